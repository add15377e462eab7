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
//! The same maths in libtorch operations ([`Engine::Reference`]) runs on the CPU:
//! the tests check the backward pass written out against autograd's there,
//! and the CUDA kernels against it on a GPU.

use tch::{Kind, Tensor};

use harness_kernels::kernels::{self, Norm};
use harness_kernels::torch_ext::{self, CustomOp};

/// A max pooling's window ([`max_pool`]).
pub use harness_kernels::kernels::Pool;

/// LayerNorm's epsilon (as `nn.LayerNorm`).
pub const EPS: f64 = 1e-5;

/// RMS normalisation's epsilon (T5's layer norm).
pub const RMS_EPS: f64 = 1e-6;

/// Whether `HARNESS_FUSED_REFERENCE=1` asks for the libtorch reference on
/// CUDA too (a diagnostic: it tells a kernel's error from the fused layers'
/// own maths, e.g. the bias added in fp32).
fn reference_forced() -> bool {
    harness_format::switches::get().fused_reference
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
        // A buffer the step has not written yet is written over, not added to.
        let first: Vec<bool> = buffers.iter().map(crate::stale::take).collect();
        match self {
            Sums::Partials(part) => part.store_into(&buffers.iter().collect::<Vec<_>>(), &first)?,
            Sums::Tensors(ts) => {
                for ((g, t), first) in buffers.iter().zip(&ts).zip(first) {
                    store(g, t, first)?;
                }
            }
        }
        Ok(params.iter().map(|_| None).collect())
    }
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
fn add_norm_with(
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
/// A layer that writes a buffer asks [`crate::stale::take`] first: the
/// step's first write to a buffer the data parallel code left stale
/// (unzeroed) writes over it instead of adding.
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
    /// The weight is also [`embed`]'s table: without a gradient buffer,
    /// its gradient goes there, for the embedding's backward pass to add
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

/// The backward pass of a linear layer that kept `[bf16(x), bf16(w), w,
/// b?]`, from its output's gradient `dy` (contiguous bf16 rows) and, with a
/// bias, the sums of `dy` over its rows (`bias_sums`): the gradients of `[x
/// (as `x_kind`), w, b?]`, the weight's and the bias's added into their
/// buffers where they have them ([`into_buffer`], [`Sums::deliver`]), the
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
fn qkv_with(engine: Engine, x: &Tensor, w: &Tensor, b: Option<&Tensor>, shape: (i64, i64, i64)) -> (Tensor, Tensor, Tensor) {
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
/// matmul in fp32 and added into its gradient buffer ([`buffer`]) or handed
/// to autograd, and the bias's gradient summed by a kernel of harness's
/// own. Else libtorch's linear (autocast casts the weight).
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

/// [`linear`] without a bias through a weight that is also the table of
/// the [`embed`] that gave `tie`: the output layer of a tied embedding.
pub fn tied_linear(x: &Tensor, w: &Tensor, tie: Option<&Tie>, fused: bool) -> Tensor {
    match tie {
        Some(tie) if fused && w.device().is_cuda() => linear_with(engine(), x, w, None, Some(tie.clone())),
        _ => linear(x, w, None, fused),
    }
}

/// The engine of the fused layers on CUDA.
fn engine() -> Engine {
    if kernels::available() && !reference_forced() {
        Engine::Cuda
    } else {
        Engine::Reference
    }
}

/// [`linear`]'s autograd node on `engine`.
fn linear_with(engine: Engine, x: &Tensor, w: &Tensor, b: Option<&Tensor>, tie: Option<Tie>) -> Tensor {
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

/// A GPT block's or an encoder layer's MLP, `act(h w1^T + b1) w2^T` without
/// the second bias (left to the next [`add_norm`] or [`post_norm`]): the
/// autograd node behind [`mlp`]. Inputs `[h, w1, b1, w2]` (`h` `[n, c]`,
/// bf16 or fp32, the weights fp32 `[f, c]` and `[c2, f]`, `b1` fp32 `[f]`),
/// output `[y]` (bf16 `[n, c2]`), kept `[bf16(h), w1 (bf16), w2 (bf16), w1,
/// b1, w2]`. The hidden layer, `m = act(h w1^T + b1)`, and what the
/// derivative needs (`aux`: GELU's pre-activation, ReLU's bitmask) are held
/// by the node itself: the backward pass frees `m` once the second weight's
/// gradient is out and `aux` once the derivative is, as the separate
/// layers' nodes freed them, where autograd would keep kept tensors to the
/// end of the node (at the peak of the backward pass, two more hidden
/// layers alive than before the node existed).
struct Mlp {
    engine: Engine,
    act: Act,
    /// `h`'s kind, for its gradient.
    h_kind: Kind,
    hidden: std::sync::Mutex<Option<(Tensor, Tensor)>>,
}

pub use harness_kernels::blaslt::Act;

impl CustomOp for Mlp {
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        let [h, w1, b1, w2] = inputs else { anyhow::bail!("mlp: {} inputs", inputs.len()) };
        let h = aligned_rows(h);
        let (w1h, w2h) = (cast(self.engine, w1)?, cast(self.engine, w2)?);
        let (pre, m) = match self.engine {
            Engine::Cuda => harness_kernels::blaslt::act_forward(self.act, &h, &w1h, b1)?,
            Engine::Reference => {
                let b = b1.to_kind(Kind::BFloat16).to_kind(Kind::Float);
                let acc = h.to_kind(Kind::Float).mm(&w1h.to_kind(Kind::Float).tr()) + b;
                let m = match self.act {
                    Act::Gelu => acc.gelu("tanh"),
                    Act::Relu => acc.relu(),
                };
                (acc.to_kind(Kind::BFloat16), m.to_kind(Kind::BFloat16))
            }
        };
        let y = matmul(self.engine, &m, &w2h, None)?;
        *self.hidden.lock().unwrap_or_else(|e| e.into_inner()) = Some((pre, m));
        Ok((vec![y], vec![h, w1h, w2h, w1.shallow_clone(), b1.shallow_clone(), w2.shallow_clone()]))
    }

    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let ([h, w1h, w2h, w1, b1, w2], [dy]) = (saved, grads) else {
            anyhow::bail!("mlp: {} kept, {} gradients", saved.len(), grads.len())
        };
        let hidden = self.hidden.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(dy) = dy else { return Ok((0..4).map(|_| None).collect()) };
        let Some((pre, m)) = hidden else { anyhow::bail!("mlp: the backward pass ran twice (retain_graph is not supported)") };
        let dy = aligned_rows(dy);
        let dw2 = weight_grad_into_buffer(self.engine, &dy, &m, w2)?;
        drop(m);
        let (dpre, db1) = match self.engine {
            Engine::Cuda => match self.act {
                Act::Gelu => {
                    let dpre = harness_kernels::blaslt::dgelu_backward(&dy, w2h, &pre)?;
                    let sums = Sums::Partials(kernels::column_sums_bf16(&dpre)?);
                    (dpre, sums)
                }
                // `pre` is the ReLU's output: the mask of its derivative.
                Act::Relu => {
                    let (dpre, part) = kernels::relu_backward(&input_grad(self.engine, &dy, w2h)?, &pre)?;
                    (dpre, Sums::Partials(part))
                }
            },
            Engine::Reference => {
                let dm = dy.to_kind(Kind::Float).mm(&w2h.to_kind(Kind::Float));
                let d = match self.act {
                    Act::Gelu => pre.to_kind(Kind::Float).gelu_backward(&dm, "tanh"),
                    Act::Relu => dm * pre.gt(0.0),
                };
                let d = d.to_kind(Kind::BFloat16);
                let sums = Sums::Tensors(vec![d.sum_dim_intlist(0, false, Kind::Float)]);
                (d, sums)
            }
        };
        drop(pre);
        let dw1 = weight_grad_into_buffer(self.engine, &dpre, h, w1)?;
        let dh = input_grad(self.engine, &dpre, w1h)?.to_kind(self.h_kind);
        let db1 = db1.deliver(&[b1])?.pop().flatten();
        Ok(vec![Some(dh), dw1, db1, dw2])
    }
}

/// `x` as contiguous bf16 rows starting 16-byte aligned (cuBLASLt's
/// epilogue matmuls take no other): a copy where a view starts elsewhere.
fn aligned_rows(x: &Tensor) -> Tensor {
    let x = x.to_kind(Kind::BFloat16).contiguous();
    if aligned(&[&x]) {
        x
    } else {
        x.copy()
    }
}

/// `w` as bf16 for a matmul: this step's cast ([`WeightCasts`]) where there
/// is one, else cast here (the vectorised kernel on CUDA).
fn cast(engine: Engine, w: &Tensor) -> anyhow::Result<Tensor> {
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
fn matmul(engine: Engine, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> anyhow::Result<Tensor> {
    if lt(engine, &[x, w]) {
        return harness_kernels::blaslt::linear(x, w, b);
    }
    Ok(match b {
        Some(b) => b.to_kind(Kind::BFloat16).f_addmm(x, &w.tr())?,
        None => x.f_mm(&w.tr())?,
    })
}

/// `dy w` in bf16: the input's gradient of [`matmul`].
fn input_grad(engine: Engine, dy: &Tensor, w: &Tensor) -> anyhow::Result<Tensor> {
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
/// gradient buffer (none for autograd), or handed to autograd where `w` has
/// none. Where the matmul runs in cuBLASLt and the buffer is aligned, the
/// matmul adds into the buffer itself (its epilogue reads it: the same fp32
/// sum and rounding), without a temporary and a pass of its own for the add
/// (a flat gradient buffer under ZeRO, or a later micro-batch's backward
/// pass under gradient accumulation).
fn weight_grad_into_buffer(engine: Engine, dy: &Tensor, x: &Tensor, w: &Tensor) -> anyhow::Result<Option<Tensor>> {
    if let Some(b) = buffer(w) {
        if lt(engine, &[dy, x]) && aligned(&[&b]) {
            // The step's first gradient for the buffer: beta = 0.
            let add = !crate::stale::take(&b);
            harness_kernels::blaslt::weight_grad_into(dy, x, &b, add)?;
            return Ok(None);
        }
    }
    into_buffer(w, weight_grad(engine, dy, x)?)
}

/// `g` added into `p`'s gradient buffer (none for autograd), or handed to
/// autograd where `p` has none.
fn into_buffer(p: &Tensor, g: Tensor) -> anyhow::Result<Option<Tensor>> {
    Ok(match buffer(p) {
        Some(b) => {
            store(&b, &g, crate::stale::take(&b))?;
            None
        }
        None => Some(g),
    })
}

/// `g` added into the gradient buffer `b`, or copied over it where `first`
/// (the step's first write to a stale buffer, [`crate::stale`]).
fn store(b: &Tensor, g: &Tensor, first: bool) -> anyhow::Result<()> {
    let mut b = b.shallow_clone();
    if first {
        b.f_copy_(g)?;
    } else {
        let _ = b.f_add_(g)?;
    }
    Ok(())
}

/// Whether [`mlp`] runs on CUDA for `n` rows of `c` channels, `f` hidden
/// units and `c2` outputs with activation `act`: the fused kernels are there
/// and cuBLASLt has algorithms for its two epilogues. `HARNESS_FUSED_MLP=0`
/// keeps the separate layers (a diagnostic).
pub fn mlp_cuda_fits(act: Act, device: tch::Device, n: i64, c: i64, f: i64, c2: i64) -> bool {
    harness_format::switches::get().fused_mlp
        && device.is_cuda()
        && kernels::available()
        && !reference_forced()
        && harness_kernels::blaslt::mlp_fits(act, n, c, f, c2)
}

/// `act(h w1^T + b1) w2^T` (GELU's tanh approximation, or ReLU; the second
/// layer's bias left to the caller) over rows `h` `[.., c]` (bf16, or fp32
/// as a post-norm stream), fp32 weights `w1` `[f, c]`, `w2` `[c2, f]` and
/// bias `b1` `[f]`: one autograd node whose first matmul adds the bias and
/// applies the activation in its epilogue (keeping what its derivative
/// needs), and whose backward pass gets the derivative from the epilogue of
/// the matmul that makes the hidden layer's gradient ([`harness_kernels::blaslt`]) and
/// the bias's gradient from the column-sum kernel. The weights' gradients
/// come out of their matmuls in fp32, into their buffers where they have
/// them. Only on CUDA where [`mlp_cuda_fits`].
pub fn mlp(h: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, act: Act) -> Tensor {
    mlp_with(Engine::Cuda, act, h, w1, b1, w2)
}

/// [`mlp`]'s autograd node on `engine`.
fn mlp_with(engine: Engine, act: Act, h: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor) -> Tensor {
    let mut shape = h.size();
    let c = *shape.last().expect("mlp takes rows");
    let h2 = h.reshape([-1, c]);
    let op = Mlp { engine, act, h_kind: h.kind(), hidden: Default::default() };
    let out = torch_ext::custom_op(op, &[&h2, w1, b1, w2]).unwrap_or_else(|e| panic!("{e}"));
    *shape.last_mut().expect("mlp takes rows") = w2.size()[0];
    out[0].view(shape.as_slice())
}

/// The link between a tied embedding's two uses of its table in one
/// forward pass ([`embed`] and [`tied_linear`]): the output layer's
/// backward pass, which runs first, leaves the table's dense gradient here
/// (where the table has no gradient buffer) instead of handing it to
/// autograd; the embedding's backward pass adds its rows into it and hands
/// autograd the sum. Autograd would otherwise sum a dense gradient from
/// each use: a zero-filled table, a scatter into it, and an add of two
/// tables (about 0.5 ms per step for GPT-2 124M on an H100).
#[derive(Clone, Default)]
pub struct Tie(std::sync::Arc<std::sync::Mutex<Option<Tensor>>>);

impl Tie {
    /// Leaves the output layer's gradient for the embedding (returns none
    /// for autograd).
    fn put(&self, g: Tensor) -> Option<Tensor> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(g);
        None
    }

    /// The output layer's gradient, if its backward pass left one.
    fn take(&self) -> Option<Tensor> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Token plus position embeddings: the autograd node behind [`embed`].
/// Inputs `[idx, wte, wpe]`, output `[x]`, kept `[idx, wte, wpe]`.
struct Embed {
    engine: Engine,
    tie: Tie,
}

impl CustomOp for Embed {
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        let [idx, wte, wpe] = inputs else { anyhow::bail!("embed: {} inputs", inputs.len()) };
        let t = idx.size2()?.1;
        let x = if self.engine == Engine::Cuda && aligned(&[wte, wpe]) {
            kernels::embed(idx, wte, wpe)?
        } else {
            Tensor::f_embedding(wte, idx, -1, false, false)? + wpe.narrow(0, 0, t)
        };
        Ok((vec![x], vec![idx.shallow_clone(), wte.shallow_clone(), wpe.shallow_clone()]))
    }

    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let ([idx, wte, wpe], [dx]) = (saved, grads) else { anyhow::bail!("embed: {} kept, {} gradients", saved.len(), grads.len()) };
        let head = self.tie.take();
        let Some(dx) = dx else { return Ok(vec![None, head, None]) };
        let t = idx.size2()?.1;
        // The table's gradient: its buffer (where the output layer has
        // already added its part), else the output layer's, else zeros.
        let (gwte, wte_out) = match (buffer(wte), head) {
            (Some(g), head) => {
                // The kernel adds the rows: a stale buffer gets the output
                // layer's part or zeros first.
                match (crate::stale::take(&g), head) {
                    (first, Some(h)) => store(&g, &h, first)?,
                    (true, None) => {
                        let _ = g.shallow_clone().f_zero_()?;
                    }
                    (false, None) => {}
                }
                (g, None)
            }
            (None, Some(h)) => (h.shallow_clone(), Some(h)),
            (None, None) => {
                let z = wte.zeros_like();
                (z.shallow_clone(), Some(z))
            }
        };
        // Positions beyond the sequence get no gradient: the kernel writes
        // the first t rows, so a fresh tensor is zeroed where t is shorter.
        let (gwpe, wpe_out, assign) = match buffer(wpe) {
            // A stale buffer: the kernel writes the first t rows over it,
            // and the rest are zeroed where t is shorter.
            Some(g) if crate::stale::take(&g) => {
                if t < wpe.size()[0] {
                    let _ = g.narrow(0, t, wpe.size()[0] - t).f_zero_()?;
                }
                (g, None, true)
            }
            Some(g) => (g, None, false),
            None if t == wpe.size()[0] => {
                let g = wpe.empty_like();
                (g.shallow_clone(), Some(g), true)
            }
            None => {
                let g = wpe.zeros_like();
                (g.shallow_clone(), Some(g), false)
            }
        };
        match self.engine {
            Engine::Cuda if aligned(&[&gwte, &gwpe]) => kernels::embed_backward(idx, dx, &gwte, &gwpe, assign)?,
            _ => {
                let c = gwte.size()[1];
                let d = dx.to_kind(Kind::Float);
                let _ = gwte.shallow_clone().f_index_add_(0, &idx.reshape([-1]), &d.reshape([-1, c]))?;
                let mut rows = gwpe.narrow(0, 0, t);
                let sum = d.sum_dim_intlist(0, false, Kind::Float);
                if assign {
                    rows.copy_(&sum);
                } else {
                    let _ = rows.f_add_(&sum)?;
                }
            }
        }
        Ok(vec![None, wte_out, wpe_out])
    }
}

/// Whether the tensors start 16-byte aligned, as the embedding kernels'
/// vector loads and adds and cuBLASLt's matmuls need (a parameter or
/// gradient inside a ZeRO flat buffer may start anywhere: then libtorch's
/// operations run instead, or a copy).
fn aligned(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| (t.data_ptr() as usize) % 16 == 0)
}

/// Whether [`embed`] runs on CUDA for tables of `c` channels on this
/// device (else a caller keeps libtorch's embeddings).
/// `HARNESS_FUSED_EMBED=0` keeps libtorch's (a diagnostic).
pub fn embed_cuda_fits(c: i64, device: tch::Device) -> bool {
    harness_format::switches::get().fused_embed && device.is_cuda() && kernels::embed_fits(c)
}

/// `wte[idx] + wpe[..t]` for int64 tokens `idx` `[b, t]`: fp32 `[b, t, c]`
/// (the token and position embeddings of GPT-2, before dropout), as one
/// autograd node, and the [`Tie`] for an output layer that shares `wte`
/// ([`tied_linear`]). On CUDA ([`embed_cuda_fits`]) one kernel each way:
/// the backward pass adds each token's row into the table's gradient by
/// atomic adds and sums the positions' over the batch. Elsewhere the same
/// maths in libtorch operations.
pub fn embed(idx: &Tensor, wte: &Tensor, wpe: &Tensor) -> (Tensor, Tie) {
    embed_with(engine(), idx, wte, wpe)
}

/// [`embed`]'s autograd node on `engine`.
fn embed_with(engine: Engine, idx: &Tensor, wte: &Tensor, wpe: &Tensor) -> (Tensor, Tie) {
    let tie = Tie::default();
    let op = Embed { engine, tie: tie.clone() };
    let idx = idx.to_kind(Kind::Int64).contiguous();
    let out = torch_ext::custom_op(op, &[&idx, wte, wpe]).unwrap_or_else(|e| panic!("{e}"));
    (out[0].shallow_clone(), tie)
}

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
fn batch_norm_act_with(engine: Engine, x: &Tensor, bn: &BatchNormParams, res: Option<&Tensor>, relu: bool) -> Tensor {
    let BatchNormParams { w, b, running, momentum, eps } = *bn;
    let running = running.map(|(m, v)| (m.shallow_clone(), v.shallow_clone()));
    let op = BatchNormAct { engine, relu, residual: res.is_some(), running: std::sync::Mutex::new(running), momentum, eps };
    let mut inputs = vec![x, w, b];
    inputs.extend(res);
    let mut out = torch_ext::custom_op(op, &inputs).unwrap_or_else(|e| panic!("{e}"));
    out.pop().expect("batch_norm_act returns its output")
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

    /// The output and gradients (x, f, fb, w, b) of a loss over a post-norm
    /// layer's `LayerNorm(x + f + fb)` on `[n, c]` rows, `f` in `kind`:
    /// through [`post_norm`] (`fused`), or libtorch's add and LayerNorm.
    /// `buffers`: fb, w and b have zeroed gradient buffers beforehand.
    fn post_grads(fused: bool, buffers: bool, dev: Device, kind: Kind, (n, c): (i64, i64)) -> Vec<Tensor> {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(13);
        let leaf = |t: Tensor| t.set_requires_grad(true);
        let x = leaf(Tensor::randn([n, c], (Kind::Float, dev)) * 2.0 + 0.5);
        let f = leaf(Tensor::randn([n, c], (Kind::Float, dev)).to_kind(kind));
        let fb = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1);
        let w = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1 + 1.0);
        let b = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1);
        let p = Tensor::randn([n, c], (Kind::Float, dev));
        let kept: Vec<Tensor> = [&fb, &w, &b].iter().filter(|_| buffers).map(|t| t.zeros_like()).collect();
        for (t, g) in [&fb, &w, &b].iter().zip(&kept) {
            torch_ext::set_grad(t, Some(g)).unwrap();
        }
        let y = if fused { post_norm(&x, &f, Some(&fb), &w, &b) } else { (&x + &f + &fb).layer_norm([c], Some(&w), Some(&b), EPS, false) };
        assert_eq!(y.kind(), Kind::Float, "a post-norm layer's output is the fp32 stream");
        (&y * &p).sum(Kind::Float).backward();
        for (t, g) in [&fb, &w, &b].iter().zip(&kept) {
            assert_eq!(t.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
        }
        assert_eq!(f.grad().kind(), kind, "the branch's gradient is not in its kind");
        vec![y.detach(), x.grad(), f.grad().to_kind(Kind::Float), fb.grad(), w.grad(), b.grad()]
    }

    #[test]
    fn the_post_norm_node_matches_libtorchs_layers() {
        // fp32 on the CPU: the reference's maths against autograd's.
        for buffers in [false, true] {
            let want = post_grads(false, buffers, Device::Cpu, Kind::Float, (6, 16));
            let got = post_grads(true, buffers, Device::Cpu, Kind::Float, (6, 16));
            assert_close(&want, &got, max_error, 1e-4, &format!("buffers={buffers}"));
        }
    }

    #[test]
    fn the_written_out_backward_pass_matches_autograd() {
        // fp32 on the CPU: the reference's maths against autograd's.
        for (residual, bias) in CASES {
            for buffers in [false, true] {
                let want = grads(plain, residual, bias, buffers, Device::Cpu, Kind::Float, (6, 16));
                let got = grads(add_norm, residual, bias, buffers, Device::Cpu, Kind::Float, (6, 16));
                assert_close(&want, &got, max_error, 1e-4, &format!("residual={residual} bias={bias} buffers={buffers}"));
            }
        }
    }

    /// The output, the sum and the gradients (x, w, then f where used) of a
    /// loss over `(x + f, rms_norm(x + f) * w)` on `[n, c]` rows, `f` in
    /// `kind`: through [`add_rms_norm_with`] on `engine`, or (None) T5's
    /// plain composition in libtorch's operations under autograd. `buffer`:
    /// w has a zeroed gradient buffer beforehand.
    fn rms_grads(engine: Option<Engine>, residual: bool, buffer: bool, dev: Device, kind: Kind, (n, c): (i64, i64)) -> Vec<Tensor> {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(17);
        let leaf = |t: Tensor| t.set_requires_grad(true);
        let x = leaf(Tensor::randn([n, c], (Kind::Float, dev)) * 3.0 + 0.5);
        let f = leaf(Tensor::randn([n, c], (Kind::Float, dev)).to_kind(kind));
        let w = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1 + 1.0);
        let (py, pr) = (Tensor::randn([n, c], (Kind::Float, dev)), Tensor::randn([n, c], (Kind::Float, dev)));
        let kept = buffer.then(|| w.zeros_like());
        if let Some(g) = &kept {
            torch_ext::set_grad(&w, Some(g)).unwrap();
        }
        let f_in = residual.then_some(&f);
        let (xo, y) = match engine {
            Some(engine) => {
                let y_kind = if engine == Engine::Cuda { Kind::BFloat16 } else { f_in.map_or(Kind::Float, Tensor::kind) };
                add_norm_with(engine, Norm::Rms, &x, f_in, None, &w, None, y_kind)
            }
            None => {
                let xo = f_in.map_or_else(|| x.shallow_clone(), |f| &x + f);
                let x32 = xo.to_kind(Kind::Float);
                let y = &x32 * (x32.square().mean_dim(-1, true, Kind::Float) + RMS_EPS).rsqrt() * &w;
                (xo, y)
            }
        };
        let loss = (y.to_kind(Kind::Float) * &py).sum(Kind::Float) + (&xo * &pr).sum(Kind::Float);
        loss.backward();
        if let Some(g) = &kept {
            assert_eq!(w.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
        }
        let mut g = vec![y.detach().to_kind(Kind::Float), xo.detach(), x.grad(), w.grad()];
        if residual {
            g.push(f.grad().to_kind(Kind::Float));
        }
        g
    }

    #[test]
    fn the_rms_node_matches_t5s_layer_norm_under_autograd() {
        // fp32 on the CPU: the reference's written-out backward pass
        // against autograd's.
        for residual in [true, false] {
            for buffer in [false, true] {
                let want = rms_grads(None, residual, buffer, Device::Cpu, Kind::Float, (6, 16));
                let got = rms_grads(Some(Engine::Reference), residual, buffer, Device::Cpu, Kind::Float, (6, 16));
                assert_close(&want, &got, max_error, 1e-4, &format!("residual={residual} buffer={buffer}"));
            }
        }
        // Without the fused kernels t5 keeps its own composition; with them
        // on the CPU, the node's reference (rows in the branch's kind).
        // (No random numbers outside GLOBAL_RNG's lock: other tests seed it.)
        let (x, w) = (Tensor::arange(24, (Kind::Float, Device::Cpu)).view([3, 8]), Tensor::ones([8], (Kind::Float, Device::Cpu)));
        let (xo, y) = add_rms_norm(&x, None, &w);
        assert!(xo.equal(&x) && y.kind() == Kind::Float);
    }

    /// Batch norm in training (then the residual and ReLU where asked) on
    /// `[n, c, h, w]` (channels-last on CUDA) in `kind`: the output, the
    /// gradients of x, w, b (and the residual's), and the running mean and
    /// variance after the step; through [`batch_norm_act_with`] on
    /// `engine`, or (None) libtorch's batch norm, add and ReLU.
    fn bn_grads(engine: Option<Engine>, relu: bool, residual: bool, dev: Device, kind: Kind, shape: [i64; 4]) -> Vec<Tensor> {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(23);
        let c = shape[1];
        let layout = |t: Tensor| if dev.is_cuda() { channels_last(&t) } else { t };
        let x = layout((Tensor::randn(shape, (Kind::Float, dev)) * 2.0 + 0.7).to_kind(kind)).set_requires_grad(true);
        let r = layout(Tensor::randn(shape, (Kind::Float, dev)).to_kind(kind)).set_requires_grad(true);
        let w = (Tensor::randn([c], (Kind::Float, dev)) * 0.2 + 1.0).set_requires_grad(true);
        let b = (Tensor::randn([c], (Kind::Float, dev)) * 0.2).set_requires_grad(true);
        let (rm, rv) = (Tensor::randn([c], (Kind::Float, dev)) * 0.1, Tensor::ones([c], (Kind::Float, dev)));
        let p = Tensor::randn(shape, (Kind::Float, dev));
        let res = residual.then_some(&r);
        let y = match engine {
            Some(engine) => {
                let bn = BatchNormParams { w: &w, b: &b, running: Some((&rm, &rv)), momentum: 0.1, eps: 1e-5 };
                batch_norm_act_with(engine, &x, &bn, res, relu)
            }
            None => {
                let mut y = x.batch_norm(Some(&w), Some(&b), Some(&rm), Some(&rv), true, 0.1, 1e-5, false);
                if let Some(r) = res {
                    y = &y + r;
                }
                if relu {
                    y = y.relu();
                }
                y
            }
        };
        assert_eq!(y.kind(), kind, "the output is not in the input's kind");
        (y.to_kind(Kind::Float) * p).sum(Kind::Float).backward();
        let mut out = vec![y.detach().to_kind(Kind::Float), x.grad().to_kind(Kind::Float), w.grad(), b.grad()];
        if residual {
            out.push(r.grad().to_kind(Kind::Float));
        }
        out.extend([rm, rv]);
        out
    }

    #[test]
    fn the_batch_norm_node_matches_libtorchs_layers() {
        // fp32 on the CPU: the reference's written-out backward pass
        // against autograd's, the running statistics as torch's.
        for (relu, residual) in [(true, true), (true, false), (false, false)] {
            let want = bn_grads(None, relu, residual, Device::Cpu, Kind::Float, [4, 16, 5, 3]);
            let got = bn_grads(Some(Engine::Reference), relu, residual, Device::Cpu, Kind::Float, [4, 16, 5, 3]);
            assert_close(&want, &got, max_error, 1e-4, &format!("relu={relu} residual={residual}"));
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
            assert_close(&want, &got, max_error, 1e-4, &format!("buffer={buffer}"));
        }
    }

    /// The largest absolute difference between `a` and `b`.
    fn max_error(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    /// Asserts each of `got` within `tol` of the same place in `want` by
    /// `error` ([`max_error`] or [`relative`]); `case` names the case.
    fn assert_close(want: &[Tensor], got: &[Tensor], error: fn(&Tensor, &Tensor) -> f64, tol: f64, case: &str) {
        assert_eq!(want.len(), got.len(), "{case}: {} outputs and gradients against {}", got.len(), want.len());
        for (i, (a, b)) in want.iter().zip(got).enumerate() {
            let e = error(a, b);
            assert!(e < tol, "{case}, output/gradient {i}: error {e} (tolerance {tol})");
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
                Some(e) => linear_with(e, &x, &w, None, None),
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
        linear_with(Engine::Reference, &x, &w, None, None).to_kind(Kind::Float).sum(Kind::Float).backward();
        assert!(w.grad().equal(&Tensor::full([3, 4], 2.0, (Kind::Float, Device::Cpu))));
    }

    /// The output and the gradients (x, w, then b) of a loss over a linear
    /// layer of `n` rows, `i` to `o`: through [`Linear`] on `engine`, or
    /// (None) as autocast computes it (bf16 casts, then libtorch's matmul
    /// and autograd). `buffers`: w and b have zeroed gradient buffers, which
    /// must then hold their gradients. `x` is bf16 (a pre-norm block's
    /// LayerNorm output) or fp32 (a post-norm encoder's residual stream),
    /// and its gradient comes back in its kind.
    fn linear_grads(
        engine: Option<Engine>,
        bias: bool,
        buffers: bool,
        dev: Device,
        x_kind: Kind,
        (n, i, o): (i64, i64, i64),
    ) -> Vec<Tensor> {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(17);
        let x = Tensor::randn([2, n, i], (Kind::Float, dev)).to_kind(Kind::BFloat16).to_kind(x_kind).set_requires_grad(true);
        let w = (Tensor::randn([o, i], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
        let b = (Tensor::randn([o], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
        let p = Tensor::randn([2, n, o], (Kind::Float, dev));
        let kept: Vec<Tensor> = [&w, &b].iter().filter(|_| buffers).map(|t| t.zeros_like()).collect();
        for (t, g) in [&w, &b].iter().zip(&kept) {
            torch_ext::set_grad(t, Some(g)).unwrap();
        }
        let bias_in = bias.then_some(&b);
        let y = match engine {
            Some(e) => linear_with(e, &x, &w, bias_in, None),
            None => x.to_kind(Kind::BFloat16).linear(&w.to_kind(Kind::BFloat16), bias_in.map(|b| b.to_kind(Kind::BFloat16))),
        };
        assert_eq!((y.size(), y.kind()), (vec![2, n, o], Kind::BFloat16));
        (y.to_kind(Kind::Float) * p).sum(Kind::Float).backward();
        assert_eq!(x.grad().kind(), x_kind, "the input's gradient is not in the input's kind");
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
        for x_kind in [Kind::BFloat16, Kind::Float] {
            for bias in [false, true] {
                for buffers in [false, true] {
                    let want = linear_grads(None, bias, buffers, Device::Cpu, x_kind, (7, 24, 40));
                    let got = linear_grads(Some(Engine::Reference), bias, buffers, Device::Cpu, x_kind, (7, 24, 40));
                    let case = format!("{x_kind:?} input, bias={bias} buffers={buffers}");
                    assert!(want[0].equal(&got[0]) && want[1].equal(&got[1]), "{case}: output or input gradient differs");
                    for (k, (a, b)) in want.iter().zip(&got).enumerate().skip(2) {
                        let rel = relative(a, b);
                        assert!(rel < 8e-3, "{case}, gradient {k}: relative error {rel}");
                    }
                }
            }
        }
    }

    /// The outputs and gradients (x, w, b) of a loss over a q, k, v
    /// projection of `[2, t, c]` split into `heads` heads: through
    /// [`QkvProj`] (`fused`), or through the linear node and autograd's
    /// split, both on `engine`. `buffers`: w and b have zeroed gradient
    /// buffers, which must then hold their gradients.
    fn qkv_grads(fused: bool, engine: Engine, buffers: bool, dev: Device, x_kind: Kind, (t, c, heads): (i64, i64, i64)) -> Vec<Tensor> {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(23);
        let x = Tensor::randn([2, t, c], (Kind::Float, dev)).to_kind(x_kind).set_requires_grad(true);
        let w = (Tensor::randn([3 * c, c], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
        let b = (Tensor::randn([3 * c], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
        let ps: Vec<Tensor> = (0..3).map(|_| Tensor::randn([2, heads, t, c / heads], (Kind::Float, dev))).collect();
        let kept: Vec<Tensor> = [&w, &b].iter().filter(|_| buffers).map(|t| t.zeros_like()).collect();
        for (t, g) in [&w, &b].iter().zip(&kept) {
            torch_ext::set_grad(t, Some(g)).unwrap();
        }
        let (q, k, v) = if fused {
            qkv_with(engine, &x, &w, Some(&b), (2, t, heads))
        } else {
            let y = linear_with(engine, &x, &w, Some(&b), None);
            let parts = y.view([2, t, 3, heads, c / heads]).unbind(2);
            (parts[0].transpose(1, 2), parts[1].transpose(1, 2), parts[2].transpose(1, 2))
        };
        // Only q and v reach the loss: k's gradient is none.
        let loss = (q.to_kind(Kind::Float) * &ps[0]).sum(Kind::Float) + (v.to_kind(Kind::Float) * &ps[2]).sum(Kind::Float);
        loss.backward();
        for (t, g) in [&w, &b].iter().zip(&kept) {
            assert_eq!(t.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
        }
        assert_eq!(x.grad().kind(), x_kind, "the input's gradient is not in the input's kind");
        vec![q.to_kind(Kind::Float), k.to_kind(Kind::Float), v.to_kind(Kind::Float), x.grad().to_kind(Kind::Float), w.grad(), b.grad()]
    }

    #[test]
    fn the_qkv_node_gives_the_linear_layers_and_splits_gradients() {
        // The same matmuls on the same packed gradient: equal, bit for bit.
        for x_kind in [Kind::BFloat16, Kind::Float] {
            for buffers in [false, true] {
                let want = qkv_grads(false, Engine::Reference, buffers, Device::Cpu, x_kind, (5, 24, 3));
                let got = qkv_grads(true, Engine::Reference, buffers, Device::Cpu, x_kind, (5, 24, 3));
                for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                    assert!(a.equal(b), "{x_kind:?} input, buffers={buffers}: output or gradient {i} differs");
                }
            }
        }
    }

    /// The output and gradients (h, w1, b1, w2) of a loss over a GPT
    /// block's (`act` GELU, `h` bf16) or an encoder layer's (ReLU, fp32)
    /// MLP (`n` rows of `c`, `f` hidden units): through [`Mlp`] on `engine`,
    /// or (None) as autocast computes the two layers and the activation in
    /// libtorch. `buffers`: the parameters have zeroed gradient buffers,
    /// which must then hold their gradients.
    fn mlp_grads(engine: Option<Engine>, act: Act, buffers: bool, dev: Device, (n, c, f): (i64, i64, i64)) -> Vec<Tensor> {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(29);
        let h_kind = if act == Act::Gelu { Kind::BFloat16 } else { Kind::Float };
        let h = Tensor::randn([2, n, c], (Kind::Float, dev)).to_kind(Kind::BFloat16).to_kind(h_kind).set_requires_grad(true);
        let w1 = (Tensor::randn([f, c], (Kind::Float, dev)) * 0.05).set_requires_grad(true);
        let b1 = (Tensor::randn([f], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
        let w2 = (Tensor::randn([c, f], (Kind::Float, dev)) * 0.05).set_requires_grad(true);
        let p = Tensor::randn([2, n, c], (Kind::Float, dev));
        let params = [&w1, &b1, &w2];
        let kept: Vec<Tensor> = params.iter().filter(|_| buffers).map(|t| t.zeros_like()).collect();
        for (t, g) in params.iter().zip(&kept) {
            torch_ext::set_grad(t, Some(g)).unwrap();
        }
        let y = match engine {
            Some(e) => mlp_with(e, act, &h, &w1, &b1, &w2),
            None => {
                let bf = |t: &Tensor| t.to_kind(Kind::BFloat16);
                let pre = bf(&h).linear(&bf(&w1), Some(&bf(&b1)));
                let m = if act == Act::Gelu { pre.gelu("tanh") } else { pre.relu() };
                m.linear::<Tensor>(&bf(&w2), None)
            }
        };
        assert_eq!((y.size(), y.kind()), (vec![2, n, c], Kind::BFloat16));
        (y.to_kind(Kind::Float) * p).sum(Kind::Float).backward();
        for (t, g) in params.iter().zip(&kept) {
            assert_eq!(t.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
        }
        assert_eq!(h.grad().kind(), h_kind, "the input's gradient is not in the input's kind");
        vec![y.to_kind(Kind::Float), h.grad().to_kind(Kind::Float), w1.grad(), b1.grad(), w2.grad()]
    }

    #[test]
    fn the_mlp_node_gives_autocasts_gradients() {
        // The reference sums in fp32 where autocast rounds to bf16 between
        // steps (the bias added in bf16, the weights' gradients rounded):
        // the same within bf16's epsilon, relative to each tensor's size.
        for act in [Act::Gelu, Act::Relu] {
            for buffers in [false, true] {
                let want = mlp_grads(None, act, buffers, Device::Cpu, (9, 16, 64));
                let got = mlp_grads(Some(Engine::Reference), act, buffers, Device::Cpu, (9, 16, 64));
                assert_close(&want, &got, relative, 2e-2, &format!("{act:?} buffers={buffers}"));
            }
        }
    }

    /// The gradients (wte, wpe) of a loss over GPT-2's embeddings of `b x t`
    /// tokens (`seq` positions, `v` words, `c` channels) and, with `tied`,
    /// an output layer through the same table: through [`Embed`] and
    /// [`tied_linear`]'s node on `engine`, or (None) as libtorch's
    /// embeddings and autocast's linear layer compute them. `buffers`: the
    /// tables have zeroed gradient buffers, which must then hold them.
    fn embed_grads(
        engine: Option<Engine>,
        tied: bool,
        buffers: bool,
        dev: Device,
        (b, t, seq, v, c): (i64, i64, i64, i64, i64),
    ) -> Vec<Tensor> {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(23);
        let wte = (Tensor::randn([v, c], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
        let wpe = (Tensor::randn([seq, c], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
        // Few words, so that tokens repeat within and across rows.
        let idx = Tensor::randint(v, [b, t], (Kind::Int64, dev));
        let p = Tensor::randn([b, t, c], (Kind::Float, dev));
        let q = Tensor::randn([b, t, v], (Kind::Float, dev));
        let kept: Vec<Tensor> = [&wte, &wpe].iter().filter(|_| buffers).map(|w| w.zeros_like()).collect();
        for (w, g) in [&wte, &wpe].iter().zip(&kept) {
            torch_ext::set_grad(w, Some(g)).unwrap();
        }
        let (x, head) = match engine {
            Some(e) => {
                let (x, tie) = embed_with(e, &idx, &wte, &wpe);
                let head = tied.then(|| linear_with(e, &x.to_kind(Kind::BFloat16), &wte, None, Some(tie)));
                (x, head)
            }
            None => {
                let pos = Tensor::arange(t, (Kind::Int64, dev));
                let x = Tensor::embedding(&wte, &idx, -1, false, false) + Tensor::embedding(&wpe, &pos, -1, false, false);
                let head = tied.then(|| x.to_kind(Kind::BFloat16).linear::<Tensor>(&wte.to_kind(Kind::BFloat16), None));
                (x, head)
            }
        };
        assert_eq!((x.size(), x.kind()), (vec![b, t, c], Kind::Float));
        let mut loss = (&x * &p).sum(Kind::Float);
        if let Some(h) = head {
            loss += (h.to_kind(Kind::Float) * &q).sum(Kind::Float);
        }
        loss.backward();
        for (w, g) in [&wte, &wpe].iter().zip(&kept) {
            assert_eq!(w.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
        }
        vec![x.detach(), wte.grad(), wpe.grad()]
    }

    /// `embed_grads` through `engine` against libtorch, every case: tied or
    /// not, gradient buffers or not, all positions or fewer.
    fn check_embed(engine: Engine, dev: Device, shapes: &[(i64, i64, i64, i64, i64)]) {
        for &shape in shapes {
            for tied in [false, true] {
                for buffers in [false, true] {
                    let want = embed_grads(None, tied, buffers, dev, shape);
                    let got = embed_grads(Some(engine), tied, buffers, dev, shape);
                    assert!(want[0].equal(&got[0]), "{shape:?}: the embeddings differ");
                    for (k, (a, b)) in want.iter().zip(&got).enumerate().skip(1) {
                        // The output layer's part of the table's gradient is
                        // summed in fp32, autocast's rounded to bf16.
                        let rel = relative(a, b);
                        let tol = if tied && k == 1 { 8e-3 } else { 1e-5 };
                        assert!(rel < tol, "{shape:?} tied={tied} buffers={buffers}, gradient {k}: relative error {rel}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_embedding_node_gives_libtorchs_gradients() {
        check_embed(Engine::Reference, Device::Cpu, &[(3, 8, 8, 11, 16), (2, 5, 8, 7, 12)]);
    }

    #[test]
    fn cuda_max_pool_matches_libtorch() {
        if !harness_runtime::device::init_cuda() {
            eprintln!("skipped: no CUDA device (this test runs on the GPU machines)");
            return;
        }
        let dev = Device::Cuda(0);
        // ResNet's stem pooling at its size, odd sides, other windows; values
        // on a coarse grid so that windows hold ties (the first maximum in
        // row-major order wins, as libtorch's), and a NaN.
        let stem = Pool { k: 3, stride: 2, pad: 1 };
        let cases = [
            ([32, 64, 112, 112], stem),
            ([3, 8, 7, 9], stem),
            ([2, 16, 10, 11], Pool { k: 2, stride: 2, pad: 0 }),
            ([2, 24, 9, 8], Pool { k: 3, stride: 1, pad: 1 }),
            ([1, 8, 13, 13], Pool { k: 5, stride: 3, pad: 2 }),
        ];
        for (shape, pool) in cases {
            let (x, dy) = {
                let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
                let x = Tensor::randint(7, shape, (Kind::Float, dev)) - 3.0;
                let y_shape = [shape[0], shape[1], pool.out(shape[2]), pool.out(shape[3])];
                (x, Tensor::randn(y_shape, (Kind::Float, dev)).to_kind(Kind::BFloat16))
            };
            let x = channels_last(&x.to_kind(Kind::BFloat16));
            let _ = x.permute([0, 2, 3, 1]).view([-1]).get(5).fill_(f64::NAN);
            assert!(max_pool_cuda_fits(&x, pool), "{shape:?} {pool:?}: the kernels should take it");
            let run = |fused: bool| {
                let x = x.detach().set_requires_grad(true);
                let y = if fused { max_pool(&x, pool) } else { libtorch_max_pool(&x, pool) };
                (y.to_kind(Kind::Float) * dy.to_kind(Kind::Float)).sum(Kind::Float).backward();
                (y.detach(), x.grad())
            };
            let ((y, dx), (want_y, want_dx)) = (run(true), run(false));
            let case = format!("max pool {shape:?} {pool:?}");
            assert!(is_channels_last(&y) && y.size() == want_y.size(), "{case}: the output's shape or layout");
            assert!(
                y.isnan().equal(&want_y.isnan()) && y.nan_to_num(0.0, None, None).equal(&want_y.nan_to_num(0.0, None, None)),
                "{case}: outputs differ"
            );
            let err = relative(&want_dx, &dx);
            assert!(err < 1e-3, "{case}: the input's gradient differs ({err})");
        }
    }

    #[test]
    fn cuda_weight_gradient_added_by_the_matmul() {
        if !harness_runtime::device::init_cuda() {
            eprintln!("skipped: no CUDA device (this test runs on the GPU machines)");
            return;
        }
        let dev = Device::Cuda(0);
        // A weight's gradient added into its buffer by the matmul itself
        // (its epilogue reads the buffer): the matmul's fp32 sums plus the
        // buffer, as the gradient out of the matmul followed by an fp32 add.
        for (n, o, k) in [(512, 2304, 768), (33, 8 * 130, 64)] {
            let (dy, x, into) = {
                let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
                let bf = |s: [i64; 2]| Tensor::randn(s, (Kind::Float, dev)).to_kind(Kind::BFloat16);
                (bf([n, o]), bf([n, k]), Tensor::randn([o, k], (Kind::Float, dev)))
            };
            let want = &into + harness_kernels::blaslt::weight_grad(&dy, &x).unwrap();
            let got = into.copy();
            harness_kernels::blaslt::weight_grad_into(&dy, &x, &got, true).unwrap();
            let err = (&want - &got).abs().max().double_value(&[]) / want.abs().max().double_value(&[]);
            assert!(err < 1e-6, "weight gradient added by the matmul [{n}, {o}, {k}]: relative error {err}");
            // A step's first write (beta = 0) never reads the buffer: NaNs
            // there are overwritten with the matmul's sums, bit for bit.
            let stale = Tensor::full([o, k], f64::NAN, (Kind::Float, dev));
            harness_kernels::blaslt::weight_grad_into(&dy, &x, &stale, false).unwrap();
            assert!(stale.equal(&harness_kernels::blaslt::weight_grad(&dy, &x).unwrap()), "the first write [{n}, {o}, {k}] differs");
        }
    }

    #[test]
    fn cuda_kernels_match_the_reference() {
        if !harness_runtime::device::init_cuda() {
            eprintln!("skipped: no CUDA device (this test runs on the GPU machines)");
            return;
        }
        let dev = Device::Cuda(0);
        // A warp per row (768; 256 with several rows per warp) and a
        // block per row (16, 2048).
        for shape in [(6, 16), (300, 768), (5000, 256), (64, 2048)] {
            for (residual, bias) in CASES {
                for buffers in [false, true] {
                    let want = grads(plain, residual, bias, buffers, dev, Kind::BFloat16, shape);
                    let got = grads(add_norm, residual, bias, buffers, dev, Kind::BFloat16, shape);
                    assert_close(&want, &got, relative, 2e-2, &format!("{shape:?} residual={residual} bias={bias} buffers={buffers}"));
                }
            }
        }
        // RMS normalisation (t5): T5-large's and T5-small's widths (a warp
        // per row), a block per row (2048) and a width of several rows per
        // warp, against the plain composition in fp32.
        for shape in [(300, 1024), (700, 512), (64, 2048), (5000, 256), (6, 16)] {
            for residual in [true, false] {
                for buffer in [false, true] {
                    let want = rms_grads(None, residual, buffer, dev, Kind::BFloat16, shape);
                    let got = rms_grads(Some(Engine::Cuda), residual, buffer, dev, Kind::BFloat16, shape);
                    assert_close(&want, &got, relative, 1e-2, &format!("RMS {shape:?} residual={residual} buffer={buffer}"));
                }
            }
        }
        // Batch norm with its ReLU and residual (ResNet-50's widths and
        // positions per image, a 7 x 7 one of 2048 channels, and the
        // smallest width), channels-last bf16, against the reference's
        // maths on the same device (fp32, rounded to bf16 at the end, as
        // the kernels) and, more loosely, against libtorch's layers: their
        // bf16 rounding before the ReLU flips its mask where the input is
        // near 0, and the gradient differs there by the whole of dy.
        for shape in [[8, 64, 28, 28], [4, 256, 14, 14], [6, 2048, 7, 7], [3, 8, 5, 5], [2, 512, 7, 9]] {
            for (relu, residual) in [(true, true), (true, false), (false, false)] {
                let case = format!("batch norm {shape:?} relu={relu} residual={residual}");
                let got = bn_grads(Some(Engine::Cuda), relu, residual, dev, Kind::BFloat16, shape);
                let want = bn_grads(Some(Engine::Reference), relu, residual, dev, Kind::BFloat16, shape);
                assert_close(&want, &got, relative, 1e-2, &case);
                let libtorch = bn_grads(None, relu, residual, dev, Kind::BFloat16, shape);
                assert_close(&libtorch, &got, relative, 6e-2, &format!("{case}, against libtorch"));
            }
        }
        // A batch norm weight and bias inside a flat buffer (ZeRO), 4 bytes
        // off 16: the same results as aligned copies (the kernels load 8
        // channels at a time).
        {
            let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
            let (m, c) = (512, 64);
            let x = Tensor::randn([m, c], (Kind::Float, dev)).to_kind(Kind::BFloat16);
            let dy = Tensor::randn([m, c], (Kind::Float, dev)).to_kind(Kind::BFloat16);
            let flat = Tensor::randn([1 + 2 * c], (Kind::Float, dev));
            let (w, b) = (flat.narrow(0, 1, c), flat.narrow(0, 1 + c, c));
            let run = |w: &Tensor, b: &Tensor| {
                let out = kernels::batch_norm(&x, w, b, None, None, 0.1, 1e-5, true).unwrap();
                let (dx, _, sums) = kernels::batch_norm_backward(&dy, out.relu_mask.as_ref(), &x, &out.mean, &out.rstd, w, false).unwrap();
                [out.y, dx, sums]
            };
            let (off, aligned) = (run(&w, &b), run(&w.copy(), &b.copy()));
            assert!(off.iter().zip(&aligned).all(|(a, b)| a.equal(b)), "batch norm: an unaligned weight changed the results");
            // The ReLU's mask: bit j of byte i where y's element 8 i + j is
            // above 0, bit for bit.
            let out = kernels::batch_norm(&x, &w, &b, None, None, 0.1, 1e-5, true).unwrap();
            let weights = Tensor::from_slice(&[1i64, 2, 4, 8, 16, 32, 64, 128]).to_device(dev);
            let want = (out.y.gt(0.0).to_kind(Kind::Int64).view([-1, 8]) * weights).sum_dim_intlist(1, false, Kind::Int64);
            let mask = out.relu_mask.expect("a mask with the ReLU").to_kind(Kind::Int64);
            assert!(mask.equal(&want), "batch norm: the ReLU's mask is not y > 0");
        }
        // Post-norm (fp32 rows out, fp32 gradients in): the claims5
        // encoder's width, a block per row (2048), several rows per warp.
        for shape in [(300, 512), (64, 2048), (5000, 256)] {
            for buffers in [false, true] {
                let want = post_grads(false, buffers, dev, Kind::BFloat16, shape);
                let got = post_grads(true, buffers, dev, Kind::BFloat16, shape);
                assert_close(&want, &got, relative, 1e-2, &format!("post-norm {shape:?} buffers={buffers}"));
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
        // The list cast: more tensors than one launch takes, sizes off the
        // chunk and the vector width, one view not 16-byte aligned.
        {
            let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
            let mut ws: Vec<Tensor> = (0..60).map(|i| Tensor::randn([3 + 7 * i, 16400 + i], (Kind::Float, dev)) * 10.0).collect();
            ws.push(Tensor::randn([1001], (Kind::Float, dev)).narrow(0, 1, 1000));
            let casts = kernels::cast_bf16_list(&ws).unwrap();
            for (i, (w, c)) in ws.iter().zip(&casts).enumerate() {
                assert!(c.equal(&w.to_kind(Kind::BFloat16)), "list cast {i}: not libtorch's rounding");
            }
        }
        // GPT-2 124M's attention projection (with its bias) and a width not
        // a multiple of the column sums' blocks.
        // The claims5 encoder's feed-forward layer takes fp32 rows (its
        // post-norm residual stream).
        for (shape, x_kind) in [((512, 768, 2304), Kind::BFloat16), ((33, 64, 8 * 130), Kind::BFloat16), ((256, 512, 2048), Kind::Float)] {
            for (bias, buffers) in [(true, false), (true, true), (false, false)] {
                let want = linear_grads(None, bias, buffers, dev, x_kind, shape);
                let got = linear_grads(Some(Engine::Cuda), bias, buffers, dev, x_kind, shape);
                assert_close(&want, &got, relative, 1e-2, &format!("linear {shape:?} {x_kind:?} bias={bias} buffers={buffers}"));
            }
        }
        // The q, k, v node's packing kernel against the linear node and
        // autograd's split: GPT-2 124M's widths, and a width not a multiple
        // of the kernel's blocks (its bias sums in another order).
        // The claims5 encoder's projection takes fp32 rows.
        for (shape, x_kind) in [((256, 768, 12), Kind::BFloat16), ((33, 64 * 5, 5), Kind::BFloat16), ((128, 512, 8), Kind::Float)] {
            for buffers in [false, true] {
                let want = qkv_grads(false, Engine::Cuda, buffers, dev, x_kind, shape);
                let got = qkv_grads(true, Engine::Cuda, buffers, dev, x_kind, shape);
                assert_close(&want, &got, relative, 1e-5, &format!("qkv {shape:?} {x_kind:?} buffers={buffers}"));
            }
        }
        for shape in [(5, 24), (300, 3072), (64, 8192)] {
            for buffer in [false, true] {
                let want = gelu_grads(false, buffer, dev, Kind::BFloat16, shape);
                let got = gelu_grads(true, buffer, dev, Kind::BFloat16, shape);
                assert_close(&want, &got, relative, 2e-2, &format!("GELU {shape:?} buffer={buffer}"));
            }
        }
        // cuBLASLt's epilogues against the reference (GPT-2 124M's and the
        // claims5 encoder's widths, and small ones), where cuBLASLt has
        // algorithms for them.
        for (act, shape) in
            [(Act::Gelu, (512, 768, 3072)), (Act::Gelu, (40, 64, 256)), (Act::Relu, (512, 512, 2048)), (Act::Relu, (40, 64, 256))]
        {
            if !harness_kernels::blaslt::mlp_fits(act, 2 * shape.0, shape.1, shape.2, shape.1) {
                eprintln!("cuBLASLt has no {act:?} epilogues for {shape:?}: the fused MLP is not used there");
                continue;
            }
            for buffers in [false, true] {
                let want = mlp_grads(Some(Engine::Reference), act, buffers, dev, shape);
                let got = mlp_grads(Some(Engine::Cuda), act, buffers, dev, shape);
                assert_close(&want, &got, relative, 2e-2, &format!("{act:?} MLP {shape:?} buffers={buffers}"));
            }
        }
        // The epilogue's GELU is the tanh approximation (GPT-2's), not erf:
        // pre-activations near -2.5, where the two differ by more than
        // bf16's step at the output's size.
        {
            let (n, c, f) = (64i64, 64i64, 128i64);
            let h = Tensor::ones([n, c], (Kind::BFloat16, dev));
            let w = (Tensor::linspace(-2.0, -3.0, f, (Kind::Float, dev)) / c as f64).unsqueeze(1).expand([f, c], false).contiguous();
            let b = Tensor::zeros([f], (Kind::Float, dev));
            let (pre, m) = harness_kernels::blaslt::act_forward(Act::Gelu, &h, &w.to_kind(Kind::BFloat16), &b).unwrap();
            let x = pre.to_kind(Kind::Float);
            let m = m.to_kind(Kind::Float);
            let tanh = (&m - x.gelu("tanh")).abs().max().double_value(&[]);
            let erf = (&m - x.gelu("none")).abs().max().double_value(&[]);
            assert!(tanh < erf, "cuBLASLt's GELU is closer to erf ({erf}) than to tanh ({tanh})");
        }
        // GPT-2's widths, a row of 4 channels, and fewer positions than the
        // table: the kernels against libtorch (atomic adds in another order).
        check_embed(Engine::Cuda, dev, &[(4, 64, 64, 50, 768), (3, 5, 8, 7, 4), (2, 100, 128, 1000, 1600)]);
        // Tables that start off 16 bytes (as in a ZeRO flat buffer): the
        // node runs libtorch's maths instead of the vector kernels.
        {
            let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
            let flat = Tensor::randn([1 + 50 * 8 + 16 * 8], (Kind::Float, dev));
            let wte = flat.narrow(0, 1, 50 * 8).view([50, 8]).detach().set_requires_grad(true);
            let wpe = flat.narrow(0, 1 + 50 * 8, 16 * 8).view([16, 8]).detach().set_requires_grad(true);
            let idx = Tensor::randint(50, [2, 16], (Kind::Int64, dev));
            let (x, _) = embed_with(Engine::Cuda, &idx, &wte, &wpe);
            x.sum(Kind::Float).backward();
            let pos = Tensor::arange(16, (Kind::Int64, dev));
            let want = Tensor::embedding(&wte, &idx, -1, false, false) + Tensor::embedding(&wpe, &pos, -1, false, false);
            assert!(x.allclose(&want, 1e-6, 1e-6, false), "unaligned tables: wrong embeddings");
            let counts = Tensor::zeros([50], (Kind::Float, dev)).index_add(0, &idx.reshape([-1]), &Tensor::ones([32], (Kind::Float, dev)));
            assert!(
                wte.grad().sum_dim_intlist(1, false, Kind::Float).allclose(&(counts * 8.0), 1e-5, 1e-5, false),
                "unaligned tables: wrong gradient"
            );
        }
    }
}
