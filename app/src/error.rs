//! The one error type of the application crate (the commands, the bench, `finetune`).
//!
//! Invariant: [`Error::exit_code`] is 2 exactly when the user's configuration or flags
//! are at fault (the message then names the key or flag), 1 otherwise. Errors of the
//! library (configuration, the layers below) are kept whole in [`Error::Tidestore`], so
//! their key, file and line survive.

use std::path::PathBuf;

/// Everything the `tidestore` binary can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Configuration, store, optimizer, step-loop and I/O errors (the library's).
    #[error(transparent)]
    Tidestore(#[from] tidestore::Error),

    /// A model's forward or backward in candle failed, or the candle glue refused (the
    /// step loop's errors it passes on go through the library, see the `From`).
    #[error(transparent)]
    Candle(tidestore_candle::Error),

    /// The bench's GPU kernels could not be built (NVRTC version and log).
    #[error("GPU kernels: NVRTC {nvrtc}: {reason}")]
    KernelBuild {
        /// The NVRTC version, for the report.
        nvrtc: String,
        /// Why, with the compiler's log.
        reason: String,
    },

    /// The emulated training iteration went wrong (a result that cannot be, a bound).
    #[error("bench: {0}")]
    Bench(String),

    /// `io-bench` itself went wrong (a request lost, a file that cannot be removed).
    #[error("io-bench: {0}")]
    IoBench(String),

    /// The fine-tuning run could not go on (its data, its model, its outputs).
    #[error("finetune: {0}")]
    Finetune(String),

    /// A record of a fine-tuning data file is unusable: a line that is not JSON, lacks
    /// its field, or holds a conversation the chat template cannot render.
    #[error("training data {}{}: {reason}", path.display(), line.map_or(String::new(), |l| format!(":{l}")))]
    Data {
        /// The data file.
        path: PathBuf,
        /// The 1-based line, where the problem is one line's.
        line: Option<usize>,
        /// What is wrong.
        reason: String,
    },

    /// A command-line value that is well-formed but impossible.
    #[error("invalid value for {flag}: {reason}")]
    Usage {
        /// The flag as written (`--threads`).
        flag: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// fio is missing, failed, or printed something we cannot read.
    #[error("fio: {0}")]
    Fio(String),

    /// An output file (the plot, the JSON) could not be written.
    #[error("{what} {}: {reason}", path.display())]
    Output {
        /// What the file is (`--plot`).
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why not.
        reason: String,
    },
}

/// `Result` with [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The layers' errors reach the application through the library's [`tidestore::Error`],
/// which maps each to its variant (a bad setting to `Config`, naming the key).
macro_rules! through_library {
    ($($t:ty),* $(,)?) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Self {
                Error::Tidestore(e.into())
            }
        }
    )*};
}

through_library!(
    tidestore::io::IoError,
    tidestore::tiers::TierError,
    tidestore::chunk::ChunkError,
    tidestore::optimizer::OptimError,
    tidestore::train::TrainError,
);

impl From<tidestore_candle::Error> for Error {
    /// The trainer's errors candle passes on are the library's (a bad setting a config
    /// error naming its key); candle's own stay [`Error::Candle`].
    fn from(e: tidestore_candle::Error) -> Self {
        match e {
            tidestore_candle::Error::Train(e) => e.into(),
            e => Error::Candle(e),
        }
    }
}

impl Error {
    /// A configuration error for `key` (the library's `Config`, with no location yet).
    pub fn config(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Tidestore(tidestore::Error::config(key, reason))
    }

    /// [`Error::Output`] about the file at `path` (`what`: what could not be done with
    /// it), as a function of the reason (for `map_err`).
    pub(crate) fn output<'p>(
        what: &'static str,
        path: &'p std::path::Path,
    ) -> impl Fn(String) -> Self + 'p {
        move |reason| Error::Output {
            what,
            path: path.to_path_buf(),
            reason,
        }
    }

    /// The configuration key this error is about, if it is about one.
    pub fn key(&self) -> Option<&str> {
        match self {
            Error::Tidestore(e) => e.key(),
            _ => None,
        }
    }

    /// Whether the user's configuration is at fault (its key named in the message).
    pub fn is_config(&self) -> bool {
        matches!(self, Error::Tidestore(e) if e.is_config())
    }

    /// The message on one line (its lines trimmed and joined with `; `), as the binary
    /// prints it after `error: `.
    pub fn one_line(&self) -> String {
        let message = self.to_string();
        let lines: Vec<&str> = message.lines().map(str::trim).collect();
        lines.join("; ")
    }

    /// 2 for the user's configuration or flags, 1 for everything else.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Usage { .. } => 2,
            e if e.is_config() => 2,
            _ => 1,
        }
    }
}
