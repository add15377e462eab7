//! The text `harness project` prints: every table headed as a projection.

use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use harness_format::fmt::{human, printable};

use super::check::Check;
use super::projection::Projection;

/// The heading every projection carries.
pub const LABEL: &str = "PROJECTION: a calibrated model's prediction, not a measurement (docs/projection.md)";

fn table(header: Vec<&str>) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(header);
    t
}

/// A string from an input file, as the terminal may show it (escape
/// sequences and controls escaped).
fn shown(s: &str) -> String {
    printable(s).into_owned()
}

fn pct(x: f64) -> String {
    format!("{:+.1}%", 100.0 * x)
}

/// The projection's tables: step, throughput and scaling per strategy and
/// cluster; each compressor's break-even bandwidth.
pub fn projection(p: &Projection) -> String {
    let mut out = format!("{LABEL}\n\n");
    for line in &p.calibration {
        out.push_str(&format!("calibration: {}\n", shown(line)));
    }
    if let Some((g, from)) = &p.intra {
        out.push_str(&format!("calibration: bus bandwidth inside a node {:.1} GB/s measured by {}\n", g / 8.0, shown(from)));
    }
    out.push_str(&format!(
        "calibration: compute slowdown beside collectives {:.2} (range {:.2} to {:.2}, from {} overlapped entries)\n\n",
        p.slowdown.mid, p.slowdown.lo, p.slowdown.hi, p.slowdown_fits
    ));
    let mut t =
        table(vec!["workload", "strategy", "GPUs", "cluster", "step ms [interval]", "tokens/s [interval]", "scaling", "exposed comm ms"]);
    for r in &p.rows {
        let x = &r.prediction;
        t.add_row(vec![
            shown(&r.workload),
            shown(&r.strategy),
            x.world.to_string(),
            r.cluster.label(),
            format!("{:.1} [{:.1}, {:.1}]", x.step * 1e3, x.lo * 1e3, x.hi * 1e3),
            format!("{} [{}, {}]", human(x.tokens_per_s), human(x.tokens_lo), human(x.tokens_hi)),
            format!("{:.0}%", 100.0 * x.efficiency),
            format!("{:.1}", x.parts.exposed * 1e3),
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    if !p.break_even.is_empty() {
        let mut t = table(vec!["workload", "compressor", "cluster", "faster than all-reduce when the limiting link is below"]);
        for b in &p.break_even {
            let v = match b.gbps {
                Ok(Some(g)) => format!("{g:.3} Gbps"),
                Ok(None) => "never (slower at every bandwidth from 0.01 Gbps)".into(),
                Err(()) => "always (faster up to 100 Tbps)".into(),
            };
            t.add_row(vec![shown(&b.workload), shown(&b.strategy), b.cluster.label(), v]);
        }
        out.push_str(&format!("\n{LABEL}: break-even bandwidth (net between nodes; inside the node on one node)\n"));
        out.push_str(&t.to_string());
        out.push('\n');
    }
    for s in &p.skipped {
        out.push_str(&format!("skipped: {}\n", shown(s)));
    }
    out
}

/// The check's table, and its summary: how many within 10%.
pub fn check(c: &Check) -> String {
    let mut out = format!("{LABEL}: --check, measured entries predicted from data that excluded them\n\n");
    let mut t =
        table(vec!["entry", "GPUs", "link", "measured tok/s", "predicted tok/s [interval]", "error", "slowdown", "strategy costs from"]);
    for r in &c.rows {
        let x = &r.predicted;
        t.add_row(vec![
            shown(&r.target),
            r.world.to_string(),
            r.setting.clone(),
            human(r.measured),
            format!("{} [{}, {}]", human(x.tokens_per_s), human(x.tokens_lo), human(x.tokens_hi)),
            pct(r.error),
            format!("{:.2}", r.slowdown.mid),
            shown(&r.profile_from),
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    let within = c.rows.iter().filter(|r| r.error.abs() <= 0.10).count();
    let worst = c.rows.iter().map(|r| r.error.abs()).fold(0.0, f64::max);
    out.push_str(&format!(
        "{within} of {} entries within 10% of the measured throughput; largest error {:.1}%\n",
        c.rows.len(),
        100.0 * worst
    ));
    let mut computes: Vec<&str> = c.rows.iter().map(|r| r.compute_from.as_str()).collect();
    computes.sort();
    computes.dedup();
    out.push_str(&format!("one-GPU compute from: {}\n", shown(&computes.join(", "))));
    let mut benches: Vec<&str> = c.rows.iter().map(|r| r.bench_from.as_str()).collect();
    benches.sort();
    benches.dedup();
    out.push_str(&format!("collective bandwidth from: {}\n", shown(&benches.join(", "))));
    for s in &c.skipped {
        out.push_str(&format!("skipped: {}\n", shown(s)));
    }
    out
}
