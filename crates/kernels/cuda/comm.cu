// The averaging half of a reduce-scatter done as an all-to-all (each rank
// receives every rank's copy of its chunk, in rank order, on the copy
// engines): out[i] = scale * (in[i] + in[chunk + i] + ... + in[(n-1) chunk + i]),
// summed in rank order. Compiled as a program of its own (not with the
// training kernels, whose PTX an edit of their program's text can move).
extern "C" __global__ void mean_chunks_f32(const float* __restrict__ in, float* __restrict__ out,
                                           long long chunk, int n, float scale) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if ((chunk & 3) == 0 && (((unsigned long long)in | (unsigned long long)out) & 15) == 0) {
    const long long c4 = chunk >> 2;
    const float4* in4 = reinterpret_cast<const float4*>(in);
    float4* out4 = reinterpret_cast<float4*>(out);
    for (long long i = first; i < c4; i += stride) {
      float4 s = in4[i];
      for (int j = 1; j < n; ++j) {
        const float4 v = in4[j * c4 + i];
        s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
      }
      s.x *= scale; s.y *= scale; s.z *= scale; s.w *= scale;
      out4[i] = s;
    }
  } else {
    for (long long i = first; i < chunk; i += stride) {
      float s = in[i];
      for (int j = 1; j < n; ++j) s += in[j * chunk + i];
      out[i] = s * scale;
    }
  }
}

// x[i] *= scale: the division of a reduce-scatter's sum by the ranks, where
// the scatter sums (NCCL's symmetric kernels take the sum only).
extern "C" __global__ void scale_f32(float* x, long long n, float scale) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if ((n & 3) == 0 && ((unsigned long long)x & 15) == 0) {
    float4* x4 = reinterpret_cast<float4*>(x);
    for (long long i = first; i < (n >> 2); i += stride) {
      float4 v = x4[i];
      v.x *= scale; v.y *= scale; v.z *= scale; v.w *= scale;
      x4[i] = v;
    }
  } else {
    for (long long i = first; i < n; i += stride) x[i] *= scale;
  }
}
