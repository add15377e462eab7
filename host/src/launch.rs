//! Running a plan: entries one after another on this process's rank, each
//! isolated so that a failing entry (error, panic, out of memory) is recorded
//! as failed and the run goes on; the result file is rewritten atomically
//! after every entry, so a killed run keeps what it finished.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::comm::{Collective, InProcessGroup, Link, SingleRank};
use crate::console::{clean_panic, last_panic, Console, QuietPanics};
use crate::device;
use crate::fmt::short;
use crate::ranks::{nccl_join, RankEnv, Watchdog};
use crate::rendezvous;
use crate::results::{EntryResult, EntryStatus, RankRecord, RunResult};
use crate::suite::{PlanEntry, Suite};
use crate::train::{self, EntryContext, EntryOutput, Progress};

/// How a run is asked for.
pub struct RunOptions {
    /// The result file (created, or continued with `resume`).
    pub out: PathBuf,
    /// Continue `out`: run only the entries it lacks.
    pub resume: bool,
    /// This process's place among the ranks, when started as one of several.
    pub ranks: Option<RankEnv>,
}

/// Runs every planned entry that `out` lacks; returns the final result.
/// Where an entry's checkpoints go: next to the result file,
/// `<out stem>.checkpoints/<entry id, with / as _>`.
pub fn checkpoint_dir(out: &std::path::Path, entry_id: &str) -> PathBuf {
    let safe: String = entry_id.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    out.with_extension("checkpoints").join(safe)
}

