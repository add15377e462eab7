//! The command line: [`Cli`] parses it, [`main`] hands each subcommand's
//! arguments to the function that runs it (`harness run`'s is `run`), and
//! [`Child`] writes the command lines of the `harness` processes that
//! harness starts itself.
//!
//! The doc comments of the argument structs are clap's help text, where
//! `<suite>` and the like are plain placeholders, not HTML tags.
#![allow(rustdoc::invalid_html_tags)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::bench::Allreduce;
use crate::console::Console;
use crate::device;
use crate::fmt::{counted, printable, printable_path};
use crate::launch::{self, RunOptions};
use crate::ranks::{self, RankEnv};
use crate::report;
use crate::results::{self, EntryStatus};
use crate::suite::{Suite, DEFAULT_SUITE};

/// The exit codes, also under this path for the integration tests
/// (`harness::cli::exit`).
pub use crate::exit;

/// `harness run`'s folder for result files.
const DEFAULT_RESULTS_DIR: &str = "results";

/// Benchmark harness for distributed-training strategies.
#[derive(Debug, Parser)]
#[command(name = "harness", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a suite and write its results (default: suites/cpu.toml).
    Run(RunArgs),
    /// Check a suite file without running it.
    Validate(ValidateArgs),
    /// Score result files: write LEADERBOARD.md and index.html.
    Report(ReportArgs),
    /// Bundle a standard-suite result for submission: the result, the suite,
    /// the plugin artifact, the run's log and the machine fingerprint, with
    /// their sha256 (docs/submitting.md). The bundle is verified at once.
    Submit(SubmitArgs),
    /// Check submission bundles against the rules (docs/rules.md): prints
    /// each violation with what to do; exits 1 if any bundle breaks a rule.
    Verify(VerifyArgs),
    /// Train submissions again from their bundles alone and compare the
    /// reruns with the claims (docs/rules.md, "Reproduction"): writes a
    /// record per bundle, signed with --key; exits 1 if any bundle does not
    /// verify or does not reproduce.
    Reproduce(ReproduceArgs),
    /// Make an ed25519 key to sign reproduction records: the secret key in
    /// FILE (readable by you only), the public key in FILE.pub.
    Keygen(KeygenArgs),
    /// Compare two result files side by side, with ratios and significance.
    Compare(CompareArgs),
    /// Project strategies on larger clusters with a model calibrated on
    /// result files and all-reduce benches (a projection, not a
    /// measurement: docs/projection.md); --check predicts the measured
    /// multi-GPU entries and prints the error.
    Project(ProjectArgs),
    /// Benchmarks of harness's own building blocks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Strategy plugins: scaffold a new one, or inspect an artifact.
    #[command(subcommand)]
    Plugin(PluginCommand),
    /// Show what harness sees: CPU, GPUs, driver, CUDA, libtorch, NCCL.
    Env(EnvArgs),
}

/// `harness bench ...`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// harness's NCCL all-reduce on a result's gradient buckets, back to
    /// back (one process per GPU), timed like bench/allreduce_busbw.py;
    /// prints JSON.
    Allreduce(AllreduceArgs),
    /// Writes a checkpoint to disk with the checkpoint writer and reads it
    /// back as a restore does (sizes and hashes checked), each way of
    /// reading in turn with the files dropped from the page cache first,
    /// and raw as `dd iflag=direct` reads; prints a table of speeds.
    CheckpointRead(CheckpointReadArgs),
}

/// `harness plugin ...`.
#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// Create a plugin crate that builds to WASM and native, with a suite
    /// that runs it.
    New(PluginNewArgs),
    /// Load a plugin artifact and print its manifest as a `[[plugin]]` table
    /// to pin in a suite.
    Inspect(PluginInspectArgs),
    /// Measure the host -> plugin hook round trip of artifacts: the host's
    /// own per-call meter (p50/p90/p99/mean) and calls back to back.
    Bench(PluginBenchArgs),
    /// Test a plugin artifact as a run would use it, in seconds: a
    /// compressor on synthetic gradient buckets on simulated CPU ranks
    /// (determinism, agreement across ranks, round-trip error, bytes on the
    /// wire, state save/load, config errors), a batch or checkpoint policy
    /// on synthetic telemetry (determinism, state save/load, config
    /// errors). Prints a pass/fail table; exits 1 if any check fails.
    Test(PluginTestArgs),
}

/// Arguments of `harness run`.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct RunArgs {
    /// The suite to run.
    #[arg(default_value = DEFAULT_SUITE)]
    pub suite: PathBuf,
    /// Result file to write (default: results/<suite>-<UTC time>.json).
    #[arg(short, long)]
    pub out: Option<PathBuf>,
    /// Continue an interrupted run: with --out, that file; otherwise the newest
    /// incomplete result of this suite under --results-dir.
    #[arg(long)]
    pub resume: bool,
    /// Folder for result files.
    #[arg(long, default_value = DEFAULT_RESULTS_DIR)]
    pub results_dir: PathBuf,
    /// No progress bar or per-entry lines; the summary table is still printed.
    #[arg(short, long)]
    pub quiet: bool,
    /// Enter a plugin into a standard suite: KIND=PATH, KIND one of
    /// compressor, batch-policy, checkpoint-policy. It runs in every track of
    /// its kind, next to the track's baseline.
    #[arg(long, value_name = "KIND=PATH")]
    pub plugin: Option<String>,
    /// A configuration key of the entered plugin, KEY=VALUE (VALUE as TOML:
    /// 0.01, true, "text"; bare words are strings). Repeatable.
    #[arg(long = "plugin-config", value_name = "KEY=VALUE")]
    pub plugin_config: Vec<String>,
    /// Run only this track of a standard suite.
    #[arg(long)]
    pub track: Option<String>,
    /// GPUs (ranks) to run on: a standard suite's division (default: the
    /// suite's world_size).
    #[arg(long)]
    pub gpus: Option<u32>,
    /// Record a Chrome/Perfetto trace of one step of every entry (the first
    /// after warm-up, on rank 0): operators, GPU kernels and copies, the
    /// step's phases and plugin calls, in `<out stem>.trace/<entry>.json`.
    /// The profiler slows that step down: measure without it.
    #[arg(long)]
    pub trace: bool,
}

