//! The self-contained HTML report: tables and SVG plots drawn here, no
//! external files or scripts beyond a few lines for legend highlighting.
//! The submission boards ([`tracks`]) come first, each with its forest
//! plot, performance profiles and curves ([`plots`]); then the
//! per-workload tables. Each ranked submission has a page of its own
//! ([`submission_page`]). Every string from a result file or bundle goes
//! through [`crate::escape::html`]; the only links are to the page's own
//! sections, to the bundles' copies and pages beside it
//! ([`crate::submissions::Files`]), and back to the board.

mod plots;
pub mod projection;
pub mod submission_page;
mod ticks;
mod tracks;

use std::fmt::Write;

use super::submissions::{SubBoard, Verified};
use super::{Board, Metric, Row};
use crate::escape::{code_spans, html as esc};
use harness_format::histogram;
use plots::{svg_open, Frame, PALETTE};

fn legend(rows: &[Row]) -> String {
    let mut out = String::from(r#"<div class="legend">"#);
    for (i, r) in rows.iter().enumerate() {
        let c = PALETTE[i % PALETTE.len()];
        let _ = write!(out, r#"<span class="key" data-series="{i}"><i style="background:{c}"></i>{}</span>"#, esc(&r.label()));
    }
    out.push_str("</div>");
    out
}

/// An optional 95% interval.
type Interval = Option<(f64, f64)>;

/// Tokens/s per strategy: horizontal olympic-mean bars with their 95%
/// interval, each strategy's name written above its bar (long names never
/// overlap).
fn throughput_bars(id: &str, rows: &[Row]) -> String {
    let vals: Vec<Option<(f64, Interval)>> =
        rows.iter().map(|r| r.summaries.get(&Metric::TokensPerS).map(|s| (s.olympic_mean, s.ci95))).collect();
    let top = vals.iter().flatten().map(|(m, ci)| ci.map_or(*m, |c| c.1.max(*m))).fold(0.0, f64::max);
    let slot = 34.0;
    let mut f = Frame::new((0.0, top.max(1.0)), (0.0, 1.0));
    f.x = ticks::linear(0.0, top.max(1.0), 5);
    f.h = 50.0 + slot * rows.len().max(1) as f64;
    f.left = 16.0;
    let unit = Metric::TokensPerS.unit();
    let mut out = svg_open(id, &f, &format!("Throughput ({unit}, olympic mean and 95% interval)"));
    let y_axis = f.h - f.bottom;
    // About 6.2 pixels a character at 11px.
    let label_chars = ((f.w - f.left - f.right) / 6.2) as usize;
    for &v in &f.x.ticks {
        let x = f.px(v);
        let _ = write!(
            out,
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="10" y2="{y_axis}" stroke="#eee"/><line x1="{x:.1}" x2="{x:.1}" y1="{y_axis}" y2="{:.1}" stroke="#333"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" font-size="11">{}</text>"##,
            y_axis + 4.0,
            y_axis + 16.0,
            esc(&f.x.label(v))
        );
    }
    let _ = write!(out, r##"<path d="M{} 10 V{y_axis} H{}" stroke="#333" fill="none"/>"##, f.left, f.w - f.right);
    let _ = write!(
        out,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="12">{}</text>"##,
        (f.left + f.w - f.right) / 2.0,
        f.h - 6.0,
        esc(unit)
    );
    for (i, v) in vals.iter().enumerate() {
        let c = PALETTE[i % PALETTE.len()];
        let y = 14.0 + slot * i as f64;
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{:.1}" font-size="11">{}<title>{}</title></text>"#,
            f.left + 4.0,
            y + 9.0,
            esc(&plots::clip(&rows[i].label(), label_chars)),
            esc(&rows[i].label())
        );
        let Some((m, ci)) = v else { continue };
        let _ = write!(
            out,
            r#"<rect class="s{i}" x="{:.1}" y="{:.1}" width="{:.1}" height="14" fill="{c}"><title>{}: {:.0}</title></rect>"#,
            f.left,
            y + 13.0,
            (f.px(*m) - f.left).max(0.0),
            esc(&rows[i].group.strategy),
            m
        );
        if let Some((lo, hi)) = ci {
            let cy = y + 20.0;
            let _ = write!(
                out,
                r##"<path d="M{:.1} {cy:.1} H{:.1} M{:.1} {:.1} V{:.1} M{:.1} {:.1} V{:.1}" stroke="#000"/>"##,
                f.px(*lo),
                f.px(*hi),
                f.px(*lo),
                cy - 5.0,
                cy + 5.0,
                f.px(*hi),
                cy - 5.0,
                cy + 5.0
            );
        }
    }
    out.push_str("</svg></figure>");
    out
}

/// Step latency against percentile, from the merged HDR histograms of each
/// strategy's repeats; x is the number of nines, -log10(1 - q).
fn latency_curves(id: &str, rows: &[Row]) -> String {
    let qs = [0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.995, 0.999, 0.9995, 0.9999];
    let nines = |q: f64| -(1.0 - q).max(1e-4).log10();
    let series: Vec<Vec<(f64, f64)>> = rows
        .iter()
        .map(|r| {
            let mut merged = histogram::new_histogram();
            for h in r.group.step_histograms.iter().filter_map(|s| histogram::decode(s).ok()) {
                let _ = merged.add(&h);
            }
            if merged.is_empty() {
                return Vec::new();
            }
            qs.iter().map(|&q| (nines(q), merged.value_at_quantile(q) as f64 / 1e6)).collect()
        })
        .collect();
    let ymax = series.iter().flatten().map(|p| p.1).fold(0.0, f64::max);
    let f = Frame::new((0.0, 4.0), (0.0, ymax.max(1e-3)));
    let mut out = svg_open(id, &f, "Step latency by percentile (ms)");
    f.axes(&mut out, "percentile", "ms", Some(&|x| format!("{}%", ticks::tidy(100.0 * (1.0 - 10f64.powf(-x))))));
    for (i, s) in series.iter().enumerate() {
        polyline(&mut out, &f, i, s.iter().copied(), "2.5");
    }
    out.push_str("</svg></figure>");
    out
}

/// Training loss against training time (the first repeat of each strategy),
/// with the data's loss floor dashed where it is known.
fn loss_curves(id: &str, rows: &[Row]) -> String {
    let curves: Vec<&[(u64, f64, f64)]> = rows.iter().map(|r| r.group.runs.first().map_or(&[][..], |m| &m.loss_curve[..])).collect();
    let floor = rows.iter().find_map(|r| r.group.runs.first().and_then(|m| m.loss_floor));
    let xmax = curves.iter().flat_map(|c| c.iter()).map(|p| p.1).fold(0.0, f64::max);
    let ymax = curves.iter().flat_map(|c| c.iter()).map(|p| p.2).filter(|v| v.is_finite()).fold(0.0, f64::max);
    let ymin = floor.unwrap_or(0.0).min(curves.iter().flat_map(|c| c.iter()).map(|p| p.2).fold(f64::INFINITY, f64::min));
    let f = Frame::new((0.0, xmax.max(1e-3)), (ymin.min(ymax), ymax));
    let mut out = svg_open(id, &f, "Training loss against training time");
    f.axes(&mut out, "training time (s)", "loss", None);
    if let Some(fl) = floor {
        let y = f.py(fl);
        let _ = write!(
            out,
            r##"<line x1="{}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#888" stroke-dasharray="6 4"><title>loss floor {fl:.4}</title></line>"##,
            f.left,
            f.w - f.right
        );
    }
    for (i, c) in curves.iter().enumerate() {
        polyline(&mut out, &f, i, c.iter().filter(|p| p.2.is_finite()).map(|p| (p.1, p.2)), "2");
    }
    out.push_str("</svg></figure>");
    out
}

/// Series `i`'s line through `points` (data coordinates) in `f`, in its
/// palette colour; nothing for a series without points.
fn polyline(out: &mut String, f: &Frame, i: usize, points: impl Iterator<Item = (f64, f64)>, width: &str) {
    let d: Vec<String> = points.map(|(x, y)| format!("{:.1},{:.1}", f.px(x), f.py(y))).collect();
    if d.is_empty() {
        return;
    }
    let _ = write!(
        out,
        r#"<polyline class="s{i}" points="{}" fill="none" stroke="{}" stroke-width="{width}"/>"#,
        d.join(" "),
        PALETTE[i % PALETTE.len()]
    );
}

const STYLE: &str = "body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:2em auto;max-width:1500px;padding:0 1.5em;color:#222;line-height:1.4}\
h1{margin-bottom:.2em}h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:2em}h3{margin-top:1.6em}\
table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #d4d4d4;padding:4px 8px;text-align:right}\
td:nth-child(2),th{text-align:left}table.board td{white-space:nowrap}table.board td:nth-child(2){white-space:normal}th{background:#f4f4f4}small{color:#666;font-weight:normal}\
figure{display:inline-block;vertical-align:top;margin:0 1.5em 1em 0}figcaption{font-size:13px;font-weight:600;margin-bottom:4px}\
.figs{display:flex;flex-wrap:wrap;align-items:flex-start}.legend{margin:.5em 0;max-width:420px}\
.key{display:inline-block;margin-right:1.2em;cursor:default;font-size:13px}\
.key i,i.sw{display:inline-block;width:12px;height:12px;margin-right:5px;vertical-align:middle;border-radius:2px}\
.key svg.line{vertical-align:middle;margin-right:5px}.legend .note{font-size:12px;color:#555;margin:.3em 0}figure.forest{display:block}\
.dim{opacity:.15}.flag{color:#b00}.unranked{color:#777}.howto,.explain{font-size:14px;max-width:1100px;color:#333}\
.howto{background:#f6f8fa;border-left:4px solid #1f77b4;padding:.5em .8em}tr.reference td{color:#555;background:#fafafa}\
tr.tied td:first-child{font-weight:600}td.faster{background:#e8f5e9}td.slower{background:#fdecea}td.missed{color:#b00}\
table.facts th{width:11em}table.facts code{white-space:pre-wrap}nav ul{columns:2;font-size:14px}";

/// Hovering a legend key dims the other strategies' series.
const SCRIPT: &str = "document.querySelectorAll('.key').forEach(function(k){var s=k.dataset.series;var sec=k.closest('section');\
k.addEventListener('mouseenter',function(){sec.querySelectorAll('.plot [class^=s]').forEach(function(e){if(e.getAttribute('class')!=='s'+s)e.classList.add('dim');});});\
k.addEventListener('mouseleave',function(){sec.querySelectorAll('.dim').forEach(function(e){e.classList.remove('dim');});});});";

/// The whole page: the submission boards of `subs` and the bundles listed
/// apart (when bundles were given), then a section per board.
pub fn page(boards: &[Board], subs: &[SubBoard], bundles: &[Verified], sources: &[String]) -> String {
    page_with(boards, subs, bundles, sources, &[])
}

/// [`page`], with the suites' projections in a section of their own after
/// the boards ([`projection::section`]).
pub fn page_with(
    boards: &[Board],
    subs: &[SubBoard],
    bundles: &[Verified],
    sources: &[String],
    projections: &[crate::project::suite::SuiteProjection],
) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width\"><title>harness leaderboard</title><style>{STYLE}</style></head><body>"
    );
    out.push_str("<h1>harness leaderboard</h1><p class=\"howto\">Generated by <code>harness report</code>. Values are olympic means over repeats with bootstrap 95% intervals. Only what was measured side by side is compared: each row with its track's baseline of the same run, paired by repeat, and ranked against the rows of its run only; entries that no interval separates share a rank (=1). Runs are never pooled.</p>");
    let _ = write!(out, "<details><summary>{} source files</summary><ul>", sources.len());
    for s in sources {
        let _ = write!(out, "<li><code>{}</code></li>", esc(s));
    }
    out.push_str("</ul></details>");
    out.push_str(&tracks::section(boards, subs, bundles));
    if !boards.is_empty() {
        out.push_str("<h2 id=\"workloads\">Per-workload tables</h2>");
    }
    for (bi, b) in boards.iter().enumerate() {
        out.push_str(&workload_board(bi, b));
    }
    out.push_str(&projection::section(projections));
    let _ = writeln!(out, "<script>{SCRIPT}</script></body></html>");
    out
}

