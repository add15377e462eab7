//! What every fused layer shares: which code computes their maths
//! ([`Engine`]), the normalisations' epsilons, and the alignment the
//! kernels need.

use tch::Tensor;

use harness_kernels::kernels;

/// LayerNorm's epsilon (as `nn.LayerNorm`).
pub const EPS: f64 = 1e-5;

/// RMS normalisation's epsilon (T5's layer norm).
pub const RMS_EPS: f64 = 1e-6;

/// Whether `HARNESS_FUSED_REFERENCE=1` asks for the libtorch reference on
/// CUDA too (a diagnostic: it tells a kernel's error from the fused layers'
/// own maths, e.g. the bias added in fp32).
pub(super) fn reference_forced() -> bool {
    harness_format::switches::get().fused_reference
}

/// Which code computes the fused layers' maths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Engine {
    /// The CUDA kernels of [`kernels`].
    Cuda,
    /// libtorch operations (any device), the reference.
    Reference,
}

/// The engine of the fused layers on CUDA.
pub(super) fn engine() -> Engine {
    if kernels::available() && !reference_forced() {
        Engine::Cuda
    } else {
        Engine::Reference
    }
}

/// Whether the tensors start 16-byte aligned, as the embedding kernels'
/// vector loads and adds and cuBLASLt's matmuls need (a parameter or
/// gradient inside a ZeRO flat buffer may start anywhere: then libtorch's
/// operations run instead, or a copy).
pub(super) fn aligned(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| (t.data_ptr() as usize) % 16 == 0)
}
