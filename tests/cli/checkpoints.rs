//! Checkpoints and injected failures end to end: a failure sends training
//! back to the last checkpoint, and the resumed run repeats the uninterrupted
//! run's losses bit for bit (model, optimizer, plugin state, data position);
//! checkpoint writes killed at any instant never leave a torn checkpoint.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use harness::train::checkpoint;

use crate::{artifact, harness, plugin_table, run_ok, write};

fn results(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).expect("result file")).expect("result JSON")
}

fn entry<'a>(r: &'a serde_json::Value, strategy: &str) -> &'a serde_json::Value {
    r["entries"].as_array().unwrap().iter().find(|e| e["strategy"] == strategy).unwrap_or_else(|| panic!("no entry of {strategy}"))
}

/// Two ranks, top-k with error feedback (plugin state), every-n checkpoints
/// keeping 2, plain and compressed, and a restart from scratch without any.
fn suite(faults: &str) -> String {
    format!(
        r#"[suite]
name = "ckpt"
device = "cpu"
seed = 7
world_size = 2
warmup_steps = 2

[[workload]]
name = "gpt"
model = {{ kind = "gpt", preset = "tiny" }}
data = {{ kind = "synthetic", vocab = 64, branching = 2 }}
batch = 8
seq_len = 32
steps = 30
optimizer = {{ kind = "adamw", lr = 3e-3, betas = [0.9, 0.95] }}
eval_every = 10
eval_batches = 2
target_loss = 100.0
{faults}

{}{}{}
[[strategy]]
name = "every5"
compressor = "topk"
compressor_config = {{ ratio = 0.1 }}
checkpoint = "every-n"
checkpoint_config = {{ every = 5, keep = 2 }}

[[strategy]]
name = "every5-zstd"
compressor = "topk"
compressor_config = {{ ratio = 0.1 }}
checkpoint = "every-n-native"
checkpoint_config = {{ every = 5, keep = 2 }}
checkpoint_compress = true

[[strategy]]
name = "every5-sync"
compressor = "topk"
compressor_config = {{ ratio = 0.1 }}
checkpoint = "every-n"
checkpoint_config = {{ every = 5, keep = 2 }}
checkpoint_async = false

[[strategy]]
name = "restart"
compressor = "topk"
compressor_config = {{ ratio = 0.1 }}
"#,
        plugin_table("topk", "topk.wasm"),
        plugin_table("every-n", "every-n.wasm"),
        plugin_table("every-n-native", "libevery-n.so"),
    )
}

fn losses(e: &serde_json::Value) -> Vec<(u64, f64)> {
    e["metrics"]["loss_curve"].as_array().unwrap().iter().map(|p| (p[0].as_u64().unwrap(), p[2].as_f64().unwrap())).collect()
}

