//! Rank 0's store: the listeners, the accepting thread, the two pools of
//! connections and what the server counts and logs.

mod conn;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::auth::{nonce, Auth};
use super::{Limits, RendezvousError, GREETING, MAX_LOGGED, THREAD_STACK, VERSION};

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

#[derive(Default)]
struct State {
    map: HashMap<String, Arc<[u8]>>,
    /// Bytes held (keys, values and [`ENTRY_OVERHEAD`](super::ENTRY_OVERHEAD) each).
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
}
