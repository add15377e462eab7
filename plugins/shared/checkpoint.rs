//! Shared by the checkpoint-policy plugins (each includes this file with
//! `#[path = "../../shared/checkpoint.rs"] mod checkpoint;`; it is not a
//! crate): keep-last-K retention and the reading of its `keep` key.
#![allow(dead_code)]

use harness_sdk::{Config, Error};

/// Reads `keep` (checkpoints kept on disk; 0 keeps all; default 0).
pub fn keep_from_config(config: &Config) -> Result<usize, Error> {
    config.get_or("keep", 0usize)
}

/// The checkpoints to delete so that at most `keep` stay on disk (`keep` =
/// 0 keeps all): the oldest of `saved` (the host's list of durable ones,
/// oldest first) beyond the newest `keep`, each once.
///
/// Asked after every step, not only when saving: a checkpoint counts once
/// it is durable, never before. A snapshot taken now, or one being
/// persisted in the background, may never reach disk (a newer one can take
/// its turn, a failure can cut its write), so deleting older ones for it
/// first could leave fewer than `keep` to restore from.
pub fn retain(saved: &[u64], keep: usize) -> Vec<u64> {
    if keep == 0 {
        return Vec::new();
    }
    let mut unique: Vec<u64> = Vec::with_capacity(saved.len());
    for &s in saved {
        if !unique.contains(&s) {
            unique.push(s);
        }
    }
    let excess = unique.len().saturating_sub(keep);
    unique.truncate(excess);
    unique
}
