//! `harness-sdk`: the guest SDK for harness strategy plugins.
//!
//! The stable plugin contract (WIT package `harness:strategy`, a C header for
//! native plugins, traits and an `export!` macro) is built on top of the
//! host's strategy traits in `harness::strategy`. This crate currently only
//! carries the contract's version; the contract itself is the next milestone.
#![deny(missing_docs)]

/// Version of the plugin contract this SDK speaks (semver).
pub const CONTRACT_VERSION: &str = "0.0.0";
