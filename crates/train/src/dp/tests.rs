use std::sync::Arc;
use std::time::Duration;

use super::*;
use harness_runtime::comm::InProcessGroup;
use harness_sandbox::strategy::AllReduce;

/// Parameters of odd sizes (so that ZeRO pads) with values depending on
/// `seed` (not from libtorch's generator, which tests share).
fn params(seed: i64) -> Vec<Tensor> {
    let shapes: [&[i64]; 4] = [&[3, 5], &[7], &[2, 2], &[9, 1]];
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n: i64 = s.iter().product();
            let x = (Tensor::arange(n, tch::kind::FLOAT_CPU) * 0.37 + (seed * 10 + i as i64) as f64).sin();
            x.view(*s).set_requires_grad(true)
        })
        .collect()
}

/// A loss that gives every parameter a distinct gradient.
fn loss(ps: &[Tensor], k: f64) -> Tensor {
    ps.iter()
        .enumerate()
        .map(|(i, p)| (p * p * (i as f64 + k)).sum(Kind::Float) + p.sum(Kind::Float))
        .fold(Tensor::zeros([], tch::kind::FLOAT_CPU), |a, b| a + b)
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&t.reshape([-1])).unwrap()
}

/// Fresh gradients from autograd over two micro-batches.
fn autograd_reference() -> Vec<Vec<f32>> {
    let reference = params(1);
    for k in [1.0, 2.0] {
        loss(&reference, k).backward();
    }
    torch_ext::grads(&reference).unwrap().iter().map(values).collect()
}

/// The two micro-batches of [`autograd_reference`] through `dp`: the
/// gradients the optimizer would read.
fn two_micro_batches(dp: &mut DataParallel, ps: &[Tensor]) -> Vec<Vec<f32>> {
    for k in [1.0, 2.0] {
        dp.before_backward(ps).unwrap();
        loss(ps, k).backward();
    }
    dp.check_grads(ps).unwrap();
    dp.grads().unwrap().iter().map(values).collect()
}

#[test]
fn the_automatic_bucket_size_is_a_24th_of_the_gradients_and_at_least_25_mib() {
    let mib = 1u64 << 20;
    // GPT-2 124M's fp32 gradients: PyTorch DDP's 25 MiB.
    assert_eq!(auto_bucket_bytes_for(124_475_904 * 4), 25 * mib);
    // GPT 1.3B's (1,313,722,368 parameters): 25 buckets of about 209 MiB.
    let big = 1_313_722_368u64 * 4;
    assert_eq!(auto_bucket_bytes_for(big), big / 24);
    assert!((200 * mib..220 * mib).contains(&auto_bucket_bytes_for(big)));
    assert_eq!(auto_bucket_bytes_for(0), 25 * mib);
}

#[test]
fn flat_buckets_collect_what_autograd_computes_and_zero_each_step() {
    let want = autograd_reference();

    // Same parameters, gradients as views of flat buckets of at most 44 bytes.
    let ps = params(1);
    let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, 0, 2).unwrap();
    assert_eq!(dp.bucket_bytes(), [60, 28 + 16, 36]);
    for step in 0..2 {
        dp.begin_step().unwrap();
        let got = two_micro_batches(&mut dp, &ps);
        assert_eq!(got, want, "step {step}");
        // The buffers hold them: bucket 1 is parameters 1 and 2, back to back.
        let flat = &dp.buckets[1].grad.as_ref().unwrap().0;
        assert_eq!(values(flat), [want[1].clone(), want[2].clone()].concat());
    }
    // A gradient that autograd (or anyone) replaced is caught.
    torch_ext::set_grad(&ps[2], Some(&Tensor::zeros([2, 2], tch::kind::FLOAT_CPU))).unwrap();
    let e = dp.check_grads(&ps).unwrap_err().to_string();
    assert!(e.contains("parameter 2's gradient is no longer a view"), "{e}");
}

