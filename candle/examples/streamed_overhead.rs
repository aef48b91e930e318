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

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{Device, Tensor};
use candle_nn::{Optimizer, ParamsAdamW};
use clap::Parser;
use tidestore_candle::streamed::InMemoryTraining;
use tidestore_candle::{
    train_step, Budget, InMemory, Llama, LlamaConfig, Precision, TideConfig, TideParams,
};
use tidestore_train::{HyperParams, Mode};
use tidestore_train::{IoConfig, MicroBatchOrder};

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
    let model = Llama::new(LlamaConfig {
        vocab: a.vocab,
        hidden: a.hidden,
        intermediate: a.intermediate,
        layers: a.layers,
        heads: a.heads,
        kv_heads: a.kv_heads,
        rms_eps: 1e-5,
        rope_theta: 10_000.0,
        tie_embeddings: false,
        lora: None,
    })?;
    let init = model.init(1);
    let params: usize = init.iter().map(|(s, _)| s.elements()).sum();
    println!(
        "model: {} layers, hidden {}, {} params; batch {} x {} tokens",
        a.layers, a.hidden, params, a.batch, a.sequence
    );
    let batch = |step: usize| -> Result<(Tensor, Tensor), candle_core::Error> {
        let ids: Vec<u32> = (0..a.batch * (a.sequence + 1))
            .map(|i| ((i * 2_654_435_761 + step * 97) % a.vocab) as u32)
            .collect();
        let all = Tensor::from_vec(ids, (a.batch, a.sequence + 1), &Device::Cpu)?;
        Ok((all.narrow(1, 0, a.sequence)?, all.narrow(1, 1, a.sequence)?))
    };
    let adam = ParamsAdamW {
        lr: LR,
        ..ParamsAdamW::default()
    };
    // Every chunk fits the host pool: the store's own overhead, no NVMe.
    let hp = HyperParams {
        lr: LR as f32,
        mode: Mode::AdamW,
        ..HyperParams::default()
    };
    let mut cfg = TideConfig::new(hp, &a.swap_dir);
    cfg.precision = Precision::Bf16;
    cfg.device_budget = Budget::Bytes(4 << 30);
    cfg.host_budget = Budget::Bytes(4 << 30);
    cfg.io = IoConfig::default();
    let mut store = TideParams::open(&init, &cfg, &Device::Cpu)?;
    let mut recompute = InMemoryTraining::new(InMemory::new(&init, &Device::Cpu)?, adam.clone())?;
    let mut graph = InMemory::new(&init, &Device::Cpu)?;
    let mut graph_opt = candle_nn::AdamW::new(graph.vars(), adam)?;
    let mut times: [Vec<f64>; 3] = [vec![], vec![], vec![]];
    let mut step = 0;
    for _ in 0..a.rounds {
        for (v, t) in times.iter_mut().enumerate() {
            for k in 0..a.steps {
                let (x, y) = batch(step)?;
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
