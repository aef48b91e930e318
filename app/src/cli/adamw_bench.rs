//! `tidestore adamw-bench`: the CPU AdamW kernel's parameters/s against an in-place
//! read-modify-write memory probe over arrays of the same sizes, measured in the same
//! run (alternating step and probe), as a table of medians.

use clap::Args;

use tidestore_optimizer::bench::{self, BenchConfig, BenchPath};
use tidestore_optimizer::SimdLevel;

use super::Error;

#[derive(Debug, Args)]
pub struct AdamwBenchArgs {
    /// Parameter counts to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [10_000_000usize, 100_000_000])]
    params: Vec<usize>,
    /// Thread counts to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2])]
    threads: Vec<usize>,
    /// Measured repeats of each (step, probe) pair; medians are reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Only one path: fp32 (fp32 grads, no 16-bit output), bf16 (bf16 grads in, bf16
    /// params out, fp32 moments), m-bf16 / m-int8 (as bf16, with bf16 or block-wise
    /// int8 moments: `optimizer.states`); all by default.
    #[arg(long, value_parser = ["fp32", "bf16", "m-bf16", "m-int8"])]
    path: Option<String>,
    /// Force the SIMD level of the kernels: scalar, avx2, avx512, avx512bf16 (it must be
    /// one this CPU supports). Without it, the level the TIDESTORE_SIMD environment
    /// variable names, else the best this CPU supports. The table's first line says which
    /// level ran and why.
    #[arg(long, value_parser = ["scalar", "avx2", "avx512", "avx512bf16"])]
    simd: Option<String>,
}

pub fn run(args: &AdamwBenchArgs) -> Result<(), Error> {
    if args.params.contains(&0) {
        return Err(Error::Usage {
            flag: "--params",
            reason: "parameter counts must be positive".into(),
        });
    }
    if args.threads.contains(&0) {
        return Err(Error::Usage {
            flag: "--threads",
            reason: "thread counts must be positive".into(),
        });
    }
    if args.repeats == 0 {
        return Err(Error::Usage {
            flag: "--repeats",
            reason: "at least one repeat is needed for a median".into(),
        });
    }
    let mut cfg = BenchConfig {
        sizes: args.params.clone(),
        threads: args.threads.clone(),
        repeats: args.repeats,
        ..BenchConfig::default()
    };
    match args.path.as_deref() {
        Some("fp32") => cfg.paths = vec![BenchPath::Fp32],
        Some("bf16") => cfg.paths = vec![BenchPath::Bf16],
        Some("m-bf16") => cfg.paths = vec![BenchPath::StatesBf16],
        Some("m-int8") => cfg.paths = vec![BenchPath::StatesInt8],
        _ => {}
    }
    cfg.simd = args.simd.as_deref().and_then(SimdLevel::parse);
    let level = bench::level_line(&cfg, "--simd").map_err(crate::Error::from)?;
    out!("{level}");
    out!("{}", bench::table_header());
    bench::run_with(&cfg, |r| out!("{}", r.table_line())).map_err(crate::Error::from)?;
    Ok(())
}
