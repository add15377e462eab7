//! WASM plugins: wasmtime components, sandboxed.
//!
//! One [`Engine`] per process (epoch interruption on, one ticker thread);
//! each artifact is compiled once and pre-instantiated ([`InstancePre`]);
//! each plugin instance (one per entry and rank) gets its own [`Store`] with
//! a memory cap, a per-call deadline, and a WASI context that grants nothing
//! (no files, network, environment or clocks beyond what WASI p2 forces;
//! stderr goes to a small in-memory pipe so a guest's panic message can be
//! reported).

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use harness_sdk::abi::Op;
use wasmtime::component::{HasSelf, InstancePre, Linker, Resource, ResourceTable};
use wasmtime::{Engine, ResourceLimiter, Store};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::ops::{HostSide, KINDS};
use super::Kind as PluginKind;

/// Host-side type of the WIT `tensor` resource: the resource's rep is the
/// id in [`HostSide`]'s table.
pub struct TensorRes;

#[allow(missing_docs, clippy::all)]
mod bindings {
    pub mod compressor {
        wasmtime::component::bindgen!({
            path: "../../sdk/wit",
            world: "compressor",
            imports: { default: trappable },
            with: { "harness:strategy/tensor.tensor": super::super::TensorRes },
            anyhow: true,
        });
    }
    pub mod batch_policy {
        wasmtime::component::bindgen!({
            path: "../../sdk/wit",
            world: "batch-policy",
            imports: { default: trappable },
            with: {
                "harness:strategy/log": super::compressor::harness::strategy::log,
                "harness:strategy/types": super::compressor::harness::strategy::types,
            },
            anyhow: true,
        });
    }
    pub mod checkpoint_policy {
        wasmtime::component::bindgen!({
            path: "../../sdk/wit",
            world: "checkpoint-policy",
            imports: { default: trappable },
            with: {
                "harness:strategy/log": super::compressor::harness::strategy::log,
                "harness:strategy/types": super::compressor::harness::strategy::types,
            },
            anyhow: true,
        });
    }
    pub mod tiered_checkpoint_policy {
        wasmtime::component::bindgen!({
            path: "../../sdk/wit",
            world: "tiered-checkpoint-policy",
            imports: { default: trappable },
            with: {
                "harness:strategy/log": super::compressor::harness::strategy::log,
                "harness:strategy/types": super::compressor::harness::strategy::types,
            },
            anyhow: true,
        });
    }
}

pub use bindings::batch_policy::exports::harness::strategy::batch_sizing as wit_batch;
pub use bindings::checkpoint_policy::exports::harness::strategy::checkpointing as wit_checkpoint;
pub use bindings::compressor::exports::harness::strategy::gradient_compression as wit_compress;
pub use bindings::compressor::harness::strategy::types as wit_types;
use bindings::compressor::harness::strategy::{collective, log, tensor};
use bindings::tiered_checkpoint_policy::exports::harness::strategy::tiered_checkpointing as wit_tiered;

/// Ticks per second of the epoch clock that deadlines count in.
const TICKS_PER_S: u64 = 100;

/// The process's engine; a thread advances its epoch every 10 ms.
pub fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let mut cfg = wasmtime::Config::new();
        cfg.epoch_interruption(true);
        cfg.wasm_component_model(true);
        let engine = Engine::new(&cfg).expect("a wasmtime engine with the default configuration");
        let e = engine.clone();
        std::thread::Builder::new()
            .name("wasm-epoch".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(1000 / TICKS_PER_S));
                e.increment_epoch();
            })
            .expect("spawning the epoch thread");
        engine
    })
}

/// The per-store state.
pub struct State {
    wasi: WasiCtx,
    table: ResourceTable,
    limits: Caps,
    stderr: Stderr,
    pub host: HostSide,
}

/// Most core instances, linear memories and tables one plugin instance may
/// create. Toolchains other than Rust build components of several core
/// modules (componentize-py: 14 instances); the bytes of all memories and
/// tables together are capped by `memory_mb` whatever their number.
pub const MAX_INSTANCES: usize = 64;
pub const MAX_MEMORIES: usize = 32;
pub const MAX_TABLES: usize = 64;
/// Bytes a table element is counted as (a function reference).
const TABLE_ELEMENT_BYTES: usize = 16;

/// The store's resource limiter: every linear memory and table of the
/// plugin instance, counted together against one cap, and their numbers
/// capped. Growth past the cap traps, with a message saying so.
struct Caps {
    max_bytes: usize,
    used: usize,
}

impl Caps {
    fn grow(&mut self, what: &str, current: usize, desired: usize) -> wasmtime::Result<bool> {
        let more = desired.saturating_sub(current);
        if self.used.saturating_add(more) > self.max_bytes {
            return Err(wasmtime::Error::msg(format!(
                "it tried to grow its {what} to {} MiB in all, its memory past the cap of {} MiB (memory_mb counts every memory and table together)",
                (self.used + more) >> 20,
                self.max_bytes >> 20
            )));
        }
        self.used += more;
        Ok(true)
    }
}

impl ResourceLimiter for Caps {
    fn memory_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        self.grow("memories", current, desired)
    }
    fn table_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        self.grow("tables", current.saturating_mul(TABLE_ELEMENT_BYTES), desired.saturating_mul(TABLE_ELEMENT_BYTES))
    }
    fn instances(&self) -> usize {
        MAX_INSTANCES
    }
    fn memories(&self) -> usize {
        MAX_MEMORIES
    }
    fn tables(&self) -> usize {
        MAX_TABLES
    }
}

