//! The native plugin ABI: the C mirror of the WIT contract.
//!
//! `sdk/include/harness_strategy.h` declares the same types and constants for
//! C and C++ authors (a test checks the two agree). A native plugin is a
//! shared library that exports the `harness_*` functions below; the host
//! calls `harness_abi_version` before any other symbol and refuses a library
//! whose version is neither [`ABI_VERSION`] nor [`ABI_VERSION_0_1`] (a
//! library of contract 0.1 loads as it did: its compressor is not told the
//! buckets' layout).
//!
//! Tensors are `u64` handles owned by the host. Every host call goes through
//! one function, [`Host::op`], with an [`Op`] code: the codes map one to one
//! onto the WIT functions (`tensor.add` is [`Op::Add`], ...), plus two that
//! only native plugins get: [`Op::DataPtr`] and [`Op::CudaStream`].
//!
//! Status codes returned by plugin exports and by [`Host::op`]:
//! [`STATUS_OK`], [`STATUS_ERROR`] (message through the matching
//! `last_error`), [`STATUS_PANIC`].

use std::ffi::c_void;

/// The ABI version: `major << 16 | minor` of the contract
/// (`harness:strategy@0.2.0` is 0.2, version 2).
pub const ABI_VERSION: u32 = 2;

/// The ABI version of contract 0.1, which hosts still load: the same
/// symbols, without `harness_compress_setup`.
pub const ABI_VERSION_0_1: u32 = 1;

/// Success.
pub const STATUS_OK: i32 = 0;
/// The call failed; the message is available through `last_error`.
pub const STATUS_ERROR: i32 = 1;
/// The plugin panicked (Rust) or threw (C++); the message is available
/// through `last_error`.
pub const STATUS_PANIC: i32 = 2;

/// Plugin kinds, as `harness_plugin_kind` returns them.
pub const KIND_COMPRESSOR: u32 = 1;
/// A batch-size policy.
pub const KIND_BATCH_POLICY: u32 = 2;
/// A checkpoint policy.
pub const KIND_CHECKPOINT_POLICY: u32 = 3;

/// Element types (the WIT `dtype` enum, in order).
pub const DTYPES: [&str; 8] = ["f32", "f16", "bf16", "f64", "i64", "i32", "u8", "bool"];

/// Host operations. Inputs: `tensors` (`self` first), `floats`, `ints`,
/// `data`; outputs: `tensors`, `scalar`, `ints`, `data`, `ptr` of
/// [`OpResult`].
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum Op {
    // Queries: scalar or ints out.
    /// ints out: the dimensions.
    Shape = 1,
    /// scalar out.
    Numel = 2,
    /// scalar out: index into [`DTYPES`].
    Dtype = 3,
    /// scalar out: 0 CPU, 1 CUDA.
    Device = 4,
    // In place.
    /// tensors `[self, src]`.
    Assign = 5,
    /// tensors `[self]` -> 1 tensor.
    Duplicate = 6,
    // Element-wise: tensors [self, other] -> 1 tensor.
    Add = 7,
    Sub = 8,
    Mul = 9,
    Div = 10,
    /// floats `[s]`.
    AddScalar = 11,
    /// floats `[s]`.
    MulScalar = 12,
    Abs = 13,
    Sign = 14,
    Floor = 15,
    Sqrt = 16,
    LessThan = 17,
    // Shape and type.
    /// ints `[dtype index]`.
    Cast = 18,
    /// ints: the new shape.
    Reshape = 19,
    /// ints `[a, b]`.
    Transpose = 20,
    /// ints `[dim, start, len]`.
    Narrow = 21,
    // Selection.
    /// ints `[k]` -> tensors `[values, indices]`.
    Topk = 22,
    /// tensors `[self, index]`.
    Gather = 23,
    /// tensors `[self, index, src]`.
    ScatterAdd = 24,
    // Reductions and linear algebra.
    /// scalar out.
    Sum = 25,
    /// scalar out.
    Norm = 26,
    /// scalar out.
    MeanAbs = 27,
    /// tensors `[self, other]`.
    Matmul = 28,
    Orthonormalize = 29,
    PackSigns = 30,
    /// data out (metered).
    ReadF32 = 31,
    // Constructors: tensors [like].
    /// ints `[dtype index, dims...]`.
    Zeros = 32,
    /// ints `[seed, dims...]`.
    RandUniform = 33,
    /// ints `[seed, dims...]`.
    RandNormal = 34,
    /// ints `[n, k, seed]`.
    RandIndices = 35,
    /// data in, ints: the shape.
    FromF32 = 36,
    /// tensors `[packed]`, ints `[numel]`.
    UnpackSigns = 37,
    // Collectives.
    /// scalar out.
    Rank = 38,
    /// scalar out.
    WorldSize = 39,
    /// tensors `[t]`, in place.
    AllReduceSum = 40,
    /// tensors `[t]` -> 1 tensor.
    AllGather = 41,
    /// tensors `[t]`, ints `[root]`, in place.
    Broadcast = 42,
    /// tensors `[t]` -> 1 tensor.
    ReduceScatterSum = 43,
    // Native only.
    /// tensors `[t]` -> ptr: the tensor's data (device memory on GPU).
    DataPtr = 44,
    /// ptr: the CUDA stream the host orders its work on (null: legacy
    /// default stream, or CPU).
    CudaStream = 45,
}

