//! Reading files that untrusted input names or holds: a suite's plugin
//! artifacts, and what `harness verify`, `report`, `compare` and
//! `reproduce` are given (result files, bundles, reproduction records and
//! their signatures, keys). Every such read goes through one bounded reader
//! and stops at a cap named below, one per kind of file.
//!
//! A path may name anything: `/dev/zero` (endless bytes), a FIFO (an
//! `open` that waits for a writer forever), a directory, a file of
//! gigabytes, a symbolic link out of the folder it was found in.
//! [`read_regular`] looks at the path's metadata before opening it, refuses
//! anything but a regular file and anything over its cap, opens it without
//! blocking and checks the opened file again (the path may have been
//! swapped in between), then reads at most the cap through a bounded
//! reader. [`read_plain`] does the same and refuses a symbolic link too,
//! for files found in a folder someone else made. [`read_capped`] only
//! bounds the bytes read, for paths the user names on the command line (a
//! suite given as `<(...)` is a pipe). [`read_at_most`] is the bounded
//! read under all three, for callers that open the file themselves.
//!
//! The caps are generous for what harness writes and small enough that
//! `harness verify` or `report` of any one bundle stays well under 1 GiB:
//! parsing JSON into values takes up to about 16 bytes of memory per byte
//! of text (`[0,0,...]`: a 32-byte value per 2 bytes), so a 16 MiB result
//! costs at most about 256 MiB while it is parsed. docs/rules.md
//! ("Size limits") lists them.

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

/// The largest result file harness reads (a bundle's `result.json`, a
/// result given to `harness report` or `compare`): 16 MiB. The largest
/// result in results/ is 2.9 MB (72 entries of the plugin-overhead suite,
/// each with its loss curve and 8 histograms); a standard-suite result is
/// under 0.5 MB. Its JSON is parsed whole (see the module's note on memory).
pub const RESULT_MAX_BYTES: u64 = 16 << 20;

/// The largest bundle manifest (`MANIFEST.json`): 1 MiB. It lists at most
/// 64 files of about 200 bytes each (those in results/ are under 1.5 kB).
pub const MANIFEST_MAX_BYTES: u64 = 1 << 20;

/// The largest run log (`run.log`) harness reads: 16 MiB. The console
/// writes an opening line per run and a line per entry (under 200 bytes
/// in results/, whose logs are under 3 kB).
pub const LOG_MAX_BYTES: u64 = 16 << 20;

/// The largest machine fingerprint (`machine.json`): 1 MiB. Those in
/// results/ are under 1 kB.
pub const MACHINE_MAX_BYTES: u64 = 1 << 20;

/// The largest reproduction record (`*.reproduction.json`): 16 MiB. The
/// records in results/ are under 5 kB; a difference or a timing figure
/// takes about 150 to 200 bytes, so this leaves room for tens of
/// thousands.
pub const RECORD_MAX_BYTES: u64 = 16 << 20;

/// The largest signature (`*.sig`) or key file: 4 KiB. A signature file is
/// 260 bytes of JSON (a 64-byte signature and a 32-byte key, in hex); a
/// key file is 64 hex digits and a newline.
pub const KEY_MAX_BYTES: u64 = 4 << 10;

/// Why a file was not read.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file could not be inspected, opened or read.
    #[error("cannot read {}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    /// Not a regular file: a directory, FIFO, socket, device, or (for
    /// [`read_plain`]) a symbolic link.
    #[error("{} is {what}, not a regular file", path.display())]
    NotRegular { path: PathBuf, what: FileKind },
    /// Larger than the cap: `size` is the file's size, or, when the read
    /// stopped at the cap (a pipe, a file that grew), the bytes read.
    #[error("{} has {}{size} bytes, more than the {cap} bytes{} harness reads", path.display(), if *whole { "" } else { "at least " }, size_text(*cap))]
    TooLarge { path: PathBuf, size: u64, cap: u64, whole: bool },
}

/// A cap of whole MiB or KiB in words, ` (16 MiB)`, ` (4 KiB)`; nothing
/// for other sizes.
fn size_text(n: u64) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!(" ({} MiB)", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!(" ({} KiB)", n >> 10),
        _ => String::new(),
    }
}

