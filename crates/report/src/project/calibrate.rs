//! What a projection is calibrated on, read from result files and
//! `harness bench allreduce` records with their own types: the step's
//! compute on one GPU ([`Compute`]), a strategy's collectives and its cost
//! outside them ([`Profile`]), and the collectives' bandwidth on the
//! machine ([`Bench`]).

use std::path::{Path, PathBuf};

use harness_format::bench::{AllreduceBench, BenchBuckets};
use harness_format::histogram;
use harness_format::link::Op;
use harness_format::results::{EntryResult, EntryStatus, Metrics, RunResult};
use harness_format::suite::{NcclTransport, Strategy};

use super::cluster::{Algo, Cluster};

/// A result file, read.
#[derive(Debug, Clone)]
pub struct Source {
    pub path: PathBuf,
    pub result: RunResult,
}

impl Source {
    pub fn read(path: &Path) -> anyhow::Result<Source> {
        Ok(Source { path: path.to_owned(), result: RunResult::read(path)? })
    }

    /// The strategy an entry ran, from the plan.
    pub fn strategy(&self, e: &EntryResult) -> Option<&Strategy> {
        self.result.plan.iter().find(|p| p.id == e.id).map(|p| &p.strategy)
    }

    /// The entries that finished, with their metrics.
    pub fn ok(&self) -> impl Iterator<Item = (&EntryResult, &Metrics)> {
        self.result.entries.iter().filter(|e| e.status == EntryStatus::Ok).filter_map(|e| e.metrics.as_ref().map(|m| (e, m)))
    }

    /// `file#entry`, naming where a figure came from.
    pub fn name(&self, e: &EntryResult) -> String {
        format!("{}#{}", self.path.file_name().map_or("?".into(), |f| f.to_string_lossy()), e.id)
    }

    /// The machine's first GPU, by name.
    pub fn gpu(&self) -> Option<String> {
        self.result.machine.gpus.first().map(|g| g.name.clone())
    }

    pub fn revision(&self) -> &str {
        &self.result.machine.git_revision
    }
}

/// A `harness bench allreduce` record, and whether it ran over NCCL's
/// network transport (the record does not say: the caller does); or, where
/// no bench ran on a machine, the all-reduce bus bandwidth one entry of a
/// result file measured in training (`FILE#ENTRY`).
#[derive(Debug, Clone)]
pub struct Bench {
    pub path: PathBuf,
    pub network: bool,
    pub record: AllreduceBench,
    /// The entry it was read from, for a bandwidth measured in training.
    pub entry: Option<String>,
    /// That entry's GPU: a bandwidth measured in training calibrates
    /// entries of the same GPU only (a bench record does not name its
    /// machine: give one machine's records per call).
    pub gpu: Option<String>,
}

impl Bench {
    /// Reads `PATH`, `network=PATH`, or `FILE#ENTRY` (`network=` too).
    pub fn read(arg: &str) -> anyhow::Result<Bench> {
        let (network, path) = match arg.split_once('=') {
            Some(("network", p)) => (true, p),
            Some(("nvlink", p)) => (false, p),
            Some((k, _)) => anyhow::bail!("bench `{arg}`: `{k}=` is not `network=` or `nvlink=`"),
            None => (false, arg),
        };
        if let Some((file, entry)) = path.split_once('#') {
            return Bench::in_run(Path::new(file), entry, network);
        }
        let path = PathBuf::from(path);
        let record = AllreduceBench::read(&path)?;
        anyhow::ensure!(record.buckets.busbw_gbs > 0.0, "{}: bus bandwidth is not positive", path.display());
        Ok(Bench { path, network, record, entry: None, gpu: None })
    }

