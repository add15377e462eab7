//! Rendezvous: a small TCP key-value store that rank 0 serves at
//! MASTER_ADDR:MASTER_PORT, for what ranks must agree on before NCCL exists
//! (the NCCL unique id, the entries to run) and for gathering figures.
//!
//! Protocol, one request per connection, all lengths in decimal:
//! `SET <key> <len>\n<bytes>` -> `OK\n`; `GET <key> <timeout_ms>\n` ->
//! `VAL <len>\n<bytes>` or `TIMEOUT\n`. Keys have no spaces.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Rendezvous failures.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("rank {rank} could not reach the rendezvous at {addr} within {timeout_s:.0} s: {why}\nhint: is rank 0 running, and are MASTER_ADDR / MASTER_PORT the same on every rank?")]
    Unreachable { rank: usize, addr: String, timeout_s: f64, why: String },
    #[error("rank {rank} waited {timeout_s:.0} s for `{key}` at the rendezvous; the rank that publishes it never did")]
    Timeout { rank: usize, key: String, timeout_s: f64 },
    #[error("rendezvous I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("rendezvous protocol error: {0}")]
    Protocol(String),
}

#[derive(Default)]
struct Store {
    map: Mutex<HashMap<String, Vec<u8>>>,
    cv: Condvar,
}

/// Serves the store on `addr` from a background thread (rank 0).
pub fn serve(addr: &str) -> Result<(), RendezvousError> {
    let listener = TcpListener::bind(addr)?;
    let store = Arc::new(Store::default());
    std::thread::Builder::new().name("harness-rendezvous".into()).spawn(move || {
        for conn in listener.incoming().flatten() {
            let store = store.clone();
            std::thread::spawn(move || {
                let _ = handle(conn, &store);
            });
        }
    })?;
    Ok(())
}

fn handle(conn: TcpStream, store: &Store) -> Result<(), RendezvousError> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let parts: Vec<&str> = line.split_whitespace().collect();
    let mut w = conn;
    match parts.as_slice() {
        ["SET", key, len] => {
            let len: usize = len.parse().map_err(|_| RendezvousError::Protocol(line.clone()))?;
            let mut buf = vec![0; len];
            reader.read_exact(&mut buf)?;
            store.map.lock().unwrap_or_else(|e| e.into_inner()).insert(key.to_string(), buf);
            store.cv.notify_all();
            w.write_all(b"OK\n")?;
        }
        ["GET", key, ms] => {
            let ms: u64 = ms.parse().map_err(|_| RendezvousError::Protocol(line.clone()))?;
            let deadline = Instant::now() + Duration::from_millis(ms);
            let mut map = store.map.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(v) = map.get(*key) {
                    w.write_all(format!("VAL {}\n", v.len()).as_bytes())?;
                    w.write_all(v)?;
                    break;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    w.write_all(b"TIMEOUT\n")?;
                    break;
                }
                map = store.cv.wait_timeout(map, left).unwrap_or_else(|e| e.into_inner()).0;
            }
        }
        _ => return Err(RendezvousError::Protocol(line)),
    }
    Ok(())
}

/// A rank's connection details to the store.
#[derive(Debug, Clone)]
pub struct Client {
    pub addr: String,
    pub rank: usize,
    pub timeout: Duration,
}

impl Client {
    fn connect(&self) -> Result<TcpStream, RendezvousError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let attempt = self
                .addr
                .to_socket_addrs()
                .map_err(|e| e.to_string())
                .and_then(|mut a| a.next().ok_or_else(|| "no address".to_owned()))
                .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).map_err(|e| e.to_string()));
            match attempt {
                Ok(s) => return Ok(s),
                Err(why) if Instant::now() >= deadline => {
                    return Err(RendezvousError::Unreachable {
                        rank: self.rank,
                        addr: self.addr.clone(),
                        timeout_s: self.timeout.as_secs_f64(),
                        why,
                    })
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Publishes `value` under `key`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        let mut s = self.connect()?;
        s.write_all(format!("SET {key} {}\n", value.len()).as_bytes())?;
        s.write_all(value)?;
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line)?;
        if line.trim() == "OK" {
            Ok(())
        } else {
            Err(RendezvousError::Protocol(line))
        }
    }

    /// Waits for `key` (up to the client's timeout) and returns its value.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, RendezvousError> {
        let mut s = self.connect()?;
        s.write_all(format!("GET {key} {}\n", self.timeout.as_millis()).as_bytes())?;
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line)?;
        match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["VAL", len] => {
                let mut buf = vec![0; len.parse().map_err(|_| RendezvousError::Protocol(line.clone()))?];
                r.read_exact(&mut buf)?;
                Ok(buf)
            }
            ["TIMEOUT"] => Err(RendezvousError::Timeout { rank: self.rank, key: key.into(), timeout_s: self.timeout.as_secs_f64() }),
            _ => Err(RendezvousError::Protocol(line)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_addr() -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    }

    #[test]
    fn values_cross_between_ranks_and_waits_time_out() {
        let addr = free_addr();
        serve(&addr).unwrap();
        let c0 = Client { addr: addr.clone(), rank: 0, timeout: Duration::from_secs(5) };
        let c1 = Client { addr: addr.clone(), rank: 1, timeout: Duration::from_secs(5) };
        let waiter = std::thread::spawn(move || c1.get("id").unwrap());
        std::thread::sleep(Duration::from_millis(100));
        c0.set("id", &[1, 2, 3, 0, 255]).unwrap();
        assert_eq!(waiter.join().unwrap(), vec![1, 2, 3, 0, 255]);
        let short = Client { addr, rank: 3, timeout: Duration::from_millis(200) };
        let e = short.get("never").unwrap_err().to_string();
        assert!(e.contains("rank 3 waited") && e.contains("`never`"), "{e}");
    }

    #[test]
    fn an_absent_rank_zero_is_reported() {
        let c = Client { addr: free_addr(), rank: 1, timeout: Duration::from_millis(300) };
        let e = c.get("x").unwrap_err().to_string();
        assert!(e.contains("could not reach the rendezvous") && e.contains("hint:"), "{e}");
    }
}
