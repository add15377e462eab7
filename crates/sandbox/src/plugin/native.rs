//! Native plugins: shared libraries through the C ABI of
//! `sdk/include/harness_strategy.h`, loaded with libloading.
//!
//! Native plugins are trusted code: they run in the host process without a
//! sandbox (no memory cap, no deadline), and results label them
//! "native (unsandboxed)". The host still validates everything they return
//! and turns their panics (caught by the SDK's export wrappers) into entry
//! failures.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use harness_sdk::abi::{self, exports as x, symbols, Op};
use libloading::Library;

use super::ops::HostSide;
use super::Kind as PluginKind;
use crate::strategy::CheckpointHistory;

/// An opened library whose ABI version matched.
pub struct Artifact {
    lib: Arc<Library>,
    pub kind: PluginKind,
    /// The ABI version it speaks: [`abi::ABI_VERSION`] or [`abi::ABI_VERSION_0_1`].
    pub abi: u32,
}

/// Opens `path` and checks `harness_abi_version` before touching any other
/// symbol.
pub fn load(path: &Path) -> Result<Artifact> {
    // A file that is no shared library (a source file, a `.rlib`) is named
    // for what it is, not by the loader's "invalid ELF header".
    let mut head = [0u8; 8];
    let n = std::io::Read::read(&mut std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?, &mut head)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let format = harness_format::plugin::ArtifactFormat::of(&head[..n]);
    if format != harness_format::plugin::ArtifactFormat::Elf {
        bail!(
            "{} is {} (it starts with {}): a plugin is a WebAssembly component (`cargo build --release --target wasm32-wasip2` -> \
             target/wasm32-wasip2/release/<crate>.wasm) or a native library of this machine (`cargo build --release` -> \
             target/release/lib<crate>.so)",
            path.display(),
            format.describe(),
            harness_format::plugin::head_hex(&head[..n], 8)
        );
    }
    // A name without a slash would be searched for on the library path
    // (`libc.so.6`): the file named is the one loaded.
    let path = &if path.components().count() == 1 { Path::new(".").join(path) } else { path.to_owned() };
    let loading = super::exit_guard::CallScope::loading(path);
    // SAFETY: loading runs the library's initialisers: native plugins are
    // trusted code by definition (docs/plugin-sdk.md), and labelled unsandboxed.
    let lib = unsafe { Library::new(path) }.with_context(|| format!("cannot load the library {}", path.display()))?;
    drop(loading);
    // The library's exit handlers run before those registered earlier: the
    // guard's goes after them, to run first.
    super::exit_guard::register_again();
    // SAFETY: the symbol's type is the ABI's; it takes nothing.
    let version = unsafe {
        let f = lib
            .get::<x::AbiVersion>(symbols::ABI_VERSION)
            .map_err(|_| anyhow!("it does not export `harness_abi_version`: not a harness plugin (build it with harness-sdk's export!)"))?;
        f()
    };
    if version != abi::ABI_VERSION && version != abi::ABI_VERSION_0_1 {
        bail!(
            "it speaks plugin ABI version {version} ({}.{}), and this harness speaks version {} ({}.{}) and loads version {} ({}.{}); rebuild the plugin against a matching harness-sdk",
            version >> 16,
            version & 0xffff,
            abi::ABI_VERSION,
            abi::ABI_VERSION >> 16,
            abi::ABI_VERSION & 0xffff,
            abi::ABI_VERSION_0_1,
            abi::ABI_VERSION_0_1 >> 16,
            abi::ABI_VERSION_0_1 & 0xffff,
        );
    }
    // SAFETY: as above; checked version.
    let kind = unsafe { lib.get::<x::Kind>(symbols::KIND).map_err(|_| anyhow!("it does not export `harness_plugin_kind`"))?() };
    let kind = match kind {
        abi::KIND_COMPRESSOR => PluginKind::Compressor,
        abi::KIND_BATCH_POLICY => PluginKind::BatchPolicy,
        abi::KIND_CHECKPOINT_POLICY => PluginKind::CheckpointPolicy,
        k => bail!("it says it is of kind {k}, which is none of 1 (compressor), 2 (batch policy), 3 (checkpoint policy)"),
    };
    if kind == PluginKind::Compressor && version >= abi::ABI_VERSION {
        // SAFETY: as above; only looked up.
        if unsafe { lib.get::<x::CompressSetup>(symbols::COMPRESS_SETUP) }.is_err() {
            bail!("it speaks ABI version {version} and does not export `harness_compress_setup`, which a compressor of that version must");
        }
    }
    Ok(Artifact { lib: Arc::new(lib), kind, abi: version })
}

