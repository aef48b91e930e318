//! Guards every supported model family against computing anything but what Hugging
//! Face transformers computes: for each fixture in `tests/fixtures/families/` (a tiny
//! random checkpoint written by transformers, with the logits, the loss and the losses
//! of 5 torch AdamW steps that transformers computed; `make_fixtures.py` and
//! `VERSIONS.txt` beside them), tidestore reads the config and weights as a user's
//! model directory, and its logits, loss and the losses of 5 AdamW steps through the
//! store, layer-streamed, must equal transformers' in fp32 within 1e-5 relative. A
//! missed RoPE scaling, bias, q/k norm, head_dim or sliding window moves them far more.
//! Also: transformers 5's `rope_parameters` with θ = 500000 is read, not dropped (the
//! same weights with θ = 10000 give other losses); LoRA on Qwen2, Qwen3 and Llama 3.1
//! equals PEFT's (`<family>_lora/`).

mod common;

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use common::{max_rel_diff, tide_config};
use tidestore_candle::{train_step, InMemory, Llama, ParamSpec, Precision, TideParams};
use tidestore_train::hf::{HfWeights, LlamaConfig};
use tidestore_train::MicroBatchOrder::Horizontal;

/// The fixture families: each directory holds config.json, model.safetensors and
/// expected.safetensors.
const FAMILIES: [&str; 9] = [
    "llama2",
    "llama3",
    "llama31",
    "llama32",
    "llama_linear",
    "llama_yarn",
    "mistral",
    "qwen2",
    "qwen3",
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/families")
        .join(name)
}

/// What transformers computed: the input tokens `(x, y)`, logits of `x`, the losses.
struct Expected {
    x: Tensor,
    y: Tensor,
    logits: Vec<f32>,
    losses: Vec<f32>,
}

fn expected(dir: &Path) -> Expected {
    let t = candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu).unwrap();
    let tokens = t["tokens"].to_dtype(candle_core::DType::U32).unwrap();
    let n = tokens.dim(1).unwrap();
    Expected {
        x: tokens.narrow(1, 0, n - 1).unwrap(),
        y: tokens.narrow(1, 1, n - 1).unwrap(),
        logits: t["logits"].flatten_all().unwrap().to_vec1().unwrap(),
        losses: t["losses"].to_vec1().unwrap(),
    }
}

/// The model and its weights, as tidestore reads a model directory.
fn load(dir: &Path) -> (Llama, Vec<(ParamSpec, Vec<f32>)>) {
    let cfg = LlamaConfig::load(dir).unwrap();
    let model = Llama::from_hf(&cfg, None).unwrap();
    let weights = HfWeights::open(dir, &cfg).unwrap();
    let init = model
        .specs()
        .into_iter()
        .map(|s| {
            let v = weights
                .tensor_f32(&s.name)
                .unwrap_or_else(|| panic!("{} not in the checkpoint", s.name));
            (s, v)
        })
        .collect();
    (model, init)
}

/// The largest |got - want| over the reference's largest magnitude.
fn scaled_max_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs());
    worst.fold(0f32, f32::max) / scale
}

/// Five AdamW steps of `model` on (x, y), layer-streamed through a fresh store holding
/// `init`: their losses, then the loss after the fifth.
fn streamed_losses(
    init: &[(ParamSpec, Vec<f32>)],
    model: &Llama,
    x: &Tensor,
    y: &Tensor,
) -> Vec<f32> {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tide_config(tmp.path(), Precision::F32);
    let mut p = TideParams::open(init, &cfg, &Device::Cpu).unwrap();
    let batch = [(x.clone(), y.clone())];
    let mut losses: Vec<f32> = (0..5)
        .map(|_| train_step(&mut p, model, &batch, Horizontal).unwrap().loss)
        .collect();
    let last = model.forward(&mut p, x).unwrap();
    losses.push(Llama::loss(&last, y).unwrap().to_scalar::<f32>().unwrap());
    losses
}

fn rel(a: f32, b: f32) -> f32 {
    (a - b).abs() / b.abs()
}

/// Relative errors against transformers: (logits, loss, losses of 5 steps).
fn check(family: &str) -> (f32, f32, f32) {
    let dir = fixture(family);
    let want = expected(&dir);
    let (model, init) = load(&dir);
    let mut mem = InMemory::new(&init, &Device::Cpu).unwrap();
    let logits = model.forward(&mut mem, &want.x).unwrap();
    let loss = Llama::loss(&logits, &want.y)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let got: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
    let logits_err = scaled_max_err(&got, &want.logits);
    let loss_err = rel(loss, want.losses[0]);
    let losses = streamed_losses(&init, &model, &want.x, &want.y);
    let steps_err = max_rel_diff(&losses, &want.losses);
    eprintln!(
        "{family}: logits {logits_err:e}, loss {loss_err:e}, 5 AdamW steps {steps_err:e} \
         (tidestore {losses:?}, transformers {:?})",
        want.losses
    );
    (logits_err, loss_err, steps_err)
}

#[test]
fn every_family_matches_transformers_logits_loss_and_five_adamw_steps() {
    let mut failed = Vec::new();
    for family in FAMILIES {
        let (a, b, c) = check(family);
        if a.max(b).max(c) > 1e-5 {
            failed.push(format!("{family}: logits {a:e}, loss {b:e}, steps {c:e}"));
        }
    }
    assert!(
        failed.is_empty(),
        "off transformers by more than 1e-5: {failed:?}"
    );
}