#[test]
fn a_failure_goes_back_to_the_last_checkpoint_and_repeats_the_losses_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let clean = write(dir.path(), "clean.toml", &suite(""));
    let faulty = write(dir.path(), "faulty.toml", &suite("faults = { at_steps = [13, 27] }"));
    let (a, b) = (dir.path().join("clean.json"), dir.path().join("faulty.json"));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&clean).arg("--out").arg(&a));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&faulty).arg("--out").arg(&b));
    let (a, b) = (results(&a), results(&b));
    for s in ["every5", "every5-zstd", "every5-sync", "restart"] {
        let (x, y) = (entry(&a, s), entry(&b, s));
        assert_eq!(y["status"], "ok", "{s}: {}", y["error"]);
        assert_eq!(losses(x).len(), 30, "{s}");
        assert_eq!(losses(x), losses(y), "{s}: the resumed run's losses differ from the uninterrupted run's");
        assert_eq!(x["metrics"]["final_eval_loss"], y["metrics"]["final_eval_loss"], "{s}");
        assert_eq!(x["metrics"]["eval_curve"].as_array().unwrap().len(), y["metrics"]["eval_curve"].as_array().unwrap().len());

        let r = &y["metrics"]["resilience"];
        let failures: Vec<(u64, u64)> =
            r["failures"].as_array().unwrap().iter().map(|f| (f["step"].as_u64().unwrap(), f["restored_to"].as_u64().unwrap())).collect();
        if s == "restart" {
            // No checkpoints: each failure starts over.
            assert_eq!(failures, vec![(13, 0), (27, 0)]);
            assert_eq!(r["steps_executed"], 30 + 13 + 27);
            assert_eq!(y["metrics"]["checkpoints_written"], 0);
            // The target (reached at the first eval, step 10) stays reached
            // when the failure at step 13 throws that work away: a run to a
            // target would have stopped at step 10.
            assert_eq!(y["metrics"]["steps_to_target"], 10);
            let ttt = y["metrics"]["time_to_target_s"].as_f64().unwrap();
            let t13 = r["failures"][0]["lost_s"].as_f64().unwrap();
            assert!(ttt < t13, "time to target {ttt} s is after the failure at step 13 ({t13} s)");
        } else {
            assert_eq!(failures, vec![(13, 10), (27, 25)], "{s}");
            // Asynchronous checkpoints restore from host memory, synchronous
            // ones from disk.
            let from = if s == "every5-sync" { "disk" } else { "memory" };
            assert!(r["failures"].as_array().unwrap().iter().all(|f| f["restored_from"] == from), "{s}: {}", r["failures"]);
            assert_eq!(r["checkpoint_mode"], if s == "every5-sync" { "sync" } else { "async" });
            assert_eq!(r["steps_executed"], 30 + 3 + 2, "{s}");
            let written: Vec<u64> = r["checkpoints"].as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
            assert_eq!(written, vec![5, 10, 15, 20, 25, 30], "{s}");
            let records = r["checkpoints"].as_array().unwrap();
            assert!(records.iter().all(|c| c["cost_s"].as_f64().unwrap() > 0.0 && c["bytes"].as_u64().unwrap() > 0));
            if s == "every5-sync" {
                // keep = 2: after saving 15 the policy deleted 5, and so on.
                assert_eq!(records[2]["deleted"], serde_json::json!([5]), "{s}");
                assert!(records.iter().all(|c| c["persisted"] == true));
            } else {
                // Persists overlap training, so which snapshots reached disk
                // depends on timing (a snapshot waiting for the writer gives
                // way to a newer one); deletions only ever name checkpoints
                // that had been persisted before.
                let mut durable = Vec::new();
                for c in records {
                    for d in c["deleted"].as_array().unwrap() {
                        assert!(durable.contains(&d.as_u64().unwrap()), "{s}: deleted {d}, never persisted before: {records:?}");
                    }
                    if c["persisted"] == true {
                        durable.push(c["step"].as_u64().unwrap());
                    }
                }
                assert!(!durable.is_empty(), "{s}: nothing was persisted");
            }
            // The plugin saw both failures in its history: the record names them.
            assert!(r["time_lost_s"].as_f64().unwrap() > 0.0);
        }
        let goodput = y["metrics"]["goodput_steps_per_s"].as_f64().unwrap();
        let wall = y["metrics"]["train_time_s"].as_f64().unwrap();
        assert!((goodput - 30.0 / wall).abs() < 1e-9 * goodput.max(1.0), "goodput {goodput} != 30 / {wall}");
    }
    // Compressed checkpoints are smaller (the same state, zstd).
    let bytes = |s: &str| entry(&b, s)["metrics"]["resilience"]["checkpoints"][0]["bytes"].as_u64().unwrap();
    assert!(bytes("every5-zstd") < bytes("every5"), "compressed {} vs {}", bytes("every5-zstd"), bytes("every5"));
    // A finished entry leaves no checkpoints behind.
    assert!(!dir.path().join("faulty.checkpoints").join("gpt_every5_r0").exists());
}

