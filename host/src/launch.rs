//! Running a plan: entries one after another on this process's rank, each
//! isolated so that a failing entry (error, panic, out of memory) is recorded
//! as failed and the run goes on; the result file is rewritten atomically
//! after every entry, so a killed run keeps what it finished.
//!
//! [`run_suite`] prepares the run (device, result file, the entries still to
//! run, agreed between ranks), then for each entry runs it on the ranks
//! (`Run::entry`) and keeps its record (`Run::keep`). What the run shows
//! goes through the [`Console`]; rank processes, the rendezvous and NCCL are
//! set up by [`crate::ranks`].

use std::ffi::OsString;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use crate::console::{last_panic, Console, QuietPanics};
use crate::device::{self, GpuInfo};
use crate::ranks::{nccl_join, NcclLog, RankEnv, Watchdog, ENTRIES_VAR};
use crate::rendezvous;
use harness_format::error::EntryError;
use harness_format::exit;
use harness_format::fmt::short;
use harness_format::results::{EntryResult, EntryStatus, RankRecord, RunResult};
use harness_format::suite::{Plan, PlanEntry, Precision, Suite, SuiteMeta};
use harness_runtime::comm::{Collective, InProcessGroup, Link, SingleRank};
use harness_sandbox::plugin::exit_guard::{self, Mark, Verdict};
use harness_sandbox::plugin::PluginSet;
use harness_train::{EntryContext, EntryOutput, Progress};

/// How a run is asked for.
pub struct RunOptions {
    /// The result file (created, or continued with `resume`).
    pub out: PathBuf,
    /// Continue `out`: run only the entries it lacks.
    pub resume: bool,
    /// This process's place among the ranks, when started as one of several.
    pub ranks: Option<RankEnv>,
    /// A standard-suite run: what was entered (its `unofficial` reasons are
    /// completed here, from the machine).
    pub submission: Option<harness_format::results::Submission>,
    /// A rank process's NCCL debug output ([`NcclLog::capture`]).
    pub nccl_log: Option<NcclLog>,
    /// `--trace`: record a trace of one step of every entry.
    pub trace: bool,
}

/// Where an entry's checkpoints go: next to the result file,
/// `<out stem>.checkpoints/<entry id, with / as _>`.
pub fn checkpoint_dir(out: &std::path::Path, entry_id: &str) -> PathBuf {
    out.with_extension("checkpoints").join(file_safe(entry_id))
}

/// Where `--trace` writes an entry's trace: next to the result file,
/// `<out stem>.trace/<entry id, with / as _>.json`.
pub fn trace_file(out: &std::path::Path, entry_id: &str) -> PathBuf {
    out.with_extension("trace").join(format!("{}.json", file_safe(entry_id)))
}

fn file_safe(entry_id: &str) -> String {
    entry_id.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect()
}

