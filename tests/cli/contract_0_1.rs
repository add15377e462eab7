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

/// The committed bundles of the CPU standard suite, made with the 0.1.1
/// components they carry (a top-k, a batch policy, a checkpoint policy),
/// trained again by this host on their own suite, cut to one repeat (and
/// the compression track to its first workload, which the bundle ran first
/// with the same seeds): every training and evaluation loss as the bundle
/// recorded it, bit for bit. (`harness reproduce` retrains whole bundles;
/// it calls this host another build than the bundles', so it is not what
/// this test runs.)
#[test]
fn the_committed_bundles_of_0_1_1_plugins_train_again_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let mut compared = 0;
    for name in ["compression-topk", "batch-size-memory-growth", "checkpointing-every-n"] {
        let bundle = repo_root().join(format!("results/cpu/submissions/1.2/{name}.bundle"));
        let json = |f: &str| -> serde_json::Value { serde_json::from_slice(&std::fs::read(bundle.join(f)).unwrap()).unwrap() };
        let (manifest, claimed) = (json("MANIFEST.json"), json("result.json"));
        let track = manifest["tracks"][0].as_str().unwrap();
        let plugin = &manifest["plugins"][0];
        let suite = std::fs::read_to_string(bundle.join("suite.toml")).unwrap().replace("\nrepeats = 3\n", "\nrepeats = 1\n");
        let suite = suite.replacen(
            "name = \"compression\"\ndescription = \"Gradient compression over the ranks' own in-process link\"\nkind = \"compressor\"\nworkloads = [\"gpt-tiny\", \"resnet-tiny\", \"t5-tiny\"]",
            "name = \"compression\"\ndescription = \"Gradient compression over the ranks' own in-process link\"\nkind = \"compressor\"\nworkloads = [\"gpt-tiny\"]",
            1,
        );
        assert!(suite.contains("repeats = 1"), "{name}: the suite has no `repeats = 3` line to cut");
        let s = write(dir.path(), &format!("{name}.toml"), &suite);
        let out_path = dir.path().join(format!("{name}.json"));
        let mut run = harness(dir.path());
        run.arg("run").arg(&s).args(["--track", track, "-q", "--out"]).arg(&out_path);
        run.arg("--plugin").arg(format!(
            "{}={}",
            plugin["kind"].as_str().unwrap(),
            bundle.join(plugin["file"].as_str().unwrap()).display()
        ));
        let config = claimed["submission"]["entered"][0]["config"].as_str().unwrap_or("");
        for line in config.lines().filter(|l| !l.trim().is_empty()) {
            run.arg("--plugin-config").arg(line.replace(' ', ""));
        }
        run_ok(&mut run);
        let again = results(&out_path);
        let entries = again["entries"].as_array().unwrap();
        assert!(entries.len() >= 2, "{name}: {} entries", entries.len());
        // (step, loss) of a curve; the curves' middle column is wall time.
        let losses_of = |e: &serde_json::Value, curve: &str| -> Vec<(u64, f64)> {
            e["metrics"][curve].as_array().unwrap().iter().map(|p| (p[0].as_u64().unwrap(), p[2].as_f64().unwrap())).collect()
        };
        for e in entries {
            let id = e["id"].as_str().unwrap();
            assert_eq!(e["status"], "ok", "{name}: {id}: {e}");
            let before = claimed["entries"].as_array().unwrap().iter().find(|b| b["id"] == id).unwrap_or_else(|| panic!("{name}: no {id}"));
            assert_eq!(e["seed"], before["seed"], "{name}: {id}");
            for curve in ["loss_curve", "eval_curve"] {
                assert_eq!(losses_of(e, curve), losses_of(before, curve), "{name}: {id}: the {curve} differs");
            }
            compared += 1;
        }
    }
    assert_eq!(compared, 6, "two entries (baseline and submission) of each bundle");
}
