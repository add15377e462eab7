//! The summary table printed at the end of `harness run`, and the lines
//! beside it: plugin calls, checkpoints and failures, NCCL.

use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};

use crate::metric::bytes;
use harness_format::fmt::human;
use harness_format::results::{EntryStatus, Metrics, RunResult};

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

fn opt(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.4}"))
}
