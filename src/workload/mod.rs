//! The fine-tuning workload `tidestore bench` drives and `tidestore plan` sizes: a named
//! model shape (or a custom one), fully fine-tuned or with LoRA adapters, as the list of
//! tensors it registers in forward order and the blocks its forward and backward passes
//! touch.
//!
//! Invariants kept:
//! - the tensor list is in forward order and every name is unique;
//! - the shapes are the published ones (see [`models`]; parameter counts are tested
//!   against the papers' and model cards' figures);
//! - with LoRA the base model is frozen (16-bit, no gradient, master, M or V) and only
//!   the adapters `lora_a` / `lora_b` of the targeted projections are trainable;
//! - in full fine-tuning every tensor is trainable and registered as fp32 (the chunk
//!   crate keeps a 16-bit compute copy and the fp32 master, M and V).
//!
//! What is emulated (no matmul runs): the activations, reported to the store as
//! non-model device memory with the sizes [`Workload::activation_bytes`] gives.

pub mod models;

use std::fmt;

use serde::Deserialize;
use tidestore_chunk::{DType, TensorSpec};

use crate::error::{Error, Result};
pub use models::{Arch, ModelShape};

/// `workload.model`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize)]
pub enum ModelName {
    /// GPT-2 small, 124M parameters.
    #[default]
    #[serde(rename = "gpt2")]
    Gpt2,
    /// GPT-2 XL, 1.5B parameters.
    #[serde(rename = "gpt2-xl")]
    Gpt2Xl,
    /// LLaMA 7B.
    #[serde(rename = "llama-7b")]
    Llama7b,
    /// LLaMA 13B.
    #[serde(rename = "llama-13b")]
    Llama13b,
    /// LLaMA 2 70B (grouped-query attention, 8 KV heads).
    #[serde(rename = "llama-70b")]
    Llama70b,
    /// The shape given by `workload.arch`, `layers`, `hidden`, ... .
    #[serde(rename = "custom")]
    Custom,
}

impl ModelName {
    /// The name as the config spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            ModelName::Gpt2 => "gpt2",
            ModelName::Gpt2Xl => "gpt2-xl",
            ModelName::Llama7b => "llama-7b",
            ModelName::Llama13b => "llama-13b",
            ModelName::Llama70b => "llama-70b",
            ModelName::Custom => "custom",
        }
    }

    /// The published shape of a named model (`None` for custom).
    pub fn shape(self) -> Option<ModelShape> {
        Some(match self {
            ModelName::Gpt2 => models::GPT2,
            ModelName::Gpt2Xl => models::GPT2_XL,
            ModelName::Llama7b => models::LLAMA_7B,
            ModelName::Llama13b => models::LLAMA_13B,
            ModelName::Llama70b => models::LLAMA_70B,
            ModelName::Custom => return None,
        })
    }
}

impl fmt::Display for ModelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ModelName {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let all = [
            ModelName::Gpt2,
            ModelName::Gpt2Xl,
            ModelName::Llama7b,
            ModelName::Llama13b,
            ModelName::Llama70b,
            ModelName::Custom,
        ];
        all.into_iter()
            .find(|m| m.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                format!(
                    "unknown model `{s}` (expected gpt2, gpt2-xl, llama-7b, llama-13b, \
                     llama-70b or custom)"
                )
            })
    }
}

/// `workload.mode`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainMode {
    /// Every parameter trainable.
    #[default]
    Full,
    /// Frozen base model, trainable low-rank adapters.
    Lora,
}

/// `workload.lora_targets`: which projections get adapters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraTargets {
    /// The query and value projections (the LoRA paper's choice).
    #[default]
    Qv,
    /// All four attention projections: q, k, v, o.
    Attention,
}