#[test]
fn one_rank_with_the_plain_average_keeps_autograds_gradients() {
    let want = autograd_reference();
    // Two ranks, ZeRO or a compressor keep the buffers.
    let ps = params(1);
    assert!(!DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, 0, 2).unwrap().use_local_grads(true).unwrap());
    assert!(!DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, 0, 1).unwrap().use_local_grads(false).unwrap());
    let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, 0, 1).unwrap();
    assert!(dp.use_local_grads(true).unwrap());
    assert_eq!(dp.gradient_bytes(), 0, "the buffers stayed");
    for step in 0..2 {
        dp.begin_step().unwrap();
        assert!(torch_ext::grads(&ps).unwrap().iter().all(|g| !g.defined()), "step {step} began with gradients");
        let got = two_micro_batches(&mut dp, &ps);
        assert_eq!(got, want, "step {step}");
        assert_eq!(dp.gradient_bytes(), 4 * 35);
    }
    // A parameter no pass reached gets zeros for the optimizer.
    dp.begin_step().unwrap();
    (&ps[0] * 2.0).sum(Kind::Float).backward();
    let g = dp.grads().unwrap();
    assert_eq!(values(&g[0]), vec![2.0; 15]);
    assert!(g[1..].iter().all(|g| values(g).iter().all(|&v| v == 0.0)));
}

#[test]
fn gradients_and_zero_parameters_keep_a_channels_last_layout() {
    use harness_kernels::torch_ext::is_dense_layout as dense;
    assert!(dense(&[2, 3, 4, 5], &[60, 1, 15, 3]) && dense(&[7, 1], &[1, 1]) && !dense(&[4, 4], &[8, 1]));
    let conv = || {
        let w = (Tensor::arange(2 * 3 * 2 * 2, tch::kind::FLOAT_CPU) * 0.1).sin().view([2, 3, 2, 2]);
        crate::models::vision::channels_last(&w).set_requires_grad(true)
    };
    let reference = conv();
    (&reference * &reference).sum(Kind::Float).backward();
    for stage in [ZeroStage::None, ZeroStage::Two] {
        let ps = vec![conv(), Tensor::ones([5], tch::kind::FLOAT_CPU).set_requires_grad(true)];
        let strides = ps[0].stride();
        let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 1 << 20), stage, 0, 2).unwrap();
        assert_eq!(ps[0].stride(), strides, "{stage:?} changed the parameter's layout");
        assert_eq!(ps[0].grad().stride(), strides, "{stage:?}: the gradient's layout is not the parameter's");
        dp.begin_step().unwrap();
        dp.before_backward(&ps).unwrap();
        (&ps[0] * &ps[0]).sum(Kind::Float).backward();
        dp.check_grads(&ps).unwrap();
        assert!(ps[0].grad().equal(&reference.grad()), "{stage:?}");
    }
}

#[test]
fn zero_shards_split_every_parameter_once_and_keep_its_values() {
    let world = 3;
    let before: Vec<Vec<f32>> = params(2).iter().map(values).collect();
    let total: i64 = before.iter().map(|v| v.len() as i64).sum();
    let mut seen = vec![0u32; total as usize];
    let mut sizes = Vec::new();
    for rank in 0..world {
        let ps = params(2);
        let dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::One, rank, world).unwrap();
        // Buffers padded to a multiple of the ranks: 15 -> 15, 11 -> 12, 9 -> 9.
        assert_eq!(dp.buckets.iter().map(|b| b.padded).collect::<Vec<_>>(), [15, 12, 9]);
        // The parameters kept their values and now live in the flat buffers.
        for (p, v) in ps.iter().zip(&before) {
            assert_eq!(&values(p), v);
        }
        let flat = dp.buckets[1].param_flat.as_ref().unwrap();
        assert_eq!(ps[2].data_ptr() as usize, flat.data_ptr() as usize + 7 * 4);
        let (targets, decay) = dp.update_targets(&ps);
        sizes.push(targets.iter().map(|t| t.numel()).sum::<usize>());
        for (s, d) in dp.segments.iter().zip(decay) {
            let b = &dp.buckets[s.bucket];
            let chunk = b.padded / world as i64;
            assert!(s.start >= rank as i64 * chunk && s.start + s.len <= (rank as i64 + 1) * chunk, "{s:?} outside rank {rank}'s chunk");
            let global: i64 = dp.buckets[..s.bucket].iter().map(|b| b.numel).sum::<i64>() + s.start;
            for e in global..global + s.len {
                seen[e as usize] += 1;
            }
            // Decay follows the parameter the segment lies in (only [3, 5], [2, 2] and [9, 1] are matrices).
            let owner = b.offsets.iter().rposition(|&o| o <= s.start).unwrap();
            assert_eq!(d, ps[b.params[owner]].dim() >= 2);
        }
    }
    assert!(seen.iter().all(|&c| c == 1), "elements owned by other than one rank: {seen:?}");
    // Each rank owns 1/3 of every padded bucket, less the padding it got.
    assert_eq!(sizes, [5 + 4 + 3, 5 + 4 + 3, 5 + 3 + 3]);
}

