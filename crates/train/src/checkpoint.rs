//! Checkpoints: what an entry needs to go on exactly where it was (model,
//! optimizer and loss-scaler state, plugin states, data position, random
//! generator, batch), on disk and written so that a crash at any instant
//! leaves either the old set of checkpoints or the new one, never a torn one.
//!
//! Layout under an entry's checkpoint directory:
//!
//! ```text
//! step-00000040/
//!   checkpoint.json          manifest: format, step, world size, data position,
//!                            batch, and the model file's size and sha256
//!   model.safetensors[.zst]  parameters (rank 0 writes them; ranks hold equal copies)
//!   rank-0.safetensors[.zst] that rank's optimizer and scaler state, RNG state
//!                            and plugin states (`plugin/<slot>`, bytes)
//!   rank-0.json              that file's size and sha256
//!   ...
//! ```
//!
//! A write goes to `.step-00000040.tmp/`: every rank writes its files and
//! fsyncs them, the ranks meet, rank 0 writes the manifest, fsyncs it and the
//! directory, renames the directory to its final name and fsyncs the parent.
//! Only a directory with the final name counts, and reading one checks every
//! file's size and hash. Temporary directories left by a crash are removed
//! when the store is opened.

pub mod confined;

use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};

/// A write given up because its snapshot was lost (the failure took the
/// node's memory); its temporary files are not a checkpoint.
#[derive(Debug, thiserror::Error)]
#[error("the checkpoint write was cancelled")]
pub struct Cancelled;

/// Version of the on-disk layout.
pub const FORMAT: u32 = 1;

/// Where a checkpoint puts the training loop.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Position {
    /// Optimizer steps completed.
    pub step: u64,
    /// Training samples each rank's data stream has handed out.
    pub data_position: u64,
    /// The batch the next step runs with.
    pub micro_batch: u32,
    pub accum_steps: u32,
    pub lr_scale: f64,
}

/// One rank's part of a checkpoint, in host memory.
pub struct Snapshot {
    pub position: Position,
    /// Parameters by name (rank 0's part only; empty on other ranks).
    pub model: Vec<(String, Tensor)>,
    /// This rank's own state by name: `optimizer/...`, `scaler/...`, `rng`.
    pub state: Vec<(String, Tensor)>,
    /// Plugin states by slot (`compressor`, `batch`, `checkpoint`).
    pub plugins: Vec<(String, Vec<u8>)>,
    /// On CUDA, the event after the copies into this snapshot's buffers,
    /// which were queued without waiting: readers wait for it first.
    pub ready: Option<crate::torch_ext::Event>,
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

impl Snapshot {
    /// Waits until the copies into this snapshot have landed.
    pub fn wait_ready(&self) -> Result<()> {
        if let Some(e) = &self.ready {
            e.synchronize()?;
        }
        Ok(())
    }

    /// Bytes of tensor data held.
    pub fn bytes(&self) -> u64 {
        let t = |v: &Vec<(String, Tensor)>| v.iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum::<u64>();
        t(&self.model) + t(&self.state) + self.plugins.iter().map(|(_, b)| b.len() as u64).sum::<u64>()
    }

    /// This rank's state tensor `name`, moved to `device`.
    pub fn take_state(&self, name: &str, device: Device) -> Option<Tensor> {
        self.state.iter().find(|(n, _)| n == name).map(|(_, t)| t.to_device(device))
    }

    /// The saved state of plugin slot `slot`.
    pub fn plugin(&self, slot: &str) -> Option<&[u8]> {
        self.plugins.iter().find(|(s, _)| s == slot).map(|(_, b)| b.as_slice())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
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

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    world_size: u32,
    compressed: bool,
    position: Position,
    model: FileRecord,
}

/// An entry's checkpoint directory, seen from one rank.
pub struct Store {
    root: PathBuf,
    rank: usize,
    world: usize,
    compress: bool,
    /// How reads go to the disk ([`ReadMode::RESTORE`] unless a benchmark
    /// compares others).
    pub read_mode: ReadMode,
}

/// Name of the directory of the checkpoint of `step`.
fn dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

impl Store {
    /// Opens (and on rank 0 creates) `root`, removing what crashed writes
    /// left behind, and with `fresh` every checkpoint there too (a new run
    /// of the entry, not a resumed one).
    pub fn open(root: &Path, rank: usize, world: usize, compress: bool, fresh: bool) -> Result<Store> {
        if rank == 0 {
            fs::create_dir_all(root).with_context(|| format!("creating the checkpoint directory {}", root.display()))?;
            for e in fs::read_dir(root)?.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let torn = name.starts_with('.') && (name.ends_with(".tmp") || name.ends_with(".deleting"));
                if torn || (fresh && name.starts_with("step-")) {
                    fs::remove_dir_all(e.path()).with_context(|| format!("removing the torn checkpoint {}", e.path().display()))?;
                }
            }
        }
        Ok(Store { root: root.to_path_buf(), rank, world, compress, read_mode: ReadMode::RESTORE })
    }

