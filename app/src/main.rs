//! The `tidestore` binary: commands over one `tidestore.toml`.
//!
//! Results go to stdout, progress bars and logs (`RUST_LOG`, default `info`) to stderr.
//! Exit codes: 0 success, 1 a run that failed (I/O error, missing tool), 2 a bad
//! configuration or command line, reported on one line that names the key or flag.
//! Nothing here panics on bad input: every error travels up to [`main`] as a value.

// `unsafe` only in `cli::finetune::cap_heap_growth` (one glibc tunable) and
// `cli::signals` (a signal handler writing into a pipe).
#![deny(unsafe_code)]

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::Parser;
use tidestore_app::cli;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    // clap prints usage errors itself and exits with 2.
    let args = cli::Cli::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    cli::signals::install();
    match args.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Not `eprintln!`: a closed stderr must not turn an error into a panic.
            let _ = writeln!(std::io::stderr(), "error: {}", e.one_line());
            ExitCode::from(e.exit_code())
        }
    }
}
