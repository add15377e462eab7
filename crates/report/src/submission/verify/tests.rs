//! Hostile bundles: a real verified bundle, copied and forged the way a
//! submitter who wants a better rank would (the manifest's hashes always
//! recomputed), each refused with a message naming what differs.

use std::path::{Path, PathBuf};

use super::*;
use crate::metric::Metric;
use crate::test_support::copy_dir;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

use crate::test_support::inspect_as;

#[test]
fn every_bundle_in_the_repository_verifies() {
    let (mut n, mut failed) = (0, String::new());
    for class in ["cpu", "h100", "h200"] {
        for version in
            // A folder per suite version (the board's `bundles/` beside them
            // holds its copies of results and manifests, not bundles).
            std::fs::read_dir(repo().join("results").join(class).join("submissions"))
                .unwrap()
                .flatten()
                .filter(|d| d.path().is_dir() && d.file_name().to_string_lossy().chars().all(|c| c.is_ascii_digit() || c == '.'))
        {
            for b in std::fs::read_dir(version.path()).unwrap().flatten().filter(|b| super::super::is_bundle(&b.path())) {
                let r = RunResult::read(&b.path().join(RESULT)).unwrap();
                let p = &r.submission.as_ref().unwrap().entered[0];
                let kind = p.kind.clone();
                let (name, version) = (p.name.clone(), p.version.clone());
                let inspect = move |bytes: &[u8]| -> anyhow::Result<harness_format::plugin::Manifest> {
                    let mut m = inspect_as(&name, &version)(bytes)?;
                    m.kind = serde_json::from_value(serde_json::Value::String(kind.clone()))?;
                    Ok(m)
                };
                let v = verify(&b.path(), &inspect);
                if !v.verified() {
                    failed.push_str(&render(&b.path(), &v));
                }
                n += 1;
            }
        }
    }
    assert!(failed.is_empty(), "{failed}");
    assert!(n >= 20, "{n} bundles");
}

/// The bundle the forgeries start from: `topk` entered into the H100
/// compression track on 2 GPUs, verified.
const REAL: &str = "results/h100/submissions/1.2/compression-topk.bundle";
const TOPK_SHA: &str = "c4b8bc5d3ce2a2a7a4220304762a9739b1ad30729f54e98b6edb9bbc67bdbbed";
const ARTIFACT: &str = "plugins/topk-c4b8bc5d3ce2.wasm";

/// A copy of [`REAL`] in a temporary folder, to forge.
struct Forge {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
}

impl Forge {
    fn new() -> Forge {
        Forge::of(REAL)
    }

    /// A copy of the bundle `bundle` (a path in the repository).
    fn of(bundle: &str) -> Forge {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("forged.bundle");
        copy_dir(&repo().join(bundle), &dir);
        Forge { _tmp: tmp, dir }
    }

    fn json(&self, rel: &str) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.dir.join(rel)).unwrap()).unwrap()
    }

    fn edit_json(&self, rel: &str, edit: impl FnOnce(&mut serde_json::Value)) -> &Self {
        let mut v = self.json(rel);
        edit(&mut v);
        std::fs::write(self.dir.join(rel), serde_json::to_vec_pretty(&v).unwrap()).unwrap();
        self
    }

    /// Edits result.json, and machine.json to the result's fingerprint.
    fn result(&self, edit: impl FnOnce(&mut serde_json::Value)) -> &Self {
        self.edit_json(RESULT, edit);
        let machine = self.json(RESULT)["machine"].clone();
        std::fs::write(self.dir.join(MACHINE), serde_json::to_vec_pretty(&machine).unwrap()).unwrap();
        self
    }

    fn manifest(&self, edit: impl FnOnce(&mut serde_json::Value)) -> &Self {
        self.edit_json(MANIFEST, edit)
    }

    fn log(&self, edit: impl FnOnce(String) -> String) -> &Self {
        let text = std::fs::read_to_string(self.dir.join(LOG)).unwrap();
        std::fs::write(self.dir.join(LOG), edit(text)).unwrap();
        self
    }

    /// What any forger does last: the manifest's sizes and hashes made
    /// those of the files as they now are.
    fn rehash(&self) -> &Self {
        let dir = self.dir.clone();
        self.manifest(|m| {
            for f in m["files"].as_array_mut().unwrap() {
                if let Ok(bytes) = std::fs::read(dir.join(f["path"].as_str().unwrap())) {
                    f["sha256"] = sha256_hex(&bytes).into();
                    f["bytes"] = bytes.len().into();
                }
            }
        })
    }

    fn verify(&self) -> Verdict {
        verify(&self.dir, &inspect_as("topk", "0.1.0"))
    }
}

