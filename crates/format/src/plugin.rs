//! Plugins as result files record them: the artifact's identity
//! ([`Manifest`]: name, version, kind, transport, contract, sha256) and what
//! it did in an entry ([`PluginRecord`]). Loading and running plugins is the
//! sandbox's job.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::histogram::LatencySummary;

/// The three plugin kinds (WIT worlds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    Compressor,
    BatchPolicy,
    CheckpointPolicy,
}

impl Kind {
    /// The WIT world name.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Compressor => "compressor",
            Kind::BatchPolicy => "batch-policy",
            Kind::CheckpointPolicy => "checkpoint-policy",
        }
    }
}

/// How a plugin runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Transport {
    #[serde(rename = "wasm")]
    Wasm,
    #[serde(rename = "native (unsandboxed)")]
    Native,
}

/// What identifies a plugin artifact; `harness plugin inspect` prints it and
/// a suite's `[[plugin]]` can pin its fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub name: String,
    pub version: String,
    pub kind: Kind,
    pub transport: Transport,
    /// WASM: the WIT package version; native: the ABI version.
    pub abi: String,
    pub sha256: String,
    pub path: PathBuf,
}

/// What one plugin did in an entry (results format, `metrics.plugins`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PluginRecord {
    /// compressor, batch_policy or checkpoint.
    pub slot: String,
    #[serde(flatten)]
    pub manifest: Manifest,
    /// Calls into the plugin, and the time inside them.
    pub calls: u64,
    pub call: Option<LatencySummary>,
    /// Host ops the plugin ran.
    pub host_ops: u64,
    /// Bytes the plugin copied into its own memory (`read-f32`).
    pub read_bytes: u64,
    /// Seconds loading the artifact took (reading, validating and, for a
    /// component, compiling it), once per run: not training time.
    #[serde(default)]
    pub load_s: f64,
    /// Seconds making and configuring this entry's instance took, before
    /// training started: not training time.
    #[serde(default)]
    pub instantiate_s: f64,
}

/// A plugin's record and its call-time histogram (encoded), for results.
pub type PluginReport = (PluginRecord, String);
