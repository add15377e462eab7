// Link emulation on the device timeline: stamp() records the GPU clock before
// a collective; spin_until() after it waits until `ns` have passed since that
// stamp, so the collective appears to take at least what the modelled link
// would need. One thread; nothing else runs on the stream meanwhile.
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
extern "C" __global__ void stamp(unsigned long long* at) { *at = now_ns(); }
extern "C" __global__ void spin_until(const unsigned long long* at, unsigned long long ns) {
  const unsigned long long end = *at + ns;
  while (now_ns() < end) { __nanosleep(1000); }
}
