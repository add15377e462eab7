//! The batch in force: micro-batch size, accumulation steps and learning-rate
//! scale as the batch policy decides them, and what out-of-memory errors
//! taught about sizes that do not fit.

use anyhow::Result;

use super::checkpoint::{Position, MAX_LR_SCALE};
use harness_format::results::OomRecord;
use harness_sandbox::strategy::{BatchDecision, BatchPolicy, StepTelemetry};

/// The batch the next step trains with.
pub struct Batch {
    pub micro_batch: u32,
    pub accum_steps: u32,
    /// Multiplier on the scheduled learning rate.
    pub lr_scale: f64,
    /// The smallest micro-batch that ran out of memory, and the size that
    /// was retried then: a size that ran out is not tried again.
    oom_ceiling: Option<u32>,
    oom_fallback: u32,
    /// (step, micro-batch, accumulation steps) at every change, for results.
    pub changes: Vec<(u64, u32, u32)>,
    /// The telemetry of the last step, for the policy's retry call.
    last_telemetry: StepTelemetry,
}

impl Batch {
    /// The policy's first batch, given the workload's.
    pub fn initial(policy: &mut dyn BatchPolicy, configured: BatchDecision, memory_total_bytes: u64, world: usize) -> Result<Batch> {
        let first = policy.initial(configured)?;
        check_lr_scale(first.lr_scale)?;
        Ok(Batch {
            micro_batch: first.micro_batch,
            accum_steps: first.accum_steps,
            lr_scale: first.lr_scale,
            oom_ceiling: None,
            oom_fallback: first.micro_batch,
            changes: vec![(0, first.micro_batch, first.accum_steps)],
            last_telemetry: StepTelemetry {
                memory_total_bytes,
                micro_batch: first.micro_batch,
                accum_steps: first.accum_steps,
                world_size: world as u32,
                loss: f64::NAN,
                ..StepTelemetry::default()
            },
        })
    }

    /// Where the loop stands after `step` steps, for a snapshot.
    pub fn position(&self, step: u64, data_position: u64) -> Position {
        Position { step, data_position, micro_batch: self.micro_batch, accum_steps: self.accum_steps, lr_scale: self.lr_scale }
    }

    /// Puts back the batch of a snapshot.
    pub fn restore(&mut self, p: &Position) {
        (self.micro_batch, self.accum_steps, self.lr_scale) = (p.micro_batch, p.accum_steps, p.lr_scale);
    }

    /// Forgets changes after step `to` (a restore went back there); after a
    /// resume the history starts at the restored batch.
    pub fn rewind(&mut self, to: u64, resumed: bool) {
        if resumed {
            self.changes = vec![(to, self.micro_batch, self.accum_steps)];
        } else {
            self.changes.retain(|e| e.0 <= to);
        }
    }

    /// Step `step` ran out of memory: it is retried with the policy's
    /// smaller micro-batch, else half. Returns what happened, for results.
    pub fn after_oom(&mut self, policy: &mut dyn BatchPolicy, step: u64, emulated: bool) -> Result<OomRecord> {
        let failed = self.micro_batch;
        anyhow::ensure!(failed > 1, "step {} ran out of memory at micro-batch 1: there is nothing smaller to retry with", step + 1);
        let t =
            StepTelemetry { step, micro_batch: failed, accum_steps: self.accum_steps, out_of_memory: true, ..self.last_telemetry.clone() };
        let next = policy.next(&t)?;
        check_lr_scale(next.lr_scale)?;
        let retry = if next.micro_batch < failed { next.micro_batch } else { (failed / 2).max(1) };
        self.oom_ceiling = Some(self.oom_ceiling.map_or(failed, |c| c.min(failed)));
        self.oom_fallback = retry;
        self.changes.push((step, retry, next.accum_steps));
        (self.micro_batch, self.accum_steps, self.lr_scale) = (retry, next.accum_steps, next.lr_scale);
        Ok(OomRecord { step, micro_batch: failed, retried_with: retry, emulated })
    }

    /// After a step: the policy decides the next batch from `telemetry`
    /// (whose `step` is the number of steps done).
    pub fn after_step(&mut self, policy: &mut dyn BatchPolicy, telemetry: &StepTelemetry) -> Result<()> {
        let mut next = policy.next(telemetry)?;
        check_lr_scale(next.lr_scale)?;
        self.last_telemetry = telemetry.clone();
        // A size that ran out of memory is not tried again: the policy's
        // request falls back to the size that was retried then.
        if self.oom_ceiling.is_some_and(|c| next.micro_batch >= c) {
            next.micro_batch = self.oom_fallback;
        }
        if (next.micro_batch, next.accum_steps) != (self.micro_batch, self.accum_steps) {
            self.changes.push((telemetry.step, next.micro_batch, next.accum_steps));
        }
        (self.micro_batch, self.accum_steps, self.lr_scale) = (next.micro_batch, next.accum_steps, next.lr_scale);
        anyhow::ensure!(
            self.micro_batch >= 1 && self.accum_steps >= 1,
            "the batch policy returned batch {} x {} accumulation steps; both must be at least 1",
            self.micro_batch,
            self.accum_steps
        );
        Ok(())
    }
}

/// Refuses an `lr_scale` that is not finite, positive and at most
/// [`MAX_LR_SCALE`] (the largest ratio of two batches the host accepts; a
/// checkpoint holding more is refused too).
fn check_lr_scale(lr_scale: f64) -> Result<()> {
    anyhow::ensure!(
        lr_scale.is_finite() && lr_scale > 0.0 && lr_scale <= MAX_LR_SCALE,
        "the batch policy returned lr_scale {lr_scale}; it must be finite, positive and at most {MAX_LR_SCALE}"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_lr_scale_that_is_not_finite_positive_and_within_the_bound_is_refused() {
        for ok in [1.0, 1e-300, 0.5, MAX_LR_SCALE] {
            check_lr_scale(ok).unwrap();
        }
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e30, MAX_LR_SCALE * (1.0 + f64::EPSILON)] {
            let e = check_lr_scale(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("lr_scale {bad}; it must be finite, positive and at most 4294967296")), "{e}");
        }
    }
}
