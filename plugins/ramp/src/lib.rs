//! `ramp`: a batch-size policy whose micro-batch moves linearly from `start`
//! to `end` over `over_steps` steps, then stays at `end`.
//!
//! ```toml
//! start = 8          # micro-batch per rank at step 0 (required)
//! end = 64           # micro-batch from step `over_steps` on (required)
//! over_steps = 1000  # length of the ramp, steps (required, >= 1)
//! lr_rule = "none"   # "none" | "linear" | "sqrt": lr_scale relative to `start`
//! ```
//!
//! The micro-batch after step `s` (telemetry `step`; `initial` is step 0) is
//! `round(start + (end - start) * min(s, over_steps) / over_steps)`. `end`
//! below `start` ramps down. Accumulation steps stay the workload's. The
//! decision depends only on the step; the state is the accumulation steps and
//! the step reached, so `initial` after a resume continues the ramp.

#[path = "../../shared/batch.rs"]
mod batch;

use batch::{LrRule, Reader, Writer};
use harness_sdk::{Batch, BatchPolicy, Config, Error, Plugin, Telemetry};

/// The plugin: one instance per rank, made by `configure`.
pub struct Ramp {
    start: u32,
    end: u32,
    over_steps: u64,
    lr_rule: LrRule,
    /// The workload's accumulation steps (0 before `initial`).
    accum: u32,
    /// Steps completed so far (the latest telemetry's `step`).
    step: u64,
}

impl Plugin for Ramp {
    const NAME: &'static str = "ramp";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["start", "end", "over_steps", "lr_rule"])?;
        let need = |key: &str| -> Result<u64, Error> {
            config.get::<u64>(key)?.ok_or_else(|| Error::new(format!("`{key}` is required (keys: start, end, over_steps, lr_rule)")))
        };
        let (start, end, over_steps) = (need("start")?, need("end")?, need("over_steps")?);
        let lr_rule = LrRule::from_config(config)?;
        let limit = u64::from(u32::MAX);
        if start == 0 || end == 0 || start > limit || end > limit {
            return Err(Error::new(format!("start and end must lie in 1..={limit}, not {start} and {end}")));
        }
        if over_steps == 0 {
            return Err(Error::new("over_steps must be at least 1"));
        }
        Ok(Ramp { start: start as u32, end: end as u32, over_steps, lr_rule, accum: 0, step: 0 })
    }

    fn state_save(&self) -> Vec<u8> {
        Writer::new(Self::NAME).u32(self.accum).u64(self.step).finish()
    }

    fn state_load(&mut self, state: &[u8]) -> Result<(), Error> {
        let mut r = Reader::new(state, Self::NAME)?;
        let (accum, step) = (r.u32()?, r.u64()?);
        r.finish()?;
        self.accum = accum;
        self.step = step;
        Ok(())
    }
}

impl Ramp {
    fn at(&self, step: u64) -> Batch {
        let f = step.min(self.over_steps) as f64 / self.over_steps as f64;
        let (s, e) = (f64::from(self.start), f64::from(self.end));
        let micro = (s + (e - s) * f).round().max(1.0) as u32;
        Batch { micro_batch: micro, accum_steps: self.accum, lr_scale: self.lr_rule.scale(f64::from(micro), s) }
    }
}

impl BatchPolicy for Ramp {
    fn initial(&mut self, configured: Batch) -> Result<Batch, Error> {
        if self.accum == 0 {
            self.accum = configured.accum_steps.max(1);
        }
        // After a resume (restored state), the batch of the step reached.
        Ok(self.at(self.step))
    }

    fn next(&mut self, t: &Telemetry) -> Result<Batch, Error> {
        if self.accum == 0 {
            return Err(Error::new("next before initial"));
        }
        self.step = t.step;
        Ok(self.at(t.step))
    }
}

harness_sdk::export!(Ramp as batch_policy);
