//! tidestore: a three-tier (GPU / pinned host / NVMe) storage engine for training state —
//! the library.
//!
//! This crate ties the layers together behind one configuration and one error type:
//! [`Config`] is read from a `tidestore.toml` (unknown keys and impossible values are
//! errors naming the key), and [`Error`] wraps the errors of every layer below. The
//! layers are re-exported under their own names ([`dtype`], [`io`], [`tiers`], [`chunk`],
//! [`optimizer`], [`train`]). On top of them:
//! - [`workload`]: the tensors of GPT-2, GPT-2 XL, LLaMA 7B/13B/70B or a custom shape,
//!   fully fine-tuned or with LoRA — what the config's `[workload]` section describes;
//! - [`session`]: a chunk store opened for a workload from the config, with every
//!   up-front check mapped to the config key at fault.
//!
//! Where the seam is: this crate is what a program that embeds the store needs, and it
//! depends on no command-line, plotting or model-framework crate. The `tidestore` binary
//! and everything only it uses — the commands, the bench's emulated iteration and its
//! report, `plan`, `finetune` over candle models, the bench's GPU kernels, plots — are the
//! application crate `tidestore-app` (`app/`), built on this one. `workload` and
//! `session` stay here because opening a store from a configuration needs the tensors
//! its `[workload]` section names; the `[train]` section is configuration too
//! ([`config::TrainSection`]), read and checked here, run by the application.
//!
//! Nothing here prints; everything is logged with `tracing`.

#![forbid(unsafe_code)]

pub mod config;
pub mod error;
pub mod session;
pub mod workload;

pub use config::{
    AutoSize, ChunkSection, Config, DeviceSection, EngineName, HostSection, IoSection, NvmeSection,
    OptimizerSection, PolicySection, Size,
};
pub use error::{Error, Location, Result};
pub use tidestore_chunk as chunk;
pub use tidestore_dtype as dtype;
pub use tidestore_io as io;
pub use tidestore_optimizer as optimizer;
pub use tidestore_tiers as tiers;
pub use tidestore_train as train;
pub use workload::{Workload, WorkloadSection};
