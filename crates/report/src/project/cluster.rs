//! The cluster a projection runs on: nodes x GPUs per node, the link inside
//! a node and the network between nodes (bandwidth and latency each), and
//! the time of one collective over it: NCCL's ring or tree, flat inside a
//! node, hierarchical across nodes (within each node, between nodes, within
//! each node again).
//!
//! A cluster is written as a compact string (docs/projection.md):
//! `NODESxGPUS[:key=value,...]`, e.g. `64x8:nvlink=450GBps,net=100Gbps`.
//! `NODES` may be a range of powers of two, `1-128x8`, for one cluster per
//! size. Keys: `nvlink` (or `intra`): the bus bandwidth inside a node, with
//! a unit (`GBps` bytes, `Gbps` bits per second) or `measured` (the
//! default: what `harness bench allreduce` measured); `nvlink_lat`: its
//! per-step latency (`us`, `ms`; default 0); `net` (or `inter`): each node's
//! link to the others, shared by its GPUs (as an emulated `link` with
//! `nodes`); `net_lat`: its per-step latency (default 5us); `algo`: `ring`,
//! `tree` or `auto` (the faster of the two, as NCCL's tuner picks; the
//! default) for the all-reduce between nodes.

use harness_format::link::{Link, Op};

/// NCCL's all-reduce algorithm between nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    Ring,
    Tree,
    /// The faster of ring and tree for each message.
    Auto,
}

/// A cluster to project on.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    pub nodes: usize,
    pub gpus_per_node: usize,
    /// Bus bandwidth inside a node, Gbit/s; None: the measured one.
    pub intra_gbps: Option<f64>,
    pub intra_latency_us: f64,
    /// Each node's link to the others, Gbit/s (unused on one node).
    pub net_gbps: f64,
    pub net_latency_us: f64,
    pub algo: Algo,
}

/// What is wrong with a cluster string.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecError(pub String);

impl std::fmt::Display for SpecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::error::Error for SpecError {}

fn err<T>(s: &str, why: impl std::fmt::Display) -> Result<T, SpecError> {
    Err(SpecError(format!(
        "cluster `{s}`: {why} (expected NODESxGPUS[:key=value,...], e.g. `64x8:nvlink=450GBps,net=100Gbps`; keys nvlink, nvlink_lat, net, net_lat, algo)"
    )))
}

/// A bandwidth with its unit, in Gbit/s: `100Gbps`, `450GBps`.
fn bandwidth(s: &str, v: &str) -> Result<f64, SpecError> {
    let (num, scale) = if let Some(n) = v.strip_suffix("GBps").or_else(|| v.strip_suffix("GB/s")) {
        (n, 8.0)
    } else if let Some(n) = v.strip_suffix("Gbps").or_else(|| v.strip_suffix("Gbit/s")) {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix("Tbps") {
        (n, 1000.0)
    } else {
        return err(s, format!("bandwidth `{v}` needs a unit: Gbps (bits) or GBps (bytes) per second"));
    };
    match num.trim().parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x * scale),
        _ => err(s, format!("bandwidth `{v}` is not a positive number")),
    }
}

/// A latency with its unit, in microseconds: `5us`, `0.01ms`.
fn latency(s: &str, v: &str) -> Result<f64, SpecError> {
    let (num, scale) = if let Some(n) = v.strip_suffix("us") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1000.0)
    } else {
        return err(s, format!("latency `{v}` needs a unit: us or ms"));
    };
    match num.trim().parse::<f64>() {
        Ok(x) if x >= 0.0 && x.is_finite() => Ok(x * scale),
        _ => err(s, format!("latency `{v}` is not a number of at least 0")),
    }
}

fn count(s: &str, v: &str, what: &str) -> Result<usize, SpecError> {
    match v.trim().parse::<usize>() {
        Ok(x) if (1..=1 << 16).contains(&x) => Ok(x),
        _ => err(s, format!("{what} `{v}` is not a whole number from 1 to 65536")),
    }
}

impl Cluster {
    /// Parses a cluster string; a range of nodes (`1-128x8`) gives one
    /// cluster per power of two in it.
    pub fn parse(s: &str) -> Result<Vec<Cluster>, SpecError> {
        let (shape, keys) = s.split_once(':').unwrap_or((s, ""));
        let Some((nodes, gpus)) = shape.split_once('x') else { return err(s, "no `x` between nodes and GPUs per node") };
        let gpus_per_node = count(s, gpus, "GPUs per node")?;
        let node_counts: Vec<usize> = match nodes.split_once('-') {
            None => vec![count(s, nodes, "nodes")?],
            Some((a, b)) => {
                let (a, b) = (count(s, a, "nodes")?, count(s, b, "nodes")?);
                if a > b {
                    return err(s, "the range of nodes runs backwards");
                }
                std::iter::successors(Some(a), |&n| Some(n * 2)).take_while(|&n| n <= b).collect()
            }
        };
        let mut c = Cluster {
            nodes: 1,
            gpus_per_node,
            intra_gbps: None,
            intra_latency_us: 0.0,
            net_gbps: 0.0,
            net_latency_us: 5.0,
            algo: Algo::Auto,
        };
        let mut net = false;
        for kv in keys.split(',').filter(|k| !k.trim().is_empty()) {
            let Some((k, v)) = kv.split_once('=') else { return err(s, format!("`{kv}` is not key=value")) };
            let v = v.trim();
            match k.trim() {
                "nvlink" | "intra" if v == "measured" => c.intra_gbps = None,
                "nvlink" | "intra" => c.intra_gbps = Some(bandwidth(s, v)?),
                "nvlink_lat" | "intra_lat" => c.intra_latency_us = latency(s, v)?,
                "net" | "inter" => {
                    c.net_gbps = bandwidth(s, v)?;
                    net = true;
                }
                "net_lat" | "inter_lat" => c.net_latency_us = latency(s, v)?,
                "algo" => {
                    c.algo = match v {
                        "ring" => Algo::Ring,
                        "tree" => Algo::Tree,
                        "auto" => Algo::Auto,
                        _ => return err(s, format!("algo `{v}` is not ring, tree or auto")),
                    }
                }
                other => return err(s, format!("unknown key `{other}`")),
            }
        }
        if !net && node_counts.iter().any(|&n| n > 1) {
            return err(s, "more than one node needs `net=` (each node's link to the others)");
        }
        Ok(node_counts.into_iter().map(|nodes| Cluster { nodes, ..c.clone() }).collect())
    }

