//! The `t5` family end to end on the CPU: a tiny T5 learns a word-for-word
//! translation to within 0.1 nats of its floor, and on two ranks it trains
//! with a compressor and restores from checkpoints bit for bit.

use harness::results::{EntryStatus, RunResult};

use crate::*;

#[test]
fn the_t5_suite_learns_its_translation_to_the_floor() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t5.json");
    run_ok(harness(&repo_root()).args(["run", "--quiet", "suites/t5-cpu.toml", "--out"]).arg(&out));
    let r = RunResult::read(&out).unwrap();
    let e = &r.entries[0];
    assert_eq!(e.status, EntryStatus::Ok, "{}", e.id);
    let m = e.metrics.as_ref().unwrap();
    // 8 words, 10% replaced by any of the 8: the right word has probability
    // q = 0.9 + 0.1 / 8, each other word 0.1 / 8.
    let (q, r8) = (0.9f64 + 0.1 / 8.0, 0.1f64 / 8.0);
    let floor = -(q * q.ln()) - 7.0 * r8 * r8.ln();
    assert!((m.loss_floor.unwrap() - floor).abs() < 1e-12, "{:?} vs {floor}", m.loss_floor);
    let eval = m.final_eval_loss.unwrap();
    let first = m.loss_curve.first().unwrap().2;
    // From about ln 8 (2.08) or more to within 0.1 nats of the floor, and not
    // below it by more than the eval set's sampling error allows.
    assert!(first > floor + 1.0, "first loss {first}");
    assert!(eval < floor + 0.1 && eval > floor - 0.05, "eval {eval}, floor {floor}");
    assert!(m.steps_to_target.is_some());
    // Tokens are target tokens: 32 pairs of 8 per step.
    assert_eq!(m.tokens, m.samples * 8);
    assert_eq!(m.model["kind"], "t5");
    assert!(m.flops_per_token > 0.0);
}

/// Two ranks: the built-in all-reduce and top-k with error feedback, each
/// checkpointing every 5 steps; `faults` makes the run lose its work.
fn two_rank_t5(faults: &str) -> String {
    format!(
        r#"[suite]
name = "t5-ranks"
device = "cpu"
seed = 5
world_size = 2
warmup_steps = 2

[[workload]]
name = "t5"
model = {{ kind = "t5", preset = "tiny", n_layer = 1 }}
data = {{ kind = "pairs", vocab = 12, noise = 0.1 }}
batch = 8
seq_len = 6
steps = 30
optimizer = {{ kind = "adamw", lr = 1e-3 }}
eval_every = 10
eval_batches = 2
{faults}

{}"#,
        checkpointed_allreduce_and_topk()
    )
}

#[test]
fn two_ranks_with_a_compressor_and_failures_repeat_every_loss() {
    let dir = tempfile::tempdir().unwrap();
    let clean = write(dir.path(), "clean.toml", &two_rank_t5(""));
    let faulty = write(dir.path(), "faulty.toml", &two_rank_t5("faults = { at_steps = [13, 27] }"));
    let (a, b) = (dir.path().join("clean.json"), dir.path().join("faulty.json"));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&clean).arg("--out").arg(&a));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&faulty).arg("--out").arg(&b));
    let (a, b) = (results(&a), results(&b));
    for s in ["ddp", "topk"] {
        let id = format!("t5/{s}/r0");
        let (x, y) = (entry(&a, &id), entry(&b, &id));
        assert_eq!(x["status"], "ok", "{id}: {}", x["error"]);
        assert_eq!(y["status"], "ok", "{id}: {}", y["error"]);
        assert_eq!(x["metrics"]["world_size"], 2);
        let failures = y["metrics"]["resilience"]["failures"].as_array().unwrap().len();
        assert_eq!(failures, 2, "{id}");
        assert_eq!(losses(&a, &id).len(), 30);
        assert_eq!(losses(&a, &id), losses(&b, &id), "{id}: the restored run's training losses differ");
        let evals = |m: &serde_json::Value| m["eval_curve"].as_array().unwrap().iter().map(|p| p[2].clone()).collect::<Vec<_>>();
        assert_eq!(evals(&x["metrics"]), evals(&y["metrics"]), "{id}: eval losses differ after the restores");
    }
    let bytes = |s: &str| entry(&a, &format!("t5/{s}/r0"))["metrics"]["bytes_on_wire"].as_u64().unwrap();
    assert!(bytes("topk") < bytes("ddp") / 2, "top-k {} vs all-reduce {}", bytes("topk"), bytes("ddp"));
}

#[test]
fn t5_workloads_need_pairs_and_pairs_need_t5() {
    let dir = tempfile::tempdir().unwrap();
    let w = r#"
[[workload]]
name = "a"
model = { kind = "t5", preset = "tiny" }
data = { kind = "synthetic", vocab = 16 }
batch = 4
seq_len = 8
steps = 5
optimizer = { kind = "adamw", lr = 1e-3 }

[[workload]]
name = "b"
model = { kind = "gpt", preset = "tiny" }
data = { kind = "pairs", vocab = 16 }
batch = 4
seq_len = 8
steps = 5
optimizer = { kind = "adamw", lr = 1e-3 }

[[workload]]
name = "c"
model = { kind = "t5", preset = "tiny" }
data = { kind = "pairs", vocab = 3, noise = 1.5 }
batch = 4
seq_len = 8
steps = 5
recompute = "all"
optimizer = { kind = "adamw", lr = 1e-3 }
"#;
    let s = write(dir.path(), "s.toml", &suite("t5-bad", "", w));
    let out = harness(dir.path()).arg("validate").arg(&s).output().unwrap();
    assert_eq!(out.status.code(), Some(harness::cli::exit::INVALID_SUITE));
    let err = String::from_utf8_lossy(&out.stderr);
    for want in [
        "the t5 model trains on sequence pairs",
        "pairs data needs `model.kind = \"t5\"`",
        "`vocab` must lie in 4..=65536",
        "`noise` is a probability",
        "the t5 model does not recompute activations",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
}
