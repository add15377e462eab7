//! Reports: the summary table printed at the end of `harness run`.

use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};

use crate::launch::human;
use crate::results::{EntryStatus, RunResult};

/// A table of every entry: throughput, latency, MFU, memory, loss, target.
pub fn summary_table(r: &RunResult) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header([
        "entry",
        "status",
        "tokens/s",
        "step p50 ms",
        "step p99 ms",
        "MFU",
        "peak mem",
        "eval loss",
        "floor",
        "target",
        "time to target",
    ]);
    for e in &r.entries {
        let status = match &e.status {
            EntryStatus::Ok => "ok".to_owned(),
            EntryStatus::Failed { .. } => "FAILED".to_owned(),
        };
        let row: Vec<String> = match &e.metrics {
            Some(m) => {
                let mem = m.memory.peak_device_allocated_bytes.map(|b| b as u64).or(m.memory.peak_rss_bytes).map_or("-".into(), bytes);
                vec![
                    e.id.clone(),
                    status,
                    human(m.tokens_per_s),
                    m.step.as_ref().map_or("-".into(), |s| format!("{:.2}", s.p50_ms)),
                    m.step.as_ref().map_or("-".into(), |s| format!("{:.2}", s.p99_ms)),
                    m.mfu.map_or("-".into(), |x| format!("{:.1}%", 100.0 * x)),
                    mem,
                    opt(m.final_eval_loss),
                    opt(m.loss_floor),
                    opt(m.target_loss),
                    match (m.target_loss, m.time_to_target_s) {
                        (None, _) => "-".into(),
                        (Some(_), Some(s)) => format!("{s:.1} s"),
                        (Some(_), None) => "missed".into(),
                    },
                ]
            }
            None => {
                let mut v = vec![e.id.clone(), status];
                v.extend(std::iter::repeat_n("-".to_owned(), 9));
                v
            }
        };
        t.add_row(row.into_iter().map(Cell::new));
    }
    for c in 2..11 {
        if let Some(col) = t.column_mut(c) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    let mut out = t.to_string();
    for e in &r.entries {
        if let EntryStatus::Failed { error } = &e.status {
            out.push_str(&format!("\n{}: {error}", e.id));
        }
    }
    out
}

fn opt(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.4}"))
}

/// 1536 -> "1.5 KiB".
pub fn bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}
