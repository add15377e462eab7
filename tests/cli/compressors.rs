//! The compressor plugins of `plugins/` (fp16, bf16, topk, randomk, powersgd,
//! qsgd, onebit, and the reference allreduce), checked on known tensors with
//! ranks as threads (`InProcessGroup`): each rank instantiates the built
//! artifact (`target/plugins/<name>.wasm`, or `lib<name>.so`) and calls
//! `compress` the way the host's adapter does, on a lent bucket with the
//! rank's collective. Then the suite `suites/compressors-cpu.toml`,
//! shortened, through the binary.
//!
//! The artifacts come from `scripts/build-plugins.sh` (run by `./x test`).

use std::sync::Arc;
use std::time::Duration;

use harness::comm::{Collective as _, InProcessComm, InProcessGroup};
use harness::plugin::ops::{CommPtr, HostSide};
use harness::plugin::{native, wasm};
use harness::strategy::{BucketCtx, BucketLayout};
use harness_sdk::abi;
use tch::{Kind, Tensor};

use crate::{harness, repo_root, run_ok, write};

// ---------------------------------------------------------------------------
// Driving a plugin per rank

/// A loaded artifact, shared by the rank threads.
enum Artifact {
    Wasm(wasm::Artifact),
    Native(native::Artifact),
}

impl Artifact {
    /// `target/plugins/<file>`: `topk.wasm` or `libtopk.so`.
    fn open(file: &str) -> Arc<Artifact> {
        let p = repo_root().join("target/plugins").join(file);
        assert!(p.exists(), "{} is missing: run scripts/build-plugins.sh (./x test does)", p.display());
        Arc::new(if file.ends_with(".wasm") {
            Artifact::Wasm(wasm::load(&std::fs::read(&p).unwrap()).unwrap_or_else(|e| panic!("{file}: {e:#}")))
        } else {
            Artifact::Native(native::load(&p).unwrap_or_else(|e| panic!("{file}: {e:#}")))
        })
    }
}

enum Inst {
    Wasm(Box<wasm::Instance>),
    Native(native::Instance),
}

/// One rank: a configured plugin instance and the rank's collective.
struct Rank {
    inst: Inst,
    comm: InProcessComm,
    /// The layouts to set up before the first `compress` (empty: each
    /// bucket one 1-D tensor of the first input's length).
    layouts: Vec<BucketLayout>,
    set_up: bool,
}

impl Rank {
    fn new(a: &Artifact, comm: InProcessComm, config: &str) -> Rank {
        let mut r = Rank::unconfigured(a, comm);
        r.configure(config).unwrap_or_else(|e| panic!("configure({config:?}): {e}"));
        r
    }

    /// `setup` with `layouts`, as the host calls it once before the first
    /// `compress`.
    fn setup(&mut self, layouts: &[BucketLayout]) {
        let r = match &mut self.inst {
            Inst::Wasm(w) => w.setup(layouts),
            Inst::Native(n) => n.setup(layouts),
        };
        r.unwrap().unwrap_or_else(|e| panic!("setup: {e}"));
        self.set_up = true;
    }

    fn unconfigured(a: &Artifact, comm: InProcessComm) -> Rank {
        let host = HostSide::new("test", tch::Device::Cpu, 1 << 30);
        let inst = match a {
            Artifact::Wasm(w) => Inst::Wasm(Box::new(
                wasm::Instance::new(w, host, wasm::Limits { memory_bytes: 256 << 20, deadline: Duration::from_secs(60) }).unwrap(),
            )),
            Artifact::Native(n) => Inst::Native(native::Instance::new(n, host).unwrap()),
        };
        Rank { inst, comm, layouts: Vec::new(), set_up: false }
    }

    fn configure(&mut self, config: &str) -> Result<(), String> {
        match &mut self.inst {
            Inst::Wasm(w) => w.configure(config),
            Inst::Native(n) => n.configure(config),
        }
        .unwrap()
    }

    fn host(&mut self) -> &mut HostSide {
        match &mut self.inst {
            Inst::Wasm(w) => w.host(),
            Inst::Native(n) => n.host(),
        }
    }

