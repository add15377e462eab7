//! Builds `csrc/shim.cpp`: the few libtorch entry points that `tch` 0.24 does
//! not expose (autocast dtype, fused AdamW, multi-tensor gradient ops, the
//! device allocator's statistics). It compiles against the same libtorch that
//! torch-sys found, whose library folder torch-sys publishes as
//! `DEP_TCH_LIBTORCH_LIB` (its `links = "tch"`).
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=csrc/shim.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys did not report libtorch's folder; run through ./x, which sets up libtorch"),
    );
    let root = lib.parent().expect("libtorch lib folder has a parent").to_path_buf();
    let include = root.join("include");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").ok().unwrap_or_else(|| {
        // Ask the PyTorch that torch-sys used, as torch-sys itself does.
        Command::new(std::env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python".into()))
            .args(["-c", "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"])
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_owned())
            .filter(|s| s == "0" || s == "1")
            .unwrap_or_else(|| "1".into())
    });
    // The shim is compiled again only when what it is built from changed:
    // the C++ text, the ABI flag, libtorch's folder or the CUDA headers' (the
    // script may run again without that: this file edited, CUDA_HOME or
    // LIBTORCH_CXX11_ABI set again).
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let stamp = out.join("harness_shim.stamp");
    let source = std::fs::read("csrc/shim.cpp").expect("csrc/shim.cpp is readable");
    let cuda = cuda_include(&lib);
    let key = format!("{:016x} abi={abi} include={} cuda={cuda:?}", fnv1a(&source), include.display());
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(key.as_str()) && out.join("libharness_shim.a").is_file() {
        println!("cargo:rustc-link-search=native={}", out.display());
        println!("cargo:rustc-link-lib=static=harness_shim");
    } else {
        let mut build = cc::Build::new();
        if let Some(dir) = &cuda {
            build.include(dir).define("HX_CUDA", None);
        }
        build
            .cpp(true)
            .file("csrc/shim.cpp")
            .include(&include)
            .include(include.join("torch/csrc/api/include"))
            .flag("-std=c++17")
            .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
            .flag("-DGLOG_USE_GLOG_EXPORT")
            .flag_if_supported("-Wno-unused-parameter")
            .warnings(false)
            .compile("harness_shim");
        std::fs::write(&stamp, key).expect("OUT_DIR is writable");
    }
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=c10");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    if let Some(include) = &cuda {
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        // The CUDA runtime, beside its headers (a wheel's `lib`, a
        // toolkit's `lib64`), by the name libtorch_cuda links it under.
        let runtime = ["lib", "lib64"].iter().map(|l| include.with_file_name(l)).find_map(|dir| {
            let mut names: Vec<String> = std::fs::read_dir(&dir)
                .ok()?
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with("libcudart.so"))
                .collect();
            names.sort_by_key(|n| n.len());
            names.into_iter().next().map(|n| (dir, n))
        });
        match runtime {
            Some((dir, name)) => {
                println!("cargo:rustc-link-search=native={}", dir.display());
                println!("cargo:rustc-link-lib=dylib:+verbatim={name}");
            }
            None => println!("cargo:rustc-link-lib=dylib=cudart"),
        }
    }
    println!("cargo:rustc-link-lib=dylib=stdc++");
}

/// The CUDA runtime's headers, when libtorch is a CUDA build: the shim's
/// graph capture and stream lookup need them and libtorch_cuda. PyTorch's
/// wheels ship the headers in the `nvidia` packages beside `torch`
/// (`nvidia/cu13/include`, `nvidia/cuda_runtime/include`); a CUDA toolkit's
/// are found through CUDA_HOME. None: a CPU-only libtorch, and a shim whose
/// CUDA entry points say so.
fn cuda_include(lib: &std::path::Path) -> Option<PathBuf> {
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if !lib.join("libtorch_cuda.so").is_file() {
        return None;
    }
    let mut candidates = Vec::new();
    if let Some(site) = lib.parent().and_then(|torch| torch.parent()) {
        if let Ok(dirs) = std::fs::read_dir(site.join("nvidia")) {
            let mut found: Vec<PathBuf> = dirs.flatten().map(|d| d.path().join("include")).collect();
            found.sort();
            candidates.extend(found);
        }
    }
    if let Ok(home) = std::env::var("CUDA_HOME") {
        candidates.push(PathBuf::from(home).join("include"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates.into_iter().find(|d| d.join("cuda_runtime_api.h").is_file() && d.join("crt/host_defines.h").is_file())
}

/// FNV-1a (64 bits) of `bytes`: whether the shim's source changed.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}
