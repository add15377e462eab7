//! The `HARNESS_*` environment switches, parsed once per process.
//!
//! Each switch turns one part of harness's work on or off (or sets a
//! number), mostly to measure what that part buys with one binary. They are
//! read here and nowhere else: [`init`] parses the environment at start-up
//! (the binary refuses a malformed value before any work), and [`get`] hands
//! every reader the same [`Switches`].
//!
//! A switch is of one of two classes ([`Class`]): those that change the
//! measured work (kernels, the all-reduce's overlap, CUDA graphs, autocast,
//! replica checks) are recorded in the result file when they differ from
//! their default ([`Switches::recorded`]; `switches` in
//! docs/results-format.md), so that a run with a kernel switched off never
//! looks like a default run; diagnostics and operations (traces, caches,
//! test blessing) are not. docs/benchmarks.md ("Environment switches")
//! lists them all.
//!
//! This module depends on std only (no libtorch, no other harness module).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::OnceLock;

/// Whether a switch changes the measured work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Changes what a run measures: recorded in the result when it differs
    /// from its default.
    Recorded,
    /// A diagnostic or an operational setting (what is printed, cached or
    /// traced): never recorded.
    Operational,
}

/// One switch as set in a [`Switches`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    /// The environment variable, e.g. `HARNESS_OVERLAP`.
    pub var: &'static str,
    pub class: Class,
    /// The value in its canonical spelling (`0`/`1` for on/off switches,
    /// `unset` for a tri-state switch left to the suite).
    pub value: String,
    /// The default, spelt the same way.
    pub default: String,
    /// The values the variable takes.
    pub accepted: &'static str,
}

impl Setting {
    /// Whether the value differs from the default.
    pub fn changed(&self) -> bool {
        self.value != self.default
    }
}

