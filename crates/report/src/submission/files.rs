//! Reading a received bundle's files without trusting its manifest. A
//! bundle comes from someone else: the paths its `MANIFEST.json` names
//! are read only when they stay inside the bundle's folder, as regular
//! files reached without a symbolic link, no larger than a cap checked
//! before reading (one per kind of file: [`cap`]), and through a reader
//! bounded by that cap. Nothing else in the folder is read (docs/rules.md,
//! "Verification" and "Size limits").

use std::path::{Component, Path, PathBuf};

use harness_format::files as caps;

/// The files of a bundle, relative to its folder.
pub const MANIFEST: &str = "MANIFEST.json";
pub const RESULT: &str = "result.json";
pub const SUITE: &str = "suite.toml";
pub const MACHINE: &str = "machine.json";
pub const LOG: &str = "run.log";

/// Most bytes `MANIFEST.json` may have.
pub const MANIFEST_CAP: u64 = caps::MANIFEST_MAX_BYTES;
/// Most bytes any file of a bundle may have: a plugin artifact's cap (a
/// large component: a Python one is about 40 MB). The bundle's own files
/// have smaller caps ([`cap`]).
pub const FILE_CAP: u64 = caps::PLUGIN_MAX_BYTES;
/// Most bytes of all a bundle's files together.
pub const TOTAL_CAP: u64 = 512 << 20;
/// Most files a manifest may list.
pub const MAX_FILES: usize = 64;

/// The most bytes of the bundle's file `rel` that are read, by its kind:
/// the manifest, the result, the suite, the fingerprint and the log have
/// the caps of their kind ([`harness_format::files`]); anything else the
/// manifest lists is a plugin artifact ([`FILE_CAP`]).
pub fn cap(rel: &str) -> u64 {
    match rel {
        MANIFEST => MANIFEST_CAP,
        RESULT => caps::RESULT_MAX_BYTES,
        SUITE => caps::SUITE_MAX_BYTES,
        MACHINE => caps::MACHINE_MAX_BYTES,
        LOG => caps::LOG_MAX_BYTES,
        _ => FILE_CAP,
    }
}

/// The file `rel` of the bundle in `dir`, if the path is one a bundle may
/// name: relative, of plain names only (no `..`, no root, no prefix, no
/// `.`), every folder on the way a real folder and the file a regular
/// file, none of them a symbolic link. The error says which rule `rel`
/// breaks.
pub fn confine(dir: &Path, rel: &str) -> Result<PathBuf, String> {
    if rel.is_empty() || rel.contains('\0') {
        return Err(format!("the manifest names the file `{}`, which is no path", rel.escape_default()));
    }
    let parts: Vec<Component> = Path::new(rel).components().collect();
    let mut at = dir.to_path_buf();
    for (i, part) in parts.iter().enumerate() {
        match part {
            Component::Normal(name) => at.push(name),
            Component::ParentDir => return Err(format!("`{rel}` leaves the bundle's folder (`..`); verify reads only files inside it")),
            Component::RootDir | Component::Prefix(_) => {
                return Err(format!("`{rel}` is an absolute path; verify reads only files inside the bundle's folder"))
            }
            Component::CurDir => return Err(format!("`{rel}` is not a plain relative path (`.`)")),
        }
        let meta = std::fs::symlink_metadata(&at).map_err(|e| format!("{rel} is missing: {e}"))?;
        let kind = meta.file_type();
        let shown = at.strip_prefix(dir).unwrap_or(&at).display().to_string();
        if kind.is_symlink() {
            return Err(format!(
                "`{rel}` goes through the symbolic link `{shown}`; verify reads only the bundle's own files, never a link"
            ));
        }
        let last = i + 1 == parts.len();
        if !last && !kind.is_dir() {
            return Err(format!("`{rel}`: `{shown}` is not a folder"));
        }
        if last && !kind.is_file() {
            return Err(format!("`{rel}` is not a regular file (a folder, a device, a pipe or a socket); verify reads only regular files"));
        }
    }
    Ok(at)
}

/// The bytes of the bundle's file `rel` ([`confine`]d), refused unread
/// when it holds more than `cap` bytes, and read through a reader that
/// stops at `cap` whatever the file does meanwhile.
pub fn read(dir: &Path, rel: &str, cap: u64) -> Result<Vec<u8>, String> {
    let path = confine(dir, rel)?;
    let meta = std::fs::symlink_metadata(&path).map_err(|e| format!("{rel} is missing: {e}"))?;
    if meta.len() > cap {
        return Err(format!("{rel} has {} bytes; verify reads at most {cap} bytes of a bundle's file", meta.len()));
    }
    let file = std::fs::File::open(&path).map_err(|e| format!("{rel} cannot be opened: {e}"))?;
    same_file(&meta, &file).map_err(|why| format!("{rel} {why}"))?;
    caps::read_at_most(Path::new(rel), file, cap, meta.len()).map_err(|e| match e {
        caps::FileError::TooLarge { .. } => format!("{rel} grew past {cap} bytes while it was read"),
        e => e.to_string(),
    })
}

/// Whether the file opened is the regular file checked (not one swapped
/// in for it since, such as a link).
#[cfg(unix)]
fn same_file(checked: &std::fs::Metadata, opened: &std::fs::File) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let m = opened.metadata().map_err(|e| format!("cannot be read: {e}"))?;
    if !m.is_file() || m.dev() != checked.dev() || m.ino() != checked.ino() {
        return Err("changed between its check and its opening".into());
    }
    Ok(())
}

#[cfg(not(unix))]
fn same_file(_checked: &std::fs::Metadata, opened: &std::fs::File) -> Result<(), String> {
    match opened.metadata() {
        Ok(m) if m.is_file() => Ok(()),
        _ => Err("is not a regular file".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_relative_paths_to_regular_files_inside_the_folder_are_read() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("b.bundle");
        std::fs::create_dir_all(dir.join("plugins")).unwrap();
        std::fs::write(dir.join("plugins/p.wasm"), b"abc").unwrap();
        std::fs::write(tmp.path().join("outside"), b"secret").unwrap();
        assert_eq!(read(&dir, "plugins/p.wasm", 10).unwrap(), b"abc");
        let err = |rel: &str| read(&dir, rel, 1 << 20).unwrap_err();
        assert!(err("../outside").contains("leaves the bundle's folder"), "{}", err("../outside"));
        assert!(err("plugins/../../outside").contains("leaves the bundle's folder"));
        assert!(err("/dev/zero").contains("is an absolute path"));
        assert!(err("./plugins/p.wasm").contains("not a plain relative path"));
        assert!(err("plugins").contains("not a regular file"));
        assert!(err("").contains("no path"));
        assert!(err("nothing").contains("nothing is missing"));
        assert!(read(&dir, "plugins/p.wasm", 2).unwrap_err().contains("has 3 bytes; verify reads at most 2"));
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("/dev/zero", dir.join("zero")).unwrap();
            std::os::unix::fs::symlink(tmp.path(), dir.join("up")).unwrap();
            assert!(err("zero").contains("goes through the symbolic link `zero`"), "{}", err("zero"));
            assert!(err("up/outside").contains("goes through the symbolic link `up`"), "{}", err("up/outside"));
        }
    }
}
