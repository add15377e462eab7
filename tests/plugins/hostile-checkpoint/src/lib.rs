//! A checkpoint policy that breaks the contract, for the host's sandbox
//! tests: it saves every step and, once two checkpoints exist, asks to
//! delete the oldest one twice in the same decision (`mode = "twice"`, the
//! default), or once and then again in the next decision (`mode = "again"`).

use harness_sdk::{CheckpointHistory, CheckpointPolicy, Config, Decision, Error, Plugin, Telemetry};

/// See the crate docs.
pub struct DeleteTwice {
    again: bool,
    /// The step deleted in an earlier decision (`again`).
    deleted: Option<u64>,
}

impl Plugin for DeleteTwice {
    const NAME: &'static str = "delete-twice";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["mode"])?;
        let again = match config.get_or("mode", "twice".to_owned())?.as_str() {
            "twice" => false,
            "again" => true,
            other => return Err(Error::new(format!("unknown mode `{other}` (modes: twice, again)"))),
        };
        Ok(DeleteTwice { again, deleted: None })
    }
}

impl CheckpointPolicy for DeleteTwice {
    fn decide(&mut self, _t: &Telemetry, h: &CheckpointHistory) -> Result<Decision, Error> {
        let delete = match (self.deleted, h.saved.first()) {
            (Some(s), _) => vec![s],
            (None, Some(&s)) if h.saved.len() >= 2 && self.again => {
                self.deleted = Some(s);
                vec![s]
            }
            (None, Some(&s)) if h.saved.len() >= 2 => vec![s, s],
            _ => Vec::new(),
        };
        Ok(Decision { save: true, persist: true, delete })
    }
}

harness_sdk::export!(DeleteTwice as checkpoint_policy);
