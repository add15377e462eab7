//! Reports: the summary table printed at the end of `harness run`, and the
//! scores across result files: the leaderboard (`harness report`, Markdown and
//! a self-contained HTML page with SVG plots) and `harness compare`.
//!
//! Entries are grouped by (run, suite, workload, strategy, device, track);
//! the repeats of a group are summarised with [`stats`], every metric is
//! compared with the group of the baseline strategy of the same run,
//! paired by repeat, and rows are ranked against their own run's only.
//!
//! [`submission`] makes and checks submission bundles (`harness submit`,
//! `harness verify`); [`inputs`] reads what `harness report` is given
//! (result files, and bundles: verified, one per content); [`submissions`]
//! ranks the verified bundles; [`output`] writes the board. Every string
//! read from a result file or bundle is written through [`escape`].
//!
//! This crate stands on the file formats alone (`harness-format`): no
//! libtorch, no plugin runtime. What needs one (reading a plugin artifact's
//! manifest) is passed in by the caller.

pub mod escape;
pub mod html;
pub mod inputs;
pub mod metric;
pub mod output;
pub mod project;
pub mod reproduction;
pub mod stats;
pub mod submission;
pub mod submissions;
#[cfg(test)]
mod test_support;

use std::collections::BTreeMap;

use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};

use crate::escape::{md, md_code};
use harness_format::fmt::{human, printable};
use harness_format::results::{EntryStatus, Metrics, RunResult};
use harness_format::suite;
pub use metric::{bytes, Better, Metric, PerMetric};
use stats::{Summary, Verdict};

/// A table of every entry: throughput, latency, MFU, memory, loss, target.
///
/// With classifiers among the entries, two more columns: the eval top-1
/// accuracy and the data's best reachable accuracy; with plugins, the mean
/// time of a call into them ([`plugin_call_us`]).
pub fn summary_table(r: &RunResult) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    let accuracy = r.entries.iter().any(|e| e.metrics.as_ref().is_some_and(|m| m.final_eval_accuracy.is_some()));
    let mut header = vec!["entry", "status", "tokens/s", "step p50 ms", "step p99 ms", "MFU", "peak mem", "eval loss", "floor"];
    if accuracy {
        header.extend(["eval acc", "best acc"]);
    }
    header.extend(["target", "time to target"]);
    // What a call into the entry's plugins cost, when any ran.
    let plugins = r.entries.iter().any(|e| e.metrics.as_ref().is_some_and(|m| !m.plugins.is_empty()));
    if plugins {
        header.push("plugin µs/call");
    }
    let columns = header.len();
    t.set_header(header);
    for e in &r.entries {
        let status = match &e.status {
            EntryStatus::Ok => "ok".to_owned(),
            EntryStatus::Failed { .. } => "FAILED".to_owned(),
        };
        let row: Vec<String> = match &e.metrics {
            Some(m) => {
                let mem = m.memory.peak_device_allocated_bytes.map(|b| b as u64).or(m.memory.peak_rss_bytes).map_or("-".into(), bytes);
                let has_target = m.target_loss.is_some() || m.target_accuracy.is_some();
                let mut v = vec![
                    e.id.clone(),
                    status,
                    human(m.tokens_per_s),
                    m.step.as_ref().map_or("-".into(), |s| format!("{:.2}", s.p50_ms)),
                    m.step.as_ref().map_or("-".into(), |s| format!("{:.2}", s.p99_ms)),
                    m.mfu.map_or("-".into(), |x| format!("{:.1}%", 100.0 * x)),
                    mem,
                    opt(m.final_eval_loss),
                    opt(m.loss_floor),
                ];
                if accuracy {
                    v.extend([opt(m.final_eval_accuracy), opt(m.best_accuracy)]);
                }
                v.push(match (m.target_loss, m.target_accuracy) {
                    (None, Some(a)) => format!("acc {a:.4}"),
                    (t, _) => opt(t),
                });
                v.push(match (has_target, m.time_to_target_s) {
                    (false, _) => "-".into(),
                    (true, Some(s)) => format!("{s:.1} s"),
                    (true, None) => "missed".into(),
                });
                if plugins {
                    v.push(plugin_call_us(m).map_or("-".into(), |us| format!("{us:.2}")));
                }
                v
            }
            None => {
                let mut v = vec![e.id.clone(), status];
                v.extend(std::iter::repeat_n("-".to_owned(), columns - 2));
                v
            }
        };
        t.add_row(row.into_iter().map(Cell::new));
    }
    for c in 2..columns {
        if let Some(col) = t.column_mut(c) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    let mut out = t.to_string();
    if !r.switches.is_empty() {
        out.push_str(&format!("\nswitches: {} (not the default work)", harness_format::switches::line(&r.switches)));
    }
    for (strategy, line) in nccl_by_strategy(r.entries.iter().filter_map(|e| Some((e.strategy.as_str(), e.metrics.as_ref()?)))) {
        out.push_str(&format!("\n{strategy}: {line}"));
    }
    for e in &r.entries {
        if let Some(line) = e.metrics.as_ref().and_then(|m| m.resilience.as_ref()).and_then(resilience_line) {
            out.push_str(&format!("\n{}: {line}", e.id));
        }
    }
    for e in &r.entries {
        if let EntryStatus::Failed { error, .. } = &e.status {
            out.push_str(&format!("\n{}: {error}", e.id));
        }
    }
    out
}

