//! Layers computed by harness's own kernels (the workload's `kernels =
//! "fused"`), as autograd nodes: the forward and backward passes are
//! written out, not recorded op by op.
//!
//! [`add_norm`] is a residual add followed by LayerNorm, the junction that
//! appears twice in every pre-norm transformer block: `x' = x + f` (the fp32
//! residual stream plus a bf16 branch output) and `y = LayerNorm(x')` in
//! bf16, the input of the next matmul. libtorch under autocast runs it as
//! five kernels forward (add, an fp32 LayerNorm, a cast to bf16) and as
//! many backward (cast, two LayerNorm kernels, two adds); the fused form is
//! one kernel each way, reading and writing each row once.
//!
//! The same maths in libtorch operations ([`Reference`]) runs on the CPU:
//! the tests check the backward pass written out against autograd's there,
//! and the CUDA kernels against it on a GPU.

use tch::{Kind, Tensor};

use crate::kernels;
use crate::torch_ext::{self, CustomOp};

/// LayerNorm's epsilon (as `nn.LayerNorm`).
pub const EPS: f64 = 1e-5;

/// Whether `HARNESS_FUSED_REFERENCE=1` asks for the libtorch reference on
/// CUDA too (a diagnostic: it tells a kernel's error from the fused layers'
/// own maths, e.g. the bias added in fp32).
fn reference_forced() -> bool {
    static FORCED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| std::env::var("HARNESS_FUSED_REFERENCE").is_ok_and(|v| v == "1"))
}

/// Which code computes the fused layers' maths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// The CUDA kernels of [`kernels`].
    Cuda,
    /// libtorch operations (any device), the reference.
    Reference,
}

/// `y = LayerNorm(x + f + fb)` with the sum kept: the autograd node behind
/// [`add_norm`]. Inputs `[x, f?, fb?, w, b]` (`fb` only with `f`); outputs
/// `[x + f + fb, y]` with `f`, `[y]` without; kept `[the sum or x, mean,
/// rstd, w]`.
struct AddNorm {
    engine: Engine,
    residual: bool,
    bias: bool,
}

/// The reference forward pass: `(x + f + fb, y, mean, rstd)`, y in `f`'s
/// kind (or `x`'s without `f`).
fn reference_forward(
    x: &Tensor,
    f: Option<&Tensor>,
    fb: Option<&Tensor>,
    w: &Tensor,
    b: &Tensor,
) -> (Option<Tensor>, Tensor, Tensor, Tensor) {
    let xo = f.map(|f| match fb {
        Some(fb) => x + f.to_kind(Kind::Float) + fb,
        None => x + f,
    });
    let xin = xo.as_ref().unwrap_or(x);
    let kind = f.map_or(x.kind(), Tensor::kind);
    let (mean, var) = (xin.mean_dim(-1, true, Kind::Float), xin.var_dim(-1, false, true));
    let rstd = (var + EPS).rsqrt();
    let y = ((xin - &mean) * &rstd * w + b).to_kind(kind);
    (xo, y, mean.squeeze_dim(-1), rstd.squeeze_dim(-1))
}

/// The reference backward pass, as the kernel computes it.
fn reference_backward(
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
    let s1 = g.mean_dim(-1, true, Kind::Float);
    let s2 = (&g * &xhat).mean_dim(-1, true, Kind::Float);
    let mut dx = rstd * (g - s1 - &xhat * s2);
    if let Some(d) = dres {
        dx += d.to_kind(Kind::Float);
    }
    let dw = (&dy * xhat).sum_dim_intlist(0, false, Kind::Float);
    let db = dy.sum_dim_intlist(0, false, Kind::Float);
    (dx, dw, db)
}

