//! The model against committed GPU results (results/, read in place), and
//! its parts against hand-worked figures.

use std::path::{Path, PathBuf};

use harness_format::link::{Link, Op};

use super::calibrate::{Bench, Source};
use super::check::check;
use super::cluster::{Algo, Cluster};
use super::projection::project;
use super::render;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn sources(paths: &[&str]) -> Vec<Source> {
    paths.iter().map(|p| Source::read(&root().join(p)).unwrap()).collect()
}

fn benches(args: &[&str]) -> Vec<Bench> {
    args.iter()
        .map(|a| match a.split_once('=') {
            Some((k, p)) => Bench::read(&format!("{k}={}", root().join(p).display())).unwrap(),
            None => Bench::read(&root().join(a).display().to_string()).unwrap(),
        })
        .collect()
}

/// Every result file the check reads: H200 runs of 1, 2 and 4 GPUs.
const RESULTS: &[&str] = &[
    "results/h200x4/scaling-625ab31/scaling-gpt2-124m/harness-1.json",
    "results/h200x4/scaling-625ab31/scaling-gpt2-124m/harness-2.json",
    "results/h200x4/scaling-625ab31/scaling-gpt2-124m/harness-4.json",
    "results/h200x4/scaling-625ab31/scaling-1.3b/harness-1.json",
    "results/h200x4/scaling-625ab31/scaling-1.3b/harness-2.json",
    "results/h200x4/scaling-625ab31/scaling-1.3b/harness-4.json",
    "results/h200x2/harness-1gpu.json",
    "results/h200x2/gpu2-compressors.json",
    "results/h200x2/gpu2-compressors-10gbps.json",
    "results/h200x2/gpu2-zero.json",
    "results/h200x2/link.json",
    "results/h200x2/nccl/gpu2-nccl.json",
    "results/h200x4/claims-b592d86/gpu1-claims.json",
    "results/h200x4/claims-b592d86/gpu4-claims.json",
    "results/h200/compressors-1gpu-2de43bd/gpu1-compressors.json",
    "results/h200/compressors-1gpu-2de43bd/gpu1-1.3b-compressors.json",
    "results/h200x2/check-comm-3e54f88/gpu2-1.3b-compressors.json",
];

const BENCHES: &[&str] = &[
    "results/h200x4/scaling-625ab31/busbw/harness-busbw-gpt2-124m-2.json",
    "results/h200x4/scaling-625ab31/busbw/harness-busbw-gpt2-124m-4.json",
    "results/h200x4/scaling-625ab31/busbw/harness-busbw-1.3b-2.json",
    "results/h200x4/scaling-625ab31/busbw/harness-busbw-1.3b-4.json",
    "results/h200x2/busbw/harness-busbw-1.json",
    "results/h200x4/harness-busbw4.json",
    "network=results/h200x2/nccl/busbw-network.json",
];

