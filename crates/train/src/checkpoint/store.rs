//! [`Store`]: an entry's checkpoint directory as one rank sees it: opens
//! it, writes and commits a checkpoint, lists, deletes and reads them.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use anyhow::{bail, Context, Result};
use harness_format::secrets::Key;
use tch::Tensor;

use super::accept::{refused, Accept, FileLayout, Layout, RunIdentity};
use super::confined::Dir;
use super::manifest::{check_record, read_manifest, read_record, user_key, FileRecord, Manifest, Seal, FORMAT};
use super::read::{read_file_into, read_tensors, ReadMode};
use super::snapshot::{Position, Snapshot};
use super::write::{sync_dir, write_synced, write_tensors};

/// An entry's checkpoint directory, seen from one rank.
pub struct Store {
    pub(super) root: PathBuf,
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

    pub(super) fn ext(&self) -> &'static str {
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

    /// [`Store::write_part`], given up with [`Cancelled`](super::Cancelled) as soon as
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
