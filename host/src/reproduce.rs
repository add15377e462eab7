//! `harness reproduce BUNDLE...`: the operator trains each submission again
//! from its bundle alone and compares the rerun with the claim
//! ([`harness_report::reproduction`]), writing a record per bundle, signed when
//! given the operator's key.
//!
//! The rerun is `harness run` in a child process, of the harness's own copy
//! of the released suite (never the bundle's text), with the bundled
//! WebAssembly artifact (already verified: its bytes are a component, its
//! sha256 the one that ran), its configuration, tracks and GPU count. The
//! plan and the seeds follow from those. Reruns are kept under
//! `OUT/reruns/<inputs>/`, named by a hash of their inputs: a rerun that
//! was cut short is resumed, and two bundles of the same inputs (the same
//! artifact and configuration submitted twice, or a forged copy of a
//! bundle) are compared with the one rerun.
//!
//! What is compared and signed is what was read once: the bundle is
//! copied ([`stage`]) into `OUT/staged/` before it is verified, and
//! everything after (the rerun's inputs, the comparison, the record's
//! hashes) reads that copy, so a bundle changed while its rerun trains
//! changes nothing. A rerun found on disk is used (compared, or resumed)
//! only when it carries this operator's seal ([`seal_rerun`]: a MAC, keyed by a
//! secret of the operator's kept outside `OUT`, over the rerun's inputs
//! and its result file's bytes), which the harness writes when its child
//! `harness run` ends; a result planted there is trained over.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use harness_format::results::{self, RunResult};
use harness_format::secrets::Key;
use harness_format::suite::standard;
use harness_report::reproduction::{self, BundleId, Record, Tolerance};
use harness_report::submission::{self, files, sha256_hex, Bundle, Manifest, MANIFEST, RESULT};

/// A bundle as `harness reproduce` read it, once: the copy in
/// `OUT/staged/` that it verifies, reruns and compares.
pub struct Staged {
    /// The copy's folder.
    pub dir: PathBuf,
    /// The bundle's own folder name (for people; not an identity).
    pub folder: String,
    /// sha256 of the MANIFEST.json read (which holds every other file's).
    pub manifest_sha256: String,
    /// sha256 of the result.json read.
    pub result_sha256: String,
}

/// Copies the bundle in `dir` (its MANIFEST.json and the files it lists,
/// each read confined and capped as verify reads them) to a fresh folder
/// under `out/staged/`, and hashes what it read. Nothing of `dir` is read
/// again afterwards.
pub fn stage(dir: &Path, out: &Path) -> Result<Staged> {
    let read = |f: &str, cap| files::read(dir, f, cap).map_err(|e| anyhow::anyhow!("cannot read {f} of {}: {e}", dir.display()));
    let manifest_bytes = read(MANIFEST, files::MANIFEST_CAP)?;
    let manifest: Manifest =
        serde_json::from_slice(&manifest_bytes).with_context(|| format!("{} is not a bundle manifest", dir.join(MANIFEST).display()))?;
    anyhow::ensure!(
        manifest.files.len() <= files::MAX_FILES,
        "{}'s manifest lists {} files; a bundle holds at most {}",
        dir.display(),
        manifest.files.len(),
        files::MAX_FILES
    );
    let mut copied = Vec::with_capacity(manifest.files.len());
    let mut total = 0u64;
    for f in &manifest.files {
        let bytes = read(&f.path, files::cap(&f.path))?;
        total += bytes.len() as u64;
        anyhow::ensure!(total <= files::TOTAL_CAP, "{}'s files hold more than {} bytes together", dir.display(), files::TOTAL_CAP);
        copied.push((f.path.clone(), bytes));
    }
    let result_sha256 = copied
        .iter()
        .find(|(p, _)| p == RESULT)
        .map(|(_, b)| sha256_hex(b))
        .with_context(|| format!("{} lists no {RESULT}", dir.display()))?;
    let manifest_sha256 = sha256_hex(&manifest_bytes);
    let folder = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| dir.display().to_string());
    let staged = out.join("staged").join(format!("{}.bundle", &manifest_sha256[..16]));
    if staged.exists() {
        std::fs::remove_dir_all(&staged).with_context(|| format!("cannot remove the old copy {}", staged.display()))?;
    }
    for (rel, bytes) in std::iter::once((MANIFEST.to_owned(), manifest_bytes)).chain(copied) {
        // `rel` passed `files::confine`: plain names inside the folder.
        let path = staged.join(&rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        }
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create_new(true);
        let mut file = o.open(&path).with_context(|| format!("cannot create {}", path.display()))?;
        std::io::Write::write_all(&mut file, &bytes).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(Staged { dir: staged, folder, manifest_sha256, result_sha256 })
}

