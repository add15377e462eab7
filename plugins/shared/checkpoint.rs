//! Shared by the checkpoint-policy plugins (each includes this file with
//! `#[path = "../../shared/checkpoint.rs"] mod checkpoint;`; it is not a
//! crate): keep-last-K retention and the reading of its `keep` key.
#![allow(dead_code)]

use harness_sdk::{Config, Error};

/// Reads `keep` (checkpoints kept on disk; 0 keeps all; default 0).
pub fn keep_from_config(config: &Config) -> Result<usize, Error> {
    config.get_or("keep", 0usize)
}

/// The checkpoints to delete when the checkpoint of `step` is about to be
/// saved, so that at most `keep` remain once it is (`keep` = 0 keeps all).
///
/// `saved` is the host's list, oldest first; the oldest go first. Only steps
/// in `saved` are returned, each once, and never `step` itself (a checkpoint
/// of the current step already on disk is overwritten, not added).
///
/// `persisting` (a checkpoint on its way to disk) counts as on disk, but is
/// never returned: it cannot be deleted before it is durable.
pub fn retain(saved: &[u64], persisting: Option<u64>, keep: usize, step: u64) -> Vec<u64> {
    if keep == 0 {
        return Vec::new();
    }
    let mut others: Vec<u64> = Vec::with_capacity(saved.len() + 1);
    for s in saved.iter().copied().chain(persisting) {
        if s != step && !others.contains(&s) {
            others.push(s);
        }
    }
    // After the save: `others` plus the new one.
    let excess = (others.len() + 1).saturating_sub(keep);
    others.truncate(excess);
    others.retain(|s| saved.contains(s));
    others
}
