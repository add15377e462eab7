//! Plugins end to end: bad plugins fail their own entry with a message that
//! names the plugin, the call and the cause, and never the run; good ones
//! train like the built-in strategy; `harness plugin new` makes a crate that
//! builds and runs as generated.
//!
//! The artifacts come from `scripts/build-plugins.sh` (run by `./x test`).

use crate::{artifact, entry, exclusive, harness, installed_harness, losses, repo_root, results, run_ok, write};
use harness::cli::exit;

const WORKLOAD: &str = r#"
[[workload]]
name = "mlp"
model = { kind = "mlp", preset = "tiny" }
data = { kind = "synthetic", vocab = 256, branching = 4 }
batch = 8
seq_len = 16
steps = 12
optimizer = { kind = "adamw", lr = 1e-2, weight_decay = 0.0 }
eval_batches = 1
"#;

#[test]
fn misbehaving_plugins_fail_their_own_entry_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = format!("[suite]\nname = \"bad-plugins\"\ndevice = \"cpu\"\nseed = 1\nworld_size = 2\nwarmup_steps = 2\n{WORKLOAD}");
    let plugin =
        |name: &str, file: &str, extra: &str| format!("[[plugin]]\nname = \"{name}\"\npath = \"{}\"\n{extra}\n", artifact(file).display());
    s += &plugin("avg", "allreduce.wasm", "");
    s += &plugin("avg-native", "liballreduce.so", "");
    s += &plugin("bad", "misbehave.wasm", "memory_mb = 32\ndeadline_ms = 300");
    s += &plugin("bad-native", "libmisbehave.so", "");
    s += &plugin("old-abi", "libbad-abi.so", "");
    s += &plugin("batchy", "misbehave-batch.wasm", "");
    s += "[[strategy]]\nname = \"first\"\ncompressor = \"avg\"\n";
    let modes = ["trap", "panic", "loop", "alloc", "nan", "wrong-shape", "reject"];
    for m in modes {
        s += &format!("[[strategy]]\nname = \"{m}\"\ncompressor = \"bad\"\ncompressor_config = {{ mode = \"{m}\" }}\n");
    }
    s += "[[strategy]]\nname = \"native-panic\"\ncompressor = \"bad-native\"\ncompressor_config = { mode = \"panic\" }\n";
    // Only rank 1 fails: its own error is what the entry reports, not rank 0's wait.
    s += "[[strategy]]\nname = \"rank1-panic\"\ncompressor = \"bad\"\ncompressor_config = { mode = \"panic\", rank = 1 }\n";
    s += "[[strategy]]\nname = \"abi\"\ncompressor = \"old-abi\"\n";
    for m in ["zero", "nan-lr"] {
        s += &format!("[[strategy]]\nname = \"batch-{m}\"\nbatch_policy = \"batchy\"\nbatch_policy_config = {{ mode = \"{m}\" }}\n");
    }
    s += "[[strategy]]\nname = \"last\"\ncompressor = \"avg-native\"\n";
    let suite = write(dir.path(), "suite.toml", &s);
    let out_path = dir.path().join("r.json");
    let t0 = std::time::Instant::now();
    let out = harness(dir.path()).arg("run").arg(&suite).arg("--out").arg(&out_path).arg("-q").output().unwrap();
    // Exit 1: the run finished and some entries failed; nothing crashed.
    assert_eq!(out.status.code(), Some(1), "stderr:\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(t0.elapsed().as_secs() < 120, "the run took {:?}: something hung", t0.elapsed());
    let r = results(&out_path);
    for ok in ["mlp/first/r0", "mlp/last/r0"] {
        let e = entry(&r, ok);
        assert_eq!(e["status"], "ok", "{ok}: {e}");
        assert!(e["metrics"]["steps"].as_u64() == Some(12), "{ok} trained all its steps");
    }
    let wasm = |call: &str, cause: &str| vec![format!("compressor plugin `bad` (wasm, "), format!("`{call}`: "), cause.to_owned()];
    let expect: Vec<(&str, Vec<String>)> = vec![
        ("trap", wasm("compress", "it trapped (unreachable instruction)")),
        ("panic", wasm("compress", "it panicked at tests/plugins/misbehave/src/lib.rs")),
        ("loop", wasm("compress", "per-call deadline of 300 ms")),
        ("alloc", wasm("compress", "memory past the cap of 32 MiB")),
        ("nan", wasm("compress", "non-finite values in bucket 0 at step 0")),
        ("wrong-shape", wasm("compress", "host op `tensor.assign`: shapes differ")),
        ("reject", wasm("configure", "rejects its config on purpose")),
        ("rank1-panic", vec!["rank 1: compressor plugin `bad` (wasm, ".into(), "it panicked at tests/plugins/misbehave/src/lib.rs".into()]),
        (
            "native-panic",
            vec!["compressor plugin `bad-native` (native, ".into(), "`compress`: ".into(), "it panicked: mode `panic`".into()],
        ),
        (
            "abi",
            vec!["plugin `old-abi`".into(), "ABI version 999".into(), "harness speaks version 2 (0.2) and loads version 1 (0.1)".into()],
        ),
        ("batch-zero", vec!["batch-policy plugin `batchy`".into(), "from `initial`".into(), "micro-batch 0 x 1".into()]),
        ("batch-nan-lr", vec!["batch-policy plugin `batchy`".into(), "from `initial`".into(), "lr-scale NaN".into()]),
    ];
    for (name, wants) in expect {
        let e = entry(&r, &format!("mlp/{name}/r0"));
        assert_eq!(e["status"], "failed", "{name}: {e}");
        let msg = e["error"].as_str().unwrap();
        for w in wants {
            assert!(msg.contains(&w), "{name}: {msg:?} lacks {w:?}");
        }
    }
}

