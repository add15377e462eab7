//! A batch policy for the host's tests. Config `mode`:
//!
//! - `ok`: returns the configured batch, every step;
//! - `zero`: micro-batch 0;
//! - `huge`: micro-batch `u32::MAX`;
//! - `nan-lr`: learning-rate scale NaN;
//! - `grow`: a legitimate policy that doubles the micro-batch every `every`
//!   steps (default 5) up to `max` (default 64), to test batch changes.

use harness_sdk::{Batch, BatchPolicy, Config, Error, Plugin, Telemetry};

const MODES: [&str; 5] = ["ok", "zero", "huge", "nan-lr", "grow"];

/// See the crate docs.
pub struct MisbehaveBatch {
    mode: String,
    every: u64,
    max: u32,
    configured: Option<Batch>,
}

impl Plugin for MisbehaveBatch {
    const NAME: &'static str = "misbehave-batch";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["mode", "every", "max"])?;
        let mode = config.get_or("mode", "ok".to_owned())?;
        if !MODES.contains(&mode.as_str()) {
            return Err(Error::new(format!("unknown mode `{mode}` (modes: {})", MODES.join(", "))));
        }
        let every = config.get_or("every", 5u64)?;
        let max = config.get_or("max", 64u32)?;
        if every == 0 || max == 0 {
            return Err(Error::new("`every` and `max` must be at least 1"));
        }
        Ok(MisbehaveBatch { mode, every, max, configured: None })
    }
}

impl MisbehaveBatch {
    fn decide(&self, step: u64) -> Batch {
        let base = self.configured.unwrap_or(Batch { micro_batch: 1, accum_steps: 1, lr_scale: 1.0 });
        match self.mode.as_str() {
            "zero" => Batch { micro_batch: 0, ..base },
            "huge" => Batch { micro_batch: u32::MAX, ..base },
            "nan-lr" => Batch { lr_scale: f64::NAN, ..base },
            "grow" => {
                let doublings = (step / self.every).min(31) as u32;
                let grown = u64::from(base.micro_batch) << doublings;
                Batch { micro_batch: grown.min(u64::from(self.max)).max(1) as u32, ..base }
            }
            _ => base,
        }
    }
}

impl BatchPolicy for MisbehaveBatch {
    fn initial(&mut self, configured: Batch) -> Result<Batch, Error> {
        self.configured = Some(configured);
        Ok(self.decide(0))
    }

    fn next(&mut self, t: &Telemetry) -> Result<Batch, Error> {
        Ok(self.decide(t.step))
    }
}

harness_sdk::export!(MisbehaveBatch as batch_policy);
