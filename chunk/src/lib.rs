//! Tensors -> chunks: the pure planning logic of tidestore.
//!
//! This crate decides *where* every tensor lives inside which chunk, how big a chunk is,
//! which state each tensor and chunk is in, when each chunk will be needed (from the
//! warm-up trace) and which chunk to evict or prefetch. It performs no I/O and holds no
//! buffers: the `tiers` crate and the chunk store built on top of it move the bytes.
//!
//! Modules, one concept each:
//! - [`dtype`]: element types and their byte sizes.
//! - [`id`]: the compact identifiers [`TensorId`], [`ListKind`] and [`ChunkId`].
//! - [`layout`]: registration of tensors in model order into chunk lists.
//! - [`search`]: the chunk-size search that minimises wasted bytes.
//! - [`state`]: tensor states, the legal transitions, chunk states kept incrementally.
//! - [`tracer`]: the warm-up trace, the [`Schedule`] it yields and divergence checks.
//! - [`policy`]: eviction policies (`lifetime`, `lru`, `fifo`) and the prefetch planner.
//! - [`sim`]: a one-tier simulator, an offline Belady reference and a GPT trace generator.
//!
//! Every fallible function returns [`ChunkError`], the one error type of the crate.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod dtype;
pub mod error;
pub mod id;
pub mod layout;
pub mod policy;
pub mod search;
pub mod sim;
pub mod state;
pub mod tracer;

pub use dtype::DType;
pub use error::ChunkError;
pub use id::{ChunkId, ListKind, TensorId};
pub use layout::{Layout, LayoutBuilder, LayoutConfig, TensorLocation, TensorSpec};
pub use policy::{
    EvictionPolicy, Fifo, Lifetime, Lru, PolicyKind, PrefetchPlanner, PrefetchStep, Residency,
};
pub use search::{
    search_chunk_size, search_chunk_size_exhaustive, Candidate, SearchConfig, SearchReport,
};
pub use sim::{
    gpt_trace, offline_belady, simulate, AccessTrace, GptShape, GptTrace, Prefetch, SimReport,
};
pub use state::{ChunkState, StateTable, TensorState};
pub use tracer::{
    Divergence, DivergenceKind, Follow, Follower, Horizon, Moment, MomentKind, Schedule, Tracer,
};

/// The result type of this crate.
pub type Result<T, E = ChunkError> = std::result::Result<T, E>;