pub fn run_suite(suite: &Suite, opts: &RunOptions, console: &mut Console) -> anyhow::Result<RunResult> {
    let meta = &suite.spec.suite;
    let world = meta.world_size as usize;
    let rank_env = &opts.ranks;
    let (rank, local_rank) = rank_env.as_ref().map_or((0, 0), |e| (e.rank, e.local_rank));
    let device = device::select(meta.device, local_rank)?;
    let dist = device.is_cuda() && world > 1;
    if dist {
        let env = rank_env
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("a multi-GPU suite must run under a launcher (harness run starts one itself)"))?;
        anyhow::ensure!(env.world == world, "WORLD_SIZE={} but the suite says world_size = {world}", env.world);
        device::make_current(local_rank)?;
    }
    let writes = rank == 0;
    if let Some(n) = meta.threads {
        tch::set_num_threads(n as i32);
    } else if dist && std::env::var_os("OMP_NUM_THREADS").is_none() {
        // Ranks sharing a host share its cores: libtorch's default (every
        // core per process) oversubscribes them and starves the data threads.
        let local = std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(world).max(1);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        tch::set_num_threads((cores / local).max(1) as i32);
    }
    let machine = device::fingerprint();
    let mut result = if opts.resume && writes {
        let r = RunResult::read(&opts.out)?;
        if r.suite.sha256 != suite.sha256 {
            anyhow::bail!(
                "{} was made from a different version of {} (sha256 {} vs {}); resume needs the same suite file\nhint: run without --resume to start a new result file",
                opts.out.display(),
                suite.path.display(),
                short(&r.suite.sha256),
                short(&suite.sha256)
            );
        }
        if r.machine.hostname != machine.hostname || r.machine.gpus != machine.gpus {
            console.warning(&format!(
                "resuming on a different machine than {} was started on; its entries will carry mixed fingerprints",
                opts.out.display()
            ));
        }
        r
    } else {
        let mut r = RunResult::new(suite, machine);
        if writes {
            r.write_atomic(&opts.out)?;
        }
        r
    };
    let timeout = Duration::from_secs_f64(meta.collective_timeout_s);
    // Ranks of a multi-GPU run agree on the entries through rank 0's store.
    let store = match (rank_env, dist) {
        (Some(env), true) => Some(env.rendezvous(timeout)?),
        _ => None,
    };
    let done = result.done_ids();
    let plan = suite.plan();
    let mut todo_ids: Vec<String> = plan.entries.iter().filter(|e| !done.contains(&e.id)).map(|e| e.id.clone()).collect();
    if let Some(c) = &store {
        if rank == 0 {
            c.set("todo", &serde_json::to_vec(&todo_ids)?)?;
        } else {
            todo_ids = serde_json::from_slice(&c.get("todo")?)?;
        }
    }
    let todo: Vec<_> = plan.entries.iter().filter(|e| todo_ids.contains(&e.id)).collect();
    // The GPU this rank trains on (None on the CPU).
    let gpu = if device.is_cuda() { result.machine.gpus.get(local_rank).cloned() } else { None };
    let device_name = match device {
        tch::Device::Cpu => "cpu".to_owned(),
        _ => {
            let name = gpu.as_ref().map_or("cuda".into(), |g| format!("cuda ({})", g.name));
            if dist {
                format!("{world} x {name}")
            } else {
                name
            }
        }
    };
    console.run_started(&meta.name, todo.len(), plan.entries.len(), &device_name, &opts.out);

    let suite_dir = suite.path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf();
    let memory_total_bytes = match device {
        tch::Device::Cpu => result.machine.memory_bytes,
        _ => gpu.as_ref().map_or(0, |g| g.memory_bytes),
    };
    let _quiet_panics = QuietPanics::install();
    // Loaded on first use: a broken plugin fails only the entries using it.
    let plugins = crate::plugin::PluginSet::new(&suite.spec.plugins, &suite_dir);
    // Set when a rank died or hung: the next entry could not form a
    // communicator, so the run stops after recording this one.
    let mut ranks_lost = false;

    for (i, entry) in todo.iter().enumerate() {
        let w = &suite.spec.workloads[entry.workload];
        // The suite's figure wins; else the GPU table at the entry's precision.
        let low_precision = w.precision != crate::suite::Precision::Fp32;
        let peak_for = meta.peak_tflops.or_else(|| gpu.as_ref().and_then(|g| device::peak_tflops(&g.name, low_precision)));
        let ctx = EntryContext {
            workload: w,
            entry,
            suite_dir: &suite_dir,
            device,
            warmup_steps: meta.warmup_steps,
            peak_tflops: peak_for,
            memory_total_bytes,
            bucket_bytes: (meta.bucket_mb * 1024.0 * 1024.0) as u64,
            plugins: &plugins,
            checkpoint_dir: checkpoint_dir(&opts.out, &entry.id),
            resume: opts.resume,
        };
        let link = entry.strategy.link;
        let say = console.rank_stopping();
        console.entry_started(i + 1, todo.len(), &entry.id, w.steps, w.time_budget_s);
        let mut on_progress = |p: &Progress| console.progress(p);
        let outcome = if let Some(c) = &store {
            // What the watchdog says, and writes on rank 0, if this entry
            // hangs on a lost rank.
            let on_fire: Box<dyn FnOnce(&str) + Send> = if writes {
                let (mut snap, out) = (result.clone(), opts.out.clone());
                let failed = entry_result(entry, &w.name, &device_name, Err(String::new()));
                Box::new(move |msg: &str| {
                    say(msg);
                    snap.entries.push(EntryResult { status: EntryStatus::Failed { error: msg.to_owned() }, ..failed });
                    let _ = snap.write_atomic(&out);
                })
            } else {
                Box::new(say)
            };
            run_nccl(&ctx, c, rank, world, &mut on_progress, &mut ranks_lost, on_fire)?
        } else if world == 1 {
            run_rank(&ctx, &mut SingleRank::default(), &mut on_progress)
        } else {
            run_threads(&ctx, world, link, timeout, &mut on_progress)
        };
        let record = entry_result(entry, &w.name, &device_name, outcome);
        console.entry_finished(&record);
        let lost_because = match (&record.status, ranks_lost) {
            (EntryStatus::Failed { error }, true) => Some(error.clone()),
            (_, true) => Some("a rank was lost".to_owned()),
            _ => None,
        };
        result.entries.push(record);
        // Plan order, whatever order resume ran things in.
        let order = |id: &str| plan.entries.iter().position(|p| p.id == id).unwrap_or(usize::MAX);
        result.entries.sort_by_key(|e| order(&e.id));
        if writes {
            result.write_atomic(&opts.out)?;
        }
        if let Some(why) = lost_because {
            anyhow::bail!(
                "stopping the run: {why}\nfinished entries are kept in {}; `--resume` continues once every rank is back",
                opts.out.display()
            );
        }
    }
    Ok(result)
}

/// The record of one entry, from what its run returned.
fn entry_result(entry: &PlanEntry, workload: &str, device: &str, outcome: Result<EntryOutput, String>) -> EntryResult {
    let (status, metrics, histograms) = match outcome {
        Ok(out) => (EntryStatus::Ok, Some(out.metrics), out.histograms),
        Err(error) => (EntryStatus::Failed { error }, None, Default::default()),
    };
    EntryResult {
        id: entry.id.clone(),
        workload: workload.to_owned(),
        strategy: entry.strategy.name.clone(),
        repeat: entry.repeat,
        seed: entry.seed,
        status,
        device: device.to_owned(),
        metrics,
        histograms,
    }
}

/// Runs one rank of an entry; errors and panics become the failure message,
/// and the other ranks are released from their collectives.
fn run_rank(ctx: &EntryContext<'_>, comm: &mut dyn Collective, progress: &mut dyn FnMut(&Progress)) -> Result<EntryOutput, String> {
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| train::run_entry(ctx, comm, progress)));
    let err = match outcome {
        Ok(Ok(out)) => return Ok(out),
        Ok(Err(e)) => format!("{e:#}"),
        Err(_) => clean_panic(&last_panic().unwrap_or_else(|| "panic".into())),
    };
    comm.abort(&err);
    Err(err)
}

