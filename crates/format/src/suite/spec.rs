//! The serde types of the suite format (`docs/suite-format.md`): what a
//! suite file says, as written, with the defaults of the keys it leaves out.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A parsed suite file, as written.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SuiteSpec {
    /// Suite-wide settings.
    pub suite: SuiteMeta,
    /// What is trained.
    #[serde(rename = "workload")]
    pub workloads: Vec<Workload>,
    /// How it is trained (crossed with every workload it applies to).
    #[serde(rename = "strategy", default)]
    pub strategies: Vec<Strategy>,
    /// Plugins the strategies may name (`[[plugin]]`).
    #[serde(rename = "plugin", default)]
    pub plugins: Vec<PluginSpec>,
    /// A standard suite's tracks (`[[track]]`): which workloads and
    /// reference strategies a submission of each strategy kind runs with.
    #[serde(rename = "track", default)]
    pub tracks: Vec<Track>,
    /// Clusters `harness report` projects the suite's strategies on
    /// (`[projection]`; docs/projection.md): a model's answer, shown apart
    /// from the measured rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub projection: Option<ProjectionSpec>,
}

/// The `[projection]` table: the clusters to project on, in the form of
/// `harness project --cluster` (`NODESxGPUS[:key=value,...]`), and the
/// strategies to project (all when left out).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProjectionSpec {
    pub clusters: Vec<String>,
    #[serde(default)]
    pub strategies: Vec<String>,
}

/// One `[[track]]` of a standard suite: a strategy kind that submissions
/// enter, the workloads chosen so that kind matters, the baseline every
/// submission is scored against and the other reference strategies that
/// run beside it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Track {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    /// The kind of plugin a submission to this track is:
    /// "compressor", "batch-policy" or "checkpoint-policy".
    pub kind: String,
    /// The track's workloads (names of `[[workload]]`s).
    pub workloads: Vec<String>,
    /// The strategy every entry of the track is scored against.
    pub baseline: String,
    /// Other reference strategies run in the track.
    #[serde(default)]
    pub strategies: Vec<String>,
    /// The fewest GPUs (ranks) the track runs with: a compression track
    /// needs 2. With fewer, `harness run` leaves the track out.
    #[serde(default = "one")]
    pub min_gpus: u32,
}

/// The hardware a standard suite is for (`[suite.hardware]`). A CPU class
/// has `gpu = ""` and counts thread ranks in `gpus`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    /// The hardware class, e.g. "h200".
    pub class: String,
    /// What the GPU's name must contain, e.g. "H200".
    pub gpu: String,
    /// The GPU's memory, GiB.
    pub memory_gib: f64,
    /// The GPU counts (divisions) the suite is defined for.
    pub gpus: Vec<u32>,
}

/// One `[[plugin]]`: a strategy plugin artifact, and optionally its pinned
/// manifest fields (`harness plugin inspect` prints them).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSpec {
    /// The name strategies use for it.
    pub name: String,
    /// The artifact, relative to the suite file: a `.wasm` component, or a
    /// native shared library (`.so`, `.dylib`).
    pub path: PathBuf,
    /// Pinned sha256 of the artifact (hex).
    #[serde(default)]
    pub sha256: Option<String>,
    /// Pinned plugin version (what the plugin reports).
    #[serde(default)]
    pub version: Option<String>,
    /// Pinned kind: "compressor", "batch-policy" or "checkpoint-policy".
    #[serde(default)]
    pub kind: Option<String>,
    /// WASM only: memory cap of each instance, MiB.
    #[serde(default = "default_plugin_memory_mb")]
    pub memory_mb: u32,
    /// WASM only: deadline of each call, milliseconds.
    #[serde(default = "default_plugin_deadline_ms")]
    pub deadline_ms: u64,
    /// Most host tensor memory one instance may hold, MiB.
    #[serde(default = "default_plugin_tensor_mb")]
    pub tensor_mb: u64,
}

fn default_plugin_memory_mb() -> u32 {
    256
}
fn default_plugin_deadline_ms() -> u64 {
    10_000
}
fn default_plugin_tensor_mb() -> u64 {
    8192
}