#[test]
fn a_non_finite_output_on_one_rank_is_caught_by_that_rank_with_clipping_on() {
    // With clipping, several ranks share the gradient norm (each reads a
    // piece of the averaged gradients); where the norm checks a plugin's
    // output, each rank must read all of its own: here rank 1's first
    // element, which lies in rank 0's piece, is NaN and rank 0's is not.
    let dir = tempfile::tempdir().unwrap();
    let workload = WORKLOAD.replace("eval_batches = 1", "eval_batches = 1\ngrad_clip = 1.0");
    let s = format!(
        "[suite]\nname = \"nan-one-rank\"\ndevice = \"cpu\"\nseed = 1\nworld_size = 2\nwarmup_steps = 2\n{workload}\n\
         [[plugin]]\nname = \"bad\"\npath = \"{}\"\n\
         [[strategy]]\nname = \"nan-first\"\ncompressor = \"bad\"\ncompressor_config = {{ mode = \"nan-first\", rank = 1 }}\n",
        artifact("misbehave.wasm").display()
    );
    let suite = write(dir.path(), "suite.toml", &s);
    let out_path = dir.path().join("r.json");
    let out = harness(dir.path()).arg("run").arg(&suite).arg("--out").arg(&out_path).arg("-q").output().unwrap();
    assert_eq!(out.status.code(), Some(1), "stderr:\n{}", String::from_utf8_lossy(&out.stderr));
    let r = results(&out_path);
    let e = entry(&r, "mlp/nan-first/r0");
    assert_eq!(e["status"], "failed", "{e}");
    let msg = e["error"].as_str().unwrap();
    assert!(msg.contains("rank 1: ") && msg.contains("non-finite values in bucket 0 at step 0"), "{msg}");
}

#[test]
fn a_wasm_all_reduce_plugin_trains_exactly_like_the_built_in_one() {
    let dir = tempfile::tempdir().unwrap();
    let s = format!(
        "[suite]\nname = \"same\"\ndevice = \"cpu\"\nseed = 3\nworld_size = 2\nwarmup_steps = 2\n{WORKLOAD}\n\
         [[plugin]]\nname = \"avg\"\npath = \"{}\"\n[[plugin]]\nname = \"avg-native\"\npath = \"{}\"\n\
         [[strategy]]\nname = \"builtin\"\nbaseline = true\n\
         [[strategy]]\nname = \"wasm\"\ncompressor = \"avg\"\n[[strategy]]\nname = \"native\"\ncompressor = \"avg-native\"\n",
        artifact("allreduce.wasm").display(),
        artifact("liballreduce.so").display()
    );
    let suite = write(dir.path(), "suite.toml", &s);
    let out_path = dir.path().join("r.json");
    run_ok(harness(dir.path()).arg("run").arg(&suite).arg("--out").arg(&out_path).arg("-q"));
    let r = results(&out_path);
    // (step, seconds, loss): the losses, not the clock.
    let curve = |id: &str| losses(&r, id);
    let base = entry(&r, "mlp/builtin/r0");
    for id in ["mlp/wasm/r0", "mlp/native/r0"] {
        let e = entry(&r, id);
        // Same seed, same sums: the plugin's average is the built-in's.
        assert_eq!(curve(id), curve("mlp/builtin/r0"), "{id} learned differently");
        assert_eq!(e["metrics"]["bytes_on_wire"], base["metrics"]["bytes_on_wire"], "{id} moved other bytes");
        let p = &e["metrics"]["plugins"][0];
        assert_eq!(p["slot"], "compressor");
        assert_eq!(p["name"], "allreduce");
        let calls = p["calls"].as_u64().unwrap();
        // configure, setup (the buckets' layout) + one compress per bucket
        // per step.
        let buckets = 1;
        assert_eq!(calls, 2 + 12 * buckets, "{id}: {p}");
        assert!(p["call"]["p50_ms"].as_f64().unwrap() > 0.0);
        assert!(e["histograms"]["plugin.compressor"].is_string());
    }
    assert_eq!(entry(&r, "mlp/wasm/r0")["metrics"]["strategy_runtime"], "wasm");
    assert_eq!(entry(&r, "mlp/native/r0")["metrics"]["strategy_runtime"], "native (unsandboxed)");
    assert_eq!(base["metrics"]["strategy_runtime"], "built-in");
}

