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

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

/// Where the cache lives, or None when it is turned off.
pub fn dir() -> Option<PathBuf> {
    if std::env::var("HARNESS_COMPILE_CACHE").is_ok_and(|v| v == "0") {
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
                return Ok((comp, Source::Cached));
            }
        }
        source = Source::Recompiled;
    }
    let comp = Component::new(engine, bytes)?;
    if let Ok(c) = comp.serialize() {
        let _ = store(dir, &code, &sum, &c);
    }
    Ok((comp, source))
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
}
