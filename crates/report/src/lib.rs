//! Reports: the summary table printed at the end of `harness run`, and the
//! scores across result files: the leaderboard (`harness report`, Markdown and
//! a self-contained HTML page with SVG plots) and `harness compare`.
//!
//! Entries are grouped by (run, suite, workload, strategy, device, track);
//! the repeats of a group are summarised with [`stats`], every metric is
//! compared with the group of the baseline strategy of the same run,
//! paired by repeat, and rows are ranked against their own run's only.
//!
//! [`submission`] makes and checks submission bundles (`harness submit`,
//! `harness verify`); [`inputs`] reads what `harness report` is given
//! (result files, and bundles: verified, one per content); [`submissions`]
//! ranks the verified bundles; [`output`] writes the board. Every string
//! read from a result file or bundle is written through [`escape`].
//!
//! This crate stands on the file formats alone (`harness-format`): no
//! libtorch, no plugin runtime. What needs one (reading a plugin artifact's
//! manifest) is passed in by the caller.
//!
//! The summary table is in `summary.rs`; the groups, rows and boards of
//! the leaderboard in `board.rs`; the leaderboard as Markdown and
//! `harness compare`'s table in `tables.rs`.

mod board;
pub mod escape;
pub mod html;
pub mod inputs;
pub mod metric;
pub mod output;
pub mod project;
pub mod reproduction;
pub mod stats;
pub mod submission;
pub mod submissions;
mod summary;
mod tables;
#[cfg(test)]
mod test_support;

pub use board::{board_has_accuracy, board_nccl, boards, groups, row_flags, run_label, suite_version, Board, Group, Row};
pub use metric::{bytes, Better, Metric, PerMetric};
pub use summary::{nccl_by_strategy, nccl_line, plugin_call_us, resilience_line, summary_table};
pub use tables::{compare_table, fmt_verdict, leaderboard_markdown, suite_heading};

#[cfg(test)]
mod tests;
