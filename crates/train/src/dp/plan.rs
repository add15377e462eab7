//! The data-parallel plan: which gradient path an entry takes, decided once,
//! as a value, from what the entry asks for, the switches and what the
//! collective can do ([`DpPlan::new`], a pure function), then carried out by
//! [`super::DataParallel::new`]. Which combinations are legal lives here and
//! nowhere else; the tests go through every combination of the inputs.

use harness_format::switches::Switches;
use harness_runtime::comm::Capabilities;

/// How the optimizer state and gradients are partitioned over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroStage {
    /// Plain DDP: every rank holds everything; gradients are all-reduced by the compressor.
    None,
    /// ZeRO-1: optimizer state is sharded. The full gradient buffers stay
    /// allocated for the whole run, as in DDP.
    One,
    /// ZeRO-2: optimizer state and reduced gradients are sharded: the full
    /// gradient buffers are released right after their reduce-scatter and
    /// allocated again before the next step's first backward pass.
    ///
    /// With the overlap on, each bucket is reduce-scattered from the
    /// gradient hooks as soon as its gradients are complete, beside the rest
    /// of the backward pass; the buffers are released after the pass, behind
    /// the wait for those collectives. So the full local gradient still
    /// exists from the first backward pass of a step to the end of the last,
    /// and the peak of the backward pass is the same as with stage 1. What
    /// stage 2 saves over stage 1 is the full gradient buffers during the
    /// optimizer step, the parameter all-gather, evaluation and the next
    /// step's forward pass.
    Two,
}

impl ZeroStage {
    /// The stage of a suite's `zero` key (0, 1 or 2).
    pub fn from_level(level: u8) -> anyhow::Result<ZeroStage> {
        Ok(match level {
            0 => ZeroStage::None,
            1 => ZeroStage::One,
            2 => ZeroStage::Two,
            other => anyhow::bail!("ZeRO stage {other} does not exist (0, 1 or 2)"),
        })
    }

    pub(super) fn sharded(self) -> bool {
        self != ZeroStage::None
    }
}

/// The `HARNESS_*` switches that shape the data-parallel path (see
/// [`Switches`] for each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Levers {
    /// `HARNESS_OVERLAP`.
    pub overlap: bool,
    /// `HARNESS_LOCAL_GRADS`.
    pub local_grads: bool,
    /// `HARNESS_CE_GATHER`: unset, forced on or off.
    pub ce_gather: Option<bool>,
    /// `HARNESS_SYM_SCATTER`.
    pub sym_scatter: bool,
    /// `HARNESS_UNZEROED_GRADS`.
    pub unzeroed_grads: bool,
    /// `HARNESS_ZERO_PREFETCH`.
    pub zero_prefetch: bool,
}

impl Levers {
    pub fn of(s: &Switches) -> Levers {
        Levers {
            overlap: s.overlap,
            local_grads: s.local_grads,
            ce_gather: s.ce_gather,
            sym_scatter: s.sym_scatter,
            unzeroed_grads: s.unzeroed_grads,
            zero_prefetch: s.zero_prefetch,
        }
    }
}

/// What the plan is made from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// Ranks.
    pub world: usize,
    /// The ranks train on CUDA GPUs.
    pub cuda: bool,
    /// The strategy's `zero`.
    pub zero: ZeroStage,
    /// The compressor is the built-in average (`allreduce`), not a plugin.
    pub plain_average: bool,
    /// The strategy's `reduce_dtype = "bf16"`.
    pub reduce_bf16: bool,
    /// The strategy may gather on the copy engines: the built-in fp32
    /// average over NCCL's own transport, no emulated link
    /// ([`harness_format::suite::Strategy::copy_engine_gather_candidate`]).
    pub ce_candidate: bool,
    /// The batch policy reads gradient statistics (the local gradient's
    /// norm before the average).
    pub grad_stats: bool,
    /// The emulated out-of-memory limit has the ranks agree on each step
    /// before reducing.
    pub oom_agree: bool,
    /// What the collective can do.
    pub comm: Capabilities,
    pub levers: Levers,
}

