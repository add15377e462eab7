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

