//! The leaderboard's data: entries grouped by (run, suite, workload,
//! strategy, device, track) ([`Group`]), each group scored against its
//! run's baseline ([`Row`]), and the rows of one suite ranked ([`Board`]).

use std::collections::BTreeMap;

use crate::escape;
use crate::metric::{Metric, PerMetric};
use crate::stats::{Summary, Verdict};
use crate::summary::nccl_by_strategy;
use harness_format::results::{EntryStatus, Metrics, RunResult};
use harness_format::suite;

/// [`nccl_by_strategy`] over a board's rows.
pub fn board_nccl(b: &Board) -> Vec<(String, String)> {
    nccl_by_strategy(b.rows.iter().flat_map(|r| r.group.runs.iter().map(|m| (r.group.strategy.as_str(), m))))
}

/// Whether a board's runs report classification accuracy.
pub fn board_has_accuracy(b: &Board) -> bool {
    b.rows.iter().any(|r| r.summaries.contains_key(&Metric::EvalAccuracy))
}

/// A row's flags and the errors of its failed repeats, as the tables show
/// them (plain text: each output escapes it).
pub fn row_flags(r: &Row) -> Vec<String> {
    let mut flags = r.flags.clone();
    flags.extend(r.group.failures.iter().map(|e| format!("failed: {e}")));
    flags
}

/// One strategy on one workload: every repeat found in the result files.
#[derive(Debug, Clone)]
pub struct Group {
    pub suite: String,
    /// The suite's version, where it has one ([`suite_version`]): results
    /// of different versions are different experiments, never pooled.
    pub version: Option<String>,
    pub workload: String,
    pub strategy: String,
    pub device: String,
    /// The run's recorded `HARNESS_*` switches as one line
    /// (`harness_format::switches::line`), empty for a default run: runs with
    /// different switches measured different work, never pooled.
    pub switches: String,
    pub baseline: bool,
    /// The standard suite's track the strategy ran in on this workload
    /// (a strategy in two tracks has a group in each); None for suites
    /// without tracks.
    pub track: Option<String>,
    /// The run it came from ([`run_label`]): a row is compared with its
    /// own run's baseline and ranked against its own run's rows only, and
    /// the groups of different runs are never pooled (two runs, days apart
    /// or on two machines, differ by more than their repeats do). None only
    /// in tests.
    pub run: Option<String>,
    /// (compressor, batch policy, checkpoint policy) names.
    pub parts: (String, String, String),
    pub runs: Vec<Metrics>,
    /// Each run's repeat index, in the same order: a row and its baseline
    /// are paired by repeat (the two share the repeat's seed).
    pub repeats: Vec<u32>,
    /// Step histograms (base64) of the runs, in the same order.
    pub step_histograms: Vec<String>,
    /// Errors of repeats that failed.
    pub failures: Vec<String>,
}

/// A group's scores and how they compare with the baseline.
#[derive(Debug, Clone)]
pub struct Row {
    pub group: Group,
    /// The metrics the repeats have, over the repeats.
    pub summaries: PerMetric<Summary>,
    /// Each metric against the baseline's: candidate / baseline and the
    /// call; none for the baseline itself.
    pub verdicts: PerMetric<(f64, Verdict)>,
    /// Repeats that reached the target, of those that ran.
    pub reached: (usize, usize),
    pub has_target: bool,
    /// 1 + the rows ahead of it that are better beyond doubt (their 95%
    /// intervals do not overlap): rows that nothing separates share one.
    pub rank: Option<usize>,
    /// Whether another row shares its rank.
    pub tied: bool,
    /// Engagement checks that failed.
    pub flags: Vec<String>,
    /// Whether its board holds more than one run, so that its label names
    /// the run.
    pub show_run: bool,
}

impl Row {
    /// Its rank as the tables show it: "1", "=1" when tied, "-".
    pub fn rank_cell(&self) -> String {
        match self.rank {
            None => "-".into(),
            Some(k) if self.tied => format!("={k}"),
            Some(k) => k.to_string(),
        }
    }

