//! The machine a result was measured on, as result files carry it
//! (`machine`): CPU, memory, GPUs, driver, CUDA, libtorch, NCCL, the level
//! of libtorch's CPU kernels and harness's own version. Reading it off the
//! machine is the device layer's job.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One GPU as the driver describes it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GpuInfo {
    pub index: usize,
    pub name: String,
    pub memory_bytes: u64,
    pub compute_capability: String,
}

/// The machine a result was measured on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Fingerprint {
    pub hostname: String,
    pub os: String,
    pub cpu: String,
    pub cpu_cores: usize,
    pub memory_bytes: u64,
    pub gpus: Vec<GpuInfo>,
    pub driver: Option<String>,
    /// CUDA version libtorch was built with.
    pub cuda: Option<String>,
    /// CUDA version the driver supports.
    pub cuda_driver_api: Option<String>,
    pub libtorch: Option<String>,
    pub nccl: Option<String>,
    pub harness_version: String,
    pub git_revision: String,
    /// The level libtorch's CPU kernels ran at (x86-64). Absent in files
    /// written before it was recorded, and on other architectures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_kernels: Option<CpuKernels>,
    /// The variables of [`WORK_ENV`] the run saw set: they change the
    /// measured work without being switches. Empty in files written before
    /// they were recorded.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub environment: std::collections::BTreeMap<String, String>,
}

/// Variables of the environment that change the measured work and are not
/// `HARNESS_*` switches, recorded in the fingerprint when set:
/// `CUDA_DEVICE_MAX_CONNECTIONS` (the hardware queues the GPU's streams
/// share, measured at 3% of 4-GPU scaling: docs/benchmarks.md) and the
/// CPU thread counts of libtorch's OpenMP and MKL.
pub const WORK_ENV: [&str; 3] = ["CUDA_DEVICE_MAX_CONNECTIONS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"];

/// The variables of [`WORK_ENV`] set in this process's environment.
pub fn work_env() -> std::collections::BTreeMap<String, String> {
    WORK_ENV.iter().filter_map(|k| Some(((*k).to_owned(), std::env::var(k).ok()?))).collect()
}

/// The hardware class (`[suite.hardware] class`) of the CPU standard suite:
/// x86-64 CPUs with AVX2 and FMA, whose runs hold libtorch's CPU kernels
/// to [`CPU_CLASS_PIN`] so that a rerun on any of them gives the quality
/// trajectory bit for bit (docs/rules.md, "The CPU class").
pub const CPU_CLASS: &str = "cpu";

/// The variables that hold libtorch's CPU kernels to one level on every
/// CPU of the [`CPU_CLASS`]: ATen's vectorised kernels and oneDNN's
/// (convolutions) to AVX2 with FMA, and MKL's (matrix products) to its
/// conditional numerical reproducibility mode on the `COMPATIBLE` branch,
/// the one Intel documents as giving the same results on Intel and other
/// x86-64 CPUs (its `AVX2` branch is for Intel CPUs alone: elsewhere MKL
/// silently takes its own `AUTO` one; and `MKL_ENABLE_INSTRUCTIONS` moves
/// `AVX2`'s results, not `COMPATIBLE`'s). libtorch reads them once, at its
/// first use: `harness run` of a CPU-class suite starts itself again with
/// them (docs/rules.md, "The CPU class", has the measurements).
pub const CPU_CLASS_PIN: [(&str, &str); 3] = [("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"), ("MKL_CBWR", "COMPATIBLE")];

/// The level libtorch's CPU kernels ran at in the process that trained
/// (`machine.cpu_kernels`), and what held them there.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CpuKernels {
    /// ATen's vectorised kernels, `avx512`, `avx2` or `default`, as ATen
    /// chooses them: `ATEN_CPU_CAPABILITY` where it names one of the three
    /// (ATen takes it as given), else the best the CPU has (`avx512`:
    /// AVX-512 VL, BW and DQ with FMA; `avx2`: AVX2 with FMA).
    pub aten: String,
    /// The variables of [`CPU_CLASS_PIN`] the process had, with their
    /// values; unset ones are absent.
    pub variables: BTreeMap<String, String>,
    /// Whether the CPU has AVX2 and FMA (its /proc/cpuinfo flags), which
    /// the [`CPU_CLASS`] requires.
    pub avx2_fma: bool,
}

impl CpuKernels {
    /// The kernels of a run of the [`CPU_CLASS`]: [`CPU_CLASS_PIN`], on a
    /// CPU with AVX2 and FMA.
    pub fn pinned() -> CpuKernels {
        CpuKernels {
            aten: "avx2".into(),
            variables: CPU_CLASS_PIN.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            avx2_fma: true,
        }
    }

