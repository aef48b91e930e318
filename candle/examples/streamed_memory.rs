//! Full fine-tuning of a random-weight LLaMA whose training state is larger than the
//! host budget, layer-streamed through tidestore, with the process's peak resident
//! memory printed beside the bound the design promises:
//!
//! ```text
//! bound = RSS before the store opens
//!       + the host pool + the simulated device's memory          (the store's budgets)
//!       + one block's working set (its parameters and their gradients as f32 candle
//!         tensors, and its graph's activations, the head's logits included)
//!       + the block inputs kept for recompute ((layers + 1) · batch · time · hidden · 4)
//! ```
//!
//! ```text
//! cargo run --release -p tidestore-candle --example streamed_memory -- \
//!     --layers 8 --hidden 1024 --intermediate 2816 --heads 16 --kv-heads 4 \
//!     --vocab 32000 --host-mib 512 --device-mib 256 --steps 3 --swap-dir /path/on/nvme
//! ```
//! Parameters are written into the store one tensor at a time: the model is never whole
//! in RAM. Time per step is split into candle's compute, waiting on the store, and the
//! optimizer.

mod common;

use std::path::PathBuf;
use std::time::Instant;

use candle_core::Device;
use clap::Parser;
use tidestore_candle::{train_step, TideParams};
use tidestore_train::MicroBatchOrder;

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, default_value_t = 8)]
    layers: usize,
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    #[arg(long, default_value_t = 2816)]
    intermediate: usize,
    #[arg(long, default_value_t = 16)]
    heads: usize,
    #[arg(long, default_value_t = 4)]
    kv_heads: usize,
    #[arg(long, default_value_t = 32000)]
    vocab: usize,
    #[arg(long, default_value_t = 64)]
    sequence: usize,
    #[arg(long, default_value_t = 2)]
    batch: usize,
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Pinned host pool, MiB.
    #[arg(long, default_value_t = 512)]
    host_mib: u64,
    /// Device budget (simulated), MiB.
    #[arg(long, default_value_t = 256)]
    device_mib: u64,
    /// Directory of the swap file (on the disk to use).
    #[arg(long)]
    swap_dir: PathBuf,
    /// CPU AdamW threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Chunk size in fp32 elements (default: the chunk-size search).
    #[arg(long)]
    chunk_elements: Option<u64>,
}

fn rss(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Large allocations straight from `mmap` (returned to the OS when freed), as
/// `tidestore finetune` sets them: glibc's default threshold rises to 32 MiB after the
/// first frees, and the block-sized tensors the trainer frees then fragment its heap.
#[allow(unsafe_code)]
fn cap_heap_growth() {
    // SAFETY: `mallopt` only sets one of glibc malloc's tunables (under its own lock); it
    // has no pointer arguments and runs before anything else allocates much.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("TIDESTORE_DEFAULT_MALLOC").is_none() {
        cap_heap_growth();
    }
    let a = Args::parse();
    let model = common::llama(
        a.vocab,
        a.hidden,
        a.intermediate,
        a.layers,
        a.heads,
        a.kv_heads,
    )?;
    let specs = model.specs();
    let params: u64 = specs.iter().map(|s| s.elements() as u64).sum();
    let state = 16 * params;
    let host = a.host_mib << 20;
    let device = a.device_mib << 20;
    println!(
        "model: {} layers, hidden {}, {} params; training state {} (16 B/param) = {:.1}x the host budget of {}",
        a.layers,
        a.hidden,
        params,
        gib(state),
        state as f64 / host as f64,
        gib(host)
    );
    let baseline = rss("VmRSS:");
    let mut cfg = common::store_config(1e-4, &a.swap_dir, device, host);
    cfg.optimizer_threads = a.threads;
    cfg.chunk_elements = a.chunk_elements;
    let started = Instant::now();
    let mut p = TideParams::open_specs(&specs, &cfg, &Device::Cpu)?;
    // One tensor at a time, from a per-tensor seed.
    for (k, s) in specs.iter().enumerate() {
        let mut x = (k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let values: Vec<f32> = (0..s.elements())
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if s.name.ends_with("norm.weight") {
                    1.0
                } else {
                    ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04
                }
            })
            .collect();
        p.set_param(&s.name, &values)?;
    }
    println!("initialised in {:.1} s", started.elapsed().as_secs_f64());
    let (b, t) = (a.batch, a.sequence);
    let mut totals = (0.0, 0.0, 0.0, 0.0);
    for step in 0..a.steps {
        let (x, y) = common::token_batch(b, t, a.vocab, step)?;
        let started = Instant::now();
        let s = train_step(&mut p, &model, &[(x, y)], MicroBatchOrder::Vertical)?;
        let secs = started.elapsed().as_secs_f64();
        println!(
            "step {}: loss {:.4}, {:.2} s = compute {:.2} s + store {:.2} s + optimizer {:.2} s",
            step + 1,
            s.loss,
            secs,
            s.times.compute.as_secs_f64(),
            s.times.store.as_secs_f64(),
            s.times.optimizer.as_secs_f64()
        );
        if step > 0 {
            totals.0 += secs;
            totals.1 += s.times.compute.as_secs_f64();
            totals.2 += s.times.store.as_secs_f64();
            totals.3 += s.times.optimizer.as_secs_f64();
        }
    }
    let c = model.config();
    let hd = c.hidden / c.heads;
    let largest_block = (0..model.blocks())
        .map(|k| {
            model
                .block_params(k)
                .iter()
                .map(|s| s.elements() as u64)
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    let tokens = (b * t) as u64;
    // The graph of a layer: q, k, v (repeated), rope temporaries, attention scores and
    // probabilities, the MLP's gate/up/act — a generous 24 hidden-sized and 6
    // intermediate-sized tensors plus 4 score matrices; the head: logits, their softmax
    // and gradient.
    let layer_graph = 4
        * (tokens * (24 * c.hidden as u64 + 6 * c.intermediate as u64)
            + 4 * (b * c.heads * t * t) as u64
            + tokens * (c.heads * hd) as u64);
    let head_graph = 4 * 3 * tokens * c.vocab as u64;
    let block_ws = 2 * 4 * largest_block + layer_graph.max(head_graph);
    let inputs = (c.layers as u64 + 1) * tokens * c.hidden as u64 * 4;
    let st = p.stats();
    let sim_memory = st.device.capacity_bytes.max(device);
    let bound = baseline + host + sim_memory + block_ws + inputs;
    let peak = rss("VmHWM:");
    let n = (a.steps - 1).max(1) as f64;
    println!(
        "per step (steps 2..): {:.2} s = compute {:.2} s + waiting on the store {:.2} s + optimizer {:.2} s",
        totals.0 / n,
        totals.1 / n,
        totals.2 / n,
        totals.3 / n
    );
    println!(
        "NVMe: read {}, written {}; peak host pool {}, peak device {}",
        gib(st.nvme_to_host_bytes),
        gib(st.host_to_nvme_bytes),
        gib(st.host.peak_bytes),
        gib(st.device.peak_bytes)
    );
    println!(
        "peak RSS {} vs bound {} = baseline {} + host pool {} + device {} + largest block's working set {} + block inputs {} ({:.1}% of the bound)",
        gib(peak),
        gib(bound),
        gib(baseline),
        gib(host),
        gib(sim_memory),
        gib(block_ws),
        gib(inputs),
        100.0 * peak as f64 / bound as f64
    );
    Ok(())
}