/// The model against every measured configuration of the committed H200
/// runs: each predicted from data that excluded it. The bound is the
/// issue's 10%, for all but the entries docs/projection.md names: the
/// encoder on 4 GPUs (its ranks' input pipelines share the host's CPU,
/// which the model does not see) and NCCL's network transport (two repeats
/// of the same run 12% apart). Each 2-GPU compressor entry is predicted
/// twice, from another 2-GPU entry of it and from its own cost on one GPU
/// with the sizes of its collectives: both within 10%.
#[test]
fn check_predicts_the_committed_runs_within_ten_percent() {
    use super::check::Basis;
    let c = check(&sources(RESULTS), &benches(BENCHES));
    println!("{}", render::check(&c));
    assert!(c.rows.len() >= 56, "rows: {}", c.rows.len());
    let known = |t: &str| t.contains("encoder-claims5") || t.contains("/network/");
    for r in &c.rows {
        assert!(r.measured > 0.0 && r.predicted.tokens_per_s > 0.0);
        assert!(r.predicted.tokens_lo <= r.predicted.tokens_per_s && r.predicted.tokens_per_s <= r.predicted.tokens_hi, "{}", r.target);
        if !known(&r.target) {
            assert!(
                r.error.abs() <= 0.10,
                "{}: predicted {:.0} tokens/s, measured {:.0} ({:+.1}%)",
                r.target,
                r.predicted.tokens_per_s,
                r.measured,
                100.0 * r.error
            );
        }
        // Never its own measurement: a strategy's costs come from another entry.
        if !r.profile_from.ends_with("(bucket sizes)") {
            assert!(!r.profile_from.starts_with(&r.target), "{} calibrated on itself", r.target);
        }
        assert_ne!(r.compute_from, r.target);
    }
    // Every kind of configuration the issue names is in the check.
    for kind in ["ddp/", "zero2/", "fp16/", "powersgd-r4/", "topk-5pct/", "/network/", "link-10gbps", "link20/"] {
        assert!(c.rows.iter().any(|r| r.target.contains(kind)), "no {kind} entry checked");
    }
    for w in [2, 4] {
        assert!(c.rows.iter().any(|r| r.world == w), "no {w}-GPU entry");
    }
    let within = c.rows.iter().filter(|r| r.error.abs() <= 0.10).count();
    assert!(within + 3 >= c.rows.len(), "{within} of {} within 10%", c.rows.len());
    // Each compressor of both 2-GPU runs (NVLink and emulated 10 Gbps) from
    // its one-GPU cost: the cost from the one-GPU run, nothing timed of the
    // entry itself but its collectives' sizes.
    for file in ["gpu2-compressors.json#", "gpu2-compressors-10gbps.json#"] {
        for s in ["fp16", "topk-5pct", "randomk-5pct", "powersgd-r4", "qsgd-256", "onebit"] {
            let target = format!("{file}gpt2-124m-bf16/{s}/r0");
            let rows: Vec<_> = c.rows.iter().filter(|r| r.target == target).collect();
            assert_eq!(rows.iter().map(|r| r.basis).collect::<Vec<_>>(), [Basis::OtherEntry, Basis::OneGpu], "{target}");
            let one = rows[1];
            assert!(
                one.profile_from
                    .starts_with(&format!("gpu1-compressors.json#gpt2-124m-bf16/{s}/r0 (own cost, 1 GPU) + {target} (collective sizes)")),
                "{}",
                one.profile_from
            );
            assert!(one.error.abs() <= 0.10, "{target} from its one-GPU cost: {:+.1}%", 100.0 * one.error);
        }
    }
    assert!(render::check(&c).contains("calibrated on 1-GPU cost + sizes: 15 of 15 within 10%"));
    // The 1.3B's fp16, top-k and per-matrix PowerSGD on two GPUs from their
    // one-GPU costs. The PowerSGD's 80 small collectives a step were +15%
    // from it while each one's rank check drained the GPU's queue (dc9e8f6);
    // the check now waits on its own stream (5be2fb3).
    for s in ["fp16", "topk-5pct", "powersgd-r4-layers"] {
        let target = format!("gpu2-1.3b-compressors.json#gpt-1.3b-bf16/{s}/r0");
        let r = c.rows.iter().find(|r| r.target == target && r.basis == Basis::OneGpu).unwrap();
        assert!(r.error.abs() <= 0.10, "{target}: {:+.1}%", 100.0 * r.error);
    }
}

