//! `harness report` and `harness compare` on result files with known values.

use std::path::Path;

use harness::device::Fingerprint;
use harness::measure::LatencySummary;
use harness::results::{EntryResult, EntryStatus, Metrics, RunResult, SuiteRecord, FORMAT_VERSION};
use harness::suite::{PlanEntry, Strategy};

use crate::*;

fn machine() -> Fingerprint {
    Fingerprint {
        hostname: "test".into(),
        os: "Linux".into(),
        cpu: "cpu".into(),
        cpu_cores: 2,
        memory_bytes: 1 << 34,
        gpus: vec![],
        driver: None,
        cuda: None,
        cuda_driver_api: None,
        libtorch: Some("2.11.0".into()),
        nccl: None,
        harness_version: "0".into(),
        git_revision: "r".into(),
        cpu_kernels: None,
        environment: Default::default(),
    }
}

fn strategy(name: &str, baseline: bool, compressor: &str) -> Strategy {
    Strategy {
        name: name.into(),
        baseline,
        compressor: compressor.into(),
        batch_policy: "fixed".into(),
        checkpoint: "none".into(),
        compressor_config: None,
        batch_policy_config: None,
        checkpoint_config: None,
        workloads: None,
        link: None,
        zero: 0,
        checkpoint_compress: false,
        checkpoint_async: true,
        nccl: Default::default(),
        nccl_transport: Default::default(),
        reduce_dtype: Default::default(),
    }
}

/// A step histogram with `n` values around `ms` milliseconds.
fn hist(ms: f64, n: u64) -> String {
    let mut h = harness::measure::new_histogram();
    for i in 0..n {
        h.record((ms * 1e6) as u64 + i * 1000).unwrap();
    }
    harness::measure::encode(&h)
}

/// One entry with the given throughput, time to target and bytes per step.
fn entry(s: &Strategy, repeat: u32, tps: f64, ttt: Option<f64>, bytes_per_step: u64) -> (PlanEntry, EntryResult) {
    let id = format!("w/{}/r{repeat}", s.name);
    let steps = 100;
    let step = LatencySummary {
        count: 90,
        mean_ms: 1e3 / tps,
        p50_ms: 1e3 / tps,
        p90_ms: 1.1e3 / tps,
        p99_ms: 1.2e3 / tps,
        p999_ms: 1.3e3 / tps,
        max_ms: 1.3e3 / tps,
    };
    let m = Metrics {
        steps,
        tokens_per_s: tps,
        step: Some(step),
        target_loss: Some(1.0),
        time_to_target_s: ttt,
        steps_to_target: ttt.map(|_| 50),
        loss_floor: Some(0.9),
        loss_curve: (0..20).map(|i| (i * 5, i as f64 * 0.1, 3.0 - i as f64 * 0.1)).collect(),
        bytes_on_wire: bytes_per_step * steps,
        batch_changes: vec![(0, 8, 1)],
        ..Default::default()
    };
    let plan = PlanEntry { id: id.clone(), workload: 0, strategy: s.clone(), repeat, seed: repeat as u64 };
    let e = EntryResult {
        id,
        workload: "w".into(),
        strategy: s.name.clone(),
        repeat,
        seed: repeat as u64,
        status: EntryStatus::Ok,
        device: "cpu".into(),
        metrics: Some(m),
        histograms: [("step".to_owned(), hist(1e3 / tps, 90))].into(),
    };
    (plan, e)
}

/// Baseline at ~1000 tokens/s; `fast` clearly faster; `same` no different
/// and claims a batch policy that never acted;
/// `lossy` claims top-k but sends the baseline's bytes and misses the target
/// once.
fn fixture() -> RunResult {
    let base = strategy("base", true, "allreduce");
    let fast = strategy("fast", false, "allreduce");
    // Claims a batch policy but never changed the batch: flagged.
    let mut same = strategy("same", false, "allreduce");
    same.batch_policy = "memory-growth".into();
    let lossy = strategy("lossy", false, "topk");
    let mut pairs = Vec::new();
    for r in 0..5u32 {
        let jitter = [0.0, 3.0, -2.0, 5.0, -4.0][r as usize];
        pairs.push(entry(&base, r, 1000.0 + jitter, Some(10.0 + jitter / 10.0), 4000));
        pairs.push(entry(&fast, r, 1300.0 + jitter, Some(8.0 + jitter / 10.0), 4000));
        pairs.push(entry(&same, r, 1000.0 - jitter, Some(10.0 - jitter / 10.0), 4000));
        pairs.push(entry(&lossy, r, 1100.0 + jitter, if r == 2 { None } else { Some(9.0) }, 4000));
    }
    RunResult {
        format_version: FORMAT_VERSION,
        suite: SuiteRecord { name: "fixture".into(), path: "fixture.toml".into(), sha256: "0".into(), text: String::new() },
        machine: machine(),
        plan: pairs.iter().map(|p| p.0.clone()).collect(),
        entries: pairs.into_iter().map(|p| p.1).collect(),
        complete: true,
        started_at: "2026-11-22T00:00:00Z".into(),
        updated_at: "2026-11-22T00:00:00Z".into(),
        submission: None,
        switches: Default::default(),
    }
}

