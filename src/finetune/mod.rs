//! `tidestore finetune` as a library: a Hugging Face LLaMA directory fine-tuned on a text
//! file, layer-streamed through the chunk store ([`tidestore_candle::train_step`]), so
//! that neither the GPU nor the host has to hold the model: the store's budgets
//! (`[device]`, `[host]`, `[nvme]`) bound the parameters and optimizer state, and
//! candle holds one block's parameters and graph at a time plus the block inputs.
//!
//! A run: the model's `config.json` read and its weights imported into the store one
//! tensor at a time ([`model`]); the text tokenized with the directory's
//! `tokenizer.json` (byte-level when there is none); then `train.steps` steps of
//! `train.accumulation` micro-batches each, the learning rate from `train.schedule`;
//! checkpoints every `train.checkpoint_every` steps (and at the end) in the train
//! crate's format; `--resume` continues from the newest one, bit-identical to a run
//! never interrupted (the batches are a function of the step); at the end, the export.

mod data;
pub mod model;
mod section;

use std::path::PathBuf;
use std::time::Instant;

use candle_core::Device;
use serde::Serialize;
use tidestore_candle::{checkpoint, train_step, Budget, Precision, TideConfig, TideParams};
use tidestore_chunk::{ChunkError, StoreStats};
use tidestore_optimizer::StepDecision;
use tidestore_train::{CheckpointDir, TrainError};

use crate::bench::hyper_params;
use crate::config::{AutoSize, Config};
use crate::error::{Error, Result};

pub use data::Samples;
pub use section::{ExportDtype, MicroBatchOrderName, PrecisionName, Schedule, TrainSection};

/// The JSON schema name of [`FinetuneReport`].
pub const SCHEMA: &str = "tidestore.finetune.v1";

/// One step, as run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StepRecord {
    /// 1-based.
    pub step: u32,
    /// Mean cross-entropy of the step's micro-batches before it.
    pub loss: f32,
    /// Learning rate of the step.
    pub lr: f64,
    /// Tokens trained on.
    pub tokens: u64,
    /// Wall time.
    pub seconds: f64,
    /// Of which candle's forward, recompute and backward.
    pub compute_seconds: f64,
    /// Of which getting parameters from and gradients into the store.
    pub store_seconds: f64,
    /// Of which the optimizer step.
    pub optimizer_seconds: f64,
    /// Global gradient norm (0 for a skipped step).
    pub grad_norm: f64,
}

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct FinetuneReport {
    /// [`SCHEMA`].
    pub schema: String,
    /// The model in one line.
    pub model: String,
    /// How Adam's moments were stored (`optimizer.states`: fp32, bf16 or int8).
    pub states: String,
    /// Parameters.
    pub params: u64,
    /// Trained parameters.
    pub params_trainable: u64,
    /// Tokens in the text.
    pub text_tokens: u64,
    /// The step a resumed run continued from (`None`: from the start).
    pub resumed_from: Option<u64>,
    /// Every step run.
    pub steps: Vec<StepRecord>,
    /// Checkpoints written.
    pub checkpoints: Vec<PathBuf>,
    /// Where the model was exported.
    pub export: Option<PathBuf>,
    /// The store's counters over the run.
    #[serde(skip)]
    pub store: StoreStats,
    /// Bytes moved NVMe -> host and host -> NVMe over the run.
    pub nvme_bytes: (u64, u64),
    /// Most bytes in use per tier over the run: device, host, NVMe.
    pub peak_tier_bytes: (u64, u64, u64),
    /// Peak resident memory of the process (`VmHWM`), where the OS reports it.
    pub peak_rss_bytes: Option<u64>,
}

/// Progress of a run, for a progress bar.
pub trait FinetuneProgress {
    /// Steps `first..=last` are about to run.
    fn begin(&mut self, first: u32, last: u32);
    /// A step finished.
    fn step(&mut self, record: &StepRecord);
    /// The run ended.
    fn end(&mut self);
}

/// No progress reporting.
#[derive(Debug, Default)]
pub struct NoProgress;

impl FinetuneProgress for NoProgress {
    fn begin(&mut self, _: u32, _: u32) {}
    fn step(&mut self, _: &StepRecord) {}
    fn end(&mut self) {}
}

/// The store's settings from the config.
fn tide_config(cfg: &Config) -> Result<TideConfig> {
    let t = &cfg.train;
    let mut tc = TideConfig::new(hyper_params(cfg), cfg.nvme_dir()?);
    tc.precision = match t.precision {
        PrecisionName::Bf16 => Precision::Bf16,
        PrecisionName::F32 => Precision::F32,
    };
    tc.max_grad_norm =
        (cfg.optimizer.max_grad_norm > 0.0).then_some(cfg.optimizer.max_grad_norm as f32);
    tc.chunk_elements = match cfg.chunk.size {
        AutoSize::Auto => None,
        AutoSize::Fixed(s) => Some(s.bytes() / 4),
    };
    tc.device_budget = Budget::Bytes(cfg.device.budget.bytes());
    tc.host_budget = Budget::Bytes(cfg.host.budget.bytes());
    tc.moments = cfg.optimizer.states.moments();
    tc.io = cfg.io_config()?;
    tc.optimizer_threads = cfg.optimizer.threads as usize;
    Ok(tc)
}

