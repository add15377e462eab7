//! The `vision` family: image classifiers on `images` data, ResNets
//! (layers = depth, width = the first stage's channels) and, for the ViT
//! presets, Vision Transformers (layers, heads, width, MLP width as for
//! gpt). A sample is one image.

use super::{block, image, sizes, DataFit, DataKind, Family, ModelConfig, Preset, ShapeError, Unfit};
use crate::suite::spec::{DataSpec, ModelKind, ModelSpec, Workload};

/// The `vision` family.
pub struct Vision;

/// Presets: layers = ResNet depth, width = the first stage's channels,
/// feed-forward width = the features before the classifier; then the Vision
/// Transformers: layers, heads, width, MLP width as for gpt.
const PRESETS: &[Preset] = &[
    Preset::new("tiny", 10, 1, 8, 64),
    Preset::new("resnet18", 18, 1, 64, 512),
    Preset::new("resnet50", 50, 1, 64, 2048),
    Preset::new("vit-tiny", 2, 2, 32, 64),
    Preset::new("vit-b16", 12, 12, 768, 3072),
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

/// Tokens a ViT sees per image: its patches and the class token.
fn vit_tokens(side: f64, patch: f64) -> f64 {
    (side / patch).floor().powi(2) + 1.0
}

impl Family for Vision {
    fn kind(&self) -> ModelKind {
        ModelKind::Vision
    }

    fn name(&self) -> &'static str {
        "vision"
    }

    fn presets(&self) -> &'static [Preset] {
        PRESETS
    }

    fn data(&self) -> DataFit {
        DataFit {
            kinds: &[DataKind::Images],
            other: Some("the vision model trains on `kind = \"images\"` data"),
            claimed: Some(("image data needs `model.kind = \"vision\"`", None)),
        }
    }

    fn classifies(&self) -> bool {
        true
    }

    /// Its layers are not wrapped for recomputation.
    fn recomputes(&self) -> bool {
        false
    }

    fn patch(&self, preset: Option<&str>) -> Option<i64> {
        VIT_PATCH.iter().find(|v| preset == Some(v.0)).map(|v| v.1)
    }

    /// A ResNet has no heads: without a ViT preset, 1.
    fn fixed_heads(&self, patch: Option<i64>) -> Option<i64> {
        patch.is_none().then_some(1)
    }

    /// A ResNet's: the features the classifier reads.
    fn fixed_d_ff(&self, n_layer: i64, d_model: i64, patch: Option<i64>) -> Option<i64> {
        match (patch, resnet_stages(n_layer)) {
            (None, Some((_, bottleneck))) => Some(d_model * 8 * if bottleneck { 4 } else { 1 }),
            _ => None,
        }
    }

    /// A ResNet's depth is one of [`resnet_stages`]', and it has no heads
    /// or feed-forward width to set.
    fn check_shape(&self, spec: &ModelSpec, n_layer: i64, patch: Option<i64>) -> Result<(), ShapeError> {
        if patch.is_none() {
            if resnet_stages(n_layer).is_none() {
                return Err((format!("no ResNet of depth {n_layer}"), Some("`n_layer` is the depth: 10, 18, 34, 50 or 101".into())));
            }
            if spec.n_head.is_some() || spec.d_ff.is_some() {
                return Err(("a ResNet has no `n_head` or `d_ff`".into(), Some("set `n_layer` (depth) and `d_model` (width)".into())));
            }
        }
        Ok(())
    }

    /// A ViT's images cut into whole patches; a sample is one image.
    fn check_workload(&self, w: &Workload, cfg: Option<&ModelConfig>) -> Vec<Unfit> {
        let mut unfit = Vec::new();
        if let (Some(p), DataSpec::Images { image_size, .. }) = (cfg.and_then(|c| c.patch), &w.data) {
            if i64::from(*image_size) % p != 0 {
                unfit.push(Unfit {
                    at: &["data", "image_size"],
                    message: format!("the Vision Transformer cuts images into {p} x {p} patches: `image_size` must be a multiple of {p}"),
                    hint: None,
                });
            }
        }
        if w.seq_len != 1 {
            unfit.push(Unfit {
                at: &["seq_len"],
                message: "a vision workload's sample is one image: `seq_len` must be 1".into(),
                hint: Some("tokens/s then counts images/s".into()),
            });
        }
        unfit
    }

    /// A ViT: every layer's attention and MLP matrices, the patch
    /// projection and the head. A ResNet: one 3x3 convolution at the first
    /// stage's width per layer, and the classifier.
    fn params_at_least(&self, cfg: &ModelConfig, channels: f64) -> f64 {
        let [l, d, ff, v] = sizes(cfg);
        match cfg.patch {
            Some(p) => l * block(d, ff) + channels * (p * p) as f64 * d + v * d,
            None => 9.0 * d * d * l + ff * v,
        }
    }

    /// The fp32 input image, then a ViT's layers' outputs on every token,
    /// or a ResNet's stem's output.
    fn activations_at_least(&self, cfg: &ModelConfig, w: &Workload, e: f64) -> f64 {
        let [l, d, _, _] = sizes(cfg);
        let (c, s) = image(&w.data).unwrap_or((3.0, 32.0));
        let input = c * s * s * 4.0;
        match cfg.patch {
            Some(p) => input + vit_tokens(s, p as f64) * l * d * e,
            None => {
                // The stem: full resolution for small images, else a
                // 7x7 stride-2 convolution before the max-pool.
                let r = if s <= SMALL_IMAGE as f64 { s } else { ((s - 1.0) / 2.0).floor() + 1.0 };
                input + r * r * d * e
            }
        }
    }

    /// Per image (a sample is one image, one "token"): forward 2 x
    /// multiply-adds, backward twice the forward.
    fn flops_per_token(&self, cfg: &ModelConfig, params: i64) -> f64 {
        let [c, s] = cfg.image.unwrap_or([3, 224]);
        match cfg.patch {
            // As gpt's per token, with each part of the network
            // counted on the tokens it sees: the encoder blocks on
            // the patches and the class token, the patch projection
            // on the patches, the head on the class token alone;
            // the class token and positions do no multiply-adds.
            Some(p) => {
                let (d, t) = (cfg.d_model, (s / p) * (s / p) + 1);
                let patch = c * p * p * d + d;
                let head = d * cfg.vocab + cfg.vocab;
                let blocks = params - patch - head - d - t * d - 2 * d;
                6.0 * (t * blocks + (t - 1) * patch + head) as f64 + 12.0 * (cfg.n_layer * d * t * t) as f64
            }
            None => 6.0 * resnet_macs(cfg.n_layer, cfg.d_model, c, s, cfg.vocab),
        }
    }
}
