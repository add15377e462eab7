//! `harness project`: each workload's strategies projected on clusters,
//! calibrated on the given result files and bench records.

use super::calibrate::{
    entry_cluster, plain, same_artifact, same_gradients, same_strategy, same_work, scales_with_bucket_bytes, Bench, Compute, OwnCost,
    Profile, Source,
};
use super::check::slowdowns;
use super::cluster::Cluster;
use super::model::{break_even, predict, Prediction, Slowdown};

/// One strategy of one workload on one cluster.
#[derive(Debug, Clone)]
pub struct Row {
    pub workload: String,
    pub strategy: String,
    pub cluster: Cluster,
    pub prediction: Prediction,
    /// Seconds of training to the suite's target on this cluster, where
    /// the strategy's entry measured its steps to it at this world size
    /// (`Profile::to_target`): (predicted, low, high), with where the
    /// steps came from.
    pub time_to_target: Option<((f64, f64, f64), String)>,
}

/// A compressor's break-even bandwidth against the all-reduce on a cluster.
#[derive(Debug, Clone)]
pub struct BreakEven {
    pub workload: String,
    pub strategy: String,
    pub cluster: Cluster,
    /// See [`break_even`].
    pub gbps: Result<Option<f64>, ()>,
}

/// A projection, with what it was calibrated on.
#[derive(Debug, Clone)]
pub struct Projection {
    pub rows: Vec<Row>,
    pub break_even: Vec<BreakEven>,
    pub slowdown: Slowdown,
    /// How many entries the slowdown was fitted on.
    pub slowdown_fits: usize,
    /// Per workload: the measured bandwidth inside a node, Gbit/s, and
    /// where it came from.
    pub intra: Vec<(String, f64, String)>,
    /// One line per workload: its one-GPU step and where its inputs came from.
    pub calibration: Vec<String>,
    pub skipped: Vec<String>,
}

/// One workload: its one-GPU compute and the strategies measured on it.
struct Workload {
    name: String,
    compute: Compute,
    profiles: Vec<Profile>,
    /// What the projection says of how it was calibrated beyond its inputs.
    notes: Vec<String>,
}

fn workloads(sources: &[Source], benches: &[Bench]) -> (Vec<Workload>, Vec<String>) {
    let mut out: Vec<(Workload, harness_format::results::Metrics)> = Vec::new();
    let mut skipped = Vec::new();
    for src in sources {
        for (e, m) in src.ok() {
            // The step's compute from the plain all-reduce on one GPU (a
            // compressor's one-GPU entry gives its own cost, below).
            let plain_one = src.strategy(e).is_none_or(plain);
            if m.world_size != 1 || !plain_one || out.iter().any(|(_, w)| same_work(w, m)) {
                continue;
            }
            if let Some(compute) = Compute::of(src, e, m) {
                out.push((Workload { name: e.workload.clone(), compute, profiles: Vec::new(), notes: Vec::new() }, m.clone()));
            }
        }
    }
    for src in sources {
        for (e, m) in src.ok() {
            let Some(s) = src.strategy(e) else { continue };
            if m.world_size < 2 {
                continue;
            }
            let Some((w, _)) = out.iter_mut().find(|(_, one)| same_work(one, m)) else {
                skipped.push(format!("{}: no one-GPU entry of the same work", src.name(e)));
                continue;
            };
            // One all-reduce per workload; each other strategy once, first
            // where it ran on the machine's own links.
            let key = if plain(s) { "allreduce".to_string() } else { s.name.clone() };
            if let Some(i) = w.profiles.iter().position(|p| p.name == key) {
                if !(w.profiles[i].from.ends_with(" (link)") && s.link.is_none()) {
                    continue;
                }
                w.profiles.remove(i);
            }
            let Some(ran_on) = entry_cluster(benches, src, e, m) else {
                skipped.push(format!("{}: no all-reduce bench at its world size and transport", src.name(e)));
                continue;
            };
            if let Some(mut p) = Profile::of(src, e, m, &ran_on) {
                p.name = key;
                if s.link.is_some() {
                    p.from.push_str(" (link)");
                }
                w.profiles.push(p);
            }
        }
    }
    // Only workloads with a multi-GPU entry give rows: those are told apart.
    let rowed = || out.iter().filter(|(w, _)| !w.profiles.is_empty()).map(|(o, om)| (&o.name, om));
    let labels: Vec<String> =
        out.iter().map(|(w, m)| if w.profiles.is_empty() { w.name.clone() } else { work_label(&w.name, m, rowed()) }).collect();
    for ((w, _), label) in out.iter_mut().zip(labels) {
        w.name = label;
    }
    for (w, one) in &mut out {
        if !w.profiles.is_empty() {
            from_one_gpu(sources, benches, w, one, &mut skipped);
        }
    }
    let mut ws: Vec<Workload> = out.into_iter().map(|(w, _)| w).collect();
    for w in &mut ws {
        w.profiles.sort_by_key(|p| !p.plain);
    }
    (ws, skipped)
}

