//! The `gpt` family: decoder-only transformers (GPT-2 style, tied
//! embedding), trained on tokens (`synthetic` or `bin` data).

use super::{block, sizes, DataFit, DataKind, Family, ModelConfig, Preset};
use crate::suite::spec::{ModelKind, Workload};

/// The `gpt` family.
pub struct Gpt;

/// Presets: layers, heads, width, feed-forward width.
const PRESETS: &[Preset] = &[
    Preset::new("tiny", 2, 4, 128, 512),
    Preset::new("small", 4, 4, 256, 1024),
    Preset::new("gpt2-124m", 12, 12, 768, 3072),
    Preset::new("gpt2-350m", 24, 16, 1024, 4096),
    Preset::new("1.3b", 24, 16, 2048, 8192),
];

impl Family for Gpt {
    fn kind(&self) -> ModelKind {
        ModelKind::Gpt
    }

    fn name(&self) -> &'static str {
        "gpt"
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

    /// Every layer's attention and feed-forward matrices, the token and
    /// position embeddings.
    fn params_at_least(&self, cfg: &ModelConfig, _channels: f64) -> f64 {
        let [l, d, ff, v] = sizes(cfg);
        l * block(d, ff) + (v + cfg.seq_len as f64) * d
    }

    /// Each layer's output and the logits, per position.
    fn activations_at_least(&self, cfg: &ModelConfig, w: &Workload, e: f64) -> f64 {
        let [l, d, _, v] = sizes(cfg);
        let t = f64::from(w.seq_len);
        t * (l * d + v) * e
    }

    /// 6 x matmul parameters + 12 x layers x width x sequence for
    /// attention, PaLM's convention (its appendix B).
    fn flops_per_token(&self, cfg: &ModelConfig, params: i64) -> f64 {
        6.0 * params as f64 + 12.0 * (cfg.n_layer * cfg.d_model * cfg.seq_len) as f64
    }
}
