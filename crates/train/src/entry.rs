//! What an entry is given ([`EntryContext`]), reports after each step
//! ([`Progress`]) and gives back ([`EntryOutput`]): the types between
//! [`crate::run_entry`], its caller and the parts of the loop.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use harness_format::results::Metrics;
use harness_format::suite::{PlanEntry, Workload};
use tch::Device;

/// What a running entry reports to the user, after each step.
#[derive(Debug, Clone)]
pub struct Progress {
    pub step: u64,
    pub total_steps: Option<u64>,
    pub elapsed: Duration,
    pub time_budget: Option<Duration>,
    pub loss: Option<f64>,
    pub tokens_per_s: Option<f64>,
    /// `--resume`: the step of the checkpoint the entry went on from, in
    /// the report sent once before its first step.
    pub resumed_from: Option<u64>,
}

/// Everything an entry needs besides its workload.
pub struct EntryContext<'a> {
    pub workload: &'a Workload,
    pub entry: &'a PlanEntry,
    /// The sha256 of the suite file: the entry's checkpoints name it, and
    /// `--resume` refuses those of another suite.
    pub suite_sha256: &'a str,
    pub suite_dir: &'a Path,
    pub device: Device,
    pub warmup_steps: u64,
    pub peak_tflops: Option<f64>,
    /// Memory of the training device (GPU memory, or the host's RAM).
    pub memory_total_bytes: u64,
    /// Gradient bucket size for data parallelism (none: harness's choice,
    /// [`crate::dp::DataParallel::auto_bucket_bytes`]).
    pub bucket_bytes: Option<u64>,
    /// The suite's plugins.
    pub plugins: &'a harness_sandbox::plugin::PluginSet,
    /// Where this entry's checkpoints go (removed when the entry succeeds).
    pub checkpoint_dir: std::path::PathBuf,
    /// `harness run --resume`: go on from the newest checkpoint an
    /// interrupted run of this entry left (else checkpoints there are stale
    /// and removed).
    pub resume: bool,
    /// `harness run --trace`: the file for the trace of this entry's first
    /// step after warm-up (rank 0 records it).
    pub trace: Option<std::path::PathBuf>,
}

/// The outcome of a finished entry.
pub struct EntryOutput {
    pub metrics: Metrics,
    pub histograms: BTreeMap<String, String>,
    /// What the user should know that is not a failure (e.g. a fused kernel
    /// that could not be used); launch shows it.
    pub warnings: Vec<String>,
}
