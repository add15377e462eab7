//! Strategy plugins: WASM components (sandboxed) and native libraries
//! (unsandboxed) behind one contract, `sdk/wit/strategy.wit` and its C mirror
//! `sdk/include/harness_strategy.h`.
//!
//! A suite declares plugins with `[[plugin]]`; [`PluginSet`] loads each
//! artifact once per process (lazily, so a broken plugin fails only the
//! entries that use it), checks the contract version before anything else,
//! and makes one instance per entry and rank. The adapters here implement the
//! host's strategy traits, time every call into the plugin (HDR), validate
//! what the plugin returns, and turn traps, panics, deadlines and errors into
//! entry failures that name the plugin, the call and the cause;
//! `strategies.rs` assembles an entry's strategies from built-in ones and
//! these adapters.

pub mod bench;
pub mod budget;
pub mod cache;
pub mod exit_guard;
pub mod log;
pub mod native;
pub mod ops;
mod strategies;
pub mod test_kit;
pub mod wasm;

use std::any::Any;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use harness_sdk::abi;
use hdrhistogram::Histogram;

use sha2::{Digest, Sha256};
use tch::{Device, Tensor};

use crate::strategy::{
    BatchDecision, BatchPolicy, BucketCtx, BucketLayout, CheckpointDecision, CheckpointHistory, CheckpointPolicy, Compressor, StepTelemetry,
};
use harness_format::suite::PluginSpec;
use harness_runtime::comm::Collective;
use harness_runtime::measure::{self, LatencySummary};
use ops::{CommPtr, HostSide};

pub use harness_format::plugin::{Kind, Manifest, PluginRecord, PluginReport, Transport};

pub use log::log_line;

/// The name of an artifact that no suite names (`plugin bench`, `plugin
/// test`; errors name the plugin by it): its file name.
fn artifact_name(path: &Path) -> String {
    path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// The line of an error that a table shows: the first that is not empty
/// (what follows quotes the plugin's stderr, or a backtrace).
fn first_line(error: &str) -> String {
    error.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("failed").to_owned()
}

enum Artifact {
    Wasm(wasm::Artifact),
    Native(native::Artifact),
}

struct Loaded {
    artifact: Artifact,
    manifest: Manifest,
    spec: PluginSpec,
    load_s: f64,
}

/// The suite's plugins, loaded on first use and shared by ranks.
pub struct PluginSet {
    specs: Vec<PluginSpec>,
    dir: PathBuf,
    loaded: Mutex<HashMap<String, Arc<Result<Loaded, String>>>>,
}

/// sha256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let bytes = read_artifact(path)?;
    Ok(hex::encode(Sha256::digest(&bytes)))
}

/// A plugin artifact's bytes: a regular file (a FIFO or a device is refused
/// without being opened) of at most [`harness_format::files::PLUGIN_MAX_BYTES`].
fn read_artifact(path: &Path) -> Result<Vec<u8>> {
    Ok(harness_format::files::read_regular(path, harness_format::files::PLUGIN_MAX_BYTES)?)
}

/// Loads an artifact by extension and asks it who it is.
fn open(path: &Path) -> Result<(Artifact, Manifest)> {
    let bytes = read_artifact(path)?;
    let sha256 = hex::encode(Sha256::digest(&bytes));
    let is_wasm = path.extension().is_some_and(|e| e == "wasm");
    let (artifact, kind, transport, abi_v) = if is_wasm {
        let a = wasm::load(&bytes)?;
        let (k, c) = (a.kind, a.contract.clone());
        (Artifact::Wasm(a), k, Transport::Wasm, c)
    } else {
        let a = native::load(path)?;
        let (k, v) = (a.kind, a.abi);
        (Artifact::Native(a), k, Transport::Native, v.to_string())
    };
    // Name and version come from a throwaway instance.
    let mut probe = instantiate(&artifact, HostSide::new("probe", Device::Cpu, 1 << 20), 64 << 20, Duration::from_secs(10))?;
    let (name, version) = probe.info().context("calling `info`")?;
    Ok((artifact, Manifest { name, version, kind, transport, abi: abi_v, sha256, path: path.to_owned() }))
}

