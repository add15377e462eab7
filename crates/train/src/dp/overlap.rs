//! The overlap of the gradients' reduction with the backward pass: the
//! hooks that start each bucket's collective as its last gradient arrives,
//! the flat buffers in symmetric memory (the split average) and the
//! buffers left unzeroed between steps.

use tch::{Kind, Tensor};

use super::{padded_to, Bucket, DataParallel};
use harness_kernels::torch_ext;
use harness_runtime::comm::{Collective, CommPtr};

/// Overlap of the gradient all-reduce with the backward pass (plain DDP,
/// the built-in all-reduce, a collective that runs beside the computation:
/// NCCL). A post-accumulate-grad hook on every parameter counts down its
/// bucket during the last backward pass of a step; when a bucket's last
/// gradient has been accumulated, the hook (on autograd's thread, while the
/// step's thread waits in `backward`) starts the bucket's reduction on the
/// collective's side stream.
///
/// With autograd's own gradients (the default, see
/// [`DataParallel::use_local_grads`]) a bucket is the group of its
/// parameters' gradients, averaged in place as one collective: no buffer
/// to zero, accumulate into or divide, passes that cost 5% of a 1.3B step.
/// With the flat buffers (`HARNESS_LOCAL_GRADS=0`) a bucket's buffer is
/// summed, and divided by the world size after the backward pass, behind
/// a wait for the side stream. Under ZeRO a bucket's buffer is
/// reduce-scattered (averaged) into this rank's chunk.
pub(super) struct Overlap {
    /// ZeRO: reduce-scatters instead of all-reduces.
    pub(super) sharded: bool,
    pub(super) bucket_of: Vec<usize>,
    pub(super) sizes: Vec<usize>,
    /// Each bucket's parameters (their gradients are the group).
    pub(super) members: Vec<Vec<Tensor>>,
    /// Every parameter, by index.
    pub(super) params: Vec<Tensor>,
    /// Whether a backward pass has handed autograd a gradient for the
    /// parameter (rather than a layer writing its buffer itself): set by
    /// the arrival hooks of [`DataParallel::use_stale_buffers`].
    pub(super) by_autograd: Vec<std::sync::atomic::AtomicBool>,
    pub(super) state: std::sync::Mutex<OverlapState>,
}

pub(super) struct OverlapState {
    /// Set for the last backward pass of a step only.
    pub(super) comm: Option<CommPtr>,
    pub(super) remaining: Vec<usize>,
    /// The flat buffers, or none with autograd's own gradients.
    pub(super) flats: Vec<Tensor>,
    /// ZeRO: each bucket's chunk of this rank, which its reduce-scatter fills.
    pub(super) chunks: Vec<Tensor>,
    /// `reduce_dtype`: the type autograd's gradients are averaged in, when
    /// not their own; and each gradient with its averaged copy in that
    /// type, copied back after the wait.
    pub(super) reduce_kind: Option<Kind>,
    pub(super) casts: Vec<(Tensor, Tensor)>,
    pub(super) launched: Vec<bool>,
    /// The flat buffers are in symmetric memory and averaged as a
    /// reduce-scatter and an all-gather ([`DataParallel::use_symmetric_buffers`]).
    pub(super) split: bool,
    /// Buffers may be stale at a step's start ([`DataParallel::use_stale_buffers`]):
    /// a gradient that nothing wrote is zeroed before its bucket goes.
    pub(super) stale: bool,
    pub(super) error: Option<String>,
}

/// [`DataParallel::use_stale_buffers`]'s state.
pub(super) struct StaleBuffers {
    /// The arrival hooks' handles, by parameter.
    pub(super) hooks: Vec<i64>,
    /// Steps begun since it was turned on.
    pub(super) steps: u64,
    /// Which buckets the current step left unzeroed.
    pub(super) stale: Vec<bool>,
}

impl StaleBuffers {
    /// Whether the current step left bucket `bi` unzeroed.
    pub(super) fn left(&self, bi: usize) -> bool {
        self.stale.get(bi).copied().unwrap_or(false)
    }
}

/// The arrival hook of [`DataParallel::use_stale_buffers`]: autograd is
/// about to add a gradient into parameter `idx`'s buffer, so the buffer
/// must hold zeros or this step's earlier gradients; and the parameter's
/// bucket is zeroed at the next steps' starts.
pub(super) unsafe extern "C" fn grad_arrives(ctx: *mut std::ffi::c_void, idx: i64) {
    // SAFETY: ctx is the boxed Overlap of a live DataParallel (the arrival
    // hooks are removed in its Drop, before the box goes).
    let o = unsafe { &*(ctx as *const Overlap) };
    o.by_autograd[idx as usize].store(true, std::sync::atomic::Ordering::Relaxed);
    crate::stale::settle(&o.params[idx as usize].grad());
}

