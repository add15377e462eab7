//! Linear layers as autograd nodes: [`linear`] (and [`tied_linear`], the
//! output layer through a tied embedding's table) and a GPT block's q, k, v
//! projection split into its heads ([`qkv`]).

use tch::{Kind, Tensor};

use harness_kernels::kernels;
use harness_kernels::torch_ext::{self, CustomOp};

use super::embedding::Tie;
use super::engine::{aligned, engine, reference_forced, Engine};
use super::gemm::{cast, input_grad, matmul, weight_grad_into_buffer};
use super::grad::Sums;

/// `x w^T + b` under bf16 autocast with the weight's cast and gradient
/// handled here: the autograd node behind [`linear`]. Inputs `[x, w, b?]`
/// (`x` `[n, in]`, `w` fp32 `[out, in]`, `b` fp32 `[out]`), output `[y]`
/// (bf16 `[n, out]`), kept `[bf16(x), bf16(w), w, b?]`.
struct Linear {
    engine: Engine,
    bias: bool,
    /// `x`'s kind, for its gradient.
    x_kind: Kind,
    /// The weight is also [`embed`](super::embed)'s table: without a gradient
    /// buffer, its gradient goes there, for the embedding's backward pass to add
    /// its rows into and hand to autograd.
    tie: Option<Tie>,
}

impl CustomOp for Linear {
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        let (y, kept) = linear_forward(self.engine, self.bias, inputs)?;
        Ok((vec![y], kept))
    }

    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let [dy] = grads else { anyhow::bail!("linear: {} gradients", grads.len()) };
        let Some(dy) = dy else { return Ok((1..saved.len()).map(|_| None).collect()) };
        let dy = dy.to_kind(Kind::BFloat16).contiguous();
        let engine = self.engine;
        linear_backward(engine, saved, &dy, self.x_kind, self.tie.as_ref(), || {
            Ok(match engine {
                Engine::Cuda => Sums::Partials(kernels::column_sums_bf16(&dy)?),
                Engine::Reference => Sums::Tensors(vec![dy.sum_dim_intlist(0, false, Kind::Float)]),
            })
        })
    }
}

/// The forward pass of a linear layer over `inputs` (`[x, w, b]` with a
/// `bias`, else `[x, w]`): `x w^T + b` in bf16, the bias in the matmul's
/// epilogue as autocast's addmm adds it, and what its backward pass keeps,
/// `[bf16(x), bf16(w), w, b?]`.
fn linear_forward(engine: Engine, bias: bool, inputs: &[Tensor]) -> anyhow::Result<(Tensor, Vec<Tensor>)> {
    let (x, w, b) = match (bias, inputs) {
        (true, [x, w, b]) => (x, w, Some(b)),
        (false, [x, w]) => (x, w, None),
        _ => anyhow::bail!("linear: {} inputs", inputs.len()),
    };
    let w16 = cast(engine, w)?;
    let x16 = x.to_kind(Kind::BFloat16).contiguous();
    let y = matmul(engine, &x16, &w16, b)?;
    let mut kept = vec![x16, w16, w.shallow_clone()];
    kept.extend(b.map(Tensor::shallow_clone));
    Ok((y, kept))
}

/// The backward pass of a linear layer that kept `[bf16(x), bf16(w), w, b?]`,
/// from its output's gradient `dy` (contiguous bf16 rows) and, with a bias, the
/// sums of `dy` over its rows (`bias_sums`): the gradients of `[x (as
/// `x_kind`), w, b?]`, the weight's and the bias's added into their buffers
/// where they have them ([`weight_grad_into_buffer`], [`Sums::deliver`]), the
/// weight's left at `tie` for a tied embedding.
fn linear_backward(
    engine: Engine,
    saved: &[Tensor],
    dy: &Tensor,
    x_kind: Kind,
    tie: Option<&Tie>,
    bias_sums: impl FnOnce() -> anyhow::Result<Sums>,
) -> anyhow::Result<Vec<Option<Tensor>>> {
    let (x16, w16, w, b) = match saved {
        [x16, w16, w] => (x16, w16, w, None),
        [x16, w16, w, b] => (x16, w16, w, Some(b)),
        _ => anyhow::bail!("linear: {} kept", saved.len()),
    };
    let dx = input_grad(engine, dy, w16)?.to_kind(x_kind);
    // The weight's gradient straight out of the matmul in fp32 (bf16
    // products, fp32 sums), where autocast's bf16 matmul rounds it to bf16
    // and a cast widens it again.
    let dw = weight_grad_into_buffer(engine, dy, x16, w)?;
    let dw = match (dw, tie) {
        (Some(dw), Some(tie)) => tie.put(dw),
        (dw, _) => dw,
    };
    let mut out = vec![Some(dx), dw];
    if let Some(b) = b {
        out.push(bias_sums()?.deliver(&[b])?.pop().flatten());
    }
    Ok(out)
}

/// A GPT block's q, k, v projection `x w^T + b` split into the heads' q, k
/// and v (`[batch, heads, t, d]` strided views of the projection, which
/// scaled-dot-product attention takes without a copy): the autograd node
/// behind [`qkv`]. Inputs `[x, w, b?]` as [`Linear`]'s, outputs `[q, k,
/// v]`, kept as [`Linear`]'s. Its backward pass writes q, k and v's
/// gradients side by side into the projection's and sums the bias's
/// gradient in the same pass ([`kernels::pack_qkv`]), where autograd's
/// backward of the split (a stack) and the bias's column sums read them
/// twice (about 0.3 ms per GPT-2 124M step on an H100).
struct QkvProj {
    engine: Engine,
    bias: bool,
    x_kind: Kind,
    /// Batch, sequence length and heads.
    shape: (i64, i64, i64),
}

