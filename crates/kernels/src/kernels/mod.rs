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
//!
//! The layers of a transformer are here; the batch norm and max pooling of
//! a CNN in [`cnn`], the kernels over the weights (the AdamW update, the
//! bf16 cast) in [`weights`], those of the collectives and the replica check
//! in [`comm`]; each is re-exported here.

mod cnn;
mod comm;
mod launch;
mod weights;

pub use cnn::{batch_norm, batch_norm_backward, batch_norm_fits, max_pool, max_pool_backward, BatchNormOut, Pool};
pub use comm::{scale_on, spin_until, stamp, word_hashes};
pub use weights::{adamw, cast_bf16, cast_bf16_list};

use tch::{Kind, Tensor};

use launch::{launch, ln_bwd_warp_smem, loaded, params, require, Grid, Loaded, LN_BWD_THREADS};

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

#[cfg(test)]
mod tests;
