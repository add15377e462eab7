//! Strategies: the three decisions a training run delegates (how gradients
//! are reduced, how large the next batch is, when to checkpoint), as traits.
//!
//! The built-in strategies (plain all-reduce, a fixed batch size, no
//! checkpoints) implement these traits directly; plugins (WASM or native,
//! in `plugin/`) implement them through adapters that time and validate
//! every call. This module names no plugin code: `plugin/strategies.rs`
//! assembles an entry's [`Strategies`] (`Strategies::build`) and reaches
//! the plugin behind a strategy through [`Compressor::plugin_any`] and its
//! siblings.

use std::any::Any;

use tch::Tensor;

/// What the host tells policies after each step (the WIT `step-telemetry`).
#[derive(Debug, Clone, Default)]
pub struct StepTelemetry {
    pub step: u64,
    pub loss: f64,
    pub step_time_s: f64,
    pub elapsed_s: f64,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub tokens_per_s: f64,
    pub micro_batch: u32,
    pub accum_steps: u32,
    pub world_size: u32,
    pub grad_sq_norm: Option<f64>,
    pub local_grad_sq_norm: Option<f64>,
    pub out_of_memory: bool,
}

/// Where a gradient bucket sits in the step.
#[derive(Debug, Clone, Copy, Default)]
pub struct BucketCtx {
    /// Step being computed (0-based).
    pub step: u64,
    pub index: usize,
    pub count: usize,
}

/// One parameter's gradient in a bucket (the WIT `param-slot`, contract 0.2).
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSlot {
    /// The parameter's name in the model.
    pub name: String,
    pub shape: Vec<u64>,
    /// Offset of its first element in the bucket (elements).
    pub offset: u64,
    pub numel: u64,
    /// Element type of the bucket.
    pub dtype: tch::Kind,
    /// Two or more dimensions: a weight matrix.
    pub weight: bool,
}

/// What a gradient bucket holds (the WIT `bucket-layout`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BucketLayout {
    /// Elements of the bucket.
    pub numel: u64,
    /// Its parameters, by ascending offset.
    pub params: Vec<ParamSlot>,
}

impl BucketLayout {
    /// A bucket of `params` (name, shape) laid out back to back, of `dtype`.
    pub fn packed<'a>(params: impl IntoIterator<Item = (&'a str, &'a [i64])>, dtype: tch::Kind) -> BucketLayout {
        let mut layout = BucketLayout::default();
        for (name, shape) in params {
            let numel = shape.iter().product::<i64>().max(0) as u64;
            layout.params.push(ParamSlot {
                name: name.to_owned(),
                shape: shape.iter().map(|&d| d.max(0) as u64).collect(),
                offset: layout.numel,
                numel,
                dtype,
                weight: shape.len() >= 2,
            });
            layout.numel += numel;
        }
        layout
    }
}

/// A checkpoint policy plugin's answer: snapshot, persist, steps to delete.
pub type CheckpointAnswer = (bool, bool, Vec<u64>);

/// A batch decision (the WIT `batch`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchDecision {
    pub micro_batch: u32,
    pub accum_steps: u32,
    /// Multiplier on the scheduled learning rate.
    pub lr_scale: f64,
}

pub use harness_runtime::comm::{Collective, SingleRank};

