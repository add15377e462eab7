//! The command line: [`Cli`] parses it, [`main`] hands each subcommand's
//! arguments to the function that runs it (`harness run`'s is `run`), and
//! [`Child`] writes the command lines of the `harness` processes that
//! harness starts itself.
//!
//! The clap types are in `args.rs`; the subcommands' bodies in `run.rs`,
//! `validate.rs`, `reporting.rs` (report, submit, verify, reproduce,
//! keygen, compare, project) and `tools.rs` (env, bench, plugin); [`Child`]
//! in `child.rs`.

mod args;
mod child;
mod reporting;
mod run;
mod tools;
mod validate;

pub use args::{
    AllreduceArgs, BenchCommand, CheckpointReadArgs, Cli, Command, CompareArgs, EnvArgs, KeygenArgs, PluginBenchArgs, PluginCommand,
    PluginInspectArgs, PluginNewArgs, PluginTestArgs, ProjectArgs, ReportArgs, ReproduceArgs, RunArgs, SubmitArgs, ValidateArgs,
    VerifyArgs,
};
pub use child::Child;

/// The exit codes, also under this path for the integration tests
/// (`harness::cli::exit`).
pub use harness_format::exit;

use reporting::{compare, keygen, project, report, reproduce, submit, verify};
use run::run;
use tools::{bench_allreduce, bench_checkpoint_read, env, plugin_bench, plugin_inspect, plugin_new, plugin_test};
use validate::validate;

/// Runs the parsed command; returns the process exit code.
pub fn main(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Run(args) => run(args),
        Command::Validate(args) => validate(args),
        Command::Report(args) => report(args),
        Command::Submit(args) => submit(args),
        Command::Verify(args) => verify(args),
        Command::Reproduce(args) => reproduce(args),
        Command::Keygen(args) => keygen(args),
        Command::Compare(args) => compare(args),
        Command::Project(args) => project(args),
        Command::Bench(BenchCommand::Allreduce(args)) => bench_allreduce(args),
        Command::Bench(BenchCommand::CheckpointRead(args)) => bench_checkpoint_read(args),
        Command::Plugin(PluginCommand::New(args)) => plugin_new(args),
        Command::Plugin(PluginCommand::Inspect(args)) => plugin_inspect(args),
        Command::Plugin(PluginCommand::Bench(args)) => plugin_bench(args),
        Command::Plugin(PluginCommand::Test(args)) => plugin_test(args),
        Command::Env(args) => env(args),
    }
}

#[cfg(test)]
mod tests;
