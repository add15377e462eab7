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
    /// Bytes of the tensors it creates (an upper bound).
    pub bytes: u64,
    /// Floating-point operations, or element reads and writes for
    /// memory-bound ops (an estimate).
    pub flops: f64,
}

/// Element-wise ops touch memory more than they compute: each element costs
/// this many "flops" against the matmul rate (a deliberate overestimate of
/// their speed, so that the estimate errs towards letting ops run).
const ELEMENT_FLOPS: f64 = 4.0;

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

/// The cost of `op` on `inputs` (the tensors its ids name) with integer
/// arguments `ints`, `data` floats and `world` ranks. Ops that only read
/// metadata or make views cost nothing.
pub fn cost(op: Op, inputs: &[&Tensor], ints: &[i64], data: usize, world: usize) -> Result<Cost> {
    use Op::*;
    let elt = |t: &Tensor| t.kind().elt_size_in_bytes() as u64;
    let n = |i: usize| inputs.get(i).map_or(0, |t| t.numel() as u64);
    let linear = |elements: u64, bytes_per: u64| Cost { bytes: elements.saturating_mul(bytes_per), flops: elements as f64 * ELEMENT_FLOPS };
    Ok(match op {
        Add | Sub | Mul | Div | LessThan if inputs.len() == 2 => {
            let out = numel(&broadcast(&inputs[0].size(), &inputs[1].size())?);
            linear(out, elt(inputs[0]).max(elt(inputs[1])))
        }
        Matmul if inputs.len() == 2 && inputs[0].dim() == 2 && inputs[1].dim() == 2 => {
            let (a, b) = (inputs[0].size(), inputs[1].size());
            let (rows, inner, cols) = (a[0].max(0) as f64, a[1].max(0) as f64, b[1].max(0) as f64);
            Cost { bytes: numel(&[a[0], b[1]]).saturating_mul(elt(inputs[0]).max(elt(inputs[1]))), flops: 2.0 * rows * inner * cols }
        }
        Orthonormalize if inputs.len() == 1 && inputs[0].dim() == 2 => {
            let s = inputs[0].size();
            let (r, c) = (s[0].max(0) as f64, s[1].max(0) as f64);
            // Householder QR: about 2 r c^2 flops; Q has the input's shape.
            Cost { bytes: numel(&s).saturating_mul(elt(inputs[0])), flops: 2.0 * r * c * c.min(r) }
        }
        Duplicate | Abs | Sign | Floor | Sqrt | AddScalar | MulScalar | Transpose if !inputs.is_empty() => linear(n(0), elt(inputs[0])),
        Cast if !inputs.is_empty() && ints.len() == 1 => linear(n(0), dtype_bytes(ints[0])),
        Topk if !inputs.is_empty() && ints.len() == 1 => {
            let k = ints[0].max(0) as u64;
            Cost { bytes: k.saturating_mul(16), flops: n(0) as f64 * ELEMENT_FLOPS * (k.max(2) as f64).log2() }
        }
        Gather if inputs.len() == 2 => linear(n(1), elt(inputs[0])),
        ScatterAdd if inputs.len() == 3 => linear(n(0) + n(1), elt(inputs[0])),
        // No tensor comes out (their temporaries are at most a few times
        // the input, which is itself capped or lent).
        Sum | Norm | MeanAbs | ReadF32 if !inputs.is_empty() => Cost { bytes: 0, flops: n(0) as f64 * ELEMENT_FLOPS },
        PackSigns if !inputs.is_empty() => linear(n(0), 2),
        UnpackSigns if ints.len() == 1 => linear(ints[0].max(0) as u64, 5),
        Zeros if !ints.is_empty() => linear(numel(&ints[1..]), dtype_bytes(ints[0])),
        RandUniform | RandNormal if !ints.is_empty() => linear(numel(&ints[1..]), 4),
        // A permutation of n (a temporary, but as large as n says), then
        // the first k, copied.
        RandIndices if ints.len() == 3 => linear(ints[0].max(0) as u64 + ints[1].max(0) as u64, 8),
        FromF32 => linear(data as u64, 4),
        AllGather if !inputs.is_empty() => linear(n(0).saturating_mul(world as u64), elt(inputs[0])),
        ReduceScatterSum if !inputs.is_empty() => linear(n(0), elt(inputs[0])),
        // Metadata, views, collectives in place, pointers: nothing new (a
        // wrong argument count is reported by the op itself).
        _ => Cost::default(),
    })
}

/// How fast `device` multiplies f32 matrices, in flops per second, measured
/// once per process and device kind (a few milliseconds). The estimate of
/// an op's time is its flops over this rate.
pub fn rate(device: Device) -> f64 {
    static CPU: OnceLock<f64> = OnceLock::new();
    static CUDA: OnceLock<f64> = OnceLock::new();
    let (cell, n) = if device.is_cuda() { (&CUDA, 2048i64) } else { (&CPU, 256i64) };
    *cell.get_or_init(|| measure_rate(device, n))
}

fn measure_rate(device: Device, n: i64) -> f64 {
    let run = || -> Option<f64> {
        let _guard = tch::no_grad_guard();
        let a = Tensor::f_ones([n, n], (Kind::Float, device)).ok()?;
        let _ = a.f_matmul(&a).ok()?; // warm-up (kernels, threads)
        let mut best = Duration::MAX;
        for _ in 0..3 {
            let t0 = Instant::now();
            let c = a.f_matmul(&a).ok()?;
            let _ = c.f_sum(Kind::Float).ok()?.f_double_value(&[]).ok()?; // waits for the device
            best = best.min(t0.elapsed());
        }
        Some(2.0 * (n * n * n) as f64 / best.as_secs_f64().max(1e-9))
    };
    // Without a measurement, assume a fast device: estimates then err
    // towards letting ops run.
    run().unwrap_or(if device.is_cuda() { 1e14 } else { 1e11 })
}

/// The estimated time of `c` on a device of `rate` flops per second.
pub fn time(c: &Cost, rate: f64) -> Duration {
    Duration::from_secs_f64((c.flops / rate.max(1.0)).min(1e9))
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
        assert!(rate(Device::Cpu) > 1e8, "a CPU multiplies at more than 0.1 GFLOP/s");
    }
}
