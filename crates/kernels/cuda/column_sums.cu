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

