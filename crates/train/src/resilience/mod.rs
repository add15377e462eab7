//! What survives a failure: the fault clock that injects failures and the
//! budget that bounds what they may cost, the checkpoint store and the
//! policy's history, capturing and restoring a rank's training state, and
//! what checkpoints and failures cost ([`Resilience`]).
//!
//! The fault clock and budget are in `faults.rs`, the checkpoint saves,
//! persists and deletions in `save.rs`, the capture and restore of a
//! rank's training state in `capture.rs`.

mod capture;
mod faults;
mod save;

pub use faults::{Budget, FaultBudget, FaultBudgetExhausted, FaultClock};

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tch::{Device, Tensor};

use super::batch::Batch;
use super::checkpoint::{
    Accept, Bounds, Layout, Position, RunIdentity, Snapshot, Store, TensorSpec, PLUGIN_STATE_BASE, PLUGIN_STATE_PER_PARAMETER,
};
use super::tiers::{Persisted, Pool, Report, Shared, Writer};
use crate::entry::EntryContext;
use crate::training::Training;
use faults::median;
use harness_format::results::{FailureRecord, ResilienceRecord};
use harness_kernels::torch_ext;
use harness_runtime::comm::Collective;
use harness_sandbox::strategy::{CheckpointHistory, CheckpointPolicy, StepTelemetry};

/// Checkpoints and injected failures of one entry on one rank. A failure
/// before the first checkpoint goes back to the start, kept in host memory.
pub struct Resilience {
    clock: Option<FaultClock>,
    /// What failures may cost before the entry ends instead of restarting
    /// (with the clock).
    budget: Option<FaultBudget>,
    store: Option<Arc<Store>>,
    /// Host-memory snapshots and the background writer; `None` on the
    /// synchronous path (`checkpoint_async = false`) or without a store.
    tiers: Option<Tiers>,
    /// What the checkpoint policy is told.
    history: CheckpointHistory,
    /// Training time since which work is at risk: the last checkpoint's
    /// completion, or the last restore, or the start.
    at_risk_since: Duration,
    /// The state at step 0, when failures may strike.
    initial: Option<Snapshot>,
    rank: usize,
    world: usize,
    pub record: ResilienceRecord,
}

/// The two tiers of one rank's asynchronous checkpoints.
struct Tiers {
    pool: Pool,
    writer: Writer,
    /// The newest snapshot, held in host memory.
    memory: Option<Arc<Shared>>,
    /// The memory tier's snapshot is to be persisted once the writer is
    /// free (the newest snapshot is persisted when the writer gets to it).
    pending: bool,
    in_flight: Option<InFlight>,
    /// Times of recent steps that overlapped no checkpoint work.
    clean: VecDeque<f64>,
    /// The checkpoint (index into the record) whose snapshot copy, persist
    /// or deletions run alongside the step now training.
    overlapping: Option<usize>,
    /// Deletions queued in the writer and not done yet.
    deleting: usize,
    /// The training clock at the last decision, and the stall taken since
    /// (which is the checkpoint's own cost, not a slowdown).
    last_now: Option<Duration>,
    stall_since: Duration,
}

/// The persist under way.
struct InFlight {
    position: Position,
    /// Index of its checkpoint in the record.
    record: usize,
    /// This rank's files are durable (and, with one rank, committed).
    part_done: Option<Persisted>,
}

/// Clean steps the slowdown of overlapping steps is measured against.
const CLEAN_WINDOW: usize = 32;

/// Rank 0's checkpoint decision and whether a failure strikes, as every
/// rank agreed on them.
pub struct Decision {
    pub save: bool,
    /// Persist the snapshot to disk as well.
    pub persist: bool,
    pub fail: bool,
    /// The failure also loses the host-memory tier.
    pub lose_memory: bool,
    pub delete: Vec<u64>,
    /// Ranks whose part of the persist in flight is durable.
    parts_done: usize,
    /// The failure would overrun rank 0's fault budget: the entry ends.
    over_budget: Option<Budget>,
}

