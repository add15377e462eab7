//! The convolutional networks' layers: training-mode batch norm with its
//! residual add and ReLU ([`batch_norm_act`]), max pooling ([`max_pool`]),
//! and the channels-last layout both run in.

use tch::{Kind, Tensor};

use harness_kernels::kernels::{self, Pool};
use harness_kernels::torch_ext::{self, CustomOp};

use super::engine::{reference_forced, Engine};

/// Training-mode batch norm, then a residual added and ReLU where asked:
/// the autograd node behind [`batch_norm_act`]. Inputs `[x, w, b, res?]`
/// (`x` and `res` `[n, c, h, w]`), output `[y]`, kept `[x, mask, mean,
/// rstd, w]`: on CUDA `x` as its channels-last rows `[n h w, c]` and the
/// ReLU's bit mask ([`kernels::BatchNormOut::relu_mask`]), in the reference
/// `x` and `y` for its mask; without the ReLU an empty tensor for the mask,
/// so that a shortcut's batch norm does not hold its output.
struct BatchNormAct {
    engine: Engine,
    relu: bool,
    residual: bool,
    /// The running mean and variance, updated by the forward pass (in a
    /// mutex: a node is shared with autograd's threads).
    running: std::sync::Mutex<Option<(Tensor, Tensor)>>,
    momentum: f64,
    eps: f64,
}

/// The rows `[n h w, c]` of a channels-last `[n, c, h, w]` tensor (a view;
/// a copy for another layout).
fn nhwc_rows(t: &Tensor) -> Tensor {
    let c = t.size()[1];
    t.permute([0, 2, 3, 1]).contiguous().view([-1, c])
}

/// `[n, c, h, w]` (channels-last strides) over rows `[n h w, c]`.
fn from_nhwc_rows(rows: &Tensor, shape: &[i64]) -> Tensor {
    let [n, c, h, w] = shape else { panic!("batch norm takes [n, c, h, w]") };
    rows.view([*n, *h, *w, *c]).permute([0, 3, 1, 2])
}

impl BatchNormAct {
    /// What the reference's backward pass keeps for the ReLU's mask: `y`;
    /// without the ReLU nothing (an empty tensor).
    fn mask_of(&self, y: &Tensor) -> Tensor {
        if self.relu {
            y.shallow_clone()
        } else {
            no_mask(y)
        }
    }

    /// The reference forward pass over `[n, c, h, w]`: `(y, mean, rstd)`.
    fn reference_forward(&self, x: &Tensor, w: &Tensor, b: &Tensor, res: Option<&Tensor>) -> (Tensor, Tensor, Tensor) {
        let c = x.size()[1];
        let per_channel = |t: &Tensor| t.view([1, c, 1, 1]);
        let x32 = x.to_kind(Kind::Float);
        let mean = x32.mean_dim([0i64, 2, 3].as_slice(), false, Kind::Float);
        let centred = &x32 - per_channel(&mean);
        let var = centred.square().mean_dim([0i64, 2, 3].as_slice(), false, Kind::Float);
        let rstd = (&var + self.eps).rsqrt();
        let mut y = centred * per_channel(&(&rstd * w)) + per_channel(b);
        if let Some(r) = res {
            y += r.to_kind(Kind::Float);
        }
        if self.relu {
            y = y.relu();
        }
        if let Some((rm, rv)) = &*self.running.lock().unwrap_or_else(|e| e.into_inner()) {
            let m = (x.numel() as i64 / c) as f64;
            let unbiased = &var * (m / (m - 1.0).max(1.0));
            let _ = rm.shallow_clone().g_mul_scalar_(1.0 - self.momentum).g_add_(&(mean.shallow_clone() * self.momentum));
            let _ = rv.shallow_clone().g_mul_scalar_(1.0 - self.momentum).g_add_(&(unbiased * self.momentum));
        }
        (y.to_kind(x.kind()), mean, rstd)
    }

    /// The reference backward pass: `(dx, dres, db, dw)`.
    fn reference_backward(&self, dy: &Tensor, saved: [&Tensor; 5]) -> (Tensor, Tensor, Tensor, Tensor) {
        let [x, y, mean, rstd, w] = saved;
        let c = x.size()[1];
        let per_channel = |t: &Tensor| t.view([1, c, 1, 1]);
        let mut g = dy.to_kind(Kind::Float);
        if self.relu {
            g *= y.gt(0.0).to_kind(Kind::Float);
        }
        let xhat = (x.to_kind(Kind::Float) - per_channel(mean)) * per_channel(rstd);
        let m = (x.numel() as i64 / c) as f64;
        let sg = g.sum_dim_intlist([0i64, 2, 3].as_slice(), false, Kind::Float);
        let sgx = (&g * &xhat).sum_dim_intlist([0i64, 2, 3].as_slice(), false, Kind::Float);
        let dx = per_channel(&(w * rstd)) * (&g - per_channel(&sg) / m - &xhat * per_channel(&sgx) / m);
        (dx.to_kind(x.kind()), g.to_kind(x.kind()), sg, sgx)
    }
}