/// Arguments of `harness validate`.
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// The suites to check (each on its own; every problem of every suite
    /// is reported).
    #[arg(required = true)]
    pub suites: Vec<PathBuf>,
}

/// Arguments of `harness report`.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Result files, or folders to search for them (*.json).
    #[arg(required = true)]
    pub results: Vec<PathBuf>,
    /// Where to write LEADERBOARD.md and index.html.
    #[arg(long, default_value = "results")]
    pub out_dir: PathBuf,
    /// The operator's signed reproduction records (`harness reproduce
    /// --key`), or folders holding them: the board ranks the reruns beside
    /// them; a bundle no record reproduces is shown as self-reported, not
    /// ranked.
    #[arg(long, value_name = "RECORDS", num_args = 1.., requires = "public_key")]
    pub reproductions: Vec<PathBuf>,
    /// The operator's public key (FILE.pub of `harness keygen`, or the hex)
    /// that signed the records.
    #[arg(long, value_name = "KEY", requires = "reproductions")]
    pub public_key: Option<String>,
}

/// Arguments of `harness submit`.
#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// The result file of `harness run SUITE --plugin KIND=PATH`.
    pub result: PathBuf,
    /// The bundle folder to create (default: <result stem>.bundle).
    #[arg(short, long)]
    pub out: Option<PathBuf>,
    /// The run's log (default: <result stem>.log, written by harness run).
    #[arg(long)]
    pub log: Option<PathBuf>,
    /// Bundle the plugin's sha256 and size only, not its artifact.
    #[arg(long)]
    pub no_artifacts: bool,
}

/// Arguments of `harness verify`.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// Bundle folders written by `harness submit`.
    #[arg(required = true)]
    pub bundles: Vec<PathBuf>,
    /// A signed reproduction record of the bundle (`harness reproduce
    /// --key`; its signature is RECORD.sig): checks it against the
    /// operator's public key (--public-key).
    #[arg(long, value_name = "RECORD", requires = "public_key")]
    pub reproduction: Option<PathBuf>,
    /// The operator's public key: the FILE.pub of `harness keygen`, or its
    /// 64 hex digits.
    #[arg(long, value_name = "KEY", requires = "reproduction")]
    pub public_key: Option<String>,
}

/// Arguments of `harness reproduce`.
#[derive(Debug, Args)]
pub struct ReproduceArgs {
    /// Bundle folders written by `harness submit`.
    #[arg(required = true)]
    pub bundles: Vec<PathBuf>,
    /// Where the reruns (reruns/<inputs>/) and the records
    /// (<bundle>-<hash>.reproduction.json) go.
    #[arg(long, default_value = "reproductions")]
    pub out: PathBuf,
    /// The operator's secret key (`harness keygen FILE`): signs each record
    /// (RECORD.sig).
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// Train again even where a finished rerun of the same inputs is kept.
    #[arg(long)]
    pub fresh: bool,
    /// No progress bar or per-entry lines while training.
    #[arg(short, long)]
    pub quiet: bool,
}

/// Arguments of `harness keygen`.
#[derive(Debug, Args)]
pub struct KeygenArgs {
    /// The secret key's file (not overwritten); the public key goes to
    /// FILE.pub.
    pub file: PathBuf,
}

/// Arguments of `harness compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// The reference (A).
    pub a: PathBuf,
    /// The candidate (B).
    pub b: PathBuf,
}

/// Arguments of `harness project`.
#[derive(Debug, Args)]
pub struct ProjectArgs {
    /// Result files: one-GPU entries give the step's compute, multi-GPU
    /// entries the gradient buckets and each strategy's collectives and
    /// costs.
    #[arg(required = true)]
    pub results: Vec<PathBuf>,
    /// A cluster, `NODESxGPUS[:key=value,...]`, e.g.
    /// `1-128x8:nvlink=measured,net=100Gbps` (a range of nodes: every power
    /// of two in it); repeatable. Keys: nvlink, nvlink_lat, net, net_lat,
    /// algo (docs/projection.md).
    #[arg(long)]
    pub cluster: Vec<String>,
    /// A `harness bench allreduce` record (`PATH`, or `network=PATH` for
    /// one run over NCCL's network transport), or where no bench ran on a
    /// machine `FILE#ENTRY`: the all-reduce bandwidth that entry measured
    /// in training; repeatable.
    #[arg(long)]
    pub bench: Vec<String>,
    /// Project only these strategies (by name; `allreduce` is the plain
    /// all-reduce whatever its entry's name); repeatable or comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub strategy: Vec<String>,
    /// Also print the projection in short: tokens/s per strategy and
    /// network against the number of GPUs, and the break-even bandwidths.
    #[arg(long)]
    pub summary: bool,
    /// Write the plot (tokens/s against GPUs, one line per strategy and
    /// network) as a standalone SVG.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Write a page with the plot and the tables.
    #[arg(long)]
    pub html: Option<PathBuf>,
    /// The compute slowdown beside collectives, instead of the one fitted
    /// on the overlapped entries of the results.
    #[arg(long)]
    pub slowdown: Option<f64>,
    /// Predict every measured multi-GPU entry of the results from data
    /// that excluded it, and print the error.
    #[arg(long)]
    pub check: bool,
}

