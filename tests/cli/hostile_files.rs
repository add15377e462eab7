//! Hostile inputs: encoded blobs and oversized files that `harness verify`
//! and `harness report` read.
//!
//! Issue 61: a 156-byte step histogram whose V2 header declared a payload
//! of 0xFFFFFFF0 bytes made hdrhistogram's decoder allocate 4 GiB:
//! `harness verify` took 133 s and 4.5 GiB, and aborted under a 3 GiB
//! address-space limit; `harness report` aborted (no board) even when the
//! histogram was in a plain result file beside honest bundles. Both run
//! here under a limit of about 1 GiB above what `harness` needs at all
//! (the honest bundle verifies under it), which the old decoder blows.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;

use crate::repo_root;
use crate::submit::{copy_dir, rehash, text};

/// A committed bundle that verifies as it is (its component is inspected
/// in the sandbox), and its result's first entry.
const REAL: &str = "results/h100/submissions/1.2/compression-topk.bundle";
const ENTRY: &str = "gpt2-124m/allreduce/r0";

/// The data limit (`ulimit -d`, RLIMIT_DATA: private writable memory,
/// which the libraries' data segments count in) `harness` runs under, in
/// KiB: 1 GiB above the 600 MiB that `harness --version` needs to start
/// (libtorch's and CUDA's libraries loaded; measured on the CI machine:
/// 592 MiB starts, `verify` of the honest bundle needs 640 to 704 MiB). The
/// 4 GiB the old decoder asked for is refused. An address-space limit
/// (`ulimit -v`) would also count the ranges wasmtime reserves for a
/// component's memory (4 GiB and guard pages, never touched): the honest
/// bundle needs over 4 GiB of address space to verify.
const DATA_LIMIT_KIB: u64 = (1 << 20) + (600 << 10);

/// `harness ARGS` run from `dir` under [`DATA_LIMIT_KIB`], killed after
/// `deadline` (the test then fails saying so).
fn limited(dir: &Path, args: &[&str], deadline: Duration) -> (Output, Duration) {
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(format!("ulimit -d {DATA_LIMIT_KIB} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_harness"))
        .args(args)
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = c.spawn().expect("sh starts");
    while child.try_wait().expect("waiting for harness").is_none() {
        if started.elapsed() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("harness {args:?} ran past {deadline:?}\n{}", text(&out));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    (child.wait_with_output().unwrap(), started.elapsed())
}

/// The histogram `text` with bytes 4..8 (the V2 payload length) set to
/// 0xFFFFFFF0: the reviewer's bomb.
fn bomb(text: &str) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut bytes = b64.decode(text).unwrap();
    bytes[4..8].copy_from_slice(&0xFFFF_FFF0u32.to_be_bytes());
    b64.encode(bytes)
}

/// The result file `raw` with [`ENTRY`]'s step histogram made a bomb, its
/// bytes otherwise unchanged.
fn bombed_result(raw: &str) -> String {
    let r: serde_json::Value = serde_json::from_str(raw).unwrap();
    let entry = r["entries"].as_array().unwrap().iter().find(|e| e["id"] == ENTRY).unwrap();
    let step = entry["histograms"]["step"].as_str().unwrap();
    assert_eq!(raw.matches(step).count(), 1, "the step histogram appears once");
    raw.replacen(step, &bomb(step), 1)
}

#[test]
fn verify_refuses_a_4_gib_histogram_bomb_quickly_within_1_gib() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let honest = dir.join("honest.bundle");
    copy_dir(&repo_root().join(REAL), &honest);
    // Control: the honest bundle verifies under the same limit.
    let (out, _) = limited(dir, &["verify", "honest.bundle"], Duration::from_secs(120));
    assert!(out.status.success() && text(&out).contains("honest.bundle: verified"), "{}", text(&out));

    let forged = dir.join("bomb.bundle");
    copy_dir(&honest, &forged);
    let raw = std::fs::read_to_string(forged.join("result.json")).unwrap();
    std::fs::write(forged.join("result.json"), bombed_result(&raw)).unwrap();
    rehash(&forged);
    let (out, took) = limited(dir, &["verify", "bomb.bundle"], Duration::from_secs(120));
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "refused, not aborted:\n{said}");
    assert!(
        said.contains(&format!(
            "{ENTRY}'s step histogram does not decode: the histogram's header declares a payload of 4294967280 bytes (bytes 4..8)"
        )) && said.contains("at most 304128 for harness's histograms"),
        "{said}"
    );
    assert!(!said.contains("memory allocation"), "{said}");
    assert!(took < Duration::from_secs(60), "verify of the bomb took {took:?}");
}

#[test]
fn report_refuses_a_result_with_a_histogram_bomb_and_builds_the_board_from_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let results = dir.join("results");
    std::fs::create_dir(&results).unwrap();
    let raw = std::fs::read_to_string(repo_root().join(REAL).join("result.json")).unwrap();
    std::fs::write(results.join("honest.json"), &raw).unwrap();
    std::fs::write(results.join("bomb.json"), bombed_result(&raw)).unwrap();
    // A link out of the folder and a FIFO (whose opening would wait for a
    // writer forever) are refused, not read.
    let outside: PathBuf = dir.join("outside.json");
    std::fs::write(&outside, &raw).unwrap();
    std::os::unix::fs::symlink(&outside, results.join("link.json")).unwrap();
    assert!(Command::new("mkfifo").arg(results.join("fifo.json")).status().unwrap().success());

    let (out, took) = limited(dir, &["report", "results", "--out-dir", "board"], Duration::from_secs(120));
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains(&format!(
            "note: refused results/bomb.json: entry {ENTRY}'s `step` histogram does not decode: the histogram's header declares a payload of 4294967280 bytes (bytes 4..8)"
        )),
        "{said}"
    );
    assert!(said.contains("note: skipped results/link.json, a symbolic link"), "{said}");
    assert!(said.contains("note: refused results/fifo.json: results/fifo.json is a FIFO (named pipe), not a regular file"), "{said}");
    assert!(said.contains("1 result files (0 bundles"), "the board holds the honest result alone: {said}");
    let board = std::fs::read_to_string(dir.join("board/LEADERBOARD.md")).unwrap();
    assert!(board.contains("gpt2-124m"), "{board}");
    assert!(took < Duration::from_secs(60), "report took {took:?}");

    // A file named on the command line is refused the same way.
    let (out, _) = limited(dir, &["report", "results/bomb.json", "results/honest.json", "--out-dir", "board2"], Duration::from_secs(120));
    assert!(out.status.success() && text(&out).contains("note: refused results/bomb.json"), "{}", text(&out));
}
