//! What survives a failure: the fault clock that injects failures and the
//! budget that bounds what they may cost, the checkpoint store and the
//! policy's history, capturing and restoring a rank's training state, and
//! what checkpoints and failures cost ([`Resilience`]).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Device, Tensor};

use super::batch::Batch;
use super::checkpoint::{
    host_copy, Accept, Bounds, Layout, Position, RunIdentity, Snapshot, Store, TensorSpec, PLUGIN_STATE_BASE, PLUGIN_STATE_PER_PARAMETER,
};
use super::tiers::{copy_into, Persisted, Pool, Report, Shared, Writer};
use crate::entry::EntryContext;
use crate::training::{TrainState, Training};
use harness_format::results::{CheckpointRecord, FailureRecord, ResilienceRecord};
use harness_format::suite::FaultSpec;
use harness_kernels::torch_ext;
use harness_runtime::comm::{ranks_agree, Collective};
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

    /// Collects the writer's reports. Returns whether this rank's part of
    /// the persist in flight is durable.
    fn poll_writer(&mut self) -> Result<bool> {
        let Some(tiers) = &mut self.tiers else { return Ok(false) };
        for r in tiers.writer.poll()? {
            match r {
                Report::Persisted(p) => match &mut tiers.in_flight {
                    Some(f) => f.part_done = Some(p),
                    None => anyhow::bail!("the checkpoint writer reported a persist nobody asked for"),
                },
                Report::Deleted(_) => tiers.deleting = tiers.deleting.saturating_sub(1),
                // Only a lost node cancels, and it waits for the report.
                Report::Cancelled(step) => anyhow::bail!("the checkpoint writer gave up the persist of step {step} unasked"),
            }
        }
        Ok(tiers.in_flight.as_ref().is_some_and(|f| f.part_done.is_some()))
    }

    /// Every rank's part of the persist in flight is durable: rank 0 commits
    /// it (the writer already did with one rank), it counts as saved, and
    /// the snapshot waiting for the writer, if any, goes next.
    fn persisted(&mut self) -> Result<()> {
        let tiers = self.tiers.as_mut().context("a persist without a writer")?;
        let f = tiers.in_flight.take().context("no persist in flight")?;
        let p = f.part_done.context("the persist is not durable")?;
        let t0 = Instant::now();
        if self.world > 1 && self.rank == 0 {
            let store = self.store.as_ref().context("a persist without a store")?;
            store.commit(f.position).with_context(|| format!("committing the checkpoint of step {}", p.step))?;
        }
        let seconds = p.seconds + t0.elapsed().as_secs_f64();
        self.history.saved.retain(|&s| s != p.step);
        self.history.saved.push(p.step);
        self.history.persisting = None;
        self.history.last_persist_s = Some(seconds);
        let c = &mut self.record.checkpoints[f.record];
        c.persisted = true;
        c.persist_s = Some(seconds);
        c.bytes = p.bytes;
        if tiers.overlapping == Some(f.record) && tiers.deleting == 0 {
            tiers.overlapping = None;
        }
        if std::mem::take(&mut tiers.pending) {
            if let Some(snap) = tiers.memory.clone() {
                self.start_persist(snap);
            }
        }
        Ok(())
    }

    /// Hands `snap` to the writer.
    fn start_persist(&mut self, snap: Arc<Shared>) {
        let Some(tiers) = &mut self.tiers else { return };
        let step = snap.position.step;
        let record = self.record.checkpoints.iter().rposition(|c| c.step == step).unwrap_or(self.record.checkpoints.len() - 1);
        tiers.writer.start(snap.clone(), self.world == 1);
        tiers.in_flight = Some(InFlight { position: snap.position, record, part_done: None });
        tiers.overlapping = Some(record);
        self.history.persisting = Some(step);
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

    /// Checkpoints `done` steps. Asynchronously (the default): a snapshot
    /// into host memory while training waits, then, with `persist`, the
    /// writer puts it on disk while training goes on. Synchronously: every
    /// rank writes its part, and rank 0 commits it once every part is
    /// durable. `synchronize` waits for the device; `elapsed` reads the
    /// training clock afterwards.
    #[allow(clippy::too_many_arguments)]
    pub fn save(
        &mut self,
        t: &mut Training,
        batch: &Batch,
        done: u64,
        persist: bool,
        comm: &mut dyn Collective,
        synchronize: &dyn Fn(),
        elapsed: &dyn Fn() -> Duration,
    ) -> Result<()> {
        if self.tiers.is_none() {
            return self.save_sync(t, batch, done, comm, synchronize, elapsed);
        }
        let t0 = Instant::now();
        let at = batch.position(done, t.data.position());
        let tiers = self.tiers.as_mut().context("no snapshot buffers")?;
        if tiers.pool.free().is_none() {
            // The memory tier's snapshot gives way to the newer one (a
            // persist waiting for it moves to the newer one too).
            tiers.memory = None;
        }
        let (i, set) = tiers.pool.free().context("no free snapshot buffers")?;
        t.state()?.capture_into(set, at, true)?;
        let snap = tiers.pool.share(i);
        tiers.memory = Some(snap.clone());
        let stall = t0.elapsed().as_secs_f64();
        self.record.checkpoints.push(CheckpointRecord {
            step: done,
            cost_s: stall,
            bytes: snap.bytes(),
            deleted: Vec::new(),
            persisted: false,
            persist_s: None,
            overlap_steps: 0,
            slowdown_s: 0.0,
        });
        tiers.overlapping = Some(self.record.checkpoints.len() - 1);
        tiers.stall_since += t0.elapsed();
        self.record.checkpoint_time_s += stall;
        self.history.in_memory = vec![done];
        self.history.last_stall_s = Some(stall);
        self.history.last_slowdown_s = Some(0.0);
        self.history.last_cost_s = Some(stall);
        self.at_risk_since = elapsed();
        if persist {
            if tiers.in_flight.is_none() {
                self.start_persist(snap);
            } else {
                tiers.pending = true;
            }
        }
        Ok(())
    }

    /// The synchronous path: training waits until the checkpoint is durable.
    fn save_sync(
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
        let written = t.state()?.capture(at, rank == 0).and_then(|snap| store.write_part(&snap));
        // Every rank's part is durable before rank 0 makes it a checkpoint.
        let all_ok = ranks_agree(comm, written.is_ok(), device)?;
        let bytes = written.with_context(|| format!("writing the checkpoint of step {done}"))?;
        anyhow::ensure!(all_ok, "another rank failed to write its part of the checkpoint of step {done}");
        if rank == 0 {
            store.commit(at).with_context(|| format!("committing the checkpoint of step {done}"))?;
        }
        ranks_agree(comm, true, device)?;
        let cost = t0.elapsed().as_secs_f64();
        self.history.saved.retain(|&s| s != done);
        self.history.saved.push(done);
        self.history.last_cost_s = Some(cost);
        self.history.last_stall_s = Some(cost);
        self.history.last_persist_s = Some(cost);
        self.at_risk_since = elapsed();
        self.record.checkpoints.push(CheckpointRecord {
            step: done,
            cost_s: cost,
            bytes,
            deleted: Vec::new(),
            persisted: true,
            persist_s: Some(cost),
            overlap_steps: 0,
            slowdown_s: 0.0,
        });
        self.record.checkpoint_time_s += cost;
        Ok(())
    }

    /// Deletes the checkpoints of `steps` (rank 0 deletes the files: on the
    /// asynchronous path through the writer, behind the persist under way).
    pub fn delete(&mut self, steps: &[u64], rank: usize) -> Result<()> {
        for &d in steps {
            if rank == 0 {
                match &mut self.tiers {
                    Some(tiers) => {
                        tiers.writer.delete(d);
                        tiers.deleting += 1;
                        if let Some(c) = self.record.checkpoints.len().checked_sub(1) {
                            tiers.overlapping.get_or_insert(c);
                        }
                    }
                    None => self.store.as_ref().context("a checkpoint deletion without a store")?.delete(d)?,
                }
            }
            self.history.saved.retain(|&s| s != d);
            if let Some(c) = self.record.checkpoints.last_mut() {
                c.deleted.push(d);
            }
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

/// The median of `xs`, if any.
fn median(xs: &VecDeque<f64>) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v: Vec<f64> = xs.iter().copied().collect();
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
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

/// When injected failures strike, and which of them lose host memory.
pub struct FaultClock {
    /// Listed steps that have not struck yet (each strikes once).
    at_steps: BTreeSet<u64>,
    /// Random failures: the mean time between them, the generator and the
    /// training time of the next one.
    random: Option<(f64, ChaCha8Rng, f64)>,
    /// The share of failures that lose host memory, and its generator.
    lose: Option<(f64, ChaCha8Rng)>,
}

impl FaultClock {
    /// The clock of `spec`. Random draws happen on rank 0 only (the ranks
    /// then agree through a collective); listed steps strike on every rank.
    pub fn new(spec: &FaultSpec, entry_seed: u64, rank: usize) -> FaultClock {
        let seed = spec.seed.unwrap_or(entry_seed);
        let random = spec.mtbf_s.filter(|_| rank == 0).map(|mtbf| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xfa11_0fa1);
            let first = exponential(&mut rng, mtbf);
            (mtbf, rng, first)
        });
        let lose = spec.lose_memory.filter(|&p| rank == 0 && p > 0.0).map(|p| (p, ChaCha8Rng::seed_from_u64(seed ^ 0x10_5e_4e_40)));
        FaultClock { at_steps: spec.at_steps.iter().copied().collect(), random, lose }
    }

    /// Whether a failure strikes now, with `done` steps completed after
    /// `elapsed_s` seconds of training, and whether it loses host memory.
    pub fn strikes(&mut self, done: u64, elapsed_s: f64) -> (bool, bool) {
        let listed = self.at_steps.remove(&done);
        let random = match &mut self.random {
            Some((mtbf, rng, next)) if elapsed_s >= *next => {
                *next = elapsed_s + exponential(rng, *mtbf);
                true
            }
            _ => false,
        };
        let fail = listed || random;
        let lose = fail && self.lose.as_mut().is_some_and(|(p, rng)| rng.random::<f64>() < *p);
        (fail, lose)
    }
}

/// An exponentially distributed time with mean `mean`.
fn exponential(rng: &mut ChaCha8Rng, mean: f64) -> f64 {
    -(1.0 - rng.random::<f64>()).ln() * mean
}

/// Which fault budget a failure overran.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// `faults.max_restarts`.
    Restarts,
    /// `faults.max_time_lost_ratio`.
    TimeLost,
}

