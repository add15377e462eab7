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

use harness_format::suite::DeviceKind;

/// Loads libtorch's CUDA library once; returns whether CUDA is usable
/// ([`harness_kernels::torch_ext::cuda_available`]).
pub fn init_cuda() -> bool {
    harness_kernels::torch_ext::cuda_available()
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

pub use harness_format::machine::{CpuKernels, Fingerprint, GpuInfo, CPU_CLASS_PIN};

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
        cpu_kernels: cpu_kernels(),
        environment: harness_format::machine::work_env(),
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
    let hardware = cpu_flags(cpuinfo).any(|f| matches!(f, "avx512_bf16" | "amx_bf16" | "bf16"));
    let aten = aten_capability.is_none_or(|v| v.trim().eq_ignore_ascii_case("avx512"));
    let onednn = onednn_max_isa.is_none_or(|v| {
        let v = v.trim().to_ascii_uppercase();
        v == "ALL" || v.contains("BF16") || v.contains("AMX")
    });
    hardware && aten && onednn
}

/// The first CPU's flags in the text of /proc/cpuinfo (`flags` on x86,
/// `Features` on Arm).
fn cpu_flags(cpuinfo: &str) -> impl Iterator<Item = &str> {
    let flags = cpuinfo.lines().find(|l| l.starts_with("flags") || l.starts_with("Features")).and_then(|l| l.split(':').nth(1));
    flags.unwrap_or_default().split_whitespace()
}