/// Starts averaging `grads` in place as one collective, or with `kind`
/// copies of them in that type, which `casts` keeps with their gradients
/// to be copied back after the wait.
pub(super) fn start_average(
    comm: &mut dyn Collective,
    grads: Vec<Tensor>,
    kind: Option<Kind>,
    casts: &mut Vec<(Tensor, Tensor)>,
) -> anyhow::Result<()> {
    let Some(kind) = kind else {
        return Ok(comm.all_reduce_avg_async(&grads)?);
    };
    let low: Vec<Tensor> = tch::no_grad(|| grads.iter().map(|g| g.to_kind(kind)).collect());
    comm.all_reduce_avg_async(&low)?;
    casts.extend(grads.into_iter().zip(low));
    Ok(())
}

/// The gradients of `params` as one rank holds them after its backward
/// pass, ready to be reduced in place: a parameter no pass reached gets
/// zeros, and a gradient that is not dense a dense copy (NCCL moves dense
/// memory), each made its parameter's `.grad`.
pub(super) fn reducible_grads(params: &[Tensor]) -> anyhow::Result<Vec<Tensor>> {
    let grads = torch_ext::grads(params)?;
    params
        .iter()
        .zip(grads)
        .map(|(p, g)| {
            let g = if !g.defined() {
                tch::no_grad(|| p.zeros_like())
            } else if !torch_ext::is_dense(&g) {
                tch::no_grad(|| g.contiguous())
            } else {
                return Ok(g);
            };
            torch_ext::set_grad(p, Some(&g))?;
            Ok(g)
        })
        .collect()
}

pub(super) unsafe extern "C" fn grad_ready(ctx: *mut std::ffi::c_void, idx: i64) {
    // SAFETY: ctx is the boxed Overlap of a live DataParallel (hooks are
    // removed in its Drop before the box goes).
    let o = unsafe { &*(ctx as *const Overlap) };
    let mut st = o.state.lock().unwrap_or_else(|e| e.into_inner());
    let Some(comm) = st.comm else { return };
    if st.stale {
        // No layer wrote this gradient in the step: zeros, before the bucket goes.
        crate::stale::settle(&o.params[idx as usize].grad());
    }
    let b = o.bucket_of[idx as usize];
    st.remaining[b] = st.remaining[b].saturating_sub(1);
    if st.remaining[b] == 0 && !st.launched[b] && st.error.is_none() {
        st.launched[b] = true;
        // SAFETY: see CommPtr.
        // The autograd thread uses it only while the owning thread is
        // blocked in `backward` and does not touch the collective.
        let comm = unsafe { comm.get() };
        let started = match (st.flats.get(b), st.chunks.get(b)) {
            (Some(flat), Some(chunk)) => comm.reduce_scatter_avg_async(flat, chunk).map_err(anyhow::Error::from),
            (Some(flat), None) if st.split => comm.all_reduce_split_avg_async(flat).map_err(anyhow::Error::from),
            (Some(flat), None) => comm.all_reduce_sum_async(flat).map_err(anyhow::Error::from),
            (None, _) => {
                let kind = st.reduce_kind;
                reducible_grads(&o.members[b]).and_then(|g| start_average(comm, g, kind, &mut st.casts))
            }
        };
        if let Err(e) = started {
            st.error = Some(e.to_string());
        }
    }
}

impl DataParallel {
    /// `HARNESS_CE_GATHER`: with the overlap on, the flat buffers (neither
    /// autograd's own gradients nor ZeRO) move into the collective's
    /// symmetric memory, padded to a multiple of the ranks, and each bucket
    /// is averaged as a reduce-scatter and an all-gather (NCCL can run the
    /// gather on the copy engines, see
    /// [`Collective::all_reduce_split_avg_async`]). Every rank calls it.
    /// Returns whether it applies (false, and nothing changed, where the
    /// collective has no symmetric memory).
    pub(super) fn use_symmetric_buffers(&mut self, comm: &mut dyn Collective) -> anyhow::Result<bool> {
        if !self.overlap.as_ref().is_some_and(|o| !o.sharded && !self.local) || !self.attach_symmetric_grads(comm)? {
            return Ok(false);
        }
        if let Some(o) = &self.overlap {
            o.state.lock().unwrap_or_else(|e| e.into_inner()).split = true;
        }
        Ok(true)
    }

