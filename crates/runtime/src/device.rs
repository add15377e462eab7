//! Devices: bringing up CUDA through libtorch, and the machine fingerprint
//! that every result carries.
//!
//! The linker drops `libtorch_cuda.so` from the binary (`--as-needed`: no
//! symbol of it is referenced), so [`init_cuda`] loads it at start-up
//! with dlopen(RTLD_GLOBAL) (through harness-kernels'
//! `torch_ext::cuda_available`); without it libtorch sees no GPU and harness
//! runs on CPU.

use std::path::{Path, PathBuf};

use tch::Device;

use crate::suite::DeviceKind;

/// Loads libtorch's CUDA library once; returns whether CUDA is usable
/// ([`crate::torch_ext::cuda_available`]).
pub fn init_cuda() -> bool {
    crate::torch_ext::cuda_available()
}

/// Errors choosing a device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("the suite asks for `device = \"cuda\"` but no CUDA device is usable here ({why})")]
    NoCuda { why: String },
}

/// Picks the training device for a suite's setting; `local_rank` is the GPU
/// of this process (0 unless several ranks share the host).
pub fn select(kind: DeviceKind, local_rank: usize) -> Result<Device, DeviceError> {
    match kind {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Auto => Ok(if init_cuda() { Device::Cuda(local_rank) } else { Device::Cpu }),
        DeviceKind::Cuda => {
            if init_cuda() {
                Ok(Device::Cuda(local_rank))
            } else {
                let why = if libtorch_dir().map(|d| d.join("libtorch_cuda.so").exists()).unwrap_or(false) {
                    "libtorch has CUDA support but found no GPU or driver".to_owned()
                } else {
                    "this libtorch has no CUDA library".to_owned()
                };
                Err(DeviceError::NoCuda { why })
            }
        }
    }
}

/// Makes GPU `index`'s primary context current on this thread, so that
/// harness's own driver calls (events, kernels, NCCL) use the GPU that
/// libtorch trains on.
pub fn make_current(index: usize) -> anyhow::Result<()> {
    use cudarc::driver::result;
    result::init()?;
    let dev = result::device::get(index as i32)?;
    // SAFETY: dev is a valid device; the retained primary context lives for
    // the process (libtorch uses the same one), and is made current here.
    unsafe {
        let ctx = result::primary_ctx::retain(dev)?;
        result::ctx::set_current(ctx)?;
    }
    Ok(())
}

/// Whether every visible GPU can reach every other's memory directly
/// (NVLink or PCIe peer access), as NCCL's copy-engine collectives in
/// symmetric memory need; true with one GPU, false without CUDA.
pub fn peer_access_everywhere() -> bool {
    use cudarc::driver::{result, sys};
    let n = gpu_count() as i32;
    if n == 0 {
        return false;
    }
    let Ok(devs) = (0..n).map(result::device::get).collect::<Result<Vec<_>, _>>() else { return false };
    devs.iter().all(|&a| {
        devs.iter().all(|&b| {
            let mut can = 0;
            // SAFETY: `can` receives an int; a and b are valid devices.
            a == b || (unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) } == sys::CUresult::CUDA_SUCCESS && can == 1)
        })
    })
}

/// How many GPUs the driver sees (0 without CUDA).
pub fn gpu_count() -> usize {
    if !init_cuda() {
        return 0;
    }
    cudarc::driver::result::init().ok().and_then(|_| cudarc::driver::result::device::get_count().ok()).unwrap_or(0) as usize
}

pub use harness_format::machine::{Fingerprint, GpuInfo};

/// Reads the machine fingerprint (initialises CUDA if present), for a
/// harness of version `harness_version` built from `git_revision` (the
/// binary knows both).
pub fn fingerprint(harness_version: &str, git_revision: &str) -> Fingerprint {
    let cuda = init_cuda();
    let torch_dir = libtorch_dir();
    let (libtorch, cuda_build) = torch_dir.as_deref().map(torch_versions).unwrap_or((None, None));
    Fingerprint {
        hostname: hostname(),
        os: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| format!("Linux {}", s.trim()))
            .unwrap_or_else(|_| std::env::consts::OS.into()),
        cpu: cpu_model(),
        cpu_cores: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        memory_bytes: meminfo_kb("MemTotal:").unwrap_or(0) * 1024,
        gpus: if cuda { gpus() } else { Vec::new() },
        driver: std::fs::read_to_string("/proc/driver/nvidia/version").ok().and_then(|s| {
            s.lines().next().and_then(|l| {
                l.split_whitespace().find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.')).map(str::to_owned)
            })
        }),
        cuda: cuda_build,
        cuda_driver_api: if cuda { cuda_driver_version() } else { None },
        libtorch,
        nccl: nccl_version(),
        harness_version: harness_version.into(),
        git_revision: git_revision.into(),
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_owned()))
        .unwrap_or_else(|| std::env::consts::ARCH.into())
}

/// Whether libtorch gets bf16 arithmetic from this CPU: x86 with
/// AVX512-BF16 or AMX-BF16, or Arm with BF16 (the flags of
/// /proc/cpuinfo), and not held below it by `ATEN_CPU_CAPABILITY` (other
/// than `avx512`) or `ONEDNN_MAX_CPU_ISA` (an ISA without BF16 or AMX).
/// Without it libtorch emulates bf16 in fp32 and bf16 runs many times
/// slower than fp32.
pub fn cpu_has_bf16() -> bool {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let env = |k: &str| std::env::var(k).ok();
    bf16_from(&cpuinfo, env("ATEN_CPU_CAPABILITY").as_deref(), env("ONEDNN_MAX_CPU_ISA").as_deref())
}

