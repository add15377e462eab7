//! A transformer's feed-forward layers: the MLP as one node ([`mlp`], the
//! bias and activation in cuBLASLt's epilogues), and the bias and GELU
//! after a linear layer ([`bias_gelu`]).

use tch::{Kind, Tensor};

use harness_kernels::blaslt::Act;
use harness_kernels::kernels;
use harness_kernels::torch_ext::{self, CustomOp};

use super::engine::{reference_forced, Engine};
use super::gemm::{aligned_rows, cast, input_grad, matmul, weight_grad_into_buffer};
use super::grad::Sums;

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

/// A GPT block's or an encoder layer's MLP, `act(h w1^T + b1) w2^T` without the
/// second bias (left to the next [`add_norm`](super::add_norm) or
/// [`post_norm`](super::post_norm)): the autograd node behind [`mlp`]. Inputs
/// `[h, w1, b1, w2]` (`h` `[n, c]`, bf16 or fp32, the weights fp32 `[f, c]` and
/// `[c2, f]`, `b1` fp32 `[f]`), output `[y]` (bf16 `[n, c2]`), kept `[bf16(h),
/// w1 (bf16), w2 (bf16), w1, b1, w2]`. The hidden layer, `m = act(h w1^T +
/// b1)`, and what the derivative needs (`aux`: GELU's pre-activation, ReLU's
/// bitmask) are held by the node itself: the backward pass frees `m` once the
/// second weight's gradient is out and `aux` once the derivative is, as the
/// separate layers' nodes freed them, where autograd would keep kept tensors to
/// the end of the node (at the peak of the backward pass, two more hidden
/// layers alive than before the node existed).
struct Mlp {
    engine: Engine,
    act: Act,
    /// `h`'s kind, for its gradient.
    h_kind: Kind,
    hidden: std::sync::Mutex<Option<(Tensor, Tensor)>>,
}

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
pub(super) fn mlp_with(engine: Engine, act: Act, h: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor) -> Tensor {
    let mut shape = h.size();
    let c = *shape.last().expect("mlp takes rows");
    let h2 = h.reshape([-1, c]);
    let op = Mlp { engine, act, h_kind: h.kind(), hidden: Default::default() };
    let out = torch_ext::custom_op(op, &[&h2, w1, b1, w2]).unwrap_or_else(|e| panic!("{e}"));
    *shape.last_mut().expect("mlp takes rows") = w2.size()[0];
    out[0].view(shape.as_slice())
}
