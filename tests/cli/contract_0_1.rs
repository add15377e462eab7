//! Plugins built against contract 0.1 (before the buckets' layout of 0.2)
//! keep loading under this host and give the results they gave: every
//! committed 0.1 component, a native library of ABI version 1, and a
//! committed bundle whose 0.1.1 top-k is trained again bit for bit.

use std::path::{Path, PathBuf};

use crate::{artifact, entry, harness, losses, repo_root, results, run_ok, write};

/// Every `.wasm` file under `dir`, recursively.
fn components(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            components(&p, out);
        } else if p.extension().is_some_and(|x| x == "wasm") {
            out.push(p);
        }
    }
}

#[test]
fn every_committed_0_1_component_still_loads() {
    let mut files = Vec::new();
    components(&repo_root().join("results"), &mut files);
    components(&repo_root().join("tests/fixtures"), &mut files);
    let mut contracts = std::collections::BTreeMap::new();
    for f in &files {
        let m = harness::plugin::inspect_component(&std::fs::read(f).unwrap()).unwrap_or_else(|e| panic!("{}: {e:#}", f.display()));
        assert!(m.abi.starts_with("0.1."), "{}: contract {}", f.display(), m.abi);
        *contracts.entry((m.abi.clone(), m.kind.name())).or_insert(0) += 1;
    }
    // Components of both 0.1 patches and of every kind.
    assert!(files.len() >= 20, "{} components", files.len());
    for want in [("0.1.0", "checkpoint-policy"), ("0.1.1", "compressor"), ("0.1.1", "batch-policy"), ("0.1.1", "checkpoint-policy")] {
        assert!(contracts.keys().any(|(c, k)| (c.as_str(), *k) == want), "no {want:?} among {contracts:?}");
    }
}

#[test]
fn a_native_library_of_abi_version_1_trains_as_the_built_in_all_reduce() {
    let dir = tempfile::tempdir().unwrap();
    let lib = artifact("libabi-0-1.so");
    let out = run_ok(harness(dir.path()).args(["plugin", "inspect"]).arg(&lib));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("native ABI 1"), "{said}");
    let s = format!(
        "[suite]\nname = \"abi1\"\ndevice = \"cpu\"\nseed = 3\nworld_size = 2\nwarmup_steps = 2\n\
         [[workload]]\nname = \"mlp\"\nmodel = {{ kind = \"mlp\", preset = \"tiny\" }}\n\
         data = {{ kind = \"synthetic\", vocab = 256, branching = 4 }}\nbatch = 8\nseq_len = 16\nsteps = 10\n\
         optimizer = {{ kind = \"adamw\", lr = 1e-2, weight_decay = 0.0 }}\neval_batches = 1\n\
         [[plugin]]\nname = \"old\"\npath = \"{}\"\n\n[[strategy]]\nname = \"builtin\"\n\n[[strategy]]\nname = \"old\"\ncompressor = \"old\"\n",
        lib.display()
    );
    let suite = write(dir.path(), "s.toml", &s);
    let out_path = dir.path().join("r.json");
    run_ok(harness(dir.path()).arg("run").arg(&suite).arg("--out").arg(&out_path).arg("-q"));
    let r = results(&out_path);
    assert_eq!(entry(&r, "mlp/old/r0")["status"], "ok");
    let (a, b) = (losses(&r, "mlp/builtin/r0"), losses(&r, "mlp/old/r0"));
    assert_eq!(a.len(), 10);
    assert_eq!(a, b, "the ABI-1 library's average trains as the built-in one, bit for bit");
}

/// A committed bundle of the CPU standard suite, made with the 0.1.1 top-k
/// component it carries, trained again by this host: every evaluation of
/// its 18 entries bit for bit. (The record says "not reproduced" only
/// because this harness is another build than the bundle's.)
#[test]
fn a_committed_bundle_of_a_0_1_1_compressor_trains_again_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = repo_root().join("results/cpu/submissions/1.2/compression-topk.bundle");
    let out = harness(dir.path()).arg("reproduce").arg(&bundle).args(["--out", "repro", "-q"]).output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("18 entries and 388 evaluations compared (bit for bit on the CPU backend; largest difference 0.00e0)"), "{said}");
    let differences: Vec<&str> = said.lines().filter(|l| l.starts_with("difference: ")).collect();
    assert!(differences.len() == 1 && differences[0].contains("the harness build is"), "only the build differs: {said}");
}
