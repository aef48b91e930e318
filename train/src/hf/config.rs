//! The `config.json` of a Hugging Face `LlamaForCausalLM` model: read, checked, written.
//!
//! Hugging Face configs carry many keys; this reads the ones that decide the model's
//! tensors and arithmetic, applies `transformers`' defaults where a key is absent
//! (`num_key_value_heads` = heads, `rope_theta` = 10000, `rms_norm_eps` = 1e-6,
//! `tie_word_embeddings` = false, `max_position_embeddings` = 2048) and keeps the whole
//! JSON object, unknown keys included, so an export writes it back unchanged but for the
//! dtype.
//!
//! Invariant of a [`LlamaConfig`]: every size is non-zero, the attention heads are a
//! multiple of the key/value heads, and it describes a model tidestore's LLaMA computes
//! exactly: a config asking for another architecture, `rope_scaling`, biases in the
//! attention or MLP, or an activation other than SiLU is refused with
//! [`TrainError::HfConfig`] naming the file and the key.

use std::path::Path;

use serde::Deserialize;
use serde_json::{Map, Value};
use tidestore_chunk::DType;

use crate::error::{Result, TrainError};

/// The name of a model directory's config file.
pub const CONFIG_FILE: &str = "config.json";

/// The architecture this crate reads and writes.
pub const LLAMA_ARCHITECTURE: &str = "LlamaForCausalLM";

