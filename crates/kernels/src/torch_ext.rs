//! Safe wrappers over `csrc/shim.cpp`: the libtorch calls `tch` 0.24 lacks
//! (bf16/fp16 autocast, fused AdamW, multi-tensor gradient norm, loss-scale
//! unscaling, the CUDA caching allocator's statistics).

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

/// Loads libtorch's CUDA library once; returns whether CUDA is usable.
///
/// The linker drops `libtorch_cuda.so` from a binary that references no
/// symbol of it (`--as-needed`), so it is loaded here with
/// dlopen(RTLD_GLOBAL); without it libtorch sees no GPU.
pub fn cuda_available() -> bool {
    static CUDA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CUDA.get_or_init(|| {
        // SAFETY: loading libtorch_cuda runs its static initialisers, which
        // register the CUDA backend with the already-loaded libtorch_cpu of
        // the same installation (found through LD_LIBRARY_PATH / rpath). The
        // handle is leaked on purpose: the library must stay for the process.
        let lib = unsafe {
            libloading::os::unix::Library::open(
                Some("libtorch_cuda.so"),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        };
        match lib {
            Ok(l) => {
                std::mem::forget(l);
                tch::Cuda::is_available()
            }
            Err(_) => false,
        }
    })
}

/// libtorch's current CUDA stream on the current device, as a driver stream
/// handle (null: the legacy default stream, where harness runs; inside
/// [`CudaGraph::capture`], the capture's stream, on the capturing thread and
/// on the autograd thread running the captured backward pass).
pub fn current_cuda_stream() -> Result<*mut c_void, TorchError> {
    let mut out = std::ptr::null_mut();
    // SAFETY: out receives a stream handle (or null); nothing is allocated.
    check(unsafe { ffi::hx_cuda_current_stream(&mut out) })?;
    Ok(out)
}

/// libtorch's cuBLASLt handle for this thread and device, and its cuBLASLt
/// workspace for the current stream (pointer and bytes).
pub fn cublaslt() -> Result<(*mut c_void, *mut c_void, usize), TorchError> {
    let (mut handle, mut workspace, mut bytes) = (std::ptr::null_mut(), std::ptr::null_mut(), 0usize);
    // SAFETY: the three out-parameters receive libtorch's pointers and size.
    check(unsafe { ffi::hx_cublaslt(&mut handle, &mut workspace, &mut bytes) })?;
    Ok((handle, workspace, bytes))
}

/// Whether the shim was built with libtorch's CUDA library (graphs work).
pub fn has_cuda_graphs() -> bool {
    // SAFETY: a constant of the shim.
    unsafe { ffi::hx_has_cuda_graphs() != 0 }
}

/// A CUDA graph (`at::cuda::CUDAGraph`) with the side stream it is captured
/// on: libtorch routes the capture's allocations into the graph's private
/// memory pool, which lives as long as the graph, so the tensors the
/// captured work reads and writes keep their addresses for every replay.
pub struct CudaGraph {
    ptr: *mut c_void,
    captured: bool,
}

// SAFETY: the shim's graph object is used by one thread at a time (the
// entry's), and CUDA graphs and streams are not tied to a host thread.
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    pub fn new() -> Result<CudaGraph, TorchError> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: ptr receives a new graph object, freed in Drop.
        check(unsafe { ffi::hx_graph_new(&mut ptr) })?;
        Ok(CudaGraph { ptr, captured: false })
    }

    /// Runs `work` with the graph's side stream as the current stream (it
    /// first waits for the current stream's queued work, which then waits
    /// for it): a warm-up on the capture's stream, as CUDA graphs need
    /// (libraries set up per-stream state, such as cuBLAS's workspace, on
    /// first use, which must not happen inside a capture).
    pub fn on_side_stream<T>(&mut self, work: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
        // SAFETY: self.ptr is a live graph object.
        check(unsafe { ffi::hx_graph_enter(self.ptr) })?;
        let out = work();
        // SAFETY: as above; leaving is a no-op if entering failed.
        let left = check(unsafe { ffi::hx_graph_leave(self.ptr) });
        let out = out?;
        left?;
        Ok(out)
    }

    /// Captures the work `work` queues on the side stream (nothing runs:
    /// [`CudaGraph::replay`] runs it). On an error the partial capture is
    /// discarded and the graph stays empty.
    pub fn capture<T>(&mut self, work: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
        anyhow::ensure!(!self.captured, "the graph was captured already");
        let ptr = self.ptr;
        let out = self.on_side_stream(|| {
            // SAFETY: ptr is a live graph object; its side stream is current.
            check(unsafe { ffi::hx_graph_capture_begin(ptr) })?;
            let out = work();
            let ended = match &out {
                // SAFETY: as above: the capture ends, or is aborted on failure.
                Ok(_) => check(unsafe { ffi::hx_graph_capture_end(ptr) }),
                Err(_) => {
                    // SAFETY: as above.
                    unsafe { ffi::hx_graph_abort(ptr) };
                    Ok(())
                }
            };
            if ended.is_err() {
                // SAFETY: as above.
                unsafe { ffi::hx_graph_abort(ptr) };
            }
            let out = out?;
            ended?;
            Ok(out)
        })?;
        self.captured = true;
        Ok(out)
    }

    /// Launches the captured work on the current stream.
    pub fn replay(&self) -> Result<(), TorchError> {
        if !self.captured {
            return Err(TorchError("replay of a CUDA graph that was not captured".into()));
        }
        // SAFETY: self.ptr is a live, captured graph.
        check(unsafe { ffi::hx_graph_replay(self.ptr) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: self.ptr came from hx_graph_new and is freed once, here.
        unsafe { ffi::hx_graph_free(self.ptr) }
    }
}

/// A page-locked copy of a CPU tensor (for asynchronous uploads).
pub fn pin_memory(t: &Tensor) -> Result<Tensor, TorchError> {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: t is live; out receives a new at::Tensor.
    check(unsafe { ffi::hx_pin_memory(t.as_ptr() as *mut c_void, &mut out) })?;
    // SAFETY: out is a heap at::Tensor from the shim.
    Ok(unsafe { Tensor::from_ptr(out as *mut _) })
}

/// Copies `src[i]` into `dst[i]` without waiting for the device: into
/// pinned host memory the copies are queued on the current stream, and the
/// data is there once an [`Event`] recorded afterwards completed. Shapes
/// must match.
pub fn copy_nonblocking(dst: &[Tensor], src: &[Tensor]) -> Result<(), TorchError> {
    assert_eq!(dst.len(), src.len());
    let d: Vec<*mut c_void> = dst.iter().map(|t| t.as_ptr() as *mut c_void).collect();
    let s: Vec<*mut c_void> = src.iter().map(|t| t.as_ptr() as *mut c_void).collect();
    // SAFETY: every pointer is a live tensor for the call; exceptions are caught.
    check(unsafe { ffi::hx_copy_nonblocking(d.as_ptr(), s.as_ptr(), d.len() as c_int) })
}

/// A CUDA event recorded on a device's current stream: it completes once
/// the work queued there before it has run. It may be waited for from any
/// thread.
pub struct Event(*mut c_void);

// SAFETY: a CUDA event is not tied to the thread that recorded it; the
// handle is only synchronised and freed, each through the runtime.
unsafe impl Send for Event {}
// SAFETY: the one use through a shared reference is `synchronize`
// (c10::Event::synchronize, a const call into cudaEventSynchronize, which
// the CUDA runtime allows from several threads at once).
unsafe impl Sync for Event {}

impl Event {
    /// Records an event on the current stream of CUDA device `index`.
    pub fn record(index: usize) -> Result<Event, TorchError> {
        let mut out: *mut c_void = std::ptr::null_mut();
        // SAFETY: out receives a heap c10::Event; exceptions are caught.
        check(unsafe { ffi::hx_event_record(index as c_int, &mut out) })?;
        Ok(Event(out))
    }

    /// Blocks the calling thread until the event completed.
    pub fn synchronize(&self) -> Result<(), TorchError> {
        // SAFETY: self.0 is a live event until drop.
        check(unsafe { ffi::hx_event_synchronize(self.0) })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: self.0 came from hx_event_record and is freed once.
        unsafe { ffi::hx_event_free(self.0) }
    }
}

/// The CUDA caching allocator's figures for one device, in bytes.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct CudaMemory {
    pub allocated: i64,
    pub peak_allocated: i64,
    pub reserved: i64,
    pub peak_reserved: i64,
}

