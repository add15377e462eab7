//! The compile cache of WebAssembly components: a component is compiled
//! once per artifact, wasmtime version and engine settings, and the
//! machine code is kept outside the clone (`$HARNESS_CACHE/components`,
//! default `~/.cache/harness/components`). A large component (a Python one
//! takes about 15 s to compile) then loads in milliseconds at every
//! `validate`, `inspect` and run.
//!
//! Each entry is `<key>.cwasm` with `<key>.sha256`, a seal written when it
//! was stored: the artifact's sha256, the `.cwasm`'s sha256 and an
//! HMAC-SHA256 of both and the key under the user's `compile-cache` key,
//! which lives outside the cache, in the user's state folder
//! ([`harness_format::secrets`]: `$HARNESS_STATE_DIR`, else
//! `~/.local/state/harness`). Whoever supplies the cache folder (a shared
//! or restored CI cache) does not supply that key. Deserializing compiled
//! code runs it, so nothing is deserialized before its seal is checked
//! against the artifact being loaded and the `.cwasm` bytes read: an entry
//! whose bytes do not match (truncated, corrupt), whose seal names another
//! artifact (an entry of another module copied or renamed over this one),
//! whose seal was not made with the user's key (forged, copied from
//! another cache or another user, or sealed by an older harness with the
//! key it kept in the cache, `components/secret`, which is no longer read),
//! or that wasmtime refuses (another version or settings under the same
//! key) is compiled again from the artifact and replaced: foreign code is
//! never run under an artifact's sha256. Without the user's key (no state
//! folder, or its key refused) the cache is not used, with a one-line note.
//! Set `HARNESS_COMPILE_CACHE=0` to compile every time.
//!
//! The cache is bounded: after an entry is stored, the least recently
//! used entries (a load marks an entry used) are removed until the
//! compiled code takes at most `HARNESS_COMPILE_CACHE_MB` megabytes
//! (default 2048). The entry just stored is always kept.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use harness_format::secrets::Key;
use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

/// Where the cache lives, or None when it is turned off.
pub fn dir() -> Option<PathBuf> {
    if !harness_format::switches::get().compile_cache {
        return None;
    }
    let base = std::env::var_os("HARNESS_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("harness")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/harness")))?;
    Some(base.join("components"))
}

/// How a component was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Compiled,
    Cached,
    /// Compiled because the cache entry was corrupt or stale.
    Recompiled,
}

/// The cache key of an artifact whose sha256 is `artifact` under `engine`:
/// that hash, the wasmtime version and the engine's compatibility hash (its
/// settings and the host's CPU features).
fn key(engine: &Engine, artifact: &str) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut h);
    env!("CARGO_PKG_VERSION").hash(&mut h);
    format!("{artifact}-{:016x}", h.finish())
}

/// The name of the user's key the cache seals with.
const KEY_NAME: &str = "compile-cache";

/// What a seal's HMAC is made for (its domain: no other seal verifies).
const SEAL_CONTEXT: &str = "harness compile cache entry";

/// The user's `compile-cache` key, read once per process; None (with a
/// one-line note) when there is no state folder or its key is refused:
/// then the cache is not used.
fn user_key() -> Option<&'static Key> {
    static KEY: std::sync::OnceLock<Option<Key>> = std::sync::OnceLock::new();
    KEY.get_or_init(|| match Key::of_user(KEY_NAME) {
        Ok(k) => Some(k),
        Err(e) => {
            let e = harness_format::fmt::printable_line(&e.to_string()).into_owned();
            eprintln!("harness: note: WebAssembly plugins are compiled without the compile cache: {e}");
            None
        }
    })
    .as_ref()
}

/// The seal of an entry: what `<key>.sha256` holds.
fn seal(secret: &Key, key: &str, artifact: &str, code: &[u8]) -> String {
    let code = hex::encode(Sha256::digest(code));
    let mac = hex::encode(secret.mac(SEAL_CONTEXT, &[key.as_bytes(), artifact.as_bytes(), code.as_bytes()]));
    format!("artifact {artifact}\ncode {code}\nmac {mac}\n")
}

