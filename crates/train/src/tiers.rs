//! The two tiers of asynchronous checkpoints: snapshots in preallocated
//! host memory ([`Pool`]), taken while training waits, and their
//! persistence to disk by a background writer ([`Writer`]) while training
//! goes on.
//!
//! On CUDA the snapshot's copies go into pinned memory without waiting: they
//! are queued on the training stream behind the step that produced the
//! state, an event marks their end, and whoever reads the snapshot (the
//! writer, a restore) waits for that event first. Training stops only to
//! queue the copies and save the small host-side state (random generators,
//! plugin states); the copies themselves slow the step that follows, which
//! the host measures as that checkpoint's slowdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{Context, Result};
use tch::{Device, Tensor};

use super::checkpoint::{Cancelled, Position, Snapshot, Store};
use harness_kernels::torch_ext;

/// A snapshot shared between the training thread (the memory tier,
/// restores) and the writer.
pub struct Shared(pub Snapshot);

// SAFETY: a shared snapshot is only read (its tensors' bytes, copies out of
// them), from any thread; it is written only through `Arc::get_mut`, when
// no other thread holds it. libtorch allows concurrent reads of a tensor.
unsafe impl Sync for Shared {}

impl std::ops::Deref for Shared {
    type Target = Snapshot;
    fn deref(&self) -> &Snapshot {
        &self.0
    }
}

/// Two sets of host buffers shaped like one rank's training state: one
/// can be persisted while the other takes the newest snapshot.
pub struct Pool {
    sets: Vec<Arc<Shared>>,
}

/// A set of buffers of `like`'s shapes on the host, pinned when the state
/// lives on a GPU (so copies into them need not wait).
pub(super) fn buffers(like: &[(String, Tensor)], pinned: bool) -> Result<Vec<(String, Tensor)>> {
    like.iter()
        .map(|(n, t)| {
            let b = Tensor::empty(t.size(), (t.kind(), Device::Cpu));
            let b = if pinned { torch_ext::pin_memory(&b)? } else { b };
            Ok((n.clone(), b))
        })
        .collect()
}

impl Pool {
    /// Allocates the buffers for `model` (rank 0's parameters, else empty)
    /// and `state` (this rank's optimizer and scaler state).
    pub fn allocate(model: &[(String, Tensor)], state: &[(String, Tensor)], device: Device) -> Result<Pool> {
        let pinned = device.is_cuda();
        let mut sets = Vec::new();
        for _ in 0..2 {
            sets.push(Arc::new(Shared(Snapshot {
                position: Position { step: 0, data_position: 0, micro_batch: 0, accum_steps: 0, lr_scale: 1.0 },
                model: buffers(model, pinned).context("allocating host memory for checkpoint snapshots")?,
                state: buffers(state, pinned).context("allocating host memory for checkpoint snapshots")?,
                plugins: Vec::new(),
                ready: None,
            })));
        }
        Ok(Pool { sets })
    }

    /// Bytes of host memory the pool holds.
    pub fn bytes(&self) -> u64 {
        self.sets.iter().map(|s| s.bytes()).sum()
    }

    /// A set that nobody else holds (not the memory tier's, not the one
    /// being persisted), to take a snapshot into.
    pub fn free(&mut self) -> Option<(usize, &mut Snapshot)> {
        self.sets.iter_mut().enumerate().find_map(|(i, s)| Arc::get_mut(s).map(|s| (i, &mut s.0)))
    }

    /// The set `i`, shared.
    pub fn share(&self, i: usize) -> Arc<Shared> {
        self.sets[i].clone()
    }
}

/// Copies the device tensors `src` into the snapshot buffers `dst` (same
/// names and shapes, in order) without waiting for the device.
pub fn copy_into(dst: &[(String, Tensor)], src: &[(String, Tensor)]) -> Result<()> {
    anyhow::ensure!(dst.len() == src.len(), "the training state changed shape since the snapshot buffers were allocated");
    for ((dn, d), (sn, s)) in dst.iter().zip(src) {
        anyhow::ensure!(dn == sn && d.size() == s.size(), "snapshot buffer `{dn}` {:?} does not fit `{sn}` {:?}", d.size(), s.size());
    }
    let d: Vec<Tensor> = dst.iter().map(|(_, t)| t.shallow_clone()).collect();
    let s: Vec<Tensor> = src.iter().map(|(_, t)| t.detach()).collect();
    tch::no_grad(|| torch_ext::copy_nonblocking(&d, &s))?;
    Ok(())
}

/// What the writer finished.
pub enum Report {
    Persisted(Persisted),
    Deleted(u64),
    /// A persist given up through [`Writer::cancel`] (with one rank, its
    /// temporary files are removed).
    Cancelled(u64),
}

/// A persist the writer finished: durable on this rank (and committed, with
/// one rank).
pub struct Persisted {
    pub step: u64,
    pub bytes: u64,
    /// From the job's start to durable.
    pub seconds: f64,
}

enum Job {
    Persist {
        snap: Arc<Shared>,
        commit: bool,
    },
    /// Rank 0: delete a checkpoint (after the persist queued before it).
    Delete(u64),
}

/// One rank's background writer: persists snapshots, one at a time.
pub struct Writer {
    jobs: Option<Sender<Job>>,
    cancel: Arc<AtomicBool>,
    done: Receiver<Result<Report>>,
    thread: Option<JoinHandle<()>>,
}

