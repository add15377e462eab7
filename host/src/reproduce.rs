//! `harness reproduce BUNDLE...`: the operator trains each submission again
//! from its bundle alone and compares the rerun with the claim
//! ([`crate::report::reproduction`]), writing a record per bundle, signed when
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

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::report::reproduction::{self, BundleId, Record, Tolerance};
use crate::results::{self, RunResult};
use crate::submission::{self, files, sha256_hex, Bundle, MANIFEST, RESULT};
use crate::suite::standard;

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
    std::fs::create_dir_all(&rerun).with_context(|| format!("cannot create {}", rerun.display()))?;
    let suite_file = rerun.join(Path::new(released.file).file_name().unwrap_or("suite.toml".as_ref()));
    results::write_atomic(&suite_file, released.text.as_bytes())?;
    let plugin = rerun.join(format!("{}.wasm", &sha256_hex(&artifact)[..16]));
    results::write_atomic(&plugin, &artifact)?;
    std::fs::write(rerun.join("inputs.json"), serde_json::to_string_pretty(&inputs)? + "\n")?;
    let result = rerun.join("result.json");
    let existing = RunResult::read(&result).ok();
    let done = !opts.fresh && existing.as_ref().is_some_and(|x| x.complete);
    if opts.fresh && result.exists() {
        for f in [result.clone(), results::log_path(&result)] {
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
    })
}

/// Compares a bundle with its finished rerun and writes the record (and its
/// signature) to `OUT/<bundle folder>.reproduction.json`; returns it and
/// its path.
pub fn record(dir: &Path, bundle: &Bundle, rerun: &Rerun, opts: &Options) -> Result<(Record, PathBuf)> {
    let claimed = &bundle.result;
    let again = RunResult::read(&rerun.result)?;
    let Some(sub) = &claimed.submission else { bail!("{} holds no submission record", dir.display()) };
    let [entered] = sub.entered.as_slice() else {
        bail!("{} enters {} plugins; a submission enters one", dir.display(), sub.entered.len())
    };
    let released = standard::released(&claimed.suite.text).context("the bundle's suite is not released")?;
    let suite = crate::suite::Suite::parse(Path::new(released.file), released.text.to_owned())?;
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
    let read = |f: &str, cap| files::read(dir, f, cap).map_err(|e| anyhow::anyhow!("cannot read {f} of {}: {e}", dir.display()));
    let folder = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| dir.display().to_string());
    let record = Record {
        format: reproduction::FORMAT,
        bundle: BundleId {
            folder: folder.clone(),
            manifest_sha256: sha256_hex(&read(MANIFEST, files::MANIFEST_CAP)?),
            result_sha256: sha256_hex(&read(RESULT, files::FILE_CAP)?),
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
        rerun_sha256: sha256_hex(&std::fs::read(&rerun.result)?),
        tolerance,
        reproduced: comparison.reproduced(),
        comparison,
    };
    // The folder name is the submitter's: only its safe characters name
    // the record.
    let safe: String = folder.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    let path = opts.out.join(format!("{}-{}.reproduction.json", safe.trim_start_matches('.'), &record.bundle.manifest_sha256[..12]));
    let bytes = serde_json::to_vec_pretty(&record)?;
    results::write_atomic(&path, &bytes)?;
    if let Some(key) = &opts.key {
        let secret = std::fs::read_to_string(key).with_context(|| format!("cannot read the key {}", key.display()))?;
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
        if f.exists() {
            bail!("{} already exists\nhint: a key is not overwritten; choose another file", f.display());
        }
    }
    let (secret, public) = reproduction::keygen()?;
    {
        use std::io::Write;
        #[cfg(unix)]
        use std::os::unix::fs::OpenOptionsExt;
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(unix)]
        o.mode(0o600);
        let mut f = o.open(file).with_context(|| format!("cannot create {}", file.display()))?;
        f.write_all(format!("{secret}\n").as_bytes())?;
    }
    std::fs::write(&public_file, format!("{public}\n")).with_context(|| format!("cannot write {}", public_file.display()))?;
    Ok(public)
}

/// Reads a public key: a file holding it, or the hex itself.
pub fn public_key(arg: &str) -> Result<String> {
    let p = Path::new(arg);
    if p.is_file() {
        let meta = std::fs::metadata(p)?;
        anyhow::ensure!(meta.len() <= 1024, "{} is {} bytes; a public key file holds 64 hex digits", p.display(), meta.len());
        return Ok(std::fs::read_to_string(p)?.trim().to_owned());
    }
    Ok(arg.trim().to_owned())
}

/// Checks the signed record `record` (its signature at `record.sig`) of the
/// bundle in `dir` against the operator's public key.
pub fn check_signed(dir: &Path, record: &Path, public: &str) -> Result<Record> {
    const MAX: u64 = 16 << 20;
    let read = |p: &Path| -> Result<Vec<u8>> {
        let meta = std::fs::symlink_metadata(p).with_context(|| format!("cannot read {}", p.display()))?;
        anyhow::ensure!(meta.is_file() && meta.len() <= MAX, "{} is not a regular file of at most {MAX} bytes", p.display());
        Ok(std::fs::read(p)?)
    };
    let bytes = read(record)?;
    let sig_path = signature_path(record);
    let sig: reproduction::SignatureFile =
        serde_json::from_slice(&read(&sig_path)?).with_context(|| format!("{} is not a signature file", sig_path.display()))?;
    let manifest = read(&dir.join(submission::MANIFEST))?;
    reproduction::check(&bytes, &sig, public, Some(&manifest))
}
