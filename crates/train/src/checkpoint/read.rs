//! Reading a checkpoint's files back, verified: whole pieces read by
//! threads (direct reads where the file system allows), hashed as they
//! arrive, straight into the tensors' memory where it can.

use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};

use super::accept::{refused, FileLayout};
use super::confined::Dir;
use super::manifest::{check_record, read_manifest, FileRecord, HASH_CHUNK};
use super::snapshot::Position;
use super::write::{tree_digest, CHUNK, HASH_THREADS};

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

fn damaged(path: &Path, rec: &FileRecord, bytes: u64, sha: &str) -> Result<()> {
    if bytes != rec.bytes || sha != rec.sha256 {
        bail!("{} is damaged: {bytes} bytes with sha256 {sha}, written as {} bytes with sha256 {}", path.display(), rec.bytes, rec.sha256);
    }
    Ok(())
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
pub(super) const DIRECT_ALIGN: usize = 4096;

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
pub(super) fn read_file_into(
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
pub(super) fn read_tensors(
    folder: &Dir,
    rec: &FileRecord,
    layout: FileLayout<'_>,
    compressed: bool,
    mode: ReadMode,
) -> Result<Vec<(String, Tensor)>> {
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
