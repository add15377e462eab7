use std::sync::Arc;
use std::time::Instant;

use super::*;

fn spawn<F>(n: usize, timeout: Duration, f: F) -> Vec<Result<Vec<f32>, CommError>>
where
    F: Fn(&mut InProcessComm) -> Result<Vec<f32>, CommError> + Send + Sync + 'static,
{
    let g = InProcessGroup::new(n, timeout);
    let f = Arc::new(f);
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let (g, f) = (g.clone(), f.clone());
            std::thread::spawn(move || f(&mut g.rank(r, None)))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn all_reduce_sums_over_ranks_many_times() {
    let out = spawn(4, Duration::from_secs(10), |c| {
        let mut last = Vec::new();
        for k in 0..50 {
            let mut t = Tensor::from_slice(&[c.rank() as f32, k as f32, 1.0]);
            c.all_reduce_sum(&mut t)?;
            last = Vec::<f32>::try_from(&t).unwrap();
            assert_eq!(last, vec![6.0, 4.0 * k as f32, 4.0], "rank {} round {k}", c.rank());
        }
        assert_eq!(c.stats().collectives, 50);
        // 12 bytes per reduce, 2 * 3/4 of it sent per rank.
        assert_eq!(c.stats().ops[&Op::AllReduce].bytes, 50 * 12);
        assert_eq!(c.stats().bytes_sent, 50 * (2 * 3 * 12 / 4));
        Ok(last)
    });
    assert!(out.iter().all(|r| r.is_ok()));
}

#[test]
fn broadcast_copies_the_root() {
    let out = spawn(3, Duration::from_secs(10), |c| {
        let mut t = Tensor::from_slice(&[c.rank() as f32 + 10.0]);
        c.broadcast(&mut t, 1)?;
        Ok(Vec::<f32>::try_from(&t).unwrap())
    });
    for r in out {
        assert_eq!(r.unwrap(), vec![11.0]);
    }
}

#[test]
fn a_missing_rank_times_out_with_its_number() {
    let out = spawn(3, Duration::from_millis(300), |c| {
        if c.rank() == 2 {
            return Ok(vec![]); // never joins
        }
        let mut t = Tensor::from_slice(&[1.0f32]);
        c.all_reduce_sum(&mut t).map(|_| vec![])
    });
    for r in &out[..2] {
        match r {
            Err(CommError::Timeout { missing, op, .. }) => {
                assert_eq!(missing, &vec![2]);
                assert_eq!(*op, "all_reduce");
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
}

#[test]
fn abort_releases_waiting_ranks_at_once() {
    let t0 = Instant::now();
    let out = spawn(2, Duration::from_secs(30), |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(50));
            c.abort("out of memory");
            return Ok(vec![]);
        }
        let mut t = Tensor::from_slice(&[1.0f32]);
        c.all_reduce_sum(&mut t).map(|_| vec![])
    });
    assert!(t0.elapsed() < Duration::from_secs(5));
    let e = out[0].as_ref().unwrap_err().to_string();
    assert!(e.contains("rank 1 failed: out of memory"), "{e}");
}

#[test]
fn link_model_matches_the_ring_formula() {
    // 10 Gbps, 5 us, 8 ranks, 100 MB: 14 x 5 us + 14/8 x 0.8 Gb / 10 Gbps.
    let l = Link::flat(10.0, 5.0);
    let t = l.all_reduce_time(100_000_000, 8).as_secs_f64();
    assert!((t - (14.0 * 5e-6 + 14.0 / 8.0 * 0.08)).abs() < 1e-9, "{t}");
    assert_eq!(l.all_reduce_time(1, 1), Duration::ZERO);
}

#[test]
fn a_topology_stretches_only_the_traffic_between_nodes() {
    let measured = Duration::from_millis(3);
    let (bytes, n) = (100_000_000u64, 8);
    // 2 nodes x 4 ranks at 10 Gbps, 5 us: the node's link carries a ring
    // over 2 nodes of the whole buffer (2 steps of 1/2 of it), after
    // the measured phases within nodes.
    let two_by_four = Link { nodes: Some(2), ..Link::flat(10.0, 5.0) };
    assert_eq!(two_by_four.topology(n), (2, 4));
    let inter = two_by_four.inter_node_time(Op::AllReduce, bytes, n).as_secs_f64();
    assert!((inter - (2.0 * 5e-6 + 2.0 / 2.0 * 0.08)).abs() < 1e-9, "{inter}");
    assert_eq!(two_by_four.emulated(Op::AllReduce, bytes, n, measured), measured + two_by_four.inter_node_time(Op::AllReduce, bytes, n));
    // Gathers and scatters cross between nodes once (1 step of 1/2).
    let ag = two_by_four.inter_node_time(Op::AllGather, bytes, n).as_secs_f64();
    assert!((ag - (5e-6 + 0.04)).abs() < 1e-9, "{ag}");
    // One rank per node is the flat link: the ring over all ranks, at
    // least the measured time.
    let flat = Link::flat(10.0, 5.0);
    let eight = Link { nodes: Some(8), ..flat };
    assert_eq!(eight.emulated(Op::AllReduce, bytes, n, measured), flat.emulated(Op::AllReduce, bytes, n, measured));
    assert_eq!(flat.emulated(Op::AllReduce, bytes, n, measured), flat.all_reduce_time(bytes, n));
    assert_eq!(flat.emulated(Op::AllReduce, 8, n, Duration::from_secs(1)), Duration::from_secs(1));
    // 2 x 1 on 2 ranks is the flat link on 2.
    let two = Link { nodes: Some(2), ..flat };
    assert_eq!(two.emulated(Op::AllReduce, bytes, 2, measured), flat.emulated(Op::AllReduce, bytes, 2, measured));
}

#[test]
fn thread_ranks_on_a_topology_add_the_time_between_nodes_to_what_they_measured() {
    let g = InProcessGroup::new(4, Duration::from_secs(10));
    let link = Link { nodes: Some(2), ..Link::flat(0.001, 0.0) }; // 1 Mbps per node
    let hs: Vec<_> = (0..4)
        .map(|r| {
            let g = g.clone();
            std::thread::spawn(move || {
                let mut c = g.rank(r, Some(link));
                let mut t = Tensor::full([1000], r as f64, (tch::Kind::Float, tch::Device::Cpu));
                c.all_reduce_sum(&mut t).unwrap();
                // The maths is the flat all-reduce's.
                assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![6.0; 1000]);
                c.stats().clone()
            })
        })
        .collect();
    for h in hs {
        let s = h.join().unwrap();
        // 4000 bytes over 2 nodes: 2 steps of 2000 bytes at 1 Mbps = 32 ms, on top.
        assert_eq!(s.emulated_total - s.measured_total, Duration::from_millis(32));
    }
}

