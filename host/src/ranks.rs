//! The ranks of a multi-process run: where this process stands among them
//! (the launcher's variables), starting one process per local GPU, the
//! rendezvous store and NCCL communicator they share, and the watchdog that
//! ends a rank whose collectives hang.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use harness_format::error::EntryError;
use harness_runtime::comm::nccl::{unique_id, NcclComm, UniqueId};
use harness_runtime::comm::Link;

use crate::{device, rendezvous};
use harness_format::exit;

/// This process's place among ranks started by a launcher: torchrun's
/// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or
/// Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, with MASTER_ADDR and
/// MASTER_PORT set by the job script), and the run's rendezvous secret
/// ([`rendezvous::SECRET_VAR`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The run's secret and namespace; None when the secret is not set
    /// (a run that needs the rendezvous then refuses to start).
    pub auth: Option<rendezvous::Auth>,
    /// Whether the ranks run on more than one host (torchrun's
    /// LOCAL_WORLD_SIZE below WORLD_SIZE, or a Slurm step on several nodes).
    pub spans_hosts: bool,
}

impl RankEnv {
    /// Reads the launcher variables; None when this process was not started
    /// as one rank of several.
    pub fn from_env() -> anyhow::Result<Option<RankEnv>> {
        let var = |k: &str| std::env::var(k).ok();
        let (rank, world, local, slurm) = match (var("RANK"), var("WORLD_SIZE")) {
            (Some(r), Some(w)) => (r, w, var("LOCAL_RANK").unwrap_or_else(|| "0".into()), false),
            _ => match (var("SLURM_PROCID"), var("SLURM_NTASKS")) {
                (Some(r), Some(w)) => (r, w, var("SLURM_LOCALID").unwrap_or_else(|| "0".into()), true),
                _ => return Ok(None),
            },
        };
        let num = |name: &str, v: &str| v.trim().parse::<usize>().map_err(|_| anyhow::anyhow!("{name}={v:?} is not a number"));
        let master_addr = var("MASTER_ADDR").ok_or_else(|| anyhow::anyhow!("launched as rank {rank} but MASTER_ADDR is not set\nhint: export MASTER_ADDR (rank 0's host) and MASTER_PORT on every rank"))?;
        let port = var("MASTER_PORT").unwrap_or_else(|| "29500".into());
        let world = num("WORLD_SIZE", &world)?;
        // What the launcher calls this job, the same on every rank: two jobs
        // that reuse one secret still get two namespaces.
        let job = var("TORCHELASTIC_RUN_ID")
            .or_else(|| var("SLURM_JOB_ID").map(|j| format!("{j}.{}", var("SLURM_STEP_ID").unwrap_or_default())))
            .unwrap_or_default();
        let count = |k: &str| var(k).and_then(|v| v.trim().parse::<usize>().ok());
        let spans_hosts = if slurm {
            count("SLURM_STEP_NUM_NODES").or_else(|| count("SLURM_NNODES")).is_some_and(|n| n > 1)
        } else {
            count("LOCAL_WORLD_SIZE").is_some_and(|local| local < world)
        };
        Ok(Some(RankEnv {
            rank: num("RANK", &rank)?,
            world,
            local_rank: num("LOCAL_RANK", &local)?,
            master_addr,
            master_port: port.trim().parse().map_err(|_| anyhow::anyhow!("MASTER_PORT={port:?} is not a port"))?,
            auth: rendezvous::Secret::from_env()?.map(|s| rendezvous::Auth::new(s, &job)),
            spans_hosts,
        }))
    }

    /// The rendezvous store the ranks share: rank 0 serves it on the
    /// addresses of MASTER_ADDR at MASTER_PORT (never every interface),
    /// every rank (rank 0 included) is a client of MASTER_ADDR:MASTER_PORT,
    /// with the run's secret. Without the secret, the run does not start.
    pub fn rendezvous(&self, timeout: Duration) -> anyhow::Result<rendezvous::Client> {
        let auth = self.auth.clone().ok_or_else(|| {
            anyhow::anyhow!(
                "rank {} of {} has no rendezvous secret: {} is not set, and rank 0's store serves only the ranks that hold the run's secret\nhint: `harness run` sets one for the ranks it starts; under torchrun or srun export the same secret on every host before the launch, e.g. `export {}=$(openssl rand -hex 32)` in the job script (docs/cluster.md)",
                self.rank,
                self.world,
                rendezvous::SECRET_VAR,
                rendezvous::SECRET_VAR
            )
        })?;
        if self.rank == 0 {
            let addrs = rendezvous::bind_addrs(&self.master_addr, self.master_port, self.spans_hosts)?;
            rendezvous::serve(&addrs, &auth, rendezvous::Limits::for_world(self.world))?;
        }
        // An IPv6 address is written in brackets before its port.
        let host = if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]", self.master_addr)
        } else {
            self.master_addr.clone()
        };
        Ok(rendezvous::Client { addr: format!("{host}:{}", self.master_port), rank: self.rank, timeout, auth })
    }
}

