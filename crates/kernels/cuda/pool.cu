// Max pooling over channels-last bf16 activations x [N, H, W, C] (C % 8 ==
// 0), window K x K, stride S, padding P (padded positions never win), into
// y [N, Ho, Wo, C]. The forward pass keeps, per output element, the
// window offset (kh * K + kw, one byte) of its maximum, the first one in
// row-major window order (libtorch's rule; NaN wins), instead of int64
// indices into the input: the backward pass then needs neither the input
// nor 8 bytes an output. A thread owns 8 channels of one position,
// grid-striding over the positions.
// The output's 8 channels at (n, ho, wo) and their offsets.
extern "C" __global__ void max_pool_fwd(const bf16* __restrict__ x, bf16* __restrict__ y, unsigned char* __restrict__ offsets,
    int N, int H, int W, int C, int Ho, int Wo, int K, int S, int P) {
  PDL_WAIT();
  const int G = C / 8;
  const size_t total = (size_t)N * Ho * Wo * G;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
    const int g = (int)(i % G);
    const size_t pos = i / G;
    const int wo = (int)(pos % Wo), ho = (int)(pos / Wo % Ho), n = (int)(pos / ((size_t)Wo * Ho));
    // libtorch's rule: from -inf at the window's first position inside
    // the input, a value replaces the best if greater or NaN.
    const int h0 = ho * S - P, w0 = wo * S - P;
    const unsigned char first = (unsigned char)((max(h0, 0) - h0) * K + (max(w0, 0) - w0));
    float best[8];
    unsigned char at[8];
    #pragma unroll
    for (int j = 0; j < 8; j++) { best[j] = NEG_INF; at[j] = first; }
    for (int kh = max(0, -h0); kh < K && h0 + kh < H; kh++) {
      for (int kw = max(0, -w0); kw < K && w0 + kw < W; kw++) {
        float v[8];
        ld_bf8(x + (((size_t)n * H + h0 + kh) * W + w0 + kw) * C + 8 * g, v);
        const unsigned char k = (unsigned char)(kh * K + kw);
        #pragma unroll
        for (int j = 0; j < 8; j++) {
          if (v[j] > best[j] || isnan(v[j])) { best[j] = v[j]; at[j] = k; }
        }
      }
    }
    st_bf8(y + 8 * i, best);
    unsigned int lo = 0, hi = 0;
    #pragma unroll
    for (int j = 0; j < 4; j++) { lo |= (unsigned int)at[j] << (8 * j); hi |= (unsigned int)at[4 + j] << (8 * j); }
    *reinterpret_cast<uint2*>(offsets + 8 * i) = make_uint2(lo, hi);
  }
}
// dx at (n, h, w): the sum of dy over the windows (at most ceil(K / S)^2)
// whose kept offset points at (n, h, w), in fp32, then bf16.
extern "C" __global__ void max_pool_bwd(const bf16* __restrict__ dy, const unsigned char* __restrict__ offsets, bf16* __restrict__ dx,
    int N, int H, int W, int C, int Ho, int Wo, int K, int S, int P) {
  PDL_WAIT();
  const int G = C / 8;
  const size_t total = (size_t)N * H * W * G;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
    const int g = (int)(i % G);
    const size_t pos = i / G;
    const int w = (int)(pos % W), h = (int)(pos / W % H), n = (int)(pos / ((size_t)W * H));
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    // Windows ho with ho * S - P <= h <= ho * S - P + K - 1.
    const int ho0 = max(0, (h + P - K + S) / S), ho1 = min(Ho - 1, (h + P) / S);
    const int wo0 = max(0, (w + P - K + S) / S), wo1 = min(Wo - 1, (w + P) / S);
    for (int ho = ho0; ho <= ho1; ho++) {
      const int kh = h + P - ho * S;
      for (int wo = wo0; wo <= wo1; wo++) {
        const int kw = w + P - wo * S;
        const size_t o = (((size_t)n * Ho + ho) * Wo + wo) * G + g;
        const uint2 packed = *reinterpret_cast<const uint2*>(offsets + 8 * o);
        const unsigned char k = (unsigned char)(kh * K + kw);
        float d[8];
        ld_bf8(dy + 8 * o, d);
        #pragma unroll
        for (int j = 0; j < 8; j++) {
          const unsigned int word = j < 4 ? packed.x : packed.y;
          if (((word >> (8 * (j % 4))) & 0xffu) == k) acc[j] += d[j];
        }
      }
    }
    st_bf8(dx + 8 * i, acc);
  }
}
