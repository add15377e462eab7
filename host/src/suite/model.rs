//! A model's shape, resolved from a suite's `model` table and its presets:
//! pure configuration (no tensors), so that validation can check it and the
//! training core can build the model from it.

use serde::Serialize;

use super::spec::{ModelKind, ModelSpec};

/// A model's resolved shape.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ModelConfig {
    pub kind: ModelKind,
    pub preset: Option<String>,
    pub n_layer: i64,
    pub n_head: i64,
    pub d_model: i64,
    pub d_ff: i64,
    pub vocab: i64,
    pub seq_len: i64,
    pub dropout: f64,
}

/// Presets: (kind, name, layers, heads, width, feed-forward width).
pub const PRESETS: &[(ModelKind, &str, i64, i64, i64, i64)] = &[
    (ModelKind::Gpt, "tiny", 2, 4, 128, 512),
    (ModelKind::Gpt, "small", 4, 4, 256, 1024),
    (ModelKind::Gpt, "gpt2-124m", 12, 12, 768, 3072),
    (ModelKind::Gpt, "gpt2-350m", 24, 16, 1024, 4096),
    (ModelKind::Gpt, "1.3b", 24, 16, 2048, 8192),
    (ModelKind::Encoder, "tiny", 2, 4, 64, 256),
    (ModelKind::Encoder, "claims5", 6, 8, 512, 2048),
    (ModelKind::Mlp, "tiny", 1, 1, 64, 256),
    (ModelKind::Mlp, "small", 1, 1, 256, 1024),
];

impl ModelConfig {
    /// Resolves a suite's model table; errors carry a message and a hint.
    pub fn resolve(spec: &ModelSpec, vocab: u32, seq_len: u32) -> Result<ModelConfig, (String, Option<String>)> {
        let names = |k: ModelKind| PRESETS.iter().filter(|p| p.0 == k).map(|p| p.1).collect::<Vec<_>>().join(", ");
        let base = match &spec.preset {
            Some(name) => match PRESETS.iter().find(|p| p.0 == spec.kind && p.1 == name) {
                Some(p) => Some(*p),
                None => {
                    return Err((
                        format!("unknown {:?} preset `{name}`", spec.kind).to_lowercase(),
                        Some(format!("presets: {}", names(spec.kind))),
                    ))
                }
            },
            None => None,
        };
        let pick = |v: Option<u32>, from_preset: Option<i64>, key: &str| -> Result<i64, (String, Option<String>)> {
            match (v, from_preset) {
                (Some(v), _) => Ok(v as i64),
                (None, Some(p)) => Ok(p),
                (None, None) => Err((format!("the model needs `preset` or `{key}`"), Some(format!("presets: {}", names(spec.kind))))),
            }
        };
        let n_layer = pick(spec.n_layer, base.map(|p| p.2), "n_layer")?;
        let n_head = pick(spec.n_head, base.map(|p| p.3), "n_head")?;
        let d_model = pick(spec.d_model, base.map(|p| p.4), "d_model")?;
        let d_ff = spec.d_ff.map(i64::from).or(base.map(|p| p.5)).unwrap_or(4 * d_model);
        if n_layer < 1 || n_head < 1 || d_model < 1 || d_ff < 1 {
            return Err(("model sizes must be at least 1".into(), None));
        }
        if spec.kind != ModelKind::Mlp && d_model % n_head != 0 {
            return Err((
                format!("d_model ({d_model}) is not a multiple of n_head ({n_head})"),
                Some("each head gets d_model / n_head channels".into()),
            ));
        }
        Ok(ModelConfig {
            kind: spec.kind,
            preset: spec.preset.clone(),
            n_layer,
            n_head,
            d_model,
            d_ff,
            vocab: vocab as i64,
            seq_len: seq_len as i64,
            dropout: spec.dropout.unwrap_or(0.0),
        })
    }

    /// Training FLOPs per token (per position for the encoder): 6 x matmul
    /// parameters + 12 x layers x width x sequence for attention, PaLM's
    /// convention (its appendix B); docs/results-format.md
    /// (`flops_per_token`) gives the formulas.
    pub fn flops_per_token(&self, params: i64) -> f64 {
        match self.kind {
            ModelKind::Gpt | ModelKind::Encoder => 6.0 * params as f64 + 12.0 * (self.n_layer * self.d_model * self.seq_len) as f64,
            // The embedding lookup does no multiply-adds.
            ModelKind::Mlp => 6.0 * (params - self.vocab * self.d_model) as f64,
        }
    }
}