impl Resilience {
    /// Opens the entry's checkpoint store (if its policy ever saves), with
    /// its snapshot buffers and writer on the asynchronous path, and, when
    /// failures are injected, keeps the starting state.
    pub fn open(ctx: &EntryContext<'_>, t: &mut Training, batch: &Batch) -> Result<Resilience> {
        let w = ctx.workload;
        let faults = w.faults.as_ref().filter(|f| !f.at_steps.is_empty() || f.mtbf_s.is_some());
        let clock = faults.map(|f| FaultClock::new(f, ctx.entry.seed, t.rank));
        let budget = faults.map(|f| FaultBudget::new(f, w.steps, w.time_budget_s));
        let strategy = &ctx.entry.strategy;
        let store = if t.strategies.checkpoint.never_saves() {
            None
        } else {
            let (run, accept) = run_and_accept(ctx, t)?;
            let store = Store::open(&ctx.checkpoint_dir, t.rank, t.world, strategy.checkpoint_compress, !ctx.resume)?;
            Some(Arc::new(store.for_run(run, accept)?))
        };
        if store.is_some() && t.device.is_cuda() {
            // Before the training clock starts, as the snapshot sets are.
            crate::checkpoint::reserve_read_buffers();
        }
        let mut record = ResilienceRecord::default();
        let tiers = match (&store, strategy.checkpoint_async) {
            (Some(store), true) => {
                // Every rank keeps the parameters in memory, for its own
                // restores; rank 0 alone writes them to disk.
                let (model, state) = t.state()?.sources(true);
                let pool = Pool::allocate(&model, &state, t.device)?;
                record.snapshot_memory_bytes = Some(pool.bytes());
                Some(Tiers {
                    pool,
                    writer: Writer::spawn(store.clone()),
                    memory: None,
                    pending: false,
                    in_flight: None,
                    clean: VecDeque::new(),
                    overlapping: None,
                    deleting: 0,
                    last_now: None,
                    stall_since: Duration::ZERO,
                })
            }
            _ => None,
        };
        if store.is_some() {
            record.checkpoint_mode = Some(if tiers.is_some() { "async" } else { "sync" }.into());
        }
        let initial = match clock {
            Some(_) => {
                let at = batch.position(0, t.data.position());
                Some(t.state()?.capture(at, true)?)
            }
            None => None,
        };
        Ok(Resilience {
            clock,
            budget,
            store,
            tiers,
            history: CheckpointHistory::default(),
            at_risk_since: Duration::ZERO,
            initial,
            rank: t.rank,
            world: t.world,
            record,
        })
    }

    /// `harness run --resume`: an interrupted run of this entry goes on from
    /// its newest checkpoint, which must be this run's and entry's, within
    /// what the run could have produced, and hold finite values (see
    /// [`checkpoint`](super::checkpoint)); else the entry fails, naming the
    /// checkpoint and what is wrong with it. Returns the step it goes on
    /// from.
    pub fn resume(&mut self, ctx: &EntryContext<'_>, t: &mut Training, batch: &mut Batch) -> Result<Option<u64>> {
        let (true, Some(store)) = (ctx.resume, self.store.clone()) else { return Ok(None) };
        let on_disk = store.list().with_context(|| format!("resuming from the checkpoints in {}", ctx.checkpoint_dir.display()))?;
        let Some(&c) = on_disk.last() else { return Ok(None) };
        let dir = store.dir(c);
        let resuming = || format!("resuming from the checkpoint of step {c} in {}", ctx.checkpoint_dir.display());
        let snap = self.read_disk(c).with_context(resuming)?;
        finite(&snap, &dir).with_context(resuming)?;
        restore(t, batch, &snap).with_context(resuming)?;
        batch.rewind(c, true);
        self.history.saved = on_disk;
        self.record.resumed_from = Some(c);
        Ok(Some(c))
    }

    /// This rank's part of the checkpoint of `step`, read from disk into a
    /// free snapshot set of the host-memory tier when there is one (no
    /// allocation, and on CUDA pinned memory, from which the copies to the
    /// device run at full speed).
    fn read_disk(&mut self, step: u64) -> Result<Snapshot> {
        let store = self.store.as_ref().context("a checkpoint without a store")?;
        match self.tiers.as_mut().and_then(|t| t.pool.free()) {
            Some((_, set)) => {
                // Copies of a snapshot lost with the memory tier may still
                // be landing in these buffers.
                set.wait_ready()?;
                store.read_into(step, set)
            }
            None => store.read(step),
        }
    }

    /// Whether the entry's results carry a resilience section.
    pub fn tracked(&self) -> bool {
        self.store.is_some() || self.clock.is_some() || !self.record.out_of_memory.is_empty() || self.record.resumed_from.is_some()
    }