/// What the host lends one instance; the plugin gets a pointer to it.
struct Ctx {
    host: HostSide,
    last_error: String,
    ints: Vec<i64>,
    data: Vec<f32>,
}

unsafe extern "C" fn host_op(ctx: *mut c_void, code: u32, args: *const abi::OpArgs, out: *mut abi::OpResult) -> i32 {
    let r = catch_unwind(AssertUnwindSafe(|| -> Result<()> {
        // SAFETY: ctx is the Box<Ctx> this module lent with the table; the
        // plugin calls back only during a host-initiated call, while the
        // host holds no reference to it.
        let c = unsafe { &mut *(ctx as *mut Ctx) };
        let op = Op::from_code(code).ok_or_else(|| anyhow!("unknown op code {code}"))?;
        // SAFETY: args and out are valid for the call per the ABI; slices
        // are built from the pointer/length pairs the plugin passed.
        let (a, o) = unsafe { (&*args, &mut *out) };
        let slice = |p: *const u8, n: usize, size: usize| -> &[u8] {
            if n == 0 || p.is_null() {
                &[]
            } else {
                // SAFETY: per the ABI, p points to n elements of `size` bytes.
                unsafe { std::slice::from_raw_parts(p, n * size) }
            }
        };
        let tensors: Vec<u32> = slice(a.tensors as *const u8, a.n_tensors, 8)
            .chunks_exact(8)
            .map(|b| u64::from_ne_bytes(b.try_into().expect("8 bytes")))
            .map(|h| u32::try_from(h).map_err(|_| anyhow!("tensor handle {h} is not live")))
            .collect::<Result<_>>()?;
        let floats: Vec<f64> =
            slice(a.floats as *const u8, a.n_floats, 8).chunks_exact(8).map(|b| f64::from_ne_bytes(b.try_into().expect("8"))).collect();
        let ints: Vec<i64> =
            slice(a.ints as *const u8, a.n_ints, 8).chunks_exact(8).map(|b| i64::from_ne_bytes(b.try_into().expect("8"))).collect();
        let data: Vec<f32> =
            slice(a.data as *const u8, a.n_data, 4).chunks_exact(4).map(|b| f32::from_ne_bytes(b.try_into().expect("4"))).collect();
        let r = c.host.exec(op, &tensors, &floats, &ints, &data)?;
        *o = abi::OpResult::default();
        for (slot, id) in o.tensors.iter_mut().zip(&r.ids) {
            *slot = *id as u64;
        }
        o.scalar = r.scalar;
        o.ptr = r.ptr as *mut c_void;
        c.ints = r.ints;
        c.data = r.data;
        o.ints = c.ints.as_ptr();
        o.n_ints = c.ints.len();
        o.data = c.data.as_ptr();
        o.n_data = c.data.len();
        Ok(())
    }));
    // SAFETY: as above.
    let c = unsafe { &mut *(ctx as *mut Ctx) };
    match r {
        Ok(Ok(())) => abi::STATUS_OK,
        Ok(Err(e)) => {
            c.last_error = format!("{e:#}");
            abi::STATUS_ERROR
        }
        Err(_) => {
            c.last_error = "the host panicked in this op".into();
            abi::STATUS_PANIC
        }
    }
}

unsafe extern "C" fn host_drop(ctx: *mut c_void, t: u64) {
    // SAFETY: see host_op.
    let c = unsafe { &mut *(ctx as *mut Ctx) };
    if let Ok(id) = u32::try_from(t) {
        c.host.remove(id);
    }
}

unsafe extern "C" fn host_last_error(ctx: *mut c_void, len: *mut usize) -> *const u8 {
    // SAFETY: see host_op; len is a valid out pointer per the ABI.
    let c = unsafe { &*(ctx as *const Ctx) };
    // SAFETY: `len` is a valid, writable out pointer per the ABI.
    unsafe { *len = c.last_error.len() };
    c.last_error.as_ptr()
}

unsafe extern "C" fn host_log(ctx: *mut c_void, level: u32, msg: *const u8, len: usize) {
    // SAFETY: see host_op; msg points to len bytes per the ABI.
    let c = unsafe { &*(ctx as *const Ctx) };
    // SAFETY: a non-null `msg` points to `len` readable bytes per the ABI.
    let bytes = if msg.is_null() { &[][..] } else { unsafe { std::slice::from_raw_parts(msg, len) } };
    super::log_line(&c.host.log, &c.host.name, level, &String::from_utf8_lossy(bytes));
}