    /// The directory of the checkpoint of `step`.
    pub fn dir(&self, step: u64) -> PathBuf {
        self.root.join(dir_name(step))
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
    /// manifest and moves the checkpoint to its final name, durably.
    pub fn commit(&self, position: Position) -> Result<PathBuf> {
        let tmp = self.tmp(position.step);
        let model: FileRecord = serde_json::from_slice(&fs::read(tmp.join("model.json"))?)?;
        let m = Manifest { format: FORMAT, world_size: self.world as u32, compressed: self.compress, position, model };
        write_synced(&tmp.join("checkpoint.json"), &serde_json::to_vec_pretty(&m)?)?;
        sync_dir(&tmp)?;
        let dir = self.dir(position.step);
        if dir.exists() {
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
        fs::remove_dir_all(&away).with_context(|| format!("deleting {}", away.display()))
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
    /// states). Compressed checkpoints and files written before pieces were
    /// hashed are read as [`Store::read`] does.
    pub fn read_into(&self, step: u64, buffers: &mut Snapshot) -> Result<Snapshot> {
        self.read_with(step, Some(buffers))
    }

    fn read_with(&self, step: u64, buffers: Option<&Snapshot>) -> Result<Snapshot> {
        let dir = self.dir(step);
        let m = read_manifest(&dir)?;
        if m.world_size as usize != self.world {
            bail!("{} was written by {} ranks; this run has {}", dir.display(), m.world_size, self.world);
        }
        let rec: FileRecord = read_json(&dir.join(format!("rank-{}.json", self.rank)))?;
        let buffers = buffers.filter(|_| !m.compressed && m.model.chunk_bytes.is_some() && rec.chunk_bytes.is_some());
        let read = |file: &FileRecord, into: fn(&Snapshot) -> &[(String, Tensor)]| match buffers {
            Some(b) => read_file_into(&dir, file, into(b), self.read_mode),
            None => read_tensors(&dir, file, m.compressed, self.read_mode),
        };
        let model = read(&m.model, |b| &b.model)?;
        let mut state = Vec::new();
        let mut plugins = Vec::new();
        for (name, t) in read(&rec, |b| &b.state)? {
            match name.strip_prefix("plugin/") {
                Some(slot) => plugins.push((slot.to_owned(), Vec::<u8>::try_from(&t).context("a plugin state")?)),
                None => state.push((name, t)),
            }
        }
        Ok(Snapshot { position: m.position, model, state, plugins, ready: None })
    }
}

/// Checks a checkpoint directory completely (every rank's files, sizes and
/// hashes) and returns where it puts training.
pub fn verify(dir: &Path) -> Result<Position> {
    let m = read_manifest(dir)?;
    check_file(dir, &m.model)?;
    for r in 0..m.world_size {
        let rec: FileRecord = read_json(&dir.join(format!("rank-{r}.json")))?;
        check_file(dir, &rec)?;
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

/// The checkpoints under `root` (final names only), oldest first.
pub fn list(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("step-")?.parse().ok()?;
            Some((step, e.path()))
        })
        .collect();
    v.sort();
    v
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
}

fn read_manifest(dir: &Path) -> Result<Manifest> {
    let m: Manifest = read_json(&dir.join("checkpoint.json"))?;
    if m.format != FORMAT {
        bail!("{} has checkpoint format {}; this harness reads format {FORMAT}", dir.display(), m.format);
    }
    Ok(m)
}

fn sha256_file(path: &Path) -> Result<(u64, String)> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((n, hex::encode(h.finalize())))
}

fn check_file(dir: &Path, rec: &FileRecord) -> Result<()> {
    let path = dir.join(&rec.file);
    if rec.chunk_bytes.is_some() {
        return read_verified(dir, rec, ReadMode::RESTORE).map(drop);
    }
    let (bytes, sha) = sha256_file(&path)?;
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

/// The safetensors dtype of a tensor kind.
fn dtype_name(kind: Kind) -> Result<&'static str> {
    Ok(match kind {
        Kind::Float => "F32",
        Kind::Double => "F64",
        Kind::Half => "F16",
        Kind::BFloat16 => "BF16",
        Kind::Int64 => "I64",
        Kind::Int => "I32",
        Kind::Int16 => "I16",
        Kind::Int8 => "I8",
        Kind::Uint8 => "U8",
        Kind::Bool => "BOOL",
        k => bail!("a checkpoint cannot hold {k:?} tensors"),
    })
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
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    for (name, t) in tensors {
        let n = t.numel() * t.kind().elt_size_in_bytes();
        header.insert(name.clone(), serde_json::json!({ "dtype": dtype_name(t.kind())?, "shape": t.size(), "data_offsets": [at, at + n] }));
        at += n;
    }
    let mut json = serde_json::to_vec(&header)?;
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
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

/// Opens `rec`'s file; fails if its size is not the size written.
fn open_record(dir: &Path, rec: &FileRecord) -> Result<(File, PathBuf, u64)> {
    let path = dir.join(&rec.file);
    let f = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let len = f.metadata()?.len();
    if len != rec.bytes {
        bail!("{} is damaged: {len} bytes, written as {}", path.display(), rec.bytes);
    }
    Ok((f, path, len))
}

/// Reads `rec`'s file whole (through [`read_pieces`] when it was hashed in
/// pieces), and fails if size or hash differ from what was written.
fn read_verified(dir: &Path, rec: &FileRecord, mode: ReadMode) -> Result<Vec<u8>> {
    let (mut f, path, len) = open_record(dir, rec)?;
    let mut buf = vec![0u8; len as usize];
    let sha = match rec.chunk_bytes {
        Some(chunk) => read_pieces(&path, &f, vec![(&mut buf[..], false)], chunk as usize, mode)
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
fn read_pieces(path: &Path, f: &File, segments: Vec<(&mut [u8], bool)>, chunk: usize, mode: ReadMode) -> Result<String> {
    use std::os::unix::fs::FileExt;
    use std::sync::{mpsc, Mutex};
    anyhow::ensure!(chunk > 0, "a checkpoint file record with chunk_bytes = 0");
    let len = f.metadata()?.len() as usize;
    // Direct reads need aligned offsets: pieces of whole pages.
    let direct = if mode.direct && chunk % DIRECT_ALIGN == 0 { open_direct(path) } else { None };
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
/// for the others), through [`read_pieces`]; fails if size or hash differ
/// from what was written. Returns the tensors in file order.
fn read_file_into(dir: &Path, rec: &FileRecord, into: &[(String, Tensor)], mode: ReadMode) -> Result<Vec<(String, Tensor)>> {
    let chunk = rec.chunk_bytes.context("a file record without pieces")? as usize;
    let (mut f, path, len) = open_record(dir, rec)?;
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
    // The data must tile the rest of the file exactly.
    let mut end = 0;
    let mut out = Vec::with_capacity(infos.len());
    for (name, info) in &infos {
        let (a, b) = info.data_offsets;
        let kind = kind_of(info.dtype)?;
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
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
    let sha = read_pieces(&path, &f, segments, chunk, mode).with_context(|| format!("reading {}", path.display()))?;
    damaged(&path, rec, len, &sha)?;
    Ok(out)
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

/// Reads the tensors of `rec`'s file, verified against its size and hash.
fn read_tensors(dir: &Path, rec: &FileRecord, compressed: bool, mode: ReadMode) -> Result<Vec<(String, Tensor)>> {
    let path = dir.join(&rec.file);
    let mut bytes = read_verified(dir, rec, mode)?;
    if compressed {
        bytes = zstd::decode_all(bytes.as_slice()).with_context(|| format!("decompressing {}", path.display()))?;
    }
    let st = safetensors::SafeTensors::deserialize(&bytes).with_context(|| format!("parsing {}", path.display()))?;
    let mut named: Vec<(usize, String, Tensor)> = Vec::new();
    for (name, view) in st.tensors() {
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
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

    fn snap(step: u64, v: f32) -> Snapshot {
        Snapshot {
            position: Position { step, data_position: step * 4, micro_batch: 4, accum_steps: 1, lr_scale: 1.0 },
            model: vec![("w".into(), Tensor::from_slice(&[v, v + 1.0]))],
            state: vec![("optimizer/exp_avg.0".into(), Tensor::from_slice(&[v * 2.0]))],
            plugins: vec![("compressor".into(), vec![1, 2, 3]), ("batch".into(), vec![])],
            ready: None,
        }
    }

    #[test]
    fn a_checkpoint_reads_back_what_was_written_and_damage_is_found() {
        for compress in [false, true] {
            let d = tempfile::tempdir().unwrap();
            let s = Store::open(d.path(), 0, 1, compress, true).unwrap();
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
        let s = Store::open(d.path(), 0, 1, false, true).unwrap();
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
        let rec: FileRecord = read_json(&dir.join("rank-0.json")).unwrap();
        let bytes = fs::read(dir.join(&rec.file)).unwrap();
        let digests: Vec<[u8; 32]> = bytes.chunks(7).map(|c| Sha256::digest(c).into()).collect();
        let small = FileRecord { sha256: tree_digest(&digests), chunk_bytes: Some(7), ..rec.clone() };
        let into = vec![("optimizer/exp_avg.0".to_owned(), Tensor::from_slice(&[0.0f32]))];
        let got = read_file_into(&dir, &small, &into, ReadMode::RESTORE).unwrap();
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
        let got = read_file_into(&dir, &rec, &odd, ReadMode::RESTORE).unwrap();
        assert_ne!(got[0].1.data_ptr(), odd[0].1.data_ptr());
        assert_eq!(Vec::<f32>::try_from(&got[0].1).unwrap(), vec![3.0]);
    }

    #[test]
    fn every_read_mode_reads_the_same_bytes_and_finds_damage() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path(), 0, 1, false, true).unwrap();
        let big: Vec<f32> = (0..100_003).map(|i| i as f32 * 0.5).collect();
        let mut written = snap(10, 1.5);
        written.state[0].1 = Tensor::from_slice(&big);
        s.write_part(&written).unwrap();
        let dir = s.commit(written.position).unwrap();
        // Pieces of two pages (direct reads apply) over a 400 KB file: many
        // pieces in flight, the last one short.
        let rec: FileRecord = read_json(&dir.join("rank-0.json")).unwrap();
        let bytes = fs::read(dir.join(&rec.file)).unwrap();
        let chunk = 2 * DIRECT_ALIGN;
        let digests: Vec<[u8; 32]> = bytes.chunks(chunk).map(|c| Sha256::digest(c).into()).collect();
        let small = FileRecord { sha256: tree_digest(&digests), chunk_bytes: Some(chunk as u64), ..rec.clone() };
        let f = dir.join(&rec.file);
        for direct in [true, false] {
            for readers in [1, 3, 8] {
                let mode = ReadMode { direct, readers };
                let into = vec![("optimizer/exp_avg.0".to_owned(), Tensor::zeros([100_003], (Kind::Float, Device::Cpu)))];
                read_file_into(&dir, &small, &into, mode).unwrap();
                assert_eq!(Vec::<f32>::try_from(&into[0].1).unwrap(), big, "{mode:?}");
                // A flipped byte in a middle piece is found.
                let mut b = bytes.clone();
                b[bytes.len() / 2] ^= 1;
                fs::write(&f, b).unwrap();
                let e = format!("{:#}", read_file_into(&dir, &small, &into, mode).unwrap_err());
                assert!(e.contains("is damaged"), "{mode:?}: {e}");
                fs::write(&f, &bytes).unwrap();
            }
        }
    }

    #[test]
    fn torn_writes_are_not_checkpoints_and_are_cleaned_up() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path(), 0, 1, false, true).unwrap();
        s.write_part(&snap(5, 1.0)).unwrap(); // no commit: a crash here
        assert!(list(d.path()).is_empty());
        s.write_part(&snap(6, 1.0)).unwrap();
        s.commit(snap(6, 1.0).position).unwrap();
        s.delete(6).unwrap();
        assert!(list(d.path()).is_empty());
        Store::open(d.path(), 0, 1, false, false).unwrap();
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 0, "the torn write was left behind");
    }
}