/// Arguments of `harness env`.
#[derive(Debug, Args)]
pub struct EnvArgs {
    /// Print JSON (the fingerprint that result files carry).
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `harness bench allreduce`.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct AllreduceArgs {
    /// A result file of a data-parallel run (its `bucket_bytes`).
    #[arg(long)]
    pub bytes_from: PathBuf,
    /// Number of GPUs (one process each).
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// Timed rounds over all buckets.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Issue on the NCCL side stream of overlapped training instead of
    /// libtorch's legacy stream.
    #[arg(long)]
    pub side_stream: bool,
    /// No events or accounting around each collective (what timing costs).
    #[arg(long)]
    pub untimed: bool,
}

/// Arguments of `harness bench checkpoint-read`.
#[derive(Debug, Args)]
pub struct CheckpointReadArgs {
    /// A directory on the disk to measure (the checkpoint goes into a
    /// new folder there and is removed afterwards).
    #[arg(default_value = ".")]
    pub dir: PathBuf,
    /// Size of the checkpoint.
    #[arg(long, default_value_t = 1.5)]
    pub gb: f64,
    /// Keep the checkpoint written (its path goes to stderr).
    #[arg(long)]
    pub keep: bool,
    /// Rounds over all ways of reading.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
}

/// Arguments of `harness plugin new`.
#[derive(Debug, Args)]
pub struct PluginNewArgs {
    /// compressor, batch-policy or checkpoint-policy.
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(crate::suite::TRACK_KINDS))]
    pub kind: String,
    /// The plugin's name (a folder of that name is created).
    pub name: String,
    /// Where to create the folder.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// The harness-sdk crate to depend on (default: a copy of this
    /// harness's own SDK, written into the plugin's folder).
    #[arg(long)]
    pub sdk: Option<PathBuf>,
    /// The plugin's language: rust (a WASM component and a native
    /// library from one crate), c (a native library; compressors),
    /// c-wasm (C built into a WASM component with wit-bindgen, a clang
    /// for wasm32-wasi and wasm-tools; compressors), python or js (a
    /// WASM component built by componentize-py or componentize-js;
    /// compressors).
    #[arg(long, default_value = "rust", value_parser = ["rust", "c", "c-wasm", "python", "js"])]
    pub lang: String,
}

/// Arguments of `harness plugin inspect`.
#[derive(Debug, Args)]
pub struct PluginInspectArgs {
    /// A `.wasm` component or a native library.
    pub path: PathBuf,
}

/// Arguments of `harness plugin bench`.
#[derive(Debug, Args)]
pub struct PluginBenchArgs {
    /// `.wasm` components or native libraries (any kind).
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    /// Timed calls per artifact (default: as many as take about half a
    /// second each way, measured on the warm-up calls: 100 to 200000).
    #[arg(long)]
    pub calls: Option<u64>,
    /// Cold calls, as in training: before each call, write through a
    /// buffer of this many MiB (evicting the caches, as a training step
    /// does between two hooks). 0: warm caches.
    #[arg(long, default_value_t = 0)]
    pub evict_mb: usize,
}

/// Arguments of `harness plugin test`.
#[derive(Debug, Args)]
pub struct PluginTestArgs {
    /// A `.wasm` component or a native library (any kind).
    pub path: PathBuf,
    /// A configuration key of the plugin, KEY=VALUE (VALUE as TOML: 0.01,
    /// true, "text"; bare words are strings). Repeatable.
    #[arg(long = "plugin-config", value_name = "KEY=VALUE")]
    pub plugin_config: Vec<String>,
    /// Simulated ranks (threads over the in-process collective), 1 to 16.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=crate::plugin::test_kit::MAX_RANKS as i64))]
    pub ranks: u32,
    /// Print the report as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// `--plugin-config KEY=VALUE...` as a plugin's configuration table: each
/// VALUE parsed as TOML, or taken as a string when it is not TOML.
fn plugin_config(pairs: &[String]) -> Result<toml::Table, String> {
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
fn entered_plugin(args: &RunArgs) -> Result<Option<crate::suite::standard::Entry>, String> {
    let Some(p) = &args.plugin else {
        return match args.plugin_config.is_empty() {
            true => Ok(None),
            false => Err("--plugin-config needs --plugin KIND=PATH".into()),
        };
    };
    let (kind, path) = p.split_once('=').ok_or_else(|| format!("--plugin {p}: expected KIND=PATH, e.g. compressor=my.wasm"))?;
    if !crate::suite::TRACK_KINDS.contains(&kind) {
        return Err(format!("--plugin {p}: unknown kind `{kind}` (one of: {})", crate::suite::TRACK_KINDS.join(", ")));
    }
    let config = plugin_config(&args.plugin_config)?;
    let path = std::path::absolute(path).map_err(|e| format!("--plugin {p}: {e}"))?;
    Ok(Some(crate::suite::standard::Entry { kind: kind.to_owned(), path, config: (!config.is_empty()).then_some(config) }))
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
        let m = crate::plugin::inspect(&e.path).map_err(|err| format!("--plugin {}: {err:#}", e.path.display()))?;
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
            crate::plugin::Transport::Wasm => "wasm",
            crate::plugin::Transport::Native => "native",
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
        released_suite: crate::suite::standard::released(&suite.source).is_some(),
        tracks,
        gpus: meta.world_size,
        entered,
        unofficial: Vec::new(),
    }))
}

/// Which strategies [`configure_all`] configures.
enum Configure<'a> {
    /// Every strategy of the suite (`harness validate`).
    All,
    /// The strategies of a plugin entered with `--plugin` (`harness run`;
    /// their names).
    Entered(&'a [String]),
}

