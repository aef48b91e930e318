//! A new random-weight LLaMA directory in exact Hugging Face format, from a seed and a
//! shape: tests and newcomers get a model without any download.
//!
//! The directory holds `config.json` ([`LlamaConfig::from_shape`]), the weights as an
//! export writes them (`model.safetensors`, or shards and their index) and, by default,
//! a byte-level `tokenizer.json` ([`crate::hf::tokenizer::byte_level_tokenizer_json`]:
//! token `b` is byte `b`, then `<s>` = 256 and `</s>` = 257, so the vocabulary must
//! hold at least 258). Weights follow `transformers`' LLaMA initialisation: every
//! matrix normal with std 0.02 (`initializer_range`), every norm weight 1. The values
//! depend only on the seed and the shape ([`SplitMix64`], drawn in forward order).

use std::path::Path;

use tidestore_chunk::DType;

use crate::checkpoint::io_err;
use crate::error::{Result, TrainError};
use crate::hf::config::{LlamaConfig, LlamaShape, CONFIG_FILE};
use crate::hf::files::encode;
use crate::hf::names::base_tensors;
use crate::hf::rng::SplitMix64;
use crate::hf::shards::{write_dir_atomically, write_shards, ExportReport, OutTensor};
use crate::hf::tokenizer::{byte_level_tokenizer_json, BYTE_LEVEL_VOCAB, TOKENIZER_FILE};

/// `transformers`' `initializer_range` for LLaMA.
pub const INIT_STD: f32 = 0.02;

/// How a new model directory is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitOptions {
    /// The PRNG seed.
    pub seed: u64,
    /// The dtype of the weights (and `torch_dtype`); bf16 by default.
    pub dtype: DType,
    /// The largest shard; one file by default.
    pub max_shard_bytes: u64,
    /// Whether to write a byte-level `tokenizer.json` (the default).
    pub tokenizer: bool,
}

impl Default for InitOptions {
    /// Seed 0, bf16, one file, with a tokenizer.
    fn default() -> Self {
        InitOptions {
            seed: 0,
            dtype: DType::BF16,
            max_shard_bytes: u64::MAX,
            tokenizer: true,
        }
    }
}

/// Writes a new random-weight LLaMA of `shape` into `dir` (atomically, as an export;
/// see the module doc) and returns its config as read back from the directory.
pub fn init_model(dir: &Path, shape: LlamaShape, opts: &InitOptions) -> Result<LlamaConfig> {
    let cfg = LlamaConfig::from_shape(shape)?;
    if opts.tokenizer && cfg.vocab_size < BYTE_LEVEL_VOCAB {
        return Err(TrainError::Config {
            key: "vocab_size",
            reason: format!(
                "{} is too small for the byte-level tokenizer ({BYTE_LEVEL_VOCAB}: 256 bytes, \
                 <s>, </s>)",
                cfg.vocab_size
            ),
        });
    }
    let tensors: Vec<OutTensor> = base_tensors(&cfg)
        .into_iter()
        .map(|(name, shape)| OutTensor::new(name, shape, opts.dtype))
        .collect();
    let mut rng = SplitMix64::new(opts.seed);
    let report: ExportReport = write_dir_atomically(dir, |tmp| {
        let path = tmp.join(CONFIG_FILE);
        std::fs::write(&path, cfg.to_json(opts.dtype)).map_err(io_err("writing", &path))?;
        if opts.tokenizer {
            let path = tmp.join(TOKENIZER_FILE);
            std::fs::write(&path, byte_level_tokenizer_json()).map_err(io_err("writing", &path))?;
        }
        write_shards(tmp, &tensors, opts.dtype, opts.max_shard_bytes, |name| {
            let t = tensors
                .iter()
                .find(|t| t.name == name)
                .ok_or_else(|| TrainError::Protocol(format!("tensor `{name}` lost (a bug)")))?;
            let n: usize = t.shape.iter().product();
            let values: Vec<f32> = if name.ends_with("norm.weight") {
                vec![1.0; n]
            } else {
                (0..n).map(|_| rng.normal_f32(INIT_STD)).collect()
            };
            Ok(encode(&values, opts.dtype))
        })
    })?;
    tracing::info!(dir = %dir.display(), parameters = cfg.parameter_count(),
        shards = report.shards.len(), "random model written");
    LlamaConfig::load(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prng_is_stable_and_roughly_right() {
        let mut r = SplitMix64::new(1);
        let first = r.next_u64();
        assert_eq!(first, SplitMix64::new(1).next_u64());
        let n = 20_000;
        let xs: Vec<f32> = (0..n).map(|_| r.normal_f32(1.0)).collect();
        let mean = xs.iter().sum::<f32>() / n as f32;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n as f32;
        assert!(
            mean.abs() < 0.05 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
        assert!((0..1000).all(|_| (-0.5..0.5).contains(&r.uniform_f32(-0.5, 0.5))));
    }
}