impl Op {
    /// Every op, in code order.
    pub const ALL: [Op; 45] = {
        use Op::*;
        [
            Shape,
            Numel,
            Dtype,
            Device,
            Assign,
            Duplicate,
            Add,
            Sub,
            Mul,
            Div,
            AddScalar,
            MulScalar,
            Abs,
            Sign,
            Floor,
            Sqrt,
            LessThan,
            Cast,
            Reshape,
            Transpose,
            Narrow,
            Topk,
            Gather,
            ScatterAdd,
            Sum,
            Norm,
            MeanAbs,
            Matmul,
            Orthonormalize,
            PackSigns,
            ReadF32,
            Zeros,
            RandUniform,
            RandNormal,
            RandIndices,
            FromF32,
            UnpackSigns,
            Rank,
            WorldSize,
            AllReduceSum,
            AllGather,
            Broadcast,
            ReduceScatterSum,
            DataPtr,
            CudaStream,
        ]
    };

    /// The op with this code.
    pub fn from_code(code: u32) -> Option<Op> {
        Op::ALL.get((code as usize).checked_sub(1)?).copied()
    }

    /// The WIT name of the function this op mirrors (for messages).
    pub fn wit_name(self) -> &'static str {
        use Op::*;
        match self {
            Shape => "tensor.shape",
            Numel => "tensor.numel",
            Dtype => "tensor.dtype",
            Device => "tensor.device",
            Assign => "tensor.assign",
            Duplicate => "tensor.duplicate",
            Add => "tensor.add",
            Sub => "tensor.sub",
            Mul => "tensor.mul",
            Div => "tensor.div",
            AddScalar => "tensor.add-scalar",
            MulScalar => "tensor.mul-scalar",
            Abs => "tensor.abs",
            Sign => "tensor.sign",
            Floor => "tensor.floor",
            Sqrt => "tensor.sqrt",
            LessThan => "tensor.less-than",
            Cast => "tensor.cast",
            Reshape => "tensor.reshape",
            Transpose => "tensor.transpose",
            Narrow => "tensor.narrow",
            Topk => "tensor.topk",
            Gather => "tensor.gather",
            ScatterAdd => "tensor.scatter-add",
            Sum => "tensor.sum",
            Norm => "tensor.norm",
            MeanAbs => "tensor.mean-abs",
            Matmul => "tensor.matmul",
            Orthonormalize => "tensor.orthonormalize",
            PackSigns => "tensor.pack-signs",
            ReadF32 => "tensor.read-f32",
            Zeros => "zeros",
            RandUniform => "rand-uniform",
            RandNormal => "rand-normal",
            RandIndices => "rand-indices",
            FromF32 => "from-f32",
            UnpackSigns => "unpack-signs",
            Rank => "collective.rank",
            WorldSize => "collective.world-size",
            AllReduceSum => "collective.all-reduce-sum",
            AllGather => "collective.all-gather",
            Broadcast => "collective.broadcast",
            ReduceScatterSum => "collective.reduce-scatter-sum",
            DataPtr => "data-ptr (native)",
            CudaStream => "cuda-stream (native)",
        }
    }
}

/// Inputs of one [`Host::op`] call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct OpArgs {
    /// Tensor handles, `self` first.
    pub tensors: *const u64,
    /// Number of tensor handles.
    pub n_tensors: usize,
    /// Float arguments.
    pub floats: *const f64,
    /// Number of float arguments.
    pub n_floats: usize,
    /// Integer arguments (dims, shapes, seeds, dtype indices).
    pub ints: *const i64,
    /// Number of integer arguments.
    pub n_ints: usize,
    /// Guest data ([`Op::FromF32`]).
    pub data: *const f32,
    /// Number of floats in `data`.
    pub n_data: usize,
}

/// Outputs of one [`Host::op`] call. `ints` and `data` point into host
/// memory that stays valid until the next call on the same host.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct OpResult {
    /// New tensor handles (0 where none); the plugin owns them and must
    /// release each with [`Host::drop_tensor`].
    pub tensors: [u64; 2],
    /// A scalar result.
    pub scalar: f64,
    /// Integer results ([`Op::Shape`]).
    pub ints: *const i64,
    /// Number of integer results.
    pub n_ints: usize,
    /// Float results ([`Op::ReadF32`]).
    pub data: *const f32,
    /// Number of float results.
    pub n_data: usize,
    /// A pointer result ([`Op::DataPtr`], [`Op::CudaStream`]).
    pub ptr: *mut c_void,
}

