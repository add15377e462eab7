//! Device kernels of harness's own, compiled at run time with NVRTC (the
//! `libnvrtc` of the PyTorch installation) and launched on libtorch's stream.
//!
//! The kernels of `kernels = "fused"` (the layers in `train::models::fused` and the
//! loss): residual add + LayerNorm and bias + GELU with their backward
//! passes, the weights' cast to bf16, the AdamW update, a
//! bias's gradient (column sums), the reduction of the backward kernels'
//! partial sums into the parameters' gradients, and the fused cross-entropy.
//! The last, for bf16 logits: autocast's cross-entropy writes an fp32 copy
//! of the logits, its log-softmax, and in the backward pass three more
//! full-size tensors: about 30 GB of memory traffic per step for GPT-2 124M
//! at 16 x 1024 tokens (vocabulary 50304). The fused kernel reads each row
//! of logits once (keeping it in shared memory) and writes the gradient once
//! (about 3.3 GB), computing the loss and its gradient in the same pass; the
//! gradient is then fed into autograd at the logits.
//!
//! The CUDA source is `cuda/` of this crate, one file per op or family of
//! ops, compiled as one program (`launch.rs`, which also loads it and
//! launches). Each function here checks its tensors, makes its outputs and
//! launches its kernel with the kernel's parameters in order (`params!`).

mod launch;

use std::ffi::c_void;

use tch::{Kind, Tensor};

use launch::{
    comm_loaded, launch, launch_on, ln_bwd_warp_smem, loaded, params, require, AdamList, CastList, Grid, Loaded, ADAM_CHUNK, ADAM_MAX,
    CAST_CHUNK, LN_BWD_THREADS,
};

/// Why the fused kernels cannot be used, if they cannot.
pub fn unavailable_reason() -> Option<String> {
    loaded().err()
}

/// Whether the fused kernels can be used (CUDA present and NVRTC works).
pub fn available() -> bool {
    loaded().is_ok()
}

/// Rows and channels as the kernels' `int` N and C.
fn dims(n: i64, c: i64) -> anyhow::Result<(i32, i32)> {
    Ok((i32::try_from(n)?, i32::try_from(c)?))
}

/// Fused cross-entropy of bf16 CUDA logits `[n, V]` against int64 targets
/// `[n]`. Returns the mean loss (fp32 scalar) and d(mean loss)/d(logits) as
/// bf16, multiplied by `factor` and, if given, by the device scalar `scale`
/// (fp16-style loss scaling). Nothing is synchronised. `in_place`: the
/// gradient overwrites the logits (which the caller must not read again),
/// where a new tensor would raise the backward pass's peak by their size
/// (1.6 GB for GPT-2 124M at 16 x 1024 tokens).
pub fn cross_entropy_bf16(
    logits: &Tensor,
    target: &Tensor,
    factor: f32,
    scale: Option<&Tensor>,
    in_place: bool,
) -> anyhow::Result<(Tensor, Tensor)> {
    let k = require("fused")?;
    let (n, v) = logits.size2()?;
    anyhow::ensure!(logits.kind() == Kind::BFloat16 && logits.device().is_cuda(), "fused cross-entropy takes bf16 CUDA logits");
    let logits = logits.contiguous();
    let target = target.to_kind(Kind::Int64).contiguous();
    anyhow::ensure!(target.size() == [n], "targets must be [{n}]");
    let grad = if in_place { logits.shallow_clone() } else { logits.empty_like() };
    let rows = Tensor::empty([n], (Kind::Float, logits.device()));
    let scale = scale.map(|s| s.to_kind(Kind::Float).contiguous());
    // The kernel writes (softmax - onehot) * factor: the gradient of the
    // rows' sum. The loss is their mean, so its gradient carries 1/n.
    let factor = factor / n as f32;
    // The row in shared memory where it fits (else read from memory again).
    let row_bytes = 2 * v;
    let cached = v % 8 == 0 && row_bytes <= k.ce_smem as i64;
    let grid = Grid::line(u32::try_from(n)?, 512).smem(if cached { row_bytes as u32 } else { 0 });
    let v32 = i32::try_from(v)?;
    // SAFETY: the parameters match ce_bf16's signature (four device
    // pointers to tensors of the checked shapes and kinds, an int, a device
    // pointer or null, a float, an int); the dynamic shared memory is within
    // what the function was allowed at load and holds the row when
    // `cached`. All tensors stay alive until the function
    // returns and libtorch's caching allocator keeps their memory from reuse
    // until work queued after the launch on the same (libtorch's current)
    // stream has run. The launch goes to that same stream.
    unsafe { launch(k.ce_bf16, grid, params![&logits, &target, &grad, &rows, v32, scale.as_ref(), factor, i32::from(cached)]) }?;
    Ok((rows.mean(Kind::Float), grad))
}

/// Whether [`add_layer_norm`] takes rows of `c` channels.
pub fn layer_norm_fits(c: i64) -> bool {
    c % 4 == 0 && (4..=4096).contains(&c)
}

/// Whether [`add_layer_norm`] takes a warp per row of up to 1024 channels.
fn ln_warp() -> bool {
    crate::options().ln_warp
}

/// Whether [`add_layer_norm_backward`] takes a warp per row of 128, 256,
/// .. 1024 channels (`HARNESS_LN_BWD_WARP=0` keeps a block per row).
fn ln_bwd_warp() -> bool {
    crate::options().ln_bwd_warp
}

/// The normalisation of [`add_layer_norm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    /// LayerNorm: `(x - mean) / std * w + b`.
    Layer,
    /// RMS normalisation (T5's layer norm): `x / rms(x) * w`, no mean
    /// subtracted and no bias.
    Rms,
}

/// Which of the LayerNorm kernels serve `norm` with an output (and
/// gradient) of `kind`: LayerNorm in bf16 (0) or fp32 (1), RMS
/// normalisation in bf16 (2).
fn ln_index(norm: Norm, kind: Kind) -> anyhow::Result<usize> {
    match (norm, kind) {
        (Norm::Layer, Kind::BFloat16) => Ok(0),
        (Norm::Layer, Kind::Float) => Ok(1),
        (Norm::Rms, Kind::BFloat16) => Ok(2),
        (Norm::Layer, k) => anyhow::bail!("fused LayerNorm writes bf16 or fp32 rows, not {k:?}"),
        (Norm::Rms, k) => anyhow::bail!("fused RMS normalisation writes bf16 rows, not {k:?}"),
    }
}

/// A block per row for rows of `c` channels (four per thread), as many
/// blocks as the SMs hold at once.
fn ln_grid(k: &Loaded, n: i64, c: i64) -> Grid {
    let threads = quad_threads(c);
    let per_sm = (2048 / threads).clamp(1, 16);
    Grid::line((k.sms * per_sm).min(n.max(1) as u32), threads)
}

