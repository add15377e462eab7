//! What a run accepts from its checkpoint folder, known before anything in
//! it is read: the run and entry a checkpoint must belong to
//! ([`RunIdentity`]), the tensors its files must hold ([`Layout`]: names,
//! dtypes and shapes, hence the files' sizes), and the range of every field
//! of its manifest ([`Bounds`]). The folder is read as a hostile one:
//! anything else is refused ([`Refused`]), naming the checkpoint folder and
//! the field. The files' sizes follow from the safetensors header
//! ([`dtype_name`], [`header_json`]), which the writer makes with the same
//! two functions.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::snapshot::{Position, Snapshot};

/// The largest `lr_scale` a batch policy may ask for, and a checkpoint
/// hold: `lr_scale` follows the batch relative to a start batch
/// (docs/batch-policies.md), and the largest ratio of two global batches
/// (micro-batch x accumulation steps, each in 1..=65536) is 2^32.
pub const MAX_LR_SCALE: f64 = 4_294_967_296.0;

/// The most steps, and samples per rank, a checkpoint may count: 2^40,
/// beyond any run, and small enough that nothing derived from them
/// (tokens: samples x sequence length x ranks) overflows.
pub const MAX_COUNT: u64 = 1 << 40;

/// Bytes of a plugin's state a checkpoint may hold, besides
/// [`PLUGIN_STATE_PER_PARAMETER`] bytes per parameter.
pub const PLUGIN_STATE_BASE: u64 = 64 << 20;

/// Bytes per model parameter a plugin's state may hold on top of
/// [`PLUGIN_STATE_BASE`]: two f32 values per parameter (an error-feedback
/// residual and another vector as large).
pub const PLUGIN_STATE_PER_PARAMETER: u64 = 8;

/// A checkpoint refused: which one, which field, and why.
#[derive(Debug, thiserror::Error)]
#[error("checkpoint {} refused: `{field}` {why}", dir.display())]
pub struct Refused {
    /// The checkpoint's folder.
    pub dir: PathBuf,
    /// The manifest's field (`position.micro_batch`, `run.entry`,
    /// `model.bytes`, ...) or the file.
    pub field: String,
    pub why: String,
}

/// [`Refused`], as an error.
pub(crate) fn refused(dir: &Path, field: impl Into<String>, why: impl Display) -> anyhow::Error {
    Refused { dir: dir.to_path_buf(), field: field.into(), why: why.to_string() }.into()
}

/// The run and entry a checkpoint belongs to, written into its manifest
/// (and so covered by the manifest's hash): a checkpoint of another suite,
/// entry, seed, world size, plan or plugin build is refused by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunIdentity {
    /// The sha256 of the suite file's bytes.
    pub suite_sha256: String,
    /// The plan entry's id.
    pub entry: String,
    /// The entry's seed.
    pub seed: u64,
    /// Ranks of the run.
    pub world_size: u32,
    /// The entry's planned steps (none: it trains for a time budget).
    pub steps: Option<u64>,
    /// The sha256 of each strategy plugin's artifact, by slot
    /// (`compressor`, `batch`, `checkpoint`; built-in strategies have none).
    pub plugins: BTreeMap<String, String>,
    /// Under ZeRO, a digest of how the parameters lie in the shards
    /// ([`crate::dp::DataParallel::shard_layout`]): the optimizer state is
    /// kept per shard piece, and pieces of another layout can have the same
    /// shapes and hold other parameters' state. Empty (and not written)
    /// without ZeRO, where the state follows the parameters.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub shards: String,
}

impl RunIdentity {
    /// A run of `world` ranks known by nothing else (benchmarks, tests).
    pub fn anonymous(world: usize) -> RunIdentity {
        RunIdentity { world_size: world as u32, ..RunIdentity::default() }
    }

