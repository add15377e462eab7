//! Standard suites: a plugin entered with `--plugin KIND=PATH` runs in the
//! tracks of its kind next to their baselines, and the result records what
//! was entered and whether the run is official.

use crate::{artifact, harness, repo_root, results, write};

#[test]
fn an_entered_plugin_runs_next_to_the_track_baseline_and_the_run_is_official() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.json");
    let suite = repo_root().join("suites/cpu-standard.toml");
    let run = harness(dir.path())
        .arg("run")
        .arg(&suite)
        .args(["--track", "batch-size", "--plugin"])
        .arg(format!("batch-policy={}", artifact("memory-growth.wasm").display()))
        .args(["--plugin-config", "max=32", "--out"])
        .arg(&out)
        .arg("-q")
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let r = results(&out);
    let ids: Vec<&str> = r["entries"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap()).collect();
    for rep in 0..3 {
        for st in ["fixed", "submission-batch-size"] {
            assert!(ids.contains(&format!("mlp-memory-bound/{st}/r{rep}").as_str()), "{ids:?}");
        }
    }
    assert_eq!(ids.len(), 6, "only the batch-size track ran: {ids:?}");
    // Every entry stopped at the evaluation that reached its target, and
    // rank 0's evaluation decided: each rank evaluates its own held-out
    // batches, and when any rank's could stop the run, fixed/r2 stopped at
    // step 85 on rank 1's evaluation while rank 0's (the one recorded) was
    // still above the target.
    for e in r["entries"].as_array().unwrap() {
        let m = &e["metrics"];
        assert!(m["steps"].as_u64().unwrap() < 150, "{}: stopped before its 150 steps", e["id"]);
        assert_eq!(m["steps"], m["steps_to_target"], "{}", e["id"]);
        let last = m["eval_curve"].as_array().unwrap().last().unwrap();
        assert!(last[2].as_f64().unwrap() <= m["target_loss"].as_f64().unwrap(), "{}", e["id"]);
    }
    let s = &r["submission"];
    assert_eq!(s["tracks"], serde_json::json!(["batch-size"]));
    assert_eq!(s["released_suite"], true);
    assert_eq!(s["unofficial"], serde_json::json!([]), "a released CPU suite on the CPU is official");
    let p = &s["entered"][0];
    assert_eq!(p["name"], "memory-growth");
    assert_eq!(p["config"], "max = 32\n");
    assert_eq!(p["sha256"].as_str().unwrap().len(), 64);
    // The entered policy chose the batch (memory-growth starts at its
    // `max`); the baseline kept the workload's 4.
    let first =
        |id: &str| r["entries"].as_array().unwrap().iter().find(|e| e["id"] == id).unwrap()["metrics"]["batch_changes"][0][1].clone();
    assert_eq!(first("mlp-memory-bound/submission-batch-size/r0"), 32);
    assert_eq!(first("mlp-memory-bound/fixed/r0"), 4);
}

#[test]
fn a_plugin_of_the_wrong_kind_or_an_edited_suite_is_caught_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let suite = repo_root().join("suites/cpu-standard.toml");
    // Declared as a batch policy, but the artifact is a compressor.
    let run = harness(dir.path())
        .arg("run")
        .arg(&suite)
        .arg("--plugin")
        .arg(format!("batch-policy={}", artifact("topk.wasm").display()))
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2));
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("the plugin is a compressor, not a batch-policy"), "{err}");
    // A batch policy entered into the checkpointing track.
    let run = harness(dir.path())
        .arg("run")
        .arg(&suite)
        .args(["--track", "checkpointing", "--plugin"])
        .arg(format!("batch-policy={}", artifact("memory-growth.wasm").display()))
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("no track selected here takes one"));
    // A suite without tracks takes no entries.
    let run = harness(dir.path())
        .arg("run")
        .arg(repo_root().join("suites/cpu.toml"))
        .arg("--plugin")
        .arg(format!("compressor={}", artifact("topk.wasm").display()))
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("has no tracks"));
    // An edited copy runs, labelled unofficial with the reason.
    let text = std::fs::read_to_string(&suite).unwrap().replace("steps = 150", "steps = 20");
    let edited = write(dir.path(), "edited.toml", &text);
    let out = dir.path().join("e.json");
    let run = harness(dir.path()).arg("run").arg(&edited).args(["--track", "checkpointing", "--out"]).arg(&out).arg("-q").output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let r = results(&out);
    let why = r["submission"]["unofficial"].as_array().unwrap();
    assert!(why.iter().any(|w| w.as_str().unwrap().contains("is not a released standard suite")), "{why:?}");
}

#[test]
fn a_misspelt_plugin_config_key_is_refused_before_anything_trains_naming_the_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.json");
    // Entered without --track: it would run in both compression tracks,
    // after their baselines; the key is checked once, before any of them.
    let run = harness(dir.path())
        .arg("run")
        .arg(repo_root().join("suites/cpu-standard.toml"))
        .arg("--plugin")
        .arg(format!("compressor={}", artifact("topk.wasm").display()))
        .args(["--plugin-config", "ratoi=0.1", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2), "the usage code");
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("--plugin-config") && err.contains("unknown config key `ratoi` (known: ratio, per_layer)"), "{err}");
    assert!(err.contains("plugin `topk "), "named by its own name: {err}");
    assert!(!err.contains("`submission"), "not by the suite's name for it: {err}");
    assert_eq!(err.matches("unknown config key").count(), 1, "once, however many tracks: {err}");
    assert!(!out.exists(), "nothing ran, nothing was written");
}