#[test]
fn checkpoint_writes_killed_at_any_instant_never_leave_a_torn_checkpoint_and_the_run_resumes() {
    let dir = tempfile::tempdir().unwrap();
    // One rank (quick to start), a checkpoint persisted at every step, so
    // that most kills land in a persist (the background writer) or in the
    // snapshot before it.
    let s = format!(
        r#"[suite]
name = "kill"
device = "cpu"
seed = 3

[[workload]]
name = "gpt"
model = {{ kind = "gpt", preset = "tiny" }}
data = {{ kind = "synthetic", vocab = 64, branching = 2 }}
batch = 4
seq_len = 16
steps = 100000
optimizer = {{ kind = "adamw", lr = 3e-3 }}

[[plugin]]
name = "every-n"
path = "{}"

[[strategy]]
name = "every1"
checkpoint = "every-n"
checkpoint_config = {{ every = 1, keep = 3 }}
"#,
        artifact("every-n.wasm").display()
    );
    let suite = write(dir.path(), "kill.toml", &s);
    let out = dir.path().join("kill.json");
    let root = checkpoint_root(&out);
    let (mut kills, mut seen, mut resumed) = (0, 0usize, 0);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    // 40 kills: each round starts the run (resuming after the first) and
    // kills it at a pseudo-random 0..150 ms once a checkpoint newer than
    // the last round's is on disk; so each round also shows the run
    // resumed from what the previous kill left. (110 kills until
    // 2026-11-29, none torn; each round costs a process start, about
    // 0.4 s of libtorch's initialisation, on CI's 2 cores.)
    let mut newest = 0u64;
    for round in 0..40 {
        let mut cmd = harness(dir.path());
        cmd.args(["run", "-q"]).arg(&suite).arg("--out").arg(&out);
        if round > 0 {
            cmd.arg("--resume");
        }
        let mut child = cmd.spawn().unwrap();
        let t0 = Instant::now();
        while checkpoint::list(&root).last().is_none_or(|c| c.0 <= newest) {
            assert!(t0.elapsed() < Duration::from_secs(120), "round {round}: no new checkpoint appeared in {}", root.display());
            assert!(child.try_wait().unwrap().is_none(), "round {round}: harness exited early (it could not resume?)");
            std::thread::sleep(Duration::from_millis(2));
        }
        if round > 0 {
            resumed += 1;
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_millis(rng % 150));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        kills += 1;
        let all = checkpoint::list(&root);
        assert!(!all.is_empty(), "round {round}: the checkpoints are gone");
        for (step, path) in &all {
            let at = checkpoint::verify(path).unwrap_or_else(|e| panic!("round {round}: torn checkpoint {}: {e:#}", path.display()));
            assert_eq!(at.step, *step);
        }
        newest = all.last().unwrap().0;
        seen += all.len();
    }
    assert_eq!(kills, 40);
    // Every round after the first went on from the checkpoint the kill left
    // and wrote newer ones.
    assert_eq!(resumed, 39);
    assert!(seen >= 40);
}

/// The checkpoint directory of the only entry of the kill suite.
fn checkpoint_root(out: &Path) -> PathBuf {
    out.with_extension("checkpoints").join("gpt_every1_r0")
}

