//! `harness bench allreduce`: harness's own NCCL all-reduce, back to back,
//! on the gradient buckets of a result file, timed as
//! `bench/allreduce_busbw.py` times torch.distributed's (host wall time over
//! repeated rounds, device synchronised at both ends), so the two bus
//! bandwidths compare like for like. The busbw recorded inside a training
//! step also includes each rank's wait for the other.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

use crate::device;
use crate::ranks::{self, RankEnv};
use harness_format::results;
use harness_runtime::comm::Collective;

/// The gradient bucket sizes (bytes) of the first entry that has them.
pub fn bucket_bytes(path: &Path) -> Result<Vec<u64>> {
    let r = results::RunResult::read(path)?;
    r.entries
        .iter()
        .filter_map(|e| e.metrics.as_ref())
        .map(|m| m.bucket_bytes.clone())
        .find(|b| !b.is_empty())
        .with_context(|| format!("no entry of {} recorded gradient buckets (a data-parallel run has them)", path.display()))
}

/// What [`allreduce`] did.
#[derive(Debug)]
pub enum Allreduce {
    /// Started one process per GPU and waited for them: the exit code of the
    /// first that failed, or 0.
    Launched(i32),
    /// Ran as one rank: on rank 0 the figures (one JSON object, which the CLI
    /// prints as a line), on the others None.
    Ran(Option<serde_json::Value>),
}

/// Runs the benchmark: starts one process per GPU when not started as a
/// rank (`env` is None), else joins as one.
/// With `side`, the all-reduces go to the NCCL side stream that overlapped
/// training uses (`Collective::all_reduce_sum_async`), else to libtorch's
/// legacy stream as the non-overlapped reduction does.
/// With `untimed`, no events or accounting around each collective.
pub fn allreduce(
    env: Option<&RankEnv>,
    buckets: &[u64],
    world: usize,
    iters: usize,
    side: bool,
    untimed: bool,
    args: &[std::ffi::OsString],
) -> Result<Allreduce> {
    let Some(env) = env else {
        let gpus = device::gpu_count();
        anyhow::ensure!(gpus >= world, "the all-reduce benchmark needs {world} GPUs, and this machine has {gpus} usable");
        return crate::launch::launch_bench_ranks(world, args).map(Allreduce::Launched);
    };
    anyhow::ensure!(device::init_cuda(), "no usable CUDA device");
    device::make_current(env.local_rank)?;
    let dev = Device::Cuda(env.local_rank);
    let store = env.rendezvous(Duration::from_secs(60))?;
    let mut comm = ranks::nccl_join(&store, "bench/allreduce", env.rank, env.world, None, dev)?;
    let mut xs: Vec<Tensor> = buckets.iter().map(|&b| Tensor::randn([(b / 4) as i64], (Kind::Float, dev))).collect();
    let mut round = |xs: &mut Vec<Tensor>| -> Result<()> {
        for x in xs.iter_mut() {
            if untimed {
                comm.all_reduce_sum_untimed(x)?;
            } else if side {
                comm.all_reduce_sum_async(x)?;
            } else {
                comm.all_reduce_sum(x)?;
            }
        }
        if side {
            comm.wait_async()?;
        }
        Ok(())
    };
    for _ in 0..3 {
        round(&mut xs)?;
    }
    tch::Cuda::synchronize(env.local_rank as i64);
    let t0 = Instant::now();
    for _ in 0..iters {
        round(&mut xs)?;
    }
    tch::Cuda::synchronize(env.local_rank as i64);
    let dt = t0.elapsed().as_secs_f64() / iters as f64;
    let bytes: u64 = buckets.iter().sum();
    let alg = bytes as f64 / dt / 1e9;
    let n = env.world as f64;
    if env.rank != 0 {
        return Ok(Allreduce::Ran(None));
    }
    let record = harness_format::bench::AllreduceBench {
        world_size: env.world as u32,
        stream: Some(if side { "side" } else { "legacy" }.into()),
        timed: Some(!untimed),
        buckets: harness_format::bench::BenchBuckets {
            count: buckets.len() as u64,
            bytes,
            ms_per_step: dt * 1e3,
            algbw_gbs: alg,
            busbw_gbs: alg * 2.0 * (n - 1.0) / n,
        },
    };
    Ok(Allreduce::Ran(Some(serde_json::to_value(record)?)))
}

