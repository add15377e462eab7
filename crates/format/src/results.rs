//! Result files: the JSON a run leaves under `results/`, written atomically
//! after every entry. The format is documented in `docs/results-format.md`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::histogram::LatencySummary;
use crate::machine::Fingerprint;
use crate::suite::{PlanEntry, Suite};

/// Version of the result format.
///
/// Changelog:
/// - 1: first version (suite, plan, entries with metrics and HDR histograms,
///   machine fingerprint).
/// - 2: classification accuracy: `final_eval_accuracy`, `best_accuracy`,
///   `target_accuracy` and `accuracy_curve` in an entry's metrics (absent
///   for models that do not classify); the model `vision`, its `image`
///   and, for ViTs, `patch`. Additive since: the fingerprint's
///   `cpu_kernels` (the level libtorch's CPU kernels ran at; absent in
///   older files).
pub const FORMAT_VERSION: u32 = 2;

/// Errors reading or writing result files.
#[derive(Debug, thiserror::Error)]
pub enum ResultsError {
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    /// Not read: too large ([`crate::files::RESULT_MAX_BYTES`]), missing,
    /// or not a file.
    #[error(transparent)]
    File(#[from] crate::files::FileError),
    #[error("{path} is not a harness result file: {source}")]
    Parse { path: PathBuf, source: serde_json::Error },
    #[error("{path} has result format {found}; this harness reads format {FORMAT_VERSION} and older (upgrade harness)")]
    TooNew { path: PathBuf, found: u32 },
}

/// A whole run: what was asked, where, and what came out.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunResult {
    pub format_version: u32,
    pub suite: SuiteRecord,
    pub machine: Fingerprint,
    pub plan: Vec<PlanEntry>,
    pub entries: Vec<EntryResult>,
    /// True once every planned entry has a result.
    pub complete: bool,
    pub started_at: String,
    pub updated_at: String,
    /// A standard-suite run with entered plugins (`harness run SUITE
    /// --plugin KIND=PATH`): what was entered and whether the run is
    /// official. Absent otherwise, and in files written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submission: Option<Submission>,
    /// The `HARNESS_*` switches that changed the measured work, where they
    /// differ from their defaults (`crate::switches::Switches::recorded`):
    /// variable to value, e.g. `HARNESS_FUSED_MLP` -> `0`. Absent for a
    /// run with every switch at its default, and in older files.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub switches: BTreeMap<String, String>,
}

/// What a submission run entered, and under which rules it ran.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Submission {
    /// The standard suite's version (`[suite] version`), if it has one.
    pub suite_version: Option<String>,
    /// The hardware class the suite is for (`[suite.hardware] class`).
    pub hardware_class: Option<String>,
    /// Whether the suite's text is byte-identical to a standard suite this
    /// harness releases (`suite::standard::RELEASED`).
    pub released_suite: bool,
    /// The tracks that ran.
    pub tracks: Vec<String>,
    /// GPUs (ranks) the run used.
    pub gpus: u32,
    /// The plugins entered.
    pub entered: Vec<EnteredPlugin>,
    /// Why the run is unofficial, one sentence each; empty when official.
    pub unofficial: Vec<String>,
}

