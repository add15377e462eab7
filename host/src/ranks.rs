//! The ranks of a multi-process run: where this process stands among them
//! (the launcher's variables), starting one process per local GPU, the
//! rendezvous store and NCCL communicator they share, and the watchdog that
//! ends a rank whose collectives hang.

use std::ffi::OsString;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::comm::nccl::{unique_id, NcclComm, UniqueId};
use crate::comm::Link;
use crate::{device, exit, rendezvous};

/// This process's place among ranks started by a launcher: torchrun's
/// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or
/// Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, with MASTER_ADDR and
/// MASTER_PORT set by the job script).
#[derive(Debug, Clone, PartialEq)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
}

impl RankEnv {
    /// Reads the launcher variables; None when this process was not started
    /// as one rank of several.
    pub fn from_env() -> anyhow::Result<Option<RankEnv>> {
        let var = |k: &str| std::env::var(k).ok();
        let (rank, world, local) = match (var("RANK"), var("WORLD_SIZE")) {
            (Some(r), Some(w)) => (r, w, var("LOCAL_RANK").unwrap_or_else(|| "0".into())),
            _ => match (var("SLURM_PROCID"), var("SLURM_NTASKS")) {
                (Some(r), Some(w)) => (r, w, var("SLURM_LOCALID").unwrap_or_else(|| "0".into())),
                _ => return Ok(None),
            },
        };
        let num = |name: &str, v: &str| v.trim().parse::<usize>().map_err(|_| anyhow::anyhow!("{name}={v:?} is not a number"));
        let master_addr = var("MASTER_ADDR").ok_or_else(|| anyhow::anyhow!("launched as rank {rank} but MASTER_ADDR is not set\nhint: export MASTER_ADDR (rank 0's host) and MASTER_PORT on every rank"))?;
        let port = var("MASTER_PORT").unwrap_or_else(|| "29500".into());
        Ok(Some(RankEnv {
            rank: num("RANK", &rank)?,
            world: num("WORLD_SIZE", &world)?,
            local_rank: num("LOCAL_RANK", &local)?,
            master_addr,
            master_port: port.trim().parse().map_err(|_| anyhow::anyhow!("MASTER_PORT={port:?} is not a port"))?,
        }))
    }

    /// The rendezvous store the ranks share: rank 0 serves it on
    /// MASTER_PORT, every rank (rank 0 included) is a client of
    /// MASTER_ADDR:MASTER_PORT.
    pub fn rendezvous(&self, timeout: Duration) -> anyhow::Result<rendezvous::Client> {
        if self.rank == 0 {
            rendezvous::serve(&format!("0.0.0.0:{}", self.master_port))?;
        }
        Ok(rendezvous::Client { addr: format!("{}:{}", self.master_addr, self.master_port), rank: self.rank, timeout })
    }
}

/// Starts one process per local GPU, each a rank of `world` with torchrun's
/// variables, and waits for all; rank 0 writes the result file. Returns the
/// exit code of the first rank that failed (or 0).
pub fn launch_local_ranks(world: usize, args: &[OsString]) -> anyhow::Result<i32> {
    let gpus = device::gpu_count();
    anyhow::ensure!(gpus >= world, "the suite asks for world_size = {world} but this machine has {gpus} usable GPU(s)\nhint: lower world_size, or start ranks on several hosts with torchrun or srun");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for r in 0..world {
        let mut c = std::process::Command::new(&exe);
        c.args(args)
            .env("RANK", r.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string());
        if r > 0 {
            c.stdout(std::process::Stdio::null());
        }
        children.push(c.spawn()?);
    }
    let mut code = 0;
    for mut ch in children {
        let status = ch.wait()?;
        if code == 0 && !status.success() {
            code = status.code().unwrap_or(exit::ERROR);
        }
    }
    Ok(code)
}

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
    NcclComm::new(id, rank, world, link, device)
}

/// Watches a rank's progress during a multi-GPU entry. Each rank publishes
/// its step to the rendezvous every two seconds; when a rank's own steps stop
/// for longer than the collective timeout (a peer died or hangs, so an NCCL
/// collective never completes), the watchdog names the ranks whose published
/// step is behind or missing, hands that message to `on_fire` (which says
/// why and, on rank 0, records the failed entry) and ends the process: a CUDA
/// context stuck in a collective cannot be recovered in place
/// (ncclCommAbort left it with an illegal-address error on the H200s, and
/// libtorch then aborted), which is also how PyTorch's NCCL watchdog ends.
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

impl Watchdog {
    /// Starts watching `rank` of `world` during `entry`.
    pub fn start(on_fire: Box<dyn FnOnce(&str) + Send>, store: rendezvous::Client, entry: &str, rank: usize, world: usize) -> Watchdog {
        let state =
            Arc::new(WatchState { t0: Instant::now(), step: Default::default(), last_ms: Default::default(), stop: Default::default() });
        let (st, entry) = (state.clone(), entry.to_owned());
        let thread = std::thread::spawn(move || {
            let ms = || st.t0.elapsed().as_millis() as u64;
            let timeout_ms = store.timeout.as_millis() as u64;
            let beat_key = |r: usize| format!("beat/{entry}/{r}");
            let mut published = 0u64;
            while !st.stop.load(SeqCst) {
                std::thread::sleep(Duration::from_millis(250));
                let now = ms();
                if now >= published + 2000 {
                    published = now;
                    let _ = store.set(&beat_key(rank), st.step.load(SeqCst).to_string().as_bytes());
                }
                let idle = now.saturating_sub(st.last_ms.load(SeqCst));
                if idle > timeout_ms {
                    let mine = st.step.load(SeqCst);
                    let who = lagging_ranks(&store, &beat_key, rank, world, mine);
                    let msg = format!(
                        "rank {rank}: no step finished for {:.0} s after step {mine}, waiting in an NCCL collective: {who}",
                        idle as f64 / 1e3
                    );
                    on_fire(&msg);
                    std::process::exit(exit::ERROR);
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
    let mut unreachable = false;
    for r in (0..world).filter(|&r| r != rank) {
        match quick.get(&beat_key(r)) {
            Ok(v) if String::from_utf8_lossy(&v).parse::<u64>().is_ok_and(|s| s + 1 >= mine) => {}
            Ok(_) | Err(rendezvous::RendezvousError::Timeout { .. }) => behind.push(r),
            Err(_) => unreachable = true,
        }
    }
    if unreachable {
        "rank 0 (which serves the rendezvous) is unreachable".to_owned()
    } else if behind.is_empty() {
        "every rank published a recent step; a collective hangs".to_owned()
    } else {
        format!("rank(s) {behind:?} stopped making progress")
    }
}
