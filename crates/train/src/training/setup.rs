//! What trains: an entry's model, parameters, data, data-parallel buckets,
//! optimizer, loss scaler, strategies and precision, set up in the order
//! that makes every rank start from the same state.

use anyhow::Result;
use tch::{nn, Device, Kind, Tensor};

use super::{Evaluation, Training};
use crate::data::Data;
use crate::dp::{self, DataParallel};
use crate::entry::EntryContext;
use crate::models::{self as model, Model, ModelConfig};
use crate::oom::OomGuard;
use crate::optim::{LossScaler, Optimizer};
use harness_format::suite::{Kernels, Precision, Recompute};
use harness_kernels::kernels;
use harness_kernels::torch_ext::{self, AutocastDevice};
use harness_runtime::comm::Collective;
use harness_sandbox::strategy::Strategies;

/// Turns autocast off again when an entry ends, however it ends.
pub struct AutocastGuard {
    device: Option<AutocastDevice>,
    /// Whether [`AutocastGuard::paused`] turns it off (read once).
    pause_backward: bool,
}

impl AutocastGuard {
    fn set(device: Device, precision: Precision) -> Result<AutocastGuard> {
        let ac = if device.is_cuda() { AutocastDevice::Cuda } else { AutocastDevice::Cpu };
        let pause_backward = !harness_format::switches::get().autocast_backward;
        let kind = match precision {
            Precision::Fp32 => return Ok(AutocastGuard { device: None, pause_backward }),
            Precision::Bf16 => Kind::BFloat16,
            Precision::Fp16 => Kind::Half,
        };
        torch_ext::set_autocast(ac, Some(kind))?;
        Ok(AutocastGuard { device: Some(ac), pause_backward })
    }

    pub fn on(&self) -> bool {
        self.device.is_some()
    }

    /// Autocast off until the returned guard goes: for the backward pass,
    /// which runs with the state of the thread that starts it (the autograd
    /// engine carries the caller's thread-local state to its device
    /// threads). torch.autocast covers the forward pass only, so under it
    /// a backward op runs in the dtypes autograd saved; left on, autocast
    /// would cast again where PyTorch does not (T5's math attention ran its
    /// fp32 gradient matmuls in bf16 behind 72 casts of [256, 513, 513]
    /// tensors a step). Recomputed blocks restore the forward pass's state
    /// themselves. `HARNESS_AUTOCAST_BACKWARD=1` leaves it on (as before
    /// 2026-11-25), to measure the difference.
    pub fn paused(&self) -> Result<AutocastPause> {
        let on = self.device.filter(|_| self.pause_backward);
        if let Some(d) = on {
            torch_ext::set_autocast_enabled(d, false)?;
        }
        Ok(AutocastPause(on))
    }
}

/// Turns autocast back on when it goes ([`AutocastGuard::paused`]).
pub struct AutocastPause(Option<AutocastDevice>);

impl Drop for AutocastPause {
    fn drop(&mut self) {
        if let Some(d) = self.0 {
            let _ = torch_ext::set_autocast_enabled(d, true);
        }
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        if let Some(d) = self.device {
            let _ = torch_ext::set_autocast(d, None);
        }
    }
}

