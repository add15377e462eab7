//! Rule 10, the log's side: the run's log (`run.log`, written by the
//! console as the run went: host/src/console.rs) agrees with the result.
//!
//! The log is a series of runs (one per `harness run`, `--resume` or round
//! of rank processes), each opened by a line `harness: suite `NAME` (N of
//! M entries to run) on DEVICE -> OUT`, then a line per finished entry:
//! `  ID ok (seed S): ... tokens/s` with its figures, or `  ID FAILED:
//! ERROR`. Checked statically:
//!
//! - every entry of the result has exactly one line, `ok` for a finished
//!   one, whose figures (steps, losses, accuracy, tokens/s, seed) print as
//!   the result's do; no line names an entry the plan lacks;
//! - no line reports a failure the result does not record;
//! - each run of the log runs, in plan order, the first N entries that no
//!   earlier run of the log had run (as `harness run` picks them): a line
//!   removed from the middle of a run (a failure hidden by running the
//!   entry again) leaves a gap there;
//! - a run's entries ran on its device, and loaded the entered plugin
//!   once (one load time per process): an entry from another run has
//!   another load time.
//!
//! A failure at the very end of a run of the log, removed with its line
//! and run again by `--resume`, looks like an interrupted run and passes;
//! so does an entry from another run of the same plugin whose records were
//! edited to match. Only reproducing the run catches those.

use std::collections::{BTreeMap, BTreeSet};

use super::{list, Verdict, LOG};
use harness_format::results::{EntryResult, EntryStatus, RunResult};

const TODO: &str = "submit the result with the log its run wrote (<result>.log), neither edited";

/// One run of the log: its opening line and its entries' lines.
struct Run<'a> {
    /// 1-based line of its opening line.
    line: usize,
    suite: &'a str,
    to_run: usize,
    planned: usize,
    device: &'a str,
    entries: Vec<Entry<'a>>,
}

/// One entry's line.
struct Entry<'a> {
    line: usize,
    id: &'a str,
    /// The whole line, for `ok`; None for `FAILED`.
    ok: Option<&'a str>,
    /// `FAILED`: the error's first line.
    error: &'a str,
}

/// `harness: suite `NAME` (N of M entries to run) on DEVICE -> OUT`.
fn opening(line: &str) -> Option<(&str, usize, usize, &str)> {
    let rest = line.strip_prefix("harness: suite `")?;
    let (name, rest) = rest.split_once("` (")?;
    let (n, rest) = rest.split_once(" of ")?;
    let (m, rest) = rest.split_once(" entries to run) on ")?;
    let (device, _) = rest.split_once(" -> ")?;
    Some((name, n.parse().ok()?, m.parse().ok()?, device))
}

/// An entry's line: `  ID ok (seed ...` or `  ID FAILED: ...`.
fn entry(n: usize, line: &str) -> Option<Entry<'_>> {
    let body = line.strip_prefix("  ")?;
    let (id, rest) = body.split_once(' ')?;
    if rest.starts_with("ok (seed ") {
        Some(Entry { line: n, id, ok: Some(line), error: "" })
    } else {
        rest.strip_prefix("FAILED: ").map(|error| Entry { line: n, id, ok: None, error })
    }
}

/// The runs of the log, and entry lines before any opening line.
fn parse(log: &str) -> (Vec<Run<'_>>, usize) {
    let mut runs: Vec<Run> = Vec::new();
    let mut orphans = 0;
    for (i, line) in log.lines().enumerate() {
        if let Some((suite, to_run, planned, device)) = opening(line) {
            runs.push(Run { line: i + 1, suite, to_run, planned, device, entries: Vec::new() });
        } else if let Some(e) = entry(i + 1, line) {
            match runs.last_mut() {
                Some(r) => r.entries.push(e),
                None => orphans += 1,
            }
        }
    }
    (runs, orphans)
}

/// The line the console writes for a finished entry
/// (host/src/console.rs, `entry_finished`).
fn ok_line(e: &EntryResult) -> Option<String> {
    let m = e.metrics.as_ref()?;
    Some(format!(
        "  {} ok (seed {}): {} steps, loss {:.4} (eval {:.4}{}){}, {:.0} tokens/s",
        e.id,
        e.seed,
        m.steps,
        m.final_train_loss.unwrap_or(f64::NAN),
        m.final_eval_loss.unwrap_or(f64::NAN),
        m.loss_floor.map(|f| format!(", floor {f:.4}")).unwrap_or_default(),
        m.final_eval_accuracy
            .map(|a| format!(", accuracy {a:.4}{}", m.best_accuracy.map(|b| format!(" (best {b:.4})")).unwrap_or_default()))
            .unwrap_or_default(),
        m.tokens_per_s
    ))
}

