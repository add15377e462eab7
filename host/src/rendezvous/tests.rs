use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Instant;

use super::auth::nonce;
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