impl Training {
    /// Sets up an entry on this rank: every rank's model starts from rank
    /// 0's parameters; each rank draws its own samples.
    pub fn new(ctx: &EntryContext<'_>, comm: &mut dyn Collective) -> Result<Training> {
        // Gathers that an entry before this one on this thread left in
        // flight (it failed between an update and its next forward pass)
        // belong to its collective: dropped, never waited for.
        crate::gate::forget();
        let w = ctx.workload;
        let device = ctx.device;
        let (rank, world) = (comm.rank(), comm.world_size());
        let Replica { cfg, mut data, vs, mut model, names, params, buffers } = Replica::new(ctx, comm)?;
        let n_params: i64 = params.iter().map(|p| p.numel() as i64).sum();
        let mut strategies =
            Strategies::build(&ctx.entry.strategy, w.batch, w.grad_accum, ctx.plugins, device, w.precision != Precision::Fp16)?;
        let oom =
            OomGuard::new(w.faults.as_ref().and_then(|f| f.oom_above_batch), ctx.plugins.has(&ctx.entry.strategy.batch_policy), world);
        let switches = harness_format::switches::get();
        let (dp_plan, dp) = data_parallel(ctx, comm, &mut strategies, &oom, (&vs, &names, &params))?;
        let (grad_stats, overlapped) = (dp_plan.grad_stats, dp_plan.overlapped(world));
        let (targets, decay) = dp.update_targets(&params);
        let mut optimizer = Optimizer::with_decay(&w.optimizer, &targets, &decay);
        let scaler = (w.precision == Precision::Fp16).then(|| LossScaler::new(device));
        // cuDNN's convolution algorithms: timed per input shape, or its
        // heuristics' choice (a process-wide libtorch setting, set for
        // every entry).
        if device.is_cuda() {
            tch::Cuda::cudnn_set_benchmark(w.cudnn_benchmark);
        }
        // Precision: autocast as torch.autocast does it; weights stay fp32.
        let autocast = AutocastGuard::set(device, w.precision)?;
        // Images in bf16 where the model's first layer (ResNet's stem, ViT's
        // patches: convolutions) would cast them under bf16 autocast: the
        // same values, a smaller batch (HARNESS_BF16_IMAGES=0 keeps fp32).
        let family = model::family(cfg.kind);
        if device.is_cuda() && w.precision == Precision::Bf16 && family.bf16_images() && switches.bf16_images {
            data.images_in(Kind::BFloat16);
        }
        let (fused, mut warnings) = fused_kernels(device, w.precision, w.kernels);
        warnings.extend(dp_plan.warnings);
        // HARNESS_FUSED_CE=0 keeps libtorch's cross-entropy under the fused
        // kernels (a diagnostic, to tell the kernels' effects apart).
        // The fused cross-entropy serves the token models (gpt, mlp, t5).
        let fused_ce = fused && family.fused_cross_entropy() && switches.fused_ce;
        model.use_fused_kernels(fused);
        // AdamW through harness's kernel with the fused kernels
        // (HARNESS_FUSED_ADAMW=0 keeps libtorch's, a diagnostic).
        optimizer.use_own_kernel(fused && switches.fused_adamw);
        // The step as a CUDA graph where the workload asks for it
        // (`cuda_graph = true`); HARNESS_CUDA_GRAPH=1 or 0 overrides the
        // suite, to measure what graphs buy with the same suite.
        let graph = super::graph::Eligibility {
            cuda: device.is_cuda(),
            world,
            local_grads: dp.local(),
            loss_scaling: scaler.is_some(),
            grad_stats,
            emulated_memory_limit: oom.limit.is_some(),
            recompute: w.recompute()? != Recompute::None,
            family_checked: family.graph_checked(),
        }
        .graph(switches.cuda_graph.unwrap_or(w.cuda_graph), &mut warnings);
        let eval_set = data.eval_set(w.eval_batches as usize, w.batch as usize);
        Ok(Training {
            cfg,
            _vs: vs,
            model,
            names,
            params,
            buffers,
            n_params,
            data,
            eval_set,
            dp,
            targets,
            optimizer,
            scaler,
            strategies,
            device,
            rank,
            world,
            precision: w.precision,
            grad_clip: w.grad_clip,
            autocast,
            fused_ce,
            grad_stats,
            overlapped,
            oom,
            gradient_bytes: 0,
            stats_in_flight: None,
            warnings,
            graph,
            graph_replays: 0,
        })
    }

    /// Whether parameters and gradients are sharded across ranks (ZeRO).
    pub fn sharded(&self) -> bool {
        self.dp.sharded()
    }

    /// Gradient bucket sizes (for results of multi-rank entries).
    pub fn bucket_bytes(&self) -> Vec<u64> {
        self.dp.bucket_bytes()
    }

    /// The buckets the last step left unzeroed (none: absent).
    pub fn unzeroed_buckets(&self) -> Option<u32> {
        Some(self.dp.stale_buckets() as u32).filter(|&n| n > 0)
    }

    /// Whether the model classifies (its evaluations report accuracy).
    pub fn classifies(&self) -> bool {
        self.cfg.family().classifies()
    }