/// The `[suite]` table.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SuiteMeta {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub device: DeviceKind,
    #[serde(default = "one")]
    pub world_size: u32,
    #[serde(default = "one")]
    pub repeats: u32,
    #[serde(default)]
    pub seed: u64,
    /// The order of the strategies within each workload of a repeat.
    #[serde(default)]
    pub order: Order,
    /// Steps at the start of each entry left out of latency and throughput.
    #[serde(default = "default_warmup")]
    pub warmup_steps: u64,
    /// Peak dense TFLOP/s used for MFU when the device is not in the table.
    #[serde(default)]
    pub peak_tflops: Option<f64>,
    /// CPU threads for libtorch's intra-op pool (default: all cores).
    #[serde(default)]
    pub threads: Option<u32>,
    /// Gradient bucket size for data parallelism, MiB; none: harness's
    /// choice for the model (`DataParallel::auto_bucket_bytes`: about 24
    /// buckets, at least PyTorch DDP's 25 MiB).
    #[serde(default)]
    pub bucket_mb: Option<f64>,
    /// A collective not finished within this many seconds fails the entry.
    #[serde(default = "default_collective_timeout")]
    pub collective_timeout_s: f64,
    /// A standard suite's version (docs/rules.md); results of a suite
    /// byte-identical to a released version are official.
    #[serde(default)]
    pub version: Option<String>,
    /// The hardware a standard suite is for.
    #[serde(default)]
    pub hardware: Option<Hardware>,
}

fn default_collective_timeout() -> f64 {
    60.0
}

fn one() -> u32 {
    1
}
fn default_warmup() -> u64 {
    3
}

/// The order in which a repeat runs its strategies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    /// As listed, in every repeat.
    #[default]
    Listed,
    /// Repeat r starts at the (r mod n)-th of the n strategies and wraps
    /// around: over a multiple of n repeats each strategy runs in each
    /// position equally often, so a machine that drifts (warms up, throttles,
    /// gets a noisy neighbour) during a repeat favours none of them.
    Rotate,
}

/// Where the training samples of `images` and `regression` data are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pipeline {
    /// On host threads (for images, augmentation on the CPU; batches
    /// collated ahead into pinned memory): the input pipeline of a real
    /// training job.
    Host,
    /// By tensor ops on the training device, no CPU work but the
    /// per-sample draws: for throughput runs.
    Device,
}

/// Where a suite runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// CUDA when a GPU is usable, else CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// One `[[workload]]`: model, data and training recipe.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub name: String,
    pub model: ModelSpec,
    pub data: DataSpec,
    /// Micro-batch size per rank, in sequences (samples).
    pub batch: u32,
    /// Tokens per sequence (for the encoder: positions per sample).
    pub seq_len: u32,
    #[serde(default = "one")]
    pub grad_accum: u32,
    /// Optimizer steps to run; with `time_budget_s` too, whichever ends first.
    #[serde(default)]
    pub steps: Option<u64>,
    #[serde(default)]
    pub time_budget_s: Option<f64>,
    #[serde(default)]
    pub precision: Precision,
    /// Activation recomputation: `"none"` (default), `"all"` layers, or
    /// every k-th layer (`k`, an integer). Changes memory and speed, not
    /// the maths.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute: Option<RecomputeSpec>,
    /// Which code computes the layers on CUDA: `"fused"` (default),
    /// harness's own fused kernels where a layer has one, or `"libtorch"`,
    /// libtorch's operations throughout. The same maths either way.
    #[serde(default, skip_serializing_if = "Kernels::is_fused")]
    pub kernels: Kernels,
    /// On CUDA, whether cuDNN times its convolution algorithms for each new
    /// input shape and keeps the fastest (`true`, as
    /// `torch.backends.cudnn.benchmark = True`), or takes its heuristics'
    /// choice (`false`, the default: timing costs seconds at every new
    /// batch size, which a batch policy meets). Only convolutions (the
    /// ResNets) are affected.
    #[serde(default, skip_serializing_if = "is_false")]
    pub cudnn_benchmark: bool,
    /// On one GPU, whether the training step is captured as a CUDA graph
    /// and replayed (`true`, where the step qualifies: docs/suite-format.md
    /// says when), or runs eagerly, every operation launched from the host
    /// (`false`, the default). The same maths either way. Entries that are
    /// compared should run the same way: results record the replayed steps.
    #[serde(default, skip_serializing_if = "is_false")]
    pub cuda_graph: bool,
    pub optimizer: OptimizerSpec,
    #[serde(default)]
    pub schedule: ScheduleSpec,
    /// Clip the global gradient norm to this value.
    #[serde(default)]
    pub grad_clip: Option<f64>,
    /// Evaluate every this many steps (0: only at the end).
    #[serde(default)]
    pub eval_every: u64,
    /// Evaluate whenever this many more tokens (all ranks together) have
    /// been trained, whatever the batch: entries whose batch policies pick
    /// different batches are evaluated at the same amounts of data. Not
    /// with `eval_every`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_every_tokens: Option<u64>,
    #[serde(default = "default_eval_batches")]
    pub eval_batches: u32,
    /// Absolute target for the eval loss.
    #[serde(default)]
    pub target_loss: Option<f64>,
    /// Target as a margin above the data's known loss floor.
    #[serde(default)]
    pub target_above_floor: Option<f64>,
    /// Classification: target for the eval top-1 accuracy (in (0, 1]),
    /// instead of a loss target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_accuracy: Option<f64>,
    /// End the entry at the first evaluation that reaches the target, as
    /// time-to-target benchmarks do; `steps` (or `time_budget_s`) is then
    /// the most it may train.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stop_at_target: bool,
    /// Injected failures and an emulated memory limit, to score checkpoint
    /// and batch-size policies.
    #[serde(default)]
    pub faults: Option<FaultSpec>,
}

