//! Safe wrappers over `csrc/shim.cpp`: the libtorch calls `tch` 0.24 lacks
//! (bf16/fp16 autocast, fused AdamW, multi-tensor gradient norm, loss-scale
//! unscaling, the CUDA caching allocator's statistics).

//!
//! The wrappers by concern: the shim's CUDA side (graphs, streams, events,
//! the caching allocator) in [`cuda`], the autograd nodes of harness's own
//! (recomputed blocks, fused operations) in [`autograd`], tensors read
//! straight from memory in [`memory`], libtorch's profiler in [`profiler`];
//! the rest (autocast, gradients, the fused optimizer, random state, hooks)
//! here. Each is re-exported here, so that `torch_ext::X` names every one.

mod autograd;
mod cuda;
mod memory;
mod profiler;

pub use autograd::{custom_op, recompute, CustomOp, CUSTOM_OP_MAX};
#[cfg(any(test, feature = "testing"))]
pub use autograd::{BLOCK_RUNS, GLOBAL_RNG};
pub use cuda::{
    copy_nonblocking, cublaslt, cuda_available, cuda_empty_cache, cuda_memory, cuda_reset_peak, current_cuda_stream, has_cuda_graphs,
    pin_memory, CudaGraph, CudaMemory, Event,
};
pub use memory::{cpu_all_finite, is_dense, is_dense_layout, nbytes};
pub use profiler::{profiler_start, profiler_stop, Range};

use std::ffi::{c_char, c_int, c_void, CStr};

use tch::{Device, Kind, Tensor};

