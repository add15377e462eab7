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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use rand::{Rng, RngCore};
use sha2::Sha256;

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
    secret: Secret,
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

    fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        mac(self.secret.expose().as_bytes(), parts)
    }

    /// Whether `tag_hex` is the MAC of `parts`, compared in constant time.
    fn verify(&self, parts: &[&[u8]], tag_hex: &str) -> bool {
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

fn nonce() -> String {
    let mut b = [0u8; NONCE_BYTES];
    rand::rng().fill_bytes(&mut b);
    hex::encode(b)
}

fn is_nonce(s: &str) -> bool {
    s.len() == 2 * NONCE_BYTES && s.bytes().all(|b| b.is_ascii_hexdigit())
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

/// What the server counted, for logs and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Connections open now, authenticated or not.
    pub open: usize,
    /// Of those, the ones not yet authenticated.
    pub pending: usize,
    /// Connection threads alive: the open connections', and those of
    /// pushed-out connections still ending.
    pub threads: usize,
    /// Requests served.
    pub served: u64,
    /// Connections answered `BUSY` (authenticated over the cap, or no
    /// thread to serve them).
    pub busy: u64,
    /// Connections closed before authenticating: silent, too slow, or
    /// sending something else first.
    pub unauthenticated: u64,
    /// Connections pushed out before authenticating by newer ones (the
    /// pool of those waiting to authenticate was full).
    pub evicted: u64,
    /// Connections whose authentication failed (wrong secret, another run).
    pub denied: u64,
    /// Authenticated requests refused (a cap, a bad key) or cut off (too slow).
    pub refused: u64,
    /// Keys held.
    pub keys: usize,
    /// Bytes held, as [`Limits::max_store_bytes`] counts them.
    pub bytes: usize,
    /// Bytes reserved for values being received.
    pub reserved: usize,
}

/// Why a connection was refused: the counter it goes to, and the reason
/// it is logged under (once per address).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Busy,
    Unauthenticated,
    Evicted,
    Denied,
    Refused,
}

struct Refusal {
    kind: Kind,
    why: String,
}

fn refusal(kind: Kind, why: impl Into<String>) -> Refusal {
    Refusal { kind, why: why.into() }
}

/// An I/O failure of a connection, as a reason.
fn io_why(e: &io::Error, timeout: Duration) -> String {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => format!("timed out after {:.1} s", timeout.as_secs_f64()),
        _ => e.to_string(),
    }
}

/// A peer's words in a log line or an answer: at most 40 characters, quoted
/// and escaped.
fn quoted(s: &str) -> String {
    let cut: String = s.chars().take(40).collect();
    format!("{cut:?}{}", if cut.len() < s.len() { "..." } else { "" })
}

#[derive(Default)]
struct State {
    map: HashMap<String, Arc<[u8]>>,
    /// Bytes held (keys, values and [`ENTRY_OVERHEAD`] each).
    bytes: usize,
    /// Bytes reserved for values being received.
    reserved: usize,
}

#[derive(Default)]
struct Store {
    state: Mutex<State>,
    cv: Condvar,
}

impl Store {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Bytes reserved in the store for a value being received, released when
/// dropped.
struct Reservation<'a> {
    store: &'a Store,
    bytes: usize,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.store.lock().reserved -= self.bytes;
    }
}

/// A stream whose reads and writes fail once `deadline` has passed: each
/// call waits at most what is left, so a peer cannot stretch a phase by
/// trickling bytes.
struct Timed<'a> {
    s: &'a TcpStream,
    deadline: Instant,
}

impl Timed<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io::ErrorKind::TimedOut.into())
        } else {
            Ok(left)
        }
    }
}

impl Read for Timed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.s.set_read_timeout(Some(self.left()?))?;
        let mut s = self.s;
        s.read(buf)
    }
}

impl Write for Timed<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.s.set_write_timeout(Some(self.left()?))?;
        let mut s = self.s;
        s.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
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

/// The connections open, in their two pools, and the threads serving them:
/// what the accepting thread and the connections' threads share.
#[derive(Default)]
struct Conns {
    /// Connections not yet authenticated, oldest first.
    pending: BTreeMap<u64, Pending>,
    next_id: u64,
    /// Authenticated connections open.
    authenticated: usize,
    /// Connection threads alive.
    threads: usize,
}

struct Pending {
    /// Shared with the connection's thread, for the accepting thread to shut
    /// it when it pushes the connection out.
    conn: Arc<TcpStream>,
    peer: SocketAddr,
    accepted: Instant,
}

/// Whether an authenticated connection may go on to its request.
enum Admission {
    Admitted,
    /// The authenticated connections are at their cap.
    Full,
    /// A newer connection pushed it out first (the accepting thread counted it).
    PushedOut,
}

/// What the server threads share.
struct Shared {
    auth: Auth,
    limits: Limits,
    store: Store,
    conns: Mutex<Conns>,
    /// Signalled when a connection's thread ends.
    ended: Condvar,
    served: AtomicU64,
    /// Whether a failed accept was logged.
    accept_failed: AtomicBool,
    counts: Mutex<HashMap<Kind, u64>>,
    /// The addresses and reasons already logged, and whether the "no more"
    /// line was.
    logged: Mutex<(HashSet<(IpAddr, Kind)>, bool)>,
    /// What was logged (also printed to stderr).
    lines: Mutex<Vec<String>>,
}

/// A running store: its addresses, what it counted and logged. Dropping it
/// leaves the store serving until the process ends.
pub struct Server {
    addrs: Vec<SocketAddr>,
    shared: Arc<Shared>,
}

/// Serves the store on `addrs` from background threads (rank 0), for the
/// ranks that hold `auth`'s secret.
pub fn serve(addrs: &[SocketAddr], auth: &Auth, limits: Limits) -> Result<Server, RendezvousError> {
    let mut listeners = Vec::new();
    let mut failed = Vec::new();
    for a in addrs {
        match TcpListener::bind(a) {
            Ok(l) => listeners.push(l),
            // A name may resolve to addresses of other hosts too.
            Err(e) if e.kind() == io::ErrorKind::AddrNotAvailable => failed.push(format!("{a}: not an address of this host")),
            Err(e) => {
                return Err(RendezvousError::Config(format!(
                    "rank 0 cannot serve the rendezvous on {a}: {e}\nhint: MASTER_PORT must be a free port on rank 0's host"
                )))
            }
        }
    }
    if listeners.is_empty() {
        return Err(RendezvousError::Config(format!(
            "rank 0 cannot serve the rendezvous: {}\nhint: MASTER_ADDR must be an address of rank 0's host, as the other ranks reach it",
            failed.join("; ")
        )));
    }
    let shared = Arc::new(Shared {
        auth: auth.clone(),
        limits,
        store: Store::default(),
        conns: Mutex::default(),
        ended: Condvar::new(),
        served: AtomicU64::new(0),
        accept_failed: AtomicBool::new(false),
        counts: Mutex::default(),
        logged: Mutex::default(),
        lines: Mutex::default(),
    });
    let mut bound = Vec::new();
    for l in listeners {
        bound.push(l.local_addr()?);
        let shared = shared.clone();
        std::thread::Builder::new().name("harness-rendezvous".into()).spawn(move || accept_loop(&l, &shared))?;
    }
    Ok(Server { addrs: bound, shared })
}

