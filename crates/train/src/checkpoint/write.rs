//! Writing a checkpoint's files: safetensors straight from the tensors'
//! memory, hashed in pieces as they are written, synced and evicted.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use tch::{Device, Tensor};

use super::accept::{dtype_name, header_json};
use super::manifest::{FileRecord, HASH_CHUNK};

/// A write given up because its snapshot was lost (the failure took the
/// node's memory); its temporary files are not a checkpoint.
#[derive(Debug, thiserror::Error)]
#[error("the checkpoint write was cancelled")]
pub struct Cancelled;

/// A copy on the host that later steps cannot change.
pub fn host_copy(t: &Tensor) -> Tensor {
    let t = t.detach();
    if t.device() == Device::Cpu {
        t.copy()
    } else {
        t.to_device(Device::Cpu)
    }
}

/// Threads that hash one file's pieces.
pub(super) const HASH_THREADS: usize = 4;

/// The sha256 of the piece digests (see [`FileRecord::sha256`]).
pub(super) fn tree_digest(digests: &[[u8; 32]]) -> String {
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

/// Seconds to hash `bytes` bytes already in memory as checkpoint files are
/// hashed (pieces on [`HASH_THREADS`] threads): the benchmark's bound on
/// how fast a verified read can go.
pub fn hash_seconds(bytes: usize) -> f64 {
    let data = vec![1u8; bytes];
    let t0 = std::time::Instant::now();
    std::hint::black_box(hash_pieces(&[&data]));
    t0.elapsed().as_secs_f64()
}

pub(super) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)?;
    f.sync_all().with_context(|| format!("syncing {}", path.display()))
}

pub(super) fn sync_dir(dir: &Path) -> Result<()> {
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
pub(super) const CHUNK: usize = 16 << 20;

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
pub(super) fn write_tensors(
    dir: &Path,
    name: &str,
    tensors: &[(String, Tensor)],
    compress: bool,
    cancel: &AtomicBool,
) -> Result<FileRecord> {
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
