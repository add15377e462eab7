//! `fp16`: divides the bucket by the world size, casts it to float16 (5 exponent bits, 10 mantissa bits),
//! all-reduces the cast tensor (a sum of averages) and assigns the average
//! back, cast to the bucket's dtype. Dividing first, in the bucket's
//! precision, as PyTorch's `fp16_compress_hook` does, keeps the sum from
//! overflowing where the average would not.
//!
//! Bytes on the wire: half of an fp32 all-reduce. No state; no configuration
//! (any key is rejected).

use harness_sdk::{BucketInfo, Collective, Compressor, Config, Dtype, Error, Plugin, Tensor};

/// The plugin: stateless.
pub struct Fp16;

impl Plugin for Fp16 {
    const NAME: &'static str = "fp16";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&[])?;
        Ok(Fp16)
    }
}

impl Compressor for Fp16 {
    fn compress(&mut self, bucket: &Tensor, comm: &Collective, _info: BucketInfo) -> Result<(), Error> {
        let world = f64::from(comm.world_size());
        // Divided before the cast and the reduction: a sum of averages.
        let half = bucket.mul_scalar(1.0 / world).cast(Dtype::F16);
        comm.all_reduce_sum(&half);
        bucket.assign(&half);
        Ok(())
    }
}

harness_sdk::export!(Fp16 as compressor);