impl Submission {
    /// Why this run of `suite` on `machine` is not official, one sentence each
    /// (docs/rules.md): a suite that is not byte-identical to a released one,
    /// other hardware (on the CPU class, a CPU without AVX2 and FMA or
    /// libtorch's CPU kernels not held to them), a GPU count outside the
    /// divisions, a native plugin,
    /// `HARNESS_*` switches that changed the measured work (`switches`, as
    /// the result records them).
    pub fn unofficial_reasons(&self, suite: &Suite, machine: &Fingerprint, switches: &BTreeMap<String, String>) -> Vec<String> {
        let s = self;
        let mut why = Vec::new();
        if !s.released_suite {
            why.push(format!("{} is not a released standard suite (edited, or from another harness version)", suite.path.display()));
        }
        match &suite.spec.suite.hardware {
            None => why.push("the suite declares no hardware class".into()),
            Some(h) => {
                let gpu = machine.gpus.first().map(|g| g.name.clone());
                match (h.gpu.is_empty(), gpu) {
                    (true, Some(g)) if suite.spec.suite.device != crate::suite::DeviceKind::Cpu => {
                        why.push(format!("ran on {g}; the suite is for the CPU"))
                    }
                    (false, None) => why.push(format!("ran without a GPU; the suite is for {} ({})", h.gpu, h.class)),
                    (false, Some(g)) if !g.contains(&h.gpu) => why.push(format!("ran on {g}; the suite is for {} ({})", h.gpu, h.class)),
                    _ => {}
                }
                if !h.gpus.contains(&s.gpus) {
                    why.push(format!("ran on {} GPUs (ranks); the suite's divisions are {:?}", s.gpus, h.gpus));
                }
                if h.class == crate::machine::CPU_CLASS {
                    why.extend(crate::machine::cpu_class_problem(machine));
                }
            }
        }
        for p in s.entered.iter().filter(|p| p.transport != "wasm") {
            why.push(format!("the entered plugin {} is a native library (unsandboxed); submissions are WebAssembly components", p.name));
        }
        if !switches.is_empty() {
            why.push(format!(
                "it ran with switches that change the measured work ({}); official runs leave every HARNESS_* switch at its default",
                crate::switches::line(switches)
            ));
        }
        why
    }
}

/// One plugin entered into a standard suite.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct EnteredPlugin {
    /// "compressor", "batch-policy" or "checkpoint-policy".
    pub kind: String,
    /// The plugin's own name and version (`info`).
    pub name: String,
    pub version: String,
    /// "wasm" or "native".
    pub transport: String,
    /// The artifact as given, its sha256 (hex) and size.
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
    /// `--plugin-config` keys, as TOML text.
    pub config: String,
    /// The strategies in the plan that run it, one per track.
    pub strategies: Vec<String>,
}

/// The suite as it was run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SuiteRecord {
    pub name: String,
    pub path: String,
    pub sha256: String,
    /// The suite file's full text, so a result explains itself.
    pub text: String,
}

/// How an entry ended.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum EntryStatus {
    Ok,
    Failed {
        error: String,
        /// What kind of failure (`error::EntryError::kind`): out-of-memory,
        /// plugin, rank-lost, replicas-diverged, non-finite-loss, libtorch,
        /// other. Absent in files written before it existed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kind: Option<String>,
    },
}

/// One entry's outcome.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EntryResult {
    pub id: String,
    pub workload: String,
    pub strategy: String,
    pub repeat: u32,
    pub seed: u64,
    #[serde(flatten)]
    pub status: EntryStatus,
    pub device: String,
    pub metrics: Option<Metrics>,
    /// Serialized HDR histograms (V2, base64), nanoseconds: "step", one per
    /// phase, and on CUDA `"host.<phase>"` for the host side of device phases.
    pub histograms: BTreeMap<String, String>,
}