    /// Mean loss over the fixed eval set (no gradients, no dropout, batch
    /// norm with its running statistics) and, for a classifier, the share
    /// of eval samples whose largest logit is their label's (top-1
    /// accuracy).
    pub fn evaluate(&self) -> Result<Evaluation> {
        let mut total: Option<Tensor> = None;
        let mut correct: Option<Tensor> = None;
        let mut samples = 0i64;
        for b in &self.eval_set {
            let b = b.to_device(self.device);
            let (l, hits) = tch::no_grad(|| match self.model.forward(&b.input, &b.target, false) {
                model::Output::Logits { logits, target } => {
                    let hits = self.classifies().then(|| logits.argmax(-1, false).eq_tensor(&target).sum(Kind::Int64));
                    (model::token_loss(&logits, &target), hits)
                }
                model::Output::Loss(l) => (l, None),
            });
            let l = l.to_kind(Kind::Double);
            samples += b.samples as i64;
            if self.autocast.on() {
                torch_ext::autocast_clear_cache()?;
            }
            total = Some(match total {
                Some(t) => t + l,
                None => l,
            });
            if let Some(h) = hits {
                correct = Some(match correct {
                    Some(c) => c + h,
                    None => h,
                });
            }
        }
        let loss = total.map_or(f64::NAN, |t| t.double_value(&[]) / self.eval_set.len() as f64);
        let accuracy = correct.map(|c| c.int64_value(&[]) as f64 / samples.max(1) as f64);
        Ok(Evaluation { loss, accuracy })
    }
}

/// An entry's model and data on this rank, as every rank starts it.
struct Replica {
    cfg: ModelConfig,
    data: Data,
    vs: nn::VarStore,
    model: Model,
    names: Vec<String>,
    params: Vec<Tensor>,
    buffers: Vec<(String, Tensor)>,
}

impl Replica {
    /// The model resolved from the workload and initialised from the
    /// entry's seed, its variables broadcast from rank 0 so every rank
    /// starts from rank 0's; the data stream, each rank drawing its own
    /// samples.
    fn new(ctx: &EntryContext<'_>, comm: &mut dyn Collective) -> Result<Replica> {
        let w = ctx.workload;
        // The encoder reads vectors of its own width.
        let mut cfg = ModelConfig::resolve(&w.model, w.data.vocab().unwrap_or(2), w.seq_len).map_err(|(m, _)| anyhow::anyhow!(m))?;
        if let harness_format::suite::DataSpec::Images { channels, image_size, .. } = &w.data {
            cfg.image = Some([i64::from(*channels), i64::from(*image_size)]);
        }
        let rank = comm.rank();
        let data_seed = if rank == 0 { ctx.entry.seed } else { harness_format::suite::mix_seed(ctx.entry.seed, "rank", rank as u32) };
        let data = Data::new(&w.data, ctx.suite_dir, w.seq_len as usize, cfg.d_model as usize, data_seed, ctx.device)?;
        let (vs, model, names, params, buffers) = init_model(&cfg, w.recompute()?, ctx.entry.seed, ctx.device);
        if comm.world_size() > 1 {
            tch::no_grad(|| -> Result<()> {
                for p in params.iter().chain(buffers.iter().map(|b| &b.1)) {
                    comm.broadcast(&mut p.shallow_clone(), 0)?;
                }
                Ok(())
            })?;
        }
        Ok(Replica { cfg, data, vs, model, names, params, buffers })
    }
}

/// The data-parallel path (dp::plan): gradients in flat buckets (views
/// into one buffer per bucket, DDP's gradient_as_bucket_view) handed to
/// the compressor as they are, on one rank too (the compressor's cost is
/// part of the strategy); autograd's own gradients with the built-in
/// average; optionally sharded (ZeRO). A batch policy that asks for them
/// (`wants-gradient-stats`, asked once here) gets gradient statistics (the
/// two-batch-size estimate of the gradient noise scale needs the local and
/// the averaged gradient's squared norms), which turns the overlap off and
/// costs a norm pass and a read-back a step. The compressor learns what its
/// buckets hold before any state is loaded into it (contract 0.2's
/// `setup`).
fn data_parallel(
    ctx: &EntryContext<'_>,
    comm: &mut dyn Collective,
    strategies: &mut Strategies,
    oom: &OomGuard,
    (vs, names, params): (&nn::VarStore, &[String], &[Tensor]),
) -> Result<(dp::plan::DpPlan, DataParallel)> {
    let ask = dp::plan::Ask {
        world: comm.world_size(),
        cuda: ctx.device.is_cuda(),
        zero: dp::ZeroStage::from_level(ctx.entry.strategy.zero)?,
        plain_average: strategies.compressor.is_plain_average(),
        reduce_bf16: ctx.entry.strategy.reduce_dtype == harness_format::suite::ReduceDtype::Bf16,
        ce_candidate: ctx.entry.strategy.copy_engine_gather_candidate(),
        grad_stats: strategies.batch.wants_gradient_stats()?,
        oom_agree: oom.agree,
        comm: comm.capabilities(),
        levers: dp::plan::Levers::of(harness_format::switches::get()),
    };
    let plan = dp::plan::DpPlan::new(&ask)?;
    let buckets = bucket_plan(vs, params, ctx.bucket_bytes);
    let dp = DataParallel::new(params, &buckets, &plan, comm)?;
    strategies.compressor.setup(&dp.layouts(names, params))?;
    Ok((plan, dp))
}