/// A checked `LlamaForCausalLM` config (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// `hidden_size` (H).
    pub hidden_size: usize,
    /// `intermediate_size` (I, the MLP's width).
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads` (grouped-query attention; = heads when absent).
    pub num_key_value_heads: usize,
    /// `head_dim`, or `hidden_size / num_attention_heads` when absent. HF allows
    /// `heads * head_dim != hidden_size` (q_proj is then `[heads * head_dim, H]`); the
    /// tensor shapes here follow it.
    pub head_dim: usize,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// `rope_theta`.
    pub rope_theta: f64,
    /// `vocab_size` (V).
    pub vocab_size: usize,
    /// `tie_word_embeddings`: the head reuses `model.embed_tokens.weight`.
    pub tie_word_embeddings: bool,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `torch_dtype` (or `dtype`, its newer name) when it names one of F32, F16, BF16.
    pub torch_dtype: Option<DType>,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (a number or a list of them in HF; always a list here).
    pub eos_token_ids: Vec<u32>,
    /// The whole JSON object as read, unknown keys included.
    pub raw: Map<String, Value>,
}

/// The sizes of a LLaMA, to write a config for a new model ([`LlamaConfig::from_shape`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlamaShape {
    /// H.
    pub hidden_size: usize,
    /// I.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads (H must be a multiple).
    pub num_attention_heads: usize,
    /// Key/value heads (a divisor of the heads).
    pub num_key_value_heads: usize,
    /// V.
    pub vocab_size: usize,
    /// Whether the head reuses the embedding.
    pub tie_word_embeddings: bool,
    /// The longest sequence.
    pub max_position_embeddings: usize,
}

/// `eos_token_id` is a number or a list of numbers in HF configs.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

/// The keys read, each optional so a missing one is named by this crate.
#[derive(Deserialize)]
struct Raw {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    vocab_size: Option<usize>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<TokenIds>,
    hidden_act: Option<String>,
    rope_scaling: Option<Value>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
}

impl LlamaConfig {
    /// Reads and checks `dir/config.json`.
    pub fn load(dir: &Path) -> Result<LlamaConfig> {
        let path = dir.join(CONFIG_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(TrainError::HfMissingFile { path, tensor: None })
            }
            Err(source) => {
                return Err(TrainError::Io {
                    op: "reading",
                    path,
                    source,
                })
            }
        };
        LlamaConfig::from_json(&text, &path)
    }

    /// Parses and checks a config's text; `path` only names it in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<LlamaConfig> {
        let value: Value = serde_json::from_str(text).map_err(|e| TrainError::HfConfig {
            path: path.to_path_buf(),
            key: "<file>".into(),
            reason: format!("not valid JSON: {e}"),
        })?;
        LlamaConfig::from_value(value, path)
    }

    /// A config for a new model of `shape` (bf16, RoPE theta 10000, eps 1e-5, byte-level
    /// token ids: BOS 256 and EOS 257 when the vocabulary has room, else none).
    pub fn from_shape(shape: LlamaShape) -> Result<LlamaConfig> {
        let (bos, eos) = if shape.vocab_size >= 258 {
            (Value::from(256u32), Value::from(257u32))
        } else {
            (Value::Null, Value::Null)
        };
        let value = serde_json::json!({
            "architectures": [LLAMA_ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": shape.hidden_size,
            "intermediate_size": shape.intermediate_size,
            "num_hidden_layers": shape.num_hidden_layers,
            "num_attention_heads": shape.num_attention_heads,
            "num_key_value_heads": shape.num_key_value_heads,
            "vocab_size": shape.vocab_size,
            "tie_word_embeddings": shape.tie_word_embeddings,
            "max_position_embeddings": shape.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "rope_scaling": null,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "mlp_bias": false,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
            "use_cache": true,
            "torch_dtype": "bfloat16",
            "bos_token_id": bos,
            "eos_token_id": eos,
        });
        LlamaConfig::from_value(value, Path::new("<new model>"))
    }

    fn from_value(value: Value, path: &Path) -> Result<LlamaConfig> {
        let err = |key: &str, reason: String| TrainError::HfConfig {
            path: path.to_path_buf(),
            key: key.to_string(),
            reason,
        };
        let Value::Object(raw) = value else {
            return Err(err("<file>", "not a JSON object".into()));
        };
        let r: Raw = serde_path_to_error::deserialize(Value::Object(raw.clone()))
            .map_err(|e| err(&e.path().to_string(), e.inner().to_string()))?;
        check_supported(&r, &err)?;
        let need = |v: Option<usize>, key: &str| -> Result<usize> {
            match v {
                None => Err(err(key, "missing".into())),
                Some(0) => Err(err(key, "must be at least 1".into())),
                Some(n) => Ok(n),
            }
        };
        let hidden_size = need(r.hidden_size, "hidden_size")?;
        let heads = need(r.num_attention_heads, "num_attention_heads")?;
        let kv_heads = need(r.num_key_value_heads.or(Some(heads)), "num_key_value_heads")?;
        if heads % kv_heads != 0 {
            return Err(err(
                "num_key_value_heads",
                format!("{kv_heads} does not divide num_attention_heads = {heads}"),
            ));
        }
        let head_dim = match r.head_dim {
            Some(d) => need(Some(d), "head_dim")?,
            None if hidden_size % heads != 0 => {
                return Err(err(
                    "num_attention_heads",
                    format!("{heads} does not divide hidden_size = {hidden_size}"),
                ))
            }
            None => hidden_size / heads,
        };
        let dtype_text = r.torch_dtype.as_deref().or(r.dtype.as_deref());
        let torch_dtype = match dtype_text {
            None => None,
            Some(t) => Some(dtype_from_torch(t).ok_or_else(|| {
                err(
                    "torch_dtype",
                    format!("`{t}`; tidestore reads float32, float16 and bfloat16"),
                )
            })?),
        };
        Ok(LlamaConfig {
            hidden_size,
            intermediate_size: need(r.intermediate_size, "intermediate_size")?,
            num_hidden_layers: need(r.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: r.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: r.rope_theta.unwrap_or(10000.0),
            vocab_size: need(r.vocab_size, "vocab_size")?,
            tie_word_embeddings: r.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: need(
                r.max_position_embeddings.or(Some(2048)),
                "max_position_embeddings",
            )?,
            torch_dtype,
            bos_token_id: r.bos_token_id,
            eos_token_ids: match r.eos_token_id {
                None => Vec::new(),
                Some(TokenIds::One(id)) => vec![id],
                Some(TokenIds::Many(ids)) => ids,
            },
            raw,
        })
    }

    /// The config's JSON (every key read, unknown ones included), pretty-printed, with
    /// `torch_dtype` set to `dtype`: what an export writes as `config.json`.
    pub fn to_json(&self, dtype: DType) -> String {
        let mut raw = self.raw.clone();
        raw.remove("dtype");
        raw.insert("torch_dtype".into(), dtype_to_torch(dtype).into());
        let mut text = serde_json::to_string_pretty(&Value::Object(raw))
            .unwrap_or_else(|e| unreachable!("a JSON map always serialises: {e}"));
        text.push('\n');
        text
    }

    /// Output width of `q_proj` and input width of `o_proj`: heads x head_dim.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Output width of `k_proj` and `v_proj`: key/value heads x head_dim.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Parameters of the base model (no adapters).
    pub fn parameter_count(&self) -> u64 {
        let (h, i, v) = (
            self.hidden_size as u64,
            self.intermediate_size as u64,
            self.vocab_size as u64,
        );
        let (q, kv) = (self.q_dim() as u64, self.kv_dim() as u64);
        let layer = h + h * q + 2 * h * kv + q * h + h + 3 * h * i;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers as u64 * layer + h + head
    }
}

/// Refuses what tidestore's LLaMA does not compute.
fn check_supported(r: &Raw, err: &impl Fn(&str, String) -> TrainError) -> Result<()> {
    match (&r.architectures, &r.model_type) {
        (Some(archs), _) => {
            if let Some((i, a)) = archs
                .iter()
                .enumerate()
                .find(|(_, a)| a.as_str() != LLAMA_ARCHITECTURE)
            {
                return Err(err(
                    &format!("architectures[{i}]"),
                    format!("`{a}` is not supported; tidestore reads {LLAMA_ARCHITECTURE}"),
                ));
            }
            if archs.is_empty() {
                return Err(err("architectures", "empty".into()));
            }
        }
        (None, Some(_)) => {}
        (None, None) => {
            return Err(err(
                "architectures",
                "missing (and no model_type): cannot tell the model is a LLaMA".into(),
            ))
        }
    }
    if let Some(t) = r.model_type.as_deref().filter(|t| *t != "llama") {
        return Err(err(
            "model_type",
            format!("`{t}` is not supported; tidestore reads `llama`"),
        ));
    }
    if let Some(a) = r.hidden_act.as_deref().filter(|a| *a != "silu") {
        return Err(err(
            "hidden_act",
            format!("`{a}` is not supported; LLaMA uses `silu`"),
        ));
    }
    if let Some(s) = r.rope_scaling.as_ref().filter(|s| !s.is_null()) {
        return Err(err(
            "rope_scaling",
            format!("{s} is not supported: tidestore implements plain RoPE only"),
        ));
    }
    if r.attention_bias == Some(true) {
        return Err(err(
            "attention_bias",
            "true is not supported: tidestore's LLaMA has no attention biases".into(),
        ));
    }
    if r.mlp_bias == Some(true) {
        return Err(err(
            "mlp_bias",
            "true is not supported: tidestore's LLaMA has no MLP biases".into(),
        ));
    }
    Ok(())
}

/// `torch_dtype`'s spelling of a dtype (`Q8`, block-quantized moments, is never a
/// model's weights; its raw codes are bytes).
pub fn dtype_to_torch(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::Q8 => "uint8",
    }
}

/// The dtype a `torch_dtype` names, if tidestore holds it.
pub fn dtype_from_torch(t: &str) -> Option<DType> {
    match t {
        "float32" => Some(DType::F32),
        "float16" => Some(DType::F16),
        "bfloat16" => Some(DType::BF16),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA2_7B: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
      "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
      "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
      "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
      "tie_word_embeddings": false, "torch_dtype": "float16",
      "transformers_version": "4.31.0.dev0", "use_cache": true, "vocab_size": 32000
    }"#;

    fn parse(text: &str) -> Result<LlamaConfig> {
        LlamaConfig::from_json(text, Path::new("m/config.json"))
    }

    fn with(key: &str, v: Value) -> String {
        let mut m: Map<String, Value> = serde_json::from_str(LLAMA2_7B).unwrap();
        m.insert(key.into(), v);
        Value::Object(m).to_string()
    }

    #[test]
    fn reads_llama2_and_counts_its_parameters() {
        let c = parse(LLAMA2_7B).unwrap();
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.torch_dtype, Some(DType::F16));
        assert_eq!(c.eos_token_ids, vec![2]);
        assert_eq!(c.parameter_count(), 6_738_415_616);
    }

    #[test]
    fn refuses_what_it_cannot_compute_naming_the_key() {
        for (key, v) in [
            (
                "rope_scaling",
                serde_json::json!({"type": "linear", "factor": 2.0}),
            ),
            ("attention_bias", Value::Bool(true)),
            ("mlp_bias", Value::Bool(true)),
            ("hidden_act", Value::from("gelu")),
            ("num_key_value_heads", Value::from(5)),
            ("torch_dtype", Value::from("int8")),
            ("hidden_size", Value::from("big")),
        ] {
            match parse(&with(key, v)) {
                Err(TrainError::HfConfig { key: k, path, .. }) => {
                    assert_eq!(k, key);
                    assert_eq!(path, Path::new("m/config.json"));
                }
                other => panic!("{key}: {other:?}"),
            }
        }
        let e = parse(&with(
            "architectures",
            serde_json::json!(["MistralForCausalLM"]),
        ));
        assert!(
            matches!(e, Err(TrainError::HfConfig { ref key, .. }) if key == "architectures[0]")
        );
    }

    #[test]
    fn keeps_unknown_keys_and_rewrites_the_dtype() {
        let c = parse(LLAMA2_7B).unwrap();
        let back = parse(&c.to_json(DType::BF16)).unwrap();
        assert_eq!(back.torch_dtype, Some(DType::BF16));
        assert_eq!(back.raw["transformers_version"], "4.31.0.dev0");
    }
}
