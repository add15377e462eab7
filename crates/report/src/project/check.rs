//! `harness project --check`: every measured multi-GPU entry predicted from
//! data that excluded it (the step's compute from a one-GPU entry of the
//! same work, the collectives' bandwidth from a bench at the same world
//! size and transport, a strategy's own costs from another entry of the
//! same strategy, the slowdown beside collectives fitted on the other
//! overlapped entries), and the error against what was measured.

use super::calibrate::{
    entry_cluster, measured_step, network, pick_bench, plain, run_cluster, same_artifact, same_gradients, same_strategy, same_work, Bench,
    Compute, OwnCost, Profile, Source,
};
use super::cluster::Cluster;
use super::model::{predict, step, Prediction, Slowdown};

/// What a checked entry's strategy was calibrated on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basis {
    /// The plain all-reduce: its buckets' sizes (structure) alone.
    Buckets,
    /// Another multi-GPU entry of the same strategy: its costs beside its
    /// collectives.
    OtherEntry,
    /// A compressor's own cost from a one-GPU entry of it, and the sizes of
    /// the checked entry's own collectives (structure, not timing).
    OneGpu,
}

impl Basis {
    /// The short label the check's table prints.
    pub fn label(self) -> &'static str {
        match self {
            Basis::Buckets => "buckets",
            Basis::OtherEntry => "other multi-GPU entry",
            Basis::OneGpu => "1-GPU cost + sizes",
        }
    }
}

/// One checked entry.
#[derive(Debug, Clone)]
pub struct CheckRow {
    /// `file#entry`.
    pub target: String,
    pub world: usize,
    pub strategy: String,
    /// How its ranks were connected: `nvlink`, `network`, an emulated link.
    pub setting: String,
    /// Measured tokens/s.
    pub measured: f64,
    pub predicted: Prediction,
    /// (predicted - measured) / measured.
    pub error: f64,
    /// Where each input came from.
    pub compute_from: String,
    pub bench_from: String,
    pub profile_from: String,
    /// What the strategy's costs were calibrated on.
    pub basis: Basis,
    pub slowdown: Slowdown,
}

/// The check: its rows and the entries it could not predict, with why.
#[derive(Debug, Clone, Default)]
pub struct Check {
    pub rows: Vec<CheckRow>,
    pub skipped: Vec<String>,
}

/// What one target is predicted from.
struct Plan<'a> {
    target: String,
    strategy: String,
    setting: String,
    measured_step: f64,
    measured: f64,
    compute: Compute,
    bench: &'a Bench,
    profile: Profile,
    basis: Basis,
    cluster: Cluster,
    overlap: bool,
}

fn pick_compute(sources: &[Source], src: &Source, m: &harness_format::results::Metrics) -> Option<Compute> {
    let mut found: Vec<(bool, Compute)> = Vec::new();
    for s in sources {
        for (e, one) in s.ok() {
            if one.world_size == 1 && same_work(one, m) {
                if let Some(c) = Compute::of(s, e, one) {
                    found.push((s.revision() == src.revision(), c));
                }
            }
        }
    }
    // The same build first.
    found.sort_by_key(|(same, _)| !*same);
    found.into_iter().next().map(|(_, c)| c)
}

/// Plans every multi-GPU entry of `sources`, or says why not. `own`: an
/// entry may take the bandwidth it measured in training itself (a
/// projection's calibration; never under `--check`).
fn plans<'a>(sources: &[Source], benches: &'a [Bench], own: bool) -> (Vec<Plan<'a>>, Vec<String>) {
    let (mut plans, mut skipped) = (Vec::new(), Vec::new());
    for src in sources {
        for (e, m) in src.ok() {
            let n = m.world_size as usize;
            let (Some(strategy), true) = (src.strategy(e), n > 1) else { continue };
            let target = src.name(e);
            let Some(compute) = pick_compute(sources, src, m) else {
                skipped.push(format!("{target}: no one-GPU entry of the same work"));
                continue;
            };
            let net = network(strategy);
            let bytes: u64 = m.bucket_bytes.iter().sum();
            let Some(bench) = pick_bench(benches, src, n, net, bytes, (!own).then_some(e)) else {
                let kind = if net { "network" } else { "nvlink" };
                skipped.push(format!("{target}: no {kind} all-reduce bench at {n} GPUs"));
                continue;
            };
            let mut profiles = Vec::new();
            if plain(strategy) {
                // The bucket layout is the configuration (model and bucket
                // size), not a timing.
                profiles.push((Profile::all_reduce(&strategy.name, &m.bucket_bytes, format!("{target} (bucket sizes)")), Basis::Buckets));
            } else {
                match held_out(sources, benches, src, e, m, strategy) {
                    Some(p) => profiles.push((p, Basis::OtherEntry)),
                    None => skipped.push(format!("{target}: no other entry of strategy {} to take its costs from", strategy.name)),
                }
                // Beside it, the compressor's own cost from one GPU and the
                // sizes of this entry's collectives.
                if let Some(p) = one_gpu_cost(sources, m, strategy).and_then(|c| Profile::of_one_gpu(src, e, m, &c)) {
                    profiles.push((p, Basis::OneGpu));
                }
            }
            let (cluster, setting) = run_cluster(strategy, n, bench.gbps());
            for (profile, basis) in profiles {
                plans.push(Plan {
                    target: target.clone(),
                    strategy: strategy.name.clone(),
                    setting: setting.clone(),
                    measured_step: measured_step(m),
                    measured: m.tokens_per_s,
                    compute: compute.clone(),
                    bench,
                    profile,
                    basis,
                    cluster: cluster.clone(),
                    overlap: m.overlapped_reduction,
                });
            }
        }
    }
    (plans, skipped)
}