/// What a path that is not a regular file is, in words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Directory,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
    SymbolicLink,
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
            FileKind::SymbolicLink => "a symbolic link",
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
    if t.is_symlink() {
        return Some(FileKind::SymbolicLink);
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
        return Err(FileError::TooLarge { path: path.to_owned(), size: md.len(), cap, whole: true });
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
/// was read opens at once instead of waiting for a writer) and, unless
/// `follow`, without following a symbolic link; checks what was opened: a
/// regular file of at most `cap` bytes. Returns it and its size.
fn open_regular(path: &Path, cap: u64, follow: bool) -> Result<(File, u64), FileError> {
    let io = |error| FileError::Io { path: path.to_owned(), error };
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // Regular files ignore O_NONBLOCK; FIFOs and devices open at once.
        // O_NOFOLLOW: a link swapped in since the check fails to open.
        options.custom_flags(libc::O_NONBLOCK | if follow { 0 } else { libc::O_NOFOLLOW });
    }
    let file = match options.open(path) {
        #[cfg(unix)]
        Err(e) if !follow && e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(FileError::NotRegular { path: path.to_owned(), what: FileKind::SymbolicLink })
        }
        r => r.map_err(io)?,
    };
    let md = file.metadata().map_err(io)?;
    let size = check(path, &md, cap)?;
    Ok((file, size))
}

/// Reads at most `cap` bytes from `r` (`path` names it in errors; its
/// size, from its metadata, sizes the buffer up to `cap`); more is an
/// error, never an allocation beyond `cap + 1` bytes. The one bounded read
/// under every reader here, for callers that open and check the file
/// themselves (a bundle's files, confined to its folder).
pub fn read_at_most(path: &Path, r: impl Read, cap: u64, size_hint: u64) -> Result<Vec<u8>, FileError> {
    let mut bytes = Vec::with_capacity(size_hint.min(cap) as usize);
    r.take(cap.saturating_add(1)).read_to_end(&mut bytes).map_err(|error| FileError::Io { path: path.to_owned(), error })?;
    if bytes.len() as u64 > cap {
        return Err(FileError::TooLarge { path: path.to_owned(), size: bytes.len() as u64, cap, whole: false });
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
    let (file, size) = open_regular(path, cap, true)?;
    read_at_most(path, file, cap, size)
}

/// [`read_regular`] for a file found in a folder someone else made (a
/// result beside others that `harness report` was given): a symbolic link
/// is refused rather than followed, before and when it is opened, since it
/// could point anywhere on this machine.
pub fn read_plain(path: &Path, cap: u64) -> Result<Vec<u8>, FileError> {
    let md = std::fs::symlink_metadata(path).map_err(|error| FileError::Io { path: path.to_owned(), error })?;
    check(path, &md, cap)?;
    let (file, size) = open_regular(path, cap, false)?;
    read_at_most(path, file, cap, size)
}

/// The bytes of `path`, whatever it is (a pipe too), at most `cap` of
/// them: for files the user names on the command line, where a pipe is a
/// legitimate choice but `/dev/zero` must not fill the memory.
pub fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>, FileError> {
    let file = File::open(path).map_err(|error| FileError::Io { path: path.to_owned(), error })?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    if size > cap {
        return Err(FileError::TooLarge { path: path.to_owned(), size, cap, whole: true });
    }
    read_at_most(path, file, cap, size)
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
        let e = open_regular(&f, PLUGIN_MAX_BYTES, true).unwrap_err();
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
        let e = read_capped(Path::new("/dev/zero"), KEY_MAX_BYTES).unwrap_err();
        assert!(e.to_string().ends_with("/dev/zero has at least 4097 bytes, more than the 4096 bytes (4 KiB) harness reads"), "{e}");
    }

    /// Issue 61: a file found in a folder someone else made is read only
    /// if it is a regular file there, never through a symbolic link.
    #[cfg(unix)]
    #[test]
    fn a_plain_read_refuses_links_and_says_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.json");
        std::fs::write(&p, vec![b' '; 100]).unwrap();
        assert_eq!(read_plain(&p, 100).unwrap().len(), 100);
        let e = read_plain(&p, 99).unwrap_err();
        assert!(e.to_string().ends_with("r.json has 100 bytes, more than the 99 bytes harness reads"), "{e}");
        let link = dir.path().join("link.json");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        let e = read_plain(&link, 100).unwrap_err();
        assert!(matches!(e, FileError::NotRegular { what: FileKind::SymbolicLink, .. }), "{e}");
        assert!(e.to_string().ends_with("link.json is a symbolic link, not a regular file"), "{e}");
        // Swapped in after the check, a link still does not open.
        let e = open_regular(&link, 100, false).unwrap_err();
        assert!(matches!(e, FileError::NotRegular { what: FileKind::SymbolicLink, .. }), "{e}");
        assert_eq!(read_regular(&link, 100).unwrap().len(), 100, "read_regular follows links");
        let e = read_plain(Path::new("/dev/zero"), RESULT_MAX_BYTES).unwrap_err();
        assert!(matches!(e, FileError::NotRegular { what: FileKind::CharDevice, .. }), "{e}");
    }
}