/// The figures of one entry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct Metrics {
    pub model: serde_json::Value,
    pub parameters: i64,
    pub precision: String,
    pub steps: u64,
    /// Steps left out of timing at the start.
    pub warmup_steps: u64,
    pub tokens: u64,
    pub samples: u64,
    /// Wall time of training, evaluation excluded.
    pub train_time_s: f64,
    /// Throughput after warm-up.
    pub tokens_per_s: f64,
    pub samples_per_s: f64,
    pub step: Option<LatencySummary>,
    pub phases: BTreeMap<String, LatencySummary>,
    /// CUDA only: host time spent issuing each device phase.
    #[serde(default)]
    pub host_phases: BTreeMap<String, LatencySummary>,
    pub flops_per_token: f64,
    pub achieved_tflops: f64,
    /// Model FLOPs utilisation against `peak_tflops`, if a peak is known.
    pub mfu: Option<f64>,
    pub peak_tflops: Option<f64>,
    pub memory: MemoryRecord,
    pub final_train_loss: Option<f64>,
    pub final_eval_loss: Option<f64>,
    /// The best reachable loss of the data, when known.
    pub loss_floor: Option<f64>,
    pub target_loss: Option<f64>,
    /// Training seconds until the eval loss first reached the target.
    pub time_to_target_s: Option<f64>,
    pub steps_to_target: Option<u64>,
    /// (step, training seconds, train loss), subsampled to at most 512 points.
    pub loss_curve: Vec<(u64, f64, f64)>,
    /// (step, training seconds, eval loss) at every evaluation.
    pub eval_curve: Vec<(u64, f64, f64)>,
    /// Classifiers: top-1 accuracy on the eval set at the last evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_eval_accuracy: Option<f64>,
    /// Classifiers: the best reachable top-1 accuracy of the data, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_accuracy: Option<f64>,
    /// The target eval accuracy (`target_accuracy`); `time_to_target_s`
    /// and `steps_to_target` then refer to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_accuracy: Option<f64>,
    /// Classifiers: (step, training seconds, top-1 accuracy) at every
    /// evaluation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accuracy_curve: Vec<(u64, f64, f64)>,
    /// fp16: steps skipped because gradients overflowed.
    pub skipped_steps: u64,
    /// Bytes this rank sent in training collectives (ring accounting).
    pub bytes_on_wire: u64,
    /// Ranks that trained this entry (throughput counts all of them).
    #[serde(default = "one")]
    pub world_size: u32,
    /// Training collectives this rank issued.
    #[serde(default)]
    pub collectives: u64,
    /// Measured latency of each collective.
    #[serde(default)]
    pub collective: Option<LatencySummary>,
    /// Latency after link emulation, when a link was emulated.
    #[serde(default)]
    pub collective_emulated: Option<LatencySummary>,
    /// Size in bytes of each gradient bucket reduced per step (world > 1).
    #[serde(default)]
    pub bucket_bytes: Vec<u64>,
    /// How many of those buckets the last step left unzeroed at its start,
    /// the layers writing their gradients over the stale buffers
    /// (`HARNESS_UNZEROED_GRADS`); absent when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unzeroed_buckets: Option<u32>,
    /// All-reduce bus bandwidth, GB/s (nccl-tests: bytes / time x 2(n-1)/n).
    #[serde(default)]
    pub busbw_gbs: Option<f64>,
    /// The same under link emulation.
    #[serde(default)]
    pub busbw_emulated_gbs: Option<f64>,
    /// Per kind of training collective (`all_reduce`, `all_gather`,
    /// `reduce_scatter`), for the kinds issued: counts, bytes and bandwidth.
    #[serde(default)]
    pub collective_ops: BTreeMap<String, CollectiveOpRecord>,
    /// "built-in", "wasm", or "native (unsandboxed)" when any plugin is native.
    pub strategy_runtime: String,
    /// The gradients' reduction (the all-reduces, or ZeRO's
    /// reduce-scatters) ran during the backward pass (NCCL side stream,
    /// started as buckets filled).
    #[serde(default)]
    pub overlapped_reduction: bool,
    /// The plugins the entry ran, with the time inside their calls.
    #[serde(default)]
    pub plugins: Vec<crate::plugin::PluginRecord>,
    /// (step, micro-batch, accumulation steps) at the start and at every
    /// change the batch policy made.
    #[serde(default)]
    pub batch_changes: Vec<(u64, u32, u32)>,
    /// Useful steps per wall second under injected failures; None when the
    /// entry injected none.
    #[serde(default)]
    pub goodput_steps_per_s: Option<f64>,
    /// Checkpoints written during the entry.
    #[serde(default)]
    pub checkpoints_written: u64,
    /// Checkpoints, injected failures and out-of-memory retries, when the
    /// entry had any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resilience: Option<ResilienceRecord>,
    /// ZeRO stage of the strategy (0: plain data parallelism, or one rank).
    #[serde(default)]
    pub zero: u8,
    /// Bytes of optimizer state rank 0 held at the end (under ZeRO, its shard's).
    #[serde(default)]
    pub optimizer_state_bytes: u64,
    /// Most bytes of gradient buffers rank 0 held at an optimizer step.
    #[serde(default)]
    pub gradient_bytes: u64,
    /// Every rank's own memory figures, in rank order.
    #[serde(default)]
    pub ranks: Vec<RankRecord>,
    /// Whether the loss came from harness's fused cross-entropy kernel
    /// (bf16 on CUDA) rather than libtorch's cross_entropy.
    #[serde(default)]
    pub fused_cross_entropy: bool,
    /// Whether residual adds and LayerNorms ran through harness's fused
    /// kernel (`kernels = "fused"`, bf16 on CUDA, the `gpt` family).
    #[serde(default)]
    pub fused_layer_norm: bool,
    /// Steps that ran as replays of the step captured as a CUDA graph
    /// (`cuda_graph`, one GPU); 0 when every step ran eagerly.
    #[serde(default)]
    pub cuda_graph_steps: u64,
    /// What NCCL ran with (multi-GPU entries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nccl: Option<NcclRecord>,
}

