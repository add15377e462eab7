//! Device kernels of harness's own, compiled at run time with NVRTC (the
//! `libnvrtc` of the PyTorch installation) and launched on libtorch's stream.
//!
//! One kernel so far: fused softmax cross-entropy for bf16 logits. Autocast's
//! cross-entropy writes an fp32 copy of the logits, its log-softmax, and in the
//! backward pass three more full-size tensors: about 30 GB of memory traffic
//! per step for GPT-2 124M at 16 x 1024 tokens (vocabulary 50304). The fused
//! kernel reads each row of logits twice and writes the gradient once (about
//! 5 GB), computing the loss and its gradient in the same pass; the gradient
//! is then fed into autograd at the logits.

use std::ffi::{c_void, CString};
use std::sync::OnceLock;

use cudarc::driver::{result, sys};
use tch::{Kind, Tensor};

const SOURCE: &str = r#"
typedef unsigned short bf16;
#define NEG_INF __int_as_float(0xff800000)
__device__ __forceinline__ float bf2f(bf16 h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ bf16 f2bf(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16)(u >> 16);
}
// Merge two (max, sum of exp(x - max)) pairs.
__device__ __forceinline__ void merge(float &m, float &s, float m2, float s2) {
  if (m2 == NEG_INF) return;
  if (m == NEG_INF) { m = m2; s = s2; return; }
  if (m2 > m) { s = s * __expf(m - m2) + s2; m = m2; } else { s += s2 * __expf(m2 - m); }
}
__device__ __forceinline__ void add(float &m, float &s, float v) {
  if (v > m) { s = s * __expf(m - v) + 1.f; m = v; } else { s += __expf(v - m); }
}
// One block per row of logits [rows, V] (bf16, row-major). Writes
// grad = (softmax(x) - onehot(t)) * k, k = factor * (scale ? *scale : 1),
// and loss_rows[row] = logsumexp(x) - x[t].
extern "C" __global__ void __launch_bounds__(1024) ce_bf16(
    const bf16* __restrict__ logits, const long long* __restrict__ target,
    bf16* __restrict__ grad, float* __restrict__ loss_rows, int V,
    const float* __restrict__ scale, float factor) {
  const size_t row = blockIdx.x;
  const bf16* x = logits + row * (size_t)V;
  bf16* g = grad + row * (size_t)V;
  const bool vec = (V % 8) == 0;
  float m = NEG_INF, s = 0.f;
  if (vec) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (int i = threadIdx.x; i < V / 8; i += blockDim.x) {
      uint4 p = xv[i];
      unsigned int w[4] = {p.x, p.y, p.z, p.w};
      #pragma unroll
      for (int j = 0; j < 4; j++) { add(m, s, bf2f((bf16)(w[j] & 0xffffu))); add(m, s, bf2f((bf16)(w[j] >> 16))); }
    }
  } else {
    for (int i = threadIdx.x; i < V; i += blockDim.x) add(m, s, bf2f(x[i]));
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge(m, s, m2, s2);
  }
  __shared__ float sm[32], ss[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = (blockDim.x + 31) / 32;
  if (lane == 0) { sm[warp] = m; ss[warp] = s; }
  __syncthreads();
  if (warp == 0) {
    m = lane < nwarps ? sm[lane] : NEG_INF; s = lane < nwarps ? ss[lane] : 0.f;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
      merge(m, s, m2, s2);
    }
    if (lane == 0) { sm[0] = m; ss[0] = s; }
  }
  __syncthreads();
  const float lse = sm[0] + logf(ss[0]);
  const long long t = target[row];
  const float k = factor * (scale ? scale[0] : 1.f);
  if (vec) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* gv = reinterpret_cast<uint4*>(g);
    for (int i = threadIdx.x; i < V / 8; i += blockDim.x) {
      uint4 p = xv[i];
      unsigned int w[4] = {p.x, p.y, p.z, p.w}, o[4];
      #pragma unroll
      for (int j = 0; j < 4; j++) {
        int c = 8 * i + 2 * j;
        float lo = __expf(bf2f((bf16)(w[j] & 0xffffu)) - lse) - (c == t ? 1.f : 0.f);
        float hi = __expf(bf2f((bf16)(w[j] >> 16)) - lse) - (c + 1 == t ? 1.f : 0.f);
        o[j] = (unsigned int)f2bf(lo * k) | ((unsigned int)f2bf(hi * k) << 16);
      }
      gv[i] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  } else {
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      float d = __expf(bf2f(x[i]) - lse) - (i == t ? 1.f : 0.f);
      g[i] = f2bf(d * k);
    }
  }
  if (threadIdx.x == 0) loss_rows[row] = lse - bf2f(x[t]);
}

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
"#;