impl Server {
    /// The addresses it listens on (with the ports bound, for port 0).
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// What it counted so far.
    pub fn stats(&self) -> Stats {
        let s = &self.shared;
        let count = |k| s.counts.lock().unwrap_or_else(|e| e.into_inner()).get(&k).copied().unwrap_or(0);
        let (pending, authenticated, threads) = {
            let c = s.lock_conns();
            (c.pending.len(), c.authenticated, c.threads)
        };
        let st = s.store.lock();
        Stats {
            open: pending + authenticated,
            pending,
            threads,
            served: s.served.load(SeqCst),
            busy: count(Kind::Busy),
            unauthenticated: count(Kind::Unauthenticated),
            evicted: count(Kind::Evicted),
            denied: count(Kind::Denied),
            refused: count(Kind::Refused),
            keys: st.map.len(),
            bytes: st.bytes,
            reserved: st.reserved,
        }
    }

    /// The lines it logged so far.
    pub fn logged(&self) -> Vec<String> {
        self.shared.lines.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A connection's thread, counted until it ends (and its connection taken
/// out of the pending pool if it is still there).
struct ThreadGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for ThreadGuard {
    fn drop(&mut self) {
        let mut c = self.shared.lock_conns();
        c.pending.remove(&self.id);
        c.threads -= 1;
        drop(c);
        self.shared.ended.notify_all();
    }
}

/// An authenticated connection, counted in its pool until dropped.
struct AuthenticatedGuard<'a>(&'a Shared);

impl Drop for AuthenticatedGuard<'_> {
    fn drop(&mut self) {
        self.0.lock_conns().authenticated -= 1;
    }
}

/// Sends a fresh connection the greeting with the server's nonce `sn`,
/// without blocking: a short line into an empty socket buffer.
fn greet(conn: &TcpStream, run: &str, sn: &str) -> io::Result<()> {
    conn.set_nodelay(true)?;
    conn.set_nonblocking(true)?;
    let sent = (&*conn).write_all(format!("{GREETING} {VERSION} {run} {sn}\n").as_bytes());
    conn.set_nonblocking(false)?;
    sent
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let lim = &shared.limits;
    loop {
        let (conn, peer) = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors, most likely: the peers that hold
                // them time out; meanwhile, no busy loop, and one line.
                if !shared.accept_failed.swap(true, SeqCst) {
                    shared.log_line(&format!("rendezvous: cannot accept a connection: {e} (further failures are not logged)"));
                }
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let accepted = Instant::now();
        // Greeted at once, before its thread exists: a rank's AUTH is on its
        // way while the thread starts, so it leaves the pending pool sooner.
        let sn = nonce();
        if let Err(e) = greet(&conn, shared.auth.run(), &sn) {
            shared.refuse(peer, &refusal(Kind::Unauthenticated, format!("did not take the greeting: {e}")));
            continue;
        }
        let conn = Arc::new(conn);
        let (id, pushed_out) = {
            let mut c = shared.lock_conns();
            // Full of connections that have not authenticated: the oldest
            // goes. A rank answers its greeting within a round trip, so it is
            // the newest, not the oldest, while a silent peer ages until a
            // newcomer pushes it out (or its deadline closes it).
            let pushed_out = if c.pending.len() >= lim.max_pending { c.pending.pop_first().map(|(_, p)| p) } else { None };
            if let Some(p) = &pushed_out {
                // Its thread's read or write fails at once, and it ends.
                let _ = p.conn.shutdown(Shutdown::Both);
            }
            // The threads alive stay within the two pools: a pushed-out
            // connection's thread may still be ending.
            while c.threads >= lim.max_pending + lim.max_connections {
                c = shared.ended.wait_timeout(c, Duration::from_millis(100)).unwrap_or_else(|e| e.into_inner()).0;
            }
            let id = c.next_id;
            c.next_id += 1;
            c.pending.insert(id, Pending { conn: conn.clone(), peer, accepted });
            c.threads += 1;
            (id, pushed_out)
        };
        if let Some(p) = pushed_out {
            let why = format!(
                "not authenticated {:.0} ms after its accept, pushed out by a newer connection ({} connections waiting to authenticate, the cap)",
                p.accepted.elapsed().as_secs_f64() * 1e3,
                lim.max_pending
            );
            shared.refuse(p.peer, &refusal(Kind::Evicted, why));
        }
        let guard = ThreadGuard { shared: shared.clone(), id };
        let (sh, theirs) = (shared.clone(), conn.clone());
        let spawned = std::thread::Builder::new().name("harness-rendezvous-conn".into()).stack_size(THREAD_STACK).spawn(move || {
            let guard = guard;
            sh.serve_conn(&theirs, peer, guard.id, accepted, &sn);
        });
        if let Err(e) = spawned {
            // The guard went with the closure. Never blocks the accepting
            // thread: a short line into a fresh socket's buffer, or nothing.
            let _ = conn.set_nonblocking(true);
            let _ = (&*conn).write_all(b"BUSY no thread to serve the connection\n");
            shared.refuse(peer, &refusal(Kind::Busy, format!("no thread to serve it: {e} (answered BUSY)")));
        }
    }
}

impl Shared {
    fn lock_conns(&self) -> MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn log_line(&self, line: &str) {
        eprintln!("harness: {line}");
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        if lines.len() < MAX_LOGGED {
            lines.push(line.to_owned());
        }
    }

    /// Counts a refusal, and logs it the first time for its address and reason.
    fn refuse(&self, peer: SocketAddr, r: &Refusal) {
        *self.counts.lock().unwrap_or_else(|e| e.into_inner()).entry(r.kind).or_default() += 1;
        let line = {
            let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
            let (seen, full) = &mut *logged;
            if seen.contains(&(peer.ip(), r.kind)) {
                None
            } else if seen.len() < MAX_LOGGED {
                seen.insert((peer.ip(), r.kind));
                Some(format!(
                    "rendezvous: refused {peer}: {} (further refusals of {} for this reason are counted, not logged)",
                    r.why,
                    peer.ip()
                ))
            } else if !*full {
                *full = true;
                Some(format!("rendezvous: refusals from {MAX_LOGGED} addresses logged; further ones are counted, not logged"))
            } else {
                None
            }
        };
        if let Some(line) = line {
            self.log_line(&line);
        }
    }

    /// Moves connection `id`, just authenticated, from the pending pool to
    /// the authenticated one, if it is still pending and there is room.
    fn admit(&self, id: u64) -> Admission {
        let mut c = self.lock_conns();
        if c.pending.remove(&id).is_none() {
            return Admission::PushedOut;
        }
        if c.authenticated >= self.limits.max_connections {
            return Admission::Full;
        }
        c.authenticated += 1;
        Admission::Admitted
    }

