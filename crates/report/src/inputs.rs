//! What `harness report` reads: result files, and submission bundles
//! (`harness submit`), each verified with `harness verify`'s checks,
//! identified by its content, and, when it is the first of its content
//! and verifies, its result joined to the per-workload tables under
//! submission strategies named after its plugin. Folders are searched (not
//! recursively, and never through a symbolic link) for both.
//!
//! Every file is read within its kind's cap (`harness_format::files`), and
//! every histogram of a result is decoded before the result is used: a
//! file that cannot be read, parsed or decoded is refused with a note
//! naming it and why, and the board is built from the rest.
//!
//! A bundle's folder name, and every string inside it, is its submitter's
//! to choose: nothing here trusts them further than `verify` checked, and
//! what is shown of them is escaped by the writers ([`crate::escape`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Result;
use harness_format::files;
use serde::Serialize;

use crate::submission::verify::{self, Inspect};
use crate::submission::{sha256_hex, Bundle, Manifest, MANIFEST, RESULT};
use crate::submissions::{self, Files, Verified};
use harness_format::results::{self, RunResult};

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
/// recursively; symbolic links in them are skipped) for bundles and
/// `*.json` result files, skipping JSON files that are not harness results
/// (bench outputs) and results that were bundled next to themselves
/// (`r.json` beside `r.bundle`). A result that is too large, too new or
/// holds a histogram that does not decode is refused with a note, as is
/// one named here; only a named file that cannot be opened stops the
/// report. Each bundle is
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
            // The folder's own entries: `file_type` does not follow links.
            let mut files: Vec<(PathBuf, std::fs::FileType)> =
                std::fs::read_dir(p)?.flatten().filter_map(|e| Some((e.path(), e.file_type().ok()?))).collect();
            files.sort_by(|a, b| a.0.cmp(&b.0));
            for (f, kind) in files {
                let json = f.extension().is_some_and(|x| x == "json");
                if kind.is_symlink() {
                    if json || crate::submission::is_bundle(&f) {
                        l.notes.push(crate::escape::terminal(&format!(
                            "note: skipped {}, a symbolic link: a folder's own files and bundles are read, never a link out of it (name its target to include it)",
                            f.display()
                        )));
                    }
                    continue;
                }
                if kind.is_dir() {
                    if crate::submission::is_bundle(&f) {
                        add_bundle(&f, inspect, &mut l);
                    }
                    continue;
                }
                // A result that was bundled is read from its bundle.
                if !json || crate::submission::is_bundle(&crate::submission::default_bundle_path(&f)) {
                    continue;
                }
                let read = files::read_plain(&f, files::RESULT_MAX_BYTES)
                    .map_err(results::ResultsError::from)
                    .and_then(|bytes| RunResult::parse(&String::from_utf8_lossy(&bytes), &f));
                add_result(&f, read, &mut l);
            }
        } else {
            // Named here: read as given (a pipe too), within the cap.
            match RunResult::read(p) {
                Err(results::ResultsError::File(e @ files::FileError::Io { .. })) => return Err(e.into()),
                read => add_result(p, read, &mut l),
            }
        }
    }
    anyhow::ensure!(
        !l.results.is_empty() || !l.bundles.is_empty(),
        "no result files or bundles found in {}",
        crate::escape::terminal(&paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))
    );
    Ok(l)
}

/// Files the result read from `path` among the results if it was read and
/// its histograms decode, else a note saying why it was refused (a JSON
/// file that is no result at all, a bench output, is merely skipped).
fn add_result(path: &Path, read: Result<RunResult, results::ResultsError>, l: &mut Loaded) {
    let why = match read {
        Ok(r) if !r.complete => {
            l.notes.push(crate::escape::terminal(&format!(
                "note: skipped {}: its run did not finish (`complete` is false), and the tables compare only finished runs; `harness run --resume` finishes it",
                path.display()
            )));
            return;
        }
        Ok(r) => match undecodable(&r) {
            None => {
                l.sources.push(path.display().to_string());
                l.results.push(r);
                return;
            }
            Some(why) => why,
        },
        Err(results::ResultsError::Parse { .. }) => {
            l.notes.push(crate::escape::terminal(&format!("note: {} is not a harness result file; skipped", path.display())));
            return;
        }
        Err(e) => e.to_string(),
    };
    l.notes.push(crate::escape::terminal(&format!("note: refused {}: {why}; the board is built without it", path.display())));
}

