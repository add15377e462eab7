//! A checkpoint policy that breaks the contract, for the host's sandbox
//! tests: it saves every step and, once two checkpoints exist, asks to
//! delete the oldest one twice in the same decision.

use harness_sdk::{CheckpointHistory, CheckpointPolicy, Config, Decision, Error, Plugin, Telemetry};

/// See the crate docs.
pub struct DeleteTwice;

impl Plugin for DeleteTwice {
    const NAME: &'static str = "delete-twice";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&[])?;
        Ok(DeleteTwice)
    }
}

impl CheckpointPolicy for DeleteTwice {
    fn decide(&mut self, _t: &Telemetry, h: &CheckpointHistory) -> Result<Decision, Error> {
        let delete = match h.saved.first() {
            Some(&s) if h.saved.len() >= 2 => vec![s, s],
            _ => Vec::new(),
        };
        Ok(Decision { save: true, persist: true, delete })
    }
}

harness_sdk::export!(DeleteTwice as checkpoint_policy);
