//! What a host op will cost, known before it runs: the bytes of the tensors
//! it creates and an estimate of its time, from the shapes of its inputs.
//! [`super::ops::HostSide`] refuses an op whose new tensors would not fit
//! the plugin's tensor cap, or whose estimated time would not fit the time
//! left in the call's deadline, before libtorch allocates or computes
//! anything: a plugin cannot make the host allocate 20 GiB or multiply
//! matrices for minutes first and be refused afterwards.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use harness_sdk::abi::Op;
use tch::{Device, Kind, Tensor};

/// An op's cost before it runs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Cost {
    /// Bytes of the tensors it creates and hands back (an upper bound).
    pub bytes: u64,
    /// Bytes of its intermediates at their peak, besides those tensors:
    /// freed when it returns, but held while it runs (an upper bound).
    pub temp: u64,
    /// Floating-point operations of its arithmetic-bound part (matrix
    /// products, factorisations), against the device's matmul rate.
    pub flops: f64,
    /// Bytes it reads and writes, intermediates included, each weighted by
    /// how much slower than a streaming pass its access is (random
    /// indices, sorting, random numbers), against the device's memory rate.
    pub traffic: f64,
}

impl Cost {
    fn add(self, o: Cost) -> Cost {
        Cost {
            bytes: self.bytes.saturating_add(o.bytes),
            temp: self.temp.saturating_add(o.temp),
            flops: self.flops + o.flops,
            traffic: self.traffic + o.traffic,
        }
    }

    /// Memory the op holds at its peak: its new tensors and intermediates.
    pub fn peak(&self) -> u64 {
        self.bytes.saturating_add(self.temp)
    }
}

/// How much slower than a streaming pass over memory each kind of access
/// is, per byte (measured on CPUs, where they are slowest relative to a
/// pass; `tests::estimates_bound_the_measured_time_of_every_op` checks
/// them): the estimate must not fall below the time, or an op could run
/// for many times the deadline it was admitted under.
mod weight {
    /// Element-wise maths beyond a copy (division, comparisons).
    pub const MATH: f64 = 2.0;
    /// Transcendental element-wise maths (sqrt).
    pub const HEAVY: f64 = 8.0;
    /// Maths that makes integers floating (u8 plus a float: a slow path).
    pub const INT_TO_FLOAT: f64 = 40.0;
    /// Copies through strides (a transpose made contiguous).
    pub const STRIDED: f64 = 4.0;
    /// Reads and writes at indices (index_select, scatter_add).
    pub const INDEXED: f64 = 6.0;
    /// Generating random numbers, per byte of output.
    pub const RANDOM: f64 = 12.0;
    /// A random permutation, per byte of it.
    pub const PERMUTATION: f64 = 24.0;
    /// Selecting the k largest: per byte of input and per doubling of k.
    pub const SELECT: f64 = 1.0;
    /// A QR factorisation, per flop (LAPACK's on tall, thin matrices is
    /// far from the matmul rate).
    pub const QR: f64 = 8.0;
    /// Matrix products of kinds without fast kernels on the device (any
    /// but f32 and f64 on a CPU), per flop.
    pub const SLOW_MATMUL: f64 = 8.0;
}

fn numel(shape: &[i64]) -> u64 {
    shape.iter().map(|&d| d.max(0) as u64).fold(1u64, |a, d| a.saturating_mul(d))
}

/// The shape two tensors broadcast to (right-aligned; sizes equal or 1).
fn broadcast(a: &[i64], b: &[i64]) -> Result<Vec<i64>> {
    let n = a.len().max(b.len());
    let at = |s: &[i64], i: usize| if i + s.len() >= n { s[i + s.len() - n] } else { 1 };
    (0..n)
        .map(|i| {
            let (x, y) = (at(a, i), at(b, i));
            ensure!(x == y || x == 1 || y == 1, "shapes {a:?} and {b:?} do not broadcast");
            Ok(x.max(y))
        })
        .collect()
}

/// Bytes per element of the WIT dtype with index `i` (f32, f16, bf16, f64,
/// i64, i32, u8, bool); 8 for an unknown index (the op reports it).
fn dtype_bytes(i: i64) -> u64 {
    [4, 2, 2, 8, 8, 4, 1, 1].get(i as usize).copied().unwrap_or(8)
}

fn elt(t: &Tensor) -> u64 {
    t.kind().elt_size_in_bytes() as u64
}

fn bytes_of(t: &Tensor) -> u64 {
    (t.numel() as u64).saturating_mul(elt(t))
}

