//! The batch and checkpoint policies' checks: sessions on synthetic
//! telemetry (and a checkpoint history that follows the decisions), and
//! what is compared between them.

use std::ops::Range;

use anyhow::{Context, Result};

use super::{Check, Kit, NOT_RUN, POLICY_SAVE_AFTER, POLICY_STEPS};
use crate::plugin::{Kind, PluginBatch, PluginCheckpoint};
use crate::strategy::{BatchDecision, BatchPolicy, CheckpointHistory, CheckpointPolicy, StepTelemetry};
use harness_format::fmt::counted;

impl Kit {
    /// A policy's checks: determinism and the state round trip.
    pub(super) fn policy_checks(&self) -> Vec<Check> {
        let all = 0..POLICY_STEPS;
        let a = self.policy_session(all.clone(), None, false).map_err(|e| self.message(&format!("{e:#}")));
        let b = self.policy_session(all, None, false).map_err(|e| self.message(&format!("{e:#}")));
        let determinism = match (&a, &b) {
            (Err(e), _) | (_, Err(e)) => Check::fail("determinism", e.clone()),
            (Ok(a), Ok(b)) if a.initial != b.initial => Check::fail(
                "determinism",
                format!(
                    "two fresh instances chose different initial batches: {} then {}",
                    a.initial.as_deref().unwrap_or("-"),
                    b.initial.as_deref().unwrap_or("-")
                ),
            ),
            (Ok(a), Ok(b)) => match first_decision_difference(&a.decisions, &b.decisions, ["first instance", "second instance"]) {
                None => Check::pass(
                    "determinism",
                    format!("two fresh instances decided alike at each of {POLICY_STEPS} steps ({})", a.summary()),
                ),
                Some(d) => Check::fail("determinism", format!("two fresh instances decided differently: {d}")),
            },
        };
        let k = POLICY_SAVE_AFTER;
        let state = (|| -> Result<Check, String> {
            let Ok(a) = a.as_ref() else {
                return Ok(Check::fail("state save/load", NOT_RUN));
            };
            let saved = self.policy_session(0..k, None, true).map_err(|e| self.message(&format!("{e:#}")))?;
            let host = saved.hosts.last().cloned().expect("steps before the save");
            let resumed =
                self.policy_session(k..POLICY_STEPS, Some((&saved.state, host)), false).map_err(|e| self.message(&format!("{e:#}")))?;
            let what = match saved.state.len() {
                0 => "no state, 0 bytes".to_owned(),
                b => format!("{b} bytes"),
            };
            Ok(match first_decision_difference(&a.decisions[k as usize..], &resumed.decisions, ["uninterrupted", "resumed"]) {
                None => Check::pass(
                    "state save/load",
                    format!(
                        "saved after step {k} ({what}), loaded into a fresh instance: steps {}..{POLICY_STEPS} decided as uninterrupted",
                        k + 1
                    ),
                ),
                Some(d) => Check::fail(
                    "state save/load",
                    format!(
                        "saved after step {k} ({what}) and loaded into a fresh instance, it decided otherwise: {d}{}",
                        if saved.state.is_empty() { " (what it keeps across calls must be in state-save)" } else { "" }
                    ),
                ),
            })
        })()
        .unwrap_or_else(|e| Check::fail("state save/load", e));
        vec![determinism, state]
    }

    /// A fresh policy instance over `steps` of synthetic telemetry,
    /// starting from a saved state and the host's side at that point when
    /// given, as a resumed run does (a batch policy is asked for its
    /// initial batch first, as at every start).
    fn policy_session(&self, steps: Range<u64>, resume: Option<(&[u8], Host)>, save: bool) -> Result<PolicyRun> {
        let plugin = self.configure(&self.config)?;
        let mut run = PolicyRun::default();
        let world = self.ranks as u32;
        match self.kind {
            Kind::BatchPolicy => {
                let mut p = PluginBatch { plugin };
                let stats = p.wants_gradient_stats()?;
                let mut last = p.initial(CONFIGURED_BATCH)?;
                run.initial = Some(format!("{last:?}"));
                if let Some((state, host)) = resume {
                    p.plugin.state_load(state)?;
                    if let Host::Batch(b) = host {
                        last = b;
                    }
                }
                for step in steps {
                    let t = batch_telemetry(step, last, world, stats);
                    last = p.next(&t).with_context(|| format!("step {}", t.step))?;
                    run.decisions.push((format!("step {}", t.step), format!("{last:?}")));
                    run.hosts.push(Host::Batch(last));
                }
                if save {
                    run.state = p.plugin.state_save()?;
                }
            }
            Kind::CheckpointPolicy => {
                let mut p = PluginCheckpoint { plugin };
                let (mut h, mut last_save) = (CheckpointHistory::default(), 0);
                if let Some((state, host)) = resume {
                    p.plugin.state_load(state)?;
                    if let Host::Checkpoint(history, at) = host {
                        (h, last_save) = (history, at);
                    }
                }
                for step in steps {
                    let s = step + 1;
                    let t = checkpoint_telemetry(s, world);
                    h.since_last_s = (s - last_save) as f64 * STEP_S;
                    if s == FAILURE_AT {
                        h.failures.push(s);
                    }
                    let d = p.decide(&t, &h).with_context(|| format!("step {s}"))?;
                    if d.save {
                        run.snapshots += 1;
                        run.persisted += usize::from(d.persist);
                        (h.in_memory, last_save) = (vec![s], s);
                        (h.last_cost_s, h.last_stall_s) = (Some(0.05), Some(0.02));
                        if d.persist {
                            h.saved.push(s);
                            (h.last_persist_s, h.last_slowdown_s) = (Some(0.04), Some(0.01));
                        }
                    }
                    h.saved.retain(|x| !d.delete.contains(x));
                    run.decisions.push((format!("step {s}"), format!("{d:?}")));
                    run.hosts.push(Host::Checkpoint(h.clone(), last_save));
                }
                if save {
                    run.state = p.plugin.state_save()?;
                }
            }
            Kind::Compressor => unreachable!("compressors run in compress_session"),
        }
        Ok(run)
    }
}

