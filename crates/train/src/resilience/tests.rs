use super::*;
use harness_format::suite::FaultSpec;

#[test]
fn listed_failures_strike_once_and_random_ones_follow_the_mtbf() {
    let spec = FaultSpec { at_steps: vec![3, 7], ..FaultSpec::default() };
    let mut c = FaultClock::new(&spec, 1, 0);
    let hits: Vec<u64> = (1..=10).filter(|&s| c.strikes(s, 0.0).0).collect();
    assert_eq!(hits, vec![3, 7]);
    assert!(!c.strikes(3, 0.0).0, "a listed failure struck twice (after a restore)");

    // 20,000 draws with mean 5 s: the mean interval is 5 s within 3%.
    let spec = FaultSpec { mtbf_s: Some(5.0), seed: Some(9), ..FaultSpec::default() };
    let mut c = FaultClock::new(&spec, 1, 0);
    let (mut n, mut t) = (0u32, 0.0);
    while n < 20_000 {
        t += 0.01;
        if c.strikes(0, t).0 {
            n += 1;
        }
    }
    assert!((t / n as f64 - 5.0).abs() < 0.15, "mean time between failures {}", t / n as f64);
    // Other ranks follow rank 0 through a collective.
    assert!(FaultClock::new(&spec, 1, 1).random.is_none());
}

#[test]
fn the_fault_budget_ends_an_entry_that_fails_faster_than_it_trains() {
    // Issue 61: `mtbf_s = 1e-300` restarted a 50-step entry for ever.
    // Every step of 2 ms fails, and its restore takes 1 ms.
    let spec = FaultSpec { mtbf_s: Some(1e-3), ..FaultSpec::default() };
    let mut b = FaultBudget::new(&spec, Some(50), None);
    let (mut t, mut lost, mut restarts) = (0.0, 0.0, 0u64);
    let ended = loop {
        t += 0.002;
        b.stepped(t);
        if let Some(over) = b.overrun(restarts, lost + 0.002) {
            break over;
        }
        lost += 0.003;
        t += 0.001;
        b.resumed(t);
        restarts += 1;
        assert!(restarts < 1000, "no budget ended it");
    };
    // Failure-free: 50 steps of 2 ms (restores left out), 0.1 s; ten
    // times that, 1 s, is lost at the 334th failure (3 ms each).
    assert_eq!(ended, Budget::TimeLost);
    assert!((b.failure_free_s().unwrap() - 0.1).abs() < 1e-9, "{:?}", b.failure_free_s());
    assert_eq!(restarts, 333);
    let e = b.exhausted(ended, 1, restarts, lost + 0.002).to_string();
    assert!(e.contains("`faults.max_time_lost_ratio` = 10 times the entry's failure-free training time (about 0.100 s)"), "{e}");
    assert!(e.contains("failure 334 struck at step 1, and the 334 failures lost 1.001 s of training"), "{e}");
    assert!(e.contains("Its steps take about 2.000 ms"), "{e}");

    // The restart budget, whatever the time.
    let spec = FaultSpec { at_steps: vec![1], max_restarts: Some(3), ..FaultSpec::default() };
    let b = FaultBudget::new(&spec, Some(50), None);
    assert_eq!(b.overrun(2, 1e9), None, "no step measured yet: only restarts count");
    assert_eq!(b.overrun(3, 0.0), Some(Budget::Restarts));
    assert!(b.exhausted(Budget::Restarts, 9, 3, 0.5).to_string().starts_with(
        "injected failures exhausted the restart budget, `faults.max_restarts` = 3: failure 4 struck at step 9, and the 4 failures lost 0.500 s"
    ));

    // A time budget bounds the failure-free time; the shorter counts.
    let spec = FaultSpec { mtbf_s: Some(1.0), ..FaultSpec::default() };
    let mut b = FaultBudget::new(&spec, None, Some(60.0));
    assert_eq!(b.failure_free_s(), Some(60.0));
    assert_eq!(b.overrun(5, 599.0), None);
    b = FaultBudget::new(&spec, Some(1000), Some(60.0));
    b.stepped(0.01);
    assert_eq!(b.failure_free_s(), Some(10.0));
    // The ranks agree on the budget as a number.
    for x in [None, Some(Budget::Restarts), Some(Budget::TimeLost)] {
        assert_eq!(Budget::of_code(x.map_or(0.0, Budget::code)), x);
    }
}

#[test]
fn a_checkpoint_holding_nan_or_infinity_is_refused_naming_the_tensor() {
    let snap = |v: f32| Snapshot {
        position: Position { step: 40, data_position: 160, micro_batch: 4, accum_steps: 1, lr_scale: 1.0 },
        model: vec![("w".into(), Tensor::from_slice(&[1.0f32, v]))],
        state: vec![("rng/cpu".into(), Tensor::from_slice(&[255u8])), ("optimizer/exp_avg.0".into(), Tensor::from_slice(&[v as f64]))],
        plugins: Vec::new(),
        ready: None,
    };
    let dir = std::path::Path::new("/results/run.checkpoints/w_a_r0/step-00000040");
    finite(&snap(2.0), dir).unwrap();
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let e = format!("{:#}", finite(&snap(bad), dir).unwrap_err());
        assert_eq!(e, format!("checkpoint {} refused: `model: tensor w` holds NaN or infinite values", dir.display()));
    }
    let mut s = snap(2.0);
    s.state[1].1 = Tensor::from_slice(&[f64::NAN]);
    let e = format!("{:#}", finite(&s, dir).unwrap_err());
    assert!(e.contains("`state: tensor optimizer/exp_avg.0` holds NaN"), "{e}");
}
