//! ZeRO's shards: this rank's pieces of each bucket, ZeRO-1's gradient
//! buffers in symmetric memory, and the updated parameters' all-gathers,
//! in flight into the next forward pass.

use tch::Tensor;

use super::{decays, slot, DataParallel, Segment, ZeroStage};
use harness_kernels::torch_ext;
use harness_runtime::comm::Collective;

impl DataParallel {
    /// This rank's shard: the pieces of rank r's chunk of each bucket that
    /// lie in parameters (not in padding), merged within a decay group.
    pub(super) fn shard_segments(&self, params: &[Tensor]) -> Vec<Segment> {
        let mut out: Vec<Segment> = Vec::new();
        for (bi, b) in self.buckets.iter().enumerate() {
            let chunk = b.padded / self.world as i64;
            let (lo, hi) = (self.rank as i64 * chunk, (self.rank as i64 + 1) * chunk);
            for (&i, &off) in b.params.iter().zip(&b.offsets) {
                let (s, e) = (off.max(lo), (off + params[i].numel() as i64).min(hi));
                if s >= e {
                    continue;
                }
                let decay = decays(&params[i]);
                match out.last_mut() {
                    Some(last) if last.bucket == bi && last.decay == decay && last.start + last.len == s => last.len += e - s,
                    _ => out.push(Segment { bucket: bi, start: s, len: e - s, decay }),
                }
            }
        }
        out
    }

    /// ZeRO-1 with the overlap: the gradient buffers in the collective's
    /// symmetric memory (NCCL: `ncclMemAlloc`, one window a bucket), each
    /// reduce-scattered in place into this rank's chunk of it, which NCCL
    /// runs between windows as its symmetric kernel (`HARNESS_SYM_SCATTER`:
    /// the sum, divided behind it). Every rank calls it alike, before the
    /// arrival hooks of [`DataParallel::use_stale_buffers`]. Returns whether
    /// it applies (not ZeRO-2, whose buffers are released every step).
    pub(super) fn use_symmetric_zero_grads(&mut self, comm: &mut dyn Collective) -> anyhow::Result<bool> {
        if self.stage != ZeroStage::One || self.local || self.zero_sym || self.overlap.is_none() {
            return Ok(false);
        }
        self.zero_sym = self.attach_symmetric_grads(comm)?;
        Ok(self.zero_sym)
    }

    /// Under ZeRO, a digest of where each parameter lies in the buckets
    /// and so in the ranks' shards (the parameters, their offsets, the
    /// padded sizes, the ranks): equal exactly when the optimizer state of
    /// one run's shard pieces belongs to the same parameters in another's.
    /// Empty without ZeRO.
    pub fn shard_layout(&self) -> String {
        use sha2::{Digest, Sha256};
        if !self.stage.sharded() {
            return String::new();
        }
        let mut h = Sha256::new();
        h.update(format!("world {}\n", self.world));
        for b in &self.buckets {
            h.update(format!("bucket {} {:?} {:?}\n", b.padded, b.params, b.offsets));
        }
        let digest = h.finalize();
        digest.iter().take(8).map(|x| format!("{x:02x}")).collect()
    }

    /// ZeRO: gathers every rank's updated chunk of each bucket into the
    /// parameters, and drops the reduced gradient chunks.
    /// With the prefetch on, the gathers only start here, beside whatever
    /// the device runs next (see [`DataParallel::prefetch_params`]).
    pub fn gather_params(&mut self, comm: &mut dyn Collective) -> anyhow::Result<()> {
        if !self.stage.sharded() {
            return Ok(());
        }
        if self.prefetch {
            self.buckets.iter_mut().for_each(|b| b.reduced = None);
            return self.start_gathers(comm);
        }
        for b in &mut self.buckets {
            let flat = b.param_flat.as_ref().expect("ZeRO keeps flat parameter buffers");
            comm.all_gather_in_place(flat)?;
            b.reduced = None;
        }
        Ok(())
    }