struct Loaded {
    _module: sys::CUmodule,
    ce_bf16: sys::CUfunction,
    stamp: sys::CUfunction,
    spin_until: sys::CUfunction,
}

// SAFETY: CUmodule and CUfunction are driver handles valid in every thread
// that has the (primary) context current; they are only used for launches.
unsafe impl Send for Loaded {}
unsafe impl Sync for Loaded {}

fn loaded() -> Result<&'static Loaded, String> {
    static K: OnceLock<Result<Loaded, String>> = OnceLock::new();
    K.get_or_init(|| {
        let mut dev = 0;
        // SAFETY: libtorch has initialised CUDA on this thread (a tensor is
        // on the device before the first launch); this reads the device.
        unsafe { sys::cuCtxGetDevice(&mut dev) }.result().map_err(|e| format!("no CUDA context: {e:?}"))?;
        let cap = |a| unsafe { result::device::get_attribute(dev, a) }.map_err(|e| format!("{e:?}"));
        let major = cap(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = cap(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let image = CString::new(compile(major, minor)?).map_err(|e| e.to_string())?;
        // SAFETY: image is NUL-terminated PTX text; the module lives for the
        // process (kept in the static).
        let module = unsafe { result::module::load_data(image.as_ptr() as *const c_void) }.map_err(|e| format!("{e:?}"))?;
        let get = |name: &str| {
            // SAFETY: module is loaded; the name is NUL-terminated.
            unsafe { result::module::get_function(module, CString::new(name).expect("no NUL")) }.map_err(|e| format!("{name}: {e:?}"))
        };
        Ok(Loaded { _module: module, ce_bf16: get("ce_bf16")?, stamp: get("stamp")?, spin_until: get("spin_until")? })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Compiles the kernels to PTX for a compute capability (NVRTC needs no GPU).
fn compile(major: i32, minor: i32) -> Result<String, String> {
    let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
    let opts = cudarc::nvrtc::CompileOptions { arch: Some(arch), ..Default::default() };
    let ptx = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts))
        .map_err(|_| "libnvrtc could not be loaded".to_owned())?
        .map_err(|e| format!("NVRTC: {e:?}"))?;
    Ok(ptx.to_src())
}

/// Why the fused kernels cannot be used, if they cannot.
pub fn unavailable_reason() -> Option<String> {
    loaded().err()
}

/// Whether the fused kernels can be used (CUDA present and NVRTC works).
pub fn available() -> bool {
    loaded().is_ok()
}

/// Fused cross-entropy of bf16 CUDA logits `[n, V]` against int64 targets
/// `[n]`. Returns the mean loss (fp32 scalar) and d(mean loss)/d(logits) as
/// bf16, multiplied by `factor` and, if given, by the device scalar `scale`
/// (fp16-style loss scaling). Nothing is synchronised.
pub fn cross_entropy_bf16(logits: &Tensor, target: &Tensor, factor: f32, scale: Option<&Tensor>) -> anyhow::Result<(Tensor, Tensor)> {
    let k = loaded().map_err(|e| anyhow::anyhow!("fused kernels unavailable: {e}"))?;
    let (n, v) = logits.size2()?;
    anyhow::ensure!(logits.kind() == Kind::BFloat16 && logits.device().is_cuda(), "fused cross-entropy takes bf16 CUDA logits");
    let logits = logits.contiguous();
    let target = target.to_kind(Kind::Int64).contiguous();
    anyhow::ensure!(target.size() == [n], "targets must be [{n}]");
    let grad = logits.empty_like();
    let rows = Tensor::empty([n], (Kind::Float, logits.device()));
    let scale_t = scale.map(|s| s.to_kind(Kind::Float).contiguous());
    let mut p_logits = logits.data_ptr();
    let mut p_target = target.data_ptr();
    let mut p_grad = grad.data_ptr();
    let mut p_rows = rows.data_ptr();
    let mut v_i32 = i32::try_from(v)?;
    let mut p_scale = scale_t.as_ref().map_or(std::ptr::null_mut(), |s| s.data_ptr());
    let mut factor = factor;
    let mut params: [*mut c_void; 7] = [
        &mut p_logits as *mut _ as *mut c_void,
        &mut p_target as *mut _ as *mut c_void,
        &mut p_grad as *mut _ as *mut c_void,
        &mut p_rows as *mut _ as *mut c_void,
        &mut v_i32 as *mut _ as *mut c_void,
        &mut p_scale as *mut _ as *mut c_void,
        &mut factor as *mut _ as *mut c_void,
    ];
    let grid = u32::try_from(n)?;
    // SAFETY: the parameters match ce_bf16's signature (four device
    // pointers to tensors of the checked shapes and kinds, an int, a device
    // pointer or null, a float); all tensors stay alive until the function
    // returns and libtorch's caching allocator keeps their memory from reuse
    // until work queued after the launch on the same (legacy default) stream
    // has run. The launch goes to that same stream.
    unsafe { result::launch_kernel(k.ce_bf16, (grid, 1, 1), (1024, 1, 1), 0, std::ptr::null_mut(), &mut params) }?;
    Ok((rows.mean(Kind::Float), grad))
}

/// Records the GPU clock into `at` (one int64 on the device), in stream order.
pub fn stamp(at: &Tensor) -> anyhow::Result<()> {
    let k = loaded().map_err(|e| anyhow::anyhow!("device kernels unavailable: {e}"))?;
    let mut p = at.data_ptr();
    let mut params: [*mut c_void; 1] = [&mut p as *mut _ as *mut c_void];
    // SAFETY: `at` is a live device tensor of at least 8 bytes; one thread
    // writes one u64; the legacy default stream orders it.
    unsafe { result::launch_kernel(k.stamp, (1, 1, 1), (1, 1, 1), 0, std::ptr::null_mut(), &mut params) }?;
    Ok(())
}

/// Holds the stream until `ns` nanoseconds after the clock stored in `at`.
pub fn spin_until(at: &Tensor, ns: u64) -> anyhow::Result<()> {
    let k = loaded().map_err(|e| anyhow::anyhow!("device kernels unavailable: {e}"))?;
    let mut p = at.data_ptr();
    let mut ns = ns;
    let mut params: [*mut c_void; 2] = [&mut p as *mut _ as *mut c_void, &mut ns as *mut _ as *mut c_void];
    // SAFETY: as in `stamp`; the kernel only reads the stamp.
    unsafe { result::launch_kernel(k.spin_until, (1, 1, 1), (1, 1, 1), 0, std::ptr::null_mut(), &mut params) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Skips (with a message) where no GPU is usable.
    fn cuda() -> bool {
        if crate::device::init_cuda() {
            true
        } else {
            eprintln!("skipped: no CUDA device (this test runs on the GPU machines)");
            false
        }
    }

    #[test]
    fn kernel_source_compiles_for_hopper() {
        // NVRTC runs without a GPU; the CPU test environment has libnvrtc.
        let ptx = compile(9, 0).unwrap();
        assert!(ptx.contains(".entry ce_bf16"), "{ptx}");
        assert!(ptx.contains(".entry spin_until") && ptx.contains("globaltimer"), "{ptx}");
    }

    #[test]
    fn cuda_fused_cross_entropy_matches_libtorch() {
        if !cuda() {
            return;
        }
        let dev = tch::Device::Cuda(0);
        for (n, v) in [(64, 50304), (33, 1000), (7, 77)] {
            let logits = (Tensor::randn([n, v], (Kind::Float, dev)) * 3.0).to_kind(Kind::BFloat16);
            let target = Tensor::randint(v, [n], (Kind::Int64, dev));
            let (loss, grad) = cross_entropy_bf16(&logits, &target, 1.0 / n as f32, None).unwrap();
            let x = logits.to_kind(Kind::Float).set_requires_grad(true);
            let want = x.cross_entropy_loss::<Tensor>(&target, None, tch::Reduction::Mean, -100, 0.0);
            want.backward();
            let dl = (loss.double_value(&[]) - want.double_value(&[])).abs();
            assert!(dl < 1e-4 * want.double_value(&[]).abs().max(1.0), "n={n} v={v}: loss {loss:?} vs {want:?}");
            let g = grad.to_kind(Kind::Float);
            let rel = (&g - x.grad()).norm().double_value(&[]) / x.grad().norm().double_value(&[]);
            assert!(rel < 1e-2, "n={n} v={v}: gradient relative error {rel}");
        }
    }
}