/// Where two lines first differ, a word or two around it in each.
fn first_difference(logged: &str, recorded: &str) -> (String, String) {
    let (a, b): (Vec<&str>, Vec<&str>) = (logged.split_whitespace().collect(), recorded.split_whitespace().collect());
    let i = a.iter().zip(&b).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len()));
    let around = |w: &[&str]| w[i.saturating_sub(1).min(w.len())..(i + 2).min(w.len())].join(" ");
    (around(&a), around(&b))
}

/// Checks the log (`log`: its bytes, None when the bundle has none).
pub(super) fn check(log: Option<&[u8]>, r: &RunResult, v: &mut Verdict) {
    let Some(log) = log else {
        v.add(
            "failures",
            format!("the bundle has no run log ({LOG})"),
            "submit from where `harness run` wrote the result (its log is <result>.log next to it), or pass --log",
        );
        return;
    };
    let log = String::from_utf8_lossy(log);
    let (runs, orphans) = parse(&log);
    let failed: BTreeSet<&str> =
        r.entries.iter().filter(|e| matches!(e.status, EntryStatus::Failed { .. })).map(|e| e.id.as_str()).collect();
    let lines: Vec<&Entry> = runs.iter().flat_map(|run| &run.entries).collect();
    let in_log: BTreeSet<&str> = lines.iter().filter(|e| e.ok.is_none()).map(|e| e.id).collect();
    let unreported: Vec<&str> = in_log.difference(&failed).copied().collect();
    if !unreported.is_empty() {
        v.add(
            "failures",
            format!("the run's log reports failures the result does not: {}", list(&unreported)),
            "submit the result of the run as it was written; a failed entry may not be run again to replace it",
        );
    }
    if runs.is_empty() {
        v.add("log", format!("{LOG} has no line opening a run (`harness: suite ...`)"), TODO);
        return;
    }
    if orphans > 0 {
        v.add("log", format!("{LOG} has {orphans} entry lines before the line opening its first run"), TODO);
    }
    check_lines(&lines, r, v);
    check_runs(&runs, r, v);
}

/// Every entry has one line, and an `ok` line prints the result's figures.
fn check_lines(lines: &[&Entry], r: &RunResult, v: &mut Verdict) {
    let mut by_id: BTreeMap<&str, Vec<&Entry>> = BTreeMap::new();
    for e in lines {
        by_id.entry(e.id).or_default().push(e);
    }
    let planned: BTreeSet<&str> = r.plan.iter().map(|p| p.id.as_str()).collect();
    let unknown: Vec<&str> = by_id.keys().copied().filter(|id| !planned.contains(id)).collect();
    if !unknown.is_empty() {
        v.add("log", format!("the run's log has lines for entries the result's plan lacks: {}", list(&unknown)), TODO);
    }
    let mut unlogged = Vec::new();
    for e in &r.entries {
        let seen = by_id.get(e.id.as_str()).map_or(&[][..], Vec::as_slice);
        match (seen, &e.status) {
            ([], EntryStatus::Ok) => unlogged.push(e.id.as_str()),
            // Rank 0 died: the launcher recorded the failure, nobody logged it.
            ([], EntryStatus::Failed { .. }) => {}
            ([one], EntryStatus::Ok) => match (one.ok, ok_line(e)) {
                (Some(logged), Some(want)) if logged.trim_end() != want => {
                    let (said, gives) = first_difference(logged, &want);
                    v.add("log", format!("{}: the log (line {}) says `{said}` where the result gives `{gives}`", e.id, one.line), TODO);
                }
                _ => {} // a FAILED line: reported as a failure the result lacks
            },
            ([one], EntryStatus::Failed { error, .. }) => match one.ok {
                Some(_) => v.add("log", format!("{}: the log (line {}) says it finished; the result says it failed", e.id, one.line), TODO),
                None if one.error.trim_end() != error.lines().next().unwrap_or("").trim_end() => v.add(
                    "log",
                    format!("{}: the log (line {}) gives another error than the result: `{}`", e.id, one.line, one.error),
                    TODO,
                ),
                None => {}
            },
            (many, _) => v.add(
                "log",
                format!(
                    "{} has {} lines in the run's log (lines {}): it ran more than once, and a result may keep only its first run",
                    e.id,
                    many.len(),
                    many.iter().map(|x| x.line.to_string()).collect::<Vec<_>>().join(", ")
                ),
                "submit the result of the run as it was written; a failed entry may not be run again to replace it",
            ),
        }
    }
    if !unlogged.is_empty() {
        v.add(
            "log",
            format!(
                "{} entries of the result have no line in the run's log (taken from another run?): {}",
                unlogged.len(),
                list(&unlogged)
            ),
            TODO,
        );
    }
}

