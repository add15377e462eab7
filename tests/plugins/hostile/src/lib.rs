//! A compressor that attacks the sandbox, written against the public
//! contract only, for the host's tests of the guarantees in
//! docs/plugin-sdk.md ("What the sandbox guarantees"). It averages the
//! bucket like `allreduce` and, depending on `mode`, first:
//!
//! - `sleep`: sleeps for an hour through WASI (a blocking clock `poll`);
//! - `huge-zeros`: asks for a 16 GiB tensor in one host op;
//! - `broadcast`: adds a 100,000 x 1 and a 1 x 100,000 tensor (40 GB of
//!   output from 800 KB of inputs);
//! - `slow-matmul`: multiplies two 3,500 x 3,500 f16 matrices (86 GFLOP in
//!   49 MB: seconds on any CPU, refused on the estimate alone);
//! - `hoard-views`: keeps a one-element view of a new 16 MiB tensor, and
//!   of a random permutation of 4 M indices, every call;
//! - `mismatch`: rank 0 all-reduces while rank 1 all-gathers;
//! - `mismatch-broadcast`: rank 0 all-reduces while rank 1 broadcasts;
//! - `diverge`: adds its rank to the averaged bucket (replicas drift);
//! - `log-flood`: logs 200,000 lines, one 8 MiB line and lines with ANSI
//!   escapes and newlines that imitate harness's own output;
//! - `stderr-then-panic`: writes 1 MiB to stderr, then panics;
//! - `exit`: calls `exit(0)` (meant for the native build: the host
//!   process ends);
//! - `_exit`: calls `_exit(0)` (no exit handlers run);
//! - `exit_group`: ends the process with the `exit_group(0)` system call;
//! - `thread-exit`: starts a thread that calls `exit(0)` a moment later,
//!   while the host trains on (the native build; elsewhere like `exit`);
//! - `segv-at-exit`: leaves an exit handler behind that kills the process
//!   with SIGSEGV once the host has finished its run and exits (the native
//!   build on Linux; elsewhere like `ok`).
//!
//! `at = "configure"` moves `sleep` into `configure`.

use harness_sdk::{log, tensor, BucketInfo, Collective, Compressor, Config, Dtype, Error, Plugin, Tensor};

const MODES: [&str; 17] = [
    "ok",
    "sleep",
    "huge-zeros",
    "broadcast",
    "slow-matmul",
    "hoard-views",
    "mismatch",
    "mismatch-broadcast",
    "diverge",
    "log-flood",
    "stderr-then-panic",
    "exit",
    "_exit",
    "exit_group",
    "thread-exit",
    "segv-at-exit",
    "none",
];

/// Ends the process at once: `_exit(0)`, or the `exit_group(0)` system call
/// (on Linux; elsewhere `exit(0)`).
fn end_now(group: bool) -> ! {
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            fn _exit(code: i32) -> !;
            fn syscall(n: i64, ...) -> i64;
        }
        #[cfg(target_arch = "x86_64")]
        const EXIT_GROUP: i64 = 231;
        #[cfg(target_arch = "aarch64")]
        const EXIT_GROUP: i64 = 94;
        // SAFETY: both end the process; nothing after them runs.
        unsafe {
            if group {
                syscall(EXIT_GROUP, 0i64);
            }
            _exit(0)
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = group;
        std::process::exit(0)
    }
}

/// Registers, once, an exit handler that raises SIGSEGV, and keeps this
/// library loaded until the process ends (the host unloads it after the
/// run, and glibc would run the handler then), so that the process dies
/// after the host has returned its exit code.
#[cfg(target_os = "linux")]
fn segv_at_exit() {
    use std::ffi::{c_char, c_int, c_void};
    #[repr(C)]
    struct DlInfo {
        fname: *const c_char,
        fbase: *mut c_void,
        sname: *const c_char,
        saddr: *mut c_void,
    }
    extern "C" {
        fn dladdr(addr: *const c_void, info: *mut DlInfo) -> c_int;
        fn dlopen(file: *const c_char, mode: c_int) -> *mut c_void;
        fn atexit(f: extern "C" fn()) -> c_int;
        fn signal(sig: c_int, handler: usize) -> usize;
        fn raise(sig: c_int) -> c_int;
    }
    const RTLD_NOW: c_int = 2;
    const RTLD_NOLOAD: c_int = 4;
    const RTLD_NODELETE: c_int = 0x1000;
    const SIGSEGV: c_int = 11;
    const SIG_DFL: usize = 0;
    extern "C" fn segv() {
        // SAFETY: the default action first (Rust's runtime handles SIGSEGV
        // to detect stack overflows, and returns from a raised one), then
        // the signal, which ends the process.
        unsafe {
            signal(SIGSEGV, SIG_DFL);
            raise(SIGSEGV);
        }
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut info =
            DlInfo { fname: std::ptr::null(), fbase: std::ptr::null_mut(), sname: std::ptr::null(), saddr: std::ptr::null_mut() };
        // SAFETY: dladdr fills `info` for an address of this library (the
        // handler's); dlopen with RTLD_NOLOAD only marks the library, which
        // is loaded, as never to be unloaded; atexit stores the handler,
        // which then lives as long as the process.
        unsafe {
            if dladdr(segv as *const c_void, &mut info) != 0 && !info.fname.is_null() {
                dlopen(info.fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
            }
            atexit(segv);
        }
    });
}