/// Loads `path` and returns its manifest (for `harness plugin inspect`).
/// A native library is loaded (`dlopen`), which runs its constructors: for
/// one's own artifacts only. A bundle someone else made is read with
/// [`inspect_component`].
pub fn inspect(path: &Path) -> Result<Manifest> {
    open(path).map(|(_, m)| m).with_context(|| format!("{} is not a usable plugin", path.display()))
}

/// Memory a component inspected by [`inspect_component`] may use.
pub const INSPECT_MEMORY_BYTES: usize = 64 << 20;
/// How long its `info` may run.
pub const INSPECT_DEADLINE: Duration = Duration::from_secs(10);

/// The manifest of the WebAssembly component `bytes`, for `harness verify`
/// and `harness report` on bundles made elsewhere: nothing that is not a
/// component by its first bytes is loaded (a native library would run its
/// constructors the moment it were), and a component is compiled and
/// instantiated in the wasm sandbox, under [`INSPECT_MEMORY_BYTES`] and
/// [`INSPECT_DEADLINE`], where only `info` is called. The manifest's
/// `path` is empty: the bytes are all there is.
pub fn inspect_component(bytes: &[u8]) -> Result<Manifest> {
    let format = harness_format::plugin::ArtifactFormat::of(bytes);
    if format != harness_format::plugin::ArtifactFormat::Component {
        bail!(
            "it is {} (it starts with {}), not a WebAssembly component: only components are loaded here, and only in the sandbox",
            format.describe(),
            harness_format::plugin::head_hex(bytes, 8)
        );
    }
    let a = wasm::load(bytes)?;
    let (kind, abi_v) = (a.kind, a.contract.clone());
    let artifact = Artifact::Wasm(a);
    let mut probe = instantiate(&artifact, HostSide::new("inspect", Device::Cpu, 1 << 20), INSPECT_MEMORY_BYTES, INSPECT_DEADLINE)?;
    let (name, version) = probe.info().context("calling `info`")?;
    let sha256 = hex::encode(Sha256::digest(bytes));
    Ok(Manifest { name, version, kind, transport: Transport::Wasm, abi: abi_v, sha256, path: PathBuf::new() })
}

fn instantiate(a: &Artifact, host: HostSide, memory_bytes: usize, deadline: Duration) -> Result<Inst> {
    Ok(match a {
        Artifact::Wasm(w) => Inst::Wasm(Box::new(wasm::Instance::new(w, host, wasm::Limits { memory_bytes, deadline })?)),
        Artifact::Native(n) => Inst::Native(native::Instance::new(n, host)?),
    })
}

impl PluginSet {
    /// The plugins of a suite whose file lives in `dir`.
    pub fn new(specs: &[PluginSpec], dir: &Path) -> PluginSet {
        PluginSet { specs: specs.to_vec(), dir: dir.to_owned(), loaded: Mutex::new(HashMap::new()) }
    }

    /// No plugins (built-in strategies only).
    pub fn empty() -> PluginSet {
        PluginSet::new(&[], Path::new("."))
    }

    /// True if `name` is a declared plugin.
    pub fn has(&self, name: &str) -> bool {
        self.specs.iter().any(|s| s.name == name)
    }

    fn load(&self, name: &str) -> Arc<Result<Loaded, String>> {
        let mut map = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(name.to_owned())
            .or_insert_with(|| {
                let spec = self.specs.iter().find(|s| s.name == name).cloned();
                Arc::new(spec.ok_or_else(|| format!("no [[plugin]] is named `{name}`")).and_then(|spec| {
                    let path = self.dir.join(&spec.path);
                    let describe = || format!("plugin `{name}` ({})", path.display());
                    let started = std::time::Instant::now();
                    let (artifact, manifest) = open(&path).map_err(|e| format!("{} cannot be loaded: {e:#}", describe()))?;
                    if let Some(h) = &spec.sha256 {
                        if !h.eq_ignore_ascii_case(&manifest.sha256) {
                            return Err(format!("{}: sha256 is {}, and the suite pins {h}", describe(), manifest.sha256));
                        }
                    }
                    if let Some(v) = &spec.version {
                        if *v != manifest.version {
                            return Err(format!("{}: version is {}, and the suite pins {v}", describe(), manifest.version));
                        }
                    }
                    Ok(Loaded { artifact, manifest, spec, load_s: started.elapsed().as_secs_f64() })
                }))
            })
            .clone()
    }

