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
use crate::strategy::{BatchDecision, BatchPolicy, BucketCtx, CheckpointHistory, CheckpointPolicy, Compressor, StepTelemetry};
use harness_format::suite::PluginSpec;
use harness_runtime::comm::SingleRank;
use harness_runtime::measure::{self, LatencySummary};

/// One artifact's figures, or why it has none.
#[derive(Debug, Clone)]
pub struct Row {
    pub path: PathBuf,
    pub timed: Result<Timed, String>,
}

/// The figures of an artifact whose hook was timed.
#[derive(Debug, Clone)]
pub struct Timed {
    pub kind: Kind,
    pub transport: Transport,
    pub hook: &'static str,
    pub calls: u64,
    /// The host's per-call meter.
    pub latency: LatencySummary,
    /// Nanoseconds per call, back to back (not with `--evict-mb`).
    pub loop_mean_ns: Option<f64>,
}

fn spec(path: &Path, name: String) -> PluginSpec {
    PluginSpec { name, path: path.to_owned(), sha256: None, version: None, kind: None, memory_mb: 64, deadline_ms: 10_000, tensor_mb: 64 }
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

/// How many calls to time per artifact.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Calls {
    /// Exactly this many (`--calls N`).
    Exactly(u64),
    /// As many as take about [`AUTO_SECONDS`] per way of timing, measured
    /// on the warm-up calls, within [`AUTO_MIN_CALLS`]..=[`AUTO_MAX_CALLS`]:
    /// a slow hook is timed on fewer calls, and the bench ends in seconds
    /// whatever the plugins cost.
    Auto,
}

/// [`Calls::Auto`]: seconds of calls per way of timing (back to back, then
/// metered one by one).
pub const AUTO_SECONDS: f64 = 0.5;
/// [`Calls::Auto`]: the fewest calls timed, however slow the hook.
pub const AUTO_MIN_CALLS: u64 = 100;
/// [`Calls::Auto`]: the most calls timed, however fast the hook.
pub const AUTO_MAX_CALLS: u64 = 200_000;

