//! What `harness report` reads: result files, and submission bundles
//! (`harness submit`), each verified with `harness verify`'s checks,
//! identified by its content, and, when it is the first of its content
//! and verifies, its result joined to the per-workload tables under
//! submission strategies named after its plugin. Folders are searched (not
//! recursively) for both.
//!
//! A bundle's folder name, and every string inside it, is its submitter's
//! to choose: nothing here trusts them further than `verify` checked, and
//! what is shown of them is escaped by the writers ([`crate::escape`]).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::Serialize;

use crate::results::{self, RunResult};
use crate::submission::verify::{self, Inspect};
use crate::submission::{sha256_hex, Bundle, Manifest, MANIFEST, RESULT};
use crate::submissions::{self, Files, Verified};

/// The most bytes of a bundle's `result.json` the board copies (a
/// standard-suite result with its histograms is well under 1 MiB).
pub const MAX_RESULT_COPY: u64 = 16 << 20;
/// The most bytes of a bundle's `MANIFEST.json` the board copies.
pub const MAX_MANIFEST_COPY: u64 = 1 << 20;

/// What `harness report` read.
pub struct Loaded {
    /// The results whose entries go into the per-workload tables: the
    /// result files, and the result of each bundle that ranks
    /// ([`Verified::ranks`]), its submission strategies renamed
    /// ([`submissions::strategy_name`]).
    pub results: Vec<RunResult>,
    /// Where each of `results` was read from, in the same order (shown as
    /// text).
    pub sources: Vec<String>,
    /// Every bundle that could be read, in the order given, with what
    /// `verify` said of it.
    pub bundles: Vec<Verified>,
    /// Notes for the terminal: bundles that cannot be read at all, JSON
    /// files that are not results. Escaped for the terminal.
    pub notes: Vec<String>,
}

/// A bundle's content identity: the sha256 (hex) of its manifest's `files`
/// entries (path, sha256 and size of each; the result, the suite, the
/// machine, the log and the artifacts), in path order. `verify` checks
/// each entry against the file, so two bundles that verify and have one
/// identity hold the same files, whatever their folders are called and
/// whenever their manifests were written.
pub fn content_id(m: &Manifest) -> String {
    #[derive(Serialize)]
    struct Entry<'a> {
        path: &'a str,
        sha256: &'a str,
        bytes: u64,
    }
    let mut entries: Vec<Entry> = m.files.iter().map(|f| Entry { path: &f.path, sha256: &f.sha256, bytes: f.bytes }).collect();
    entries.sort_by(|a, b| (a.path, a.sha256, a.bytes).cmp(&(b.path, b.sha256, b.bytes)));
    sha256_hex(&serde_json::to_vec(&entries).expect("file entries serialize"))
}

