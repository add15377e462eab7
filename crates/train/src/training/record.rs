//! What is measured while an entry trains (phase timers, the step-latency
//! histogram, loss and eval curves, throughput, memory, the time to the
//! target loss) and the entry's figures for the results file.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use hdrhistogram::Histogram;
use tch::Device;

use super::Trained;
use super::{Evaluation, Pending, Training};
use crate::batch::Batch;
use crate::entry::{EntryContext, EntryOutput};
use harness_format::results::{CollectiveOpRecord, MemoryRecord, Metrics, RankRecord, ResilienceRecord};
use harness_format::suite::Recompute;
use harness_kernels::torch_ext;
use harness_runtime::comm::{Collective, CommStats};
use harness_runtime::measure::{self, LatencySummary, PhaseTimer};
use harness_sandbox::strategy::StepTelemetry;

/// The training loss became NaN or infinite.
#[derive(Debug, thiserror::Error)]
#[error("the training loss became {value} at step {step}")]
pub struct NonFiniteLoss {
    pub step: u64,
    pub value: f64,
}

/// (step, training seconds, value)
type Curve = Vec<(u64, f64, f64)>;

/// What an evaluation must reach: an eval loss at or below `loss`, or a
/// top-1 accuracy at or above `accuracy` (a suite sets one of them).
#[derive(Debug, Clone, Copy, Default)]
pub struct Target {
    pub loss: Option<f64>,
    pub accuracy: Option<f64>,
}

impl Target {
    fn set(&self) -> bool {
        self.loss.is_some() || self.accuracy.is_some()
    }

    fn reached(&self, ev: &Evaluation) -> bool {
        self.set() && self.loss.is_none_or(|t| ev.loss <= t) && self.accuracy.is_none_or(|t| ev.accuracy.is_some_and(|a| a >= t))
    }
}

/// The measurements of one entry on one rank.
pub struct Meter {
    pub timer: PhaseTimer,
    step_hist: Histogram<u64>,
    /// CUDA: the device, and the largest per-step peaks (allocated,
    /// reserved) so far.
    cuda: Option<usize>,
    peak_seen: (i64, i64),
    memory_total_bytes: u64,
    start: Instant,
    /// Evaluation pauses the training clock.
    eval_time: Duration,
    /// (training time, tokens, samples) when warm-up ended.
    measured_from: Option<(Duration, u64, u64)>,
    pub tokens: u64,
    pub samples: u64,
    pending_loss: Option<Pending>,
    loss_curve: Curve,
    eval_curve: Curve,
    /// Classifiers: top-1 accuracy at every evaluation.
    accuracy_curve: Curve,
    pub last_loss: Option<f64>,
    /// The target, and (step, training seconds) when eval reached it.
    target: Target,
    reached: Option<(u64, f64)>,
    last_iter: Instant,
}

impl Meter {
    /// Starts the clocks and the memory peaks.
    pub fn start(t: &Training, target: Target, memory_total_bytes: u64) -> Result<Meter> {
        measure::reset_peak_rss();
        let cuda = match t.device {
            Device::Cuda(i) => Some(i),
            _ => None,
        };
        if let Some(i) = cuda {
            tch::Cuda::synchronize(i as i64);
            torch_ext::cuda_reset_peak(i)?;
        }
        Ok(Meter {
            timer: PhaseTimer::new(cuda.is_some()),
            step_hist: measure::new_histogram(),
            cuda,
            peak_seen: (0, 0),
            memory_total_bytes,
            start: Instant::now(),
            eval_time: Duration::ZERO,
            measured_from: None,
            tokens: 0,
            samples: 0,
            pending_loss: None,
            loss_curve: Vec::new(),
            eval_curve: Vec::new(),
            accuracy_curve: Vec::new(),
            last_loss: None,
            target,
            reached: None,
            last_iter: Instant::now(),
        })
    }

    /// Training time so far: wall time less evaluation.
    pub fn train_elapsed(&self) -> Duration {
        self.start.elapsed().saturating_sub(self.eval_time)
    }

    fn synchronize(&self) {
        if let Some(i) = self.cuda {
            tch::Cuda::synchronize(i as i64);
        }
    }

    /// Starts step `step`; throughput and the collectives' timings count
    /// from the end of warm-up. Returns whether this step is recorded.
    pub fn begin_step(&mut self, step: u64, warmup_steps: u64, comm: &mut dyn Collective) -> bool {
        if step == warmup_steps && self.measured_from.is_none() {
            self.synchronize();
            self.measured_from = Some((self.train_elapsed(), self.tokens, self.samples));
            // The first recorded step starts with the window, so that the
            // recorded steps tile it: without this it also held the time
            // since the last warm-up step ended (the device finishing the
            // warm-up's queued work in the synchronize above, the host's
            // progress and checks, any time the process was not scheduled),
            // and its histogram could hold more than the window
            // (`harness verify` refused such an honest run on a loaded CPU).
            self.last_iter = Instant::now();
            comm.reset_timings();
        }
        let recording = step >= warmup_steps;
        self.timer.begin_step(recording);
        recording
    }

