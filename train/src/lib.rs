//! tidestore-train: training over a tidestore chunk store.
//!
//! The layers below keep tensors in chunks ([`tidestore_chunk::ChunkStore`]) and step
//! AdamW over slices ([`tidestore_optimizer`], pure compute). This crate is where the two
//! meet, once: the step loop that steps each tensor's groups where the store holds them,
//! and the checkpoints streamed out of the store and back; and the Hugging Face formats
//! a model comes in and goes out in ([`hf`]). It knows no framework: the
//! benchmark, the candle glue and a library user drive the same loop.
//!
//! Every fallible function returns [`TrainError`], the one error type of the crate.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod checkpoint;
pub mod checkpoint_dir;
pub mod error;
pub mod hf;
pub mod step;

pub use checkpoint::{CheckpointState, FileTensor, CHECKPOINT_FORMAT};
pub use checkpoint_dir::CheckpointDir;
pub use error::{Result, TrainError};
pub use step::{
    GradPlace, Observer, Overlap, StepConfig, StepLoop, StepOutcome, StepPlace, StepStats,
    StepTensor,
};