/// Each run of the log: the suite and plan it names, the entries it ran
/// in the order `harness run` picks them, on its device, with one load of
/// the plugin.
fn check_runs(runs: &[Run], r: &RunResult, v: &mut Verdict) {
    let results: BTreeMap<&str, &EntryResult> = r.entries.iter().map(|e| (e.id.as_str(), e)).collect();
    let logged: BTreeSet<&str> = runs.iter().flat_map(|run| run.entries.iter().map(|e| e.id)).collect();
    // Entries recorded failed with no line (rank 0 died) are not run again.
    let lost: BTreeSet<&str> = r
        .entries
        .iter()
        .filter(|e| matches!(e.status, EntryStatus::Failed { .. }) && !logged.contains(e.id.as_str()))
        .map(|e| e.id.as_str())
        .collect();
    let mut before: BTreeSet<&str> = BTreeSet::new();
    for run in runs {
        let at = format!("the log's run at line {}", run.line);
        if run.suite != r.suite.name || run.planned != r.plan.len() {
            v.add(
                "log",
                format!(
                    "{at} is of suite `{}` with {} planned entries; the result's is `{}` with {}",
                    run.suite,
                    run.planned,
                    r.suite.name,
                    r.plan.len()
                ),
                TODO,
            );
        }
        let todo: Vec<&str> =
            r.plan.iter().map(|p| p.id.as_str()).filter(|id| !before.contains(id) && !lost.contains(id)).take(run.to_run).collect();
        let ran: Vec<&str> = run.entries.iter().map(|e| e.id).collect();
        if ran.len() > run.to_run {
            v.add("log", format!("{at} has {} entry lines; it was to run {}", ran.len(), run.to_run), TODO);
        } else if let Some(i) = ran.iter().zip(&todo).position(|(a, b)| a != b) {
            v.add(
                "log",
                format!(
                    "{at} runs {} (line {}) where the plan's next entry is {}: that entry's line is missing from the log (removed?), or the log is not this result's",
                    ran[i], run.entries[i].line, todo[i]
                ),
                "submit the result with the log its run wrote; a failed entry may not be run again to replace it",
            );
        }
        let elsewhere: Vec<String> = run
            .entries
            .iter()
            .filter_map(|e| results.get(e.id).filter(|x| x.device != run.device).map(|x| format!("{} (`{}`)", e.id, x.device)))
            .collect();
        if !elsewhere.is_empty() {
            v.add("log", format!("{at} ran on `{}`; its entries' results say otherwise: {}", run.device, list(&elsewhere)), TODO);
        }
        plugin_loads(run, &at, &results, v);
        before.extend(ran);
    }
}

/// A run of the log is one process, which loads each plugin once: its
/// entries record one load time per plugin.
fn plugin_loads(run: &Run, at: &str, results: &BTreeMap<&str, &EntryResult>, v: &mut Verdict) {
    // Per plugin (slot, sha256): load time -> the entries that record it.
    let mut loads: BTreeMap<(String, String), BTreeMap<String, Vec<&str>>> = BTreeMap::new();
    for e in &run.entries {
        let Some(m) = results.get(e.id).and_then(|x| x.metrics.as_ref()) else { continue };
        for p in m.plugins.iter().filter(|p| p.load_s > 0.0) {
            loads.entry((p.slot.clone(), p.manifest.sha256.clone())).or_default().entry(p.load_s.to_string()).or_default().push(e.id);
        }
    }
    for ((slot, _), times) in loads.iter().filter(|(_, t)| t.len() > 1) {
        let each: Vec<String> = times.iter().map(|(t, ids)| format!("{t} s ({})", list(ids))).collect();
        v.add(
            "log",
            format!(
                "{at} is one process, which loads a plugin once, yet its entries record {} load times of its {slot} plugin (entries from another run?): {}",
                times.len(),
                each.join("; ")
            ),
            TODO,
        );
    }
}
