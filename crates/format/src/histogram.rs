//! Latency histograms as results store them: nanosecond HDR histograms
//! (3 significant digits, 1 ns to 1 h), their text encoding (HdrHistogram
//! V2, base64) and their percentile summary.
//!
//! A histogram in a result file is a stranger's bytes: [`decode`] checks
//! everything the decoder would size an allocation by before it decodes
//! (the text's length, the format, the payload length the header declares,
//! the bounds that size the counts array), so a histogram of a few bytes
//! can never ask for more than a histogram of our own bounds holds.

use std::time::Duration;

use base64::Engine;
use hdrhistogram::serialization::{Deserializer, Serializer, V2Serializer};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// The lowest value a histogram tracks: 1 ns.
const LOWEST_NS: u64 = 1;
/// The highest value a histogram tracks: 1 h in nanoseconds.
const HIGHEST_NS: u64 = 3_600_000_000_000;
/// Significant decimal digits a histogram keeps.
const DIGITS: u8 = 3;

/// The counters of a histogram of our bounds. 3 digits need 2 * 10^3
/// sub-buckets, rounded up to 2048 (half of them, 1024, per bucket after
/// the first); a bucket doubles the range, and 2048 * 2^30 < 3.6e12 <=
/// 2048 * 2^31, so 32 buckets cover 1 h; hdrhistogram keeps (32 + 1) *
/// 1024 counters. Pinned against [`new_histogram`] by a test.
const COUNTS: usize = 33 * 1024;
/// The V2 header: cookie, payload length, normalizing offset, digits (4
/// bytes each), lowest, highest (8 each), integer-to-double ratio (8).
const HEADER_BYTES: usize = 40;
/// The most payload bytes a histogram of our bounds encodes to: V2 writes
/// each counter, or each run of zero counters, as one LEB128-64b9B varint
/// of at most 9 bytes (hdrhistogram's `counts_array_max_encoded_size`).
pub const MAX_PAYLOAD_BYTES: usize = 9 * COUNTS;
/// The most base64 characters a histogram of our bounds encodes to: the
/// header and the largest payload, 4 characters per 3 bytes (405,560).
pub const MAX_TEXT_CHARS: usize = (HEADER_BYTES + MAX_PAYLOAD_BYTES).div_ceil(3) * 4;

/// HdrHistogram's V2 cookie (what [`encode`] writes), and the cookie of
/// its DEFLATE-compressed variant, which [`decode`] refuses: a few bytes of
/// it inflate to any size.
const V2_COOKIE: u32 = 0x1c84_9313;
const V2_DEFLATE_COOKIE: u32 = 0x1c84_9314;

/// Why a histogram's text was refused. Each says which part of the
/// encoding is wrong and what harness accepts.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    #[error("the histogram's text has {chars} characters; one of harness's histograms (1 ns to 1 h, 3 digits) encodes in at most {MAX_TEXT_CHARS}")]
    TooLong { chars: usize },
    #[error("the histogram is not base64: {0}")]
    Base64(String),
    #[error("the histogram has {bytes} bytes, fewer than the {HEADER_BYTES} of an HdrHistogram V2 header (truncated?)")]
    Truncated { bytes: usize },
    #[error(
        "the histogram is compressed (HdrHistogram V2 with DEFLATE, cookie {V2_DEFLATE_COOKIE:#010x}); harness reads the uncompressed V2 format it writes (cookie {V2_COOKIE:#010x}) only"
    )]
    Compressed,
    #[error("the histogram's cookie (bytes 0..4) is {found:#010x}, not HdrHistogram V2's {V2_COOKIE:#010x}")]
    Cookie { found: u32 },
    #[error(
        "the histogram's header declares a payload of {declared} bytes (bytes 4..8), but {present} bytes follow the header (at most {MAX_PAYLOAD_BYTES} for harness's histograms)"
    )]
    PayloadLength { declared: u32, present: usize },
    #[error("the histogram's header field `{field}` is {found}; harness's histograms have {expected}")]
    Header { field: &'static str, found: String, expected: String },
    #[error("the histogram's counts do not decode: {0}")]
    Counts(String),
}

/// A latency histogram in nanoseconds (3 significant digits, 1 ns to 1 h).
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(LOWEST_NS, HIGHEST_NS, DIGITS).expect("valid histogram bounds")
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

