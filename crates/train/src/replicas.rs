//! Replica consistency: data-parallel training assumes every rank holds the
//! same parameters. A compressor that returns different values on different
//! ranks (or a bug in a collective) lets the replicas drift apart silently;
//! each would train its own model and the entry would still look fine.
//!
//! Every `every` steps and after the last one, each rank takes a fingerprint
//! of its parameters (each parameter's L2 norm, one multi-tensor kernel),
//! rank 0's fingerprint is broadcast (a setup-sized collective, not counted
//! as the strategy's bytes), and every rank compares its own with it bit for
//! bit: replicas of a correct data-parallel run are bit-identical. A rank
//! whose fingerprint differs fails the entry, naming the first parameter
//! that differs.

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use crate::comm::Collective;
use crate::torch_ext;

/// Steps between checks when the suite does not say.
pub const DEFAULT_EVERY: u64 = crate::switches::Switches::DEFAULT.replica_check_every;

/// Replicas that no longer agree.
#[derive(Debug, thiserror::Error)]
#[error(
    "the replicas diverged: after step {step}, rank {rank}'s parameter `{param}` differs from rank 0's ({theirs} against {ours}); \
     data-parallel replicas must stay identical (the compressor `{strategy}` returned different results on different ranks?)"
)]
pub struct Diverged {
    pub step: u64,
    pub rank: usize,
    pub param: String,
    pub ours: f32,
    pub theirs: f32,
    pub strategy: String,
}

/// When and how replicas are compared.
pub struct ReplicaCheck {
    every: u64,
    /// Also on a single rank (to measure what the fingerprint costs).
    forced: bool,
}

impl ReplicaCheck {
    /// Checks every `every` steps (0: only after the last step) with more
    /// than one rank; `forced` takes the fingerprint on one rank too.
    pub fn new(every: u64, forced: bool) -> ReplicaCheck {
        ReplicaCheck { every, forced }
    }

    /// Whether the check runs after `done` steps.
    pub fn due(&self, done: u64, world: usize) -> bool {
        (world > 1 || self.forced) && self.every > 0 && done % self.every == 0
    }

    /// Compares this rank's parameters with rank 0's.
    pub fn check(&self, params: &[Tensor], names: &[String], comm: &mut dyn Collective, done: u64, strategy: &str) -> Result<()> {
        if comm.world_size() == 1 && !self.forced {
            return Ok(());
        }
        let ours = tch::no_grad(|| torch_ext::param_norms(params))?;
        if comm.world_size() == 1 {
            // Nothing to compare with: the fingerprint is taken (and read)
            // so that its cost shows.
            let _ = ours.f_sum(Kind::Float)?.f_double_value(&[])?;
            return Ok(());
        }
        let mut reference = ours.copy();
        comm.broadcast(&mut reference, 0)?;
        let differ = ours.f_ne_tensor(&reference)?.f_any()?.f_to_device(Device::Cpu)?.f_int64_value(&[])? != 0;
        if !differ {
            return Ok(());
        }
        let (a, b) = (Vec::<f32>::try_from(&ours.to_device(Device::Cpu))?, Vec::<f32>::try_from(&reference.to_device(Device::Cpu))?);
        let i = a.iter().zip(&b).position(|(x, y)| x.to_bits() != y.to_bits()).unwrap_or(0);
        Err(Diverged {
            step: done,
            rank: comm.rank(),
            param: names.get(i).cloned().unwrap_or_default(),
            ours: b[i],
            theirs: a[i],
            strategy: strategy.to_owned(),
        }
        .into())
    }
}
