//! Ctrl-C during `harness run`: the run stops as SIGINT stops it (the
//! shell sees exit status 130), after saying where it stopped and what
//! `--resume` will do, and without leaving empty checkpoint folders.
//!
//! [`watch`] installs a SIGINT handler that only writes a byte to a pipe
//! (all a signal handler may safely do); a thread reading the pipe prints
//! the line, tidies up and ends the process by SIGINT. The console tells
//! this module which entry runs and at which step ([`at`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;

/// Where the run is, for the line Ctrl-C prints.
struct Position {
    /// The result file.
    out: PathBuf,
    /// Where an entry's checkpoints go (`launch::checkpoint_dir`).
    checkpoints: CheckpointDir,
    /// The entry that runs and its last step (None before the first).
    entry: Option<(String, u64, Option<u64>)>,
}

/// The folder of an entry's checkpoints, from the result file and the
/// entry's id.
pub type CheckpointDir = fn(&Path, &str) -> PathBuf;

static POSITION: Mutex<Option<Position>> = Mutex::new(None);

/// The pipe's write end, for the signal handler (-1: not installed).
static PIPE: AtomicI32 = AtomicI32::new(-1);

/// From now on, Ctrl-C says where the run writing `out` stopped; its
/// entries' checkpoints are in `checkpoints(out, entry id)`. Installs the
/// handler once per process; a later call only changes the run.
pub fn watch(out: &Path, checkpoints: CheckpointDir) {
    *POSITION.lock().unwrap_or_else(|e| e.into_inner()) = Some(Position { out: out.to_owned(), checkpoints, entry: None });
    if PIPE.load(Ordering::SeqCst) >= 0 {
        return;
    }
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe(2) to fill.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return; // Ctrl-C then stops the run silently, as before.
    }
    let [read_end, write_end] = fds;
    PIPE.store(write_end, Ordering::SeqCst);
    let spawned = std::thread::Builder::new().name("harness-sigint".into()).spawn(move || {
        let mut byte = 0u8;
        // SAFETY: reads one byte into a live local; the fd is the pipe's
        // read end, owned by this thread.
        while unsafe { libc::read(read_end, (&mut byte as *mut u8).cast(), 1) } != 1 {}
        stopped();
    });
    if spawned.is_err() {
        PIPE.store(-1, Ordering::SeqCst);
        return;
    }
    // SAFETY: a zeroed sigaction is a valid starting value; the handler is
    // an `extern "C"` function that only calls write(2), which is
    // async-signal-safe. SA_RESTART keeps other threads' system calls from
    // failing with EINTR.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut());
    }
}

/// The entry `id` runs and has done `step` steps of `total` (if known).
pub fn at(id: &str, step: u64, total: Option<u64>) {
    if let Some(p) = POSITION.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        match &mut p.entry {
            Some((running, s, t)) if running == id => (*s, *t) = (step, total),
            e => *e = Some((id.to_owned(), step, total)),
        }
    }
}

extern "C" fn on_sigint(_: libc::c_int) {
    let fd = PIPE.load(Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: write(2) is async-signal-safe; the buffer is a static byte.
        unsafe { libc::write(fd, b"i".as_ptr().cast(), 1) };
    }
}

/// After Ctrl-C: the line, the empty checkpoint folders removed, and the
/// process ended by SIGINT as if no handler had been installed.
fn stopped() -> ! {
    let position = POSITION.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(Position { out, checkpoints, entry }) = position {
        eprintln!("\n{}", message(&out, checkpoints, entry.as_ref()));
        if let Some((id, ..)) = &entry {
            remove_if_empty(&checkpoints(&out, id));
        }
        remove_if_empty(&out.with_extension("checkpoints"));
    }
    // SAFETY: restores SIGINT's default action and raises it: the process
    // ends with the status of a SIGINT (130 in a shell), which is what a
    // caller waiting on it expects.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
        libc::raise(libc::SIGINT);
    }
    std::process::exit(130)
}

/// The line Ctrl-C prints.
fn message(out: &Path, checkpoints: CheckpointDir, entry: Option<&(String, u64, Option<u64>)>) -> String {
    let Some((id, step, total)) = entry else {
        return format!("harness: interrupted before the first entry; the same command with `--resume` continues {}", out.display());
    };
    let of = total.map(|t| format!(" of {t}")).unwrap_or_default();
    let has_checkpoint = std::fs::read_dir(checkpoints(out, id)).is_ok_and(|mut d| d.next().is_some());
    let goes_on = if has_checkpoint { "from its newest checkpoint" } else { "from step 0 (it wrote no checkpoint)" };
    format!(
        "harness: interrupted at step {step}{of} of entry {id}; finished entries are kept in {}\n\
         harness: the same command with `--resume` continues: this entry {goes_on}, then the entries not yet run",
        out.display()
    )
}

/// Removes `dir` if it is an empty folder.
fn remove_if_empty(dir: &Path) {
    let _ = std::fs::remove_dir(dir);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_says_where_the_run_stopped_and_what_resume_does() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("r.json");
        let entry = ("a/every1/r0".to_owned(), 120, Some(300));
        let dirs: CheckpointDir = |out, id| out.with_extension("checkpoints").join(id.replace('/', "_"));
        let line = message(&out, dirs, Some(&entry));
        assert!(line.contains("interrupted at step 120 of 300 of entry a/every1/r0"), "{line}");
        assert!(line.contains("from step 0 (it wrote no checkpoint)"), "{line}");
        std::fs::create_dir_all(dirs(&out, "a/every1/r0").join("step-00000100")).unwrap();
        assert!(message(&out, dirs, Some(&entry)).contains("this entry from its newest checkpoint"));
        assert!(message(&out, dirs, None).contains("before the first entry"));
    }
}
