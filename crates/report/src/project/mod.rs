//! `harness project`: a calibrated analytic model of a data-parallel
//! strategy on clusters larger than the machines the runs came from, always
//! labelled as a projection (docs/projection.md).
//!
//! [`calibrate`] reads what the model stands on from result files and
//! `harness bench allreduce` records; [`cluster`] parses a cluster and times
//! one collective on it; [`model`] puts a step together; [`projection`]
//! projects every workload's strategies on clusters; [`check()`] predicts the
//! measured multi-GPU entries from data that excluded them; [`render`]
//! prints both; [`suite`] projects a suite's `[projection]` in the report.

pub mod calibrate;
pub mod check;
pub mod cluster;
pub mod model;
pub mod projection;
pub mod render;
pub mod suite;
#[cfg(test)]
mod tests;

pub use calibrate::{Bench, Source};
pub use check::{check, Check, CheckRow};
pub use cluster::Cluster;
pub use projection::{project, Projection};
