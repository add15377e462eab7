//! The sandbox against hostile plugins (tests/plugins/hostile and
//! hostile-checkpoint): each attack fails its own entry with a message
//! naming the plugin, quickly, within a few hundred MiB, and the entries
//! before and after it (built-in and plugin baselines) train all their
//! steps in the same process.

use std::time::{Duration, Instant};

use crate::{artifact, entry, exclusive, harness, hostile_device, results, write};

const WORKLOAD: &str = r#"
[[workload]]
name = "mlp"
model = { kind = "mlp", preset = "tiny" }
data = { kind = "synthetic", vocab = 256, branching = 4 }
batch = 8
seq_len = 16
steps = 6
optimizer = { kind = "adamw", lr = 1e-2, weight_decay = 0.0 }
eval_batches = 1
"#;

/// Runs `modes` of the hostile compressor (each as strategy `<mode>`, with
/// the `[[plugin]]` keys `limits`) between a built-in first entry and a WASM
/// all-reduce last entry, on `world` thread ranks. Returns the result file,
/// stderr and the wall time.
fn run_attacks(world: u32, limits: &str, modes: &[&str]) -> (serde_json::Value, String, Duration) {
    let _alone = exclusive();
    let dir = tempfile::tempdir().unwrap();
    let mut s = format!(
        "[suite]\nname = \"hostile\"\ndevice = \"{}\"\nseed = 1\nworld_size = {world}\nwarmup_steps = 1\n{WORKLOAD}",
        hostile_device(world)
    );
    s += &format!("[[plugin]]\nname = \"avg\"\npath = \"{}\"\n", artifact("allreduce.wasm").display());
    s += &format!("[[plugin]]\nname = \"evil\"\npath = \"{}\"\n{limits}\n", artifact("hostile.wasm").display());
    s += "[[strategy]]\nname = \"first\"\n";
    for m in modes {
        let (mode, at) = m.split_once('@').unwrap_or((m, "compress"));
        s += &format!(
            "[[strategy]]\nname = \"{}\"\ncompressor = \"evil\"\ncompressor_config = {{ mode = \"{mode}\", at = \"{at}\" }}\n",
            m.replace('@', "-at-")
        );
    }
    s += "[[strategy]]\nname = \"last\"\ncompressor = \"avg\"\n";
    let suite = write(dir.path(), "suite.toml", &s);
    let out_path = dir.path().join("r.json");
    let t0 = Instant::now();
    let out = harness(dir.path()).arg("run").arg(&suite).arg("--out").arg(&out_path).arg("-q").output().unwrap();
    let took = t0.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "the run finishes with failed entries; stderr:\n{}", &stderr[..stderr.len().min(4000)]);
    let r = results(&out_path);
    assert_eq!(r["complete"], true);
    for ok in ["mlp/first/r0", "mlp/last/r0"] {
        let e = entry(&r, ok);
        assert_eq!(e["status"], "ok", "{ok} after the attacks: {e}");
        assert_eq!(e["metrics"]["steps"].as_u64(), Some(6), "{ok} trained all its steps");
    }
    (r, stderr, took)
}

fn error_of(r: &serde_json::Value, strategy: &str) -> String {
    let e = entry(r, &format!("mlp/{strategy}/r0"));
    assert_eq!(e["status"], "failed", "{strategy}: {e}");
    e["error"].as_str().unwrap().to_owned()
}

fn assert_contains(msg: &str, wants: &[&str]) {
    for w in wants {
        assert!(msg.contains(w), "{msg:?} lacks {w:?}");
    }
}

