//! What layer streaming through the store costs on a model that fits in memory: time per
//! step of the streamed trainer over tidestore's store, against candle's in-memory
//! training with the same recompute (the same blocks, candle's AdamW, no store), and
//! against in-memory training as one graph without recompute — alternated in one run,
//! medians printed with the ratios.
//!
//! ```text
//! cargo run --release -p tidestore-candle --example streamed_overhead -- \
//!     --layers 6 --hidden 512 --steps 8 --rounds 3 --swap-dir /tmp/swap
//! ```

mod common;

use std::path::PathBuf;
use std::time::Instant;

use candle_core::Device;
use candle_nn::{Optimizer, ParamsAdamW};
use clap::Parser;
use tidestore_candle::streamed::InMemoryTraining;
use tidestore_candle::{train_step, InMemory, Llama, TideParams};
use tidestore_train::MicroBatchOrder;

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, default_value_t = 6)]
    layers: usize,
    #[arg(long, default_value_t = 512)]
    hidden: usize,
    #[arg(long, default_value_t = 1408)]
    intermediate: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 4)]
    kv_heads: usize,
    #[arg(long, default_value_t = 8192)]
    vocab: usize,
    #[arg(long, default_value_t = 128)]
    sequence: usize,
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Steps per variant per round (the first of each is not timed).
    #[arg(long, default_value_t = 6)]
    steps: usize,
    /// Rounds, each running every variant in turn.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long)]
    swap_dir: PathBuf,
}

const LR: f64 = 1e-4;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let model = common::llama(
        a.vocab,
        a.hidden,
        a.intermediate,
        a.layers,
        a.heads,
        a.kv_heads,
    )?;
    let init = model.init(1);
    let params: usize = init.iter().map(|(s, _)| s.elements()).sum();
    println!(
        "model: {} layers, hidden {}, {} params; batch {} x {} tokens",
        a.layers, a.hidden, params, a.batch, a.sequence
    );
    let adam = ParamsAdamW {
        lr: LR,
        ..ParamsAdamW::default()
    };
    // Every chunk fits the host pool: the store's own overhead, no NVMe.
    let cfg = common::store_config(LR as f32, &a.swap_dir, 4 << 30, 4 << 30);
    let mut store = TideParams::open(&init, &cfg, &Device::Cpu)?;
    let mut recompute = InMemoryTraining::new(InMemory::new(&init, &Device::Cpu)?, adam.clone())?;
    let mut graph = InMemory::new(&init, &Device::Cpu)?;
    let mut graph_opt = candle_nn::AdamW::new(graph.vars(), adam)?;
    let mut times: [Vec<f64>; 3] = [vec![], vec![], vec![]];
    let mut step = 0u64;
    for _ in 0..a.rounds {
        for (v, t) in times.iter_mut().enumerate() {
            for k in 0..a.steps {
                let (x, y) = common::token_batch(a.batch, a.sequence, a.vocab, step)?;
                step += 1;
                let started = Instant::now();
                match v {
                    0 => {
                        train_step(&mut store, &model, &[(x, y)], MicroBatchOrder::Vertical)?;
                    }
                    1 => {
                        train_step(&mut recompute, &model, &[(x, y)], MicroBatchOrder::Vertical)?;
                    }
                    _ => {
                        let logits = model.forward(&mut graph, &x)?;
                        let loss = Llama::loss(&logits, &y)?;
                        graph_opt.backward_step(&loss)?;
                    }
                }
                if k > 0 {
                    t.push(started.elapsed().as_secs_f64());
                }
            }
        }
    }
    let [s, r, g] = times.map(median);
    println!("median s/step: streamed through the store {s:.3}, in memory with the same recompute {r:.3}, in memory as one graph {g:.3}");
    println!(
        "streamed / in-memory with recompute = {:.3}x; streamed / one graph = {:.3}x",
        s / r,
        s / g
    );
    Ok(())
}
