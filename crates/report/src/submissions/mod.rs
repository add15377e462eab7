//! The leaderboard of submissions: bundles (`harness submit`) ranked per
//! standard suite version, hardware class, GPU count and track, by their
//! time to target relative to the track's baseline measured in the same
//! run, with a performance profile across the track's workloads (as
//! AlgoPerf scores submissions). Only bundles that verify (which makes
//! them official too) are ranked, one row per entered identity and track
//! ([`crate::submission::track_identity`]: what was measured, not the
//! bundle's bytes), pooling the repeats of every bundle of it ([`boards`]);
//! the others, and the byte-for-byte copies of a ranked bundle under other
//! folder names, are listed apart with the reason ([`apart`]) and never
//! reach a table.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::stats::Summary;
use super::Metric;
use crate::escape::{self, md, md_code, short, Markup};
use crate::reproduction::{Reproduced, Tolerance};
use crate::submission::verify::Verdict;
use crate::submission::Bundle;
use harness_format::results::{EnteredPlugin, EntryResult, EntryStatus, RunResult};
use harness_format::suite::Suite;

/// The profile's range: a submission more than this many times slower than
/// the best on a workload scores nothing there (AlgoPerf's τ_max).
pub const TAU_MAX: f64 = 4.0;

/// A bundle as `harness report` lists it ([`crate::inputs::load`]): what
/// `harness verify` said of it, its content identity, and the files of it
/// the board copies.
pub struct Verified {
    pub bundle: Bundle,
    pub verdict: Verdict,
    /// Its content identity ([`crate::inputs::content_id`], hex) when it
    /// verifies; else, its manifest's word not being taken, the hash of
    /// the files copied from it.
    pub id: String,
    /// The folder given earlier that holds the same content, when both
    /// verify: this one is a copy, listed apart and never ranked.
    pub same_as: Option<PathBuf>,
    /// Where its copies go in the board's folder.
    pub files: Files,
    /// The bytes of the files copied ([`Files::copied`], in that order).
    pub copies: Vec<Vec<u8>>,
}

impl Verified {
    /// Whether it is ranked: it verifies and is not a copy of a bundle
    /// given before it. Its repeats are pooled into the row of its entered
    /// identity ([`boards`]), which names the first such bundle given.
    pub fn ranks(&self) -> bool {
        self.verdict.verified() && self.same_as.is_none()
    }
}

/// The folder the board keeps a bundle's files in, `bundles/<folder>/`
/// beside LEADERBOARD.md and index.html: the links of the board go there,
/// never to the bundle's own folder, whose name the submitter chose.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Files {
    /// Hex digits only: the first 16 of the bundle's content identity
    /// (all 64 where two different contents share the first 16).
    pub folder: String,
    /// The files copied there ([`crate::submission::RESULT`],
    /// [`crate::submission::MANIFEST`]).
    pub copied: Vec<&'static str>,
    /// Files not copied, with why (too large, unreadable, changed since
    /// `harness verify` read it).
    pub not_copied: Vec<String>,
}

/// Where the board keeps the bundles' files, relative to its folder.
pub const BUNDLES: &str = "bundles";

impl Files {
    /// The relative links to the copied files: (file name, href). The
    /// href holds [`BUNDLES`], hex digits and the file's name only.
    pub fn links(&self) -> Vec<(&'static str, String)> {
        debug_assert!(self.folder.chars().all(|c| c.is_ascii_hexdigit()), "{}", self.folder);
        if self.folder.is_empty() || !self.folder.chars().all(|c| c.is_ascii_hexdigit()) {
            return Vec::new();
        }
        self.copied.iter().map(|f| (*f, format!("{BUNDLES}/{}/{f}", self.folder))).collect()
    }

    /// The links as the Markdown writes them, or why there are none.
    fn markdown(&self) -> String {
        let mut parts: Vec<String> = self.links().into_iter().map(|(f, href)| format!("[{f}]({href})")).collect();
        parts.extend(self.not_copied.iter().map(|w| md(w)));
        parts.join(", ")
    }

