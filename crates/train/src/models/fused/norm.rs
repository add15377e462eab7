//! Residual adds with their normalisation: [`add_norm`] (pre-norm
//! LayerNorm), [`add_rms_norm`] (T5's) and [`post_norm`] (a post-norm
//! layer's, fp32 out), one autograd node ([`AddNorm`]) each way.

use tch::{Kind, Tensor};

use harness_kernels::kernels::{self, Norm};
use harness_kernels::torch_ext::{self, CustomOp};

use super::engine::{reference_forced, Engine, EPS, RMS_EPS};
use super::grad::Sums;

/// `y = LayerNorm(x + f + fb)` with the sum kept: the autograd node behind
/// [`add_norm`] (and, with [`Norm::Rms`], [`add_rms_norm`]). Inputs `[x,
/// f?, fb?, w, b?]` (`fb` only with `f`, `b` only for LayerNorm); outputs
/// `[x + f + fb, y]` with `f`, `[x, y]` without (`x` passed through, so
/// that the gradient reaching it from its other uses is added in the
/// backward kernel, where autograd would sum the two in a pass of its own);
/// kept `[the sum or x, mean, rstd, w, b?, fb?]`.
struct AddNorm {
    engine: Engine,
    norm: Norm,
    residual: bool,
    bias: bool,
    /// `y`'s kind: bf16 before a matmul ([`add_norm`]), fp32 as a post-norm
    /// layer's residual stream ([`post_norm`]).
    y_kind: Kind,
    /// `f`'s kind, for its gradient.
    f_kind: Kind,
}

/// The reference forward pass: `(x + f + fb, y, mean, rstd)`, y in `y_kind`
/// (RMS normalisation: no mean subtracted, kept as 0, and no bias).
fn reference_forward(
    norm: Norm,
    x: &Tensor,
    f: Option<&Tensor>,
    fb: Option<&Tensor>,
    w: &Tensor,
    b: Option<&Tensor>,
    y_kind: Kind,
) -> (Option<Tensor>, Tensor, Tensor, Tensor) {
    let xo = f.map(|f| match fb {
        Some(fb) => x + f.to_kind(Kind::Float) + fb,
        None => x + f,
    });
    let xin = xo.as_ref().unwrap_or(x);
    let (mean, var, eps) = match norm {
        Norm::Layer => (xin.mean_dim(-1, true, Kind::Float), xin.var_dim(-1, false, true), EPS),
        Norm::Rms => (xin.zeros_like().narrow(-1, 0, 1), xin.square().mean_dim(-1, true, Kind::Float), RMS_EPS),
    };
    let rstd = (var + eps).rsqrt();
    let mut y = (xin - &mean) * &rstd * w;
    if let Some(b) = b {
        y += b;
    }
    (xo, y.to_kind(y_kind), mean.squeeze_dim(-1), rstd.squeeze_dim(-1))
}

/// The reference backward pass, as the kernel computes it.
fn reference_backward(
    norm: Norm,
    dy: &Tensor,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    w: &Tensor,
    dres: Option<&Tensor>,
) -> (Tensor, Tensor, Tensor) {
    let dy = dy.to_kind(Kind::Float);
    let (mean, rstd) = (mean.unsqueeze(-1), rstd.unsqueeze(-1));
    let xhat = (x - &mean) * &rstd;
    let g = &dy * w;
    let s2 = (&g * &xhat).mean_dim(-1, true, Kind::Float);
    let mut dx = match norm {
        Norm::Layer => &rstd * (&g - g.mean_dim(-1, true, Kind::Float) - &xhat * s2),
        Norm::Rms => &rstd * (&g - &xhat * s2),
    };
    if let Some(d) = dres {
        dx += d.to_kind(Kind::Float);
    }
    let dw = (&dy * xhat).sum_dim_intlist(0, false, Kind::Float);
    let db = dy.sum_dim_intlist(0, false, Kind::Float);
    (dx, dw, db)
}

impl AddNorm {
    /// The inputs `[x, f?, fb?, w, b?]` by name.
    fn split<'a>(&self, inputs: &'a [Tensor]) -> anyhow::Result<AddNormInputs<'a>> {
        let layer = self.norm == Norm::Layer;
        let want = 2 + usize::from(self.residual) + usize::from(self.bias) + usize::from(layer);
        anyhow::ensure!(inputs.len() == want && (self.residual || !self.bias), "add_norm: {} inputs", inputs.len());
        // The backward kernels' partial sums are dw, db, then the branch
        // bias's: without a norm bias there is no row for it.
        anyhow::ensure!(layer || !self.bias, "RMS normalisation takes no branch bias");
        let mut it = inputs.iter();
        let mut next = |on: bool| if on { it.next() } else { None };
        let x = next(true).expect("counted");
        let f = next(self.residual);
        let fb = next(self.bias);
        let w = next(true).expect("counted");
        let b = next(layer);
        Ok(AddNormInputs { x, f, fb, w, b })
    }
}

