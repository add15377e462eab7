//! The text `harness project` prints: every table headed as a projection.

use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use harness_format::fmt::{human, printable};

use super::check::{Basis, Check};
use super::cluster::{trim, Cluster};
use super::projection::{BreakEven, Projection, Row};

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

/// What a projection was calibrated on, one line each.
pub fn calibration(p: &Projection) -> String {
    let mut out = String::new();
    for line in &p.calibration {
        out.push_str(&format!("calibration: {}\n", shown(line)));
    }
    for (w, g, from) in &p.intra {
        out.push_str(&format!("calibration: {}: bus bandwidth inside a node {:.1} GB/s measured by {}\n", shown(w), g / 8.0, shown(from)));
    }
    out.push_str(&format!(
        "calibration: compute slowdown beside collectives {:.2} (range {:.2} to {:.2}, from {} overlapped entries)\n",
        p.slowdown.mid, p.slowdown.lo, p.slowdown.hi, p.slowdown_fits
    ));
    out
}

/// The projection's tables: step, throughput and scaling per strategy and
/// cluster; each compressor's break-even bandwidth.
pub fn projection(p: &Projection) -> String {
    let mut out = format!("{LABEL}\n\n");
    out.push_str(&calibration(p));
    out.push('\n');
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
    out.push_str(&time_to_target(p));
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

/// The rows with a time to the target: training time only (evaluations
/// left out), at the world size whose steps to the target were measured;
/// and a line saying where it is not projected.
pub fn time_to_target(p: &Projection) -> String {
    let rows: Vec<_> = p.rows.iter().filter_map(|r| r.time_to_target.as_ref().map(|t| (r, t))).collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut t = table(vec!["workload", "strategy", "GPUs", "cluster", "time to target s [interval]", "steps to target measured by"]);
    for (r, ((mid, lo, hi), from)) in rows {
        t.add_row(vec![
            shown(&r.workload),
            shown(&r.strategy),
            r.prediction.world.to_string(),
            r.cluster.label(),
            format!("{mid:.1} [{lo:.1}, {hi:.1}]"),
            shown(from),
        ]);
    }
    let mut out = format!(
        "\n{LABEL}: time to the target (training steps only), at the world size that measured its steps to it (the same global batch); \
         at other sizes the global batch and the steps differ, which the model does not predict\n"
    );
    out.push_str(&t.to_string());
    out.push('\n');
    out
}

/// The check's table, and its summary: how many within 10%.
pub fn check(c: &Check) -> String {
    let mut out = format!("{LABEL}: --check, measured entries predicted from data that excluded them\n\n");
    let mut t = table(vec![
        "entry",
        "GPUs",
        "link",
        "measured tok/s",
        "predicted tok/s [interval]",
        "error",
        "slowdown",
        "calibrated on",
        "strategy costs from",
    ]);
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
            r.basis.label().to_string(),
            shown(&r.profile_from),
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    let within = c.rows.iter().filter(|r| r.error.abs() <= 0.10).count();
    let worst = c.rows.iter().map(|r| r.error.abs()).fold(0.0, f64::max);
    out.push_str(&format!(
        "{within} of {} predictions within 10% of the measured throughput; largest error {:.1}%\n",
        c.rows.len(),
        100.0 * worst
    ));
    for basis in [Basis::Buckets, Basis::OtherEntry, Basis::OneGpu] {
        let rows: Vec<_> = c.rows.iter().filter(|r| r.basis == basis).collect();
        if rows.is_empty() {
            continue;
        }
        let within = rows.iter().filter(|r| r.error.abs() <= 0.10).count();
        let worst = rows.iter().map(|r| r.error.abs()).fold(0.0, f64::max);
        out.push_str(&format!(
            "  calibrated on {}: {within} of {} within 10%; largest error {:.1}%\n",
            basis.label(),
            rows.len(),
            100.0 * worst
        ));
    }
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

/// The network a row ran on, for the summary and the plot: each node's
/// link to the others, or `one node` where none was given.
fn network(c: &Cluster) -> String {
    if c.net_gbps > 0.0 {
        format!("{} Gbps", trim(c.net_gbps))
    } else {
        "one node".into()
    }
}

/// Distinct values in first-seen order.
fn distinct<T: PartialEq + Clone>(xs: impl Iterator<Item = T>) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for x in xs {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

fn workloads(p: &Projection) -> Vec<String> {
    distinct(p.rows.iter().map(|r| r.workload.clone()))
}

/// The projection in short, per workload: tokens/s on all GPUs and the
/// scaling efficiency, one row per strategy and network, one column per
/// number of GPUs; then each compressor's break-even bandwidth per number
/// of GPUs.
pub fn summary(p: &Projection) -> String {
    let mut out = String::new();
    for w in workloads(p) {
        let rows: Vec<&Row> = p.rows.iter().filter(|r| r.workload == w).collect();
        let mut sizes = distinct(rows.iter().map(|r| r.prediction.world));
        sizes.sort();
        let mut header = vec!["strategy".to_string(), "network".to_string()];
        header.extend(sizes.iter().map(|n| format!("{n} GPUs")));
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED);
        t.set_header(header);
        for s in distinct(rows.iter().map(|r| r.strategy.clone())) {
            for net in distinct(rows.iter().filter(|r| r.strategy == s).map(|r| network(&r.cluster))) {
                let mut line = vec![shown(&s), net.clone()];
                for &n in &sizes {
                    let cell = rows.iter().find(|r| r.strategy == s && network(&r.cluster) == net && r.prediction.world == n);
                    line.push(
                        cell.map_or("-".into(), |r| {
                            format!("{} ({:.0}%)", human(r.prediction.tokens_per_s), 100.0 * r.prediction.efficiency)
                        }),
                    );
                }
                t.add_row(line);
            }
        }
        out.push_str(&format!("{LABEL}\n{}: tokens/s on all GPUs (scaling efficiency against one GPU)\n", shown(&w)));
        out.push_str(&t.to_string());
        out.push('\n');
        let be: Vec<&BreakEven> = p.break_even.iter().filter(|b| b.workload == w).collect();
        if be.is_empty() {
            out.push_str(&format!("{}: no compressor measured on this workload in the inputs: no break-even bandwidth\n", shown(&w)));
            continue;
        }
        let mut bsizes = distinct(be.iter().map(|b| b.cluster.world()));
        bsizes.sort();
        let mut header = vec!["compressor".to_string()];
        header.extend(bsizes.iter().map(|n| format!("{n} GPUs")));
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED);
        t.set_header(header);
        for s in distinct(be.iter().map(|b| b.strategy.clone())) {
            let mut line = vec![shown(&s)];
            for &n in &bsizes {
                // The break-even varies the limiting link: the same on
                // every network of one size (the first is shown).
                let cell = be.iter().find(|b| b.strategy == s && b.cluster.world() == n);
                line.push(cell.map_or("-".into(), |b| match b.gbps {
                    Ok(Some(g)) => format!("{} Gbps", sig(g)),
                    Ok(None) => "never".into(),
                    Err(()) => "always".into(),
                }));
            }
            t.add_row(line);
        }
        out.push_str(&format!(
            "{}: break-even bandwidth, below which the compressor is faster than the all-reduce (the link between nodes; on one node, inside it)\n",
            shown(&w)
        ));
        out.push_str(&t.to_string());
        out.push('\n');
    }
    out
}

/// Three significant digits.
fn sig(x: f64) -> String {
    let d = (2 - x.abs().log10().floor() as i32).max(0) as usize;
    format!("{x:.d$}")
}

/// One line of a projection's plot (drawn by `crate::html::projection`).
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The legend's text: strategy and network.
    pub name: String,
    /// Palette index (the strategy).
    pub colour: usize,
    /// Dash pattern index (the network): 0 solid, then dashed, dotted.
    pub dash: usize,
    /// (GPUs, tokens/s, low end, high end), ascending in GPUs.
    pub points: Vec<(f64, f64, f64, f64)>,
}

