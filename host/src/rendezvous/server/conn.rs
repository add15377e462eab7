//! One connection of rank 0's store: the handshake, then its one request
//! (`SET`, `PUT` or `GET`), each phase within its deadline.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use super::{io_why, refusal, Admission, AuthenticatedGuard, Kind, Refusal, Reservation, Shared};
use crate::rendezvous::auth::is_nonce;
use crate::rendezvous::{quoted, read_line, ENTRY_OVERHEAD, MAX_LINE};

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

impl Shared {
    /// One connection: the handshake, then one request.
    pub(super) fn serve_conn(&self, conn: &TcpStream, peer: SocketAddr, id: u64, accepted: Instant, sn: &str) {
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

    /// `GET`: waits for the key (at most [`Limits::max_wait`](crate::rendezvous::Limits::max_wait)), then sends
    /// it with no lock held, within [`Limits::io_timeout`](crate::rendezvous::Limits::io_timeout).
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
