//! The console of `harness run`: the line that opens a run, a progress bar
//! and a closing line per entry, warnings, the summary table at the end, and
//! the panic hook that keeps libtorch's errors (panics in tch) off it so that
//! they are reported once, as the entry's failure. The modules below the CLI
//! print nothing themselves; what a run shows goes through here.

use std::cell::RefCell;
use std::path::Path;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use harness_format::fmt::{human, printable, printable_path};
use harness_format::results::{EntryResult, EntryStatus, RunResult};
use harness_train::Progress;

/// What one run shows on the terminal. Progress goes to stderr, the summary
/// to stdout. Quiet: no run line, progress bar or entry lines; warnings and
/// the summary are still shown.
pub struct Console {
    quiet: bool,
    entry: Option<EntryBar>,
    /// The run's log (`<result stem>.log`): what the terminal shows, less
    /// the progress, whether quiet or not. `harness submit` bundles it.
    log: Option<std::sync::Mutex<Log>>,
}

/// The log file, opened (and its folder made) at the first line, so a run
/// that stops before it starts (no usable device) leaves nothing behind.
enum Log {
    Pending(std::path::PathBuf),
    Open(std::fs::File),
    Failed,
}

/// The progress of the entry that runs now.
struct EntryBar {
    id: String,
    bar: ProgressBar,
    /// When the last progress line was printed in place of a hidden bar.
    last_print: Instant,
}

impl Console {
    pub fn new(quiet: bool) -> Console {
        Console { quiet, entry: None, log: None }
    }

    /// Also writes the run's lines to `path` (appended, so a resumed run
    /// adds to the log of the run it continues; never through a symbolic
    /// link: [`harness_format::outfile::append`]).
    pub fn log_to(&mut self, path: &Path) {
        self.log = Some(std::sync::Mutex::new(Log::Pending(path.to_owned())));
    }

    /// The log file of the result file `out`.
    pub fn log_path(out: &Path) -> std::path::PathBuf {
        harness_format::results::log_path(out)
    }

    fn log(&self, line: &str) {
        use std::io::Write;
        let Some(log) = &self.log else { return };
        let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
        if let Log::Pending(path) = &*log {
            let open = || -> anyhow::Result<std::fs::File> {
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)?;
                }
                Ok(harness_format::outfile::append(path)?)
            };
            *log = match open() {
                Ok(f) => Log::Open(f),
                Err(e) => {
                    let why = printable(&format!("{e:#}")).into_owned();
                    eprintln!("warning: the run's log {} is not written: {why}", printable_path(path));
                    Log::Failed
                }
            };
        }
        if let Log::Open(f) = &mut *log {
            let _ = writeln!(f, "{line}");
        }
    }

    /// Shows a line on stderr unless quiet, and logs it. Lines quote what
    /// suites, plugins and peers chose (paths, names, their errors): what a
    /// terminal would act on is escaped.
    fn say(&self, line: &str) {
        let line = printable(line);
        if !self.quiet {
            eprintln!("{line}");
        }
        self.log(&line);
    }

    /// The run's opening line: what runs where, and the result file.
    pub fn run_started(&self, suite: &str, to_run: usize, planned: usize, device: &str, out: &Path) {
        self.log(&format!("# {} harness {}", harness_format::results::now(), env!("CARGO_PKG_VERSION")));
        self.say(&format!("harness: suite `{suite}` ({to_run} of {planned} entries to run) on {device} -> {}", out.display()));
    }

    /// A line about the run (not an entry), shown unless quiet, and logged.
    pub fn note(&self, msg: &str) {
        self.say(&format!("harness: {msg}"));
    }

    /// A warning, shown even when quiet.
    pub fn warning(&self, msg: &str) {
        let msg = printable(msg);
        eprintln!("warning: {msg}");
        self.log(&format!("warning: {msg}"));
    }

    /// Shows a progress bar for entry `position` (from 1) of `count`: by step
    /// when the run length is steps, by time when it is a time budget.
    pub fn entry_started(&mut self, position: usize, count: usize, id: &str, steps: Option<u64>, budget_s: Option<f64>) {
        // The suite chose the entry's name.
        let bar = progress_bar(self.quiet, &format!("[{position}/{count}] {}", printable(id)), steps, budget_s);
        self.entry = Some(EntryBar { id: id.to_owned(), bar, last_print: Instant::now() });
        crate::interrupt::at(id, 0, steps);
    }

    /// Moves the entry's bar. Without a terminal (CI logs, pipes) the bar is
    /// hidden: a line every 10 seconds instead shows that a long run is alive.
    pub fn progress(&mut self, p: &Progress) {
        let Some(EntryBar { id, bar, last_print }) = &mut self.entry else { return };
        crate::interrupt::at(id, p.step, p.total_steps);
        if let Some(from) = p.resumed_from {
            // The bar goes on from the checkpoint, and its rate and ETA
            // count only the steps this process runs.
            bar.set_position(from);
            bar.reset_eta();
            let line = format!("  resumed entry {} from step {from} (its newest checkpoint)", printable(id));
            if !self.quiet {
                bar.suspend(|| eprintln!("{line}"));
            }
            self.log(&line);
            return;
        }
        let msg = format!(
            "loss {} | {}",
            p.loss.map_or("-".into(), |l| format!("{l:.4}")),
            p.tokens_per_s.map_or("- tok/s".into(), |t| format!("{} tok/s", human(t)))
        );
        match (p.total_steps, p.time_budget) {
            (Some(_), _) => bar.set_position(p.step),
            (None, Some(_)) => bar.set_position((p.elapsed.as_secs_f64() * 10.0) as u64),
            _ => {}
        }
        bar.set_message(msg.clone());
        if !self.quiet && bar.is_hidden() && last_print.elapsed() >= Duration::from_secs(10) && !bar.is_finished() {
            *last_print = Instant::now();
            eprintln!("  {}: step {}{} {msg}", printable(id), p.step, p.total_steps.map(|s| format!("/{s}")).unwrap_or_default());
        }
    }

    /// Clears the entry's bar and says how the entry ended.
    pub fn entry_finished(&mut self, record: &EntryResult) {
        if let Some(e) = self.entry.take() {
            e.bar.finish_and_clear();
        }
        match (&record.status, &record.metrics) {
            (EntryStatus::Ok, Some(m)) => self.say(&format!(
                "  {} ok (seed {}): {} steps, loss {:.4} (eval {:.4}{}){}, {:.0} tokens/s",
                record.id,
                record.seed,
                m.steps,
                m.final_train_loss.unwrap_or(f64::NAN),
                m.final_eval_loss.unwrap_or(f64::NAN),
                m.loss_floor.map(|f| format!(", floor {f:.4}")).unwrap_or_default(),
                m.final_eval_accuracy
                    .map(|a| format!(", accuracy {a:.4}{}", m.best_accuracy.map(|b| format!(" (best {b:.4})")).unwrap_or_default()))
                    .unwrap_or_default(),
                m.tokens_per_s
            )),
            (EntryStatus::Failed { error, .. }, _) => self.say(&format!("  {} FAILED: {error}", record.id)),
            _ => {}
        }
    }

    /// What the watchdog of a multi-GPU entry says (even when quiet) before
    /// it ends a rank whose collectives hang; it runs on the watchdog's
    /// thread.
    pub fn rank_stopping(&self) -> impl FnOnce(&str) + Send + 'static {
        |msg: &str| eprintln!("harness: {}; stopping this rank", printable(msg))
    }

    /// The summary table of a finished run, and where its results are. The
    /// table quotes the entries' names, which a result file that was
    /// resumed or a suite from elsewhere chose.
    pub fn summary(&self, result: &RunResult, out: &Path) {
        println!("{}", printable(&harness_report::summary_table(result)));
        println!("results: {}", printable_path(out));
    }
}