/// The operator's key that seals reruns: the user's key
/// `reproduce-reruns` ([`harness_format::secrets`]), kept outside `OUT`.
fn seal_key() -> Result<Key> {
    Ok(Key::of_user("reproduce-reruns")?)
}

/// What a rerun's seal is a MAC of: its inputs key and its result file.
const SEAL_CONTEXT: &str = "harness reproduce rerun";

/// Where a rerun's seal is kept: beside its result.
fn seal_path(rerun_dir: &Path) -> PathBuf {
    rerun_dir.join("result.seal")
}

/// Seals the rerun's result file as it is now (when its `harness run`
/// ended, finished or cut short).
pub fn seal_rerun(rerun: &Rerun) -> Result<()> {
    seal_result(&seal_key()?, &rerun.dir, &rerun.inputs_key)
}

/// Writes the seal of `dir/result.json` under `key`, if there is one.
fn seal_result(key: &Key, dir: &Path, inputs_key: &str) -> Result<()> {
    let Ok(bytes) = files::read(dir, "result.json", files::cap(RESULT)) else { return Ok(()) };
    let mac = key.mac(SEAL_CONTEXT, &[inputs_key.as_bytes(), &bytes]);
    results::write_atomic(&seal_path(dir), format!("{}\n", hex::encode(mac)).as_bytes())?;
    Ok(())
}

/// The bytes of `dir/result.json`, if its seal is `key`'s for these inputs.
fn sealed_result(key: &Key, dir: &Path, inputs_key: &str) -> Option<Vec<u8>> {
    // Read as a bundle's files are: regular files, no link, within caps.
    let bytes = files::read(dir, "result.json", files::cap(RESULT)).ok()?;
    let mac = files::read(dir, "result.seal", 1024).ok()?;
    let tag = hex::decode(String::from_utf8_lossy(&mac).trim()).ok()?;
    key.verify(SEAL_CONTEXT, &[inputs_key.as_bytes(), &bytes], &tag).then_some(bytes)
}

/// Options of `harness reproduce`.
pub struct Options {
    /// Where the reruns and the records go.
    pub out: PathBuf,
    /// The operator's secret key (`harness keygen`), to sign the records.
    pub key: Option<PathBuf>,
    /// Train again even if a finished rerun of the same inputs is there.
    pub fresh: bool,
    pub quiet: bool,
}

/// A bundle's rerun: what `harness run` is given, and where it writes.
pub struct Rerun {
    pub dir: PathBuf,
    pub result: PathBuf,
    /// The suite file (harness's copy of the released suite).
    pub suite: PathBuf,
    /// Continue a rerun that was cut short.
    pub resume: bool,
    /// `--plugin KIND=PATH`.
    pub plugin: String,
    /// `--plugin-config KEY=VALUE`, each.
    pub plugin_config: Vec<String>,
    /// `--track`, when the bundle ran one track.
    pub track: Option<String>,
    pub gpus: u32,
    /// A finished rerun of these inputs is already there.
    pub done: bool,
    /// sha256 of the rerun's inputs (what it trains), which its seal binds.
    pub inputs_key: String,
}

