//! The page's submission boards: per track, a line on how to read it, the
//! ranked table (shared ranks marked `=`, intervals that hold the
//! baseline's 1 marked n.s.), the forest plot of time-to-target ratios,
//! the performance profiles the score integrates, and each workload's
//! evaluations against training time; then the bundles listed apart.
//! Rows link to each submission's own page ([`super::submission_page`]).

use std::fmt::Write;

use super::esc;
use super::plots::{self, Curve};
use crate::escape::{code_spans, short, Markup};
use crate::submissions::{self, SubBoard, Verified};
use crate::Board;
use harness_format::results::{EntryStatus, RunResult};

/// How to read a track's board, one paragraph.
pub const HOW_TO_READ: &str = "How to read this: a dot is a submission's time to target ÷ the baseline's in the same run \
(olympic mean over paired repeats; bar: 95% interval; log scale); left of the dashed 1 is faster. n.s. (a hollow dot): the interval holds 1. \
=1: ranks no interval separates. Profiles: the share of workloads within τ of the best ratio; the score is the area under it.";

/// The id of a track's section, for the page's contents.
pub(super) fn anchor(i: usize) -> String {
    format!("track-{i}")
}

/// The bundle a row's numbers come from.
fn bundle_of<'a>(bundles: &'a [Verified], r: &submissions::SubRow) -> Option<&'a Verified> {
    bundles.iter().find(|v| v.ranks() && !r.files.folder.is_empty() && v.files.folder == r.files.folder)
}

/// Every submission board, then the bundles listed apart.
pub(super) fn section(boards: &[Board], subs: &[SubBoard], bundles: &[Verified]) -> String {
    let mut out = String::new();
    if bundles.is_empty() {
        return out;
    }
    let _ = write!(out, "<h2 id=\"submissions\">Submissions</h2><p class=\"explain\">{}</p>", code_spans(submissions::EXPLAINED));
    if !subs.is_empty() {
        out.push_str("<nav><ul>");
        for (i, b) in subs.iter().enumerate() {
            let _ = write!(out, "<li><a href=\"#{}\">{}</a></li>", anchor(i), submissions::title(b, Markup::Html));
        }
        out.push_str("</ul></nav>");
    }
    for (i, b) in subs.iter().enumerate() {
        out.push_str(&track(i, b, boards, bundles));
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

/// One track: title, how to read it, the table, the plots.
fn track(i: usize, b: &SubBoard, boards: &[Board], bundles: &[Verified]) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<section class=\"track\" id=\"{}\"><h3>{}</h3><p>Baseline: <code>{}</code>. {} ranked.</p><p class=\"howto\">{}</p>",
        anchor(i),
        submissions::title(b, Markup::Html),
        esc(&b.baseline),
        b.rows.iter().filter(|r| r.ranked()).count(),
        esc(HOW_TO_READ)
    );
    out.push_str(&table(b, boards));
    let _ = write!(
        out,
        "<figure class=\"forest\"><figcaption>Time to target ÷ the baseline's, per workload (95% interval)</figcaption>{}</figure>",
        plots::forest(&format!("forest-{i}"), b)
    );
    let _ = write!(
        out,
        "<div class=\"figs\"><figure><figcaption>Performance profiles (score = area under the curve)</figcaption>{}{}</figure>",
        plots::profiles(&format!("profile-{i}"), b),
        legend(b)
    );
    for (wi, w) in b.workloads.iter().enumerate() {
        out.push_str(&workload_curves(&format!("curves-{i}-{wi}"), b, w, bundles));
    }
    out.push_str("</div></section>");
    out
}

/// The rows' colours and names, as the plots draw them (the baseline's
/// dashed), and which profiles coincide.
fn legend(b: &SubBoard) -> String {
    let mut out = String::from("<div class=\"legend\">");
    for (i, r) in b.rows.iter().enumerate() {
        let name = if r.reference {
            format!("baseline {}", r.plugin)
        } else {
            format!("{} {} {}", submissions::rank_cell(r), r.plugin, r.version)
        };
        let dash = if r.reference { " stroke-dasharray=\"6 3\"" } else { "" };
        let _ = write!(
            out,
            "<span class=\"key\"><svg class=\"line\" width=\"24\" height=\"10\"><line x1=\"1\" y1=\"5\" x2=\"23\" y2=\"5\" stroke=\"{}\" stroke-width=\"2.5\"{dash}/></svg>{}</span>",
            plots::row_colour(b, i),
            esc(&name)
        );
    }
    for g in plots::coinciding(b) {
        let names: Vec<String> = g
            .iter()
            .map(|&i| if b.rows[i].reference { "the baseline".to_owned() } else { format!("{} {}", b.rows[i].plugin, b.rows[i].version) })
            .collect();
        let _ = write!(out, "<p class=\"note\">Profiles that coincide, drawn side by side: {}.</p>", esc(&names.join(", ")));
    }
    out.push_str("<p class=\"note\">Curves against time: the first repeat of each run, the submission solid and its run's baseline dashed, in the submission's colour.</p>");
    out.push_str("</div>");
    out
}

