//! `{{name}}`: top-k sparsification with error feedback, 5% of each bucket,
//! written from `harness plugin new compressor` (Rust) by
//! bench/rank_flows.sh. app.py beside it is the same algorithm in Python,
//! op for op: the two builds must train bit for bit alike.

use std::collections::BTreeMap;

use harness_sdk::{tensor, BucketInfo, Collective, Compressor, Config, Dtype, Error, Plugin, Tensor};

pub struct TopK {
    residuals: BTreeMap<u32, Tensor>,
    saved: BTreeMap<u32, Vec<f32>>,
}

impl Plugin for TopK {
    const NAME: &'static str = "{{name}}";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&[])?;
        Ok(TopK { residuals: BTreeMap::new(), saved: BTreeMap::new() })
    }

    /// Per bucket, in index order: u32 index, u64 n, n x f32 (little-endian).
    fn state_save(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, t) in &self.residuals {
            let data = t.read_f32();
            out.extend_from_slice(&i.to_le_bytes());
            out.extend_from_slice(&(data.len() as u64).to_le_bytes());
            data.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        }
        out
    }

    fn state_load(&mut self, mut b: &[u8]) -> Result<(), Error> {
        self.residuals.clear();
        self.saved.clear();
        while !b.is_empty() {
            let bad = || Error::from("{{name}}: a truncated state".to_string());
            let (i, rest) = b.split_at_checked(4).ok_or_else(bad)?;
            let (n, rest) = rest.split_at_checked(8).ok_or_else(bad)?;
            let n = u64::from_le_bytes(n.try_into().unwrap()) as usize;
            let (data, rest) = rest.split_at_checked(n.checked_mul(4).ok_or_else(bad)?).ok_or_else(bad)?;
            let data = data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            self.saved.insert(u32::from_le_bytes(i.try_into().unwrap()), data);
            b = rest;
        }
        Ok(())
    }
}

impl Compressor for TopK {
    fn compress(&mut self, bucket: &Tensor, comm: &Collective, info: BucketInfo) -> Result<(), Error> {
        let n = bucket.numel();
        let world = f64::from(comm.world_size());
        let flat = bucket.reshape(&[-1]);
        let residual = match self.saved.remove(&info.index) {
            Some(data) => Some(tensor::from_f32(&data, &[data.len() as u64], bucket)),
            None => self.residuals.remove(&info.index),
        };
        let acc = match residual {
            Some(r) if r.numel() == n => flat.add(&r),
            Some(r) => return Err(format!("bucket {} has {n} elements, its residual {}", info.index, r.numel()).into()),
            None => flat.duplicate(),
        };
        let k = (n + 19) / 20;
        let (_, idx) = acc.abs().topk(k);
        let vals = acc.gather(&idx);
        let all_vals = comm.all_gather(&vals);
        let all_idx = comm.all_gather(&idx.cast(Dtype::I32)).cast(Dtype::I64);
        let zeros = tensor::zeros(&[n], acc.dtype(), bucket);
        let sum = zeros.scatter_add(&all_idx, &all_vals);
        let mine = zeros.scatter_add(&idx, &vals);
        self.residuals.insert(info.index, acc.sub(&mine));
        let shape: Vec<i64> = bucket.shape().iter().map(|&d| d as i64).collect();
        bucket.assign(&sum.mul_scalar(1.0 / world).reshape(&shape));
        Ok(())
    }
}

harness_sdk::export!(TopK as compressor);
