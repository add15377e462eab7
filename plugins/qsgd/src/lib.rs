//! `qsgd`: QSGD stochastic quantization (Alistarh et al. 2017), unbiased,
//! without error feedback.
//!
//! Per bucket and rank: `norm = ||x||_2`; each `|x_i| / norm * s` (with `s
//! = levels - 1`) is rounded to one of its two neighbouring integers at
//! random, up with probability equal to its fractional part (`floor(y + u)`,
//! `u` uniform in [0, 1) from `rand_uniform`, seeded from the configured
//! seed, the step, the bucket index and the rank), so `E[q] = y`. Every
//! rank's levels (u8), signs (`pack_signs`) and `norm / s` (f32) are
//! all-gathered; the output is the average over ranks of `sign * q * norm /
//! s`, an unbiased estimate of the mean gradient.
//!
//! ```toml
//! compressor_config = { levels = 256, seed = 0 }   # levels in 2..=256 (u8 on the wire), default 256; seed default 0
//! ```
//!
//! Bytes on the wire: all-gathers of `n` u8 levels, `ceil(n / 8)` bytes of
//! signs and one f32 per rank: a ring sends `(w - 1) * (n + ceil(n / 8) +
//! 4)` bytes per rank (9/32 of an fp32 all-reduce on two ranks).
//!
//! No state: the random numbers depend only on the seed, step, bucket and
//! rank.

#[path = "../../shared/state.rs"]
mod state;

use harness_sdk::{tensor, BucketInfo, Collective, Compressor, Config, Dtype, Error, Plugin, Tensor};

/// The plugin: one instance per rank.
pub struct Qsgd {
    /// Quantization intervals: `levels - 1`.
    s: f64,
    seed: u64,
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
        Ok(Qsgd { s: f64::from(levels - 1), seed: config.get_or("seed", 0u64)? })
    }
}

impl Compressor for Qsgd {
    fn compress(&mut self, bucket: &Tensor, comm: &Collective, info: BucketInfo) -> Result<(), Error> {
        let n = bucket.numel();
        let world = u64::from(comm.world_size());
        let x = bucket.reshape(&[-1]);
        let norm = x.norm();
        // Levels in 0..=s: |x| / norm <= 1, up to rounding, which the clamp
        // below takes back.
        let factor = if norm > 0.0 && norm.is_finite() { self.s / norm } else { 0.0 };
        let y = x.abs().cast(Dtype::F32).mul_scalar(factor);
        let u = tensor::rand_uniform(&[n], state::mix(&[self.seed, info.step, u64::from(info.index), u64::from(comm.rank())]), bucket);
        let q = y.add(&u).floor();
        let top = tensor::from_f32(&[self.s as f32], &[1], bucket);
        let q = q.sub(&top.less_than(&q));
        let levels = q.cast(Dtype::U8);
        let signs = x.pack_signs();
        let bytes = signs.numel();
        let unit = (norm / self.s) as f32;
        let all_levels = comm.all_gather(&levels);
        let all_signs = comm.all_gather(&signs);
        let all_units = comm.all_gather(&tensor::from_f32(&[if factor > 0.0 { unit } else { 0.0 }], &[1], bucket));
        let w = world as i64;
        let signs = tensor::unpack_signs(&all_signs, world * bytes * 8).reshape(&[w, (bytes * 8) as i64]).narrow(1, 0, n);
        let values = all_levels.cast(Dtype::F32).reshape(&[w, n as i64]).mul(&signs);
        let sum = all_units.reshape(&[1, w]).matmul(&values).reshape(&[-1]);
        let shape: Vec<i64> = bucket.shape().iter().map(|&d| d as i64).collect();
        bucket.assign(&sum.mul_scalar(1.0 / world as f64).reshape(&shape));
        Ok(())
    }
}

harness_sdk::export!(Qsgd as compressor);