/// Bytes per element of the result of element-wise maths on kinds `a` and
/// `b`: the larger, and at least 4 when they differ or are integers that
/// the maths makes floating (type promotion: f16 with bf16 gives f32, u8
/// with a float scalar gives f32).
fn promoted(a: Kind, b: Kind) -> u64 {
    let (x, y) = (a.elt_size_in_bytes() as u64, b.elt_size_in_bytes() as u64);
    if a == b && matches!(a, Kind::Float | Kind::Half | Kind::BFloat16 | Kind::Double) {
        x
    } else {
        x.max(y).max(4)
    }
}

/// A pass that reads `read` bytes and writes `write` new ones, weighted.
fn pass(read: u64, write: u64, weight: f64) -> Cost {
    Cost { bytes: write, temp: 0, flops: 0.0, traffic: (read + write) as f64 * weight }
}

/// An intermediate of `b` bytes, written once and read once.
fn temp(b: u64) -> Cost {
    Cost { bytes: 0, temp: b, flops: 0.0, traffic: 2.0 * b as f64 }
}

/// The copy `reshape(-1)` or `contiguous()` makes of a tensor that is not
/// contiguous (a view from `narrow` or a lent bucket's view); nothing for a
/// contiguous one.
fn flat(t: &Tensor) -> Cost {
    if t.is_contiguous() {
        Cost::default()
    } else {
        temp(bytes_of(t))
    }
}

