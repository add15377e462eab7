//! Host tensors: handles to data that stays where it lives (CPU or GPU).
//!
//! Every op runs on the host, on the tensor's device, and returns a new
//! tensor unless its name says `assign` (in place). Only
//! [`Tensor::read_f32`] copies data into the plugin, and the host meters it.
//!
//! Invalid arguments (mismatched shapes, an index out of range, an
//! unsupported dtype) fail the call: a WASM plugin traps, a native plugin
//! panics with `host op <name> failed: <why>`; either way the host fails the
//! entry with that message. Ops do not return `Result`.

use std::fmt;
use std::marker::PhantomData;

#[cfg(not(target_arch = "wasm32"))]
use crate::native_backend as backend;
pub use crate::types::{Device, Dtype};
#[cfg(target_arch = "wasm32")]
use crate::wasm_backend as backend;

/// A tensor owned by the host.
///
/// A `Tensor` that an op returned is owned by the plugin: dropping it
/// releases the host's memory. The gradient bucket handed to
/// [`crate::Compressor::compress`] is borrowed: it lives for the call, and
/// the plugin leaves its result in it with [`Tensor::assign`] or in-place
/// collectives. Keep tensors across calls (residuals, factors) by owning
/// them, e.g. through [`Tensor::duplicate`].
///
/// Tensors are tied to the plugin instance's thread (neither `Send` nor
/// `Sync`).
pub struct Tensor {
    raw: backend::Raw,
    owned: bool,
    _local: PhantomData<*const ()>,
}

impl Tensor {
    pub(crate) fn owned(raw: backend::Raw) -> Tensor {
        Tensor { raw, owned: true, _local: PhantomData }
    }

    pub(crate) fn borrowed(raw: backend::Raw) -> Tensor {
        Tensor { raw, owned: false, _local: PhantomData }
    }

    pub(crate) fn raw(&self) -> &backend::Raw {
        &self.raw
    }

