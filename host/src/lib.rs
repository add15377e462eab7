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
//! [`oom`] (out-of-memory messages). Below them all, re-exported from the
//! `harness-kernels` crate: [`torch_ext`] (the libtorch calls that `tch`
//! lacks), [`blaslt`] (cuBLASLt matmuls and epilogues) and [`kernels`]
//! (harness's own CUDA kernels). [`switches`] holds the `HARNESS_*`
//! environment switches, parsed once.

pub use harness_format::{error, exit, fmt, results, suite, switches};
pub use harness_report::{self as report, submission};

pub mod bench;
pub mod cli;
pub mod console;
pub mod device;
pub mod launch;
pub mod ranks;
pub mod rendezvous;
pub mod scaffold;

pub use harness_kernels::{blaslt, kernels, torch_ext};
pub use harness_runtime::{comm, measure};
pub use harness_sandbox::{plugin, strategy};
pub use harness_train as train;
