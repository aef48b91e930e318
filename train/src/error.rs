//! The one error type of the train crate.
//!
//! Errors of the layers below (the chunk store, the optimizer, file I/O) are wrapped with
//! what was being done; errors of this crate's own checks name the tensor, file or key at
//! fault. Nothing here panics on bad input.

use std::path::PathBuf;

use tidestore_chunk::ChunkError;
use tidestore_optimizer::OptimError;

/// Errors of the train crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// The chunk store refused or failed.
    #[error(transparent)]
    Store(#[from] ChunkError),

    /// The optimizer refused or failed.
    #[error(transparent)]
    Optim(#[from] OptimError),

    /// A file could not be read or written.
    #[error("{op} `{path}`: {source}")]
    Io {
        /// What was being done (`creating`, `reading`, `renaming`, ...).
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// A setting that cannot work, named as the caller's configuration names it.
    #[error("invalid config `{key}`: {reason}")]
    Config {
        /// The key (`optimizer.overlap`, ...).
        key: &'static str,
        /// Why, with the numbers.
        reason: String,
    },

    /// A tensor of the step (or a checkpoint) that does not fit what the store holds.
    #[error("tensor `{tensor}`: {reason}")]
    Tensor {
        /// The tensor's name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },

    /// The step loop was driven out of order (a tensor stepped twice in one step, a
    /// step finished with tensors left, ...).
    #[error("step loop: {0}")]
    Protocol(String),
}

/// The result type of this crate.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
