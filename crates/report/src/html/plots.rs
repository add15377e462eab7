//! The page's plots, drawn as inline SVG: the frame and axes the
//! per-workload plots share, and the submission boards' forest plot of
//! time-to-target ratios, performance profiles and loss-against-time
//! curves. Every label from a file goes through [`esc`]; nothing here
//! writes a link or a script.

use std::fmt::Write;

use super::ticks::{self, Axis};
use crate::escape::html as esc;
use crate::escape::short;
use crate::submissions::{self, SubBoard};

/// A plot area mapping data coordinates to SVG pixels, with its axes.
pub(super) struct Frame {
    pub w: f64,
    pub h: f64,
    pub left: f64,
    /// Room for the last x tick label.
    pub right: f64,
    pub bottom: f64,
    pub x: Axis,
    pub y: Axis,
}

/// The top margin of a frame's plot area.
const TOP: f64 = 10.0;

impl Frame {
    /// A 420 × 270 frame (three side by side on a laptop's screen) whose
    /// axes hold `x` and `y` ([`ticks::linear`]).
    pub fn new(x: (f64, f64), y: (f64, f64)) -> Frame {
        Frame { w: 420.0, h: 270.0, left: 60.0, right: 28.0, bottom: 40.0, x: ticks::linear(x.0, x.1, 6), y: ticks::linear(y.0, y.1, 5) }
    }
    pub fn px(&self, x: f64) -> f64 {
        self.left + (x - self.x.lo) / (self.x.hi - self.x.lo) * (self.w - self.left - self.right)
    }
    pub fn py(&self, y: f64) -> f64 {
        (self.h - self.bottom) - (y - self.y.lo) / (self.y.hi - self.y.lo) * (self.h - self.bottom - TOP)
    }
    /// Axes, grid, ticks and labels; `fx` formats x ticks (else the x
    /// axis's own labels).
    pub fn axes(&self, out: &mut String, xlabel: &str, ylabel: &str, fx: Option<&dyn Fn(f64) -> String>) {
        self.axes_with(out, xlabel, ylabel, fx, None)
    }
    /// [`Frame::axes`], with `fy` formatting the y ticks too (a log axis
    /// drawn in log space labels its ticks with the values).
    pub fn axes_with(
        &self,
        out: &mut String,
        xlabel: &str,
        ylabel: &str,
        fx: Option<&dyn Fn(f64) -> String>,
        fy: Option<&dyn Fn(f64) -> String>,
    ) {
        let (x0, y0, x1, y1) = (self.left, self.h - self.bottom, self.w - self.right, TOP);
        for &t in &self.y.ticks {
            let py = self.py(t);
            let label = fy.map_or_else(|| self.y.label(t), |f| f(t));
            let _ = write!(
                out,
                r##"<line x1="{x0}" x2="{x1}" y1="{py:.1}" y2="{py:.1}" stroke="#ececec"/><text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11">{}</text>"##,
                x0 - 5.0,
                py + 4.0,
                esc(&label)
            );
        }
        for &t in &self.x.ticks {
            let px = self.px(t);
            let label = fx.map_or_else(|| self.x.label(t), |f| f(t));
            let _ = write!(
                out,
                r##"<line x1="{px:.1}" x2="{px:.1}" y1="{y1}" y2="{y0}" stroke="#f3f3f3"/><line x1="{px:.1}" x2="{px:.1}" y1="{y0}" y2="{:.1}" stroke="#333"/><text x="{px:.1}" y="{:.1}" text-anchor="middle" font-size="11">{}</text>"##,
                y0 + 4.0,
                y0 + 16.0,
                esc(&label)
            );
        }
        let _ = write!(out, r##"<path d="M{x0} {y1} V{y0} H{x1}" stroke="#333" fill="none"/>"##);
        let _ = write!(
            out,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="12">{}</text>"##,
            (x0 + x1) / 2.0,
            self.h - 6.0,
            esc(xlabel)
        );
        let _ = write!(
            out,
            r##"<text x="14" y="{:.1}" font-size="12" transform="rotate(-90 14 {:.1})" text-anchor="middle">{}</text>"##,
            (y0 + y1) / 2.0,
            (y0 + y1) / 2.0,
            esc(ylabel)
        );
    }
}

pub(super) fn svg_open(id: &str, f: &Frame, title: &str) -> String {
    format!(
        r##"<figure><figcaption style="max-width:{}px">{}</figcaption><svg id="{}" class="plot" width="{}" height="{}" viewBox="0 0 {} {}" xmlns="http://www.w3.org/2000/svg"><rect width="100%" height="100%" fill="#fff"/>"##,
        f.w,
        esc(title),
        esc(id),
        f.w,
        f.h,
        f.w,
        f.h
    )
}

/// Series colours (Tableau 10); tests look for the first ones on screen.
pub const PALETTE: &[&str] = &["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/// The colour of a submission board's row: the baseline grey, the others
/// the palette in row order (ranked rows only).
pub(super) fn row_colour(b: &SubBoard, i: usize) -> &'static str {
    if b.rows[i].reference {
        return BASELINE;
    }
    let k = b.rows[..i].iter().filter(|r| !r.reference).count();
    PALETTE[k % PALETTE.len()]
}

/// The baseline's colour on the submission boards.
pub(super) const BASELINE: &str = "#666666";

/// `s` cut to `n` characters, with an ellipsis when cut.
pub(super) fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        format!("{}…", s.chars().take(n.saturating_sub(1)).collect::<String>())
    }
}

