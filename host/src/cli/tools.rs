//! The tools beside the runs: `harness env`, `harness bench` and
//! `harness plugin`.

use super::args::{AllreduceArgs, CheckpointReadArgs, EnvArgs, PluginBenchArgs, PluginInspectArgs, PluginNewArgs, PluginTestArgs};
use super::child::Child;
use super::run::plugin_config;
use crate::bench::Allreduce;
use crate::device;
use crate::ranks::RankEnv;
use harness_format::exit;
use harness_format::fmt::{printable, printable_path};
/// `harness env`: the machine fingerprint, as a table or (`--json`) as
/// result files carry it.
pub(super) fn env(args: EnvArgs) -> anyhow::Result<i32> {
    let f = device::fingerprint();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&f)?);
    } else {
        print_env(&f);
    }
    Ok(exit::OK)
}

/// `harness bench allreduce`: started by hand, starts one rank process per
/// GPU with the same arguments and returns the first failing rank's exit
/// code; as a rank, runs the benchmark, and rank 0 prints its figures.
pub(super) fn bench_allreduce(args: AllreduceArgs) -> anyhow::Result<i32> {
    let buckets = crate::bench::bucket_bytes(&args.bytes_from)?;
    let argv = Child::BenchAllreduce(args.clone()).argv();
    let rank_env = RankEnv::from_env()?;
    let AllreduceArgs { world, iters, side_stream, untimed, .. } = args;
    match crate::bench::allreduce(rank_env.as_ref(), &buckets, world, iters, side_stream, untimed, &argv)? {
        Allreduce::Launched(code) => Ok(code),
        Allreduce::Ran(figures) => {
            if let Some(f) = figures {
                println!("{f}");
            }
            Ok(exit::OK)
        }
    }
}

/// `harness bench checkpoint-read`: prints the table of write and read speeds.
pub(super) fn bench_checkpoint_read(args: CheckpointReadArgs) -> anyhow::Result<i32> {
    print!("{}", crate::bench::checkpoint_read(&args.dir, args.gb, args.rounds, args.keep)?);
    Ok(exit::OK)
}

/// `harness plugin new`: creates the plugin's folder and prints how to
/// build and run it.
pub(super) fn plugin_new(args: PluginNewArgs) -> anyhow::Result<i32> {
    let PluginNewArgs { kind, name, dir, sdk, lang } = args;
    let made = match crate::scaffold::create(&kind, &name, &dir, sdk.as_deref(), &lang) {
        Err(e) if e.is::<crate::scaffold::Usage>() => {
            eprintln!("error: {e}");
            return Ok(exit::USAGE);
        }
        made => made?,
    };
    let made = printable_path(&made);
    println!("created {made}");
    let build = match lang.as_str() {
        "c" => "make",
        "c-wasm" | "python" | "js" => "./build.sh",
        _ => "cargo build --release --target wasm32-wasip2",
    };
    println!("build:  cd {made} && {build}");
    println!("run:    harness run {made}/suite.toml");
    Ok(exit::OK)
}

/// `harness plugin inspect`: prints the artifact's manifest as a
/// `[[plugin]]` table (its strings escaped as TOML, so nothing the
/// artifact chose reaches the terminal raw).
pub(super) fn plugin_inspect(args: PluginInspectArgs) -> anyhow::Result<i32> {
    let m = harness_sandbox::plugin::inspect(&args.path)?;
    print!("{}", printable(&crate::scaffold::manifest_toml(&m)));
    Ok(exit::OK)
}

