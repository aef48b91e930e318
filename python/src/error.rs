//! The one error type of the Python extension, and how each becomes a Python exception.
//!
//! Rust errors keep their message word for word (the key, tensor or file they name);
//! only the exception class is chosen here, from what went wrong:
//! - bad input or configuration (a wrong `states`, an unwritable `nvme_dir`, a budget
//!   the store cannot work in, a buffer of the wrong size) -> `tidestore.ConfigError`,
//!   a `ValueError`;
//! - an I/O failure anywhere in the chain (EIO, ENOSPC, a short read past the end of a
//!   file) -> `tidestore.IoError`, an `OSError` carrying the errno where there is one;
//! - everything else (a corrupt checkpoint, a poisoned step loop, a protocol misuse)
//!   -> `tidestore.TidestoreError`, a `RuntimeError`.

use std::error::Error as StdError;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::PyErr;
use tidestore_chunk::ChunkError;
use tidestore_io::IoError;
use tidestore_optimizer::OptimError;
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
    /// From the chunk store.
    #[error(transparent)]
    Store(#[from] ChunkError),
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

fn classify(err: &Error) -> Class {
    match err {
        Error::BadInput { .. } => return Class::Config,
        Error::Protocol(_) => return Class::Other,
        _ => {}
    }
    let mut class = Class::Other;
    let mut cur: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<IoError>() {
            class = match io {
                IoError::Config { .. } => Class::Config,
                IoError::NoSpace { .. } => Class::Io(Some(libc::ENOSPC)),
                IoError::UnexpectedEof { .. } => Class::Io(None),
                _ => Class::Io(None),
            };
        } else if let Some(os) = e.downcast_ref::<std::io::Error>() {
            if let Class::Io(None) | Class::Other = class {
                class = Class::Io(os.raw_os_error());
            }
        } else if let Some(c) = e.downcast_ref::<ChunkError>() {
            if matches!(
                c,
                ChunkError::BudgetTooSmall { .. }
                    | ChunkError::ModelTooLarge { .. }
                    | ChunkError::Config { .. }
            ) {
                return Class::Config;
            }
        } else if let Some(t) = e.downcast_ref::<TrainError>() {
            if matches!(t, TrainError::Config { .. }) {
                return Class::Config;
            }
        } else if let Some(OptimError::InvalidParam { .. }) = e.downcast_ref::<OptimError>()
        {
            return Class::Config;
        }
        cur = e.source();
    }
    class
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