mod ffi {
    use super::*;
    pub type BlockFn = unsafe extern "C" fn(ctx: *mut c_void, input: *mut c_void, out: *mut *mut c_void, err: *mut c_char, err_len: usize);
    pub type BlockDrop = unsafe extern "C" fn(ctx: *mut c_void);
    pub type OpFwd = unsafe extern "C" fn(
        ctx: *mut c_void,
        input: *mut *mut c_void,
        n_in: c_int,
        out: *mut *mut c_void,
        n_out: *mut c_int,
        saved: *mut *mut c_void,
        n_saved: *mut c_int,
        err: *mut c_char,
        err_len: usize,
    );
    pub type OpBwd = unsafe extern "C" fn(
        ctx: *mut c_void,
        saved: *mut *mut c_void,
        n_saved: c_int,
        grads: *mut *mut c_void,
        n_grads: c_int,
        in_grads: *mut *mut c_void,
        n_in: c_int,
        err: *mut c_char,
        err_len: usize,
    );
    extern "C" {
        pub fn hx_free_error(err: *mut c_char);
        pub fn hx_autocast_set(device_type: c_int, enabled: c_int, dtype: c_int) -> *mut c_char;
        pub fn hx_autocast_clear_cache() -> *mut c_char;
        pub fn hx_autocast_enable(device_type: c_int, enabled: c_int) -> *mut c_char;
        pub fn hx_backward(out: *mut c_void, grad: *mut c_void) -> *mut c_char;
        pub fn hx_grads_to_none(params: *const *mut c_void, n: c_int) -> *mut c_char;
        pub fn hx_set_grad(param: *mut c_void, grad: *mut c_void) -> *mut c_char;
        pub fn hx_grads(params: *const *mut c_void, n: c_int, out: *mut *mut c_void) -> *mut c_char;
        pub fn hx_clip_grad_norm(grads: *const *mut c_void, n: c_int, max_norm: f64, norm_out: *mut *mut c_void) -> *mut c_char;
        pub fn hx_unscale_check(grads: *const *mut c_void, n: c_int, found_inf: *mut c_void, inv_scale: *mut c_void) -> *mut c_char;
        #[allow(clippy::too_many_arguments)]
        pub fn hx_fused_adamw(
            params: *const *mut c_void,
            grads: *const *mut c_void,
            exp_avg: *const *mut c_void,
            exp_avg_sq: *const *mut c_void,
            steps: *const *mut c_void,
            n: c_int,
            lr: f64,
            lr_t: *mut c_void,
            beta1: f64,
            beta2: f64,
            weight_decay: f64,
            eps: f64,
            found_inf: *mut c_void,
            grad_scale: *mut c_void,
        ) -> *mut c_char;
        pub fn hx_pin_memory(t: *mut c_void, out: *mut *mut c_void) -> *mut c_char;
        pub fn hx_has_cuda_graphs() -> c_int;
        pub fn hx_cuda_empty_cache() -> *mut c_char;
        pub fn hx_cuda_current_stream(out: *mut *mut c_void) -> *mut c_char;
        pub fn hx_cublaslt(handle: *mut *mut c_void, workspace: *mut *mut c_void, bytes: *mut usize) -> *mut c_char;
        pub fn hx_graph_new(out: *mut *mut c_void) -> *mut c_char;
        pub fn hx_graph_enter(g: *mut c_void) -> *mut c_char;
        pub fn hx_graph_leave(g: *mut c_void) -> *mut c_char;
        pub fn hx_graph_capture_begin(g: *mut c_void) -> *mut c_char;
        pub fn hx_graph_capture_end(g: *mut c_void) -> *mut c_char;
        pub fn hx_graph_abort(g: *mut c_void);
        pub fn hx_graph_replay(g: *mut c_void) -> *mut c_char;
        pub fn hx_graph_free(g: *mut c_void);
        pub fn hx_copy_nonblocking(dst: *const *mut c_void, src: *const *mut c_void, n: c_int) -> *mut c_char;
        pub fn hx_event_record(device: c_int, out: *mut *mut c_void) -> *mut c_char;
        pub fn hx_event_synchronize(ev: *mut c_void) -> *mut c_char;
        pub fn hx_event_free(ev: *mut c_void);
        pub fn hx_param_hashes(params: *const *mut c_void, n: c_int, out: *mut *mut c_void) -> *mut c_char;
        pub fn hx_storage_info(t: *mut c_void, nbytes: *mut u64, key: *mut u64) -> *mut c_char;
        pub fn hx_cuda_memory(device: c_int, out: *mut i64) -> *mut c_char;
        pub fn hx_cuda_reset_peak(device: c_int) -> *mut c_char;
        pub fn hx_rng_get_state(device: c_int, out: *mut *mut c_void) -> *mut c_char;
        pub fn hx_rng_set_state(device: c_int, state: *mut c_void) -> *mut c_char;
        pub fn hx_recompute(
            x: *mut c_void,
            run: BlockFn,
            drop: BlockDrop,
            ctx: *mut c_void,
            rng: c_int,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        #[allow(clippy::too_many_arguments)]
        pub fn hx_custom_op(
            input: *const *mut c_void,
            n_in: c_int,
            fwd: OpFwd,
            bwd: OpBwd,
            drop: BlockDrop,
            ctx: *mut c_void,
            out: *mut *mut c_void,
            n_out: *mut c_int,
        ) -> *mut c_char;
        pub fn hx_set_grad_ready_hook(param: *mut c_void, cb: Option<GradReady>, ctx: *mut c_void, idx: i64) -> *mut c_char;
        pub fn hx_set_grad_arrival_hook(param: *mut c_void, cb: GradReady, ctx: *mut c_void, idx: i64, handle: *mut i64) -> *mut c_char;
        pub fn hx_remove_hook(param: *mut c_void, handle: i64) -> *mut c_char;
        pub fn hx_rand_seeded(
            kind: c_int,
            sizes: *const i64,
            ndim: c_int,
            seed: u64,
            device_type: c_int,
            device_index: c_int,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        pub fn hx_profiler_start(cuda: c_int) -> *mut c_char;
        pub fn hx_profiler_stop(path: *const c_char) -> *mut c_char;
        pub fn hx_range_push(name: *const c_char) -> *mut c_void;
        pub fn hx_range_pop(range: *mut c_void);
    }
}

/// An exception thrown by libtorch inside the shim.
#[derive(Debug, thiserror::Error)]
#[error("libtorch: {0}")]
pub struct TorchError(pub String);

fn check(err: *mut c_char) -> Result<(), TorchError> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string from strdup in the
    // shim, owned by us until hx_free_error releases it.
    let msg = unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned();
    // SAFETY: err came from strdup and is freed exactly once.
    unsafe { ffi::hx_free_error(err) };
    Err(TorchError(msg.lines().next().unwrap_or("").to_owned()))
}

fn ptrs(ts: &[Tensor]) -> Vec<*mut c_void> {
    ts.iter().map(|t| t.as_ptr() as *mut c_void).collect()
}

fn len(ts: &[Tensor]) -> c_int {
    c_int::try_from(ts.len()).expect("fewer than 2^31 tensors")
}

/// Which device type autocast applies to.
#[derive(Debug, Clone, Copy)]
pub enum AutocastDevice {
    Cpu = 0,
    Cuda = 1,
}

/// Enables autocast for one device type with a compute dtype (BFloat16 or
/// Half), or disables it. Global to the thread, as `torch.autocast`.
pub fn set_autocast(device: AutocastDevice, kind: Option<Kind>) -> Result<(), TorchError> {
    let (enabled, dtype) = match kind {
        Some(k) => (1, scalar_type(k)),
        None => (0, scalar_type(Kind::BFloat16)),
    };
    // SAFETY: plain values; the shim catches every exception.
    check(unsafe { ffi::hx_autocast_set(device as c_int, enabled, dtype) })
}

/// Turns autocast on `device` on or off, keeping its dtype (and its cache:
/// [`autocast_clear_cache`] after each forward pass empties it).
pub fn set_autocast_enabled(device: AutocastDevice, enabled: bool) -> Result<(), TorchError> {
    // SAFETY: plain values; the shim catches every exception.
    check(unsafe { ffi::hx_autocast_enable(device as c_int, enabled as c_int) })
}

/// Drops autocast's cached low-precision copies of the weights; call after
/// every forward pass while autocast is on (see csrc/shim.cpp).
pub fn autocast_clear_cache() -> Result<(), TorchError> {
    // SAFETY: no arguments; exceptions are caught in the shim.
    check(unsafe { ffi::hx_autocast_clear_cache() })
}

/// c10::ScalarType codes of the autocast dtypes.
fn scalar_type(k: Kind) -> c_int {
    match k {
        Kind::Half => 5,
        Kind::BFloat16 => 15,
        other => panic!("autocast dtype must be Half or BFloat16, not {other:?}"),
    }
}

/// Runs the backward pass from `out` seeded with `grad` (same shape).
pub fn backward_with_grad(out: &Tensor, grad: &Tensor) -> Result<(), TorchError> {
    // SAFETY: both pointers are live tensors for the duration of the call.
    check(unsafe { ffi::hx_backward(out.as_ptr() as *mut c_void, grad.as_ptr() as *mut c_void) })
}

/// Sets every parameter's `.grad` to None.
pub fn grads_to_none(params: &[Tensor]) -> Result<(), TorchError> {
    let p = ptrs(params);
    // SAFETY: p holds live at::Tensor pointers owned by `params`, which
    // outlives the call; the shim only resets their grad fields.
    check(unsafe { ffi::hx_grads_to_none(p.as_ptr(), len(params)) })
}

/// Makes `grad` the `.grad` of `param` (the same tensor, not a copy; `None`
/// resets it). Shape, dtype and device must match the parameter's. Backward
/// passes then accumulate into `grad` in place, so a view into a flat buffer
/// collects the parameter's gradient there (DDP's `gradient_as_bucket_view`).
pub fn set_grad(param: &Tensor, grad: Option<&Tensor>) -> Result<(), TorchError> {
    let g = grad.map_or(std::ptr::null_mut(), |g| g.as_ptr() as *mut c_void);
    // SAFETY: param is live and g null or live for the call; the shim stores
    // a new reference to g's tensor in param's grad field.
    check(unsafe { ffi::hx_set_grad(param.as_ptr() as *mut c_void, g) })
}

/// The parameters' gradients (undefined tensors where none was computed).
pub fn grads(params: &[Tensor]) -> Result<Vec<Tensor>, TorchError> {
    let p = ptrs(params);
    let mut out: Vec<*mut c_void> = vec![std::ptr::null_mut(); params.len()];
    // SAFETY: p is valid as above; out has room for n pointers, which the shim
    // fills with new at::Tensor objects that we take ownership of below.
    check(unsafe { ffi::hx_grads(p.as_ptr(), len(params), out.as_mut_ptr()) })?;
    // SAFETY: each pointer is a heap at::Tensor from the shim; tch frees it.
    Ok(out.into_iter().map(|t| unsafe { Tensor::from_ptr(t as *mut _) }).collect())
}

/// Global gradient 2-norm (a device scalar, no sync); clips when `max_norm`.
pub fn clip_grad_norm(grads: &[Tensor], max_norm: Option<f64>) -> Result<Tensor, TorchError> {
    let g = ptrs(grads);
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: g points at live tensors; out receives a new at::Tensor.
    check(unsafe { ffi::hx_clip_grad_norm(g.as_ptr(), len(grads), max_norm.unwrap_or(0.0), &mut out) })?;
    // SAFETY: out is a heap at::Tensor from the shim.
    Ok(unsafe { Tensor::from_ptr(out as *mut _) })
}

/// Divides gradients by the loss scale in place; `found_inf` becomes 1 if any
/// gradient is not finite.
pub fn unscale_check(grads: &[Tensor], found_inf: &Tensor, inv_scale: &Tensor) -> Result<(), TorchError> {
    let g = ptrs(grads);
    // SAFETY: all pointers are live tensors for the duration of the call.
    check(unsafe { ffi::hx_unscale_check(g.as_ptr(), len(grads), found_inf.as_ptr() as *mut c_void, inv_scale.as_ptr() as *mut c_void) })
}

/// A learning rate: a number fixed when the update is queued, or a float
/// scalar on the device read when it runs (what a captured CUDA graph of
/// the step replays with a new value each step).
#[derive(Debug, Clone, Copy)]
pub enum Lr<'a> {
    Host(f64),
    Device(&'a Tensor),
}

/// Hyper-parameters of one AdamW step.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep<'a> {
    pub lr: Lr<'a>,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// One fused AdamW step (`torch.optim.AdamW(fused=True)`'s kernel). With