    /// Loads every declared plugin and returns the manifests or the first
    /// problems (for `harness validate`).
    pub fn check_all(&self) -> Vec<Result<Manifest, String>> {
        self.specs
            .iter()
            .map(|s| match &*self.load(&s.name) {
                Ok(l) => Ok(l.manifest.clone()),
                Err(e) => Err(e.clone()),
            })
            .collect()
    }

    /// A configured instance of plugin `name` for one entry and rank.
    pub fn instance(&self, name: &str, slot: &str, want: Kind, config: Option<&toml::Table>, device: Device) -> Result<Plugin> {
        let loaded = self.load(name);
        let l = loaded.as_ref().as_ref().map_err(|e| anyhow!("{e}"))?;
        if l.manifest.kind != want {
            bail!("plugin `{name}` ({}) is a {}, and `{slot}` needs a {}", l.spec.path.display(), l.manifest.kind.name(), want.name());
        }
        let started = std::time::Instant::now();
        let host = HostSide::new(&l.manifest.name, device, l.spec.tensor_mb << 20);
        let inst = instantiate(&l.artifact, host, (l.spec.memory_mb as usize) << 20, Duration::from_millis(l.spec.deadline_ms))
            .with_context(|| format!("{} plugin `{name}` could not be instantiated", want.name()))?;
        let mut p = Plugin {
            inst,
            manifest: l.manifest.clone(),
            slot: slot.into(),
            suite_name: name.into(),
            hist: measure::new_histogram(),
            calls: 0,
            who: String::new(),
            load_s: l.load_s,
            instantiate_s: 0.0,
        };
        p.who = p.who();
        let text = toml::to_string(&config.cloned().unwrap_or_default()).context("serialising the plugin config")?;
        p.call("configure", |i| i.configure(&text))?;
        p.instantiate_s = started.elapsed().as_secs_f64();
        Ok(p)
    }
}

enum Inst {
    Wasm(Box<wasm::Instance>),
    Native(native::Instance),
}

impl Inst {
    fn host(&mut self) -> &mut HostSide {
        match self {
            Inst::Wasm(w) => w.host(),
            Inst::Native(n) => n.host(),
        }
    }
    fn info(&mut self) -> Result<(String, String)> {
        match self {
            Inst::Wasm(w) => w.info(),
            Inst::Native(n) => n.info(),
        }
    }
    fn configure(&mut self, toml: &str) -> Result<Result<(), String>> {
        match self {
            Inst::Wasm(w) => w.configure(toml),
            Inst::Native(n) => n.configure(toml),
        }
    }
}

/// A plugin failed a call: trapped, ran past a limit, returned an error or
/// an invalid result. `plugin` is its name in the suite.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PluginFailure {
    pub plugin: String,
    pub message: String,
}

/// One configured plugin instance.
pub struct Plugin {
    inst: Inst,
    pub manifest: Manifest,
    slot: String,
    suite_name: String,
    hist: Histogram<u64>,
    calls: u64,
    /// [`Plugin::who`], kept for the exit guard of native calls.
    who: String,
    load_s: f64,
    instantiate_s: f64,
}

