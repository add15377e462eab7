//! Rendezvous: a small TCP key-value store that rank 0 serves at
//! MASTER_ADDR:MASTER_PORT, for what ranks must agree on before NCCL exists
//! (the NCCL unique id, the entries to run) and for gathering figures.
//!
//! Only the ranks of one run may use it, and nothing a peer sends can
//! exhaust it (docs/cluster.md, "The rendezvous"):
//!
//! - **Where**: rank 0 listens on the addresses MASTER_ADDR resolves to
//!   ([`bind_addrs`]), never on every interface; `harness run`'s own ranks
//!   meet on 127.0.0.1.
//! - **Authentication**, both ways, before any request: the run's secret
//!   ([`Secret`]: made by `harness run` for the ranks it starts, read from
//!   [`SECRET_VAR`] under torchrun or srun) never crosses the wire. The
//!   server greets with `HARNESS-RDZV 1 <run> <server nonce>`; the client
//!   answers `AUTH <rank> <client nonce> <mac>`, mac = HMAC-SHA256 of the
//!   secret over ("client", run, both nonces, rank), checked in constant
//!   time; the server answers `OK <mac'>` (over "server", run and both
//!   nonces: the client checks that it talks to this run's rank 0) or
//!   `DENIED <why>` and closes, or `BUSY <why>` when the authenticated
//!   connections are at their cap (the client tries again).
//! - **One request** per connection: `SET <key> <len>\n<bytes>` (a key is
//!   written once: another value for a key already set is refused) or
//!   `PUT <key> <len>\n<bytes>` (replaced: heartbeats), both answered `OK`;
//!   `GET <key> <wait_ms>` answered `VAL <len>\n<bytes>` or `TIMEOUT`; a
//!   refused request is answered `ERR <why>`. Lengths are decimal; keys are
//!   printable ASCII without spaces, every one under `<run>/`, the run's
//!   namespace ([`Auth::run`], derived from the secret and the launcher's
//!   job id), which the server enforces.
//! - **Caps** ([`Limits`]): key and value sizes (checked from the request
//!   line, before anything is allocated), the number of keys and the bytes
//!   held (values being received included), and connections in two pools,
//!   so that peers without the secret cannot crowd out the ranks: those
//!   not yet authenticated ([`Limits::max_pending`]; when it is full, a new
//!   connection pushes out the oldest, which an honest rank, answering its
//!   greeting within a round trip, never is for long) and authenticated
//!   ones ([`Limits::max_connections`], sized by the world; one more is
//!   answered `BUSY` instead of `OK`). The threads alive stay within the two
//!   caps: the accepting thread waits for a pushed-out one to end. Until
//!   their timeout, clients try again soon after a closed handshake, and
//!   after a growing pause after `BUSY` or an unreachable store.
//! - **Timeouts**: a connection must authenticate within
//!   [`Limits::handshake_timeout`] of its accept (1 s: a silent peer holds
//!   its slot no longer), then send its request, and later take the answer,
//!   within [`Limits::io_timeout`] each; a GET waits at most
//!   [`Limits::max_wait`]. Values are shared with the readers that are sent
//!   them, never copied, and no lock is held while sending.
//! - **Logs**: a refused, timed-out or pushed-out peer is named (its
//!   address) on stderr once per address and reason, and counted
//!   ([`Server::stats`]).
//!
//! The files: `auth.rs`, the secret and the handshake's MACs; `server/`,
//! rank 0's store (`conn.rs`: one connection's handshake and request);
//! `client.rs`, a rank's requests.

mod auth;
mod client;
mod server;

pub use auth::{Auth, Secret};
pub use client::Client;
pub use server::{serve, Server, Stats};

use std::io::{self, BufRead, Read};
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