    /// The all-reduce bus bandwidth that entry `id` of the result file at
    /// `path` measured in training: the mean all-reduce beside the backward
    /// pass (waits for the other ranks included), so it is lower than a
    /// bench's; the slowdown fitted on the same entry then absorbs less. An
    /// entry over an emulated link has no bandwidth of the machine's own.
    pub fn in_run(path: &Path, id: &str, network: bool) -> anyhow::Result<Bench> {
        let src = Source::read(path)?;
        let Some((e, m)) = src.ok().find(|(e, _)| e.id == id) else {
            anyhow::bail!("{}: no finished entry `{id}` (the form is FILE#ENTRY)", path.display())
        };
        Bench::of_entry(&src, e, m, network)
    }

    /// [`Bench::in_run`] of an entry already read.
    pub fn of_entry(src: &Source, e: &EntryResult, m: &Metrics, network: bool) -> anyhow::Result<Bench> {
        let (path, id) = (src.path.as_path(), e.id.as_str());
        let s = src.strategy(e);
        anyhow::ensure!(s.is_some_and(|s| s.link.is_none()), "{}#{id}: ran over an emulated link, not the machine's own", path.display());
        anyhow::ensure!(m.world_size >= 2, "{}#{id}: ran on one GPU: no collective", path.display());
        let Some(r) = m.collective_ops.get(Op::AllReduce.name()) else { anyhow::bail!("{}#{id}: recorded no all-reduce", path.display()) };
        let busbw = r.busbw_gbs.unwrap_or(0.0);
        anyhow::ensure!(busbw > 0.0 && r.collectives > 0, "{}#{id}: recorded no all-reduce bandwidth", path.display());
        let n = m.world_size as f64;
        let steps = m.steps.max(1) as f64;
        let bytes = r.bytes as f64 / steps;
        let algbw = busbw * n / (2.0 * (n - 1.0));
        let record = AllreduceBench {
            world_size: m.world_size,
            stream: None,
            timed: Some(true),
            buckets: BenchBuckets {
                count: (r.collectives as f64 / steps).round() as u64,
                bytes: bytes.round() as u64,
                ms_per_step: bytes / (algbw * 1e9) * 1e3,
                algbw_gbs: algbw,
                busbw_gbs: busbw,
            },
        };
        Ok(Bench {
            path: path.to_owned(),
            network: network || s.is_some_and(self::network),
            record,
            entry: Some(id.to_owned()),
            gpu: src.gpu(),
        })
    }

    /// Where the bandwidth came from: the file, or `file#entry (in training)`.
    pub fn name(&self) -> String {
        match &self.entry {
            Some(e) => format!("{}#{e} (in training)", self.path.display()),
            None => self.path.display().to_string(),
        }
    }

    /// The bus bandwidth as a link's Gbit/s: a ring all-reduce of S bytes
    /// over it takes 2(n-1)/n S / busbw, as the bench measured.
    pub fn gbps(&self) -> f64 {
        self.record.buckets.busbw_gbs * 8.0
    }

    pub fn world(&self) -> usize {
        self.record.world_size as usize
    }

    /// Whether it was measured by entry `e` of `src` itself.
    pub fn is_of(&self, src: &Source, e: &EntryResult) -> bool {
        self.entry.as_deref() == Some(e.id.as_str()) && self.path == src.path
    }
}

/// Whether two entries did the same work on each rank: the same resolved
/// model, precision, micro-batch with its accumulation at the start, and
/// kernels (harness's fused cross-entropy and LayerNorm, which change the
/// step's compute, not its gradients).
pub fn same_work(a: &Metrics, b: &Metrics) -> bool {
    same_gradients(a, b)
        && a.batch_changes.first().map(|c| (c.1, c.2)) == b.batch_changes.first().map(|c| (c.1, c.2))
        && a.fused_cross_entropy == b.fused_cross_entropy
        && a.fused_layer_norm == b.fused_layer_norm
}

/// Whether two entries' gradients are the same: the same resolved model
/// and precision (whatever the batch or the kernels).
pub fn same_gradients(a: &Metrics, b: &Metrics) -> bool {
    a.model == b.model && a.precision == b.precision
}

