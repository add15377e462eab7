//! Reading files that untrusted input names (a suite's plugin artifacts):
//! regular files only, and never more than a stated number of bytes.
//!
//! A path in a suite may name anything: `/dev/zero` (endless bytes), a FIFO
//! (an `open` that waits for a writer forever), a directory, a file of
//! gigabytes. [`read_regular`] looks at the path's metadata before opening
//! it, refuses anything but a regular file and anything over its cap, opens
//! it without blocking and checks the opened file again (the path may have
//! been swapped in between), then reads at most the cap through a bounded
//! reader. [`read_capped`] only bounds the bytes read, for paths the user
//! names on the command line (a suite given as `<(...)` is a pipe).

use std::fmt;
use std::fs::{File, Metadata};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The largest plugin artifact harness reads: 256 MiB. The reference
/// plugins are about 0.1 to 2 MiB as WebAssembly components and smaller as
/// native libraries; a component embedding a Python interpreter
/// (componentize-py) is about 40 MiB.
pub const PLUGIN_MAX_BYTES: u64 = 256 << 20;

/// The largest suite file harness reads: 16 MiB (the largest shipped suite
/// is under 20 kB).
pub const SUITE_MAX_BYTES: u64 = 16 << 20;

/// Why a file was not read.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file could not be inspected, opened or read.
    #[error("cannot read {}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    /// Not a regular file: a directory, FIFO, socket or device.
    #[error("{} is {what}, not a regular file", path.display())]
    NotRegular { path: PathBuf, what: FileKind },
    /// Larger than the cap.
    #[error("{} has {size} bytes, more than the {cap} bytes ({} MiB) harness reads", path.display(), cap >> 20)]
    TooLarge { path: PathBuf, size: u64, cap: u64 },
}

/// What a path that is not a regular file is, in words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Directory,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
    Other,
}

impl fmt::Display for FileKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FileKind::Directory => "a directory",
            FileKind::Fifo => "a FIFO (named pipe)",
            FileKind::Socket => "a socket",
            FileKind::CharDevice => "a character device",
            FileKind::BlockDevice => "a block device",
            FileKind::Other => "not a file",
        })
    }
}

/// `Some(kind)` when `md` is not a regular file.
fn irregular(md: &Metadata) -> Option<FileKind> {
    let t = md.file_type();
    if t.is_file() {
        return None;
    }
    if t.is_dir() {
        return Some(FileKind::Directory);
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return Some(FileKind::Fifo);
        }
        if t.is_socket() {
            return Some(FileKind::Socket);
        }
        if t.is_char_device() {
            return Some(FileKind::CharDevice);
        }
        if t.is_block_device() {
            return Some(FileKind::BlockDevice);
        }
    }
    Some(FileKind::Other)
}

/// Checks `md` (of `path`): a regular file of at most `cap` bytes; returns
/// its size.
fn check(path: &Path, md: &Metadata, cap: u64) -> Result<u64, FileError> {
    if let Some(what) = irregular(md) {
        return Err(FileError::NotRegular { path: path.to_owned(), what });
    }
    if md.len() > cap {
        return Err(FileError::TooLarge { path: path.to_owned(), size: md.len(), cap });
    }
    Ok(md.len())
}

/// Whether `path` is a regular file (symbolic links followed) of at most
/// `cap` bytes, from its metadata alone: nothing is opened. Returns its
/// size.
pub fn check_regular(path: &Path, cap: u64) -> Result<u64, FileError> {
    let md = std::fs::metadata(path).map_err(|error| FileError::Io { path: path.to_owned(), error })?;
    check(path, &md, cap)
}

/// Opens `path` without blocking (a FIFO that appeared since the metadata
/// was read opens at once instead of waiting for a writer) and checks what
/// was opened: a regular file of at most `cap` bytes. Returns it and its size.
fn open_regular(path: &Path, cap: u64) -> Result<(File, u64), FileError> {
    let io = |error| FileError::Io { path: path.to_owned(), error };
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // Regular files ignore O_NONBLOCK; FIFOs and devices open at once.
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(io)?;
    let md = file.metadata().map_err(io)?;
    let size = check(path, &md, cap)?;
    Ok((file, size))
}