/// The environment variable that carries a run's rendezvous secret to its
/// ranks: set by `harness run` for the ranks it starts, exported by the
/// user on every host under torchrun or srun.
pub const SECRET_VAR: &str = "HARNESS_RDZV_SECRET";
/// The shortest secret accepted, in characters.
pub const MIN_SECRET_CHARS: usize = 16;
/// The longest key, namespace included, in bytes (the default cap).
pub const MAX_KEY_BYTES: usize = 1024;
/// The largest value, in bytes (the default cap; clients refuse larger ones
/// before sending, and never read a larger one).
pub const MAX_VALUE_BYTES: usize = 16 << 20;

const GREETING: &str = "HARNESS-RDZV";
/// 2: `BUSY` may answer `AUTH` (the authenticated connections' cap).
const VERSION: &str = "2";
const NONCE_BYTES: usize = 32;
/// The longest handshake or answer line either side reads.
const MAX_LINE: usize = 512;
/// What a stored key costs beyond its bytes, in the store's accounting.
const ENTRY_OVERHEAD: usize = 64;
/// A connection's thread: it holds a request line and small buffers.
const THREAD_STACK: usize = 256 << 10;
/// How long a client waits for the server's greeting and answer to `AUTH`.
const CLIENT_HANDSHAKE: Duration = Duration::from_secs(10);
/// How long a client waits for the answer to a request, beyond a GET's wait.
const CLIENT_IO: Duration = Duration::from_secs(60);
/// A client's pause before it tries again: after a closed handshake always
/// this one, otherwise doubled after each failed try up to
/// [`CLIENT_MAX_PAUSE`]; each drawn at random between half and all of it
/// (so that ranks that met `BUSY` together do not come back together).
const CLIENT_FIRST_PAUSE: Duration = Duration::from_millis(5);
const CLIENT_MAX_PAUSE: Duration = Duration::from_millis(200);
/// Addresses and reasons whose refusals are logged; beyond, refusals are
/// only counted.
const MAX_LOGGED: usize = 4096;

/// Rendezvous failures.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("rank {rank} could not reach the rendezvous at {addr} within {timeout_s:.0} s: {why}\nhint: is rank 0 running, and are MASTER_ADDR / MASTER_PORT the same on every rank?")]
    Unreachable { rank: usize, addr: String, timeout_s: f64, why: String },
    #[error("rank {rank} waited {timeout_s:.0} s for `{key}` at the rendezvous; the rank that publishes it never did")]
    Timeout { rank: usize, key: String, timeout_s: f64 },
    #[error("rank {rank} was refused by the rendezvous at {addr}: {why}\nhint: every rank of a run needs the same HARNESS_RDZV_SECRET (`harness run` gives the ranks it starts one; under torchrun or srun export it on every host, docs/cluster.md), and MASTER_ADDR:MASTER_PORT must be this run's rank 0")]
    Denied { rank: usize, addr: String, why: String },
    #[error("rank {rank}: the rendezvous refused `{key}`: {why}")]
    Refused { rank: usize, key: String, why: String },
    #[error("{0}")]
    Config(String),
    #[error("rendezvous I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("rendezvous protocol error: {0}")]
    Protocol(String),
}

/// What the store accepts and for how long it waits.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The longest key, namespace included, in bytes.
    pub max_key_bytes: usize,
    /// The largest value, in bytes.
    pub max_value_bytes: usize,
    /// The most keys the store holds.
    pub max_keys: usize,
    /// The most bytes the store holds, values being received included (each
    /// key counts its key, its value and 64 bytes).
    pub max_store_bytes: usize,
    /// The most authenticated connections open at once (the ranks'
    /// requests); one more is answered `BUSY` instead of `OK`. Peers without
    /// the secret never hold one.
    pub max_connections: usize,
    /// The most connections open at once that have not authenticated yet;
    /// one more pushes out the oldest of them.
    pub max_pending: usize,
    /// How long a connection has from its accept to be authenticated.
    pub handshake_timeout: Duration,
    /// How long an authenticated peer has to send its request, and later
    /// to take the answer.
    pub io_timeout: Duration,
    /// The longest a GET waits for its key.
    pub max_wait: Duration,
}

