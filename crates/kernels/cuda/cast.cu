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

