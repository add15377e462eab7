//! A checkpoint policy exported with `harness_sdk::export!`, through its C
//! entry points.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::{message, FakeHost};
use harness_sdk::abi;
use harness_sdk::{CheckpointHistory, CheckpointPolicy, Config, Decision, Error, Plugin, Telemetry};

/// Saves every `every` steps, keeps the last `keep`; with `greedy`, deletes
/// more than exist.
struct KeepLast {
    every: u64,
    keep: usize,
    greedy: bool,
}

impl Plugin for KeepLast {
    const NAME: &'static str = "keep-last";
    const VERSION: &'static str = "0.1.0";
    fn configure(config: &Config) -> Result<Self, Error> {
        Ok(KeepLast { every: config.get_or("every", 2)?, keep: config.get_or("keep", 2)?, greedy: config.get_or("greedy", false)? })
    }
}

impl CheckpointPolicy for KeepLast {
    fn decide(&mut self, t: &Telemetry, h: &CheckpointHistory) -> Result<Decision, Error> {
        assert_eq!(h.last_cost_s, Some(1.5));
        assert_eq!(h.failures, vec![3]);
        let mut delete: Vec<u64> = h.saved.iter().rev().skip(self.keep).copied().collect();
        if self.greedy {
            delete.extend(&h.saved);
        }
        // Every second snapshot is persisted (contract 0.1.1; the 0.1.0 entry
        // point persists them all). The tiers' state arrives as sent.
        assert!(h.in_memory.is_empty() || h.in_memory == vec![7]);
        assert!(h.persisting.is_none() || (h.persisting == Some(7) && h.last_stall_s == Some(0.25)));
        Ok(Decision { save: t.step % self.every == 0, persist: t.step % (2 * self.every) == 0, delete })
    }
}

harness_sdk::export!(KeepLast as checkpoint_policy);

fn decide(config: &str, step: u64, saved: &[u64]) -> (i32, abi::Decision, Vec<u64>, String) {
    let mut host = FakeHost::new(1);
    let table = host.table();
    let failures = [3u64];
    let mut room = vec![0u64; saved.len()];
    // SAFETY: the entry points get the live table of a host that outlives
    // them, the handle `harness_plugin_create` returned until it is destroyed,
    // and pointers to locals that outlive each call (`room` has a slot for
    // every saved step the policy may delete).
    unsafe {
        let this = harness_plugin_create(&table);
        assert_eq!(harness_plugin_configure(this, config.as_ptr(), config.len()), abi::STATUS_OK);
        let t = abi::StepTelemetry { step, ..Default::default() };
        let h = abi::CheckpointHistory {
            has_last_cost_s: 1,
            last_cost_s: 1.5,
            saved: saved.as_ptr(),
            n_saved: saved.len(),
            failures: failures.as_ptr(),
            n_failures: 1,
            since_last_s: 10.0,
        };
        let mut out = abi::Decision { save: 0, delete_steps: room.as_mut_ptr(), n_delete: 0 };
        let status = harness_checkpoint_decide(this, &t, &h, &mut out);
        let mut len = 0;
        let error = message(harness_plugin_last_error(this, &mut len), len);
        harness_plugin_destroy(this);
        let deleted = room[..out.n_delete].to_vec();
        (status, out, deleted, error)
    }
}

#[test]
fn the_tiered_entry_point_carries_the_tiers_both_ways() {
    let mut host = FakeHost::new(1);
    let table = host.table();
    let (failures, saved, in_memory) = ([3u64], [1u64, 2, 3], [7u64]);
    let mut room = vec![0u64; saved.len()];
    for (step, save, persist) in [(4u64, 1u8, 1u8), (2, 1, 0), (3, 0, 0)] {
        // SAFETY: as in `decide`: a live table, the handle until it is
        // destroyed, pointers to locals that outlive each call.
        unsafe {
            let this = harness_plugin_create(&table);
            assert_eq!(harness_plugin_configure(this, "".as_ptr(), 0), abi::STATUS_OK);
            let t = abi::StepTelemetry { step, ..Default::default() };
            let h = abi::TieredHistory {
                base: abi::CheckpointHistory {
                    has_last_cost_s: 1,
                    last_cost_s: 1.5,
                    saved: saved.as_ptr(),
                    n_saved: saved.len(),
                    failures: failures.as_ptr(),
                    n_failures: 1,
                    since_last_s: 10.0,
                },
                in_memory: in_memory.as_ptr(),
                n_in_memory: 1,
                has_persisting: 1,
                persisting: 7,
                has_last_stall_s: 1,
                last_stall_s: 0.25,
                has_last_persist_s: 0,
                last_persist_s: 0.0,
                has_last_slowdown_s: 0,
                last_slowdown_s: 0.0,
            };
            let mut out = abi::TieredDecision { base: abi::Decision { save: 0, delete_steps: room.as_mut_ptr(), n_delete: 0 }, persist: 9 };
            assert_eq!(harness_checkpoint_decide_tiered(this, &t, &h, &mut out), abi::STATUS_OK, "step {step}");
            assert_eq!((out.base.save, out.persist), (save, persist), "step {step}");
            assert_eq!(room[..out.base.n_delete], [1]);
            harness_plugin_destroy(this);
        }
    }
}

#[test]
fn decisions_come_back_through_the_hosts_buffer() {
    assert_eq!(harness_plugin_kind(), abi::KIND_CHECKPOINT_POLICY);
    let (status, out, deleted, _) = decide("", 4, &[1, 2, 3]);
    assert_eq!(status, abi::STATUS_OK);
    assert_eq!(out.save, 1);
    assert_eq!(deleted, vec![1]);
    let (status, out, deleted, _) = decide("", 5, &[]);
    assert_eq!((status, out.save, deleted), (abi::STATUS_OK, 0, vec![]));
}

#[test]
fn deleting_more_than_is_saved_is_an_error() {
    let (status, _, _, error) = decide("greedy = true", 4, &[1, 2, 3]);
    assert_eq!(status, abi::STATUS_ERROR);
    assert_eq!(error, "the decision deletes 4 checkpoints but only 3 are saved");
}
