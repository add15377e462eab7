//! Token files: llm.c `.bin` files (256 x i32 header, magic 20240520, then
//! u16 tokens) or nanoGPT's headerless u16 files, memory-mapped, and the
//! check of a split against the model's vocabulary.

use std::path::{Path, PathBuf};

/// Magic number of llm.c token files.
pub const LLMC_MAGIC: i32 = 20240520;

/// A memory-mapped u16 token file.
pub struct TokenFile {
    path: PathBuf,
    map: memmap2::Mmap,
    offset: usize,
    len: usize,
}

/// Errors reading token files.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot open token file {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("token file {path} is malformed: {why}")]
    Malformed { path: PathBuf, why: String },
    #[error("token file {path} holds token {token}, outside the model's vocabulary of {vocab}; set `vocab` in the data table")]
    TokenOutOfRange { path: PathBuf, token: u16, vocab: u32 },
}

impl TokenFile {
    /// Opens and maps a token file, detecting the llm.c header.
    pub fn open(path: &Path) -> Result<TokenFile, DataError> {
        let f = std::fs::File::open(path).map_err(|source| DataError::Open { path: path.into(), source })?;
        // SAFETY: the file is mapped read-only and only read as bytes; a
        // concurrent truncation by another process is outside our control,
        // as with any memory-mapped reader (nanoGPT's np.memmap included).
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|source| DataError::Open { path: path.into(), source })?;
        let bad = |why: String| DataError::Malformed { path: path.into(), why };
        let header = 256 * 4;
        let (offset, len) = if map.len() >= header && i32::from_le_bytes(map[0..4].try_into().expect("4 bytes")) == LLMC_MAGIC {
            let version = i32::from_le_bytes(map[4..8].try_into().expect("4 bytes"));
            let n = i32::from_le_bytes(map[8..12].try_into().expect("4 bytes"));
            if version != 1 {
                return Err(bad(format!("llm.c header version {version}; only version 1 (u16 tokens) is supported")));
            }
            if n < 0 || header + 2 * n as usize > map.len() {
                return Err(bad(format!("header says {n} tokens but the file holds {}", (map.len() - header) / 2)));
            }
            (header, n as usize)
        } else {
            if map.len() % 2 != 0 {
                return Err(bad("odd number of bytes for a u16 token file".into()));
            }
            (0, map.len() / 2)
        };
        Ok(TokenFile { path: path.into(), map, offset, len })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the file holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Token `i`.
    pub fn get(&self, i: usize) -> u16 {
        let p = self.offset + 2 * i;
        u16::from_le_bytes([self.map[p], self.map[p + 1]])
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A split must hold one sequence, and its tokens must fit the vocabulary
/// (checked on a sample of 4096 positions up front).
pub(super) fn check_split(file: &TokenFile, range: (usize, usize), t: usize, vocab: u32) -> anyhow::Result<()> {
    if range.1 - range.0 < t + 1 {
        anyhow::bail!(
            "token file {} has {} tokens in its split, fewer than one sequence of {t} + 1",
            file.path().display(),
            range.1 - range.0
        );
    }
    let step = ((range.1 - range.0) / 4096).max(1);
    for i in (range.0..range.1).step_by(step) {
        let tok = file.get(i);
        if tok as u32 >= vocab {
            return Err(DataError::TokenOutOfRange { path: file.path().into(), token: tok, vocab }.into());
        }
    }
    Ok(())
}
