//! The training core: one entry's model, data, optimizer and step loop.
//!
//! [`run_entry`] is the order of a step and nothing else; each concern has
//! its own part:
//! - [`training`]: what trains ([`training::Training`]: model, parameters,
//!   data, data parallel, optimizer, scaler, strategies, precision), set up
//!   by [`training::setup`], stepped by [`training::step`] (data ->
//!   forward -> backward (x grad_accum) -> communicate (the compressor) ->
//!   optimizer, with the data-parallel protocol inside), replayed as a CUDA
//!   graph by [`training::graph`] and measured by [`training::record`];
//! - [`models`]: the model families (a module each, with the layers they
//!   share and harness's fused layers) and [`data`]: their data, whose best
//!   reachable loss is known;
//! - [`dp`]: gradient buckets, ZeRO, and [`optim`]: AdamW, SGD, loss scaling;
//! - [`oom`]: out-of-memory detection and the retry of a step;
//! - [`batch`]: the batch in force, as the batch policy decides it;
//! - [`resilience`]: checkpoints, injected failures and restores;
//! - [`checkpoint`] and [`tiers`]: the checkpoint files and their tiers;
//! - [`replicas`]: the data-parallel replicas compared.
//!
//! The loss of step k is read from the device after step k+1 is enqueued,
//! so the host never waits on a step it has just launched; evaluation
//! pauses the training clock.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod batch;
pub mod checkpoint;
pub mod data;
pub mod dp;
mod entry;
mod gate;
pub mod models;
pub mod oom;
pub mod optim;
pub mod replicas;
pub mod resilience;
mod stale;
pub mod tiers;
pub mod training;

use anyhow::Context;
use std::path::Path;
use std::time::Duration;

use tch::Device;

use batch::Batch;
pub use entry::{EntryContext, EntryOutput, Progress};
use harness_format::error::EntryError;
use harness_format::suite::Workload;
use harness_runtime::comm::{any_rank, Collective};
use harness_sandbox::strategy::BatchDecision;
use optim::learning_rate;
use replicas::ReplicaCheck;
use resilience::Resilience;
use training::record::{self, Meter, Outcome};
use training::{Stepped, Training};

/// Trains one entry to the end and measures it.
///
/// Gradient mode is thread-local state of libtorch that `tch::no_grad`
/// restores only when its closure returns: a panic inside one (a failed
/// plugin op, a libtorch error) would leave autograd off for every later
/// entry of this thread. Each entry therefore runs with it switched on.
pub fn run_entry(
    ctx: &EntryContext<'_>,
    comm: &mut dyn Collective,
    progress: &mut dyn FnMut(&Progress),
) -> Result<EntryOutput, EntryError> {
    tch::with_grad(|| train(ctx, comm, progress)).map_err(classify)
}

/// What kind of failure an error of the loop is.
fn classify(e: anyhow::Error) -> EntryError {
    let message = harness_format::error::without_backtrace(&format!("{e:#}"));
    // First: a collective aborted because another rank failed is an echo of
    // that rank's error, even inside a plugin's call (whose error reaches
    // here as the plugin's message: the sandbox flattens what the guest
    // saw into text, so the echo is recognised by the collective's words).
    let aborted = e
        .chain()
        .any(|c| matches!(c.downcast_ref::<harness_runtime::comm::CommError>(), Some(harness_runtime::comm::CommError::Aborted { .. })));
    if aborted || message.contains(harness_runtime::comm::ABORTED_BY_PEER) {
        return EntryError::RankLost { message };
    }
    if let Some(p) = e.chain().find_map(|c| c.downcast_ref::<harness_sandbox::plugin::PluginFailure>()) {
        return EntryError::Plugin { plugin: p.plugin.clone(), message };
    }
    if let Some(d) = e.downcast_ref::<replicas::Diverged>() {
        return EntryError::ReplicasDiverged { strategy: d.strategy.clone(), message };
    }
    if let Some(n) = e.downcast_ref::<record::NonFiniteLoss>() {
        return EntryError::NonFiniteLoss { step: n.step, message };
    }
    if e.chain().any(|c| {
        matches!(
            c.downcast_ref::<harness_runtime::comm::CommError>(),
            Some(harness_runtime::comm::CommError::Aborted { .. } | harness_runtime::comm::CommError::Timeout { .. })
        )
    }) {
        return EntryError::RankLost { message };
    }
    if oom::is_oom_error(&e) {
        return EntryError::OutOfMemory { message };
    }
    if e.chain().any(|c| c.downcast_ref::<tch::TchError>().is_some()) {
        return EntryError::Torch { message };
    }
    EntryError::Other { message }
}