#[test]
fn young_daly_under_random_failures_keeps_going_and_accounts_for_the_time_lost() {
    let dir = tempfile::tempdir().unwrap();
    let s = format!(
        r#"[suite]
name = "yd"
device = "cpu"
seed = 5
world_size = 2

[[workload]]
name = "gpt"
model = {{ kind = "gpt", preset = "tiny" }}
data = {{ kind = "synthetic", vocab = 64, branching = 2 }}
batch = 8
seq_len = 32
steps = 120
optimizer = {{ kind = "adamw", lr = 3e-3 }}
eval_batches = 1
faults = {{ mtbf_s = 0.4, seed = 11 }}

[[plugin]]
name = "young-daly"
path = "{}"

[[strategy]]
name = "yd"
checkpoint = "young-daly"
checkpoint_config = {{ mtbf_s = 0.4, keep = 3 }}
checkpoint_compress = true
"#,
        artifact("young-daly.wasm").display()
    );
    let suite = write(dir.path(), "yd.toml", &s);
    let out = dir.path().join("yd.json");
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&suite).arg("--out").arg(&out));
    let r = results(&out);
    let e = &r["entries"][0];
    assert_eq!(e["status"], "ok", "{}", e["error"]);
    let m = &e["metrics"];
    assert_eq!(m["steps"], 120);
    let res = &m["resilience"];
    let failures = res["failures"].as_array().unwrap();
    let checkpoints = res["checkpoints"].as_array().unwrap();
    assert!(!failures.is_empty(), "no failure struck in {} s of training", m["train_time_s"]);
    assert!(checkpoints.len() >= 2);
    // The first save comes at step 1, to measure the cost.
    assert_eq!(checkpoints[0]["step"], 1);
    // Each failure goes back to the newest checkpoint written before it.
    for f in failures {
        let (at, back) = (f["step"].as_u64().unwrap(), f["restored_to"].as_u64().unwrap());
        assert!(back < at);
        if back > 0 {
            assert!(checkpoints.iter().any(|c| c["step"].as_u64() == Some(back)), "restored to {back}, never written");
        }
    }
    // Time lost is the sum of the lost work and the restores.
    let lost: f64 = failures.iter().map(|f| f["lost_s"].as_f64().unwrap() + f["restore_s"].as_f64().unwrap()).sum();
    assert!((res["time_lost_s"].as_f64().unwrap() - lost).abs() < 1e-9);
    // Executed steps are the useful ones plus the redone ones.
    let redone: u64 = failures.iter().map(|f| f["step"].as_u64().unwrap() - f["restored_to"].as_u64().unwrap()).sum();
    assert_eq!(res["steps_executed"].as_u64().unwrap(), 120 + redone);
    // keep = 3, counted over durable checkpoints: only persisted ones are
    // deleted, and at the end at most keep + 1 remain (a policy deletes for
    // a checkpoint at the decision after it became durable).
    let mut on_disk = std::collections::BTreeSet::new();
    for c in checkpoints {
        for d in c["deleted"].as_array().unwrap() {
            assert!(on_disk.remove(&d.as_u64().unwrap()), "deleted {d}, which was not on disk");
        }
        if c["persisted"] == true {
            on_disk.insert(c["step"].as_u64().unwrap());
        }
    }
    assert!(on_disk.len() <= 4, "{on_disk:?}");
}

#[test]
fn a_killed_run_resumes_from_its_newest_checkpoint_and_repeats_the_losses_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let text = suite("").replace("steps = 30", "steps = 300").replace("eval_every = 10", "eval_every = 100");
    // Only the plain every-n strategy, its checkpoints synchronous: the kill
    // comes once step 40's is durable, however slow the disk. (Asynchronous
    // persists can lag a whole entry behind when builds load the disk's
    // fsyncs; killing those is the torn-checkpoint test's part.)
    let cut = text.find("[[strategy]]\nname = \"every5-zstd\"").unwrap();
    let s = write(dir.path(), "s.toml", &format!("{}checkpoint_async = false\n", &text[..cut]));
    let (a, b) = (dir.path().join("a.json"), dir.path().join("b.json"));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).arg("--out").arg(&a));

    // Kill the second run once it has a checkpoint past step 40.
    let root = b.with_extension("checkpoints").join("gpt_every5_r0");
    let mut child = harness(dir.path()).args(["run", "-q"]).arg(&s).arg("--out").arg(&b).spawn().unwrap();
    let t0 = Instant::now();
    while !checkpoint::list(&root).iter().any(|c| c.0 >= 40) {
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint past step 40 appeared");
        assert!(child.try_wait().unwrap().is_none(), "harness finished before it could be killed");
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    run_ok(harness(dir.path()).args(["run", "-q", "--resume"]).arg(&s).arg("--out").arg(&b));

    let (x, y) = (results(&a), results(&b));
    let (x, y) = (entry(&x, "every5"), entry(&y, "every5"));
    assert_eq!(y["status"], "ok", "{}", y["error"]);
    let from = y["metrics"]["resilience"]["resumed_from"].as_u64().expect("the entry did not resume from a checkpoint");
    assert!(from >= 40 && from % 5 == 0, "resumed from {from}");
    let tail: Vec<(u64, f64)> = losses(x).into_iter().filter(|l| l.0 >= from).collect();
    assert_eq!(tail.len() as u64, 300 - from);
    assert_eq!(losses(y), tail, "the resumed run's losses differ from the uninterrupted run's");
    assert_eq!(x["metrics"]["final_eval_loss"], y["metrics"]["final_eval_loss"]);
    assert!(!root.exists(), "the finished entry left its checkpoints");
}

