//! `onebit`: sign compression with one scale per rank and error feedback,
//! the compression inside 1-bit Adam (Tang et al. 2021) and error-feedback
//! signSGD (Karimireddy et al. 2019).
//!
//! Per bucket: `acc = bucket + residual`, `scale = mean |acc|`; every rank's
//! signs (`pack_signs`, 8 per byte; zero counts as +) and scale are
//! all-gathered; the output is the average over ranks of `signs_r *
//! scale_r` (one matmul of the scales, 1 x w, with the unpacked signs, w x
//! n); `residual = acc - signs * scale` (this rank's own dequantized part).
//!
//! No configuration (any key is rejected).
//!
//! Bytes on the wire: all-gathers of `ceil(n / 8)` bytes of signs and one
//! f32 scale per rank: a ring sends `(w - 1) * (ceil(n / 8) + 4)` bytes per
//! rank, against `2 (w - 1) / w * 4n` for an fp32 all-reduce (1/32 of it on
//! two ranks, 3/64 on three).
//!
//! State: the residual of every bucket.

#[path = "../../shared/state.rs"]
mod state;

use harness_sdk::{tensor, BucketInfo, Collective, Compressor, Config, Error, Plugin, Tensor};
use state::BucketState;

/// The plugin: one instance per rank.
pub struct OneBit {
    state: BucketState,
}

impl Plugin for OneBit {
    const NAME: &'static str = "onebit";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&[])?;
        Ok(OneBit { state: BucketState::default() })
    }

    fn state_save(&self) -> Vec<u8> {
        self.state.save(Self::NAME)
    }

    fn state_load(&mut self, bytes: &[u8]) -> Result<(), Error> {
        self.state = BucketState::load(Self::NAME, bytes)?;
        Ok(())
    }
}

impl Compressor for OneBit {
    fn compress(&mut self, bucket: &Tensor, comm: &Collective, info: BucketInfo) -> Result<(), Error> {
        let n = bucket.numel();
        let world = u64::from(comm.world_size());
        let flat = bucket.reshape(&[-1]);
        let acc = match self.state.take(info.index, "residual", bucket) {
            Some(r) if r.numel() == n => flat.add(&r),
            Some(r) => return Err(format!("bucket {} has {n} elements, its saved residual {}", info.index, r.numel()).into()),
            None => flat.duplicate(),
        };
        let scale = acc.mean_abs();
        let signs = acc.pack_signs();
        let bytes = signs.numel();
        let all_signs = comm.all_gather(&signs);
        let all_scales = comm.all_gather(&tensor::from_f32(&[scale as f32], &[1], bucket));
        // Rank r's signs are row r (8 * bytes columns, the first n real).
        let unpacked = tensor::unpack_signs(&all_signs, world * bytes * 8).reshape(&[world as i64, (bytes * 8) as i64]);
        let sum = all_scales.reshape(&[1, world as i64]).matmul(&unpacked).reshape(&[-1]).narrow(0, 0, n);
        let mine = tensor::unpack_signs(&signs, n).mul_scalar(f64::from(scale as f32));
        self.state.put(info.index, "residual", acc.sub(&mine));
        let shape: Vec<i64> = bucket.shape().iter().map(|&d| d as i64).collect();
        bucket.assign(&sum.mul_scalar(1.0 / world as f64).reshape(&shape));
        Ok(())
    }
}

harness_sdk::export!(OneBit as compressor);
