//! `harness run`'s supervising parent: a run whose suite loads a native
//! plugin runs in a child process, and this process only waits for it. A
//! native plugin is code in the child's process; it can end it by any
//! route (`exit`, `_exit`, the `exit_group` system call, a thread of its
//! own calling `exit`), with any status, 0 included. The child records in a
//! shared page ([`harness_sandbox::plugin::exit_guard::Mark`]) the native plugin
//! call in progress and whether it returned its exit code itself; a child
//! that ended otherwise was ended by the plugin (or crashed), and the
//! parent says which plugin and exits with
//! [`harness_format::exit::PLUGIN_ENDED_PROCESS`]. The result file, rewritten by the
//! child after every finished entry, keeps the entries finished before and
//! stays `complete: false`. A child that finished its run (result file
//! complete) and then died anyway (a plugin's thread or exit handler) ends
//! the run with [`harness_format::exit::ENDED_AFTER_RUN`], never 0.

use std::path::Path;
use std::process::ExitStatus;

use anyhow::Context;

use harness_format::exit;
use harness_sandbox::plugin::exit_guard::{self, Mark, Verdict, MARK_VAR};

/// Whether `harness run` of this suite needs a supervising parent: it loads
/// a native library, and this process is not already supervised (the
/// child) or a rank (whose launcher, torchrun or srun watch it).
pub fn wanted(suite: &harness_format::suite::Suite) -> bool {
    // The child (even one whose mark could not be mapped: it must never
    // start a child of its own).
    if std::env::var_os(MARK_VAR).is_some() {
        return false;
    }
    let dir = suite.path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    suite.spec.plugins.iter().any(|p| {
        let path = dir.join(&p.path);
        let mut head = [0u8; 4];
        std::fs::File::open(&path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head)).is_ok()
            && harness_format::plugin::ArtifactFormat::of(&head).is_native()
    })
}

