//! The compressor's checks: sessions of thread ranks over the in-process
//! collective on synthetic gradient buckets, and what is compared between
//! them.

use std::ops::Range;

use anyhow::{anyhow, Context, Result};
use tch::{Device, Tensor};

use super::{
    bucket_layouts, num, BucketFigures, Check, Kit, BUCKET_SIZES, COLLECTIVE_TIMEOUT, COMPRESSOR_SAVE_AFTER, COMPRESSOR_STEPS, NOT_RUN,
    SEED,
};
use crate::plugin::PluginCompressor;
use crate::strategy::{BucketCtx, Compressor};
use harness_format::fmt::counted;
use harness_runtime::comm::{Collective, InProcessComm, InProcessGroup, Op, ABORTED_BY_PEER};

impl Kit {
    /// The compressor's checks and its figures per bucket size.
    pub(super) fn compressor_checks(&self) -> (Vec<Check>, Vec<BucketFigures>) {
        let inputs = Inputs::new(self.ranks, COMPRESSOR_STEPS);
        let all = 0..COMPRESSOR_STEPS;
        let a = self.compress_session(&inputs, all.clone(), None, false);
        let b = self.compress_session(&inputs, all, None, false);
        let mut checks = vec![determinism(&a, &b)];
        let Ok(runs) = &a else {
            // Its error is determinism's detail; the other checks need a run.
            for name in ["ranks agree", "round-trip error", "bytes on the wire", "state save/load"] {
                checks.push(Check::fail(name, NOT_RUN));
            }
            return (checks, Vec::new());
        };
        checks.push(match self.ranks {
            1 => Check::skip("ranks agree", "one rank: nothing to compare (--ranks 2 or more)"),
            _ => agreement(runs),
        });
        let (round_trip, figures) = round_trip(runs, &inputs);
        checks.push(round_trip);
        checks.push(wire(&figures, self.ranks));
        checks.push(self.compressor_state(&inputs, &a));
        (checks, figures)
    }

    /// Saves each rank's state after [`COMPRESSOR_SAVE_AFTER`] steps, loads
    /// it into fresh instances, goes on, and compares with `uninterrupted`.
    fn compressor_state(&self, inputs: &Inputs, uninterrupted: &Result<Vec<RankRun>, String>) -> Check {
        const NAME: &str = "state save/load";
        let k = COMPRESSOR_SAVE_AFTER;
        let saved = match self.compress_session(inputs, 0..k, None, true) {
            Ok(s) => s,
            Err(e) => return Check::fail(NAME, e),
        };
        let states: Vec<Vec<u8>> = saved.into_iter().map(|r| r.state).collect();
        let bytes = states.iter().map(Vec::len).max().unwrap_or(0);
        let resumed = self.compress_session(inputs, k..COMPRESSOR_STEPS, Some(&states), false);
        let what = match bytes {
            0 => "no state, 0 bytes".to_owned(),
            b => format!("{b} bytes a rank at most"),
        };
        match compare_runs(uninterrupted, &resumed, k, ["uninterrupted", "resumed"]) {
            Ok(()) => Check::pass(
                NAME,
                format!(
                    "saved after step {} ({what}), loaded into fresh instances: steps {k}..{} bit-identical to the uninterrupted run",
                    k - 1,
                    COMPRESSOR_STEPS - 1
                ),
            ),
            Err(e) => Check::fail(
                NAME,
                format!(
                    "saved after step {} ({what}) and loaded into fresh instances: {e}{}",
                    k - 1,
                    if bytes == 0 { " (what it keeps across calls must be in state-save)" } else { "" }
                ),
            ),
        }
    }