impl CustomOp for AddNorm {
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        let (x, f, fb, w, b) = match (self.residual, self.bias, inputs) {
            (true, true, [x, f, fb, w, b]) => (x, Some(f), Some(fb), w, b),
            (true, false, [x, f, w, b]) => (x, Some(f), None, w, b),
            (false, false, [x, w, b]) => (x, None, None, w, b),
            _ => anyhow::bail!("add_norm: {} inputs", inputs.len()),
        };
        let (xo, y, mean, rstd) = match self.engine {
            Engine::Cuda => kernels::add_layer_norm(x, f, fb, w, b, EPS as f32)?,
            Engine::Reference => reference_forward(x, f, fb, w, b),
        };
        let kept = vec![xo.as_ref().unwrap_or(x).shallow_clone(), mean, rstd, w.shallow_clone()];
        Ok((xo.into_iter().chain([y]).collect(), kept))
    }

    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let [x, mean, rstd, w] = saved else { anyhow::bail!("add_norm: {} kept tensors", saved.len()) };
        let (dres, dy) = match (self.residual, grads) {
            (true, [dres, dy]) => (dres.as_ref(), dy.as_ref()),
            (false, [dy]) => (None, dy.as_ref()),
            _ => anyhow::bail!("add_norm: {} gradients", grads.len()),
        };
        let grads = |dx: Option<Tensor>, df: Option<Tensor>, dfb: Option<Tensor>, dw: Option<Tensor>, db: Option<Tensor>| {
            let mut g = vec![dx];
            if self.residual {
                g.push(df);
            }
            if self.bias {
                g.push(dfb);
            }
            g.extend([dw, db]);
            g
        };
        let Some(dy) = dy else {
            // Only the sum was used: its gradient passes through the add.
            let df = dres.map(|d| d.to_kind(Kind::BFloat16));
            let dfb = dres.map(|d| d.sum_dim_intlist(0, false, Kind::Float));
            return Ok(grads(dres.map(Tensor::shallow_clone), df, dfb, None, None));
        };
        let (dx, df, dw, db, dfb) = match self.engine {
            Engine::Cuda => kernels::add_layer_norm_backward(dy, x, mean, rstd, w, dres, self.residual)?,
            Engine::Reference => {
                let (dx, dw, db) = reference_backward(dy, x, mean, rstd, w, dres);
                let df = self.residual.then(|| dx.to_kind(dy.kind()));
                let dfb = dx.sum_dim_intlist(0, false, Kind::Float);
                (dx, df, dw, db, dfb)
            }
        };
        Ok(grads(Some(dx), df, Some(dfb), Some(dw), Some(db)))
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
    let c = *x.size().last().expect("add_norm takes rows");
    let shape = x.size();
    let engine = if cuda_fits(c, x.device()) && !reference_forced() { Engine::Cuda } else { Engine::Reference };
    let rows = |t: &Tensor| t.reshape([-1, c]).contiguous();
    let x2 = rows(x);
    let f2 = f.map(rows);
    let fb = fb.filter(|_| f.is_some());
    let mut inputs = vec![&x2];
    inputs.extend(f2.as_ref());
    inputs.extend(fb);
    inputs.extend([w, b]);
    let op = AddNorm { engine, residual: f.is_some(), bias: fb.is_some() };
    let out = torch_ext::custom_op(op, &inputs).unwrap_or_else(|e| panic!("{e}"));
    match (f, &out[..]) {
        (Some(_), [xo, y]) => (xo.view(shape.as_slice()), y.view(shape.as_slice())),
        (None, [y]) => (x.shallow_clone(), y.view(shape.as_slice())),
        _ => unreachable!("add_norm returns its outputs"),
    }
}

/// `gelu(x + b)` (tanh approximation): the autograd node behind
/// [`bias_gelu`]. Inputs `[x, b]`, output `[y]`, kept `[x, b]`.
struct BiasGelu {
    engine: Engine,
}

