//! `memory-growth`: a batch-size policy that grows the micro-batch while the
//! device has memory to spare and backs off when a step runs out of memory
//! (the "dynamic batching from 32 up to 512, growth factor 1.2, memory
//! threshold 0.8" of CLAIMS.md section 4).
//!
//! ```toml
//! start = 32        # first micro-batch per rank
//! max = 512         # largest micro-batch
//! growth = 1.2      # factor per growth decision (> 1; rounded, at least +1)
//! threshold = 0.8   # grow only while memory_used / memory_total < threshold
//! every = 1         # steps between growth decisions
//! backoff = 0.5     # factor on out-of-memory (0 < backoff < 1)
//! lr_rule = "none"  # "none" | "linear" | "sqrt": lr_scale relative to `start`
//! ```
//!
//! The rule, after each step (telemetry `t`):
//!
//! - `t.out_of_memory`: the micro-batch in force (this policy's last decision)
//!   failed; it becomes a ceiling (the policy never asks for it, or more,
//!   again) and the micro-batch shrinks to `round(b * backoff)` (at least 1,
//!   at most `b - 1`);
//! - otherwise, every `every` steps (`t.step % every == 0`), when the host
//!   reports memory (`memory_total_bytes > 0`) and
//!   `memory_used / memory_total < threshold`: `b = max(b + 1, round(b *
//!   growth))`, clamped to `max` and below the lowest failing size;
//! - otherwise the batch stays.
//!
//! Accumulation steps stay the workload's. State: the micro-batch, the
//! accumulation steps and the out-of-memory ceiling.

#[path = "../../shared/batch.rs"]
mod batch;

use batch::{LrRule, Reader, Writer};
use harness_sdk::{Batch, BatchPolicy, Config, Error, Plugin, Telemetry};

/// The plugin: one instance per rank, made by `configure`.
pub struct MemoryGrowth {
    start: u32,
    max: u32,
    growth: f64,
    threshold: f64,
    every: u64,
    backoff: f64,
    lr_rule: LrRule,
    /// Current micro-batch (0 before `initial`).
    micro: u32,
    accum: u32,
    /// Largest micro-batch allowed after an out-of-memory (u32::MAX: none).
    ceiling: u32,
}

impl Plugin for MemoryGrowth {
    const NAME: &'static str = "memory-growth";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["start", "max", "growth", "threshold", "every", "backoff", "lr_rule"])?;
        let start: u32 = config.get_or("start", 32)?;
        let max: u32 = config.get_or("max", 512)?;
        let growth: f64 = config.get_or("growth", 1.2)?;
        let threshold: f64 = config.get_or("threshold", 0.8)?;
        let every: u64 = config.get_or("every", 1)?;
        let backoff: f64 = config.get_or("backoff", 0.5)?;
        let lr_rule = LrRule::from_config(config)?;
        if start == 0 || start > max {
            return Err(Error::new(format!("need 1 <= start <= max, not start = {start}, max = {max}")));
        }
        if !(growth.is_finite() && growth > 1.0) {
            return Err(Error::new(format!("growth must be finite and > 1, not {growth}")));
        }
        if !(threshold > 0.0 && threshold <= 1.0) {
            return Err(Error::new(format!("threshold must lie in (0, 1], not {threshold}")));
        }
        if every == 0 {
            return Err(Error::new("every must be at least 1"));
        }
        if !(backoff > 0.0 && backoff < 1.0) {
            return Err(Error::new(format!("backoff must lie in (0, 1), not {backoff}")));
        }
        Ok(MemoryGrowth { start, max, growth, threshold, every, backoff, lr_rule, micro: 0, accum: 0, ceiling: u32::MAX })
    }

    fn state_save(&self) -> Vec<u8> {
        Writer::new(Self::NAME).u32(self.micro).u32(self.accum).u32(self.ceiling).finish()
    }

    fn state_load(&mut self, state: &[u8]) -> Result<(), Error> {
        let mut r = Reader::new(state, Self::NAME)?;
        let (micro, accum, ceiling) = (r.u32()?, r.u32()?, r.u32()?);
        r.finish()?;
        if (micro == 0) != (accum == 0) {
            return Err(Error::new("inconsistent state"));
        }
        self.micro = micro;
        self.accum = accum;
        self.ceiling = ceiling;
        Ok(())
    }
}

impl MemoryGrowth {
    fn batch(&self) -> Batch {
        Batch {
            micro_batch: self.micro,
            accum_steps: self.accum,
            lr_scale: self.lr_rule.scale(f64::from(self.micro), f64::from(self.start)),
        }
    }
}

impl BatchPolicy for MemoryGrowth {
    fn initial(&mut self, configured: Batch) -> Result<Batch, Error> {
        // A restored state (resume) keeps its batch.
        if self.micro == 0 {
            self.micro = self.start;
            self.accum = configured.accum_steps.max(1);
        }
        Ok(self.batch())
    }

    fn next(&mut self, t: &Telemetry) -> Result<Batch, Error> {
        if self.micro == 0 {
            return Err(Error::new("next before initial"));
        }
        let b = self.micro;
        if t.out_of_memory {
            self.ceiling = self.ceiling.min(b.saturating_sub(1).max(1));
            let shrunk = (f64::from(b) * self.backoff).round() as u32;
            self.micro = shrunk.clamp(1, self.ceiling);
        } else if t.step % self.every == 0 && t.memory_total_bytes > 0 {
            let used = t.memory_used_bytes as f64 / t.memory_total_bytes as f64;
            if used < self.threshold {
                let grown = (f64::from(b) * self.growth).round().min(f64::from(u32::MAX)) as u32;
                let limit = self.max.min(self.ceiling);
                self.micro = grown.max(b.saturating_add(1)).min(limit);
            }
        }
        Ok(self.batch())
    }
}

harness_sdk::export!(MemoryGrowth as batch_policy);
