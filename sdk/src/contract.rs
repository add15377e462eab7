//! The plugin contract: what every plugin is ([`Plugin`]), what each kind
//! implements ([`Compressor`], [`BatchPolicy`], [`CheckpointPolicy`]), and
//! the contract's version.

use crate::{Batch, BucketInfo, BucketLayout, CheckpointHistory, Collective, Config, Decision, Error, Telemetry, Tensor};

/// Version of the plugin contract this SDK speaks (semver): the WIT package
/// `harness:strategy@0.2.0`, native ABI version [`crate::abi::ABI_VERSION`].
/// Hosts of 0.2 also load plugins built against contract 0.1 (`sdk/wit-0.1`,
/// ABI version [`crate::abi::ABI_VERSION_0_1`]).
pub const CONTRACT_VERSION: &str = "0.2.0";

/// What every plugin is: a name, a version, made from its configuration,
/// with a state saved in checkpoints.
pub trait Plugin: Sized + 'static {
    /// The plugin's name, as results show it.
    const NAME: &'static str;
    /// The plugin's version, as results show it.
    const VERSION: &'static str;

    /// Makes the plugin from its configuration: the strategy's
    /// `compressor_config`, `batch_policy_config` or `checkpoint_config`
    /// table in the suite, or the `--plugin-config` keys of a plugin entered
    /// into a standard suite. Called
    /// once per entry and rank, before anything else; an error rejects the
    /// entry with its message.
    fn configure(config: &Config) -> Result<Self, Error>;

    /// The plugin's state (error-feedback residuals, factors, counters),
    /// saved with the model checkpoint. Default: nothing.
    fn state_save(&self) -> Vec<u8> {
        Vec::new()
    }

    /// Restores a state from [`Plugin::state_save`] when a run resumes.
    /// Default: ignores it.
    fn state_load(&mut self, state: &[u8]) -> Result<(), Error> {
        let _ = state;
        Ok(())
    }
}

/// Gradient compression: called per gradient bucket, every step.
pub trait Compressor: Plugin {
    /// The layout of every bucket (indexed by [`BucketInfo::index`]): the
    /// parameters each holds, with their names, shapes and offsets. Called
    /// once per entry and rank, after `configure` and before
    /// [`Plugin::state_load`] and the first `compress`; the layout holds for
    /// the whole entry. An error rejects the entry. Default: ignores it (a
    /// compressor that treats each bucket as a flat run of floats).
    fn setup(&mut self, buckets: &[BucketLayout]) -> Result<(), Error> {
        let _ = buckets;
        Ok(())
    }

    /// Reduces one bucket (the flattened gradients of consecutive
    /// parameters) across ranks and leaves the average in `bucket`, in place,
    /// through [`Tensor::assign`] or in-place collectives.
    fn compress(&mut self, bucket: &Tensor, comm: &Collective, info: BucketInfo) -> Result<(), Error>;
}

/// Batch size: called before the first step and after every step.
pub trait BatchPolicy: Plugin {
    /// Whether this policy reads [`Telemetry::grad_sq_norm`] and
    /// [`Telemetry::local_grad_sq_norm`]. Asked once, after `configure` and
    /// before [`BatchPolicy::initial`]. Default: false, and both fields are
    /// `None`.
    ///
    /// Say true only when the policy uses them: they cost the host a norm
    /// pass over the gradients every step, and, since they need each rank's
    /// own gradient before the all-reduce, the all-reduce no longer overlaps
    /// with the backward pass.
    fn wants_gradient_stats(&self) -> bool {
        false
    }

    /// The first batch, given the workload's configured one. Default: the
    /// configured one.
    fn initial(&mut self, configured: Batch) -> Result<Batch, Error> {
        Ok(configured)
    }

    /// The next batch, after a step.
    fn next(&mut self, telemetry: &Telemetry) -> Result<Batch, Error>;
}

/// Checkpoints: called after every step.
pub trait CheckpointPolicy: Plugin {
    /// Decides after a step: save now, and which saved checkpoints to
    /// delete.
    fn decide(&mut self, telemetry: &Telemetry, history: &CheckpointHistory) -> Result<Decision, Error>;
}