    /// One set of fresh instances, one per rank on a thread of its own,
    /// over `steps` of `inputs`; loads `load[rank]` first when given, and
    /// saves each rank's state at the end when `save`. The error is the
    /// first rank's that is not an echo of another's.
    fn compress_session(&self, inputs: &Inputs, steps: Range<u64>, load: Option<&[Vec<u8>]>, save: bool) -> Result<Vec<RankRun>, String> {
        let group = InProcessGroup::new(self.ranks, COLLECTIVE_TIMEOUT);
        let results: Vec<Result<RankRun, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.ranks)
                .map(|r| {
                    let mut comm = group.rank(r, None);
                    let steps = steps.clone();
                    s.spawn(move || {
                        let state = load.map(|l| l[r].as_slice());
                        // A panic of the host's own (a native plugin's is
                        // caught at its C boundary) fails this rank, and
                        // the abort below releases the others.
                        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            self.compress_rank(&mut comm, inputs, steps, state, save)
                        }))
                        .unwrap_or_else(|_| Err(anyhow!("harness panicked running it")));
                        if let Err(e) = &out {
                            comm.abort(&format!("{e:#}"));
                        }
                        out.map_err(|e| format!("rank {r}: {e:#}"))
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| h.join().unwrap_or_else(|_| Err(format!("rank {r}: harness panicked running it"))))
                .collect()
        });
        let errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        if let Some(e) = errors.iter().find(|e| !e.contains(ABORTED_BY_PEER)).or(errors.first()) {
            return Err(self.message(e));
        }
        Ok(results.into_iter().flatten().collect())
    }

    /// One rank of [`Kit::compress_session`].
    fn compress_rank(
        &self,
        comm: &mut InProcessComm,
        inputs: &Inputs,
        steps: Range<u64>,
        load: Option<&[u8]>,
        save: bool,
    ) -> Result<RankRun> {
        let rank = comm.rank();
        let mut p = PluginCompressor::new(self.configure(&self.config)?, false);
        p.setup(&bucket_layouts())?;
        if let Some(state) = load {
            p.plugin.state_load(state)?;
        }
        let mut run = RankRun::default();
        for step in steps {
            let (mut outs, mut sent) = (Vec::new(), Vec::new());
            for index in 0..BUCKET_SIZES.len() {
                let at = || format!("step {step}, {}", describe_bucket(index));
                let mut bucket = Tensor::from_slice(&inputs.data[step as usize][index][rank]);
                let before = comm.stats().bytes_sent;
                p.reduce(&mut bucket, comm, &BucketCtx { step, index, count: BUCKET_SIZES.len() }).with_context(at)?;
                sent.push(comm.stats().bytes_sent - before);
                outs.push(Vec::<f32>::try_from(&bucket.reshape([-1])).with_context(at)?);
                // Every rank is done with this bucket's collectives: one that
                // made more or fewer than the others meets this barrier with
                // another collective, and both fail here, saying so.
                let mut done = Tensor::zeros([1], (tch::Kind::Float, Device::Cpu));
                comm.all_reduce_sum_control(&mut done)
                    .map_err(|e| anyhow!("{}: the ranks did not make the same collectives: {e}", at()))?;
            }
            run.out.push(outs);
            run.sent.push(sent);
        }
        if save {
            run.state = p.plugin.state_save()?;
        }
        Ok(run)
    }
}

/// What one rank of a compressor session gave.
#[derive(Debug, Default, Clone)]
struct RankRun {
    /// The reduced buckets, per step run and bucket.
    out: Vec<Vec<Vec<f32>>>,
    /// Bytes sent per step run and bucket.
    sent: Vec<Vec<u64>>,
    /// The state saved at the end (when asked).
    state: Vec<u8>,
}

/// The synthetic gradients: per step, bucket and rank, a part common to
/// the ranks plus half as much of the rank's own, each element normal.
pub(super) struct Inputs {
    ranks: usize,
    /// `[step][bucket][rank]`.
    pub(super) data: Vec<Vec<Vec<Vec<f32>>>>,
}

