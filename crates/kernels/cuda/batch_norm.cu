// Training-mode batch norm over channels-last bf16 activations x [M, C]
// (M = N * H * W rows, C % 8 == 0, 256 % (C / 8) == 0), with the ReLU and
// the residual add that follow it in a ResNet fused in:
// y = relu((x - mean) / sqrt(var + eps) * w + b + res). Blocks of 256
// threads: thread t owns the 8 channels of group t % G (G = C / 8) on rows
// t / G, t / G + 256 / G, ... of its block's rows. Statistics in fp32.
// With the ReLU, the forward pass also writes the ReLU's mask, one byte per
// 8 channels (bit j: y[8 i + j] > 0), which the backward pass reads instead
// of y: 1/16 of the bytes.
#define BN_THREADS 256
// Eight fp32 channels from a 16-byte aligned pointer.
__device__ __forceinline__ void ld_f8(const float* __restrict__ p, float v[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
// Per-block sums over the block's rows (rows [blockIdx.x * per, ...)) of
// v (8 channels per thread) and of v * v, or of v and v * u, reduced over
// the block's row lanes in shared memory; lane 0 of each group writes them
// to part [gridDim.x, 2, C].
__device__ __forceinline__ void bn_block_sums(float s[8], float q[8], float* __restrict__ part, int C) {
  __shared__ float sh[2 * BN_THREADS * 8];
  const int G = C / 8, g = threadIdx.x % G, lanes = BN_THREADS / G, lane = threadIdx.x / G;
  #pragma unroll
  for (int j = 0; j < 8; j++) { sh[(lane * G + g) * 8 + j] = s[j]; sh[BN_THREADS * 8 + (lane * G + g) * 8 + j] = q[j]; }
  __syncthreads();
  if (lane == 0) {
    for (int l = 1; l < lanes; l++) {
      #pragma unroll
      for (int j = 0; j < 8; j++) { s[j] += sh[(l * G + g) * 8 + j]; q[j] += sh[BN_THREADS * 8 + (l * G + g) * 8 + j]; }
    }
    float* p = part + (size_t)blockIdx.x * 2 * C + 8 * g;
    #pragma unroll
    for (int j = 0; j < 8; j++) { p[j] = s[j]; p[C + j] = q[j]; }
  }
}
// The forward statistics, stage 1: per-block sums of x - k and of its
// square over the block's `per` rows, in part [gridDim.x, 2, C] (summed by
// add_partials), k each channel's value in row 0: shifted sums, so that a
// mean far from 0 costs no precision.
extern "C" __global__ void __launch_bounds__(BN_THREADS) bn_stats(const bf16* __restrict__ x, float* __restrict__ part, int M, int C, int per) {
  PDL_WAIT();
  const int G = C / 8, g = threadIdx.x % G, lanes = BN_THREADS / G, lane = threadIdx.x / G;
  const int r0 = blockIdx.x * per, r1 = min(M, r0 + per);
  float k[8];
  ld_bf8(x + 8 * g, k);
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, q[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int r = r0 + lane; r < r1; r += lanes) {
    float v[8];
    ld_bf8(x + (size_t)r * C + 8 * g, v);
    #pragma unroll
    for (int j = 0; j < 8; j++) { const float d = v[j] - k[j]; s[j] += d; q[j] += d * d; }
  }
  bn_block_sums(s, q, part, C);
}
// Stage 2, a thread per channel, from the summed [2, C] sums: the mean and
// 1/std (biased variance) kept for the backward pass, scale = w / std and
// shift = b - mean * scale for the apply kernel, and the running statistics
// updated as torch's batch norm does (momentum, the unbiased variance).
extern "C" __global__ void bn_stats_finish(const float* __restrict__ sums, const bf16* __restrict__ x, int M, int C,
    const float* __restrict__ w, const float* __restrict__ b, float* __restrict__ mean_out, float* __restrict__ rstd_out,
    float* __restrict__ scale, float* __restrict__ shift, float* __restrict__ run_mean, float* __restrict__ run_var,
    float momentum, float eps) {
  PDL_WAIT();
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const float n = (float)M, ds = sums[c] / n;
  const float var = fmaxf(sums[C + c] / n - ds * ds, 0.f);
  const float mean = bf2f(x[c]) + ds;
  const float r = rsqrtf(var + eps);
  mean_out[c] = mean;
  rstd_out[c] = r;
  const float sc = w[c] * r;
  scale[c] = sc;
  shift[c] = b[c] - mean * sc;
  if (run_mean) {
    run_mean[c] = (1.f - momentum) * run_mean[c] + momentum * mean;
    run_var[c] = (1.f - momentum) * run_var[c] + momentum * (M > 1 ? var * n / (n - 1.f) : var);
  }
}
// The 8 bits of a ReLU mask byte for 8 values written as bf16: bit j set
// where v[j] rounded to bf16 is above 0.
__device__ __forceinline__ unsigned char bn_mask_bits(const float v[8]) {
  unsigned int bits = 0;
  #pragma unroll
  for (int j = 0; j < 8; j++) bits |= (bf2f(f2bf(v[j])) > 0.f ? 1u : 0u) << j;
  return (unsigned char)bits;
}
// 8 gradients with the ReLU's mask byte applied: d[j] where bit j is set.
__device__ __forceinline__ void bn_apply_mask(float d[8], unsigned char bits) {
  #pragma unroll
  for (int j = 0; j < 8; j++) d[j] = (bits >> j) & 1u ? d[j] : 0.f;
}
// y = x * scale + shift (+ res) (then ReLU), bf16, 8 channels per thread,
// grid-striding over the M * G groups; the ReLU where `mask` is given,
// which gets its byte per group.
extern "C" __global__ void bn_apply(const bf16* __restrict__ x, const bf16* __restrict__ res, const float* __restrict__ scale,
    const float* __restrict__ shift, bf16* __restrict__ y, unsigned char* __restrict__ mask, int M, int C) {
  PDL_WAIT();
  const int G = C / 8;
  const size_t total = (size_t)M * G;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
    const int c = 8 * (int)(i % G);
    float v[8], sc[8], sh[8];
    ld_bf8(x + 8 * i, v);
    ld_f8(scale + c, sc);
    ld_f8(shift + c, sh);
    float rv[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (res) ld_bf8(res + 8 * i, rv);
    #pragma unroll
    for (int j = 0; j < 8; j++) {
      const float o = v[j] * sc[j] + sh[j] + rv[j];
      v[j] = mask ? fmaxf(o, 0.f) : o;
    }
    st_bf8(y + 8 * i, v);
    if (mask) mask[i] = bn_mask_bits(v);
  }
}
// The backward pass, stage 1: g = dy where the ReLU's mask (if given) has
// its bit set (y > 0), else 0 (without the ReLU: dy);
// per-block sums of g and of g * xhat (xhat = (x - mean) * rstd) in part
// [gridDim.x, 2, C], summed by add_partials: db and dw.
extern "C" __global__ void __launch_bounds__(BN_THREADS) bn_bwd_sums(const bf16* __restrict__ dy, const unsigned char* __restrict__ mask,
    const bf16* __restrict__ x, const float* __restrict__ mean, const float* __restrict__ rstd, float* __restrict__ part,
    int M, int C, int per) {
  PDL_WAIT();
  const int G = C / 8, g = threadIdx.x % G, lanes = BN_THREADS / G, lane = threadIdx.x / G;
  const int r0 = blockIdx.x * per, r1 = min(M, r0 + per);
  float mu[8], rs[8];
  ld_f8(mean + 8 * g, mu);
  ld_f8(rstd + 8 * g, rs);
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, q[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int r = r0 + lane; r < r1; r += lanes) {
    const size_t at = (size_t)r * C + 8 * g;
    float d[8], xv[8];
    ld_bf8(dy + at, d);
    ld_bf8(x + at, xv);
    if (mask) bn_apply_mask(d, mask[(size_t)r * G + g]);
    #pragma unroll
    for (int j = 0; j < 8; j++) { s[j] += d[j]; q[j] += d[j] * (xv[j] - mu[j]) * rs[j]; }
  }
  bn_block_sums(s, q, part, C);
}
// Stage 2: dx = w * rstd * (g - sum(g) / M - xhat * sum(g * xhat) / M)
// (bf16), and with `dres`, the residual's gradient g (bf16). `sums` is
// [2, C]: sum(g), then sum(g * xhat).
extern "C" __global__ void bn_bwd_apply(const bf16* __restrict__ dy, const unsigned char* __restrict__ mask, const bf16* __restrict__ x,
    const float* __restrict__ mean, const float* __restrict__ rstd, const float* __restrict__ w, const float* __restrict__ sums,
    bf16* __restrict__ dx, bf16* __restrict__ dres, int M, int C) {
  PDL_WAIT();
  const int G = C / 8;
  const float inv_m = 1.f / (float)M;
  const size_t total = (size_t)M * G;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
    const int c = 8 * (int)(i % G);
    float d[8], xv[8];
    ld_bf8(dy + 8 * i, d);
    ld_bf8(x + 8 * i, xv);
    if (mask) bn_apply_mask(d, mask[i]);
    if (dres) st_bf8(dres + 8 * i, d);
    float r[8], mu[8], wv[8], sg[8], sgx[8], o[8];
    ld_f8(rstd + c, r);
    ld_f8(mean + c, mu);
    ld_f8(w + c, wv);
    ld_f8(sums + c, sg);
    ld_f8(sums + C + c, sgx);
    #pragma unroll
    for (int j = 0; j < 8; j++) o[j] = wv[j] * r[j] * (d[j] - sg[j] * inv_m - (xv[j] - mu[j]) * r[j] * (sgx[j] * inv_m));
    st_bf8(dx + 8 * i, o);
  }
}
