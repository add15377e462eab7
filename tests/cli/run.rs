//! `harness run` end to end.

use harness::results::{EntryStatus, RunResult};

use crate::*;

#[test]
fn default_suite_learns_towards_the_floor_and_records_everything() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cpu.json");
    let o = run_ok(harness(&repo_root()).args(["run", "--quiet", "--out"]).arg(&out));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(table.contains("tokens/s") && table.contains("time to target"), "{table}");

    let r = RunResult::read(&out).unwrap();
    assert!(r.complete);
    assert_eq!(r.suite.name, "cpu");
    assert_eq!(r.suite.text, std::fs::read_to_string(repo_root().join("suites/cpu.toml")).unwrap());
    assert!(r.machine.libtorch.as_deref().unwrap_or("").starts_with("2.11"), "{:?}", r.machine.libtorch);
    assert_eq!(r.entries.len(), r.plan.len());
    for e in &r.entries {
        assert_eq!(e.status, EntryStatus::Ok, "{}", e.id);
        let m = e.metrics.as_ref().unwrap();
        let floor = m.loss_floor.expect("the default suite's data have a known floor");
        let first = m.loss_curve.first().unwrap().2;
        let eval = m.final_eval_loss.unwrap();
        // The gap above the floor shrinks at least five-fold, and the eval
        // loss ends within the suite's target.
        assert!(first - floor > 5.0 * (eval - floor), "{}: first loss {first}, eval {eval}, floor {floor}", e.id);
        assert!(eval <= m.target_loss.unwrap(), "{}: eval {eval}, target {:?}", e.id, m.target_loss);
        assert!(m.time_to_target_s.is_some() && m.steps_to_target.is_some());
        assert!(m.tokens_per_s > 0.0 && m.train_time_s > 0.0);
        // Histograms decode and agree with the summary.
        let h = harness::measure::decode(&e.histograms["step"]).unwrap();
        assert_eq!(h.len(), m.steps - m.warmup_steps);
        // The recorded steps tile the window that tokens/s is measured
        // over (`harness verify` checks the two against each other).
        let window = m.tokens as f64 * (m.steps - m.warmup_steps) as f64 / m.steps as f64 / m.tokens_per_s;
        let held = h.mean() * h.len() as f64 / 1e9;
        assert!(held <= window * 1.002 + 1e-4, "{}: the steps hold {held} s, the window is {window} s", e.id);
        let p50 = h.value_at_quantile(0.5) as f64 / 1e6;
        assert!((p50 - m.step.as_ref().unwrap().p50_ms).abs() < 1e-9);
        for phase in ["data", "forward", "backward", "optimizer"] {
            assert!(e.histograms.contains_key(phase), "{}: no {phase} histogram", e.id);
        }
        assert!(m.memory.peak_rss_bytes.unwrap() > 0);
    }
}

#[test]
fn bf16_autocast_learns_like_fp32() {
    // Pins a bug: with autocast left on for a whole run, its cache of bf16
    // weight copies must be cleared after every forward, or training keeps
    // using the initial weights.
    let dir = tempfile::tempdir().unwrap();
    let w = tiny_gpt("fp32", 120, "precision = \"fp32\"") + &tiny_gpt("bf16", 120, "precision = \"bf16\"");
    let s = write(dir.path(), "s.toml", &suite("prec", "", &w));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]));
    let r = RunResult::read(&dir.path().join("r.json")).unwrap();
    let eval = |i: usize| r.entries[i].metrics.as_ref().unwrap().final_eval_loss.unwrap();
    let floor = r.entries[0].metrics.as_ref().unwrap().loss_floor.unwrap();
    assert!(eval(0) < floor + 0.5, "fp32 did not learn: {} (floor {floor})", eval(0));
    assert!((eval(1) - eval(0)).abs() < 0.1, "bf16 {} vs fp32 {}", eval(1), eval(0));
}

