//! The model families as the suite format knows them, one file each:
//! `gpt`, `encoder`, `mlp`, `vision`, `t5`. Each is a [`Family`]: what
//! validation, the memory bounds, `ModelConfig::resolve` and the training
//! core ask about a family (its presets, the data it trains on, its
//! parameter, activation and FLOP counts, whether it classifies or
//! recomputes activations), answered in one place. `registry` lists them
//! ([`FAMILIES`]) and finds a kind's ([`of`]).
//!
//! This module holds what the families' files share: the trait, the
//! resolved shape it is asked about ([`ModelConfig`], resolved in
//! `suite/model.rs`), presets and data kinds. The training core builds each
//! family's network from a [`ModelConfig`] (crates/train/src/models/, a
//! file per family there too).

use serde::Serialize;

use super::spec::{DataSpec, ModelKind, ModelSpec, Workload};

mod encoder;
mod gpt;
mod mlp;
mod registry;
mod t5;
mod vision;

pub use registry::{of, FAMILIES};
pub use vision::{resnet_macs, resnet_stages, SMALL_IMAGE, VIT_PATCH};

/// A model's resolved shape (`ModelConfig::resolve`, in `suite/model.rs`).
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

/// A named size of a family's model: layers, heads, width, feed-forward
/// width (what each means for a family its file says).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preset {
    pub name: &'static str,
    pub n_layer: i64,
    pub n_head: i64,
    pub d_model: i64,
    pub d_ff: i64,
}

impl Preset {
    /// The preset `name`: layers, heads, width, feed-forward width.
    pub const fn new(name: &'static str, n_layer: i64, n_head: i64, d_model: i64, d_ff: i64) -> Preset {
        Preset { name, n_layer, n_head, d_model, d_ff }
    }
}

/// The kinds of `data` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataKind {
    Synthetic,
    Bin,
    Regression,
    Images,
    Pairs,
}

impl From<&DataSpec> for DataKind {
    /// The kind of a data table.
    fn from(data: &DataSpec) -> DataKind {
        match data {
            DataSpec::Synthetic { .. } => DataKind::Synthetic,
            DataSpec::Bin { .. } => DataKind::Bin,
            DataSpec::Regression { .. } => DataKind::Regression,
            DataSpec::Images { .. } => DataKind::Images,
            DataSpec::Pairs { .. } => DataKind::Pairs,
        }
    }
}

/// The data a family trains on, and what validation says when a
/// workload's model and data do not fit.
#[derive(Debug, Clone, Copy)]
pub struct DataFit {
    /// The data kinds its model trains on.
    pub kinds: &'static [DataKind],
    /// The error when its model is given other data (None: the data's own
    /// family says what it needs, as for the token models).
    pub other: Option<&'static str>,
    /// The error, and a hint, when another family's model is given the
    /// data of `kinds` (None: another family trains on it too).
    pub claimed: Option<(&'static str, Option<&'static str>)>,
}

/// A problem a family finds with a workload ([`Family::check_workload`]):
/// the keys under the workload's table it is at, its message, a hint.
#[derive(Debug, Clone)]
pub struct Unfit {
    pub at: &'static [&'static str],
    pub message: String,
    pub hint: Option<String>,
}

/// An error of `ModelConfig::resolve`: a message and a hint.
pub type ShapeError = (String, Option<String>);

/// What the suite format asks a model family. The methods with a default
/// are the questions only some families answer otherwise (the `vision`
/// family's ResNets have no heads and derive their feature width).
pub trait Family: Sync {
    /// The `model.kind` it is.
    fn kind(&self) -> ModelKind;

    /// Its name, as `model.kind` and messages write it.
    fn name(&self) -> &'static str;

    /// Its presets.
    fn presets(&self) -> &'static [Preset];

    /// The data it trains on.
    fn data(&self) -> DataFit;

    /// Whether it classifies: its evaluations report top-1 accuracy, its
    /// workloads may set `target_accuracy`.
    fn classifies(&self) -> bool;

    /// Whether its layers recompute their activations (`recompute`).
    fn recomputes(&self) -> bool;

    /// Whether its width is split into heads (`d_model` a multiple of
    /// `n_head`).
    fn splits_heads(&self) -> bool {
        true
    }

    /// The patch side of a Vision Transformer preset.
    fn patch(&self, _preset: Option<&str>) -> Option<i64> {
        None
    }

    /// The heads when the model table gives none, for a model without
    /// attention (whatever its preset says).
    fn fixed_heads(&self, _patch: Option<i64>) -> Option<i64> {
        None
    }

    /// The feed-forward width when the shape determines it.
    fn fixed_d_ff(&self, _n_layer: i64, _d_model: i64, _patch: Option<i64>) -> Option<i64> {
        None
    }

    /// The family's own checks of a resolved shape, after every size is
    /// found to be at least 1.
    fn check_shape(&self, _spec: &ModelSpec, _n_layer: i64, _patch: Option<i64>) -> Result<(), ShapeError> {
        Ok(())
    }

    /// The family's own checks of a workload, given its resolved model
    /// (None when it does not resolve).
    fn check_workload(&self, _w: &Workload, _cfg: Option<&ModelConfig>) -> Vec<Unfit> {
        Vec::new()
    }

    /// At least how many parameters the model of `cfg` has (its vocabulary,
    /// or classes, in `cfg.vocab`; `channels` of its images), as
    /// `limits::params_at_least` says.
    fn params_at_least(&self, cfg: &ModelConfig, channels: f64) -> f64;

    /// At least how many bytes one sample's activations take in a step of
    /// `w` with `element` bytes an activation, as
    /// `limits::step_activations_at_least` says.
    fn activations_at_least(&self, cfg: &ModelConfig, w: &Workload, element: f64) -> f64;

    /// Training FLOPs per token (`ModelConfig::flops_per_token`).
    fn flops_per_token(&self, cfg: &ModelConfig, params: i64) -> f64;
}

/// Layers, width, feed-forward width and vocabulary of `cfg`, in f64.
fn sizes(cfg: &ModelConfig) -> [f64; 4] {
    [cfg.n_layer, cfg.d_model, cfg.d_ff, cfg.vocab].map(|x| x as f64)
}

/// A transformer layer's attention projections and feed-forward matrices:
/// 4 d² + 2 d d_ff.
fn block(d: f64, ff: f64) -> f64 {
    4.0 * d * d + 2.0 * d * ff
}

/// (channels, side) of the workload's images, if it trains on images.
pub fn image(data: &DataSpec) -> Option<(f64, f64)> {
    match data {
        DataSpec::Images { channels, image_size, .. } => Some((f64::from(*channels), f64::from(*image_size))),
        _ => None,
    }
}
