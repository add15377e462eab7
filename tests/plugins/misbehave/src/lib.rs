//! A compressor that misbehaves on purpose, for the host's sandbox and
//! error-handling tests. Config:
//!
//! - `mode`: `ok` (behaves like `allreduce`), `trap` (a WASM trap; natively a
//!   panic, since aborting would take the host down), `panic`, `loop` (spins
//!   forever without host calls; natively nothing can interrupt it, so use it
//!   with the WASM build), `alloc` (grows a `Vec` without bound,
//!   touching every page; natively that exhausts the host process's memory,
//!   so use it with the WASM build), `nan` (leaves NaN in the bucket),
//!   `nan-first` (averages as `allreduce`, then leaves NaN in the bucket's
//!   first element only),
//!   `wrong-shape` (assigns a tensor of another shape to the bucket),
//!   `reject` (configure fails), `hang` (sleeps for an hour without entering
//!   the collective; natively only), `kill` (kills its own process with
//!   SIGKILL, as the kernel's out-of-memory killer would; natively only);
//! - `at`: `compress` (default) or `configure`: where `trap`, `panic`,
//!   `loop` and `alloc` happen. `nan`, `nan-first`, `wrong-shape`, `hang`
//!   and `kill` happen in `compress`;
//! - `rank`: the one rank that misbehaves (default: every rank); the others
//!   behave like `allreduce`.

use harness_sdk::{tensor, BucketInfo, Collective, Compressor, Config, Error, Plugin, Tensor};

const MODES: [&str; 11] = ["ok", "trap", "panic", "loop", "alloc", "nan", "nan-first", "wrong-shape", "reject", "hang", "kill"];

/// See the crate docs.
pub struct Misbehave {
    mode: String,
    rank: Option<u32>,
}

impl Plugin for Misbehave {
    const NAME: &'static str = "misbehave";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["mode", "at", "rank"])?;
        let rank = config.get::<i64>("rank")?.map(|r| r as u32);
        let mode = config.get_or("mode", "ok".to_owned())?;
        if !MODES.contains(&mode.as_str()) {
            return Err(Error::new(format!("unknown mode `{mode}` (modes: {})", MODES.join(", "))));
        }
        if mode == "reject" {
            return Err(Error::new("mode `reject`: this plugin rejects its config on purpose"));
        }
        match config.get_or("at", "compress".to_owned())?.as_str() {
            "compress" => {}
            "configure" => misbehave(&mode),
            other => return Err(Error::new(format!("unknown `at` = `{other}` (configure, compress)"))),
        }
        Ok(Misbehave { mode, rank })
    }
}

/// The misbehaviours that need no bucket; returns for the others.
fn misbehave(mode: &str) {
    match mode {
        "trap" => trap(),
        "panic" => panic!("mode `panic`: this plugin panics on purpose"),
        "loop" => {
            let mut i = 0u64;
            loop {
                i = std::hint::black_box(i.wrapping_add(1));
            }
        }
        "alloc" => {
            let mut hoard: Vec<Vec<u8>> = Vec::new();
            loop {
                let mut chunk = vec![0u8; 1 << 20];
                for byte in chunk.iter_mut().step_by(4096) {
                    *byte = 1;
                }
                hoard.push(std::hint::black_box(chunk));
            }
        }
        _ => {}
    }
}

/// SIGKILL to this process (natively; a component cannot).
fn kill_self() {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = std::process::Command::new("kill").args(["-9", &std::process::id().to_string()]).status();
        std::thread::sleep(std::time::Duration::from_secs(60));
    }
}

#[cfg(target_arch = "wasm32")]
fn trap() -> ! {
    core::arch::wasm32::unreachable()
}

#[cfg(not(target_arch = "wasm32"))]
fn trap() -> ! {
    panic!("mode `trap`: this plugin traps on purpose (a panic natively)")
}

impl Compressor for Misbehave {
    fn compress(&mut self, bucket: &Tensor, comm: &Collective, _info: BucketInfo) -> Result<(), Error> {
        let mode = if self.rank.is_none_or(|r| r == comm.rank()) { self.mode.as_str() } else { "ok" };
        misbehave(mode);
        match mode {
            "hang" => std::thread::sleep(std::time::Duration::from_secs(3600)),
            "kill" => kill_self(),
            "nan" => bucket.assign(&bucket.mul_scalar(f64::NAN)),
            "wrong-shape" => bucket.assign(&tensor::zeros(&[bucket.numel() + 1], bucket.dtype(), bucket)),
            "nan-first" => {
                average(bucket, comm);
                let mut poison = vec![0f32; bucket.numel() as usize];
                poison[0] = f32::NAN;
                bucket.assign(&bucket.add(&tensor::from_f32(&poison, &bucket.shape(), bucket)));
            }
            _ => average(bucket, comm),
        }
        Ok(())
    }
}

/// What `allreduce` does: the bucket summed over the ranks, then divided by them.
fn average(bucket: &Tensor, comm: &Collective) {
    comm.all_reduce_sum(bucket);
    let world = comm.world_size();
    if world > 1 {
        bucket.assign(&bucket.mul_scalar(1.0 / f64::from(world)));
    }
}

harness_sdk::export!(Misbehave as compressor);
