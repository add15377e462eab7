//! The kernels over a model's weights, a list of tensors per launch: the
//! AdamW update and the weights' cast to bf16.

use tch::{Kind, Tensor};

use super::launch::{launch, loaded, params, AdamList, CastList, Grid, Loaded, ADAM_CHUNK, ADAM_MAX, CAST_CHUNK};

/// A list kernel's `first_block` for tensors of `ns` elements (at most
/// [`ADAM_MAX`]), `chunk` elements per block: each tensor's first block,
/// closed by the total, which comes back too.
pub(super) fn first_blocks(ns: &[i64], chunk: i64) -> anyhow::Result<([i32; ADAM_MAX + 1], i64)> {
    anyhow::ensure!(ns.len() <= ADAM_MAX, "{} tensors for one launch of at most {ADAM_MAX}", ns.len());
    let mut first = [0i32; ADAM_MAX + 1];
    let mut blocks = 0i64;
    for (j, &n) in ns.iter().enumerate() {
        first[j] = i32::try_from(blocks)?;
        blocks += (n + chunk - 1) / chunk;
    }
    first[ns.len()] = i32::try_from(blocks)?;
    Ok((first, blocks))
}

/// Whether [`adamw`] takes these tensors: fp32 CUDA, contiguous, one
/// parameter's state and gradient of its shape, fp32 step counts.
fn adamw_fits(params: &[Tensor], grads: &[Tensor], exp_avg: &[Tensor], exp_avg_sq: &[Tensor], steps: &[Tensor]) -> bool {
    let fp32 = |t: &Tensor| t.kind() == Kind::Float && t.device().is_cuda() && t.is_contiguous();
    [grads.len(), exp_avg.len(), exp_avg_sq.len(), steps.len()].iter().all(|&n| n == params.len())
        && (0..params.len()).all(|i| {
            let shape = params[i].size();
            [&params[i], &grads[i], &exp_avg[i], &exp_avg_sq[i]].iter().all(|t| fp32(t) && t.size() == shape)
                && fp32(&steps[i])
                && steps[i].numel() == 1
        })
}

/// One AdamW update of `params` (libtorch's `_fused_adamw_`: the same
/// maths, one kernel per 48 tensors, the step counts in `steps` advanced
/// after it), without writing the gradients: libtorch's kernel writes each
/// gradient back (divided by `grad_scale` when given), 4 of its 32 bytes of
/// traffic per parameter. `lr_t`: the learning rate as a device scalar (read
/// when the kernel runs), else `lr`. An update with `found_inf` = 1 is
/// skipped. Returns false, having done nothing, where the kernel does not
/// take the tensors (not fp32 CUDA, not contiguous, a state or gradient of
/// another shape, no NVRTC): the caller updates them otherwise.
#[allow(clippy::too_many_arguments)]
pub fn adamw(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avg: &[Tensor],
    exp_avg_sq: &[Tensor],
    steps: &[Tensor],
    (lr, lr_t): (f64, Option<&Tensor>),
    (beta1, beta2, weight_decay, eps): (f64, f64, f64, f64),
    found_inf: Option<&Tensor>,
    grad_scale: Option<&Tensor>,
) -> anyhow::Result<bool> {
    let Ok(k) = loaded() else { return Ok(false) };
    if !adamw_fits(params, grads, exp_avg, exp_avg_sq, steps) {
        return Ok(false);
    }
    for t in [lr_t, found_inf, grad_scale].into_iter().flatten() {
        anyhow::ensure!(
            t.kind() == Kind::Float && t.numel() == 1 && t.device().is_cuda(),
            "AdamW kernel: scalars must be one fp32 on the device"
        );
    }
    for start in (0..params.len()).step_by(ADAM_MAX) {
        let end = (start + ADAM_MAX).min(params.len());
        let null = std::ptr::null_mut();
        let ns: Vec<i64> = params[start..end].iter().map(|p| p.numel() as i64).collect();
        let (first_block, blocks) = first_blocks(&ns, ADAM_CHUNK)?;
        let mut list = AdamList {
            p: [null; ADAM_MAX],
            g: [null; ADAM_MAX],
            m: [null; ADAM_MAX],
            v: [null; ADAM_MAX],
            step: [null; ADAM_MAX],
            n: [0; ADAM_MAX],
            first_block,
            count: (end - start) as i32,
        };
        for (j, i) in (start..end).enumerate() {
            list.p[j] = params[i].data_ptr();
            list.g[j] = grads[i].data_ptr();
            list.m[j] = exp_avg[i].data_ptr();
            list.v[j] = exp_avg_sq[i].data_ptr();
            list.step[j] = steps[i].data_ptr();
            list.n[j] = ns[j];
        }
        if blocks > 0 {
            let grid = Grid::line(u32::try_from(blocks)?, 512);
            // SAFETY: the arguments follow adamw's signature: the list (laid
            // out as AdamList, pointers to the checked fp32 CUDA tensors,
            // alive until the call returns and, through libtorch's caching
            // allocator, until the stream's later work), then a device
            // scalar or null, five doubles, two device scalars or null.
            unsafe { launch(k.adamw, grid, params![&mut list, lr_t, lr, beta1, beta2, weight_decay, eps, grad_scale, found_inf])? };
        }
        // SAFETY: as above; one thread per tensor of the list.
        unsafe { launch(k.adamw_steps, Grid::line(1, ADAM_MAX as u32), params![&mut list, found_inf])? };
    }
    Ok(true)
}

