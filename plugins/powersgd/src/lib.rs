//! `powersgd`: rank-r PowerSGD with error feedback and warm start (Vogels,
//! Karimireddy and Jaggi 2019, Algorithm 1 with the error feedback of
//! their Algorithm 2; the same steps as PyTorch's `powerSGD_hook`).
//!
//! Matrix shape: a bucket of `n` elements is viewed as a row-major matrix of
//! `rows = ceil(sqrt(n))` by `cols = ceil(n / rows)`, zero-padded to `rows *
//! cols` (fewer than `rows` zeros). Square-ish matrices minimise `rows +
//! cols`, hence the bytes, for a given `n`; a bucket holds many parameters,
//! so the layers' own shapes are not available anyway. The padding is
//! placed with a scatter-add through the index `0..n`, built once per bucket
//! (the contract has no concatenation) and dropped again with `narrow`.
//!
//! Per bucket, with `M` the padded matrix of `bucket + residual` on this
//! rank and `Q` (cols x r) the previous step's factor (a standard normal
//! draw from the seed and bucket index at the first step, the same on
//! every rank):
//!
//! 1. `P = M Q`; all-reduce `P` (the sum: orthonormalisation ignores scale);
//! 2. `P = orthonormalize(P)` (reduced QR);
//! 3. `Q = M^T P`; all-reduce `Q`, divided by the world size: the mean of the
//!    ranks' `M_w^T P`;
//! 4. output `P Q^T` (= `P P^T mean(M_w)`, the mean's projection on span P),
//!    assigned to the bucket;
//! 5. `residual = M - P Q^T` (this rank's input minus the decompressed
//!    aggregate, as in the paper and the hook); `Q` is kept for the next
//!    step (warm start).
//!
//! ```toml
//! compressor_config = { rank = 4, seed = 0, min_compression = 2.0 }
//! # rank: r >= 1, default 4 (capped at min(rows, cols));
//! # seed: of the first Q, default 0;
//! # min_compression: optional; a bucket whose compression factor
//! #   n / ((rows + cols) * r) is below it is all-reduced in fp32 instead.
//! ```
//!
//! Bytes on the wire: all-reduces of `rows * r` and `cols * r` f32 per
//! bucket: `2 (w - 1) / w * 4 (rows + cols) r` bytes sent per rank,
//! `(rows + cols) r / n` of an fp32 all-reduce.
//!
//! State: per bucket, the residual and `Q`.

#[path = "../../shared/state.rs"]
mod state;

use harness_sdk::{tensor, BucketInfo, Collective, Compressor, Config, Dtype, Error, Plugin, Tensor};
use state::BucketState;

/// The plugin: one instance per rank.
pub struct PowerSgd {
    rank: u64,
    seed: u64,
    min_compression: Option<f64>,
    state: BucketState,
    /// Per bucket index: `0..n` as i64 (not saved: rebuilt on demand).
    arange: Vec<Option<Tensor>>,
}

impl Plugin for PowerSgd {
    const NAME: &'static str = "powersgd";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["rank", "seed", "min_compression"])?;
        let rank: u64 = config.get_or("rank", 4)?;
        if rank == 0 {
            return Err(Error::new("rank must be at least 1"));
        }
        let min_compression: Option<f64> = config.get("min_compression")?;
        if let Some(m) = min_compression {
            if !(m.is_finite() && m > 0.0) {
                return Err(Error::new(format!("min_compression must be finite and > 0, not {m}")));
            }
        }
        Ok(PowerSgd { rank, seed: config.get_or("seed", 0u64)?, min_compression, state: BucketState::default(), arange: Vec::new() })
    }

    fn state_save(&self) -> Vec<u8> {
        self.state.save(Self::NAME)
    }

    fn state_load(&mut self, bytes: &[u8]) -> Result<(), Error> {
        self.state = BucketState::load(Self::NAME, bytes)?;
        Ok(())
    }
}

/// The matrix a bucket of `n` elements is viewed as: `rows` the smallest
/// integer with `rows^2 >= n` (the float square root, corrected), `cols =
/// ceil(n / rows)`.
pub fn matrix_shape(n: u64) -> (u64, u64) {
    let mut rows = (n as f64).sqrt().ceil() as u64;
    while rows > 1 && (rows - 1) * (rows - 1) >= n {
        rows -= 1;
    }
    while rows * rows < n {
        rows += 1;
    }
    let rows = rows.max(1);
    (rows, n.div_ceil(rows).max(1))
}

impl Compressor for PowerSgd {
    fn compress(&mut self, bucket: &Tensor, comm: &Collective, info: BucketInfo) -> Result<(), Error> {
        let n = bucket.numel();
        let world = f64::from(comm.world_size());
        let shape: Vec<i64> = bucket.shape().iter().map(|&d| d as i64).collect();
        let (rows, cols) = matrix_shape(n);
        let r = self.rank.min(rows).min(cols);
        if let Some(min) = self.min_compression {
            if (n as f64) / (((rows + cols) * r) as f64) < min {
                comm.all_reduce_sum(bucket);
                bucket.assign(&bucket.mul_scalar(1.0 / world));
                return Ok(());
            }
        }
        let flat = bucket.reshape(&[-1]).cast(Dtype::F32);
        let acc = match self.state.take(info.index, "residual", bucket) {
            Some(e) if e.numel() == n => flat.add(&e),
            Some(e) => return Err(format!("bucket {} has {n} elements, its saved residual {}", info.index, e.numel()).into()),
            None => flat.duplicate(),
        };
        let padded = if rows * cols == n {
            acc.duplicate()
        } else {
            let i = info.index as usize;
            if self.arange.len() <= i {
                self.arange.resize_with(i + 1, || None);
            }
            let idx = self.arange[i].get_or_insert_with(|| {
                // perm[j] at position perm[j]: 0..n.
                let perm = tensor::rand_indices(n, n, 0, bucket);
                tensor::zeros(&[n], Dtype::I64, bucket).scatter_add(&perm, &perm)
            });
            tensor::zeros(&[rows * cols], Dtype::F32, bucket).scatter_add(idx, &acc)
        };
        let m = padded.reshape(&[rows as i64, cols as i64]);
        let q = match self.state.take(info.index, "q", bucket) {
            Some(q) if q.shape() == [cols, r] => q,
            Some(q) => return Err(format!("bucket {}: saved Q has shape {:?}, expected [{cols}, {r}]", info.index, q.shape()).into()),
            None => tensor::rand_normal(&[cols, r], state::mix(&[self.seed, u64::from(info.index)]), bucket),
        };
        let p = m.matmul(&q);
        comm.all_reduce_sum(&p);
        let p = p.orthonormalize();
        let q = m.transpose(0, 1).matmul(&p);
        comm.all_reduce_sum(&q);
        let q = q.mul_scalar(1.0 / world);
        let approx = p.matmul(&q.transpose(0, 1)).reshape(&[-1]).narrow(0, 0, n);
        self.state.put(info.index, "residual", acc.sub(&approx));
        self.state.put(info.index, "q", q);
        bucket.assign(&approx.reshape(&shape));
        Ok(())
    }
}

harness_sdk::export!(PowerSgd as compressor);