/// Reads the allocator statistics (CUDA must be initialised).
pub fn cuda_memory(device: usize) -> Result<CudaMemory, TorchError> {
    let mut out = [0i64; 4];
    // SAFETY: out has the four slots the shim writes.
    check(unsafe { ffi::hx_cuda_memory(device as c_int, out.as_mut_ptr()) })?;
    Ok(CudaMemory { allocated: out[0], peak_allocated: out[1], reserved: out[2], peak_reserved: out[3] })
}

/// Gives the CUDA caching allocator's unused cached blocks back to the
/// driver (`torch.cuda.empty_cache()`); captured graphs keep their pools.
/// Waits for the device.
pub fn cuda_empty_cache() -> Result<(), TorchError> {
    // SAFETY: no arguments; exceptions are caught in the shim.
    check(unsafe { ffi::hx_cuda_empty_cache() })
}

/// Resets the allocator's peak figures.
pub fn cuda_reset_peak(device: usize) -> Result<(), TorchError> {
    // SAFETY: plain value; exceptions are caught in the shim.
    check(unsafe { ffi::hx_cuda_reset_peak(device as c_int) })
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

/// A block of a model whose activations [`recompute`] drops.
type Block = Box<dyn Fn(&Tensor) -> Tensor + Send>;

/// Tests that seed or draw from libtorch's global generators take turns
/// (this crate's, and with the `testing` feature those of the crates above).
#[cfg(any(test, feature = "testing"))]
pub static GLOBAL_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(any(test, feature = "testing"))]
thread_local! {
    /// How often a block given to [`recompute`] ran on this thread (tests).
    pub static BLOCK_RUNS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// `block(x)`, with its activations dropped after the forward pass and
/// recomputed in the backward pass (as `torch.utils.checkpoint` does): the
/// backward pass runs `block` again on the kept input, with the autocast
/// state of the forward pass and, with `rng` (the block draws random
/// numbers: dropout), the random state it had, then back-propagates
/// through it. The gradients are those of `block(x)` computed directly.
/// With grad mode off, `block` just runs.
///
/// `block` is kept by the graph of the result until the backward pass (it
/// may run on the autograd engine's thread), so it owns what it uses:
/// shallow clones of the parameters.
pub fn recompute(x: &Tensor, rng: bool, block: impl Fn(&Tensor) -> Tensor + Send + 'static) -> Result<Tensor, TorchError> {
    unsafe extern "C" fn run(ctx: *mut c_void, input: *mut c_void, out: *mut *mut c_void, err: *mut c_char, err_len: usize) {
        // SAFETY: ctx is the Box<Block> leaked below, alive until drop_block;
        // input is a new at::Tensor handed over to us.
        let (block, input) = unsafe { (&*(ctx as *const Block), Tensor::from_ptr(input as *mut _)) };
        #[cfg(any(test, feature = "testing"))]
        BLOCK_RUNS.with(|n| n.set(n.get() + 1));
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| block(&input))) {
            // SAFETY: out is valid for one write; the shim takes the tensor.
            Ok(y) => {
                // SAFETY: out is valid for one write; the shim takes over the
                // at::Tensor, so y must not free it.
                unsafe { *out = y.as_ptr() as *mut c_void };
                std::mem::forget(y);
            }
            Err(payload) => {
                let msg = payload
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| payload.downcast_ref::<&str>().copied())
                    .unwrap_or("the recomputed block panicked");
                let n = msg.len().min(err_len.saturating_sub(1));
                // SAFETY: err holds err_len bytes; n + 1 <= err_len.
                unsafe {
                    std::ptr::copy_nonoverlapping(msg.as_ptr(), err as *mut u8, n);
                    *err.add(n) = 0;
                }
            }
        }
    }
    unsafe extern "C" fn drop_block(ctx: *mut c_void) {
        // SAFETY: ctx is the Box<Block> leaked below; the shim calls this once.
        drop(unsafe { Box::from_raw(ctx as *mut Block) });
    }
    let ctx = Box::into_raw(Box::new(Box::new(block) as Block)) as *mut c_void;
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: x is a live tensor; the shim owns ctx from here on and frees it
    // through drop_block, also when it fails.
    check(unsafe { ffi::hx_recompute(x.as_ptr() as *mut c_void, run, drop_block, ctx, rng as c_int, &mut out) })?;
    // SAFETY: out is a heap at::Tensor from the shim, owned from here on.
    Ok(unsafe { Tensor::from_ptr(out as *mut _) })
}