/// The submission's entries (those the entered plugin ran in).
fn submission_entries(r: &mut serde_json::Value) -> impl Iterator<Item = &mut serde_json::Value> {
    r["entries"].as_array_mut().unwrap().iter_mut().filter(|e| e["strategy"].as_str().unwrap().starts_with("submission-"))
}

/// Multiplies a JSON number in place.
fn scale(x: &mut serde_json::Value, by: f64) {
    *x = (x.as_f64().unwrap() * by).into();
}

/// Asserts that the verdict is a refusal whose reasons say each of `what`.
fn refused(v: &Verdict, what: &[&str]) -> String {
    let text = render(Path::new("forged.bundle"), v);
    assert!(!v.verified(), "a forgery verified:\n{text}");
    for w in what {
        assert!(text.contains(w), "no violation says `{w}`:\n{text}");
    }
    text
}

#[test]
fn a_copy_rewritten_and_rehashed_unchanged_still_verifies() {
    let f = Forge::new();
    f.result(|_| {}).rehash();
    let v = f.verify();
    assert!(v.verified(), "{}", render(&f.dir, &v));
}

#[test]
fn times_cut_to_a_tenth_in_the_summary_are_refused() {
    let f = Forge::new();
    f.result(|r| {
        for e in submission_entries(r) {
            let m = &mut e["metrics"];
            for k in ["time_to_target_s", "train_time_s"] {
                scale(&mut m[k], 0.1);
            }
            for k in ["mean_ms", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms"] {
                scale(&mut m["step"][k], 0.1);
            }
            for k in ["tokens_per_s", "samples_per_s", "achieved_tflops", "mfu"] {
                scale(&mut m[k], 10.0);
            }
        }
    })
    .rehash();
    refused(
        &f.verify(),
        &[
            "gpt2-124m/submission-compression/r0: the step latency summary is not the `step` histogram's it is computed from: mean_ms 5.1417673142857145 (histogram: 51.41767314285714), p50_ms 4.9217535 (histogram: 49.217535)",
            "gpt2-124m/submission-compression/r0: time to target is 0.42264671 s (step 80); worked out from the first evaluation at the target on its eval curve it is 4.2264671 s (step 80)",
            "gpt2-124m/submission-compression/r0: its step histogram holds 3.5992 s of timed steps, but tokens/s (6365054.0) puts only 0.3604 s of training after warm-up",
            "gpt2-124m/submission-compression/r0: its eval curve has step 8 at 0.51650695 s, outside its train time of 0.422810361 s",
            "gpt2-124m/submission-compression/r0: the log (line 5) says `1.1018), 636505 tokens/s` where the result gives `1.1018), 6365054 tokens/s`",
        ],
    );
}

/// Issue 60: "An `ok` entry with `"metrics": null` verifies, is skipped
/// by reproduce and drops out of the pairing (baseline repeats removed at
/// will: `2.058 (n=1)`)."
#[test]
fn an_ok_entry_without_metrics_is_refused_naming_it() {
    let f = Forge::new();
    f.result(|r| {
        for e in r["entries"].as_array_mut().unwrap() {
            if ["gpt2-124m/allreduce/r1", "gpt2-124m/allreduce/r2"].contains(&e["id"].as_str().unwrap()) {
                e["metrics"] = serde_json::Value::Null;
            }
        }
    })
    .rehash();
    refused(
        &f.verify(),
        &["violation [result]: 2 entries finished (`ok`) without metrics, so none of their figures can be checked or ranked: gpt2-124m/allreduce/r1, gpt2-124m/allreduce/r2"],
    );
}