impl Budget {
    /// As a number the ranks agree on (0: none).
    fn code(self) -> f32 {
        match self {
            Budget::Restarts => 1.0,
            Budget::TimeLost => 2.0,
        }
    }

    fn of_code(x: f32) -> Option<Budget> {
        match x.round() as i32 {
            1 => Some(Budget::Restarts),
            2 => Some(Budget::TimeLost),
            _ => None,
        }
    }
}

/// Recent steps the failure-free training time is estimated from.
const STEP_WINDOW: usize = 32;

/// What injected failures may cost an entry before it ends, failed,
/// instead of restarting (`faults.max_restarts`,
/// `faults.max_time_lost_ratio`): failures more frequent than the entry
/// can checkpoint (or finish, without checkpoints) would otherwise restart
/// it for ever. Time lost is weighed against the entry's own failure-free
/// training time, so the budget scales with the entry: its planned steps
/// at its median step time (steps between decisions on the training
/// clock, measured as it trains, restores left out), or its time budget,
/// whichever is shorter.
pub struct FaultBudget {
    max_restarts: u64,
    max_ratio: f64,
    steps: Option<u64>,
    time_budget_s: Option<f64>,
    /// Recent step times, seconds.
    recent: VecDeque<f64>,
    /// The training time of the last decision or restore.
    last_s: f64,
}