#[test]
fn emulated_links_stretch_collectives() {
    let g = InProcessGroup::new(2, Duration::from_secs(10));
    let link = Link::flat(0.001, 0.0); // 1 Mbps
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let g = g.clone();
            std::thread::spawn(move || {
                let mut c = g.rank(r, Some(link));
                let mut t = Tensor::zeros([1000], (tch::Kind::Float, tch::Device::Cpu));
                c.all_reduce_sum(&mut t).unwrap();
                c.stats().clone()
            })
        })
        .collect();
    for h in hs {
        let s = h.join().unwrap();
        // 4000 bytes, 2 x 1/2 of it over 1 Mbps = 32 ms.
        assert!(s.emulated_total >= Duration::from_millis(32), "{:?}", s.emulated_total);
        assert!(s.measured_total < s.emulated_total);
    }
}

/// Fills `result` with this rank's number, waits until every rank has
/// done the same (an all-reduce is a barrier), then reads it back: a
/// result shared between ranks would show another rank's number.
fn result_is_private(c: &mut InProcessComm, result: &mut Tensor) -> Result<bool, CommError> {
    let _ = result.fill_(c.rank() as f64);
    c.all_reduce_sum(&mut Tensor::from_slice(&[0.0f32]))?;
    Ok(Vec::<f32>::try_from(&*result).unwrap().iter().all(|&x| x == c.rank() as f32))
}