/// The compressor artifact an entry ran (its sha256), if it recorded one.
fn compressor_sha(m: &Metrics) -> Option<&str> {
    m.plugins.iter().find(|p| p.slot == "compressor").map(|p| p.manifest.sha256.as_str())
}

/// Whether two entries ran the same compressor artifact, where both
/// recorded one.
pub fn same_artifact(a: &Metrics, b: &Metrics) -> bool {
    match (compressor_sha(a), compressor_sha(b)) {
        (Some(x), Some(y)) => x == y,
        _ => true,
    }
}

/// Tokens of one step on all ranks.
pub fn tokens_per_step(m: &Metrics) -> f64 {
    m.tokens as f64 / m.steps.max(1) as f64
}

/// The mean step in seconds that the entry's throughput implies.
pub fn measured_step(m: &Metrics) -> f64 {
    tokens_per_step(m) / m.tokens_per_s
}

fn phase(m: &Metrics, name: &str) -> f64 {
    m.phases.get(name).map_or(0.0, |l| l.mean_ms * 1e-3)
}

/// The step of one GPU, in seconds (means over the timed steps).
#[derive(Debug, Clone, PartialEq)]
pub struct Compute {
    /// `file#entry` it came from.
    pub from: String,
    pub forward: f64,
    pub backward: f64,
    pub optimizer: f64,
    pub data: f64,
    /// The step less its phases (host gaps, the strategy hooks).
    pub other: f64,
    /// The mean step the throughput implies.
    pub step: f64,
    /// Tokens of one step of one rank.
    pub tokens_per_step: f64,
    /// The step histogram's 10th and 90th percentiles over its median: the
    /// spread a projection's interval carries.
    pub lo_ratio: f64,
    pub hi_ratio: f64,
}

impl Compute {
    /// From an entry that ran on one GPU.
    pub fn of(src: &Source, e: &EntryResult, m: &Metrics) -> Option<Compute> {
        if m.world_size != 1 || m.tokens_per_s <= 0.0 || !m.phases.contains_key("backward") {
            return None;
        }
        let step = measured_step(m);
        let (forward, backward, optimizer, data) = (phase(m, "forward"), phase(m, "backward"), phase(m, "optimizer"), phase(m, "data"));
        let rest: f64 = ["communicate", "strategy"].iter().map(|p| phase(m, p)).sum();
        let (lo_ratio, hi_ratio) = e
            .histograms
            .get("step")
            .and_then(|h| histogram::decode(h).ok())
            .filter(|h| !h.is_empty())
            .map(|h| {
                let q = |x: f64| h.value_at_quantile(x) as f64;
                (q(0.1) / q(0.5), q(0.9) / q(0.5))
            })
            .unwrap_or((1.0, 1.0));
        Some(Compute {
            from: src.name(e),
            forward,
            backward,
            optimizer,
            data,
            other: (step - forward - backward - optimizer - data - rest).max(0.0),
            step,
            tokens_per_step: tokens_per_step(m),
            lo_ratio,
            hi_ratio,
        })
    }
}

/// One kind of collective a strategy issues every step.
#[derive(Debug, Clone, PartialEq)]
pub struct Use {
    pub op: Op,
    /// Collectives of this kind per step.
    pub per_step: f64,
    /// Mean nccl-tests size of one, bytes, at the profile's world size.
    pub bytes: f64,
}

/// A compressor's own cost, from an entry that ran it on one GPU: there its
/// plugin runs on every bucket and its collectives are no-ops, so the
/// `communicate` phase is the compressor's work alone (and the host's
/// around it), with no collective.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnCost {
    /// `file#entry` it came from.
    pub from: String,
    /// Seconds per step of the `communicate` phase.
    pub seconds: f64,
    /// Buckets per step: the plugin's calls over the timed steps (one call
    /// per bucket and step, and a few outside them), if it recorded any.
    pub buckets: Option<usize>,
}