    /// Every bucket's gradient buffer moved into the collective's symmetric
    /// memory, padded to a multiple of the ranks (ZeRO's buckets are padded
    /// so already), the parameters' gradients views of it. Returns false,
    /// and nothing changed, where the collective has no symmetric memory.
    pub(super) fn attach_symmetric_grads(&mut self, comm: &mut dyn Collective) -> anyhow::Result<bool> {
        let Some(flats) = self.symmetric_flats(comm, "gradient")? else { return Ok(false) };
        for (b, flat) in self.buckets.iter_mut().zip(flats) {
            anyhow::ensure!(
                !self.stage.sharded() || flat.numel() as i64 == b.padded,
                "a symmetric buffer of {} elements for a bucket of {}",
                flat.numel(),
                b.padded
            );
            b.padded = flat.numel() as i64;
            b.attach(&self.params, flat)?;
        }
        Ok(true)
    }

    /// A zeroed buffer in the collective's symmetric memory for every
    /// bucket, padded to a multiple of the ranks (ZeRO's padding already):
    /// all of them, or None where the collective has none. `what` names
    /// the buckets in the error of a collective that gave some only.
    pub(super) fn symmetric_flats(&self, comm: &mut dyn Collective, what: &str) -> anyhow::Result<Option<Vec<Tensor>>> {
        let mut flats = Vec::with_capacity(self.buckets.len());
        for b in &self.buckets {
            match comm.symmetric_zeros(padded_to(b.numel, self.world), b.kind)? {
                Some(flat) => flats.push(flat),
                None if flats.is_empty() => return Ok(None),
                None => anyhow::bail!("the collective gave symmetric memory for {} {what} buckets, not all", flats.len()),
            }
        }
        Ok(Some(flats))
    }