/// What NCCL ran an entry with, as rank 0 saw it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct NcclRecord {
    /// NCCL's version, as NCCL printed it ("2.27.3+cuda12.9"), else as
    /// `ncclGetVersion` gives it.
    pub version: Option<String>,
    /// The NCCL_* variables in the rank's environment (the strategy's
    /// `nccl` and `nccl_transport` settings, and any exported before the
    /// run), without the debug settings harness uses to read the transports.
    pub settings: BTreeMap<String, String>,
    /// The transports NCCL chose for rank 0's connections, from its debug
    /// output: "P2P/CUMEM/read" or "P2P/IPC" (NVLink or PCIe peer to peer),
    /// "SHM/direct/direct" (shared memory), "NET/Socket/0", "NET/IB/0"
    /// (the network), "NVLS" (NVLink SHARP) and so on.
    pub transports: Vec<String>,
    /// Why the transports are unknown, when they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

fn one() -> u32 {
    1
}

/// One kind of collective's figures on rank 0 (nccl-tests conventions).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct CollectiveOpRecord {
    /// Collectives of this kind issued.
    pub collectives: u64,
    /// Sum of their sizes: the buffer reduced (all-reduce), gathered
    /// (all-gather) or reduced before scattering (reduce-scatter).
    pub bytes: u64,
    /// Bytes sent: 2(n-1)/n of the size for an all-reduce, (n-1)/n otherwise.
    pub bytes_on_wire: u64,
    /// Measured latency after warm-up.
    pub latency: Option<LatencySummary>,
    /// Bus bandwidth, GB/s: size / time x 2(n-1)/n (all-reduce) or (n-1)/n.
    pub busbw_gbs: Option<f64>,
    /// The same with emulated times, when a link was emulated.
    pub busbw_emulated_gbs: Option<f64>,
}

/// One rank's own memory figures.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct RankRecord {
    pub rank: u32,
    /// The rank's high-water marks (thread ranks share one process: its RSS).
    pub memory: MemoryRecord,
    /// Bytes of optimizer state the rank held at the end.
    pub optimizer_state_bytes: u64,
    /// Most bytes of gradient buffers the rank held at an optimizer step.
    pub gradient_bytes: u64,
}

/// Memory high-water marks. The device figures include what harness holds
/// beside the caching allocator for the whole entry (the gradient buffers
/// in NCCL's symmetric memory where the copy engines gather them,
/// `HARNESS_CE_GATHER`, and ZeRO's parameters there).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct MemoryRecord {
    /// Peak resident set of the process during the entry.
    pub peak_rss_bytes: Option<u64>,
    /// CUDA caching allocator: peak bytes in tensors.
    pub peak_device_allocated_bytes: Option<i64>,
    /// CUDA caching allocator: peak bytes reserved from the driver.
    pub peak_device_reserved_bytes: Option<i64>,
    /// CUDA caching allocator: the largest peak of bytes in tensors within
    /// one training step (evaluation excluded: what a step needs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_step_allocated_bytes: Option<i64>,
}

