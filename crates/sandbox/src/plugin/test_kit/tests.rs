use anyhow::anyhow;

use super::compressor::{first_difference, Inputs};
use super::*;

#[test]
fn said_tells_a_refusal_from_a_failure() {
    let refused =
        anyhow!("compressor plugin `t.wasm` (wasm, /t.wasm) returned an error from `configure`: unknown config key `x` (known: a)");
    assert!(matches!(said(&refused, "configure"), Said::Refused(m) if m == "unknown config key `x` (known: a)"));
    let trapped = anyhow!("compressor plugin `t.wasm` (wasm, /t.wasm) failed in `configure`: wasm trap: unreachable\nstderr: ...");
    assert!(matches!(said(&trapped, "configure"), Said::Failed(m) if m == "wasm trap: unreachable"));
}

#[test]
fn inputs_are_the_same_every_time_and_differ_between_ranks() {
    let (a, b) = (Inputs::new(2, 2), Inputs::new(2, 2));
    assert_eq!(a.data, b.data);
    assert_ne!(a.data[1][2][0], a.data[1][2][1]);
    assert_ne!(a.data[0][3][0], a.data[1][3][0]);
    let x = &a.data[0][3][0];
    let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / x.len() as f64;
    let var = x.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / x.len() as f64;
    assert!(mean.abs() < 0.02 && (var - 1.25).abs() < 0.05, "mean {mean}, variance {var}");
}

#[test]
fn the_layouts_fill_the_buckets() {
    let layouts = bucket_layouts();
    for (l, &n) in layouts.iter().zip(&BUCKET_SIZES) {
        assert_eq!(l.numel, n as u64);
        assert_eq!(l.params.iter().map(|p| p.numel).sum::<u64>(), n as u64);
    }
    let last = &layouts[3].params;
    assert_eq!((last[1].offset, last[1].shape.as_slice(), last[1].weight), (49152, &[120u64, 128][..], true));
    assert!(!last[2].weight && layouts[2].params[0].weight);
}

#[test]
fn first_difference_compares_bits() {
    assert_eq!(first_difference(&[0.0, 1.0], &[0.0, 1.0]), None);
    assert_eq!(first_difference(&[0.0, 1.0], &[-0.0, 1.0]), Some(0));
    assert_eq!(first_difference(&[f32::NAN], &[f32::NAN]), None);
    assert_eq!(first_difference(&[1.0], &[1.0, 2.0]), Some(1));
}