#[test]
fn inspect_prints_a_pinnable_manifest_and_pins_are_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let wasm = artifact("allreduce.wasm");
    let out = run_ok(harness(dir.path()).args(["plugin", "inspect"]).arg(&wasm));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let sha = harness::plugin::sha256_file(&wasm).unwrap();
    assert!(text.contains(&format!("sha256 = \"{sha}\"")) && text.contains("kind = \"compressor\""), "{text}");
    assert!(text.contains("harness:strategy@0.2.0"), "{text}");
    // A pin that does not match fails validation and names both hashes.
    let pinned = format!(
        "[suite]\nname = \"pin\"\ndevice = \"cpu\"\nworld_size = 2\n{WORKLOAD}\n[[plugin]]\nname = \"avg\"\npath = \"{}\"\nsha256 = \"{}\"\n\
         [[strategy]]\nname = \"s\"\ncompressor = \"avg\"\n",
        wasm.display(),
        "0".repeat(64)
    );
    let suite = write(dir.path(), "pinned.toml", &pinned);
    let out = harness(dir.path()).arg("validate").arg(&suite).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&sha) && err.contains(&"0".repeat(64)), "{err}");
    // Native libraries with another ABI are refused before any other symbol.
    let out = harness(dir.path()).args(["plugin", "inspect"]).arg(artifact("libbad-abi.so")).output().unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("ABI version 999"));
}

