//! What the training core asks a model family ([`Family`]: build its
//! network, and whether bf16 images, the fused cross-entropy and CUDA-graph
//! capture apply to it), and what a family's network does ([`Network`]):
//! one file per family beside this one (`gpt`, `encoder`, `mlp`, `vision`,
//! `t5`), found by `models::family` (models/mod.rs). The suite format's
//! side of a family (presets, data, estimates, FLOPs) is
//! `harness_format::suite::family`.

use tch::{nn, Tensor};

use super::layers::Shape;
use harness_format::suite::{ModelConfig, ModelKind, Recompute};

/// What a forward pass ends with.
pub enum Output {
    /// A scalar loss with its graph.
    Loss(Tensor),
    /// `[n, vocab]` next-token logits and their `[n]` targets.
    Logits { logits: Tensor, target: Tensor },
}

/// What a network's forward pass is given besides its batch.
pub(crate) struct Pass<'a> {
    pub(crate) cfg: &'a ModelConfig,
    /// Which layers recompute their activations.
    pub(crate) recompute: Recompute,
    /// harness's fused kernels (`Model::use_fused_kernels`).
    pub(crate) fused: bool,
    pub(crate) train: bool,
}

impl Pass<'_> {
    /// A layer's [`Shape`] on a `b x t` batch.
    pub(crate) fn shape(&self, b: i64, t: i64) -> Shape {
        let cfg = self.cfg;
        Shape { b, t, heads: cfg.n_head, d_model: cfg.d_model, dropout: cfg.dropout, train: self.train, fused: self.fused }
    }

    /// Whether layer `i` recomputes its activations.
    pub(crate) fn again(&self, i: usize) -> bool {
        self.recompute.layer(i)
    }
}

/// A family's network, as `Model` drives it.
pub(crate) trait Network: Send {
    /// The forward pass up to the loss: token models stop at the logits,
    /// so the caller may compute the loss with a fused kernel.
    fn output(&self, input: &Tensor, target: &Tensor, pass: &Pass) -> Output;

    /// Tells the network that harness's fused kernels serve it, for the
    /// networks that hold that themselves.
    fn use_fused_kernels(&mut self, _on: bool) {}

    /// Whether the forward pass waits for each layer's parameters itself
    /// (`fused::params_ready`), so that ZeRO's gathers of the others may
    /// still run.
    fn waits_per_layer(&self) -> bool {
        false
    }

    /// Whether it has LayerNorms that the fused kernels serve (residual
    /// add and LayerNorm, or post-norm).
    fn fused_norms(&self) -> bool {
        false
    }
}

/// What the training core asks a model family.
pub(crate) trait Family: Sync {
    /// The `model.kind` it is.
    fn kind(&self) -> ModelKind;

    /// Its network's variables under `p`, with its network.
    fn build(&self, p: &nn::Path, cfg: &ModelConfig) -> Box<dyn Network>;

    /// Whether its images go to the device in bf16 under bf16 autocast
    /// (its first layer would cast them: the same values, a smaller batch).
    fn bf16_images(&self) -> bool;

    /// Whether the fused cross-entropy serves its logits (with the fused
    /// kernels).
    fn fused_cross_entropy(&self) -> bool;

    /// Whether its step is checked under CUDA-graph capture
    /// (`graph::Eligibility::family_checked`).
    fn graph_checked(&self) -> bool;
}

/// Runs `layer` on `x`; with `recompute`, through [`torch_ext::recompute`]
/// on a copy sharing the layer's parameters.
///
/// [`torch_ext::recompute`]: harness_kernels::torch_ext::recompute
macro_rules! layer {
    ($layer:expr, $x:expr, $shape:expr, $recompute:expr) => {{
        let (layer, x, s) = ($layer, $x, $shape);
        if $recompute && s.train {
            let (own, s) = (layer.share(), *s);
            harness_kernels::torch_ext::recompute(x, s.dropout > 0.0, move |x| own.forward(x, &s)).unwrap_or_else(|e| panic!("{e}"))
        } else {
            layer.forward(x, s)
        }
    }};
}
pub(crate) use layer;