/// `harness bench checkpoint-read`: a checkpoint of `gb` GB (a model file
/// and a rank file twice its size, as fp32 parameters and two AdamW moments
/// are) written under `dir` through the checkpoint writer (timed), then
/// restored `rounds` times in each way a restore could read it (the way
/// restores use first) into the snapshot's own memory (as a restore reads
/// into a preallocated snapshot set), its files dropped from the page cache
/// before each read; once a round it is read raw (one thread, direct reads
/// of 16 MiB, no hashing: what `dd iflag=direct bs=16M` measures), and last
/// as many bytes in memory are hashed. The checkpoint is removed afterwards
/// unless `keep`. Returns the table to print.
pub fn checkpoint_read(dir: &Path, gb: f64, rounds: usize, keep: bool) -> Result<String> {
    use harness_train::checkpoint::{self, Position, ReadMode, Snapshot, Store};
    anyhow::ensure!(gb > 0.0, "--gb must be positive");
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    t.set_header(vec!["way", "round", "GB", "seconds", "GB/s"]);
    let mut row = |way: &str, round: String, bytes: u64, s: f64| {
        let gb = bytes as f64 / 1e9;
        t.add_row(vec![way.to_string(), round, format!("{gb:.3}"), format!("{s:.3}"), format!("{:.2}", gb / s)]);
    };
    let root = dir.join(format!("harness-bench-checkpoint-{}", std::process::id()));
    let mut store = Store::open(&root, 0, 1, false, true)?;
    let floats = |share: f64| (gb * 1e9 * share / 4.0) as i64;
    let random = |n| Tensor::randn([n], (Kind::Float, Device::Cpu));
    // Values that do not compress or repeat, as trained weights are.
    tch::manual_seed(0);
    let mut snap = Snapshot {
        position: Position { step: 1, data_position: 0, micro_batch: 1, accum_steps: 1, lr_scale: 1.0 },
        model: vec![("w".into(), random(floats(1.0 / 3.0)))],
        state: vec![("optimizer/exp_avg".into(), random(floats(1.0 / 3.0))), ("optimizer/exp_avg_sq".into(), random(floats(1.0 / 3.0)))],
        plugins: vec![],
        ready: None,
    };
    let result = (|| -> Result<()> {
        let t0 = Instant::now();
        let want = snap.bytes();
        let bytes = store.write_part(&snap)?;
        let ckpt = store.commit(snap.position)?;
        row("write (checkpoint writer, fsync)", "-".into(), bytes, t0.elapsed().as_secs_f64());
        // As a training entry does before its clock starts.
        checkpoint::reserve_read_buffers();
        let ways = [
            ("direct, 2 readers (restores)", ReadMode::RESTORE),
            ("direct, 1 reader", ReadMode { direct: true, readers: 1 }),
            ("direct, 4 readers", ReadMode { direct: true, readers: 4 }),
            ("page cache, 4 readers", ReadMode { direct: false, readers: 4 }),
        ];
        for round in 1..=rounds {
            checkpoint::evict_dir(&ckpt)?;
            let t0 = Instant::now();
            let raw = checkpoint::raw_direct_read(&ckpt)?;
            row("raw: direct 16 MiB reads, no hash", round.to_string(), raw, t0.elapsed().as_secs_f64());
            for (name, mode) in ways {
                checkpoint::evict_dir(&ckpt)?;
                store.read_mode = mode;
                let t0 = Instant::now();
                let back = store.read_into(1, &mut snap)?;
                row(name, round.to_string(), raw, t0.elapsed().as_secs_f64());
                anyhow::ensure!(back.bytes() == want, "read {} bytes of tensors back of {want}", back.bytes());
            }
        }
        row("hash only, in memory", "-".into(), bytes, checkpoint::hash_seconds(bytes as usize));
        if keep {
            eprintln!("kept the checkpoint: {}", ckpt.display());
        }
        Ok(())
    })();
    if !keep {
        std::fs::remove_dir_all(&root).with_context(|| format!("removing {}", root.display()))?;
    }
    result?;
    Ok(format!("{t}\n"))
}