/// Runs `f` on two thread ranks with fresh parameters each.
fn two_ranks<T: Send + 'static>(f: impl Fn(usize, &mut harness_runtime::comm::InProcessComm) -> T + Send + Sync + 'static) -> Vec<T> {
    let g = InProcessGroup::new(2, Duration::from_secs(10));
    let f = Arc::new(f);
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let (g, f) = (g.clone(), f.clone());
            std::thread::spawn(move || f(r, &mut g.rank(r, None)))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn zero_reduces_this_ranks_shard_and_gathers_every_update() {
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let out = two_ranks(move |rank, comm| {
            let ps = params(3);
            let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), stage, rank, 2).unwrap();
            let full = dp.gradient_bytes();
            dp.begin_step().unwrap();
            dp.before_backward(&ps).unwrap();
            // Rank r's gradient is (r + 1) x the loss's: the average is 1.5 x.
            (loss(&ps, 1.0) * (rank as f64 + 1.0)).backward();
            dp.check_grads(&ps).unwrap();
            let want: Vec<f32> = torch_ext::grads(&ps).unwrap().iter().flat_map(|g| values(&(g / (rank as f64 + 1.0) * 1.5))).collect();
            dp.reduce(&ps, &mut AllReduce, comm, 0, false).unwrap();
            let held = dp.gradient_bytes();
            // The shard's gradients are the average, at the shard's places.
            let (targets, _) = dp.update_targets(&ps);
            for (s, g) in dp.segments.iter().zip(dp.grads().unwrap()) {
                let global = dp.buckets[..s.bucket].iter().map(|b| b.numel).sum::<i64>() + s.start;
                assert_eq!(values(&g), want[global as usize..(global + s.len) as usize]);
            }
            // An "update" of the shard: every element becomes its rank's number; the gather spreads it.
            tch::no_grad(|| targets.iter().for_each(|t| drop(t.shallow_clone().fill_(rank as f64 + 10.0))));
            dp.gather_params(comm).unwrap();
            let after: Vec<f32> = ps.iter().flat_map(values).collect();
            (full, held, after, dp.segments.clone())
        });
        // Both ranks end with the same parameters: rank 0's first half of each bucket, rank 1's second.
        assert_eq!(out[0].2, out[1].2, "{stage:?}");
        assert!(out[0].2.iter().all(|&x| x == 10.0 || x == 11.0));
        for (rank, o) in out.iter().enumerate() {
            // Bucket of 15 elements padded to 16: 4 bytes x (16 + 12 + 10), half of it reduced.
            assert_eq!(o.0, 4 * (16 + 12 + 10), "{stage:?}");
            let shard = 4 * (8 + 6 + 5);
            let held = if stage == ZeroStage::Two { shard } else { 4 * (16 + 12 + 10) + shard };
            assert_eq!(o.1, held, "{stage:?} rank {rank}");
        }
    }
}

/// Two steps of two micro-batches on rank `rank`, its gradients
/// (r + 1 + step) x the loss's, parameter 3 getting none, the reduction
/// started from the hooks where the overlap is on: after each step, the
/// gradients the optimizer reads and the gradient bytes held.
fn two_steps(
    dp: &mut DataParallel,
    ps: &[Tensor],
    rank: usize,
    comm: &mut harness_runtime::comm::InProcessComm,
) -> Vec<(Vec<Vec<f32>>, u64)> {
    let mut out = Vec::new();
    for step in 0..2u64 {
        dp.begin_step().unwrap();
        for (micro, k) in [1.0, 2.0].into_iter().enumerate() {
            dp.before_backward(ps).unwrap();
            dp.arm_overlap(comm, micro == 1);
            (loss(&ps[..3], k) * (rank as f64 + 1.0 + step as f64)).backward();
            dp.disarm_overlap();
        }
        dp.check_grads(ps).unwrap();
        dp.reduce(ps, &mut AllReduce, comm, step, false).unwrap();
        out.push((dp.grads().unwrap().iter().map(values).collect(), dp.gradient_bytes()));
        dp.gather_params(comm).unwrap();
    }
    out
}

