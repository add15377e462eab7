//! The training core: one entry's model, data, optimizer and step loop.
//!
//! A step: data -> forward -> backward (x grad_accum) -> communicate (the
//! compressor) -> optimizer -> strategy hooks. The loss of step k is read
//! from the device after step k+1 is enqueued, so the host never waits on a
//! step it has just launched; evaluation pauses the training clock.

pub mod checkpoint;
pub mod data;
pub mod dp;
pub mod model;
pub mod optim;
pub mod resilience;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use tch::{nn, Device, Kind, Tensor};

use crate::comm::Collective;
use crate::kernels;
use crate::measure::{self, LatencySummary, Phase, PhaseTimer};
use crate::results::{CheckpointRecord, FailureRecord, OomRecord, ResilienceRecord};
use crate::results::{CollectiveOpRecord, MemoryRecord, Metrics, RankRecord};
use crate::strategy::{BatchDecision, CheckpointHistory, StepTelemetry, Strategies};
use crate::suite::{ModelKind, PlanEntry, Precision, Workload};
use crate::torch_ext::{self, AutocastDevice};
use checkpoint::Position;
use data::Data;
use model::{Model, ModelConfig};
use optim::{learning_rate, LossScaler, Optimizer};
use resilience::{FaultClock, TrainState};

/// What a running entry reports to the user, after each step.
#[derive(Debug, Clone)]
pub struct Progress {
    pub step: u64,
    pub total_steps: Option<u64>,
    pub elapsed: Duration,
    pub time_budget: Option<Duration>,
    pub loss: Option<f64>,
    pub tokens_per_s: Option<f64>,
}

/// Everything an entry needs besides its workload.
pub struct EntryContext<'a> {
    pub workload: &'a Workload,
    pub entry: &'a PlanEntry,
    pub suite_dir: &'a Path,
    pub device: Device,
    pub warmup_steps: u64,
    pub peak_tflops: Option<f64>,
    /// Memory of the training device (GPU memory, or the host's RAM).
    pub memory_total_bytes: u64,
    /// Gradient bucket size for data parallelism.
    pub bucket_bytes: u64,
    /// The suite's plugins.
    pub plugins: &'a crate::plugin::PluginSet,
    /// Where this entry's checkpoints go (removed when the entry succeeds).
    pub checkpoint_dir: std::path::PathBuf,
    /// `harness run --resume`: go on from the newest checkpoint an
    /// interrupted run of this entry left (else checkpoints there are stale
    /// and removed).
    pub resume: bool,
}

/// The outcome of a finished entry.
pub struct EntryOutput {
    pub metrics: Metrics,
    pub histograms: BTreeMap<String, String>,
}

/// Turns autocast off again when an entry ends, however it ends.
struct AutocastGuard(Option<AutocastDevice>);

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        if let Some(d) = self.0 {
            let _ = torch_ext::set_autocast(d, None);
        }
    }
}