/// The plot's series of one workload: a line per strategy (colour) and
/// network (dash).
pub fn series(p: &Projection, workload: &str) -> Vec<Series> {
    let rows: Vec<&Row> = p.rows.iter().filter(|r| r.workload == workload).collect();
    let strategies = distinct(rows.iter().map(|r| r.strategy.clone()));
    let nets = distinct(rows.iter().map(|r| network(&r.cluster)));
    let mut out = Vec::new();
    for (si, s) in strategies.iter().enumerate() {
        for (ni, net) in nets.iter().enumerate() {
            let mut points: Vec<(f64, f64, f64, f64)> = rows
                .iter()
                .filter(|r| &r.strategy == s && &network(&r.cluster) == net)
                .map(|r| (r.prediction.world as f64, r.prediction.tokens_per_s, r.prediction.tokens_lo, r.prediction.tokens_hi))
                .collect();
            if points.is_empty() {
                continue;
            }
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            out.push(Series { name: format!("{s}, {net}"), colour: si, dash: ni, points });
        }
    }
    out
}

/// Each workload's series, in the order the rows name the workloads.
pub fn workload_series(p: &Projection) -> Vec<(String, Vec<Series>)> {
    workloads(p).into_iter().map(|w| (w.clone(), series(p, &w))).collect()
}
