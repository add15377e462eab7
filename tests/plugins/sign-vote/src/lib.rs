//! `sign-vote`: signSGD with majority vote (Bernstein et al., ICLR 2019),
//! with error feedback, written as a plugin author outside harness would:
//! the public SDK only, a version of its own. Each rank sends one bit per
//! gradient element (all-gather of packed signs) and one scale; the update
//! is the sign of the ranks' vote times their mean scale. The submission
//! tests enter it into the CPU standard suite.

use std::collections::HashMap;

use harness_sdk::{tensor, BucketInfo, Collective, Compressor, Config, Error, Plugin, Tensor};

pub struct SignVote {
    /// Per bucket: what the sent signs left out, added back next step.
    residual: HashMap<u32, Tensor>,
    /// Residuals loaded from a checkpoint, made tensors on the bucket's
    /// device at the bucket's next call.
    loaded: HashMap<u32, Vec<f32>>,
    error_feedback: bool,
}

impl Plugin for SignVote {
    const NAME: &'static str = "sign-vote";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["error_feedback"])?;
        Ok(SignVote { residual: HashMap::new(), loaded: HashMap::new(), error_feedback: config.get_or("error_feedback", true)? })
    }

    /// The residuals, so that a run resumed from a checkpoint adds back
    /// what the uninterrupted run would: per bucket, its index and element
    /// count (little-endian u32, u64) and its f32 values.
    fn state_save(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut all: Vec<(u32, Vec<f32>)> = self.residual.iter().map(|(&i, r)| (i, r.read_f32())).collect();
        all.extend(self.loaded.iter().map(|(&i, v)| (i, v.clone())));
        all.sort_by_key(|(i, _)| *i);
        for (i, values) in all {
            out.extend(i.to_le_bytes());
            out.extend((values.len() as u64).to_le_bytes());
            values.iter().for_each(|v| out.extend(v.to_le_bytes()));
        }
        out
    }

    fn state_load(&mut self, mut state: &[u8]) -> Result<(), Error> {
        self.residual.clear();
        self.loaded.clear();
        while !state.is_empty() {
            let (head, rest) = state.split_at_checked(12).ok_or("sign-vote: a truncated residual in the saved state")?;
            let index = u32::from_le_bytes(head[..4].try_into().unwrap());
            let n = usize::try_from(u64::from_le_bytes(head[4..].try_into().unwrap())).map_err(|_| "sign-vote: a residual too large")?;
            let bytes = n.checked_mul(4).filter(|&b| b <= rest.len()).ok_or("sign-vote: a truncated residual in the saved state")?;
            let values = rest[..bytes].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            self.loaded.insert(index, values);
            state = &rest[bytes..];
        }
        Ok(())
    }
}

impl Compressor for SignVote {
    fn compress(&mut self, bucket: &Tensor, comm: &Collective, info: BucketInfo) -> Result<(), Error> {
        let n = bucket.numel();
        let world = u64::from(comm.world_size());
        let flat = bucket.reshape(&[-1]);
        if let Some(values) = self.loaded.remove(&info.index) {
            self.residual.insert(info.index, tensor::from_f32(&values, &[values.len() as u64], bucket));
        }
        let acc = match self.residual.remove(&info.index) {
            Some(r) if r.numel() == n => flat.add(&r),
            _ => flat.duplicate(),
        };
        let scale = acc.mean_abs();
        let signs = acc.pack_signs();
        let bits = signs.numel() * 8;
        let votes = tensor::unpack_signs(&comm.all_gather(&signs), world * bits).reshape(&[world as i64, bits as i64]);
        let ones = tensor::from_f32(&vec![1.0; world as usize], &[1, world], bucket);
        let majority = ones.matmul(&votes).reshape(&[-1]).narrow(0, 0, n).sign();
        let scales = tensor::from_f32(&[scale as f32], &[1], bucket);
        comm.all_reduce_sum(&scales);
        let mean_scale = f64::from(scales.read_f32()[0]) / world as f64;
        if self.error_feedback {
            self.residual.insert(info.index, acc.sub(&tensor::unpack_signs(&signs, n).mul_scalar(scale)));
        }
        let shape: Vec<i64> = bucket.shape().iter().map(|&d| d as i64).collect();
        bucket.assign(&majority.mul_scalar(mean_scale).reshape(&shape));
        Ok(())
    }
}

harness_sdk::export!(SignVote as compressor);
