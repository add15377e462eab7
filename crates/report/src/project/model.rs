//! The step of a data-parallel strategy on a cluster: the step's compute on
//! one GPU, the strategy's collectives timed on the cluster, overlapped with
//! the backward pass where the strategy overlaps them, with the compute
//! slowed beside them, and the exposed tail.

use harness_format::link::Op;

use super::calibrate::{Compute, Profile};
use super::cluster::Cluster;

/// The calibrated slowdown of compute beside collectives: extra compute
/// seconds per second a collective runs beside the backward pass. `mid` is
/// what the prediction uses, `lo` and `hi` bound the interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slowdown {
    pub lo: f64,
    pub mid: f64,
    pub hi: f64,
}

impl Slowdown {
    pub const NONE: Slowdown = Slowdown { lo: 0.0, mid: 0.0, hi: 0.0 };

    /// From calibration values: their median, and their quartiles for the
    /// interval (the range would follow one outlier); none: zero.
    pub fn of(values: &[f64]) -> Slowdown {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Slowdown::NONE;
        }
        v.sort_by(f64::total_cmp);
        let q = |f: f64| {
            let x = f * (v.len() - 1) as f64;
            let (i, j) = (x.floor() as usize, x.ceil() as usize);
            v[i] + (v[j] - v[i]) * (x - i as f64)
        };
        Slowdown { lo: q(0.25), mid: q(0.5), hi: q(0.75) }
    }
}

/// The parts of one predicted step, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Parts {
    pub step: f64,
    /// Every collective of the step, end to end.
    pub collectives: f64,
    /// Collective time beside the backward pass.
    pub overlapped: f64,
    /// What the step waits for after the backward pass: the tail of the
    /// overlapped collectives, or all of them and the strategy's own work
    /// when they do not overlap.
    pub exposed: f64,
    /// The backward pass, slowed beside collectives.
    pub backward: f64,
}

/// The optimizer under ZeRO on `n` ranks: a part every rank runs whole and
/// a part sharded n ways, split by the one-GPU and the profile's times.
fn zero_optimizer(one: f64, p: &Profile, n: usize) -> f64 {
    if p.world > 1 && p.world != n && one > p.optimizer {
        let shard = (one - p.optimizer) * p.world as f64 / (p.world as f64 - 1.0);
        let whole = (one - shard).max(0.0);
        return whole + shard / n as f64;
    }
    if p.world == n && p.optimizer > 0.0 {
        return p.optimizer;
    }
    one / n as f64
}

/// Start and end of each collective of a chain, each starting once its
/// bucket is ready and the one before has ended; and the time they spend
/// before `until`.
fn chain(ready: &[f64], times: &[f64], until: f64) -> (f64, f64) {
    let (mut t, mut beside) = (0.0f64, 0.0);
    for (&r, &d) in ready.iter().zip(times) {
        let start = t.max(r);
        let end = start + d;
        beside += (end.min(until) - start.min(until)).max(0.0);
        t = end;
    }
    (t, beside)
}

