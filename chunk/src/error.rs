//! The one error type of the chunk crate.
//!
//! Every variant carries the context needed to act on it: the tensor's name, the chunk,
//! the states of an illegal transition, the moment and byte counts of a working set
//! that does not fit. Errors are values: nothing in this crate panics on bad input.

use std::sync::Arc;

use tidestore_tiers::{TierError, TierKind};

use crate::dtype::{DType, UnknownDType};
use crate::id::{ChunkId, ListKind};
use crate::tensor_state::TensorState;

/// Errors of the chunk crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChunkError {
    /// A dtype name that is not `f32`, `f16` or `bf16` (or one of their aliases).
    #[error("unknown dtype `{name}` (expected f32, f16 or bf16)")]
    UnknownDType {
        /// The name as given.
        name: String,
    },

    /// A tensor whose shape has no elements.
    #[error("tensor `{tensor}` has no elements (shape {shape:?})")]
    EmptyTensor {
        /// The tensor's name.
        tensor: String,
        /// Its shape.
        shape: Vec<usize>,
    },

    /// A tensor whose element count overflows `u64`.
    #[error("tensor `{tensor}`: element count of shape {shape:?} overflows")]
    TensorOverflow {
        /// The tensor's name.
        tensor: String,
        /// Its shape.
        shape: Vec<usize>,
    },

    /// A name registered twice.
    #[error("tensor `{tensor}` is registered twice")]
    DuplicateTensor {
        /// The tensor's name.
        tensor: String,
    },

    /// A tensor that does not fit one chunk; tensors are never split.
    #[error(
        "tensor `{tensor}` needs {needed_elements} element slots but a chunk holds \
         {chunk_elements}; tensors are never split across chunks"
    )]
    TensorTooLarge {
        /// The tensor's name.
        tensor: String,
        /// Slots it needs in the Params list.
        needed_elements: u64,
        /// The chunk size in elements.
        chunk_elements: u64,
    },

    /// A chunk size that cannot be used.
    #[error("invalid chunk size of {chunk_elements} elements: {reason}")]
    InvalidChunkSize {
        /// The rejected size.
        chunk_elements: u64,
        /// Why.
        reason: &'static str,
    },

    /// The dtype asked for 16-bit copies of fp32 tensors is not a 16-bit type.
    #[error("param16 dtype must be f16 or bf16, got {dtype}")]
    NotSixteenBit {
        /// The rejected dtype.
        dtype: DType,
    },

    /// A layout asked for fp32 gradients without a gradient list to hold them.
    #[error(
        "fp32 gradients need their own list: a layout with fp32_grads must have \
         grad_accumulation on"
    )]
    Fp32GradsWithoutGradList,

    /// An I/O block size of zero, or one whose alignment overflows.
    #[error("invalid I/O block size of {block_bytes} bytes: {reason}")]
    InvalidBlockSize {
        /// The rejected block size.
        block_bytes: u64,
        /// Why.
        reason: &'static str,
    },

    /// An operation that needs at least one tensor got none.
    #[error("no tensors registered")]
    NoTensors,

    /// More chunks than a [`ChunkId`] can number.
    #[error("{chunks} chunks per list exceed the limit of {limit}")]
    TooManyChunks {
        /// Chunks the layout would need.
        chunks: u64,
        /// The limit.
        limit: u64,
    },

    /// A tensor state transition outside the legal table (see [`crate::state`]).
    #[error("tensor `{tensor}` (in chunk {chunk}): illegal state transition {from} -> {to}")]
    IllegalTransition {
        /// The tensor's name.
        tensor: String,
        /// Its chunk.
        chunk: ChunkId,
        /// Its current state.
        from: TensorState,
        /// The state asked for.
        to: TensorState,
    },

    /// A tensor id that was never registered.
    #[error("unknown tensor id {id} ({count} tensors registered)")]
    UnknownTensor {
        /// The id.
        id: u32,
        /// How many tensors exist.
        count: u32,
    },

    /// A chunk whose size is unknown to a trace or simulation.
    #[error("chunk {chunk} has no known size")]
    UnknownChunk {
        /// The chunk.
        chunk: ChunkId,
    },

    /// The chunks needed together at one moment exceed the tier's capacity.
    #[error(
        "moment {moment}: the chunks needed together take {needed_bytes} bytes but the tier \
         holds {capacity_bytes} bytes ({short_bytes} short)"
    )]
    WorkingSetTooLarge {
        /// The moment.
        moment: u64,
        /// Bytes the moment's chunks need.
        needed_bytes: u64,
        /// The tier's capacity.
        capacity_bytes: u64,
        /// `needed_bytes - capacity_bytes`.
        short_bytes: u64,
    },

    /// An eviction policy declined to pick a victim although candidates existed.
    #[error("moment {moment}: policy `{policy}` chose no victim to make room for chunk {chunk}")]
    NoVictim {
        /// The moment.
        moment: u64,
        /// The chunk being loaded.
        chunk: ChunkId,
        /// The policy's name.
        policy: &'static str,
    },

    /// A policy name that is not `lifetime`, `lru` or `fifo`.
    #[error("unknown eviction policy `{name}` (expected lifetime, lru or fifo)")]
    UnknownPolicy {
        /// The name as given.
        name: String,
    },

    /// A tier budget that cannot hold one moment's working set; found when the store
    /// opens, before the first iteration.
    #[error(
        "{tier} budget too small: {what} needs {needed_bytes} bytes, the budget is \
         {available_bytes} bytes ({short_bytes} short)"
    )]
    BudgetTooSmall {
        /// The tier.
        tier: TierKind,
        /// What needs the bytes.
        what: &'static str,
        /// Bytes needed.
        needed_bytes: u64,
        /// Bytes the budget gives.
        available_bytes: u64,
        /// `needed_bytes - available_bytes`.
        short_bytes: u64,
    },

    /// The model's chunks do not fit in host + NVMe; found when the store opens.
    #[error(
        "model too large: {chunks} chunks plus one staging slot need {needed_bytes} bytes of \
         host + NVMe slots of {slot_bytes} bytes, but host ({host_bytes} bytes) + NVMe \
         ({nvme_bytes} bytes) give {available_bytes} bytes ({short_bytes} short)"
    )]
    ModelTooLarge {
        /// Chunks of the layout.
        chunks: u64,
        /// Bytes of a host buffer / NVMe slot (each chunk takes one whole).
        slot_bytes: u64,
        /// `(chunks + 1) * slot_bytes`.
        needed_bytes: u64,
        /// Usable bytes of the pinned host pool.
        host_bytes: u64,
        /// Usable bytes of the NVMe swap file.
        nvme_bytes: u64,
        /// `host_bytes + nvme_bytes`.
        available_bytes: u64,
        /// `needed_bytes - available_bytes`.
        short_bytes: u64,
    },

    /// A tier has no room left that eviction could make (everything in it is in use).
    #[error(
        "{tier} tier full: chunk {chunk} needs {needed_bytes} bytes but every chunk there is \
         in use or in flight ({capacity_bytes} bytes capacity)"
    )]
    TierFull {
        /// The tier.
        tier: TierKind,
        /// The chunk that needed room.
        chunk: ChunkId,
        /// Bytes it needed.
        needed_bytes: u64,
        /// The tier's capacity.
        capacity_bytes: u64,
    },

    /// A store configuration value out of range; `key` names it.
    #[error("invalid store config `{key}`: {reason}")]
    Config {
        /// The key, as the configuration file spells it.
        key: &'static str,
        /// Why.
        reason: String,
    },

    /// A tensor that has no place in the list asked for (a frozen tensor in an
    /// optimizer list, or `grads` without gradient accumulation).
    #[error("tensor `{tensor}` has no place in list {list}")]
    NoPlace {
        /// The tensor's name.
        tensor: String,
        /// The list.
        list: ListKind,
    },

    /// A chunk accessed on one tier while another of its tensors computes on the other.
    #[error(
        "tensor `{tensor}`: chunk {chunk} is in use on the {pinned_on} tier; it cannot be \
         accessed on another tier until released"
    )]
    PinnedElsewhere {
        /// The tensor's name.
        tensor: String,
        /// Its chunk.
        chunk: ChunkId,
        /// Where the chunk is in use.
        pinned_on: TierKind,
    },

    /// A view asked of a guard whose tensor is no longer accessed, or a view kind the
    /// guard's tier cannot give (host bytes of real GPU memory).
    #[error("tensor `{tensor}`: {reason}")]
    BadView {
        /// The tensor's name.
        tensor: String,
        /// Why.
        reason: &'static str,
    },

    /// [`crate::ChunkStore::views_mut`] was asked for two views whose bytes overlap (the
    /// same tensor twice, or two ranges of one chunk that intersect).
    #[error(
        "views of `{first}` and `{second}` overlap in chunk {chunk}: mutable views must be \
         disjoint"
    )]
    OverlappingViews {
        /// The first tensor's name.
        first: String,
        /// The second tensor's name.
        second: String,
        /// Their chunk.
        chunk: ChunkId,
    },

    /// Bytes written to a tensor whose length differs from the tensor's.
    #[error("tensor `{tensor}` is {expected_bytes} bytes, got {got_bytes}")]
    LengthMismatch {
        /// The tensor's name.
        tensor: String,
        /// Its size in its list.
        expected_bytes: u64,
        /// Bytes given.
        got_bytes: u64,
    },

    /// [`crate::StoreConfig::adopt`] asked to take the chunks of an existing swap file
    /// as the store's contents, and the file does not qualify; nothing was changed.
    #[error("cannot adopt the chunks of swap file {path}: {reason}")]
    AdoptRefused {
        /// The swap file.
        path: String,
        /// Why.
        reason: AdoptRefusal,
    },

    /// A [`crate::Guard`] that no longer names the access it came from: its tensor was
    /// released (by id) and perhaps accessed again, or it comes from another store.
    /// Nothing was changed.
    #[error("tensor `{tensor}` in list {list}: stale guard (its access ended)")]
    StaleGuard {
        /// The tensor's name.
        tensor: String,
        /// The list of the guard.
        list: ListKind,
        /// The guard's chunk.
        chunk: ChunkId,
    },

    /// A broken invariant of the store (see [`crate::ChunkStore::verify`]): a bug,
    /// reported rather than repaired.
    #[error("store invariant broken{}: {what}", chunk_ctx(.chunk))]
    Invariant {
        /// The chunk concerned, where one is.
        chunk: Option<ChunkId>,
        /// What disagrees.
        what: String,
    },

    /// An error of a tier (device copy, host pool, NVMe I/O), with the chunk it hit.
    #[error("{op}{}: {source}", chunk_ctx(.chunk))]
    Tier {
        /// What the store was doing.
        op: &'static str,
        /// The chunk, where one was involved.
        chunk: Option<ChunkId>,
        /// The tier's error.
        #[source]
        source: SharedTierError,
    },
}

