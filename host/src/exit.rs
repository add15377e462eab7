//! Exit codes of the `harness` binary (README.md, "Exit codes").

/// Everything ran and every entry succeeded.
pub const OK: i32 = 0;
/// The run finished, but at least one entry failed (see the result file).
pub const ENTRY_FAILED: i32 = 1;
/// The suite file is invalid (`harness validate` says why).
pub const INVALID_SUITE: i32 = 2;
/// Harness itself could not run (I/O, device set-up, resume mismatch).
/// Command-line usage errors exit with 2, from the argument parser.
pub const ERROR: i32 = 3;