/// Why `r` cannot be used, if one of its histograms does not decode: the
/// first such entry and histogram, and the decoder's reason.
fn undecodable(r: &RunResult) -> Option<String> {
    r.entries.iter().find_map(|e| {
        e.histograms.iter().find_map(|(key, h)| {
            harness_format::histogram::decode(h).err().map(|err| format!("entry {}'s `{key}` histogram does not decode: {err}", e.id))
        })
    })
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
    for name in [RESULT, MANIFEST] {
        match crate::submission::files::read(dir, name, crate::submission::files::cap(name)) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use harness_format::results::testing;

    /// Issue 61's bomb: the first 9 bytes of a V2 histogram (its cookie,
    /// its payload length set to 0xFFFFFFF0, the first byte of its
    /// normalizing offset) in base64, 12 characters that stand for the
    /// first 12 of an honest histogram's text.
    const BOMB_HEAD: &str = "HISTE/////AA";

    fn no_plugins(_: &[u8]) -> anyhow::Result<harness_format::plugin::Manifest> {
        unreachable!("no bundle is given")
    }

    /// Issue 61: `harness report` aborted on a result whose histogram asked
    /// for 4 GiB, even beside honest files; it refuses that file, naming it
    /// and why, and reports the rest.
    #[test]
    fn a_result_that_does_not_decode_is_refused_and_the_rest_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let good = testing::result("s", None, 100.0);
        let mut bad = testing::result("s", None, 50.0);
        let step = bad.entries[0].histograms.get_mut("step").unwrap();
        *step = format!("{BOMB_HEAD}{}", &step[BOMB_HEAD.len()..]);
        std::fs::write(dir.join("a.json"), serde_json::to_vec(&good).unwrap()).unwrap();
        std::fs::write(dir.join("b.json"), serde_json::to_vec(&bad).unwrap()).unwrap();
        // Over the cap: refused by its size, unread (a sparse file).
        std::fs::File::create(dir.join("c.json")).unwrap().set_len(files::RESULT_MAX_BYTES + 1).unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(dir.join("a.json"), dir.join("d.json")).unwrap();

        let l = load(&[dir.to_owned()], &no_plugins).unwrap();
        assert_eq!(l.sources, [dir.join("a.json").display().to_string()], "{:?}", l.notes);
        let notes = l.notes.join("\n");
        let refused = format!(
            "note: refused {}: entry w/baseline/r0's `step` histogram does not decode: the histogram's header declares a payload of 4294967280 bytes (bytes 4..8)",
            dir.join("b.json").display()
        );
        assert!(notes.contains(&refused), "{notes}");
        assert!(notes.contains("c.json has 16777217 bytes, more than the 16777216 bytes (16 MiB) harness reads"), "{notes}");
        #[cfg(unix)]
        assert!(notes.contains(&format!("note: skipped {}, a symbolic link", dir.join("d.json").display())), "{notes}");

        // Named on the command line, it is refused the same way; a file
        // that cannot be opened still stops the report.
        let l = load(&[dir.join("b.json"), dir.join("a.json")], &no_plugins).unwrap();
        assert_eq!(l.results.len(), 1);
        assert!(l.notes.join("\n").contains(&refused), "{:?}", l.notes);
        assert!(load(&[dir.join("none.json")], &no_plugins).is_err());
    }

    /// Issue 60: the per-workload tables "pull in a failed raw result". A
    /// run that did not finish is left out of them, saying why and what to
    /// do; the finished one beside it is reported.
    #[test]
    fn an_unfinished_run_is_left_out_of_the_tables_saying_so() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let mut cut = testing::result("s", None, 50.0);
        cut.complete = false;
        std::fs::write(dir.join("a.json"), serde_json::to_vec(&testing::result("s", None, 100.0)).unwrap()).unwrap();
        std::fs::write(dir.join("b.json"), serde_json::to_vec(&cut).unwrap()).unwrap();
        let l = load(&[dir.to_owned()], &no_plugins).unwrap();
        assert_eq!(l.sources, [dir.join("a.json").display().to_string()], "{:?}", l.notes);
        let notes = l.notes.join("\n");
        assert!(notes.contains(&format!("note: skipped {}: its run did not finish", dir.join("b.json").display())), "{notes}");
        assert!(notes.contains("`harness run --resume` finishes it"), "{notes}");
    }
}