#[test]
fn overlapped_ranks_with_autograds_gradients_average_as_the_flat_buckets_do() {
    // Two steps of two micro-batches on two ranks, the all-reduce started
    // from the gradient hooks; parameter 3 gets no gradient, so its
    // bucket is reduced after the pass, as zeros.
    let run = |local: bool| {
        two_ranks(move |rank, comm| {
            let ps = params(5);
            let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, rank, 2).unwrap();
            assert!(dp.enable_overlap(comm).unwrap());
            // Else the flat buffers, which HARNESS_LOCAL_GRADS=0 keeps.
            if local {
                assert!(tch::no_grad(|| dp.use_local_grads(true)).unwrap());
            }
            let steps: Vec<_> = two_steps(&mut dp, &ps, rank, comm).into_iter().map(|s| s.0).collect();
            (steps, comm.stats().collectives)
        })
    };
    let flat = run(false);
    let local = run(true);
    // Bit for bit what the flat buffers give, on both ranks, with one
    // collective per bucket and step (three buckets).
    assert_eq!(flat, local);
    assert_eq!(local[0].0, local[1].0);
    assert_eq!(local[0].1, 2 * 3);
    // The average over ranks: (r + 1 + step) x the two passes' gradients.
    let reference = params(5);
    for k in [1.0, 2.0] {
        loss(&reference[..3], k).backward();
    }
    let want = torch_ext::grads(&reference[..3]).unwrap();
    for (step, got) in local[0].0.iter().enumerate() {
        for (g, w) in got.iter().zip(&want) {
            let w = values(&(w * (1.5 + step as f64)));
            assert!(g.iter().zip(&w).all(|(a, b)| (a - b).abs() <= 1e-5 * b.abs().max(1.0)), "step {step}: {g:?} vs {w:?}");
        }
        assert!(got[3].iter().all(|&x| x == 0.0), "an unused parameter's average is zero");
    }
}

#[test]
fn buckets_follow_the_plans_order_and_shrink_at_its_end() {
    // 60, 28, 16 and 36 bytes of gradients.
    let ps = params(1);
    // In order, 44-byte buckets: a parameter larger than that alone.
    assert_eq!(buckets_of(&ps, &[0, 1, 2, 3], 44, 0), [vec![0], vec![1, 2], vec![3]]);
    // The reverse order, the last bucket at most 100 / 2 bytes: 16 alone
    // (60 more would pass 50), then 60 + 28 within 100, 36 left first.
    assert_eq!(buckets_of(&ps, &[3, 1, 0, 2], 100, 1), [vec![3], vec![1, 0], vec![2]]);
    // Two smaller ones: 16 within 25, 60 alone past 50, then 28 + 36.
    assert_eq!(buckets_of(&ps, &[3, 1, 0, 2], 100, 2), [vec![3, 1], vec![0], vec![2]]);
    // The backward pass finishes the last created first; a parameter the
    // creation order misses goes first, a repeated one at its last place.
    assert_eq!(ready_order(4, &[0, 1, 2, 3]), [3, 2, 1, 0]);
    assert_eq!(ready_order(4, &[2, 0, 3, 0, 9]), [1, 0, 3, 2]);
}

#[test]
fn buckets_in_another_order_average_as_in_the_parameters_order() {
    // The same two steps on two ranks, the buckets in the parameters'
    // order or as [3], [1, 0], [2]: the same averages, handed to the
    // optimizer in the parameters' order, on every path that keeps
    // flat buffers or autograd's gradients.
    let run = |reordered: bool, path: u8| {
        two_ranks(move |rank, comm| {
            let ps = params(5);
            let plan =
                if reordered { BucketPlan { order: vec![3, 1, 0, 2], max_bytes: 100, tail: 1 } } else { BucketPlan::in_order(&ps, 44) };
            let mut dp = DataParallel::lay_out(&ps, &plan, ZeroStage::None, rank, 2).unwrap();
            assert!(dp.enable_overlap(comm).unwrap());
            match path {
                1 => assert!(tch::no_grad(|| dp.use_local_grads(true)).unwrap()),
                2 => assert!(tch::no_grad(|| dp.use_symmetric_buffers(comm)).unwrap()),
                _ => {}
            }
            let (targets, _) = dp.update_targets(&ps);
            assert!(targets.iter().zip(&ps).all(|(t, p)| t.data_ptr() == p.data_ptr()), "the optimizer's targets keep their order");
            let steps: Vec<_> = two_steps(&mut dp, &ps, rank, comm).into_iter().map(|s| s.0).collect();
            (steps, dp.bucket_bytes())
        })
    };
    for path in 0..3 {
        let (before, after) = (run(false, path), run(true, path));
        assert_eq!(after[0].0, before[0].0, "path {path}");
        assert_eq!(after[0].0, after[1].0, "path {path}");
        assert_eq!(after[0].1, [36, 88, 16]);
    }
    let ps = params(5);
    let e = DataParallel::lay_out(&ps, &BucketPlan { order: vec![0, 1, 1, 3], max_bytes: 44, tail: 0 }, ZeroStage::None, 0, 2)
        .err()
        .expect("a parameter twice is refused");
    assert!(e.to_string().contains("each of the 4 parameters once"), "{e}");
}

