//! WASM plugins: wasmtime components, sandboxed.
//!
//! One [`Engine`] per process (epoch interruption on, one ticker thread);
//! each artifact is compiled once and pre-instantiated ([`InstancePre`]);
//! each plugin instance (one per entry and rank) gets its own [`Store`] with
//! a memory cap, a per-call deadline, and a WASI context that grants nothing
//! (no files, network, environment or clocks beyond what WASI p2 forces;
//! stderr goes to a small in-memory pipe so a guest's panic message can be
//! reported).

use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use wasmtime::component::{HasSelf, InstancePre, Linker, Resource, ResourceTable};
use wasmtime::{Engine, ResourceLimiter, Store};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::ops::{self, HostSide};
use super::Kind as PluginKind;
use crate::strategy::{BatchDecision, BucketCtx, BucketLayout, CheckpointAnswer, CheckpointHistory, StepTelemetry};

/// Host-side type of the WIT `tensor` resource: the resource's rep is the
/// id in [`HostSide`]'s table.
pub struct TensorRes;

mod imports;
mod stderr;

use imports::bindings::{v0_1, v0_2};
pub use stderr::Stderr;
use stderr::{guest_exception, panic_message, stderr_tail};

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

/// Which of the contract's worlds, of which version, a component is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bind {
    Compressor01,
    Batch01,
    /// Contract 0.1.0's `checkpointing`: every snapshot is persisted.
    Checkpoint010,
    Tiered01,
    Compressor02,
    Batch02,
    Tiered02,
}

/// A compiled component, ready to instantiate.
pub struct Artifact {
    pre: InstancePre<State>,
    pub kind: PluginKind,
    bind: Bind,
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

/// The contract versions this host loads: the newest patch of each minor
/// version it keeps (a component of an earlier patch of one loads too).
pub const CONTRACTS: [&str; 2] = ["0.1.1", harness_sdk::CONTRACT_VERSION];

/// Compiles a component and checks what it exports.
pub fn load(bytes: &[u8]) -> Result<Artifact> {
    let engine = engine();
    let (component, _) =
        super::cache::component(engine, bytes, super::cache::dir().as_deref()).map_err(anyhow::Error::from).context(what_it_is(bytes))?;
    let ty = component.component_type();
    let mut ifaces = Vec::new();
    let mut contract = None;
    for (name, _) in ty.exports(engine) {
        if let Some((iface, version)) = interface_version(name) {
            contract.get_or_insert_with(|| version.to_owned());
            ifaces.push(iface.to_owned());
        }
    }
    let contract = contract.ok_or_else(|| anyhow!("it exports no harness:strategy interface: not a harness plugin"))?;
    let Some(minor) = contract_minor(&contract) else {
        anyhow::bail!(
            "it was built against contract harness:strategy@{contract}, and this harness speaks @{} (and loads 0.1 components); rebuild it with a matching harness-sdk",
            harness_sdk::CONTRACT_VERSION
        );
    };
    let has = |i: &str| ifaces.iter().any(|x| x == i);
    let bind = match (minor, has("gradient-compression"), has("batch-sizing"), has("tiered-checkpointing"), has("checkpointing")) {
        (1, true, ..) => Bind::Compressor01,
        (1, _, true, ..) => Bind::Batch01,
        (1, _, _, true, _) => Bind::Tiered01,
        (1, _, _, _, true) => Bind::Checkpoint010,
        (_, true, ..) => Bind::Compressor02,
        (_, _, true, ..) => Bind::Batch02,
        (_, _, _, true, _) => Bind::Tiered02,
        _ => anyhow::bail!("it exports none of gradient-compression, batch-sizing, tiered-checkpointing (contract {contract})"),
    };
    let kind = match bind {
        Bind::Compressor01 | Bind::Compressor02 => PluginKind::Compressor,
        Bind::Batch01 | Bind::Batch02 => PluginKind::BatchPolicy,
        Bind::Checkpoint010 | Bind::Tiered01 | Bind::Tiered02 => PluginKind::CheckpointPolicy,
    };
    let mut linker: Linker<State> = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
    forbid_blocking(&mut linker)?;
    let l = &mut linker;
    match bind {
        Bind::Compressor01 => v0_1::compressor::Compressor::add_to_linker::<State, HasSelf<State>>(l, |s| s)?,
        Bind::Batch01 => v0_1::batch_policy::BatchPolicy::add_to_linker::<State, HasSelf<State>>(l, |s| s)?,
        Bind::Checkpoint010 => v0_1::checkpoint_policy::CheckpointPolicy::add_to_linker::<State, HasSelf<State>>(l, |s| s)?,
        Bind::Tiered01 => v0_1::tiered_checkpoint_policy::TieredCheckpointPolicy::add_to_linker::<State, HasSelf<State>>(l, |s| s)?,
        Bind::Compressor02 => v0_2::compressor::Compressor::add_to_linker::<State, HasSelf<State>>(l, |s| s)?,
        Bind::Batch02 => v0_2::batch_policy::BatchPolicy::add_to_linker::<State, HasSelf<State>>(l, |s| s)?,
        Bind::Tiered02 => v0_2::checkpoint_policy::CheckpointPolicy::add_to_linker::<State, HasSelf<State>>(l, |s| s)?,
    }
    let pre = linker.instantiate_pre(&component).map_err(anyhow::Error::from).context("its imports cannot be satisfied by the sandbox")?;
    Ok(Artifact { pre, kind, bind, contract })
}

/// The minor version of `contract` if this host loads it: one of
/// [`CONTRACTS`]' minor versions, of that patch or an earlier one.
fn contract_minor(contract: &str) -> Option<u32> {
    let parse = |v: &str| -> Option<(u32, u32, u32)> {
        let mut it = v.split('.').map(|p| p.parse::<u32>().ok());
        let v = (it.next()??, it.next()??, it.next()??);
        it.next().is_none().then_some(v)
    };
    let (a, b, c) = parse(contract)?;
    CONTRACTS.iter().filter_map(|k| parse(k)).find(|&(x, y, z)| a == x && b == y && c <= z).map(|(_, y, _)| y)
}

/// Sandbox limits of one instance.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub memory_bytes: usize,
    pub deadline: Duration,
}