    /// `compress` on `bucket` in place, as the host's adapter calls it.
    fn compress(&mut self, bucket: &Tensor, step: u64, index: u32, count: u32) {
        if !self.set_up {
            let layouts = match self.layouts.is_empty() {
                true => vec![one_tensor(bucket.numel()); 16],
                false => self.layouts.clone(),
            };
            self.setup(&layouts);
        }
        let id = self.host().lend(bucket);
        let comm: &mut dyn harness::comm::Collective = &mut self.comm;
        // SAFETY: cleared below, while `self.comm` is still borrowed by this
        // call; the plugin runs on this thread.
        let ptr = unsafe { CommPtr::new(comm) };
        let host = match &mut self.inst {
            Inst::Wasm(w) => w.host(),
            Inst::Native(n) => n.host(),
        };
        host.set_comm(Some(ptr));
        let r = match &mut self.inst {
            Inst::Wasm(w) => w.compress(id, &BucketCtx { step, index: index as usize, count: count as usize }),
            Inst::Native(n) => n.compress(id, abi::BucketInfo { step, index, count }),
        };
        let host = self.host();
        host.set_comm(None);
        host.give_back(id);
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("compress returned an error: {e}"),
            Err(e) => panic!("compress failed: {e:#}"),
        }
    }

    /// Compresses a copy of `input` and returns the output.
    fn reduce(&mut self, input: &[f32], step: u64, index: u32) -> Vec<f32> {
        let bucket = Tensor::from_slice(input);
        self.compress(&bucket, step, index, 1);
        floats(&bucket)
    }

    fn save(&mut self) -> Vec<u8> {
        match &mut self.inst {
            Inst::Wasm(w) => w.state_save(),
            Inst::Native(n) => n.state_save(),
        }
        .unwrap()
    }

    fn load(&mut self, state: &[u8]) -> Result<(), String> {
        match &mut self.inst {
            Inst::Wasm(w) => w.state_load(state),
            Inst::Native(n) => n.state_load(state),
        }
        .unwrap()
    }

    /// Bytes this rank sent so far, as the host counts them.
    fn bytes_sent(&mut self) -> u64 {
        self.comm.stats().bytes_sent
    }
}

/// A bucket of one 1-D tensor of `n` elements.
fn one_tensor(n: usize) -> BucketLayout {
    BucketLayout::packed([("grad", &[n as i64][..])], Kind::Float)
}

/// Runs `f` on `world` ranks (threads), each with its own instance of
/// `file` configured with `config`; returns each rank's result in rank order.
/// Each bucket holds one 1-D tensor.
fn on_ranks<R: Send>(world: usize, file: &str, config: &str, f: impl Fn(usize, &mut Rank) -> R + Sync) -> Vec<R> {
    on_ranks_laid(world, file, config, &[], f)
}

/// [`on_ranks`] with the buckets' layouts.
fn on_ranks_laid<R: Send>(
    world: usize,
    file: &str,
    config: &str,
    layouts: &[BucketLayout],
    f: impl Fn(usize, &mut Rank) -> R + Sync,
) -> Vec<R> {
    let art = Artifact::open(file);
    let group = InProcessGroup::new(world, Duration::from_secs(120));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let (art, group, f) = (&art, &group, &f);
                s.spawn(move || {
                    tch::set_num_threads(1);
                    let mut rank = Rank::new(art, group.rank(r, None), config);
                    rank.layouts = layouts.to_vec();
                    f(r, &mut rank)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

fn floats(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).reshape([-1])).unwrap()
}

/// Reproducible inputs: rank `rank`'s gradient at `step`, `n` values in
/// about [-1, 1) (a few larger), from a 64-bit LCG.
fn grad(n: usize, rank: usize, step: u64) -> Vec<f32> {
    let mut s = 0x853c_49e6_748f_ea9b_u64 ^ ((rank as u64) << 32) ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..n)
        .map(|i| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            if i % 17 == 0 {
                4.0 * u
            } else {
                u
            }
        })
        .collect()
}

/// Element-wise mean over ranks.
fn mean(inputs: &[Vec<f32>]) -> Vec<f32> {
    let w = inputs.len() as f64;
    (0..inputs[0].len()).map(|i| (inputs.iter().map(|x| f64::from(x[i])).sum::<f64>() / w) as f32).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().map(|x| x.abs()).fold(0.0, f32::max)
}

/// Every rank's output is the same, bit for bit.
fn assert_same_on_all_ranks(what: &str, outs: &[Vec<f32>]) {
    for (r, o) in outs.iter().enumerate().skip(1) {
        assert!(o.iter().zip(&outs[0]).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: rank {r}'s output differs from rank 0's");
    }
}

/// The tensors of a state saved by the plugins' shared format
/// (`plugins/shared/state.rs`): (bucket, name) -> (shape, data).
fn parse_state(plugin: &str, b: &[u8]) -> std::collections::BTreeMap<(u32, String), (Vec<u64>, Vec<f32>)> {
    let mut at = 0;
    let mut take = |n: usize| {
        let s = &b[at..at + n];
        at += n;
        s
    };
    assert_eq!(take(4), b"HCS1");
    assert_eq!(take(1), [1]);
    let len = u16::from_le_bytes(take(2).try_into().unwrap()) as usize;
    assert_eq!(take(len), plugin.as_bytes());
    let count = u32::from_le_bytes(take(4).try_into().unwrap());
    let mut out = std::collections::BTreeMap::new();
    for _ in 0..count {
        let bucket = u32::from_le_bytes(take(4).try_into().unwrap());
        let len = u16::from_le_bytes(take(2).try_into().unwrap()) as usize;
        let name = String::from_utf8(take(len).to_vec()).unwrap();
        let ndim = take(1)[0] as usize;
        let shape: Vec<u64> = (0..ndim).map(|_| u64::from_le_bytes(take(8).try_into().unwrap())).collect();
        let numel = shape.iter().product::<u64>() as usize;
        let data = take(4 * numel).chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        out.insert((bucket, name), (shape, data));
    }
    assert_eq!(at, b.len(), "trailing bytes in the state");
    out
}

// ---------------------------------------------------------------------------
// Exact math

#[test]
fn allreduce_fp16_and_bf16_leave_the_mean_on_every_rank() {
    let n = 1000;
    for world in [2, 3] {
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| grad(n, r, 0)).collect();
        let want = mean(&inputs);
        // Precision of the cast: relative 2^-11 (fp16) or 2^-8 (bf16) per
        // rounding, of the input (divided by w), then of each partial sum
        // of the reduction: (w + 1) roundings of values up to max |x|.
        for (file, eps) in [("allreduce.wasm", 1e-7f32), ("fp16.wasm", 2f32.powi(-11)), ("bf16.wasm", 2f32.powi(-8))] {
            let outs = on_ranks(world, file, "", |r, rank| rank.reduce(&inputs[r], 0, 0));
            assert_same_on_all_ranks(file, &outs);
            let tol = (world as f32 + 1.0) * eps * max_abs(&inputs.concat());
            let err = max_abs_diff(&outs[0], &want);
            assert!(err <= tol, "{file} on {world} ranks: max error {err} > {tol}");
            if file != "allreduce.wasm" {
                assert!(err > 0.0, "{file}: no rounding at all? the cast did not happen");
            }
        }
    }
}

