//! Device kernels of harness's own, compiled at run time with NVRTC (the
//! `libnvrtc` of the PyTorch installation) and launched on libtorch's stream.
//!
//! The kernels of `kernels = "fused"` (the layers in `train::fused` and the
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

use std::ffi::{c_void, CString};
use std::sync::OnceLock;

use cudarc::driver::{result, sys};
use tch::{Kind, Tensor};

const SOURCE: &str = r#"
typedef unsigned short bf16;
// Every kernel that harness launches through `launch_smem` starts with
// PDL_WAIT: on sm_90 and later it may be launched while the kernel before
// it on the stream is still running (programmatic dependent launch), and
// waits there until that kernel has finished and its writes are visible,
// before it reads or writes anything.
#if __CUDA_ARCH__ >= 900
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define PDL_WAIT() do {} while (0)
#endif
#define NEG_INF __int_as_float(0xff800000)
__device__ __forceinline__ float bf2f(bf16 h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ bf16 f2bf(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16)(u >> 16);
}
// Block-wide max and sum (blockDim.x a multiple of 32): every thread gets
// the result.
__device__ __forceinline__ float block_max(float v, float* sh) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float t = lane < nw ? sh[lane] : NEG_INF;
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
  return t;
}
__device__ __forceinline__ float block_sum(float v, float* sh) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float t = lane < nw ? sh[lane] : 0.f;
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}
// Two floats as bf16 (round to nearest even), lo in the low half: one
// instruction from sm_80 on.
__device__ __forceinline__ unsigned int pack_bf2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
  unsigned int r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
#else
  return (unsigned int)f2bf(lo) | ((unsigned int)f2bf(hi) << 16);
#endif
}
// Cross-entropy of bf16 logits [rows, V] (row-major), one block of 512
// threads per row. Writes grad = (softmax(x) - onehot(t)) * k, k = factor *
// (scale ? *scale : 1), and loss_rows[row] = logsumexp(x) - x[t]. Three
// sweeps over the row: its max, the sum of exp(x - max), the gradient. With
// `cached` (V % 8 == 0 and 2 V bytes of dynamic shared memory) the first
// sweep copies the row into shared memory and the others read it there, so
// the logits are read from memory once; two blocks fit an SM, one
// streaming while the other reduces. grad may be the logits' own memory
// (each element is read before the same thread writes its gradient, and
// x[t] is read first).
#define LOG2E 1.4426950408889634f
__device__ __forceinline__ float bf_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float max8(uint4 p) {
  return fmaxf(fmaxf(fmaxf(bf_lo(p.x), bf_hi(p.x)), fmaxf(bf_lo(p.y), bf_hi(p.y))),
               fmaxf(fmaxf(bf_lo(p.z), bf_hi(p.z)), fmaxf(bf_lo(p.w), bf_hi(p.w))));
}
// sum of 2^(x * log2(e) - ml), ml = m * log2(e): exp(x - m).
__device__ __forceinline__ float sumexp8(uint4 p, float ml) {
  const unsigned int w[4] = {p.x, p.y, p.z, p.w};
  float s = 0.f;
  #pragma unroll
  for (int j = 0; j < 4; j++) s += exp2f(fmaf(bf_lo(w[j]), LOG2E, -ml)) + exp2f(fmaf(bf_hi(w[j]), LOG2E, -ml));
  return s;
}
// The gradient of the 8 logits from column c (int: V < 2^31), t the target
// column, ll = logsumexp * log2(e).
__device__ __forceinline__ uint4 grad8(uint4 p, int c, int t, float ll, float k) {
  const unsigned int w[4] = {p.x, p.y, p.z, p.w};
  unsigned int o[4];
  #pragma unroll
  for (int j = 0; j < 4; j++) {
    const float lo = exp2f(fmaf(bf_lo(w[j]), LOG2E, -ll)) - (c + 2 * j == t ? 1.f : 0.f);
    const float hi = exp2f(fmaf(bf_hi(w[j]), LOG2E, -ll)) - (c + 2 * j + 1 == t ? 1.f : 0.f);
    o[j] = pack_bf2(lo * k, hi * k);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}
extern "C" __global__ void __launch_bounds__(512, 2) ce_bf16(
    const bf16* logits, const long long* __restrict__ target,
    bf16* grad, float* __restrict__ loss_rows, int V,
    const float* __restrict__ scale, float factor, int cached) {
  extern __shared__ uint4 row_sm[];
  __shared__ float sh[32];
  const size_t row = blockIdx.x;
  const bf16* x = logits + row * (size_t)V;
  bf16* g = grad + row * (size_t)V;
  const int t = (int)target[row];
  // Read before any gradient is written: grad may be the logits' memory.
  const float xt = threadIdx.x == 0 ? bf2f(x[t]) : 0.f;
  const float k = factor * (scale ? scale[0] : 1.f);
  const int nt = blockDim.x;
  float m = NEG_INF, s = 0.f, lse;
  if ((V % 8) == 0) {
    const int nv = V / 8;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* gv = reinterpret_cast<uint4*>(g);
    if (cached) {
      for (int i = threadIdx.x; i < nv; i += nt) { const uint4 p = xv[i]; row_sm[i] = p; m = fmaxf(m, max8(p)); }
    } else {
      for (int i = threadIdx.x; i < nv; i += nt) m = fmaxf(m, max8(xv[i]));
    }
    m = block_max(m, sh);
    const uint4* src = cached ? row_sm : xv;
    for (int i = threadIdx.x; i < nv; i += nt) s += sumexp8(src[i], m * LOG2E);
    lse = m + logf(block_sum(s, sh));
    for (int i = threadIdx.x; i < nv; i += nt) gv[i] = grad8(src[i], 8 * i, t, lse * LOG2E, k);
  } else {
    for (int i = threadIdx.x; i < V; i += nt) m = fmaxf(m, bf2f(x[i]));
    m = block_max(m, sh);
    for (int i = threadIdx.x; i < V; i += nt) s += __expf(bf2f(x[i]) - m);
    lse = m + logf(block_sum(s, sh));
    for (int i = threadIdx.x; i < V; i += nt) g[i] = f2bf((__expf(bf2f(x[i]) - lse) - (i == t ? 1.f : 0.f)) * k);
  }
  if (threadIdx.x == 0) loss_rows[row] = lse - xt;
}

// Residual add + LayerNorm over rows of C channels (C % 4 == 0), thread t of
// a block owning channels 4t..4t+3 (blockDim.x = C/4 rounded up to a warp),
// blocks striding over rows. Statistics in fp32, two-pass variance.
__device__ __forceinline__ void st_bf4(bf16* p, const float v[4]) {
  uint2 u;
  u.x = (unsigned int)f2bf(v[0]) | ((unsigned int)f2bf(v[1]) << 16);
  u.y = (unsigned int)f2bf(v[2]) | ((unsigned int)f2bf(v[3]) << 16);
  *reinterpret_cast<uint2*>(p) = u;
}
// Four channels of the LayerNorm's output or of its gradient: bf16 where
// a matmul takes it (pre-norm blocks), fp32 where it is the residual
// stream (post-norm layers, the `_f32` kernels).
template <typename Y> struct Quad;
template <> struct Quad<bf16> { typedef uint2 T; };
template <> struct Quad<float> { typedef float4 T; };
template <typename Y> __device__ __forceinline__ typename Quad<Y>::T ld4(const Y* p) {
  return *reinterpret_cast<const typename Quad<Y>::T*>(p);
}
__device__ __forceinline__ void unquad(uint2 u, float d[4]) { d[0] = bf_lo(u.x); d[1] = bf_hi(u.x); d[2] = bf_lo(u.y); d[3] = bf_hi(u.y); }
__device__ __forceinline__ void unquad(float4 u, float d[4]) { d[0] = u.x; d[1] = u.y; d[2] = u.z; d[3] = u.w; }
__device__ __forceinline__ void st4(bf16* p, const float v[4]) { st_bf4(p, v); }
__device__ __forceinline__ void st4(float* p, const float v[4]) { *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]); }
// xo = x + f + fb (fp32; f bf16 and fb, the branch's bias, fp32 [C], both
// optional; without f, xo is not written), y = LayerNorm(xo) * w + b as
// Y (bf16, or fp32 in add_ln_fwd_f32), with each row's mean and 1/std kept.
template <typename Y>
__device__ __forceinline__ void ln_fwd(const float* __restrict__ x, const bf16* __restrict__ f,
    const float* __restrict__ fb, const float* __restrict__ w, const float* __restrict__ b, float* __restrict__ xo, Y* __restrict__ y,
    float* __restrict__ mean, float* __restrict__ rstd, int N, int C, float eps) {
  PDL_WAIT();
  __shared__ float sh[32];
  const int c = 4 * threadIdx.x;
  const bool on = c < C;
  float wv[4] = {0.f, 0.f, 0.f, 0.f}, bv[4] = {0.f, 0.f, 0.f, 0.f}, fbv[4] = {0.f, 0.f, 0.f, 0.f};
  if (on) {
    float4 a = *reinterpret_cast<const float4*>(w + c), d = *reinterpret_cast<const float4*>(b + c);
    wv[0] = a.x; wv[1] = a.y; wv[2] = a.z; wv[3] = a.w; bv[0] = d.x; bv[1] = d.y; bv[2] = d.z; bv[3] = d.w;
    if (fb) { float4 e = *reinterpret_cast<const float4*>(fb + c); fbv[0] = e.x; fbv[1] = e.y; fbv[2] = e.z; fbv[3] = e.w; }
  }
  const float inv_c = 1.f / (float)C;
  // The next row's loads are issued before this row's reductions, so a
  // block keeps memory busy while it synchronises.
  float4 xa = make_float4(0.f, 0.f, 0.f, 0.f);
  uint2 fa = make_uint2(0u, 0u);
  int row = blockIdx.x;
  if (on && row < N) {
    xa = *reinterpret_cast<const float4*>(x + (size_t)row * C + c);
    if (f) fa = *reinterpret_cast<const uint2*>(f + (size_t)row * C + c);
  }
  for (; row < N; row += gridDim.x) {
    const size_t at = (size_t)row * C + c;
    float v[4] = {xa.x, xa.y, xa.z, xa.w};
    const uint2 fu = fa;
    const int next = row + gridDim.x;
    if (on && next < N) {
      xa = *reinterpret_cast<const float4*>(x + (size_t)next * C + c);
      if (f) fa = *reinterpret_cast<const uint2*>(f + (size_t)next * C + c);
    }
    if (on && f) {
      const float g[4] = {bf_lo(fu.x), bf_hi(fu.x), bf_lo(fu.y), bf_hi(fu.y)};
      #pragma unroll
      for (int j = 0; j < 4; j++) v[j] += g[j] + fbv[j];
      *reinterpret_cast<float4*>(xo + at) = make_float4(v[0], v[1], v[2], v[3]);
    }
    const float m = block_sum(v[0] + v[1] + v[2] + v[3], sh) * inv_c;
    float sq = 0.f;
    if (on) {
      #pragma unroll
      for (int j = 0; j < 4; j++) { float d = v[j] - m; sq += d * d; }
    }
    const float r = rsqrtf(block_sum(sq, sh) * inv_c + eps);
    if (on) {
      float o[4];
      #pragma unroll
      for (int j = 0; j < 4; j++) o[j] = (v[j] - m) * r * wv[j] + bv[j];
      st4(y + at, o);
    }
    if (threadIdx.x == 0) { mean[row] = m; rstd[row] = r; }
  }
}
#define LN_FWD_ARGS(Y) const float* __restrict__ x, const bf16* __restrict__ f, const float* __restrict__ fb, \
    const float* __restrict__ w, const float* __restrict__ b, float* __restrict__ xo, Y* __restrict__ y, \
    float* __restrict__ mean, float* __restrict__ rstd, int N, int C, float eps
