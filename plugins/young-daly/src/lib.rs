//! `young-daly`: a checkpoint policy that saves at the first-order optimal
//! interval of Young (1974) and Daly (2006),
//!
//! ```text
//! T = sqrt(2 * C * MTBF)
//! ```
//!
//! with C the cost of writing one checkpoint, seconds, and MTBF the mean time
//! between failures, seconds. (J. W. Young, "A first order approximation to
//! the optimum checkpoint interval", CACM 17(9), 1974; J. T. Daly, "A higher
//! order estimate of the optimum checkpoint interval for restart dumps",
//! FGCS 22(3), 2006, whose first-order term this is.)
//!
//! ```toml
//! mtbf_s = 3600.0        # MTBF, seconds (required unless estimate_mtbf = true; > 0)
//! estimate_mtbf = false  # estimate MTBF = elapsed_s / failures once a failure happened
//! initial_cost_s = 1.0   # C before the host has measured one (> 0)
//! first_at_step = 1      # while no cost is known and none is on disk, save at this step (0: off)
//! min_interval_s = 0.0   # clamps on T (>= 0; max >= min; max default: none)
//! # max_interval_s = 1800.0
//! keep = 0               # checkpoints kept on disk; 0 keeps all
//! ```
//!
//! Rule, after each step:
//!
//! - C is `history.last_cost_s`, the host's measurement of what the latest
//!   checkpoint cost training: with asynchronous checkpoints its stall plus
//!   the slowdown of the steps that overlapped its copy and persist (the
//!   time the write itself took in the background does not stop training
//!   and is not counted); with synchronous ones the whole write. So T
//!   follows the latest cost. Before a measurement
//!   (or if it is not finite or negative) C is `initial_cost_s`.
//! - MTBF is `mtbf_s`; with `estimate_mtbf = true` and at least one failure in
//!   `history.failures`, it is `telemetry.elapsed_s / failures.len()`; before
//!   the first failure, `mtbf_s` or, without it, [`DEFAULT_MTBF_S`] (one day).
//! - T = sqrt(2 C MTBF), clamped to [`min_interval_s`, `max_interval_s`].
//! - It saves when `history.since_last_s >= T`, and also, while no cost has
//!   been measured and no checkpoint is on disk, at the first step `>=
//!   first_at_step`: that first write is what gives the host a real C, so
//!   the guess `initial_cost_s` decides (almost) nothing.
//!
//! Retention (`keep`) as in `every-n`: after every step, when more than
//! `keep` durable checkpoints are on disk, it deletes the oldest of
//! `history.saved`; a snapshot counts once durable.
//! Stateless: every decision follows from the telemetry and the history.

#[path = "../../shared/checkpoint.rs"]
mod checkpoint;

use harness_sdk::{CheckpointHistory, CheckpointPolicy, Config, Decision, Error, Plugin, Telemetry};

/// MTBF used with `estimate_mtbf = true` before the first failure when no
/// `mtbf_s` is configured: one day, seconds.
pub const DEFAULT_MTBF_S: f64 = 86_400.0;

/// The Young/Daly first-order interval sqrt(2 C MTBF), seconds.
pub fn young_daly_interval(cost_s: f64, mtbf_s: f64) -> f64 {
    (2.0 * cost_s * mtbf_s).sqrt()
}

/// The plugin: one instance per rank, made by `configure`.
pub struct YoungDaly {
    mtbf_s: Option<f64>,
    estimate_mtbf: bool,
    initial_cost_s: f64,
    first_at_step: u64,
    min_interval_s: f64,
    max_interval_s: f64,
    keep: usize,
}

/// A key that must be finite and > 0, when present.
fn positive(config: &Config, key: &str) -> Result<Option<f64>, Error> {
    match config.get::<f64>(key)? {
        Some(v) if !(v > 0.0 && v.is_finite()) => Err(Error::new(format!("{key} must be finite and > 0, not {v}"))),
        v => Ok(v),
    }
}