    /// The variables as `K=V` words, in [`CPU_CLASS_PIN`]'s order, `K
    /// unset` for those the process lacked.
    fn shown(&self) -> String {
        CPU_CLASS_PIN
            .iter()
            .map(|(k, _)| self.variables.get(*k).map_or(format!("{k} unset"), |v| format!("{k}={v}")))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The pin as `K=V` words.
pub fn pin_line() -> String {
    CPU_CLASS_PIN.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
}

/// Why a run on `machine` is outside the [`CPU_CLASS`], one sentence that
/// names the fingerprint's field; None when its CPU has AVX2 and FMA and
/// libtorch's CPU kernels were held to [`CPU_CLASS_PIN`].
pub fn cpu_class_problem(machine: &Fingerprint) -> Option<String> {
    let Some(k) = &machine.cpu_kernels else {
        return Some(
            "the fingerprint records no CPU kernels (`machine.cpu_kernels`: an x86-64 CPU and a harness that holds libtorch's CPU \
             kernels to the class's level record them), so the run may have used kernels another CPU of the class lacks"
                .into(),
        );
    };
    if !k.avx2_fma {
        return Some(format!(
            "its CPU ({}) lacks AVX2 or FMA (`machine.cpu_kernels.avx2_fma` is false); the CPU class is x86-64 CPUs with both",
            machine.cpu
        ));
    }
    let pinned = CpuKernels::pinned();
    if k.variables != pinned.variables || k.aten != pinned.aten {
        return Some(format!(
            "libtorch's CPU kernels were not held to the CPU class's level (`machine.cpu_kernels`: ATen `{}`, {}; the class holds \
             them with {}), so another CPU of the class trains other bits",
            k.aten,
            k.shown(),
            pin_line()
        ));
    }
    None
}

/// Fingerprints for tests of what reads them.
#[cfg(any(test, feature = "testing"))]
pub mod testing {
    use super::*;

    /// A 2-core CPU machine without GPUs, libtorch or a real build (host `h`,
    /// harness `0` at revision `r`), its CPU kernels held to the CPU
    /// class's level.
    pub fn machine() -> Fingerprint {
        Fingerprint {
            hostname: "h".into(),
            os: "Linux".into(),
            cpu: "c".into(),
            cpu_cores: 2,
            memory_bytes: 1,
            gpus: vec![],
            driver: None,
            cuda: None,
            cuda_driver_api: None,
            libtorch: None,
            nccl: None,
            harness_version: "0".into(),
            git_revision: "r".into(),
            cpu_kernels: Some(CpuKernels::pinned()),
            environment: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(cpu_kernels: Option<CpuKernels>) -> Fingerprint {
        let mut m = testing::machine();
        m.cpu_kernels = cpu_kernels;
        m
    }

    /// Issue 60: a CPU-class bundle was rerun bit for bit only on a CPU of
    /// its own instruction set (6 evaluations differed with ATen held to
    /// AVX2), and the fingerprint did not say which kernels ran.
    #[test]
    fn only_the_pinned_kernels_on_a_cpu_with_avx2_and_fma_are_the_cpu_class() {
        assert_eq!(cpu_class_problem(&machine(Some(CpuKernels::pinned()))), None);
        let missing = cpu_class_problem(&machine(None)).unwrap();
        assert!(missing.contains("records no CPU kernels (`machine.cpu_kernels`"), "{missing}");
        let mut avx512 = CpuKernels { aten: "avx512".into(), variables: BTreeMap::new(), avx2_fma: true };
        let why = cpu_class_problem(&machine(Some(avx512.clone()))).unwrap();
        assert!(
            why.contains(
                "(`machine.cpu_kernels`: ATen `avx512`, ATEN_CPU_CAPABILITY unset, ONEDNN_MAX_CPU_ISA unset, MKL_CBWR unset; \
                 the class holds them with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=COMPATIBLE)"
            ),
            "{why}"
        );
        // One variable off (MKL on its Intel-only AVX2 branch) is enough to
        // leave the class.
        avx512.variables = CpuKernels::pinned().variables;
        avx512.variables.insert("MKL_CBWR".into(), "AVX2".into());
        avx512.aten = "avx2".into();
        assert!(cpu_class_problem(&machine(Some(avx512))).unwrap().contains("ONEDNN_MAX_CPU_ISA=AVX2, MKL_CBWR=AVX2;"));
        let old = CpuKernels { avx2_fma: false, ..CpuKernels::pinned() };
        assert!(cpu_class_problem(&machine(Some(old))).unwrap().contains("lacks AVX2 or FMA (`machine.cpu_kernels.avx2_fma` is false)"));
    }

    #[test]
    fn fingerprints_without_cpu_kernels_still_read_and_are_written_as_they_were() {
        let m = machine(None);
        let text = serde_json::to_string(&m).unwrap();
        assert!(!text.contains("cpu_kernels"), "{text}");
        assert_eq!(serde_json::from_str::<Fingerprint>(&text).unwrap(), m);
        let pinned = machine(Some(CpuKernels::pinned()));
        assert_eq!(serde_json::from_str::<Fingerprint>(&serde_json::to_string(&pinned).unwrap()).unwrap(), pinned);
    }
}