impl Plugin {
    /// Calls into the plugin, timing the call and naming the plugin, the call
    /// and the cause in any failure.
    fn call<R>(&mut self, what: &'static str, f: impl FnOnce(&mut Inst) -> Result<Result<R, String>>) -> Result<R> {
        let scope = match self.manifest.transport {
            Transport::Native => Some(exit_guard::CallScope::enter(&self.who, what)),
            Transport::Wasm => None,
        };
        let range = harness_kernels::torch_ext::Range::open(|| format!("plugin {}: {what}", self.suite_name));
        let t0 = measure::mark();
        let r = f(&mut self.inst);
        drop(scope);
        drop(range);
        measure::record_since(&mut self.hist, t0);
        self.calls += 1;
        match r {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(msg)) => Err(self.failure(format!("{} returned an error from `{what}`: {}", self.who(), log::clean(&msg, 2000)))),
            Err(e) => Err(self.failure(format!(
                "{} failed in `{what}`: {}",
                self.who(),
                harness_format::error::without_backtrace(&format!("{e:#}"))
            ))),
        }
    }

    fn failure(&self, message: String) -> anyhow::Error {
        PluginFailure { plugin: self.suite_name.clone(), message }.into()
    }

    /// Forgets the calls timed so far (the benchmark's warm-up).
    pub(crate) fn restart_timing(&mut self) {
        self.hist.reset();
        self.calls = 0;
    }

    /// The calls' times so far.
    pub(crate) fn timing(&self) -> LatencySummary {
        LatencySummary::of(&self.hist)
    }

    fn who(&self) -> String {
        let transport = match self.manifest.transport {
            Transport::Wasm => "wasm",
            Transport::Native => "native",
        };
        format!("{} plugin `{}` ({transport}, {})", self.manifest.kind.name(), self.name(), self.manifest.path.display())
    }

    /// The plugin's name in messages: the suite's name for it, or, for a
    /// plugin entered with `--plugin` (which the suite knows only as
    /// [`ENTERED_PLUGIN`](harness_format::suite::standard::ENTERED_PLUGIN)), its own
    /// name and version from its manifest.
    fn name(&self) -> String {
        if self.suite_name == harness_format::suite::standard::ENTERED_PLUGIN {
            format!("{} {}", self.manifest.name, self.manifest.version)
        } else {
            self.suite_name.clone()
        }
    }

    /// The plugin's state (`state-save`), for a checkpoint.
    pub fn state_save(&mut self) -> Result<Vec<u8>> {
        self.call("state-save", |i| match i {
            Inst::Wasm(w) => w.state_save().map(Ok),
            Inst::Native(n) => n.state_save().map(Ok),
        })
    }

    /// Restores a state from [`Plugin::state_save`] (`state-load`).
    pub fn state_load(&mut self, state: &[u8]) -> Result<()> {
        self.call("state-load", |i| match i {
            Inst::Wasm(w) => w.state_load(state),
            Inst::Native(n) => n.state_load(state),
        })
    }

    fn fail(&self, what: &str, msg: impl std::fmt::Display) -> anyhow::Error {
        self.failure(format!("{} returned an invalid result from `{what}`: {msg}", self.who()))
    }

    /// The record for the results.
    pub fn record(&mut self) -> PluginRecord {
        let meter = self.inst.host().meter.clone();
        PluginRecord {
            slot: self.slot.clone(),
            manifest: self.manifest.clone(),
            calls: self.calls,
            call: (!self.hist.is_empty()).then(|| LatencySummary::of(&self.hist)),
            host_ops: meter.ops,
            read_bytes: meter.read_bytes,
            load_s: self.load_s,
            instantiate_s: self.instantiate_s,
        }
    }

    /// The record and the encoded call histogram, for the results.
    pub fn report(&mut self) -> PluginReport {
        (self.record(), measure::encode(&self.hist))
    }
}

/// The native ABI's `step-telemetry` (what a native policy's `next` and
/// `decide` get).
pub fn telemetry_abi(t: &StepTelemetry) -> abi::StepTelemetry {
    abi::StepTelemetry {
        step: t.step,
        loss: t.loss,
        step_time_s: t.step_time_s,
        elapsed_s: t.elapsed_s,
        memory_used_bytes: t.memory_used_bytes,
        memory_total_bytes: t.memory_total_bytes,
        tokens_per_s: t.tokens_per_s,
        micro_batch: t.micro_batch,
        accum_steps: t.accum_steps,
        world_size: t.world_size,
        has_grad_sq_norm: t.grad_sq_norm.is_some() as u8,
        has_local_grad_sq_norm: t.local_grad_sq_norm.is_some() as u8,
        out_of_memory: t.out_of_memory as u8,
        grad_sq_norm: t.grad_sq_norm.unwrap_or(0.0),
        local_grad_sq_norm: t.local_grad_sq_norm.unwrap_or(0.0),
    }
}

/// A compressor plugin behind the host's [`Compressor`] trait.
pub struct PluginCompressor {
    pub plugin: Plugin,
    /// Check the reduced gradients for NaN/inf (off under fp16 loss scaling,
    /// whose overflow steps are expected and skipped by the scaler).
    check_finite: bool,
    /// CUDA: the previous step's gradient norm on its way to the host, with
    /// the event after its copy and the step.
    in_flight: Option<(Tensor, measure::cuda::Event, u64)>,
}