impl CustomOp for BatchNormAct {
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        let (x, w, b, res) = match inputs {
            [x, w, b] if !self.residual => (x, w, b, None),
            [x, w, b, r] if self.residual => (x, w, b, Some(r)),
            _ => anyhow::bail!("batch_norm_act: {} inputs", inputs.len()),
        };
        let (y, kept) = match self.engine {
            Engine::Cuda => {
                let (x2, r2) = (nhwc_rows(x), res.map(nhwc_rows));
                let guard = self.running.lock().unwrap_or_else(|e| e.into_inner());
                let running = guard.as_ref().map(|(m, v)| (m, v));
                let out = kernels::batch_norm(&x2, w, b, r2.as_ref(), running, self.momentum as f32, self.eps as f32, self.relu)?;
                let mask = out.relu_mask.unwrap_or_else(|| no_mask(&out.y));
                (from_nhwc_rows(&out.y, &x.size()), vec![x2, mask, out.mean, out.rstd, w.shallow_clone()])
            }
            Engine::Reference => {
                let (y, mean, rstd) = self.reference_forward(x, w, b, res);
                (y.shallow_clone(), vec![x.shallow_clone(), self.mask_of(&y), mean, rstd, w.shallow_clone()])
            }
        };
        Ok((vec![y], kept))
    }

    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let ([x, mask, mean, rstd, w], [dy]) = (saved, grads) else {
            anyhow::bail!("batch_norm_act: {} kept, {} gradients", saved.len(), grads.len())
        };
        let n_inputs = 3 + usize::from(self.residual);
        let Some(dy) = dy else { return Ok((0..n_inputs).map(|_| None).collect()) };
        let (dx, dres, db, dw) = match self.engine {
            Engine::Cuda => {
                let shape = dy.size();
                let (dx, dres, sums) =
                    kernels::batch_norm_backward(&nhwc_rows(dy), self.relu.then_some(mask), x, mean, rstd, w, self.residual)?;
                let dres = dres.map(|d| from_nhwc_rows(&d, &shape));
                (from_nhwc_rows(&dx, &shape), dres, sums.get(0), sums.get(1))
            }
            Engine::Reference => {
                let (dx, dres, db, dw) = self.reference_backward(dy, [x, mask, mean, rstd, w]);
                (dx, Some(dres), db, dw)
            }
        };
        let mut g = vec![Some(dx), Some(dw), Some(db)];
        if self.residual {
            g.push(dres);
        }
        Ok(g)
    }
}

/// Max pooling in training: the autograd node behind [`max_pool`] on CUDA.
/// Input `[x]` (`[n, c, h, w]`, channels-last), output `[y]`
/// (channels-last), kept `[offsets]`: a byte per output, not the input.
struct MaxPool {
    pool: Pool,
    /// The input's height and width.
    in_hw: (i64, i64),
}

impl CustomOp for MaxPool {
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        let [x] = inputs else { anyhow::bail!("max_pool: {} inputs", inputs.len()) };
        let (y, offsets) = kernels::max_pool(&x.permute([0, 2, 3, 1]), self.pool)?;
        Ok((vec![y.permute([0, 3, 1, 2])], vec![offsets]))
    }

    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let ([offsets], [dy]) = (saved, grads) else { anyhow::bail!("max_pool: {} kept, {} gradients", saved.len(), grads.len()) };
        let Some(dy) = dy else { return Ok(vec![None]) };
        let (h, w) = self.in_hw;
        let dx = kernels::max_pool_backward(&dy.permute([0, 2, 3, 1]).contiguous(), offsets, h, w, self.pool)?;
        Ok(vec![Some(dx.permute([0, 3, 1, 2]))])
    }
}

/// The empty tensor kept in place of a mask where there is no ReLU.
fn no_mask(like: &Tensor) -> Tensor {
    Tensor::empty([0], (like.kind(), like.device()))
}

/// `x` with channels-last strides (NHWC in memory, NCHW in shape). tch has
/// no memory-format API; libtorch infers the format from the strides.
pub fn channels_last(x: &Tensor) -> Tensor {
    x.permute([0, 2, 3, 1]).contiguous().permute([0, 3, 1, 2])
}

/// Whether `x` (4-d) has channels-last strides.
pub fn is_channels_last(x: &Tensor) -> bool {
    let (size, stride) = (x.size(), x.stride());
    size.len() == 4 && stride[1] == 1 && stride[3] == size[1] && stride[2] == size[1] * size[3]
}

