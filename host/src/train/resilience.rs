//! What survives a failure: the fault clock that injects failures, the
//! checkpoint store and the policy's history, capturing and restoring a
//! rank's training state, and what checkpoints and failures cost
//! ([`Resilience`]).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Device, Tensor};

use super::batch::Batch;
use super::checkpoint::{self, host_copy, Position, Snapshot, Store};
use super::optim::{LossScaler, Optimizer};
use super::setup::Training;
use super::EntryContext;
use crate::comm::{ranks_agree, Collective};
use crate::results::{CheckpointRecord, FailureRecord, ResilienceRecord};
use crate::strategy::{CheckpointHistory, CheckpointPolicy, StepTelemetry, Strategies};
use crate::suite::FaultSpec;
use crate::torch_ext;

/// Checkpoints and injected failures of one entry on one rank. A failure
/// before the first checkpoint goes back to the start, kept in host memory.
pub struct Resilience {
    clock: Option<FaultClock>,
    store: Option<Store>,
    /// What the checkpoint policy is told.
    history: CheckpointHistory,
    /// Training time since which work is at risk: the last checkpoint's
    /// completion, or the last restore, or the start.
    at_risk_since: Duration,
    /// The state at step 0, when failures may strike.
    initial: Option<Snapshot>,
    pub record: ResilienceRecord,
}

/// Rank 0's checkpoint decision and whether a failure strikes, as every
/// rank agreed on them.
pub struct Decision {
    pub save: bool,
    pub fail: bool,
    pub delete: Vec<u64>,
}

impl Resilience {
    /// Opens the entry's checkpoint store (if its policy ever saves) and,
    /// when failures are injected, keeps the starting state.
    pub fn open(ctx: &EntryContext<'_>, t: &mut Training, batch: &Batch) -> Result<Resilience> {
        let w = ctx.workload;
        let clock =
            w.faults.as_ref().filter(|f| !f.at_steps.is_empty() || f.mtbf_s.is_some()).map(|f| FaultClock::new(f, ctx.entry.seed, t.rank));
        let store = if t.strategies.checkpoint.never_saves() {
            None
        } else {
            Some(Store::open(&ctx.checkpoint_dir, t.rank, t.world, ctx.entry.strategy.checkpoint_compress, !ctx.resume)?)
        };
        let initial = match clock {
            Some(_) => {
                let at = batch.position(0, t.data.position());
                Some(state(t).capture(at, true)?)
            }
            None => None,
        };
        Ok(Resilience {
            clock,
            store,
            history: CheckpointHistory::default(),
            at_risk_since: Duration::ZERO,
            initial,
            record: ResilienceRecord::default(),
        })
    }

    /// `harness run --resume`: an interrupted run of this entry goes on from
    /// its newest checkpoint. Returns the step it goes on from.
    pub fn resume(&mut self, ctx: &EntryContext<'_>, t: &mut Training, batch: &mut Batch) -> Result<Option<u64>> {
        let (true, Some(store)) = (ctx.resume, &self.store) else { return Ok(None) };
        let on_disk: Vec<u64> = checkpoint::list(&ctx.checkpoint_dir).into_iter().map(|c| c.0).collect();
        let Some(&c) = on_disk.last() else { return Ok(None) };
        let snap =
            store.read(c).with_context(|| format!("resuming from the checkpoint of step {c} in {}", ctx.checkpoint_dir.display()))?;
        restore(t, batch, &snap).with_context(|| format!("resuming from the checkpoint of step {c}"))?;
        batch.rewind(c, true);
        self.history.saved = on_disk;
        self.record.resumed_from = Some(c);
        Ok(Some(c))
    }

    /// Whether the entry's results carry a resilience section.
    pub fn tracked(&self) -> bool {
        self.store.is_some() || self.clock.is_some() || !self.record.out_of_memory.is_empty() || self.record.resumed_from.is_some()
    }