#[test]
fn a_failing_entry_is_recorded_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let w = tiny_gpt("first", 10, "") + &tiny_gpt("diverges", 30, "").replace("lr = 3e-3", "lr = 1e12") + &tiny_gpt("last", 10, "");
    let s = write(dir.path(), "s.toml", &suite("fail", "", &w));
    let out = harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(harness::cli::exit::ENTRY_FAILED));
    let r = RunResult::read(&dir.path().join("r.json")).unwrap();
    assert!(r.complete);
    let status: Vec<_> = r.entries.iter().map(|e| (e.id.as_str(), matches!(e.status, EntryStatus::Ok))).collect();
    assert_eq!(status, [("first/baseline/r0", true), ("diverges/baseline/r0", false), ("last/baseline/r0", true)]);
    let EntryStatus::Failed { error, .. } = &r.entries[1].status else { unreachable!() };
    assert!(error.contains("training loss became"), "{error}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("diverges/baseline/r0: the training loss became"));
}

#[test]
fn token_files_train_with_a_held_out_split() {
    let dir = tempfile::tempdir().unwrap();
    // llm.c format: 256 x i32 header, then u16 tokens (a learnable cycle).
    let tokens: Vec<u16> = (0..20_000u32).map(|i| ((i * 7) % 61) as u16).collect();
    let mut bytes = Vec::new();
    let mut header = [0i32; 256];
    header[0] = 20240520;
    header[1] = 1;
    header[2] = tokens.len() as i32;
    bytes.extend(header.iter().flat_map(|x| x.to_le_bytes()));
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    std::fs::write(dir.path().join("train.bin"), bytes).unwrap();
    let w = tiny_gpt("bin", 60, "target_loss = 0.5").replace(
        "data = { kind = \"synthetic\", vocab = 64, branching = 2 }",
        "data = { kind = \"bin\", train = \"train.bin\", vocab = 64 }",
    );
    let s = write(dir.path(), "s.toml", &suite("bin", "", &w));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]));
    let r = RunResult::read(&dir.path().join("r.json")).unwrap();
    let m = r.entries[0].metrics.as_ref().unwrap();
    assert_eq!(m.loss_floor, None);
    assert!(m.final_eval_loss.unwrap() < 0.5, "{:?}", m.final_eval_loss);
}

#[test]
fn encoder_regression_approaches_its_noise_floor() {
    let dir = tempfile::tempdir().unwrap();
    let w = r#"
[[workload]]
name = "enc"
model = { kind = "encoder", preset = "tiny" }
data = { kind = "regression", noise = 0.3 }
batch = 16
seq_len = 8
steps = 150
optimizer = { kind = "adamw", lr = 2e-3 }
eval_batches = 4
target_above_floor = 0.15
"#;
    let s = write(dir.path(), "s.toml", &suite("enc", "", w));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]));
    let r = RunResult::read(&dir.path().join("r.json")).unwrap();
    let m = r.entries[0].metrics.as_ref().unwrap();
    assert!((m.loss_floor.unwrap() - 0.09).abs() < 1e-12);
    // Targets have unit variance: an untrained model sits near 1.0.
    assert!(m.final_eval_loss.unwrap() <= m.target_loss.unwrap(), "eval {:?} target {:?}", m.final_eval_loss, m.target_loss);
}

#[test]
fn cuda_suites_fail_clearly_without_a_gpu() {
    if harness::device::init_cuda() {
        eprintln!("skipped: this machine has a GPU; the test checks the message on machines without one");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = write(dir.path(), "s.toml", &suite("c", "", &tiny_gpt("w", 5, "")).replace("device = \"cpu\"", "device = \"cuda\""));
    let out = harness(dir.path()).arg("run").arg(&s).output().unwrap();
    assert_eq!(out.status.code(), Some(harness::cli::exit::ERROR));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("asks for `device = \"cuda\"` but no CUDA device is usable"), "{err}");
    // Nothing half-made is left behind.
    assert!(!dir.path().join("results").exists());
}