    /// GPUs in all.
    pub fn world(&self) -> usize {
        self.nodes * self.gpus_per_node
    }

    /// The cluster with the link inside a node at `gbps` where it was
    /// `measured`.
    pub fn with_measured_intra(&self, gbps: f64) -> Cluster {
        Cluster { intra_gbps: Some(self.intra_gbps.unwrap_or(gbps)), ..self.clone() }
    }

    /// The cluster with the link that limits it (between nodes, or inside
    /// the one node) at `gbps`: what a break-even bandwidth varies.
    pub fn with_limiting_link(&self, gbps: f64) -> Cluster {
        if self.nodes > 1 {
            Cluster { net_gbps: gbps, ..self.clone() }
        } else {
            Cluster { intra_gbps: Some(gbps), ..self.clone() }
        }
    }

    /// The bandwidth of the limiting link, Gbit/s, if known.
    pub fn limiting_gbps(&self) -> Option<f64> {
        if self.nodes > 1 {
            Some(self.net_gbps)
        } else {
            self.intra_gbps
        }
    }

    /// A short label: `16x8 net 100Gbps`.
    pub fn label(&self) -> String {
        let intra = self.intra_gbps.map_or("measured".to_string(), |g| format!("{}GBps", trim(g / 8.0)));
        if self.nodes > 1 {
            format!("{}x{} nvlink {intra} net {}Gbps", self.nodes, self.gpus_per_node, trim(self.net_gbps))
        } else {
            format!("1x{} nvlink {intra}", self.gpus_per_node)
        }
    }

    fn intra(&self) -> Link {
        Link::flat(self.intra_gbps.unwrap_or(f64::INFINITY), self.intra_latency_us)
    }

    fn inter(&self) -> Link {
        Link::flat(self.net_gbps, self.net_latency_us)
    }

    /// Seconds of one collective of `op` whose nccl-tests size is `bytes`
    /// over every GPU of the cluster. One node: a ring inside it. Several
    /// nodes of one GPU: the collective between nodes. Several nodes of
    /// several GPUs: hierarchically, a reduce-scatter inside each node,
    /// the collective between nodes (each node's GPUs run theirs on 1/g of
    /// the buffer through the node's one link: together the whole buffer
    /// over it), then an all-gather inside each node; an all-gather or a
    /// reduce-scatter: its phase between nodes and its phase inside them.
    pub fn time(&self, op: Op, bytes: f64) -> f64 {
        let (n, g) = (self.nodes, self.gpus_per_node);
        let b = bytes.max(0.0) as u64;
        let secs = |d: std::time::Duration| d.as_secs_f64();
        if n == 1 {
            return secs(self.intra().time(op, b, g));
        }
        let between = match op {
            Op::AllReduce => self.inter_all_reduce(bytes, n),
            _ => secs(self.inter().time(op, b, n)),
        };
        if g == 1 {
            return between;
        }
        let inside = match op {
            Op::AllReduce => secs(self.intra().reduce_scatter_time(b, g)) + secs(self.intra().all_gather_time(b, g)),
            _ => secs(self.intra().time(op, b, g)),
        };
        between + inside
    }

    /// An all-reduce of `bytes` between `n` nodes: a ring (2(n-1) steps of
    /// bytes/n), or NCCL's double binary tree (2 log2 n steps of latency,
    /// the buffer up and down the tree at the link's bandwidth), or the
    /// faster of the two.
    fn inter_all_reduce(&self, bytes: f64, n: usize) -> f64 {
        let ring = self.inter().all_reduce_time(bytes.max(0.0) as u64, n).as_secs_f64();
        let tree = 2.0 * (n as f64).log2().ceil() * self.net_latency_us * 1e-6 + 2.0 * bytes * 8.0 / (self.net_gbps * 1e9);
        match self.algo {
            Algo::Ring => ring,
            Algo::Tree => tree,
            Algo::Auto => ring.min(tree),
        }
    }
}

/// A number without trailing zeros: 100, 12.5.
pub(crate) fn trim(x: f64) -> String {
    let s = format!("{x:.1}");
    s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
}
