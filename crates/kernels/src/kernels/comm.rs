//! The kernels of the collectives and the checks around them: a
//! reduce-scatter's sum made the average, the clock of link emulation, and
//! the replica check's hashes.

use std::ffi::c_void;

use tch::{Kind, Tensor};

use super::launch::{comm_loaded, launch, launch_on, params, require, Grid};

/// `x` (dense fp32 on CUDA) multiplied by `scale` in place, on `stream`
/// (a live `CUstream` that orders the kernel after whatever writes `x`;
/// the caller keeps `x`'s memory until it has run): a reduce-scatter's sum
/// made the average.
pub fn scale_on(stream: *mut c_void, x: &Tensor, scale: f32) -> anyhow::Result<()> {
    let k = comm_loaded().map_err(|e| anyhow::anyhow!("the collectives' kernels are unavailable: {e}"))?;
    anyhow::ensure!(x.kind() == Kind::Float && x.is_contiguous(), "scale takes a dense fp32 tensor");
    let n = x.numel() as i64;
    if n == 0 {
        return Ok(());
    }
    let blocks = u32::try_from(((n + 4095) / 4096).clamp(1, i64::from(k.sms)))?;
    // SAFETY: the parameters match scale_f32's signature (n floats of x,
    // read and written in place); the caller's stream orders the kernel
    // and keeps the memory (see above).
    unsafe { launch_on(stream as _, k.scale_f32, Grid::line(blocks, 512), params![x, n, scale]) }?;
    Ok(())
}

/// Records the GPU clock into `at` (one int64 on the device), in stream order.
pub fn stamp(at: &Tensor) -> anyhow::Result<()> {
    let k = require("device")?;
    // SAFETY: `at` is a live device tensor of at least 8 bytes; one thread
    // writes one u64; libtorch's current stream orders it.
    unsafe { launch(k.stamp, Grid::line(1, 1), params![at]) }?;
    Ok(())
}

/// Holds the stream until `ns` nanoseconds after the clock stored in `at`.
pub fn spin_until(at: &Tensor, ns: u64) -> anyhow::Result<()> {
    let k = require("device")?;
    // SAFETY: as in `stamp`; the kernel only reads the stamp.
    unsafe { launch(k.spin_until, Grid::line(1, 1), params![at, ns]) }?;
    Ok(())
}

/// The replica check's hash of each tensor's bytes (`torch_ext::param_hashes`'s
/// number, bit for bit), one kernel per tensor: an int64 tensor of one hash
/// per tensor, on their device (all on one CUDA device, contiguous or made
/// so). Nothing is synchronised.
pub fn word_hashes(tensors: &[Tensor]) -> anyhow::Result<Tensor> {
    let k = require("device")?;
    let device = tensors.first().map_or(tch::Device::Cpu, Tensor::device);
    anyhow::ensure!(device.is_cuda() && tensors.iter().all(|t| t.device() == device), "word hashes take tensors of one CUDA device");
    let out = Tensor::zeros([tensors.len() as i64], (Kind::Int64, device));
    for (i, t) in tensors.iter().enumerate() {
        let words = t.detach().contiguous();
        let n = words.numel() as i64;
        if n == 0 {
            continue;
        }
        let width = i32::try_from(words.kind().elt_size_in_bytes())?;
        let slot = out.narrow(0, i as i64, 1);
        let blocks = u32::try_from(((n + 1023) / 1024).min(i64::from(k.sms) * 8))?;
        // SAFETY: the parameters match word_hash's signature (a device
        // pointer to `n` words of `width` bytes, the count, the width, a
        // device pointer to one u64 that the blocks add to); the tensors stay
        // alive until the launch is queued, and libtorch's stream orders the
        // kernel after their producers and before any reader of `out`.
        unsafe { launch(k.word_hash, Grid::line(blocks, 256), params![&words, n, width, &slot]) }?;
    }
    Ok(out)
}