    /// One connection: the handshake, then one request.
    fn serve_conn(&self, conn: &TcpStream, peer: SocketAddr, id: u64, accepted: Instant, sn: &str) {
        let deadline = accepted + self.limits.handshake_timeout;
        let mut r = BufReader::with_capacity(4096, Timed { s: conn, deadline });
        let mut w = Timed { s: conn, deadline };
        let (rank, proof) = match self.handshake(&mut r, &mut w, sn) {
            Ok(ok) => ok,
            Err(e) => {
                // Unless a newer connection pushed it out first (counted then).
                if self.lock_conns().pending.remove(&id).is_some() {
                    self.refuse(peer, &e);
                }
                return;
            }
        };
        let _admitted = match self.admit(id) {
            Admission::Admitted => AuthenticatedGuard(self),
            Admission::PushedOut => return,
            Admission::Full => {
                let cap = self.limits.max_connections;
                let _ = w.write_all(format!("BUSY the cap of {cap} authenticated connections\n").as_bytes());
                let why = format!("rank {rank} authenticated over the cap of {cap} authenticated connections (answered BUSY)");
                return self.refuse(peer, &refusal(Kind::Busy, why));
            }
        };
        if let Err(e) = w.write_all(format!("OK {proof}\n").as_bytes()) {
            let timeout = self.limits.handshake_timeout;
            return self.refuse(peer, &refusal(Kind::Refused, format!("rank {rank} did not take OK: {}", io_why(&e, timeout))));
        }
        let deadline = Instant::now() + self.limits.io_timeout;
        r.get_mut().deadline = deadline;
        w.deadline = deadline;
        match self.request(&mut r, &mut w) {
            Ok(()) => {
                self.served.fetch_add(1, SeqCst);
            }
            Err(e) => {
                // The peer learns why; a peer that stopped reading learns nothing.
                let _ = w.write_all(format!("ERR {}\n", e.why).as_bytes());
                self.refuse(peer, &refusal(e.kind, format!("a request of rank {rank}: {}", e.why)));
            }
        }
    }

    /// The peer's proof of the secret, after the greeting with nonce `sn`:
    /// its rank, and the store's own proof for the answer `OK`.
    fn handshake(&self, r: &mut impl BufRead, w: &mut impl Write, sn: &str) -> Result<(usize, String), Refusal> {
        let timeout = self.limits.handshake_timeout;
        let unauth = |e: io::Error| refusal(Kind::Unauthenticated, format!("did not authenticate: {}", io_why(&e, timeout)));
        let run = self.auth.run();
        let line = read_line(r, MAX_LINE)
            .map_err(unauth)?
            .ok_or_else(|| refusal(Kind::Unauthenticated, "closed the connection without authenticating"))?;
        let parts: Vec<&str> = line.split_ascii_whitespace().collect();
        let (rank, cn, tag) = match parts.as_slice() {
            ["AUTH", rank, cn, tag] if is_nonce(cn) => (*rank, *cn, *tag),
            [first, ..] if *first != "AUTH" => {
                let _ = w.write_all(b"DENIED authenticate first\n");
                return Err(refusal(Kind::Unauthenticated, format!("sent {} before authenticating", quoted(first))));
            }
            _ => {
                let _ = w.write_all(b"DENIED malformed AUTH\n");
                return Err(refusal(Kind::Unauthenticated, format!("sent a malformed AUTH line {}", quoted(&line))));
            }
        };
        if !self.auth.verify(&[b"client", run.as_bytes(), sn.as_bytes(), cn.as_bytes(), rank.as_bytes()], tag) {
            let _ = w.write_all(b"DENIED authentication failed: the proof does not match this run's secret\n");
            return Err(refusal(
                Kind::Denied,
                format!("authentication failed (claiming rank {}): a wrong secret, or a rank of another run", quoted(rank)),
            ));
        }
        let rank = rank.parse().map_err(|_| refusal(Kind::Denied, format!("rank {} is not a number", quoted(rank))))?;
        Ok((rank, hex::encode(self.auth.mac(&[b"server", run.as_bytes(), sn.as_bytes(), cn.as_bytes()]))))
    }

    /// An authenticated peer's one request.
    fn request(&self, r: &mut BufReader<Timed<'_>>, w: &mut Timed<'_>) -> Result<(), Refusal> {
        let io_timeout = self.limits.io_timeout;
        let line = read_line(r, self.limits.max_key_bytes + 64)
            .map_err(|e| refusal(Kind::Refused, format!("no request: {}", io_why(&e, io_timeout))))?
            .ok_or_else(|| refusal(Kind::Refused, "closed the connection without a request"))?;
        let parts: Vec<&str> = line.split_ascii_whitespace().collect();
        match parts.as_slice() {
            [cmd @ ("SET" | "PUT"), key, len] => self.set(r, w, key, len, *cmd == "PUT"),
            ["GET", key, ms] => self.get(w, key, ms),
            _ => Err(refusal(Kind::Refused, format!("unknown request {}", quoted(&line)))),
        }
    }

    fn check_key(&self, key: &str) -> Result<(), Refusal> {
        let refused = |why: String| Err(refusal(Kind::Refused, why));
        if key.len() > self.limits.max_key_bytes {
            return refused(format!("a key of {} bytes, over the cap of {}", key.len(), self.limits.max_key_bytes));
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return refused(format!("the key {} is not printable ASCII", quoted(key)));
        }
        if !key.strip_prefix(self.auth.run()).is_some_and(|k| k.starts_with('/') && k.len() > 1) {
            return refused(format!("the key {} is outside this run's namespace `{}/`", quoted(key), self.auth.run()));
        }
        Ok(())
    }

    /// `SET` or `PUT` (`replace`): the value is read only once its length
    /// passed the caps and its bytes are reserved.
    fn set(&self, r: &mut impl Read, w: &mut impl Write, key: &str, len: &str, replace: bool) -> Result<(), Refusal> {
        let refused = |why: String| refusal(Kind::Refused, why);
        self.check_key(key)?;
        let len: usize = len.parse().map_err(|_| refused(format!("{} is not a length", quoted(len))))?;
        let lim = &self.limits;
        if len > lim.max_value_bytes {
            return Err(refused(format!("a value of {len} bytes for `{key}`, over the cap of {} bytes", lim.max_value_bytes)));
        }
        let cost = len + key.len() + ENTRY_OVERHEAD;
        let reservation = {
            let mut st = self.store.lock();
            if !st.map.contains_key(key) && st.map.len() >= lim.max_keys {
                return Err(refused(format!("the store holds its cap of {} keys", lim.max_keys)));
            }
            if st.bytes + st.reserved + cost > lim.max_store_bytes {
                return Err(refused(format!(
                    "the store is full: {} of its {} bytes held or reserved",
                    st.bytes + st.reserved,
                    lim.max_store_bytes
                )));
            }
            st.reserved += cost;
            Reservation { store: &self.store, bytes: cost }
        };
        // Grown as the bytes come: a peer that stops sending holds little.
        let mut value = Vec::with_capacity(len.min(64 << 10));
        r.by_ref()
            .take(len as u64)
            .read_to_end(&mut value)
            .map_err(|e| refused(format!("the value of `{key}`: {}", io_why(&e, lim.io_timeout))))?;
        if value.len() < len {
            return Err(refused(format!("the connection closed after {} of the {len} bytes of `{key}`", value.len())));
        }
        {
            let mut st = self.store.lock();
            let old = st.map.get(key).cloned();
            if let Some(old) = &old {
                if !replace && **old != *value {
                    return Err(refused(format!("`{key}` is already set to another value (keys are written once; PUT replaces)")));
                }
            } else if st.map.len() >= lim.max_keys {
                return Err(refused(format!("the store holds its cap of {} keys", lim.max_keys)));
            }
            let freed = old.map_or(0, |o| o.len() + key.len() + ENTRY_OVERHEAD);
            st.bytes = st.bytes + cost - freed;
            st.map.insert(key.to_owned(), value.into());
        }
        drop(reservation);
        self.store.cv.notify_all();
        w.write_all(b"OK\n").map_err(|e| refused(format!("the answer to SET `{key}`: {}", io_why(&e, lim.io_timeout))))
    }

