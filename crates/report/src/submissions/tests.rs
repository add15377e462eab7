//! Boards built from fixtures: three submissions of a compressor to the
//! CPU standard suite, each run without `--track` (beside every track's
//! baseline) on its own machine, so each run's baselines take their own
//! times. Two of them are builds of one algorithm whose training is bit
//! for bit the same (their times differ by noise); the third is slower.

use std::path::{Path, PathBuf};

use super::*;
use crate::results::{EntryResult, EntryStatus, Metrics, RunResult, Submission};
use crate::submission::verify::Verdict;
use crate::submission::{Bundle, Manifest, SuiteRef};
use crate::suite::standard::Entry;

const SUITE: &str = include_str!("../../../../suites/cpu-standard.toml");

/// Seconds to target: the run's machine speed x the strategy's own
/// factor x a little noise per repeat.
fn seconds(machine: f64, factor: f64, repeat: u32, noise: f64) -> f64 {
    machine * factor * (1.0 + noise * [0.0, 1.0, -1.0][repeat as usize % 3])
}

/// A verified bundle of a run that entered `plugin`, whose submission
/// takes `factor[track]` of its own baseline's time on every workload.
fn bundle(plugin: &str, machine: f64, factor: &dyn Fn(&str) -> f64, noise: f64, folder: &str) -> Verified {
    let mut suite = crate::suite::Suite::parse(Path::new("suites/cpu-standard.toml"), SUITE.to_owned()).unwrap();
    let entry = Entry { kind: "compressor".into(), path: PathBuf::from("p.wasm"), config: None };
    let (tracks, _) = suite.select(None, Some(&entry)).unwrap();
    assert_eq!(tracks.len(), 4, "without --track every track runs");
    let fp = crate::results::testing::machine();
    let mut r = RunResult::new(&suite, fp);
    r.started_at = format!("2026-12-01T00:00:0{}Z", folder.len() % 10);
    let sha = format!("{folder:0<64}");
    r.submission = Some(Submission {
        suite_version: Some("1.2".into()),
        hardware_class: Some("cpu".into()),
        released_suite: true,
        tracks: tracks.clone(),
        gpus: 1,
        entered: vec![crate::results::EnteredPlugin {
            kind: "compressor".into(),
            name: plugin.into(),
            version: "0.1.0".into(),
            transport: "wasm".into(),
            sha256: sha.clone(),
            ..Default::default()
        }],
        unofficial: vec![],
    });
    for p in r.plan.clone() {
        let workload = &suite.spec.workloads[p.workload].name;
        let name = &p.strategy.name;
        // The 100 Mbit/s link's baseline is 5 times slower than the
        // in-process one: a ratio against the wrong baseline shows.
        let base = if name.contains("100mbps") { 5.0 } else { 1.0 };
        let f = name.strip_prefix("submission-").map_or(1.0, factor);
        let t = seconds(machine * base, f, p.repeat, if name.starts_with("submission-") { noise } else { 0.001 });
        r.entries.push(EntryResult {
            id: p.id.clone(),
            workload: workload.clone(),
            strategy: name.clone(),
            repeat: p.repeat,
            seed: p.seed,
            status: EntryStatus::Ok,
            device: "cpu".into(),
            metrics: Some(Metrics {
                steps: 10,
                tokens_per_s: 1000.0 / t,
                time_to_target_s: Some(t),
                target_loss: Some(1.0),
                eval_curve: vec![(5, t / 2.0, 2.0), (10, t, 0.9)],
                ..Default::default()
            }),
            histograms: Default::default(),
        });
    }
    let manifest = Manifest {
        bundle_format: 1,
        harness_version: "0".into(),
        created_at: r.started_at.clone(),
        suite: SuiteRef { name: r.suite.name.clone(), version: Some("1.2".into()), sha256: String::new(), released_as: None },
        hardware_class: Some("cpu".into()),
        gpus: 1,
        tracks: crate::submission::entered_tracks(&r),
        plugins: vec![],
        files: vec![],
    };
    Verified {
        bundle: Bundle { dir: PathBuf::from(format!("{folder}.bundle")), manifest, result: r },
        verdict: Verdict::default(),
        id: sha.clone(),
        same_as: None,
        files: Files { folder: sha[..16].to_owned(), copied: vec![], not_copied: vec![] },
        copies: vec![],
    }
}