/// A compressor on one GPU gives its own cost; its messages come from a
/// multi-GPU entry of the same compressor, on another workload only where
/// the method's payload is a fixed share of a bucket's bytes (scaled per
/// bucket, and said so); otherwise it is left out, with why.
#[test]
fn compressors_of_the_13b_from_their_one_gpu_costs() {
    use super::calibrate::scales_with_bucket_bytes;
    use harness_format::link::Op;
    let files = [
        "results/h200x2/gpu2-compressors.json",
        "results/h200x4/scaling-625ab31/scaling-1.3b/harness-1.json",
        "results/h200x4/scaling-625ab31/scaling-1.3b/harness-2.json",
        "results/h200/compressors-1gpu-2de43bd/gpu1-1.3b-compressors.json",
    ];
    let b = benches(&["results/h200x2/busbw/harness-busbw-1.json", "results/h200x4/scaling-625ab31/busbw/harness-busbw-1.3b-2.json"]);
    let clusters = Cluster::parse("1-2x8:net=100Gbps").unwrap();
    let p = project(&sources(&files), &b, &clusters, Some(1.0), &[]).unwrap();
    let text = render::projection(&p);
    let of = |s: &str| p.rows.iter().filter(|r| r.workload == "gpt-1.3b-bf16" && r.strategy == s).count();
    assert_eq!((of("allreduce"), of("fp16"), of("topk-5pct"), of("powersgd-r4-layers")), (2, 2, 2, 0), "{text}");
    for s in ["fp16", "topk-5pct"] {
        assert!(
            text.contains(&format!("gpt-1.3b-bf16: {s} scaled its messages from gpu2-compressors.json#gpt2-124m-bf16/{s}/r0 per bucket")),
            "{text}"
        );
    }
    assert!(
        text.contains("powersgd-r4-layers (own cost on one GPU from gpu1-1.3b-compressors.json") && text.contains("left out"),
        "{text}"
    );
    assert!(!p.break_even.iter().any(|x| x.strategy == "powersgd-r4-layers"));
    // fp16's all-reduces carry half the 1.3B's gradient bytes a step, one a
    // bucket, as many buckets as the plugin was called on a step.
    let two = &sources(&files[2..3])[0];
    let grads: f64 = two.ok().next().unwrap().1.bucket_bytes.iter().sum::<u64>() as f64;
    let fp16 = p.rows.iter().find(|r| r.workload == "gpt-1.3b-bf16" && r.strategy == "fp16").unwrap();
    assert!(fp16.prediction.parts.collectives > 0.0);
    // The method's rule: fp16 and top-k at a ratio scale with a bucket's
    // bytes; PowerSGD and a top-k without a ratio do not.
    let one = sources(&files[3..4]);
    let strategy = |name: &str| one[0].result.plan.iter().find(|x| x.strategy.name == name).unwrap().strategy.clone();
    assert!(scales_with_bucket_bytes(&strategy("fp16")).is_some() && scales_with_bucket_bytes(&strategy("topk-5pct")).is_some());
    assert!(scales_with_bucket_bytes(&strategy("powersgd-r4-layers")).is_none());
    let mut no_ratio = strategy("topk-5pct");
    no_ratio.compressor_config = None;
    assert!(scales_with_bucket_bytes(&no_ratio).is_none());
    let src = &sources(&files[0..1])[0];
    let (e, m) = src.ok().find(|(e, _)| e.id.contains("/fp16/")).unwrap();
    let ran_on = super::calibrate::entry_cluster(&b, src, e, m).unwrap();
    let measured = super::calibrate::Profile::of(src, e, m, &ran_on).unwrap();
    let cost = super::calibrate::OwnCost { from: "x".into(), seconds: 0.0, buckets: Some(27) };
    let scaled = measured.scaled(grads as u64, 27, &cost);
    let u = scaled.uses.iter().find(|u| u.op == Op::AllReduce).unwrap();
    assert_eq!(u.per_step, 27.0);
    assert!((u.per_step * u.bytes / grads - 0.5).abs() < 1e-9, "{}", u.per_step * u.bytes / grads);
    assert_eq!(scaled.buckets.iter().sum::<u64>(), grads as u64);
}

/// PowerSGD's one-GPU cost with its messages only on another workload: not
/// scaled (its factors follow the matrices' shapes), left out, with why.
#[test]
fn a_compressor_whose_messages_do_not_scale_is_left_out() {
    let mut s = sources(&[
        "results/h200x2/gpu2-compressors.json",
        "results/h200x4/scaling-625ab31/scaling-1.3b/harness-1.json",
        "results/h200x4/scaling-625ab31/scaling-1.3b/harness-2.json",
        "results/h200/compressors-1gpu-2de43bd/gpu1-1.3b-compressors.json",
    ]);
    // The per-matrix entry relabelled as the flat PowerSGD of the 2-GPU run
    // (the same strategy and artifact).
    let (flat, sha) = {
        let (e, m) = s[0].ok().find(|(e, _)| e.id.contains("/powersgd-r4/")).unwrap();
        (s[0].strategy(e).unwrap().clone(), m.plugins[0].manifest.sha256.clone())
    };
    let one = &mut s[3].result;
    one.plan.iter_mut().filter(|x| x.strategy.name == "powersgd-r4-layers").for_each(|x| x.strategy = flat.clone());
    for e in one.entries.iter_mut().filter(|e| e.id.contains("powersgd-r4-layers")) {
        e.metrics.as_mut().unwrap().plugins[0].manifest.sha256 = sha.clone();
    }
    let b = benches(&["results/h200x2/busbw/harness-busbw-1.json", "results/h200x4/scaling-625ab31/busbw/harness-busbw-1.3b-2.json"]);
    let p = project(&s, &b, &Cluster::parse("2x8:net=100Gbps").unwrap(), Some(1.0), &[]).unwrap();
    assert!(!p.rows.iter().any(|r| r.workload == "gpt-1.3b-bf16" && r.strategy == "powersgd-r4"));
    let text = render::projection(&p);
    assert!(text.contains("not a fixed share of a bucket's bytes: left out"), "{text}");
}

