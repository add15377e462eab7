//! `harness-runtime`: what a rank runs on, below the strategies and the
//! training loop: [`device`] (GPUs, driver, CUDA, libtorch and NCCL, the
//! machine fingerprint), [`measure`] (clocks, phase timers with CUDA events,
//! HDR histograms) and [`comm`] (collectives: NCCL, in-process thread
//! ranks, link emulation, and their accounting).

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod comm;
pub mod device;
pub mod measure;