    /// The links as the page writes them, or why there are none.
    pub fn html(&self) -> String {
        let mut parts: Vec<String> = self.links().into_iter().map(|(f, href)| format!("<a href=\"{href}\">{f}</a>")).collect();
        parts.extend(self.not_copied.iter().map(|w| escape::html(w)));
        parts.join(", ")
    }
}

/// The name a bundle's submission strategy takes in the per-workload
/// tables: the plugin's name, version and sha256 prefix, then the track's
/// strategy (`topk 0.1.0 (c4b8bc5d3ce2) [submission-compression]`), so
/// that two parties' plugins are never pooled.
pub fn strategy_name(plugin: &EnteredPlugin, strategy: &str) -> String {
    format!("{} {} ({}) [{strategy}]", plugin.name, plugin.version, short(&plugin.sha256))
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
    /// The ranked rows and the baseline's reference row, best first; then
    /// the rows that are shown but not ranked (self-reported, or not
    /// reproduced).
    pub rows: Vec<SubRow>,
    /// The hardware class's timing band ([`crate::reproduction::Tolerance`]):
    /// how far two honest runs of the same work differ. Two rows are told
    /// apart only by more than this ([`faster_beyond_doubt`]).
    pub band: f64,
}

/// Who measured a row's figures.
#[derive(Debug, Clone, PartialEq)]
pub enum Measured {
    /// The operator: `reruns` reruns (`harness reproduce`, signed records
    /// that say reproduced), their repeats pooled; what the bundles
    /// claimed is kept beside, per workload, for the reader.
    Operator { reruns: usize, claimed: Vec<Option<Summary>> },
    /// Only the submitter's own runs: shown, never ranked.
    SelfReported,
    /// The operator reran a bundle of it and the rerun did not match the
    /// claim: shown with the first difference, never ranked.
    NotReproduced { why: String },
}

/// One submission on one track.
#[derive(Debug, Clone)]
pub struct SubRow {
    /// The plugin's name (the baseline's, for the reference row).
    pub plugin: String,
    pub version: String,
    pub sha256: String,
    /// The bundle's folder as it was given (shown as text, never linked):
    /// the first given of the bundles the row pools.
    pub bundle: PathBuf,
    /// Its files in the board's folder (the links).
    pub files: Files,
    /// The name of its submission strategy on this track in the
    /// per-workload tables ([`strategy_name`]).
    pub strategy: String,
    /// Per workload: time to target / the baseline's, paired by repeat,
    /// over the repeats of every bundle the row pools.
    pub ratios: Vec<Option<Summary>>,
    /// Per workload: repeats that reached the target, of those that ran.
    pub reached: Vec<(usize, usize)>,
    /// Per workload: the board's `second` metric over the baseline's,
    /// paired by repeat (higher is better).
    pub second: Vec<Option<Summary>>,
    /// Area under the performance profile over [1, TAU_MAX], in [0, 1].
    pub profile: f64,
    /// Its rank: 1 + the ranked rows ahead of it that are faster on some
    /// workload beyond doubt (their 95% intervals do not overlap, or it
    /// missed a target they reached). Rows no interval separates share a
    /// rank.
    pub rank: Option<usize>,
    /// Whether another ranked row shares its rank.
    pub tied: bool,
    /// The track's baseline, ratio 1 by definition: listed for reference
    /// among the ranked rows, never ranked itself.
    pub reference: bool,
    /// Whose measurements `ratios`, `reached` and `second` are.
    pub measured: Measured,
}

impl SubRow {
    /// Whether it is ranked: a submission the operator measured.
    pub fn ranked(&self) -> bool {
        !self.reference && matches!(self.measured, Measured::Operator { .. })
    }

