//! Boards built from fixtures: three submissions of a compressor to the
//! CPU standard suite, each run without `--track` (beside every track's
//! baseline) on its own machine, so each run's baselines take their own
//! times. Two of them are builds of one algorithm whose training is bit
//! for bit the same (their times differ by noise); the third is slower.

use std::path::{Path, PathBuf};

use super::*;
use crate::reproduction::Reproduced;
use crate::submission::verify::Verdict;
use crate::submission::{Bundle, Manifest, SuiteRef};
use harness_format::results::{EntryResult, EntryStatus, Metrics, RunResult, Submission};
use harness_format::suite::standard::Entry;

const SUITE: &str = include_str!("../../../../suites/cpu-standard.toml");

/// Seconds to target: the run's machine speed x the strategy's own
/// factor x a little noise per repeat.
fn seconds(machine: f64, factor: f64, repeat: u32, noise: f64) -> f64 {
    machine * factor * (1.0 + noise * [0.0, 1.0, -1.0][repeat as usize % 3])
}

/// A verified bundle of a run that entered `plugin`, whose submission
/// takes `factor[track]` of its own baseline's time on every workload.
fn bundle(plugin: &str, machine: f64, factor: &dyn Fn(&str) -> f64, noise: f64, folder: &str) -> Verified {
    let mut suite = harness_format::suite::Suite::parse(Path::new("suites/cpu-standard.toml"), SUITE.to_owned()).unwrap();
    let entry = Entry { kind: "compressor".into(), path: PathBuf::from("p.wasm"), config: None };
    let (tracks, _) = suite.select(None, Some(&entry)).unwrap();
    assert_eq!(tracks.len(), 4, "without --track every track runs");
    let fp = harness_format::results::testing::machine();
    let mut r = RunResult::new(&suite, fp);
    r.started_at = format!("2026-12-01T00:00:0{}Z", folder.len() % 10);
    let sha = format!("{folder:0<64}");
    r.submission = Some(Submission {
        suite_version: Some("1.2".into()),
        hardware_class: Some("cpu".into()),
        released_suite: true,
        tracks: tracks.clone(),
        gpus: 1,
        entered: vec![harness_format::results::EnteredPlugin {
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

/// The operator's records that reproduced each bundle, its own result
/// as the rerun.
fn vouched(bundles: &[Verified]) -> Vec<Reproduced> {
    bundles.iter().map(|v| Reproduced::vouching(&v.bundle.result, v.bundle.result.clone(), true)).collect()
}

fn fixtures() -> Vec<Verified> {
    let fast = |t: &str| if t == "compression" { 0.8 } else { 0.3 };
    vec![
        // One algorithm built twice, run on two machines, 2 and 3 s to the
        // baseline's target: the same ratios but for noise.
        bundle("sign-rust", 2.0, &fast, 0.01, "a1"),
        bundle("sign-python", 3.0, &fast, 0.012, "b2"),
        // Slower than the baseline on the plain link, faster over 100 Mbit/s;
        // on both, slower than the two builds by more than the CPU class's
        // run-to-run band.
        bundle("slow", 1.0, &|t| if t == "compression" { 2.5 } else { 0.9 }, 0.01, "c3"),
    ]
}

#[test]
fn each_submission_is_ranked_only_in_its_tracks_against_its_own_runs_baseline_with_ties_shared() {
    let bundles = fixtures();
    for v in &bundles {
        assert_eq!(v.bundle.manifest.tracks, ["compression", "compression-100mbps"], "the MANIFEST lists the entered tracks");
    }
    let subs = boards(&bundles, &vouched(&bundles));
    let tracks: Vec<&str> = subs.iter().map(|b| b.track.as_str()).collect();
    assert_eq!(tracks, ["compression", "compression-100mbps"], "no board for tracks no submission entered");
    for b in &subs {
        assert_eq!(b.workloads, ["gpt-tiny", "resnet-tiny", "t5-tiny"]);
        assert_eq!(b.rows.iter().filter(|r| r.ranked()).count(), 3, "{}", b.track);
        let row = |name: &str| b.rows.iter().find(|r| r.plugin == name).unwrap();
        // Against its own run's baseline on this track: the factor, whatever
        // the machine and whatever the other track's baseline took.
        let want = if b.track == "compression" { [0.8, 0.8, 2.5] } else { [0.3, 0.3, 0.9] };
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
                (Some("compression"), true) => 2.5,
                (_, false) => 0.3,
                (_, true) => 0.9,
            };
            let (ratio, _) = r.verdicts.get(&Metric::TimeToTarget).unwrap();
            assert!((ratio - want).abs() < 0.02, "{:?}: {ratio} not {want}", r.group.run);
        }
    }
}

/// Issue 60: "The same artifact resumed and rerun also gets a row per
/// bundle, so a submitter can rerun and keep the best." Two runs of one
/// entry (the same artifact, configuration, suite, hardware and GPUs, on
/// two machines, the second a little slower) are one row that pools their
/// repeats, 3 + 3, whichever is given first; a copy of the first run in
/// another bundle adds none; another configuration of the artifact is
/// another entry.
#[test]
fn reruns_of_one_entry_are_one_row_pooling_every_repeat_once() {
    let fast = |t: &str| if t == "compression" { 0.8 } else { 0.4 };
    let slower = |t: &str| if t == "compression" { 0.9 } else { 0.5 };
    let first = || bundle("sign-rust", 2.0, &fast, 0.01, "a1");
    let rerun = || {
        let mut v = bundle("sign-rust", 3.0, &slower, 0.01, "a1");
        v.bundle.dir = PathBuf::from("a1-rerun.bundle");
        v
    };
    let mut copy = bundle("sign-rust", 2.0, &fast, 0.01, "a1");
    copy.bundle.dir = PathBuf::from("a1-copy.bundle");
    let mut configured = bundle("sign-rust", 2.0, &fast, 0.01, "a1");
    configured.bundle.dir = PathBuf::from("a1-k8.bundle");
    configured.bundle.result.submission.as_mut().unwrap().entered[0].config = "k = 8".into();
    let id = |v: &Verified| crate::submission::identity(&v.bundle.result).unwrap();
    assert_eq!(id(&first()), id(&rerun()), "a rerun is the same entry");
    assert_ne!(id(&first()), id(&configured), "another configuration is another entry");

    let rows = |bundles: &[Verified]| -> Vec<(String, Vec<(usize, f64)>)> {
        let b = boards(bundles, &[]).into_iter().find(|b| b.track == "compression").unwrap();
        b.rows
            .iter()
            .filter(|r| !r.reference)
            .map(|r| {
                (r.bundle.display().to_string(), r.ratios.iter().map(|s| s.as_ref().map(|s| (s.n, s.olympic_mean)).unwrap()).collect())
            })
            .collect()
    };
    let given = rows(&[first(), rerun(), copy, configured]);
    assert_eq!(given.len(), 2, "{given:?}");
    let pooled = given.iter().find(|r| r.0 == "a1.bundle").unwrap();
    for &(n, mean) in &pooled.1 {
        assert_eq!(n, 6, "3 repeats of each run, the copy's counted once: {given:?}");
        assert!(mean > 0.82 && mean < 0.88, "the pool of 0.8 and 0.9, not the best run's: {mean}");
    }
    // Which run is given first changes which bundle the row links, not its
    // figures.
    let swapped = rows(&[rerun(), first()]);
    assert_eq!(swapped.len(), 1);
    assert_eq!(swapped[0].0, "a1-rerun.bundle");
    assert_eq!(swapped[0].1, pooled.1);
}

/// Issue 60: "`harness report` reads no reproduction record: it ranks the
/// submitter's numbers whether or not anyone reproduced them." Given the
/// operator's records, a row ranks on the operator's reruns (here slower
/// than the claim), shows the claim beside them, and a bundle nobody
/// reproduced, or whose reproduction failed, is shown but not ranked.
#[test]
fn only_the_operators_measurements_rank_and_the_claim_is_shown_beside_them() {
    let fast = |t: &str| if t == "compression" { 0.8 } else { 0.4 };
    let claimed = bundle("boasted", 2.0, &|_| 0.1, 0.01, "a1");
    // The operator's rerun of the same entry: the plugin's real speed.
    let measured = bundle("boasted", 2.5, &fast, 0.01, "a1").bundle.result;
    let unreproduced = bundle("unchecked", 2.0, &|_| 0.2, 0.01, "b2");
    let refuted = bundle("refuted", 2.0, &|_| 0.3, 0.01, "c3");
    let operator = vec![
        Reproduced::vouching(&claimed.bundle.result, measured, true),
        Reproduced::vouching(&refuted.bundle.result, refuted.bundle.result.clone(), false),
    ];
    let bundles = [claimed, unreproduced, refuted];
    let subs = boards(&bundles, &operator);
    let b = subs.iter().find(|b| b.track == "compression").unwrap();
    let row = |name: &str| b.rows.iter().find(|r| r.plugin == name).unwrap();

    let boasted = row("boasted");
    assert!(boasted.ranked() && boasted.rank == Some(1), "{boasted:?}");
    for s in &boasted.ratios {
        let s = s.as_ref().unwrap();
        assert!((s.olympic_mean - 0.8).abs() < 0.02, "the operator's 0.8, not the claimed 0.1: {}", s.olympic_mean);
    }
    match &boasted.measured {
        Measured::Operator { reruns, claimed } => {
            assert_eq!(*reruns, 1);
            assert!(claimed.iter().all(|c| (c.as_ref().unwrap().olympic_mean - 0.1).abs() < 0.01), "{claimed:?}");
        }
        m => panic!("{m:?}"),
    }
    assert!(boasted.measured_cell().starts_with("operator, 1 rerun (claimed 0.100"), "{}", boasted.measured_cell());

    let (unchecked, refuted) = (row("unchecked"), row("refuted"));
    assert!(!unchecked.ranked() && unchecked.rank.is_none() && unchecked.measured == Measured::SelfReported);
    assert!(!refuted.ranked() && refuted.rank.is_none());
    assert!(
        refuted.measured_cell().starts_with("NOT reproduced: gpt-tiny/submission-compression: time to target"),
        "{}",
        refuted.measured_cell()
    );
    // Shown below the ranked rows and the reference, whatever they claim.
    let order: Vec<&str> = b.rows.iter().map(|r| r.plugin.as_str()).collect();
    assert_eq!(&order[2..], ["unchecked", "refuted"], "{order:?}");
    let md = markdown(&subs, &bundles);
    assert!(md.lines().any(|l| l.starts_with("| - | unchecked 0.1.0") && l.contains("self-reported")), "{md}");
    assert!(md.lines().any(|l| l.starts_with("| 1 | boasted 0.1.0") && l.contains("operator, 1 rerun")), "{md}");

    // Without records, nothing ranks.
    let none = boards(&bundles, &[]);
    assert!(none.iter().flat_map(|b| &b.rows).all(|r| !r.ranked() && r.rank.is_none()));
}

/// Issue 60: two bit-identical builds whose operator reruns differ by
/// run-to-run noise (here the second's rerun 30% slower on every
/// workload, within the CPU class's band) share a rank, though their
/// intervals are disjoint; a row slower by more than the band does not.
#[test]
fn rows_apart_by_less_than_the_classs_run_to_run_noise_share_a_rank() {
    let fast = |t: &str| if t == "compression" { 0.5 } else { 0.4 };
    let noisy = |t: &str| if t == "compression" { 0.5 * 1.3 } else { 0.4 * 1.3 };
    let rust = bundle("sign-rust", 2.0, &fast, 0.01, "a1");
    let python = bundle("sign-python", 2.0, &fast, 0.01, "b2");
    let slow = bundle("slow", 2.0, &|_| 2.0, 0.01, "c3");
    let operator = vec![
        Reproduced::vouching(&rust.bundle.result, rust.bundle.result.clone(), true),
        Reproduced::vouching(&python.bundle.result, bundle("sign-python", 2.0, &noisy, 0.01, "b2").bundle.result, true),
        Reproduced::vouching(&slow.bundle.result, slow.bundle.result.clone(), true),
    ];
    let bundles = [rust, python, slow];
    for b in boards(&bundles, &operator) {
        assert_eq!(b.band, crate::reproduction::CPU_TIME_BAND);
        let row = |name: &str| b.rows.iter().find(|r| r.plugin == name).unwrap();
        let (x, y) = (row("sign-rust").ratios[0].as_ref().unwrap(), row("sign-python").ratios[0].as_ref().unwrap());
        assert!(interval(x).1 < interval(y).0, "the intervals alone would separate them: {x:?} {y:?}");
        assert_eq!((row("sign-rust").rank, row("sign-python").rank), (Some(1), Some(1)), "{}", b.track);
        assert_eq!(row("slow").rank, Some(3), "{}", b.track);
    }
}

/// Issue 60, item 7: the per-workload tables "rank the baselines of tracks
/// a submission never entered (`| 1 | no-checkpoints (baseline; run of
/// signsgd-mv ...)`)", rank absolute times across runs and days, and give
/// `0.846x n.s.` where the Submissions table gives `0.663 [0.658, 0.846]`
/// for the same comparison. The fixtures' runs trained every track's
/// baseline: only the tracks each entered its plugin in are tabled, each
/// run's rows are ranked among themselves and listed together, and each
/// comparison is the Submissions table's statistic, to the digit.
#[test]
fn per_workload_tables_hold_the_entered_tracks_rank_within_each_run_and_agree_with_the_submissions_table() {
    let bundles = fixtures();
    let results: Vec<RunResult> = bundles.iter().map(|v| v.bundle.result.clone()).collect();
    let boards = crate::boards(&results);
    let tracks: BTreeSet<Option<&str>> = boards.iter().map(|b| b.track.as_deref()).collect();
    assert_eq!(tracks, [Some("compression"), Some("compression-100mbps")].into(), "no batch-size or checkpointing table");
    let subs = super::boards(&bundles, &vouched(&bundles));
    for b in &boards {
        let runs: Vec<&str> = b.rows.iter().map(|r| r.group.run.as_deref().unwrap()).collect();
        let mut listed = runs.clone();
        listed.dedup();
        assert_eq!(listed.len(), 3, "each run's rows together: {runs:?}");
        for run in &listed {
            let ranks: Vec<Option<usize>> = b.rows.iter().filter(|r| r.group.run.as_deref() == Some(run)).map(|r| r.rank).collect();
            assert_eq!(ranks, [Some(1), Some(2)], "{run}: ranked within its run");
        }
        let sub = subs.iter().find(|s| Some(s.track.as_str()) == b.track.as_deref()).unwrap();
        let w = sub.workloads.iter().position(|w| *w == b.workload).unwrap();
        for row in b.rows.iter().filter(|r| !r.group.baseline) {
            let (ratio, _) = row.verdicts[&Metric::TimeToTarget];
            let plugin = row.group.run.as_deref().unwrap().trim_start_matches("run of ").split(' ').next().unwrap();
            let cell = sub.rows.iter().find(|r| r.plugin == plugin).unwrap().ratios[w].as_ref().unwrap();
            assert_eq!(ratio, cell.olympic_mean, "{plugin} on {} {:?}", b.workload, b.track);
        }
    }
}