impl PluginCompressor {
    /// Wraps a compressor plugin.
    pub fn new(plugin: Plugin, check_finite: bool) -> PluginCompressor {
        PluginCompressor { plugin, check_finite, in_flight: None }
    }

    /// CUDA: the previous step's norm, once its copy to the host is done.
    fn check_in_flight(&mut self) -> Result<()> {
        if let Some((host, done, step)) = self.in_flight.take() {
            done.synchronize()?;
            if !host.double_value(&[]).is_finite() {
                return Err(self.plugin.fail("compress", format!("non-finite values in its output at step {step}")));
            }
        }
        Ok(())
    }
}

impl Compressor for PluginCompressor {
    fn setup(&mut self, buckets: &[BucketLayout]) -> Result<()> {
        for (i, b) in buckets.iter().enumerate() {
            let end = b.params.iter().map(|p| p.offset + p.numel).max().unwrap_or(0);
            anyhow::ensure!(end <= b.numel, "bucket {i}'s layout runs past its {} elements", b.numel);
        }
        self.plugin.call("setup", |i| match i {
            Inst::Wasm(w) => w.setup(buckets),
            Inst::Native(n) => n.setup(buckets),
        })
    }

    fn reduce(&mut self, bucket: &mut Tensor, comm: &mut dyn Collective, ctx: &BucketCtx) -> Result<()> {
        let shape = bucket.size();
        let kind = bucket.kind();
        let host = self.plugin.inst.host();
        let id = host.lend(bucket);
        // SAFETY: cleared below, before `comm`'s borrow ends; the plugin runs
        // on this thread.
        host.set_comm(Some(unsafe { CommPtr::new(comm) }));
        let r = self.plugin.call("compress", |i| match i {
            Inst::Wasm(w) => w.compress(id, ctx),
            Inst::Native(n) => n.compress(id, abi::BucketInfo { step: ctx.step, index: ctx.index as u32, count: ctx.count as u32 }),
        });
        let host = self.plugin.inst.host();
        host.set_comm(None);
        host.give_back(id);
        r?;
        if bucket.size() != shape || bucket.kind() != kind {
            return Err(self.plugin.fail("compress", "the bucket changed shape or dtype"));
        }
        Ok(())
    }

    fn checks_output(&self) -> bool {
        self.check_finite
    }

    /// The gradient norm the step computes anyway (for clipping or the batch
    /// policy's statistics) is NaN or infinite exactly when some element of
    /// the reduced gradients is, so the check costs no pass of its own when
    /// clipping is on. On CPU it is read now; on a GPU it is copied to the
    /// host behind an event and read at the next step (reading it directly
    /// would wait for everything queued since, and leave the device idle),
    /// and the last step's at the end.
    fn check_output(&mut self, step: u64, norm: &Tensor, locate: &dyn Fn() -> Option<usize>) -> Result<()> {
        if !self.check_finite {
            return Ok(());
        }
        if !norm.device().is_cuda() {
            if norm.double_value(&[]).is_finite() {
                return Ok(());
            }
            let why = match locate() {
                Some(i) => format!("non-finite values in bucket {i} at step {step}"),
                None => format!("the norm of its output overflowed at step {step}"),
            };
            return Err(self.plugin.fail("compress", why));
        }
        self.check_in_flight()?;
        let host = norm.to_device_(Device::Cpu, tch::Kind::Double, true, false);
        let done = measure::cuda::Event::new()?;
        done.record()?;
        self.in_flight = Some((host, done, step));
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.check_in_flight()
    }

    fn plugin_any(&mut self) -> Option<&mut dyn Any> {
        Some(&mut self.plugin)
    }
}

/// Largest micro-batch or accumulation a batch policy may ask for.
pub const MAX_BATCH: u32 = 1 << 16;

/// A batch-policy plugin behind the host's [`BatchPolicy`] trait.
pub struct PluginBatch {
    pub plugin: Plugin,
}

impl PluginBatch {
    fn validate(&self, what: &str, b: BatchDecision) -> Result<BatchDecision> {
        if !(1..=MAX_BATCH).contains(&b.micro_batch) || !(1..=MAX_BATCH).contains(&b.accum_steps) {
            return Err(self.plugin.fail(
                what,
                format!("micro-batch {} x {} accumulation steps; both must lie in 1..={MAX_BATCH}", b.micro_batch, b.accum_steps),
            ));
        }
        if !(b.lr_scale.is_finite() && b.lr_scale > 0.0) {
            return Err(self.plugin.fail(what, format!("lr-scale {} is not a finite positive number", b.lr_scale)));
        }
        Ok(b)
    }
}