enum World {
    Compressor01(v0_1::compressor::Compressor),
    Batch01(v0_1::batch_policy::BatchPolicy),
    Checkpoint010(v0_1::checkpoint_policy::CheckpointPolicy),
    Tiered01(v0_1::tiered_checkpoint_policy::TieredCheckpointPolicy),
    Compressor02(v0_2::compressor::Compressor),
    Batch02(v0_2::batch_policy::BatchPolicy),
    Tiered02(v0_2::checkpoint_policy::CheckpointPolicy),
}

/// `$body` with `$p` the world's `plugin` interface, in every world.
macro_rules! on_plugin {
    ($w:expr, |$p:ident| $body:expr) => {
        match $w {
            World::Compressor01(b) => {
                let $p = b.harness_strategy_plugin();
                $body
            }
            World::Batch01(b) => {
                let $p = b.harness_strategy_plugin();
                $body
            }
            World::Checkpoint010(b) => {
                let $p = b.harness_strategy_plugin();
                $body
            }
            World::Tiered01(b) => {
                let $p = b.harness_strategy_plugin();
                $body
            }
            World::Compressor02(b) => {
                let $p = b.harness_strategy_plugin();
                $body
            }
            World::Batch02(b) => {
                let $p = b.harness_strategy_plugin();
                $body
            }
            World::Tiered02(b) => {
                let $p = b.harness_strategy_plugin();
                $body
            }
        }
    };
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
        let (s, i) = (&mut store, &instance);
        let world = match a.bind {
            Bind::Compressor01 => World::Compressor01(v0_1::compressor::Compressor::new(s, i)?),
            Bind::Batch01 => World::Batch01(v0_1::batch_policy::BatchPolicy::new(s, i)?),
            Bind::Checkpoint010 => World::Checkpoint010(v0_1::checkpoint_policy::CheckpointPolicy::new(s, i)?),
            Bind::Tiered01 => World::Tiered01(v0_1::tiered_checkpoint_policy::TieredCheckpointPolicy::new(s, i)?),
            Bind::Compressor02 => World::Compressor02(v0_2::compressor::Compressor::new(s, i)?),
            Bind::Batch02 => World::Batch02(v0_2::batch_policy::BatchPolicy::new(s, i)?),
            Bind::Tiered02 => World::Tiered02(v0_2::checkpoint_policy::CheckpointPolicy::new(s, i)?),
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
            on_plugin!(w, |p| {
                let i = p.call_info(s)?;
                Ok((i.name, i.version))
            })
        })
    }

    /// `plugin.configure`.
    pub fn configure(&mut self, toml: &str) -> Result<Result<(), String>> {
        self.call(|s, w| on_plugin!(w, |p| p.call_configure(s, toml)))
    }

    /// `plugin.state-save`.
    pub fn state_save(&mut self) -> Result<Vec<u8>> {
        self.call(|s, w| on_plugin!(w, |p| p.call_state_save(s)))
    }

    /// `plugin.state-load`.
    pub fn state_load(&mut self, state: &[u8]) -> Result<Result<(), String>> {
        self.call(|s, w| on_plugin!(w, |p| p.call_state_load(s, state)))
    }

    /// `gradient-compression.setup` (contract 0.2; a 0.1 compressor is
    /// told nothing).
    pub fn setup(&mut self, buckets: &[BucketLayout]) -> Result<Result<(), String>> {
        use v0_2::compressor::exports::harness::strategy::gradient_compression as wit;
        let layouts: Vec<wit::BucketLayout> = buckets
            .iter()
            .map(|b| {
                let params = b
                    .params
                    .iter()
                    .map(|p| {
                        Ok(wit::ParamSlot {
                            name: p.name.clone(),
                            shape: p.shape.clone(),
                            offset: p.offset,
                            numel: p.numel,
                            dtype: imports::v0_2_glue::dtype_to_wit(ops::dtype_index(p.dtype)?),
                            weight: p.weight,
                        })
                    })
                    .collect::<Result<_>>()?;
                Ok(wit::BucketLayout { numel: b.numel, params })
            })
            .collect::<Result<_>>()?;
        self.call(|s, w| match w {
            World::Compressor02(b) => b.harness_strategy_gradient_compression().call_setup(s, &layouts),
            World::Compressor01(_) => Ok(Ok(())),
            _ => unreachable!("setup on a plugin of another kind"),
        })
    }

    /// `gradient-compression.compress` on a lent tensor id.
    pub fn compress(&mut self, bucket: u32, ctx: &BucketCtx) -> Result<Result<(), String>> {
        let (step, index, count) = (ctx.step, ctx.index as u32, ctx.count as u32);
        self.call(|s, w| match w {
            World::Compressor01(b) => {
                use v0_1::compressor::exports::harness::strategy::gradient_compression as wit;
                b.harness_strategy_gradient_compression().call_compress(
                    s,
                    Resource::new_borrow(bucket),
                    wit::BucketInfo { step, index, count },
                )
            }
            World::Compressor02(b) => {
                use v0_2::compressor::exports::harness::strategy::gradient_compression as wit;
                b.harness_strategy_gradient_compression().call_compress(
                    s,
                    Resource::new_borrow(bucket),
                    wit::BucketInfo { step, index, count },
                )
            }
            _ => unreachable!("compress on a plugin of another kind"),
        })
    }

    /// `batch-sizing.initial`.
    pub fn batch_initial(&mut self, c: BatchDecision) -> Result<Result<BatchDecision, String>> {
        macro_rules! initial {
            ($b:expr, $s:expr, $($wit:ident)::+) => {{
                use $($wit)::+ as wit;
                let given = wit::Batch { micro_batch: c.micro_batch, accum_steps: c.accum_steps, lr_scale: c.lr_scale };
                let r = $b.harness_strategy_batch_sizing().call_initial($s, given)?;
                Ok(r.map(|b| BatchDecision { micro_batch: b.micro_batch, accum_steps: b.accum_steps, lr_scale: b.lr_scale }))
            }};
        }
        self.call(|s, w| match w {
            World::Batch01(b) => initial!(b, s, v0_1::batch_policy::exports::harness::strategy::batch_sizing),
            World::Batch02(b) => initial!(b, s, v0_2::batch_policy::exports::harness::strategy::batch_sizing),
            _ => unreachable!("batch call on a plugin of another kind"),
        })
    }

    /// `batch-sizing.next`.
    pub fn batch_next(&mut self, t: &StepTelemetry) -> Result<Result<BatchDecision, String>> {
        self.call(|s, w| {
            let r = match w {
                World::Batch01(b) => b
                    .harness_strategy_batch_sizing()
                    .call_next(s, imports::v0_1_glue::telemetry(t))?
                    .map(|b| BatchDecision { micro_batch: b.micro_batch, accum_steps: b.accum_steps, lr_scale: b.lr_scale }),
                World::Batch02(b) => b
                    .harness_strategy_batch_sizing()
                    .call_next(s, imports::v0_2_glue::telemetry(t))?
                    .map(|b| BatchDecision { micro_batch: b.micro_batch, accum_steps: b.accum_steps, lr_scale: b.lr_scale }),
                _ => unreachable!("batch call on a plugin of another kind"),
            };
            Ok(r)
        })
    }

    /// `batch-sizing.wants-gradient-stats`.
    pub fn batch_wants_gradient_stats(&mut self) -> Result<Result<bool, String>> {
        self.call(|s, w| match w {
            World::Batch01(b) => b.harness_strategy_batch_sizing().call_wants_gradient_stats(s).map(Ok),
            World::Batch02(b) => b.harness_strategy_batch_sizing().call_wants_gradient_stats(s).map(Ok),
            _ => unreachable!("batch call on a plugin of another kind"),
        })
    }

    /// `tiered-checkpointing.decide` (or 0.1.0's `checkpointing.decide`,
    /// whose every snapshot is persisted).
    pub fn checkpoint_decide(&mut self, t: &StepTelemetry, h: &CheckpointHistory) -> Result<Result<CheckpointAnswer, String>> {
        macro_rules! tiered {
            ($b:expr, $s:expr, $($wit:ident)::+, $glue:ident) => {{
                use $($wit)::+ as wit;
                let state = wit::CheckpointState {
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
                let d = $b.harness_strategy_tiered_checkpointing().call_decide($s, imports::$glue::telemetry(t), &state)?;
                Ok(d.map(|d| (d.snapshot, d.snapshot && d.persist, d.delete)))
            }};
        }
        self.call(|s, w| match w {
            World::Tiered01(b) => {
                tiered!(b, s, v0_1::tiered_checkpoint_policy::exports::harness::strategy::tiered_checkpointing, v0_1_glue)
            }
            World::Tiered02(b) => tiered!(b, s, v0_2::checkpoint_policy::exports::harness::strategy::tiered_checkpointing, v0_2_glue),
            World::Checkpoint010(b) => {
                use v0_1::checkpoint_policy::exports::harness::strategy::checkpointing as wit;
                let hist = wit::CheckpointHistory {
                    last_cost_s: h.last_cost_s,
                    saved: h.saved.clone(),
                    failures: h.failures.clone(),
                    since_last_s: h.since_last_s,
                };
                let d = b.harness_strategy_checkpointing().call_decide(s, imports::v0_1_glue::telemetry(t), &hist)?;
                Ok(d.map(|d| (d.save, d.save, d.delete)))
            }
            _ => unreachable!("checkpoint call on a plugin of another kind"),
        })
    }
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
}
