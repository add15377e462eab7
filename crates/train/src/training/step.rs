//! One training step, and the data-parallel protocol inside it: the forward
//! and backward passes (with gradient accumulation and the all-reduce
//! overlapped with the backward pass), the compressor's reduction of the
//! gradient buckets, the optimizer update and, under ZeRO, the gathering of
//! the parameters. Callers see one call, [`Training::step`], so the order of
//! the data-parallel calls cannot be got wrong.

use anyhow::{Context, Result};
use tch::Tensor;

use super::Pending;
use super::{Stepped, Trained, Training};
use crate::batch::Batch;
use crate::data;
use crate::dp;
use crate::models as model;
use harness_kernels::kernels;
use harness_kernels::torch_ext::{self, Lr};
use harness_runtime::comm::{any_rank, Collective};
use harness_runtime::measure::{Phase, PhaseTimer};

impl Training {
    /// Trains one step of `batch` at learning rate `lr`; `step` counts from 0.
    /// Replays the step's CUDA graph where the entry's step is captured
    /// (see [`super::graph`]), else runs it eagerly.
    pub fn step(&mut self, comm: &mut dyn Collective, batch: &Batch, timer: &mut PhaseTimer, step: u64, lr: f64) -> Result<Stepped> {
        match self.graph_step(comm, batch, timer, step, lr)? {
            Some(stepped) => Ok(stepped),
            None => self.eager_step(comm, batch, timer, step, lr, None),
        }
    }

    /// One step, each operation queued from the host as it comes. `fed`:
    /// the step's micro-batch when already drawn (accumulation 1).
    pub(super) fn eager_step(
        &mut self,
        comm: &mut dyn Collective,
        batch: &Batch,
        timer: &mut PhaseTimer,
        step: u64,
        lr: f64,
        fed: Option<&data::Batch>,
    ) -> Result<Stepped> {
        self.dp.begin_step()?;
        let emulated = self.oom.emulated(batch.micro_batch);
        let mut out = Trained { loss: None, tokens: 0, samples: 0, grad_stats: None };
        let guard = self.oom;
        let mut oom = emulated || guard.catch(|| self.passes(comm, batch, timer, &mut out, fed))?;
        if guard.agree {
            oom = any_rank(comm, oom, self.device)?;
        }
        if oom {
            // Drop the step: nothing was reduced or updated.
            timer.stop()?;
            self.dp.disarm_overlap();
            if self.autocast.on() {
                torch_ext::autocast_clear_cache()?;
            }
            timer.begin_step(false);
            timer.end_step()?;
            return Ok(Stepped::OutOfMemory { emulated });
        }
        self.dp.check_grads(&self.params)?;
        let (grads, check) = self.communicate(comm, timer, step, &mut out)?;
        self.update(comm, timer, grads, check, step, Lr::Host(lr))?;
        Ok(Stepped::Trained(out))
    }

