//! `topk`: top-k sparsification with error feedback (Stich et al. 2018,
//! "Sparsified SGD with memory"; Lin et al. 2018, "Deep gradient
//! compression").
//!
//! Per bucket: `acc = bucket + residual`; the `k = ceil(ratio * n)` entries
//! of largest `|acc|` are picked (values from `acc`); every rank's values and
//! indices are all-gathered, scatter-added into zeros, divided by the world
//! size and assigned to the bucket. What this rank did not send stays in its
//! residual: `residual = acc - (its own sparse contribution)`.
//!
//! ```toml
//! compressor_config = { ratio = 0.05 }   # fraction of entries sent, (0, 1]; default 0.05
//! ```
//!
//! Bytes on the wire: two all-gathers per bucket, of `k` f32 values and `k`
//! i32 indices per rank (i64 indices are used only for buckets of 2^31
//! elements or more): a ring sends `(w - 1) * 8k` bytes per rank, against
//! `2 (w - 1) / w * 4n` for an fp32 all-reduce.
//!
//! State: the residual of every bucket (`state_save` / `state_load`).

#[path = "../../shared/state.rs"]
mod state;

use harness_sdk::{tensor, BucketInfo, Collective, Compressor, Config, Dtype, Error, Plugin, Tensor};
use state::BucketState;

/// The plugin: one instance per rank.
pub struct TopK {
    ratio: f64,
    state: BucketState,
}

impl Plugin for TopK {
    const NAME: &'static str = "topk";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["ratio"])?;
        Ok(TopK { ratio: state::ratio(config, 0.05)?, state: BucketState::default() })
    }

    fn state_save(&self) -> Vec<u8> {
        self.state.save(Self::NAME)
    }

    fn state_load(&mut self, bytes: &[u8]) -> Result<(), Error> {
        self.state = BucketState::load(Self::NAME, bytes)?;
        Ok(())
    }
}

impl Compressor for TopK {
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
        let (_, idx) = acc.abs().topk(k);
        let vals = acc.gather(&idx);
        // Indices travel as i32 where they fit: half the bytes of i64.
        let wire_idx = if n <= i32::MAX as u64 { idx.cast(Dtype::I32) } else { idx.duplicate() };
        let all_vals = comm.all_gather(&vals);
        let all_idx = comm.all_gather(&wire_idx).cast(Dtype::I64);
        let zeros = tensor::zeros(&[n], acc.dtype(), bucket);
        let sum = zeros.scatter_add(&all_idx, &all_vals);
        let mine = zeros.scatter_add(&idx, &vals);
        self.state.put(info.index, "residual", acc.sub(&mine));
        bucket.assign(&sum.mul_scalar(1.0 / world).reshape(&shape_i64(bucket)));
        Ok(())
    }
}

fn shape_i64(t: &Tensor) -> Vec<i64> {
    t.shape().iter().map(|&d| d as i64).collect()
}

harness_sdk::export!(TopK as compressor);
