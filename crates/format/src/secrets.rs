//! Local secrets: the user's keys that seal what harness keeps on disk and
//! trusts later (the compile cache's machine code, checkpoints), kept
//! outside the folders they seal.
//!
//! A seal made with a key kept beside what it seals proves nothing: whoever
//! supplies the folder (a shared or restored CI cache, a copied checkpoint
//! folder) supplies the key too. So the keys live in the user's state
//! folder ([`state_dir`]): `$HARNESS_STATE_DIR`, else
//! `$XDG_STATE_HOME/harness`, else `~/.local/state/harness`. A state folder
//! in a cache folder (`$HARNESS_CACHE`, `$XDG_CACHE_HOME/harness`,
//! `~/.cache/harness`: what CI restores from elsewhere) is refused.
//!
//! A key ([`Key::of_user`]) is `<name>.key`: 32 random bytes from the
//! system's random source, mode 0600, in a folder of mode 0700. Both must
//! be owned by the user and closed to group and others, the key a regular
//! file of 32 bytes, the folder a real directory; nothing is followed
//! through a symbolic link (the folder is opened `O_NOFOLLOW`, the key
//! relative to it, `O_NOFOLLOW` too). A key that fails any of this is
//! refused by name ([`KeyError::Refused`]) and never replaced: a key that
//! others could read or write seals nothing, and replacing it on the quiet
//! would disown whatever was sealed with it, hiding the tampering it may
//! stand for. Removing it is the user's call (the refusal says so). A
//! missing key is made: written whole to a new temporary file (created
//! exclusively, synced) that is then linked to the key's name, which never
//! replaces an existing key, so processes that start together (the ranks
//! of a run) agree on one key: the first linked.

use std::ffi::{CString, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The environment variable naming the state folder (an absolute path).
pub const STATE_DIR_VAR: &str = "HARNESS_STATE_DIR";

/// Bytes of a key.
const KEY_BYTES: usize = 32;

/// Why no key was had.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// No variable names a state folder.
    #[error(
        "harness has no folder for its keys: none of {STATE_DIR_VAR}, XDG_STATE_HOME or HOME is set; set {STATE_DIR_VAR} \
         to a folder of your own, outside the cache folder"
    )]
    NoStateDir,
    /// `HARNESS_STATE_DIR` is relative.
    #[error("{STATE_DIR_VAR} is `{}`, a relative path: set it to an absolute one", .0.display())]
    Relative(PathBuf),
    /// The state folder lies in a cache folder.
    #[error(
        "the key folder {} lies in the cache folder {}, which CI restores from elsewhere: a key there seals nothing; set \
         {STATE_DIR_VAR} to a folder outside it",
        dir.display(),
        cache.display()
    )]
    InCache { dir: PathBuf, cache: PathBuf },
    /// A key or its folder that is not the user's alone, or damaged.
    #[error("{} is refused as harness's key {}: {why}; {hint}", path.display(), if *folder { "folder" } else { "file" })]
    Refused { path: PathBuf, folder: bool, why: String, hint: String },
    /// The folder or the key could not be made or read.
    #[error("cannot {doing} {}: {error}", path.display())]
    Io { path: PathBuf, doing: &'static str, error: std::io::Error },
}

/// A secret key: what [`Key::mac`] seals with. Its bytes are never shown.
#[derive(Clone)]
pub struct Key {
    bytes: [u8; KEY_BYTES],
    path: PathBuf,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Key").field("path", &self.path).field("id", &self.id()).finish_non_exhaustive()
    }
}

impl Key {
    /// The user's key `name` (`compile-cache`, `checkpoints`), from the
    /// state folder ([`state_dir`]), made on first use.
    pub fn of_user(name: &str) -> Result<Key, KeyError> {
        Key::in_dir(&state_dir()?, name)
    }

    /// The key `name` in the folder `dir` (made, mode 0700, when missing),
    /// made on first use; refused unless the folder and the key are the
    /// user's alone (see the module's documentation).
    pub fn in_dir(dir: &Path, name: &str) -> Result<Key, KeyError> {
        let folder = open_folder(dir)?;
        let file = format!("{name}.key");
        let path = dir.join(&file);
        if let Some(bytes) = read_key(&folder, &file, &path)? {
            return Ok(Key { bytes, path });
        }
        make_key(&folder, dir, &file)?;
        match read_key(&folder, &file, &path)? {
            Some(bytes) => Ok(Key { bytes, path }),
            None => Err(KeyError::Io { path, doing: "read the key just made", error: std::io::ErrorKind::NotFound.into() }),
        }
    }