/// `faults = { at_steps = [30, 70] }`, `faults = { mtbf_s = 20, seed = 1 }`,
/// `faults = { oom_above_batch = 48 }`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    /// A failure strikes when training reaches each of these steps (steps
    /// completed), once each: the work since the last checkpoint is lost.
    #[serde(default)]
    pub at_steps: Vec<u64>,
    /// Failures at random, exponentially distributed with this mean time
    /// between failures in seconds of training time (seeded).
    #[serde(default)]
    pub mtbf_s: Option<f64>,
    /// Seed of the random failures (default: the entry's seed).
    #[serde(default)]
    pub seed: Option<u64>,
    /// Emulated device memory: a step whose micro-batch exceeds this runs
    /// out of memory (as a real out-of-memory error would be handled).
    #[serde(default)]
    pub oom_above_batch: Option<u32>,
    /// The share of failures (0 to 1, drawn with the failures' seed) that
    /// also lose the checkpoints held in host memory, as losing a node
    /// would: those restore from disk. Default 0: the host-memory tier
    /// survives a failure of training.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lose_memory: Option<f64>,
    /// The restart budget: the failure after this many restarts ends the
    /// entry, failed, instead of restarting it (default
    /// [`DEFAULT_MAX_RESTARTS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_restarts: Option<u64>,
    /// The time-lost budget: a failure that brings the time failures cost
    /// (work lost and restores) above this many times the entry's
    /// failure-free training time ends the entry, failed, instead of
    /// restarting it (default [`DEFAULT_MAX_TIME_LOST_RATIO`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_time_lost_ratio: Option<f64>,
}

/// `faults.max_restarts` when left out. The failure workloads of the
/// shipped suites restart a handful of times (three before the target in
/// the standard suites' `gpt2-124m-failures`, a few in 200 steps of GPT-2
/// at `mtbf_s = 8`); a thousand is far above any run that measures
/// something, and a tiny MLP failing at every step (steps of 0.4 ms, one
/// CPU core) reaches it in 1.8 s of training.
pub const DEFAULT_MAX_RESTARTS: u64 = 1000;

/// `faults.max_time_lost_ratio` when left out: failures may cost ten times
/// the entry's failure-free training time, a goodput of 1/11. Starting over
/// three times without checkpoints (the standard suites' baseline) costs at
/// most three.
pub const DEFAULT_MAX_TIME_LOST_RATIO: f64 = 10.0;