extern "C" __global__ void add_ln_fwd(LN_FWD_ARGS(bf16)) { ln_fwd<bf16>(x, f, fb, w, b, xo, y, mean, rstd, N, C, eps); }
extern "C" __global__ void add_ln_fwd_f32(LN_FWD_ARGS(float)) { ln_fwd<float>(x, f, fb, w, b, xo, y, mean, rstd, N, C, eps); }
// add_ln_fwd for rows of at most 1024 channels: one warp per row, lane l
// owning the float4 chunks l, l + 32, ... (all of a row's loads issued
// before its reductions, which are warp shuffles: no block-wide
// synchronisation). Same arguments and results.
template <typename Y>
__device__ __forceinline__ void ln_fwd_warp(const float* __restrict__ x, const bf16* __restrict__ f,
    const float* __restrict__ fb, const float* __restrict__ w, const float* __restrict__ b, float* __restrict__ xo, Y* __restrict__ y,
    float* __restrict__ mean, float* __restrict__ rstd, int N, int C, float eps) {
  PDL_WAIT();
  const int lane = threadIdx.x % 32, nq = C / 4;
  const int warps = blockDim.x / 32;
  const float inv_c = 1.f / (float)C;
  for (int row = blockIdx.x * warps + threadIdx.x / 32; row < N; row += gridDim.x * warps) {
    const size_t base = (size_t)row * C;
    float v[8][4];
    #pragma unroll
    for (int j = 0; j < 8; j++) {
      const int q = lane + 32 * j;
      if (q < nq) {
        const float4 a = *reinterpret_cast<const float4*>(x + base + 4 * q);
        v[j][0] = a.x; v[j][1] = a.y; v[j][2] = a.z; v[j][3] = a.w;
        if (f) {
          const uint2 u = *reinterpret_cast<const uint2*>(f + base + 4 * q);
          const float g[4] = {bf_lo(u.x), bf_hi(u.x), bf_lo(u.y), bf_hi(u.y)};
          float4 e = make_float4(0.f, 0.f, 0.f, 0.f);
          if (fb) e = *reinterpret_cast<const float4*>(fb + 4 * q);
          const float h[4] = {e.x, e.y, e.z, e.w};
          #pragma unroll
          for (int i = 0; i < 4; i++) v[j][i] += g[i] + h[i];
        }
      } else {
        #pragma unroll
        for (int i = 0; i < 4; i++) v[j][i] = 0.f;
      }
    }
    float s = 0.f;
    #pragma unroll
    for (int j = 0; j < 8; j++) s += v[j][0] + v[j][1] + v[j][2] + v[j][3];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const float m = s * inv_c;
    float sq = 0.f;
    #pragma unroll
    for (int j = 0; j < 8; j++) {
      if (lane + 32 * j < nq) {
        #pragma unroll
        for (int i = 0; i < 4; i++) { const float d = v[j][i] - m; sq += d * d; }
      }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    const float r = rsqrtf(sq * inv_c + eps);
    #pragma unroll
    for (int j = 0; j < 8; j++) {
      const int q = lane + 32 * j;
      if (q < nq) {
        if (f) *reinterpret_cast<float4*>(xo + base + 4 * q) = make_float4(v[j][0], v[j][1], v[j][2], v[j][3]);
        const float4 wq = *reinterpret_cast<const float4*>(w + 4 * q), bq = *reinterpret_cast<const float4*>(b + 4 * q);
        const float wv[4] = {wq.x, wq.y, wq.z, wq.w}, bv[4] = {bq.x, bq.y, bq.z, bq.w};
        float o[4];
        #pragma unroll
        for (int i = 0; i < 4; i++) o[i] = (v[j][i] - m) * r * wv[i] + bv[i];
        st4(y + base + 4 * q, o);
      }
    }
    if (lane == 0) { mean[row] = m; rstd[row] = r; }
  }
}
extern "C" __global__ void __launch_bounds__(256) add_ln_fwd_warp(LN_FWD_ARGS(bf16)) {
  ln_fwd_warp<bf16>(x, f, fb, w, b, xo, y, mean, rstd, N, C, eps);
}
extern "C" __global__ void __launch_bounds__(256) add_ln_fwd_warp_f32(LN_FWD_ARGS(float)) {
  ln_fwd_warp<float>(x, f, fb, w, b, xo, y, mean, rstd, N, C, eps);
}
// The backward pass of add_ln_fwd: from dy (Y: bf16, or fp32 in the _f32
// kernels) and the LayerNorm's input x, dx = dres + d(LayerNorm)/dx (fp32;
// dres optional), df = bf16(dx) (optional), and per-block partial sums
// ([gridDim.x, 3, C] in part) of dw = sum(dy * xhat), db = sum(dy) and, for
// the branch's bias, sum(dx).
template <typename Y>
__device__ __forceinline__ void ln_bwd(const Y* __restrict__ dy, const float* __restrict__ x,
    const float* __restrict__ mean, const float* __restrict__ rstd, const float* __restrict__ w,
    const float* __restrict__ dres, float* __restrict__ dx, bf16* __restrict__ df,
    float* __restrict__ part, int N, int C) {
  PDL_WAIT();
  __shared__ float sh[32];
  const int c = 4 * threadIdx.x;
  const bool on = c < C;
  float wv[4] = {0.f, 0.f, 0.f, 0.f}, dw[4] = {0.f, 0.f, 0.f, 0.f}, db[4] = {0.f, 0.f, 0.f, 0.f};
  float dfb[4] = {0.f, 0.f, 0.f, 0.f};
  if (on) {
    float4 a = *reinterpret_cast<const float4*>(w + c);
    wv[0] = a.x; wv[1] = a.y; wv[2] = a.z; wv[3] = a.w;
  }
  const float inv_c = 1.f / (float)C;
  // The next row's loads are issued before this row's reductions (as in
  // add_ln_fwd).
  typename Quad<Y>::T da{};
  float4 xa = make_float4(0.f, 0.f, 0.f, 0.f), ra = make_float4(0.f, 0.f, 0.f, 0.f);
  int row = blockIdx.x;
  float ma = row < N ? mean[row] : 0.f, rsa = row < N ? rstd[row] : 0.f;
  if (on && row < N) {
    da = ld4(dy + (size_t)row * C + c);
    xa = *reinterpret_cast<const float4*>(x + (size_t)row * C + c);
    if (dres) ra = *reinterpret_cast<const float4*>(dres + (size_t)row * C + c);
  }
  for (; row < N; row += gridDim.x) {
    const size_t at = (size_t)row * C + c;
    const float m = ma, r = rsa;
    const typename Quad<Y>::T du = da;
    const float4 xu = xa, ru = ra;
    const int next = row + gridDim.x;
    if (next < N) { ma = mean[next]; rsa = rstd[next]; }
    if (on && next < N) {
      da = ld4(dy + (size_t)next * C + c);
      xa = *reinterpret_cast<const float4*>(x + (size_t)next * C + c);
      if (dres) ra = *reinterpret_cast<const float4*>(dres + (size_t)next * C + c);
    }
    float g[4] = {0.f, 0.f, 0.f, 0.f}, xh[4] = {0.f, 0.f, 0.f, 0.f}, s1 = 0.f, s2 = 0.f;
    if (on) {
      float d[4];
      unquad(du, d);
      const float xv[4] = {xu.x, xu.y, xu.z, xu.w};
      #pragma unroll
      for (int j = 0; j < 4; j++) {
        xh[j] = (xv[j] - m) * r;
        g[j] = d[j] * wv[j];
        s1 += g[j];
        s2 += g[j] * xh[j];
        dw[j] += d[j] * xh[j];
        db[j] += d[j];
      }
    }
    s1 = block_sum(s1, sh) * inv_c;
    s2 = block_sum(s2, sh) * inv_c;
    if (on) {
      float o[4];
      #pragma unroll
      for (int j = 0; j < 4; j++) o[j] = r * (g[j] - s1 - xh[j] * s2);
      if (dres) { o[0] += ru.x; o[1] += ru.y; o[2] += ru.z; o[3] += ru.w; }
      *reinterpret_cast<float4*>(dx + at) = make_float4(o[0], o[1], o[2], o[3]);
      if (df) st_bf4(df + at, o);
      #pragma unroll
      for (int j = 0; j < 4; j++) dfb[j] += o[j];
    }
  }
  if (on) {
    float* p = part + (size_t)blockIdx.x * 3 * C + c;
    *reinterpret_cast<float4*>(p) = make_float4(dw[0], dw[1], dw[2], dw[3]);
    *reinterpret_cast<float4*>(p + C) = make_float4(db[0], db[1], db[2], db[3]);
    *reinterpret_cast<float4*>(p + 2 * C) = make_float4(dfb[0], dfb[1], dfb[2], dfb[3]);
  }
}
#define LN_BWD_ARGS(Y) const Y* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ mean, \
    const float* __restrict__ rstd, const float* __restrict__ w, const float* __restrict__ dres, float* __restrict__ dx, \
    bf16* __restrict__ df, float* __restrict__ part, int N, int C
extern "C" __global__ void add_ln_bwd(LN_BWD_ARGS(bf16)) { ln_bwd<bf16>(dy, x, mean, rstd, w, dres, dx, df, part, N, C); }
extern "C" __global__ void add_ln_bwd_f32(LN_BWD_ARGS(float)) { ln_bwd<float>(dy, x, mean, rstd, w, dres, dx, df, part, N, C); }

// add_ln_bwd for rows of C = 128 * NQ channels: a warp per row, lane l
// owning the float4 chunks l, l + 32, ... (all of a row's loads issued
// before its two warp-shuffle reductions), the block's warps striding over
// rows. Each warp adds its rows' dw, db and branch-bias terms into its own
// [3, C] floats of (dynamic) shared memory, where each lane only touches
// its own chunks; at the end the block sums its warps' sets in warp order
// (deterministic) and writes one partial set per block. add_ln_bwd writes
// one per row-sized block: 1,320 sets of [3, 768] for GPT-2 124M on an
// H100, 12 MB written and read back per LayerNorm. (Sums kept in each
// lane's registers, 72 at 768 channels, ran slower on an H100: 2.00 ms of
// GPT-2 124M's step in 8-warp blocks, 1.80 in 4-warp ones, against 1.69
// here.) Same arguments and results as add_ln_bwd.
template <typename Y, int NQ>
__device__ __forceinline__ void ln_bwd_warp(const Y* __restrict__ dy, const float* __restrict__ x,
    const float* __restrict__ mean, const float* __restrict__ rstd, const float* __restrict__ w,
    const float* __restrict__ dres, float* __restrict__ dx, bf16* __restrict__ df,
    float* __restrict__ part, int N, int C) {
  PDL_WAIT();
  extern __shared__ float block_sums[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const float inv_c = 1.f / (float)C;
  float* acc = block_sums + warp * 3 * C;
  #pragma unroll
  for (int j = 0; j < NQ; j++) {
    const int c = 4 * (lane + 32 * j);
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    *reinterpret_cast<float4*>(acc + c) = z;
    *reinterpret_cast<float4*>(acc + C + c) = z;
    *reinterpret_cast<float4*>(acc + 2 * C + c) = z;
  }
  for (int row = blockIdx.x * warps + warp; row < N; row += gridDim.x * warps) {
    const size_t base = (size_t)row * C;
    const float m = mean[row], r = rstd[row];
    typename Quad<Y>::T du[NQ];
    float4 xv[NQ], rv[NQ];
    #pragma unroll
    for (int j = 0; j < NQ; j++) {
      const int c = 4 * (lane + 32 * j);
      du[j] = ld4(dy + base + c);
      xv[j] = *reinterpret_cast<const float4*>(x + base + c);
      rv[j] = dres ? *reinterpret_cast<const float4*>(dres + base + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float s1 = 0.f, s2 = 0.f;
    #pragma unroll
    for (int j = 0; j < NQ; j++) {
      const int c = 4 * (lane + 32 * j);
      const float4 wq = *reinterpret_cast<const float4*>(w + c);
      float d[4];
      unquad(du[j], d);
      const float xa[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w}, wa[4] = {wq.x, wq.y, wq.z, wq.w};
      float pw[4];
      #pragma unroll
      for (int i = 0; i < 4; i++) {
        const float xh = (xa[i] - m) * r, g = d[i] * wa[i];
        s1 += g;
        s2 += g * xh;
        pw[i] = d[i] * xh;
      }
      float4* aw = reinterpret_cast<float4*>(acc + c);
      float4* ab = reinterpret_cast<float4*>(acc + C + c);
      const float4 v = *aw, u = *ab;
      *aw = make_float4(v.x + pw[0], v.y + pw[1], v.z + pw[2], v.w + pw[3]);
      *ab = make_float4(u.x + d[0], u.y + d[1], u.z + d[2], u.w + d[3]);
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      s1 += __shfl_xor_sync(0xffffffffu, s1, o);
      s2 += __shfl_xor_sync(0xffffffffu, s2, o);
    }
    s1 *= inv_c;
    s2 *= inv_c;
    #pragma unroll
    for (int j = 0; j < NQ; j++) {
      const int c = 4 * (lane + 32 * j);
      const float4 wq = *reinterpret_cast<const float4*>(w + c);
      float d[4];
      unquad(du[j], d);
      const float xa[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w}, wa[4] = {wq.x, wq.y, wq.z, wq.w};
      const float ra[4] = {rv[j].x, rv[j].y, rv[j].z, rv[j].w};
      float o[4];
      #pragma unroll
      for (int i = 0; i < 4; i++) o[i] = r * (d[i] * wa[i] - s1 - (xa[i] - m) * r * s2) + ra[i];
      float4* af = reinterpret_cast<float4*>(acc + 2 * C + c);
      const float4 v = *af;
      *af = make_float4(v.x + o[0], v.y + o[1], v.z + o[2], v.w + o[3]);
      *reinterpret_cast<float4*>(dx + base + c) = make_float4(o[0], o[1], o[2], o[3]);
      if (df) st_bf4(df + base + c, o);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 3 * C; i += blockDim.x) {
    float t = block_sums[i];
    for (int k = 1; k < warps; k++) t += block_sums[k * 3 * C + i];
    part[(size_t)blockIdx.x * 3 * C + i] = t;
  }
}
#define LN_BWD_WARP(NQ) \
  extern "C" __global__ void add_ln_bwd_warp##NQ(LN_BWD_ARGS(bf16)) { \
    ln_bwd_warp<bf16, NQ>(dy, x, mean, rstd, w, dres, dx, df, part, N, C); \
  } \
  extern "C" __global__ void add_ln_bwd_warp_f32_##NQ(LN_BWD_ARGS(float)) { \
    ln_bwd_warp<float, NQ>(dy, x, mean, rstd, w, dres, dx, df, part, N, C); \
  }
LN_BWD_WARP(1)
LN_BWD_WARP(2)
LN_BWD_WARP(3)
LN_BWD_WARP(4)
LN_BWD_WARP(5)
LN_BWD_WARP(6)
LN_BWD_WARP(7)
LN_BWD_WARP(8)

// Bias + GELU (tanh approximation) over rows of C channels (C % 8 == 0):
// thread (blockIdx.y * blockDim.x + threadIdx.x) owns channels 8i..8i+7,
// blocks stride over rows in blockIdx.x.
#define GELU_K0 0.7978845608028654f
#define GELU_K1 0.044715f
// The hardware tanh (sm_75 on; relative error about 2^-11, below bf16's
// 2^-8): the accurate tanhf made these kernels compute-bound.
__device__ __forceinline__ float tanh_fast(float x) {
#if __CUDA_ARCH__ >= 750
  float y; asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
#else
  return tanhf(x);
#endif
}
// 8 bf16 values (16 bytes) as floats.
__device__ __forceinline__ void unpack_bf8(uint4 u, float v[8]) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
  #pragma unroll
  for (int j = 0; j < 4; j++) { v[2 * j] = bf_lo(w[j]); v[2 * j + 1] = bf_hi(w[j]); }
}
__device__ __forceinline__ void ld_bf8(const bf16* p, float v[8]) { unpack_bf8(*reinterpret_cast<const uint4*>(p), v); }
__device__ __forceinline__ void st_bf8(bf16* p, const float v[8]) {
  unsigned int w[4];
  #pragma unroll
  for (int j = 0; j < 4; j++) w[j] = (unsigned int)f2bf(v[2 * j]) | ((unsigned int)f2bf(v[2 * j + 1]) << 16);
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}
// y = gelu(x + b) (x, y bf16 [N, C]; b fp32 [C]).
extern "C" __global__ void bias_gelu_fwd(const bf16* __restrict__ x, const float* __restrict__ b,
    bf16* __restrict__ y, int N, int C) {
  PDL_WAIT();
  const int c = 8 * (blockIdx.y * blockDim.x + threadIdx.x);
  if (c >= C) return;
  float bv[8];
  #pragma unroll
  for (int j = 0; j < 8; j++) bv[j] = b[c + j];
  for (int row = blockIdx.x; row < N; row += gridDim.x) {
    const size_t at = (size_t)row * C + c;
    float v[8], o[8];
    ld_bf8(x + at, v);
    #pragma unroll
    for (int j = 0; j < 8; j++) {
      float u = v[j] + bv[j];
      o[j] = 0.5f * u * (1.f + tanh_fast(GELU_K0 * (u + GELU_K1 * u * u * u)));
    }
    st_bf8(y + at, o);
  }
}
// o = d * gelu'(v + b) for 8 channels, added into acc.
__device__ __forceinline__ void gelu_bwd8(const float v[8], const float d[8], const float b[8], float o[8], float acc[8]) {
  #pragma unroll
  for (int j = 0; j < 8; j++) {
    const float u = v[j] + b[j];
    const float t = tanh_fast(GELU_K0 * (u + GELU_K1 * u * u * u));
    const float g = 0.5f * (1.f + t) + 0.5f * u * (1.f - t * t) * GELU_K0 * (1.f + 3.f * GELU_K1 * u * u);
    o[j] = d[j] * g;
    acc[j] += o[j];
  }
}
// dx = dy * gelu'(x + b) (bf16), and per-block partial sums of dx over rows
// (the bias's gradient) in part ([gridDim.x, C]).
extern "C" __global__ void bias_gelu_bwd(const bf16* __restrict__ dy, const bf16* __restrict__ x,
    const float* __restrict__ b, bf16* __restrict__ dx, float* __restrict__ part, int N, int C) {
  PDL_WAIT();
  const int c = 8 * (blockIdx.y * blockDim.x + threadIdx.x);
  if (c >= C) return;
  float bv[8], acc[8];
  #pragma unroll
  for (int j = 0; j < 8; j++) { bv[j] = b[c + j]; acc[j] = 0.f; }
  // Two rows per iteration: twice the loads in flight.
  for (int row = blockIdx.x; row < N; row += 2 * gridDim.x) {
    const bool two = row + gridDim.x < N;
    const size_t at = (size_t)row * C + c, at2 = (size_t)(row + gridDim.x) * C + c;
    float v[8], d[8], v2[8], d2[8], o[8];
    ld_bf8(x + at, v);
    ld_bf8(dy + at, d);
    if (two) { ld_bf8(x + at2, v2); ld_bf8(dy + at2, d2); }
    gelu_bwd8(v, d, bv, o, acc);
    st_bf8(dx + at, o);
    if (two) {
      gelu_bwd8(v2, d2, bv, o, acc);
      st_bf8(dx + at2, o);
    }
  }
  float* p = part + (size_t)blockIdx.x * C + c;
  #pragma unroll
  for (int j = 0; j < 8; j++) p[j] = acc[j];
}

// A weight's cast for a matmul and its gradient's accumulation (the fused
// weight path): out = bf16(w) (round to nearest even, as libtorch's cast),
// and g += float(d) (as libtorch's cast then add, in one pass). n elements,
// 8 per thread and step (pointers 16-byte aligned), grid-stride.
extern "C" __global__ void cast_bf16(const float* __restrict__ w, bf16* __restrict__ out, long long n) {
  PDL_WAIT();
  const long long n8 = n / 8, stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += stride) {
    const float4 a = reinterpret_cast<const float4*>(w)[2 * i], b = reinterpret_cast<const float4*>(w)[2 * i + 1];
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    st_bf8(out + 8 * i, v);
  }
  for (long long i = 8 * n8 + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = f2bf(w[i]);
}

// g_k[c] += sum over b of part[b, k, c] for part [B, K, C] (fp32, K <= 3),
// or g_k[c] = that sum (assign != 0): the per-block partial sums of the
// backward kernels above, reduced and added into the parameters' gradient
// buffers (any alignment), or written as new gradients, in one launch.
// Block (32, 32): 32 columns, 32 row strides; grid (C / 32, K). The order
// of the additions is fixed: the same sums on every run.
extern "C" __global__ void add_partials(const float* __restrict__ part, float* g0, float* g1, float* g2, int B, int K, int C, int assign) {
  PDL_WAIT();
  __shared__ float sh[32][33];
  const int c = blockIdx.x * 32 + threadIdx.x, k = blockIdx.y;
  float s = 0.f;
  if (c < C) {
    const float* p = part + (size_t)k * C + c;
    #pragma unroll 4
    for (int b = threadIdx.y; b < B; b += 32) s += p[(size_t)b * K * C];
  }
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    #pragma unroll
    for (int j = 1; j < 32; j++) s += sh[j][threadIdx.x];
    float* g = k == 0 ? g0 : (k == 1 ? g1 : g2);
    g[c] = assign ? s : g[c] + s;
  }
}
// Per-block partial sums over the rows of bf16 x [N, C] (C % 8 == 0) in
// part [gridDim.x, C] (a bias's gradient, reduced by add_partials): thread
// (blockIdx.y * blockDim.x + threadIdx.x) owns channels 8i..8i+7, blocks
// stride over rows in blockIdx.x, four rows in flight per thread. With
// RELU, x is the gradient of a ReLU's output m [N, C] (bf16): what is summed
// (and written to dx) is x where m > 0 and 0 elsewhere, ReLU's backward.
__device__ __forceinline__ void relu_mask(uint4 m, float v[8]) {
  float mv[8];
  unpack_bf8(m, mv);
  #pragma unroll
  for (int j = 0; j < 8; j++) v[j] = mv[j] > 0.f ? v[j] : 0.f;
}
template <bool RELU>
__device__ __forceinline__ void col_sums(const bf16* __restrict__ x, const bf16* __restrict__ m, bf16* __restrict__ dx,
    float* __restrict__ part, int N, int C) {
  PDL_WAIT();
  const int c = 8 * (blockIdx.y * blockDim.x + threadIdx.x);
  if (c >= C) return;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int step = gridDim.x;
  int row = blockIdx.x;
  for (; row + 3 * step < N; row += 4 * step) {
    uint4 u[4], um[4];
    #pragma unroll
    for (int r = 0; r < 4; r++) {
      u[r] = *reinterpret_cast<const uint4*>(x + (size_t)(row + r * step) * C + c);
      if (RELU) um[r] = *reinterpret_cast<const uint4*>(m + (size_t)(row + r * step) * C + c);
    }
    #pragma unroll
    for (int r = 0; r < 4; r++) {
      float v[8];
      unpack_bf8(u[r], v);
      if (RELU) {
        relu_mask(um[r], v);
        st_bf8(dx + (size_t)(row + r * step) * C + c, v);
      }
      #pragma unroll
      for (int j = 0; j < 8; j++) acc[j] += v[j];
    }
  }
  for (; row < N; row += step) {
    float v[8];
    ld_bf8(x + (size_t)row * C + c, v);
    if (RELU) {
      relu_mask(*reinterpret_cast<const uint4*>(m + (size_t)row * C + c), v);
      st_bf8(dx + (size_t)row * C + c, v);
    }
    #pragma unroll
    for (int j = 0; j < 8; j++) acc[j] += v[j];
  }
  float* p = part + (size_t)blockIdx.x * C + c;
  #pragma unroll
  for (int j = 0; j < 8; j++) p[j] = acc[j];
}
extern "C" __global__ void col_sums_bf16(const bf16* __restrict__ x, float* __restrict__ part, int N, int C) {
  col_sums<false>(x, nullptr, nullptr, part, N, C);
}
extern "C" __global__ void relu_bwd(const bf16* __restrict__ dy, const bf16* __restrict__ m, bf16* __restrict__ dx,
    float* __restrict__ part, int N, int C) {
  col_sums<true>(dy, m, dx, part, N, C);
}

// The gradient of a fused q, k, v projection from its three parts: q, k
// and v (bf16 rows [N, C] each, contiguous) side by side into qkv [N, 3C],
// with per-block partial sums over the rows of qkv (the projection bias's
// gradient) in part [gridDim.x, 3C] (reduced by add_partials). Thread
// (blockIdx.y * blockDim.x + threadIdx.x) owns columns 8i..8i+7 of qkv
// (C % 8 == 0), blocks stride over rows in blockIdx.x, four rows in flight
// per thread. One pass over the parts, where a copy into qkv and a
// column-sum pass over it read them twice.
extern "C" __global__ void pack_qkv(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
    bf16* __restrict__ qkv, float* __restrict__ part, int N, int C) {
  PDL_WAIT();
  const int c = 8 * (blockIdx.y * blockDim.x + threadIdx.x);
  if (c >= 3 * C) return;
  const int which = c / C, cc = c - which * C;
  const bf16* __restrict__ src = which == 0 ? q : (which == 1 ? k : v);
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int step = gridDim.x;
  int row = blockIdx.x;
  for (; row + 3 * step < N; row += 4 * step) {
    uint4 u[4];
    #pragma unroll
    for (int r = 0; r < 4; r++) u[r] = *reinterpret_cast<const uint4*>(src + (size_t)(row + r * step) * C + cc);
    #pragma unroll
    for (int r = 0; r < 4; r++) {
      *reinterpret_cast<uint4*>(qkv + (size_t)(row + r * step) * 3 * C + c) = u[r];
      float f[8];
      unpack_bf8(u[r], f);
      #pragma unroll
      for (int j = 0; j < 8; j++) acc[j] += f[j];
    }
  }
  for (; row < N; row += step) {
    const uint4 u = *reinterpret_cast<const uint4*>(src + (size_t)row * C + cc);
    *reinterpret_cast<uint4*>(qkv + (size_t)row * 3 * C + c) = u;
    float f[8];
    unpack_bf8(u, f);
    #pragma unroll
    for (int j = 0; j < 8; j++) acc[j] += f[j];
  }
  float* p = part + (size_t)blockIdx.x * 3 * C + c;
  #pragma unroll
  for (int j = 0; j < 8; j++) p[j] = acc[j];
}

// Token and position embeddings of N = B * T tokens (row r = b * T + t):
// x[r] = wte[idx[r]] + wpe[t] (fp32 rows of C, C % 4 == 0). One block of
// at least C / 4 threads per position t, looping over the batch. A token
// outside [0, V) stops the kernel (__trap), as libtorch's device-side
// index check stops its gather.
extern "C" __global__ void embed_fwd(const long long* __restrict__ idx, const float* __restrict__ wte,
    const float* __restrict__ wpe, float* __restrict__ x, int B, int T, int C, long long V) {
  PDL_WAIT();
  const int t = blockIdx.x, c = 4 * threadIdx.x;
  if (c >= C) return;
  const float4 p = *reinterpret_cast<const float4*>(wpe + (size_t)t * C + c);
  #pragma unroll 4
  for (int b = 0; b < B; b++) {
    const size_t r = (size_t)b * T + t;
    const long long tok = idx[r];
    if (tok < 0 || tok >= V) __trap();
    const float4 a = *reinterpret_cast<const float4*>(wte + (size_t)tok * C + c);
    *reinterpret_cast<float4*>(x + r * C + c) = make_float4(a.x + p.x, a.y + p.y, a.z + p.z, a.w + p.w);
  }
}
// Four floats added into global memory without reading them back: one
// vector reduction from sm_90 on.
__device__ __forceinline__ void red_add4(float* p, float4 v) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
#else
  atomicAdd(p, v.x); atomicAdd(p + 1, v.y); atomicAdd(p + 2, v.z); atomicAdd(p + 3, v.w);
#endif
}
// The backward pass of embed_fwd from dx [N, C] (fp32): gwpe[t] = (assign)
// or += the sum over b of dx[b * T + t], in b order; gwte[idx[r]] += dx[r]
// by atomic adds, so the rows of a token that occurs more than once are
// summed in an order that varies between runs (the last bits may differ).
extern "C" __global__ void embed_bwd(const long long* __restrict__ idx, const float* __restrict__ dx,
    float* gwte, float* gwpe, int B, int T, int C, int assign) {
  PDL_WAIT();
  const int t = blockIdx.x, c = 4 * threadIdx.x;
  if (c >= C) return;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  #pragma unroll 4
  for (int b = 0; b < B; b++) {
    const size_t r = (size_t)b * T + t;
    const float4 d = *reinterpret_cast<const float4*>(dx + r * C + c);
    s.x += d.x; s.y += d.y; s.z += d.z; s.w += d.w;
    red_add4(gwte + (size_t)idx[r] * C + c, d);
  }
  float4* o = reinterpret_cast<float4*>(gwpe + (size_t)t * C + c);
  if (!assign) { const float4 g = *o; s.x += g.x; s.y += g.y; s.z += g.z; s.w += g.w; }
  *o = s;
}

