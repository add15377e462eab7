//! The models of the training core, written with `tch`: one file per
//! model family, each a [`Family`] that builds its [`Network`]
//! (`family.rs`), found by [`family()`] below.
//!
//! * `gpt`: decoder-only transformer as GPT-2 (pre-LayerNorm, learned
//!   positions, GELU(tanh), tied embedding), causal attention through
//!   `scaled_dot_product_attention` (flash / memory-efficient kernels on CUDA).
//! * `encoder`: `nn.TransformerEncoder` (post-LayerNorm, ReLU, batch first)
//!   with a mean-pool regression head (the TransformerEncoder regression
//!   benchmark of docs/benchmarks.md).
//! * `mlp`: a token MLP that predicts the next token from the current one.
//! * `vision`: ResNet and ViT image classifiers ([`vision`]).
//! * `t5`: T5's encoder–decoder ([`t5`]).
//!
//! Activation recomputation (the workload's `recompute`) wraps a layer in
//! [`torch_ext::recompute`]: its activations are dropped after the forward
//! pass and computed again in the backward pass. A layer is a GPT block, an
//! encoder layer, or the MLP's hidden layer.
//!
//! [`torch_ext::recompute`]: harness_kernels::torch_ext::recompute

use tch::{nn, Tensor};

pub use harness_format::suite::ModelConfig;
use harness_format::suite::{ModelKind, Recompute};
pub mod encoder;
pub mod family;
pub mod fused;
pub mod gpt;
pub mod layers;
pub mod mlp;
pub mod t5;
pub mod vision;

pub use family::Output;
use family::{Family, Network, Pass};
pub use layers::token_loss;

/// The training core's side of the family of `kind`. The match is
/// exhaustive: a `ModelKind` variant without a family here does not
/// compile.
pub(crate) fn family(kind: ModelKind) -> &'static dyn Family {
    match kind {
        ModelKind::Gpt => &gpt::GptFamily,
        ModelKind::Encoder => &encoder::EncoderFamily,
        ModelKind::Mlp => &mlp::MlpFamily,
        ModelKind::Vision => &vision::VisionFamily,
        ModelKind::T5 => &t5::T5Family,
    }
}

/// A model: its configuration, its network (its family's, behind one
/// virtual call a forward pass) and which of its layers recompute their
/// activations.
pub struct Model {
    cfg: ModelConfig,
    net: Box<dyn Network>,
    recompute: Recompute,
    fused: bool,
}

impl Model {
    /// Builds a model's variables under `p`, as its family does
    /// (initialisation as nanoGPT for the transformers: N(0, 0.02),
    /// residual projections N(0, 0.02 / sqrt(2 L)), zero biases).
    pub fn new(p: &nn::Path, cfg: &ModelConfig, recompute: Recompute) -> Model {
        let family = family(cfg.kind);
        debug_assert_eq!(family.kind(), cfg.kind, "models::family gave another kind's family");
        let net = family.build(p, cfg);
        Model { cfg: cfg.clone(), net, recompute, fused: false }
    }

    /// Computes layers with harness's fused kernels where they apply (bf16
    /// autocast on CUDA): residual adds and LayerNorms ([`fused::add_norm`]),
    /// linear layers ([`fused::linear`]), attention projections
    /// ([`fused::qkv`]), ...
    pub fn use_fused_kernels(&mut self, on: bool) {
        self.fused = on;
        self.net.use_fused_kernels(on);
    }

    /// Whether the forward pass waits for each layer's parameters itself
    /// ([`fused::params_ready`]), so that ZeRO's gathers of the others may
    /// still run (GPT); other models' parameters are all gathered first.
    pub fn waits_per_layer(&self) -> bool {
        self.net.waits_per_layer()
    }

    /// Whether the fused kernels are on ([`Model::use_fused_kernels`]).
    pub fn uses_fused_kernels(&self) -> bool {
        self.fused
    }

    /// Whether the residual adds and LayerNorms run through
    /// [`fused::add_norm`]'s (or, post-norm, [`fused::post_norm`]'s) CUDA kernels.
    pub fn fused_layer_norm(&self) -> bool {
        self.fused && self.net.fused_norms() && harness_kernels::kernels::layer_norm_fits(self.cfg.d_model)
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
        let pass = Pass { cfg: &self.cfg, recompute: self.recompute, fused: self.fused, train };
        self.net.output(input, target, &pass)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_format::suite::{ModelSpec, Recompute, FAMILIES};
    use harness_kernels::torch_ext;
    use tch::Kind;

    #[test]
    fn every_family_of_the_suite_format_has_one_here() {
        // `family` is an exhaustive match on `ModelKind`; the format's
        // registry test checks that FAMILIES holds every kind.
        for f in FAMILIES {
            assert_eq!(family(f.kind()).kind(), f.kind(), "{}", f.name());
        }
    }

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