impl OwnCost {
    /// From a one-GPU entry of a strategy other than the plain all-reduce
    /// (no ZeRO: a compressor).
    pub fn of(src: &Source, e: &EntryResult, m: &Metrics) -> Option<OwnCost> {
        let s = src.strategy(e)?;
        if m.world_size != 1 || plain(s) || s.zero != 0 || !m.phases.contains_key("communicate") {
            return None;
        }
        let buckets = m.plugins.iter().find(|p| p.slot == "compressor").map(|p| (p.calls / m.steps.max(1)) as usize).filter(|&b| b > 0);
        Some(OwnCost { from: src.name(e), seconds: phase(m, "communicate"), buckets })
    }
}

/// Whether a compressor's messages are, bucket by bucket, a fixed share of
/// the bucket's bytes, whatever the bucket and the model: fp16 sends each
/// bucket's values in half precision, top-k at a fixed ratio the largest
/// `ratio` of them with their indices. Then the messages of one workload
/// scale to another's gradients. Not PowerSGD (its factors follow the
/// matrices' shapes and its rank), nor a compressor this does not know.
pub fn scales_with_bucket_bytes(s: &Strategy) -> Option<&'static str> {
    let ratio = s.compressor_config.as_ref().and_then(|c| c.get("ratio")).is_some();
    match s.compressor.as_str() {
        "fp16" => Some("each bucket's values in half precision"),
        "topk" if ratio => Some("each bucket's largest `ratio` of values with their indices"),
        _ => None,
    }
}

/// A strategy as the model runs it: its gradient buckets, the collectives
/// it issues per step, and what its communicate phase costs beside them.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    pub name: String,
    pub compressor: String,
    pub zero: u8,
    /// `file#entry` it came from.
    pub from: String,
    /// World size it was measured at.
    pub world: usize,
    /// Gradient bucket sizes in reduction order.
    pub buckets: Vec<u64>,
    /// The built-in all-reduce without ZeRO: one all-reduce per bucket,
    /// which can overlap the backward pass.
    pub plain: bool,
    pub uses: Vec<Use>,
    /// Seconds per step of the communicate phase outside its collectives
    /// (a compressor's own work, ZeRO's copies), held to the same at every
    /// world size.
    pub overhead: f64,
    /// The optimizer phase at `world` (ZeRO shards it).
    pub optimizer: f64,
    /// The steps its entry took to reach the suite's target, at its world
    /// size, where it recorded them ([`ToTarget`]).
    pub to_target: Option<ToTarget>,
}

/// Steps to the target measured at a world size: at that world size (the
/// same batch per GPU, so the same global batch) a cluster's time to the
/// target is those steps at its predicted step; at another, the global
/// batch differs and with it the steps, which the model does not predict.
#[derive(Debug, Clone, PartialEq)]
pub struct ToTarget {
    pub steps: u64,
    pub world: usize,
    /// `file#entry` it came from.
    pub from: String,
}

impl ToTarget {
    fn of(src: &Source, e: &EntryResult, m: &Metrics) -> Option<ToTarget> {
        m.steps_to_target.map(|steps| ToTarget { steps, world: m.world_size as usize, from: src.name(e) })
    }
}

/// The built-in all-reduce, no ZeRO.
pub fn plain(s: &Strategy) -> bool {
    s.compressor == "allreduce" && s.zero == 0
}

/// Whether two strategies are the same up to their name, emulated link and
/// NCCL transport.
pub fn same_strategy(a: &Strategy, b: &Strategy) -> bool {
    a.compressor == b.compressor && a.zero == b.zero && a.compressor_config == b.compressor_config && a.reduce_dtype == b.reduce_dtype
}