    /// Refuses `theirs` (a checkpoint's) unless it is this run's.
    pub(crate) fn check(&self, dir: &Path, theirs: &RunIdentity) -> Result<()> {
        let differs = |field: &str, t: String, o: String| {
            refused(dir, format!("run.{field}"), format!("is {t}, this run's is {o}: the checkpoint belongs to another run or entry"))
        };
        if theirs.suite_sha256 != self.suite_sha256 {
            return Err(differs("suite_sha256", shown(&theirs.suite_sha256, false), self.suite_sha256.clone()));
        }
        if theirs.entry != self.entry {
            return Err(differs("entry", shown(&theirs.entry, true), format!("`{}`", self.entry)));
        }
        if theirs.seed != self.seed {
            return Err(differs("seed", theirs.seed.to_string(), self.seed.to_string()));
        }
        if theirs.world_size != self.world_size {
            return Err(differs("world_size", theirs.world_size.to_string(), self.world_size.to_string()));
        }
        if theirs.steps != self.steps {
            return Err(differs("steps", format!("{:?}", theirs.steps), format!("{:?}", self.steps)));
        }
        if theirs.plugins != self.plugins {
            return Err(differs("plugins", format!("{:?}", theirs.plugins), format!("{:?}", self.plugins)));
        }
        if theirs.shards != self.shards {
            // A manifest is a stranger's: only a layout digest (hex) is shown
            // (stricter than `shown`, which any printable value passes).
            let digest = |s: &str| match s {
                "" => "none".to_owned(),
                s if s.len() <= 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) => format!("`{s}`"),
                s => format!("no layout digest ({} bytes)", s.len()),
            };
            return Err(refused(
                dir,
                "run.shards",
                format!(
                    "is {}, this run's is {}: the ZeRO shards lie differently (the gradient buckets changed: bucket_mb \
                     or harness's version), so its optimizer state would \
                     land on other parameters",
                    digest(&theirs.shards),
                    digest(&self.shards)
                ),
            ));
        }
        Ok(())
    }
}

/// A string from a stranger's manifest as a message shows it: as it is
/// (in backticks with `quoted`) when short and free of control characters,
/// else only its length.
fn shown(s: &str, quoted: bool) -> String {
    if s.len() > 256 || s.chars().any(char::is_control) {
        return format!("a value of {} bytes (not shown: too long or with control characters)", s.len());
    }
    if quoted {
        format!("`{s}`")
    } else {
        s.to_owned()
    }
}

/// One tensor a checkpoint file holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub kind: Kind,
    pub shape: Vec<i64>,
    /// The file may lack it (SGD's momentum, made at the first step).
    pub optional: bool,
}

impl TensorSpec {
    /// The spec of `t`, named `name`.
    pub fn of(name: impl Into<String>, t: &Tensor) -> TensorSpec {
        TensorSpec { name: name.into(), kind: t.kind(), shape: t.size(), optional: false }
    }

    /// Bytes of its data.
    pub fn bytes(&self) -> u64 {
        let n = self.shape.iter().fold(1u64, |n, &d| n.saturating_mul(u64::try_from(d).unwrap_or(0)));
        n.saturating_mul(self.kind.elt_size_in_bytes() as u64)
    }
}

/// The tensors one rank's checkpoint files must hold, known from the
/// training state before anything is restored.
#[derive(Debug, Clone, Default)]
pub struct Layout {
    /// The model file's tensors, in the order written (rank 0 writes it;
    /// every rank reads it).
    pub model: Vec<TensorSpec>,
    /// This rank's state file: buffers, optimizer and loss-scaler state,
    /// random generators.
    pub state: Vec<TensorSpec>,
    /// The plugin slots whose states this rank's file holds
    /// (`plugin/<slot>`, bytes).
    pub plugins: Vec<String>,
    /// The most bytes a plugin's state may hold.
    pub plugin_state_cap: u64,
}

/// One file's part of a [`Layout`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct FileLayout<'a> {
    specs: &'a [TensorSpec],
    plugins: &'a [String],
    plugin_cap: u64,
}

impl Layout {
    /// Exactly what `snap` holds (benchmarks and tests: a run takes its
    /// layout from its training state); a plugin state may be as large as
    /// the largest it holds, or 1 MiB.
    pub fn of(snap: &Snapshot) -> Layout {
        let specs = |v: &[(String, Tensor)]| v.iter().map(|(n, t)| TensorSpec::of(n.clone(), t)).collect();
        let largest = snap.plugins.iter().map(|(_, b)| b.len() as u64).max().unwrap_or(0);
        Layout {
            model: specs(&snap.model),
            state: specs(&snap.state),
            plugins: snap.plugins.iter().map(|(s, _)| s.clone()).collect(),
            plugin_state_cap: largest.max(1 << 20),
        }
    }

    /// The model file's part.
    pub(crate) fn model(&self) -> FileLayout<'_> {
        FileLayout { specs: &self.model, plugins: &[], plugin_cap: 0 }
    }

    /// This rank's state file's part.
    pub(crate) fn state(&self) -> FileLayout<'_> {
        FileLayout { specs: &self.state, plugins: &self.plugins, plugin_cap: self.plugin_state_cap }
    }
}

