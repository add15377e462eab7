//! One rank's part of a checkpoint in host memory ([`Snapshot`]), and where
//! it puts the training loop ([`Position`]).

use anyhow::Result;
use serde::{Deserialize, Serialize};
use tch::{Device, Tensor};

/// Where a checkpoint puts the training loop.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Position {
    /// Optimizer steps completed.
    pub step: u64,
    /// Training samples each rank's data stream has handed out.
    pub data_position: u64,
    /// The batch the next step runs with.
    pub micro_batch: u32,
    pub accum_steps: u32,
    /// Written as the shortest decimal text that reads back to the same
    /// bits (a JSON number need not).
    #[serde(with = "exact_f64")]
    pub lr_scale: f64,
}

/// An `f64` as text that parses back to the same value, bit for bit.
mod exact_f64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(|_| serde::de::Error::custom(format!("`{text}` is not a number")))
    }
}

/// One rank's part of a checkpoint, in host memory.
pub struct Snapshot {
    pub position: Position,
    /// Parameters by name (rank 0's part only; empty on other ranks).
    pub model: Vec<(String, Tensor)>,
    /// This rank's own state by name: `optimizer/...`, `scaler/...`, `rng`.
    pub state: Vec<(String, Tensor)>,
    /// Plugin states by slot (`compressor`, `batch`, `checkpoint`).
    pub plugins: Vec<(String, Vec<u8>)>,
    /// On CUDA, the event after the copies into this snapshot's buffers,
    /// which were queued without waiting: readers wait for it first.
    pub ready: Option<harness_kernels::torch_ext::Event>,
}

impl Snapshot {
    /// Waits until the copies into this snapshot have landed.
    pub fn wait_ready(&self) -> Result<()> {
        if let Some(e) = &self.ready {
            e.synchronize()?;
        }
        Ok(())
    }

    /// Bytes of tensor data held.
    pub fn bytes(&self) -> u64 {
        let t = |v: &Vec<(String, Tensor)>| v.iter().map(|(_, t)| harness_kernels::torch_ext::nbytes(t)).sum::<u64>();
        t(&self.model) + t(&self.state) + self.plugins.iter().map(|(_, b)| b.len() as u64).sum::<u64>()
    }

    /// This rank's state tensor `name`, moved to `device`.
    pub fn take_state(&self, name: &str, device: Device) -> Option<Tensor> {
        self.state.iter().find(|(n, _)| n == name).map(|(_, t)| t.to_device(device))
    }

    /// The saved state of plugin slot `slot`.
    pub fn plugin(&self, slot: &str) -> Option<&[u8]> {
        self.plugins.iter().find(|(s, _)| s == slot).map(|(_, b)| b.as_slice())
    }
}