impl FaultSpec {
    /// The restart budget in force.
    pub fn max_restarts(&self) -> u64 {
        self.max_restarts.unwrap_or(DEFAULT_MAX_RESTARTS)
    }

    /// The time-lost budget in force, as a multiple of the entry's
    /// failure-free training time.
    pub fn max_time_lost_ratio(&self) -> f64 {
        self.max_time_lost_ratio.unwrap_or(DEFAULT_MAX_TIME_LOST_RATIO)
    }
}

fn default_eval_batches() -> u32 {
    8
}

/// `model = { kind = "gpt", preset = "tiny" }`; explicit sizes override the preset.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub kind: ModelKind,
    #[serde(default)]
    pub preset: Option<String>,
    #[serde(default)]
    pub n_layer: Option<u32>,
    #[serde(default)]
    pub n_head: Option<u32>,
    #[serde(default)]
    pub d_model: Option<u32>,
    #[serde(default)]
    pub d_ff: Option<u32>,
    #[serde(default)]
    pub dropout: Option<f64>,
}

/// The model families of the training core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// Decoder-only transformer (GPT-2 style, tied embedding).
    Gpt,
    /// `nn.TransformerEncoder` layers with a mean-pool regression head (preset
    /// `claims5`: the TransformerEncoder regression of docs/benchmarks.md).
    Encoder,
    /// Token MLP: embedding, one hidden layer, logits of the next token.
    Mlp,
    /// Image classifier (ResNet), on `images` data.
    Vision,
    /// T5's encoder–decoder (v1.0), trained with teacher forcing on
    /// sequence pairs (`pairs` data).
    T5,
}

/// Where batches come from.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum DataSpec {
    /// Seeded Markov-chain tokens whose entropy rate (the loss floor) is known.
    Synthetic {
        vocab: u32,
        #[serde(default = "default_branching")]
        branching: u32,
        #[serde(default)]
        seed: Option<u64>,
    },
    /// Token files in the llm.c / nanoGPT `.bin` format (u16 tokens).
    Bin {
        train: PathBuf,
        #[serde(default)]
        val: Option<PathBuf>,
        /// Fraction of `train` held out for eval when `val` is not given.
        #[serde(default = "default_val_fraction")]
        val_fraction: f64,
        /// Model vocabulary (default 50304, GPT-2's rounded up).
        #[serde(default)]
        vocab: Option<u32>,
    },
    /// Gaussian inputs, targets a fixed linear map of them plus noise of known
    /// variance (the MSE floor).
    Regression {
        #[serde(default = "default_noise")]
        noise: f64,
        /// Where training inputs are drawn (default: on the device when
        /// training on a GPU, else on the host).
        #[serde(default)]
        pipeline: Option<Pipeline>,
        #[serde(default)]
        seed: Option<u64>,
    },
    /// Class-conditional images: a seeded smooth prototype per class plus
    /// Gaussian pixel noise, labels flipped to another class with
    /// probability `label_noise` (the floor is that noise's entropy).
    Images {
        #[serde(default = "default_classes")]
        classes: u32,
        /// Height and width, pixels.
        #[serde(default = "default_image_size")]
        image_size: u32,
        #[serde(default = "default_channels")]
        channels: u32,
        /// Standard deviation of the pixel noise.
        #[serde(default = "default_pixel_noise")]
        noise: f64,
        #[serde(default = "default_label_noise")]
        label_noise: f64,
        /// Training augmentation: random crop with `padding`, horizontal flip.
        #[serde(default = "default_true")]
        augment: bool,
        #[serde(default = "default_padding")]
        padding: u32,
        /// Threads making (and augmenting) samples (default: a quarter of
        /// the cores, 1 to 4).
        #[serde(default)]
        threads: Option<u32>,
        /// Where training images are made (default: on the device when
        /// training on a GPU and `threads` is not set, else on the host).
        #[serde(default)]
        pipeline: Option<Pipeline>,
        #[serde(default)]
        seed: Option<u64>,
    },
    /// Sequence pairs for the `t5` model: a seeded word-for-word translation
    /// of uniform source tokens, each target word replaced by a random one
    /// with probability `noise` (the floor is that noise's entropy; `noise =
    /// 1` gives random targets).
    Pairs {
        vocab: u32,
        #[serde(default = "default_noise")]
        noise: f64,
        #[serde(default)]
        seed: Option<u64>,
    },
}

