//! The one error type of the crate: a candle, chunk-store, optimizer or checkpoint
//! failure, or a parameter the glue does not know.

use tidestore_chunk::ChunkError;
use tidestore_optimizer::OptimError;

/// Everything that can go wrong between candle and tidestore.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A candle operation failed (forward, backward, a tensor copy).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The chunk store refused or failed (budgets, I/O, illegal state transition).
    #[error("chunk store: {0}")]
    Chunk(#[from] ChunkError),
    /// The optimizer refused or failed.
    #[error("optimizer: {0}")]
    Optim(#[from] OptimError),

    /// The step loop refused or failed.
    #[error(transparent)]
    Train(#[from] tidestore_train::TrainError),
    /// A parameter name that was never registered.
    #[error("unknown parameter `{name}`")]
    UnknownParam {
        /// The name asked for.
        name: String,
    },
    /// Two parameters with one name, or a value whose length does not match its shape.
    #[error("parameter `{name}`: {reason}")]
    BadParam {
        /// The parameter.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A checkpoint could not be written or read.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The checkpoint file.
        path: std::path::PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