    /// A step that ran out of memory is retried: its time is not a step's.
    pub fn retry_step(&mut self) {
        self.last_iter = Instant::now();
    }

    /// After step `step` trained: reads the previous step's loss (the
    /// device has this one queued already) and queues this one's.
    pub fn trained(&mut self, step: u64, out: &mut Trained) -> Result<Duration> {
        self.tokens += out.tokens;
        self.samples += out.samples;
        self.read_loss()?;
        let now = self.train_elapsed();
        self.pending_loss = out.loss.take().map(|l| Pending::start(step, now.as_secs_f64(), &l)).transpose()?;
        Ok(now)
    }

    fn read_loss(&mut self) -> Result<()> {
        if let Some(p) = self.pending_loss.take() {
            let v = p.read()?;
            if !v.is_finite() {
                return Err(NonFiniteLoss { step: p.step, value: v }.into());
            }
            self.loss_curve.push((p.step, p.time_s, v));
            self.last_loss = Some(v);
        }
        Ok(())
    }

    /// Tokens per second since warm-up ended, at training time `now`.
    pub fn tokens_per_s(&self, now: Duration) -> Option<f64> {
        self.measured_from.map(|(t0, tok0, _)| (self.tokens - tok0) as f64 / (now.saturating_sub(t0)).as_secs_f64().max(1e-9))
    }

    /// What the policies are told after `done` steps, at training time `now`.
    pub fn telemetry(
        &mut self,
        done: u64,
        now: Duration,
        batch: &Batch,
        world: usize,
        grad_stats: Option<(f64, f64)>,
    ) -> Result<StepTelemetry> {
        Ok(StepTelemetry {
            step: done,
            loss: self.last_loss.unwrap_or(f64::NAN),
            step_time_s: self.last_iter.elapsed().as_secs_f64(),
            elapsed_s: now.as_secs_f64(),
            memory_used_bytes: self.step_memory()?,
            memory_total_bytes: self.memory_total_bytes,
            tokens_per_s: self.tokens_per_s(now).unwrap_or(0.0),
            micro_batch: batch.micro_batch,
            accum_steps: batch.accum_steps,
            world_size: world as u32,
            grad_sq_norm: grad_stats.map(|s| s.1),
            local_grad_sq_norm: grad_stats.map(|s| s.0),
            out_of_memory: false,
        })
    }

    /// The memory the step used. CUDA: the step's peak allocation, which is
    /// what a grown batch must fit; the allocator's peak restarts every
    /// step, and the entry's peak is the largest of them. CPU: the RSS.
    fn step_memory(&mut self) -> Result<u64> {
        Ok(match self.cuda {
            Some(i) => {
                let m = torch_ext::cuda_memory(i)?;
                self.peak_seen = (self.peak_seen.0.max(m.peak_allocated), self.peak_seen.1.max(m.peak_reserved));
                torch_ext::cuda_reset_peak(i)?;
                m.peak_allocated as u64
            }
            None => measure::rss_bytes().unwrap_or(0),
        })
    }

    /// A restore went back to step `to`: the curves after it are gone. A
    /// target already reached stays reached: a run that trains to a target
    /// stops there, so a failure after it does not count against the time
    /// to target (the eval point itself leaves the curve).
    pub fn rewind(&mut self, to: u64) {
        self.pending_loss = None;
        self.loss_curve.retain(|e| e.0 < to);
        self.eval_curve.retain(|e| e.0 <= to);
        self.accuracy_curve.retain(|e| e.0 <= to);
        self.synchronize();
    }

    /// The step is over (restores and retries excepted): its wall time
    /// goes into the step histogram.
    pub fn end_step(&mut self, recording: bool) {
        let iter = self.last_iter.elapsed();
        self.last_iter = Instant::now();
        if recording {
            measure::record(&mut self.step_hist, iter);
        }
    }

    /// Evaluates after `step` steps, with the training clock paused, and
    /// returns what `decide` makes of whether the target is reached (the
    /// ranks' agreement to stop, which waits for every rank's evaluation
    /// and so is evaluation time too). The device finishes the steps
    /// queued before the clock pauses: their time is training time. The
    /// next step's time leaves the evaluation out as well, so the recorded
    /// steps tile the training time that throughput is measured over,
    /// which `harness verify` checks.
    pub fn evaluate(&mut self, t: &Training, step: u64, decide: impl FnOnce(bool) -> Result<bool>) -> Result<bool> {
        self.synchronize();
        let t_eval = Instant::now();
        let t_train = self.train_elapsed().as_secs_f64();
        let ev = t.evaluate()?;
        self.eval_point(step, t_train, ev);
        let stop = decide(self.reached.is_some());
        let took = t_eval.elapsed();
        self.eval_time += took;
        self.last_iter += took;
        stop
    }

