//! The fused layers' matmuls (cuBLASLt's where it takes the operands,
//! libtorch's elsewhere) and the step's bf16 casts of the weights they read
//! ([`WeightCasts`]).

use tch::{Kind, Tensor};

use harness_kernels::kernels;

use super::engine::{aligned, Engine};
use super::grad::GradBuffer;

/// `x` as contiguous bf16 rows starting 16-byte aligned (cuBLASLt's
/// epilogue matmuls take no other): a copy where a view starts elsewhere.
pub(super) fn aligned_rows(x: &Tensor) -> Tensor {
    let x = x.to_kind(Kind::BFloat16).contiguous();
    if aligned(&[&x]) {
        x
    } else {
        x.copy()
    }
}

/// `w` as bf16 for a matmul: this step's cast ([`WeightCasts`]) where there
/// is one, else cast here (the vectorised kernel on CUDA).
pub(super) fn cast(engine: Engine, w: &Tensor) -> anyhow::Result<Tensor> {
    Ok(match engine {
        Engine::Cuda => match WeightCasts::get(w) {
            Some(c) => c,
            None => kernels::cast_bf16(w)?,
        },
        Engine::Reference => w.to_kind(Kind::BFloat16),
    })
}

/// The bf16 casts of the step's weights, made in one launch per 48 weights
/// before its first forward pass ([`WeightCasts::new`]) where each linear
/// layer cast its own (49 launches per step for GPT-2 124M, 0.35 ms on an
/// H100), and dropped with the guard after the last backward pass. A cast
/// is found by the weight's address and shape; the weights do not change
/// between a step's passes (the optimizer runs after them).
static CASTS: std::sync::Mutex<Option<Casts>> = std::sync::Mutex::new(None);

/// A step's casts by weight (address and shape).
type Casts = std::collections::HashMap<(usize, Vec<i64>), Tensor>;

/// The guard of a step's weight casts (see [`CASTS`]).
pub struct WeightCasts(());

impl WeightCasts {
    /// Casts every 2-d fp32 CUDA tensor of `params` (the weights the fused
    /// linear layers read; others are not looked up) for this step.
    /// Weights still being gathered ([`crate::gate`]) are cast as their
    /// layers wait for them ([`params_ready`]).
    pub fn new(params: &[Tensor]) -> anyhow::Result<WeightCasts> {
        let ready: Vec<Tensor> = params.iter().filter(|p| !crate::gate::pending(p)).map(Tensor::shallow_clone).collect();
        *CASTS.lock().unwrap_or_else(|e| e.into_inner()) = Some(Casts::new());
        Self::add(&ready)?;
        Ok(WeightCasts(()))
    }

    /// Casts the 2-d fp32 CUDA tensors of `params` into this step's casts,
    /// if the step has them.
    fn add(params: &[Tensor]) -> anyhow::Result<()> {
        let ws: Vec<Tensor> =
            params.iter().filter(|p| p.dim() == 2 && p.kind() == Kind::Float && p.device().is_cuda()).map(Tensor::shallow_clone).collect();
        if ws.is_empty() {
            return Ok(());
        }
        let mut casts = CASTS.lock().unwrap_or_else(|e| e.into_inner());
        let Some(map) = casts.as_mut() else { return Ok(()) };
        for (w, c) in ws.iter().zip(kernels::cast_bf16_list(&ws)?) {
            map.insert((w.data_ptr() as usize, w.size()), c);
        }
        Ok(())
    }

    fn get(w: &Tensor) -> Option<Tensor> {
        let casts = CASTS.lock().unwrap_or_else(|e| e.into_inner());
        casts.as_ref()?.get(&(w.data_ptr() as usize, w.size())).map(Tensor::shallow_clone)
    }
}

/// Before a layer reads `params`: the device waits for the gathers of
/// their buckets still in flight ([`crate::gate`], ZeRO's prefetch), and
/// the weights those buckets hold join the step's casts. Nothing to do
/// where no gather is in flight.
pub fn params_ready(params: &[&Tensor]) {
    let arrived = crate::gate::before(params).unwrap_or_else(|e| panic!("waiting for the parameters' all-gather failed: {e:#}"));
    if !arrived.is_empty() {
        WeightCasts::add(&arrived).unwrap_or_else(|e| panic!("casting the gathered weights failed: {e:#}"));
    }
}

impl Drop for WeightCasts {
    fn drop(&mut self) {
        *CASTS.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// Whether bf16 operands go to [`harness_kernels::blaslt`]'s matmuls (algorithms
/// timed per problem) rather than libtorch's: on CUDA where they are
/// available, for contiguous 16-byte aligned operands.
fn lt(engine: Engine, ts: &[&Tensor]) -> bool {
    engine == Engine::Cuda
        && harness_kernels::blaslt::matmuls_available()
        && ts.iter().all(|t| t.kind() == Kind::BFloat16 && t.is_contiguous())
        && aligned(ts)
}

/// `x w^T (+ b)` in bf16 for bf16 `x` `[n, k]` and `w` `[o, k]`, the bias
/// (fp32 `[o]`) rounded to bf16 and added in the matmul's epilogue, as
/// autocast's addmm does.
pub(super) fn matmul(engine: Engine, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> anyhow::Result<Tensor> {
    if lt(engine, &[x, w]) {
        return harness_kernels::blaslt::linear(x, w, b);
    }
    Ok(match b {
        Some(b) => b.to_kind(Kind::BFloat16).f_addmm(x, &w.tr())?,
        None => x.f_mm(&w.tr())?,
    })
}

/// `dy w` in bf16: the input's gradient of [`matmul`].
pub(super) fn input_grad(engine: Engine, dy: &Tensor, w: &Tensor) -> anyhow::Result<Tensor> {
    if lt(engine, &[dy, w]) {
        return harness_kernels::blaslt::input_grad(dy, w);
    }
    Ok(dy.f_mm(w)?)
}

/// A weight's gradient `dy^T x` in fp32 straight out of the matmul (bf16
/// products, fp32 sums).
fn weight_grad(engine: Engine, dy: &Tensor, x: &Tensor) -> anyhow::Result<Tensor> {
    if lt(engine, &[dy, x]) {
        return harness_kernels::blaslt::weight_grad(dy, x);
    }
    Ok(match engine {
        Engine::Cuda => dy.tr().f_mm_dtype(x, Kind::Float)?,
        Engine::Reference => dy.to_kind(Kind::Float).tr().f_mm(&x.to_kind(Kind::Float))?,
    })
}

/// The gradient of weight `w` (`dy^T x`, [`weight_grad`]) added into its
/// gradient buffer ([`GradBuffer`]; none for autograd), or handed to autograd
/// where `w` has none. Where the matmul runs in cuBLASLt and the buffer is
/// aligned, the matmul adds into the buffer itself (its epilogue reads it: the
/// same fp32 sum and rounding), without a temporary and a pass of its own for
/// the add (a flat gradient buffer under ZeRO, or a later micro-batch's
/// backward pass under gradient accumulation).
pub(super) fn weight_grad_into_buffer(engine: Engine, dy: &Tensor, x: &Tensor, w: &Tensor) -> anyhow::Result<Option<Tensor>> {
    let Some(b) = GradBuffer::claim(w) else { return Ok(Some(weight_grad(engine, dy, x)?)) };
    if lt(engine, &[dy, x]) && aligned(&[b.tensor()]) {
        // The step's first gradient for the buffer: beta = 0.
        harness_kernels::blaslt::weight_grad_into(dy, x, b.tensor(), !b.first())?;
    } else {
        b.store(&weight_grad(engine, dy, x)?)?;
    }
    Ok(None)
}
