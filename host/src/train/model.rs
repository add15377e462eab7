//! The models of the training core, written with `tch`.
//!
//! * `gpt`: decoder-only transformer as GPT-2 (pre-LayerNorm, learned
//!   positions, GELU(tanh), tied embedding), causal attention through
//!   `scaled_dot_product_attention` (flash / memory-efficient kernels on CUDA).
//! * `encoder`: `nn.TransformerEncoder` (post-LayerNorm, ReLU, batch first)
//!   with a mean-pool regression head (the TransformerEncoder regression
//!   benchmark of docs/benchmarks.md).
//! * `mlp`: a token MLP that predicts the next token from the current one.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

pub use crate::suite::ModelConfig;
use crate::suite::ModelKind;

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

fn layer_norm(p: nn::Path, d: i64) -> nn::LayerNorm {
    nn::layer_norm(p, vec![d], Default::default())
}

pub struct GptBlock {
    ln1: nn::LayerNorm,
    c_attn: nn::Linear,
    attn_proj: nn::Linear,
    ln2: nn::LayerNorm,
    c_fc: nn::Linear,
    mlp_proj: nn::Linear,
}

/// What a forward pass ends with.
pub enum Output {
    /// A scalar loss with its graph.
    Loss(Tensor),
    /// `[n, vocab]` next-token logits and their `[n]` targets.
    Logits { logits: Tensor, target: Tensor },
}

/// The models, one enum so the step loop needs no dynamic dispatch.
pub enum Model {
    Gpt { cfg: ModelConfig, wte: nn::Embedding, wpe: nn::Embedding, blocks: Vec<GptBlock>, ln_f: nn::LayerNorm },
    Encoder { cfg: ModelConfig, layers: Vec<EncoderLayer>, head: nn::Linear },
    Mlp { cfg: ModelConfig, emb: nn::Embedding, fc: nn::Linear, out: nn::Linear },
}

/// One `nn.TransformerEncoderLayer` (post-norm).
pub struct EncoderLayer {
    in_proj: nn::Linear,
    out_proj: nn::Linear,
    norm1: nn::LayerNorm,
    lin1: nn::Linear,
    lin2: nn::Linear,
    norm2: nn::LayerNorm,
}

