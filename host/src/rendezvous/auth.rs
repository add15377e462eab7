//! The run's secret ([`Secret`]) and what a rank proves with it
//! ([`Auth`]): the MACs of the handshake, the run's namespace.

use std::sync::Arc;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use super::{RendezvousError, MIN_SECRET_CHARS, NONCE_BYTES, SECRET_VAR};

/// A run's rendezvous secret. Its `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Arc<str>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// A fresh secret: 32 random bytes from the operating system's
    /// generator (through `rand`'s thread generator), as 64 hex digits.
    pub fn generate() -> Secret {
        let mut b = [0u8; 32];
        rand::rng().fill_bytes(&mut b);
        Secret(hex::encode(b).into())
    }

    /// `text` as a secret: at least [`MIN_SECRET_CHARS`] characters.
    pub fn new(text: &str) -> Result<Secret, RendezvousError> {
        let n = text.chars().count();
        if n < MIN_SECRET_CHARS {
            return Err(RendezvousError::Config(format!(
                "{SECRET_VAR} has {n} characters; a rendezvous secret needs at least {MIN_SECRET_CHARS}\nhint: make one with `openssl rand -hex 32` and export it on every host"
            )));
        }
        Ok(Secret(text.into()))
    }

    /// The secret in [`SECRET_VAR`], if it is set.
    pub fn from_env() -> Result<Option<Secret>, RendezvousError> {
        match std::env::var(SECRET_VAR) {
            Ok(v) => Secret::new(&v).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(RendezvousError::Config(format!("{SECRET_VAR} is not valid UTF-8"))),
        }
    }

    /// The secret's text, for the environment of the ranks that share it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// What a rank proves and namespaces its keys with: the run's secret and
/// the run id derived from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Auth {
    pub(super) secret: Secret,
    run: String,
}

impl Auth {
    /// The ranks of one run: `job` is what the launcher names the job by
    /// (torchrun's run id, Slurm's job and step; empty for `harness run`'s
    /// own ranks, whose secret is fresh each time), so that two jobs that
    /// reuse one secret still get two namespaces.
    pub fn new(secret: Secret, job: &str) -> Auth {
        let tag = mac(secret.expose().as_bytes(), &[b"harness-rdzv run id", job.as_bytes()]);
        Auth { run: hex::encode(&tag[..8]), secret }
    }

    /// The run id: 16 hex digits, every key's namespace.
    pub fn run(&self) -> &str {
        &self.run
    }

    pub(super) fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        mac(self.secret.expose().as_bytes(), parts)
    }

    /// Whether `tag_hex` is the MAC of `parts`, compared in constant time.
    pub(super) fn verify(&self, parts: &[&[u8]], tag_hex: &str) -> bool {
        let Ok(tag) = hex::decode(tag_hex) else { return false };
        hmac_of(self.secret.expose().as_bytes(), parts).verify_slice(&tag).is_ok()
    }
}

fn hmac_of(key: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        // Each part with its length, so that no two lists of parts run together.
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m
}

fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    hmac_of(key, parts).finalize().into_bytes().into()
}

pub(super) fn nonce() -> String {
    let mut b = [0u8; NONCE_BYTES];
    rand::rng().fill_bytes(&mut b);
    hex::encode(b)
}

pub(super) fn is_nonce(s: &str) -> bool {
    s.len() == 2 * NONCE_BYTES && s.bytes().all(|b| b.is_ascii_hexdigit())
}