/// Issue 60: a planned entry removed from the result (and from its plan,
/// with `complete` left true) is named, as is a repeat relabelled as
/// another or given twice.
#[test]
fn planned_entries_missing_relabelled_or_given_twice_are_refused_naming_them() {
    let f = Forge::new();
    f.result(|r| {
        let gone = |x: &serde_json::Value| x["id"] == "gpt2-124m/allreduce/r2";
        r["entries"].as_array_mut().unwrap().retain(|e| !gone(e));
        r["plan"].as_array_mut().unwrap().retain(|e| !gone(e));
    })
    .rehash();
    refused(
        &f.verify(),
        &[
            "violation [plan]: the plan lacks 1 entries of the released suite: gpt2-124m/allreduce/r2",
            "gpt2-124m/allreduce ran 2 of the 3 repeats the suite asks for",
        ],
    );

    let f = Forge::new();
    f.result(|r| {
        let entries = r["entries"].as_array_mut().unwrap();
        let r0 = entries.iter().position(|e| e["id"] == "gpt2-124m/allreduce/r0").unwrap();
        let copy = entries[r0].clone();
        entries.push(copy);
        let r1 = entries.iter_mut().find(|e| e["id"] == "gpt2-124m/allreduce/r1").unwrap();
        r1["repeat"] = 0.into();
        r1["workload"] = "resnet50".into();
    })
    .rehash();
    refused(
        &f.verify(),
        &[
            "violation [result]: entries have more than one result: gpt2-124m/allreduce/r0",
            "violation [result]: entries are labelled otherwise than their plan entry: gpt2-124m/allreduce/r1 says strategy `allreduce`, repeat 0, seed 4584914233734634; its plan entry `allreduce`, 1, 4584914233734634",
            "violation [plan]: entries are labelled with another workload: gpt2-124m/allreduce/r1 says workload `resnet50`; the suite's entry is of `gpt2-124m`",
        ],
    );
}

/// Issue 60: "the data's loss floor moved by -0.0004 everywhere
/// verifies." Moved with the target and the log's lines, as a thorough
/// forger would: the suite's data table gives the floor.
#[test]
fn a_loss_floor_moved_in_every_entry_is_refused_naming_both_values() {
    let f = Forge::new();
    f.result(|r| {
        for e in r["entries"].as_array_mut().unwrap() {
            let m = &mut e["metrics"];
            // The ResNet's target is an accuracy: it has no target loss.
            for k in ["loss_floor", "target_loss"] {
                if let Some(x) = m[k].as_f64() {
                    m[k] = (x - 0.0004).into();
                }
            }
        }
    })
    .log(|log| log.replace("floor 1.1018", "floor 1.1014").replace("floor 0.7846", "floor 0.7842"))
    .rehash();
    let (gpt, resnet) = (1.1018147496464787f64, 0.7845949584049073f64);
    refused(
        &f.verify(),
        &[
            &format!(
                "gpt2-124m/allreduce/r0: the data's loss floor is {}; worked out from the suite's `synthetic` data table it is {gpt}",
                gpt - 0.0004
            ),
            &format!(
                "resnet50/submission-compression/r2: the data's loss floor is {}; worked out from the suite's `images` data table it is {resnet}",
                resnet - 0.0004
            ),
            &format!("gpt2-124m/allreduce/r0: the target loss is Some({}); worked out from", 1.3518147496464787f64 - 0.0004),
        ],
    );
    // The best accuracy too.
    let f = Forge::new();
    f.result(|r| {
        for e in r["entries"].as_array_mut().unwrap().iter_mut().filter(|e| e["workload"] == "resnet50") {
            e["metrics"]["best_accuracy"] = 0.95.into();
        }
    })
    .log(|log| log.replace("(best 0.9000)", "(best 0.9500)"))
    .rehash();
    refused(
        &f.verify(),
        &["resnet50/allreduce/r0: the data's best accuracy is 0.95; worked out from the suite's `images` data table it is 0.9"],
    );
}

/// Issue 60: "an unknown field in result.json makes a new identity". A
/// field this harness does not know is refused, named by its path.
#[test]
fn fields_the_result_format_does_not_know_are_refused_naming_them() {
    let f = Forge::new();
    f.result(|r| {
        r["resubmitted"] = true.into();
        r["entries"][3]["metrics"]["note"] = "rerun".into();
        r["entries"][0]["metrics"]["ranks"][0]["x"] = 1.into();
    })
    .rehash();
    refused(
        &f.verify(),
        &["violation [result]: result.json has fields this harness does not know (they would be dropped unread): `entries[0].metrics.ranks[0].x`, `entries[3].metrics.note`, `resubmitted`"],
    );
}