/// A workload's name in the output: its suite name, and where another
/// workload of the same name did other work (an older build's kernels,
/// another batch), what this one's work is, so that their rows never mix.
fn work_label<'a>(
    name: &str,
    m: &harness_format::results::Metrics,
    all: impl Iterator<Item = (&'a String, &'a harness_format::results::Metrics)>,
) -> String {
    let others: Vec<&harness_format::results::Metrics> =
        all.filter(|(n, o)| n.as_str() == name && !same_work(o, m)).map(|(_, o)| o).collect();
    if others.is_empty() {
        return name.to_string();
    }
    let mut parts = Vec::new();
    let batch = |x: &harness_format::results::Metrics| x.batch_changes.first().map(|c| (c.1, c.2));
    if others.iter().any(|o| batch(o) != batch(m)) {
        if let Some((b, acc)) = batch(m) {
            parts.push(if acc > 1 { format!("batch {b}x{acc}") } else { format!("batch {b}") });
        }
    }
    if others.iter().any(|o| o.fused_cross_entropy != m.fused_cross_entropy) {
        parts.push(if m.fused_cross_entropy { "fused CE" } else { "unfused CE" }.to_string());
    }
    if others.iter().any(|o| o.fused_layer_norm != m.fused_layer_norm) {
        parts.push(if m.fused_layer_norm { "fused LN" } else { "unfused LN" }.to_string());
    }
    if others.iter().any(|o| o.model != m.model || o.precision != m.precision) {
        parts.push(format!("{} parameters", m.parameters));
    }
    format!("{name} ({})", parts.join(", "))
}

/// The compressors that ran on one GPU on a workload's gradients and on no
/// multi-GPU entry of it: its own cost from that one-GPU entry, its
/// messages from a multi-GPU entry of the same compressor (configuration
/// and artifact) on another workload, scaled per bucket to this one's
/// gradients, where the method's payload is a fixed share of a bucket's
/// bytes; otherwise left out, with why.
fn from_one_gpu(
    sources: &[Source],
    benches: &[Bench],
    w: &mut Workload,
    one: &harness_format::results::Metrics,
    skipped: &mut Vec<String>,
) {
    let bytes: u64 = w.profiles.iter().find(|p| p.plain).or(w.profiles.first()).map_or(0, |p| p.buckets.iter().sum());
    for src in sources {
        for (e, m) in src.ok() {
            let Some(s) = src.strategy(e) else { continue };
            if m.world_size != 1 || !same_gradients(m, one) || w.profiles.iter().any(|p| p.name == s.name) {
                continue;
            }
            let Some(cost) = OwnCost::of(src, e, m) else { continue };
            let what = format!("{}: {} (own cost on one GPU from {})", w.name, s.name, cost.from);
            // Every multi-GPU entry of the same compressor, on any workload.
            let elsewhere: Vec<(&Source, &harness_format::results::EntryResult, &harness_format::results::Metrics)> = sources
                .iter()
                .flat_map(|o| o.ok().map(move |(oe, om)| (o, oe, om)))
                .filter(|(o, oe, om)| {
                    om.world_size >= 2 && o.strategy(oe).is_some_and(|os| same_strategy(os, s) && os.name == s.name) && same_artifact(om, m)
                })
                .collect();
            let Some(&(o, oe, om)) = elsewhere.first() else {
                let shape = if scales_with_bucket_bytes(s).is_none() {
                    " (and they are not a fixed share of a bucket's bytes: no other compressor's would stand for them)"
                } else {
                    ""
                };
                skipped.push(format!("{what}: no multi-GPU entry of it, on any workload, recorded its messages{shape}: left out"));
                continue;
            };
            let Some(why) = scales_with_bucket_bytes(s) else {
                skipped.push(format!(
                    "{what}: its messages were recorded only on another workload ({}), and they are not a fixed share of a bucket's bytes: left out",
                    o.name(oe)
                ));
                continue;
            };
            let Some(ran_on) = entry_cluster(benches, o, oe, om) else {
                skipped.push(format!("{what}: no all-reduce bench for {}: left out", o.name(oe)));
                continue;
            };
            // As many buckets as the plugin was called on a step where its
            // cost was measured.
            let buckets = cost.buckets.unwrap_or(w.profiles[0].buckets.len());
            let Some(measured) = Profile::of(o, oe, om, &ran_on) else { continue };
            let mut p = measured.scaled(bytes, buckets, &cost);
            p.name = s.name.clone();
            w.notes.push(format!(
                "{}: {} scaled its messages from {} per bucket to {buckets} buckets of {:.2} GB a step ({why}: payload proportional to the bucket's bytes)",
                w.name,
                s.name,
                o.name(oe),
                bytes as f64 / 1e9
            ));
            w.profiles.push(p);
        }
    }
}