// AdamW over a list of fp32 tensors, the maths of libtorch's _fused_adamw_
// (its fp64 and fp32 steps as written there), one block per chunk of
// ADAM_CHUNK elements of a tensor: p, m and v are read and written, g only
// read (libtorch also writes the gradient back when it is scaled).
// `step` holds each tensor's steps so far (this update is step + 1;
// adamw_steps counts it afterwards). An update with *found_inf == 1 is
// skipped; the learning rate is *lr_t where given, else lr; gradients are
// divided by *grad_scale where given.
// ADAM_MAX and ADAM_CHUNK come from the Rust constants of the same names
// (compile()'s -D options).
struct AdamList {
  float* p[ADAM_MAX];
  float* g[ADAM_MAX];
  float* m[ADAM_MAX];
  float* v[ADAM_MAX];
  float* step[ADAM_MAX];
  long long n[ADAM_MAX];
  int first_block[ADAM_MAX + 1];
  int count;
};
struct AdamScalars {
  double lr, beta1, beta2, wd, eps;
  float bc1, bc2_sqrt;
  const float* grad_scale;
};
__device__ __forceinline__ void adam_elem(float& param, float grad, float& exp_avg, float& exp_avg_sq, const AdamScalars& a) {
  if (a.grad_scale) grad /= (double)*a.grad_scale;
  if (a.wd != 0.0) param -= a.lr * a.wd * param;
  exp_avg = a.beta1 * exp_avg + (1 - a.beta1) * grad;
  exp_avg_sq = a.beta2 * exp_avg_sq + (1 - a.beta2) * grad * grad;
  const float step_size = a.lr / a.bc1;
  const float denom = (sqrtf(exp_avg_sq) / a.bc2_sqrt) + a.eps;
  param -= step_size * exp_avg / denom;
}
extern "C" __global__ void __launch_bounds__(512) adamw(const AdamList L, const float* __restrict__ lr_t, double lr,
    double beta1, double beta2, double wd, double eps, const float* __restrict__ grad_scale,
    const float* __restrict__ found_inf) {
  PDL_WAIT();
  if (found_inf && *found_inf == 1.f) return;
  int lo = 0, hi = L.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (L.first_block[mid] <= (int)blockIdx.x) lo = mid; else hi = mid - 1;
  }
  const int t = lo;
  const long long start = (long long)(blockIdx.x - L.first_block[t]) * ADAM_CHUNK;
  const long long end = min(L.n[t], start + ADAM_CHUNK);
  const float step = *L.step[t] + 1.f;
  AdamScalars a;
  a.lr = lr_t ? (double)*lr_t : lr;
  a.beta1 = beta1; a.beta2 = beta2; a.wd = wd; a.eps = eps; a.grad_scale = grad_scale;
  a.bc1 = (float)(1.0 - pow(beta1, (double)step));
  a.bc2_sqrt = (float)sqrt(1.0 - pow(beta2, (double)step));
  float* p = L.p[t]; const float* g = L.g[t]; float* m = L.m[t]; float* v = L.v[t];
  long long i = start + threadIdx.x;
  if ((((size_t)p | (size_t)g | (size_t)m | (size_t)v) & 15) == 0) {
    // start is a multiple of 4: float4 steps up to the last whole one.
    const long long end4 = start + ((end - start) & ~3ll);
    for (long long j = start + 4ll * threadIdx.x; j < end4; j += 4ll * blockDim.x) {
      float4 pv = *reinterpret_cast<float4*>(p + j), gv = *reinterpret_cast<const float4*>(g + j);
      float4 mv = *reinterpret_cast<float4*>(m + j), vv = *reinterpret_cast<float4*>(v + j);
      adam_elem(pv.x, gv.x, mv.x, vv.x, a); adam_elem(pv.y, gv.y, mv.y, vv.y, a);
      adam_elem(pv.z, gv.z, mv.z, vv.z, a); adam_elem(pv.w, gv.w, mv.w, vv.w, a);
      *reinterpret_cast<float4*>(p + j) = pv; *reinterpret_cast<float4*>(m + j) = mv; *reinterpret_cast<float4*>(v + j) = vv;
    }
    i = end4 + threadIdx.x;
  }
  for (; i < end; i += blockDim.x) {
    float pv = p[i], mv = m[i], vv = v[i];
    adam_elem(pv, g[i], mv, vv, a);
    p[i] = pv; m[i] = mv; v[i] = vv;
  }
}
// After adamw: each tensor's step count += 1 - *found_inf (as libtorch adds
// one before the update and takes found_inf off after it).
extern "C" __global__ void adamw_steps(const AdamList L, const float* __restrict__ found_inf) {
  PDL_WAIT();
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < L.count) *L.step[t] += 1.f - (found_inf ? *found_inf : 0.f);
}