#[test]
fn switches_that_change_the_work_are_recorded_and_malformed_ones_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = write(dir.path(), "s.toml", &suite("sw", "", &tiny_gpt("w", 4, "")));
    let run = |out: &str| {
        let mut c = harness(dir.path());
        c.args(["run", "-q"]).arg(&s).args(["--out", out]);
        c
    };
    // A value the switch does not take: refused before anything runs.
    let o = run("bad.json").env("HARNESS_OVERLAP", "maybe").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(harness::cli::exit::INVALID_SWITCH), "{err}");
    assert!(err.contains("error: HARNESS_OVERLAP=\"maybe\" is not a value it takes: it takes 1 or 0"), "{err}");
    assert!(!dir.path().join("bad.json").exists());
    // A switch of the measured work off its default is recorded and shown;
    // an operational one is not.
    let o = run_ok(run("r.json").env("HARNESS_OVERLAP", "off").env("HARNESS_TRACE_STEPS", "2"));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(table.contains("\nswitches: HARNESS_OVERLAP=0 (not the default work)\n"), "{table}");
    assert_eq!(results(&dir.path().join("r.json"))["switches"], serde_json::json!({ "HARNESS_OVERLAP": "0" }));
    // Resuming it without the switch would mix two kinds of work.
    let o = run("r.json").arg("--resume").env_remove("HARNESS_OVERLAP").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(harness::cli::exit::ERROR), "{err}");
    assert!(err.contains("was started with the switches HARNESS_OVERLAP=0, this process has none"), "{err}");
    // A default run's file has no `switches`.
    run_ok(run("d.json").env("HARNESS_OVERLAP", "1"));
    assert!(results(&dir.path().join("d.json")).get("switches").is_none());
}

#[test]
fn env_reports_the_libtorch_it_runs_on() {
    let o = run_ok(harness(&repo_root()).args(["env", "--json"]));
    let f: harness::device::Fingerprint = serde_json::from_slice(&o.stdout).unwrap();
    assert!(f.libtorch.unwrap().starts_with("2.11"));
    assert!(f.cpu_cores >= 1);
    let o = run_ok(harness(&repo_root()).arg("env"));
    assert!(String::from_utf8_lossy(&o.stdout).contains("libtorch  2.11"));
    // Issue 62: CUDA_DEVICE_MAX_CONNECTIONS and the CPU thread counts
    // change the work without being switches: the fingerprint (and with it
    // every result) records them when set.
    let o = run_ok(
        harness(&repo_root())
            .args(["env", "--json"])
            .env("CUDA_DEVICE_MAX_CONNECTIONS", "8")
            .env("OMP_NUM_THREADS", "1")
            .env_remove("MKL_NUM_THREADS"),
    );
    let f: harness::device::Fingerprint = serde_json::from_slice(&o.stdout).unwrap();
    let want: std::collections::BTreeMap<String, String> =
        [("CUDA_DEVICE_MAX_CONNECTIONS".into(), "8".into()), ("OMP_NUM_THREADS".into(), "1".into())].into();
    assert_eq!(f.environment, want);
}

#[test]
fn every_command_has_help() {
    for args in [&["--help"][..], &["run", "--help"], &["validate", "--help"], &["env", "--help"]] {
        let o = run_ok(harness(&repo_root()).args(args));
        assert!(String::from_utf8_lossy(&o.stdout).contains("Usage: harness"), "{args:?}");
    }
}

#[test]
fn accumulation_and_time_budgets_count_what_ran() {
    let dir = tempfile::tempdir().unwrap();
    let w = tiny_gpt("accum", 6, "grad_accum = 3") + &tiny_gpt("budget", 1, "time_budget_s = 1.5").replace("steps = 1\n", "");
    let s = write(dir.path(), "s.toml", &suite("acc", "", &w));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]));
    let r = RunResult::read(&dir.path().join("r.json")).unwrap();
    let m = r.entries[0].metrics.as_ref().unwrap();
    // 6 optimizer steps x 3 micro-batches x 8 sequences x 32 tokens.
    assert_eq!((m.steps, m.samples, m.tokens), (6, 6 * 3 * 8, 6 * 3 * 8 * 32));
    assert_eq!(m.loss_curve.len(), 6);
    let b = r.entries[1].metrics.as_ref().unwrap();
    assert!(b.steps > 3, "a 1.5 s budget ran only {} steps", b.steps);
    assert!(b.train_time_s >= 1.5 && b.train_time_s < 3.0, "train time {}", b.train_time_s);
}

