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

use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tch::{Device, Tensor};

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
    sha256: String,
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
        Ok(Store { root: root.to_path_buf(), rank, world, compress })
    }

    /// The directory of the checkpoint of `step`.
    pub fn dir(&self, step: u64) -> PathBuf {
        self.root.join(dir_name(step))
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
        let tmp = self.tmp(snap.position.step);
        fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut state: Vec<(String, Tensor)> = snap.state.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        for (slot, bytes) in &snap.plugins {
            state.push((format!("plugin/{slot}"), Tensor::from_slice(bytes)));
        }
        let rec = write_tensors(&tmp, &format!("rank-{}{}", self.rank, self.ext()), &state, self.compress)?;
        let mut bytes = rec.bytes;
        write_synced(&tmp.join(format!("rank-{}.json", self.rank)), &serde_json::to_vec_pretty(&rec)?)?;
        if self.rank == 0 {
            let rec = write_tensors(&tmp, &format!("model{}", self.ext()), &snap.model, self.compress)?;
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
        let dir = self.dir(step);
        let m = read_manifest(&dir)?;
        if m.world_size as usize != self.world {
            bail!("{} was written by {} ranks; this run has {}", dir.display(), m.world_size, self.world);
        }
        let model = read_tensors(&dir, &m.model, m.compressed)?;
        let rec: FileRecord = read_json(&dir.join(format!("rank-{}.json", self.rank)))?;
        let mut state = Vec::new();
        let mut plugins = Vec::new();
        for (name, t) in read_tensors(&dir, &rec, m.compressed)? {
            match name.strip_prefix("plugin/") {
                Some(slot) => plugins.push((slot.to_owned(), Vec::<u8>::try_from(&t).context("a plugin state")?)),
                None => state.push((name, t)),
            }
        }
        Ok(Snapshot { position: m.position, model, state, plugins })
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
    let mut f = BufReader::new(File::open(path).with_context(|| format!("opening {}", path.display()))?);
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
    let (bytes, sha) = sha256_file(&path)?;
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

/// Writes `tensors` as safetensors (zstd-compressed with `compress`) into
/// `dir/name`, synced, and returns the file's record.
fn write_tensors(dir: &Path, name: &str, tensors: &[(String, Tensor)], compress: bool) -> Result<FileRecord> {
    let path = dir.join(name);
    if compress {
        let raw = dir.join(format!("{name}.raw"));
        Tensor::write_safetensors(tensors, &raw).with_context(|| format!("writing {}", raw.display()))?;
        {
            let mut src = BufReader::new(File::open(&raw)?);
            let out = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
            let mut enc = zstd::Encoder::new(BufWriter::new(out), 3)?;
            std::io::copy(&mut src, &mut enc)?;
            let out = enc.finish()?.into_inner().map_err(|e| e.into_error())?;
            out.sync_all()?;
        }
        fs::remove_file(&raw)?;
    } else {
        Tensor::write_safetensors(tensors, &path).with_context(|| format!("writing {}", path.display()))?;
        File::open(&path)?.sync_all().with_context(|| format!("syncing {}", path.display()))?;
    }
    let (bytes, sha256) = sha256_file(&path)?;
    Ok(FileRecord { file: name.to_owned(), bytes, sha256 })
}

fn read_tensors(dir: &Path, rec: &FileRecord, compressed: bool) -> Result<Vec<(String, Tensor)>> {
    check_file(dir, rec)?;
    let path = dir.join(&rec.file);
    if !compressed {
        return Tensor::read_safetensors(&path).with_context(|| format!("reading {}", path.display()));
    }
    let mut raw = tempfile::NamedTempFile::new_in(dir.parent().unwrap_or(dir))?;
    zstd::stream::copy_decode(BufReader::new(File::open(&path)?), raw.as_file_mut())
        .with_context(|| format!("decompressing {}", path.display()))?;
    Tensor::read_safetensors(raw.path()).with_context(|| format!("reading {}", path.display()))
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
