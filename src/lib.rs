//! tidestore: a three-tier (GPU / pinned host / NVMe) storage engine for training state.
//!
//! This facade crate ties the layers together behind one configuration and one error
//! type: [`Config`] is read from a `tidestore.toml` (unknown keys and impossible values
//! are errors naming the key), and [`Error`] wraps the errors of every layer below. The
//! layers are re-exported under their own names ([`io`], [`tiers`], [`chunk`],
//! [`optimizer`]). On top of them:
//! - [`workload`]: the tensors of GPT-2, GPT-2 XL, LLaMA 7B/13B/70B or a custom shape,
//!   fully fine-tuned or with LoRA;
//! - [`session`]: a chunk store opened for a workload from the config, with every
//!   up-front check mapped to the config key at fault;
//! - [`bench`]: warm-up plus N iterations of forward, backward and optimizer step
//!   through the real store and the real optimizer, measured; with the `cuda` feature
//!   on a GPU its tensors are read and written there by the kernels of `gpu`;
//! - [`plan`]: where each chunk list goes on a given machine, and the projected step.
//!
//! Nothing here prints; the `tidestore` binary does, and everything else is logged with
//! `tracing`.

// `unsafe` only in the GPU module (FFI to CUDA, each call in a small function with its
// contract); without the `cuda` feature the crate has none at all.
#![cfg_attr(not(feature = "cuda"), forbid(unsafe_code))]
#![cfg_attr(feature = "cuda", deny(unsafe_code))]

pub mod bench;
pub mod config;
pub mod error;
pub mod finetune;
#[cfg(feature = "cuda")]
pub mod gpu;
#[cfg(feature = "cli")]
pub mod loss_plot;
pub mod plan;
pub mod scratch;
pub mod session;
pub mod workload;

pub use config::{
    AutoSize, ChunkSection, Config, DeviceSection, EngineName, HostSection, IoSection, NvmeSection,
    OptimizerSection, PolicySection, Size,
};
pub use error::{Error, Location, Result};
pub use tidestore_chunk as chunk;
pub use tidestore_io as io;
pub use tidestore_optimizer as optimizer;
pub use tidestore_tiers as tiers;
pub use tidestore_train as train;
pub use workload::{Workload, WorkloadSection};
