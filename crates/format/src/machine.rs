//! The machine a result was measured on, as result files carry it
//! (`machine`): CPU, memory, GPUs, driver, CUDA, libtorch, NCCL and harness's
//! own version. Reading it off the machine is the device layer's job.

use serde::{Deserialize, Serialize};

/// One GPU as the driver describes it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GpuInfo {
    pub index: usize,
    pub name: String,
    pub memory_bytes: u64,
    pub compute_capability: String,
}

/// The machine a result was measured on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Fingerprint {
    pub hostname: String,
    pub os: String,
    pub cpu: String,
    pub cpu_cores: usize,
    pub memory_bytes: u64,
    pub gpus: Vec<GpuInfo>,
    pub driver: Option<String>,
    /// CUDA version libtorch was built with.
    pub cuda: Option<String>,
    /// CUDA version the driver supports.
    pub cuda_driver_api: Option<String>,
    pub libtorch: Option<String>,
    pub nccl: Option<String>,
    pub harness_version: String,
    pub git_revision: String,
}
