//! The `encoder` family: `nn.TransformerEncoder` layers with a mean-pool
//! regression head (preset `claims5`: the TransformerEncoder regression of
//! docs/benchmarks.md), trained on `regression` data.

use super::{block, sizes, DataFit, DataKind, Family, ModelConfig, Preset};
use crate::suite::spec::{ModelKind, Workload};

/// The `encoder` family.
pub struct Encoder;

/// Presets: layers, heads, width, feed-forward width.
const PRESETS: &[Preset] = &[Preset::new("tiny", 2, 4, 64, 256), Preset::new("claims5", 6, 8, 512, 2048)];

impl Family for Encoder {
    fn kind(&self) -> ModelKind {
        ModelKind::Encoder
    }

    fn name(&self) -> &'static str {
        "encoder"
    }

    fn presets(&self) -> &'static [Preset] {
        PRESETS
    }

    fn data(&self) -> DataFit {
        DataFit {
            kinds: &[DataKind::Regression],
            other: Some("the encoder model trains on `kind = \"regression\"` data"),
            claimed: Some((
                "regression data needs `model.kind = \"encoder\"`",
                Some("gpt and mlp train on tokens: use `synthetic` or `bin` data"),
            )),
        }
    }

    fn classifies(&self) -> bool {
        false
    }

    fn recomputes(&self) -> bool {
        true
    }

    /// Every layer's attention and feed-forward matrices (the inputs are
    /// vectors of its width: no embedding).
    fn params_at_least(&self, cfg: &ModelConfig, _channels: f64) -> f64 {
        let [l, d, ff, _] = sizes(cfg);
        l * block(d, ff)
    }

    /// The fp32 inputs, then each layer's output.
    fn activations_at_least(&self, cfg: &ModelConfig, w: &Workload, e: f64) -> f64 {
        let [l, d, _, _] = sizes(cfg);
        let t = f64::from(w.seq_len);
        t * d * 4.0 + t * l * d * e
    }

    /// Per position, as gpt's per token.
    fn flops_per_token(&self, cfg: &ModelConfig, params: i64) -> f64 {
        6.0 * params as f64 + 12.0 * (cfg.n_layer * cfg.d_model * cfg.seq_len) as f64
    }
}
