//! `every-n`: a checkpoint policy that saves at a fixed interval, in steps or
//! in seconds, and keeps the newest `keep` checkpoints.
//!
//! ```toml
//! every = 100     # save when step % every == 0 (default 100, >= 1)
//! # every_s = 600 # or: save once `since_last_s` reaches this many seconds (> 0)
//! keep = 2        # checkpoints kept on disk; 0 keeps all (default 0)
//! persist_every = 1  # persist every k-th snapshot to disk, keep the others
//!                    # in host memory only (default 1: all; >= 1)
//! ```
//!
//! `every` and `every_s` exclude each other; with neither, `every = 100`.
//! With `every_s`, the clock is the host's `since_last_s` (seconds since the
//! last checkpoint, or since the start), so a save restarts it.
//!
//! Retention: after every step, when more than `keep` durable checkpoints
//! are on disk (`history.saved`), the decision deletes the oldest of them
//! (never anything else), so `keep` remain. A snapshot counts once it is
//! durable, never before (one in host memory or being persisted may never
//! reach disk). `persist_every` counts snapshots since the last persisted
//! one: that count is the plugin's only state, and the SDK's empty state
//! restarts it after a restore.

#[path = "../../shared/checkpoint.rs"]
mod checkpoint;

use harness_sdk::{CheckpointHistory, CheckpointPolicy, Config, Decision, Error, Plugin, Telemetry};

/// When to save.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Interval {
    /// At steps that are multiples of this (>= 1).
    Steps(u64),
    /// Once this many seconds passed since the last checkpoint (> 0).
    Seconds(f64),
}

/// The plugin: one instance per rank, made by `configure`.
pub struct EveryN {
    interval: Interval,
    keep: usize,
    persist_every: u64,
    /// Snapshots taken since the last persisted one.
    since_persist: u64,
}

impl Plugin for EveryN {
    const NAME: &'static str = "every-n";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn configure(config: &Config) -> Result<Self, Error> {
        config.check_keys(&["every", "every_s", "keep", "persist_every"])?;
        let every: Option<u64> = config.get("every")?;
        let every_s: Option<f64> = config.get("every_s")?;
        let interval = match (every, every_s) {
            (Some(_), Some(_)) => return Err(Error::new("set one of `every` (steps) and `every_s` (seconds), not both")),
            (Some(0), None) => return Err(Error::new("every must be at least 1")),
            (Some(n), None) => Interval::Steps(n),
            (None, Some(s)) if !(s > 0.0 && s.is_finite()) => {
                return Err(Error::new(format!("every_s must be finite and > 0, not {s}")));
            }
            (None, Some(s)) => Interval::Seconds(s),
            (None, None) => Interval::Steps(100),
        };
        let persist_every: u64 = config.get_or("persist_every", 1u64)?;
        if persist_every == 0 {
            return Err(Error::new("persist_every must be at least 1"));
        }
        Ok(EveryN { interval, keep: checkpoint::keep_from_config(config)?, persist_every, since_persist: 0 })
    }
}

impl EveryN {
    /// The configured interval.
    pub fn interval(&self) -> Interval {
        self.interval
    }

    /// Whether a checkpoint is due after step `t.step`.
    fn due(&self, t: &Telemetry, h: &CheckpointHistory) -> bool {
        match self.interval {
            Interval::Steps(n) => t.step % n == 0,
            Interval::Seconds(s) => h.since_last_s >= s,
        }
    }
}

impl CheckpointPolicy for EveryN {
    fn decide(&mut self, t: &Telemetry, h: &CheckpointHistory) -> Result<Decision, Error> {
        let delete = checkpoint::retain(&h.saved, self.keep);
        if !self.due(t, h) {
            return Ok(Decision { delete, ..Decision::none() });
        }
        self.since_persist += 1;
        if self.since_persist < self.persist_every {
            return Ok(Decision { delete, ..Decision::snapshot() });
        }
        self.since_persist = 0;
        Ok(Decision { save: true, persist: true, delete })
    }
}

