//! The one-rank training step as a CUDA graph: captured once, then replayed
//! every step with the new batch copied into its input and the scheduled
//! learning rate written to a device scalar. A replay launches the step's
//! few thousand kernels in one call, so the GPU no longer waits between
//! them for the host to issue the next (launch gaps are what separates a
//! small model's step from its kernels' time).
//!
//! The maths are the eager step's: the same operations, captured from it.
//! The device learning rate is read as an fp32 scalar where the eager step
//! passes a double (the fused AdamW kernel), so updates may differ in the
//! last bits.
//!
//! A step is captured only where nothing in it depends on the host between
//! its kernels: one CUDA rank whose gradients are autograd's own (no
//! collectives, no compressor), bf16 or fp32 (fp16's loss scaling decides
//! on the host), no gradient statistics for a batch policy, no emulated
//! memory limit, no activation recomputation, one micro-batch a step, and a
//! model family checked under capture (gpt, encoder, mlp, vision). Everything else,
//! and any step whose capture fails, runs eagerly.
//!
//! At each micro-batch size the first step runs eagerly, the second on the
//! capture's stream (libraries set up per-stream state on first use, which
//! must not happen inside a capture), the third is captured and replayed,
//! and the rest are replayed. A new micro-batch size (a batch policy) or a
//! restore from a checkpoint (which may replace state the graph captured)
//! starts this again. Those first steps' phases are not timed on the
//! device; a replayed step's device time is the `graph` phase.

use anyhow::{Context, Result};
use tch::{Kind, Tensor};

use super::Training;
use super::{Stepped, Trained};
use crate::batch::Batch;
use crate::data;
use harness_kernels::torch_ext::{CudaGraph, Lr};
use harness_runtime::comm::Collective;
use harness_runtime::measure::{Phase, PhaseTimer};

/// Where an entry's step graph stands.
pub enum StepGraph {
    /// Every step runs eagerly.
    Off,
    /// Eager steps run at `micro_batch` so far (capture follows two), and
    /// the graph whose stream the second ran on.
    Warming {
        micro_batch: u32,
        steps: u32,
        graph: Option<CudaGraph>,
    },
    Ready(Box<Captured>),
}

/// A captured step and the tensors it reads and writes, at fixed addresses.
/// Dropping it hands the graph's memory back to the driver.
pub struct Captured {
    graph: Option<CudaGraph>,
    micro_batch: u32,
    input: Tensor,
    target: Tensor,
    /// The learning rate (fp32 scalar), written before each replay.
    lr: Tensor,
    /// The step's loss, written by each replay.
    loss: Tensor,
}

impl Captured {
    fn replay(&self) -> Result<()> {
        self.graph.as_ref().context("the step's graph was released")?.replay()?;
        Ok(())
    }
}

impl Drop for Captured {
    /// The graph goes first (its pool is released with it), then the
    /// tensors in that pool, then the allocator hands the freed memory back
    /// to the driver: an entry that follows (or the eager steps of another
    /// micro-batch size) would otherwise find it cached for a pool that no
    /// longer exists, and reserve as much again.
    fn drop(&mut self) {
        self.graph = None;
        for t in [&mut self.input, &mut self.target, &mut self.lr, &mut self.loss] {
            *t = Tensor::new();
        }
        let _ = harness_kernels::torch_ext::cuda_empty_cache();
    }
}

impl StepGraph {
    pub fn new(eligible: bool) -> StepGraph {
        if eligible {
            StepGraph::Warming { micro_batch: 0, steps: 0, graph: None }
        } else {
            StepGraph::Off
        }
    }

    /// Captures again from the start (after a restore from a checkpoint).
    pub fn reset(&mut self) {
        if !matches!(self, StepGraph::Off) {
            *self = StepGraph::new(true);
        }
    }
}

/// Whether an entry's step may be captured (see the module's doc).
#[derive(Debug, Clone, Copy)]
pub struct Eligibility {
    pub cuda: bool,
    pub world: usize,
    pub local_grads: bool,
    pub loss_scaling: bool,
    pub grad_stats: bool,
    pub emulated_memory_limit: bool,
    pub recompute: bool,
    pub family_checked: bool,
}

