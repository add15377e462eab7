//! The compile cache of WebAssembly components: a component is compiled
//! once per artifact, wasmtime version and engine settings, and the
//! machine code is kept outside the clone (`$HARNESS_CACHE/components`,
//! default `~/.cache/harness/components`). A large component (a Python one
//! takes about 15 s to compile) then loads in milliseconds at every
//! `validate`, `inspect` and run.
//!
//! Each entry is `<key>.cwasm` with `<key>.sha256`, the hash of the
//! `.cwasm` bytes, written when it was stored. An entry whose bytes do not
//! match (truncated, corrupt) or that wasmtime refuses (another version or
//! settings under the same key) is compiled again and replaced. Set
//! `HARNESS_COMPILE_CACHE=0` to compile every time.
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

/// The cache key of `bytes` under `engine`: the artifact's sha256, the
/// wasmtime version and the engine's compatibility hash (its settings and
/// the host's CPU features).
fn key(engine: &Engine, bytes: &[u8]) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut h);
    env!("CARGO_PKG_VERSION").hash(&mut h);
    format!("{}-{:016x}", hex::encode(Sha256::digest(bytes)), h.finish())
}

/// The component of `bytes`, from the cache in `dir` when it holds a sound
/// entry, else compiled (and stored, best effort: a cache that cannot be
/// written only costs the next compile).
pub fn component(engine: &Engine, bytes: &[u8], dir: Option<&Path>) -> wasmtime::Result<(Component, Source)> {
    let Some(dir) = dir else { return Ok((Component::new(engine, bytes)?, Source::Compiled)) };
    let key = key(engine, bytes);
    let (code, sum) = (dir.join(format!("{key}.cwasm")), dir.join(format!("{key}.sha256")));
    let mut source = Source::Compiled;
    if let (Ok(c), Ok(s)) = (std::fs::read(&code), std::fs::read_to_string(&sum)) {
        if hex::encode(Sha256::digest(&c)) == s.trim() {
            // SAFETY: the bytes are what `Component::serialize` wrote for
            // this engine's settings (the key), unchanged since (their
            // sha256); wasmtime checks the version and settings again.
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
        if store(dir, &code, &sum, &c).is_ok() {
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

/// Writes an entry: the code, then its hash, each to a temporary file
/// renamed into place (a reader sees a whole file or none).
fn store(dir: &Path, code: &Path, sum: &Path, c: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let put = |path: &Path, bytes: &[u8]| -> std::io::Result<()> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, path)
    };
    put(code, c)?;
    put(sum, hex::encode(Sha256::digest(c)).as_bytes())
}

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