    /// `GET`: waits for the key (at most [`Limits::max_wait`]), then sends
    /// it with no lock held, within [`Limits::io_timeout`].
    fn get(&self, w: &mut Timed<'_>, key: &str, ms: &str) -> Result<(), Refusal> {
        let refused = |why: String| refusal(Kind::Refused, why);
        self.check_key(key)?;
        let ms: u64 = ms.parse().map_err(|_| refused(format!("{} is not a number of milliseconds", quoted(ms))))?;
        let deadline = Instant::now() + Duration::from_millis(ms).min(self.limits.max_wait);
        let value = {
            let mut st = self.store.lock();
            loop {
                if let Some(v) = st.map.get(key) {
                    break Some(v.clone());
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break None;
                }
                st = self.store.cv.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
            }
        };
        w.deadline = Instant::now() + self.limits.io_timeout;
        let sent = match value {
            Some(v) => w.write_all(format!("VAL {}\n", v.len()).as_bytes()).and_then(|()| w.write_all(&v)),
            None => w.write_all(b"TIMEOUT\n"),
        };
        sent.map_err(|e| refused(format!("the answer to GET `{key}`: {}", io_why(&e, self.limits.io_timeout))))
    }
}

/// A rank's connection details to the store.
#[derive(Debug, Clone)]
pub struct Client {
    /// `host:port` of rank 0's store (MASTER_ADDR:MASTER_PORT).
    pub addr: String,
    pub rank: usize,
    /// How long to keep trying to reach the store, and how long a GET waits.
    pub timeout: Duration,
    /// The run's secret and namespace.
    pub auth: Auth,
}

/// A `BUSY` line as the reason for another try.
fn busy(line: &str) -> String {
    format!("the store is busy: {}", quoted(line.trim_start_matches("BUSY").trim_start()))
}

/// Why one attempt to connect failed: worth another try, or not.
enum Attempt {
    /// No store yet, or a busy one: try again after a growing pause.
    Retry(String),
    /// The store closed the handshake (pushed out by peers without the
    /// secret, most likely): try again soon, as a pause would not end that.
    Closed(String),
    Fatal(RendezvousError),
}

/// An authenticated connection, ready for its one request.
struct Conn {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Client {
    /// Connects, authenticates (retrying while the store is unreachable,
    /// busy or closes the handshake, until the client's timeout), and
    /// returns the connection.
    fn connect(&self) -> Result<Conn, RendezvousError> {
        let deadline = Instant::now() + self.timeout;
        let mut pause = CLIENT_FIRST_PAUSE;
        loop {
            let (why, closed) = match self.addr.to_socket_addrs() {
                Err(e) => (e.to_string(), false),
                Ok(addrs) => {
                    let mut why = ("no address".to_owned(), false);
                    for a in addrs {
                        match self.attempt(a) {
                            Ok(c) => return Ok(c),
                            Err(Attempt::Fatal(e)) => return Err(e),
                            Err(Attempt::Retry(w)) => why = (w, false),
                            Err(Attempt::Closed(w)) => why = (w, true),
                        }
                    }
                    why
                }
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RendezvousError::Unreachable {
                    rank: self.rank,
                    addr: self.addr.clone(),
                    timeout_s: self.timeout.as_secs_f64(),
                    why,
                });
            }
            let wait = if closed { CLIENT_FIRST_PAUSE } else { pause };
            if !closed {
                pause = (pause * 2).min(CLIENT_MAX_PAUSE);
            }
            std::thread::sleep(rand::rng().random_range(wait / 2..=wait).min(left));
        }
    }

    /// One connection to `a` and the handshake.
    fn attempt(&self, a: SocketAddr) -> Result<Conn, Attempt> {
        let s = TcpStream::connect_timeout(&a, Duration::from_secs(2)).map_err(|e| Attempt::Retry(e.to_string()))?;
        let closed = |e: io::Error| Attempt::Closed(e.to_string());
        let _ = s.set_nodelay(true);
        s.set_read_timeout(Some(CLIENT_HANDSHAKE)).map_err(closed)?;
        s.set_write_timeout(Some(CLIENT_HANDSHAKE)).map_err(closed)?;
        let mut r = BufReader::new(s.try_clone().map_err(closed)?);
        let mut w = s;
        let line = read_line(&mut r, MAX_LINE).map_err(closed)?.ok_or_else(|| Attempt::Closed(format!("{a} closed the connection")))?;
        let parts: Vec<&str> = line.split_ascii_whitespace().collect();
        let (run, sn) = match parts.as_slice() {
            ["BUSY", ..] => return Err(Attempt::Retry(busy(&line))),
            [GREETING, VERSION, run, sn] if is_nonce(sn) => (*run, *sn),
            [GREETING, v, ..] => {
                return Err(Attempt::Fatal(RendezvousError::Protocol(format!(
                    "the rendezvous at {a} speaks version {}, this rank version {VERSION}: every rank needs the same harness",
                    quoted(v)
                ))))
            }
            _ => {
                return Err(Attempt::Fatal(RendezvousError::Protocol(format!(
                    "{a} is not a harness rendezvous: it said {}",
                    quoted(&line)
                ))))
            }
        };
        let ours = self.auth.run();
        let cn = nonce();
        let rank = self.rank.to_string();
        let tag = hex::encode(self.auth.mac(&[b"client", ours.as_bytes(), sn.as_bytes(), cn.as_bytes(), rank.as_bytes()]));
        w.write_all(format!("AUTH {rank} {cn} {tag}\n").as_bytes()).map_err(closed)?;
        let denied = |why: String| Attempt::Fatal(RendezvousError::Denied { rank: self.rank, addr: a.to_string(), why });
        let answer = read_line(&mut r, MAX_LINE)
            .map_err(closed)?
            .ok_or_else(|| Attempt::Closed(format!("{a} closed the connection during the handshake")))?;
        match answer.split_ascii_whitespace().collect::<Vec<_>>().as_slice() {
            ["OK", proof] if self.auth.verify(&[b"server", ours.as_bytes(), sn.as_bytes(), cn.as_bytes()], proof) => Ok(Conn { r, w }),
            ["OK", ..] => Err(denied("it did not prove that it holds this run's secret: it is not this run's rank 0".into())),
            ["BUSY", ..] => Err(Attempt::Retry(busy(&answer))),
            _ if run != ours => Err(denied(format!(
                "it serves another run (run id {}, this rank's is {ours}): the ranks have different secrets, or the port is another job's",
                quoted(run)
            ))),
            ["DENIED", ..] => Err(denied(answer.trim_start_matches("DENIED").trim().chars().take(200).collect())),
            _ => Err(Attempt::Fatal(RendezvousError::Protocol(format!("{a} answered AUTH with {}", quoted(&answer))))),
        }
    }

