//! The shim's CUDA side: whether libtorch sees a GPU, its current stream
//! and cuBLASLt handle, CUDA graphs, pinned memory and asynchronous copies,
//! events, and the caching allocator's figures.

use std::ffi::{c_int, c_void};

use tch::Tensor;

use super::{check, ffi, TorchError};

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