/// Sleeping through WASI (a clock subscription and `poll`) in `compress`
/// or `configure` would block in host code, out of the epoch deadline's
/// reach: the blocking calls trap at once. Host ops that would allocate
/// past the cap or run past the deadline are refused before they start.
#[test]
fn blocking_calls_and_oversized_host_ops_are_cut_before_they_cost() {
    // 100 ms: the fixture's matmul (86 GFLOP, the most that fits the 64 MiB
    // cap) must cost more than the deadline on any CPU; a 2-core VM ran it
    // in 217 ms, inside a 300 ms deadline.
    let limits = "deadline_ms = 100\ntensor_mb = 64";
    let (r, _, took) = run_attacks(1, limits, &["sleep", "sleep@configure", "huge-zeros", "broadcast", "slow-matmul"]);
    assert!(took < Duration::from_secs(60), "the run took {took:?}: a plugin held it up");
    for s in ["sleep", "sleep-at-configure"] {
        assert_contains(&error_of(&r, s), &["compressor plugin `evil` (wasm", "blocking WASI function", "may not wait"]);
    }
    assert_contains(&error_of(&r, "sleep-at-configure"), &["`configure`"]);
    for s in ["huge-zeros", "broadcast"] {
        assert_contains(&error_of(&r, s), &["compressor plugin `evil`", "more than its cap of 64 MiB"]);
    }
    // On a CPU the matmul is refused on its estimate. On a GPU it takes
    // well under a millisecond and is admitted; the call is then cut at its
    // deadline, by the next op or by the interruption of the guest (an
    // H200's first matmul of the process, with cuBLAS's set-up, took longer
    // than 100 ms: bench/hostile_gpu.sh).
    let slow = error_of(&r, "slow-matmul");
    assert_contains(&slow, &["compressor plugin `evil`", "deadline of 100 ms"]);
    if hostile_device(1) == "cpu" {
        assert_contains(&slow, &["host op `tensor.matmul`", "left of the call's deadline of 100 ms"]);
    }
}

/// A view keeps its whole storage alive, so one-element views of large
/// tensors count their storage against `tensor_mb`.
#[test]
fn views_count_the_storage_they_keep_alive() {
    let (r, _, _) = run_attacks(1, "tensor_mb = 64", &["hoard-views"]);
    assert_contains(&error_of(&r, "hoard-views"), &["compressor plugin `evil`", "more than its cap of 64 MiB"]);
}

/// Two ranks that call different collectives fail the entry with a message
/// naming what each rank called; the process stays usable (autograd on)
/// for the entries after it. A compressor that makes the replicas differ
/// is caught by the replica check.
#[test]
fn collective_mismatches_and_diverging_replicas_fail_their_entry_only() {
    let (r, _, took) = run_attacks(2, "", &["mismatch", "mismatch-broadcast", "diverge"]);
    assert!(took < Duration::from_secs(60), "the run took {took:?}");
    assert_contains(
        &error_of(&r, "mismatch"),
        &["compressor plugin `evil`", "the ranks called different collectives", "rank 0: all_reduce", "rank 1: all_gather"],
    );
    assert_contains(&error_of(&r, "mismatch-broadcast"), &["rank 0: all_reduce", "rank 1: broadcast from rank 0"]);
    assert_contains(&error_of(&r, "diverge"), &["the replicas diverged", "rank 1", "differs from rank 0", "`evil`"]);
}

/// Plugin output is data: lines are labelled, escaped, cut and limited; a
/// panic message survives a megabyte of stderr before it.
#[test]
fn plugin_output_is_escaped_cut_and_limited() {
    let (r, stderr, _) = run_attacks(1, "memory_mb = 128", &["log-flood", "stderr-then-panic"]);
    assert_eq!(entry(&r, "mlp/log-flood/r0")["status"], "ok");
    assert!(stderr.len() < 1 << 20, "{} bytes of stderr from a flooding plugin", stderr.len());
    assert!(!stderr.contains('\u{1b}'), "an escape sequence went through raw");
    assert!(!stderr.contains("\n[harness] entry mlp/first/r0: ok (forged)"), "a forged line went through");
    for line in stderr.lines().filter(|l| l.contains("flood line") || l.contains("xxxx")) {
        assert!(line.starts_with("[plugin hostile] "), "unlabelled plugin output: {line:.100}");
        assert!(line.len() < 600, "a {}-byte log line", line.len());
    }
    assert!(stderr.contains("log budget spent"), "no notice that lines were dropped");
    assert_contains(&error_of(&r, "stderr-then-panic"), &["it panicked at", "the panic message after 1 MiB of stderr"]);
}

/// A checkpoint policy that lists a checkpoint twice for deletion fails
/// its entry, naming the plugin, and deletes nothing twice. (Synchronous
/// checkpoints: the policy deletes once two are durable, which with
/// background persists depends on how fast the disk is.)
#[test]
fn a_checkpoint_policy_that_deletes_twice_is_refused() {
    let r = run_twice(1, "");
    assert_eq!(entry(&r, "mlp/last/r0")["status"], "ok");
}