impl LoraTargets {
    /// The projections adapted.
    pub fn projections(self) -> &'static [&'static str] {
        match self {
            LoraTargets::Qv => &["q", "v"],
            LoraTargets::Attention => &["q", "k", "v", "o"],
        }
    }

    /// The name as the config spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            LoraTargets::Qv => "qv",
            LoraTargets::Attention => "attention",
        }
    }
}

/// `[workload]`: the model and how it is trained.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct WorkloadSection {
    /// A named model or `custom`.
    pub model: ModelName,
    /// Full fine-tuning or LoRA.
    pub mode: TrainMode,
    /// LoRA rank (used with `mode = "lora"`), 1..=65536.
    pub lora_rank: u32,
    /// Which projections get LoRA adapters.
    pub lora_targets: LoraTargets,
    /// Measured iterations after the warm-up (traced) one, 1..=100000.
    pub iterations: u32,
    /// Sequences per micro-batch (sizes the emulated activations), >= 1.
    pub micro_batch: u32,
    /// Tokens per sequence (sizes the emulated activations), >= 1.
    pub sequence: u32,
    /// The device's compute rate in TFLOP/s for the bench's compute model (forward and
    /// backward take their FLOPs' time at this rate); 0: compute takes no time.
    pub tflops: f64,
    /// Custom models only: `gpt2` (LayerNorm with biases, fc/proj MLP, tied head,
    /// learned positions) or `llama` (RMSNorm, gate/up/down MLP, untied head).
    pub arch: Option<Arch>,
    /// Custom models only: transformer blocks.
    pub layers: Option<u32>,
    /// Custom models only: model width.
    pub hidden: Option<u32>,
    /// Custom models only: attention heads (divides `hidden`).
    pub heads: Option<u32>,
    /// Custom models only: key/value heads (grouped-query attention; divides `heads`);
    /// default `heads`.
    pub kv_heads: Option<u32>,
    /// Custom models only: MLP width.
    pub intermediate: Option<u32>,
    /// Custom models only: vocabulary size.
    pub vocab: Option<u32>,
}

impl Default for WorkloadSection {
    fn default() -> Self {
        WorkloadSection {
            model: ModelName::Gpt2,
            mode: TrainMode::Full,
            lora_rank: 16,
            lora_targets: LoraTargets::Qv,
            iterations: 3,
            micro_batch: 1,
            sequence: 1024,
            tflops: 0.0,
            arch: None,
            layers: None,
            hidden: None,
            heads: None,
            kv_heads: None,
            intermediate: None,
            vocab: None,
        }
    }
}

impl WorkloadSection {
    /// Checks ranges and that custom-shape keys come with `model = "custom"` (and are
    /// complete there); the error names the key.
    pub fn validate(&self) -> Result<()> {
        if self.lora_rank == 0 || self.lora_rank > 65536 {
            return Err(Error::config(
                "workload.lora_rank",
                format!("{} is outside 1..=65536", self.lora_rank),
            ));
        }
        if self.iterations == 0 || self.iterations > 100_000 {
            return Err(Error::config(
                "workload.iterations",
                format!("{} is outside 1..=100000", self.iterations),
            ));
        }
        if self.micro_batch == 0 {
            return Err(Error::config("workload.micro_batch", "must be at least 1"));
        }
        if self.sequence == 0 {
            return Err(Error::config("workload.sequence", "must be at least 1"));
        }
        if !(self.tflops.is_finite() && (0.0..=1e6).contains(&self.tflops)) {
            return Err(Error::config(
                "workload.tflops",
                format!(
                    "{} is outside 0..=1000000 (0: compute not modeled)",
                    self.tflops
                ),
            ));
        }
        self.shape().map(|_| ())
    }