impl FaultBudget {
    /// The budget of `spec` for an entry of `steps` steps or a time budget
    /// of `time_budget_s` seconds.
    pub fn new(spec: &FaultSpec, steps: Option<u64>, time_budget_s: Option<f64>) -> FaultBudget {
        FaultBudget {
            max_restarts: spec.max_restarts(),
            max_ratio: spec.max_time_lost_ratio(),
            steps,
            time_budget_s,
            recent: VecDeque::new(),
            last_s: 0.0,
        }
    }

    /// A step ended at training time `now_s`.
    pub fn stepped(&mut self, now_s: f64) {
        let step = now_s - std::mem::replace(&mut self.last_s, now_s);
        if step > 0.0 {
            self.recent.push_back(step);
            if self.recent.len() > STEP_WINDOW {
                self.recent.pop_front();
            }
        }
    }

    /// Training went on at training time `at_s` after a restore.
    pub fn resumed(&mut self, at_s: f64) {
        self.last_s = at_s;
    }

    /// The entry's failure-free training time, seconds, as estimated now.
    pub fn failure_free_s(&self) -> Option<f64> {
        let by_steps = self.steps.zip(median(&self.recent)).map(|(n, step)| n as f64 * step);
        match (by_steps, self.time_budget_s) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether a failure after `restarts` restarts, with `lost_s` seconds
    /// of training lost including its own, overruns the budget.
    pub fn overrun(&self, restarts: u64, lost_s: f64) -> Option<Budget> {
        if restarts >= self.max_restarts {
            return Some(Budget::Restarts);
        }
        let most = self.failure_free_s()? * self.max_ratio;
        (lost_s > most).then_some(Budget::TimeLost)
    }

    /// The entry's error when a failure at step `step` overran `budget`.
    pub fn exhausted(&self, budget: Budget, step: u64, restarts: u64, lost_s: f64) -> FaultBudgetExhausted {
        let over = match budget {
            Budget::Restarts => format!("the restart budget, `faults.max_restarts` = {}", self.max_restarts),
            Budget::TimeLost => format!(
                "the time-lost budget, `faults.max_time_lost_ratio` = {} times the entry's failure-free training time (about {:.3} s)",
                self.max_ratio,
                self.failure_free_s().unwrap_or(0.0)
            ),
        };
        let (n, step_ms) = (restarts + 1, median(&self.recent).unwrap_or(0.0) * 1e3);
        FaultBudgetExhausted {
            message: format!(
                "injected failures exhausted {over}: failure {n} struck at step {step}, and the {n} failures lost {lost_s:.3} s of training (the work since the last checkpoint, and the restores); the entry ends instead of restarting again. Its steps take about {step_ms:.3} ms: make failures rarer (`faults.mtbf_s`, `faults.at_steps`), checkpoint more often, or raise the budget"
            ),
        }
    }
}

/// An entry ended by its fault budget ([`FaultBudget`]).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct FaultBudgetExhausted {
    message: String,
}

