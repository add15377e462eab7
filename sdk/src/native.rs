//! Native-only extras (not available to WASM plugins): raw device pointers
//! and the host's CUDA stream, for plugins that launch their own kernels.
//!
//! Native plugins are trusted code: they run unsandboxed in the host
//! process, and results label them "native (unsandboxed)". A plugin that
//! uses this module does not build for wasm32.

use std::cell::Cell;
use std::ffi::c_void;

use crate::abi::Op;
use crate::native_backend::{self as backend, CURRENT_HOST};
use crate::Tensor;

/// The tensor's data: device memory on GPU, host memory on CPU. Valid while
/// the tensor lives and the host does not reallocate it (for the bucket:
/// during the call). Order work on [`cuda_stream`].
pub fn data_ptr(t: &Tensor) -> *mut c_void {
    let raw = t.raw();
    backend::call(raw.host, Op::DataPtr, &[raw.handle], &[], &[], &[]).ptr
}

/// The CUDA stream the host orders its work on (null: the legacy default
/// stream, or CPU). Call it from inside a plugin callback.
pub fn cuda_stream() -> *mut c_void {
    let host = CURRENT_HOST.with(Cell::get);
    assert!(!host.is_null(), "harness_sdk::native::cuda_stream called outside a plugin callback");
    backend::call(host, Op::CudaStream, &[], &[], &[], &[]).ptr
}
