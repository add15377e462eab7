//! Shared by the batch-policy plugins (each includes this file with
//! `#[path = "../../shared/batch.rs"] mod batch;`; it is not a crate): the
//! learning-rate rule and the byte format of their `state_save` /
//! `state_load`.
//!
//! State format (little-endian):
//!
//! ```text
//! "HBS1"  u8 version (1, or the plugin's newer layout of its fields)
//! u16 len, plugin name (UTF-8)   -- a state is loaded only by the plugin that saved it
//! then the plugin's fields, in a fixed order (u8 / u32 / u64 / f64)
//! ```
//!
//! The version numbers the layout of the plugin's fields: every plugin
//! starts at 1 ([`Writer::new`], [`Reader::new`]); one that adds fields
//! writes a higher version ([`Writer::versioned`]) and reads its older ones
//! too ([`Reader::versioned`]).
#![allow(dead_code)]

use harness_sdk::{Config, Error};

const MAGIC: &[u8; 4] = b"HBS1";
const VERSION: u8 = 1;

/// How the learning rate follows the batch: `lr_scale` relative to the
/// policy's start batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LrRule {
    /// Always 1.
    None,
    /// `batch / start` (Goyal et al. 2017).
    Linear,
    /// `sqrt(batch / start)` (Krizhevsky 2014; Hoffer et al. 2017).
    Sqrt,
}

impl LrRule {
    /// Reads `lr_rule` ("none", "linear", "sqrt"; default "none").
    pub fn from_config(config: &Config) -> Result<LrRule, Error> {
        match config.get_or("lr_rule", "none".to_owned())?.as_str() {
            "none" => Ok(LrRule::None),
            "linear" => Ok(LrRule::Linear),
            "sqrt" => Ok(LrRule::Sqrt),
            other => Err(Error::new(format!("lr_rule must be \"none\", \"linear\" or \"sqrt\", not \"{other}\""))),
        }
    }

    /// The learning-rate multiplier for `batch` samples, given `start`.
    pub fn scale(self, batch: f64, start: f64) -> f64 {
        let r = batch / start;
        let s = match self {
            LrRule::None => 1.0,
            LrRule::Linear => r,
            LrRule::Sqrt => r.sqrt(),
        };
        if s.is_finite() && s > 0.0 {
            s
        } else {
            1.0
        }
    }
}

/// Writes a state.
pub struct Writer(Vec<u8>);

impl Writer {
    /// A state of plugin `name`, fields in layout 1.
    pub fn new(name: &str) -> Writer {
        Writer::versioned(name, VERSION)
    }
    /// A state of plugin `name`, fields in the plugin's layout `version`.
    pub fn versioned(name: &str, version: u8) -> Writer {
        let mut b = MAGIC.to_vec();
        b.push(version);
        b.extend_from_slice(&(name.len() as u16).to_le_bytes());
        b.extend_from_slice(name.as_bytes());
        Writer(b)
    }
    pub fn u8(&mut self, v: u8) -> &mut Writer {
        self.0.push(v);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Writer {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Writer {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn f64(&mut self, v: f64) -> &mut Writer {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}

/// Reads a state written by [`Writer`].
pub struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// Checks the header: magic, that `name` saved it, and layout 1.
    pub fn new(b: &'a [u8], name: &str) -> Result<Reader<'a>, Error> {
        Ok(Reader::versioned(b, name, VERSION)?.0)
    }
    /// Checks the header: magic, that `name` saved it, and a layout from 1
    /// to `newest`; returns the reader and the state's layout version.
    pub fn versioned(b: &'a [u8], name: &str, newest: u8) -> Result<(Reader<'a>, u8), Error> {
        let mut r = Reader { b, at: 0 };
        if r.take(4)? != MAGIC {
            return Err(Error::new("not a batch-policy state (bad magic)"));
        }
        let v = r.u8()?;
        let len = u16::from_le_bytes(r.take(2)?.try_into().unwrap()) as usize;
        let who = r.take(len)?;
        if who != name.as_bytes() {
            return Err(Error::new(format!("a state of plugin `{}`, not `{name}`", String::from_utf8_lossy(who))));
        }
        if !(VERSION..=newest).contains(&v) {
            let reads = if newest == VERSION { format!("{VERSION}") } else { format!("{VERSION} to {newest}") };
            return Err(Error::new(format!("state version {v}, this plugin reads {reads}")));
        }
        Ok((r, v))
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| Error::new("truncated state"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64, Error> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn f64(&mut self) -> Result<f64, Error> {
        Ok(f64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    /// Fails on trailing bytes.
    pub fn finish(self) -> Result<(), Error> {
        if self.at == self.b.len() {
            Ok(())
        } else {
            Err(Error::new(format!("{} trailing bytes in the state", self.b.len() - self.at)))
        }
    }
}