#[test]
fn plugin_new_makes_a_crate_that_builds_and_runs_as_generated() {
    let dir = tempfile::tempdir().unwrap();
    run_ok(installed_harness(dir.path()).args(["plugin", "new", "compressor", "my-avg"]));
    let krate = dir.path().join("my-avg");
    // It depends on the SDK copied into its own folder, not on this checkout.
    let manifest = std::fs::read_to_string(krate.join("Cargo.toml")).unwrap();
    assert!(manifest.contains(r#"harness-sdk = { path = "harness-sdk" }"#), "{manifest}");
    assert!(krate.join("harness-sdk/wit/strategy.wit").exists());
    // Share the workspace's build cache for the SDK's dependencies.
    let target = repo_root().join("target/scaffold-test");
    let build = std::process::Command::new(env!("CARGO"))
        .args(["build", "--release", "--target", "wasm32-wasip2", "--quiet"])
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(&krate)
        .output()
        .unwrap();
    assert!(build.status.success(), "the generated crate does not build:\n{}", String::from_utf8_lossy(&build.stderr));
    let built = target.join("wasm32-wasip2/release/my_avg.wasm");
    let want = krate.join("target/wasm32-wasip2/release");
    std::fs::create_dir_all(&want).unwrap();
    std::fs::copy(&built, want.join("my_avg.wasm")).unwrap();
    let out_path = dir.path().join("r.json");
    run_ok(installed_harness(&krate).args(["run", "suite.toml", "--out"]).arg(&out_path).arg("-q"));
    let r = results(&out_path);
    let e = entry(&r, "mlp-tiny/with-my-avg/r0");
    assert_eq!(e["status"], "ok", "{e}");
    assert_eq!(e["metrics"]["plugins"][0]["name"], "my-avg");
    assert_eq!(losses(&r, "mlp-tiny/with-my-avg/r0"), losses(&r, "mlp-tiny/baseline/r0"));
    // Three repeats each, and the target is within reach: every entry has a time to it.
    for id in ["baseline", "with-my-avg"].iter().flat_map(|s| (0..3).map(move |k| format!("mlp-tiny/{s}/r{k}"))) {
        assert!(entry(&r, &id)["metrics"]["time_to_target_s"].as_f64().is_some(), "{id} missed the scaffold's target");
    }
}

#[test]
fn plugin_new_in_c_makes_a_library_that_builds_with_make_and_trains_like_the_baseline() {
    let dir = tempfile::tempdir().unwrap();
    run_ok(installed_harness(dir.path()).args(["plugin", "new", "compressor", "my-c", "--lang", "c"]));
    let folder = dir.path().join("my-c");
    // The folder builds on its own: the header is copied next to the source.
    let make = std::process::Command::new("make").current_dir(&folder).output().expect("make is installed");
    assert!(make.status.success(), "the generated C plugin does not build:\n{}", String::from_utf8_lossy(&make.stderr));
    assert!(!String::from_utf8_lossy(&make.stderr).contains("warning"), "{}", String::from_utf8_lossy(&make.stderr));
    let out_path = dir.path().join("r.json");
    run_ok(installed_harness(&folder).args(["run", "suite.toml", "--out"]).arg(&out_path).arg("-q"));
    let r = results(&out_path);
    let losses = |id: &str| losses(&r, id);
    for k in 0..3 {
        let e = entry(&r, &format!("mlp-tiny/with-my-c/r{k}"));
        assert_eq!(e["status"], "ok", "{e}");
        assert_eq!(e["metrics"]["strategy_runtime"], "native (unsandboxed)");
        assert_eq!(e["metrics"]["plugins"][0]["name"], "my-c");
        assert_eq!(losses(&format!("mlp-tiny/with-my-c/r{k}")), losses(&format!("mlp-tiny/baseline/r{k}")), "repeat {k}");
        assert!(e["metrics"]["time_to_target_s"].as_f64().is_some());
    }
    // It takes no configuration, and says so where the suite gives one.
    let suite = std::fs::read_to_string(folder.join("suite.toml"))
        .unwrap()
        .replace("compressor = \"my-c\"", "compressor = \"my-c\"\ncompressor_config = { ratio = 0.1 }");
    std::fs::write(folder.join("bad.toml"), suite).unwrap();
    let out = installed_harness(&folder).args(["validate", "bad.toml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("my-c takes no configuration, got: ratio = 0.1"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// For a language with exceptions, what the test adds to the generated
/// source (in the same build, so that no second one costs minutes): the
/// file, (text, text to insert after it) pairs and code to append, with
/// which `compressor_config = { bad_k = true }` makes `compress` raise from
/// a function of the plugin's own; and what the entry's error must hold.
struct Raises {
    file: &'static str,
    insert_after: &'static [(&'static str, &'static str)],
    append: &'static str,
    wants: &'static [&'static str],
}

fn raises(lang: &str) -> Option<Raises> {
    match lang {
        "python" => Some(Raises {
            file: "app.py",
            insert_after: &[
                ("    def configure(self, config: str) -> None:\n", "        global BAD_K\n"),
                (
                    "            raise Err(f\"{{name}}: the configuration is not TOML: {e}\")\n",
                    "        BAD_K = keys.pop(\"bad_k\", False)\n",
                ),
                ("    def compress(self, bucket, info) -> None:\n", "        if BAD_K:\n            check_k()\n"),
            ],
            append: "\n\nBAD_K = False\n\n\ndef check_k():\n    raise ValueError(\"bad k\")\n",
            // The type, the message, and the plugin's own line that raised
            // it, not componentize-py's panic.
            wants: &["it raised ValueError: bad k (at app.py line {last}, in check_k)", "Traceback (most recent call last):"],
        }),
        "js" => Some(Raises {
            file: "app.js",
            insert_after: &[
                ("  configure(config) {\n", "    badK = config.trim() === 'bad_k = true';\n    if (badK) return;\n"),
                ("  compress(bucket, info) {\n", "    if (badK) checkK();\n"),
            ],
            append: "\nlet badK = false;\n\nfunction checkK() {\n  throw new RangeError('bad k');\n}\n",
            wants: &["returned an error from `compress`: RangeError: bad k (at checkK@app.js:{last}:"],
        }),
        _ => None,
    }
}

/// A third party's plugin in another language, from an empty folder with
/// the installed `harness`: scaffolded, built by its own script (the
/// toolchain installed once into the cache), loaded into the
/// sandbox, and on two ranks it trains exactly as the Rust `allreduce`
/// plugin and the built-in all-reduce do; a configuration it does not take
/// is refused before anything trains, with the plugin's own message. In a
/// language with exceptions, one raised by the plugin fails its entry with
/// the exception's type, message and the plugin's own line.
fn scaffolded_component_trains_like_the_rust_allreduce(lang: &str, name: &str) {
    let _alone = exclusive();
    let dir = tempfile::tempdir().unwrap();
    run_ok(installed_harness(dir.path()).args(["plugin", "new", "compressor", name, "--lang", lang]));
    let folder = dir.path().join(name);
    let raises = raises(lang);
    // The line of the source that raises.
    let mut raise_line = 0;
    if let Some(r) = &raises {
        let path = folder.join(r.file);
        let mut src = std::fs::read_to_string(&path).unwrap();
        for (at, insert) in r.insert_after {
            let at = at.replace("{{name}}", name);
            let i = src.find(&at).unwrap_or_else(|| panic!("{}: no {at:?} in\n{src}", r.file)) + at.len();
            src.insert_str(i, insert);
        }
        src += r.append;
        raise_line = 1 + src.lines().position(|l| l.contains("bad k")).unwrap();
        std::fs::write(&path, src).unwrap();
    }
    let build = std::process::Command::new("./build.sh").current_dir(&folder).output().expect("bash runs build.sh");
    assert!(build.status.success(), "the generated {lang} plugin does not build:\n{}", String::from_utf8_lossy(&build.stderr));
    let mut suite = std::fs::read_to_string(folder.join("suite.toml")).unwrap()
        + &format!(
            "\n[[plugin]]\nname = \"rust-avg\"\npath = \"{}\"\n\n[[strategy]]\nname = \"rust\"\ncompressor = \"rust-avg\"\n",
            artifact("allreduce.wasm").display()
        );
    if raises.is_some() {
        suite += &format!("\n[[strategy]]\nname = \"raises\"\ncompressor = \"{name}\"\ncompressor_config = {{ bad_k = true }}\n");
    }
    std::fs::write(folder.join("with-rust.toml"), suite).unwrap();
    let out_path = dir.path().join("r.json");
    let out = installed_harness(&folder).args(["run", "with-rust.toml", "--out"]).arg(&out_path).arg("-q").output().unwrap();
    // Exit 1 where an entry raised on purpose.
    let code = if raises.is_some() { exit::ENTRY_FAILED } else { exit::OK };
    assert_eq!(
        out.status.code(),
        Some(code),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let r = results(&out_path);
    if let Some(raises) = &raises {
        let e = entry(&r, "mlp-tiny/raises/r0");
        assert_eq!(e["status"], "failed", "{e}");
        let msg = e["error"].as_str().unwrap();
        for want in raises.wants {
            let want = want.replace("{last}", &raise_line.to_string());
            assert!(msg.contains(&want), "{lang}: {msg:?} lacks {want:?}");
        }
    }
    let losses = |id: &str| losses(&r, id);
    for k in 0..3 {
        let id = format!("mlp-tiny/with-{name}/r{k}");
        let e = entry(&r, &id);
        assert_eq!(e["status"], "ok", "{e}");
        assert_eq!(e["metrics"]["strategy_runtime"], "wasm");
        assert_eq!(e["metrics"]["world_size"], 2);
        assert_eq!(e["metrics"]["plugins"][0]["name"], name);
        assert_eq!(losses(&id), losses(&format!("mlp-tiny/rust/r{k}")), "repeat {k}: {lang} and Rust differ");
        assert_eq!(losses(&id), losses(&format!("mlp-tiny/baseline/r{k}")), "repeat {k}");
    }
    let bad = std::fs::read_to_string(folder.join("suite.toml"))
        .unwrap()
        .replace(&format!("compressor = \"{name}\""), &format!("compressor = \"{name}\"\ncompressor_config = {{ ratio = 0.1 }}"));
    std::fs::write(folder.join("bad.toml"), bad).unwrap();
    let out = installed_harness(&folder).args(["validate", "bad.toml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("{name} takes no configuration, got: ratio = 0.1")), "{stderr}");
}

#[test]
fn plugin_new_in_python_builds_a_component_that_trains_like_the_rust_allreduce() {
    scaffolded_component_trains_like_the_rust_allreduce("python", "my-py");
}

#[test]
fn plugin_new_in_javascript_builds_a_component_that_trains_like_the_rust_allreduce() {
    scaffolded_component_trains_like_the_rust_allreduce("js", "my-js");
}

/// Batch and checkpoint policies in Python and JavaScript: each template
/// builds as generated, passes the test kit's checks, refuses an unknown
/// config key by name, and trains next to the baseline in its own suite
/// (shortened; a checkpoint policy told to save every 10 steps leaves
/// checkpoints).
#[test]
fn plugin_new_makes_policies_in_python_and_javascript_that_build_and_run() {
    let _alone = exclusive();
    let dir = tempfile::tempdir().unwrap();
    let plugins: Vec<(&str, &str, String)> = ["batch-policy", "checkpoint-policy"]
        .into_iter()
        .flat_map(|kind| ["python", "js"].map(|lang| (lang, kind, format!("{}-{kind}", if lang == "js" { "js" } else { "py" }))))
        .collect();
    let config = |kind: &str| if kind == "checkpoint-policy" { "every=10" } else { "micro_batch=16" };
    // Two at a time, a Python and a JavaScript one: built, then checked by
    // `plugin test`, whose first call compiles the component (seconds of
    // one core each: an interpreter inside); the two never install into
    // the same folder when a machine builds its first. Then each plugin's
    // other checks in turn.
    for pair in plugins.chunks(2) {
        std::thread::scope(|scope| {
            for (lang, kind, name) in pair {
                let dir = dir.path();
                scope.spawn(move || {
                    run_ok(installed_harness(dir).args(["plugin", "new", kind, name, "--lang", lang]));
                    let folder = dir.join(name);
                    let build = std::process::Command::new("./build.sh").current_dir(&folder).output().expect("bash runs build.sh");
                    assert!(build.status.success(), "{lang} {kind} does not build:\n{}", String::from_utf8_lossy(&build.stderr));
                    let wasm = folder.join(format!("{name}.wasm"));
                    let out = run_ok(installed_harness(&folder).args(["plugin", "test", "--plugin-config", config(kind)]).arg(&wasm));
                    let text = String::from_utf8_lossy(&out.stdout);
                    assert!(text.contains("determinism") && !text.contains("FAILED"), "{lang} {kind}:\n{text}");
                });
            }
        });
    }
    for (lang, kind, name) in &plugins {
        let (lang, kind, name) = (*lang, *kind, name.as_str());
        let folder = dir.path().join(name);
        let wasm = folder.join(format!("{name}.wasm"));
        let config = config(kind);
        let bad = installed_harness(&folder).args(["plugin", "test", "--plugin-config", "nonsense=1"]).arg(&wasm).output().unwrap();
        let said = format!("{}{}", String::from_utf8_lossy(&bad.stdout), String::from_utf8_lossy(&bad.stderr));
        assert!(said.contains("unknown config key `nonsense`"), "{lang} {kind}:\n{said}");
        let suite = std::fs::read_to_string(folder.join("suite.toml")).unwrap();
        let slot = if kind == "checkpoint-policy" { "checkpoint" } else { "batch_policy" };
        // Shortened: one repeat of 30 steps.
        let suite = suite
            .replace(
                &format!("{slot} = \"{name}\"\n"),
                &format!("{slot} = \"{name}\"\n{slot}_config = {{ {} }}\n", config.replace('=', " = ")),
            )
            .replace("repeats = 3", "repeats = 1")
            .replace("steps = 100", "steps = 30");
        std::fs::write(folder.join("suite.toml"), suite).unwrap();
        let out_path = folder.join("r.json");
        run_ok(installed_harness(&folder).args(["run", "suite.toml", "-q", "--out"]).arg(&out_path));
        let r = results(&out_path);
        let e = entry(&r, &format!("mlp-tiny/with-{name}/r0"));
        assert_eq!(e["status"], "ok", "{lang} {kind}: {e}");
        if kind == "checkpoint-policy" {
            assert!(e["metrics"]["checkpoints_written"].as_u64().unwrap_or(0) >= 1, "{lang} {kind}: {e}");
        }
    }
}

#[test]
fn plugin_new_in_c_for_wasm_builds_a_component_that_trains_like_the_rust_allreduce() {
    scaffolded_component_trains_like_the_rust_allreduce("c-wasm", "my-cw");
}

#[test]
fn plugin_bench_times_a_hook_of_every_kind() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_ok(
        harness(dir.path())
            .args(["plugin", "bench", "--calls", "2000"])
            .arg(artifact("fixed.wasm"))
            .arg(artifact("libfixed.so"))
            .arg(artifact("allreduce.wasm"))
            .arg(artifact("every-n.wasm")),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for hook in ["batch-sizing.next", "gradient-compression.compress", "checkpointing.decide"] {
        let row = text.lines().find(|l| l.contains(hook)).unwrap_or_else(|| panic!("no {hook} row in\n{text}"));
        // calls, then p50 / p90 / p99 / mean of the host's meter and the
        // back-to-back mean in ns: all positive numbers.
        let nums: Vec<f64> = row.split(['│', '┆']).filter_map(|c| c.trim().parse().ok()).collect();
        assert_eq!(nums.len(), 6, "{row}");
        assert_eq!(nums[0], 2000.0);
        assert!(nums[1..].iter().all(|&n| n > 0.0), "{row}");
    }
}

/// Each artifact is timed on its own: one that fails a call (a checkpoint
/// policy that deletes a checkpoint twice) or cannot be loaded (another
/// ABI version) gets a row and a line with its file name and error, the
/// good ones before and after it are timed, and the exit code says so.
#[test]
fn plugin_bench_reports_every_artifact_and_each_failure() {
    let dir = tempfile::tempdir().unwrap();
    let out = harness(dir.path())
        .args(["plugin", "bench", "--calls", "200"])
        .arg(artifact("fixed.wasm"))
        .arg(artifact("hostile-checkpoint.wasm"))
        .arg(artifact("libbad-abi.so"))
        .arg(artifact("allreduce.wasm"))
        .output()
        .unwrap();
    let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(harness::cli::exit::ARTIFACT_FAILED), "{text}\n{err}");
    for hook in ["batch-sizing.next", "gradient-compression.compress"] {
        let row = text.lines().find(|l| l.contains(hook)).unwrap_or_else(|| panic!("no {hook} row in\n{text}"));
        let nums: Vec<f64> = row.split(['│', '┆']).filter_map(|c| c.trim().parse().ok()).collect();
        assert_eq!(nums[0], 200.0, "{row}");
    }
    for file in ["hostile-checkpoint.wasm", "libbad-abi.so"] {
        assert!(text.lines().any(|l| l.contains(file) && l.contains("FAILED")), "no row for {file} in\n{text}");
    }
    let failed = |file: &str| {
        text.lines().find(|l| l.starts_with(&format!("FAILED {file}: "))).unwrap_or_else(|| panic!("no line for {file} in\n{text}"))
    };
    let line = failed("hostile-checkpoint.wasm");
    assert!(line.contains("plugin `hostile-checkpoint.wasm`") && line.contains("delete the checkpoint of step 10 twice"), "{line}");
    let line = failed("libbad-abi.so");
    assert!(line.contains("plugin `libbad-abi.so`") && line.contains("ABI version 999"), "{line}");
    assert!(!text.contains("`bench`"), "{text}");
    assert!(err.contains("2 of 4 artifacts failed"), "{err}");
}

/// Without `--calls`, each artifact is timed on as many calls as take
/// about half a second at the pace of its warm-up: a hook made slow (a
/// 64 MiB write before each call) gets a few hundred, not 200000.
#[test]
fn plugin_bench_by_default_fits_the_calls_to_the_hook() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_ok(harness(dir.path()).args(["plugin", "bench", "--evict-mb", "64"]).arg(artifact("fixed.wasm")));
    let text = String::from_utf8_lossy(&out.stdout);
    let row = text.lines().find(|l| l.contains("batch-sizing.next")).unwrap_or_else(|| panic!("no row in\n{text}"));
    let calls: u64 = row.split(['│', '┆']).nth(4).and_then(|c| c.trim().parse().ok()).unwrap_or_else(|| panic!("{row}"));
    assert!((100..200_000).contains(&calls), "{calls} calls: {row}");
}

/// `harness plugin test` on a reference compressor: every check passes on
/// two thread ranks, and topk's bytes on the wire are reported against an
/// fp32 all-reduce (ratio 0.1 sends k = 6554 values and i32 indices of a
/// 65536-element bucket: 0.2 of the all-reduce's bytes).
#[test]
fn plugin_test_passes_a_reference_compressor() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_ok(harness(dir.path()).args(["plugin", "test", "--plugin-config", "ratio=0.1"]).arg(artifact("topk.wasm")));
    let text = String::from_utf8_lossy(&out.stdout);
    let cells = |l: &str| l.split(['│', '┆']).map(|c| c.trim().to_owned()).filter(|c| !c.is_empty()).collect::<Vec<_>>();
    for check in [
        "determinism",
        "ranks agree",
        "round-trip error",
        "bytes on the wire",
        "state save/load",
        "config: unknown key",
        "config: bad value",
    ] {
        let row = text
            .lines()
            .find(|l| cells(l).first().map(String::as_str) == Some(check))
            .unwrap_or_else(|| panic!("no {check} row in\n{text}"));
        assert_eq!(cells(row)[1], "pass", "{row}\n{text}");
    }
    let bucket = text.lines().find(|l| cells(l).first().map(String::as_str) == Some("65536")).unwrap_or_else(|| panic!("{text}"));
    assert_eq!(cells(bucket)[2..], ["52432", "262144", "0.2000"], "{bucket}");
    assert!(!text.contains("FAILED"), "{text}");
    // The third party's sign-vote (error feedback) saves its residuals: the
    // kit found it did not (resumed steps differed), and now it passes.
    let out = run_ok(harness(dir.path()).args(["plugin", "test"]).arg(artifact("sign-vote.wasm")));
    let text = String::from_utf8_lossy(&out.stdout);
    let row = text.lines().find(|l| cells(l).first().map(String::as_str) == Some("state save/load")).unwrap_or_else(|| panic!("{text}"));
    assert_eq!(cells(row)[1], "pass", "{text}");
}

/// A compressor whose ranks drift apart (the hostile fixture's `diverge`:
/// each rank adds its rank to the average) fails the agreement check,
/// which names the bucket and both ranks' values; the other checks pass,
/// the exit code is 1, and `--json` says the same.
#[test]
fn plugin_test_names_the_check_a_compressor_fails() {
    let dir = tempfile::tempdir().unwrap();
    let test = |json: bool| {
        let mut c = harness(dir.path());
        c.args(["plugin", "test", "--plugin-config", "mode=diverge"]).arg(artifact("hostile.wasm"));
        if json {
            c.arg("--json");
        }
        let out = c.output().unwrap();
        let (text, err) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
        assert_eq!(out.status.code(), Some(exit::PLUGIN_TEST_FAILED), "{text}\n{err}");
        assert!(err.contains("1 of 7 checks failed"), "{err}");
        text
    };
    let text = test(false);
    let failed: Vec<&str> = text.lines().filter(|l| l.starts_with("FAILED ")).collect();
    assert_eq!(failed.len(), 1, "{text}");
    assert!(
        failed[0].starts_with("FAILED ranks agree: step 0, bucket 0 (1 element): rank 0 and rank 1 hold different buckets")
            && failed[0].contains("rank 1 "),
        "{text}"
    );
    let report: serde_json::Value = serde_json::from_str(&test(true)).unwrap();
    assert_eq!(report["passed"], false);
    let checks = report["checks"].as_array().unwrap();
    let failing: Vec<&str> = checks.iter().filter(|c| c["status"] == "fail").filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(failing, ["ranks agree"], "{report}");
}

/// `harness validate` configures every plugin as the suite does, so a
/// misspelt key is reported at its line, not when the entry runs.
#[test]
fn validate_configures_each_plugin_and_points_at_a_bad_config() {
    let dir = tempfile::tempdir().unwrap();
    let suite = |config: &str| {
        format!(
            "[suite]\nname = \"cfg\"\ndevice = \"cpu\"\nworld_size = 2\n{WORKLOAD}\n[[plugin]]\nname = \"topk\"\npath = \"{}\"\n\n\
             [[strategy]]\nname = \"ok\"\ncompressor = \"topk\"\ncompressor_config = {{ ratio = 0.1 }}\n\n\
             [[strategy]]\nname = \"typo\"\ncompressor = \"topk\"\ncompressor_config = {config}\n",
            artifact("topk.wasm").display()
        )
    };
    let good = write(dir.path(), "good.toml", &suite("{ ratio = 0.2 }"));
    let out = run_ok(harness(dir.path()).arg("validate").arg(&good));
    // The suite's name for the plugin, then what the artifact says it is and how it runs.
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(said.contains("plugin `topk`: topk ") && said.contains("(compressor, wasm, contract 0.2.0) from "), "{said}");
    let text = suite("{ ratoi = 0.2 }");
    let bad = write(dir.path(), "bad.toml", &text);
    let out = harness(dir.path()).arg("validate").arg(&bad).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    let line = text.lines().position(|l| l.contains("ratoi")).unwrap() + 1;
    assert!(err.contains(&format!("bad.toml:{line}:")), "the error points at the config's line {line}: {err}");
    assert!(err.contains("strategy `typo`") && err.contains("ratoi"), "{err}");
    assert!(!err.contains("strategy `ok`"), "{err}");
}

/// The C templates make compressors only: asking one for another kind is
/// a usage error (exit code 2), which writes nothing.
#[test]
fn plugin_new_of_a_kind_the_language_does_not_make_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    for lang in ["c", "c-wasm"] {
        let out = harness(dir.path()).args(["plugin", "new", "batch-policy", "b", "--lang", lang]).output().unwrap();
        assert_eq!(out.status.code(), Some(harness::cli::exit::USAGE), "{lang}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("the {lang} template is a compressor")), "{lang}: {err}");
        assert!(!dir.path().join("b").exists(), "{lang}: wrote the folder");
    }
}

/// `./x install`'s wrapper puts libtorch's folders first, then the
/// caller's library path if it has one: never an empty entry, which would
/// make the current folder a library search path.
#[test]
fn the_installed_wrapper_adds_no_empty_library_path_entry() {
    let home = tempfile::tempdir().unwrap();
    let bin = home.path().join("bin");
    let out = std::process::Command::new(repo_root().join("x"))
        .arg("install")
        .arg(&bin)
        .arg("--no-build")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let wrapper = std::fs::read_to_string(bin.join("harness")).unwrap();
    let export = wrapper.lines().find(|l| l.starts_with("export LD_LIBRARY_PATH=")).expect("the wrapper sets the library path");
    for caller in [None, Some(""), Some("/opt/lib")] {
        let mut sh = std::process::Command::new("bash");
        sh.args(["-c", &format!("{export}; printf %s \"$LD_LIBRARY_PATH\"")]);
        match caller {
            None => sh.env_remove("LD_LIBRARY_PATH"),
            Some(v) => sh.env("LD_LIBRARY_PATH", v),
        };
        let path = String::from_utf8(sh.output().unwrap().stdout).unwrap();
        assert!(path.split(':').all(|e| !e.is_empty()), "caller {caller:?}: an empty entry in {path:?}");
        assert!(path.contains("torch/lib"), "{path}");
        assert_eq!(path.ends_with(":/opt/lib"), caller == Some("/opt/lib"), "{path}");
    }
}

/// Issue 63: `harness plugin inspect src/lib.rs` said "invalid ELF
/// header"; it says what the file is and what a plugin is. A native
/// library named without a slash is the file in the folder, not one
/// searched for on the library path.
#[test]
fn inspect_names_a_file_that_is_no_plugin_and_loads_a_bare_name_from_the_folder() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "lib.rs", "// not a plugin\n");
    let out = harness(dir.path()).args(["plugin", "inspect", "lib.rs"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("lib.rs is neither a WebAssembly component nor a known native library (it starts with 2f 2f 20"), "{err}");
    assert!(err.contains("a plugin is a WebAssembly component") && !err.contains("ELF header"), "{err}");
    std::fs::copy(artifact("libtopk.so"), dir.path().join("libtopk.so")).unwrap();
    let out = run_ok(harness(dir.path()).args(["plugin", "inspect", "libtopk.so"]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("name = \"topk\""), "{}", String::from_utf8_lossy(&out.stdout));
}
