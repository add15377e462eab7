// g_k[c] += sum over b of part[b, k, c] for part [B, K, C] (fp32, K <= 3),
// or g_k[c] = that sum where bit k of `assign` is set: the per-block partial sums of the
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
    g[c] = ((assign >> k) & 1) ? s : g[c] + s;
  }
}
