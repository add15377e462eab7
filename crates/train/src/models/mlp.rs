//! The `mlp` family: a token MLP that predicts the next token from the
//! current one. A recomputed layer is its hidden layer.

use tch::nn::{self, Module};
use tch::Tensor;

use super::family::{layer, Family, Network, Output, Pass};
use super::layers::{linear, share, Shape};
use harness_format::suite::{ModelConfig, ModelKind};

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

/// The token MLP: embedding, hidden layer, output layer.
pub struct Mlp {
    emb: nn::Embedding,
    hidden: Hidden,
    out: nn::Linear,
}

impl Mlp {
    /// Its variables under `p` (initialisation N(0, 0.02), zero biases).
    pub fn new(p: &nn::Path, cfg: &ModelConfig) -> Mlp {
        let d = cfg.d_model;
        let std = 0.02;
        let emb_cfg = nn::EmbeddingConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: std }, ..Default::default() };
        Mlp {
            emb: nn::embedding(p / "emb", cfg.vocab, d, emb_cfg),
            hidden: Hidden { fc: linear(p / "fc", d, cfg.d_ff, std) },
            out: linear(p / "out", cfg.d_ff, cfg.vocab, std),
        }
    }
}

impl Network for Mlp {
    fn output(&self, input: &Tensor, target: &Tensor, pass: &Pass) -> Output {
        let Mlp { emb, hidden, out } = self;
        let (b, t) = input.size2().expect("token batches are 2-d");
        let s = pass.shape(b, t);
        let logits = out.forward(&layer!(hidden, &emb.forward(input), &s, pass.again(0)));
        Output::Logits { logits: logits.view([b * t, pass.cfg.vocab]), target: target.reshape([b * t]) }
    }
}

/// The `mlp` family.
pub struct MlpFamily;

impl Family for MlpFamily {
    fn kind(&self) -> ModelKind {
        ModelKind::Mlp
    }

    fn build(&self, p: &nn::Path, cfg: &ModelConfig) -> Box<dyn Network> {
        Box::new(Mlp::new(p, cfg))
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