impl Eligibility {
    /// Why the step cannot be captured, or None when it can.
    pub fn why_not(&self) -> Option<&'static str> {
        let reasons = [
            (!self.cuda, "it trains on the CPU"),
            (self.world != 1, "it trains on more than one rank"),
            (!self.local_grads, "its gradients go through buckets (a compressor plugin or ZeRO)"),
            (self.loss_scaling, "fp16 loss scaling decides on the host"),
            (self.grad_stats, "its batch policy reads gradient statistics"),
            (self.emulated_memory_limit, "it emulates a memory limit"),
            (self.recompute, "it recomputes activations"),
            (!self.family_checked, "its model family is not checked under capture (gpt, encoder, mlp and vision are)"),
            (!harness_kernels::torch_ext::has_cuda_graphs(), "this build's libtorch shim has no CUDA graphs"),
        ];
        reasons.into_iter().find_map(|(applies, why)| applies.then_some(why))
    }

    /// The entry's step graph: captured when `allowed` (the workload's
    /// `cuda_graph`, or `HARNESS_CUDA_GRAPH`) and eligible; allowed and
    /// not eligible, eager with a warning that says why.
    pub fn graph(self, allowed: bool, warnings: &mut Vec<String>) -> StepGraph {
        let why_not = self.why_not();
        if let (true, Some(why)) = (allowed, why_not) {
            warnings.push(format!("cuda_graph: every step runs eagerly, since {why}"));
        }
        StepGraph::new(allowed && why_not.is_none())
    }
}

impl Training {
    /// The step through the graph, when this entry's steps are captured:
    /// None when this step is to run eagerly on libtorch's stream.
    pub(super) fn graph_step(
        &mut self,
        comm: &mut dyn Collective,
        batch: &Batch,
        timer: &mut PhaseTimer,
        step: u64,
        lr: f64,
    ) -> Result<Option<Stepped>> {
        let mb = batch.micro_batch;
        if matches!(self.graph, StepGraph::Off) {
            return Ok(None);
        }
        if batch.accum_steps != 1 {
            self.graph.reset();
            return Ok(None);
        }
        match std::mem::replace(&mut self.graph, StepGraph::Off) {
            StepGraph::Ready(c) if c.micro_batch == mb => {
                let out = self.replay(&c, timer, lr);
                self.graph = StepGraph::Ready(c);
                Ok(Some(Stepped::Trained(out?)))
            }
            StepGraph::Warming { micro_batch, steps: 1, graph } if micro_batch == mb => {
                let mut g = match graph {
                    Some(g) => g,
                    None => CudaGraph::new()?,
                };
                let mut quiet = PhaseTimer::new(false);
                // The side stream cannot take blocks cached for libtorch's
                // stream, nor the capture's pool blocks cached for either:
                // each hands its cache back first, so that the step's
                // memory is held once, not three times.
                release_cache(self.device, "before the warm-up on the capture's stream")?;
                let stepped = g.on_side_stream(|| self.eager_step(comm, batch, &mut quiet, step, lr, None));
                release_cache(self.device, "after the warm-up on the capture's stream")?;
                self.graph = StepGraph::Warming { micro_batch: mb, steps: 2, graph: Some(g) };
                stepped.map(Some)
            }
            StepGraph::Warming { micro_batch, steps, graph } if micro_batch == mb && steps >= 2 => {
                let g = match graph {
                    Some(g) => g,
                    None => CudaGraph::new()?,
                };
                self.capture(g, comm, batch, timer, step, lr).map(Some)
            }
            _ => {
                // A new micro-batch size (or the first step): eager, once.
                // A graph of another size has gone, its pool with it.
                self.graph = StepGraph::Warming { micro_batch: mb, steps: 1, graph: None };
                Ok(None)
            }
        }
    }

