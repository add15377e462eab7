//! A suite's `[projection]` in `harness report`: the suite's strategies
//! projected on the clusters it names, calibrated on the result files the
//! report was given (one-GPU entries of the same work from any of them,
//! the buckets and strategies from the suite's own), the bandwidth inside
//! a node from what the suite's plain all-reduce entries measured in
//! training (or the clusters' `nvlink=`). Shown in a section of its own,
//! labelled as a projection, never on a board beside measured rows.

use std::path::{Path, PathBuf};

use harness_format::results::RunResult;
use harness_format::suite::Suite;

use super::calibrate::{plain, Bench, Source};
use super::cluster::Cluster;
use super::projection::project;
use super::render;

/// The most clusters (ranges expanded) a suite's projection is made on: a
/// result file from elsewhere must not make the report project without end.
pub const MAX_CLUSTERS: usize = 256;

/// One suite's projection, or why none could be made.
#[derive(Debug, Clone)]
pub struct SuiteProjection {
    pub suite: String,
    /// The calibration and the short tables, or the reason there are none.
    pub text: String,
    /// Each workload's lines, for the report's plot.
    pub series: Vec<(String, Vec<render::Series>)>,
}

/// The projections of every suite among `results` (read from `sources`,
/// in the same order) that has a `[projection]` section.
pub fn of_results(results: &[RunResult], sources: &[String]) -> Vec<SuiteProjection> {
    let all: Vec<Source> = results
        .iter()
        .enumerate()
        .map(|(i, r)| Source { path: PathBuf::from(sources.get(i).cloned().unwrap_or_default()), result: r.clone() })
        .collect();
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for r in results {
        if seen.contains(&r.suite.sha256) {
            continue;
        }
        seen.push(r.suite.sha256.clone());
        let Ok(suite) = Suite::parse(Path::new(&r.suite.path), r.suite.text.clone()) else { continue };
        let Some(spec) = &suite.spec.projection else { continue };
        let text = |t: String| SuiteProjection { suite: r.suite.name.clone(), text: t, series: Vec::new() };
        let mut clusters = Vec::new();
        for c in &spec.clusters {
            match Cluster::parse(c) {
                Ok(cs) => clusters.extend(cs),
                Err(e) => {
                    out.push(text(format!("no projection: {e}")));
                    break;
                }
            }
        }
        if clusters.is_empty() {
            continue;
        }
        if clusters.len() > MAX_CLUSTERS {
            out.push(text(format!("no projection: the section names {} clusters, more than {MAX_CLUSTERS}", clusters.len())));
            continue;
        }
        // The suite's own plain all-reduce entries, on the machine's own
        // links, give the bandwidth inside a node.
        let mut benches = Vec::new();
        for src in all.iter().filter(|s| s.result.suite.sha256 == r.suite.sha256) {
            for (e, m) in src.ok() {
                let own = src.strategy(e).is_some_and(|s| plain(s) && s.link.is_none());
                if own && m.world_size >= 2 {
                    if let Ok(b) = Bench::of_entry(src, e, m, false) {
                        benches.push(b);
                    }
                }
            }
        }
        let mut p = match project(&all, &benches, &clusters, None, &spec.strategies) {
            Ok(p) => p,
            Err(e) => {
                out.push(text(format!("no projection: {e}")));
                continue;
            }
        };
        let names: Vec<&str> = suite.spec.workloads.iter().map(|w| w.name.as_str()).collect();
        // A workload's rows carry its suite name, with what its work was
        // in brackets where another of the name did other work.
        let ours = |w: &str| names.iter().any(|n| w == *n || w.strip_prefix(n).is_some_and(|rest| rest.starts_with(" (")));
        p.rows.retain(|x| ours(&x.workload));
        p.break_even.retain(|x| ours(&x.workload));
        p.intra.retain(|x| names.contains(&x.0.as_str()));
        p.calibration.retain(|line| names.iter().any(|n| line.starts_with(&format!("{n}:"))));
        if p.rows.is_empty() {
            out.push(text(
                "no projection: no workload of the suite has a one-GPU entry and a multi-GPU entry of the same work among the results"
                    .into(),
            ));
            continue;
        }
        out.push(SuiteProjection {
            suite: r.suite.name.clone(),
            text: format!("{}\n{}{}", render::calibration(&p), render::summary(&p), render::time_to_target(&p)),
            series: render::workload_series(&p),
        });
    }
    out
}

/// The projections as a section of LEADERBOARD.md; empty without any.
pub fn markdown(ps: &[SuiteProjection]) -> String {
    if ps.is_empty() {
        return String::new();
    }
    let mut out = format!("\n## Projections (not measurements)\n\n{}. Each suite with a `[projection]` section, projected by `harness project` on the clusters it names; index.html plots them.\n", render::LABEL);
    for p in ps {
        // A fence longer than any run of backticks in the text.
        let run = p.text.split(|c| c != '`').map(str::len).max().unwrap_or(0);
        let fence = "`".repeat(run.max(2) + 1);
        out.push_str(&format!("\n### {}\n\n{fence}text\n{}\n{fence}\n", crate::escape::md(&p.suite), p.text.trim_end()));
    }
    out
}