/// Another entry of the same strategy and work: from another file first.
fn held_out(
    sources: &[Source],
    benches: &[Bench],
    src: &Source,
    e: &harness_format::results::EntryResult,
    m: &harness_format::results::Metrics,
    s: &harness_format::suite::Strategy,
) -> Option<Profile> {
    let mut found: Vec<(bool, Profile)> = Vec::new();
    for other in sources {
        for (oe, om) in other.ok() {
            let same_entry = std::ptr::eq(other, src) && oe.id == e.id;
            let Some(os) = other.strategy(oe) else { continue };
            if same_entry || om.world_size < 2 || !same_work(om, m) || !same_strategy(os, s) || os.name != s.name {
                continue;
            }
            let Some(ran_on) = entry_cluster(benches, other, oe, om) else { continue };
            if let Some(p) = Profile::of(other, oe, om, &ran_on) {
                found.push((std::ptr::eq(other, src), p));
            }
        }
    }
    found.sort_by_key(|(same_file, _)| *same_file);
    found.into_iter().next().map(|(_, p)| p)
}

/// A compressor's own cost from a one-GPU entry of the same strategy (the
/// same compressor, configuration and artifact) on the same gradients.
pub fn one_gpu_cost(sources: &[Source], m: &harness_format::results::Metrics, s: &harness_format::suite::Strategy) -> Option<OwnCost> {
    sources.iter().find_map(|other| {
        other.ok().find_map(|(oe, om)| {
            let os = other.strategy(oe)?;
            let same = om.world_size == 1 && same_gradients(om, m) && same_strategy(os, s) && os.name == s.name && same_artifact(om, m);
            same.then(|| OwnCost::of(other, oe, om)).flatten()
        })
    })
}

/// The slowdown each overlapped plan's measurement implies: the step it
/// missed without one, over the collective time beside its backward pass.
fn implied_slowdown(p: &Plan) -> Option<f64> {
    if !p.overlap || !p.profile.plain {
        return None;
    }
    let zero = step(&p.compute, &p.profile, &p.cluster, 0.0, true);
    (zero.overlapped > 0.0).then(|| (p.measured_step - zero.step) / zero.overlapped)
}

/// The slowdowns the overlapped multi-GPU entries of `sources` imply, for
/// a projection's calibration.
pub fn slowdowns(sources: &[Source], benches: &[Bench]) -> Vec<f64> {
    plans(sources, benches, true).0.iter().filter_map(implied_slowdown).collect()
}

/// Predicts every multi-GPU entry of `sources` from data that excluded it.
pub fn check(sources: &[Source], benches: &[Bench]) -> Check {
    let (plans, skipped) = plans(sources, benches, false);
    let implied: Vec<Option<f64>> = plans.iter().map(implied_slowdown).collect();
    let rows = plans
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let others: Vec<f64> = implied.iter().enumerate().filter(|(j, _)| *j != i).filter_map(|(_, s)| *s).collect();
            let slowdown = Slowdown::of(&others);
            let predicted = predict(&p.compute, &p.profile, &p.cluster, slowdown, p.overlap);
            CheckRow {
                target: p.target.clone(),
                world: p.cluster.world(),
                strategy: p.strategy.clone(),
                setting: p.setting.clone(),
                measured: p.measured,
                error: (predicted.tokens_per_s - p.measured) / p.measured,
                predicted,
                compute_from: p.compute.from.clone(),
                bench_from: p.bench.name(),
                profile_from: p.profile.from.clone(),
                basis: p.basis,
                slowdown,
            }
        })
        .collect();
    Check { rows, skipped }
}
