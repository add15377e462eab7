//! The layers around a CNN's convolutions (a ResNet's, channels-last bf16):
//! training-mode batch norm with the residual add and ReLU after it, and
//! max pooling, each with its backward pass.

use tch::{Kind, Tensor};

use super::launch::{launch, params, require, Grid, Loaded};
use super::{aligned16, Partials};

/// Whether [`batch_norm`] takes rows of `c` channels: a multiple of 8
/// whose groups of 8 divide a block's 256 threads (8 to 2048 channels in
/// powers of two).
pub fn batch_norm_fits(c: i64) -> bool {
    c % 8 == 0 && c >= 8 && 256 % (c / 8) == 0
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
