//! A model's shape, resolved from a suite's `model` table and its family's
//! presets: pure configuration (no tensors), so that validation can check
//! it and the training core can build the model from it. What differs by
//! family the family answers (`family::of`); [`ModelConfig`] itself is
//! defined with the families' trait (`suite/family/mod.rs`), which every
//! family's file reads.

use super::family::{self, Family};
use super::spec::ModelSpec;

pub use super::family::ModelConfig;

impl ModelConfig {
    /// Resolves a suite's model table; errors carry a message and a hint.
    pub fn resolve(spec: &ModelSpec, vocab: u32, seq_len: u32) -> Result<ModelConfig, (String, Option<String>)> {
        let family = family::of(spec.kind);
        let presets = family.presets();
        let names = || presets.iter().map(|p| p.name).collect::<Vec<_>>().join(", ");
        let base = match &spec.preset {
            Some(name) => match presets.iter().find(|p| p.name == name) {
                Some(p) => Some(*p),
                None => {
                    return Err((format!("unknown {:?} preset `{name}`", spec.kind).to_lowercase(), Some(format!("presets: {}", names()))))
                }
            },
            None => None,
        };
        let pick = |v: Option<u32>, from_preset: Option<i64>, key: &str| -> Result<i64, (String, Option<String>)> {
            match (v, from_preset) {
                (Some(v), _) => Ok(v as i64),
                (None, Some(p)) => Ok(p),
                (None, None) => Err((format!("the model needs `preset` or `{key}`"), Some(format!("presets: {}", names())))),
            }
        };
        let n_layer = pick(spec.n_layer, base.map(|p| p.n_layer), "n_layer")?;
        let patch = family.patch(spec.preset.as_deref());
        let n_head = match (spec.n_head, family.fixed_heads(patch)) {
            (None, Some(heads)) => heads,
            _ => pick(spec.n_head, base.map(|p| p.n_head), "n_head")?,
        };
        let d_model = pick(spec.d_model, base.map(|p| p.d_model), "d_model")?;
        let d_ff = family
            .fixed_d_ff(n_layer, d_model, patch)
            .unwrap_or_else(|| spec.d_ff.map(i64::from).or(base.map(|p| p.d_ff)).unwrap_or(4 * d_model));
        if n_layer < 1 || n_head < 1 || d_model < 1 || d_ff < 1 {
            return Err(("model sizes must be at least 1".into(), None));
        }
        family.check_shape(spec, n_layer, patch)?;
        if family.splits_heads() && d_model % n_head != 0 {
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
            image: None,
            patch,
        })
    }

    /// Its family: what validation, the bounds and the training core ask
    /// about it.
    pub fn family(&self) -> &'static dyn Family {
        family::of(self.kind)
    }

    /// Training FLOPs per token (per position for the encoder, per image
    /// for vision, per target token for t5): 6 x matmul parameters + 12 x
    /// layers x width x sequence for attention, PaLM's convention (its
    /// appendix B), as each family counts it ([`Family::flops_per_token`]);
    /// docs/results-format.md (`flops_per_token`) gives the formulas.
    pub fn flops_per_token(&self, params: i64) -> f64 {
        self.family().flops_per_token(self, params)
    }
}