/// Whether [`batch_norm_act`] runs the CUDA kernels on `x` (bf16,
/// channels-last `[n, c, h, w]`, a width the kernels take, CUDA);
/// `HARNESS_FUSED_BN=0` keeps libtorch's layers (a diagnostic).
pub fn batch_norm_cuda_fits(x: &Tensor) -> bool {
    let size = x.size();
    harness_format::switches::get().fused_bn
        && size.len() == 4
        && x.device().is_cuda()
        && x.kind() == Kind::BFloat16
        && is_channels_last(x)
        && kernels::batch_norm_fits(size[1])
        && kernels::available()
}

/// Training-mode batch norm of `x` `[n, c, h, w]` over its batch and
/// positions with weight `w` and bias `b` (fp32 `[c]`), then `res` (the
/// residual, `x`'s shape) added and ReLU applied where asked: `relu(bn(x) +
/// res)`, in `x`'s kind, the running mean and variance updated (momentum,
/// unbiased variance) as torch's batch norm does. On CUDA
/// ([`batch_norm_cuda_fits`]) three kernels forward (the statistics in two
/// stages, then the normalisation with the add and the ReLU, writing
/// channels-last bf16) and three backward (the sums of the gradient behind
/// the ReLU and of its product with the normalised input, their total, then
/// the input's and the residual's gradients in one pass); elsewhere the same
/// maths in libtorch operations.
pub fn batch_norm_act(x: &Tensor, bn: &BatchNormParams, res: Option<&Tensor>, relu: bool) -> Tensor {
    let cuda = batch_norm_cuda_fits(x) && !reference_forced() && res.is_none_or(|r| r.kind() == Kind::BFloat16 && r.size() == x.size());
    let engine = if cuda { Engine::Cuda } else { Engine::Reference };
    batch_norm_act_with(engine, x, bn, res, relu)
}

/// Whether [`max_pool`] runs harness's kernels on `x` (bf16, channels-last
/// `[n, c, h, w]` on CUDA, a window the kernels take);
/// `HARNESS_FUSED_POOL=0` keeps libtorch's (a diagnostic).
pub fn max_pool_cuda_fits(x: &Tensor, pool: Pool) -> bool {
    let size = x.size();
    harness_format::switches::get().fused_pool
        && size.len() == 4
        && x.device().is_cuda()
        && x.kind() == Kind::BFloat16
        && is_channels_last(x)
        && pool.fits(size[1])
        && kernels::available()
}

/// Max pooling of `x` `[n, c, h, w]` over square windows: on CUDA
/// ([`max_pool_cuda_fits`]) one kernel each way, keeping a byte per output
/// (its maximum's place in its window) for the backward pass instead of
/// the input and int64 indices; elsewhere libtorch's `max_pool2d`.
pub fn max_pool(x: &Tensor, pool: Pool) -> Tensor {
    if !max_pool_cuda_fits(x, pool) || reference_forced() {
        return libtorch_max_pool(x, pool);
    }
    let size = x.size();
    let op = MaxPool { pool, in_hw: (size[2], size[3]) };
    let mut out = torch_ext::custom_op(op, &[x]).unwrap_or_else(|e| panic!("{e}"));
    out.pop().expect("max_pool returns its output")
}

/// libtorch's max pooling of `x` `[n, c, h, w]` over `pool`'s windows.
pub fn libtorch_max_pool(x: &Tensor, pool: Pool) -> Tensor {
    let Pool { k, stride, pad } = pool;
    x.max_pool2d([k, k], [stride, stride], [pad, pad], [1, 1], false)
}

/// A batch norm's weight and bias (fp32 `[c]`), its running mean and
/// variance (updated in training) and its momentum and epsilon, as
/// [`batch_norm_act`] takes them.
#[derive(Clone, Copy)]
pub struct BatchNormParams<'a> {
    pub w: &'a Tensor,
    pub b: &'a Tensor,
    pub running: Option<(&'a Tensor, &'a Tensor)>,
    pub momentum: f64,
    pub eps: f64,
}

/// [`batch_norm_act`]'s node on `engine`.
pub(super) fn batch_norm_act_with(engine: Engine, x: &Tensor, bn: &BatchNormParams, res: Option<&Tensor>, relu: bool) -> Tensor {
    let BatchNormParams { w, b, running, momentum, eps } = *bn;
    let running = running.map(|(m, v)| (m.shallow_clone(), v.shallow_clone()));
    let op = BatchNormAct { engine, relu, residual: res.is_some(), running: std::sync::Mutex::new(running), momentum, eps };
    let mut inputs = vec![x, w, b];
    inputs.extend(res);
    let mut out = torch_ext::custom_op(op, &inputs).unwrap_or_else(|e| panic!("{e}"));
    out.pop().expect("batch_norm_act returns its output")
}
