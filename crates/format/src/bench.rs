//! What `harness bench allreduce` prints (one JSON object a line): its
//! NCCL all-reduces of a result's gradient buckets, back to back, timed on
//! the host. `harness project` reads these records to calibrate the
//! collectives' bandwidth on the machine they ran on.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// One `harness bench allreduce` record. Older records lack `stream` and
/// `timed`; `bench/allreduce_busbw.py` (torch.distributed) writes the same
/// `world_size` and `buckets` keys beside keys of its own, so its records
/// read too.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllreduceBench {
    /// Ranks (GPUs) that took part.
    pub world_size: u32,
    /// `legacy` (libtorch's stream) or `side` (the overlapped reduction's
    /// stream); absent in older records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
    /// Whether each all-reduce was timed with events as in training; absent
    /// in older records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timed: Option<bool>,
    /// The buckets all-reduced in one round, and the round's time.
    pub buckets: BenchBuckets,
}

/// One round of a bench: every bucket all-reduced once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchBuckets {
    /// Buckets (all-reduces) in a round.
    pub count: u64,
    /// Their bytes, summed.
    pub bytes: u64,
    /// Milliseconds a round took (mean over the timed rounds).
    pub ms_per_step: f64,
    /// bytes / time, GB/s.
    pub algbw_gbs: f64,
    /// nccl-tests' bus bandwidth: algbw x 2(n-1)/n, GB/s.
    pub busbw_gbs: f64,
}

/// Why a bench record could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    File(#[from] crate::files::FileError),
    #[error("{path} is not a `harness bench allreduce` record: {source}")]
    Parse { path: std::path::PathBuf, source: serde_json::Error },
}

impl AllreduceBench {
    /// Reads a record: a file holding one JSON object (the line the bench
    /// printed), at most [`crate::files::MACHINE_MAX_BYTES`].
    pub fn read(path: &Path) -> Result<AllreduceBench, BenchError> {
        let bytes = crate::files::read_capped(path, crate::files::MACHINE_MAX_BYTES)?;
        serde_json::from_slice(&bytes).map_err(|source| BenchError::Parse { path: path.into(), source })
    }
}
