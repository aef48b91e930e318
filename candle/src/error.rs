//! The one error type of the crate: a candle failure, a trainer failure (the store,
//! the optimizer, the step loop, a checkpoint file), or a parameter the glue does not
//! know.

/// Everything that can go wrong between candle and tidestore.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A candle operation failed (forward, backward, a tensor copy).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The trainer refused or failed: the store (budgets, I/O), the optimizer, the step
    /// loop, a checkpoint file.
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
    /// The CBLAS library named by `TIDESTORE_BLAS` cannot be opened or lacks
    /// `cblas_sgemm`.
    #[error("blas: {0}")]
    Blas(String),
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
