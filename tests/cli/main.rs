//! End-to-end tests of the `harness` binary: they run it as a user would and
//! read what it leaves behind.

mod batch_policies;
mod checkpoints;
mod compressors;
mod contract_0_1;
mod errors;
mod hostile_files;
mod hostile_paths;
mod hostile_secrets;
mod hostile_suites;
mod out_of_memory;
mod plugins;
mod report;
mod reproduce;
mod resume;
mod run;
mod sandbox;
mod standard;
mod submit;
mod t5;
mod vision;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Held by the tests whose checks depend on wall-clock deadlines (the
/// sandbox's attacks) and by those that build plugins with other languages'
/// toolchains, which load every core for seconds: the two never run side
/// by side, so a deadline is not missed for want of a core.
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The device the hostile-input suites (hostile_suites, hostile_secrets,
/// sandbox) train on: the CPU, unless `HARNESS_TEST_DEVICE=cuda` (their run
/// on a GPU machine, bench/hostile_gpu.sh) and the suite's `world` ranks fit
/// the `HARNESS_TEST_GPUS` GPUs (default 1) the machine has; a suite of more
/// ranks then stays on the CPU, and says so.
pub fn hostile_device(world: u32) -> &'static str {
    match std::env::var("HARNESS_TEST_DEVICE").as_deref() {
        Err(_) | Ok("cpu") => "cpu",
        Ok("cuda") => {
            let gpus: u32 = std::env::var("HARNESS_TEST_GPUS").map_or(1, |g| g.parse().expect("HARNESS_TEST_GPUS is a number"));
            if world <= gpus {
                "cuda"
            } else {
                eprintln!("note: {world} ranks on the CPU: HARNESS_TEST_GPUS={gpus}");
                "cpu"
            }
        }
        Ok(other) => panic!("HARNESS_TEST_DEVICE={other}: `cpu` or `cuda`"),
    }
}

/// The repository root (suites/ lives there).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("host/ has a parent").to_path_buf()
}

/// A built plugin artifact, `target/plugins/<name>` (`topk.wasm`,
/// `libtopk.so`); fails with what to run when it is missing.
pub fn artifact(name: &str) -> PathBuf {
    let p = repo_root().join("target/plugins").join(name);
    assert!(p.exists(), "{} is missing: run scripts/build-plugins.sh (./x test does)", p.display());
    p
}

/// libtorch's CPU threads per `harness` process: one, unless the caller's
/// `OMP_NUM_THREADS` says otherwise. The tests run side by side (one per
/// core), and a process whose OpenMP pool spans every core oversubscribes
/// them: its threads spin at each barrier while the other test holds the
/// core. On 2 cores with a build beside it, the default suite took 307 s of
/// CPU with two threads against 46 s with one.
fn cpu_threads(c: &mut Command) -> &mut Command {
    c.env("OMP_NUM_THREADS", std::env::var("OMP_NUM_THREADS").unwrap_or_else(|_| "1".into()))
}

/// A `harness` command run from `dir`.
pub fn harness(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_harness"));
    c.current_dir(dir);
    cpu_threads(&mut c);
    c
}

/// The `harness` command a user gets from `./x install DIR`, run from
/// `dir` without this process's library path (the command finds libtorch
/// on its own): installed once per test process, wrapping the binary these
/// tests run.
pub fn installed_harness(dir: &Path) -> Command {
    static INSTALLED: std::sync::OnceLock<(tempfile::TempDir, PathBuf)> = std::sync::OnceLock::new();
    let (_, bin) = INSTALLED.get_or_init(|| {
        let home = tempfile::tempdir().expect("a temporary folder");
        let bin = home.path().join("bin");
        let out = Command::new(repo_root().join("x")).arg("install").arg(&bin).arg("--no-build").output().expect("./x runs");
        assert!(out.status.success(), "./x install failed:\n{}", String::from_utf8_lossy(&out.stderr));
        (home, bin.join("harness"))
    });
    let mut c = Command::new(bin);
    c.current_dir(dir).env_remove("LD_LIBRARY_PATH");
    cpu_threads(&mut c);
    c
}

/// Runs to completion and returns the output.
pub fn run_ok(c: &mut Command) -> Output {
    let out = c.output().expect("harness starts");
    assert!(
        out.status.success(),
        "harness failed ({:?})\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A result file, as JSON.
pub fn results(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).expect("result file")).expect("result JSON")
}

/// The entry `id` of a result file.
pub fn entry<'a>(r: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    r["entries"].as_array().unwrap().iter().find(|e| e["id"] == id).unwrap_or_else(|| panic!("no entry {id}"))
}

/// The train losses of the entry `id` of a result file (its loss curve
/// without steps and clock).
pub fn losses(r: &serde_json::Value, id: &str) -> Vec<serde_json::Value> {
    entry(r, id)["metrics"]["loss_curve"].as_array().unwrap().iter().map(|p| p[2].clone()).collect()
}

/// Writes `text` to `dir/name` and returns the path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write fixture");
    p
}

/// A small suite: `workloads` is appended after a CPU `[suite]` table.
pub fn suite(name: &str, extra_meta: &str, workloads: &str) -> String {
    format!("[suite]\nname = \"{name}\"\ndevice = \"cpu\"\nwarmup_steps = 2\nthreads = 1\n{extra_meta}\n{workloads}")
}

/// A `[[plugin]]` table naming the built plugin artifact `file` (a `.wasm`
/// component or a native library) `name`.
pub fn plugin_table(name: &str, file: &str) -> String {
    format!("[[plugin]]\nname = \"{name}\"\npath = \"{}\"\n", artifact(file).display())
}

/// The strategies of the two-rank restore tests, with the plugin tables
/// they need: the built-in all-reduce (the baseline) and top-k keeping 10%
/// with error feedback (plugin state), each checkpointing every 5 steps and
/// keeping 2.
pub fn checkpointed_allreduce_and_topk() -> String {
    format!(
        r#"{}{}
[[strategy]]
name = "ddp"
baseline = true
checkpoint = "every-n"
checkpoint_config = {{ every = 5, keep = 2 }}

[[strategy]]
name = "topk"
compressor = "topk"
compressor_config = {{ ratio = 0.1 }}
checkpoint = "every-n"
checkpoint_config = {{ every = 5, keep = 2 }}
"#,
        plugin_table("every-n", "libevery-n.so"),
        plugin_table("topk", "libtopk.so"),
    )
}

/// A tiny token workload with the given name, steps and extra keys.
pub fn tiny_gpt(name: &str, steps: u32, extra: &str) -> String {
    format!(
        r#"
[[workload]]
name = "{name}"
model = {{ kind = "gpt", preset = "tiny" }}
data = {{ kind = "synthetic", vocab = 64, branching = 2 }}
batch = 8
seq_len = 32
steps = {steps}
optimizer = {{ kind = "adamw", lr = 3e-3, betas = [0.9, 0.95] }}
eval_batches = 2
{extra}
"#
    )
}