/// Runs every planned entry that `out` lacks; returns the final result.
pub fn run_suite(suite: &Suite, opts: &RunOptions, console: &mut Console) -> anyhow::Result<RunResult> {
    let meta = &suite.spec.suite;
    let world = meta.world_size as usize;
    let (rank, local_rank) = opts.ranks.as_ref().map_or((0, 0), |e| (e.rank, e.local_rank));
    let device = prepare_device(meta, opts.ranks.as_ref())?;
    let dist = device.is_cuda() && world > 1;
    let writes = rank == 0;
    let timeout = Duration::from_secs_f64(meta.collective_timeout_s);
    // Ranks of a multi-GPU run agree on the entries through rank 0's store;
    // set up before the result file, so that a rank without the run's
    // secret stops before rank 0 writes anything.
    let store = match (&opts.ranks, dist) {
        (Some(env), true) => Some(env.rendezvous(timeout)?),
        _ => None,
    };
    let mut result = open_result(suite, opts, writes, console)?;
    if let Some(c) = &store {
        agree_on_switches(c, rank)?;
    }
    let plan = suite.plan();
    let todo = entries_to_run(&plan, &result, store.as_ref(), rank)?;
    // The GPU this rank trains on (None on the CPU).
    let gpu = if device.is_cuda() { result.machine.gpus.get(local_rank).cloned() } else { None };
    let device_name = device_name(device, gpu.as_ref(), dist, world);
    console.run_started(&meta.name, todo.len(), plan.entries.len(), &device_name, &opts.out);
    if !device.is_cuda() {
        warn_of_emulated_bf16(suite, &todo, console);
    }

    let suite_dir = suite.path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf();
    let memory_total_bytes = match device {
        tch::Device::Cpu => result.machine.memory_bytes,
        _ => gpu.as_ref().map_or(0, |g| g.memory_bytes),
    };
    let _quiet_panics = QuietPanics::install();
    // Loaded on first use: a broken plugin fails only the entries using it.
    let plugins = PluginSet::new(&suite.spec.plugins, &suite_dir);
    let run = Run { suite, opts, world, rank, writes, device, gpu, device_name, memory_total_bytes, suite_dir, plugins, timeout, store };
    if run.device.is_cuda() && !todo.is_empty() {
        let t0 = std::time::Instant::now();
        let workloads = run.warm_up(&todo, console);
        console.note(&format!(
            "warmed up the process on {workloads} workload(s) in {:.1} s ({PROCESS_WARMUP_STEPS} untimed steps each, nothing recorded)",
            t0.elapsed().as_secs_f64()
        ));
    }
    // Set when a rank died or hung: the next entry could not form a
    // communicator, so the run stops after recording this one.
    let mut ranks_lost = false;

    for (i, entry) in todo.iter().enumerate() {
        let w = &suite.spec.workloads[entry.workload];
        console.entry_started(i + 1, todo.len(), &entry.id, w.steps, w.time_budget_s);
        let outcome = run.entry(entry, &result, console, &mut ranks_lost)?;
        if let Ok(out) = &outcome {
            for w in &out.warnings {
                console.warning(w);
            }
        }
        if opts.trace && rank == 0 {
            let trace = trace_file(&opts.out, &entry.id);
            if trace.is_file() {
                console.note(&format!("{}: trace of one step in {}", entry.id, trace.display()));
            }
        }
        let record = entry_result(entry, &w.name, &run.device_name, outcome);
        console.entry_finished(&record);
        let lost_because = match (&record.status, ranks_lost) {
            (EntryStatus::Failed { error, .. }, true) => Some(error.clone()),
            (_, true) => Some("a rank was lost".to_owned()),
            _ => None,
        };
        run.keep(&mut result, record)?;
        if let Some(why) = lost_because {
            return Err(RanksLost(format!(
                "stopping the run: {why}\nfinished entries are kept in {}; `--resume` continues once every rank is back",
                opts.out.display()
            ))
            .into());
        }
    }
    Ok(result)
}

/// Says, once per workload, that bf16 entries about to run on a CPU that
/// lacks bf16 arithmetic ([`device::cpu_has_bf16`]) will be slow: libtorch
/// emulates it.
fn warn_of_emulated_bf16(suite: &Suite, todo: &[&PlanEntry], console: &Console) {
    let mut bf16: Vec<&str> = Vec::new();
    for e in todo {
        let w = &suite.spec.workloads[e.workload];
        if w.precision == Precision::Bf16 && !bf16.contains(&w.name.as_str()) {
            bf16.push(&w.name);
        }
    }
    if bf16.is_empty() || device::cpu_has_bf16() {
        return;
    }
    console.warning(&format!(
        "{} train(s) in bf16, and this CPU has no bf16 arithmetic (no avx512_bf16 or amx_bf16 flag, or ATEN_CPU_CAPABILITY / \
         ONEDNN_MAX_CPU_ISA hold libtorch below it): libtorch emulates bf16, many times slower than fp32\n\
         hint: run bf16 workloads on a CPU with bf16 (Intel Sapphire Rapids or newer, AMD Zen 4 or newer) or a GPU, or set \
         `precision = \"fp32\"`",
        bf16.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
    ));
}

/// Steps of the untimed warm-up on each workload before a GPU process's
/// first entry ([`Run::warm_up`]).
pub const PROCESS_WARMUP_STEPS: u64 = 3;

/// Why a rank process stops before the end of its entries: a rank was lost,
/// and its communicator with it (exit code [`harness_format::exit::RANK_LOST`]).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RanksLost(pub String);

/// Selects this rank's device (made current for a multi-GPU run, which must
/// run under a launcher of `world_size` ranks) and libtorch's thread count.
fn prepare_device(meta: &SuiteMeta, ranks: Option<&RankEnv>) -> anyhow::Result<tch::Device> {
    let world = meta.world_size as usize;
    let local_rank = ranks.map_or(0, |e| e.local_rank);
    let device = device::select(meta.device, local_rank)?;
    let dist = device.is_cuda() && world > 1;
    if dist {
        let env = ranks.ok_or_else(|| anyhow::anyhow!("a multi-GPU suite must run under a launcher (harness run starts one itself)"))?;
        anyhow::ensure!(env.world == world, "WORLD_SIZE={} but the suite says world_size = {world}", env.world);
        device::make_current(local_rank)?;
    }
    if let Some(n) = meta.threads {
        tch::set_num_threads(n as i32);
    } else if dist && std::env::var_os("OMP_NUM_THREADS").is_none() {
        // Ranks sharing a host share its cores: libtorch's default (every
        // core per process) oversubscribes them and starves the data threads.
        let local = std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(world).max(1);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        tch::set_num_threads((cores / local).max(1) as i32);
    }
    Ok(device)
}