#[test]
fn topk_and_randomk_with_ratio_one_are_the_mean() {
    let n = 777;
    for world in [2, 3] {
        for step in 0..3u64 {
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| grad(n, r, step)).collect();
            let want = mean(&inputs);
            for (file, config) in [("topk.wasm", "ratio = 1.0"), ("randomk.wasm", "ratio = 1.0\nseed = 9")] {
                let outs = on_ranks(world, file, config, |r, rank| rank.reduce(&inputs[r], step, 0));
                assert_same_on_all_ranks(file, &outs);
                let err = max_abs_diff(&outs[0], &want);
                assert!(err <= 1e-6, "{file} ratio 1 on {world} ranks: max error {err}");
            }
        }
    }
}

/// Layer-wise top-k: a tensor of small gradients beside one of large ones
/// keeps its share of the picks (k per tensor), where a top-k over the
/// bucket sends none of it; at ratio 1 both are the mean.
#[test]
fn topk_per_layer_sends_each_tensors_share() {
    let layout = [laid(&[("big.weight", &[30, 30]), ("small.bias", &[100])])];
    let input = |r: usize| -> Vec<f32> {
        let mut x: Vec<f32> = grad(900, r, 0).iter().map(|v| 10.0 * v).collect();
        x.extend(grad(100, r + 7, 0).iter().map(|v| 0.01 * v));
        x
    };
    for world in [1, 2] {
        let inputs: Vec<Vec<f32>> = (0..world).map(input).collect();
        let nonzero = |o: &[f32]| o.iter().filter(|v| **v != 0.0).count();
        let run = |config: &str| on_ranks_laid(world, "topk.wasm", config, &layout, |r, rank| rank.reduce(&inputs[r], 0, 0));
        let flat = run("ratio = 0.1");
        let layers = run("ratio = 0.1\nper_layer = true");
        assert_same_on_all_ranks("topk per layer", &layers);
        assert_eq!(nonzero(&flat[0][900..]), 0, "a top-k over the bucket picks only the large tensor");
        // Each rank sends 10 of the small tensor's entries (90 of the big one's).
        let small = nonzero(&layers[0][900..]);
        assert!((10..=10 * world).contains(&small), "{world} ranks: {small} of the small tensor's entries arrived");
        assert!(nonzero(&layers[0][..900]) >= 90, "the big tensor keeps its 90 a rank");
        let mean_out = run("ratio = 1.0\nper_layer = true");
        assert!(max_abs_diff(&mean_out[0], &mean(&inputs)) <= 1e-5, "ratio 1 per layer is the mean");
    }
}