    /// After `telemetry.step` steps at training time `now`: the step's time
    /// is accounted to the checkpoint work it overlapped, the writer's
    /// progress is collected, the policy decides, a failure may strike, and
    /// the ranks agree on all of it. A persist every rank has finished
    /// becomes a checkpoint here.
    pub fn decide(
        &mut self,
        policy: &mut dyn CheckpointPolicy,
        telemetry: &StepTelemetry,
        now: Duration,
        comm: &mut dyn Collective,
        device: Device,
    ) -> Result<Decision> {
        let done = telemetry.step;
        self.account_step(now);
        if let Some(b) = &mut self.budget {
            b.stepped(now.as_secs_f64());
        }
        let part_done = self.poll_writer()?;
        self.history.since_last_s = now.saturating_sub(self.at_risk_since).as_secs_f64();
        let decision = policy.decide(telemetry, &self.history)?;
        let (fail, lose_memory) = match &mut self.clock {
            Some(c) => c.strikes(done, now.as_secs_f64()),
            None => (false, false),
        };
        let over_budget = match &self.budget {
            Some(b) if fail => b.overrun(self.record.failures.len() as u64, self.time_lost_with(now)),
            _ => None,
        };
        let mut d = Decision {
            save: decision.save,
            persist: decision.save && decision.persist,
            fail,
            lose_memory,
            delete: decision.delete,
            parts_done: part_done as usize,
            over_budget,
        };
        if comm.world_size() > 1 && (self.store.is_some() || self.clock.is_some()) {
            d = self.agree(d, comm, device)?;
        }
        if let (true, Some(budget), Some(b)) = (d.fail, d.over_budget, &self.budget) {
            return Err(b.exhausted(budget, done, self.record.failures.len() as u64, self.time_lost_with(now)).into());
        }
        if part_done && d.parts_done == self.world {
            self.persisted()?;
        }
        Ok(d)
    }

    /// The training time failures have cost so far, and a failure at
    /// training time `now` would add (the work since the last checkpoint;
    /// its restore is not known yet).
    fn time_lost_with(&self, now: Duration) -> f64 {
        self.record.time_lost_s + now.saturating_sub(self.at_risk_since).as_secs_f64()
    }

    /// Rank 0's decision holds for every rank (a policy that reads the clock
    /// may decide differently on each): save, persist, failure, whether it
    /// overruns the fault budget, and which of the checkpoints on disk (the
    /// same list on every rank) to delete; the ranks whose part of the
    /// persist in flight is durable are counted.
    fn agree(&self, d: Decision, comm: &mut dyn Collective, device: Device) -> Result<Decision> {
        const FIXED: usize = 6;
        let saved = &self.history.saved;
        let mut v = vec![0f32; FIXED + saved.len()];
        v[4] = d.parts_done as f32;
        if comm.rank() == 0 {
            v[0] = d.save as i32 as f32;
            v[1] = d.persist as i32 as f32;
            v[2] = d.fail as i32 as f32;
            v[3] = d.lose_memory as i32 as f32;
            v[5] = d.over_budget.map_or(0.0, Budget::code);
            for (i, s) in saved.iter().enumerate() {
                v[FIXED + i] = d.delete.contains(s) as i32 as f32;
            }
        }
        let mut flags = Tensor::from_slice(&v).to_device(device);
        comm.all_reduce_sum(&mut flags)?;
        let got = Vec::<f32>::try_from(&flags.to_device(Device::Cpu))?;
        let delete = saved.iter().zip(&got[FIXED..]).filter(|(_, &d)| d > 0.0).map(|(&s, _)| s).collect();
        Ok(Decision {
            save: got[0] > 0.0,
            persist: got[1] > 0.0,
            fail: got[2] > 0.0,
            lose_memory: got[3] > 0.0,
            delete,
            parts_done: got[4].round() as usize,
            over_budget: Budget::of_code(got[5]),
        })
    }

    /// The last iteration's training time (the step, the policies, the
    /// progress report: everything from one decision to the next but a
    /// snapshot's own stall, on the training clock, so evaluation is left
    /// out) goes to the checkpoint whose work ran alongside it, as the
    /// slowdown over the median of recent iterations that overlapped
    /// nothing, or joins those.
    fn account_step(&mut self, now: Duration) {
        let Some(tiers) = &mut self.tiers else { return };
        let since = tiers.last_now.replace(now);
        let stall = std::mem::take(&mut tiers.stall_since);
        let Some(since) = since else { return };
        let iter_s = now.saturating_sub(since).saturating_sub(stall).as_secs_f64();
        let Some(i) = tiers.overlapping else {
            if iter_s > 0.0 {
                tiers.clean.push_back(iter_s);
                if tiers.clean.len() > CLEAN_WINDOW {
                    tiers.clean.pop_front();
                }
            }
            return;
        };
        let last = i + 1 == self.record.checkpoints.len();
        let c = &mut self.record.checkpoints[i];
        c.overlap_steps += 1;
        if let Some(base) = median(&tiers.clean) {
            let extra = iter_s - base;
            c.slowdown_s += extra;
            self.record.checkpoint_slowdown_s += extra;
        }
        if last {
            self.history.last_slowdown_s = Some(c.slowdown_s);
            self.history.last_cost_s = Some(c.cost_s + c.slowdown_s.max(0.0));
        }
        // The snapshot's copies ran during this iteration; the writer's work
        // for it may go on.
        if tiers.in_flight.is_none() && tiers.deleting == 0 {
            tiers.overlapping = None;
        }
    }