fn write_fixture(dir: &Path) {
    let json = serde_json::to_string_pretty(&fixture()).unwrap();
    write(dir, "fixture.json", &json);
}

#[test]
fn leaderboard_ranks_scores_and_flags() {
    let dir = tempfile::tempdir().unwrap();
    write_fixture(dir.path());
    run_ok(harness(dir.path()).args(["report", "fixture.json", "--out-dir", "out"]));
    let md = std::fs::read_to_string(dir.path().join("out/LEADERBOARD.md")).unwrap();
    insta::assert_snapshot!(md);
}

#[test]
fn compare_prints_ratios_and_significance() {
    let dir = tempfile::tempdir().unwrap();
    write_fixture(dir.path());
    // Two files: A holds the baseline only, B the fast strategy only.
    let mut a = fixture();
    a.entries.retain(|e| e.strategy == "base");
    let mut b = fixture();
    b.entries.retain(|e| e.strategy == "fast");
    write(dir.path(), "a.json", &serde_json::to_string(&a).unwrap());
    write(dir.path(), "b.json", &serde_json::to_string(&b).unwrap());
    let o = run_ok(harness(dir.path()).args(["compare", "a.json", "b.json"]));
    insta::assert_snapshot!(String::from_utf8_lossy(&o.stdout));
}

#[test]
fn what_a_file_chose_reaches_the_terminal_escaped() {
    // A result file and a suite that spell escape sequences (set the
    // terminal's title, clear the screen): the errors and the table quote
    // them, escaped.
    let dir = tempfile::tempdir().unwrap();
    let mut a = fixture();
    a.entries.iter_mut().for_each(|e| e.strategy = "base\u{1b}]0;title\u{7}".into());
    write(dir.path(), "a.json", &serde_json::to_string(&a).unwrap());
    let bad = serde_json::to_string(&fixture()).unwrap().replacen("\"ok\"", "\"ok\\u001b[2J\"", 1);
    write(dir.path(), "bad.json", &bad);
    write(dir.path(), "bad.toml", "[suite]\nname = \"s\"\n\"k\\u001b[2J\" = 1 # \u{202e}\n");
    let table = run_ok(harness(dir.path()).args(["compare", "a.json", "a.json"]));
    let failed = harness(dir.path()).args(["compare", "bad.json", "a.json"]).output().unwrap();
    let invalid = harness(dir.path()).args(["validate", "bad.toml"]).output().unwrap();
    for (out, says) in [
        (&table.stdout, r"A: base\u{1b}]0;title\u{7}"),
        (&failed.stderr, r"unknown variant `ok\u{1b}[2J`"),
        (&invalid.stderr, r"unknown field `k\u{1b}[2J`"),
    ] {
        let text = String::from_utf8_lossy(out);
        assert!(text.contains(says), "{text}");
        assert!(!text.chars().any(|c| harness::fmt::unseen(c) && c != '\n'), "{text:?}");
    }
    assert!(String::from_utf8_lossy(&invalid.stderr).contains("\"k\\u001b[2J\" = 1 # \u{fffd}"));
}

#[test]
fn report_rejects_an_empty_folder() {
    let dir = tempfile::tempdir().unwrap();
    let out = harness(dir.path()).args(["report", "."]).output().unwrap();
    assert_eq!(out.status.code(), Some(harness::cli::exit::ERROR));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no result files or bundles found"));
}

