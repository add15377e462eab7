//! The models of the training core, written with `tch`.
//!
//! * `gpt`: decoder-only transformer as GPT-2 (pre-LayerNorm, learned
//!   positions, GELU(tanh), tied embedding), causal attention through
//!   `scaled_dot_product_attention` (flash / memory-efficient kernels on CUDA).
//! * `encoder`: `nn.TransformerEncoder` (post-LayerNorm, ReLU, batch first)
//!   with a mean-pool regression head (the TransformerEncoder regression
//!   benchmark of docs/benchmarks.md).
//! * `mlp`: a token MLP that predicts the next token from the current one.
//! * `vision`: ResNet and ViT image classifiers ([`super::vision`]).
//!
//! Activation recomputation (the workload's `recompute`) wraps a layer in
//! [`torch_ext::recompute`]: its activations are dropped after the forward
//! pass and computed again in the backward pass. A layer is a GPT block, an
//! encoder layer, or the MLP's hidden layer.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

pub use crate::suite::ModelConfig;
use crate::suite::{ModelKind, Recompute};
use crate::torch_ext;
use crate::train::{fused, t5};

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
fn residual(x: &Tensor, f: Tensor) -> Tensor {
    x + f
}

/// Dropout that issues no kernel at all when it would do nothing.
fn dropout(x: Tensor, p: f64, train: bool) -> Tensor {
    if train && p > 0.0 {
        x.dropout(p, true)
    } else {
        x
    }
}

fn linear(p: nn::Path, i: i64, o: i64, std: f64) -> nn::Linear {
    let cfg = nn::LinearConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: std }, bs_init: Some(nn::Init::Const(0.0)), bias: true };
    nn::linear(p, i, o, cfg)
}