    /// A failure struck after `done` steps at training time `now`: the work
    /// since the last checkpoint is lost, and every rank goes back to the
    /// newest checkpoint of either tier (host memory, unless `lose_memory`
    /// took it, then disk, then the start). `synchronized` waits for the
    /// device and forgets what was measured after the restored step, and
    /// returns the training clock. Returns the step training goes on from.
    pub fn fail(
        &mut self,
        t: &mut Training,
        batch: &mut Batch,
        done: u64,
        now: Duration,
        lose_memory: bool,
        synchronized: &mut dyn FnMut(u64) -> Duration,
    ) -> Result<u64> {
        t.strategies.compressor.finish()?;
        let t0 = Instant::now();
        if let Some(tiers) = &mut self.tiers {
            // The restore's iteration is no step to compare.
            tiers.last_now = None;
            tiers.stall_since = Duration::ZERO;
        }
        if lose_memory {
            self.lose_memory()?;
        }
        let memory = self.tiers.as_ref().and_then(|m| m.memory.clone());
        let disk = self.history.saved.last().copied();
        let loaded;
        let mut read = None;
        let (snap, from): (&Snapshot, &str) = match (&memory, disk) {
            (Some(m), d) if d.is_none_or(|d| m.position.step >= d) => {
                m.wait_ready()?;
                (m, "memory")
            }
            (_, Some(s)) => {
                let r0 = Instant::now();
                loaded = self.read_disk(s)?;
                read = Some((r0.elapsed().as_secs_f64(), loaded.bytes()));
                (&loaded, "disk")
            }
            (_, None) => (self.initial.as_ref().context("no initial state to restart from")?, "start"),
        };
        let c = snap.position.step;
        restore(t, batch, snap).with_context(|| format!("restoring the checkpoint of step {c} after the failure at step {done}"))?;
        batch.rewind(c, false);
        let resumed_at = synchronized(c);
        if let Some(b) = &mut self.budget {
            b.resumed(resumed_at.as_secs_f64());
        }
        let restore_s = t0.elapsed().as_secs_f64();
        let lost_s = now.saturating_sub(self.at_risk_since).as_secs_f64();
        self.at_risk_since = resumed_at;
        self.history.failures.push(done);
        self.record.failures.push(FailureRecord {
            step: done,
            restored_to: c,
            lost_s,
            restore_s,
            read_s: read.map(|r| r.0),
            read_bytes: read.map(|r| r.1),
            restored_from: Some(from.into()),
            lost_memory: lose_memory,
        });
        self.record.time_lost_s += lost_s + restore_s;
        Ok(c)
    }

    /// A failure that loses the node's memory: the host-memory tier is
    /// gone, and so is a persist under way (waited for, then deleted if it
    /// was already committed: it could not have finished).
    fn lose_memory(&mut self) -> Result<()> {
        let Some(tiers) = &mut self.tiers else { return Ok(()) };
        tiers.memory = None;
        tiers.pending = false;
        tiers.overlapping = None;
        self.history.in_memory.clear();
        if let Some(f) = tiers.in_flight.take() {
            // The writer dies with the node: the persist under way stops
            // (its temporary files are no checkpoint), or, if it finished
            // already, its checkpoint is deleted (it could not have).
            let mut over = f.part_done.is_some();
            let mut committed = over;
            if !over {
                tiers.writer.cancel();
            }
            while !over {
                match tiers.writer.wait()? {
                    Report::Persisted(_) => (over, committed) = (true, true),
                    Report::Cancelled(_) => over = true,
                    Report::Deleted(_) => tiers.deleting = tiers.deleting.saturating_sub(1),
                }
            }
            tiers.writer.cancel_done();
            if committed && self.world == 1 {
                self.store.as_ref().context("a persist without a store")?.delete(f.position.step)?;
            }
            self.history.persisting = None;
        }
        Ok(())
    }

