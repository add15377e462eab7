//! The manifest (`checkpoint.json`) and the file records it gathers: what
//! they hold, the seal under the user's key, and how they are read back
//! and checked.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result};
use harness_format::secrets::Key;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::accept::{refused, FileLayout, RunIdentity};
use super::confined::Dir;
use super::snapshot::Position;

/// Version of the on-disk layout. 3: the manifest carries a seal (`seal`,
/// an HMAC-SHA256 under the user's checkpoint key). 2: the manifest names
/// the run it belongs to, holds every rank's file record and its own
/// sha256. A checkpoint of another format is refused by name (`format`):
/// `--resume` fails its entry, which runs again only in a new result file.
pub const FORMAT: u32 = 3;

/// The name of the user's key that checkpoints are sealed with
/// ([`harness_format::secrets::Key::of_user`]).
pub const KEY_NAME: &str = "checkpoints";

/// What a manifest's seal is made for (its HMAC's domain).
const SEAL_CONTEXT: &str = "harness checkpoint manifest";

/// The key the stores of this process seal with and check seals against:
/// the user's `checkpoints` key.
#[cfg(not(test))]
pub(super) fn user_key() -> Result<Key> {
    Key::of_user(KEY_NAME).context("the key checkpoints are sealed with")
}

/// In unit tests, a key of the tests' own, never the user's.
#[cfg(test)]
pub(super) fn user_key() -> Result<Key> {
    Ok(Key::from_bytes([0x5e; 32]))
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileRecord {
    pub(super) file: String,
    pub(super) bytes: u64,
    /// Without `chunk_bytes`: the sha256 of the file. With it: the sha256 of
    /// the concatenated sha256 digests of the file's consecutive pieces of
    /// `chunk_bytes` bytes (the last one shorter), so that several threads
    /// can hash one file as fast as the disk moves it.
    pub(super) sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) chunk_bytes: Option<u64>,
}

/// Pieces hashed separately, on several threads (see [`FileRecord`]).
pub(super) const HASH_CHUNK: usize = 64 << 20;

/// A manifest's seal: the HMAC-SHA256 of its sha256 under the writer's
/// checkpoint key, and that key's id ([`Key::id`], which tells a seal of
/// another key from a changed manifest in messages).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Seal {
    pub(super) key: String,
    hmac: String,
}

impl Seal {
    /// The seal of the manifest whose sha256 is `digest`, made with `key`.
    pub(super) fn of(key: &Key, digest: &str) -> Seal {
        Seal { key: key.id(), hmac: hex::encode(key.mac(SEAL_CONTEXT, &[digest.as_bytes()])) }
    }

