//! The files of a Hugging Face model directory and of a PEFT adapter, by name, and the
//! conversion of values into a file's dtype: what import, export, `init-model` and the
//! PEFT adapter share (a leaf of `hf`: it uses no other part of it).

use std::borrow::Cow;

use tidestore_chunk::typed::{decode_f32, encode_f32};
use tidestore_chunk::DType;

use crate::error::{Result, TrainError};

/// The single-file weights of a model directory.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The shard index of a sharded model directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The adapter weights' file name.
pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
/// The adapter config's file name.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";

/// Files of a model directory other than weights and config that an export copies
/// along when they exist (tokenizer and generation settings).
pub const COPIED_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
];

/// The largest finite f16.
pub(crate) const F16_MAX: f32 = 65504.0;

/// `src` (elements of `from`) as elements of `to`: borrowed when they agree.
pub(crate) fn convert(src: &[u8], from: DType, to: DType) -> Cow<'_, [u8]> {
    if from == to {
        return Cow::Borrowed(src);
    }
    let mut values = vec![0f32; src.len() / from.size_bytes() as usize];
    decode_f32(src, from, &mut values);
    Cow::Owned(encode(&values, to))
}

/// f32 values as little-endian elements of `to`.
pub(crate) fn encode(values: &[f32], to: DType) -> Vec<u8> {
    let mut out = vec![0u8; values.len() * to.size_bytes() as usize];
    encode_f32(values, to, &mut out);
    out
}

/// Refuses values an f16 export would turn into infinities.
pub(crate) fn check_fits(name: &str, values: &[f32], dtype: DType) -> Result<()> {
    if dtype != DType::F16 {
        return Ok(());
    }
    match values.iter().find(|v| v.is_finite() && v.abs() > F16_MAX) {
        None => Ok(()),
        Some(v) => Err(TrainError::Tensor {
            tensor: name.to_string(),
            reason: format!("holds {v}, beyond f16's range (±{F16_MAX}): export it as bf16 or f32"),
        }),
    }
}
