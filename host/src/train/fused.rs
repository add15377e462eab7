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

/// The gradients of a fused layer's vector parameters (LayerNorm's weight
/// and bias, a bias), as the backward kernels leave them: per-block partial
/// sums on CUDA, finished vectors from the reference.
enum Sums {
    Partials(kernels::Partials),
    Tensors(Vec<Tensor>),
}

impl Sums {
    /// Hands the gradients of `params` (in order) over. Where every one has
    /// a gradient buffer ([`buffer`]), adds them in there directly (on
    /// CUDA, reducing the partial sums and adding in one launch, against a
    /// reduction, a memset and an add each through autograd) and returns no
    /// gradients for autograd; else returns them.
    fn deliver(self, params: &[&Tensor]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let buffers: Option<Vec<Tensor>> = params.iter().map(|p| buffer(p)).collect();
        let Some(buffers) = buffers else {
            return Ok(match self {
                Sums::Partials(part) => {
                    let sums = part.sums()?;
                    (0..params.len()).map(|i| Some(sums.get(i as i64))).collect()
                }
                Sums::Tensors(ts) => ts.into_iter().map(Some).collect(),
            });
        };
        match self {
            Sums::Partials(part) => part.add_into(&buffers.iter().collect::<Vec<_>>())?,
            Sums::Tensors(ts) => {
                for (g, t) in buffers.iter().zip(&ts) {
                    let _ = g.shallow_clone().f_add_(t)?;
                }
            }
        }
        Ok(params.iter().map(|_| None).collect())
    }
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
        let mut kept = vec![xo.as_ref().unwrap_or(x).shallow_clone(), mean, rstd, w.shallow_clone(), b.shallow_clone()];
        kept.extend(fb.map(Tensor::shallow_clone));
        Ok((xo.into_iter().chain([y]).collect(), kept))
    }

    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let (x, mean, rstd, w, b, fb) = match saved {
            [x, mean, rstd, w, b] => (x, mean, rstd, w, b, None),
            [x, mean, rstd, w, b, fb] => (x, mean, rstd, w, b, Some(fb)),
            _ => anyhow::bail!("add_norm: {} kept tensors", saved.len()),
        };
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
        let mut params = vec![w, b];
        params.extend(fb);
        let (dx, df, sums) = match self.engine {
            Engine::Cuda => {
                let (dx, df, part) = kernels::add_layer_norm_backward(dy, x, mean, rstd, w, dres, self.residual)?;
                (dx, df, Sums::Partials(part))
            }
            Engine::Reference => {
                let (dx, dw, db) = reference_backward(dy, x, mean, rstd, w, dres);
                let df = self.residual.then(|| dx.to_kind(dy.kind()));
                let mut sums = vec![dw, db];
                if fb.is_some() {
                    sums.push(dx.sum_dim_intlist(0, false, Kind::Float));
                }
                (dx, df, Sums::Tensors(sums))
            }
        };
        let mut p = sums.deliver(&params)?.into_iter();
        let (dw, db, dfb) = (p.next().flatten(), p.next().flatten(), p.next().flatten());
        Ok(grads(Some(dx), df, dfb, dw, db))
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
        let (dx, sums) = match self.engine {
            Engine::Cuda => {
                let (dx, part) = kernels::bias_gelu_backward(dy, x, b)?;
                (dx, Sums::Partials(part))
            }
            Engine::Reference => {
                let d = (x.to_kind(Kind::Float) + b).gelu_backward(&dy.to_kind(Kind::Float), "tanh");
                (d.to_kind(x.kind()), Sums::Tensors(vec![d.sum_dim_intlist(0, false, Kind::Float)]))
            }
        };
        let mut db = sums.deliver(&[b])?;
        Ok(vec![Some(dx), db.pop().flatten()])
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

/// `p`'s gradient buffer, when it has one that a fused layer can add into
/// directly: `.grad` defined, fp32, contiguous, of `p`'s shape (the data
/// parallel code keeps each parameter's as a view of its bucket).
///
/// A layer that adds a gradient there itself hands autograd none for `p`.
/// `p`'s AccumulateGrad node still runs, after the backward pass of every
/// use of `p` (so after this one), and runs the post-accumulate-grad hook
/// (the data parallel code's signal that the gradient is complete) with or
/// without a gradient to add (libtorch 2.11's `AccumulateGrad::apply`; the
/// tests pin one call per backward pass). A parameter used elsewhere too
/// (the tied embedding) gets the other uses' gradients through it as usual.
fn buffer(p: &Tensor) -> Option<Tensor> {
    let g = p.grad();
    (g.defined() && g.kind() == Kind::Float && g.size() == p.size() && g.is_contiguous()).then_some(g)
}

