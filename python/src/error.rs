//! The one error type of the Python extension, and how each becomes a Python exception.
//!
//! Rust errors keep their message word for word (the key, tensor or file they name);
//! only the exception class is chosen here, from what went wrong:
//! - bad input or configuration (a wrong `states`, an unwritable `nvme_dir`, a budget
//!   the store cannot work in, a buffer of the wrong size) -> `tidestore.ConfigError`,
//!   a `ValueError`;
//! - an I/O failure anywhere in the chain (EIO, ENOSPC, a short read past the end of a
//!   file) -> `tidestore.IoError`, an `OSError` carrying the errno where there is one
//!   (EIO for a read the file ends before);
//! - everything else (a corrupt checkpoint, a poisoned step loop, a protocol misuse)
//!   -> `tidestore.TidestoreError`, a `RuntimeError`.

use std::error::Error as StdError;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::PyErr;
use tidestore_train::aio::IoError;
use tidestore_train::ChunkError;
use tidestore_train::OptimError;
use tidestore_train::TrainError;

pyo3::create_exception!(
    _tidestore,
    TidestoreError,
    PyRuntimeError,
    "A failure inside tidestore's store, step loop or checkpoint code."
);
pyo3::create_exception!(
    _tidestore,
    ConfigError,
    PyValueError,
    "A bad argument, configuration value or budget; nothing was changed."
);
pyo3::create_exception!(
    _tidestore,
    TidestoreIoError,
    PyOSError,
    "An I/O failure (EIO, ENOSPC, a short read or write); errno set where known."
);

/// Errors of the extension.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument the caller passed is wrong; `what` names it.
    #[error("{what}: {reason}")]
    BadInput { what: String, reason: String },
    /// From the step loop and checkpoints.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// From the optimizer (hyper-parameters).
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// From the I/O engine, with the file it was working on.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: IoError,
    },
    /// A use of an object in the wrong order (a step without gradients, ...).
    #[error("{0}")]
    Protocol(String),
    /// A file-system call on `path` (making a run's swap directory).
    #[error("{path}: {source}")]
    Os {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// From the TOML configuration file (its key, line and column named).
    #[error(transparent)]
    Config(#[from] tidestore::error::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn bad(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::BadInput {
            what: what.into(),
            reason: reason.into(),
        }
    }
}

/// What kind of Python exception an error becomes.
#[derive(Debug, PartialEq, Eq)]
enum Class {
    Config,
    Io(Option<i32>),
    Other,
}

/// The class of `err`: first from the variants wrapped transparently (whose `source()`
/// skips them), then from the first I/O error down the chain of causes.
fn classify(err: &Error) -> Class {
    let direct = match err {
        Error::BadInput { .. } => Some(Class::Config),
        Error::Protocol(_) => Some(Class::Other),
        Error::Optim(o) => optim_class(o),
        Error::Train(t) => train_class(t),
        Error::Io { source, .. } => Some(io_class(source)),
        Error::Os { source, .. } => Some(Class::Io(source.raw_os_error())),
        Error::Config(c) => config_class(c),
    };
    direct.unwrap_or_else(|| chain_class(err))
}

fn config_class(e: &tidestore::error::Error) -> Option<Class> {
    use tidestore::error::Error as E;
    match e {
        E::ConfigRead { .. } | E::Syntax { .. } | E::Config { .. } => Some(Class::Config),
        E::Train(t) => train_class(t),
        _ => None,
    }
}

fn optim_class(e: &OptimError) -> Option<Class> {
    matches!(e, OptimError::InvalidParam { .. }).then_some(Class::Config)
}

fn chunk_class(e: &ChunkError) -> Option<Class> {
    matches!(
        e,
        ChunkError::BudgetTooSmall { .. }
            | ChunkError::ModelTooLarge { .. }
            | ChunkError::Config { .. }
            | ChunkError::TensorTooLarge { .. }
            | ChunkError::InvalidChunkSize { .. }
    )
    .then_some(Class::Config)
}

fn train_class(e: &TrainError) -> Option<Class> {
    match e {
        TrainError::Config { .. } | TrainError::Argument { .. } => Some(Class::Config),
        TrainError::Store(c) => chunk_class(c),
        TrainError::Optim(o) => optim_class(o),
        _ => None,
    }
}

fn io_class(e: &IoError) -> Class {
    match e {
        IoError::Config { .. } => Class::Config,
        IoError::NoSpace { .. } => Class::Io(Some(libc::ENOSPC)),
        // The file ends before the transfer does. No errno means "end of file"; EIO is
        // the closest, and the class promises an errno for every I/O failure.
        IoError::UnexpectedEof { .. } => Class::Io(Some(libc::EIO)),
        IoError::Device { source, .. } | IoError::Setup { source, .. } => {
            Class::Io(source.raw_os_error())
        }
        _ => Class::Io(None),
    }
}

/// The first I/O error among `err`'s causes decides; otherwise `Other`.
fn chain_class(err: &Error) -> Class {
    let mut cur: Option<&(dyn StdError + 'static)> = err.source();
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<IoError>() {
            return io_class(io);
        }
        if let Some(os) = e.downcast_ref::<std::io::Error>() {
            return Class::Io(os.raw_os_error());
        }
        cur = e.source();
    }
    Class::Other
}

/// The error's message with every cause its text does not already contain.
pub fn message(err: &Error) -> String {
    let mut msg = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let part = e.to_string();
        if !msg.contains(&part) {
            msg.push_str(": ");
            msg.push_str(&part);
        }
        cur = e.source();
    }
    msg
}

impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        let msg = message(&err);
        match classify(&err) {
            Class::Config => ConfigError::new_err(msg),
            Class::Io(Some(errno)) => TidestoreIoError::new_err((errno, msg)),
            Class::Io(None) => TidestoreIoError::new_err(msg),
            Class::Other => TidestoreError::new_err(msg),
        }
    }
}
