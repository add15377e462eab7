//! `powersgd`: rank-r PowerSGD with error feedback and warm start, per
//! weight matrix (Vogels, Karimireddy and Jaggi 2019, Algorithm 1 with the
//! error feedback of their Algorithm 2), the steps of PyTorch's
//! `powerSGD_hook`.
//!
//! The bucket's layout (contract 0.2's `setup`) says which parameters it
//! holds. Each weight whose low-rank form is worth it is compressed as a
//! matrix of its own: `shape[0]` rows by the rest (a convolution's kernel
//! too), at rank `r = min(rank, rows, cols)`, when `(rows + cols) r *
//! min_compression < rows cols` (the hook's `min_compression_rate` test).
//! Every other tensor (biases, norms' gains, small or square-ish weights)
//! travels uncompressed: packed into one buffer and all-reduced.
//!
//! Per bucket, with `A = bucket + residual` on this rank (error feedback on
//! the whole bucket, as the hook's), `M_i` each compressed weight's slice of
//! `A` as a matrix and `Q_i` (cols x r) its previous step's factor (a
//! standard normal draw from the seed, the bucket and the parameter's index
//! at the first step, the same on every rank):
//!
//! 1. the uncompressed tensors of `A`, packed, all-reduced and divided by the
//!    world size, into their places in the bucket;
//! 2. `P_i = M_i Q_i`, packed into one buffer, all-reduced (the sum:
//!    orthonormalisation ignores scale); `P_i = orthonormalize(P_i)`
//!    (reduced QR);
//! 3. `Q_i = M_i^T P_i`, packed, all-reduced and divided by the world size;
//! 4. `P_i Q_i^T` into the weight's place in the bucket;
//! 5. `residual = A - bucket` (this rank's input minus the aggregate, for
//!    the uncompressed tensors too, as the hook does); `Q_i` kept for the
//!    next step (warm start).
//!
//! Before `start_step` every bucket is all-reduced in full, without error
//! feedback (the hook's `start_powerSGD_iter`, whose default there is 1000).
//!
//! ```toml
//! compressor_config = { rank = 4, seed = 0, min_compression = 2.0, start_step = 0 }
//! # rank: r >= 1, default 4 (capped at min(rows, cols) per matrix);
//! # seed: of the first Qs, default 0;
//! # min_compression: > 0, default 2 (the hook's): a weight is compressed
//! #   when (rows + cols) r * min_compression < rows * cols;
//! # start_step: steps all-reduced in full first, default 0.
//! ```
//!
//! Bytes on the wire per bucket: three all-reduces, of the uncompressed
//! elements, of `sum rows_i r_i` and of `sum cols_i r_i` f32 (each all-reduce
//! of B bytes sends `2 (w - 1) / w B` per rank).
//!
//! State: per bucket, the residual and each compressed weight's `Q`.

#[path = "../../shared/state.rs"]
mod state;

use harness_sdk::{tensor, BucketInfo, BucketLayout, Collective, Compressor, Config, Dtype, Error, Plugin, Tensor};
use state::BucketState;

/// The plugin: one instance per rank.
pub struct PowerSgd {
    rank: u64,
    seed: u64,
    min_compression: f64,
    start_step: u64,
    layouts: Vec<BucketLayout>,
    state: BucketState,
}

impl Plugin for PowerSgd {
    const NAME: &'static str = "powersgd";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["rank", "seed", "min_compression", "start_step"])?;
        let rank: u64 = config.get_or("rank", 4)?;
        if rank == 0 {
            return Err(Error::new("rank must be at least 1"));
        }
        let min_compression: f64 = config.get_or("min_compression", 2.0)?;
        if !(min_compression.is_finite() && min_compression > 0.0) {
            return Err(Error::new(format!("min_compression must be finite and > 0, not {min_compression}")));
        }
        Ok(PowerSgd {
            rank,
            seed: config.get_or("seed", 0u64)?,
            min_compression,
            start_step: config.get_or("start_step", 0u64)?,
            layouts: Vec::new(),
            state: BucketState::default(),
        })
    }

    fn state_save(&self) -> Vec<u8> {
        self.state.save(Self::NAME)
    }

    fn state_load(&mut self, bytes: &[u8]) -> Result<(), Error> {
        self.state = BucketState::load(Self::NAME, bytes)?;
        Ok(())
    }
}

/// How one parameter of a bucket travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Uncompressed: `numel` elements at `offset`.
    Plain { offset: u64, numel: u64 },
    /// A `rows x cols` matrix at `offset`, at rank `r`; `param` is its index
    /// in the bucket (its `Q`'s name in the state).
    Matrix { param: usize, offset: u64, rows: u64, cols: u64, r: u64 },
}

/// How each parameter of `layout` travels, at rank `rank` with the hook's
/// `min_compression` test.
pub fn plan(layout: &BucketLayout, rank: u64, min_compression: f64) -> Vec<Slot> {
    layout
        .params
        .iter()
        .enumerate()
        .map(|(param, p)| {
            let (rows, cols) = p.matrix();
            let r = rank.min(rows).min(cols);
            if p.weight && (((rows + cols) * r) as f64) * min_compression < (rows * cols) as f64 {
                Slot::Matrix { param, offset: p.offset, rows, cols, r }
            } else {
                Slot::Plain { offset: p.offset, numel: p.numel }
            }
        })
        .collect()
}

impl Compressor for PowerSgd {
    fn setup(&mut self, buckets: &[BucketLayout]) -> Result<(), Error> {
        self.layouts = buckets.to_vec();
        Ok(())
    }

