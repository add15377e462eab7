//! The `gpt` family: decoder-only transformer as GPT-2 (pre-LayerNorm,
//! learned positions, GELU(tanh), tied embedding), causal attention through
//! `scaled_dot_product_attention` (flash / memory-efficient kernels on
//! CUDA). A recomputed layer is a block.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use super::family::{layer, Family, Network, Output, Pass};
use super::fused;
use super::layers::{linear, residual, share, Branch, Norm, Shape};
use harness_format::suite::{ModelConfig, ModelKind};

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

    /// Its parameters, for [`fused::params_ready`].
    fn params(&self) -> Vec<&Tensor> {
        let mut ps = self.ln1.params();
        for l in [&self.c_attn, &self.attn_proj, &self.c_fc, &self.mlp_proj] {
            ps.push(&l.ws);
            ps.extend(l.bs.as_ref());
        }
        ps.extend(self.ln2.params());
        ps
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

/// A GPT: token and position embeddings, blocks, the final LayerNorm; the
/// output layer is the token embedding's.
pub struct Gpt {
    wte: nn::Embedding,
    wpe: nn::Embedding,
    blocks: Vec<GptBlock>,
    ln_f: Norm,
}

impl Gpt {
    /// Its variables under `p` (initialisation as nanoGPT: N(0, 0.02),
    /// residual projections N(0, 0.02 / sqrt(2 L)), zero biases).
    pub fn new(p: &nn::Path, cfg: &ModelConfig) -> Gpt {
        let d = cfg.d_model;
        let std = 0.02;
        let proj_std = 0.02 / ((2 * cfg.n_layer) as f64).sqrt();
        let emb_cfg = nn::EmbeddingConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: std }, ..Default::default() };
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
        Gpt { wte, wpe, blocks, ln_f: Norm::new(p / "ln_f", d) }
    }
}

impl Network for Gpt {
    fn output(&self, input: &Tensor, target: &Tensor, pass: &Pass) -> Output {
        let Gpt { wte, wpe, blocks, ln_f } = self;
        let cfg = pass.cfg;
        let (b, t) = input.size2().expect("token batches are 2-d");
        let s = pass.shape(b, t);
        fused::params_ready(&[&wte.ws, &wpe.ws]);
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
            fused::params_ready(&blk.params());
            if pass.again(i) && s.train {
                if let Some(f) = pending.take() {
                    x = residual(&x, f.value());
                }
                x = layer!(blk, &x, &s, true);
            } else {
                let (nx, f) = blk.forward_pending(&x, pending.as_ref(), &s);
                (x, pending) = (nx, Some(f));
            }
        }
        fused::params_ready(&ln_f.params());
        let (_, x) = ln_f.add_forward(&x, pending.as_ref(), s.fused);
        let logits = fused::tied_linear(&x, &wte.ws, tie.as_ref(), s.fused);
        Output::Logits { logits: logits.view([b * t, cfg.vocab]), target: target.reshape([b * t]) }
    }

    fn waits_per_layer(&self) -> bool {
        true
    }

    fn fused_norms(&self) -> bool {
        true
    }
}

/// The `gpt` family.
pub struct GptFamily;

impl Family for GptFamily {
    fn kind(&self) -> ModelKind {
        ModelKind::Gpt
    }

    fn build(&self, p: &nn::Path, cfg: &ModelConfig) -> Box<dyn Network> {
        Box::new(Gpt::new(p, cfg))
    }

    fn bf16_images(&self) -> bool {
        false
    }

    fn fused_cross_entropy(&self) -> bool {
        true
    }

    fn graph_checked(&self) -> bool {
        true
    }
}
