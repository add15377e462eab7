//! The self-contained HTML report: tables and SVG plots drawn here, no
//! external files or scripts beyond a few lines for legend highlighting.
//! Every string from a result file or bundle goes through
//! [`crate::escape::html`]; the only links are to the page's own tables
//! and to the bundles' copies beside it ([`submissions::Files`]).

use std::fmt::Write;

use super::submissions::{self, SubBoard, Verified};
use super::{Board, Metric, Row};
use crate::escape::{html as esc, Markup};
use crate::measure;

/// Series colours (Tableau 10); tests look for the first ones on screen.
pub const PALETTE: &[&str] = &["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/// A plot area mapping data coordinates to SVG pixels.
struct Frame {
    w: f64,
    h: f64,
    left: f64,
    /// Room for the last x tick label.
    right: f64,
    bottom: f64,
    x: (f64, f64),
    y: (f64, f64),
}

impl Frame {
    fn new(x: (f64, f64), y: (f64, f64)) -> Frame {
        let widen = |(a, b): (f64, f64)| if (b - a).abs() < 1e-12 { (a - 1.0, b + 1.0) } else { (a, b) };
        Frame { w: 560.0, h: 300.0, left: 70.0, right: 28.0, bottom: 40.0, x: widen(x), y: widen(y) }
    }
    fn px(&self, x: f64) -> f64 {
        self.left + (x - self.x.0) / (self.x.1 - self.x.0) * (self.w - self.left - self.right)
    }
    fn py(&self, y: f64) -> f64 {
        (self.h - self.bottom) - (y - self.y.0) / (self.y.1 - self.y.0) * (self.h - self.bottom - 10.0)
    }
    /// Axes, ticks and labels; `fx` formats x tick values.
    fn axes(&self, out: &mut String, xlabel: &str, ylabel: &str, fx: &dyn Fn(f64) -> String) {
        let (x0, y0, x1, y1) = (self.left, self.h - self.bottom, self.w - self.right, 10.0);
        let _ = write!(out, r##"<path d="M{x0} {y1} V{y0} H{x1}" stroke="#333" fill="none"/>"##);
        for i in 0..=4 {
            let fy = self.y.0 + (self.y.1 - self.y.0) * i as f64 / 4.0;
            let fxv = self.x.0 + (self.x.1 - self.x.0) * i as f64 / 4.0;
            let (py, px) = (self.py(fy), self.px(fxv));
            let _ = write!(
                out,
                r##"<line x1="{x0}" x2="{x1}" y1="{py:.1}" y2="{py:.1}" stroke="#eee"/><text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11">{}</text>"##,
                x0 - 4.0,
                py + 4.0,
                tick(fy)
            );
            let _ = write!(out, r##"<text x="{px:.1}" y="{:.1}" text-anchor="middle" font-size="11">{}</text>"##, y0 + 16.0, esc(&fx(fxv)));
        }
        let _ = write!(
            out,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="12">{}</text>"##,
            (x0 + x1) / 2.0,
            self.h - 4.0,
            esc(xlabel)
        );
        let _ = write!(
            out,
            r##"<text x="12" y="{:.1}" font-size="12" transform="rotate(-90 12 {:.1})" text-anchor="middle">{}</text>"##,
            (y0 + y1) / 2.0,
            (y0 + y1) / 2.0,
            esc(ylabel)
        );
    }
}

fn tick(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{:.1}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 10.0 || a == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn svg_open(id: &str, f: &Frame, title: &str) -> String {
    format!(
        r##"<figure><figcaption>{}</figcaption><svg id="{}" class="plot" width="{}" height="{}" viewBox="0 0 {} {}" xmlns="http://www.w3.org/2000/svg"><rect width="100%" height="100%" fill="#fff"/>"##,
        esc(title),
        esc(id),
        f.w,
        f.h,
        f.w,
        f.h
    )
}

fn legend(rows: &[Row]) -> String {
    let mut out = String::from(r#"<div class="legend">"#);
    for (i, r) in rows.iter().enumerate() {
        let c = PALETTE[i % PALETTE.len()];
        let _ = write!(out, r#"<span class="key" data-series="{i}"><i style="background:{c}"></i>{}</span>"#, esc(&r.group.strategy));
    }
    out.push_str("</div>");
    out
}

/// An optional 95% interval.
type Interval = Option<(f64, f64)>;

/// Tokens/s per strategy: olympic mean bars with their 95% interval.
fn throughput_bars(id: &str, rows: &[Row]) -> String {
    let vals: Vec<Option<(f64, Interval)>> =
        rows.iter().map(|r| r.summaries.get(&Metric::TokensPerS).map(|s| (s.olympic_mean, s.ci95))).collect();
    let top = vals.iter().flatten().map(|(m, ci)| ci.map_or(*m, |c| c.1.max(*m))).fold(0.0, f64::max) * 1.1;
    let f = Frame::new((0.0, rows.len().max(1) as f64), (0.0, top.max(1.0)));
    let unit = Metric::TokensPerS.unit();
    let mut out = svg_open(id, &f, &format!("Throughput ({unit}, olympic mean and 95% interval)"));
    f.axes(&mut out, "strategy", unit, &|_| String::new());
    let slot = (f.px(1.0) - f.px(0.0)).max(1.0);
    for (i, v) in vals.iter().enumerate() {
        let Some((m, ci)) = v else { continue };
        let c = PALETTE[i % PALETTE.len()];
        let (x, y0, y) = (f.px(i as f64) + 0.15 * slot, f.py(0.0), f.py(*m));
        let _ = write!(
            out,
            r#"<rect class="s{i}" x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{c}"><title>{}: {:.0}</title></rect>"#,
            0.7 * slot,
            (y0 - y).max(0.0),
            esc(&rows[i].group.strategy),
            m
        );
        if let Some((lo, hi)) = ci {
            let cx = x + 0.35 * slot;
            let _ = write!(
                out,
                r##"<path d="M{cx:.1} {:.1} V{:.1} M{:.1} {:.1} H{:.1} M{:.1} {:.1} H{:.1}" stroke="#000"/>"##,
                f.py(*lo),
                f.py(*hi),
                cx - 6.0,
                f.py(*lo),
                cx + 6.0,
                cx - 6.0,
                f.py(*hi),
                cx + 6.0
            );
        }
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11">{}</text>"#,
            x + 0.35 * slot,
            f.h - f.bottom + 16.0,
            esc(&rows[i].group.strategy)
        );
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
            let mut merged = measure::new_histogram();
            for h in r.group.step_histograms.iter().filter_map(|s| measure::decode(s).ok()) {
                let _ = merged.add(&h);
            }
            if merged.is_empty() {
                return Vec::new();
            }
            qs.iter().map(|&q| (nines(q), merged.value_at_quantile(q) as f64 / 1e6)).collect()
        })
        .collect();
    let ymax = series.iter().flatten().map(|p| p.1).fold(0.0, f64::max) * 1.1;
    let f = Frame::new((0.0, 4.0), (0.0, ymax.max(1e-3)));
    let mut out = svg_open(id, &f, "Step latency by percentile (ms)");
    f.axes(&mut out, "percentile", "ms", &|x| format!("{}%", 100.0 * (1.0 - 10f64.powf(-x))).replace(".0%", "%"));
    for (i, s) in series.iter().enumerate() {
        if s.is_empty() {
            continue;
        }
        let d: Vec<String> = s.iter().map(|(x, y)| format!("{:.1},{:.1}", f.px(*x), f.py(*y))).collect();
        let _ = write!(
            out,
            r#"<polyline class="s{i}" points="{}" fill="none" stroke="{}" stroke-width="2.5"/>"#,
            d.join(" "),
            PALETTE[i % PALETTE.len()]
        );
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
    let ymax = curves.iter().flat_map(|c| c.iter()).map(|p| p.2).filter(|v| v.is_finite()).fold(0.0, f64::max) * 1.05;
    let ymin = floor.unwrap_or(0.0).min(curves.iter().flat_map(|c| c.iter()).map(|p| p.2).fold(f64::INFINITY, f64::min)) * 0.95;
    let f = Frame::new((0.0, xmax.max(1e-3)), (ymin.min(ymax), ymax));
    let mut out = svg_open(id, &f, "Training loss against training time");
    f.axes(&mut out, "training time (s)", "loss", &|x| tick(x));
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
        if c.is_empty() {
            continue;
        }
        let d: Vec<String> = c.iter().filter(|p| p.2.is_finite()).map(|p| format!("{:.1},{:.1}", f.px(p.1), f.py(p.2))).collect();
        let _ = write!(
            out,
            r#"<polyline class="s{i}" points="{}" fill="none" stroke="{}" stroke-width="2"/>"#,
            d.join(" "),
            PALETTE[i % PALETTE.len()]
        );
    }
    out.push_str("</svg></figure>");
    out
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0;font-size:13px}\
td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}td:nth-child(2),th{text-align:left}figure{display:inline-block;margin:0 1em 1em 0}\
figcaption{font-size:13px;font-weight:600}.legend{margin:.5em 0}.key{margin-right:1.2em;cursor:default;font-size:13px}\
.key i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:middle}.dim{opacity:.15}.flag{color:#b00}.unranked{color:#777}";

/// Hovering a legend key dims the other strategies' series.
const SCRIPT: &str = "document.querySelectorAll('.key').forEach(function(k){var s=k.dataset.series;var sec=k.closest('section');\
k.addEventListener('mouseenter',function(){sec.querySelectorAll('.plot [class^=s]').forEach(function(e){if(e.getAttribute('class')!=='s'+s)e.classList.add('dim');});});\
k.addEventListener('mouseleave',function(){sec.querySelectorAll('.dim').forEach(function(e){e.classList.remove('dim');});});});";

/// One section per track of the submission boards: each row with its
/// plugin's name, version and hash, its ratios, and links to its copied
/// files and to the per-workload tables of its run; then the bundles
/// listed apart, with why.
fn submissions(boards: &[Board], subs: &[SubBoard], bundles: &[Verified]) -> String {
    let mut out = String::new();
    if bundles.is_empty() {
        return out;
    }
    let _ = write!(out, "<h2>Submissions</h2><p>{}</p>", esc(submissions::EXPLAINED));
    for b in subs {
        let _ = write!(
            out,
            "<section class=\"track\"><h3>{}</h3><p>Baseline: <code>{}</code></p>",
            submissions::title(b, Markup::Html),
            esc(&b.baseline)
        );
        out.push_str("<table><tr><th>rank</th><th>plugin</th><th>sha256</th>");
        for w in &b.workloads {
            let _ = write!(out, "<th>{} <small>time vs baseline</small></th>", esc(w));
        }
        for w in &b.workloads {
            let _ = write!(out, "<th>{} <small>{} vs baseline</small></th>", esc(w), esc(b.second.name()));
        }
        out.push_str("<th>profile</th><th>bundle</th><th>details</th></tr>");
        for r in &b.rows {
            let plugin = r.plugin_cell(Markup::Html);
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{plugin}</td><td><code title=\"{}\">{}</code></td>",
                r.rank.map_or("-".into(), |k| k.to_string()),
                esc(&r.sha256),
                esc(submissions::short(&r.sha256))
            );
            for (s, n) in r.ratios.iter().zip(&r.reached) {
                let _ = write!(out, "<td>{}</td>", esc(&submissions::ratio_cell(s, *n)));
            }
            for s in &r.second {
                let _ = write!(out, "<td>{}</td>", esc(&submissions::ratio_cell(s, (0, 0))));
            }
            let (bundle, mut links) = if r.reference {
                (String::new(), String::new())
            } else {
                (format!("<code>{}</code>", esc(&r.bundle.display().to_string())), r.files.html())
            };
            for w in b.workloads.iter().filter(|_| !r.reference) {
                if let Some(i) = boards.iter().position(|x| {
                    x.suite == b.suite
                        && x.version.as_deref().unwrap_or("-") == b.version
                        && &x.workload == w
                        && x.rows.iter().any(|row| row.group.strategy == r.strategy)
                }) {
                    let _ = write!(links, " <a href=\"#board-{i}\">{}</a>", esc(w));
                }
            }
            let _ = write!(out, "<td>{:.2}</td><td>{bundle}</td><td>{links}</td></tr>", r.profile);
        }
        out.push_str("</table></section>");
    }
    if subs.is_empty() {
        out.push_str("<p>No bundle verified: none is ranked.</p>");
    }
    let apart: Vec<&Verified> = submissions::apart(bundles).collect();
    if !apart.is_empty() {
        out.push_str("<section class=\"apart\"><h3>Not ranked</h3><ul>");
        for v in apart {
            let plugin = submissions::plugin_of(v).map_or_else(|| "no plugin entered".to_owned(), |p| esc(&p));
            let files = v.files.html();
            let _ = write!(
                out,
                "<li class=\"unranked\"><code>{}</code> ({plugin}): <span class=\"flag\">{}</span>{}</li>",
                esc(&v.bundle.dir.display().to_string()),
                esc(&submissions::why_apart(v).join("; ")),
                if files.is_empty() { String::new() } else { format!("; files: {files}") }
            );
        }
        out.push_str("</ul></section>");
    }
    out
}

/// The whole page: the submission boards of `subs` and the bundles listed
/// apart (when bundles were given), then a section per board.
pub fn page(boards: &[Board], subs: &[SubBoard], bundles: &[Verified], sources: &[String]) -> String {
    let mut out = String::new();
    let _ = write!(out, "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>harness leaderboard</title><style>{STYLE}</style></head><body>");
    out.push_str("<h1>harness leaderboard</h1><p>Generated by <code>harness report</code>; olympic means over repeats with bootstrap 95% intervals. Sources:</p><ul>");
    for s in sources {
        let _ = write!(out, "<li><code>{}</code></li>", esc(s));
    }
    out.push_str("</ul>");
    out.push_str(&submissions(boards, subs, bundles));
    for (bi, b) in boards.iter().enumerate() {
        let _ = write!(
            out,
            "<section id=\"board-{bi}\"><h2>{} / {} <small>on {}</small></h2>",
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
        out.push_str("<th>flags</th></tr>");
        for r in &b.rows {
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}{}</td><td>{}</td>",
                r.rank.map_or("-".into(), |k| k.to_string()),
                esc(&r.group.strategy),
                if r.group.baseline { " (baseline)" } else { "" },
                if r.has_target { format!("{} of {}", r.reached.0, r.reached.1) } else { "no target".into() }
            );
            if accuracy {
                let _ = write!(out, "<td>{}</td>", esc(&Metric::EvalAccuracy.format_summary(r.summaries.get(&Metric::EvalAccuracy))));
            }
            for m in Metric::SCORED {
                let _ = write!(out, "<td>{}</td>", esc(&m.format_summary(r.summaries.get(&m))));
            }
            let _ = write!(out, "<td class=\"flag\">{}</td></tr>", esc(&super::row_flags(r).join("; ")));
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
        out.push_str(&throughput_bars(&format!("throughput-{bi}"), &b.rows));
        out.push_str(&latency_curves(&format!("latency-{bi}"), &b.rows));
        out.push_str(&loss_curves(&format!("loss-{bi}"), &b.rows));
        out.push_str("</section>");
    }
    let _ = writeln!(out, "<script>{SCRIPT}</script></body></html>");
    out
}