    fn eval_point(&mut self, step: u64, t_train: f64, ev: Evaluation) {
        self.eval_curve.push((step, t_train, ev.loss));
        if let Some(a) = ev.accuracy {
            self.accuracy_curve.push((step, t_train, a));
        }
        if self.reached.is_none() && self.target.reached(&ev) {
            self.reached = Some((step, t_train));
        }
    }

    /// After the last of `steps` steps: the last loss, the final eval
    /// (unless an evaluation after that very step is already on the curve,
    /// as when the entry stopped at its target). Returns the training time.
    pub fn close(&mut self, t: &Training, steps: u64) -> Result<Duration> {
        self.read_loss()?;
        self.synchronize();
        self.timer.flush()?;
        let train_time = self.train_elapsed();
        if self.eval_curve.last().is_none_or(|e| e.0 != steps) {
            let final_eval = t.evaluate()?;
            self.eval_point(steps, train_time.as_secs_f64(), final_eval);
        }
        Ok(train_time)
    }
}

/// What the loop leaves for the entry's figures besides the meter.
pub struct Outcome<'a> {
    pub steps: u64,
    pub train_time: Duration,
    pub batch_changes: Vec<(u64, u32, u32)>,
    /// Checkpoints, failures and out-of-memory retries, when the entry had
    /// any of them (else the results leave the section out).
    pub resilience: Option<ResilienceRecord>,
    pub comm: &'a CommStats,
}

/// The entry's figures and histograms on this rank.
pub fn entry_output(ctx: &EntryContext<'_>, t: &mut Training, m: Meter, o: Outcome<'_>) -> Result<EntryOutput> {
    let (steps, t_train, world) = (o.steps, o.train_time.as_secs_f64(), t.world);
    // Throughput after warm-up (or over everything if warm-up never ended).
    let (t0, tok0, s0) = m.measured_from.unwrap_or((Duration::ZERO, 0, 0));
    let window = o.train_time.saturating_sub(t0).as_secs_f64().max(1e-9);
    let tokens_per_s = (m.tokens - tok0) as f64 / window;
    let samples_per_s = (m.samples - s0) as f64 / window;
    let flops_per_token = t.cfg.flops_per_token(t.n_params);
    let achieved_tflops = flops_per_token * tokens_per_s / 1e12;
    let peak = ctx.peak_tflops;
    let memory = memory_record(&m, t.dp.outside_allocator_bytes() as i64)?;
    let ranks = vec![RankRecord {
        rank: t.rank as u32,
        memory: memory.clone(),
        optimizer_state_bytes: t.optimizer.state_bytes(),
        gradient_bytes: t.gradient_bytes,
    }];
    let (histograms, plugins, runtime) = histograms(t, &m, o.comm);
    let cs = o.comm;
    let (final_eval, reached) = (m.eval_curve.last().map(|e| e.2), m.reached);
    let mut model = serde_json::to_value(&t.cfg)?;
    if t.model.recompute() != Recompute::None {
        model["recompute"] = t.model.recompute().to_value();
    }
    let metrics = Metrics {
        model,
        parameters: t.n_params,
        precision: format!("{:?}", t.precision).to_lowercase(),
        steps,
        warmup_steps: ctx.warmup_steps.min(steps),
        tokens: m.tokens,
        samples: m.samples,
        train_time_s: t_train,
        tokens_per_s,
        samples_per_s,
        step: (!m.step_hist.is_empty()).then(|| LatencySummary::of(&m.step_hist)),
        phases: summaries(&m.timer.histograms),
        host_phases: summaries(&m.timer.host_histograms),
        flops_per_token,
        achieved_tflops,
        mfu: peak.map(|p| achieved_tflops / p),
        peak_tflops: peak,
        memory,
        final_train_loss: m.last_loss,
        final_eval_loss: final_eval,
        loss_floor: t.data.loss_floor(),
        target_loss: m.target.loss,
        final_eval_accuracy: m.accuracy_curve.last().map(|e| e.2),
        best_accuracy: t.data.best_accuracy().filter(|_| t.classifies()),
        target_accuracy: m.target.accuracy,
        accuracy_curve: m.accuracy_curve,
        time_to_target_s: reached.map(|r| r.1),
        steps_to_target: reached.map(|r| r.0),
        loss_curve: subsample(m.loss_curve, 512),
        eval_curve: m.eval_curve,
        skipped_steps: t.scaler.as_ref().map_or(0, |s| s.skipped_steps()),
        bytes_on_wire: cs.bytes_sent,
        world_size: world as u32,
        bucket_bytes: if world > 1 { t.bucket_bytes() } else { Vec::new() },
        unzeroed_buckets: t.unzeroed_buckets(),
        collectives: cs.collectives,
        collective: (cs.collectives > 0).then(|| LatencySummary::of(&cs.latency)),
        collective_emulated: (cs.collectives > 0 && cs.emulated_total != cs.measured_total).then(|| LatencySummary::of(&cs.emulated)),
        busbw_gbs: cs.bandwidth_gbs(world, false).map(|b| b.1),
        busbw_emulated_gbs: cs.bandwidth_gbs(world, true).map(|b| b.1).filter(|_| cs.emulated_total != cs.measured_total),
        collective_ops: collective_ops(cs, world),
        strategy_runtime: runtime,
        plugins,
        fused_cross_entropy: t.fused_ce,
        fused_layer_norm: t.model.fused_layer_norm(),
        cuda_graph_steps: t.graph_replays,
        nccl: None,
        overlapped_reduction: t.overlapped,
        zero: ctx.entry.strategy.zero,
        optimizer_state_bytes: t.optimizer.state_bytes(),
        gradient_bytes: t.gradient_bytes,
        ranks,
        batch_changes: o.batch_changes,
        checkpoints_written: o.resilience.as_ref().map_or(0, |r| r.checkpoints.len() as u64),
        goodput_steps_per_s: o.resilience.is_some().then(|| steps as f64 / t_train.max(1e-9)),
        resilience: o.resilience,
    };
    Ok(EntryOutput { metrics, histograms, warnings: t.warnings.clone() })
}

