use std::ffi::OsString;

use clap::Parser;

use super::tools::env_text;
use super::*;
use crate::device;
use harness_format::fmt::printable;

/// `argv`, parsed as `harness`'s command line.
fn parse(argv: Vec<OsString>) -> Command {
    let argv = std::iter::once(OsString::from("harness")).chain(argv);
    Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{e}")).command
}

fn parse_run(words: &[&str]) -> RunArgs {
    match parse(words.iter().map(OsString::from).collect()) {
        Command::Run(a) => a,
        c => panic!("{c:?}"),
    }
}

fn parse_allreduce(words: &[&str]) -> AllreduceArgs {
    match parse(words.iter().map(OsString::from).collect()) {
        Command::Bench(BenchCommand::Allreduce(a)) => a,
        c => panic!("{c:?}"),
    }
}

#[test]
fn a_run_ranks_command_line_parses_back_to_its_options() {
    let plain = parse_run(&["run"]);
    let full = RunArgs {
        suite: "suites/standard/v1.toml".into(),
        out: Some("/tmp/r s/out.json".into()),
        resume: true,
        results_dir: "elsewhere".into(),
        quiet: true,
        plugin: Some("compressor=/p/topk.wasm".into()),
        plugin_config: vec!["ratio=0.01".into(), "name=\"a b\"".into()],
        track: Some("compression".into()),
        gpus: Some(4),
        trace: true,
    };
    let out_only = RunArgs { out: Some("r.json".into()), ..plain.clone() };
    for args in [plain, full, out_only] {
        let child = Child::Run(args.clone());
        match parse(child.argv()) {
            Command::Run(back) => assert_eq!(back, args),
            c => panic!("{c:?}"),
        }
    }
}

#[test]
fn a_run_ranks_command_line_leaves_defaults_out() {
    let args = parse_run(&["run", "s.toml", "--out", "r.json", "--gpus", "2"]);
    let argv = Child::Run(RunArgs { resume: true, ..args }).argv();
    assert_eq!(argv, ["run", "s.toml", "--out", "r.json", "--gpus", "2", "--resume"]);
}

#[test]
fn an_allreduce_ranks_command_line_parses_back_to_its_options() {
    let plain = parse_allreduce(&["bench", "allreduce", "--bytes-from", "r.json"]);
    let full = AllreduceArgs { bytes_from: "a b/r.json".into(), world: 8, iters: 3, side_stream: true, untimed: true };
    assert_eq!(
        Child::BenchAllreduce(plain.clone()).argv(),
        ["bench", "allreduce", "--bytes-from", "r.json", "--world", "2", "--iters", "20"]
    );
    for args in [plain, full] {
        match parse(Child::BenchAllreduce(args.clone()).argv()) {
            Command::Bench(BenchCommand::Allreduce(back)) => assert_eq!(back, args),
            c => panic!("{c:?}"),
        }
    }
}

#[test]
fn harness_env_shows_the_hosts_strings_escaped() {
    let f = device::Fingerprint {
        hostname: "node\u{1b}]0;owned\u{7}".into(),
        os: "linux".into(),
        cpu: "cpu \u{202e}x".into(),
        cpu_cores: 2,
        memory_bytes: 1 << 30,
        gpus: vec![device::GpuInfo { index: 0, name: "H100\u{1b}[2J".into(), memory_bytes: 1 << 30, compute_capability: "9.0".into() }],
        driver: Some("580".into()),
        cuda: None,
        cuda_driver_api: None,
        libtorch: None,
        nccl: Some("2.28\u{9b}".into()),
        harness_version: "0".into(),
        git_revision: "r".into(),
        cpu_kernels: None,
        environment: [("OMP_NUM_THREADS".to_owned(), "4\u{1b}[2J".to_owned())].into(),
    };
    let shown = printable(&env_text(&f)).into_owned();
    assert!(!shown.chars().any(harness_format::fmt::withheld), "{shown:?}");
    for part in [
        r"node\u{1b}]0;owned\u{7}",
        r"cpu \u{202e}x",
        r"H100\u{1b}[2J",
        r"2.28\u{9b}",
        "cuda      not found",
        r"env       OMP_NUM_THREADS=4\u{1b}[2J",
    ] {
        assert!(shown.contains(part), "{part} in {shown}");
    }
    assert_eq!(shown.lines().count(), 9, "{shown}");
}