#[test]
fn zero_shard_layouts_follow_the_bucket_plan_and_plain_data_parallelism_has_none() {
    // What a ZeRO checkpoint records so that a run whose buckets lie
    // otherwise refuses it: the same plan, the same digest; another, another.
    let layout = |plan: BucketPlan, stage| {
        let ps = params(5);
        DataParallel::lay_out(&ps, &plan, stage, 0, 2).unwrap().shard_layout()
    };
    let reordered = || BucketPlan { order: vec![3, 1, 0, 2], max_bytes: 100, tail: 1 };
    let a = layout(BucketPlan::in_order(&params(5), 44), ZeroStage::One);
    assert_eq!(a.len(), 16, "{a}");
    assert_eq!(a, layout(BucketPlan::in_order(&params(5), 44), ZeroStage::One));
    assert_ne!(a, layout(reordered(), ZeroStage::One));
    assert_ne!(a, layout(BucketPlan::in_order(&params(5), 60), ZeroStage::One));
    assert_eq!(layout(reordered(), ZeroStage::Two), layout(reordered(), ZeroStage::Two));
    assert_eq!(layout(reordered(), ZeroStage::None), "");
}

#[test]
fn the_ranks_shares_of_the_norm_add_up_to_the_norm_of_every_gradient() {
    // After the reduction every rank holds the same averages; each takes
    // a disjoint half of them, and the control all-reduce that adds the
    // squares up is not counted as gradient traffic.
    for path in 0..3u8 {
        let got = two_ranks(move |rank, comm| {
            let ps = params(5);
            let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, rank, 2).unwrap();
            assert!(dp.enable_overlap(comm).unwrap());
            match path {
                1 => assert!(tch::no_grad(|| dp.use_local_grads(true)).unwrap()),
                2 => assert!(tch::no_grad(|| dp.use_symmetric_buffers(comm)).unwrap()),
                _ => {}
            }
            two_steps(&mut dp, &ps, rank, comm);
            let all = torch_ext::clip_grad_norm(&dp.grads().unwrap(), None).unwrap().double_value(&[]);
            let share = dp.norm_share().unwrap().expect("two ranks without ZeRO share the norm");
            let mine: i64 = share.iter().map(|t| t.numel() as i64).sum();
            let before = comm.stats().collectives;
            let norm = global_norm(&share, comm, Device::Cpu).unwrap().double_value(&[]);
            (all, norm, mine, comm.stats().collectives - before)
        });
        for (rank, (all, norm, _, counted)) in got.iter().enumerate() {
            assert!((all - norm).abs() <= 1e-5 * all, "path {path}, rank {rank}: {norm} against {all}");
            assert_eq!(*counted, 0, "the control all-reduce counted");
        }
        // 35 elements (or 15 + 7 + 4 + 9, each split) between the two ranks, once each.
        assert_eq!(got[0].2 + got[1].2, 35, "path {path}");
    }
    // Under ZeRO the shard is the share, and one rank reads everything.
    let ps = params(5);
    assert!(DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::One, 0, 2).unwrap().norm_share().unwrap().is_none());
    assert!(DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, 0, 1).unwrap().norm_share().unwrap().is_none());
}

#[test]
fn symmetric_buffers_average_as_a_scatter_and_a_gather_what_the_all_reduce_does() {
    // HARNESS_CE_GATHER's path on thread ranks: the flat buffers moved
    // into the collective's symmetric memory (padded to the ranks), each
    // bucket a reduce-scatter and an all-gather from the hooks.
    let run = |split: bool| {
        two_ranks(move |rank, comm| {
            let ps = params(5);
            let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, rank, 2).unwrap();
            assert!(dp.enable_overlap(comm).unwrap());
            if split {
                assert!(tch::no_grad(|| dp.use_symmetric_buffers(comm)).unwrap());
            }
            let padded: Vec<i64> = dp.buckets.iter().map(|b| b.padded).collect();
            let steps: Vec<_> = two_steps(&mut dp, &ps, rank, comm).into_iter().map(|s| s.0).collect();
            let s = comm.stats();
            let ops = |op| s.ops.get(&op).map_or(0, |o| o.collectives);
            (
                steps,
                padded,
                ops(harness_runtime::comm::Op::AllReduce),
                ops(harness_runtime::comm::Op::ReduceScatter),
                ops(harness_runtime::comm::Op::AllGather),
            )
        })
    };
    let plain = run(false);
    let split = run(true);
    // The same averages bit for bit (a sum in rank order, halved), on both ranks.
    assert_eq!(split[0].0, plain[0].0);
    assert_eq!(split[0].0, split[1].0);
    // Buckets of 15, 11 and 9 elements: odd ones padded to the two ranks.
    assert_eq!(plain[0].1, [15, 11, 9]);
    assert_eq!(split[0].1, [16, 12, 10]);
    // Three buckets a step, two steps: an all-reduce each, or a scatter and a gather.
    assert_eq!((plain[0].2, plain[0].3, plain[0].4), (6, 0, 0));
    assert_eq!((split[0].2, split[0].3, split[0].4), (0, 6, 6));
}

