//! Trains a small byte-level GPT on a public-domain text (`examples/data/`) with candle,
//! its parameters, gradients, master weights, Adam M and V kept in tidestore: a host
//! pool of a few chunks, so M and V stream from an NVMe swap file every step.
//!
//! ```text
//! cargo run --release --example finetune -- --steps 200            # tidestore, M/V on NVMe
//! cargo run --release --example finetune -- --steps 200 --optimizer candle   # baseline
//! cargo run --release --example finetune -- --steps 300 --resume    # continue from the checkpoint
//! cargo run --release --example finetune -- --lora 8 --base target/finetune/ckpt.safetensors
//! cargo run --release --example finetune -- --steps 300 --states fp32,bf16,int8 --plot states.svg
//! cargo run --release --example finetune --features gpu -- ...   # GPU (README: "GPU build")
//! ```
//!
//! `--optimizer candle` trains the same model, same data and hyper-parameters with
//! `candle_nn::AdamW` entirely in memory (no checkpoint): the reference for the loss
//! curve and the wall time. Prints the loss with a progress bar, a loss curve at the end,
//! the wall time, and (tidestore) the bytes each tier moved. Several `--states` train the
//! same model on the same batches once per moment form, print each final loss against
//! the first form's, and with `--plot` draw the curves side by side.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::Device;
use candle_nn::{Optimizer, ParamsAdamW};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use tidestore_app::loss_plot::{draw_loss_curves, final_loss, LossCurve};
use tidestore_candle::{
    checkpoint, Batches, Budget, Gpt, GptConfig, InMemory, LoraConfig, ParamSource, Precision,
    TideConfig, TideParams,
};
use tidestore_train::{HyperParams, Mode};
use tidestore_train::{ListKind, MomentForm};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Opt {
    /// tidestore's AdamW; everything in the chunk store.
    Tidestore,
    /// candle_nn::AdamW, everything in candle memory.
    Candle,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Prec {
    F32,
    Bf16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum States {
    Fp32,
    Bf16,
    Int8,
}

impl States {
    fn name(self) -> &'static str {
        match self {
            States::Fp32 => "fp32",
            States::Bf16 => "bf16",
            States::Int8 => "int8",
        }
    }
}

#[derive(Debug, Parser)]
#[command(about = "Fine-tune a small GPT with candle, training state in tidestore")]
struct Args {
    /// The training text (bytes are the tokens).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/data/genesis-kjv.txt"))]
    text: PathBuf,
    /// Optimizer steps to reach (a resumed run continues up to this step).
    #[arg(long, default_value_t = 200)]
    steps: u64,
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 64)]
    ctx: usize,
    #[arg(long, default_value_t = 256)]
    d_model: usize,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Seed of the initial weights and of the batches.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, value_enum, default_value_t = Opt::Tidestore)]
    optimizer: Opt,
    /// Forward weights and gradients: fp32 master, or the bf16 compute copy.
    #[arg(long, value_enum, default_value_t = Prec::F32)]
    precision: Prec,
    /// Pinned host pool in chunks (>= 5); below the model's chunk count M and V go to NVMe.
    #[arg(long, default_value_t = 8)]
    host_chunks: u32,
    /// Device budget in chunks (>= 4).
    #[arg(long, default_value_t = 4)]
    device_chunks: u32,
    /// Chunk size in element slots (default: the chunk-size search).
    #[arg(long)]
    chunk_elements: Option<u64>,
    /// Directory of the NVMe swap file (default: a temporary directory).
    #[arg(long)]
    swap_dir: Option<PathBuf>,
    /// Checkpoint file (default target/finetune/ckpt.safetensors, lora.safetensors with --lora).
    #[arg(long)]
    ckpt: Option<PathBuf>,
    /// Write the checkpoint every this many steps (and at the end).
    #[arg(long, default_value_t = 100)]
    save_every: u64,
    /// Continue from the checkpoint.
    #[arg(long)]
    resume: bool,
    /// LoRA: freeze the base and train rank-RANK adapters on the attention.
    #[arg(long, value_name = "RANK")]
    lora: Option<usize>,
    /// LoRA scale numerator (adapter output x alpha / rank); default 2 x rank.
    #[arg(long)]
    lora_alpha: Option<f32>,
    /// LoRA: base weights from this checkpoint (e.g. a full run's); default: random init.
    #[arg(long)]
    base: Option<PathBuf>,
    /// How M and V are stored (optimizer.states): fp32, bf16 or int8; several
    /// (comma-separated) train once per form, same model and batches, and compare.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "fp32")]
    states: Vec<States>,
    /// Draw the loss curve(s) into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Print the loss every this many steps.
    #[arg(long, default_value_t = 10)]
    log_every: u64,
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The message names the option or key (and its causes, which the
            // crates' errors print inline); not the Debug form.
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let device = Device::cuda_if_available(0)?;
    let text =
        std::fs::read(&args.text).map_err(|e| format!("--text {}: {e}", args.text.display()))?;
    let model = Gpt::new(GptConfig {
        vocab: 256,
        ctx: args.ctx,
        d_model: args.d_model,
        heads: args.heads,
        layers: args.layers,
        lora: args.lora.map(|rank| LoraConfig {
            rank,
            alpha: args.lora_alpha.unwrap_or(2.0 * rank as f32),
        }),
    });
    let data = Batches::new(text, args.batch, args.ctx, args.seed)?;
    let mut params = model.init(args.seed);
    if let Some(base) = &args.base {
        let values = checkpoint::read_params(base)?;
        let mut n = 0;
        for (spec, v) in params.iter_mut().filter(|(s, _)| !s.trainable) {
            if let Some(b) = values.get(&spec.name) {
                *v = b.clone();
                n += 1;
            }
        }
        println!("base: {n} frozen tensors from {}", base.display());
    }
    let trainable: usize = params
        .iter()
        .filter(|(s, _)| s.trainable)
        .map(|(s, _)| s.elements())
        .sum();
    let total: usize = params.iter().map(|(s, _)| s.elements()).sum();
    println!(
        "model: {} layers, d_model {}, ctx {}, {total} params ({trainable} trainable{}), device {:?}, text {} bytes",
        args.layers,
        args.d_model,
        args.ctx,
        if args.lora.is_some() { ", LoRA" } else { "" },
        device,
        args.text.metadata().map(|m| m.len()).unwrap_or(0)
    );

    if args.resume && args.states.len() > 1 {
        return Err("--resume continues one run: give one --states".into());
    }
    let mut curves: Vec<(String, Curve)> = Vec::new();
    let runs: Vec<Option<States>> = match args.optimizer {
        Opt::Candle => vec![None],
        Opt::Tidestore => args.states.iter().map(|&s| Some(s)).collect(),
    };
    for states in runs {
        let started = Instant::now();
        let (label, curve) = match states {
            None => (
                "candle AdamW".to_string(),
                run_candle(&args, &model, &data, &params, &device)?,
            ),
            Some(s) => (
                format!("tidestore, {} moments", s.name()),
                run_tidestore(&args, s, &model, &data, &params, &device)?,
            ),
        };
        let wall = started.elapsed().as_secs_f64();
        println!("loss curve, {label} (step: loss):");
        let stride = (curve.len() / 10).max(1);
        for (i, (step, loss)) in curve.iter().enumerate() {
            if i % stride == 0 || i + 1 == curve.len() {
                println!("  {step:>6}: {loss:.4}");
            }
        }
        if !curve.is_empty() {
            println!(
                "wall {wall:.1} s for {} steps ({:.3} s/step), {label}",
                curve.len(),
                wall / curve.len() as f64,
            );
        }
        curves.push((label, curve));
    }
    compare(&curves);
    if let Some(path) = &args.plot {
        draw(&curves, path).map_err(|e| format!("--plot {}: {e}", path.display()))?;
        println!("plot: {}", path.display());
    }
    Ok(())
}

