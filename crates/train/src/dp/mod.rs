//! Data parallelism on one rank: gradient buckets as flat buffers, reduced by
//! the compressor (plain DDP, `zero = 0`) or sharded (ZeRO stages 1 and 2).
//!
//! Every parameter's `.grad` is a view of its bucket's flat buffer, allocated
//! once (PyTorch DDP's `gradient_as_bucket_view`): backward passes accumulate
//! into the buffers in place, which are zeroed at the start of each step, and
//! the compressor reduces each buffer as it is, without a copy.
//!
//! ZeRO ([`ZeroStage`]): each bucket's flat space (padded to a multiple of
//! the ranks) is split into `world` contiguous chunks; rank r owns the r-th
//! chunk of every bucket: its shard. The parameters become views of flat
//! parameter buffers laid out as the gradient buffers. A step reduce-scatters
//! each gradient buffer (rank r receives the averaged r-th chunk), updates
//! the shard's parameters with optimizer state kept for the shard only, and
//! all-gathers the updated chunks into every rank's parameters. With one
//! bucket the shards are the contiguous `world`-way partition of all
//! parameters; with several, a rank's shard is one contiguous piece per
//! bucket, so that the reduce-scatter of a bucket delivers exactly it.

pub mod plan;

use tch::{Device, Kind, Tensor};

use harness_kernels::torch_ext;
use harness_runtime::comm::{Collective, CommPtr};
use harness_sandbox::strategy::Compressor;

impl Drop for DataParallel {
    fn drop(&mut self) {
        if let Some(f) = self.stale_bufs.take() {
            for (p, &h) in self.params.iter().zip(&f.hooks) {
                let _ = torch_ext::remove_hook(p, h);
            }
            crate::stale::forget(self.buckets.iter().filter_map(|b| b.grad.as_ref()).flat_map(|g| g.1.iter()));
        }
        if self.overlap.is_some() {
            for p in &self.params {
                // SAFETY: removing the hook; nothing else refers to the context.
                let _ = unsafe { torch_ext::set_grad_ready_hook(p, None, std::ptr::null_mut(), 0) };
            }
        }
    }
}

/// How the optimizer state and gradients are partitioned over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroStage {
    /// Plain DDP: every rank holds everything; gradients are all-reduced by the compressor.
    None,
    /// ZeRO-1: optimizer state is sharded. The full gradient buffers stay
    /// allocated for the whole run, as in DDP.
    One,
    /// ZeRO-2: optimizer state and reduced gradients are sharded: the full
    /// gradient buffers are released right after their reduce-scatter and
    /// allocated again before the next step's first backward pass.
    ///
    /// With the overlap on, each bucket is reduce-scattered from the
    /// gradient hooks as soon as its gradients are complete, beside the rest
    /// of the backward pass; the buffers are released after the pass, behind
    /// the wait for those collectives. So the full local gradient still
    /// exists from the first backward pass of a step to the end of the last,
    /// and the peak of the backward pass is the same as with stage 1. What
    /// stage 2 saves over stage 1 is the full gradient buffers during the
    /// optimizer step, the parameter all-gather, evaluation and the next
    /// step's forward pass.
    Two,
}

impl ZeroStage {
    /// The stage of a suite's `zero` key (0, 1 or 2).
    pub fn from_level(level: u8) -> anyhow::Result<ZeroStage> {
        Ok(match level {
            0 => ZeroStage::None,
            1 => ZeroStage::One,
            2 => ZeroStage::Two,
            other => anyhow::bail!("ZeRO stage {other} does not exist (0, 1 or 2)"),
        })
    }

    fn sharded(self) -> bool {
        self != ZeroStage::None
    }
}

/// Consecutive parameters whose gradients (and, under ZeRO, values) are
/// views of one flat buffer.
struct Bucket {
    /// Indices of its parameters.
    params: Vec<usize>,
    /// Element offset of each parameter in the flat buffers.
    offsets: Vec<i64>,
    /// Elements of the parameters.
    numel: i64,
    /// Elements of the flat buffers: `numel`, rounded up to a multiple of
    /// the ranks under ZeRO (the padding is zero and belongs to no parameter).
    padded: i64,
    kind: Kind,
    /// The flat gradient buffer and each parameter's view of it; None while
    /// released (ZeRO-2).
    grad: Option<(Tensor, Vec<Tensor>)>,
    /// ZeRO: the flat buffer the parameters are views of.
    param_flat: Option<Tensor>,
    /// ZeRO: this rank's averaged chunk of the gradient, from the
    /// reduce-scatter until the parameters are gathered.
    reduced: Option<Tensor>,
}

impl Bucket {
    /// Makes `flat` the bucket's gradient buffer and every parameter's
    /// `.grad` its view of it.
    fn attach(&mut self, params: &[Tensor], flat: Tensor) -> anyhow::Result<()> {
        let mut views = Vec::with_capacity(self.params.len());
        for (&i, &off) in self.params.iter().zip(&self.offsets) {
            let p = &params[i];
            let view = slot(&flat, off, p);
            torch_ext::set_grad(p, Some(&view))?;
            views.push(view);
        }
        self.grad = Some((flat, views));
        Ok(())
    }
}

/// `numel` rounded up to a multiple of `world` (ranks' equal chunks).
fn padded_to(numel: i64, world: usize) -> i64 {
    ((numel as usize).div_ceil(world) * world) as i64
}

/// A contiguous piece of this rank's shard (ZeRO): elements
/// `start .. start + len` of a bucket's flat buffers, inside parameters of
/// one weight-decay group (consecutive parameters of a group are merged).
#[derive(Debug, Clone, PartialEq)]
struct Segment {
    bucket: usize,
    start: i64,
    len: i64,
    decay: bool,
}

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
struct Overlap {
    /// ZeRO: reduce-scatters instead of all-reduces.
    sharded: bool,
    bucket_of: Vec<usize>,
    sizes: Vec<usize>,
    /// Each bucket's parameters (their gradients are the group).
    members: Vec<Vec<Tensor>>,
    /// Every parameter, by index.
    params: Vec<Tensor>,
    /// Whether a backward pass has handed autograd a gradient for the
    /// parameter (rather than a layer writing its buffer itself): set by
    /// the arrival hooks of [`DataParallel::use_stale_buffers`].
    by_autograd: Vec<std::sync::atomic::AtomicBool>,
    state: std::sync::Mutex<OverlapState>,
}

struct OverlapState {
    /// Set for the last backward pass of a step only.
    comm: Option<CommPtr>,
    remaining: Vec<usize>,
    /// The flat buffers, or none with autograd's own gradients.
    flats: Vec<Tensor>,
    /// ZeRO: each bucket's chunk of this rank, which its reduce-scatter fills.
    chunks: Vec<Tensor>,
    /// `reduce_dtype`: the type autograd's gradients are averaged in, when
    /// not their own; and each gradient with its averaged copy in that
    /// type, copied back after the wait.
    reduce_kind: Option<Kind>,
    casts: Vec<(Tensor, Tensor)>,
    launched: Vec<bool>,
    /// The flat buffers are in symmetric memory and averaged as a
    /// reduce-scatter and an all-gather ([`DataParallel::use_symmetric_buffers`]).
    split: bool,
    /// Buffers may be stale at a step's start ([`DataParallel::use_stale_buffers`]):
    /// a gradient that nothing wrote is zeroed before its bucket goes.
    stale: bool,
    error: Option<String>,
}

/// [`DataParallel::use_stale_buffers`]'s state.
struct StaleBuffers {
    /// The arrival hooks' handles, by parameter.
    hooks: Vec<i64>,
    /// Steps begun since it was turned on.
    steps: u64,
    /// Which buckets the current step left unzeroed.
    stale: Vec<bool>,
}

impl StaleBuffers {
    /// Whether the current step left bucket `bi` unzeroed.
    fn left(&self, bi: usize) -> bool {
        self.stale.get(bi).copied().unwrap_or(false)
    }
}

/// The arrival hook of [`DataParallel::use_stale_buffers`]: autograd is
/// about to add a gradient into parameter `idx`'s buffer, so the buffer
/// must hold zeros or this step's earlier gradients; and the parameter's
/// bucket is zeroed at the next steps' starts.
unsafe extern "C" fn grad_arrives(ctx: *mut std::ffi::c_void, idx: i64) {
    // SAFETY: ctx is the boxed Overlap of a live DataParallel (the arrival
    // hooks are removed in its Drop, before the box goes).
    let o = unsafe { &*(ctx as *const Overlap) };
    o.by_autograd[idx as usize].store(true, std::sync::atomic::Ordering::Relaxed);
    crate::stale::settle(&o.params[idx as usize].grad());
}

