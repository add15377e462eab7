//! Strategies: the three decisions a training run delegates (how gradients
//! are reduced, how large the next batch is, when to checkpoint), as traits.
//!
//! This version ships the built-in strategies (plain all-reduce, a fixed
//! batch size, no checkpoints); the plugin SDK implements the same traits
//! for WASM and native plugins.

use tch::Tensor;

/// What the host tells policies after each step.
#[derive(Debug, Clone, Default)]
pub struct StepTelemetry {
    pub step: u64,
    pub loss: f64,
    pub step_time_s: f64,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub tokens_per_s: f64,
}

pub use crate::comm::{Collective, SingleRank};

/// Reduces gradients across ranks, leaving the average in place.
pub trait Compressor {
    /// Reduces one bucket: the flattened gradients of consecutive parameters.
    fn reduce(&mut self, bucket: &mut Tensor, comm: &mut dyn Collective) -> anyhow::Result<()>;
}

/// Decides the next micro-batch size and accumulation steps.
pub trait BatchPolicy {
    /// Called after every step; returns (micro-batch, accumulation steps).
    fn next(&mut self, t: &StepTelemetry) -> (u32, u32);
}

/// Decides when to checkpoint.
pub trait CheckpointPolicy {
    /// Called after every step; true means save now.
    fn should_save(&mut self, t: &StepTelemetry) -> bool;
}

/// Plain all-reduce of full-precision gradients, then division by the world.
#[derive(Debug, Default)]
pub struct AllReduce;

impl Compressor for AllReduce {
    fn reduce(&mut self, bucket: &mut Tensor, comm: &mut dyn Collective) -> anyhow::Result<()> {
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
    fn next(&mut self, _t: &StepTelemetry) -> (u32, u32) {
        (self.batch, self.accum)
    }
}

/// Never checkpoints.
#[derive(Debug, Default)]
pub struct NoCheckpoint;

impl CheckpointPolicy for NoCheckpoint {
    fn should_save(&mut self, _t: &StepTelemetry) -> bool {
        false
    }
}

/// The strategies of one entry, built from the suite's names.
pub struct Strategies {
    pub compressor: Box<dyn Compressor>,
    pub batch: Box<dyn BatchPolicy>,
    pub checkpoint: Box<dyn CheckpointPolicy>,
}

impl Strategies {
    /// Instantiates the built-in strategies named by a suite entry (names
    /// are checked by suite validation).
    pub fn built_in(s: &crate::suite::Strategy, batch: u32, accum: u32) -> anyhow::Result<Strategies> {
        let compressor: Box<dyn Compressor> = match s.compressor.as_str() {
            "allreduce" => Box::new(AllReduce),
            other => anyhow::bail!("unknown compressor `{other}`"),
        };
        let batch: Box<dyn BatchPolicy> = match s.batch_policy.as_str() {
            "fixed" => Box::new(FixedBatch { batch, accum }),
            other => anyhow::bail!("unknown batch policy `{other}`"),
        };
        let checkpoint: Box<dyn CheckpointPolicy> = match s.checkpoint.as_str() {
            "none" => Box::new(NoCheckpoint),
            other => anyhow::bail!("unknown checkpoint policy `{other}`"),
        };
        Ok(Strategies { compressor, batch, checkpoint })
    }
}
