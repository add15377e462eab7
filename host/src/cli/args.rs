//! The command line's clap types: [`Cli`] and its subcommands' arguments.
//!
//! The doc comments of the argument structs are clap's help text, where
//! `<suite>` and the like are plain placeholders, not HTML tags.
#![allow(rustdoc::invalid_html_tags)]

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use harness_format::suite::DEFAULT_SUITE;

/// `harness run`'s folder for result files.
pub(super) const DEFAULT_RESULTS_DIR: &str = "results";

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
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(harness_format::suite::TRACK_KINDS))]
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
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=harness_sandbox::plugin::test_kit::MAX_RANKS as i64))]
    pub ranks: u32,
    /// Print the report as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}
