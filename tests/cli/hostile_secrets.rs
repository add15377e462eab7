//! Hostile inputs: the compile cache and checkpoints, sealed by keys kept
//! away from what they seal (issue 61). Every command here runs with its
//! own key folder (`HARNESS_STATE_DIR`) and cache (`HARNESS_CACHE`), never
//! the user's.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use harness::train::checkpoint;

use crate::*;

/// A key folder and a cache folder of the test's own.
struct Folders {
    dir: tempfile::TempDir,
}

impl Folders {
    fn new() -> Folders {
        Folders { dir: tempfile::tempdir().unwrap() }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn state(&self) -> PathBuf {
        self.path().join("state")
    }

    fn cache(&self) -> PathBuf {
        self.path().join("cache")
    }

    /// `harness` run from the test's folder with its key folder `state`.
    fn harness_with(&self, state: &Path) -> Command {
        let mut c = harness(self.path());
        c.env("HARNESS_STATE_DIR", state).env("HARNESS_CACHE", self.cache());
        c
    }

    fn harness(&self) -> Command {
        self.harness_with(&self.state())
    }
}

/// `harness plugin inspect` of `wasm`: its output.
fn inspect(c: &mut Command, wasm: &Path) -> Output {
    run_ok(c.args(["plugin", "inspect"]).arg(wasm))
}

/// The compile cache's entry files (code, seal) of the artifact `wasm`.
fn cache_entry(components: &Path, wasm: &Path) -> (PathBuf, PathBuf) {
    let sha = harness::plugin::sha256_file(wasm).unwrap();
    let code = fs::read_dir(components)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "cwasm") && p.file_name().unwrap().to_string_lossy().starts_with(&sha))
        .unwrap_or_else(|| panic!("no cache entry of {} in {}", wasm.display(), components.display()));
    (code.clone(), code.with_extension("sha256"))
}

/// Issue 61, first finding: the compile cache kept its HMAC key in the
/// cache folder (`components/secret`), so whoever supplied the folder
/// supplied the key. With the secret set to zeros, another component's
/// compiled code sealed under rt-ramp's sha256 ran as rt-ramp. Now the key
/// lives in the user's state folder: the same plant (a secret of zeros, the
/// other component's code sealed with it under this one's sha256) is not
/// loaded, the component is compiled again from its artifact, and a note
/// says the old secret is not trusted.
#[test]
fn r61_a_cache_folder_that_brings_its_own_key_does_not_run_its_code() {
    let f = Folders::new();
    let (ours, theirs) = (artifact("every-n.wasm"), artifact("ramp.wasm"));
    let text = |o: &Output| String::from_utf8_lossy(&o.stdout).into_owned();
    let honest = text(&inspect(&mut f.harness(), &ours));
    assert!(honest.contains("kind = \"checkpoint-policy\""), "{honest}");
    assert!(text(&inspect(&mut f.harness(), &theirs)).contains("kind = \"batch-policy\""));
    // The key is in the state folder, the user's alone; the cache holds none.
    let key = f.state().join("compile-cache.key");
    assert_eq!(fs::metadata(&key).unwrap().len(), 32);
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&fs::metadata(&key).unwrap().permissions()) & 0o777, 0o600);
    let components = f.cache().join("components");
    for e in fs::read_dir(&components).unwrap() {
        let p = e.unwrap().path();
        assert!(p.extension().is_some_and(|x| x == "cwasm" || x == "sha256"), "{} in the cache", p.display());
    }

    // The plant: a secret of zeros, and the other component's code sealed
    // with it (as the older harness sealed) under this component's sha256.
    let (code, sum) = cache_entry(&components, &ours);
    let (their_code, _) = cache_entry(&components, &theirs);
    let foreign = fs::read(&their_code).unwrap();
    fs::write(components.join("secret"), [0u8; 32]).unwrap();
    let cache_key = code.file_stem().unwrap().to_string_lossy().into_owned();
    let sha = harness::plugin::sha256_file(&ours).unwrap();
    let code_sha = hex::encode(Sha256::digest(&foreign));
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&[0u8; 32]).unwrap();
    mac.update(format!("{cache_key}\n{sha}\n{code_sha}").as_bytes());
    let mac = hex::encode(mac.finalize().into_bytes());
    fs::write(&code, &foreign).unwrap();
    fs::write(&sum, format!("artifact {sha}\ncode {code_sha}\nmac {mac}\n")).unwrap();

    let out = inspect(&mut f.harness(), &ours);
    assert_eq!(text(&out), honest, "the planted code ran as {}", ours.display());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("components/secret") && err.contains("is not trusted"), "{err}");
    assert_eq!(err.matches("is not trusted").count(), 1, "{err}");
    // The entry was compiled again and replaced: no longer the plant.
    assert_ne!(fs::read(&sum).unwrap(), format!("artifact {sha}\ncode {code_sha}\nmac {mac}\n").into_bytes());
    assert_eq!(text(&inspect(&mut f.harness(), &ours)), honest);

    // The same cache used with another user's key folder: the entries are
    // not sealed with that key, so they are compiled again and sealed anew
    // (their seals change), never loaded.
    let (_, their_sum) = cache_entry(&components, &theirs);
    let sealed = fs::read(&their_sum).unwrap();
    inspect(&mut f.harness_with(&f.path().join("other-user")), &theirs);
    assert_ne!(fs::read(&their_sum).unwrap(), sealed, "an entry sealed with another key was loaded");
    // The state folder may not hide in the cache, where the cache's
    // supplier would supply it: the cache is then not used.
    let out = inspect(&mut f.harness_with(&f.cache().join("keys")), &ours);
    assert_eq!(text(&out), honest);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("compiled without the compile cache") && err.contains("lies in the cache folder"), "{err}");
    assert!(!f.cache().join("keys").exists(), "a key was made in the cache");
}

