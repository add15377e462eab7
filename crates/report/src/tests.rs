use super::*;
use crate::board::{flag_mixed_graphs, rank, score};
use harness_format::results::Metrics;
use harness_format::results::NcclRecord;

#[test]
fn without_a_target_checkpoint_policies_rank_by_goodput_not_tokens_per_second() {
    let row = |name: &str, tokens_per_s: f64, goodput: Option<f64>| {
        let runs: Vec<Metrics> =
            (0..3).map(|_| Metrics { tokens_per_s, goodput_steps_per_s: goodput, steps: 100, ..Default::default() }).collect();
        score(Group {
            suite: "s".into(),
            version: None,
            workload: "w".into(),
            strategy: name.into(),
            device: "cpu".into(),
            switches: String::new(),
            baseline: false,
            track: None,
            run: None,
            parts: Default::default(),
            runs,
            repeats: vec![0, 1, 2],
            step_histograms: vec![],
            failures: vec![],
        })
    };
    // every-n checkpoints: slower steps, but less work lost to failures.
    let mut rows = vec![row("none", 1000.0, Some(5.0)), row("every-n", 900.0, Some(7.0))];
    rank(&mut rows);
    assert_eq!((rows[0].group.strategy.as_str(), rows[0].rank), ("every-n", Some(1)));
    // Without failures or checkpoints, tokens/s decides.
    let mut rows = vec![row("a", 900.0, None), row("b", 1000.0, None)];
    rank(&mut rows);
    assert_eq!(rows[0].group.strategy, "b");
}

#[test]
fn strategies_run_as_cuda_graphs_and_eagerly_side_by_side_are_flagged() {
    let row = |name: &str, graph_steps: u64| {
        let runs = vec![Metrics { tokens_per_s: 100.0, steps: 10, cuda_graph_steps: graph_steps, ..Default::default() }];
        let group = Group {
            suite: "s".into(),
            version: None,
            workload: "w".into(),
            strategy: name.into(),
            device: "cuda".into(),
            switches: String::new(),
            baseline: false,
            track: None,
            run: None,
            parts: Default::default(),
            runs,
            repeats: vec![0],
            step_histograms: vec![],
            failures: vec![],
        };
        score(group)
    };
    let mut mixed = vec![row("graphed", 8), row("eager", 0)];
    flag_mixed_graphs(&mut mixed);
    assert!(mixed[0].flags[0].starts_with("steps replayed as a CUDA graph"), "{:?}", mixed[0].flags);
    assert!(mixed[1].flags[0].starts_with("steps eager"), "{:?}", mixed[1].flags);
    for same in [vec![row("a", 8), row("b", 8)], vec![row("a", 0), row("b", 0)]] {
        let mut rows = same;
        flag_mixed_graphs(&mut rows);
        assert!(rows.iter().all(|r| r.flags.is_empty()), "like for like needs no flag");
    }
}

#[test]
fn results_of_different_suite_versions_are_never_pooled() {
    use harness_format::results::testing::result;
    let results =
        [result("std", Some("1.0"), 10.0), result("std", Some("1.1"), 30.0), result("std", Some("1.1"), 50.0), result("own", None, 7.0)];
    let boards = boards(&results);
    // Each row's repeats, row by row: two runs of one version are two
    // rows, never pooled either.
    let runs = |v: Option<&str>| {
        let b = boards.iter().find(|b| b.suite == "std" && b.version.as_deref() == v).expect("a board per version");
        b.rows.iter().map(|r| r.group.runs.iter().map(|m| m.tokens_per_s).collect::<Vec<_>>()).collect::<Vec<_>>()
    };
    assert_eq!(boards.len(), 3);
    assert_eq!(runs(Some("1.0")), [[10.0]]);
    assert_eq!(runs(Some("1.1")), [[30.0], [50.0]]);
    let md = leaderboard_markdown(&boards, &[]);
    assert!(md.contains("## Suite `std` version 1.0\n") && md.contains("## Suite `std` version 1.1\n"), "{md}");
    assert!(md.contains("## Suite `own`\n"), "{md}");
}

