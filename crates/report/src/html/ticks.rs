//! Axis ticks for the page's plots: on a linear axis, a nice step (1, 2,
//! 2.5 or 5 × 10^k) and a range widened to whole steps around the data; on
//! a log axis (the forest plot's ratios), ticks at 1, 2 and 5 × 10^k (or
//! finer, or whole decades, whichever bounds the data most tightly without
//! crowding), the range ending on ticks. Labels are as short as the step
//! allows ("0.25", "2.5", "40k").

/// An axis: its range, which holds the data and ends on ticks (until a
/// plot pads it), and its ticks, ascending.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Axis {
    pub lo: f64,
    pub hi: f64,
    pub ticks: Vec<f64>,
    /// The distance between ticks; 0 on a log axis.
    pub step: f64,
}

/// The smallest of 1, 2, 2.5, 5 × 10^k that is at least `span / n`.
pub(super) fn nice_step(span: f64, n: usize) -> f64 {
    let raw = span / n.max(1) as f64;
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0].into_iter().map(|m| m * p).find(|s| *s >= raw * (1.0 - 1e-9)).unwrap_or(10.0 * p)
}

/// A linear axis over the data range `(lo, hi)` with at most about `n`
/// steps: the step is [`nice_step`], the range whole steps that hold
/// `lo` and `hi`. A range of one value is widened around it; a range that
/// is not finite becomes 0 to 1.
pub(super) fn linear(lo: f64, hi: f64, n: usize) -> Axis {
    let (lo, hi) = if lo.is_finite() && hi.is_finite() { (lo.min(hi), lo.max(hi)) } else { (0.0, 1.0) };
    let (lo, hi) = if hi - lo <= 1e-12 * lo.abs().max(1.0) {
        let d = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        (lo - d, hi + d)
    } else {
        (lo, hi)
    };
    let step = nice_step(hi - lo, n);
    let (a, b) = ((lo / step + 1e-9).floor() as i64, (hi / step - 1e-9).ceil() as i64);
    // Each tick a multiple of the step, with no -0.
    let ticks: Vec<f64> = (a..=b).map(|k| tidy(k as f64 * step) + 0.0).collect();
    Axis { lo: ticks[0], hi: ticks[ticks.len() - 1], ticks, step }
}

/// Mantissas of log ticks, coarse to fine.
const LOG_SETS: [&[f64]; 4] =
    [&[1.0], &[1.0, 2.0, 5.0], &[1.0, 1.5, 2.0, 3.0, 5.0, 7.0], &[1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0]];

/// A log axis over the positive data range `(lo, hi)` with at most
/// `most` ticks (at least 2): of the tick sets 10^k, (1, 2, 5) × 10^k and
/// two finer ones, the one whose ticks around the data bound it most
/// tightly; the range runs from the tick at or below `lo` to the one at or
/// above `hi`.
pub(super) fn log(lo: f64, hi: f64, most: usize) -> Axis {
    let lo = if lo.is_finite() && lo > 0.0 { lo } else { 1e-3 };
    let hi = if hi.is_finite() && hi > lo { hi } else { lo * 10.0 };
    let mut best: Option<Axis> = None;
    for set in LOG_SETS {
        let e0 = lo.log10().floor() as i32 - 1;
        let e1 = hi.log10().ceil() as i32 + 1;
        let all: Vec<f64> = (e0..=e1).flat_map(|e| set.iter().map(move |m| tidy(m * 10f64.powi(e)))).collect();
        let eps = 1e-9;
        let (Some(&a), Some(&b)) = (all.iter().rev().find(|v| **v <= lo * (1.0 + eps)), all.iter().find(|v| **v >= hi * (1.0 - eps)))
        else {
            continue;
        };
        let ticks: Vec<f64> = all.iter().copied().filter(|v| *v >= a && *v <= b).collect();
        let fits = (2..=most.max(2)).contains(&ticks.len());
        let tighter = best.as_ref().is_none_or(|x| (b / a).ln() < (x.hi / x.lo).ln() - 1e-9);
        if fits && tighter {
            best = Some(Axis { lo: a, hi: b, ticks, step: 0.0 });
        }
    }
    best.unwrap_or_else(|| {
        // Too wide for whole decades: every k-th decade.
        let (e0, e1) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
        let k = ((e1 - e0) as usize).div_ceil(most.max(2) - 1).max(1) as i32;
        let e1 = e0 + (e1 - e0 + k - 1) / k * k;
        let ticks: Vec<f64> = (e0..=e1).step_by(k as usize).map(|e| tidy(10f64.powi(e))).collect();
        Axis { lo: ticks[0], hi: ticks[ticks.len() - 1], ticks, step: 0.0 }
    })
}

/// `v` rounded to 12 significant digits (so 3 × 0.1 is 0.3).
pub(super) fn tidy(v: f64) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let p = 10f64.powi(11 - v.abs().log10().floor() as i32);
    (v * p).round() / p
}

/// The fewest decimals (up to 6) that write `v` exactly.
fn decimals(v: f64) -> usize {
    (0..6)
        .find(|d| {
            let s = v * 10f64.powi(*d as i32);
            (s - s.round()).abs() < 1e-6 * s.abs().max(1.0)
        })
        .unwrap_or(6)
}