    /// Who measured it, as a cell: "operator, 2 reruns (claimed 0.52, 0.81)",
    /// "self-reported", "NOT reproduced: ...".
    pub fn measured_cell(&self) -> String {
        match &self.measured {
            _ if self.reference => "-".into(),
            Measured::Operator { reruns, claimed } => {
                let claims: Vec<String> =
                    claimed.iter().map(|c| c.as_ref().map_or("-".into(), |c| format!("{:.3}", c.olympic_mean))).collect();
                format!("operator, {reruns} rerun{} (claimed {})", if *reruns == 1 { "" } else { "s" }, claims.join(", "))
            }
            Measured::SelfReported => "self-reported (not reproduced by the operator): not ranked".into(),
            Measured::NotReproduced { why } => format!("NOT reproduced: {why}"),
        }
    }

    fn baseline(b: &SubBoard, runs: usize) -> SubRow {
        let one = Summary { n: runs, olympic_mean: 1.0, median: 1.0, ci95: None };
        SubRow {
            plugin: b.baseline.clone(),
            version: String::new(),
            sha256: String::new(),
            bundle: PathBuf::new(),
            files: Files::default(),
            strategy: b.baseline.clone(),
            ratios: vec![Some(one); b.workloads.len()],
            reached: vec![(runs, runs); b.workloads.len()],
            second: vec![Some(Summary { n: runs, olympic_mean: 1.0, median: 1.0, ci95: None }); b.workloads.len()],
            profile: 0.0,
            rank: None,
            tied: false,
            reference: true,
            measured: Measured::SelfReported,
        }
    }

    /// The plugin cell: name and version, or the reference's words.
    pub fn plugin_cell(&self, m: Markup) -> String {
        if self.reference {
            format!("baseline {} (reference)", m.code(&self.plugin))
        } else {
            m.text(format!("{} {}", self.plugin, self.version).trim())
        }
    }
}