#[test]
fn cpu_data_parallel_ranks_share_the_work_and_count_their_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let w = tiny_gpt("dp", 80, "target_above_floor = 0.5");
    let meta = "world_size = 2\n\n[[strategy]]\nname = \"ddp\"\nbaseline = true\n\n[[strategy]]\nname = \"slow-link\"\nlink = { gbps = 0.05, latency_us = 100 }\n";
    // Strategies must follow the workloads in the file.
    let text = suite("dp", "world_size = 2", &w) + &meta.replace("world_size = 2\n", "");
    let s = write(dir.path(), "s.toml", &text);
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]));
    let r = RunResult::read(&dir.path().join("r.json")).unwrap();
    let (fast, slow) = (r.entries[0].metrics.as_ref().unwrap(), r.entries[1].metrics.as_ref().unwrap());
    for m in [fast, slow] {
        assert_eq!(m.world_size, 2);
        // Both ranks' samples count: 80 steps x 2 ranks x 8 sequences.
        assert_eq!(m.samples, 80 * 2 * 8);
        // One 25 MiB bucket holds the tiny model: one all-reduce per step,
        // each sending 2(n-1)/n = all of the fp32 gradients.
        assert_eq!(m.collectives, 80);
        // The built-in all-reduce ran from the backward pass's gradient hooks.
        assert!(m.overlapped_reduction);
        assert_eq!(m.bytes_on_wire, 80 * 4 * m.parameters as u64);
        assert!(m.final_eval_loss.unwrap() <= m.target_loss.unwrap(), "{:?} vs {:?}", m.final_eval_loss, m.target_loss);
        assert!(m.busbw_gbs.unwrap() > 0.0);
    }
    // 0.05 Gbps, 100 us, 2 ranks: each all-reduce of the fp32 gradients is
    // stretched to 2 x 100 us + bytes x 8 / 0.05 Gbps (about 260 ms here).
    // Compared with the model, not with the measured time: that includes
    // waiting for the other rank, which varies with the machine's load.
    let model_ms = 2.0 * 0.1 + (4 * slow.parameters) as f64 * 8.0 / 0.05e9 * 1e3;
    let emu = slow.collective_emulated.as_ref().expect("emulated latencies recorded");
    assert!(emu.p50_ms >= 0.99 * model_ms && emu.p50_ms < 1.5 * model_ms, "{emu:?} vs model {model_ms} ms");
    // The emulated bus bandwidth is the link's: 0.05 Gbit/s = 0.00625 GB/s
    // (a little under, for the latency term).
    let bw = slow.busbw_emulated_gbs.unwrap();
    assert!(bw <= 0.00625 * 1.01 && bw > 0.00625 * 0.6, "emulated busbw {bw} GB/s");
    assert!(slow.step.as_ref().unwrap().p50_ms > fast.step.as_ref().unwrap().p50_ms + 20.0);
    assert!(fast.collective_emulated.is_none());
    // Same seeds, same data, same averaged gradients: the link changes time, not learning.
    assert_eq!(fast.final_eval_loss, slow.final_eval_loss);
}

