//! Expanding a suite into its [`Plan`]: workloads x strategies x repeats,
//! each entry with its seed.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::spec::{Order, Strategy};
use super::validate::Suite;

impl Suite {
    /// The strategies in effect (the default baseline when none are listed).
    pub fn strategies(&self) -> Vec<Strategy> {
        if self.spec.strategies.is_empty() {
            vec![Strategy::default_baseline()]
        } else {
            self.spec.strategies.clone()
        }
    }

    /// Expands workloads x strategies x repeats into the entries to run.
    pub fn plan(&self) -> Plan {
        let mut entries = Vec::new();
        let strategies = self.strategies();
        for r in 0..self.spec.suite.repeats {
            let mut strategies = strategies.clone();
            if self.spec.suite.order == Order::Rotate && !strategies.is_empty() {
                let n = strategies.len();
                strategies.rotate_left(r as usize % n);
            }
            for (wi, w) in self.spec.workloads.iter().enumerate() {
                for st in &strategies {
                    if let Some(ws) = &st.workloads {
                        if !ws.iter().any(|n| n == &w.name) {
                            continue;
                        }
                    }
                    // Same seed for every strategy of one repeat: a paired
                    // comparison sees the same initial weights and data.
                    let seed = mix_seed(self.spec.suite.seed, &w.name, r);
                    entries.push(PlanEntry {
                        id: format!("{}/{}/r{}", w.name, st.name, r),
                        workload: wi,
                        strategy: st.clone(),
                        repeat: r,
                        seed,
                    });
                }
            }
        }
        Plan { entries }
    }
}

/// A deterministic 64-bit seed from the suite seed, a name and a repeat index.
pub fn mix_seed(seed: u64, name: &str, repeat: u32) -> u64 {
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(name.as_bytes());
    h.update(repeat.to_le_bytes());
    let d = h.finalize();
    u64::from_le_bytes(d[..8].try_into().expect("sha256 has 32 bytes")) >> 1
}

/// What a suite runs, in order.
#[derive(Debug, Clone)]
pub struct Plan {
    pub entries: Vec<PlanEntry>,
}

/// One training run: a workload under one strategy, one repeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanEntry {
    pub id: String,
    /// Index into the suite's workloads.
    pub workload: usize,
    pub strategy: Strategy,
    pub repeat: u32,
    pub seed: u64,
}

#[cfg(test)]
mod tests {
    use crate::suite::validate::tests::{parse, OK};

    #[test]
    fn plan_crosses_workloads_strategies_and_repeats() {
        let s = parse(OK).unwrap();
        let p = s.plan();
        let ids: Vec<_> = p.entries.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["w/a/r0", "w/b/r0", "w/a/r1", "w/b/r1"]);
        // Paired seeds: same within a repeat, different across repeats.
        assert_eq!(p.entries[0].seed, p.entries[1].seed);
        assert_ne!(p.entries[0].seed, p.entries[2].seed);
    }

    #[test]
    fn rotate_puts_every_strategy_in_every_position() {
        let s = parse(&OK.replace("repeats = 2", "repeats = 2\norder = \"rotate\"")).unwrap();
        let ids: Vec<_> = s.plan().entries.iter().map(|e| e.id.clone()).collect();
        assert_eq!(ids, ["w/a/r0", "w/b/r0", "w/b/r1", "w/a/r1"]);
        // Still paired: both strategies of a repeat share its seed.
        let p = s.plan();
        assert_eq!(p.entries[2].seed, p.entries[3].seed);
        let bad = parse(&OK.replace("repeats = 2", "repeats = 2\norder = \"random\"")).unwrap_err();
        assert!(bad.to_string().contains("unknown variant `random`"), "{bad}");
    }
}
