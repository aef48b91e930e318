//! The tensors of a LLaMA as Hugging Face names them, in forward order, grouped into the
//! blocks the layer-streamed driver runs: what a store registers for a model.
//!
//! Order (the order of registration, hence of chunks): `model.embed_tokens.weight`;
//! for each layer N `model.layers.N.` + `input_layernorm.weight`, `self_attn.q_proj`,
//! `k_proj`, `v_proj`, `o_proj` (`.weight`), `post_attention_layernorm.weight`,
//! `mlp.gate_proj`, `up_proj`, `down_proj` (`.weight`); `model.norm.weight`;
//! with Qwen2's biases `P.bias` right after `P.weight` for q/k/v (before any adapters),
//! and with Qwen3's norms `self_attn.q_norm.weight` / `k_norm.weight` (`[head_dim]`)
//! after q_proj's / k_proj's tensors;
//! `lm_head.weight` unless the embeddings are tied. Blocks: the embedding, each layer,
//! and the head (final norm + `lm_head`; with tied embeddings the head block registers
//! only the norm and the driver reuses the embedding).
//!
//! With LoRA every base tensor is frozen (dtype [`LoraSpec::base_dtype`], bf16 by
//! default) and each targeted projection `P.weight` [out, in] is followed by its
//! adapters, PEFT's names: `P.lora_A.weight` [r, in] and `P.lora_B.weight` [out, r],
//! fp32 trainable. Without LoRA every tensor is fp32 trainable (the store keeps a 16-bit
//! compute copy and an fp32 master).

use std::fmt;
use std::str::FromStr;

use tidestore_chunk::{DType, TensorSpec};

use crate::error::{Result, TrainError};
use crate::hf::config::LlamaConfig;

/// The embedding's name.
pub const EMBED: &str = "model.embed_tokens.weight";
/// The final norm's name.
pub const FINAL_NORM: &str = "model.norm.weight";
/// The output head's name (absent with tied embeddings).
pub const LM_HEAD: &str = "lm_head.weight";