fn train(ctx: &EntryContext<'_>, comm: &mut dyn Collective, progress: &mut dyn FnMut(&Progress)) -> anyhow::Result<EntryOutput> {
    let w = ctx.workload;
    let mut t = Training::new(ctx, comm)?;
    let configured = BatchDecision { micro_batch: w.batch, accum_steps: w.grad_accum, lr_scale: 1.0 };
    let mut batch = Batch::initial(t.strategies.batch.as_mut(), configured, ctx.memory_total_bytes, t.world)?;
    // The ranks' policies decide from the same telemetry, and their
    // decisions are compared before each step runs.
    let agreement = batch::Agreement::new(&ctx.entry.strategy.batch_policy, t.strategies.batch.as_mut(), t.world, t.device);
    agreement.check("before the first step", batch.decision(), comm)?;
    // Before the training clock starts: the snapshot buffers (pinned host
    // memory) take a while to allocate.
    let mut safe = Resilience::open(ctx, &mut t, &batch)?;
    let target = record::Target { loss: target_loss(w, t.data.loss_floor()), accuracy: w.target_accuracy };
    let mut meter = Meter::start(&t, target, ctx.memory_total_bytes)?;
    let resumed_from = safe.resume(ctx, &mut t, &mut batch)?;
    let mut step = resumed_from.unwrap_or(0);
    let budget = w.time_budget_s.map(Duration::from_secs_f64);
    if resumed_from.is_some() {
        let elapsed = meter.train_elapsed();
        progress(&Progress { step, total_steps: w.steps, elapsed, time_budget: budget, loss: None, tokens_per_s: None, resumed_from });
    }
    let mut replicas = replica_check(ctx.warmup_steps);
    let compressor = &ctx.entry.strategy.compressor;
    let mut trace = StepTrace::new(ctx, t.rank);

    loop {
        let elapsed = meter.train_elapsed();
        if should_stop(w, step, elapsed, budget, comm, t.device)? {
            break;
        }
        trace.before(step, t.device)?;
        let tokens_before = t.data.position();
        let recording = meter.begin_step(step, ctx.warmup_steps, comm);
        let lr = learning_rate(w.optimizer.lr(), &w.schedule, step, progress_fraction(w, step, elapsed, budget)) * batch.lr_scale;
        let mut out = match t.step(comm, &batch, &mut meter.timer, step, lr)? {
            Stepped::OutOfMemory { emulated } => {
                // Retried with a smaller micro-batch: the policy's, else half.
                let oom = batch.after_oom(t.strategies.batch.as_mut(), step, emulated)?;
                agreement.check(&format!("for the retry of step {} after it ran out of memory", step + 1), batch.decision(), comm)?;
                safe.record.out_of_memory.push(oom);
                meter.retry_step();
                continue;
            }
            Stepped::Trained(out) => out,
        };
        let now = meter.trained(step, &mut out)?;
        let done = step + 1;
        // The verdict of the replica check started a step ago.
        replicas.settle()?;

        // The policies decide the next batch and the checkpoints; a
        // failure may strike.
        meter.timer.start(harness_runtime::measure::Phase::Strategy)?;
        let telemetry = agreement.telemetry(meter.telemetry(done, now, &batch, t.world, out.grad_stats)?, comm)?;
        batch.after_step(t.strategies.batch.as_mut(), &telemetry)?;
        agreement.check(&format!("after step {done}"), batch.decision(), comm)?;
        let decision = safe.decide(t.strategies.checkpoint.as_mut(), &telemetry, now, comm, t.device)?;
        meter.timer.stop()?;
        meter.timer.end_step()?;
        safe.record.steps_executed += 1;

        if decision.fail || decision.save || replicas.due(done, t.world) {
            t.params_current()?;
        }
        if decision.fail {
            step = safe.fail(&mut t, &mut batch, done, now, decision.lose_memory, &mut |to| {
                meter.rewind(to);
                meter.train_elapsed()
            })?;
            meter.retry_step();
            continue;
        }
        if decision.save {
            let device = t.device;
            let sync = || synchronize(device);
            let elapsed = || meter.train_elapsed();
            safe.save(&mut t, &batch, done, decision.persist, comm, &sync, &elapsed)?;
        }
        safe.delete(&decision.delete, t.rank)?;
        if replicas.due(done, t.world) {
            replicas.start(t.current_params()?, &t.names, comm, done, compressor)?;
        }

        meter.end_step(recording);
        trace.after(t.device, w.steps == Some(done))?;
        step = done;
        progress(&Progress {
            step,
            total_steps: w.steps,
            elapsed: now,
            time_budget: budget,
            loss: meter.last_loss,
            tokens_per_s: meter.tokens_per_s(now),
            resumed_from: None,
        });
        if eval_due(w, step, tokens_before, t.data.position(), t.world) && w.steps != Some(step) {
            // Only an evaluation can reach the target, and rank 0's decides
            // (each rank evaluates its own held-out batches; rank 0's are
            // the ones results record). Every rank stops together: none may
            // wait in a collective for ranks that have stopped.
            let (rank, device) = (t.rank, t.device);
            t.params_current()?;
            let decide = |reached| Ok(w.stop_at_target && rank_zero_reached(reached, rank, comm, device)?);
            if meter.evaluate(&t, step, decide)? {
                break;
            }
        }
    }

    // The last update's parameters, gathered on the training clock.
    t.params_current()?;
    // The training clock stops before the last replica check: it checks
    // the training, it is not part of it.
    let train_time = meter.close(&t, step)?;
    replicas.check(t.current_params()?, &t.names, comm, step, compressor)?;
    t.strategies.compressor.finish()?;
    let batch_changes = std::mem::take(&mut batch.changes);
    // (The training's collectives, before the ranks meet to remove the
    // checkpoints.)
    let comm_stats = comm.stats().clone();
    let resilience = safe.finish(ctx, t.rank, comm, t.device)?;
    record::entry_output(ctx, &mut t, meter, Outcome { steps: step, train_time, batch_changes, resilience, comm: &comm_stats })
}

