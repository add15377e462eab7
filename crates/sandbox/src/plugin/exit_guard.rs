//! A native plugin is code in our process: it can call `exit(0)`, and the
//! run would end with status 0 and no message, so an incomplete run would
//! look successful. While a run is in progress ([`arm`]), an `atexit`
//! handler turns any exit into status [`PLUGIN_ENDED_PROCESS`], naming the
//! plugin and the call it was in (`exit` runs the handlers on the thread
//! that called it, whose current plugin call is recorded in [`CallScope`]).
//! The result file, rewritten after every finished entry, then stays
//! `complete: false`.
//!
//! `_exit`, the `exit_group` system call, or `exit` racing the process's
//! own threads bypass or outrun that handler, so `harness run` supervises:
//! it runs the suite in a child process given a [`Mark`], a page of shared
//! memory (the file [`MARK_VAR`] names) where the child records the native
//! plugin call in progress (or the library being loaded), the last one, and
//! whether it returned its exit code itself ([`finished`]). A child that
//! ended any other way ended by a plugin (or crashed): the parent says
//! which plugin and exits with [`PLUGIN_ENDED_PROCESS`].

use std::cell::Cell;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

pub use harness_format::exit::PLUGIN_ENDED_PROCESS;

static ARMED: AtomicBool = AtomicBool::new(false);

/// A plugin call in progress: the plugin's description (owned by the
/// plugin, alive for the call) and the call's name.
type Current = Option<(*const String, &'static str)>;

thread_local! {
    /// The plugin call in progress on this thread (two stores a call: no
    /// allocation on the hook path).
    static CURRENT: Cell<Current> = const { Cell::new(None) };
}

/// Arms (`true`, before the first entry) or disarms (after the last) the
/// guard; the first call registers the handler.
pub fn arm(on: bool) {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // SAFETY: `on_exit` is an `extern "C" fn()` that lives for the
        // whole program; atexit only stores the pointer.
        unsafe { libc::atexit(on_exit) };
    });
    ARMED.store(on, Ordering::SeqCst);
}

/// Registers the handler once more, so that it runs before the exit
/// handlers of a library loaded since (handlers run last registered first).
pub fn register_again() {
    // SAFETY: as in `arm`.
    unsafe { libc::atexit(on_exit) };
}

/// The latest plugin call of the process, for the watchdog of a rank
/// process (one training thread): the plugin's description, the call's name
/// (pointer and length) and when it started, in ns since [`epoch`]. Written
/// by the training thread at each call; read only after the rank has made
/// no progress for seconds, when nothing writes them.
static LAST_PLUGIN: AtomicPtr<String> = AtomicPtr::new(std::ptr::null_mut());
static LAST_CALL: (AtomicPtr<u8>, AtomicUsize) = (AtomicPtr::new(std::ptr::null_mut()), AtomicUsize::new(0));
static LAST_START_NS: AtomicU64 = AtomicU64::new(0);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Marks a plugin call in progress on this thread until dropped.
pub struct CallScope(());

impl CallScope {
    /// `plugin` must outlive the scope (the plugin's own description).
    pub fn enter(plugin: &String, call: &'static str) -> CallScope {
        CURRENT.with(|c| c.set(Some((plugin as *const String, call))));
        LAST_START_NS.store(epoch().elapsed().as_nanos() as u64, Ordering::Relaxed);
        LAST_CALL.0.store(call.as_ptr() as *mut u8, Ordering::Relaxed);
        LAST_CALL.1.store(call.len(), Ordering::Relaxed);
        LAST_PLUGIN.store(plugin as *const String as *mut String, Ordering::Release);
        if let Some(m) = own_mark() {
            m.enter(plugin, call);
        }
        CallScope(())
    }

    /// Marks the loading of the native library `path` (its constructors
    /// run then), until dropped.
    pub fn loading(path: &Path) -> Option<CallScope> {
        let m = own_mark()?;
        m.enter(&format!("the native library {}", path.display()), "load");
        Some(CallScope(()))
    }
}

impl Drop for CallScope {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(None));
        LAST_PLUGIN.store(std::ptr::null_mut(), Ordering::Release);
        if let Some(m) = own_mark() {
            m.in_call.store(0, Ordering::Release);
        }
    }
}

/// The environment variable that names a supervised process's mark file.
pub const MARK_VAR: &str = "HARNESS_EXIT_MARK";

/// The size of a mark file: one page.
pub const MARK_BYTES: u64 = 4096;

const FINISHED: u32 = 0x4649_4e31;
const WHO: usize = 3072;
const CALL: usize = 64;

/// What a supervised process records for its parent, in a page of memory
/// shared with it (all atomics: thread ranks may call plugins at once).
#[repr(C)]
pub struct Mark {
    /// [`FINISHED`] once the process returns its exit code itself.
    finished: AtomicU32,
    code: AtomicI32,
    /// 1 while a native plugin call (or a load) is in progress.
    in_call: AtomicU32,
    /// 1 when `exit` ran the guard's handler during a run.
    by_exit: AtomicU32,
    who_len: AtomicU32,
    call_len: AtomicU32,
    who: [AtomicU8; WHO],
    call: [AtomicU8; CALL],
}

const _: () = assert!(std::mem::size_of::<Mark>() as u64 <= MARK_BYTES);

/// How a supervised process ended, as its mark says.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// The exit code it returned itself, if it finished.
    pub finished: Option<i32>,
    /// The last native plugin call (plugin, call) and whether it was still
    /// in progress.
    pub last_call: Option<(String, String, bool)>,
    /// `exit` ran the guard's handler.
    pub by_exit: bool,
}

