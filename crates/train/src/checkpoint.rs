//! Checkpoints: what an entry needs to go on exactly where it was (model,
//! optimizer and loss-scaler state, plugin states, data position, random
//! generator, batch), on disk and written so that a crash at any instant
//! leaves either the old set of checkpoints or the new one, never a torn one.
//!
//! Layout under an entry's checkpoint directory:
//!
//! ```text
//! step-00000040/
//!   checkpoint.json          manifest: format, the run it belongs to, step,
//!                            data position, batch, every file's size and
//!                            sha256, its own sha256 over all of that, and
//!                            its seal: an HMAC-SHA256 of that sha256 under
//!                            the user's checkpoint key
//!   model.safetensors[.zst]  parameters (rank 0 writes them; ranks hold equal copies)
//!   rank-0.safetensors[.zst] that rank's optimizer and scaler state, RNG state
//!                            and plugin states (`plugin/<slot>`, bytes)
//!   rank-0.json              that file's size and sha256 (gathered into the manifest)
//!   ...
//! ```
//!
//! A write goes to `.step-00000040.tmp/`: every rank writes its files and
//! fsyncs them, the ranks meet, rank 0 writes the manifest, fsyncs it and the
//! directory, renames the directory to its final name and fsyncs the parent.
//! Only a directory with the final name counts. Temporary directories left
//! by a crash are removed when the store is opened.
//!
//! The seal's key is the user's `checkpoints` key, kept outside every
//! checkpoint folder, in the user's state folder
//! ([`harness_format::secrets`]: `$HARNESS_STATE_DIR`, else
//! `~/.local/state/harness`), so whoever can write a checkpoint folder but
//! not that key cannot make a checkpoint this store accepts: files rewritten
//! with their hashes recomputed fail the seal. A later process of the same
//! user on the same machine (`harness run --resume`) holds the same key;
//! a checkpoint taken to another machine or user is refused unless its key
//! goes with it (checkpoints never travel in bundles).
//!
//! Reading treats the folder as hostile ([`accept`], [`confined`]): the
//! checkpoint must be a real directory of regular files (no symbolic link
//! anywhere below the entry's checkpoint directory, which itself and its
//! parent must be real directories; FIFOs and devices are refused from their
//! metadata, unopened), its manifest must be intact (its sha256) and sealed
//! with the user's key (its HMAC), of this
//! run and entry ([`RunIdentity`]), name exactly the files this store
//! writes, and hold a position within what the run could have produced
//! ([`Bounds`]); every file's size is checked against what the run's
//! tensors occupy ([`Layout`]) before it is read, and its header against
//! their names, dtypes and shapes before any tensor is allocated; reads
//! never exceed those sizes. A refusal ([`Refused`]) names the folder and
//! the field.

mod accept;
pub mod confined;
mod snapshot;

pub(crate) use accept::refused;
use accept::{dtype_name, header_json, FileLayout};
pub use accept::{
    Accept, Bounds, Layout, LrScale, Refused, RunIdentity, TensorSpec, MAX_COUNT, MAX_LR_SCALE, PLUGIN_STATE_BASE,
    PLUGIN_STATE_PER_PARAMETER,
};
use confined::Dir;
pub use snapshot::{Position, Snapshot};

use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context, Result};
use harness_format::secrets::Key;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};

/// A write given up because its snapshot was lost (the failure took the
/// node's memory); its temporary files are not a checkpoint.
#[derive(Debug, thiserror::Error)]
#[error("the checkpoint write was cancelled")]
pub struct Cancelled;

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
fn user_key() -> Result<Key> {
    Key::of_user(KEY_NAME).context("the key checkpoints are sealed with")
}

/// In unit tests, a key of the tests' own, never the user's.
#[cfg(test)]
fn user_key() -> Result<Key> {
    Ok(Key::from_bytes([0x5e; 32]))
}