    /// `HARNESS_UNZEROED_GRADS`: with the overlap on and flat buffers (not
    /// autograd's own gradients), a step's start leaves a bucket's buffer as
    /// it is, unzeroed (ZeRO-2: allocated without zeroing), where in the
    /// steps so far no gradient of its parameters reached autograd: the fused layers write them all
    /// themselves, and each one's first write of a step writes over the
    /// buffer ([`crate::stale`]; a weight's gradient matmul with beta = 0)
    /// instead of adding into zeros. That saves the zeroing pass and the
    /// matmuls' reads of the zeros, for the same values bit for bit. The
    /// first step zeroes every bucket and learns, through a hook on every
    /// parameter that sees the gradients autograd is handed, which buckets
    /// qualify; should autograd be handed one later, that hook zeroes the
    /// stale buffer first, and its bucket is zeroed from the next step on.
    /// A gradient that nothing wrote in a step is zeroed before its bucket
    /// is reduced. Returns whether it applies.
    pub(super) fn use_stale_buffers(&mut self) -> anyhow::Result<bool> {
        let Some(o) = self.overlap.as_ref().filter(|_| !self.local && self.stale_bufs.is_none()) else { return Ok(false) };
        let ctx = &**o as *const Overlap as *mut std::ffi::c_void;
        let mut hooks = Vec::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            // SAFETY: ctx points into the box kept in self.overlap; Drop
            // removes these hooks before it goes.
            match unsafe { torch_ext::set_grad_arrival_hook(p, grad_arrives, ctx, i as i64) } {
                Ok(h) => hooks.push(h),
                Err(e) => {
                    for (p, &h) in self.params.iter().zip(&hooks) {
                        let _ = torch_ext::remove_hook(p, h);
                    }
                    return Err(e.into());
                }
            }
        }
        o.state.lock().unwrap_or_else(|e| e.into_inner()).stale = true;
        self.stale_bufs = Some(StaleBuffers { hooks, steps: 0, stale: vec![false; self.buckets.len()] });
        Ok(true)
    }

    /// How many buckets the current step left unzeroed
    /// ([`DataParallel::use_stale_buffers`]).
    pub fn stale_buckets(&self) -> usize {
        self.stale_bufs.as_ref().map_or(0, |f| f.stale.iter().filter(|&&s| s).count())
    }

    /// Zeroes the gradients of bucket `b` that nothing wrote this step.
    pub(super) fn settle_bucket(&self, b: &Bucket) {
        if let (Some(_), Some((_, views))) = (&self.stale_bufs, &b.grad) {
            views.iter().for_each(crate::stale::settle);
        }
    }

    /// Whether the flat buffers are the collective's symmetric memory
    /// ([`DataParallel::use_symmetric_buffers`]).
    pub(super) fn split_buffers(&self) -> bool {
        self.overlap.as_ref().is_some_and(|o| o.state.lock().unwrap_or_else(|e| e.into_inner()).split)
    }

    /// Averages the gradients in `kind` (the strategy's `reduce_dtype`),
    /// which only the overlapped average of autograd's own gradients does:
    /// an error where it is off with more than one rank (one rank reduces
    /// nothing).
    pub(super) fn reduce_in(&mut self, kind: Kind) -> anyhow::Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        let Some(o) = self.overlap.as_ref().filter(|o| self.local && !o.sharded) else {
            anyhow::bail!(
                "`reduce_dtype = \"bf16\"` needs the all-reduce that overlaps the backward pass with autograd's own gradients, \
                 which is off here (HARNESS_OVERLAP=0, HARNESS_LOCAL_GRADS=0, a batch policy that reads gradient statistics, or \
                 an emulated out-of-memory limit)"
            );
        };
        o.state.lock().unwrap_or_else(|e| e.into_inner()).reduce_kind = Some(kind);
        Ok(())
    }

    /// Turns on the overlap of the gradients' reduction (all-reduces, or
    /// under ZeRO reduce-scatters) with the backward pass; returns whether
    /// it is on (more than one rank, a collective that supports it).
    pub(super) fn enable_overlap(&mut self, comm: &dyn Collective) -> anyhow::Result<bool> {
        if self.world < 2 || !comm.supports_async() || self.overlap.is_some() {
            return Ok(self.overlap.is_some());
        }
        let mut bucket_of = vec![usize::MAX; self.params.len()];
        for (bi, b) in self.buckets.iter().enumerate() {
            for &i in &b.params {
                bucket_of[i] = bi;
            }
        }
        let sizes = self.buckets.iter().map(|b| b.params.len()).collect();
        let members = self.buckets.iter().map(|b| b.params.iter().map(|&i| self.params[i].shallow_clone()).collect()).collect();
        let n = self.buckets.len();
        let state = OverlapState {
            comm: None,
            remaining: vec![0; n],
            flats: Vec::new(),
            chunks: Vec::new(),
            reduce_kind: None,
            casts: Vec::new(),
            launched: vec![false; n],
            split: false,
            stale: false,
            error: None,
        };
        let sharded = self.stage.sharded();
        let params = self.params.iter().map(Tensor::shallow_clone).collect();
        let by_autograd = self.params.iter().map(|_| std::sync::atomic::AtomicBool::new(false)).collect();
        let state = std::sync::Mutex::new(state);
        let o = Box::new(Overlap { sharded, bucket_of, sizes, members, params, by_autograd, state });
        let ctx = &*o as *const Overlap as *mut std::ffi::c_void;
        for (i, p) in self.params.iter().enumerate() {
            // SAFETY: ctx points into the box kept in self.overlap; the hooks
            // are removed in Drop before it goes.
            unsafe { torch_ext::set_grad_ready_hook(p, Some(grad_ready), ctx, i as i64)? };
        }
        self.overlap = Some(o);
        Ok(true)
    }

    /// Before the backward pass of a micro-batch: with overlap, the last
    /// micro-batch's pass starts the all-reduces as buckets fill.
    pub fn arm_overlap(&mut self, comm: &mut dyn Collective, last: bool) {
        let Some(o) = &self.overlap else { return };
        let mut st = o.state.lock().unwrap_or_else(|e| e.into_inner());
        if !last {
            st.comm = None;
            return;
        }
        // SAFETY: only the lifetime is erased; `disarm` clears it right after
        // the backward pass, while `comm` is still borrowed by the step.
        st.comm = Some(unsafe { CommPtr::new(comm) });
        st.remaining = o.sizes.clone();
        st.launched.iter_mut().for_each(|l| *l = false);
        // Nothing of a dropped step (one that ran out of memory) carries over.
        st.casts.clear();
        st.flats = if self.local {
            Vec::new()
        } else {
            self.buckets.iter().map(|b| b.grad.as_ref().map_or_else(Tensor::new, |g| g.0.shallow_clone())).collect()
        };
        let world = self.world as i64;
        st.chunks = if o.sharded {
            let chunk = |b: &Bucket| match (&b.grad, self.zero_sym) {
                // In place: this rank's chunk of the symmetric buffer.
                (Some((flat, _)), true) => flat.narrow(0, self.rank as i64 * (b.padded / world), b.padded / world),
                _ => Tensor::empty([b.padded / world], (b.kind, self.device)),
            };
            self.buckets.iter().map(chunk).collect()
        } else {
            Vec::new()
        };
        st.error = None;
    }

    /// After each backward pass: no more hooks into the collective.
    pub fn disarm_overlap(&mut self) {
        if let Some(o) = &self.overlap {
            o.state.lock().unwrap_or_else(|e| e.into_inner()).comm = None;
        }
    }
}
