//! Command-line surface of the `tidestore` binary: the argument types (clap derive), the
//! binary's error type and its exit codes, and one module per command.
//!
//! Invariant: every failure is a [`CliError`]; [`CliError::exit_code`] is 2 exactly when
//! the user's configuration or flags are at fault (the message then names the key or
//! flag), 1 otherwise.

/// `println!` that does not panic when stdout is closed (`tidestore io-bench | head`):
/// results that cannot be written are dropped, and the run goes on to clean up.
macro_rules! out {
    () => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout());
    }};
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

mod adamw_bench;
mod bench;
mod blockdev;
mod finetune;
mod fio;
mod init_model;
mod io_bench;
mod plan;
mod plot;
pub(crate) mod signals;
mod stats;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// tidestore: a three-tier (GPU / pinned host / NVMe) store for training state.
#[derive(Debug, Parser)]
#[command(name = "tidestore", version, about, long_about = None)]
pub struct Cli {
    /// Configuration file (TOML; every key is documented in the shipped tidestore.toml).
    #[arg(
        long,
        short,
        global = true,
        value_name = "FILE",
        default_value = "tidestore.toml"
    )]
    config: PathBuf,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run warm-up plus N iterations of the configured fine-tuning workload through the
    /// real chunk store and optimizer, and report time, bytes and bandwidth per phase.
    Bench(bench::BenchArgs),
    /// Show where a model's chunk lists go on a given GPU / RAM / NVMe, whether it fits,
    /// and the projected iteration time.
    Plan(plan::PlanArgs),
    /// Write then read a file in nvme.dir through the chunk I/O engine and report MB/s;
    /// optionally against fio (--compare-fio) or over a sweep of settings (--tune).
    IoBench(io_bench::IoBenchArgs),
    /// Measure the CPU AdamW kernel (parameters/s) against an in-place read-modify-write
    /// memory probe over arrays of the same sizes, in the same run.
    AdamwBench(adamw_bench::AdamwBenchArgs),
    /// Fine-tune the [train] section's Hugging Face LLaMA on its text, layer-streamed
    /// through the store: the model never has to fit in GPU or host memory.
    Finetune(finetune::FinetuneArgs),
    /// Write a random-weight LLaMA as a Hugging Face directory (config.json,
    /// safetensors, a byte-level tokenizer.json): a model to fine-tune without a download.
    InitModel(init_model::InitModelArgs),
}

impl Cli {
    /// Run the chosen command.
    pub fn run(self) -> Result<(), CliError> {
        match self.command {
            Command::IoBench(args) => io_bench::run(&self.config, &args),
            Command::Bench(args) => bench::run(&self.config, &args),
            Command::Plan(args) => plan::run(&self.config, &args),
            Command::AdamwBench(args) => adamw_bench::run(&args),
            Command::Finetune(args) => finetune::run(&self.config, &args),
            Command::InitModel(args) => init_model::run(&args),
        }
    }
}

/// Errors of the binary.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Configuration, library and I/O errors.
    #[error(transparent)]
    Tidestore(#[from] tidestore::Error),

    /// A command-line value that is well-formed but impossible.
    #[error("invalid value for {flag}: {reason}")]
    Usage { flag: &'static str, reason: String },

    /// fio is missing, failed, or printed something we cannot read.
    #[error("fio: {0}")]
    Fio(String),

    /// The benchmark itself went wrong (a request lost, a file that cannot be removed).
    #[error("io-bench: {0}")]
    Bench(String),

    /// An output file (the plot, the JSON) could not be written.
    #[error("{what} {}: {reason}", path.display())]
    Output {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
}

impl From<tidestore::io::IoError> for CliError {
    fn from(e: tidestore::io::IoError) -> Self {
        CliError::Tidestore(e.into())
    }
}

/// Proves an output file's folder writable before a run (a file made there and
/// removed), so that no run is lost to an output that cannot be written at its end.
pub(crate) fn check_output_writable(
    flag: &'static str,
    path: &std::path::Path,
) -> Result<(), CliError> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let probe = dir.join(format!(".tidestore-probe.{}", std::process::id()));
    std::fs::write(&probe, b"probe")
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|e| CliError::Usage {
            flag,
            reason: format!("{}: its folder is not writable: {e}", path.display()),
        })
}

impl CliError {
    /// 2 for the user's configuration or flags, 1 for everything else.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Tidestore(e) if e.is_config() => 2,
            CliError::Usage { .. } => 2,
            _ => 1,
        }
    }
}
