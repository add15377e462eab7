//! Plain data of the contract: what the host passes to callbacks and what
//! policies return.

/// Element types of host tensors (WIT `dtype`; the order is the native ABI's
/// dtype index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    Bf16,
    /// 64-bit float.
    F64,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// 8-bit unsigned integer.
    U8,
    /// Boolean.
    Bool,
}

impl Dtype {
    /// Every dtype, in index order.
    pub const ALL: [Dtype; 8] = [Dtype::F32, Dtype::F16, Dtype::Bf16, Dtype::F64, Dtype::I64, Dtype::I32, Dtype::U8, Dtype::Bool];

    /// The index in the native ABI (`HARNESS_DTYPE_*`, [`crate::abi::DTYPES`]).
    pub fn index(self) -> u32 {
        self as u32
    }

    /// The dtype with this native ABI index.
    pub fn from_index(index: u32) -> Option<Dtype> {
        Dtype::ALL.get(index as usize).copied()
    }

    /// Its name in [`crate::abi::DTYPES`] (`"f32"`, ..., `"bool"`).
    pub fn name(self) -> &'static str {
        crate::abi::DTYPES[self as usize]
    }
}

/// Where a tensor lives (WIT `device-kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// A CUDA device.
    Cuda,
}

/// One parameter's gradient in a bucket (WIT `param-slot`, contract 0.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSlot {
    /// The parameter's name in the model, e.g. `h.3.attn.qkv.weight`.
    pub name: String,
    /// Its dimensions.
    pub shape: Vec<u64>,
    /// Offset of its first element in the bucket (elements).
    pub offset: u64,
    /// Its number of elements: the product of `shape`.
    pub numel: u64,
    /// Element type of its gradient (the bucket's).
    pub dtype: Dtype,
    /// A weight matrix: two or more dimensions (a convolution's kernel
    /// counts, as `shape[0]` rows by the rest); false for biases, norms'
    /// gains and other 1-D tensors.
    pub weight: bool,
}

impl ParamSlot {
    /// The matrix PowerSGD views it as: `shape[0]` rows by the rest
    /// (`[numel, 1]` for a 1-D tensor).
    pub fn matrix(&self) -> (u64, u64) {
        let rows = self.shape.first().copied().unwrap_or(1).max(1);
        (rows, self.numel / rows)
    }
}

/// What a gradient bucket holds (WIT `bucket-layout`): given once, to
/// [`crate::Compressor::setup`], and indexed by [`BucketInfo::index`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BucketLayout {
    /// Elements of the bucket (the tensor `compress` gets is 1-D of this
    /// many). Elements that belong to no parameter are zero.
    pub numel: u64,
    /// Its parameters, by ascending offset.
    pub params: Vec<ParamSlot>,
}

/// Where a gradient bucket sits in the step (WIT `bucket-info`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BucketInfo {
    /// Step being computed (0-based).
    pub step: u64,
    /// This bucket's index.
    pub index: u32,
    /// Number of buckets.
    pub count: u32,
}

/// A batch decision (WIT `batch`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Batch {
    /// Micro-batch size per rank (1 ..= 65536; larger batches than fit run out of memory, which the host catches and retries smaller).
    pub micro_batch: u32,
    /// Micro-batches accumulated per optimizer step (>= 1).
    pub accum_steps: u32,
    /// Multiplier on the schedule's learning rate (finite, > 0).
    pub lr_scale: f64,
}

/// What the host tells policies after each optimizer step (WIT
/// `step-telemetry`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Telemetry {
    /// Steps completed (the first call sees 1).
    pub step: u64,
    /// Training loss of the latest step whose loss has been read back (NaN
    /// before the first one).
    pub loss: f64,
    /// Wall time of the last step, seconds.
    pub step_time_s: f64,
    /// Seconds since training started (evaluation excluded).
    pub elapsed_s: f64,
    /// Device memory used, bytes: on CUDA the peak allocated during the last
    /// step (what a larger batch must fit); on CPU the resident set.
    pub memory_used_bytes: u64,
    /// Device memory in total (CPU: physical memory), bytes.
    pub memory_total_bytes: u64,
    /// Training throughput since warm-up, tokens (or samples) per second.
    pub tokens_per_s: f64,
    /// Micro-batch size per rank of the last step.
    pub micro_batch: u32,
    /// Accumulation steps of the last step.
    pub accum_steps: u32,
    /// Number of ranks.
    pub world_size: u32,
    /// Squared L2 norm of the averaged gradient of the last step, when the
    /// host computed it.
    pub grad_sq_norm: Option<f64>,
    /// Mean over ranks of the squared L2 norm of each rank's own gradient
    /// before averaging, when the host computed it.
    pub local_grad_sq_norm: Option<f64>,
    /// True when the last step ran out of memory and was retried with a
    /// smaller batch.
    pub out_of_memory: bool,
}

/// What the host knows about checkpoints and failures so far (WIT
/// `checkpoint-history`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CheckpointHistory {
    /// What the last checkpoint cost training, seconds, as the host measured
    /// it: its stall plus the slowdown of the steps that overlapped its copy
    /// and persist so far (a synchronous checkpoint: the whole write).
    pub last_cost_s: Option<f64>,
    /// Steps of the checkpoints on disk (durable), oldest first.
    pub saved: Vec<u64>,
    /// Steps at which failures happened.
    pub failures: Vec<u64>,
    /// Seconds since the last checkpoint of either tier (or since the start).
    pub since_last_s: f64,
    /// Steps of the snapshots held in host memory. @since 0.1.1 (empty
    /// from hosts of 0.1.0).
    pub in_memory: Vec<u64>,
    /// The step whose snapshot is being persisted. @since 0.1.1
    pub persisting: Option<u64>,
    /// Seconds training stopped for the last snapshot. @since 0.1.1
    pub last_stall_s: Option<f64>,
    /// Seconds the last completed persist took, until durable. @since 0.1.1
    pub last_persist_s: Option<f64>,
    /// Extra seconds of the steps that overlapped the last checkpoint's copy
    /// and persist, over steps that overlapped none. @since 0.1.1
    pub last_slowdown_s: Option<f64>,
}

/// A checkpoint decision (WIT `decision`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Decision {
    /// Take a checkpoint of the current step now: a snapshot into host
    /// memory (training waits for it).
    pub save: bool,
    /// With `save`, also persist the snapshot to disk (in the background).
    /// `false` keeps it in host memory only. @since 0.1.1 (hosts of 0.1.0
    /// persist every checkpoint).
    pub persist: bool,
    /// Steps of saved checkpoints to delete (each must be in
    /// [`CheckpointHistory::saved`]).
    pub delete: Vec<u64>,
}

impl Decision {
    /// Neither save nor delete.
    pub fn none() -> Decision {
        Decision::default()
    }

    /// Save now, to host memory and disk; delete nothing.
    pub fn save() -> Decision {
        Decision { save: true, persist: true, delete: Vec::new() }
    }

    /// A snapshot into host memory only; delete nothing. @since 0.1.1
    pub fn snapshot() -> Decision {
        Decision { save: true, persist: false, delete: Vec::new() }
    }
}

/// Severity (WIT `log.level`; native ABI: 0, 1, 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Details for debugging.
    Debug,
    /// Normal messages.
    Info,
    /// Something looks wrong.
    Warn,
}