impl Inputs {
    pub(super) fn new(ranks: usize, steps: u64) -> Inputs {
        let data = (0..steps)
            .map(|step| {
                BUCKET_SIZES
                    .iter()
                    .enumerate()
                    .map(|(b, &n)| {
                        let common = normals(mix(&[SEED, step, b as u64, u64::MAX]), n as usize);
                        (0..ranks)
                            .map(|r| {
                                let own = normals(mix(&[SEED, step, b as u64, r as u64]), n as usize);
                                common.iter().zip(&own).map(|(c, o)| (c + 0.5 * o) as f32).collect()
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        Inputs { ranks, data }
    }

    /// The exact average of the ranks' bucket `b` at `step`.
    fn average(&self, step: usize, b: usize) -> Vec<f64> {
        let n = BUCKET_SIZES[b] as usize;
        let mut avg = vec![0f64; n];
        for r in &self.data[step][b] {
            for (a, x) in avg.iter_mut().zip(r) {
                *a += f64::from(*x);
            }
        }
        avg.iter_mut().for_each(|a| *a /= self.ranks as f64);
        avg
    }
}

/// splitmix64 of the words in turn.
fn mix(words: &[u64]) -> u64 {
    words.iter().fold(0x9e37_79b9_7f4a_7c15u64, |h, &w| splitmix(&mut (h ^ w)))
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `n` standard normal numbers from `seed` (Box-Muller).
fn normals(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed;
    let mut unit = || ((splitmix(&mut s) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    (0..n).map(|_| (-2.0 * unit().ln()).sqrt() * (std::f64::consts::TAU * unit()).cos()).collect()
}

/// An element as the messages show it: its value and its bits.
fn value(x: f32) -> String {
    format!("{x:?} (0x{:08x})", x.to_bits())
}

/// The first element where `a` and `b` differ bit for bit (or the length,
/// when one is shorter).
pub(super) fn first_difference(a: &[f32], b: &[f32]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x.to_bits() != y.to_bits()).or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

fn describe_bucket(b: usize) -> String {
    format!("bucket {b} ({})", counted(BUCKET_SIZES[b] as usize, "element", "elements"))
}

/// Two sessions' reduced buckets compared rank by rank, bit for bit;
/// `second` starts at step `from` of `first`. The error is the first
/// difference (`labels` name the two sessions) or a session's error.
fn compare_runs(
    first: &Result<Vec<RankRun>, String>,
    second: &Result<Vec<RankRun>, String>,
    from: u64,
    labels: [&str; 2],
) -> Result<(), String> {
    let (a, b) = match (first, second) {
        (Err(e), _) | (_, Err(e)) => return Err(e.clone()),
        (Ok(a), Ok(b)) => (a, b),
    };
    for (r, (ra, rb)) in a.iter().zip(b).enumerate() {
        for (i, outs) in rb.out.iter().enumerate() {
            let step = from as usize + i;
            for (bi, (x, y)) in ra.out[step].iter().zip(outs).enumerate() {
                if let Some(e) = first_difference(x, y) {
                    let show = |v: &[f32]| v.get(e).map_or("nothing".into(), |&v| value(v));
                    let [l0, l1] = labels;
                    return Err(format!("rank {r}, step {step}, {}, element {e}: {l0} {}, {l1} {}", describe_bucket(bi), show(x), show(y)));
                }
            }
        }
    }
    Ok(())
}

/// Two fresh sets of instances on the same buckets, bit for bit.
fn determinism(first: &Result<Vec<RankRun>, String>, second: &Result<Vec<RankRun>, String>) -> Check {
    const NAME: &str = "determinism";
    match compare_runs(first, second, 0, ["first run", "second run"]) {
        Ok(()) => {
            Check::pass(NAME, format!("two fresh sets of instances: bit-identical buckets on every rank over {COMPRESSOR_STEPS} steps"))
        }
        Err(e) => Check::fail(NAME, e),
    }
}

/// Every rank's reduced buckets against rank 0's, bit for bit.
fn agreement(runs: &[RankRun]) -> Check {
    const NAME: &str = "ranks agree";
    for (step, outs) in runs[0].out.iter().enumerate() {
        for (b, x) in outs.iter().enumerate() {
            for (r, other) in runs.iter().enumerate().skip(1) {
                let y = &other.out[step][b];
                if let Some(e) = first_difference(x, y) {
                    let count = x.iter().zip(y).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
                    return Check::fail(
                        NAME,
                        format!(
                            "step {step}, {}: rank 0 and rank {r} hold different buckets ({} differ); element {e}: rank 0 {}, rank {r} {}",
                            describe_bucket(b),
                            counted(count, "element", "elements"),
                            value(x[e]),
                            value(y[e])
                        ),
                    );
                }
            }
        }
    }
    Check::pass(NAME, format!("all {} ranks hold bit-identical buckets after every reduce", runs.len()))
}

/// The relative L2 error of rank 0's reduced buckets against the exact
/// averages; fails on a non-finite element (on any rank). A changed shape
/// or dtype fails the call, hence the run.
fn round_trip(runs: &[RankRun], inputs: &Inputs) -> (Check, Vec<BucketFigures>) {
    const NAME: &str = "round-trip error";
    let world = inputs.ranks;
    let mut figures: Vec<BucketFigures> = BUCKET_SIZES
        .iter()
        .map(|&n| {
            let fp32 = Op::AllReduce.bytes_sent(4 * n as u64, world);
            BucketFigures { elements: n, rel_l2_error: Vec::new(), bytes_sent: Vec::new(), fp32_allreduce_bytes: fp32, wire_ratio: None }
        })
        .collect();
    let mut bad = None;
    for (step, outs) in runs[0].out.iter().enumerate() {
        for (b, out) in outs.iter().enumerate() {
            let avg = inputs.average(step, b);
            let (mut diff, mut norm) = (0f64, 0f64);
            for (o, a) in out.iter().zip(&avg) {
                diff += (f64::from(*o) - a).powi(2);
                norm += a * a;
            }
            let err = if norm > 0.0 { (diff / norm).sqrt() } else { diff.sqrt() };
            figures[b].rel_l2_error.push(err);
            figures[b].bytes_sent.push(runs[0].sent[step][b]);
            for (r, run) in runs.iter().enumerate() {
                if let (None, Some(e)) = (&bad, run.out[step][b].iter().position(|x| !x.is_finite())) {
                    bad = Some(format!("rank {r}, step {step}, {}: element {e} is {}", describe_bucket(b), run.out[step][b][e]));
                }
            }
        }
    }
    for f in &mut figures {
        let mean = f.bytes_sent.iter().sum::<u64>() as f64 / f.bytes_sent.len().max(1) as f64;
        f.wire_ratio = (f.fp32_allreduce_bytes > 0).then(|| mean / f.fp32_allreduce_bytes as f64);
    }
    if let Some(b) = bad {
        return (Check::fail(NAME, format!("non-finite values in the reduced bucket: {b}")), figures);
    }
    let errs = figures.iter().flat_map(|f| f.rel_l2_error.iter().copied());
    let (lo, hi) = errs.fold((f64::INFINITY, 0f64), |(lo, hi), e| (lo.min(e), hi.max(e)));
    (Check::pass(NAME, format!("relative L2 error against the exact average: {} to {} (per bucket below)", num(lo), num(hi))), figures)
}

/// The bytes rank 0 sent against an fp32 all-reduce of the same buckets.
fn wire(figures: &[BucketFigures], world: usize) -> Check {
    const NAME: &str = "bytes on the wire";
    if world == 1 {
        return Check::skip(NAME, "one rank sends nothing (--ranks 2 or more)");
    }
    let sent: u64 = figures.iter().flat_map(|f| &f.bytes_sent).sum();
    let fp32: u64 = figures.iter().map(|f| f.fp32_allreduce_bytes * f.bytes_sent.len() as u64).sum();
    Check::pass(
        NAME,
        format!("rank 0 sent {sent} bytes, {:.4}x an fp32 all-reduce's {fp32} (per bucket below)", sent as f64 / fp32.max(1) as f64),
    )
}