impl CustomOp for QkvProj {
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        let (y, kept) = linear_forward(self.engine, self.bias, inputs)?;
        let (bt, t, heads) = self.shape;
        let d = y.size().last().copied().unwrap_or(0) / 3;
        let parts = y.view([bt, t, 3, heads, d / heads]).unbind(2);
        Ok((parts.iter().map(|p| p.transpose(1, 2)).collect(), kept))
    }

    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let [gq, gk, gv] = grads else { anyhow::bail!("qkv: {} gradients", grads.len()) };
        if gq.is_none() && gk.is_none() && gv.is_none() {
            return Ok((1..saved.len()).map(|_| None).collect());
        }
        let (bt, t, _) = self.shape;
        let d = saved[1].size()[0] / 3;
        // Each part's gradient as [b t, d] rows (SDPA's come in that layout:
        // no copy); a part without one is zeros.
        let rows = |g: &Option<Tensor>| -> Tensor {
            match g {
                Some(g) => g.to_kind(Kind::BFloat16).transpose(1, 2).contiguous().view([bt * t, d]),
                None => Tensor::zeros([bt * t, d], (Kind::BFloat16, saved[0].device())),
            }
        };
        let (q, k, v) = (rows(gq), rows(gk), rows(gv));
        let (dy, sums) = match self.engine {
            Engine::Cuda if aligned(&[&q, &k, &v]) && d % 8 == 0 => {
                let (dy, part) = kernels::pack_qkv(&q, &k, &v)?;
                (dy, Sums::Partials(part))
            }
            _ => {
                let dy = Tensor::cat(&[q, k, v], 1);
                let sums = Sums::Tensors(vec![dy.sum_dim_intlist(0, false, Kind::Float)]);
                (dy, sums)
            }
        };
        linear_backward(self.engine, saved, &dy, self.x_kind, None, || Ok(sums))
    }
}

/// A GPT block's q, k, v projection of `x` (`[batch, t, c]`) by `w` (fp32
/// `[3 c', c]`) and `b`, split into `heads` heads: `(q, k, v)`, each
/// `[batch, heads, t, c' / heads]`, as one autograd node ([`QkvProj`]).
/// Only on CUDA where [`qkv_cuda_fits`].
pub fn qkv(x: &Tensor, w: &Tensor, b: Option<&Tensor>, shape: (i64, i64, i64)) -> (Tensor, Tensor, Tensor) {
    qkv_with(Engine::Cuda, x, w, b, shape)
}

/// Whether [`qkv`] runs as one node on CUDA for projections of `c` (= 3 c')
/// outputs on this device. `HARNESS_FUSED_QKV=0` keeps a linear layer and
/// autograd's split (a diagnostic).
pub fn qkv_cuda_fits(c: i64, device: tch::Device) -> bool {
    harness_format::switches::get().fused_qkv && device.is_cuda() && kernels::available() && !reference_forced() && c % 24 == 0
}

/// [`qkv`]'s autograd node on `engine`.
pub(super) fn qkv_with(engine: Engine, x: &Tensor, w: &Tensor, b: Option<&Tensor>, shape: (i64, i64, i64)) -> (Tensor, Tensor, Tensor) {
    let inner = *x.size().last().expect("qkv takes rows");
    let x2 = x.reshape([-1, inner]);
    let mut inputs = vec![&x2, w];
    inputs.extend(b);
    let op = QkvProj { engine, bias: b.is_some(), x_kind: x.kind(), shape };
    let mut out = torch_ext::custom_op(op, &inputs).unwrap_or_else(|e| panic!("{e}")).into_iter();
    let mut next = || out.next().expect("qkv has three outputs");
    (next(), next(), next())
}

/// `x w^T + b` (a linear layer; `w` fp32 `[out, in]`, `x` `[.., in]`).
/// With the fused kernels (`fused`) on CUDA, one autograd node: the weight
/// cast to bf16 by one vectorised kernel, its gradient computed by the
/// matmul in fp32 and added into its gradient buffer
/// ([`GradBuffer`](super::grad::GradBuffer)) or handed to autograd, and the
/// bias's gradient summed by a kernel of harness's own. Else libtorch's
/// linear (autocast casts the weight).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, fused: bool) -> Tensor {
    if !(fused && w.device().is_cuda()) {
        return x.linear(w, b);
    }
    linear_with(engine(), x, w, b, None)
}

/// [`linear`]'s autograd node on the reference engine (any device), for the
/// tests of the code that keeps gradient buffers.
#[cfg(test)]
pub(crate) fn reference_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    linear_with(Engine::Reference, x, w, b, None)
}

/// [`linear`] without a bias through a weight that is also the table of the
/// [`embed`](super::embed) that gave `tie`: the output layer of a tied
/// embedding.
pub fn tied_linear(x: &Tensor, w: &Tensor, tie: Option<&Tie>, fused: bool) -> Tensor {
    match tie {
        Some(tie) if fused && w.device().is_cuda() => linear_with(engine(), x, w, None, Some(tie.clone())),
        _ => linear(x, w, None, fused),
    }
}

/// [`linear`]'s autograd node on `engine`.
pub(super) fn linear_with(engine: Engine, x: &Tensor, w: &Tensor, b: Option<&Tensor>, tie: Option<Tie>) -> Tensor {
    let mut shape = x.size();
    let inner = *shape.last().expect("linear takes rows");
    let x2 = x.reshape([-1, inner]);
    let mut inputs = vec![&x2, w];
    inputs.extend(b);
    let op = Linear { engine, bias: b.is_some(), x_kind: x.kind(), tie };
    let out = torch_ext::custom_op(op, &inputs).unwrap_or_else(|e| panic!("{e}"));
    *shape.last_mut().expect("linear takes rows") = w.size()[0];
    out[0].view(shape.as_slice())
}