/// Under ZeRO the parameters' gathers run into the next step; an entry
/// that fails between its update and its next forward pass (here its
/// checkpoint policy, on two thread ranks) leaves gathers of its own
/// collective behind, which the next entry drops: it trains as the first.
#[test]
fn a_zero_entry_that_fails_after_its_update_leaves_nothing_to_the_next() {
    let r = run_twice(2, "zero = 2\n");
    let losses = |id: &str| -> Vec<f64> {
        let e = entry(&r, id);
        assert_eq!(e["status"], "ok", "{id}: {}", e["error"]);
        e["metrics"]["loss_curve"].as_array().unwrap().iter().map(|p| p[2].as_f64().unwrap()).collect()
    };
    assert_eq!(losses("mlp/last/r0"), losses("mlp/first/r0"));
}

/// Entries `first`, `twice` (the hostile checkpoint policy that deletes a
/// checkpoint twice, synchronous checkpoints) and `last` on `world` thread
/// ranks, each strategy with the keys `keys`: the run exits 1 and `twice`
/// fails naming its plugin. Returns the result file.
fn run_twice(world: u32, keys: &str) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let s = format!(
        "[suite]\nname = \"twice\"\ndevice = \"{device}\"\nseed = 1\nwarmup_steps = 1\nworld_size = {world}\n{WORKLOAD}\n\
         [[plugin]]\nname = \"twice\"\npath = \"{}\"\n\
         [[strategy]]\nname = \"first\"\n{keys}[[strategy]]\nname = \"twice\"\n{keys}checkpoint = \"twice\"\ncheckpoint_async = false\n\
         [[strategy]]\nname = \"last\"\n{keys}",
        artifact("hostile-checkpoint.wasm").display(),
        device = hostile_device(world)
    );
    let suite = write(dir.path(), "suite.toml", &s);
    let out_path = dir.path().join("r.json");
    let out = harness(dir.path()).arg("run").arg(&suite).arg("--out").arg(&out_path).arg("-q").output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let r = results(&out_path);
    assert_contains(&error_of(&r, "twice"), &["checkpoint-policy plugin `twice`", "delete the checkpoint of step 1 twice"]);
    r
}

/// A native plugin that ends the process, by any route (`exit(0)`,
/// `_exit(0)`, the `exit_group(0)` system call, a thread of its own calling
/// `exit(0)` while harness trains on), does not end the run successfully:
/// the supervising `harness run` says which plugin ended it and exits with
/// 4, and the result file keeps the entries before it and stays incomplete.
#[test]
fn a_native_plugin_that_exits_cannot_end_the_run_successfully() {
    for (mode, said) in [
        ("exit", "ended the process (exit) during `compress`"),
        ("_exit", "ended the process (_exit or exit_group, status 0) during `compress`"),
        ("exit_group", "ended the process (_exit or exit_group, status 0) during `compress`"),
        // During a later call or between calls, as the thread's moment falls.
        ("thread-exit", "ended the process (exit)"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        // The thread calls exit 50 ms after the first call: the entry trains
        // long enough for it to come while harness trains on, however fast
        // six steps are.
        let workload = if mode == "thread-exit" { WORKLOAD.replace("steps = 6", "steps = 2000") } else { WORKLOAD.to_owned() };
        let s = format!(
            "[suite]\nname = \"exit\"\ndevice = \"{device}\"\nseed = 1\nwarmup_steps = 1\n{workload}\n\
             [[plugin]]\nname = \"quitter\"\npath = \"{}\"\n\
             [[strategy]]\nname = \"first\"\n[[strategy]]\nname = \"exit\"\ncompressor = \"quitter\"\ncompressor_config = {{ mode = \"{mode}\" }}\n\
             [[strategy]]\nname = \"last\"\n",
            artifact("libhostile.so").display(),
            device = hostile_device(1)
        );
        let suite = write(dir.path(), "suite.toml", &s);
        let out_path = dir.path().join("r.json");
        let out = harness(dir.path()).arg("run").arg(&suite).arg("--out").arg(&out_path).arg("-q").output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(4), "{mode}: stderr:\n{stderr}");
        assert_contains(&stderr, &["compressor plugin `quitter` (native", said, "the run is incomplete"]);
        let r = results(&out_path);
        assert_eq!(r["complete"], false, "{mode}");
        assert_eq!(entry(&r, "mlp/first/r0")["status"], "ok", "{mode}");
    }
}
