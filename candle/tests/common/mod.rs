//! Helpers shared by the candle integration tests: a tiny GPT, the same training loop
//! with candle's AdamW in memory and through tidestore.
#![allow(dead_code)]

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use tidestore_candle::{
    Batches, Budget, Gpt, GptConfig, InMemory, Llama, LlamaConfig, LlamaLora, LoraConfig,
    Precision, TideConfig, TideParams,
};
use tidestore_train::IoConfig;
use tidestore_train::MomentForm;
use tidestore_train::{BlockParams, Loan, StepDecision};
use tidestore_train::{HyperParams, Mode};

pub const TEXT: &[u8] = include_bytes!("../../../examples/data/genesis-kjv.txt");

pub fn gpt(lora: Option<usize>) -> Gpt {
    Gpt::new(GptConfig {
        vocab: 256,
        ctx: 16,
        d_model: 32,
        heads: 2,
        layers: 2,
        lora: lora.map(|rank| LoraConfig {
            rank,
            alpha: 2.0 * rank as f32,
        }),
    })
}

/// A small LLaMA (grouped-query attention), its head tied to the embedding or not, with
/// LoRA adapters on q and v or without.
pub fn llama(tie: bool, lora: bool) -> Llama {
    Llama::new(LlamaConfig {
        vocab: 256,
        hidden: 32,
        intermediate: 64,
        layers: 3,
        heads: 4,
        kv_heads: 2,
        rms_eps: 1e-5,
        rope_theta: 10_000.0,
        tie_embeddings: tie,
        lora: lora.then(|| LlamaLora {
            rank: 4,
            alpha: 8.0,
            targets: vec!["q_proj".into(), "v_proj".into()],
        }),
    })
    .unwrap()
}

pub fn batches() -> Batches {
    Batches::new(TEXT[..20_000].to_vec(), 4, 16, 7).unwrap()
}

pub const LR: f64 = 3e-3;
pub const BETAS: (f64, f64) = (0.9, 0.99);
pub const EPS: f64 = 1e-8;
pub const WD: f64 = 0.01;

/// Losses of `steps` steps with candle's AdamW, every tensor in candle memory. A LoRA
/// model's base starts from `base` when given.
pub fn train_candle(model: &Gpt, seed: u64, steps: u64) -> Vec<f32> {
    let dev = Device::Cpu;
    let mut mem = InMemory::new(&model.init(seed), &dev).unwrap();
    let mut opt = AdamW::new(
        mem.vars(),
        ParamsAdamW {
            lr: LR,
            beta1: BETAS.0,
            beta2: BETAS.1,
            eps: EPS,
            weight_decay: WD,
        },
    )
    .unwrap();
    let data = batches();
    (0..steps)
        .map(|s| {
            let (x, y) = data.get(s, &dev).unwrap();
            let loss = model.loss(&mut mem, &x, &y).unwrap();
            opt.backward_step(&loss).unwrap();
            loss.to_scalar::<f32>().unwrap()
        })
        .collect()
}

pub fn tide_config(dir: &std::path::Path, precision: Precision) -> TideConfig {
    let hp = HyperParams {
        lr: LR as f32,
        beta1: BETAS.0 as f32,
        beta2: BETAS.1 as f32,
        eps: EPS as f32,
        weight_decay: WD as f32,
        mode: Mode::AdamW,
    };
    let mut cfg = TideConfig::new(hp, dir);
    cfg.precision = precision;
    // 16 Ki slots: 32 KiB Params chunks, 64 KiB fp32 chunks; the model needs ~14
    // chunks and the host pool holds 5, so M and V live on NVMe between steps.
    cfg.chunk_elements = Some(16 * 1024);
    cfg.host_budget = Budget::Chunks(5);
    cfg.device_budget = Budget::Chunks(4);
    cfg.io = IoConfig {
        block_bytes: 16 * 1024,
        queue_depth: 8,
        threads: 2,
        ..IoConfig::default()
    };
    cfg.optimizer_threads = 1;
    cfg
}

pub fn open_tide(
    model: &Gpt,
    seed: u64,
    dir: &std::path::Path,
    precision: Precision,
) -> TideParams {
    open_tide_with(model, seed, dir, precision, MomentForm::F32)
}