#[test]
fn runs_with_switches_are_never_pooled_with_default_runs_and_say_so() {
    use harness_format::results::testing::result;
    let mut switched = result("s", None, 30.0);
    switched.switches = [("HARNESS_FUSED_MLP".to_owned(), "0".to_owned())].into();
    let results = [result("s", None, 10.0), switched.clone(), result("s", None, 20.0)];
    let boards = boards(&results);
    assert_eq!(boards.len(), 2);
    let runs = |b: &Board| b.rows.iter().flat_map(|r| r.group.runs.iter().map(|m| m.tokens_per_s)).collect::<Vec<_>>();
    assert_eq!((boards[0].switches.as_str(), runs(&boards[0])), ("", vec![10.0, 20.0]));
    assert_eq!((boards[1].switches.as_str(), runs(&boards[1])), ("HARNESS_FUSED_MLP=0", vec![30.0]));
    assert_eq!(boards[0].rows.len(), 2, "two runs are two rows");
    let md = leaderboard_markdown(&boards, &[]);
    assert_eq!(md.matches("switches: `HARNESS_FUSED_MLP=0`").count(), 1, "{md}");
    let html = html::page(&boards, &[], &[], &[]);
    assert_eq!(html.matches("switches: <code>HARNESS_FUSED_MLP=0</code>").count(), 1);
    assert!(compare_table(&results[..1], &[switched.clone()]).contains("switches: A none; B HARNESS_FUSED_MLP=0\n"));
    assert!(!compare_table(&results[..1], &results[2..]).contains("switches"));
    assert!(summary_table(&switched).contains("\nswitches: HARNESS_FUSED_MLP=0 (not the default work)"));
    assert!(!summary_table(&results[0]).contains("switches"));
}

#[test]
fn compare_shows_what_the_result_files_chose_without_sending_it_to_the_terminal() {
    use harness_format::results::testing::result;
    let mut a = result("s", None, 10.0);
    let b = result("s", None, 20.0);
    for e in &mut a.entries {
        e.strategy = "base\u{1b}]0;title\u{7}".into();
        e.device = "cpu\u{202e}".into();
    }
    a.switches = [("HARNESS_X".to_owned(), "\u{1b}[2J".to_owned())].into();
    let text = compare_table(&[a], &[b]);
    assert!(!text.chars().any(|c| harness_format::fmt::unseen(c) && c != '\n'), "{text:?}");
    assert!(text.contains(r"A: base\u{1b}]0;title\u{7}"), "{text}");
    assert!(text.contains(r"on cpu\u{202e} vs cpu"), "{text}");
    assert!(text.contains(r"switches: A HARNESS_X=\u{1b}[2J; B none"), "{text}");
}

/// Issue 60: `harness compare` of two runs of one suite 14 minutes
/// apart called the unchanged baseline's 2x throughput difference "B
/// better (significant)": three repeats inside one run do not see the
/// variance between runs. Between two runs a timing difference is
/// called only beyond the class's run-to-run band; inside one run the
/// intervals decide, as before.
#[test]
fn compare_calls_a_timing_difference_between_two_runs_only_beyond_the_run_to_run_band() {
    use harness_format::results::testing::result;
    let run = |started: &str, tokens_per_s: f64| {
        let mut r = result("s", None, tokens_per_s);
        r.started_at = started.into();
        let first = r.entries[0].clone();
        r.entries = (0..3u32)
            .map(|k| {
                let mut e = first.clone();
                e.repeat = k;
                e.id = format!("w/baseline/r{k}");
                e.metrics.as_mut().unwrap().tokens_per_s = tokens_per_s * (1.0 + 0.01 * f64::from(k));
                e
            })
            .collect();
        r
    };
    let row = |text: &str| text.lines().find(|l| l.contains("tokens/s")).unwrap_or_default().to_owned();
    let twice = compare_table(&[run("t1", 1000.0)], &[run("t2", 2000.0)]);
    assert!(row(&twice).contains("within run-to-run noise (±130%)"), "{twice}");
    assert!(
        twice.contains("A and B are two runs: a timing difference is called only beyond the run-to-run band of the CPU (±130%"),
        "{twice}"
    );
    let far = compare_table(&[run("t1", 1000.0)], &[run("t2", 2500.0)]);
    assert!(row(&far).contains("B better (significant)"), "{far}");
    let one_run = compare_table(&[run("t1", 1000.0)], &[run("t1", 2000.0)]);
    assert!(row(&one_run).contains("B better (significant)") && !one_run.contains("two runs"), "{one_run}");
}

