//! A batch policy exported with `harness_sdk::export!`, through its C entry
//! points.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::{message, FakeHost};
use harness_sdk::abi;
use harness_sdk::{Batch, BatchPolicy, Config, Error, Plugin, Telemetry};

struct Doubling {
    max: u32,
}

impl Plugin for Doubling {
    const NAME: &'static str = "doubling";
    const VERSION: &'static str = "0.1.0";
    fn configure(config: &Config) -> Result<Self, Error> {
        Ok(Doubling { max: config.get_or("max", 8)? })
    }
}

impl BatchPolicy for Doubling {
    fn next(&mut self, t: &Telemetry) -> Result<Batch, Error> {
        if t.grad_sq_norm.is_none() || !t.out_of_memory {
            return Err(Error::new(format!("telemetry lost its fields: {t:?}")));
        }
        Ok(Batch { micro_batch: (t.micro_batch * 2).min(self.max), accum_steps: t.accum_steps, lr_scale: 0.5 })
    }
}

harness_sdk::export!(Doubling as batch_policy);

#[test]
fn initial_defaults_to_the_configured_batch_and_next_sees_telemetry() {
    assert_eq!(harness_plugin_kind(), abi::KIND_BATCH_POLICY);
    let mut host = FakeHost::new(1);
    let table = host.table();
    // SAFETY: the entry points get the live table of a host that outlives
    // them, the handle `harness_plugin_create` returned until it is destroyed,
    // and pointers to locals that outlive each call.
    unsafe {
        let this = harness_plugin_create(&table);
        let mut wants = 7u8;
        assert_eq!(harness_batch_wants_gradient_stats(this, &mut wants), abi::STATUS_ERROR, "before configure");
        let toml = "max = 6";
        assert_eq!(harness_plugin_configure(this, toml.as_ptr(), toml.len()), abi::STATUS_OK);
        // The default: no gradient statistics.
        assert_eq!(harness_batch_wants_gradient_stats(this, &mut wants), abi::STATUS_OK);
        assert_eq!(wants, 0);
        assert_eq!(harness_batch_wants_gradient_stats(this, std::ptr::null_mut()), abi::STATUS_ERROR);
        let configured = abi::Batch { micro_batch: 4, accum_steps: 2, lr_scale: 1.0 };
        let mut out = abi::Batch::default();
        assert_eq!(harness_batch_initial(this, &configured, &mut out), abi::STATUS_OK);
        assert_eq!(out, configured);

        let t = abi::StepTelemetry {
            step: 1,
            micro_batch: 4,
            accum_steps: 2,
            has_grad_sq_norm: 1,
            grad_sq_norm: 0.5,
            out_of_memory: 1,
            ..Default::default()
        };
        assert_eq!(harness_batch_next(this, &t, &mut out), abi::STATUS_OK);
        assert_eq!(out, abi::Batch { micro_batch: 6, accum_steps: 2, lr_scale: 0.5 });

        let t = abi::StepTelemetry { has_grad_sq_norm: 0, ..t };
        assert_eq!(harness_batch_next(this, &t, &mut out), abi::STATUS_ERROR);
        let mut len = 0;
        assert!(message(harness_plugin_last_error(this, &mut len), len).starts_with("telemetry lost its fields"));
        assert_eq!(harness_batch_next(this, &t, std::ptr::null_mut()), abi::STATUS_ERROR);
        harness_plugin_destroy(this);
    }
}