#[test]
fn a_failure_that_loses_host_memory_restores_from_disk_and_repeats_the_losses_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    // Snapshots every 5 steps, every second one persisted: 10, 20, 30 reach
    // disk, 5, 15, 25 stay in memory.
    let text = suite("");
    let cut = text.find("[[strategy]]\nname = \"every5-zstd\"").unwrap();
    let base = text[..cut]
        .replace("checkpoint_config = { every = 5, keep = 2 }", "checkpoint_config = { every = 5, keep = 2, persist_every = 2 }");
    let clean = write(dir.path(), "clean.toml", &base);
    // A failure at 13 loses nothing: back to 10 (memory). At 27 with memory
    // lost: back to 20 from disk (25 was in memory only).
    let lossy = base.replace("target_loss = 100.0\n", "target_loss = 100.0\nfaults = { at_steps = [13, 27], lose_memory = 1.0 }\n");
    let lossy = write(dir.path(), "lossy.toml", &lossy);
    let (a, b) = (dir.path().join("clean.json"), dir.path().join("lossy.json"));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&clean).arg("--out").arg(&a));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&lossy).arg("--out").arg(&b));
    let (x, y) = (results(&a), results(&b));
    let (x, y) = (entry(&x, "every5"), entry(&y, "every5"));
    assert_eq!(y["status"], "ok", "{}", y["error"]);
    assert_eq!(losses(x), losses(y), "the run restored from disk repeats different losses");
    let f = y["metrics"]["resilience"]["failures"].as_array().unwrap();
    let got: Vec<(u64, u64, &str)> =
        f.iter().map(|f| (f["step"].as_u64().unwrap(), f["restored_to"].as_u64().unwrap(), f["restored_from"].as_str().unwrap())).collect();
    // lose_memory = 1: every failure loses memory, so both come from disk.
    // At 13 the newest durable checkpoint is 10 if its persist finished in
    // the 3 steps since, else the start (a persist under way is lost too).
    assert!(got[0] == (13, 10, "disk") || got[0] == (13, 0, "start"), "{got:?}");
    assert!(got[1].0 == 27 && got[1].2 == "disk" && [10, 20].contains(&got[1].1), "{got:?}");
    assert!(f.iter().all(|f| f["lost_memory"] == true));
}

/// A checkpoint policy built against contract 0.1.0 (before the two tiers)
/// still loads and runs: every snapshot it asks for is persisted.
#[test]
fn a_checkpoint_policy_of_contract_0_1_0_still_loads_and_persists_every_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let old = crate::repo_root().join("tests/fixtures/every-n-wit-0.1.0.wasm");
    let text = suite("faults = { at_steps = [13] }").replace(&artifact("every-n.wasm").display().to_string(), &old.display().to_string());
    let cut = text.find("[[strategy]]\nname = \"every5-zstd\"").unwrap();
    let s = write(dir.path(), "old.toml", &text[..cut]);
    let v = run_ok(harness(dir.path()).arg("validate").arg(&s));
    let said = String::from_utf8_lossy(&v.stdout);
    assert!(said.contains("every-n") && said.contains("0.1.0"), "{said}");
    let out = dir.path().join("old.json");
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).arg("--out").arg(&out));
    let r = results(&out);
    let e = entry(&r, "every5");
    assert_eq!(e["status"], "ok", "{}", e["error"]);
    let res = &e["metrics"]["resilience"];
    assert_eq!(res["failures"][0]["restored_to"], 10);
    assert!(res["checkpoints"].as_array().unwrap().iter().any(|c| c["persisted"] == true));
}

