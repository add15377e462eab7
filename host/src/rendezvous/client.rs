//! A rank's side of the rendezvous ([`Client`]): connect, authenticate,
//! one request per connection, retried while the store is not there yet.

use std::io::{self, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use rand::Rng;

use super::auth::{is_nonce, nonce, Auth};
use super::{
    quoted, read_line, RendezvousError, CLIENT_FIRST_PAUSE, CLIENT_HANDSHAKE, CLIENT_IO, CLIENT_MAX_PAUSE, GREETING, MAX_KEY_BYTES,
    MAX_LINE, MAX_VALUE_BYTES, VERSION,
};

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