/// The variable through which the launcher names the entries a rank
/// process runs (their ids, comma-separated).
pub const ENTRIES_VAR: &str = "HARNESS_ENTRIES";

/// Joins an NCCL communicator: rank 0 makes the unique id and publishes it
/// under `key` in the store, the others read it.
pub fn nccl_join(
    store: &rendezvous::Client,
    key: &str,
    rank: usize,
    world: usize,
    link: Option<Link>,
    device: tch::Device,
) -> anyhow::Result<NcclComm> {
    let id = if rank == 0 {
        let id = unique_id()?;
        store.set(key, &id.0.iter().map(|&b| b as u8).collect::<Vec<u8>>())?;
        id
    } else {
        let bytes = store.get(key)?;
        anyhow::ensure!(bytes.len() == 128, "the NCCL id from rank 0 has {} bytes, not 128", bytes.len());
        let mut id = UniqueId([0; 128]);
        for (d, s) in id.0.iter_mut().zip(&bytes) {
            *d = *s as std::ffi::c_char;
        }
        id
    };
    NcclComm::new(id, rank, world, link, device, harness_format::switches::get().sym_scatter)
}

/// Watches a rank's progress during a multi-GPU entry. Each rank publishes
/// its step to the rendezvous every two seconds and looks for an error that
/// another rank published (`fail/<entry>/<rank>`, see [`publish_failure`]).
/// The watchdog fires when a peer published its error (at once, with that
/// error, naming the rank) or when this rank's own steps stop for longer
/// than the collective timeout (a peer died or hangs, so an NCCL collective
/// never completes; the message names the ranks whose published step is
/// behind or missing). It hands the error to `on_fire` (which says why and,
/// on rank 0, records the failed entry) and ends the process with
/// [`exit::RANK_LOST`]: a CUDA context stuck in a collective cannot be
/// recovered in place (ncclCommAbort left it with an illegal-address error
/// on the H200s, and libtorch then aborted), which is also how PyTorch's
/// NCCL watchdog ends. `harness run`'s launcher then starts the ranks anew
/// for the entries left ([`crate::launch::launch_local_ranks`]).
pub struct Watchdog {
    state: Arc<WatchState>,
    thread: Option<JoinHandle<()>>,
}

struct WatchState {
    t0: Instant,
    step: AtomicU64,
    last_ms: AtomicU64,
    stop: AtomicBool,
}

/// The store key under which `rank` publishes why it failed `entry`.
fn fail_key(entry: &str, rank: usize) -> String {
    format!("fail/{entry}/{rank}")
}

/// Publishes this rank's own failure of `entry`, so that its peers, stuck in
/// a collective it will never enter, report this error instead of a stall.
pub fn publish_failure(store: &rendezvous::Client, entry: &str, rank: usize, e: &EntryError) {
    if let Ok(bytes) = serde_json::to_vec(e) {
        let _ = store.set(&fail_key(entry, rank), &bytes);
    }
}

/// The first error a rank other than `rank` published for `entry`, with its rank.
fn peer_failure(store: &rendezvous::Client, entry: &str, rank: usize, world: usize) -> Option<(usize, EntryError)> {
    let quick = rendezvous::Client { timeout: Duration::from_millis(1), ..store.clone() };
    (0..world).filter(|&r| r != rank).find_map(|r| {
        let bytes = quick.get(&fail_key(entry, r)).ok()?;
        Some((r, serde_json::from_slice::<EntryError>(&bytes).ok()?))
    })
}