/// The forward pass of a residual add and LayerNorm over the last dimension
/// (eps `eps`) of fp32 CUDA rows `x` `[n, c]` ([`layer_norm_fits`]), with
/// `f` (bf16, same shape) and its bias `fb` (fp32 `[c]`) added first when
/// given: returns `x + f + fb` (fp32; only with `f`), the normalised rows in
/// `y_kind` (bf16 for a matmul, or fp32 for a post-norm residual stream),
/// and each row's mean and 1/std (fp32 `[n]`) for
/// [`add_layer_norm_backward`]. With [`Norm::Rms`], RMS normalisation
/// (bf16 rows only; no bias `b`; the kept mean is 0).
#[allow(clippy::too_many_arguments)]
pub fn add_layer_norm(
    norm: Norm,
    x: &Tensor,
    f: Option<&Tensor>,
    fb: Option<&Tensor>,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f32,
    y_kind: Kind,
) -> anyhow::Result<(Option<Tensor>, Tensor, Tensor, Tensor)> {
    let k = require("fused")?;
    let (n, c) = x.size2()?;
    anyhow::ensure!(
        layer_norm_fits(c) && x.kind() == Kind::Float && x.device().is_cuda() && x.is_contiguous(),
        "fused LayerNorm takes contiguous fp32 CUDA rows"
    );
    anyhow::ensure!(
        f.is_none_or(|f| f.kind() == Kind::BFloat16 && f.size() == [n, c] && f.is_contiguous()),
        "the residual branch must be contiguous bf16 [{n}, {c}]"
    );
    anyhow::ensure!(
        w.kind() == Kind::Float && w.size() == [c] && b.is_none_or(|b| b.kind() == Kind::Float && b.size() == [c]),
        "LayerNorm parameters must be fp32 [{c}]"
    );
    anyhow::ensure!(b.is_some() == (norm == Norm::Layer), "LayerNorm takes a bias, RMS normalisation none");
    anyhow::ensure!(
        fb.is_none_or(|fb| f.is_some() && fb.kind() == Kind::Float && fb.size() == [c]),
        "the branch's bias must be fp32 [{c}], with a branch"
    );
    let out = ln_index(norm, y_kind)?;
    let xo = f.map(|_| x.empty_like());
    let y = Tensor::empty([n, c], (y_kind, x.device()));
    let mean = Tensor::empty([n], (Kind::Float, x.device()));
    let rstd = mean.empty_like();
    // Rows of up to 1024 channels: a warp per row (HARNESS_LN_WARP=0 keeps
    // the block per row, a diagnostic).
    let (kernel, grid) = if c <= 1024 && ln_warp() {
        (k.add_ln_fwd_warp[out], Grid::line((n.max(1) as u64).div_ceil(8).min(u64::from(k.sms) * 8) as u32, 256))
    } else {
        (k.add_ln_fwd[out], ln_grid(k, n, c))
    };
    let (n32, c32) = dims(n, c)?;
    // SAFETY: the arguments follow add_ln_fwd's signature, which
    // add_ln_fwd_warp and the add_rms_fwd kernels share (device pointers to
    // tensors of the checked shapes, kinds and contiguity, or null for the
    // absent residual, and for the bias, which the RMS kernels do not read,
    // then N, C, eps); every tensor outlives the call.
    unsafe {
        launch(kernel, grid, params![x, f, fb, w, b, xo.as_ref(), &y, &mean, &rstd, n32, c32, eps])?;
    }
    Ok((xo, y, mean, rstd))
}

/// The backward pass of [`add_layer_norm`]: from `dy` (the normalised rows'
/// gradient: fp32 for fp32 rows, else taken as bf16), the LayerNorm's input
/// `x`, the kept `mean` and `rstd`,
/// and `dres` (fp32, the gradient reaching `x + f` from elsewhere, if any),
/// returns dx (fp32; also `f`'s gradient when cast to bf16), `f`'s gradient
/// (bf16, with `want_df`), and the partial sums of dw, db and the branch
/// bias's gradient (the sum of dx over rows), each fp32 `[c]` once summed
/// (with [`Norm::Rms`], db's sums are of no use).
#[allow(clippy::too_many_arguments)]
pub fn add_layer_norm_backward(
    norm: Norm,
    dy: &Tensor,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    w: &Tensor,
    dres: Option<&Tensor>,
    want_df: bool,
) -> anyhow::Result<(Tensor, Option<Tensor>, Partials)> {
    let k = require("fused")?;
    let (n, c) = x.size2()?;
    let dy = if dy.kind() == Kind::Float { dy.contiguous() } else { dy.to_kind(Kind::BFloat16).contiguous() };
    let out = ln_index(norm, dy.kind())?;
    let dres = dres.map(|d| d.to_kind(Kind::Float).contiguous());
    anyhow::ensure!(dy.size() == [n, c] && dres.as_ref().is_none_or(|d| d.size() == [n, c]), "gradients must be [{n}, {c}]");
    anyhow::ensure!(
        layer_norm_fits(c) && x.kind() == Kind::Float && x.is_contiguous() && mean.size() == [n] && rstd.size() == [n],
        "fused LayerNorm backward: bad saved tensors"
    );
    let dx = x.empty_like();
    let df = want_df.then(|| Tensor::empty([n, c], (Kind::BFloat16, x.device())));
    // A warp per row for rows of 128, 256, .. 1024 channels (as many
    // blocks as the SMs hold at once), else a block per row.
    let warp = (c % 128 == 0 && c <= 1024 && ln_bwd_warp()).then(|| k.add_ln_bwd_warp[out][(c / 128 - 1) as usize]);
    let (kernel, grid) = match warp {
        Some((kernel, per_sm)) => {
            let blocks = (k.sms * per_sm).min((n.max(1) as u32).div_ceil(LN_BWD_THREADS / 32));
            (kernel, Grid::line(blocks, LN_BWD_THREADS).smem(ln_bwd_warp_smem(c)))
        }
        None => (k.add_ln_bwd[out], ln_grid(k, n, c)),
    };
    let part = Tensor::empty([grid.blocks.0 as i64, 3, c], (Kind::Float, x.device()));
    let (n32, c32) = dims(n, c)?;
    // SAFETY: the arguments follow add_ln_bwd's signature, which the warp
    // kernels share (device pointers to tensors of the checked shapes and
    // kinds, null for the absent dres and df, then N, C); the partial sums
    // have 3 rows per block; a warp kernel's shared memory holds a [3, C]
    // fp32 set per warp.
    unsafe { launch(kernel, grid, params![&dy, x, mean, rstd, w, dres.as_ref(), &dx, df.as_ref(), &part, n32, c32])? };
    Ok((dx, df, Partials(part)))
}

/// Whether [`bias_gelu`] takes rows of `c` channels.
pub fn gelu_fits(c: i64) -> bool {
    c % 8 == 0 && c >= 8
}

/// Grid for kernels with 128 threads of 8 channels per block across and
/// blocks striding over rows down: `per_sm` blocks per SM in all (16 for
/// the bias + GELU kernels, 8 for the column sums).
fn rows_of_8_grid(k: &Loaded, n: i64, c: i64, per_sm: u32) -> Grid {
    let threads = 128u32;
    let across = ((c / 8) as u32).div_ceil(threads);
    let down = ((k.sms * per_sm) / across).max(1).min(n.max(1) as u32);
    Grid::new((down, across, 1), (threads, 1, 1))
}