/// The cost of `op` on `inputs` (the tensors its ids name) with integer
/// arguments `ints`, `data` floats and `world` ranks: its new tensors, its
/// intermediates (each as [`super::ops`] computes the op) and its work.
/// Ops that only read metadata or make views cost nothing.
pub fn cost(op: Op, inputs: &[&Tensor], ints: &[i64], data: usize, world: usize) -> Result<Cost> {
    use Op::*;
    let n = |i: usize| inputs.get(i).map_or(0, |t| t.numel() as u64);
    let b = |i: usize| inputs.get(i).map_or(0, |t| bytes_of(t));
    let cuda = inputs.first().is_some_and(|t| t.device().is_cuda());
    Ok(match (op, inputs) {
        (Add | Sub | Mul | Div | LessThan, [x, y]) => {
            let out = numel(&broadcast(&x.size(), &y.size())?);
            if op == LessThan {
                // A bool result, then cast to the first input's kind.
                pass(b(0) + b(1), out, weight::MATH).add(temp(out)).add(pass(out, out.saturating_mul(elt(x)), 1.0))
            } else {
                pass(b(0) + b(1), out.saturating_mul(promoted(x.kind(), y.kind())), weight::MATH)
            }
        }
        (Matmul, [x, y]) if x.dim() == 2 && y.dim() == 2 => {
            let (a, c) = (x.size(), y.size());
            let (rows, inner, cols) = (a[0].max(0) as f64, a[1].max(0) as f64, c[1].max(0) as f64);
            let fast = matches!(x.kind(), Kind::Float | Kind::Double) || cuda;
            let out = pass(b(0) + b(1), numel(&[a[0], c[1]]).saturating_mul(promoted(x.kind(), y.kind())), 1.0);
            let flops = 2.0 * rows * inner * cols * if fast { 1.0 } else { weight::SLOW_MATMUL };
            out.add(flat(x)).add(flat(y)).add(Cost { flops, ..Cost::default() })
        }
        (Orthonormalize, [x]) if x.dim() == 2 => {
            let s = x.size();
            let (r, c) = (s[0].max(0) as f64, s[1].max(0) as f64);
            // An f32 copy, Householder QR (about 2 r c^2 flops, its
            // reflectors and R besides Q), Q cast back to the input's kind.
            let f32s = numel(&s).saturating_mul(4);
            let flops = 2.0 * r * c * c.min(r) * weight::QR;
            temp(f32s).add(temp(f32s)).add(pass(f32s, b(0), 1.0)).add(Cost {
                flops,
                traffic: (f32s as f64) * c.min(r).log2().max(1.0),
                ..Cost::default()
            })
        }
        // Zeros of its shape, then the copy.
        (Duplicate, [_]) => pass(b(0), b(0), 1.0).add(Cost { traffic: b(0) as f64, ..Cost::default() }),
        (Abs | Sign | Floor, [_]) => pass(b(0), b(0), weight::MATH),
        (Sqrt | AddScalar | MulScalar, [x]) => {
            let float = matches!(x.kind(), Kind::Float | Kind::Half | Kind::BFloat16 | Kind::Double);
            let w = if !float {
                weight::INT_TO_FLOAT
            } else if op == Sqrt {
                weight::HEAVY
            } else {
                weight::MATH
            };
            pass(b(0), n(0).saturating_mul(elt(x).max(4)), w)
        }
        (Transpose, [_]) => pass(b(0), b(0), weight::STRIDED),
        (Reshape, [x]) if !x.is_contiguous() => pass(b(0), b(0), weight::STRIDED),
        (Cast, [_]) if ints.len() == 1 => pass(b(0), n(0).saturating_mul(dtype_bytes(ints[0])), weight::MATH),
        (Topk, [x]) if ints.len() == 1 => {
            let k = ints[0].max(0) as u64;
            // The CPU kernel queues (value, index) pairs of the whole input.
            let select = Cost { traffic: (n(0) as f64) * 16.0 * weight::SELECT * (k.max(2) as f64).log2(), ..Cost::default() };
            flat(x).add(temp(n(0).saturating_mul(16))).add(pass(0, k.saturating_mul(elt(x) + 8), 1.0)).add(select)
        }
        (Gather, [x, _]) => flat(x).add(pass(b(1), n(1).saturating_mul(elt(x)), weight::INDEXED)),
        (ScatterAdd, [x, _, src]) => {
            // A copy of self, src cast to its kind, the indexed adds.
            let cast = if src.kind() == x.kind() { Cost::default() } else { temp(n(2).saturating_mul(elt(x))) };
            pass(b(0), b(0), 1.0).add(cast).add(Cost { traffic: (b(1) + 2 * n(1) * elt(x)) as f64 * weight::INDEXED, ..Cost::default() })
        }
        // A scalar out: the input as f64 (a copy unless it is f64), and for
        // mean-abs its absolute values in place.
        (Sum | Norm | MeanAbs, [x]) => {
            let double = if x.kind() == Kind::Double { Cost::default() } else { temp(n(0).saturating_mul(8)) };
            let abs = if op == MeanAbs {
                pass(n(0) * 8, 0, weight::MATH).add(temp(if x.kind() == Kind::Double { n(0) * 8 } else { 0 }))
            } else {
                Cost::default()
            };
            pass(b(0), 0, weight::MATH).add(double).add(abs)
        }
        (PackSigns, [x]) => {
            // Signs as bool, as u8, padded to whole bytes, weighted, summed.
            let m = n(0) + 8;
            flat(x).add(pass(b(0), 0, weight::MATH)).add(temp(m)).add(temp(m)).add(temp(m)).add(pass(m, m / 8, weight::MATH))
        }
        (UnpackSigns, [_]) if ints.len() == 1 => {
            // The bytes that hold n signs, each and-ed with 8 masks (u8),
            // compared with 0 (bool), as f32 scaled in place.
            let signs = ints[0].max(0) as u64;
            let bits = signs.div_ceil(8).saturating_mul(8);
            temp(bits)
                .add(temp(bits))
                .add(pass(bits, signs.saturating_mul(4), weight::MATH))
                .add(Cost { traffic: signs as f64 * 16.0, ..Cost::default() })
        }
        // Whole data out to the host: as f32, on the CPU, then copied out.
        (ReadF32, [x]) => {
            let f32s = n(0).saturating_mul(4);
            let cast = if x.kind() == Kind::Float { Cost::default() } else { temp(f32s) };
            let host = if cuda { temp(f32s) } else { Cost::default() };
            flat(x).add(cast).add(host).add(temp(f32s))
        }
        (Zeros, [_]) if !ints.is_empty() => pass(0, numel(&ints[1..]).saturating_mul(dtype_bytes(ints[0])), 1.0),
        (RandUniform | RandNormal, [_]) if !ints.is_empty() => pass(0, numel(&ints[1..]).saturating_mul(4), weight::RANDOM),
        // A permutation of n (an intermediate, but as large as n says),
        // then the first k, copied.
        (RandIndices, [_]) if ints.len() == 3 => {
            let (all, k) = (ints[0].max(0) as u64, ints[1].max(0) as u64);
            temp(all.saturating_mul(8)).add(Cost { traffic: all as f64 * 8.0 * weight::PERMUTATION, ..Cost::default() }).add(pass(
                k * 8,
                k * 8,
                1.0,
            ))
        }
        // The data as a CPU tensor, then moved to the device.
        (FromF32, [_]) => {
            let f32s = (data as u64).saturating_mul(4);
            pass(f32s, f32s, 1.0).add(if cuda { temp(f32s) } else { Cost::default() })
        }
        (AllGather, [x]) => flat(x).add(pass(b(0), b(0).saturating_mul(world as u64), 1.0)),
        (ReduceScatterSum, [x]) => flat(x).add(pass(b(0), b(0), 1.0)),
        (Assign, [x, y]) => pass(b(1), 0, weight::MATH)
            .add(Cost { traffic: b(0) as f64 * weight::MATH, ..Cost::default() })
            .add(if x.device() == y.device() { Cost::default() } else { temp(b(1)) }),
        (AllReduceSum | Broadcast, [_]) => pass(b(0), 0, 1.0).add(Cost { traffic: b(0) as f64, ..Cost::default() }),
        // Metadata, views, pointers: nothing new (a wrong argument count is
        // reported by the op itself).
        _ => Cost::default(),
    })
}