impl CustomOp for BiasGelu {
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        let [x, b] = inputs else { anyhow::bail!("bias_gelu: {} inputs", inputs.len()) };
        let y = match self.engine {
            Engine::Cuda => kernels::bias_gelu(x, b)?,
            Engine::Reference => (x.to_kind(Kind::Float) + b).gelu("tanh").to_kind(x.kind()),
        };
        Ok((vec![y], vec![x.shallow_clone(), b.shallow_clone()]))
    }

    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let ([x, b], [dy]) = (saved, grads) else { anyhow::bail!("bias_gelu: {} kept, {} gradients", saved.len(), grads.len()) };
        let Some(dy) = dy else { return Ok(vec![None, None]) };
        let (dx, db) = match self.engine {
            Engine::Cuda => kernels::bias_gelu_backward(dy, x, b)?,
            Engine::Reference => {
                let d = (x.to_kind(Kind::Float) + b).gelu_backward(&dy.to_kind(Kind::Float), "tanh");
                (d.to_kind(x.kind()), d.sum_dim_intlist(0, false, Kind::Float))
            }
        };
        Ok(vec![Some(dx), Some(db)])
    }
}

/// Whether [`bias_gelu`] runs the CUDA kernels on rows of `c` channels of
/// this device.
pub fn gelu_cuda_fits(c: i64, device: tch::Device) -> bool {
    device.is_cuda() && kernels::gelu_fits(c) && kernels::available()
}