/// Current UTC time, RFC 3339.
pub fn now() -> String {
    time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339).unwrap_or_default()
}

impl RunResult {
    /// An empty result for a suite about to run.
    pub fn new(suite: &Suite, machine: Fingerprint) -> RunResult {
        let t = now();
        RunResult {
            format_version: FORMAT_VERSION,
            suite: SuiteRecord {
                name: suite.spec.suite.name.clone(),
                path: suite.path.display().to_string(),
                sha256: suite.sha256.clone(),
                text: suite.source.clone(),
            },
            machine,
            plan: suite.plan().entries,
            entries: Vec::new(),
            complete: false,
            started_at: t.clone(),
            updated_at: t,
            submission: None,
            switches: BTreeMap::new(),
        }
    }

    /// Reads a result file, at most [`crate::files::RESULT_MAX_BYTES`] of
    /// it, refusing formats newer than this build's.
    pub fn read(path: &Path) -> Result<RunResult, ResultsError> {
        let bytes = crate::files::read_capped(path, crate::files::RESULT_MAX_BYTES)?;
        RunResult::parse(&String::from_utf8_lossy(&bytes), path)
    }

    /// Parses a result file's text (read elsewhere, e.g. through a bounded
    /// reader); `path` names it in errors. Refuses formats newer than this
    /// build's.
    pub fn parse(text: &str, path: &Path) -> Result<RunResult, ResultsError> {
        let probe: serde_json::Value = serde_json::from_str(text).map_err(|source| ResultsError::Parse { path: path.into(), source })?;
        let found = probe.get("format_version").and_then(|v| v.as_u64()).unwrap_or(0) as u32;
        if found > FORMAT_VERSION {
            return Err(ResultsError::TooNew { path: path.into(), found });
        }
        serde_json::from_value(probe).map_err(|source| ResultsError::Parse { path: path.into(), source })
    }

    /// Ids of entries that have a result.
    pub fn done_ids(&self) -> std::collections::BTreeSet<String> {
        self.entries.iter().map(|e| e.id.clone()).collect()
    }

    /// Writes the file atomically: a temporary file in the same folder,
    /// fsync, rename over the target, fsync of the folder. A reader (or a
    /// crash) sees the old file or the new one, never half of one.
    /// Adds an entry's record, keeping the entries in plan order whatever
    /// order they ran in (resume, relaunched ranks).
    pub fn add_entry(&mut self, record: EntryResult) {
        self.entries.push(record);
        let plan = &self.plan;
        let order = |id: &str| plan.iter().position(|p| p.id == id).unwrap_or(usize::MAX);
        self.entries.sort_by_key(|e| order(&e.id));
    }

    pub fn write_atomic(&mut self, path: &Path) -> Result<(), ResultsError> {
        self.updated_at = now();
        self.complete = self.plan.iter().all(|p| self.entries.iter().any(|e| e.id == p.id));
        let json = serde_json::to_vec_pretty(self).expect("results serialize");
        write_atomic(path, &json)
    }
}

/// Atomic replace of `path` with `bytes` (see [`RunResult::write_atomic`]).
/// The file gets the permissions `std::fs::write` would give it (0666 less
/// the umask: 0644 with the usual 022), not the temporary file's 0600, so
/// results and leaderboards can be read by others and served.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ResultsError> {
    let err = |source| ResultsError::Write { path: path.into(), source };
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut builder = tempfile::Builder::new();
    builder.prefix(".harness-").suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let mut tmp = builder.tempfile_in(dir).map_err(err)?;
    tmp.write_all(bytes).map_err(err)?;
    tmp.as_file().sync_all().map_err(err)?;
    tmp.persist(path).map_err(|e| err(e.error))?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(err)?;
    Ok(())
}

