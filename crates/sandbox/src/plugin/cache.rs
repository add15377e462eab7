//! The compile cache of WebAssembly components: a component is compiled
//! once per artifact, wasmtime version and engine settings, and the
//! machine code is kept outside the clone (`$HARNESS_CACHE/components`,
//! default `~/.cache/harness/components`). A large component (a Python one
//! takes about 15 s to compile) then loads in milliseconds at every
//! `validate`, `inspect` and run.
//!
//! Each entry is `<key>.cwasm` with `<key>.sha256`, a seal written when it
//! was stored: the artifact's sha256, the `.cwasm`'s sha256 and an
//! HMAC-SHA256 of both and the key under the cache's own secret
//! (`secret`, 32 random bytes made once, readable by its owner only).
//! Before compiled code is used, the seal is checked against the artifact
//! being loaded and the `.cwasm` bytes read: an entry whose bytes do not
//! match (truncated, corrupt), whose seal names another artifact (an entry
//! of another module copied or renamed over this one), whose seal was not
//! made with this cache's secret (forged, or copied from another cache),
//! or that wasmtime refuses (another version or settings under the same
//! key) is compiled again from the artifact and replaced: foreign code is
//! never run under an artifact's sha256. Set `HARNESS_COMPILE_CACHE=0` to
//! compile every time.
//!
//! The cache is bounded: after an entry is stored, the least recently
//! used entries (a load marks an entry used) are removed until the
//! compiled code takes at most `HARNESS_COMPILE_CACHE_MB` megabytes
//! (default 2048). The entry just stored is always kept.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

