//! Command-line surface of the `tidestore` binary: the argument types (clap derive) and
//! one module per command. Every failure is a [`crate::Error`], whose exit code says
//! whether the user's configuration or flags are at fault.

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
pub mod signals;
mod stats;

use std::path::PathBuf;

use crate::error::Error;

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
    pub fn run(self) -> Result<(), Error> {
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

/// Prints `report` on stdout as pretty JSON; `what` names the failure to encode it
/// (`cannot encode the report as JSON for`), whose path is `stdout`.
pub(crate) fn print_json(report: &impl serde::Serialize, what: &'static str) -> Result<(), Error> {
    let text = serde_json::to_string_pretty(report).map_err(|e| Error::Output {
        what,
        path: PathBuf::from("stdout"),
        reason: e.to_string(),
    })?;
    out!("{text}");
    Ok(())
}

/// Proves an output file's folder writable before a run (a file made there and
/// removed), and the file itself not a directory, so that no run is lost to an output
/// that cannot be written at its end.
pub(crate) fn check_output_writable(
    flag: &'static str,
    path: &std::path::Path,
) -> Result<(), Error> {
    if path.is_dir() {
        return Err(Error::Usage {
            flag,
            reason: format!("{} is a directory; give a file's path", path.display()),
        });
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let probe = dir.join(format!(".tidestore-probe.{}", std::process::id()));
    std::fs::write(&probe, b"probe")
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|e| Error::Usage {
            flag,
            reason: format!("{}: its folder is not writable: {e}", path.display()),
        })
}