/// The vocabulary of token files that do not give one: GPT-2's rounded up
/// to a multiple of 64 (nanoGPT's choice).
pub const DEFAULT_BIN_VOCAB: u32 = 50304;

impl DataSpec {
    /// The token vocabulary the data implies, or the classes of images
    /// (None for regression data).
    pub fn vocab(&self) -> Option<u32> {
        match self {
            DataSpec::Synthetic { vocab, .. } => Some(*vocab),
            DataSpec::Bin { vocab, .. } => Some(vocab.unwrap_or(DEFAULT_BIN_VOCAB)),
            DataSpec::Regression { .. } => None,
            // A classifier's outputs are its classes.
            DataSpec::Images { classes, .. } => Some(*classes),
            DataSpec::Pairs { vocab, .. } => Some(*vocab),
        }
    }
}

fn default_branching() -> u32 {
    4
}
fn default_val_fraction() -> f64 {
    0.05
}
fn default_noise() -> f64 {
    0.1
}
fn default_classes() -> u32 {
    10
}
fn default_image_size() -> u32 {
    32
}
fn default_channels() -> u32 {
    3
}
fn default_pixel_noise() -> f64 {
    0.5
}
fn default_label_noise() -> f64 {
    0.1
}
fn default_padding() -> u32 {
    4
}

/// `recompute` as written: a name or a layer interval.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum RecomputeSpec {
    Name(String),
    Every(i64),
}

/// Which layers drop their activations in the forward pass and compute
/// them again in the backward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Recompute {
    #[default]
    None,
    /// Layers 0, k, 2k, ... (`Every(1)`: all of them).
    Every(u32),
}

impl RecomputeSpec {
    /// The setting, or what is wrong with it.
    pub fn resolve(&self) -> Result<Recompute, String> {
        match self {
            RecomputeSpec::Name(n) if n == "none" => Ok(Recompute::None),
            RecomputeSpec::Name(n) if n == "all" => Ok(Recompute::Every(1)),
            RecomputeSpec::Name(n) => {
                Err(format!("`recompute = \"{n}\"` is not a setting: \"none\", \"all\" or an integer k (every k-th layer)"))
            }
            RecomputeSpec::Every(k) if (1..=u32::MAX as i64).contains(k) => Ok(Recompute::Every(*k as u32)),
            RecomputeSpec::Every(k) => Err(format!("`recompute = {k}`: every k-th layer needs k >= 1")),
        }
    }
}

impl Recompute {
    /// As a suite writes it: `"none"`, `"all"` or k.
    pub fn to_value(self) -> serde_json::Value {
        match self {
            Recompute::None => "none".into(),
            Recompute::Every(1) => "all".into(),
            Recompute::Every(k) => k.into(),
        }
    }

    /// Whether layer `i` (from 0) is recomputed.
    pub fn layer(self, i: usize) -> bool {
        match self {
            Recompute::None => false,
            Recompute::Every(k) => i % k as usize == 0,
        }
    }
}

impl Workload {
    /// The workload's activation recomputation (validated: errors here
    /// cannot happen in a validated suite).
    pub fn recompute(&self) -> anyhow::Result<Recompute> {
        self.recompute.as_ref().map_or(Ok(Recompute::None), |r| r.resolve().map_err(anyhow::Error::msg))
    }
}

/// `kernels = "fused" | "libtorch"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kernels {
    /// harness's fused kernels (bf16 on CUDA): the fused cross-entropy and
    /// residual add + LayerNorm; libtorch's operations for the rest.
    #[default]
    Fused,
    /// libtorch's operations only (the reference the fused kernels match).
    Libtorch,
}

impl Kernels {
    fn is_fused(&self) -> bool {
        *self == Kernels::Fused
    }
}

/// Arithmetic precision of the step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    Fp32,
    /// bf16 autocast, fp32 master weights.
    Bf16,
    /// fp16 autocast with dynamic loss scaling.
    Fp16,
}

