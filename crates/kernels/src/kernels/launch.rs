//! The kernels' program and how they are launched: the CUDA source
//! (`cuda/*.cu`) compiled with NVRTC for the device, its module loaded once,
//! and [`launch`], through which every kernel goes to libtorch's stream.

use std::ffi::{c_void, CString};
use std::marker::PhantomData;
use std::sync::OnceLock;

use cudarc::driver::{result, sys};
use tch::Tensor;

/// Threads per block of the warp-per-row LayerNorm backward.
pub(super) const LN_BWD_THREADS: u32 = 128;

/// Its shared memory per block for rows of `c` channels: a [3, c] fp32 set
/// per warp (48 KiB, the default limit, at 1024 channels).
pub(super) fn ln_bwd_warp_smem(c: i64) -> u32 {
    (LN_BWD_THREADS / 32) * 3 * c as u32 * 4
}

/// Tensors per launch of the AdamW kernel (its `ADAM_MAX`, passed to NVRTC).
pub(super) const ADAM_MAX: usize = 48;
/// Elements per block of the AdamW kernel (its `ADAM_CHUNK`, passed to NVRTC).
pub(super) const ADAM_CHUNK: i64 = 8192;

/// The AdamW kernel's tensor list, laid out as its `AdamList`.
#[repr(C)]
pub(super) struct AdamList {
    pub(super) p: [*mut c_void; ADAM_MAX],
    pub(super) g: [*mut c_void; ADAM_MAX],
    pub(super) m: [*mut c_void; ADAM_MAX],
    pub(super) v: [*mut c_void; ADAM_MAX],
    pub(super) step: [*mut c_void; ADAM_MAX],
    pub(super) n: [i64; ADAM_MAX],
    pub(super) first_block: [i32; ADAM_MAX + 1],
    pub(super) count: i32,
}

/// Elements per block of the list cast (its `CAST_CHUNK`, passed to NVRTC).
pub(super) const CAST_CHUNK: i64 = 16384;

/// [`super::cast_bf16_list`]'s argument, laid out as the kernel's `CastList`.
#[repr(C)]
pub(super) struct CastList {
    pub(super) w: [*mut c_void; ADAM_MAX],
    pub(super) out: [*mut c_void; ADAM_MAX],
    pub(super) n: [i64; ADAM_MAX],
    pub(super) first_block: [i32; ADAM_MAX + 1],
    pub(super) count: i32,
}

/// The program NVRTC compiles: the files of `cuda/`, one op or family of
/// ops each, in this order and as they are, nothing between them (a file
/// ends with an empty line where the next one's text was set apart when
/// this was one string). A file may use what an earlier one defines:
/// `common.cu`'s bf16 type and conversions, PDL_WAIT and block reductions;
/// `cross_entropy.cu`'s `bf_lo` and `bf_hi`; `gelu.cu`'s `unpack_bf8`,
/// `ld_bf8` and `st_bf8`.
///
/// The text is byte for byte the one string this was in kernels.rs
/// (common.cu's leading empty line included, and its comment on PDL_WAIT,
/// which calls [`launch`] by its old name, `launch_smem`): NVRTC's PTX for
/// it is not a function of the text alone. From run to run, and with any
/// change of the text, a comment's too, a few of the LayerNorm backward
/// kernels (`add_ln_bwd_warp*`) gain or lose a redundant shared-memory
/// load, as the compiler's memory layout falls; so an edit here is a change
/// of GPU code, whatever it touches.
const SOURCE: &str = concat!(
    include_str!("../../cuda/common.cu"),
    include_str!("../../cuda/cross_entropy.cu"),
    include_str!("../../cuda/layer_norm.cu"),
    include_str!("../../cuda/gelu.cu"),
    include_str!("../../cuda/cast.cu"),
    include_str!("../../cuda/partials.cu"),
    include_str!("../../cuda/column_sums.cu"),
    include_str!("../../cuda/pack_qkv.cu"),
    include_str!("../../cuda/embedding.cu"),
    include_str!("../../cuda/multi_tensor.cu"),
    include_str!("../../cuda/clock.cu"),
    include_str!("../../cuda/hash.cu"),
    include_str!("../../cuda/batch_norm.cu"),
    include_str!("../../cuda/pool.cu"),
);

