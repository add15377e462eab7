//! The plot of a projection (`harness project --html`/`--svg`, and the
//! report of a suite with a `[projection]` section): tokens/s on all GPUs
//! against the number of GPUs, both on log scales, one line per strategy
//! (colour) and network (dash), each point with its interval as a
//! whisker. Every plot says PROJECTION in its title: a model's answer,
//! never a measurement. Every label goes through [`esc`].

use std::fmt::Write;

use super::plots::{Frame, PALETTE};
use super::ticks::{self, Axis};
use crate::escape::html as esc;
use harness_format::fmt::human;

/// What every projection plot's title starts with.
pub const TITLE: &str = "PROJECTION (a calibrated model, not a measurement)";

pub use crate::project::render::Series;

/// One plot per workload of a projection (standalone SVGs), titled
/// [`TITLE`].
pub fn plots(p: &crate::project::Projection) -> Vec<String> {
    series_of(&crate::project::render::workload_series(p))
}

/// One plot per workload, from each workload's series.
pub fn series_of(workloads: &[(String, Vec<Series>)]) -> Vec<String> {
    workloads.iter().enumerate().map(|(i, (w, s))| plot(&format!("projection-{i}"), &format!("{w}, tokens/s against GPUs"), s)).collect()
}

const DASHES: &[&str] = &["", "7 4", "2 3", "10 3 2 3", "1 5"];

/// The band above the frame that holds the title.
const HEAD: f64 = 22.0;

