//! `harness plugin bench`: the cost of crossing into a plugin.
//!
//! For each artifact, one hook call from the host into the plugin and back,
//! over and over: a batch policy's `next` (a record in, a record out: the
//! pure hook cost), a checkpoint policy's `decide`, and a compressor's
//! `compress` on a one-element bucket with one rank (the hook plus the host
//! calls the plugin makes).
//!
//! Two figures, neither with a timer of the bench's own around each call
//! (a second pair of clock reads would cost as much as a native hook):
//! - the distribution of the host's own per-call meter, the one every run
//!   records for its plugins (one pair of TSC reads around the hook);
//! - the mean over calls made back to back and timed as one block: the
//!   whole cost to the host per call, the meter and the host's wrapping
//!   (lending the bucket, validating the answer) included.

use std::path::{Path, PathBuf};

use anyhow::Result;
use tch::{Device, Kind as TKind, Tensor};

use super::{Kind, Plugin, PluginSet, Transport};
use crate::comm::SingleRank;
use crate::measure::{self, LatencySummary};
use crate::strategy::{BatchDecision, BatchPolicy, BucketCtx, CheckpointHistory, CheckpointPolicy, Compressor, StepTelemetry};
use crate::suite::PluginSpec;

/// One artifact's figures.
#[derive(Debug, Clone)]
pub struct Row {
    pub path: PathBuf,
    pub kind: Kind,
    pub transport: Transport,
    pub hook: &'static str,
    pub calls: u64,
    /// The host's per-call meter.
    pub latency: LatencySummary,
    /// Nanoseconds per call, back to back (not with `--evict-mb`).
    pub loop_mean_ns: Option<f64>,
}

fn spec(path: &Path) -> PluginSpec {
    PluginSpec {
        name: "bench".into(),
        path: path.to_owned(),
        sha256: None,
        version: None,
        kind: None,
        memory_mb: 64,
        deadline_ms: 10_000,
        tensor_mb: 64,
    }
}

/// Writes through a buffer before each metered call (`--evict-mb`): the
/// caches and TLBs then hold the buffer, not the plugin's code and data.
struct Evict(Vec<u64>);

impl Evict {
    fn run(&mut self, round: u64) {
        // One write per cache line; the value changes so that no pass is
        // optimised away.
        for x in self.0.iter_mut().step_by(8) {
            *x = x.wrapping_add(round);
        }
        std::hint::black_box(&self.0);
    }
}

/// Times `calls` calls of `hook` on `p` (after `calls / 10` warm-up calls):
/// back to back as one block (unless evicting), then one by one through the
/// plugin's own meter, each after `evict` when given.
fn time_hook<P>(
    p: &mut P,
    plugin: fn(&mut P) -> &mut Plugin,
    calls: u64,
    evict: &mut Option<Evict>,
    mut hook: impl FnMut(&mut P, u64) -> Result<()>,
) -> Result<(LatencySummary, Option<f64>)> {
    for i in 0..calls / 10 {
        hook(p, i)?;
    }
    let loop_mean_ns = match evict {
        Some(_) => None,
        None => {
            let t0 = measure::mark();
            for i in 0..calls {
                hook(p, i)?;
            }
            Some(measure::ns_since(t0) as f64 / calls.max(1) as f64)
        }
    };
    plugin(p).restart_timing();
    for i in 0..calls {
        if let Some(e) = evict {
            e.run(i);
        }
        hook(p, i)?;
    }
    Ok((plugin(p).timing(), loop_mean_ns))
}

/// Times `calls` hook calls into each artifact, each metered call after a
/// write through `evict_mb` MiB when that is not 0.
pub fn run(paths: &[PathBuf], calls: u64, evict_mb: usize) -> Result<Vec<Row>> {
    let mut evict = (evict_mb > 0).then(|| Evict(vec![0u64; evict_mb << 17]));
    let mut rows = Vec::new();
    for path in paths {
        let abs = std::fs::canonicalize(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let set = PluginSet::new(&[spec(&abs)], Path::new("/"));
        let m = set.check_all().remove(0).map_err(anyhow::Error::msg)?;
        let telemetry = |i: u64| StepTelemetry { step: i + 1, micro_batch: 8, accum_steps: 1, world_size: 1, ..Default::default() };
        let (hook, (latency, loop_mean_ns)) = match m.kind {
            Kind::BatchPolicy => {
                let mut p = super::PluginBatch { plugin: set.instance("bench", "batch_policy", Kind::BatchPolicy, None, Device::Cpu)? };
                p.initial(BatchDecision { micro_batch: 8, accum_steps: 1, lr_scale: 1.0 })?;
                let timed = time_hook(&mut p, |p| &mut p.plugin, calls, &mut evict, |p, i| p.next(&telemetry(i)).map(drop))?;
                ("batch-sizing.next", timed)
            }
            Kind::Compressor => {
                let plugin = set.instance("bench", "compressor", Kind::Compressor, None, Device::Cpu)?;
                let mut p = super::PluginCompressor::new(plugin, false);
                let mut comm = SingleRank::default();
                let mut bucket = Tensor::ones([1], (TKind::Float, Device::Cpu));
                let timed = time_hook(
                    &mut p,
                    |p| &mut p.plugin,
                    calls,
                    &mut evict,
                    |p, i| p.reduce(&mut bucket, &mut comm, &BucketCtx { step: i, index: 0, count: 1 }),
                )?;
                ("gradient-compression.compress", timed)
            }
            Kind::CheckpointPolicy => {
                // The plugin's own configuration is unknown here: it is
                // configured with none, and one that needs keys says so.
                let plugin = set.instance("bench", "checkpoint", Kind::CheckpointPolicy, None, Device::Cpu)?;
                let mut p = super::PluginCheckpoint { plugin };
                let h = CheckpointHistory {
                    last_cost_s: Some(1.0),
                    saved: vec![10, 20, 30],
                    failures: vec![15],
                    since_last_s: 5.0,
                    ..Default::default()
                };
                let timed = time_hook(&mut p, |p| &mut p.plugin, calls, &mut evict, |p, i| p.decide(&telemetry(i), &h).map(drop))?;
                ("checkpointing.decide", timed)
            }
        };
        rows.push(Row { path: path.clone(), kind: m.kind, transport: m.transport, hook, calls, latency, loop_mean_ns });
    }
    Ok(rows)
}

/// What the meter reads around nothing: a pair of [`measure::clock`] reads
/// (the TSC where it is invariant), recorded like a plugin call.
pub fn clock_floor(calls: u64) -> LatencySummary {
    let mut hist = measure::new_histogram();
    for _ in 0..calls {
        let t0 = measure::mark();
        measure::record_since(&mut hist, std::hint::black_box(t0));
    }
    LatencySummary::of(&hist)
}

/// The table `harness plugin bench` prints.
pub fn table(rows: &[Row]) -> String {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    t.set_header(["artifact", "transport", "hook", "calls", "p50 ns", "p90 ns", "p99 ns", "mean ns", "back to back ns"]);
    for r in rows {
        let ns = |ms: f64| format!("{:.0}", ms * 1e6);
        t.add_row([
            r.path.display().to_string(),
            match r.transport {
                Transport::Wasm => "wasm".into(),
                Transport::Native => "native".into(),
            },
            r.hook.to_string(),
            r.calls.to_string(),
            ns(r.latency.p50_ms),
            ns(r.latency.p90_ms),
            ns(r.latency.p99_ms),
            ns(r.latency.mean_ms),
            r.loop_mean_ns.map_or("-".into(), |n| format!("{n:.0}")),
        ]);
    }
    format!("{t}\n")
}
