//! The batch in force: micro-batch size, accumulation steps and learning-rate
//! scale as the batch policy decides them, and what out-of-memory errors
//! taught about sizes that do not fit.

use anyhow::Result;
use tch::{Device, Tensor};

use super::checkpoint::{Position, MAX_LR_SCALE};
use harness_format::results::OomRecord;
use harness_runtime::comm::Collective;
use harness_sandbox::plugin::PluginFailure;
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

impl Batch {
    /// The batch in force, as the policy's decision.
    pub fn decision(&self) -> BatchDecision {
        BatchDecision { micro_batch: self.micro_batch, accum_steps: self.accum_steps, lr_scale: self.lr_scale }
    }
}

/// Batch policies that agree across ranks by construction: on several
/// ranks, each rank's policy plugin is told the same telemetry, the ranks'
/// reduced ([`Agreement::telemetry`]), so that a policy that decides from
/// its telemetry and its own state decides alike on every rank; and the
/// decisions are compared before the next step runs
/// ([`Agreement::check`]), so that one that still parts ways (it reads a
/// clock, a random number or a rank's own state) fails its entry naming the
/// policy and each rank's decision, instead of a collective that later
/// finds tensors of different sizes. Each costs a control all-reduce of a
/// few numbers a step (with a read-back); one rank, or the built-in fixed
/// batch, costs nothing.
pub struct Agreement {
    /// The policy's name in the suite.
    name: String,
    /// Several ranks, and a policy plugin.
    on: bool,
    device: Device,
}

impl Agreement {
    pub fn new(name: &str, policy: &mut dyn BatchPolicy, world: usize, device: Device) -> Agreement {
        Agreement { name: name.to_owned(), on: world > 1 && policy.plugin_any().is_some(), device }
    }

    /// What every rank's policy is told: the ranks' telemetry reduced.
    /// `loss`, `local_grad_sq_norm` and `tokens_per_s`: their mean over the
    /// ranks (the loss of the global batch when the ranks' micro-batches are
    /// equal); `memory_used_bytes`, `step_time_s` and `elapsed_s`: their
    /// largest (the rank that a larger batch would stop first, the slowest);
    /// `grad_sq_norm` (the averaged gradient's, the same on every rank):
    /// its largest. The rest is the same on every rank already.
    pub fn telemetry(&self, t: StepTelemetry, comm: &mut dyn Collective) -> Result<StepTelemetry> {
        if !self.on {
            return Ok(t);
        }
        let nan = f64::NAN;
        let mine = [
            t.loss,
            t.local_grad_sq_norm.unwrap_or(nan),
            t.tokens_per_s,
            t.memory_used_bytes as f64,
            t.step_time_s,
            t.elapsed_s,
            t.grad_sq_norm.unwrap_or(nan),
        ];
        let all = gather(&mine, comm, self.device)?;
        let n = all.len() as f64;
        let mean = |i: usize| all.iter().map(|r| r[i]).sum::<f64>() / n;
        let max = |i: usize| all.iter().map(|r| r[i]).fold(f64::NEG_INFINITY, f64::max);
        Ok(StepTelemetry {
            loss: mean(0),
            local_grad_sq_norm: t.local_grad_sq_norm.map(|_| mean(1)),
            tokens_per_s: mean(2),
            memory_used_bytes: max(3) as u64,
            step_time_s: max(4),
            elapsed_s: max(5),
            grad_sq_norm: t.grad_sq_norm.map(|_| max(6)),
            ..t
        })
    }

    /// Fails when the ranks' batches differ `when` (e.g. "after step 12"),
    /// naming the policy and each rank's decision.
    pub fn check(&self, when: &str, d: BatchDecision, comm: &mut dyn Collective) -> Result<()> {
        if !self.on {
            return Ok(());
        }
        let all = gather(&[f64::from(d.micro_batch), f64::from(d.accum_steps), d.lr_scale], comm, self.device)?;
        if all.iter().all(|r| r.iter().zip(&all[0]).all(|(a, b)| a.to_bits() == b.to_bits())) {
            return Ok(());
        }
        let each: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(rank, r)| format!("rank {rank}: micro-batch {} x {} accumulation steps, lr_scale {}", r[0], r[1], r[2]))
            .collect();
        Err(PluginFailure {
            plugin: self.name.clone(),
            message: format!(
                "the batch policy `{}` decided differently on the ranks {when} ({}). Every rank's policy is told the same \
                 telemetry (the ranks' reduced: mean loss, largest memory, ...); a policy must decide from it and its own \
                 state only, not from a clock, random numbers or anything of its rank's",
                self.name,
                each.join("; ")
            ),
        }
        .into())
    }
}