/// `x w^T + b` under bf16 autocast with the weight's cast and gradient
/// handled here: the autograd node behind [`linear`]. Inputs `[x, w, b?]`
/// (`x` `[n, in]`, `w` fp32 `[out, in]`, `b` fp32 `[out]`), output `[y]`
/// (bf16 `[n, out]`), kept `[bf16(x), bf16(w), w, b?]`.
struct Linear {
    engine: Engine,
    bias: bool,
    /// `x`'s kind, for its gradient.
    x_kind: Kind,
}

impl CustomOp for Linear {
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        let (x, w, b) = match (self.bias, inputs) {
            (true, [x, w, b]) => (x, w, Some(b)),
            (false, [x, w]) => (x, w, None),
            _ => anyhow::bail!("linear: {} inputs", inputs.len()),
        };
        let w16 = match self.engine {
            Engine::Cuda => kernels::cast_bf16(w)?,
            Engine::Reference => w.to_kind(Kind::BFloat16),
        };
        let x16 = x.to_kind(Kind::BFloat16);
        let y = match b {
            // The bias in the matmul's epilogue, as autocast's addmm.
            Some(b) => b.to_kind(Kind::BFloat16).f_addmm(&x16, &w16.tr())?,
            None => x16.f_mm(&w16.tr())?,
        };
        let mut kept = vec![x16, w16, w.shallow_clone()];
        kept.extend(b.map(Tensor::shallow_clone));
        Ok((vec![y], kept))
    }

    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let (x16, w16, w, b, dy) = match (saved, grads) {
            ([x16, w16, w], [dy]) => (x16, w16, w, None, dy),
            ([x16, w16, w, b], [dy]) => (x16, w16, w, Some(b), dy),
            _ => anyhow::bail!("linear: {} kept, {} gradients", saved.len(), grads.len()),
        };
        let Some(dy) = dy else { return Ok((1..saved.len()).map(|_| None).collect()) };
        let dy = dy.to_kind(Kind::BFloat16);
        let dx = dy.f_mm(w16)?.to_kind(self.x_kind);
        // The weight's gradient straight out of the matmul in fp32 (bf16
        // products, fp32 sums), where autocast's bf16 matmul rounds it to
        // bf16 and a cast widens it again.
        let dw = match self.engine {
            Engine::Cuda => dy.tr().f_mm_dtype(x16, Kind::Float)?,
            Engine::Reference => dy.to_kind(Kind::Float).tr().f_mm(&x16.to_kind(Kind::Float))?,
        };
        let dw = match buffer(w) {
            Some(g) => {
                let _ = g.shallow_clone().f_add_(&dw)?;
                None
            }
            None => Some(dw),
        };
        let mut out = vec![Some(dx), dw];
        if let Some(b) = b {
            let sums = match self.engine {
                Engine::Cuda => Sums::Partials(kernels::column_sums_bf16(&dy.contiguous())?),
                Engine::Reference => Sums::Tensors(vec![dy.sum_dim_intlist(0, false, Kind::Float)]),
            };
            out.push(sums.deliver(&[b])?.pop().flatten());
        }
        Ok(out)
    }
}

/// `x w^T + b` (a linear layer; `w` fp32 `[out, in]`, `x` `[.., in]`).
/// With the fused kernels (`fused`) on CUDA, one autograd node: the weight
/// cast to bf16 by one vectorised kernel, its gradient computed by the
/// matmul in fp32 and added into its gradient buffer ([`buffer`]) or handed
/// to autograd, and the bias's gradient summed by a kernel of harness's
/// own. Else libtorch's linear (autocast casts the weight).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, fused: bool) -> Tensor {
    if !(fused && w.device().is_cuda()) {
        return x.linear(w, b);
    }
    let engine = if kernels::available() && !reference_forced() { Engine::Cuda } else { Engine::Reference };
    linear_with(engine, x, w, b)
}

