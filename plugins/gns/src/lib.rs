//! `gns`: a batch-size policy that follows the gradient noise scale
//! (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
//! appendix A.1).
//!
//! ```toml
//! min = 32          # smallest global batch, samples (default 1)
//! max = 4096        # largest global batch, samples (default 65536)
//! every = 10        # steps between batch decisions (default 10)
//! ema = 0.95        # smoothing of both estimates (0 <= ema < 1)
//! lr_rule = "none"  # "none" | "linear" | "sqrt": lr_scale relative to the start batch
//! ```
//!
//! It asks for gradient statistics (`wants_gradient_stats`), and after each
//! step the host reports `grad_sq_norm` = |G_big|^2, the squared norm of the
//! gradient averaged over all ranks and micro-batches (batch B_big =
//! micro_batch * accum_steps * world_size), and `local_grad_sq_norm` =
//! |G_small|^2, the mean over ranks of each rank's own gradient (B_small =
//! micro_batch * accum_steps). The unbiased estimators
//!
//! ```text
//! |G|^2  = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
//! tr(S)  = (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)
//! ```
//!
//! are each smoothed by an exponential moving average (the first
//! observation initialises it), and B_simple = EMA(tr(S)) / EMA(|G|^2).
//! Every `every` steps the policy sets the global batch to B_simple clamped
//! to [`min`, `max`], by changing the accumulation steps (the micro-batch
//! stays the workload's): `accum = round(target / (micro_batch * world))`,
//! kept within what [`min`, `max`] allows and at least 1.
//!
//! It keeps the batch when it cannot estimate: a step without both norms
//! (None) or with non-finite ones updates nothing, and a decision step with
//! no new estimate since the last decision keeps the batch; with `world_size` 1,
//! B_big == B_small and the two-batch estimate does not exist; while the
//! smoothed |G|^2 is not positive (noise dominates), B_simple is undefined.
//!
//! `lr_scale` follows `lr_rule` with batch = micro_batch * accum_steps
//! relative to the workload's (the start batch). State: the batch, the start
//! accumulation steps and both moving averages.

#[path = "../../shared/batch.rs"]
mod batch;

use batch::{LrRule, Reader, Writer};
use harness_sdk::{Batch, BatchPolicy, Config, Error, Plugin, Telemetry};

/// Most accumulation steps (the host's limit on both batch fields).
const MAX_ACCUM: u32 = 1 << 16;

/// The plugin: one instance per rank, made by `configure`.
pub struct Gns {
    min: f64,
    max: f64,
    every: u64,
    ema: f64,
    lr_rule: LrRule,
    /// Micro-batch and accumulation steps in force (0 before `initial`).
    micro: u32,
    accum: u32,
    /// The workload's accumulation steps: the start batch of `lr_rule`.
    accum0: u32,
    /// Moving averages of tr(S) and |G|^2, and how many steps fed them.
    ema_trace: f64,
    ema_g2: f64,
    seen: u64,
    /// A step fed the averages since the last decision.
    fresh: bool,
}

impl Plugin for Gns {
    const NAME: &'static str = "gns";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["min", "max", "every", "ema", "lr_rule"])?;
        let min: u64 = config.get_or("min", 1)?;
        let max: u64 = config.get_or("max", 65536)?;
        let every: u64 = config.get_or("every", 10)?;
        let ema: f64 = config.get_or("ema", 0.95)?;
        let lr_rule = LrRule::from_config(config)?;
        if min == 0 || min > max {
            return Err(Error::new(format!("need 1 <= min <= max, not min = {min}, max = {max}")));
        }
        if every == 0 {
            return Err(Error::new("every must be at least 1"));
        }
        if !(0.0..1.0).contains(&ema) {
            return Err(Error::new(format!("ema must lie in [0, 1), not {ema}")));
        }
        Ok(Gns {
            min: min as f64,
            max: max as f64,
            every,
            ema,
            lr_rule,
            micro: 0,
            accum: 0,
            accum0: 0,
            ema_trace: 0.0,
            ema_g2: 0.0,
            seen: 0,
            fresh: false,
        })
    }

    fn state_save(&self) -> Vec<u8> {
        Writer::new(Self::NAME)
            .u32(self.micro)
            .u32(self.accum)
            .u32(self.accum0)
            .f64(self.ema_trace)
            .f64(self.ema_g2)
            .u64(self.seen)
            .u8(self.fresh as u8)
            .finish()
    }

    fn state_load(&mut self, state: &[u8]) -> Result<(), Error> {
        let mut r = Reader::new(state, Self::NAME)?;
        let (micro, accum, accum0) = (r.u32()?, r.u32()?, r.u32()?);
        let (ema_trace, ema_g2, seen, fresh) = (r.f64()?, r.f64()?, r.u64()?, r.u8()? != 0);
        r.finish()?;
        if !(ema_trace.is_finite() && ema_g2.is_finite()) {
            return Err(Error::new("non-finite moving averages in the state"));
        }
        *self = Gns { micro, accum, accum0, ema_trace, ema_g2, seen, fresh, ..*self };
        Ok(())
    }
}