impl BatchPolicy for PluginBatch {
    fn initial(&mut self, configured: BatchDecision) -> Result<BatchDecision> {
        let c = configured;
        let b = self.plugin.call("initial", |i| match i {
            Inst::Wasm(w) => w.batch_initial(c),
            Inst::Native(n) => n
                .batch_initial(abi::Batch { micro_batch: c.micro_batch, accum_steps: c.accum_steps, lr_scale: c.lr_scale })
                .map(|r| r.map(|b| BatchDecision { micro_batch: b.micro_batch, accum_steps: b.accum_steps, lr_scale: b.lr_scale })),
        })?;
        self.validate("initial", b)
    }

    fn next(&mut self, t: &StepTelemetry) -> Result<BatchDecision> {
        let b = self.plugin.call("next", |i| match i {
            Inst::Wasm(w) => w.batch_next(t),
            Inst::Native(n) => n
                .batch_next(&telemetry_abi(t))
                .map(|r| r.map(|b| BatchDecision { micro_batch: b.micro_batch, accum_steps: b.accum_steps, lr_scale: b.lr_scale })),
        })?;
        self.validate("next", b)
    }

    fn wants_gradient_stats(&mut self) -> Result<bool> {
        self.plugin.call("wants-gradient-stats", |i| match i {
            Inst::Wasm(w) => w.batch_wants_gradient_stats(),
            Inst::Native(n) => n.batch_wants_gradient_stats(),
        })
    }

    fn plugin_any(&mut self) -> Option<&mut dyn Any> {
        Some(&mut self.plugin)
    }
}

pub use crate::strategy::CheckpointAnswer;

/// A checkpoint-policy plugin behind the host's [`CheckpointPolicy`] trait.
pub struct PluginCheckpoint {
    pub plugin: Plugin,
}

impl CheckpointPolicy for PluginCheckpoint {
    fn decide(&mut self, t: &StepTelemetry, h: &CheckpointHistory) -> Result<CheckpointDecision> {
        let (save, persist, delete) = self.plugin.call("decide", |i| match i {
            Inst::Wasm(w) => w.checkpoint_decide(t, h),
            Inst::Native(n) => n.checkpoint_decide(&telemetry_abi(t), h),
        })?;
        if let Some(d) = delete.iter().find(|d| !h.saved.contains(d)) {
            // Also a step it deleted in an earlier decision: say what is saved.
            let saved = match h.saved.as_slice() {
                [] => "none is saved".to_owned(),
                s if s.len() <= 8 => format!("saved: steps {s:?}"),
                s => format!("{} are saved, steps {} to {}", s.len(), s[0], s[s.len() - 1]),
            };
            return Err(self.plugin.fail(
                "decide",
                format!("it asked to delete the checkpoint of step {d}, which is not a saved checkpoint ({saved}): each is deleted once, after it is persisted"),
            ));
        }
        if let Some(d) = delete.iter().enumerate().find_map(|(i, d)| delete[..i].contains(d).then_some(d)) {
            return Err(self.plugin.fail("decide", format!("it asked to delete the checkpoint of step {d} twice")));
        }
        Ok(CheckpointDecision { save, persist, delete })
    }

    fn plugin_any(&mut self) -> Option<&mut dyn Any> {
        Some(&mut self.plugin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inspect_component_loads_nothing_but_components() {
        // This test binary is a native executable, constructors and all.
        let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let e = format!("{:#}", inspect_component(&exe).unwrap_err());
        assert!(e.contains("a native library") && e.contains("not a WebAssembly component"), "{e}");
        let e = format!("{:#}", inspect_component(b"\0asm\x01\0\0\0").unwrap_err());
        assert!(e.contains("a core WebAssembly module, not a component"), "{e}");
        let e = format!("{:#}", inspect_component(b"<html>404</html>").unwrap_err());
        assert!(e.contains("neither a WebAssembly component nor a known native library") && e.contains("3c 68 74 6d"), "{e}");
    }
}