/// The newest incomplete result in `dir` for a suite name, for `--resume`.
pub fn find_resumable(dir: &Path, suite_name: &str) -> Option<PathBuf> {
    let mut best: Option<(String, PathBuf)> = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        if p.extension().and_then(|x| x.to_str()) != Some("json") {
            continue;
        }
        if let Ok(r) = RunResult::read(&p) {
            if r.suite.name == suite_name && !r.complete && best.as_ref().is_none_or(|(t, _)| r.started_at > *t) {
                best = Some((r.started_at, p));
            }
        }
    }
    best.map(|b| b.1)
}

/// The default path of a new result file, in `dir`. Validation refuses a
/// suite name that is not a plain name; one that reaches here unchecked
/// still cannot leave `dir`: every character but ASCII letters, digits,
/// `-`, `_` and `.` becomes `_` (the name is followed by the time stamp, so
/// the file name is never `.` or `..`).
pub fn default_path(dir: &Path, suite_name: &str) -> PathBuf {
    let stamp = time::OffsetDateTime::now_utc()
        .format(time::macros::format_description!("[year][month][day]T[hour][minute][second]Z"))
        .unwrap_or_default();
    let name: String = suite_name.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    dir.join(format!("{name}-{stamp}.json"))
}

/// The log file kept next to the result file `result`: the run's lines
/// (`harness submit` bundles it).
pub fn log_path(result: &Path) -> PathBuf {
    result.with_extension("log")
}

/// Result files for tests of what reads them.
#[cfg(any(test, feature = "testing"))]
pub mod testing {
    use super::*;

    /// A 2-core CPU machine ([`crate::machine::testing::machine`]).
    pub fn machine() -> Fingerprint {
        crate::machine::testing::machine()
    }

    /// A suite `name` (with `[suite] version`, if given) of one workload
    /// `w`, and a result of it with one finished entry of strategy
    /// `baseline` on the CPU at `tokens_per_s`.
    pub fn result(name: &str, version: Option<&str>, tokens_per_s: f64) -> RunResult {
        let version = version.map_or(String::new(), |v| format!("version='{v}'\n"));
        let suite = Suite::parse(
            Path::new("s.toml"),
            format!("[suite]\nname='{name}'\n{version}[[workload]]\nname='w'\nmodel={{kind='mlp',preset='tiny'}}\ndata={{kind='synthetic',vocab=8}}\nbatch=2\nseq_len=4\nsteps=2\noptimizer={{kind='sgd',lr=0.1}}\n"),
        )
        .unwrap();
        let machine = Fingerprint { libtorch: Some("2.11.0".into()), ..machine() };
        let mut r = RunResult::new(&suite, machine);
        let mut h = crate::histogram::new_histogram();
        h.record(12345).unwrap();
        r.entries.push(EntryResult {
            id: "w/baseline/r0".into(),
            workload: "w".into(),
            strategy: "baseline".into(),
            repeat: 0,
            seed: 1,
            status: EntryStatus::Ok,
            device: "cpu".into(),
            metrics: Some(Metrics { steps: 2, tokens_per_s, loss_curve: vec![(1, 0.1, 2.0)], ..Default::default() }),
            histograms: [("step".to_owned(), crate::histogram::encode(&h))].into(),
        });
        r.complete = true;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RunResult {
        testing::result("s", None, 1.5)
    }

    #[test]
    fn result_files_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.json");
        let mut r = sample();
        r.write_atomic(&p).unwrap();
        assert!(r.complete);
        let back = RunResult::read(&p).unwrap();
        assert_eq!(back, r);
        let h = crate::histogram::decode(&back.entries[0].histograms["step"]).unwrap();
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn switches_are_written_only_when_set_and_older_files_read_without_them() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.json");
        let mut r = sample();
        r.write_atomic(&p).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(!text.contains("\"switches\""), "a default run's file has no `switches`");
        // A file written before the field existed reads as a default run.
        let mut old: serde_json::Value = serde_json::from_str(&text).unwrap();
        old.as_object_mut().unwrap().remove("switches");
        std::fs::write(&p, old.to_string()).unwrap();
        assert!(RunResult::read(&p).unwrap().switches.is_empty());

        r.switches = [("HARNESS_FUSED_MLP".to_owned(), "0".to_owned()), ("HARNESS_OVERLAP".to_owned(), "0".to_owned())].into();
        r.write_atomic(&p).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(v["switches"], serde_json::json!({"HARNESS_FUSED_MLP": "0", "HARNESS_OVERLAP": "0"}));
        assert_eq!(RunResult::read(&p).unwrap(), r);
    }

