//! `fixed`: a batch-size policy plugin for harness.
//!
//! This starting point keeps a fixed batch taken from its configuration:
//!
//! ```toml
//! micro_batch = 16   # per rank; default: the workload's configured one
//! accum_steps = 2    # default: the workload's configured one
//! lr_scale = 1.0     # multiplier on the learning-rate schedule; default 1.0
//! ```
//!
//! A dynamic policy reads the `Telemetry` handed to `next` (loss, step time,
//! memory, gradient norms for the noise scale, out-of-memory retries).

use harness_sdk::{Batch, BatchPolicy, Config, Error, Plugin, Telemetry};

/// The plugin: one instance per rank, made by `configure`.
pub struct FixedBatch {
    micro_batch: Option<u32>,
    accum_steps: Option<u32>,
    lr_scale: f64,
    batch: Option<Batch>,
}

impl Plugin for FixedBatch {
    const NAME: &'static str = "fixed";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["micro_batch", "accum_steps", "lr_scale"])?;
        let micro_batch: Option<u32> = config.get("micro_batch")?;
        let accum_steps: Option<u32> = config.get("accum_steps")?;
        let lr_scale = config.get_or("lr_scale", 1.0)?;
        if micro_batch == Some(0) || accum_steps == Some(0) {
            return Err(Error::new("micro_batch and accum_steps must be at least 1"));
        }
        if !(lr_scale > 0.0 && f64::is_finite(lr_scale)) {
            return Err(Error::new(format!("lr_scale must be finite and > 0, not {lr_scale}")));
        }
        Ok(FixedBatch { micro_batch, accum_steps, lr_scale, batch: None })
    }
}

impl BatchPolicy for FixedBatch {
    fn initial(&mut self, configured: Batch) -> Result<Batch, Error> {
        let batch = Batch {
            micro_batch: self.micro_batch.unwrap_or(configured.micro_batch),
            accum_steps: self.accum_steps.unwrap_or(configured.accum_steps),
            lr_scale: self.lr_scale,
        };
        self.batch = Some(batch);
        Ok(batch)
    }

    fn next(&mut self, _telemetry: &Telemetry) -> Result<Batch, Error> {
        self.batch.ok_or_else(|| Error::new("next before initial"))
    }
}

harness_sdk::export!(FixedBatch as batch_policy);