    /// A key of these bytes, held in memory only (tests; a key kept
    /// elsewhere).
    pub fn from_bytes(bytes: [u8; KEY_BYTES]) -> Key {
        Key { bytes, path: PathBuf::from("(a key in memory)") }
    }

    /// The key's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A name of the key that gives nothing of it away (16 hexadecimal
    /// digits of its HMAC of a fixed text), for messages that tell a seal
    /// made with another key from a changed one.
    pub fn id(&self) -> String {
        hex::encode(&self.mac("harness key id", &[])[..8])
    }

    /// HMAC-SHA256 under the key of `parts` for the use `context` (each
    /// framed with its length, so that neither the context nor the split
    /// of the parts can be shifted).
    pub fn mac(&self, context: &str, parts: &[&[u8]]) -> [u8; 32] {
        self.hmac(context, parts).finalize().into_bytes().into()
    }

    /// Whether `tag` is [`Key::mac`] of `context` and `parts`, compared in
    /// constant time.
    pub fn verify(&self, context: &str, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.hmac(context, parts).verify_slice(tag).is_ok()
    }

    fn hmac(&self, context: &str, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.bytes).expect("HMAC takes keys of any length");
        for p in std::iter::once(context.as_bytes()).chain(parts.iter().copied()) {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }
}

/// The folder of the user's keys: `$HARNESS_STATE_DIR` (absolute), else
/// `$XDG_STATE_HOME/harness` (where absolute), else
/// `~/.local/state/harness`; refused when it lies in a cache folder.
pub fn state_dir() -> Result<PathBuf, KeyError> {
    state_dir_from(&|v| std::env::var_os(v))
}

/// [`state_dir`], with the environment variables read through `var`.
fn state_dir_from(var: &dyn Fn(&str) -> Option<OsString>) -> Result<PathBuf, KeyError> {
    let set = |v: &str| var(v).filter(|s| !s.is_empty()).map(PathBuf::from);
    let home = set("HOME").filter(|h| h.is_absolute());
    let dir = match set(STATE_DIR_VAR) {
        Some(d) if d.is_relative() => return Err(KeyError::Relative(d)),
        Some(d) => d,
        None => set("XDG_STATE_HOME")
            .filter(|d| d.is_absolute())
            .map(|d| d.join("harness"))
            .or_else(|| home.as_ref().map(|h| h.join(".local/state/harness")))
            .ok_or(KeyError::NoStateDir)?,
    };
    // Every cache folder harness may use, not only the one in force: a
    // variable set for one command and not the next would move the cache.
    let caches = [set("HARNESS_CACHE"), set("XDG_CACHE_HOME").map(|d| d.join("harness")), home.map(|h| h.join(".cache/harness"))];
    let real = resolved(&dir);
    for cache in caches.into_iter().flatten() {
        if real.starts_with(resolved(&cache)) {
            return Err(KeyError::InCache { dir, cache });
        }
    }
    Ok(dir)
}

/// `p` made absolute and resolved one component at a time, as the kernel
/// walks it: each symbolic link that exists resolved, each `..` taken from
/// what precedes it.
fn resolved(p: &Path) -> PathBuf {
    let p = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let mut real = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                real.pop();
            }
            Component::CurDir => {}
            c => {
                real.push(c);
                if let Ok(r) = real.canonicalize() {
                    real = r;
                }
            }
        }
    }
    real
}

/// The effective user.
fn euid() -> u32 {
    // SAFETY: geteuid takes nothing, cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// The state folder `dir`, made (mode 0700) when missing, opened without
/// following a symbolic link and refused unless it is the user's alone.
fn open_folder(dir: &Path) -> Result<File, KeyError> {
    let io = |doing, error| KeyError::Io { path: dir.to_path_buf(), doing, error };
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| io("make the key folder", e))?;
    let refused = |why: String, hint: String| KeyError::Refused { path: dir.to_path_buf(), folder: true, why, hint };
    let folder = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC).open(dir)
    {
        Ok(f) => f,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::ENOTDIR)) => {
            return Err(refused(
                "it is a symbolic link or not a directory".into(),
                format!("set {STATE_DIR_VAR} to a real folder of your own"),
            ));
        }
        Err(e) => return Err(io("open the key folder", e)),
    };
    let m = folder.metadata().map_err(|e| io("inspect the key folder", e))?;
    if m.uid() != euid() {
        return Err(refused(
            format!("it belongs to user {}, not to you (user {})", m.uid(), euid()),
            format!("set {STATE_DIR_VAR} to a folder of your own"),
        ));
    }
    if m.mode() & 0o077 != 0 {
        return Err(refused(
            format!("its mode is {:04o}: group or others may change the keys in it", m.mode() & 0o7777),
            format!("`chmod 700 {}` if no one else can have written to it; else remove it (harness makes new keys)", dir.display()),
        ));
    }
    Ok(folder)
}