impl Plugin for YoungDaly {
    const NAME: &'static str = "young-daly";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["mtbf_s", "estimate_mtbf", "initial_cost_s", "first_at_step", "min_interval_s", "max_interval_s", "keep"])?;
        let mtbf_s = positive(config, "mtbf_s")?;
        let estimate_mtbf = config.get_or("estimate_mtbf", false)?;
        if mtbf_s.is_none() && !estimate_mtbf {
            return Err(Error::new("mtbf_s (seconds) is required, unless estimate_mtbf = true"));
        }
        let initial_cost_s = positive(config, "initial_cost_s")?.unwrap_or(1.0);
        let first_at_step = config.get_or("first_at_step", 1u64)?;
        let min_interval_s: f64 = config.get_or("min_interval_s", 0.0)?;
        if !(min_interval_s >= 0.0 && min_interval_s.is_finite()) {
            return Err(Error::new(format!("min_interval_s must be finite and >= 0, not {min_interval_s}")));
        }
        let max_interval_s = positive(config, "max_interval_s")?.unwrap_or(f64::INFINITY);
        if max_interval_s < min_interval_s {
            return Err(Error::new(format!("need min_interval_s <= max_interval_s, not {min_interval_s} > {max_interval_s}")));
        }
        let keep = checkpoint::keep_from_config(config)?;
        Ok(YoungDaly { mtbf_s, estimate_mtbf, initial_cost_s, first_at_step, min_interval_s, max_interval_s, keep })
    }
}

impl YoungDaly {
    /// C: the host's latest measured cost, else `initial_cost_s`.
    pub fn cost_s(&self, h: &CheckpointHistory) -> f64 {
        match h.last_cost_s {
            Some(c) if c >= 0.0 && c.is_finite() => c,
            _ => self.initial_cost_s,
        }
    }

    /// MTBF: configured, or estimated from the failures seen so far.
    pub fn mtbf_s(&self, t: &Telemetry, h: &CheckpointHistory) -> f64 {
        if self.estimate_mtbf && !h.failures.is_empty() {
            let est = t.elapsed_s / h.failures.len() as f64;
            if est > 0.0 && est.is_finite() {
                return est;
            }
        }
        self.mtbf_s.unwrap_or(DEFAULT_MTBF_S)
    }

    /// T = sqrt(2 C MTBF), clamped to [`min_interval_s`, `max_interval_s`].
    pub fn interval_s(&self, t: &Telemetry, h: &CheckpointHistory) -> f64 {
        young_daly_interval(self.cost_s(h), self.mtbf_s(t, h)).clamp(self.min_interval_s, self.max_interval_s)
    }

    /// The first save, made to measure C: no cost known, none on disk, and
    /// the step reached `first_at_step`.
    fn first_save(&self, t: &Telemetry, h: &CheckpointHistory) -> bool {
        self.first_at_step > 0 && h.last_cost_s.is_none() && h.saved.is_empty() && t.step >= self.first_at_step
    }
}

impl CheckpointPolicy for YoungDaly {
    fn decide(&mut self, t: &Telemetry, h: &CheckpointHistory) -> Result<Decision, Error> {
        let save = self.first_save(t, h) || h.since_last_s >= self.interval_s(t, h);
        Ok(Decision { save, persist: save, delete: checkpoint::retain(&h.saved, self.keep) })
    }
}