/// The boards of the verified bundles' tracks: one row per entered
/// identity ([`crate::submission::track_identity`]: the released suite,
/// hardware class, GPU count, track, and the plugin's artifact and
/// configuration) on each track it was entered in, whatever the number of
/// bundles. The row pools the repeats of all of its bundles (each repeat
/// once, however many bundles carry it: [`pooled`]), so that neither
/// several runs nor one run in several bundles can put a best foot
/// forward; it names and links the first of them given that ranks.
/// A bundle that does not verify has no row and adds no repeat.
///
/// Only the operator's measurements rank ([`Measured`]): a row whose
/// identity the operator reproduced (`operator`: signed records, checked,
/// with their reruns) shows and is ranked on the reruns' figures, pooled
/// over the reruns, with the bundles' claim beside; a row the operator has
/// not reproduced is shown as self-reported, and one whose reproduction
/// failed with the first difference, neither ranked.
pub fn boards(bundles: &[Verified], operator: &[Reproduced]) -> Vec<SubBoard> {
    type Key = (String, String, String, u32, String);
    let mut by_key: BTreeMap<Key, SubBoard> = BTreeMap::new();
    // The rows of each board: its entered identities, each with its bundles
    // in the order given.
    let mut rows: BTreeMap<Key, Vec<(String, Vec<&Verified>)>> = BTreeMap::new();
    for v in bundles.iter().filter(|v| v.verdict.verified()) {
        let r = &v.bundle.result;
        let Some(sub) = &r.submission else { continue };
        let Ok(suite) = Suite::parse(Path::new(&r.suite.path), r.suite.text.clone()) else { continue };
        // Only the tracks it was entered in: a compressor run without
        // `--track` ran beside the other kinds' baselines, not in their
        // tracks.
        for track in &crate::submission::entered_tracks(r) {
            let Some(t) = suite.spec.tracks.iter().find(|t| &t.name == track) else { continue };
            let Some(id) = crate::submission::track_identity(r, track) else { continue };
            let version = sub.suite_version.clone().unwrap_or_else(|| "-".into());
            let hardware = sub.hardware_class.clone().unwrap_or_else(|| "-".into());
            let key = (r.suite.name.clone(), version.clone(), hardware.clone(), sub.gpus, track.clone());
            by_key.entry(key.clone()).or_insert_with(|| SubBoard {
                suite: r.suite.name.clone(),
                version,
                hardware,
                gpus: sub.gpus,
                track: track.clone(),
                baseline: t.baseline.clone(),
                workloads: t.workloads.clone(),
                second: if t.kind == "checkpoint-policy" { Metric::Goodput } else { Metric::TokensPerS },
                rows: Vec::new(),
                band: Tolerance::for_class(sub.hardware_class.as_deref()).time_band,
            });
            let ids = rows.entry(key).or_default();
            match ids.iter_mut().find(|(i, _)| *i == id) {
                Some((_, vs)) => vs.push(v),
                None => ids.push((id, vec![v])),
            }
        }
    }
    let mut out = Vec::new();
    for (key, mut board) in by_key {
        let strategy = format!("submission-{}", board.track);
        for (id, vs) in rows.remove(&key).unwrap_or_default() {
            let first = vs.iter().find(|v| v.ranks()).unwrap_or(&vs[0]);
            let Some(plugin) = first.bundle.result.submission.as_ref().and_then(|s| s.entered.first()) else { continue };
            let claims: Vec<&RunResult> = vs.iter().map(|v| &v.bundle.result).collect();
            // The operator's records of this identity: its reruns carry the
            // same released suite, artifact, configuration and track.
            let records: Vec<&Reproduced> = operator
                .iter()
                .filter(|o| {
                    o.record.bundle.plugin_sha256 == plugin.sha256
                        && crate::submission::entered_tracks(&o.rerun).contains(&board.track)
                        && crate::submission::track_identity(&o.rerun, &board.track).as_deref() == Some(id.as_str())
                })
                .collect();
            let reruns: Vec<&RunResult> = records.iter().filter(|o| o.record.reproduced).map(|o| &o.rerun).collect();
            let failed = records.iter().find(|o| !o.record.reproduced);
            let claimed: Vec<Option<Summary>> =
                board.workloads.iter().map(|w| pooled(&claims, w, &strategy, &board.baseline, Metric::TimeToTarget).0).collect();
            let (results, measured) = if !reruns.is_empty() {
                (reruns.clone(), Measured::Operator { reruns: reruns.len(), claimed })
            } else if let Some(o) = failed {
                let why = o.record.comparison.differences.first().map_or_else(|| "the rerun differs".to_owned(), |d| d.to_string());
                (claims.clone(), Measured::NotReproduced { why })
            } else {
                (claims.clone(), Measured::SelfReported)
            };
            let (ratios, reached) =
                board.workloads.iter().map(|w| pooled(&results, w, &strategy, &board.baseline, Metric::TimeToTarget)).unzip();
            let second = board.workloads.iter().map(|w| pooled(&results, w, &strategy, &board.baseline, board.second).0).collect();
            board.rows.push(SubRow {
                plugin: plugin.name.clone(),
                version: plugin.version.clone(),
                sha256: plugin.sha256.clone(),
                bundle: first.bundle.dir.clone(),
                files: first.files.clone(),
                strategy: strategy_name(plugin, &strategy),
                ratios,
                reached,
                second,
                profile: 0.0,
                rank: None,
                tied: false,
                reference: false,
                measured,
            });
        }
        let reference = SubRow::baseline(&board, 0);
        board.rows.push(reference);
        score(&mut board);
        out.push(board);
    }
    out
}