/// Sets up the rerun of a verified bundle: the released suite and the
/// artifact copied into its folder, and `harness run`'s arguments.
pub fn prepare(dir: &Path, bundle: &Bundle, opts: &Options) -> Result<Rerun> {
    let r = &bundle.result;
    let Some(sub) = &r.submission else { bail!("{} holds no submission record", dir.display()) };
    let Some(released) = standard::released(&r.suite.text) else {
        bail!("{}'s suite is not one this harness releases; reproduce it with the harness version that released it", dir.display())
    };
    let [entered] = sub.entered.as_slice() else {
        bail!("{} enters {} plugins; a submission enters one", dir.display(), sub.entered.len())
    };
    let Some(file) = bundle.manifest.plugins.iter().find(|p| p.kind == entered.kind).and_then(|p| p.file.clone()) else {
        bail!(
            "{} holds the plugin's sha256 and size only (submitted with --no-artifacts): there is nothing to run\nhint: ask the submitter for a bundle with its artifact",
            dir.display()
        )
    };
    // Read confined to the bundle and capped, as verify reads it.
    let artifact = files::read(dir, &file, files::FILE_CAP).map_err(|e| anyhow::anyhow!("cannot read {file} of {}: {e}", dir.display()))?;
    anyhow::ensure!(sha256_hex(&artifact) == entered.sha256, "{file} is not the artifact that ran (verify the bundle first)");
    // The rerun's identity: what it trains, nothing the submitter labels.
    let inputs = serde_json::json!({
        "suite": sha256_hex(released.text.as_bytes()),
        "kind": entered.kind,
        "artifact": entered.sha256,
        "config": entered.config,
        "tracks": sub.tracks,
        "gpus": sub.gpus,
        "harness": env!("CARGO_PKG_VERSION"),
    });
    let key = sha256_hex(inputs.to_string().as_bytes());
    let rerun = opts.out.join("reruns").join(&key[..16]);
    let result = rerun.join("result.json");
    // Only a rerun this operator's harness sealed is compared or resumed;
    // anything else in its folder (planted, or a run whose seal was never
    // written) is trained over.
    let sealed = sealed_result(&seal_key()?, &rerun, &key);
    if sealed.is_none() && rerun.exists() {
        if result.exists() {
            eprintln!(
                "note: {} does not carry this operator's seal (planted, or cut short before it was sealed); training again",
                harness_format::fmt::printable_path(&result)
            );
        }
        std::fs::remove_dir_all(&rerun).with_context(|| format!("cannot clear {}", rerun.display()))?;
    }
    std::fs::create_dir_all(&rerun).with_context(|| format!("cannot create {}", rerun.display()))?;
    let suite_file = rerun.join(Path::new(released.file).file_name().unwrap_or("suite.toml".as_ref()));
    results::write_atomic(&suite_file, released.text.as_bytes())?;
    let plugin = rerun.join(format!("{}.wasm", &sha256_hex(&artifact)[..16]));
    results::write_atomic(&plugin, &artifact)?;
    results::write_atomic(&rerun.join("inputs.json"), (serde_json::to_string_pretty(&inputs)? + "\n").as_bytes())?;
    let existing = sealed.and_then(|b| RunResult::parse(&String::from_utf8_lossy(&b), &result).ok());
    let done = !opts.fresh && existing.as_ref().is_some_and(|x| x.complete);
    if opts.fresh && result.exists() {
        for f in [result.clone(), results::log_path(&result), seal_path(&rerun)] {
            let _ = std::fs::remove_file(f);
        }
    }
    let config = entered
        .config
        .parse::<toml::Table>()
        .with_context(|| format!("the entered plugin's configuration is not TOML: {}", entered.config))?;
    Ok(Rerun {
        suite: suite_file,
        resume: !opts.fresh && existing.is_some(),
        plugin: format!("{}={}", entered.kind, plugin.display()),
        plugin_config: config.iter().map(|(k, v)| format!("{k}={v}")).collect(),
        track: match sub.tracks.as_slice() {
            [one] => Some(one.clone()),
            _ => None,
        },
        gpus: sub.gpus,
        dir: rerun,
        result,
        done,
        inputs_key: key,
    })
}

