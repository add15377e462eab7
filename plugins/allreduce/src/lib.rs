//! The reference compressor: all-reduce-sum the bucket in place, then divide
//! by the world size. No compression, no logging: it measures what the
//! plugin boundary costs against the host's built-in all-reduce.

use harness_sdk::{BucketInfo, Collective, Compressor, Config, Error, Plugin, Tensor};

/// Plain all-reduce average.
pub struct AllReduce;

impl Plugin for AllReduce {
    const NAME: &'static str = "allreduce";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&[])?;
        Ok(AllReduce)
    }
}

impl Compressor for AllReduce {
    fn compress(&mut self, bucket: &Tensor, comm: &Collective, _info: BucketInfo) -> Result<(), Error> {
        comm.all_reduce_sum(bucket);
        let world = comm.world_size();
        if world > 1 {
            bucket.assign(&bucket.mul_scalar(1.0 / f64::from(world)));
        }
        Ok(())
    }
}

harness_sdk::export!(AllReduce as compressor);
