//! Collectives over the ranks of the run, run and accounted for by the host.

use std::marker::PhantomData;

#[cfg(not(target_arch = "wasm32"))]
use crate::native_backend as backend;
#[cfg(target_arch = "wasm32")]
use crate::wasm_backend as backend;
use crate::Tensor;

/// The collectives of this rank's communicator, handed to
/// [`crate::Compressor::compress`]. The host runs them (NCCL on GPU) and
/// accounts for them: bytes on the wire, time, count.
pub struct Collective {
    raw: backend::RawComm,
    _local: PhantomData<*const ()>,
}

impl Collective {
    pub(crate) fn new(raw: backend::RawComm) -> Collective {
        Collective { raw, _local: PhantomData }
    }

    /// This rank's index.
    pub fn rank(&self) -> u32 {
        backend::rank(&self.raw)
    }
    /// Number of ranks.
    pub fn world_size(&self) -> u32 {
        backend::world_size(&self.raw)
    }
    /// Sums `t` over ranks, in place.
    pub fn all_reduce_sum(&self, t: &Tensor) {
        backend::all_reduce_sum(&self.raw, t.raw())
    }
    /// Every rank's `t` (same shape everywhere), concatenated in rank order
    /// into one 1-D tensor.
    pub fn all_gather(&self, t: &Tensor) -> Tensor {
        Tensor::owned(backend::all_gather(&self.raw, t.raw()))
    }
    /// Copies rank `root`'s `t` into every rank's `t`, in place.
    pub fn broadcast(&self, t: &Tensor, root: u32) {
        backend::broadcast(&self.raw, t.raw(), root)
    }
    /// Sums `t` over ranks and returns this rank's 1-D chunk (numel must be
    /// divisible by the world size).
    pub fn reduce_scatter_sum(&self, t: &Tensor) -> Tensor {
        Tensor::owned(backend::reduce_scatter_sum(&self.raw, t.raw()))
    }
}

impl std::fmt::Debug for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Collective")
    }
}