/// The batch a policy is told the workload configures.
const CONFIGURED_BATCH: BatchDecision = BatchDecision { micro_batch: 8, accum_steps: 1, lr_scale: 1.0 };
/// Seconds of a synthetic step (per sample of the micro-batch, for a batch policy).
const STEP_S: f64 = 0.1;
/// The step at which the checkpoint policy's history records a failure.
const FAILURE_AT: u64 = 60;
const GIB: u64 = 1 << 30;

/// The host's side of a policy session after a step: what a resumed run
/// restores next to the plugin's state.
#[derive(Debug, Clone)]
enum Host {
    /// The batch in force.
    Batch(BatchDecision),
    /// The history and the step of the last snapshot.
    Checkpoint(CheckpointHistory, u64),
}

/// What a policy session decided.
#[derive(Debug, Default)]
struct PolicyRun {
    /// A batch policy's initial batch.
    initial: Option<String>,
    /// (when, the decision) at each step, in order.
    decisions: Vec<(String, String)>,
    /// The host's side after each step.
    hosts: Vec<Host>,
    /// A checkpoint policy's snapshots, and those also persisted.
    snapshots: usize,
    persisted: usize,
    state: Vec<u8>,
}

impl PolicyRun {
    /// What the decisions amount to: how often the batch changed, or how
    /// many snapshots were taken.
    fn summary(&self) -> String {
        let changes = self.decisions.windows(2).filter(|w| w[0].1 != w[1].1).count();
        match self.initial {
            Some(_) => format!("the batch changed {}", counted(changes, "time", "times")),
            None => format!("{} snapshots, {} of them persisted", self.snapshots, self.persisted),
        }
    }
}

/// The first decision where `a` and `b` differ.
fn first_decision_difference(a: &[(String, String)], b: &[(String, String)], labels: [&str; 2]) -> Option<String> {
    if let Some(((when, x), (_, y))) = a.iter().zip(b).find(|(x, y)| x != y) {
        let [l0, l1] = labels;
        return Some(format!("at {when}: {l0} {x}, {l1} {y}"));
    }
    (a.len() != b.len()).then(|| format!("{} {} decisions, {} {}", labels[0], a.len(), labels[1], b.len()))
}

/// The telemetry of step `step` (0-based) under the batch `b`: a loss
/// falling towards 1, a step time and memory growing with the batch, and
/// (when asked for) gradient norms that wander.
fn batch_telemetry(step: u64, b: BatchDecision, world: u32, stats: bool) -> StepTelemetry {
    let s = step + 1;
    let samples = f64::from(b.micro_batch) * f64::from(b.accum_steps);
    let step_time_s = 0.01 + STEP_S * samples / 8.0;
    let x = s as f64;
    StepTelemetry {
        step: s,
        loss: 1.0 + 3.0 * (-x / 50.0).exp(),
        step_time_s,
        elapsed_s: x * STEP_S,
        memory_used_bytes: (2 * GIB + u64::from(b.micro_batch) * (GIB / 4)).min(16 * GIB),
        memory_total_bytes: 16 * GIB,
        tokens_per_s: samples * 1024.0 / step_time_s,
        micro_batch: b.micro_batch,
        accum_steps: b.accum_steps,
        world_size: world,
        grad_sq_norm: stats.then(|| 1.0 + 0.25 * (x * 0.7).sin()),
        local_grad_sq_norm: stats.then(|| 3.0 + 0.5 * (x * 0.3).cos()),
        out_of_memory: false,
    }
}

/// The telemetry after `s` steps of a fixed batch.
fn checkpoint_telemetry(s: u64, world: u32) -> StepTelemetry {
    let x = s as f64;
    StepTelemetry {
        step: s,
        loss: 1.0 + 3.0 * (-x / 50.0).exp(),
        step_time_s: STEP_S,
        elapsed_s: x * STEP_S,
        memory_used_bytes: 4 * GIB,
        memory_total_bytes: 16 * GIB,
        tokens_per_s: 8.0 * 1024.0 / STEP_S,
        micro_batch: 8,
        accum_steps: 1,
        world_size: world,
        ..Default::default()
    }
}