impl FileLayout<'_> {
    /// The most bytes of tensor data the file may hold.
    fn max_data(&self) -> u64 {
        let specs = self.specs.iter().fold(0u64, |n, s| n.saturating_add(s.bytes()));
        specs.saturating_add((self.plugins.len() as u64).saturating_mul(self.plugin_cap))
    }

    /// The most bytes the (uncompressed) file may hold: its 8-byte length,
    /// the longest header it could have (every tensor present, every
    /// offset as long as the largest) and its data.
    pub(crate) fn max_uncompressed(&self) -> u64 {
        let total = self.max_data();
        let at = [total, total];
        let mut entries: Vec<(String, &str, Vec<i64>, [u64; 2])> =
            self.specs.iter().map(|s| (s.name.clone(), dtype_name(s.kind).unwrap_or("F64"), s.shape.clone(), at)).collect();
        let cap = i64::try_from(self.plugin_cap).unwrap_or(i64::MAX);
        entries.extend(self.plugins.iter().map(|p| (format!("plugin/{p}"), "U8", vec![cap], at)));
        (8 + header_json(&entries).len() as u64).saturating_add(total)
    }

    /// The exact size of the (uncompressed) file, when it holds nothing
    /// optional: the model file.
    pub(crate) fn exact(&self) -> Option<u64> {
        if !self.plugins.is_empty() || self.specs.iter().any(|s| s.optional) {
            return None;
        }
        let mut at = 0;
        let mut entries = Vec::new();
        for s in self.specs {
            entries.push((s.name.clone(), dtype_name(s.kind).ok()?, s.shape.clone(), [at, at + s.bytes()]));
            at += s.bytes();
        }
        Some(8 + header_json(&entries).len() as u64 + at)
    }

    /// The most bytes the file may hold on disk (zstd's bound for what
    /// compresses worst, when compressed).
    pub(crate) fn max_file(&self, compressed: bool) -> u64 {
        let n = self.max_uncompressed();
        if !compressed {
            return n;
        }
        let bound = zstd::zstd_safe::compress_bound(usize::try_from(n).unwrap_or(usize::MAX)) as u64;
        // Frames written in a stream carry a little more than one block's
        // headers: a margin, generous and still bounded.
        bound.saturating_add(n / 128).saturating_add(1 << 20)
    }

    /// Refuses the tensors a file's header lists (`dir`'s file `file`)
    /// unless they are exactly this layout's: every tensor the run has,
    /// with its dtype and shape, each plugin state as bytes within the cap,
    /// nothing else.
    pub(crate) fn check(&self, dir: &Path, file: &str, tensors: &[(String, Kind, Vec<i64>)]) -> Result<()> {
        for (name, kind, shape) in tensors {
            let field = format!("{file}: tensor {name}");
            if let Some(slot) = name.strip_prefix("plugin/").filter(|s| self.plugins.iter().any(|p| p == s)) {
                let fits = *kind == Kind::Uint8 && shape.len() == 1 && u64::try_from(shape[0]).is_ok_and(|n| n <= self.plugin_cap);
                if !fits {
                    let why =
                        format!("is {kind:?} of shape {shape:?}; the state of the `{slot}` plugin is bytes, at most {}", self.plugin_cap);
                    return Err(refused(dir, field, why));
                }
                continue;
            }
            match self.specs.iter().find(|s| &s.name == name) {
                Some(s) if s.kind == *kind && &s.shape == shape => {}
                Some(s) => {
                    let why = format!("is {kind:?} of shape {shape:?}; this run's is {:?} of shape {:?}", s.kind, s.shape);
                    return Err(refused(dir, field, why));
                }
                None => return Err(refused(dir, field, "is not a tensor this run has")),
            }
        }
        let has = |n: &str| tensors.iter().any(|t| t.0 == n);
        if let Some(s) = self.specs.iter().find(|s| !s.optional && !has(&s.name)) {
            return Err(refused(dir, format!("{file}: tensor {}", s.name), "is missing"));
        }
        if let Some(p) = self.plugins.iter().find(|p| !has(&format!("plugin/{p}"))) {
            return Err(refused(dir, format!("{file}: tensor plugin/{p}"), format!("is missing: the state of the `{p}` plugin")));
        }
        Ok(())
    }
}

/// How `lr_scale` is bounded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrScale {
    /// Always this value (the built-in fixed batch policy: 1).
    Exactly(f64),
    /// Finite, positive and at most this.
    UpTo(f64),
}

/// The range of every field of a checkpoint's position: what the run could
/// have produced.
#[derive(Debug, Clone)]
pub struct Bounds {
    /// The run's planned steps, if it has them.
    pub max_step: Option<u64>,
    pub micro_batch: (u32, u32),
    pub accum_steps: (u32, u32),
    pub lr_scale: LrScale,
    /// What sets the batch bounds, for messages.
    pub policy: String,
}