#[test]
fn a_bf16_average_is_a_recorded_strategy_key_that_learns_as_fp32_does() {
    let dir = tempfile::tempdir().unwrap();
    let w = tiny_gpt("dp", 40, "");
    let strategies = "\n[[strategy]]\nname = \"fp32\"\nbaseline = true\n\n[[strategy]]\nname = \"bf16\"\nreduce_dtype = \"bf16\"\n";
    let s = write(dir.path(), "s.toml", &(suite("bf16", "world_size = 2", &w) + strategies));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]));
    let r = results(&dir.path().join("r.json"));
    assert_eq!(r["plan"][1]["strategy"]["reduce_dtype"], "bf16", "recorded with the entry's strategy");
    assert!(r["plan"][0]["strategy"].get("reduce_dtype").is_none(), "fp32 is the default, left out");
    let loss = |i: usize| r["entries"][i]["metrics"]["final_eval_loss"].as_f64().unwrap();
    let (fp32, bf16) = (loss(0), loss(1));
    assert_ne!(fp32, bf16, "the bf16 average changes the numerics");
    assert!((fp32 - bf16).abs() < 0.05 * fp32, "bf16 {bf16} vs fp32 {fp32}");
    // Where the reduction does not overlap the backward pass, the entry
    // fails by name and the run goes on.
    let o = harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "off.json"]).env("HARNESS_OVERLAP", "0").output().unwrap();
    let r = RunResult::read(&dir.path().join("off.json")).unwrap();
    assert!(matches!(r.entries[0].status, EntryStatus::Ok), "{}", String::from_utf8_lossy(&o.stdout));
    let EntryStatus::Failed { error, .. } = &r.entries[1].status else { panic!("the bf16 entry ran without the overlap") };
    assert!(error.contains("`reduce_dtype = \"bf16\"` needs the all-reduce that overlaps the backward pass"), "{error}");
}

#[test]
fn a_cluster_topology_stretches_only_the_traffic_between_nodes_and_learns_as_flat_ranks_do() {
    let dir = tempfile::tempdir().unwrap();
    let w = tiny_gpt("topo", 12, "");
    // 4 thread ranks: flat and fast, as 2 nodes x 2 over 0.05 Gbps, and as
    // 4 nodes x 1 (every rank's traffic on the link).
    let strategies = "\n[[strategy]]\nname = \"flat\"\nbaseline = true\n\n[[strategy]]\nname = \"2x2\"\nlink = { gbps = 0.05, latency_us = 100, nodes = 2 }\n\n[[strategy]]\nname = \"4x1\"\nlink = { gbps = 0.05, latency_us = 100, nodes = 4 }\n";
    let s = write(dir.path(), "s.toml", &(suite("topo", "world_size = 4", &w) + strategies));
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]));
    let r = RunResult::read(&dir.path().join("r.json")).unwrap();
    let m = |i: usize| r.entries[i].metrics.clone().unwrap();
    let (flat, two, four) = (m(0), m(1), m(2));
    // The topology changes time, not learning: the same reduced gradients.
    assert_eq!(flat.final_eval_loss, two.final_eval_loss);
    assert_eq!(flat.final_eval_loss, four.final_eval_loss);
    let losses = |m: &harness::results::Metrics| m.loss_curve.iter().map(|&(step, _, loss)| (step, loss)).collect::<Vec<_>>();
    assert_eq!(losses(&flat), losses(&two));
    // One bucket of fp32 gradients per step. 2 x 2: a ring over the 2 nodes
    // (2 steps of half the buffer, 100 us each) on top of the measured
    // collective. 4 x 1: a ring over 4 (6 steps of a quarter).
    let bytes = (4 * two.parameters) as f64;
    let between_2 = 2.0 * 0.1 + 2.0 / 2.0 * bytes * 8.0 / 0.05e9 * 1e3;
    let between_4 = 6.0 * 0.1 + 6.0 / 4.0 * bytes * 8.0 / 0.05e9 * 1e3;
    let added = two.collective_emulated.as_ref().unwrap().mean_ms - two.collective.as_ref().unwrap().mean_ms;
    // HDR histograms keep 3 significant digits.
    assert!((added - between_2).abs() < 0.01 * between_2, "2x2 added {added} ms per collective, the model says {between_2}");
    let four_emu = four.collective_emulated.as_ref().unwrap().mean_ms;
    assert!(four_emu >= 0.99 * between_4 && four_emu < 1.5 * between_4, "4x1: {four_emu} ms vs the model's {between_4}");
    assert!(flat.collective_emulated.is_none());
}