/// The plugin's exports, looked up once per instance (a `dlsym` per call
/// would cost more than the call).
#[derive(Clone, Copy, Default)]
struct Fns {
    info: Option<x::GetInfo>,
    configure: Option<x::Configure>,
    last_error: Option<x::LastError>,
    state_save: Option<x::StateSave>,
    state_load: Option<x::StateLoad>,
    compress: Option<x::Compress>,
    compress_setup: Option<x::CompressSetup>,
    batch_initial: Option<x::BatchInitial>,
    batch_next: Option<x::BatchNext>,
    batch_wants_gradient_stats: Option<x::BatchWantsGradientStats>,
    checkpoint_decide: Option<x::CheckpointDecide>,
    checkpoint_decide_tiered: Option<x::CheckpointDecideTiered>,
}

/// One instance of a native plugin.
pub struct Instance {
    lib: Arc<Library>,
    fns: Fns,
    this: *mut c_void,
    ctx: *mut Ctx,
    /// Keeps the table the plugin points at alive.
    _table: Box<abi::Host>,
}

// SAFETY: an instance is used by one thread at a time (one per rank); the
// raw pointers are owned by it.
unsafe impl Send for Instance {}

impl Instance {
    /// Creates an instance with its own host table.
    pub fn new(a: &Artifact, host: HostSide) -> Result<Instance> {
        let ctx = Box::into_raw(Box::new(Ctx { host, last_error: String::new(), ints: Vec::new(), data: Vec::new() }));
        let table = Box::new(abi::Host {
            abi_version: a.abi,
            ctx: ctx as *mut c_void,
            op: host_op,
            drop_tensor: host_drop,
            last_error: host_last_error,
            log: host_log,
        });
        // SAFETY: checked ABI; the table outlives the instance.
        let this = unsafe {
            let create = a.lib.get::<x::Create>(symbols::CREATE).map_err(|_| anyhow!("it does not export `harness_plugin_create`"))?;
            create(&*table)
        };
        if this.is_null() {
            // SAFETY: ctx came from Box::into_raw above and is not shared.
            drop(unsafe { Box::from_raw(ctx) });
            bail!("harness_plugin_create returned null");
        }
        let mut inst = Instance { lib: a.lib.clone(), fns: Fns::default(), this, ctx, _table: table };
        inst.fns = Fns {
            info: inst.sym(symbols::INFO).ok(),
            configure: inst.sym(symbols::CONFIGURE).ok(),
            last_error: inst.sym(symbols::LAST_ERROR).ok(),
            state_save: inst.sym(symbols::STATE_SAVE).ok(),
            state_load: inst.sym(symbols::STATE_LOAD).ok(),
            compress: inst.sym(symbols::COMPRESS).ok(),
            compress_setup: if a.abi >= abi::ABI_VERSION { inst.sym(symbols::COMPRESS_SETUP).ok() } else { None },
            batch_initial: inst.sym(symbols::BATCH_INITIAL).ok(),
            batch_next: inst.sym(symbols::BATCH_NEXT).ok(),
            batch_wants_gradient_stats: inst.sym(symbols::BATCH_WANTS_GRADIENT_STATS).ok(),
            checkpoint_decide: inst.sym(symbols::CHECKPOINT_DECIDE).ok(),
            checkpoint_decide_tiered: inst.sym(symbols::CHECKPOINT_DECIDE_TIERED).ok(),
        };
        Ok(inst)
    }

    fn need<F>(f: Option<F>, name: &[u8]) -> Result<F> {
        f.ok_or_else(|| anyhow!("it does not export `{}`", String::from_utf8_lossy(&name[..name.len() - 1])))
    }

    /// The host side (tensor table, meter). Not to be held across plugin calls.
    pub fn host(&mut self) -> &mut HostSide {
        // SAFETY: no plugin call is running (we hold &mut self).
        unsafe { &mut (*self.ctx).host }
    }

    fn sym<F: Copy>(&self, name: &[u8]) -> Result<F> {
        // SAFETY: F is the ABI signature of `name` (callers pair them).
        let s = unsafe { self.lib.get::<F>(name) }
            .map_err(|_| anyhow!("it does not export `{}`", String::from_utf8_lossy(&name[..name.len() - 1])))?;
        Ok(*s)
    }

    /// Turns a status into a result, with the plugin's message.
    fn status(&self, code: i32) -> Result<Result<(), String>> {
        if code == abi::STATUS_OK {
            return Ok(Ok(()));
        }
        let f = Self::need(self.fns.last_error, symbols::LAST_ERROR)?;
        let mut len = 0usize;
        // SAFETY: per the ABI the message is valid until the next call.
        let msg = unsafe {
            let p = f(self.this, &mut len);
            if p.is_null() {
                String::new()
            } else {
                String::from_utf8_lossy(std::slice::from_raw_parts(p, len)).into_owned()
            }
        };
        if code == abi::STATUS_PANIC {
            bail!("it panicked: {msg}");
        }
        Ok(Err(msg))
    }