/// Whether `sealed` (what `<key>.sha256` holds) is the seal of `code` as
/// the entry `key` of `artifact`, made with `secret` (its HMAC compared in
/// constant time).
fn sealed_by(secret: &Key, key: &str, artifact: &str, code: &[u8], sealed: &[u8]) -> bool {
    let code = hex::encode(Sha256::digest(code));
    let Some(mac) = std::str::from_utf8(sealed)
        .ok()
        .and_then(|s| s.strip_prefix(&format!("artifact {artifact}\ncode {code}\nmac ")))
        .and_then(|s| s.strip_suffix('\n'))
        .and_then(|m| hex::decode(m).ok())
    else {
        return false;
    };
    secret.verify(SEAL_CONTEXT, &[key.as_bytes(), artifact.as_bytes(), code.as_bytes()], &mac)
}

/// An older harness kept the cache's key in the cache (`dir/secret`): a
/// key supplied with the folder it seals proves nothing. It is not read;
/// a one-line note (once per process) says so, and the entries it sealed
/// fail their seals and are compiled again. (It is left for the user to
/// remove: nothing is deleted through a folder someone else may supply.)
fn note_an_old_secret(dir: &Path) {
    static NOTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let old = dir.join("secret");
    if std::fs::symlink_metadata(&old).is_ok() && !NOTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        eprintln!(
            "harness: note: {} (the key an older harness kept in the compile cache) is not trusted: the entries it sealed \
             are compiled again; remove it",
            harness_format::fmt::printable_path(&old)
        );
    }
}

/// The component of `bytes`, from the cache in `dir` when it holds a sound
/// entry, else compiled (and stored, best effort: a cache that cannot be
/// written only costs the next compile). The entries are sealed with the
/// user's `compile-cache` key; without it, nothing is read from the cache.
pub fn component(engine: &Engine, bytes: &[u8], dir: Option<&Path>) -> wasmtime::Result<(Component, Source)> {
    component_sealed(engine, bytes, dir.and_then(|d| Some((d, user_key()?))))
}

/// [`component`], with the cache folder and the key that seals it.
fn component_sealed(engine: &Engine, bytes: &[u8], cache: Option<(&Path, &Key)>) -> wasmtime::Result<(Component, Source)> {
    let Some((dir, secret)) = cache else {
        return Ok((Component::new(engine, bytes)?, Source::Compiled));
    };
    note_an_old_secret(dir);
    let artifact = hex::encode(Sha256::digest(bytes));
    let key = key(engine, &artifact);
    let (code, sum) = (dir.join(format!("{key}.cwasm")), dir.join(format!("{key}.sha256")));
    let mut source = Source::Compiled;
    if let (Ok(c), Ok(s)) = (harness_format::files::read_regular(&code, MAX_ENTRY_BYTES), harness_format::files::read_regular(&sum, 4096)) {
        if sealed_by(secret, &key, &artifact, &c, &s) {
            // SAFETY: deserializing runs the bytes as machine code, so they
            // must be what `Component::serialize` wrote for this artifact
            // (its sha256 is in the seal) under this engine's settings (the
            // key), unchanged since (their sha256, in the seal, of the very
            // bytes in `c`), and sealed by this user's harness (the HMAC,
            // under a key kept outside the cache, which whoever supplies the
            // cache folder does not have); wasmtime checks the version and
            // settings again.
            if let Ok(comp) = unsafe { Component::deserialize(engine, &c) } {
                // Used now: the last to go when the cache is pruned.
                let _ = std::fs::File::options().write(true).open(&code).and_then(|f| f.set_modified(std::time::SystemTime::now()));
                return Ok((comp, Source::Cached));
            }
        }
        source = Source::Recompiled;
    }
    let comp = Component::new(engine, bytes)?;
    if let Ok(c) = comp.serialize() {
        let stored = std::fs::create_dir_all(dir).and_then(|()| store(&code, &sum, &c, &seal(secret, &key, &artifact, &c)));
        if stored.is_ok() {
            prune(dir, limit_bytes(), &code);
        }
    }
    Ok((comp, source))
}