/// As [`open_tide`], with M and V stored as `moments`.
pub fn open_tide_with(
    model: &Gpt,
    seed: u64,
    dir: &std::path::Path,
    precision: Precision,
    moments: MomentForm,
) -> TideParams {
    let mut cfg = tide_config(dir, precision);
    cfg.moments = moments;
    TideParams::open(&model.init(seed), &cfg, &Device::Cpu).unwrap()
}

/// Losses of steps `from..to` through tidestore.
pub fn train_tide(model: &Gpt, p: &mut TideParams, from: u64, to: u64) -> Vec<f32> {
    let dev = Device::Cpu;
    let data = batches();
    (from..to)
        .map(|s| {
            let (x, y) = data.get(s, &dev).unwrap();
            let loss = model.loss(p, &x, &y).unwrap();
            p.backward(&loss).unwrap();
            p.step().unwrap();
            loss.to_scalar::<f32>().unwrap()
        })
        .collect()
}

pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(1.0))
        .fold(0.0, f32::max)
}

/// What the store showed at every parameter the blocks asked for ([`Through`]).
#[derive(Debug, Clone, Copy)]
pub struct Seen {
    /// The most non-model bytes reported to the device.
    pub peak_reported: u64,
    /// The lowest device budget for chunks (the tide).
    pub lowest_tide: u64,
    /// Accesses where the chunks in use and the reported bytes exceeded the device.
    pub over: usize,
}

impl Default for Seen {
    fn default() -> Self {
        Seen {
            peak_reported: 0,
            lowest_tide: u64::MAX,
            over: 0,
        }
    }
}

/// `TideParams` as the driver sees it, lending (or not, `lend: false`: every parameter
/// copied into a candle tensor) and counting its loans; telling the store what the
/// activations take (or not, `counts: false`) and recording what it showed at every
/// fetch and loan ([`Seen`], against a device of `device_bytes`); its step first reads
/// the gradients of `names` (the step consumes them).
pub struct Through<'a> {
    pub p: &'a mut TideParams,
    pub lend: bool,
    pub loans: usize,
    pub names: Vec<String>,
    pub grads: HashMap<String, Vec<f32>>,
    pub counts: bool,
    pub device_bytes: u64,
    pub seen: Seen,
}

impl<'a> Through<'a> {
    pub fn new(p: &'a mut TideParams, lend: bool) -> Self {
        Through {
            p,
            lend,
            loans: 0,
            names: Vec::new(),
            grads: HashMap::new(),
            counts: true,
            device_bytes: u64::MAX,
            seen: Seen::default(),
        }
    }

    fn look(&mut self) {
        let store = self.p.trainer().store();
        let reported = store.device().non_model_reported_bytes();
        let s = &mut self.seen;
        s.peak_reported = s.peak_reported.max(reported);
        s.lowest_tide = s.lowest_tide.min(store.device_budget_bytes());
        let used = store.stats().device.used_bytes;
        s.over += usize::from(used.saturating_add(reported) > self.device_bytes);
    }
}

impl BlockParams<Llama> for Through<'_> {
    fn fetch(&mut self, name: &str, backward: bool) -> tidestore_candle::Result<Tensor> {
        let t = BlockParams::<Llama>::fetch(self.p, name, backward)?;
        self.look();
        Ok(t)
    }

    fn lend(&mut self, name: &str, backward: bool) -> tidestore_candle::Result<Option<Loan>> {
        if !self.lend {
            return Ok(None);
        }
        let loan = self.p.lend(name, backward)?;
        self.loans += usize::from(loan.is_some());
        self.look();
        Ok(loan)
    }

    fn lent(&self, loan: &Loan) -> tidestore_candle::Result<&[f32]> {
        self.p.lent(loan)
    }

    fn end_loans(&mut self) -> tidestore_candle::Result<()> {
        self.p.end_loans()
    }

    fn put_grad(
        &mut self,
        name: &str,
        grad: &Tensor,
        first: bool,
        last: bool,
    ) -> tidestore_candle::Result<()> {
        BlockParams::<Llama>::put_grad(self.p, name, grad, first, last)
    }

    fn hold_activations(&mut self, bytes: u64) -> tidestore_candle::Result<()> {
        if self.counts {
            BlockParams::<Llama>::hold_activations(self.p, bytes)?;
        }
        Ok(())
    }

    fn step(&mut self) -> tidestore_candle::Result<StepDecision> {
        for name in &self.names {
            self.grads.insert(name.clone(), self.p.grad_values(name)?);
        }
        BlockParams::<Llama>::step(self.p)
    }
}