/// A suite of one entry that checkpoints every step (`every-n` from its
/// WebAssembly component).
fn checkpointing_suite(dir: &Path) -> PathBuf {
    let strategy = "\n[[strategy]]\nname = \"every1\"\ncheckpoint = \"every-n\"\ncheckpoint_config = { every = 1, keep = 1 }\n";
    let w = tiny_gpt("a", 400, "") + &plugin_table("every-n", "every-n.wasm") + strategy;
    let s = suite("sealed", "", &w).replace("device = \"cpu\"", &format!("device = \"{}\"", hostile_device(1)));
    write(dir, "s.toml", &s)
}

/// Runs `suite` into `out` until it has a checkpoint of step 3 or later,
/// then SIGKILLs it; returns that checkpoint's folder.
fn killed_after_a_checkpoint(f: &Folders, suite: &Path, out: &Path) -> PathBuf {
    let root = out.with_extension("checkpoints").join("a_every1_r0");
    let mut child = f.harness().args(["run", "-q"]).arg(suite).arg("--out").arg(out).spawn().unwrap();
    let t0 = Instant::now();
    while checkpoint::list(&root).last().is_none_or(|c| c.0 < 3) {
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint appeared in {}", root.display());
        assert!(child.try_wait().unwrap().is_none(), "harness finished before it could be killed");
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    checkpoint::list(&root).last().unwrap().1.clone()
}

/// `json` (as serde_json writes it, pretty or not) without the whitespace
/// outside its strings: the compact form.
fn compact(json: &str) -> String {
    let (mut out, mut in_string, mut escaped) = (String::new(), false, false);
    for c in json.chars() {
        if in_string {
            escaped = !escaped && c == '\\';
            in_string = escaped || c != '"';
        } else if c.is_whitespace() {
            continue;
        } else {
            in_string = c == '"';
        }
        out.push(c);
    }
    out
}

/// The manifest's sha256 as the writer computes it (as format 2 did, and
/// anyone can): of its compact JSON with its own hash and seal emptied.
fn manifest_digest(text: &str) -> String {
    let m: serde_json::Value = serde_json::from_str(text).unwrap();
    let (sha, key, hmac) = (m["sha256"].as_str().unwrap(), m["seal"]["key"].as_str().unwrap(), m["seal"]["hmac"].as_str().unwrap());
    let c = compact(text)
        .replace(&format!("\"sha256\":\"{sha}\""), "\"sha256\":\"\"")
        .replace(&format!("\"seal\":{{\"key\":\"{key}\",\"hmac\":\"{hmac}\"}}"), "\"seal\":{\"key\":\"\",\"hmac\":\"\"}");
    hex::encode(Sha256::new().chain_update(b"harness checkpoint manifest\n").chain_update(c).finalize())
}

/// The sha256 a file record holds for `bytes`: of the sha256 digests of
/// its 64 MiB pieces (one piece here).
fn record_digest(bytes: &[u8]) -> String {
    assert!(bytes.len() < 64 << 20);
    hex::encode(Sha256::digest(Sha256::digest(bytes)))
}

/// Rewrites the checkpoint in `dir` as the reviewer of issue 61 did:
/// other weights (every f32 parameter 0.5) with every hash recomputed (the
/// model file's record, the manifest's sha256), the seal left as it was.
fn rewrite_with_recomputed_hashes(dir: &Path) {
    let manifest = dir.join("checkpoint.json");
    let text = fs::read_to_string(&manifest).unwrap();
    // The recomputation is the writer's: it reproduces the honest hash.
    let honest: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(manifest_digest(&text), honest["sha256"].as_str().unwrap(), "the test's digest is not the writer's");
    let model = dir.join("model.safetensors");
    let old = fs::read(&model).unwrap();
    let mut new = old.clone();
    let n = u64::from_le_bytes(old[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&old[8..8 + n]).unwrap();
    for (name, t) in header.iter().filter(|(name, _)| *name != "__metadata__") {
        if t["dtype"] == "F32" {
            let (a, b) = (t["data_offsets"][0].as_u64().unwrap() as usize, t["data_offsets"][1].as_u64().unwrap() as usize);
            for v in new[8 + n + a..8 + n + b].chunks_mut(4) {
                v.copy_from_slice(&0.5f32.to_le_bytes());
            }
        } else {
            eprintln!("{name} left as it was ({})", t["dtype"]);
        }
    }
    assert_ne!(new, old);
    fs::write(&model, &new).unwrap();
    let (was, now) = (record_digest(&old), record_digest(&new));
    assert_eq!(text.matches(&was).count(), 1, "{text}");
    let text = text.replace(&was, &now);
    let text = text.replace(honest["sha256"].as_str().unwrap(), &manifest_digest(&text));
    fs::write(&manifest, text).unwrap();
    checkpoint::verify(dir).expect("the rewritten checkpoint is whole: every hash holds");
}

/// `harness run --resume` of `suite` into `out` with the key folder
/// `state`: the entry `a/every1/r0` of the result.
fn resumed(f: &Folders, state: &Path, suite: &Path, out: &Path) -> (Option<i32>, serde_json::Value) {
    let o = f.harness_with(state).args(["run", "-q", "--resume"]).arg(suite).arg("--out").arg(out).output().unwrap();
    (o.status.code(), entry(&results(out), "a/every1/r0").clone())
}

/// Issue 61, second finding: format 2's seal was an unkeyed sha256, so a
/// checkpoint rewritten with recomputed hashes resumed (random weights
/// trained on to eval loss 185). Its seal is now an HMAC under the user's
/// key, kept outside the checkpoint folder: `--resume` refuses the
/// rewrite by name (the checkpoint's folder, hence its step, and `seal`),
/// failing the entry; a checkpoint taken to another user's or machine's
/// key is refused the same way; and an honest one, written by an earlier
/// process of the same user, resumes.
#[test]
fn r61_a_checkpoint_rewritten_with_recomputed_hashes_is_refused_by_name_on_resume() {
    let f = Folders::new();
    let s = checkpointing_suite(f.path());

    let out = f.path().join("rewritten.json");
    let newest = killed_after_a_checkpoint(&f, &s, &out);
    let key = f.state().join("checkpoints.key");
    assert_eq!(fs::metadata(&key).unwrap().len(), 32, "the checkpoint key is in HARNESS_STATE_DIR");
    assert!(!fs::read_dir(&newest).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().contains("key")));
    rewrite_with_recomputed_hashes(&newest);
    let (code, a) = resumed(&f, &f.state(), &s, &out);
    assert_eq!(code, Some(harness::cli::exit::ENTRY_FAILED), "{a}");
    assert_eq!(a["status"], "failed", "{a}");
    let e = a["error"].as_str().unwrap();
    assert!(e.contains(&format!("checkpoint {} refused: `seal`", newest.display())), "{e}");
    assert!(e.contains("was changed after it was written") && e.contains(&key.display().to_string()), "{e}");
    assert!(a["metrics"]["resilience"]["resumed_from"].is_null(), "{a}");

    // An honest checkpoint resumed with another key folder (another user,
    // or the checkpoint copied to another machine): refused by its seal.
    let out = f.path().join("elsewhere.json");
    let newest = killed_after_a_checkpoint(&f, &s, &out);
    let (code, a) = resumed(&f, &f.path().join("elsewhere"), &s, &out);
    assert_eq!(code, Some(harness::cli::exit::ENTRY_FAILED), "{a}");
    let e = a["error"].as_str().unwrap();
    assert!(e.contains(&format!("checkpoint {} refused: `seal`", newest.display())) && e.contains("was made with key"), "{e}");

    // The same user's later process resumes an honest checkpoint.
    let out = f.path().join("honest.json");
    let newest = killed_after_a_checkpoint(&f, &s, &out);
    let step: u64 = newest.file_name().unwrap().to_string_lossy()["step-".len()..].parse().unwrap();
    let (code, a) = resumed(&f, &f.state(), &s, &out);
    assert_eq!(code, Some(harness::cli::exit::OK), "{a}");
    assert_eq!(a["metrics"]["resilience"]["resumed_from"].as_u64(), Some(step), "{a}");
}