/// Without a bench at an entry's world size the check says so and skips it,
/// rather than predicting from nothing.
#[test]
fn check_skips_entries_it_has_no_calibration_for() {
    let s = sources(&[
        "results/h200x4/scaling-625ab31/scaling-gpt2-124m/harness-1.json",
        "results/h200x4/scaling-625ab31/scaling-gpt2-124m/harness-4.json",
    ]);
    let c = check(&s, &benches(&["results/h200x4/scaling-625ab31/busbw/harness-busbw-gpt2-124m-2.json"]));
    assert!(c.rows.is_empty());
    assert!(c.skipped.iter().any(|x| x.contains("no nvlink all-reduce bench at 4 GPUs")), "{:?}", c.skipped);
    let c = check(&s[1..], &benches(&["results/h200x4/scaling-625ab31/busbw/harness-busbw-gpt2-124m-4.json"]));
    assert!(c.skipped.iter().any(|x| x.contains("no one-GPU entry")), "{:?}", c.skipped);
}

/// The cluster string: shapes, units, ranges and what it refuses.
#[test]
fn cluster_strings_parse_and_refuse() {
    let c = Cluster::parse("64x8:nvlink=450GBps,net=100Gbps,net_lat=2us,algo=ring").unwrap();
    assert_eq!(c.len(), 1);
    let c = &c[0];
    assert_eq!((c.nodes, c.gpus_per_node, c.world()), (64, 8, 512));
    assert_eq!(c.intra_gbps, Some(3600.0));
    assert_eq!((c.net_gbps, c.net_latency_us, c.algo), (100.0, 2.0, Algo::Ring));
    let r = Cluster::parse("1-128x8:net=25Gbps").unwrap();
    assert_eq!(r.iter().map(|c| c.world()).collect::<Vec<_>>(), vec![8, 16, 32, 64, 128, 256, 512, 1024]);
    assert_eq!(r[0].intra_gbps, None, "nvlink defaults to the measured bandwidth");
    assert_eq!(Cluster::parse("1x4").unwrap()[0].world(), 4);
    for bad in ["8", "2x4", "2x4:net=100", "2x4:net=100Mbps", "1x8:foo=1", "4-2x8:net=1Gbps", "1x0", "1x8:algo=star", "1x8:nvlink_lat=3"] {
        assert!(Cluster::parse(bad).is_err(), "{bad} parsed");
    }
    let e = Cluster::parse("2x4").unwrap_err().to_string();
    assert!(e.contains("net="), "{e}");
}

