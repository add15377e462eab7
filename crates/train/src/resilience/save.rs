//! Checkpoints saved, persisted and deleted: the host-memory tier's
//! snapshots and the writer that puts them on disk, or the synchronous
//! path.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::{InFlight, Resilience};
use crate::batch::Batch;
use crate::tiers::{Report, Shared};
use crate::training::Training;
use harness_format::results::CheckpointRecord;
use harness_runtime::comm::{ranks_agree, Collective};

impl Resilience {
    /// Collects the writer's reports. Returns whether this rank's part of
    /// the persist in flight is durable.
    pub(super) fn poll_writer(&mut self) -> Result<bool> {
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
    pub(super) fn persisted(&mut self) -> Result<()> {
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
}