#[test]
fn zero_stages_train_as_ddp_does_with_half_the_optimizer_state_per_rank() {
    let dir = tempfile::tempdir().unwrap();
    // Odd sizes (vocabulary 63, width 33), so that buckets need padding;
    // accumulation, clipping (ZeRO: the global norm over shards) and weight decay.
    let fp32 = tiny_gpt("fp32", 30, "grad_accum = 2\ngrad_clip = 0.5")
        .replace("preset = \"tiny\"", "n_layer = 2, n_head = 3, d_model = 33")
        .replace("vocab = 64", "vocab = 63")
        .replace("betas = [0.9, 0.95] }", "betas = [0.9, 0.95], weight_decay = 0.1 }");
    // fp16: the loss scale starts too high and overflows, so ranks must agree to skip.
    // Few tokens per batch: the scaled loss's gradient is large per token.
    let fp16 = tiny_gpt("fp16", 30, "precision = \"fp16\"").replace("batch = 8", "batch = 1").replace("seq_len = 32", "seq_len = 8");
    let strategies = "\n[[strategy]]\nname = \"ddp\"\nbaseline = true\n\n[[strategy]]\nname = \"zero1\"\nzero = 1\n\n[[strategy]]\nname = \"zero2\"\nzero = 2\n";
    let text = suite("zero", "world_size = 2\nbucket_mb = 0.1", &(fp32 + &fp16)) + strategies;
    let s = write(dir.path(), "s.toml", &text);
    run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]));
    let r = RunResult::read(&dir.path().join("r.json")).unwrap();
    let m =
        |id: &str| r.entries.iter().find(|e| e.id == id).and_then(|e| e.metrics.clone()).unwrap_or_else(|| panic!("{id} has no metrics"));
    for w in ["fp32", "fp16"] {
        let ddp = m(&format!("{w}/ddp/r0"));
        let steps = ddp.steps;
        let buckets = ddp.bucket_bytes.len() as u64;
        assert!(buckets >= 2, "{w}: the test wants several buckets, got {buckets}");
        assert_eq!(ddp.zero, 0);
        assert_eq!(ddp.collective_ops.keys().collect::<Vec<_>>(), ["all_reduce"]);
        assert_eq!(ddp.collective_ops["all_reduce"].collectives, steps * buckets);
        if w == "fp16" {
            assert!(ddp.skipped_steps >= 1, "no overflow: the fp16 entry does not test the ranks' agreement");
        }
        for (stage, name) in [(1u8, "zero1"), (2, "zero2")] {
            let z = m(&format!("{w}/{name}/r0"));
            assert_eq!(z.zero, stage);
            // Same seed, same data, same averaged gradients: the same loss at every step.
            assert_eq!(z.loss_curve.len(), ddp.loss_curve.len());
            for (a, b) in z.loss_curve.iter().zip(&ddp.loss_curve) {
                assert!((a.2 - b.2).abs() <= 1e-4 * b.2.abs(), "{w}/{name} step {}: loss {} vs DDP {}", a.0, a.2, b.2);
            }
            let (ze, de) = (z.final_eval_loss.unwrap(), ddp.final_eval_loss.unwrap());
            assert!((ze - de).abs() <= 1e-4 * de.abs(), "{w}/{name}: eval loss {ze} vs DDP {de}");
            assert_eq!(z.skipped_steps, ddp.skipped_steps, "{w}/{name}");
            // Each rank keeps optimizer state for half the parameters (plus a step counter per piece).
            assert_eq!(z.ranks.iter().map(|k| k.rank).collect::<Vec<_>>(), [0, 1]);
            for k in &z.ranks {
                let (mine, all) = (k.optimizer_state_bytes as f64, ddp.ranks[k.rank as usize].optimizer_state_bytes as f64);
                assert!((mine / all - 0.5).abs() < 0.01, "{w}/{name} rank {}: {mine} bytes of optimizer state vs DDP's {all}", k.rank);
                // Gradient memory at the optimizer step: stage 1 keeps the full buffers, the reduced
                // shard a piece of them (each bucket reduce-scattered in place); stage 2 keeps the
                // shard only.
                let (g, full) = (k.gradient_bytes as f64, ddp.ranks[k.rank as usize].gradient_bytes as f64);
                let want = if stage == 1 { 1.0 } else { 0.5 };
                assert!((g / full - want).abs() < 0.01, "{w}/{name} rank {}: {g} gradient bytes vs DDP's {full}", k.rank);
            }
            assert_eq!(z.optimizer_state_bytes, z.ranks[0].optimizer_state_bytes);
            // A reduce-scatter and an all-gather per bucket per step: on 2 ranks
            // together they send what DDP's all-reduce sends, plus the padding.
            let (rs, ag) = (&z.collective_ops["reduce_scatter"], &z.collective_ops["all_gather"]);
            assert_eq!((rs.collectives, ag.collectives), (steps * buckets, steps * buckets));
            assert_eq!(rs.bytes, ag.bytes);
            let extra = rs.bytes_on_wire + ag.bytes_on_wire - ddp.bytes_on_wire;
            assert!(extra < steps * buckets * 4 * 2, "{w}/{name}: {extra} bytes more than DDP");
            assert!(rs.busbw_gbs.unwrap() > 0.0 && ag.busbw_gbs.unwrap() > 0.0);
            // fp16: one small all-reduce per step, the overflow flag; the
            // gradient norm's (fp32, clipped) is a control collective, not counted.
            let flags = if w == "fp16" { steps } else { 0 };
            assert_eq!(z.collective_ops.get("all_reduce").map_or(0, |o| o.collectives), flags);
            assert_eq!(z.collectives, steps * 2 * buckets + flags);
        }
    }
    // The plan records the stage with the strategy.
    assert_eq!(r.plan.iter().map(|p| p.strategy.zero).collect::<Vec<_>>(), [0, 1, 2, 0, 1, 2]);
}