/// The ranked table of a track.
fn table(b: &SubBoard, boards: &[Board]) -> String {
    let mut out = String::from("<table class=\"board\"><tr><th>rank</th><th>plugin</th><th>sha256</th>");
    for w in &b.workloads {
        let _ = write!(out, "<th>{}<br><small>time vs baseline</small></th>", esc(w));
    }
    for w in &b.workloads {
        let _ = write!(out, "<th>{}<br><small>{} vs baseline</small></th>", esc(w), esc(b.second.name()));
    }
    out.push_str("<th>profile</th><th>bundle</th><th>tables</th></tr>");
    for (i, r) in b.rows.iter().enumerate() {
        let swatch = format!("<i class=\"sw\" style=\"background:{}\"></i>", plots::row_colour(b, i));
        let plugin = if r.reference || r.files.folder.is_empty() {
            r.plugin_cell(Markup::Html)
        } else {
            format!("<a href=\"bundles/{}/index.html\">{}</a>", r.files.folder, r.plugin_cell(Markup::Html))
        };
        let class = if r.reference {
            " class=\"reference\""
        } else if r.tied {
            " class=\"tied\""
        } else {
            ""
        };
        let _ = write!(
            out,
            "<tr{class}><td>{}</td><td>{swatch}{plugin}</td><td><code title=\"{}\">{}</code></td>",
            esc(&submissions::rank_cell(r)),
            esc(&r.sha256),
            esc(short(&r.sha256))
        );
        for (s, n) in r.ratios.iter().zip(&r.reached) {
            let cell = submissions::ratio_cell(s, *n, !r.reference);
            let cls = match s.as_ref().and_then(submissions::against_baseline) {
                _ if n.0 < n.1 => "missed",
                Some("faster") if !r.reference => "faster",
                Some("slower") if !r.reference => "slower",
                _ => "",
            };
            let _ = write!(out, "<td class=\"{cls}\">{}</td>", esc(&cell));
        }
        for s in &r.second {
            let _ = write!(out, "<td>{}</td>", esc(&submissions::ratio_cell(s, (0, 0), false)));
        }
        let bundle = if r.reference { String::new() } else { r.files.html() };
        let mut links = String::new();
        for w in b.workloads.iter().filter(|_| !r.reference) {
            if let Some(k) = boards.iter().position(|x| {
                x.suite == b.suite
                    && x.version.as_deref().unwrap_or("-") == b.version
                    && &x.workload == w
                    && x.track.as_deref() == Some(b.track.as_str())
                    && x.rows.iter().any(|row| row.group.strategy == r.strategy)
            }) {
                let _ = write!(links, " <a href=\"#board-{k}\">{}</a>", esc(w));
            }
        }
        let _ = write!(out, "<td>{:.2}</td><td>{bundle}</td><td>{links}</td></tr>", r.profile);
    }
    out.push_str("</table>");
    out
}

/// Evaluations against training time on one workload of a track: each
/// submission's first repeat in its colour, its own run's baseline dashed
/// in the same colour, the target dashed in red. Accuracy for workloads
/// with an accuracy target, else the eval loss.
fn workload_curves(id: &str, b: &SubBoard, workload: &str, bundles: &[Verified]) -> String {
    let mut curves = Vec::new();
    let mut target = None;
    let mut accuracy = false;
    for (i, r) in b.rows.iter().enumerate().filter(|(_, r)| !r.reference) {
        let Some(v) = bundle_of(bundles, r) else { continue };
        let colour = plots::row_colour(b, i);
        for (strategy, dashed) in [(format!("submission-{}", b.track), false), (b.baseline.clone(), true)] {
            let Some((m, acc)) = first_repeat(&v.bundle.result, workload, &strategy) else { continue };
            accuracy |= acc;
            target = target.or(if acc { m.target_accuracy } else { m.target_loss });
            let curve = if acc { &m.accuracy_curve } else { &m.eval_curve };
            let who = if dashed { format!("its run's baseline {}", b.baseline) } else { format!("{} {}", r.plugin, r.version) };
            curves.push(Curve { colour, dashed, name: who, points: curve.iter().map(|p| (p.1, p.2)).collect() });
        }
    }
    let (what, unit) = if accuracy { ("eval accuracy", "top-1 accuracy") } else { ("eval loss", "loss") };
    let title = format!("{workload}: {what} against training time");
    plots::curves(id, &title, unit, &curves, target)
}

/// The metrics of `strategy`'s first finished repeat on `workload`, and
/// whether the workload's target is an accuracy.
fn first_repeat<'a>(r: &'a RunResult, workload: &str, strategy: &str) -> Option<(&'a harness_format::results::Metrics, bool)> {
    let e = r
        .entries
        .iter()
        .filter(|e| e.workload == workload && e.strategy == strategy && matches!(e.status, EntryStatus::Ok))
        .min_by_key(|e| e.repeat)?;
    let m = e.metrics.as_ref()?;
    Some((m, m.target_accuracy.is_some()))
}