/// The cache's bound on compiled code, bytes.
fn limit_bytes() -> u64 {
    let mb = harness_format::switches::get().compile_cache_mb;
    mb << 20
}

/// Removes the least recently used entries of `dir` (oldest modification
/// time first) until their code takes at most `limit` bytes; `keep` stays.
/// Best effort: an entry that cannot be removed is left.
fn prune(dir: &Path, limit: u64, keep: &Path) {
    let Ok(read) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<(std::time::SystemTime, u64, PathBuf)> = read
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
        .filter_map(|p| {
            let m = std::fs::metadata(&p).ok()?;
            Some((m.modified().ok()?, m.len(), p))
        })
        .collect();
    let mut total: u64 = entries.iter().map(|e| e.1).sum();
    entries.sort();
    for (_, len, path) in entries {
        if total <= limit {
            break;
        }
        if path != keep && std::fs::remove_file(&path).is_ok() {
            let _ = std::fs::remove_file(path.with_extension("sha256"));
            total -= len;
        }
    }
}

/// Writes an entry: the code, then its seal, each to a temporary file
/// renamed into place (a reader sees a whole file or none).
fn store(code: &Path, sum: &Path, c: &[u8], seal: &str) -> std::io::Result<()> {
    let put = |path: &Path, bytes: &[u8]| -> std::io::Result<()> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, path)
    };
    put(code, c)?;
    put(sum, seal.as_bytes())
}

/// The largest compiled component read from the cache (a Python one is
/// tens of MiB); a larger entry is compiled again.
const MAX_ENTRY_BYTES: u64 = 1 << 30;

#[cfg(test)]
mod tests {
    use super::*;

    /// The smallest component: the preamble of the component binary format.
    const EMPTY_COMPONENT: &[u8] = b"\0asm\x0d\0\x01\0";