/// Renders the page in headless Chromium: no console messages, and the
/// plots are drawn (their series colours cover many pixels).
#[test]
fn html_report_renders_in_chromium_with_plots() {
    let chromium = ["/usr/bin/chromium", "/usr/bin/chromium-browser"].into_iter().find(|p| Path::new(p).exists());
    let chromium = chromium.expect("Chromium is not installed: scripts/test.sh installs Debian's chromium package");
    let dir = tempfile::tempdir().unwrap();
    write_fixture(dir.path());
    run_ok(harness(dir.path()).args(["report", "fixture.json", "--out-dir", "out"]));
    let page = dir.path().join("out/index.html");
    let shot = dir.path().join("shot.png");
    let out = std::process::Command::new(chromium)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking"])
        .args(["--disable-component-update", "--disable-sync", "--enable-logging=stderr", "--v=0", "--window-size=1400,1600"])
        .arg(format!("--user-data-dir={}", dir.path().join("profile").display()))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", page.display()))
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    let console: Vec<&str> = log.lines().filter(|l| l.contains(":CONSOLE")).collect();
    assert!(console.is_empty(), "console messages: {console:#?}");
    assert!(shot.exists(), "no screenshot; chromium said:\n{log}");

    let decoder = png::Decoder::new(std::fs::File::open(&shot).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    let count = |rgb: [u8; 3]| buf[..info.buffer_size()].chunks(channels).filter(|p| p[..3] == rgb).count();
    // Bars, lines and legend swatches of the first four series.
    for (hex, rgb) in
        [("#1f77b4", [0x1f, 0x77, 0xb4]), ("#ff7f0e", [0xff, 0x7f, 0x0e]), ("#2ca02c", [0x2c, 0xa0, 0x2c]), ("#d62728", [0xd6, 0x27, 0x28])]
    {
        let n = count(rgb);
        assert!(n > 2000, "series colour {hex} covers only {n} pixels");
    }
}

#[test]
fn project_checks_the_committed_runs_and_refuses_a_bad_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let root = repo_root();
    let r = |p: &str| root.join(p).display().to_string();
    let o = run_ok(harness(dir.path()).args([
        "project",
        "--check",
        &r("results/h200x4/scaling-625ab31/scaling-gpt2-124m/harness-1.json"),
        &r("results/h200x4/scaling-625ab31/scaling-gpt2-124m/harness-2.json"),
        "--bench",
        &r("results/h200x4/scaling-625ab31/busbw/harness-busbw-gpt2-124m-2.json"),
    ]));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.starts_with("PROJECTION"), "{out}");
    // DDP is predicted; ZeRO-2 has no other entry to take its costs from.
    assert!(out.contains("1 of 1 predictions within 10%"), "{out}");
    assert!(out.contains("zero2/r0: no other entry of strategy zero2"), "{out}");
    let o = harness(dir.path()).args(["project", &r("results/h200x2/harness-1gpu.json"), "--cluster", "2x4"]).output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("more than one node needs `net=`"));
}

/// docs/claims.md's T5-large on 8 GPUs and 2 x 4 over 10 and 20 Gbps,
/// calibrated on the two-H100 runs (the bandwidth their DDP entry measured
/// in training): labelled, with its plot as SVG and as a page; and
/// `harness report` of a suite with a `[projection]` section puts the
/// projection in a section of its own, never on the board.
#[test]
fn project_writes_the_t5_projection_with_its_plot_and_report_shows_a_suites() {
    let dir = tempfile::tempdir().unwrap();
    let root = repo_root();
    let r = |p: &str| root.join(p).display().to_string();
    let (one, two) = (r("results/h100/families-vs-pytorch-c9e4397/t5/harness-1.json"), r("results/h100x2/claims1-t5-b9d3b69/claims1.json"));
    let o = run_ok(harness(dir.path()).args([
        "project",
        &one,
        &two,
        "--bench",
        &format!("{two}#t5-large-bf16/ddp/r0"),
        "--cluster",
        "1x8",
        "--cluster",
        "2x4:net=10Gbps",
        "--cluster",
        "2x4:net=20Gbps",
        "--summary",
        "--svg",
        "t5.svg",
        "--html",
        "t5.html",
    ]));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.starts_with("PROJECTION") && out.contains("(in training)") && out.contains("8 GPUs"), "{out}");
    let svg = std::fs::read_to_string(dir.path().join("t5.svg")).unwrap();
    assert!(svg.starts_with("<svg xmlns") && svg.contains("PROJECTION") && svg.matches("<polyline").count() == 3, "{svg}");
    let page = std::fs::read_to_string(dir.path().join("t5.html")).unwrap();
    assert!(page.contains("PROJECTION") && page.contains("<svg") && page.contains("t5-large-bf16"));

    // The same as a suite's [projection], through `harness report`.
    let mut result: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&two).unwrap()).unwrap();
    let text = result["suite"]["text"].as_str().unwrap().to_owned();
    result["suite"]["text"] = format!("{text}\n[projection]\nclusters = [\"1x8\", \"2x4:net=10Gbps\"]\n").into();
    result["suite"]["sha256"] = "with-projection".into();
    std::fs::write(dir.path().join("claims1.json"), result.to_string()).unwrap();
    std::fs::copy(&one, dir.path().join("t5-1.json")).unwrap();
    run_ok(harness(dir.path()).args(["report", "claims1.json", "t5-1.json", "--out-dir", "out"]));
    let md = std::fs::read_to_string(dir.path().join("out/LEADERBOARD.md")).unwrap();
    let (board, projection) = md.split_once("## Projections (not measurements)").expect("a projection section");
    assert!(!board.contains("PROJECTION"), "the board holds measured rows only");
    assert!(projection.contains("PROJECTION") && projection.contains("10 Gbps"), "{projection}");
    let html = std::fs::read_to_string(dir.path().join("out/index.html")).unwrap();
    assert!(html.contains("id=\"projections\"") && html.contains("PROJECTION (a calibrated model"));
}