/// Peak memory: the process's RSS and, on CUDA, the device's peaks, with
/// `outside` bytes held beside libtorch's allocator for the whole entry
/// (symmetric gradient buffers) added to each.
fn memory_record(m: &Meter, outside: i64) -> Result<MemoryRecord> {
    let device = match m.cuda {
        Some(i) => Some(torch_ext::cuda_memory(i)?),
        None => None,
    };
    Ok(MemoryRecord {
        peak_rss_bytes: measure::peak_rss_bytes(),
        peak_device_allocated_bytes: device.as_ref().map(|d| d.peak_allocated.max(m.peak_seen.0) + outside),
        peak_device_reserved_bytes: device.as_ref().map(|d| d.peak_reserved.max(m.peak_seen.1) + outside),
        peak_step_allocated_bytes: device.as_ref().map(|_| m.peak_seen.0 + outside),
    })
}

/// Every histogram of the entry, encoded (step, phases, host phases,
/// collectives, plugin calls), the plugins' records and the strategies'
/// runtime (built-in, wasm, or native).
fn histograms(
    t: &mut Training,
    m: &Meter,
    cs: &CommStats,
) -> (BTreeMap<String, String>, Vec<harness_sandbox::plugin::PluginRecord>, String) {
    let mut histograms = BTreeMap::new();
    let reports = t.strategies.plugin_reports();
    let runtime = match reports.iter().map(|r| r.0.manifest.transport).collect::<std::collections::BTreeSet<_>>() {
        t if t.is_empty() => "built-in".to_owned(),
        t if t.contains(&harness_sandbox::plugin::Transport::Native) => "native (unsandboxed)".to_owned(),
        _ => "wasm".to_owned(),
    };
    let mut plugin_records = Vec::new();
    for (rec, hist) in reports {
        histograms.insert(format!("plugin.{}", rec.slot), hist);
        plugin_records.push(rec);
    }
    histograms.insert("step".to_owned(), measure::encode(&m.step_hist));
    if cs.collectives > 0 {
        histograms.insert("collective".to_owned(), measure::encode(&cs.latency));
        histograms.insert("collective.emulated".to_owned(), measure::encode(&cs.emulated));
    }
    for (p, h) in m.timer.histograms.iter().filter(|(_, h)| !h.is_empty()) {
        histograms.insert(p.name().to_owned(), measure::encode(h));
    }
    for (p, h) in m.timer.host_histograms.iter().filter(|(_, h)| !h.is_empty()) {
        histograms.insert(format!("host.{}", p.name()), measure::encode(h));
    }
    (histograms, plugin_records, runtime)
}

/// Percentile summaries of the phases that ran.
fn summaries<'a>(hists: impl IntoIterator<Item = (&'a measure::Phase, &'a Histogram<u64>)>) -> BTreeMap<String, LatencySummary> {
    hists.into_iter().filter(|(_, h)| !h.is_empty()).map(|(p, h)| (p.name().to_owned(), LatencySummary::of(h))).collect()
}

/// Per collective kind: counts, bytes, latency and bus bandwidth.
fn collective_ops(cs: &CommStats, world: usize) -> BTreeMap<String, CollectiveOpRecord> {
    cs.ops
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
        .collect()
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
