//! Latency histograms as results store them: nanosecond HDR histograms
//! (3 significant digits, 1 ns to 1 h), their text encoding (HdrHistogram
//! V2, base64) and their percentile summary.

use std::time::Duration;

use base64::Engine;
use hdrhistogram::serialization::{Deserializer, Serializer, V2Serializer};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// A latency histogram in nanoseconds (3 significant digits, 1 ns to 1 h).
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds")
}

/// Records a duration, clamped into the histogram's range.
pub fn record(h: &mut Histogram<u64>, d: Duration) {
    h.saturating_record((d.as_nanos() as u64).max(1));
}

/// Serializes a histogram (HdrHistogram V2 format, base64).
pub fn encode(h: &Histogram<u64>) -> String {
    let mut buf = Vec::new();
    V2Serializer::new().serialize(h, &mut buf).expect("serializing to memory cannot fail");
    base64::engine::general_purpose::STANDARD.encode(buf)
}

/// Reads a histogram written by [`encode`].
pub fn decode(s: &str) -> anyhow::Result<Histogram<u64>> {
    let bytes = base64::engine::general_purpose::STANDARD.decode(s)?;
    Ok(Deserializer::new().deserialize(&mut bytes.as_slice())?)
}

/// Percentiles of a latency histogram, in milliseconds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

impl LatencySummary {
    /// Summarises a nanosecond histogram.
    pub fn of(h: &Histogram<u64>) -> LatencySummary {
        let ms = |ns: u64| ns as f64 / 1e6;
        LatencySummary {
            count: h.len(),
            mean_ms: h.mean() / 1e6,
            p50_ms: ms(h.value_at_quantile(0.5)),
            p90_ms: ms(h.value_at_quantile(0.9)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            p999_ms: ms(h.value_at_quantile(0.999)),
            max_ms: ms(h.max()),
        }
    }
}