impl Limits {
    /// The caps for a run of `world` ranks: [`MAX_KEY_BYTES`],
    /// [`MAX_VALUE_BYTES`], a million keys, 256 MiB; 256 + 1 per rank
    /// connections waiting to authenticate (every rank at once, and more
    /// than peers without the secret can replace within a rank's round trip;
    /// at most an eighth of the process's file descriptors) and 64 + 4 per
    /// rank authenticated (a rank holds two or three at a time; the two
    /// pools at most half the file descriptors); 1 s to authenticate (a
    /// round trip and two HMACs take well under a millisecond on a network
    /// the ranks share, and a rank that misses it tries again); 60 s per
    /// request and answer; a GET's wait at most a day.
    pub fn for_world(world: usize) -> Limits {
        let fds = fd_limit() / 2;
        let max_pending = (256 + world).min(fds / 4).max(16);
        Limits {
            max_key_bytes: MAX_KEY_BYTES,
            max_value_bytes: MAX_VALUE_BYTES,
            max_keys: 1 << 20,
            max_store_bytes: 256 << 20,
            max_connections: (64 + 4 * world).min(fds.saturating_sub(max_pending)).max(16),
            max_pending,
            handshake_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(60),
            max_wait: Duration::from_secs(24 * 3600),
        }
    }
}

/// The process's soft limit on open files.
fn fd_limit() -> usize {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `rlimit` through a pointer to a live,
    // properly aligned local of that type.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0;
    if ok {
        usize::try_from(rl.rlim_cur).unwrap_or(usize::MAX)
    } else {
        1024
    }
}

/// The addresses rank 0 serves the rendezvous on: those `host`
/// (MASTER_ADDR) resolves to, with `port`. The unspecified address (every
/// interface) is refused, and so is a loopback-only `host` when the run
/// `spans_hosts` (the other hosts could not reach it).
pub fn bind_addrs(host: &str, port: u16, spans_hosts: bool) -> Result<Vec<SocketAddr>, RendezvousError> {
    let resolved: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| RendezvousError::Config(format!("MASTER_ADDR={host:?} does not resolve on rank 0: {e}")))?
        .collect();
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for a in resolved {
        if !addrs.contains(&a) {
            addrs.push(a);
        }
    }
    let list = addrs.iter().map(|a| a.ip().to_string()).collect::<Vec<_>>().join(", ");
    if addrs.is_empty() {
        return Err(RendezvousError::Config(format!("MASTER_ADDR={host:?} resolves to no address on rank 0")));
    }
    if addrs.iter().any(|a| a.ip().is_unspecified()) {
        return Err(RendezvousError::Config(format!(
            "MASTER_ADDR={host:?} is the unspecified address: rank 0 would serve the rendezvous on every interface\nhint: set MASTER_ADDR to rank 0's own address (127.0.0.1 when every rank runs on this host)"
        )));
    }
    if spans_hosts && addrs.iter().all(|a| a.ip().is_loopback()) {
        return Err(RendezvousError::Config(format!(
            "MASTER_ADDR={host:?} resolves to {list} on rank 0, a loopback address that the other hosts cannot reach\nhint: set MASTER_ADDR to rank 0's address on the network the hosts share (an IP address, e.g. from `hostname -I`)"
        )));
    }
    Ok(addrs)
}

/// A peer's words in a log line or an answer: at most 40 characters, quoted
/// and escaped.
fn quoted(s: &str) -> String {
    let cut: String = s.chars().take(40).collect();
    format!("{cut:?}{}", if cut.len() < s.len() { "..." } else { "" })
}

/// One line of at most `cap` bytes, without its newline; None at the end of
/// the stream. A longer line is an error, read no further than `cap + 1`
/// bytes.
fn read_line(r: &mut impl BufRead, cap: usize) -> io::Result<Option<String>> {
    let mut buf = Vec::new();
    r.by_ref().take(cap as u64 + 1).read_until(b'\n', &mut buf)?;
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > cap {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a line over {cap} bytes")));
    } else if buf.is_empty() {
        return Ok(None);
    } else {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    String::from_utf8(buf).map(Some).map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a line that is not UTF-8"))
}

#[cfg(test)]
mod tests;