/// Configures every plugin of the strategies `which` names with the
/// strategy's config (an instance on the CPU, as a rank would make it); the
/// errors, each at the strategy's config key in the suite file, or, for a
/// plugin entered with `--plugin`, at its `--plugin-config` keys, once
/// however many tracks it runs in.
fn configure_all(s: &Suite, set: &crate::plugin::PluginSet, which: Configure<'_>) -> Vec<String> {
    use crate::plugin::Kind;
    let entered: &[String] = match which {
        Configure::All => &[],
        Configure::Entered(names) => names,
    };
    let mut errors: Vec<String> = Vec::new();
    for (i, st) in s.spec.strategies.iter().enumerate() {
        if matches!(which, Configure::Entered(_)) && !entered.contains(&st.name) {
            continue;
        }
        let slots = [
            (&st.compressor, "compressor", "compressor_config", Kind::Compressor, st.compressor_config.as_ref()),
            (&st.batch_policy, "batch_policy", "batch_policy_config", Kind::BatchPolicy, st.batch_policy_config.as_ref()),
            (&st.checkpoint, "checkpoint", "checkpoint_config", Kind::CheckpointPolicy, st.checkpoint_config.as_ref()),
        ];
        for (name, key, config_key, kind, config) in slots {
            if !set.has(name) {
                continue;
            }
            if let Err(e) = set.instance(name, key, kind, config, tch::Device::Cpu) {
                let why = crate::error::without_backtrace(&format!("{e:#}"));
                let error = if entered.contains(&st.name) {
                    format!("error: --plugin-config: {why}\nhint: fix the --plugin-config keys; the plugin says what it accepts")
                } else {
                    let at = if config.is_some() { config_key } else { key };
                    let hint = format!("fix `{at}` of strategy `{}`; the plugin says what it accepts", st.name);
                    s.strategy_error(i, at, format!("strategy `{}`: {why}", st.name), Some(hint)).to_string()
                };
                if !errors.contains(&error) {
                    errors.push(error);
                }
            }
        }
    }
    errors
}

/// Runs the parsed command; returns the process exit code.
pub fn main(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Run(args) => run(args),
        Command::Validate(args) => validate(args),
        Command::Report(args) => report(args),
        Command::Submit(args) => submit(args),
        Command::Verify(args) => verify(args),
        Command::Reproduce(args) => reproduce(args),
        Command::Keygen(args) => keygen(args),
        Command::Compare(args) => compare(args),
        Command::Project(args) => project(args),
        Command::Bench(BenchCommand::Allreduce(args)) => bench_allreduce(args),
        Command::Bench(BenchCommand::CheckpointRead(args)) => bench_checkpoint_read(args),
        Command::Plugin(PluginCommand::New(args)) => plugin_new(args),
        Command::Plugin(PluginCommand::Inspect(args)) => plugin_inspect(args),
        Command::Plugin(PluginCommand::Bench(args)) => plugin_bench(args),
        Command::Plugin(PluginCommand::Test(args)) => plugin_test(args),
        Command::Env(args) => env(args),
    }
}

/// `harness validate`: checks each suite ([`validate_one`]); any invalid
/// suite or plugin is [`exit::INVALID_SUITE`], after all were checked.
fn validate(args: ValidateArgs) -> anyhow::Result<i32> {
    let mut code = exit::OK;
    for suite in &args.suites {
        if validate_one(suite)? != exit::OK {
            code = exit::INVALID_SUITE;
        }
    }
    Ok(code)
}

/// Loads the suite, loads each of its plugins and configures it as the
/// suite does, and prints what it found; an invalid suite or plugin is
/// [`exit::INVALID_SUITE`].
fn validate_one(suite: &Path) -> anyhow::Result<i32> {
    let s = match Suite::load(suite) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return Ok(exit::INVALID_SUITE);
        }
    };
    let dir = s.path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let set = crate::plugin::PluginSet::new(&s.spec.plugins, dir);
    if check_plugins(&s, &set) > 0 {
        return Ok(exit::INVALID_SUITE);
    }
    // Each plugin configured as the suite configures it, so a
    // misspelt key fails here and not when its entry runs.
    let errors = configure_all(&s, &set, Configure::All);
    for e in &errors {
        eprintln!("{e}");
    }
    if !errors.is_empty() {
        return Ok(exit::INVALID_SUITE);
    }
    let plan = s.plan();
    println!(
        "{}: ok ({}, {}, {})",
        printable_path(suite),
        counted(s.spec.workloads.len(), "workload", "workloads"),
        counted(s.strategies().len(), "strategy", "strategies"),
        counted(plan.entries.len(), "entry", "entries")
    );
    Ok(exit::OK)
}

/// Loads every plugin of the suite: prints what each is, or (to stderr) why
/// it cannot be loaded. Returns how many could not.
fn check_plugins(s: &Suite, set: &crate::plugin::PluginSet) -> usize {
    let mut bad = 0;
    for (spec, r) in s.spec.plugins.iter().zip(set.check_all()) {
        match r {
            Ok(m) => {
                let transport = match m.transport {
                    crate::plugin::Transport::Wasm => format!("wasm, contract {}", m.abi),
                    crate::plugin::Transport::Native => "native, unsandboxed".to_owned(),
                };
                // The artifact chose its name and version.
                let line =
                    format!("plugin `{}`: {} {} ({}, {transport}) from {}", spec.name, m.name, m.version, m.kind.name(), m.path.display());
                println!("{}", printable(&line));
            }
            Err(e) => {
                bad += 1;
                eprintln!("error: {}", printable(&e.to_string()));
            }
        }
    }
    bad
}

/// `harness env`: the machine fingerprint, as a table or (`--json`) as
/// result files carry it.
fn env(args: EnvArgs) -> anyhow::Result<i32> {
    let f = device::fingerprint();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&f)?);
    } else {
        print_env(&f);
    }
    Ok(exit::OK)
}

