//! The leaderboard of submissions: bundles (`harness submit`) ranked per
//! standard suite version, hardware class, GPU count and track, by their
//! time to target relative to the track's baseline measured in the same
//! run, with a performance profile across the track's workloads (as
//! AlgoPerf scores submissions). Bundles that do not verify, or runs that
//! are unofficial, are listed apart and never ranked.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::stats::Summary;
use super::Metric;
use crate::results::{EntryStatus, RunResult};
use crate::submission::verify::Verdict;
use crate::submission::Bundle;
use crate::suite::Suite;

/// The profile's range: a submission more than this many times slower than
/// the best on a workload scores nothing there (AlgoPerf's τ_max).
pub const TAU_MAX: f64 = 4.0;

/// A bundle and what `harness verify` said of it.
pub struct Verified {
    pub bundle: Bundle,
    pub verdict: Verdict,
}

/// One board: a track of one suite version on one hardware class and GPU
/// count.
#[derive(Debug, Clone)]
pub struct SubBoard {
    pub suite: String,
    pub version: String,
    pub hardware: String,
    pub gpus: u32,
    pub track: String,
    pub baseline: String,
    pub workloads: Vec<String>,
    /// The metric shown next to time to target (not ranked on): goodput
    /// for checkpoint policies, throughput for the other kinds.
    pub second: Metric,
    /// Ranked rows first (verified and official), then the others.
    pub rows: Vec<SubRow>,
}

/// One submission on one track.
#[derive(Debug, Clone)]
pub struct SubRow {
    pub plugin: String,
    pub version: String,
    pub sha256: String,
    pub bundle: PathBuf,
    /// Per workload: time to target / the baseline's, paired by repeat.
    pub ratios: Vec<Option<Summary>>,
    /// Per workload: repeats that reached the target, of those that ran.
    pub reached: Vec<(usize, usize)>,
    /// Per workload: the board's `second` metric over the baseline's,
    /// paired by repeat (higher is better).
    pub second: Vec<Option<Summary>>,
    /// Area under the performance profile over [1, TAU_MAX], in [0, 1].
    pub profile: f64,
    pub rank: Option<usize>,
    /// Why the row is not ranked (empty when verified and official).
    pub why_not: Vec<String>,
    /// The track's baseline, ratio 1 by definition: listed for reference
    /// among the ranked rows, never ranked itself.
    pub reference: bool,
}

impl SubRow {
    pub fn ranked(&self) -> bool {
        self.why_not.is_empty() && !self.reference
    }

    /// A row of the ranked table (ranked, or the reference).
    fn listed_with_ranked(&self) -> bool {
        self.why_not.is_empty()
    }

    fn baseline(b: &SubBoard, runs: usize) -> SubRow {
        let one = Summary { n: runs, olympic_mean: 1.0, median: 1.0, ci95: None };
        SubRow {
            plugin: format!("baseline `{}` (reference)", b.baseline),
            version: String::new(),
            sha256: String::new(),
            bundle: PathBuf::new(),
            ratios: vec![Some(one); b.workloads.len()],
            reached: vec![(runs, runs); b.workloads.len()],
            second: vec![Some(Summary { n: runs, olympic_mean: 1.0, median: 1.0, ci95: None }); b.workloads.len()],
            profile: 0.0,
            rank: None,
            why_not: Vec::new(),
            reference: true,
        }
    }
}

