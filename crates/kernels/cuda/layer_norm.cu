// Residual add + LayerNorm over rows of C channels (C % 4 == 0), thread t of
// a block owning channels 4t..4t+3 (blockDim.x = C/4 rounded up to a warp),
// blocks striding over rows. Statistics in fp32, two-pass variance. With
// RMS (the add_rms_* kernels), RMS normalisation instead (T5's layer norm):
// no mean is subtracted (the kept mean is 0) and there is no bias (b is not
// read), y = x / sqrt(mean(x^2) + eps) * w.
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
template <typename Y, bool RMS>
__device__ __forceinline__ void ln_fwd(const float* __restrict__ x, const bf16* __restrict__ f,
    const float* __restrict__ fb, const float* __restrict__ w, const float* __restrict__ b, float* __restrict__ xo, Y* __restrict__ y,
    float* __restrict__ mean, float* __restrict__ rstd, int N, int C, float eps) {
  PDL_WAIT();
  __shared__ float sh[32];
  const int c = 4 * threadIdx.x;
  const bool on = c < C;
  float wv[4] = {0.f, 0.f, 0.f, 0.f}, bv[4] = {0.f, 0.f, 0.f, 0.f}, fbv[4] = {0.f, 0.f, 0.f, 0.f};
  if (on) {
    float4 a = *reinterpret_cast<const float4*>(w + c);
    wv[0] = a.x; wv[1] = a.y; wv[2] = a.z; wv[3] = a.w;
    if (!RMS) { float4 d = *reinterpret_cast<const float4*>(b + c); bv[0] = d.x; bv[1] = d.y; bv[2] = d.z; bv[3] = d.w; }
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
    const float m = RMS ? 0.f : block_sum(v[0] + v[1] + v[2] + v[3], sh) * inv_c;
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
extern "C" __global__ void add_ln_fwd(LN_FWD_ARGS(bf16)) { ln_fwd<bf16, false>(x, f, fb, w, b, xo, y, mean, rstd, N, C, eps); }
extern "C" __global__ void add_ln_fwd_f32(LN_FWD_ARGS(float)) { ln_fwd<float, false>(x, f, fb, w, b, xo, y, mean, rstd, N, C, eps); }
extern "C" __global__ void add_rms_fwd(LN_FWD_ARGS(bf16)) { ln_fwd<bf16, true>(x, f, fb, w, b, xo, y, mean, rstd, N, C, eps); }
// add_ln_fwd for rows of at most 1024 channels: one warp per row, lane l
// owning the float4 chunks l, l + 32, ... (all of a row's loads issued
// before its reductions, which are warp shuffles: no block-wide
// synchronisation). Same arguments and results.
template <typename Y, bool RMS>
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
    const float m = RMS ? 0.f : s * inv_c;
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
        const float4 wq = *reinterpret_cast<const float4*>(w + 4 * q);
        const float4 bq = RMS ? make_float4(0.f, 0.f, 0.f, 0.f) : *reinterpret_cast<const float4*>(b + 4 * q);
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
  ln_fwd_warp<bf16, false>(x, f, fb, w, b, xo, y, mean, rstd, N, C, eps);
}
extern "C" __global__ void __launch_bounds__(256) add_ln_fwd_warp_f32(LN_FWD_ARGS(float)) {
  ln_fwd_warp<float, false>(x, f, fb, w, b, xo, y, mean, rstd, N, C, eps);
}
extern "C" __global__ void __launch_bounds__(256) add_rms_fwd_warp(LN_FWD_ARGS(bf16)) {
  ln_fwd_warp<bf16, true>(x, f, fb, w, b, xo, y, mean, rstd, N, C, eps);
}
// The backward pass of add_ln_fwd: from dy (Y: bf16, or fp32 in the _f32
// kernels) and the LayerNorm's input x, dx = dres + d(LayerNorm)/dx (fp32;
// dres optional), df = bf16(dx) (optional), and per-block partial sums
// ([gridDim.x, 3, C] in part) of dw = sum(dy * xhat), db = sum(dy) and, for
// the branch's bias, sum(dx).
template <typename Y, bool RMS>
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
    s1 = RMS ? 0.f : block_sum(s1, sh) * inv_c;
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
extern "C" __global__ void add_ln_bwd(LN_BWD_ARGS(bf16)) { ln_bwd<bf16, false>(dy, x, mean, rstd, w, dres, dx, df, part, N, C); }
extern "C" __global__ void add_ln_bwd_f32(LN_BWD_ARGS(float)) { ln_bwd<float, false>(dy, x, mean, rstd, w, dres, dx, df, part, N, C); }
extern "C" __global__ void add_rms_bwd(LN_BWD_ARGS(bf16)) { ln_bwd<bf16, true>(dy, x, mean, rstd, w, dres, dx, df, part, N, C); }

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
template <typename Y, int NQ, bool RMS>
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
    s1 = RMS ? 0.f : s1 * inv_c;
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
    ln_bwd_warp<bf16, NQ, false>(dy, x, mean, rstd, w, dres, dx, df, part, N, C); \
  } \
  extern "C" __global__ void add_ln_bwd_warp_f32_##NQ(LN_BWD_ARGS(float)) { \
    ln_bwd_warp<float, NQ, false>(dy, x, mean, rstd, w, dres, dx, df, part, N, C); \
  } \
  extern "C" __global__ void add_rms_bwd_warp##NQ(LN_BWD_ARGS(bf16)) { \
    ln_bwd_warp<bf16, NQ, true>(dy, x, mean, rstd, w, dres, dx, df, part, N, C); \
  }
LN_BWD_WARP(1)
LN_BWD_WARP(2)
LN_BWD_WARP(3)
LN_BWD_WARP(4)
LN_BWD_WARP(5)
LN_BWD_WARP(6)
LN_BWD_WARP(7)
LN_BWD_WARP(8)

