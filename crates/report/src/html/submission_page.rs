//! Each ranked submission's own page, `bundles/<folder>/index.html` beside
//! the copies of its result and manifest: the plugin (name, version, kind,
//! sha256, configuration), the run (suite, hardware class, GPUs, tracks,
//! machine), the cost of a call into the plugin where the result records
//! it, and its rows on the boards with their forest plots. Its links are the two copies beside it
//! and the board two folders up; every string from the bundle is escaped.

use std::fmt::Write;

use super::{esc, STYLE};
use crate::submissions::{self, SubBoard, Verified};
use harness_format::results::{EntryStatus, RunResult};

/// The page of a ranked bundle, with its rows on `subs` (the board's
/// sections numbered as [`super::tracks::anchor`] numbers them).
pub fn page(v: &Verified, subs: &[SubBoard]) -> String {
    let r = &v.bundle.result;
    let m = &v.bundle.manifest;
    let sub = r.submission.clone().unwrap_or_default();
    let p = sub.entered.first().cloned().unwrap_or_default();
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{} {} · harness submission</title><style>{STYLE}</style></head><body>",
        esc(&p.name),
        esc(&p.version)
    );
    let _ = write!(
        out,
        "<p><a href=\"../../index.html\">← the leaderboard</a></p><h1>{} <small>{}</small></h1>",
        esc(&p.name),
        esc(&p.version)
    );
    let config = if p.config.trim().is_empty() { "none (the plugin's defaults)".to_owned() } else { p.config.trim().to_owned() };
    let machine = &r.machine;
    let gpus = if machine.gpus.is_empty() {
        "none".to_owned()
    } else {
        machine
            .gpus
            .iter()
            .map(|g| format!("{} ({:.0} GiB)", g.name, g.memory_bytes as f64 / (1u64 << 30) as f64))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let facts: Vec<(&str, String)> = vec![
        ("kind", p.kind.clone()),
        ("sha256", p.sha256.clone()),
        ("artifact", format!("{} bytes, {}", p.bytes, p.transport)),
        ("configuration", config),
        ("suite", format!("{} {}", r.suite.name, sub.suite_version.clone().unwrap_or_default())),
        ("released as", m.suite.released_as.clone().unwrap_or_else(|| "-".into())),
        ("hardware class", sub.hardware_class.clone().unwrap_or_else(|| "-".into())),
        ("GPUs (ranks)", sub.gpus.to_string()),
        ("tracks entered", crate::submission::entered_tracks(r).join(", ")),
        ("run started", r.started_at.clone()),
        ("machine", format!("{} ({} cores, {}), {}", machine.cpu, machine.cpu_cores, crate::bytes(machine.memory_bytes), machine.os)),
        ("GPUs of the machine", gpus),
        ("harness", format!("{} ({})", machine.harness_version, machine.git_revision)),
        ("libtorch", machine.libtorch.clone().unwrap_or_else(|| "-".into())),
        ("content id", v.id.clone()),
    ];
    out.push_str("<table class=\"facts\">");
    for (k, val) in facts {
        let cell = if matches!(k, "sha256" | "configuration" | "content id") { format!("<code>{}</code>", esc(&val)) } else { esc(&val) };
        let _ = write!(out, "<tr><th>{}</th><td>{cell}</td></tr>", esc(k));
    }
    out.push_str("</table>");
    let _ = write!(out, "<p>Files: {}</p>", v.files.html().replace("href=\"bundles/", "href=\"../../bundles/"));
    out.push_str(&rows_on_boards(v, subs));
    out.push_str(&call_cost(r, &p.name));
    if !v.verdict.notes.is_empty() {
        out.push_str("<h2>Notes from <code>harness verify</code></h2><ul>");
        for n in &v.verdict.notes {
            let _ = write!(out, "<li>{}</li>", esc(n));
        }
        out.push_str("</ul>");
    }
    out.push_str("</body></html>\n");
    out
}