/// The bytes of the key `file` (at `path`) in `folder`, None when it does
/// not exist; refused unless it is a regular file of the user's, closed to
/// group and others, of [`KEY_BYTES`] bytes.
fn read_key(folder: &File, file: &str, path: &Path) -> Result<Option<[u8; KEY_BYTES]>, KeyError> {
    let io = |doing, error| KeyError::Io { path: path.to_path_buf(), doing, error };
    let remove = format!(
        "remove it and harness makes a new key (what was sealed with the old one is then refused: checkpoints do not resume, \
         and plugins are compiled again): `rm {}`",
        path.display()
    );
    let refused = |why: String| KeyError::Refused { path: path.to_path_buf(), folder: false, why, hint: remove.clone() };
    let name = CString::new(file).map_err(|_| io("name", std::io::ErrorKind::InvalidInput.into()))?;
    // Without blocking (a FIFO opens at once, and is refused below).
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: `folder` is an open directory and `name` a NUL-terminated
    // string, both alive for the call; the descriptor returned is owned
    // below.
    let fd = unsafe { libc::openat(folder.as_raw_fd(), name.as_ptr(), flags) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOENT) => Ok(None),
            Some(libc::ELOOP) => Err(refused("it is a symbolic link".into())),
            _ => Err(io("open", e)),
        };
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    let f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let m = f.metadata().map_err(|e| io("inspect", e))?;
    if !m.file_type().is_file() {
        return Err(refused("it is not a regular file".into()));
    }
    if m.uid() != euid() {
        return Err(refused(format!("it belongs to user {}, not to you (user {})", m.uid(), euid())));
    }
    if m.mode() & 0o077 != 0 {
        return Err(refused(format!("its mode is {:04o}: group or others can read or change it", m.mode() & 0o7777)));
    }
    let mut bytes = Vec::with_capacity(KEY_BYTES + 1);
    (&f).take(KEY_BYTES as u64 + 1).read_to_end(&mut bytes).map_err(|e| io("read", e))?;
    let key: [u8; KEY_BYTES] =
        bytes.as_slice().try_into().map_err(|_| refused(format!("it holds {} bytes, not {KEY_BYTES}: it is damaged", bytes.len())))?;
    Ok(Some(key))
}

