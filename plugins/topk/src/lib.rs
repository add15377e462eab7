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
//! Layer-wise (`per_layer = true`, from the bucket's layout of contract
//! 0.2's `setup`): each tensor of the bucket sends its own `k_t =
//! ceil(ratio * n_t)` largest entries, so a layer of small gradients keeps
//! its share instead of losing it to the layers of large ones (the
//! layer-wise selection of Shi et al. 2019, "Understanding top-k
//! sparsification in distributed deep learning", and of DGC's per-layer
//! thresholds). The picks are made in a dense copy (each tensor's top-k
//! scattered into its place), from which one top-k of `sum k_t` gives the
//! bucket's indices; the rest is as above.
//!
//! ```toml
//! compressor_config = { ratio = 0.05, per_layer = false }
//! # ratio: fraction of entries sent, (0, 1]; default 0.05
//! # per_layer: k per tensor of the bucket instead of per bucket; default false
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

use harness_sdk::{tensor, BucketInfo, BucketLayout, Collective, Compressor, Config, Dtype, Error, Plugin, Tensor};
use state::BucketState;

/// The plugin: one instance per rank.
pub struct TopK {
    ratio: f64,
    per_layer: bool,
    layouts: Vec<BucketLayout>,
    state: BucketState,
}

impl Plugin for TopK {
    const NAME: &'static str = "topk";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["ratio", "per_layer"])?;
        Ok(TopK {
            ratio: state::ratio(config, 0.05)?,
            per_layer: config.get_or("per_layer", false)?,
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

impl Compressor for TopK {
    fn setup(&mut self, buckets: &[BucketLayout]) -> Result<(), Error> {
        self.layouts = buckets.to_vec();
        Ok(())
    }

    fn compress(&mut self, bucket: &Tensor, comm: &Collective, info: BucketInfo) -> Result<(), Error> {
        let n = bucket.numel();
        let world = f64::from(comm.world_size());
        let flat = bucket.reshape(&[-1]);
        let acc = match self.state.take(info.index, "residual", bucket) {
            Some(r) if r.numel() == n => flat.add(&r),
            Some(r) => return Err(format!("bucket {} has {n} elements, its saved residual {}", info.index, r.numel()).into()),
            None => flat.duplicate(),
        };
        // The indices to send, and (layer-wise) the dense copy of the picks
        // their values come from.
        let (idx, picked) = if self.per_layer {
            let layout = self.layouts.get(info.index as usize).ok_or_else(|| {
                Error::new(format!("bucket {} has no layout ({} were set up): the host did not call setup", info.index, self.layouts.len()))
            })?;
            if layout.numel != n {
                return Err(format!("bucket {} has {n} elements, its layout {}", info.index, layout.numel).into());
            }
            // Each tensor's picks, in their places in a dense copy.
            let picked = tensor::zeros(&[n], acc.dtype(), bucket);
            let mut k = 0;
            for p in layout.params.iter().filter(|p| p.numel > 0) {
                let part = acc.narrow(0, p.offset, p.numel);
                let (_, i) = part.abs().topk(state::count(self.ratio, p.numel));
                let place = picked.narrow(0, p.offset, p.numel);
                place.assign(&place.scatter_add(&i, &part.gather(&i)));
                k += i.numel();
            }
            // (A tensor with fewer non-zeros than its k sends zeros for the
            // rest, wherever the top-k of the copy finds them.)
            (picked.abs().topk(k.max(1)).1, Some(picked))
        } else {
            (acc.abs().topk(state::count(self.ratio, n)).1, None)
        };
        let vals = picked.as_ref().unwrap_or(&acc).gather(&idx);
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