/// `gelu(x + b)` (tanh approximation) of contiguous bf16 CUDA rows `x`
/// `[n, c]` ([`gelu_fits`]) and an fp32 bias `[c]`, as bf16.
pub fn bias_gelu(x: &Tensor, b: &Tensor) -> anyhow::Result<Tensor> {
    let k = require("fused")?;
    let (n, c) = x.size2()?;
    anyhow::ensure!(
        gelu_fits(c) && x.kind() == Kind::BFloat16 && x.device().is_cuda() && x.is_contiguous(),
        "fused GELU takes contiguous bf16 CUDA rows"
    );
    anyhow::ensure!(b.kind() == Kind::Float && b.size() == [c] && b.is_contiguous(), "the bias must be fp32 [{c}]");
    let y = x.empty_like();
    let (n32, c32) = dims(n, c)?;
    // SAFETY: the arguments follow bias_gelu_fwd's signature (device
    // pointers to tensors of the checked shapes and kinds, then N, C).
    unsafe { launch(k.bias_gelu_fwd, rows_of_8_grid(k, n, c, 16), params![x, b, &y, n32, c32])? };
    Ok(y)
}

/// The backward pass of [`bias_gelu`]: from `dy` and the kept `x` and `b`,
/// returns dx (bf16; also the pre-bias input's gradient) and the partial
/// sums of db (fp32 `[c]` once summed).
pub fn bias_gelu_backward(dy: &Tensor, x: &Tensor, b: &Tensor) -> anyhow::Result<(Tensor, Partials)> {
    let k = require("fused")?;
    let (n, c) = x.size2()?;
    let dy = dy.to_kind(Kind::BFloat16).contiguous();
    anyhow::ensure!(dy.size() == [n, c] && gelu_fits(c) && x.is_contiguous(), "fused GELU backward: bad shapes");
    let dx = x.empty_like();
    let grid = rows_of_8_grid(k, n, c, 16);
    let part = Tensor::empty([grid.blocks.0 as i64, 1, c], (Kind::Float, x.device()));
    let (n32, c32) = dims(n, c)?;
    // SAFETY: the arguments follow bias_gelu_bwd's signature; the partial
    // sums have one row per block row of the grid.
    unsafe { launch(k.bias_gelu_bwd, grid, params![&dy, x, b, &dx, &part, n32, c32])? };
    Ok((dx, Partials(part)))
}

/// `q`, `k` and `v` (contiguous bf16 CUDA rows `[n, c]`, `c % 8 == 0`,
/// 16-byte aligned) side by side as `[n, 3c]`, and the partial sums over
/// its rows (the `[3c]` bias gradient of the projection they came from),
/// in one pass: a fused q, k, v projection's gradient.
pub fn pack_qkv(q: &Tensor, k: &Tensor, v: &Tensor) -> anyhow::Result<(Tensor, Partials)> {
    let kl = require("fused")?;
    let (n, c) = q.size2()?;
    for t in [q, k, v] {
        anyhow::ensure!(
            t.size() == [n, c]
                && c % 8 == 0
                && t.kind() == Kind::BFloat16
                && t.device().is_cuda()
                && t.is_contiguous()
                && (t.data_ptr() as usize) % 16 == 0,
            "pack_qkv takes three contiguous, aligned bf16 CUDA [{n}, {c}] tensors (c a multiple of 8)"
        );
    }
    let qkv = Tensor::empty([n, 3 * c], (Kind::BFloat16, q.device()));
    let grid = rows_of_8_grid(kl, n, 3 * c, 8);
    let part = Tensor::empty([grid.blocks.0 as i64, 1, 3 * c], (Kind::Float, q.device()));
    let (n32, c32) = dims(n, c)?;
    // SAFETY: the arguments follow pack_qkv's signature (device pointers to
    // the checked parts, to qkv [n, 3c] and to partial sums of one row of
    // 3c per block row of the grid, then N, C).
    unsafe { launch(kl.pack_qkv, grid, params![q, k, v, &qkv, &part, n32, c32])? };
    Ok((qkv, Partials(part)))
}

/// The partial sums over the rows of contiguous bf16 CUDA rows `x` `[n, c]`
/// (`c % 8 == 0`): a bias's gradient (fp32 `[c]` once summed) from its
/// output's, in one pass at memory speed where libtorch's bf16 reduction
/// over GPT-2 124M's attention projection took about twice the time.
pub fn column_sums_bf16(x: &Tensor) -> anyhow::Result<Partials> {
    Ok(masked_column_sums(x, None)?.1)
}

/// ReLU's backward pass from its output `m` and the output's gradient `dy`
/// (bf16 `[n, c]`, contiguous, `c % 8 == 0`): `dx = dy` where `m > 0`, else
/// 0 (bf16), and the partial sums of `dx` over the rows (the gradient of the
/// bias added before the ReLU), in one pass.
pub fn relu_backward(dy: &Tensor, m: &Tensor) -> anyhow::Result<(Tensor, Partials)> {
    let (dx, part) = masked_column_sums(dy, Some(m))?;
    Ok((dx.expect("a masked sum writes its rows"), part))
}

/// The partial sums over the rows of `x` (`col_sums_bf16`); with a ReLU's
/// output `m`, of `x` zeroed where `m` is not positive, and those rows
/// written out too (`relu_bwd`). Contiguous bf16 CUDA rows `[n, c]`,
/// `c % 8 == 0`.
fn masked_column_sums(x: &Tensor, m: Option<&Tensor>) -> anyhow::Result<(Option<Tensor>, Partials)> {
    let k = require("fused")?;
    let (n, c) = x.size2()?;
    for t in std::iter::once(x).chain(m) {
        anyhow::ensure!(
            c % 8 == 0 && t.size() == [n, c] && t.kind() == Kind::BFloat16 && t.device().is_cuda() && t.is_contiguous(),
            "column sums take contiguous bf16 CUDA rows [{n}, {c}] of a multiple of 8"
        );
    }
    let grid = rows_of_8_grid(k, n, c, 8);
    let part = Tensor::empty([grid.blocks.0 as i64, 1, c], (Kind::Float, x.device()));
    let (n32, c32) = dims(n, c)?;
    let dx = m.map(|_| x.empty_like());
    // SAFETY: the arguments follow col_sums_bf16's signature, or with `m`
    // relu_bwd's (device pointers to the checked rows, to dx of their shape
    // and to partial sums of one row per block row of the grid, then N, C).
    unsafe {
        match (m, &dx) {
            (Some(m), Some(dx)) => launch(k.relu_bwd, grid, params![x, m, dx, &part, n32, c32])?,
            _ => launch(k.col_sums_bf16, grid, params![x, &part, n32, c32])?,
        }
    };
    Ok((dx, Partials(part)))
}

/// Whether [`batch_norm`] takes rows of `c` channels: a multiple of 8
/// whose groups of 8 divide a block's 256 threads (8 to 2048 channels in
/// powers of two).
pub fn batch_norm_fits(c: i64) -> bool {
    c % 8 == 0 && c >= 8 && 256 % (c / 8) == 0
}

/// `t`, or a copy of it where it does not start 16-byte aligned (the batch
/// norm kernels load 8 channels at a time; a parameter or gradient inside
/// a ZeRO flat buffer may start anywhere).
fn aligned16(t: &Tensor) -> Tensor {
    if (t.data_ptr() as usize) % 16 == 0 {
        t.shallow_clone()
    } else {
        t.copy()
    }
}

/// Threads per block of the batch norm kernels (`BN_THREADS`).
const BN_THREADS: u32 = 256;

