//! `harness-kernels`: the lowest layer of harness, where it talks to libtorch
//! and CUDA below what `tch` offers.
//!
//! [`torch_ext`] wraps the libtorch calls that `tch` lacks (through
//! `csrc/shim.cpp`, which this crate's build script compiles and links
//! against torch-sys's libtorch); [`blaslt`] runs matmuls with their
//! activation in cuBLASLt's epilogues; [`kernels`] holds harness's own CUDA
//! kernels (`cuda/`, compiled at run time with NVRTC) and their launches.
//! The `harness` crate re-exports the three modules under the same names.
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod blaslt;
pub mod kernels;
pub mod torch_ext;

use std::sync::OnceLock;

/// The kernels' options. Each is one of the binary's `HARNESS_*` switches,
/// which the binary passes in once at start-up ([`configure`]), before the
/// first kernel or matmul: this crate reads no environment. Where nothing
/// configured them (a library user, a unit test) every option is on, the
/// switches' defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// `HARNESS_LT_MATMULS`: the linear layers' matmuls through cuBLASLt.
    pub lt_matmuls: bool,
    /// `HARNESS_PDL`: programmatic dependent launches on sm_90 and later.
    pub pdl: bool,
    /// `HARNESS_LN_WARP`: a warp per row in the LayerNorm forward.
    pub ln_warp: bool,
    /// `HARNESS_LN_BWD_WARP`: a warp per row in the LayerNorm backward.
    pub ln_bwd_warp: bool,
}

impl Options {
    /// Every option on.
    pub const DEFAULT: Options = Options { lt_matmuls: true, pdl: true, ln_warp: true, ln_bwd_warp: true };
}

static OPTIONS: OnceLock<Options> = OnceLock::new();

/// Sets the options for the process; an error (with the options in force)
/// once they were set or read already.
pub fn configure(options: Options) -> Result<(), Options> {
    OPTIONS.set(options).map_err(|_| self::options())
}

/// The options in force.
pub fn options() -> Options {
    *OPTIONS.get_or_init(|| Options::DEFAULT)
}