/// Reads a histogram written by [`encode`], and nothing else: the text is
/// at most [`MAX_TEXT_CHARS`] long, uncompressed V2, its header declares
/// the payload that follows it, and its bounds are [`new_histogram`]'s, so
/// that decoding allocates a counts array of the known size and a payload
/// buffer of at most [`MAX_PAYLOAD_BYTES`]. (hdrhistogram's deserializer
/// sizes both by the header: 4 bytes set to 0xFFFFFFF0 asked for 4 GiB.)
pub fn decode(s: &str) -> Result<Histogram<u64>, DecodeError> {
    if s.len() > MAX_TEXT_CHARS {
        return Err(DecodeError::TooLong { chars: s.len() });
    }
    let bytes = base64::engine::general_purpose::STANDARD.decode(s).map_err(|e| DecodeError::Base64(e.to_string()))?;
    check_header(&bytes)?;
    Deserializer::new().deserialize(&mut bytes.as_slice()).map_err(|e| DecodeError::Counts(e.to_string()))
}

/// Checks a V2 histogram's header against what [`encode`] writes for a
/// histogram of our bounds (hdrhistogram's `V2Serializer`, big-endian).
fn check_header(b: &[u8]) -> Result<(), DecodeError> {
    if b.len() < HEADER_BYTES {
        return Err(DecodeError::Truncated { bytes: b.len() });
    }
    let u32_at = |at: usize| u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    match u32_at(0) {
        V2_COOKIE => {}
        V2_DEFLATE_COOKIE => return Err(DecodeError::Compressed),
        found => return Err(DecodeError::Cookie { found }),
    }
    let declared = u32_at(4);
    let present = b.len() - HEADER_BYTES;
    if declared as usize != present || present > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::PayloadLength { declared, present });
    }
    let field = |field: &'static str, found: String, expected: String| Err(DecodeError::Header { field, found, expected });
    if u32_at(8) != 0 {
        return field("normalizing index offset (bytes 8..12)", u32_at(8).to_string(), "0".into());
    }
    if u32_at(12) != u32::from(DIGITS) {
        return field("significant digits (bytes 12..16)", u32_at(12).to_string(), DIGITS.to_string());
    }
    if u64_at(16) != LOWEST_NS {
        return field("lowest trackable value (bytes 16..24)", format!("{} ns", u64_at(16)), format!("{LOWEST_NS} ns"));
    }
    if u64_at(24) != HIGHEST_NS {
        return field("highest trackable value (bytes 24..32)", format!("{} ns", u64_at(24)), format!("{HIGHEST_NS} ns (1 h)"));
    }
    let ratio = f64::from_be_bytes(b[32..40].try_into().expect("8 bytes"));
    if ratio != 1.0 {
        return field("integer-to-double ratio (bytes 32..40)", ratio.to_string(), "1".into());
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use hdrhistogram::serialization::V2DeflateSerializer;

    fn honest() -> Histogram<u64> {
        let mut h = new_histogram();
        for ms in [1u64, 2, 3, 5, 8, 13, 21, 34, 55, 89] {
            record(&mut h, Duration::from_millis(ms));
        }
        record(&mut h, Duration::from_secs(7200)); // clamped to 1 h
        h
    }

    /// The bytes of `h` encoded, changed by `edit`, as base64 again.
    fn edited(h: &Histogram<u64>, edit: impl FnOnce(&mut Vec<u8>)) -> String {
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut bytes = b64.decode(encode(h)).unwrap();
        edit(&mut bytes);
        b64.encode(bytes)
    }

    #[test]
    fn the_bounds_are_those_of_our_histograms() {
        let h = new_histogram();
        assert_eq!(h.distinct_values(), COUNTS, "COUNTS is the counts array of new_histogram()");
        // The fullest histogram (every counter non-zero and large) encodes
        // within the bounds.
        let mut full = new_histogram();
        let mut v = 1;
        while v <= HIGHEST_NS {
            full.record_n(v, u64::from(u32::MAX)).unwrap();
            v = full.next_non_equivalent(v);
        }
        let text = encode(&full);
        assert!(text.len() <= MAX_TEXT_CHARS, "{} > {MAX_TEXT_CHARS}", text.len());
        assert_eq!(decode(&text).unwrap(), full);
        assert_eq!(MAX_TEXT_CHARS, 405_560);
    }

    #[test]
    fn an_honest_histogram_round_trips() {
        let h = honest();
        let back = decode(&encode(&h)).unwrap();
        assert_eq!(back, h);
        assert_eq!(back.len(), 11);
        assert_eq!(back.max(), h.max());
        assert_eq!(decode(&encode(&new_histogram())).unwrap().len(), 0);
    }

    /// Issue 61: bytes 4..8 of a 156-byte step histogram set to 0xFFFFFFF0
    /// made hdrhistogram's deserializer allocate 4 GiB.
    #[test]
    fn a_declared_payload_of_4_gib_is_refused_before_anything_is_allocated() {
        let bomb = edited(&honest(), |b| b[4..8].copy_from_slice(&0xFFFF_FFF0u32.to_be_bytes()));
        let e = decode(&bomb).unwrap_err();
        assert!(matches!(e, DecodeError::PayloadLength { declared: 0xFFFF_FFF0, .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("declares a payload of 4294967280 bytes (bytes 4..8)") && msg.contains("at most 304128"), "{msg}");
        // A payload length short of the bytes present is refused as well.
        let short = edited(&honest(), |b| b[4..8].copy_from_slice(&1u32.to_be_bytes()));
        assert!(matches!(decode(&short), Err(DecodeError::PayloadLength { declared: 1, .. })));
    }

    #[test]
    fn a_truncated_histogram_is_refused() {
        let h = honest();
        let cut = edited(&h, |b| b.truncate(b.len() - 3));
        assert!(matches!(decode(&cut), Err(DecodeError::PayloadLength { .. })), "{:?}", decode(&cut));
        let header_only = edited(&h, |b| b.truncate(20));
        let e = decode(&header_only).unwrap_err();
        assert_eq!(e, DecodeError::Truncated { bytes: 20 });
        assert!(e.to_string().contains("fewer than the 40 of an HdrHistogram V2 header"), "{e}");
        assert!(matches!(decode("not base64!"), Err(DecodeError::Base64(_))));
    }

    #[test]
    fn a_compressed_histogram_is_refused() {
        let mut buf = Vec::new();
        V2DeflateSerializer::new().serialize(&honest(), &mut buf).unwrap();
        let text = base64::engine::general_purpose::STANDARD.encode(buf);
        let e = decode(&text).unwrap_err();
        assert_eq!(e, DecodeError::Compressed);
        assert!(e.to_string().contains("compressed (HdrHistogram V2 with DEFLATE, cookie 0x1c849314)"), "{e}");
        let other = edited(&honest(), |b| b[0..4].copy_from_slice(&0xdead_beefu32.to_be_bytes()));
        assert_eq!(decode(&other), Err(DecodeError::Cookie { found: 0xdead_beef }));
    }

    #[test]
    fn other_bounds_are_refused_naming_the_field() {
        // A wider histogram (1 ns to 2^62 ns, 5 digits) would size a far
        // larger counts array; the header says so before anything is sized.
        let wide = Histogram::<u64>::new_with_bounds(1, 1 << 62, 5).unwrap();
        let e = decode(&encode(&wide)).unwrap_err();
        assert!(e.to_string().contains("`significant digits (bytes 12..16)` is 5; harness's histograms have 3"), "{e}");
        let cases: [(usize, &[u8], &str); 4] = [
            (16, &2u64.to_be_bytes(), "`lowest trackable value (bytes 16..24)` is 2 ns; harness's histograms have 1 ns"),
            (24, &u64::MAX.to_be_bytes(), "`highest trackable value (bytes 24..32)` is 18446744073709551615 ns"),
            (8, &7u32.to_be_bytes(), "`normalizing index offset (bytes 8..12)` is 7"),
            (32, &2f64.to_be_bytes(), "`integer-to-double ratio (bytes 32..40)` is 2"),
        ];
        for (at, value, says) in cases {
            let text = edited(&honest(), |b| b[at..at + value.len()].copy_from_slice(value));
            let e = decode(&text).unwrap_err();
            assert!(matches!(e, DecodeError::Header { .. }) && e.to_string().contains(says), "{e}");
        }
    }

    #[test]
    fn text_longer_than_any_of_our_histograms_is_refused_unread() {
        let long = "A".repeat(MAX_TEXT_CHARS + 4);
        assert_eq!(decode(&long), Err(DecodeError::TooLong { chars: MAX_TEXT_CHARS + 4 }));
    }

    #[test]
    fn counts_past_the_array_are_refused() {
        // A payload within the bounds that skips past the last counter.
        let text = edited(&new_histogram(), |b| {
            b.truncate(HEADER_BYTES);
            // zig-zag(-40000) = 79999 as a varint, then a count of 1.
            b.extend_from_slice(&[0xff, 0xf0, 0x04, 0x02]);
            let n = (b.len() - HEADER_BYTES) as u32;
            b[4..8].copy_from_slice(&n.to_be_bytes());
        });
        assert!(matches!(decode(&text), Err(DecodeError::Counts(_))), "{:?}", decode(&text));
    }
}