/// A linear module of a decoder layer that LoRA can adapt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoraTarget {
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj`.
    Gate,
    /// `mlp.up_proj`.
    Up,
    /// `mlp.down_proj`.
    Down,
}

impl LoraTarget {
    /// All targets, in forward order.
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// PEFT's `target_modules` name (`q_proj`, ...).
    pub const fn module(self) -> &'static str {
        match self {
            LoraTarget::Q => "q_proj",
            LoraTarget::K => "k_proj",
            LoraTarget::V => "v_proj",
            LoraTarget::O => "o_proj",
            LoraTarget::Gate => "gate_proj",
            LoraTarget::Up => "up_proj",
            LoraTarget::Down => "down_proj",
        }
    }

    /// The path inside a layer (`self_attn.q_proj`, `mlp.up_proj`).
    pub const fn path(self) -> &'static str {
        match self {
            LoraTarget::Q => "self_attn.q_proj",
            LoraTarget::K => "self_attn.k_proj",
            LoraTarget::V => "self_attn.v_proj",
            LoraTarget::O => "self_attn.o_proj",
            LoraTarget::Gate => "mlp.gate_proj",
            LoraTarget::Up => "mlp.up_proj",
            LoraTarget::Down => "mlp.down_proj",
        }
    }

    /// Whether the projection carries a bias (`P.bias` `[out]`): q/k/v in Qwen2.
    pub fn biased(self, cfg: &LlamaConfig) -> bool {
        cfg.qkv_bias && matches!(self, LoraTarget::Q | LoraTarget::K | LoraTarget::V)
    }

    /// The per-head norm that follows the projection: Qwen3's `q_norm` after `q_proj`,
    /// `k_norm` after `k_proj`.
    pub fn qk_norm(self, cfg: &LlamaConfig) -> Option<&'static str> {
        match self {
            LoraTarget::Q if cfg.qk_norm => Some("q_norm"),
            LoraTarget::K if cfg.qk_norm => Some("k_norm"),
            _ => None,
        }
    }

    /// `[out, in]` of the projection's weight.
    pub fn shape(self, cfg: &LlamaConfig) -> [usize; 2] {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        match self {
            LoraTarget::Q => [cfg.q_dim(), h],
            LoraTarget::K | LoraTarget::V => [cfg.kv_dim(), h],
            LoraTarget::O => [h, cfg.q_dim()],
            LoraTarget::Gate | LoraTarget::Up => [i, h],
            LoraTarget::Down => [h, i],
        }
    }
}

impl fmt::Display for LoraTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.module())
    }
}

impl FromStr for LoraTarget {
    type Err = TrainError;
    /// `q_proj` or `q` (and so on for the seven modules).
    fn from_str(s: &str) -> Result<Self> {
        LoraTarget::ALL
            .into_iter()
            .find(|t| s == t.module() || Some(s) == t.module().strip_suffix("_proj"))
            .ok_or_else(|| TrainError::Config {
                key: "lora.targets",
                reason: format!(
                    "`{s}` is not a LLaMA linear module (q_proj, k_proj, v_proj, o_proj, \
                     gate_proj, up_proj, down_proj)"
                ),
            })
    }
}

/// A LoRA setting: rank, scale and the adapted modules.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// The rank r (at least 1).
    pub r: usize,
    /// `lora_alpha`: the update is scaled by alpha / r.
    pub alpha: f32,
    /// `lora_dropout`, recorded in `adapter_config.json` (the driver applies it).
    pub dropout: f32,
    /// The adapted modules, in forward order, each once.
    pub targets: Vec<LoraTarget>,
    /// The dtype of the frozen base tensors in the store (bf16 by default).
    pub base_dtype: DType,
}

impl LoraSpec {
    /// Rank `r`, `alpha`, no dropout, the given targets (sorted, deduplicated), a bf16 base.
    pub fn new(r: usize, alpha: f32, targets: &[LoraTarget]) -> Self {
        let mut targets = targets.to_vec();
        targets.sort();
        targets.dedup();
        LoraSpec {
            r,
            alpha,
            dropout: 0.0,
            targets,
            base_dtype: DType::BF16,
        }
    }

    /// alpha / r, the factor of B·A in the adapted weight.
    pub fn scale(&self) -> f32 {
        self.alpha / self.r as f32
    }

    fn check(&self) -> Result<()> {
        if self.r == 0 {
            return Err(TrainError::Config {
                key: "lora.r",
                reason: "the rank must be at least 1".into(),
            });
        }
        if self.targets.is_empty() {
            return Err(TrainError::Config {
                key: "lora.targets",
                reason: "no module to adapt".into(),
            });
        }
        if !self.alpha.is_finite() {
            return Err(TrainError::Config {
                key: "lora.alpha",
                reason: format!("{} is not a finite number", self.alpha),
            });
        }
        Ok(())
    }
}

/// Which part of the model a block is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// The token embedding.
    Embed,
    /// Decoder layer N.
    Layer(usize),
    /// The final norm and the output head.
    Head,
}

/// One block of the model and its tensors in forward order.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockSpec {
    /// Which block.
    pub kind: BlockKind,
    /// Its tensors, as the store registers them.
    pub tensors: Vec<TensorSpec>,
}

/// One LoRA adapter pair and the weight it adapts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapter {
    /// The adapted module (`model.layers.3.self_attn.q_proj`), PEFT's module name.
    pub module: String,
    /// Which projection.
    pub target: LoraTarget,
    /// The base weight (`MODULE.weight`), `[out_features, in_features]`.
    pub base: String,
    /// `MODULE.lora_A.weight`, `[r, in_features]`.
    pub a: String,
    /// `MODULE.lora_B.weight`, `[out_features, r]`.
    pub b: String,
    /// The projection's input width.
    pub in_features: usize,
    /// The projection's output width.
    pub out_features: usize,
}

/// Decoder layer `n`'s name prefix (`model.layers.N`).
pub fn layer_prefix(n: usize) -> String {
    format!("model.layers.{n}")
}

/// The model's tensors in forward order, grouped into blocks (see the module doc).
pub fn llama_blocks(cfg: &LlamaConfig, lora: Option<&LoraSpec>) -> Result<Vec<BlockSpec>> {
    if let Some(l) = lora {
        l.check()?;
    }
    let base = |name: String, shape: &[usize]| match lora {
        None => TensorSpec::new(name, shape, DType::F32, true),
        Some(l) => TensorSpec::new(name, shape, l.base_dtype, false),
    };
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let mut blocks = Vec::with_capacity(cfg.num_hidden_layers + 2);
    blocks.push(BlockSpec {
        kind: BlockKind::Embed,
        tensors: vec![base(EMBED.into(), &[v, h])],
    });
    for n in 0..cfg.num_hidden_layers {
        let p = layer_prefix(n);
        let mut t = vec![base(format!("{p}.input_layernorm.weight"), &[h])];
        for target in LoraTarget::ALL {
            if target == LoraTarget::Gate {
                t.push(base(format!("{p}.post_attention_layernorm.weight"), &[h]));
            }
            let [out, inp] = target.shape(cfg);
            t.push(base(format!("{p}.{}.weight", target.path()), &[out, inp]));
            if target.biased(cfg) {
                t.push(base(format!("{p}.{}.bias", target.path()), &[out]));
            }
            if let Some(l) = lora.filter(|l| l.targets.contains(&target)) {
                let m = format!("{p}.{}", target.path());
                t.push(TensorSpec::new(
                    format!("{m}.lora_A.weight"),
                    &[l.r, inp],
                    DType::F32,
                    true,
                ));
                t.push(TensorSpec::new(
                    format!("{m}.lora_B.weight"),
                    &[out, l.r],
                    DType::F32,
                    true,
                ));
            }
            if let Some(norm) = target.qk_norm(cfg) {
                t.push(base(
                    format!("{p}.self_attn.{norm}.weight"),
                    &[cfg.head_dim],
                ));
            }
        }
        blocks.push(BlockSpec {
            kind: BlockKind::Layer(n),
            tensors: t,
        });
    }
    let mut head = vec![base(FINAL_NORM.into(), &[h])];
    if !cfg.tie_word_embeddings {
        head.push(base(LM_HEAD.into(), &[v, h]));
    }
    blocks.push(BlockSpec {
        kind: BlockKind::Head,
        tensors: head,
    });
    Ok(blocks)
}

/// [`llama_blocks`] flattened: every tensor in forward order.
pub fn llama_tensors(cfg: &LlamaConfig, lora: Option<&LoraSpec>) -> Result<Vec<TensorSpec>> {
    Ok(llama_blocks(cfg, lora)?
        .into_iter()
        .flat_map(|b| b.tensors)
        .collect())
}

/// The base model's tensors (what a Hugging Face checkpoint holds): names and shapes in
/// forward order.
pub fn base_tensors(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let specs =
        llama_blocks(cfg, None).unwrap_or_else(|e| unreachable!("no LoRA setting to refuse: {e}"));
    specs
        .into_iter()
        .flat_map(|b| b.tensors)
        .map(|t| (t.name, t.shape))
        .collect()
}

/// The adapters of `lora` on `cfg`, in forward order.
pub fn lora_adapters(cfg: &LlamaConfig, lora: &LoraSpec) -> Vec<Adapter> {
    let mut out = Vec::new();
    for n in 0..cfg.num_hidden_layers {
        for &target in &lora.targets {
            let module = format!("{}.{}", layer_prefix(n), target.path());
            let [out_features, in_features] = target.shape(cfg);
            out.push(Adapter {
                base: format!("{module}.weight"),
                a: format!("{module}.lora_A.weight"),
                b: format!("{module}.lora_B.weight"),
                module,
                target,
                in_features,
                out_features,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::config::LlamaShape;

    fn cfg(tie: bool) -> LlamaConfig {
        LlamaConfig::from_shape(LlamaShape {
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            vocab_size: 40,
            tie_word_embeddings: tie,
            max_position_embeddings: 64,
        })
        .unwrap()
    }

    #[test]
    fn forward_order_shapes_and_blocks() {
        let blocks = llama_blocks(&cfg(false), None).unwrap();
        assert_eq!(blocks.len(), 4);
        let names: Vec<_> = blocks[1].tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.0.input_layernorm.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.k_proj.weight",
                "model.layers.0.self_attn.v_proj.weight",
                "model.layers.0.self_attn.o_proj.weight",
                "model.layers.0.post_attention_layernorm.weight",
                "model.layers.0.mlp.gate_proj.weight",
                "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.mlp.down_proj.weight",
            ]
        );
        assert_eq!(blocks[1].tensors[2].shape, [8, 16]); // 2 kv heads x 4
        assert_eq!(blocks[1].tensors[8].shape, [16, 24]);
        assert_eq!(blocks[3].tensors.len(), 2);
        assert!(blocks.iter().flat_map(|b| &b.tensors).all(|t| t.trainable));
        let tied = llama_blocks(&cfg(true), None).unwrap();
        assert_eq!(tied[3].tensors.len(), 1);
        let c = cfg(false);
        let n: u64 = llama_tensors(&c, None)
            .unwrap()
            .iter()
            .map(|t| t.elements().unwrap())
            .sum();
        assert_eq!(n, c.parameter_count());
    }

    #[test]
    fn head_dim_other_than_hidden_over_heads_sets_the_attention_shapes() {
        let mut raw = cfg(false).raw;
        raw.insert("head_dim".into(), 8.into());
        let c = LlamaConfig::from_json(
            &serde_json::Value::Object(raw).to_string(),
            std::path::Path::new("config.json"),
        )
        .unwrap();
        let t = llama_tensors(&c, None).unwrap();
        let shape = |n: &str| t.iter().find(|t| t.name == n).unwrap().shape.clone();
        assert_eq!(shape("model.layers.0.self_attn.q_proj.weight"), [32, 16]);
        assert_eq!(shape("model.layers.0.self_attn.k_proj.weight"), [16, 16]);
        assert_eq!(shape("model.layers.0.self_attn.o_proj.weight"), [16, 32]);
    }

    #[test]
    fn adapters_follow_their_base_weight() {
        let lora = LoraSpec::new(4, 8.0, &[LoraTarget::V, LoraTarget::Q]);
        let t = llama_tensors(&cfg(false), Some(&lora)).unwrap();
        let i = t
            .iter()
            .position(|t| t.name == "model.layers.1.self_attn.q_proj.weight")
            .unwrap();
        assert!(!t[i].trainable && t[i].dtype == DType::BF16);
        assert_eq!(
            t[i + 1].name,
            "model.layers.1.self_attn.q_proj.lora_A.weight"
        );
        assert_eq!(t[i + 1].shape, [4, 16]);
        assert_eq!(t[i + 2].shape, [16, 4]);
        assert!(t[i + 2].trainable && t[i + 2].dtype == DType::F32);
        assert_eq!(t[i + 3].name, "model.layers.1.self_attn.k_proj.weight");
        assert_eq!(
            t[i + 5].name,
            "model.layers.1.self_attn.v_proj.lora_A.weight"
        );
        assert_eq!(lora_adapters(&cfg(false), &lora).len(), 4);
        assert_eq!("v".parse::<LoraTarget>().unwrap(), LoraTarget::V);
        assert!(LoraSpec::new(0, 1.0, &[LoraTarget::Q]).check().is_err());
    }
}
