//! Reproduction by the operator: `harness reproduce` trains an honest CPU
//! submission again from its bundle alone and finds it bit for bit; a
//! forged copy (one evaluation's loss edited, the hashes recomputed, so
//! that it still verifies) is refused with the figure that differs; the
//! signed record checks against the operator's public key, and an edited
//! record does not.

use sha2::{Digest, Sha256};

use crate::submit::{copy_dir, honest_run, rehash, text};
use crate::{harness, run_ok};

/// Edits a bundle's result.json and writes the manifest's hashes and sizes
/// anew, as a forger would.
fn forge(bundle: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = bundle.join("result.json");
    let mut r: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut r);
    std::fs::write(&path, serde_json::to_vec_pretty(&r).unwrap()).unwrap();
    rehash(bundle);
}

#[test]
fn an_honest_bundle_reproduces_bit_for_bit_and_a_forged_copy_is_refused_with_the_figure() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    honest_run(dir);
    run_ok(harness(dir).args(["submit", "r.json"]));
    let out = run_ok(harness(dir).args(["keygen", "operator.key"]));
    assert!(text(&out).contains("public key: "), "{}", text(&out));
    let public = std::fs::read_to_string(dir.join("operator.key.pub")).unwrap();
    assert_eq!(public.trim().len(), 64, "an ed25519 public key in hex");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(dir.join("operator.key")).unwrap().permissions().mode() & 0o777, 0o600);
    }
    let again = harness(dir).args(["keygen", "operator.key"]).output().unwrap();
    assert_ne!(again.status.code(), Some(0), "a key is never overwritten");

    // The honest bundle: trained again, every evaluation bit for bit.
    let out = run_ok(harness(dir).args(["reproduce", "r.bundle", "--key", "operator.key", "--out", "repro", "-q"]));
    let said = text(&out);
    assert!(said.contains("r.bundle: reproduced"), "{said}");
    assert!(said.contains("bit for bit on the CPU backend; largest difference 0.00e0"), "{said}");
    let record_path = std::fs::read_dir(dir.join("repro"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with(".reproduction.json"))
        .expect("a record");
    let record: serde_json::Value = serde_json::from_slice(&std::fs::read(&record_path).unwrap()).unwrap();
    assert_eq!(record["reproduced"], true);
    // The operator's rerun travels beside the record that hashes it.
    let rerun = std::fs::read(record_path.with_extension("rerun.json")).expect("the rerun beside the record");
    assert_eq!(record["rerun_sha256"], hex::encode(Sha256::digest(&rerun)));
    assert_eq!(record["bundle"]["plugin_name"], "sign-vote");
    assert!(record["comparison"]["evaluations_compared"].as_u64().unwrap() >= 9, "{record}");
    assert!(record["comparison"]["timing"].as_array().unwrap().iter().any(|t| t["figure"] == "time to target over the baseline's"));

    // Anyone checks the signed record against the operator's public key.
    let rec = record_path.to_str().unwrap();
    let out = run_ok(harness(dir).args(["verify", "r.bundle", "--reproduction", rec, "--public-key", "operator.key.pub"]));
    assert!(text(&out).contains("signed reproduction record: reproduced"), "{}", text(&out));
    let edited = std::fs::read_to_string(&record_path).unwrap().replacen("\"reproduced\": true", "\"reproduced\": false", 1);
    let forged_record = dir.join("edited.reproduction.json");
    std::fs::write(&forged_record, edited).unwrap();
    std::fs::copy(format!("{rec}.sig"), dir.join("edited.reproduction.json.sig")).unwrap();
    let out = harness(dir)
        .args(["verify", "r.bundle", "--reproduction", "edited.reproduction.json", "--public-key", "operator.key.pub"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("the signature does not match the record"), "{}", text(&out));

    // What the signer wrote about its machine reaches the terminal escaped.
    let mut hostile: serde_json::Value = serde_json::from_slice(&std::fs::read(&record_path).unwrap()).unwrap();
    hostile["machine"]["hostname"] = "node\u{1b}]0;owned\u{7}".into();
    let bytes = serde_json::to_vec_pretty(&hostile).unwrap();
    std::fs::write(dir.join("hostile.reproduction.json"), &bytes).unwrap();
    let secret = std::fs::read_to_string(dir.join("operator.key")).unwrap();
    let sig = harness::report::reproduction::sign(&bytes, secret.trim()).unwrap();
    std::fs::write(dir.join("hostile.reproduction.json.sig"), serde_json::to_vec_pretty(&sig).unwrap()).unwrap();
    let out = run_ok(harness(dir).args([
        "verify",
        "r.bundle",
        "--reproduction",
        "hostile.reproduction.json",
        "--public-key",
        "operator.key.pub",
    ]));
    let said = text(&out);
    assert!(said.contains(r"(node\u{1b}]0;owned\u{7})") && !said.contains('\u{1b}'), "{said:?}");

    // A forged copy: the submission's first evaluation of its first repeat
    // made better, the manifest's hashes recomputed. The same inputs, so
    // the kept rerun is compared again rather than trained anew.
    copy_dir(&dir.join("r.bundle"), &dir.join("better.bundle"));
    let mut forged_loss = 0.0;
    forge(&dir.join("better.bundle"), |r| {
        let e = r["entries"].as_array_mut().unwrap().iter_mut().find(|e| e["id"] == "gpt-tiny/submission-compression/r0").unwrap();
        let point = &mut e["metrics"]["eval_curve"][0];
        forged_loss = point[2].as_f64().unwrap() - 0.01;
        point[2] = forged_loss.into();
    });
    let out = harness(dir).args(["reproduce", "better.bundle", "--key", "operator.key", "--out", "repro", "-q"]).output().unwrap();
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("comparing with it"), "the rerun of the same inputs is reused: {said}");
    assert!(
        said.contains("gpt-tiny/submission-compression/r0: eval loss at step")
            && said.contains(&format!("is {forged_loss:.6} in the bundle"))
            && said.contains("better.bundle: NOT reproduced"),
        "{said}"
    );

    // Issue 60: a genuine, validly signed record that says NOT reproduced
    // checks, but `verify --reproduction` must not exit 0 on it.
    let not_reproduced = std::fs::read_dir(dir.join("repro"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().contains("better.bundle-") && p.to_string_lossy().ends_with(".reproduction.json"))
        .expect("the forged copy's record");
    let out = harness(dir)
        .args(["verify", "better.bundle", "--reproduction", not_reproduced.to_str().unwrap(), "--public-key", "operator.key.pub"])
        .output()
        .unwrap();
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("signed reproduction record: NOT reproduced") && said.contains("difference: gpt-tiny/"), "{said}");

    // Issue 60: the board ranks the operator's rerun, beside the claim,
    // with the records checked against the operator's key; the NOT
    // reproduced record of the forged copy does not unrank the honest one.
    let out = run_ok(harness(dir).args([
        "report",
        "r.bundle",
        "--reproductions",
        "repro",
        "--public-key",
        "operator.key.pub",
        "--out-dir",
        "board",
    ]));
    assert!(text(&out).contains("2 signed reproduction records (1 reproduced)"), "{}", text(&out));
    let md = std::fs::read_to_string(dir.join("board/LEADERBOARD.md")).unwrap();
    let row = md.lines().find(|l| l.contains("`r.bundle`")).unwrap_or_else(|| panic!("no row:\n{md}"));
    assert!(row.starts_with("| 1 | sign-vote 0.3.1 |") && row.contains("operator, 1 rerun (claimed "), "{row}");
    // A record under another key is not the operator's: nothing ranks.
    run_ok(harness(dir).args(["keygen", "other.key"]));
    let out = run_ok(harness(dir).args([
        "report",
        "r.bundle",
        "--reproductions",
        "repro",
        "--public-key",
        "other.key.pub",
        "--out-dir",
        "board2",
    ]));
    assert!(text(&out).contains("reproduction record not used") && text(&out).contains("was signed by the key"), "{}", text(&out));
    let md = std::fs::read_to_string(dir.join("board2/LEADERBOARD.md")).unwrap();
    assert!(md.lines().any(|l| l.starts_with("| - | sign-vote 0.3.1 |") && l.contains("self-reported")), "{md}");

    // Issue 60: the forged claim planted as a finished rerun of the same
    // inputs in another operator folder was compared with itself and
    // "reproduced". Without this operator's seal it is trained over.
    let kept = std::fs::read_dir(dir.join("repro/reruns")).unwrap().flatten().next().expect("the kept rerun").file_name();
    let planted = dir.join("planted/reruns").join(&kept);
    std::fs::create_dir_all(&planted).unwrap();
    std::fs::copy(dir.join("better.bundle/result.json"), planted.join("result.json")).unwrap();
    // Once it says so and starts training, it is stopped (with the run it
    // started): that the rerun of these inputs refutes the forged claim is
    // shown above, and training it a third time would only cost the tests
    // a minute.
    let said = until_said(
        harness(dir).args(["reproduce", "better.bundle", "--out", "planted", "-q"]),
        dir,
        &["does not carry this operator's seal", "training it again"],
    );
    assert!(said.contains("does not carry this operator's seal") && said.contains("training it again"), "{said}");
}

/// Runs `c` in a process group of its own, its output into files of `dir`,
/// until everything in `wanted` was printed (or it ended), then kills the
/// group; returns stdout and stderr together.
fn until_said(c: &mut std::process::Command, dir: &std::path::Path, wanted: &[&str]) -> String {
    use std::os::unix::process::CommandExt;
    let (out, err) = (dir.join("until.stdout"), dir.join("until.stderr"));
    let mut child =
        c.process_group(0).stdout(std::fs::File::create(&out).unwrap()).stderr(std::fs::File::create(&err).unwrap()).spawn().unwrap();
    let said = || std::fs::read_to_string(&out).unwrap_or_default() + &std::fs::read_to_string(&err).unwrap_or_default();
    let started = std::time::Instant::now();
    while !wanted.iter().all(|w| said().contains(w)) && child.try_wait().unwrap().is_none() {
        assert!(started.elapsed() < std::time::Duration::from_secs(300), "still not said after 5 minutes: {}", said());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // SAFETY: a signal to the process group this test started.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    child.wait().unwrap();
    said()
}