/// A linear layer sharing `l`'s parameters (for a recomputed layer, which
/// must own what it uses).
fn share(l: &nn::Linear) -> nn::Linear {
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
    fn post_forward(&self, x: &Tensor, f: &Branch, fused: bool) -> Tensor {
        if fused && fused::post_norm_cuda_fits(self.d, x.device()) {
            return fused::post_norm(x, &f.out, f.bias.as_ref(), &self.ws, &self.bs);
        }
        self.forward(&residual(x, f.value()))
    }

    fn share(&self) -> Norm {
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
    fn value(&self) -> Tensor {
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
struct Shape {
    b: i64,
    t: i64,
    heads: i64,
    d_model: i64,
    dropout: f64,
    train: bool,
    /// harness's fused layers ([`fused::add_norm`], [`fused::linear`], ...).
    fused: bool,
}

impl Shape {
    fn attention_dropout(&self) -> f64 {
        if self.train {
            self.dropout
        } else {
            0.0
        }
    }

    /// Attention over `l(h)`, `l` the fused q, k, v projection
    /// ([`qkv_attention`]).
    fn qkv_attention(&self, l: &nn::Linear, h: &Tensor, causal: bool) -> Tensor {
        qkv_attention(l, h, self.fused, (self.b, self.t, self.heads), self.attention_dropout(), causal)
    }

    fn dropout(&self, x: Tensor) -> Tensor {
        dropout(x, self.dropout, self.train)
    }

    /// `l(h)` ([`fused::linear`]).
    fn linear(&self, l: &nn::Linear, h: &Tensor) -> Tensor {
        fused::linear(h, &l.ws, l.bs.as_ref(), self.fused)
    }

    /// `l(y)` (then dropout) as a branch of the residual stream; with the
    /// fused kernels and no dropout, its bias is left to the next
    /// [`fused::add_norm`].
    fn project(&self, l: &nn::Linear, y: &Tensor) -> Branch {
        if self.fused && (!self.train || self.dropout == 0.0) && fused::cuda_fits(self.d_model, y.device()) {
            Branch::of(l, y, true, self.d_model)
        } else {
            Branch { out: self.dropout(self.linear(l, y)), bias: None }
        }
    }

    /// `proj(gelu(fc(h)))` as a branch of the residual stream: one node
    /// where [`Shape::mlp_node`] makes one; else the two layers as
    /// [`Shape::linear_gelu`] and [`Shape::project`] make them.
    fn mlp(&self, fc: &nn::Linear, proj: &nn::Linear, h: &Tensor) -> Branch {
        self.mlp_node(fused::Act::Gelu, fc, proj, h).unwrap_or_else(|| self.project(proj, &self.linear_gelu(fc, h)))
    }

    /// `l2(dropout(relu(l1(h))))` as a branch of the residual stream (an
    /// encoder layer's feed-forward block): one node where
    /// [`Shape::mlp_node`] makes one; else the two layers and libtorch's
    /// ReLU.
    fn relu_mlp(&self, l1: &nn::Linear, l2: &nn::Linear, h: &Tensor) -> Branch {
        self.mlp_node(fused::Act::Relu, l1, l2, h).unwrap_or_else(|| self.project(l2, &self.dropout(self.linear(l1, h).relu())))
    }

    /// `l2(act(l1(h)))` as one node ([`fused::mlp`]) with the second bias
    /// left to the next [`fused::add_norm`] or [`fused::post_norm`]: with
    /// the fused kernels, no dropout, a first bias and cuBLASLt's epilogues
    /// for these sizes; else none.
    fn mlp_node(&self, act: fused::Act, l1: &nn::Linear, l2: &nn::Linear, h: &Tensor) -> Option<Branch> {
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
    fn linear_gelu(&self, l: &nn::Linear, h: &Tensor) -> Tensor {
        let out = *l.ws.size().first().expect("a weight matrix");
        match &l.bs {
            Some(b) if self.fused && fused::gelu_cuda_fits(out, h.device()) => fused::bias_gelu(&fused::linear(h, &l.ws, None, true), b),
            _ => l.forward(h).gelu("tanh"),
        }
    }
}

pub struct GptBlock {
    ln1: Norm,
    c_attn: nn::Linear,
    attn_proj: nn::Linear,
    ln2: Norm,
    c_fc: nn::Linear,
    mlp_proj: nn::Linear,
}

impl GptBlock {
    fn forward(&self, x: &Tensor, s: &Shape) -> Tensor {
        let (x, f) = self.forward_pending(x, None, s);
        residual(&x, f.value())
    }

    /// The block on the residual stream `x` plus the previous block's
    /// pending MLP output `f`, which is added here, in the same kernel as
    /// the first LayerNorm when fused: returns the stream before this
    /// block's MLP output, and that output (pending for the next block).
    fn forward_pending(&self, x: &Tensor, f: Option<&Branch>, s: &Shape) -> (Tensor, Branch) {
        let (x, h) = self.ln1.add_forward(x, f, s.fused);
        let y = s.qkv_attention(&self.c_attn, &h, true);
        let (x, h) = self.ln2.add_forward(&x, Some(&s.project(&self.attn_proj, &y)), s.fused);
        (x, s.mlp(&self.c_fc, &self.mlp_proj, &h))
    }

    fn share(&self) -> GptBlock {
        GptBlock {
            ln1: self.ln1.share(),
            c_attn: share(&self.c_attn),
            attn_proj: share(&self.attn_proj),
            ln2: self.ln2.share(),
            c_fc: share(&self.c_fc),
            mlp_proj: share(&self.mlp_proj),
        }
    }
}

/// One `nn.TransformerEncoderLayer` (post-norm). With the fused kernels
/// its attention is [`qkv_attention`]'s, its feed-forward block one
/// [`fused::mlp`] node (the ReLU in cuBLASLt's epilogues), its other linear
/// layers [`fused::linear`]'s nodes, and each residual add with its
/// LayerNorm (and the bias of the layer before) one [`fused::post_norm`]
/// node, whose output stays the fp32 residual stream.
pub struct EncoderLayer {
    in_proj: nn::Linear,
    out_proj: nn::Linear,
    norm1: Norm,
    lin1: nn::Linear,
    lin2: nn::Linear,
    norm2: Norm,
}

impl EncoderLayer {
    fn forward(&self, x: &Tensor, s: &Shape) -> Tensor {
        let y = s.qkv_attention(&self.in_proj, x, false);
        let x = self.norm1.post_forward(x, &s.project(&self.out_proj, &y), s.fused);
        self.norm2.post_forward(&x, &s.relu_mlp(&self.lin1, &self.lin2, &x), s.fused)
    }

    fn share(&self) -> EncoderLayer {
        EncoderLayer {
            in_proj: share(&self.in_proj),
            out_proj: share(&self.out_proj),
            norm1: self.norm1.share(),
            lin1: share(&self.lin1),
            lin2: share(&self.lin2),
            norm2: self.norm2.share(),
        }
    }
}

/// The MLP's hidden layer.
pub struct Hidden {
    fc: nn::Linear,
}

impl Hidden {
    fn forward(&self, x: &Tensor, _: &Shape) -> Tensor {
        self.fc.forward(x).gelu("tanh")
    }

    fn share(&self) -> Hidden {
        Hidden { fc: share(&self.fc) }
    }
}

/// What a forward pass ends with.
pub enum Output {
    /// A scalar loss with its graph.
    Loss(Tensor),
    /// `[n, vocab]` next-token logits and their `[n]` targets.
    Logits { logits: Tensor, target: Tensor },
}

/// The networks, one enum so the step loop needs no dynamic dispatch.
enum Net {
    Gpt { wte: nn::Embedding, wpe: nn::Embedding, blocks: Vec<GptBlock>, ln_f: Norm },
    Encoder { layers: Vec<EncoderLayer>, head: nn::Linear },
    Mlp { emb: nn::Embedding, hidden: Hidden, out: nn::Linear },
    Vision(Box<super::vision::Vision>),
    T5(Box<t5::T5>),
}

/// A model: its configuration, its network and which of its layers
/// recompute their activations.
pub struct Model {
    cfg: ModelConfig,
    net: Net,
    recompute: Recompute,
    fused: bool,
}

/// Runs `layer` on `x`; with `recompute`, through [`torch_ext::recompute`]
/// on a copy sharing the layer's parameters.
macro_rules! layer {
    ($layer:expr, $x:expr, $shape:expr, $recompute:expr) => {{
        let (layer, x, s) = ($layer, $x, $shape);
        if $recompute && s.train {
            let (own, s) = (layer.share(), *s);
            torch_ext::recompute(x, s.dropout > 0.0, move |x| own.forward(x, &s)).unwrap_or_else(|e| panic!("{e}"))
        } else {
            layer.forward(x, s)
        }
    }};
}

impl Model {
    /// Builds a model's variables under `p` (initialisation as nanoGPT:
    /// N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 L)), zero biases).
    pub fn new(p: &nn::Path, cfg: &ModelConfig, recompute: Recompute) -> Model {
        let d = cfg.d_model;
        let std = 0.02;
        let proj_std = 0.02 / ((2 * cfg.n_layer) as f64).sqrt();
        let emb_cfg = nn::EmbeddingConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: std }, ..Default::default() };
        let net = match cfg.kind {
            ModelKind::Gpt => {
                let wte = nn::embedding(p / "wte", cfg.vocab, d, emb_cfg);
                let wpe = nn::embedding(p / "wpe", cfg.seq_len, d, emb_cfg);
                let blocks = (0..cfg.n_layer)
                    .map(|i| {
                        let b = p / "h" / i;
                        GptBlock {
                            ln1: Norm::new(&b / "ln_1", d),
                            c_attn: linear(&b / "attn" / "c_attn", d, 3 * d, std),
                            attn_proj: linear(&b / "attn" / "c_proj", d, d, proj_std),
                            ln2: Norm::new(&b / "ln_2", d),
                            c_fc: linear(&b / "mlp" / "c_fc", d, cfg.d_ff, std),
                            mlp_proj: linear(&b / "mlp" / "c_proj", cfg.d_ff, d, proj_std),
                        }
                    })
                    .collect();
                Net::Gpt { wte, wpe, blocks, ln_f: Norm::new(p / "ln_f", d) }
            }
            ModelKind::Encoder => {
                let layers = (0..cfg.n_layer)
                    .map(|i| {
                        let l = p / "layers" / i;
                        EncoderLayer {
                            in_proj: linear(&l / "self_attn" / "in_proj", d, 3 * d, std),
                            out_proj: linear(&l / "self_attn" / "out_proj", d, d, proj_std),
                            norm1: Norm::new(&l / "norm1", d),
                            lin1: linear(&l / "linear1", d, cfg.d_ff, std),
                            lin2: linear(&l / "linear2", cfg.d_ff, d, proj_std),
                            norm2: Norm::new(&l / "norm2", d),
                        }
                    })
                    .collect();
                Net::Encoder { layers, head: linear(p / "head", d, 1, std) }
            }
            ModelKind::Mlp => Net::Mlp {
                emb: nn::embedding(p / "emb", cfg.vocab, d, emb_cfg),
                hidden: Hidden { fc: linear(p / "fc", d, cfg.d_ff, std) },
                out: linear(p / "out", cfg.d_ff, cfg.vocab, std),
            },
            ModelKind::Vision => Net::Vision(Box::new(super::vision::Vision::new(p, cfg))),
            ModelKind::T5 => Net::T5(Box::new(t5::T5::new(p, cfg.vocab, d, cfg.d_ff, cfg.n_head, cfg.n_layer, cfg.dropout))),
        };
        Model { cfg: cfg.clone(), net, recompute, fused: false }
    }

    /// Computes layers with harness's fused kernels where they apply (bf16
    /// autocast on CUDA): residual adds and LayerNorms ([`fused::add_norm`]),
    /// linear layers ([`fused::linear`]), attention projections
    /// ([`fused::qkv`]), ...
    pub fn use_fused_kernels(&mut self, on: bool) {
        self.fused = on;
        match &mut self.net {
            Net::T5(m) => m.use_fused_kernels(on),
            Net::Vision(v) => v.use_fused_kernels(on),
            _ => {}
        }
    }

    /// Whether the fused kernels are on ([`Model::use_fused_kernels`]).
    pub fn uses_fused_kernels(&self) -> bool {
        self.fused
    }

    /// Whether the residual adds and LayerNorms run through
    /// [`fused::add_norm`]'s (or, post-norm, [`fused::post_norm`]'s) CUDA kernels.
    pub fn fused_layer_norm(&self) -> bool {
        let with_norms = match &self.net {
            Net::Gpt { .. } => true,
            Net::Encoder { .. } => fused::post_norm_on(),
            Net::Vision(v) => v.is_transformer(),
            _ => false,
        };
        self.fused && with_norms && crate::kernels::layer_norm_fits(self.cfg.d_model)
    }

    /// The resolved configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Which layers recompute their activations.
    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// Forward pass and loss (cross-entropy in nats, or MSE for regression).
    pub fn loss(&self, input: &Tensor, target: &Tensor, train: bool) -> Tensor {
        match self.forward(input, target, train) {
            Output::Loss(l) => l,
            Output::Logits { logits, target } => token_loss(&logits, &target),
        }
    }

    /// Forward pass up to the loss: token models stop at the logits, so the
    /// caller may compute the loss with a fused kernel.
    pub fn forward(&self, input: &Tensor, target: &Tensor, train: bool) -> Output {
        let cfg = &self.cfg;
        let shape = |b, t| Shape { b, t, heads: cfg.n_head, d_model: cfg.d_model, dropout: cfg.dropout, train, fused: self.fused };
        let again = |i: usize| self.recompute.layer(i);
        match &self.net {
            Net::Gpt { wte, wpe, blocks, ln_f } => {
                let (b, t) = input.size2().expect("token batches are 2-d");
                let s = shape(b, t);
                let (x, tie) = if s.fused && fused::embed_cuda_fits(cfg.d_model, input.device()) {
                    let (x, tie) = fused::embed(input, &wte.ws, &wpe.ws);
                    (x, Some(tie))
                } else {
                    let pos = Tensor::arange(t, (Kind::Int64, input.device()));
                    (wte.forward(input) + wpe.forward(&pos), None)
                };
                let mut x = s.dropout(x);
                // Each block leaves its MLP output pending, for the next
                // LayerNorm to add (fused with it on CUDA). A recomputed
                // block takes one tensor: the pending output is added first.
                let mut pending: Option<Branch> = None;
                for (i, blk) in blocks.iter().enumerate() {
                    if again(i) && s.train {
                        if let Some(f) = pending.take() {
                            x = residual(&x, f.value());
                        }
                        x = layer!(blk, &x, &s, true);
                    } else {
                        let (nx, f) = blk.forward_pending(&x, pending.as_ref(), &s);
                        (x, pending) = (nx, Some(f));
                    }
                }
                let (_, x) = ln_f.add_forward(&x, pending.as_ref(), s.fused);
                let logits = fused::tied_linear(&x, &wte.ws, tie.as_ref(), s.fused);
                Output::Logits { logits: logits.view([b * t, cfg.vocab]), target: target.reshape([b * t]) }
            }
            Net::Encoder { layers, head } => {
                let (b, t, _) = input.size3().expect("regression batches are 3-d");
                let s = shape(b, t);
                let mut x = input.shallow_clone();
                for (i, l) in layers.iter().enumerate() {
                    x = layer!(l, &x, &s, again(i));
                }
                let pred = head.forward(&x.mean_dim(1, false, None)).view([b]);
                Output::Loss(pred.to_kind(Kind::Float).mse_loss(&target.to_kind(Kind::Float), tch::Reduction::Mean))
            }
            Net::Mlp { emb, hidden, out } => {
                let (b, t) = input.size2().expect("token batches are 2-d");
                let s = shape(b, t);
                let logits = out.forward(&layer!(hidden, &emb.forward(input), &s, again(0)));
                Output::Logits { logits: logits.view([b * t, cfg.vocab]), target: target.reshape([b * t]) }
            }
            Net::Vision(net) => Output::Logits { logits: net.forward(input, train), target: target.shallow_clone() },
            // Teacher forcing: the target is also the decoder's input.
            Net::T5(m) => Output::Logits { logits: m.forward(input, target, train), target: target.reshape([-1]) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::suite::{ModelSpec, Recompute};

    /// Gradients of a tiny GPT's loss, and how many layer runs went
    /// through recomputation.
    fn grads(recompute: Recompute) -> (Vec<Tensor>, u64) {
        let spec = ModelSpec {
            kind: ModelKind::Gpt,
            preset: Some("tiny".into()),
            n_layer: Some(3),
            n_head: None,
            d_model: None,
            d_ff: None,
            dropout: Some(0.1),
        };
        let cfg = ModelConfig::resolve(&spec, 32, 8).unwrap();
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(3);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let model = Model::new(&vs.root(), &cfg, recompute);
        let input = Tensor::randint(32, [2, 8], (Kind::Int64, tch::Device::Cpu));
        let before = torch_ext::BLOCK_RUNS.with(|n| n.get());
        model.loss(&input, &input, true).backward();
        let runs = torch_ext::BLOCK_RUNS.with(|n| n.get()) - before;
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        (named.into_iter().map(|(_, p)| p.grad()).collect(), runs)
    }

    #[test]
    fn recomputed_layers_run_twice_and_give_the_same_gradients() {
        let (plain, none) = grads(Recompute::None);
        assert_eq!(none, 0);
        // Three layers: "all" runs each twice; every 2nd: layers 0 and 2.
        for (r, want) in [(Recompute::Every(1), 6), (Recompute::Every(2), 4)] {
            let (g, runs) = grads(r);
            assert_eq!(runs, want, "{r:?}");
            for (a, b) in plain.iter().zip(&g) {
                assert!(a.equal(b), "{r:?}: a gradient differs");
            }
        }
    }
}