// Many weights' casts in one launch (the fused layers' weights at the start
// of a step): out_i = bf16(w_i) as cast_bf16, one block of 256 threads per
// chunk of CAST_CHUNK elements of a tensor (w_i and out_i 16-byte aligned).
struct CastList {
  const float* w[ADAM_MAX];
  bf16* out[ADAM_MAX];
  long long n[ADAM_MAX];
  int first_block[ADAM_MAX + 1];
  int count;
};
extern "C" __global__ void __launch_bounds__(256) cast_list(const CastList L) {
  PDL_WAIT();
  int lo = 0, hi = L.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (L.first_block[mid] <= (int)blockIdx.x) lo = mid; else hi = mid - 1;
  }
  const float* w = L.w[lo];
  bf16* out = L.out[lo];
  const long long start = (long long)(blockIdx.x - L.first_block[lo]) * CAST_CHUNK;
  const long long end = min(L.n[lo], start + CAST_CHUNK);
  // Chunks start at multiples of 8: whole groups of 8, then a tail.
  const long long end8 = start + (end - start) / 8 * 8;
  for (long long i = start + 8 * threadIdx.x; i < end8; i += 8 * blockDim.x) {
    const float4 a = *reinterpret_cast<const float4*>(w + i), b = *reinterpret_cast<const float4*>(w + i + 4);
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    st_bf8(out + i, v);
  }
  for (long long i = end8 + threadIdx.x; i < end; i += blockDim.x) out[i] = f2bf(w[i]);
}