/// Trains one entry to the end and measures it.
pub fn run_entry(ctx: &EntryContext<'_>, comm: &mut dyn Collective, progress: &mut dyn FnMut(&Progress)) -> anyhow::Result<EntryOutput> {
    let w = ctx.workload;
    let device = ctx.device;
    let cuda = device.is_cuda();
    let dev_index = match device {
        Device::Cuda(i) => i,
        _ => 0,
    };

    // Model and data. The encoder reads vectors of its own width.
    let cfg = ModelConfig::resolve(&w.model, w.data.vocab().unwrap_or(2), w.seq_len).map_err(|(m, _)| anyhow::anyhow!(m))?;
    let (rank, world) = (comm.rank(), comm.world_size());
    // Every rank draws its own samples; the model starts from rank 0's.
    let data_seed = if rank == 0 { ctx.entry.seed } else { crate::suite::mix_seed(ctx.entry.seed, "rank", rank as u32) };
    let mut data = Data::new(&w.data, ctx.suite_dir, w.seq_len as usize, cfg.d_model as usize, data_seed, device)?;
    // libtorch's generator is global to the process: thread ranks take turns
    // so that each initialisation sees exactly the entry's seed.
    static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let (vs, model) = {
        let _turn = INIT.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(ctx.entry.seed as i64);
        let vs = nn::VarStore::new(device);
        let model = Model::new(&vs.root(), &cfg);
        (vs, model)
    };
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let (param_names, params): (Vec<String>, Vec<Tensor>) = named.into_iter().unzip();
    if world > 1 {
        tch::no_grad(|| -> anyhow::Result<()> {
            for p in &params {
                comm.broadcast(&mut p.shallow_clone(), 0)?;
            }
            Ok(())
        })?;
    }
    let n_params: i64 = params.iter().map(|p| p.numel() as i64).sum();
    // Gradients live in flat buckets (views into one buffer per bucket,
    // DDP's gradient_as_bucket_view), handed to the compressor as they are,
    // on one rank too: the compressor's cost is part of the strategy, and
    // the built-in all-reduce returns at once with one rank. Optionally
    // sharded (ZeRO).
    let stage = dp::ZeroStage::from_level(ctx.entry.strategy.zero)?;
    let mut dp = tch::no_grad(|| dp::DataParallel::new(&params, ctx.bucket_bytes, stage, rank, world))?;
    // What the optimizer updates: the parameters, or this rank's shard of them.
    let (targets, decay) = dp.update_targets(&params);
    let mut optimizer = Optimizer::with_decay(&w.optimizer, &targets, &decay);
    let sharded = dp.sharded();
    let mut gradient_bytes = 0u64;
    let mut scaler = (w.precision == Precision::Fp16).then(|| LossScaler::new(device));
    let mut strategies =
        Strategies::build(&ctx.entry.strategy, w.batch, w.grad_accum, ctx.plugins, device, w.precision != Precision::Fp16)?;
    // The built-in all-reduce over NCCL overlaps with the backward pass
    // (HARNESS_OVERLAP=0 turns that off, to measure what it buys).
    // A batch policy that asks for them (`wants-gradient-stats`, asked once
    // here) gets gradient statistics (the two-batch-size estimate of the
    // gradient noise scale needs the local and the averaged gradient's
    // squared norms): they need the local gradient before the all-reduce, so
    // they turn the overlap off, and cost a norm pass and a read-back a step.
    let grad_stats = strategies.batch.wants_gradient_stats()? && !sharded;
    // Out-of-memory recovery: with a batch-policy plugin (which may shrink
    // the batch) or an emulated memory limit, an out-of-memory error in the
    // forward or backward pass is caught and the step retried smaller. With
    // several ranks they agree after the backward pass on whether any ran
    // out; collectives in flight during backward would break that, so the
    // overlap is off then.
    let oom_limit = w.faults.as_ref().and_then(|f| f.oom_above_batch);
    let oom_armed = oom_limit.is_some() || ctx.plugins.has(&ctx.entry.strategy.batch_policy);
    let oom_agree = oom_armed && world > 1;
    if oom_armed {
        quiet_caught_oom_panics();
    }
    let overlap_allowed = std::env::var("HARNESS_OVERLAP").map_or(true, |v| v != "0") && !grad_stats && !oom_agree;
    let overlapped = overlap_allowed && strategies.compressor.is_plain_average() && dp.enable_overlap(comm)?;

    // Precision: autocast as torch.autocast does it; weights stay fp32.
    let ac_device = if cuda { AutocastDevice::Cuda } else { AutocastDevice::Cpu };
    let autocast = match w.precision {
        Precision::Fp32 => AutocastGuard(None),
        Precision::Bf16 => {
            torch_ext::set_autocast(ac_device, Some(Kind::BFloat16))?;
            AutocastGuard(Some(ac_device))
        }
        Precision::Fp16 => {
            torch_ext::set_autocast(ac_device, Some(Kind::Half))?;
            AutocastGuard(Some(ac_device))
        }
    };

    let autocast_on = autocast.0.is_some();
    // bf16 on CUDA: the loss and its gradient come from one fused kernel.
    let fused_ce = cuda && w.precision == Precision::Bf16 && w.model.kind != ModelKind::Encoder && kernels::available();
    if cuda && w.precision == Precision::Bf16 && !fused_ce {
        if let Some(why) = kernels::unavailable_reason() {
            eprintln!("warning: fused cross-entropy unavailable ({why}); using libtorch's");
        }
    }
    let eval_set = data.eval_set(w.eval_batches as usize, w.batch as usize);
    let target = match (w.target_loss, w.target_above_floor, data.loss_floor()) {
        (Some(t), _, _) => Some(t),
        (None, Some(m), Some(f)) => Some(f + m),
        _ => None,
    };

    measure::reset_peak_rss();
    if cuda {
        tch::Cuda::synchronize(dev_index as i64);
        torch_ext::cuda_reset_peak(dev_index)?;
    }
    let mut timer = PhaseTimer::new(cuda);
    // CUDA: the largest per-step peaks (allocated, reserved) so far.
    let mut peak_seen = (0i64, 0i64);
    let mut step_hist = measure::new_histogram();
    let first = strategies.batch.initial(BatchDecision { micro_batch: w.batch, accum_steps: w.grad_accum, lr_scale: 1.0 })?;
    let (mut cur_batch, mut cur_accum, mut lr_scale) = (first.micro_batch, first.accum_steps, first.lr_scale);
    let mut batch_changes = vec![(0u64, cur_batch, cur_accum)];

    let start = Instant::now();
    let mut eval_time = Duration::ZERO;
    let train_elapsed = |eval_time: Duration| start.elapsed().saturating_sub(eval_time);
    let mut measured_from: Option<(Duration, u64, u64)> = None; // (train time, tokens, samples) at warm-up end
    let (mut tokens, mut samples) = (0u64, 0u64);
    let mut pending_loss: Option<PendingLoss> = None;
    // Gradient statistics for batch-policy plugins, on their way to the host.
    let mut stats_in_flight: Option<PendingLoss> = None;
    let mut loss_curve = Vec::new();
    let mut eval_curve = Vec::new();
    let mut last_loss = None;
    let mut reached: Option<(u64, f64)> = None;
    let mut last_iter = Instant::now();
    let budget = w.time_budget_s.map(Duration::from_secs_f64);
    let mut step = 0u64;

    // Checkpoints and injected failures. A failure before the first
    // checkpoint goes back to the start, kept in host memory.
    let mut fault_clock =
        w.faults.as_ref().filter(|f| !f.at_steps.is_empty() || f.mtbf_s.is_some()).map(|f| FaultClock::new(f, ctx.entry.seed, rank));
    let saves = !strategies.checkpoint.never_saves();
    let store = if saves {
        Some(checkpoint::Store::open(&ctx.checkpoint_dir, rank, world, ctx.entry.strategy.checkpoint_compress, !ctx.resume)?)
    } else {
        None
    };
    let mut history = CheckpointHistory::default();
    // Training time since which work is at risk: the last checkpoint's
    // completion, or the last restore, or the start.
    let mut at_risk_since = Duration::ZERO;
    let mut res = ResilienceRecord::default();
    // Out of memory: the smallest micro-batch that ran out, the size retried
    // then, and the telemetry of the last step (for the policy's retry call).
    let mut oom_ceiling: Option<u32> = None;
    let mut oom_fallback = cur_batch;
    let mut last_telemetry = StepTelemetry {
        memory_total_bytes: ctx.memory_total_bytes,
        micro_batch: cur_batch,
        accum_steps: cur_accum,
        world_size: world as u32,
        loss: f64::NAN,
        ..StepTelemetry::default()
    };
    // What a snapshot is taken of and restored into, and where it puts the
    // loop: the parameters, optimizer, scaler and plugins; the data stream's
    // position; the batch.
    macro_rules! train_state {
        () => {
            TrainState {
                names: &param_names,
                params: &params,
                optimizer: &mut optimizer,
                scaler: scaler.as_mut(),
                strategies: &mut strategies,
                device,
            }
        };
    }
    macro_rules! position {
        ($step:expr) => {
            Position { step: $step, data_position: data.position(), micro_batch: cur_batch, accum_steps: cur_accum, lr_scale }
        };
    }
    macro_rules! restore {
        ($snap:expr, $why:expr) => {{
            let snap: &checkpoint::Snapshot = $snap;
            train_state!().restore(snap).with_context(|| $why)?;
            data.seek(snap.position.data_position);
            (cur_batch, cur_accum, lr_scale) = (snap.position.micro_batch, snap.position.accum_steps, snap.position.lr_scale);
            snap.position.step
        }};
    }
    let initial = match fault_clock {
        Some(_) => Some(train_state!().capture(position!(0), true)?),
        None => None,
    };
    // An interrupted run of this entry goes on from its newest checkpoint.
    if let (true, Some(store)) = (ctx.resume, &store) {
        let on_disk: Vec<u64> = checkpoint::list(&ctx.checkpoint_dir).into_iter().map(|c| c.0).collect();
        if let Some(&c) = on_disk.last() {
            let snap =
                store.read(c).with_context(|| format!("resuming from the checkpoint of step {c} in {}", ctx.checkpoint_dir.display()))?;
            restore!(&snap, format!("resuming from the checkpoint of step {c}"));
            batch_changes = vec![(c, cur_batch, cur_accum)];
            history.saved = on_disk;
            step = c;
            res.resumed_from = Some(c);
        }
    }

    let read_loss = |p: PendingLoss, curve: &mut Vec<(u64, f64, f64)>| -> anyhow::Result<f64> {
        let v = p.read()?;
        if !v.is_finite() {
            anyhow::bail!("the training loss became {v} at step {}", p.step);
        }
        curve.push((p.step, p.time_s, v));
        Ok(v)
    };

    loop {
        let elapsed = train_elapsed(eval_time);
        let mut stop = w.steps.is_some_and(|s| step >= s) || budget.is_some_and(|b| elapsed >= b);
        if world > 1 && budget.is_some() {
            // Ranks must agree on when a time budget ends, or one would wait
            // in a collective for ranks that have stopped.
            stop = any_rank(comm, stop, device)?;
        }
        if stop {
            break;
        }
        if step == ctx.warmup_steps && measured_from.is_none() {
            if cuda {
                tch::Cuda::synchronize(dev_index as i64);
            }
            measured_from = Some((train_elapsed(eval_time), tokens, samples));
            comm.reset_timings();
        }
        let recording = step >= ctx.warmup_steps;
        timer.begin_step(recording);
        let progress_frac = {
            let by_steps = w.steps.map(|s| step as f64 / s as f64).unwrap_or(0.0);
            let by_time = budget.map(|b| elapsed.as_secs_f64() / b.as_secs_f64()).unwrap_or(0.0);
            by_steps.max(by_time)
        };
        let lr = learning_rate(w.optimizer.lr(), &w.schedule, step, progress_frac) * lr_scale;

        dp.begin_step();
        let mut step_loss: Option<Tensor> = None;
        let emulated_oom = oom_limit.is_some_and(|l| cur_batch > l);
        let mut oom = emulated_oom;
        if !oom {
            CATCHING_OOM.with(|c| c.set(oom_armed));
            let passes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> anyhow::Result<()> {
                for micro in 0..cur_accum {
                    timer.start(Phase::Data)?;
                    let b = data.next_train(cur_batch as usize);
                    timer.stop()?;
                    timer.start(Phase::Forward)?;
                    let (loss, seed) = match model.forward(&b.input, &b.target, true) {
                        model::Output::Logits { logits, target } if fused_ce => {
                            let scale = scaler.as_ref().map(|s| &s.scale);
                            let (loss, grad) = kernels::cross_entropy_bf16(&logits, &target, 1.0 / cur_accum as f32, scale)?;
                            (loss, Some((logits, grad)))
                        }
                        model::Output::Logits { logits, target } => (model::token_loss(&logits, &target), None),
                        model::Output::Loss(l) => (l, None),
                    };
                    if autocast_on {
                        torch_ext::autocast_clear_cache()?;
                    }
                    timer.stop()?;
                    // ZeRO-2 allocates its released gradient buffers here, outside
                    // the backward phase (the other stages zero theirs at step start).
                    dp.before_backward(&params)?;
                    dp.arm_overlap(comm, micro + 1 == cur_accum);
                    timer.start(Phase::Backward)?;
                    match seed {
                        Some((logits, grad)) => torch_ext::backward_with_grad(&logits, &grad)?,
                        None => {
                            let mut scaled = if cur_accum > 1 { &loss / cur_accum as f64 } else { loss.shallow_clone() };
                            if let Some(s) = &scaler {
                                scaled = &scaled * &s.scale;
                            }
                            scaled.backward();
                        }
                    }
                    dp.disarm_overlap();
                    timer.stop()?;
                    let l = if cur_accum > 1 { loss.detach() / cur_accum as f64 } else { loss.detach() };
                    step_loss = Some(match step_loss.take() {
                        Some(acc) => acc + l,
                        None => l,
                    });
                    tokens += b.tokens as u64;
                    samples += b.samples as u64;
                }
                Ok(())
            }));
            CATCHING_OOM.with(|c| c.set(false));
            match passes {
                // libtorch's out-of-memory error, returned (f_ ops, kernels) or thrown.
                Ok(Err(e)) if oom_armed && format!("{e:#}").contains("out of memory") => oom = true,
                Ok(r) => r?,
                Err(payload) if oom_armed && is_oom(payload.as_ref()) => oom = true,
                Err(payload) => std::panic::resume_unwind(payload),
            }
        }
        if oom_agree {
            oom = any_rank(comm, oom, device)?;
        }
        if oom {
            // Drop the step and retry it with a smaller micro-batch: the
            // policy's, if it shrinks, else half.
            timer.stop()?;
            dp.disarm_overlap();
            if autocast_on {
                torch_ext::autocast_clear_cache()?;
            }
            timer.begin_step(false);
            timer.end_step()?;
            drop(step_loss);
            let failed = cur_batch;
            anyhow::ensure!(failed > 1, "step {} ran out of memory at micro-batch 1: there is nothing smaller to retry with", step + 1);
            let t = StepTelemetry { step, micro_batch: failed, accum_steps: cur_accum, out_of_memory: true, ..last_telemetry.clone() };
            let next = strategies.batch.next(&t)?;
            let retry = if next.micro_batch < failed { next.micro_batch } else { (failed / 2).max(1) };
            oom_ceiling = Some(oom_ceiling.map_or(failed, |c: u32| c.min(failed)));
            oom_fallback = retry;
            res.out_of_memory.push(OomRecord { step, micro_batch: failed, retried_with: retry, emulated: emulated_oom });
            batch_changes.push((step, retry, next.accum_steps));
            (cur_batch, cur_accum, lr_scale) = (retry, next.accum_steps, next.lr_scale);
            last_iter = Instant::now();
            continue;
        }
        dp.check_grads(&params)?;
        let local_sq = if grad_stats { Some(dp.grad_sq_norm()?) } else { None };
        // A plugin compressor's output is checked for NaN/inf through a norm
        // of the reduced gradients, the one computed anyway if there is one
        // (clipping, the batch policy's statistics). Else, on a device,
        // through their sum (one pass, read a step later); on the CPU, each
        // bucket is scanned directly as the compressor hands it back.
        let check = strategies.compressor.checks_output() && !sharded;
        let scan = check && !device.is_cuda() && w.grad_clip.is_none() && !grad_stats;
        timer.start(Phase::Communicate)?;
        if sharded {
            dp.reduce(&params, strategies.compressor.as_mut(), comm, step, false).context("the reduce-scatter of the gradients failed")?;
        } else {
            dp.reduce(&params, strategies.compressor.as_mut(), comm, step, scan)?;
        }
        timer.stop()?;
        let grads = dp.grads()?;
        // (mean over ranks of the local squared norm, squared norm of the
        // average): copied to the host behind an event and read a step later,
        // as the loss is, so that no step waits for the device.
        let stats_prev = stats_in_flight.take();
        let mut global_sq = None;
        if let Some(mut local) = local_sq {
            let global = dp.grad_sq_norm()?;
            global_sq = Some(global.shallow_clone());
            if world > 1 {
                comm.all_reduce_sum(&mut local)?;
            }
            let pair = Tensor::cat(&[local / world as f64, global], 0);
            stats_in_flight = Some(PendingLoss::start(step, 0.0, &pair)?);
        }
        let stats = match stats_prev {
            Some(p) => {
                if let Some(e) = &p.done {
                    e.synchronize()?;
                }
                Some((p.host.double_value(&[0]), p.host.double_value(&[1])))
            }
            None => None,
        };

        timer.start(Phase::Optimizer)?;
        if let Some(s) = &mut scaler {
            s.unscale(&grads)?;
            if sharded {
                // Each rank saw only its shard: skip the step everywhere if
                // any rank overflowed (the kernels skip on exactly 1).
                comm.all_reduce_sum(&mut s.found_inf)?;
                let _ = s.found_inf.clamp_max_(1.0);
            }
        }
        let mut clip_norm = None;
        if let Some(max) = w.grad_clip {
            if sharded {
                let _norm = dp::clip_grad_norm_sharded(&grads, max, comm, device)?;
            } else {
                clip_norm = Some(torch_ext::clip_grad_norm(&grads, Some(max))?);
            }
        }
        if check && !scan {
            let norm = match clip_norm.or(global_sq) {
                Some(n) => n,
                None => dp.grad_checksum(),
            };
            strategies.compressor.check_output(step, &norm, &|| dp.first_non_finite_bucket())?;
        }
        optimizer.step(&targets, &grads, lr, scaler.as_ref().map(|s| &s.found_inf))?;
        if let Some(s) = &mut scaler {
            s.update();
        }
        timer.stop()?;
        drop(grads);
        {
            let d = &mut dp;
            gradient_bytes = gradient_bytes.max(d.gradient_bytes());
            if d.sharded() {
                timer.start(Phase::Communicate)?;
                d.gather_params(comm).context("gathering the parameters failed")?;
                timer.stop()?;
            }
        }

        // The previous step's loss: the device has this step queued already.
        if let Some(p) = pending_loss.take() {
            last_loss = Some(read_loss(p, &mut loss_curve)?);
        }
        let now = train_elapsed(eval_time);
        pending_loss = step_loss.map(|l| PendingLoss::start(step, now.as_secs_f64(), &l)).transpose()?;

        timer.start(Phase::Strategy)?;
        let tps = measured_from.map(|(t0, tok0, _)| (tokens - tok0) as f64 / (now.saturating_sub(t0)).as_secs_f64().max(1e-9));
        // CUDA: the step's peak allocation, which is what a grown batch
        // must fit; the allocator's peak restarts every step, and the
        // entry's peak is the largest of them.
        let memory_used = if cuda {
            let m = torch_ext::cuda_memory(dev_index)?;
            peak_seen = (peak_seen.0.max(m.peak_allocated), peak_seen.1.max(m.peak_reserved));
            torch_ext::cuda_reset_peak(dev_index)?;
            m.peak_allocated as u64
        } else {
            measure::rss_bytes().unwrap_or(0)
        };
        let telemetry = StepTelemetry {
            step: step + 1,
            loss: last_loss.unwrap_or(f64::NAN),
            step_time_s: last_iter.elapsed().as_secs_f64(),
            elapsed_s: now.as_secs_f64(),
            memory_used_bytes: memory_used,
            memory_total_bytes: ctx.memory_total_bytes,
            tokens_per_s: tps.unwrap_or(0.0),
            micro_batch: cur_batch,
            accum_steps: cur_accum,
            world_size: world as u32,
            grad_sq_norm: stats.map(|s| s.1),
            local_grad_sq_norm: stats.map(|s| s.0),
            out_of_memory: false,
        };
        let mut next = strategies.batch.next(&telemetry)?;
        last_telemetry = telemetry.clone();
        // A size that ran out of memory is not tried again: the policy's
        // request falls back to the size that was retried then.
        if oom_ceiling.is_some_and(|c| next.micro_batch >= c) {
            next.micro_batch = oom_fallback;
        }
        if (next.micro_batch, next.accum_steps) != (cur_batch, cur_accum) {
            batch_changes.push((step + 1, next.micro_batch, next.accum_steps));
        }
        (cur_batch, cur_accum, lr_scale) = (next.micro_batch, next.accum_steps, next.lr_scale);
        anyhow::ensure!(
            cur_batch >= 1 && cur_accum >= 1,
            "the batch policy returned batch {cur_batch} x {cur_accum} accumulation steps; both must be at least 1"
        );
        // Checkpoint and failure: the policy decides, a failure may strike,
        // and the ranks agree on both.
        let done = step + 1;
        history.since_last_s = now.saturating_sub(at_risk_since).as_secs_f64();
        let decision = strategies.checkpoint.decide(&telemetry, &history)?;
        let mut fail = fault_clock.as_mut().is_some_and(|c| c.strikes(done, now.as_secs_f64()));
        let (mut save, mut delete) = (decision.save, decision.delete);
        if world > 1 && (saves || fault_clock.is_some()) {
            // Rank 0's decision holds for every rank (a policy that reads the
            // clock may decide differently on each): save, failure, and which
            // of the checkpoints on disk (the same list on every rank) to delete.
            let mut v = vec![0f32; 2 + history.saved.len()];
            if rank == 0 {
                v[0] = save as i32 as f32;
                v[1] = fail as i32 as f32;
                for (i, s) in history.saved.iter().enumerate() {
                    v[2 + i] = delete.contains(s) as i32 as f32;
                }
            }
            let mut flags = Tensor::from_slice(&v).to_device(device);
            comm.all_reduce_sum(&mut flags)?;
            let got = Vec::<f32>::try_from(&flags.to_device(Device::Cpu))?;
            (save, fail) = (got[0] > 0.0, got[1] > 0.0);
            delete = history.saved.iter().zip(&got[2..]).filter(|(_, &d)| d > 0.0).map(|(&s, _)| s).collect();
        }
        timer.stop()?;
        timer.end_step()?;
        res.steps_executed += 1;

        if fail {
            // The work since the last checkpoint is lost: back to it.
            strategies.compressor.finish()?;
            let t0 = Instant::now();
            let loaded;
            let snap = match history.saved.last() {
                Some(&s) => {
                    loaded = store.as_ref().context("a checkpoint without a store")?.read(s)?;
                    &loaded
                }
                None => initial.as_ref().context("no initial state to restart from")?,
            };
            let c = restore!(snap, format!("restoring the checkpoint of step {} after the failure at step {done}", snap.position.step));
            pending_loss = None;
            stats_in_flight = None;
            loss_curve.retain(|e: &(u64, f64, f64)| e.0 < c);
            eval_curve.retain(|e: &(u64, f64, f64)| e.0 <= c);
            batch_changes.retain(|e| e.0 <= c);
            if reached.is_some_and(|r| r.0 > c) {
                reached = None;
            }
            if cuda {
                tch::Cuda::synchronize(dev_index as i64);
            }
            let restore_s = t0.elapsed().as_secs_f64();
            let lost_s = now.saturating_sub(at_risk_since).as_secs_f64();
            at_risk_since = train_elapsed(eval_time);
            history.failures.push(done);
            res.failures.push(FailureRecord { step: done, restored_to: c, lost_s, restore_s });
            res.time_lost_s += lost_s + restore_s;
            step = c;
            last_iter = Instant::now();
            continue;
        }
        if save {
            let store = store.as_ref().context("the checkpoint policy `none` asked to save")?;
            let t0 = Instant::now();
            if cuda {
                tch::Cuda::synchronize(dev_index as i64);
            }
            let at = position!(done);
            let written = train_state!().capture(at, rank == 0).and_then(|snap| store.write_part(&snap));
            // Every rank's part is durable before rank 0 makes it a checkpoint.
            let all_ok = ranks_agree(comm, written.is_ok(), device)?;
            let bytes = written.with_context(|| format!("writing the checkpoint of step {done}"))?;
            anyhow::ensure!(all_ok, "another rank failed to write its part of the checkpoint of step {done}");
            if rank == 0 {
                store.commit(at).with_context(|| format!("committing the checkpoint of step {done}"))?;
            }
            ranks_agree(comm, true, device)?;
            let cost = t0.elapsed().as_secs_f64();
            history.saved.push(done);
            history.last_cost_s = Some(cost);
            at_risk_since = train_elapsed(eval_time);
            res.checkpoints.push(CheckpointRecord { step: done, cost_s: cost, bytes, deleted: Vec::new() });
            res.checkpoint_time_s += cost;
        }
        for &d in &delete {
            if rank == 0 {
                store.as_ref().context("a checkpoint deletion without a store")?.delete(d)?;
            }
            history.saved.retain(|&s| s != d);
            if let Some(c) = res.checkpoints.last_mut() {
                c.deleted.push(d);
            }
        }

        let iter = last_iter.elapsed();
        last_iter = Instant::now();
        if recording {
            measure::record(&mut step_hist, iter);
        }
        step += 1;

        progress(&Progress { step, total_steps: w.steps, elapsed: now, time_budget: budget, loss: last_loss, tokens_per_s: tps });

        if w.eval_every > 0 && step % w.eval_every == 0 && w.steps != Some(step) {
            let t_eval = Instant::now();
            let t_train = train_elapsed(eval_time).as_secs_f64();
            let ev = evaluate(&model, &eval_set, autocast_on)?;
            eval_time += t_eval.elapsed();
            eval_curve.push((step, t_train, ev));
            if let (Some(t), None) = (target, reached) {
                if ev <= t {
                    reached = Some((step, t_train));
                }
            }
            last_iter = Instant::now();
        }
    }
    if let Some(p) = pending_loss.take() {
        last_loss = Some(read_loss(p, &mut loss_curve)?);
    }
    if cuda {
        tch::Cuda::synchronize(dev_index as i64);
    }
    timer.flush()?;
    let train_time = train_elapsed(eval_time);
    let t_train = train_time.as_secs_f64();
    let final_eval = evaluate(&model, &eval_set, autocast_on)?;
    eval_curve.push((step, t_train, final_eval));
    if let (Some(t), None) = (target, reached) {
        if final_eval <= t {
            reached = Some((step, t_train));
        }
    }

    // Throughput after warm-up (or over everything if warm-up never ended).
    let (t0, tok0, s0) = measured_from.unwrap_or((Duration::ZERO, 0, 0));
    let window = train_time.saturating_sub(t0).as_secs_f64().max(1e-9);
    let tokens_per_s = (tokens - tok0) as f64 / window;
    let samples_per_s = (samples - s0) as f64 / window;
    let flops_per_token = cfg.flops_per_token(n_params);
    let achieved_tflops = flops_per_token * tokens_per_s / 1e12;
    let peak = ctx.peak_tflops;

    let cs = comm.stats().clone();
    let memory = MemoryRecord {
        peak_rss_bytes: measure::peak_rss_bytes(),
        peak_device_allocated_bytes: if cuda { Some(torch_ext::cuda_memory(dev_index)?.peak_allocated.max(peak_seen.0)) } else { None },
        peak_device_reserved_bytes: if cuda { Some(torch_ext::cuda_memory(dev_index)?.peak_reserved.max(peak_seen.1)) } else { None },
    };
    let ranks =
        vec![RankRecord { rank: rank as u32, memory: memory.clone(), optimizer_state_bytes: optimizer.state_bytes(), gradient_bytes }];
    strategies.compressor.finish()?;
    let tracked = saves || fault_clock.is_some() || !res.out_of_memory.is_empty() || res.resumed_from.is_some();
    if let (Some(_), 0) = (&store, rank) {
        // Checkpoints serve a run that has not finished; this one has.
        let _ = std::fs::remove_dir_all(&ctx.checkpoint_dir);
    }
    let mut histograms = BTreeMap::new();
    let reports = strategies.plugin_reports();
    let runtime = match reports.iter().map(|r| r.0.manifest.transport).collect::<std::collections::BTreeSet<_>>() {
        t if t.is_empty() => "built-in".to_owned(),
        t if t.contains(&crate::plugin::Transport::Native) => "native (unsandboxed)".to_owned(),
        _ => "wasm".to_owned(),
    };
    let mut plugin_records = Vec::new();
    for (rec, hist) in reports {
        histograms.insert(format!("plugin.{}", rec.slot), hist);
        plugin_records.push(rec);
    }
    let mut phases = BTreeMap::new();
    histograms.insert("step".to_owned(), measure::encode(&step_hist));
    if cs.collectives > 0 {
        histograms.insert("collective".to_owned(), measure::encode(&cs.latency));
        histograms.insert("collective.emulated".to_owned(), measure::encode(&cs.emulated));
    }
    for (p, h) in &timer.histograms {
        if h.is_empty() {
            continue;
        }
        histograms.insert(p.name().to_owned(), measure::encode(h));
        phases.insert(p.name().to_owned(), LatencySummary::of(h));
    }
    let mut host_phases = BTreeMap::new();
    for (p, h) in &timer.host_histograms {
        if h.is_empty() {
            continue;
        }
        histograms.insert(format!("host.{}", p.name()), measure::encode(h));
        host_phases.insert(p.name().to_owned(), LatencySummary::of(h));
    }
    let metrics = Metrics {
        model: serde_json::to_value(&cfg)?,
        parameters: n_params,
        precision: format!("{:?}", w.precision).to_lowercase(),
        steps: step,
        warmup_steps: ctx.warmup_steps.min(step),
        tokens,
        samples,
        train_time_s: t_train,
        tokens_per_s,
        samples_per_s,
        step: (!step_hist.is_empty()).then(|| LatencySummary::of(&step_hist)),
        phases,
        host_phases,
        flops_per_token,
        achieved_tflops,
        mfu: peak.map(|p| achieved_tflops / p),
        peak_tflops: peak,
        memory,
        final_train_loss: last_loss,
        final_eval_loss: Some(final_eval),
        loss_floor: data.loss_floor(),
        target_loss: target,
        time_to_target_s: reached.map(|r| r.1),
        steps_to_target: reached.map(|r| r.0),
        loss_curve: subsample(loss_curve, 512),
        eval_curve,
        skipped_steps: scaler.as_ref().map_or(0, |s| s.skipped_steps()),
        bytes_on_wire: cs.bytes_sent,
        world_size: world as u32,
        bucket_bytes: if world > 1 { dp.bucket_bytes() } else { Vec::new() },
        collectives: cs.collectives,
        collective: (cs.collectives > 0).then(|| LatencySummary::of(&cs.latency)),
        collective_emulated: (cs.collectives > 0 && cs.emulated_total != cs.measured_total).then(|| LatencySummary::of(&cs.emulated)),
        busbw_gbs: cs.bandwidth_gbs(world, false).map(|b| b.1),
        busbw_emulated_gbs: cs.bandwidth_gbs(world, true).map(|b| b.1).filter(|_| cs.emulated_total != cs.measured_total),
        collective_ops: cs
            .ops
            .iter()
            .map(|(op, s)| {
                let emulated = s.emulated_total != s.measured_total;
                let record = CollectiveOpRecord {
                    collectives: s.collectives,
                    bytes: s.bytes,
                    bytes_on_wire: s.bytes_sent,
                    latency: (!s.latency.is_empty()).then(|| LatencySummary::of(&s.latency)),
                    busbw_gbs: cs.op_bandwidth_gbs(*op, world, false).map(|b| b.1),
                    busbw_emulated_gbs: cs.op_bandwidth_gbs(*op, world, true).map(|b| b.1).filter(|_| emulated),
                };
                (op.name().to_owned(), record)
            })
            .collect(),
        strategy_runtime: runtime,
        plugins: plugin_records,
        fused_cross_entropy: fused_ce,
        overlapped_reduction: overlapped,
        zero: ctx.entry.strategy.zero,
        optimizer_state_bytes: optimizer.state_bytes(),
        gradient_bytes,
        ranks,
        batch_changes,
        checkpoints_written: res.checkpoints.len() as u64,
        goodput_steps_per_s: tracked.then(|| step as f64 / t_train.max(1e-9)),
        resilience: tracked.then_some(res),
    };
    Ok(EntryOutput { metrics, histograms })
}