/// Rows per block of the batch norm's reductions over `m` rows, and the
/// blocks: a few blocks per SM.
fn bn_blocks(k: &Loaded, m: i64) -> (i64, u32) {
    let blocks = i64::from(k.sms) * 4;
    let per = ((m + blocks - 1) / blocks).max(1);
    (per, ((m + per - 1) / per).max(1) as u32)
}

/// A grid striding over the `m * c / 8` groups of 8 channels (batch norm's
/// and max pooling's elementwise kernels).
fn bn_stride_grid(k: &Loaded, m: i64, c: i64) -> Grid {
    let groups = (m * c / 8).max(1) as u64;
    Grid::line(groups.div_ceil(u64::from(BN_THREADS)).min(u64::from(k.sms) * 16) as u32, BN_THREADS)
}

/// The forward pass of training-mode batch norm over the rows of
/// channels-last activations `x` `[m, c]` (bf16, contiguous,
/// [`batch_norm_fits`]), with weight `w` and bias `b` (fp32 `[c]`), then
/// `res` (bf16 `[m, c]`) added and ReLU applied where asked:
/// `y = relu(xhat * w + b + res)` in bf16, `xhat = (x - mean) / sqrt(var +
/// eps)` with the rows' mean and biased variance. Returns y, the mean and
/// 1/std (fp32 `[c]`, for [`batch_norm_backward`]) and, with the ReLU, its
/// mask (see [`BatchNormOut`]). `running` (mean, var,
/// fp32 `[c]`) are updated as torch's batch norm does: `(1 - momentum) *
/// old + momentum * new`, with the unbiased variance.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    res: Option<&Tensor>,
    running: Option<(&Tensor, &Tensor)>,
    momentum: f32,
    eps: f32,
    relu: bool,
) -> anyhow::Result<BatchNormOut> {
    let k = require("fused")?;
    let (m, c) = x.size2()?;
    let rows_ok = |t: &Tensor| t.size() == [m, c] && t.kind() == Kind::BFloat16 && t.device() == x.device() && t.is_contiguous();
    anyhow::ensure!(
        batch_norm_fits(c) && x.device().is_cuda() && rows_ok(x),
        "fused batch norm takes contiguous bf16 CUDA rows [{m}, {c}]"
    );
    anyhow::ensure!(res.is_none_or(rows_ok), "the residual must be contiguous bf16 [{m}, {c}]");
    let vec_ok = |t: &Tensor| t.size() == [c] && t.kind() == Kind::Float && t.device() == x.device() && t.is_contiguous();
    anyhow::ensure!(vec_ok(w) && vec_ok(b), "batch norm parameters must be fp32 [{c}]");
    anyhow::ensure!(running.is_none_or(|(rm, rv)| vec_ok(rm) && vec_ok(rv)), "running statistics must be fp32 [{c}]");
    let (x, res) = (aligned16(x), res.map(aligned16));
    let (x, res) = (&x, res.as_ref());
    let (per, blocks) = bn_blocks(k, m);
    let part = Tensor::empty([i64::from(blocks), 2, c], (Kind::Float, x.device()));
    let (m32, c32, per32) = (i32::try_from(m)?, i32::try_from(c)?, i32::try_from(per)?);
    let mean = Tensor::empty([c], (Kind::Float, x.device()));
    let (rstd, scale, shift) = (mean.empty_like(), mean.empty_like(), mean.empty_like());
    let y = x.empty_like();
    let relu_mask = relu.then(|| Tensor::empty([m * c / 8], (Kind::Uint8, x.device())));
    let (rm, rv) = running.unzip();
    // SAFETY: the arguments follow bn_stats', bn_stats_finish's and
    // bn_apply's signatures (device pointers to tensors of the checked
    // shapes, kinds and contiguity or fresh ones of theirs, null for the
    // absent residual, running statistics and mask, then ints and floats;
    // the mask, where given, holds a byte per 8 channels of each row); the
    // partial sums hold [blocks, 2, c] for the blocks launched; every
    // tensor outlives the launches, which go to libtorch's current stream
    // in order (the reduction of the partial sums between them too).
    unsafe {
        launch(k.bn_stats, Grid::line(blocks, BN_THREADS), params![x, &part, m32, c32, per32])?;
    }
    let sums = Partials(part).sums()?;
    // SAFETY: as above; `sums` is the fresh [2, c] total of the partial
    // sums, `x`'s first row gives the shift they were taken from.
    unsafe {
        launch(
            k.bn_stats_finish,
            Grid::line((c as u32).div_ceil(256), 256),
            params![&sums, x, m32, c32, w, b, &mean, &rstd, &scale, &shift, rm, rv, momentum, eps],
        )?;
        launch(k.bn_apply, bn_stride_grid(k, m, c), params![x, res, &scale, &shift, &y, relu_mask.as_ref(), m32, c32])?;
    }
    Ok(BatchNormOut { y, mean, rstd, relu_mask })
}

/// What [`batch_norm`] returns.
pub struct BatchNormOut {
    /// The output rows `[m, c]` (bf16).
    pub y: Tensor,
    /// The rows' mean and 1/std (fp32 `[c]`).
    pub mean: Tensor,
    pub rstd: Tensor,
    /// With the ReLU, its mask for [`batch_norm_backward`]: a byte per 8
    /// channels of each row (uint8 `[m * c / 8]`, bit j of byte i set where
    /// `y`'s element `8 i + j` is above 0), 1/16 of `y`'s bytes to read.
    pub relu_mask: Option<Tensor>,
}

/// The backward pass of [`batch_norm`] from the output's gradient `dy`, the
/// ReLU's mask where there was one ([`BatchNormOut::relu_mask`]), the input `x`
/// and the kept `mean` and `rstd`, and `w`: returns dx (bf16), the
/// residual's gradient (bf16, with `want_dres`: the gradient behind the
/// ReLU), and `[2, c]` fp32 sums: db, then dw.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward(
    dy: &Tensor,
    relu_mask: Option<&Tensor>,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    w: &Tensor,
    want_dres: bool,
) -> anyhow::Result<(Tensor, Option<Tensor>, Tensor)> {
    let k = require("fused")?;
    let (m, c) = x.size2()?;
    let rows_ok = |t: &Tensor| t.size() == [m, c] && t.kind() == Kind::BFloat16 && t.device() == x.device() && t.is_contiguous();
    anyhow::ensure!(batch_norm_fits(c) && rows_ok(dy) && rows_ok(x), "fused batch norm backward takes contiguous bf16 rows [{m}, {c}]");
    anyhow::ensure!(
        relu_mask.is_none_or(|t| t.size() == [m * c / 8] && t.kind() == Kind::Uint8 && t.device() == x.device() && t.is_contiguous()),
        "the ReLU's mask must be contiguous uint8 [{}]",
        m * c / 8
    );
    let (dy, x, w) = (aligned16(dy), aligned16(x), aligned16(w));
    let (dy, x, w) = (&dy, &x, &w);
    let vec_ok = |t: &Tensor| t.size() == [c] && t.kind() == Kind::Float && t.device() == x.device() && t.is_contiguous();
    anyhow::ensure!([mean, rstd, w].iter().all(|t| vec_ok(t)), "batch norm backward: kept statistics and weight must be fp32 [{c}]");
    let (per, blocks) = bn_blocks(k, m);
    let part = Tensor::empty([i64::from(blocks), 2, c], (Kind::Float, x.device()));
    let (m32, c32, per32) = (i32::try_from(m)?, i32::try_from(c)?, i32::try_from(per)?);
    // SAFETY: the arguments follow bn_bwd_sums' signature (device pointers
    // to the checked rows, mask and vectors, null for the mask without the
    // ReLU, partial sums of [blocks, 2, c] for the blocks launched, then
    // ints); all outlive the launch.
    unsafe { launch(k.bn_bwd_sums, Grid::line(blocks, BN_THREADS), params![dy, relu_mask, x, mean, rstd, &part, m32, c32, per32])? };
    let sums = Partials(part).sums()?;
    let dx = x.empty_like();
    let dres = want_dres.then(|| x.empty_like());
    // SAFETY: the arguments follow bn_bwd_apply's signature (device
    // pointers to the checked rows, mask and vectors, null for the mask
    // without the ReLU, the [2, c] sums, fresh rows for dx and dres or
    // null, then ints); all outlive the launch.
    unsafe {
        launch(k.bn_bwd_apply, bn_stride_grid(k, m, c), params![dy, relu_mask, x, mean, rstd, w, &sums, &dx, dres.as_ref(), m32, c32])?
    };
    Ok((dx, dres, sums))
}