impl Mark {
    /// Maps the mark file `path` (at least [`MARK_BYTES`] long), shared
    /// with every process that maps it; the mapping lives as long as the
    /// process.
    pub fn map(path: &Path) -> std::io::Result<&'static Mark> {
        use std::os::fd::AsRawFd;
        let f = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
        if f.metadata()?.len() < MARK_BYTES {
            f.set_len(MARK_BYTES)?;
        }
        // SAFETY: a fresh shared mapping of a file at least MARK_BYTES long,
        // never unmapped; the fd may be closed after mmap.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), MARK_BYTES as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, f.as_raw_fd(), 0)
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: page-aligned, MARK_BYTES >= size_of::<Mark>(), and every
        // bit pattern is a valid Mark (atomic integers); it lives forever.
        Ok(unsafe { &*(p as *const Mark) })
    }

    fn put(dst: &[AtomicU8], len: &AtomicU32, text: &str) {
        let n = text.len().min(dst.len());
        for (d, b) in dst.iter().zip(&text.as_bytes()[..n]) {
            d.store(*b, Ordering::Relaxed);
        }
        len.store(n as u32, Ordering::Release);
    }

    fn get(src: &[AtomicU8], len: &AtomicU32) -> String {
        let n = (len.load(Ordering::Acquire) as usize).min(src.len());
        String::from_utf8_lossy(&src[..n].iter().map(|b| b.load(Ordering::Relaxed)).collect::<Vec<u8>>()).into_owned()
    }

    fn enter(&self, who: &str, call: &str) {
        Mark::put(&self.who, &self.who_len, who);
        Mark::put(&self.call, &self.call_len, call);
        self.in_call.store(1, Ordering::Release);
    }

    /// What the process recorded.
    pub fn verdict(&self) -> Verdict {
        let who = Mark::get(&self.who, &self.who_len);
        Verdict {
            finished: (self.finished.load(Ordering::Acquire) == FINISHED).then(|| self.code.load(Ordering::Acquire)),
            last_call: (!who.is_empty()).then(|| (who, Mark::get(&self.call, &self.call_len), self.in_call.load(Ordering::Acquire) == 1)),
            by_exit: self.by_exit.load(Ordering::Acquire) == 1,
        }
    }
}

/// This process's mark, when a parent supervises it.
fn own_mark() -> Option<&'static Mark> {
    static MARK: OnceLock<Option<&'static Mark>> = OnceLock::new();
    *MARK.get_or_init(|| Mark::map(Path::new(&std::env::var_os(MARK_VAR)?)).ok())
}

/// Records that the process returns `code` itself: the last thing it does
/// before it exits.
pub fn finished(code: i32) {
    if let Some(m) = own_mark() {
        m.code.store(code, Ordering::Release);
        m.finished.store(FINISHED, Ordering::Release);
    }
}

/// Set while a plugin's call is inside a host collective: the plugin is
/// then waiting for the other ranks, not holding them up.
static IN_COLLECTIVE: AtomicBool = AtomicBool::new(false);

/// Marks a host collective that a plugin asked for, until dropped.
pub struct CollectiveScope(());

impl CollectiveScope {
    pub fn enter() -> CollectiveScope {
        IN_COLLECTIVE.store(true, Ordering::Relaxed);
        CollectiveScope(())
    }
}

impl Drop for CollectiveScope {
    fn drop(&mut self) {
        IN_COLLECTIVE.store(false, Ordering::Relaxed);
    }
}

/// The plugin call in progress in this process, if any, and not inside a
/// collective it asked for: "compressor plugin
/// `x` (...)'s `compress`", and for how long. For a rank's watchdog, which
/// asks only once the rank has stopped making progress.
pub fn call_in_progress() -> Option<(String, Duration)> {
    let plugin = LAST_PLUGIN.load(Ordering::Acquire);
    if plugin.is_null() || IN_COLLECTIVE.load(Ordering::Relaxed) {
        return None;
    }
    let (ptr, len) = (LAST_CALL.0.load(Ordering::Relaxed), LAST_CALL.1.load(Ordering::Relaxed));
    // SAFETY: the pointers were stored together by a CallScope that has not
    // been dropped (a dropped one nulls LAST_PLUGIN): the plugin's
    // description lives while its call runs, and the name is a `&'static str`.
    let (plugin, call) = unsafe { (&*plugin, std::str::from_utf8_unchecked(std::slice::from_raw_parts(ptr, len))) };
    let since = epoch().elapsed().saturating_sub(Duration::from_nanos(LAST_START_NS.load(Ordering::Relaxed)));
    Some((format!("{plugin}'s `{call}`"), since))
}

extern "C" fn on_exit() {
    if !ARMED.load(Ordering::SeqCst) {
        return;
    }
    if let Some(m) = own_mark() {
        // The parent says who ended the process.
        m.by_exit.store(1, Ordering::Release);
        // SAFETY: as below.
        unsafe { libc::_exit(PLUGIN_ENDED_PROCESS) };
    }
    let during = CURRENT.try_with(|c| c.get()).ok().flatten();
    let who = match during {
        // SAFETY: the pointer was set by a CallScope that is still alive (the
        // plugin's call has not returned: it is calling exit), and the
        // string it points to is owned by the plugin making that call.
        Some((plugin, call)) => format!("{} ended the process (exit) during `{call}`", unsafe { &*plugin }),
        None => "the process was ended (exit) while a run was in progress".to_owned(),
    };
    eprintln!("harness: {who}; the run is incomplete (the result file keeps the entries finished before)");
    // SAFETY: _exit ends the process at once, without running the other
    // exit handlers again; nothing is left to flush that matters more than
    // the status.
    unsafe { libc::_exit(PLUGIN_ENDED_PROCESS) };
}