#[cfg(not(target_os = "linux"))]
fn segv_at_exit() {}

/// See the crate docs.
pub struct Hostile {
    mode: String,
    hoard: Vec<Tensor>,
}

fn sleep_an_hour() {
    std::thread::sleep(std::time::Duration::from_secs(3600));
}

impl Plugin for Hostile {
    const NAME: &'static str = "hostile";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["mode", "at"])?;
        let mode = config.get_or("mode", "ok".to_owned())?;
        if !MODES.contains(&mode.as_str()) {
            return Err(Error::new(format!("unknown mode `{mode}` (modes: {})", MODES.join(", "))));
        }
        if config.get_or("at", "compress".to_owned())? == "configure" && mode == "sleep" {
            sleep_an_hour();
        }
        Ok(Hostile { mode, hoard: Vec::new() })
    }
}

impl Compressor for Hostile {
    fn compress(&mut self, bucket: &Tensor, comm: &Collective, _info: BucketInfo) -> Result<(), Error> {
        let rank = comm.rank();
        match self.mode.as_str() {
            "sleep" => sleep_an_hour(),
            "huge-zeros" => drop(tensor::zeros(&[1 << 32], Dtype::F32, bucket)),
            "broadcast" => {
                let a = tensor::zeros(&[100_000, 1], Dtype::F32, bucket);
                let b = tensor::zeros(&[1, 100_000], Dtype::F32, bucket);
                drop(a.add(&b));
            }
            "slow-matmul" => {
                let a = tensor::zeros(&[3500, 3500], Dtype::F16, bucket);
                drop(a.matmul(&a));
            }
            "hoard-views" => {
                let big = tensor::zeros(&[4 << 20], Dtype::F32, bucket);
                self.hoard.push(big.narrow(0, 0, 1));
                self.hoard.push(tensor::rand_indices(4 << 20, 1, 7, bucket));
            }
            "mismatch" if rank == 1 => drop(comm.all_gather(bucket)),
            "mismatch-broadcast" if rank == 1 => comm.broadcast(bucket, 0),
            "log-flood" => {
                for i in 0..200_000 {
                    log::info(&format!("flood line {i}"));
                }
                log::warn(&"x".repeat(8 << 20));
                log::warn("\n\u{1b}[2K[harness] entry mlp/first/r0: ok (forged)\r");
            }
            "stderr-then-panic" => {
                let line = "y".repeat(1023);
                for _ in 0..1024 {
                    eprintln!("{line}");
                }
                panic!("the panic message after 1 MiB of stderr");
            }
            "exit" => std::process::exit(0),
            "_exit" => end_now(false),
            "exit_group" => end_now(true),
            "thread-exit" if cfg!(target_os = "wasi") => std::process::exit(0),
            "thread-exit" => drop(std::thread::spawn(|| {
                std::thread::sleep(std::time::Duration::from_millis(50));
                std::process::exit(0)
            })),
            "segv-at-exit" => segv_at_exit(),
            _ => {}
        }
        if self.mode != "none" && !(self.mode.starts_with("mismatch") && rank == 1) {
            comm.all_reduce_sum(bucket);
            let world = comm.world_size();
            if world > 1 {
                bucket.assign(&bucket.mul_scalar(1.0 / f64::from(world)));
            }
        }
        if self.mode == "diverge" && rank == 1 {
            bucket.assign(&bucket.add_scalar(1.0));
        }
        Ok(())
    }
}

harness_sdk::export!(Hostile as compressor);
