//! What every data source shares: the seeded generator of each sample, and
//! the copy of a batch to the device.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tch::{Device, Tensor};

/// The generator of sample `i` of the stream seeded `seed`.
pub(crate) fn sample_rng(seed: u64, i: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(i);
    rng
}

/// Host-to-device copy through pinned memory, asynchronous on CUDA so the
/// host can prepare the next batch while the device trains.
pub(crate) fn upload(t: Tensor, device: Device) -> Tensor {
    match device {
        Device::Cpu => t,
        d => match harness_kernels::torch_ext::pin_memory(&t) {
            Ok(p) => p.to_device_(d, t.kind(), true, false),
            // Pinned memory can run out; a synchronous copy still works.
            Err(_) => t.to_device(d),
        },
    }
}
