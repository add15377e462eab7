//! Exit codes of the `harness` binary (README.md, "Exit codes").

/// Everything ran and every entry succeeded.
pub const OK: i32 = 0;
/// The run finished, but at least one entry failed (see the result file).
pub const ENTRY_FAILED: i32 = 1;
/// `harness verify` / `harness submit`: a bundle breaks a rule of the
/// standard suites (each violation is printed with what to do).
pub const NOT_VERIFIED: i32 = 1;
/// `harness reproduce`: a bundle does not verify, or its rerun differs from
/// its claim beyond the tolerance (each difference is printed).
pub const NOT_REPRODUCED: i32 = 1;
/// `harness plugin bench`: at least one artifact could not be timed (it
/// failed to load, or failed or panicked in a call); the others were, and
/// the table shows every one.
pub const ARTIFACT_FAILED: i32 = 1;
/// `harness plugin test`: at least one check failed (or the artifact could
/// not be loaded, or refused the configuration given); the FAILED lines
/// under the table say what was seen.
pub const PLUGIN_TEST_FAILED: i32 = 1;
/// The suite file is invalid (`harness validate` says why).
pub const INVALID_SUITE: i32 = 2;
/// The command line asks for what harness does not do: clap's own usage
/// errors, and combinations it cannot check (`harness plugin new` of a
/// kind the language's template does not make).
pub const USAGE: i32 = 2;
/// A `HARNESS_*` environment switch has a value it does not take
/// (`switches`); nothing ran.
pub const INVALID_SWITCH: i32 = 2;
/// Harness itself could not run (I/O, device set-up, resume mismatch).
/// Command-line usage errors exit with 2, from the argument parser.
pub const ERROR: i32 = 3;
/// A rank process of a multi-GPU run stopped because a rank was lost (it
/// died, hung or failed inside a collective): its NCCL communicator cannot
/// be used again, so the launcher starts the ranks anew for the entries left.
pub const RANK_LOST: i32 = 5;
/// A native plugin ended the process (`exit`, `_exit`, `exit_group`, a
/// thread of its own) during a run; the result file is incomplete
/// (`plugin::exit_guard`, and `harness run`'s supervising parent).
pub const PLUGIN_ENDED_PROCESS: i32 = 4;
/// The run finished and wrote its whole result file (it returned 0 or 1
/// itself), but its process then ended otherwise, by a signal or another
/// status: a native plugin's thread or exit handler, or a crash while the
/// process tore down (`harness run`'s supervising parent, and its launcher
/// of ranks). The result file stands; the process that made it did not
/// end cleanly, so the run does not count as a success.
pub const ENDED_AFTER_RUN: i32 = 6;

/// The exit code of a run that finished with `failed_entries` failed
/// entries: every kind of entry failure (`error::EntryError`, recorded as
/// the entry's `kind` in the result file) is [`ENTRY_FAILED`]; none is
/// [`OK`].
pub fn of_finished_run(failed_entries: usize) -> i32 {
    if failed_entries > 0 {
        ENTRY_FAILED
    } else {
        OK
    }
}
