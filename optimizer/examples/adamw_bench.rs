//! CPU AdamW throughput against the in-place memory roofline, as a table.
//!
//! `cargo run --release -p tidestore-optimizer --example adamw_bench -- [repeats] [sizes...]`
//! (defaults: 9 repeats; 10M and 100M parameters). Threads 1 and 2, fp32 and bf16 paths.
//! Each row: median step time over `repeats`, parameters/s, GB/s at the bytes counted per
//! parameter, the probe's GB/s over the same arrays in the same run, and the fraction.

use tidestore_optimizer::bench::{self, BenchConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut cfg = BenchConfig::default();
    if let Some(r) = args.next() {
        cfg.repeats = r.parse()?;
    }
    let sizes: Vec<usize> = args.map(|s| s.parse()).collect::<Result<_, _>>()?;
    if !sizes.is_empty() {
        cfg.sizes = sizes;
    }
    if let Ok(t) = std::env::var("ADAMW_BENCH_THREADS") {
        cfg.threads = t.split(',').map(str::parse).collect::<Result<_, _>>()?;
    }
    if let Ok(l) = std::env::var("ADAMW_BENCH_SIMD") {
        cfg.simd = tidestore_optimizer::SimdLevel::ALL
            .into_iter()
            .find(|x| format!("{x:?}").eq_ignore_ascii_case(&l));
    }
    if let Ok(b) = std::env::var("ADAMW_BENCH_BLOCK") {
        cfg.block_params = b.parse()?;
    }
    println!("{}", bench::table_header());
    bench::run_with(&cfg, |r| println!("{}", r.table_line()))?;
    Ok(())
}
