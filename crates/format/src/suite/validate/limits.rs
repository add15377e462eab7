//! The bounds of [`crate::suite::limits`], checked at the key that breaks
//! them: each error says the bound and, in its hint, why it is there.
//! Values that break an older rule (zero, negative, not finite) get that
//! rule's message in the other checks of `validate/`; these checks add the
//! upper bounds, the least values of the keys that measure something
//! physical (a positive duration or peak can still be far too small to
//! mean anything), the names that become paths, the plugin artifacts'
//! files and the estimates of memory and plan size.

use std::collections::BTreeSet;
use std::path::Path;

use super::{valid_name, Checker, Seg, NAME_HINT};
use crate::files::{self, FileError, PLUGIN_MAX_BYTES};
use crate::link::Link;
use crate::suite::limits::*;
use crate::suite::model::ModelConfig;
use crate::suite::spec::{DataSpec, DeviceKind, FaultSpec, OptimizerSpec, PluginSpec, SuiteMeta, SuiteSpec, Track, Workload};
use Seg::{Index, Key};

/// A float as messages write it: plain, or in exponent form when very
/// large or small (`1e300`, not three hundred zeros).
fn num(x: f64) -> String {
    if x != 0.0 && (x.abs() >= 1e7 || x.abs() < 1e-3) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// Bytes of the plan's records beside each entry's copy of its strategy
/// (id, indices, seed).
const PLAN_ENTRY_OVERHEAD: u64 = 64;

/// The most bytes the plan's copies of strategies may take (each entry
/// holds its strategy, configuration tables included; every result file
/// writes the plan).
const MAX_PLAN_BYTES: u64 = 256 << 20;

impl Checker<'_> {
    /// An integer key at most `max`.
    fn at_most(&mut self, segs: &[Seg], key: &str, value: u64, max: u64, why: &str) {
        if value > max {
            self.err(segs, format!("`{key}` = {value} is above its bound of {max}"), Some(why.to_owned()));
        }
    }

    /// A float key at most `max` (only when finite: a non-finite value has
    /// its own message).
    fn float_at_most(&mut self, segs: &[Seg], key: &str, value: f64, max: f64, why: &str) {
        if value.is_finite() && value > max {
            self.err(segs, format!("`{key}` = {} is above its bound of {}", num(value), num(max)), Some(why.to_owned()));
        }
    }

    /// A float key at least `least` (only when finite and positive: zero,
    /// negative and non-finite values have their own message).
    fn float_at_least(&mut self, segs: &[Seg], key: &str, value: f64, least: f64, why: &str) {
        if value.is_finite() && value > 0.0 && value < least {
            self.err(segs, format!("`{key}` = {} is below its bound of {}", num(value), num(least)), Some(why.to_owned()));
        }
    }

    /// The `[suite]` table's bounds: its name (it names the result file),
    /// repeats, ranks, threads, warm-up, sizes and times.
    pub(super) fn meta_bounds(&mut self, meta: &SuiteMeta) {
        let at = |k: &'static str| [Key("suite"), Key(k)];
        if !meta.name.trim().is_empty() && !valid_name(&meta.name) {
            self.err(
                &at("name"),
                format!("the suite name `{}` is not a plain name: it names the result file and its log", meta.name),
                Some(format!("{NAME_HINT}; `name = \"../x\"` or \"/tmp/x\" would write outside --results-dir")),
            );
        }
        self.at_most(
            &at("repeats"),
            "repeats",
            meta.repeats.into(),
            MAX_REPEATS.into(),
            "every repeat runs each (workload, strategy) pair again; 1000 is beyond what any comparison needs",
        );
        self.world_bounds(meta);
        if let Some(t) = meta.threads {
            self.at_most(&at("threads"), "threads", t.into(), MAX_THREADS.into(), "more threads than any one host has hardware threads");
        }
        self.at_most(
            &at("warmup_steps"),
            "warmup_steps",
            meta.warmup_steps,
            MAX_STEPS,
            "steps are bounded by 10000000 (the loss curve keeps a point per step)",
        );
        if let Some(mb) = meta.bucket_mb {
            self.float_at_most(
                &at("bucket_mb"),
                "bucket_mb",
                mb,
                MAX_BUCKET_MB,
                "a bucket larger than the model is one bucket; 1 TiB is larger than any model that fits",
            );
        }
        self.float_at_most(
            &at("collective_timeout_s"),
            "collective_timeout_s",
            meta.collective_timeout_s,
            MAX_SECONDS,
            "durations are at most a week (604800 s); the timeout becomes a clock deadline",
        );
        self.float_at_least(
            &at("collective_timeout_s"),
            "collective_timeout_s",
            meta.collective_timeout_s,
            MIN_COLLECTIVE_TIMEOUT_S,
            "it also bounds the ranks' rendezvous and each rank's first collective, and NCCL's set-up alone takes about a second: shorter timeouts fail healthy entries as lost ranks",
        );
        if let Some(p) = meta.peak_tflops {
            self.float_at_least(
                &at("peak_tflops"),
                "peak_tflops",
                p,
                MIN_PEAK_TFLOPS,
                "a GFLOP/s is below one CPU core's peak; MFU divides by it (1e-300 gave an MFU of 2e298)",
            );
            self.float_at_most(
                &at("peak_tflops"),
                "peak_tflops",
                p,
                MAX_PEAK_TFLOPS,
                "100 PFLOP/s per device, 20x the densest accelerator's datasheet peak",
            );
        }
        if let Some(h) = &meta.hardware {
            let at_h = |k: &'static str| [Key("suite"), Key("hardware"), Key(k)];
            if !(h.memory_gib.is_finite() && (0.0..=MAX_MEMORY_GIB).contains(&h.memory_gib)) {
                self.err(
                    &at_h("memory_gib"),
                    format!("`memory_gib` must lie in [0, {MAX_MEMORY_GIB}]"),
                    Some("the GPU's memory in GiB; 0 for a CPU class".into()),
                );
            }
            if h.gpus.iter().any(|&g| g == 0 || g > MAX_WORLD_SIZE) {
                self.err(
                    &at_h("gpus"),
                    format!("each of `gpus` must lie in 1..={MAX_WORLD_SIZE}"),
                    Some("the GPU counts (ranks) the suite is defined for".into()),
                );
            }
        }
    }

    /// `world_size`: ranks a host or cluster can have; on the CPU, thread
    /// ranks of one process.
    fn world_bounds(&mut self, meta: &SuiteMeta) {
        let at = [Key("suite"), Key("world_size")];
        if meta.device != DeviceKind::Cuda && meta.world_size > MAX_CPU_RANKS {
            let device = if meta.device == DeviceKind::Cpu { "cpu" } else { "auto" };
            self.err(
                &at,
                format!("`world_size` = {} is above the bound of {MAX_CPU_RANKS} ranks with `device = \"{device}\"`", meta.world_size),
                Some(format!(
                    "CPU ranks are threads of one process, each holding a whole replica; {MAX_CPU_RANKS} is the hardware threads of a large two-socket host (`auto` runs on the CPU when no GPU is usable); set `device = \"cuda\"` for more ranks (at most {MAX_WORLD_SIZE})"
                )),
            );
        } else {
            self.at_most(
                &at,
                "world_size",
                meta.world_size.into(),
                MAX_WORLD_SIZE.into(),
                "one rank per GPU; 4096 GPUs is more than a data-parallel job of one model replica per GPU uses",
            );
        }
    }

    /// The plan's size: entries, and the bytes of their copies of the
    /// strategies, counted without building it.
    pub(super) fn plan_bounds(&mut self, s: &SuiteSpec) {
        let names: BTreeSet<&str> = s.workloads.iter().map(|w| w.name.as_str()).collect();
        let repeats = u64::from(s.suite.repeats);
        let (mut entries, mut bytes) = (0u64, 0u64);
        let all = s.workloads.len() as u64;
        for (i, st) in s.strategies.iter().enumerate() {
            let n = st
                .workloads
                .as_ref()
                .map_or(all, |ws| ws.iter().filter(|w| names.contains(w.as_str())).collect::<BTreeSet<_>>().len() as u64);
            let len = self.span_of(&[Key("strategy"), Index(i)]).map_or(0, |r| r.len() as u64);
            entries = entries.saturating_add(n.saturating_mul(repeats));
            bytes = bytes.saturating_add(n.saturating_mul(repeats).saturating_mul(len + PLAN_ENTRY_OVERHEAD));
        }
        if s.strategies.is_empty() {
            entries = all.saturating_mul(repeats);
        }
        if entries > MAX_ENTRIES {
            self.err(
                &[Key("suite"), Key("repeats")],
                format!("the suite plans {entries} entries (workloads x strategies x repeats), above the bound of {MAX_ENTRIES}"),
                Some("the plan and every result file keep a record per entry; split the suite".into()),
            );
        } else if bytes > MAX_PLAN_BYTES {
            self.err(
                &[Key("suite"), Key("repeats")],
                format!(
                    "the plan's copies of the strategies would take {} MiB, above the bound of {} MiB",
                    bytes >> 20,
                    MAX_PLAN_BYTES >> 20
                ),
                Some(
                    "each entry holds its strategy, configuration tables included; shorten the configurations or plan fewer entries".into(),
                ),
            );
        }
    }

    /// The `i`-th workload's bounds: sizes, steps, times, the optimizer,
    /// faults, targets, the model and the data; then, if all of those hold,
    /// the estimates of memory.
    pub(super) fn workload_bounds(&mut self, i: usize, w: &Workload, meta: &SuiteMeta) {
        let before = self.errors.len();
        let at = |k: &'static str| [Key("workload"), Index(i), Key(k)];
        let steps_why = "steps are bounded by 10000000: the loss curve keeps a point per step in memory";
        self.at_most(
            &at("batch"),
            "batch",
            w.batch.into(),
            MAX_BATCH.into(),
            "a micro-batch is at most 65536 samples, as a batch policy's",
        );
        self.at_most(
            &at("grad_accum"),
            "grad_accum",
            w.grad_accum.into(),
            MAX_GRAD_ACCUM.into(),
            "at most 65536 micro-batches a step, as a batch policy's",
        );
        self.at_most(&at("seq_len"), "seq_len", w.seq_len.into(), MAX_SEQ_LEN.into(), "no model here has a fixed context (gpt learns `seq_len` positions); 65536 positions is 64x the longest shipped sequence, and attention is quadratic in it");
        if let Some(s) = w.steps {
            self.at_most(&at("steps"), "steps", s, MAX_STEPS, steps_why);
        }
        if let Some(t) = w.time_budget_s {
            self.float_at_most(&at("time_budget_s"), "time_budget_s", t, MAX_SECONDS, "durations are at most a week (604800 s)");
            self.float_at_least(
                &at("time_budget_s"),
                "time_budget_s",
                t,
                MIN_TRAINING_SECONDS,
                "a millisecond is about one step of the smallest model here; a shorter budget ends before the first step",
            );
        }
        self.at_most(&at("eval_every"), "eval_every", w.eval_every, MAX_STEPS, steps_why);
        if let Some(t) = w.eval_every_tokens {
            let most = MAX_TOKENS_PER_STEP * MAX_STEPS;
            self.at_most(
                &at("eval_every_tokens"),
                "eval_every_tokens",
                t,
                most,
                "more tokens than any run trains (tokens per step x steps, each at its bound)",
            );
        }
        self.at_most(
            &at("eval_batches"),
            "eval_batches",
            w.eval_batches.into(),
            MAX_EVAL_BATCHES.into(),
            "the eval set is kept in memory and evaluated whole at every evaluation",
        );
        self.at_most(
            &[Key("workload"), Index(i), Key("schedule"), Key("warmup_steps")],
            "warmup_steps",
            w.schedule.warmup_steps,
            MAX_STEPS,
            steps_why,
        );
        let tokens = u64::from(w.batch) * u64::from(w.grad_accum) * u64::from(w.seq_len) * u64::from(meta.world_size);
        if tokens > MAX_TOKENS_PER_STEP {
            self.err(
                &at("batch"),
                format!("a step trains {tokens} tokens (batch x grad_accum x seq_len x world_size), above the bound of {MAX_TOKENS_PER_STEP} (2^30)"),
                Some("64x the 16M tokens per step of the largest published LLM runs; token counts over a run must fit 64 bits".into()),
            );
        }
        self.optimizer_bounds(i, &w.optimizer);
        if let Some(g) = w.grad_clip {
            self.float_at_most(&at("grad_clip"), "grad_clip", g, MAX_FP32_SCALAR, "the fused AdamW kernel reads it as an fp32 scalar");
        }
        let loss_why = "losses start at most near ln(vocab) <= 11.1 nats (cross-entropy) or noise^2 <= 1e6 (MSE)";
        if let Some(t) = w.target_loss {
            if t.is_finite() && !(0.0..=MAX_TARGET_LOSS).contains(&t) {
                self.err(&at("target_loss"), format!("`target_loss` = {} must lie in [0, 1e6]", num(t)), Some(loss_why.into()));
            }
        }
        if let Some(t) = w.target_above_floor {
            self.float_at_most(&at("target_above_floor"), "target_above_floor", t, MAX_TARGET_LOSS, loss_why);
        }
        if let Some(f) = &w.faults {
            self.fault_bounds(i, f);
        }
        self.model_bounds(i, w);
        self.data_bounds(i, &w.data);
        if self.errors.len() == before {
            self.memory_bounds(i, w);
        }
    }

    /// The optimizer table's upper bounds.
    fn optimizer_bounds(&mut self, i: usize, optimizer: &OptimizerSpec) {
        let at = |k: &'static str| [Key("workload"), Index(i), Key("optimizer"), Key(k)];
        let lr_why = "the fused AdamW kernel reads the rate as an fp32 scalar (finite up to 3.4e38); rates far above 1 only diverge";
        let wd_why = "10 is 100x the usual AdamW decay (0.1); the decay per step is lr x weight_decay";
        match optimizer {
            OptimizerSpec::Adamw { lr, eps, weight_decay, .. } => {
                self.float_at_most(&at("lr"), "lr", *lr, MAX_FP32_SCALAR, lr_why);
                self.float_at_most(
                    &at("eps"),
                    "eps",
                    *eps,
                    MAX_EPS,
                    "eps guards the division by the second moment's root; at 1 it outweighs any gradient's scale",
                );
                self.float_at_most(&at("weight_decay"), "weight_decay", *weight_decay, MAX_WEIGHT_DECAY, wd_why);
            }
            OptimizerSpec::Sgd { lr, weight_decay, .. } => {
                self.float_at_most(&at("lr"), "lr", *lr, MAX_FP32_SCALAR, lr_why);
                self.float_at_most(&at("weight_decay"), "weight_decay", *weight_decay, MAX_WEIGHT_DECAY, wd_why);
            }
        }
    }

    /// The `faults` table's bounds.
    fn fault_bounds(&mut self, i: usize, f: &FaultSpec) {
        let at = |k: &'static str| [Key("workload"), Index(i), Key("faults"), Key(k)];
        if let Some(&s) = f.at_steps.iter().max() {
            self.at_most(&at("at_steps"), "at_steps", s, MAX_STEPS, "steps are bounded by 10000000");
        }
        if let Some(m) = f.mtbf_s {
            self.float_at_most(&at("mtbf_s"), "mtbf_s", m, MAX_SECONDS, "durations are at most a week (604800 s)");
            self.float_at_least(
                &at("mtbf_s"),
                "mtbf_s",
                m,
                MIN_TRAINING_SECONDS,
                "a millisecond is about one step of the smallest model here: failures more frequent than steps strike at every step, and the entry never gets past its first",
            );
        }
        if let Some(n) = f.max_restarts {
            self.at_most(
                &at("max_restarts"),
                "max_restarts",
                n,
                MAX_RESTARTS,
                "every restart is a record in the result file; an entry failing this often measures nothing",
            );
        }
        if let Some(r) = f.max_time_lost_ratio {
            self.float_at_most(
                &at("max_time_lost_ratio"),
                "max_time_lost_ratio",
                r,
                MAX_TIME_LOST_RATIO,
                "failures costing a thousand times the entry's own training time leave nothing to measure",
            );
        }
        if let Some(b) = f.oom_above_batch {
            self.at_most(&at("oom_above_batch"), "oom_above_batch", b.into(), MAX_BATCH.into(), "micro-batches never exceed 65536 samples");
        }
    }

    /// The model table's explicit sizes.
    fn model_bounds(&mut self, i: usize, w: &Workload) {
        let at = |k: &'static str| [Key("workload"), Index(i), Key("model"), Key(k)];
        let m = &w.model;
        for (key, value, max, why) in [
            ("n_layer", m.n_layer, MAX_LAYERS, "1024 layers is 10x the deepest model here (ResNet-101)"),
            ("n_head", m.n_head, MAX_HEADS, "1024 heads is 8x the most of any published transformer"),
            ("d_model", m.d_model, MAX_WIDTH, "65536 is 2.5x the widest published transformer (25600)"),
            ("d_ff", m.d_ff, MAX_FF_WIDTH, "4x the widest `d_model`"),
        ] {
            if let Some(v) = value {
                self.at_most(&at(key), key, v.into(), max.into(), why);
            }
        }
    }

    /// The data table's upper bounds.
    fn data_bounds(&mut self, i: usize, data: &DataSpec) {
        let at = |k: &'static str| [Key("workload"), Index(i), Key("data"), Key(k)];
        let noise_why = "noise is a standard deviation in the data's unit scale; at 1000 the signal is gone";
        match data {
            DataSpec::Synthetic { vocab, branching, .. } => {
                self.at_most(
                    &at("vocab"),
                    "vocab",
                    (*vocab).into(),
                    MAX_VOCAB.into(),
                    "token vocabularies are at most 65536 (u16 tokens), as for `bin` and `pairs`",
                );
                let transitions = u64::from(*vocab) * u64::from(*branching);
                if *vocab <= MAX_VOCAB && transitions > MAX_MARKOV_TRANSITIONS {
                    self.err(
                        &at("branching"),
                        format!("the chain has {transitions} transitions (vocab x branching), above the bound of {MAX_MARKOV_TRANSITIONS} (2^22)"),
                        Some("the chain's tables hold 20 bytes a transition and its stationary distribution is found by power iteration over them".into()),
                    );
                }
            }
            DataSpec::Regression { noise, .. } => self.float_at_most(&at("noise"), "noise", *noise, MAX_NOISE, noise_why),
            DataSpec::Images { classes, image_size, channels, noise, threads, .. } => {
                self.at_most(
                    &at("classes"),
                    "classes",
                    (*classes).into(),
                    MAX_VOCAB.into(),
                    "classes are the classifier's outputs, bounded as vocabularies (ImageNet-21k has 21841)",
                );
                self.at_most(
                    &at("image_size"),
                    "image_size",
                    (*image_size).into(),
                    MAX_IMAGE_SIZE.into(),
                    "4096 x 4096 pixels is 334x ImageNet's 224 x 224",
                );
                self.at_most(
                    &at("channels"),
                    "channels",
                    (*channels).into(),
                    MAX_CHANNELS.into(),
                    "256 channels is far beyond RGB's 3 and multispectral imagery's 13",
                );
                self.float_at_most(&at("noise"), "noise", *noise, MAX_NOISE, noise_why);
                if let Some(t) = threads {
                    self.at_most(
                        &at("threads"),
                        "threads",
                        (*t).into(),
                        MAX_THREADS.into(),
                        "more threads than any one host has hardware threads",
                    );
                }
            }
            DataSpec::Bin { .. } | DataSpec::Pairs { .. } => {}
        }
    }

    /// The estimates: parameters, a micro-batch's activations and the eval
    /// set, each a lower bound, against [`MAX_PARAMS`] and
    /// [`MAX_MEMORY_BYTES`]. Only for a model that resolves (else it has
    /// its own error).
    fn memory_bounds(&mut self, i: usize, w: &Workload) {
        let at = |k: &'static str| [Key("workload"), Index(i), Key(k)];
        let Ok(cfg) = ModelConfig::resolve(&w.model, w.data.vocab().unwrap_or(1), w.seq_len) else { return };
        let channels = match &w.data {
            DataSpec::Images { channels, .. } => f64::from(*channels),
            _ => 3.0,
        };
        let most = MAX_MEMORY_BYTES as f64;
        let why = "256 GiB is more than any one accelerator's memory (B200: 192 GB) and than the CPU backend can use; the estimate is a lower bound, so the suite could not run";
        let params = params_at_least(&cfg, channels);
        if params > MAX_PARAMS as f64 {
            self.err(
                &at("model"),
                format!("the model has at least {params:.3e} parameters, above the bound of 2^35 ({MAX_PARAMS}): its fp32 weights and gradients alone take {}", gib(params * 8.0)),
                Some(format!("every rank holds the whole model; {why}")),
            );
        }
        let acts = step_activations_at_least(w, &cfg);
        if acts > most {
            self.err(
                &at("batch"),
                format!("a micro-batch of {} samples keeps at least {} of activations, above the bound of 256 GiB", w.batch, gib(acts)),
                Some(format!("lower `batch` (and use `grad_accum` for the same step), `seq_len` or the model's size; {why}")),
            );
        }
        let eval = sample_bytes(w, &cfg) * f64::from(w.batch) * f64::from(w.eval_batches);
        if eval > most {
            self.err(
                &at("eval_batches"),
                format!(
                    "the eval set ({} batches of {} samples) takes at least {} of memory, above the bound of 256 GiB",
                    w.eval_batches,
                    w.batch,
                    gib(eval)
                ),
                Some(format!("the eval set is kept in memory whole; {why}")),
            );
        }
    }

    /// A `[[plugin]]`'s caps and artifact: when the artifact exists it must
    /// be a regular file of at most [`PLUGIN_MAX_BYTES`] (a missing one is
    /// reported by the loader, which `harness validate` runs next).
    pub(super) fn plugin_bounds(&mut self, i: usize, p: &PluginSpec) {
        let at = |k: &'static str| [Key("plugin"), Index(i), Key(k)];
        self.at_most(
            &at("memory_mb"),
            "memory_mb",
            p.memory_mb.into(),
            MAX_PLUGIN_MEMORY_MB.into(),
            "64 GiB of linear memory, 16x what a 32-bit WebAssembly memory can address",
        );
        self.at_most(
            &at("deadline_ms"),
            "deadline_ms",
            p.deadline_ms,
            MAX_PLUGIN_DEADLINE_MS,
            "an hour for one call (a bucket, a step); the deadline becomes a clock deadline",
        );
        self.at_most(
            &at("tensor_mb"),
            "tensor_mb",
            p.tensor_mb,
            MAX_PLUGIN_TENSOR_MB,
            "1 TiB of tensors, more than any one host or GPU holds",
        );
        if p.path.as_os_str().is_empty() {
            return;
        }
        let base = self.path.parent().unwrap_or(Path::new("."));
        let full = if p.path.is_absolute() { p.path.clone() } else { base.join(&p.path) };
        match files::check_regular(&full, PLUGIN_MAX_BYTES) {
            Ok(_) | Err(FileError::Io { .. }) => {}
            Err(e @ FileError::NotRegular { .. }) => self.err(
                &at("path"),
                format!("plugin `{}`: {e}", p.name),
                Some("a plugin is a `.wasm` component or a shared library: a regular file".into()),
            ),
            Err(e @ FileError::TooLarge { .. }) => self.err(
                &at("path"),
                format!("plugin `{}`: {e}", p.name),
                Some(format!(
                    "plugin artifacts are at most {} MiB (a component with a Python interpreter is about 40)",
                    PLUGIN_MAX_BYTES >> 20
                )),
            ),
        }
    }

    /// An emulated link's upper bounds and least bandwidth.
    pub(super) fn link_bounds(&mut self, i: usize, l: &Link) {
        let at = |k: &'static str| [Key("strategy"), Index(i), Key("link"), Key(k)];
        let (least, most) = LINK_GBPS;
        let wait = "the emulated time must stay a time a run can wait";
        if l.gbps.is_finite() && l.gbps > 0.0 && !(least..=most).contains(&l.gbps) {
            self.err(
                &at("gbps"),
                format!("`gbps` = {} must lie in [{least}, {most}]", num(l.gbps)),
                Some(format!(
                    "from 1 Mbit/s (a 25 MiB bucket's all-reduce then takes minutes) to 100 Tbit/s (14x NVLink 5's per GPU); {wait}"
                )),
            );
        }
        self.float_at_most(&at("latency_us"), "latency_us", l.latency_us, MAX_LATENCY_US, &format!("a second per ring step; {wait}"));
        if let Some(n) = l.nodes {
            self.at_most(&at("nodes"), "nodes", n.into(), MAX_WORLD_SIZE.into(), "nodes hold ranks, at most 4096");
        }
    }

    /// A track's name (its plugin's strategy is `submission-<track>`) and
    /// `min_gpus`.
    pub(super) fn track_bounds(&mut self, i: usize, t: &Track) {
        let at = |k: &'static str| [Key("track"), Index(i), Key(k)];
        let most = MAX_NAME_LEN - SUBMISSION_PREFIX.len();
        if t.name.chars().count() > most {
            self.err(
                &at("name"),
                format!("track name `{}` is longer than {most} characters", t.name),
                Some(format!("a plugin entered into the track runs as strategy `{SUBMISSION_PREFIX}<track>`, a name of at most {MAX_NAME_LEN} characters")),
            );
        }
        self.at_most(&at("min_gpus"), "min_gpus", t.min_gpus.into(), MAX_WORLD_SIZE.into(), "no suite runs more than 4096 ranks");
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::{Duration, Instant};

    use super::super::tests::{parse, OK};
    use crate::suite::Suite;

    /// `OK` with `from` replaced by `to` is refused, fast (nothing sized by
    /// the values is allocated), with an error whose message contains
    /// `says`, at line `line` of test.toml, with a hint saying why.
    fn refused(from: &str, to: &str, says: &str, line: usize) {
        assert!(OK.contains(from), "{from}");
        let started = Instant::now();
        let e = parse(&OK.replace(from, to)).expect_err(to);
        assert!(started.elapsed() < Duration::from_secs(2), "{to}: {:?}", started.elapsed());
        let hit = e.0.iter().find(|x| x.message.contains(says)).unwrap_or_else(|| panic!("{to}: no error says {says:?}: {e}"));
        assert_eq!(hit.line_col().map(|l| l.0), Some(line), "{to}: {e}");
        assert!(hit.to_string().contains(&format!("test.toml:{line}:")), "{hit}");
        assert!(hit.hint.as_ref().is_some_and(|h| !h.is_empty()), "{to}: no reason given: {hit}");
    }

    #[test]
    fn the_tester_s_suites_are_refused_at_their_line_with_the_bound() {
        // Issue 38: each of these passed `validate` and aborted or
        // panicked later (or allocated gigabytes while planning).
        refused("repeats = 2", "repeats = 4000000000", "`repeats` = 4000000000 is above its bound of 1000", 4);
        refused("repeats = 2", "repeats = 4000000000", "plans 8000000000 entries", 4);
        refused("batch = 4", "batch = 4294967295", "`batch` = 4294967295 is above its bound of 65536", 10);
        refused("seq_len = 16", "seq_len = 2000000000", "`seq_len` = 2000000000 is above its bound of 65536", 11);
        refused(
            "repeats = 2",
            "repeats = 2\ndevice = \"cpu\"\nworld_size = 20000",
            "`world_size` = 20000 is above the bound of 256 ranks",
            6,
        );
        refused("repeats = 2", "repeats = 2\nworld_size = 300", "with `device = \"auto\"`", 5);
        refused("repeats = 2", "repeats = 2\ndevice = \"cuda\"\nworld_size = 20000", "`world_size` = 20000 is above its bound of 4096", 6);
        refused(
            "repeats = 2",
            "repeats = 2\ncollective_timeout_s = 1e300",
            "`collective_timeout_s` = 1e300 is above its bound of 604800",
            5,
        );
    }

    #[test]
    fn suite_names_that_would_leave_the_results_folder_are_refused() {
        for bad in ["../x", "/tmp/x", "a/b", "..\\x", "x y", ""] {
            let e = parse(&OK.replace("name = \"t\"", &format!("name = {bad:?}"))).expect_err(bad);
            let says = if bad.is_empty() { "the suite needs a name" } else { "is not a plain name: it names the result file" };
            assert!(e.0[0].message.contains(says) && e.0[0].line_col().unwrap().0 == 3, "{bad}: {e}");
        }
        let long = "n".repeat(101);
        let e = parse(&OK.replace("name = \"b\"", &format!("name = \"{long}\""))).unwrap_err();
        assert!(e.0[0].message.contains("is not a plain name") && e.0[0].hint.as_ref().unwrap().contains("at most 100"), "{e}");
        parse(&OK.replace("name = \"t\"", &format!("name = \"{}\"", "n".repeat(100)))).unwrap();
        parse(&OK.replace("name = \"t\"", "name = \"cpu-standard_1.2\"")).unwrap();
    }

    #[test]
    fn every_integer_key_that_sizes_work_is_bounded() {
        let big = "9223372036854775807"; // TOML's largest integer
        let u32max = "4294967295";
        for (from, to, says, line) in [
            ("repeats = 2", format!("repeats = 2\nthreads = {u32max}"), "`threads` = 4294967295 is above its bound of 1024", 5),
            ("repeats = 2", format!("repeats = 2\nwarmup_steps = {big}"), "`warmup_steps`", 5),
            ("steps = 10", format!("steps = {big}"), "`steps` = 9223372036854775807 is above its bound of 10000000", 12),
            ("steps = 10", format!("steps = 10\ngrad_accum = {u32max}"), "`grad_accum` = 4294967295 is above its bound of 65536", 13),
            ("steps = 10", format!("steps = 10\neval_every = {big}"), "`eval_every`", 13),
            ("steps = 10", format!("steps = 10\neval_every_tokens = {big}"), "`eval_every_tokens`", 13),
            ("steps = 10", format!("steps = 10\neval_batches = {u32max}"), "`eval_batches` = 4294967295 is above its bound of 10000", 13),
            ("steps = 10", format!("steps = 10\nschedule = {{ warmup_steps = {big} }}"), "`warmup_steps`", 13),
            ("steps = 10", format!("steps = 10\nfaults = {{ at_steps = [3, {big}] }}"), "`at_steps`", 13),
            ("steps = 10", format!("steps = 10\nfaults = {{ oom_above_batch = {u32max} }}"), "`oom_above_batch`", 13),
            ("preset = \"tiny\"", format!("preset = \"tiny\", n_layer = {u32max}"), "`n_layer` = 4294967295 is above its bound of 1024", 8),
            ("preset = \"tiny\"", format!("preset = \"tiny\", n_head = {u32max}"), "`n_head`", 8),
            ("preset = \"tiny\"", format!("preset = \"tiny\", d_model = {u32max}"), "`d_model`", 8),
            ("preset = \"tiny\"", format!("preset = \"tiny\", d_ff = {u32max}"), "`d_ff`", 8),
            ("vocab = 64", format!("vocab = {u32max}"), "`vocab` = 4294967295 is above its bound of 65536", 9),
            (
                "vocab = 64",
                "vocab = 65536, branching = 65536".into(),
                "4294967296 transitions (vocab x branching), above the bound of 4194304",
                9,
            ),
        ] {
            refused(from, &to, says, line);
        }
        // A batch and a sequence each in bounds whose step is not.
        refused("batch = 4\nseq_len = 16", "batch = 65536\nseq_len = 65536", "a step trains 4294967296 tokens", 10);
    }

    #[test]
    fn memory_is_bounded_by_lower_bound_estimates() {
        // 4M tokens a step, within bounds, but the logits and layer outputs
        // of 1.3B-parameter GPT at a 65536 vocabulary do not fit anywhere.
        let big = OK
            .replace("preset = \"tiny\"", "preset = \"1.3b\"")
            .replace("vocab = 64", "vocab = 65536")
            .replace("batch = 4\nseq_len = 16", "batch = 1024\nseq_len = 4096");
        let e = parse(&big).unwrap_err();
        assert!(
            e.0[0].message.contains("a micro-batch of 1024 samples keeps at least")
                && e.0[0].message.contains("above the bound of 256 GiB"),
            "{e}"
        );
        assert_eq!(e.0[0].line_col().unwrap().0, 10);
        // The same with a micro-batch of 8 runs (with accumulation for the same step).
        parse(&big.replace("batch = 1024", "batch = 8\ngrad_accum = 128")).unwrap();
        refused("preset = \"tiny\"", "preset = \"tiny\", n_layer = 1024, d_model = 65536, n_head = 64", "the model has at least", 8);
        refused(
            "batch = 4\nseq_len = 16",
            "batch = 65536\nseq_len = 64\neval_batches = 10000",
            "the eval set (10000 batches of 65536 samples)",
            12,
        );
    }

    #[test]
    fn every_float_key_is_finite_and_in_range() {
        for (from, to, says, line) in [
            ("repeats = 2", "repeats = 2\npeak_tflops = 1e300", "`peak_tflops` = 1e300 is above its bound of 100000", 5),
            ("repeats = 2", "repeats = 2\nbucket_mb = 1e300", "`bucket_mb` = 1e300 is above its bound of 1048576", 5),
            ("steps = 10", "time_budget_s = 1e300", "`time_budget_s` = 1e300 is above its bound of 604800", 12),
            ("lr = 1e-3", "lr = 1e300", "`lr` = 1e300 is above its bound of 1e30", 13),
            ("lr = 1e-3", "lr = 1e-3, eps = 2.0", "`eps` = 2 is above its bound of 1", 13),
            ("lr = 1e-3", "lr = 1e-3, weight_decay = 1e9", "`weight_decay` = 1e9 is above its bound of 10", 13),
            ("steps = 10", "steps = 10\ngrad_clip = 1e300", "`grad_clip` = 1e300 is above its bound of 1e30", 13),
            ("steps = 10", "steps = 10\ntarget_loss = 1e300", "`target_loss` = 1e300 must lie in [0, 1e6]", 13),
            ("steps = 10", "steps = 10\ntarget_loss = -1.0", "`target_loss` = -1 must lie in [0, 1e6]", 13),
            ("steps = 10", "steps = 10\ntarget_above_floor = 1e300", "`target_above_floor` = 1e300 is above its bound of 1000000", 13),
            ("steps = 10", "steps = 10\nfaults = { mtbf_s = 1e300 }", "`mtbf_s` = 1e300 is above its bound of 604800", 13),
        ] {
            refused(from, to, says, line);
        }
        // Regression and image noise; the link between ranks.
        let enc = OK
            .replace("{ kind = \"gpt\", preset = \"tiny\" }", "{ kind = \"encoder\", preset = \"tiny\" }")
            .replace("{ kind = \"synthetic\", vocab = 64 }", "{ kind = \"regression\", noise = 1e300 }");
        let e = parse(&enc).unwrap_err();
        assert!(e.0[0].message.contains("`noise` = 1e300 is above its bound of 1000") && e.0[0].line_col().unwrap().0 == 9, "{e}");
        let two = OK.replace("repeats = 2", "repeats = 2\nworld_size = 2");
        for (link, says) in [
            ("{ gbps = 1e-300 }", "`gbps` = 1e-300 must lie in [0.001, 100000]"),
            ("{ gbps = 1e300 }", "`gbps` = 1e300 must lie in [0.001, 100000]"),
            ("{ gbps = 10, latency_us = 1e300 }", "`latency_us` = 1e300 is above its bound of 1000000"),
            ("{ gbps = 10, nodes = 4294967295 }", "`nodes` = 4294967295 is above its bound of 4096"),
        ] {
            let e = parse(&two.replace("name = \"b\"", &format!("name = \"b\"\nlink = {link}"))).unwrap_err();
            let hit = e.0.iter().find(|x| x.message.contains(says)).unwrap_or_else(|| panic!("{link}: {e}"));
            assert_eq!(hit.line_col().unwrap().0, 22, "{e}");
        }
    }

    #[test]
    fn physical_keys_are_refused_below_the_least_value_that_means_something() {
        // Issue 61: each of these validated, then restarted for ever
        // (`mtbf_s`), ended an entry with "rank(s) [] never joined"
        // (`collective_timeout_s`), recorded an MFU of 2.2e298
        // (`peak_tflops`) or ended before the first step (`time_budget_s`).
        for (from, to, says, line) in [
            ("repeats = 2", "repeats = 2\ncollective_timeout_s = 1e-300", "`collective_timeout_s` = 1e-300 is below its bound of 1", 5),
            ("repeats = 2", "repeats = 2\ncollective_timeout_s = 0.5", "`collective_timeout_s` = 0.5 is below its bound of 1", 5),
            ("repeats = 2", "repeats = 2\npeak_tflops = 1e-300", "`peak_tflops` = 1e-300 is below its bound of 0.001", 5),
            ("steps = 10", "time_budget_s = 1e-300", "`time_budget_s` = 1e-300 is below its bound of 0.001", 12),
            ("steps = 10", "steps = 10\nfaults = { mtbf_s = 1e-300, seed = 1 }", "`mtbf_s` = 1e-300 is below its bound of 0.001", 13),
            ("steps = 10", "steps = 10\nfaults = { mtbf_s = 0.0009 }", "`mtbf_s` = 9e-4 is below its bound of 0.001", 13),
            (
                "steps = 10",
                "steps = 10\nfaults = { at_steps = [3], max_restarts = 1000000 }",
                "`max_restarts` = 1000000 is above its bound of 100000",
                13,
            ),
            (
                "steps = 10",
                "steps = 10\nfaults = { at_steps = [3], max_time_lost_ratio = 1e300 }",
                "`max_time_lost_ratio` = 1e300 is above its bound of 1000",
                13,
            ),
        ] {
            refused(from, to, says, line);
        }
        // The bounds themselves are in range.
        for (from, to) in [
            ("repeats = 2", "repeats = 2\ncollective_timeout_s = 1\npeak_tflops = 0.001"),
            ("steps = 10", "time_budget_s = 0.001"),
            ("steps = 10", "steps = 10\nfaults = { mtbf_s = 0.001, max_restarts = 100000, max_time_lost_ratio = 1000 }"),
        ] {
            parse(&OK.replace(from, to)).unwrap_or_else(|e| panic!("{to}: {e}"));
        }
    }

    #[test]
    fn image_keys_are_bounded() {
        let vision = OK
            .replace("{ kind = \"gpt\", preset = \"tiny\" }", "{ kind = \"vision\", preset = \"tiny\" }")
            .replace("seq_len = 16", "seq_len = 1");
        for (data, says) in [
            ("{ kind = \"images\", classes = 4294967295 }", "`classes` = 4294967295 is above its bound of 65536"),
            ("{ kind = \"images\", image_size = 4294967295 }", "`image_size` = 4294967295 is above its bound of 4096"),
            ("{ kind = \"images\", channels = 4294967295 }", "`channels` = 4294967295 is above its bound of 256"),
            ("{ kind = \"images\", threads = 4294967295 }", "`threads` = 4294967295 is above its bound of 1024"),
            ("{ kind = \"images\", noise = 1e300 }", "`noise` = 1e300 is above its bound of 1000"),
            // In bounds key by key, but a batch of 256 images of 4096 x
            // 4096 pixels in 256 channels is 4 TiB.
            ("{ kind = \"images\", image_size = 4096, channels = 256, padding = 4 }", "keeps at least"),
        ] {
            let e = parse(&vision.replace("{ kind = \"synthetic\", vocab = 64 }", data).replace("batch = 4", "batch = 256")).unwrap_err();
            assert!(e.0.iter().any(|x| x.message.contains(says)), "{data}: {e}");
        }
    }

    #[test]
    fn plugin_caps_are_bounded() {
        let with = |keys: &str| format!("{OK}\n[[plugin]]\nname = \"p\"\npath = \"p.wasm\"\n{keys}\n");
        for (keys, says) in [
            ("memory_mb = 4294967295", "`memory_mb` = 4294967295 is above its bound of 65536"),
            ("deadline_ms = 9223372036854775807", "`deadline_ms` = 9223372036854775807 is above its bound of 3600000"),
            ("tensor_mb = 9223372036854775807", "`tensor_mb` = 9223372036854775807 is above its bound of 1048576"),
        ] {
            let e = parse(&with(keys)).unwrap_err();
            assert!(e.0[0].message.contains(says) && e.0[0].line_col().unwrap().0 == 25, "{keys}: {e}");
        }
    }

    /// A suite in `dir` with one plugin at `path`; its errors.
    fn plugin_at(dir: &Path, path: &Path) -> String {
        let text = format!("{OK}\n[[plugin]]\nname = \"p\"\npath = {:?}\n", path.display().to_string());
        let started = Instant::now();
        let e = Suite::parse(&dir.join("suite.toml"), text).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        assert_eq!(e.0[0].line_col().unwrap().0, 24, "{e}");
        e.to_string()
    }

    #[test]
    fn plugin_paths_must_be_regular_files_of_at_most_256_mib() {
        let dir = tempfile::tempdir().unwrap();
        let e = plugin_at(dir.path(), Path::new("/dev/zero"));
        assert!(e.contains("plugin `p`: /dev/zero is a character device, not a regular file"), "{e}");
        let fifo = crate::files::tests::fifo(dir.path());
        let e = plugin_at(dir.path(), Path::new("plugin.fifo"));
        assert!(e.contains("is a FIFO (named pipe), not a regular file"), "{e}");
        assert!(fifo.exists());
        let e = plugin_at(dir.path(), dir.path());
        assert!(e.contains("is a directory, not a regular file"), "{e}");
        // A sparse file of 257 MiB: refused by its size, nothing read.
        let big = dir.path().join("big.wasm");
        std::fs::File::create(&big).unwrap().set_len(257 << 20).unwrap();
        let e = plugin_at(dir.path(), Path::new("big.wasm"));
        assert!(e.contains("more than the 268435456 bytes (256 MiB) harness reads"), "{e}");
        // A missing artifact is left to the loader (`harness validate` runs it).
        let text = format!("{OK}\n[[plugin]]\nname = \"p\"\npath = \"none.wasm\"\n");
        Suite::parse(&dir.path().join("suite.toml"), text).unwrap();
    }

    #[test]
    fn tracks_are_bounded() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let text = &std::fs::read_to_string(root.join("suites/cpu-standard.toml")).unwrap();
        let track = "name = \"compression\"\n";
        assert!(text.contains(track));
        let e = Suite::parse(Path::new("s.toml"), text.replacen(track, &format!("{track}min_gpus = 4294967295\n"), 1)).unwrap_err();
        assert!(e.to_string().contains("`min_gpus` = 4294967295 is above its bound of 4096"), "{e}");
        let long = format!("name = \"{}\"\n", "c".repeat(90));
        let e = Suite::parse(Path::new("s.toml"), text.replace(track, &long)).unwrap_err();
        assert!(e.to_string().contains("is longer than 89 characters"), "{e}");
        let e = Suite::parse(Path::new("s.toml"), text.replacen("gpus = [2]", "gpus = [2, 0, 5000]", 1)).unwrap_err();
        assert!(e.to_string().contains("each of `gpus` must lie in 1..=4096"), "{e}");
        let e = Suite::parse(Path::new("s.toml"), text.replacen("memory_gib = 0", "memory_gib = 1e300", 1)).unwrap_err();
        assert!(e.to_string().contains("`memory_gib` must lie in [0, 65536]"), "{e}");
    }

    #[test]
    fn every_suite_in_the_repository_is_within_the_bounds() {
        // Shipped and released suites are byte-frozen: the bounds must
        // accept them (plugins not loaded: `harness validate` does that).
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut n = 0;
        for dir in ["suites", "suites/standard/1.0", "suites/standard/1.1"] {
            for e in std::fs::read_dir(root.join(dir)).unwrap() {
                let p = e.unwrap().path();
                if p.extension().is_some_and(|x| x == "toml") {
                    Suite::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                    n += 1;
                }
            }
        }
        assert!(n > 40, "{n}");
    }
}