/// Steps the final loss is averaged over (one batch per step: single steps are noisy).
const FINAL_STEPS: usize = 20;

fn points(c: &Curve) -> Vec<(u32, f32)> {
    c.iter().map(|&(s, l)| (s as u32, l)).collect()
}

/// Every run's final loss against the first run's.
fn compare(curves: &[(String, Curve)]) {
    let [(first_label, first), rest @ ..] = curves else {
        return;
    };
    if rest.is_empty() || first.is_empty() {
        return;
    }
    let base = final_loss(&points(first), FINAL_STEPS);
    println!("final loss (mean of the last {FINAL_STEPS} steps): {first_label} {base:.4}");
    for (label, c) in rest {
        let l = final_loss(&points(c), FINAL_STEPS);
        println!("  {label} {l:.4} ({:+.2} %)", (l / base - 1.0) * 100.0);
    }
}

/// The curves side by side, and each one's distance to the first.
fn draw(curves: &[(String, Curve)], path: &std::path::Path) -> Result<(), String> {
    let curves: Vec<LossCurve> = curves
        .iter()
        .map(|(label, c)| LossCurve {
            label: label.clone(),
            points: points(c),
        })
        .collect();
    draw_loss_curves("byte-level GPT (examples/finetune.rs)", &curves, path)
}

fn bar(from: u64, to: u64) -> ProgressBar {
    let pb = ProgressBar::new(to.saturating_sub(from));
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:40} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

fn report(pb: &ProgressBar, log_every: u64, step: u64, loss: f32) {
    pb.inc(1);
    pb.set_message(format!("loss {loss:.4}"));
    if step.is_multiple_of(log_every) {
        let line = format!("step {step:>6}  loss {loss:.4}");
        // A hidden bar (stdout not a terminal) prints nothing, not even its lines.
        if pb.is_hidden() {
            println!("{line}");
        } else {
            pb.println(line);
        }
    }
}

type Curve = Vec<(u64, f32)>;