#[test]
fn eval_timestamps_edited_to_look_consistent_are_refused() {
    // The evaluations, the time to target and the train time moved
    // earlier together: the loss curve (when each step finished) says the
    // evaluations came before the steps they follow.
    let f = Forge::new();
    let earlier = |m: &mut serde_json::Value| {
        for c in ["eval_curve", "accuracy_curve"] {
            for p in m.get_mut(c).and_then(|c| c.as_array_mut()).into_iter().flatten() {
                scale(&mut p[1], 0.8);
            }
        }
        scale(&mut m["time_to_target_s"], 0.8);
    };
    f.result(|r| submission_entries(r).for_each(|e| earlier(&mut e["metrics"]))).rehash();
    refused(
        &f.verify(),
        &["gpt2-124m/submission-compression/r0: 32 of its 32 evaluations are timed before the step they follow finished training (the loss curve's times); the first: after step 3 at 0.22275764 s, step 3 finished training at 0.278390983 s"],
    );

    // ... and with the loss curve and the train time moved too, the step
    // histogram no longer fits between them.
    let f = Forge::new();
    f.result(|r| {
        for e in submission_entries(r) {
            let m = &mut e["metrics"];
            earlier(m);
            for p in m["loss_curve"].as_array_mut().unwrap() {
                scale(&mut p[1], 0.8);
            }
            scale(&mut m["train_time_s"], 0.8);
            scale(&mut m["tokens_per_s"], 1.25);
        }
    })
    .rehash();
    refused(
        &f.verify(),
        &["gpt2-124m/submission-compression/r0: its loss curve puts 2.8798 s between the end of warm-up and its last step; its step histogram holds 3.5992 s of those steps"],
    );
}

/// The artifact replaced by `bytes`, and the manifest and the result's
/// submission record edited to match (name, version, hash, size).
fn swap_artifact(f: &Forge, bytes: &[u8], name: &str) {
    std::fs::write(f.dir.join(ARTIFACT), bytes).unwrap();
    let sha = sha256_hex(bytes);
    let (s, n) = (sha.clone(), bytes.len());
    f.result(|r| {
        let p = &mut r["submission"]["entered"][0];
        p["sha256"] = s.clone().into();
        p["bytes"] = n.into();
        p["name"] = name.into();
    });
    f.manifest(|m| {
        let p = &mut m["plugins"][0];
        p["sha256"] = sha.into();
        p["bytes"] = n.into();
        p["name"] = name.into();
    });
    f.rehash();
}

#[test]
fn another_plugins_artifact_with_manifest_and_result_to_match_is_refused() {
    let f = Forge::new();
    let mut other = COMPONENT_HEADER.to_vec();
    other.extend_from_slice(b"another plugin's component");
    swap_artifact(&f, &other, "randomk");
    let v = verify(&f.dir, &inspect_as("randomk", "0.1.0"));
    refused(
        &v,
        &[
            "entries of the submission do not record running the entered compressor `randomk` 0.1.0",
            "gpt2-124m/submission-compression/r0 ran the compressor `topk` 0.1.0 (sha256 c4b8bc5d3ce2)",
        ],
    );
}

const COMPONENT_HEADER: [u8; 8] = harness_format::plugin::COMPONENT_MAGIC;