impl Bounds {
    /// The built-in fixed batch policy: the workload's micro-batch (lowered
    /// only by out-of-memory retries) and accumulation steps, `lr_scale` 1.
    pub fn fixed(batch: u32, accum: u32, steps: Option<u64>) -> Bounds {
        Bounds {
            max_step: steps,
            micro_batch: (1, batch),
            accum_steps: (accum, accum),
            lr_scale: LrScale::Exactly(1.0),
            policy: format!("the batch policy `fixed`: the workload's batch {batch} x {accum}, lowered only by out-of-memory retries"),
        }
    }

    /// A batch-policy plugin `name`: what the host accepts from one
    /// (micro-batch and accumulation steps in 1..=`max_batch`, `lr_scale`
    /// finite, positive and at most [`MAX_LR_SCALE`]).
    pub fn plugin(name: &str, max_batch: u32, steps: Option<u64>) -> Bounds {
        Bounds {
            max_step: steps,
            micro_batch: (1, max_batch),
            accum_steps: (1, max_batch),
            lr_scale: LrScale::UpTo(MAX_LR_SCALE),
            policy: format!("what the host accepts from the batch-policy plugin `{name}`"),
        }
    }

    /// Refuses `p` (the position of the checkpoint in `dir`, whose folder
    /// is named for `folder_step`) unless every field lies within these
    /// bounds.
    pub(crate) fn check(&self, dir: &Path, folder_step: u64, p: &Position) -> Result<()> {
        let out = |field: &str, why: String| refused(dir, format!("position.{field}"), why);
        if p.step != folder_step {
            return Err(out("step", format!("is {}, but the folder is named for step {folder_step}", p.step)));
        }
        if p.step == 0 || p.step > MAX_COUNT {
            return Err(out("step", format!("is {}, outside 1..={MAX_COUNT}", p.step)));
        }
        if let Some(max) = self.max_step.filter(|&m| p.step > m) {
            return Err(out("step", format!("is {}, beyond the {max} steps the run plans", p.step)));
        }
        let within = |field: &str, v: u32, (lo, hi): (u32, u32)| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(out(field, format!("is {v}, outside {lo}..={hi} ({})", self.policy)))
            }
        };
        within("micro_batch", p.micro_batch, self.micro_batch)?;
        within("accum_steps", p.accum_steps, self.accum_steps)?;
        let lr = p.lr_scale;
        match self.lr_scale {
            LrScale::Exactly(x) if lr.to_bits() != x.to_bits() => {
                return Err(out("lr_scale", format!("is {lr}, not {x} ({})", self.policy)))
            }
            LrScale::UpTo(max) if !(lr.is_finite() && lr > 0.0 && lr <= max) => {
                return Err(out("lr_scale", format!("is {lr}; it must be finite, positive and at most {max} ({})", self.policy)));
            }
            _ => {}
        }
        // Every step drew at least one sample per rank; each draw (steps,
        // and out-of-memory attempts, at most one per micro-batch size
        // below the largest) at most the largest batch.
        let largest = u64::from(self.micro_batch.1) * u64::from(self.accum_steps.1);
        let most = p.step.saturating_add(u64::from(self.micro_batch.1)).saturating_mul(largest).min(MAX_COUNT);
        if !(p.step..=most).contains(&p.data_position) {
            let why = format!("is {}, outside {}..={most} (the samples {} steps can have drawn)", p.data_position, p.step, p.step);
            return Err(out("data_position", why));
        }
        Ok(())
    }
}

/// What a run accepts from its checkpoints: the tensors their files hold
/// and the range of their positions.
#[derive(Debug, Clone)]
pub struct Accept {
    pub layout: Layout,
    pub bounds: Bounds,
}

/// The safetensors dtype of a tensor kind.
pub(super) fn dtype_name(kind: Kind) -> Result<&'static str> {
    Ok(match kind {
        Kind::Float => "F32",
        Kind::Double => "F64",
        Kind::Half => "F16",
        Kind::BFloat16 => "BF16",
        Kind::Int64 => "I64",
        Kind::Int => "I32",
        Kind::Int16 => "I16",
        Kind::Int8 => "I8",
        Kind::Uint8 => "U8",
        Kind::Bool => "BOOL",
        k => anyhow::bail!("a checkpoint cannot hold {k:?} tensors"),
    })
}

/// The JSON header of a safetensors file holding `entries` (name, dtype,
/// shape, data offsets), padded to 8 bytes.
pub(super) fn header_json(entries: &[(String, &str, Vec<i64>, [u64; 2])]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    for (name, dtype, shape, at) in entries {
        header.insert(name.clone(), serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": at }));
    }
    let mut json = serde_json::to_vec(&header).expect("a header serialises");
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    json
}