/// [`AddNorm`]'s inputs.
struct AddNormInputs<'a> {
    x: &'a Tensor,
    f: Option<&'a Tensor>,
    fb: Option<&'a Tensor>,
    w: &'a Tensor,
    b: Option<&'a Tensor>,
}

impl CustomOp for AddNorm {
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        let AddNormInputs { x, f, fb, w, b } = self.split(inputs)?;
        let (xo, y, mean, rstd) = match self.engine {
            Engine::Cuda => kernels::add_layer_norm(self.norm, x, f, fb, w, b, self.eps() as f32, self.y_kind)?,
            Engine::Reference => reference_forward(self.norm, x, f, fb, w, b, self.y_kind),
        };
        let mut kept = vec![xo.as_ref().unwrap_or(x).shallow_clone(), mean, rstd, w.shallow_clone()];
        kept.extend(b.map(Tensor::shallow_clone));
        kept.extend(fb.map(Tensor::shallow_clone));
        Ok((vec![xo.unwrap_or_else(|| x.shallow_clone()), y], kept))
    }

    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let layer = self.norm == Norm::Layer;
        anyhow::ensure!(saved.len() == 4 + usize::from(layer) + usize::from(self.bias), "add_norm: {} kept tensors", saved.len());
        let (x, mean, rstd, w) = (&saved[0], &saved[1], &saved[2], &saved[3]);
        let b = layer.then(|| &saved[4]);
        let fb = self.bias.then(|| &saved[saved.len() - 1]);
        let [dres, dy] = grads else { anyhow::bail!("add_norm: {} gradients", grads.len()) };
        let (dres, dy) = (dres.as_ref(), dy.as_ref());
        let grads = |dx: Option<Tensor>, df: Option<Tensor>, dfb: Option<Tensor>, dw: Option<Tensor>, db: Option<Tensor>| {
            let mut g = vec![dx];
            if self.residual {
                g.push(df);
            }
            if self.bias {
                g.push(dfb);
            }
            g.push(dw);
            if layer {
                g.push(db);
            }
            g
        };
        let Some(dy) = dy else {
            // Only the sum was used: its gradient passes through the add.
            let df = dres.map(|d| d.to_kind(Kind::BFloat16));
            let dfb = dres.map(|d| d.sum_dim_intlist(0, false, Kind::Float));
            return Ok(grads(dres.map(Tensor::shallow_clone), df, dfb, None, None));
        };
        // The partial sums' rows are dw, db, the branch bias's: RMS
        // normalisation (no b) takes no branch bias (`add_rms_norm`).
        let mut params = vec![w];
        params.extend(b);
        params.extend(fb);
        let (dx, df, sums) = match self.engine {
            Engine::Cuda => {
                let (dx, df, part) = kernels::add_layer_norm_backward(self.norm, dy, x, mean, rstd, w, dres, self.residual)?;
                (dx, df, Sums::Partials(part))
            }
            Engine::Reference => {
                let (dx, dw, db) = reference_backward(self.norm, dy, x, mean, rstd, w, dres);
                let df = self.residual.then(|| dx.to_kind(self.f_kind));
                let mut sums = vec![dw];
                sums.extend(layer.then_some(db));
                if fb.is_some() {
                    sums.push(dx.sum_dim_intlist(0, false, Kind::Float));
                }
                (dx, df, Sums::Tensors(sums))
            }
        };
        let mut p = sums.deliver(&params)?.into_iter();
        let dw = p.next().flatten();
        let db = if layer { p.next().flatten() } else { None };
        let dfb = p.next().flatten();
        Ok(grads(Some(dx), df, dfb, dw, db))
    }
}

impl AddNorm {
    /// The normalisation's epsilon.
    fn eps(&self) -> f64 {
        match self.norm {
            Norm::Layer => EPS,
            Norm::Rms => RMS_EPS,
        }
    }
}

/// Whether [`add_norm`] runs the CUDA kernels on rows of `c` channels of
/// this device (else a caller keeps libtorch's layers).
pub fn cuda_fits(c: i64, device: tch::Device) -> bool {
    device.is_cuda() && kernels::layer_norm_fits(c) && kernels::available()
}

/// `(x + f, LayerNorm(x + f))` over the last dimension with weight `w` and
/// bias `b` (fp32), or `(x, LayerNorm(x))` without `f`: `x` is the fp32
/// residual stream `[.., c]`, `f` a bf16 branch output of its shape, and the
/// normalised rows come back in bf16. `fb` (fp32 `[c]`, with `f` only) is
/// the bias of the linear layer that made `f`, added here instead of in the
/// matmul so that its gradient comes out of the same backward kernel. On
/// CUDA ([`cuda_fits`]) one kernel each way; elsewhere the same maths in
/// libtorch operations.
pub fn add_norm(x: &Tensor, f: Option<&Tensor>, fb: Option<&Tensor>, w: &Tensor, b: &Tensor) -> (Tensor, Tensor) {
    let engine = if cuda_fits(*x.size().last().expect("add_norm takes rows"), x.device()) && !reference_forced() {
        Engine::Cuda
    } else {
        Engine::Reference
    };
    // The kernels write bf16 rows (for the next matmul); the reference
    // writes f's kind (x's without f).
    let y_kind = match engine {
        Engine::Cuda => Kind::BFloat16,
        Engine::Reference => f.map_or(x.kind(), Tensor::kind),
    };
    add_norm_with(engine, Norm::Layer, x, f, fb, w, Some(b), y_kind)
}