fn run_candle(
    args: &Args,
    model: &Gpt,
    data: &Batches,
    params: &[(tidestore_candle::ParamSpec, Vec<f32>)],
    device: &Device,
) -> Result<Curve, Box<dyn std::error::Error>> {
    let mut mem = InMemory::new(params, device)?;
    let mut opt = candle_nn::AdamW::new(
        mem.vars(),
        ParamsAdamW {
            lr: args.lr,
            weight_decay: args.weight_decay,
            ..ParamsAdamW::default()
        },
    )?;
    let pb = bar(0, args.steps);
    let mut curve = Vec::new();
    for step in 0..args.steps {
        let (x, y) = data.get(step, device)?;
        let loss = model.loss(&mut mem as &mut dyn ParamSource, &x, &y)?;
        opt.backward_step(&loss)?;
        let l = loss.to_scalar::<f32>()?;
        curve.push((step + 1, l));
        report(&pb, args.log_every, step + 1, l);
    }
    pb.finish_and_clear();
    Ok(curve)
}

fn run_tidestore(
    args: &Args,
    states: States,
    model: &Gpt,
    data: &Batches,
    params: &[(tidestore_candle::ParamSpec, Vec<f32>)],
    device: &Device,
) -> Result<Curve, Box<dyn std::error::Error>> {
    let hp = HyperParams {
        lr: args.lr as f32,
        weight_decay: args.weight_decay as f32,
        mode: Mode::AdamW,
        ..HyperParams::default()
    };
    let tmp = tempfile::tempdir()?;
    let swap_dir = args
        .swap_dir
        .clone()
        .unwrap_or_else(|| tmp.path().to_path_buf());
    let mut cfg = TideConfig::new(hp, &swap_dir);
    cfg.precision = match args.precision {
        Prec::F32 => Precision::F32,
        Prec::Bf16 => Precision::Bf16,
    };
    cfg.host_budget = Budget::Chunks(args.host_chunks);
    cfg.device_budget = Budget::Chunks(args.device_chunks);
    cfg.chunk_elements = args.chunk_elements;
    cfg.moments = match states {
        States::Fp32 => MomentForm::F32,
        States::Bf16 => MomentForm::BF16,
        States::Int8 => MomentForm::Int8,
    };
    let ckpt = args.ckpt.clone().unwrap_or_else(|| {
        let name = if args.lora.is_some() { "lora" } else { "ckpt" };
        // One file per form when several are compared (a checkpoint holds its form).
        let form = if args.states.len() > 1 {
            format!("-{}", states.name())
        } else {
            String::new()
        };
        PathBuf::from(format!("target/finetune/{name}{form}.safetensors"))
    });
    // The checkpoint's directory (target/finetune on a fresh clone) may not exist yet.
    if let Some(dir) = ckpt.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("checkpoint directory {}: {e}", dir.display()))?;
    }

    let mut p = TideParams::open(params, &cfg, device)?;
    let layout = p.trainer().store().layout();
    println!(
        "tidestore: {} chunks of up to {} KiB; host pool {} chunks, device {} chunks; swap file in {}",
        layout.lists().iter().map(|&l| layout.list_chunk_count(l)).sum::<u64>(),
        layout.dense_chunk_bytes().into_iter().max().unwrap_or(0) / 1024,
        args.host_chunks,
        args.device_chunks,
        swap_dir.display()
    );
    if args.resume {
        checkpoint::load(&mut p, &ckpt)?;
        println!("resumed from {} at step {}", ckpt.display(), p.step_count());
    }
    let from = p.step_count();
    let pb = bar(from, args.steps);
    let mut curve = Vec::new();
    for step in from..args.steps {
        let (x, y) = data.get(step, device)?;
        let loss = model.loss(&mut p, &x, &y)?;
        p.backward(&loss)?;
        p.step()?;
        let l = loss.to_scalar::<f32>()?;
        curve.push((step + 1, l));
        report(&pb, args.log_every, step + 1, l);
        if (step + 1).is_multiple_of(args.save_every) && step + 1 < args.steps {
            checkpoint::save(&mut p, &ckpt)?;
        }
    }
    pb.finish_and_clear();
    let t = Instant::now();
    checkpoint::save(&mut p, &ckpt)?;
    println!(
        "checkpoint: {} at step {} ({:.2} s)",
        ckpt.display(),
        p.step_count(),
        t.elapsed().as_secs_f64()
    );
    if let Some(tr) = p.nvme_traffic() {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        println!(
            "NVMe traffic: M read {:.1} MiB / written {:.1} MiB, V read {:.1} / written {:.1}, master read {:.1} / written {:.1}, param16+grads read {:.1} / written {:.1}",
            mib(tr.read_bytes(ListKind::Momentum)),
            mib(tr.written_bytes(ListKind::Momentum)),
            mib(tr.read_bytes(ListKind::Variance)),
            mib(tr.written_bytes(ListKind::Variance)),
            mib(tr.read_bytes(ListKind::Master)),
            mib(tr.written_bytes(ListKind::Master)),
            mib(tr.read_bytes(ListKind::Params)),
            mib(tr.written_bytes(ListKind::Params)),
        );
    }
    print!("store: {}", p.stats());
    Ok(curve)
}