/// Peak resident memory of this process, from `/proc/self/status`.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Runs the fine-tuning the configuration describes (see the module doc); `resume`
/// continues from the newest checkpoint in `train.checkpoint_dir`.
pub fn run(
    cfg: &Config,
    resume: bool,
    progress: &mut dyn FinetuneProgress,
) -> Result<FinetuneReport> {
    let t = &cfg.train;
    let loaded = model::open(t)?;
    let samples = model::samples(t, &loaded)?;
    let mut params =
        match TideParams::open_specs(&loaded.model.specs(), &tide_config(cfg)?, &Device::Cpu) {
            Ok(p) => p,
            Err(tidestore_candle::Error::Train(TrainError::Store(
                e @ ChunkError::BudgetTooSmall { .. },
            ))) => return Err(crate::session::budget_error(e, cfg)),
            Err(e) => return Err(e.into()),
        };
    model::import(t, &loaded, &mut params)?;
    let ckpt_dir = t
        .checkpoint_dir
        .as_ref()
        .map(|d| CheckpointDir::open(d.clone(), 2))
        .transpose()?;
    let resumed_from = match (&ckpt_dir, resume) {
        (Some(dir), true) => match dir.latest()? {
            Some((step, path)) => {
                checkpoint::load(&mut params, &path)?;
                Some(step)
            }
            None => None,
        },
        (None, true) => {
            return Err(Error::config(
                "train.checkpoint_dir",
                "missing: --resume continues from the newest checkpoint there",
            ))
        }
        _ => None,
    };
    let first = resumed_from.map_or(1, |s| s as u32 + 1);
    let mut report = FinetuneReport {
        schema: SCHEMA.into(),
        model: loaded.describe(),
        states: cfg.optimizer.states.moments().to_string(),
        params: loaded.params(),
        params_trainable: loaded.params_trainable(),
        text_tokens: samples.len() as u64,
        resumed_from,
        steps: Vec::new(),
        checkpoints: Vec::new(),
        export: None,
        store: StoreStats::default(),
        nvme_bytes: (0, 0),
        peak_tier_bytes: (0, 0, 0),
        peak_rss_bytes: None,
    };
    progress.begin(first, t.steps);
    for step in first..=t.steps {
        let record = one_step(cfg, &loaded, &samples, &mut params, step)?;
        progress.step(&record);
        report.steps.push(record);
        let due = t.checkpoint_every > 0 && (step % t.checkpoint_every == 0 || step == t.steps);
        if let (Some(dir), true) = (&ckpt_dir, due) {
            let path = dir.path(u64::from(step));
            checkpoint::save(&mut params, &path)?;
            dir.prune()?;
            report.checkpoints.push(path);
        }
    }
    progress.end();
    if let Some(dir) = &t.export_dir {
        model::export(t, &loaded, &mut params, dir)?;
        report.export = Some(dir.clone());
    }
    let st = params.stats();
    report.nvme_bytes = (st.nvme_to_host_bytes, st.host_to_nvme_bytes);
    report.peak_tier_bytes = (st.device.peak_bytes, st.host.peak_bytes, st.nvme.peak_bytes);
    report.store = st;
    report.peak_rss_bytes = peak_rss_bytes();
    Ok(report)
}

/// Step `step`: its micro-batches through the streamed trainer, at its learning rate.
fn one_step(
    cfg: &Config,
    loaded: &model::Loaded,
    samples: &Samples,
    params: &mut TideParams,
    step: u32,
) -> Result<StepRecord> {
    let t = &cfg.train;
    let started = Instant::now();
    let lr = t.lr_at(step, cfg.optimizer.lr);
    params.set_lr(lr as f32)?;
    let batches = (0..u64::from(t.accumulation))
        .map(|k| samples.batch(u64::from(step), k, &Device::Cpu))
        .collect::<Result<Vec<_>>>()?;
    let s = train_step(params, &loaded.model, &batches, t.micro_batch_order.order())?;
    let tokens = u64::from(t.accumulation) * u64::from(t.micro_batch) * u64::from(t.sequence);
    Ok(StepRecord {
        step,
        loss: s.loss,
        lr,
        tokens,
        seconds: started.elapsed().as_secs_f64(),
        compute_seconds: s.times.compute.as_secs_f64(),
        store_seconds: s.times.store.as_secs_f64(),
        optimizer_seconds: s.times.optimizer.as_secs_f64(),
        grad_norm: match s.decision {
            StepDecision::Apply { grad_norm, .. } => grad_norm,
            StepDecision::Skip { .. } => 0.0,
        },
    })
}