    /// False for a tensor the host lent to this call (the bucket).
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    /// Dimensions.
    pub fn shape(&self) -> Vec<u64> {
        backend::shape(&self.raw)
    }
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        backend::numel(&self.raw)
    }
    /// Element type.
    pub fn dtype(&self) -> Dtype {
        backend::dtype(&self.raw)
    }
    /// Where it lives.
    pub fn device(&self) -> Device {
        backend::device(&self.raw)
    }

    /// Copies `src` (same shape; any dtype, cast on the way) into this
    /// tensor, in place. This is how a compressor leaves its result in the
    /// bucket.
    pub fn assign(&self, src: &Tensor) {
        backend::assign(&self.raw, &src.raw)
    }
    /// A copy (owned).
    pub fn duplicate(&self) -> Tensor {
        Tensor::owned(backend::duplicate(&self.raw))
    }

    /// Element-wise `self + other` (shapes must match or broadcast).
    pub fn add(&self, other: &Tensor) -> Tensor {
        Tensor::owned(backend::add(&self.raw, &other.raw))
    }
    /// Element-wise `self - other`.
    pub fn sub(&self, other: &Tensor) -> Tensor {
        Tensor::owned(backend::sub(&self.raw, &other.raw))
    }
    /// Element-wise `self * other`.
    pub fn mul(&self, other: &Tensor) -> Tensor {
        Tensor::owned(backend::mul(&self.raw, &other.raw))
    }
    /// Element-wise `self / other`.
    pub fn div(&self, other: &Tensor) -> Tensor {
        Tensor::owned(backend::div(&self.raw, &other.raw))
    }
    /// `self + s`.
    pub fn add_scalar(&self, s: f64) -> Tensor {
        Tensor::owned(backend::add_scalar(&self.raw, s))
    }
    /// `self * s`.
    pub fn mul_scalar(&self, s: f64) -> Tensor {
        Tensor::owned(backend::mul_scalar(&self.raw, s))
    }
    /// Absolute values.
    pub fn abs(&self) -> Tensor {
        Tensor::owned(backend::abs(&self.raw))
    }
    /// -1, 0 or 1 per element.
    pub fn sign(&self) -> Tensor {
        Tensor::owned(backend::sign(&self.raw))
    }
    /// Rounded down.
    pub fn floor(&self) -> Tensor {
        Tensor::owned(backend::floor(&self.raw))
    }
    /// Square root.
    pub fn sqrt(&self) -> Tensor {
        Tensor::owned(backend::sqrt(&self.raw))
    }
    /// 1.0 where `self < other` element-wise, else 0.0 (dtype of self).
    pub fn less_than(&self, other: &Tensor) -> Tensor {
        Tensor::owned(backend::less_than(&self.raw, &other.raw))
    }

    /// Converted to another element type.
    pub fn cast(&self, to: Dtype) -> Tensor {
        Tensor::owned(backend::cast(&self.raw, to))
    }
    /// Same data, new shape (element count must match; -1 infers one
    /// dimension).
    pub fn reshape(&self, shape: &[i64]) -> Tensor {
        Tensor::owned(backend::reshape(&self.raw, shape))
    }
    /// Dimensions `a` and `b` swapped.
    pub fn transpose(&self, a: u32, b: u32) -> Tensor {
        Tensor::owned(backend::transpose(&self.raw, a, b))
    }
    /// `len` entries from `start` along dimension `dim`.
    pub fn narrow(&self, dim: u32, start: u64, len: u64) -> Tensor {
        Tensor::owned(backend::narrow(&self.raw, dim, start, len))
    }

    /// The `k` largest entries of the flattened tensor: (values, i64 indices
    /// into the flattened tensor).
    pub fn topk(&self, k: u64) -> (Tensor, Tensor) {
        let (values, indices) = backend::topk(&self.raw, k);
        (Tensor::owned(values), Tensor::owned(indices))
    }
    /// `self.flatten()[index]`: `index` is a 1-D i64 tensor.
    pub fn gather(&self, index: &Tensor) -> Tensor {
        Tensor::owned(backend::gather(&self.raw, &index.raw))
    }
    /// A copy of the flattened tensor with `src[i]` added at `index[i]` (1-D;
    /// repeated indices accumulate).
    pub fn scatter_add(&self, index: &Tensor, src: &Tensor) -> Tensor {
        Tensor::owned(backend::scatter_add(&self.raw, &index.raw, &src.raw))
    }

    /// Sum of all elements.
    pub fn sum(&self) -> f64 {
        backend::sum(&self.raw)
    }
    /// L2 norm of all elements.
    pub fn norm(&self) -> f64 {
        backend::norm(&self.raw)
    }
    /// Mean of absolute values.
    pub fn mean_abs(&self) -> f64 {
        backend::mean_abs(&self.raw)
    }
    /// Matrix product (2-D x 2-D).
    pub fn matmul(&self, other: &Tensor) -> Tensor {
        Tensor::owned(backend::matmul(&self.raw, &other.raw))
    }
    /// Orthonormal columns spanning this 2-D tensor's columns (the Q of a
    /// reduced QR decomposition).
    pub fn orthonormalize(&self) -> Tensor {
        Tensor::owned(backend::orthonormalize(&self.raw))
    }

    /// Signs packed 8 per byte (bit set where the element is >= 0),
    /// little-endian bit order, as a 1-D u8 tensor of ceil(numel / 8).
    pub fn pack_signs(&self) -> Tensor {
        Tensor::owned(backend::pack_signs(&self.raw))
    }

    /// Reads the elements into the plugin as f32. The host meters this
    /// (bytes and time): keep it off the hot path.
    pub fn read_f32(&self) -> Vec<f32> {
        backend::read_f32(&self.raw)
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        if self.owned {
            backend::release(&mut self.raw);
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor").field("handle", &backend::handle(&self.raw)).field("owned", &self.owned).finish()
    }
}

/// Zeros of the given shape and dtype, on the device of `like`.
pub fn zeros(shape: &[u64], dtype: Dtype, like: &Tensor) -> Tensor {
    Tensor::owned(backend::zeros(shape, dtype, &like.raw))
}
/// Uniform [0, 1) floats, reproducible from `seed`, on `like`'s device.
pub fn rand_uniform(shape: &[u64], seed: u64, like: &Tensor) -> Tensor {
    Tensor::owned(backend::rand_uniform(shape, seed, &like.raw))
}
/// Standard normal floats, reproducible from `seed`, on `like`'s device.
pub fn rand_normal(shape: &[u64], seed: u64, like: &Tensor) -> Tensor {
    Tensor::owned(backend::rand_normal(shape, seed, &like.raw))
}
/// `k` distinct indices from 0..n (i64), reproducible from `seed`, on
/// `like`'s device.
pub fn rand_indices(n: u64, k: u64, seed: u64, like: &Tensor) -> Tensor {
    Tensor::owned(backend::rand_indices(n, k, seed, &like.raw))
}
/// A tensor from plugin data (f32), on `like`'s device.
pub fn from_f32(data: &[f32], shape: &[u64], like: &Tensor) -> Tensor {
    Tensor::owned(backend::from_f32(data, shape, &like.raw))
}
/// Unpacks `numel` signs packed by [`Tensor::pack_signs`] into f32 -1.0 /
/// +1.0.
pub fn unpack_signs(packed: &Tensor, numel: u64) -> Tensor {
    Tensor::owned(backend::unpack_signs(&packed.raw, numel))
}