    /// After `telemetry.step` steps at training time `now`: the policy
    /// decides, a failure may strike, and the ranks agree on both.
    pub fn decide(
        &mut self,
        policy: &mut dyn CheckpointPolicy,
        telemetry: &StepTelemetry,
        now: Duration,
        comm: &mut dyn Collective,
        device: Device,
    ) -> Result<Decision> {
        let done = telemetry.step;
        self.history.since_last_s = now.saturating_sub(self.at_risk_since).as_secs_f64();
        let decision = policy.decide(telemetry, &self.history)?;
        let fail = self.clock.as_mut().is_some_and(|c| c.strikes(done, now.as_secs_f64()));
        let mut d = Decision { save: decision.save, fail, delete: decision.delete };
        if comm.world_size() > 1 && (self.store.is_some() || self.clock.is_some()) {
            d = self.agree(d, comm, device)?;
        }
        Ok(d)
    }

    /// Rank 0's decision holds for every rank (a policy that reads the clock
    /// may decide differently on each): save, failure, and which of the
    /// checkpoints on disk (the same list on every rank) to delete.
    fn agree(&self, d: Decision, comm: &mut dyn Collective, device: Device) -> Result<Decision> {
        let saved = &self.history.saved;
        let mut v = vec![0f32; 2 + saved.len()];
        if comm.rank() == 0 {
            v[0] = d.save as i32 as f32;
            v[1] = d.fail as i32 as f32;
            for (i, s) in saved.iter().enumerate() {
                v[2 + i] = d.delete.contains(s) as i32 as f32;
            }
        }
        let mut flags = Tensor::from_slice(&v).to_device(device);
        comm.all_reduce_sum(&mut flags)?;
        let got = Vec::<f32>::try_from(&flags.to_device(Device::Cpu))?;
        let delete = saved.iter().zip(&got[2..]).filter(|(_, &d)| d > 0.0).map(|(&s, _)| s).collect();
        Ok(Decision { save: got[0] > 0.0, fail: got[1] > 0.0, delete })
    }

    /// A failure struck after `done` steps at training time `now`: the work
    /// since the last checkpoint is lost, and every rank goes back to it.
    /// `synchronized` waits for the device and forgets what was measured
    /// after the restored step; `elapsed` is the training clock. Returns
    /// the step training goes on from.
    pub fn fail(
        &mut self,
        t: &mut Training,
        batch: &mut Batch,
        done: u64,
        now: Duration,
        synchronized: &mut dyn FnMut(u64) -> Duration,
    ) -> Result<u64> {
        t.strategies.compressor.finish()?;
        let t0 = Instant::now();
        let loaded;
        let snap = match self.history.saved.last() {
            Some(&s) => {
                loaded = self.store.as_ref().context("a checkpoint without a store")?.read(s)?;
                &loaded
            }
            None => self.initial.as_ref().context("no initial state to restart from")?,
        };
        let c = snap.position.step;
        restore(t, batch, snap).with_context(|| format!("restoring the checkpoint of step {c} after the failure at step {done}"))?;
        batch.rewind(c, false);
        let resumed_at = synchronized(c);
        let restore_s = t0.elapsed().as_secs_f64();
        let lost_s = now.saturating_sub(self.at_risk_since).as_secs_f64();
        self.at_risk_since = resumed_at;
        self.history.failures.push(done);
        self.record.failures.push(FailureRecord { step: done, restored_to: c, lost_s, restore_s });
        self.record.time_lost_s += lost_s + restore_s;
        Ok(c)
    }

    /// Writes the checkpoint of `done` steps on every rank and commits it
    /// on rank 0 once every part is durable. `synchronize` waits for the
    /// device; `elapsed` reads the training clock afterwards.
    pub fn save(
        &mut self,
        t: &mut Training,
        batch: &Batch,
        done: u64,
        comm: &mut dyn Collective,
        synchronize: &dyn Fn(),
        elapsed: &dyn Fn() -> Duration,
    ) -> Result<()> {
        let store = self.store.as_ref().context("the checkpoint policy `none` asked to save")?;
        let t0 = Instant::now();
        synchronize();
        let (rank, device) = (t.rank, t.device);
        let at = batch.position(done, t.data.position());
        let written = state(t).capture(at, rank == 0).and_then(|snap| store.write_part(&snap));
        // Every rank's part is durable before rank 0 makes it a checkpoint.
        let all_ok = ranks_agree(comm, written.is_ok(), device)?;
        let bytes = written.with_context(|| format!("writing the checkpoint of step {done}"))?;
        anyhow::ensure!(all_ok, "another rank failed to write its part of the checkpoint of step {done}");
        if rank == 0 {
            store.commit(at).with_context(|| format!("committing the checkpoint of step {done}"))?;
        }
        ranks_agree(comm, true, device)?;
        let cost = t0.elapsed().as_secs_f64();
        self.history.saved.push(done);
        self.history.last_cost_s = Some(cost);
        self.at_risk_since = elapsed();
        self.record.checkpoints.push(CheckpointRecord { step: done, cost_s: cost, bytes, deleted: Vec::new() });
        self.record.checkpoint_time_s += cost;
        Ok(())
    }

