//! The metrics the report scores: what each is called, its unit, which way
//! is better, how it is read from an entry's [`Metrics`] and how its values
//! are written in the tables.

use std::collections::BTreeMap;

use super::stats::Summary;
use harness_format::results::Metrics;

/// A metric's direction: which way is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Better {
    Higher,
    Lower,
}

/// A metric of the leaderboard and of `harness compare`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Metric {
    /// Training time until the eval loss (or accuracy) reached the target.
    TimeToTarget,
    TokensPerS,
    StepP50,
    StepP99,
    StepP999,
    /// Model FLOP utilisation, a fraction of the device's peak.
    Mfu,
    /// Peak device memory allocated, else the peak resident set.
    PeakMemory,
    /// Bytes on the wire per step.
    BytesPerStep,
    /// Steps that counted per second, with the time failures cost.
    Goodput,
    /// Classifiers' final eval top-1 accuracy: a column of the boards that
    /// have it and a row of `harness compare`, never ranked on.
    EvalAccuracy,
}

/// A value per metric; a metric without one is absent.
pub type PerMetric<T> = BTreeMap<Metric, T>;

impl Metric {
    /// Every metric: the scored ones, then the accuracy. A new variant
    /// goes here, and in [`Metric::SCORED`] if it is a leaderboard column.
    pub const ALL: [Metric; 10] = [
        Metric::TimeToTarget,
        Metric::TokensPerS,
        Metric::StepP50,
        Metric::StepP99,
        Metric::StepP999,
        Metric::Mfu,
        Metric::PeakMemory,
        Metric::BytesPerStep,
        Metric::Goodput,
        Metric::EvalAccuracy,
    ];

    /// The scored metrics, in the order of the leaderboard's columns.
    pub const SCORED: [Metric; 9] = [
        Metric::TimeToTarget,
        Metric::TokensPerS,
        Metric::StepP50,
        Metric::StepP99,
        Metric::StepP999,
        Metric::Mfu,
        Metric::PeakMemory,
        Metric::BytesPerStep,
        Metric::Goodput,
    ];

    /// The name in table headers and rows.
    pub fn name(self) -> &'static str {
        match self {
            Metric::TimeToTarget => "time to target s",
            Metric::TokensPerS => "tokens/s",
            Metric::StepP50 => "step p50 ms",
            Metric::StepP99 => "step p99 ms",
            Metric::StepP999 => "step p99.9 ms",
            Metric::Mfu => "MFU",
            Metric::PeakMemory => "peak memory",
            Metric::BytesPerStep => "bytes/step",
            Metric::Goodput => "goodput steps/s",
            Metric::EvalAccuracy => "eval accuracy",
        }
    }

    /// The unit of [`Metric::value`]; empty for fractions.
    pub fn unit(self) -> &'static str {
        match self {
            Metric::TimeToTarget => "s",
            Metric::TokensPerS => "tokens/s",
            Metric::StepP50 | Metric::StepP99 | Metric::StepP999 => "ms",
            Metric::Mfu | Metric::EvalAccuracy => "",
            Metric::PeakMemory | Metric::BytesPerStep => "B",
            Metric::Goodput => "steps/s",
        }
    }

    /// Whether it is a figure of time (durations, rates and what is made
    /// of them), which differs between two honest runs by the class's
    /// run-to-run band; memory, bytes and accuracy do not.
    pub fn is_timing(self) -> bool {
        matches!(
            self,
            Metric::TimeToTarget
                | Metric::TokensPerS
                | Metric::StepP50
                | Metric::StepP99
                | Metric::StepP999
                | Metric::Mfu
                | Metric::Goodput
        )
    }

    /// Which way is better.
    pub fn better(self) -> Better {
        match self {
            Metric::TokensPerS | Metric::Mfu | Metric::Goodput | Metric::EvalAccuracy => Better::Higher,
            Metric::TimeToTarget | Metric::StepP50 | Metric::StepP99 | Metric::StepP999 | Metric::PeakMemory | Metric::BytesPerStep => {
                Better::Lower
            }
        }
    }

    /// The metric of one entry; None where the entry does not have it.
    pub fn value(self, m: &Metrics) -> Option<f64> {
        let step = m.step.as_ref();
        match self {
            Metric::TimeToTarget => m.time_to_target_s,
            Metric::TokensPerS => Some(m.tokens_per_s),
            Metric::StepP50 => step.map(|s| s.p50_ms),
            Metric::StepP99 => step.map(|s| s.p99_ms),
            Metric::StepP999 => step.map(|s| s.p999_ms),
            Metric::Mfu => m.mfu,
            Metric::PeakMemory => m.memory.peak_device_allocated_bytes.map(|b| b as f64).or(m.memory.peak_rss_bytes.map(|b| b as f64)),
            Metric::BytesPerStep => (m.steps > 0).then(|| m.bytes_on_wire as f64 / m.steps as f64),
            Metric::Goodput => m.goodput_steps_per_s,
            Metric::EvalAccuracy => m.final_eval_accuracy,
        }
    }

    /// One value as the tables write it.
    pub fn format(self, x: f64) -> String {
        match self {
            Metric::TokensPerS => sig4(x),
            Metric::Mfu => format!("{:.1}%", 100.0 * x),
            Metric::PeakMemory | Metric::BytesPerStep => bytes(x.max(0.0) as u64),
            Metric::TimeToTarget => format!("{x:.2}"),
            Metric::StepP50 | Metric::StepP99 | Metric::StepP999 | Metric::Goodput | Metric::EvalAccuracy => format!("{x:.3}"),
        }
    }

    /// A summary as the tables write it: "mean [lo, hi]", "mean (n=1)"
    /// without an interval, "-" without a value.
    pub fn format_summary(self, s: Option<&Summary>) -> String {
        let Some(s) = s else { return "-".into() };
        match s.ci95 {
            Some((lo, hi)) if s.n >= 2 => format!("{} [{}, {}]", self.format(s.olympic_mean), self.format(lo), self.format(hi)),
            _ => format!("{} (n=1)", self.format(s.olympic_mean)),
        }
    }
}