/// With ZeRO, the updated parameters' all-gather beside the next forward
/// pass (`HARNESS_ZERO_PREFETCH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    /// From parameter buffers in the collective's symmetric memory (on the
    /// copy engines under NCCL's zero-CTA policy; plain memory on the CPU's
    /// thread ranks), else from the buffers as they are, on the SMs.
    pub symmetric: bool,
}

/// The gradient path: where the gradients live and how they are averaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gradients {
    /// Autograd's own gradients (as `zero_grad(set_to_none=True)`): one rank
    /// reduces nothing; several average each bucket's gradients in place,
    /// as one group, beside the backward pass, in fp32 or, with
    /// `reduce_bf16`, in bf16.
    Local { reduce_bf16: bool },
    /// Flat buffers, each parameter's gradient a view of its bucket's:
    /// handed to the compressor after the backward pass, or (`overlapped`,
    /// the built-in average) each bucket summed beside it and divided after.
    Flat { overlapped: bool },
    /// Flat buffers in the collective's symmetric memory, each bucket
    /// averaged beside the backward pass as a reduce-scatter and an
    /// all-gather (which NCCL runs on the copy engines under its zero-CTA
    /// policy).
    Split,
    /// ZeRO: each bucket reduce-scattered into this rank's shard
    /// (`overlapped`: beside the backward pass), the shard updated, the
    /// parameters all-gathered.
    Sharded {
        stage: ZeroStage,
        overlapped: bool,
        /// ZeRO-1's gradient buffers in symmetric memory, reduce-scattered
        /// in place (`HARNESS_SYM_SCATTER`).
        symmetric_grads: bool,
        prefetch: Option<Prefetch>,
    },
}

/// An entry's data-parallel path ([`DpPlan::new`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DpPlan {
    pub gradients: Gradients,
    /// Flat buffers that the fused layers write whole are left unzeroed at
    /// a step's start (`HARNESS_UNZEROED_GRADS`; overlapped flat buffers
    /// only).
    pub unzeroed: bool,
    /// The batch policy gets gradient statistics (not under ZeRO).
    pub grad_stats: bool,
    /// What was asked for and cannot be had, for the entry's warnings.
    pub warnings: Vec<String>,
}

impl DpPlan {
    /// The plan for `ask`: an error for what cannot run at all (ZeRO on one
    /// rank, a bf16 average without the path that does it).
    pub fn new(ask: &Ask) -> anyhow::Result<DpPlan> {
        let Ask { world, cuda, zero, plain_average, reduce_bf16, ce_candidate, grad_stats, oom_agree, comm, levers } = *ask;
        anyhow::ensure!(world >= 1, "a world of no ranks");
        anyhow::ensure!(world >= 2 || zero == ZeroStage::None, "ZeRO needs world >= 2");
        let sharded = zero != ZeroStage::None;
        let several = world > 1;
        // The copy engines between the ranks: CUDA GPUs that all reach each
        // other's memory under NCCL's zero-CTA policy, and a strategy that
        // may gather there.
        let copy_engines = several && cuda && ce_candidate && comm.copy_engines;
        let grad_stats = grad_stats && !sharded;
        // The built-in reduction overlaps the backward pass where the
        // collective runs beside it and nothing needs the local gradient
        // after the pass.
        let overlapped = several && comm.overlap && levers.overlap && !grad_stats && !oom_agree && plain_average;
        let mut warnings = Vec::new();
        let gradients = if sharded {
            // ZeRO's symmetric buffers: where the copy engines gather, and on
            // the CPU's thread ranks (plain memory, so that the path runs there).
            let symmetric_here = comm.symmetric_memory && (!cuda || copy_engines);
            let prefetch = (comm.overlap && levers.zero_prefetch).then_some(Prefetch { symmetric: symmetric_here });
            let symmetric_grads = zero == ZeroStage::One && overlapped && levers.sym_scatter && symmetric_here;
            Gradients::Sharded { stage: zero, overlapped, symmetric_grads, prefetch }
        } else if overlapped
            && comm.symmetric_memory
            && (levers.ce_gather == Some(true) || (levers.ce_gather.is_none() && levers.local_grads && copy_engines))
        {
            Gradients::Split
        } else if levers.local_grads && !(levers.ce_gather == Some(true) && several) && plain_average && (overlapped || !several) {
            Gradients::Local { reduce_bf16: reduce_bf16 && several }
        } else {
            Gradients::Flat { overlapped }
        };
        if levers.ce_gather == Some(true) && several && gradients != Gradients::Split {
            warnings.push(
                "HARNESS_CE_GATHER=1: the gradients stay in plain flat buffers, all-reduced (it needs the overlapped built-in \
                 all-reduce without ZeRO, and NCCL 2.27 or later with symmetric memory)"
                    .to_owned(),
            );
        }
        if reduce_bf16 && several && !matches!(gradients, Gradients::Local { .. }) {
            anyhow::bail!(
                "`reduce_dtype = \"bf16\"` needs the all-reduce that overlaps the backward pass with autograd's own gradients, \
                 which is off here (HARNESS_OVERLAP=0, HARNESS_LOCAL_GRADS=0, a batch policy that reads gradient statistics, or \
                 an emulated out-of-memory limit)"
            );
        }
        let flat_overlapped = match gradients {
            Gradients::Local { .. } => false,
            Gradients::Flat { overlapped } | Gradients::Sharded { overlapped, .. } => overlapped,
            Gradients::Split => true,
        };
        Ok(DpPlan { gradients, unzeroed: levers.unzeroed_grads && flat_overlapped, grad_stats, warnings })
    }