/// Collective times against hand-worked alpha-beta figures and the
/// emulation's own ring (`Link`).
#[test]
fn collective_times_follow_ring_tree_and_hierarchy() {
    let gb = 1e9;
    // One node of 4: a ring all-reduce moves 2(n-1)/n of the buffer.
    let one = &Cluster::parse("1x4:nvlink=100GBps").unwrap()[0];
    let t = one.time(Op::AllReduce, gb);
    assert!((t - 1.5 * gb / 100e9).abs() < 1e-9, "{t}");
    // Flat nodes of one GPU: exactly what the link emulation times.
    let flat = &Cluster::parse("4x1:net=10Gbps,net_lat=10us,algo=ring").unwrap()[0];
    let link = Link::flat(10.0, 10.0);
    for op in Op::ALL {
        assert!((flat.time(op, gb) - link.time(op, gb as u64, 4).as_secs_f64()).abs() < 1e-9);
    }
    // Hierarchical: inside, between, inside.
    let h = &Cluster::parse("2x4:nvlink=100GBps,net=100Gbps,net_lat=0us,algo=ring").unwrap()[0];
    let want = 0.75 * gb / 100e9 + 1.0 * gb * 8.0 / 100e9 + 0.75 * gb / 100e9;
    assert!((h.time(Op::AllReduce, gb) - want).abs() < 1e-9);
    // An all-gather's gathered size is the caller's; between 64 nodes the
    // tree's latency beats the ring's on a small message.
    let ring = &Cluster::parse("64x1:net=100Gbps,net_lat=10us,algo=ring").unwrap()[0];
    let tree = Cluster { algo: Algo::Tree, ..ring.clone() };
    let auto = Cluster { algo: Algo::Auto, ..ring.clone() };
    assert!(tree.time(Op::AllReduce, 1e3) < ring.time(Op::AllReduce, 1e3));
    assert!(ring.time(Op::AllReduce, 1e9) < tree.time(Op::AllReduce, 1e9));
    assert_eq!(auto.time(Op::AllReduce, 1e3), tree.time(Op::AllReduce, 1e3));
}

/// A projection of the committed runs: labelled, all-reduce scaling falls
/// with slower networks, top-k's all-gather grows with the world, and the
/// break-even bandwidths are where the steps cross.
#[test]
fn projection_scales_and_finds_break_even() {
    let s = sources(&["results/h200x2/harness-1gpu.json", "results/h200x2/gpu2-compressors.json"]);
    let b = benches(&["results/h200x2/busbw/harness-busbw-1.json"]);
    let mut clusters = Cluster::parse("1x2").unwrap();
    clusters.extend(Cluster::parse("1-128x8:net=25Gbps").unwrap());
    clusters.extend(Cluster::parse("1-128x8:net=400Gbps").unwrap());
    let p = project(&s, &b, &clusters, Some(1.0), &[]).unwrap();
    let text = render::projection(&p);
    assert!(text.starts_with(render::LABEL), "{text}");
    let row = |strategy: &str, world: usize, net: f64| {
        p.rows
            .iter()
            .find(|r| r.strategy == strategy && r.cluster.world() == world && (r.cluster.nodes == 1 || r.cluster.net_gbps == net))
            .unwrap_or_else(|| panic!("no {strategy} at {world} over {net}"))
            .prediction
    };
    // Weak scaling: the all-reduce's efficiency falls with size and with a
    // slower network.
    let (a, b25) = (row("allreduce", 64, 400.0), row("allreduce", 64, 25.0));
    assert!(b25.efficiency < a.efficiency && a.efficiency <= 1.0);
    assert!(row("allreduce", 1024, 25.0).efficiency <= row("allreduce", 16, 25.0).efficiency);
    // top-k's all-gather grows with the world: its exposed time does too.
    assert!(row("topk-5pct", 1024, 400.0).parts.exposed > 4.0 * row("topk-5pct", 16, 400.0).parts.exposed);
    // On two GPUs of NVLink, as measured, the all-reduce beats every compressor.
    for r in p.rows.iter().filter(|r| r.cluster.world() == 2 && r.strategy != "allreduce") {
        assert!(r.prediction.step > row("allreduce", 2, 0.0).step, "{}", r.strategy);
    }
    // Break-even: just below it the compressor is faster, just above slower.
    let be = p.break_even.iter().find(|x| x.strategy == "fp16" && x.cluster.world() == 64 && x.cluster.net_gbps == 25.0).unwrap();
    let g = be.gbps.unwrap().expect("fp16 halves the bytes: it wins on a slow enough link");
    assert!(g > 0.01 && g < 1e5, "{g}");
    for (net, fp16_faster) in [(g * 0.8, true), (g * 1.25, false)] {
        let c = Cluster::parse(&format!("8x8:net={net}Gbps")).unwrap();
        let q = project(&s, &b, &c, Some(1.0), &[]).unwrap();
        let step = |name: &str| q.rows.iter().find(|r| r.strategy == name).unwrap().prediction.step;
        assert_eq!(step("fp16") < step("allreduce"), fp16_faster, "at {net} Gbps");
    }
    println!("{text}");
    assert!(g > 0.01 && g < 1e5, "{g}");
}

