// The replica check's fingerprint of a tensor's bytes (train::replicas), the
// same number the shim's ATen path (hx_param_hashes) computes, in one kernel
// per tensor instead of a few per chunk: words of `width` bytes, sign
// extended to int64; the word at row r, column c of rows of 1024 words
// weighs row[r] * col[c], the odd splitmix64 weights of seeds 2 and 1; all
// summed modulo 2^64. Integer sums wrap the same in any order, so the atomic
// adds give the same bits on every run. Blocks of 256 threads; thread t
// weighs columns t, t + 256, t + 512 and t + 768 of the rows of its block.
__device__ __forceinline__ unsigned long long hash_weight(unsigned long long seed, unsigned long long k) {
  unsigned long long z = seed + (k + 1ull) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (z ^ (z >> 31)) | 1ull;
}
__device__ __forceinline__ long long hash_word(const void* data, long long j, int width) {
  if (width == 8) return ((const long long*)data)[j];
  if (width == 4) return ((const int*)data)[j];
  if (width == 2) return ((const short*)data)[j];
  return ((const signed char*)data)[j];
}
extern "C" __global__ void word_hash(const void* data, long long n, int width, unsigned long long* out) {
  unsigned long long col[4];
  for (int k = 0; k < 4; k++) col[k] = hash_weight(1ull, threadIdx.x + 256u * k);
  unsigned long long acc = 0;
  const long long rows = (n + 1023) / 1024;
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    unsigned long long sum = 0;
    for (int k = 0; k < 4; k++) {
      const long long j = r * 1024 + threadIdx.x + 256 * k;
      if (j < n) sum += (unsigned long long)hash_word(data, j, width) * col[k];
    }
    acc += sum * hash_weight(2ull, (unsigned long long)r);
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}