/// A step's loss (or other small device values) on its way to the host. On CUDA it is copied into pinned
/// memory behind an event, so reading it later waits for that copy only;
/// `.item()` would wait for everything queued on the stream, the next step
/// included, and leave the device idle while the host prepares another.
struct PendingLoss {
    step: u64,
    time_s: f64,
    host: Tensor,
    done: Option<measure::cuda::Event>,
}

impl PendingLoss {
    fn start(step: u64, time_s: f64, loss: &Tensor) -> anyhow::Result<PendingLoss> {
        if loss.device().is_cuda() {
            let host = loss.to_device_(Device::Cpu, Kind::Float, true, false);
            let done = measure::cuda::Event::new()?;
            done.record()?;
            Ok(PendingLoss { step, time_s, host, done: Some(done) })
        } else {
            Ok(PendingLoss { step, time_s, host: loss.shallow_clone(), done: None })
        }
    }

    fn read(&self) -> anyhow::Result<f64> {
        if let Some(e) = &self.done {
            e.synchronize()?;
        }
        Ok(self.host.double_value(&[]))
    }
}

/// Mean loss over the fixed eval set (no gradients, no dropout).
fn evaluate(model: &Model, set: &[data::Batch], autocast_on: bool) -> anyhow::Result<f64> {
    let mut total: Option<Tensor> = None;
    for b in set {
        let l = tch::no_grad(|| model.loss(&b.input, &b.target, false)).to_kind(Kind::Double);
        if autocast_on {
            torch_ext::autocast_clear_cache()?;
        }
        total = Some(match total {
            Some(t) => t + l,
            None => l,
        });
    }
    Ok(total.map_or(f64::NAN, |t| t.double_value(&[]) / set.len() as f64))
}