/// The boards of every bundle's tracks.
pub fn boards(bundles: &[Verified]) -> Vec<SubBoard> {
    let mut by_key: BTreeMap<(String, String, String, u32, String), SubBoard> = BTreeMap::new();
    for v in bundles {
        let r = &v.bundle.result;
        let Some(sub) = &r.submission else { continue };
        let Ok(suite) = Suite::parse(Path::new(&r.suite.path), r.suite.text.clone()) else { continue };
        let Some(plugin) = sub.entered.first() else { continue };
        for track in &sub.tracks {
            let Some(t) = suite.spec.tracks.iter().find(|t| &t.name == track) else { continue };
            let version = sub.suite_version.clone().unwrap_or_else(|| "-".into());
            let hardware = sub.hardware_class.clone().unwrap_or_else(|| "-".into());
            let key = (r.suite.name.clone(), version.clone(), hardware.clone(), sub.gpus, track.clone());
            let board = by_key.entry(key).or_insert_with(|| SubBoard {
                suite: r.suite.name.clone(),
                version,
                hardware,
                gpus: sub.gpus,
                track: track.clone(),
                baseline: t.baseline.clone(),
                workloads: t.workloads.clone(),
                second: if t.kind == "checkpoint-policy" { Metric::Goodput } else { Metric::TokensPerS },
                rows: Vec::new(),
            });
            let strategy = format!("submission-{track}");
            let (ratios, reached) = board.workloads.iter().map(|w| time_ratios(r, w, &strategy, &t.baseline)).unzip();
            let second = board
                .workloads
                .iter()
                .map(|w| paired(r, w, &strategy, &t.baseline, board.second).map(|(s, _)| s).unwrap_or(None))
                .collect();
            board.rows.push(SubRow {
                plugin: plugin.name.clone(),
                version: plugin.version.clone(),
                sha256: plugin.sha256.clone(),
                bundle: v.bundle.dir.clone(),
                ratios,
                reached,
                second,
                profile: 0.0,
                rank: None,
                why_not: v.verdict.reasons(),
                reference: false,
            });
        }
    }
    let mut out: Vec<SubBoard> = by_key.into_values().collect();
    for b in &mut out {
        let reference = SubRow::baseline(b, 0);
        b.rows.push(reference);
        score(b);
    }
    out
}

/// A metric of the submission over the baseline's, repeat by repeat (the
/// two share the repeat's seed and ran side by side): their summary, and
/// how many of the submission's repeats have the metric, of those that ran.
/// None when the submission lacks it in a repeat.
fn paired(r: &RunResult, workload: &str, strategy: &str, baseline: &str, metric: Metric) -> Option<(Option<Summary>, (usize, usize))> {
    let of = |st: &str| -> BTreeMap<u32, Option<f64>> {
        r.entries
            .iter()
            .filter(|e| e.workload == workload && e.strategy == st)
            .map(|e| {
                let x = match (&e.status, &e.metrics) {
                    (EntryStatus::Ok, Some(m)) => metric.value(m),
                    _ => None,
                };
                (e.repeat, x)
            })
            .collect()
    };
    let (sub, base) = (of(strategy), of(baseline));
    let have = (sub.values().filter(|x| x.is_some()).count(), sub.len());
    if have.0 < have.1 || have.1 == 0 {
        return Some((None, have));
    }
    let xs: Vec<f64> = sub.iter().filter_map(|(rep, x)| Some((*x)? / base.get(rep).copied().flatten()?)).collect();
    Some((Summary::of(&xs), have))
}

/// Time to target over the baseline's, and the repeats that reached it.
fn time_ratios(r: &RunResult, workload: &str, strategy: &str, baseline: &str) -> (Option<Summary>, (usize, usize)) {
    paired(r, workload, strategy, baseline, Metric::TimeToTarget).unwrap_or((None, (0, 0)))
}

/// Performance profile and rank. On each workload, a submission's ratio is
/// compared with the best ratio of the board's ranked rows and the
/// baseline's (1); the profile ρ(τ) is the share of workloads within τ of
/// the best, and the score its mean over [1, TAU_MAX]. A missed target
/// scores 0 on that workload.
fn score(b: &mut SubBoard) {
    let best: Vec<f64> = (0..b.workloads.len())
        .map(|w| b.rows.iter().filter(|r| r.ranked()).filter_map(|r| r.ratios[w].as_ref().map(|s| s.olympic_mean)).fold(1.0, f64::min))
        .collect();
    for r in &mut b.rows {
        let n = b.workloads.len().max(1) as f64;
        r.profile = r
            .ratios
            .iter()
            .zip(&best)
            .map(|(s, best)| s.as_ref().map_or(0.0, |s| (TAU_MAX - (s.olympic_mean / best).max(1.0)).max(0.0) / (TAU_MAX - 1.0)))
            .sum::<f64>()
            / n;
    }
    let geo = |r: &SubRow| -> f64 {
        let xs: Vec<f64> = r.ratios.iter().map(|s| s.as_ref().map_or(f64::INFINITY, |s| s.olympic_mean)).collect();
        (xs.iter().map(|x| x.ln()).sum::<f64>() / xs.len().max(1) as f64).exp()
    };
    b.rows.sort_by(|x, y| {
        y.listed_with_ranked().cmp(&x.listed_with_ranked()).then(y.profile.total_cmp(&x.profile)).then(geo(x).total_cmp(&geo(y)))
    });
    for (k, r) in (1..).zip(b.rows.iter_mut().filter(|r| r.ranked())) {
        r.rank = Some(k);
    }
}

