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