/// Keeps at most `max` points, evenly spaced, always the last.
fn subsample<T: Clone>(v: Vec<T>, max: usize) -> Vec<T> {
    if v.len() <= max {
        return v;
    }
    let n = v.len();
    let mut out: Vec<T> = (0..max - 1).map(|i| v[i * (n - 1) / (max - 1)].clone()).collect();
    out.push(v[n - 1].clone());
    out
}

/// True on every rank when `flag` is true on any rank (a barrier too).
fn any_rank(comm: &mut dyn Collective, flag: bool, device: Device) -> anyhow::Result<bool> {
    if comm.world_size() == 1 {
        return Ok(flag);
    }
    let mut t = Tensor::from_slice(&[flag as i32 as f32]).to_device(device);
    comm.all_reduce_sum(&mut t)?;
    Ok(t.double_value(&[0]) > 0.0)
}

/// True on every rank when `ok` is true on every rank (a barrier too).
fn ranks_agree(comm: &mut dyn Collective, ok: bool, device: Device) -> anyhow::Result<bool> {
    Ok(!any_rank(comm, !ok, device)?)
}

thread_local! {
    /// Set while a step's passes run with out-of-memory recovery armed.
    static CATCHING_OOM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether a panic's payload is libtorch's out-of-memory error.
fn is_oom(payload: &(dyn std::any::Any + Send)) -> bool {
    let msg = payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied()).unwrap_or("");
    msg.contains("out of memory") || msg.contains("OutOfMemoryError")
}

/// Out-of-memory panics that the step loop catches and retries are not
/// printed (every other panic is, as before).
fn quiet_caught_oom_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !(CATCHING_OOM.with(|c| c.get()) && is_oom(info.payload())) {
                previous(info);
            }
        }));
    });
}
