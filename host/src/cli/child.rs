//! [`Child`]: the command lines of the `harness` processes that harness
//! starts itself.

use std::ffi::OsString;

use super::args::{AllreduceArgs, RunArgs, DEFAULT_RESULTS_DIR};

/// A `harness` process that harness starts itself, as the options it is
/// started with: a rank of a multi-GPU `harness run`, or of `harness bench
/// allreduce`. [`Child::argv`] is the one place their command lines are
/// written; [`Cli`](super::Cli) parses them back to the same options.
#[derive(Debug, Clone, PartialEq)]
pub enum Child {
    /// A rank of `harness run` (started by [`crate::launch::launch_local_ranks`]).
    Run(RunArgs),
    /// A rank of `harness bench allreduce`.
    BenchAllreduce(AllreduceArgs),
}

impl Child {
    /// The arguments to start `harness` with (the program name not included).
    /// Options at their defaults are left out.
    pub fn argv(&self) -> Vec<OsString> {
        match self {
            Child::Run(a) => Argv::default()
                .arg("run")
                .arg(&a.suite)
                .opt("--out", &a.out)
                .flag("--quiet", a.quiet)
                .flag("--trace", a.trace)
                .opt("--plugin", &a.plugin)
                .opt("--track", &a.track)
                .opt("--plugin-config", &a.plugin_config)
                .opt("--gpus", a.gpus.map(|n| n.to_string()))
                .opt("--results-dir", Some(&a.results_dir).filter(|d| d.as_os_str() != DEFAULT_RESULTS_DIR))
                .flag("--resume", a.resume),
            Child::BenchAllreduce(a) => Argv::default()
                .arg("bench")
                .arg("allreduce")
                .opt("--bytes-from", [&a.bytes_from])
                .opt("--world", [a.world.to_string()])
                .opt("--iters", [a.iters.to_string()])
                .flag("--side-stream", a.side_stream)
                .flag("--untimed", a.untimed),
        }
        .0
    }
}

/// A command line being written ([`Child::argv`]).
#[derive(Default)]
struct Argv(Vec<OsString>);

impl Argv {
    /// A word of its own: a subcommand, a positional argument.
    fn arg(mut self, a: impl Into<OsString>) -> Argv {
        self.0.push(a.into());
        self
    }

    /// `name` if `on`.
    fn flag(self, name: &str, on: bool) -> Argv {
        if on {
            self.arg(name)
        } else {
            self
        }
    }

    /// `name VALUE` for each of `values` (none, one, or a repeated option's).
    fn opt<V: Into<OsString>>(self, name: &str, values: impl IntoIterator<Item = V>) -> Argv {
        values.into_iter().fold(self, |argv, v| argv.arg(name).arg(v))
    }
}