/// The most outputs (and kept tensors) a [`CustomOp`] may have.
pub const CUSTOM_OP_MAX: usize = 8;

/// A differentiable operation computed by code of harness's own (the fused
/// kernels), run through [`custom_op`]: autograd calls `backward` with the
/// tensors `forward` kept and the gradients of its outputs.
pub trait CustomOp: Send + Sync + 'static {
    /// The outputs (at least one, at most [`CUSTOM_OP_MAX`]) and the tensors
    /// to keep for the backward pass (at most [`CUSTOM_OP_MAX`]; an output
    /// may be among them).
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)>;
    /// The inputs' gradients (None for an input without one) from the kept
    /// tensors and the outputs' gradients (None where no gradient flowed).
    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>>;
}

/// Writes a callback's failure (an error or a panic) into the shim's buffer.
fn report(msg: &str, err: *mut c_char, err_len: usize) {
    let n = msg.len().min(err_len.saturating_sub(1));
    // SAFETY: err holds err_len bytes; n + 1 <= err_len.
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr(), err as *mut u8, n);
        *err.add(n) = 0;
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a fused operation panicked".into())
}

/// Takes `n` tensors handed over by the shim (NULL: none).
///
/// # Safety
/// `ptrs` holds `n` pointers, each NULL or a heap at::Tensor the caller owns.
unsafe fn take(ptrs: *mut *mut c_void, n: c_int) -> Vec<Option<Tensor>> {
    (0..n.max(0) as usize)
        .map(|i| {
            // SAFETY: per the function's contract.
            let p = unsafe { *ptrs.add(i) };
            // SAFETY: a non-null p is a heap at::Tensor the caller owns
            // (the function's contract), taken over here once.
            (!p.is_null()).then(|| unsafe { Tensor::from_ptr(p as *mut _) })
        })
        .collect()
}

/// Hands tensors to the shim (which frees them) through `ptrs`.
///
/// # Safety
/// `ptrs` has room for `ts.len()` pointers.
unsafe fn give(ts: Vec<Option<Tensor>>, ptrs: *mut *mut c_void) {
    for (i, t) in ts.into_iter().enumerate() {
        let p = match t {
            Some(t) => {
                let p = t.as_ptr() as *mut c_void;
                std::mem::forget(t);
                p
            }
            None => std::ptr::null_mut(),
        };
        // SAFETY: per the function's contract.
        unsafe { *ptrs.add(i) = p };
    }
}