/// The result the run adds to: `out` read back to resume it (rank 0; it must
/// come from the same suite file), else a new one, written at once by the
/// rank that writes.
fn open_result(suite: &Suite, opts: &RunOptions, writes: bool, console: &Console) -> anyhow::Result<RunResult> {
    let machine = device::fingerprint();
    let switches = harness_format::switches::get().recorded();
    if !(opts.resume && writes) {
        let mut r = RunResult::new(suite, machine);
        r.switches = switches;
        r.submission = opts.submission.clone().map(|mut s| {
            s.unofficial = s.unofficial_reasons(suite, &r.machine, &r.switches);
            s
        });
        if writes {
            r.write_atomic(&opts.out)?;
        }
        return Ok(r);
    }
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
    if r.switches != switches {
        anyhow::bail!(
            "{} was started with the switches {}, this process has {}; resume needs the same HARNESS_* switches\nhint: set them as they were, or run without --resume to start a new result file",
            opts.out.display(),
            harness_format::switches::line(&r.switches),
            harness_format::switches::line(&switches)
        );
    }
    if r.machine.hostname != machine.hostname || r.machine.gpus != machine.gpus {
        console.warning(&format!(
            "resuming on a different machine than {} was started on; its entries will carry mixed fingerprints",
            opts.out.display()
        ));
    }
    Ok(r)
}

/// Ranks run the same work: rank 0 publishes its recorded switches, and a
/// rank whose own differ (another host's environment) stops, since rank 0
/// records only its own.
fn agree_on_switches(store: &rendezvous::Client, rank: usize) -> anyhow::Result<()> {
    let ours = harness_format::switches::get().recorded();
    if rank == 0 {
        store.set("switches", &serde_json::to_vec(&ours)?)?;
        return Ok(());
    }
    let theirs: std::collections::BTreeMap<String, String> = serde_json::from_slice(&store.get("switches")?)?;
    anyhow::ensure!(
        theirs == ours,
        "rank {rank} runs with the switches {}, rank 0 with {}; every rank must run the same work\nhint: set the same HARNESS_* variables on every host",
        harness_format::switches::line(&ours),
        harness_format::switches::line(&theirs)
    );
    Ok(())
}

/// The planned entries that `result` lacks; with a store, rank 0's list,
/// which every rank then runs.
fn entries_to_run<'p>(
    plan: &'p Plan,
    result: &RunResult,
    store: Option<&rendezvous::Client>,
    rank: usize,
) -> anyhow::Result<Vec<&'p PlanEntry>> {
    let done = result.done_ids();
    // The launcher names the entries of this round of rank processes.
    let named: Option<Vec<String>> = std::env::var(crate::ranks::ENTRIES_VAR).ok().map(|v| v.split(',').map(str::to_owned).collect());
    let mut todo_ids: Vec<String> = plan
        .entries
        .iter()
        .filter(|e| !done.contains(&e.id) && named.as_ref().is_none_or(|n| n.contains(&e.id)))
        .map(|e| e.id.clone())
        .collect();
    if let Some(c) = store {
        if rank == 0 {
            c.set("todo", &serde_json::to_vec(&todo_ids)?)?;
        } else {
            todo_ids = serde_json::from_slice(&c.get("todo")?)?;
        }
    }
    Ok(plan.entries.iter().filter(|e| todo_ids.contains(&e.id)).collect())
}

/// The device as the results name it: `"cpu"`, `"cuda (<GPU>)"`, or
/// `"<world> x cuda (<GPU>)"` for a multi-GPU run.
fn device_name(device: tch::Device, gpu: Option<&GpuInfo>, dist: bool, world: usize) -> String {
    match device {
        tch::Device::Cpu => "cpu".to_owned(),
        _ => {
            let name = gpu.map_or("cuda".into(), |g| format!("cuda ({})", g.name));
            if dist {
                format!("{world} x {name}")
            } else {
                name
            }
        }
    }
}

/// What every entry of a run shares.
struct Run<'a> {
    suite: &'a Suite,
    opts: &'a RunOptions,
    world: usize,
    rank: usize,
    /// Whether this rank writes the result file (rank 0).
    writes: bool,
    device: tch::Device,
    /// The GPU this rank trains on (None on the CPU).
    gpu: Option<GpuInfo>,
    /// The device as the results name it ([`device_name`]).
    device_name: String,
    memory_total_bytes: u64,
    suite_dir: PathBuf,
    plugins: PluginSet,
    /// How long a collective may wait for the other ranks.
    timeout: Duration,
    /// Rank 0's store, when the ranks are processes of a multi-GPU run.
    store: Option<rendezvous::Client>,
}

