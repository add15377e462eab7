//! `harness-format`: what harness reads and writes, with no libtorch and no
//! wasmtime underneath, so that the report, the verifier and any tool that
//! reads results build and test anywhere.
//!
//! - [`suite`]: the suite format (serde types, validation with
//!   `file:line:column`, the plan of entries and seeds, model presets, the
//!   released standard suites and their tracks);
//! - [`results`]: the result file (versioned, written atomically), with
//!   [`histogram`] (HDR latency histograms and their encoding),
//!   [`machine`] (the machine fingerprint), [`plugin`] (what a plugin is
//!   and did) and [`link`] (the emulated network);
//! - [`switches`]: the `HARNESS_*` environment switches, typed and read
//!   once (those that change the measured work are recorded in results);
//! - the leaves [`error`] (why an entry failed), [`exit`] (exit codes),
//!   [`files`] (reading files that untrusted input names: regular files
//!   only, up to a cap), [`outfile`] (opening the files harness writes
//!   without following a symbolic link), [`fmt`] (short forms of numbers,
//!   text made safe for a terminal) and [`secrets`]
//!   (the user's keys, kept outside the folders they seal).

pub mod bench;
pub mod error;
pub mod exit;
pub mod files;
pub mod fmt;
pub mod histogram;
pub mod link;
pub mod machine;
pub mod outfile;
pub mod plugin;
pub mod results;
#[cfg(unix)]
pub mod secrets;
pub mod suite;
pub mod switches;
