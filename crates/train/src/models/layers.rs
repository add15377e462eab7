//! The layers the model families share: LayerNorm (with the fused add +
//! LayerNorm nodes), residual branches, attention (through the fused q, k, v
//! node on CUDA), the feed-forward blocks, and a forward pass's shape.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use super::fused;

/// Mean next-token cross-entropy of `[n, vocab]` logits.
///
/// On CUDA, fp16 logits go straight into log-softmax with fp32 output
/// (`_log_softmax(half_to_float)`, not an autocast op), skipping the fp32
/// copy of the logits that autocast's cross_entropy writes first; libtorch
/// 2.11 has that conversion for Half only, so bf16 takes the autocast path.
pub fn token_loss(logits: &Tensor, target: &Tensor) -> Tensor {
    if logits.kind() == Kind::Half && logits.device().is_cuda() {
        logits.internal_log_softmax(-1, true).nll_loss(target)
    } else {
        logits.cross_entropy_loss::<Tensor>(target, None, tch::Reduction::Mean, -100, 0.0)
    }
}

/// `x + f`, a new tensor (see the GPT block).
pub(crate) fn residual(x: &Tensor, f: Tensor) -> Tensor {
    x + f
}

/// Dropout that issues no kernel at all when it would do nothing.
pub(crate) fn dropout(x: Tensor, p: f64, train: bool) -> Tensor {
    if train && p > 0.0 {
        x.dropout(p, true)
    } else {
        x
    }
}

pub(crate) fn linear(p: nn::Path, i: i64, o: i64, std: f64) -> nn::Linear {
    let cfg = nn::LinearConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: std }, bs_init: Some(nn::Init::Const(0.0)), bias: true };
    nn::linear(p, i, o, cfg)
}

/// A linear layer sharing `l`'s parameters (for a recomputed layer, which
/// must own what it uses).
pub(crate) fn share(l: &nn::Linear) -> nn::Linear {
    nn::Linear { ws: l.ws.shallow_clone(), bs: l.bs.as_ref().map(Tensor::shallow_clone) }
}

/// LayerNorm over the last dimension, as `nn.LayerNorm(d)` (eps 1e-5):
/// `tch`'s own keeps its configuration private, so a layer could not own a
/// copy sharing its parameters.
pub struct Norm {
    ws: Tensor,
    bs: Tensor,
    d: i64,
}

impl Norm {
    pub(crate) fn new(p: nn::Path, d: i64) -> Norm {
        let ln = nn::layer_norm(p, vec![d], Default::default());
        Norm { ws: ln.ws.expect("affine"), bs: ln.bs.expect("affine"), d }
    }

    /// Its weight and bias.
    pub(crate) fn params(&self) -> Vec<&Tensor> {
        vec![&self.ws, &self.bs]
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Tensor {
        x.layer_norm([self.d], Some(&self.ws), Some(&self.bs), fused::EPS, true)
    }

    /// `(x + f, LayerNorm(x + f))`, or `(x, LayerNorm(x))` without `f`:
    /// with `fused`, through [`fused::add_norm`] (the normalised rows in
    /// bf16), else libtorch's add and LayerNorm.
    pub(crate) fn add_forward(&self, x: &Tensor, f: Option<&Branch>, fused: bool) -> (Tensor, Tensor) {
        if fused && fused::cuda_fits(self.d, x.device()) {
            return fused::add_norm(x, f.map(|f| &f.out), f.and_then(|f| f.bias.as_ref()), &self.ws, &self.bs);
        }
        let x = f.map_or_else(|| x.shallow_clone(), |f| residual(x, f.value()));
        let y = self.forward(&x);
        (x, y)
    }

    /// `LayerNorm(x + f)`, a post-norm layer's residual add and LayerNorm
    /// (fp32 out, the next residual stream): with `fused`, through
    /// [`fused::post_norm`] with the branch's pending bias added there,
    /// else libtorch's add and LayerNorm.
    pub(crate) fn post_forward(&self, x: &Tensor, f: &Branch, fused: bool) -> Tensor {
        if fused && fused::post_norm_cuda_fits(self.d, x.device()) {
            return fused::post_norm(x, &f.out, f.bias.as_ref(), &self.ws, &self.bs);
        }
        self.forward(&residual(x, f.value()))
    }

    pub(crate) fn share(&self) -> Norm {
        Norm { ws: self.ws.shallow_clone(), bs: self.bs.shallow_clone(), d: self.d }
    }
}

/// A branch's output not yet added to the residual stream. With the fused
/// kernels, the bias of the linear layer that made it is added with it (in
/// [`fused::add_norm`]), not in the matmul.
pub(crate) struct Branch {
    out: Tensor,
    bias: Option<Tensor>,
}

impl Branch {
    /// `l(y)` as a branch of a residual stream of `d` channels (no
    /// dropout): with the fused kernels (where [`fused::add_norm`] takes
    /// rows of `d`), its bias is left to the next [`fused::add_norm`].
    pub(crate) fn of(l: &nn::Linear, y: &Tensor, fused: bool, d: i64) -> Branch {
        if fused && fused::cuda_fits(d, y.device()) {
            Branch { out: fused::linear(y, &l.ws, None, fused), bias: l.bs.as_ref().map(Tensor::shallow_clone) }
        } else {
            Branch { out: fused::linear(y, &l.ws, l.bs.as_ref(), fused), bias: None }
        }
    }