    /// Its strategy as the tables name it: "(baseline)" after the
    /// baseline, and the run after any strategy of a submission's run but
    /// the submission itself (whose name says whose it is).
    pub fn label(&self) -> String {
        let g = &self.group;
        let mut notes = Vec::new();
        if g.baseline {
            notes.push("baseline".to_owned());
        }
        if let Some(run) = g.run.as_ref().filter(|_| self.show_run && !g.strategy.contains("[submission-")) {
            notes.push(run.clone());
        }
        if notes.is_empty() {
            g.strategy.clone()
        } else {
            format!("{} ({})", g.strategy, notes.join("; "))
        }
    }
}

/// One leaderboard table: a workload of a suite on one device.
#[derive(Debug, Clone)]
pub struct Board {
    pub suite: String,
    pub version: Option<String>,
    pub workload: String,
    pub device: String,
    /// The recorded switches of its runs ([`Group::switches`]).
    pub switches: String,
    /// The standard suite's track ([`Group::track`]).
    pub track: Option<String>,
    pub rows: Vec<Row>,
}

/// What names a run in the per-workload tables: "run of PLUGIN VERSION
/// (SHA256 PREFIX), STARTED" for a submission's, else "run of SUITE,
/// STARTED".
pub fn run_label(r: &RunResult) -> String {
    match r.submission.as_ref().and_then(|s| s.entered.first()) {
        Some(p) => format!("run of {} {} ({}), {}", p.name, p.version, escape::short(&p.sha256), r.started_at),
        None => format!("run of {}, {}", r.suite.name, r.started_at),
    }
}

/// The tracks of `tracks` that `strategy` runs in on `workload`: as the
/// baseline, a reference strategy, or the submission (`submission-TRACK`,
/// or, renamed after its plugin, ending in `[submission-TRACK]`).
fn tracks_of(tracks: &[suite::Track], workload: &str, strategy: &str) -> Vec<String> {
    tracks
        .iter()
        .filter(|t| t.workloads.iter().any(|w| w == workload))
        .filter(|t| {
            let sub = format!("submission-{}", t.name);
            t.baseline == strategy
                || t.strategies.iter().any(|s| s == strategy)
                || strategy == sub
                || strategy.ends_with(&format!("[{sub}]"))
        })
        .map(|t| t.name.clone())
        .collect()
}

/// The tracks a submission's run entered its plugin in (as
/// [`crate::submission::entered_tracks`], its submission strategies
/// renamed after the plugin or not); None for other runs.
fn entered_tracks(r: &RunResult) -> Option<Vec<String>> {
    let sub = r.submission.as_ref()?;
    let ran = |t: &String| {
        let name = format!("submission-{t}");
        r.plan.iter().any(|p| p.strategy.name == name || p.strategy.name.ends_with(&format!("[{name}]")))
    };
    Some(sub.tracks.iter().filter(|t| ran(t)).cloned().collect())
}

/// A result's suite version: the submission's record of it, else
/// `[suite] version` in the suite's text; None for suites without one.
pub fn suite_version(r: &RunResult) -> Option<String> {
    r.submission.as_ref().and_then(|s| s.suite_version.clone()).or_else(|| {
        let table = r.suite.text.parse::<toml::Table>().ok()?;
        table.get("suite")?.get("version")?.as_str().map(str::to_owned)
    })
}