/// `harness run --trace`: libtorch's profiler records one step on rank 0,
/// the first after warm-up (its retries and restores included), and writes
/// its trace; `HARNESS_TRACE_STEPS=n` records n steps (the gaps between
/// steps), `HARNESS_TRACE_ALL_RANKS=1` on every rank ([`rank_trace_file`]).
/// The device is synchronised before the profiler stops, so the trace holds
/// the steps' kernels.
/// Rank `rank`'s trace beside rank 0's `file`: `file` itself for rank 0,
/// `NAME.rank<r>.EXT` for the others.
fn rank_trace_file(file: &Path, rank: usize) -> std::path::PathBuf {
    if rank == 0 {
        return file.to_path_buf();
    }
    let stem = file.file_stem().map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let name = match file.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    file.with_file_name(name)
}

struct StepTrace {
    file: Option<std::path::PathBuf>,
    step: u64,
    /// Steps still to record once started.
    left: u64,
    on: bool,
}

impl StepTrace {
    fn new(ctx: &EntryContext<'_>, rank: usize) -> StepTrace {
        let last = ctx.workload.steps.map_or(u64::MAX, |s| s.saturating_sub(1));
        let switches = harness_format::switches::get();
        let file = ctx.trace.as_deref().filter(|_| rank == 0 || switches.trace_all_ranks).map(|f| rank_trace_file(f, rank));
        StepTrace { file, step: ctx.warmup_steps.min(last), left: switches.trace_steps.max(1), on: false }
    }

    fn before(&mut self, step: u64, device: Device) -> anyhow::Result<()> {
        if self.file.is_some() && !self.on && step == self.step {
            harness_kernels::torch_ext::profiler_start(device.is_cuda())?;
            self.on = true;
        }
        Ok(())
    }

    fn after(&mut self, device: Device, last_step: bool) -> anyhow::Result<()> {
        if !self.on {
            return Ok(());
        }
        self.left -= 1;
        if self.left > 0 && !last_step {
            return Ok(());
        }
        self.on = false;
        synchronize(device);
        let file = self.file.take().expect("a trace file while tracing");
        std::fs::create_dir_all(file.parent().expect("a trace file in a folder"))
            .with_context(|| format!("creating {}", file.display()))?;
        harness_kernels::torch_ext::profiler_stop(&file).with_context(|| format!("writing the trace {}", file.display()))?;
        Ok(())
    }
}

impl Drop for StepTrace {
    /// An entry that fails during its traced step still stops the profiler,
    /// so the next entry can start it again.
    fn drop(&mut self) {
        if self.on {
            let _ = harness_kernels::torch_ext::profiler_stop(self.file.as_deref().unwrap_or(Path::new("/dev/null")));
        }
    }
}

/// Whether the entry is over: its steps are done or its time budget spent.
/// With a budget, the ranks agree, or one would wait in a collective for
/// ranks that have stopped.
fn should_stop(
    w: &Workload,
    step: u64,
    elapsed: Duration,
    budget: Option<Duration>,
    comm: &mut dyn Collective,
    device: Device,
) -> anyhow::Result<bool> {
    let stop = w.steps.is_some_and(|s| step >= s) || budget.is_some_and(|b| elapsed >= b);
    if comm.world_size() > 1 && budget.is_some() {
        return Ok(any_rank(comm, stop, device)?);
    }
    Ok(stop)
}