/// How fast a device works: its f32 matmul rate (flops per second) and the
/// rate of a streaming element-wise op into new memory (bytes read and
/// written per second, the allocation of the output included).
#[derive(Debug, Clone, Copy)]
pub struct Rate {
    pub flops: f64,
    pub bytes: f64,
}

/// How fast `device` works, measured once per process and device kind (a
/// few tens of milliseconds on a CPU). An op's estimated time is its flops
/// over the matmul rate plus its traffic over the memory rate.
pub fn rate(device: Device) -> Rate {
    static CPU: OnceLock<Rate> = OnceLock::new();
    static CUDA: OnceLock<Rate> = OnceLock::new();
    let cell = if device.is_cuda() { &CUDA } else { &CPU };
    *cell.get_or_init(|| measure_rate(device))
}

/// The best of three timings of `f` after a warm-up, waiting for the device.
fn best_of_three(f: &dyn Fn() -> Option<Tensor>) -> Option<Duration> {
    let _ = f()?.f_sum(Kind::Float).ok()?.f_double_value(&[]).ok()?;
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let t0 = Instant::now();
        let c = f()?;
        let _ = c.f_narrow(0, 0, 1).ok()?.f_sum(Kind::Float).ok()?.f_double_value(&[]).ok()?; // waits for the device
        best = best.min(t0.elapsed());
    }
    Some(best)
}

fn measure_rate(device: Device) -> Rate {
    let _guard = tch::no_grad_guard();
    let n: i64 = if device.is_cuda() { 2048 } else { 256 };
    let flops = Tensor::f_ones([n, n], (Kind::Float, device))
        .ok()
        .and_then(|a| best_of_three(&|| a.f_matmul(&a).ok()))
        .map(|t| 2.0 * (n * n * n) as f64 / t.as_secs_f64().max(1e-9));
    // 32 MiB in, 32 MiB out: large enough that the CPU's allocator maps
    // fresh pages for the output, as it does for a large op's.
    let len: i64 = if device.is_cuda() { 1 << 26 } else { 1 << 23 };
    let bytes = Tensor::f_ones([len], (Kind::Float, device))
        .ok()
        .and_then(|a| best_of_three(&|| a.f_add_scalar(1.0).ok()))
        .map(|t| 8.0 * len as f64 / t.as_secs_f64().max(1e-9));
    // Without a measurement, assume a fast device: estimates then err
    // towards letting ops run.
    Rate {
        flops: flops.unwrap_or(if device.is_cuda() { 1e14 } else { 1e11 }),
        bytes: bytes.unwrap_or(if device.is_cuda() { 2e12 } else { 2e10 }),
    }
}

/// The estimated time of `c` on a device of `rate`.
pub fn time(c: &Cost, rate: Rate) -> Duration {
    Duration::from_secs_f64((c.flops / rate.flops.max(1.0) + c.traffic / rate.bytes.max(1.0)).min(1e9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_outputs_are_counted_before_they_exist() {
        // A 100,000 x 1 and a 1 x 100,000 tensor broadcast to 10^10 elements:
        // 40 GB that must be refused before libtorch allocates it.
        let a = Tensor::zeros([100_000, 1], (Kind::Float, Device::Cpu));
        let b = Tensor::zeros([1, 100_000], (Kind::Float, Device::Cpu));
        let c = cost(Op::Add, &[&a, &b], &[], 0, 1).unwrap();
        assert_eq!(c.bytes, 40_000_000_000);
        assert!(cost(Op::Add, &[&a, &Tensor::zeros([3, 2], (Kind::Float, Device::Cpu))], &[], 0, 1).is_err());
    }

    #[test]
    fn matmul_costs_its_flops_and_output() {
        let a = Tensor::zeros([300, 200], (Kind::Float, Device::Cpu));
        let b = Tensor::zeros([200, 100], (Kind::Float, Device::Cpu));
        let c = cost(Op::Matmul, &[&a, &b], &[], 0, 1).unwrap();
        assert_eq!(c.bytes, 300 * 100 * 4);
        assert_eq!(c.flops, 2.0 * 300.0 * 200.0 * 100.0);
        assert!(rate(Device::Cpu).flops > 1e8, "a CPU multiplies at more than 0.1 GFLOP/s");
    }
}
