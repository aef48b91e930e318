//! The one error type of the facade crate.
//!
//! A bad configuration is always [`Error::Config`] (or [`Error::Syntax`] for TOML that
//! does not parse): it names the key as the user wrote it (`io.block_size`), the reason,
//! and where it is known the file, line and column. Errors of the layers below are wrapped
//! whole, so their context (op, offset, chunk, slot) survives; an invalid value the io
//! crate finds is turned into [`Error::Config`] too, so callers have one place to look.

use std::fmt;
use std::path::PathBuf;

use tidestore_io::IoError;

/// Where in a configuration file a problem is: the file, and the line and column (both
/// 1-based) where the TOML parser pointed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Location {
    pub file: Option<PathBuf>,
    pub line_column: Option<(usize, usize)>,
}

impl fmt::Display for Location {
    /// `file:line:column: `, `file: `, `line L, column C: ` or nothing, ready to prefix a
    /// message.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.file, self.line_column) {
            (Some(file), Some((line, column))) => {
                write!(f, "{}:{line}:{column}: ", file.display())
            }
            (Some(file), None) => write!(f, "{}: ", file.display()),
            (None, Some((line, column))) => write!(f, "line {line}, column {column}: "),
            (None, None) => Ok(()),
        }
    }
}

/// Errors of the `tidestore` crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration file could not be read.
    #[error("cannot read config {}: {source}", path.display())]
    ConfigRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The configuration file is not valid TOML.
    #[error("{at}invalid TOML: {message}")]
    Syntax { at: Location, message: String },

    /// A configuration value is missing, unknown, of the wrong type or out of range.
    /// `key` is the dotted TOML path (`io.queue_depth`) or, for values given on the
    /// command line, the flag.
    #[error("{at}invalid config `{key}`: {reason}")]
    Config {
        at: Location,
        key: String,
        reason: String,
    },

    /// An error of the io layer (device errors, corrupt chunks, setup failures).
    #[error(transparent)]
    Io(#[from] IoError),

    /// An error of the tiers (a missing GPU, an allocation that failed).
    #[error(transparent)]
    Tier(#[from] tidestore_tiers::TierError),

    /// An error of the chunk store while running (I/O, a store invariant).
    #[error(transparent)]
    Store(#[from] tidestore_chunk::ChunkError),

    /// An error of the optimizer.
    #[error("optimizer: {0}")]
    Optimizer(#[from] tidestore_optimizer::OptimError),

    /// An error of the step loop or a checkpoint.
    #[error(transparent)]
    Train(tidestore_train::TrainError),
}

impl From<tidestore_train::TrainError> for Error {
    /// The layers' errors keep their own variants; a bad setting is [`Error::Config`].
    fn from(e: tidestore_train::TrainError) -> Self {
        use tidestore_train::TrainError;
        match e {
            TrainError::Config { key, reason } => Error::config(config_key(key), reason),
            TrainError::Store(e) => Error::Store(e),
            TrainError::Optim(e) => Error::Optimizer(e),
            other => Error::Train(other),
        }
    }
}

/// The configuration key behind a trainer setting's name (the trainer names its own
/// fields; the user wrote the TOML's).
fn config_key(trainer_key: &'static str) -> &'static str {
    match trainer_key {
        "chunk_elements" => "chunk.size",
        "lora.r" => "train.lora_rank",
        "lora.alpha" => "train.lora_alpha",
        "lora.targets" => "train.lora_targets",
        key => key,
    }
}

/// `Result` with [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A configuration error for `key` with no location yet.
    pub fn config(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Config {
            at: Location::default(),
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// The configuration key this error is about, if it is about one.
    pub fn key(&self) -> Option<&str> {
        match self {
            Error::Config { key, .. } => Some(key),
            Error::Io(IoError::Config { key, .. }) => Some(key),
            _ => None,
        }
    }

    /// Whether the error is the user's configuration (unreadable, malformed or invalid)
    /// rather than something that went wrong while running.
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            Error::ConfigRead { .. }
                | Error::Syntax { .. }
                | Error::Config { .. }
                | Error::Io(IoError::Config { .. })
        )
    }

    /// Attach the configuration file's name to a configuration error that has none.
    pub(crate) fn in_file(mut self, path: &std::path::Path) -> Self {
        if let Error::Syntax { at, .. } | Error::Config { at, .. } = &mut self {
            if at.file.is_none() {
                at.file = Some(path.to_path_buf());
            }
        }
        self
    }
}

/// Turn the io crate's invalid-value error into [`Error::Config`]; pass others through.
pub(crate) fn from_io_validation(e: IoError) -> Error {
    match e {
        IoError::Config { key, reason } => Error::config(key, reason),
        other => Error::Io(other),
    }
}