// Link emulation on the device timeline: stamp() records the GPU clock before
// a collective; spin_until() after it waits until `ns` have passed since that
// stamp, so the collective appears to take at least what the modelled link
// would need. One thread; nothing else runs on the stream meanwhile.
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
extern "C" __global__ void stamp(unsigned long long* at) { *at = now_ns(); }
extern "C" __global__ void spin_until(const unsigned long long* at, unsigned long long ns) {
  const unsigned long long end = *at + ns;
  while (now_ns() < end) { __nanosleep(1000); }
}
"#;

struct Loaded {
    _module: sys::CUmodule,
    ce_bf16: sys::CUfunction,
    /// The LayerNorm kernels by the kind of its output and of that
    /// output's gradient ([`ln_index`]): bf16, then fp32 (`_f32`).
    add_ln_fwd: [sys::CUfunction; 2],
    add_ln_fwd_warp: [sys::CUfunction; 2],
    add_ln_bwd: [sys::CUfunction; 2],
    /// `add_ln_bwd_warp{NQ}` (and `add_ln_bwd_warp_f32_{NQ}`) for NQ =
    /// 1..=8 (rows of 128 NQ channels), with the blocks of 128 threads each
    /// SM holds at once.
    add_ln_bwd_warp: [[(sys::CUfunction, u32); 8]; 2],
    bias_gelu_fwd: sys::CUfunction,
    bias_gelu_bwd: sys::CUfunction,
    cast_bf16: sys::CUfunction,
    add_partials: sys::CUfunction,
    col_sums_bf16: sys::CUfunction,
    relu_bwd: sys::CUfunction,
    pack_qkv: sys::CUfunction,
    embed_fwd: sys::CUfunction,
    embed_bwd: sys::CUfunction,
    adamw: sys::CUfunction,
    adamw_steps: sys::CUfunction,
    cast_list: sys::CUfunction,
    /// Streaming multiprocessors of the device (grid sizes).
    sms: u32,
    /// The device's compute capability (major).
    major: i32,
    /// Dynamic shared memory a block of `ce_bf16` may take (bytes).
    ce_smem: i32,
    stamp: sys::CUfunction,
    spin_until: sys::CUfunction,
}

// SAFETY: CUmodule and CUfunction are driver handles valid in every thread
// that has the (primary) context current; they are only used for launches.
unsafe impl Send for Loaded {}
unsafe impl Sync for Loaded {}

