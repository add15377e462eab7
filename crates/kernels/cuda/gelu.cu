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

