//! Shared by the compressor plugins (each includes this file with
//! `#[path = "../../shared/state.rs"] mod state;`; it is not a crate):
//! per-bucket tensors kept across calls (error-feedback residuals, PowerSGD
//! factors), their byte format for `state_save` / `state_load`, and seed
//! mixing.
//!
//! State format (little-endian), self-describing:
//!
//! ```text
//! "HCS1"  u8 version = 1
//! u16 len, plugin name (UTF-8)        -- a state is loaded only by the plugin that saved it
//! u32 entries
//! per entry: u32 bucket index, u16 len, tensor name (UTF-8),
//!            u8 ndim, ndim x u64 dims, numel x f32 elements
//! ```
#![allow(dead_code)]

use std::collections::BTreeMap;

use harness_sdk::{tensor, Error, Tensor};

const MAGIC: &[u8; 4] = b"HCS1";
const VERSION: u8 = 1;

enum Slot {
    Live(Tensor),
    /// Loaded from a saved state; becomes a tensor on the next call (a host
    /// tensor needs a `like` tensor for its device, and only `compress` has
    /// one).
    Saved {
        shape: Vec<u64>,
        data: Vec<f32>,
    },
}

/// Named tensors per bucket index.
#[derive(Default)]
pub struct BucketState {
    slots: BTreeMap<(u32, String), Slot>,
}

impl BucketState {
    /// Removes and returns the tensor `name` of `bucket` (made on `like`'s
    /// device if it came from a saved state).
    pub fn take(&mut self, bucket: u32, name: &str, like: &Tensor) -> Option<Tensor> {
        match self.slots.remove(&(bucket, name.to_owned()))? {
            Slot::Live(t) => Some(t),
            Slot::Saved { shape, data } => Some(tensor::from_f32(&data, &shape, like)),
        }
    }

    /// Keeps `t` as the tensor `name` of `bucket`.
    pub fn put(&mut self, bucket: u32, name: &str, t: Tensor) {
        self.slots.insert((bucket, name.to_owned()), Slot::Live(t));
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.slots.clear();
    }

    /// The bytes of the format above (tensors read with `read_f32`).
    pub fn save(&self, plugin: &str) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.push(VERSION);
        put_str(&mut b, plugin);
        b.extend_from_slice(&(self.slots.len() as u32).to_le_bytes());
        for ((bucket, name), slot) in &self.slots {
            b.extend_from_slice(&bucket.to_le_bytes());
            put_str(&mut b, name);
            let (shape, data) = match slot {
                Slot::Live(t) => (t.shape(), t.read_f32()),
                Slot::Saved { shape, data } => (shape.clone(), data.clone()),
            };
            b.push(shape.len() as u8);
            for d in &shape {
                b.extend_from_slice(&d.to_le_bytes());
            }
            for x in &data {
                b.extend_from_slice(&x.to_le_bytes());
            }
        }
        b
    }

    /// Parses [`BucketState::save`]'s bytes; empty bytes are an empty state.
    pub fn load(plugin: &str, bytes: &[u8]) -> Result<BucketState, Error> {
        let mut st = BucketState::default();
        if bytes.is_empty() {
            return Ok(st);
        }
        let mut r = Reader { b: bytes, at: 0 };
        if r.take(4)? != MAGIC {
            return Err(Error::new("not a compressor state (bad magic)"));
        }
        let v = r.take(1)?[0];
        if v != VERSION {
            return Err(Error::new(format!("state format version {v}, this plugin reads {VERSION}")));
        }
        let who = r.string()?;
        if who != plugin {
            return Err(Error::new(format!("the state was saved by plugin `{who}`, not `{plugin}`")));
        }
        let n = r.u32()?;
        for _ in 0..n {
            let bucket = r.u32()?;
            let name = r.string()?;
            let ndim = r.take(1)?[0] as usize;
            let mut shape = Vec::with_capacity(ndim);
            for _ in 0..ndim {
                shape.push(u64::from_le_bytes(r.take(8)?.try_into().expect("8 bytes")));
            }
            let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or_else(|| Error::new("tensor shape overflows"))?;
            let raw = r.take(numel.checked_mul(4).ok_or_else(|| Error::new("tensor too large"))? as usize)?;
            let data = raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
            st.slots.insert((bucket, name), Slot::Saved { shape, data });
        }
        if r.at != bytes.len() {
            return Err(Error::new(format!("{} trailing bytes after the state", bytes.len() - r.at)));
        }
        Ok(st)
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u16).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| Error::new("the state is truncated"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn string(&mut self) -> Result<String, Error> {
        let n = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")) as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| Error::new("a name in the state is not UTF-8"))
    }
}

/// A seed from several parts (configured seed, step, bucket index, rank):
/// splitmix64 over each in turn, so nearby inputs give unrelated seeds. Kept
/// below 2^63 (the native ABI passes seeds as i64).
pub fn mix(parts: &[u64]) -> u64 {
    let mut h: u64 = 0x243F_6A88_85A3_08D3;
    for &p in parts {
        h = splitmix64(h ^ p);
    }
    h >> 1
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `k = ceil(ratio * n)`, within 1..=n.
pub fn count(ratio: f64, n: u64) -> u64 {
    ((ratio * n as f64).ceil() as u64).clamp(1, n.max(1))
}

/// The `ratio` key: in (0, 1].
pub fn ratio(config: &harness_sdk::Config, default: f64) -> Result<f64, Error> {
    let r: f64 = config.get_or("ratio", default)?;
    if !(r > 0.0 && r <= 1.0) {
        return Err(Error::new(format!("ratio must lie in (0, 1], not {r}")));
    }
    Ok(r)
}