/// A metric of the submission over the baseline's, repeat by repeat (the
/// two share the repeat's seed and ran side by side in one run), pooled
/// over the runs `results` of one entered identity: their summary, and how
/// many of the submission's repeats have the metric, of those that ran.
/// A repeat is the pair of its two entries' records: one that several
/// results carry (copies of one run in bundles that differ by a log line,
/// a file or a field) counts once. The summary is none when a repeat of
/// the submission lacks the metric (for time to target: missed the
/// target).
fn pooled(results: &[&RunResult], workload: &str, strategy: &str, baseline: &str, metric: Metric) -> (Option<Summary>, (usize, usize)) {
    let value = |e: &EntryResult| match (&e.status, &e.metrics) {
        (EntryStatus::Ok, Some(m)) => metric.value(m),
        _ => None,
    };
    let mut seen = BTreeSet::new();
    let mut xs = Vec::new();
    let mut have = (0, 0);
    for r in results {
        let of = |st: &str| -> BTreeMap<u32, &EntryResult> {
            r.entries.iter().filter(|e| e.workload == workload && e.strategy == st).map(|e| (e.repeat, e)).collect()
        };
        let base = of(baseline);
        for (rep, e) in of(strategy) {
            let b = base.get(&rep).copied();
            let record = serde_json::to_vec(&(e, b)).expect("entries serialise");
            if !seen.insert(crate::submission::sha256_hex(&record)) {
                continue;
            }
            let x = value(e);
            have.1 += 1;
            if let Some(x) = x {
                have.0 += 1;
                if let Some(b) = b.and_then(value) {
                    xs.push(x / b);
                }
            }
        }
    }
    if have.0 < have.1 || have.1 == 0 {
        return (None, have);
    }
    (Summary::of(&xs), have)
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
    b.rows.sort_by(|x, y| y.profile.total_cmp(&x.profile).then(geo(x).total_cmp(&geo(y))));
    share_ranks(&mut b.rows, b.band);
}

/// Ranks the rows, in the order of their score: a row's rank is 1 plus
/// the number of ranked rows ahead of it that are faster beyond doubt on
/// some workload ([`faster_beyond_doubt`]); rows that nothing separates
/// share a rank and are marked tied. The order is then by rank (a row is
/// never listed below one it ranks above), the score's order within a rank.
fn share_ranks(rows: &mut Vec<SubRow>, band: f64) {
    let ranks: Vec<Option<usize>> = (0..rows.len())
        .map(|i| rows[i].ranked().then(|| 1 + rows[..i].iter().filter(|a| a.ranked() && faster_beyond_doubt(a, &rows[i], band)).count()))
        .collect();
    for (r, k) in rows.iter_mut().zip(ranks) {
        r.rank = k;
    }
    // A stable sort: the reference row keeps its place among its neighbours.
    let mut keyed: Vec<(usize, SubRow)> = Vec::with_capacity(rows.len());
    let mut last = 0;
    for r in rows.drain(..) {
        // Rows shown but not ranked go last; the reference row keeps its
        // place among the ranked ones.
        let at = match (r.rank, r.reference) {
            (Some(k), _) => {
                last = k;
                k
            }
            (None, true) => last,
            (None, false) => usize::MAX,
        };
        keyed.push((at, r));
    }
    keyed.sort_by_key(|(k, _)| *k);
    rows.extend(keyed.into_iter().map(|(_, r)| r));
    let counts = rows.iter().filter_map(|r| r.rank).fold(BTreeMap::new(), |mut m, k| {
        *m.entry(k).or_insert(0) += 1;
        m
    });
    for r in rows.iter_mut() {
        r.tied = r.rank.is_some_and(|k| counts[&k] > 1);
    }
}

/// Whether `a` is faster than `b` beyond doubt on some workload of the
/// track: its ratio's 95% interval, widened by the class's timing band
/// (`band`: how far two honest runs of the same work differ, which
/// intervals over one run's repeats do not see), lies wholly below `b`'s
/// (a ratio of one repeat is its own interval), or `a` reached a target
/// `b` missed.
pub fn faster_beyond_doubt(a: &SubRow, b: &SubRow, band: f64) -> bool {
    a.ratios.iter().zip(&b.ratios).any(|(x, y)| match (x, y) {
        (Some(x), Some(y)) => interval(x).1 * (1.0 + band) < interval(y).0,
        (Some(_), None) => true,
        _ => false,
    })
}