/// Groups every entry of the result files: one group per run, suite,
/// suite version, workload, strategy, device, switches and track. A run
/// given twice (the same result, re-serialised the same: in two bundles
/// that differ by a log line, say) counts once; a submission's run adds
/// only the tracks it was entered in (the baselines of the others ran, but
/// nothing was compared with them).
pub fn groups(results: &[RunResult]) -> Vec<Group> {
    type Key = (String, Option<String>, String, String, String, String, Option<String>, Option<String>);
    let mut map: BTreeMap<Key, Group> = BTreeMap::new();
    let mut seen = std::collections::BTreeSet::new();
    for r in results {
        if !seen.insert(crate::submission::sha256_hex(&serde_json::to_vec(r).expect("results serialise"))) {
            continue;
        }
        let version = suite_version(r);
        let switches = if r.switches.is_empty() { String::new() } else { harness_format::switches::line(&r.switches) };
        let tracks = suite::Suite::parse(std::path::Path::new(&r.suite.path), r.suite.text.clone()).map_or(Vec::new(), |s| s.spec.tracks);
        let entered = entered_tracks(r);
        let run = Some(run_label(r));
        for e in &r.entries {
            let strategy = r.plan.iter().find(|p| p.id == e.id).map(|p| p.strategy.clone());
            let mut in_tracks: Vec<Option<String>> = tracks_of(&tracks, &e.workload, &e.strategy)
                .into_iter()
                .filter(|t| entered.as_ref().is_none_or(|entered| entered.contains(t)))
                .map(Some)
                .collect();
            if in_tracks.is_empty() {
                if entered.is_some() {
                    continue;
                }
                in_tracks.push(None);
            }
            for track in in_tracks {
                let key = (
                    r.suite.name.clone(),
                    version.clone(),
                    e.workload.clone(),
                    e.strategy.clone(),
                    e.device.clone(),
                    switches.clone(),
                    track.clone(),
                    run.clone(),
                );
                let g = map.entry(key).or_insert_with(|| Group {
                    suite: r.suite.name.clone(),
                    version: version.clone(),
                    workload: e.workload.clone(),
                    strategy: e.strategy.clone(),
                    device: e.device.clone(),
                    switches: switches.clone(),
                    baseline: strategy.as_ref().is_some_and(|s| s.baseline),
                    track,
                    run: run.clone(),
                    parts: strategy
                        .as_ref()
                        .map_or_else(Default::default, |s| (s.compressor.clone(), s.batch_policy.clone(), s.checkpoint.clone())),
                    runs: Vec::new(),
                    repeats: Vec::new(),
                    step_histograms: Vec::new(),
                    failures: Vec::new(),
                });
                match (&e.status, &e.metrics) {
                    (EntryStatus::Ok, Some(m)) => {
                        g.runs.push(m.clone());
                        g.repeats.push(e.repeat);
                        g.step_histograms.push(e.histograms.get("step").cloned().unwrap_or_default());
                    }
                    (EntryStatus::Failed { error, .. }, _) => g.failures.push(error.clone()),
                    _ => {}
                }
            }
        }
    }
    map.into_values().collect()
}

/// Scores, compares and ranks the groups; one board per suite, suite
/// version, workload, device, switches and track.
pub fn boards(results: &[RunResult]) -> Vec<Board> {
    type Key = (String, Option<String>, String, String, String, Option<String>);
    let mut by_board: BTreeMap<Key, Vec<Group>> = BTreeMap::new();
    for g in groups(results) {
        let key = (g.suite.clone(), g.version.clone(), g.workload.clone(), g.device.clone(), g.switches.clone(), g.track.clone());
        by_board.entry(key).or_default().push(g);
    }
    by_board
        .into_iter()
        .map(|((suite, version, workload, device, switches, track), gs)| {
            let mut rows: Vec<Row> = gs.into_iter().map(score).collect();
            let first_run = rows.first().map(|r| r.group.run.clone());
            let show_run = rows.iter().any(|r| Some(&r.group.run) != first_run.as_ref());
            rows.iter_mut().for_each(|r| r.show_run = show_run);
            compare_with_baselines(&mut rows);
            flag_mixed_graphs(&mut rows);
            rank(&mut rows);
            Board { suite, version, workload, device, switches, track, rows }
        })
        .collect()
}

/// Each row against its baseline: the board's baseline row of the same
/// run, paired by repeat (each repeat's value over the baseline's of the
/// same repeat; the olympic mean of those ratios, called higher or lower
/// only when their bootstrap 95% interval excludes 1: the statistic of the
/// Submissions tables). A row whose run has no baseline on the board is
/// compared with nothing. Sets the verdicts and the engagement flags.
fn compare_with_baselines(rows: &mut [Row]) {
    let base_of: Vec<Option<usize>> =
        rows.iter().map(|r| rows.iter().position(|b| b.group.baseline && b.group.run == r.group.run)).collect();
    let snapshot: Vec<(Group, PerMetric<Summary>)> = rows.iter().map(|r| (r.group.clone(), r.summaries.clone())).collect();
    for (i, row) in rows.iter_mut().enumerate() {
        let Some(b) = base_of[i] else {
            row.verdicts = PerMetric::new();
            row.flags = engagement(&row.group, &Default::default(), None, None);
            continue;
        };
        let (base, base_sums) = &snapshot[b];
        row.verdicts = if i == b {
            PerMetric::new()
        } else {
            row.summaries.keys().filter_map(|m| Some((*m, paired(&row.group, base, *m)?))).collect()
        };
        // A group that missed the target in any repeat has no
        // time-to-target score, so nothing to compare either.
        if row.has_target && row.reached.0 < row.reached.1 {
            row.verdicts.remove(&Metric::TimeToTarget);
        }
        let bytes = row.summaries.get(&Metric::BytesPerStep).map(|s| s.olympic_mean);
        let base_bytes = base_sums.get(&Metric::BytesPerStep).map(|s| s.olympic_mean);
        row.flags = engagement(&row.group, &base.parts, bytes, base_bytes);
    }
}

