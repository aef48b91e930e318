//! tidestore-candle: a candle model whose parameters, gradients, fp32 master weights and
//! Adam moments live in tidestore's chunk store, stepped by tidestore's AdamW.
//!
//! - [`source`]: [`ParamSource`], how a layer asks for its parameters right before it
//!   runs, and [`InMemory`], the plain-candle source (the baseline for `candle_nn::AdamW`).
//! - [`tide`]: [`TideParams`], the tidestore source: registration into a chunk layout,
//!   access/copy/release per parameter in forward, gradients into the store after
//!   backward, the AdamW step over master, M and V wherever the budgets put them (NVMe
//!   included). Its module doc lists every copy the glue makes.
//! - [`checkpoint`]: save/load in tidestore's one checkpoint format (the train crate's:
//!   streamed from the store, crc32c per tensor, atomic), and [`checkpoint::read_params`].
//! - [`gpt`]: a small byte-level GPT (with optional LoRA) written against
//!   [`ParamSource`], its seeded initialisation and seeded batches.
//! - [`llama`]: LLaMA as Hugging Face's `LlamaForCausalLM` (RMSNorm, rotary embeddings,
//!   grouped-query attention, SwiGLU, tied or untied head, optional LoRA), in blocks.
//! - [`streamed`]: layer-streamed training with recompute over [`TideParams`]: one
//!   block's parameters and graph in candle at a time, the store the only home of the
//!   rest.
//!
//! Numerics: with [`Precision::F32`] both sides compute in fp32 from the same values,
//! and tidestore's AdamW is candle's formula — `m̂ = m / (1 - β1^t)`,
//! `v̂ = v / (1 - β2^t)`, `p ← p (1 - lr wd) - lr m̂ / (sqrt(v̂) + eps)`, eps outside the
//! square root, decay decoupled — evaluated in another order (the bias corrections
//! folded into the step size and `1/sqrt(1 - β2^t)`, fused multiply-adds), so the two
//! agree to f32 rounding per step (see `tests/candle_parity.rs`).
//!
//! Weaknesses: candle's autograd keeps every parameter it was handed alive until the
//! graph is dropped, so during forward/backward candle memory holds a full copy of the
//! parameters (tidestore bounds the master weights, M and V, 12 of the 16 bytes per
//! parameter). On a CUDA device tier the glue reads parameters from the host pool, not
//! the GPU copy: candle 0.11 builds device tensors from host memory here.
//!
//! Nothing here prints; it logs through `tracing`.

pub mod checkpoint;
pub mod error;
pub mod gpt;
pub mod llama;
pub mod source;
pub mod streamed;
pub mod tide;

pub use error::{Error, Result};
pub use gpt::{Batches, Gpt, GptConfig, LoraConfig};
pub use llama::{Llama, LlamaConfig, LlamaLora};
pub use source::{InMemory, ParamSource, ParamSpec};
pub use streamed::{train_step, StepTimes, StreamedStep};
pub use tide::{NvmeTraffic, Precision, TideConfig, TideParams};
