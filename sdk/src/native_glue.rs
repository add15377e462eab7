//! What `export!` expands to on native targets: the `harness_*` symbols of
//! [`crate::abi`] call these generic functions.
//!
//! Every function catches panics: a panic becomes [`STATUS_PANIC`] with its
//! message available from `harness_plugin_last_error`. A plugin error
//! becomes [`STATUS_ERROR`] with its message.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::abi::{Host, ABI_VERSION, STATUS_ERROR, STATUS_OK, STATUS_PANIC};
use crate::native_backend::{EnterHost, Raw, RawComm};
use crate::{BatchPolicy, CheckpointHistory, CheckpointPolicy, Collective, Compressor, Config, Error, Plugin, Telemetry, Tensor};

pub use crate::abi::{Batch, BucketInfo, CheckpointHistory as RawHistory, Decision as RawDecision, Info, Sink, StepTelemetry};
pub use crate::abi::{KIND_BATCH_POLICY, KIND_CHECKPOINT_POLICY, KIND_COMPRESSOR};

/// One plugin instance: the host's table, the plugin once configured, and
/// the message of the last failed call.
struct Instance<T> {
    host: Host,
    plugin: Option<T>,
    last_error: String,
}

thread_local! {
    /// Why the last `harness_plugin_create` on this thread returned null
    /// (`harness_plugin_last_error(NULL, ..)` returns it).
    static CREATE_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn panic_message(payload: Box<dyn Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => match payload.downcast::<&'static str>() {
            Ok(s) => (*s).to_owned(),
            Err(_) => "the plugin panicked (no message)".to_owned(),
        },
    }
}

/// `harness_plugin_create`.
///
/// # Safety
/// `host` is null or points at a valid host table.
pub unsafe fn create<T: Plugin>(host: *const Host) -> *mut c_void {
    let made = catch_unwind(|| {
        if host.is_null() {
            return Err("harness_plugin_create: the host table is null".to_owned());
        }
        // SAFETY: the caller passes a valid table; we keep a copy.
        let host = unsafe { *host };
        if host.abi_version != ABI_VERSION {
            return Err(format!(
                "harness_plugin_create: the host speaks ABI version {}, this plugin (harness-sdk {}) speaks {ABI_VERSION}",
                host.abi_version,
                crate::CONTRACT_VERSION
            ));
        }
        Ok(Box::into_raw(Box::new(Instance::<T> { host, plugin: None, last_error: String::new() })) as *mut c_void)
    });
    match made {
        Ok(Ok(this)) => this,
        Ok(Err(message)) => {
            CREATE_ERROR.with(|e| *e.borrow_mut() = message);
            std::ptr::null_mut()
        }
        Err(payload) => {
            let message = panic_message(payload);
            CREATE_ERROR.with(|e| *e.borrow_mut() = message);
            std::ptr::null_mut()
        }
    }
}

/// `harness_plugin_destroy`: drops the plugin (releasing the tensors it
/// owns) and the instance.
///
/// # Safety
/// `this` is null or came from [`create`] with the same `T`, and is not used
/// afterwards.
pub unsafe fn destroy<T: Plugin>(this: *mut c_void) {
    if this.is_null() {
        return;
    }
    // SAFETY: per the contract above.
    let mut instance = unsafe { Box::from_raw(this as *mut Instance<T>) };
    let _enter = EnterHost::new(&instance.host);
    // A panicking Drop must not unwind into the host; the instance's memory
    // is then leaked rather than freed half-dropped.
    if catch_unwind(AssertUnwindSafe(|| drop(instance.plugin.take()))).is_err() {
        std::mem::forget(instance);
    }
}

/// Runs `f` on the instance, turning errors and panics into status codes.
///
/// # Safety
/// `this` is null or a live instance from [`create`] with the same `T`.
unsafe fn call<T: Plugin>(this: *mut c_void, f: impl FnOnce(&mut Option<T>, *const Host) -> Result<(), Error>) -> i32 {
    if this.is_null() {
        CREATE_ERROR.with(|e| *e.borrow_mut() = "called with a null plugin instance".to_owned());
        return STATUS_ERROR;
    }
    let this = this as *mut Instance<T>;
    // SAFETY: live instance; the host table stays where it is while the
    // instance lives, so tensors may keep pointers to it.
    let (host, plugin) = unsafe { (&raw const (*this).host, &mut (*this).plugin) };
    let _enter = EnterHost::new(host);
    let (status, message) = match catch_unwind(AssertUnwindSafe(|| f(plugin, host))) {
        Ok(Ok(())) => (STATUS_OK, String::new()),
        Ok(Err(e)) => (STATUS_ERROR, e.to_string()),
        Err(payload) => (STATUS_PANIC, panic_message(payload)),
    };
    // SAFETY: live instance; `plugin`'s borrow ended with the call.
    unsafe { (*this).last_error = message };
    status
}