/// ZeRO's parameters are gathered beside the next forward pass
/// (`HARNESS_ZERO_PREFETCH`, on by default): whatever reads them between
/// steps waits for the gathers first. Thread ranks run a gather only when
/// it is waited for, so a reader that did not wait would see another rank's
/// shard stale: the replica check would fail, an evaluation or a checkpoint
/// would differ. Two ranks, ZeRO-1 and ZeRO-2, evaluations, replica checks
/// and asynchronous checkpoints every 4 steps and a failure at step 13: the
/// same losses, evaluations and restore points, bit for bit, as with the
/// gathers right after each update.
#[test]
fn zero_gathers_beside_the_forward_pass_change_no_bit_of_training_checkpoints_or_restores() {
    let dir = tempfile::tempdir().unwrap();
    let workload = crate::tiny_gpt("gpt", 20, "grad_clip = 1.0\neval_every = 4\nfaults = { at_steps = [13] }")
        .replace("betas = [0.9, 0.95] }", "betas = [0.9, 0.95], weight_decay = 0.1 }");
    let every4 = "checkpoint = \"every-n\"\ncheckpoint_config = { every = 4, keep = 2 }";
    let text = format!(
        "[suite]\nname = \"zero-prefetch\"\ndevice = \"cpu\"\nseed = 5\nworld_size = 2\nwarmup_steps = 2\nbucket_mb = 0.1\n{workload}\n{}\n\
         [[strategy]]\nname = \"zero1\"\nzero = 1\n{every4}\n\n[[strategy]]\nname = \"zero2\"\nzero = 2\n{every4}\n",
        plugin_table("every-n", "every-n.wasm"),
    );
    let s = write(dir.path(), "s.toml", &text);
    let run = |prefetch: &str| {
        let out = dir.path().join(format!("prefetch{prefetch}.json"));
        run_ok(
            harness(dir.path())
                .env("HARNESS_ZERO_PREFETCH", prefetch)
                .env("HARNESS_REPLICA_CHECK_EVERY", "4")
                .args(["run", "-q"])
                .arg(&s)
                .arg("--out")
                .arg(&out),
        );
        results(&out)
    };
    let (on, off) = (run("1"), run("0"));
    for s in ["zero1", "zero2"] {
        let (x, y) = (entry(&on, s), entry(&off, s));
        assert_eq!(x["status"], "ok", "{s}: {}", x["error"]);
        assert_eq!(y["status"], "ok", "{s}: {}", y["error"]);
        assert_eq!(losses(x).len(), 20, "{s}");
        assert_eq!(losses(x), losses(y), "{s}: the losses differ with the gathers beside the forward pass");
        let evals = |e: &serde_json::Value| -> Vec<(u64, f64)> {
            e["metrics"]["eval_curve"].as_array().unwrap().iter().map(|p| (p[0].as_u64().unwrap(), p[2].as_f64().unwrap())).collect()
        };
        assert_eq!(evals(x), evals(y), "{s}");
        assert_eq!(evals(x).len(), 5, "{s}");
        assert_eq!(x["metrics"]["final_eval_loss"], y["metrics"]["final_eval_loss"], "{s}");
        let failures = |e: &serde_json::Value| -> Vec<(u64, u64)> {
            let fs = e["metrics"]["resilience"]["failures"].as_array().unwrap().iter();
            fs.map(|f| (f["step"].as_u64().unwrap(), f["restored_to"].as_u64().unwrap())).collect()
        };
        assert_eq!(failures(x), [(13, 12)], "{s}");
        assert_eq!(failures(y), [(13, 12)], "{s}");
    }
    // The setting is recorded with the result where it is not the default.
    assert_eq!(on["switches"].get("HARNESS_ZERO_PREFETCH"), None, "{}", on["switches"]);
    assert_eq!(off["switches"]["HARNESS_ZERO_PREFETCH"], "0", "{}", off["switches"]);
}
