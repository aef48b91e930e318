//! The one error type of the chunk crate.
//!
//! Every variant carries the context needed to act on it: the tensor's name, the chunk,
//! the states of an illegal transition, the moment and byte counts of a working set
//! that does not fit. Errors are values: nothing in this crate panics on bad input.

use crate::dtype::DType;
use crate::id::ChunkId;
use crate::state::TensorState;

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
        /// Slots it needs in the Param16 list.
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
}