impl Profile {
    /// The built-in all-reduce over `buckets`.
    pub fn all_reduce(name: &str, buckets: &[u64], from: String) -> Profile {
        Profile {
            name: name.into(),
            compressor: "allreduce".into(),
            zero: 0,
            from,
            world: 0,
            buckets: buckets.to_vec(),
            plain: true,
            uses: Vec::new(),
            overhead: 0.0,
            optimizer: 0.0,
            to_target: None,
        }
    }

    /// From a multi-GPU entry that recorded its collectives per kind, and
    /// the cluster it ran on (its machine's measured bandwidth, its
    /// emulated link). What its communicate phase took beyond the model's
    /// time of its collectives on that cluster is the strategy's own cost:
    /// the compressor's work, and whatever each collective costs that the
    /// alpha-beta model leaves out (waiting for the other ranks, launches).
    pub fn of(src: &Source, e: &EntryResult, m: &Metrics, ran_on: &Cluster) -> Option<Profile> {
        let s = src.strategy(e)?;
        let n = m.world_size as usize;
        if n < 2 || m.bucket_bytes.is_empty() {
            return None;
        }
        if plain(s) {
            return Some(Profile { to_target: ToTarget::of(src, e, m), ..Profile::all_reduce(&s.name, &m.bucket_bytes, src.name(e)) });
        }
        let uses = uses(m)?;
        let in_collectives: f64 = uses.iter().map(|u| u.per_step * ran_on.time(u.op, u.bytes)).sum();
        Some(Profile {
            name: s.name.clone(),
            compressor: s.compressor.clone(),
            zero: s.zero,
            from: src.name(e),
            world: n,
            buckets: m.bucket_bytes.clone(),
            plain: false,
            uses,
            overhead: (phase(m, "communicate") - in_collectives).max(0.0),
            optimizer: phase(m, "optimizer"),
            to_target: ToTarget::of(src, e, m),
        })
    }

    /// From a multi-GPU entry's collectives (their kinds, counts and sizes:
    /// the method's messages, structure like its buckets, not a timing) and
    /// the compressor's own cost measured on one GPU: nothing of the
    /// entry's time is used.
    pub fn of_one_gpu(src: &Source, e: &EntryResult, m: &Metrics, cost: &OwnCost) -> Option<Profile> {
        let s = src.strategy(e)?;
        let n = m.world_size as usize;
        if n < 2 || plain(s) || s.zero != 0 || m.bucket_bytes.is_empty() {
            return None;
        }
        Some(Profile {
            name: s.name.clone(),
            compressor: s.compressor.clone(),
            zero: 0,
            from: format!("{} (own cost, 1 GPU) + {} (collective sizes)", cost.from, src.name(e)),
            world: n,
            buckets: m.bucket_bytes.clone(),
            plain: false,
            uses: uses(m)?,
            overhead: cost.seconds,
            optimizer: phase(m, "optimizer"),
            to_target: ToTarget::of(src, e, m),
        })
    }

    /// This compressor's messages scaled to gradients of `bytes` in
    /// `buckets` buckets, each collective kind keeping its count per bucket
    /// and its share of a bucket's bytes (true where
    /// [`scales_with_bucket_bytes`] says so), with the own cost `cost`
    /// measured on those gradients.
    pub fn scaled(&self, bytes: u64, buckets: usize, cost: &OwnCost) -> Profile {
        let (src_bytes, src_buckets) = (self.buckets.iter().sum::<u64>().max(1) as f64, self.buckets.len().max(1) as f64);
        let uses = self
            .uses
            .iter()
            .map(|u| {
                let per_step = u.per_step / src_buckets * buckets as f64;
                let share = u.per_step * u.bytes / src_bytes;
                Use { op: u.op, per_step, bytes: share * bytes as f64 / per_step.max(1e-12) }
            })
            .collect();
        let count = buckets.max(1) as u64;
        let mut sizes = vec![bytes / count; count as usize];
        if let Some(last) = sizes.last_mut() {
            *last += bytes % count;
        }
        Profile {
            from: format!("{} (own cost, 1 GPU) + {} (messages scaled per bucket)", cost.from, self.from),
            buckets: sizes,
            uses,
            overhead: cost.seconds,
            // Another workload's steps say nothing of this one's.
            to_target: None,
            ..self.clone()
        }
    }