/// Activation recomputation changes memory and speed, never the maths: on
/// the CPU every training and eval loss is bit-identical with and without
/// it, for each model family, with dropout (the recomputed layers draw the
/// same numbers again), under bf16 autocast (they recompute in bf16), with
/// gradient accumulation, and on two ranks.
#[test]
fn activation_recomputation_leaves_every_loss_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    // Dropout on one rank only: thread ranks share libtorch's CPU generator,
    // so their dropout masks depend on the threads' interleaving.
    let workloads = |setting: &str, dropout: f64| {
        let extra = format!("{setting}\neval_every = 3");
        let gpt = tiny_gpt("gpt", 6, &format!("{extra}\ngrad_accum = 2"))
            .replace("preset = \"tiny\" }", &format!("preset = \"tiny\", dropout = {dropout} }}"));
        let bf16 = tiny_gpt("gpt-bf16", 6, &format!("{extra}\nprecision = \"bf16\""));
        let encoder = format!(
            "\n[[workload]]\nname = \"encoder\"\nmodel = {{ kind = \"encoder\", preset = \"tiny\", dropout = {dropout} }}\n\
             data = {{ kind = \"regression\", noise = 0.3 }}\nbatch = 8\nseq_len = 8\nsteps = 6\n\
             optimizer = {{ kind = \"adamw\", lr = 2e-3 }}\neval_batches = 2\n{extra}\n"
        );
        let mlp = tiny_gpt("mlp", 6, &extra).replace("kind = \"gpt\"", "kind = \"mlp\"");
        gpt + &bf16 + &encoder + &mlp
    };
    let losses = |setting: &str, world: u32, file: &str| {
        let dropout = if world == 1 { 0.1 } else { 0.0 };
        let text = suite("recompute", &format!("world_size = {world}"), &workloads(setting, dropout));
        let s = write(dir.path(), &format!("{file}.toml"), &text);
        run_ok(harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", &format!("{file}.json")]));
        let r = RunResult::read(&dir.path().join(format!("{file}.json"))).unwrap();
        r.entries
            .iter()
            .map(|e| {
                let m = e.metrics.clone().unwrap_or_else(|| panic!("{file}: {} has no metrics", e.id));
                let curve: Vec<(u64, u64)> = m.loss_curve.iter().map(|&(step, _, loss)| (step, loss.to_bits())).collect();
                let evals: Vec<u64> = m.eval_curve.iter().map(|&(_, _, loss)| loss.to_bits()).collect();
                assert_eq!(m.steps, 6, "{file}: {}", e.id);
                assert_eq!(m.model.get("recompute").is_some(), setting.contains("all") || setting.contains('2'), "{file}: {}", e.id);
                (e.id.clone(), curve, evals, m.final_eval_loss.map(f64::to_bits))
            })
            .collect::<Vec<_>>()
    };
    for world in [1, 2] {
        let plain = losses("", world, &format!("plain-{world}"));
        assert_eq!(plain.len(), 4);
        for (setting, file) in [("recompute = \"all\"", "all"), ("recompute = 2", "every2"), ("recompute = \"none\"", "none")] {
            let again = losses(setting, world, &format!("{file}-{world}"));
            for (p, a) in plain.iter().zip(&again) {
                assert_eq!(p, a, "{setting}, {world} rank(s): {} differs from the run without recomputation", p.0);
            }
        }
    }
}

