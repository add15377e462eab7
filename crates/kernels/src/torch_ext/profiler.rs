//! libtorch's profiler (Kineto): a Chrome trace of a stretch of the run,
//! with named ranges on its timeline.

use std::ffi::{c_int, c_void};

use super::{check, ffi, TorchError};

/// Whether a trace is being recorded in this process (ranges cost an
/// allocation each, so they are opened only then).
static TRACING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Starts libtorch's profiler (Kineto) on this thread, as torch.profiler
/// does: operators with their input shapes, and with `cuda` the kernels and
/// copies (through CUPTI). Operators of the autograd engine's threads are
/// recorded too (they inherit the profiler's thread state).
pub fn profiler_start(cuda: bool) -> Result<(), TorchError> {
    // SAFETY: no pointers are passed.
    check(unsafe { ffi::hx_profiler_start(c_int::from(cuda)) })?;
    TRACING.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Stops the profiler started by [`profiler_start`] and writes its Chrome
/// trace (JSON, for chrome://tracing or ui.perfetto.dev) to `path`.
pub fn profiler_stop(path: &std::path::Path) -> Result<(), TorchError> {
    TRACING.store(false, std::sync::atomic::Ordering::Relaxed);
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| TorchError("a path with a NUL byte".into()))?;
    // SAFETY: c is a NUL-terminated string alive for the call.
    check(unsafe { ffi::hx_profiler_stop(c.as_ptr()) })
}

/// A named range on the trace's timeline while a trace is recorded (else
/// nothing): ended when dropped, on the thread that opened it.
pub struct Range(*mut c_void);

impl Range {
    /// Opens a range named `name()` if a trace is being recorded.
    pub fn open(name: impl FnOnce() -> String) -> Option<Range> {
        if !TRACING.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let c = std::ffi::CString::new(name().replace('\0', " ")).ok()?;
        // SAFETY: c is a NUL-terminated string alive for the call; the shim
        // copies it.
        let r = unsafe { ffi::hx_range_push(c.as_ptr()) };
        (!r.is_null()).then_some(Range(r))
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        // SAFETY: self.0 came from hx_range_push and is ended once, here;
        // Range is neither Send nor Sync (raw pointer), so this runs on the
        // thread that opened it, as RecordFunction requires.
        unsafe { ffi::hx_range_pop(self.0) }
    }
}
