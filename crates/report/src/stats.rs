//! Statistics over repeats: olympic mean, median, bootstrap confidence
//! intervals, and the rule for calling a difference.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// Resamples drawn for a bootstrap interval.
pub const BOOTSTRAP_RESAMPLES: usize = 10_000;

/// One metric over the repeats of an entry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub n: usize,
    /// Mean without the smallest and the largest value when n >= 3 (MLPerf's
    /// olympic scoring); the plain mean otherwise.
    pub olympic_mean: f64,
    pub median: f64,
    /// Percentile-bootstrap 95% interval of the mean; None for n < 2.
    pub ci95: Option<(f64, f64)>,
}

/// Mean without the extremes (n >= 3), else the mean.
pub fn olympic_mean(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let core = if v.len() >= 3 { &v[1..v.len() - 1] } else { &v[..] };
    core.iter().sum::<f64>() / core.len() as f64
}

/// The median (mean of the middle two for even n).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Percentile-bootstrap 95% interval of the mean, with a fixed seed so a
/// report is reproducible. None for fewer than two values.
pub fn bootstrap_ci95(xs: &[f64], seed: u64) -> Option<(f64, f64)> {
    let n = xs.len();
    if n < 2 {
        return None;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut means: Vec<f64> =
        (0..BOOTSTRAP_RESAMPLES).map(|_| (0..n).map(|_| xs[rng.random_range(0..n)]).sum::<f64>() / n as f64).collect();
    means.sort_by(f64::total_cmp);
    let at = |q: f64| means[((q * (BOOTSTRAP_RESAMPLES - 1) as f64).round() as usize).min(BOOTSTRAP_RESAMPLES - 1)];
    Some((at(0.025), at(0.975)))
}

impl Summary {
    /// Summarises finite values; None when there are none.
    pub fn of(xs: &[f64]) -> Option<Summary> {
        let v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        Some(Summary { n: v.len(), olympic_mean: olympic_mean(&v), median: median(&v), ci95: bootstrap_ci95(&v, 0x5eed_b007) })
    }
}

/// How a candidate compares with the baseline on one metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The intervals do not overlap and the candidate is higher.
    Higher,
    /// The intervals do not overlap and the candidate is lower.
    Lower,
    /// The intervals overlap: no difference can be called.
    NotSignificant,
    /// Fewer than two repeats on a side: no interval, no call.
    TooFewRepeats,
}

/// Calls a difference only when the two 95% intervals are disjoint, a
/// conservative rule (it needs no assumption about the distributions).
pub fn compare(candidate: &Summary, baseline: &Summary) -> Verdict {
    match (candidate.ci95, baseline.ci95) {
        (Some((cl, ch)), Some((bl, bh))) => {
            if cl > bh {
                Verdict::Higher
            } else if ch < bl {
                Verdict::Lower
            } else {
                Verdict::NotSignificant
            }
        }
        _ => Verdict::TooFewRepeats,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn olympic_mean_drops_the_extremes() {
        assert_eq!(olympic_mean(&[10.0, 1.0, 2.0, 3.0, 100.0]), 5.0);
        assert_eq!(olympic_mean(&[4.0, 2.0]), 3.0);
        assert_eq!(olympic_mean(&[7.0]), 7.0);
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn bootstrap_interval_covers_the_mean_and_shrinks_with_n() {
        // Values with a known spread: the interval of the mean of n draws
        // has a width close to 2 x 1.96 x sd / sqrt(n).
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let draw = |rng: &mut ChaCha8Rng, n: usize| (0..n).map(|_| 10.0 + rng.random_range(-1.0..1.0)).collect::<Vec<f64>>();
        let small = draw(&mut rng, 10);
        let large = draw(&mut rng, 400);
        let (sl, sh) = bootstrap_ci95(&small, 1).unwrap();
        let (ll, lh) = bootstrap_ci95(&large, 1).unwrap();
        let mean = large.iter().sum::<f64>() / 400.0;
        assert!(ll < mean && mean < lh);
        assert!((lh - ll) < (sh - sl));
        // Uniform(-1, 1) has sd 1/sqrt(3); expected width 2 * 1.96 * 0.577 / 20.
        let want = 2.0 * 1.96 * (1.0f64 / 3.0).sqrt() / 20.0;
        assert!(((lh - ll) - want).abs() < 0.25 * want, "width {} vs {want}", lh - ll);
        assert_eq!(bootstrap_ci95(&[1.0], 1), None);
        // A constant sample has a zero-width interval.
        assert_eq!(bootstrap_ci95(&[2.0, 2.0, 2.0], 1), Some((2.0, 2.0)));
    }

    #[test]
    fn differences_are_called_only_on_disjoint_intervals() {
        let s = |xs: &[f64]| Summary::of(xs).unwrap();
        let base = s(&[100.0, 101.0, 99.0, 100.5, 99.5]);
        assert_eq!(compare(&s(&[120.0, 121.0, 119.0, 120.5, 119.5]), &base), Verdict::Higher);
        assert_eq!(compare(&s(&[80.0, 81.0, 79.0, 80.5, 79.5]), &base), Verdict::Lower);
        assert_eq!(compare(&s(&[100.2, 99.8, 101.0, 99.0, 100.0]), &base), Verdict::NotSignificant);
        assert_eq!(compare(&s(&[150.0]), &base), Verdict::TooFewRepeats);
    }
}