/// Makes the key `file` in `folder` (the folder `dir`), unless another
/// process makes it first: 32 random bytes written to a new temporary file
/// (mode 0600, created exclusively, never through a link), synced, then
/// linked to the key's name (which never replaces a key already there)
/// and the temporary name removed.
fn make_key(folder: &File, dir: &Path, file: &str) -> Result<(), KeyError> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = format!(".{file}.{}-{n}.tmp", std::process::id());
    let path = dir.join(file);
    let io = |doing, error| KeyError::Io { path: path.clone(), doing, error };
    let mut bytes = [0u8; KEY_BYTES];
    getrandom::fill(&mut bytes).map_err(|e| io("draw random bytes for", std::io::Error::other(e.to_string())))?;
    let (tmp_c, name_c) = (CString::new(tmp.as_bytes()), CString::new(file));
    let (Ok(tmp_c), Ok(name_c)) = (tmp_c, name_c) else {
        return Err(io("name", std::io::ErrorKind::InvalidInput.into()));
    };
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: `folder` is an open directory and `tmp_c` a NUL-terminated
    // string, alive for the call; the mode is passed as the variadic
    // argument O_CREAT requires; the descriptor returned is owned below.
    let fd = unsafe { libc::openat(folder.as_raw_fd(), tmp_c.as_ptr(), flags, 0o600 as libc::c_uint) };
    if fd < 0 {
        return Err(io("create a temporary file for", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    let mut f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let link = || {
        // SAFETY: both names are NUL-terminated strings relative to the
        // open directory `folder`, alive for the call; flags 0 links the
        // name itself, never what a link would point to.
        match unsafe { libc::linkat(folder.as_raw_fd(), tmp_c.as_ptr(), folder.as_raw_fd(), name_c.as_ptr(), 0) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    };
    let linked = f.write_all(&bytes).and_then(|()| f.sync_all()).and_then(|()| link());
    // SAFETY: as above; removes the temporary name only.
    unsafe { libc::unlinkat(folder.as_raw_fd(), tmp_c.as_ptr(), 0) };
    match linked {
        // Another process made the key first: it is the one.
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        Err(e) => Err(io("make", e)),
        Ok(()) => folder.sync_all().map_err(|e| io("sync the folder of", e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn a_key_is_made_once_mode_0600_in_a_0700_folder_and_read_back() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("state/harness");
        let k = Key::in_dir(&dir, "checkpoints").unwrap();
        assert_eq!(k.path(), dir.join("checkpoints.key"));
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("checkpoints.key")), 0o600);
        assert_eq!(std::fs::read(k.path()).unwrap().len(), 32);
        // Read back, the same key; another name, another key.
        let again = Key::in_dir(&dir, "checkpoints").unwrap();
        assert_eq!(again.mac("c", &[b"x"]), k.mac("c", &[b"x"]));
        assert_ne!(Key::in_dir(&dir, "compile-cache").unwrap().id(), k.id());
        // Nothing left behind but the keys.
        let mut names: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        assert_eq!(names, ["checkpoints.key", "compile-cache.key"]);
        // Its bytes are never shown.
        let shown = format!("{k:?}");
        assert!(shown.contains(&k.id()) && !shown.contains(&hex::encode(std::fs::read(k.path()).unwrap())), "{shown}");
    }

    #[test]
    fn processes_that_start_together_agree_on_one_key() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("state");
        let ids: Vec<String> = std::thread::scope(|s| {
            let all: Vec<_> = (0..8).map(|_| s.spawn(|| Key::in_dir(&dir, "k").unwrap().id())).collect();
            all.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(ids.iter().all(|i| *i == ids[0]), "{ids:?}");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    }

    #[test]
    fn the_mac_binds_key_context_and_the_split_of_its_parts() {
        let (a, b) = (Key::from_bytes([1; 32]), Key::from_bytes([2; 32]));
        let tag = a.mac("seal", &[b"ab", b"c"]);
        assert!(a.verify("seal", &[b"ab", b"c"], &tag));
        assert!(!b.verify("seal", &[b"ab", b"c"], &tag));
        assert!(!a.verify("other", &[b"ab", b"c"], &tag));
        assert!(!a.verify("seal", &[b"a", b"bc"], &tag));
        assert!(!a.verify("seal", &[b"abc"], &tag));
        assert!(!a.verify("seal", &[b"ab", b"c"], &tag[..31]));
    }

    /// The refusal of `r`, checked to name `path`.
    fn refusal(r: Result<Key, KeyError>, path: &Path, why: &str) -> String {
        let e = r.expect_err("the key was accepted");
        let m = e.to_string();
        assert!(matches!(&e, KeyError::Refused { path: p, .. } if p == path), "{m}");
        assert!(m.contains(&path.display().to_string()) && m.contains(why), "{m}");
        m
    }

    #[test]
    fn a_symbolic_link_is_never_followed_and_is_refused_by_name() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("state");
        Key::in_dir(&dir, "k").unwrap();
        // A key that is a link to a file of 32 bytes elsewhere.
        let elsewhere = t.path().join("planted");
        std::fs::write(&elsewhere, [0u8; 32]).unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink(&elsewhere, dir.join("linked.key")).unwrap();
        let m = refusal(Key::in_dir(&dir, "linked"), &dir.join("linked.key"), "is a symbolic link");
        assert!(m.contains("rm "), "{m}");
        // A dangling link is not followed to make a key where it points.
        std::os::unix::fs::symlink(t.path().join("nowhere"), dir.join("dangling.key")).unwrap();
        refusal(Key::in_dir(&dir, "dangling"), &dir.join("dangling.key"), "is a symbolic link");
        assert!(!t.path().join("nowhere").exists());
        // The folder itself a link to a folder of the user's.
        let linked = t.path().join("linked-state");
        std::os::unix::fs::symlink(&dir, &linked).unwrap();
        refusal(Key::in_dir(&linked, "k"), &linked, "is a symbolic link or not a directory");
    }

    #[test]
    fn a_key_others_can_read_or_change_or_of_another_length_is_refused_not_replaced() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("state");
        let k = Key::in_dir(&dir, "k").unwrap();
        let bytes = std::fs::read(k.path()).unwrap();
        std::fs::set_permissions(k.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
        refusal(Key::in_dir(&dir, "k"), k.path(), "its mode is 0644");
        assert_eq!(std::fs::read(k.path()).unwrap(), bytes, "a refused key was replaced");
        std::fs::set_permissions(k.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(k.path(), [0u8; 31]).unwrap();
        refusal(Key::in_dir(&dir, "k"), k.path(), "it holds 31 bytes, not 32");
        std::fs::write(k.path(), [0u8; 64]).unwrap();
        refusal(Key::in_dir(&dir, "k"), k.path(), "it holds 33 bytes, not 32");
        // A FIFO is refused at once, not waited on.
        assert!(std::process::Command::new("mkfifo").arg(dir.join("fifo.key")).status().unwrap().success());
        refusal(Key::in_dir(&dir, "fifo"), &dir.join("fifo.key"), "not a regular file");
        // A folder group or others may write to.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
        refusal(Key::in_dir(&dir, "k"), &dir, "its mode is 0770");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        // Another user's key (only root can plant one).
        if euid() == 0 {
            std::fs::write(k.path(), &bytes).unwrap();
            std::os::unix::fs::chown(k.path(), Some(4242), None).unwrap();
            refusal(Key::in_dir(&dir, "k"), k.path(), "it belongs to user 4242");
            std::os::unix::fs::chown(&dir, Some(4242), None).unwrap();
            refusal(Key::in_dir(&dir, "k"), &dir, "it belongs to user 4242");
        }
    }

    /// [`state_dir_from`] with the variables `vars`.
    fn state(vars: &[(&str, &str)]) -> Result<PathBuf, KeyError> {
        let vars: Vec<(String, OsString)> = vars.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
        state_dir_from(&|v| vars.iter().find(|(k, _)| k == v).map(|(_, x)| x.clone()))
    }

    #[test]
    fn the_state_folder_is_never_in_a_cache_folder() {
        let t = tempfile::tempdir().unwrap();
        let home = t.path().join("home");
        let h = home.to_str().unwrap();
        assert_eq!(state(&[("HOME", h)]).unwrap(), home.join(".local/state/harness"));
        assert_eq!(state(&[("HOME", h), ("XDG_STATE_HOME", "/xdg/state")]).unwrap(), Path::new("/xdg/state/harness"));
        // A relative XDG_STATE_HOME is ignored, as the XDG rules say.
        assert_eq!(state(&[("HOME", h), ("XDG_STATE_HOME", "rel")]).unwrap(), home.join(".local/state/harness"));
        assert_eq!(state(&[("HOME", h), (STATE_DIR_VAR, "/keys"), ("XDG_STATE_HOME", "/x")]).unwrap(), Path::new("/keys"));
        assert!(matches!(state(&[("HOME", h), (STATE_DIR_VAR, "keys")]), Err(KeyError::Relative(_))));
        assert!(matches!(state(&[]), Err(KeyError::NoStateDir)));
        // In, or equal to, any cache folder harness may use: refused.
        let cache = t.path().join("ci-cache");
        let c = cache.to_str().unwrap();
        let inside = cache.join("state");
        let (xdg_keys, dotdot) = (format!("{c}/harness/keys"), format!("{h}/.cache/harness/../harness/k"));
        let cases: [Vec<(&str, &str)>; 5] = [
            vec![("HOME", h), ("HARNESS_CACHE", c), (STATE_DIR_VAR, inside.to_str().unwrap())],
            vec![("HOME", h), ("HARNESS_CACHE", c), (STATE_DIR_VAR, c)],
            vec![("HOME", h), ("HARNESS_CACHE", c), ("XDG_STATE_HOME", c)],
            vec![("HOME", h), ("XDG_CACHE_HOME", c), (STATE_DIR_VAR, &xdg_keys)],
            vec![("HOME", h), (STATE_DIR_VAR, &dotdot)],
        ];
        for vars in cases {
            let e = state(&vars).expect_err(&format!("{vars:?}"));
            assert!(matches!(e, KeyError::InCache { .. }), "{vars:?}: {e}");
            assert!(e.to_string().contains("which CI restores from elsewhere"), "{e}");
        }
        // Through a symbolic link into the cache: refused too.
        std::fs::create_dir_all(cache.join("k")).unwrap();
        let link = t.path().join("looks-elsewhere");
        std::os::unix::fs::symlink(cache.join("k"), &link).unwrap();
        let e = state(&[("HOME", h), ("HARNESS_CACHE", c), (STATE_DIR_VAR, link.to_str().unwrap())]).unwrap_err();
        assert!(matches!(e, KeyError::InCache { .. }), "{e}");
        // Beside it: fine (a shared prefix of the name is not a folder).
        let beside = t.path().join("ci-cache-keys");
        assert_eq!(state(&[("HOME", h), ("HARNESS_CACHE", c), (STATE_DIR_VAR, beside.to_str().unwrap())]).unwrap(), beside);
    }
}