#[test]
fn a_native_library_labelled_wasm_is_refused_and_never_loaded() {
    let f = Forge::new();
    let elf = b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0\x03\0\x3e\0 a shared library with a constructor";
    swap_artifact(&f, elf, "topk");
    // The entries' records, too, name the library's hash (a thorough forger).
    let sha = sha256_hex(elf);
    f.result(|r| {
        for e in submission_entries(r) {
            e["metrics"]["plugins"][0]["sha256"] = sha.clone().into();
        }
    })
    .rehash();
    let calls = std::cell::Cell::new(0);
    let inspect = |_: &[u8]| -> anyhow::Result<harness_format::plugin::Manifest> {
        calls.set(calls.get() + 1);
        anyhow::bail!("verify must not hand a native library to the inspector")
    };
    let v = verify(&f.dir, &inspect);
    assert_eq!(calls.get(), 0, "the inspector was called");
    refused(
        &v,
        &[
            "plugins/topk-c4b8bc5d3ce2.wasm is an ELF file: a native library (it starts with 7f 45 4c 46 02 01 01 00), not a WebAssembly component, whatever the result's transport label `wasm` says: verify loads nothing but components, and those only in the sandbox, so it was not loaded",
            "the run is unofficial: the entered plugin topk is an ELF file: a native library by its bytes (unsandboxed)",
            "the result labels the entered plugin's transport `wasm`; its bytes make it `native`",
            "gpt2-124m/submission-compression/r0 records the plugin's transport as `wasm`; its bytes make it `native`",
        ],
    );
}

#[test]
fn failed_entries_replaced_and_their_log_lines_removed_are_refused() {
    // Three entries of the submission "failed" (their lines are removed
    // from the log) and their results are another run's.
    let hidden = ["gpt2-124m/submission-compression/r0", "resnet50/submission-compression/r1", "gpt2-124m/submission-compression/r2"];
    let f = Forge::new();
    f.log(|log| log.lines().filter(|l| !hidden.iter().any(|h| l.starts_with(&format!("  {h} ")))).map(|l| format!("{l}\n")).collect())
        .rehash();
    refused(
        &f.verify(),
        &[
            "3 entries of the result have no line in the run's log (taken from another run?): gpt2-124m/submission-compression/r0, resnet50/submission-compression/r1, gpt2-124m/submission-compression/r2",
            "the log's run at line 2 runs resnet50/allreduce/r0 (line 5) where the plan's next entry is gpt2-124m/submission-compression/r0: that entry's line is missing from the log (removed?)",
        ],
    );

    // With lines for them put back (the other run's, or made up), the
    // entries still say they came from another process: the plugin was
    // loaded once per run.
    let f = Forge::new();
    f.result(|r| {
        for e in submission_entries(r).filter(|e| hidden.contains(&e["id"].as_str().unwrap())) {
            e["metrics"]["plugins"][0]["load_s"] = 0.0051.into();
        }
    })
    .rehash();
    refused(
        &f.verify(),
        &["the log's run at line 2 is one process, which loads a plugin once, yet its entries record 2 load times of its compressor plugin (entries from another run?): 0.004287659 s (resnet50/submission-compression/r0, gpt2-124m/submission-compression/r1, resnet50/submission-compression/r2); 0.0051 s (gpt2-124m/submission-compression/r0, resnet50/submission-compression/r1, gpt2-124m/submission-compression/r2)"],
    );
}

#[test]
fn edited_labels_are_refused() {
    let f = Forge::new();
    f.result(|r| {
        r["submission"]["hardware_class"] = "h200".into();
        r["submission"]["suite_version"] = "1.1".into();
    })
    .manifest(|m| {
        m["hardware_class"] = "h200".into();
        m["suite"]["version"] = "1.1".into();
    })
    .rehash();
    refused(
        &f.verify(),
        &[
            "the result's hardware class is `h200`; the released suite that ran (suites/h100.toml) gives `h100`",
            "the manifest's hardware class is `h200`; the released suite that ran (suites/h100.toml) gives `h100`",
            "the result's suite version is `1.1`; the released suite that ran (suites/h100.toml) gives `1.2`",
        ],
    );

    // More GPUs than the run had: the fingerprint and the entries say 2.
    let f = Forge::new();
    f.result(|r| r["submission"]["gpus"] = 4.into()).manifest(|m| m["gpus"] = 4.into()).rehash();
    refused(
        &f.verify(),
        &[
            "the run used 4 GPUs; the fingerprint lists 2",
            "12 entries did not run on the device the fingerprint and the class h100 on 4 GPUs give (`4 x cuda (NVIDIA H100 80GB HBM3)`)",
            "gpt2-124m/allreduce/r0 trained on 2 ranks, the run's GPU count is 4",
        ],
    );
    // The manifest alone edited.
    let f = Forge::new();
    f.manifest(|m| m["gpus"] = 8.into()).rehash();
    refused(&f.verify(), &["the manifest says 8 GPUs, the result 2"]);
}

