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