/// The mean time of a call into the entry's plugins, in microseconds
/// (every hook of every plugin it ran, as the host's meter timed them);
/// None when it ran none or made no call.
pub fn plugin_call_us(m: &harness_format::results::Metrics) -> Option<f64> {
    let (calls, ms) = m
        .plugins
        .iter()
        .filter_map(|p| Some((p.calls, p.call.as_ref()?.mean_ms * p.calls as f64)))
        .fold((0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    (calls > 0).then(|| ms * 1e3 / calls as f64)
}

/// What checkpoints and failures cost an entry, one line; none when it
/// took no checkpoint and had no failure.
pub fn resilience_line(r: &harness_format::results::ResilienceRecord) -> Option<String> {
    if r.checkpoints.is_empty() && r.failures.is_empty() {
        return None;
    }
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    let mut parts = Vec::new();
    if !r.checkpoints.is_empty() {
        let n = r.checkpoints.len();
        let stalls: Vec<f64> = r.checkpoints.iter().map(|c| c.cost_s).collect();
        let mode = r.checkpoint_mode.as_deref().unwrap_or("sync");
        let mut p = format!("{n} checkpoint{} ({mode}): stall {} each", if n == 1 { "" } else { "s" }, seconds(mean(&stalls)));
        let persisted: Vec<&harness_format::results::CheckpointRecord> = r.checkpoints.iter().filter(|c| c.persist_s.is_some()).collect();
        if mode == "async" {
            if !persisted.is_empty() {
                let secs: Vec<f64> = persisted.iter().filter_map(|c| c.persist_s).collect();
                let rate: Vec<f64> = persisted.iter().filter_map(|c| Some(c.bytes as f64 / c.persist_s? / 1e9)).collect();
                p.push_str(&format!(", {} persisted in {} at {:.2} GB/s", persisted.len(), seconds(mean(&secs)), mean(&rate)));
            }
            let slow: Vec<f64> = r.checkpoints.iter().map(|c| c.slowdown_s).collect();
            p.push_str(&format!(", slowdown {} each", seconds(mean(&slow))));
        }
        parts.push(p);
    }
    if !r.failures.is_empty() {
        let restore: Vec<f64> = r.failures.iter().map(|f| f.restore_s).collect();
        let mut from: Vec<(String, usize)> = Vec::new();
        for f in &r.failures {
            let k = f.restored_from.clone().unwrap_or_else(|| "checkpoint".into());
            match from.iter_mut().find(|(x, _)| *x == k) {
                Some((_, n)) => *n += 1,
                None => from.push((k, 1)),
            }
        }
        let from = from.iter().map(|(k, n)| format!("{n} from {k}")).collect::<Vec<_>>().join(", ");
        parts.push(format!(
            "{} failures ({from}), restore {} each, {} lost",
            r.failures.len(),
            seconds(mean(&restore)),
            seconds(r.time_lost_s)
        ));
    }
    Some(parts.join("; "))
}

/// 0.0042 -> "4.2 ms", 1.5 -> "1.50 s".
fn seconds(s: f64) -> String {
    if s.abs() < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// What NCCL ran with, one line: version, transports, settings.
pub fn nccl_line(n: &harness_format::results::NcclRecord) -> String {
    let mut parts = vec![format!("NCCL {}", n.version.as_deref().unwrap_or("(version unknown)"))];
    parts.push(if n.transports.is_empty() {
        format!("transports unknown ({})", n.note.as_deref().unwrap_or("no connection lines"))
    } else {
        format!("via {}", n.transports.join(", "))
    });
    if !n.settings.is_empty() {
        parts.push(n.settings.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "));
    }
    parts.join("; ")
}

/// Each strategy's NCCL line, in first-seen order: (strategy, the distinct
/// lines of its entries joined with " | ").
pub fn nccl_by_strategy<'a>(runs: impl Iterator<Item = (&'a str, &'a Metrics)>) -> Vec<(String, String)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for (strategy, m) in runs {
        let Some(n) = &m.nccl else { continue };
        let line = nccl_line(n);
        match out.iter_mut().find(|(s, _)| s == strategy) {
            Some((_, lines)) if !lines.contains(&line) => lines.push(line),
            Some(_) => {}
            None => out.push((strategy.to_owned(), vec![line])),
        }
    }
    out.into_iter().map(|(s, l)| (s, l.join(" | "))).collect()
}

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

fn opt(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.4}"))
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

fn score(group: Group) -> Row {
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
fn rank(rows: &mut [Row]) {
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
fn flag_mixed_graphs(rows: &mut [Row]) {
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

/// A verdict cell: "1.234x higher", "n.s.", or "-".
pub fn fmt_verdict(v: Option<&(f64, Verdict)>) -> String {
    match v {
        None => "-".into(),
        Some((r, v)) => format!(
            "{r:.3}x {}",
            match v {
                Verdict::Higher => "higher",
                Verdict::Lower => "lower",
                Verdict::NotSignificant => "n.s.",
                Verdict::TooFewRepeats => "(too few repeats)",
            }
        ),
    }
}

/// "Suite `name`", with " version V" where the suite has one, as the
/// Markdown heads a suite's tables.
pub fn suite_heading(b: &Board) -> String {
    match &b.version {
        Some(v) => format!("Suite {} version {}", md_code(&b.suite), md(v)),
        None => format!("Suite {}", md_code(&b.suite)),
    }
}

/// The Markdown leaderboard: one ranked table per suite, suite version,
/// workload and device.
pub fn leaderboard_markdown(boards: &[Board], sources: &[String]) -> String {
    let mut out = String::from("# Leaderboard\n\n");
    out.push_str("Generated by `harness report` from the result files below; do not edit by hand.\n");
    out.push_str("Values are olympic means over repeats with bootstrap 95% intervals. Only what was measured side by side is\n");
    out.push_str("compared: each row with its track's baseline of the same run, paired by repeat (the ratios' olympic mean, called\n");
    out.push_str("higher / lower only when their interval excludes 1, otherwise n.s.), and ranked against the rows of its run only\n");
    out.push_str("(rows whose intervals overlap share a rank, =1). Runs are never pooled; each run's rows are listed together.\n\n");
    for s in sources {
        out.push_str(&format!("- {}\n", md_code(s)));
    }
    let mut suite = None;
    for b in boards {
        if suite != Some((&b.suite, &b.version)) {
            suite = Some((&b.suite, &b.version));
            out.push_str(&format!("\n## {}\n", suite_heading(b)));
        }
        let track = b.track.as_ref().map_or(String::new(), |t| format!(", track {}", md_code(t)));
        out.push_str(&format!("\n### {} on {}{track}\n\n", md_code(&b.workload), md(&b.device)));
        if !b.switches.is_empty() {
            out.push_str(&format!("switches: {} (not the default work; docs/benchmarks.md)\n\n", md_code(&b.switches)));
        }
        let mut header = vec!["rank", "strategy", "target reached"];
        let accuracy = board_has_accuracy(b);
        if accuracy {
            header.push(Metric::EvalAccuracy.name());
        }
        header.extend(Metric::SCORED.map(Metric::name));
        header.extend(["tokens/s vs baseline", "time to target vs baseline", "flags"]);
        out.push_str(&format!("| {} |\n|{}|\n", header.join(" | "), vec![" --- "; header.len()].join("|")));
        for r in &b.rows {
            let mut cells = vec![
                r.rank_cell(),
                md(&r.label()),
                if r.has_target { format!("{} of {}", r.reached.0, r.reached.1) } else { "no target".into() },
            ];
            if accuracy {
                cells.push(Metric::EvalAccuracy.format_summary(r.summaries.get(&Metric::EvalAccuracy)));
            }
            for m in Metric::SCORED {
                cells.push(if m == Metric::TimeToTarget && r.has_target && r.reached.0 < r.reached.1 {
                    "no score (missed)".into()
                } else {
                    m.format_summary(r.summaries.get(&m))
                });
            }
            cells.push(fmt_verdict(r.verdicts.get(&Metric::TokensPerS)));
            cells.push(fmt_verdict(r.verdicts.get(&Metric::TimeToTarget)));
            cells.push(if r.flags.is_empty() && r.group.failures.is_empty() { "-".into() } else { md(&row_flags(r).join("; ")) });
            out.push_str(&format!("| {} |\n", cells.join(" | ")));
        }
        for (strategy, line) in board_nccl(b) {
            out.push_str(&format!("\n- {}: {}", md_code(&strategy), md(&line)));
        }
        if !board_nccl(b).is_empty() {
            out.push('\n');
        }
    }
    out
}

/// How far two honest runs of the same work differ in time on these
/// devices: the CPU class's band if either ran on the CPU, else the GPU
/// classes' ([`crate::reproduction::Tolerance`]).
fn run_to_run_band(a: &str, b: &str) -> f64 {
    let gpu = |d: &str| d.starts_with("cuda");
    if gpu(a) && gpu(b) {
        crate::reproduction::Tolerance::GPU.time_band
    } else {
        crate::reproduction::Tolerance::CPU.time_band
    }
}

/// `harness compare`: every group of `a` next to the matching group of `b`
/// (same workload, and the same strategy when both have it).
pub fn compare_table(a: &[RunResult], b: &[RunResult]) -> String {
    let ga = groups(a);
    let gb = groups(b);
    let mut out = String::new();
    // A strategy in two tracks has a group in each: compared once.
    let mut seen = std::collections::BTreeSet::new();
    for x in ga.iter().filter(|x| seen.insert((x.workload.clone(), x.strategy.clone(), x.device.clone(), x.run.clone()))) {
        let y = gb.iter().find(|y| y.workload == x.workload && y.strategy == x.strategy).or_else(|| {
            let same_workload: Vec<_> = gb.iter().filter(|y| y.workload == x.workload).collect();
            (same_workload.len() == 1).then(|| same_workload[0])
        });
        let Some(y) = y else { continue };
        let (rx, ry) = (score(x.clone()), score(y.clone()));
        // Two runs differ by more than the repeats inside either do: a
        // timing difference between runs is called only beyond the
        // class's run-to-run band (docs/rules.md, "Reproduction").
        let band = (x.run != y.run).then(|| run_to_run_band(&x.device, &y.device));
        // The result files chose the names: for a terminal, escaped.
        let p = |s: &str| printable(s).into_owned();
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED);
        t.set_header([
            "metric",
            &format!("A: {}", p(&x.strategy)),
            "A median",
            &format!("B: {}", p(&y.strategy)),
            "B median",
            "B / A",
            "difference",
        ]);
        // Every metric, the leaderboard's columns then (classifiers) the
        // final eval accuracy.
        for metric in Metric::ALL {
            let (sa, sb) = (rx.summaries.get(&metric), ry.summaries.get(&metric));
            if sa.is_none() && sb.is_none() {
                continue;
            }
            let (ratio, verdict) = match (sa, sb) {
                (Some(p), Some(q)) if p.olympic_mean != 0.0 => {
                    let v = stats::compare(q, p);
                    let r = q.olympic_mean / p.olympic_mean;
                    let word = match (v, metric.better()) {
                        (Verdict::Higher | Verdict::Lower, _) if band.is_some_and(|b| metric.is_timing() && r.max(1.0 / r) - 1.0 <= b) => {
                            format!("within run-to-run noise (±{:.0}%)", 100.0 * band.unwrap_or_default())
                        }
                        (Verdict::Higher, Better::Higher) | (Verdict::Lower, Better::Lower) => "B better (significant)".into(),
                        (Verdict::Higher, Better::Lower) | (Verdict::Lower, Better::Higher) => "B worse (significant)".into(),
                        (Verdict::NotSignificant, _) => "not significant".into(),
                        (Verdict::TooFewRepeats, _) => "too few repeats".into(),
                    };
                    (format!("{r:.3}"), word)
                }
                _ => ("-".into(), "-".into()),
            };
            let med = |s: Option<&Summary>| s.map_or("-".into(), |s| metric.format(s.median));
            t.add_row([metric.name().to_owned(), metric.format_summary(sa), med(sa), metric.format_summary(sb), med(sb), ratio, verdict]);
        }
        out.push_str(&format!("{} / {} on {} vs {}\n", p(&x.suite), p(&x.workload), p(&x.device), p(&y.device)));
        if let Some(b) = band {
            out.push_str(&format!(
                "A and B are two runs: a timing difference is called only beyond the run-to-run band of {} (±{:.0}%, docs/rules.md)\n",
                if b == crate::reproduction::CPU_TIME_BAND { "the CPU" } else { "GPUs" },
                100.0 * b
            ));
        }
        if !x.switches.is_empty() || !y.switches.is_empty() {
            let say = |s: &String| if s.is_empty() { "none".to_owned() } else { p(s) };
            out.push_str(&format!("switches: A {}; B {}\n", say(&x.switches), say(&y.switches)));
        }
        out.push_str(&format!("{t}\n\n"));
    }
    if out.is_empty() {
        out.push_str("no workload appears in both A and B\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let results = [
            result("std", Some("1.0"), 10.0),
            result("std", Some("1.1"), 30.0),
            result("std", Some("1.1"), 50.0),
            result("own", None, 7.0),
        ];
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
        let unknown =
            Metrics { nccl: Some(NcclRecord { note: Some("NCCL_DEBUG=WARN".into()), ..Default::default() }), ..Default::default() };
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
}
