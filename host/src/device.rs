//! The device layer of `harness-runtime` (GPUs, driver, CUDA, libtorch,
//! NCCL), with the machine fingerprint of this build of harness.

pub use harness_runtime::device::*;

/// Reads the machine fingerprint of this build of harness (its version and
/// git revision), initialising CUDA if present.
pub fn fingerprint() -> Fingerprint {
    harness_runtime::device::fingerprint(env!("CARGO_PKG_VERSION"), env!("HARNESS_GIT_REVISION"))
}