fn configured<T>(plugin: &mut Option<T>) -> Result<&mut T, Error> {
    plugin.as_mut().ok_or_else(|| Error::new("called before a successful configure"))
}

fn out_ptr<'a, U>(p: *mut U, what: &str) -> Result<&'a mut U, Error> {
    // SAFETY: the host passes null or a valid, writable pointer.
    unsafe { p.as_mut() }.ok_or_else(|| Error::new(format!("{what} is null")))
}

fn in_ptr<'a, U>(p: *const U, what: &str) -> Result<&'a U, Error> {
    // SAFETY: the host passes null or a valid pointer.
    unsafe { p.as_ref() }.ok_or_else(|| Error::new(format!("{what} is null")))
}

/// A slice from the host (null with length 0 is empty).
unsafe fn slice<'a, U>(p: *const U, len: usize, what: &str) -> Result<&'a [U], Error> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::new(format!("{what} is null")));
    }
    // SAFETY: the host passes `len` valid elements.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// `harness_plugin_info`.
///
/// # Safety
/// `out` is null or writable.
pub unsafe fn info<T: Plugin>(_this: *mut c_void, out: *mut Info) {
    // SAFETY: per the contract above.
    if let Some(out) = unsafe { out.as_mut() } {
        *out = Info { name: T::NAME.as_ptr(), name_len: T::NAME.len(), version: T::VERSION.as_ptr(), version_len: T::VERSION.len() };
    }
}

/// `harness_plugin_configure`: parses nothing yet, hands [`Config`] to
/// [`Plugin::configure`]. A second call replaces the plugin.
///
/// # Safety
/// `this` is a live instance; `toml` points at `len` bytes.
pub unsafe fn configure<T: Plugin>(this: *mut c_void, toml: *const u8, len: usize) -> i32 {
    // SAFETY: per the contract above.
    unsafe {
        call::<T>(this, |plugin, _| {
            let bytes = slice(toml, len, "the config")?;
            let text = std::str::from_utf8(bytes).map_err(|e| Error::new(format!("the config is not UTF-8: {e}")))?;
            *plugin = None;
            *plugin = Some(T::configure(&Config::new(text))?);
            Ok(())
        })
    }
}

/// `harness_plugin_last_error`: the message of the last failed call on this
/// instance (on a null instance: why `create` failed on this thread).
///
/// # Safety
/// `this` is null or a live instance; `len` is null or writable.
pub unsafe fn last_error<T: Plugin>(this: *mut c_void, len: *mut usize) -> *const u8 {
    let (ptr, n) = if this.is_null() {
        CREATE_ERROR.with(|e| {
            let e = e.borrow();
            (e.as_ptr(), e.len())
        })
    } else {
        // SAFETY: live instance.
        let e = unsafe { &(*(this as *mut Instance<T>)).last_error };
        (e.as_ptr(), e.len())
    };
    // SAFETY: per the contract above.
    if let Some(len) = unsafe { len.as_mut() } {
        *len = n;
    }
    ptr
}

/// `harness_plugin_state_save`.
///
/// # Safety
/// `this` is a live instance; `sink` is callable with `sink_ctx`.
pub unsafe fn state_save<T: Plugin>(this: *mut c_void, sink: Sink, sink_ctx: *mut c_void) -> i32 {
    // SAFETY: per the contract above.
    unsafe {
        call::<T>(this, |plugin, _| {
            let state = configured(plugin)?.state_save();
            sink(sink_ctx, state.as_ptr(), state.len());
            Ok(())
        })
    }
}

/// `harness_plugin_state_load`.
///
/// # Safety
/// `this` is a live instance; `data` points at `len` bytes.
pub unsafe fn state_load<T: Plugin>(this: *mut c_void, data: *const u8, len: usize) -> i32 {
    // SAFETY: per the contract above.
    unsafe { call::<T>(this, |plugin, _| configured(plugin)?.state_load(slice(data, len, "the state")?)) }
}