/// The forest plot's geometry: the label column, each workload's panel,
/// each row's height, and the margins above and below the rows.
const FOREST: (f64, f64, f64, f64) = (240.0, 28.0, 50.0, 48.0);

/// The forest plot of a submission board: one panel per workload, one line
/// per row (the submissions in rank order, the baseline's reference line
/// at 1 dashed), each submission's time to target over its own run's
/// baseline as a dot (hollow when n.s.) with its 95% interval, on a log
/// scale whose range
/// holds every dot, every interval and 1. A missed target is written, not
/// drawn. The plot is as tall as its rows and as wide as its labels and
/// workloads.
pub(super) fn forest(id: &str, b: &SubBoard) -> String {
    let rows: Vec<usize> = (0..b.rows.len()).filter(|&i| !b.rows[i].reference).collect();
    let (panel_w, row_h, top, bottom) = FOREST;
    let labels: Vec<String> = rows
        .iter()
        .map(|&i| clip(&format!("{} {} {}", submissions::rank_cell(&b.rows[i]), b.rows[i].plugin, b.rows[i].version), 30))
        .collect();
    // About 7 pixels a character at 12px.
    let label_w = (labels.iter().map(|l| l.chars().count()).max().unwrap_or(0) as f64 * 7.0 + 24.0).clamp(100.0, 240.0);
    let n = b.workloads.len().max(1) as f64;
    let (w, h) = (label_w + n * panel_w, top + rows.len().max(1) as f64 * row_h + bottom);
    let mut out = format!(
        r##"<svg id="{}" class="plot forest" width="{w}" height="{h}" viewBox="0 0 {w} {h}" xmlns="http://www.w3.org/2000/svg" role="img"><title>time to target over the baseline's, per workload</title><rect width="100%" height="100%" fill="#fff"/>"##,
        esc(id)
    );
    for (k, (&i, label)) in rows.iter().zip(&labels).enumerate() {
        let r = &b.rows[i];
        let y = top + (k as f64 + 0.5) * row_h;
        if k % 2 == 1 {
            let _ =
                write!(out, r##"<rect x="0" y="{:.1}" width="{w}" height="{row_h}" fill="#000" fill-opacity="0.035"/>"##, y - row_h / 2.0);
        }
        let name = format!("{} {} {} ({})", submissions::rank_cell(r), r.plugin, r.version, short(&r.sha256));
        let _ = write!(
            out,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="12" fill="{}">{}<title>{}</title></text>"##,
            label_w - 10.0,
            y + 4.0,
            row_colour(b, i),
            esc(label),
            esc(&name)
        );
    }
    for wi in 0..b.workloads.len() {
        forest_panel(&mut out, b, &rows, wi, label_w + wi as f64 * panel_w);
    }
    out.push_str("</svg>");
    out
}

/// The log axis of a forest panel: it holds 1 and each row's ratio and
/// interval on the workload, with a little room on both sides.
fn forest_axis(b: &SubBoard, rows: &[usize], wi: usize) -> Axis {
    let (mut lo, mut hi) = (1.0f64, 1.0f64);
    for &i in rows {
        if let Some(s) = b.rows[i].ratios[wi].as_ref().filter(|_| b.rows[i].reached[wi].0 == b.rows[i].reached[wi].1) {
            let (a, c) = submissions::interval(s);
            for v in [a, c, s.olympic_mean].into_iter().filter(|v| v.is_finite() && *v > 0.0) {
                lo = lo.min(v);
                hi = hi.max(v);
            }
        }
    }
    ticks::log(lo / 1.06, hi * 1.06, 5)
}

/// One workload's panel of the forest plot, its left edge at `left`.
fn forest_panel(out: &mut String, b: &SubBoard, rows: &[usize], wi: usize, left: f64) {
    let (panel_w, row_h, top, _) = FOREST;
    let workload = &b.workloads[wi];
    let (x0, x1) = (left + 16.0, left + panel_w - 16.0);
    let axis = forest_axis(b, rows, wi);
    let px = |v: f64| x0 + (v.ln() - axis.lo.ln()) / (axis.hi.ln() - axis.lo.ln()) * (x1 - x0);
    let y_end = top + rows.len().max(1) as f64 * row_h;
    let _ = write!(
        out,
        r##"<text x="{:.1}" y="18" text-anchor="middle" font-size="13" font-weight="600">{}<title>{}</title></text>"##,
        (x0 + x1) / 2.0,
        esc(&clip(workload, 28)),
        esc(workload)
    );
    for &t in &axis.ticks {
        let x = px(t);
        let _ = write!(
            out,
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="{top}" y2="{y_end:.1}" stroke="#e4e4e4"/><line x1="{x:.1}" x2="{x:.1}" y1="{y_end:.1}" y2="{:.1}" stroke="#333"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" font-size="11">{}</text>"##,
            y_end + 4.0,
            y_end + 16.0,
            esc(&axis.label(t))
        );
    }
    let _ = write!(out, r##"<path d="M{x0:.1} {y_end:.1} H{x1:.1}" stroke="#333"/>"##);
    let one = px(1.0);
    let _ = write!(
        out,
        r##"<line x1="{one:.1}" x2="{one:.1}" y1="{:.1}" y2="{y_end:.1}" stroke="{BASELINE}" stroke-dasharray="5 3" stroke-width="1.5"><title>the baseline: 1</title></line><text x="{one:.1}" y="{:.1}" text-anchor="middle" font-size="10" fill="{BASELINE}">baseline</text>"##,
        top - 6.0,
        top - 9.0
    );
    let _ = write!(
        out,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11" fill="#555">← faster · slower →</text>"##,
        (x0 + x1) / 2.0,
        y_end + 34.0
    );
    for (k, &i) in rows.iter().enumerate() {
        let r = &b.rows[i];
        let y = top + (k as f64 + 0.5) * row_h;
        let c = row_colour(b, i);
        match &r.ratios[wi] {
            Some(s) if r.reached[wi].0 == r.reached[wi].1 => {
                let (a, z) = submissions::interval(s);
                let tip = format!("{}: {}", workload, submissions::ratio_cell(&r.ratios[wi], r.reached[wi], true));
                let (a, z, m) = (px(a), px(z), px(s.olympic_mean));
                // Hollow where the interval holds the baseline's 1.
                let fill = if submissions::against_baseline(s) == Some("n.s.") { "#fff" } else { c };
                let _ = write!(
                    out,
                    r##"<g><title>{}</title><path d="M{a:.1} {y:.1} H{z:.1} M{a:.1} {:.1} V{:.1} M{z:.1} {:.1} V{:.1}" stroke="{c}" stroke-width="2"/><circle cx="{m:.1}" cy="{y:.1}" r="5" fill="{fill}" stroke="{c}" stroke-width="2"/></g>"##,
                    esc(&tip),
                    y - 5.0,
                    y + 5.0,
                    y - 5.0,
                    y + 5.0,
                );
            }
            _ => {
                let what = submissions::ratio_cell(&r.ratios[wi], r.reached[wi], false);
                let _ = write!(
                    out,
                    r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11" fill="#b00">{}<title>{}</title></text>"##,
                    (x0 + x1) / 2.0,
                    y + 4.0,
                    esc(&clip(&what, 32)),
                    esc(&what)
                );
            }
        }
    }
}

/// Each row's performance profile as the τ at which each of its
/// workloads enters the share (its ratio over the best, those within
/// [`submissions::TAU_MAX`]), ascending.
fn profile_steps(b: &SubBoard) -> Vec<Vec<f64>> {
    let best = best_ratios(b);
    b.rows
        .iter()
        .map(|r| {
            let mut at: Vec<f64> = r
                .ratios
                .iter()
                .zip(&r.reached)
                .zip(&best)
                .filter_map(|((s, n), best)| s.as_ref().filter(|_| n.0 == n.1).map(|s| (s.olympic_mean / best).max(1.0)))
                .filter(|t| *t <= submissions::TAU_MAX)
                .collect();
            at.sort_by(f64::total_cmp);
            at
        })
        .collect()
}

/// The rows whose performance profiles coincide on the plot (each step
/// within [`SAME_TAU`] of the other's), each set of two or more in row
/// order.
pub(super) fn coinciding(b: &SubBoard) -> Vec<Vec<usize>> {
    let steps = profile_steps(b);
    let same = |x: &[f64], y: &[f64]| x.len() == y.len() && x.iter().zip(y).all(|(a, b)| (a - b).abs() < SAME_TAU);
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for i in 0..steps.len() {
        match groups.iter_mut().find(|g| same(&steps[g[0]], &steps[i])) {
            Some(g) => g.push(i),
            None => groups.push(vec![i]),
        }
    }
    groups.retain(|g| g.len() > 1);
    groups
}

/// How close in τ two steps of profiles are to be drawn as one: about two
/// pixels of the profile plot.
const SAME_TAU: f64 = 0.02;

/// Pixels between two coinciding profiles.
const APART: f64 = 3.5;

/// The performance profiles of a submission board (AlgoPerf): for each
/// row, the share of the track's workloads on which its ratio is within a
/// factor τ of the best on the board, for τ from 1 to
/// [`submissions::TAU_MAX`]; the profile score is the area under it. The
/// axes leave room around 0 and 1 and left of τ = 1, so that no curve runs
/// along the frame, and curves that coincide ([`coinciding`]) are drawn
/// [`APART`] pixels apart, diagonally.
pub(super) fn profiles(id: &str, b: &SubBoard) -> String {
    let mut f = Frame {
        w: 420.0,
        h: 280.0,
        left: 50.0,
        right: 18.0,
        bottom: 44.0,
        x: ticks::linear(1.0, submissions::TAU_MAX, 6),
        y: ticks::linear(0.0, 1.0, 4),
    };
    f.x.lo = 1.0 - 0.03 * (submissions::TAU_MAX - 1.0);
    (f.y.lo, f.y.hi) = (-0.05, 1.07);
    let mut out = format!(
        r##"<svg id="{}" class="plot profile" width="{}" height="{}" viewBox="0 0 {} {}" xmlns="http://www.w3.org/2000/svg" role="img"><title>performance profiles</title><rect width="100%" height="100%" fill="#fff"/>"##,
        esc(id),
        f.w,
        f.h,
        f.w,
        f.h
    );
    f.axes(&mut out, "τ: within this factor of the best ratio", "share of workloads", None);
    let steps = profile_steps(b);
    let groups = coinciding(b);
    let nw = b.workloads.len().max(1) as f64;
    for (i, r) in b.rows.iter().enumerate().rev() {
        let o = groups.iter().find_map(|g| g.iter().position(|&j| j == i).map(|k| (k as f64 - (g.len() - 1) as f64 / 2.0) * APART));
        let o = o.unwrap_or(0.0);
        let (x, y) = (|v: f64| f.px(v) + o, |v: f64| f.py(v) - o);
        let mut d = format!("M{:.1} {:.1}", x(1.0), y(0.0));
        let mut share = 0.0;
        for t in &steps[i] {
            share += 1.0 / nw;
            let _ = write!(d, " H{:.1} V{:.1}", x(*t), y(share));
        }
        let _ = write!(d, " H{:.1}", x(submissions::TAU_MAX));
        let dash = if r.reference { r#" stroke-dasharray="6 3""# } else { "" };
        let _ = write!(
            out,
            r##"<path d="{d}" fill="none" stroke="{}" stroke-width="2.2"{dash} stroke-linejoin="round"><title>{}: profile score {:.2}</title></path>"##,
            row_colour(b, i),
            esc(format!("{} {}", r.plugin, r.version).trim()),
            r.profile
        );
    }
    out.push_str("</svg>");
    out
}

/// The best time-to-target ratio on each workload of a board: the
/// smallest of the submissions' reached ratios and the baseline's 1.
pub(super) fn best_ratios(b: &SubBoard) -> Vec<f64> {
    (0..b.workloads.len())
        .map(|w| {
            b.rows
                .iter()
                .filter(|r| !r.reference && r.reached[w].0 == r.reached[w].1)
                .filter_map(|r| r.ratios[w].as_ref().map(|s| s.olympic_mean))
                .fold(1.0, f64::min)
        })
        .collect()
}

/// One line of a loss (or accuracy) plot: its colour, whether dashed, a
/// name, and (training seconds, value) points.
pub(super) struct Curve {
    pub colour: &'static str,
    pub dashed: bool,
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Curves against training time, with the target dashed across: the
/// evaluations of each row's first repeat on one workload. The axes hold
/// every point and the target.
pub(super) fn curves(id: &str, title: &str, ylabel: &str, curves: &[Curve], target: Option<f64>) -> String {
    let all = || curves.iter().flat_map(|c| c.points.iter()).filter(|p| p.0.is_finite() && p.1.is_finite());
    let xmax = all().map(|p| p.0).fold(0.0, f64::max);
    let ymin = all().map(|p| p.1).chain(target).fold(f64::INFINITY, f64::min);
    let ymax = all().map(|p| p.1).chain(target).fold(f64::NEG_INFINITY, f64::max);
    let (ymin, ymax) = if ymin.is_finite() { (ymin, ymax) } else { (0.0, 1.0) };
    let mut f = Frame::new((0.0, xmax.max(1e-3)), (ymin, ymax));
    f.w = 420.0;
    f.h = 260.0;
    f.left = 56.0;
    let mut out = svg_open(id, &f, title);
    f.axes(&mut out, "training time (s)", ylabel, None);
    if let Some(t) = target {
        let y = f.py(t);
        let _ = write!(
            out,
            r##"<line x1="{}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#b00" stroke-dasharray="2 3"><title>target {t:.4}</title></line><text x="{:.1}" y="{:.1}" font-size="10" fill="#b00" text-anchor="end">target</text>"##,
            f.left,
            f.w - f.right,
            f.w - f.right - 2.0,
            y - 3.0
        );
    }
    for c in curves.iter().filter(|c| !c.points.is_empty()) {
        let d: Vec<String> =
            c.points.iter().filter(|p| p.0.is_finite() && p.1.is_finite()).map(|p| format!("{:.1},{:.1}", f.px(p.0), f.py(p.1))).collect();
        let dash = if c.dashed { r#" stroke-dasharray="5 3""# } else { "" };
        let _ = write!(
            out,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"{dash}><title>{}</title></polyline>"#,
            d.join(" "),
            c.colour,
            esc(&c.name)
        );
    }
    out.push_str("</svg></figure>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Summary;
    use crate::submissions::{Files, SubRow};
    use crate::Metric;

    fn ratio(m: f64, ci: (f64, f64)) -> Option<Summary> {
        Some(Summary { n: 3, olympic_mean: m, median: m, ci95: Some(ci) })
    }

    fn row(plugin: &str, ratios: Vec<Option<Summary>>, reference: bool) -> SubRow {
        let n = ratios.len();
        SubRow {
            plugin: plugin.into(),
            version: "0.1.0".into(),
            sha256: "ab".repeat(32),
            bundle: Default::default(),
            files: Files::default(),
            strategy: format!("submission-{plugin}"),
            ratios,
            reached: vec![(3, 3); n],
            second: vec![None; n],
            profile: 0.5,
            rank: Some(1),
            tied: false,
            reference,
            measured: crate::submissions::Measured::Operator { reruns: 1, claimed: vec![] },
        }
    }

    fn board(rows: Vec<SubRow>) -> SubBoard {
        let n = rows[0].ratios.len();
        SubBoard {
            suite: "s".into(),
            version: "1.0".into(),
            hardware: "h200".into(),
            gpus: 1,
            track: "compression".into(),
            baseline: "allreduce".into(),
            workloads: (0..n).map(|w| format!("w{w}")).collect(),
            second: Metric::TokensPerS,
            rows,
            band: 0.3,
        }
    }

    /// The numbers of `attr="..."` in `svg`, in order.
    fn attr(svg: &str, attr: &str) -> Vec<f64> {
        svg.split(&format!(" {attr}=\"")).skip(1).filter_map(|s| s.split('"').next()?.parse().ok()).collect()
    }

    #[test]
    fn the_forest_axis_holds_every_dot_interval_and_one() {
        let b = board(vec![
            row("far", vec![ratio(3.8, (3.7, 5.9)), ratio(0.95, (0.9, 1.002))], false),
            row("near", vec![ratio(0.31, (0.2, 0.45)), ratio(0.97, (0.94, 0.99))], false),
            row("allreduce", vec![ratio(1.0, (1.0, 1.0)); 2], true),
        ]);
        let rows = [0, 1];
        let a = forest_axis(&b, &rows, 0);
        assert!(a.lo <= 0.2 && a.hi >= 5.9 && a.ticks.contains(&1.0), "{a:?}");
        let a = forest_axis(&b, &rows, 1);
        assert!(a.lo <= 0.9 && a.lo > 0.5 && a.hi >= 1.002 && a.hi < 2.0, "narrow ratios get a narrow axis: {a:?}");
        // Every dot and whisker lands inside its panel.
        let svg = forest("f", &b);
        let (panel_w, ..) = FOREST;
        let w = attr(&svg, "width")[0];
        assert!(w >= 100.0 + 2.0 * panel_w && w <= 240.0 + 2.0 * panel_w, "{w}");
        for x in attr(&svg, "cx") {
            assert!(x > w - 2.0 * panel_w && x < w, "{x}");
        }
    }

    #[test]
    fn a_forest_is_as_tall_as_its_rows() {
        let one = forest("f", &board(vec![row("a", vec![ratio(0.5, (0.4, 0.6))], false)]));
        let three = forest("f", &board((0..3).map(|i| row(&format!("p{i}"), vec![ratio(0.5, (0.4, 0.6))], false)).collect()));
        let (_, row_h, top, bottom) = FOREST;
        assert_eq!(attr(&one, "height")[0], top + row_h + bottom);
        assert_eq!(attr(&three, "height")[0], top + 3.0 * row_h + bottom);
    }

    #[test]
    fn coinciding_profiles_are_named_and_drawn_apart() {
        // Two builds with one ratio, and the baseline, best on the other workload.
        let b = board(vec![
            row("rust", vec![ratio(0.5, (0.45, 0.55)), ratio(1.2, (1.1, 1.3))], false),
            row("python", vec![ratio(0.5, (0.45, 0.55)), ratio(1.2, (1.1, 1.3))], false),
            row("slow", vec![ratio(0.9, (0.8, 1.0)), ratio(1.5, (1.4, 1.6))], false),
            row("allreduce", vec![ratio(1.0, (1.0, 1.0)); 2], true),
        ]);
        assert_eq!(coinciding(&b), [vec![0, 1]]);
        let svg = profiles("p", &b);
        let starts: Vec<&str> = svg.split("<path d=\"M").skip(2).map(|s| s.split(' ').next().unwrap()).collect();
        assert_eq!(starts.len(), 4, "{svg}");
        // Drawn last row first: python and rust start APART pixels apart.
        let (py, rs): (f64, f64) = (starts[2].parse().unwrap(), starts[3].parse().unwrap());
        assert!(((py - rs) - APART).abs() < 0.11, "{starts:?}");
        // A submission as fast as the baseline, give or take a pixel: their curves coincide too.
        let b =
            board(vec![row("every-n", vec![ratio(0.993, (0.585, 1.017))], false), row("allreduce", vec![ratio(1.0, (1.0, 1.0))], true)]);
        assert_eq!(coinciding(&b), [vec![0, 1]]);
        let b = board(vec![row("every-n", vec![ratio(0.9, (0.85, 0.95))], false), row("allreduce", vec![ratio(1.0, (1.0, 1.0))], true)]);
        assert!(coinciding(&b).is_empty());
        assert_eq!(clip("abcdef", 4), "abc…");
    }

    #[test]
    fn profiles_leave_room_above_one_and_below_zero() {
        let b = board(vec![row("a", vec![ratio(2.0, (1.9, 2.1))], false), row("allreduce", vec![ratio(1.0, (1.0, 1.0))], true)]);
        let svg = profiles("p", &b);
        let f_top = TOP;
        // The baseline's curve at share 1 runs below the frame's top.
        let ys: Vec<f64> = svg.split(" V").skip(1).filter_map(|s| s.split([' ', '"']).next()?.parse().ok()).collect();
        assert!(ys.iter().all(|y| *y > f_top + 5.0), "{ys:?}");
    }
}