#[test]
fn a_run_on_the_cpu_relabelled_as_two_h100s_is_refused() {
    // The entries as a CPU run records them, under the H100 suite's labels.
    let cpu_entries = |r: &mut serde_json::Value| {
        for e in r["entries"].as_array_mut().unwrap() {
            e["device"] = "cpu".into();
            e["metrics"]["memory"]["peak_device_allocated_bytes"] = serde_json::Value::Null;
            e["metrics"]["ranks"][0]["memory"]["peak_device_allocated_bytes"] = serde_json::Value::Null;
        }
    };
    // With the fingerprint of the CPU machine it ran on ...
    let f = Forge::new();
    f.result(|r| {
        cpu_entries(r);
        r["machine"]["gpus"] = serde_json::json!([]);
    })
    .rehash();
    refused(
        &f.verify(),
        &[
            "the run is unofficial: ran without a GPU; the suite is for H100 (h100)",
            "the run used 2 GPUs; the fingerprint lists 0",
            "12 entries did not run on the device the fingerprint and the class h100 on 2 GPUs give (a GPU the fingerprint lacks): gpt2-124m/allreduce/r0 (`cpu`)",
            "gpt2-124m/allreduce/r0 has no GPU memory figures (it did not train on a GPU)",
        ],
    );
    // ... and with a fingerprint edited to show two H100s.
    let f = Forge::new();
    f.result(cpu_entries).rehash();
    refused(
        &f.verify(),
        &[
            "12 entries did not run on the device the fingerprint and the class h100 on 2 GPUs give (`2 x cuda (NVIDIA H100 80GB HBM3)`): gpt2-124m/allreduce/r0 (`cpu`)",
            "the log's run at line 2 ran on `2 x cuda (NVIDIA H100 80GB HBM3)`; its entries' results say otherwise",
        ],
    );
    // machine.json edited apart from the result's fingerprint.
    let f = Forge::new();
    f.edit_json(MACHINE, |m| m["gpus"][0]["name"] = "NVIDIA H200".into()).rehash();
    refused(&f.verify(), &["machine.json is not the fingerprint recorded in result.json"]);
}

#[test]
fn manifest_paths_outside_the_bundle_are_never_read() {
    let outside = |f: &Forge| f.dir.parent().unwrap().join("x");
    for (path, bytes, says) in [
        ("../x", 6, "`../x` leaves the bundle's folder (`..`); verify reads only files inside it"),
        ("/dev/zero", 8_912_896_000u64, "the manifest says /dev/zero has 8912896000 bytes; verify reads at most"),
        ("/dev/zero", 6, "`/dev/zero` is an absolute path; verify reads only files inside the bundle's folder"),
        (
            "plugins/zero",
            6,
            "`plugins/zero` goes through the symbolic link `plugins/zero`; verify reads only the bundle's own files, never a link",
        ),
        ("up/x", 6, "`up/x` goes through the symbolic link `up`"),
        ("plugins", 6, "`plugins` is not a regular file"),
    ] {
        let f = Forge::new();
        std::fs::write(outside(&f), b"secret").unwrap();
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("/dev/zero", f.dir.join("plugins/zero")).unwrap();
            std::os::unix::fs::symlink(f.dir.parent().unwrap(), f.dir.join("up")).unwrap();
        }
        f.rehash().manifest(|m| {
            m["files"].as_array_mut().unwrap().push(serde_json::json!({"path": path, "sha256": sha256_hex(b"secret"), "bytes": bytes}));
        });
        let started = std::time::Instant::now();
        refused(&f.verify(), &[says]);
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "{path}: verify took {:?}", started.elapsed());
    }
    // The plugin's file pointed outside, through the manifest's plugin record.
    let f = Forge::new();
    std::fs::write(outside(&f), b"secret").unwrap();
    f.manifest(|m| m["plugins"][0]["file"] = "../x".into()).rehash();
    refused(&f.verify(), &["the manifest names ../x as the compressor `topk` but does not list it with its sha256 among its files"]);
}