fn fixtures() -> Vec<Verified> {
    let fast = |t: &str| if t == "compression" { 0.8 } else { 0.4 };
    vec![
        // One algorithm built twice, run on two machines, 2 and 3 s to the
        // baseline's target: the same ratios but for noise.
        bundle("sign-rust", 2.0, &fast, 0.01, "a1"),
        bundle("sign-python", 3.0, &fast, 0.012, "b2"),
        // Slower than the baseline on the plain link, faster over 100 Mbit/s.
        bundle("slow", 1.0, &|t| if t == "compression" { 1.5 } else { 0.9 }, 0.01, "c3"),
    ]
}

#[test]
fn each_submission_is_ranked_only_in_its_tracks_against_its_own_runs_baseline_with_ties_shared() {
    let bundles = fixtures();
    for v in &bundles {
        assert_eq!(v.bundle.manifest.tracks, ["compression", "compression-100mbps"], "the MANIFEST lists the entered tracks");
    }
    let subs = boards(&bundles);
    let tracks: Vec<&str> = subs.iter().map(|b| b.track.as_str()).collect();
    assert_eq!(tracks, ["compression", "compression-100mbps"], "no board for tracks no submission entered");
    for b in &subs {
        assert_eq!(b.workloads, ["gpt-tiny", "resnet-tiny", "t5-tiny"]);
        assert_eq!(b.rows.iter().filter(|r| r.ranked()).count(), 3, "{}", b.track);
        let row = |name: &str| b.rows.iter().find(|r| r.plugin == name).unwrap();
        // Against its own run's baseline on this track: the factor, whatever
        // the machine and whatever the other track's baseline took.
        let want = if b.track == "compression" { [0.8, 0.8, 1.5] } else { [0.4, 0.4, 0.9] };
        for (name, want) in ["sign-rust", "sign-python", "slow"].into_iter().zip(want) {
            for s in row(name).ratios.iter().map(|s| s.as_ref().unwrap()) {
                assert!((s.olympic_mean - want).abs() < 0.02, "{} {name}: {} not {want}", b.track, s.olympic_mean);
            }
        }
        // The two builds tie; the third is behind both beyond doubt.
        let (rust, python, slow) = (row("sign-rust"), row("sign-python"), row("slow"));
        assert_eq!((rust.rank, rust.tied), (Some(1), true), "{}", b.track);
        assert_eq!((python.rank, python.tied), (Some(1), true), "{}", b.track);
        assert_eq!((slow.rank, slow.tied), (Some(3), false), "{}", b.track);
        assert_eq!(rank_cell(rust), "=1");
        assert_eq!(against_baseline(slow.ratios[0].as_ref().unwrap()), Some(if b.track == "compression" { "slower" } else { "faster" }));
    }
    let md = markdown(&subs, &bundles);
    assert!(!md.contains("track `batch-size`") && !md.contains("track `checkpointing`"), "{md}");
    assert!(md.contains("track `compression`") && md.contains("track `compression-100mbps`"), "{md}");
    assert_eq!(md.lines().filter(|l| l.starts_with("| =1 | sign-")).count(), 4, "{md}");
}

#[test]
fn the_per_workload_tables_compare_each_entry_with_its_tracks_baseline_of_its_run() {
    let bundles = fixtures();
    let results: Vec<RunResult> = bundles.iter().map(|v| v.bundle.result.clone()).collect();
    let boards = crate::boards(&results);
    let gpt: Vec<&crate::Board> = boards.iter().filter(|b| b.workload == "gpt-tiny").collect();
    let tracks: Vec<Option<&str>> = gpt.iter().map(|b| b.track.as_deref()).collect();
    assert_eq!(tracks, [Some("compression"), Some("compression-100mbps")], "a table per track");
    for b in gpt {
        // One baseline per run, never pooled: 3 repeats each.
        let baselines: Vec<&crate::Row> = b.rows.iter().filter(|r| r.group.baseline).collect();
        assert_eq!(baselines.len(), 3, "{:?}", b.track);
        assert!(baselines.iter().all(|r| r.group.runs.len() == 3 && r.verdicts.is_empty()));
        // Each submission's time against its own run's baseline.
        for r in b.rows.iter().filter(|r| !r.group.baseline) {
            let want = match (b.track.as_deref(), r.group.run.as_deref().unwrap().contains("slow")) {
                (Some("compression"), false) => 0.8,
                (Some("compression"), true) => 1.5,
                (_, false) => 0.4,
                (_, true) => 0.9,
            };
            let (ratio, _) = r.verdicts.get(&Metric::TimeToTarget).unwrap();
            assert!((ratio - want).abs() < 0.02, "{:?}: {ratio} not {want}", r.group.run);
        }
    }
}
