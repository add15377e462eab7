//! `harness run`: the suite entered (`--plugin`, `--track`, `--gpus`), run
//! here or as ranks.

use std::path::{Path, PathBuf};

use anyhow::Context;

use super::args::RunArgs;
use super::child::Child;
use super::validate::{configure_all, Configure};
use crate::console::Console;
use crate::device;
use crate::launch::{self, RunOptions};
use crate::ranks::{self, RankEnv};
use harness_format::exit;
use harness_format::fmt::printable;
use harness_format::results::{self, EntryStatus};
use harness_format::suite::Suite;

/// `--plugin-config KEY=VALUE...` as a plugin's configuration table: each
/// VALUE parsed as TOML, or taken as a string when it is not TOML.
pub(super) fn plugin_config(pairs: &[String]) -> Result<toml::Table, String> {
    let mut config = toml::Table::new();
    for kv in pairs {
        let (k, v) = kv.split_once('=').ok_or_else(|| format!("--plugin-config {kv}: expected KEY=VALUE"))?;
        let value = format!("v = {v}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(v.to_owned()));
        config.insert(k.trim().to_owned(), value);
    }
    Ok(config)
}

/// `--plugin KIND=PATH` and `--plugin-config KEY=VALUE...` as an entry.
fn entered_plugin(args: &RunArgs) -> Result<Option<harness_format::suite::standard::Entry>, String> {
    let Some(p) = &args.plugin else {
        return match args.plugin_config.is_empty() {
            true => Ok(None),
            false => Err("--plugin-config needs --plugin KIND=PATH".into()),
        };
    };
    let (kind, path) = p.split_once('=').ok_or_else(|| format!("--plugin {p}: expected KIND=PATH, e.g. compressor=my.wasm"))?;
    if !harness_format::suite::TRACK_KINDS.contains(&kind) {
        return Err(format!("--plugin {p}: unknown kind `{kind}` (one of: {})", harness_format::suite::TRACK_KINDS.join(", ")));
    }
    let config = plugin_config(&args.plugin_config)?;
    let path = std::path::absolute(path).map_err(|e| format!("--plugin {p}: {e}"))?;
    Ok(Some(harness_format::suite::standard::Entry { kind: kind.to_owned(), path, config: (!config.is_empty()).then_some(config) }))
}

/// Applies `--gpus`, `--track` and `--plugin` to a standard suite and
/// checks the entered plugin before anything trains. Returns the
/// submission record (its `unofficial` reasons are completed by launch,
/// which knows the machine).
fn enter(suite: &mut Suite, args: &RunArgs) -> Result<Option<results::Submission>, String> {
    if let Some(n) = args.gpus {
        if let Some(h) = suite.spec.suite.hardware.as_ref().filter(|h| !h.gpus.is_empty() && !h.gpus.contains(&n)) {
            let unit = if h.class == harness_format::machine::CPU_CLASS { "ranks" } else { "GPUs" };
            return Err(format!(
                "--gpus {n}: {} is run on {:?} {unit} (its divisions, `[suite.hardware] gpus`); pass one of them",
                suite.path.display(),
                h.gpus
            ));
        }
        suite.spec.suite.world_size = n;
    }
    let entry = entered_plugin(args)?;
    let mut entered = Vec::new();
    if let Some(e) = &entry {
        let m = harness_sandbox::plugin::inspect(&e.path).map_err(|err| format!("--plugin {}: {err:#}", e.path.display()))?;
        if m.kind.name() != e.kind {
            return Err(format!(
                "--plugin {}: the plugin is a {}, not a {}\nhint: --plugin {}={}",
                e.path.display(),
                m.kind.name(),
                e.kind,
                m.kind.name(),
                e.path.display()
            ));
        }
        let bytes = std::fs::metadata(&e.path).map(|md| md.len()).unwrap_or(0);
        let transport = match m.transport {
            harness_sandbox::plugin::Transport::Wasm => "wasm",
            harness_sandbox::plugin::Transport::Native => "native",
        };
        let config = e.config.as_ref().map(|c| toml::to_string(c).unwrap_or_default()).unwrap_or_default();
        entered.push(results::EnteredPlugin {
            kind: e.kind.clone(),
            name: m.name,
            version: m.version,
            transport: transport.into(),
            path: e.path.display().to_string(),
            sha256: m.sha256,
            bytes,
            config,
            strategies: Vec::new(),
        });
    }
    let (tracks, strategies) = suite.select(args.track.as_deref(), entry.as_ref())?;
    // The caller says "error: " once.
    suite.validate().map_err(|e| e.to_string().trim_start_matches("error: ").to_owned())?;
    if tracks.is_empty() {
        return Ok(None);
    }
    if let Some(p) = entered.first_mut() {
        p.strategies = strategies;
    }
    let meta = &suite.spec.suite;
    Ok(Some(results::Submission {
        suite_version: meta.version.clone(),
        hardware_class: meta.hardware.as_ref().map(|h| h.class.clone()),
        released_suite: harness_format::suite::standard::released(&suite.source).is_some(),
        tracks,
        gpus: meta.world_size,
        entered,
        unofficial: Vec::new(),
    }))
}

/// `harness run`: runs the suite (with `--plugin`, `--track` and `--gpus`
/// applied to a standard suite) and writes its result file: in this
/// process, or, for a multi-GPU suite not started as a rank, in one rank
/// process per GPU ([`run_ranks`]). An invalid suite is
/// [`exit::INVALID_SUITE`]; a finished run says whether an entry failed.
pub(super) fn run(args: RunArgs) -> anyhow::Result<i32> {
    let mut suite = match Suite::load(&args.suite) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return Ok(exit::INVALID_SUITE);
        }
    };
    if suite.spec.suite.hardware.as_ref().is_some_and(|h| h.class == harness_format::machine::CPU_CLASS) {
        hold_cpu_kernels()?;
    }
    let out = out_path(&args, &suite.spec.suite.name)?;
    let rank_env = RankEnv::from_env()?;
    // Before any thread starts (entering a plugin compiles it on threads):
    // NCCL's debug output, to record the transports it chose.
    let nccl_log = rank_env.as_ref().map(|e| ranks::NcclLog::capture(&out, e.rank));
    let submission = match enter(&mut suite, &args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {}", printable(&e.to_string()));
            return Ok(exit::INVALID_SUITE);
        }
    };
    let follower = rank_env.as_ref().is_some_and(|e| e.rank != 0);
    if !args.resume && out.exists() && !follower {
        anyhow::bail!("{} already exists\nhint: pass --resume to continue it, or choose another --out", out.display());
    }
    if !follower {
        // The log is appended to as the run goes: a link planted at its
        // path would take the run's lines wherever it points. Refused
        // before anything trains (its opening refuses it again).
        harness_format::outfile::refuse_link(&Console::log_path(&out))?;
    }
    // The entered plugin configured as its entries will configure it,
    // before anything trains: a misspelt `--plugin-config` key is found
    // now, not after the baseline's entries (the rank processes of a
    // multi-GPU run leave this to the run that started them).
    let entered = submission.as_ref().and_then(|s| s.entered.first()).map(|p| p.strategies.clone()).unwrap_or_default();
    if rank_env.is_none() && !entered.is_empty() {
        let dir = suite.path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let set = harness_sandbox::plugin::PluginSet::new(&suite.spec.plugins, dir);
        let errors = configure_all(&suite, &set, Configure::Entered(&entered));
        if !errors.is_empty() {
            for e in &errors {
                eprintln!("{e}");
            }
            return Ok(exit::INVALID_SUITE);
        }
    }
    let world = suite.spec.suite.world_size as usize;
    if world > 1
        && rank_env.is_none()
        && suite.spec.suite.device != harness_format::suite::DeviceKind::Cpu
        && crate::device::gpu_count() > 0
    {
        return run_ranks(&args, &suite, &out, world);
    }
    if rank_env.is_none() && crate::supervise::wanted(&suite) {
        return crate::supervise::run_child();
    }
    let opts = RunOptions { out, resume: args.resume, ranks: rank_env, submission, nccl_log, trace: args.trace };
    run_here(&suite, &opts, args.quiet)
}