harness_sdk::export!(YoungDaly as checkpoint_policy);

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(config: &str) -> YoungDaly {
        YoungDaly::configure(&Config::new(config)).unwrap()
    }

    fn error(config: &str) -> String {
        match YoungDaly::configure(&Config::new(config)) {
            Ok(_) => panic!("`{config}` was accepted"),
            Err(e) => e.message().to_owned(),
        }
    }

    fn tele(step: u64, elapsed_s: f64) -> Telemetry {
        Telemetry { step, elapsed_s, step_time_s: 1.0, ..Default::default() }
    }

    fn hist(cost: Option<f64>, saved: &[u64], failures: &[u64], since: f64) -> CheckpointHistory {
        CheckpointHistory {
            last_cost_s: cost,
            saved: saved.to_vec(),
            failures: failures.to_vec(),
            since_last_s: since,
            ..Default::default()
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    /// A simulated run: steps of `step_s` seconds; a save costs `cost(k)`
    /// for the k-th write (0-based), which the host reports afterwards, and
    /// resets `since_last_s`. Returns (step, since_last_s at the save) per save.
    fn simulate(p: &mut YoungDaly, steps: u64, step_s: f64, cost: impl Fn(usize) -> f64) -> Vec<(u64, f64)> {
        let (mut since, mut last_cost, mut saved, mut out) = (0.0, None, Vec::new(), Vec::new());
        for s in 1..=steps {
            since += step_s;
            let d = p.decide(&tele(s, s as f64 * step_s), &hist(last_cost, &saved, &[], since)).unwrap();
            for x in &d.delete {
                saved.retain(|y| y != x);
            }
            if d.save {
                out.push((s, since));
                last_cost = Some(cost(saved.len()));
                saved.push(s);
                since = 0.0;
            }
        }
        out
    }

    #[test]
    fn the_interval_is_sqrt_2_c_mtbf() {
        assert_eq!(young_daly_interval(2.0, 3600.0), 120.0);
        let p = policy("mtbf_s = 3600");
        let t = tele(10, 10.0);
        assert_eq!(p.interval_s(&t, &hist(Some(2.0), &[1], &[], 0.0)), 120.0);
        for (c, m) in [(0.5, 7200.0), (30.0, 86400.0), (1e-3, 60.0), (12.5, 1e6)] {
            let p = policy(&format!("mtbf_s = {m:?}"));
            let got = p.interval_s(&t, &hist(Some(c), &[1], &[], 0.0));
            assert!(close(got, (2.0f64 * c * m).sqrt()), "C = {c}, MTBF = {m}: {got}");
            // Quadrupling C doubles T.
            let got4 = p.interval_s(&t, &hist(Some(4.0 * c), &[1], &[], 0.0));
            assert!(close(got4, 2.0 * got), "C = {c}, MTBF = {m}: {got4} != 2 x {got}");
        }
    }

    #[test]
    fn saves_at_the_first_decide_where_since_last_crosses_t() {
        // C = 2 s, MTBF = 3600 s: T = 120 s.
        let mut p = policy("mtbf_s = 3600");
        let h = |since| hist(Some(2.0), &[1], &[], since);
        assert_eq!(p.decide(&tele(50, 50.0), &h(119.999)).unwrap(), Decision::none());
        assert_eq!(p.decide(&tele(51, 51.0), &h(120.0)).unwrap(), Decision::save());
        assert_eq!(p.decide(&tele(52, 52.0), &h(120.001)).unwrap(), Decision::save());

        // 7 s steps: 17 x 7 = 119 < 120 <= 18 x 7 = 126, so after the first
        // save (step 1, to measure C) every 18th step saves.
        let saves = simulate(&mut policy("mtbf_s = 3600"), 100, 7.0, |_| 2.0);
        let steps: Vec<u64> = saves.iter().map(|s| s.0).collect();
        assert_eq!(steps, vec![1, 19, 37, 55, 73, 91]);
        for &(s, since) in &saves[1..] {
            assert!((120.0..127.0).contains(&since), "step {s}: saved at {since} s");
        }
    }

    #[test]
    fn the_interval_follows_the_latest_measured_cost() {
        let p = policy("mtbf_s = 3600");
        let t = tele(100, 100.0);
        for (c, want) in [(2.0, 120.0), (8.0, 240.0), (0.5, 60.0), (2.0, 120.0)] {
            assert!(close(p.interval_s(&t, &hist(Some(c), &[1], &[], 0.0)), want), "C = {c}");
        }
        // In a run whose writes cost 2, 8, 0.5, 0.5, ... s (1 s steps), the
        // gaps are T of the cost measured at the previous save: 120, 240, 60.
        let costs = [2.0, 8.0, 0.5];
        let saves = simulate(&mut policy("mtbf_s = 3600"), 500, 1.0, |k| costs[k.min(2)]);
        let since: Vec<f64> = saves.iter().map(|s| s.1).collect();
        assert_eq!(since[..5], [1.0, 120.0, 240.0, 60.0, 60.0]);
    }

    #[test]
    fn before_a_cost_is_known_it_saves_at_first_at_step() {
        // Default: the very first decide saves, whatever since_last_s says.
        let mut p = policy("mtbf_s = 3600");
        assert_eq!(p.decide(&tele(1, 1.0), &hist(None, &[], &[], 0.1)).unwrap(), Decision::save());
        // Once a cost is measured, T rules.
        assert_eq!(p.decide(&tele(2, 2.0), &hist(Some(2.0), &[1], &[], 1.0)).unwrap(), Decision::none());

        // first_at_step = 5: steps 1..4 wait (T from initial_cost_s = 1 is
        // sqrt(7200) = 84.9 s), step 5 saves; a later first call (a resume
        // without checkpoints) saves too.
        let mut p = policy("mtbf_s = 3600\nfirst_at_step = 5");
        for s in 1..5 {
            assert!(!p.decide(&tele(s, s as f64), &hist(None, &[], &[], s as f64)).unwrap().save, "step {s}");
        }
        assert!(p.decide(&tele(5, 5.0), &hist(None, &[], &[], 5.0)).unwrap().save);
        assert!(p.decide(&tele(9, 9.0), &hist(None, &[], &[], 9.0)).unwrap().save);

        // first_at_step = 0: C = initial_cost_s until measured.
        let mut p = policy("mtbf_s = 3600\nfirst_at_step = 0\ninitial_cost_s = 2");
        assert_eq!(p.interval_s(&tele(1, 1.0), &hist(None, &[], &[], 0.0)), 120.0);
        assert!(!p.decide(&tele(1, 1.0), &hist(None, &[], &[], 1.0)).unwrap().save);
        assert!(!p.decide(&tele(119, 119.0), &hist(None, &[], &[], 119.9)).unwrap().save);
        assert!(p.decide(&tele(120, 120.0), &hist(None, &[], &[], 120.0)).unwrap().save);
        let p = policy("mtbf_s = 3600\nfirst_at_step = 0");
        assert!(close(p.interval_s(&tele(1, 1.0), &hist(None, &[], &[], 0.0)), 7200f64.sqrt()));

        // A checkpoint on disk without a measured cost (a resume): no extra
        // first save; T from initial_cost_s.
        let mut p = policy("mtbf_s = 3600");
        assert!(!p.decide(&tele(40, 40.0), &hist(None, &[30], &[], 10.0)).unwrap().save);
        assert!(p.decide(&tele(41, 41.0), &hist(None, &[30], &[], 85.0)).unwrap().save);
        // A measured cost that is not a number falls back to initial_cost_s.
        assert!(close(p.interval_s(&tele(1, 1.0), &hist(Some(f64::NAN), &[1], &[], 0.0)), 7200f64.sqrt()));
        assert!(close(p.interval_s(&tele(1, 1.0), &hist(Some(-1.0), &[1], &[], 0.0)), 7200f64.sqrt()));
    }

    #[test]
    fn mtbf_is_estimated_from_failures() {
        let p = policy("estimate_mtbf = true\nmtbf_s = 800");
        // Before a failure: the configured mtbf_s. sqrt(2 x 2 x 800) = sqrt(3200).
        assert!(close(p.mtbf_s(&tele(10, 7200.0), &hist(Some(2.0), &[1], &[], 0.0)), 800.0));
        assert!(close(p.interval_s(&tele(10, 7200.0), &hist(Some(2.0), &[1], &[], 0.0)), 3200f64.sqrt()));
        // Two failures in 7200 s: MTBF 3600 s, T = 120 s with C = 2.
        let h = hist(Some(2.0), &[1], &[100, 250], 0.0);
        assert_eq!(p.mtbf_s(&tele(300, 7200.0), &h), 3600.0);
        assert_eq!(p.interval_s(&tele(300, 7200.0), &h), 120.0);
        // Three in 900 s: 300 s; T = sqrt(2 x 2 x 300) = sqrt(1200).
        let h = hist(Some(2.0), &[1], &[5, 6, 7], 0.0);
        assert_eq!(p.mtbf_s(&tele(8, 900.0), &h), 300.0);
        assert!(close(p.interval_s(&tele(8, 900.0), &h), 1200f64.sqrt()));
        // The estimate decides saves: 35 s since the last is past sqrt(1200) = 34.6.
        let mut p2 = policy("estimate_mtbf = true\nmtbf_s = 800");
        assert!(!p2.decide(&tele(8, 900.0), &hist(Some(2.0), &[1], &[5, 6, 7], 34.0)).unwrap().save);
        assert!(p2.decide(&tele(8, 900.0), &hist(Some(2.0), &[1], &[5, 6, 7], 35.0)).unwrap().save);

        // Without mtbf_s: one day before the first failure.
        let p = policy("estimate_mtbf = true");
        assert_eq!(p.mtbf_s(&tele(10, 10.0), &hist(Some(2.0), &[1], &[], 0.0)), DEFAULT_MTBF_S);
        assert!(close(p.interval_s(&tele(10, 10.0), &hist(Some(2.0), &[1], &[], 0.0)), (4.0 * 86400f64).sqrt()));
        // No elapsed time yet: the estimate is undefined, the fallback holds.
        assert_eq!(p.mtbf_s(&tele(1, 0.0), &hist(Some(2.0), &[1], &[1], 0.0)), DEFAULT_MTBF_S);

        // Without estimate_mtbf, failures do not move MTBF.
        let p = policy("mtbf_s = 3600");
        assert_eq!(p.mtbf_s(&tele(300, 7200.0), &hist(Some(2.0), &[1], &[1, 2, 3, 4], 0.0)), 3600.0);
    }

    #[test]
    fn the_interval_is_clamped() {
        let p = policy("mtbf_s = 3600\nmin_interval_s = 150\nmax_interval_s = 200");
        let t = tele(10, 10.0);
        assert_eq!(p.interval_s(&t, &hist(Some(2.0), &[1], &[], 0.0)), 150.0); // 120 -> 150
        assert!(close(p.interval_s(&t, &hist(Some(4.5), &[1], &[], 0.0)), 180.0)); // inside
        assert_eq!(p.interval_s(&t, &hist(Some(8.0), &[1], &[], 0.0)), 200.0); // 240 -> 200
                                                                               // A zero cost would checkpoint every step; min_interval_s stops it.
        assert_eq!(policy("mtbf_s = 3600").interval_s(&t, &hist(Some(0.0), &[1], &[], 0.0)), 0.0);
        assert_eq!(p.interval_s(&t, &hist(Some(0.0), &[1], &[], 0.0)), 150.0);
    }

    #[test]
    fn keep_last_k_deletes_the_oldest_durable_ones_beyond_k() {
        for keep in [1usize, 2, 4] {
            let mut p = policy(&format!("mtbf_s = 3600\nkeep = {keep}"));
            let (mut saved, mut since, mut n_saves) = (Vec::<u64>::new(), 0.0, 0usize);
            for s in 1..=2000u64 {
                since += 1.0;
                let d = p.decide(&tele(s, s as f64), &hist((n_saves > 0).then_some(2.0), &saved, &[], since)).unwrap();
                // Deletions: the oldest durable ones beyond `keep`, at any step.
                let n_del = saved.len().saturating_sub(keep);
                assert_eq!(d.delete, saved[..n_del], "keep = {keep}, step {s}");
                saved.drain(..n_del);
                if d.save {
                    saved.push(s);
                    n_saves += 1;
                    since = 0.0;
                }
                assert!(saved.len() <= keep + 1, "keep = {keep}, step {s}");
            }
            saved.drain(..saved.len().saturating_sub(keep));
            // Step 1, then every 120 steps: 1, 121, ..., 1921.
            assert_eq!(n_saves, 17);
            let all: Vec<u64> = (0..17u64).map(|k| 1 + 120 * k).collect();
            assert_eq!(saved, all[17 - keep..], "keep = {keep}");
        }
        // keep = 0 keeps all.
        let mut p = policy("mtbf_s = 3600");
        assert_eq!(p.decide(&tele(500, 500.0), &hist(Some(2.0), &[1, 121, 241, 361], &[], 120.0)).unwrap(), Decision::save());
    }

    #[test]
    fn configuration_errors() {
        assert_eq!(error(""), "mtbf_s (seconds) is required, unless estimate_mtbf = true");
        assert_eq!(error("mtbf_s = -3600"), "mtbf_s must be finite and > 0, not -3600");
        assert!(error("mtbf_s = 0").starts_with("mtbf_s must be finite and > 0"));
        assert!(error("mtbf_s = nan").starts_with("mtbf_s must be finite and > 0"));
        assert!(error("mtbf_s = inf").starts_with("mtbf_s must be finite and > 0"));
        assert!(error("mtbf_s = \"1h\"").contains("`mtbf_s`"));
        assert!(error("estimate_mtbf = true\nmtbf_s = -1").starts_with("mtbf_s must be finite and > 0"));
        assert!(error("estimate_mtbf = 1").contains("`estimate_mtbf`"));
        assert!(error("mtbf_s = 3600\ninitial_cost_s = 0").starts_with("initial_cost_s must be finite and > 0"));
        assert!(error("mtbf_s = 3600\nfirst_at_step = -1").contains("`first_at_step`"));
        assert!(error("mtbf_s = 3600\nmin_interval_s = -1").starts_with("min_interval_s must be finite and >= 0"));
        assert!(error("mtbf_s = 3600\nmax_interval_s = 0").starts_with("max_interval_s must be finite and > 0"));
        assert!(error("mtbf_s = 3600\nmin_interval_s = 300\nmax_interval_s = 200").starts_with("need min_interval_s <= max_interval_s"));
        assert!(error("mtbf_s = 3600\nkeep = -2").contains("`keep`"));
        assert!(error("mtbf_s = 3600\nmtbf = 1").starts_with("unknown config key `mtbf` (known: mtbf_s, "));
        // Accepted edge values.
        policy("estimate_mtbf = true");
        policy("mtbf_s = 1e-3\nmin_interval_s = 5\nmax_interval_s = 5\nfirst_at_step = 0\nkeep = 1");
    }

    #[test]
    fn state_is_empty_and_loading_it_changes_nothing() {
        let mut p = policy("mtbf_s = 3600\nkeep = 1");
        assert!(p.state_save().is_empty());
        p.state_load(&[]).unwrap();
        assert_eq!(
            p.decide(&tele(200, 200.0), &hist(Some(2.0), &[1, 121], &[], 120.0)).unwrap(),
            Decision { save: true, persist: true, delete: vec![1] }
        );
    }
}
