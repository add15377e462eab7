//! Submissions: `harness submit RESULT` bundles a standard-suite run (the
//! result file, the suite that ran, the entered plugin's artifact, the run's
//! log and the machine's fingerprint) into a folder with a manifest of
//! sha256 hashes; `harness verify BUNDLE` ([`verify`]) checks a bundle
//! against the rules (docs/rules.md). The bundle format is documented in
//! docs/submitting.md.

pub mod files;
pub mod verify;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use harness_format::files as caps;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use files::{LOG, MACHINE, MANIFEST, RESULT, SUITE};
use harness_format::results::{self, RunResult};

/// Version of the bundle format (`MANIFEST.json`).
///
/// Changelog:
/// - 1: first version.
pub const BUNDLE_FORMAT: u32 = 1;

/// `MANIFEST.json`: what the bundle holds, each file with its hash.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub bundle_format: u32,
    /// The harness that wrote the bundle.
    pub harness_version: String,
    pub created_at: String,
    pub suite: SuiteRef,
    pub hardware_class: Option<String>,
    pub gpus: u32,
    pub tracks: Vec<String>,
    pub plugins: Vec<PluginRef>,
    /// Every file of the bundle but the manifest.
    pub files: Vec<FileRef>,
}

/// The suite a bundle's result ran.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SuiteRef {
    pub name: String,
    pub version: Option<String>,
    /// sha256 of the suite's text.
    pub sha256: String,
    /// The released standard suite it is byte-identical to, if any.
    pub released_as: Option<String>,
}

/// An entered plugin: its identity, and its artifact in the bundle when it
/// was included (`--no-artifacts` leaves the hash and size only).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PluginRef {
    pub kind: String,
    pub name: String,
    pub version: String,
    pub sha256: String,
    pub bytes: u64,
    pub file: Option<String>,
}

/// One file of the bundle.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FileRef {
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
}

