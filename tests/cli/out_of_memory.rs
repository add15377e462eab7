//! Out-of-memory recovery end to end, with the emulated memory limit
//! (`faults.oom_above_batch`): the step that runs out is dropped, the batch
//! shrinks, the step is retried, the event is recorded, and the entry
//! finishes all its steps.

use crate::{artifact, harness, run_ok, write};

#[test]
fn a_grown_batch_that_runs_out_of_memory_shrinks_and_the_step_is_retried() {
    let dir = tempfile::tempdir().unwrap();
    let s = format!(
        r#"[suite]
name = "oom"
device = "cpu"
seed = 2
world_size = 2
warmup_steps = 2

[[workload]]
name = "mlp"
model = {{ kind = "mlp", preset = "tiny" }}
data = {{ kind = "synthetic", vocab = 64, branching = 2 }}
batch = 32
seq_len = 16
steps = 24
optimizer = {{ kind = "adamw", lr = 1e-2 }}
eval_batches = 1
faults = {{ oom_above_batch = 20 }}

[[plugin]]
name = "memory-growth"
path = "{}"

[[strategy]]
name = "grow"
batch_policy = "memory-growth"
batch_policy_config = {{ start = 8, max = 64, growth = 2.0, threshold = 1.0, backoff = 0.5 }}

[[strategy]]
name = "fixed"
"#,
        artifact("memory-growth.wasm").display()
    );
    let suite = write(dir.path(), "oom.toml", &s);
    let out = dir.path().join("oom.json");
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&suite).arg("--out").arg(&out));
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let entry = |s: &str| r["entries"].as_array().unwrap().iter().find(|e| e["strategy"] == s).unwrap().clone();

    for s in ["grow", "fixed"] {
        let e = entry(s);
        assert_eq!(e["status"], "ok", "{s}: {}", e["error"]);
        let m = &e["metrics"];
        assert_eq!(m["steps"], 24, "{s}: every step ran");
        let ooms = m["resilience"]["out_of_memory"].as_array().unwrap();
        assert!(!ooms.is_empty(), "{s}: no out-of-memory was recorded");
        for o in ooms {
            assert!(o["micro_batch"].as_u64().unwrap() > 20, "{s}: {o}");
            assert!(o["retried_with"].as_u64().unwrap() < o["micro_batch"].as_u64().unwrap(), "{s}: {o}");
            assert_eq!(o["emulated"], true);
        }
        // After the last out-of-memory, no step runs above the limit.
        let last = ooms.last().unwrap();
        let changes = m["batch_changes"].as_array().unwrap();
        let retry =
            changes.iter().rposition(|c| c[0] == last["step"] && c[1] == last["retried_with"]).expect("the retry is a batch change");
        let after: Vec<u64> = changes[retry..].iter().map(|c| c[1].as_u64().unwrap()).collect();
        assert!(after.iter().all(|&b| b <= 20), "{s}: batches after the last out-of-memory: {after:?}");
        // Retried steps are not counted twice.
        assert_eq!(m["resilience"]["steps_executed"], 24, "{s}");
    }
    // memory-growth: 8, 16, 32 runs out at step 2 and backs off to 16.
    let g = entry("grow");
    assert_eq!(
        g["metrics"]["resilience"]["out_of_memory"][0],
        serde_json::json!({"step": 2, "micro_batch": 32, "retried_with": 16, "emulated": true})
    );
    // fixed asks for 32 every step: the host halves it once and keeps 16.
    let f = entry("fixed");
    assert_eq!(f["metrics"]["resilience"]["out_of_memory"].as_array().unwrap().len(), 1);
    assert_eq!(f["metrics"]["batch_changes"], serde_json::json!([[0, 32, 1], [0, 16, 1]]));
}
