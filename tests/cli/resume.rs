//! A run killed half-way keeps every finished entry, and `--resume` finishes
//! it without redoing them.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use harness::results::RunResult;
use harness::train::checkpoint;

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

/// `--resume` reads the checkpoint folder as a hostile one: the newest
/// checkpoint renamed to a later step, a FIFO in place of its model file,
/// its folder a symbolic link to one outside, or its manifest edited, each
/// fails the entry at once, recorded with a message naming the checkpoint
/// folder and the field, and the run goes on with the next entry.
#[test]
fn a_hostile_checkpoint_fails_its_entry_by_name_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let strategy = "\n[[strategy]]\nname = \"every1\"\ncheckpoint = \"every-n\"\ncheckpoint_config = { every = 1, keep = 3 }\n";
    let w = tiny_gpt("a", 100_000, "") + &tiny_gpt("b", 5, "") + &plugin_table("every-n", "every-n.wasm") + strategy;
    let s = write(dir.path(), "s.toml", &suite("hostile", "", &w));
    type Sabotage = fn(&Path, &Path) -> PathBuf;
    let cases: [(&str, Sabotage, &str, &str); 4] = [
        (
            "renamed",
            |newest, _| {
                let renamed = newest.with_file_name("step-99999999");
                std::fs::rename(newest, &renamed).unwrap();
                renamed
            },
            "position.step",
            "but the folder is named for step 99999999",
        ),
        (
            "fifo",
            |newest, _| {
                std::fs::remove_file(newest.join("model.safetensors")).unwrap();
                assert!(std::process::Command::new("mkfifo").arg(newest.join("model.safetensors")).status().unwrap().success());
                newest.to_path_buf()
            },
            "model.safetensors",
            "is a FIFO, not a regular file",
        ),
        (
            "symlinked",
            |newest, outside| {
                let away = outside.join("elsewhere");
                std::fs::rename(newest, &away).unwrap();
                std::os::unix::fs::symlink(&away, newest).unwrap();
                newest.to_path_buf()
            },
            "the folder",
            "is a symbolic link, not a directory",
        ),
        (
            "edited",
            |newest, _| {
                let m = newest.join("checkpoint.json");
                let text = std::fs::read_to_string(&m).unwrap();
                assert!(text.contains("\"micro_batch\": 8,"), "{text}");
                std::fs::write(&m, text.replace("\"micro_batch\": 8,", "\"micro_batch\": 4000000000,")).unwrap();
                newest.to_path_buf()
            },
            "sha256",
            "changed after it was written",
        ),
    ];
    for (case, sabotage, field, why) in cases {
        let out = dir.path().join(format!("{case}.json"));
        let root = out.with_extension("checkpoints").join("a_every1_r0");
        let mut child = harness(dir.path()).args(["run", "-q"]).arg(&s).arg("--out").arg(&out).spawn().unwrap();
        let t0 = Instant::now();
        while checkpoint::list(&root).last().is_none_or(|c| c.0 < 3) {
            assert!(t0.elapsed() < Duration::from_secs(120), "{case}: no checkpoint appeared in {}", root.display());
            assert!(child.try_wait().unwrap().is_none(), "{case}: harness finished before it could be killed");
            std::thread::sleep(Duration::from_millis(2));
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let newest = checkpoint::list(&root).last().unwrap().1.clone();
        let refused = sabotage(&newest, dir.path());

        let mut child = harness(dir.path()).args(["run", "-q", "--resume"]).arg(&s).arg("--out").arg(&out).spawn().unwrap();
        let t0 = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if t0.elapsed() > Duration::from_secs(120) {
                child.kill().unwrap();
                panic!("{case}: the resumed run hung");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(status.code(), Some(harness::cli::exit::ENTRY_FAILED), "{case}");
        let r = results(&out);
        assert_eq!(r["complete"], true, "{case}");
        let a = entry(&r, "a/every1/r0");
        assert_eq!(a["status"], "failed", "{case}: {a}");
        let e = a["error"].as_str().unwrap();
        assert!(e.contains(&format!("checkpoint {} refused: `{field}`", refused.display())) && e.contains(why), "{case}: {e}");
        assert_eq!(entry(&r, "b/every1/r0")["status"], "ok", "{case}: the run did not go on");
    }
}

/// Ctrl-C (SIGINT) says where the run stopped and what `--resume` does,
/// and ends it as SIGINT does (130 in a shell); the resumed run says which
/// entry goes on from which step; the finished run leaves no checkpoint
/// folder, and its files have the permissions a plain write gives.
#[test]
fn ctrl_c_and_resume_say_what_happened_and_leave_nothing_empty() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let strategy = "\n[[strategy]]\nname = \"every5\"\ncheckpoint = \"every-n\"\ncheckpoint_config = { every = 5, keep = 1 }\n";
    let w = tiny_gpt("a", 300, "") + &tiny_gpt("b", 3, "") + &plugin_table("every-n", "every-n.wasm") + strategy;
    let s = write(dir.path(), "s.toml", &suite("int", "", &w));
    let out = dir.path().join("r.json");
    let root = out.with_extension("checkpoints").join("a_every5_r0");
    let run = || harness(dir.path()).args(["run"]).arg(&s).arg("--out").arg(&out).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let mut child = run();
    let t0 = Instant::now();
    while checkpoint::list(&root).last().is_none_or(|c| c.0 < 10) {
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint appeared in {}", root.display());
        assert!(child.try_wait().unwrap().is_none(), "harness finished before it could be interrupted");
        std::thread::sleep(Duration::from_millis(2));
    }
    let pid = child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.signal(), Some(2), "ended by SIGINT (2), as without a handler: {:?}", o.status);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("harness: interrupted at step ") && err.contains(" of 300 of entry a/every5/r0"), "{err}");
    assert!(err.contains("`--resume` continues: this entry from its newest checkpoint"), "{err}");

    let o = run_ok(harness(dir.path()).args(["run", "--resume"]).arg(&s).arg("--out").arg(&out));
    let err = String::from_utf8_lossy(&o.stderr);
    let r = results(&out);
    let from = entry(&r, "a/every5/r0")["metrics"]["resilience"]["resumed_from"].as_u64().expect("resumed from a checkpoint");
    assert!(err.contains(&format!("resumed entry a/every5/r0 from step {from} (its newest checkpoint)")), "{err}");
    assert!(!out.with_extension("checkpoints").exists(), "an empty checkpoint folder was left behind");
    let plain = dir.path().join("plain");
    std::fs::write(&plain, b"x").unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&out), mode(&plain), "the result file");
    assert_eq!(mode(&out.with_extension("log")), mode(&plain), "the run's log");
}