/// How many of the last gradient buckets are smaller (a half, a quarter,
/// an eighth of the bucket size), so that little is left to reduce after
/// the backward pass. Fixed since its switch left (results/retired-levers/):
/// whole last buckets measured within 1%, and the committed CPU bundles'
/// compressors saw these layouts.
const TAIL_BUCKETS: u32 = 3;

/// The gradient buckets: at most `bucket_bytes` each (else
/// [`DataParallel::auto_bucket_bytes`]), filled in the order the backward
/// pass finishes the gradients, the reverse of the model's creation order,
/// the last [`TAIL_BUCKETS`] smaller.
fn bucket_plan(vs: &nn::VarStore, params: &[Tensor], bucket_bytes: Option<u64>) -> dp::BucketPlan {
    let created: Vec<usize> = vs
        .trainable_variables()
        .iter()
        .filter_map(|t| params.iter().position(|p| p.data_ptr() == t.data_ptr() && p.size() == t.size()))
        .collect();
    let order = dp::ready_order(params.len(), &created);
    let max_bytes = bucket_bytes.unwrap_or_else(|| DataParallel::auto_bucket_bytes(params));
    dp::BucketPlan { order, max_bytes, tail: TAIL_BUCKETS }
}

/// What [`init_model`] makes: the store, the model, the parameters' names
/// and tensors, and the untrained state variables (buffers) by name.
type Initialised = (nn::VarStore, Model, Vec<String>, Vec<Tensor>, Vec<(String, Tensor)>);

/// The model from the entry's seed, parameters and buffers (variables that
/// need no gradient) each sorted by name. libtorch's generator is global to
/// the process: thread ranks take turns so that each initialisation sees
/// exactly the entry's seed.
fn init_model(cfg: &ModelConfig, recompute: Recompute, seed: u64, device: Device) -> Initialised {
    static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let (vs, model) = {
        let _turn = INIT.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(seed as i64);
        let vs = nn::VarStore::new(device);
        let model = Model::new(&vs.root(), cfg, recompute);
        (vs, model)
    };
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let (trained, buffers): (Vec<_>, Vec<_>) = named.into_iter().partition(|(_, t)| t.requires_grad());
    let (names, params) = trained.into_iter().unzip();
    (vs, model, names, params, buffers)
}