/// A summary's 95% interval, or its mean where it has none.
pub fn interval(s: &Summary) -> (f64, f64) {
    s.ci95.unwrap_or((s.olympic_mean, s.olympic_mean))
}

/// How a ratio compares with the baseline's 1: "faster" or "slower" when
/// its 95% interval excludes 1, "n.s." when it holds 1, none without an
/// interval (fewer than 2 repeats).
pub fn against_baseline(s: &Summary) -> Option<&'static str> {
    let (lo, hi) = s.ci95.filter(|_| s.n >= 2)?;
    Some(if hi < 1.0 {
        "faster"
    } else if lo > 1.0 {
        "slower"
    } else {
        "n.s."
    })
}

/// A row's rank as the tables show it: "1", "=1" when tied, "-" unranked.
pub fn rank_cell(r: &SubRow) -> String {
    match r.rank {
        None => "-".into(),
        Some(k) if r.tied => format!("={k}"),
        Some(k) => k.to_string(),
    }
}

/// A ratio cell: "0.62 [0.60, 0.65]", "missed 1 of 3", or "-"; with
/// `mark`, " n.s." after an interval that holds 1 (no different from the
/// baseline).
pub fn ratio_cell(s: &Option<Summary>, reached: (usize, usize), mark: bool) -> String {
    match s {
        _ if reached.0 < reached.1 => format!("missed the target in {} of {}", reached.1 - reached.0, reached.1),
        None => "-".into(),
        Some(s) => {
            let ns = if mark && against_baseline(s) == Some("n.s.") { " n.s." } else { "" };
            match s.ci95 {
                Some((lo, hi)) if s.n >= 2 => format!("{:.3} [{lo:.3}, {hi:.3}]{ns}", s.olympic_mean),
                _ if s.n == 0 => format!("{:.3}", s.olympic_mean),
                _ => format!("{:.3} (n={})", s.olympic_mean, s.n),
            }
        }
    }
}

/// The board's title, written for `m`.
pub fn title(b: &SubBoard, m: Markup) -> String {
    let unit = if b.hardware == "cpu" { "rank" } else { "GPU" };
    format!(
        "{} {} · {} · {} {unit}{} · track {}",
        m.text(&b.suite),
        m.text(&b.version),
        m.text(&b.hardware),
        b.gpus,
        if b.gpus == 1 { "" } else { "s" },
        m.code(&b.track)
    )
}

pub const EXPLAINED: &str = "Per standard suite version, hardware class, GPU count and track. Only what the operator \
measured is ranked: a row's figures are those of the operator's reruns (`harness reproduce`, signed records checked against \
the operator's public key, each rerun's result beside its record), pooled over the reruns, with what the bundles claimed \
beside them; a verified bundle that no record reproduces is shown as self-reported, and one whose rerun did not match its \
claim as not reproduced, neither ranked. Each workload's cell is the submission's time to target divided by the track \
baseline's, measured in the same run and paired by repeat (olympic mean and bootstrap 95% interval; below 1 is faster than \
the baseline), and next to it, not ranked on, the same ratio of goodput (checkpointing tracks) or tokens/s (the others; \
above 1 is more). The profile score is the area under the performance profile over τ in [1, 4] (AlgoPerf): 1.00 means the \
best ratio on every workload, 0 a missed target or 4× the best everywhere. A row ranks above another only when it is faster \
beyond doubt on some workload: its interval, widened by the hardware class's timing band (how far two honest runs of the \
same work differ, docs/rules.md), lies wholly below the other's; rows that nothing separates share a rank. One row per \
entered identity (the released suite, the artifact, its configuration, the track), whatever the number of bundles: their \
repeats are pooled, each once. Bundles that do not verify, and byte-for-byte copies, are listed apart with the reasons. \
Each bundle's result.json and MANIFEST.json are copied into bundles/ beside this board, named by the bundle's content \
hash, and the links go there.";

