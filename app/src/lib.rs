//! The `tidestore` application: the binary's commands and everything only they use,
//! over the `tidestore` library (configuration, errors, a store opened from a
//! configuration), which depends on none of this crate's command-line, plotting or
//! model-framework crates.
//!
//! - [`cli`]: the command-line surface (clap), one module per command;
//! - [`bench`]: warm-up plus N iterations of forward, backward and optimizer step through
//!   the real store and the real optimizer, measured; with the `cuda` feature on a GPU
//!   its tensors are read and written there by the kernels of `gpu`;
//! - [`plan`]: where each chunk list goes on a given machine, and the projected step;
//! - [`finetune`]: a Hugging Face LLaMA-family model fine-tuned through the store with
//!   candle (the `[train]` section);
//! - [`scratch`]: per-run scratch folders and their clean-up; [`loss_plot`]: SVG plots.
//!
//! Only [`cli`] prints; everything else logs with `tracing`.

// `unsafe` only where it is allowed by name: the GPU module (FFI to CUDA) and the few
// libc calls of the command line (signal handlers, malloc tuning), each in a small
// function with its contract.
#![deny(unsafe_code)]

pub mod bench;
pub mod cli;
pub mod error;
pub mod finetune;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod loss_plot;
pub mod plan;
pub mod ranks;
pub mod scratch;

pub use error::{Error, Result};
