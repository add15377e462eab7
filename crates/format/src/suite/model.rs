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
    /// `vision`: the input images' (channels, height = width), from the data.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<[i64; 2]>,
    /// `vision` Transformers (ViT presets): the side of a patch, in pixels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch: Option<i64>,
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
    // Vision: layers = ResNet depth, width = the first stage's channels,
    // feed-forward width = the features before the classifier.
    (ModelKind::Vision, "tiny", 10, 1, 8, 64),
    (ModelKind::Vision, "resnet18", 18, 1, 64, 512),
    (ModelKind::Vision, "resnet50", 50, 1, 64, 2048),
    // Vision Transformers: layers, heads, width, MLP width as for gpt.
    (ModelKind::Vision, "vit-tiny", 2, 2, 32, 64),
    (ModelKind::Vision, "vit-b16", 12, 12, 768, 3072),
    // T5 v1.0 as released: layers per stack (encoder and decoder alike).
    (ModelKind::T5, "tiny", 2, 4, 64, 256),
    (ModelKind::T5, "small", 6, 8, 512, 2048),
    (ModelKind::T5, "base", 12, 12, 768, 3072),
    (ModelKind::T5, "large", 24, 16, 1024, 4096),
];

/// The patch side of the Vision Transformer presets (a `vision` model is a
/// ViT exactly when its preset is one of these).
pub const VIT_PATCH: &[(&str, i64)] = &[("vit-tiny", 4), ("vit-b16", 16)];

/// A ResNet's blocks per stage and whether they are bottlenecks, by depth.
pub fn resnet_stages(depth: i64) -> Option<([i64; 4], bool)> {
    match depth {
        10 => Some(([1, 1, 1, 1], false)),
        18 => Some(([2, 2, 2, 2], false)),
        34 => Some(([3, 4, 6, 3], false)),
        50 => Some(([3, 4, 6, 3], true)),
        101 => Some(([3, 4, 23, 3], true)),
        _ => None,
    }
}

/// Images up to this side get the small-image stem (a 3x3 convolution at
/// full resolution, no max-pool, as ResNets for CIFAR); larger ones
/// ImageNet's (7x7 stride 2, then a 3x3 stride-2 max-pool).
pub const SMALL_IMAGE: i64 = 64;

/// Multiply-adds of a ResNet's forward pass on one image of `channels` x
/// `size` x `size` (convolutions and the classifier; normalisation,
/// activations and pooling left out).
pub fn resnet_macs(depth: i64, width: i64, channels: i64, size: i64, classes: i64) -> f64 {
    let Some((blocks, bottleneck)) = resnet_stages(depth) else { return 0.0 };
    // Output side of a convolution with kernel k, stride st, padding k / 2.
    let out = |s: i64, k: i64, st: i64| (s + 2 * (k / 2) - k) / st + 1;
    let mut macs = 0.0;
    let mut s = size;
    if size <= SMALL_IMAGE {
        macs += (s * s * 9 * channels * width) as f64;
    } else {
        s = out(s, 7, 2);
        macs += (s * s * 49 * channels * width) as f64;
        s = out(s, 3, 2);
    }
    let expansion = if bottleneck { 4 } else { 1 };
    let mut c_in = width;
    for (stage, &n) in blocks.iter().enumerate() {
        let planes = width << stage;
        for b in 0..n {
            let stride = if stage > 0 && b == 0 { 2 } else { 1 };
            let o = out(s, 3, stride);
            let c_out = planes * expansion;
            macs += if bottleneck {
                (s * s * c_in * planes + o * o * 9 * planes * planes + o * o * planes * c_out) as f64
            } else {
                (o * o * 9 * c_in * planes + o * o * 9 * planes * planes) as f64
            };
            if stride != 1 || c_in != c_out {
                macs += (o * o * c_in * c_out) as f64;
            }
            c_in = c_out;
            s = o;
        }
    }
    macs + (c_in * classes) as f64
}

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
        // A ResNet has no heads: without a ViT preset, 1.
        let resnet = spec.kind == ModelKind::Vision && base.is_none_or(|p| !VIT_PATCH.iter().any(|v| v.0 == p.1));
        let n_head = if resnet && spec.n_head.is_none() { 1 } else { pick(spec.n_head, base.map(|p| p.3), "n_head")? };
        let d_model = pick(spec.d_model, base.map(|p| p.4), "d_model")?;
        let patch = VIT_PATCH.iter().find(|v| spec.kind == ModelKind::Vision && spec.preset.as_deref() == Some(v.0)).map(|v| v.1);
        let mut d_ff = spec.d_ff.map(i64::from).or(base.map(|p| p.5)).unwrap_or(4 * d_model);
        if let (ModelKind::Vision, None, Some((_, bottleneck))) = (spec.kind, patch, resnet_stages(n_layer)) {
            // The features the classifier reads.
            d_ff = d_model * 8 * if bottleneck { 4 } else { 1 };
        }
        if n_layer < 1 || n_head < 1 || d_model < 1 || d_ff < 1 {
            return Err(("model sizes must be at least 1".into(), None));
        }
        if spec.kind == ModelKind::Vision && patch.is_none() {
            if resnet_stages(n_layer).is_none() {
                return Err((format!("no ResNet of depth {n_layer}"), Some("`n_layer` is the depth: 10, 18, 34, 50 or 101".into())));
            }
            if spec.n_head.is_some() || spec.d_ff.is_some() {
                return Err(("a ResNet has no `n_head` or `d_ff`".into(), Some("set `n_layer` (depth) and `d_model` (width)".into())));
            }
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
            image: None,
            patch,
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
            // Per image (a sample is one image, one "token"): forward 2 x
            // multiply-adds, backward twice the forward.
            ModelKind::Vision => {
                let [c, s] = self.image.unwrap_or([3, 224]);
                match self.patch {
                    // As gpt's per token, with each part of the network
                    // counted on the tokens it sees: the encoder blocks on
                    // the patches and the class token, the patch projection
                    // on the patches, the head on the class token alone;
                    // the class token and positions do no multiply-adds.
                    Some(p) => {
                        let (d, t) = (self.d_model, (s / p) * (s / p) + 1);
                        let patch = c * p * p * d + d;
                        let head = d * self.vocab + self.vocab;
                        let blocks = params - patch - head - d - t * d - 2 * d;
                        6.0 * (t * blocks + (t - 1) * patch + head) as f64 + 12.0 * (self.n_layer * d * t * t) as f64
                    }
                    None => 6.0 * resnet_macs(self.n_layer, self.d_model, c, s, self.vocab),
                }
            }
            // Per target token, the source as long as the target: the
            // parameters, and three attentions per layer pair (the
            // encoder's, the decoder's, the cross attention).
            ModelKind::T5 => 6.0 * params as f64 + 36.0 * (self.n_layer * self.d_model * self.seq_len) as f64,
        }
    }
}
