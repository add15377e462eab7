//! The bounds of the suite format's numeric keys and of the names that
//! become paths: what validation refuses, and why (docs/suite-format.md,
//! "Bounds", tabulates them; a test keeps the two in step).
//!
//! A suite file is input like any other: a value that would make harness
//! allocate gigabytes while planning, abort in an allocation, overflow a
//! time or spin for days is refused at its line before anything runs. Each
//! bound is a stated maximum, the same on every machine (a suite validates
//! alike wherever it is checked), chosen far above what any shipped suite
//! uses. The memory bounds compare lower-bound estimates (what a step must
//! hold at the least) with [`MAX_MEMORY_BYTES`], so a suite refused by them
//! could not have run anywhere.

use super::family::{image, ModelConfig};
use super::spec::{DataSpec, Precision, Workload};

/// Repeats of a suite: each runs every (workload, strategy) pair again.
pub const MAX_REPEATS: u32 = 1000;
/// Entries of a plan (workloads × strategies × repeats): the plan and every
/// result file keep one record per entry.
pub const MAX_ENTRIES: u64 = 100_000;
/// Ranks of a CUDA run (one process per GPU, across hosts under torchrun
/// or srun).
pub const MAX_WORLD_SIZE: u32 = 4096;
/// Ranks of a CPU run (`device = "cpu"`, or `"auto"`, which falls back to
/// the CPU): threads of one process, each with a whole replica.
pub const MAX_CPU_RANKS: u32 = 256;
/// Threads of libtorch's intra-op pool, or of an image pipeline per rank.
pub const MAX_THREADS: u32 = 1024;
/// Optimizer steps, and every key counted in steps.
pub const MAX_STEPS: u64 = 10_000_000;
/// Seconds, for every key that is a duration (a week).
pub const MAX_SECONDS: f64 = 604_800.0;
/// Seconds of training time, the least for `time_budget_s` and
/// `faults.mtbf_s`: a millisecond, about one step of the smallest model
/// here (`mlp` `tiny` on one CPU core). A shorter budget ends before the
/// first step; failures more frequent than steps strike at every one.
pub const MIN_TRAINING_SECONDS: f64 = 0.001;
/// `collective_timeout_s`, the least: a second. The timeout also bounds the
/// ranks' rendezvous and a rank's first collective (NCCL's communicator
/// set-up takes about a second on one host); below it, healthy entries fail
/// as lost ranks.
pub const MIN_COLLECTIVE_TIMEOUT_S: f64 = 1.0;
/// `faults.max_restarts`, the most: every restart is a record in the
/// result file (about 200 bytes: 20 MB at the bound).
pub const MAX_RESTARTS: u64 = 100_000;
/// `faults.max_time_lost_ratio`, the most: failures costing a thousand
/// times an entry's own training time.
pub const MAX_TIME_LOST_RATIO: f64 = 1000.0;
/// The micro-batch, in samples: the range a batch policy may return too.
pub const MAX_BATCH: u32 = 65_536;
/// Micro-batches per step: the range a batch policy may return too.
pub const MAX_GRAD_ACCUM: u32 = 65_536;
/// Tokens (positions) per sequence.
pub const MAX_SEQ_LEN: u32 = 65_536;
/// Tokens of one optimizer step, all ranks together: batch × grad_accum ×
/// seq_len × world_size.
pub const MAX_TOKENS_PER_STEP: u64 = 1 << 30;
/// Batches of the eval set.
pub const MAX_EVAL_BATCHES: u32 = 10_000;
/// The most memory any estimate of a suite may reach: a step's activations,
/// the eval set, the model's weights and gradients (256 GiB).
pub const MAX_MEMORY_BYTES: u64 = 256 << 30;
/// Parameters of a model: its fp32 weights and gradients (8 bytes a
/// parameter, held whole by every rank) in [`MAX_MEMORY_BYTES`].
pub const MAX_PARAMS: u64 = MAX_MEMORY_BYTES / 8;
/// Tokens of a vocabulary, and classes of images (model outputs).
pub const MAX_VOCAB: u32 = 65_536;
/// Transitions of a synthetic Markov chain (vocab × branching).
pub const MAX_MARKOV_TRANSITIONS: u64 = 1 << 22;
/// Layers of a model (per stack for T5).
pub const MAX_LAYERS: u32 = 1024;
/// Attention heads.
pub const MAX_HEADS: u32 = 1024;
/// `d_model`.
pub const MAX_WIDTH: u32 = 65_536;
/// `d_ff`.
pub const MAX_FF_WIDTH: u32 = 262_144;
/// Image side, pixels.
pub const MAX_IMAGE_SIZE: u32 = 4096;
/// Image channels.
pub const MAX_CHANNELS: u32 = 256;
/// Characters of a name (suite, workload, strategy, plugin, track).
pub const MAX_NAME_LEN: usize = 100;
/// The prefix of the strategy a plugin entered into a track becomes.
pub const SUBMISSION_PREFIX: &str = "submission-";
/// `[[plugin]] memory_mb`.
pub const MAX_PLUGIN_MEMORY_MB: u32 = 65_536;
/// `[[plugin]] deadline_ms` (an hour).
pub const MAX_PLUGIN_DEADLINE_MS: u64 = 3_600_000;
/// `[[plugin]] tensor_mb` (1 TiB).
pub const MAX_PLUGIN_TENSOR_MB: u64 = 1 << 20;
/// `bucket_mb` (1 TiB).
pub const MAX_BUCKET_MB: f64 = 1_048_576.0;
/// `peak_tflops`.
pub const MAX_PEAK_TFLOPS: f64 = 100_000.0;
/// `peak_tflops`, the least: a GFLOP/s, below one CPU core's peak, so that
/// MFU stays a fraction of a peak a device could have.
pub const MIN_PEAK_TFLOPS: f64 = 0.001;
/// `lr`, `grad_clip`: far inside fp32's range (3.4e38), in which the fused
/// AdamW kernel reads them.
pub const MAX_FP32_SCALAR: f64 = 1e30;
/// AdamW's `eps`.
pub const MAX_EPS: f64 = 1.0;
/// `weight_decay`.
pub const MAX_WEIGHT_DECAY: f64 = 10.0;
/// Standard deviations of data noise (`regression`, `images`).
pub const MAX_NOISE: f64 = 1000.0;
/// `target_loss` and `target_above_floor`: above any loss a run starts
/// from (ln of the vocabulary, at most 11.1 nats; an MSE floor of at most
/// [`MAX_NOISE`]²).
pub const MAX_TARGET_LOSS: f64 = 1e6;
/// An emulated link's bandwidth, Gbit/s: (least, most).
pub const LINK_GBPS: (f64, f64) = (0.001, 100_000.0);
/// An emulated link's latency, µs (a second).
pub const MAX_LATENCY_US: f64 = 1e6;
/// `[suite.hardware] memory_gib`.
pub const MAX_MEMORY_GIB: f64 = 65_536.0;