/// `op(inputs)` as one node of the autograd graph (see [`CustomOp`]); with
/// grad mode off, just its forward pass. The op is kept by the graph until
/// the backward pass, which may run on the autograd engine's thread.
pub fn custom_op(op: impl CustomOp, inputs: &[&Tensor]) -> Result<Vec<Tensor>, TorchError> {
    type Boxed = Box<dyn CustomOp>;
    unsafe extern "C" fn fwd(
        ctx: *mut c_void,
        input: *mut *mut c_void,
        n_in: c_int,
        out: *mut *mut c_void,
        n_out: *mut c_int,
        saved: *mut *mut c_void,
        n_saved: *mut c_int,
        err: *mut c_char,
        err_len: usize,
    ) {
        // SAFETY: ctx is the Box<Boxed> leaked in custom_op, alive until
        // drop_op; the inputs are new tensors handed to us.
        let (op, inputs) = unsafe { (&*(ctx as *const Boxed), take(input, n_in)) };
        let inputs: Vec<Tensor> = inputs.into_iter().flatten().collect();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op.forward(&inputs))) {
            Ok(Ok((outs, keep))) if !outs.is_empty() && outs.len() <= CUSTOM_OP_MAX && keep.len() <= CUSTOM_OP_MAX => {
                // SAFETY: n_out/n_saved are valid; out and saved have room
                // for CUSTOM_OP_MAX (HX_OP_MAX) pointers.
                unsafe {
                    *n_out = outs.len() as c_int;
                    *n_saved = keep.len() as c_int;
                    give(outs.into_iter().map(Some).collect(), out);
                    give(keep.into_iter().map(Some).collect(), saved);
                }
            }
            Ok(Ok(_)) => report("a fused operation returned no outputs, or too many", err, err_len),
            Ok(Err(e)) => report(&format!("{e:#}"), err, err_len),
            Err(p) => report(&panic_message(&*p), err, err_len),
        }
    }
    unsafe extern "C" fn bwd(
        ctx: *mut c_void,
        saved: *mut *mut c_void,
        n_saved: c_int,
        grads: *mut *mut c_void,
        n_grads: c_int,
        in_grads: *mut *mut c_void,
        n_in: c_int,
        err: *mut c_char,
        err_len: usize,
    ) {
        // SAFETY: as in fwd; the kept tensors and gradients are handed to us.
        let (op, saved, grads) = unsafe { (&*(ctx as *const Boxed), take(saved, n_saved), take(grads, n_grads)) };
        let saved: Vec<Tensor> = saved.into_iter().map(|t| t.unwrap_or_else(Tensor::new)).collect();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op.backward(&saved, &grads))) {
            Ok(Ok(g)) if g.len() == n_in as usize => {
                // SAFETY: in_grads has room for n_in pointers.
                unsafe { give(g, in_grads) }
            }
            Ok(Ok(g)) => report(&format!("a fused operation gave {} gradients for {n_in} inputs", g.len()), err, err_len),
            Ok(Err(e)) => report(&format!("{e:#}"), err, err_len),
            Err(p) => report(&panic_message(&*p), err, err_len),
        }
    }
    unsafe extern "C" fn drop_op(ctx: *mut c_void) {
        // SAFETY: ctx is the Box<Boxed> leaked below; the shim calls this once.
        drop(unsafe { Box::from_raw(ctx as *mut Boxed) });
    }
    let ctx = Box::into_raw(Box::new(Box::new(op) as Boxed)) as *mut c_void;
    let ptrs: Vec<*mut c_void> = inputs.iter().map(|t| t.as_ptr() as *mut c_void).collect();
    let mut out = [std::ptr::null_mut::<c_void>(); CUSTOM_OP_MAX];
    let mut n_out: c_int = 0;
    // SAFETY: the inputs are live tensors (the shim copies the handles);
    // out has room for CUSTOM_OP_MAX results; the shim owns ctx from here on
    // and frees it through drop_op, also when it fails.
    check(unsafe { ffi::hx_custom_op(ptrs.as_ptr(), ptrs.len() as c_int, fwd, bwd, drop_op, ctx, out.as_mut_ptr(), &mut n_out) })?;
    // SAFETY: the shim wrote n_out (<= CUSTOM_OP_MAX) new tensors we now own.
    Ok(unsafe { take(out.as_mut_ptr(), n_out.min(CUSTOM_OP_MAX as c_int)) }.into_iter().flatten().collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn fused_adamw_matches_the_textbook_update() {
        let p = Tensor::from_slice(&[1.0f32, -2.0, 0.5]);
        let g = Tensor::from_slice(&[0.1f32, 0.2, -0.3]);
        let (m, v, s) = (p.zeros_like(), p.zeros_like(), Tensor::zeros([], (Kind::Float, Device::Cpu)));
        let h = AdamWStep { lr: Lr::Host(0.1), beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8 };
        let before: Vec<f32> = Vec::try_from(&p).unwrap();
        fused_adamw(&[p.shallow_clone()], &[g.shallow_clone()], &[m], &[v], &[s], h, None, None).unwrap();
        let after: Vec<f32> = Vec::try_from(&p).unwrap();
        let gs: Vec<f32> = Vec::try_from(&g).unwrap();
        for i in 0..3 {
            // First step: m_hat = g, v_hat = g^2, update = lr * g / (|g| + eps).
            let want = before[i] * (1.0 - 0.1 * 0.01) - 0.1 * gs[i] / (gs[i].abs() + 1e-8);
            assert!((after[i] - want).abs() < 1e-6, "{i}: {} vs {want}", after[i]);
        }
    }

    #[test]
    fn a_gradient_scale_divides_the_gradients_as_the_kernel_reads_them() {
        // The same step from g / 4 and from g with a scale of 4.
        let run = |g: Tensor, scale: Option<&Tensor>| {
            let p = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 3.0]);
            let (m, v, s) = (p.zeros_like(), p.zeros_like(), Tensor::zeros([], (Kind::Float, Device::Cpu)));
            let h = AdamWStep { lr: Lr::Host(0.1), beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-3 };
            fused_adamw(&[p.shallow_clone()], &[g.shallow_clone()], &[m.shallow_clone()], &[v], &[s], h, None, scale).unwrap();
            (p, m, g)
        };
        let g = Tensor::from_slice(&[0.4f32, 0.8, -1.2, 2.0]);
        let (want_p, want_m, _) = run(&g / 4.0, None);
        let (p, m, g_after) = run(g.copy(), Some(&Tensor::from_slice(&[4.0f32]).squeeze()));
        assert!(p.allclose(&want_p, 1e-6, 1e-7, false) && m.allclose(&want_m, 1e-6, 1e-7, false), "{p} vs {want_p}");
        assert!(g_after.allclose(&(g / 4.0), 1e-6, 0.0, false), "the scaled gradient is written back");
        let bad = Tensor::from_slice(&[1.0f64]);
        let p = Tensor::from_slice(&[1.0f32]);
        let h = AdamWStep { lr: Lr::Host(0.1), beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 };
        let e = fused_adamw(
            &[p.shallow_clone()],
            &[p.ones_like()],
            &[p.zeros_like()],
            &[p.zeros_like()],
            &[p.zeros_like().squeeze()],
            h,
            None,
            Some(&bad),
        );
        assert!(e.is_err(), "a double scale is refused");
    }

    #[test]
    fn cpu_all_finite_finds_every_non_finite_value_in_every_float_kind() {
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            // Past one 4096-element chunk, large finite values included.
            let clean = Tensor::linspace(-6e4, 6e4, 10_000, (Kind::Float, Device::Cpu)).to_kind(kind);
            assert_eq!(cpu_all_finite(&clean), Some(true), "{kind:?}");
            for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                for at in [0, 4095, 4096, 9_999] {
                    let t = clean.copy();
                    let _ = t.get(at).fill_(bad);
                    assert_eq!(cpu_all_finite(&t), Some(false), "{kind:?} {bad} at {at}");
                }
            }
        }
        assert_eq!(cpu_all_finite(&Tensor::from_slice(&[f32::MAX, f32::MIN, 0.0, -0.0])), Some(true));
        assert_eq!(cpu_all_finite(&Tensor::zeros([0], (Kind::Float, Device::Cpu))), Some(true));
        // What it cannot read directly is left to the caller.
        let m = Tensor::ones([4, 4], (Kind::Float, Device::Cpu));
        assert_eq!(cpu_all_finite(&m.tr()), None);
        assert_eq!(cpu_all_finite(&Tensor::ones([4], (Kind::Double, Device::Cpu))), None);
    }

    #[test]
    fn clip_grad_norm_scales_to_the_limit() {
        let a = Tensor::from_slice(&[3.0f32]);
        let b = Tensor::from_slice(&[4.0f32]);
        let n = clip_grad_norm(&[a.shallow_clone(), b.shallow_clone()], Some(1.0)).unwrap();
        assert!((n.double_value(&[]) - 5.0).abs() < 1e-6);
        assert!((a.double_value(&[0]) - 0.6).abs() < 1e-5);
        assert!((b.double_value(&[0]) - 0.8).abs() < 1e-5);
    }

    #[test]
    fn errors_from_libtorch_are_reported_not_thrown() {
        // An integer gradient: libtorch's norm throws; we get an Err.
        let e = clip_grad_norm(&[Tensor::from_slice(&[1i64, 2])], Some(1.0)).unwrap_err();
        assert!(e.0.contains("norm"), "{e}");
    }

    #[test]
    fn seeded_random_repeats_and_leaves_the_global_stream_alone() {
        let _turn = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(7);
        let before = Tensor::rand([4], (Kind::Float, Device::Cpu));
        tch::manual_seed(7);
        let a = rand_seeded(RandKind::Uniform, &[1000], 42, Device::Cpu).unwrap();
        let b = rand_seeded(RandKind::Uniform, &[1000], 42, Device::Cpu).unwrap();
        let after = Tensor::rand([4], (Kind::Float, Device::Cpu));
        assert!(a.equal(&b));
        assert!(!a.equal(&rand_seeded(RandKind::Uniform, &[1000], 43, Device::Cpu).unwrap()));
        assert!(before.equal(&after), "the global generator moved");
        let p = rand_seeded(RandKind::Permutation, &[50], 1, Device::Cpu).unwrap();
        let sorted = p.sort(0, false).0;
        assert!(sorted.equal(&Tensor::arange(50, (Kind::Int64, Device::Cpu))));
        let n = rand_seeded(RandKind::Normal, &[20000], 3, Device::Cpu).unwrap();
        assert!(n.mean(Kind::Float).double_value(&[]).abs() < 0.05);
    }

    #[test]
    fn backward_accumulates_into_a_gradient_set_as_a_view() {
        // Two parameters whose gradients are views of one flat buffer.
        let flat = Tensor::zeros([5], (Kind::Float, Device::Cpu));
        let a = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let b = Tensor::from_slice(&[3.0f32, 4.0, 5.0]).view([3, 1]).set_requires_grad(true);
        set_grad(&a, Some(&flat.narrow(0, 0, 2))).unwrap();
        set_grad(&b, Some(&flat.narrow(0, 2, 3).view([3, 1]))).unwrap();
        // Two backward passes (gradient accumulation): d/da sum(a^2) = 2a, d/db sum(3b) = 3.
        for _ in 0..2 {
            ((&a * &a).sum(Kind::Float) + (&b * 3.0).sum(Kind::Float)).backward();
        }
        assert_eq!(Vec::<f32>::try_from(&flat).unwrap(), [4.0, 8.0, 6.0, 6.0, 6.0]);
        // The gradients are still the views, not copies.
        let g = grads(&[a.shallow_clone(), b.shallow_clone()]).unwrap();
        assert_eq!(g[0].data_ptr(), flat.data_ptr());
        assert_eq!(g[1].size(), [3, 1]);
        // None resets; a wrong shape is refused.
        set_grad(&a, None).unwrap();
        assert!(!grads(&[a.shallow_clone()]).unwrap()[0].defined());
        let e = set_grad(&a, Some(&flat)).unwrap_err();
        assert!(e.0.contains("gradient of shape [5] for a parameter of shape [2]"), "{e}");
    }

    #[test]
    fn grad_ready_hooks_fire_once_per_accumulation() {
        unsafe extern "C" fn count(ctx: *mut c_void, idx: i64) {
            // SAFETY: ctx is the Vec below, alive while the hook is set.
            let v = unsafe { &mut *(ctx as *mut Vec<i64>) };
            v.push(idx);
        }
        let mut seen: Vec<i64> = Vec::new();
        let a = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let b = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        let ctx = &mut seen as *mut Vec<i64> as *mut c_void;
        // SAFETY: `seen` outlives the hooks, removed below.
        unsafe {
            set_grad_ready_hook(&a, Some(count), ctx, 7).unwrap();
            set_grad_ready_hook(&b, Some(count), ctx, 9).unwrap();
        }
        ((&a * &a).sum(Kind::Float) + (&b * &a.sum(Kind::Float))).sum(Kind::Float).backward();
        let mut got = seen.clone();
        got.sort();
        assert_eq!(got, vec![7, 9]);
        // SAFETY: removing the hooks.
        unsafe {
            set_grad_ready_hook(&a, None, std::ptr::null_mut(), 0).unwrap();
            set_grad_ready_hook(&b, None, std::ptr::null_mut(), 0).unwrap();
        }
        (&a * 2.0).sum(Kind::Float).backward();
        assert_eq!(seen.len(), 2, "a removed hook fired");
    }

    #[test]
    fn arrival_hooks_fire_before_autograd_accumulates() {
        struct Seen {
            a: Tensor,
            at_arrival: Vec<(i64, Vec<f32>)>,
        }
        unsafe extern "C" fn look(ctx: *mut c_void, idx: i64) {
            // SAFETY: ctx is the Seen below, alive while the hook is set.
            let s = unsafe { &mut *(ctx as *mut Seen) };
            let g = s.a.grad();
            let now = if g.defined() { Vec::<f32>::try_from(&g).unwrap() } else { vec![] };
            s.at_arrival.push((idx, now));
        }
        let a = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let mut seen = Seen { a: a.shallow_clone(), at_arrival: vec![] };
        // SAFETY: `seen` outlives the hook, removed below.
        let handle = unsafe { set_grad_arrival_hook(&a, look, &mut seen as *mut Seen as *mut c_void, 4).unwrap() };
        (&a * 3.0).sum(Kind::Float).backward();
        (&a * 3.0).sum(Kind::Float).backward();
        // Once per backward pass, each time before that pass's gradient was added.
        assert_eq!(seen.at_arrival, vec![(4, vec![]), (4, vec![3.0, 3.0])]);
        assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), vec![6.0, 6.0]);
        remove_hook(&a, handle).unwrap();
        (&a * 3.0).sum(Kind::Float).backward();
        assert_eq!(seen.at_arrival.len(), 2, "a removed hook fired");
    }

    /// A two-layer block with dropout: x -> dropout(gelu(x W1)) W2 + x.
    fn block(w1: &Tensor, w2: &Tensor) -> impl Fn(&Tensor) -> Tensor + Send + 'static {
        let (w1, w2) = (w1.shallow_clone(), w2.shallow_clone());
        move |x: &Tensor| x.matmul(&w1).gelu("tanh").dropout(0.3, true).matmul(&w2) + x
    }

    /// Gradients of (w1, w2, x) of `sum(f(f(x))^2)`, the first application
    /// through `recompute` or directly.
    fn grads_of(again: bool, calls: &std::sync::Arc<std::sync::atomic::AtomicU32>) -> Vec<Tensor> {
        let _turn = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(5);
        let w1 = Tensor::randn([6, 12], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let w2 = Tensor::randn([12, 6], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::randn([4, 6], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let f = block(&w1, &w2);
        let counted = {
            let (f, calls) = (block(&w1, &w2), calls.clone());
            move |x: &Tensor| {
                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                f(x)
            }
        };
        let h = if again { recompute(&x, true, counted).unwrap() } else { counted(&x) };
        // The random draws after the recomputed block are those of a plain run.
        let y = f(&h);
        y.square().sum(Kind::Float).backward();
        vec![w1.grad(), w2.grad(), x.grad()]
    }

    #[test]
    fn recomputation_runs_the_block_again_and_gives_the_same_gradients_bit_for_bit() {
        use std::sync::{atomic::AtomicU32, atomic::Ordering, Arc};
        let (plain_calls, again_calls) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let plain = grads_of(false, &plain_calls);
        let again = grads_of(true, &again_calls);
        assert_eq!(plain_calls.load(Ordering::SeqCst), 1);
        assert_eq!(again_calls.load(Ordering::SeqCst), 2, "the backward pass did not run the block again");
        for (i, (a, b)) in plain.iter().zip(&again).enumerate() {
            assert!(a.defined() && b.defined(), "gradient {i} missing");
            assert!(a.equal(b), "gradient {i} differs: {a} vs {b}");
        }
    }

    #[test]
    fn recomputation_keeps_the_autocast_of_the_forward_pass_and_reports_failures() {
        let w = Tensor::randn([8, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::randn([2, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let grad = |again: bool| {
            grads_to_none(std::slice::from_ref(&w)).unwrap();
            set_autocast(AutocastDevice::Cpu, Some(Kind::BFloat16)).unwrap();
            let wc = w.shallow_clone();
            let f = move |x: &Tensor| x.matmul(&wc).relu();
            let y = if again { recompute(&x, false, f).unwrap() } else { f(&x) };
            set_autocast(AutocastDevice::Cpu, None).unwrap();
            assert_eq!(y.kind(), Kind::BFloat16);
            // The backward pass runs with autocast off: the recomputation
            // must turn it back on, or its gradients come out in fp32 maths.
            y.to_kind(Kind::Float).sum(Kind::Float).backward();
            w.grad().copy()
        };
        let (plain, again) = (grad(false), grad(true));
        assert!(plain.equal(&again), "bf16 gradients differ: {plain} vs {again}");
        // A block that fails in the backward pass fails the backward pass
        // with its message.
        let fired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = {
            let fired = fired.clone();
            let wc = w.shallow_clone();
            move |x: &Tensor| {
                if fired.swap(true, std::sync::atomic::Ordering::SeqCst) {
                    panic!("CUDA out of memory (emulated)");
                }
                x.matmul(&wc)
            }
        };
        let y = recompute(&x, false, f).unwrap();
        let e = backward_with_grad(&y, &y.ones_like()).unwrap_err();
        assert!(e.0.contains("out of memory (emulated)"), "{e}");
    }

    #[test]
    fn dense_tensors_are_contiguous_or_permuted_but_never_strided_or_overlapping() {
        let x = Tensor::arange(2 * 3 * 4 * 5, (Kind::Float, Device::Cpu)).view([2, 3, 4, 5]);
        assert!(is_dense(&x));
        // channels-last: NHWC in memory, NCHW in shape.
        let cl = x.permute([0, 2, 3, 1]).contiguous().permute([0, 3, 1, 2]);
        assert!(!cl.is_contiguous() && is_dense(&cl));
        assert!(is_dense(&x.transpose(1, 2)));
        assert!(!is_dense(&x.narrow(3, 0, 4)), "a slice leaves gaps");
        assert!(!is_dense(&x.select(1, 0).unsqueeze(1).expand([2, 3, 4, 5], false)), "expanded: elements overlap");
        assert!(is_dense(&Tensor::zeros([1, 7, 1], (Kind::Float, Device::Cpu))));
    }

    #[test]
    fn adamw_refuses_mismatched_shapes() {
        let p = Tensor::from_slice(&[1.0f32, 2.0]);
        let g = Tensor::from_slice(&[1.0f32]);
        let (m, v, s) = (p.zeros_like(), p.zeros_like(), Tensor::zeros([], (Kind::Float, Device::Cpu)));
        let h = AdamWStep { lr: Lr::Host(0.1), beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 };
        assert!(fused_adamw(&[p], &[g], &[m], &[v], &[s], h, None, None).is_err());
    }
}

/// The bytes of `t`'s elements (its numel times its element size).
pub fn nbytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// Whether `t`'s elements fill `numel` consecutive elements of memory from
/// its data pointer, each once, in some order of its dimensions (a
/// contiguous tensor, or one in channels-last layout): what a library that
/// takes a pointer and a count (NCCL, a copy) may use in place when every
/// side has the same layout.
pub fn is_dense(t: &Tensor) -> bool {
    is_dense_layout(&t.size(), &t.stride())
}

/// [`is_dense`] of a tensor of `size` with `stride`: sorted by stride, each
/// stride (of a dimension longer than 1) is the product of the sizes below.
pub fn is_dense_layout(size: &[i64], stride: &[i64]) -> bool {
    let mut dims: Vec<(i64, i64)> = size.iter().zip(stride).filter(|(&n, _)| n != 1).map(|(&n, &s)| (s, n)).collect();
    dims.sort_unstable();
    let mut next = 1;
    for (s, n) in dims {
        if s != next {
            return false;
        }
        next *= n;
    }
    true
}

/// Whether every element of a contiguous CPU tensor of floats (f32, bf16,
/// f16) is finite, read straight from its memory in one vectorised pass with
/// no libtorch dispatch or thread-pool start; `None` for tensors on a device,
/// non-contiguous ones and other kinds.
pub fn cpu_all_finite(t: &Tensor) -> Option<bool> {
    if t.device() != Device::Cpu || !t.is_contiguous() {
        return None;
    }
    let n = t.numel();
    if n == 0 {
        return Some(true);
    }
    let p = t.data_ptr();
    // SAFETY: a contiguous CPU tensor of `n` elements of the matched kind
    // starts at `p`; the slice lives only for this call, while `t` holds it.
    unsafe {
        match t.kind() {
            Kind::Float => Some(finite::all32(std::slice::from_raw_parts(p as *const i32, n))),
            Kind::BFloat16 => Some(finite::all16(std::slice::from_raw_parts(p as *const i16, n), 0x7f7f)),
            Kind::Half => Some(finite::all16(std::slice::from_raw_parts(p as *const i16, n), 0x7bff)),
            _ => None,
        }
    }
}

/// The scans of [`cpu_all_finite`]. An element is NaN or infinite exactly
/// when its bits without the sign exceed those of the largest finite value;
/// the comparisons are signed (the masked bits are non-negative), which
/// every x86-64 vector unit has. AVX2 where the CPU has it.
mod finite {
    #[inline(always)]
    fn scan32(xs: &[i32]) -> bool {
        xs.chunks(4096).all(|c| !c.iter().fold(false, |bad, &x| bad | ((x & 0x7fff_ffff) > 0x7f7f_ffff)))
    }

    #[inline(always)]
    fn scan16(xs: &[i16], max_finite: i16) -> bool {
        xs.chunks(8192).all(|c| !c.iter().fold(false, |bad, &x| bad | ((x & 0x7fff) > max_finite)))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn scan32_avx2(xs: &[i32]) -> bool {
        scan32(xs)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn scan16_avx2(xs: &[i16], max_finite: i16) -> bool {
        scan16(xs, max_finite)
    }

    pub fn all32(xs: &[i32]) -> bool {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { scan32_avx2(xs) };
        }
        scan32(xs)
    }

    pub fn all16(xs: &[i16], max_finite: i16) -> bool {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { scan16_avx2(xs, max_finite) };
        }
        scan16(xs, max_finite)
    }
}

/// Whether a trace is being recorded in this process (ranges cost an
/// allocation each, so they are opened only then).
static TRACING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Starts libtorch's profiler (Kineto) on this thread, as torch.profiler
/// does: operators with their input shapes, and with `cuda` the kernels and
/// copies (through CUPTI). Operators of the autograd engine's threads are
/// recorded too (they inherit the profiler's thread state).
pub fn profiler_start(cuda: bool) -> Result<(), TorchError> {
    // SAFETY: no pointers are passed.
    check(unsafe { ffi::hx_profiler_start(c_int::from(cuda)) })?;
    TRACING.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Stops the profiler started by [`profiler_start`] and writes its Chrome
/// trace (JSON, for chrome://tracing or ui.perfetto.dev) to `path`.
pub fn profiler_stop(path: &std::path::Path) -> Result<(), TorchError> {
    TRACING.store(false, std::sync::atomic::Ordering::Relaxed);
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| TorchError("a path with a NUL byte".into()))?;
    // SAFETY: c is a NUL-terminated string alive for the call.
    check(unsafe { ffi::hx_profiler_stop(c.as_ptr()) })
}

/// A named range on the trace's timeline while a trace is recorded (else
/// nothing): ended when dropped, on the thread that opened it.
pub struct Range(*mut c_void);

impl Range {
    /// Opens a range named `name()` if a trace is being recorded.
    pub fn open(name: impl FnOnce() -> String) -> Option<Range> {
        if !TRACING.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let c = std::ffi::CString::new(name().replace('\0', " ")).ok()?;
        // SAFETY: c is a NUL-terminated string alive for the call; the shim
        // copies it.
        let r = unsafe { ffi::hx_range_push(c.as_ptr()) };
        (!r.is_null()).then_some(Range(r))
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        // SAFETY: self.0 came from hx_range_push and is ended once, here;
        // Range is neither Send nor Sync (raw pointer), so this runs on the
        // thread that opened it, as RecordFunction requires.
        unsafe { ffi::hx_range_pop(self.0) }
    }
}