    /// The entry finished: its checkpoints served a run that has not
    /// finished, so rank 0 removes them, once every rank's writer has
    /// stopped (the ranks meet first: a writer still persisting its rank's
    /// file would otherwise make the directory again after the removal).
    /// Returns the record when the entry's results carry one.
    pub fn finish(
        mut self,
        ctx: &EntryContext<'_>,
        rank: usize,
        comm: &mut dyn harness_runtime::comm::Collective,
        device: tch::Device,
    ) -> Result<Option<ResilienceRecord>> {
        drop(self.tiers.take());
        if self.store.is_some() {
            harness_runtime::comm::ranks_agree(comm, true, device)?;
            if rank == 0 {
                let _ = std::fs::remove_dir_all(&ctx.checkpoint_dir);
            }
        }
        let tracked = self.tracked();
        Ok(tracked.then_some(self.record))
    }
}

/// Who this entry's checkpoints belong to (its suite, entry, seed, ranks,
/// planned steps and plugin builds), and what its restores accept: the
/// tensors its training state has, known before anything is restored, and
/// the range of the batch its batch policy can produce.
fn run_and_accept(ctx: &EntryContext<'_>, t: &mut Training) -> Result<(RunIdentity, Accept)> {
    let w = ctx.workload;
    let plugins: BTreeMap<String, String> =
        t.state()?.plugins().into_iter().map(|(slot, p)| (slot.to_owned(), p.manifest.sha256.clone())).collect();
    let run = RunIdentity {
        suite_sha256: ctx.suite_sha256.to_owned(),
        entry: ctx.entry.id.clone(),
        seed: ctx.entry.seed,
        world_size: t.world as u32,
        steps: w.steps,
        plugins,
        shards: t.dp.shard_layout(),
    };
    let bounds = match t.strategies.batch.plugin_mut() {
        None => Bounds::fixed(w.batch, w.grad_accum, w.steps),
        Some(_) => Bounds::plugin(&ctx.entry.strategy.batch_policy, harness_sandbox::plugin::MAX_BATCH, w.steps),
    };
    Ok((run, Accept { layout: layout(t)?, bounds }))
}

/// The tensors of this rank's checkpoint files, from the training state:
/// the parameters; the buffers, the optimizer's state (SGD's momentum
/// buffers optional: its first step makes them), the loss scaler's and the
/// random generators'; and the plugins' states, each within
/// [`PLUGIN_STATE_BASE`] plus [`PLUGIN_STATE_PER_PARAMETER`] bytes per
/// parameter.
fn layout(t: &mut Training) -> Result<Layout> {
    let params = t.current_params()?;
    let n_params: u64 = params.iter().map(|p| p.numel() as u64).sum();
    let model = t.names.iter().zip(params).map(|(n, p)| TensorSpec::of(n.clone(), p)).collect();
    let mut specs: Vec<TensorSpec> = t.buffers.iter().map(|(n, b)| TensorSpec::of(format!("buffer/{n}"), b)).collect();
    specs.extend(t.optimizer.state_specs().into_iter().map(|(n, kind, shape, optional)| TensorSpec {
        name: format!("optimizer/{n}"),
        kind,
        shape,
        optional,
    }));
    if let Some(s) = &t.scaler {
        specs.extend(s.state_tensors().into_iter().map(|(n, x)| TensorSpec::of(format!("scaler/{n}"), &x)));
    }
    specs.push(TensorSpec::of("rng/cpu", &torch_ext::rng_state(Device::Cpu)?));
    if t.device.is_cuda() {
        specs.push(TensorSpec::of("rng/device", &torch_ext::rng_state(t.device)?));
    }
    let plugins = t.state()?.plugins().into_iter().map(|(slot, _)| slot.to_owned()).collect();
    let cap = PLUGIN_STATE_BASE.saturating_add(PLUGIN_STATE_PER_PARAMETER.saturating_mul(n_params));
    Ok(Layout { model, state: specs, plugins, plugin_state_cap: cap })
}

/// Refuses a snapshot read from the checkpoint in `dir` whose parameters or
/// floating-point state hold a NaN or an infinity.
fn finite(snap: &Snapshot, dir: &std::path::Path) -> Result<()> {
    for (file, tensors) in [("model", &snap.model), ("state", &snap.state)] {
        for (name, t) in tensors.iter().filter(|(_, t)| t.is_floating_point()) {
            if t.f_isfinite()?.f_all()?.int64_value(&[]) == 0 {
                return Err(super::checkpoint::refused(dir, format!("{file}: tensor {name}"), "holds NaN or infinite values"));
            }
        }
    }
    Ok(())
}

/// Puts `snap` back: the training state, the data stream's position and
/// the batch in force.
fn restore(t: &mut Training, batch: &mut Batch, snap: &Snapshot) -> Result<()> {
    t.state()?.restore(snap)?;
    t.data.seek(snap.position.data_position);
    batch.restore(&snap.position);
    t.forget_in_flight();
    Ok(())
}

#[cfg(test)]
mod tests;