impl Run<'_> {
    /// Runs one entry on this rank: alone, as one NCCL rank of several
    /// processes, or with one thread per rank (CPU data parallelism). `Err`
    /// ends the run (a rendezvous failure); a failed entry is `Ok(Err)`.
    fn entry(
        &self,
        entry: &PlanEntry,
        result: &RunResult,
        console: &mut Console,
        ranks_lost: &mut bool,
    ) -> anyhow::Result<Result<EntryOutput, EntryError>> {
        let ctx = self.context(entry);
        let say = console.rank_stopping();
        let mut on_progress = |p: &Progress| console.progress(p);
        Ok(if let Some(c) = &self.store {
            let on_fire = self.on_fire(entry, result, say);
            run_nccl(&ctx, c, self.rank, self.world, &mut on_progress, ranks_lost, on_fire, self.opts.nccl_log.as_ref())?
        } else if self.world == 1 {
            run_rank(&ctx, &mut SingleRank::default(), &mut on_progress)
        } else {
            run_threads(&ctx, self.world, entry.strategy.link, self.timeout, &mut on_progress)
        })
    }

    /// Trains each workload of `todo` for [`PROCESS_WARMUP_STEPS`] steps
    /// with the built-in strategy on this rank alone, and throws the result
    /// away: the process's one-time costs on a GPU (CUDA and cuBLAS set-up,
    /// kernels compiled at run time, the caching allocator's first
    /// reservations, about 3 s on an H200) would otherwise land in the time
    /// to target of the first entry that runs here, and of nothing after it.
    /// Returns the number of workloads warmed up; a warm-up that fails is a
    /// warning (the entry itself will say what is wrong).
    fn warm_up(&self, todo: &[&PlanEntry], console: &Console) -> usize {
        let mut seen = Vec::new();
        for entry in todo {
            if seen.contains(&entry.workload) {
                continue;
            }
            seen.push(entry.workload);
            let w = &self.suite.spec.workloads[entry.workload];
            let short = harness_format::suite::Workload {
                steps: Some(PROCESS_WARMUP_STEPS),
                time_budget_s: None,
                eval_every: 0,
                eval_every_tokens: None,
                eval_batches: 1,
                target_loss: None,
                target_above_floor: None,
                target_accuracy: None,
                stop_at_target: false,
                faults: None,
                ..w.clone()
            };
            let plan = PlanEntry {
                id: format!("warm-up/{}", w.name),
                strategy: harness_format::suite::Strategy::default_baseline(),
                ..(*entry).clone()
            };
            let scratch = std::env::temp_dir().join(format!("harness-warm-up-{}", std::process::id()));
            let ctx = EntryContext {
                workload: &short,
                entry: &plan,
                checkpoint_dir: scratch.clone(),
                resume: false,
                trace: None,
                ..self.context(entry)
            };
            let outcome =
                std::panic::catch_unwind(AssertUnwindSafe(|| harness_train::run_entry(&ctx, &mut SingleRank::default(), &mut |_| {})));
            let _ = std::fs::remove_dir_all(&scratch);
            match outcome {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => console.warning(&format!("the untimed warm-up on `{}` failed: {}", w.name, e.message())),
                Err(_) => console.warning(&format!("the untimed warm-up on `{}` panicked", w.name)),
            }
        }
        seen.len()
    }

    /// What training needs to know of an entry and the run around it.
    fn context<'e>(&'e self, entry: &'e PlanEntry) -> EntryContext<'e> {
        let meta = &self.suite.spec.suite;
        let w = &self.suite.spec.workloads[entry.workload];
        // The suite's figure wins; else the GPU table at the entry's precision.
        let low_precision = w.precision != Precision::Fp32;
        let peak_for = meta.peak_tflops.or_else(|| self.gpu.as_ref().and_then(|g| device::peak_tflops(&g.name, low_precision)));
        EntryContext {
            workload: w,
            entry,
            suite_sha256: &self.suite.sha256,
            suite_dir: &self.suite_dir,
            device: self.device,
            warmup_steps: meta.warmup_steps,
            peak_tflops: peak_for,
            memory_total_bytes: self.memory_total_bytes,
            bucket_bytes: meta.bucket_mb.map(|mb| (mb * 1024.0 * 1024.0) as u64),
            plugins: &self.plugins,
            checkpoint_dir: checkpoint_dir(&self.opts.out, &entry.id),
            resume: self.opts.resume,
            trace: self.opts.trace.then(|| trace_file(&self.opts.out, &entry.id)),
        }
    }

    /// What the watchdog does if this entry hangs on a lost rank: `say` why
    /// and, on rank 0, write the result so far with this entry failed.
    /// On the other ranks, tell rank 0 that this one is gone, so that it
    /// does not wait for this rank's figures.
    fn on_fire(
        &self,
        entry: &PlanEntry,
        result: &RunResult,
        say: impl FnOnce(&str) + Send + 'static,
    ) -> Box<dyn FnOnce(&EntryError) + Send> {
        let (rank, id) = (self.rank, entry.id.clone());
        if !self.writes {
            let store = self.store.clone();
            return Box::new(move |e: &EntryError| {
                say(e.message());
                let gone: Result<RankFigures, EntryError> =
                    Err(EntryError::RankLost { message: format!("rank {rank} stopped: {}", e.message()) });
                if let (Some(store), Ok(bytes)) = (store, serde_json::to_vec(&gone)) {
                    let _ = store.set(&format!("done/{id}/{rank}"), &bytes);
                }
            });
        }
        let w = &self.suite.spec.workloads[entry.workload];
        let (mut snap, out) = (result.clone(), self.opts.out.clone());
        let (entry, workload, device) = (entry.clone(), w.name.clone(), self.device_name.clone());
        Box::new(move |e: &EntryError| {
            say(e.message());
            snap.add_entry(entry_result(&entry, &workload, &device, Err(e.clone())));
            let _ = snap.write_atomic(&out);
        })
    }

    /// Adds an entry's record to the result, in plan order whatever order
    /// resume ran things in, and rewrites the result file (rank 0).
    /// The folder of the entries' checkpoints goes once it is empty: a
    /// finished entry removes its own.
    fn keep(&self, result: &mut RunResult, record: EntryResult) -> anyhow::Result<()> {
        result.add_entry(record);
        if self.writes {
            result.write_atomic(&self.opts.out)?;
            // Fails, as it should, while an entry's checkpoints are in it.
            let _ = std::fs::remove_dir(self.opts.out.with_extension("checkpoints"));
        }
        Ok(())
    }
}