/// A standalone SVG (it opens with its namespace, so it can be a file of
/// its own or sit in a page): the title, the frame, the lines with their
/// whiskers and the legend on the right.
pub fn plot(id: &str, title: &str, series: &[Series]) -> String {
    let all = || series.iter().flat_map(|s| s.points.iter()).filter(|p| p.0 > 0.0 && p.1 > 0.0 && p.1.is_finite());
    let (xmin, xmax) = all().fold((f64::INFINITY, 0.0f64), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let lo = all().map(|p| if p.2 > 0.0 && p.2.is_finite() { p.2 } else { p.1 }).fold(f64::INFINITY, f64::min);
    let hi = all().map(|p| if p.3.is_finite() { p.3.max(p.1) } else { p.1 }).fold(0.0, f64::max);
    let (xmin, xmax) = if xmin.is_finite() { (xmin, xmax.max(xmin * 2.0)) } else { (1.0, 2.0) };
    // x: log2 of the GPUs, a tick at every power of two; y: log10 of the
    // tokens/s, ticks at 1, 2, 5 x 10^k.
    let (a, b) = (xmin.log2().floor(), xmax.log2().ceil());
    let x = Axis { lo: a, hi: b, ticks: (a as i64..=b as i64).map(|k| k as f64).collect(), step: 1.0 };
    let ly = ticks::log(lo, hi, 8);
    let y = Axis { lo: ly.lo.log10(), hi: ly.hi.log10(), ticks: ly.ticks.iter().map(|t| t.log10()).collect(), step: 0.0 };
    let legend_w = 230.0;
    let f = Frame { w: 460.0 + legend_w, h: 320.0, left: 64.0, right: 28.0 + legend_w, bottom: 40.0, x, y };
    let mut out = String::new();
    let _ = write!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" id="{}" class="plot" width="{}" height="{}" viewBox="0 0 {} {}"><rect width="100%" height="100%" fill="#fff"/><text x="8" y="15" font-size="13" font-weight="600">{}</text><g transform="translate(0 {HEAD})">"##,
        esc(id),
        f.w,
        f.h + HEAD,
        f.w,
        f.h + HEAD,
        esc(&format!("{TITLE}: {title}"))
    );
    let fx = |t: f64| format!("{}", 2f64.powf(t).round());
    let fy = |t: f64| human(10f64.powf(t));
    f.axes_with(&mut out, "GPUs", "tokens/s on all GPUs (projected)", Some(&fx), Some(&fy));
    let at = |p: &(f64, f64, f64, f64), v: f64| (f.px(p.0.log2()), f.py(v.log10()));
    for (i, s) in series.iter().enumerate() {
        let colour = PALETTE[s.colour % PALETTE.len()];
        let dash = DASHES[s.dash % DASHES.len()];
        let dash = if dash.is_empty() { String::new() } else { format!(r#" stroke-dasharray="{dash}""#) };
        let pts: Vec<&(f64, f64, f64, f64)> = s.points.iter().filter(|p| p.0 > 0.0 && p.1 > 0.0 && p.1.is_finite()).collect();
        let d: Vec<String> = pts.iter().map(|p| at(p, p.1)).map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        if !d.is_empty() {
            let _ = write!(
                out,
                r#"<polyline class="s{i}" points="{}" fill="none" stroke="{colour}" stroke-width="2"{dash}><title>{}</title></polyline>"#,
                d.join(" "),
                esc(&s.name)
            );
        }
        for p in pts {
            let (x, y) = at(p, p.1);
            let (_, y0) = at(p, if p.2 > 0.0 && p.2.is_finite() { p.2 } else { p.1 });
            let (_, y1) = at(p, if p.3.is_finite() { p.3.max(p.1) } else { p.1 });
            let _ = write!(
                out,
                r#"<line class="s{i}" x1="{x:.1}" x2="{x:.1}" y1="{y0:.1}" y2="{y1:.1}" stroke="{colour}" stroke-width="1"/><circle class="s{i}" cx="{x:.1}" cy="{y:.1}" r="2.5" fill="{colour}"><title>{}: {} GPUs, {} tokens/s [{}, {}]</title></circle>"#,
                esc(&s.name),
                p.0,
                human(p.1),
                human(p.2),
                human(p.3)
            );
        }
    }
    let lx = f.w - legend_w + 10.0;
    for (i, s) in series.iter().enumerate() {
        let colour = PALETTE[s.colour % PALETTE.len()];
        let dash = DASHES[s.dash % DASHES.len()];
        let dash = if dash.is_empty() { String::new() } else { format!(r#" stroke-dasharray="{dash}""#) };
        let ly = 16.0 + 16.0 * i as f64;
        let _ = write!(
            out,
            r#"<line x1="{lx:.1}" x2="{:.1}" y1="{ly:.1}" y2="{ly:.1}" stroke="{colour}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}" font-size="11">{}</text>"#,
            lx + 26.0,
            lx + 32.0,
            ly + 4.0,
            esc(&s.name)
        );
    }
    out.push_str("</g></svg>");
    out
}

/// Plots side by side in one standalone SVG, one under the other.
pub fn stack(plots: &[String]) -> String {
    let size = |svg: &str, key: &str| -> f64 {
        svg.split_once(&format!(r#" {key}=""#)).and_then(|(_, r)| r.split_once('"')).and_then(|(v, _)| v.parse().ok()).unwrap_or(0.0)
    };
    let w = plots.iter().map(|p| size(p, "width")).fold(0.0, f64::max);
    let h: f64 = plots.iter().map(|p| size(p, "height")).sum();
    let mut out = format!(r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">"##);
    let mut y = 0.0;
    for p in plots {
        // A nested svg placed at its offset.
        let body = p.replacen("<svg ", &format!(r#"<svg y="{y}" "#), 1);
        out.push_str(&body);
        y += size(p, "height");
    }
    out.push_str("</svg>\n");
    out
}

/// A page of its own: the label, the calibration, the plots and the text
/// tables (as printed), nothing fetched from elsewhere.
pub fn page(label: &str, plots: &[String], text: &str) -> String {
    let mut out = String::from(
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>harness project: PROJECTION</title>\
         <style>body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1400px;padding:0 1.5em;color:#222}\
         .label{background:#fff4e5;border-left:4px solid #e68a00;padding:.5em .8em}pre{font-size:12px}</style></head><body>",
    );
    let _ = write!(out, "<h1>harness project</h1><p class=\"label\">{}</p>", esc(label));
    for p in plots {
        let _ = write!(out, "<figure>{p}</figure>");
    }
    let _ = writeln!(out, "<pre>{}</pre></body></html>", esc(text));
    out
}

/// The report's section of projections (each suite's `[projection]`),
/// apart from the boards; empty without any.
pub fn section(ps: &[crate::project::suite::SuiteProjection]) -> String {
    if ps.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "<section id=\"projections\"><h2>Projections (not measurements)</h2><p class=\"howto\">{}. Each suite with a <code>[projection]</code> section, projected on the clusters it names by <code>harness project</code>'s model, calibrated on the results above; none of these figures was measured, and none is on a board.</p>",
        esc(crate::project::render::LABEL)
    );
    for p in ps {
        let _ = write!(out, "<h3>{}</h3><div class=\"figs\">", esc(&p.suite));
        for svg in series_of(&p.series) {
            let _ = write!(out, "<figure>{svg}</figure>");
        }
        let _ = write!(out, "</div><pre>{}</pre>", esc(&p.text));
    }
    out.push_str("</section>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series() -> Vec<Series> {
        vec![
            Series {
                name: "allreduce, 400 Gbps".into(),
                colour: 0,
                dash: 0,
                points: vec![(8.0, 1e6, 0.9e6, 1.1e6), (64.0, 7e6, 6e6, 8e6)],
            },
            Series { name: "fp16 <b>".into(), colour: 1, dash: 1, points: vec![(8.0, 9e5, 8e5, 1e6), (1024.0, 5e7, 4e7, 6e7)] },
        ]
    }

    /// The title says PROJECTION; every series is a line in the legend;
    /// labels are escaped; the axes hold every point and whisker.
    #[test]
    fn a_projection_plot_is_labelled_and_holds_its_points() {
        let svg = plot("p", "gpt2 <x>", &series());
        assert!(svg.starts_with("<svg xmlns="), "{svg}");
        assert!(svg.contains(TITLE));
        assert!(svg.contains("gpt2 &lt;x&gt;") && svg.contains("fp16 &lt;b&gt;") && !svg.contains("<b>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 4);
        // x ticks at every power of two from 8 to 1024.
        for g in ["8", "16", "512", "1024"] {
            assert!(svg.contains(&format!(r#"text-anchor="middle" font-size="11">{g}</text>"#)), "no tick {g}");
        }
        // Every circle and whisker inside the frame's area.
        let nums = |key: &str| -> Vec<f64> {
            svg.split(&format!(r#" {key}=""#)).skip(1).filter_map(|r| r.split('"').next()?.parse().ok()).collect()
        };
        for y in nums("cy").into_iter().chain(nums("y1")).chain(nums("y2")) {
            assert!((0.0..=320.0).contains(&y), "{y}");
        }
        let stacked = stack(&[svg.clone(), svg]);
        assert!(stacked.contains(r#"<svg y="342" "#), "{}", &stacked[..200]);
    }

    /// A suite's projection in the report: its own labelled section, a plot
    /// per workload drawn from its series, the text escaped.
    #[test]
    fn a_suites_projection_is_a_labelled_section_with_its_plots() {
        assert_eq!(section(&[]), "");
        let p = crate::project::suite::SuiteProjection {
            suite: "s <1>".into(),
            text: "calibration <x>".into(),
            series: vec![("gpt2".into(), series())],
        };
        let html = section(&[p]);
        assert!(html.contains("id=\"projections\"") && html.contains(TITLE) && html.contains(&esc(crate::project::render::LABEL)));
        assert!(html.contains("s &lt;1&gt;") && html.contains("calibration &lt;x&gt;"), "{html}");
        assert_eq!(html.matches("<polyline").count(), 2);
    }
}