    /// `harness_plugin_info`.
    pub fn info(&mut self) -> Result<(String, String)> {
        let f = Self::need(self.fns.info, symbols::INFO)?;
        let mut i = abi::Info { name: std::ptr::null(), name_len: 0, version: std::ptr::null(), version_len: 0 };
        // SAFETY: i is a valid out pointer; strings live as long as the instance.
        unsafe { f(self.this, &mut i) };
        let s = |p: *const u8, n: usize| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: per the ABI, p points to n UTF-8 bytes.
                String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(p, n) }).into_owned()
            }
        };
        Ok((s(i.name, i.name_len), s(i.version, i.version_len)))
    }

    /// `harness_plugin_configure`.
    pub fn configure(&mut self, toml: &str) -> Result<Result<(), String>> {
        let f = Self::need(self.fns.configure, symbols::CONFIGURE)?;
        // SAFETY: toml outlives the call.
        let code = unsafe { f(self.this, toml.as_ptr(), toml.len()) };
        self.status(code)
    }

    /// `harness_plugin_state_save`.
    pub fn state_save(&mut self) -> Result<Vec<u8>> {
        unsafe extern "C" fn sink(ctx: *mut c_void, data: *const u8, len: usize) {
            // SAFETY: ctx is the Vec below; data points to len bytes.
            let v = unsafe { &mut *(ctx as *mut Vec<u8>) };
            if !data.is_null() {
                // SAFETY: a non-null `data` points to `len` readable bytes per the ABI.
                v.extend_from_slice(unsafe { std::slice::from_raw_parts(data, len) });
            }
        }
        let f = Self::need(self.fns.state_save, symbols::STATE_SAVE)?;
        let mut out: Vec<u8> = Vec::new();
        // SAFETY: out outlives the call.
        let code = unsafe { f(self.this, sink, &mut out as *mut Vec<u8> as *mut c_void) };
        self.status(code)?.map_err(|m| anyhow!("state-save failed: {m}"))?;
        Ok(out)
    }

    /// `harness_plugin_state_load`.
    pub fn state_load(&mut self, state: &[u8]) -> Result<Result<(), String>> {
        let f = Self::need(self.fns.state_load, symbols::STATE_LOAD)?;
        // SAFETY: state outlives the call.
        let code = unsafe { f(self.this, state.as_ptr(), state.len()) };
        self.status(code)
    }

    /// `harness_compress` on a lent tensor id.
    pub fn compress(&mut self, bucket: u32, info: abi::BucketInfo) -> Result<Result<(), String>> {
        let f = Self::need(self.fns.compress, symbols::COMPRESS)?;
        // SAFETY: info outlives the call.
        let code = unsafe { f(self.this, bucket as u64, &info) };
        self.status(code)
    }

    /// `harness_compress_setup` (ABI 2; a library of ABI 1 is told nothing).
    pub fn setup(&mut self, buckets: &[crate::strategy::BucketLayout]) -> Result<Result<(), String>> {
        let Some(f) = self.fns.compress_setup else { return Ok(Ok(())) };
        let dtypes: Vec<Vec<u32>> = buckets
            .iter()
            .map(|b| b.params.iter().map(|p| super::ops::dtype_index(p.dtype).map(|i| i as u32)).collect::<Result<_>>())
            .collect::<Result<_>>()?;
        let slots: Vec<Vec<abi::ParamSlot>> = buckets
            .iter()
            .zip(&dtypes)
            .map(|(b, d)| {
                b.params
                    .iter()
                    .zip(d)
                    .map(|(p, &dtype)| abi::ParamSlot {
                        name: p.name.as_ptr(),
                        name_len: p.name.len(),
                        shape: p.shape.as_ptr(),
                        ndim: p.shape.len(),
                        offset: p.offset,
                        numel: p.numel,
                        dtype,
                        weight: p.weight as u8,
                    })
                    .collect()
            })
            .collect();
        let layouts: Vec<abi::BucketLayout> =
            buckets.iter().zip(&slots).map(|(b, s)| abi::BucketLayout { numel: b.numel, params: s.as_ptr(), n_params: s.len() }).collect();
        // SAFETY: the layouts, slots, names and shapes outlive the call.
        let code = unsafe { f(self.this, layouts.as_ptr(), layouts.len()) };
        self.status(code)
    }

    /// `harness_batch_initial`.
    pub fn batch_initial(&mut self, configured: abi::Batch) -> Result<Result<abi::Batch, String>> {
        let f = Self::need(self.fns.batch_initial, symbols::BATCH_INITIAL)?;
        let mut out = abi::Batch::default();
        // SAFETY: valid in and out pointers.
        let code = unsafe { f(self.this, &configured, &mut out) };
        Ok(self.status(code)?.map(|()| out))
    }

    /// `harness_batch_next`.
    pub fn batch_next(&mut self, t: &abi::StepTelemetry) -> Result<Result<abi::Batch, String>> {
        let f = Self::need(self.fns.batch_next, symbols::BATCH_NEXT)?;
        let mut out = abi::Batch::default();
        // SAFETY: valid in and out pointers.
        let code = unsafe { f(self.this, t, &mut out) };
        Ok(self.status(code)?.map(|()| out))
    }

    /// `harness_batch_wants_gradient_stats`. Optional: a library without it
    /// (built before the symbol existed) wants no statistics.
    pub fn batch_wants_gradient_stats(&mut self) -> Result<Result<bool, String>> {
        let Some(f) = self.fns.batch_wants_gradient_stats else { return Ok(Ok(false)) };
        let mut out = 0u8;
        // SAFETY: valid out pointer.
        let code = unsafe { f(self.this, &mut out) };
        Ok(self.status(code)?.map(|()| out != 0))
    }

    /// `harness_checkpoint_decide_tiered` when the library has it (contract
    /// 0.1.1), else `harness_checkpoint_decide` (which persists every
    /// snapshot); returns (save, persist, steps to delete).
    pub fn checkpoint_decide(&mut self, t: &abi::StepTelemetry, h: &CheckpointHistory) -> Result<Result<super::CheckpointAnswer, String>> {
        let opt = |v: Option<f64>| (v.is_some() as u8, v.unwrap_or(0.0));
        let (has_last_cost_s, last_cost_s) = opt(h.last_cost_s);
        let base = abi::CheckpointHistory {
            has_last_cost_s,
            last_cost_s,
            saved: h.saved.as_ptr(),
            n_saved: h.saved.len(),
            failures: h.failures.as_ptr(),
            n_failures: h.failures.len(),
            since_last_s: h.since_last_s,
        };
        let mut room = vec![0u64; h.saved.len()];
        let mut d = abi::Decision { save: 0, delete_steps: room.as_mut_ptr(), n_delete: 0 };
        let (code, persist) = match self.fns.checkpoint_decide_tiered {
            Some(f) => {
                let (has_last_stall_s, last_stall_s) = opt(h.last_stall_s);
                let (has_last_persist_s, last_persist_s) = opt(h.last_persist_s);
                let (has_last_slowdown_s, last_slowdown_s) = opt(h.last_slowdown_s);
                let th = abi::TieredHistory {
                    base,
                    in_memory: h.in_memory.as_ptr(),
                    n_in_memory: h.in_memory.len(),
                    has_persisting: h.persisting.is_some() as u8,
                    persisting: h.persisting.unwrap_or(0),
                    has_last_stall_s,
                    last_stall_s,
                    has_last_persist_s,
                    last_persist_s,
                    has_last_slowdown_s,
                    last_slowdown_s,
                };
                let mut td = abi::TieredDecision { base: d, persist: 0 };
                // SAFETY: valid pointers; room has n_saved slots.
                let code = unsafe { f(self.this, t, &th, &mut td) };
                d = td.base;
                (code, td.persist != 0)
            }
            None => {
                let f = Self::need(self.fns.checkpoint_decide, symbols::CHECKPOINT_DECIDE)?;
                // SAFETY: valid pointers; room has n_saved slots.
                (unsafe { f(self.this, t, &base, &mut d) }, true)
            }
        };
        Ok(self.status(code)?.and_then(|()| {
            if d.n_delete > room.len() {
                return Err(format!("it listed {} checkpoints to delete, more than the {} saved", d.n_delete, room.len()));
            }
            room.truncate(d.n_delete);
            Ok((d.save != 0, d.save != 0 && persist, room))
        }))
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        if let Ok(f) = self.sym::<x::Destroy>(symbols::DESTROY) {
            // SAFETY: the instance is destroyed once, before its context.
            let _ = catch_unwind(AssertUnwindSafe(|| unsafe { f(self.this) }));
        }
        // SAFETY: ctx came from Box::into_raw in `new`; the plugin is gone.
        drop(unsafe { Box::from_raw(self.ctx) });
    }
}