impl Axis {
    /// A tick's label: in thousands ("40k"), millions or billions when
    /// the axis reaches 10,000 or more, with the decimals the step needs
    /// (on a log axis, the tick itself).
    pub fn label(&self, v: f64) -> String {
        if v == 0.0 {
            return "0".to_owned();
        }
        let top = self.lo.abs().max(self.hi.abs());
        let (scale, suffix) = [(1e9, "G"), (1e6, "M"), (1e3, "k")].into_iter().find(|(s, _)| top >= 10.0 * s).unwrap_or((1.0, ""));
        let d = decimals(if self.step > 0.0 { self.step / scale } else { tidy(v / scale) });
        format!("{:.*}{suffix}", d, v / scale + 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `m` × 10^k for m in 1, 2, 2.5, 5.
    fn is_nice(step: f64) -> bool {
        let m = step / 10f64.powf(step.log10().floor());
        [1.0, 2.0, 2.5, 5.0, 10.0].iter().any(|n| (m - n).abs() < 1e-9)
    }

    #[test]
    fn linear_ticks_are_nice_steps_that_cover_the_data() {
        // The loss and time axes of the old page: 0.91..5.95, 0..108.
        let a = linear(0.91, 5.95, 5);
        assert_eq!((a.lo, a.hi, a.step), (0.0, 6.0, 2.0));
        assert_eq!(a.ticks, [0.0, 2.0, 4.0, 6.0]);
        assert_eq!(linear(0.0, 108.0, 5).ticks, [0.0, 25.0, 50.0, 75.0, 100.0, 125.0]);
        assert_eq!(linear(0.0, 6.94, 5).ticks, [0.0, 2.0, 4.0, 6.0, 8.0]);
        assert_eq!(linear(1.03, 3.31, 5).ticks, [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]);
        for (lo, hi) in [(0.91, 5.95), (1e-4, 3e-4), (-3.2, 7.7), (12345.0, 98765.0), (0.0, 1.0), (2.0, 2.0), (-5.0, -5.0)] {
            for n in [3, 5, 8] {
                let a = linear(lo, hi, n);
                assert!(is_nice(a.step), "{lo}..{hi}/{n}: step {}", a.step);
                assert!(a.lo <= lo && a.hi >= hi && a.lo < a.hi, "{lo}..{hi}/{n}: {a:?}");
                assert_eq!(a.ticks.first(), Some(&a.lo));
                assert_eq!(a.ticks.last(), Some(&a.hi));
                assert!(a.ticks.len() >= 2 && a.ticks.len() <= n + 3, "{lo}..{hi}/{n}: {a:?}");
                assert!(a.ticks.windows(2).all(|w| ((w[1] - w[0]) - a.step).abs() < 1e-9 * a.step.max(1.0)), "{a:?}");
            }
        }
        assert_eq!(nice_step(7.0, 4), 2.0);
        assert_eq!(nice_step(9.0, 4), 2.5);
        assert_eq!(nice_step(0.3, 5), 0.1);
        assert_eq!(linear(f64::NAN, 1.0, 5).ticks, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]);
    }

    #[test]
    fn labels_have_the_decimals_of_the_step() {
        let a = linear(0.0, 1.0, 4);
        assert_eq!(labels(&a), ["0", "0.25", "0.50", "0.75", "1.00"]);
        let a = linear(0.0, 9.0, 4);
        assert_eq!(labels(&a), ["0", "2.5", "5.0", "7.5", "10.0"]);
        let a = linear(0.0, 180_000.0, 4);
        assert_eq!(labels(&a), ["0", "50k", "100k", "150k", "200k"]);
        let a = linear(0.0, 2400.0, 5);
        assert_eq!(a.label(1000.0), "1000");
        assert_eq!(linear(-1.0, 1.0, 4).label(-0.0), "0");
    }

    fn labels(a: &Axis) -> Vec<String> {
        a.ticks.iter().map(|t| a.label(*t)).collect()
    }

    #[test]
    fn log_ticks_are_one_two_five_and_bound_the_data() {
        // A ratio axis around 0.4 to 3, with the baseline's 1.
        let a = log(0.4, 3.0, 5);
        assert_eq!((a.lo, a.hi), (0.2, 5.0));
        assert_eq!(a.ticks, [0.2, 0.5, 1.0, 2.0, 5.0]);
        assert_eq!(labels(&a), ["0.2", "0.5", "1", "2", "5"]);
        // Wide: whole decades.
        assert_eq!(log(0.012, 45.0, 5).ticks, [0.01, 0.1, 1.0, 10.0, 100.0]);
        // Narrow: finer ticks, still with 1 among them.
        let a = log(0.86, 1.1, 5);
        assert_eq!(a.ticks, [0.8, 1.0, 1.2]);
        // Too wide for decades: every other one.
        let a = log(1e-6, 1e6, 5);
        assert!(a.ticks.len() <= 7 && a.lo <= 1e-6 && a.hi >= 1e6, "{a:?}");
        for (lo, hi) in [(0.4, 3.0), (0.9, 1.002), (0.05, 0.07), (3.2, 5.8), (0.001, 1.0), (1.0, 1.0)] {
            let a = log(lo, hi, 5);
            assert!(a.lo <= lo * (1.0 + 1e-9) && a.hi >= hi * (1.0 - 1e-9), "{lo}..{hi}: {a:?}");
            assert!((2..=5).contains(&a.ticks.len()), "{lo}..{hi}: {a:?}");
            assert!(a.ticks.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