/// What the bench is doing, for a progress display.
#[derive(Debug, Clone, Copy)]
pub enum Stage<'a> {
    /// Loading (and, for a component, compiling) an artifact.
    Loading(&'a Path),
    /// Timing this many calls of the artifact's hook.
    Timing(&'a Path, u64),
    /// Done with the artifact.
    Done(&'a Path),
}

/// Warms `hook` up and settles how many calls to time: `calls / 10`
/// warm-up calls for [`Calls::Exactly`]; for [`Calls::Auto`], warm-up calls
/// for a fifth of [`AUTO_SECONDS`] (each after `evict` when given, as the
/// metered calls will be), and the count that fills [`AUTO_SECONDS`] at
/// their pace.
fn warm_up<P>(p: &mut P, calls: Calls, evict: &mut Option<Evict>, hook: &mut impl FnMut(&mut P, u64) -> Result<()>) -> Result<u64> {
    let n = match calls {
        Calls::Exactly(n) => {
            for i in 0..n / 10 {
                hook(p, i)?;
            }
            return Ok(n);
        }
        Calls::Auto => {
            let t0 = std::time::Instant::now();
            let mut n = 0u64;
            while n < 10 || t0.elapsed().as_secs_f64() < AUTO_SECONDS / 5.0 {
                if let Some(e) = evict {
                    e.run(n);
                }
                hook(p, n)?;
                n += 1;
            }
            let per_call = t0.elapsed().as_secs_f64() / n as f64;
            (AUTO_SECONDS / per_call) as u64
        }
    };
    Ok(n.clamp(AUTO_MIN_CALLS, AUTO_MAX_CALLS))
}

/// Times calls of `hook` on `p` (after warm-up calls, [`warm_up`]): back
/// to back as one block (unless evicting), then one by one through the
/// plugin's own meter, each after `evict` when given. Returns the figures
/// and the number of calls each way.
fn time_hook<P>(
    p: &mut P,
    plugin: fn(&mut P) -> &mut Plugin,
    calls: Calls,
    evict: &mut Option<Evict>,
    mut hook: impl FnMut(&mut P, u64) -> Result<()>,
    timing: &mut dyn FnMut(u64),
) -> Result<(LatencySummary, Option<f64>, u64)> {
    let calls = warm_up(p, calls, evict, &mut hook)?;
    timing(calls);
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
    Ok((plugin(p).timing(), loop_mean_ns, calls))
}

/// Times hook calls into each artifact, each metered call after a write
/// through `evict_mb` MiB when that is not 0; `stage` hears what it is
/// doing. Each artifact is timed on its own: one that cannot be loaded,
/// fails a call or panics gets a row with its error, and the others are
/// timed all the same.
pub fn run(paths: &[PathBuf], calls: Calls, evict_mb: usize, stage: &mut dyn FnMut(Stage<'_>)) -> Vec<Row> {
    let mut evict = (evict_mb > 0).then(|| Evict(vec![0u64; evict_mb << 17]));
    let mut rows = Vec::new();
    for path in paths {
        stage(Stage::Loading(path));
        let timing = &mut |n: u64| stage(Stage::Timing(path, n));
        // A panic of the host's own while timing (a native plugin's is
        // caught at its C boundary) fails this artifact, not the bench.
        let timed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| time_artifact(path, calls, &mut evict, timing)))
            .unwrap_or_else(|p| {
                let msg = p.downcast_ref::<String>().map(String::as_str).or_else(|| p.downcast_ref::<&str>().copied());
                Err(anyhow::anyhow!("harness panicked timing it: {}", msg.unwrap_or("(no message)")))
            });
        rows.push(Row { path: path.clone(), timed: timed.map_err(|e| super::first_line(&format!("{e:#}"))) });
        stage(Stage::Done(path));
    }
    rows
}

/// Loads the artifact at `path` and times its hook.
fn time_artifact(path: &Path, calls: Calls, evict: &mut Option<Evict>, timing: &mut dyn FnMut(u64)) -> Result<Timed> {
    let abs = std::fs::canonicalize(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let name = super::artifact_name(path);
    let set = PluginSet::new(&[spec(&abs, name.clone())], Path::new("/"));
    let m = set.check_all().remove(0).map_err(anyhow::Error::msg)?;
    let telemetry = |i: u64| StepTelemetry { step: i + 1, micro_batch: 8, accum_steps: 1, world_size: 1, ..Default::default() };
    let (hook, (latency, loop_mean_ns, calls)) = match m.kind {
        Kind::BatchPolicy => {
            let mut p = super::PluginBatch { plugin: set.instance(&name, "batch_policy", Kind::BatchPolicy, None, Device::Cpu)? };
            p.initial(BatchDecision { micro_batch: 8, accum_steps: 1, lr_scale: 1.0 })?;
            let timed = time_hook(&mut p, |p| &mut p.plugin, calls, evict, |p, i| p.next(&telemetry(i)).map(drop), timing)?;
            ("batch-sizing.next", timed)
        }
        Kind::Compressor => {
            let plugin = set.instance(&name, "compressor", Kind::Compressor, None, Device::Cpu)?;
            let mut p = super::PluginCompressor::new(plugin, false);
            p.setup(&[crate::strategy::BucketLayout::packed([("bias", &[1i64][..])], TKind::Float)])?;
            let mut comm = SingleRank::default();
            let mut bucket = Tensor::ones([1], (TKind::Float, Device::Cpu));
            let timed = time_hook(
                &mut p,
                |p| &mut p.plugin,
                calls,
                evict,
                |p, i| p.reduce(&mut bucket, &mut comm, &BucketCtx { step: i, index: 0, count: 1 }),
                timing,
            )?;
            ("gradient-compression.compress", timed)
        }
        Kind::CheckpointPolicy => {
            // The plugin's own configuration is unknown here: it is
            // configured with none, and one that needs keys says so.
            let plugin = set.instance(&name, "checkpoint", Kind::CheckpointPolicy, None, Device::Cpu)?;
            let mut p = super::PluginCheckpoint { plugin };
            let h = CheckpointHistory {
                last_cost_s: Some(1.0),
                saved: vec![10, 20, 30],
                failures: vec![15],
                since_last_s: 5.0,
                ..Default::default()
            };
            let timed = time_hook(&mut p, |p| &mut p.plugin, calls, evict, |p, i| p.decide(&telemetry(i), &h).map(drop), timing)?;
            ("checkpointing.decide", timed)
        }
    };
    Ok(Timed { kind: m.kind, transport: m.transport, hook, calls, latency, loop_mean_ns })
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

/// The table `harness plugin bench` prints: a row per artifact (one that
/// failed marked so), then a line per artifact that failed, naming it by
/// its file name, with the first line of its error.
pub fn table(rows: &[Row]) -> String {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    t.set_header(["artifact", "transport", "hook", "calls", "p50 ns", "p90 ns", "p99 ns", "mean ns", "back to back ns"]);
    let mut failed = String::new();
    for row in rows {
        let artifact = row.path.display().to_string();
        let r = match &row.timed {
            Ok(r) => r,
            Err(e) => {
                failed += &format!("FAILED {}: {e}\n", super::artifact_name(&row.path));
                t.add_row([artifact.as_str(), "-", "FAILED (below)", "-", "-", "-", "-", "-", "-"]);
                continue;
            }
        };
        let ns = |ms: f64| format!("{:.0}", ms * 1e6);
        t.add_row([
            artifact,
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
    format!("{t}\n{failed}")
}
