//! The `t5` family: T5's encoder–decoder (v1.0), trained with teacher
//! forcing on sequence pairs (`pairs` data).

use super::{block, sizes, DataFit, DataKind, Family, ModelConfig, Preset};
use crate::suite::spec::{ModelKind, Workload};

/// The `t5` family.
pub struct T5;

/// T5 v1.0 as released: layers per stack (encoder and decoder alike),
/// heads, width, feed-forward width.
const PRESETS: &[Preset] = &[
    Preset::new("tiny", 2, 4, 64, 256),
    Preset::new("small", 6, 8, 512, 2048),
    Preset::new("base", 12, 12, 768, 3072),
    Preset::new("large", 24, 16, 1024, 4096),
];

impl Family for T5 {
    fn kind(&self) -> ModelKind {
        ModelKind::T5
    }

    fn name(&self) -> &'static str {
        "t5"
    }

    fn presets(&self) -> &'static [Preset] {
        PRESETS
    }

    fn data(&self) -> DataFit {
        DataFit {
            kinds: &[DataKind::Pairs],
            other: Some("the t5 model trains on sequence pairs: `kind = \"pairs\"` data"),
            claimed: Some(("pairs data needs `model.kind = \"t5\"`", Some("gpt and mlp train on tokens: use `synthetic` or `bin` data"))),
        }
    }

    fn classifies(&self) -> bool {
        false
    }

    /// Its layers are not wrapped for recomputation.
    fn recomputes(&self) -> bool {
        false
    }

    /// Both stacks' layers (the decoder's add cross attention), the shared
    /// embedding.
    fn params_at_least(&self, cfg: &ModelConfig, _channels: f64) -> f64 {
        let [l, d, ff, v] = sizes(cfg);
        let block = block(d, ff);
        l * block + l * (block + 4.0 * d * d) + v * d
    }

    /// Each layer's output in both stacks, and the logits, per position.
    fn activations_at_least(&self, cfg: &ModelConfig, w: &Workload, e: f64) -> f64 {
        let [l, d, _, v] = sizes(cfg);
        let t = f64::from(w.seq_len);
        t * (2.0 * l * d + v) * e
    }

    /// Per target token, the source as long as the target: the parameters,
    /// and three attentions per layer pair (the encoder's, the decoder's,
    /// the cross attention).
    fn flops_per_token(&self, cfg: &ModelConfig, params: i64) -> f64 {
        6.0 * params as f64 + 36.0 * (cfg.n_layer * cfg.d_model * cfg.seq_len) as f64
    }
}