/// A value a switch can hold, and how the environment spells it.
trait Value: Sized + PartialEq {
    /// The spellings it takes, for error messages and docs.
    const ACCEPTED: &'static str;
    /// Parses a trimmed, non-empty value.
    fn parse(s: &str) -> Option<Self>;
    /// The canonical spelling.
    fn show(&self) -> String;
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

impl Value for bool {
    const ACCEPTED: &'static str = "1 or 0 (also true/false, on/off, yes/no)";
    fn parse(s: &str) -> Option<bool> {
        parse_bool(s)
    }
    fn show(&self) -> String {
        if *self { "1" } else { "0" }.to_owned()
    }
}

/// A tri-state switch: unset leaves the decision to the suite.
impl Value for Option<bool> {
    const ACCEPTED: &'static str = "1 or 0 (also true/false, on/off, yes/no), or unset to leave it to the suite";
    fn parse(s: &str) -> Option<Option<bool>> {
        parse_bool(s).map(Some)
    }
    fn show(&self) -> String {
        self.map_or("unset".to_owned(), |b| b.show())
    }
}

impl Value for u64 {
    const ACCEPTED: &'static str = "a whole number (0, 1, 2, ...)";
    fn parse(s: &str) -> Option<u64> {
        s.parse().ok()
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

/// Declares [`Switches`]: one field per switch with its variable, default
/// and class, and the parsing and listing that go with them.
macro_rules! switches {
    ($( $(#[doc = $doc:literal])* $field:ident : $ty:ty = $default:expr, $var:literal, $class:ident; )*) => {
        /// Every `HARNESS_*` switch, typed. Unset (or empty) variables take
        /// their defaults ([`Switches::DEFAULT`]).
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct Switches {
            $( $(#[doc = $doc])* pub $field: $ty, )*
        }

        impl Switches {
            /// Every switch at its default: what a process without any
            /// `HARNESS_*` variable runs with.
            pub const DEFAULT: Switches = Switches { $( $field: $default, )* };

            /// Parses the switches from `var` (the value of a variable, or
            /// None when unset). Every malformed value is reported, not
            /// only the first.
            pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Switches, SwitchesError> {
                let mut s = Switches::DEFAULT;
                let mut malformed = Vec::new();
                $(
                    if let Some(raw) = var($var).filter(|v| !v.trim().is_empty()) {
                        match <$ty as Value>::parse(raw.trim()) {
                            Some(x) => s.$field = x,
                            None => malformed.push(Malformed {
                                var: $var,
                                value: raw,
                                accepted: <$ty as Value>::ACCEPTED,
                                default: Value::show(&s.$field),
                                retired: None,
                            }),
                        }
                    }
                )*
                for (name, why) in RETIRED {
                    if let Some(raw) = var(name).filter(|v| !v.trim().is_empty()) {
                        malformed.push(Malformed { var: name, value: raw, accepted: "", default: String::new(), retired: Some(why) });
                    }
                }
                if malformed.is_empty() {
                    Ok(s)
                } else {
                    Err(SwitchesError { malformed })
                }
            }

            /// Every switch with its value and default, in the order of
            /// the docs' table.
            pub fn settings(&self) -> Vec<Setting> {
                vec![ $( Setting {
                    var: $var,
                    class: Class::$class,
                    value: Value::show(&self.$field),
                    default: Value::show(&Switches::DEFAULT.$field),
                    accepted: <$ty as Value>::ACCEPTED,
                }, )* ]
            }
        }
    };
}

switches! {
    // Recorded: they change the measured work.

    /// `HARNESS_FUSED_CE` (default 1): the token models' (gpt, mlp) fused
    /// cross-entropy under the fused kernels; 0 keeps libtorch's.
    fused_ce: bool = true, "HARNESS_FUSED_CE", Recorded;
    /// `HARNESS_FUSED_ADAMW` (default 1): harness's AdamW kernel under the
    /// fused kernels; 0 keeps libtorch's AdamW.
    fused_adamw: bool = true, "HARNESS_FUSED_ADAMW", Recorded;
    /// `HARNESS_FUSED_EMBED` (default 1): the embedding node (token and
    /// position embeddings in one kernel) on CUDA; 0 keeps libtorch's.
    fused_embed: bool = true, "HARNESS_FUSED_EMBED", Recorded;
    /// `HARNESS_FUSED_MLP` (default 1): the MLP node on CUDA (cuBLASLt's
    /// GELU epilogues; the encoder's ReLU one); 0 keeps the separate layers.
    fused_mlp: bool = true, "HARNESS_FUSED_MLP", Recorded;
    /// `HARNESS_FUSED_QKV` (default 1): the q, k, v projection as one node on
    /// CUDA; 0 keeps a linear layer and autograd's split.
    fused_qkv: bool = true, "HARNESS_FUSED_QKV", Recorded;
    /// `HARNESS_FUSED_POST_NORM` (default 1): the encoder's post-norm add and
    /// LayerNorm node; 0 keeps libtorch's.
    fused_post_norm: bool = true, "HARNESS_FUSED_POST_NORM", Recorded;
    /// `HARNESS_FUSED_RMS_NORM` (default 1): t5's residual add and RMS
    /// normalisation node on CUDA; 0 keeps libtorch's.
    fused_rms_norm: bool = true, "HARNESS_FUSED_RMS_NORM", Recorded;
    /// `HARNESS_FUSED_BN` (default 1): the ResNets' training-mode batch
    /// norm with its ReLU and residual add as one node on CUDA; 0 keeps
    /// libtorch's.
    fused_bn: bool = true, "HARNESS_FUSED_BN", Recorded;
    /// `HARNESS_FUSED_POOL` (default 1): the ResNets' max pooling in
    /// training as harness's kernels on CUDA (a byte per output for the
    /// backward pass); 0 keeps libtorch's.
    fused_pool: bool = true, "HARNESS_FUSED_POOL", Recorded;
    /// `HARNESS_BF16_IMAGES` (default 1): under bf16 autocast on CUDA, the
    /// vision models' training images come in bf16 (their first layer, a
    /// convolution, casts them so anyway); 0 keeps them fp32.
    bf16_images: bool = true, "HARNESS_BF16_IMAGES", Recorded;
    /// `HARNESS_FUSED_CASTS` (default 1): the fused layers' weights cast to
    /// bf16 in one launch per step; 0 leaves each layer to cast its own.
    /// Read on every step.
    fused_casts: bool = true, "HARNESS_FUSED_CASTS", Recorded;
    /// `HARNESS_FUSED_REFERENCE` (default 0): 1 runs the fused layers'
    /// libtorch reference on CUDA too (their maths without harness's
    /// kernels).
    fused_reference: bool = false, "HARNESS_FUSED_REFERENCE", Recorded;
    /// `HARNESS_LT_MATMULS` (default 1): the linear layers' matmuls through
    /// cuBLASLt; 0 keeps libtorch's.
    lt_matmuls: bool = true, "HARNESS_LT_MATMULS", Recorded;
    /// `HARNESS_LN_WARP` (default 1): a warp per row in the LayerNorm
    /// forward for rows of up to 1024 channels; 0 keeps a block per row.
    ln_warp: bool = true, "HARNESS_LN_WARP", Recorded;
    /// `HARNESS_LN_BWD_WARP` (default 1): a warp per row in the LayerNorm
    /// backward for rows of 128 .. 1024 channels; 0 keeps a block per row.
    ln_bwd_warp: bool = true, "HARNESS_LN_BWD_WARP", Recorded;
    /// `HARNESS_PDL` (default 1): programmatic dependent launches of
    /// harness's kernels on sm_90 and later; 0 keeps plain launches.
    pdl: bool = true, "HARNESS_PDL", Recorded;
    /// `HARNESS_OVERLAP` (default 1): the built-in reduction over NCCL (the
    /// all-reduce, or ZeRO's reduce-scatter) overlaps with the backward
    /// pass; 0 reduces after it.
    overlap: bool = true, "HARNESS_OVERLAP", Recorded;
    /// `HARNESS_LOCAL_GRADS` (default 1): with the plain average, at one
    /// rank or at several with the overlap on, autograd's own gradients
    /// (several ranks average each bucket's gradients in place as one NCCL
    /// group); 0 keeps the flat gradient buffers.
    local_grads: bool = true, "HARNESS_LOCAL_GRADS", Recorded;
    /// `HARNESS_CE_GATHER` (default unset): the flat gradient buffers in
    /// NCCL's symmetric memory, each overlapped bucket averaged as a
    /// reduce-scatter and an all-gather, which NCCL 2.28 and later runs on
    /// the copy engines (no SMs) when its CTA policy is zero
    /// (`NCCL_CTA_POLICY=2`, which harness sets for the ranks it starts
    /// unless it is set already). Unset: where it applies by default (CUDA
    /// GPUs with peer access, ranks harness started on one host, the plain
    /// fp32 average overlapped, no ZeRO, NCCL's own transport, no emulated
    /// link), else autograd's own gradients all-reduced; 1: wherever the
    /// symmetric memory is to be had (else flat buffers, all-reduced); 0:
    /// never.
    ce_gather: Option<bool> = None, "HARNESS_CE_GATHER", Recorded;
    /// `HARNESS_SYM_SCATTER` (default 1): where the copy engines' all-gather
    /// averages the buckets (`HARNESS_CE_GATHER`, the reduce-scatter on the
    /// SMs), each fp32 bucket's reduce-scatter sums (NCCL 2.27 and later run
    /// a sum between symmetric windows as a kernel that loads the peers'
    /// chunks directly, where NCCL's average takes its ring kernels) and a
    /// kernel divides this rank's chunk by the ranks before its gather: the
    /// fp32 average, summed in another order. ZeRO-1's gradient buffers lie
    /// in symmetric memory too, each reduce-scattered in place (its chunk a
    /// piece of it, no memory of its own). 0 averages with NCCL's average
    /// and keeps ZeRO-1's buffers and chunks in libtorch's memory.
    sym_scatter: bool = true, "HARNESS_SYM_SCATTER", Recorded;
    /// `HARNESS_ZERO_PREFETCH` (default 1): under ZeRO with several ranks,
    /// the parameters updated by each rank's shard are all-gathered beside
    /// the next step's forward pass (bucket by bucket, in the order the
    /// pass reads them; GPT's layers wait for their own bucket only, other
    /// models for all of them before the pass) from buffers in NCCL's
    /// symmetric memory, on the copy engines where NCCL's CTA policy is
    /// zero; 0 gathers them right after the update, on the SMs.
    zero_prefetch: bool = true, "HARNESS_ZERO_PREFETCH", Recorded;
    /// `HARNESS_SHARED_NORM` (default 1): with several ranks and no ZeRO,
    /// the gradient norm that clipping needs is computed by each rank over a
    /// world-th of the averaged gradients, the squares added up by a
    /// control all-reduce of one number (not where that norm checks a
    /// compressor plugin's output: each rank reads all of its own); 0 has
    /// every rank read all of them.
    shared_norm: bool = true, "HARNESS_SHARED_NORM", Recorded;
    /// `HARNESS_UNZEROED_GRADS` (default 1): where several ranks keep flat
    /// gradient buffers with the overlapped average (`HARNESS_LOCAL_GRADS=0`,
    /// `HARNESS_CE_GATHER=1`, ZeRO), a step's start leaves a bucket's
    /// buffer unzeroed when the fused layers write all its gradients
    /// themselves: the step's first write to each writes over it (a weight
    /// gradient's matmul with beta = 0), the same values as adding into
    /// zeros; 0 zeroes every buffer at each step's start.
    unzeroed_grads: bool = true, "HARNESS_UNZEROED_GRADS", Recorded;
    /// `HARNESS_CUDA_GRAPH` (default unset): overrides the workloads'
    /// `cuda_graph`; 1 replays the step as a CUDA graph where it qualifies,
    /// 0 runs every step eagerly, unset leaves it to the suite.
    cuda_graph: Option<bool> = None, "HARNESS_CUDA_GRAPH", Recorded;
    /// `HARNESS_AUTOCAST_BACKWARD` (default 0): 1 leaves autocast on in the
    /// backward pass (as before 2026-11-25); by default it is paused there,
    /// as torch.autocast covers the forward pass only.
    autocast_backward: bool = false, "HARNESS_AUTOCAST_BACKWARD", Recorded;
    /// `HARNESS_REPLICA_CHECK_EVERY` (default 50): steps between the checks
    /// that data-parallel replicas hold the same parameters, which also run
    /// once after warm-up (0: after the last step only).
    replica_check_every: u64 = 50, "HARNESS_REPLICA_CHECK_EVERY", Recorded;
    /// `HARNESS_REPLICA_CHECK_FORCE` (default 0): 1 takes the replica
    /// fingerprint on one rank too, to measure what it costs.
    replica_check_force: bool = false, "HARNESS_REPLICA_CHECK_FORCE", Recorded;

    // Operational: diagnostics, caches and tests; not recorded.

    /// `HARNESS_TRACE_STEPS` (default 1): steps that `harness run --trace`
    /// records (at least one).
    trace_steps: u64 = 1, "HARNESS_TRACE_STEPS", Operational;
    /// `HARNESS_TRACE_ALL_RANKS` (default 0): 1 has every rank of a
    /// data-parallel entry record its trace (rank r > 0 beside rank 0's,
    /// as `NAME.rank<r>.json`), to compare the ranks' timelines.
    trace_all_ranks: bool = false, "HARNESS_TRACE_ALL_RANKS", Operational;
    /// `HARNESS_GRAPH_DEBUG` (default 0): 1 prints the CUDA allocator's
    /// figures around a graph's capture (warm-up steps only).
    graph_debug: bool = false, "HARNESS_GRAPH_DEBUG", Operational;
    /// `HARNESS_COMPILE_CACHE` (default 1): WebAssembly plugins' machine code
    /// is cached across runs; 0 compiles every time.
    compile_cache: bool = true, "HARNESS_COMPILE_CACHE", Operational;
    /// `HARNESS_COMPILE_CACHE_MB` (default 2048): megabytes of compiled code
    /// the cache keeps.
    compile_cache_mb: u64 = 2048, "HARNESS_COMPILE_CACHE_MB", Operational;
    /// `HARNESS_BLESS` (default 0): in harness's own tests, 1 rewrites the
    /// rendered standard suites instead of comparing them.
    bless: bool = false, "HARNESS_BLESS", Operational;
}

/// Switches that levers had until they left the product, each with why:
/// a run that sets one is refused rather than measured without the lever
/// it names. Their code is kept as patches beside their measurements.
pub const RETIRED: [(&str, &str); 6] = [
    (
        "HARNESS_COMM_PRIORITY",
        "it left harness on 2026-11-29 (the collectives' stream at CUDA's greatest priority bought nothing in two \
         measured rounds; results/retired-levers/ keeps its code as a patch)",
    ),
    (
        "HARNESS_SM_RESERVE",
        "it left harness on 2026-11-29 (SMs reserved for NCCL slowed the matmuls more than they gained, two measured \
         rounds; results/retired-levers/ keeps its code as a patch)",
    ),
    (
        "HARNESS_SM_RESERVE_GBS",
        "it left harness on 2026-11-29 with HARNESS_SM_RESERVE (no gain; results/retired-levers/ keeps \
         its code as a patch)",
    ),
    (
        "HARNESS_READY_ORDER",
        "it left harness on 2026-11-29 (the gradient buckets in the names' order instead of the backward pass's \
         bought nothing in four measured rounds; the buckets always follow the backward pass now, see \
         results/retired-levers/)",
    ),
    (
        "HARNESS_TAIL_BUCKETS",
        "it left harness on 2026-11-29 (whole last buckets instead of three smaller ones: within 1% in the measured \
         rounds; the last three buckets are always a half, a quarter and an eighth now, see results/retired-levers/)",
    ),
    (
        "HARNESS_CE_REDUCE",
        "it left harness on 2026-11-29 (the reduce-scatter as an all-to-all on the copy engines was no better in two \
         measured rounds; results/retired-levers/ keeps its code as a patch)",
    ),
];

impl Default for Switches {
    fn default() -> Switches {
        Switches::DEFAULT
    }
}

impl Switches {
    /// Parses the process's environment (a variable that is not valid
    /// Unicode is malformed too).
    pub fn from_env() -> Result<Switches, SwitchesError> {
        Switches::from_vars(|k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned()))
    }

    /// The switches that change the measured work and differ from their
    /// defaults, variable to canonical value: what a result file records
    /// (empty for a default run).
    pub fn recorded(&self) -> BTreeMap<String, String> {
        self.settings().into_iter().filter(|s| s.class == Class::Recorded && s.changed()).map(|s| (s.var.to_owned(), s.value)).collect()
    }
}

/// Recorded switches as one line for reports: `HARNESS_FUSED_MLP=0,
/// HARNESS_OVERLAP=0`, or `none` when there are none.
pub fn line(recorded: &BTreeMap<String, String>) -> String {
    if recorded.is_empty() {
        return "none".to_owned();
    }
    recorded.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
}

/// A variable whose value the switch does not take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed {
    pub var: &'static str,
    pub value: String,
    pub accepted: &'static str,
    pub default: String,
    /// A switch that left harness ([`RETIRED`]): why, and where its code is.
    pub retired: Option<&'static str>,
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(why) = self.retired {
            return write!(f, "{}={:?} is no longer a switch: {why}", self.var, self.value);
        }
        write!(f, "{}={:?} is not a value it takes: it takes {} (default {})", self.var, self.value, self.accepted, self.default)
    }
}

/// Malformed switches: harness refuses to start rather than ignore them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwitchesError {
    pub malformed: Vec<Malformed>,
}

impl fmt::Display for SwitchesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, m) in self.malformed.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{m}")?;
        }
        write!(f, "\nhint: fix or unset the variable; docs/benchmarks.md (\"Environment switches\") lists every switch")
    }
}