fn loaded() -> Result<&'static Loaded, String> {
    static K: OnceLock<Result<Loaded, String>> = OnceLock::new();
    K.get_or_init(|| {
        let mut dev = 0;
        // SAFETY: libtorch has initialised CUDA on this thread (a tensor is
        // on the device before the first launch); this reads the device.
        unsafe { sys::cuCtxGetDevice(&mut dev) }.result().map_err(|e| format!("no CUDA context: {e:?}"))?;
        let cap = |a| unsafe { result::device::get_attribute(dev, a) }.map_err(|e| format!("{e:?}"));
        let major = cap(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = cap(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let image = CString::new(compile(major, minor)?).map_err(|e| e.to_string())?;
        // SAFETY: image is NUL-terminated PTX text; the module lives for the
        // process (kept in the static).
        let module = unsafe { result::module::load_data(image.as_ptr() as *const c_void) }.map_err(|e| format!("{e:?}"))?;
        let get = |name: &str| {
            // SAFETY: module is loaded; the name is NUL-terminated.
            unsafe { result::module::get_function(module, CString::new(name).expect("no NUL")) }.map_err(|e| format!("{name}: {e:?}"))
        };
        let sms = cap(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let ce_bf16 = get("ce_bf16")?;
        // The fused cross-entropy keeps a row of logits in shared memory:
        // as much as a block may opt into (a row of 50,304 bf16 logits
        // takes 98 KiB; Hopper allows 227 KiB).
        let optin = cap(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let static_smem = 32 * 4;
        let ce_smem = optin - static_smem;
        // SAFETY: ce_bf16 is a function of the loaded module.
        unsafe {
            result::function::set_function_attribute(
                ce_bf16,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                ce_smem,
            )
        }
        .map_err(|e| format!("ce_bf16 shared memory: {e:?}"))?;
        Ok(Loaded {
            _module: module,
            ce_bf16,
            ce_smem,
            add_ln_fwd: [get("add_ln_fwd")?, get("add_ln_fwd_f32")?],
            add_ln_fwd_warp: [get("add_ln_fwd_warp")?, get("add_ln_fwd_warp_f32")?],
            add_ln_bwd: [get("add_ln_bwd")?, get("add_ln_bwd_f32")?],
            add_ln_bwd_warp: {
                let mut fs = [[(std::ptr::null_mut(), 0); 8]; 2];
                for (prefix, set) in ["add_ln_bwd_warp", "add_ln_bwd_warp_f32_"].iter().zip(fs.iter_mut()) {
                    for (i, f) in set.iter_mut().enumerate() {
                        let func = get(&format!("{prefix}{}", i + 1))?;
                        let smem = ln_bwd_warp_smem(128 * (i as i64 + 1));
                        // SAFETY: func is a function of the loaded module.
                        let per_sm =
                            unsafe { result::occupancy::max_active_block_per_multiprocessor(func, LN_BWD_THREADS as i32, smem as usize) }
                                .map_err(|e| format!("{prefix} occupancy: {e:?}"))?;
                        *f = (func, per_sm.max(1) as u32);
                    }
                }
                fs
            },
            bias_gelu_fwd: get("bias_gelu_fwd")?,
            bias_gelu_bwd: get("bias_gelu_bwd")?,
            cast_bf16: get("cast_bf16")?,
            add_partials: get("add_partials")?,
            col_sums_bf16: get("col_sums_bf16")?,
            relu_bwd: get("relu_bwd")?,
            pack_qkv: get("pack_qkv")?,
            embed_fwd: get("embed_fwd")?,
            embed_bwd: get("embed_bwd")?,
            adamw: get("adamw")?,
            adamw_steps: get("adamw_steps")?,
            cast_list: get("cast_list")?,
            sms,
            major,
            stamp: get("stamp")?,
            spin_until: get("spin_until")?,
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Compiles the kernels to PTX for a compute capability (NVRTC needs no GPU).
fn compile(major: i32, minor: i32) -> Result<String, String> {
    let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
    let options = vec![format!("-DADAM_MAX={ADAM_MAX}"), format!("-DADAM_CHUNK={ADAM_CHUNK}"), format!("-DCAST_CHUNK={CAST_CHUNK}")];
    let opts = cudarc::nvrtc::CompileOptions { arch: Some(arch), options, ..Default::default() };
    let ptx = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts))
        .map_err(|_| "libnvrtc could not be loaded".to_owned())?
        .map_err(|e| format!("NVRTC: {e:?}"))?;
    Ok(ptx.to_src())
}

/// Why the fused kernels cannot be used, if they cannot.
pub fn unavailable_reason() -> Option<String> {
    loaded().err()
}

/// Whether the fused kernels can be used (CUDA present and NVRTC works).
pub fn available() -> bool {
    loaded().is_ok()
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
    let k = loaded().map_err(|e| anyhow::anyhow!("fused kernels unavailable: {e}"))?;
    let (n, v) = logits.size2()?;
    anyhow::ensure!(logits.kind() == Kind::BFloat16 && logits.device().is_cuda(), "fused cross-entropy takes bf16 CUDA logits");
    let logits = logits.contiguous();
    let target = target.to_kind(Kind::Int64).contiguous();
    anyhow::ensure!(target.size() == [n], "targets must be [{n}]");
    let grad = if in_place { logits.shallow_clone() } else { logits.empty_like() };
    let rows = Tensor::empty([n], (Kind::Float, logits.device()));
    let scale_t = scale.map(|s| s.to_kind(Kind::Float).contiguous());
    let mut p_logits = logits.data_ptr();
    let mut p_target = target.data_ptr();
    let mut p_grad = grad.data_ptr();
    let mut p_rows = rows.data_ptr();
    let mut v_i32 = i32::try_from(v)?;
    let mut p_scale = scale_t.as_ref().map_or(std::ptr::null_mut(), |s| s.data_ptr());
    // The kernel writes (softmax - onehot) * factor: the gradient of the
    // rows' sum. The loss is their mean, so its gradient carries 1/n.
    let mut factor = factor / n as f32;
    // The row in shared memory where it fits (else read from memory again).
    let row_bytes = 2 * v;
    let mut cached = i32::from(v % 8 == 0 && row_bytes <= k.ce_smem as i64);
    let mut params: [*mut c_void; 8] = [
        &mut p_logits as *mut _ as *mut c_void,
        &mut p_target as *mut _ as *mut c_void,
        &mut p_grad as *mut _ as *mut c_void,
        &mut p_rows as *mut _ as *mut c_void,
        &mut v_i32 as *mut _ as *mut c_void,
        &mut p_scale as *mut _ as *mut c_void,
        &mut factor as *mut _ as *mut c_void,
        &mut cached as *mut _ as *mut c_void,
    ];
    let grid = u32::try_from(n)?;
    let smem = if cached != 0 { row_bytes as u32 } else { 0 };
    // SAFETY: the parameters match ce_bf16's signature (four device
    // pointers to tensors of the checked shapes and kinds, an int, a device
    // pointer or null, a float, an int); the dynamic shared memory is within
    // what the function was allowed at load and holds the row when
    // `cached`. All tensors stay alive until the function
    // returns and libtorch's caching allocator keeps their memory from reuse
    // until work queued after the launch on the same (libtorch's current)
    // stream has run. The launch goes to that same stream.
    unsafe { result::launch_kernel(k.ce_bf16, (grid, 1, 1), (512, 1, 1), smem, stream()?, &mut params) }?;
    Ok((rows.mean(Kind::Float), grad))
}

/// The stream every launch goes to: libtorch's current one, the legacy
/// default stream where harness runs, or a CUDA graph's capture stream
/// while the training step is captured (on the capturing thread, and on
/// the autograd thread running the captured backward pass).
fn stream() -> anyhow::Result<sys::CUstream> {
    Ok(crate::torch_ext::current_cuda_stream()? as sys::CUstream)
}

/// A device pointer argument: the tensor's data, or null for none.
fn ptr(t: Option<&Tensor>) -> *mut c_void {
    t.map_or(std::ptr::null_mut(), |t| t.data_ptr())
}

/// Launches `f` on libtorch's current stream with `args`, the kernel's
/// parameters in order.
///
/// # Safety
/// `args` must match the kernel's signature in number, order and types;
/// every device pointer among them must stay valid until work queued after
/// the launch on the same stream has run (libtorch's caching allocator keeps
/// a freed tensor's memory from reuse by later work on that stream).
unsafe fn launch(f: sys::CUfunction, grid: u32, block: u32, args: &mut [&mut dyn std::any::Any]) -> anyhow::Result<()> {
    // SAFETY: per the function's contract.
    unsafe { launch2(f, (grid, 1, 1), (block, 1, 1), args) }
}

/// Whether [`add_layer_norm`] takes rows of `c` channels.
pub fn layer_norm_fits(c: i64) -> bool {
    c % 4 == 0 && (4..=4096).contains(&c)
}

/// Whether [`add_layer_norm`] takes a warp per row of up to 1024 channels.
fn ln_warp() -> bool {
    crate::switches::get().ln_warp
}

/// Threads per block of the warp-per-row LayerNorm backward.
const LN_BWD_THREADS: u32 = 128;

/// Its shared memory per block for rows of `c` channels: a [3, c] fp32 set
/// per warp (48 KiB, the default limit, at 1024 channels).
fn ln_bwd_warp_smem(c: i64) -> u32 {
    (LN_BWD_THREADS / 32) * 3 * c as u32 * 4
}

/// Whether [`add_layer_norm_backward`] takes a warp per row of 128, 256,
/// .. 1024 channels (`HARNESS_LN_BWD_WARP=0` keeps a block per row).
fn ln_bwd_warp() -> bool {
    crate::switches::get().ln_bwd_warp
}

/// Which of the LayerNorm kernels serve an output (and gradient) of
/// `kind`: bf16 (0) or fp32 (1).
fn ln_index(kind: Kind) -> anyhow::Result<usize> {
    match kind {
        Kind::BFloat16 => Ok(0),
        Kind::Float => Ok(1),
        k => anyhow::bail!("fused LayerNorm writes bf16 or fp32 rows, not {k:?}"),
    }
}

/// Threads per block for rows of `c` channels (four per thread), and blocks.
fn ln_shape(k: &Loaded, n: i64, c: i64) -> (u32, u32) {
    let threads = quad_threads(c);
    let per_sm = (2048 / threads).clamp(1, 16);
    (threads, (k.sms * per_sm).min(n.max(1) as u32))
}

/// The forward pass of a residual add and LayerNorm over the last dimension
/// (eps `eps`) of fp32 CUDA rows `x` `[n, c]` ([`layer_norm_fits`]), with
/// `f` (bf16, same shape) and its bias `fb` (fp32 `[c]`) added first when
/// given: returns `x + f + fb` (fp32; only with `f`), the normalised rows in
/// `y_kind` (bf16 for a matmul, or fp32 for a post-norm residual stream),
/// and each row's mean and 1/std (fp32 `[n]`) for
/// [`add_layer_norm_backward`].
pub fn add_layer_norm(
    x: &Tensor,
    f: Option<&Tensor>,
    fb: Option<&Tensor>,
    w: &Tensor,
    b: &Tensor,
    eps: f32,
    y_kind: Kind,
) -> anyhow::Result<(Option<Tensor>, Tensor, Tensor, Tensor)> {
    let k = loaded().map_err(|e| anyhow::anyhow!("fused kernels unavailable: {e}"))?;
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
        w.kind() == Kind::Float && b.kind() == Kind::Float && w.size() == [c] && b.size() == [c],
        "LayerNorm parameters must be fp32 [{c}]"
    );
    anyhow::ensure!(
        fb.is_none_or(|fb| f.is_some() && fb.kind() == Kind::Float && fb.size() == [c]),
        "the branch's bias must be fp32 [{c}], with a branch"
    );
    let out = ln_index(y_kind)?;
    let xo = f.map(|_| x.empty_like());
    let y = Tensor::empty([n, c], (y_kind, x.device()));
    let mean = Tensor::empty([n], (Kind::Float, x.device()));
    let rstd = mean.empty_like();
    // Rows of up to 1024 channels: a warp per row (HARNESS_LN_WARP=0 keeps
    // the block per row, a diagnostic).
    let (f_ln, (threads, blocks)) = if c <= 1024 && ln_warp() {
        (k.add_ln_fwd_warp[out], (256, (n.max(1) as u64).div_ceil(8).min(u64::from(k.sms) * 8) as u32))
    } else {
        (k.add_ln_fwd[out], ln_shape(k, n, c))
    };
    let (n32, c32) = (i32::try_from(n)?, i32::try_from(c)?);
    // SAFETY: the arguments follow add_ln_fwd's signature, which
    // add_ln_fwd_warp shares (device pointers to tensors of the checked
    // shapes, kinds and contiguity, or null for the absent residual, then
    // N, C, eps); every tensor outlives the call.
    unsafe {
        launch(
            f_ln,
            blocks,
            threads,
            &mut [
                &mut x.data_ptr(),
                &mut ptr(f),
                &mut ptr(fb),
                &mut w.data_ptr(),
                &mut b.data_ptr(),
                &mut ptr(xo.as_ref()),
                &mut y.data_ptr(),
                &mut mean.data_ptr(),
                &mut rstd.data_ptr(),
                &mut { n32 },
                &mut { c32 },
                &mut { eps },
            ],
        )?;
    }
    Ok((xo, y, mean, rstd))
}

/// The backward pass of [`add_layer_norm`]: from `dy` (the normalised rows'
/// gradient: fp32 for fp32 rows, else taken as bf16), the LayerNorm's input
/// `x`, the kept `mean` and `rstd`,
/// and `dres` (fp32, the gradient reaching `x + f` from elsewhere, if any),
/// returns dx (fp32; also `f`'s gradient when cast to bf16), `f`'s gradient
/// (bf16, with `want_df`), and the partial sums of dw, db and the branch
/// bias's gradient (the sum of dx over rows), each fp32 `[c]` once summed.
pub fn add_layer_norm_backward(
    dy: &Tensor,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    w: &Tensor,
    dres: Option<&Tensor>,
    want_df: bool,
) -> anyhow::Result<(Tensor, Option<Tensor>, Partials)> {
    let k = loaded().map_err(|e| anyhow::anyhow!("fused kernels unavailable: {e}"))?;
    let (n, c) = x.size2()?;
    let dy = if dy.kind() == Kind::Float { dy.contiguous() } else { dy.to_kind(Kind::BFloat16).contiguous() };
    let out = ln_index(dy.kind())?;
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
    let (f, blocks, threads, smem) = match warp {
        Some((f, per_sm)) => {
            let blocks = (k.sms * per_sm).min((n.max(1) as u32).div_ceil(LN_BWD_THREADS / 32));
            (f, blocks, LN_BWD_THREADS, ln_bwd_warp_smem(c))
        }
        None => {
            let (threads, blocks) = ln_shape(k, n, c);
            (k.add_ln_bwd[out], blocks, threads, 0)
        }
    };
    let part = Tensor::empty([blocks as i64, 3, c], (Kind::Float, x.device()));
    let (n32, c32) = (i32::try_from(n)?, i32::try_from(c)?);
    let mut params: [&mut dyn std::any::Any; 11] = [
        &mut dy.data_ptr(),
        &mut x.data_ptr(),
        &mut mean.data_ptr(),
        &mut rstd.data_ptr(),
        &mut w.data_ptr(),
        &mut ptr(dres.as_ref()),
        &mut dx.data_ptr(),
        &mut ptr(df.as_ref()),
        &mut part.data_ptr(),
        &mut { n32 },
        &mut { c32 },
    ];
    // SAFETY: the arguments follow add_ln_bwd's signature, which the warp
    // kernels share (device pointers to tensors of the checked shapes and
    // kinds, null for the absent dres and df, then N, C); the partial sums
    // have 3 rows per block; a warp kernel's shared memory holds a [3, C]
    // fp32 set per warp.
    unsafe { launch_smem(f, (blocks, 1, 1), (threads, 1, 1), smem, &mut params)? };
    Ok((dx, df, Partials(part)))
}

/// Whether [`bias_gelu`] takes rows of `c` channels.
pub fn gelu_fits(c: i64) -> bool {
    c % 8 == 0 && c >= 8
}

/// Grid for the bias + GELU kernels: 128 threads of 8 channels per block
/// across, blocks striding over rows down.
fn gelu_shape(k: &Loaded, n: i64, c: i64) -> ((u32, u32, u32), u32) {
    rows_of_8_shape(k, n, c, 16)
}

/// Grid for kernels with 128 threads of 8 channels per block across and
/// blocks striding over rows down: `per_sm` blocks per SM in all.
fn rows_of_8_shape(k: &Loaded, n: i64, c: i64, per_sm: u32) -> ((u32, u32, u32), u32) {
    let threads = 128u32;
    let across = ((c / 8) as u32).div_ceil(threads);
    let down = ((k.sms * per_sm) / across).max(1).min(n.max(1) as u32);
    ((down, across, 1), threads)
}

/// Launches a kernel on a grid and blocks of up to 3 dimensions (see
/// [`launch`]).
///
/// # Safety
/// As for [`launch`].
unsafe fn launch2(
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    args: &mut [&mut dyn std::any::Any],
) -> anyhow::Result<()> {
    // SAFETY: per the function's contract.
    unsafe { launch_smem(f, grid, block, 0, args) }
}

/// [`launch2`] with `smem` bytes of dynamic shared memory per block.
///
/// # Safety
/// As for [`launch`]; the kernel takes at most `smem` bytes of dynamic
/// shared memory (within the device's default limit per block).
unsafe fn launch_smem(
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    smem: u32,
    args: &mut [&mut dyn std::any::Any],
) -> anyhow::Result<()> {
    let mut params: Vec<*mut c_void> = args.iter_mut().map(|a| (&mut **a) as *mut dyn std::any::Any as *mut c_void).collect();
    let stream = stream()?;
    if !dependent_launches() {
        // SAFETY: per the function's contract; each parameter points at a
        // live local of the caller for the duration of the call.
        unsafe { result::launch_kernel(f, grid, block, smem, stream, &mut params) }?;
        return Ok(());
    }
    // SAFETY: zeroed launch attributes are plain data; the one used is set.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: smem,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: as above; the kernel waits for the one before it (PDL_WAIT at
    // its start, which every kernel launched here has); config and attr
    // outlive the call.
    unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }.result()?;
    Ok(())
}

/// Whether [`launch_smem`] lets a kernel launch before the one ahead of it
/// on the stream has finished (programmatic dependent launch: the GPU sets
/// it up meanwhile, and its PDL_WAIT holds it until that kernel's writes
/// are visible): on sm_90 and later, unless `HARNESS_PDL=0` (a diagnostic).
fn dependent_launches() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| loaded().is_ok_and(|k| k.major >= 9) && crate::switches::get().pdl)
}

/// `gelu(x + b)` (tanh approximation) of contiguous bf16 CUDA rows `x`
/// `[n, c]` ([`gelu_fits`]) and an fp32 bias `[c]`, as bf16.
pub fn bias_gelu(x: &Tensor, b: &Tensor) -> anyhow::Result<Tensor> {
    let k = loaded().map_err(|e| anyhow::anyhow!("fused kernels unavailable: {e}"))?;
    let (n, c) = x.size2()?;
    anyhow::ensure!(
        gelu_fits(c) && x.kind() == Kind::BFloat16 && x.device().is_cuda() && x.is_contiguous(),
        "fused GELU takes contiguous bf16 CUDA rows"
    );
    anyhow::ensure!(b.kind() == Kind::Float && b.size() == [c] && b.is_contiguous(), "the bias must be fp32 [{c}]");
    let y = x.empty_like();
    let (grid, threads) = gelu_shape(k, n, c);
    let (n32, c32) = (i32::try_from(n)?, i32::try_from(c)?);
    // SAFETY: the arguments follow bias_gelu_fwd's signature (device
    // pointers to tensors of the checked shapes and kinds, then N, C).
    unsafe {
        launch2(
            k.bias_gelu_fwd,
            grid,
            (threads, 1, 1),
            &mut [&mut x.data_ptr(), &mut b.data_ptr(), &mut y.data_ptr(), &mut { n32 }, &mut { c32 }],
        )?
    };
    Ok(y)
}

/// The backward pass of [`bias_gelu`]: from `dy` and the kept `x` and `b`,
/// returns dx (bf16; also the pre-bias input's gradient) and the partial
/// sums of db (fp32 `[c]` once summed).
pub fn bias_gelu_backward(dy: &Tensor, x: &Tensor, b: &Tensor) -> anyhow::Result<(Tensor, Partials)> {
    let k = loaded().map_err(|e| anyhow::anyhow!("fused kernels unavailable: {e}"))?;
    let (n, c) = x.size2()?;
    let dy = dy.to_kind(Kind::BFloat16).contiguous();
    anyhow::ensure!(dy.size() == [n, c] && gelu_fits(c) && x.is_contiguous(), "fused GELU backward: bad shapes");
    let dx = x.empty_like();
    let (grid, threads) = gelu_shape(k, n, c);
    let part = Tensor::empty([grid.0 as i64, 1, c], (Kind::Float, x.device()));
    let (n32, c32) = (i32::try_from(n)?, i32::try_from(c)?);
    // SAFETY: the arguments follow bias_gelu_bwd's signature; the partial
    // sums have one row per block row of the grid.
    unsafe {
        launch2(
            k.bias_gelu_bwd,
            grid,
            (threads, 1, 1),
            &mut [&mut dy.data_ptr(), &mut x.data_ptr(), &mut b.data_ptr(), &mut dx.data_ptr(), &mut part.data_ptr(), &mut { n32 }, &mut {
                c32
            }],
        )?
    };
    Ok((dx, Partials(part)))
}

/// `q`, `k` and `v` (contiguous bf16 CUDA rows `[n, c]`, `c % 8 == 0`,
/// 16-byte aligned) side by side as `[n, 3c]`, and the partial sums over
/// its rows (the `[3c]` bias gradient of the projection they came from),
/// in one pass: a fused q, k, v projection's gradient.
pub fn pack_qkv(q: &Tensor, k: &Tensor, v: &Tensor) -> anyhow::Result<(Tensor, Partials)> {
    let kl = loaded().map_err(|e| anyhow::anyhow!("fused kernels unavailable: {e}"))?;
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
    let (grid, threads) = rows_of_8_shape(kl, n, 3 * c, 8);
    let part = Tensor::empty([grid.0 as i64, 1, 3 * c], (Kind::Float, q.device()));
    let (n32, c32) = (i32::try_from(n)?, i32::try_from(c)?);
    // SAFETY: the arguments follow pack_qkv's signature (device pointers to
    // the checked parts, to qkv [n, 3c] and to partial sums of one row of
    // 3c per block row of the grid, then N, C).
    unsafe {
        launch2(
            kl.pack_qkv,
            grid,
            (threads, 1, 1),
            &mut [&mut q.data_ptr(), &mut k.data_ptr(), &mut v.data_ptr(), &mut qkv.data_ptr(), &mut part.data_ptr(), &mut { n32 }, &mut {
                c32
            }],
        )?
    };
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
    let k = loaded().map_err(|e| anyhow::anyhow!("fused kernels unavailable: {e}"))?;
    let (n, c) = x.size2()?;
    for t in std::iter::once(x).chain(m) {
        anyhow::ensure!(
            c % 8 == 0 && t.size() == [n, c] && t.kind() == Kind::BFloat16 && t.device().is_cuda() && t.is_contiguous(),
            "column sums take contiguous bf16 CUDA rows [{n}, {c}] of a multiple of 8"
        );
    }
    let (grid, threads) = rows_of_8_shape(k, n, c, 8);
    let part = Tensor::empty([grid.0 as i64, 1, c], (Kind::Float, x.device()));
    let (n32, c32) = (i32::try_from(n)?, i32::try_from(c)?);
    let dx = m.map(|_| x.empty_like());
    // SAFETY: the arguments follow col_sums_bf16's signature, or with `m`
    // relu_bwd's (device pointers to the checked rows, to dx of their shape
    // and to partial sums of one row per block row of the grid, then N, C).
    unsafe {
        match (m, &dx) {
            (Some(m), Some(dx)) => launch2(
                k.relu_bwd,
                grid,
                (threads, 1, 1),
                &mut [&mut x.data_ptr(), &mut m.data_ptr(), &mut dx.data_ptr(), &mut part.data_ptr(), &mut { n32 }, &mut { c32 }],
            )?,
            _ => {
                launch2(k.col_sums_bf16, grid, (threads, 1, 1), &mut [&mut x.data_ptr(), &mut part.data_ptr(), &mut { n32 }, &mut { c32 }])?
            }
        }
    };
    Ok((dx, Partials(part)))
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
    let k = loaded().map_err(|e| anyhow::anyhow!("fused kernels unavailable: {e}"))?;
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
    // SAFETY: the arguments follow embed_fwd's signature (device pointers to
    // the checked tokens, tables and a fresh [b, t, c] output, then B, T, C,
    // V); every tensor outlives the call.
    unsafe {
        launch(
            k.embed_fwd,
            u32::try_from(t)?,
            quad_threads(c),
            &mut [
                &mut idx.data_ptr(),
                &mut wte.data_ptr(),
                &mut wpe.data_ptr(),
                &mut x.data_ptr(),
                &mut { b32 },
                &mut { t32 },
                &mut { c32 },
                &mut { v },
            ],
        )?
    };
    Ok(x)
}

/// The backward pass of [`embed`] from `dx` (`[b, t, c]`): adds each token's
/// row of `dx` into `gwte` (fp32 `[v, c]`, by atomic adds: a token that
/// occurs more than once is summed in an order that varies between runs),
/// and writes (`assign`) or adds the sum over the batch into the first `t`
/// rows of `gwpe` (fp32 `[>= t, c]`).
pub fn embed_backward(idx: &Tensor, dx: &Tensor, gwte: &Tensor, gwpe: &Tensor, assign: bool) -> anyhow::Result<()> {
    let k = loaded().map_err(|e| anyhow::anyhow!("fused kernels unavailable: {e}"))?;
    let (b, t) = idx.size2()?;
    let c = gwte.size2()?.1;
    let dx = dx.to_kind(Kind::Float).contiguous();
    // The kernel reads dx four floats at a time.
    let dx = if (dx.data_ptr() as usize) % 16 == 0 { dx } else { dx.copy() };
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
    // SAFETY: the arguments follow embed_bwd's signature (device pointers to
    // the checked tokens, dx and the two gradients, then B, T, C and the
    // flag); the tokens were checked in range by the forward pass's kernel.
    unsafe {
        launch(
            k.embed_bwd,
            u32::try_from(t)?,
            quad_threads(c),
            &mut [
                &mut idx.data_ptr(),
                &mut dx.data_ptr(),
                &mut gwte.data_ptr(),
                &mut gwpe.data_ptr(),
                &mut { b32 },
                &mut { t32 },
                &mut { c32 },
                &mut { i32::from(assign) },
            ],
        )?
    };
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
        self.reduce(&rows.iter().collect::<Vec<_>>(), true)?;
        Ok(out)
    }

    /// Adds the `i`-th sum into `into[i]` (the first `into.len()` of them;
    /// fp32 `[c]`, contiguous, e.g. a
    /// parameter's gradient buffer), every one in one launch, where libtorch
    /// takes a reduction (with a memset) and an add per vector.
    pub fn add_into(&self, into: &[&Tensor]) -> anyhow::Result<()> {
        self.reduce(into, false)
    }

    /// The sums added into `into` (`assign`: written there).
    fn reduce(&self, into: &[&Tensor], assign: bool) -> anyhow::Result<()> {
        let k = loaded().map_err(|e| anyhow::anyhow!("fused kernels unavailable: {e}"))?;
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
        let grid = ((c32 as u32).div_ceil(32), into.len() as u32, 1);
        let g = |i: usize| ptr(into.get(i).copied());
        // SAFETY: the arguments follow add_partials' signature: the partial
        // sums [blocks, k, c] (contiguous, fresh from empty()), the checked
        // fp32 [c] gradients (null beyond `into`, never read), then B, K, C
        // and the flag; all outlive the call, which goes to libtorch's
        // current stream, as the kernel that wrote the sums did.
        unsafe {
            launch2(
                k.add_partials,
                grid,
                (32, 32, 1),
                &mut [&mut self.0.data_ptr(), &mut g(0), &mut g(1), &mut g(2), &mut { b32 }, &mut { k32 }, &mut { c32 }, &mut {
                    i32::from(assign)
                }],
            )?
        };
        Ok(())
    }
}

/// Tensors per launch of the AdamW kernel (its `ADAM_MAX`, passed to NVRTC).
const ADAM_MAX: usize = 48;
/// Elements per block of the AdamW kernel (its `ADAM_CHUNK`, passed to NVRTC).
const ADAM_CHUNK: i64 = 8192;

/// The AdamW kernel's tensor list, laid out as its `AdamList`.
#[repr(C)]
struct AdamList {
    p: [*mut c_void; ADAM_MAX],
    g: [*mut c_void; ADAM_MAX],
    m: [*mut c_void; ADAM_MAX],
    v: [*mut c_void; ADAM_MAX],
    step: [*mut c_void; ADAM_MAX],
    n: [i64; ADAM_MAX],
    first_block: [i32; ADAM_MAX + 1],
    count: i32,
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
            // SAFETY: the arguments follow adamw's signature: the list (laid
            // out as AdamList, pointers to the checked fp32 CUDA tensors,
            // alive until the call returns and, through libtorch's caching
            // allocator, until the stream's later work), then a device
            // scalar or null, five doubles, two device scalars or null.
            unsafe {
                launch2(
                    k.adamw,
                    (u32::try_from(blocks)?, 1, 1),
                    (512, 1, 1),
                    &mut [
                        &mut list,
                        &mut ptr(lr_t),
                        &mut { lr },
                        &mut { beta1 },
                        &mut { beta2 },
                        &mut { weight_decay },
                        &mut { eps },
                        &mut ptr(grad_scale),
                        &mut ptr(found_inf),
                    ],
                )?
            };
        }
        // SAFETY: as above; one thread per tensor of the list.
        unsafe { launch2(k.adamw_steps, (1, 1, 1), (ADAM_MAX as u32, 1, 1), &mut [&mut list, &mut ptr(found_inf)])? };
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
    unsafe { launch(k.cast_bf16, vector_blocks(k, n), 256, &mut [&mut w.data_ptr(), &mut out.data_ptr(), &mut { n }])? };
    Ok(out)
}