/// `harness run --trace`: a Chrome trace of one step per entry (the first
/// after warm-up), on rank 0 of two, holding libtorch's operators, the
/// step's phases and the plugin's calls as ranges; the result is the run's
/// as without it.
#[test]
fn trace_records_one_step_with_its_operators_phases_and_plugin_calls() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = format!("\n[[plugin]]\nname = \"topk\"\npath = \"{}\"\n", artifact("topk.wasm").display());
    let strategy = "\n[[strategy]]\nname = \"topk\"\ncompressor = \"topk\"\ncompressor_config = { ratio = 0.1 }\n";
    let text = suite("traced", "world_size = 2", &(plugin + &tiny_gpt("w", 5, "") + strategy));
    let s = write(dir.path(), "s.toml", &text);
    let out = run_ok(harness(dir.path()).arg("run").arg(&s).args(["--out", "r.json", "--trace"]));
    assert!(String::from_utf8_lossy(&out.stderr).contains("w/topk/r0: trace of one step in"), "{}", String::from_utf8_lossy(&out.stderr));
    let traces: Vec<_> = std::fs::read_dir(dir.path().join("r.trace")).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(traces, vec![std::ffi::OsString::from("w_topk_r0.json")], "one trace, rank 0's");
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.path().join("r.trace/w_topk_r0.json")).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let named = |cat: &str| -> Vec<&str> { events.iter().filter(|e| e["cat"] == cat).map(|e| e["name"].as_str().unwrap()).collect() };
    let ranges = named("user_annotation");
    for phase in ["data", "forward", "backward", "communicate", "optimizer", "strategy"] {
        assert_eq!(ranges.iter().filter(|r| **r == format!("harness: {phase}")).count(), 1, "one step's {phase}: {ranges:?}");
    }
    assert!(ranges.contains(&"plugin topk: compress"), "{ranges:?}");
    let ops = named("cpu_op");
    assert!(ops.contains(&"aten::topk") && ops.iter().any(|o| o.starts_with("aten::mm") || o.starts_with("aten::addmm")), "{ops:?}");
    let r = results(&dir.path().join("r.json"));
    assert_eq!(r["entries"][0]["metrics"]["steps"], 5);
}

/// A bf16 workload on a CPU without bf16 arithmetic (emulated here by
/// holding libtorch below AVX-512, as on an AVX2 machine) is run with a
/// warning naming it and why it is slow.
#[test]
fn bf16_on_a_cpu_without_bf16_arithmetic_is_said_to_be_emulated() {
    let dir = tempfile::tempdir().unwrap();
    let w = tiny_gpt("half", 4, "precision = \"bf16\"") + &tiny_gpt("full", 4, "");
    let s = write(dir.path(), "s.toml", &suite("bf16", "", &w));
    let o = run_ok(
        harness(dir.path())
            .args(["run", "-q"])
            .arg(&s)
            .args(["--out", "r.json"])
            .env("ATEN_CPU_CAPABILITY", "avx2")
            .env("ONEDNN_MAX_CPU_ISA", "AVX2"),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    let warning = err.lines().find(|l| l.starts_with("warning: ")).unwrap_or_else(|| panic!("no warning in\n{err}"));
    assert!(warning.contains("`half` train(s) in bf16, and this CPU has no bf16 arithmetic"), "{warning}");
    assert!(!warning.contains("`full`"), "{warning}");
}