/// ZeRO's all-gather moves the whole bucket at any world size; a
/// compressor's gathers a share from every rank and grows with it.
#[test]
fn all_gather_grows_for_compressors_not_for_zero() {
    use super::calibrate::{Profile, Use};
    let use_ = Use { op: Op::AllGather, per_step: 1.0, bytes: 1000.0 };
    let mut p = Profile::all_reduce("x", &[1000], "test".into());
    p.plain = false;
    p.world = 2;
    p.zero = 0;
    assert_eq!(p.bytes_at(&use_, 8), 4000.0);
    p.zero = 2;
    assert_eq!(p.bytes_at(&use_, 8), 1000.0);
    let rs = Use { op: Op::ReduceScatter, ..use_ };
    assert_eq!(p.bytes_at(&rs, 8), 1000.0);
}

/// The T5-large runs of docs/claims.md on two H100s, where no bench ran:
/// the bandwidth the DDP entry measured in training calibrates the others
/// and the projection, never that entry's own check; the emulated links are
/// predicted from the one-GPU run of the same host.
const T5: &[&str] = &["results/h100/families-vs-pytorch-c9e4397/t5/harness-1.json", "results/h100x2/claims1-t5-b9d3b69/claims1.json"];
const T5_DDP: &str = "results/h100x2/claims1-t5-b9d3b69/claims1.json#t5-large-bf16/ddp/r0";

#[test]
fn t5_is_checked_and_projected_from_a_bandwidth_measured_in_training() {
    let s = sources(T5);
    let b = benches(&[T5_DDP]);
    assert_eq!(b[0].world(), 2);
    assert!(b[0].gbps() > 0.0 && b[0].name().ends_with("(in training)"));
    let c = check(&s, &b);
    assert!(c.skipped.iter().any(|x| x.contains("ddp/r0: no nvlink all-reduce bench")), "{:?}", c.skipped);
    assert_eq!(c.rows.len(), 2, "{}", render::check(&c));
    for r in &c.rows {
        assert!(r.target.contains("link"), "{}", r.target);
        assert!(r.error.abs() <= 0.10, "{}: {:+.1}%", r.target, 100.0 * r.error);
    }
    let mut clusters = Cluster::parse("1x8").unwrap();
    clusters.extend(Cluster::parse("2x4:net=10Gbps").unwrap());
    clusters.extend(Cluster::parse("2x4:net=20Gbps").unwrap());
    let p = project(&s, &b, &clusters, None, &[]).unwrap();
    assert_eq!(p.rows.len(), 3);
    assert_eq!(p.slowdown_fits, 1, "the DDP entry fits the slowdown");
    let at = |net: f64| p.rows.iter().find(|r| r.cluster.net_gbps == net).unwrap().prediction;
    let (one_node, g20, g10) = (at(0.0), at(20.0), at(10.0));
    assert!(one_node.tokens_per_s > g20.tokens_per_s && g20.tokens_per_s > g10.tokens_per_s);
    // 2 x 4 over 10 Gbps: each step's 2.95 GB of gradients cross the
    // nodes' link, more than the whole step of one GPU.
    assert!(g10.parts.exposed > one_node.step, "{:?}", g10.parts);
    assert!(render::projection(&p).contains("(in training)"));
    let summary = render::summary(&p);
    assert!(summary.starts_with(render::LABEL) && summary.contains("8 GPUs") && summary.contains("no compressor measured"), "{summary}");
}

/// A bandwidth measured in training needs an entry that ran on the
/// machine's own links.
#[test]
fn a_bandwidth_in_training_refuses_what_it_cannot_use() {
    let file = root().join("results/h100x2/claims1-t5-b9d3b69/claims1.json");
    let e = Bench::read(&format!("{}#t5-large-bf16/link20/r0", file.display())).unwrap_err().to_string();
    assert!(e.contains("emulated link"), "{e}");
    let e = Bench::read(&format!("{}#nothing", file.display())).unwrap_err().to_string();
    assert!(e.contains("no finished entry `nothing`"), "{e}");
    let one = root().join("results/h100/families-vs-pytorch-c9e4397/t5/harness-1.json");
    let e = Bench::read(&format!("{}#t5-large-bf16/allreduce/r0", one.display())).unwrap_err().to_string();
    assert!(e.contains("one GPU"), "{e}");
}