/// [`linear`]'s autograd node on `engine`.
fn linear_with(engine: Engine, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let mut shape = x.size();
    let inner = *shape.last().expect("linear takes rows");
    let x2 = x.reshape([-1, inner]);
    let mut inputs = vec![&x2, w];
    inputs.extend(b);
    let op = Linear { engine, bias: b.is_some(), x_kind: x.kind() };
    let out = torch_ext::custom_op(op, &inputs).unwrap_or_else(|e| panic!("{e}"));
    *shape.last_mut().expect("linear takes rows") = w.size()[0];
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
    /// outputs of `op` on `[n, c]` rows; `buffers`: w, b and fb have zeroed
    /// gradient buffers beforehand, as the data parallel code gives them
    /// (the fused layer then adds into them itself).
    fn grads(op: AddNormFn, residual: bool, bias: bool, buffers: bool, dev: Device, kind: Kind, (n, c): (i64, i64)) -> Vec<Tensor> {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(11);
        let leaf = |t: Tensor| t.set_requires_grad(true);
        let x = leaf(Tensor::randn([n, c], (Kind::Float, dev)));
        let f = leaf(Tensor::randn([n, c], (Kind::Float, dev)).to_kind(kind));
        let fb = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1);
        let w = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1 + 1.0);
        let b = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1);
        let (py, pr) = (Tensor::randn([n, c], (Kind::Float, dev)), Tensor::randn([n, c], (Kind::Float, dev)));
        let kept: Vec<Tensor> = [&w, &b, &fb].iter().filter(|_| buffers).map(|t| t.zeros_like()).collect();
        for (t, g) in [&w, &b, &fb].iter().zip(&kept) {
            torch_ext::set_grad(t, Some(g)).unwrap();
        }
        let (xo, y) = op(&x, residual.then_some(&f), bias.then_some(&fb), &w, &b);
        let loss = (y.to_kind(Kind::Float) * &py).sum(Kind::Float) + (xo * &pr).sum(Kind::Float);
        loss.backward();
        for (t, g) in [&w, &b, &fb].iter().zip(&kept) {
            assert_eq!(t.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
        }
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
            for buffers in [false, true] {
                let want = grads(plain, residual, bias, buffers, Device::Cpu, Kind::Float, (6, 16));
                let got = grads(add_norm, residual, bias, buffers, Device::Cpu, Kind::Float, (6, 16));
                for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                    let err = (a - b).abs().max().double_value(&[]);
                    assert!(err < 1e-4, "residual={residual} bias={bias} buffers={buffers}, gradient {i}: max error {err}");
                }
            }
        }
    }

    #[test]
    fn without_grad_mode_only_the_forward_pass_runs() {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
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
    /// the plain composition; `buffer`: b has a zeroed gradient buffer
    /// beforehand.
    fn gelu_grads(fused: bool, buffer: bool, dev: Device, kind: Kind, (n, c): (i64, i64)) -> Vec<Tensor> {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(5);
        let x = (Tensor::randn([n, c], (Kind::Float, dev)) * 2.0).to_kind(kind).set_requires_grad(true);
        let b = (Tensor::randn([c], (Kind::Float, dev)) * 0.5).set_requires_grad(true);
        if buffer {
            torch_ext::set_grad(&b, Some(&b.zeros_like())).unwrap();
        }
        let p = Tensor::randn([n, c], (Kind::Float, dev));
        let y = if fused { bias_gelu(&x, &b) } else { (&x + &b).gelu("tanh") };
        (y.to_kind(Kind::Float) * p).sum(Kind::Float).backward();
        vec![y.to_kind(Kind::Float), x.grad().to_kind(Kind::Float), b.grad()]
    }

    #[test]
    fn bias_gelu_matches_the_plain_composition() {
        for buffer in [false, true] {
            let want = gelu_grads(false, buffer, Device::Cpu, Kind::Float, (5, 24));
            let got = gelu_grads(true, buffer, Device::Cpu, Kind::Float, (5, 24));
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                let err = (a - b).abs().max().double_value(&[]);
                assert!(err < 1e-4, "buffer={buffer}, output/gradient {i}: max error {err}");
            }
        }
    }

    fn relative(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
        (&a - &b).norm().double_value(&[]) / a.norm().double_value(&[]).max(1e-6)
    }

    /// Gradients of `w` and `x` for `x @ w^T` in bf16 used twice (as two
    /// micro-batches would), and how often the post-accumulate-grad hook
    /// ran, with a zeroed `.grad` buffer set beforehand as the data
    /// parallel code sets it; `engine`: through [`Linear`], else (None) a
    /// plain cast and autograd's accumulation.
    /// `tied`: `w` has a second, fp32 use in the same graph (as the tied
    /// embedding's lookup).
    fn hook_grads(engine: Option<Engine>, tied: bool, dev: Device) -> (Tensor, Tensor, i64) {
        unsafe extern "C" fn count(ctx: *mut std::ffi::c_void, _: i64) {
            // SAFETY: ctx is the AtomicI64 below, alive until the hook is removed.
            unsafe { &*(ctx as *const std::sync::atomic::AtomicI64) }.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(9);
        let w = Tensor::randn([24, 16], (Kind::Float, dev)).set_requires_grad(true);
        let x = Tensor::randn([5, 16], (Kind::Float, dev)).to_kind(Kind::BFloat16).set_requires_grad(true);
        let p = Tensor::randn([5, 24], (Kind::Float, dev));
        let buffer = Tensor::zeros([24 * 16 + 8], (Kind::Float, dev));
        torch_ext::set_grad(&w, Some(&buffer.narrow(0, 8, 24 * 16).view([24, 16]))).unwrap();
        let calls = std::sync::atomic::AtomicI64::new(0);
        let ctx = &calls as *const _ as *mut std::ffi::c_void;
        // SAFETY: `calls` outlives the hook, removed below.
        unsafe { torch_ext::set_grad_ready_hook(&w, Some(count), ctx, 0) }.unwrap();
        for _ in 0..2 {
            let y = match engine {
                Some(e) => linear_with(e, &x, &w, None),
                None => x.matmul(&w.to_kind(Kind::BFloat16).tr()),
            };
            let mut loss = (y.to_kind(Kind::Float) * &p).sum(Kind::Float);
            if tied {
                loss += (&w * 0.25).square().sum(Kind::Float);
            }
            loss.backward();
        }
        // SAFETY: removing the hook.
        unsafe { torch_ext::set_grad_ready_hook(&w, None, std::ptr::null_mut(), 0) }.unwrap();
        let g = w.grad();
        assert_eq!(g.data_ptr(), buffer.narrow(0, 8, 1).data_ptr(), "the gradient stays in its buffer");
        (g.copy(), x.grad().copy(), calls.load(std::sync::atomic::Ordering::SeqCst))
    }

    #[test]
    fn the_linear_node_adds_into_the_buffer_and_signals_it_once() {
        for tied in [false, true] {
            let (gw, gx, calls) = hook_grads(None, tied, Device::Cpu);
            let (fw, fx, fcalls) = hook_grads(Some(Engine::Reference), tied, Device::Cpu);
            // The node sums the weight's gradient in fp32 where autocast
            // rounds it to bf16 first: the same within bf16's epsilon.
            let err = (&gw - &fw).abs().max().double_value(&[]) / gw.abs().max().double_value(&[]);
            assert!(err < 8e-3, "tied={tied}: the weight's gradient differs: relative error {err}");
            assert!(gx.equal(&fx), "tied={tied}: the input's gradient differs");
            assert_eq!((calls, fcalls), (2, 2), "tied={tied}: one hook call per backward pass");
        }
    }

    #[test]
    fn the_linear_node_without_a_buffer_leaves_accumulation_to_autograd() {
        let w = Tensor::full([3, 4], 0.5, (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::ones([2, 4], (Kind::BFloat16, Device::Cpu));
        linear_with(Engine::Reference, &x, &w, None).to_kind(Kind::Float).sum(Kind::Float).backward();
        assert!(w.grad().equal(&Tensor::full([3, 4], 2.0, (Kind::Float, Device::Cpu))));
    }

    /// The output and the gradients (x, w, then b) of a loss over a linear
    /// layer of `n` rows, `i` to `o`: through [`Linear`] on `engine`, or
    /// (None) as autocast computes it (bf16 casts, then libtorch's matmul
    /// and autograd). `buffers`: w and b have zeroed gradient buffers, which
    /// must then hold their gradients.
    fn linear_grads(engine: Option<Engine>, bias: bool, buffers: bool, dev: Device, (n, i, o): (i64, i64, i64)) -> Vec<Tensor> {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(17);
        let x = Tensor::randn([2, n, i], (Kind::Float, dev)).to_kind(Kind::BFloat16).set_requires_grad(true);
        let w = (Tensor::randn([o, i], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
        let b = (Tensor::randn([o], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
        let p = Tensor::randn([2, n, o], (Kind::Float, dev));
        let kept: Vec<Tensor> = [&w, &b].iter().filter(|_| buffers).map(|t| t.zeros_like()).collect();
        for (t, g) in [&w, &b].iter().zip(&kept) {
            torch_ext::set_grad(t, Some(g)).unwrap();
        }
        let bias_in = bias.then_some(&b);
        let y = match engine {
            Some(e) => linear_with(e, &x, &w, bias_in),
            None => x.linear(&w.to_kind(Kind::BFloat16), bias_in.map(|b| b.to_kind(Kind::BFloat16))),
        };
        assert_eq!((y.size(), y.kind()), (vec![2, n, o], Kind::BFloat16));
        (y.to_kind(Kind::Float) * p).sum(Kind::Float).backward();
        for (t, g) in [&w, &b].iter().zip(&kept) {
            if t.grad().defined() {
                assert_eq!(t.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
            }
        }
        let mut out = vec![y.to_kind(Kind::Float), x.grad().to_kind(Kind::Float), w.grad()];
        if bias {
            out.push(b.grad());
        }
        out
    }

    #[test]
    fn the_linear_node_gives_autocasts_gradients() {
        // The input's gradient is the same bf16 matmul; the weight's is
        // summed in fp32 instead of rounded to bf16 (within bf16's epsilon).
        for bias in [false, true] {
            for buffers in [false, true] {
                let want = linear_grads(None, bias, buffers, Device::Cpu, (7, 24, 40));
                let got = linear_grads(Some(Engine::Reference), bias, buffers, Device::Cpu, (7, 24, 40));
                assert!(
                    want[0].equal(&got[0]) && want[1].equal(&got[1]),
                    "bias={bias} buffers={buffers}: output or input gradient differs"
                );
                for (k, (a, b)) in want.iter().zip(&got).enumerate().skip(2) {
                    let rel = relative(a, b);
                    assert!(rel < 8e-3, "bias={bias} buffers={buffers}, gradient {k}: relative error {rel}");
                }
            }
        }
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
                for buffers in [false, true] {
                    let want = grads(plain, residual, bias, buffers, dev, Kind::BFloat16, shape);
                    let got = grads(add_norm, residual, bias, buffers, dev, Kind::BFloat16, shape);
                    for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                        let rel = relative(a, b);
                        assert!(
                            rel < 2e-2,
                            "{shape:?} residual={residual} bias={bias} buffers={buffers}, gradient {i}: relative error {rel}"
                        );
                    }
                }
            }
        }
        for tied in [false, true] {
            let (gw, gx, calls) = hook_grads(None, tied, dev);
            let (fw, fx, fcalls) = hook_grads(Some(Engine::Cuda), tied, dev);
            let err = (&gw - &fw).abs().max().double_value(&[]) / gw.abs().max().double_value(&[]);
            let errx = relative(&gx, &fx);
            assert!(err < 8e-3 && errx < 1e-2 && calls == fcalls, "linear on CUDA (tied={tied}): not autograd's gradients ({err}, {errx})");
        }
        for n in [8 * 1000, 8 * 1000 + 5, 3] {
            let w = {
                let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
                Tensor::randn([n], (Kind::Float, dev)) * 100.0
            };
            assert!(kernels::cast_bf16(&w).unwrap().equal(&w.to_kind(Kind::BFloat16)), "cast of {n}: not libtorch's rounding");
        }
        // GPT-2 124M's attention projection (with its bias) and a width not
        // a multiple of the column sums' blocks.
        for shape in [(512, 768, 2304), (33, 64, 8 * 130)] {
            for (bias, buffers) in [(true, false), (true, true), (false, false)] {
                let want = linear_grads(None, bias, buffers, dev, shape);
                let got = linear_grads(Some(Engine::Cuda), bias, buffers, dev, shape);
                for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                    let rel = relative(a, b);
                    assert!(rel < 1e-2, "linear {shape:?} bias={bias} buffers={buffers}, output/gradient {i}: relative error {rel}");
                }
            }
        }
        for shape in [(5, 24), (300, 3072), (64, 8192)] {
            for buffer in [false, true] {
                let want = gelu_grads(false, buffer, dev, Kind::BFloat16, shape);
                let got = gelu_grads(true, buffer, dev, Kind::BFloat16, shape);
                for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                    let rel = relative(a, b);
                    assert!(rel < 2e-2, "GELU {shape:?} buffer={buffer}, output/gradient {i}: relative error {rel}");
                }
            }
        }
    }
}