/// The bench a workload's clusters take the bandwidth inside a node from
/// (`nvlink=measured`): a bench record before a bandwidth measured in
/// training, of the workload's own buckets, at the largest world size.
fn intra_bench<'a>(benches: &'a [Bench], w: &Workload) -> Option<&'a Bench> {
    let bytes: u64 = w.profiles.first().map_or(0, |p| p.buckets.iter().sum());
    benches.iter().filter(|b| !b.network).max_by_key(|b| (b.entry.is_none(), b.record.buckets.bytes == bytes, b.world()))
}

/// Projects every workload with a one-GPU entry and a multi-GPU one in
/// `sources` on each cluster. `slowdown` overrides the calibrated one;
/// `only`, when not empty, names the strategies to project (`allreduce`
/// for the plain all-reduce whatever its name).
pub fn project(
    sources: &[Source],
    benches: &[Bench],
    clusters: &[Cluster],
    slowdown: Option<f64>,
    only: &[String],
) -> anyhow::Result<Projection> {
    let (mut ws, mut skipped) = workloads(sources, benches);
    if !only.is_empty() {
        for name in only {
            if !ws.iter().any(|w| w.profiles.iter().any(|p| &p.name == name)) {
                skipped.push(format!("strategy {name}: measured on no workload of the inputs"));
            }
        }
        for w in &mut ws {
            w.profiles.retain(|p| only.contains(&p.name));
        }
    }
    anyhow::ensure!(
        ws.iter().any(|w| !w.profiles.is_empty()),
        "nothing to project: the inputs need a one-GPU entry and a multi-GPU entry (for the gradient buckets) of the same work{}",
        if only.is_empty() { "" } else { ", of the strategies named" }
    );
    let fits = slowdowns(sources, benches);
    let slowdown = match slowdown {
        Some(s) => Slowdown { lo: s, mid: s, hi: s },
        None => Slowdown::of(&fits),
    };
    let mut rows = Vec::new();
    let mut be = Vec::new();
    let mut calibration = Vec::new();
    let mut intra = Vec::new();
    for w in &ws {
        if w.profiles.is_empty() {
            skipped.push(format!(
                "{} (one GPU: {}): no multi-GPU entry of the same work (model, precision, batch, kernels) to take the gradient buckets from",
                w.name, w.compute.from
            ));
            continue;
        }
        let bench = intra_bench(benches, w);
        if clusters.iter().any(|c| c.intra_gbps.is_none()) && bench.is_none() {
            anyhow::bail!(
                "a cluster takes the measured bandwidth inside a node (`nvlink=measured`, the default), and no --bench record was given"
            );
        }
        if let Some(b) = bench {
            intra.push((w.name.clone(), b.gbps(), b.name()));
        }
        calibration.push(format!(
            "{}: one-GPU step {:.2} ms (forward {:.2}, backward {:.2}, optimizer {:.2}) from {}; strategies from {}",
            w.name,
            w.compute.step * 1e3,
            w.compute.forward * 1e3,
            w.compute.backward * 1e3,
            w.compute.optimizer * 1e3,
            w.compute.from,
            w.profiles.iter().map(|p| p.from.as_str()).collect::<Vec<_>>().join(", ")
        ));
        calibration.extend(w.notes.iter().cloned());
        for c in clusters {
            let c = c.with_measured_intra(bench.map_or(0.0, |b| b.gbps()));
            for p in &w.profiles {
                let prediction = predict(&w.compute, p, &c, slowdown, p.plain);
                let time_to_target = p.to_target.as_ref().filter(|t| t.world == c.world()).map(|t| {
                    let steps = t.steps as f64;
                    ((steps * prediction.step, steps * prediction.lo, steps * prediction.hi), format!("{} steps, {}", t.steps, t.from))
                });
                rows.push(Row { workload: w.name.clone(), strategy: p.name.clone(), cluster: c.clone(), prediction, time_to_target });
            }
            let Some(ar) = w.profiles.iter().find(|p| p.plain) else { continue };
            for q in w.profiles.iter().filter(|q| !q.plain && q.zero == 0) {
                be.push(BreakEven {
                    workload: w.name.clone(),
                    strategy: q.name.clone(),
                    cluster: c.clone(),
                    gbps: break_even(&w.compute, ar, q, &c, slowdown.mid),
                });
            }
        }
    }
    Ok(Projection { rows, break_even: be, slowdown, slowdown_fits: fits.len(), intra, calibration, skipped })
}