    /// The branch's value.
    pub(crate) fn value(&self) -> Tensor {
        match &self.bias {
            Some(b) => &self.out + b,
            None => self.out.shallow_clone(),
        }
    }
}

/// Multi-head attention over a fused projection `qkv` of `b x t` tokens
/// (`[b, t, 3 d]` or `[b t, 3 d]`, q, k and v side by side) with `heads`
/// heads and dropout `p`: `[b, t, d]`.
pub(crate) fn attention(qkv: &Tensor, b: i64, t: i64, heads: i64, p: f64, causal: bool) -> Tensor {
    let d = qkv.size().last().copied().unwrap_or(0) / 3;
    // q, k and v as strided views of the projection ([b, h, t, d], the
    // last dimension contiguous, which SDPA takes without a copy). One
    // `unbind`, not three `select`s: its backward is a single `stack`
    // that writes the projection's gradient in its own [b, t, 3, h, d]
    // layout, where each `select`'s backward zero-filled a [3, b, h, t,
    // d] tensor and added into it, and a permute copied the sum back
    // (measured on an H200, GPT-2 124M: 4.8 of a step's 42 ms of GPU
    // time, results/h200/trace-0c84040/).
    let parts = qkv.view([b, t, 3, heads, d / heads]).unbind(2);
    let (q, k, v) = (parts[0].transpose(1, 2), parts[1].transpose(1, 2), parts[2].transpose(1, 2));
    heads_attention(&q, &k, &v, p, causal)
}

/// Scaled-dot-product attention over the heads' `q`, `k` and `v` (`[b, h,
/// t, d]`) with dropout `p`: `[b, t, h d]`.
fn heads_attention(q: &Tensor, k: &Tensor, v: &Tensor, p: f64, causal: bool) -> Tensor {
    let (b, h, t, d) = q.size4().expect("q is [b, h, t, d]");
    let y = Tensor::scaled_dot_product_attention::<Tensor>(q, k, v, None, p, causal, None, false);
    y.transpose(1, 2).contiguous().view([b, t, h * d])
}

/// Multi-head attention over `l(h)`, `l` the fused q, k, v projection of
/// `b x t` tokens `h` (`[b, t, d]`), with `heads` heads and dropout `p`:
/// `[b, t, d']`. With the fused kernels (`fused`) on CUDA, the projection
/// and its split into the heads are one node ([`fused::qkv`]), whose
/// backward pass writes the three gradients side by side and sums the
/// bias's in one kernel; else [`attention`] over [`fused::linear`].
pub(crate) fn qkv_attention(l: &nn::Linear, h: &Tensor, fused: bool, (b, t, heads): (i64, i64, i64), p: f64, causal: bool) -> Tensor {
    if fused && fused::qkv_cuda_fits(l.ws.size()[0], h.device()) {
        let (q, k, v) = fused::qkv(h, &l.ws, l.bs.as_ref(), (b, t, heads));
        return heads_attention(&q, &k, &v, p, causal);
    }
    attention(&fused::linear(h, &l.ws, l.bs.as_ref(), fused), b, t, heads, p, causal)
}

/// What a layer's forward pass needs besides its parameters.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) b: i64,
    pub(crate) t: i64,
    pub(crate) heads: i64,
    pub(crate) d_model: i64,
    pub(crate) dropout: f64,
    pub(crate) train: bool,
    /// harness's fused layers ([`fused::add_norm`], [`fused::linear`], ...).
    pub(crate) fused: bool,
}

