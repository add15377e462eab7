//! Bad suites: every problem is reported with file:line:column, the source
//! line and a hint, and `validate` exits with INVALID_SUITE.

use crate::*;

const GOOD: &str = r#"[suite]
name = "s"
device = "cpu"

[[workload]]
name = "w"
model = { kind = "gpt", preset = "tiny" }
data = { kind = "synthetic", vocab = 64 }
batch = 8
seq_len = 32
steps = 10
optimizer = { kind = "adamw", lr = 1e-3 }

[[strategy]]
name = "base"
baseline = true
"#;

/// `harness validate` on `text`; returns stderr, asserting the exit code.
fn validate(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "suite.toml", text);
    let out = harness(dir.path()).args(["validate", "suite.toml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(harness::cli::exit::INVALID_SUITE), "{}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn the_good_suite_validates() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "suite.toml", GOOD);
    let o = run_ok(harness(dir.path()).args(["validate", "suite.toml"]));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "suite.toml: ok (1 workloads, 1 strategies, 1 entries)\n");
}

#[test]
fn misspelt_key() {
    insta::assert_snapshot!(validate(&GOOD.replace("steps = 10", "stpes = 10")));
}

#[test]
fn wrong_type() {
    insta::assert_snapshot!(validate(&GOOD.replace("batch = 8", "batch = \"8\"")));
}

#[test]
fn unknown_enum_value() {
    insta::assert_snapshot!(validate(&GOOD.replace("[[workload]]\n", "[[workload]]\nprecision = \"fp8\"\n")));
}

#[test]
fn toml_syntax_error() {
    insta::assert_snapshot!(validate(&GOOD.replace("seq_len = 32", "seq_len = = 32")));
}

#[test]
fn impossible_values_are_all_reported_at_once() {
    let bad = GOOD.replace("batch = 8", "batch = 0").replace("lr = 1e-3", "lr = -1.0").replace("preset = \"tiny\"", "preset = \"huge\"");
    insta::assert_snapshot!(validate(&bad));
}

#[test]
fn strategy_names_a_missing_workload_and_an_unknown_compressor() {
    let bad = GOOD.replace("baseline = true", "baseline = true\ncompressor = \"topk\"\nworkloads = [\"nope\"]");
    insta::assert_snapshot!(validate(&bad));
}

#[test]
fn zero_needs_ranks_and_exists_only_up_to_stage_two() {
    // world_size is 1 here; stage 3 does not exist.
    let bad = GOOD.replace("baseline = true", "baseline = true\nzero = 2") + "\n[[strategy]]\nname = \"z3\"\nzero = 3\n";
    insta::assert_snapshot!(validate(&bad));
}

#[test]
fn missing_run_length() {
    insta::assert_snapshot!(validate(&GOOD.replace("steps = 10\n", "")));
}

#[test]
fn missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = harness(dir.path()).args(["validate", "nope.toml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(harness::cli::exit::INVALID_SUITE));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nope.toml: cannot read the suite") && err.contains("hint:"), "{err}");
}

#[test]
fn run_refuses_an_invalid_suite_before_touching_results() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "suite.toml", &GOOD.replace("batch = 8", "batch = 0"));
    let out = harness(dir.path()).args(["run", "suite.toml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(harness::cli::exit::INVALID_SUITE));
    assert!(!dir.path().join("results").exists());
}

#[test]
fn every_suite_in_the_repository_validates() {
    // The GPU suites too: validation needs no GPU, and a suite that no
    // longer parses would otherwise be found only on a lent machine.
    let root = repo_root();
    let mut suites: Vec<std::path::PathBuf> = Vec::new();
    for dir in ["suites", "suites/standard/1.0", "suites/standard/1.1"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "toml") {
                suites.push(p);
            }
        }
    }
    assert!(suites.len() > 20, "{suites:?}");
    for s in suites {
        let out = harness(&root).arg("validate").arg(&s).output().unwrap();
        assert!(out.status.success(), "{}: {}", s.display(), String::from_utf8_lossy(&out.stderr));
    }
}