/// Whether an evaluation is due after `step` steps: every `eval_every`
/// steps, or each time the tokens trained (all ranks, from the data
/// stream's position in samples before and after the step) pass a multiple
/// of `eval_every_tokens`. Both counts survive restores and resumes, so
/// every rank and every rerun evaluates at the same points.
fn eval_due(w: &Workload, step: u64, samples_before: u64, samples_after: u64, world: usize) -> bool {
    if let Some(every) = w.eval_every_tokens {
        let tokens = |samples: u64| samples * u64::from(w.seq_len) * world as u64;
        return tokens(samples_after) / every > tokens(samples_before) / every;
    }
    w.eval_every > 0 && step % w.eval_every == 0
}

/// Whether rank 0's evaluation reached the target, on every rank.
fn rank_zero_reached(reached: bool, rank: usize, comm: &mut dyn Collective, device: Device) -> anyhow::Result<bool> {
    Ok(any_rank(comm, rank == 0 && reached, device)?)
}

/// How far the entry is, by steps or by time (for the learning-rate schedule).
fn progress_fraction(w: &Workload, step: u64, elapsed: Duration, budget: Option<Duration>) -> f64 {
    let by_steps = w.steps.map(|s| step as f64 / s as f64).unwrap_or(0.0);
    let by_time = budget.map(|b| elapsed.as_secs_f64() / b.as_secs_f64()).unwrap_or(0.0);
    by_steps.max(by_time)
}

/// The target loss: the workload's, or its data's floor plus a margin.
fn target_loss(w: &Workload, floor: Option<f64>) -> Option<f64> {
    match (w.target_loss, w.target_above_floor, floor) {
        (Some(t), _, _) => Some(t),
        (None, Some(m), Some(f)) => Some(f + m),
        _ => None,
    }
}

/// Replica checks every [`replicas::DEFAULT_EVERY`] steps, or every
/// `HARNESS_REPLICA_CHECK_EVERY` steps, and after warm-up (0: only after
/// the last step); with
/// `HARNESS_REPLICA_CHECK_FORCE=1` the fingerprint is taken on one rank too,
/// to measure its cost.
fn replica_check(warmup_steps: u64) -> ReplicaCheck {
    let s = harness_format::switches::get();
    ReplicaCheck::new(s.replica_check_every, warmup_steps, s.replica_check_force)
}

fn synchronize(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_ranks_trace_beside_rank_zero() {
        let f = Path::new("out/trace/gpt-tiny_ddp_r0.json");
        assert_eq!(rank_trace_file(f, 0), f);
        assert_eq!(rank_trace_file(f, 3), Path::new("out/trace/gpt-tiny_ddp_r0.rank3.json"));
        assert_eq!(rank_trace_file(Path::new("t"), 1), Path::new("t.rank1"));
    }

    fn workload(extra: &str) -> Workload {
        let text = format!(
            "name = \"w\"\nmodel = {{ kind = \"gpt\", preset = \"tiny\" }}\ndata = {{ kind = \"synthetic\", vocab = 64 }}\nbatch = 4\nseq_len = 16\nsteps = 10\noptimizer = {{ kind = \"adamw\", lr = 1e-3 }}\n{extra}"
        );
        toml::from_str(&text).unwrap()
    }

    #[test]
    fn evaluations_by_tokens_fall_at_the_same_data_whatever_the_batch() {
        // 2 ranks x 16 tokens per sample: every 256 tokens is every 8 samples.
        let w = workload("eval_every_tokens = 256");
        let points = |batches: &[u64]| {
            let mut samples = 0;
            let mut due = Vec::new();
            for (step, b) in batches.iter().enumerate() {
                if eval_due(&w, step as u64 + 1, samples, samples + b, 2) {
                    due.push(samples + b);
                }
                samples += b;
            }
            due
        };
        assert_eq!(points(&[2; 12]), vec![8, 16, 24]);
        assert_eq!(points(&[8; 3]), vec![8, 16, 24]);
        // A step that crosses two multiples evaluates once, after it.
        assert_eq!(points(&[4, 20]), vec![24]);
        let by_steps = workload("eval_every = 3");
        assert!(eval_due(&by_steps, 3, 0, 1, 1) && !eval_due(&by_steps, 4, 1, 2, 1));
        assert!(!eval_due(&workload(""), 5, 0, 1000, 1));
    }
}
