//! The one error type of the io crate.
//!
//! Every variant carries the context a user needs to act on it: the operation, the file
//! offset and length, the chunk and slot, or the configuration key that was wrong.
//! Errors never name the types of the backends (io-uring, libc) in their public shape.

use std::path::PathBuf;

/// Which kind of operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Read,
    Write,
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
        })
    }
}

/// Errors of the io crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    /// A configuration value is out of range; `key` names it as it is written in TOML.
    #[error("invalid config `{key}`: {reason}")]
    Config { key: &'static str, reason: String },

    /// The device or file returned an error for one request.
    #[error("{op} of {len_bytes} bytes at offset {offset_bytes} failed: {source}")]
    Device {
        op: Op,
        offset_bytes: u64,
        len_bytes: usize,
        #[source]
        source: std::io::Error,
    },

    /// The device kept returning zero bytes: the file ends before the request does.
    #[error("{op} at offset {offset_bytes}: end of file with {remaining_bytes} bytes still to go")]
    UnexpectedEof {
        op: Op,
        offset_bytes: u64,
        remaining_bytes: usize,
    },

    /// The device has no space for the write (ENOSPC).
    #[error("no space left on device writing {len_bytes} bytes at offset {offset_bytes}")]
    NoSpace { offset_bytes: u64, len_bytes: usize },

    /// A request is malformed: unaligned offset or length, buffer too small, past the end.
    #[error("invalid request: {reason}")]
    InvalidRequest { reason: String },

    /// A chunk read back does not match the checksum it was written with.
    #[error(
        "chunk {chunk} in slot {slot} is corrupt: crc32c {found:#010x}, expected {expected:#010x}"
    )]
    Corrupt {
        chunk: u64,
        slot: u32,
        expected: u32,
        found: u32,
    },

    /// A chunk was asked for that the swap file does not hold.
    #[error("chunk {chunk} is not in the swap file")]
    UnknownChunk { chunk: u64 },

    /// Every slot of the swap file is taken.
    #[error("swap file is full: all {slots} slots are taken (chunk {chunk} needs one)")]
    SwapFull { chunk: u64, slots: u32 },

    /// A chunk is larger than a slot.
    #[error("chunk {chunk} is {len_bytes} bytes, larger than a slot ({slot_bytes} bytes)")]
    ChunkTooLarge {
        chunk: u64,
        len_bytes: usize,
        slot_bytes: usize,
    },

    /// An earlier write or sync failed; the file refuses writes until it is reopened.
    #[error("swap file {path} refuses writes after an earlier failure: {first_error}")]
    Poisoned { path: PathBuf, first_error: String },

    /// The swap file on disk is not one of ours or is of another version or shape.
    #[error("swap file {path}: {reason}")]
    BadHeader { path: PathBuf, reason: String },

    /// Setting up a file, directory, ring or buffer pool failed.
    #[error("{what} {path}: {source}")]
    Setup {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The buffer pool could not be allocated or has no buffer of the size asked.
    #[error("buffer pool: {reason}")]
    Pool { reason: String },

    /// Compression or decompression of a chunk failed.
    #[error("chunk {chunk}: {reason}")]
    Compression { chunk: u64, reason: String },
}

pub type Result<T, E = IoError> = std::result::Result<T, E>;

impl IoError {
    /// Build the typed error for a failed piece of a request from a raw `-errno`.
    pub(crate) fn from_errno(op: Op, offset_bytes: u64, len_bytes: usize, errno: i32) -> Self {
        if errno == libc::ENOSPC {
            IoError::NoSpace {
                offset_bytes,
                len_bytes,
            }
        } else {
            IoError::Device {
                op,
                offset_bytes,
                len_bytes,
                source: std::io::Error::from_raw_os_error(errno),
            }
        }
    }

    pub(crate) fn config(key: &'static str, reason: impl Into<String>) -> Self {
        IoError::Config {
            key,
            reason: reason.into(),
        }
    }
}