/// Compares a bundle with its finished rerun and writes the record (and its
/// signature) to `OUT/<bundle folder>.reproduction.json`; returns it and
/// its path.
pub fn record(staged: &Staged, bundle: &Bundle, rerun: &Rerun, opts: &Options) -> Result<(Record, PathBuf)> {
    let dir = staged.dir.as_path();
    let claimed = &bundle.result;
    let Some(rerun_bytes) = sealed_result(&seal_key()?, &rerun.dir, &rerun.inputs_key) else {
        bail!(
            "the rerun's result {} does not carry this operator's seal: it changed after its run ended\nhint: run `harness reproduce --fresh` to train it again",
            rerun.result.display()
        )
    };
    let again = RunResult::parse(&String::from_utf8_lossy(&rerun_bytes), &rerun.result)?;
    let Some(sub) = &claimed.submission else { bail!("{} holds no submission record", dir.display()) };
    let [entered] = sub.entered.as_slice() else {
        bail!("{} enters {} plugins; a submission enters one", dir.display(), sub.entered.len())
    };
    let released = standard::released(&claimed.suite.text).context("the bundle's suite is not released")?;
    let suite = harness_format::suite::Suite::parse(Path::new(released.file), released.text.to_owned())?;
    let tolerance = Tolerance::for_class(sub.hardware_class.as_deref());
    let mut comparison = reproduction::compare(claimed, &again, &suite, &tolerance);
    // The rerun must itself be official: the suite's hardware class and
    // GPU count, on this machine.
    for why in again.submission.as_ref().map(|s| s.unofficial.clone()).unwrap_or_default() {
        comparison.differences.push(reproduction::Difference {
            at: "the rerun".into(),
            figure: "official".into(),
            claimed: "official".into(),
            reproduced: format!("unofficial: {why}"),
            allowed: "reproduce on the suite's hardware class".into(),
        });
    }
    let folder = staged.folder.clone();
    let record = Record {
        format: reproduction::FORMAT,
        bundle: BundleId {
            folder: folder.clone(),
            manifest_sha256: staged.manifest_sha256.clone(),
            result_sha256: staged.result_sha256.clone(),
            plugin_kind: entered.kind.clone(),
            plugin_name: entered.name.clone(),
            plugin_version: entered.version.clone(),
            plugin_sha256: entered.sha256.clone(),
            suite: released.file.to_owned(),
            suite_version: suite.spec.suite.version.clone(),
            tracks: sub.tracks.clone(),
            gpus: sub.gpus,
        },
        machine: again.machine.clone(),
        harness_version: env!("CARGO_PKG_VERSION").to_owned(),
        reproduced_at: results::now(),
        rerun_sha256: sha256_hex(&rerun_bytes),
        tolerance,
        reproduced: comparison.reproduced(),
        comparison,
    };
    // The folder name is the submitter's: only its safe characters name
    // the record.
    let safe: String = folder.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    let path = opts.out.join(format!("{}-{}.reproduction.json", safe.trim_start_matches('.'), &record.bundle.manifest_sha256[..12]));
    let bytes = serde_json::to_vec_pretty(&record)?;
    // The operator's measurement travels with the record that hashes it
    // (`rerun_sha256`): the board ranks these figures, not the claim's.
    results::write_atomic(&reproduction::rerun_path(&path), &rerun_bytes)?;
    results::write_atomic(&path, &bytes)?;
    if let Some(key) = &opts.key {
        let secret = harness_format::files::read_capped(key, harness_format::files::KEY_MAX_BYTES)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .with_context(|| format!("cannot read the key {}", key.display()))?;
        let sig = reproduction::sign(&bytes, &secret).with_context(|| format!("{} is not a key `harness keygen` wrote", key.display()))?;
        results::write_atomic(&signature_path(&path), (serde_json::to_string_pretty(&sig)? + "\n").as_bytes())?;
    }
    Ok((record, path))
}

