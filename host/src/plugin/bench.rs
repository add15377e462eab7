//! `harness plugin bench`: the cost of crossing into a plugin.
//!
//! For each artifact, the round trip of one hook call from the host into the
//! plugin and back, timed call by call into an HDR histogram: a batch
//! policy's `next` (a record in, a record out: the pure hook cost), and a
//! compressor's `compress` on a one-element bucket with one rank (the hook
//! plus the host calls the plugin makes).

use std::path::{Path, PathBuf};

use anyhow::Result;
use tch::{Device, Kind as TKind, Tensor};

use super::{Kind, PluginSet, Transport};
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
    pub latency: LatencySummary,
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

/// Writes through a buffer before each timed call (`--evict-mb`): the
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

/// Times `calls` hook calls into each artifact (after `calls / 10` warm-up
/// calls), each after writing through `evict_mb` MiB when that is not 0.
pub fn run(paths: &[PathBuf], calls: u64, evict_mb: usize) -> Result<Vec<Row>> {
    let mut evict = (evict_mb > 0).then(|| Evict(vec![0u64; evict_mb << 17]));
    let mut before = |i: u64| {
        if let Some(e) = &mut evict {
            e.run(i);
        }
    };
    let mut rows = Vec::new();
    for path in paths {
        let abs = std::fs::canonicalize(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let set = PluginSet::new(&[spec(&abs)], Path::new("/"));
        let m = set.check_all().remove(0).map_err(anyhow::Error::msg)?;
        let mut hist = measure::new_histogram();
        let hook = match m.kind {
            Kind::BatchPolicy => {
                let mut p = super::PluginBatch { plugin: set.instance("bench", "batch_policy", Kind::BatchPolicy, None, Device::Cpu)? };
                p.initial(BatchDecision { micro_batch: 8, accum_steps: 1, lr_scale: 1.0 })?;
                let mut t = StepTelemetry { micro_batch: 8, accum_steps: 1, world_size: 1, ..Default::default() };
                for i in 0..calls + calls / 10 {
                    t.step = i + 1;
                    before(i);
                    let t0 = measure::mark();
                    std::hint::black_box(p.next(&t)?);
                    if i >= calls / 10 {
                        measure::record_since(&mut hist, t0);
                    }
                }
                "batch-sizing.next"
            }
            Kind::Compressor => {
                let plugin = set.instance("bench", "compressor", Kind::Compressor, None, Device::Cpu)?;
                let mut p = super::PluginCompressor::new(plugin, false);
                let mut comm = SingleRank::default();
                let mut bucket = Tensor::ones([1], (TKind::Float, Device::Cpu));
                for i in 0..calls + calls / 10 {
                    let ctx = BucketCtx { step: i, index: 0, count: 1 };
                    before(i);
                    let t0 = measure::mark();
                    p.reduce(&mut bucket, &mut comm, &ctx)?;
                    if i >= calls / 10 {
                        measure::record_since(&mut hist, t0);
                    }
                }
                "gradient-compression.compress"
            }
            Kind::CheckpointPolicy => {
                // The plugin's own configuration is unknown here: it is
                // configured with none, and one that needs keys says so.
                let plugin = set.instance("bench", "checkpoint", Kind::CheckpointPolicy, None, Device::Cpu)?;
                let mut p = super::PluginCheckpoint { plugin };
                let mut t = StepTelemetry { micro_batch: 8, accum_steps: 1, world_size: 1, ..Default::default() };
                let h = CheckpointHistory { last_cost_s: Some(1.0), saved: vec![10, 20, 30], failures: vec![15], since_last_s: 5.0 };
                for i in 0..calls + calls / 10 {
                    t.step = i + 1;
                    before(i);
                    let t0 = measure::mark();
                    std::hint::black_box(p.decide(&t, &h)?);
                    if i >= calls / 10 {
                        measure::record_since(&mut hist, t0);
                    }
                }
                "checkpointing.decide"
            }
        };
        rows.push(Row { path: path.clone(), kind: m.kind, transport: m.transport, hook, calls, latency: LatencySummary::of(&hist) });
    }
    Ok(rows)
}

/// The floor of the figures: an empty region timed like a call (with
/// [`measure::clock`], the TSC where it is invariant).
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
    t.set_header(["artifact", "transport", "hook", "calls", "p50 ns", "p90 ns", "p99 ns", "mean ns"]);
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
        ]);
    }
    format!("{t}\n")
}