/// Options of `harness submit`.
#[derive(Debug, Clone, Default)]
pub struct SubmitOptions {
    /// The bundle folder (default: `<result stem>.bundle` next to it).
    pub out: Option<PathBuf>,
    /// The run's log (default: `<result stem>.log` next to it).
    pub log: Option<PathBuf>,
    /// Leave the plugin artifacts out (their sha256 and size stay).
    pub no_artifacts: bool,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The result as a bundle publishes it, and its machine fingerprint:
/// without the submitter's host name (emptied) and with each entered
/// plugin's path on the submitter's machine (`paths`: from, to) replaced by
/// its file in the bundle, in `submission.entered` and in the entries'
/// plugin figures. Nothing else changes; `verify` reads both as it reads
/// any result.
fn public_result(raw: &[u8], run: &RunResult, paths: &[(String, String)]) -> Result<(Vec<u8>, harness_format::machine::Fingerprint)> {
    let mut v: serde_json::Value = serde_json::from_slice(raw).context("the result file is not JSON")?;
    let public = |s: &mut serde_json::Value| {
        if let Some((_, to)) = paths.iter().find(|(from, _)| s.as_str() == Some(from.as_str())) {
            *s = serde_json::Value::String(to.clone());
        }
    };
    if let Some(h) = v.pointer_mut("/machine/hostname") {
        *h = serde_json::Value::String(String::new());
    }
    if let Some(entered) = v.pointer_mut("/submission/entered").and_then(|e| e.as_array_mut()) {
        entered.iter_mut().filter_map(|p| p.get_mut("path")).for_each(public);
    }
    if let Some(entries) = v.get_mut("entries").and_then(|e| e.as_array_mut()) {
        for e in entries {
            if let Some(ps) = e.pointer_mut("/metrics/plugins").and_then(|p| p.as_array_mut()) {
                ps.iter_mut().filter_map(|p| p.get_mut("path")).for_each(public);
            }
        }
    }
    let mut machine = run.machine.clone();
    machine.hostname.clear();
    Ok(((serde_json::to_string_pretty(&v)? + "\n").into_bytes(), machine))
}

/// Where `harness submit` puts the bundle of `result` by default.
pub fn default_bundle_path(result: &Path) -> PathBuf {
    result.with_extension("bundle")
}

/// Writes the bundle of the result file `result`; returns its folder. The
/// bundle is assembled in a `.partial` folder and renamed into place, so a
/// folder named like a bundle is always a whole one.
pub fn submit(result: &Path, opts: &SubmitOptions) -> Result<PathBuf> {
    // The bytes bundled are the bytes parsed, read within the caps verify
    // applies (docs/rules.md, "Size limits").
    let raw = caps::read_capped(result, caps::RESULT_MAX_BYTES)?;
    let run = RunResult::parse(&String::from_utf8_lossy(&raw), result)?;
    let Some(sub) = &run.submission else {
        bail!(
            "{} is not the result of a submission run (it has no `submission` record)\n\
             hint: enter a plugin into a standard suite: harness run suites/cpu-standard.toml --plugin KIND=PATH",
            result.display()
        );
    };
    let out = opts.out.clone().unwrap_or_else(|| default_bundle_path(result));
    if out.exists() {
        bail!("{} already exists\nhint: remove it, or choose another folder with --out", out.display());
    }
    let log = opts.log.clone().unwrap_or_else(|| harness_format::results::log_path(result));
    let log_text = match caps::read_capped(&log, caps::LOG_MAX_BYTES) {
        Ok(t) => Some(t),
        Err(caps::FileError::Io { error, .. }) if opts.log.is_none() && error.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => bail!("the run's log cannot be bundled: {e}"),
    };
    // Read the artifacts first: a plugin rebuilt since the run is refused
    // before anything is written.
    let mut artifacts = Vec::new();
    let mut plugins = Vec::new();
    // The submitter's folders stay home: each artifact's path becomes its
    // file in the bundle (its file name with --no-artifacts).
    let mut public_paths = Vec::new();
    for p in &sub.entered {
        let mut file = None;
        if !opts.no_artifacts {
            let bytes = caps::read_regular(Path::new(&p.path), caps::PLUGIN_MAX_BYTES).with_context(|| {
                format!(
                    "cannot read the entered plugin {} (its artifact goes into the bundle)\nhint: submit from the machine that ran, or pass --no-artifacts to bundle its sha256 and size only",
                    p.path
                )
            })?;
            let sha = sha256_hex(&bytes);
            if sha != p.sha256 {
                bail!(
                    "{} has changed since the run: its sha256 is {sha}, the run loaded {}\nhint: bundle the artifact that ran (rebuild it from the same source, or restore it), or pass --no-artifacts",
                    p.path,
                    p.sha256
                );
            }
            let ext = Path::new(&p.path).extension().and_then(|e| e.to_str()).unwrap_or("bin");
            let name: String = p.name.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
            let rel = format!("plugins/{name}-{}.{ext}", &sha[..12]);
            artifacts.push((rel.clone(), bytes));
            file = Some(rel);
        }
        let public = file
            .clone()
            .unwrap_or_else(|| Path::new(&p.path).file_name().map_or_else(|| "plugin".to_owned(), |n| n.to_string_lossy().into_owned()));
        public_paths.push((p.path.clone(), public));
        plugins.push(PluginRef {
            kind: p.kind.clone(),
            name: p.name.clone(),
            version: p.version.clone(),
            sha256: p.sha256.clone(),
            bytes: p.bytes,
            file,
        });
    }

    let partial = out.with_extension("bundle.partial");
    if partial.exists() {
        std::fs::remove_dir_all(&partial).with_context(|| format!("cannot remove {}", partial.display()))?;
    }
    std::fs::create_dir_all(partial.join("plugins")).with_context(|| format!("cannot create {}", partial.display()))?;
    let mut files = Vec::new();
    let mut put = |rel: &str, bytes: &[u8]| -> Result<()> {
        let path = partial.join(rel);
        harness_format::outfile::write_new(&path, bytes)?;
        files.push(FileRef { path: rel.to_owned(), sha256: sha256_hex(bytes), bytes: bytes.len() as u64 });
        Ok(())
    };
    let (public_raw, machine) = public_result(&raw, &run, &public_paths)?;
    put(RESULT, &public_raw)?;
    put(SUITE, run.suite.text.as_bytes())?;
    put(MACHINE, serde_json::to_string_pretty(&machine)?.as_bytes())?;
    if let Some(t) = &log_text {
        put(LOG, t)?;
    }
    for (rel, bytes) in &artifacts {
        put(rel, bytes)?;
    }
    let manifest = Manifest {
        bundle_format: BUNDLE_FORMAT,
        harness_version: env!("CARGO_PKG_VERSION").to_owned(),
        created_at: results::now(),
        suite: SuiteRef {
            name: run.suite.name.clone(),
            version: sub.suite_version.clone(),
            sha256: sha256_hex(run.suite.text.as_bytes()),
            released_as: harness_format::suite::standard::released(&run.suite.text).map(|r| r.file.to_owned()),
        },
        hardware_class: sub.hardware_class.clone(),
        gpus: sub.gpus,
        tracks: entered_tracks(&run),
        plugins,
        files,
    };
    harness_format::outfile::write_new(&partial.join(MANIFEST), (serde_json::to_string_pretty(&manifest)? + "\n").as_bytes())?;
    std::fs::rename(&partial, &out).with_context(|| format!("cannot move {} to {}", partial.display(), out.display()))?;
    Ok(out)
}

/// The tracks a submission run entered its plugin in: those of the run's
/// tracks (`submission.tracks`, every track that ran, baselines included)
/// whose submission strategy (`submission-<track>`) is in the run's plan.
/// A compressor entered without `--track` runs beside every track's
/// baseline, but is a submission only in the compression tracks.
pub fn entered_tracks(r: &RunResult) -> Vec<String> {
    let Some(sub) = &r.submission else { return Vec::new() };
    sub.tracks
        .iter()
        .filter(|t| {
            let name = format!("submission-{t}");
            r.plan.iter().any(|p| p.strategy.name == name)
        })
        .cloned()
        .collect()
}

/// Version of the entered identity ([`identity`]): what it hashes.
///
/// Changelog:
/// - 1: the released suite's sha256, the hardware class, the GPU count,
///   the tracks, and each entered plugin's kind, artifact sha256 and
///   configuration.
pub const IDENTITY_VERSION: u32 = 1;

/// What a submission run entered, the identity of a submission by what was
/// measured rather than by the bundle's bytes (sha256, hex): the released
/// suite's sha256, the hardware class, the GPU count, the tracks the
/// plugin was entered in ([`entered_tracks`]) and each entered plugin's
/// kind, artifact sha256 and configuration (its keys as TOML values, so
/// spelling and order do not count), serialised canonically. The plan and
/// seeds follow from these, so two results of one identity are runs of the
/// same experiment: reruns, or copies whatever bytes were added to their
/// bundles (a log line, a file, a field). Their names, versions and
/// transports follow from the artifact's bytes (`harness verify` checks
/// them), and the machine, times and figures are what was measured, so
/// none of these count. The leaderboard pools the repeats of the bundles
/// of one identity into one row per track ([`track_identity`]); `None`
/// for a result that records no submission.
pub fn identity(r: &RunResult) -> Option<String> {
    entered_identity(r, &entered_tracks(r))
}

/// [`identity`] of the entry into one `track`: the same for a run entered
/// in every track of the plugin's kind and one entered with `--track`, on
/// that track.
pub fn track_identity(r: &RunResult, track: &str) -> Option<String> {
    entered_identity(r, &[track.to_owned()])
}

fn entered_identity(r: &RunResult, tracks: &[String]) -> Option<String> {
    #[derive(Serialize)]
    struct Entered<'a> {
        identity: u32,
        suite_sha256: &'a str,
        hardware_class: Option<&'a str>,
        gpus: u32,
        tracks: Vec<&'a str>,
        plugins: Vec<(&'a str, &'a str, serde_json::Value)>,
    }
    let sub = r.submission.as_ref()?;
    let mut tracks: Vec<&str> = tracks.iter().map(String::as_str).collect();
    tracks.sort_unstable();
    tracks.dedup();
    // The configuration as values (a JSON object's keys serialise sorted);
    // text that is no TOML table counts as itself.
    let config = |text: &str| match text.parse::<toml::Table>() {
        Ok(t) => serde_json::to_value(t).unwrap_or_else(|_| text.into()),
        Err(_) => text.into(),
    };
    let mut plugins: Vec<(&str, &str, serde_json::Value)> =
        sub.entered.iter().map(|p| (p.kind.as_str(), p.sha256.as_str(), config(&p.config))).collect();
    plugins.sort_by(|a, b| (a.0, a.1, a.2.to_string()).cmp(&(b.0, b.1, b.2.to_string())));
    let entered = Entered {
        identity: IDENTITY_VERSION,
        suite_sha256: &r.suite.sha256,
        hardware_class: sub.hardware_class.as_deref(),
        gpus: sub.gpus,
        tracks,
        plugins,
    };
    Some(sha256_hex(&serde_json::to_vec(&entered).expect("an identity serialises")))
}

/// A bundle read back: its manifest and result, if they could be read.
pub struct Bundle {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub result: RunResult,
}

/// Whether `dir` is a bundle (holds a manifest).
pub fn is_bundle(dir: &Path) -> bool {
    dir.join(MANIFEST).is_file()
}

impl Bundle {
    /// Reads a bundle's manifest and result (no checks: see [`verify`]),
    /// each a regular file of the bundle's folder read within its cap
    /// ([`files`]).
    pub fn read(dir: &Path) -> Result<Bundle> {
        let m = dir.join(MANIFEST);
        let text = files::read(dir, MANIFEST, files::MANIFEST_CAP).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", dir.display()))?;
        let manifest: Manifest = serde_json::from_slice(&text).with_context(|| format!("{} is not a bundle manifest", m.display()))?;
        let raw = files::read(dir, RESULT, files::cap(RESULT)).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", dir.display()))?;
        let result = RunResult::parse(&String::from_utf8_lossy(&raw), &dir.join(RESULT))?;
        Ok(Bundle { dir: dir.to_owned(), manifest, result })
    }
}
