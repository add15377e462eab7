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