/// [`cpu_has_bf16`] from the text of /proc/cpuinfo and the two variables.
fn bf16_from(cpuinfo: &str, aten_capability: Option<&str>, onednn_max_isa: Option<&str>) -> bool {
    let flags = cpuinfo.lines().find(|l| l.starts_with("flags") || l.starts_with("Features")).and_then(|l| l.split(':').nth(1));
    let hardware = flags.is_some_and(|f| f.split_whitespace().any(|f| matches!(f, "avx512_bf16" | "amx_bf16" | "bf16")));
    let aten = aten_capability.is_none_or(|v| v.trim().eq_ignore_ascii_case("avx512"));
    let onednn = onednn_max_isa.is_none_or(|v| {
        let v = v.trim().to_ascii_uppercase();
        v == "ALL" || v.contains("BF16") || v.contains("AMX")
    });
    hardware && aten && onednn
}

fn meminfo_kb(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    s.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse().ok()
}

/// The folder of the libtorch loaded into this process (from /proc/self/maps).
pub fn libtorch_dir() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libtorch_cpu.so"))
        .and_then(|p| Path::new(p).parent().map(Path::to_path_buf))
}

/// libtorch and CUDA versions from the PyTorch installation's version.py.
fn torch_versions(lib_dir: &Path) -> (Option<String>, Option<String>) {
    let Some(text) = lib_dir.parent().and_then(|d| std::fs::read_to_string(d.join("version.py")).ok()) else {
        return (None, None);
    };
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split('=').nth(1))
            .map(|v| v.trim().trim_matches(|c| c == '\'' || c == '"').to_owned())
            .filter(|v| v != "None")
    };
    (field("__version__"), field("cuda"))
}

fn gpus() -> Vec<GpuInfo> {
    use cudarc::driver::{result, sys};
    if result::init().is_err() {
        return Vec::new();
    }
    let n = result::device::get_count().unwrap_or(0);
    (0..n)
        .filter_map(|i| {
            let dev = result::device::get(i).ok()?;
            // SAFETY: dev is a device handle returned by get() above.
            let memory_bytes = unsafe { result::device::total_mem(dev) }.ok()? as u64;
            // SAFETY: as above, `dev` is a valid device handle; `a` is an attribute enum value.
            let attr = |a| unsafe { result::device::get_attribute(dev, a) }.ok();
            let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            Some(GpuInfo {
                index: i as usize,
                name: result::device::get_name(dev).ok()?,
                memory_bytes,
                compute_capability: format!("{major}.{minor}"),
            })
        })
        .collect()
}

fn cuda_driver_version() -> Option<String> {
    let mut v = 0;
    // SAFETY: writes one int; the driver library is loaded (CUDA is usable).
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }.result().ok()?;
    Some(format!("{}.{}", v / 1000, (v % 1000) / 10))
}

/// This machine's host name (empty where it cannot be read).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_owned()).unwrap_or_default()
}

/// NCCL's version, from the libnccl.so.2 that libtorch uses when it is loaded
/// (dlopen by soname returns that same library: two NCCLs in one process
/// fail with "corrupted comm object").
pub fn nccl_version() -> Option<String> {
    // SAFETY: loading libnccl runs no initialiser with side effects beyond
    // NCCL's own; ncclGetVersion(int*) writes one int.
    unsafe {
        let lib = libloading::Library::new("libnccl.so.2").ok()?;
        let f: libloading::Symbol<unsafe extern "C" fn(*mut i32) -> i32> = lib.get(b"ncclGetVersion").ok()?;
        let mut v = 0;
        if f(&mut v) != 0 {
            return None;
        }
        // NCCL_VERSION_CODE = major * 10000 + minor * 100 + patch since 2.9.
        Some(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
    }
}

/// Peak dense TFLOP/s of known GPUs for a precision (datasheet, without
/// sparsity): (name fragment, bf16/fp16 tensor, fp32).
pub const PEAK_TFLOPS: &[(&str, f64, f64)] = &[
    ("H200", 989.4, 66.9),
    ("H100 PCIe", 756.0, 51.2),
    ("H100", 989.4, 66.9),
    ("A100", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("RTX 4090", 165.2, 82.6),
    ("V100", 125.0, 15.7),
];

/// The peak a GPU reaches at a precision, if it is in the table.
pub fn peak_tflops(gpu_name: &str, low_precision: bool) -> Option<f64> {
    PEAK_TFLOPS.iter().find(|(n, _, _)| gpu_name.contains(n)).map(|(_, lp, fp32)| if low_precision { *lp } else { *fp32 })
}

#[cfg(test)]
mod tests {
    use super::bf16_from;

    #[test]
    fn bf16_needs_the_flag_and_no_variable_holding_libtorch_below_it() {
        let spr = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n";
        let epyc = "processor\t: 0\nflags\t\t: fpu avx2 fma\n";
        let arm = "processor\t: 0\nFeatures\t: fp asimd sve bf16\n";
        assert!(bf16_from(spr, None, None));
        assert!(bf16_from(arm, None, None));
        assert!(!bf16_from(epyc, None, None));
        assert!(!bf16_from("", None, None));
        // What emulates a CPU without it on one with it.
        assert!(!bf16_from(spr, Some("avx2"), None));
        assert!(!bf16_from(spr, None, Some("AVX2")));
        assert!(bf16_from(spr, Some("avx512"), Some("AVX512_CORE_AMX")));
        assert!(bf16_from(spr, None, Some("ALL")));
    }
}