    #[test]
    fn newer_formats_are_refused_with_a_hint() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.json");
        let mut v = serde_json::to_value(sample()).unwrap();
        v["format_version"] = (FORMAT_VERSION + 1).into();
        std::fs::write(&p, v.to_string()).unwrap();
        let e = RunResult::read(&p).unwrap_err().to_string();
        assert!(e.contains("upgrade harness"), "{e}");
    }

    #[test]
    fn result_files_stay_in_the_results_folder_whatever_the_suite_name() {
        let dir = Path::new("results");
        for name in ["cpu", "../../etc/x", "/tmp/x", "a/../../b", ".."] {
            let p = default_path(dir, name);
            assert_eq!(p.parent(), Some(dir), "{name}: {}", p.display());
            assert!(p.components().all(|c| matches!(c, std::path::Component::Normal(_))), "{name}: {}", p.display());
            assert_eq!(log_path(&p).parent(), Some(dir));
        }
    }

    #[test]
    fn atomic_write_leaves_no_temporary_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[cfg(unix)]
    #[test]
    fn atomic_writes_get_the_permissions_a_plain_write_gets_not_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (atomic, plain) = (dir.path().join("a.md"), dir.path().join("b.md"));
        write_atomic(&atomic, b"x").unwrap();
        std::fs::write(&plain, b"x").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        // 0666 less the umask (0644 with the usual 022), whatever it is here.
        assert_eq!(mode(&atomic), mode(&plain));
    }

    #[test]
    fn switches_that_changed_the_measured_work_make_a_run_unofficial() {
        let r = &crate::suite::standard::RELEASED[0];
        let s = Suite::parse(Path::new(r.file), r.text.to_owned()).unwrap();
        let machine = testing::result("x", None, 1.0).machine;
        let sub = Submission { released_suite: true, gpus: 2, ..Default::default() };
        assert_eq!(sub.unofficial_reasons(&s, &machine, &Default::default()), Vec::<String>::new());
        let switches = [("HARNESS_OVERLAP".to_owned(), "0".to_owned())].into();
        let why = sub.unofficial_reasons(&s, &machine, &switches);
        assert_eq!(
            why,
            ["it ran with switches that change the measured work (HARNESS_OVERLAP=0); official runs leave every HARNESS_* switch at its default"]
        );
    }

    /// The reason is the run's own (`submission.unofficial`) and verify's:
    /// CPU-class suites only.
    #[test]
    fn a_cpu_class_run_without_the_pinned_kernels_is_unofficial_and_a_gpu_class_run_is_not_judged_by_them() {
        use crate::machine::{cpu_class_problem, CpuKernels, GpuInfo};
        use crate::suite::{standard::RELEASED, Suite};
        let machine = |k: Option<CpuKernels>| Fingerprint { cpu_kernels: k, ..testing::machine() };
        let suite = |file: &str| {
            let r = RELEASED.iter().find(|r| r.file == file).unwrap();
            Suite::parse(std::path::Path::new(r.file), r.text.to_owned()).unwrap()
        };
        let (cpu, h100) = (suite("suites/cpu-standard.toml"), suite("suites/h100.toml"));
        let sub = Submission { released_suite: true, gpus: 2, ..Default::default() };
        let reasons = |s: &Suite, m: &Fingerprint| sub.unofficial_reasons(s, m, &Default::default());
        assert_eq!(reasons(&cpu, &machine(Some(CpuKernels::pinned()))), Vec::<String>::new());
        assert_eq!(reasons(&cpu, &machine(None)), [cpu_class_problem(&machine(None)).unwrap()]);
        let gpu = GpuInfo { index: 0, name: "NVIDIA H100 80GB HBM3".into(), memory_bytes: 1, compute_capability: "9.0".into() };
        let on_h100 = Fingerprint { gpus: vec![gpu.clone(), GpuInfo { index: 1, ..gpu }], ..machine(None) };
        assert_eq!(reasons(&h100, &on_h100), Vec::<String>::new());
    }
}

