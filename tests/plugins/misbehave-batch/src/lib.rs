//! A batch policy for the host's tests. Config `mode`:
//!
//! - `ok`: returns the configured batch, every step;
//! - `zero`: micro-batch 0;
//! - `huge`: micro-batch `u32::MAX`;
//! - `nan-lr`: learning-rate scale NaN;
//! - `grow`: a legitimate policy that doubles the micro-batch every `every`
//!   steps (default 5) up to `max` (default 64), to test batch changes;
//! - `loss`: a loss-driven policy: it doubles the micro-batch (up to `max`)
//!   each time the telemetry's loss falls below 99% of the lowest loss it
//!   has seen when it last doubled. Its decisions hang on the loss's exact
//!   value: ranks told their own losses would part ways;
//! - `diverge`: deliberately divergent: each instance adds its number (0,
//!   1, ...: a counter the library's instances in the process share, so
//!   thread ranks of a native build differ) and its process's `RANK` (set
//!   by the launcher for each rank process on GPUs, where every process
//!   counts from 0) to the configured micro-batch.

use std::sync::atomic::{AtomicU32, Ordering};

use harness_sdk::{Batch, BatchPolicy, Config, Error, Plugin, Telemetry};

const MODES: [&str; 7] = ["ok", "zero", "huge", "nan-lr", "grow", "loss", "diverge"];

/// Instances made so far in this process (`diverge`).
static INSTANCES: AtomicU32 = AtomicU32::new(0);

/// See the crate docs.
pub struct MisbehaveBatch {
    mode: String,
    every: u64,
    max: u32,
    configured: Option<Batch>,
    /// `loss`: the doublings so far and the loss that must be beaten.
    doublings: u32,
    bar: f64,
    /// `diverge`: this instance's number.
    instance: u32,
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
        let rank = std::env::var("RANK").ok().and_then(|r| r.parse::<u32>().ok()).unwrap_or(0);
        let instance = INSTANCES.fetch_add(1, Ordering::Relaxed).saturating_add(rank);
        Ok(MisbehaveBatch { mode, every, max, configured: None, doublings: 0, bar: f64::INFINITY, instance })
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
            "loss" => {
                let grown = u64::from(base.micro_batch) << self.doublings.min(31);
                Batch { micro_batch: grown.min(u64::from(self.max)).max(1) as u32, ..base }
            }
            "diverge" => Batch { micro_batch: base.micro_batch.saturating_add(self.instance), ..base },
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
        if self.mode == "loss" && t.loss.is_finite() {
            if t.loss < self.bar * 0.99 && self.bar.is_finite() {
                self.doublings += 1;
                self.bar = t.loss;
            } else if !self.bar.is_finite() {
                self.bar = t.loss;
            }
        }
        Ok(self.decide(t.step))
    }
}

harness_sdk::export!(MisbehaveBatch as batch_policy);