impl Watchdog {
    /// Starts watching `rank` of `world` during `entry`.
    pub fn start(
        on_fire: Box<dyn FnOnce(&EntryError) + Send>,
        store: rendezvous::Client,
        entry: &str,
        rank: usize,
        world: usize,
    ) -> Watchdog {
        Self::start_with(
            on_fire,
            store,
            entry,
            rank,
            world,
            Box::new(|| {
                use std::io::Write;
                let _ = std::io::stdout().flush();
                let _ = std::io::stderr().flush();
                // SAFETY: ends the process at once: no exit handlers (the
                // plugin exit guard would call this a plugin's exit) and no
                // destructors of CUDA or NCCL state stuck in a collective.
                unsafe { libc::_exit(exit::RANK_LOST) }
            }),
        )
    }

    /// [`Watchdog::start`], ending with `end` instead of the process's exit (tests).
    fn start_with(
        on_fire: Box<dyn FnOnce(&EntryError) + Send>,
        store: rendezvous::Client,
        entry: &str,
        rank: usize,
        world: usize,
        end: Box<dyn FnOnce() + Send>,
    ) -> Watchdog {
        let state =
            Arc::new(WatchState { t0: Instant::now(), step: Default::default(), last_ms: Default::default(), stop: Default::default() });
        let (st, entry) = (state.clone(), entry.to_owned());
        let thread = std::thread::spawn(move || {
            let ms = || st.t0.elapsed().as_millis() as u64;
            let timeout_ms = store.timeout.as_millis() as u64;
            let beat_key = |r: usize| format!("beat/{entry}/{r}");
            let mut published = 0u64;
            let mut polled = 0u64;
            while !st.stop.load(SeqCst) {
                std::thread::sleep(Duration::from_millis(250));
                let now = ms();
                if now >= published + 2000 {
                    published = now;
                    // "step" or "step\twhere": a plugin call this rank has been in for over a second.
                    let mut beat = st.step.load(SeqCst).to_string();
                    if let Some((call, since)) = harness_sandbox::plugin::exit_guard::call_in_progress().filter(|(_, d)| d.as_secs() >= 1) {
                        beat.push_str(&format!("\tin {call} for {:.0} s", since.as_secs_f64()));
                    }
                    let _ = store.put(&beat_key(rank), beat.as_bytes());
                }
                let mut fired = None;
                if now >= polled + 1000 {
                    polled = now;
                    // A peer's own error, said of that rank ("rank 1: out of memory ...").
                    fired = peer_failure(&store, &entry, rank, world).map(|(r, e)| e.on_rank(r));
                }
                let idle = now.saturating_sub(st.last_ms.load(SeqCst));
                if fired.is_none() && idle > timeout_ms {
                    let mine = st.step.load(SeqCst);
                    let who = match harness_sandbox::plugin::exit_guard::call_in_progress() {
                        Some((call, since)) => {
                            format!("it has been in {call} for {:.0} s, without entering the collective", since.as_secs_f64())
                        }
                        None => format!("waiting in an NCCL collective: {}", lagging_ranks(&store, &beat_key, rank, world, mine)),
                    };
                    let message = format!("rank {rank}: no step finished for {:.0} s after step {mine}, {who}", idle as f64 / 1e3);
                    fired = Some(EntryError::RankLost { message });
                }
                if let Some(e) = fired {
                    if st.stop.load(SeqCst) {
                        return;
                    }
                    on_fire(&e);
                    end();
                    return;
                }
            }
        });
        Watchdog { state, thread: Some(thread) }
    }

    /// Records that a step finished.
    pub fn beat(&self, step: u64) {
        self.state.step.store(step, SeqCst);
        self.state.last_ms.store(self.state.t0.elapsed().as_millis() as u64, SeqCst);
    }