/// Whether harness's fused kernels (bf16 on CUDA: cross-entropy, residual
/// add + LayerNorm) serve this entry, and a warning when they should and
/// cannot.
fn fused_kernels(device: Device, precision: Precision, wanted: Kernels) -> (bool, Vec<String>) {
    let eligible = device.is_cuda() && precision == Precision::Bf16 && wanted == Kernels::Fused;
    let fused = eligible && kernels::available();
    let mut warnings = Vec::new();
    if eligible && !fused {
        if let Some(why) = kernels::unavailable_reason() {
            warnings.push(format!("fused kernels unavailable ({why}); using libtorch's operations"));
        }
    }
    (fused, warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The order in which a backward pass of the model `spec` (on CPU, over
    /// `input` as its own target) finishes its parameters' gradients, as
    /// indices into the parameters of [`init_model`], and its bucket plan
    /// at about a fifth of the gradients a bucket.
    fn arrivals(spec: &harness_format::suite::ModelSpec, vocab: u32, input: &Tensor) -> (Vec<usize>, dp::BucketPlan, Vec<Tensor>) {
        unsafe extern "C" fn arrived(ctx: *mut std::ffi::c_void, idx: i64) {
            // SAFETY: ctx is the mutex below, alive while the hooks are set.
            let v = unsafe { &*(ctx as *const std::sync::Mutex<Vec<usize>>) };
            v.lock().unwrap().push(idx as usize);
        }
        let cfg = ModelConfig::resolve(spec, vocab, input.size()[1] as u32).unwrap();
        let (vs, model, _, params, _) = init_model(&cfg, harness_format::suite::Recompute::None, 3, Device::Cpu);
        let total: u64 = params.iter().map(harness_kernels::torch_ext::nbytes).sum();
        let plan = bucket_plan(&vs, &params, Some(total / 5));
        let seen = std::sync::Mutex::new(Vec::new());
        let ctx = &seen as *const _ as *mut std::ffi::c_void;
        for (i, p) in params.iter().enumerate() {
            // SAFETY: `seen` outlives the hooks, removed below.
            unsafe { harness_kernels::torch_ext::set_grad_ready_hook(p, Some(arrived), ctx, i as i64).unwrap() };
        }
        model.loss(input, input, true).backward();
        for p in &params {
            // SAFETY: removing the hook.
            unsafe { harness_kernels::torch_ext::set_grad_ready_hook(p, None, std::ptr::null_mut(), 0).unwrap() };
        }
        (seen.into_inner().unwrap(), plan, params)
    }

    /// Whether `buckets` complete in their order when gradients arrive in
    /// `arrived`'s: each bucket's last gradient before the next bucket's last.
    fn complete_in_order(buckets: &[Vec<usize>], arrived: &[usize]) -> bool {
        let at = |i: &usize| arrived.iter().position(|a| a == i).expect("every parameter's gradient arrives");
        let last: Vec<usize> = buckets.iter().map(|b| b.iter().map(at).max().unwrap()).collect();
        last.windows(2).all(|w| w[0] < w[1])
    }

    #[test]
    fn gradient_buckets_complete_in_their_order_in_a_gpts_backward_pass() {
        // Twelve layers: by name, layer 10 would come between 1 and 2, and
        // the position table beside the final norm (a bucket that waits for
        // the end of the pass); the tied token table is finished last.
        let _turn = harness_kernels::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let spec = harness_format::suite::ModelSpec {
            kind: harness_format::suite::ModelKind::Gpt,
            preset: Some("tiny".into()),
            n_layer: Some(12),
            n_head: None,
            d_model: None,
            d_ff: None,
            dropout: None,
        };
        let input = Tensor::randint(64, [2, 8], (Kind::Int64, Device::Cpu));
        let (arrived, plan, params) = arrivals(&spec, 64, &input);
        assert_eq!(arrived.len(), params.len(), "one arrival per parameter");
        let buckets = dp::buckets_of(&params, &plan.order, plan.max_bytes, plan.tail);
        assert!(buckets.len() >= 5, "{} buckets", buckets.len());
        assert!(complete_in_order(&buckets, &arrived), "buckets {buckets:?}, arrivals {arrived:?}");
        // By name they would not.
        let by_name = dp::buckets_of(&params, &(0..params.len()).collect::<Vec<_>>(), plan.max_bytes, plan.tail);
        assert!(!complete_in_order(&by_name, &arrived));
        // The tied token table's gradient is finished last, and is last in
        // the order; the last bucket is the smallest.
        assert_eq!(arrived.last(), plan.order.last());
        let bytes = |b: &Vec<usize>| b.iter().map(|&i| harness_kernels::torch_ext::nbytes(&params[i])).sum::<u64>();
        assert!(buckets.iter().all(|b| bytes(b) >= bytes(buckets.last().unwrap())));
    }

    #[test]
    fn autocast_covers_the_forward_pass_and_pauses_for_the_backward_pass() {
        // Autocast is thread-local: this test's thread only.
        let (a, b) = (Tensor::ones([4, 4], tch::kind::FLOAT_CPU), Tensor::ones([4, 4], tch::kind::FLOAT_CPU));
        let guard = AutocastGuard::set(Device::Cpu, Precision::Bf16).unwrap();
        assert_eq!(a.matmul(&b).kind(), Kind::BFloat16, "autocast is on for the forward pass");
        {
            let _off = guard.paused().unwrap();
            assert_eq!(a.matmul(&b).kind(), Kind::Float, "autocast stayed on for the backward pass");
        }
        assert_eq!(a.matmul(&b).kind(), Kind::BFloat16, "autocast did not come back after the backward pass");
        drop(guard);
        assert_eq!(a.matmul(&b).kind(), Kind::Float);
        // fp32 runs have no autocast to pause.
        let fp32 = AutocastGuard::set(Device::Cpu, Precision::Fp32).unwrap();
        let _off = fp32.paused().unwrap();
        assert_eq!(a.matmul(&b).kind(), Kind::Float);
    }
}