/// Where the cache lives, or None when it is turned off.
pub fn dir() -> Option<PathBuf> {
    if !crate::switches::get().compile_cache {
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

/// HMAC-SHA256 (RFC 2104) of `msg` under `secret` (at most 64 bytes).
fn hmac(secret: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    k[..secret.len().min(64)].copy_from_slice(&secret[..secret.len().min(64)]);
    let pad = |b: u8| k.iter().map(|x| x ^ b).collect::<Vec<u8>>();
    let inner = Sha256::new().chain_update(pad(0x36)).chain_update(msg).finalize();
    Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize().into()
}

/// The cache's secret: `dir/secret`, made (32 bytes from the system's
/// random source, mode 0600) when missing. None when it cannot be read or
/// made, or has another length: then nothing is read from the cache.
fn secret(dir: &Path) -> Option<Vec<u8>> {
    let path = dir.join("secret");
    if let Ok(s) = crate::files::read_regular(&path, 64) {
        return (s.len() == 32).then_some(s);
    }
    std::fs::create_dir_all(dir).ok()?;
    let mut s = vec![0u8; 32];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").ok()?, &mut s).ok()?;
    let tmp = dir.join(format!("secret.tmp{}", std::process::id()));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    std::io::Write::write_all(&mut opts.open(&tmp).ok()?, &s).ok()?;
    // Another process may have made one meanwhile: the first one stays.
    if std::fs::hard_link(&tmp, &path).is_err() {
        let _ = std::fs::remove_file(&tmp);
        let s = crate::files::read_regular(&path, 64).ok()?;
        return (s.len() == 32).then_some(s);
    }
    let _ = std::fs::remove_file(&tmp);
    Some(s)
}

/// The seal of an entry: what `<key>.sha256` holds.
fn seal(secret: &[u8], key: &str, artifact: &str, code: &[u8]) -> String {
    let code = hex::encode(Sha256::digest(code));
    let mac = hex::encode(hmac(secret, format!("{key}\n{artifact}\n{code}").as_bytes()));
    format!("artifact {artifact}\ncode {code}\nmac {mac}\n")
}

/// The component of `bytes`, from the cache in `dir` when it holds a sound
/// entry, else compiled (and stored, best effort: a cache that cannot be
/// written only costs the next compile).
pub fn component(engine: &Engine, bytes: &[u8], dir: Option<&Path>) -> wasmtime::Result<(Component, Source)> {
    let Some((dir, secret)) = dir.and_then(|d| Some((d, secret(d)?))) else {
        return Ok((Component::new(engine, bytes)?, Source::Compiled));
    };
    let artifact = hex::encode(Sha256::digest(bytes));
    let key = key(engine, &artifact);
    let (code, sum) = (dir.join(format!("{key}.cwasm")), dir.join(format!("{key}.sha256")));
    let mut source = Source::Compiled;
    if let (Ok(c), Ok(s)) = (crate::files::read_regular(&code, MAX_ENTRY_BYTES), crate::files::read_regular(&sum, 4096)) {
        if seal(&secret, &key, &artifact, &c).as_bytes() == s.as_slice() {
            // SAFETY: the bytes are what `Component::serialize` wrote for
            // this artifact (its sha256 is in the seal) and this engine's
            // settings (the key), unchanged since (their sha256), and the
            // seal was made by this cache (its HMAC under the cache's
            // secret); wasmtime checks the version and settings again.
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
        if store(&code, &sum, &c, &seal(&secret, &key, &artifact, &c)).is_ok() {
            prune(dir, limit_bytes(), &code);
        }
    }
    Ok((comp, source))
}

/// The cache's bound on compiled code, bytes.
fn limit_bytes() -> u64 {
    let mb = crate::switches::get().compile_cache_mb;
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

    #[test]
    fn a_component_is_compiled_once_and_a_corrupt_entry_is_rebuilt() {
        let engine = super::super::wasm::engine();
        let dir = tempfile::tempdir().unwrap();
        let (_, s) = component(engine, EMPTY_COMPONENT, Some(dir.path())).unwrap();
        assert_eq!(s, Source::Compiled);
        let (_, s) = component(engine, EMPTY_COMPONENT, Some(dir.path())).unwrap();
        assert_eq!(s, Source::Cached);
        // Corrupt the code: its hash no longer matches, so it is compiled
        // again, and the entry replaced.
        let code = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "cwasm"))
            .unwrap();
        let mut c = std::fs::read(&code).unwrap();
        let last = c.len() - 1;
        c[last] ^= 0xff;
        std::fs::write(&code, &c).unwrap();
        let (_, s) = component(engine, EMPTY_COMPONENT, Some(dir.path())).unwrap();
        assert_eq!(s, Source::Recompiled);
        let (_, s) = component(engine, EMPTY_COMPONENT, Some(dir.path())).unwrap();
        assert_eq!(s, Source::Cached);
        // A truncated entry too.
        std::fs::write(&code, &c[..c.len() / 2]).unwrap();
        assert_eq!(component(engine, EMPTY_COMPONENT, Some(dir.path())).unwrap().1, Source::Recompiled);
        // Without a cache folder nothing is stored.
        assert_eq!(component(engine, EMPTY_COMPONENT, None).unwrap().1, Source::Compiled);
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

    #[test]
    fn an_entry_of_another_artifact_or_a_forged_seal_is_never_used() {
        let engine = super::super::wasm::engine();
        let dir = tempfile::tempdir().unwrap();
        // Another module: the same preamble and a custom section.
        let other: &[u8] = b"\0asm\x0d\0\x01\0\x00\x06\x05other";
        assert_eq!(component(engine, EMPTY_COMPONENT, Some(dir.path())).unwrap().1, Source::Compiled);
        assert_eq!(component(engine, other, Some(dir.path())).unwrap().1, Source::Compiled);
        let (code, sum) = entry(dir.path(), EMPTY_COMPONENT);
        let (other_code, other_sum) = entry(dir.path(), other);
        // The other module's entry, code and seal, copied over this one's:
        // its seal names the other artifact, so it is compiled again.
        std::fs::copy(&other_code, &code).unwrap();
        std::fs::copy(&other_sum, &sum).unwrap();
        assert_eq!(component(engine, EMPTY_COMPONENT, Some(dir.path())).unwrap().1, Source::Recompiled);
        assert_eq!(component(engine, EMPTY_COMPONENT, Some(dir.path())).unwrap().1, Source::Cached);
        // Foreign code with a seal made the way an attacker can (the right
        // artifact and code hashes, but not the cache's secret): refused.
        let foreign = std::fs::read(&other_code).unwrap();
        let forged =
            seal(&[7u8; 32], &code.file_stem().unwrap().to_string_lossy(), &hex::encode(Sha256::digest(EMPTY_COMPONENT)), &foreign);
        std::fs::write(&code, &foreign).unwrap();
        std::fs::write(&sum, forged).unwrap();
        assert_eq!(component(engine, EMPTY_COMPONENT, Some(dir.path())).unwrap().1, Source::Recompiled);
        // The seal of the old format (the code's sha256 alone) too.
        std::fs::write(&code, &foreign).unwrap();
        std::fs::write(&sum, hex::encode(Sha256::digest(&foreign))).unwrap();
        assert_eq!(component(engine, EMPTY_COMPONENT, Some(dir.path())).unwrap().1, Source::Recompiled);
        // What is stored again is this artifact's own code, sealed (the
        // two modules compile to the same bytes here: the seals differ).
        let s = std::fs::read_to_string(&sum).unwrap();
        assert!(s.starts_with(&format!("artifact {}\n", hex::encode(Sha256::digest(EMPTY_COMPONENT)))), "{s}");
        // The secret is the owner's alone.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("secret")).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "mode {mode:o}");
        }
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