/// Every rank's `values`, in rank order, on every rank: each rank writes
/// its own into its slot of zeros and the ranks sum them (exactly: each
/// slot adds one rank's values to zeros) in a control all-reduce.
fn gather(values: &[f64], comm: &mut dyn Collective, device: Device) -> Result<Vec<Vec<f64>>> {
    let (k, rank, world) = (values.len(), comm.rank(), comm.world_size());
    let mut slots = vec![0f64; k * world];
    slots[rank * k..(rank + 1) * k].copy_from_slice(values);
    let mut t = Tensor::from_slice(&slots).to_device(device);
    comm.all_reduce_sum_control(&mut t)?;
    let summed = Vec::<f64>::try_from(&t.to_device(Device::Cpu))?;
    Ok(summed.chunks(k).map(<[f64]>::to_vec).collect())
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

    /// Runs `f` on two thread ranks with an agreement switched on.
    fn on_two_ranks<T: Send + 'static>(f: impl Fn(usize, &Agreement, &mut dyn Collective) -> T + Send + Sync + 'static) -> Vec<T> {
        let g = harness_runtime::comm::InProcessGroup::new(2, std::time::Duration::from_secs(10));
        let f = std::sync::Arc::new(f);
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let (g, f) = (g.clone(), f.clone());
                std::thread::spawn(move || {
                    let a = Agreement { name: "p".into(), on: true, device: Device::Cpu };
                    f(r, &a, &mut g.rank(r, None))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_is_told_the_ranks_telemetry_reduced() {
        let told = on_two_ranks(|rank, a, comm| {
            let r = rank as f64;
            let t = StepTelemetry {
                step: 7,
                loss: 2.0 + r,
                local_grad_sq_norm: Some(10.0 * (r + 1.0)),
                grad_sq_norm: Some(0.5),
                tokens_per_s: 100.0 + r,
                memory_used_bytes: 1000 + 500 * rank as u64,
                step_time_s: 0.2 - 0.1 * r,
                elapsed_s: 3.0 + r,
                micro_batch: 4,
                accum_steps: 2,
                world_size: 2,
                ..StepTelemetry::default()
            };
            a.telemetry(t, comm).unwrap()
        });
        for t in &told {
            assert_eq!((t.loss, t.local_grad_sq_norm, t.tokens_per_s), (2.5, Some(15.0), 100.5), "means");
            assert_eq!((t.memory_used_bytes, t.step_time_s, t.elapsed_s, t.grad_sq_norm), (1500, 0.2, 4.0, Some(0.5)), "largest");
            assert_eq!((t.step, t.micro_batch, t.accum_steps, t.world_size), (7, 4, 2, 2), "as they were");
        }
        // Bit for bit the same on both ranks (a NaN loss stays NaN).
        assert_eq!(format!("{:?}", told[0]), format!("{:?}", told[1]));
    }

    #[test]
    fn decisions_that_differ_fail_with_the_policy_and_each_ranks_decision() {
        let same =
            on_two_ranks(|_, a, comm| a.check("after step 3", BatchDecision { micro_batch: 8, accum_steps: 1, lr_scale: 0.5 }, comm));
        assert!(same.iter().all(Result::is_ok));
        let differ = on_two_ranks(|rank, a, comm| {
            let d = BatchDecision { micro_batch: 8 << rank, accum_steps: 1, lr_scale: 1.0 };
            a.check("after step 3", d, comm).unwrap_err()
        });
        for e in differ {
            let f = e.downcast_ref::<PluginFailure>().expect("a plugin's failure, naming it");
            assert_eq!(f.plugin, "p");
            assert!(f.message.contains("decided differently on the ranks after step 3 (rank 0: micro-batch 8 x 1 accumulation steps, lr_scale 1; rank 1: micro-batch 16 x 1"), "{}", f.message);
        }
    }

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