/// A ratio cell: "0.62 [0.60, 0.65]", "missed 1 of 3", or "-".
pub fn ratio_cell(s: &Option<Summary>, reached: (usize, usize)) -> String {
    match s {
        _ if reached.0 < reached.1 => format!("missed the target in {} of {}", reached.1 - reached.0, reached.1),
        None => "-".into(),
        Some(s) => match s.ci95 {
            Some((lo, hi)) if s.n >= 2 => format!("{:.3} [{lo:.3}, {hi:.3}]", s.olympic_mean),
            _ if s.n == 0 => format!("{:.3}", s.olympic_mean),
            _ => format!("{:.3} (n={})", s.olympic_mean, s.n),
        },
    }
}

/// The board's title.
pub fn title(b: &SubBoard) -> String {
    let unit = if b.hardware == "cpu" { "rank" } else { "GPU" };
    format!("{} {} · {} · {} {unit}{} · track `{}`", b.suite, b.version, b.hardware, b.gpus, if b.gpus == 1 { "" } else { "s" }, b.track)
}

pub const EXPLAINED: &str = "Per standard suite version, hardware class, GPU count and track. Each workload's cell is the \
submission's time to target divided by the track baseline's, measured in the same run and paired by repeat (olympic mean \
and bootstrap 95% interval; below 1 is faster than the baseline), and next to it, not ranked on, the same ratio of goodput \
(checkpointing tracks) or tokens/s (the others; above 1 is more). The profile score is the area under the performance \
profile over τ in [1, 4] (AlgoPerf): 1.00 means the best ratio on every workload, 0 a missed target or 4× the best \
everywhere. Only bundles that `harness verify` accepts are ranked; the others are listed apart with the reasons.";

/// The Markdown section.
pub fn markdown(boards: &[SubBoard]) -> String {
    let mut out = String::from("## Submissions\n\n");
    out.push_str(EXPLAINED);
    out.push('\n');
    for b in boards {
        out.push_str(&format!("\n### {}\n\nBaseline: `{}`.\n\n", title(b), b.baseline));
        let mut header = vec!["rank".to_owned(), "plugin".into(), "sha256".into()];
        header.extend(b.workloads.iter().map(|w| format!("{w} (time vs baseline)")));
        header.extend(b.workloads.iter().map(|w| format!("{w} ({} vs baseline)", b.second.name())));
        header.extend(["profile".into(), "bundle".into(), "not ranked because".into()]);
        out.push_str(&format!("| {} |\n|{}|\n", header.join(" | "), vec![" --- "; header.len()].join("|")));
        for r in &b.rows {
            let sha = if r.reference { "-".into() } else { format!("`{}`", &r.sha256[..12.min(r.sha256.len())]) };
            let mut cells =
                vec![r.rank.map_or("-".into(), |k| k.to_string()), format!("{} {}", r.plugin, r.version).trim().to_owned(), sha];
            cells.extend(r.ratios.iter().zip(&r.reached).map(|(s, n)| ratio_cell(s, *n)));
            cells.extend(r.second.iter().map(|s| ratio_cell(s, (0, 0))));
            cells.push(format!("{:.2}", r.profile));
            cells.push(if r.reference { "-".into() } else { format!("`{}`", r.bundle.display()) });
            cells.push(if r.why_not.is_empty() { "-".into() } else { r.why_not.join("; ") });
            out.push_str(&format!("| {} |\n", cells.join(" | ").replace('\n', " ")));
        }
    }
    if boards.is_empty() {
        out.push_str("\nNo submission bundles were given.\n");
    }
    out
}