/// `gelu(x + b)` (tanh approximation) over rows `x` `[.., c]` (bf16, the
/// output of a matmul without its bias) and the fp32 bias `b` `[c]`, in
/// `x`'s kind: the bias's gradient comes out of the GELU's backward kernel
/// instead of a separate reduction. On CUDA ([`gelu_cuda_fits`]) one kernel
/// each way; elsewhere the same maths in libtorch operations.
pub fn bias_gelu(x: &Tensor, b: &Tensor) -> Tensor {
    let c = *x.size().last().expect("bias_gelu takes rows");
    let shape = x.size();
    let engine = if gelu_cuda_fits(c, x.device()) && !reference_forced() { Engine::Cuda } else { Engine::Reference };
    let x2 = x.reshape([-1, c]).contiguous();
    let out = torch_ext::custom_op(BiasGelu { engine }, &[&x2, b]).unwrap_or_else(|e| panic!("{e}"));
    out[0].view(shape.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    type AddNormFn = fn(&Tensor, Option<&Tensor>, Option<&Tensor>, &Tensor, &Tensor) -> (Tensor, Tensor);

    /// The plain composition `add_norm` replaces: `x + f + fb`, then
    /// LayerNorm.
    fn plain(x: &Tensor, f: Option<&Tensor>, fb: Option<&Tensor>, w: &Tensor, b: &Tensor) -> (Tensor, Tensor) {
        let xo = match (f, fb) {
            (Some(f), Some(fb)) => x + (f + fb),
            (Some(f), None) => x + f,
            _ => x.shallow_clone(),
        };
        let y = xo.layer_norm([w.size()[0]], Some(w), Some(b), EPS, false);
        (xo, y)
    }

    /// Gradients (x, w, b, then f and fb where used) of a loss using both
    /// outputs of `op` on `[n, c]` rows.
    fn grads(op: AddNormFn, residual: bool, bias: bool, dev: Device, kind: Kind, (n, c): (i64, i64)) -> Vec<Tensor> {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(11);
        let leaf = |t: Tensor| t.set_requires_grad(true);
        let x = leaf(Tensor::randn([n, c], (Kind::Float, dev)));
        let f = leaf(Tensor::randn([n, c], (Kind::Float, dev)).to_kind(kind));
        let fb = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1);
        let w = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1 + 1.0);
        let b = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1);
        let (py, pr) = (Tensor::randn([n, c], (Kind::Float, dev)), Tensor::randn([n, c], (Kind::Float, dev)));
        let (xo, y) = op(&x, residual.then_some(&f), bias.then_some(&fb), &w, &b);
        let loss = (y.to_kind(Kind::Float) * &py).sum(Kind::Float) + (xo * &pr).sum(Kind::Float);
        loss.backward();
        let mut g = vec![x.grad(), w.grad(), b.grad()];
        if residual {
            g.push(f.grad());
        }
        if bias {
            g.push(fb.grad());
        }
        g
    }

    const CASES: [(bool, bool); 3] = [(true, true), (true, false), (false, false)];

    #[test]
    fn the_written_out_backward_pass_matches_autograd() {
        // fp32 on the CPU: the reference's maths against autograd's.
        for (residual, bias) in CASES {
            let want = grads(plain, residual, bias, Device::Cpu, Kind::Float, (6, 16));
            let got = grads(add_norm, residual, bias, Device::Cpu, Kind::Float, (6, 16));
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                let err = (a - b).abs().max().double_value(&[]);
                assert!(err < 1e-4, "residual={residual} bias={bias}, gradient {i}: max error {err}");
            }
        }
    }

    #[test]
    fn without_grad_mode_only_the_forward_pass_runs() {
        let _g = tch::no_grad_guard();
        let x = Tensor::randn([3, 8], (Kind::Float, Device::Cpu));
        let f = Tensor::randn([3, 8], (Kind::Float, Device::Cpu));
        let (w, b) = (Tensor::ones([8], (Kind::Float, Device::Cpu)), Tensor::zeros([8], (Kind::Float, Device::Cpu)));
        let (xo, y) = add_norm(&x, Some(&f), None, &w, &b);
        let (pxo, py) = plain(&x, Some(&f), None, &w, &b);
        assert!(xo.allclose(&pxo, 0.0, 0.0, false));
        assert!(y.allclose(&py, 1e-5, 1e-5, false));
    }

    /// GELU's output and the gradients of x and b, through `bias_gelu` or
    /// the plain composition.
    fn gelu_grads(fused: bool, dev: Device, kind: Kind, (n, c): (i64, i64)) -> Vec<Tensor> {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(5);
        let x = (Tensor::randn([n, c], (Kind::Float, dev)) * 2.0).to_kind(kind).set_requires_grad(true);
        let b = (Tensor::randn([c], (Kind::Float, dev)) * 0.5).set_requires_grad(true);
        let p = Tensor::randn([n, c], (Kind::Float, dev));
        let y = if fused { bias_gelu(&x, &b) } else { (&x + &b).gelu("tanh") };
        (y.to_kind(Kind::Float) * p).sum(Kind::Float).backward();
        vec![y.to_kind(Kind::Float), x.grad().to_kind(Kind::Float), b.grad()]
    }

    #[test]
    fn bias_gelu_matches_the_plain_composition() {
        let want = gelu_grads(false, Device::Cpu, Kind::Float, (5, 24));
        let got = gelu_grads(true, Device::Cpu, Kind::Float, (5, 24));
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            let err = (a - b).abs().max().double_value(&[]);
            assert!(err < 1e-4, "output/gradient {i}: max error {err}");
        }
    }

    fn relative(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
        (&a - &b).norm().double_value(&[]) / a.norm().double_value(&[]).max(1e-6)
    }

    #[test]
    fn cuda_kernels_match_the_reference() {
        if !crate::device::init_cuda() {
            eprintln!("skipped: no CUDA device (this test runs on the GPU machines)");
            return;
        }
        let dev = Device::Cuda(0);
        for shape in [(6, 16), (300, 768), (64, 2048)] {
            for (residual, bias) in CASES {
                let want = grads(plain, residual, bias, dev, Kind::BFloat16, shape);
                let got = grads(add_norm, residual, bias, dev, Kind::BFloat16, shape);
                for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                    let rel = relative(a, b);
                    assert!(rel < 2e-2, "{shape:?} residual={residual} bias={bias}, gradient {i}: relative error {rel}");
                }
            }
        }
        for shape in [(5, 24), (300, 3072), (64, 8192)] {
            let want = gelu_grads(false, dev, Kind::BFloat16, shape);
            let got = gelu_grads(true, dev, Kind::BFloat16, shape);
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                let rel = relative(a, b);
                assert!(rel < 2e-2, "GELU {shape:?}, output/gradient {i}: relative error {rel}");
            }
        }
    }
}