/// `harness run`: runs the suite (with `--plugin`, `--track` and `--gpus`
/// applied to a standard suite) and writes its result file: in this
/// process, or, for a multi-GPU suite not started as a rank, in one rank
/// process per GPU ([`run_ranks`]). An invalid suite is
/// [`exit::INVALID_SUITE`]; a finished run says whether an entry failed.
fn run(args: RunArgs) -> anyhow::Result<i32> {
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
        let set = crate::plugin::PluginSet::new(&suite.spec.plugins, dir);
        let errors = configure_all(&suite, &set, Configure::Entered(&entered));
        if !errors.is_empty() {
            for e in &errors {
                eprintln!("{e}");
            }
            return Ok(exit::INVALID_SUITE);
        }
    }
    let world = suite.spec.suite.world_size as usize;
    if world > 1 && rank_env.is_none() && suite.spec.suite.device != crate::suite::DeviceKind::Cpu && crate::device::gpu_count() > 0 {
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
    crate::plugin::exit_guard::arm(true);
    let result = launch::run_suite(suite, opts, &mut console);
    crate::plugin::exit_guard::arm(false);
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

/// `harness report`: scores result files and submission bundles, and writes
/// LEADERBOARD.md, index.html and the bundles' copies to `--out-dir`
/// (`report::inputs::load`, `report::output::write`).
fn report(args: ReportArgs) -> anyhow::Result<i32> {
    let ReportArgs { results, out_dir, reproductions, public_key } = args;
    let loaded = report::inputs::load(&results, &crate::plugin::inspect_component)?;
    for n in &loaded.notes {
        eprintln!("{n}");
    }
    let operator = match &public_key {
        Some(key) => {
            let (records, notes) = report::reproduction::load_signed(&reproductions, &crate::reproduce::public_key(key)?);
            for n in &notes {
                eprintln!("{n}");
            }
            records
        }
        None => Vec::new(),
    };
    let written = report::output::write(&out_dir, &loaded, &operator)?;
    let verified = loaded.bundles.iter().filter(|b| b.verdict.verified()).count();
    let copies = loaded.bundles.iter().filter(|b| b.same_as.is_some()).count();
    println!(
        "{} result files ({} bundles, {verified} verified{}), {} tables, {} submission tables -> {}, {}",
        loaded.results.len(),
        loaded.bundles.len(),
        if copies == 0 { String::new() } else { format!(", {copies} of them copies of another") },
        written.boards.len(),
        written.submission_boards,
        report::escape::terminal(&written.leaderboard.display().to_string()),
        report::escape::terminal(&written.page.display().to_string())
    );
    if public_key.is_some() {
        let reproduced = operator.iter().filter(|o| o.record.reproduced).count();
        println!("{} signed reproduction records ({reproduced} reproduced): the submission tables rank their reruns", operator.len());
    } else if !loaded.bundles.is_empty() {
        println!("no reproduction records given (--reproductions, --public-key): every submission is shown as self-reported, none ranked");
    }
    Ok(exit::OK)
}

/// `harness submit`: bundles a standard-suite result and verifies the
/// bundle at once; a bundle that breaks a rule is [`exit::NOT_VERIFIED`].
fn submit(args: SubmitArgs) -> anyhow::Result<i32> {
    let SubmitArgs { result, out, log, no_artifacts } = args;
    let opts = crate::submission::SubmitOptions { out, log, no_artifacts };
    let dir = crate::submission::submit(&result, &opts)?;
    println!("bundle: {}", printable_path(&dir));
    let verdict = crate::submission::verify::verify(&dir, &crate::plugin::inspect_component);
    print!("{}", crate::submission::verify::render(&dir, &verdict));
    Ok(if verdict.verified() { exit::OK } else { exit::NOT_VERIFIED })
}

/// `harness verify`: checks each bundle against the rules and prints its
/// verdict; [`exit::NOT_VERIFIED`] if any breaks a rule.
fn verify(args: VerifyArgs) -> anyhow::Result<i32> {
    let mut code = exit::OK;
    for b in &args.bundles {
        let verdict = crate::submission::verify::verify(b, &crate::plugin::inspect_component);
        print!("{}", crate::submission::verify::render(b, &verdict));
        if !verdict.verified() {
            code = exit::NOT_VERIFIED;
        }
    }
    if let (Some(record), Some(key)) = (&args.reproduction, &args.public_key) {
        let [bundle] = args.bundles.as_slice() else { anyhow::bail!("--reproduction checks the record of one bundle; name one") };
        match crate::reproduce::public_key(key).and_then(|k| crate::reproduce::check_signed(bundle, record, &k)) {
            // The record's machine and time are what its signer wrote.
            Ok(r) => {
                println!(
                    "{}: signed reproduction record: {} on {} ({}), {}",
                    printable_path(record),
                    if r.reproduced { "reproduced" } else { "NOT reproduced" },
                    printable(r.machine.gpus.first().map_or(r.machine.cpu.as_str(), |g| g.name.as_str())),
                    printable(&r.machine.hostname),
                    printable(&r.reproduced_at)
                );
                // A genuine record of a failed reproduction checks, but
                // proves the opposite of the claim.
                if !r.reproduced {
                    for d in &r.comparison.differences {
                        println!("  difference: {}", printable(&d.to_string()));
                    }
                    code = exit::NOT_REPRODUCED;
                }
            }
            Err(e) => {
                println!("{}: the reproduction record does not check: {}", printable_path(record), printable(&format!("{e:#}")));
                code = exit::NOT_VERIFIED;
            }
        }
    }
    Ok(code)
}

/// `harness reproduce`: verifies each bundle, trains it again (or takes the
/// kept rerun of the same inputs), compares and writes the record.
fn reproduce(args: ReproduceArgs) -> anyhow::Result<i32> {
    use crate::reproduce::{self as rp, Options};
    let ReproduceArgs { bundles, out, key, fresh, quiet } = args;
    if let Some(k) = &key {
        // A key that cannot sign is found before anything trains.
        let secret = harness_format::files::read_capped(k, harness_format::files::KEY_MAX_BYTES)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .with_context(|| format!("cannot read the key {}", k.display()))?;
        crate::report::reproduction::sign(b"", &secret).with_context(|| format!("{} is not a key `harness keygen` wrote", k.display()))?;
    }
    let opts = Options { out, key, fresh, quiet };
    let mut code = exit::OK;
    for dir in &bundles {
        // Read once: the copy is verified, rerun and hashed into the
        // record; the bundle's folder is not read again.
        let staged = match rp::stage(dir, &opts.out) {
            Ok(s) => s,
            Err(e) => {
                let verdict = crate::submission::verify::verify(dir, &crate::plugin::inspect_component);
                print!("{}", crate::submission::verify::render(dir, &verdict));
                println!("{}: not reproduced: {}", printable_path(dir), printable(&format!("{e:#}")));
                code = exit::NOT_REPRODUCED;
                continue;
            }
        };
        let verdict = crate::submission::verify::verify(&staged.dir, &crate::plugin::inspect_component);
        if !verdict.verified() {
            print!("{}", crate::submission::verify::render(dir, &verdict));
            println!("{}: not reproduced: the bundle does not verify", printable_path(dir));
            code = exit::NOT_REPRODUCED;
            continue;
        }
        let bundle = crate::submission::Bundle::read(&staged.dir)?;
        let rerun = rp::prepare(&staged.dir, &bundle, &opts)?;
        if rerun.done {
            println!(
                "{}: a finished rerun of the same inputs is in {}; comparing with it (--fresh trains again)",
                printable_path(dir),
                printable_path(&rerun.dir)
            );
        } else {
            println!("{}: training it again in {}", printable_path(dir), printable_path(&rerun.dir));
            let exe = std::env::current_exe().context("cannot find the harness executable")?;
            let args = RunArgs {
                suite: rerun.suite.clone(),
                out: Some(rerun.result.clone()),
                resume: rerun.resume,
                results_dir: rerun.dir.clone(),
                quiet: opts.quiet,
                plugin: Some(rerun.plugin.clone()),
                plugin_config: rerun.plugin_config.clone(),
                track: rerun.track.clone(),
                gpus: Some(rerun.gpus),
                trace: false,
            };
            let status = std::process::Command::new(exe).args(Child::Run(args).argv()).status()?;
            // What the child left is this operator's: sealed, so that it is
            // compared or resumed, and nothing planted in its place is.
            rp::seal_rerun(&rerun)?;
            // Failed entries are compared (a claim of success they refute);
            // anything else stopped the rerun.
            if !matches!(status.code(), Some(exit::OK | exit::ENTRY_FAILED)) {
                anyhow::bail!(
                    "the rerun of {} stopped ({status})\nhint: run the same `harness reproduce` again to resume it",
                    dir.display()
                );
            }
        }
        let (record, path) = rp::record(&staged, &bundle, &rerun, &opts)?;
        print!("{}", crate::report::reproduction::render(&record));
        println!("record: {}{}", printable_path(&path), if opts.key.is_some() { " (signed: .sig)" } else { "" });
        if !record.reproduced {
            code = exit::NOT_REPRODUCED;
        }
    }
    Ok(code)
}

/// `harness keygen`: writes a new key pair and prints the public key.
fn keygen(args: KeygenArgs) -> anyhow::Result<i32> {
    let public = crate::reproduce::keygen(&args.file)?;
    let file = printable_path(&args.file);
    println!("secret key: {file} (keep it private; it signs your reproduction records)");
    println!("public key: {public} (also in {file}.pub; publish it with the board)");
    Ok(exit::OK)
}

/// `harness compare`: the two result files side by side.
fn compare(args: CompareArgs) -> anyhow::Result<i32> {
    let ra = results::RunResult::read(&args.a)?;
    let rb = results::RunResult::read(&args.b)?;
    print!("{}", report::compare_table(&[ra], &[rb]));
    Ok(exit::OK)
}

/// `harness project`: the model's projection, or with --check its error
/// on the measured entries.
fn project(args: ProjectArgs) -> anyhow::Result<i32> {
    use report::project;
    let sources = args.results.iter().map(|p| project::Source::read(p)).collect::<anyhow::Result<Vec<_>>>()?;
    let benches = args.bench.iter().map(|b| project::calibrate::Bench::read(b)).collect::<anyhow::Result<Vec<_>>>()?;
    if args.check {
        let c = project::check(&sources, &benches);
        anyhow::ensure!(!c.rows.is_empty(), "nothing to check: {}", c.skipped.join("; "));
        print!("{}", project::render::check(&c));
        return Ok(exit::OK);
    }
    anyhow::ensure!(!args.cluster.is_empty(), "give at least one --cluster (e.g. `1-16x8:net=100Gbps`), or --check");
    let mut clusters = Vec::new();
    for c in &args.cluster {
        clusters.extend(project::Cluster::parse(c)?);
    }
    let p = project::project(&sources, &benches, &clusters, args.slowdown, &args.strategy)?;
    let mut text = project::render::projection(&p);
    if args.summary {
        text.push('\n');
        text.push_str(&project::render::summary(&p));
    }
    print!("{text}");
    let plots = report::html::projection::plots(&p);
    if let Some(path) = &args.svg {
        std::fs::write(path, report::html::projection::stack(&plots)).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.html {
        let page = report::html::projection::page(project::render::LABEL, &plots, &text);
        std::fs::write(path, page).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(exit::OK)
}

/// `harness bench allreduce`: started by hand, starts one rank process per
/// GPU with the same arguments and returns the first failing rank's exit
/// code; as a rank, runs the benchmark, and rank 0 prints its figures.
fn bench_allreduce(args: AllreduceArgs) -> anyhow::Result<i32> {
    let buckets = crate::bench::bucket_bytes(&args.bytes_from)?;
    let argv = Child::BenchAllreduce(args.clone()).argv();
    let rank_env = RankEnv::from_env()?;
    let AllreduceArgs { world, iters, side_stream, untimed, .. } = args;
    match crate::bench::allreduce(rank_env.as_ref(), &buckets, world, iters, side_stream, untimed, &argv)? {
        Allreduce::Launched(code) => Ok(code),
        Allreduce::Ran(figures) => {
            if let Some(f) = figures {
                println!("{f}");
            }
            Ok(exit::OK)
        }
    }
}

/// `harness bench checkpoint-read`: prints the table of write and read speeds.
fn bench_checkpoint_read(args: CheckpointReadArgs) -> anyhow::Result<i32> {
    print!("{}", crate::bench::checkpoint_read(&args.dir, args.gb, args.rounds, args.keep)?);
    Ok(exit::OK)
}

/// `harness plugin new`: creates the plugin's folder and prints how to
/// build and run it.
fn plugin_new(args: PluginNewArgs) -> anyhow::Result<i32> {
    let PluginNewArgs { kind, name, dir, sdk, lang } = args;
    let made = match crate::scaffold::create(&kind, &name, &dir, sdk.as_deref(), &lang) {
        Err(e) if e.is::<crate::scaffold::Usage>() => {
            eprintln!("error: {e}");
            return Ok(exit::USAGE);
        }
        made => made?,
    };
    let made = printable_path(&made);
    println!("created {made}");
    let build = match lang.as_str() {
        "c" => "make",
        "c-wasm" | "python" | "js" => "./build.sh",
        _ => "cargo build --release --target wasm32-wasip2",
    };
    println!("build:  cd {made} && {build}");
    println!("run:    harness run {made}/suite.toml");
    Ok(exit::OK)
}

/// `harness plugin inspect`: prints the artifact's manifest as a
/// `[[plugin]]` table (its strings escaped as TOML, so nothing the
/// artifact chose reaches the terminal raw).
fn plugin_inspect(args: PluginInspectArgs) -> anyhow::Result<i32> {
    let m = crate::plugin::inspect(&args.path)?;
    print!("{}", printable(&crate::scaffold::manifest_toml(&m)));
    Ok(exit::OK)
}

/// `harness plugin bench`: prints the table of hook round trips, and what
/// the host's meter reads around nothing.
fn plugin_bench(args: PluginBenchArgs) -> anyhow::Result<i32> {
    use crate::plugin::bench::{self, Calls, Stage};
    let PluginBenchArgs { paths, calls, evict_mb } = args;
    let bar = indicatif::ProgressBar::new(paths.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("[{pos}/{len}] [{bar:20}] {msg} ({elapsed})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(250));
    let rows = bench::run(&paths, calls.map_or(Calls::Auto, Calls::Exactly), evict_mb, &mut |stage| match stage {
        Stage::Loading(p) => bar.set_message(format!("{}: loading", printable_path(p))),
        Stage::Timing(p, n) => bar.set_message(format!("{}: timing {n} calls", printable_path(p))),
        Stage::Done(_) => bar.inc(1),
    });
    bar.finish_and_clear();
    // The table names the artifacts by their paths, and those that failed
    // with their errors.
    print!("{}", printable(&bench::table(&rows)));
    let calls = rows.iter().filter_map(|r| r.timed.as_ref().ok()).map(|t| t.calls).max();
    let floor = bench::clock_floor(calls.unwrap_or(bench::AUTO_MIN_CALLS));
    println!(
        "p50..mean: the host's own per-call meter, which reads p50 {:.0} ns, p99 {:.0} ns around nothing here. \
         back to back: the whole cost to the host per call, the meter included.{}",
        floor.p50_ms * 1e6,
        floor.p99_ms * 1e6,
        if evict_mb > 0 { format!(" Each metered call followed a write through {evict_mb} MiB (cold caches).") } else { String::new() }
    );
    let failed = rows.iter().filter(|r| r.timed.is_err()).count();
    if failed > 0 {
        eprintln!("error: {failed} of {} artifacts failed (the FAILED lines under the table say why)", rows.len());
        return Ok(exit::ARTIFACT_FAILED);
    }
    Ok(exit::OK)
}

/// `harness plugin test`: runs the test kit on the artifact and prints its
/// table (or its report as JSON); [`exit::PLUGIN_TEST_FAILED`] if a check
/// failed.
fn plugin_test(args: PluginTestArgs) -> anyhow::Result<i32> {
    use crate::plugin::test_kit;
    let config = match plugin_config(&args.plugin_config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {}", printable(&e));
            return Ok(exit::USAGE);
        }
    };
    let report = test_kit::run(&args.path, &config, args.ranks as usize);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", printable(&test_kit::table(&report)));
    }
    let failed = report.checks.iter().filter(|c| c.status == test_kit::Status::Fail).count();
    if failed > 0 {
        eprintln!("error: {failed} of {} checks failed (the FAILED lines say what was seen)", report.checks.len());
        return Ok(exit::PLUGIN_TEST_FAILED);
    }
    Ok(exit::OK)
}

/// A `harness` process that harness starts itself, as the options it is
/// started with: a rank of a multi-GPU `harness run`, or of `harness bench
/// allreduce`. [`Child::argv`] is the one place their command lines are
/// written; [`Cli`] parses them back to the same options.
#[derive(Debug, Clone, PartialEq)]
pub enum Child {
    /// A rank of `harness run` (started by [`crate::launch::launch_local_ranks`]).
    Run(RunArgs),
    /// A rank of `harness bench allreduce`.
    BenchAllreduce(AllreduceArgs),
}

impl Child {
    /// The arguments to start `harness` with (the program name not included).
    /// Options at their defaults are left out.
    pub fn argv(&self) -> Vec<OsString> {
        match self {
            Child::Run(a) => Argv::default()
                .arg("run")
                .arg(&a.suite)
                .opt("--out", &a.out)
                .flag("--quiet", a.quiet)
                .flag("--trace", a.trace)
                .opt("--plugin", &a.plugin)
                .opt("--track", &a.track)
                .opt("--plugin-config", &a.plugin_config)
                .opt("--gpus", a.gpus.map(|n| n.to_string()))
                .opt("--results-dir", Some(&a.results_dir).filter(|d| d.as_os_str() != DEFAULT_RESULTS_DIR))
                .flag("--resume", a.resume),
            Child::BenchAllreduce(a) => Argv::default()
                .arg("bench")
                .arg("allreduce")
                .opt("--bytes-from", [&a.bytes_from])
                .opt("--world", [a.world.to_string()])
                .opt("--iters", [a.iters.to_string()])
                .flag("--side-stream", a.side_stream)
                .flag("--untimed", a.untimed),
        }
        .0
    }
}

/// A command line being written ([`Child::argv`]).
#[derive(Default)]
struct Argv(Vec<OsString>);

impl Argv {
    /// A word of its own: a subcommand, a positional argument.
    fn arg(mut self, a: impl Into<OsString>) -> Argv {
        self.0.push(a.into());
        self
    }

    /// `name` if `on`.
    fn flag(self, name: &str, on: bool) -> Argv {
        if on {
            self.arg(name)
        } else {
            self
        }
    }

    /// `name VALUE` for each of `values` (none, one, or a repeated option's).
    fn opt<V: Into<OsString>>(self, name: &str, values: impl IntoIterator<Item = V>) -> Argv {
        values.into_iter().fold(self, |argv, v| argv.arg(name).arg(v))
    }
}

fn print_env(f: &device::Fingerprint) {
    print!("{}", printable(&env_text(f)));
}

/// `harness env`'s lines. The strings come from the host (its name, the
/// CPU's and the GPUs' names, the libraries' version strings), which a
/// terminal could act on: the caller escapes them.
fn env_text(f: &device::Fingerprint) -> String {
    use std::fmt::Write;
    let na = |o: &Option<String>| o.clone().unwrap_or_else(|| "not found".into());
    let mut out = String::new();
    let mut line = |text: String| {
        let _ = writeln!(out, "{text}");
    };
    line(format!("harness   {} ({})", f.harness_version, f.git_revision));
    line(format!("host      {} ({})", f.hostname, f.os));
    line(format!("cpu       {} ({} cores), {} memory", f.cpu, f.cpu_cores, report::bytes(f.memory_bytes)));
    if f.gpus.is_empty() {
        line("gpus      none usable (training runs on CPU)".into());
    }
    for g in &f.gpus {
        line(format!("gpu {}     {} ({}, compute {})", g.index, g.name, report::bytes(g.memory_bytes), g.compute_capability));
    }
    line(format!("driver    {}", na(&f.driver)));
    line(format!(
        "cuda      {} (libtorch build){}",
        na(&f.cuda),
        f.cuda_driver_api.as_ref().map(|v| format!(", driver supports {v}")).unwrap_or_default()
    ));
    line(format!("libtorch  {}{}", na(&f.libtorch), device::libtorch_dir().map(|d| format!(" at {}", d.display())).unwrap_or_default()));
    line(format!("nccl      {}", na(&f.nccl)));
    if !f.environment.is_empty() {
        line(format!("env       {}", f.environment.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `argv`, parsed as `harness`'s command line.
    fn parse(argv: Vec<OsString>) -> Command {
        let argv = std::iter::once(OsString::from("harness")).chain(argv);
        Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{e}")).command
    }

    fn parse_run(words: &[&str]) -> RunArgs {
        match parse(words.iter().map(OsString::from).collect()) {
            Command::Run(a) => a,
            c => panic!("{c:?}"),
        }
    }

    fn parse_allreduce(words: &[&str]) -> AllreduceArgs {
        match parse(words.iter().map(OsString::from).collect()) {
            Command::Bench(BenchCommand::Allreduce(a)) => a,
            c => panic!("{c:?}"),
        }
    }

    #[test]
    fn a_run_ranks_command_line_parses_back_to_its_options() {
        let plain = parse_run(&["run"]);
        let full = RunArgs {
            suite: "suites/standard/v1.toml".into(),
            out: Some("/tmp/r s/out.json".into()),
            resume: true,
            results_dir: "elsewhere".into(),
            quiet: true,
            plugin: Some("compressor=/p/topk.wasm".into()),
            plugin_config: vec!["ratio=0.01".into(), "name=\"a b\"".into()],
            track: Some("compression".into()),
            gpus: Some(4),
            trace: true,
        };
        let out_only = RunArgs { out: Some("r.json".into()), ..plain.clone() };
        for args in [plain, full, out_only] {
            let child = Child::Run(args.clone());
            match parse(child.argv()) {
                Command::Run(back) => assert_eq!(back, args),
                c => panic!("{c:?}"),
            }
        }
    }

    #[test]
    fn a_run_ranks_command_line_leaves_defaults_out() {
        let args = parse_run(&["run", "s.toml", "--out", "r.json", "--gpus", "2"]);
        let argv = Child::Run(RunArgs { resume: true, ..args }).argv();
        assert_eq!(argv, ["run", "s.toml", "--out", "r.json", "--gpus", "2", "--resume"]);
    }

    #[test]
    fn an_allreduce_ranks_command_line_parses_back_to_its_options() {
        let plain = parse_allreduce(&["bench", "allreduce", "--bytes-from", "r.json"]);
        let full = AllreduceArgs { bytes_from: "a b/r.json".into(), world: 8, iters: 3, side_stream: true, untimed: true };
        assert_eq!(
            Child::BenchAllreduce(plain.clone()).argv(),
            ["bench", "allreduce", "--bytes-from", "r.json", "--world", "2", "--iters", "20"]
        );
        for args in [plain, full] {
            match parse(Child::BenchAllreduce(args.clone()).argv()) {
                Command::Bench(BenchCommand::Allreduce(back)) => assert_eq!(back, args),
                c => panic!("{c:?}"),
            }
        }
    }

    #[test]
    fn harness_env_shows_the_hosts_strings_escaped() {
        let f = device::Fingerprint {
            hostname: "node\u{1b}]0;owned\u{7}".into(),
            os: "linux".into(),
            cpu: "cpu \u{202e}x".into(),
            cpu_cores: 2,
            memory_bytes: 1 << 30,
            gpus: vec![device::GpuInfo { index: 0, name: "H100\u{1b}[2J".into(), memory_bytes: 1 << 30, compute_capability: "9.0".into() }],
            driver: Some("580".into()),
            cuda: None,
            cuda_driver_api: None,
            libtorch: None,
            nccl: Some("2.28\u{9b}".into()),
            harness_version: "0".into(),
            git_revision: "r".into(),
            cpu_kernels: None,
            environment: [("OMP_NUM_THREADS".to_owned(), "4\u{1b}[2J".to_owned())].into(),
        };
        let shown = printable(&env_text(&f)).into_owned();
        assert!(!shown.chars().any(crate::fmt::withheld), "{shown:?}");
        for part in [
            r"node\u{1b}]0;owned\u{7}",
            r"cpu \u{202e}x",
            r"H100\u{1b}[2J",
            r"2.28\u{9b}",
            "cuda      not found",
            r"env       OMP_NUM_THREADS=4\u{1b}[2J",
        ] {
            assert!(shown.contains(part), "{part} in {shown}");
        }
        assert_eq!(shown.lines().count(), 9, "{shown}");
    }
}
