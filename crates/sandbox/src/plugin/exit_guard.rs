//! A native plugin is code in our process: it can call `exit(0)`, and the
//! run would end with status 0 and no message, so an incomplete run would
//! look successful. While a run is in progress ([`arm`]), an `atexit`
//! handler turns any exit into status [`PLUGIN_ENDED_PROCESS`], naming the
//! plugin and the call it was in (`exit` runs the handlers on the thread
//! that called it, whose current plugin call is recorded in [`CallScope`]).
//! The result file, rewritten after every finished entry, then stays
//! `complete: false`.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

pub use crate::exit::PLUGIN_ENDED_PROCESS;

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
        CallScope(())
    }
}

impl Drop for CallScope {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(None));
        LAST_PLUGIN.store(std::ptr::null_mut(), Ordering::Release);
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