/// `found_inf` (a device scalar), the step is skipped where it is nonzero;
/// with `grad_scale` (a float device scalar), every gradient is divided by
/// it as the kernel reads it, and the quotient written back.
#[allow(clippy::too_many_arguments)]
pub fn fused_adamw(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avg: &[Tensor],
    exp_avg_sq: &[Tensor],
    steps: &[Tensor],
    h: AdamWStep,
    found_inf: Option<&Tensor>,
    grad_scale: Option<&Tensor>,
) -> Result<(), TorchError> {
    let n = params.len();
    assert!(grads.len() == n && exp_avg.len() == n && exp_avg_sq.len() == n && steps.len() == n);
    // The fused kernel trusts its inputs (the CPU one does not check shapes),
    // so mismatches are refused here rather than read out of bounds.
    for i in 0..n {
        let shape = params[i].size();
        if grads[i].size() != shape || exp_avg[i].size() != shape || exp_avg_sq[i].size() != shape {
            return Err(TorchError(format!("AdamW: parameter {i} has shape {shape:?} but its gradient or state differs")));
        }
    }
    let (p, g, m, v, s) = (ptrs(params), ptrs(grads), ptrs(exp_avg), ptrs(exp_avg_sq), ptrs(steps));
    if let Some(t) = grad_scale {
        if t.kind() != Kind::Float || t.numel() != 1 {
            return Err(TorchError(format!("AdamW: the gradient scale must be one float, not {:?} {:?}", t.kind(), t.size())));
        }
    }
    let (lr, lr_t) = match h.lr {
        Lr::Host(lr) => (lr, std::ptr::null_mut()),
        Lr::Device(t) => {
            if t.kind() != Kind::Float || t.numel() != 1 || t.device() != params.first().map_or(t.device(), |p| p.device()) {
                return Err(TorchError(format!(
                    "AdamW: a device learning rate must be one float on the parameters' device, not {:?} {:?}",
                    t.kind(),
                    t.size()
                )));
            }
            (f64::NAN, t.as_ptr() as *mut c_void)
        }
    };
    let fi = found_inf.map_or(std::ptr::null_mut(), |t| t.as_ptr() as *mut c_void);
    let gs = grad_scale.map_or(std::ptr::null_mut(), |t| t.as_ptr() as *mut c_void);
    // SAFETY: five arrays of n live tensor pointers (lengths asserted above),
    // fi and gs null or live; the kernel updates params and states in place.
    check(unsafe {
        ffi::hx_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            len(params),
            lr,
            lr_t,
            h.beta1,
            h.beta2,
            h.weight_decay,
            h.eps,
            fi,
            gs,
        )
    })
}

