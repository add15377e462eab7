//! An entry's [`Strategies`], assembled from the names its suite strategy
//! gives: built-in strategies, or configured instances of the suite's
//! plugins behind their adapters. The strategy traits live below this
//! module and know plugins only as `Any` (`plugin_any`); `plugin_mut` here
//! gives the plugin back its type.

use tch::Device;

use super::{Kind, Plugin, PluginBatch, PluginCheckpoint, PluginCompressor, PluginReport, PluginSet};
use crate::strategy::{AllReduce, BatchPolicy, CheckpointPolicy, Compressor, FixedBatch, NoCheckpoint, Strategies};
use harness_format::suite::Strategy;

impl Strategies {
    /// Instantiates the strategies a suite entry names: built-in ones, or
    /// configured instances of the suite's plugins (names are checked by
    /// suite validation). `check_finite`: validate compressor outputs for
    /// NaN/inf (off under fp16 loss scaling).
    pub fn build(
        s: &Strategy,
        batch: u32,
        accum: u32,
        plugins: &PluginSet,
        device: Device,
        check_finite: bool,
    ) -> anyhow::Result<Strategies> {
        let compressor: Box<dyn Compressor> = match s.compressor.as_str() {
            "allreduce" => Box::new(AllReduce),
            name if plugins.has(name) => Box::new(PluginCompressor::new(
                plugins.instance(name, "compressor", Kind::Compressor, s.compressor_config.as_ref(), device)?,
                check_finite,
            )),
            other => anyhow::bail!("unknown compressor `{other}`"),
        };
        let batch: Box<dyn BatchPolicy> = match s.batch_policy.as_str() {
            "fixed" => Box::new(FixedBatch { batch, accum }),
            name if plugins.has(name) => Box::new(PluginBatch {
                plugin: plugins.instance(name, "batch_policy", Kind::BatchPolicy, s.batch_policy_config.as_ref(), device)?,
            }),
            other => anyhow::bail!("unknown batch policy `{other}`"),
        };
        let checkpoint: Box<dyn CheckpointPolicy> = match s.checkpoint.as_str() {
            "none" => Box::new(NoCheckpoint),
            name if plugins.has(name) => Box::new(PluginCheckpoint {
                plugin: plugins.instance(name, "checkpoint", Kind::CheckpointPolicy, s.checkpoint_config.as_ref(), device)?,
            }),
            other => anyhow::bail!("unknown checkpoint policy `{other}`"),
        };
        Ok(Strategies { compressor, batch, checkpoint })
    }

    /// The plugins' records and call histograms.
    pub fn plugin_reports(&mut self) -> Vec<PluginReport> {
        [self.compressor.plugin_mut(), self.batch.plugin_mut(), self.checkpoint.plugin_mut()]
            .into_iter()
            .flatten()
            .map(|p| p.report())
            .collect()
    }
}

impl dyn Compressor {
    /// The plugin, if this is one (for its state in checkpoints).
    pub fn plugin_mut(&mut self) -> Option<&mut Plugin> {
        self.plugin_any()?.downcast_mut()
    }
}

impl dyn BatchPolicy {
    /// The plugin, if this is one (for its state in checkpoints).
    pub fn plugin_mut(&mut self) -> Option<&mut Plugin> {
        self.plugin_any()?.downcast_mut()
    }
}

impl dyn CheckpointPolicy {
    /// The plugin, if this is one (for its state in checkpoints).
    pub fn plugin_mut(&mut self) -> Option<&mut Plugin> {
        self.plugin_any()?.downcast_mut()
    }
}