/// For a CPU-class suite: starts this command line again with libtorch's
/// CPU kernels held to the class's level ([`device::CPU_CLASS_PIN`]), so
/// that a rerun on any CPU of the class trains the same bits. libtorch reads
/// those variables once, at its first use, so they must be in the
/// environment the process starts with. Returns at once when they are
/// there (the process started again, and the child a supervising parent
/// starts, inherit them) or when the CPU is outside the class (its run is
/// unofficial, and its fingerprint says why). A value the caller set
/// otherwise is overridden, with a note: docs/rules.md, "The CPU class".
fn hold_cpu_kernels() -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt;
    let missing = device::cpu_class_pin_missing();
    if missing.is_empty() {
        return Ok(());
    }
    for (k, v, had) in &missing {
        if let Some(had) = had {
            eprintln!(
                "harness: {k}={} overridden with {k}={v}: a CPU-class suite holds libtorch's CPU kernels to the class's level (docs/rules.md, \"The CPU class\")",
                printable(&had.to_string_lossy())
            );
        }
    }
    const WHY: &str = "cannot start harness again with libtorch's CPU kernels held to the CPU class's level";
    let exe = std::env::current_exe().context(WHY)?;
    let e = std::process::Command::new(exe).args(std::env::args_os().skip(1)).envs(missing.iter().map(|(k, v, _)| (k, v))).exec();
    Err(anyhow::Error::new(e).context(WHY))
}