    /// An engine configured as the sandbox's (epochs, the component
    /// model), without its epoch thread: these tests only compile.
    fn engine() -> &'static wasmtime::Engine {
        static ENGINE: std::sync::OnceLock<wasmtime::Engine> = std::sync::OnceLock::new();
        ENGINE.get_or_init(|| {
            let mut cfg = wasmtime::Config::new();
            cfg.epoch_interruption(true);
            cfg.wasm_component_model(true);
            wasmtime::Engine::new(&cfg).expect("a wasmtime engine")
        })
    }

    /// A cache folder and a state folder holding the user's key (never the
    /// real ones).
    struct Cache {
        dir: tempfile::TempDir,
        _state: tempfile::TempDir,
        key: Key,
    }

    impl Cache {
        fn new() -> Cache {
            let state = tempfile::tempdir().unwrap();
            let key = Key::in_dir(&state.path().join("harness"), KEY_NAME).unwrap();
            Cache { dir: tempfile::tempdir().unwrap(), _state: state, key }
        }

        /// The cache folder (made by the first store).
        fn path(&self) -> PathBuf {
            self.dir.path().join("components")
        }

        /// How `bytes` is obtained through this cache.
        fn load(&self, bytes: &[u8]) -> Source {
            component_sealed(engine(), bytes, Some((&self.path(), &self.key))).unwrap().1
        }
    }

    #[test]
    fn a_component_is_compiled_once_and_a_corrupt_entry_is_rebuilt() {
        let cache = Cache::new();
        assert_eq!(cache.load(EMPTY_COMPONENT), Source::Compiled);
        assert_eq!(cache.load(EMPTY_COMPONENT), Source::Cached);
        // Corrupt the code: its hash no longer matches, so it is compiled
        // again, and the entry replaced.
        let (code, _) = entry(&cache.path(), EMPTY_COMPONENT);
        let mut c = std::fs::read(&code).unwrap();
        let last = c.len() - 1;
        c[last] ^= 0xff;
        std::fs::write(&code, &c).unwrap();
        assert_eq!(cache.load(EMPTY_COMPONENT), Source::Recompiled);
        assert_eq!(cache.load(EMPTY_COMPONENT), Source::Cached);
        // A truncated entry too.
        std::fs::write(&code, &c[..c.len() / 2]).unwrap();
        assert_eq!(cache.load(EMPTY_COMPONENT), Source::Recompiled);
        // Without a cache folder nothing is stored.
        assert_eq!(component_sealed(engine(), EMPTY_COMPONENT, None).unwrap().1, Source::Compiled);
        // The cache holds entries only: no key.
        for e in std::fs::read_dir(cache.path()).unwrap() {
            let p = e.unwrap().path();
            assert!(p.extension().is_some_and(|x| x == "cwasm" || x == "sha256"), "{}", p.display());
        }
    }

    /// The cache's entry files (code, seal), of the one entry whose key
    /// starts with `artifact`'s sha256.
    fn entry(dir: &Path, artifact: &[u8]) -> (PathBuf, PathBuf) {
        let sha = hex::encode(Sha256::digest(artifact));
        let code = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "cwasm") && p.file_name().unwrap().to_string_lossy().starts_with(&sha))
            .unwrap();
        (code.clone(), code.with_extension("sha256"))
    }

    /// Another module: the same preamble and a custom section.
    const OTHER: &[u8] = b"\0asm\x0d\0\x01\0\x00\x06\x05other";

    #[test]
    fn an_entry_of_another_artifact_or_a_forged_seal_is_never_used() {
        let cache = Cache::new();
        assert_eq!(cache.load(EMPTY_COMPONENT), Source::Compiled);
        assert_eq!(cache.load(OTHER), Source::Compiled);
        let (code, sum) = entry(&cache.path(), EMPTY_COMPONENT);
        let (other_code, other_sum) = entry(&cache.path(), OTHER);
        // The other module's entry, code and seal, copied over this one's:
        // its seal names the other artifact, so it is compiled again.
        std::fs::copy(&other_code, &code).unwrap();
        std::fs::copy(&other_sum, &sum).unwrap();
        assert_eq!(cache.load(EMPTY_COMPONENT), Source::Recompiled);
        assert_eq!(cache.load(EMPTY_COMPONENT), Source::Cached);
        // Foreign code with a seal made the way an attacker can (the right
        // artifact and code hashes, but another key: a key of their own, or
        // another user's cache with its key): refused.
        let foreign = std::fs::read(&other_code).unwrap();
        let cache_key = code.file_stem().unwrap().to_string_lossy().into_owned();
        let artifact = hex::encode(Sha256::digest(EMPTY_COMPONENT));
        let other_user = Cache::new();
        for theirs in [Key::from_bytes([7u8; 32]), Key::from_bytes([0u8; 32]), other_user.key.clone()] {
            std::fs::write(&code, &foreign).unwrap();
            std::fs::write(&sum, seal(&theirs, &cache_key, &artifact, &foreign)).unwrap();
            assert_eq!(cache.load(EMPTY_COMPONENT), Source::Recompiled, "{theirs:?}");
        }
        // The seal of the old format (the code's sha256 alone) too.
        std::fs::write(&code, &foreign).unwrap();
        std::fs::write(&sum, hex::encode(Sha256::digest(&foreign))).unwrap();
        assert_eq!(cache.load(EMPTY_COMPONENT), Source::Recompiled);
        // What is stored again is this artifact's own code, sealed with the
        // user's key (the two modules compile to the same bytes here: the
        // seals differ).
        let s = std::fs::read(&sum).unwrap();
        assert!(sealed_by(&cache.key, &cache_key, &artifact, &std::fs::read(&code).unwrap(), &s));
        assert!(!sealed_by(&other_user.key, &cache_key, &artifact, &std::fs::read(&code).unwrap(), &s));
    }

    /// The HMAC-SHA256 (RFC 2104) an older harness sealed entries with,
    /// under the key it kept in the cache (`components/secret`).
    fn hmac_of_an_older_harness(secret: &[u8], msg: &[u8]) -> [u8; 32] {
        let mut k = [0u8; 64];
        k[..secret.len()].copy_from_slice(secret);
        let pad = |b: u8| k.iter().map(|x| x ^ b).collect::<Vec<u8>>();
        let inner = Sha256::new().chain_update(pad(0x36)).chain_update(msg).finalize();
        Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize().into()
    }

    /// Issue 61: the cache kept its key in `components/secret`, so whoever
    /// supplied the folder supplied the key: with the secret set to zeros,
    /// another component's code sealed under rt-ramp's sha256 ran as
    /// rt-ramp. A planted secret and an entry sealed with it are never
    /// loaded now: the entry is compiled again.
    #[test]
    fn r61_a_planted_secret_in_the_cache_and_the_entries_it_seals_are_not_trusted() {
        let cache = Cache::new();
        assert_eq!(cache.load(OTHER), Source::Compiled);
        assert_eq!(cache.load(EMPTY_COMPONENT), Source::Compiled);
        let (code, sum) = entry(&cache.path(), EMPTY_COMPONENT);
        let (other_code, _) = entry(&cache.path(), OTHER);
        let foreign = std::fs::read(&other_code).unwrap();
        let cache_key = code.file_stem().unwrap().to_string_lossy().into_owned();
        let artifact = hex::encode(Sha256::digest(EMPTY_COMPONENT));
        std::fs::write(cache.path().join("secret"), [0u8; 32]).unwrap();
        let code_sha = hex::encode(Sha256::digest(&foreign));
        let mac = hex::encode(hmac_of_an_older_harness(&[0u8; 32], format!("{cache_key}\n{artifact}\n{code_sha}").as_bytes()));
        std::fs::write(&code, &foreign).unwrap();
        std::fs::write(&sum, format!("artifact {artifact}\ncode {code_sha}\nmac {mac}\n")).unwrap();
        assert_eq!(cache.load(EMPTY_COMPONENT), Source::Recompiled);
        assert_eq!(cache.load(EMPTY_COMPONENT), Source::Cached);
        // The planted secret is not read, nor replaced, nor used to seal.
        assert_eq!(std::fs::read(cache.path().join("secret")).unwrap(), [0u8; 32]);
        let s = String::from_utf8(std::fs::read(&sum).unwrap()).unwrap();
        assert!(!s.ends_with(&format!("mac {mac}\n")), "{s}");
    }
    #[test]
    fn the_least_recently_used_entries_go_first_when_the_cache_is_over_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let day = std::time::Duration::from_secs(86_400);
        let now = std::time::SystemTime::now();
        // Four entries of 100 bytes, used 4, 3, 2 and 1 days ago.
        let paths: Vec<PathBuf> = (0..4u32)
            .map(|i| {
                let code = dir.path().join(format!("e{i}.cwasm"));
                std::fs::write(&code, [0u8; 100]).unwrap();
                std::fs::write(code.with_extension("sha256"), "x").unwrap();
                std::fs::File::options().write(true).open(&code).unwrap().set_modified(now - day * (4 - i)).unwrap();
                code
            })
            .collect();
        // Within the bound nothing goes.
        prune(dir.path(), 400, &paths[3]);
        assert!(paths.iter().all(|p| p.exists()));
        // Over it, the oldest go first, with their hash files; the entry
        // to keep stays even when it is the oldest.
        prune(dir.path(), 200, &paths[0]);
        let left: Vec<bool> = paths.iter().map(|p| p.exists()).collect();
        assert_eq!(left, [true, false, false, true]);
        assert!(!paths[1].with_extension("sha256").exists());
        assert!(paths[3].with_extension("sha256").exists());
    }
}
