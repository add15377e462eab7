//! `harness`: a benchmark harness that scores distributed-training strategies.
//!
//! The modules follow the data: [`cli`] -> [`suite`] (parse, validate,
//! expand to a plan) -> [`launch`] (run entries, keep results) -> [`device`] /
//! [`comm`] -> [`train`] (model, data, optimizer, step loop) with
//! [`strategy`] (the decisions strategies make) -> [`measure`] (HDR
//! histograms, timers) -> [`results`] (schema, atomic writes) -> [`report`].
//! Beside that line: [`ranks`] (rank environment, rank processes, rendezvous
//! and NCCL set-up, watchdog), [`console`] (what a run shows on the terminal)
//! and the leaves [`exit`] (exit codes), [`fmt`] (short forms of numbers) and
//! [`oom`] (out-of-memory messages). [`torch_ext`] wraps the libtorch calls
//! that `tch` lacks. [`switches`] holds the `HARNESS_*` environment
//! switches, parsed once.

pub mod bench;
pub mod blaslt;
pub mod cli;
pub mod comm;
pub mod console;
pub mod device;
pub mod error;
pub mod exit;
pub mod fmt;
pub mod kernels;
pub mod launch;
pub mod measure;
pub mod plugin;
pub mod ranks;
pub mod rendezvous;
pub mod report;
pub mod results;
pub mod strategy;
pub mod submission;
pub mod suite;
pub mod switches;
pub mod torch_ext;
pub mod train;