/// Bytes of one activation element under `precision` (autocast keeps bf16
/// and fp16 activations).
fn activation_bytes(precision: Precision) -> f64 {
    match precision {
        Precision::Fp32 => 4.0,
        Precision::Bf16 | Precision::Fp16 => 2.0,
    }
}

/// At least how many parameters the model of `cfg` has (its vocabulary,
/// or classes, in `cfg.vocab`): every layer's attention projections and
/// feed-forward matrices (4 d² + 2 d d_ff; T5's decoder layers add cross
/// attention), the embeddings and output layers, and for a ResNet one 3x3
/// convolution at the first stage's width per layer. Biases and norms are
/// left out. In f64: no product of out-of-bound sizes overflows. Each
/// family counts its own ([`Family::params_at_least`](super::family::Family::params_at_least)).
pub fn params_at_least(cfg: &ModelConfig, channels: f64) -> f64 {
    cfg.family().params_at_least(cfg, channels)
}

/// At least how many bytes one micro-batch's activations take in a step
/// of workload `w` (model `cfg`): what the backward pass keeps per sample
/// (each layer's output, or its input when recomputed; the logits), times
/// the batch. For images, the input batch and the stem's output. Each
/// family counts a sample's ([`Family::activations_at_least`](super::family::Family::activations_at_least)).
pub fn step_activations_at_least(w: &Workload, cfg: &ModelConfig) -> f64 {
    let per_sample = cfg.family().activations_at_least(cfg, w, activation_bytes(w.precision));
    per_sample * f64::from(w.batch)
}

/// Bytes of one sample as the data source hands it over (tokens as i64,
/// inputs as f32): the eval set keeps `eval_batches × batch` of them in
/// host memory.
pub fn sample_bytes(w: &Workload, cfg: &ModelConfig) -> f64 {
    let t = f64::from(w.seq_len);
    match &w.data {
        DataSpec::Synthetic { .. } | DataSpec::Bin { .. } => (t + 1.0) * 8.0,
        DataSpec::Pairs { .. } => (2.0 * t + 1.0) * 8.0,
        DataSpec::Regression { .. } => t * cfg.d_model as f64 * 4.0 + 4.0,
        DataSpec::Images { .. } => image(&w.data).map_or(0.0, |(c, s)| c * s * s * 4.0 + 8.0),
    }
}