/// Error feedback loses nothing: over T steps, the outputs plus the mean of
/// the final residuals add up to the mean inputs (the sum telescopes:
/// `out_t = mean(acc_t) - mean(residual_t)` and `acc_t = g_t +
/// residual_{t-1}`).
#[test]
fn error_feedback_conserves_the_gradient_sum() {
    let (n, steps) = (600, 8u64);
    for world in [2, 3] {
        for (file, plugin, config) in
            [("topk.wasm", "topk", "ratio = 0.1"), ("randomk.wasm", "randomk", "ratio = 0.1\nseed = 3"), ("onebit.wasm", "onebit", "")]
        {
            let per_rank = on_ranks(world, file, config, |r, rank| {
                let mut outs = Vec::new();
                for t in 0..steps {
                    outs.push(rank.reduce(&grad(n, r, t), t, 0));
                }
                let state = parse_state(plugin, &rank.save());
                let (shape, residual) = state[&(0, "residual".to_owned())].clone();
                assert_eq!(shape, vec![n as u64]);
                (outs, residual)
            });
            for t in 0..steps as usize {
                let outs: Vec<Vec<f32>> = per_rank.iter().map(|(o, _)| o[t].clone()).collect();
                assert_same_on_all_ranks(file, &outs);
            }
            let mut got = mean(&per_rank.iter().map(|(_, res)| res.clone()).collect::<Vec<_>>());
            let mut want = vec![0f32; n];
            for t in 0..steps {
                let out = &per_rank[0].0[t as usize];
                let m = mean(&(0..world).map(|r| grad(n, r, t)).collect::<Vec<_>>());
                for i in 0..n {
                    got[i] += out[i];
                    want[i] += m[i];
                }
            }
            let err = max_abs_diff(&got, &want);
            assert!(err <= 1e-4, "{file} on {world} ranks: sum of outputs + residual misses the sum of means by {err}");
            // And the compression did something: a single step is not the mean.
            let first = mean(&(0..world).map(|r| grad(n, r, 0)).collect::<Vec<_>>());
            assert!(max_abs_diff(&per_rank[0].0[0], &first) > 0.1, "{file}: the first step's output is the mean: nothing compressed");
        }
    }
}

/// Rank `rank`'s bucket for the PowerSGD tests: `U C_rank V^T` in the
/// plugin's layout (`rows x cols`, row-major), so the mean over ranks is
/// `U mean(C) V^T`, of rank 2.
fn low_rank(rows: usize, cols: usize, rank: usize) -> Vec<f32> {
    let u = grad(rows * 2, 100, 0);
    let v = grad(cols * 2, 101, 0);
    let c = grad(4, rank, 7);
    let mut m = vec![0f32; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            let mut x = 0.0;
            for a in 0..2 {
                for b in 0..2 {
                    x += u[i * 2 + a] * c[a * 2 + b] * v[j * 2 + b];
                }
            }
            m[i * cols + j] = x;
        }
    }
    m
}

/// A bucket of these tensors (name, shape), back to back.
fn laid(params: &[(&str, &[i64])]) -> BucketLayout {
    BucketLayout::packed(params.iter().map(|&(n, s)| (n, s)), Kind::Float)
}

#[test]
fn powersgd_recovers_a_low_rank_mean_and_a_full_rank_one_at_full_rank() {
    for world in [2, 3] {
        // A 40 x 40 weight whose mean has rank 2 <= r = 4.
        let layout = [laid(&[("w", &[40, 40])])];
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| low_rank(40, 40, r)).collect();
        let want = mean(&inputs);
        let outs = on_ranks_laid(world, "powersgd.wasm", "rank = 4", &layout, |r, rank| rank.reduce(&inputs[r], 0, 0));
        assert_same_on_all_ranks("powersgd", &outs);
        let err = max_abs_diff(&outs[0], &want);
        assert!(err <= 1e-4 * max_abs(&want), "powersgd rank 4 on a rank-2 mean, {world} ranks: max error {err}");
        // Rank 1 cannot: the output differs from the mean.
        let outs = on_ranks_laid(world, "powersgd.wasm", "rank = 1", &layout, |r, rank| rank.reduce(&inputs[r], 0, 0));
        assert!(max_abs_diff(&outs[0], &want) > 1e-2 * max_abs(&want), "rank 1 recovered a rank-2 matrix");
        // A 40 x 37 weight at rank 64, capped at 37 = min(rows, cols), where
        // any matrix is recovered (compressed though it saves nothing, with
        // a min_compression that lets it).
        let layout = [laid(&[("w", &[40, 37])])];
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| grad(1480, r, 5)).collect();
        let want = mean(&inputs);
        let config = "rank = 64\nmin_compression = 0.01";
        let outs = on_ranks_laid(world, "powersgd.wasm", config, &layout, |r, rank| rank.reduce(&inputs[r], 0, 0));
        assert_same_on_all_ranks("powersgd", &outs);
        let err = max_abs_diff(&outs[0], &want);
        assert!(err <= 1e-4 * max_abs(&want), "powersgd at full rank, {world} ranks: max error {err}");
    }
}