impl Default for OpResult {
    fn default() -> Self {
        OpResult {
            tensors: [0; 2],
            scalar: 0.0,
            ints: std::ptr::null(),
            n_ints: 0,
            data: std::ptr::null(),
            n_data: 0,
            ptr: std::ptr::null_mut(),
        }
    }
}

/// What the host lends a native plugin: one table per plugin instance.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Host {
    /// The host's [`ABI_VERSION`].
    pub abi_version: u32,
    /// Passed back to every function below.
    pub ctx: *mut c_void,
    /// Runs one host op; returns a status code.
    pub op: unsafe extern "C" fn(ctx: *mut c_void, op: u32, args: *const OpArgs, out: *mut OpResult) -> i32,
    /// Releases a tensor handle the plugin owns.
    pub drop_tensor: unsafe extern "C" fn(ctx: *mut c_void, t: u64),
    /// The message of the last failed op (UTF-8, not NUL-terminated).
    pub last_error: unsafe extern "C" fn(ctx: *mut c_void, len: *mut usize) -> *const u8,
    /// Writes a log line (level: 0 debug, 1 info, 2 warn).
    pub log: unsafe extern "C" fn(ctx: *mut c_void, level: u32, msg: *const u8, len: usize),
}

/// The WIT `bucket-info`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct BucketInfo {
    /// Step being computed (0-based).
    pub step: u64,
    /// This bucket's index.
    pub index: u32,
    /// Number of buckets.
    pub count: u32,
}

/// The WIT `param-slot` (since ABI 2, contract 0.2): one parameter's
/// gradient in a bucket. Pointers are valid during the call only.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ParamSlot {
    /// The parameter's name (UTF-8, not NUL-terminated).
    pub name: *const u8,
    /// Bytes of `name`.
    pub name_len: usize,
    /// Its dimensions.
    pub shape: *const u64,
    /// Number of dimensions.
    pub ndim: usize,
    /// Offset of its first element in the bucket (elements).
    pub offset: u64,
    /// Its number of elements.
    pub numel: u64,
    /// Element type: an index into [`DTYPES`].
    pub dtype: u32,
    /// 1 for a weight matrix (two or more dimensions), else 0.
    pub weight: u8,
}

/// The WIT `bucket-layout` (since ABI 2).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BucketLayout {
    /// Elements of the bucket.
    pub numel: u64,
    /// Its parameters, by ascending offset.
    pub params: *const ParamSlot,
    /// Number of `params`.
    pub n_params: usize,
}

/// The WIT `batch`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Batch {
    /// Micro-batch size per rank.
    pub micro_batch: u32,
    /// Accumulation steps.
    pub accum_steps: u32,
    /// Multiplier on the scheduled learning rate.
    pub lr_scale: f64,
}

/// The WIT `step-telemetry`; `has_*` say whether the optional field is set.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
#[allow(missing_docs)]
pub struct StepTelemetry {
    pub step: u64,
    pub loss: f64,
    pub step_time_s: f64,
    pub elapsed_s: f64,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub tokens_per_s: f64,
    pub micro_batch: u32,
    pub accum_steps: u32,
    pub world_size: u32,
    pub has_grad_sq_norm: u8,
    pub has_local_grad_sq_norm: u8,
    pub out_of_memory: u8,
    pub grad_sq_norm: f64,
    pub local_grad_sq_norm: f64,
}

/// The WIT `checkpoint-history`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct CheckpointHistory {
    pub has_last_cost_s: u8,
    pub last_cost_s: f64,
    pub saved: *const u64,
    pub n_saved: usize,
    pub failures: *const u64,
    pub n_failures: usize,
    pub since_last_s: f64,
}

/// The WIT `decision`. The host points `delete` at room for `n_saved`
/// steps; the plugin sets `n_delete`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct Decision {
    pub save: u8,
    pub delete_steps: *mut u64,
    pub n_delete: usize,
}

/// The WIT `checkpoint-state` (since contract 0.1.1): the history of
/// contract 0.1.0 and the two tiers' state and costs.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct TieredHistory {
    pub base: CheckpointHistory,
    pub in_memory: *const u64,
    pub n_in_memory: usize,
    pub has_persisting: u8,
    pub persisting: u64,
    pub has_last_stall_s: u8,
    pub last_stall_s: f64,
    pub has_last_persist_s: u8,
    pub last_persist_s: f64,
    pub has_last_slowdown_s: u8,
    pub last_slowdown_s: f64,
}

