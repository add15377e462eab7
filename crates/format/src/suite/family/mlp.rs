//! The `mlp` family: a token MLP (embedding, one hidden layer, logits of
//! the next token), trained on tokens (`synthetic` or `bin` data).

use super::{sizes, DataFit, DataKind, Family, ModelConfig, Preset};
use crate::suite::spec::{ModelKind, Workload};

/// The `mlp` family.
pub struct Mlp;

/// Presets: layers, heads (none: 1), width, hidden width.
const PRESETS: &[Preset] = &[Preset::new("tiny", 1, 1, 64, 256), Preset::new("small", 1, 1, 256, 1024)];

impl Family for Mlp {
    fn kind(&self) -> ModelKind {
        ModelKind::Mlp
    }

    fn name(&self) -> &'static str {
        "mlp"
    }

    fn presets(&self) -> &'static [Preset] {
        PRESETS
    }

    fn data(&self) -> DataFit {
        DataFit { kinds: &[DataKind::Synthetic, DataKind::Bin], other: None, claimed: None }
    }

    fn classifies(&self) -> bool {
        false
    }

    fn recomputes(&self) -> bool {
        true
    }

    /// No attention: no heads to split the width into.
    fn splits_heads(&self) -> bool {
        false
    }

    /// The embedding, the hidden layer and the output layer.
    fn params_at_least(&self, cfg: &ModelConfig, _channels: f64) -> f64 {
        let [_, d, ff, v] = sizes(cfg);
        v * d + d * ff + ff * v
    }

    /// The embedding and the logits, per position.
    fn activations_at_least(&self, cfg: &ModelConfig, w: &Workload, e: f64) -> f64 {
        let [_, d, _, v] = sizes(cfg);
        let t = f64::from(w.seq_len);
        t * (d + v) * e
    }

    /// 6 x matmul parameters: the embedding lookup does no multiply-adds.
    fn flops_per_token(&self, cfg: &ModelConfig, params: i64) -> f64 {
        6.0 * (params - cfg.vocab * cfg.d_model) as f64
    }
}