/// A max pooling's square window, stride and padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool {
    pub k: i64,
    pub stride: i64,
    pub pad: i64,
}

impl Pool {
    /// The output side of an input side `n` (no dilation, floor).
    pub fn out(&self, n: i64) -> i64 {
        (n + 2 * self.pad - self.k) / self.stride + 1
    }

    /// Whether [`max_pool`] takes this window over `c` channels: `c` a
    /// multiple of 8, a window of at most 255 positions (a byte each),
    /// padding at most half the window (every window meets the input).
    pub fn fits(&self, c: i64) -> bool {
        c % 8 == 0 && c > 0 && self.k >= 1 && self.k * self.k <= 255 && self.stride >= 1 && (0..=self.k / 2).contains(&self.pad)
    }
}

/// Max pooling of channels-last activations `x` `[n, h, w, c]` (bf16,
/// contiguous, [`Pool::fits`]): returns y `[n, ho, wo, c]` and, per output
/// element, the offset `kh * k + kw` of its maximum in its window (uint8,
/// the first in row-major order; NaN wins, as libtorch's), which
/// [`max_pool_backward`] takes instead of the input.
pub fn max_pool(x: &Tensor, pool: Pool) -> anyhow::Result<(Tensor, Tensor)> {
    let k = require("fused")?;
    let (n, h, w, c) = x.size4()?;
    anyhow::ensure!(
        pool.fits(c) && x.kind() == Kind::BFloat16 && x.device().is_cuda() && x.is_contiguous(),
        "fused max pooling takes contiguous bf16 CUDA rows [n, h, w, {c}] and {pool:?}"
    );
    let (ho, wo) = (pool.out(h), pool.out(w));
    anyhow::ensure!(ho >= 1 && wo >= 1, "max pooling {pool:?} of {h} x {w}: no output");
    let x = aligned16(x);
    let y = Tensor::empty([n, ho, wo, c], (Kind::BFloat16, x.device()));
    let offsets = Tensor::empty([n, ho, wo, c], (Kind::Uint8, x.device()));
    let [n32, h32, w32, c32, ho32, wo32, k32, s32, p32] = pool_dims([n, h, w, c, ho, wo], pool)?;
    // SAFETY: the arguments follow max_pool_fwd's signature (device
    // pointers to the checked input and fresh outputs of its shape, then
    // ints); all outlive the launch.
    unsafe {
        launch(k.max_pool_fwd, bn_stride_grid(k, n * ho * wo, c), params![&x, &y, &offsets, n32, h32, w32, c32, ho32, wo32, k32, s32, p32])?
    };
    Ok((y, offsets))
}

/// The backward pass of [`max_pool`]: dx `[n, h, w, c]` (bf16) from dy
/// `[n, ho, wo, c]` and the kept offsets, the input's sides `h` and `w`.
pub fn max_pool_backward(dy: &Tensor, offsets: &Tensor, h: i64, w: i64, pool: Pool) -> anyhow::Result<Tensor> {
    let k = require("fused")?;
    let (n, ho, wo, c) = dy.size4()?;
    anyhow::ensure!(
        pool.fits(c)
            && (pool.out(h), pool.out(w)) == (ho, wo)
            && dy.kind() == Kind::BFloat16
            && dy.device().is_cuda()
            && dy.is_contiguous(),
        "fused max pooling backward takes contiguous bf16 CUDA rows [n, ho, wo, {c}] of {pool:?}"
    );
    anyhow::ensure!(
        offsets.size() == dy.size() && offsets.kind() == Kind::Uint8 && offsets.is_contiguous() && offsets.device() == dy.device(),
        "max pooling: the offsets must be contiguous uint8 like dy"
    );
    let dy = aligned16(dy);
    let dx = Tensor::empty([n, h, w, c], (Kind::BFloat16, dy.device()));
    let [n32, h32, w32, c32, ho32, wo32, k32, s32, p32] = pool_dims([n, h, w, c, ho, wo], pool)?;
    // SAFETY: the arguments follow max_pool_bwd's signature (device
    // pointers to the checked gradient and offsets and a fresh dx of the
    // input's shape, then ints); all outlive the launch.
    unsafe {
        launch(k.max_pool_bwd, bn_stride_grid(k, n * h * w, c), params![&dy, offsets, &dx, n32, h32, w32, c32, ho32, wo32, k32, s32, p32])?
    };
    Ok(dx)
}

/// The pooling kernels' int arguments: n, h, w, c, ho, wo, k, stride, pad.
fn pool_dims(sizes: [i64; 6], pool: Pool) -> anyhow::Result<[i32; 9]> {
    let [n, h, w, c, ho, wo] = sizes;
    let mut out = [0i32; 9];
    for (o, v) in out.iter_mut().zip([n, h, w, c, ho, wo, pool.k, pool.stride, pool.pad]) {
        *o = i32::try_from(v)?;
    }
    Ok(out)
}

/// Whether [`embed`] takes rows of `c` channels.
pub fn embed_fits(c: i64) -> bool {
    c % 4 == 0 && (4..=4096).contains(&c)
}

/// Threads for rows of `c` channels, four per thread.
fn quad_threads(c: i64) -> u32 {
    ((c / 4 + 31) / 32 * 32) as u32
}