/// A guest's stderr, kept for error messages: the first and the last
/// [`Stderr::KEEP`] bytes, whatever it writes in between, so a panic
/// message written after megabytes of output is still there. Writes never
/// fail and never block.
#[derive(Clone, Default)]
pub struct Stderr(Arc<Mutex<StderrBuf>>);

#[derive(Default)]
struct StderrBuf {
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    total: u64,
}

impl Stderr {
    const KEEP: usize = 16 << 10;

    fn push(&self, bytes: &[u8]) {
        let mut b = self.0.lock().unwrap_or_else(|e| e.into_inner());
        b.total += bytes.len() as u64;
        let room = Self::KEEP.saturating_sub(b.head.len());
        let (to_head, rest) = bytes.split_at(room.min(bytes.len()));
        b.head.extend_from_slice(to_head);
        let rest = &rest[rest.len().saturating_sub(Self::KEEP)..];
        b.tail.extend(rest);
        let over = b.tail.len().saturating_sub(Self::KEEP);
        b.tail.drain(..over);
    }

    /// What was kept, with a marker where bytes were left out.
    pub fn contents(&self) -> String {
        let b = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut s = String::from_utf8_lossy(&b.head).into_owned();
        let cut = b.total - b.head.len() as u64 - b.tail.len() as u64;
        if cut > 0 {
            s.push_str(&format!("\n[... {cut} bytes left out ...]\n"));
        }
        s.push_str(&String::from_utf8_lossy(&b.tail.iter().copied().collect::<Vec<u8>>()));
        s
    }
}

impl IsTerminal for Stderr {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for Stderr {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[async_trait::async_trait]
impl Pollable for Stderr {
    async fn ready(&mut self) {}
}

#[async_trait::async_trait]
impl OutputStream for Stderr {
    fn write(&mut self, bytes: bytes::Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }
    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }
    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(64 << 10)
    }
}