#[test]
fn manifests_and_results_that_are_no_regular_files_of_their_cap_are_refused() {
    let f = Forge::new();
    let mut big = std::fs::read(f.dir.join(MANIFEST)).unwrap();
    big.extend(std::iter::repeat_n(b' ', files::MANIFEST_CAP as usize));
    std::fs::write(f.dir.join(MANIFEST), big).unwrap();
    refused(&f.verify(), &["MANIFEST.json has 1049975 bytes; ", "verify reads at most 1048576 bytes of a bundle's file"]);
    #[cfg(unix)]
    {
        let f = Forge::new();
        let real = f.dir.parent().unwrap().join("real.json");
        std::fs::rename(f.dir.join(MANIFEST), &real).unwrap();
        std::os::unix::fs::symlink(&real, f.dir.join(MANIFEST)).unwrap();
        refused(&f.verify(), &["`MANIFEST.json` goes through the symbolic link `MANIFEST.json`"]);
        let f = Forge::new();
        let real = f.dir.parent().unwrap().join("real.json");
        std::fs::rename(f.dir.join(RESULT), &real).unwrap();
        std::os::unix::fs::symlink(&real, f.dir.join(RESULT)).unwrap();
        refused(&f.verify(), &["`result.json` goes through the symbolic link", "result.json cannot be read (see the files rule)"]);
    }
}

#[test]
fn a_bundle_without_its_artifact_is_refused() {
    let f = Forge::new();
    std::fs::remove_file(f.dir.join(ARTIFACT)).unwrap();
    f.manifest(|m| {
        m["plugins"][0]["file"] = serde_json::Value::Null;
        m["files"].as_array_mut().unwrap().retain(|x| x["path"] != ARTIFACT);
    });
    refused(
        &f.verify(),
        &["the compressor `topk` 0.1.0 is bundled as its sha256 and size only (`--no-artifacts`): verify cannot check that it is the plugin the result names, nor that it is a WebAssembly component that ran sandboxed"],
    );
}

#[test]
fn the_artifact_bundled_is_the_one_the_sha256_names() {
    assert_eq!(sha256_hex(&std::fs::read(repo().join(REAL).join(ARTIFACT)).unwrap()), TOPK_SHA);
}

/// A hash of other characters than hex (a manifest may hold anything) is
/// cut for messages at a character boundary, never mid-character.
#[test]
fn hostile_hashes_are_cut_for_messages_without_a_panic() {
    assert_eq!(super::short("aaaaaaaaaaaé"), "aaaaaaaaaaaé");
    assert_eq!(super::short("aaaaaaaaaaaéé"), "aaaaaaaaaaaé");
    assert_eq!(super::short("0123456789abcdef"), "0123456789ab");
}

#[test]
fn reasons_quote_what_the_bundle_chose_without_sending_it_to_the_terminal() {
    let v = Verdict {
        violations: vec![Violation { rule: "files", what: "`w\u{1b}[2J` is not a workload of the suite".into(), todo: "\u{9b}31m".into() }],
        notes: vec!["a \u{202e}note".into()],
    };
    let text = render(Path::new("x\u{1b}]0;t\u{7}.bundle"), &v);
    assert!(!text.chars().any(|c| harness_format::fmt::unseen(c) && c != '\n'), "{text:?}");
    assert!(text.contains(r"`w\u{1b}[2J` is not a workload"), "{text}");
    assert!(text.contains(r"x\u{1b}]0;t\u{7}.bundle: NOT verified"), "{text}");
}