    /// Deletes the checkpoints of `steps` (rank 0 deletes the files).
    pub fn delete(&mut self, steps: &[u64], rank: usize) -> Result<()> {
        for &d in steps {
            if rank == 0 {
                self.store.as_ref().context("a checkpoint deletion without a store")?.delete(d)?;
            }
            self.history.saved.retain(|&s| s != d);
            if let Some(c) = self.record.checkpoints.last_mut() {
                c.deleted.push(d);
            }
        }
        Ok(())
    }

    /// The entry finished: its checkpoints served a run that has not
    /// finished, so rank 0 removes them. Returns the record when the
    /// entry's results carry one.
    pub fn finish(self, ctx: &EntryContext<'_>, rank: usize) -> Option<ResilienceRecord> {
        if let (Some(_), 0) = (&self.store, rank) {
            let _ = std::fs::remove_dir_all(&ctx.checkpoint_dir);
        }
        let tracked = self.tracked();
        tracked.then_some(self.record)
    }
}

/// The training state a snapshot is taken of and restored into.
fn state(t: &mut Training) -> TrainState<'_> {
    TrainState {
        names: &t.names,
        params: &t.params,
        optimizer: &mut t.optimizer,
        scaler: t.scaler.as_mut(),
        strategies: &mut t.strategies,
        device: t.device,
    }
}

/// Puts `snap` back: the training state, the data stream's position and
/// the batch in force.
fn restore(t: &mut Training, batch: &mut Batch, snap: &Snapshot) -> Result<()> {
    state(t).restore(snap)?;
    t.data.seek(snap.position.data_position);
    batch.restore(&snap.position);
    t.forget_in_flight();
    Ok(())
}

/// When injected failures strike.
pub struct FaultClock {
    /// Listed steps that have not struck yet (each strikes once).
    at_steps: BTreeSet<u64>,
    /// Random failures: the mean time between them, the generator and the
    /// training time of the next one.
    random: Option<(f64, ChaCha8Rng, f64)>,
}

impl FaultClock {
    /// The clock of `spec`. Random failures are drawn on rank 0 only (the
    /// ranks then agree through a collective); listed steps on every rank.
    pub fn new(spec: &FaultSpec, entry_seed: u64, rank: usize) -> FaultClock {
        let random = spec.mtbf_s.filter(|_| rank == 0).map(|mtbf| {
            let mut rng = ChaCha8Rng::seed_from_u64(spec.seed.unwrap_or(entry_seed) ^ 0xfa11_0fa1);
            let first = exponential(&mut rng, mtbf);
            (mtbf, rng, first)
        });
        FaultClock { at_steps: spec.at_steps.iter().copied().collect(), random }
    }

    /// Whether a failure strikes now, with `done` steps completed after
    /// `elapsed_s` seconds of training.
    pub fn strikes(&mut self, done: u64, elapsed_s: f64) -> bool {
        let listed = self.at_steps.remove(&done);
        let random = match &mut self.random {
            Some((mtbf, rng, next)) if elapsed_s >= *next => {
                *next = elapsed_s + exponential(rng, *mtbf);
                true
            }
            _ => false,
        };
        listed || random
    }
}

/// An exponentially distributed time with mean `mean`.
fn exponential(rng: &mut ChaCha8Rng, mean: f64) -> f64 {
    -(1.0 - rng.random::<f64>()).ln() * mean
}

/// What a snapshot is taken of and restored into.
pub struct TrainState<'a> {
    pub names: &'a [String],
    pub params: &'a [Tensor],
    pub optimizer: &'a mut Optimizer,
    pub scaler: Option<&'a mut LossScaler>,
    pub strategies: &'a mut Strategies,
    pub device: Device,
}