impl Model {
    /// Builds a model's variables under `p` (initialisation as nanoGPT:
    /// N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 L)), zero biases).
    pub fn new(p: &nn::Path, cfg: &ModelConfig) -> Model {
        let d = cfg.d_model;
        let std = 0.02;
        let proj_std = 0.02 / ((2 * cfg.n_layer) as f64).sqrt();
        let emb_cfg = nn::EmbeddingConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: std }, ..Default::default() };
        match cfg.kind {
            ModelKind::Gpt => {
                let wte = nn::embedding(p / "wte", cfg.vocab, d, emb_cfg);
                let wpe = nn::embedding(p / "wpe", cfg.seq_len, d, emb_cfg);
                let blocks = (0..cfg.n_layer)
                    .map(|i| {
                        let b = p / "h" / i;
                        GptBlock {
                            ln1: layer_norm(&b / "ln_1", d),
                            c_attn: linear(&b / "attn" / "c_attn", d, 3 * d, std),
                            attn_proj: linear(&b / "attn" / "c_proj", d, d, proj_std),
                            ln2: layer_norm(&b / "ln_2", d),
                            c_fc: linear(&b / "mlp" / "c_fc", d, cfg.d_ff, std),
                            mlp_proj: linear(&b / "mlp" / "c_proj", cfg.d_ff, d, proj_std),
                        }
                    })
                    .collect();
                Model::Gpt { cfg: cfg.clone(), wte, wpe, blocks, ln_f: layer_norm(p / "ln_f", d) }
            }
            ModelKind::Encoder => {
                let layers = (0..cfg.n_layer)
                    .map(|i| {
                        let l = p / "layers" / i;
                        EncoderLayer {
                            in_proj: linear(&l / "self_attn" / "in_proj", d, 3 * d, std),
                            out_proj: linear(&l / "self_attn" / "out_proj", d, d, proj_std),
                            norm1: layer_norm(&l / "norm1", d),
                            lin1: linear(&l / "linear1", d, cfg.d_ff, std),
                            lin2: linear(&l / "linear2", cfg.d_ff, d, proj_std),
                            norm2: layer_norm(&l / "norm2", d),
                        }
                    })
                    .collect();
                Model::Encoder { cfg: cfg.clone(), layers, head: linear(p / "head", d, 1, std) }
            }
            ModelKind::Mlp => Model::Mlp {
                cfg: cfg.clone(),
                emb: nn::embedding(p / "emb", cfg.vocab, d, emb_cfg),
                fc: linear(p / "fc", d, cfg.d_ff, std),
                out: linear(p / "out", cfg.d_ff, cfg.vocab, std),
            },
        }
    }

    /// The resolved configuration.
    pub fn config(&self) -> &ModelConfig {
        match self {
            Model::Gpt { cfg, .. } | Model::Encoder { cfg, .. } | Model::Mlp { cfg, .. } => cfg,
        }
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
        match self {
            Model::Gpt { cfg, wte, wpe, blocks, ln_f } => {
                let (b, t) = input.size2().expect("token batches are 2-d");
                let pos = Tensor::arange(t, (Kind::Int64, input.device()));
                let mut x = wte.forward(input) + wpe.forward(&pos);
                x = dropout(x, cfg.dropout, train);
                let (h, hd) = (cfg.n_head, cfg.d_model / cfg.n_head);
                for blk in blocks {
                    let qkv = blk.c_attn.forward(&blk.ln1.forward(&x));
                    let qkv = qkv.view([b, t, 3, h, hd]).permute([2, 0, 3, 1, 4]);
                    let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
                    let p = if train { cfg.dropout } else { 0.0 };
                    let y = Tensor::scaled_dot_product_attention::<Tensor>(&q, &k, &v, None, p, true, None, false);
                    let y = y.transpose(1, 2).contiguous().view([b, t, cfg.d_model]);
                    // Out of place on purpose: tch's `+=` adds in place, which
                    // would overwrite a tensor autograd saved for backward.
                    x = residual(&x, dropout(blk.attn_proj.forward(&y), cfg.dropout, train));
                    let m = blk.c_fc.forward(&blk.ln2.forward(&x)).gelu("tanh");
                    x = residual(&x, dropout(blk.mlp_proj.forward(&m), cfg.dropout, train));
                }
                let x = ln_f.forward(&x);
                let logits = x.matmul(&wte.ws.tr());
                Output::Logits { logits: logits.view([b * t, cfg.vocab]), target: target.reshape([b * t]) }
            }
            Model::Encoder { cfg, layers, head } => {
                let (b, t, _) = input.size3().expect("regression batches are 3-d");
                let (h, hd) = (cfg.n_head, cfg.d_model / cfg.n_head);
                let mut x = input.shallow_clone();
                for l in layers {
                    let qkv = l.in_proj.forward(&x).view([b, t, 3, h, hd]).permute([2, 0, 3, 1, 4]);
                    let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
                    let p = if train { cfg.dropout } else { 0.0 };
                    let y = Tensor::scaled_dot_product_attention::<Tensor>(&q, &k, &v, None, p, false, None, false);
                    let y = y.transpose(1, 2).contiguous().view([b, t, cfg.d_model]);
                    x = l.norm1.forward(&(x + dropout(l.out_proj.forward(&y), cfg.dropout, train)));
                    let f = l.lin2.forward(&dropout(l.lin1.forward(&x).relu(), cfg.dropout, train));
                    x = l.norm2.forward(&(x + dropout(f, cfg.dropout, train)));
                }
                let pred = head.forward(&x.mean_dim(1, false, None)).view([b]);
                Output::Loss(pred.to_kind(Kind::Float).mse_loss(&target.to_kind(Kind::Float), tch::Reduction::Mean))
            }
            Model::Mlp { cfg, emb, fc, out } => {
                let (b, t) = input.size2().expect("token batches are 2-d");
                let logits = out.forward(&fc.forward(&emb.forward(input)).gelu("tanh"));
                Output::Logits { logits: logits.view([b * t, cfg.vocab]), target: target.reshape([b * t]) }
            }
        }
    }
}