/// The bundles listed apart, in the order given: those that do not verify
/// and the copies of a ranked one.
pub fn apart(bundles: &[Verified]) -> impl Iterator<Item = &Verified> {
    bundles.iter().filter(|v| !v.ranks())
}

/// Why a bundle is listed apart, one sentence each (plain text: each
/// output escapes it): "same content as FOLDER", or "not verified: " and
/// `harness verify`'s reasons.
pub fn why_apart(v: &Verified) -> Vec<String> {
    match &v.same_as {
        Some(first) => vec![format!("same content as {}, ranked as that one", first.display())],
        None => v.verdict.reasons().into_iter().enumerate().map(|(i, r)| if i == 0 { format!("not verified: {r}") } else { r }).collect(),
    }
}

/// The plugin a bundle's result names, as text: "name version", or none.
pub fn plugin_of(v: &Verified) -> Option<String> {
    let p = v.bundle.result.submission.as_ref()?.entered.first()?;
    Some(format!("{} {}", p.name, p.version))
}

/// The Markdown section: a table per board, then the bundles listed
/// apart.
pub fn markdown(boards: &[SubBoard], bundles: &[Verified]) -> String {
    let m = Markup::Markdown;
    let mut out = String::from("## Submissions\n\n");
    out.push_str(EXPLAINED);
    out.push('\n');
    for b in boards {
        out.push_str(&format!("\n### {}\n\nBaseline: {}.\n\n", title(b, m), md_code(&b.baseline)));
        let mut header = vec!["rank".to_owned(), "plugin".into(), "sha256".into()];
        header.extend(b.workloads.iter().map(|w| format!("{} (time vs baseline)", md(w))));
        header.extend(b.workloads.iter().map(|w| format!("{} ({} vs baseline)", md(w), b.second.name())));
        header.extend(["profile".into(), "measured by".into(), "bundle".into()]);
        out.push_str(&format!("| {} |\n|{}|\n", header.join(" | "), vec![" --- "; header.len()].join("|")));
        for r in &b.rows {
            let sha = if r.reference { "-".into() } else { md_code(short(&r.sha256)) };
            let mut cells = vec![rank_cell(r), r.plugin_cell(m), sha];
            cells.extend(r.ratios.iter().zip(&r.reached).map(|(s, n)| ratio_cell(s, *n, !r.reference)));
            cells.extend(r.second.iter().map(|s| ratio_cell(s, (0, 0), false)));
            cells.push(format!("{:.2}", r.profile));
            cells.push(md(&r.measured_cell()));
            cells.push(if r.reference { "-".into() } else { bundle_cell(&r.bundle, &r.files) });
            out.push_str(&format!("| {} |\n", cells.join(" | ")));
        }
    }
    if boards.is_empty() {
        out.push_str(if bundles.is_empty() { "\nNo submission bundles were given.\n" } else { "\nNo bundle verified: none is ranked.\n" });
    }
    let apart: Vec<&Verified> = apart(bundles).collect();
    if !apart.is_empty() {
        out.push_str("\n### Not ranked\n\n");
        for v in apart {
            let plugin = plugin_of(v).map_or_else(|| "no plugin entered".to_owned(), |p| md(&p));
            let why = why_apart(v).iter().map(|w| md(w)).collect::<Vec<_>>().join("; ");
            let files = v.files.markdown();
            let files = if files.is_empty() { String::new() } else { format!("; files: {files}") };
            out.push_str(&format!("- {} ({plugin}): {why}{files}\n", md_code(&v.bundle.dir.display().to_string())));
        }
    }
    out
}

/// A bundle's folder as it was given, as text, and the links to its
/// copied files.
fn bundle_cell(dir: &Path, files: &Files) -> String {
    let links = files.markdown();
    if links.is_empty() {
        md_code(&dir.display().to_string())
    } else {
        format!("{} ({links})", md_code(&dir.display().to_string()))
    }
}

#[cfg(test)]
mod tests;