    /// The model's shape: the published one, or the custom keys checked.
    pub fn shape(&self) -> Result<ModelShape> {
        let custom_keys: [(&str, bool); 7] = [
            ("workload.arch", self.arch.is_some()),
            ("workload.layers", self.layers.is_some()),
            ("workload.hidden", self.hidden.is_some()),
            ("workload.heads", self.heads.is_some()),
            ("workload.kv_heads", self.kv_heads.is_some()),
            ("workload.intermediate", self.intermediate.is_some()),
            ("workload.vocab", self.vocab.is_some()),
        ];
        if let Some(shape) = self.model.shape() {
            if let Some((key, _)) = custom_keys.iter().find(|(_, set)| *set) {
                return Err(Error::config(
                    *key,
                    format!(
                        "only used with model = \"custom\"; model = \"{}\" has its published \
                         shape (remove the key)",
                        self.model
                    ),
                ));
            }
            return Ok(shape);
        }
        self.custom_shape()
    }

    /// `model = "custom"`'s shape, from its keys, checked.
    fn custom_shape(&self) -> Result<ModelShape> {
        let need = |key: &'static str, v: Option<u32>| -> Result<u32> {
            match v {
                None => Err(Error::config(
                    key,
                    "missing: model = \"custom\" needs arch, layers, hidden, heads, \
                     intermediate and vocab",
                )),
                Some(0) => Err(Error::config(key, "must be at least 1")),
                Some(v) => Ok(v),
            }
        };
        let arch = self.arch.ok_or_else(|| {
            Error::config(
                "workload.arch",
                "missing: model = \"custom\" needs arch = \"gpt2\" or \"llama\"",
            )
        })?;
        let layers = need("workload.layers", self.layers)?;
        let hidden = need("workload.hidden", self.hidden)?;
        let heads = need("workload.heads", self.heads)?;
        let intermediate = need("workload.intermediate", self.intermediate)?;
        let vocab = need("workload.vocab", self.vocab)?;
        let kv_heads = need("workload.kv_heads", Some(self.kv_heads.unwrap_or(heads)))?;
        if hidden % heads != 0 {
            return Err(Error::config(
                "workload.heads",
                format!("{heads} heads do not divide hidden = {hidden}"),
            ));
        }
        if heads % kv_heads != 0 {
            return Err(Error::config(
                "workload.kv_heads",
                format!("{kv_heads} KV heads do not divide heads = {heads}"),
            ));
        }
        if arch == Arch::Gpt2 && kv_heads != heads {
            return Err(Error::config(
                "workload.kv_heads",
                "arch = \"gpt2\" has no grouped-query attention: leave kv_heads out or equal \
                 to heads",
            ));
        }
        Ok(ModelShape {
            arch,
            layers,
            hidden,
            heads,
            kv_heads,
            intermediate,
            vocab,
            positions: if arch == Arch::Gpt2 { 1024 } else { 0 },
        })
    }

    /// The workload this section describes.
    pub fn build(&self) -> Result<Workload> {
        self.validate()?;
        let shape = self.shape()?;
        let lora = match self.mode {
            TrainMode::Full => None,
            TrainMode::Lora => Some((self.lora_rank, self.lora_targets)),
        };
        Ok(Workload::new(
            self.model,
            shape,
            lora,
            u64::from(self.micro_batch),
            u64::from(self.sequence),
        ))
    }
}

/// What one compute step touches: the tensors of one block of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// `embed`, `layers.N`, `head`.
    pub name: String,
    /// Indices into [`Workload::tensors`], in the order the block uses them.
    pub tensors: Vec<usize>,
    /// Whether this is a transformer layer (it holds activations for backward).
    pub is_layer: bool,
}

/// A model shape with its training mode, as tensors and blocks.
#[derive(Debug, Clone)]
pub struct Workload {
    /// The model's name.
    pub model: ModelName,
    /// Its shape.
    pub shape: ModelShape,
    /// LoRA rank and targets, or `None` for full fine-tuning.
    pub lora: Option<(u32, LoraTargets)>,
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Tokens per sequence.
    pub sequence: u64,
    /// Every tensor, in forward order.
    pub tensors: Vec<TensorSpec>,
    /// The forward pass, block by block (backward is the reverse).
    pub blocks: Vec<Block>,
}