impl TrainState<'_> {
    /// A host copy of this rank's state at `position`; `with_model` adds
    /// the parameters (rank 0 writes them for every rank).
    pub fn capture(&mut self, position: Position, with_model: bool) -> Result<Snapshot> {
        let model = if with_model { self.names.iter().cloned().zip(self.params.iter().map(host_copy)).collect() } else { Vec::new() };
        let mut state: Vec<(String, Tensor)> =
            self.optimizer.state_tensors().into_iter().map(|(n, t)| (format!("optimizer/{n}"), host_copy(&t))).collect();
        if let Some(s) = &self.scaler {
            state.extend(s.state_tensors().into_iter().map(|(n, t)| (format!("scaler/{n}"), host_copy(&t))));
        }
        state.push(("rng/cpu".into(), torch_ext::rng_state(Device::Cpu)?));
        if self.device.is_cuda() {
            state.push(("rng/device".into(), torch_ext::rng_state(self.device)?));
        }
        let mut plugins = Vec::new();
        for (slot, p) in self.plugins() {
            plugins.push((slot.to_owned(), p.state_save()?));
        }
        Ok(Snapshot { position, model, state, plugins })
    }

    /// Puts `snap` back: parameters, optimizer and scaler state, random
    /// generators and plugin states.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for (name, p) in self.names.iter().zip(self.params) {
                let v = snap.model.iter().find(|(n, _)| n == name).with_context(|| format!("the checkpoint lacks parameter `{name}`"))?;
                anyhow::ensure!(
                    v.1.size() == p.size(),
                    "parameter `{name}`: shape {:?} in the checkpoint, {:?} here",
                    v.1.size(),
                    p.size()
                );
                p.shallow_clone().copy_(&v.1);
            }
            Ok(())
        })?;
        let device = self.device;
        self.optimizer.load_state(&mut |n| snap.take_state(&format!("optimizer/{n}"), device))?;
        if let Some(s) = &mut self.scaler {
            s.load_state(&mut |n| snap.take_state(&format!("scaler/{n}"), device))?;
        }
        if let Some(t) = snap.take_state("rng/cpu", Device::Cpu) {
            torch_ext::set_rng_state(Device::Cpu, &t)?;
        }
        if let (Some(t), true) = (snap.take_state("rng/device", Device::Cpu), device.is_cuda()) {
            torch_ext::set_rng_state(device, &t)?;
        }
        for (slot, p) in self.plugins() {
            let state = snap.plugin(slot).with_context(|| format!("the checkpoint lacks the state of the {slot} plugin"))?;
            p.state_load(state)?;
        }
        Ok(())
    }

    fn plugins(&mut self) -> Vec<(&'static str, &mut crate::plugin::Plugin)> {
        let s = &mut *self.strategies;
        [("compressor", s.compressor.plugin_mut()), ("batch", s.batch.plugin_mut()), ("checkpoint", s.checkpoint.plugin_mut())]
            .into_iter()
            .filter_map(|(slot, p)| p.map(|p| (slot, p)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_failures_strike_once_and_random_ones_follow_the_mtbf() {
        let spec = FaultSpec { at_steps: vec![3, 7], ..FaultSpec::default() };
        let mut c = FaultClock::new(&spec, 1, 0);
        let hits: Vec<u64> = (1..=10).filter(|&s| c.strikes(s, 0.0)).collect();
        assert_eq!(hits, vec![3, 7]);
        assert!(!c.strikes(3, 0.0), "a listed failure struck twice (after a restore)");

        // 20,000 draws with mean 5 s: the mean interval is 5 s within 3%.
        let spec = FaultSpec { mtbf_s: Some(5.0), seed: Some(9), ..FaultSpec::default() };
        let mut c = FaultClock::new(&spec, 1, 0);
        let (mut n, mut t) = (0u32, 0.0);
        while n < 20_000 {
            t += 0.01;
            if c.strikes(0, t) {
                n += 1;
            }
        }
        assert!((t / n as f64 - 5.0).abs() < 0.15, "mean time between failures {}", t / n as f64);
        // Other ranks follow rank 0 through a collective.
        assert!(FaultClock::new(&spec, 1, 1).random.is_none());
    }
}