    /// Refuses this seal of the manifest of `dir` (whose sha256 is
    /// `digest`) unless `key` made it.
    pub(super) fn check(&self, dir: &Path, digest: &str, key: &Key) -> Result<()> {
        let sealed = hex::decode(&self.hmac).is_ok_and(|mac| key.verify(SEAL_CONTEXT, &[digest.as_bytes()], &mac));
        if sealed {
            return Ok(());
        }
        let ours = key.id();
        let why = if self.key != ours {
            // A stranger's text: shown only as a key id (16 hex digits).
            let theirs = match &self.key {
                k if k.len() == 16 && k.bytes().all(|b| b.is_ascii_hexdigit()) => format!("key {k}"),
                k => format!("no key id ({} bytes)", k.len()),
            };
            format!(
                "was made with {theirs}, not with this user's checkpoint key {} (key {ours}): the checkpoint was written by \
                 another user or machine, before the key was made anew, or forged; it resumes only where its writer's key is",
                key.path().display()
            )
        } else {
            format!(
                "does not match the manifest under this user's checkpoint key {} (key {ours}): the checkpoint was changed \
                 after it was written (its hashes recomputed without the key)",
                key.path().display()
            )
        };
        Err(refused(dir, "seal", why))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Manifest {
    pub(super) format: u32,
    /// The run and entry that wrote it.
    pub(super) run: RunIdentity,
    pub(super) compressed: bool,
    pub(super) position: Position,
    pub(super) model: FileRecord,
    /// Each rank's file, in rank order.
    pub(super) ranks: Vec<FileRecord>,
    /// The sha256 of everything above ([`Manifest::digest`]).
    pub(super) sha256: String,
    /// The sha256 sealed with the writer's key.
    pub(super) seal: Seal,
}

impl Manifest {
    /// The sha256 of the manifest's fields but its own hash and seal, in
    /// their canonical form (compact JSON, fields in declaration order).
    pub(super) fn digest(&self) -> String {
        let mut m = self.clone();
        m.sha256.clear();
        m.seal = Seal::default();
        let mut h = Sha256::new();
        h.update(b"harness checkpoint manifest\n");
        h.update(serde_json::to_vec(&m).expect("a manifest serialises"));
        hex::encode(h.finalize())
    }
}

/// The most bytes a manifest may hold.
const MANIFEST_CAP: u64 = 4 << 20;
/// The most bytes a file record (`model.json`, `rank-N.json`) may hold.
const RECORD_CAP: u64 = 64 << 10;

/// Refuses the file record `rec` (field `field` of the manifest of `dir`)
/// unless it names `file`, is hashed as this store hashes, and, with this
/// rank's `layout` of the file, declares no more bytes than its tensors
/// occupy (exactly as many, for the model's uncompressed file).
pub(super) fn check_record(
    dir: &Path,
    field: &str,
    rec: &FileRecord,
    file: &str,
    compressed: bool,
    layout: Option<FileLayout<'_>>,
) -> Result<()> {
    if rec.file != file {
        return Err(refused(dir, format!("{field}.file"), format!("is `{}`, not `{file}`", rec.file.escape_debug())));
    }
    let chunk = (!compressed).then_some(HASH_CHUNK as u64);
    if rec.chunk_bytes != chunk {
        return Err(refused(
            dir,
            format!("{field}.chunk_bytes"),
            format!("is {:?}; this store hashes in pieces of {chunk:?}", rec.chunk_bytes),
        ));
    }
    if rec.sha256.len() != 64 || !rec.sha256.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(refused(dir, format!("{field}.sha256"), "is not a sha256 (64 lowercase hexadecimal digits)"));
    }
    let Some(layout) = layout else { return Ok(()) };
    match layout.exact().filter(|_| !compressed) {
        Some(n) if rec.bytes != n => Err(refused(
            dir,
            format!("{field}.bytes"),
            format!("is {}, but this run's tensors make a file of exactly {n} bytes", rec.bytes),
        )),
        _ if rec.bytes > layout.max_file(compressed) => Err(refused(
            dir,
            format!("{field}.bytes"),
            format!("is {}, more than the {} bytes this run's tensors can occupy", rec.bytes, layout.max_file(compressed)),
        )),
        _ => Ok(()),
    }
}

/// A file record this rank or another wrote into a temporary directory.
pub(super) fn read_record(path: &Path) -> Result<FileRecord> {
    let mut bytes = Vec::new();
    File::open(path).and_then(|f| f.take(RECORD_CAP + 1).read_to_end(&mut bytes)).with_context(|| format!("reading {}", path.display()))?;
    anyhow::ensure!(bytes.len() as u64 <= RECORD_CAP, "{} holds more than {RECORD_CAP} bytes", path.display());
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
}

/// The manifest of the checkpoint in `folder`, read within its cap and
/// refused unless it is of this format, parses whole (no field unknown or
/// missing) and its sha256 holds.
pub(super) fn read_manifest(folder: &Dir) -> Result<Manifest> {
    let dir = folder.path();
    let bytes =
        folder.read("checkpoint.json", MANIFEST_CAP).map_err(|e| refused(dir, "checkpoint.json", format!("cannot be read: {e:#}")))?;
    #[derive(Deserialize)]
    struct Format {
        format: u32,
    }
    let f: Format = serde_json::from_slice(&bytes).map_err(|e| refused(dir, "format", format!("cannot be read: {e}")))?;
    if f.format < FORMAT {
        let why = format!(
            "is {}, an older harness's, without the keyed seal of format {FORMAT}, the only one this harness reads: run the entry \
             again in a new result file",
            f.format
        );
        return Err(refused(dir, "format", why));
    }
    if f.format != FORMAT {
        return Err(refused(dir, "format", format!("is {}; this harness reads format {FORMAT}", f.format)));
    }
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| refused(dir, "checkpoint.json", format!("does not parse: {e}")))?;
    let digest = m.digest();
    if m.sha256 != digest {
        let why =
            format!("is {}, but the manifest's fields hash to {digest}: it was changed after it was written", m.sha256.escape_debug());
        return Err(refused(dir, "sha256", why));
    }
    Ok(m)
}