/// A copy on the host that later steps cannot change.
pub fn host_copy(t: &Tensor) -> Tensor {
    let t = t.detach();
    if t.device() == Device::Cpu {
        t.copy()
    } else {
        t.to_device(Device::Cpu)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRecord {
    file: String,
    bytes: u64,
    /// Without `chunk_bytes`: the sha256 of the file. With it: the sha256 of
    /// the concatenated sha256 digests of the file's consecutive pieces of
    /// `chunk_bytes` bytes (the last one shorter), so that several threads
    /// can hash one file as fast as the disk moves it.
    sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    chunk_bytes: Option<u64>,
}

/// A manifest's seal: the HMAC-SHA256 of its sha256 under the writer's
/// checkpoint key, and that key's id ([`Key::id`], which tells a seal of
/// another key from a changed manifest in messages).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Seal {
    key: String,
    hmac: String,
}

impl Seal {
    /// The seal of the manifest whose sha256 is `digest`, made with `key`.
    fn of(key: &Key, digest: &str) -> Seal {
        Seal { key: key.id(), hmac: hex::encode(key.mac(SEAL_CONTEXT, &[digest.as_bytes()])) }
    }

    /// Refuses this seal of the manifest of `dir` (whose sha256 is
    /// `digest`) unless `key` made it.
    fn check(&self, dir: &Path, digest: &str, key: &Key) -> Result<()> {
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
struct Manifest {
    format: u32,
    /// The run and entry that wrote it.
    run: RunIdentity,
    compressed: bool,
    position: Position,
    model: FileRecord,
    /// Each rank's file, in rank order.
    ranks: Vec<FileRecord>,
    /// The sha256 of everything above ([`Manifest::digest`]).
    sha256: String,
    /// The sha256 sealed with the writer's key.
    seal: Seal,
}

impl Manifest {
    /// The sha256 of the manifest's fields but its own hash and seal, in
    /// their canonical form (compact JSON, fields in declaration order).
    fn digest(&self) -> String {
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

/// An entry's checkpoint directory, seen from one rank.
pub struct Store {
    root: PathBuf,
    rank: usize,
    world: usize,
    compress: bool,
    /// The run written into manifests, and required of those read.
    run: RunIdentity,
    /// What reads accept besides the run (none: benchmarks and tests,
    /// whose reads into snapshot buffers accept those buffers' tensors).
    accept: Option<Accept>,
    /// How reads go to the disk ([`ReadMode::RESTORE`] unless a benchmark
    /// compares others).
    pub read_mode: ReadMode,
    /// What manifests are sealed with, and seals checked against.
    key: Key,
}

/// Name of the directory of the checkpoint of `step`.
fn dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Refuses `path` if it is a symbolic link (to a directory or anything
/// else); fine if it does not exist.
fn not_a_link(path: &Path) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => bail!("{} is a symbolic link; a checkpoint directory must be a real one", path.display()),
        _ => Ok(()),
    }
}

impl Store {
    /// Opens (and on rank 0 creates) `root`, removing what crashed writes
    /// left behind, and with `fresh` every checkpoint there too (a new run
    /// of the entry, not a resumed one). Neither `root` nor its parent may
    /// be a symbolic link. The store belongs to no run in particular until
    /// [`Store::for_run`]. Its seals are made with the user's checkpoint
    /// key (made on first use; a key refused, or no folder for it, fails
    /// the open, naming the key and what to do).
    pub fn open(root: &Path, rank: usize, world: usize, compress: bool, fresh: bool) -> Result<Store> {
        let key = user_key()?;
        not_a_link(root)?;
        if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
            not_a_link(parent)?;
        }
        if rank == 0 {
            fs::create_dir_all(root).with_context(|| format!("creating the checkpoint directory {}", root.display()))?;
            for e in fs::read_dir(root)?.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let torn = name.starts_with('.') && (name.ends_with(".tmp") || name.ends_with(".deleting"));
                if torn || (fresh && name.starts_with("step-")) {
                    // Never through a symbolic link.
                    let gone = match e.file_type() {
                        Ok(t) if t.is_dir() => fs::remove_dir_all(e.path()),
                        _ => fs::remove_file(e.path()),
                    };
                    gone.with_context(|| format!("removing the torn checkpoint {}", e.path().display()))?;
                }
            }
        }
        Ok(Store {
            root: root.to_path_buf(),
            rank,
            world,
            compress,
            run: RunIdentity::anonymous(world),
            accept: None,
            read_mode: ReadMode::RESTORE,
            key,
        })
    }

    /// This store with its seals made with, and checked against, `key`
    /// instead of the user's checkpoint key.
    pub fn with_key(mut self, key: Key) -> Store {
        self.key = key;
        self
    }

    /// This store as the run `run`'s: its manifests name it, and reads
    /// refuse what `accept` does not.
    pub fn for_run(mut self, run: RunIdentity, accept: Accept) -> Result<Store> {
        anyhow::ensure!(run.world_size as usize == self.world, "a run of {} ranks for a store of {}", run.world_size, self.world);
        self.run = run;
        self.accept = Some(accept);
        Ok(self)
    }

    /// The directory of the checkpoint of `step`.
    pub fn dir(&self, step: u64) -> PathBuf {
        self.root.join(dir_name(step))
    }

    /// The steps of the checkpoints in the directory (final names only),
    /// oldest first; the directory must be a real one.
    pub fn list(&self) -> Result<Vec<u64>> {
        not_a_link(&self.root)?;
        if let Some(parent) = self.root.parent().filter(|p| !p.as_os_str().is_empty()) {
            not_a_link(parent)?;
        }
        Ok(list(&self.root).into_iter().map(|c| c.0).collect())
    }

    /// Removes the temporary files of an uncommitted write of `step` (one
    /// rank: no other rank writes into them).
    pub fn discard(&self, step: u64) -> Result<()> {
        let tmp = self.tmp(step);
        match fs::remove_dir_all(&tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e).with_context(|| format!("removing {}", tmp.display())),
            _ => Ok(()),
        }
    }

    fn tmp(&self, step: u64) -> PathBuf {
        self.root.join(format!(".{}.tmp", dir_name(step)))
    }

    fn ext(&self) -> &'static str {
        if self.compress {
            ".safetensors.zst"
        } else {
            ".safetensors"
        }
    }

    /// Writes this rank's files of `snap` into the temporary directory and
    /// syncs them. Every rank calls it; then rank 0 calls [`Store::commit`].
    /// Returns the bytes written.
    pub fn write_part(&self, snap: &Snapshot) -> Result<u64> {
        self.write_part_unless(snap, &AtomicBool::new(false))
    }

    /// [`Store::write_part`], given up with [`Cancelled`] as soon as
    /// `cancel` is set (checked every 16 MiB written).
    pub fn write_part_unless(&self, snap: &Snapshot, cancel: &AtomicBool) -> Result<u64> {
        if let Some(a) = &self.accept {
            // What a resume would refuse is not written.
            if let Some((slot, b)) = snap.plugins.iter().find(|(_, b)| b.len() as u64 > a.layout.plugin_state_cap) {
                bail!(
                    "the {slot} plugin's state is {} bytes, more than the {} a checkpoint may hold for it",
                    b.len(),
                    a.layout.plugin_state_cap
                );
            }
        }
        let tmp = self.tmp(snap.position.step);
        fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut state: Vec<(String, Tensor)> = snap.state.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        for (slot, bytes) in &snap.plugins {
            state.push((format!("plugin/{slot}"), Tensor::from_slice(bytes)));
        }
        let rec = write_tensors(&tmp, &format!("rank-{}{}", self.rank, self.ext()), &state, self.compress, cancel)?;
        let mut bytes = rec.bytes;
        write_synced(&tmp.join(format!("rank-{}.json", self.rank)), &serde_json::to_vec_pretty(&rec)?)?;
        if self.rank == 0 {
            let rec = write_tensors(&tmp, &format!("model{}", self.ext()), &snap.model, self.compress, cancel)?;
            bytes += rec.bytes;
            write_synced(&tmp.join("model.json"), &serde_json::to_vec_pretty(&rec)?)?;
        }
        Ok(bytes)
    }

    /// Rank 0, once every rank's [`Store::write_part`] succeeded: writes the
    /// manifest (every rank's file record gathered into it, and its hash)
    /// and moves the checkpoint to its final name, durably.
    pub fn commit(&self, position: Position) -> Result<PathBuf> {
        let tmp = self.tmp(position.step);
        let model: FileRecord = read_record(&tmp.join("model.json"))?;
        let ranks = (0..self.world).map(|r| read_record(&tmp.join(format!("rank-{r}.json")))).collect::<Result<Vec<FileRecord>>>()?;
        let mut m = Manifest {
            format: FORMAT,
            run: self.run.clone(),
            compressed: self.compress,
            position,
            model,
            ranks,
            sha256: String::new(),
            seal: Seal::default(),
        };
        m.sha256 = m.digest();
        m.seal = Seal::of(&self.key, &m.sha256);
        write_synced(&tmp.join("checkpoint.json"), &serde_json::to_vec_pretty(&m)?)?;
        sync_dir(&tmp)?;
        let dir = self.dir(position.step);
        if fs::symlink_metadata(&dir).is_ok() {
            // The same step saved again (after a restore): the new one wins.
            self.delete(position.step)?;
        }
        fs::rename(&tmp, &dir).with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
        sync_dir(&self.root)?;
        Ok(dir)
    }

    /// Rank 0: deletes the checkpoint of `step` (renamed away first, so a
    /// crash half-way leaves no directory that looks like a checkpoint).
    pub fn delete(&self, step: u64) -> Result<()> {
        let dir = self.dir(step);
        let away = self.root.join(format!(".{}.deleting", dir_name(step)));
        fs::rename(&dir, &away).with_context(|| format!("deleting the checkpoint {}", dir.display()))?;
        sync_dir(&self.root)?;
        // Never through a symbolic link.
        match fs::symlink_metadata(&away) {
            Ok(m) if m.is_dir() => fs::remove_dir_all(&away),
            _ => fs::remove_file(&away),
        }
        .with_context(|| format!("deleting {}", away.display()))
    }

    /// Reads this rank's part of the checkpoint of `step`, checking every
    /// file it reads against the sizes and hashes written with it.
    pub fn read(&self, step: u64) -> Result<Snapshot> {
        self.read_with(step, None)
    }

    /// As [`Store::read`], but the tensors land straight in `buffers`'
    /// memory (a snapshot set of the host-memory tier: preallocated and,
    /// on CUDA, pinned) wherever name, shape and kind match, with no copy
    /// in between: each file is read once while its pieces are hashed
    /// ([`read_file_into`]). The snapshot returned shares those buffers
    /// (and holds the few tensors they lack, such as the random generators'
    /// states). Compressed checkpoints are read as [`Store::read`] does.
    pub fn read_into(&self, step: u64, buffers: &mut Snapshot) -> Result<Snapshot> {
        self.read_with(step, Some(buffers))
    }

    /// The checkpoint folder of `step`, opened confined (see the module's
    /// documentation).
    fn folder(&self, step: u64) -> Result<Dir> {
        let dir = self.dir(step);
        let open = || -> Result<Dir> {
            not_a_link(&self.root)?;
            if let Some(parent) = self.root.parent().filter(|p| !p.as_os_str().is_empty()) {
                not_a_link(parent)?;
            }
            Dir::open(&self.root)?.dir(&dir_name(step))
        };
        open().map_err(|e| refused(&dir, "the folder", format!("cannot be read as a checkpoint: {e:#}")))
    }

    /// Refuses the manifest `m` of the checkpoint of `step` in `dir` unless
    /// it is sealed with this store's key, this run's, written as this
    /// store writes, and (with [`Store::for_run`]) within the run's bounds
    /// and layout.
    fn check(&self, m: &Manifest, step: u64, dir: &Path, layout: &Layout) -> Result<()> {
        m.seal.check(dir, &m.sha256, &self.key)?;
        self.run.check(dir, &m.run)?;
        if m.compressed != self.compress {
            return Err(refused(
                dir,
                "compressed",
                format!("is {}, but this run writes with checkpoint_compress = {}", m.compressed, self.compress),
            ));
        }
        if m.ranks.len() != self.world {
            return Err(refused(dir, "ranks", format!("holds {} file records; the run has {} ranks", m.ranks.len(), self.world)));
        }
        match &self.accept {
            Some(a) => a.bounds.check(dir, step, &m.position)?,
            None if m.position.step != step => {
                return Err(refused(dir, "position.step", format!("is {}, but the folder is named for step {step}", m.position.step)));
            }
            None => {}
        }
        let (c, ext) = (m.compressed, self.ext());
        check_record(dir, "model", &m.model, &format!("model{ext}"), c, Some(layout.model()))?;
        for (r, rec) in m.ranks.iter().enumerate() {
            let ours = (r == self.rank).then(|| layout.state());
            check_record(dir, &format!("ranks[{r}]"), rec, &format!("rank-{r}{ext}"), c, ours)?;
        }
        Ok(())
    }

    fn read_with(&self, step: u64, buffers: Option<&Snapshot>) -> Result<Snapshot> {
        let folder = self.folder(step)?;
        let dir = folder.path().to_path_buf();
        let m = read_manifest(&folder)?;
        let owned;
        let layout = match (&self.accept, buffers) {
            (Some(a), _) => &a.layout,
            (None, Some(b)) => {
                owned = Layout::of(b);
                &owned
            }
            (None, None) => bail!("a checkpoint is read only against the tensors the run expects (Store::for_run)"),
        };
        self.check(&m, step, &dir, layout)?;
        let rec = &m.ranks[self.rank];
        let buffers = buffers.filter(|_| !m.compressed);
        let read = |file: &FileRecord, part: FileLayout<'_>, into: fn(&Snapshot) -> &[(String, Tensor)]| match buffers {
            Some(b) => read_file_into(&folder, file, part, into(b), self.read_mode),
            None => read_tensors(&folder, file, part, m.compressed, self.read_mode),
        };
        let model = read(&m.model, layout.model(), |b| &b.model)?;
        let mut state = Vec::new();
        let mut plugins = Vec::new();
        for (name, t) in read(rec, layout.state(), |b| &b.state)? {
            match name.strip_prefix("plugin/") {
                Some(slot) => plugins.push((slot.to_owned(), Vec::<u8>::try_from(&t).context("a plugin state")?)),
                None => state.push((name, t)),
            }
        }
        Ok(Snapshot { position: m.position, model, state, plugins, ready: None })
    }
}

/// Refuses the file record `rec` (field `field` of the manifest of `dir`)
/// unless it names `file`, is hashed as this store hashes, and, with this
/// rank's `layout` of the file, declares no more bytes than its tensors
/// occupy (exactly as many, for the model's uncompressed file).
fn check_record(dir: &Path, field: &str, rec: &FileRecord, file: &str, compressed: bool, layout: Option<FileLayout<'_>>) -> Result<()> {
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

/// Checks a checkpoint directory completely (every rank's files, sizes and
/// hashes, against its manifest, whose own hash must hold) and returns
/// where it puts training: whether it is whole, not whether it is
/// authentic (its seal needs the writer's key; reads check it).
pub fn verify(dir: &Path) -> Result<Position> {
    let folder = Dir::open(dir)?;
    let m = read_manifest(&folder)?;
    let ext = if m.compressed { ".safetensors.zst" } else { ".safetensors" };
    check_record(dir, "model", &m.model, &format!("model{ext}"), m.compressed, None)?;
    check_file(&folder, &m.model)?;
    for (r, rec) in m.ranks.iter().enumerate() {
        check_record(dir, &format!("ranks[{r}]"), rec, &format!("rank-{r}{ext}"), m.compressed, None)?;
        check_file(&folder, rec)?;
    }
    Ok(m.position)
}

/// Reads every file of the checkpoint in `dir` from start to end as `dd
/// iflag=direct bs=16M` does (one thread, direct reads where the file
/// system allows them, nothing checked); returns the bytes read. The
/// benchmark's reference for the disk's read speed.
pub fn raw_direct_read(dir: &Path) -> Result<u64> {
    use std::os::unix::fs::FileExt;
    let mut buf = Aligned::new(CHUNK);
    let buf = buf.get(CHUNK);
    let mut total = 0;
    for e in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = e?.path();
        if !path.is_file() {
            continue;
        }
        let f = match open_direct(&path) {
            Some(f) => f,
            None => File::open(&path).with_context(|| format!("opening {}", path.display()))?,
        };
        let mut at = 0u64;
        loop {
            let k = f.read_at(buf, at).with_context(|| format!("reading {}", path.display()))?;
            if k == 0 {
                break;
            }
            at += k as u64;
        }
        total += at;
    }
    Ok(total)
}

