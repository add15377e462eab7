//! The network a multi-rank run emulates: a [`Link`]'s bandwidth, latency
//! and node layout, the alpha-beta model of a ring collective over it, and
//! the kinds of collective ([`Op`]) with their nccl-tests byte conventions.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A link between ranks, for emulation: bandwidth and one-way latency.
/// Without `nodes`, every rank is a node of its own and every collective
/// crosses the link as one ring over all ranks. With `nodes`, the ranks are
/// that many nodes of world/nodes ranks each (consecutive ranks share a
/// node), `gbps` is each node's link to the others, shared by its ranks, and
/// only the traffic between nodes is stretched.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub gbps: f64,
    #[serde(default)]
    pub latency_us: f64,
    /// Nodes the ranks are spread over (default: one rank per node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<u32>,
}

impl Link {
    /// A flat link: every rank its own node.
    pub fn flat(gbps: f64, latency_us: f64) -> Link {
        Link { gbps, latency_us, nodes: None }
    }

    /// (nodes, ranks per node) for `n` ranks.
    pub fn topology(&self, n: usize) -> (usize, usize) {
        let nodes = self.nodes.map_or(n, |k| (k as usize).clamp(1, n.max(1)));
        (nodes, (n / nodes).max(1))
    }

    /// Time the traffic between nodes of a collective of `op` on `bytes`
    /// (its nccl-tests size) over `n` ranks takes on the link. Hierarchically
    /// (reduce-scatter within each node, the same op between nodes, then an
    /// all-gather within each node), each of a node's g ranks runs a ring
    /// between nodes on 1/g of the buffer, all through the node's one link:
    /// together a ring over the nodes on the whole buffer.
    pub fn inter_node_time(&self, op: Op, bytes: u64, n: usize) -> Duration {
        let (nodes, _) = self.topology(n);
        self.time(op, bytes, nodes)
    }

    /// The emulated time of a collective that took `measured` on the
    /// machine. Flat (one rank per node): the link's ring time, never less
    /// than what was measured. With several ranks per node, the measured
    /// collective stands for the phases within nodes, which run at the
    /// machine's speed, and the phase between nodes comes on top.
    pub fn emulated(&self, op: Op, bytes: u64, n: usize, measured: Duration) -> Duration {
        let inter = self.inter_node_time(op, bytes, n);
        if self.ranks_share_nodes(n) {
            measured + inter
        } else {
            inter.max(measured)
        }
    }

    /// Whether several of `n` ranks share a node (so collectives have phases within nodes).
    pub fn ranks_share_nodes(&self, n: usize) -> bool {
        self.topology(n).1 > 1
    }

    /// Time of `steps` ring steps over `n` ranks, each paying the latency and
    /// moving 1/n of `bytes`.
    fn ring_steps(&self, steps: usize, bytes: u64, n: usize) -> Duration {
        if n < 2 {
            return Duration::ZERO;
        }
        let steps = steps as f64;
        let secs = steps * self.latency_us * 1e-6 + steps / n as f64 * bytes as f64 * 8.0 / (self.gbps * 1e9);
        Duration::from_secs_f64(secs)
    }

    /// Time of a ring all-reduce of `bytes` over `n` ranks on this link:
    /// 2(n-1) steps, each paying the latency and moving bytes/n.
    pub fn all_reduce_time(&self, bytes: u64, n: usize) -> Duration {
        self.ring_steps(2 * n.saturating_sub(1), bytes, n)
    }

    /// Time of a ring all-gather whose gathered buffer has `bytes`, over `n`
    /// ranks: n-1 steps, each paying the latency and moving bytes/n.
    pub fn all_gather_time(&self, bytes: u64, n: usize) -> Duration {
        self.ring_steps(n.saturating_sub(1), bytes, n)
    }

    /// Time of a ring reduce-scatter of a buffer of `bytes` (before
    /// scattering) over `n` ranks: n-1 steps of bytes/n, as an all-gather.
    pub fn reduce_scatter_time(&self, bytes: u64, n: usize) -> Duration {
        self.all_gather_time(bytes, n)
    }

    /// The ring time of `op` on `bytes` (its nccl-tests size) over `n` ranks.
    pub fn time(&self, op: Op, bytes: u64, n: usize) -> Duration {
        match op {
            Op::AllReduce => self.all_reduce_time(bytes, n),
            Op::AllGather => self.all_gather_time(bytes, n),
            Op::ReduceScatter => self.reduce_scatter_time(bytes, n),
        }
    }
}

/// The kinds of training collective, accounted for separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
}

impl Op {
    /// Every kind, in a fixed order.
    pub const ALL: [Op; 3] = [Op::AllReduce, Op::AllGather, Op::ReduceScatter];

    /// The name in results and error messages.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
        }
    }

    /// nccl-tests' bus-bandwidth factor, which is also the fraction of the
    /// buffer each rank sends in a ring: 2(n-1)/n for an all-reduce, (n-1)/n
    /// for an all-gather or a reduce-scatter.
    pub fn bus_factor(self, n: usize) -> f64 {
        let ring = (n as f64 - 1.0) / n as f64;
        match self {
            Op::AllReduce => 2.0 * ring,
            Op::AllGather | Op::ReduceScatter => ring,
        }
    }

    /// Bytes one rank sends in a ring for a buffer of `bytes` (the nccl-tests size).
    pub fn bytes_sent(self, bytes: u64, n: usize) -> u64 {
        let (n, steps) = (n as u64, n.saturating_sub(1) as u64);
        match self {
            Op::AllReduce => 2 * steps * bytes / n,
            Op::AllGather | Op::ReduceScatter => steps * bytes / n,
        }
    }
}
