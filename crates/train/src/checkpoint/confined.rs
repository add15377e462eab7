//! A bounded reader of regular files confined to one folder, for a
//! checkpoint folder read as a hostile one: directories are opened without
//! following symbolic links, each file's type and size are checked from its
//! metadata before it is opened (so a FIFO, a device or a socket is refused
//! at once, and a file larger than its caller allows is refused unread), it
//! is opened without blocking and without following a symbolic link, and it
//! must still be the file whose metadata was checked. No read returns more
//! bytes than its cap.
//!
//! (harness-format is getting a reader of its own for submission bundles;
//! the two are to be folded together.)

use std::ffi::CString;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// A directory opened without following symbolic links: the files and
/// directories below it are opened relative to it, one plain name at a
/// time.
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

/// What the file type bits of `mode` name.
fn what(mode: libc::mode_t) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "a regular file",
        libc::S_IFDIR => "a directory",
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        libc::S_IFSOCK => "a socket",
        _ => "of an unknown type",
    }
}

/// `name` as one plain path component (no `/`, not `.` or `..`).
fn component(name: &str) -> Result<CString> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        bail!("`{name}` is not a plain file name (no `/`, `.` or `..`)");
    }
    Ok(CString::new(name)?)
}

impl Dir {
    /// The directory at `path`, which must be a directory itself, not a
    /// symbolic link to one.
    pub fn open(path: &Path) -> Result<Dir> {
        let meta = std::fs::symlink_metadata(path).with_context(|| format!("reading the metadata of {}", path.display()))?;
        if !meta.file_type().is_dir() {
            bail!("{} is {}, not a directory", path.display(), what(meta.mode()));
        }
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .with_context(|| format!("opening the directory {}", path.display()))?;
        Ok(Dir { fd: f.into(), path: path.to_path_buf() })
    }

    /// Where this directory is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The metadata of `name` in this directory, not following a symbolic
    /// link.
    fn stat(&self, name: &CString) -> std::io::Result<libc::stat> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: a valid directory descriptor, a NUL-terminated name and
        // room for one `stat`, which the call fills when it succeeds.
        let r = unsafe { libc::fstatat(self.fd.as_raw_fd(), name.as_ptr(), st.as_mut_ptr(), libc::AT_SYMLINK_NOFOLLOW) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fstatat succeeded, so it wrote the whole struct.
        Ok(unsafe { st.assume_init() })
    }