    /// `key` in the run's namespace, checked as the server checks it.
    fn key(&self, key: &str) -> Result<String, RendezvousError> {
        let full = format!("{}/{key}", self.auth.run());
        let why = if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
            "keys are printable ASCII without spaces".to_owned()
        } else if full.len() > MAX_KEY_BYTES {
            format!("a key of {} bytes (namespace included) is over the cap of {MAX_KEY_BYTES}", full.len())
        } else {
            return Ok(full);
        };
        Err(RendezvousError::Refused { rank: self.rank, key: key.to_owned(), why })
    }

    /// The server's answer to a request: its line, or the error it names.
    fn answer(&self, c: &mut Conn, key: &str) -> Result<String, RendezvousError> {
        let line = read_line(&mut c.r, MAX_LINE)?.ok_or_else(|| RendezvousError::Protocol(format!("no answer for `{key}`")))?;
        match line.strip_prefix("ERR ") {
            Some(why) => Err(RendezvousError::Refused { rank: self.rank, key: key.to_owned(), why: why.to_owned() }),
            None => Ok(line),
        }
    }

    fn write(&self, cmd: &str, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        let full = self.key(key)?;
        if value.len() > MAX_VALUE_BYTES {
            let why = format!("a value of {} bytes is over the cap of {MAX_VALUE_BYTES} bytes", value.len());
            return Err(RendezvousError::Refused { rank: self.rank, key: key.to_owned(), why });
        }
        let mut c = self.connect()?;
        c.w.set_write_timeout(Some(CLIENT_IO))?;
        c.w.set_read_timeout(Some(CLIENT_IO))?;
        let sent = c.w.write_all(format!("{cmd} {full} {}\n", value.len()).as_bytes()).and_then(|()| c.w.write_all(value));
        // A refusal comes before the value is read, and the server may close
        // while it is still being sent: its answer says why.
        match (sent, self.answer(&mut c, key)) {
            (_, Err(e @ RendezvousError::Refused { .. })) => Err(e),
            (Err(e), _) => Err(e.into()),
            (Ok(()), Ok(line)) if line == "OK" => Ok(()),
            (Ok(()), Ok(other)) => Err(RendezvousError::Protocol(format!("{cmd} `{key}` was answered {}", quoted(&other)))),
            (Ok(()), Err(e)) => Err(e),
        }
    }

    /// Publishes `value` under `key`, once: another value for a key already
    /// set is refused.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        self.write("SET", key, value)
    }

    /// Publishes `value` under `key`, replacing what it held (heartbeats).
    pub fn put(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        self.write("PUT", key, value)
    }

    /// Waits for `key` (up to the client's timeout) and returns its value.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, RendezvousError> {
        let full = self.key(key)?;
        let mut c = self.connect()?;
        c.w.set_write_timeout(Some(CLIENT_IO))?;
        c.r.get_ref().set_read_timeout(Some(self.timeout.saturating_add(CLIENT_IO)))?;
        let ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
        c.w.write_all(format!("GET {full} {ms}\n").as_bytes())?;
        let line = self.answer(&mut c, key)?;
        match line.split_ascii_whitespace().collect::<Vec<_>>().as_slice() {
            ["VAL", len] => {
                let len: usize = len.parse().map_err(|_| RendezvousError::Protocol(format!("VAL {}", quoted(len))))?;
                if len > MAX_VALUE_BYTES {
                    return Err(RendezvousError::Protocol(format!("`{key}` came with {len} bytes, over the cap of {MAX_VALUE_BYTES}")));
                }
                let mut buf = Vec::with_capacity(len.min(64 << 10));
                (&mut c.r).take(len as u64).read_to_end(&mut buf)?;
                if buf.len() < len {
                    return Err(RendezvousError::Protocol(format!("`{key}` was cut after {} of its {len} bytes", buf.len())));
                }
                Ok(buf)
            }
            ["TIMEOUT"] => Err(RendezvousError::Timeout { rank: self.rank, key: key.into(), timeout_s: self.timeout.as_secs_f64() }),
            _ => Err(RendezvousError::Protocol(format!("GET `{key}` was answered {}", quoted(&line)))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Caps for tests: the defaults, with short timeouts (ms).
    fn quick(handshake_ms: u64, io_ms: u64) -> Limits {
        Limits { handshake_timeout: Duration::from_millis(handshake_ms), io_timeout: Duration::from_millis(io_ms), ..Limits::for_world(2) }
    }

    fn new_auth() -> Auth {
        Auth::new(Secret::generate(), "")
    }

    /// A store for `auth`'s run on a free loopback port, and its address.
    fn start(auth: &Auth, limits: Limits) -> (Server, String) {
        let server = serve(&["127.0.0.1:0".parse().unwrap()], auth, limits).unwrap();
        let addr = server.addrs()[0].to_string();
        (server, addr)
    }

    fn client(addr: &str, rank: usize, auth: &Auth, timeout: Duration) -> Client {
        Client { addr: addr.to_owned(), rank, timeout, auth: auth.clone() }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// Polls `ok` for up to 10 s (the server counts a connection after it
    /// answered it).
    fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
        let t0 = Instant::now();
        while !ok() {
            assert!(t0.elapsed() < secs(10), "never: {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A peer that speaks the protocol by hand (a rogue, unless it
    /// authenticates).
    struct Raw {
        r: BufReader<TcpStream>,
        w: TcpStream,
    }

    impl Raw {
        fn connect(addr: &str) -> Raw {
            let w = TcpStream::connect(addr).unwrap();
            w.set_read_timeout(Some(secs(10))).unwrap();
            Raw { r: BufReader::new(w.try_clone().unwrap()), w }
        }

        fn line(&mut self) -> Option<String> {
            read_line(&mut self.r, 1 << 16).ok().flatten()
        }

        fn send(&mut self, bytes: &[u8]) {
            let _ = self.w.write_all(bytes);
        }

        /// The greeting's run id and nonce.
        fn greeting(&mut self) -> (String, String) {
            let g = self.line().expect("a greeting");
            let p: Vec<&str> = g.split(' ').collect();
            assert_eq!(p[..2], [GREETING, VERSION], "{g}");
            (p[2].to_owned(), p[3].to_owned())
        }

        /// Connected and authenticated as rank 1 with `auth`'s secret.
        fn authenticated(addr: &str, auth: &Auth) -> Raw {
            let mut raw = Raw::connect(addr);
            let (run, sn) = raw.greeting();
            let cn = nonce();
            let tag = hex::encode(auth.mac(&[b"client", run.as_bytes(), sn.as_bytes(), cn.as_bytes(), b"1"]));
            raw.send(format!("AUTH 1 {cn} {tag}\n").as_bytes());
            assert!(raw.line().is_some_and(|l| l.starts_with("OK ")));
            raw
        }

        /// What the server sends until it closes.
        fn rest(&mut self) -> String {
            let mut s = Vec::new();
            let _ = self.r.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        }
    }

    #[test]
    fn values_cross_between_ranks_and_waits_time_out() {
        let auth = new_auth();
        let (_server, addr) = start(&auth, Limits::for_world(2));
        let c0 = client(&addr, 0, &auth, secs(5));
        let c1 = client(&addr, 1, &auth, secs(5));
        let waiter = std::thread::spawn(move || c1.get("id").unwrap());
        std::thread::sleep(Duration::from_millis(100));
        c0.set("id", &[1, 2, 3, 0, 255]).unwrap();
        assert_eq!(waiter.join().unwrap(), vec![1, 2, 3, 0, 255]);
        let short = client(&addr, 3, &auth, Duration::from_millis(200));
        let e = short.get("never").unwrap_err().to_string();
        assert!(e.contains("rank 3 waited") && e.contains("`never`"), "{e}");
    }

    #[test]
    fn an_absent_rank_zero_is_reported() {
        let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let c = client(&addr, 1, &new_auth(), Duration::from_millis(300));
        let e = c.get("x").unwrap_err().to_string();
        assert!(e.contains("could not reach the rendezvous") && e.contains("hint:"), "{e}");
    }

    #[test]
    fn secrets_are_long_enough_and_never_printed() {
        let e = Secret::new("short").unwrap_err().to_string();
        assert!(e.contains("at least 16") && e.contains("hint:"), "{e}");
        let s = Secret::generate();
        assert_eq!(s.expose().len(), 64);
        assert_ne!(s, Secret::generate());
        let a = Auth::new(s.clone(), "");
        assert!(!format!("{a:?}").contains(s.expose()), "{a:?}");
        // Two jobs that reuse one secret get two namespaces.
        assert_eq!(Auth::new(s.clone(), "").run(), a.run());
        assert_ne!(Auth::new(s, "job-7.0").run(), a.run());
    }

    #[test]
    fn the_store_listens_only_where_master_addr_points() {
        let e = bind_addrs("0.0.0.0", 29500, false).unwrap_err().to_string();
        assert!(e.contains("every interface") && e.contains("hint:"), "{e}");
        assert!(bind_addrs("::", 29500, false).is_err());
        let e = bind_addrs("127.0.0.1", 29500, true).unwrap_err().to_string();
        assert!(e.contains("a loopback address that the other hosts cannot reach") && e.contains("hint:"), "{e}");
        assert_eq!(bind_addrs("127.0.0.1", 29500, false).unwrap(), ["127.0.0.1:29500".parse().unwrap()]);
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let e = serve(&[taken.local_addr().unwrap()], &new_auth(), Limits::for_world(2)).err().unwrap().to_string();
        assert!(e.contains("MASTER_PORT must be a free port"), "{e}");
    }

    #[test]
    fn requests_without_the_secret_are_refused_and_change_nothing() {
        let auth = new_auth();
        let (server, addr) = start(&auth, quick(2000, 2000));
        let c0 = client(&addr, 0, &auth, secs(5));
        c0.set("todo", b"[\"w/s/r0\"]").unwrap();
        let run = auth.run();
        // A forged peer failure, the entry list overwritten, a read: each
        // refused at its first word, and the connection closed.
        for req in [
            format!("SET {run}/fail/w/s/r0/0 2\n{{}}"),
            format!("SET {run}/todo 2\n[]"),
            format!("PUT {run}/todo 2\n[]"),
            format!("GET {run}/todo 0\n"),
        ] {
            let mut raw = Raw::connect(&addr);
            raw.greeting();
            raw.send(req.as_bytes());
            assert_eq!(raw.line().as_deref(), Some("DENIED authenticate first"), "{req}");
            assert_eq!(raw.rest(), "", "{req}");
        }
        // One that does not wait for the greeting fares no better.
        let mut raw = Raw::connect(&addr);
        raw.send(format!("GET {run}/todo 0\n").as_bytes());
        let rest = raw.rest();
        assert!(rest.starts_with(GREETING) && rest.ends_with("\nDENIED authenticate first\n"), "{rest}");
        let quick_get = client(&addr, 1, &auth, Duration::from_millis(300));
        assert!(matches!(quick_get.get("fail/w/s/r0/0"), Err(RendezvousError::Timeout { .. })));
        assert_eq!(c0.get("todo").unwrap(), b"[\"w/s/r0\"]");
        eventually("3 served", || server.stats().served == 3);
        let st = server.stats();
        assert_eq!((st.keys, st.unauthenticated, st.denied), (1, 5, 0), "{st:?}");
        // Logged once, with the peer's address.
        let logged = server.logged();
        assert_eq!(logged.len(), 1, "{logged:?}");
        assert!(logged[0].contains("refused 127.0.0.1:") && logged[0].contains("sent \"SET\" before authenticating"), "{logged:?}");
    }

    #[test]
    fn a_wrong_secret_or_another_run_is_denied_and_logged_once() {
        let auth = new_auth();
        let (server, addr) = start(&auth, quick(2000, 2000));
        let honest = client(&addr, 0, &auth, secs(5));
        honest.set("nccl/e", b"id").unwrap();
        let wrong = client(&addr, 1, &new_auth(), secs(5));
        for _ in 0..3 {
            let e = wrong.get("nccl/e").unwrap_err();
            assert!(matches!(e, RendezvousError::Denied { .. }), "{e}");
            let e = e.to_string();
            assert!(e.contains("rank 1 was refused") && e.contains("serves another run") && e.contains("hint:"), "{e}");
        }
        // The right secret, but another job's: another namespace.
        let other_job = client(&addr, 1, &Auth::new(auth.secret.clone(), "12345.0"), secs(5));
        assert!(matches!(other_job.set("nccl/e", b"forged"), Err(RendezvousError::Denied { .. })));
        // A made-up proof for the (public) run id.
        let mut raw = Raw::connect(&addr);
        raw.greeting();
        raw.send(format!("AUTH 1 {} {}\n", nonce(), "00".repeat(32)).as_bytes());
        assert!(raw.line().is_some_and(|l| l.starts_with("DENIED authentication failed")));
        assert_eq!(honest.get("nccl/e").unwrap(), b"id");
        eventually("5 denied", || server.stats().denied == 5);
        let logged = server.logged();
        assert_eq!(logged.len(), 1, "one line for 127.0.0.1: {logged:?}");
        assert!(logged[0].contains("refused 127.0.0.1:") && logged[0].contains("authentication failed"), "{logged:?}");
    }

    #[test]
    fn a_store_that_does_not_hold_the_secret_is_not_believed() {
        let auth = new_auth();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let run = auth.run().to_owned();
        std::thread::spawn(move || {
            let (conn, _) = l.accept().unwrap();
            let mut w = &conn;
            w.write_all(format!("{GREETING} {VERSION} {run} {}\n", nonce()).as_bytes()).unwrap();
            let _ = read_line(&mut BufReader::new(&conn), MAX_LINE);
            let _ = w.write_all(format!("OK {}\nVAL 6\nforged", "ab".repeat(32)).as_bytes());
        });
        let e = client(&addr, 1, &auth, secs(5)).get("nccl/e").unwrap_err().to_string();
        assert!(e.contains("did not prove that it holds this run's secret"), "{e}");
    }

    #[test]
    fn oversize_lengths_bad_requests_and_a_full_store_are_refused_before_allocating() {
        let auth = new_auth();
        let limits = Limits { max_keys: 4, max_store_bytes: 64 << 10, max_value_bytes: 32 << 10, ..quick(2000, 2000) };
        let (server, addr) = start(&auth, limits);
        let run = auth.run();
        // Unauthenticated, the tester's 24 bytes are refused at their first word.
        let mut raw = Raw::connect(&addr);
        raw.greeting();
        raw.send(b"SET x 1099511627776\n");
        assert_eq!(raw.line().as_deref(), Some("DENIED authenticate first"));
        // Authenticated, a 1 TiB value is refused from its header alone (a
        // buffer for it would abort this test process).
        let mut raw = Raw::authenticated(&addr, &auth);
        raw.send(format!("SET {run}/a 1099511627776\n").as_bytes());
        let l = raw.line().unwrap();
        assert!(l.starts_with("ERR a value of 1099511627776 bytes") && l.ends_with("over the cap of 32768 bytes"), "{l}");
        let mut raw = Raw::authenticated(&addr, &auth);
        raw.send(&[b'a'; 2000]);
        assert_eq!(raw.line().as_deref(), Some("ERR no request: a line over 1088 bytes"));
        for (req, why) in [
            ("SET other/x 1\n".to_owned(), "is outside this run's namespace"),
            (format!("GET {run}/x soon\n"), "is not a number of milliseconds"),
            (format!("SET {run}/x -1\n"), "is not a length"),
            (format!("DEL {run}/x\n"), "unknown request"),
        ] {
            let mut raw = Raw::authenticated(&addr, &auth);
            raw.send(req.as_bytes());
            let l = raw.line().unwrap();
            assert!(l.starts_with("ERR ") && l.contains(why), "{req}: {l}");
        }
        // The caps on values, bytes and keys, through a rank's client.
        let c = client(&addr, 0, &auth, secs(5));
        let refused = |r: Result<(), RendezvousError>| match r {
            Err(e @ RendezvousError::Refused { .. }) => e.to_string(),
            other => panic!("{other:?}"),
        };
        assert!(refused(c.set("big", &[0; 40 << 10])).ends_with("over the cap of 32768 bytes"));
        assert!(refused(c.set("huge", &vec![0; MAX_VALUE_BYTES + 1])).contains("over the cap of 16777216 bytes"));
        c.set("v0", &[1; 30 << 10]).unwrap();
        c.set("v1", &[1; 30 << 10]).unwrap();
        assert!(refused(c.set("v2", &[1; 30 << 10])).contains("the store is full"));
        c.set("k2", b"x").unwrap();
        c.set("k3", b"x").unwrap();
        assert!(refused(c.set("k4", b"x")).contains("its cap of 4 keys"));
        // Written once (the same value again is fine); PUT replaces.
        c.set("k2", b"x").unwrap();
        assert!(refused(c.set("k2", b"y")).contains("is already set to another value"));
        c.put("k2", b"y").unwrap();
        assert_eq!(c.get("k2").unwrap(), b"y");
        assert!(refused(c.set("with space", b"x")).contains("printable ASCII without spaces"));
        let st = server.stats();
        assert_eq!((st.keys, st.reserved), (4, 0), "{st:?}");
        assert!(st.bytes <= 64 << 10, "{st:?}");
    }

    #[test]
    fn idle_connections_are_pushed_out_and_closed_and_the_ranks_still_meet() {
        let auth = new_auth();
        let (server, addr) = start(&auth, Limits { max_pending: 8, ..quick(300, 2000) });
        // The tester held 663 connections; over a pool of 8, 40 do.
        let mut idle: Vec<Raw> = (0..40).map(|_| Raw::connect(&addr)).collect();
        // The ranks meet all the same: the oldest idle connections make room
        // for them, and the rest are closed soon.
        let c0 = client(&addr, 0, &auth, secs(10));
        let c1 = client(&addr, 1, &auth, secs(10));
        let waiter = std::thread::spawn(move || c1.get("id").unwrap());
        c0.set("id", b"nccl").unwrap();
        assert_eq!(waiter.join().unwrap(), b"nccl");
        for raw in &mut idle {
            // Greeted, then pushed out or timed out.
            let rest = raw.rest();
            assert!(rest.starts_with(GREETING) && rest.lines().count() == 1, "{rest}");
        }
        eventually("every connection closed", || server.stats().threads == 0);
        let st = server.stats();
        assert!(st.evicted >= 32 && st.evicted + st.unauthenticated >= 40 && st.busy == 0, "{st:?}");
        let logged = server.logged().join("\n");
        assert!(logged.contains("did not authenticate: timed out after 0.3 s"), "{logged}");
        assert!(logged.contains("pushed out by a newer connection (8 connections waiting to authenticate, the cap)"), "{logged}");
    }

    /// Issue 61: 100 connections that read the greeting and stay silent,
    /// reconnecting at once, held the store's 72 slots, and every request of
    /// the ranks was answered `BUSY` until their timeout. Now such peers
    /// fill only the pool of connections waiting to authenticate, where the
    /// oldest is pushed out for a newcomer, and a rank's connection leaves it
    /// within a round trip.
    #[test]
    fn issue_61_silent_peers_that_reconnect_at_once_do_not_lock_the_ranks_out() {
        // The defaults (more room than the flood fills), and a pool that it
        // keeps full, pushing out the oldest at each accept.
        for limits in [Limits::for_world(2), Limits { max_pending: 16, ..Limits::for_world(2) }] {
            let auth = new_auth();
            let (server, addr) = start(&auth, limits.clone());
            let flooded = limits.max_pending.min(128);
            let stop = Arc::new(AtomicBool::new(false));
            let flood: Vec<_> = (0..128)
                .map(|_| {
                    let (addr, stop) = (addr.clone(), stop.clone());
                    std::thread::Builder::new()
                        .stack_size(64 << 10)
                        .spawn(move || {
                            let mut buf = [0u8; 256];
                            while !stop.load(SeqCst) {
                                let Ok(mut s) = TcpStream::connect(&addr) else { continue };
                                s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
                                // Take the greeting, say nothing, and connect again once closed.
                                while !stop.load(SeqCst) {
                                    match s.read(&mut buf) {
                                        Ok(0) => break,
                                        Ok(_) => {}
                                        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                                        Err(_) => break,
                                    }
                                }
                            }
                        })
                        .unwrap()
                })
                .collect();
            eventually("the flood holds its connections", || server.stats().pending == flooded);
            let t0 = Instant::now();
            let c0 = client(&addr, 0, &auth, secs(5));
            let c1 = client(&addr, 1, &auth, secs(5));
            let c1_waits = c1.clone();
            let waiter = std::thread::spawn(move || c1_waits.get("nccl/id").unwrap());
            c0.put("nccl/id", b"unique id").unwrap();
            assert_eq!(waiter.join().unwrap(), b"unique id");
            for i in 0..5 {
                c0.put(&format!("beat/{i}"), b"0").unwrap();
                assert_eq!(c1.get(&format!("beat/{i}")).unwrap(), b"0");
                c1.set(&format!("figures/{i}"), b"1").unwrap();
                assert_eq!(c0.get(&format!("figures/{i}")).unwrap(), b"1");
            }
            let took = t0.elapsed();
            let st = server.stats();
            stop.store(true, SeqCst);
            for t in flood {
                t.join().unwrap();
            }
            assert!(took < secs(3), "the ranks took {took:?} among the flood ({limits:?}): {st:?}");
            assert!(st.pending <= limits.max_pending && st.threads <= limits.max_pending + limits.max_connections, "{st:?}");
            assert!(st.busy == 0 && st.keys == 11, "{st:?}");
            let logged = server.logged().join("\n");
            if flooded == limits.max_pending {
                assert!(st.evicted > 0, "{st:?}");
                assert!(logged.contains("refused 127.0.0.1:") && logged.contains("pushed out by a newer connection"), "{logged}");
            }
        }
    }

    #[test]
    fn garbage_or_an_oversized_line_before_authenticating_is_dropped_at_once() {
        let auth = new_auth();
        // A long deadline: what closes these connections is what they sent.
        let (server, addr) = start(&auth, quick(5000, 5000));
        let t0 = Instant::now();
        for (sent, answer) in [
            (vec![b'x'; 600], ""),
            (vec![b'x'; 1 << 20], ""),
            (b"\xff\xfe\x00 binary\n".to_vec(), ""),
            (b"hello there\n".to_vec(), "DENIED authenticate first\n"),
            (b"AUTH 1 short 00\n".to_vec(), "DENIED malformed AUTH\n"),
        ] {
            let mut raw = Raw::connect(&addr);
            raw.greeting();
            raw.send(&sent);
            assert_eq!(raw.rest(), answer, "{:?}", String::from_utf8_lossy(&sent[..sent.len().min(20)]));
        }
        assert!(t0.elapsed() < secs(2), "dropped at once, not at the deadline: {:?}", t0.elapsed());
        eventually("5 counted", || server.stats().unauthenticated == 5);
        let st = server.stats();
        assert_eq!((st.open, st.keys), (0, 0), "{st:?}");
        // Logged with the peer's address (once for it and this reason).
        let logged = server.logged();
        assert_eq!(logged.len(), 1, "{logged:?}");
        assert!(logged[0].starts_with("rendezvous: refused 127.0.0.1:") && logged[0].contains("a line over 512 bytes"), "{logged:?}");
    }

    #[test]
    fn authenticated_connections_over_their_cap_are_answered_busy_and_the_rank_retries() {
        let auth = new_auth();
        let (server, addr) = start(&auth, Limits { max_connections: 1, ..quick(2000, 2000) });
        let holder = Raw::authenticated(&addr, &auth);
        let mut raw = Raw::connect(&addr);
        let (run, sn) = raw.greeting();
        let cn = nonce();
        let tag = hex::encode(auth.mac(&[b"client", run.as_bytes(), sn.as_bytes(), cn.as_bytes(), b"1"]));
        raw.send(format!("AUTH 1 {cn} {tag}\n").as_bytes());
        assert_eq!(raw.rest(), "BUSY the cap of 1 authenticated connections\n");
        // A rank's client tries again, and gets in once the slot is free.
        let c = client(&addr, 0, &auth, secs(5));
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(holder);
        });
        c.set("k", b"v").unwrap();
        release.join().unwrap();
        eventually("1 served", || server.stats().served == 1);
        assert!(server.stats().busy >= 2, "{:?}", server.stats());
        assert!(server.logged().join("\n").contains("rank 1 authenticated over the cap of 1 authenticated connections (answered BUSY)"));
        // A client that runs out of time says why.
        let _holder = Raw::authenticated(&addr, &auth);
        let e = client(&addr, 0, &auth, Duration::from_millis(200)).get("k").unwrap_err().to_string();
        assert!(
            e.contains("could not reach the rendezvous") && e.contains("the store is busy: \"the cap of 1 authenticated connections\""),
            "{e}"
        );
    }

    #[test]
    fn slow_readers_are_cut_off_without_stalling_the_store() {
        let auth = new_auth();
        let (server, addr) = start(&auth, quick(2000, 3000));
        let c0 = client(&addr, 0, &auth, secs(5));
        let c1 = client(&addr, 1, &auth, secs(5));
        // More than the socket buffers between the store and a reader hold.
        let big = vec![7u8; MAX_VALUE_BYTES];
        c0.set("big", &big).unwrap();
        let run = auth.run();
        let t0 = Instant::now();
        let _slow: Vec<Raw> = (0..8)
            .map(|_| {
                let mut raw = Raw::authenticated(&addr, &auth);
                raw.send(format!("GET {run}/big 0\n").as_bytes());
                raw
            })
            .collect();
        // While they take nothing (and share one copy of the value), the
        // store serves the ranks: no lock is held while sending.
        for i in 0..5 {
            c0.set(&format!("k{i}"), b"v").unwrap();
            assert_eq!(c1.get(&format!("k{i}")).unwrap(), b"v");
        }
        assert_eq!(c1.get("big").unwrap(), big);
        assert!(t0.elapsed() < secs(3), "served while the slow readers were stuck ({:?})", t0.elapsed());
        eventually("the slow readers cut off", || server.stats().open == 0);
        let st = server.stats();
        assert_eq!(st.refused, 8, "{st:?}");
        // The key `<run>/big` (20 bytes) and five `<run>/k<i>` (19) of one byte.
        assert_eq!(st.bytes, MAX_VALUE_BYTES + 20 + 5 * (19 + 1) + 6 * ENTRY_OVERHEAD, "{st:?}");
        assert!(server.logged().join("\n").contains("timed out after 3.0 s"), "{:?}", server.logged());
    }

    #[test]
    fn an_honest_pair_agrees_while_rogues_try_everything_at_once() {
        let auth = new_auth();
        let (server, addr) = start(&auth, Limits { max_pending: 16, ..quick(300, 1000) });
        let stop = Arc::new(AtomicBool::new(false));
        let rogues: Vec<_> = (0..4)
            .map(|kind| {
                let (addr, run, stop) = (addr.clone(), auth.run().to_owned(), stop.clone());
                std::thread::spawn(move || {
                    let mut held = std::collections::VecDeque::new();
                    let stranger = client(&addr, 1, &new_auth(), Duration::from_millis(1));
                    while !stop.load(SeqCst) {
                        match kind {
                            // Idle connections, a dozen held at a time.
                            0 => {
                                held.extend(TcpStream::connect(&addr).ok());
                                if held.len() > 12 {
                                    held.pop_front();
                                }
                            }
                            1 => {
                                let mut raw = Raw::connect(&addr);
                                raw.send(format!("SET {run}/fail/w/s/r0/0 2\n{{}}").as_bytes());
                                raw.rest();
                            }
                            2 => assert!(stranger.set("todo", b"[]").is_err()),
                            _ => {
                                let mut raw = Raw::connect(&addr);
                                raw.send(format!("SET {run}/todo 1099511627776\n").as_bytes());
                                raw.rest();
                            }
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                })
            })
            .collect();
        let c0 = client(&addr, 0, &auth, secs(20));
        let c1 = client(&addr, 1, &auth, secs(20));
        for i in 0..10 {
            c0.set(&format!("to1/{i}"), format!("v{i}").as_bytes()).unwrap();
            assert_eq!(c1.get(&format!("to1/{i}")).unwrap(), format!("v{i}").as_bytes());
            c1.set(&format!("to0/{i}"), format!("w{i}").as_bytes()).unwrap();
            assert_eq!(c0.get(&format!("to0/{i}")).unwrap(), format!("w{i}").as_bytes());
        }
        stop.store(true, SeqCst);
        for r in rogues {
            r.join().unwrap();
        }
        assert!(matches!(client(&addr, 0, &auth, Duration::from_millis(100)).get("fail/w/s/r0/0"), Err(RendezvousError::Timeout { .. })));
        let st = server.stats();
        assert_eq!(st.keys, 20, "only the ranks' keys: {st:?}");
        assert!(st.unauthenticated > 0 && st.denied > 0, "{st:?}");
    }
}