/// Whether [`cast_bf16`] takes these tensors:
/// contiguous CUDA data whose first element is 16-byte aligned (a
/// parameter or gradient inside a ZeRO flat buffer may start anywhere).
fn vector_fits(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| t.device().is_cuda() && t.is_contiguous() && (t.data_ptr() as usize) % 16 == 0)
}

/// Blocks of 256 threads for `n` elements, 8 per thread, at most 8 per SM.
fn vector_blocks(k: &Loaded, n: i64) -> u32 {
    let want = (n.max(1) as u64).div_ceil(8 * 256);
    want.min(u64::from(k.sms) * 8).max(1) as u32
}

/// `w` (fp32) as bf16, rounded to nearest even as libtorch's cast: one
/// vectorised pass (libtorch's fp32 -> bf16 copy is not vectorised: 1.8
/// TB/s on an H200 for the 1.3B preset's weights). Falls back to libtorch
/// for tensors the kernel does not take.
pub fn cast_bf16(w: &Tensor) -> anyhow::Result<Tensor> {
    let k = match loaded() {
        Ok(k) if w.kind() == Kind::Float && vector_fits(&[w]) => k,
        _ => return Ok(w.to_kind(Kind::BFloat16)),
    };
    let out = Tensor::empty(w.size(), (Kind::BFloat16, w.device()));
    let n = w.numel() as i64;
    // SAFETY: the arguments follow cast_bf16's signature: two device
    // pointers to n contiguous elements each (w fp32, 16-byte aligned, and a
    // fresh bf16 tensor from the allocator), then n; both outlive the call.
    unsafe { launch(k.cast_bf16, Grid::line(vector_blocks(k, n), 256), params![w, &out, n])? };
    Ok(out)
}

/// Each of `ws` (fp32) as bf16, as [`cast_bf16`] casts one: those the
/// vectorised kernel takes (contiguous, 16-byte aligned CUDA) in one launch
/// per 48, the others one by one.
pub fn cast_bf16_list(ws: &[Tensor]) -> anyhow::Result<Vec<Tensor>> {
    let Ok(k) = loaded() else { return ws.iter().map(cast_bf16).collect() };
    // An output for each weight the kernel takes (the others are cast one
    // by one at the end).
    let outs: Vec<Option<Tensor>> = ws
        .iter()
        .map(|w| (w.kind() == Kind::Float && vector_fits(&[w])).then(|| Tensor::empty(w.size(), (Kind::BFloat16, w.device()))))
        .collect();
    let listed: Vec<usize> = (0..ws.len()).filter(|&i| outs[i].is_some()).collect();
    for group in listed.chunks(ADAM_MAX) {
        let ns: Vec<i64> = group.iter().map(|&i| ws[i].numel() as i64).collect();
        let (first_block, blocks) = first_blocks(&ns, CAST_CHUNK)?;
        let null = std::ptr::null_mut();
        let mut list = CastList { w: [null; ADAM_MAX], out: [null; ADAM_MAX], n: [0; ADAM_MAX], first_block, count: group.len() as i32 };
        for (j, &i) in group.iter().enumerate() {
            list.w[j] = ws[i].data_ptr();
            list.out[j] = outs[i].as_ref().map_or(null, |o| o.data_ptr());
            list.n[j] = ns[j];
        }
        if blocks > 0 {
            let grid = Grid::line(u32::try_from(blocks)?, 256);
            // SAFETY: the argument follows cast_list's signature (the list
            // laid out as CastList: 16-byte aligned contiguous fp32 CUDA
            // weights and fresh bf16 tensors of their sizes, alive until
            // the stream's later work through libtorch's caching allocator).
            unsafe { launch(k.cast_list, grid, params![&mut list])? };
        }
    }
    ws.iter().zip(outs).map(|(w, o)| o.map_or_else(|| cast_bf16(w), Ok)).collect()
}