#[test]
fn unzeroed_buffers_that_the_layers_write_average_as_zeroed_ones_do() {
    // A fused linear layer (w, b: its node writes their buffers itself),
    // a parameter whose node hands autograd no gradient and writes none
    // (u), and one autograd accumulates (v), on two ranks, four steps of
    // two micro-batches; the third step's first micro-batch runs the
    // layer through libtorch, so autograd gets w's and b's gradients
    // first. Between steps every gradient is overwritten with NaN: what
    // a stale buffer holds must never reach an average.
    struct NoGradient;
    impl torch_ext::CustomOp for NoGradient {
        fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
            Ok((vec![&inputs[0] * 2.0], vec![]))
        }
        fn backward(&self, _: &[Tensor], _: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
            Ok(vec![None])
        }
    }
    let run = |unzeroed: bool, stage: ZeroStage| {
        two_ranks(move |rank, comm| {
            let w = (Tensor::arange(12, tch::kind::FLOAT_CPU).view([4, 3]) * 0.1).sin().set_requires_grad(true);
            let b = (Tensor::arange(4, tch::kind::FLOAT_CPU) * 0.3).cos().set_requires_grad(true);
            let u = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
            let v = Tensor::from_slice(&[0.5f32, -1.5, 2.0]).set_requires_grad(true);
            let ps = vec![w.shallow_clone(), b.shallow_clone(), u.shallow_clone(), v.shallow_clone()];
            // Buckets: [w, b, u] (72 bytes), [v].
            let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 72), stage, rank, 2).unwrap();
            assert!(dp.enable_overlap(comm).unwrap());
            if unzeroed {
                assert!(dp.use_stale_buffers().unwrap());
            }
            let mut out = Vec::new();
            for step in 0..4u64 {
                dp.begin_step().unwrap();
                let stale = dp.stale_buckets();
                for micro in 0..2 {
                    dp.before_backward(&ps).unwrap();
                    dp.arm_overlap(comm, micro == 1);
                    let k = (rank + 1) as f64 + step as f64 + micro as f64;
                    let x = (Tensor::arange(6, tch::kind::FLOAT_CPU).view([2, 3]) * k).cos().to_kind(Kind::BFloat16);
                    let y = if step == 2 && micro == 0 {
                        x.to_kind(Kind::Float).linear(&w, Some(&b))
                    } else {
                        crate::models::fused::reference_linear(&x, &w, Some(&b)).to_kind(Kind::Float)
                    };
                    let nothing = torch_ext::custom_op(NoGradient, &[&u]).unwrap().remove(0).sum(Kind::Float);
                    ((&y * &y).sum(Kind::Float) + (&v * &v * k).sum(Kind::Float) + nothing).backward();
                    dp.disarm_overlap();
                }
                dp.check_grads(&ps).unwrap();
                dp.reduce(&ps, &mut AllReduce, comm, step, false).unwrap();
                out.push((dp.grads().unwrap().iter().map(values).collect::<Vec<_>>(), stale));
                tch::no_grad(|| {
                    // (ZeRO-2 has released its buffers.)
                    for g in torch_ext::grads(&ps).unwrap().into_iter().filter(Tensor::defined) {
                        let _ = g.shallow_clone().fill_(f64::NAN);
                    }
                });
            }
            out
        })
    };
    for stage in [ZeroStage::None, ZeroStage::One, ZeroStage::Two] {
        let zeroed = run(false, stage);
        let unzeroed = run(true, stage);
        let grads = |r: &Vec<(Vec<Vec<f32>>, usize)>| r.iter().map(|s| s.0.clone()).collect::<Vec<_>>();
        // Bit for bit the zeroed buffers' averages.
        assert_eq!(grads(&unzeroed[0]), grads(&zeroed[0]), "{stage:?}");
        assert_eq!(grads(&unzeroed[1]), grads(&zeroed[1]), "{stage:?}");
        assert!(grads(&zeroed[0]).iter().flatten().flatten().all(|x| x.is_finite()), "{stage:?}");
        if stage == ZeroStage::None {
            assert_eq!(grads(&unzeroed[0]), grads(&unzeroed[1]));
            assert!(unzeroed[0].iter().all(|s| s.0[2].iter().all(|&x| x == 0.0)), "a gradient nothing wrote averages to zero");
        }
        // The first step zeroes both buckets and learns that autograd
        // writes v's; [w, b, u] stays unzeroed in the second and third
        // steps (where autograd's gradients for w and b found their
        // buffers zeroed by the hook), and is zeroed once autograd has
        // written there.
        let stale: Vec<usize> = unzeroed[0].iter().map(|s| s.1).collect();
        assert_eq!(stale, [0, 1, 1, 0], "{stage:?}");
        assert!(zeroed[0].iter().all(|s| s.1 == 0), "{stage:?}");
    }
}

