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
    assert_eq!(String::from_utf8_lossy(&o.stdout), "suite.toml: ok (1 workload, 1 strategy, 1 entry)\n");
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
    // One process for all of them (`validate` takes several suites).
    let out = harness(&root).arg("validate").args(&suites).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "a suite does not validate (plugins built? scripts/build-plugins.sh):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for s in &suites {
        assert!(stdout.contains(&format!("{}: ok (", s.display())), "{} not reported valid:\n{stdout}", s.display());
    }
}

#[test]
fn validate_checks_every_suite_it_is_given_and_fails_if_any_is_invalid() {
    let dir = tempfile::tempdir().unwrap();
    let good = repo_root().join("suites/cpu.toml");
    let bad = write(dir.path(), "bad.toml", "[suite]\nname = \"bad\"\nrepeats = 0\n");
    let out = harness(dir.path()).arg("validate").arg(&bad).arg(&good).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("bad.toml:"), "the invalid suite is named with its line: {stderr}");
    assert!(stdout.contains("cpu.toml: ok ("), "the suite after it is still checked: {stdout}");
}

/// `harness ARGS` in `dir`, killed if it has not ended within 30 s (a
/// hang is the failure); its exit code and stderr.
fn within_30_s(dir: &std::path::Path, args: &[&str]) -> (Option<i32>, String) {
    use std::io::Read;
    let mut child = harness(dir).args(args).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > std::time::Duration::from_secs(30) {
            child.kill().unwrap();
            panic!("harness {args:?} hung");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (status.code(), err)
}

#[test]
fn hostile_suites_are_refused_with_exit_2_at_their_line_before_anything_runs() {
    // Issue 38: each of these aborted, panicked (exit 4), hung or wrote
    // outside --results-dir.
    let dir = tempfile::tempdir().unwrap();
    let inside = dir.path().join("inside");
    std::fs::create_dir(&inside).unwrap();
    let fifo = dir.path().join("plugin.fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let plugin = |path: &str| format!("{GOOD}\n[[plugin]]\nname = \"p\"\npath = \"{path}\"\n");
    for (text, says) in [
        (GOOD.replace("name = \"s\"", "name = \"../escape\""), "suite.toml:2:8: the suite name `../escape` is not a plain name"),
        (
            GOOD.replace("name = \"s\"", "name = \"s\"\nrepeats = 4000000000"),
            "suite.toml:3:11: `repeats` = 4000000000 is above its bound of 1000",
        ),
        (GOOD.replace("batch = 8", "batch = 4294967295"), "`batch` = 4294967295 is above its bound of 65536"),
        (GOOD.replace("seq_len = 32", "seq_len = 2000000000"), "`seq_len` = 2000000000 is above its bound of 65536"),
        (GOOD.replace("device = \"cpu\"", "device = \"cpu\"\nworld_size = 20000"), "`world_size` = 20000 is above the bound of 256 ranks"),
        (
            GOOD.replace("device = \"cpu\"", "device = \"cpu\"\ncollective_timeout_s = 1e300"),
            "`collective_timeout_s` = 1e300 is above its bound",
        ),
        (plugin("/dev/zero"), "suite.toml:20:8: plugin `p`: /dev/zero is a character device, not a regular file"),
        (plugin("plugin.fifo"), "is a FIFO (named pipe), not a regular file"),
    ] {
        write(dir.path(), "suite.toml", &text);
        for cmd in ["validate", "run"] {
            let args =
                if cmd == "run" { vec!["run", "suite.toml", "--results-dir", "inside/results"] } else { vec!["validate", "suite.toml"] };
            let (code, err) = within_30_s(dir.path(), &args);
            assert_eq!(code, Some(harness::cli::exit::INVALID_SUITE), "{cmd} {says}: {err}");
            assert!(err.contains(says) && err.contains("hint:"), "{cmd}: expected {says:?} in:\n{err}");
        }
    }
    // Nothing was written, inside --results-dir or beside it.
    assert!(!inside.join("results").exists());
    let mut left: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    assert_eq!(left, ["inside", "plugin.fifo", "suite.toml"]);
    // Entering /dev/zero as a plugin is refused at once too.
    let (code, err) = within_30_s(&repo_root(), &["plugin", "inspect", "/dev/zero"]);
    assert_ne!(code, Some(0), "{err}");
    assert!(err.contains("/dev/zero is a character device, not a regular file"), "{err}");
}