impl Writer {
    /// Starts the writer thread of `store`.
    pub fn spawn(store: Arc<Store>) -> Writer {
        let (jobs, rx) = mpsc::channel::<Job>();
        let (tx, done) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let cancelled = cancel.clone();
        let thread = std::thread::Builder::new()
            .name("checkpoint-writer".into())
            .spawn(move || {
                for job in rx {
                    let r = match job {
                        // The job (and its hold on the snapshot) ends before
                        // the report, so the buffers are free once it is read.
                        Job::Persist { snap, commit } => {
                            let step = snap.position.step;
                            match persist(&store, snap, commit, &cancelled) {
                                Err(e) if e.is::<Cancelled>() => {
                                    cancelled.store(false, Ordering::SeqCst);
                                    let gone = if commit { store.discard(step) } else { Ok(()) };
                                    gone.map(|()| Report::Cancelled(step))
                                }
                                r => r.map(Report::Persisted),
                            }
                        }
                        Job::Delete(step) => store
                            .delete(step)
                            .map(|()| Report::Deleted(step))
                            .with_context(|| format!("deleting the checkpoint of step {step}")),
                    };
                    if tx.send(r).is_err() {
                        break;
                    }
                }
            })
            .expect("starting the checkpoint writer thread");
        Writer { jobs: Some(jobs), cancel, done, thread: Some(thread) }
    }

    /// Gives up the persist under way, if any, as soon as it notices (every
    /// 16 MiB); its report is `Cancelled`, or `Persisted` if it had
    /// finished. A node that fails loses its writer with its memory.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// After the cancelled persist's report: a persist that had finished
    /// before it noticed leaves the request set, which must not stop the
    /// next one.
    pub fn cancel_done(&self) {
        self.cancel.store(false, Ordering::SeqCst);
    }

    /// Persists `snap`; with `commit` (one rank) the writer also makes it a
    /// checkpoint once its files are durable.
    pub fn start(&self, snap: Arc<Shared>, commit: bool) {
        if let Some(j) = &self.jobs {
            let _ = j.send(Job::Persist { snap, commit });
        }
    }

    /// Deletes the checkpoint of `step` once the work queued before is done.
    /// In the writer, not on the training thread: deleting syncs the
    /// checkpoint directory, which on common filesystems waits for the
    /// persist under way to reach the disk.
    pub fn delete(&self, step: u64) {
        if let Some(j) = &self.jobs {
            let _ = j.send(Job::Delete(step));
        }
    }

    /// What the writer finished since the last call.
    pub fn poll(&self) -> Result<Vec<Report>> {
        let mut out = Vec::new();
        loop {
            match self.done.try_recv() {
                Ok(r) => out.push(r?),
                Err(TryRecvError::Empty) => return Ok(out),
                Err(TryRecvError::Disconnected) => anyhow::bail!("the checkpoint writer thread ended"),
            }
        }
    }

    /// Waits for the next thing the writer finishes.
    pub fn wait(&self) -> Result<Report> {
        self.done.recv().context("the checkpoint writer thread ended")?
    }
}

/// Writes one job's files, durably, and commits them if it says so.
fn persist(store: &Store, snap: Arc<Shared>, commit: bool, cancel: &AtomicBool) -> Result<Persisted> {
    let t0 = Instant::now();
    let step = snap.position.step;
    snap.wait_ready()?;
    // A cancellation stays recognisable through the context (`is`).
    let bytes = store.write_part_unless(&snap, cancel).with_context(|| format!("writing the checkpoint of step {step}"))?;
    if commit {
        store.commit(snap.position).with_context(|| format!("committing the checkpoint of step {step}"))?;
    }
    Ok(Persisted { step, bytes, seconds: t0.elapsed().as_secs_f64() })
}

impl Drop for Writer {
    /// Lets the persist in flight finish (its files stay consistent: until
    /// committed, they are a temporary directory).
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint;

    fn shared(step: u64) -> Arc<Shared> {
        Arc::new(Shared(Snapshot {
            position: Position { step, data_position: 0, micro_batch: 1, accum_steps: 1, lr_scale: 1.0 },
            model: vec![("w".into(), Tensor::ones([1 << 20], (tch::Kind::Float, Device::Cpu)))],
            state: Vec::new(),
            plugins: Vec::new(),
            ready: None,
        }))
    }

    #[test]
    fn a_cancelled_persist_leaves_no_files_and_the_next_one_persists() {
        let d = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(d.path(), 0, 1, false, true).unwrap());
        let w = Writer::spawn(store.clone());
        // Cancelled before its first piece is written.
        w.cancel();
        w.start(shared(5), true);
        assert!(matches!(w.wait().unwrap(), Report::Cancelled(5)));
        assert!(checkpoint::list(d.path()).is_empty());
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0, "temporary files left behind");
        // A request that comes after the persist finished stops nothing later.
        w.start(shared(6), true);
        assert!(matches!(w.wait().unwrap(), Report::Persisted(Persisted { step: 6, .. })));
        w.cancel();
        w.cancel_done();
        w.start(shared(7), true);
        assert!(matches!(w.wait().unwrap(), Report::Persisted(Persisted { step: 7, .. })));
        assert_eq!(checkpoint::list(d.path()).iter().map(|c| c.0).collect::<Vec<_>>(), [6, 7]);
    }
}