/// `bytes` in GiB, for messages.
pub fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / f64::from(1u32 << 30))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each bound as docs/suite-format.md's table writes it, by key.
    fn documented() -> Vec<(&'static str, String)> {
        vec![
            ("repeats", format!("{MAX_REPEATS}")),
            ("entries", format!("{MAX_ENTRIES}")),
            ("world_size", format!("{MAX_WORLD_SIZE}")),
            ("world_size", format!("{MAX_CPU_RANKS}")),
            ("threads", format!("{MAX_THREADS}")),
            ("steps", format!("{MAX_STEPS}")),
            ("time_budget_s", format!("[{MIN_TRAINING_SECONDS}, {MAX_SECONDS}]")),
            ("collective_timeout_s", format!("[{MIN_COLLECTIVE_TIMEOUT_S}, {MAX_SECONDS}]")),
            ("max_restarts", format!("1 to {MAX_RESTARTS}")),
            ("max_time_lost_ratio", format!("(0, {MAX_TIME_LOST_RATIO}]")),
            ("batch", format!("{MAX_BATCH}")),
            ("grad_accum", format!("{MAX_GRAD_ACCUM}")),
            ("seq_len", format!("{MAX_SEQ_LEN}")),
            ("tokens per step", format!("2^30 = {MAX_TOKENS_PER_STEP}")),
            ("eval_batches", format!("{MAX_EVAL_BATCHES}")),
            ("memory of a micro-batch", "256 GiB".into()),
            ("parameters", format!("2^35 = {MAX_PARAMS}")),
            ("vocab", format!("{MAX_VOCAB}")),
            ("branching", format!("{MAX_MARKOV_TRANSITIONS}")),
            ("n_layer", format!("{MAX_LAYERS}")),
            ("n_head", format!("{MAX_HEADS}")),
            ("d_model", format!("{MAX_WIDTH}")),
            ("d_ff", format!("{MAX_FF_WIDTH}")),
            ("image_size", format!("{MAX_IMAGE_SIZE}")),
            ("channels", format!("{MAX_CHANNELS}")),
            ("name", format!("{MAX_NAME_LEN}")),
            ("memory_mb", format!("{MAX_PLUGIN_MEMORY_MB}")),
            ("deadline_ms", format!("{MAX_PLUGIN_DEADLINE_MS}")),
            ("tensor_mb", format!("{MAX_PLUGIN_TENSOR_MB}")),
            ("bucket_mb", format!("(0, {MAX_BUCKET_MB}]")),
            ("peak_tflops", format!("[{MIN_PEAK_TFLOPS}, {MAX_PEAK_TFLOPS}]")),
            ("lr", "(0, 1e30]".into()),
            ("eps", format!("(0, {MAX_EPS}]")),
            ("weight_decay", format!("[0, {MAX_WEIGHT_DECAY}]")),
            ("noise", format!("[0, {MAX_NOISE}]")),
            ("target_loss", "[0, 1e6]".into()),
            ("gbps", format!("[{}, {}]", LINK_GBPS.0, LINK_GBPS.1)),
            ("latency_us", format!("[0, {MAX_LATENCY_US}]")),
            ("memory_gib", format!("[0, {MAX_MEMORY_GIB}]")),
            ("path", format!("{} MiB", crate::files::PLUGIN_MAX_BYTES >> 20)),
        ]
    }

    #[test]
    fn the_documented_bounds_are_the_enforced_ones() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let docs = std::fs::read_to_string(root.join("docs/suite-format.md")).unwrap();
        let table = docs.split("## Bounds").nth(1).expect("docs/suite-format.md has a Bounds section");
        let table = table.split("\n## ").next().unwrap();
        for (key, bound) in documented() {
            let row = table.lines().find(|l| l.starts_with("| ") && l.contains(key) && l.contains(&bound));
            assert!(row.is_some(), "docs/suite-format.md, Bounds: no row for `{key}` saying {bound}");
        }
    }

    #[test]
    fn the_estimates_of_the_presets_are_near_their_real_sizes() {
        use crate::suite::spec::{ModelKind, ModelSpec};
        let cfg = |kind, preset: &str, vocab| {
            let spec =
                ModelSpec { kind, preset: Some(preset.into()), n_layer: None, n_head: None, d_model: None, d_ff: None, dropout: None };
            ModelConfig::resolve(&spec, vocab, 1024).unwrap()
        };
        // GPT-2 124M (124,439,808 with its 1024 positions, biases and norms).
        let p = params_at_least(&cfg(ModelKind::Gpt, "gpt2-124m", 50257), 3.0);
        assert!((120e6..124.5e6).contains(&p), "{p}");
        // t5-large: 737.7M.
        let p = params_at_least(&cfg(ModelKind::T5, "large", 32128), 3.0);
        assert!((700e6..737.7e6).contains(&p), "{p}");
        // ResNet-50: 25.6M; a lower bound well under it.
        let p = params_at_least(&cfg(ModelKind::Vision, "resnet50", 1000), 3.0);
        assert!((1e6..25.6e6).contains(&p), "{p}");
    }
}