#[test]
fn the_summary_shows_what_a_plugin_call_cost_when_plugins_ran() {
    use harness_format::results::testing::result;
    let built_in = result("s", None, 10.0);
    assert!(!summary_table(&built_in).contains("plugin µs/call"));
    let record = |calls: u64, mean_ms: f64| -> harness_format::plugin::PluginRecord {
        serde_json::from_value(serde_json::json!({
            "slot": "compressor", "name": "topk", "version": "0.1.0", "kind": "compressor", "transport": "wasm",
            "abi": "0.3.0", "sha256": "ab", "path": "topk.wasm", "calls": calls, "host_ops": 0, "read_bytes": 0,
            "call": { "count": calls, "mean_ms": mean_ms, "p50_ms": mean_ms, "p90_ms": mean_ms, "p99_ms": mean_ms,
                      "p999_ms": mean_ms, "max_ms": mean_ms },
        }))
        .unwrap()
    };
    let mut with = built_in.clone();
    let m = with.entries[0].metrics.as_mut().unwrap();
    // 300 calls of 2 us and 100 of 6 us: 3 us a call.
    m.plugins = vec![record(300, 0.002), record(100, 0.006)];
    assert!((plugin_call_us(m).unwrap() - 3.0).abs() < 1e-9);
    let table = summary_table(&with);
    assert!(table.contains("plugin µs/call") && table.contains(" 3.00 "), "{table}");
}

#[test]
fn each_strategy_says_once_which_nccl_transports_and_settings_it_ran_with() {
    let with = |transports: &[&str], settings: &[(&str, &str)]| Metrics {
        nccl: Some(NcclRecord {
            version: Some("2.27.3+cuda12.9".into()),
            settings: settings.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            transports: transports.iter().map(|t| t.to_string()).collect(),
            note: None,
        }),
        ..Default::default()
    };
    let nvlink = with(&["P2P/CUMEM/read"], &[]);
    let net = with(&["NET/Socket/0"], &[("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")]);
    let unknown = Metrics { nccl: Some(NcclRecord { note: Some("NCCL_DEBUG=WARN".into()), ..Default::default() }), ..Default::default() };
    let lines = nccl_by_strategy(
        [("nvlink", &nvlink), ("net", &net), ("nvlink", &nvlink), ("quiet", &unknown), ("cpu", &Metrics::default())].into_iter(),
    );
    assert_eq!(
        lines,
        [
            ("nvlink".to_owned(), "NCCL 2.27.3+cuda12.9; via P2P/CUMEM/read".to_owned()),
            ("net".to_owned(), "NCCL 2.27.3+cuda12.9; via NET/Socket/0; NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1".to_owned()),
            ("quiet".to_owned(), "NCCL (version unknown); transports unknown (NCCL_DEBUG=WARN)".to_owned()),
        ]
    );
}

#[test]
fn a_switches_line_cannot_leave_its_code_span() {
    use harness_format::results::testing::result;
    let mut r = result("s", None, 10.0);
    r.switches = [("X".to_owned(), "`|\r\n| 1 | <script>".to_owned())].into();
    let md = leaderboard_markdown(&boards(&[r]), &[]);
    let line = md.lines().find(|l| l.starts_with("switches: ")).expect("a switches line");
    assert_eq!(line, "switches: <code>X=\\`\\|  \\| 1 \\| &lt;script&gt;</code> (not the default work; docs/benchmarks.md)");
    assert!(!md.contains("<script>"), "{md}");
}
