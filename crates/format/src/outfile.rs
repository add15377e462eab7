//! Opening the files harness writes without following a symbolic link.
//!
//! An output path is often in a folder others can write to (a shared
//! results folder, `/tmp`), or next to a file that came from elsewhere. A
//! link planted at the path would have harness write wherever it points:
//! append its log to someone's shell profile, create a key where the link's
//! owner chose. Every output is therefore written one of three ways, none
//! of which follows a link at the path's last component:
//!
//! - [`append`]: a file that grows (the run's log, continued by a resumed
//!   run), opened with `O_NOFOLLOW`;
//! - [`create_new`] / [`write_new`]: a file that must not exist yet (a
//!   key, the files of a folder harness has just made), opened with
//!   `O_CREAT | O_EXCL`, which never follows a link, dangling or not;
//! - [`crate::results::write_atomic`]: a file replaced whole (results,
//!   boards, records), written to a fresh temporary file and renamed over
//!   the path: a rename replaces a link, never writes through it.
//!
//! [`refuse_link`] says so early, before any work, for a path that is
//! opened later. The folders above the path are the user's choice and are
//! followed as usual.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Why an output file was not opened.
#[derive(Debug, thiserror::Error)]
pub enum OutFileError {
    /// A symbolic link is at the path.
    #[error(
        "{} is a symbolic link (to {}); harness does not write through a link, which could point anywhere\nhint: remove the link, or write elsewhere",
        path.display(),
        target.display()
    )]
    Link { path: PathBuf, target: PathBuf },
    /// Something that is not a regular file is at the path (a FIFO would
    /// block the writer, a device swallow or misplace the output).
    #[error("{} is not a regular file; harness writes its output to regular files only\nhint: remove it, or write elsewhere", path.display())]
    NotRegular { path: PathBuf },
    /// [`create_new`]: something is already at the path.
    #[error("{} already exists\nhint: harness does not overwrite it; write elsewhere", path.display())]
    Exists { path: PathBuf },
    /// The file could not be opened or written.
    #[error("cannot write {}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
}

/// The error for `path`, a link or not, from what is there now.
fn what_is_there(path: &Path, error: std::io::Error) -> OutFileError {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            let target = std::fs::read_link(path).unwrap_or_default();
            OutFileError::Link { path: path.to_owned(), target }
        }
        Ok(m) if !m.is_file() => OutFileError::NotRegular { path: path.to_owned() },
        Ok(_) if error.kind() == std::io::ErrorKind::AlreadyExists => OutFileError::Exists { path: path.to_owned() },
        _ => OutFileError::Io { path: path.to_owned(), error },
    }
}

/// Refuses a symbolic link (dangling or not) at `path`; anything else, or
/// nothing, passes. For a path written later, so that the refusal comes
/// before any work ([`append`] and [`create_new`] refuse it again).
pub fn refuse_link(path: &Path) -> Result<(), OutFileError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            Err(OutFileError::Link { path: path.to_owned(), target: std::fs::read_link(path).unwrap_or_default() })
        }
        _ => Ok(()),
    }
}

/// Opens the regular file `path` to append to it, creating it if it is
/// not there; a symbolic link at `path` is refused (`O_NOFOLLOW`), and so
/// is anything but a regular file (opened without blocking, so a FIFO
/// planted there is refused rather than waited on).
pub fn append(path: &Path) -> Result<File, OutFileError> {
    let mut o = std::fs::OpenOptions::new();
    o.create(true).append(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // Regular files ignore O_NONBLOCK.
        o.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    }
    let f = o.open(path).map_err(|e| what_is_there(path, e))?;
    let md = f.metadata().map_err(|error| OutFileError::Io { path: path.to_owned(), error })?;
    if !md.is_file() {
        return Err(OutFileError::NotRegular { path: path.to_owned() });
    }
    Ok(f)
}

/// Creates the file `path`, which must not exist: nothing at the path
/// (no file, no link, dangling or not) is opened or overwritten. `mode`
/// gives its permissions (before the umask) on Unix; `None` is 0666, as
/// `std::fs::write` gives.
pub fn create_new(path: &Path, mode: Option<u32>) -> Result<File, OutFileError> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    if let Some(mode) = mode {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(mode);
    }
    #[cfg(not(unix))]
    let _ = mode;
    o.open(path).map_err(|e| what_is_there(path, e))
}

/// Writes `bytes` to the new file `path` ([`create_new`], default
/// permissions).
pub fn write_new(path: &Path, bytes: &[u8]) -> Result<(), OutFileError> {
    let mut f = create_new(path, None)?;
    f.write_all(bytes).map_err(|error| OutFileError::Io { path: path.to_owned(), error })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::time::{Duration, Instant};

    /// Issue 61: a link planted at `<out>.log` had `harness run` append its
    /// log to the link's target.
    #[test]
    fn append_refuses_a_link_and_leaves_its_target_alone() {
        let dir = tempfile::tempdir().unwrap();
        let (target, log) = (dir.path().join("profile"), dir.path().join("r.log"));
        std::fs::write(&target, "mine\n").unwrap();
        symlink(&target, &log).unwrap();
        let e = append(&log).unwrap_err();
        assert!(matches!(e, OutFileError::Link { .. }), "{e}");
        let said = e.to_string();
        assert!(said.contains(&format!("{} is a symbolic link (to {})", log.display(), target.display())), "{said}");
        assert!(said.contains("remove the link"), "{said}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "mine\n");
        assert!(matches!(refuse_link(&log), Err(OutFileError::Link { .. })));
        // A dangling link too: nothing is created where it points.
        let (gone, dangling) = (dir.path().join("gone"), dir.path().join("d.log"));
        symlink(&gone, &dangling).unwrap();
        assert!(matches!(append(&dangling), Err(OutFileError::Link { .. })));
        assert!(matches!(refuse_link(&dangling), Err(OutFileError::Link { .. })));
        assert!(!gone.exists());
    }

    #[test]
    fn append_creates_and_continues_a_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("r.log");
        refuse_link(&log).unwrap();
        writeln!(append(&log).unwrap(), "one").unwrap();
        refuse_link(&log).unwrap();
        writeln!(append(&log).unwrap(), "two").unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "one\ntwo\n");
    }

    #[test]
    fn append_refuses_a_fifo_without_waiting_for_a_reader() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("r.log");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs").success());
        let started = Instant::now();
        let e = append(&fifo).unwrap_err();
        assert!(matches!(e, OutFileError::NotRegular { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(matches!(append(dir.path()), Err(OutFileError::NotRegular { .. })));
    }

    /// Issue 61: `harness keygen KEY` wrote KEY.pub through a dangling link.
    #[test]
    fn create_new_refuses_whatever_is_there_a_dangling_link_included() {
        let dir = tempfile::tempdir().unwrap();
        let (gone, public) = (dir.path().join("gone"), dir.path().join("key.pub"));
        symlink(&gone, &public).unwrap();
        let e = write_new(&public, b"k\n").unwrap_err();
        assert!(matches!(e, OutFileError::Link { .. }), "{e}");
        assert!(!gone.exists());
        let file = dir.path().join("f");
        write_new(&file, b"first").unwrap();
        let e = write_new(&file, b"second").unwrap_err();
        assert!(matches!(e, OutFileError::Exists { .. }), "{e}");
        assert_eq!(std::fs::read(&file).unwrap(), b"first");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let secret = dir.path().join("secret");
            create_new(&secret, Some(0o600)).unwrap();
            assert_eq!(std::fs::metadata(&secret).unwrap().permissions().mode() & 0o777, 0o600);
        }
    }
}