    /// `name` in this directory opened with `flags`, never through a
    /// symbolic link.
    fn open_at(&self, name: &CString, flags: libc::c_int) -> std::io::Result<OwnedFd> {
        // SAFETY: a valid directory descriptor and a NUL-terminated name;
        // the call returns a new descriptor or -1.
        let fd = unsafe { libc::openat(self.fd.as_raw_fd(), name.as_ptr(), flags | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor just opened, which nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The directory `name` inside this one, which must be a directory
    /// itself, not a symbolic link to one.
    pub fn dir(&self, name: &str) -> Result<Dir> {
        let path = self.path.join(name);
        let c = component(name).with_context(|| format!("in {}", self.path.display()))?;
        let st = self.stat(&c).with_context(|| format!("reading the metadata of {}", path.display()))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            bail!("{} is {}, not a directory", path.display(), what(st.st_mode));
        }
        let fd = self.open_at(&c, libc::O_RDONLY | libc::O_DIRECTORY).with_context(|| format!("opening {}", path.display()))?;
        Ok(Dir { fd, path })
    }

    /// The regular file `name` inside this directory, of at most `max`
    /// bytes, opened for reading; returns it and its length. Its type and
    /// size are checked before it is opened, and again on what was opened.
    pub fn file(&self, name: &str, max: u64) -> Result<(File, u64)> {
        let path = self.path.join(name);
        let c = component(name).with_context(|| format!("in {}", self.path.display()))?;
        let st = self.stat(&c).with_context(|| format!("reading the metadata of {}", path.display()))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            bail!("{} is {}, not a regular file", path.display(), what(st.st_mode));
        }
        let len = u64::try_from(st.st_size).unwrap_or(u64::MAX);
        if len > max {
            bail!("{} is {len} bytes, more than the {max} it may hold", path.display());
        }
        // Without blocking: had it become a FIFO since, opening it would
        // wait for a writer.
        let f = File::from(self.open_at(&c, libc::O_RDONLY | libc::O_NONBLOCK).with_context(|| format!("opening {}", path.display()))?);
        let m = f.metadata().with_context(|| format!("reading the metadata of {}", path.display()))?;
        if !m.file_type().is_file() || m.ino() != st.st_ino || m.dev() != st.st_dev {
            bail!("{} changed while it was being opened", path.display());
        }
        if m.len() > max {
            bail!("{} is {} bytes, more than the {max} it may hold", path.display(), m.len());
        }
        Ok((f, m.len()))
    }

    /// `name` opened again for direct reads (`O_DIRECT`), where the file
    /// system allows them and it is still the file `like` is.
    pub fn reopen_direct(&self, name: &str, like: &File) -> Option<File> {
        #[cfg(target_os = "linux")]
        {
            let c = component(name).ok()?;
            let f = File::from(self.open_at(&c, libc::O_RDONLY | libc::O_NONBLOCK | libc::O_DIRECT).ok()?);
            let (a, b) = (f.metadata().ok()?, like.metadata().ok()?);
            (a.file_type().is_file() && a.ino() == b.ino() && a.dev() == b.dev()).then_some(f)
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = (name, like);
            None
        }
    }

    /// The regular file `name` read whole: at most `max` bytes.
    pub fn read(&self, name: &str, max: u64) -> Result<Vec<u8>> {
        let (f, len) = self.file(name, max)?;
        let mut bytes = Vec::with_capacity(len as usize);
        // A file that grows while it is read stops at the cap.
        f.take(max.saturating_add(1)).read_to_end(&mut bytes).with_context(|| format!("reading {}", self.path.join(name).display()))?;
        if bytes.len() as u64 > max {
            bail!("{} grew past the {max} bytes it may hold while it was read", self.path.join(name).display());
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn only_regular_files_and_real_directories_below_the_folder_are_read() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::write(root.join("sub/f"), b"hello").unwrap();
        std::fs::write(d.path().join("outside"), b"secret").unwrap();
        std::os::unix::fs::symlink(d.path().join("outside"), root.join("sub/link")).unwrap();
        std::os::unix::fs::symlink(root.join("sub"), root.join("linked-dir")).unwrap();

        let dir = Dir::open(&root).unwrap();
        let sub = dir.dir("sub").unwrap();
        assert_eq!(sub.read("f", 5).unwrap(), b"hello");
        let e = format!("{:#}", sub.read("f", 4).unwrap_err());
        assert!(e.contains("is 5 bytes, more than the 4"), "{e}");
        let e = format!("{:#}", sub.read("link", 100).unwrap_err());
        assert!(e.contains("is a symbolic link, not a regular file"), "{e}");
        let e = format!("{:#}", dir.dir("linked-dir").err().unwrap());
        assert!(e.contains("is a symbolic link, not a directory"), "{e}");
        let e = format!("{:#}", Dir::open(&root.join("linked-dir")).err().unwrap());
        assert!(e.contains("is a symbolic link, not a directory"), "{e}");
        for bad in ["..", ".", "../outside", "/etc/passwd", ""] {
            let e = format!("{:#}", sub.read(bad, 100).unwrap_err());
            assert!(e.contains("is not a plain file name"), "{bad}: {e}");
        }
        let e = format!("{:#}", dir.read("sub", 100).unwrap_err());
        assert!(e.contains("is a directory, not a regular file"), "{e}");
    }

    #[test]
    fn a_fifo_is_refused_at_once() {
        let d = tempfile::tempdir().unwrap();
        let ok = std::process::Command::new("mkfifo").arg(d.path().join("fifo")).status().unwrap();
        assert!(ok.success());
        let path = d.path().to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let dir = Dir::open(&path).unwrap();
            let _ = tx.send(format!("{:#}", dir.read("fifo", 100).unwrap_err()));
        });
        let e = rx.recv_timeout(Duration::from_secs(10)).expect("reading a FIFO blocked");
        assert!(e.contains("is a FIFO, not a regular file"), "{e}");
    }
}