/// Per layer, as the hook: in one bucket, a bias and a weight too small to
/// gain from compression travel whole (the exact mean), and a weight whose
/// mean has rank 2 is recovered at rank 4, each in its own place.
#[test]
fn powersgd_compresses_each_weight_and_sends_the_rest_whole() {
    let layout = [laid(&[("a.bias", &[40]), ("a.weight", &[40, 40]), ("b.weight", &[6, 6]), ("b.bias", &[6])])];
    let world = 2;
    let inputs: Vec<Vec<f32>> = (0..world)
        .map(|r| {
            let mut x = grad(40, r, 1);
            x.extend(low_rank(40, 40, r));
            x.extend(grad(42, r, 2));
            x
        })
        .collect();
    let want = mean(&inputs);
    let outs = on_ranks_laid(world, "powersgd.wasm", "rank = 4", &layout, |r, rank| (rank.reduce(&inputs[r], 0, 0), rank.bytes_sent()));
    let (out, sent) = &outs[0];
    assert_same_on_all_ranks("powersgd", &outs.iter().map(|o| o.0.clone()).collect::<Vec<_>>());
    // The whole tensors: the mean, to the rounding of a sum of two.
    for range in [0..40, 1640..1682] {
        assert!(max_abs_diff(&out[range.clone()], &want[range.clone()]) <= 1e-6, "{range:?} is not the exact mean");
    }
    let err = max_abs_diff(&out[40..1640], &want[40..1640]);
    assert!(err <= 1e-4 * max_abs(&want[40..1640]), "the rank-2 weight: max error {err}");
    // Three all-reduces on 2 ranks, each sending its bytes once: the 82
    // whole elements, P (40 x 4) and Q (40 x 4), f32.
    assert_eq!(*sent, 4 * (82 + 160 + 160));
}

// ---------------------------------------------------------------------------
// Statistics

/// QSGD is unbiased: the average of many independently seeded outputs
/// approaches the mean. Bound: rank r's element i is `norm_r / s` times a
/// variable that takes one of two neighbouring integers, variance at most
/// 1/4, so `Var(out_i) <= sum_r (norm_r / s)^2 / 4 / w^2`, and the average of
/// R runs has 1/R of it; every element must lie within 5 standard
/// deviations (of that upper bound).
#[test]
fn qsgd_is_unbiased_and_deterministic_per_seed() {
    let (n, runs, world, levels) = (64, 400u64, 2, 4);
    let s = f64::from(levels - 1);
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| grad(n, r, 11)).collect();
    let want = mean(&inputs);
    let config = format!("levels = {levels}\nseed = 5");
    // Each step draws other random numbers (the seed mixes in the step).
    let outs = on_ranks(world, "qsgd.wasm", &config, |r, rank| (0..runs).map(|t| rank.reduce(&inputs[r], t, 0)).collect::<Vec<_>>());
    for (a, b) in outs[0].iter().zip(&outs[1]) {
        assert_same_on_all_ranks("qsgd", &[a.clone(), b.clone()]);
    }
    let var_bound: f64 = inputs
        .iter()
        .map(|x| {
            let norm = x.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
            (norm / s).powi(2) / 4.0
        })
        .sum::<f64>()
        / (world * world) as f64;
    let sd = (var_bound / runs as f64).sqrt();
    let mut worst = 0f64;
    for i in 0..n {
        let avg = outs[0].iter().map(|o| f64::from(o[i])).sum::<f64>() / runs as f64;
        let z = (avg - f64::from(want[i])).abs() / sd;
        worst = worst.max(z);
        assert!(z < 5.0, "qsgd element {i}: average {avg} vs mean {}: {z:.1} sd (sd {sd:.3e})", want[i]);
        // Single runs do vary (levels = 4 is coarse).
    }
    assert!(outs[0].iter().any(|o| max_abs_diff(o, &want) > 1e-3), "qsgd never quantized");
    // The empirical variance respects the bound too.
    let var: f64 = (0..n)
        .map(|i| outs[0].iter().map(|o| (f64::from(o[i]) - f64::from(want[i])).powi(2)).sum::<f64>() / runs as f64)
        .fold(0.0, f64::max);
    // The largest of 64 estimates, each from 400 runs (about 7% sampling
    // noise), may sit a few noise widths above its true value.
    assert!(var <= 1.5 * var_bound, "qsgd: variance {var:.3e} above the bound {var_bound:.3e}");
    eprintln!("qsgd: worst deviation {worst:.2} sd over {n} elements, max variance {var:.3e} <= bound {var_bound:.3e}");
    // Same seed, same step: same output; another seed: another output.
    let again = on_ranks(world, "qsgd.wasm", &config, |r, rank| rank.reduce(&inputs[r], 3, 0));
    assert_eq!(again[0], outs[0][3]);
    let other = on_ranks(world, "qsgd.wasm", "levels = 4\nseed = 6", |r, rank| rank.reduce(&inputs[r], 3, 0));
    assert_ne!(other[0], outs[0][3]);
}

// ---------------------------------------------------------------------------
// Bytes on the wire