    /// How optimizer state and gradients are partitioned.
    pub fn stage(&self) -> ZeroStage {
        match self.gradients {
            Gradients::Sharded { stage, .. } => stage,
            _ => ZeroStage::None,
        }
    }

    /// Whether the built-in reduction overlaps the backward pass.
    pub fn overlapped(&self, world: usize) -> bool {
        match self.gradients {
            Gradients::Local { .. } => world > 1,
            Gradients::Flat { overlapped } | Gradients::Sharded { overlapped, .. } => overlapped,
            Gradients::Split => true,
        }
    }

    /// Whether the gradients are autograd's own.
    pub fn local(&self) -> bool {
        matches!(self.gradients, Gradients::Local { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every value of every input.
    fn every_ask() -> Vec<Ask> {
        let bools = [false, true];
        let mut all = Vec::new();
        for world in [1, 2, 4] {
            for cuda in bools {
                for zero in [ZeroStage::None, ZeroStage::One, ZeroStage::Two] {
                    for bits in 0u32..(1 << 8) {
                        let b = |i: u32| bits & (1 << i) != 0;
                        for lever_bits in 0u32..(1 << 5) {
                            let l = |i: u32| lever_bits & (1 << i) != 0;
                            for ce_gather in [None, Some(false), Some(true)] {
                                all.push(Ask {
                                    world,
                                    cuda,
                                    zero,
                                    plain_average: b(0),
                                    reduce_bf16: b(1),
                                    ce_candidate: b(2),
                                    grad_stats: b(3),
                                    oom_agree: b(4),
                                    comm: Capabilities { overlap: b(5), symmetric_memory: b(6), copy_engines: b(7) },
                                    levers: Levers {
                                        overlap: l(0),
                                        local_grads: l(1),
                                        ce_gather,
                                        sym_scatter: l(2),
                                        unzeroed_grads: l(3),
                                        zero_prefetch: l(4),
                                    },
                                });
                            }
                        }
                    }
                }
            }
        }
        all
    }

    /// The decisions as `Training::new` took them up to 2026-11-29, by
    /// mutators called in a fixed order on a `DataParallel` (each returning
    /// whether it applied): the reference the plan must agree with. Some
    /// for a plan, None for an error.
    fn by_the_old_mutators(a: &Ask) -> Option<(Gradients, bool, bool, usize)> {
        let (world, several) = (a.world, a.world > 1);
        let sharded = a.zero != ZeroStage::None;
        if !several && sharded {
            return None;
        }
        let lv = a.levers;
        let copy_engines_between_ranks = several && a.cuda && a.ce_candidate && a.comm.copy_engines;
        // prefetch
        let prefetch = sharded && several && a.comm.overlap && lv.zero_prefetch;
        let sym_params = prefetch && (!a.cuda || copy_engines_between_ranks) && a.comm.symmetric_memory;
        let grad_stats = a.grad_stats && !sharded;
        let overlap_allowed = lv.overlap && !grad_stats && !a.oom_agree;
        // enable_overlap: world >= 2 and a collective that runs beside.
        let overlapped = overlap_allowed && a.plain_average && world >= 2 && a.comm.overlap;
        let forced = lv.ce_gather == Some(true) && several;
        let wanted = forced || (lv.ce_gather.is_none() && lv.local_grads && a.zero == ZeroStage::None && copy_engines_between_ranks);
        // use_symmetric_buffers: overlap, not sharded, not local (yet), symmetric memory.
        let symmetric = wanted && overlapped && !sharded && a.comm.symmetric_memory;
        let local_allowed = lv.local_grads && !symmetric && !forced;
        // use_local_grads: not sharded, the plain average, (world > 1) == overlap.
        let local = local_allowed && !sharded && a.plain_average && (several == overlapped);
        // use_symmetric_zero_grads: ZeRO-1, not local, overlap, symmetric memory.
        let zero_sym = lv.sym_scatter
            && overlapped
            && (!a.cuda || copy_engines_between_ranks)
            && a.zero == ZeroStage::One
            && !local
            && a.comm.symmetric_memory;
        // use_stale_buffers: overlap, not local.
        let stale = lv.unzeroed_grads && overlapped && !local;
        // reduce_in: one rank reduces nothing; else overlap, local, not sharded.
        if a.reduce_bf16 && several && !(overlapped && local && !sharded) {
            return None;
        }
        let gradients = if sharded {
            Gradients::Sharded {
                stage: a.zero,
                overlapped,
                symmetric_grads: zero_sym,
                prefetch: prefetch.then_some(Prefetch { symmetric: sym_params }),
            }
        } else if symmetric {
            Gradients::Split
        } else if local {
            Gradients::Local { reduce_bf16: a.reduce_bf16 && several }
        } else {
            Gradients::Flat { overlapped }
        };
        let warnings = usize::from(forced && !symmetric);
        Some((gradients, stale, grad_stats, warnings))
    }

    #[test]
    fn the_plan_takes_the_old_mutators_decisions_for_every_combination() {
        let all = every_ask();
        assert_eq!(all.len(), 3 * 2 * 3 * 256 * 32 * 3);
        for a in &all {
            let plan = DpPlan::new(a).ok();
            let got = plan.as_ref().map(|p| (p.gradients, p.unzeroed, p.grad_stats, p.warnings.len()));
            assert_eq!(got, by_the_old_mutators(a), "{a:?}");
        }
    }

    #[test]
    fn every_plan_keeps_the_rules_of_its_path() {
        for a in every_ask() {
            let Ok(p) = DpPlan::new(&a) else {
                // Only ZeRO on one rank, and a bf16 average off its path, are refused.
                assert!((a.world == 1 && a.zero != ZeroStage::None) || (a.reduce_bf16 && a.world > 1), "{a:?}");
                continue;
            };
            let overlapped = p.overlapped(a.world);
            // Overlap needs several ranks, a collective that runs beside the
            // computation, the built-in average, and nothing that reads the
            // local gradient after the pass.
            if overlapped {
                assert!(a.world > 1 && a.comm.overlap && a.levers.overlap && a.plain_average, "{a:?}");
                assert!(!p.grad_stats && !a.oom_agree, "{a:?}");
            }
            // A plugin compressor always gets flat buffers after the pass.
            if !a.plain_average && a.zero == ZeroStage::None {
                assert_eq!(p.gradients, Gradients::Flat { overlapped: false }, "{a:?}");
            }
            match p.gradients {
                Gradients::Split => assert!(a.comm.symmetric_memory && a.levers.ce_gather != Some(false), "{a:?}"),
                Gradients::Local { reduce_bf16 } => {
                    assert!(a.levers.local_grads && (a.levers.ce_gather != Some(true) || a.world == 1), "{a:?}");
                    assert!(!reduce_bf16 || a.world > 1, "{a:?}");
                }
                Gradients::Sharded { symmetric_grads, prefetch, stage, .. } => {
                    assert!(a.world > 1 && stage == a.zero, "{a:?}");
                    assert!(!symmetric_grads || (stage == ZeroStage::One && a.comm.symmetric_memory), "{a:?}");
                    assert!(prefetch.is_none_or(|f| !f.symmetric || a.comm.symmetric_memory), "{a:?}");
                    assert!(!p.grad_stats, "{a:?}");
                }
                Gradients::Flat { .. } => {}
            }
            assert!(!p.unzeroed || (overlapped && !p.local()), "{a:?}");
            assert_eq!(p.stage(), a.zero, "{a:?}");
        }
    }

    /// The defaults' paths, as a reader checks them.
    #[test]
    fn the_default_paths() {
        let levers = Levers::of(&Switches::DEFAULT);
        let nccl = Capabilities { overlap: true, symmetric_memory: true, copy_engines: true };
        let threads = Capabilities { overlap: true, symmetric_memory: true, copy_engines: false };
        let ask = |world, cuda, zero, plain_average, comm| Ask {
            world,
            cuda,
            zero,
            plain_average,
            reduce_bf16: false,
            ce_candidate: plain_average,
            grad_stats: false,
            oom_agree: false,
            comm,
            levers,
        };
        let plan = |a: Ask| DpPlan::new(&a).unwrap();
        let symmetric_prefetch = Some(Prefetch { symmetric: true });
        let table = [
            // One GPU: autograd's gradients, nothing to reduce.
            (ask(1, true, ZeroStage::None, true, Capabilities::default()), Gradients::Local { reduce_bf16: false }, false),
            // A compressor plugin on one GPU still gets its buckets.
            (ask(1, true, ZeroStage::None, false, Capabilities::default()), Gradients::Flat { overlapped: false }, false),
            // Several GPUs of one host under harness: the copy engines' gather.
            (ask(2, true, ZeroStage::None, true, nccl), Gradients::Split, true),
            // Ranks started by torchrun (no zero-CTA policy): autograd's gradients all-reduced.
            (
                ask(2, true, ZeroStage::None, true, Capabilities { copy_engines: false, ..nccl }),
                Gradients::Local { reduce_bf16: false },
                false,
            ),
            // A compressor plugin on several GPUs: flat buffers after the pass.
            (ask(4, true, ZeroStage::None, false, nccl), Gradients::Flat { overlapped: false }, false),
            // ZeRO-1 and ZeRO-2 on GPUs.
            (
                ask(2, true, ZeroStage::One, true, nccl),
                Gradients::Sharded { stage: ZeroStage::One, overlapped: true, symmetric_grads: true, prefetch: symmetric_prefetch },
                true,
            ),
            (
                ask(2, true, ZeroStage::Two, true, nccl),
                Gradients::Sharded { stage: ZeroStage::Two, overlapped: true, symmetric_grads: false, prefetch: symmetric_prefetch },
                true,
            ),
            // The CPU's thread ranks.
            (ask(2, false, ZeroStage::None, true, threads), Gradients::Local { reduce_bf16: false }, false),
            (
                ask(2, false, ZeroStage::One, true, threads),
                Gradients::Sharded { stage: ZeroStage::One, overlapped: true, symmetric_grads: true, prefetch: symmetric_prefetch },
                true,
            ),
            // An emulated link: no overlap, so flat buffers and no prefetch.
            (ask(2, true, ZeroStage::None, true, Capabilities { overlap: false, ..nccl }), Gradients::Flat { overlapped: false }, false),
        ];
        for (a, gradients, unzeroed) in table {
            let p = plan(a);
            assert_eq!((p.gradients, p.unzeroed), (gradients, unzeroed), "{a:?}");
            assert!(p.warnings.is_empty(), "{a:?}: {:?}", p.warnings);
        }
    }
}