/// `harness_compress`.
///
/// # Safety
/// `this` is a live instance; `bucket` a tensor the host lends for the call.
pub unsafe fn compress<T: Compressor>(this: *mut c_void, bucket: u64, info: *const BucketInfo) -> i32 {
    // SAFETY: per the contract above.
    unsafe {
        call::<T>(this, |plugin, host| {
            let info = in_ptr(info, "the bucket info")?;
            let info = crate::BucketInfo { step: info.step, index: info.index, count: info.count };
            let bucket = Tensor::borrowed(Raw { handle: bucket, host });
            configured(plugin)?.compress(&bucket, &Collective::new(RawComm { host }), info)
        })
    }
}

/// `harness_compress_setup`.
///
/// # Safety
/// `this` is a live instance; `buckets` points to `n` layouts whose
/// pointers are valid for the call.
pub unsafe fn compress_setup<T: Compressor>(this: *mut c_void, buckets: *const crate::abi::BucketLayout, n: usize) -> i32 {
    // SAFETY: per the contract above.
    unsafe {
        call::<T>(this, |plugin, _host| {
            let layouts = slice(buckets, n, "the bucket layouts")?;
            let mut out = Vec::with_capacity(n);
            for b in layouts {
                let mut params = Vec::with_capacity(b.n_params);
                for p in slice(b.params, b.n_params, "a bucket's parameters")? {
                    let name = slice(p.name, p.name_len, "a parameter's name")?;
                    params.push(crate::ParamSlot {
                        name: String::from_utf8_lossy(name).into_owned(),
                        shape: slice(p.shape, p.ndim, "a parameter's shape")?.to_vec(),
                        offset: p.offset,
                        numel: p.numel,
                        dtype: crate::Dtype::from_index(p.dtype)
                            .ok_or_else(|| Error::new(format!("dtype index {} is not in 0..8", p.dtype)))?,
                        weight: p.weight != 0,
                    });
                }
                out.push(crate::BucketLayout { numel: b.numel, params });
            }
            configured(plugin)?.setup(&out)
        })
    }
}

fn batch_from(b: &Batch) -> crate::Batch {
    crate::Batch { micro_batch: b.micro_batch, accum_steps: b.accum_steps, lr_scale: b.lr_scale }
}

fn batch_to(b: crate::Batch) -> Batch {
    Batch { micro_batch: b.micro_batch, accum_steps: b.accum_steps, lr_scale: b.lr_scale }
}

fn telemetry_from(t: &StepTelemetry) -> Telemetry {
    Telemetry {
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
        grad_sq_norm: (t.has_grad_sq_norm != 0).then_some(t.grad_sq_norm),
        local_grad_sq_norm: (t.has_local_grad_sq_norm != 0).then_some(t.local_grad_sq_norm),
        out_of_memory: t.out_of_memory != 0,
    }
}

/// `harness_batch_initial`.
///
/// # Safety
/// `this` is a live instance; `configured` readable; `out` writable.
pub unsafe fn batch_initial<T: BatchPolicy>(this: *mut c_void, configured_batch: *const Batch, out: *mut Batch) -> i32 {
    // SAFETY: per the contract above.
    unsafe {
        call::<T>(this, |plugin, _| {
            let given = batch_from(in_ptr(configured_batch, "the configured batch")?);
            let out = out_ptr(out, "the output batch")?;
            *out = batch_to(configured(plugin)?.initial(given)?);
            Ok(())
        })
    }
}

/// `harness_batch_next`.
///
/// # Safety
/// `this` is a live instance; `t` readable; `out` writable.
pub unsafe fn batch_next<T: BatchPolicy>(this: *mut c_void, t: *const StepTelemetry, out: *mut Batch) -> i32 {
    // SAFETY: per the contract above.
    unsafe {
        call::<T>(this, |plugin, _| {
            let t = telemetry_from(in_ptr(t, "the telemetry")?);
            let out = out_ptr(out, "the output batch")?;
            *out = batch_to(configured(plugin)?.next(&t)?);
            Ok(())
        })
    }
}