/// After the launcher lost a rank during the entries of `group` (those
/// that `done_before` lacked): makes sure the entry that was running has a
/// failed record. Rank 0's watchdog usually wrote it (then `why`, what the
/// launcher saw of the ranks' ends, is added to its message when a rank was
/// killed); when rank 0 itself died, it is written here. Returns the
/// entry's id, or None when there is no result file to record it in.
pub fn record_lost_entry(
    out: &Path,
    suite: &Suite,
    group: &[&PlanEntry],
    done_before: &std::collections::BTreeSet<String>,
    why: &str,
) -> anyhow::Result<Option<String>> {
    if !out.exists() {
        return Ok(None);
    }
    let mut result = RunResult::read(out)?;
    let done = result.done_ids();
    let recorded_now = group.iter().rev().find(|e| done.contains(&e.id) && !done_before.contains(&e.id));
    let running = group.iter().find(|e| !done.contains(&e.id));
    let id = match (running, recorded_now) {
        // Rank 0 recorded the entry (its watchdog fired) and died after.
        (_, Some(e)) if result.entries.iter().any(|r| r.id == e.id && matches!(r.status, EntryStatus::Failed { .. })) => {
            if let Some(r) = result.entries.iter_mut().find(|r| r.id == e.id) {
                if let EntryStatus::Failed { error, .. } = &mut r.status {
                    if why.contains("signal") && !error.contains(why) {
                        error.push_str(&format!(" ({why})"));
                    }
                }
            }
            e.id.clone()
        }
        (Some(e), _) => {
            let w = &suite.spec.workloads[e.workload];
            let gpu = result.machine.gpus.first().cloned();
            let world = suite.spec.suite.world_size as usize;
            let device = device_name(tch::Device::Cuda(0), gpu.as_ref(), world > 1, world);
            let message = format!("{why}; the entry could not finish");
            result.add_entry(entry_result(e, &w.name, &device, Err(EntryError::RankLost { message })));
            e.id.clone()
        }
        (None, _) => return Ok(group.last().map(|e| e.id.clone())),
    };
    result.write_atomic(out)?;
    Ok(Some(id))
}

/// The record of one entry, from what its run returned.
fn entry_result(entry: &PlanEntry, workload: &str, device: &str, outcome: Result<EntryOutput, EntryError>) -> EntryResult {
    let (status, metrics, histograms) = match outcome {
        Ok(out) => (EntryStatus::Ok, Some(out.metrics), out.histograms),
        Err(e) => (EntryStatus::Failed { error: entry_error_message(&e), kind: Some(e.kind().to_owned()) }, None, Default::default()),
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
fn run_rank(ctx: &EntryContext<'_>, comm: &mut dyn Collective, progress: &mut dyn FnMut(&Progress)) -> Result<EntryOutput, EntryError> {
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| harness_train::run_entry(ctx, comm, progress)));
    let err = match outcome {
        Ok(Ok(out)) => return Ok(out),
        Ok(Err(e)) => e,
        Err(_) => EntryError::from_panic(&last_panic().unwrap_or_else(|| "panic".into())),
    };
    comm.abort(err.message());
    Err(err)
}