/// The host's count of the bytes each rank sent for one `compress` call,
/// against what the method implies. Ring accounting (comm/mod.rs, nccl-tests
/// conventions): an all-reduce of B bytes sends 2(w-1)/w B per rank; an
/// all-gather whose gathered buffer is B bytes sends (w-1)/w B.
#[test]
fn bytes_on_the_wire_match_each_method() {
    let n: u64 = 10_000;
    for world in [2u64, 3] {
        let w = world as f64;
        let all_reduce = |bytes: f64| 2.0 * (w - 1.0) / w * bytes;
        let all_gather = |bytes_per_rank: f64| (w - 1.0) * bytes_per_rank;
        let k = (0.05 * n as f64).ceil();
        let signs = n.div_ceil(8) as f64;
        // powersgd: one 100 x 100 weight, r = 4.
        let (rows, cols, r) = (100.0, 100.0, 4.0);
        let cases: Vec<(&str, &str, f64)> = vec![
            ("allreduce.wasm", "", all_reduce(4.0 * n as f64)),
            ("fp16.wasm", "", all_reduce(2.0 * n as f64)),
            ("bf16.wasm", "", all_reduce(2.0 * n as f64)),
            // k f32 values + k i32 indices, gathered.
            ("topk.wasm", "ratio = 0.05", all_gather(4.0 * k) + all_gather(4.0 * k)),
            // k f32, all-reduced.
            ("randomk.wasm", "ratio = 0.05", all_reduce(4.0 * k)),
            // P (rows x r) and Q (cols x r), all-reduced.
            ("powersgd.wasm", "rank = 4", all_reduce(4.0 * rows * r) + all_reduce(4.0 * cols * r)),
            // n u8 levels + packed signs + one f32, gathered.
            ("qsgd.wasm", "", all_gather(n as f64) + all_gather(signs) + all_gather(4.0)),
            // packed signs + one f32 scale, gathered.
            ("onebit.wasm", "", all_gather(signs) + all_gather(4.0)),
        ];
        let fp32 = all_reduce(4.0 * n as f64);
        for (file, config, want) in cases {
            let layout = [laid(&[("w", &[100, 100])])];
            let sent = on_ranks_laid(world as usize, file, config, &layout, |r, rank| {
                rank.reduce(&grad(n as usize, r, 0), 0, 0);
                rank.bytes_sent()
            });
            for (r, &b) in sent.iter().enumerate() {
                let rel = (b as f64 - want).abs() / want;
                assert!(rel <= 0.05, "{file} on {world} ranks, rank {r}: sent {b} bytes, the method implies {want:.0} ({rel:.3} off)");
            }
            eprintln!("{file:>16} w={world}: {} bytes sent per rank, {:.4} of fp32 all-reduce", sent[0], sent[0] as f64 / fp32);
        }
    }
}

// ---------------------------------------------------------------------------
// Transports and state

#[test]
fn native_and_wasm_builds_give_identical_outputs() {
    let (n, world) = (1480, 2);
    for (name, config) in [("topk", "ratio = 0.05"), ("powersgd", "rank = 4")] {
        let layout = [laid(&[("w", &[36, 40]), ("b", &[40])])];
        let run = |file: String| {
            on_ranks_laid(world, &file, config, &layout, |r, rank| (0..4u64).map(|t| rank.reduce(&grad(n, r, t), t, 0)).collect::<Vec<_>>())
        };
        let (w, nat) = (run(format!("{name}.wasm")), run(format!("lib{name}.so")));
        for r in 0..world {
            for t in 0..4 {
                assert!(
                    w[r][t].iter().zip(&nat[r][t]).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name}: rank {r} step {t}: wasm and native outputs differ"
                );
            }
        }
    }
}

/// Saving after step 3 and loading into fresh instances gives the same
/// outputs at steps 3.. as never stopping: bit for bit, for each stateful
/// plugin, over two buckets.
#[test]
fn state_save_and_load_restore_identical_future_outputs() {
    let (n, world, split, steps) = (900, 2, 3u64, 6u64);
    let sizes = [n, n / 3];
    for (file, plugin, config) in [
        ("topk.wasm", "topk", "ratio = 0.05"),
        ("randomk.wasm", "randomk", "ratio = 0.05"),
        ("onebit.wasm", "onebit", ""),
        ("powersgd.wasm", "powersgd", "rank = 2"),
        ("libpowersgd.so", "powersgd", "rank = 2"),
    ] {
        let step = |rank: &mut Rank, r: usize, t: u64| -> Vec<Vec<f32>> {
            sizes.iter().enumerate().map(|(b, &len)| rank.reduce(&grad(len, r + 10 * b, t), t, b as u32)).collect()
        };
        let layouts = [laid(&[("w", &[30, 30])]), laid(&[("w", &[15, 16]), ("b", &[60])])];
        let straight = on_ranks_laid(world, file, config, &layouts, |r, rank| (0..steps).map(|t| step(rank, r, t)).collect::<Vec<_>>());
        let art = Artifact::open(file);
        let resumed = on_ranks_laid(world, file, config, &layouts, |r, rank| {
            for t in 0..split {
                step(rank, r, t);
            }
            let saved = rank.save();
            let tensors = parse_state(plugin, &saved);
            assert!(tensors.contains_key(&(1, "residual".to_owned())), "{file}: no residual for bucket 1 in the state");
            // A fresh instance on the same collective.
            let comm = std::mem::replace(&mut rank.comm, InProcessGroup::new(1, Duration::from_secs(1)).rank(0, None));
            let mut fresh = Rank::new(&art, comm, config);
            fresh.setup(&layouts);
            fresh.load(&saved).unwrap();
            // Loading then saving gives the same bytes back.
            assert_eq!(fresh.save(), saved, "{file}: state did not round-trip");
            (split..steps).map(|t| step(&mut fresh, r, t)).collect::<Vec<_>>()
        });
        for r in 0..world {
            assert_eq!(resumed[r], straight[r][split as usize..], "{file}: rank {r} diverged after the state was restored");
        }
    }
    // Another plugin's state, or garbage, is refused.
    let topk_state = on_ranks(1, "topk.wasm", "", |_, rank| {
        rank.reduce(&grad(100, 0, 0), 0, 0);
        rank.save()
    });
    on_ranks(1, "randomk.wasm", "", |_, rank| {
        let e = rank.load(&topk_state[0]).unwrap_err();
        assert!(e.contains("saved by plugin `topk`"), "{e}");
        assert!(rank.load(b"nonsense").is_err());
        rank.load(&[]).unwrap();
    });
}

