//! What the streamed examples share: the random-weight LLaMA they train, the synthetic
//! token batches they feed it, and the store's settings around their budgets — so both
//! measure the same model, data and store.

use std::path::Path;

use candle_core::{Device, Tensor};
use tidestore_candle::{Budget, Llama, LlamaConfig, Precision, TideConfig};
use tidestore_train::{HyperParams, IoConfig, Mode};

/// A LLaMA of this shape with HF LLaMA's defaults (RMS epsilon 1e-5, rope theta 10 000,
/// untied embeddings, every weight trained).
pub fn llama(
    vocab: usize,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
) -> tidestore_candle::Result<Llama> {
    Llama::new(LlamaConfig {
        vocab,
        hidden,
        intermediate,
        layers,
        heads,
        kv_heads,
        rms_eps: 1e-5,
        rope_theta: 10_000.0,
        tie_embeddings: false,
        lora: None,
    })
}

/// Step `step`'s batch of `batch` rows of `sequence` token ids below `vocab` (a fixed
/// arithmetic pattern) and the same rows shifted by one, the next-token targets.
pub fn token_batch(
    batch: usize,
    sequence: usize,
    vocab: usize,
    step: u64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let ids: Vec<u32> = (0..batch * (sequence + 1))
        .map(|i| ((i as u64 * 2_654_435_761 + step * 97) % vocab as u64) as u32)
        .collect();
    let all = Tensor::from_vec(ids, (batch, sequence + 1), &Device::Cpu)?;
    Ok((all.narrow(1, 0, sequence)?, all.narrow(1, 1, sequence)?))
}

/// The store's settings: AdamW at `lr`, bf16 compute, device and host budgets of these
/// bytes, the swap file in `swap_dir` written in the I/O engine's default blocks.
pub fn store_config(lr: f32, swap_dir: &Path, device_bytes: u64, host_bytes: u64) -> TideConfig {
    let hp = HyperParams {
        lr,
        mode: Mode::AdamW,
        ..HyperParams::default()
    };
    let mut cfg = TideConfig::new(hp, swap_dir);
    cfg.precision = Precision::Bf16;
    cfg.device_budget = Budget::Bytes(device_bytes);
    cfg.host_budget = Budget::Bytes(host_bytes);
    cfg.io = IoConfig::default();
    cfg
}