impl Workload {
    /// Builds the tensor list for `shape`, full (`lora = None`) or LoRA.
    pub fn new(
        model: ModelName,
        shape: ModelShape,
        lora: Option<(u32, LoraTargets)>,
        micro_batch: u64,
        sequence: u64,
    ) -> Workload {
        let mut b = Builder {
            tensors: Vec::new(),
            blocks: Vec::new(),
            lora,
        };
        models::build(&shape, &mut b);
        Workload {
            model,
            shape,
            lora,
            micro_batch,
            sequence,
            tensors: b.tensors,
            blocks: b.blocks,
        }
    }

    /// Every parameter, base and adapters.
    pub fn params_total(&self) -> u64 {
        self.tensors.iter().map(elements).sum()
    }

    /// The base model's parameters (without LoRA adapters): the published count.
    pub fn params_base(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|t| !is_adapter(&t.name))
            .map(elements)
            .sum()
    }

    /// Parameters the optimizer updates.
    pub fn params_trainable(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.trainable)
            .map(elements)
            .sum()
    }

    /// What one of `ranks` data-parallel ranks stores: every tensor cut into `ranks`
    /// equal flat shards (the last padded), this rank's one in its place, as the
    /// data-parallel engines keep them (`tidestore.offload(process_group=...)`: each
    /// rank's store holds `1/ranks` of every parameter and of its master, M and V). The
    /// shape, blocks and batch stay the model's: each rank computes the whole model on
    /// its own micro-batch. One rank: the workload itself.
    pub fn shard(&self, ranks: u32) -> Workload {
        let n = u64::from(ranks.max(1));
        let tensors = self
            .tensors
            .iter()
            .map(|t| {
                let per = elements(t).div_ceil(n).max(1) as usize;
                TensorSpec::new(t.name.clone(), &[per], t.dtype, t.trainable)
            })
            .collect();
        Workload {
            tensors,
            ..self.clone()
        }
    }

    /// Elements of zero padding the shards of [`Workload::shard`] add over all `ranks`:
    /// a tensor of `n` elements that `ranks` does not divide is cut into shards of
    /// `ceil(n / ranks)`, the last ones padded.
    pub fn shard_padding(&self, ranks: u32) -> u64 {
        let n = u64::from(ranks.max(1));
        self.tensors
            .iter()
            .map(|t| elements(t).div_ceil(n) * n - elements(t))
            .sum()
    }

    /// A one-line description: `gpt2 (124.4M params), full fine-tuning`.
    pub fn describe(&self) -> String {
        let mode = match self.lora {
            None => "full fine-tuning".to_string(),
            Some((r, t)) => format!(
                "LoRA rank {r} on {} ({} trainable params)",
                match t {
                    LoraTargets::Qv => "q,v",
                    LoraTargets::Attention => "q,k,v,o",
                },
                human_count(self.params_trainable())
            ),
        };
        format!(
            "{} ({}, {} layers, hidden {}, {} params), {mode}",
            self.model,
            self.shape.arch.as_str(),
            self.shape.layers,
            self.shape.hidden,
            human_count(self.params_base())
        )
    }

    /// Emulated activation bytes (16-bit) under full activation checkpointing: each
    /// layer keeps its input (`s·b·h·2`) for backward, and the layer being computed (or
    /// recomputed in backward) holds its full activations, `s·b·h·34 + 5·a·s²·b` bytes
    /// (Korthikanti et al., 2022); the head holds fp32 logits, `s·b·vocab·4`.
    pub fn activation_bytes(&self) -> ActivationModel {
        let s = self.sequence;
        let b = self.micro_batch;
        let h = u64::from(self.shape.hidden);
        let a = u64::from(self.shape.heads);
        ActivationModel {
            checkpoint_bytes: s * b * h * 2,
            layer_bytes: s * b * h * 34 + 5 * a * s * s * b,
            logits_bytes: s * b * u64::from(self.shape.vocab) * 4,
            layers: u64::from(self.shape.layers),
        }
    }
}

