//! The page's plots, drawn as inline SVG: the frame and axes the
//! per-workload plots share, and the submission boards' forest plot of
//! time-to-target ratios, performance profiles and loss-against-time
//! curves. Every label from a file goes through [`esc`]; nothing here
//! writes a link or a script.

use std::fmt::Write;

use super::PALETTE;
use crate::escape::html as esc;
use crate::submissions::{self, SubBoard};

/// A plot area mapping data coordinates to SVG pixels.
pub(super) struct Frame {
    pub w: f64,
    pub h: f64,
    pub left: f64,
    /// Room for the last x tick label.
    pub right: f64,
    pub bottom: f64,
    pub x: (f64, f64),
    pub y: (f64, f64),
}

impl Frame {
    pub fn new(x: (f64, f64), y: (f64, f64)) -> Frame {
        let widen = |(a, b): (f64, f64)| if (b - a).abs() < 1e-12 { (a - 1.0, b + 1.0) } else { (a, b) };
        Frame { w: 560.0, h: 300.0, left: 70.0, right: 28.0, bottom: 40.0, x: widen(x), y: widen(y) }
    }
    pub fn px(&self, x: f64) -> f64 {
        self.left + (x - self.x.0) / (self.x.1 - self.x.0) * (self.w - self.left - self.right)
    }
    pub fn py(&self, y: f64) -> f64 {
        (self.h - self.bottom) - (y - self.y.0) / (self.y.1 - self.y.0) * (self.h - self.bottom - 10.0)
    }
    /// Axes, ticks and labels; `fx` formats x tick values.
    pub fn axes(&self, out: &mut String, xlabel: &str, ylabel: &str, fx: &dyn Fn(f64) -> String) {
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

pub(super) fn tick(v: f64) -> String {
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

pub(super) fn svg_open(id: &str, f: &Frame, title: &str) -> String {
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

/// Ticks for a log axis over `(lo, hi)`: 1, 2 and 5 times powers of ten
/// (fewer when they would crowd).
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut out = Vec::new();
    for mult in [&[1.0, 2.0, 5.0][..], &[1.0][..]] {
        out.clear();
        let mut e = lo.log10().floor() as i32 - 1;
        while 10f64.powi(e) <= hi * 10.0 {
            for m in mult {
                let v = m * 10f64.powi(e);
                if v >= lo && v <= hi {
                    out.push(v);
                }
            }
            e += 1;
        }
        if out.len() <= 5 {
            break;
        }
    }
    out
}

/// A ratio as an axis label: "0.5", "1", "2", "10".
fn ratio_tick(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// The forest plot of a submission board: one panel per workload, one line
/// per row (the submissions in rank order, the baseline's reference line
/// at 1 dashed), each submission's time to target over its own run's
/// baseline as a dot with its 95% interval, on a log scale. A missed
/// target is written, not drawn.
pub(super) fn forest(id: &str, b: &SubBoard) -> String {
    let rows: Vec<usize> = (0..b.rows.len()).filter(|&i| !b.rows[i].reference).collect();
    let (label_w, panel_w, row_h, top, bottom) = (200.0, 230.0, 28.0, 34.0, 42.0);
    let n = b.workloads.len().max(1) as f64;
    let (w, h) = (label_w + n * panel_w + 10.0, top + rows.len().max(1) as f64 * row_h + bottom);
    let mut out = format!(
        r##"<svg id="{}" class="plot forest" width="{w}" height="{h}" viewBox="0 0 {w} {h}" xmlns="http://www.w3.org/2000/svg" role="img"><title>time to target over the baseline's, per workload</title><rect width="100%" height="100%" fill="#fff"/>"##,
        esc(id)
    );
    for (k, &i) in rows.iter().enumerate() {
        let r = &b.rows[i];
        let y = top + (k as f64 + 0.5) * row_h;
        let name = format!("{} {} {} ({})", submissions::rank_cell(r), r.plugin, r.version, submissions::short(&r.sha256));
        let _ = write!(
            out,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="12" fill="{}">{}<title>{}</title></text>"##,
            label_w - 8.0,
            y + 4.0,
            row_colour(b, i),
            esc(&clip(&format!("{} {} {}", submissions::rank_cell(r), r.plugin, r.version), 30)),
            esc(&name)
        );
        if k % 2 == 1 {
            let _ =
                write!(out, r##"<rect x="0" y="{:.1}" width="{w}" height="{row_h}" fill="#000" fill-opacity="0.03"/>"##, y - row_h / 2.0);
        }
    }
    for (wi, workload) in b.workloads.iter().enumerate() {
        let x0 = label_w + wi as f64 * panel_w + 12.0;
        let x1 = x0 + panel_w - 24.0;
        let (mut lo, mut hi) = (1.0f64, 1.0f64);
        for &i in &rows {
            if let Some(s) = &b.rows[i].ratios[wi] {
                let (a, c) = submissions::interval(s);
                lo = lo.min(a.min(s.olympic_mean));
                hi = hi.max(c.max(s.olympic_mean));
            }
        }
        let (lo, hi) = (lo / 1.25, hi * 1.25);
        let px = |v: f64| x0 + (v.ln() - lo.ln()) / (hi.ln() - lo.ln()) * (x1 - x0);
        let y_end = top + rows.len().max(1) as f64 * row_h;
        let _ = write!(
            out,
            r##"<text x="{:.1}" y="16" text-anchor="middle" font-size="13" font-weight="600">{}</text>"##,
            (x0 + x1) / 2.0,
            esc(&clip(workload, 30))
        );
        let _ = write!(out, r##"<path d="M{x0:.1} {y_end:.1} H{x1:.1}" stroke="#333"/>"##);
        for t in log_ticks(lo, hi) {
            let x = px(t);
            let _ = write!(
                out,
                r##"<line x1="{x:.1}" x2="{x:.1}" y1="{top}" y2="{y_end:.1}" stroke="#e4e4e4"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" font-size="11">{}</text>"##,
                y_end + 14.0,
                ratio_tick(t)
            );
        }
        let one = px(1.0);
        let _ = write!(
            out,
            r##"<line x1="{one:.1}" x2="{one:.1}" y1="{:.1}" y2="{y_end:.1}" stroke="{BASELINE}" stroke-dasharray="5 3" stroke-width="1.5"><title>the baseline: 1</title></line>"##,
            top - 6.0
        );
        let _ = write!(
            out,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11" fill="#555">← faster · slower →</text>"##,
            (x0 + x1) / 2.0,
            y_end + 30.0
        );
        for (k, &i) in rows.iter().enumerate() {
            let r = &b.rows[i];
            let y = top + (k as f64 + 0.5) * row_h;
            let c = row_colour(b, i);
            match &r.ratios[wi] {
                Some(s) if r.reached[wi].0 == r.reached[wi].1 => {
                    let (a, z) = submissions::interval(s);
                    let tip = format!("{}: {}", workload, submissions::ratio_cell(&r.ratios[wi], r.reached[wi], true));
                    let _ = write!(
                        out,
                        r##"<g><title>{}</title><path d="M{:.1} {y:.1} H{:.1} M{:.1} {:.1} V{:.1} M{:.1} {:.1} V{:.1}" stroke="{c}" stroke-width="2"/><circle cx="{:.1}" cy="{y:.1}" r="5" fill="{c}"/></g>"##,
                        esc(&tip),
                        px(a),
                        px(z),
                        px(a),
                        y - 5.0,
                        y + 5.0,
                        px(z),
                        y - 5.0,
                        y + 5.0,
                        px(s.olympic_mean)
                    );
                }
                _ => {
                    let what = submissions::ratio_cell(&r.ratios[wi], r.reached[wi], false);
                    let _ = write!(
                        out,
                        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11" fill="#b00">{}</text>"##,
                        (x0 + x1) / 2.0,
                        y + 4.0,
                        esc(&clip(&what, 34))
                    );
                }
            }
        }
    }
    out.push_str("</svg>");
    out
}

/// The performance profiles of a submission board (AlgoPerf): for each
/// row, the share of the track's workloads on which its ratio is within a
/// factor τ of the best on the board, for τ from 1 to
/// [`submissions::TAU_MAX`]; the profile score is the area under it.
pub(super) fn profiles(id: &str, b: &SubBoard) -> String {
    let f = Frame { w: 420.0, h: 280.0, left: 50.0, right: 16.0, bottom: 44.0, x: (1.0, submissions::TAU_MAX), y: (0.0, 1.0) };
    let mut out = format!(
        r##"<svg id="{}" class="plot profile" width="{}" height="{}" viewBox="0 0 {} {}" xmlns="http://www.w3.org/2000/svg" role="img"><title>performance profiles</title><rect width="100%" height="100%" fill="#fff"/>"##,
        esc(id),
        f.w,
        f.h,
        f.w,
        f.h
    );
    f.axes(&mut out, "τ: within this factor of the best ratio", "share of workloads", &|x| {
        format!("{x:.2}").trim_end_matches('0').trim_end_matches('.').to_owned()
    });
    let best = best_ratios(b);
    let nw = b.workloads.len().max(1) as f64;
    for (i, r) in b.rows.iter().enumerate().rev() {
        // τ at which each workload enters the share: ratio / best.
        let mut at: Vec<f64> = r
            .ratios
            .iter()
            .zip(&r.reached)
            .zip(&best)
            .filter_map(|((s, n), best)| s.as_ref().filter(|_| n.0 == n.1).map(|s| (s.olympic_mean / best).max(1.0)))
            .filter(|t| *t <= submissions::TAU_MAX)
            .collect();
        at.sort_by(f64::total_cmp);
        let mut d = format!("M{:.1} {:.1}", f.px(1.0), f.py(0.0));
        let mut share = 0.0;
        for t in &at {
            share += 1.0 / nw;
            let _ = write!(d, " H{:.1} V{:.1}", f.px(*t), f.py(share));
        }
        let _ = write!(d, " H{:.1}", f.px(submissions::TAU_MAX));
        let dash = if r.reference { r#" stroke-dasharray="5 3""# } else { "" };
        let _ = write!(
            out,
            r##"<path d="{d}" fill="none" stroke="{}" stroke-width="2.5"{dash} stroke-opacity="0.9"><title>{}: profile score {:.2}</title></path>"##,
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
/// evaluations of each row's first repeat on one workload.
pub(super) fn curves(id: &str, title: &str, ylabel: &str, curves: &[Curve], target: Option<f64>) -> String {
    let all = || curves.iter().flat_map(|c| c.points.iter()).filter(|p| p.0.is_finite() && p.1.is_finite());
    let xmax = all().map(|p| p.0).fold(0.0, f64::max);
    let ymin = all().map(|p| p.1).chain(target).fold(f64::INFINITY, f64::min);
    let ymax = all().map(|p| p.1).chain(target).fold(f64::NEG_INFINITY, f64::max);
    let (ymin, ymax) = if ymin.is_finite() { (ymin, ymax) } else { (0.0, 1.0) };
    let pad = 0.05 * (ymax - ymin).max(1e-6);
    let mut f = Frame::new((0.0, xmax.max(1e-3)), (ymin - pad, ymax + pad));
    f.w = 420.0;
    f.h = 260.0;
    f.left = 56.0;
    let mut out = svg_open(id, &f, title);
    f.axes(&mut out, "training time (s)", ylabel, &|x| tick(x));
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
        let d: Vec<String> = c.points.iter().filter(|p| p.1.is_finite()).map(|p| format!("{:.1},{:.1}", f.px(p.0), f.py(p.1))).collect();
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

    #[test]
    fn log_ticks_fall_inside_the_axis_and_do_not_crowd() {
        assert_eq!(log_ticks(0.4, 3.0), [0.5, 1.0, 2.0]);
        let wide = log_ticks(0.01, 50.0);
        assert!(wide.len() <= 5 && wide.contains(&1.0), "{wide:?}");
        assert_eq!(ratio_tick(0.5), "0.5");
        assert_eq!(ratio_tick(2.0), "2");
        assert_eq!(clip("abcdef", 4), "abc…");
    }
}