/// CPU data parallelism: one thread per rank, an in-process collective.
/// Rank 0's figures are kept, with throughput summed over the ranks.
fn run_threads(
    ctx: &EntryContext<'_>,
    world: usize,
    link: Option<Link>,
    timeout: Duration,
    progress: &mut dyn FnMut(&Progress),
) -> Result<EntryOutput, String> {
    let group = InProcessGroup::new(world, timeout);
    let (first, others) = std::thread::scope(|s| {
        let handles: Vec<_> = (1..world)
            .map(|r| {
                let mut comm = group.rank(r, link);
                s.spawn(move || run_rank(ctx, &mut comm, &mut |_| {}))
            })
            .collect();
        let first = run_rank(ctx, &mut group.rank(0, link), progress);
        let others: Vec<Result<EntryOutput, String>> =
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("rank thread panicked".into()))).collect();
        (first, others)
    });
    let others: Vec<Result<RankFigures, String>> = others.into_iter().map(|o| o.map(|o| RankFigures::of(&o))).collect();
    combine(first, &others, world)
}

/// What rank 0 needs of another rank's entry.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct RankFigures {
    tokens: u64,
    samples: u64,
    tokens_per_s: f64,
    samples_per_s: f64,
    /// The rank's own memory figures.
    ranks: Vec<RankRecord>,
}

impl RankFigures {
    fn of(o: &EntryOutput) -> RankFigures {
        let m = &o.metrics;
        RankFigures {
            tokens: m.tokens,
            samples: m.samples,
            tokens_per_s: m.tokens_per_s,
            samples_per_s: m.samples_per_s,
            ranks: m.ranks.clone(),
        }
    }
}

/// Rank 0's figures with throughput summed over ranks; the first real error
/// (not the "aborted" echoes it caused elsewhere) if any rank failed.
fn combine(first: Result<EntryOutput, String>, others: &[Result<RankFigures, String>], world: usize) -> Result<EntryOutput, String> {
    let errors: Vec<(usize, &String)> = std::iter::once(first.as_ref().err())
        .chain(others.iter().map(|o| o.as_ref().err()))
        .enumerate()
        .filter_map(|(r, e)| e.map(|e| (r, e)))
        .collect();
    if let Some((r, e)) = errors.iter().find(|(_, e)| !e.contains("was aborted")).or(errors.first()) {
        return Err(format!("rank {r}: {e}"));
    }
    let mut out = first.map_err(|e| format!("rank 0: {e}"))?;
    let m = &mut out.metrics;
    for o in others.iter().flatten() {
        m.tokens += o.tokens;
        m.samples += o.samples;
        m.tokens_per_s += o.tokens_per_s;
        m.samples_per_s += o.samples_per_s;
        m.ranks.extend(o.ranks.iter().cloned());
    }
    m.ranks.sort_by_key(|r| r.rank);
    m.achieved_tflops = m.flops_per_token * m.tokens_per_s / 1e12;
    m.mfu = m.peak_tflops.map(|p| m.achieved_tflops / (p * world as f64));
    Ok(out)
}

fn run_nccl(
    ctx: &EntryContext<'_>,
    store: &rendezvous::Client,
    rank: usize,
    world: usize,
    progress: &mut dyn FnMut(&Progress),
    ranks_lost: &mut bool,
    on_fire: Box<dyn FnOnce(&str) + Send>,
) -> anyhow::Result<Result<EntryOutput, String>> {
    let out = match nccl_join(store, &format!("nccl/{}", ctx.entry.id), rank, world, ctx.entry.strategy.link, ctx.device) {
        Ok(mut comm) => {
            let dog = Watchdog::start(on_fire, store.clone(), &ctx.entry.id, rank, world);
            let mut tick = |p: &Progress| {
                dog.beat(p.step);
                progress(p)
            };
            let out = run_rank(ctx, &mut comm, &mut tick);
            dog.stop();
            out
        }
        Err(e) => Err(format!("{e:#}")),
    };
    let done = |r: usize| format!("done/{}/{r}", ctx.entry.id);
    if rank != 0 {
        let figures: Result<RankFigures, String> = out.as_ref().map(RankFigures::of).map_err(Clone::clone);
        store.set(&done(rank), &serde_json::to_vec(&figures)?)?;
        return Ok(out);
    }
    let mut others = Vec::new();
    for r in 1..world {
        others.push(match store.get(&done(r)) {
            Ok(bytes) => serde_json::from_slice::<Result<RankFigures, String>>(&bytes)?,
            Err(e) => {
                *ranks_lost = true;
                Err(format!("rank {r} never reported the end of the entry ({e})"))
            }
        });
    }
    Ok(combine(out, &others, world))
}