/// Sizes of the emulated activations (see [`Workload::activation_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivationModel {
    /// Kept per finished layer (its input).
    pub checkpoint_bytes: u64,
    /// Held by the layer being computed.
    pub layer_bytes: u64,
    /// The head's logits.
    pub logits_bytes: u64,
    /// Layers.
    pub layers: u64,
}

impl ActivationModel {
    /// Non-model bytes while block `layers_done` layers are kept and a layer (or the
    /// head) is being computed.
    pub fn at(&self, layers_done: u64, computing_head: bool) -> u64 {
        let live = if computing_head {
            self.logits_bytes
        } else {
            self.layer_bytes
        };
        layers_done * self.checkpoint_bytes + live
    }

    /// The most bytes at any moment.
    pub fn peak(&self) -> u64 {
        self.at(self.layers, false).max(self.at(self.layers, true))
    }
}

pub(crate) struct Builder {
    tensors: Vec<TensorSpec>,
    blocks: Vec<Block>,
    lora: Option<(u32, LoraTargets)>,
}

impl Builder {
    pub(crate) fn block(&mut self, name: String, is_layer: bool) {
        self.blocks.push(Block {
            name,
            tensors: Vec::new(),
            is_layer,
        });
    }

    /// A model tensor: fp32 trainable in full fine-tuning, bf16 frozen under LoRA.
    pub(crate) fn param(&mut self, name: String, shape: &[usize]) {
        let spec = match self.lora {
            None => TensorSpec::new(name, shape, DType::F32, true),
            Some(_) => TensorSpec::new(name, shape, DType::BF16, false),
        };
        self.push(spec);
    }

    /// A projection weight `[out, in]`, followed by its adapters when `proj` is a LoRA
    /// target: `lora_a [r, in]` and `lora_b [out, r]`, fp32 trainable.
    pub(crate) fn projection(&mut self, prefix: &str, proj: &str, out: usize, inp: usize) {
        self.param(format!("{prefix}.{proj}.weight"), &[out, inp]);
        if let Some((r, targets)) = self.lora {
            if targets.projections().contains(&proj) {
                let r = r as usize;
                self.push(TensorSpec::new(
                    format!("{prefix}.{proj}.lora_a"),
                    &[r, inp],
                    DType::F32,
                    true,
                ));
                self.push(TensorSpec::new(
                    format!("{prefix}.{proj}.lora_b"),
                    &[out, r],
                    DType::F32,
                    true,
                ));
            }
        }
    }

    /// Uses an already registered tensor again in the current block (a tied head).
    pub(crate) fn reuse(&mut self, name: &str) {
        if let Some(i) = self.tensors.iter().position(|t| t.name == name) {
            if let Some(b) = self.blocks.last_mut() {
                b.tensors.push(i);
            }
        }
    }

    fn push(&mut self, spec: TensorSpec) {
        let i = self.tensors.len();
        self.tensors.push(spec);
        if let Some(b) = self.blocks.last_mut() {
            b.tensors.push(i);
        }
    }
}

fn elements(t: &TensorSpec) -> u64 {
    t.shape.iter().map(|&d| d as u64).product()
}

fn is_adapter(name: &str) -> bool {
    name.ends_with(".lora_a") || name.ends_with(".lora_b")
}