/// Four significant digits with a k / M / G suffix: 31_312.5 -> "31.31k".
fn sig4(x: f64) -> String {
    let (v, unit) = match x.abs() {
        a if a >= 1e9 => (x / 1e9, "G"),
        a if a >= 1e6 => (x / 1e6, "M"),
        a if a >= 1e4 => (x / 1e3, "k"),
        _ => (x, ""),
    };
    let decimals = if v.abs() >= 1000.0 {
        0
    } else if v.abs() >= 100.0 {
        1
    } else if v.abs() >= 10.0 {
        2
    } else {
        3
    };
    format!("{v:.decimals$}{unit}")
}

/// 1536 -> "1.5 KiB".
pub fn bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_once_and_the_scored_ones_in_the_leaderboards_order() {
        for (i, m) in Metric::ALL.iter().enumerate() {
            assert!(!Metric::ALL[..i].contains(m), "{m:?} twice");
        }
        assert_eq!(Metric::ALL[..Metric::SCORED.len()], Metric::SCORED);
        assert_eq!(
            Metric::SCORED.map(Metric::name),
            [
                "time to target s",
                "tokens/s",
                "step p50 ms",
                "step p99 ms",
                "step p99.9 ms",
                "MFU",
                "peak memory",
                "bytes/step",
                "goodput steps/s"
            ]
        );
    }

    #[test]
    fn values_are_read_and_written_per_metric() {
        let m = Metrics { tokens_per_s: 31_312.5, mfu: Some(0.4123), steps: 4, bytes_on_wire: 6144, ..Default::default() };
        let cell = |metric: Metric| metric.value(&m).map(|x| metric.format(x));
        assert_eq!(cell(Metric::TokensPerS).as_deref(), Some("31.31k"));
        assert_eq!(cell(Metric::Mfu).as_deref(), Some("41.2%"));
        assert_eq!(cell(Metric::BytesPerStep).as_deref(), Some("1.5 KiB"));
        assert_eq!(cell(Metric::Goodput), None);
        assert_eq!(Metric::StepP99.format_summary(None), "-");
        let one = Summary { n: 1, olympic_mean: 2.5, median: 2.5, ci95: None };
        assert_eq!(Metric::TimeToTarget.format_summary(Some(&one)), "2.50 (n=1)");
    }
}