/// Tensors by name.
type Named = Vec<(String, Tensor)>;

impl TrainState<'_> {
    /// The tensors a snapshot copies, where they live: the parameters
    /// (`with_model`: rank 0 writes them for every rank) and this rank's
    /// buffers, optimizer and scaler state.
    pub fn sources(&self, with_model: bool) -> (Named, Named) {
        let model =
            if with_model { self.names.iter().cloned().zip(self.params.iter().map(|p| p.shallow_clone())).collect() } else { Vec::new() };
        let mut state: Vec<(String, Tensor)> = self.buffers.iter().map(|(n, t)| (format!("buffer/{n}"), t.shallow_clone())).collect();
        state.extend(self.optimizer.state_tensors().into_iter().map(|(n, t)| (format!("optimizer/{n}"), t)));
        if let Some(s) = &self.scaler {
            state.extend(s.state_tensors().into_iter().map(|(n, t)| (format!("scaler/{n}"), t)));
        }
        (model, state)
    }

    /// A host copy of this rank's state at `position` (see [`Self::sources`]).
    pub fn capture(&mut self, position: Position, with_model: bool) -> Result<Snapshot> {
        let (model, state) = self.sources(with_model);
        let model = model.into_iter().map(|(n, t)| (n, host_copy(&t))).collect();
        let mut state: Vec<(String, Tensor)> = state.into_iter().map(|(n, t)| (n, host_copy(&t))).collect();
        self.capture_host_side(&mut state)?;
        let mut plugins = Vec::new();
        for (slot, p) in self.plugins() {
            plugins.push((slot.to_owned(), p.state_save()?));
        }
        Ok(Snapshot { position, model, state, plugins, ready: None })
    }

    /// Takes the snapshot of `position` into `dst`'s preallocated buffers:
    /// the device copies are queued without waiting (an event marks their
    /// end), the small host-side state is saved at once.
    pub fn capture_into(&mut self, dst: &mut Snapshot, position: Position, with_model: bool) -> Result<()> {
        let (model, state) = self.sources(with_model);
        // The set holds the state and, after a snapshot, the generators'
        // states behind it (appended below).
        let fits =
            dst.state.len() >= state.len() && dst.state.iter().zip(&state).all(|((dn, d), (sn, s))| dn == sn && d.size() == s.size());
        if fits {
            dst.state.truncate(state.len());
        } else {
            // The state grew after the sets were allocated: SGD makes its
            // momentum buffers at its first step. Allocated again, once.
            dst.state = super::tiers::buffers(&state, self.device.is_cuda())?;
        }
        copy_into(&dst.model, &model)?;
        copy_into(&dst.state, &state)?;
        dst.ready = match self.device {
            Device::Cuda(i) => Some(torch_ext::Event::record(i)?),
            _ => None,
        };
        self.capture_host_side(&mut dst.state)?;
        dst.plugins.clear();
        for (slot, p) in self.plugins() {
            dst.plugins.push((slot.to_owned(), p.state_save()?));
        }
        dst.position = position;
        Ok(())
    }

    /// The random generators' states, appended to `state`.
    fn capture_host_side(&mut self, state: &mut Vec<(String, Tensor)>) -> Result<()> {
        state.push(("rng/cpu".into(), torch_ext::rng_state(Device::Cpu)?));
        if self.device.is_cuda() {
            state.push(("rng/device".into(), torch_ext::rng_state(self.device)?));
        }
        Ok(())
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
            for (name, b) in self.buffers {
                let v = snap
                    .state
                    .iter()
                    .find(|(n, _)| n.strip_prefix("buffer/") == Some(name))
                    .with_context(|| format!("the checkpoint lacks buffer `{name}`"))?;
                anyhow::ensure!(v.1.size() == b.size(), "buffer `{name}`: shape {:?} in the checkpoint, {:?} here", v.1.size(), b.size());
                b.shallow_clone().copy_(&v.1);
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

    fn plugins(&mut self) -> Vec<(&'static str, &mut harness_sandbox::plugin::Plugin)> {
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
        let hits: Vec<u64> = (1..=10).filter(|&s| c.strikes(s, 0.0).0).collect();
        assert_eq!(hits, vec![3, 7]);
        assert!(!c.strikes(3, 0.0).0, "a listed failure struck twice (after a restore)");

        // 20,000 draws with mean 5 s: the mean interval is 5 s within 3%.
        let spec = FaultSpec { mtbf_s: Some(5.0), seed: Some(9), ..FaultSpec::default() };
        let mut c = FaultClock::new(&spec, 1, 0);
        let (mut n, mut t) = (0u32, 0.0);
        while n < 20_000 {
            t += 0.01;
            if c.strikes(0, t).0 {
                n += 1;
            }
        }
        assert!((t / n as f64 - 5.0).abs() < 0.15, "mean time between failures {}", t / n as f64);
        // Other ranks follow rank 0 through a collective.
        assert!(FaultClock::new(&spec, 1, 1).random.is_none());
    }

    #[test]
    fn the_fault_budget_ends_an_entry_that_fails_faster_than_it_trains() {
        // Issue 61: `mtbf_s = 1e-300` restarted a 50-step entry for ever.
        // Every step of 2 ms fails, and its restore takes 1 ms.
        let spec = FaultSpec { mtbf_s: Some(1e-3), ..FaultSpec::default() };
        let mut b = FaultBudget::new(&spec, Some(50), None);
        let (mut t, mut lost, mut restarts) = (0.0, 0.0, 0u64);
        let ended = loop {
            t += 0.002;
            b.stepped(t);
            if let Some(over) = b.overrun(restarts, lost + 0.002) {
                break over;
            }
            lost += 0.003;
            t += 0.001;
            b.resumed(t);
            restarts += 1;
            assert!(restarts < 1000, "no budget ended it");
        };
        // Failure-free: 50 steps of 2 ms (restores left out), 0.1 s; ten
        // times that, 1 s, is lost at the 334th failure (3 ms each).
        assert_eq!(ended, Budget::TimeLost);
        assert!((b.failure_free_s().unwrap() - 0.1).abs() < 1e-9, "{:?}", b.failure_free_s());
        assert_eq!(restarts, 333);
        let e = b.exhausted(ended, 1, restarts, lost + 0.002).to_string();
        assert!(e.contains("`faults.max_time_lost_ratio` = 10 times the entry's failure-free training time (about 0.100 s)"), "{e}");
        assert!(e.contains("failure 334 struck at step 1, and the 334 failures lost 1.001 s of training"), "{e}");
        assert!(e.contains("Its steps take about 2.000 ms"), "{e}");

        // The restart budget, whatever the time.
        let spec = FaultSpec { at_steps: vec![1], max_restarts: Some(3), ..FaultSpec::default() };
        let b = FaultBudget::new(&spec, Some(50), None);
        assert_eq!(b.overrun(2, 1e9), None, "no step measured yet: only restarts count");
        assert_eq!(b.overrun(3, 0.0), Some(Budget::Restarts));
        assert!(b.exhausted(Budget::Restarts, 9, 3, 0.5).to_string().starts_with(
            "injected failures exhausted the restart budget, `faults.max_restarts` = 3: failure 4 struck at step 9, and the 4 failures lost 0.500 s"
        ));

        // A time budget bounds the failure-free time; the shorter counts.
        let spec = FaultSpec { mtbf_s: Some(1.0), ..FaultSpec::default() };
        let mut b = FaultBudget::new(&spec, None, Some(60.0));
        assert_eq!(b.failure_free_s(), Some(60.0));
        assert_eq!(b.overrun(5, 599.0), None);
        b = FaultBudget::new(&spec, Some(1000), Some(60.0));
        b.stepped(0.01);
        assert_eq!(b.failure_free_s(), Some(10.0));
        // The ranks agree on the budget as a number.
        for x in [None, Some(Budget::Restarts), Some(Budget::TimeLost)] {
            assert_eq!(Budget::of_code(x.map_or(0.0, Budget::code)), x);
        }
    }

    #[test]
    fn a_checkpoint_holding_nan_or_infinity_is_refused_naming_the_tensor() {
        let snap = |v: f32| Snapshot {
            position: Position { step: 40, data_position: 160, micro_batch: 4, accum_steps: 1, lr_scale: 1.0 },
            model: vec![("w".into(), Tensor::from_slice(&[1.0f32, v]))],
            state: vec![("rng/cpu".into(), Tensor::from_slice(&[255u8])), ("optimizer/exp_avg.0".into(), Tensor::from_slice(&[v as f64]))],
            plugins: Vec::new(),
            ready: None,
        };
        let dir = std::path::Path::new("/results/run.checkpoints/w_a_r0/step-00000040");
        finite(&snap(2.0), dir).unwrap();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let e = format!("{:#}", finite(&snap(bad), dir).unwrap_err());
            assert_eq!(e, format!("checkpoint {} refused: `model: tensor w` holds NaN or infinite values", dir.display()));
        }
        let mut s = snap(2.0);
        s.state[1].1 = Tensor::from_slice(&[f64::NAN]);
        let e = format!("{:#}", finite(&s, dir).unwrap_err());
        assert!(e.contains("`state: tensor optimizer/exp_avg.0` holds NaN"), "{e}");
    }
}