/// `path` with `suffix` appended to its file name.
fn suffixed(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// Where a record's signature goes: `<record>.sig`.
pub fn signature_path(record: &Path) -> PathBuf {
    suffixed(record, ".sig")
}

/// `harness keygen FILE`: a new ed25519 key; the secret in FILE (readable by
/// its owner only), the public key in FILE.pub. Returns the public key.
pub fn keygen(file: &Path) -> Result<String> {
    let public_file = suffixed(file, ".pub");
    for f in [file, public_file.as_path()] {
        harness_format::outfile::refuse_link(f)?;
        if f.exists() {
            bail!("{} already exists\nhint: a key is not overwritten; choose another file", f.display());
        }
    }
    let (secret, public) = reproduction::keygen()?;
    {
        use std::io::Write;
        let mut f = harness_format::outfile::create_new(file, Some(0o600))?;
        f.write_all(format!("{secret}\n").as_bytes())?;
    }
    harness_format::outfile::write_new(&public_file, format!("{public}\n").as_bytes())?;
    Ok(public)
}

/// Reads a public key: a file holding it, or the hex itself.
pub fn public_key(arg: &str) -> Result<String> {
    let p = Path::new(arg);
    if p.is_file() {
        let bytes = harness_format::files::read_regular(p, harness_format::files::KEY_MAX_BYTES)
            .with_context(|| format!("{} is no public key file (it holds 64 hex digits)", p.display()))?;
        return Ok(String::from_utf8_lossy(&bytes).trim().to_owned());
    }
    Ok(arg.trim().to_owned())
}

/// Checks the signed record `record` (its signature at `record.sig`) of the
/// bundle in `dir` against the operator's public key.
pub fn check_signed(dir: &Path, record: &Path, public: &str) -> Result<Record> {
    use harness_format::files::{read_plain, KEY_MAX_BYTES, RECORD_MAX_BYTES};
    let bytes = read_plain(record, RECORD_MAX_BYTES)?;
    let sig_path = signature_path(record);
    let sig: reproduction::SignatureFile = serde_json::from_slice(&read_plain(&sig_path, KEY_MAX_BYTES)?)
        .with_context(|| format!("{} is not a signature file", sig_path.display()))?;
    let manifest =
        files::read(dir, submission::MANIFEST, files::MANIFEST_CAP).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", dir.display()))?;
    reproduction::check(&bytes, &sig, public, Some(&manifest))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bundle folder as `harness submit` writes one: a manifest listing
    /// its files with their hashes.
    fn bundle(dir: &Path, result: &[u8]) {
        std::fs::create_dir_all(dir.join("plugins")).unwrap();
        let files = [(RESULT, result.to_vec()), ("plugins/p.wasm", b"\0asm".to_vec())];
        let mut listed = Vec::new();
        for (rel, bytes) in &files {
            std::fs::write(dir.join(rel), bytes).unwrap();
            listed.push(serde_json::json!({ "path": rel, "sha256": sha256_hex(bytes), "bytes": bytes.len() }));
        }
        let manifest = serde_json::json!({
            "bundle_format": 1, "harness_version": "0", "created_at": "now",
            "suite": { "name": "s", "version": null, "sha256": "x", "released_as": null },
            "hardware_class": "cpu", "gpus": 2, "tracks": [], "plugins": [], "files": listed,
        });
        std::fs::write(dir.join(MANIFEST), serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
    }

    #[test]
    fn the_staged_copy_is_what_was_read_and_a_later_swap_of_the_bundle_changes_nothing() {
        // Issue 60: MANIFEST.json, result.json or run.log swapped while the
        // rerun trained went into the signed record.
        let tmp = tempfile::tempdir().unwrap();
        let b = tmp.path().join("b.bundle");
        bundle(&b, b"{\"claim\": 1}");
        let staged = stage(&b, &tmp.path().join("out")).unwrap();
        assert_eq!(staged.folder, "b.bundle");
        assert_eq!(staged.result_sha256, sha256_hex(b"{\"claim\": 1}"));
        assert_eq!(staged.manifest_sha256, sha256_hex(&std::fs::read(b.join(MANIFEST)).unwrap()));
        // The swap, after the copy: the copy and its hashes keep what was read.
        bundle(&b, b"{\"claim\": 2}");
        assert_eq!(std::fs::read(staged.dir.join(RESULT)).unwrap(), b"{\"claim\": 1}");
        assert_ne!(staged.manifest_sha256, sha256_hex(&std::fs::read(b.join(MANIFEST)).unwrap()));
        assert!(staged.dir.join("plugins/p.wasm").is_file());
        // Staged again, the copy is made anew from the bundle as it is now.
        let again = stage(&b, &tmp.path().join("out")).unwrap();
        assert_eq!(std::fs::read(again.dir.join(RESULT)).unwrap(), b"{\"claim\": 2}");

        // A file the manifest lists through a link is refused, not copied.
        #[cfg(unix)]
        {
            std::fs::remove_file(b.join(RESULT)).unwrap();
            std::os::unix::fs::symlink("/etc/hostname", b.join(RESULT)).unwrap();
            let err = stage(&b, &tmp.path().join("out")).err().expect("refused").to_string();
            assert!(err.contains("goes through the symbolic link"), "{err}");
        }
    }

    #[test]
    fn a_rerun_counts_only_with_this_operators_seal_over_its_inputs_and_bytes() {
        // Issue 60: a complete result planted under OUT/reruns/<key>/ was
        // taken as the rerun (the claim compared with itself).
        let tmp = tempfile::tempdir().unwrap();
        let key = Key::in_dir(&tmp.path().join("state"), "reproduce-reruns").unwrap();
        let dir = tmp.path().join("rerun");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("result.json"), b"planted").unwrap();
        assert_eq!(sealed_result(&key, &dir, "inputs"), None, "no seal");
        std::fs::write(dir.join("result.seal"), "00".repeat(32)).unwrap();
        assert_eq!(sealed_result(&key, &dir, "inputs"), None, "a seal made up");

        seal_result(&key, &dir, "inputs").unwrap();
        assert_eq!(sealed_result(&key, &dir, "inputs").as_deref(), Some(&b"planted"[..]));
        // Another rerun's inputs, another operator, or the file edited after
        // its seal: none counts.
        assert_eq!(sealed_result(&key, &dir, "other inputs"), None);
        let other = Key::in_dir(&tmp.path().join("other-state"), "reproduce-reruns").unwrap();
        assert_eq!(sealed_result(&other, &dir, "inputs"), None);
        std::fs::write(dir.join("result.json"), b"planted, edited").unwrap();
        assert_eq!(sealed_result(&key, &dir, "inputs"), None);
    }
}