/// Starts averaging `grads` in place as one collective, or with `kind`
/// copies of them in that type, which `casts` keeps with their gradients
/// to be copied back after the wait.
fn start_average(
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
fn reducible_grads(params: &[Tensor]) -> anyhow::Result<Vec<Tensor>> {
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

unsafe extern "C" fn grad_ready(ctx: *mut std::ffi::c_void, idx: i64) {
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

/// The number of gradient buckets [`DataParallel::auto_bucket_bytes`] aims at.
pub const AUTO_BUCKETS: u64 = 24;

/// [`DataParallel::auto_bucket_bytes`] for `total` bytes of gradients.
fn auto_bucket_bytes_for(total: u64) -> u64 {
    (total / AUTO_BUCKETS).max(25 << 20)
}

/// How [`DataParallel::new`] lays out its gradient buckets: which
/// parameters go together and in which order the buckets are reduced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    /// Every parameter's index once, in the order the backward pass is
    /// expected to finish their gradients ([`ready_order`]): buckets are
    /// consecutive runs of it, so that a bucket is complete, and its
    /// reduction starts, soon after its first gradient.
    pub order: Vec<usize>,
    /// A bucket's most bytes of gradients.
    pub max_bytes: u64,
    /// How many buckets at the end of `order` are smaller ([`buckets_of`]).
    pub tail: u32,
}

impl BucketPlan {
    /// The parameters in their own order, buckets of at most `max_bytes`,
    /// none smaller at the end.
    pub fn in_order(params: &[Tensor], max_bytes: u64) -> BucketPlan {
        BucketPlan { order: (0..params.len()).collect(), max_bytes, tail: 0 }
    }
}

/// One rank's data-parallel state (more than one rank).
pub struct DataParallel {
    overlap: Option<Box<Overlap>>,
    params: Vec<Tensor>,
    stage: ZeroStage,
    rank: usize,
    world: usize,
    device: Device,
    buckets: Vec<Bucket>,
    /// ZeRO: this rank's shard.
    segments: Vec<Segment>,
    /// Autograd's own gradients, no buffers ([`DataParallel::use_local_grads`]).
    local: bool,
    /// Bytes of the all-to-all's receive buffer ([`DataParallel::use_copy_engine_reduce`]).
    /// [`DataParallel::use_stale_buffers`].
    stale_bufs: Option<StaleBuffers>,
    /// ZeRO: the parameters are gathered beside the next forward pass
    /// ([`DataParallel::prefetch_params`]).
    prefetch: bool,
    /// Bytes of the parameter buffers in the collective's symmetric memory
    /// ([`DataParallel::use_symmetric_params`]).
    symmetric_param_bytes: u64,
    /// ZeRO's prefetch: the gather of the bucket the forward pass reads
    /// first, started before the rest of the update
    /// ([`DataParallel::start_lead_gather`]).
    lead: Option<Option<harness_runtime::comm::Gathered>>,
    /// ZeRO-1's gradient buffers are the collective's symmetric memory,
    /// each reduce-scattered in place ([`DataParallel::use_symmetric_zero_grads`]).
    zero_sym: bool,
}

/// Whether a parameter gets weight decay: matrices and embeddings, not biases
/// and norms (nanoGPT's groups, as the optimizer makes them).
pub fn decays(p: &Tensor) -> bool {
    p.dim() >= 2
}

impl DataParallel {
    /// The gradient bucket size for `params` when the suite sets none:
    /// about [`AUTO_BUCKETS`] buckets, and at least PyTorch DDP's 25 MiB.
    /// Each bucket is one NCCL launch beside the backward pass, with a cost
    /// of its own: on 4 H200s GPT 1.3B (5.2 GB of fp32 gradients) scaled
    /// 0.881 at 25 MiB and 0.899 at 200 or 400 MiB, while GPT-2 124M (0.5
    /// GB) did best at 25 MiB (0.903 against 0.889 at 200): see
    /// docs/benchmarks.md, "Data-parallel levers, second round".
    pub fn auto_bucket_bytes(params: &[Tensor]) -> u64 {
        auto_bucket_bytes_for(params.iter().map(torch_ext::nbytes).sum())
    }

    /// Buckets over `params` as `plan` lays them out (the same on every
    /// rank, after the initial broadcast), with flat gradient buffers;
    /// under ZeRO the parameters are moved into flat buffers too.
    /// Lays out the buckets of `buckets` and takes the gradient path of
    /// `plan`, in the order every rank follows alike (each allocation in
    /// symmetric memory is a collective call): ZeRO's symmetric parameter
    /// buffers and their prefetch, the overlap's hooks, then the gradients'
    /// home (symmetric buffers, autograd's own, or ZeRO-1's symmetric
    /// buffers), then the unzeroed buffers. A part of the plan that does
    /// not apply (a collective without what its capabilities said) is an
    /// error.
    pub fn new(params: &[Tensor], buckets: &BucketPlan, plan: &plan::DpPlan, comm: &mut dyn Collective) -> anyhow::Result<DataParallel> {
        use plan::Gradients;
        let (rank, world) = (comm.rank(), comm.world_size());
        let took = |what: &str, applied: bool| {
            anyhow::ensure!(applied, "the data-parallel plan's {what} did not apply ({plan:?})");
            Ok(())
        };
        tch::no_grad(|| {
            let mut dp = DataParallel::lay_out(params, buckets, plan.stage(), rank, world)?;
            if let Gradients::Sharded { prefetch: Some(p), .. } = plan.gradients {
                if p.symmetric {
                    took("symmetric parameter buffers", dp.use_symmetric_params(comm)?)?;
                }
                dp.prefetch_params(true);
            }
            if plan.overlapped(world) {
                took("overlap", dp.enable_overlap(comm)?)?;
            }
            match plan.gradients {
                Gradients::Split => took("symmetric gradient buffers", dp.use_symmetric_buffers(comm)?)?,
                Gradients::Local { reduce_bf16 } => {
                    took("autograd's own gradients", dp.use_local_grads(true)?)?;
                    if reduce_bf16 {
                        dp.reduce_in(Kind::BFloat16)?;
                    }
                }
                Gradients::Sharded { symmetric_grads: true, .. } => {
                    took("ZeRO-1's symmetric gradient buffers", dp.use_symmetric_zero_grads(comm)?)?
                }
                Gradients::Flat { .. } | Gradients::Sharded { .. } => {}
            }
            if plan.unzeroed {
                took("unzeroed buffers", dp.use_stale_buffers()?)?;
            }
            Ok(dp)
        })
    }

    /// The buckets of `plan` (and under ZeRO the flat parameter buffers),
    /// every gradient a view of its bucket's buffer: the flat path after
    /// the backward pass, which [`DataParallel::new`] then changes.
    fn lay_out(params: &[Tensor], plan: &BucketPlan, stage: ZeroStage, rank: usize, world: usize) -> anyhow::Result<DataParallel> {
        anyhow::ensure!(rank < world, "rank {rank} is not in a world of {world}");
        anyhow::ensure!(world >= 2 || !stage.sharded(), "ZeRO needs world >= 2");
        let mut sorted = plan.order.clone();
        sorted.sort_unstable();
        anyhow::ensure!(
            sorted.iter().copied().eq(0..params.len()),
            "the bucket order must list each of the {} parameters once",
            params.len()
        );
        let device = params.first().map_or(Device::Cpu, |p| p.device());
        let mut buckets = Vec::new();
        for idx in buckets_of(params, &plan.order, plan.max_bytes, plan.tail) {
            let kind = params[idx[0]].kind();
            if let Some(&i) = idx.iter().find(|&&i| params[i].kind() != kind) {
                anyhow::bail!("parameters {} and {i} share a gradient bucket but not a dtype ({kind:?}, {:?})", idx[0], params[i].kind());
            }
            let mut offsets = Vec::with_capacity(idx.len());
            let mut numel = 0i64;
            for &i in &idx {
                offsets.push(numel);
                numel += params[i].numel() as i64;
            }
            let padded = if stage.sharded() { padded_to(numel, world) } else { numel };
            buckets.push(Bucket { params: idx, offsets, numel, padded, kind, grad: None, param_flat: None, reduced: None });
        }
        let mut dp = DataParallel {
            overlap: None,
            params: params.iter().map(Tensor::shallow_clone).collect(),
            stage,
            rank,
            world,
            device,
            buckets,
            segments: Vec::new(),
            local: false,
            stale_bufs: None,
            prefetch: false,
            symmetric_param_bytes: 0,
            lead: None,
            zero_sym: false,
        };
        if stage.sharded() {
            tch::no_grad(|| -> anyhow::Result<()> {
                for b in &mut dp.buckets {
                    let flat = Tensor::zeros([b.padded], (b.kind, device));
                    for (&i, &off) in b.params.iter().zip(&b.offsets) {
                        let p = &params[i];
                        let view = slot(&flat, off, p);
                        view.shallow_clone().copy_(p);
                        // The parameter now lives in the flat buffer (its own
                        // storage is freed); autograd still sees the same leaf.
                        p.shallow_clone().f_set_data(&view)?;
                    }
                    b.param_flat = Some(flat);
                }
                Ok(())
            })?;
            dp.segments = dp.shard_segments(params);
        }
        dp.attach_grads(params)?;
        Ok(dp)
    }

    /// This rank's shard: the pieces of rank r's chunk of each bucket that
    /// lie in parameters (not in padding), merged within a decay group.
    fn shard_segments(&self, params: &[Tensor]) -> Vec<Segment> {
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

    /// Allocates (zeroed) the gradient buffers that are missing and makes
    /// every parameter's `.grad` its view of its bucket's buffer. A bucket
    /// this step leaves unzeroed ([`DataParallel::use_stale_buffers`]; ZeRO-2
    /// allocates its buffers anew each step) gets a buffer of which only the
    /// padding is zeroed, its views marked stale.
    fn attach_grads(&mut self, params: &[Tensor]) -> anyhow::Result<()> {
        for (bi, b) in self.buckets.iter_mut().enumerate() {
            if b.grad.is_some() {
                continue;
            }
            let stale = self.stale_bufs.as_ref().is_some_and(|f| f.left(bi));
            let flat = if stale {
                let flat = Tensor::empty([b.padded], (b.kind, self.device));
                let _ = flat.narrow(0, b.numel, b.padded - b.numel).zero_();
                flat
            } else {
                Tensor::zeros([b.padded], (b.kind, self.device))
            };
            b.attach(params, flat)?;
            if stale {
                crate::stale::mark(b.grad.as_ref().map(|g| g.1.iter()).into_iter().flatten());
            }
        }
        Ok(())
    }

    /// Without ZeRO, with the plain average, on one rank (where it has
    /// nothing to do) or on several with the overlap on: the gradients are
    /// autograd's own, as in single-GPU PyTorch with
    /// `zero_grad(set_to_none=True)`, so the buffers go. Autograd then
    /// allocates each gradient as the backward pass reaches it, while the
    /// pass frees activations, instead of all of them living through the
    /// peak of the forward pass (up to the size of the gradients less at
    /// peak), and no zeroing or accumulating pass runs; several ranks
    /// average each bucket's gradients in place (see [`Overlap`]). Returns
    /// whether it applies.
    fn use_local_grads(&mut self, plain_average: bool) -> anyhow::Result<bool> {
        if self.stage.sharded() || !plain_average || (self.world > 1) != self.overlap.is_some() {
            return Ok(false);
        }
        for b in &mut self.buckets {
            b.grad = None;
        }
        torch_ext::grads_to_none(&self.params)?;
        self.local = true;
        Ok(true)
    }

    /// `HARNESS_CE_GATHER`: with the overlap on, the flat buffers (neither
    /// autograd's own gradients nor ZeRO) move into the collective's
    /// symmetric memory, padded to a multiple of the ranks, and each bucket
    /// is averaged as a reduce-scatter and an all-gather (NCCL can run the
    /// gather on the copy engines, see
    /// [`Collective::all_reduce_split_avg_async`]). Every rank calls it.
    /// Returns whether it applies (false, and nothing changed, where the
    /// collective has no symmetric memory).
    fn use_symmetric_buffers(&mut self, comm: &mut dyn Collective) -> anyhow::Result<bool> {
        if !self.overlap.as_ref().is_some_and(|o| !o.sharded && !self.local) || !self.attach_symmetric_grads(comm)? {
            return Ok(false);
        }
        if let Some(o) = &self.overlap {
            o.state.lock().unwrap_or_else(|e| e.into_inner()).split = true;
        }
        Ok(true)
    }

    /// ZeRO-1 with the overlap: the gradient buffers in the collective's
    /// symmetric memory (NCCL: `ncclMemAlloc`, one window a bucket), each
    /// reduce-scattered in place into this rank's chunk of it, which NCCL
    /// runs between windows as its symmetric kernel (`HARNESS_SYM_SCATTER`:
    /// the sum, divided behind it). Every rank calls it alike, before the
    /// arrival hooks of [`DataParallel::use_stale_buffers`]. Returns whether
    /// it applies (not ZeRO-2, whose buffers are released every step).
    fn use_symmetric_zero_grads(&mut self, comm: &mut dyn Collective) -> anyhow::Result<bool> {
        if self.stage != ZeroStage::One || self.local || self.zero_sym || self.overlap.is_none() {
            return Ok(false);
        }
        self.zero_sym = self.attach_symmetric_grads(comm)?;
        Ok(self.zero_sym)
    }

    /// Every bucket's gradient buffer moved into the collective's symmetric
    /// memory, padded to a multiple of the ranks (ZeRO's buckets are padded
    /// so already), the parameters' gradients views of it. Returns false,
    /// and nothing changed, where the collective has no symmetric memory.
    fn attach_symmetric_grads(&mut self, comm: &mut dyn Collective) -> anyhow::Result<bool> {
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
    fn symmetric_flats(&self, comm: &mut dyn Collective, what: &str) -> anyhow::Result<Option<Vec<Tensor>>> {
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
    fn use_stale_buffers(&mut self) -> anyhow::Result<bool> {
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
    fn settle_bucket(&self, b: &Bucket) {
        if let (Some(_), Some((_, views))) = (&self.stale_bufs, &b.grad) {
            views.iter().for_each(crate::stale::settle);
        }
    }

    /// Whether the flat buffers are the collective's symmetric memory
    /// ([`DataParallel::use_symmetric_buffers`]).
    fn split_buffers(&self) -> bool {
        self.overlap.as_ref().is_some_and(|o| o.state.lock().unwrap_or_else(|e| e.into_inner()).split)
    }

    /// Averages the gradients in `kind` (the strategy's `reduce_dtype`),
    /// which only the overlapped average of autograd's own gradients does:
    /// an error where it is off with more than one rank (one rank reduces
    /// nothing).
    fn reduce_in(&mut self, kind: Kind) -> anyhow::Result<()> {
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

    /// Whether the gradients are autograd's own ([`DataParallel::use_local_grads`]).
    pub fn local(&self) -> bool {
        self.local
    }

    /// With local gradients: every parameter's, in the parameters' order
    /// (zeros for one that no backward pass reached).
    fn local_grads(&self) -> anyhow::Result<Vec<Tensor>> {
        let all = torch_ext::grads(&self.params)?;
        Ok(all.into_iter().zip(&self.params).map(|(g, p)| if g.defined() { g } else { p.zeros_like() }).collect())
    }

    /// Turns on the overlap of the gradients' reduction (all-reduces, or
    /// under ZeRO reduce-scatters) with the backward pass; returns whether
    /// it is on (more than one rank, a collective that supports it).
    fn enable_overlap(&mut self, comm: &dyn Collective) -> anyhow::Result<bool> {
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

    /// Squared L2 norm of the gradient buffers as they are now (f64, on the
    /// device): the local gradient before the reduction, the averaged one
    /// after it. Plain data parallelism only.
    pub fn grad_sq_norm(&self) -> anyhow::Result<Tensor> {
        anyhow::ensure!(!self.stage.sharded(), "gradient statistics are not computed under ZeRO");
        let mut total = Tensor::zeros([1], (Kind::Double, self.device));
        if self.local {
            for g in self.local_grads()? {
                total += g.norm().to_kind(Kind::Double).square();
            }
            return Ok(total);
        }
        for b in &self.buckets {
            if let Some((flat, _)) = &b.grad {
                // One reduction pass without a temporary copy of the buffer.
                total += flat.norm().to_kind(Kind::Double).square();
            }
        }
        Ok(total)
    }

    /// A scalar that is NaN or infinite when some gradient element is: the
    /// sum of the gradient buffers, one reduction pass that stays on the
    /// device (a finite sum could only overflow with elements near f32's
    /// limit divided by their count). `grads` are the step's
    /// ([`DataParallel::grads`]), summed one by one when no buffers hold
    /// them (local gradients).
    pub fn grad_checksum(&self, grads: &[Tensor]) -> Tensor {
        let mut sums: Vec<Tensor> = if self.local {
            grads.iter().map(|g| g.sum(Kind::Float)).collect()
        } else {
            self.buckets.iter().filter_map(|b| b.grad.as_ref().map(|(flat, _)| flat.sum(Kind::Float))).collect()
        };
        match sums.len() {
            0 => Tensor::zeros([], (Kind::Float, self.device)),
            1 => sums.pop().expect("one sum"),
            _ => Tensor::stack(&sums, 0).sum(Kind::Float),
        }
    }

    /// The index of the first gradient bucket holding a NaN or infinity
    /// (a pass per bucket: for error messages).
    pub fn first_non_finite_bucket(&self) -> Option<usize> {
        if self.local {
            let grads = self.local_grads().ok()?;
            return self.buckets.iter().position(|b| b.params.iter().any(|&i| grads[i].isfinite().all().int64_value(&[]) == 0));
        }
        self.buckets.iter().position(|b| b.grad.as_ref().is_some_and(|(flat, _)| flat.isfinite().all().int64_value(&[]) == 0))
    }

    /// Start of a step: zeroes the gradient buffers (ZeRO-2 has released
    /// them and allocates zeroed ones before the first backward pass), or
    /// drops the local gradients.
    pub fn begin_step(&mut self) -> anyhow::Result<()> {
        if self.local {
            torch_ext::grads_to_none(&self.params)?;
            return Ok(());
        }
        if let (Some(f), Some(o)) = (&mut self.stale_bufs, &self.overlap) {
            f.steps += 1;
            for (b, stale) in self.buckets.iter().zip(&mut f.stale) {
                *stale = f.steps > 1 && !b.params.iter().any(|&i| o.by_autograd[i].load(std::sync::atomic::Ordering::Relaxed));
            }
        }
        for (bi, b) in self.buckets.iter_mut().enumerate() {
            if let Some((flat, views)) = &mut b.grad {
                if self.stale_bufs.as_ref().is_some_and(|f| f.left(bi)) {
                    crate::stale::mark(views.iter());
                } else {
                    let _ = flat.zero_();
                }
            }
        }
        Ok(())
    }

    /// Before each backward pass: gives released buffers back (ZeRO-2).
    pub fn before_backward(&mut self, params: &[Tensor]) -> anyhow::Result<()> {
        if self.local {
            return Ok(());
        }
        self.attach_grads(params)
    }

    /// Checks that backward accumulated into the buffers: every parameter's
    /// `.grad` must still be its view (autograd replacing it would leave the
    /// buffers, and so the reduction, without that gradient).
    pub fn check_grads(&self, params: &[Tensor]) -> anyhow::Result<()> {
        if self.local {
            return Ok(());
        }
        let grads = torch_ext::grads(params)?;
        for b in &self.buckets {
            let Some((_, views)) = &b.grad else { anyhow::bail!("a gradient buffer is missing before the reduction") };
            for (&i, v) in b.params.iter().zip(views) {
                anyhow::ensure!(
                    grads[i].defined() && grads[i].data_ptr() == v.data_ptr(),
                    "parameter {i}'s gradient is no longer a view of its bucket (backward replaced it)"
                );
            }
        }
        Ok(())
    }

    /// Reduces the gradients of the step. Without ZeRO each flat buffer goes
    /// to the compressor, which leaves the average in it. Under ZeRO each
    /// buffer is reduce-scattered and this rank keeps its chunk, averaged;
    /// ZeRO-2 then releases the full buffers. `scan`: check each buffer for
    /// NaN/inf right after the compressor returns it, when it was written
    /// last (the CPU check of a plugin's output when the step computes no
    /// gradient norm that would show it).
    pub fn reduce(
        &mut self,
        params: &[Tensor],
        compressor: &mut dyn Compressor,
        comm: &mut dyn Collective,
        step: u64,
        scan: bool,
    ) -> anyhow::Result<()> {
        if self.local && self.world == 1 {
            // One rank: the average is the gradient.
            return Ok(());
        }
        let n = self.world as f64;
        let count = self.buckets.len();
        if let (Some(o), true) = (&self.overlap, compressor.is_plain_average()) {
            let (launched, split) = {
                let mut st = o.state.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(e) = st.error.take() {
                    anyhow::bail!("an all-reduce started during the backward pass failed: {e}");
                }
                // The hooks' references to the buffers go: ZeRO-2 releases its
                // buffers after the wait below, and a reference kept here
                // would hold them through the update and the next forward
                // pass, and beside their successors from the next step's
                // allocation to its first hook (while they did, ZeRO-2 peaked
                // 3.6 GiB above ZeRO-1 on GPT 1.3B on 4 H100s).
                st.flats = Vec::new();
                (std::mem::take(&mut st.launched), st.split)
            };
            // Buckets whose gradients never all arrived (unused parameters).
            for (bi, (b, done)) in self.buckets.iter().zip(launched.iter().copied().chain(std::iter::repeat(false))).enumerate() {
                if done {
                    continue;
                }
                self.settle_bucket(b);
                if self.local {
                    let mut st = o.state.lock().unwrap_or_else(|e| e.into_inner());
                    let kind = st.reduce_kind;
                    start_average(comm, reducible_grads(&o.members[bi])?, kind, &mut st.casts)?;
                } else if o.sharded {
                    let Some((flat, _)) = &b.grad else { anyhow::bail!("a gradient buffer is missing before the reduction") };
                    let st = o.state.lock().unwrap_or_else(|e| e.into_inner());
                    comm.reduce_scatter_avg_async(flat, &st.chunks[bi])?;
                } else {
                    let Some((flat, _)) = &b.grad else { anyhow::bail!("a gradient buffer is missing before the reduction") };
                    if split {
                        comm.all_reduce_split_avg_async(flat)?;
                    } else {
                        comm.all_reduce_sum_async(flat)?;
                    }
                }
            }
            o.state.lock().unwrap_or_else(|e| e.into_inner()).launched = vec![false; count];
            comm.wait_async()?;
            let casts = std::mem::take(&mut o.state.lock().unwrap_or_else(|e| e.into_inner()).casts);
            tch::no_grad(|| {
                for (grad, average) in casts {
                    grad.shallow_clone().copy_(&average);
                }
            });
            if o.sharded {
                let chunks = std::mem::take(&mut o.state.lock().unwrap_or_else(|e| e.into_inner()).chunks);
                for (b, chunk) in self.buckets.iter_mut().zip(chunks) {
                    b.reduced = Some(chunk);
                    if self.stage == ZeroStage::Two {
                        // Released behind the wait: the reduce-scatter has read it.
                        for &i in &b.params {
                            torch_ext::set_grad(&params[i], None)?;
                        }
                        b.grad = None;
                    }
                }
            } else if !self.local && !split {
                // Summed: the average is a division away (the split path averages in NCCL).
                for b in &self.buckets {
                    if let Some((flat, _)) = &b.grad {
                        let _ = flat.shallow_clone().divide_scalar_(n);
                    }
                }
            }
            return Ok(());
        }
        if self.stale_bufs.is_some() {
            self.buckets.iter().for_each(|b| self.settle_bucket(b));
        }
        for (index, b) in self.buckets.iter_mut().enumerate() {
            let Some((flat, _)) = &b.grad else { anyhow::bail!("a gradient buffer is missing before the reduction") };
            if !self.stage.sharded() {
                let mut out = flat.shallow_clone();
                compressor.reduce(&mut out, comm, &harness_sandbox::strategy::BucketCtx { step, index, count })?;
                // A compressor may hand back a new tensor instead of writing
                // in place; the parameters' gradients are views of `flat`.
                if out.data_ptr() != flat.data_ptr() {
                    tch::no_grad(|| flat.shallow_clone().copy_(&out.view_as(flat)));
                }
                if scan && !torch_ext::cpu_all_finite(flat).unwrap_or_else(|| flat.isfinite().all().int64_value(&[]) != 0) {
                    compressor.check_output(step, &Tensor::from(f32::NAN), &|| Some(index))?;
                }
                continue;
            }
            let mut chunk = comm.reduce_scatter_sum(flat)?;
            let _ = chunk.divide_scalar_(n);
            b.reduced = Some(chunk);
            if self.stage == ZeroStage::Two {
                for &i in &b.params {
                    torch_ext::set_grad(&params[i], None)?;
                }
                b.grad = None;
            }
        }
        Ok(())
    }

    /// The gradients the optimizer reads, reduced, matching
    /// [`DataParallel::update_targets`]: every parameter's (views of the
    /// buffers), or under ZeRO the shard's pieces of the reduced chunks.
    pub fn grads(&self) -> anyhow::Result<Vec<Tensor>> {
        if self.local {
            return self.local_grads();
        }
        if !self.stage.sharded() {
            let mut out: Vec<Option<Tensor>> = self.params.iter().map(|_| None).collect();
            for b in &self.buckets {
                let (_, views) = b.grad.as_ref().ok_or_else(|| anyhow::anyhow!("a gradient buffer is missing"))?;
                for (&i, v) in b.params.iter().zip(views) {
                    out[i] = Some(v.shallow_clone());
                }
            }
            return out.into_iter().map(|g| g.ok_or_else(|| anyhow::anyhow!("a parameter is in no bucket"))).collect();
        }
        self.segments
            .iter()
            .map(|s| {
                let b = &self.buckets[s.bucket];
                let chunk = b.reduced.as_ref().ok_or_else(|| anyhow::anyhow!("the gradients were not reduced"))?;
                Ok(chunk.narrow(0, s.start - self.rank as i64 * (b.padded / self.world as i64), s.len))
            })
            .collect()
    }

    /// What the optimizer updates, with whether each gets weight decay: the
    /// parameters in their own order (whatever the buckets' order, so that
    /// the optimizer's state keeps its order), or under ZeRO the shard's
    /// pieces of the flat parameter buffers.
    pub fn update_targets(&self, params: &[Tensor]) -> (Vec<Tensor>, Vec<bool>) {
        if !self.stage.sharded() {
            return params.iter().map(|p| (p.shallow_clone(), decays(p))).unzip();
        }
        self.segments
            .iter()
            .map(|s| {
                let flat = self.buckets[s.bucket].param_flat.as_ref().expect("ZeRO keeps flat parameter buffers");
                (flat.narrow(0, s.start, s.len), s.decay)
            })
            .unzip()
    }

    /// Without ZeRO, after the reduction, where every rank holds the same
    /// averaged gradients: this rank's disjoint share of them, the r-th of
    /// `world` equal pieces of each flat buffer (or of each of autograd's
    /// gradients), for a norm that each rank computes over a `world`-th of
    /// the gradients and the ranks add up ([`global_norm`]) instead of every
    /// rank reading them all. None under ZeRO (its shard is the share) or
    /// with one rank.
    pub fn norm_share(&self) -> anyhow::Result<Option<Vec<Tensor>>> {
        if self.stage.sharded() || self.world < 2 {
            return Ok(None);
        }
        let piece = |t: &Tensor| {
            let n = t.numel() as i64;
            let per = padded_to(n, self.world) / self.world as i64;
            let start = (self.rank as i64 * per).min(n);
            t.reshape([-1]).narrow(0, start, per.min(n - start))
        };
        let whole = if self.local {
            self.local_grads()?
        } else {
            let flats = self.buckets.iter().map(|b| b.grad.as_ref().map(|g| g.0.narrow(0, 0, b.numel)));
            flats.collect::<Option<Vec<_>>>().ok_or_else(|| anyhow::anyhow!("a gradient buffer is missing"))?
        };
        Ok(Some(whole.iter().map(piece).filter(|p| p.numel() > 0).collect()))
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

    /// Whether optimizer state and gradients are sharded (ZeRO).
    pub fn sharded(&self) -> bool {
        self.stage.sharded()
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
    fn use_symmetric_params(&mut self, comm: &mut dyn Collective) -> anyhow::Result<bool> {
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
    fn prefetch_params(&mut self, on: bool) {
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
    fn start_gathers(&mut self, comm: &mut dyn Collective) -> anyhow::Result<()> {
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

    /// Bytes of gradient memory this rank holds now: the full buffers
    /// allocated and the reduced chunks.
    pub fn gradient_bytes(&self) -> u64 {
        let bytes = torch_ext::nbytes;
        if self.local {
            return torch_ext::grads(&self.params).map_or(0, |g| g.iter().filter(|g| g.defined()).map(bytes).sum());
        }
        // ZeRO-1's in-place chunks are views of the buffers, not memory of their own.
        let reduced = |b: &Bucket| if self.zero_sym { 0 } else { b.reduced.as_ref().map_or(0, bytes) };
        self.buckets.iter().map(|b| b.grad.as_ref().map_or(0, |g| bytes(&g.0)) + reduced(b)).sum()
    }

    /// Bytes of device memory this state holds outside libtorch's caching
    /// allocator, which its peaks leave out: the symmetric gradient
    /// buffers of [`DataParallel::use_symmetric_buffers`] (ZeRO-1's of
    /// [`DataParallel::use_symmetric_zero_grads`]) and the receive
    /// buffer of [`DataParallel::use_copy_engine_reduce`], and ZeRO's
    /// symmetric parameter buffers ([`DataParallel::use_symmetric_params`]),
    /// held for the whole run.
    pub fn outside_allocator_bytes(&self) -> u64 {
        if !self.split_buffers() && !self.zero_sym {
            return self.symmetric_param_bytes;
        }
        let buffers: u64 = self.buckets.iter().map(|b| b.grad.as_ref().map_or(0, |g| torch_ext::nbytes(&g.0))).sum();
        buffers + self.symmetric_param_bytes
    }

    /// Bytes of each bucket's gradients (padding excluded).
    pub fn bucket_bytes(&self) -> Vec<u64> {
        self.buckets.iter().map(|b| b.numel as u64 * b.kind.elt_size_in_bytes() as u64).collect()
    }
}

/// Scales `grads`, whose 2-norm is `norm`, by min(1, max_norm / (norm +
/// 1e-6)), as `torch.nn.utils.clip_grad_norm_` does.
pub fn scale_to_norm(grads: &[Tensor], norm: &Tensor, max_norm: f64) {
    let coef = ((norm + 1e-6).reciprocal() * max_norm).clamp_max(1.0);
    tch::no_grad(|| {
        for g in grads {
            let _ = g.shallow_clone().g_mul_(&coef);
        }
    });
}

/// The 2-norm of gradients spread over the ranks, each holding the disjoint
/// part `parts` (a device scalar, the same on every rank): the ranks add up
/// the squares of their parts' norms with a control all-reduce.
pub fn global_norm(parts: &[Tensor], comm: &mut dyn Collective, device: Device) -> anyhow::Result<Tensor> {
    let local = if parts.is_empty() { Tensor::zeros([], (Kind::Float, device)) } else { torch_ext::clip_grad_norm(parts, None)? };
    let mut sq = local.square();
    comm.all_reduce_sum_control(&mut sq)?;
    Ok(sq.sqrt())
}

/// Groups the parameters, taken in `order`, into buckets of consecutive
/// parameters of at most `max_bytes` of gradients (a parameter larger than
/// its bucket's limit gets a bucket of its own). The last `tail` buckets
/// are smaller: the limit halves for each, from the end of `order` (the
/// last at `max_bytes / 2^tail`), so that the gradients that the backward
/// pass finishes last, whose reduction nothing overlaps, go in small
/// collectives. Built from the end, so the first bucket takes what is left.
pub fn buckets_of(params: &[Tensor], order: &[usize], max_bytes: u64, tail: u32) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut size = 0u64;
    for &i in order.iter().rev() {
        let b = torch_ext::nbytes(&params[i]);
        // The current bucket is the k-th from the end.
        let k = out.len().saturating_sub(1) as u32;
        let limit = max_bytes >> tail.saturating_sub(k).min(63);
        match out.last_mut() {
            Some(cur) if size + b <= limit => {
                cur.push(i);
                size += b;
            }
            _ => {
                out.push(vec![i]);
                size = b;
            }
        }
    }
    out.reverse();
    for bucket in &mut out {
        bucket.reverse();
    }
    out
}

/// The order in which a backward pass finishes the gradients of `params`,
/// as far as `created` (their creation order, by index into `params`) tells:
/// the reverse of it, as PyTorch DDP buckets parameters in the reverse of
/// their registration order (a model creates its layers in the order its
/// forward pass uses them, whose gradients then come last to first). A
/// parameter missing from `created` goes first, a repeated one at its last
/// place, an index out of range is left out.
pub fn ready_order(n: usize, created: &[usize]) -> Vec<usize> {
    let mut listed = vec![false; n];
    let mut last_first = Vec::with_capacity(n);
    for &i in created.iter().rev() {
        if i < n && !std::mem::replace(&mut listed[i], true) {
            last_first.push(i);
        }
    }
    (0..n).filter(|&i| !listed[i]).chain(last_first).collect()
}

/// `p`'s place in the flat buffer `flat` (its `numel` values from `off`):
/// a view with `p`'s shape and, when `p` is dense in some dimension order
/// (as channels-last convolution weights are), `p`'s strides, so that
/// gradients and ZeRO's parameters keep the parameter's memory layout, as
/// DDP's bucket views do (fused optimizers need parameters, gradients and
/// states alike, and autograd copies gradients of another layout).
fn slot(flat: &Tensor, off: i64, p: &Tensor) -> Tensor {
    let (size, stride) = (p.size(), p.stride());
    if harness_kernels::torch_ext::is_dense_layout(&size, &stride) {
        flat.as_strided(size.as_slice(), stride.as_slice(), off)
    } else {
        flat.narrow(0, off, p.numel() as i64).view(size.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use harness_runtime::comm::InProcessGroup;
    use harness_sandbox::strategy::AllReduce;

    /// Parameters of odd sizes (so that ZeRO pads) with values depending on
    /// `seed` (not from libtorch's generator, which tests share).
    fn params(seed: i64) -> Vec<Tensor> {
        let shapes: [&[i64]; 4] = [&[3, 5], &[7], &[2, 2], &[9, 1]];
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n: i64 = s.iter().product();
                let x = (Tensor::arange(n, tch::kind::FLOAT_CPU) * 0.37 + (seed * 10 + i as i64) as f64).sin();
                x.view(*s).set_requires_grad(true)
            })
            .collect()
    }

    /// A loss that gives every parameter a distinct gradient.
    fn loss(ps: &[Tensor], k: f64) -> Tensor {
        ps.iter()
            .enumerate()
            .map(|(i, p)| (p * p * (i as f64 + k)).sum(Kind::Float) + p.sum(Kind::Float))
            .fold(Tensor::zeros([], tch::kind::FLOAT_CPU), |a, b| a + b)
    }

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(&t.reshape([-1])).unwrap()
    }

    /// Fresh gradients from autograd over two micro-batches.
    fn autograd_reference() -> Vec<Vec<f32>> {
        let reference = params(1);
        for k in [1.0, 2.0] {
            loss(&reference, k).backward();
        }
        torch_ext::grads(&reference).unwrap().iter().map(values).collect()
    }

    /// The two micro-batches of [`autograd_reference`] through `dp`: the
    /// gradients the optimizer would read.
    fn two_micro_batches(dp: &mut DataParallel, ps: &[Tensor]) -> Vec<Vec<f32>> {
        for k in [1.0, 2.0] {
            dp.before_backward(ps).unwrap();
            loss(ps, k).backward();
        }
        dp.check_grads(ps).unwrap();
        dp.grads().unwrap().iter().map(values).collect()
    }

    #[test]
    fn the_automatic_bucket_size_is_a_24th_of_the_gradients_and_at_least_25_mib() {
        let mib = 1u64 << 20;
        // GPT-2 124M's fp32 gradients: PyTorch DDP's 25 MiB.
        assert_eq!(auto_bucket_bytes_for(124_475_904 * 4), 25 * mib);
        // GPT 1.3B's (1,313,722,368 parameters): 25 buckets of about 209 MiB.
        let big = 1_313_722_368u64 * 4;
        assert_eq!(auto_bucket_bytes_for(big), big / 24);
        assert!((200 * mib..220 * mib).contains(&auto_bucket_bytes_for(big)));
        assert_eq!(auto_bucket_bytes_for(0), 25 * mib);
    }

    #[test]
    fn flat_buckets_collect_what_autograd_computes_and_zero_each_step() {
        let want = autograd_reference();

        // Same parameters, gradients as views of flat buckets of at most 44 bytes.
        let ps = params(1);
        let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, 0, 2).unwrap();
        assert_eq!(dp.bucket_bytes(), [60, 28 + 16, 36]);
        for step in 0..2 {
            dp.begin_step().unwrap();
            let got = two_micro_batches(&mut dp, &ps);
            assert_eq!(got, want, "step {step}");
            // The buffers hold them: bucket 1 is parameters 1 and 2, back to back.
            let flat = &dp.buckets[1].grad.as_ref().unwrap().0;
            assert_eq!(values(flat), [want[1].clone(), want[2].clone()].concat());
        }
        // A gradient that autograd (or anyone) replaced is caught.
        torch_ext::set_grad(&ps[2], Some(&Tensor::zeros([2, 2], tch::kind::FLOAT_CPU))).unwrap();
        let e = dp.check_grads(&ps).unwrap_err().to_string();
        assert!(e.contains("parameter 2's gradient is no longer a view"), "{e}");
    }

    #[test]
    fn one_rank_with_the_plain_average_keeps_autograds_gradients() {
        let want = autograd_reference();
        // Two ranks, ZeRO or a compressor keep the buffers.
        let ps = params(1);
        assert!(!DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, 0, 2).unwrap().use_local_grads(true).unwrap());
        assert!(!DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, 0, 1)
            .unwrap()
            .use_local_grads(false)
            .unwrap());
        let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, 0, 1).unwrap();
        assert!(dp.use_local_grads(true).unwrap());
        assert_eq!(dp.gradient_bytes(), 0, "the buffers stayed");
        for step in 0..2 {
            dp.begin_step().unwrap();
            assert!(torch_ext::grads(&ps).unwrap().iter().all(|g| !g.defined()), "step {step} began with gradients");
            let got = two_micro_batches(&mut dp, &ps);
            assert_eq!(got, want, "step {step}");
            assert_eq!(dp.gradient_bytes(), 4 * 35);
        }
        // A parameter no pass reached gets zeros for the optimizer.
        dp.begin_step().unwrap();
        (&ps[0] * 2.0).sum(Kind::Float).backward();
        let g = dp.grads().unwrap();
        assert_eq!(values(&g[0]), vec![2.0; 15]);
        assert!(g[1..].iter().all(|g| values(g).iter().all(|&v| v == 0.0)));
    }

    #[test]
    fn gradients_and_zero_parameters_keep_a_channels_last_layout() {
        use harness_kernels::torch_ext::is_dense_layout as dense;
        assert!(dense(&[2, 3, 4, 5], &[60, 1, 15, 3]) && dense(&[7, 1], &[1, 1]) && !dense(&[4, 4], &[8, 1]));
        let conv = || {
            let w = (Tensor::arange(2 * 3 * 2 * 2, tch::kind::FLOAT_CPU) * 0.1).sin().view([2, 3, 2, 2]);
            crate::models::vision::channels_last(&w).set_requires_grad(true)
        };
        let reference = conv();
        (&reference * &reference).sum(Kind::Float).backward();
        for stage in [ZeroStage::None, ZeroStage::Two] {
            let ps = vec![conv(), Tensor::ones([5], tch::kind::FLOAT_CPU).set_requires_grad(true)];
            let strides = ps[0].stride();
            let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 1 << 20), stage, 0, 2).unwrap();
            assert_eq!(ps[0].stride(), strides, "{stage:?} changed the parameter's layout");
            assert_eq!(ps[0].grad().stride(), strides, "{stage:?}: the gradient's layout is not the parameter's");
            dp.begin_step().unwrap();
            dp.before_backward(&ps).unwrap();
            (&ps[0] * &ps[0]).sum(Kind::Float).backward();
            dp.check_grads(&ps).unwrap();
            assert!(ps[0].grad().equal(&reference.grad()), "{stage:?}");
        }
    }

    #[test]
    fn zero_shards_split_every_parameter_once_and_keep_its_values() {
        let world = 3;
        let before: Vec<Vec<f32>> = params(2).iter().map(values).collect();
        let total: i64 = before.iter().map(|v| v.len() as i64).sum();
        let mut seen = vec![0u32; total as usize];
        let mut sizes = Vec::new();
        for rank in 0..world {
            let ps = params(2);
            let dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::One, rank, world).unwrap();
            // Buffers padded to a multiple of the ranks: 15 -> 15, 11 -> 12, 9 -> 9.
            assert_eq!(dp.buckets.iter().map(|b| b.padded).collect::<Vec<_>>(), [15, 12, 9]);
            // The parameters kept their values and now live in the flat buffers.
            for (p, v) in ps.iter().zip(&before) {
                assert_eq!(&values(p), v);
            }
            let flat = dp.buckets[1].param_flat.as_ref().unwrap();
            assert_eq!(ps[2].data_ptr() as usize, flat.data_ptr() as usize + 7 * 4);
            let (targets, decay) = dp.update_targets(&ps);
            sizes.push(targets.iter().map(|t| t.numel()).sum::<usize>());
            for (s, d) in dp.segments.iter().zip(decay) {
                let b = &dp.buckets[s.bucket];
                let chunk = b.padded / world as i64;
                assert!(
                    s.start >= rank as i64 * chunk && s.start + s.len <= (rank as i64 + 1) * chunk,
                    "{s:?} outside rank {rank}'s chunk"
                );
                let global: i64 = dp.buckets[..s.bucket].iter().map(|b| b.numel).sum::<i64>() + s.start;
                for e in global..global + s.len {
                    seen[e as usize] += 1;
                }
                // Decay follows the parameter the segment lies in (only [3, 5], [2, 2] and [9, 1] are matrices).
                let owner = b.offsets.iter().rposition(|&o| o <= s.start).unwrap();
                assert_eq!(d, ps[b.params[owner]].dim() >= 2);
            }
        }
        assert!(seen.iter().all(|&c| c == 1), "elements owned by other than one rank: {seen:?}");
        // Each rank owns 1/3 of every padded bucket, less the padding it got.
        assert_eq!(sizes, [5 + 4 + 3, 5 + 4 + 3, 5 + 3 + 3]);
    }

    /// Runs `f` on two thread ranks with fresh parameters each.
    fn two_ranks<T: Send + 'static>(f: impl Fn(usize, &mut harness_runtime::comm::InProcessComm) -> T + Send + Sync + 'static) -> Vec<T> {
        let g = InProcessGroup::new(2, Duration::from_secs(10));
        let f = Arc::new(f);
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let (g, f) = (g.clone(), f.clone());
                std::thread::spawn(move || f(r, &mut g.rank(r, None)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn zero_reduces_this_ranks_shard_and_gathers_every_update() {
        for stage in [ZeroStage::One, ZeroStage::Two] {
            let out = two_ranks(move |rank, comm| {
                let ps = params(3);
                let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), stage, rank, 2).unwrap();
                let full = dp.gradient_bytes();
                dp.begin_step().unwrap();
                dp.before_backward(&ps).unwrap();
                // Rank r's gradient is (r + 1) x the loss's: the average is 1.5 x.
                (loss(&ps, 1.0) * (rank as f64 + 1.0)).backward();
                dp.check_grads(&ps).unwrap();
                let want: Vec<f32> = torch_ext::grads(&ps).unwrap().iter().flat_map(|g| values(&(g / (rank as f64 + 1.0) * 1.5))).collect();
                dp.reduce(&ps, &mut AllReduce, comm, 0, false).unwrap();
                let held = dp.gradient_bytes();
                // The shard's gradients are the average, at the shard's places.
                let (targets, _) = dp.update_targets(&ps);
                for (s, g) in dp.segments.iter().zip(dp.grads().unwrap()) {
                    let global = dp.buckets[..s.bucket].iter().map(|b| b.numel).sum::<i64>() + s.start;
                    assert_eq!(values(&g), want[global as usize..(global + s.len) as usize]);
                }
                // An "update" of the shard: every element becomes its rank's number; the gather spreads it.
                tch::no_grad(|| targets.iter().for_each(|t| drop(t.shallow_clone().fill_(rank as f64 + 10.0))));
                dp.gather_params(comm).unwrap();
                let after: Vec<f32> = ps.iter().flat_map(values).collect();
                (full, held, after, dp.segments.clone())
            });
            // Both ranks end with the same parameters: rank 0's first half of each bucket, rank 1's second.
            assert_eq!(out[0].2, out[1].2, "{stage:?}");
            assert!(out[0].2.iter().all(|&x| x == 10.0 || x == 11.0));
            for (rank, o) in out.iter().enumerate() {
                // Bucket of 15 elements padded to 16: 4 bytes x (16 + 12 + 10), half of it reduced.
                assert_eq!(o.0, 4 * (16 + 12 + 10), "{stage:?}");
                let shard = 4 * (8 + 6 + 5);
                let held = if stage == ZeroStage::Two { shard } else { 4 * (16 + 12 + 10) + shard };
                assert_eq!(o.1, held, "{stage:?} rank {rank}");
            }
        }
    }

    /// Two steps of two micro-batches on rank `rank`, its gradients
    /// (r + 1 + step) x the loss's, parameter 3 getting none, the reduction
    /// started from the hooks where the overlap is on: after each step, the
    /// gradients the optimizer reads and the gradient bytes held.
    fn two_steps(
        dp: &mut DataParallel,
        ps: &[Tensor],
        rank: usize,
        comm: &mut harness_runtime::comm::InProcessComm,
    ) -> Vec<(Vec<Vec<f32>>, u64)> {
        let mut out = Vec::new();
        for step in 0..2u64 {
            dp.begin_step().unwrap();
            for (micro, k) in [1.0, 2.0].into_iter().enumerate() {
                dp.before_backward(ps).unwrap();
                dp.arm_overlap(comm, micro == 1);
                (loss(&ps[..3], k) * (rank as f64 + 1.0 + step as f64)).backward();
                dp.disarm_overlap();
            }
            dp.check_grads(ps).unwrap();
            dp.reduce(ps, &mut AllReduce, comm, step, false).unwrap();
            out.push((dp.grads().unwrap().iter().map(values).collect(), dp.gradient_bytes()));
            dp.gather_params(comm).unwrap();
        }
        out
    }

    #[test]
    fn overlapped_ranks_with_autograds_gradients_average_as_the_flat_buckets_do() {
        // Two steps of two micro-batches on two ranks, the all-reduce started
        // from the gradient hooks; parameter 3 gets no gradient, so its
        // bucket is reduced after the pass, as zeros.
        let run = |local: bool| {
            two_ranks(move |rank, comm| {
                let ps = params(5);
                let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, rank, 2).unwrap();
                assert!(dp.enable_overlap(comm).unwrap());
                // Else the flat buffers, which HARNESS_LOCAL_GRADS=0 keeps.
                if local {
                    assert!(tch::no_grad(|| dp.use_local_grads(true)).unwrap());
                }
                let steps: Vec<_> = two_steps(&mut dp, &ps, rank, comm).into_iter().map(|s| s.0).collect();
                (steps, comm.stats().collectives)
            })
        };
        let flat = run(false);
        let local = run(true);
        // Bit for bit what the flat buffers give, on both ranks, with one
        // collective per bucket and step (three buckets).
        assert_eq!(flat, local);
        assert_eq!(local[0].0, local[1].0);
        assert_eq!(local[0].1, 2 * 3);
        // The average over ranks: (r + 1 + step) x the two passes' gradients.
        let reference = params(5);
        for k in [1.0, 2.0] {
            loss(&reference[..3], k).backward();
        }
        let want = torch_ext::grads(&reference[..3]).unwrap();
        for (step, got) in local[0].0.iter().enumerate() {
            for (g, w) in got.iter().zip(&want) {
                let w = values(&(w * (1.5 + step as f64)));
                assert!(g.iter().zip(&w).all(|(a, b)| (a - b).abs() <= 1e-5 * b.abs().max(1.0)), "step {step}: {g:?} vs {w:?}");
            }
            assert!(got[3].iter().all(|&x| x == 0.0), "an unused parameter's average is zero");
        }
    }

    #[test]
    fn buckets_follow_the_plans_order_and_shrink_at_its_end() {
        // 60, 28, 16 and 36 bytes of gradients.
        let ps = params(1);
        // In order, 44-byte buckets: a parameter larger than that alone.
        assert_eq!(buckets_of(&ps, &[0, 1, 2, 3], 44, 0), [vec![0], vec![1, 2], vec![3]]);
        // The reverse order, the last bucket at most 100 / 2 bytes: 16 alone
        // (60 more would pass 50), then 60 + 28 within 100, 36 left first.
        assert_eq!(buckets_of(&ps, &[3, 1, 0, 2], 100, 1), [vec![3], vec![1, 0], vec![2]]);
        // Two smaller ones: 16 within 25, 60 alone past 50, then 28 + 36.
        assert_eq!(buckets_of(&ps, &[3, 1, 0, 2], 100, 2), [vec![3, 1], vec![0], vec![2]]);
        // The backward pass finishes the last created first; a parameter the
        // creation order misses goes first, a repeated one at its last place.
        assert_eq!(ready_order(4, &[0, 1, 2, 3]), [3, 2, 1, 0]);
        assert_eq!(ready_order(4, &[2, 0, 3, 0, 9]), [1, 0, 3, 2]);
    }

    #[test]
    fn buckets_in_another_order_average_as_in_the_parameters_order() {
        // The same two steps on two ranks, the buckets in the parameters'
        // order or as [3], [1, 0], [2]: the same averages, handed to the
        // optimizer in the parameters' order, on every path that keeps
        // flat buffers or autograd's gradients.
        let run = |reordered: bool, path: u8| {
            two_ranks(move |rank, comm| {
                let ps = params(5);
                let plan =
                    if reordered { BucketPlan { order: vec![3, 1, 0, 2], max_bytes: 100, tail: 1 } } else { BucketPlan::in_order(&ps, 44) };
                let mut dp = DataParallel::lay_out(&ps, &plan, ZeroStage::None, rank, 2).unwrap();
                assert!(dp.enable_overlap(comm).unwrap());
                match path {
                    1 => assert!(tch::no_grad(|| dp.use_local_grads(true)).unwrap()),
                    2 => assert!(tch::no_grad(|| dp.use_symmetric_buffers(comm)).unwrap()),
                    _ => {}
                }
                let (targets, _) = dp.update_targets(&ps);
                assert!(targets.iter().zip(&ps).all(|(t, p)| t.data_ptr() == p.data_ptr()), "the optimizer's targets keep their order");
                let steps: Vec<_> = two_steps(&mut dp, &ps, rank, comm).into_iter().map(|s| s.0).collect();
                (steps, dp.bucket_bytes())
            })
        };
        for path in 0..3 {
            let (before, after) = (run(false, path), run(true, path));
            assert_eq!(after[0].0, before[0].0, "path {path}");
            assert_eq!(after[0].0, after[1].0, "path {path}");
            assert_eq!(after[0].1, [36, 88, 16]);
        }
        let ps = params(5);
        let e = DataParallel::lay_out(&ps, &BucketPlan { order: vec![0, 1, 1, 3], max_bytes: 44, tail: 0 }, ZeroStage::None, 0, 2)
            .err()
            .expect("a parameter twice is refused");
        assert!(e.to_string().contains("each of the 4 parameters once"), "{e}");
    }

    #[test]
    fn zero_shard_layouts_follow_the_bucket_plan_and_plain_data_parallelism_has_none() {
        // What a ZeRO checkpoint records so that a run whose buckets lie
        // otherwise refuses it: the same plan, the same digest; another, another.
        let layout = |plan: BucketPlan, stage| {
            let ps = params(5);
            DataParallel::lay_out(&ps, &plan, stage, 0, 2).unwrap().shard_layout()
        };
        let reordered = || BucketPlan { order: vec![3, 1, 0, 2], max_bytes: 100, tail: 1 };
        let a = layout(BucketPlan::in_order(&params(5), 44), ZeroStage::One);
        assert_eq!(a.len(), 16, "{a}");
        assert_eq!(a, layout(BucketPlan::in_order(&params(5), 44), ZeroStage::One));
        assert_ne!(a, layout(reordered(), ZeroStage::One));
        assert_ne!(a, layout(BucketPlan::in_order(&params(5), 60), ZeroStage::One));
        assert_eq!(layout(reordered(), ZeroStage::Two), layout(reordered(), ZeroStage::Two));
        assert_eq!(layout(reordered(), ZeroStage::None), "");
    }

    #[test]
    fn the_ranks_shares_of_the_norm_add_up_to_the_norm_of_every_gradient() {
        // After the reduction every rank holds the same averages; each takes
        // a disjoint half of them, and the control all-reduce that adds the
        // squares up is not counted as gradient traffic.
        for path in 0..3u8 {
            let got = two_ranks(move |rank, comm| {
                let ps = params(5);
                let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, rank, 2).unwrap();
                assert!(dp.enable_overlap(comm).unwrap());
                match path {
                    1 => assert!(tch::no_grad(|| dp.use_local_grads(true)).unwrap()),
                    2 => assert!(tch::no_grad(|| dp.use_symmetric_buffers(comm)).unwrap()),
                    _ => {}
                }
                two_steps(&mut dp, &ps, rank, comm);
                let all = torch_ext::clip_grad_norm(&dp.grads().unwrap(), None).unwrap().double_value(&[]);
                let share = dp.norm_share().unwrap().expect("two ranks without ZeRO share the norm");
                let mine: i64 = share.iter().map(|t| t.numel() as i64).sum();
                let before = comm.stats().collectives;
                let norm = global_norm(&share, comm, Device::Cpu).unwrap().double_value(&[]);
                (all, norm, mine, comm.stats().collectives - before)
            });
            for (rank, (all, norm, _, counted)) in got.iter().enumerate() {
                assert!((all - norm).abs() <= 1e-5 * all, "path {path}, rank {rank}: {norm} against {all}");
                assert_eq!(*counted, 0, "the control all-reduce counted");
            }
            // 35 elements (or 15 + 7 + 4 + 9, each split) between the two ranks, once each.
            assert_eq!(got[0].2 + got[1].2, 35, "path {path}");
        }
        // Under ZeRO the shard is the share, and one rank reads everything.
        let ps = params(5);
        assert!(DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::One, 0, 2).unwrap().norm_share().unwrap().is_none());
        assert!(DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, 0, 1).unwrap().norm_share().unwrap().is_none());
    }

    #[test]
    fn symmetric_buffers_average_as_a_scatter_and_a_gather_what_the_all_reduce_does() {
        // HARNESS_CE_GATHER's path on thread ranks: the flat buffers moved
        // into the collective's symmetric memory (padded to the ranks), each
        // bucket a reduce-scatter and an all-gather from the hooks.
        let run = |split: bool| {
            two_ranks(move |rank, comm| {
                let ps = params(5);
                let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, rank, 2).unwrap();
                assert!(dp.enable_overlap(comm).unwrap());
                if split {
                    assert!(tch::no_grad(|| dp.use_symmetric_buffers(comm)).unwrap());
                }
                let padded: Vec<i64> = dp.buckets.iter().map(|b| b.padded).collect();
                let steps: Vec<_> = two_steps(&mut dp, &ps, rank, comm).into_iter().map(|s| s.0).collect();
                let s = comm.stats();
                let ops = |op| s.ops.get(&op).map_or(0, |o| o.collectives);
                (
                    steps,
                    padded,
                    ops(harness_runtime::comm::Op::AllReduce),
                    ops(harness_runtime::comm::Op::ReduceScatter),
                    ops(harness_runtime::comm::Op::AllGather),
                )
            })
        };
        let plain = run(false);
        let split = run(true);
        // The same averages bit for bit (a sum in rank order, halved), on both ranks.
        assert_eq!(split[0].0, plain[0].0);
        assert_eq!(split[0].0, split[1].0);
        // Buckets of 15, 11 and 9 elements: odd ones padded to the two ranks.
        assert_eq!(plain[0].1, [15, 11, 9]);
        assert_eq!(split[0].1, [16, 12, 10]);
        // Three buckets a step, two steps: an all-reduce each, or a scatter and a gather.
        assert_eq!((plain[0].2, plain[0].3, plain[0].4), (6, 0, 0));
        assert_eq!((split[0].2, split[0].3, split[0].4), (0, 6, 6));
    }

    #[test]
    fn unzeroed_buffers_that_the_layers_write_average_as_zeroed_ones_do() {
        // A fused linear layer (w, b: its node writes their buffers itself),
        // a parameter whose node hands autograd no gradient and writes none
        // (u), and one autograd accumulates (v), on two ranks, four steps of
        // two micro-batches; the third step's first micro-batch runs the
        // layer through libtorch, so autograd gets w's and b's gradients
        // first. Between steps every gradient is overwritten with NaN: what
        // a stale buffer holds must never reach an average.
        struct NoGradient;
        impl torch_ext::CustomOp for NoGradient {
            fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
                Ok((vec![&inputs[0] * 2.0], vec![]))
            }
            fn backward(&self, _: &[Tensor], _: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
                Ok(vec![None])
            }
        }
        let run = |unzeroed: bool, stage: ZeroStage| {
            two_ranks(move |rank, comm| {
                let w = (Tensor::arange(12, tch::kind::FLOAT_CPU).view([4, 3]) * 0.1).sin().set_requires_grad(true);
                let b = (Tensor::arange(4, tch::kind::FLOAT_CPU) * 0.3).cos().set_requires_grad(true);
                let u = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
                let v = Tensor::from_slice(&[0.5f32, -1.5, 2.0]).set_requires_grad(true);
                let ps = vec![w.shallow_clone(), b.shallow_clone(), u.shallow_clone(), v.shallow_clone()];
                // Buckets: [w, b, u] (72 bytes), [v].
                let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 72), stage, rank, 2).unwrap();
                assert!(dp.enable_overlap(comm).unwrap());
                if unzeroed {
                    assert!(dp.use_stale_buffers().unwrap());
                }
                let mut out = Vec::new();
                for step in 0..4u64 {
                    dp.begin_step().unwrap();
                    let stale = dp.stale_buckets();
                    for micro in 0..2 {
                        dp.before_backward(&ps).unwrap();
                        dp.arm_overlap(comm, micro == 1);
                        let k = (rank + 1) as f64 + step as f64 + micro as f64;
                        let x = (Tensor::arange(6, tch::kind::FLOAT_CPU).view([2, 3]) * k).cos().to_kind(Kind::BFloat16);
                        let y = if step == 2 && micro == 0 {
                            x.to_kind(Kind::Float).linear(&w, Some(&b))
                        } else {
                            crate::models::fused::reference_linear(&x, &w, Some(&b)).to_kind(Kind::Float)
                        };
                        let nothing = torch_ext::custom_op(NoGradient, &[&u]).unwrap().remove(0).sum(Kind::Float);
                        ((&y * &y).sum(Kind::Float) + (&v * &v * k).sum(Kind::Float) + nothing).backward();
                        dp.disarm_overlap();
                    }
                    dp.check_grads(&ps).unwrap();
                    dp.reduce(&ps, &mut AllReduce, comm, step, false).unwrap();
                    out.push((dp.grads().unwrap().iter().map(values).collect::<Vec<_>>(), stale));
                    tch::no_grad(|| {
                        // (ZeRO-2 has released its buffers.)
                        for g in torch_ext::grads(&ps).unwrap().into_iter().filter(Tensor::defined) {
                            let _ = g.shallow_clone().fill_(f64::NAN);
                        }
                    });
                }
                out
            })
        };
        for stage in [ZeroStage::None, ZeroStage::One, ZeroStage::Two] {
            let zeroed = run(false, stage);
            let unzeroed = run(true, stage);
            let grads = |r: &Vec<(Vec<Vec<f32>>, usize)>| r.iter().map(|s| s.0.clone()).collect::<Vec<_>>();
            // Bit for bit the zeroed buffers' averages.
            assert_eq!(grads(&unzeroed[0]), grads(&zeroed[0]), "{stage:?}");
            assert_eq!(grads(&unzeroed[1]), grads(&zeroed[1]), "{stage:?}");
            assert!(grads(&zeroed[0]).iter().flatten().flatten().all(|x| x.is_finite()), "{stage:?}");
            if stage == ZeroStage::None {
                assert_eq!(grads(&unzeroed[0]), grads(&unzeroed[1]));
                assert!(unzeroed[0].iter().all(|s| s.0[2].iter().all(|&x| x == 0.0)), "a gradient nothing wrote averages to zero");
            }
            // The first step zeroes both buckets and learns that autograd
            // writes v's; [w, b, u] stays unzeroed in the second and third
            // steps (where autograd's gradients for w and b found their
            // buffers zeroed by the hook), and is zeroed once autograd has
            // written there.
            let stale: Vec<usize> = unzeroed[0].iter().map(|s| s.1).collect();
            assert_eq!(stale, [0, 1, 1, 0], "{stage:?}");
            assert!(zeroed[0].iter().all(|s| s.1 == 0), "{stage:?}");
        }
    }

    #[test]
    fn a_bf16_reduction_averages_in_bf16_and_only_where_it_can() {
        let out = two_ranks(|rank, comm| {
            let ps = params(7);
            let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, rank, 2).unwrap();
            assert!(dp.enable_overlap(comm).unwrap());
            assert!(tch::no_grad(|| dp.use_local_grads(true)).unwrap());
            dp.reduce_in(Kind::BFloat16).unwrap();
            two_steps(&mut dp, &ps, rank, comm)
        });
        assert_eq!(out[0], out[1], "both ranks hold the same average");
        let reference = params(7);
        for k in [1.0, 2.0] {
            loss(&reference[..3], k).backward();
        }
        let want = torch_ext::grads(&reference[..3]).unwrap();
        for (step, (got, _)) in out[0].iter().enumerate() {
            for (g, w) in got.iter().zip(&want) {
                let w = values(&(w * (1.5 + step as f64)));
                // Rounded to bf16 (8 bits of mantissa), the fp32 gradients' average within it.
                let bf16 = values(&Tensor::from_slice(g).to_kind(Kind::BFloat16).to_kind(Kind::Float));
                assert_eq!(g, &bf16, "step {step}: the average is a bf16 value");
                assert!(g.iter().zip(&w).all(|(a, b)| (a - b).abs() <= 2e-2 * b.abs().max(0.1)), "step {step}: {g:?} vs {w:?}");
            }
        }
        // Where the flat buffers or ZeRO reduce, it is refused by name.
        let refused = two_ranks(|rank, comm| {
            let ps = params(7);
            let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::One, rank, 2).unwrap();
            assert!(dp.enable_overlap(comm).unwrap());
            dp.reduce_in(Kind::BFloat16).unwrap_err().to_string()
        });
        assert!(refused[0].contains("`reduce_dtype = \"bf16\"` needs the all-reduce that overlaps"), "{}", refused[0]);
    }

    #[test]
    fn zero_reduce_scatters_from_the_hooks_as_after_the_pass() {
        // ZeRO-1 and -2 on two ranks, two steps of two micro-batches, with
        // the reduce-scatters started from the gradient hooks or after the
        // pass: the same chunks bit for bit, and ZeRO-2 holds no full
        // buffer afterwards either way.
        for stage in [ZeroStage::One, ZeroStage::Two] {
            let run = move |overlap: bool| {
                two_ranks(move |rank, comm| {
                    let ps = params(6);
                    let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), stage, rank, 2).unwrap();
                    if overlap {
                        assert!(dp.enable_overlap(comm).unwrap());
                    }
                    two_steps(&mut dp, &ps, rank, comm)
                })
            };
            let (after, hooked) = (run(false), run(true));
            assert_eq!(after, hooked, "{stage:?}");
            if stage == ZeroStage::Two {
                // Only the chunks: 4 bytes x (8 + 6 + 5) on each rank.
                assert!(hooked.iter().flatten().all(|(_, bytes)| *bytes == 4 * (8 + 6 + 5)), "{hooked:?}");
            }
        }
        // ZeRO-1 with its buffers in the collective's symmetric memory (plain
        // memory on thread ranks), each reduce-scattered in place: the same
        // chunks, and the chunks no memory of their own.
        let run = |symmetric: bool| {
            two_ranks(move |rank, comm| {
                let ps = params(6);
                let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::One, rank, 2).unwrap();
                assert!(!tch::no_grad(|| dp.use_symmetric_zero_grads(comm)).unwrap(), "it needs the overlap");
                assert!(dp.enable_overlap(comm).unwrap());
                if symmetric {
                    assert!(tch::no_grad(|| dp.use_symmetric_zero_grads(comm)).unwrap());
                    assert_eq!(dp.outside_allocator_bytes(), 4 * (16 + 12 + 10), "the buffers lie outside libtorch's allocator");
                }
                two_steps(&mut dp, &ps, rank, comm)
            })
        };
        let (plain, symmetric) = (run(false), run(true));
        for (p, s) in plain.iter().flatten().zip(symmetric.iter().flatten()) {
            assert_eq!(p.0, s.0, "the reduced chunks");
            assert_eq!(p.1, s.1 + 4 * (8 + 6 + 5), "the gradient bytes: the buffers, without the chunks again");
        }
        let refused = two_ranks(|rank, comm| {
            let ps = params(6);
            let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::Two, rank, 2).unwrap();
            assert!(dp.enable_overlap(comm).unwrap());
            tch::no_grad(|| dp.use_symmetric_zero_grads(comm)).unwrap()
        });
        assert_eq!(refused, [false, false], "ZeRO-2 releases its buffers every step");
    }

    #[test]
    fn zero2_lets_go_of_its_buffers_after_the_reduction() {
        // The overlap's hooks keep references to the buffers they reduce
        // during the backward pass; after the reduction nothing may hold a
        // released buffer, or it outlives its release (memory held through
        // the update, the forward pass and the next allocation).
        let held = two_ranks(|rank, comm| {
            let ps = params(6);
            let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::Two, rank, 2).unwrap();
            assert!(dp.enable_overlap(comm).unwrap());
            let mut held = Vec::new();
            for step in 0..2 {
                dp.begin_step().unwrap();
                dp.before_backward(&ps).unwrap();
                dp.arm_overlap(comm, true);
                (loss(&ps, 1.0) * (rank as f64 + 1.0)).backward();
                dp.disarm_overlap();
                dp.check_grads(&ps).unwrap();
                dp.reduce(&ps, &mut AllReduce, comm, step, false).unwrap();
                assert!(dp.buckets.iter().all(|b| b.grad.is_none()), "released");
                let o = dp.overlap.as_ref().unwrap();
                held.push(o.state.lock().unwrap().flats.len());
                dp.gather_params(comm).unwrap();
            }
            held
        });
        assert_eq!(held, [[0, 0], [0, 0]], "buffers still referenced after their release");
    }

    #[test]
    fn a_compressor_that_returns_a_new_tensor_still_reaches_the_gradients() {
        struct Sevens;
        impl Compressor for Sevens {
            fn reduce(
                &mut self,
                bucket: &mut Tensor,
                _comm: &mut dyn Collective,
                _ctx: &harness_sandbox::strategy::BucketCtx,
            ) -> anyhow::Result<()> {
                *bucket = bucket.ones_like() * 7.0;
                Ok(())
            }
        }
        let out = two_ranks(|rank, comm| {
            let ps = params(4);
            let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 1 << 20), ZeroStage::None, rank, 2).unwrap();
            dp.begin_step().unwrap();
            dp.before_backward(&ps).unwrap();
            loss(&ps, 1.0).backward();
            dp.reduce(&ps, &mut Sevens, comm, 0, false).unwrap();
            torch_ext::grads(&ps).unwrap().iter().flat_map(values).collect::<Vec<f32>>()
        });
        for g in out {
            assert!(g.iter().all(|&x| x == 7.0), "{g:?}");
        }
    }

    #[test]
    fn sharded_clipping_uses_the_global_norm() {
        // Rank 0 holds [3], rank 1 holds [4]: the global norm is 5.
        let out = two_ranks(|rank, comm| {
            let g = Tensor::from_slice(&[3.0f32 + rank as f32]);
            let norm = global_norm(&[g.shallow_clone()], comm, Device::Cpu).unwrap();
            scale_to_norm(&[g.shallow_clone()], &norm, 1.0);
            (norm.double_value(&[]), g.double_value(&[0]))
        });
        assert!((out[0].0 - 5.0).abs() < 1e-6 && (out[1].0 - 5.0).abs() < 1e-6);
        assert!((out[0].1 - 0.6).abs() < 1e-5 && (out[1].1 - 0.8).abs() < 1e-5, "{out:?}");
    }
}