/// Seconds to hash `bytes` bytes already in memory as checkpoint files are
/// hashed (pieces on [`HASH_THREADS`] threads): the benchmark's bound on
/// how fast a verified read can go.
pub fn hash_seconds(bytes: usize) -> f64 {
    let data = vec![1u8; bytes];
    let t0 = std::time::Instant::now();
    std::hint::black_box(hash_pieces(&[&data]));
    t0.elapsed().as_secs_f64()
}

/// Drops the files of the checkpoint in `dir` from the page cache (pages
/// that are clean), so that the next read comes from the disk.
pub fn evict_dir(dir: &Path) -> Result<()> {
    for e in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = e?.path();
        if path.is_file() {
            evict(&File::open(&path).with_context(|| format!("opening {}", path.display()))?);
        }
    }
    Ok(())
}

/// The checkpoints under `root` (final names only: `step-` and the step in
/// at least eight digits, as written), oldest first.
pub fn list(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("step-")?.parse().ok()?;
            (dir_name(step) == name).then(|| (step, e.path()))
        })
        .collect();
    v.sort();
    v
}

/// A file record this rank or another wrote into a temporary directory.
fn read_record(path: &Path) -> Result<FileRecord> {
    let mut bytes = Vec::new();
    File::open(path).and_then(|f| f.take(RECORD_CAP + 1).read_to_end(&mut bytes)).with_context(|| format!("reading {}", path.display()))?;
    anyhow::ensure!(bytes.len() as u64 <= RECORD_CAP, "{} holds more than {RECORD_CAP} bytes", path.display());
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
}

/// The manifest of the checkpoint in `folder`, read within its cap and
/// refused unless it is of this format, parses whole (no field unknown or
/// missing) and its sha256 holds.
fn read_manifest(folder: &Dir) -> Result<Manifest> {
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

/// The length and sha256 of the file `f`, read to its end (at most `max`
/// bytes).
fn sha256_file(f: &File, path: &Path, max: u64) -> Result<(u64, String)> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    let mut f = f.take(max.saturating_add(1));
    loop {
        let k = f.read(&mut buf).with_context(|| format!("reading {}", path.display()))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((n, hex::encode(h.finalize())))
}

/// Checks `rec`'s file in `folder`: its size and hash.
fn check_file(folder: &Dir, rec: &FileRecord) -> Result<()> {
    if rec.chunk_bytes.is_some() {
        return read_verified(folder, rec, ReadMode::RESTORE).map(drop);
    }
    let (f, path, _) = open_record(folder, rec)?;
    let (bytes, sha) = sha256_file(&f, &path, rec.bytes)?;
    damaged(&path, rec, bytes, &sha)
}

/// Pieces hashed separately, on several threads (see [`FileRecord`]).
const HASH_CHUNK: usize = 64 << 20;
/// Threads that hash one file's pieces.
const HASH_THREADS: usize = 4;

/// The sha256 of the piece digests (see [`FileRecord::sha256`]).
fn tree_digest(digests: &[[u8; 32]]) -> String {
    let mut h = Sha256::new();
    for d in digests {
        h.update(d);
    }
    hex::encode(h.finalize())
}

/// Hashes the pieces of `HASH_CHUNK` bytes of the byte stream `parts` on
/// [`HASH_THREADS`] threads; returns the tree digest.
fn hash_pieces(parts: &[&[u8]]) -> String {
    // Each piece as the slices of `parts` it covers.
    let mut pieces: Vec<Vec<&[u8]>> = vec![Vec::new()];
    let mut room = HASH_CHUNK;
    for p in parts {
        let mut p: &[u8] = p;
        while !p.is_empty() {
            if room == 0 {
                pieces.push(Vec::new());
                room = HASH_CHUNK;
            }
            let k = room.min(p.len());
            pieces.last_mut().expect("a piece").push(&p[..k]);
            p = &p[k..];
            room -= k;
        }
    }
    let mut digests = vec![[0u8; 32]; pieces.len()];
    std::thread::scope(|s| {
        let per = pieces.len().div_ceil(HASH_THREADS).max(1);
        for (ds, ps) in digests.chunks_mut(per).zip(pieces.chunks(per)) {
            s.spawn(move || {
                for (d, piece) in ds.iter_mut().zip(ps) {
                    let mut h = Sha256::new();
                    for c in piece {
                        h.update(c);
                    }
                    d.copy_from_slice(&h.finalize());
                }
            });
        }
    });
    tree_digest(&digests)
}

fn damaged(path: &Path, rec: &FileRecord, bytes: u64, sha: &str) -> Result<()> {
    if bytes != rec.bytes || sha != rec.sha256 {
        bail!("{} is damaged: {bytes} bytes with sha256 {sha}, written as {} bytes with sha256 {}", path.display(), rec.bytes, rec.sha256);
    }
    Ok(())
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)?;
    f.sync_all().with_context(|| format!("syncing {}", path.display()))
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("syncing the directory {}", dir.display()))
}

/// Asks the kernel to drop a synced file's pages from the page cache: a
/// checkpoint is read back only after a failure, and a restore from disk is
/// then measured as the disk delivers it, not as memory does (the
/// host-memory tier is the fast path, and says so).
fn evict(f: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid descriptor; the call only advises the kernel.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// Writeback as a file is written: each piece written is sent to the disk
/// at once (`sync_file_range`), and the writer waits for the piece
/// [`WRITEBACK_AHEAD`] pieces back. The disk works while the file is being
/// written, the final fsync has little left to do, the dirty memory a
/// checkpoint holds stays bounded, and a cancelled write stops within a few
/// pieces instead of after flushing the whole file.
struct Writeback<'f> {
    file: &'f File,
    started: u64,
    in_flight: std::collections::VecDeque<(u64, u64)>,
}

/// Pieces of [`CHUNK`] bytes on their way to the disk at once.
const WRITEBACK_AHEAD: usize = 4;

impl<'f> Writeback<'f> {
    fn new(file: &'f File) -> Writeback<'f> {
        Writeback { file, started: 0, in_flight: Default::default() }
    }

    /// The file now holds `end` bytes.
    fn written(&mut self, end: u64) {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let fd = self.file.as_raw_fd();
            let (at, len) = (self.started, end - self.started);
            // SAFETY: a valid descriptor and a range of it; the calls only
            // start or wait for the writeback of that range. Errors show in
            // the fsync that ends the write.
            unsafe {
                libc::sync_file_range(fd, at as i64, len as i64, libc::SYNC_FILE_RANGE_WRITE);
            }
            self.in_flight.push_back((at, len));
            if self.in_flight.len() > WRITEBACK_AHEAD {
                let (at, len) = self.in_flight.pop_front().expect("a range in flight");
                let wait = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
                // SAFETY: as above.
                unsafe {
                    libc::sync_file_range(fd, at as i64, len as i64, wait);
                }
            }
        }
        self.started = end;
    }
}

/// Bytes hashed or written per call.
const CHUNK: usize = 16 << 20;

/// A writer that hashes what passes through it (for compressed files,
/// where compression, not hashing, sets the pace).
struct Hashing<W: Write> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn kind_of(dtype: safetensors::Dtype) -> Result<Kind> {
    use safetensors::Dtype as D;
    Ok(match dtype {
        D::F32 => Kind::Float,
        D::F64 => Kind::Double,
        D::F16 => Kind::Half,
        D::BF16 => Kind::BFloat16,
        D::I64 => Kind::Int64,
        D::I32 => Kind::Int,
        D::I16 => Kind::Int16,
        D::I8 => Kind::Int8,
        D::U8 => Kind::Uint8,
        D::BOOL => Kind::Bool,
        d => bail!("a checkpoint file holds a {d:?} tensor, which harness does not write"),
    })
}

/// The bytes of a contiguous host tensor, in place.
fn host_bytes(t: &Tensor) -> &[u8] {
    debug_assert!(t.device() == Device::Cpu && t.is_contiguous());
    let n = t.numel() * t.kind().elt_size_in_bytes();
    if n == 0 {
        return &[];
    }
    // SAFETY: a contiguous CPU tensor's data is `n` initialised bytes at
    // data_ptr, alive as long as `t` is (the borrow ties them).
    unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, n) }
}

/// The safetensors layout of `tensors`: the 8-byte header length, the JSON
/// header (padded to 8 bytes), then each tensor's bytes in order.
fn safetensors_header(tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let mut entries = Vec::new();
    let mut at = 0u64;
    for (name, t) in tensors {
        let n = harness_kernels::torch_ext::nbytes(t);
        entries.push((name.clone(), dtype_name(t.kind())?, t.size(), [at, at + n]));
        at += n;
    }
    let json = header_json(&entries);
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    Ok(out)
}