impl Gns {
    fn batch(&self) -> Batch {
        Batch {
            micro_batch: self.micro,
            accum_steps: self.accum,
            lr_scale: self.lr_rule.scale(f64::from(self.accum), f64::from(self.accum0)),
        }
    }

    /// Feeds one step's norms to the moving averages; false when they give
    /// no estimate.
    fn observe(&mut self, t: &Telemetry) -> bool {
        let (Some(big), Some(small)) = (t.grad_sq_norm, t.local_grad_sq_norm) else { return false };
        if !(big.is_finite() && small.is_finite()) {
            return false;
        }
        let b_small = f64::from(t.micro_batch) * f64::from(t.accum_steps);
        let b_big = b_small * f64::from(t.world_size);
        if !(b_small > 0.0 && b_big > b_small) {
            return false;
        }
        let g2 = (b_big * big - b_small * small) / (b_big - b_small);
        let trace = (small - big) / (1.0 / b_small - 1.0 / b_big);
        if !(g2.is_finite() && trace.is_finite()) {
            return false;
        }
        if self.seen == 0 {
            (self.ema_g2, self.ema_trace) = (g2, trace);
        } else {
            self.ema_g2 = self.ema * self.ema_g2 + (1.0 - self.ema) * g2;
            self.ema_trace = self.ema * self.ema_trace + (1.0 - self.ema) * trace;
        }
        self.seen += 1;
        self.fresh = true;
        true
    }

    /// B_simple from the moving averages, when defined.
    pub fn noise_scale(&self) -> Option<f64> {
        let b = self.ema_trace / self.ema_g2;
        (self.seen > 0 && self.ema_g2 > 0.0 && b.is_finite()).then_some(b)
    }
}

impl BatchPolicy for Gns {
    /// The estimate is made of the host's gradient norms.
    fn wants_gradient_stats(&self) -> bool {
        true
    }

    fn initial(&mut self, configured: Batch) -> Result<Batch, Error> {
        // A restored state (resume) keeps its batch.
        if self.micro == 0 {
            self.micro = configured.micro_batch.max(1);
            self.accum = configured.accum_steps.max(1);
            self.accum0 = self.accum;
        }
        Ok(self.batch())
    }

    fn next(&mut self, t: &Telemetry) -> Result<Batch, Error> {
        if self.micro == 0 {
            return Err(Error::new("next before initial"));
        }
        self.observe(t);
        if t.step % self.every == 0 && self.fresh {
            self.fresh = false;
            if let Some(b_simple) = self.noise_scale() {
                let per_accum = f64::from(self.micro) * f64::from(t.world_size.max(1));
                let target = b_simple.clamp(self.min, self.max);
                let lo = (self.min / per_accum).ceil().max(1.0);
                let hi = (self.max / per_accum).floor().max(lo).min(f64::from(MAX_ACCUM));
                self.accum = (target / per_accum).round().clamp(lo.min(hi), hi) as u32;
            }
        }
        Ok(self.batch())
    }
}

harness_sdk::export!(Gns as batch_policy);