#[test]
fn all_gather_concatenates_ranks_in_order_many_times() {
    let out = spawn(3, Duration::from_secs(10), |c| {
        let r = c.rank() as f32;
        for k in 0..20 {
            // 2-D input: the result is 1-D, rank after rank.
            let t = Tensor::from_slice(&[r, r + 10.0, k as f32]).view([1, 3]);
            let mut g = c.all_gather(&t)?;
            assert_eq!(g.size(), [9]);
            let want = [0.0, 10.0, k as f32, 1.0, 11.0, k as f32, 2.0, 12.0, k as f32];
            assert_eq!(Vec::<f32>::try_from(&g).unwrap(), want, "rank {} round {k}", c.rank());
            assert!(result_is_private(c, &mut g)?, "rank {}: the gathered tensor is shared", c.rank());
        }
        let s = c.stats().ops[&Op::AllGather].clone();
        assert_eq!(s.collectives, 20);
        // The size is the gathered buffer, 3 x 12 bytes; a ring sends 2/3 of it.
        assert_eq!(s.bytes, 20 * 36);
        assert_eq!(s.bytes_sent, 20 * 24);
        // The barrier all-reduces are accounted for apart, and everything in the totals.
        assert_eq!(c.stats().ops[&Op::AllReduce].collectives, 20);
        assert_eq!(c.stats().collectives, 40);
        assert_eq!(c.stats().bytes_sent, 20 * 24 + 20 * (2 * 2 * 4 / 3));
        Ok(vec![])
    });
    for r in out {
        r.unwrap();
    }
}

#[test]
fn reduce_scatter_returns_this_ranks_chunk_of_the_sum() {
    let out = spawn(3, Duration::from_secs(10), |c| {
        let mut last = Vec::new();
        for k in 0..20 {
            // Rank r holds (r + 1) x [0, 1, ..., 5] + k: the sum is 6 x [0..6] + 3k.
            let t = (Tensor::arange(6, (tch::Kind::Float, tch::Device::Cpu)) * (c.rank() as f64 + 1.0) + k as f64).view([2, 3]);
            let mut chunk = c.reduce_scatter_sum(&t)?;
            let i = 2.0 * c.rank() as f32;
            last = Vec::<f32>::try_from(&chunk).unwrap();
            assert_eq!(last, vec![6.0 * i + 3.0 * k as f32, 6.0 * (i + 1.0) + 3.0 * k as f32], "rank {} round {k}", c.rank());
            assert!(result_is_private(c, &mut chunk)?, "rank {}: the chunk is shared", c.rank());
        }
        let s = c.stats().ops[&Op::ReduceScatter].clone();
        // The size is the buffer before scattering, 24 bytes; a ring sends 2/3 of it.
        assert_eq!((s.collectives, s.bytes, s.bytes_sent), (20, 20 * 24, 20 * 16));
        Ok(last)
    });
    assert!(out.iter().all(|r| r.is_ok()));
}

#[test]
fn tensors_that_do_not_fit_fail_on_every_rank_at_once() {
    let t0 = Instant::now();
    // Three elements over two ranks do not split.
    let out = spawn(2, Duration::from_secs(30), |c| c.reduce_scatter_sum(&Tensor::from_slice(&[1.0f32, 2.0, 3.0])).map(|_| vec![]));
    for r in &out {
        match r {
            Err(CommError::Invalid { op: "reduce_scatter", reason, .. }) => assert!(reason.contains("do not split evenly"), "{reason}"),
            other => panic!("expected an invalid reduce-scatter, got {other:?}"),
        }
    }
    // Ranks gathering different sizes.
    let out =
        spawn(2, Duration::from_secs(30), |c| c.all_gather(&Tensor::zeros([c.rank() as i64 + 1], tch::kind::FLOAT_CPU)).map(|_| vec![]));
    for r in &out {
        match r {
            Err(CommError::Invalid { op: "all_gather", reason, .. }) => assert!(reason.contains("[1, 2]"), "{reason}"),
            other => panic!("expected an invalid all-gather, got {other:?}"),
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "the ranks waited for the timeout");
}

#[test]
fn a_missing_rank_times_out_in_gathers_and_scatters_too() {
    for op in [Op::AllGather, Op::ReduceScatter] {
        let out = spawn(3, Duration::from_millis(300), move |c| {
            if c.rank() == 1 {
                return Ok(vec![]); // never joins
            }
            let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
            match op {
                Op::AllGather => c.all_gather(&t),
                _ => c.reduce_scatter_sum(&t),
            }
            .map(|_| vec![])
        });
        for r in [&out[0], &out[2]] {
            match r {
                Err(e @ CommError::Timeout { missing, op: name, .. }) => {
                    assert_eq!(missing, &vec![1]);
                    assert_eq!(*name, op.name());
                    assert!(e.to_string().contains("rank(s) [1] never joined"), "{e}");
                }
                other => panic!("{op:?}: expected a timeout, got {other:?}"),
            }
        }
    }
}

#[test]
fn single_rank_gathers_and_scatters_are_copies() {
    let mut c = SingleRank::default();
    let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 2]);
    for out in [c.all_gather(&t).unwrap(), c.reduce_scatter_sum(&t).unwrap()] {
        assert_eq!(out.size(), [4]);
        assert_eq!(Vec::<f32>::try_from(&out).unwrap(), [1.0, 2.0, 3.0, 4.0]);
        assert_ne!(out.data_ptr(), t.data_ptr());
    }
    assert_eq!(c.stats().collectives, 0);
}