/// Reads result files and bundles; folders in `paths` are searched (not
/// recursively) for bundles and `*.json` result files, skipping JSON files
/// that are not harness results (bench outputs) and results that were
/// bundled next to themselves (`r.json` beside `r.bundle`). Each bundle is
/// checked with [`verify::verify`]`(dir, inspect)`; of bundles with one
/// content identity that verify, the first given ranks and the others are
/// listed as its copies. Only a bundle that ranks adds its result to the
/// tables.
pub fn load(paths: &[PathBuf], inspect: Inspect) -> Result<Loaded> {
    let mut l = Loaded { results: Vec::new(), sources: Vec::new(), bundles: Vec::new(), notes: Vec::new() };
    for p in paths {
        if crate::submission::is_bundle(p) {
            add_bundle(p, inspect, &mut l);
        } else if p.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(p)?.flatten().map(|e| e.path()).collect();
            files.sort();
            for f in files {
                if crate::submission::is_bundle(&f) {
                    add_bundle(&f, inspect, &mut l);
                    continue;
                }
                // A result that was bundled is read from its bundle.
                if f.extension().is_none_or(|x| x != "json") || crate::submission::is_bundle(&crate::submission::default_bundle_path(&f)) {
                    continue;
                }
                match RunResult::read(&f) {
                    Ok(r) => {
                        l.sources.push(f.display().to_string());
                        l.results.push(r);
                    }
                    Err(results::ResultsError::Parse { .. }) => {
                        l.notes.push(crate::escape::terminal(&format!("note: {} is not a harness result file; skipped", f.display())))
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        } else {
            l.results.push(RunResult::read(p)?);
            l.sources.push(p.display().to_string());
        }
    }
    anyhow::ensure!(
        !l.results.is_empty() || !l.bundles.is_empty(),
        "no result files or bundles found in {}",
        crate::escape::terminal(&paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))
    );
    Ok(l)
}

/// Reads, verifies and identifies the bundle in `dir`, and files it: a
/// note if it cannot be read, else among the bundles, and its result among
/// the results if it ranks.
fn add_bundle(dir: &Path, inspect: Inspect, l: &mut Loaded) {
    let bundle = match Bundle::read(dir) {
        Ok(b) => b,
        Err(e) => {
            l.notes.push(crate::escape::terminal(&format!(
                "note: skipped the bundle {}, which cannot be read ({e:#}); `harness verify` says why",
                dir.display()
            )));
            return;
        }
    };
    let verdict = verify::verify(dir, inspect);
    let claimed = content_id(&bundle.manifest);
    let verified = verdict.verified();
    let same_as =
        verified.then(|| l.bundles.iter().find(|v| v.verdict.verified() && v.id == claimed).map(|v| v.bundle.dir.clone())).flatten();
    // The two files a reader needs, as they are now: a bundle that
    // verifies must still hold the result it was verified with.
    let mut copied = Vec::new();
    let mut copies = Vec::new();
    let mut not_copied = Vec::new();
    for (name, limit) in [(RESULT, MAX_RESULT_COPY), (MANIFEST, MAX_MANIFEST_COPY)] {
        match read_bounded(&dir.join(name), limit) {
            Ok(bytes) => {
                let listed = bundle.manifest.files.iter().find(|f| f.path == name).map(|f| f.sha256.as_str());
                if verified && name == RESULT && listed != Some(sha256_hex(&bytes).as_str()) {
                    not_copied.push(format!("{name} not copied: it changed after it was verified"));
                } else {
                    copied.push(name);
                    copies.push(bytes);
                }
            }
            Err(why) => not_copied.push(format!("{name} not copied: {why}")),
        }
    }
    // A bundle that verifies is kept under its content identity; one that
    // does not cannot be taken at its manifest's word, so it is kept under
    // the hash of the files copied, which can never be a verified
    // bundle's folder.
    let id = if verified {
        claimed
    } else {
        let mut all = b"unverified".to_vec();
        for (name, c) in copied.iter().zip(&copies) {
            all.extend_from_slice(format!("\0{name}\0{}", sha256_hex(c)).as_bytes());
        }
        sha256_hex(&all)
    };
    let folder = folder_for(&id, &l.bundles);
    if same_as.is_none() && verified {
        let mut r = bundle.result.clone();
        rename_submission_strategies(&mut r);
        l.sources.push(dir.join(RESULT).display().to_string());
        l.results.push(r);
    }
    l.bundles.push(Verified { bundle, verdict, id, same_as, files: Files { folder, copied, not_copied }, copies });
}

/// The folder under `bundles/` for content `id`: its first 16 hex digits,
/// unless another content already took them (then all 64).
fn folder_for(id: &str, earlier: &[Verified]) -> String {
    let short = &id[..16.min(id.len())];
    let taken: BTreeMap<&str, &str> = earlier.iter().map(|v| (v.files.folder.as_str(), v.id.as_str())).collect();
    match taken.get(short) {
        Some(other) if *other != id => id.to_owned(),
        _ => short.to_owned(),
    }
}

/// A bundle's submission strategies take their plugin's name
/// ([`submissions::strategy_name`]), so that two parties' plugins are never
/// pooled in the per-workload tables.
fn rename_submission_strategies(r: &mut RunResult) {
    let Some(p) = r.submission.as_ref().and_then(|s| s.entered.first()).cloned() else { return };
    for e in &mut r.entries {
        if e.strategy.starts_with("submission-") {
            e.strategy = submissions::strategy_name(&p, &e.strategy);
        }
    }
    for e in &mut r.plan {
        if e.strategy.name.starts_with("submission-") {
            e.strategy.name = submissions::strategy_name(&p, &e.strategy.name);
        }
    }
}

/// The bytes of `path`, if it is a plain file (not a link, which could
/// point anywhere on this machine) of at most `limit` bytes.
fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| format!("cannot read it ({e})"))?;
    if !meta.is_file() {
        return Err("not a plain file".into());
    }
    let f = std::fs::File::open(path).map_err(|e| format!("cannot read it ({e})"))?;
    let mut bytes = Vec::new();
    f.take(limit + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot read it ({e})"))?;
    if bytes.len() as u64 > limit {
        return Err(format!("larger than {} MiB", limit >> 20));
    }
    Ok(bytes)
}
