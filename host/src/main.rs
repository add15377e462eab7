//! The `harness` binary: parses arguments, runs, maps errors to exit codes.
use clap::Parser;

fn main() {
    let cli = harness::cli::Cli::parse();
    let code = match harness::cli::main(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            harness::cli::exit::ERROR
        }
    };
    std::process::exit(code);
}
