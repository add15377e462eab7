//! One entry's training state on one rank ([`Training`]) and what acts on
//! it, a module each: [`setup`] builds it, [`step`] trains one step (the
//! data-parallel protocol inside), [`graph`] captures and replays that step
//! as a CUDA graph, [`record`] measures it. The types they pass between
//! them live here, so none of them needs another's.

pub mod graph;
pub mod record;
pub mod setup;
pub mod step;

use anyhow::Result;
use tch::{nn, Device, Kind, Tensor};

use crate::data::{self, Data};
use crate::dp::DataParallel;
use crate::models::{Model, ModelConfig};
use crate::oom::OomGuard;
use crate::optim::{LossScaler, Optimizer};
use harness_format::suite::Precision;
use harness_runtime::measure;
use harness_sandbox::strategy::Strategies;
use setup::AutocastGuard;

/// Everything that trains in one entry on one rank.
pub struct Training {
    pub cfg: ModelConfig,
    /// Owns the parameters (`params` are handles to its variables).
    _vs: nn::VarStore,
    pub model: Model,
    /// Parameter names and tensors, sorted by name (the same on every rank).
    /// Outside a step the tensors are read through
    /// [`Training::current_params`] or [`Training::state`], which wait for
    /// ZeRO's gathers in flight.
    pub names: Vec<String>,
    params: Vec<Tensor>,
    /// Variables that are state but not trained (batch norm's running
    /// statistics), by name: out of the gradient buckets and the optimizer,
    /// in each rank's checkpoint state.
    pub buffers: Vec<(String, Tensor)>,
    pub n_params: i64,
    pub data: Data,
    /// The fixed evaluation batches.
    pub eval_set: Vec<data::Batch>,
    /// Gradient buckets, optionally sharded (ZeRO); private so that only
    /// [`Training::step`] drives its protocol.
    pub(super) dp: DataParallel,
    /// What the optimizer updates: the parameters, or this rank's shard.
    pub(super) targets: Vec<Tensor>,
    pub optimizer: Optimizer,
    pub scaler: Option<LossScaler>,
    pub strategies: Strategies,
    pub device: Device,
    pub rank: usize,
    pub world: usize,
    pub precision: Precision,
    pub grad_clip: Option<f64>,
    pub(super) autocast: AutocastGuard,
    /// bf16 on CUDA: the loss and its gradient come from one fused kernel.
    pub fused_ce: bool,
    /// Whether the batch policy gets gradient statistics.
    pub(super) grad_stats: bool,
    /// Whether the built-in all-reduce overlaps the backward pass.
    pub overlapped: bool,
    pub(super) oom: OomGuard,
    /// The largest gradient memory seen (ZeRO-2 releases buffers).
    pub gradient_bytes: u64,
    /// Gradient statistics for the batch policy, on their way to the host.
    pub(super) stats_in_flight: Option<Pending>,
    /// For the user, not failures (see `EntryOutput::warnings`).
    pub warnings: Vec<String>,
    /// The step as a CUDA graph, where the entry's step is captured.
    pub(super) graph: graph::StepGraph,
    /// Steps that ran as a replay of the captured graph.
    pub graph_replays: u64,
}

/// What a snapshot is taken of and restored into ([`Training::state`];
/// `crate::resilience` takes and restores it).
pub struct TrainState<'a> {
    pub names: &'a [String],
    pub params: &'a [Tensor],
    /// Untrained model state (batch norm's running statistics): each
    /// rank's own, so it goes with the rank's state, not rank 0's model.
    pub buffers: &'a [(String, Tensor)],
    pub optimizer: &'a mut Optimizer,
    pub scaler: Option<&'a mut LossScaler>,
    pub strategies: &'a mut Strategies,
    pub device: Device,
}

impl Training {
    /// The parameters once every gather in flight has written them (ZeRO's
    /// prefetch, [`crate::gate`]): what anything that reads them between
    /// steps takes. A step's own reads wait per layer.
    pub fn current_params(&self) -> Result<&[Tensor]> {
        self.dp.params_current()?;
        Ok(&self.params)
    }

    /// The training state a snapshot is taken of and restored into, once
    /// every gather in flight has written the parameters.
    pub fn state(&mut self) -> Result<TrainState<'_>> {
        self.dp.params_current()?;
        Ok(TrainState {
            names: &self.names,
            params: &self.params,
            buffers: &self.buffers,
            optimizer: &mut self.optimizer,
            scaler: self.scaler.as_mut(),
            strategies: &mut self.strategies,
            device: self.device,
        })
    }
}

/// What an evaluation measured.
#[derive(Debug, Clone, Copy)]
pub struct Evaluation {
    pub loss: f64,
    /// Top-1 accuracy, for classifiers.
    pub accuracy: Option<f64>,
}

/// What a step did.
pub enum Stepped {
    /// It ran out of memory; nothing was updated and the step is to be
    /// retried with a smaller batch. `emulated`: by `faults.oom_above_batch`.
    OutOfMemory {
        emulated: bool,
    },
    Trained(Trained),
}

/// A step that trained.
pub struct Trained {
    /// The step's loss, still on the device.
    pub loss: Option<Tensor>,
    pub tokens: u64,
    pub samples: u64,
    /// For a batch policy that wants them: (mean over ranks of the local
    /// squared gradient norm, squared norm of the average), of the previous
    /// step (read a step late, as the loss is).
    pub grad_stats: Option<(f64, f64)>,
}

/// A small device value (a step's loss, gradient statistics) on its way to
/// the host. On CUDA it is copied into pinned memory behind an event, so
/// reading it later waits for that copy only; `.item()` would wait for
/// everything queued on the stream, the next step included, and leave the
/// device idle while the host prepares another.
pub struct Pending {
    step: u64,
    time_s: f64,
    host: Tensor,
    done: Option<measure::cuda::Event>,
}

impl Pending {
    pub fn start(step: u64, time_s: f64, value: &Tensor) -> Result<Pending> {
        if value.device().is_cuda() {
            let host = value.to_device_(Device::Cpu, Kind::Float, true, false);
            let done = measure::cuda::Event::new()?;
            done.record()?;
            Ok(Pending { step, time_s, host, done: Some(done) })
        } else {
            Ok(Pending { step, time_s, host: value.shallow_clone(), done: None })
        }
    }

    fn wait(&self) -> Result<()> {
        if let Some(e) = &self.done {
            e.synchronize()?;
        }
        Ok(())
    }

    pub(crate) fn read(&self) -> Result<f64> {
        self.wait()?;
        Ok(self.host.double_value(&[]))
    }

    /// The first two elements.
    pub fn read_pair(&self) -> Result<(f64, f64)> {
        self.wait()?;
        Ok((self.host.double_value(&[0]), self.host.double_value(&[1])))
    }
}