    /// Captures this step and replays it (capture runs nothing). If the
    /// capture fails, the entry's steps run eagerly from this one on, with
    /// a warning.
    fn capture(
        &mut self,
        mut g: CudaGraph,
        comm: &mut dyn Collective,
        batch: &Batch,
        timer: &mut PhaseTimer,
        step: u64,
        lr: f64,
    ) -> Result<Stepped> {
        timer.start(Phase::Data)?;
        let b = self.data.next_train(batch.micro_batch as usize);
        timer.stop()?;
        // The graph's inputs: copies the graph reads from at every replay.
        let fed = data::Batch { input: b.input.copy(), target: b.target.copy(), tokens: b.tokens, samples: b.samples };
        drop(b);
        let lr_t = Tensor::full([], lr, (Kind::Float, self.device));
        // Gradients start as none (allocated by the captured backward pass,
        // from the graph's pool, and written in place by every replay).
        self.dp.begin_step()?;
        let mut out = Trained { loss: None, tokens: 0, samples: 0, grad_stats: None };
        let mut quiet = PhaseTimer::new(false);
        let captured = g.capture(|| {
            self.passes(comm, batch, &mut quiet, &mut out, Some(&fed))?;
            let (grads, check) = self.communicate(comm, &mut quiet, step, &mut out)?;
            self.update(comm, &mut quiet, grads, check, step, Lr::Device(&lr_t))
        });
        if let Err(e) = captured {
            self.warnings.push(format!(
                "capturing the training step as a CUDA graph failed at step {step} ({}); the entry's steps run eagerly",
                harness_format::error::without_backtrace(&format!("{e:#}"))
            ));
            self.graph = StepGraph::Off;
            return self.eager_step(comm, batch, timer, step, lr, Some(&fed));
        }
        release_cache(self.device, "after the capture")?;
        let loss = out.loss.take().context("the captured step computed no loss")?;
        let c = Captured { graph: Some(g), micro_batch: batch.micro_batch, input: fed.input, target: fed.target, lr: lr_t, loss };
        timer.start(Phase::Graph)?;
        c.replay()?;
        timer.stop()?;
        out.loss = Some(c.loss.copy());
        self.graph = StepGraph::Ready(Box::new(c));
        self.graph_replays += 1;
        Ok(Stepped::Trained(out))
    }

    /// One step by replaying the graph with the next batch.
    fn replay(&mut self, c: &Captured, timer: &mut PhaseTimer, lr: f64) -> Result<Trained> {
        timer.start(Phase::Data)?;
        let b = self.data.next_train(c.micro_batch as usize);
        timer.stop()?;
        tch::no_grad(|| {
            c.input.shallow_clone().copy_(&b.input);
            c.target.shallow_clone().copy_(&b.target);
            let _ = c.lr.shallow_clone().fill_(lr);
        });
        timer.start(Phase::Graph)?;
        c.replay()?;
        timer.stop()?;
        self.graph_replays += 1;
        Ok(Trained { loss: Some(c.loss.copy()), tokens: b.tokens as u64, samples: b.samples as u64, grad_stats: None })
    }
}

/// Hands the allocator's unused cached blocks back to the driver (waits for
/// the device; warm-up steps only). `HARNESS_GRAPH_DEBUG=1` prints the
/// allocator's figures at each such point.
fn release_cache(device: tch::Device, when: &str) -> Result<()> {
    harness_kernels::torch_ext::cuda_empty_cache()?;
    if harness_format::switches::get().graph_debug {
        let tch::Device::Cuda(dev) = device else { return Ok(()) };
        let m = harness_kernels::torch_ext::cuda_memory(dev)?;
        let gib = |b: i64| b as f64 / (1u64 << 30) as f64;
        eprintln!(
            "harness: CUDA graph, {when}: allocated {:.2} GiB (peak {:.2}), reserved {:.2} GiB (peak {:.2})",
            gib(m.allocated),
            gib(m.peak_allocated),
            gib(m.reserved),
            gib(m.peak_reserved)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_captured_only_where_nothing_in_it_decides_on_the_host() {
        let ok = Eligibility {
            cuda: true,
            world: 1,
            local_grads: true,
            loss_scaling: false,
            grad_stats: false,
            emulated_memory_limit: false,
            recompute: false,
            family_checked: true,
        };
        let built_with_graphs = harness_kernels::torch_ext::has_cuda_graphs();
        assert_eq!(ok.why_not().is_none(), built_with_graphs);
        let cases = [
            (Eligibility { cuda: false, ..ok }, "CPU"),
            (Eligibility { world: 2, ..ok }, "more than one rank"),
            (Eligibility { local_grads: false, ..ok }, "buckets"),
            (Eligibility { loss_scaling: true, ..ok }, "fp16"),
            (Eligibility { grad_stats: true, ..ok }, "gradient statistics"),
            (Eligibility { emulated_memory_limit: true, ..ok }, "memory limit"),
            (Eligibility { recompute: true, ..ok }, "recomputes"),
            (Eligibility { family_checked: false, ..ok }, "model family"),
        ];
        for (e, says) in cases {
            let why = e.why_not().expect("not eligible");
            assert!(why.contains(says), "{why} should say {says}");
        }
    }
}