    fn compress(&mut self, bucket: &Tensor, comm: &Collective, info: BucketInfo) -> Result<(), Error> {
        let n = bucket.numel();
        let scale = 1.0 / f64::from(comm.world_size());
        let layout = self.layouts.get(info.index as usize).ok_or_else(|| {
            Error::new(format!("bucket {} has no layout ({} were set up): the host did not call setup", info.index, self.layouts.len()))
        })?;
        if layout.numel != n {
            return Err(format!("bucket {} has {n} elements, its layout {}", info.index, layout.numel).into());
        }
        let flat = bucket.reshape(&[-1]);
        if info.step < self.start_step {
            comm.all_reduce_sum(bucket);
            bucket.assign(&bucket.mul_scalar(scale));
            return Ok(());
        }
        // A cast to the bucket's own dtype is the bucket itself: `acc` is a
        // copy either way, read after the bucket is overwritten.
        let input = flat.cast(Dtype::F32);
        let acc = match self.state.take(info.index, "residual", bucket) {
            Some(e) if e.numel() == n => input.add(&e),
            Some(e) => return Err(format!("bucket {} has {n} elements, its saved residual {}", info.index, e.numel()).into()),
            None => input.duplicate(),
        };
        let slots = plan(layout, self.rank, self.min_compression);
        // 1. The uncompressed tensors, in one all-reduce.
        let plain: Vec<(u64, u64)> =
            slots.iter().filter_map(|s| if let Slot::Plain { offset, numel } = *s { Some((offset, numel)) } else { None }).collect();
        let plain_total: u64 = plain.iter().map(|p| p.1).sum();
        if plain_total > 0 {
            let buf = tensor::zeros(&[plain_total], Dtype::F32, bucket);
            let mut at = 0;
            for &(offset, numel) in &plain {
                buf.narrow(0, at, numel).assign(&acc.narrow(0, offset, numel));
                at += numel;
            }
            comm.all_reduce_sum(&buf);
            let mean = buf.mul_scalar(scale);
            let mut at = 0;
            for &(offset, numel) in &plain {
                flat.narrow(0, offset, numel).assign(&mean.narrow(0, at, numel));
                at += numel;
            }
        }
        // 2.-4. The weight matrices, their Ps in one all-reduce, their Qs in another.
        let matrices: Vec<(usize, u64, u64, u64, u64)> = slots
            .iter()
            .filter_map(|s| match *s {
                Slot::Matrix { param, offset, rows, cols, r } => Some((param, offset, rows, cols, r)),
                Slot::Plain { .. } => None,
            })
            .collect();
        if !matrices.is_empty() {
            let dims = |rows: u64, cols: u64| [rows as i64, cols as i64];
            let ms: Vec<Tensor> =
                matrices.iter().map(|&(_, offset, rows, cols, _)| acc.narrow(0, offset, rows * cols).reshape(&dims(rows, cols))).collect();
            let p_total: u64 = matrices.iter().map(|m| m.2 * m.4).sum();
            let q_total: u64 = matrices.iter().map(|m| m.3 * m.4).sum();
            let pbuf = tensor::zeros(&[p_total], Dtype::F32, bucket);
            let mut at = 0;
            for (m, &(param, _, rows, cols, r)) in ms.iter().zip(&matrices) {
                let name = format!("q{param}");
                let q = match self.state.take(info.index, &name, bucket) {
                    Some(q) if q.shape() == [cols, r] => q,
                    Some(q) => {
                        return Err(format!(
                            "bucket {} parameter {param}: saved Q has shape {:?}, expected [{cols}, {r}]",
                            info.index,
                            q.shape()
                        )
                        .into())
                    }
                    None => tensor::rand_normal(&[cols, r], state::mix(&[self.seed, u64::from(info.index), param as u64]), bucket),
                };
                pbuf.narrow(0, at, rows * r).reshape(&dims(rows, r)).assign(&m.matmul(&q));
                at += rows * r;
            }
            comm.all_reduce_sum(&pbuf);
            let qbuf = tensor::zeros(&[q_total], Dtype::F32, bucket);
            let mut ps = Vec::with_capacity(matrices.len());
            let (mut at_p, mut at_q) = (0, 0);
            for (m, &(_, _, rows, cols, r)) in ms.iter().zip(&matrices) {
                let p = pbuf.narrow(0, at_p, rows * r).reshape(&dims(rows, r)).orthonormalize();
                qbuf.narrow(0, at_q, cols * r).reshape(&dims(cols, r)).assign(&m.transpose(0, 1).matmul(&p));
                ps.push(p);
                (at_p, at_q) = (at_p + rows * r, at_q + cols * r);
            }
            comm.all_reduce_sum(&qbuf);
            let qbuf = qbuf.mul_scalar(scale);
            let mut at = 0;
            for (p, &(param, offset, rows, cols, r)) in ps.iter().zip(&matrices) {
                let q = qbuf.narrow(0, at, cols * r).reshape(&dims(cols, r));
                flat.narrow(0, offset, rows * cols).reshape(&dims(rows, cols)).assign(&p.matmul(&q.transpose(0, 1)));
                self.state.put(info.index, &format!("q{param}"), q);
                at += cols * r;
            }
        }
        // 5. What this rank's input lost, for the next step.
        self.state.put(info.index, "residual", acc.sub(&flat.cast(Dtype::F32)));
        Ok(())
    }
}

harness_sdk::export!(PowerSgd as compressor);