/// Token plus position embeddings of int64 tokens `idx` `[b, t]` (CUDA,
/// contiguous): `wte[idx] + wpe[..t]`, fp32 `[b, t, c]`, from the fp32
/// tables `wte` `[v, c]` and `wpe` `[>= t, c]` ([`embed_fits`]). A token
/// outside `[0, v)` stops the kernel (a device-side error, as libtorch's
/// gather raises).
pub fn embed(idx: &Tensor, wte: &Tensor, wpe: &Tensor) -> anyhow::Result<Tensor> {
    let k = require("fused")?;
    let (b, t) = idx.size2()?;
    let (v, c) = wte.size2()?;
    anyhow::ensure!(
        idx.kind() == Kind::Int64 && idx.device().is_cuda() && idx.is_contiguous(),
        "fused embedding takes contiguous int64 CUDA tokens"
    );
    anyhow::ensure!(
        embed_fits(c)
            && [wte, wpe].iter().all(|w| w.kind() == Kind::Float && w.is_contiguous() && w.device() == idx.device())
            && wpe.size().len() == 2
            && wpe.size()[1] == c
            && wpe.size()[0] >= t,
        "fused embedding: tables must be contiguous fp32 [v, {c}] and [>= {t}, {c}]"
    );
    anyhow::ensure!([wte, wpe].iter().all(|w| (w.data_ptr() as usize) % 16 == 0), "fused embedding: the tables must start 16-byte aligned");
    let x = Tensor::empty([b, t, c], (Kind::Float, idx.device()));
    let (b32, t32, c32) = (i32::try_from(b)?, i32::try_from(t)?, i32::try_from(c)?);
    let grid = Grid::line(u32::try_from(t)?, quad_threads(c));
    // SAFETY: the arguments follow embed_fwd's signature (device pointers to
    // the checked tokens, tables and a fresh [b, t, c] output, then B, T, C,
    // V); every tensor outlives the call.
    unsafe { launch(k.embed_fwd, grid, params![idx, wte, wpe, &x, b32, t32, c32, v])? };
    Ok(x)
}

/// The backward pass of [`embed`] from `dx` (`[b, t, c]`): adds each token's
/// row of `dx` into `gwte` (fp32 `[v, c]`, by atomic adds: a token that
/// occurs more than once is summed in an order that varies between runs),
/// and writes (`assign`) or adds the sum over the batch into the first `t`
/// rows of `gwpe` (fp32 `[>= t, c]`).
pub fn embed_backward(idx: &Tensor, dx: &Tensor, gwte: &Tensor, gwpe: &Tensor, assign: bool) -> anyhow::Result<()> {
    let k = require("fused")?;
    let (b, t) = idx.size2()?;
    let c = gwte.size2()?.1;
    let dx = dx.to_kind(Kind::Float).contiguous();
    // The kernel reads dx four floats at a time.
    let dx = aligned16(&dx);
    anyhow::ensure!(dx.size() == [b, t, c] && embed_fits(c), "fused embedding backward: dx must be [{b}, {t}, {c}]");
    anyhow::ensure!(
        [gwte, gwpe].iter().all(|g| (g.data_ptr() as usize) % 16 == 0),
        "fused embedding backward: the gradients must start 16-byte aligned"
    );
    anyhow::ensure!(
        [gwte, gwpe].iter().all(|g| g.kind() == Kind::Float && g.is_contiguous() && g.device() == idx.device())
            && gwpe.size().len() == 2
            && gwpe.size()[1] == c
            && gwpe.size()[0] >= t
            && idx.kind() == Kind::Int64
            && idx.is_contiguous(),
        "fused embedding backward: gradients must be contiguous fp32 [v, {c}] and [>= {t}, {c}]"
    );
    let (b32, t32, c32) = (i32::try_from(b)?, i32::try_from(t)?, i32::try_from(c)?);
    let grid = Grid::line(u32::try_from(t)?, quad_threads(c));
    // SAFETY: the arguments follow embed_bwd's signature (device pointers to
    // the checked tokens, dx and the two gradients, then B, T, C and the
    // flag); the tokens were checked in range by the forward pass's kernel.
    unsafe { launch(k.embed_bwd, grid, params![idx, &dx, gwte, gwpe, b32, t32, c32, i32::from(assign)])? };
    Ok(())
}

/// Per-block partial sums of a backward kernel, `[blocks, k, c]` fp32: `k`
/// vectors of `c` (parameter gradients) still to be summed over blocks.
pub struct Partials(Tensor);

impl Partials {
    /// The sums, `[k, c]`: on CUDA one launch of the kernel that
    /// [`Partials::add_into`] uses (libtorch's reduction over the blocks took
    /// about 16 us per call for GPT-2 124M's shapes on an H200).
    pub fn sums(&self) -> anyhow::Result<Tensor> {
        if !self.0.device().is_cuda() {
            return Ok(self.0.sum_dim_intlist(0, false, Kind::Float));
        }
        let (_, n, c) = self.0.size3()?;
        let out = Tensor::empty([n, c], (Kind::Float, self.0.device()));
        let rows: Vec<Tensor> = (0..n).map(|i| out.get(i)).collect();
        self.reduce(&rows.iter().collect::<Vec<_>>(), &[true; 3])?;
        Ok(out)
    }

    /// Adds the `i`-th sum into `into[i]` (the first `into.len()` of them;
    /// fp32 `[c]`, contiguous, e.g. a
    /// parameter's gradient buffer), every one in one launch, where libtorch
    /// takes a reduction (with a memset) and an add per vector.
    pub fn add_into(&self, into: &[&Tensor]) -> anyhow::Result<()> {
        self.reduce(into, &[])
    }

    /// As [`Partials::add_into`], but the `i`-th sum is written over
    /// `into[i]` where `write[i]` (a gradient buffer whose contents are
    /// stale: the step's first write to it), added where not.
    pub fn store_into(&self, into: &[&Tensor], write: &[bool]) -> anyhow::Result<()> {
        self.reduce(into, write)
    }

    /// The sums added into `into`, or written there where `assign` says so
    /// (missing entries: added).
    fn reduce(&self, into: &[&Tensor], assign: &[bool]) -> anyhow::Result<()> {
        let k = require("fused")?;
        let (blocks, n, c) = self.0.size3()?;
        anyhow::ensure!(into.len() <= n as usize && (1..=3).contains(&into.len()), "{n} partial sums for {} gradients", into.len());
        for g in into {
            anyhow::ensure!(
                g.kind() == Kind::Float && g.size() == [c] && g.is_contiguous() && g.device() == self.0.device(),
                "a gradient to add partial sums into must be contiguous fp32 [{c}] on their device"
            );
        }
        let (b32, k32, c32) = (i32::try_from(blocks)?, i32::try_from(n)?, i32::try_from(c)?);
        // One row of blocks per gradient (the first `into.len()` sums).
        let grid = Grid::new(((c32 as u32).div_ceil(32), into.len() as u32, 1), (32, 32, 1));
        let g = |i: usize| into.get(i).copied();
        let mask = assign.iter().take(3).enumerate().fold(0i32, |m, (i, &w)| m | (i32::from(w) << i));
        // SAFETY: the arguments follow add_partials' signature: the partial
        // sums [blocks, k, c] (contiguous, fresh from empty()), the checked
        // fp32 [c] gradients (null beyond `into`, never read), then B, K, C
        // and the bits of the gradients to write; all outlive the call, which goes to libtorch's
        // current stream, as the kernel that wrote the sums did.
        unsafe { launch(k.add_partials, grid, params![&self.0, g(0), g(1), g(2), b32, k32, c32, mask])? };
        Ok(())
    }
}