    /// Forward and backward over the step's micro-batches, accumulating
    /// the gradients in the buckets. `fed`: the one micro-batch, already
    /// drawn (else each is drawn from the data stream).
    pub(super) fn passes(
        &mut self,
        comm: &mut dyn Collective,
        batch: &Batch,
        timer: &mut PhaseTimer,
        out: &mut Trained,
        fed: Option<&data::Batch>,
    ) -> Result<()> {
        let accum = batch.accum_steps;
        anyhow::ensure!(fed.is_none() || accum == 1, "a drawn micro-batch is fed to steps of one micro-batch only");
        // The fused layers' weights cast to bf16 once for all the passes
        // (HARNESS_FUSED_CASTS=0 leaves each layer to cast its own, a
        // diagnostic).
        let casts = self.model.uses_fused_kernels() && harness_format::switches::get().fused_casts;
        // ZeRO's prefetch: the last update's parameters are still being
        // gathered; the forward pass's layers wait for their own buckets
        // (GPT), other models for all of them here.
        if !self.model.waits_per_layer() {
            crate::gate::settle()?;
        }
        let _casts = if casts { Some(crate::models::fused::WeightCasts::new(&self.params)?) } else { None };
        for micro in 0..accum {
            timer.start(Phase::Data)?;
            let b = match fed {
                Some(f) => f.to_device(self.device),
                None => self.data.next_train(batch.micro_batch as usize),
            };
            timer.stop()?;
            timer.start(Phase::Forward)?;
            let (loss, seed) = match self.model.forward(&b.input, &b.target, true) {
                model::Output::Logits { logits, target } if self.fused_ce => {
                    let scale = self.scaler.as_ref().map(|s| &s.scale);
                    // The gradient over the logits: nothing reads them again
                    // (the output layer's backward pass keeps its input).
                    let (loss, grad) = kernels::cross_entropy_bf16(&logits, &target, 1.0 / accum as f32, scale, true)?;
                    (loss, Some((logits, grad)))
                }
                model::Output::Logits { logits, target } => (model::token_loss(&logits, &target), None),
                model::Output::Loss(l) => (l, None),
            };
            // The input is not needed after the forward pass (autograd keeps
            // what the backward pass reads, e.g. its bf16 cast under
            // autocast): let go of it before the backward pass's peak.
            let (tokens, samples) = (b.tokens, b.samples);
            drop(b);
            // Parameters the forward pass did not read: gathered before the
            // backward pass and the update.
            crate::gate::settle()?;
            if self.autocast.on() {
                torch_ext::autocast_clear_cache()?;
            }
            timer.stop()?;
            // ZeRO-2 allocates its released gradient buffers here, outside
            // the backward phase (the other stages zero theirs at step start).
            self.dp.before_backward(&self.params)?;
            self.dp.arm_overlap(comm, micro + 1 == accum);
            timer.start(Phase::Backward)?;
            let autocast_off = self.autocast.paused()?;
            match seed {
                Some((logits, grad)) => torch_ext::backward_with_grad(&logits, &grad)?,
                None => {
                    let mut scaled = if accum > 1 { &loss / accum as f64 } else { loss.shallow_clone() };
                    if let Some(s) = &self.scaler {
                        scaled = &scaled * &s.scale;
                    }
                    scaled.backward();
                }
            }
            drop(autocast_off);
            self.dp.disarm_overlap();
            timer.stop()?;
            let l = if accum > 1 { loss.detach() / accum as f64 } else { loss.detach() };
            out.loss = Some(match out.loss.take() {
                Some(acc) => acc + l,
                None => l,
            });
            out.tokens += tokens as u64;
            out.samples += samples as u64;
        }
        Ok(())
    }

    /// The compressor reduces the gradient buckets across ranks. Returns
    /// the reduced gradients and how the compressor's output is still to
    /// be checked for NaN/inf.
    pub(super) fn communicate(
        &mut self,
        comm: &mut dyn Collective,
        timer: &mut PhaseTimer,
        step: u64,
        out: &mut Trained,
    ) -> Result<(Vec<Tensor>, OutputCheck)> {
        let sharded = self.dp.sharded();
        let local_sq = if self.grad_stats { Some(self.dp.grad_sq_norm()?) } else { None };
        // A plugin compressor's output is checked for NaN/inf through a norm
        // of the reduced gradients, the one computed anyway if there is one
        // (clipping, the batch policy's statistics). Else, on a device,
        // through their sum (one pass, read a step later); on the CPU, each
        // bucket is scanned directly as the compressor hands it back.
        let check = self.strategies.compressor.checks_output() && !sharded;
        let scan = check && !self.device.is_cuda() && self.grad_clip.is_none() && !self.grad_stats;
        timer.start(Phase::Communicate)?;
        if sharded {
            self.dp
                .reduce(&self.params, self.strategies.compressor.as_mut(), comm, step, false)
                .context("the reduce-scatter of the gradients failed")?;
        } else {
            self.dp.reduce(&self.params, self.strategies.compressor.as_mut(), comm, step, scan)?;
        }
        timer.stop()?;
        let grads = self.dp.grads()?;
        // The statistics are copied to the host behind an event and read a
        // step later, as the loss is, so that no step waits for the device.
        let stats_prev = self.stats_in_flight.take();
        let mut global_sq = None;
        if let Some(mut local) = local_sq {
            let global = self.dp.grad_sq_norm()?;
            global_sq = Some(global.shallow_clone());
            if self.world > 1 {
                comm.all_reduce_sum(&mut local)?;
            }
            let pair = Tensor::cat(&[local / self.world as f64, global], 0);
            self.stats_in_flight = Some(Pending::start(step, 0.0, &pair)?);
        }
        out.grad_stats = stats_prev.map(|p| p.read_pair()).transpose()?;
        let check = match (check, scan) {
            (true, false) => OutputCheck::ByNorm(global_sq),
            _ => OutputCheck::Done,
        };
        Ok((grads, check))
    }