#[test]
fn a_bf16_reduction_averages_in_bf16_and_only_where_it_can() {
    let out = two_ranks(|rank, comm| {
        let ps = params(7);
        let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::None, rank, 2).unwrap();
        assert!(dp.enable_overlap(comm).unwrap());
        assert!(tch::no_grad(|| dp.use_local_grads(true)).unwrap());
        dp.reduce_in(Kind::BFloat16).unwrap();
        two_steps(&mut dp, &ps, rank, comm)
    });
    assert_eq!(out[0], out[1], "both ranks hold the same average");
    let reference = params(7);
    for k in [1.0, 2.0] {
        loss(&reference[..3], k).backward();
    }
    let want = torch_ext::grads(&reference[..3]).unwrap();
    for (step, (got, _)) in out[0].iter().enumerate() {
        for (g, w) in got.iter().zip(&want) {
            let w = values(&(w * (1.5 + step as f64)));
            // Rounded to bf16 (8 bits of mantissa), the fp32 gradients' average within it.
            let bf16 = values(&Tensor::from_slice(g).to_kind(Kind::BFloat16).to_kind(Kind::Float));
            assert_eq!(g, &bf16, "step {step}: the average is a bf16 value");
            assert!(g.iter().zip(&w).all(|(a, b)| (a - b).abs() <= 2e-2 * b.abs().max(0.1)), "step {step}: {g:?} vs {w:?}");
        }
    }
    // Where the flat buffers or ZeRO reduce, it is refused by name.
    let refused = two_ranks(|rank, comm| {
        let ps = params(7);
        let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::One, rank, 2).unwrap();
        assert!(dp.enable_overlap(comm).unwrap());
        dp.reduce_in(Kind::BFloat16).unwrap_err().to_string()
    });
    assert!(refused[0].contains("`reduce_dtype = \"bf16\"` needs the all-reduce that overlaps"), "{}", refused[0]);
}

#[test]
fn zero_reduce_scatters_from_the_hooks_as_after_the_pass() {
    // ZeRO-1 and -2 on two ranks, two steps of two micro-batches, with
    // the reduce-scatters started from the gradient hooks or after the
    // pass: the same chunks bit for bit, and ZeRO-2 holds no full
    // buffer afterwards either way.
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let run = move |overlap: bool| {
            two_ranks(move |rank, comm| {
                let ps = params(6);
                let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), stage, rank, 2).unwrap();
                if overlap {
                    assert!(dp.enable_overlap(comm).unwrap());
                }
                two_steps(&mut dp, &ps, rank, comm)
            })
        };
        let (after, hooked) = (run(false), run(true));
        assert_eq!(after, hooked, "{stage:?}");
        if stage == ZeroStage::Two {
            // Only the chunks: 4 bytes x (8 + 6 + 5) on each rank.
            assert!(hooked.iter().flatten().all(|(_, bytes)| *bytes == 4 * (8 + 6 + 5)), "{hooked:?}");
        }
    }
    // ZeRO-1 with its buffers in the collective's symmetric memory (plain
    // memory on thread ranks), each reduce-scattered in place: the same
    // chunks, and the chunks no memory of their own.
    let run = |symmetric: bool| {
        two_ranks(move |rank, comm| {
            let ps = params(6);
            let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::One, rank, 2).unwrap();
            assert!(!tch::no_grad(|| dp.use_symmetric_zero_grads(comm)).unwrap(), "it needs the overlap");
            assert!(dp.enable_overlap(comm).unwrap());
            if symmetric {
                assert!(tch::no_grad(|| dp.use_symmetric_zero_grads(comm)).unwrap());
                assert_eq!(dp.outside_allocator_bytes(), 4 * (16 + 12 + 10), "the buffers lie outside libtorch's allocator");
            }
            two_steps(&mut dp, &ps, rank, comm)
        })
    };
    let (plain, symmetric) = (run(false), run(true));
    for (p, s) in plain.iter().flatten().zip(symmetric.iter().flatten()) {
        assert_eq!(p.0, s.0, "the reduced chunks");
        assert_eq!(p.1, s.1 + 4 * (8 + 6 + 5), "the gradient bytes: the buffers, without the chunks again");
    }
    let refused = two_ranks(|rank, comm| {
        let ps = params(6);
        let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::Two, rank, 2).unwrap();
        assert!(dp.enable_overlap(comm).unwrap());
        tch::no_grad(|| dp.use_symmetric_zero_grads(comm)).unwrap()
    });
    assert_eq!(refused, [false, false], "ZeRO-2 releases its buffers every step");
}