    /// ZeRO: moves the flat parameter buffers into the collective's
    /// symmetric memory (NCCL's, where its all-gathers run on the copy
    /// engines under the zero CTA policy), before anything else takes views
    /// of them ([`DataParallel::update_targets`]). Every rank calls it.
    /// Returns whether it applies (false, and nothing changed, where the
    /// collective has no symmetric memory).
    pub(super) fn use_symmetric_params(&mut self, comm: &mut dyn Collective) -> anyhow::Result<bool> {
        if !self.stage.sharded() {
            return Ok(false);
        }
        let Some(flats) = self.symmetric_flats(comm, "parameter")? else { return Ok(false) };
        tch::no_grad(|| -> anyhow::Result<()> {
            for (b, flat) in self.buckets.iter_mut().zip(flats) {
                let old = b.param_flat.as_ref().expect("ZeRO keeps flat parameter buffers");
                flat.shallow_clone().copy_(old);
                for (&i, &off) in b.params.iter().zip(&b.offsets) {
                    let p = &self.params[i];
                    p.shallow_clone().f_set_data(&slot(&flat, off, p))?;
                }
                self.symmetric_param_bytes += torch_ext::nbytes(&flat);
                b.param_flat = Some(flat);
            }
            Ok(())
        })?;
        Ok(true)
    }

    /// ZeRO: `on` leaves the parameters' all-gathers after each update
    /// running beside what follows: [`DataParallel::gather_params`] starts
    /// every bucket's on the collective's side stream, in the order the
    /// forward pass reads them, and the next forward pass's layers wait for
    /// their own buckets only ([`crate::gate`]). Anything else that reads
    /// the parameters between steps calls [`DataParallel::params_current`]
    /// first. (Issued right after the update's kernels, the launches cost
    /// the host their time while the device still runs the step; issued at
    /// the next step's start they left the device idle for 1 ms of GPT-2
    /// 124M's 31 ms step in traced steps on 4 H200s; untraced, the two
    /// places measured alike.)
    pub(super) fn prefetch_params(&mut self, on: bool) {
        self.prefetch = on && self.stage.sharded();
    }

    /// With the prefetch, the update's targets ([`DataParallel::update_targets`])
    /// that lie in the last bucket, the one the forward pass reads first
    /// (GPT's token embedding): updated first, so that its gather
    /// ([`DataParallel::start_lead_gather`]) runs beside the rest of the
    /// update. None without the prefetch or with one bucket.
    pub fn lead_targets(&self) -> Option<Vec<bool>> {
        let last = self.buckets.len().checked_sub(1).filter(|&l| self.prefetch && l > 0)?;
        Some(self.segments.iter().map(|s| s.bucket == last).collect())
    }

    /// Starts the gather of the last bucket (see
    /// [`DataParallel::lead_targets`]) once its targets are updated; the
    /// other buckets' start in [`DataParallel::gather_params`].
    pub fn start_lead_gather(&mut self, comm: &mut dyn Collective) -> anyhow::Result<()> {
        let Some(b) = self.buckets.last().filter(|_| self.prefetch) else { return Ok(()) };
        let flat = b.param_flat.as_ref().expect("ZeRO keeps flat parameter buffers");
        self.lead = Some(comm.all_gather_in_place_async(flat)?);
        Ok(())
    }

    /// Starts every bucket's gather (see [`DataParallel::prefetch_params`])
    /// but the one [`DataParallel::start_lead_gather`] started, those the
    /// forward pass reads first first (the buckets follow the backward
    /// pass's order), and hands them to [`crate::gate`].
    pub(super) fn start_gathers(&mut self, comm: &mut dyn Collective) -> anyhow::Result<()> {
        let mut gathers: Vec<Option<harness_runtime::comm::Gathered>> = self.buckets.iter().map(|_| None).collect();
        let lead = self.lead.take();
        let started = if lead.is_some() { self.buckets.len() - 1 } else { self.buckets.len() };
        if let (Some(g), Some(slot)) = (lead, gathers.last_mut()) {
            *slot = g;
        }
        for (bi, b) in self.buckets.iter().enumerate().take(started).rev() {
            gathers[bi] = comm.all_gather_in_place_async(b.param_flat.as_ref().expect("ZeRO keeps flat parameter buffers"))?;
        }
        let members = self.buckets.iter().map(|b| b.params.iter().map(|&i| self.params[i].shallow_clone()).collect()).collect();
        crate::gate::arm(gathers, members)
    }

    /// Every parameter as updated, for whatever reads them between steps
    /// (evaluation, checkpoints, the replica check): the work queued from
    /// now on waits for the gathers in flight.
    pub fn params_current(&self) -> anyhow::Result<()> {
        crate::gate::settle()
    }
}