    /// The size of one collective of `u` at world size `n`: a compressor's
    /// all-gather gathers a fixed share from every rank, so it grows with
    /// the world; ZeRO's all-gather of the parameters, an all-reduce or a
    /// reduce-scatter moves the same buffer at any size.
    pub fn bytes_at(&self, u: &Use, n: usize) -> f64 {
        match u.op {
            Op::AllGather if self.world > 0 && self.zero == 0 => u.bytes * n as f64 / self.world as f64,
            _ => u.bytes,
        }
    }
}

/// An entry's collectives per step, per kind, with their mean nccl-tests
/// size; none if it recorded none.
fn uses(m: &Metrics) -> Option<Vec<Use>> {
    let steps = m.steps.max(1) as f64;
    let mut uses = Vec::new();
    for op in Op::ALL {
        let Some(r) = m.collective_ops.get(op.name()) else { continue };
        if r.collectives > 0 {
            uses.push(Use { op, per_step: r.collectives as f64 / steps, bytes: r.bytes as f64 / r.collectives as f64 });
        }
    }
    (!uses.is_empty()).then_some(uses)
}

/// Whether a strategy reduced over NCCL's network transport.
pub fn network(s: &Strategy) -> bool {
    s.nccl_transport == NcclTransport::Network
}

/// The bench for an entry of `src` on `n` GPUs (over the network transport
/// or not) whose buckets hold `bytes`: the same world size and transport,
/// the same buckets and folder first.
/// A bandwidth an entry measured in training is never its own calibration
/// under `--check` (`except`).
pub fn pick_bench<'a>(
    benches: &'a [Bench],
    src: &Source,
    n: usize,
    net: bool,
    bytes: u64,
    except: Option<&EntryResult>,
) -> Option<&'a Bench> {
    let dir = src.path.parent();
    benches
        .iter()
        .filter(|b| b.world() == n && b.network == net && !except.is_some_and(|e| b.is_of(src, e)))
        .filter(|b| b.gpu.is_none() || b.gpu == src.gpu())
        .min_by_key(|b| (b.entry.is_some(), b.record.buckets.bytes != bytes, b.path.parent() != dir))
}

/// The cluster an entry of strategy `s` ran on, `n` GPUs of a machine
/// whose all-reduce bus bandwidth is `intra_gbps`, and a short name for it:
/// the machine itself, or the link the strategy emulated (its nodes, each
/// of its ranks per node; a ring between them, as the emulation times it).
pub fn run_cluster(s: &Strategy, n: usize, intra_gbps: f64) -> (Cluster, String) {
    let machine = Cluster {
        nodes: 1,
        gpus_per_node: n,
        intra_gbps: Some(intra_gbps),
        intra_latency_us: 0.0,
        net_gbps: 0.0,
        net_latency_us: 0.0,
        algo: Algo::Ring,
    };
    match s.link {
        Some(l) => {
            let (nodes, g) = l.topology(n);
            let c = Cluster { nodes, gpus_per_node: g, net_gbps: l.gbps, net_latency_us: l.latency_us, ..machine };
            (c, format!("{nodes}x{g} {}Gbps", l.gbps))
        }
        None => (machine, if network(s) { "network".into() } else { "nvlink".into() }),
    }
}

/// An entry's own cluster, from the bench that matches it.
pub fn entry_cluster(benches: &[Bench], src: &Source, e: &EntryResult, m: &Metrics) -> Option<Cluster> {
    let s = src.strategy(e)?;
    let n = m.world_size as usize;
    let bench = pick_bench(benches, src, n, network(s), m.bucket_bytes.iter().sum(), None)?;
    Some(run_cluster(s, n, bench.gbps()).0)
}
