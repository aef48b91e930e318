//! Hugging Face formats, framework-free: a LLaMA's `config.json`, its tensor names in
//! forward order, import of its safetensors weights into a [`tidestore_chunk::ChunkStore`]
//! and export back (full, merged, or LoRA adapters in PEFT's layout), a random-weight
//! model directory for tests, and its tokenizer.
//!
//! The usual flow, as the `finetune` command drives it:
//! ```text
//! let cfg = LlamaConfig::load(dir)?;                  // config.json, checked
//! let blocks = llama_blocks(&cfg, lora.as_ref())?;    // register these, in order
//! let mut store = /* open a ChunkStore over the blocks' tensors */;
//! import(dir, &cfg, &mut store, lora.as_ref(), seed)?;
//! let tok = Tokenizer::for_model(dir)?;
//! let text = read_text(text_path)?;
//! /* train */
//! export_model(&mut store, &cfg, lora.as_ref(), out, &ExportOptions::default())?;
//! export_adapter(&mut store, &cfg, &lora, out, DType::F32, "base")?; // LoRA only
//! ```
//!
//! One concept per file: [`config`], [`names`], [`import`](mod@import), [`export`], [`peft`],
//! [`init`], [`tokenizer`], [`chat`], [`rope`]. Every refusal is a [`crate::TrainError`] naming the file and
//! the tensor or key.

pub mod chat;
pub mod config;
pub mod export;
pub mod files;
pub mod import;
pub mod init;
pub mod names;
pub mod peft;
pub mod rng;
pub mod rope;
pub mod shards;
pub mod tokenizer;

pub use chat::{ChatTemplate, Message, Rendered, TokenizerConfig};
pub use config::{Family, LlamaConfig, LlamaShape, CONFIG_FILE, NEUTRAL_KEYS, USED_KEYS};
pub use export::{
    export_model, export_model_from, export_tensors, export_tensors_from, merge_into,
    ExportOptions, ReadTensor,
};
pub use files::{ADAPTER_CONFIG_FILE, ADAPTER_FILE, COPIED_FILES, INDEX_FILE, SINGLE_FILE};
pub use import::{import, HfWeights, ImportReport};
pub use init::{init_model, InitOptions};
pub use names::{
    base_tensors, llama_blocks, llama_tensors, lora_adapters, Adapter, BlockKind, BlockSpec,
    LoraSpec, LoraTarget,
};
pub use peft::{adapter_config, export_adapter, export_adapter_from, peft_key};
pub use rng::SplitMix64;
pub use rope::{Rope, RopeScaling};
pub use shards::{ExportReport, DEFAULT_MAX_SHARD_BYTES};
pub use tokenizer::{read_text, Tokenizer, TOKENIZER_FILE};