/// `harness plugin bench`: prints the table of hook round trips, and what
/// the host's meter reads around nothing.
pub(super) fn plugin_bench(args: PluginBenchArgs) -> anyhow::Result<i32> {
    use harness_sandbox::plugin::bench::{self, Calls, Stage};
    let PluginBenchArgs { paths, calls, evict_mb } = args;
    let bar = indicatif::ProgressBar::new(paths.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("[{pos}/{len}] [{bar:20}] {msg} ({elapsed})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(250));
    let rows = bench::run(&paths, calls.map_or(Calls::Auto, Calls::Exactly), evict_mb, &mut |stage| match stage {
        Stage::Loading(p) => bar.set_message(format!("{}: loading", printable_path(p))),
        Stage::Timing(p, n) => bar.set_message(format!("{}: timing {n} calls", printable_path(p))),
        Stage::Done(_) => bar.inc(1),
    });
    bar.finish_and_clear();
    // The table names the artifacts by their paths, and those that failed
    // with their errors.
    print!("{}", printable(&bench::table(&rows)));
    let calls = rows.iter().filter_map(|r| r.timed.as_ref().ok()).map(|t| t.calls).max();
    let floor = bench::clock_floor(calls.unwrap_or(bench::AUTO_MIN_CALLS));
    println!(
        "p50..mean: the host's own per-call meter, which reads p50 {:.0} ns, p99 {:.0} ns around nothing here. \
         back to back: the whole cost to the host per call, the meter included.{}",
        floor.p50_ms * 1e6,
        floor.p99_ms * 1e6,
        if evict_mb > 0 { format!(" Each metered call followed a write through {evict_mb} MiB (cold caches).") } else { String::new() }
    );
    let failed = rows.iter().filter(|r| r.timed.is_err()).count();
    if failed > 0 {
        eprintln!("error: {failed} of {} artifacts failed (the FAILED lines under the table say why)", rows.len());
        return Ok(exit::ARTIFACT_FAILED);
    }
    Ok(exit::OK)
}

/// `harness plugin test`: runs the test kit on the artifact and prints its
/// table (or its report as JSON); [`exit::PLUGIN_TEST_FAILED`] if a check
/// failed.
pub(super) fn plugin_test(args: PluginTestArgs) -> anyhow::Result<i32> {
    use harness_sandbox::plugin::test_kit;
    let config = match plugin_config(&args.plugin_config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {}", printable(&e));
            return Ok(exit::USAGE);
        }
    };
    let report = test_kit::run(&args.path, &config, args.ranks as usize);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", printable(&test_kit::table(&report)));
    }
    let failed = report.checks.iter().filter(|c| c.status == test_kit::Status::Fail).count();
    if failed > 0 {
        eprintln!("error: {failed} of {} checks failed (the FAILED lines say what was seen)", report.checks.len());
        return Ok(exit::PLUGIN_TEST_FAILED);
    }
    Ok(exit::OK)
}

fn print_env(f: &device::Fingerprint) {
    print!("{}", printable(&env_text(f)));
}

/// `harness env`'s lines. The strings come from the host (its name, the
/// CPU's and the GPUs' names, the libraries' version strings), which a
/// terminal could act on: the caller escapes them.
pub(super) fn env_text(f: &device::Fingerprint) -> String {
    use std::fmt::Write;
    let na = |o: &Option<String>| o.clone().unwrap_or_else(|| "not found".into());
    let mut out = String::new();
    let mut line = |text: String| {
        let _ = writeln!(out, "{text}");
    };
    line(format!("harness   {} ({})", f.harness_version, f.git_revision));
    line(format!("host      {} ({})", f.hostname, f.os));
    line(format!("cpu       {} ({} cores), {} memory", f.cpu, f.cpu_cores, harness_report::bytes(f.memory_bytes)));
    if f.gpus.is_empty() {
        line("gpus      none usable (training runs on CPU)".into());
    }
    for g in &f.gpus {
        line(format!("gpu {}     {} ({}, compute {})", g.index, g.name, harness_report::bytes(g.memory_bytes), g.compute_capability));
    }
    line(format!("driver    {}", na(&f.driver)));
    line(format!(
        "cuda      {} (libtorch build){}",
        na(&f.cuda),
        f.cuda_driver_api.as_ref().map(|v| format!(", driver supports {v}")).unwrap_or_default()
    ));
    line(format!("libtorch  {}{}", na(&f.libtorch), device::libtorch_dir().map(|d| format!(" at {}", d.display())).unwrap_or_default()));
    line(format!("nccl      {}", na(&f.nccl)));
    if !f.environment.is_empty() {
        line(format!("env       {}", f.environment.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")));
    }
    out
}
