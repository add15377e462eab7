//! `randomk`: random-k sparsification with error feedback (Stich et al.
//! 2018, "Sparsified SGD with memory").
//!
//! Per bucket: `acc = bucket + residual`; `k = ceil(ratio * n)` indices are
//! drawn with `rand_indices(n, k, seed')`, where `seed'` mixes the configured
//! seed, the step and the bucket index: the same on every rank, so the
//! picked values are all-reduced directly (k floats). The sum is scattered
//! into zeros, divided by the world size and assigned; `residual = acc -
//! (this rank's picked values, scattered)`. Values are not rescaled by n/k:
//! error feedback delivers the rest later.
//!
//! ```toml
//! compressor_config = { ratio = 0.05, seed = 0 }   # ratio in (0, 1], default 0.05; seed default 0
//! ```
//!
//! Bytes on the wire: one all-reduce of `k` f32 per bucket, `2 (w - 1) / w *
//! 4k` bytes sent per rank: `ratio` times an fp32 all-reduce.
//!
//! State: the residual of every bucket. The indices depend only on the seed,
//! the step and the bucket, so no generator state is needed.

#[path = "../../shared/state.rs"]
mod state;

use harness_sdk::{tensor, BucketInfo, Collective, Compressor, Config, Error, Plugin, Tensor};
use state::BucketState;

/// The plugin: one instance per rank.
pub struct RandomK {
    ratio: f64,
    seed: u64,
    state: BucketState,
}

impl Plugin for RandomK {
    const NAME: &'static str = "randomk";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["ratio", "seed"])?;
        Ok(RandomK { ratio: state::ratio(config, 0.05)?, seed: config.get_or("seed", 0u64)?, state: BucketState::default() })
    }

    fn state_save(&self) -> Vec<u8> {
        self.state.save(Self::NAME)
    }

    fn state_load(&mut self, bytes: &[u8]) -> Result<(), Error> {
        self.state = BucketState::load(Self::NAME, bytes)?;
        Ok(())
    }
}

impl Compressor for RandomK {
    fn compress(&mut self, bucket: &Tensor, comm: &Collective, info: BucketInfo) -> Result<(), Error> {
        let n = bucket.numel();
        let world = f64::from(comm.world_size());
        let flat = bucket.reshape(&[-1]);
        let acc = match self.state.take(info.index, "residual", bucket) {
            Some(r) if r.numel() == n => flat.add(&r),
            Some(r) => return Err(format!("bucket {} has {n} elements, its saved residual {}", info.index, r.numel()).into()),
            None => flat.duplicate(),
        };
        let k = state::count(self.ratio, n);
        let idx = tensor::rand_indices(n, k, state::mix(&[self.seed, info.step, u64::from(info.index)]), bucket);
        let mine = acc.gather(&idx);
        let sum = mine.duplicate();
        comm.all_reduce_sum(&sum);
        let zeros = tensor::zeros(&[n], acc.dtype(), bucket);
        self.state.put(info.index, "residual", acc.sub(&zeros.scatter_add(&idx, &mine)));
        let shape: Vec<i64> = bucket.shape().iter().map(|&d| d as i64).collect();
        bucket.assign(&zeros.scatter_add(&idx, &sum).mul_scalar(1.0 / world).reshape(&shape));
        Ok(())
    }
}

harness_sdk::export!(RandomK as compressor);
