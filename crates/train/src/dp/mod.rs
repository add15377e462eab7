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

mod overlap;
pub mod plan;
mod zero;

use tch::{Device, Kind, Tensor};

use harness_kernels::torch_ext;
use harness_runtime::comm::Collective;
use harness_sandbox::strategy::{BucketLayout, Compressor, ParamSlot};
use overlap::{reducible_grads, start_average, Overlap, StaleBuffers};
pub use plan::ZeroStage;

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
    /// Buffers left unzeroed between steps ([`DataParallel::use_stale_buffers`]).
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

    /// What each bucket holds, in the order the compressor gets them: its
    /// parameters' names (`names`, indexed as `params`), shapes and
    /// offsets (the WIT `bucket-layout`).
    pub fn layouts(&self, names: &[String], params: &[Tensor]) -> Vec<BucketLayout> {
        self.buckets
            .iter()
            .map(|b| BucketLayout {
                numel: b.padded as u64,
                params: b
                    .params
                    .iter()
                    .zip(&b.offsets)
                    .map(|(&i, &off)| {
                        let shape: Vec<u64> = params[i].size().iter().map(|&d| d as u64).collect();
                        ParamSlot {
                            name: names[i].clone(),
                            numel: shape.iter().product(),
                            weight: shape.len() >= 2,
                            shape,
                            offset: off as u64,
                            dtype: b.kind,
                        }
                    })
                    .collect(),
            })
            .collect()
    }

    /// Whether optimizer state and gradients are sharded (ZeRO).
    pub fn sharded(&self) -> bool {
        self.stage.sharded()
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
    /// buffers of the split average (`Gradients::Split`; ZeRO-1's of
    /// `symmetric_grads`) and ZeRO's symmetric parameter buffers (its
    /// prefetch's), held for the whole run.
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
mod tests;