/// Reads at most `cap` bytes from `r` (`path` names it in errors); more is
/// an error, never an allocation beyond `cap + 1` bytes.
fn read_bounded(path: &Path, r: impl Read, cap: u64, size_hint: u64) -> Result<Vec<u8>, FileError> {
    let mut bytes = Vec::with_capacity(size_hint.min(cap) as usize);
    r.take(cap.saturating_add(1)).read_to_end(&mut bytes).map_err(|error| FileError::Io { path: path.to_owned(), error })?;
    if bytes.len() as u64 > cap {
        return Err(FileError::TooLarge { path: path.to_owned(), size: bytes.len() as u64, cap });
    }
    Ok(bytes)
}

/// The bytes of the regular file `path`, at most `cap` of them: its
/// metadata is checked before it is opened (FIFOs, sockets, devices and
/// directories are refused without being opened), the opened file again,
/// and the read stops after `cap` bytes (a file that grew meanwhile is
/// refused). Plugin artifacts are read with [`PLUGIN_MAX_BYTES`].
pub fn read_regular(path: &Path, cap: u64) -> Result<Vec<u8>, FileError> {
    check_regular(path, cap)?;
    let (file, size) = open_regular(path, cap)?;
    read_bounded(path, file, cap, size)
}

/// The bytes of `path`, whatever it is (a pipe too), at most `cap` of
/// them: for files the user names on the command line, where a pipe is a
/// legitimate choice but `/dev/zero` must not fill the memory.
pub fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>, FileError> {
    let file = File::open(path).map_err(|error| FileError::Io { path: path.to_owned(), error })?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    if size > cap {
        return Err(FileError::TooLarge { path: path.to_owned(), size, cap });
    }
    read_bounded(path, file, cap, size)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A FIFO in a fresh folder (made with mkfifo(1)).
    pub(crate) fn fifo(dir: &Path) -> PathBuf {
        let p = dir.join("plugin.fifo");
        let ok = std::process::Command::new("mkfifo").arg(&p).status().expect("mkfifo runs");
        assert!(ok.success());
        p
    }

    #[test]
    fn regular_files_are_read_whole_up_to_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.wasm");
        std::fs::write(&p, b"0123456789").unwrap();
        assert_eq!(read_regular(&p, 10).unwrap(), b"0123456789");
        let e = read_regular(&p, 9).unwrap_err();
        assert!(matches!(e, FileError::TooLarge { size: 10, cap: 9, .. }), "{e}");
        assert!(matches!(read_regular(&dir.path().join("none"), 10), Err(FileError::Io { .. })));
    }

    #[test]
    fn devices_fifos_and_directories_are_refused_without_reading() {
        let dir = tempfile::tempdir().unwrap();
        let started = Instant::now();
        let e = read_regular(Path::new("/dev/zero"), PLUGIN_MAX_BYTES).unwrap_err();
        assert!(matches!(e, FileError::NotRegular { what: FileKind::CharDevice, .. }), "{e}");
        assert!(e.to_string().contains("/dev/zero is a character device, not a regular file"), "{e}");
        let e = read_regular(dir.path(), PLUGIN_MAX_BYTES).unwrap_err();
        assert!(matches!(e, FileError::NotRegular { what: FileKind::Directory, .. }), "{e}");
        let f = fifo(dir.path());
        let e = read_regular(&f, PLUGIN_MAX_BYTES).unwrap_err();
        assert!(matches!(e, FileError::NotRegular { what: FileKind::Fifo, .. }), "{e}");
        // Swapped in after the metadata was read, a FIFO still opens at
        // once (no writer is waited for) and is refused.
        let e = open_regular(&f, PLUGIN_MAX_BYTES).unwrap_err();
        assert!(matches!(e, FileError::NotRegular { what: FileKind::Fifo, .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    }

    #[test]
    fn a_capped_read_stops_after_the_cap() {
        // /dev/zero never ends; the read stops one byte past the cap.
        let e = read_capped(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(matches!(e, FileError::TooLarge { size, .. } if size == (1 << 20) + 1), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.toml");
        std::fs::write(&p, b"[suite]").unwrap();
        assert_eq!(read_capped(&p, 7).unwrap(), b"[suite]");
        assert!(matches!(read_capped(&p, 6), Err(FileError::TooLarge { size: 7, cap: 6, .. })));
    }
}