    /// Loss scaling, clipping, the check of the compressor's output and the
    /// optimizer step; under ZeRO, every rank then gathers the parameters.
    pub(super) fn update(
        &mut self,
        comm: &mut dyn Collective,
        timer: &mut PhaseTimer,
        grads: Vec<Tensor>,
        check: OutputCheck,
        step: u64,
        lr: Lr<'_>,
    ) -> Result<()> {
        let sharded = self.dp.sharded();
        timer.start(Phase::Optimizer)?;
        if let Some(s) = &mut self.scaler {
            s.unscale(&grads)?;
            if sharded {
                // Each rank saw only its shard: skip the step everywhere if
                // any rank overflowed (the kernels skip on exactly 1).
                comm.all_reduce_sum(&mut s.found_inf)?;
                let _ = s.found_inf.clamp_max_(1.0);
            }
        }
        let mut clip_norm = None;
        let mut grad_scale = None;
        if let Some(max) = self.grad_clip {
            // The norm: under ZeRO over the ranks' shards; with several
            // ranks over a world-th of the averaged gradients each
            // (HARNESS_SHARED_NORM=0: each reads them all); an all-reduce of
            // one number adds the squares up. Not where the norm checks a
            // plugin's output: each rank then reads all of its own, which a
            // hostile compressor may have left different from the others'.
            let checks_plugin = matches!(check, OutputCheck::ByNorm(_));
            let shared = harness_format::switches::get().shared_norm && !checks_plugin;
            let share = if shared { self.dp.norm_share()? } else { None };
            let spread = if sharded { Some(grads.as_slice()) } else { share.as_deref() };
            let norm = spread.map(|parts| dp::global_norm(parts, comm, self.device)).transpose()?;
            if self.scaler.is_none() && self.optimizer.takes_grad_scale() {
                // Clipping folded into the update: the fused AdamW kernel
                // divides each gradient by max(1, (norm + 1e-6) / max) as it
                // reads it, which is torch.nn.utils.clip_grad_norm_'s factor
                // min(1, max / (norm + 1e-6)) without the pass over every
                // gradient that applies it (1.9 ms of a 147 ms step of the
                // 1.3B preset on an H100).
                let norm = match norm {
                    Some(n) => n,
                    None => torch_ext::clip_grad_norm(&grads, None)?,
                };
                grad_scale = Some(((&norm + 1e-6) / max).clamp_min(1.0));
                clip_norm = Some(norm);
            } else if let Some(norm) = norm {
                dp::scale_to_norm(&grads, &norm, max);
                clip_norm = Some(norm);
            } else {
                clip_norm = Some(torch_ext::clip_grad_norm(&grads, Some(max))?);
            }
        }
        if let OutputCheck::ByNorm(global_sq) = check {
            let norm = match clip_norm.or(global_sq) {
                Some(n) => n,
                None => self.dp.grad_checksum(&grads),
            };
            let dp = &self.dp;
            self.strategies.compressor.check_output(step, &norm, &|| dp.first_non_finite_bucket())?;
        }
        let (found_inf, grad_scale) = (self.scaler.as_ref().map(|s| &s.found_inf), grad_scale.as_ref());
        match self.dp.lead_targets() {
            // ZeRO's prefetch: the bucket the next forward pass reads first
            // is updated first, and its gather starts beside the rest.
            Some(lead) => {
                self.optimizer.step_where(&self.targets, &grads, lr, found_inf, grad_scale, &|i| lead[i])?;
                self.dp.start_lead_gather(comm)?;
                self.optimizer.step_where(&self.targets, &grads, lr, found_inf, grad_scale, &|i| !lead[i])?;
            }
            None => self.optimizer.step(&self.targets, &grads, lr, found_inf, grad_scale)?,
        }
        if let Some(s) = &mut self.scaler {
            s.update();
        }
        timer.stop()?;
        drop(grads);
        self.gradient_bytes = self.gradient_bytes.max(self.dp.gradient_bytes());
        if sharded {
            timer.start(Phase::Communicate)?;
            self.dp.gather_params(comm).context("gathering the parameters failed")?;
            timer.stop()?;
        }
        Ok(())
    }

    /// Every parameter as the last update left it (ZeRO's prefetch leaves
    /// the gathers running into the next step's forward pass): for
    /// whatever reads them between steps.
    pub fn params_current(&self) -> Result<()> {
        self.dp.params_current()
    }

    /// After a restore: statistics in flight belong to the lost steps, and
    /// a captured step may hold state the restore replaced.
    pub fn forget_in_flight(&mut self) {
        self.stats_in_flight = None;
        self.graph.reset();
    }
}

/// How the compressor's output is checked after the reduction.
pub(super) enum OutputCheck {
    /// Scanned bucket by bucket during the reduction, or not checked.
    Done,
    /// Through a norm of the reduced gradients: the clipping norm, else the
    /// given squared norm, else a checksum.
    ByNorm(Option<Tensor>),
}