/// A kernel of the loaded module.
#[derive(Clone, Copy)]
pub(super) struct Kernel {
    f: sys::CUfunction,
    /// Whether the kernel starts with PDL_WAIT, and so may be launched
    /// while the one ahead of it on the stream still runs
    /// ([`dependent_launches`]).
    waits: bool,
}

/// The loaded module: each kernel, and what launches need to know of the
/// device.
pub(super) struct Loaded {
    _module: sys::CUmodule,
    pub(super) ce_bf16: Kernel,
    /// The LayerNorm kernels by the normalisation and the kind of its
    /// output and of that output's gradient (`ln_index`): LayerNorm in
    /// bf16, LayerNorm in fp32 (`_f32`), RMS normalisation in bf16
    /// (`add_rms_*`).
    pub(super) add_ln_fwd: [Kernel; 3],
    pub(super) add_ln_fwd_warp: [Kernel; 3],
    pub(super) add_ln_bwd: [Kernel; 3],
    /// `add_ln_bwd_warp{NQ}` (`add_ln_bwd_warp_f32_{NQ}`,
    /// `add_rms_bwd_warp{NQ}`) for NQ = 1..=8 (rows of 128 NQ channels),
    /// with the blocks of 128 threads each SM holds at once.
    pub(super) add_ln_bwd_warp: [[(Kernel, u32); 8]; 3],
    pub(super) bias_gelu_fwd: Kernel,
    pub(super) bias_gelu_bwd: Kernel,
    pub(super) cast_bf16: Kernel,
    pub(super) add_partials: Kernel,
    pub(super) col_sums_bf16: Kernel,
    pub(super) relu_bwd: Kernel,
    pub(super) pack_qkv: Kernel,
    pub(super) embed_fwd: Kernel,
    pub(super) embed_bwd: Kernel,
    pub(super) adamw: Kernel,
    pub(super) adamw_steps: Kernel,
    pub(super) cast_list: Kernel,
    /// Training-mode batch norm with its ReLU and residual add
    /// (`batch_norm.cu`).
    pub(super) bn_stats: Kernel,
    pub(super) bn_stats_finish: Kernel,
    pub(super) bn_apply: Kernel,
    pub(super) bn_bwd_sums: Kernel,
    pub(super) bn_bwd_apply: Kernel,
    /// Max pooling with a byte offset per output (`pool.cu`).
    pub(super) max_pool_fwd: Kernel,
    pub(super) max_pool_bwd: Kernel,
    /// Streaming multiprocessors of the device (grid sizes).
    pub(super) sms: u32,
    /// The device's compute capability (major).
    major: i32,
    /// Dynamic shared memory a block of `ce_bf16` may take (bytes).
    pub(super) ce_smem: i32,
    pub(super) stamp: Kernel,
    pub(super) spin_until: Kernel,
    pub(super) word_hash: Kernel,
}

// SAFETY: CUmodule and CUfunction are driver handles valid in every thread
// that has the (primary) context current; they are only used for launches.
unsafe impl Send for Loaded {}
// SAFETY: as for Send; nothing in Loaded changes after loading.
unsafe impl Sync for Loaded {}