/// Why a swap file's chunks cannot be adopted (see [`ChunkError::AdoptRefused`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AdoptRefusal {
    /// There is no swap file to adopt.
    NoSwapFile,
    /// The file records no layout fingerprint (never used by a chunk store of this
    /// format).
    NoFingerprint,
    /// The file was written for another layout.
    OtherLayout {
        /// The fingerprint the file records.
        file_fingerprint: u64,
        /// This layout's fingerprint.
        layout_fingerprint: u64,
    },
    /// The file was not closed by [`crate::ChunkStore::close`] after its last change
    /// (a crash, or a store dropped without `close`).
    NotClosedCleanly,
    /// The file's slots differ from the ones the config asks for.
    OtherShape {
        /// The file's slot size.
        file_slot_bytes: usize,
        /// The file's slot count.
        file_slots: u32,
        /// The slot size asked for.
        slot_bytes: usize,
        /// The slot count asked for.
        slots: u32,
    },
    /// The file stores a chunk this layout does not have (or of another length).
    ForeignChunk {
        /// The chunk's id in the file.
        chunk: u64,
        /// Its length in the file.
        len_bytes: usize,
    },
}

impl std::fmt::Display for AdoptRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AdoptRefusal::NoSwapFile => write!(f, "there is no swap file"),
            AdoptRefusal::NoFingerprint => write!(f, "it records no layout fingerprint"),
            AdoptRefusal::OtherLayout {
                file_fingerprint,
                layout_fingerprint,
            } => write!(
                f,
                "it was written for another layout (fingerprint {file_fingerprint:#018x}; \
                 this layout's is {layout_fingerprint:#018x})"
            ),
            AdoptRefusal::NotClosedCleanly => write!(
                f,
                "it was not closed cleanly (a crash, or a store dropped without close); \
                 resume from a checkpoint"
            ),
            AdoptRefusal::OtherShape {
                file_slot_bytes,
                file_slots,
                slot_bytes,
                slots,
            } => write!(
                f,
                "it has {file_slots} slots of {file_slot_bytes} bytes, the config asks for \
                 {slots} slots of {slot_bytes} bytes"
            ),
            AdoptRefusal::ForeignChunk { chunk, len_bytes } => write!(
                f,
                "it stores chunk {chunk} of {len_bytes} bytes, which this layout does not have"
            ),
        }
    }
}