impl std::error::Error for SwitchesError {}

static CURRENT: OnceLock<Switches> = OnceLock::new();

/// Parses the environment once, at start-up (the binary's `main`, before
/// any work or thread); later calls return the switches already parsed.
pub fn init() -> Result<&'static Switches, SwitchesError> {
    if let Some(s) = CURRENT.get() {
        return Ok(s);
    }
    let s = Switches::from_env()?;
    Ok(CURRENT.get_or_init(|| s))
}

/// The process's switches. Without [`init`] (unit tests, library users) the
/// environment is parsed on first use, and a malformed value panics with
/// the message [`init`] would have returned.
pub fn get() -> &'static Switches {
    CURRENT.get_or_init(|| Switches::from_env().unwrap_or_else(|e| panic!("{e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Result<Switches, SwitchesError> {
        let vars: BTreeMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Switches::from_vars(|k| vars.get(k).cloned())
    }

    #[test]
    fn no_variables_give_the_defaults_and_record_nothing() {
        let s = parse(&[]).unwrap();
        assert_eq!(s, Switches::default());
        assert!(s.fused_mlp && s.overlap && s.local_grads && s.pdl && s.fused_casts);
        assert!(!s.fused_reference && !s.autocast_backward && !s.replica_check_force && !s.bless && !s.graph_debug);
        assert_eq!(s.cuda_graph, None);
        assert_eq!((s.replica_check_every, s.trace_steps, s.compile_cache_mb), (50, 1, 2048));
        assert!(s.recorded().is_empty());
        // Empty values are unset.
        assert_eq!(parse(&[("HARNESS_OVERLAP", ""), ("HARNESS_CUDA_GRAPH", " ")]).unwrap(), Switches::DEFAULT);
    }

    #[test]
    fn each_spelling_of_on_and_off_is_taken() {
        for off in ["0", "false", "off", "no", "FALSE", "Off", " 0 "] {
            let s = parse(&[("HARNESS_OVERLAP", off), ("HARNESS_CUDA_GRAPH", off)]).unwrap();
            assert!(!s.overlap, "{off:?}");
            assert_eq!(s.cuda_graph, Some(false), "{off:?}");
        }
        for on in ["1", "true", "on", "yes", "TRUE", "Yes"] {
            let s = parse(&[("HARNESS_AUTOCAST_BACKWARD", on), ("HARNESS_CUDA_GRAPH", on)]).unwrap();
            assert!(s.autocast_backward, "{on:?}");
            assert_eq!(s.cuda_graph, Some(true), "{on:?}");
        }
        let s = parse(&[("HARNESS_REPLICA_CHECK_EVERY", "0"), ("HARNESS_TRACE_STEPS", "5"), ("HARNESS_COMPILE_CACHE_MB", "16")]).unwrap();
        assert_eq!((s.replica_check_every, s.trace_steps, s.compile_cache_mb), (0, 5, 16));
    }

    #[test]
    fn every_variable_is_read() {
        for setting in Switches::DEFAULT.settings() {
            let flipped = match setting.default.as_str() {
                "1" => "0",
                "0" | "unset" => "1",
                _ => "7",
            };
            let s = parse(&[(setting.var, flipped)]).unwrap();
            assert_ne!(s, Switches::DEFAULT, "{} is not read", setting.var);
            let changed: Vec<_> = s.settings().into_iter().filter(Setting::changed).map(|x| x.var).collect();
            assert_eq!(changed, [setting.var]);
        }
    }

    #[test]
    fn a_malformed_value_names_the_variable_and_what_it_takes() {
        let e = parse(&[("HARNESS_OVERLAP", "maybe")]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("HARNESS_OVERLAP=\"maybe\" is not a value it takes: it takes 1 or 0"), "{msg}");
        assert!(msg.contains("(default 1)") && msg.contains("hint:"), "{msg}");
        let e = parse(&[("HARNESS_CUDA_GRAPH", "auto"), ("HARNESS_TRACE_STEPS", "-1"), ("HARNESS_FUSED_MLP", "0")]).unwrap_err();
        let vars: Vec<_> = e.malformed.iter().map(|m| (m.var, m.value.as_str())).collect();
        assert_eq!(vars, [("HARNESS_CUDA_GRAPH", "auto"), ("HARNESS_TRACE_STEPS", "-1")]);
        assert!(e.to_string().contains("HARNESS_TRACE_STEPS=\"-1\" is not a value it takes: it takes a whole number"), "{e}");
        assert!(e.to_string().contains("or unset to leave it to the suite (default unset)"), "{e}");
    }

    #[test]
    fn a_retired_switch_is_refused_with_where_its_code_went() {
        let e = parse(&[("HARNESS_CE_REDUCE", "1"), ("HARNESS_OVERLAP", "1")]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("HARNESS_CE_REDUCE=\"1\" is no longer a switch: it left harness"), "{msg}");
        assert!(msg.contains("results/retired-levers/"), "{msg}");
        for (name, _) in RETIRED {
            assert!(parse(&[(name, "0")]).is_err(), "{name} set to 0 is refused too");
            assert!(Switches::DEFAULT.settings().iter().all(|s| s.var != name), "{name} is both a switch and retired");
        }
        // Unset or empty, they are no matter.
        assert!(parse(&[("HARNESS_SM_RESERVE", " ")]).is_ok());
    }

    #[test]
    fn only_changed_switches_of_the_measured_work_are_recorded() {
        let s = parse(&[
            ("HARNESS_FUSED_MLP", "off"),
            ("HARNESS_OVERLAP", "1"),
            ("HARNESS_CUDA_GRAPH", "true"),
            ("HARNESS_REPLICA_CHECK_EVERY", "50"),
            ("HARNESS_TRACE_STEPS", "3"),
            ("HARNESS_COMPILE_CACHE", "0"),
        ])
        .unwrap();
        let r = s.recorded();
        assert_eq!(line(&r), "HARNESS_CUDA_GRAPH=1, HARNESS_FUSED_MLP=0");
        assert_eq!(line(&BTreeMap::new()), "none");
        assert_eq!(parse(&[("HARNESS_CUDA_GRAPH", "0")]).unwrap().recorded().get("HARNESS_CUDA_GRAPH").map(String::as_str), Some("0"));
    }

    #[test]
    fn the_docs_table_lists_every_switch_with_its_default_and_class() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let docs = std::fs::read_to_string(root.join("docs/benchmarks.md")).unwrap();
        let table: Vec<&str> = docs
            .split("### Environment switches")
            .nth(1)
            .expect("docs/benchmarks.md has a section \"Environment switches\"")
            .lines()
            .filter(|l| l.starts_with("| `HARNESS_"))
            .collect();
        let settings = Switches::DEFAULT.settings();
        assert_eq!(table.len(), settings.len(), "one row per switch:\n{}", table.join("\n"));
        for s in settings {
            let row = table.iter().find(|r| r.starts_with(&format!("| `{}` |", s.var))).unwrap_or_else(|| panic!("no row for {}", s.var));
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            assert_eq!(cells[2], format!("`{}`", s.default), "{}'s default", s.var);
            let recorded = if s.class == Class::Recorded { "yes" } else { "no" };
            assert_eq!(cells[4], recorded, "{}: recorded?", s.var);
        }
    }
}