#[test]
fn unknown_and_invalid_config_keys_are_rejected() {
    let cases = [
        ("fp16.wasm", "ratio = 0.1", "unknown config key `ratio`"),
        ("bf16.wasm", "x = 1", "unknown config key `x`"),
        ("topk.wasm", "ratoi = 0.1", "unknown config key `ratoi`"),
        ("topk.wasm", "ratio = 1.5", "ratio must lie in (0, 1]"),
        ("randomk.wasm", "ratio = 0.0", "ratio must lie in (0, 1]"),
        ("powersgd.wasm", "rank = 0", "rank must be at least 1"),
        ("powersgd.wasm", "rnak = 2", "unknown config key `rnak`"),
        ("qsgd.wasm", "levels = 512", "levels must lie in 2..=256"),
        ("onebit.wasm", "scale = 1", "unknown config key `scale`"),
    ];
    for (file, config, want) in cases {
        let art = Artifact::open(file);
        let mut rank = Rank::unconfigured(&art, InProcessGroup::new(1, Duration::from_secs(1)).rank(0, None));
        let e = rank.configure(config).unwrap_err();
        assert!(e.contains(want), "{file} with {config:?}: {e}");
    }
}

/// PowerSGD's `min_compression`: a weight that would compress less is
/// all-reduced in full (exact mean, fp32 bytes).
#[test]
fn powersgd_min_compression_falls_back_to_a_plain_all_reduce() {
    // An 8 x 8 weight, r = 4: factor 64 / (16 * 4) = 1 < 2.
    let inputs: Vec<Vec<f32>> = (0..2).map(|r| grad(64, r, 0)).collect();
    let layout = [laid(&[("w", &[8, 8])])];
    let config = "rank = 4\nmin_compression = 2.0";
    let out = on_ranks_laid(2, "powersgd.wasm", config, &layout, |r, rank| (rank.reduce(&inputs[r], 0, 0), rank.bytes_sent()));
    assert!(max_abs_diff(&out[0].0, &mean(&inputs)) <= 1e-6);
    assert_eq!(out[0].1, 4 * 64, "a plain fp32 all-reduce of 64 floats on 2 ranks sends 256 bytes");
}

// ---------------------------------------------------------------------------
// The suite, shortened, through the binary

/// Each compressor's bytes on the wire relative to the built-in all-reduce
/// on two ranks, for a bucket of n elements (one bucket per step: the tiny
/// models are far below `bucket_mb`). Ring accounting as above with w = 2:
/// an all-reduce of B bytes sends B, an all-gather sends one rank's B.
fn expected_ratio(strategy: &str, n: u64) -> f64 {
    let fp32 = 4.0 * n as f64;
    let k = (0.05 * n as f64).ceil();
    let signs = n.div_ceil(8) as f64;
    let sent = match strategy {
        "fp16" | "bf16" => 2.0 * n as f64,
        "topk-5pct" => 8.0 * k,
        // k per tensor, ceil(0.05 n_t) each.
        "topk-5pct-layers" => 8.0 * MLP_TINY.iter().map(|p| (0.05 * p.iter().product::<u64>() as f64).ceil()).sum::<f64>(),
        "randomk-5pct" => 4.0 * k,
        "powersgd-r4" => 4.0 * powersgd_floats(MLP_TINY, 4, n),
        "qsgd-256" => n as f64 + signs + 4.0 * MLP_TINY.len() as f64,
        "onebit" => signs + 4.0,
        other => panic!("no formula for {other}"),
    };
    sent / fp32
}

/// The parameters of the MLP's `tiny` preset (vocab 256, width 64,
/// feed-forward 256), all in one bucket: the embedding, the hidden layer's
/// weight and bias, the output layer's.
const MLP_TINY: &[&[u64]] = &[&[256, 64], &[256, 64], &[256], &[256, 256], &[256]];