/// The level libtorch's CPU kernels run at in this process, and the
/// variables of [`CPU_CLASS_PIN`] that hold them (the fingerprint's
/// `cpu_kernels`); None off x86-64, where ATen's levels are others. Read
/// from the environment and /proc/cpuinfo, the inputs libtorch decides
/// from, since libtorch does not say which level it chose.
pub fn cpu_kernels() -> Option<CpuKernels> {
    if !cfg!(target_arch = "x86_64") {
        return None;
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let variables = CPU_CLASS_PIN
        .iter()
        .filter_map(|(k, _)| std::env::var_os(k).map(|v| ((*k).to_owned(), v.to_string_lossy().into_owned())))
        .collect();
    Some(cpu_kernels_from(&cpuinfo, variables))
}

/// [`cpu_kernels`] from the text of /proc/cpuinfo and the variables set.
/// ATen (2.11, `aten/src/ATen/native/DispatchStub.cpp`) takes
/// `ATEN_CPU_CAPABILITY` as given when it is exactly `avx512`, `avx2` or
/// `default` (other spellings are ignored with a warning), else the best
/// level the CPU has.
fn cpu_kernels_from(cpuinfo: &str, variables: std::collections::BTreeMap<String, String>) -> CpuKernels {
    let flags: std::collections::BTreeSet<&str> = cpu_flags(cpuinfo).collect();
    let has = |f: &str| flags.contains(f);
    let avx2_fma = has("avx2") && has("fma");
    let aten = match variables.get("ATEN_CPU_CAPABILITY").map(String::as_str) {
        Some(level @ ("avx512" | "avx2" | "default")) => level,
        _ if has("avx512vl") && has("avx512bw") && has("avx512dq") && has("fma") => "avx512",
        _ if avx2_fma => "avx2",
        _ => "default",
    };
    CpuKernels { aten: aten.to_owned(), variables, avx2_fma }
}

/// The variables of [`CPU_CLASS_PIN`] this process lacks, each with the
/// value it has instead (None: unset), for `harness run` of a CPU-class
/// suite to start itself again with them. Empty when it has them all, and
/// on a CPU outside the class (not x86-64 with AVX2 and FMA), which must
/// not be held to instructions it lacks (ATen would take `avx2` as given
/// and stop at the first AVX2 instruction); that run is unofficial, and
/// its fingerprint says why.
pub fn cpu_class_pin_missing() -> Vec<(&'static str, &'static str, Option<std::ffi::OsString>)> {
    let admitted = cpu_kernels().is_some_and(|k| k.avx2_fma);
    pin_missing(admitted, |k| std::env::var_os(k))
}

/// [`cpu_class_pin_missing`] for a CPU the class admits or not, and an
/// environment `var`.
fn pin_missing(
    admitted: bool,
    var: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Vec<(&'static str, &'static str, Option<std::ffi::OsString>)> {
    if !admitted {
        return Vec::new();
    }
    CPU_CLASS_PIN.iter().map(|&(k, v)| (k, v, var(k))).filter(|(_, v, had)| had.as_deref() != Some(std::ffi::OsStr::new(v))).collect()
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
    use super::{bf16_from, cpu_kernels_from, pin_missing, CpuKernels, CPU_CLASS_PIN};

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

    const SPR: &str = "processor\t: 0\nflags\t\t: fpu sse2 fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16\n";
    const EPYC: &str = "processor\t: 0\nflags\t\t: fpu sse2 fma avx2\n";
    const OLD: &str = "processor\t: 0\nflags\t\t: fpu sse2 avx\n";

    fn vars(kv: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    /// Issue 60: an AVX-512 CPU and an AVX2-only one ran different ATen
    /// kernels, and the fingerprint did not say which.
    #[test]
    fn the_kernel_level_is_atens_choice_from_the_cpu_and_the_variables() {
        let aten = |cpuinfo, kv: &[(&str, &str)]| cpu_kernels_from(cpuinfo, vars(kv)).aten;
        assert_eq!(aten(SPR, &[]), "avx512");
        assert_eq!(aten(EPYC, &[]), "avx2");
        assert_eq!(aten(OLD, &[]), "default");
        // AVX-512 without FMA, or without one of VL, BW and DQ, is not ATen's avx512.
        assert_eq!(aten("flags\t: avx2 avx512f avx512dq avx512bw avx512vl\n", &[]), "default");
        assert_eq!(aten("flags\t: fma avx2 avx512f avx512bw avx512vl\n", &[]), "avx2");
        // ATen takes an exact level as given, and ignores other spellings.
        assert_eq!(aten(SPR, &[("ATEN_CPU_CAPABILITY", "avx2")]), "avx2");
        assert_eq!(aten(SPR, &[("ATEN_CPU_CAPABILITY", "default")]), "default");
        assert_eq!(aten(EPYC, &[("ATEN_CPU_CAPABILITY", "avx512")]), "avx512");
        assert_eq!(aten(SPR, &[("ATEN_CPU_CAPABILITY", "AVX2")]), "avx512");
        assert_eq!(aten(SPR, &[("ATEN_CPU_CAPABILITY", " avx2")]), "avx512");
        // The CPU class's floor.
        assert!(cpu_kernels_from(SPR, vars(&[])).avx2_fma && cpu_kernels_from(EPYC, vars(&[])).avx2_fma);
        assert!(!cpu_kernels_from(OLD, vars(&[])).avx2_fma);
        assert!(!cpu_kernels_from("", vars(&[])).avx2_fma);
        // Held by the pin, both CPUs record the same kernels: the class's.
        for cpu in [SPR, EPYC] {
            assert_eq!(cpu_kernels_from(cpu, vars(&CPU_CLASS_PIN)), CpuKernels::pinned());
        }
    }

    #[test]
    fn the_pin_is_what_the_environment_lacks_and_nothing_on_a_cpu_outside_the_class() {
        let env = |kv: &'static [(&'static str, &'static str)]| {
            move |k: &str| kv.iter().find(|(n, _)| *n == k).map(|(_, v)| std::ffi::OsString::from(v))
        };
        assert_eq!(pin_missing(true, env(&[])), CPU_CLASS_PIN.iter().map(|&(k, v)| (k, v, None)).collect::<Vec<_>>());
        assert!(pin_missing(true, env(&CPU_CLASS_PIN)).is_empty(), "pinned already: no second start");
        let user = pin_missing(true, env(&[("ATEN_CPU_CAPABILITY", "avx512"), ("ONEDNN_MAX_CPU_ISA", "AVX2"), ("MKL_CBWR", "COMPATIBLE")]));
        assert_eq!(user, [("ATEN_CPU_CAPABILITY", "avx2", Some("avx512".into()))]);
        assert!(pin_missing(false, env(&[])).is_empty(), "a CPU without AVX2 is never told to run it");
    }
}