    /// Stops watching.
    pub fn stop(mut self) {
        self.state.stop.store(true, SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Which ranks a stalled rank is waiting for: those whose published step is
/// behind `mine` or missing, read from the store with a short timeout.
fn lagging_ranks(store: &rendezvous::Client, beat_key: &dyn Fn(usize) -> String, rank: usize, world: usize, mine: u64) -> String {
    let quick = rendezvous::Client { timeout: Duration::from_secs(2), ..store.clone() };
    let mut behind = Vec::new();
    let mut in_plugin = Vec::new();
    let mut unreachable = false;
    for r in (0..world).filter(|&r| r != rank) {
        match quick.get(&beat_key(r)) {
            Ok(v) => {
                let v = String::from_utf8_lossy(&v).into_owned();
                let (step, at) = v.split_once('\t').unwrap_or((&v, ""));
                if !at.is_empty() {
                    in_plugin.push(format!("rank {r} has been {at}, without entering the collective"));
                }
                if !step.parse::<u64>().is_ok_and(|s| s + 1 >= mine) {
                    behind.push(r);
                }
            }
            Err(rendezvous::RendezvousError::Timeout { .. }) => behind.push(r),
            Err(_) => unreachable = true,
        }
    }
    if unreachable {
        "rank 0 (which serves the rendezvous) is unreachable".to_owned()
    } else if !in_plugin.is_empty() {
        in_plugin.join("; ")
    } else if behind.is_empty() {
        "every rank published a recent step; a collective hangs".to_owned()
    } else {
        format!("rank(s) {behind:?} stopped making progress")
    }
}

/// NCCL's debug output of this rank process, from which the transports NCCL
/// chose are read (NCCL prints `"Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read"`
/// for every connection it makes).
#[derive(Debug, Clone)]
pub struct NcclLog {
    path: Option<PathBuf>,
    /// Why there is no output to read, when there is none.
    note: Option<String>,
}

impl NcclLog {
    /// Asks NCCL for its INIT and ENV output in a file next to the result
    /// (`<out stem>.nccl/rank<r>.<pid>.log`). NCCL reads these settings when
    /// a process first uses it, so this runs first thing in a rank process,
    /// before any thread starts. Settings exported by the user win: with
    /// their own NCCL_DEBUG_FILE, that file is read; with an NCCL_DEBUG
    /// below INFO, transports are not recorded.
    pub fn capture(out: &Path, rank: usize) -> NcclLog {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        match var("NCCL_DEBUG").map(|v| v.to_ascii_uppercase()) {
            Some(level) if level != "INFO" && level != "TRACE" => {
                return NcclLog {
                    path: None,
                    note: Some(format!("NCCL_DEBUG={level} was set before the run, so NCCL did not print its transports")),
                };
            }
            Some(_) => {}
            None => {
                std::env::set_var("NCCL_DEBUG", "INFO");
                if var("NCCL_DEBUG_SUBSYS").is_none() {
                    std::env::set_var("NCCL_DEBUG_SUBSYS", "INIT,ENV");
                }
            }
        }
        let pid = std::process::id().to_string();
        let path = match var("NCCL_DEBUG_FILE") {
            Some(p) => PathBuf::from(p.replace("%p", &pid).replace("%h", &device::hostname())),
            None => {
                let dir = out.with_extension("nccl");
                if let Err(e) = std::fs::create_dir_all(&dir) {
                    return NcclLog { path: None, note: Some(format!("cannot create {}: {e}", dir.display())) };
                }
                let p = dir.join(format!("rank{rank}.{pid}.log"));
                std::env::set_var("NCCL_DEBUG_FILE", &p);
                p
            }
        };
        NcclLog { path: Some(path), note: None }
    }

    /// Where the output is now: what an entry's NCCL prints comes after.
    pub fn mark(&self) -> u64 {
        self.path.as_ref().and_then(|p| std::fs::metadata(p).ok()).map_or(0, |m| m.len())
    }

    /// What NCCL printed since `mark`, as the entry's record: its version,
    /// the NCCL_* settings in this process's environment, the transports.
    pub fn record(&self, mark: u64, nccl_version: Option<String>) -> harness_format::results::NcclRecord {
        // NCCL_VERSION is not a setting: container images export it as
        // the version of their NCCL package, which may not be the one loaded.
        let settings = std::env::vars()
            .filter(|(k, _)| k.starts_with("NCCL_") && k != "NCCL_VERSION" && !harness_format::suite::NCCL_RESERVED.contains(&k.as_str()))
            .collect();
        let text = self.path.as_ref().and_then(|p| read_from(p, mark).ok());
        let transports = text.as_deref().map(parse_nccl_output).unwrap_or_default().1;
        // NCCL prints its version once, at the process's first communicator.
        let version = self.path.as_ref().and_then(|p| read_from(p, 0).ok()).and_then(|t| parse_nccl_output(&t).0);
        let note = match (&self.note, &text) {
            (Some(n), _) => Some(n.clone()),
            (None, None) => Some("NCCL's debug output could not be read".to_owned()),
            (None, Some(_)) if transports.is_empty() => Some("NCCL printed no connections for this entry".to_owned()),
            _ => None,
        };
        harness_format::results::NcclRecord { version: version.or(nccl_version), settings, transports, note }
    }
}

/// The bytes of `path` from `offset` on, as text.
fn read_from(path: &Path, offset: u64) -> std::io::Result<String> {
    use std::io::{Read, Seek};
    let mut f = std::fs::File::open(path)?;
    f.seek(std::io::SeekFrom::Start(offset))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// NCCL's version ("NCCL version 2.27.3+cuda12.9") and the distinct
/// transports of its connection lines ("... via P2P/CUMEM/read"), in the
/// order first seen.
pub fn parse_nccl_output(text: &str) -> (Option<String>, Vec<String>) {
    let mut version = None;
    let mut transports: Vec<String> = Vec::new();
    for line in text.lines() {
        if let Some(v) = line.split("NCCL version ").nth(1) {
            version.get_or_insert_with(|| v.split_whitespace().next().unwrap_or("").to_owned());
        }
        if !line.contains("Channel") {
            continue;
        }
        if let Some(t) = line.split(" via ").nth(1).and_then(|rest| rest.split_whitespace().next()) {
            let t = t.trim_end_matches([',', '.']).to_owned();
            if !t.is_empty() && !transports.contains(&t) {
                transports.push(t);
            }
        }
    }
    (version, transports)
}

/// Why this entry cannot run in this process: its strategy's NCCL settings
/// differ from the ones NCCL read when the process started. `harness run`
/// starts processes with each strategy's settings; under torchrun or srun,
/// export them before the launch.
pub fn nccl_settings_mismatch(want: &std::collections::BTreeMap<String, String>) -> Option<String> {
    let wrong: Vec<String> = want
        .iter()
        .filter(|(k, v)| std::env::var(k).ok().as_ref() != Some(*v))
        .map(|(k, v)| format!("{k}={v} (the process has {})", std::env::var(k).map_or("it unset".into(), |x| format!("{k}={x}"))))
        .collect();
    (!wrong.is_empty()).then(|| {
        format!(
            "this entry's strategy sets {}, but NCCL reads its settings once per process\nhint: start the run with `harness run` (which starts the ranks with each strategy's settings), or export these settings before torchrun/srun and run such strategies separately",
            wrong.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transports_and_version_come_from_nccls_connection_lines() {
        let text = "host:1:1 [0] NCCL INFO NCCL version 2.27.3+cuda12.9\n\
            host:1:9 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n\
            host:1:9 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n\
            host:1:9 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [receive] via NET/Socket/0\n\
            host:1:9 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0\n\
            host:1:9 [0] NCCL INFO NCCL_P2P_DISABLE set by environment to 1.\n";
        let (v, t) = parse_nccl_output(text);
        assert_eq!(v.as_deref(), Some("2.27.3+cuda12.9"));
        assert_eq!(t, ["P2P/CUMEM/read", "NET/Socket/0"]);
        assert_eq!(parse_nccl_output("nothing here"), (None, vec![]));
    }

    /// Rank 0's client of a store served on a free local port, with a
    /// collective timeout of `timeout`.
    fn local_store(timeout: Duration) -> rendezvous::Client {
        let auth = rendezvous::Auth::new(rendezvous::Secret::generate(), "");
        let server = rendezvous::serve(&["127.0.0.1:0".parse().unwrap()], &auth, rendezvous::Limits::for_world(2)).unwrap();
        rendezvous::Client { addr: server.addrs()[0].to_string(), rank: 0, timeout, auth }
    }

    #[test]
    fn a_failure_forged_without_the_secret_is_not_a_peers() {
        use std::io::{Read, Write};
        let store = local_store(Duration::from_secs(60));
        let forged = serde_json::to_vec(&EntryError::OutOfMemory { message: "forged".into() }).unwrap();
        // The tester's rogue client: `fail/<entry>/0` in the run's namespace
        // (its id is in the greeting), without the secret.
        let mut rogue = std::net::TcpStream::connect(&store.addr).unwrap();
        let mut req = format!("SET {}/fail/w/s/r0/0 {}\n", store.auth.run(), forged.len()).into_bytes();
        req.extend(&forged);
        rogue.write_all(&req).unwrap();
        let mut answer = String::new();
        let _ = rogue.read_to_string(&mut answer);
        assert!(answer.contains("DENIED authenticate first"), "{answer}");
        assert_eq!(peer_failure(&rendezvous::Client { rank: 1, ..store.clone() }, "w/s/r0", 1, 2), None);
        // Another run's rank, with its own secret, fares no better.
        let stranger = rendezvous::Client { auth: rendezvous::Auth::new(rendezvous::Secret::generate(), ""), ..store.clone() };
        assert!(stranger.set("fail/w/s/r0/0", &forged).is_err());
        assert_eq!(peer_failure(&rendezvous::Client { rank: 1, ..store.clone() }, "w/s/r0", 1, 2), None);
        // The real rank 0's failure is seen.
        publish_failure(&store, "w/s/r0", 0, &EntryError::OutOfMemory { message: "real".into() });
        let seen = peer_failure(&rendezvous::Client { rank: 1, ..store }, "w/s/r0", 1, 2);
        assert_eq!(seen, Some((0, EntryError::OutOfMemory { message: "real".into() })));
    }

    #[test]
    fn a_run_that_needs_the_store_refuses_to_start_without_the_secret() {
        let env = RankEnv {
            rank: 1,
            world: 2,
            local_rank: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            auth: None,
            spans_hosts: false,
        };
        let e = env.rendezvous(Duration::from_secs(1)).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 of 2 has no rendezvous secret: HARNESS_RDZV_SECRET is not set") && e.contains("openssl rand -hex 32"),
            "{e}"
        );
    }

    #[test]
    fn a_peers_published_error_fires_the_watchdog_at_once_naming_the_rank() {
        // A long collective timeout: only the peer's error can fire it soon.
        let store = local_store(Duration::from_secs(60));
        let (tx, rx) = std::sync::mpsc::channel();
        let (tx2, ended) = std::sync::mpsc::channel();
        let t0 = Instant::now();
        let dog = Watchdog::start_with(
            Box::new(move |e: &EntryError| tx.send(e.clone()).unwrap()),
            store.clone(),
            "w/s/r0",
            0,
            2,
            Box::new(move || tx2.send(()).unwrap()),
        );
        let oom = EntryError::OutOfMemory { message: "CUDA out of memory".into() };
        publish_failure(&rendezvous::Client { rank: 1, ..store }, "w/s/r0", 1, &oom);
        let got = rx.recv_timeout(Duration::from_secs(10)).expect("the watchdog fired");
        ended.recv_timeout(Duration::from_secs(1)).expect("and ended the rank");
        assert!(t0.elapsed() < Duration::from_secs(5), "fired after {:?}", t0.elapsed());
        assert_eq!(got, EntryError::OutOfMemory { message: "rank 1: CUDA out of memory".into() });
        dog.stop();
    }

    #[test]
    fn a_stalled_rank_names_the_rank_behind_after_the_timeout() {
        let store = local_store(Duration::from_millis(1500));
        let (tx, rx) = std::sync::mpsc::channel();
        let dog = Watchdog::start_with(
            Box::new(move |e: &EntryError| tx.send(e.clone()).unwrap()),
            store.clone(),
            "w/s/r0",
            0,
            2,
            Box::new(|| {}),
        );
        dog.beat(3);
        let got = rx.recv_timeout(Duration::from_secs(10)).expect("the watchdog fired");
        assert_eq!(got.kind(), "rank-lost");
        assert!(got.message().contains("after step 3") && got.message().contains("rank(s) [1] stopped making progress"), "{got}");
        dog.stop();
        // A peer stuck in a plugin call says so in its beat.
        let (tx, rx) = std::sync::mpsc::channel();
        store.set("beat/w/s/r1/1", b"0\tin compressor plugin `bad`'s `compress` for 14 s").unwrap();
        let dog = Watchdog::start_with(Box::new(move |e: &EntryError| tx.send(e.clone()).unwrap()), store, "w/s/r1", 0, 2, Box::new(|| {}));
        let got = rx.recv_timeout(Duration::from_secs(10)).expect("the watchdog fired");
        assert!(
            got.message().contains("rank 1 has been in compressor plugin `bad`'s `compress` for 14 s, without entering the collective"),
            "{got}"
        );
        dog.stop();
    }

    #[test]
    fn an_entry_whose_nccl_settings_the_process_lacks_is_refused_with_a_hint() {
        let want = [("NCCL_HARNESS_TEST_UNSET".to_owned(), "1".to_owned())].into_iter().collect();
        let e = nccl_settings_mismatch(&want).unwrap();
        assert!(e.contains("NCCL_HARNESS_TEST_UNSET=1 (the process has it unset)") && e.contains("hint:"), "{e}");
        assert_eq!(nccl_settings_mismatch(&Default::default()), None);
    }
}