/// Issue 60: a CPU-class bundle made with libtorch's kernels at the
/// CPU's own level (AVX-512 here) verified, and its rerun on an
/// AVX2-only CPU differed in 6 evaluations. The reference `topk`
/// bundle of the CPU class, its fingerprint without `cpu_kernels` (as
/// harness wrote it before it held them) and then with them pinned,
/// the manifest rehashed each time as a forger would.
#[test]
fn a_cpu_class_bundle_whose_fingerprint_lacks_the_pinned_kernels_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cpu.bundle");
    copy_dir(&repo().join("results/cpu/submissions/1.2/compression-topk.bundle"), &dir);
    let inspect = crate::test_support::inspect_as("topk", "0.1.0");
    let with_kernels = |kernels: Option<serde_json::Value>| {
        let mut r: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join(RESULT)).unwrap()).unwrap();
        match kernels {
            Some(k) => r["machine"]["cpu_kernels"] = k,
            None => _ = r["machine"].as_object_mut().unwrap().remove("cpu_kernels"),
        }
        std::fs::write(dir.join(RESULT), serde_json::to_vec_pretty(&r).unwrap()).unwrap();
        std::fs::write(dir.join(MACHINE), serde_json::to_vec_pretty(&r["machine"]).unwrap()).unwrap();
        let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join(MANIFEST)).unwrap()).unwrap();
        for f in m["files"].as_array_mut().unwrap() {
            let bytes = std::fs::read(dir.join(f["path"].as_str().unwrap())).unwrap();
            f["sha256"] = sha256_hex(&bytes).into();
            f["bytes"] = bytes.len().into();
        }
        std::fs::write(dir.join(MANIFEST), serde_json::to_vec_pretty(&m).unwrap()).unwrap();
        let v = verify(&dir, &inspect);
        (v.verified(), render(&dir, &v))
    };
    let (verified, text) = with_kernels(None);
    assert!(!verified, "{text}");
    assert!(text.contains("violation [hardware]: the fingerprint records no CPU kernels (`machine.cpu_kernels`"), "{text}");
    let avx512 = serde_json::json!({ "aten": "avx512", "variables": {}, "avx2_fma": true });
    let (verified, text) = with_kernels(Some(avx512));
    assert!(!verified, "{text}");
    assert!(text.contains("libtorch's CPU kernels were not held to the CPU class's level (`machine.cpu_kernels`: ATen `avx512`"), "{text}");
    let pinned = serde_json::to_value(harness_format::machine::CpuKernels::pinned()).unwrap();
    let (verified, text) = with_kernels(Some(pinned));
    assert!(verified, "the same bundle with the class's kernels verifies:\n{text}");
}

/// The field of a submission entry that holds `m`'s figure, and a bundle
/// whose entries record it (goodput: a checkpointing run's).
fn recorded_at(m: Metric) -> (&'static str, &'static str) {
    const CHECKPOINTING: &str = "results/cpu/submissions/1.2/checkpointing-every-n.bundle";
    match m {
        Metric::TimeToTarget => (REAL, "/metrics/time_to_target_s"),
        Metric::TokensPerS => (REAL, "/metrics/tokens_per_s"),
        Metric::StepP50 => (REAL, "/metrics/step/p50_ms"),
        Metric::StepP99 => (REAL, "/metrics/step/p99_ms"),
        Metric::StepP999 => (REAL, "/metrics/step/p999_ms"),
        Metric::Mfu => (REAL, "/metrics/mfu"),
        Metric::PeakMemory => (REAL, "/metrics/memory/peak_device_allocated_bytes"),
        Metric::BytesPerStep => (REAL, "/metrics/bytes_on_wire"),
        Metric::Goodput => (CHECKPOINTING, "/metrics/goodput_steps_per_s"),
        Metric::EvalAccuracy => (REAL, "/metrics/final_eval_accuracy"),
    }
}

/// Issue 62: "A new metric must also be added to `verify/figures.rs`, or
/// bundle verification silently weakens." Each metric the boards show,
/// forged alone (x 1.5 in every submission entry that records it, the
/// manifest rehashed), is refused by rule 9 itself.
#[test]
fn every_metric_forged_alone_is_refused_by_rule_9() {
    for m in Metric::ALL {
        let (bundle, at) = recorded_at(m);
        let f = Forge::of(bundle);
        let mut forged = 0;
        f.result(|r| {
            for e in submission_entries(r) {
                if let Some(x) = e.pointer_mut(at).filter(|x| x.is_number()) {
                    let v = x.as_f64().unwrap() * 1.5;
                    *x = if x.is_u64() { serde_json::Value::from(v as u64) } else { serde_json::Value::from(v) };
                    forged += 1;
                }
            }
        })
        .rehash();
        assert!(forged > 0, "{m:?}: {bundle} records no {at} to forge");
        let v = f.verify();
        let from = figures::worked_out_from(m);
        assert!(
            v.violations.iter().any(|x| x.rule == "figures"),
            "{m:?} ({at}) forged alone is not refused by rule 9, which says it works it out from {from}:\n{}",
            render(&f.dir, &v)
        );
    }
}