/// Writes `tensors` as safetensors (zstd-compressed with `compress`) into
/// `dir/name`, synced, and returns the file's record. The bytes go straight
/// from the tensors' memory to the file, and are hashed on a second thread
/// as they are written: nothing is read back.
fn write_tensors(dir: &Path, name: &str, tensors: &[(String, Tensor)], compress: bool, cancel: &AtomicBool) -> Result<FileRecord> {
    let path = dir.join(name);
    let host: Vec<Tensor> = tensors
        .iter()
        .map(|(_, t)| if t.device() == Device::Cpu && t.is_contiguous() { t.shallow_clone() } else { host_copy(t).contiguous() })
        .collect();
    let header = safetensors_header(tensors)?;
    let parts: Vec<&[u8]> = std::iter::once(header.as_slice()).chain(host.iter().map(host_bytes)).collect();
    let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let (bytes, sha256) = if compress {
        let mut enc = zstd::Encoder::new(Hashing { inner: BufWriter::new(&file), hash: Sha256::new(), bytes: 0 }, 3)?;
        for p in &parts {
            for c in p.chunks(CHUNK) {
                if cancel.load(Ordering::Relaxed) {
                    return Err(Cancelled.into());
                }
                enc.write_all(c)?;
            }
        }
        let mut h = enc.finish()?;
        h.flush()?;
        (h.bytes, hex::encode(h.hash.finalize()))
    } else {
        std::thread::scope(|s| -> Result<(u64, String)> {
            let hasher = s.spawn(|| hash_pieces(&parts));
            let mut f = &file;
            let mut n = 0u64;
            let mut flush = Writeback::new(&file);
            for p in &parts {
                for c in p.chunks(CHUNK) {
                    if cancel.load(Ordering::Relaxed) {
                        return Err(Cancelled.into());
                    }
                    f.write_all(c).with_context(|| format!("writing {}", path.display()))?;
                    n += c.len() as u64;
                    flush.written(n);
                }
            }
            Ok((n, hasher.join().expect("the hashing thread panicked")))
        })?
    };
    file.sync_all().with_context(|| format!("syncing {}", path.display()))?;
    evict(&file);
    let chunk_bytes = (!compress).then_some(HASH_CHUNK as u64);
    Ok(FileRecord { file: name.to_owned(), bytes, sha256, chunk_bytes })
}

/// Opens `rec`'s file in `folder` (a regular file of at most the size its
/// record declares, see [`Dir::file`]); fails if its size is not the size
/// written.
fn open_record(folder: &Dir, rec: &FileRecord) -> Result<(File, PathBuf, u64)> {
    let path = folder.path().join(&rec.file);
    let (f, len) = folder.file(&rec.file, rec.bytes).map_err(|e| refused(folder.path(), &rec.file, format!("cannot be read: {e:#}")))?;
    if len != rec.bytes {
        bail!("{} is damaged: {len} bytes, written as {}", path.display(), rec.bytes);
    }
    Ok((f, path, len))
}

/// Reads `rec`'s file whole (through [`read_pieces`] when it was hashed in
/// pieces), and fails if size or hash differ from what was written.
fn read_verified(folder: &Dir, rec: &FileRecord, mode: ReadMode) -> Result<Vec<u8>> {
    let (mut f, path, len) = open_record(folder, rec)?;
    let mut buf = vec![0u8; len as usize];
    let sha = match rec.chunk_bytes {
        Some(chunk) => read_pieces(&|| folder.reopen_direct(&rec.file, &f), &f, vec![(&mut buf[..], false)], chunk as usize, mode)
            .with_context(|| format!("reading {}", path.display()))?,
        None => {
            f.read_exact(&mut buf).with_context(|| format!("reading {}", path.display()))?;
            hex::encode(Sha256::digest(&buf))
        }
    };
    damaged(&path, rec, len, &sha)?;
    Ok(buf)
}

/// How [`read_pieces`] reads a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadMode {
    /// Bypass the page cache (`O_DIRECT`, falling back to cached reads
    /// where the file system refuses it): the disk's pages go straight to
    /// the reader's aligned buffers, as `dd iflag=direct` reads.
    pub direct: bool,
    /// Threads that read whole pieces, in file order.
    pub readers: usize,
}

impl ReadMode {
    /// What restores use: measured by `harness bench checkpoint-read`
    /// (docs/benchmarks.md).
    pub const RESTORE: ReadMode = ReadMode { direct: true, readers: 2 };
}

/// Alignment of direct reads: offsets, lengths and buffer addresses.
const DIRECT_ALIGN: usize = 4096;

/// A piece's buffer, aligned for direct reads.
struct Aligned {
    bytes: Vec<u8>,
    at: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        // Zeroed large allocations are fresh mappings: nothing is written
        // until the pages are first touched.
        let bytes = vec![0u8; len + DIRECT_ALIGN];
        let at = bytes.as_ptr().align_offset(DIRECT_ALIGN);
        Aligned { bytes, at }
    }

    fn len(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn get(&mut self, len: usize) -> &mut [u8] {
        &mut self.bytes[self.at..self.at + len]
    }
}

/// Read buffers kept between reads: a fresh buffer costs its first touch
/// of every page, which on a virtual machine took 0.18 s for 384 MiB, as
/// long as a quarter of a restore's disk read.
static READ_BUFFERS: std::sync::Mutex<Vec<Aligned>> = std::sync::Mutex::new(Vec::new());

/// Buffers kept at most.
const KEPT_BUFFERS: usize = 8;

/// A buffer of at least `len` bytes, kept or new.
fn take_buffer(len: usize) -> Aligned {
    let mut kept = READ_BUFFERS.lock().expect("the read buffers");
    match kept.iter().position(|b| b.len() >= len) {
        Some(i) => kept.swap_remove(i),
        None => Aligned::new(len),
    }
}

fn keep_buffer(b: Aligned) {
    let mut kept = READ_BUFFERS.lock().expect("the read buffers");
    if kept.len() < KEPT_BUFFERS {
        kept.push(b);
    }
}

/// Allocates, and touches every page of, the buffers a restore from disk
/// reads through ([`ReadMode::RESTORE`]: one piece per reader and two
/// being hashed, 64 MiB each), so that the first restore does not pay for
/// them. The process keeps them (256 MiB).
pub fn reserve_read_buffers() {
    let n = ReadMode::RESTORE.readers + 2;
    let mut fresh = Vec::new();
    while READ_BUFFERS.lock().expect("the read buffers").len() + fresh.len() < n {
        let mut b = Aligned::new(HASH_CHUNK);
        for page in b.get(HASH_CHUNK).chunks_mut(4096) {
            page[0] = 1;
        }
        fresh.push(b);
    }
    fresh.into_iter().for_each(keep_buffer);
}

/// Reads the file at `path` (opened as `f`) into `segments`, its bytes in
/// file order (those marked `true` hold theirs already), and returns the
/// tree digest of its pieces of `chunk` bytes. Reader threads read whole
/// pieces, one large read each (as `dd` does), into buffers of their own;
/// [`HASH_THREADS`] threads hash each piece and copy it where it belongs,
/// so the disk never waits for hashing or copying.
fn read_pieces(
    reopen_direct: &dyn Fn() -> Option<File>,
    f: &File,
    segments: Vec<(&mut [u8], bool)>,
    chunk: usize,
    mode: ReadMode,
) -> Result<String> {
    use std::os::unix::fs::FileExt;
    use std::sync::{mpsc, Mutex};
    anyhow::ensure!(chunk > 0, "a checkpoint file record with chunk_bytes = 0");
    let len = f.metadata()?.len() as usize;
    // Direct reads need aligned offsets: pieces of whole pages.
    let direct = if mode.direct && chunk % DIRECT_ALIGN == 0 { reopen_direct() } else { None };
    if direct.is_none() {
        will_need(f);
    }
    let mut pieces: Vec<Vec<(&mut [u8], bool)>> = Vec::new();
    let mut piece = Vec::new();
    let mut room = chunk;
    for (mut seg, filled) in segments {
        while !seg.is_empty() {
            let (now, rest) = seg.split_at_mut(room.min(seg.len()));
            room -= now.len();
            piece.push((now, filled));
            seg = rest;
            if room == 0 {
                pieces.push(std::mem::take(&mut piece));
                room = chunk;
            }
        }
    }
    if !piece.is_empty() {
        pieces.push(piece);
    }
    let n = pieces.len();
    anyhow::ensure!(n == len.div_ceil(chunk), "the segments do not cover the file");
    let readers = mode.readers.clamp(1, n.max(1));
    let size = chunk.min(len).next_multiple_of(DIRECT_ALIGN);
    // Free buffers: one per reader, and two for pieces being hashed (which
    // goes a few times faster than disks read), so readers rarely wait.
    let (free_tx, free_rx) = mpsc::channel::<Aligned>();
    for _ in 0..(readers + 2).min(n) {
        free_tx.send(take_buffer(size)).expect("the free buffers");
    }
    let free_rx = Mutex::new(free_rx);
    let queue = Mutex::new(pieces.into_iter().enumerate());
    let (full_tx, full_rx) = mpsc::sync_channel::<(usize, Vec<(&mut [u8], bool)>, Aligned, usize)>(HASH_THREADS);
    let full_rx = Mutex::new(full_rx);
    let digests = Mutex::new(vec![[0u8; 32]; n]);
    let failed = AtomicBool::new(false);
    std::thread::scope(|s| -> Result<()> {
        let hashers: Vec<_> = (0..HASH_THREADS)
            .map(|_| {
                let free_tx = free_tx.clone();
                s.spawn(|| {
                    let free_tx = free_tx;
                    loop {
                        let next = full_rx.lock().expect("the full buffers").recv();
                        let Ok((i, parts, mut buf, got)) = next else { return };
                        let bytes = buf.get(got);
                        digests.lock().expect("the digests")[i] = Sha256::digest(&*bytes).into();
                        let mut at = 0;
                        for (part, filled) in parts {
                            if !filled {
                                part.copy_from_slice(&bytes[at..at + part.len()]);
                            }
                            at += part.len();
                        }
                        let _ = free_tx.send(buf);
                    }
                })
            })
            .collect();
        drop(free_tx);
        let readers: Vec<_> = (0..readers)
            .map(|_| {
                let full_tx = full_tx.clone();
                s.spawn(|| -> std::io::Result<()> {
                    let full_tx = full_tx;
                    loop {
                        if failed.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        // A piece and a buffer, taken together so that the
                        // pieces reach the disk in file order.
                        let (next, buf) = {
                            let mut q = queue.lock().expect("the piece queue");
                            let Some(next) = q.next() else { return Ok(()) };
                            (next, free_rx.lock().expect("the free buffers").recv())
                        };
                        let (i, parts) = next;
                        let Ok(mut buf) = buf else { return Ok(()) };
                        let want = chunk.min(len - i * chunk);
                        let whole = if direct.is_some() { want.next_multiple_of(DIRECT_ALIGN) } else { want };
                        let mut got = 0;
                        let out = buf.get(whole);
                        let mut src = direct.as_ref().unwrap_or(f);
                        while got < want {
                            match src.read_at(&mut out[got..], (i * chunk + got) as u64) {
                                Ok(0) => {
                                    failed.store(true, Ordering::Relaxed);
                                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                                }
                                Ok(k) => got += k,
                                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                                // A file system that opens files for direct
                                // reads but refuses this one: read it cached.
                                Err(e) if e.kind() == std::io::ErrorKind::InvalidInput && !std::ptr::eq(src, f) => src = f,
                                Err(e) => {
                                    failed.store(true, Ordering::Relaxed);
                                    return Err(e);
                                }
                            }
                        }
                        if full_tx.send((i, parts, buf, want)).is_err() {
                            return Ok(());
                        }
                    }
                })
            })
            .collect();
        drop(full_tx);
        let mut result = Ok(());
        for r in readers {
            if let Err(e) = r.join().expect("a checkpoint reader panicked") {
                result = Err(e);
            }
        }
        for h in hashers {
            h.join().expect("a checkpoint hasher panicked");
        }
        free_rx.lock().expect("the free buffers").try_iter().for_each(keep_buffer);
        Ok(result?)
    })?;
    Ok(tree_digest(&digests.into_inner().expect("the digests")))
}

