//! A run killed half-way keeps every finished entry, and `--resume` finishes
//! it without redoing them.

use std::time::{Duration, Instant};

use harness::results::RunResult;

use crate::*;

#[test]
fn resume_after_sigkill_keeps_finished_entries() {
    let dir = tempfile::tempdir().unwrap();
    let w = tiny_gpt("a", 40, "") + &tiny_gpt("b", 400, "") + &tiny_gpt("c", 20, "");
    let s = write(dir.path(), "s.toml", &suite("kill", "", &w));
    let out = dir.path().join("results/kill.json");
    let mut child = harness(dir.path()).args(["run", "-q"]).arg(&s).arg("--out").arg(&out).spawn().unwrap();

    // Wait until the first entry is on disk, then SIGKILL during the second.
    let t0 = Instant::now();
    let first = loop {
        assert!(t0.elapsed() < Duration::from_secs(120), "the first entry never finished");
        assert!(child.try_wait().unwrap().is_none(), "harness exited before it was killed");
        if let Ok(r) = RunResult::read(&out) {
            if !r.entries.is_empty() {
                break r.entries[0].clone();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    let killed = RunResult::read(&out).expect("the result file is whole after SIGKILL");
    assert!(!killed.complete);
    assert_eq!(killed.entries.len(), 1, "the killed run should hold exactly the first entry");
    // The result and the run's log, and nothing else.
    let mut leftovers: Vec<_> =
        std::fs::read_dir(out.parent().unwrap()).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    leftovers.sort();
    let stem = out.file_stem().unwrap().to_string_lossy();
    assert_eq!(leftovers, [format!("{stem}.json"), format!("{stem}.log")], "temporary files left behind");

    // --resume without --out finds the newest incomplete result of the suite.
    let o = run_ok(harness(dir.path()).args(["run", "-q", "--resume"]).arg(&s));
    assert!(String::from_utf8_lossy(&o.stdout).contains("kill.json"));
    let done = RunResult::read(&out).unwrap();
    assert!(done.complete);
    let ids: Vec<_> = done.entries.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["a/baseline/r0", "b/baseline/r0", "c/baseline/r0"]);
    assert_eq!(done.entries[0], first, "a finished entry was run again");
    assert_eq!(done.started_at, killed.started_at);
}

#[test]
fn resume_refuses_a_changed_suite() {
    let dir = tempfile::tempdir().unwrap();
    let s = write(dir.path(), "s.toml", &suite("ch", "", &tiny_gpt("a", 3, "")));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]));
    write(dir.path(), "s.toml", &suite("ch", "", &tiny_gpt("a", 4, "")));
    let out = harness(dir.path()).args(["run", "-q", "--resume", "--out", "r.json"]).arg(&s).output().unwrap();
    assert_eq!(out.status.code(), Some(harness::cli::exit::ERROR));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("different version of") && err.contains("hint:"), "{err}");
}

#[test]
fn an_existing_result_is_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let s = write(dir.path(), "s.toml", &suite("ow", "", &tiny_gpt("a", 3, "")));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]));
    let before = std::fs::read(dir.path().join("r.json")).unwrap();
    let out = harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(harness::cli::exit::ERROR));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already exists"));
    assert_eq!(std::fs::read(dir.path().join("r.json")).unwrap(), before);
}
