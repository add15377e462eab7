//! Suites: the TOML a user writes, checked and expanded into a [`Plan`].
//!
//! [`Suite::load`] parses (unknown keys and wrong types are errors, thanks to
//! `deny_unknown_fields`), then [`Suite::validate`] checks values against each
//! other. Every problem is reported as a [`SuiteError`] that renders with the
//! file, line and column, the offending source line and a hint. The format is
//! documented in `docs/suite-format.md`.
//!
//! * `spec`: the serde types of the format and their defaults.
//! * `family`: the model families, a file each, and their registry
//!   ([`family::of`], [`FAMILIES`]): what validation, the bounds and the
//!   training core ask about a family (presets, data, estimates, FLOPs).
//! * `model`: [`ModelConfig`], a model's shape resolved from its table and
//!   its family's presets (configuration only; the training core builds it).
//! * `validate`: [`Suite`], loading, parsing and the checks, with their
//!   messages and hints.
//! * `limits`: the bounds of every numeric key and of names, with the
//!   lower-bound estimates of memory that validation compares with them.
//! * `plan`: the expansion into [`Plan`] entries and their seeds.
//! * `floor`: the best reachable loss and accuracy a data table gives
//!   ([`DataSpec::loss_floor`]), for the training core and `harness verify`.
//! * `standard`: the released standard suites, their tracks, and entering a
//!   plugin into them.

pub mod family;
pub mod floor;
pub mod limits;
mod model;
mod plan;
mod spec;
pub mod standard;
mod validate;

pub use family::{resnet_macs, resnet_stages, DataKind, Family, ModelConfig, Preset, FAMILIES, SMALL_IMAGE, VIT_PATCH};
pub use plan::{mix_seed, Plan, PlanEntry};
pub use spec::{
    DataSpec, Decay, DeviceKind, FaultSpec, Kernels, ModelKind, ModelSpec, NcclTransport, OptimizerSpec, Order, Pipeline, PluginSpec,
    Precision, ProjectionSpec, Recompute, RecomputeSpec, ReduceDtype, ScheduleSpec, Strategy, SuiteMeta, SuiteSpec, Track, Workload,
    BATCH_POLICIES, CHECKPOINT_POLICIES, COMPRESSORS, DEFAULT_BIN_VOCAB, NCCL_RESERVED, TRACK_KINDS,
};
pub use validate::{Suite, SuiteError, SuiteErrors};

/// The suite that `harness run` uses when none is named.
pub const DEFAULT_SUITE: &str = "suites/cpu.toml";