#[test]
fn rope_parameters_theta_is_read_and_changes_the_loss() {
    let dir = fixture("llama3");
    let cfg = LlamaConfig::load(&dir).unwrap();
    assert!(cfg.raw.contains_key("rope_parameters") && !cfg.raw.contains_key("rope_theta"));
    assert_eq!(cfg.rope.theta, 500_000.0);
    let want = expected(&dir);
    let (model, init) = load(&dir);
    let mut with_theta = cfg.clone();
    with_theta.rope.theta = 10_000.0;
    with_theta.rope_theta = 10_000.0;
    let plain = Llama::from_hf(&with_theta, None).unwrap();
    let mut mem = InMemory::new(&init, &Device::Cpu).unwrap();
    let loss = |m: &Llama, mem: &mut InMemory| {
        let l = m.forward(mem, &want.x).unwrap();
        Llama::loss(&l, &want.y)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let (read, ten_thousand) = (loss(&model, &mut mem), loss(&plain, &mut mem));
    eprintln!(
        "theta 500000: {read}, theta 10000: {ten_thousand}, transformers: {}",
        want.losses[0]
    );
    assert!(rel(read, want.losses[0]) <= 1e-5);
    assert!(rel(ten_thousand, want.losses[0]) > 1e-4);
}

/// The store registers what `hf::llama_blocks` lists and the blocks read what
/// `Llama::block_params` lists: the same names, shapes and order, block by block, for
/// every family, with and without LoRA.
#[test]
fn candle_blocks_read_exactly_the_tensors_the_store_registers() {
    use tidestore_candle::LlamaLora;
    use tidestore_train::hf::{llama_blocks, LoraSpec, LoraTarget};
    let targets = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::Gate,
    ];
    for family in FAMILIES {
        let cfg = LlamaConfig::load(&fixture(family)).unwrap();
        for lora in [false, true] {
            let spec = LoraSpec::new(4, 8.0, &targets);
            let candle_lora = lora.then(|| LlamaLora {
                rank: 4,
                alpha: 8.0,
                targets: targets.iter().map(|t| t.module().to_string()).collect(),
            });
            let model = Llama::from_hf(&cfg, candle_lora).unwrap();
            let blocks = llama_blocks(&cfg, lora.then_some(&spec)).unwrap();
            assert_eq!(blocks.len(), model.blocks());
            for (b, block) in blocks.iter().enumerate() {
                let store: Vec<_> = block.tensors.iter().map(|t| (&t.name, &t.shape)).collect();
                let params = model.block_params(b);
                let read: Vec<_> = params.iter().map(|p| (&p.name, &p.shape)).collect();
                // The tied head reads the embedding, which the store registers once.
                let read = if cfg.tie_word_embeddings && b == blocks.len() - 1 {
                    read[..1].to_vec()
                } else {
                    read
                };
                assert_eq!(store, read, "{family} lora {lora} block {b}");
            }
        }
    }
}

/// LoRA as PEFT computes and trains it (r 4, alpha 8, every projection, B started
/// random; `<family>_lora/` holds PEFT's own adapter files): tidestore reads the base
/// from the family's fixture and the adapters by PEFT's keys, and its logits, loss and
/// 5 AdamW steps of the adapters alone (biases and norms frozen) equal PEFT's.
fn check_lora(family: &str) -> (f32, f32, f32) {
    use tidestore_candle::LlamaLora;
    use tidestore_train::hf::peft_key;
    let dir = fixture(family);
    let lora_dir = fixture(&format!("{family}_lora"));
    let want = expected(&lora_dir);
    let cfg = LlamaConfig::load(&dir).unwrap();
    let targets = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ];
    let lora = LlamaLora {
        rank: 4,
        alpha: 8.0,
        targets: targets.iter().map(|t| t.to_string()).collect(),
    };
    let model = Llama::from_hf(&cfg, Some(lora)).unwrap();
    let weights = HfWeights::open(&dir, &cfg).unwrap();
    let adapters =
        candle_core::safetensors::load(lora_dir.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    let init: Vec<_> = model
        .specs()
        .into_iter()
        .map(|s| {
            let v = match weights.tensor_f32(&s.name) {
                Some(v) => v,
                None => adapters[&peft_key(&s.name)]
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap(),
            };
            (s, v)
        })
        .collect();
    assert_eq!(
        init.iter().filter(|(s, _)| s.trainable).count(),
        adapters.len(),
        "every PEFT adapter is read, and only they train"
    );
    let mut mem = InMemory::new(&init, &Device::Cpu).unwrap();
    let logits = model.forward(&mut mem, &want.x).unwrap();
    let loss = Llama::loss(&logits, &want.y)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let got: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
    let logits_err = scaled_max_err(&got, &want.logits);
    let losses = streamed_losses(&init, &model, &want.x, &want.y);
    let errs = (
        logits_err,
        rel(loss, want.losses[0]),
        max_rel_diff(&losses, &want.losses),
    );
    eprintln!(
        "{family} LoRA: logits {:e}, loss {:e}, 5 AdamW steps {:e} (tidestore {losses:?}, \
         PEFT {:?})",
        errs.0, errs.1, errs.2, want.losses
    );
    errs
}

#[test]
fn lora_matches_peft_logits_loss_and_five_adamw_steps() {
    let mut failed = Vec::new();
    for family in ["qwen2", "qwen3", "llama31"] {
        let (a, b, c) = check_lora(family);
        if a.max(b).max(c) > 1e-5 {
            failed.push(format!("{family}: logits {a:e}, loss {b:e}, steps {c:e}"));
        }
    }
    assert!(failed.is_empty(), "off PEFT by more than 1e-5: {failed:?}");
}