/// `optimizer = { kind = "adamw", lr = 6e-4, ... }`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum OptimizerSpec {
    Adamw {
        lr: f64,
        #[serde(default = "default_betas")]
        betas: [f64; 2],
        #[serde(default = "default_eps")]
        eps: f64,
        #[serde(default)]
        weight_decay: f64,
    },
    Sgd {
        lr: f64,
        #[serde(default)]
        momentum: f64,
        #[serde(default)]
        nesterov: bool,
        #[serde(default)]
        weight_decay: f64,
    },
}

fn default_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn default_eps() -> f64 {
    1e-8
}

impl OptimizerSpec {
    /// Peak learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerSpec::Adamw { lr, .. } | OptimizerSpec::Sgd { lr, .. } => *lr,
        }
    }
}

/// Learning-rate schedule: linear warm-up, then a decay to `min_lr_ratio`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSpec {
    #[serde(default)]
    pub warmup_steps: u64,
    #[serde(default)]
    pub decay: Decay,
    #[serde(default = "default_min_lr_ratio")]
    pub min_lr_ratio: f64,
}

impl Default for ScheduleSpec {
    fn default() -> Self {
        ScheduleSpec { warmup_steps: 0, decay: Decay::Constant, min_lr_ratio: default_min_lr_ratio() }
    }
}

fn default_min_lr_ratio() -> f64 {
    0.1
}

/// Shape of the decay after warm-up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Decay {
    #[default]
    Constant,
    Cosine,
    Linear,
}

/// One `[[strategy]]`: the strategy settings an entry trains with.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Strategy {
    pub name: String,
    /// The entry others are compared with (at most one per suite).
    #[serde(default)]
    pub baseline: bool,
    #[serde(default = "default_compressor")]
    pub compressor: String,
    #[serde(default = "default_batch_policy")]
    pub batch_policy: String,
    #[serde(default = "default_checkpoint")]
    pub checkpoint: String,
    /// Configuration handed to the compressor plugin's `configure`.
    #[serde(default)]
    pub compressor_config: Option<toml::Table>,
    /// Configuration handed to the batch-policy plugin's `configure`.
    #[serde(default)]
    pub batch_policy_config: Option<toml::Table>,
    /// Configuration handed to the checkpoint-policy plugin's `configure`.
    #[serde(default)]
    pub checkpoint_config: Option<toml::Table>,
    /// Workloads this strategy applies to (default: all).
    #[serde(default)]
    pub workloads: Option<Vec<String>>,
    /// Emulated link between ranks: collectives are stretched to what a
    /// ring over it would take.
    #[serde(default)]
    pub link: Option<crate::link::Link>,
    /// ZeRO stage with more than one rank: 0 (plain data parallelism), 1
    /// (optimizer state sharded) or 2 (optimizer state and reduced gradients
    /// sharded).
    #[serde(default)]
    pub zero: u8,
    /// Compress checkpoints (zstd) when the checkpoint policy saves.
    #[serde(default)]
    pub checkpoint_compress: bool,
    /// Checkpoints in two tiers (the default): training stops only to copy
    /// its state into preallocated host memory, the newest copy stays there
    /// for restores, and a background writer persists it to disk. `false`:
    /// the earlier path, where training waits until the checkpoint is on
    /// disk and every restore reads it back from there.
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub checkpoint_async: bool,
    /// NCCL's environment for this strategy's entries (`NCCL_ALGO`,
    /// `NCCL_PROTO`, `NCCL_MAX_NCHANNELS`, socket and IB options...): the
    /// rank processes of these entries start with it, since NCCL reads its
    /// settings once per process.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub nccl: std::collections::BTreeMap<String, toml::Value>,
    /// Which of NCCL's transports the ranks of one machine may use.
    #[serde(default, skip_serializing_if = "NcclTransport::is_auto")]
    pub nccl_transport: NcclTransport,
    /// The type the built-in all-reduce averages the gradients in: `fp32`,
    /// theirs, or `bf16`, half the bytes on the wire and the average
    /// rounded to bf16 (FSDP's mixed-precision `reduce_dtype`). Changes the
    /// numerics, hence a key of the strategy, recorded with it.
    #[serde(default, skip_serializing_if = "ReduceDtype::is_fp32")]
    pub reduce_dtype: ReduceDtype,
}