/// The short tables and the plot: one column per size, one line per
/// strategy and network, the compressors' break-even per size, and
/// `--strategy` keeps only what it names.
#[test]
fn summary_and_plot_of_a_projection() {
    let s = sources(&["results/h200x2/harness-1gpu.json", "results/h200x2/gpu2-compressors.json"]);
    let b = benches(&["results/h200x2/busbw/harness-busbw-1.json"]);
    let mut clusters = Cluster::parse("1-4x8:net=25Gbps").unwrap();
    clusters.extend(Cluster::parse("1-4x8:net=400Gbps").unwrap());
    let only: Vec<String> = ["allreduce", "fp16", "topk-5pct"].map(String::from).to_vec();
    let p = project(&s, &b, &clusters, Some(1.0), &only).unwrap();
    assert!(p.rows.iter().all(|r| only.contains(&r.strategy)));
    assert_eq!(p.rows.len(), 3 * 3 * 2);
    let text = render::summary(&p);
    for h in ["8 GPUs", "16 GPUs", "32 GPUs", "25 Gbps", "400 Gbps", "break-even", "topk-5pct"] {
        assert!(text.contains(h), "no {h}: {text}");
    }
    assert!(!text.contains("powersgd"));
    let series = render::workload_series(&p);
    assert_eq!(series.len(), 1);
    assert_eq!(series[0].1.len(), 3 * 2, "a line per strategy and network");
    let e = project(&s, &b, &clusters, Some(1.0), &["nothing".to_string()]).unwrap_err().to_string();
    assert!(e.contains("of the strategies named"), "{e}");
}

/// A suite's `[projection]` in the report: projected from the results the
/// report reads, the bandwidth from the suite's own DDP entry, in a section
/// of its own (Markdown and HTML), labelled, with its plot; a suite
/// without the section gets none, and a bad cluster says why.
#[test]
fn a_suites_projection_section_is_reported_apart_from_the_boards() {
    let s = sources(T5);
    let mut results: Vec<_> = s.iter().map(|x| x.result.clone()).collect();
    let names: Vec<String> = T5.iter().map(|p| p.to_string()).collect();
    assert!(super::suite::of_results(&results, &names).is_empty(), "no [projection]: no projection");
    let plain_text = results[1].suite.text.clone();
    results[1].suite.text = format!("{plain_text}\n[projection]\nclusters = [\"1x8\", \"2x4:net=10Gbps\", \"2x4:net=20Gbps\"]\n");
    results[1].suite.sha256 = "with-projection".into();
    let ps = super::suite::of_results(&results, &names);
    assert_eq!(ps.len(), 1);
    let p = &ps[0];
    assert_eq!(p.suite, results[1].suite.name);
    assert!(p.text.contains("(in training)") && p.text.contains("8 GPUs") && p.text.contains("10 Gbps"), "{}", p.text);
    assert_eq!(p.series.len(), 1);
    assert_eq!(p.series[0].1.len(), 3, "one line per network");
    let md = super::suite::markdown(&ps);
    assert!(md.contains("## Projections (not measurements)") && md.contains(render::LABEL), "{md}");
    results[1].suite.text = format!("{plain_text}\n[projection]\nclusters = [\"2x4:fast=yes\"]\n");
    let ps = super::suite::of_results(&results, &names);
    assert!(ps[0].text.contains("unknown key `fast`") && ps[0].series.is_empty(), "{}", ps[0].text);
}