/// Floats per-layer PowerSGD at rank `r` all-reduces for a bucket of
/// `params` (default min_compression 2): `(rows + cols) r` per weight it
/// compresses, the elements of every other tensor.
fn powersgd_floats(params: &[&[u64]], r: u64, n: u64) -> f64 {
    assert_eq!(params.iter().map(|p| p.iter().product::<u64>()).sum::<u64>(), n, "the bucket is not {params:?}: the model changed");
    params
        .iter()
        .map(|p| {
            let numel: u64 = p.iter().product();
            let (rows, cols) = (p[0], numel / p[0]);
            let r = r.min(rows).min(cols);
            let compressed = p.len() >= 2 && (rows + cols) * r * 2 < rows * cols;
            if compressed {
                (rows + cols) * r
            } else {
                numel
            }
        })
        .sum::<u64>() as f64
}

#[test]
fn the_compressors_suite_trains_with_every_method_and_saves_the_bytes_it_claims() {
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(repo_root().join("suites/compressors-cpu.toml")).unwrap();
    let mut suite: toml::Table = src.parse().unwrap();
    // Shortened: the token MLP only (as the suite has it: 300 steps,
    // evaluated every 25); artifacts by absolute path (the suite's are
    // relative to suites/).
    let workloads = suite["workload"].as_array_mut().unwrap();
    workloads.retain(|w| w["name"].as_str() == Some("mlp-tiny"));
    assert_eq!(workloads.len(), 1, "the suite has no mlp-tiny workload");
    for p in suite["plugin"].as_array_mut().unwrap() {
        let p = p.as_table_mut().unwrap();
        let rel = p["path"].as_str().unwrap().to_owned();
        let abs = repo_root().join("suites").join(rel);
        assert!(abs.exists(), "{} is missing: run scripts/build-plugins.sh", abs.display());
        p.insert("path".into(), abs.display().to_string().into());
    }
    let path = write(dir.path(), "suite.toml", &toml::to_string(&suite).unwrap());
    let out_path = dir.path().join("r.json");
    run_ok(harness(dir.path()).arg("run").arg(&path).arg("--out").arg(&out_path).arg("-q"));
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&out_path).unwrap()).unwrap();
    let entries = r["entries"].as_array().unwrap();
    let get = |id: &str| entries.iter().find(|e| e["id"] == id).unwrap_or_else(|| panic!("no entry {id}"));
    let base = get("mlp-tiny/allreduce/r0");
    let base_bytes = base["metrics"]["bytes_on_wire"].as_f64().unwrap();
    // One bucket of n f32 gradients: an fp32 all-reduce of 4n bytes per
    // step, which sends 2(w-1)/w * 4n = 4n bytes on two ranks.
    let buckets = base["metrics"]["bucket_bytes"].as_array().unwrap();
    assert_eq!(buckets.len(), 1, "the formulas assume one bucket: {buckets:?}");
    let n = buckets[0].as_u64().unwrap() / 4;
    let steps = base["metrics"]["steps"].as_f64().unwrap();
    assert_eq!(base_bytes, 4.0 * n as f64 * steps);
    // Measured on this workload (seed 1, 300 steps, evaluated every 25, on
    // the 2-core CPU VM where this was written; losses do not depend on
    // timing): allreduce, fp16, bf16 and qsgd-256 (scaled per tensor) reach
    // the target (1.1796) at step 100, topk-5pct at 200, onebit at 275. Two
    // miss it, and are pinned by how far their final eval loss may stay
    // above the target: the measured miss with a margin of about 2x.
    // randomk-5pct: final 1.2028 (+0.023); powersgd-r4: 1.2624 (+0.083),
    // per weight matrix (the bucket as one 315 x 314 matrix, before SDK 0.2,
    // ended at 1.4944, +0.315, sending half the bytes).
    let pinned_miss: &[(&str, f64)] = &[("randomk-5pct", 0.05), ("powersgd-r4", 0.17)];
    for e in entries {
        let id = e["id"].as_str().unwrap();
        assert_eq!(e["status"], "ok", "{id}: {e}");
        let m = &e["metrics"];
        let name = id.split('/').nth(1).unwrap();
        let target = m["target_loss"].as_f64().unwrap();
        let final_loss = m["final_eval_loss"].as_f64().unwrap();
        eprintln!(
            "{id}: steps_to_target {} final_eval_loss {final_loss:.4} (target {target:.4}) bytes_on_wire {}",
            m["steps_to_target"], m["bytes_on_wire"]
        );
        match pinned_miss.iter().find(|(s, _)| *s == name) {
            Some((_, miss)) => {
                assert!(final_loss <= target + miss, "{id}: final eval loss {final_loss} misses {target} by more than {miss}")
            }
            None => assert!(m["steps_to_target"].is_u64(), "{id} did not reach its target {target}: final eval loss {final_loss}"),
        }
        if name != "allreduce" {
            let got = m["bytes_on_wire"].as_f64().unwrap() / base_bytes;
            let want = expected_ratio(name, n);
            assert!((got - want).abs() <= 0.05 * want, "{id}: bytes on the wire {got:.5} of the baseline's, the method implies {want:.5}");
        }
    }
    assert_eq!(entries.len(), 9);
}