/// `path` opened for direct reads, where its file system allows them.
fn open_direct(path: &Path) -> Option<File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        None
    }
}

/// The bytes of a CPU tensor's memory, to be written (contiguous, on the
/// host; empty for an empty tensor).
///
/// # Safety
/// Nothing else may read or write `t`'s memory while the slice lives.
#[allow(clippy::mut_from_ref)] // the memory is libtorch's, not the handle's
unsafe fn host_bytes_mut(t: &Tensor) -> &mut [u8] {
    let n = t.numel() * t.kind().elt_size_in_bytes();
    if n == 0 {
        return &mut [];
    }
    // SAFETY: a contiguous CPU tensor owns `n` bytes at its data pointer;
    // the caller has it to itself.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut u8, n) }
}

/// Reads the uncompressed, piece-hashed file of `rec` into the tensors of
/// `into` that match its tensors by name, shape and kind (new host tensors
/// for the others), through [`read_pieces`]; its header is refused unless
/// it lists exactly `layout`'s tensors (before any is allocated), and the
/// read fails if size or hash differ from what was written. Returns the
/// tensors in file order.
fn read_file_into(
    folder: &Dir,
    rec: &FileRecord,
    layout: FileLayout<'_>,
    into: &[(String, Tensor)],
    mode: ReadMode,
) -> Result<Vec<(String, Tensor)>> {
    let chunk = rec.chunk_bytes.context("a file record without pieces")? as usize;
    let (mut f, path, len) = open_record(folder, rec)?;
    let damaged_header = || anyhow::anyhow!("{} is damaged: its header does not parse (sha256 not checked)", path.display());
    let mut prefix = [0u8; 8];
    f.read_exact(&mut prefix).with_context(|| format!("reading {}", path.display()))?;
    let n = u64::from_le_bytes(prefix);
    if n.checked_add(8).is_none_or(|end| end > len) {
        return Err(damaged_header());
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).with_context(|| format!("reading {}", path.display()))?;
    let meta: safetensors::tensor::Metadata = serde_json::from_slice(&header).map_err(|_| damaged_header())?;
    let mut infos: Vec<(String, &safetensors::tensor::TensorInfo)> = meta.tensors().into_iter().collect();
    // By start, an empty tensor before a full one at the same offset.
    infos.sort_by_key(|(_, i)| i.data_offsets);
    let listed = infos.iter().map(|(name, info)| Ok((name.clone(), kind_of(info.dtype)?, dims(&info.shape)))).collect::<Result<Vec<_>>>();
    layout.check(folder.path(), &rec.file, &listed.map_err(|e| refused(folder.path(), &rec.file, format!("{e:#}")))?)?;
    // The data must tile the rest of the file exactly.
    let mut end = 0;
    let mut out = Vec::with_capacity(infos.len());
    for (name, info) in &infos {
        let (a, b) = info.data_offsets;
        let kind = kind_of(info.dtype)?;
        let shape = dims(&info.shape);
        let want = shape.iter().product::<i64>() as usize * kind.elt_size_in_bytes();
        if a != end || b < a || b - a != want {
            return Err(damaged_header());
        }
        end = b;
        let fits = |t: &Tensor| t.size() == shape && t.kind() == kind && t.device() == Device::Cpu && t.is_contiguous();
        let t = match into.iter().find(|(n, t)| n == name && fits(t)) {
            Some((_, t)) => t.shallow_clone(),
            None => Tensor::f_empty(&shape, (kind, Device::Cpu))?,
        };
        out.push((name.clone(), t));
    }
    if 8 + n + end as u64 != len {
        return Err(damaged_header());
    }
    // The file as a sequence of byte ranges in memory, the first two read.
    let mut segments: Vec<(&mut [u8], bool)> = vec![(&mut prefix[..], true), (&mut header[..], true)];
    for (_, t) in &out {
        // SAFETY: each tensor is written only here and read (hashed) only
        // after it was written, within this call; `into`'s tensors belong
        // to the caller's free snapshot set, which nothing else uses.
        segments.push((unsafe { host_bytes_mut(t) }, false));
    }
    let sha = read_pieces(&|| folder.reopen_direct(&rec.file, &f), &f, segments, chunk, mode)
        .with_context(|| format!("reading {}", path.display()))?;
    damaged(&path, rec, len, &sha)?;
    Ok(out)
}

/// A safetensors shape as libtorch's (a dimension beyond `i64` becomes -1,
/// which no layout has).
fn dims(shape: &[usize]) -> Vec<i64> {
    shape.iter().map(|&d| i64::try_from(d).unwrap_or(-1)).collect()
}

/// Advises the kernel that all of `f` will be read soon: it starts reading
/// the file into its cache at once.
fn will_need(f: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid descriptor; the call only advises the kernel.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED);
    }
}