/// One per-workload table with its plots.
fn workload_board(bi: usize, b: &Board) -> String {
    let mut out = String::new();
    let track = b.track.as_ref().map_or(String::new(), |t| format!(" · track <code>{}</code>", esc(t)));
    let _ = write!(
        out,
        "<section id=\"board-{bi}\"><h3>{} / {}{track} <small>on {}</small></h3>",
        esc(&b.version.as_ref().map_or_else(|| b.suite.clone(), |v| format!("{} {v}", b.suite))),
        esc(&b.workload),
        esc(&b.device)
    );
    if !b.switches.is_empty() {
        let _ = write!(out, "<p class=\"flag\">switches: <code>{}</code> (not the default work)</p>", esc(&b.switches));
    }
    out.push_str("<table><tr><th>rank</th><th>strategy</th><th>target reached</th>");
    let accuracy = super::board_has_accuracy(b);
    if accuracy {
        let _ = write!(out, "<th>{}</th>", esc(Metric::EvalAccuracy.name()));
    }
    for m in Metric::SCORED {
        let _ = write!(out, "<th>{}</th>", esc(m.name()));
    }
    out.push_str("<th>time to target vs baseline</th><th>flags</th></tr>");
    for r in &b.rows {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td>",
            esc(&r.rank_cell()),
            esc(&r.label()),
            if r.has_target { format!("{} of {}", r.reached.0, r.reached.1) } else { "no target".into() }
        );
        if accuracy {
            let _ = write!(out, "<td>{}</td>", esc(&Metric::EvalAccuracy.format_summary(r.summaries.get(&Metric::EvalAccuracy))));
        }
        for m in Metric::SCORED {
            let _ = write!(out, "<td>{}</td>", esc(&m.format_summary(r.summaries.get(&m))));
        }
        let _ = write!(out, "<td>{}</td>", esc(&super::fmt_verdict(r.verdicts.get(&Metric::TimeToTarget))));
        let _ = write!(out, "<td class=\"flag\">{}</td></tr>", code_spans(&super::row_flags(r).join("; ")));
    }
    out.push_str("</table>");
    let nccl = super::board_nccl(b);
    if !nccl.is_empty() {
        out.push_str("<ul class=\"nccl\">");
        for (strategy, line) in nccl {
            let _ = write!(out, "<li><code>{}</code>: {}</li>", esc(&strategy), esc(&line));
        }
        out.push_str("</ul>");
    }
    out.push_str(&legend(&b.rows));
    out.push_str("<div class=\"figs\">");
    out.push_str(&throughput_bars(&format!("throughput-{bi}"), &b.rows));
    out.push_str(&latency_curves(&format!("latency-{bi}"), &b.rows));
    out.push_str(&loss_curves(&format!("loss-{bi}"), &b.rows));
    out.push_str("</div></section>");
    out
}
