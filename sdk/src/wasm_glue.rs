//! The adapter that `export!` hands to the generated export glue (wasm32
//! only): one instance of the plugin per component, made by `configure`.

use std::any::Any;
use std::cell::RefCell;
use std::marker::PhantomData;

use crate::__wasm::batch_policy::exports::harness::strategy::batch_sizing;
use crate::__wasm::checkpoint_policy::exports::harness::strategy::tiered_checkpointing;
use crate::__wasm::compressor::exports::harness::strategy::gradient_compression;
use crate::__wasm::compressor::harness::strategy::{tensor as wit_tensor, types};
use crate::__wasm::plugin::exports::harness::strategy::plugin;
use crate::wasm_backend::{Raw, RawComm};
use crate::{BatchPolicy, CheckpointHistory, CheckpointPolicy, Collective, Compressor, Config, Error, Plugin, Telemetry, Tensor};

/// Implements the generated `Guest` traits for a plugin type `T`.
pub struct Adapter<T>(PhantomData<T>);

thread_local! {
    /// The configured plugin (a component holds exactly one plugin type).
    static INSTANCE: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

fn with<T: 'static, R>(f: impl FnOnce(&mut T) -> Result<R, Error>) -> Result<R, String> {
    INSTANCE.with(|cell| {
        let mut slot = cell.borrow_mut();
        let plugin = slot.as_mut().and_then(|p| p.downcast_mut::<T>()).ok_or("called before a successful configure")?;
        f(plugin).map_err(|e| e.to_string())
    })
}

impl<T: Plugin> plugin::Guest for Adapter<T> {
    fn info() -> plugin::PluginInfo {
        plugin::PluginInfo { name: T::NAME.to_owned(), version: T::VERSION.to_owned() }
    }
    fn configure(config: String) -> Result<(), String> {
        INSTANCE.with(|cell| drop(cell.borrow_mut().take()));
        let plugin = T::configure(&Config::new(config)).map_err(|e| e.to_string())?;
        INSTANCE.with(|cell| *cell.borrow_mut() = Some(Box::new(plugin)));
        Ok(())
    }
    fn state_save() -> Vec<u8> {
        // No error channel in the contract: trap with the message.
        with::<T, _>(|p| Ok(p.state_save())).unwrap_or_else(|e| panic!("state-save: {e}"))
    }
    fn state_load(state: Vec<u8>) -> Result<(), String> {
        with::<T, _>(|p| p.state_load(&state))
    }
}

impl<T: Compressor> gradient_compression::Guest for Adapter<T> {
    fn setup(buckets: Vec<gradient_compression::BucketLayout>) -> Result<(), String> {
        let layouts: Vec<crate::BucketLayout> = buckets
            .into_iter()
            .map(|b| crate::BucketLayout {
                numel: b.numel,
                params: b
                    .params
                    .into_iter()
                    .map(|p| crate::ParamSlot {
                        name: p.name,
                        shape: p.shape,
                        offset: p.offset,
                        numel: p.numel,
                        dtype: crate::wasm_backend::from_wit(p.dtype),
                        weight: p.weight,
                    })
                    .collect(),
            })
            .collect();
        with::<T, _>(|p| p.setup(&layouts))
    }
    fn compress(bucket: &wit_tensor::Tensor, info: gradient_compression::BucketInfo) -> Result<(), String> {
        let bucket = Tensor::borrowed(Raw::lent(bucket));
        let info = crate::BucketInfo { step: info.step, index: info.index, count: info.count };
        with::<T, _>(|p| p.compress(&bucket, &Collective::new(RawComm), info))
    }
}

fn telemetry(t: types::StepTelemetry) -> Telemetry {
    Telemetry {
        step: t.step,
        loss: t.loss,
        step_time_s: t.step_time_s,
        elapsed_s: t.elapsed_s,
        memory_used_bytes: t.memory_used_bytes,
        memory_total_bytes: t.memory_total_bytes,
        tokens_per_s: t.tokens_per_s,
        micro_batch: t.micro_batch,
        accum_steps: t.accum_steps,
        world_size: t.world_size,
        grad_sq_norm: t.grad_sq_norm,
        local_grad_sq_norm: t.local_grad_sq_norm,
        out_of_memory: t.out_of_memory,
    }
}

fn batch_to(b: crate::Batch) -> batch_sizing::Batch {
    batch_sizing::Batch { micro_batch: b.micro_batch, accum_steps: b.accum_steps, lr_scale: b.lr_scale }
}

impl<T: BatchPolicy> batch_sizing::Guest for Adapter<T> {
    fn wants_gradient_stats() -> bool {
        // No error channel in the contract: trap with the message.
        with::<T, _>(|p| Ok(p.wants_gradient_stats())).unwrap_or_else(|e| panic!("wants-gradient-stats: {e}"))
    }
    fn initial(configured: batch_sizing::Batch) -> Result<batch_sizing::Batch, String> {
        let given =
            crate::Batch { micro_batch: configured.micro_batch, accum_steps: configured.accum_steps, lr_scale: configured.lr_scale };
        with::<T, _>(|p| p.initial(given)).map(batch_to)
    }
    fn next(t: types::StepTelemetry) -> Result<batch_sizing::Batch, String> {
        let t = telemetry(t);
        with::<T, _>(|p| p.next(&t)).map(batch_to)
    }
}

impl<T: CheckpointPolicy> tiered_checkpointing::Guest for Adapter<T> {
    fn decide(t: types::StepTelemetry, h: tiered_checkpointing::CheckpointState) -> Result<tiered_checkpointing::TieredDecision, String> {
        let t = telemetry(t);
        let h = CheckpointHistory {
            last_cost_s: h.last_cost_s,
            saved: h.saved,
            failures: h.failures,
            since_last_s: h.since_last_s,
            in_memory: h.in_memory,
            persisting: h.persisting,
            last_stall_s: h.last_stall_s,
            last_persist_s: h.last_persist_s,
            last_slowdown_s: h.last_slowdown_s,
        };
        with::<T, _>(|p| p.decide(&t, &h)).map(|d| tiered_checkpointing::TieredDecision {
            snapshot: d.save,
            persist: d.save && d.persist,
            delete: d.delete,
        })
    }
}