fn chunk_ctx(chunk: &Option<ChunkId>) -> String {
    match chunk {
        Some(c) => format!(" (chunk {c})"),
        None => String::new(),
    }
}

impl From<UnknownDType> for ChunkError {
    fn from(e: UnknownDType) -> Self {
        ChunkError::UnknownDType { name: e.name }
    }
}

impl ChunkError {
    /// Wraps a tier error with what the store was doing and the chunk.
    pub fn tier(op: &'static str, chunk: Option<ChunkId>, source: TierError) -> Self {
        ChunkError::Tier {
            op,
            chunk,
            source: SharedTierError(Arc::new(source)),
        }
    }
}

/// The [`ChunkError::Tier`] operation of a host pool that could not be allocated (a
/// budget beyond what the machine gives): a front end names its budget's key for it.
pub const ALLOCATING_HOST_POOL: &str = "allocating the host pool";

/// A [`TierError`] behind an `Arc`, so that [`ChunkError`] stays `Clone` and `Eq`
/// (two of these are equal when they are the same error value).
#[derive(Debug, Clone)]
pub struct SharedTierError(pub Arc<TierError>);

impl SharedTierError {
    /// The tier error, to match on.
    pub fn inner(&self) -> &TierError {
        &self.0
    }
}

impl PartialEq for SharedTierError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for SharedTierError {}

impl std::fmt::Display for SharedTierError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for SharedTierError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}