/// `metric` of `g` over the baseline's, repeat by repeat: the ratios'
/// olympic mean and the call of their interval against 1; none without a
/// repeat in both.
fn paired(g: &Group, base: &Group, metric: Metric) -> Option<(f64, Verdict)> {
    let of = |g: &Group| -> BTreeMap<u32, f64> {
        g.repeats.iter().zip(&g.runs).filter_map(|(k, m)| Some((*k, metric.value(m).filter(|x| x.is_finite())?))).collect()
    };
    let b = of(base);
    let xs: Vec<f64> = of(g).into_iter().filter_map(|(k, x)| Some(x / b.get(&k).filter(|y| **y != 0.0)?)).collect();
    let s = Summary::of(&xs)?;
    let verdict = match s.ci95.filter(|_| s.n >= 2) {
        None => Verdict::TooFewRepeats,
        Some((lo, _)) if lo > 1.0 => Verdict::Higher,
        Some((_, hi)) if hi < 1.0 => Verdict::Lower,
        Some(_) => Verdict::NotSignificant,
    };
    Some((s.olympic_mean, verdict))
}

pub(crate) fn score(group: Group) -> Row {
    let summaries = Metric::ALL
        .into_iter()
        .filter_map(|metric| {
            let xs: Vec<f64> = group.runs.iter().filter_map(|m| metric.value(m)).collect();
            Some((metric, Summary::of(&xs)?))
        })
        .collect();
    let has_target = group.runs.iter().any(|m| m.target_loss.is_some() || m.target_accuracy.is_some());
    let reached = (group.runs.iter().filter(|m| m.time_to_target_s.is_some()).count(), group.runs.len() + group.failures.len());
    Row { group, summaries, verdicts: PerMetric::new(), reached, has_target, rank: None, tied: false, flags: Vec::new(), show_run: false }
}