/// Issue 60: a CPU-class bundle reproduced bit for bit only on a CPU of its
/// own instruction set (libtorch held to AVX2, as on an AVX2-only EPYC, 6
/// evaluations differed), and its fingerprint did not say which kernels
/// ran. A run of the CPU standard suite holds libtorch's CPU kernels to
/// the class's level itself, records them, and is official; a caller's
/// other value is overridden with a note, and other suites are left as
/// they are. (The shared honest run is checked, and the other runs stop
/// before training: their result file exists already.)
#[test]
fn a_cpu_class_run_holds_libtorchs_cpu_kernels_to_the_class_level_and_its_fingerprint_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    crate::submit::honest_run(tmp.path());
    let r = results(&tmp.path().join("r.json"));
    let pinned = serde_json::json!({
        "aten": "avx2",
        "variables": { "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE" },
        "avx2_fma": true,
    });
    assert_eq!(r["machine"]["cpu_kernels"], pinned, "(this test needs an x86-64 CPU with AVX2 and FMA)");
    assert_eq!(r["submission"]["unofficial"], serde_json::json!([]));

    let held = |suite: &str| {
        let out = harness(tmp.path())
            .arg("run")
            .arg(repo_root().join(suite))
            .args(["--out", "r.json", "-q"])
            .env("ATEN_CPU_CAPABILITY", "avx512")
            .env_remove("MKL_CBWR")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(harness::cli::exit::ERROR), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = held("suites/cpu-standard.toml");
    assert!(
        err.contains("harness: ATEN_CPU_CAPABILITY=avx512 overridden with ATEN_CPU_CAPABILITY=avx2: a CPU-class suite holds libtorch's CPU kernels to the class's level"),
        "{err}"
    );
    assert_eq!(err.matches("overridden").count(), 1, "an unset variable is set without a note, and the pin applies once: {err}");
    assert!(err.contains("r.json already exists"), "the process started again runs the command line: {err}");
    let err = held("suites/cpu.toml");
    assert!(!err.contains("overridden") && err.contains("r.json already exists"), "suites outside the CPU class are not held: {err}");
}

/// Issue 63: `--gpus 4` on a suite of the 2-GPU division printed `error:
/// error: ...:33:8: world_size 4 is not one of the divisions [2]`. It says
/// once which divisions the suite has, before anything trains.
#[test]
fn gpus_outside_the_suites_divisions_are_refused_once_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let out = harness(dir.path()).arg("run").arg(repo_root().join("suites/cpu-standard.toml")).args(["--gpus", "4"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(harness::cli::exit::INVALID_SUITE), "{err}");
    assert!(err.starts_with("error: --gpus 4: ") && !err.contains("error: error"), "{err}");
    assert!(err.contains("is run on [2] ranks (its divisions, `[suite.hardware] gpus`)"), "{err}");
    assert!(!dir.path().join("results").exists(), "nothing ran");
}

/// A batch policy entered on the 2 thread ranks of the CPU batch-size track
/// with the given `--plugin-config`: the run's exit status and result.
fn batch_track(dir: &std::path::Path, config: &str) -> (std::process::Output, serde_json::Value) {
    let out = dir.join(format!("{}.json", config.replace('=', "-")));
    let run = harness(dir)
        .arg("run")
        .arg(repo_root().join("suites/cpu-standard.toml"))
        .args(["--track", "batch-size", "--plugin"])
        .arg(format!("batch-policy={}", artifact("libmisbehave-batch.so").display()))
        .args(["--plugin-config", config, "--out"])
        .arg(&out)
        .arg("-q")
        .output()
        .unwrap();
    let r = results(&out);
    (run, r)
}

#[test]
fn a_loss_driven_batch_policy_agrees_across_ranks_and_a_divergent_one_is_named() {
    let dir = tempfile::tempdir().unwrap();
    // Told each rank's own loss, this policy doubled its micro-batch at
    // different steps on the two ranks, and an all-reduce found tensors of
    // different sizes (1 of 3 repeats failed so before the telemetry was
    // reduced). Told the ranks' mean loss, every repeat trains, and grows.
    let (run, r) = batch_track(dir.path(), "mode=loss");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    for rep in 0..3 {
        let e = crate::entry(&r, &format!("mlp-memory-bound/submission-batch-size/r{rep}"));
        assert_eq!(e["status"], "ok", "{e}");
        let changes = e["metrics"]["batch_changes"].as_array().unwrap();
        assert!(changes.len() > 1, "the loss-driven policy changed its batch: {changes:?}");
    }
    // A policy that decides from its rank's own state fails its entry
    // before the first step, naming itself and each rank's decision.
    let (run, r) = batch_track(dir.path(), "mode=diverge");
    assert_eq!(run.status.code(), Some(1), "{}", String::from_utf8_lossy(&run.stderr));
    for rep in 0..3 {
        let e = crate::entry(&r, &format!("mlp-memory-bound/submission-batch-size/r{rep}"));
        let error = e["error"].to_string();
        assert!(error.contains("the batch policy `submission` decided differently on the ranks before the first step"), "{error}");
        assert!(error.contains("rank 0: micro-batch ") && error.contains("rank 1: micro-batch "), "{error}");
    }
    // The baseline is untouched.
    assert_eq!(crate::entry(&r, "mlp-memory-bound/fixed/r0")["status"], "ok");
}