/// Reads the tensors of `rec`'s file, verified against its size and hash;
/// a compressed file is decompressed to at most the size `layout`'s
/// tensors occupy, and its header is refused unless it lists exactly
/// `layout`'s tensors.
fn read_tensors(folder: &Dir, rec: &FileRecord, layout: FileLayout<'_>, compressed: bool, mode: ReadMode) -> Result<Vec<(String, Tensor)>> {
    let path = folder.path().join(&rec.file);
    let mut bytes = read_verified(folder, rec, mode)?;
    if compressed {
        let max = layout.max_uncompressed();
        let mut out = Vec::new();
        zstd::stream::read::Decoder::new(bytes.as_slice())
            .and_then(|d| d.take(max.saturating_add(1)).read_to_end(&mut out))
            .with_context(|| format!("decompressing {}", path.display()))?;
        if out.len() as u64 > max {
            let why = format!("decompresses to more than the {max} bytes this run's tensors can occupy");
            return Err(refused(folder.path(), &rec.file, why));
        }
        bytes = out;
    }
    let st = safetensors::SafeTensors::deserialize(&bytes).with_context(|| format!("parsing {}", path.display()))?;
    let listed = st.tensors().into_iter().map(|(name, v)| Ok((name, kind_of(v.dtype())?, dims(v.shape())))).collect::<Result<Vec<_>>>();
    layout.check(folder.path(), &rec.file, &listed.map_err(|e| refused(folder.path(), &rec.file, format!("{e:#}")))?)?;
    let mut named: Vec<(usize, String, Tensor)> = Vec::new();
    for (name, view) in st.tensors() {
        let shape = dims(view.shape());
        let kind = kind_of(view.dtype())?;
        let at = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
        named.push((at, name, Tensor::f_from_data_size(view.data(), &shape, kind)?));
    }
    // In the order written (the header's map order is not kept).
    named.sort_by_key(|n| n.0);
    Ok(named.into_iter().map(|(_, n, t)| (n, t)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// The key the stores of these tests seal with.
    pub(super) fn key() -> Key {
        super::user_key().expect("the tests' key")
    }

    fn snap(step: u64, v: f32) -> Snapshot {
        Snapshot {
            position: Position { step, data_position: step * 4, micro_batch: 4, accum_steps: 1, lr_scale: 1.0 },
            model: vec![("w".into(), Tensor::from_slice(&[v, v + 1.0]))],
            state: vec![("optimizer/exp_avg.0".into(), Tensor::from_slice(&[v * 2.0]))],
            plugins: vec![("compressor".into(), vec![1, 2, 3]), ("batch".into(), vec![])],
            ready: None,
        }
    }

    /// The run the stores of these tests belong to, as entry `entry`.
    fn run(entry: &str) -> RunIdentity {
        RunIdentity {
            suite_sha256: "ab".repeat(32),
            entry: entry.into(),
            seed: 7,
            world_size: 1,
            steps: Some(300),
            plugins: [("compressor".to_owned(), "cd".repeat(32))].into(),
            shards: String::new(),
        }
    }

    /// What the stores of these tests accept: [`snap`]'s tensors, the
    /// fixed batch 4 x 1 and 300 steps.
    fn accept() -> Accept {
        Accept { layout: Layout::of(&snap(0, 0.0)), bounds: Bounds::fixed(4, 1, Some(300)) }
    }

    /// A store of entry `w/a/r0` in `root`.
    fn store(root: &Path, compress: bool) -> Store {
        Store::open(root, 0, 1, compress, false).unwrap().for_run(run("w/a/r0"), accept()).unwrap()
    }

    #[test]
    fn a_checkpoint_reads_back_what_was_written_and_damage_is_found() {
        for compress in [false, true] {
            let d = tempfile::tempdir().unwrap();
            let s = store(d.path(), compress);
            s.write_part(&snap(10, 1.5)).unwrap();
            let dir = s.commit(snap(10, 1.5).position).unwrap();
            assert_eq!(verify(&dir).unwrap().step, 10);
            let back = s.read(10).unwrap();
            assert_eq!(back.position, snap(10, 1.5).position);
            assert_eq!(Vec::<f32>::try_from(&back.model[0].1).unwrap(), vec![1.5, 2.5]);
            assert_eq!(back.plugin("compressor"), Some(&[1u8, 2, 3][..]));
            assert_eq!(back.plugin("batch"), Some(&[][..]));
            assert_eq!(list(d.path()).iter().map(|c| c.0).collect::<Vec<_>>(), vec![10]);

            // A flipped byte is reported, naming the file.
            let f = dir.join(format!("model{}", s.ext()));
            let mut b = fs::read(&f).unwrap();
            let last = b.len() - 1;
            b[last] ^= 1;
            fs::write(&f, b).unwrap();
            let e = format!("{:#}", verify(&dir).unwrap_err());
            assert!(e.contains("is damaged"), "{e}");
            assert!(s.read(10).is_err());
        }
    }

    #[test]
    fn reads_into_snapshot_buffers_land_in_their_memory_and_find_damage() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), false);
        s.write_part(&snap(10, 1.5)).unwrap();
        let dir = s.commit(snap(10, 1.5).position).unwrap();
        let mut buffers = snap(0, 0.0);
        buffers.plugins.clear();
        let back = s.read_into(10, &mut buffers).unwrap();
        assert_eq!(back.position, snap(10, 1.5).position);
        // Straight into the buffers' memory, no copy.
        assert_eq!(back.model[0].1.data_ptr(), buffers.model[0].1.data_ptr());
        assert_eq!(Vec::<f32>::try_from(&buffers.model[0].1).unwrap(), vec![1.5, 2.5]);
        assert_eq!(back.state[0].1.data_ptr(), buffers.state[0].1.data_ptr());
        assert_eq!(Vec::<f32>::try_from(&buffers.state[0].1).unwrap(), vec![3.0]);
        assert_eq!(back.plugin("compressor"), Some(&[1u8, 2, 3][..]));
        assert_eq!(back.plugin("batch"), Some(&[][..]));

        // Pieces of 7 bytes: they straddle the length prefix, the header
        // and the tensors; the digest is the same tree as written.
        let rec = read_record(&dir.join("rank-0.json")).unwrap();
        let bytes = fs::read(dir.join(&rec.file)).unwrap();
        let digests: Vec<[u8; 32]> = bytes.chunks(7).map(|c| Sha256::digest(c).into()).collect();
        let small = FileRecord { sha256: tree_digest(&digests), chunk_bytes: Some(7), ..rec.clone() };
        let into = vec![("optimizer/exp_avg.0".to_owned(), Tensor::from_slice(&[0.0f32]))];
        let (folder, layout) = (Dir::open(&dir).unwrap(), accept().layout);
        let got = read_file_into(&folder, &small, layout.state(), &into, ReadMode::RESTORE).unwrap();
        assert_eq!(got.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["optimizer/exp_avg.0", "plugin/compressor", "plugin/batch"]);
        assert_eq!(Vec::<f32>::try_from(&into[0].1).unwrap(), vec![3.0]);

        // A flipped byte in the data, or in the header, is found.
        let f = dir.join(&rec.file);
        for at in [bytes.len() - 1, 9] {
            let mut b = bytes.clone();
            b[at] ^= 1;
            fs::write(&f, b).unwrap();
            let Err(e) = s.read_into(10, &mut snap(0, 0.0)) else { panic!("byte {at}: the damage was not found") };
            let e = format!("{e:#}");
            assert!(e.contains("is damaged"), "byte {at}: {e}");
        }
        // A shape that does not match gets a tensor of its own.
        fs::write(&f, &bytes).unwrap();
        let odd = vec![("optimizer/exp_avg.0".to_owned(), Tensor::from_slice(&[0.0f32, 0.0]))];
        let got = read_file_into(&folder, &rec, layout.state(), &odd, ReadMode::RESTORE).unwrap();
        assert_ne!(got[0].1.data_ptr(), odd[0].1.data_ptr());
        assert_eq!(Vec::<f32>::try_from(&got[0].1).unwrap(), vec![3.0]);
    }

    #[test]
    fn every_read_mode_reads_the_same_bytes_and_finds_damage() {
        let d = tempfile::tempdir().unwrap();
        let big: Vec<f32> = (0..100_003).map(|i| i as f32 * 0.5).collect();
        let mut written = snap(10, 1.5);
        written.state[0].1 = Tensor::from_slice(&big);
        let layout = Layout::of(&written);
        let s = Store::open(d.path(), 0, 1, false, true).unwrap();
        let s = s.for_run(run("w/a/r0"), Accept { layout: layout.clone(), bounds: Bounds::fixed(4, 1, None) }).unwrap();
        s.write_part(&written).unwrap();
        let dir = s.commit(written.position).unwrap();
        // Pieces of two pages (direct reads apply) over a 400 KB file: many
        // pieces in flight, the last one short.
        let rec = read_record(&dir.join("rank-0.json")).unwrap();
        let bytes = fs::read(dir.join(&rec.file)).unwrap();
        let folder = Dir::open(&dir).unwrap();
        let chunk = 2 * DIRECT_ALIGN;
        let digests: Vec<[u8; 32]> = bytes.chunks(chunk).map(|c| Sha256::digest(c).into()).collect();
        let small = FileRecord { sha256: tree_digest(&digests), chunk_bytes: Some(chunk as u64), ..rec.clone() };
        let f = dir.join(&rec.file);
        for direct in [true, false] {
            for readers in [1, 3, 8] {
                let mode = ReadMode { direct, readers };
                let into = vec![("optimizer/exp_avg.0".to_owned(), Tensor::zeros([100_003], (Kind::Float, Device::Cpu)))];
                read_file_into(&folder, &small, layout.state(), &into, mode).unwrap();
                assert_eq!(Vec::<f32>::try_from(&into[0].1).unwrap(), big, "{mode:?}");
                // A flipped byte in a middle piece is found.
                let mut b = bytes.clone();
                b[bytes.len() / 2] ^= 1;
                fs::write(&f, b).unwrap();
                let e = format!("{:#}", read_file_into(&folder, &small, layout.state(), &into, mode).unwrap_err());
                assert!(e.contains("is damaged"), "{mode:?}: {e}");
                fs::write(&f, &bytes).unwrap();
            }
        }
    }

    #[test]
    fn torn_writes_are_not_checkpoints_and_are_cleaned_up() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), false);
        s.write_part(&snap(5, 1.0)).unwrap(); // no commit: a crash here
        assert!(list(d.path()).is_empty());
        s.write_part(&snap(6, 1.0)).unwrap();
        s.commit(snap(6, 1.0).position).unwrap();
        s.delete(6).unwrap();
        assert!(list(d.path()).is_empty());
        Store::open(d.path(), 0, 1, false, false).unwrap();
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 0, "the torn write was left behind");
    }

    /// The refusal `r` ends in, checked to name the checkpoint folder `dir`
    /// and the field `field` in its message.
    fn refusal<T>(r: Result<T>, dir: &Path, field: &str) -> String {
        let Err(e) = r else { panic!("the checkpoint in {} was accepted; `{field}` should be refused", dir.display()) };
        let message = format!("{e:#}");
        let refused = e.chain().find_map(|c| c.downcast_ref::<Refused>()).unwrap_or_else(|| panic!("not a refusal: {message}"));
        assert_eq!(refused.field, field, "{message}");
        assert_eq!(refused.dir, dir, "{message}");
        assert!(message.contains(&dir.display().to_string()) && message.contains(&format!("`{field}`")), "{message}");
        message
    }

    /// A store of entry `w/a/r0` in a new folder, with the checkpoint of
    /// step 40 written; the folder and the checkpoint's directory.
    fn written(compress: bool) -> (tempfile::TempDir, Store, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let s = store(&d.path().join("w_a_r0"), compress);
        s.write_part(&snap(40, 1.5)).unwrap();
        let dir = s.commit(snap(40, 1.5).position).unwrap();
        (d, s, dir)
    }

    /// Edits the manifest in `dir` as someone who knows the format and
    /// holds the user's key would: its sha256 recomputed and sealed anew.
    fn forge(dir: &Path, edit: impl FnOnce(&mut Manifest)) {
        forge_with(dir, Some(&key()), edit)
    }

    /// [`forge`], the seal made with `key` (None: the seal left as it was,
    /// by someone without a key).
    fn forge_with(dir: &Path, key: Option<&Key>, edit: impl FnOnce(&mut Manifest)) {
        let path = dir.join("checkpoint.json");
        let mut m: Manifest = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        edit(&mut m);
        m.sha256 = m.digest();
        if let Some(key) = key {
            m.seal = Seal::of(key, &m.sha256);
        }
        fs::write(path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    }

    #[test]
    fn an_honest_checkpoint_restores_bit_for_bit_and_lr_scale_keeps_its_bits() {
        let d = tempfile::tempdir().unwrap();
        let bounds = Bounds::plugin("ramp", 65536, Some(300));
        let s = Store::open(d.path(), 0, 1, false, false).unwrap();
        let s = s.for_run(run("w/a/r0"), Accept { layout: accept().layout, bounds }).unwrap();
        let mut w = snap(40, 1.5);
        // A value that a JSON number need not read back to bit for bit.
        w.position.lr_scale = 0.1f64.sqrt() * 3.000000000000001;
        s.write_part(&w).unwrap();
        s.commit(w.position).unwrap();
        let back = s.read(40).unwrap();
        assert_eq!(back.position.lr_scale.to_bits(), w.position.lr_scale.to_bits());
        assert_eq!(back.position, w.position);
        assert!(back.model[0].1.equal(&w.model[0].1) && back.state[0].1.equal(&w.state[0].1));
    }

    #[test]
    fn a_symlinked_step_folder_file_or_checkpoint_directory_is_refused() {
        let (_a, s, dir) = written(false);
        // Another run's checkpoint, outside the folder, of the very same
        // entry: linked in as a newer step.
        let (_b, _, theirs) = written(false);
        let linked = s.dir(41);
        std::os::unix::fs::symlink(&theirs, &linked).unwrap();
        assert_eq!(s.list().unwrap(), [40, 41]);
        let e = refusal(s.read(41), &linked, "the folder");
        assert!(e.contains("is a symbolic link, not a directory"), "{e}");
        // A file of the checkpoint linked to the same bytes elsewhere.
        let model = dir.join("model.safetensors");
        fs::remove_file(&model).unwrap();
        std::os::unix::fs::symlink(theirs.join("model.safetensors"), &model).unwrap();
        let e = refusal(s.read(40), &dir, "model.safetensors");
        assert!(e.contains("is a symbolic link, not a regular file"), "{e}");
        // The entry's checkpoint directory itself, or its parent, a link.
        let root = dir.parent().unwrap();
        let link = root.with_file_name("linked");
        std::os::unix::fs::symlink(root, &link).unwrap();
        let e = format!("{:#}", Store::open(&link, 0, 1, false, false).err().unwrap());
        assert!(e.contains("is a symbolic link"), "{e}");
        let e = format!("{:#}", Store::open(&link.join("x"), 0, 1, false, false).err().unwrap());
        assert!(e.contains("is a symbolic link"), "{e}");
    }

    #[test]
    fn a_manifest_naming_a_file_outside_its_folder_is_refused() {
        let (_d, s, dir) = written(false);
        // Without its hash recomputed, any edit is refused by the hash.
        let path = dir.join("checkpoint.json");
        let text = fs::read_to_string(&path).unwrap();
        fs::write(&path, text.replace("\"model.safetensors\"", "\"../step-00000041/model.safetensors\"")).unwrap();
        refusal(s.read(40), &dir, "sha256");
        fs::write(&path, &text).unwrap();
        for outside in ["../step-00000041/model.safetensors", "/etc/passwd", "..", "sub/model.safetensors"] {
            forge(&dir, |m| m.model.file = outside.into());
            let e = refusal(s.read(40), &dir, "model.file");
            assert!(e.contains("not `model.safetensors`"), "{e}");
            refusal(verify(&dir), &dir, "model.file");
            fs::write(&path, &text).unwrap();
            forge(&dir, |m| m.ranks[0].file = outside.into());
            refusal(s.read(40), &dir, "ranks[0].file");
            fs::write(&path, &text).unwrap();
        }
        s.read(40).unwrap();
    }

    #[test]
    fn a_renamed_step_folder_and_a_step_beyond_the_plan_are_refused() {
        let (_d, s, dir) = written(false);
        let renamed = s.dir(99_999_999);
        fs::rename(&dir, &renamed).unwrap();
        assert_eq!(s.list().unwrap(), [99_999_999]);
        let e = refusal(s.read(99_999_999), &renamed, "position.step");
        assert!(e.contains("is 40, but the folder is named for step 99999999"), "{e}");
        // The manifest changed to agree: beyond the run's 300 steps.
        forge(&renamed, |m| {
            m.position.step = 99_999_999;
            m.position.data_position = 99_999_999 * 4;
        });
        let e = refusal(s.read(99_999_999), &renamed, "position.step");
        assert!(e.contains("beyond the 300 steps the run plans"), "{e}");
        // Names that are not the canonical form are no checkpoints.
        fs::rename(&renamed, s.root.join("step-40")).unwrap();
        assert!(s.list().unwrap().is_empty());
    }

    #[test]
    fn every_field_of_the_position_is_bounded_and_covered_by_the_hash() {
        let (_d, s, dir) = written(false);
        let path = dir.join("checkpoint.json");
        let honest = fs::read(&path).unwrap();
        // Not covered by the hash: refused as an edit.
        let text = String::from_utf8(honest.clone()).unwrap();
        fs::write(&path, text.replace("\"micro_batch\": 4", "\"micro_batch\": 4000000000")).unwrap();
        let e = refusal(s.read(40), &dir, "sha256");
        assert!(e.contains("changed after it was written"), "{e}");
        // Covered by a recomputed hash: refused by its bound.
        type Edit = fn(&mut Position);
        let cases: [(&str, Edit, &str); 9] = [
            ("position.micro_batch", |p| p.micro_batch = 4_000_000_000, "is 4000000000, outside 1..=4"),
            ("position.micro_batch", |p| p.micro_batch = 0, "outside 1..=4"),
            ("position.accum_steps", |p| p.accum_steps = 2, "is 2, outside 1..=1"),
            ("position.lr_scale", |p| p.lr_scale = 1e30, "is 1000000000000000000000000000000, not 1"),
            ("position.lr_scale", |p| p.lr_scale = f64::NAN, "is NaN, not 1"),
            ("position.data_position", |p| p.data_position = u64::MAX, "outside 40..=176"),
            ("position.data_position", |p| p.data_position = 39, "outside 40..=176"),
            ("position.step", |p| p.step = 0, "is 0, but the folder is named for step 40"),
            ("position.step", |p| p.step = 41, "is 41, but the folder is named for step 40"),
        ];
        for (field, edit, why) in cases {
            forge(&dir, |m| edit(&mut m.position));
            let e = refusal(s.read(40), &dir, field);
            assert!(e.contains(why), "{e}");
            fs::write(&path, &honest).unwrap();
        }
        // A batch-policy plugin: what the host accepts from one.
        let p = Store::open(s.root.as_path(), 0, 1, false, false).unwrap();
        let p = p.for_run(run("w/a/r0"), Accept { layout: accept().layout, bounds: Bounds::plugin("ramp", 65536, Some(300)) }).unwrap();
        forge(&dir, |m| m.position.lr_scale = 2.5);
        assert_eq!(p.read(40).unwrap().position.lr_scale, 2.5);
        let cases: [(&str, Edit, &str); 5] = [
            ("position.lr_scale", |p| p.lr_scale = 1e30, "it must be finite, positive and at most 4294967296"),
            ("position.lr_scale", |p| p.lr_scale = -1.0, "it must be finite, positive"),
            ("position.lr_scale", |p| p.lr_scale = f64::INFINITY, "it must be finite, positive"),
            ("position.micro_batch", |p| p.micro_batch = 4_000_000_000, "outside 1..=65536"),
            ("position.accum_steps", |p| p.accum_steps = 65537, "outside 1..=65536"),
        ];
        for (field, edit, why) in cases {
            fs::write(&path, &honest).unwrap();
            forge(&dir, |m| edit(&mut m.position));
            let e = refusal(p.read(40), &dir, field);
            assert!(e.contains(why), "{e}");
        }
        // lr_scale as a JSON number (not the exact text) does not parse.
        fs::write(&path, &honest).unwrap();
        let text = String::from_utf8(honest.clone()).unwrap();
        fs::write(&path, text.replace("\"lr_scale\": \"1\"", "\"lr_scale\": 1e30")).unwrap();
        refusal(s.read(40), &dir, "checkpoint.json");
        // An unknown field is refused, not ignored (it would be outside the hash).
        fs::write(&path, text.replacen("\"format\": 3,", "\"format\": 3, \"extra\": 1,", 1)).unwrap();
        let e = refusal(s.read(40), &dir, "checkpoint.json");
        assert!(e.contains("unknown field `extra`"), "{e}");
        // Format 2 (no keyed seal) and older: refused by name, with what to do.
        for old in [1, 2] {
            fs::write(&path, text.replacen("\"format\": 3", &format!("\"format\": {old}"), 1)).unwrap();
            let e = refusal(s.read(40), &dir, "format");
            assert!(e.contains(&format!("is {old}, an older harness's, without the keyed seal of format 3")), "{e}");
            assert!(e.contains("run the entry again in a new result file"), "{e}");
        }
        fs::write(&path, text.replacen("\"format\": 3", "\"format\": 4", 1)).unwrap();
        let e = refusal(s.read(40), &dir, "format");
        assert!(e.contains("is 4; this harness reads format 3"), "{e}");
    }

    #[test]
    fn a_sparse_8_gib_file_is_refused_before_it_is_read() {
        let t0 = std::time::Instant::now();
        let (_d, s, dir) = written(false);
        // In place of the model file, the manifest untouched.
        let model = dir.join("model.safetensors");
        let honest = fs::read(&model).unwrap();
        File::create(&model).unwrap().set_len(8 << 30).unwrap();
        let e = refusal(s.read(40), &dir, "model.safetensors");
        assert!(e.contains("is 8589934592 bytes, more than the"), "{e}");
        refusal(s.read_into(40, &mut snap(0, 0.0)), &dir, "model.safetensors");
        // Declared in the manifest as well.
        forge(&dir, |m| m.model.bytes = 8 << 30);
        let e = refusal(s.read(40), &dir, "model.bytes");
        assert!(e.contains(&format!("is 8589934592, but this run's tensors make a file of exactly {} bytes", honest.len())), "{e}");
        // A rank file, compressed or not: within what its tensors occupy.
        for compress in [false, true] {
            let (_d, s, dir) = written(compress);
            let rank = dir.join(format!("rank-0{}", s.ext()));
            File::create(&rank).unwrap().set_len(8 << 30).unwrap();
            refusal(s.read(40), &dir, &format!("rank-0{}", s.ext()));
            forge(&dir, |m| m.ranks[0].bytes = 8 << 30);
            let e = refusal(s.read(40), &dir, "ranks[0].bytes");
            assert!(e.contains("is 8589934592, more than the"), "{e}");
        }
        assert!(t0.elapsed().as_secs() < 20, "the sparse files were read: {:?}", t0.elapsed());
    }

    #[test]
    fn a_fifo_in_place_of_a_file_is_refused_at_once() {
        let (_d, s, dir) = written(false);
        let s = Arc::new(s);
        for file in ["model.safetensors", "checkpoint.json"] {
            let path = dir.join(file);
            let keep = dir.join("kept");
            fs::rename(&path, &keep).unwrap();
            assert!(std::process::Command::new("mkfifo").arg(&path).status().unwrap().success());
            let (tx, rx) = std::sync::mpsc::channel();
            let s2 = s.clone();
            std::thread::spawn(move || {
                let _ = tx.send(s2.read(40).map(drop));
            });
            let got = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("reading the checkpoint blocked on a FIFO");
            let e = refusal(got, &dir, file);
            assert!(e.contains("is a FIFO, not a regular file"), "{e}");
            fs::remove_file(&path).unwrap();
            fs::rename(&keep, &path).unwrap();
        }
    }

    #[test]
    fn a_checkpoint_of_another_run_or_entry_is_refused() {
        let (d, _, dir) = written(false);
        let ours = d.path().join("w_b_r0");
        fs::create_dir_all(&ours).unwrap();
        let copy = ours.join("step-00000040");
        fs::create_dir(&copy).unwrap();
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            fs::copy(e.path(), copy.join(e.file_name())).unwrap();
        }
        let other = |edit: fn(&mut RunIdentity)| {
            let mut r = run("w/a/r0");
            edit(&mut r);
            Store::open(&ours, 0, 1, false, false).unwrap().for_run(r, accept()).unwrap()
        };
        type Edit = fn(&mut RunIdentity);
        let cases: [(&str, Edit, &str); 6] = [
            (
                "run.entry",
                |r| r.entry = "w/b/r0".into(),
                "is `w/a/r0`, this run's is `w/b/r0`: the checkpoint belongs to another run or entry",
            ),
            ("run.suite_sha256", |r| r.suite_sha256 = "ef".repeat(32), "belongs to another run or entry"),
            ("run.seed", |r| r.seed = 8, "is 7, this run's is 8"),
            ("run.steps", |r| r.steps = Some(200), "is Some(300), this run's is Some(200)"),
            ("run.plugins", |r| r.plugins.clear(), "belongs to another run or entry"),
            // ZeRO's shards laid out otherwise (the checkpoint's run had none).
            (
                "run.shards",
                |r| r.shards = "0123456789abcdef".into(),
                "is none, this run's is `0123456789abcdef`: the ZeRO shards lie differently",
            ),
        ];
        for (field, edit, why) in cases {
            let e = refusal(other(edit).read(40), &copy, field);
            assert!(e.contains(why), "{e}");
        }
        // The same run reads its own copy.
        other(|_| {}).read(40).unwrap();
        // A world of another size.
        let two = Store::open(&ours, 0, 2, false, false).unwrap();
        let two = two.for_run(RunIdentity { world_size: 2, ..run("w/a/r0") }, accept()).unwrap();
        refusal(two.read(40), &copy, "run.world_size");
        // Compressed by a run that does not compress.
        let zst = Store::open(&ours, 0, 1, true, false).unwrap().for_run(run("w/a/r0"), accept()).unwrap();
        refusal(zst.read(40), &copy, "compressed");
        // A forged shard layout is refused without echoing what it holds.
        forge(&copy, |m| m.run.shards = "\u{1b}[2J\nrefused? no".into());
        let e = refusal(other(|_| {}).read(40), &copy, "run.shards");
        assert!(e.contains("is no layout digest (16 bytes), this run's is none") && !e.contains('\u{1b}'), "{e}");
        // So is a forged entry id.
        forge(&copy, |m| m.run.entry = "w/\u{1b}[2J".into());
        let e = refusal(other(|_| {}).read(40), &copy, "run.entry");
        assert!(e.contains("is a value of 6 bytes (not shown") && !e.contains('\u{1b}'), "{e}");
    }

    #[test]
    fn a_file_listing_other_tensors_is_refused_before_they_are_allocated() {
        let (_d, s, dir) = written(false);
        let honest = fs::read(dir.join("checkpoint.json")).unwrap();
        let rewrite = |state: Vec<(String, Tensor)>| {
            let rec = write_tensors(&dir, "rank-0.safetensors", &state, false, &AtomicBool::new(false)).unwrap();
            forge(&dir, |m| m.ranks[0] = rec);
        };
        let bytes = |n: usize| Tensor::from_slice(&vec![0u8; n]);
        type Named = Vec<(String, Tensor)>;
        let cases: [(Named, &str, &str); 5] = [
            (
                vec![
                    ("optimizer/exp_avg.0".into(), Tensor::from_slice(&[1.0f32, 2.0])),
                    ("plugin/compressor".into(), bytes(1)),
                    ("plugin/batch".into(), bytes(0)),
                ],
                "rank-0.safetensors: tensor optimizer/exp_avg.0",
                "is Float of shape [2]; this run's is Float of shape [1]",
            ),
            (
                vec![
                    ("optimizer/exp_avg.0".into(), Tensor::from_slice(&[1.0f64])),
                    ("plugin/compressor".into(), bytes(1)),
                    ("plugin/batch".into(), bytes(0)),
                ],
                "rank-0.safetensors: tensor optimizer/exp_avg.0",
                "is Double of shape [1]",
            ),
            (
                vec![
                    ("optimizer/exp_avg.0".into(), Tensor::from_slice(&[1.0f32])),
                    ("evil".into(), bytes(1)),
                    ("plugin/compressor".into(), bytes(1)),
                    ("plugin/batch".into(), bytes(0)),
                ],
                "rank-0.safetensors: tensor evil",
                "is not a tensor this run has",
            ),
            (
                vec![("plugin/compressor".into(), bytes(1)), ("plugin/batch".into(), bytes(0))],
                "rank-0.safetensors: tensor optimizer/exp_avg.0",
                "is missing",
            ),
            (
                vec![
                    ("optimizer/exp_avg.0".into(), Tensor::from_slice(&[1.0f32])),
                    ("plugin/compressor".into(), bytes((1 << 20) + 1)),
                    ("plugin/batch".into(), bytes(0)),
                ],
                "rank-0.safetensors: tensor plugin/compressor",
                "the state of the `compressor` plugin is bytes, at most 1048576",
            ),
        ];
        for (state, field, why) in cases {
            rewrite(state);
            let e = refusal(s.read(40), &dir, field);
            assert!(e.contains(why), "{e}");
            let e = refusal(s.read_into(40, &mut snap(0, 0.0)), &dir, field);
            assert!(e.contains(why), "{e}");
        }
        fs::write(dir.join("checkpoint.json"), honest).unwrap();
        // A plugin state beyond the cap is not written in the first place.
        let mut big = snap(41, 1.0);
        big.plugins[0].1 = vec![0; (1 << 20) + 1];
        let e = format!("{:#}", s.write_part(&big).unwrap_err());
        assert!(e.contains("the compressor plugin's state is 1048577 bytes, more than the 1048576"), "{e}");
    }

    /// Issue 61: format 2's seal was an unkeyed sha256, so a checkpoint
    /// rewritten with its hashes recomputed resumed (random weights trained
    /// to eval loss 185). The seal is now keyed: a rewrite without the
    /// user's key is refused by name, and so is one sealed with a key of
    /// the forger's own, or a checkpoint of another user's.
    #[test]
    fn r61_a_checkpoint_rewritten_with_recomputed_hashes_is_refused_by_its_seal() {
        for compress in [false, true] {
            let (_d, s, dir) = written(compress);
            let model = format!("model{}", s.ext());
            let weights = vec![("w".to_owned(), Tensor::from_slice(&[153.0f32, -7.0]))];
            let rec = write_tensors(&dir, &model, &weights, compress, &AtomicBool::new(false)).unwrap();
            // Every hash recomputed, the seal kept: refused, naming the
            // checkpoint (its step) and the seal.
            forge_with(&dir, None, |m| m.model = rec.clone());
            let e = refusal(s.read(40), &dir, "seal");
            assert!(e.contains("step-00000040") && e.contains("was changed after it was written"), "{e}");
            assert!(e.contains(&format!("(key {})", key().id())), "{e}");
            refusal(s.read_into(40, &mut snap(0, 0.0)), &dir, "seal");
            // The manifest's hash alone still holds: `verify` checks that the
            // checkpoint is whole, not that it is authentic.
            verify(&dir).unwrap();
            // Sealed with a key of the forger's own: refused, naming both keys.
            let theirs = Key::from_bytes([1; 32]);
            forge_with(&dir, Some(&theirs), |_| {});
            let e = refusal(s.read(40), &dir, "seal");
            assert!(e.contains(&format!("was made with key {}, not with this user's checkpoint key", theirs.id())), "{e}");
            // A seal's key id that is not one is not echoed.
            forge_with(&dir, None, |m| m.seal.key = "\u{1b}[2Jforged".into());
            let e = refusal(s.read(40), &dir, "seal");
            assert!(e.contains("was made with no key id (10 bytes)") && !e.contains('\u{1b}'), "{e}");
        }
        // An honest checkpoint read by a store of another user's key (or of
        // another machine): refused; the writer's key reads it.
        let (_d, s, dir) = written(false);
        let elsewhere = Store::open(&s.root, 0, 1, false, false).unwrap().for_run(run("w/a/r0"), accept()).unwrap();
        let elsewhere = elsewhere.with_key(Key::from_bytes([2; 32]));
        let e = refusal(elsewhere.read(40), &dir, "seal");
        assert!(e.contains("written by another user or machine"), "{e}");
        s.read(40).unwrap();
    }

    /// What remains possible, as docs/checkpoint-policies.md says: whoever
    /// holds the user's key (the user) and edits their own checkpoint
    /// consistently (the files, their hashes, the manifest's, sealed anew,
    /// within the layout and bounds) feeds the run what they like. The
    /// result records that the entry resumed.
    #[test]
    fn a_consistent_edit_sealed_with_the_users_own_key_is_accepted_as_documented() {
        let (_d, s, dir) = written(false);
        let weights = vec![("w".to_owned(), Tensor::from_slice(&[153.0f32, -7.0]))];
        let rec = write_tensors(&dir, "model.safetensors", &weights, false, &AtomicBool::new(false)).unwrap();
        forge(&dir, |m| m.model = rec);
        let back = s.read(40).unwrap();
        assert_eq!(Vec::<f32>::try_from(&back.model[0].1).unwrap(), [153.0, -7.0]);
    }
}
