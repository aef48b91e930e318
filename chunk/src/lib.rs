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
//! - [`policy`]: eviction policies (`lifetime`, `lru`, `fifo`).
//! - [`planner`]: the prefetch planner (what to load ahead of need, what to evict first).
//! - [`sim`]: a one-tier simulator, an offline Belady reference and a GPT trace generator.
//!
//! And the part that moves bytes, over the `tiers` crate:
//! - [`config`]: how a store is opened, and the capacity check made before allocating;
//! - `adopt` (private): what a store makes of a swap file that already holds chunks;
//! - `mover` (private): where each chunk's copies are, and every move between tiers;
//! - [`store`]: [`ChunkStore`], access/release with guards, tracing, tides, prefetch;
//! - [`accounting`]: [`StoreStats`] and the per-move events tests watch;
//! - [`typed`]: `f32`/`f16`/`bf16` copies of tensor bytes.
//!
//! Every fallible function returns [`ChunkError`], the one error type of the crate.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod accounting;
mod adopt;
pub mod config;
pub mod dtype;
pub mod error;
pub mod id;
pub mod layout;
pub mod moments;
mod mover;
mod place;
pub mod planner;
pub mod policy;
pub mod search;
pub mod sim;
pub mod state;
pub mod store;
mod tensor_state;
pub mod tracer;
pub mod typed;

pub use accounting::{MoveEvent, MoveHook, MoveKind, MoveReason, StoreStats, TierSnapshot};
pub use config::{device_working_set_bytes, plan_capacity, CapacityPlan, NvmeSource, StoreConfig};
pub use dtype::{DType, UnknownDType};
pub use error::{AdoptRefusal, ChunkError, SharedTierError, ALLOCATING_HOST_POOL};
pub use id::{ChunkId, ListKind, TensorId};
pub use layout::{
    Layout, LayoutBuilder, LayoutConfig, TensorLocation, TensorSpec, CHUNK_ALIGN_BYTES,
};
pub use moments::MomentForm;
pub use mover::IoPump;
pub use planner::{PoolRoom, PrefetchPlanner, PrefetchStep, Residency};
pub use policy::{EvictionPolicy, Fifo, Lifetime, Lru, PolicyKind};
pub use search::{
    search_chunk_size, search_chunk_size_exhaustive, Candidate, SearchConfig, SearchReport,
};
pub use sim::{
    gpt_trace, offline_belady, simulate, AccessTrace, GptShape, GptTrace, Prefetch, SimReport,
};
pub use state::{ChunkState, StateTable, TensorState};
pub use store::{
    ChunkResidency, ChunkStore, Guard, Phase, Place, TensorView, TensorViewMut, SWAP_FILE_NAME,
};
pub use tracer::{
    Divergence, DivergenceKind, Follow, Follower, Horizon, Moment, MomentKind, Schedule, Tracer,
};

/// The result type of this crate.
pub type Result<T, E = ChunkError> = std::result::Result<T, E>;