/// Elements per block of the list cast (its `CAST_CHUNK`, passed to NVRTC).
const CAST_CHUNK: i64 = 16384;

/// [`cast_list`]'s argument, laid out as the kernel's `CastList`.
#[repr(C)]
struct CastList {
    w: [*mut c_void; ADAM_MAX],
    out: [*mut c_void; ADAM_MAX],
    n: [i64; ADAM_MAX],
    first_block: [i32; ADAM_MAX + 1],
    count: i32,
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
            // SAFETY: the argument follows cast_list's signature (the list
            // laid out as CastList: 16-byte aligned contiguous fp32 CUDA
            // weights and fresh bf16 tensors of their sizes, alive until
            // the stream's later work through libtorch's caching allocator).
            unsafe { launch2(k.cast_list, (u32::try_from(blocks)?, 1, 1), (256, 1, 1), &mut [&mut list])? };
        }
    }
    ws.iter().zip(outs).map(|(w, o)| o.map_or_else(|| cast_bf16(w), Ok)).collect()
}

/// Records the GPU clock into `at` (one int64 on the device), in stream order.
pub fn stamp(at: &Tensor) -> anyhow::Result<()> {
    let k = loaded().map_err(|e| anyhow::anyhow!("device kernels unavailable: {e}"))?;
    let mut p = at.data_ptr();
    let mut params: [*mut c_void; 1] = [&mut p as *mut _ as *mut c_void];
    // SAFETY: `at` is a live device tensor of at least 8 bytes; one thread
    // writes one u64; libtorch's current stream orders it.
    unsafe { result::launch_kernel(k.stamp, (1, 1, 1), (1, 1, 1), 0, stream()?, &mut params) }?;
    Ok(())
}

