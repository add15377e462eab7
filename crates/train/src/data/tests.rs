use super::*;

#[test]
fn the_stream_depends_on_the_seed_alone_not_on_workers_or_seeking() {
    let src = Arc::new(SampleSource::Gaussian { dim: 3 });
    let take = |p: &mut Prefetch, n: usize| {
        (0..n)
            .map(|_| match p.next() {
                Sample::Gaussian(x, e) => (x, e),
                Sample::Tokens(_) | Sample::Image(_) => unreachable!("a Gaussian source"),
            })
            .collect::<Vec<_>>()
    };
    let one = take(&mut Prefetch::start(src.clone(), 7, 2, 16, 0, 1), 20);
    let three = take(&mut Prefetch::start(src.clone(), 7, 2, 16, 0, 3), 20);
    assert_eq!(one, three, "the number of data threads changed the stream");
    let later = take(&mut Prefetch::start(src.clone(), 7, 2, 16, 11, 3), 9);
    assert_eq!(&one[11..], &later[..], "seeking to sample 11 did not give the samples from 11 on");
    let other = take(&mut Prefetch::start(src, 8, 2, 16, 0, 1), 20);
    assert_ne!(one, other);
}

#[test]
fn collated_batches_hold_the_stream_in_order_whatever_their_sizes() {
    let spec = ImageSpec { classes: 4, size: 8, channels: 2, noise: 0.1, label_noise: 0.2, padding: 1, seed: 1 };
    let src = Arc::new(SampleSource::Images(ImageSource::new(spec, true).unwrap()));
    let mut one = Prefetch::start(src.clone(), 5, 1, 16, 0, 1);
    let (want_x, want_y): (Vec<Vec<f32>>, Vec<i64>) = (0..40)
        .map(|_| match one.next() {
            Sample::Image(i) => (i.pixels, i.label),
            _ => unreachable!("an image source"),
        })
        .unzip();
    // Sizes that change, as a batch policy changes them: fewer rows than
    // were collated ahead, then more.
    let mut c = Collator::start(Prefetch::start(src, 5, 1, 16, 0, 3), [2, 8, 8], None);
    let mut at = 0;
    for n in [4, 4, 2, 7, 3, 3, 9, 8] {
        let (x, y) = c.next(n);
        assert_eq!(x.size(), [n as i64, 2, 8, 8]);
        assert_eq!(Vec::<i64>::try_from(&y).unwrap(), want_y[at..at + n], "labels of rows {at}..{}", at + n);
        let px = Vec::<f32>::try_from(&x.reshape([-1])).unwrap();
        assert_eq!(px, want_x[at..at + n].concat(), "pixels of rows {at}..{}", at + n);
        at += n;
    }
}

#[test]
fn images_cast_as_they_are_made_hold_the_same_values_rounded() {
    let spec: DataSpec = toml::from_str("kind = \"images\"\nclasses = 4\nimage_size = 16\nchannels = 3\nnoise = 0.1\nthreads = 1").unwrap();
    let data = || Data::new(&spec, Path::new("."), 1, 0, 9, Device::Cpu).unwrap();
    let (mut plain, mut cast) = (data(), data());
    cast.images_in(Kind::BFloat16);
    for n in [4, 3] {
        let (want, got) = (plain.next_train(n), cast.next_train(n));
        assert_eq!(got.input.kind(), Kind::BFloat16);
        assert!(got.input.equal(&want.input.to_kind(Kind::BFloat16)), "batch of {n}: not the fp32 images rounded to bf16");
        assert!(got.target.equal(&want.target), "batch of {n}: the labels changed");
    }
}

/// Regression data of `seq_len` 8 and width 16 drawn through `pipeline`.
fn regression(pipeline: Pipeline, seed: u64) -> Data {
    let spec = DataSpec::Regression { noise: 0.5, pipeline: Some(pipeline), seed: None };
    Data::new(&spec, Path::new("."), 8, 16, seed, Device::Cpu).unwrap()
}

#[test]
fn device_regression_streams_are_fixed_by_seed_and_batch_sizes_and_restore() {
    let batches = |d: &mut Data| [4, 3, 5].map(|n| d.next_train(n));
    let one = batches(&mut regression(Pipeline::Device, 3));
    let again = batches(&mut regression(Pipeline::Device, 3));
    for (a, b) in one.iter().zip(&again) {
        assert!(a.input.equal(&b.input) && a.target.equal(&b.target), "the same seed gave another stream");
    }
    assert_eq!(one[1].input.size(), [3, 8, 16]);
    assert_eq!(one[1].target.size(), [3]);
    assert!(!one[0].input.equal(&batches(&mut regression(Pipeline::Device, 4))[0].input), "another seed gave the same inputs");
    // A restore seeks to the position a checkpoint recorded.
    let mut restored = regression(Pipeline::Device, 3);
    restored.seek(4);
    let (b1, b2) = (restored.next_train(3), restored.next_train(5));
    assert!(b1.input.equal(&one[1].input) && b2.target.equal(&one[2].target), "seeking did not repeat the stream");
    assert_eq!(restored.position(), 12);
}