/// The result file `harness run` writes: `--out`; with `--resume` alone the
/// newest incomplete result of the suite `name` under `--results-dir`;
/// else a new file there.
fn out_path(args: &RunArgs, name: &str) -> anyhow::Result<PathBuf> {
    Ok(match (&args.out, args.resume) {
        (Some(o), _) => o.clone(),
        (None, true) => results::find_resumable(&args.results_dir, name).ok_or_else(|| {
            anyhow::anyhow!(
                "no incomplete result of suite `{name}` under {}\nhint: name the file with --out, or run without --resume",
                args.results_dir.display()
            )
        })?,
        (None, false) => results::default_path(&args.results_dir, name),
    })
}

/// `harness run` of a multi-GPU suite: one process per GPU, each joining as
/// a rank with this run's arguments; rank 0 writes `out`. Prints the
/// summary of the whole run once the ranks are done.
fn run_ranks(args: &RunArgs, suite: &Suite, out: &Path, world: usize) -> anyhow::Result<i32> {
    // This run's options, into `out`; the launcher asks for --resume after
    // its first round (or from the start).
    let child = RunArgs { out: Some(out.to_owned()), resume: false, ..args.clone() };
    let argv = |resume| Child::Run(RunArgs { resume, ..child.clone() }).argv();
    if let Some(code) = crate::launch::launch_local_ranks(world, &argv, out, suite, args.resume)? {
        return Ok(code);
    }
    let result = results::RunResult::read(out)?;
    Console::new(args.quiet).summary(&result, out);
    Ok(finished_run(&result))
}

/// Runs the suite in this process, alone or as one rank of several (a
/// rank other than 0 prints nothing and leaves the result file to rank 0).
fn run_here(suite: &Suite, opts: &RunOptions, quiet: bool) -> anyhow::Result<i32> {
    let follower = opts.ranks.as_ref().is_some_and(|e| e.rank != 0);
    let mut console = Console::new(quiet || follower);
    if !follower {
        console.log_to(&Console::log_path(&opts.out));
        crate::interrupt::watch(&opts.out, launch::checkpoint_dir);
    }
    // From here until the run returns, a plugin that ends the process
    // cannot make it look successful.
    harness_sandbox::plugin::exit_guard::arm(true);
    let result = launch::run_suite(suite, opts, &mut console);
    harness_sandbox::plugin::exit_guard::arm(false);
    let result = match result {
        Err(e) if e.is::<launch::RanksLost>() => {
            eprintln!("error: {}", printable(&format!("{e:#}")));
            return Ok(exit::RANK_LOST);
        }
        r => r?,
    };
    if follower {
        return Ok(exit::OK);
    }
    // Started by `harness run`'s launcher, which sums up the whole run.
    if std::env::var_os(ranks::ENTRIES_VAR).is_none() {
        console.summary(&result, &opts.out);
    }
    Ok(finished_run(&result))
}

/// The exit code of a run that finished: whether any entry failed.
fn finished_run(result: &results::RunResult) -> i32 {
    let failed = result.entries.iter().filter(|e| matches!(e.status, EntryStatus::Failed { .. })).count();
    exit::of_finished_run(failed)
}