impl Shape {
    pub(crate) fn attention_dropout(&self) -> f64 {
        if self.train {
            self.dropout
        } else {
            0.0
        }
    }

    /// Attention over `l(h)`, `l` the fused q, k, v projection
    /// ([`qkv_attention`]).
    pub(crate) fn qkv_attention(&self, l: &nn::Linear, h: &Tensor, causal: bool) -> Tensor {
        qkv_attention(l, h, self.fused, (self.b, self.t, self.heads), self.attention_dropout(), causal)
    }

    pub(crate) fn dropout(&self, x: Tensor) -> Tensor {
        dropout(x, self.dropout, self.train)
    }

    /// `l(h)` ([`fused::linear`]).
    pub(crate) fn linear(&self, l: &nn::Linear, h: &Tensor) -> Tensor {
        fused::linear(h, &l.ws, l.bs.as_ref(), self.fused)
    }

    /// `l(y)` (then dropout) as a branch of the residual stream; with the
    /// fused kernels and no dropout, its bias is left to the next
    /// [`fused::add_norm`].
    pub(crate) fn project(&self, l: &nn::Linear, y: &Tensor) -> Branch {
        if self.fused && (!self.train || self.dropout == 0.0) && fused::cuda_fits(self.d_model, y.device()) {
            Branch::of(l, y, true, self.d_model)
        } else {
            Branch { out: self.dropout(self.linear(l, y)), bias: None }
        }
    }

    /// `proj(gelu(fc(h)))` as a branch of the residual stream: one node
    /// where [`Shape::mlp_node`] makes one; else the two layers as
    /// [`Shape::linear_gelu`] and [`Shape::project`] make them.
    pub(crate) fn mlp(&self, fc: &nn::Linear, proj: &nn::Linear, h: &Tensor) -> Branch {
        self.mlp_node(fused::Act::Gelu, fc, proj, h).unwrap_or_else(|| self.project(proj, &self.linear_gelu(fc, h)))
    }

    /// `l2(dropout(relu(l1(h))))` as a branch of the residual stream (an
    /// encoder layer's feed-forward block): one node where
    /// [`Shape::mlp_node`] makes one; else the two layers and libtorch's
    /// ReLU.
    pub(crate) fn relu_mlp(&self, l1: &nn::Linear, l2: &nn::Linear, h: &Tensor) -> Branch {
        self.mlp_node(fused::Act::Relu, l1, l2, h).unwrap_or_else(|| self.project(l2, &self.dropout(self.linear(l1, h).relu())))
    }

    /// `l2(act(l1(h)))` as one node ([`fused::mlp`]) with the second bias
    /// left to the next [`fused::add_norm`] or [`fused::post_norm`]: with
    /// the fused kernels, no dropout, a first bias and cuBLASLt's epilogues
    /// for these sizes; else none.
    pub(crate) fn mlp_node(&self, act: fused::Act, l1: &nn::Linear, l2: &nn::Linear, h: &Tensor) -> Option<Branch> {
        let (f, c2) = (l1.ws.size()[0], l2.ws.size()[0]);
        let n = h.numel() as i64 / self.d_model;
        let b = l1.bs.as_ref()?;
        let fits = self.fused
            && (!self.train || self.dropout == 0.0)
            && fused::cuda_fits(self.d_model, h.device())
            && fused::mlp_cuda_fits(act, h.device(), n, self.d_model, f, c2);
        fits.then(|| Branch { out: fused::mlp(h, &l1.ws, b, &l2.ws, act), bias: l2.bs.as_ref().map(Tensor::shallow_clone) })
    }

    /// `gelu(l(h))`: with the fused kernels, the bias and GELU in one kernel
    /// each way ([`fused::bias_gelu`]).
    pub(crate) fn linear_gelu(&self, l: &nn::Linear, h: &Tensor) -> Tensor {
        let out = *l.ws.size().first().expect("a weight matrix");
        match &l.bs {
            Some(b) if self.fused && fused::gelu_cuda_fits(out, h.device()) => fused::bias_gelu(&fused::linear(h, &l.ws, None, true), b),
            _ => l.forward(h).gelu("tanh"),
        }
    }
}