/// A hash of each tensor's bytes (position-weighted sums of its words,
/// wrapping; see `hx_param_hashes` in the shim), in i64, as one 1-D tensor
/// on their device: equal bytes give equal hashes, and a change of any
/// word (a sign flipped in a slice included) changes the hash but for a
/// chance of about 2^-32.
pub fn param_hashes(params: &[Tensor]) -> Result<Tensor, TorchError> {
    let p = ptrs(params);
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: p points at live tensors; out receives a new at::Tensor.
    check(unsafe { ffi::hx_param_hashes(p.as_ptr(), len(params), &mut out) })?;
    // SAFETY: out is a heap at::Tensor from the shim.
    Ok(unsafe { Tensor::from_ptr(out as *mut _) })
}

/// The storage `t` keeps alive: (bytes, an identity shared by every view of
/// that storage). A view of one element of a large tensor keeps all of it.
pub fn storage_info(t: &Tensor) -> Result<(u64, u64), TorchError> {
    let (mut nbytes, mut key) = (0u64, 0u64);
    // SAFETY: t is a live tensor; the shim writes two integers and catches
    // exceptions.
    check(unsafe { ffi::hx_storage_info(t.as_ptr() as *mut c_void, &mut nbytes, &mut key) })?;
    Ok((nbytes, key))
}

