//! The `harness` binary: parses arguments, runs, maps errors to exit codes.
use clap::Parser;

fn main() {
    // Die quietly on a closed pipe (`harness env | head`), as Unix tools do,
    // instead of panicking on the failed print.
    // SAFETY: restoring the default disposition of one signal before any
    // thread starts; no handler code is involved.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = harness::cli::Cli::parse();
    // The HARNESS_* switches, parsed once before any work: a malformed one
    // is refused, not ignored.
    match harness::switches::init() {
        Ok(s) => {
            let _ = harness_kernels::configure(harness::kernel_options(s));
        }
        Err(e) => {
            eprintln!("error: {}", harness::fmt::printable(&e.to_string()));
            std::process::exit(harness::exit::INVALID_SWITCH);
        }
    }
    let code = match harness::cli::main(cli) {
        Ok(code) => code,
        Err(e) => {
            // Errors quote what files and peers chose (a result file's
            // values, a plugin's names): escaped for the terminal.
            eprintln!("error: {}", harness::fmt::printable(&format!("{e:#}")));
            harness::exit::ERROR
        }
    };
    // A supervising parent (`harness run` of a suite with a native plugin)
    // learns that the process ended here, not in a plugin.
    harness::plugin::exit_guard::finished(code);
    std::process::exit(code);
}