/// `reduce_dtype`: the gradients' own fp32, or bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceDtype {
    #[default]
    Fp32,
    Bf16,
}

impl ReduceDtype {
    fn is_fp32(&self) -> bool {
        *self == ReduceDtype::Fp32
    }
}

/// `nccl_transport`: NCCL's own choice, or the network transport forced
/// between the ranks of one machine (as between two machines).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NcclTransport {
    /// NCCL picks (NVLink/P2P, shared memory, network).
    #[default]
    Auto,
    /// Peer-to-peer, shared memory and NVLink SHARP off: every byte goes
    /// through NCCL's network transport (IB where present, else sockets).
    Network,
}

impl NcclTransport {
    fn is_auto(&self) -> bool {
        *self == NcclTransport::Auto
    }

    /// The NCCL settings that impose this choice.
    pub fn env(self) -> &'static [(&'static str, &'static str)] {
        match self {
            NcclTransport::Auto => &[],
            NcclTransport::Network => &[("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"), ("NCCL_NVLS_ENABLE", "0")],
        }
    }
}

/// NCCL settings harness sets itself to see which transports NCCL chose.
pub const NCCL_RESERVED: &[&str] = &["NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS"];

impl Strategy {
    /// The NCCL environment this strategy's entries run with: its
    /// `nccl_transport`'s settings, then its `nccl` table (which wins).
    pub fn nccl_env(&self) -> std::collections::BTreeMap<String, String> {
        let mut env: std::collections::BTreeMap<String, String> =
            self.nccl_transport.env().iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        for (k, v) in &self.nccl {
            let v = match v {
                toml::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            env.insert(k.clone(), v);
        }
        env
    }

    /// Whether, by what the strategy says, several ranks may gather on the
    /// copy engines by default: without ZeRO the averaged gradients
    /// (`HARNESS_CE_GATHER` unset), under ZeRO the updated parameters
    /// (`HARNESS_ZERO_PREFETCH`); the built-in average in fp32, NCCL's own
    /// transport, no emulated link. The ranks then also need NCCL's
    /// zero-CTA policy (harness sets it for a group of such entries) and
    /// GPUs that reach each other's memory.
    pub fn copy_engine_gather_candidate(&self) -> bool {
        self.compressor == "allreduce"
            && self.reduce_dtype == ReduceDtype::Fp32
            && self.nccl_transport == NcclTransport::Auto
            && self.link.is_none()
    }
}

fn default_compressor() -> String {
    "allreduce".into()
}
fn default_batch_policy() -> String {
    "fixed".into()
}
fn default_checkpoint() -> String {
    "none".into()
}

impl Strategy {
    /// The strategy used when a suite lists none.
    pub fn default_baseline() -> Self {
        Strategy {
            name: "baseline".into(),
            baseline: true,
            compressor: default_compressor(),
            batch_policy: default_batch_policy(),
            checkpoint: default_checkpoint(),
            compressor_config: None,
            batch_policy_config: None,
            checkpoint_config: None,
            workloads: None,
            link: None,
            zero: 0,
            checkpoint_compress: false,
            checkpoint_async: true,
            nccl: Default::default(),
            nccl_transport: NcclTransport::Auto,
            reduce_dtype: ReduceDtype::Fp32,
        }
    }
}

/// The strategy kinds: what a `[[plugin]]` table's `kind`, a `[[track]]`,
/// `--plugin KIND=PATH` and `harness plugin new KIND` take; the plugin
/// kinds' names (`crate::plugin::Kind::ALL`, a test checks), the one list
/// that validation, the standard suites and the command line read.
pub const TRACK_KINDS: &[&str] = &["compressor", "batch-policy", "checkpoint-policy"];

/// Built-in strategy names (`[[plugin]]` names extend these).
pub const COMPRESSORS: &[&str] = &["allreduce"];
/// Built-in batch policies.
pub const BATCH_POLICIES: &[&str] = &["fixed"];
/// Built-in checkpoint policies.
pub const CHECKPOINT_POLICIES: &[&str] = &["none"];

fn default_true() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

fn is_false(b: &bool) -> bool {
    !*b
}