/// Ranks each run's rows among themselves (rows of different runs are
/// never ranked against each other: what was not measured side by side
/// is not compared). Time to target first: only groups whose every repeat
/// reached the target get a rank, ordered by their olympic-mean time. When
/// the workload sets no target, groups are ranked by goodput if failures
/// were injected or checkpoints written (what checkpoint policies exist
/// for), else by tokens/s. A group with a failed repeat, and others, are
/// listed unranked. A row's rank is 1 + the rows of its run better than it
/// beyond doubt (95% intervals apart; a metric of one repeat is its own
/// interval): rows nothing separates share a rank. The runs are listed in
/// the order given, each run's rows together.
pub(crate) fn rank(rows: &mut [Row]) {
    let any_target = rows.iter().any(|r| r.has_target);
    let by_goodput = !any_target && rows.iter().any(|r| r.summaries.contains_key(&Metric::Goodput));
    // The metric, lower is better: (mean, interval).
    let key = |r: &Row| -> Option<(f64, (f64, f64))> {
        if !r.group.failures.is_empty() {
            return None;
        }
        let (metric, sign) = if any_target {
            if !(r.reached.0 == r.reached.1 && r.reached.1 > 0) {
                return None;
            }
            (Metric::TimeToTarget, 1.0)
        } else if by_goodput {
            (Metric::Goodput, -1.0)
        } else {
            (Metric::TokensPerS, -1.0)
        };
        let s = r.summaries.get(&metric)?;
        let (lo, hi) = s.ci95.unwrap_or((s.olympic_mean, s.olympic_mean));
        let (lo, hi) = if sign < 0.0 { (-hi, -lo) } else { (lo, hi) };
        Some((sign * s.olympic_mean, (lo, hi)))
    };
    let mut runs: Vec<Option<String>> = Vec::new();
    for r in rows.iter() {
        if !runs.contains(&r.group.run) {
            runs.push(r.group.run.clone());
        }
    }
    let run_of = |r: &Row| runs.iter().position(|x| *x == r.group.run).unwrap_or(0);
    rows.sort_by(|a, b| {
        run_of(a).cmp(&run_of(b)).then_with(|| match (key(a), key(b)) {
            (Some(x), Some(y)) => x.0.total_cmp(&y.0),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => a.group.strategy.cmp(&b.group.strategy),
        })
    });
    let keys: Vec<_> = rows.iter().map(|r| (run_of(r), key(r))).collect();
    for (i, r) in rows.iter_mut().enumerate() {
        let (run, k) = keys[i];
        r.rank = k.map(|(_, (lo, _))| {
            1 + keys[..i].iter().filter(|(other, _)| *other == run).filter_map(|(_, k)| *k).filter(|(_, (_, hi))| *hi < lo).count()
        });
    }
    // Stable: within a run, a row is never listed below one it ranks above.
    let order: Vec<(usize, usize)> = rows.iter().map(|r| (run_of(r), r.rank.unwrap_or(usize::MAX))).collect();
    let mut idx: Vec<usize> = (0..rows.len()).collect();
    idx.sort_by_key(|&i| order[i]);
    let sorted: Vec<Row> = idx.iter().map(|&i| rows[i].clone()).collect();
    rows.clone_from_slice(&sorted);
    let ranks: Vec<(usize, Option<usize>)> = rows.iter().map(|r| (run_of(r), r.rank)).collect();
    for r in rows.iter_mut() {
        let me = (run_of(r), r.rank);
        r.tied = r.rank.is_some() && ranks.iter().filter(|k| **k == me).count() > 1;
    }
}

/// A strategy whose steps were replayed as a CUDA graph and one whose
/// steps ran eagerly are not compared like for like (a graph removes the
/// launch gaps between kernels; `cuda_graph` in docs/suite-format.md says
/// which entries qualify): where a board holds both, every row says which
/// it was.
pub(crate) fn flag_mixed_graphs(rows: &mut [Row]) {
    let graphed = |r: &Row| r.group.runs.iter().any(|m| m.cuda_graph_steps > 0);
    let n = rows.iter().filter(|r| graphed(r)).count();
    if n == 0 || n == rows.len() {
        return;
    }
    for r in rows.iter_mut() {
        r.flags.push(if graphed(r) {
            "steps replayed as a CUDA graph, other strategies' eager: not like for like".into()
        } else {
            "steps eager, other strategies' replayed as a CUDA graph: not like for like".into()
        });
    }
}

/// Did the strategy change what it claims to change, compared with the
/// baseline? A compressor must cut bytes on the wire, a batch policy must
/// change the batch, a checkpoint policy must write checkpoints.
fn engagement(g: &Group, base_parts: &(String, String, String), bytes: Option<f64>, base_bytes: Option<f64>) -> Vec<String> {
    let mut flags = Vec::new();
    if g.runs.is_empty() {
        return flags;
    }
    if g.parts.0 != "allreduce" && g.parts.0 != base_parts.0 {
        match (bytes, base_bytes) {
            (Some(b), Some(base)) if base > 0.0 && b >= 0.95 * base => {
                flags.push(format!("compressor `{}` sent {:.0}% of the baseline's bytes", g.parts.0, 100.0 * b / base))
            }
            (_, Some(0.0)) => {
                flags.push(format!("compressor `{}`: the baseline moved no bytes (one rank), so compression is unverified", g.parts.0))
            }
            _ => {}
        }
    }
    if g.parts.1 != "fixed" && g.runs.iter().all(|m| m.batch_changes.len() <= 1) {
        flags.push(format!("batch policy `{}` never changed the batch", g.parts.1));
    }
    if g.parts.2 != "none" && g.runs.iter().all(|m| m.checkpoints_written == 0) {
        flags.push(format!("checkpoint policy `{}` wrote no checkpoint", g.parts.2));
    }
    flags
}
