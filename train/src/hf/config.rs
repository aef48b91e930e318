//! The `config.json` of a Hugging Face decoder of a family tidestore computes — Llama
//! (2, 3, 3.1, 3.2), Mistral, Qwen2 / Qwen2.5, Qwen3 — read, checked, written.
//!
//! Nothing in a config is silently dropped: every key is either read ([`USED_KEYS`]),
//! on the written list of keys that do not change what training computes
//! ([`NEUTRAL_KEYS`]: `transformers_version`, `use_cache`, …), or refused with
//! [`TrainError::HfConfig`] naming the file and the key. RoPE is read from either
//! spelling (transformers 4's `rope_theta` / `rope_scaling`, transformers ≥ 5's
//! `rope_parameters`; see [`crate::hf::rope`]). transformers' defaults apply where a key
//! is absent (`num_key_value_heads` = heads, `rope_theta` = 10000, `rms_norm_eps` = 1e-6,
//! `tie_word_embeddings` = false, `max_position_embeddings` = 2048, Mistral's
//! `sliding_window` = 4096). The whole JSON object is kept, so an export writes it back
//! unchanged but for the dtype.
//!
//! Invariant of a [`LlamaConfig`]: every size is non-zero, the attention heads are a
//! multiple of the key/value heads, the head dimension is even, and it describes a
//! model tidestore's decoder computes exactly: another architecture, an unsupported
//! `rope_type`, biases other than Qwen2's q/k/v, attention dropout, partial rotary,
//! Qwen's per-layer sliding window or an activation other than SiLU are refused.

use std::path::Path;

use serde::Deserialize;
use serde_json::{Map, Value};
use tidestore_chunk::DType;

use crate::error::{Result, TrainError};
use crate::hf::rope::Rope;

/// The name of a model directory's config file.
pub const CONFIG_FILE: &str = "config.json";

/// The architecture this crate writes for a new model.
pub const LLAMA_ARCHITECTURE: &str = "LlamaForCausalLM";

/// A model family tidestore computes: LLaMA's decoder with the family's differences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `llama` (Llama 2, 3, 3.1, 3.2).
    Llama,
    /// `mistral`: an optional sliding attention window.
    Mistral,
    /// `qwen2` (Qwen2, Qwen2.5): q/k/v biases.
    Qwen2,
    /// `qwen3`: an explicit `head_dim`, per-head q/k RMSNorm.
    Qwen3,
}

impl Family {
    /// Every family, with its `model_type` and architecture.
    pub const ALL: [(Family, &'static str, &'static str); 4] = [
        (Family::Llama, "llama", "LlamaForCausalLM"),
        (Family::Mistral, "mistral", "MistralForCausalLM"),
        (Family::Qwen2, "qwen2", "Qwen2ForCausalLM"),
        (Family::Qwen3, "qwen3", "Qwen3ForCausalLM"),
    ];

    fn of_model_type(t: &str) -> Option<Family> {
        Family::ALL.iter().find(|f| f.1 == t).map(|f| f.0)
    }

    fn of_architecture(a: &str) -> Option<Family> {
        Family::ALL.iter().find(|f| f.2 == a).map(|f| f.0)
    }
}

/// `MistralConfig`'s `sliding_window` when a config omits the key.
pub const MISTRAL_DEFAULT_SLIDING_WINDOW: usize = 4096;

/// The keys tidestore reads (each changes the computation and is checked).
pub const USED_KEYS: &[&str] = &[
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "vocab_size",
    "tie_word_embeddings",
    "max_position_embeddings",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "attention_dropout",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
];

