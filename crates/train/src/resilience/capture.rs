//! A rank's training state captured into a snapshot, and restored from
//! one.

use anyhow::{Context, Result};
use tch::{Device, Tensor};

use crate::checkpoint::{host_copy, Position, Snapshot};
use crate::tiers::copy_into;
use crate::training::TrainState;
use harness_kernels::torch_ext;

/// Tensors by name.
type Named = Vec<(String, Tensor)>;

impl TrainState<'_> {
    /// The tensors a snapshot copies, where they live: the parameters
    /// (`with_model`: rank 0 writes them for every rank) and this rank's
    /// buffers, optimizer and scaler state.
    pub fn sources(&self, with_model: bool) -> (Named, Named) {
        let model =
            if with_model { self.names.iter().cloned().zip(self.params.iter().map(|p| p.shallow_clone())).collect() } else { Vec::new() };
        let mut state: Vec<(String, Tensor)> = self.buffers.iter().map(|(n, t)| (format!("buffer/{n}"), t.shallow_clone())).collect();
        state.extend(self.optimizer.state_tensors().into_iter().map(|(n, t)| (format!("optimizer/{n}"), t)));
        if let Some(s) = &self.scaler {
            state.extend(s.state_tensors().into_iter().map(|(n, t)| (format!("scaler/{n}"), t)));
        }
        (model, state)
    }

    /// A host copy of this rank's state at `position` (see [`Self::sources`]).
    pub fn capture(&mut self, position: Position, with_model: bool) -> Result<Snapshot> {
        let (model, state) = self.sources(with_model);
        let model = model.into_iter().map(|(n, t)| (n, host_copy(&t))).collect();
        let mut state: Vec<(String, Tensor)> = state.into_iter().map(|(n, t)| (n, host_copy(&t))).collect();
        self.capture_host_side(&mut state)?;
        let mut plugins = Vec::new();
        for (slot, p) in self.plugins() {
            plugins.push((slot.to_owned(), p.state_save()?));
        }
        Ok(Snapshot { position, model, state, plugins, ready: None })
    }

    /// Takes the snapshot of `position` into `dst`'s preallocated buffers:
    /// the device copies are queued without waiting (an event marks their
    /// end), the small host-side state is saved at once.
    pub fn capture_into(&mut self, dst: &mut Snapshot, position: Position, with_model: bool) -> Result<()> {
        let (model, state) = self.sources(with_model);
        // The set holds the state and, after a snapshot, the generators'
        // states behind it (appended below).
        let fits =
            dst.state.len() >= state.len() && dst.state.iter().zip(&state).all(|((dn, d), (sn, s))| dn == sn && d.size() == s.size());
        if fits {
            dst.state.truncate(state.len());
        } else {
            // The state grew after the sets were allocated: SGD makes its
            // momentum buffers at its first step. Allocated again, once.
            dst.state = crate::tiers::buffers(&state, self.device.is_cuda())?;
        }
        copy_into(&dst.model, &model)?;
        copy_into(&dst.state, &state)?;
        dst.ready = match self.device {
            Device::Cuda(i) => Some(torch_ext::Event::record(i)?),
            _ => None,
        };
        self.capture_host_side(&mut dst.state)?;
        dst.plugins.clear();
        for (slot, p) in self.plugins() {
            dst.plugins.push((slot.to_owned(), p.state_save()?));
        }
        dst.position = position;
        Ok(())
    }

    /// The random generators' states, appended to `state`.
    fn capture_host_side(&mut self, state: &mut Vec<(String, Tensor)>) -> Result<()> {
        state.push(("rng/cpu".into(), torch_ext::rng_state(Device::Cpu)?));
        if self.device.is_cuda() {
            state.push(("rng/device".into(), torch_ext::rng_state(self.device)?));
        }
        Ok(())
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
            for (name, b) in self.buffers {
                let v = snap
                    .state
                    .iter()
                    .find(|(n, _)| n.strip_prefix("buffer/") == Some(name))
                    .with_context(|| format!("the checkpoint lacks buffer `{name}`"))?;
                anyhow::ensure!(v.1.size() == b.size(), "buffer `{name}`: shape {:?} in the checkpoint, {:?} here", v.1.size(), b.size());
                b.shallow_clone().copy_(&v.1);
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

    pub(super) fn plugins(&mut self) -> Vec<(&'static str, &mut harness_sandbox::plugin::Plugin)> {
        let s = &mut *self.strategies;
        [("compressor", s.compressor.plugin_mut()), ("batch", s.batch.plugin_mut()), ("checkpoint", s.checkpoint.plugin_mut())]
            .into_iter()
            .filter_map(|(slot, p)| p.map(|p| (slot, p)))
            .collect()
    }
}