/// Two one-GPU calibrations of the same workload name that did different
/// work (an older build without the fused LayerNorm, a newer one with it)
/// stay apart: each row and break-even names what its work was, and the
/// newer one's compressors take their messages from its own 2-GPU entries.
#[test]
fn workloads_of_one_name_and_other_work_are_told_apart() {
    let files = [
        "results/h200x4/scaling-625ab31/scaling-1.3b/harness-1.json",
        "results/h200x4/scaling-625ab31/scaling-1.3b/harness-2.json",
        "results/h200/compressors-1gpu-2de43bd/gpu1-1.3b-compressors.json",
        "results/h200x2/check-comm-3e54f88/gpu2-1.3b-compressors.json",
    ];
    let b = benches(&["results/h200x4/scaling-625ab31/busbw/harness-busbw-1.3b-2.json"]);
    let p = project(&sources(&files), &b, &Cluster::parse("2x8:net=100Gbps").unwrap(), Some(1.0), &[]).unwrap();
    let text = render::projection(&p);
    let names: Vec<String> = render::workload_series(&p).into_iter().map(|(w, _)| w).collect();
    assert_eq!(names, ["gpt-1.3b-bf16 (unfused LN)", "gpt-1.3b-bf16 (fused LN)"], "{text}");
    assert!(!p.rows.iter().any(|r| r.workload == "gpt-1.3b-bf16"), "{text}");
    let of = |w: &str, s: &str| p.rows.iter().any(|r| r.workload == w && r.strategy == s);
    assert!(of("gpt-1.3b-bf16 (unfused LN)", "zero2") && !of("gpt-1.3b-bf16 (fused LN)", "zero2"), "{text}");
    assert!(of("gpt-1.3b-bf16 (fused LN)", "powersgd-r4-layers") && !of("gpt-1.3b-bf16 (unfused LN)", "powersgd-r4-layers"), "{text}");
    assert!(text.contains("gpt-1.3b-bf16 (fused LN): one-GPU step"), "{text}");
    // Its own messages where measured; the older build's borrow them.
    assert!(!text.contains("(fused LN): fp16 scaled its messages"), "{text}");
    assert!(text.contains("(unfused LN): fp16 scaled its messages from gpu2-1.3b-compressors.json"), "{text}");
}

/// Where a strategy's entry measured its steps to the target, the clusters
/// of its world size (the same global batch) get a time to the target:
/// those steps at the predicted step, with its interval; clusters of
/// another size get none, and the output says why.
#[test]
fn time_to_target_only_at_the_world_size_that_measured_its_steps() {
    let mut s = sources(&["results/h200x2/harness-1gpu.json", "results/h200x2/gpu2-compressors.json"]);
    for e in s[1].result.entries.iter_mut() {
        let m = e.metrics.as_mut().unwrap();
        m.steps_to_target = match e.strategy.as_str() {
            "allreduce" => Some(120),
            "topk-5pct" => Some(150),
            _ => None,
        };
    }
    let b = benches(&["results/h200x2/busbw/harness-busbw-1.json"]);
    let clusters = [Cluster::parse("2x1:net=10Gbps").unwrap(), Cluster::parse("1x4").unwrap()].concat();
    let p = project(&s, &b, &clusters, Some(1.0), &[]).unwrap();
    let row = |strategy: &str, world: usize| {
        p.rows.iter().find(|r| r.workload == "gpt2-124m-bf16" && r.strategy == strategy && r.prediction.world == world).unwrap()
    };
    for (strategy, steps) in [("allreduce", 120.0), ("topk-5pct", 150.0)] {
        let two = row(strategy, 2);
        let ((mid, lo, hi), from) = two.time_to_target.clone().expect("world 2 measured its steps");
        assert!((mid - steps * two.prediction.step).abs() < 1e-9);
        assert!(lo <= mid && mid <= hi);
        assert!(from.starts_with(&format!("{steps} steps, gpu2-compressors.json#gpt2-124m-bf16/{strategy}/r0")), "{from}");
        assert!(row(strategy, 4).time_to_target.is_none(), "another global batch");
    }
    assert!(row("fp16", 2).time_to_target.is_none(), "fp16 recorded no steps to target");
    let text = render::projection(&p);
    assert!(text.contains("time to the target (training steps only)") && text.contains("the model does not predict"), "{text}");
    // `harness project --summary` prints the projection, then the summary:
    // the table once.
    assert!(!render::summary(&p).contains("time to the target"));
    assert!(render::time_to_target(&p).contains("150 steps, gpu2-compressors.json#gpt2-124m-bf16/topk-5pct/r0"));
    // Without any steps to target, no such section.
    let plain =
        project(&sources(&["results/h200x2/harness-1gpu.json", "results/h200x2/gpu2-compressors.json"]), &b, &clusters, Some(1.0), &[])
            .unwrap();
    assert!(!render::projection(&plain).contains("time to the target"));
}