/// The failure message that the results keep for an entry: the error and
/// its causes, "outer: inner: ...". The one place that turns an
/// [`EntryError`] into text.
fn entry_error_message(e: &EntryError) -> String {
    e.message().to_owned()
}

/// CPU data parallelism: one thread per rank, an in-process collective.
/// Rank 0's figures are kept, with throughput summed over the ranks.
fn run_threads(
    ctx: &EntryContext<'_>,
    world: usize,
    link: Option<Link>,
    timeout: Duration,
    progress: &mut dyn FnMut(&Progress),
) -> Result<EntryOutput, EntryError> {
    let group = InProcessGroup::new(world, timeout);
    let (first, others) = std::thread::scope(|s| {
        let handles: Vec<_> = (1..world)
            .map(|r| {
                let mut comm = group.rank(r, link);
                s.spawn(move || run_rank(ctx, &mut comm, &mut |_| {}))
            })
            .collect();
        let first = run_rank(ctx, &mut group.rank(0, link), progress);
        let others: Vec<Result<EntryOutput, EntryError>> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(EntryError::Other { message: "rank thread panicked".into() })))
            .collect();
        (first, others)
    });
    let others: Vec<Result<RankFigures, EntryError>> = others.into_iter().map(|o| o.map(|o| RankFigures::of(&o))).collect();
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
fn combine(
    first: Result<EntryOutput, EntryError>,
    others: &[Result<RankFigures, EntryError>],
    world: usize,
) -> Result<EntryOutput, EntryError> {
    let errors: Vec<(usize, &EntryError)> = std::iter::once(first.as_ref().err())
        .chain(others.iter().map(|o| o.as_ref().err()))
        .enumerate()
        .filter_map(|(r, e)| e.map(|e| (r, e)))
        .collect();
    if let Some((r, e)) = errors.iter().find(|(_, e)| !matches!(e, EntryError::RankLost { .. })).or(errors.first()) {
        return Err(e.on_rank(*r));
    }
    let mut out = first.map_err(|e| e.on_rank(0))?;
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

/// Runs this rank's part of an entry as one NCCL rank of several processes,
/// under a [`Watchdog`] from before the communicator forms (a rank that is
/// gone would leave the others in `ncclCommInitRank` for ever) to the end.
/// A rank whose entry fails publishes its error for its peers; rank 0
/// collects the others' figures and keeps what NCCL ran with.
#[allow(clippy::too_many_arguments)]
fn run_nccl(
    ctx: &EntryContext<'_>,
    store: &rendezvous::Client,
    rank: usize,
    world: usize,
    progress: &mut dyn FnMut(&Progress),
    ranks_lost: &mut bool,
    on_fire: Box<dyn FnOnce(&EntryError) + Send>,
    nccl_log: Option<&NcclLog>,
) -> anyhow::Result<Result<EntryOutput, EntryError>> {
    let id = &ctx.entry.id;
    let mark = nccl_log.map(NcclLog::mark);
    let dog = Watchdog::start(on_fire, store.clone(), id, rank, world);
    let (mut out, comm) = match crate::ranks::nccl_settings_mismatch(&ctx.entry.strategy.nccl_env()) {
        Some(why) => (Err(EntryError::Other { message: why }), None),
        None => match nccl_join(store, &format!("nccl/{id}"), rank, world, ctx.entry.strategy.link, ctx.device) {
            Ok(mut comm) => {
                let mut tick = |p: &Progress| {
                    dog.beat(p.step);
                    progress(p)
                };
                (run_rank(ctx, &mut comm, &mut tick), Some(comm))
            }
            Err(e) => (Err(EntryError::RankLost { message: format!("{e:#}") }), None),
        },
    };
    if out.is_ok() {
        // Destroyed under the watchdog: every rank is destroying its own.
        drop(comm);
        dog.stop();
    } else {
        // Stopped first, so that a peer failing at the same moment does not
        // end this process for an entry that is already over here.
        dog.stop();
        if let Err(e) = &out {
            // Before anything that could wait for the peers: they may be in
            // a collective this rank will never enter.
            crate::ranks::publish_failure(store, id, rank, e);
        }
        // ncclCommDestroy waits for peers stuck in such a collective: a
        // failed entry's communicator is left to the end of the process.
        std::mem::forget(comm);
    }
    if let (Ok(o), Some(log), Some(mark)) = (&mut out, nccl_log, mark) {
        o.metrics.nccl = Some(log.record(mark, device::nccl_version()));
    }
    let done = |r: usize| format!("done/{}/{r}", ctx.entry.id);
    if rank != 0 {
        // Rank 0 stops the run after an entry that lost a rank (below): a
        // rank that saw the loss itself stops too, rather than wait for a
        // communicator for the next entry that no one will form.
        if matches!(out, Err(EntryError::RankLost { .. })) {
            *ranks_lost = true;
        }
        let figures: Result<RankFigures, EntryError> = out.as_ref().map(RankFigures::of).map_err(Clone::clone);
        store.set(&done(rank), &serde_json::to_vec(&figures)?)?;
        return Ok(out);
    }
    let mut others = Vec::new();
    for r in 1..world {
        others.push(match store.get(&done(r)) {
            Ok(bytes) => {
                let figures = serde_json::from_slice::<Result<RankFigures, EntryError>>(&bytes)?;
                // A rank that stopped because of a lost rank is gone: the
                // next entry could not form a communicator.
                if matches!(figures, Err(EntryError::RankLost { .. })) {
                    *ranks_lost = true;
                }
                figures
            }
            Err(e) => {
                *ranks_lost = true;
                Err(EntryError::RankLost { message: format!("rank {r} never reported the end of the entry ({e})") })
            }
        });
    }
    Ok(combine(out, &others, world))
}

/// Starts one process per local GPU, each a rank of `world` with torchrun's
/// variables, for the entries of the suite's plan that `out` lacks, and waits for
/// them; rank 0 writes `out`. NCCL reads its settings once per process, so
/// entries whose strategies set different NCCL settings run in separate
/// rounds of processes, each started with its settings. When a rank is lost
/// (killed, or stopped by its watchdog), the entry it was in is recorded as
/// failed (by rank 0, or here when rank 0 itself died) and the ranks are
/// started anew for the entries left. Returns None when every entry has a
/// record, or the exit code of a rank that could not run at all, or
/// [`exit::ENDED_AFTER_RUN`] when every entry has a record but a rank's
/// process died after finishing its entries. `argv`
/// gives the ranks' arguments, continuing `out` (`--resume`) or not.
pub fn launch_local_ranks(
    world: usize,
    argv: &dyn Fn(bool) -> Vec<OsString>,
    out: &std::path::Path,
    suite: &Suite,
    resume: bool,
) -> anyhow::Result<Option<i32>> {
    let plan = suite.plan();
    let gpus = device::gpu_count();
    anyhow::ensure!(gpus >= world, "the suite asks for world_size = {world} but this machine has {gpus} usable GPU(s)\nhint: lower world_size, or start ranks on several hosts with torchrun or srun");
    let mut started = resume;
    // A rank process that finished its round and then died (see below).
    let mut ended_after_run = false;
    loop {
        let done = done_ids(out)?;
        let todo: Vec<&PlanEntry> = plan.entries.iter().filter(|e| !done.contains(&e.id)).collect();
        let Some(first) = todo.first() else { return Ok(ended_after_run.then_some(exit::ENDED_AFTER_RUN)) };
        let env = first.strategy.nccl_env();
        let group: Vec<&PlanEntry> = todo.iter().take_while(|e| e.strategy.nccl_env() == env).copied().collect();
        let ids: Vec<&str> = group.iter().map(|e| e.id.as_str()).collect();
        let mut env: Vec<(String, String)> = env.into_iter().collect();
        env.push((ENTRIES_VAR.to_owned(), ids.join(",")));
        // The copy engines' all-gather needs NCCL's zero-CTA policy: for
        // HARNESS_CE_GATHER=1, and by default for a group of entries that
        // all may take it (see Strategy::copy_engine_gather_candidate).
        let policy_set = std::env::var_os("NCCL_CTA_POLICY").is_some() || env.iter().any(|(k, _)| k == "NCCL_CTA_POLICY");
        let ce = match harness_format::switches::get().ce_gather {
            Some(on) => on,
            None => group.iter().all(|e| e.strategy.copy_engine_gather_candidate()),
        };
        if ce && !policy_set {
            env.push(("NCCL_CTA_POLICY".to_owned(), "2".to_owned()));
        }
        let args = argv(started);
        started = true;
        let ends = spawn_ranks(world, &args, &env)?;
        // A native plugin that ended a rank's process (any route, any status)
        // ends the run, as it does a single process's under `supervise`.
        if let Some(m) =
            ends.iter().enumerate().find_map(|(r, e)| crate::supervise::ended_by_plugin(&e.1, e.0).map(|m| format!("rank {r}: {m}")))
        {
            eprintln!("harness: {m}; the run is incomplete (the result file keeps the entries finished before)");
            return Ok(Some(exit::PLUGIN_ENDED_PROCESS));
        }
        // A rank that finished its round and then died (a native plugin's
        // thread or exit handler) lost nothing: its entries are recorded.
        // It counts with the code it returned, and the run, once done,
        // exits with ENDED_AFTER_RUN, never 0.
        let statuses: Vec<std::process::ExitStatus> = ends
            .into_iter()
            .enumerate()
            .map(|(r, (status, v))| match (crate::supervise::ended_after_run(&v, status), v.finished) {
                (Some(m), Some(code)) => {
                    use std::os::unix::process::ExitStatusExt;
                    eprintln!("harness: rank {r}: {m}; its entries are recorded, and the run will exit with {}", exit::ENDED_AFTER_RUN);
                    ended_after_run = true;
                    std::process::ExitStatus::from_raw((code & 0xff) << 8)
                }
                _ => status,
            })
            .collect();
        let lost: Vec<String> = statuses.iter().enumerate().filter_map(|(r, s)| lost_rank(r, s)).collect();
        if lost.is_empty() {
            // 0, or 1 (some entry failed): the round finished its entries.
            match statuses.iter().filter_map(|s| s.code()).find(|&c| c != exit::OK && c != exit::ENTRY_FAILED) {
                Some(code) => return Ok(Some(code)),
                // A round that recorded nothing would be started again for ever.
                None if done_ids(out)?.len() == done.len() => return Ok(Some(exit::ERROR)),
                None => continue,
            }
        }
        let why = lost.join("; ");
        match crate::launch::record_lost_entry(out, suite, &group, &done, &why)? {
            Some(id) => eprintln!("harness: {why} during {id}; starting the ranks again for the entries left"),
            None => return Ok(Some(exit::RANK_LOST)),
        }
    }
}

/// Starts `harness ARGS` once per rank of `world` on this machine, with
/// torchrun's variables and `env`, and waits for all: their exit statuses
/// and exit marks (the native plugin call each was in: see `supervise`),
/// in rank order. Only rank 0 prints to stdout. The ranks meet on
/// 127.0.0.1 with a secret made for this round of processes, which they
/// get in their environment (never on a command line).
fn spawn_ranks(world: usize, args: &[OsString], env: &[(String, String)]) -> anyhow::Result<Vec<(std::process::ExitStatus, Verdict)>> {
    let exe = std::env::current_exe()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let secret = rendezvous::Secret::generate();
    let marks_dir = tempfile::tempdir().context("cannot make a folder for the ranks' exit marks")?;
    let mut children = Vec::new();
    let mut marks = Vec::new();
    for r in 0..world {
        let path = marks_dir.path().join(format!("rank-{r}"));
        std::fs::File::create(&path)?.set_len(exit_guard::MARK_BYTES)?;
        marks.push(Mark::map(&path).context("cannot map a rank's exit mark")?);
        let mut c = std::process::Command::new(&exe);
        c.args(args)
            .env("RANK", r.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env(rendezvous::SECRET_VAR, secret.expose())
            .env(exit_guard::MARK_VAR, &path)
            .envs(env.iter().map(|(k, v)| (k, v)));
        if r > 0 {
            c.stdout(std::process::Stdio::null());
        }
        children.push(c.spawn()?);
    }
    children.into_iter().zip(marks).map(|(mut c, m)| Ok((c.wait()?, m.verdict()))).collect()
}

/// Starts `harness ARGS` once per rank of `world` (a benchmark) and waits:
/// the exit code of the first rank that failed, or 0.
pub fn launch_bench_ranks(world: usize, args: &[OsString]) -> anyhow::Result<i32> {
    let statuses = spawn_ranks(world, args, &[])?;
    Ok(statuses.iter().map(|e| e.0).find(|s| !s.success()).map_or(exit::OK, |s| s.code().unwrap_or(exit::ERROR)))
}

/// Why rank `r`'s process was lost, if it was: killed by a signal, or
/// stopped by its watchdog.
fn lost_rank(r: usize, s: &std::process::ExitStatus) -> Option<String> {
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = s.signal() {
        let name = match sig {
            libc::SIGKILL => " (SIGKILL)",
            libc::SIGSEGV => " (SIGSEGV)",
            libc::SIGABRT => " (SIGABRT)",
            libc::SIGTERM => " (SIGTERM)",
            _ => "",
        };
        return Some(format!("rank {r} was killed by signal {sig}{name}"));
    }
    (s.code() == Some(exit::RANK_LOST)).then(|| format!("rank {r} stopped (a rank was lost)"))
}

/// The ids of the entries `out` has a record of (none when it does not exist yet).
fn done_ids(out: &std::path::Path) -> anyhow::Result<std::collections::BTreeSet<String>> {
    if !out.exists() {
        return Ok(Default::default());
    }
    Ok(harness_format::results::RunResult::read(out)?.done_ids())
}