/// A list kernel's `first_block` for tensors of `ns` elements (at most
/// [`ADAM_MAX`]), `chunk` elements per block: each tensor's first block,
/// closed by the total, which comes back too.
fn first_blocks(ns: &[i64], chunk: i64) -> anyhow::Result<([i32; ADAM_MAX + 1], i64)> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torch_ext::Lr;

    /// Skips (with a message) where no GPU is usable.
    fn cuda() -> bool {
        if crate::torch_ext::cuda_available() {
            true
        } else {
            eprintln!("skipped: no CUDA device (this test runs on the GPU machines)");
            false
        }
    }

    /// The replica check's kernel gives the shim's number bit for bit, for
    /// every word width and for lengths around the rows of 1024 words, and a
    /// sign flipped in one slice changes it.
    #[test]
    fn cuda_word_hashes_equal_the_shims_and_see_a_flipped_sign() {
        if !cuda() {
            return;
        }
        let dev = tch::Device::Cuda(0);
        let mut ts = Vec::new();
        for (i, n) in [1i64, 1023, 1024, 1025, 3 * 1024 + 7, 5_000_003].into_iter().enumerate() {
            let x = Tensor::randn([n], (Kind::Float, dev)) * 3.0;
            ts.push(x.to_kind([Kind::Float, Kind::BFloat16, Kind::Half, Kind::Float, Kind::BFloat16, Kind::Float][i]));
        }
        ts.push(Tensor::randint(1 << 40, [4099], (Kind::Int64, dev)) - (1i64 << 39));
        ts.push(Tensor::randint(256, [2051], (Kind::Int64, dev)).to_kind(Kind::Int8));
        let ours = Vec::<i64>::try_from(&word_hashes(&ts).unwrap()).unwrap();
        let shim = Vec::<i64>::try_from(&crate::torch_ext::param_hashes(&ts).unwrap()).unwrap();
        assert_eq!(ours, shim);
        let flipped = ts[5].copy();
        let _ = flipped.narrow(0, 1000, 4096).neg_();
        let again = Vec::<i64>::try_from(&word_hashes(&[ts[5].shallow_clone(), flipped]).unwrap()).unwrap();
        assert_eq!(again[0], ours[5]);
        assert_ne!(again[1], ours[5], "a sign flipped in a slice left the hash unchanged");
    }

    /// A captured graph replays libtorch's operations and harness's own
    /// kernels on the inputs of each replay: the kernels launch on the
    /// capture's stream (launched on the legacy stream, they would have run
    /// once at capture and never again).
    #[test]
    fn cuda_graph_replays_libtorch_and_harness_kernels_on_new_inputs() {
        if !cuda() {
            return;
        }
        assert!(crate::torch_ext::has_cuda_graphs(), "this build's shim has no CUDA graphs");
        let _turn = crate::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let dev = tch::Device::Cuda(0);
        let x = Tensor::zeros([128, 256], (Kind::Float, dev));
        let w = Tensor::randn([256, 64], (Kind::Float, dev));
        let work = || -> anyhow::Result<Tensor> {
            let h = cast_bf16(&x.matmul(&w).relu())?;
            Ok(h.to_kind(Kind::Float).sum(Kind::Float))
        };
        let mut g = crate::torch_ext::CudaGraph::new().unwrap();
        let _ = g.on_side_stream(work).unwrap();
        let out = g.capture(work).unwrap();
        assert!(g.replay().is_ok());
        for k in 1..4 {
            x.shallow_clone().copy_(&Tensor::randn([128, 256], (Kind::Float, dev)));
            g.replay().unwrap();
            let want = work().unwrap().double_value(&[]);
            let got = out.double_value(&[]);
            assert!(got != 0.0 && (got - want).abs() <= 1e-3 * want.abs(), "replay {k}: {got} against eager {want}");
        }
    }

    #[test]
    fn list_launches_give_each_tensor_its_blocks() {
        // The list kernels find a block's tensor by binary search over
        // first_block: each tensor's chunks in order, empty ones none, the
        // total closing the list.
        let (first, total) = first_blocks(&[2 * 8192 + 1, 5, 0, 8192], 8192).unwrap();
        assert_eq!((&first[..5], total), (&[0, 3, 4, 4, 5][..], 5));
        assert!(first_blocks(&vec![1; ADAM_MAX + 1], 8192).is_err(), "more tensors than one launch takes");
    }

    #[test]
    fn kernel_source_compiles_for_hopper() {
        // NVRTC runs without a GPU; the CPU test environment has libnvrtc.
        let ptx = launch::compile(9, 0).unwrap();
        assert!(ptx.contains(".entry ce_bf16"), "{ptx}");
        let comm = launch::compile_program(launch::COMM_SOURCE, 9, 0, Vec::new()).unwrap();
        assert!(comm.contains(".entry scale_f32"), "{comm}");
        assert!(ptx.contains(".entry spin_until") && ptx.contains("globaltimer"), "{ptx}");
        for k in [
            "add_ln_fwd",
            "add_ln_fwd_f32",
            "add_ln_fwd_warp",
            "add_ln_fwd_warp_f32",
            "add_ln_bwd",
            "add_ln_bwd_f32",
            "add_ln_bwd_warp8",
            "add_ln_bwd_warp_f32_4",
            "add_rms_fwd",
            "add_rms_fwd_warp",
            "add_rms_bwd",
            "add_rms_bwd_warp8",
            "bias_gelu_fwd",
            "bias_gelu_bwd",
            "cast_bf16",
            "add_partials",
            "col_sums_bf16",
            "relu_bwd",
            "embed_fwd",
            "embed_bwd",
            "adamw",
            "adamw_steps",
            "cast_list",
            "bn_stats",
            "bn_stats_finish",
            "bn_apply",
            "bn_bwd_sums",
            "bn_bwd_apply",
            "max_pool_fwd",
            "max_pool_bwd",
        ] {
            assert!(ptx.contains(&format!(".entry {k}")), "{k} missing");
        }
        assert!(ptx.contains("tanh.approx.f32"), "Hopper gets the hardware tanh");
    }

    /// The reduce-scatter's division: each element times the factor, on
    /// the vectorised path and the scalar one, nothing written past the end.
    #[test]
    fn cuda_scale_matches_libtorch() {
        if !cuda() {
            return;
        }
        let _turn = crate::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let dev = tch::Device::Cuda(0);
        let stream = crate::torch_ext::current_cuda_stream().unwrap();
        for c in [1i64 << 20, 1_000_003, 3] {
            let x = Tensor::randn([c + 4], (Kind::Float, dev));
            let want = x.narrow(0, 0, c) * 0.25;
            let tail = Vec::<f32>::try_from(&x.narrow(0, c, 4)).unwrap();
            scale_on(stream, &x.narrow(0, 0, c), 0.25).unwrap();
            assert!(x.narrow(0, 0, c).equal(&want), "{c} elements: not the product");
            assert_eq!(Vec::<f32>::try_from(&x.narrow(0, c, 4)).unwrap(), tail, "{c} elements: wrote past the end");
        }
    }

    #[test]
    fn cuda_partial_sums_add_up() {
        if !cuda() {
            return;
        }
        let _turn = crate::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let dev = tch::Device::Cuda(0);
        // Fewer rows than a block's row strides and many more (the shapes
        // of GPT-2 124M's LayerNorm and GELU kernels), and a width that is
        // not a multiple of the 32 columns of a block.
        for (b, k, c) in [(1, 1, 8), (63, 3, 768), (64, 3, 768), (1320, 3, 768), (704, 1, 3072), (77, 2, 40)] {
            let part = Partials(Tensor::randn([b, k, c], (Kind::Float, dev)));
            let gs: Vec<Tensor> = (0..k).map(|_| Tensor::randn([c], (Kind::Float, dev))).collect();
            let sums = part.0.sum_dim_intlist(0, false, Kind::Float);
            let err = (part.sums().unwrap() - &sums).abs().max().double_value(&[]);
            assert!(err < 1e-4, "[{b}, {k}, {c}]: sums' max error {err}");
            let want: Vec<Tensor> = gs.iter().enumerate().map(|(i, g)| g + sums.get(i as i64)).collect();
            part.add_into(&gs.iter().collect::<Vec<_>>()).unwrap();
            for (i, (g, w)) in gs.iter().zip(&want).enumerate() {
                let err = (g - w).abs().max().double_value(&[]);
                assert!(err < 1e-4, "[{b}, {k}, {c}], gradient {i}: max error {err}");
            }
            // The first gradient written over a stale (NaN) buffer, the
            // others added, in the same launch.
            let stale: Vec<Tensor> =
                (0..k).map(|i| if i == 0 { Tensor::full([c], f64::NAN, (Kind::Float, dev)) } else { gs[i as usize].copy() }).collect();
            part.store_into(&stale.iter().collect::<Vec<_>>(), &[true, false, false]).unwrap();
            for (i, g) in stale.iter().enumerate() {
                let want = if i == 0 { sums.get(0) } else { &gs[i] + sums.get(i as i64) };
                let err = (g - &want).abs().max().double_value(&[]);
                assert!(err < 1e-4, "[{b}, {k}, {c}], gradient {i} stored: max error {err}");
            }
        }
    }

    #[test]
    fn cuda_column_sums_match_libtorch() {
        if !cuda() {
            return;
        }
        let _turn = crate::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let dev = tch::Device::Cuda(0);
        // GPT-2 124M's attention projection, fewer rows than blocks, a
        // width that leaves threads idle.
        for (n, c) in [(16384, 2304), (3, 64), (1000, 8 * 130)] {
            let x = Tensor::randn([n, c], (Kind::Float, dev)).to_kind(Kind::BFloat16);
            let want = x.to_kind(Kind::Float).sum_dim_intlist(0, false, Kind::Float);
            let got = column_sums_bf16(&x).unwrap().sums().unwrap();
            let err = (got.get(0) - &want).abs().max().double_value(&[]);
            assert!(err < 1e-3 * (n as f64).sqrt(), "[{n}, {c}]: max error {err}");
        }
    }

    #[test]
    fn cuda_adamw_matches_libtorchs_fused_adamw() {
        if !cuda() {
            return;
        }
        let _turn = crate::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let dev = tch::Device::Cuda(0);
        let f32s = (Kind::Float, dev);
        // Several blocks with a tail that is not a whole float4, small
        // tensors, a view that starts 4 bytes into its storage (the scalar
        // path), and more tensors than one launch takes.
        let mut params: Vec<Tensor> = vec![
            Tensor::randn([768, 2304], f32s),
            Tensor::randn([8193], f32s),
            Tensor::randn([3], f32s),
            Tensor::randn([5, 7], f32s),
            Tensor::randn([50_002], f32s).narrow(0, 1, 50_001),
        ];
        params.extend((0..50).map(|i| Tensor::randn([64 + i], f32s)));
        let zeros = |ps: &[Tensor]| ps.iter().map(|p| p.zeros_like()).collect::<Vec<_>>();
        let copies = |ps: &[Tensor]| ps.iter().map(|p| p.copy()).collect::<Vec<_>>();
        let (ours, theirs) = (copies(&params), copies(&params));
        let (m1, v1, m2, v2) = (zeros(&params), zeros(&params), zeros(&params), zeros(&params));
        let steps = || params.iter().map(|_| Tensor::zeros([], f32s)).collect::<Vec<_>>();
        let (s1, s2) = (steps(), steps());
        let lr_t = Tensor::full([], 3e-3, f32s);
        let scale = Tensor::full([], 2.5, f32s);
        for step in 0..4 {
            let grads: Vec<Tensor> = params.iter().map(|p| p.randn_like()).collect();
            // Host then device learning rate, a gradient scale, a skipped
            // update (found_inf = 1), then a taken one (0).
            let lr = if step == 0 { Lr::Host(1e-3) } else { Lr::Device(&lr_t) };
            let gs = (step == 1).then_some(&scale);
            let fi = match step {
                2 => Some(Tensor::ones([], f32s)),
                3 => Some(Tensor::zeros([], f32s)),
                _ => None,
            };
            let h = crate::torch_ext::AdamWStep { lr, beta1: 0.9, beta2: 0.95, weight_decay: 0.1, eps: 1e-8 };
            crate::torch_ext::fused_adamw(&theirs, &copies(&grads), &m2, &v2, &s2, h, fi.as_ref(), gs).unwrap();
            let lr = match lr {
                Lr::Host(lr) => (lr, None),
                Lr::Device(t) => (f64::NAN, Some(t)),
            };
            assert!(
                adamw(&ours, &grads, &m1, &v1, &s1, lr, (0.9, 0.95, 0.1, 1e-8), fi.as_ref(), gs).unwrap(),
                "the kernel took the tensors"
            );
            for (i, (a, b)) in ours.iter().chain(&m1).chain(&v1).zip(theirs.iter().chain(&m2).chain(&v2)).enumerate() {
                let err = (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-30);
                assert!(err < 1e-6, "step {step}, tensor {i} (params, then m, then v): relative error {err}");
            }
            for (a, b) in s1.iter().zip(&s2) {
                assert_eq!(a.double_value(&[]), b.double_value(&[]), "step {step}: step counts differ");
            }
        }
        assert!(!ours[0].equal(&params[0]), "the parameters moved");
    }

    #[test]
    fn cuda_fused_cross_entropy_matches_libtorch() {
        if !cuda() {
            return;
        }
        // The device's random stream is shared with the tests that run
        // beside this one and compare two draws of the same seed.
        let _turn = crate::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let dev = tch::Device::Cuda(0);
        // GPT-2's padded vocabulary; a row wider than a block's shared
        // memory holds on any GPU (read from memory again); a width not a
        // multiple of 8 (the scalar path).
        for (n, v) in [(64, 50304), (2, 131_080), (33, 1000), (7, 77)] {
            let logits = (Tensor::randn([n, v], (Kind::Float, dev)) * 3.0).to_kind(Kind::BFloat16);
            let target = Tensor::randint(v, [n], (Kind::Int64, dev));
            let (loss, grad) = cross_entropy_bf16(&logits, &target, 1.0, None, false).unwrap();
            // The same written over the logits themselves.
            let over = logits.copy();
            let (loss2, grad2) = cross_entropy_bf16(&over, &target, 1.0, None, true).unwrap();
            assert!(loss2.equal(&loss) && grad2.equal(&grad) && over.equal(&grad), "n={n} v={v}: in place, not the same");
            let x = logits.to_kind(Kind::Float).set_requires_grad(true);
            let want = x.cross_entropy_loss::<Tensor>(&target, None, tch::Reduction::Mean, -100, 0.0);
            want.backward();
            let dl = (loss.double_value(&[]) - want.double_value(&[])).abs();
            assert!(dl < 1e-4 * want.double_value(&[]).abs().max(1.0), "n={n} v={v}: loss {loss:?} vs {want:?}");
            let g = grad.to_kind(Kind::Float);
            let rel = (&g - x.grad()).norm().double_value(&[]) / x.grad().norm().double_value(&[]);
            assert!(rel < 1e-2, "n={n} v={v}: gradient relative error {rel}");
        }
    }
}