/// The keys that do not change what is computed in training (kept, written back).
pub const NEUTRAL_KEYS: &[&str] = &[
    "_name_or_path",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "pad_token_id",
    // Which attention kernel transformers picked (eager, sdpa, flash: the same math).
    "_attn_implementation_autoset",
    // Tensor-parallel slicing of the same matmuls (transformers ignores it now).
    "pretraining_tp",
];

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
    /// `rope_theta` (the same as `rope.theta`, from either spelling).
    pub rope_theta: f64,
    /// RoPE: θ and the scaling, from `rope_theta` / `rope_scaling` or `rope_parameters`.
    pub rope: Rope,
    /// The family (`model_type`), which decides the keys below.
    pub family: Family,
    /// q/k/v projections carry biases (`…q_proj.bias` `[heads·head_dim]`): Qwen2.
    pub qkv_bias: bool,
    /// Per-head RMSNorm of queries and keys before RoPE (`…self_attn.q_norm.weight`
    /// `[head_dim]`): Qwen3.
    pub qk_norm: bool,
    /// Mistral's `sliding_window`: a query attends to the last `w` positions only.
    pub sliding_window: Option<usize>,
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
    vocab_size: Option<usize>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<TokenIds>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    attention_dropout: Option<f64>,
    partial_rotary_factor: Option<f64>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    layer_types: Option<Vec<String>>,
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
        check_keys(&raw, &err)?;
        let r: Raw = serde_path_to_error::deserialize(Value::Object(raw.clone()))
            .map_err(|e| err(&e.path().to_string(), e.inner().to_string()))?;
        let family = family(&r, &err)?;
        check_supported(&r, &err)?;
        let need = |v: Option<usize>, key: &str| need(v, key, &err);
        let (hidden_size, heads, kv_heads, head_dim) = attention_sizes(&r, &err)?;
        let torch_dtype = torch_dtype_of(&r, &err)?;
        let max_position_embeddings = need(
            r.max_position_embeddings.or(Some(2048)),
            "max_position_embeddings",
        )?;
        let rope = Rope::from_config(&raw, max_position_embeddings, path)?;
        let sliding_window = sliding_window_of(family, &r, &raw, &err)?;
        check_layer_types(&r, sliding_window.is_some(), &err)?;
        Ok(LlamaConfig {
            rope_theta: rope.theta,
            rope,
            family,
            qkv_bias: family == Family::Qwen2,
            qk_norm: family == Family::Qwen3,
            sliding_window,
            hidden_size,
            intermediate_size: need(r.intermediate_size, "intermediate_size")?,
            num_hidden_layers: need(r.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: rms_norm_eps_of(&r, &err)?,
            vocab_size: need(r.vocab_size, "vocab_size")?,
            tie_word_embeddings: r.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings,
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
        let biases = if self.qkv_bias { q + 2 * kv } else { 0 };
        let norms = if self.qk_norm {
            2 * self.head_dim as u64
        } else {
            0
        };
        let layer = h + h * q + 2 * h * kv + q * h + h + 3 * h * i + biases + norms;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers as u64 * layer + h + head
    }
}

/// A size that must be given and non-zero.
fn need(v: Option<usize>, key: &str, err: &impl Fn(&str, String) -> TrainError) -> Result<usize> {
    match v {
        None => Err(err(key, "missing".into())),
        Some(0) => Err(err(key, "must be at least 1".into())),
        Some(n) => Ok(n),
    }
}

/// `(hidden_size, heads, kv_heads, head_dim)`: kv heads divide the heads, the head
/// dimension (explicit, or heads dividing the width) is even.
fn attention_sizes(
    r: &Raw,
    err: &impl Fn(&str, String) -> TrainError,
) -> Result<(usize, usize, usize, usize)> {
    let hidden_size = need(r.hidden_size, "hidden_size", err)?;
    let heads = need(r.num_attention_heads, "num_attention_heads", err)?;
    let kv_heads = need(
        r.num_key_value_heads.or(Some(heads)),
        "num_key_value_heads",
        err,
    )?;
    if !heads.is_multiple_of(kv_heads) {
        return Err(err(
            "num_key_value_heads",
            format!("{kv_heads} does not divide num_attention_heads = {heads}"),
        ));
    }
    let head_dim = match r.head_dim {
        Some(d) => need(Some(d), "head_dim", err)?,
        None if !hidden_size.is_multiple_of(heads) => {
            return Err(err(
                "num_attention_heads",
                format!("{heads} does not divide hidden_size = {hidden_size}"),
            ))
        }
        None => hidden_size / heads,
    };
    if !head_dim.is_multiple_of(2) {
        return Err(err(
            "head_dim",
            format!("{head_dim} is odd; rotary embeddings rotate pairs"),
        ));
    }
    Ok((hidden_size, heads, kv_heads, head_dim))
}

/// Every key read or neutral (see the module doc); the first other one is refused.
fn check_keys(raw: &Map<String, Value>, err: &impl Fn(&str, String) -> TrainError) -> Result<()> {
    match raw
        .keys()
        .find(|k| !USED_KEYS.contains(&k.as_str()) && !NEUTRAL_KEYS.contains(&k.as_str()))
    {
        None => Ok(()),
        Some(k) => Err(err(
            k,
            "unknown key: tidestore cannot tell whether it changes the model, so it \
             refuses it rather than ignore it"
                .into(),
        )),
    }
}

/// `rms_norm_eps` (transformers' 1e-6 when absent), finite and above 0: the RMS norm
/// divides by `sqrt(mean(x²) + eps)`, which a zero or negative eps can make 0 or NaN.
fn rms_norm_eps_of(r: &Raw, err: &impl Fn(&str, String) -> TrainError) -> Result<f64> {
    match r.rms_norm_eps.unwrap_or(1e-6) {
        eps if eps.is_finite() && eps > 0.0 => Ok(eps),
        eps => Err(err(
            "rms_norm_eps",
            format!("{eps}: must be a finite number above 0"),
        )),
    }
}

/// `torch_dtype` (or `dtype`, its transformers 5 name) when it names one tidestore holds.
/// Both keys are read, each checked; given both, they must agree.
fn torch_dtype_of(r: &Raw, err: &impl Fn(&str, String) -> TrainError) -> Result<Option<DType>> {
    let read = |key: &str, t: Option<&str>| -> Result<Option<DType>> {
        t.map(|t| {
            dtype_from_torch(t).ok_or_else(|| {
                err(
                    key,
                    format!("`{t}`; tidestore reads float32, float16 and bfloat16"),
                )
            })
        })
        .transpose()
    };
    let old = read("torch_dtype", r.torch_dtype.as_deref())?;
    let new = read("dtype", r.dtype.as_deref())?;
    match (old, new) {
        (Some(a), Some(b)) if a != b => Err(err(
            "dtype",
            format!(
                "`{}` disagrees with torch_dtype = `{}`: both name the weights' dtype \
                 (dtype is transformers 5's name); keep one, or make them agree",
                dtype_to_torch(b),
                dtype_to_torch(a)
            ),
        )),
        (a, b) => Ok(a.or(b)),
    }
}

/// Mistral's window: `MistralConfig`'s default 4096 when the key is absent, none when
/// it is `null`; other families have none (Qwen's is refused in `check_supported`).
fn sliding_window_of(
    family: Family,
    r: &Raw,
    raw: &Map<String, Value>,
    err: &impl Fn(&str, String) -> TrainError,
) -> Result<Option<usize>> {
    if family != Family::Mistral {
        return Ok(None);
    }
    match (r.sliding_window, raw.contains_key("sliding_window")) {
        (Some(0), _) => Err(err("sliding_window", "must be at least 1".into())),
        (None, false) => Ok(Some(MISTRAL_DEFAULT_SLIDING_WINDOW)),
        (w, _) => Ok(w),
    }
}

/// The family named by `architectures` and `model_type`, which must agree.
fn family(r: &Raw, err: &impl Fn(&str, String) -> TrainError) -> Result<Family> {
    let supported = || {
        Family::ALL
            .iter()
            .map(|f| format!("{} ({})", f.2, f.1))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let by_type = match r.model_type.as_deref() {
        None => None,
        Some(t) => Some(Family::of_model_type(t).ok_or_else(|| {
            err(
                "model_type",
                format!("`{t}` is not supported; tidestore reads {}", supported()),
            )
        })?),
    };
    let by_arch = match &r.architectures {
        None => None,
        Some(archs) if archs.is_empty() => return Err(err("architectures", "empty".into())),
        Some(archs) => {
            let mut found = None;
            for (i, a) in archs.iter().enumerate() {
                let f = Family::of_architecture(a).ok_or_else(|| {
                    err(
                        &format!("architectures[{i}]"),
                        format!("`{a}` is not supported; tidestore reads {}", supported()),
                    )
                })?;
                if found.is_some_and(|g| g != f) {
                    return Err(err(
                        &format!("architectures[{i}]"),
                        format!("`{a}` is another family than architectures[0]"),
                    ));
                }
                found = Some(f);
            }
            found
        }
    };
    match (by_arch, by_type) {
        (Some(a), Some(t)) if a != t => Err(err(
            "model_type",
            format!(
                "`{}` ({t:?}) disagrees with architectures ({}: {a:?})",
                r.model_type.as_deref().unwrap_or_default(),
                r.architectures.as_deref().unwrap_or_default().join(", ")
            ),
        )),
        (Some(f), _) | (None, Some(f)) => Ok(f),
        (None, None) => Err(err(
            "architectures",
            "missing (and no model_type): cannot tell the model's family".into(),
        )),
    }
}

/// Refuses what tidestore's decoder does not compute for `family`: the first key set to
/// something else, with why.
fn check_supported(r: &Raw, err: &impl Fn(&str, String) -> TrainError) -> Result<()> {
    let set = |on: Option<bool>, why: &str| (on == Some(true)).then(|| why.to_string());
    let refused = [
        (
            "hidden_act",
            r.hidden_act
                .as_deref()
                .filter(|a| *a != "silu")
                .map(|a| format!("`{a}` is not supported; these families use `silu`")),
        ),
        (
            "attention_bias",
            set(
                r.attention_bias,
                "true is not supported: tidestore computes q/k/v biases for qwen2 only",
            ),
        ),
        (
            "mlp_bias",
            set(
                r.mlp_bias,
                "true is not supported: tidestore's MLP has no biases",
            ),
        ),
        (
            "attention_dropout",
            r.attention_dropout.filter(|p| *p != 0.0).map(|p| {
                format!("{p} is not supported: tidestore trains without attention dropout")
            }),
        ),
        (
            "partial_rotary_factor",
            r.partial_rotary_factor
                .filter(|p| *p != 1.0)
                .map(|p| format!("{p} is not supported: tidestore rotates the whole head (1.0)")),
        ),
        (
            "use_sliding_window",
            set(
                r.use_sliding_window,
                "true is not supported: tidestore computes Qwen's full attention only",
            ),
        ),
    ];
    match refused.into_iter().find_map(|(key, why)| Some((key, why?))) {
        Some((key, why)) => Err(err(key, why)),
        None => Ok(()),
    }
}

/// transformers ≥ 5's `layer_types`: every layer as the model computes it.
fn check_layer_types(
    r: &Raw,
    sliding: bool,
    err: &impl Fn(&str, String) -> TrainError,
) -> Result<()> {
    let want = if sliding {
        "sliding_attention"
    } else {
        "full_attention"
    };
    let types = r.layer_types.as_deref().unwrap_or_default();
    if let Some((i, t)) = types.iter().enumerate().find(|(_, t)| t.as_str() != want) {
        return Err(err(
            &format!("layer_types[{i}]"),
            format!("`{t}`: tidestore computes `{want}` in every layer of this model"),
        ));
    }
    match r.num_hidden_layers {
        Some(n) if r.layer_types.is_some() && types.len() != n => Err(err(
            "layer_types",
            format!("{} entries for {n} layers", types.len()),
        )),
        _ => Ok(()),
    }
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
    use crate::hf::rope::RopeScaling;

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
                serde_json::json!({"type": "dynamic", "factor": 2.0}),
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
                    assert!(k.starts_with(key), "{k} for {key}");
                    assert_eq!(path, Path::new("m/config.json"));
                }
                other => panic!("{key}: {other:?}"),
            }
        }
        let e = parse(&with(
            "architectures",
            serde_json::json!(["GemmaForCausalLM"]),
        ));
        assert!(
            matches!(e, Err(TrainError::HfConfig { ref key, .. }) if key == "architectures[0]")
        );
    }

    #[test]
    fn rms_norm_eps_zero_or_negative_is_refused() {
        for eps in [-1e-5, 0.0] {
            match parse(&with("rms_norm_eps", Value::from(eps))) {
                Err(e @ TrainError::HfConfig { .. }) => {
                    assert!(
                        matches!(&e, TrainError::HfConfig { key, .. } if key == "rms_norm_eps")
                    );
                    assert!(e.to_string().contains("above 0"), "{e}");
                }
                other => panic!("{eps}: {other:?}"),
            }
        }
        assert_eq!(parse(LLAMA2_7B).unwrap().rms_norm_eps, 1e-5);
    }

    /// transformers 5's `dtype` beside `torch_dtype` was ignored: checked as it is, and
    /// the two must agree.
    #[test]
    fn dtype_is_checked_and_must_agree_with_torch_dtype() {
        for (v, reason) in [("float32", "disagrees with torch_dtype"), ("int8", "int8")] {
            match parse(&with("dtype", Value::from(v))) {
                Err(e @ TrainError::HfConfig { .. }) => {
                    assert!(matches!(&e, TrainError::HfConfig { key, .. } if key == "dtype"));
                    assert!(e.to_string().contains(reason), "{e}");
                }
                other => panic!("{v}: {other:?}"),
            }
        }
        let agreeing = parse(&with("dtype", Value::from("float16"))).unwrap();
        assert_eq!(agreeing.torch_dtype, Some(DType::F16));
        let mut alone: Map<String, Value> = serde_json::from_str(LLAMA2_7B).unwrap();
        alone.remove("torch_dtype");
        alone.insert("dtype".into(), Value::from("bfloat16"));
        let c = parse(&Value::Object(alone).to_string()).unwrap();
        assert_eq!(c.torch_dtype, Some(DType::BF16));
    }

    #[test]
    fn keeps_unknown_keys_and_rewrites_the_dtype() {
        let c = parse(LLAMA2_7B).unwrap();
        let back = parse(&c.to_json(DType::BF16)).unwrap();
        assert_eq!(back.torch_dtype, Some(DType::BF16));
        assert_eq!(back.raw["transformers_version"], "4.31.0.dev0");
    }

    /// Every key of the families' published config.json files (as their model cards
    /// ship them), in both RoPE spellings.
    const LLAMA3_8B: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false,
      "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001,
      "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
      "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
      "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
      "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "transformers_version": "4.40.0.dev0", "use_cache": true, "vocab_size": 128256
    }"#;
    const LLAMA31_8B: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false,
      "attention_dropout": 0.0, "bos_token_id": 128000,
      "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
      "initializer_range": 0.02, "intermediate_size": 14336,
      "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
      "pretraining_tp": 1, "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256
    }"#;
    const LLAMA32_1B: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false,
      "attention_dropout": 0.0, "bos_token_id": 128000,
      "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
      "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
      "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
      "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
      "pretraining_tp": 1, "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
      "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256
    }"#;
    const MISTRAL_7B_V01: &str = r#"{
      "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
      "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
      "intermediate_size": 14336, "max_position_embeddings": 32768,
      "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
      "sliding_window": 4096, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "transformers_version": "4.34.0.dev0", "use_cache": true, "vocab_size": 32000
    }"#;
    const MISTRAL_7B_V03: &str = r#"{
      "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0,
      "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
      "initializer_range": 0.02, "intermediate_size": 14336,
      "max_position_embeddings": 32768, "model_type": "mistral",
      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": null,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "transformers_version": "4.42.0.dev0", "use_cache": true, "vocab_size": 32768
    }"#;
    const QWEN25_7B: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
      "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
      "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
      "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
      "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
      "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false,
      "vocab_size": 152064
    }"#;
    const QWEN3_06B: &str = r#"{
      "architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
      "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
      "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
      "initializer_range": 0.02, "intermediate_size": 3072,
      "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
      "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
      "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
      "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
      "vocab_size": 151936
    }"#;
    /// Llama 3.1 as transformers ≥ 5 writes it: `dtype`, `rope_parameters`, `head_dim`.
    const LLAMA31_8B_V5: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false,
      "attention_dropout": 0.0, "bos_token_id": 128000,
      "eos_token_id": [128001, 128008, 128009], "dtype": "bfloat16", "head_dim": 128,
      "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
      "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": false,
      "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "pad_token_id": null, "pretraining_tp": 1,
      "rms_norm_eps": 1e-05,
      "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rope_type": "llama3"},
      "tie_word_embeddings": false, "transformers_version": "5.0.0", "use_cache": true,
      "vocab_size": 128256
    }"#;

    #[test]
    fn reads_every_key_of_each_familys_real_config() {
        let llama3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        for (name, text, family, theta, tie) in [
            ("llama2", LLAMA2_7B, Family::Llama, 1e4, false),
            ("llama3", LLAMA3_8B, Family::Llama, 5e5, false),
            ("llama3.1", LLAMA31_8B, Family::Llama, 5e5, false),
            ("llama3.1 v5", LLAMA31_8B_V5, Family::Llama, 5e5, false),
            ("llama3.2", LLAMA32_1B, Family::Llama, 5e5, true),
            ("mistral v0.1", MISTRAL_7B_V01, Family::Mistral, 1e4, false),
            ("mistral v0.3", MISTRAL_7B_V03, Family::Mistral, 1e6, false),
            ("qwen2.5", QWEN25_7B, Family::Qwen2, 1e6, false),
            ("qwen3", QWEN3_06B, Family::Qwen3, 1e6, true),
        ] {
            let c = parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(c.family, family, "{name}");
            assert_eq!((c.rope.theta, c.rope_theta), (theta, theta), "{name}");
            assert_eq!(c.tie_word_embeddings, tie, "{name}");
            assert_eq!(c.qkv_bias, family == Family::Qwen2, "{name}");
            assert_eq!(c.qk_norm, family == Family::Qwen3, "{name}");
            if name.starts_with("llama3.") {
                assert_ne!(c.rope.scaling, RopeScaling::Default, "{name}");
            }
            if name.starts_with("llama3.1") {
                assert_eq!(c.rope.scaling, llama3, "{name}");
            }
            // Every key is either read or on the neutral list; one more is refused.
            let mut m: Map<String, Value> = serde_json::from_str(text).unwrap();
            m.insert("fancy_new_knob".into(), Value::Bool(true));
            match parse(&Value::Object(m).to_string()) {
                Err(TrainError::HfConfig { key, path, .. }) => {
                    assert_eq!(key, "fancy_new_knob", "{name}");
                    assert_eq!(path, Path::new("m/config.json"));
                }
                other => panic!("{name}: an unknown key gives {other:?}"),
            }
        }
        assert_eq!(parse(QWEN3_06B).unwrap().head_dim, 128);
        assert_eq!(parse(MISTRAL_7B_V01).unwrap().sliding_window, Some(4096));
        assert_eq!(parse(MISTRAL_7B_V03).unwrap().sliding_window, None);
        assert_eq!(parse(QWEN25_7B).unwrap().sliding_window, None);
        assert_eq!(
            parse(LLAMA31_8B).unwrap().rope,
            parse(LLAMA31_8B_V5).unwrap().rope
        );
    }

    #[test]
    fn rope_parameters_theta_is_read_not_dropped() {
        let text = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 300,
          "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}"#;
        let c = parse(text).unwrap();
        assert_eq!(
            (c.rope_theta, c.rope.scaling),
            (500_000.0, RopeScaling::Default)
        );
    }

    #[test]
    fn refuses_families_settings_it_does_not_compute() {
        for (text, key, v) in [
            (QWEN25_7B, "use_sliding_window", Value::Bool(true)),
            (QWEN3_06B, "attention_bias", Value::Bool(true)),
            (LLAMA3_8B, "attention_dropout", Value::from(0.1)),
            (LLAMA3_8B, "partial_rotary_factor", Value::from(0.5)),
            (
                QWEN3_06B,
                "layer_types",
                serde_json::json!(["sliding_attention"]),
            ),
            (
                LLAMA31_8B,
                "rope_scaling",
                serde_json::json!({"rope_type": "longrope", "factor": 2.0}),
            ),
            (LLAMA3_8B, "model_type", Value::from("qwen2")),
        ] {
            let mut m: Map<String, Value> = serde_json::from_str(text).unwrap();
            m.insert(key.into(), v);
            match parse(&Value::Object(m).to_string()) {
                Err(TrainError::HfConfig { key: k, .. }) => {
                    assert!(k.starts_with(key), "{k} for {key}")
                }
                other => panic!("{key}: {other:?}"),
            }
        }
    }
}