/// Holds the stream until `ns` nanoseconds after the clock stored in `at`.
pub fn spin_until(at: &Tensor, ns: u64) -> anyhow::Result<()> {
    let k = loaded().map_err(|e| anyhow::anyhow!("device kernels unavailable: {e}"))?;
    let mut p = at.data_ptr();
    let mut ns = ns;
    let mut params: [*mut c_void; 2] = [&mut p as *mut _ as *mut c_void, &mut ns as *mut _ as *mut c_void];
    // SAFETY: as in `stamp`; the kernel only reads the stamp.
    unsafe { result::launch_kernel(k.spin_until, (1, 1, 1), (1, 1, 1), 0, stream()?, &mut params) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torch_ext::Lr;

    /// Skips (with a message) where no GPU is usable.
    fn cuda() -> bool {
        if crate::device::init_cuda() {
            true
        } else {
            eprintln!("skipped: no CUDA device (this test runs on the GPU machines)");
            false
        }
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
        let ptx = compile(9, 0).unwrap();
        assert!(ptx.contains(".entry ce_bf16"), "{ptx}");
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
        ] {
            assert!(ptx.contains(&format!(".entry {k}")), "{k} missing");
        }
        assert!(ptx.contains("tanh.approx.f32"), "Hopper gets the hardware tanh");
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