#[test]
fn zero2_lets_go_of_its_buffers_after_the_reduction() {
    // The overlap's hooks keep references to the buffers they reduce
    // during the backward pass; after the reduction nothing may hold a
    // released buffer, or it outlives its release (memory held through
    // the update, the forward pass and the next allocation).
    let held = two_ranks(|rank, comm| {
        let ps = params(6);
        let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 44), ZeroStage::Two, rank, 2).unwrap();
        assert!(dp.enable_overlap(comm).unwrap());
        let mut held = Vec::new();
        for step in 0..2 {
            dp.begin_step().unwrap();
            dp.before_backward(&ps).unwrap();
            dp.arm_overlap(comm, true);
            (loss(&ps, 1.0) * (rank as f64 + 1.0)).backward();
            dp.disarm_overlap();
            dp.check_grads(&ps).unwrap();
            dp.reduce(&ps, &mut AllReduce, comm, step, false).unwrap();
            assert!(dp.buckets.iter().all(|b| b.grad.is_none()), "released");
            let o = dp.overlap.as_ref().unwrap();
            held.push(o.state.lock().unwrap().flats.len());
            dp.gather_params(comm).unwrap();
        }
        held
    });
    assert_eq!(held, [[0, 0], [0, 0]], "buffers still referenced after their release");
}

#[test]
fn a_compressor_that_returns_a_new_tensor_still_reaches_the_gradients() {
    struct Sevens;
    impl Compressor for Sevens {
        fn reduce(
            &mut self,
            bucket: &mut Tensor,
            _comm: &mut dyn Collective,
            _ctx: &harness_sandbox::strategy::BucketCtx,
        ) -> anyhow::Result<()> {
            *bucket = bucket.ones_like() * 7.0;
            Ok(())
        }
    }
    let out = two_ranks(|rank, comm| {
        let ps = params(4);
        let mut dp = DataParallel::lay_out(&ps, &BucketPlan::in_order(&ps, 1 << 20), ZeroStage::None, rank, 2).unwrap();
        dp.begin_step().unwrap();
        dp.before_backward(&ps).unwrap();
        loss(&ps, 1.0).backward();
        dp.reduce(&ps, &mut Sevens, comm, 0, false).unwrap();
        torch_ext::grads(&ps).unwrap().iter().flat_map(values).collect::<Vec<f32>>()
    });
    for g in out {
        assert!(g.iter().all(|&x| x == 7.0), "{g:?}");
    }
}

#[test]
fn sharded_clipping_uses_the_global_norm() {
    // Rank 0 holds [3], rank 1 holds [4]: the global norm is 5.
    let out = two_ranks(|rank, comm| {
        let g = Tensor::from_slice(&[3.0f32 + rank as f32]);
        let norm = global_norm(&[g.shallow_clone()], comm, Device::Cpu).unwrap();
        scale_to_norm(&[g.shallow_clone()], &norm, 1.0);
        (norm.double_value(&[]), g.double_value(&[0]))
    });
    assert!((out[0].0 - 5.0).abs() < 1e-6 && (out[1].0 - 5.0).abs() < 1e-6);
    assert!((out[0].1 - 0.6).abs() < 1e-5 && (out[1].1 - 0.8).abs() < 1e-5, "{out:?}");
}