/// Whether [`add_rms_norm`] runs the CUDA kernels on rows of `c` channels
/// of this device (else a caller keeps libtorch's layers).
/// `HARNESS_FUSED_RMS_NORM=0` keeps libtorch's (a diagnostic).
pub fn rms_cuda_fits(c: i64, device: tch::Device) -> bool {
    harness_format::switches::get().fused_rms_norm && cuda_fits(c, device)
}

/// `(x + f, rms_norm(x + f))` over the last dimension with weight `w`
/// (fp32), or `(x, rms_norm(x))` without `f`, where `rms_norm(x) = x /
/// sqrt(mean(x^2) + 1e-6) * w` (T5's layer norm): `x` is the fp32 residual
/// stream `[.., c]`, `f` a bf16 branch output of its shape, and the
/// normalised rows come back in bf16, for the next matmul. On CUDA
/// ([`rms_cuda_fits`]) one kernel each way; elsewhere the same maths in
/// libtorch operations (the rows in `f`'s kind, `x`'s without `f`).
pub fn add_rms_norm(x: &Tensor, f: Option<&Tensor>, w: &Tensor) -> (Tensor, Tensor) {
    let c = *x.size().last().expect("add_rms_norm takes rows");
    let cuda = rms_cuda_fits(c, x.device()) && !reference_forced() && f.is_none_or(|f| f.kind() == Kind::BFloat16);
    let (engine, y_kind) = if cuda { (Engine::Cuda, Kind::BFloat16) } else { (Engine::Reference, f.map_or(x.kind(), Tensor::kind)) };
    add_norm_with(engine, Norm::Rms, x, f, None, w, None, y_kind)
}

/// Whether [`post_norm`] runs the CUDA kernels on rows of `c` channels of
/// this device (else a caller keeps libtorch's layers).
/// `HARNESS_FUSED_POST_NORM=0` keeps libtorch's (a diagnostic).
pub fn post_norm_cuda_fits(c: i64, device: tch::Device) -> bool {
    post_norm_on() && cuda_fits(c, device)
}

/// Whether `HARNESS_FUSED_POST_NORM=0` leaves post-norm layers to libtorch.
pub fn post_norm_on() -> bool {
    harness_format::switches::get().fused_post_norm
}

/// `LayerNorm(x + f + fb)` over the last dimension in fp32: a post-norm
/// layer's residual add and LayerNorm (`nn.TransformerEncoderLayer`), whose
/// output is the next layer's fp32 residual stream and input. `x` is the
/// fp32 stream `[.., c]`, `f` the branch output (bf16 under autocast), `fb`
/// (fp32 `[c]`, optional) the bias of the linear layer that made it, and
/// `w`, `b` the LayerNorm's parameters. On CUDA ([`cuda_fits`], `f` bf16)
/// one kernel each way; elsewhere the same maths in libtorch operations.
pub fn post_norm(x: &Tensor, f: &Tensor, fb: Option<&Tensor>, w: &Tensor, b: &Tensor) -> Tensor {
    let c = *x.size().last().expect("post_norm takes rows");
    let cuda = cuda_fits(c, x.device()) && !reference_forced() && x.kind() == Kind::Float && f.kind() == Kind::BFloat16;
    let engine = if cuda { Engine::Cuda } else { Engine::Reference };
    add_norm_with(engine, Norm::Layer, x, Some(f), fb, w, Some(b), Kind::Float).1
}

/// [`add_norm`]'s node on `engine`, the normalised rows in `y_kind`.
#[allow(clippy::too_many_arguments)]
pub(super) fn add_norm_with(
    engine: Engine,
    norm: Norm,
    x: &Tensor,
    f: Option<&Tensor>,
    fb: Option<&Tensor>,
    w: &Tensor,
    b: Option<&Tensor>,
    y_kind: Kind,
) -> (Tensor, Tensor) {
    let c = *x.size().last().expect("add_norm takes rows");
    let shape = x.size();
    let rows = |t: &Tensor| t.reshape([-1, c]).contiguous();
    let x2 = rows(x);
    let f2 = f.map(rows);
    let fb = fb.filter(|_| f.is_some());
    let mut inputs = vec![&x2];
    inputs.extend(f2.as_ref());
    inputs.extend(fb);
    inputs.push(w);
    inputs.extend(b);
    let op = AddNorm { engine, norm, residual: f.is_some(), bias: fb.is_some(), y_kind, f_kind: f.map_or(x.kind(), Tensor::kind) };
    let out = torch_ext::custom_op(op, &inputs).unwrap_or_else(|e| panic!("{e}"));
    let [xo, y] = &out[..] else { unreachable!("add_norm returns two outputs") };
    (xo.view(shape.as_slice()), y.view(shape.as_slice()))
}
