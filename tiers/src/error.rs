//! The one error type of the tiers crate.
//!
//! Every variant carries what a caller needs to act: the tier, the chunk, the bytes asked
//! for and the bytes there are. Backend errors (CUDA driver errors) are boxed, so the
//! public enum never names a cudarc type and compiles the same with or without the `cuda`
//! feature; io errors are wrapped with the tier and chunk they happened to.

#![deny(unsafe_code)]

use crate::copy::CopyId;
use crate::kind::TierKind;

/// A boxed backend error (CUDA driver errors, in practice).
pub type BoxedError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of the tiers crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TierError {
    /// A reservation does not fit in what is left of a tier's budget.
    #[error(
        "{tier} tier over budget: needs {needed_bytes} bytes, \
         {free_bytes} of {capacity_bytes} bytes free"
    )]
    OverBudget {
        tier: TierKind,
        needed_bytes: u64,
        free_bytes: u64,
        capacity_bytes: u64,
    },

    /// A budget was asked to shrink below what is reserved in it; `excess_bytes` must be
    /// evicted first.
    #[error(
        "{tier} tier cannot shrink to {capacity_bytes} bytes: {used_bytes} bytes are in use, \
         evict {excess_bytes} bytes first"
    )]
    ShrinkBelowUsed {
        tier: TierKind,
        capacity_bytes: u64,
        used_bytes: u64,
        excess_bytes: u64,
    },

    /// More bytes were released than are reserved (a bookkeeping bug in the caller); the
    /// budget is left unchanged.
    #[error("{tier} tier: releasing {released_bytes} bytes, but only {used_bytes} are reserved")]
    ReleaseExceedsUsed {
        tier: TierKind,
        released_bytes: u64,
        used_bytes: u64,
    },

    /// Every buffer of the pinned host pool is taken.
    #[error(
        "host tier exhausted: all {buffers} buffers of {buf_bytes} bytes are taken \
         (chunk {chunk} needs one)"
    )]
    HostPoolExhausted {
        chunk: u64,
        buffers: usize,
        buf_bytes: usize,
    },

    /// A budget too small to hold even one chunk.
    #[error(
        "{tier} tier: a budget of {capacity_bytes} bytes holds no chunk of {chunk_bytes} bytes"
    )]
    BudgetTooSmall {
        tier: TierKind,
        capacity_bytes: u64,
        chunk_bytes: u64,
    },

    /// A transfer is larger than the memory on one of its ends.
    #[error("{tier} tier: chunk {chunk} moves {len_bytes} bytes, more than the {limit_bytes} bytes there are")]
    TooLarge {
        tier: TierKind,
        chunk: u64,
        len_bytes: u64,
        limit_bytes: u64,
    },

    /// Zero bytes were asked of a tier (a caller's bug: chunks are never empty).
    #[error("chunk {chunk}: zero bytes asked of the {tier} tier")]
    ZeroBytes { tier: TierKind, chunk: u64 },

    /// The device itself has no room for an allocation (its memory is taken by chunks
    /// and by non-model memory such as activations), even though the budget had.
    #[error("device out of memory: chunk {chunk} needs {needed_bytes} bytes, {free_bytes} free on the device")]
    DeviceOutOfMemory {
        chunk: u64,
        needed_bytes: u64,
        free_bytes: u64,
    },

    /// The device budget asked for is more than the device has.
    #[error("device budget of {budget_bytes} bytes is more than the device's {total_bytes} bytes")]
    BudgetExceedsDevice { budget_bytes: u64, total_bytes: u64 },

    /// The device budget asked for is more than the device's chunk slab, the memory made
    /// for chunks when the device opened (`slab_bytes` in its config).
    #[error(
        "device budget of {budget_bytes} bytes is more than the chunk slab of {slab_bytes} bytes"
    )]
    BudgetExceedsSlab { budget_bytes: u64, slab_bytes: u64 },

    /// A configuration value out of range; `key` names it as written in TOML.
    #[error("invalid config `{key}`: {reason}")]
    Config { key: &'static str, reason: String },

    /// No usable CUDA driver or GPU (the normal case on machines without one).
    #[error("no CUDA GPU: {reason}")]
    NoGpu { reason: String },

    /// The `cuda` feature was not compiled in.
    #[error("this build has no CUDA support (build with the `cuda` feature)")]
    NotCompiledWithCuda,

    /// A CUDA driver call failed.
    #[error("CUDA {op} failed{}, {bytes} bytes: {source}", chunk_ctx(.chunk))]
    Cuda {
        op: &'static str,
        chunk: Option<u64>,
        bytes: u64,
        #[source]
        source: BoxedError,
    },

    /// A copy request that cannot run as asked (memory of another device, zero length).
    #[error("device copy {id} of chunk {chunk} refused: {reason}")]
    BadCopy {
        id: CopyId,
        chunk: u64,
        reason: String,
    },

    /// The copy engine (the simulation's worker thread, or the CUDA stream after a fatal
    /// error) stopped; the copies it held are lost.
    #[error("device copy engine stopped: {reason}")]
    CopyEngineStopped { reason: String },

    /// A chunk the tier does not hold.
    #[error("{tier} tier does not hold chunk {chunk}")]
    UnknownChunk { tier: TierKind, chunk: u64 },

    /// An error of the io crate (NVMe tier, buffer pools), with the tier and chunk.
    #[error("{tier} tier{}: {source}", chunk_ctx(.chunk))]
    Io {
        tier: TierKind,
        chunk: Option<u64>,
        #[source]
        source: tidestore_io::IoError,
    },
}

fn chunk_ctx(chunk: &Option<u64>) -> String {
    match chunk {
        Some(c) => format!(" (chunk {c})"),
        None => String::new(),
    }
}

impl TierError {
    /// Wrap an io error with the tier and chunk it happened to.
    pub fn io(tier: TierKind, chunk: Option<u64>, source: tidestore_io::IoError) -> Self {
        TierError::Io {
            tier,
            chunk,
            source,
        }
    }

    /// Box a backend error as [`TierError::Cuda`].
    pub fn cuda(
        op: &'static str,
        chunk: Option<u64>,
        bytes: u64,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        TierError::Cuda {
            op,
            chunk,
            bytes,
            source: Box::new(source),
        }
    }
}

/// Result with [`TierError`].
pub type Result<T, E = TierError> = std::result::Result<T, E>;