/// The state of libtorch's default random generator of `device` (dropout
/// draws from it), as a uint8 tensor on the CPU.
pub fn rng_state(device: Device) -> Result<Tensor, TorchError> {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: out receives a new at::Tensor; exceptions are caught in the shim.
    check(unsafe { ffi::hx_rng_get_state(rng_device(device), &mut out) })?;
    // SAFETY: out is a heap at::Tensor from the shim.
    Ok(unsafe { Tensor::from_ptr(out as *mut _) })
}

/// Restores a state from [`rng_state`].
pub fn set_rng_state(device: Device, state: &Tensor) -> Result<(), TorchError> {
    // SAFETY: state is a live tensor; exceptions are caught in the shim.
    check(unsafe { ffi::hx_rng_set_state(rng_device(device), state.as_ptr() as *mut c_void) })
}

fn rng_device(device: Device) -> c_int {
    match device {
        Device::Cuda(i) => i as c_int,
        _ => -1,
    }
}

/// Called by autograd after it accumulated a gradient into a parameter:
/// (context, the index given when the hook was set).
pub type GradReady = unsafe extern "C" fn(ctx: *mut c_void, idx: i64);

/// Sets (or with `None` removes) a post-accumulate-grad hook on a leaf
/// parameter: `cb(ctx, idx)` runs on the autograd engine's thread each time
/// a backward pass has accumulated the parameter's gradient.
///
/// # Safety
/// `ctx` must stay valid, and `cb` safe to call from another thread, for as
/// long as the hook is set.
pub unsafe fn set_grad_ready_hook(param: &Tensor, cb: Option<GradReady>, ctx: *mut c_void, idx: i64) -> Result<(), TorchError> {
    // SAFETY: param is a live tensor; the caller keeps ctx valid.
    check(unsafe { ffi::hx_set_grad_ready_hook(param.as_ptr() as *mut c_void, cb, ctx, idx) })
}

/// Sets a hook on a leaf parameter that runs `cb(ctx, idx)` on the autograd
/// engine's thread each time a backward pass hands autograd a gradient for
/// it, before autograd accumulates that gradient into `.grad`. A layer that
/// adds into the gradient buffer itself and hands autograd none leaves the
/// hook silent. Returns the hook's handle for [`remove_hook`].
///
/// # Safety
/// `ctx` must stay valid, and `cb` safe to call from another thread, until
/// the hook is removed.
pub unsafe fn set_grad_arrival_hook(param: &Tensor, cb: GradReady, ctx: *mut c_void, idx: i64) -> Result<i64, TorchError> {
    let mut handle = 0i64;
    // SAFETY: param is a live tensor and handle outlives the call; the caller keeps ctx valid.
    check(unsafe { ffi::hx_set_grad_arrival_hook(param.as_ptr() as *mut c_void, cb, ctx, idx, &mut handle) })?;
    Ok(handle)
}

/// Removes the hook [`set_grad_arrival_hook`] returned `handle` for.
pub fn remove_hook(param: &Tensor, handle: i64) -> Result<(), TorchError> {
    // SAFETY: param is a live tensor.
    check(unsafe { ffi::hx_remove_hook(param.as_ptr() as *mut c_void, handle) })
}

/// What [`rand_seeded`] draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RandKind {
    /// Uniform in [0, 1), f32.
    Uniform = 0,
    /// Standard normal, f32.
    Normal = 1,
    /// A random permutation of `0..sizes[0]`, i64.
    Permutation = 2,
}

/// Random numbers from a private generator seeded with `seed` on `device`:
/// the same seed gives the same numbers, and training's random stream is
/// not touched.
pub fn rand_seeded(kind: RandKind, sizes: &[i64], seed: u64, device: tch::Device) -> Result<Tensor, TorchError> {
    let (ty, index) = match device {
        tch::Device::Cuda(i) => (1, i as c_int),
        _ => (0, -1),
    };
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: sizes outlives the call; out receives a new at::Tensor.
    check(unsafe { ffi::hx_rand_seeded(kind as c_int, sizes.as_ptr(), sizes.len() as c_int, seed, ty, index, &mut out) })?;
    // SAFETY: out is a heap at::Tensor from the shim, owned from here on.
    Ok(unsafe { Tensor::from_ptr(out as *mut _) })
}

#[cfg(test)]
mod tests;
