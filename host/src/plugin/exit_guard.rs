//! A native plugin is code in our process: it can call `exit(0)`, and the
//! run would end with status 0 and no message, so an incomplete run would
//! look successful. While a run is in progress ([`arm`]), an `atexit`
//! handler turns any exit into status [`PLUGIN_ENDED_PROCESS`], naming the
//! plugin and the call it was in (`exit` runs the handlers on the thread
//! that called it, whose current plugin call is recorded in [`CallScope`]).
//! The result file, rewritten after every finished entry, then stays
//! `complete: false`.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

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

/// Marks a plugin call in progress on this thread until dropped.
pub struct CallScope(());

impl CallScope {
    /// `plugin` must outlive the scope (the plugin's own description).
    pub fn enter(plugin: &String, call: &'static str) -> CallScope {
        CURRENT.with(|c| c.set(Some((plugin as *const String, call))));
        CallScope(())
    }
}

impl Drop for CallScope {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(None));
    }
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
