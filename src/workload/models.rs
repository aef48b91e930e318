//! The published shapes of the named models, and the tensors of one transformer in
//! forward order.
//!
//! - GPT-2 (Radford et al., 2019; Hugging Face `gpt2`, `gpt2-xl`): learned token and
//!   position embeddings, pre-LayerNorm blocks with biases everywhere, attention q/k/v
//!   (the fused `c_attn` split in three) and output `o` (`c_proj`), MLP `fc` / `proj`
//!   of width 4·hidden, final LayerNorm, and an LM head tied to the token embedding (no
//!   tensor of its own: the head block reads `wte` again).
//! - LLaMA (Touvron et al., 2023) 7B and 13B, LLaMA 2 70B: token embedding, RMSNorm
//!   (weight only), attention q/k/v/o without biases (70B: grouped-query attention with
//!   8 KV heads, so k and v are `[1024, 8192]`), SwiGLU MLP gate/up/down, final norm and
//!   an untied LM head.

use serde::Deserialize;

use super::Builder;

/// The family of a model shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    /// GPT-2 style.
    Gpt2,
    /// LLaMA style.
    Llama,
}

impl Arch {
    /// The name as the config spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Arch::Gpt2 => "gpt2",
            Arch::Llama => "llama",
        }
    }
}

/// The dimensions of a transformer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    /// Family.
    pub arch: Arch,
    /// Transformer blocks.
    pub layers: u32,
    /// Model width.
    pub hidden: u32,
    /// Attention heads.
    pub heads: u32,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: u32,
    /// MLP width.
    pub intermediate: u32,
    /// Vocabulary.
    pub vocab: u32,
    /// Learned positions (GPT-2); 0 for rotary (LLaMA).
    pub positions: u32,
}

/// GPT-2 small: 124,439,808 parameters.
pub const GPT2: ModelShape = ModelShape {
    arch: Arch::Gpt2,
    layers: 12,
    hidden: 768,
    heads: 12,
    kv_heads: 12,
    intermediate: 3072,
    vocab: 50257,
    positions: 1024,
};

/// GPT-2 XL: 1,557,611,200 parameters.
pub const GPT2_XL: ModelShape = ModelShape {
    arch: Arch::Gpt2,
    layers: 48,
    hidden: 1600,
    heads: 25,
    kv_heads: 25,
    intermediate: 6400,
    vocab: 50257,
    positions: 1024,
};

/// LLaMA 7B: 6,738,415,616 parameters.
pub const LLAMA_7B: ModelShape = ModelShape {
    arch: Arch::Llama,
    layers: 32,
    hidden: 4096,
    heads: 32,
    kv_heads: 32,
    intermediate: 11008,
    vocab: 32000,
    positions: 0,
};

/// LLaMA 13B: 13,015,864,320 parameters.
pub const LLAMA_13B: ModelShape = ModelShape {
    arch: Arch::Llama,
    layers: 40,
    hidden: 5120,
    heads: 40,
    kv_heads: 40,
    intermediate: 13824,
    vocab: 32000,
    positions: 0,
};

/// LLaMA 2 70B: 68,976,648,192 parameters.
pub const LLAMA_70B: ModelShape = ModelShape {
    arch: Arch::Llama,
    layers: 80,
    hidden: 8192,
    heads: 64,
    kv_heads: 8,
    intermediate: 28672,
    vocab: 32000,
    positions: 0,
};

/// Registers `shape`'s tensors, block by block, in forward order.
pub(crate) fn build(shape: &ModelShape, b: &mut Builder) {
    let h = shape.hidden as usize;
    let inter = shape.intermediate as usize;
    let vocab = shape.vocab as usize;
    let kv = (shape.hidden / shape.heads * shape.kv_heads) as usize;
    match shape.arch {
        Arch::Gpt2 => {
            b.block("embed".into(), false);
            b.param("wte".into(), &[vocab, h]);
            b.param("wpe".into(), &[shape.positions as usize, h]);
            for l in 0..shape.layers {
                let p = format!("h.{l}");
                b.block(p.clone(), true);
                b.param(format!("{p}.ln_1.weight"), &[h]);
                b.param(format!("{p}.ln_1.bias"), &[h]);
                for proj in ["q", "k", "v"] {
                    b.projection(&format!("{p}.attn"), proj, h, h);
                    b.param(format!("{p}.attn.{proj}.bias"), &[h]);
                }
                b.projection(&format!("{p}.attn"), "o", h, h);
                b.param(format!("{p}.attn.o.bias"), &[h]);
                b.param(format!("{p}.ln_2.weight"), &[h]);
                b.param(format!("{p}.ln_2.bias"), &[h]);
                b.param(format!("{p}.mlp.fc.weight"), &[inter, h]);
                b.param(format!("{p}.mlp.fc.bias"), &[inter]);
                b.param(format!("{p}.mlp.proj.weight"), &[h, inter]);
                b.param(format!("{p}.mlp.proj.bias"), &[h]);
            }
            b.block("head".into(), false);
            b.param("ln_f.weight".into(), &[h]);
            b.param("ln_f.bias".into(), &[h]);
            b.reuse("wte");
        }
        Arch::Llama => {
            b.block("embed".into(), false);
            b.param("embed_tokens".into(), &[vocab, h]);
            for l in 0..shape.layers {
                let p = format!("layers.{l}");
                b.block(p.clone(), true);
                b.param(format!("{p}.input_layernorm.weight"), &[h]);
                let a = format!("{p}.self_attn");
                b.projection(&a, "q", h, h);
                b.projection(&a, "k", kv, h);
                b.projection(&a, "v", kv, h);
                b.projection(&a, "o", h, h);
                b.param(format!("{p}.post_attention_layernorm.weight"), &[h]);
                b.param(format!("{p}.mlp.gate.weight"), &[inter, h]);
                b.param(format!("{p}.mlp.up.weight"), &[inter, h]);
                b.param(format!("{p}.mlp.down.weight"), &[h, inter]);
            }
            b.block("head".into(), false);
            b.param("norm.weight".into(), &[h]);
            b.param("lm_head.weight".into(), &[vocab, h]);
        }
    }
}