/// Reduces gradients across ranks, leaving the average in place.
pub trait Compressor {
    /// Tells the compressor what its buckets hold, once, before the first
    /// `reduce` (and before a state is loaded into it).
    fn setup(&mut self, _buckets: &[BucketLayout]) -> anyhow::Result<()> {
        Ok(())
    }
    /// Reduces one bucket: the flattened gradients of consecutive parameters.
    fn reduce(&mut self, bucket: &mut Tensor, comm: &mut dyn Collective, ctx: &BucketCtx) -> anyhow::Result<()>;
    /// True for the plain all-reduce average, which the data-parallel code
    /// may run as asynchronous all-reduces during the backward pass instead
    /// of calling `reduce`.
    fn is_plain_average(&self) -> bool {
        false
    }
    /// Whether the trainer must check this compressor's output, the reduced
    /// gradients, for NaN/inf after every step ([`Compressor::check_output`]).
    fn checks_output(&self) -> bool {
        false
    }
    /// Checks the reduced gradients of `step`, given a norm of them that is
    /// NaN or infinite when any element is (the clipping norm, or a squared
    /// norm). `locate` finds the first non-finite bucket (a pass per bucket;
    /// called only on failure).
    fn check_output(&mut self, _step: u64, _norm: &tch::Tensor, _locate: &dyn Fn() -> Option<usize>) -> anyhow::Result<()> {
        Ok(())
    }
    /// After the last step: checks still pending on the device.
    fn finish(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
    /// The plugin instance behind this strategy, if it is one (for its state
    /// in checkpoints and its report); `plugin_mut` in `plugin/strategies.rs`
    /// gives it its type.
    fn plugin_any(&mut self) -> Option<&mut dyn Any> {
        None
    }
}

/// Decides the micro-batch size, accumulation steps and learning-rate scale.
pub trait BatchPolicy {
    /// Before the first step, given the workload's batch.
    fn initial(&mut self, configured: BatchDecision) -> anyhow::Result<BatchDecision> {
        Ok(configured)
    }
    /// Called after every step.
    fn next(&mut self, t: &StepTelemetry) -> anyhow::Result<BatchDecision>;
    /// Whether `next` should get `grad_sq_norm` / `local_grad_sq_norm`
    /// (asked once, before `initial`). They cost a norm pass a step and the
    /// overlap of the all-reduce with the backward pass. Default: false.
    fn wants_gradient_stats(&mut self) -> anyhow::Result<bool> {
        Ok(false)
    }
    /// The plugin instance behind this strategy, if it is one (for its state
    /// in checkpoints and its report); `plugin_mut` in `plugin/strategies.rs`
    /// gives it its type.
    fn plugin_any(&mut self) -> Option<&mut dyn Any> {
        None
    }
}

/// What the host knows about checkpoints and failures, for the policy.
#[derive(Debug, Clone, Default)]
pub struct CheckpointHistory {
    /// What the last checkpoint cost training, seconds: its stall plus the
    /// slowdown of the steps that overlapped its persist so far (with
    /// `checkpoint_async = false`, the whole write).
    pub last_cost_s: Option<f64>,
    /// Steps of the checkpoints on disk (durable), oldest first.
    pub saved: Vec<u64>,
    /// Steps at which failures struck.
    pub failures: Vec<u64>,
    /// Training seconds since the last checkpoint (either tier) or restore
    /// (or the start).
    pub since_last_s: f64,
    /// Steps of the snapshots held in host memory (the newest one).
    pub in_memory: Vec<u64>,
    /// The step whose checkpoint the background writer is persisting.
    pub persisting: Option<u64>,
    /// Seconds training stopped for the last snapshot.
    pub last_stall_s: Option<f64>,
    /// Seconds the last completed persist took, from its start to durable.
    pub last_persist_s: Option<f64>,
    /// Extra seconds of the steps that overlapped the last checkpoint's
    /// snapshot copy and persist, over the steps that did not.
    pub last_slowdown_s: Option<f64>,
}

/// A checkpoint policy's decision after a step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CheckpointDecision {
    /// Snapshot the current step now (into host memory).
    pub save: bool,
    /// Persist that snapshot to disk too (policies of the first contract
    /// persist every snapshot).
    pub persist: bool,
    /// Steps of saved checkpoints to delete (each in `saved`).
    pub delete: Vec<u64>,
}

/// Decides when to checkpoint and which checkpoints to keep.
pub trait CheckpointPolicy {
    /// Called after every step.
    fn decide(&mut self, t: &StepTelemetry, h: &CheckpointHistory) -> anyhow::Result<CheckpointDecision>;
    /// True for the built-in `none`, which never saves (the host then skips
    /// the per-step agreement between ranks).
    fn never_saves(&self) -> bool {
        false
    }
    /// The plugin instance behind this strategy, if it is one (for its state
    /// in checkpoints and its report); `plugin_mut` in `plugin/strategies.rs`
    /// gives it its type.
    fn plugin_any(&mut self) -> Option<&mut dyn Any> {
        None
    }
}

/// Plain all-reduce of full-precision gradients, then division by the world.
#[derive(Debug, Default)]
pub struct AllReduce;

impl Compressor for AllReduce {
    fn is_plain_average(&self) -> bool {
        true
    }
    fn reduce(&mut self, bucket: &mut Tensor, comm: &mut dyn Collective, _ctx: &BucketCtx) -> anyhow::Result<()> {
        let n = comm.world_size();
        if n == 1 {
            return Ok(());
        }
        comm.all_reduce_sum(bucket)?;
        let _ = bucket.divide_scalar_(n as f64);
        Ok(())
    }
}

/// The suite's batch size, unchanged.
#[derive(Debug)]
pub struct FixedBatch {
    pub batch: u32,
    pub accum: u32,
}

impl BatchPolicy for FixedBatch {
    fn next(&mut self, _t: &StepTelemetry) -> anyhow::Result<BatchDecision> {
        Ok(BatchDecision { micro_batch: self.batch, accum_steps: self.accum, lr_scale: 1.0 })
    }
}

/// Never checkpoints.
#[derive(Debug, Default)]
pub struct NoCheckpoint;

impl CheckpointPolicy for NoCheckpoint {
    fn decide(&mut self, _t: &StepTelemetry, _h: &CheckpointHistory) -> anyhow::Result<CheckpointDecision> {
        Ok(CheckpointDecision::default())
    }
    fn never_saves(&self) -> bool {
        true
    }
}

/// The strategies of one entry, built from the suite's names
/// (`Strategies::build`, in `plugin/strategies.rs`).
pub struct Strategies {
    pub compressor: Box<dyn Compressor>,
    pub batch: Box<dyn BatchPolicy>,
    pub checkpoint: Box<dyn CheckpointPolicy>,
}
