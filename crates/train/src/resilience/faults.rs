//! Injected failures: when they strike ([`FaultClock`]) and what they may
//! cost before the entry ends instead of restarting ([`FaultBudget`]).

use std::collections::{BTreeSet, VecDeque};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use harness_format::suite::FaultSpec;

/// When injected failures strike, and which of them lose host memory.
pub struct FaultClock {
    /// Listed steps that have not struck yet (each strikes once).
    at_steps: BTreeSet<u64>,
    /// Random failures: the mean time between them, the generator and the
    /// training time of the next one.
    pub(super) random: Option<(f64, ChaCha8Rng, f64)>,
    /// The share of failures that lose host memory, and its generator.
    lose: Option<(f64, ChaCha8Rng)>,
}

impl FaultClock {
    /// The clock of `spec`. Random draws happen on rank 0 only (the ranks
    /// then agree through a collective); listed steps strike on every rank.
    pub fn new(spec: &FaultSpec, entry_seed: u64, rank: usize) -> FaultClock {
        let seed = spec.seed.unwrap_or(entry_seed);
        let random = spec.mtbf_s.filter(|_| rank == 0).map(|mtbf| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xfa11_0fa1);
            let first = exponential(&mut rng, mtbf);
            (mtbf, rng, first)
        });
        let lose = spec.lose_memory.filter(|&p| rank == 0 && p > 0.0).map(|p| (p, ChaCha8Rng::seed_from_u64(seed ^ 0x10_5e_4e_40)));
        FaultClock { at_steps: spec.at_steps.iter().copied().collect(), random, lose }
    }

    /// Whether a failure strikes now, with `done` steps completed after
    /// `elapsed_s` seconds of training, and whether it loses host memory.
    pub fn strikes(&mut self, done: u64, elapsed_s: f64) -> (bool, bool) {
        let listed = self.at_steps.remove(&done);
        let random = match &mut self.random {
            Some((mtbf, rng, next)) if elapsed_s >= *next => {
                *next = elapsed_s + exponential(rng, *mtbf);
                true
            }
            _ => false,
        };
        let fail = listed || random;
        let lose = fail && self.lose.as_mut().is_some_and(|(p, rng)| rng.random::<f64>() < *p);
        (fail, lose)
    }
}

/// An exponentially distributed time with mean `mean`.
fn exponential(rng: &mut ChaCha8Rng, mean: f64) -> f64 {
    -(1.0 - rng.random::<f64>()).ln() * mean
}

/// Which fault budget a failure overran.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// `faults.max_restarts`.
    Restarts,
    /// `faults.max_time_lost_ratio`.
    TimeLost,
}

impl Budget {
    /// As a number the ranks agree on (0: none).
    pub(super) fn code(self) -> f32 {
        match self {
            Budget::Restarts => 1.0,
            Budget::TimeLost => 2.0,
        }
    }

    pub(super) fn of_code(x: f32) -> Option<Budget> {
        match x.round() as i32 {
            1 => Some(Budget::Restarts),
            2 => Some(Budget::TimeLost),
            _ => None,
        }
    }
}

/// Recent steps the failure-free training time is estimated from.
const STEP_WINDOW: usize = 32;

/// What injected failures may cost an entry before it ends, failed,
/// instead of restarting (`faults.max_restarts`,
/// `faults.max_time_lost_ratio`): failures more frequent than the entry
/// can checkpoint (or finish, without checkpoints) would otherwise restart
/// it for ever. Time lost is weighed against the entry's own failure-free
/// training time, so the budget scales with the entry: its planned steps
/// at its median step time (steps between decisions on the training
/// clock, measured as it trains, restores left out), or its time budget,
/// whichever is shorter.
pub struct FaultBudget {
    max_restarts: u64,
    max_ratio: f64,
    steps: Option<u64>,
    time_budget_s: Option<f64>,
    /// Recent step times, seconds.
    recent: VecDeque<f64>,
    /// The training time of the last decision or restore.
    last_s: f64,
}

impl FaultBudget {
    /// The budget of `spec` for an entry of `steps` steps or a time budget
    /// of `time_budget_s` seconds.
    pub fn new(spec: &FaultSpec, steps: Option<u64>, time_budget_s: Option<f64>) -> FaultBudget {
        FaultBudget {
            max_restarts: spec.max_restarts(),
            max_ratio: spec.max_time_lost_ratio(),
            steps,
            time_budget_s,
            recent: VecDeque::new(),
            last_s: 0.0,
        }
    }

    /// A step ended at training time `now_s`.
    pub fn stepped(&mut self, now_s: f64) {
        let step = now_s - std::mem::replace(&mut self.last_s, now_s);
        if step > 0.0 {
            self.recent.push_back(step);
            if self.recent.len() > STEP_WINDOW {
                self.recent.pop_front();
            }
        }
    }

    /// Training went on at training time `at_s` after a restore.
    pub fn resumed(&mut self, at_s: f64) {
        self.last_s = at_s;
    }

    /// The entry's failure-free training time, seconds, as estimated now.
    pub fn failure_free_s(&self) -> Option<f64> {
        let by_steps = self.steps.zip(median(&self.recent)).map(|(n, step)| n as f64 * step);
        match (by_steps, self.time_budget_s) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether a failure after `restarts` restarts, with `lost_s` seconds
    /// of training lost including its own, overruns the budget.
    pub fn overrun(&self, restarts: u64, lost_s: f64) -> Option<Budget> {
        if restarts >= self.max_restarts {
            return Some(Budget::Restarts);
        }
        let most = self.failure_free_s()? * self.max_ratio;
        (lost_s > most).then_some(Budget::TimeLost)
    }

    /// The entry's error when a failure at step `step` overran `budget`.
    pub fn exhausted(&self, budget: Budget, step: u64, restarts: u64, lost_s: f64) -> FaultBudgetExhausted {
        let over = match budget {
            Budget::Restarts => format!("the restart budget, `faults.max_restarts` = {}", self.max_restarts),
            Budget::TimeLost => format!(
                "the time-lost budget, `faults.max_time_lost_ratio` = {} times the entry's failure-free training time (about {:.3} s)",
                self.max_ratio,
                self.failure_free_s().unwrap_or(0.0)
            ),
        };
        let (n, step_ms) = (restarts + 1, median(&self.recent).unwrap_or(0.0) * 1e3);
        FaultBudgetExhausted {
            message: format!(
                "injected failures exhausted {over}: failure {n} struck at step {step}, and the {n} failures lost {lost_s:.3} s of training (the work since the last checkpoint, and the restores); the entry ends instead of restarting again. Its steps take about {step_ms:.3} ms: make failures rarer (`faults.mtbf_s`, `faults.at_steps`), checkpoint more often, or raise the budget"
            ),
        }
    }
}

/// An entry ended by its fault budget ([`FaultBudget`]).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct FaultBudgetExhausted {
    message: String,
}

/// The median of `xs`, if any.
pub(super) fn median(xs: &VecDeque<f64>) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v: Vec<f64> = xs.iter().copied().collect();
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}
