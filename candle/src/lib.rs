//! tidestore-candle: a candle model whose parameters, gradients, fp32 master weights and
//! Adam moments live in tidestore's chunk store, stepped by tidestore's AdamW.
//!
//! - [`source`]: [`ParamSource`], how a layer asks for its parameters right before it
//!   runs, and [`InMemory`], the plain-candle source (the baseline for `candle_nn::AdamW`).
//! - [`tide`]: [`TideParams`], the tidestore source: a [`tidestore_train::Trainer`]
//!   (the one place where training meets the store: layout, budgets, gradients, the
//!   step) on one side, candle tensors on the other. Its module doc lists every copy the
//!   glue makes.
//! - [`blas`]: the decoder's matrix products through OpenBLAS where it is installed
//!   (loaded at run time), else candle's matmul.
//! - [`checkpoint`]: save/load in tidestore's one checkpoint format (the trainer's),
//!   and [`checkpoint::read_params`].
//! - [`gpt`]: a small byte-level GPT (with optional LoRA) written against
//!   [`ParamSource`], its seeded initialisation and seeded batches.
//! - [`llama`]: LLaMA as Hugging Face's `LlamaForCausalLM` (RMSNorm, rotary embeddings,
//!   grouped-query attention, SwiGLU, tied or untied head, optional LoRA), in blocks.
//! - [`streamed`]: [`Llama`] as the train crate's [`tidestore_train::Blocks`], for its
//!   layer-streamed driver ([`train_step`]): one block's parameters and graph in candle
//!   at a time, the store the only home of the rest.
//!
//! Numerics: with [`Precision::F32`] both sides compute in fp32 from the same values,
//! and tidestore's AdamW is candle's formula — `m̂ = m / (1 - β1^t)`,
//! `v̂ = v / (1 - β2^t)`, `p ← p (1 - lr wd) - lr m̂ / (sqrt(v̂) + eps)`, eps outside the
//! square root, decay decoupled — evaluated in another order (the bias corrections
//! folded into the step size and `1/sqrt(1 - β2^t)`, fused multiply-adds), so the two
//! agree to f32 rounding per step (see `tests/candle_parity.rs`).
//!
//! This crate imports the train crate only (and the types it re-exports), never the
//! store's crates: what it knows of the store is what a [`tidestore_train::Trainer`]
//! offers.
//!
//! Weaknesses: with the full graph ([`TideParams::backward`]) candle's autograd keeps
//! every parameter it was handed alive until the graph is dropped, so candle memory
//! holds a full copy of the parameters (the layer-streamed driver holds one block's).
//! On a CUDA device tier the glue reads parameters from the host pool, not the GPU
//! copy: candle 0.11 builds device tensors from host memory here.
//!
//! Nothing here prints; it logs through `tracing`.

pub mod blas;
pub mod checkpoint;
#[cfg(feature = "gpu")]
mod cuda;
mod decoder;
pub mod error;
pub mod gpt;
pub mod llama;
pub mod source;
pub mod streamed;
pub mod tide;

pub use error::{Error, Result};
pub use gpt::{Batches, Gpt, GptConfig, LoraConfig};
pub use llama::{Llama, LlamaArch, LlamaConfig, LlamaLora, IGNORE_TARGET};
pub use source::{InMemory, ParamSource, ParamSpec};
pub use streamed::InMemoryTraining;
pub use tide::{Precision, TideConfig, TideParams};
pub use tidestore_train::{
    train_step, Budget, NvmeTraffic, StepTimes, StreamedStep, TrainerConfig,
};