/// Runs this same command line in a child process, supervised, and returns
/// the exit code the run ends with.
pub fn run_child() -> anyhow::Result<i32> {
    let dir = tempfile::tempdir().context("cannot make a folder for the supervised run's mark")?;
    let path = dir.path().join("exit-mark");
    std::fs::File::create(&path)?.set_len(exit_guard::MARK_BYTES)?;
    let mark = Mark::map(&path).context("cannot map the supervised run's mark")?;
    let exe = std::env::current_exe().context("cannot find the harness executable")?;
    let mut child = std::process::Command::new(exe);
    child.args(std::env::args_os().skip(1)).env(MARK_VAR, &path);
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure runs in the forked child before exec and only
        // calls prctl, which is async-signal-safe.
        unsafe {
            child.pre_exec(|| {
                // The run ends with its parent (killed by a timeout, say).
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
    }
    let status = child.status().context("cannot start the supervised run")?;
    let (code, message) = judge(&mark.verdict(), status);
    if let Some(m) = message {
        eprintln!("harness: {m}");
    }
    Ok(code)
}

/// How the child ended (`status`, status 128 + the signal for a signal).
fn how(v: &Verdict, status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.signal(), v.by_exit) {
        (Some(sig), _) => format!("signal {sig}"),
        (None, true) => "exit".to_owned(),
        (None, false) => format!("_exit or exit_group, status {}", status.code().unwrap_or(-1)),
    }
}

/// What ended a process that did not finish (its mark `v`, its `status`)
/// when a native plugin was loaded in it: the plugin, and the call it was
/// in or had last returned from. None when it finished, or no native plugin
/// was called. A rank's launcher asks this of each rank process too.
pub fn ended_by_plugin(v: &Verdict, status: ExitStatus) -> Option<String> {
    if v.finished.is_some() {
        return None;
    }
    let how = how(v, status);
    match &v.last_call {
        Some((who, call, true)) => Some(format!("{who} ended the process ({how}) during `{call}`")),
        Some((who, call, false)) => Some(format!(
            "a native plugin ended the process ({how}) outside its calls, after {who}'s `{call}` had returned (a thread it started?)"
        )),
        None => None,
    }
}

/// What ended a process that finished its run (returned its exit code
/// itself, in its mark `v`) and then ended otherwise (`status`): a signal or
/// another status, after its last native plugin call. None when it ended
/// with the code it returned, or did not finish. A rank's launcher asks this
/// of each rank process too.
pub fn ended_after_run(v: &Verdict, status: ExitStatus) -> Option<String> {
    let code = v.finished?;
    if status.code() == Some(code) {
        return None;
    }
    let last = match &v.last_call {
        Some((who, call, _)) => {
            format!(", after its last native plugin call ({who}'s `{call}`) had returned: a thread or exit handler the plugin left behind?")
        }
        None => String::new(),
    };
    Some(format!("the run finished (exit code {code}), then its process ended by {}{last}", how(v, status)))
}

/// The exit code of a supervised run that ended with `status`, and what to
/// say about it.
fn judge(v: &Verdict, status: ExitStatus) -> (i32, Option<String>) {
    use std::os::unix::process::ExitStatusExt;
    const INCOMPLETE: &str = "the run is incomplete (the result file keeps the entries finished before)";
    if let Some(code) = v.finished {
        let Some(m) = ended_after_run(v, status) else { return (code, None) };
        // The run's own verdict (0, or 1 for failed entries) is in the
        // result file; a process that crashed after it is no success.
        // Other codes already say the run did not succeed, and why.
        return match code {
            exit::OK | exit::ENTRY_FAILED => (
                exit::ENDED_AFTER_RUN,
                Some(format!(
                    "{m}; the result file was written before and is complete, but harness exits with {} instead of {code}: the process did not end cleanly",
                    exit::ENDED_AFTER_RUN
                )),
            ),
            _ => (code, Some(m)),
        };
    }
    if let Some(m) = ended_by_plugin(v, status) {
        return (exit::PLUGIN_ENDED_PROCESS, Some(format!("{m}; {INCOMPLETE}")));
    }
    let how = how(v, status);
    match &v.last_call {
        Some(_) => unreachable!("a process with a plugin call in its mark that did not finish was ended by the plugin"),
        None => {
            let code = match (status.signal(), status.code()) {
                (Some(sig), _) => 128 + sig,
                (None, Some(exit::OK) | None) => exit::ERROR,
                (None, Some(c)) => c,
            };
            (code, Some(format!("the run's process ended ({how}) before it finished; {INCOMPLETE}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    /// Issue 61: a native plugin's thread that killed the process after the
    /// run had finished left `harness run` exiting 0.
    #[test]
    fn a_process_that_dies_after_its_run_never_exits_0() {
        let signal = |sig: i32| ExitStatus::from_raw(sig);
        let exited = |code: i32| ExitStatus::from_raw(code << 8);
        let last = Some(("compressor plugin `q`".to_owned(), "compress".to_owned(), false));
        let finished = |code| Verdict { finished: Some(code), last_call: last.clone(), by_exit: false };
        for (code, status) in [(exit::OK, signal(libc::SIGSEGV)), (exit::ENTRY_FAILED, signal(libc::SIGSEGV)), (exit::OK, exited(7))] {
            let (got, m) = judge(&finished(code), status);
            assert_eq!(got, exit::ENDED_AFTER_RUN, "{code} {status:?}");
            let m = m.unwrap();
            assert!(m.starts_with(&format!("the run finished (exit code {code}), then its process ended by ")), "{m}");
            assert!(
                m.contains("compressor plugin `q`'s `compress`") && m.contains("the result file was written before and is complete"),
                "{m}"
            );
        }
        assert!(judge(&finished(exit::OK), signal(libc::SIGSEGV)).1.unwrap().contains("ended by signal 11"));
        // A process that ended with the code it returned keeps it; one that
        // could not run (3) keeps its code and claims no complete results.
        assert_eq!(judge(&finished(exit::OK), exited(0)), (exit::OK, None));
        assert_eq!(judge(&finished(exit::ENTRY_FAILED), exited(1)), (exit::ENTRY_FAILED, None));
        let (got, m) = judge(&finished(exit::ERROR), signal(libc::SIGSEGV));
        assert_eq!(got, exit::ERROR);
        assert!(!m.unwrap().contains("complete"));
    }
}