harness_sdk::export!(EveryN as checkpoint_policy);

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(config: &str) -> EveryN {
        EveryN::configure(&Config::new(config)).unwrap()
    }

    fn error(config: &str) -> String {
        match EveryN::configure(&Config::new(config)) {
            Ok(_) => panic!("`{config}` was accepted"),
            Err(e) => e.message().to_owned(),
        }
    }

    fn step(step: u64) -> Telemetry {
        Telemetry { step, elapsed_s: step as f64, ..Default::default() }
    }

    /// What the host does with a decision: deletes the listed checkpoints
    /// (each must exist) and appends the new one.
    fn apply(saved: &mut Vec<u64>, step: u64, d: &Decision) {
        for x in &d.delete {
            let i = saved.iter().position(|s| s == x).unwrap_or_else(|| panic!("deleted {x}, not in {saved:?}"));
            saved.remove(i);
        }
        if d.save {
            saved.push(step);
        }
    }

    #[test]
    fn saves_exactly_at_multiples_of_every() {
        for every in [1u64, 3, 7, 100] {
            let mut p = policy(&format!("every = {every}"));
            let mut saves = Vec::new();
            for s in 1..=350 {
                let d = p.decide(&step(s), &CheckpointHistory::default()).unwrap();
                assert!(d.delete.is_empty(), "keep = 0 deletes nothing");
                if d.save {
                    saves.push(s);
                }
            }
            let want: Vec<u64> = (1..=350).filter(|s| s % every == 0).collect();
            assert_eq!(saves, want, "every = {every}");
        }
    }

    #[test]
    fn the_default_is_every_100_steps_keeping_all() {
        let mut p = policy("");
        assert_eq!(p.interval(), Interval::Steps(100));
        let h = CheckpointHistory { saved: (1..=50).map(|i| i * 100).collect(), ..Default::default() };
        assert_eq!(p.decide(&step(99), &h).unwrap(), Decision::none());
        assert_eq!(p.decide(&step(5100), &h).unwrap(), Decision::save());
    }

    #[test]
    fn keep_last_k_deletes_the_oldest_durable_ones_beyond_k() {
        for keep in [1usize, 2, 3, 5] {
            let mut p = policy(&format!("every = 4\nkeep = {keep}"));
            let mut saved = Vec::new();
            for s in 1..=100 {
                let before = saved.clone();
                let d = p.decide(&step(s), &CheckpointHistory { saved: saved.clone(), ..Default::default() }).unwrap();
                // The deleted ones are the oldest of those on disk beyond `keep`.
                assert_eq!(d.delete, before[..before.len().saturating_sub(keep)], "keep = {keep}, step {s}");
                apply(&mut saved, s, &d);
                // A save counts once durable (here at once): at most one over
                // `keep` until the next decision, always the newest ones.
                assert!(saved.len() <= keep + 1, "keep = {keep}, step {s}: {saved:?}");
                let all: Vec<u64> = (1..=s / 4).map(|i| i * 4).collect();
                assert_eq!(saved, all[all.len() - saved.len()..], "keep = {keep}, step {s}");
            }
        }
    }

    #[test]
    fn keep_only_deletes_checkpoints_the_host_listed() {
        let mut p = policy("every = 10\nkeep = 2");
        // More on disk than `keep` (e.g. a resume with a smaller keep): back to
        // 2, oldest first, in the host's order.
        let h = CheckpointHistory { saved: vec![30, 10, 20, 40], ..Default::default() };
        assert_eq!(p.decide(&step(50), &h).unwrap().delete, vec![30, 10]);
        // A step listed twice counts once.
        let h = CheckpointHistory { saved: vec![30, 40, 40], ..Default::default() };
        assert_eq!(p.decide(&step(50), &h).unwrap().delete, Vec::<u64>::new());
        // Nothing to delete yet.
        let h = CheckpointHistory { saved: vec![40], ..Default::default() };
        assert_eq!(p.decide(&step(50), &h).unwrap(), Decision::save());
        // Deletions do not wait for a save.
        let h = CheckpointHistory { saved: vec![10, 20, 30, 40], ..Default::default() };
        assert_eq!(p.decide(&step(51), &h).unwrap(), Decision { delete: vec![10, 20], ..Decision::none() });
    }

    #[test]
    fn every_s_saves_when_since_last_reaches_the_interval() {
        let mut p = policy("every_s = 30.0\nkeep = 1");
        assert_eq!(p.interval(), Interval::Seconds(30.0));
        let h = |since: f64, saved: Vec<u64>| CheckpointHistory { since_last_s: since, saved, ..Default::default() };
        assert_eq!(p.decide(&step(7), &h(29.999, vec![])).unwrap(), Decision::none());
        assert_eq!(p.decide(&step(8), &h(30.0, vec![])).unwrap(), Decision::save());
        assert_eq!(p.decide(&step(9), &h(0.5, vec![8])).unwrap(), Decision::none());
        assert_eq!(p.decide(&step(20), &h(31.0, vec![8])).unwrap(), Decision::save());
        assert_eq!(p.decide(&step(21), &h(0.1, vec![8, 20])).unwrap().delete, vec![8]);
        // An integer is read as seconds too.
        assert_eq!(policy("every_s = 5").interval(), Interval::Seconds(5.0));

        // Simulated clock: 1.3 s steps, the host resets since_last_s on a
        // save. Saves land at the first step at or past 30 s since the last.
        let mut p = policy("every_s = 30");
        let (mut since, mut saves) = (0.0, Vec::new());
        for s in 1..=100u64 {
            since += 1.3;
            if p.decide(&step(s), &h(since, vec![])).unwrap().save {
                saves.push(s);
                since = 0.0;
            }
        }
        // ceil(30 / 1.3) = 24 steps per checkpoint.
        assert_eq!(saves, vec![24, 48, 72, 96]);
    }

    #[test]
    fn persist_every_keeps_the_other_snapshots_in_memory_and_retention_counts_durable_ones_only() {
        let mut p = policy("every = 10\npersist_every = 3\nkeep = 2");
        let h = CheckpointHistory { saved: vec![10, 30], persisting: Some(60), in_memory: vec![50], ..Default::default() };
        let d: Vec<Decision> = [10, 20, 30, 40, 50, 60].iter().map(|&s| p.decide(&step(s), &h).unwrap()).collect();
        assert_eq!(d.iter().map(|d| (d.save, d.persist)).collect::<Vec<_>>(), [(true, false), (true, false), (true, true)].repeat(2));
        // Two durable, one on its way: nothing is deleted for it yet.
        assert!(d.iter().all(|d| d.delete.is_empty()));
    }

    #[test]
    fn configuration_errors() {
        assert_eq!(error("every = 0"), "every must be at least 1");
        assert!(error("every = -5").contains("`every`"));
        assert!(error("every = 2.5").contains("`every`"));
        assert!(error("every = 10\nevery_s = 60").contains("not both"));
        assert!(error("every_s = 0").starts_with("every_s must be finite and > 0"));
        assert!(error("every_s = -1.0").starts_with("every_s must be finite and > 0"));
        assert!(error("every_s = nan").starts_with("every_s must be finite and > 0"));
        assert!(error("every_s = inf").starts_with("every_s must be finite and > 0"));
        assert!(error("keep = -1").contains("`keep`"));
        assert_eq!(error("evry = 3"), "unknown config key `evry` (known: every, every_s, keep, persist_every)");
        assert_eq!(error("persist_every = 0"), "persist_every must be at least 1");
        assert!(error("every = ").starts_with("config is not valid TOML"));
    }

    #[test]
    fn state_is_empty_and_loading_it_changes_nothing() {
        let mut p = policy("every = 3\nkeep = 1");
        assert!(p.state_save().is_empty());
        p.state_load(&[]).unwrap();
        assert_eq!(p.decide(&step(6), &CheckpointHistory { saved: vec![3, 5], ..Default::default() }).unwrap().delete, vec![3]);
    }
}
