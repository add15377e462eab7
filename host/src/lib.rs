//! `harness`: a benchmark harness that scores distributed-training strategies.
//!
//! This crate is the binary's: the command line ([`cli`], one function per
//! subcommand), running a plan ([`launch`]: entries in order, rank
//! processes, results after each), the rank environment and the watchdog
//! ([`ranks`]), the TCP store ranks meet through ([`rendezvous`]), what a
//! run shows on the terminal ([`console`]), what Ctrl-C says and leaves
//! ([`interrupt`]), the benchmarks ([`mod@bench`]),
//! `harness plugin new` ([`scaffold`]), `harness reproduce` ([`reproduce`]), the parent that supervises a run
//! loading a native plugin ([`supervise`]) and the machine fingerprint of this
//! build ([`device`]). Everything else comes from the workspace's crates,
//! which this crate's modules name by their own paths (`harness_format::suite`,
//! never a local alias); they are re-exported here for the tests and other
//! users of the library, bottom to top:
//!
//! - `harness-format`: [`suite`], [`results`], [`switches`], [`error`],
//!   [`exit`], [`fmt`] (no libtorch, no wasmtime);
//! - `harness-report`: [`report`] and [`submission`] (on the formats alone);
//! - `harness-kernels`: [`torch_ext`] (the libtorch calls `tch` lacks),
//!   [`blaslt`] (cuBLASLt) and [`kernels`] (harness's CUDA kernels);
//! - `harness-runtime`: [`device`]'s GPUs and driver, [`measure`] (timers,
//!   histograms) and [`comm`] (collectives);
//! - `harness-sandbox`: [`strategy`] (the strategy traits and baselines) and
//!   [`plugin`] (WebAssembly components and native libraries behind them);
//! - `harness-train`: [`train`], the training core.

pub use harness_format::{error, exit, fmt, results, suite, switches};
pub use harness_report::{self as report, submission};

pub mod bench;
pub mod cli;
pub mod console;
pub mod device;
pub mod interrupt;
pub mod launch;
pub mod ranks;
pub mod rendezvous;
pub mod reproduce;
pub mod scaffold;
pub mod supervise;

pub use harness_kernels::{blaslt, kernels, torch_ext};

/// The kernels' options from the switches: what the binary passes to
/// `harness-kernels` (which reads no environment) at start-up, before any
/// kernel runs (`harness_kernels::configure`).
pub fn kernel_options(s: &harness_format::switches::Switches) -> harness_kernels::Options {
    harness_kernels::Options { lt_matmuls: s.lt_matmuls, pdl: s.pdl, ln_warp: s.ln_warp, ln_bwd_warp: s.ln_bwd_warp }
}
pub use harness_runtime::{comm, measure};
pub use harness_sandbox::{plugin, strategy};
pub use harness_train as train;

#[cfg(test)]
mod tests {
    use harness_format::switches::Switches;

    #[test]
    fn each_kernel_switch_reaches_its_own_option() {
        assert_eq!(super::kernel_options(&Switches::DEFAULT), harness_kernels::Options::DEFAULT);
        let off = |var: &str| {
            let s = Switches::from_vars(|k| (k == var).then(|| "0".to_owned())).unwrap();
            super::kernel_options(&s)
        };
        let all = harness_kernels::Options::DEFAULT;
        assert_eq!(off("HARNESS_LT_MATMULS"), harness_kernels::Options { lt_matmuls: false, ..all });
        assert_eq!(off("HARNESS_PDL"), harness_kernels::Options { pdl: false, ..all });
        assert_eq!(off("HARNESS_LN_WARP"), harness_kernels::Options { ln_warp: false, ..all });
        assert_eq!(off("HARNESS_LN_BWD_WARP"), harness_kernels::Options { ln_bwd_warp: false, ..all });
    }
}