/// What checkpoints and failures cost an entry.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResilienceRecord {
    /// Every checkpoint written: step, seconds the write took (all ranks,
    /// until it was durable), bytes.
    pub checkpoints: Vec<CheckpointRecord>,
    /// Every injected failure.
    pub failures: Vec<FailureRecord>,
    /// Every out-of-memory error caught and retried.
    #[serde(default)]
    pub out_of_memory: Vec<OomRecord>,
    /// Steps executed, redone ones included (`steps` counts useful ones).
    pub steps_executed: u64,
    /// Training seconds stopped for checkpoints: the snapshots' stalls
    /// (with `checkpoint_async = false`, the whole writes).
    pub checkpoint_time_s: f64,
    /// Extra training seconds of the steps that overlapped a snapshot's
    /// copy or a persist, over steps that did not (summed; can be slightly
    /// negative through noise).
    #[serde(default)]
    pub checkpoint_slowdown_s: f64,
    /// How checkpoints were taken: `async` (host-memory snapshot, background
    /// persist) or `sync` (training waits until on disk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_mode: Option<String>,
    /// Bytes of host memory held for snapshots (async).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_memory_bytes: Option<u64>,
    /// Training seconds lost to failures: the work since the last checkpoint
    /// plus the restore.
    pub time_lost_s: f64,
    /// `harness run --resume` continued an interrupted run of this entry
    /// from the checkpoint of this step (curves and figures start there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<u64>,
}

/// One checkpoint write.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointRecord {
    pub step: u64,
    /// Seconds training stopped for it: the snapshot (async), or the whole
    /// write (sync).
    pub cost_s: f64,
    /// Bytes on disk once persisted (this rank's part and, on rank 0, the
    /// model), else the snapshot's bytes in host memory.
    pub bytes: u64,
    /// Durable on disk (the policy asked for it, and the persist finished).
    #[serde(default = "yes")]
    pub persisted: bool,
    /// Seconds the background persist took, from its start until durable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persist_s: Option<f64>,
    /// Steps that ran while its snapshot copy or persist was under way.
    #[serde(default)]
    pub overlap_steps: u32,
    /// Their extra seconds over the median of recent steps that overlapped
    /// nothing.
    #[serde(default)]
    pub slowdown_s: f64,
    /// Checkpoints the policy deleted right after this one.
    #[serde(default)]
    pub deleted: Vec<u64>,
}

/// One injected failure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailureRecord {
    /// Steps completed when it struck.
    pub step: u64,
    /// The step training went back to (the last checkpoint; 0: the start).
    pub restored_to: u64,
    /// Training seconds of work lost: since the last checkpoint was written,
    /// or since the last restore if that came later.
    pub lost_s: f64,
    /// Seconds the restore took.
    pub restore_s: f64,
    /// Of `restore_s`, the seconds reading the checkpoint from disk (its
    /// hashes checked), and the bytes read; absent for other sources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_bytes: Option<u64>,
    /// Where the state came back from: `memory`, `disk` or `start`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_from: Option<String>,
    /// The failure also lost the host-memory tier (`faults.lose_memory`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lost_memory: bool,
}

/// One out-of-memory error caught and retried with a smaller batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OomRecord {
    /// The step that ran out of memory (steps completed before it).
    pub step: u64,
    pub micro_batch: u32,
    /// The micro-batch of the retry.
    pub retried_with: u32,
    /// True when the error was emulated (`faults.oom_above_batch`).
    pub emulated: bool,
}

fn yes() -> bool {
    true
}
