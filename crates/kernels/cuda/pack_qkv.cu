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