/// `harness_batch_wants_gradient_stats`: 1 in `*out` when the policy wants
/// gradient statistics, else 0.
///
/// # Safety
/// `this` is a live instance; `out` writable.
pub unsafe fn batch_wants_gradient_stats<T: BatchPolicy>(this: *mut c_void, out: *mut u8) -> i32 {
    // SAFETY: per the contract above.
    unsafe {
        call::<T>(this, |plugin, _| {
            let out = out_ptr(out, "the output flag")?;
            *out = configured(plugin)?.wants_gradient_stats() as u8;
            Ok(())
        })
    }
}

/// `harness_checkpoint_decide` (contract 0.1.0: every snapshot is
/// persisted). The decision's deletions go to `out.delete_steps`, which has
/// room for `h.n_saved` steps.
///
/// # Safety
/// `this` is a live instance; `t` and `h` readable (with their arrays);
/// `out` writable with room for `h.n_saved` steps.
pub unsafe fn checkpoint_decide<T: CheckpointPolicy>(
    this: *mut c_void,
    t: *const StepTelemetry,
    h: *const RawHistory,
    out: *mut RawDecision,
) -> i32 {
    // SAFETY: per the contract above.
    unsafe {
        call::<T>(this, |plugin, _| {
            let t = telemetry_from(in_ptr(t, "the telemetry")?);
            let h = in_ptr(h, "the checkpoint history")?;
            let history = history_from(h)?;
            let decision = configured(plugin)?.decide(&t, &history)?;
            decision_to(&decision, h.n_saved, out_ptr(out, "the output decision")?)
        })
    }
}

/// `harness_checkpoint_decide_tiered` (since contract 0.1.1).
///
/// # Safety
/// As [`checkpoint_decide`], with `h.in_memory` readable too.
pub unsafe fn checkpoint_decide_tiered<T: CheckpointPolicy>(
    this: *mut c_void,
    t: *const StepTelemetry,
    h: *const crate::abi::TieredHistory,
    out: *mut crate::abi::TieredDecision,
) -> i32 {
    // SAFETY: per the contract above.
    unsafe {
        call::<T>(this, |plugin, _| {
            let t = telemetry_from(in_ptr(t, "the telemetry")?);
            let h = in_ptr(h, "the checkpoint state")?;
            let opt = |has: u8, v: f64| (has != 0).then_some(v);
            let history = CheckpointHistory {
                in_memory: slice(h.in_memory, h.n_in_memory, "state.in_memory")?.to_vec(),
                persisting: (h.has_persisting != 0).then_some(h.persisting),
                last_stall_s: opt(h.has_last_stall_s, h.last_stall_s),
                last_persist_s: opt(h.has_last_persist_s, h.last_persist_s),
                last_slowdown_s: opt(h.has_last_slowdown_s, h.last_slowdown_s),
                ..history_from(&h.base)?
            };
            let decision = configured(plugin)?.decide(&t, &history)?;
            let out = out_ptr(out, "the output decision")?;
            decision_to(&decision, h.base.n_saved, &mut out.base)?;
            out.persist = (decision.save && decision.persist) as u8;
            Ok(())
        })
    }
}

/// The history of contract 0.1.0's fields.
///
/// # Safety
/// `h`'s arrays are readable.
unsafe fn history_from(h: &RawHistory) -> Result<CheckpointHistory, Error> {
    // SAFETY: per the contract above.
    unsafe {
        Ok(CheckpointHistory {
            last_cost_s: (h.has_last_cost_s != 0).then_some(h.last_cost_s),
            saved: slice(h.saved, h.n_saved, "history.saved")?.to_vec(),
            failures: slice(h.failures, h.n_failures, "history.failures")?.to_vec(),
            since_last_s: h.since_last_s,
            ..CheckpointHistory::default()
        })
    }
}

/// Writes `decision` into `out`, whose `delete_steps` has room for `room`.
///
/// # Safety
/// `out.delete_steps` has room for `room` steps.
unsafe fn decision_to(decision: &crate::Decision, room: usize, out: &mut RawDecision) -> Result<(), Error> {
    if decision.delete.len() > room {
        return Err(Error::new(format!("the decision deletes {} checkpoints but only {room} are saved", decision.delete.len())));
    }
    if !decision.delete.is_empty() && out.delete_steps.is_null() {
        return Err(Error::new("the output decision's delete_steps is null"));
    }
    for (i, step) in decision.delete.iter().enumerate() {
        // SAFETY: the host gave room for `room` >= len steps.
        unsafe { *out.delete_steps.add(i) = *step };
    }
    out.n_delete = decision.delete.len();
    out.save = decision.save as u8;
    Ok(())
}