fn progress_bar(quiet: bool, prefix: &str, steps: Option<u64>, budget_s: Option<f64>) -> ProgressBar {
    let (len, template) = match (steps, budget_s) {
        (Some(s), _) => (s, "{prefix} [{bar:30}] step {pos}/{len} {msg} ETA {eta}"),
        (None, Some(b)) => ((b * 10.0) as u64, "{prefix} [{bar:30}] {msg} ETA {eta}"),
        _ => (0, "{prefix} {msg}"),
    };
    let bar = ProgressBar::new(len);
    bar.set_style(ProgressStyle::with_template(template).expect("valid template").progress_chars("=> "));
    bar.set_prefix(prefix.to_owned());
    bar.set_draw_target(if quiet { ProgressDrawTarget::hidden() } else { ProgressDrawTarget::stderr() });
    bar.enable_steady_tick(Duration::from_millis(250));
    bar
}

thread_local! {
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// While alive, panics (libtorch errors surface as panics in tch) are not
/// printed but kept for the entry's failure message ([`last_panic`]); the
/// previous hook comes back on drop, however the run ends.
pub struct QuietPanics {
    prev: Option<PanicHook>,
}

type PanicHook = Box<dyn Fn(&std::panic::PanicHookInfo<'_>) + Sync + Send + 'static>;

impl QuietPanics {
    pub fn install() -> QuietPanics {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|info| {
            let msg = if let Some(s) = info.payload().downcast_ref::<&str>() {
                s.to_string()
            } else if let Some(s) = info.payload().downcast_ref::<String>() {
                s.clone()
            } else {
                "panic".into()
            };
            LAST_PANIC.with(|p| *p.borrow_mut() = Some(msg));
        }));
        QuietPanics { prev: Some(prev) }
    }
}

impl Drop for QuietPanics {
    fn drop(&mut self) {
        if let Some(prev) = self.prev.take() {
            std::panic::set_hook(prev);
        }
    }
}

/// The message of the last panic on this thread that [`QuietPanics`] kept
/// (taken: a second call returns None).
pub fn last_panic() -> Option<String> {
    LAST_PANIC.with(|p| p.borrow_mut().take())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runs_log_holds_what_was_chosen_elsewhere_escaped() {
        // Entry failures and notes quote paths, plugin names and their
        // errors; the log (bundled, read by others) and the terminal get
        // the same escaped line.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.log");
        let mut c = Console::new(true);
        c.log_to(&path);
        c.note("plugin `p\u{1b}]0;title\u{7}` said \u{202e}no");
        c.warning("\u{9b}2J");
        let log = std::fs::read_to_string(&path).unwrap();
        assert!(!log.chars().any(|ch| harness_format::fmt::unseen(ch) && ch != '\n'), "{log:?}");
        assert!(log.contains(r"harness: plugin `p\u{1b}]0;title\u{7}` said \u{202e}no"), "{log}");
        assert!(log.contains(r"warning: \u{9b}2J"), "{log}");
    }

    /// Issue 61: a link planted at `<out>.log` had the run append its log
    /// to the link's target.
    #[test]
    fn the_runs_log_is_never_written_through_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let (target, path) = (dir.path().join("profile"), dir.path().join("run.log"));
        std::fs::write(&target, "mine\n").unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let mut c = Console::new(true);
        c.log_to(&path);
        c.note("a line");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "mine\n");
    }
}