#[test]
fn ring_model_of_gathers_and_scatters_is_half_an_all_reduce() {
    // 10 Gbps, 5 us, 8 ranks, 100 MB gathered: 7 x 5 us + 7/8 x 0.8 Gb / 10 Gbps.
    let l = Link::flat(10.0, 5.0);
    let t = l.all_gather_time(100_000_000, 8).as_secs_f64();
    assert!((t - (7.0 * 5e-6 + 7.0 / 8.0 * 0.08)).abs() < 1e-9, "{t}");
    assert_eq!(l.reduce_scatter_time(100_000_000, 8), l.all_gather_time(100_000_000, 8));
    assert_eq!(l.time(Op::AllReduce, 100_000_000, 8), l.all_reduce_time(100_000_000, 8));
    assert_eq!(l.all_gather_time(1, 1), Duration::ZERO);
}

#[test]
fn bus_bandwidth_is_per_kind_of_collective() {
    // 4 ranks; 1 GB all-reduced in 1 s and 2 GB gathered in 1 s.
    let mut s = CommStats::default();
    s.count(Op::AllReduce, 1_000_000_000, 4);
    s.time(Op::AllReduce, 1_000_000_000, Duration::from_secs(1), Duration::from_secs(2));
    s.count(Op::AllGather, 2_000_000_000, 4);
    s.time(Op::AllGather, 2_000_000_000, Duration::from_secs(1), Duration::from_secs(1));
    // all-reduce: algbw 1 GB/s, busbw x 2 x 3/4; emulated half that.
    assert_eq!(s.bandwidth_gbs(4, false), Some((1.0, 1.5)));
    assert_eq!(s.bandwidth_gbs(4, true), Some((0.5, 0.75)));
    // all-gather: algbw 2 GB/s, busbw x 3/4.
    assert_eq!(s.op_bandwidth_gbs(Op::AllGather, 4, false), Some((2.0, 1.5)));
    assert_eq!(s.op_bandwidth_gbs(Op::ReduceScatter, 4, false), None);
    // Bytes sent: 2 x 3/4 of 1 GB plus 3/4 of 2 GB.
    assert_eq!(s.bytes_sent, 1_500_000_000 + 1_500_000_000);
    assert_eq!((s.collectives, s.latency.len()), (2, 2));
    s.clear_timings();
    assert_eq!(s.bandwidth_gbs(4, false), None);
    assert_eq!(s.ops[&Op::AllGather].bytes, 2_000_000_000);
}

#[test]
fn emulated_links_stretch_gathers_by_the_ring_model() {
    let g = InProcessGroup::new(2, Duration::from_secs(10));
    let link = Link::flat(0.001, 0.0); // 1 Mbps
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let g = g.clone();
            std::thread::spawn(move || {
                let mut c = g.rank(r, Some(link));
                // Line the threads up first, so the gather's measured time is short.
                c.all_reduce_sum(&mut Tensor::from_slice(&[0.0f32])).unwrap();
                let t = Tensor::zeros([1000], (tch::Kind::Float, tch::Device::Cpu));
                let _ = c.all_gather(&t).unwrap();
                c.stats().clone()
            })
        })
        .collect();
    for h in hs {
        let s = h.join().unwrap();
        // 8000 bytes gathered, 1/2 of it over 1 Mbps = 32 ms (an all-reduce model would say 64).
        let e = s.ops[&Op::AllGather].emulated_total;
        assert!(e >= Duration::from_millis(32) && e < Duration::from_millis(60), "{e:?}");
    }
}