impl tokio::io::AsyncWrite for Stderr {
    fn poll_write(self: std::pin::Pin<&mut Self>, _cx: &mut std::task::Context<'_>, buf: &[u8]) -> std::task::Poll<std::io::Result<usize>> {
        self.push(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: std::pin::Pin<&mut Self>, _cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: std::pin::Pin<&mut Self>, _cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// WASI's blocking calls, which would wait in host code where the epoch
/// deadline cannot interrupt them (a monotonic-clock subscription and
/// `poll`, a `pollable.block`): they trap instead. Nothing a plugin needs
/// waits: stdin is empty, stderr is always ready, and there is no network or
/// filesystem.
fn forbid_blocking(linker: &mut Linker<State>) -> Result<()> {
    linker.allow_shadowing(true);
    let mut poll = linker.instance(BLOCKING_INTERFACE)?;
    for name in ["poll", "[method]pollable.block"] {
        poll.func_new(name, move |_store, _ty, _params, _results| {
            Err(wasmtime::Error::msg(format!(
                "it called the blocking WASI function `{name}`, which plugins may not use (a plugin may not wait)"
            )))
        })?;
    }
    linker.allow_shadowing(false);
    Ok(())
}

/// The WASI interface whose functions block (the version wasmtime-wasi
/// links; guests built against older 0.2 versions resolve to it).
const BLOCKING_INTERFACE: &str = "wasi:io/poll@0.2.12";

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// A compiled component, ready to instantiate.
pub struct Artifact {
    pre: InstancePre<State>,
    pub kind: PluginKind,
    /// A checkpoint policy that exports `tiered-checkpointing` (0.1.1).
    tiered: bool,
    /// The contract version the component was built against.
    pub contract: String,
}

fn interface_version(name: &str) -> Option<(&str, &str)> {
    // "harness:strategy/plugin@0.1.0" -> ("plugin", "0.1.0")
    let rest = name.strip_prefix("harness:strategy/")?;
    rest.split_once('@')
}

/// What a file that does not compile as a component is, from its header,
/// and what to do about it.
fn what_it_is(bytes: &[u8]) -> String {
    match bytes.get(..8) {
        Some([0, b'a', b's', b'm', 0x0d, 0, 1, 0]) => {
            "an invalid or damaged WebAssembly component (rebuild it; `wasm-tools validate` says more)".to_owned()
        }
        Some([0, b'a', b's', b'm', 1, 0, 0, 0]) => {
            "a core WebAssembly module, not a component: build for wasm32-wasip2, or wrap it with `wasm-tools component new`".to_owned()
        }
        _ if bytes.starts_with(b"\0asm") => "a WebAssembly file of a version this harness does not read".to_owned(),
        _ if bytes.starts_with(b"\x7fELF") => "a native library, not a WebAssembly component: name it with a .so path".to_owned(),
        _ => {
            format!("not a WebAssembly file ({} bytes that do not start with \\0asm): a truncated download or the wrong file", bytes.len())
        }
    }
}

/// Compiles a component and checks what it exports.
pub fn load(bytes: &[u8]) -> Result<Artifact> {
    let engine = engine();
    let (component, _) =
        super::cache::component(engine, bytes, super::cache::dir().as_deref()).map_err(anyhow::Error::from).context(what_it_is(bytes))?;
    let ty = component.component_type();
    let mut kind = None;
    let mut contract = None;
    let mut tiered = false;
    for (name, _) in ty.exports(engine) {
        if let Some((iface, version)) = interface_version(name) {
            contract.get_or_insert_with(|| version.to_owned());
            tiered |= iface == "tiered-checkpointing";
            kind = kind.or(match iface {
                "gradient-compression" => Some(PluginKind::Compressor),
                "batch-sizing" => Some(PluginKind::BatchPolicy),
                "checkpointing" | "tiered-checkpointing" => Some(PluginKind::CheckpointPolicy),
                _ => None,
            });
        }
    }
    let contract = contract.ok_or_else(|| anyhow!("it exports no harness:strategy interface: not a harness plugin"))?;
    if !contract_supported(&contract) {
        anyhow::bail!(
            "it was built against contract harness:strategy@{contract}, and this harness speaks @{} (and earlier 0.1 contracts); rebuild it with a matching harness-sdk",
            harness_sdk::CONTRACT_VERSION
        );
    }
    let kind = kind.ok_or_else(|| anyhow!("it exports none of gradient-compression, batch-sizing, checkpointing"))?;
    let mut linker: Linker<State> = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
    forbid_blocking(&mut linker)?;
    match kind {
        PluginKind::Compressor => bindings::compressor::Compressor::add_to_linker::<State, HasSelf<State>>(&mut linker, |s| s)?,
        PluginKind::BatchPolicy => bindings::batch_policy::BatchPolicy::add_to_linker::<State, HasSelf<State>>(&mut linker, |s| s)?,
        PluginKind::CheckpointPolicy => {
            bindings::checkpoint_policy::CheckpointPolicy::add_to_linker::<State, HasSelf<State>>(&mut linker, |s| s)?
        }
    }
    let pre = linker.instantiate_pre(&component).map_err(anyhow::Error::from).context("its imports cannot be satisfied by the sandbox")?;
    Ok(Artifact { pre, kind, tiered, contract })
}

/// Whether this host loads a component of `contract`: the same 0.1 series,
/// no newer than its own (additions come with a new patch version, and the
/// host keeps the older worlds).
fn contract_supported(contract: &str) -> bool {
    let parse = |v: &str| -> Option<(u32, u32, u32)> {
        let mut it = v.split('.').map(|p| p.parse::<u32>().ok());
        Some((it.next()??, it.next()??, it.next()??))
    };
    match (parse(contract), parse(harness_sdk::CONTRACT_VERSION)) {
        (Some((a, b, c)), Some((x, y, z))) => a == x && b == y && c <= z,
        _ => false,
    }
}

/// Sandbox limits of one instance.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub memory_bytes: usize,
    pub deadline: Duration,
}

enum World {
    Compressor(bindings::compressor::Compressor),
    Batch(bindings::batch_policy::BatchPolicy),
    Checkpoint(bindings::checkpoint_policy::CheckpointPolicy),
    TieredCheckpoint(bindings::tiered_checkpoint_policy::TieredCheckpointPolicy),
}

/// One instance: a store and the component's exports.
pub struct Instance {
    store: Store<State>,
    world: World,
    deadline_ticks: u64,
    deadline: Duration,
    memory_bytes: usize,
}

impl Instance {
    /// Instantiates `a` with its own store.
    pub fn new(a: &Artifact, host: HostSide, limits: Limits) -> Result<Instance> {
        let stderr = Stderr::default();
        let wasi = WasiCtx::builder().stderr(stderr.clone()).build();
        let caps = Caps { max_bytes: limits.memory_bytes, used: 0 };
        let state = State { wasi, table: ResourceTable::new(), limits: caps, stderr, host };
        let mut store = Store::new(engine(), state);
        store.limiter(|s| &mut s.limits);
        store.epoch_deadline_trap();
        let deadline_ticks = (limits.deadline.as_millis() as u64 * TICKS_PER_S).div_ceil(1000).max(1) + 1;
        store.set_epoch_deadline(deadline_ticks);
        let instance = a.pre.instantiate(&mut store).map_err(anyhow::Error::from).context("instantiating the component")?;
        let world = match a.kind {
            PluginKind::Compressor => World::Compressor(bindings::compressor::Compressor::new(&mut store, &instance)?),
            PluginKind::BatchPolicy => World::Batch(bindings::batch_policy::BatchPolicy::new(&mut store, &instance)?),
            PluginKind::CheckpointPolicy if a.tiered => {
                World::TieredCheckpoint(bindings::tiered_checkpoint_policy::TieredCheckpointPolicy::new(&mut store, &instance)?)
            }
            PluginKind::CheckpointPolicy => World::Checkpoint(bindings::checkpoint_policy::CheckpointPolicy::new(&mut store, &instance)?),
        };
        Ok(Instance { store, world, deadline_ticks, deadline: limits.deadline, memory_bytes: limits.memory_bytes })
    }

    /// The host side (tensor table, meter).
    pub fn host(&mut self) -> &mut HostSide {
        &mut self.store.data_mut().host
    }

    /// Runs one export with a fresh deadline and turns traps into messages.
    fn call<R>(&mut self, f: impl FnOnce(&mut Store<State>, &World) -> wasmtime::Result<R>) -> Result<R> {
        self.store.set_epoch_deadline(self.deadline_ticks);
        self.store.data_mut().host.set_deadline(Some(self.deadline));
        let r = f(&mut self.store, &self.world);
        self.store.data_mut().host.set_deadline(None);
        r.map_err(|e| self.explain(e))
    }

    fn explain(&mut self, e: wasmtime::Error) -> anyhow::Error {
        let stderr = self.store.data().stderr.contents();
        let panic = panic_message(&stderr);
        // The chain without wasmtime's backtrace frame (it names addresses).
        let chain: Vec<String> =
            e.chain().map(|c| c.to_string()).filter(|c| !c.starts_with("error while executing at wasm backtrace")).collect();
        let text = chain.join(": ");
        let cap = || format!("it tried to grow its memory past the cap of {} MiB", self.memory_bytes >> 20);
        let cause = match e.downcast_ref::<wasmtime::Trap>() {
            Some(wasmtime::Trap::Interrupt) => {
                format!("it ran past its per-call deadline of {} ms and was interrupted", self.deadline.as_millis())
            }
            Some(wasmtime::Trap::AllocationTooLarge) => cap(),
            Some(wasmtime::Trap::UnreachableCodeReached) => match (guest_exception(&stderr, panic.as_deref()), panic) {
                (Some(exception), _) => exception,
                (None, Some(p)) => format!("it panicked{p}"),
                (None, None) => format!("it trapped (unreachable instruction){}", stderr_tail(&stderr)),
            },
            Some(t) => format!("it trapped: {t}"),
            None if text.contains("growing memory") || text.contains("memory growth") => cap(),
            None => text,
        };
        anyhow!(cause)
    }

    /// `plugin.info`.
    pub fn info(&mut self) -> Result<(String, String)> {
        self.call(|s, w| {
            let i = match w {
                World::Compressor(b) => b.harness_strategy_plugin().call_info(s)?,
                World::Batch(b) => {
                    let i = b.harness_strategy_plugin().call_info(s)?;
                    return Ok((i.name, i.version));
                }
                World::Checkpoint(b) => {
                    let i = b.harness_strategy_plugin().call_info(s)?;
                    return Ok((i.name, i.version));
                }
                World::TieredCheckpoint(b) => {
                    let i = b.harness_strategy_plugin().call_info(s)?;
                    return Ok((i.name, i.version));
                }
            };
            Ok((i.name, i.version))
        })
    }

    /// `plugin.configure`.
    pub fn configure(&mut self, toml: &str) -> Result<Result<(), String>> {
        self.call(|s, w| match w {
            World::Compressor(b) => b.harness_strategy_plugin().call_configure(s, toml),
            World::Batch(b) => b.harness_strategy_plugin().call_configure(s, toml),
            World::Checkpoint(b) => b.harness_strategy_plugin().call_configure(s, toml),
            World::TieredCheckpoint(b) => b.harness_strategy_plugin().call_configure(s, toml),
        })
    }

    /// `plugin.state-save`.
    pub fn state_save(&mut self) -> Result<Vec<u8>> {
        self.call(|s, w| match w {
            World::Compressor(b) => b.harness_strategy_plugin().call_state_save(s),
            World::Batch(b) => b.harness_strategy_plugin().call_state_save(s),
            World::Checkpoint(b) => b.harness_strategy_plugin().call_state_save(s),
            World::TieredCheckpoint(b) => b.harness_strategy_plugin().call_state_save(s),
        })
    }

    /// `plugin.state-load`.
    pub fn state_load(&mut self, state: &[u8]) -> Result<Result<(), String>> {
        self.call(|s, w| match w {
            World::Compressor(b) => b.harness_strategy_plugin().call_state_load(s, state),
            World::Batch(b) => b.harness_strategy_plugin().call_state_load(s, state),
            World::Checkpoint(b) => b.harness_strategy_plugin().call_state_load(s, state),
            World::TieredCheckpoint(b) => b.harness_strategy_plugin().call_state_load(s, state),
        })
    }

    /// `gradient-compression.compress` on a lent tensor id.
    pub fn compress(&mut self, bucket: u32, info: wit_compress::BucketInfo) -> Result<Result<(), String>> {
        self.call(|s, w| match w {
            World::Compressor(b) => b.harness_strategy_gradient_compression().call_compress(s, Resource::new_borrow(bucket), info),
            _ => unreachable!("compress on a plugin of another kind"),
        })
    }

    /// `batch-sizing.initial`.
    pub fn batch_initial(&mut self, configured: wit_batch::Batch) -> Result<Result<wit_batch::Batch, String>> {
        self.call(|s, w| match w {
            World::Batch(b) => b.harness_strategy_batch_sizing().call_initial(s, configured),
            _ => unreachable!("batch call on a plugin of another kind"),
        })
    }

    /// `batch-sizing.next`.
    pub fn batch_next(&mut self, t: &wit_types::StepTelemetry) -> Result<Result<wit_batch::Batch, String>> {
        self.call(|s, w| match w {
            World::Batch(b) => b.harness_strategy_batch_sizing().call_next(s, *t),
            _ => unreachable!("batch call on a plugin of another kind"),
        })
    }

    /// `batch-sizing.wants-gradient-stats`.
    pub fn batch_wants_gradient_stats(&mut self) -> Result<Result<bool, String>> {
        self.call(|s, w| match w {
            World::Batch(b) => b.harness_strategy_batch_sizing().call_wants_gradient_stats(s).map(Ok),
            _ => unreachable!("batch call on a plugin of another kind"),
        })
    }

    /// `checkpointing.decide`.
    pub fn checkpoint_decide(
        &mut self,
        t: &wit_types::StepTelemetry,
        h: &crate::strategy::CheckpointHistory,
    ) -> Result<Result<super::CheckpointAnswer, String>> {
        self.call(|s, w| match w {
            World::TieredCheckpoint(b) => {
                let state = wit_tiered::CheckpointState {
                    last_cost_s: h.last_cost_s,
                    saved: h.saved.clone(),
                    failures: h.failures.clone(),
                    since_last_s: h.since_last_s,
                    in_memory: h.in_memory.clone(),
                    persisting: h.persisting,
                    last_stall_s: h.last_stall_s,
                    last_persist_s: h.last_persist_s,
                    last_slowdown_s: h.last_slowdown_s,
                };
                let d = b.harness_strategy_tiered_checkpointing().call_decide(s, *t, &state)?;
                Ok(d.map(|d| (d.snapshot, d.snapshot && d.persist, d.delete)))
            }
            World::Checkpoint(b) => {
                // Contract 0.1.0: every snapshot is persisted.
                let hist = wit_checkpoint::CheckpointHistory {
                    last_cost_s: h.last_cost_s,
                    saved: h.saved.clone(),
                    failures: h.failures.clone(),
                    since_last_s: h.since_last_s,
                };
                let d = b.harness_strategy_checkpointing().call_decide(s, *t, &hist)?;
                Ok(d.map(|d| (d.save, d.save, d.delete)))
            }
            _ => unreachable!("checkpoint call on a plugin of another kind"),
        })
    }
}

// ---- host functions -------------------------------------------------------

type R<T> = anyhow::Result<T>;
type T = Resource<TensorRes>;

fn own(id: u32) -> T {
    Resource::new_own(id)
}

fn u64s(v: &[u64]) -> Vec<i64> {
    v.iter().map(|&x| x.min(i64::MAX as u64) as i64).collect()
}

impl State {
    fn one(&mut self, op: Op, ids: &[u32], floats: &[f64], ints: &[i64]) -> R<T> {
        Ok(own(self.host.exec(op, ids, floats, ints, &[])?.ids[0]))
    }
    fn scalar(&mut self, op: Op, ids: &[u32]) -> R<f64> {
        Ok(self.host.exec(op, ids, &[], &[], &[])?.scalar)
    }
}

fn dtype_to_wit(i: usize) -> wit_types::Dtype {
    use wit_types::Dtype::*;
    [F32, F16, Bf16, F64, I64, I32, U8, Boolean][i]
}

fn dtype_from_wit(d: wit_types::Dtype) -> i64 {
    use wit_types::Dtype::*;
    match d {
        F32 => 0,
        F16 => 1,
        Bf16 => 2,
        F64 => 3,
        I64 => 4,
        I32 => 5,
        U8 => 6,
        Boolean => 7,
    }
}

const _: () = assert!(KINDS.len() == 8);

impl wit_types::Host for State {}

impl tensor::HostTensor for State {
    fn shape(&mut self, s: T) -> R<Vec<u64>> {
        Ok(self.host.exec(Op::Shape, &[s.rep()], &[], &[], &[])?.ints.into_iter().map(|d| d as u64).collect())
    }
    fn numel(&mut self, s: T) -> R<u64> {
        Ok(self.scalar(Op::Numel, &[s.rep()])? as u64)
    }
    fn dtype(&mut self, s: T) -> R<wit_types::Dtype> {
        Ok(dtype_to_wit(self.scalar(Op::Dtype, &[s.rep()])? as usize))
    }
    fn device(&mut self, s: T) -> R<wit_types::DeviceKind> {
        Ok(if self.scalar(Op::Device, &[s.rep()])? == 1.0 { wit_types::DeviceKind::Cuda } else { wit_types::DeviceKind::Cpu })
    }
    fn assign(&mut self, s: T, src: T) -> R<()> {
        self.host.exec(Op::Assign, &[s.rep(), src.rep()], &[], &[], &[])?;
        Ok(())
    }
    fn duplicate(&mut self, s: T) -> R<T> {
        self.one(Op::Duplicate, &[s.rep()], &[], &[])
    }
    fn add(&mut self, s: T, o: T) -> R<T> {
        self.one(Op::Add, &[s.rep(), o.rep()], &[], &[])
    }
    fn sub(&mut self, s: T, o: T) -> R<T> {
        self.one(Op::Sub, &[s.rep(), o.rep()], &[], &[])
    }
    fn mul(&mut self, s: T, o: T) -> R<T> {
        self.one(Op::Mul, &[s.rep(), o.rep()], &[], &[])
    }
    fn div(&mut self, s: T, o: T) -> R<T> {
        self.one(Op::Div, &[s.rep(), o.rep()], &[], &[])
    }
    fn add_scalar(&mut self, s: T, x: f64) -> R<T> {
        self.one(Op::AddScalar, &[s.rep()], &[x], &[])
    }
    fn mul_scalar(&mut self, s: T, x: f64) -> R<T> {
        self.one(Op::MulScalar, &[s.rep()], &[x], &[])
    }
    fn abs(&mut self, s: T) -> R<T> {
        self.one(Op::Abs, &[s.rep()], &[], &[])
    }
    fn sign(&mut self, s: T) -> R<T> {
        self.one(Op::Sign, &[s.rep()], &[], &[])
    }
    fn floor(&mut self, s: T) -> R<T> {
        self.one(Op::Floor, &[s.rep()], &[], &[])
    }
    fn sqrt(&mut self, s: T) -> R<T> {
        self.one(Op::Sqrt, &[s.rep()], &[], &[])
    }
    fn less_than(&mut self, s: T, o: T) -> R<T> {
        self.one(Op::LessThan, &[s.rep(), o.rep()], &[], &[])
    }
    fn cast(&mut self, s: T, to: wit_types::Dtype) -> R<T> {
        self.one(Op::Cast, &[s.rep()], &[], &[dtype_from_wit(to)])
    }
    fn reshape(&mut self, s: T, shape: Vec<i64>) -> R<T> {
        self.one(Op::Reshape, &[s.rep()], &[], &shape)
    }
    fn transpose(&mut self, s: T, a: u32, b: u32) -> R<T> {
        self.one(Op::Transpose, &[s.rep()], &[], &[a as i64, b as i64])
    }
    fn narrow(&mut self, s: T, dim: u32, start: u64, len: u64) -> R<T> {
        self.one(Op::Narrow, &[s.rep()], &[], &[dim as i64, start.min(i64::MAX as u64) as i64, len.min(i64::MAX as u64) as i64])
    }
    fn topk(&mut self, s: T, k: u64) -> R<(T, T)> {
        let o = self.host.exec(Op::Topk, &[s.rep()], &[], &[k.min(i64::MAX as u64) as i64], &[])?;
        Ok((own(o.ids[0]), own(o.ids[1])))
    }
    fn gather(&mut self, s: T, index: T) -> R<T> {
        self.one(Op::Gather, &[s.rep(), index.rep()], &[], &[])
    }
    fn scatter_add(&mut self, s: T, index: T, src: T) -> R<T> {
        self.one(Op::ScatterAdd, &[s.rep(), index.rep(), src.rep()], &[], &[])
    }
    fn sum(&mut self, s: T) -> R<f64> {
        self.scalar(Op::Sum, &[s.rep()])
    }
    fn norm(&mut self, s: T) -> R<f64> {
        self.scalar(Op::Norm, &[s.rep()])
    }
    fn mean_abs(&mut self, s: T) -> R<f64> {
        self.scalar(Op::MeanAbs, &[s.rep()])
    }
    fn matmul(&mut self, s: T, o: T) -> R<T> {
        self.one(Op::Matmul, &[s.rep(), o.rep()], &[], &[])
    }
    fn orthonormalize(&mut self, s: T) -> R<T> {
        self.one(Op::Orthonormalize, &[s.rep()], &[], &[])
    }
    fn pack_signs(&mut self, s: T) -> R<T> {
        self.one(Op::PackSigns, &[s.rep()], &[], &[])
    }
    fn read_f32(&mut self, s: T) -> R<Vec<f32>> {
        Ok(self.host.exec(Op::ReadF32, &[s.rep()], &[], &[], &[])?.data)
    }
    fn drop(&mut self, s: T) -> R<()> {
        self.host.remove(s.rep());
        Ok(())
    }
}

impl tensor::Host for State {
    fn zeros(&mut self, shape: Vec<u64>, dtype: wit_types::Dtype, like: T) -> R<T> {
        let mut ints = vec![dtype_from_wit(dtype)];
        ints.extend(u64s(&shape));
        self.one(Op::Zeros, &[like.rep()], &[], &ints)
    }
    fn rand_uniform(&mut self, shape: Vec<u64>, seed: u64, like: T) -> R<T> {
        let mut ints = vec![seed as i64];
        ints.extend(u64s(&shape));
        self.one(Op::RandUniform, &[like.rep()], &[], &ints)
    }
    fn rand_normal(&mut self, shape: Vec<u64>, seed: u64, like: T) -> R<T> {
        let mut ints = vec![seed as i64];
        ints.extend(u64s(&shape));
        self.one(Op::RandNormal, &[like.rep()], &[], &ints)
    }
    fn rand_indices(&mut self, n: u64, k: u64, seed: u64, like: T) -> R<T> {
        self.one(Op::RandIndices, &[like.rep()], &[], &[n.min(i64::MAX as u64) as i64, k.min(i64::MAX as u64) as i64, seed as i64])
    }
    fn from_f32(&mut self, data: Vec<f32>, shape: Vec<u64>, like: T) -> R<T> {
        Ok(own(self.host.exec(Op::FromF32, &[like.rep()], &[], &u64s(&shape), &data)?.ids[0]))
    }
    fn unpack_signs(&mut self, packed: T, numel: u64) -> R<T> {
        self.one(Op::UnpackSigns, &[packed.rep()], &[], &[numel.min(i64::MAX as u64) as i64])
    }
}

impl collective::Host for State {
    fn rank(&mut self) -> R<u32> {
        Ok(self.scalar(Op::Rank, &[])? as u32)
    }
    fn world_size(&mut self) -> R<u32> {
        Ok(self.scalar(Op::WorldSize, &[])? as u32)
    }
    fn all_reduce_sum(&mut self, t: T) -> R<()> {
        self.host.exec(Op::AllReduceSum, &[t.rep()], &[], &[], &[])?;
        Ok(())
    }
    fn all_gather(&mut self, t: T) -> R<T> {
        self.one(Op::AllGather, &[t.rep()], &[], &[])
    }
    fn broadcast(&mut self, t: T, root: u32) -> R<()> {
        self.host.exec(Op::Broadcast, &[t.rep()], &[], &[root as i64], &[])?;
        Ok(())
    }
    fn reduce_scatter_sum(&mut self, t: T) -> R<T> {
        self.one(Op::ReduceScatterSum, &[t.rep()], &[], &[])
    }
}

impl log::Host for State {
    fn write(&mut self, level: log::Level, message: String) -> R<()> {
        super::log_line(&self.host.log, &self.host.name, level as u32, &message);
        Ok(())
    }
}

/// " at FILE:LINE:COL: MESSAGE" from a Rust guest's panic output on stderr.
fn panic_message(stderr: &str) -> Option<String> {
    let mut lines = stderr.lines().skip_while(|l| !l.contains("panicked at"));
    let first = lines.next()?;
    let at = first.split_once("panicked at").map(|(_, r)| r.trim().trim_end_matches(':')).unwrap_or("");
    let msg: Vec<&str> = lines.take_while(|l| !l.starts_with("note:")).collect();
    Some(format!(" at {at}: {}", msg.join(" ")))
}

/// Bytes of a guest's stderr (its last ones) that an error quotes.
const QUOTED_STDERR: usize = 4 << 10;

/// `text` as lines quoted under an error: each line escaped and cut (so
/// nothing the plugin wrote can pass for a line of harness's own), marked
/// `  | `, at most its last [`QUOTED_STDERR`] bytes.
fn quoted(text: &str) -> String {
    let text = text.trim_end();
    let mut cut = text.len().saturating_sub(QUOTED_STDERR);
    while !text.is_char_boundary(cut) {
        cut += 1;
    }
    let mut out = String::new();
    if cut > 0 {
        out.push_str(&format!("\n  | [... {cut} bytes left out ...]"));
    }
    for line in text[cut..].lines() {
        out.push_str("\n  | ");
        out.push_str(&super::log::clean(line, super::log::MAX_LINE_CHARS));
    }
    out
}

/// What a guest wrote to stderr before it trapped without a Rust panic
/// message (a guest in C or JavaScript that aborts, say), quoted: its last
/// [`QUOTED_STDERR`] bytes, or nothing if it wrote nothing.
fn stderr_tail(stderr: &str) -> String {
    match stderr.trim().is_empty() {
        true => String::new(),
        false => format!("; its stderr ends:{}", quoted(stderr)),
    }
}

/// The exception that ended a Python guest, from the traceback on its
/// stderr: componentize-py prints an exception that escapes an export
/// (any but its `Err`, which is the export's error result) and then
/// panics with "Python function threw an unexpected exception", which says
/// neither what was raised nor where. Returns "it raised TYPE: MESSAGE (at
/// FILE line N, in FUNCTION)", the innermost frame of the plugin's own code
/// (not of Python's library), then the traceback quoted. `None` if stderr
/// holds no traceback, or if the guest panicked in Rust for another reason.
fn guest_exception(stderr: &str, panic: Option<&str>) -> Option<String> {
    if panic.is_some_and(|p| !p.contains("Python")) {
        return None;
    }
    // The last traceback (of a chain of exceptions, the one raised last),
    // up to the runtime's panic message after it.
    let start = stderr.rfind("Traceback (most recent call last):")?;
    let tb = &stderr[start..];
    let tb = &tb[..tb.find("\nthread '").map_or(tb.len(), |i| i + 1)];
    let lines: Vec<&str> = tb.lines().collect();
    // Frames and their source lines are indented; the exception is the
    // first line after them that is not.
    let at = 1 + lines[1..].iter().position(|l| !l.is_empty() && !l.starts_with(char::is_whitespace))?;
    let exception: Vec<&str> = lines[at..].iter().map(|l| l.trim()).filter(|l| !l.is_empty()).collect();
    // `  File "PATH", line N, in NAME`
    let frames: Vec<(&str, &str, &str)> = lines[1..at]
        .iter()
        .filter_map(|l| {
            let rest = l.trim_start().strip_prefix("File \"")?;
            let (path, rest) = rest.split_once("\", line ")?;
            let (line, name) = rest.split_once(", in ").unwrap_or((rest, "?"));
            Some((path, line.trim(), name.trim()))
        })
        .collect();
    // componentize-py's file system: Python's library under /python, the
    // bindings under /world, its own modules under /bundled, and the
    // plugin's folders (`-p`, the current one by default) as /0, /1, ...
    let library = |path: &str| {
        path.starts_with('<') || ["/python/", "/world/", "/bundled/"].iter().any(|p| path.starts_with(p)) || path.contains("site-packages")
    };
    let frame = frames.iter().rev().find(|f| !library(f.0)).or(frames.last());
    let mut out = format!("it raised {}", super::log::clean(&exception.join(" "), super::log::MAX_LINE_CHARS));
    if let Some((path, line, name)) = frame {
        // "/0/app.py" -> "app.py": the path in the plugin's folder.
        let own =
            path.strip_prefix('/').and_then(|p| p.split_once('/')).filter(|(n, _)| n.parse::<u32>().is_ok()).map_or(*path, |(_, p)| p);
        out.push_str(&format!(
            " (at {} line {}, in {})",
            super::log::clean(own, 200),
            super::log::clean(line, 20),
            super::log::clean(name, 100)
        ));
    }
    out.push_str(&quoted(tb));
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_that_is_no_component_is_named_for_what_it_is() {
        let err = |bytes: &[u8]| format!("{:#}", load(bytes).err().expect("refused"));
        let e = err(&module(1, 1, 1));
        assert!(e.contains("a core WebAssembly module, not a component") && e.contains("wasm32-wasip2"), "{e}");
        let e = err(b"<html>404 Not Found</html>");
        assert!(e.contains("not a WebAssembly file (26 bytes") && e.contains("truncated download or the wrong file"), "{e}");
        let e = err(&[0, b'a', b's', b'm', 0x0d, 0, 1, 0, 1, 2, 3]);
        assert!(e.contains("an invalid or damaged WebAssembly component"), "{e}");
        let e = err(b"\x7fELF\x02\x01\x01\0\0\0");
        assert!(e.contains("a native library"), "{e}");
    }

    /// A core module with `memories` memories of `pages` 64 KiB pages each
    /// and one table of `elements` elements, in the binary format.
    fn module(memories: u8, pages: u16, elements: u32) -> Vec<u8> {
        let leb = |mut v: u32| {
            let mut out = Vec::new();
            loop {
                let b = (v & 0x7f) as u8;
                v >>= 7;
                out.push(if v == 0 { b } else { b | 0x80 });
                if v == 0 {
                    return out;
                }
            }
        };
        let mut m = b"\0asm\x01\0\0\0".to_vec();
        let mut table = vec![1, 0x70, 0];
        table.extend(leb(elements));
        m.push(4);
        m.extend(leb(table.len() as u32));
        m.extend(table);
        let mut mems = leb(memories as u32);
        for _ in 0..memories {
            mems.push(0);
            mems.extend(leb(pages as u32));
        }
        m.push(5);
        m.extend(leb(mems.len() as u32));
        m.extend(mems);
        m
    }

    fn instantiate(bytes: &[u8], cap_mb: usize) -> wasmtime::Result<()> {
        let module = wasmtime::Module::new(engine(), bytes)?;
        let mut store = Store::new(engine(), Caps { max_bytes: cap_mb << 20, used: 0 });
        store.limiter(|c| c);
        wasmtime::Instance::new(&mut store, &module, &[])?;
        Ok(())
    }

    #[test]
    fn the_memory_cap_counts_every_memory_and_table_of_an_instance() {
        // One memory of 240 MiB fits a 256 MiB cap; 16 of them (3.75 GiB)
        // do not, though each alone would.
        instantiate(&module(1, 3840, 16), 256).unwrap();
        let e = instantiate(&module(16, 3840, 16), 256).unwrap_err();
        assert!(format!("{e:#}").contains("memory past the cap of 256 MiB"), "{e:#}");
        // A table of 20 M elements counts 320 MiB.
        let e = instantiate(&module(1, 16, 20_000_000), 256).unwrap_err();
        assert!(format!("{e:#}").contains("memory past the cap of 256 MiB"), "{e:#}");
        // More memories than any toolchain needs are refused by number.
        assert!(instantiate(&module(MAX_MEMORIES as u8 + 1, 0, 0), 256).is_err());
    }

    #[test]
    fn stderr_keeps_its_head_and_tail() {
        let s = Stderr::default();
        for _ in 0..1024 {
            s.push(&[b'y'; 1024]);
        }
        s.push(b"thread '<unnamed>' panicked at src/lib.rs:1:1:\nthe end\n");
        let text = s.contents();
        assert!(text.len() < 40 << 10);
        assert!(text.contains("bytes left out"));
        assert_eq!(panic_message(&text).unwrap(), " at src/lib.rs:1:1: the end");
    }

    /// What componentize-py writes before its panic: the traceback; the
    /// error names the exception, the innermost frame of the plugin's own
    /// code (not of Python's library) and quotes the traceback.
    #[test]
    fn a_python_exception_is_read_from_its_traceback() {
        let panic = "thread '<unnamed>' panicked at runtime/src/lib.rs:1293:29:\n\
                     Python function threw an unexpected exception\nnote: run with `RUST_BACKTRACE=1`\n";
        let tb = "Traceback (most recent call last):\n  File \"/0/app.py\", line 44, in compress\n    \
                  tomllib.loads(\"=\")\n  File \"/python/tomllib/_parser.py\", line 102, in loads\n\
                  tomllib.TOMLDecodeError: Invalid statement\n  (at line 1, column 1)\n";
        let stderr = format!("earlier output\n{tb}{panic}");
        let p = panic_message(&stderr);
        let e = guest_exception(&stderr, p.as_deref()).unwrap();
        let (first, quoted) = e.split_once('\n').unwrap();
        assert_eq!(first, "it raised tomllib.TOMLDecodeError: Invalid statement (at line 1, column 1) (at app.py line 44, in compress)");
        assert!(quoted.starts_with("  | Traceback (most recent call last):\n  |   File \"/0/app.py\""), "{quoted}");
        assert!(!e.contains("earlier output") && !e.contains("panicked"), "{e}");
        // Of a chain, the exception raised last; escapes stay escaped.
        let chained = format!(
            "{tb}\nDuring handling of the above exception, another exception occurred:\n\n\
             Traceback (most recent call last):\n  File \"/0/app.py\", line 54, in check_k\nValueError: bad \u{1b}[2Kk\n{panic}"
        );
        let e = guest_exception(&chained, panic_message(&chained).as_deref()).unwrap();
        assert!(e.starts_with("it raised ValueError: bad \\u{1b}[2Kk (at app.py line 54, in check_k)\n"), "{e}");
        assert!(!e.contains('\u{1b}') && !e.contains("TOMLDecodeError"), "{e}");
        // A Rust panic is not taken for an exception, nor is a bare abort.
        let rust = format!("{tb}thread '<unnamed>' panicked at src/lib.rs:1:1:\nboom\n");
        assert!(guest_exception(&rust, panic_message(&rust).as_deref()).is_none());
        assert!(guest_exception("", None).is_none());
    }

    /// A guest that aborts without a Rust panic message (JavaScript's engine,
    /// C): the end of its stderr, quoted line by line.
    #[test]
    fn an_abort_quotes_the_end_of_stderr() {
        assert_eq!(stderr_tail(" \n"), "");
        let tail = stderr_tail(&format!("{}\nexpected a string\nStack:\n  f@app.js:1:2\n", "x".repeat(10_000)));
        assert!(tail.starts_with("; its stderr ends:\n  | [... "), "{tail}");
        assert!(tail.ends_with("\n  | expected a string\n  | Stack:\n  |   f@app.js:1:2"), "{tail}");
        assert!(tail.len() < QUOTED_STDERR + 600, "{}", tail.len());
    }

    #[test]
    fn panic_messages_are_read_from_stderr() {
        let s = "thread '<unnamed>' (1) panicked at src/lib.rs:51:20:\nboom\nnote: run with `RUST_BACKTRACE=1`\n";
        assert_eq!(super::panic_message(s).unwrap(), " at src/lib.rs:51:20: boom");
        assert!(super::panic_message("nothing").is_none());
    }
}
