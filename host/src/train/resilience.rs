//! Injected failures and the state a restore puts back: the fault clock, and
//! capturing / restoring a rank's training state as a checkpoint snapshot.

use std::collections::BTreeSet;

use anyhow::{Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Device, Tensor};

use super::checkpoint::{host_copy, Position, Snapshot};
use super::optim::{LossScaler, Optimizer};
use crate::strategy::Strategies;
use crate::suite::FaultSpec;
use crate::torch_ext;

/// When injected failures strike.
pub struct FaultClock {
    /// Listed steps that have not struck yet (each strikes once).
    at_steps: BTreeSet<u64>,
    /// Random failures: the mean time between them, the generator and the
    /// training time of the next one.
    random: Option<(f64, ChaCha8Rng, f64)>,
}

impl FaultClock {
    /// The clock of `spec`. Random failures are drawn on rank 0 only (the
    /// ranks then agree through a collective); listed steps on every rank.
    pub fn new(spec: &FaultSpec, entry_seed: u64, rank: usize) -> FaultClock {
        let random = spec.mtbf_s.filter(|_| rank == 0).map(|mtbf| {
            let mut rng = ChaCha8Rng::seed_from_u64(spec.seed.unwrap_or(entry_seed) ^ 0xfa11_0fa1);
            let first = exponential(&mut rng, mtbf);
            (mtbf, rng, first)
        });
        FaultClock { at_steps: spec.at_steps.iter().copied().collect(), random }
    }

    /// Whether a failure strikes now, with `done` steps completed after
    /// `elapsed_s` seconds of training.
    pub fn strikes(&mut self, done: u64, elapsed_s: f64) -> bool {
        let listed = self.at_steps.remove(&done);
        let random = match &mut self.random {
            Some((mtbf, rng, next)) if elapsed_s >= *next => {
                *next = elapsed_s + exponential(rng, *mtbf);
                true
            }
            _ => false,
        };
        listed || random
    }
}

/// An exponentially distributed time with mean `mean`.
fn exponential(rng: &mut ChaCha8Rng, mean: f64) -> f64 {
    -(1.0 - rng.random::<f64>()).ln() * mean
}

/// What a snapshot is taken of and restored into.
pub struct TrainState<'a> {
    pub names: &'a [String],
    pub params: &'a [Tensor],
    pub optimizer: &'a mut Optimizer,
    pub scaler: Option<&'a mut LossScaler>,
    pub strategies: &'a mut Strategies,
    pub device: Device,
}

impl TrainState<'_> {
    /// A host copy of this rank's state at `position`; `with_model` adds
    /// the parameters (rank 0 writes them for every rank).
    pub fn capture(&mut self, position: Position, with_model: bool) -> Result<Snapshot> {
        let model = if with_model { self.names.iter().cloned().zip(self.params.iter().map(host_copy)).collect() } else { Vec::new() };
        let mut state: Vec<(String, Tensor)> =
            self.optimizer.state_tensors().into_iter().map(|(n, t)| (format!("optimizer/{n}"), host_copy(&t))).collect();
        if let Some(s) = &self.scaler {
            state.extend(s.state_tensors().into_iter().map(|(n, t)| (format!("scaler/{n}"), host_copy(&t))));
        }
        state.push(("rng/cpu".into(), torch_ext::rng_state(Device::Cpu)?));
        if self.device.is_cuda() {
            state.push(("rng/device".into(), torch_ext::rng_state(self.device)?));
        }
        let mut plugins = Vec::new();
        for (slot, p) in self.plugins() {
            plugins.push((slot.to_owned(), p.state_save()?));
        }
        Ok(Snapshot { position, model, state, plugins })
    }

    /// Puts `snap` back: parameters, optimizer and scaler state, random
    /// generators and plugin states.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for (name, p) in self.names.iter().zip(self.params) {
                let v = snap.model.iter().find(|(n, _)| n == name).with_context(|| format!("the checkpoint lacks parameter `{name}`"))?;
                anyhow::ensure!(
                    v.1.size() == p.size(),
                    "parameter `{name}`: shape {:?} in the checkpoint, {:?} here",
                    v.1.size(),
                    p.size()
                );
                p.shallow_clone().copy_(&v.1);
            }
            Ok(())
        })?;
        let device = self.device;
        self.optimizer.load_state(&mut |n| snap.take_state(&format!("optimizer/{n}"), device))?;
        if let Some(s) = &mut self.scaler {
            s.load_state(&mut |n| snap.take_state(&format!("scaler/{n}"), device))?;
        }
        if let Some(t) = snap.take_state("rng/cpu", Device::Cpu) {
            torch_ext::set_rng_state(Device::Cpu, &t)?;
        }
        if let (Some(t), true) = (snap.take_state("rng/device", Device::Cpu), device.is_cuda()) {
            torch_ext::set_rng_state(device, &t)?;
        }
        for (slot, p) in self.plugins() {
            let state = snap.plugin(slot).with_context(|| format!("the checkpoint lacks the state of the {slot} plugin"))?;
            p.state_load(state)?;
        }
        Ok(())
    }

    fn plugins(&mut self) -> Vec<(&'static str, &mut crate::plugin::Plugin)> {
        let s = &mut *self.strategies;
        [("compressor", s.compressor.plugin_mut()), ("batch", s.batch.plugin_mut()), ("checkpoint", s.checkpoint.plugin_mut())]
            .into_iter()
            .filter_map(|(slot, p)| p.map(|p| (slot, p)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_failures_strike_once_and_random_ones_follow_the_mtbf() {
        let spec = FaultSpec { at_steps: vec![3, 7], ..FaultSpec::default() };
        let mut c = FaultClock::new(&spec, 1, 0);
        let hits: Vec<u64> = (1..=10).filter(|&s| c.strikes(s, 0.0)).collect();
        assert_eq!(hits, vec![3, 7]);
        assert!(!c.strikes(3, 0.0), "a listed failure struck twice (after a restore)");

        // 20,000 draws with mean 5 s: the mean interval is 5 s within 3%.
        let spec = FaultSpec { mtbf_s: Some(5.0), seed: Some(9), ..FaultSpec::default() };
        let mut c = FaultClock::new(&spec, 1, 0);
        let (mut n, mut t) = (0u32, 0.0);
        while n < 20_000 {
            t += 0.01;
            if c.strikes(0, t) {
                n += 1;
            }
        }
        assert!((t / n as f64 - 5.0).abs() < 0.15, "mean time between failures {}", t / n as f64);
        // Other ranks follow rank 0 through a collective.
        assert!(FaultClock::new(&spec, 1, 1).random.is_none());
    }
}