/// The WIT `tiered-decision` (since contract 0.1.1): `base.save` takes a
/// snapshot into host memory, `persist` also writes it to disk.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct TieredDecision {
    pub base: Decision,
    pub persist: u8,
}

/// The plugin's name and version (UTF-8, valid while the instance lives).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct Info {
    pub name: *const u8,
    pub name_len: usize,
    pub version: *const u8,
    pub version_len: usize,
}

/// Receives the bytes of `harness_plugin_state_save`.
pub type Sink = unsafe extern "C" fn(ctx: *mut c_void, data: *const u8, len: usize);

/// Names of the symbols a native plugin exports (NUL-terminated, for
/// `dlsym`).
pub mod symbols {
    #![allow(missing_docs)]
    pub const ABI_VERSION: &[u8] = b"harness_abi_version\0";
    pub const KIND: &[u8] = b"harness_plugin_kind\0";
    pub const CREATE: &[u8] = b"harness_plugin_create\0";
    pub const DESTROY: &[u8] = b"harness_plugin_destroy\0";
    pub const INFO: &[u8] = b"harness_plugin_info\0";
    pub const CONFIGURE: &[u8] = b"harness_plugin_configure\0";
    pub const LAST_ERROR: &[u8] = b"harness_plugin_last_error\0";
    pub const STATE_SAVE: &[u8] = b"harness_plugin_state_save\0";
    pub const STATE_LOAD: &[u8] = b"harness_plugin_state_load\0";
    pub const COMPRESS: &[u8] = b"harness_compress\0";
    /// Since ABI 2: required of a compressor of that version.
    pub const COMPRESS_SETUP: &[u8] = b"harness_compress_setup\0";
    pub const BATCH_INITIAL: &[u8] = b"harness_batch_initial\0";
    pub const BATCH_NEXT: &[u8] = b"harness_batch_next\0";
    /// Optional: a batch policy without it does not want gradient
    /// statistics.
    pub const BATCH_WANTS_GRADIENT_STATS: &[u8] = b"harness_batch_wants_gradient_stats\0";
    pub const CHECKPOINT_DECIDE: &[u8] = b"harness_checkpoint_decide\0";
    /// Optional (since contract 0.1.1); the host prefers it when present.
    pub const CHECKPOINT_DECIDE_TIERED: &[u8] = b"harness_checkpoint_decide_tiered\0";
}

/// Signatures of the plugin exports.
pub mod exports {
    #![allow(missing_docs)]
    use super::*;
    pub type AbiVersion = unsafe extern "C" fn() -> u32;
    pub type Kind = unsafe extern "C" fn() -> u32;
    /// Returns the instance, or null when it cannot be made.
    pub type Create = unsafe extern "C" fn(host: *const Host) -> *mut c_void;
    pub type Destroy = unsafe extern "C" fn(this: *mut c_void);
    pub type GetInfo = unsafe extern "C" fn(this: *mut c_void, out: *mut Info);
    pub type Configure = unsafe extern "C" fn(this: *mut c_void, toml: *const u8, len: usize) -> i32;
    pub type LastError = unsafe extern "C" fn(this: *mut c_void, len: *mut usize) -> *const u8;
    pub type StateSave = unsafe extern "C" fn(this: *mut c_void, sink: Sink, sink_ctx: *mut c_void) -> i32;
    pub type StateLoad = unsafe extern "C" fn(this: *mut c_void, data: *const u8, len: usize) -> i32;
    pub type Compress = unsafe extern "C" fn(this: *mut c_void, bucket: u64, info: *const BucketInfo) -> i32;
    /// The layout of every bucket, `n` of them (since ABI 2).
    pub type CompressSetup = unsafe extern "C" fn(this: *mut c_void, buckets: *const BucketLayout, n: usize) -> i32;
    pub type BatchInitial = unsafe extern "C" fn(this: *mut c_void, configured: *const Batch, out: *mut Batch) -> i32;
    pub type BatchNext = unsafe extern "C" fn(this: *mut c_void, t: *const StepTelemetry, out: *mut Batch) -> i32;
    /// Sets `*out` to 1 when the policy wants gradient statistics, else 0.
    pub type BatchWantsGradientStats = unsafe extern "C" fn(this: *mut c_void, out: *mut u8) -> i32;
    pub type CheckpointDecide =
        unsafe extern "C" fn(this: *mut c_void, t: *const StepTelemetry, h: *const CheckpointHistory, out: *mut Decision) -> i32;
    pub type CheckpointDecideTiered =
        unsafe extern "C" fn(this: *mut c_void, t: *const StepTelemetry, h: *const TieredHistory, out: *mut TieredDecision) -> i32;
}