#[test]
fn device_and_host_regression_inputs_follow_the_same_law() {
    // Inputs unit normal; the target is w . mean_t(x) sqrt(t) (unit
    // variance) plus noise 0.5: variance 1.25, and a residual of
    // variance 0.25, the loss floor.
    for pipeline in [Pipeline::Host, Pipeline::Device] {
        let mut d = regression(pipeline, 9);
        assert_eq!(d.loss_floor(), Some(0.25));
        let b = d.next_train(4000);
        let x = &b.input;
        let (mean, var) = (x.mean(Kind::Float).double_value(&[]), x.var(true).double_value(&[]));
        assert!(mean.abs() < 0.01 && (var - 1.0).abs() < 0.01, "{pipeline:?}: inputs of mean {mean}, variance {var}");
        let y = &b.target;
        let vy = y.var(true).double_value(&[]);
        assert!((vy - 1.25).abs() < 0.1, "{pipeline:?}: targets of variance {vy}");
        let (w, _) = d.regression.as_ref().unwrap();
        let residual = y - x.mean_dim(1, false, Kind::Float).matmul(w) * 8f64.sqrt();
        let vr = residual.var(true).double_value(&[]);
        assert!((vr - 0.25).abs() < 0.03, "{pipeline:?}: residual of variance {vr}");
    }
}

/// Joint entropy H(X_1..X_n) of the stationary chain, by enumerating every
/// sequence of length n.
fn joint_entropy(c: &MarkovChain, n: usize) -> f64 {
    let v = c.vocab();
    let mut h = 0.0;
    let mut seq = vec![0usize; n];
    loop {
        let mut p = c.stationary()[seq[0]];
        for i in 1..n {
            p *= c.prob(seq[i - 1], seq[i]);
        }
        if p > 0.0 {
            h -= p * p.ln();
        }
        // Next sequence in lexicographic order.
        let mut i = n;
        loop {
            if i == 0 {
                return h;
            }
            i -= 1;
            seq[i] += 1;
            if seq[i] < v {
                break;
            }
            seq[i] = 0;
        }
    }
}

#[test]
fn entropy_rate_matches_brute_force() {
    for (v, k, seed) in [(3, 2, 1), (4, 3, 7), (5, 2, 42), (4, 1, 3)] {
        let c = MarkovChain::new(v, k, seed);
        // Stationary: H(X_n | X_1..X_{n-1}) = H_n - H_{n-1} equals the
        // entropy rate for every n >= 2.
        for n in 2..=6 {
            let cond = joint_entropy(&c, n) - joint_entropy(&c, n - 1);
            assert!((cond - c.entropy_rate()).abs() < 1e-10, "v={v} k={k} n={n}: {cond} vs {}", c.entropy_rate());
        }
    }
}

#[test]
fn stationary_distribution_is_invariant() {
    let c = MarkovChain::new(50, 4, 9);
    let pi = c.stationary();
    for t in 0..50 {
        let next: f64 = (0..50).map(|s| pi[s] * c.prob(s, t)).sum();
        assert!((next - pi[t]).abs() < 1e-12);
    }
    assert!((pi.iter().sum::<f64>() - 1.0).abs() < 1e-12);
}

#[test]
fn samples_have_the_computed_cross_entropy() {
    // The true model's average log-loss on samples converges to the rate.
    let c = MarkovChain::new(64, 4, 11);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut seq = Vec::new();
    c.sample_into(&mut rng, 400_000, &mut seq);
    let nll: f64 = seq.windows(2).map(|w| -c.prob(w[0] as usize, w[1] as usize).ln()).sum::<f64>() / (seq.len() - 1) as f64;
    assert!((nll - c.entropy_rate()).abs() < 0.01, "{nll} vs {}", c.entropy_rate());
}

#[test]
fn token_files_with_and_without_llmc_header() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u16> = (0..1000).map(|i| (i * 7 % 300) as u16).collect();
    let raw = dir.path().join("raw.bin");
    std::fs::write(&raw, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<_>>()).unwrap();
    let llmc = dir.path().join("llmc.bin");
    let mut bytes = Vec::new();
    let mut header = [0i32; 256];
    header[0] = LLMC_MAGIC;
    header[1] = 1;
    header[2] = tokens.len() as i32;
    bytes.extend(header.iter().flat_map(|x| x.to_le_bytes()));
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    std::fs::write(&llmc, bytes).unwrap();
    for p in [raw, llmc] {
        let f = TokenFile::open(&p).unwrap();
        assert_eq!(f.len(), 1000);
        assert!((0..1000).all(|i| f.get(i) == tokens[i]));
    }
}
