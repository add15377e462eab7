//! The `encoder` family: `nn.TransformerEncoder` (post-LayerNorm, ReLU,
//! batch first) with a mean-pool regression head (the TransformerEncoder
//! regression benchmark of docs/benchmarks.md). A recomputed layer is an
//! encoder layer.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use super::family::{layer, Family, Network, Output, Pass};
use super::fused;
use super::layers::{linear, share, Norm, Shape};
use harness_format::suite::{ModelConfig, ModelKind};

/// One `nn.TransformerEncoderLayer` (post-norm). With the fused kernels
/// its attention is [`layers::qkv_attention`]'s, its feed-forward block one
/// [`fused::mlp`] node (the ReLU in cuBLASLt's epilogues), its other linear
/// layers [`fused::linear`]'s nodes, and each residual add with its
/// LayerNorm (and the bias of the layer before) one [`fused::post_norm`]
/// node, whose output stays the fp32 residual stream.
///
/// [`layers::qkv_attention`]: super::layers::qkv_attention
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

/// The encoder: its layers and the regression head.
pub struct Encoder {
    layers: Vec<EncoderLayer>,
    head: nn::Linear,
}

impl Encoder {
    /// Its variables under `p` (initialisation as nanoGPT's: N(0, 0.02),
    /// residual projections N(0, 0.02 / sqrt(2 L)), zero biases).
    pub fn new(p: &nn::Path, cfg: &ModelConfig) -> Encoder {
        let d = cfg.d_model;
        let std = 0.02;
        let proj_std = 0.02 / ((2 * cfg.n_layer) as f64).sqrt();
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
        Encoder { layers, head: linear(p / "head", d, 1, std) }
    }
}

impl Network for Encoder {
    fn output(&self, input: &Tensor, target: &Tensor, pass: &Pass) -> Output {
        let Encoder { layers, head } = self;
        let (b, t, _) = input.size3().expect("regression batches are 3-d");
        let s = pass.shape(b, t);
        let mut x = input.shallow_clone();
        for (i, l) in layers.iter().enumerate() {
            x = layer!(l, &x, &s, pass.again(i));
        }
        let pred = head.forward(&x.mean_dim(1, false, None)).view([b]);
        Output::Loss(pred.to_kind(Kind::Float).mse_loss(&target.to_kind(Kind::Float), tch::Reduction::Mean))
    }

    fn fused_norms(&self) -> bool {
        fused::post_norm_on()
    }
}

/// The `encoder` family.
pub struct EncoderFamily;

impl Family for EncoderFamily {
    fn kind(&self) -> ModelKind {
        ModelKind::Encoder
    }

    fn build(&self, p: &nn::Path, cfg: &ModelConfig) -> Box<dyn Network> {
        Box::new(Encoder::new(p, cfg))
    }

    fn bf16_images(&self) -> bool {
        false
    }

    /// Its output is a loss (MSE), no logits.
    fn fused_cross_entropy(&self) -> bool {
        false
    }

    fn graph_checked(&self) -> bool {
        true
    }
}