/// One step of `p` on cluster `c` (intra-node bandwidth resolved) with
/// slowdown `s`. `overlap`: the buckets' all-reduces start as buckets
/// become ready during the backward pass (the results do not record when:
/// bucket i is taken ready when the backward pass has done the share of its
/// work that buckets 0..=i hold of the bytes; the last one at its end).
pub fn step(compute: &Compute, p: &Profile, c: &Cluster, s: f64, overlap: bool) -> Parts {
    let n = c.world();
    if n < 2 {
        return Parts { step: compute.step, backward: compute.backward, ..Parts::default() };
    }
    let optimizer = if p.zero > 0 { zero_optimizer(compute.optimizer, p, n) } else { compute.optimizer };
    let base = compute.forward + compute.data + compute.other + optimizer;
    let b = compute.backward;
    if !p.plain {
        let collectives: f64 = p.uses.iter().map(|u| u.per_step * c.time(u.op, p.bytes_at(u, n))).sum();
        let exposed = collectives + p.overhead;
        return Parts { step: base + b + exposed, collectives, overlapped: 0.0, exposed, backward: b };
    }
    let times: Vec<f64> = p.buckets.iter().map(|&x| c.time(Op::AllReduce, x as f64)).collect();
    let collectives: f64 = times.iter().sum();
    if !overlap || b <= 0.0 {
        return Parts { step: base + b + collectives, collectives, overlapped: 0.0, exposed: collectives, backward: b };
    }
    let total: f64 = p.buckets.iter().map(|&x| x as f64).sum::<f64>().max(1.0);
    let mut cum = 0.0;
    let share: Vec<f64> = p
        .buckets
        .iter()
        .map(|&x| {
            cum += x as f64;
            cum / total
        })
        .collect();
    let ready = |backward: f64| share.iter().map(|f| f * backward).collect::<Vec<_>>();
    let (_, beside) = chain(&ready(b), &times, b);
    let slowed = b + s * beside;
    let (end, overlapped) = chain(&ready(slowed), &times, slowed);
    let exposed = (end - slowed).max(0.0);
    Parts { step: base + slowed + exposed, collectives, overlapped, exposed, backward: slowed }
}

/// A predicted step with its interval, and what it gives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    pub world: usize,
    pub parts: Parts,
    /// Seconds: the prediction and its interval.
    pub step: f64,
    pub lo: f64,
    pub hi: f64,
    /// Tokens per second on all GPUs, at `step`, `hi` and `lo`.
    pub tokens_per_s: f64,
    pub tokens_lo: f64,
    pub tokens_hi: f64,
    /// The one-GPU step over this one: weak scaling, the same batch per GPU.
    pub efficiency: f64,
}

/// The step with its interval: the low end with the calibration's lower
/// quartile of slowdown and the one-GPU step's 10th percentile over its median,
/// the high end with the most and the 90th.
pub fn predict(compute: &Compute, p: &Profile, c: &Cluster, s: Slowdown, overlap: bool) -> Prediction {
    let parts = step(compute, p, c, s.mid, overlap);
    let lo = step(compute, p, c, s.lo, overlap).step * compute.lo_ratio.min(1.0);
    let hi = step(compute, p, c, s.hi, overlap).step * compute.hi_ratio.max(1.0);
    let n = c.world();
    let tokens = n as f64 * compute.tokens_per_step;
    Prediction {
        world: n,
        parts,
        step: parts.step,
        lo,
        hi,
        tokens_per_s: tokens / parts.step,
        tokens_lo: tokens / hi,
        tokens_hi: tokens / lo,
        efficiency: compute.step / parts.step,
    }
}

/// The bandwidth of the cluster's limiting link (Gbit/s, searched from
/// 0.01 to 100,000) below which `q` is faster than the all-reduce `p`:
/// `Ok(Some(g))`; `Ok(None)` when `q` is slower at every bandwidth;
/// `Err(())` when it is faster at every one.
#[allow(clippy::result_unit_err)]
pub fn break_even(compute: &Compute, p: &Profile, q: &Profile, c: &Cluster, s: f64) -> Result<Option<f64>, ()> {
    let faster = |g: f64| {
        let c = c.with_limiting_link(g);
        step(compute, q, &c, s, false).step < step(compute, p, &c, s, true).step
    };
    let (min, max) = (1e-2f64, 1e5f64);
    if faster(max) {
        return Err(());
    }
    let grid: Vec<f64> = (0..=140).map(|i| min * (max / min).powf(i as f64 / 140.0)).collect();
    // The highest grid point where q is faster, then bisection above it.
    let Some(i) = grid.iter().rposition(|&g| faster(g)) else { return Ok(None) };
    let (mut a, mut b) = (grid[i], grid[i + 1]);
    for _ in 0..40 {
        let m = (a * b).sqrt();
        if faster(m) {
            a = m;
        } else {
            b = m;
        }
    }
    Ok(Some(a))
}