/// The module, compiled and loaded on first use (for the device of the
/// current context), or why it could not be.
pub(super) fn loaded() -> Result<&'static Loaded, String> {
    static K: OnceLock<Result<Loaded, String>> = OnceLock::new();
    K.get_or_init(|| {
        let (dev, major, minor) = current_device()?;
        let cap = |a| attribute(dev, a);
        let module = load(&compile(major, minor)?)?;
        let get = |name: &str| function(module, name);
        // Every kernel but the cross-entropy and the clock's starts with
        // PDL_WAIT.
        let waiting = |name: &str| get(name).map(|f| Kernel { f, waits: true });
        let plain = |name: &str| get(name).map(|f| Kernel { f, waits: false });
        let sms = cap(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let ce_bf16 = plain("ce_bf16")?;
        // The fused cross-entropy keeps a row of logits in shared memory:
        // as much as a block may opt into (a row of 50,304 bf16 logits
        // takes 98 KiB; Hopper allows 227 KiB).
        let optin = cap(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let static_smem = 32 * 4;
        let ce_smem = optin - static_smem;
        // SAFETY: ce_bf16 is a function of the loaded module.
        unsafe {
            result::function::set_function_attribute(
                ce_bf16.f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                ce_smem,
            )
        }
        .map_err(|e| format!("ce_bf16 shared memory: {e:?}"))?;
        Ok(Loaded {
            _module: module,
            ce_bf16,
            ce_smem,
            add_ln_fwd: [waiting("add_ln_fwd")?, waiting("add_ln_fwd_f32")?, waiting("add_rms_fwd")?],
            add_ln_fwd_warp: [waiting("add_ln_fwd_warp")?, waiting("add_ln_fwd_warp_f32")?, waiting("add_rms_fwd_warp")?],
            add_ln_bwd: [waiting("add_ln_bwd")?, waiting("add_ln_bwd_f32")?, waiting("add_rms_bwd")?],
            add_ln_bwd_warp: {
                let none = Kernel { f: std::ptr::null_mut(), waits: true };
                let mut fs = [[(none, 0); 8]; 3];
                for (prefix, set) in ["add_ln_bwd_warp", "add_ln_bwd_warp_f32_", "add_rms_bwd_warp"].iter().zip(fs.iter_mut()) {
                    for (i, f) in set.iter_mut().enumerate() {
                        let kernel = waiting(&format!("{prefix}{}", i + 1))?;
                        let smem = ln_bwd_warp_smem(128 * (i as i64 + 1));
                        // SAFETY: kernel.f is a function of the loaded module.
                        let per_sm = unsafe {
                            result::occupancy::max_active_block_per_multiprocessor(kernel.f, LN_BWD_THREADS as i32, smem as usize)
                        }
                        .map_err(|e| format!("{prefix} occupancy: {e:?}"))?;
                        *f = (kernel, per_sm.max(1) as u32);
                    }
                }
                fs
            },
            bias_gelu_fwd: waiting("bias_gelu_fwd")?,
            bias_gelu_bwd: waiting("bias_gelu_bwd")?,
            cast_bf16: waiting("cast_bf16")?,
            add_partials: waiting("add_partials")?,
            col_sums_bf16: waiting("col_sums_bf16")?,
            relu_bwd: waiting("relu_bwd")?,
            pack_qkv: waiting("pack_qkv")?,
            embed_fwd: waiting("embed_fwd")?,
            embed_bwd: waiting("embed_bwd")?,
            adamw: waiting("adamw")?,
            adamw_steps: waiting("adamw_steps")?,
            cast_list: waiting("cast_list")?,
            bn_stats: waiting("bn_stats")?,
            bn_stats_finish: waiting("bn_stats_finish")?,
            bn_apply: waiting("bn_apply")?,
            bn_bwd_sums: waiting("bn_bwd_sums")?,
            bn_bwd_apply: waiting("bn_bwd_apply")?,
            max_pool_fwd: waiting("max_pool_fwd")?,
            max_pool_bwd: waiting("max_pool_bwd")?,
            sms,
            major,
            stamp: plain("stamp")?,
            spin_until: plain("spin_until")?,
            word_hash: plain("word_hash")?,
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The device of the current context (libtorch has initialised CUDA on
/// this thread: a tensor is on the device before the first launch), and
/// its compute capability (major, minor).
fn current_device() -> Result<(sys::CUdevice, i32, i32), String> {
    let mut dev = 0;
    // SAFETY: this reads the current context's device into dev.
    unsafe { sys::cuCtxGetDevice(&mut dev) }.result().map_err(|e| format!("no CUDA context: {e:?}"))?;
    let major = attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok((dev, major, minor))
}

/// One attribute of device `dev`.
fn attribute(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32, String> {
    // SAFETY: dev is a device of this process; this reads one attribute.
    unsafe { result::device::get_attribute(dev, a) }.map_err(|e| format!("{e:?}"))
}

/// A module loaded from PTX text, kept for the process (the callers keep
/// it in a static).
fn load(ptx: &str) -> Result<sys::CUmodule, String> {
    let image = CString::new(ptx).map_err(|e| e.to_string())?;
    // SAFETY: image is NUL-terminated PTX text.
    unsafe { result::module::load_data(image.as_ptr() as *const c_void) }.map_err(|e| format!("{e:?}"))
}

/// The function `name` of a loaded module.
fn function(module: sys::CUmodule, name: &str) -> Result<sys::CUfunction, String> {
    // SAFETY: module is loaded; the name is NUL-terminated.
    unsafe { result::module::get_function(module, CString::new(name).expect("no NUL")) }.map_err(|e| format!("{name}: {e:?}"))
}

/// The collectives' kernels (`cuda/comm.cu`): a program of their own,
/// compiled and loaded on first use, so that the training kernels' program
/// (whose PTX moves with any edit of its text, see [`SOURCE`]) stays as it is.
pub(super) struct CommKernels {
    _module: sys::CUmodule,
    pub(super) scale_f32: Kernel,
    /// Streaming multiprocessors of the device (grid sizes).
    pub(super) sms: u32,
}

// SAFETY: as for Loaded: driver handles, only used for launches.
unsafe impl Send for CommKernels {}
// SAFETY: as for Send; nothing changes after loading.
unsafe impl Sync for CommKernels {}

/// The collectives' kernels, or why they cannot be used.
pub(super) fn comm_loaded() -> Result<&'static CommKernels, String> {
    static K: OnceLock<Result<CommKernels, String>> = OnceLock::new();
    K.get_or_init(|| {
        let (dev, major, minor) = current_device()?;
        let module = load(&compile_program(COMM_SOURCE, major, minor, Vec::new())?)?;
        Ok(CommKernels {
            _module: module,
            scale_f32: Kernel { f: function(module, "scale_f32")?, waits: false },
            sms: attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The collectives' program (see [`CommKernels`]).
pub(super) const COMM_SOURCE: &str = include_str!("../../cuda/comm.cu");

/// The loaded module, or an error saying that the `what` kernels are
/// unavailable and why.
pub(super) fn require(what: &str) -> anyhow::Result<&'static Loaded> {
    loaded().map_err(|e| anyhow::anyhow!("{what} kernels unavailable: {e}"))
}

/// Compiles the kernels to PTX for a compute capability (NVRTC needs no GPU).
pub(super) fn compile(major: i32, minor: i32) -> Result<String, String> {
    let options = vec![format!("-DADAM_MAX={ADAM_MAX}"), format!("-DADAM_CHUNK={ADAM_CHUNK}"), format!("-DCAST_CHUNK={CAST_CHUNK}")];
    compile_program(SOURCE, major, minor, options)
}

/// Compiles `source` to PTX for a compute capability, with NVRTC `options`.
pub(super) fn compile_program(source: &'static str, major: i32, minor: i32, options: Vec<String>) -> Result<String, String> {
    let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
    let opts = cudarc::nvrtc::CompileOptions { arch: Some(arch), options, ..Default::default() };
    let ptx = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(source, opts))
        .map_err(|_| "libnvrtc could not be loaded".to_owned())?
        .map_err(|e| format!("NVRTC: {e:?}"))?;
    Ok(ptx.to_src())
}

/// Where a launch runs: blocks, threads per block, and dynamic shared
/// memory per block (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Grid {
    pub(super) blocks: (u32, u32, u32),
    pub(super) threads: (u32, u32, u32),
    pub(super) smem: u32,
}

impl Grid {
    /// `blocks` blocks of `threads` threads, in one dimension each.
    pub(super) fn line(blocks: u32, threads: u32) -> Grid {
        Grid::new((blocks, 1, 1), (threads, 1, 1))
    }

    /// Blocks and threads per block in up to three dimensions.
    pub(super) fn new(blocks: (u32, u32, u32), threads: (u32, u32, u32)) -> Grid {
        Grid { blocks, threads, smem: 0 }
    }

    /// The same with `bytes` of dynamic shared memory per block.
    pub(super) fn smem(self, bytes: u32) -> Grid {
        Grid { smem: bytes, ..self }
    }
}

/// A kernel parameter as the launch passes it: a tensor as its data
/// pointer (null for none), a number as the C type of the same size and
/// kind (`int`, `long long`, `unsigned long long`, `float`, `double`), a
/// list struct where the caller keeps it.
pub(super) enum Param<'a> {
    Ptr(*mut c_void),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
    F64(f64),
    /// A `#[repr(C)]` struct the kernel takes by value, borrowed for the
    /// launch (which copies it).
    Struct(*mut c_void, PhantomData<&'a mut ()>),
}

impl Param<'_> {
    /// The address the launch reads the parameter's value from.
    fn addr(&mut self) -> *mut c_void {
        match self {
            Param::Ptr(p) => p as *mut *mut c_void as *mut c_void,
            Param::I32(v) => v as *mut i32 as *mut c_void,
            Param::I64(v) => v as *mut i64 as *mut c_void,
            Param::U64(v) => v as *mut u64 as *mut c_void,
            Param::F32(v) => v as *mut f32 as *mut c_void,
            Param::F64(v) => v as *mut f64 as *mut c_void,
            Param::Struct(p, _) => *p,
        }
    }
}

impl From<&Tensor> for Param<'_> {
    fn from(t: &Tensor) -> Self {
        Param::Ptr(t.data_ptr())
    }
}

impl From<Option<&Tensor>> for Param<'_> {
    fn from(t: Option<&Tensor>) -> Self {
        Param::Ptr(t.map_or(std::ptr::null_mut(), |t| t.data_ptr()))
    }
}

macro_rules! param_by_value {
    ($($t:ty => $v:ident),*) => {$(
        impl From<$t> for Param<'_> {
            fn from(v: $t) -> Self {
                Param::$v(v)
            }
        }
    )*};
}
param_by_value!(i32 => I32, i64 => I64, u64 => U64, f32 => F32, f64 => F64);

impl<'a> From<&'a mut AdamList> for Param<'a> {
    fn from(l: &'a mut AdamList) -> Self {
        Param::Struct(l as *mut AdamList as *mut c_void, PhantomData)
    }
}

impl<'a> From<&'a mut CastList> for Param<'a> {
    fn from(l: &'a mut CastList) -> Self {
        Param::Struct(l as *mut CastList as *mut c_void, PhantomData)
    }
}

/// A launch's parameters, in the kernel's order, each through
/// [`Param::from`]: `params![x, Some(&y), n32]`.
macro_rules! params {
    ($($p:expr),* $(,)?) => {
        &mut [$($crate::kernels::launch::Param::from($p)),*]
    };
}
pub(super) use params;

/// Launches `kernel` on libtorch's current stream ([`stream`]) with
/// `params`: as a programmatic dependent launch where the kernel waits for
/// the one before it and [`dependent_launches`] allows it, else a plain one.
///
/// # Safety
/// `params` must match the kernel's signature in number, order and types
/// (a tensor where it takes a pointer to data of the tensor's kind, which
/// the tensor holds as much of as the kernel reads or writes there);
/// every device pointer among them must stay valid until work queued after
/// the launch on the same stream has run (libtorch's caching allocator
/// keeps a freed tensor's memory from reuse by later work on that stream);
/// the kernel takes at most `grid.smem` bytes of dynamic shared memory,
/// within what it may take (the default limit, or what it was allowed at
/// load).
pub(super) unsafe fn launch(kernel: Kernel, grid: Grid, params: &mut [Param]) -> anyhow::Result<()> {
    // SAFETY: per this function's contract, on libtorch's stream.
    unsafe { launch_on(stream()?, kernel, grid, params) }
}

/// [`launch`] on `stream` instead of libtorch's current stream.
///
/// # Safety
/// As for [`launch`], with `stream` for libtorch's stream: a live stream of
/// the current context, which orders the kernel after the work that
/// produces its inputs and keeps its pointers valid until it has run.
pub(super) unsafe fn launch_on(stream: sys::CUstream, kernel: Kernel, grid: Grid, params: &mut [Param]) -> anyhow::Result<()> {
    let mut args: Vec<*mut c_void> = params.iter_mut().map(Param::addr).collect();
    if !(kernel.waits && dependent_launches()) {
        // SAFETY: per the function's contract; each argument points into
        // `params`, alive for the duration of the call.
        unsafe { result::launch_kernel(kernel.f, grid.blocks, grid.threads, grid.smem, stream, &mut args) }?;
        return Ok(());
    }
    // SAFETY: zeroed launch attributes are plain data; the one used is set.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.blocks.0,
        gridDimY: grid.blocks.1,
        gridDimZ: grid.blocks.2,
        blockDimX: grid.threads.0,
        blockDimY: grid.threads.1,
        blockDimZ: grid.threads.2,
        sharedMemBytes: grid.smem,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: as above; the kernel waits for the one before it (PDL_WAIT at
    // its start: `waits`); config and attr outlive the call.
    unsafe { sys::cuLaunchKernelEx(&config, kernel.f, args.as_mut_ptr(), std::ptr::null_mut()) }.result()?;
    Ok(())
}

/// The stream every launch goes to: libtorch's current one, the legacy
/// default stream where harness runs, or a CUDA graph's capture stream
/// while the training step is captured (on the capturing thread, and on
/// the autograd thread running the captured backward pass).
fn stream() -> anyhow::Result<sys::CUstream> {
    Ok(crate::torch_ext::current_cuda_stream()? as sys::CUstream)
}

/// Whether [`launch`] lets a kernel that waits launch before the one ahead
/// of it on the stream has finished (programmatic dependent launch: the GPU
/// sets it up meanwhile, and its PDL_WAIT holds it until that kernel's
/// writes are visible): on sm_90 and later, unless `HARNESS_PDL=0` (a
/// diagnostic).
fn dependent_launches() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| loaded().is_ok_and(|k| k.major >= 9) && crate::options().pdl)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_parameter_is_read_from_where_its_value_is_held() {
        let t = Tensor::zeros([4], (tch::Kind::Float, tch::Device::Cpu));
        let mut list = CastList {
            w: [std::ptr::null_mut(); ADAM_MAX],
            out: [std::ptr::null_mut(); ADAM_MAX],
            n: [0; ADAM_MAX],
            first_block: [0; ADAM_MAX + 1],
            count: 3,
        };
        let list_at = &mut list as *mut CastList as *mut c_void;
        let ps = params![&t, None::<&Tensor>, 7i32, -8i64, 9u64, 1.5f32, 2.25f64, &mut list];
        let a: Vec<*mut c_void> = ps.iter_mut().map(Param::addr).collect();
        assert_eq!(a[7], list_at, "a list is passed where the caller keeps it");
        // SAFETY: each address points at a value of the type read (the
        // parameters' own, alive in `ps`).
        unsafe {
            assert_eq!(*(a[0] as *const *mut c_void), t.data_ptr());
            assert!((*(a[1] as *const *mut c_void)).is_null());
            assert_eq!(*(a[2] as *const i32), 7);
            assert_eq!(*(a[3] as *const i64), -8);
            assert_eq!(*(a[4] as *const u64), 9);
            assert_eq!(*(a[5] as *const f32), 1.5);
            assert_eq!(*(a[6] as *const f64), 2.25);
        }
    }
}
