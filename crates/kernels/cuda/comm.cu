// The collectives' kernels, compiled as a program of their own (not with
// the training kernels, whose PTX an edit of their program's text can move).

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