/// `124.4M`, `1.558B`, `68.977B`.
pub fn human_count(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.3}B", n as f64 / 1e9)
    } else if n >= 1_000_000 {
        format!("{:.1}M", n as f64 / 1e6)
    } else if n >= 1_000 {
        format!("{:.1}K", n as f64 / 1e3)
    } else {
        n.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(model: ModelName) -> u64 {
        Workload::new(model, model.shape().unwrap(), None, 1, 1024).params_total()
    }

    #[test]
    fn parameter_counts_match_the_published_ones() {
        // GPT-2: 124,439,808; GPT-2 XL: 1,557,611,200 (Hugging Face model cards);
        // LLaMA: 6.738B, 13.016B (Touvron et al. 2023 / HF); LLaMA 2 70B: 68.977B.
        assert_eq!(count(ModelName::Gpt2), 124_439_808);
        assert_eq!(count(ModelName::Gpt2Xl), 1_557_611_200);
        assert_eq!(count(ModelName::Llama7b), 6_738_415_616);
        assert_eq!(count(ModelName::Llama13b), 13_015_864_320);
        assert_eq!(count(ModelName::Llama70b), 68_976_648_192);
        assert_eq!(human_count(count(ModelName::Gpt2)), "124.4M");
        assert_eq!(human_count(count(ModelName::Gpt2Xl)), "1.558B");
        assert_eq!(human_count(count(ModelName::Llama7b)), "6.738B");
        assert_eq!(human_count(count(ModelName::Llama13b)), "13.016B");
        assert_eq!(human_count(count(ModelName::Llama70b)), "68.977B");
    }

    #[test]
    fn lora_freezes_the_base_and_trains_only_adapters() {
        let shape = models::LLAMA_7B;
        let w = Workload::new(
            ModelName::Llama7b,
            shape,
            Some((8, LoraTargets::Qv)),
            1,
            512,
        );
        assert_eq!(w.params_base(), 6_738_415_616);
        // q and v: (r·in + out·r) each, 32 layers: 2 · 8 · (4096 + 4096) · 32.
        assert_eq!(w.params_trainable(), 2 * 8 * (4096 + 4096) * 32);
        for t in &w.tensors {
            assert_eq!(t.trainable, is_adapter(&t.name), "{}", t.name);
            if !t.trainable {
                assert_eq!(t.dtype, DType::BF16);
            }
        }
        // 70B with GQA: v is [1024, 8192], so its lora_b is [1024, r].
        let w = Workload::new(
            ModelName::Llama70b,
            models::LLAMA_70B,
            Some((16, LoraTargets::Attention)),
            1,
            512,
        );
        let b = w
            .tensors
            .iter()
            .find(|t| t.name == "layers.0.self_attn.v.lora_b")
            .unwrap();
        assert_eq!(b.shape, vec![1024, 16]);
        let per_layer = 16 * ((8192 + 8192) + (8192 + 1024) * 2 + (8192 + 8192));
        assert_eq!(w.params_trainable(), per_layer * 80);
    }

    #[test]
    fn names_are_unique_and_blocks_cover_every_tensor() {
        for m in [ModelName::Gpt2, ModelName::Llama7b] {
            let w = Workload::new(
                m,
                m.shape().unwrap(),
                Some((4, LoraTargets::Attention)),
                1,
                8,
            );
            let mut names: Vec<&str> = w.tensors.iter().map(|t| t.name.as_str()).collect();
            names.sort_unstable();
            let n = names.len();
            names.dedup();
            assert_eq!(names.len(), n);
            let mut seen = vec![false; n];
            for b in &w.blocks {
                for &i in &b.tensors {
                    seen[i] = true;
                }
            }
            assert!(seen.iter().all(|&s| s));
        }
    }

    #[test]
    fn custom_keys_need_model_custom() {
        let s = WorkloadSection {
            layers: Some(4),
            ..WorkloadSection::default()
        };
        assert_eq!(s.validate().unwrap_err().key(), Some("workload.layers"));
        let s = WorkloadSection {
            model: ModelName::Custom,
            arch: Some(Arch::Llama),
            layers: Some(2),
            hidden: Some(64),
            heads: Some(4),
            intermediate: Some(128),
            ..WorkloadSection::default()
        };
        assert_eq!(s.validate().unwrap_err().key(), Some("workload.vocab"));
    }
}
