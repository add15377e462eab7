//! `memory-growth`: a batch-size policy that grows the micro-batch while the
//! device has memory to spare and, after an out-of-memory, settles just below
//! the size that failed (the "dynamic batching from 32 up to 512, growth
//! factor 1.2, memory threshold 0.8" of docs/claims.md section 4).
//!
//! ```toml
//! start = 32         # first micro-batch per rank
//! max = 512          # largest micro-batch
//! growth = 1.2       # factor per growth decision (> 1; rounded, at least +1)
//! threshold = 0.8    # grow only while memory_used / memory_total < threshold
//! projected = false  # true: grow only while memory_used * grown / b < threshold * memory_total
//! every = 1          # steps between growth decisions
//! backoff = 0.5      # factor on out-of-memory with no good size to return to (0 < backoff < 1)
//! lr_rule = "none"   # "none" | "linear" | "sqrt": lr_scale relative to `start`
//! ```
//!
//! The rule, after each step (telemetry `t`; `b` the micro-batch in force,
//! this policy's last decision):
//!
//! - `t.out_of_memory`: the step at micro-batch `t.micro_batch` (`b` if the
//!   host reports 0) failed. The ceiling becomes the smallest size that
//!   failed (the policy never asks for it, or more, again). The micro-batch
//!   goes back to `last_good`, the micro-batch of the last step that
//!   completed (`out_of_memory = false`), if it lies below the ceiling; else
//!   to `round(failed * backoff)`, within `[1, ceiling - 1]`;
//! - otherwise `last_good = t.micro_batch`, and every `every` steps
//!   (`t.step % every == 0`), when the host reports memory
//!   (`memory_total_bytes > 0`): `grown = max(b + 1, round(b * growth))`,
//!   clamped to `max` and, once a ceiling exists, to `floor((b + ceiling) /
//!   2)` (bisection toward the failing size; when `ceiling - b <= 1` the
//!   batch stays). The batch becomes `grown` if `memory_used / memory_total
//!   < threshold`, or with `projected = true` if `memory_used * grown / b <
//!   threshold * memory_total` (memory grows about linearly with the
//!   micro-batch, so the use after growing stays under the threshold);
//! - otherwise the batch stays.
//!
//! Why: on an H200 (GPT-2 124M, peak allocated memory per step, start 32,
//! growth 1.2, threshold 0.8) the earlier rule (ceiling = failing size - 1,
//! back off to half, regrow by `growth`) went 32, ..., 197, 236 (out of
//! memory), 118, 142, 170, 204, 235 (out of memory), 117, ..., 234 (out of
//! memory): five failures in 30 steps, each regrowth ending one below the
//! last failure. Returning to the last good size and bisecting toward the
//! failing one costs at most about log2(failing - good) more failures and
//! then stays.
//!
//! Accumulation steps stay the workload's. State (layout 2): the
//! micro-batch, the accumulation steps, the ceiling and `last_good`; a
//! layout-1 state (before `last_good`, its ceiling the largest size still
//! allowed) loads with no good size known.

#[path = "../../shared/batch.rs"]
mod batch;

use batch::{LrRule, Reader, Writer};
use harness_sdk::{Batch, BatchPolicy, Config, Error, Plugin, Telemetry};

/// The state layout this build writes (1: micro, accum, ceiling as the
/// largest allowed size; 2: micro, accum, ceiling as the smallest failing
/// size, last_good).
const STATE_VERSION: u8 = 2;

/// No ceiling yet (no out-of-memory).
const NO_CEILING: u32 = u32::MAX;

/// The plugin: one instance per rank, made by `configure`.
pub struct MemoryGrowth {
    start: u32,
    max: u32,
    growth: f64,
    threshold: f64,
    projected: bool,
    every: u64,
    backoff: f64,
    lr_rule: LrRule,
    /// Current micro-batch (0 before `initial`).
    micro: u32,
    accum: u32,
    /// Smallest micro-batch that ran out of memory ([`NO_CEILING`]: none);
    /// every decision stays below it.
    ceiling: u32,
    /// Micro-batch of the last step that completed without running out of
    /// memory (0: none yet).
    last_good: u32,
}

impl Plugin for MemoryGrowth {
    const NAME: &'static str = "memory-growth";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["start", "max", "growth", "threshold", "projected", "every", "backoff", "lr_rule"])?;
        let start: u32 = config.get_or("start", 32)?;
        let max: u32 = config.get_or("max", 512)?;
        let growth: f64 = config.get_or("growth", 1.2)?;
        let threshold: f64 = config.get_or("threshold", 0.8)?;
        let projected: bool = config.get_or("projected", false)?;
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
        Ok(MemoryGrowth {
            start,
            max,
            growth,
            threshold,
            projected,
            every,
            backoff,
            lr_rule,
            micro: 0,
            accum: 0,
            ceiling: NO_CEILING,
            last_good: 0,
        })
    }

    fn state_save(&self) -> Vec<u8> {
        Writer::versioned(Self::NAME, STATE_VERSION).u32(self.micro).u32(self.accum).u32(self.ceiling).u32(self.last_good).finish()
    }

    fn state_load(&mut self, state: &[u8]) -> Result<(), Error> {
        let (mut r, version) = Reader::versioned(state, Self::NAME, STATE_VERSION)?;
        let (micro, accum, ceiling) = (r.u32()?, r.u32()?, r.u32()?);
        let (ceiling, last_good) = if version == 1 {
            // Layout 1 kept the largest size still allowed.
            (if ceiling == NO_CEILING { NO_CEILING } else { ceiling + 1 }, 0)
        } else {
            (ceiling, r.u32()?)
        };
        r.finish()?;
        if (micro == 0) != (accum == 0) || ceiling == 0 {
            return Err(Error::new("inconsistent state"));
        }
        self.micro = micro;
        self.accum = accum;
        self.ceiling = ceiling;
        self.last_good = last_good;
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

    /// The size a growth decision from `b` proposes: `max(b + 1, round(b *
    /// growth))` within `max`, and with a ceiling at most halfway to it
    /// (`b` itself when `b + 1` already reaches the ceiling).
    fn grown(&self, b: u32) -> u32 {
        if self.ceiling != NO_CEILING && self.ceiling.saturating_sub(b) <= 1 {
            return b;
        }
        let grown = (f64::from(b) * self.growth).round().min(f64::from(u32::MAX)) as u32;
        let mut grown = grown.max(b.saturating_add(1)).min(self.max);
        if self.ceiling != NO_CEILING {
            grown = grown.min(((u64::from(b) + u64::from(self.ceiling)) / 2) as u32);
        }
        grown.max(b)
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
            let failed = if t.micro_batch > 0 { t.micro_batch } else { b };
            self.ceiling = self.ceiling.min(failed);
            self.micro = if self.last_good > 0 && self.last_good < self.ceiling {
                self.last_good
            } else {
                let shrunk = (f64::from(failed) * self.backoff).round() as u32;
                shrunk.clamp(1, self.ceiling.saturating_sub(1).max(1))
            };
        } else {
            if t.micro_batch > 0 {
                self.last_good = t.micro_batch;
            }
            if t.step % self.every == 0 && t.memory_total_bytes > 0 {
                let grown = self.grown(b);
                let (used, total) = (t.memory_used_bytes as f64, t.memory_total_bytes as f64);
                let fits = if self.projected {
                    used * (f64::from(grown) / f64::from(b)) < self.threshold * total
                } else {
                    used / total < self.threshold
                };
                if grown > b && fits {
                    self.micro = grown;
                }
            }
        }
        Ok(self.batch())
    }
}

harness_sdk::export!(MemoryGrowth as batch_policy);
