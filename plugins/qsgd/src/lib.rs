//! `qsgd`: QSGD stochastic quantization (Alistarh et al. 2017), unbiased,
//! without error feedback, scaled per tensor.
//!
//! Per tensor of the bucket (its layout, from contract 0.2's `setup`) and
//! rank: `norm = ||x||_2` of the tensor; each `|x_i| / norm * s` (with `s =
//! levels - 1`) is rounded to one of its two neighbouring integers at
//! random, up with probability equal to its fractional part (`floor(y + u)`,
//! `u` uniform in [0, 1) from `rand_uniform`, seeded from the configured
//! seed, the step, the bucket index and the rank), so `E[q] = y`. Every
//! rank's levels (u8), signs (`pack_signs`) and each tensor's `norm / s`
//! (f32) are all-gathered; the output is the average over ranks of `sign *
//! q * norm / s`, an unbiased estimate of the mean gradient. The norms stay
//! on the device (a tensor's norm is `sqrt(x x^T)`, and a norm below about
//! 1e-30 counts as 1e-30, so a tensor of zeros stays zeros).
//!
//! ```toml
//! compressor_config = { levels = 256, seed = 0 }   # levels in 2..=256 (u8 on the wire), default 256; seed default 0
//! ```
//!
//! Bytes on the wire: all-gathers of `n` u8 levels, `ceil(n / 8)` bytes of
//! signs and one f32 per tensor per rank: a ring sends `(w - 1) * (n +
//! ceil(n / 8) + 4 t)` bytes per rank for `t` tensors (about 9/32 of an fp32
//! all-reduce on two ranks).
//!
//! No state: the random numbers depend only on the seed, step, bucket and
//! rank.

#[path = "../../shared/state.rs"]
mod state;

use harness_sdk::{tensor, BucketInfo, BucketLayout, Collective, Compressor, Config, Dtype, Error, Plugin, Tensor};

/// The plugin: one instance per rank.
pub struct Qsgd {
    /// Quantization intervals: `levels - 1`.
    s: f64,
    seed: u64,
    layouts: Vec<BucketLayout>,
}

impl Plugin for Qsgd {
    const NAME: &'static str = "qsgd";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["levels", "seed"])?;
        let levels: u32 = config.get_or("levels", 256)?;
        if !(2..=256).contains(&levels) {
            return Err(Error::new(format!("levels must lie in 2..=256 (they travel as u8), not {levels}")));
        }
        Ok(Qsgd { s: f64::from(levels - 1), seed: config.get_or("seed", 0u64)?, layouts: Vec::new() })
    }
}

impl Compressor for Qsgd {
    fn setup(&mut self, buckets: &[BucketLayout]) -> Result<(), Error> {
        self.layouts = buckets.to_vec();
        Ok(())
    }

    fn compress(&mut self, bucket: &Tensor, comm: &Collective, info: BucketInfo) -> Result<(), Error> {
        let n = bucket.numel();
        let world = u64::from(comm.world_size());
        let layout = self.layouts.get(info.index as usize).ok_or_else(|| {
            Error::new(format!("bucket {} has no layout ({} were set up): the host did not call setup", info.index, self.layouts.len()))
        })?;
        if layout.numel != n {
            return Err(format!("bucket {} has {n} elements, its layout {}", info.index, layout.numel).into());
        }
        // (offset, numel) of each tensor.
        let tensors: Vec<(u64, u64)> = layout.params.iter().filter(|p| p.numel > 0).map(|p| (p.offset, p.numel)).collect();
        let t = tensors.len() as u64;
        let x = bucket.reshape(&[-1]).cast(Dtype::F32);
        let y = tensor::zeros(&[n], Dtype::F32, bucket);
        let units = tensor::zeros(&[t.max(1)], Dtype::F32, bucket);
        for (i, &(offset, numel)) in tensors.iter().enumerate() {
            let xi = x.narrow(0, offset, numel).reshape(&[1, numel as i64]);
            let norm = xi.matmul(&xi.transpose(0, 1)).sqrt().add_scalar(1e-30);
            units.narrow(0, i as u64, 1).assign(&norm.mul_scalar(1.0 / self.s).reshape(&[1]));
            y.narrow(0, offset, numel).assign(&xi.abs().div(&norm).mul_scalar(self.s).reshape(&[-1]));
        }
        let u = tensor::rand_uniform(&[n], state::mix(&[self.seed, info.step, u64::from(info.index), u64::from(comm.rank())]), bucket);
        let q = y.add(&u).floor();
        // y <= s, so floor(y + u) <= s unless rounding lands on s + 1.
        let top = tensor::from_f32(&[self.s as f32], &[1], bucket);
        let q = q.sub(&top.less_than(&q));
        let levels = q.cast(Dtype::U8);
        let signs = x.pack_signs();
        let bytes = signs.numel();
        let all_levels = comm.all_gather(&levels);
        let all_signs = comm.all_gather(&signs);
        let all_units = comm.all_gather(&units);
        let w = world as i64;
        let signs = tensor::unpack_signs(&all_signs, world * bytes * 8).reshape(&[w, (bytes * 8) as i64]).narrow(1, 0, n);
        let values = all_levels.cast(Dtype::F32).reshape(&[w, n as i64]).mul(&signs);
        let units = all_units.reshape(&[w, t.max(1) as i64]);
        let flat = bucket.reshape(&[-1]);
        for (i, &(offset, numel)) in tensors.iter().enumerate() {
            // sum over ranks of unit[rank] * values[rank, tensor's elements].
            let sum = units.narrow(1, i as u64, 1).reshape(&[1, w]).matmul(&values.narrow(1, offset, numel));
            flat.narrow(0, offset, numel).assign(&sum.mul_scalar(1.0 / world as f64).reshape(&[-1]));
        }
        Ok(())
    }
}

harness_sdk::export!(Qsgd as compressor);