/// Its rows on the submission boards: rank, ratios, profile, and its line
/// of each board's forest plot.
fn rows_on_boards(v: &Verified, subs: &[SubBoard]) -> String {
    let mut out = String::from("<h2>On the leaderboard</h2>");
    for (i, b) in subs.iter().enumerate() {
        let Some(r) = b.rows.iter().find(|r| !r.reference && r.files.folder == v.files.folder) else { continue };
        let _ = write!(
            out,
            "<h3><a href=\"../../index.html#{}\">{}</a></h3><table><tr><th>rank</th>",
            super::tracks::anchor(i),
            submissions::title(b, crate::escape::Markup::Html)
        );
        for w in &b.workloads {
            let _ = write!(out, "<th>{}<br><small>time vs baseline</small></th>", esc(w));
        }
        out.push_str("<th>profile</th></tr><tr>");
        let _ = write!(out, "<td>{}</td>", esc(&submissions::rank_cell(r)));
        for (s, n) in r.ratios.iter().zip(&r.reached) {
            let _ = write!(out, "<td>{}</td>", esc(&submissions::ratio_cell(s, *n, true)));
        }
        let _ = write!(out, "<td>{:.2}</td></tr></table>", r.profile);
        // Its own line of the board's forest plot.
        let mut own = b.clone();
        own.rows.retain(|x| x.reference || x.files.folder == v.files.folder);
        let _ = write!(
            out,
            "<figure class=\"forest\"><figcaption>Time to target ÷ the baseline's, per workload (95% interval; hollow: n.s.)</figcaption>{}</figure>",
            super::plots::forest(&format!("forest-{i}"), &own)
        );
    }
    out
}

/// What a call into the plugin cost, per workload and strategy of the
/// submission: calls per entry and the median of the entries' p50 and p99
/// call times, with the load and compile time of the artifact. Empty when
/// the result records none.
fn call_cost(r: &RunResult, plugin: &str) -> String {
    let mut by: std::collections::BTreeMap<(String, String), Vec<Call>> = Default::default();
    for e in r.entries.iter().filter(|e| e.strategy.starts_with("submission-") && matches!(e.status, EntryStatus::Ok)) {
        for p in e.metrics.iter().flat_map(|m| m.plugins.iter()).filter(|p| p.manifest.name == plugin) {
            let Some(c) = &p.call else { continue };
            by.entry((e.workload.clone(), e.strategy.clone())).or_default().push((p.calls, c.p50_ms, c.p99_ms, p.load_s));
        }
    }
    if by.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "<h2>Cost of a call into the plugin</h2><table><tr><th>workload</th><th>strategy</th><th>repeats</th><th>calls per entry</th><th>p50 per call</th><th>p99 per call</th><th>load and compile</th></tr>",
    );
    let med = |mut xs: Vec<f64>| {
        crate::stats::median(&{
            xs.sort_by(f64::total_cmp);
            xs
        })
    };
    for ((w, s), xs) in by {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.0}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&w),
            esc(&s),
            xs.len(),
            med(xs.iter().map(|x| x.0 as f64).collect()),
            micros(med(xs.iter().map(|x| x.1).collect())),
            micros(med(xs.iter().map(|x| x.2).collect())),
            micros(xs.iter().map(|x| x.3 * 1e3).fold(0.0, f64::max))
        );
    }
    out.push_str("</table>");
    out
}

/// One entry's calls into the plugin: (calls, p50 ms, p99 ms, load s).
type Call = (u64, f64, f64, f64);

/// Milliseconds as "12.3 µs", "4.56 ms" or "1.23 s".
fn micros(ms: f64) -> String {
    if ms < 1.0 {
        format!("{:.1} µs", ms * 1e3)
    } else if ms < 1e3 {
        format!("{ms:.2} ms")
    } else {
        format!("{:.2} s", ms / 1e3)
    }
}
