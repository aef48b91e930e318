//! tidestore-io: asynchronous block I/O for chunks on the NVMe tier.
//!
//! Layers, bottom up:
//! - [`buffer`]: 4096-aligned owned buffers from a pool made once at start-up;
//! - [`backend`]: the narrow trait of raw reads and writes, with three implementations:
//!   [`uring`] (io_uring, O_DIRECT, fixed buffers), [`fallback`] (a `pread`/`pwrite`
//!   thread pool) and [`memory`] (in memory, with a seeded fault injector for tests);
//! - [`engine`]: whole-chunk requests split into blocks, short transfers resubmitted,
//!   errors typed, buffers handed back with each completion;
//! - [`swapfile`]: a preallocated file of fixed-size chunk slots with a checksum per chunk
//!   and optional [`compress`]ion.
//!
//! Nothing here prints; everything is logged with `tracing`.

pub mod backend;
pub mod buffer;
pub mod compress;
pub mod config;
pub mod engine;
pub mod error;
pub mod fallback;
pub mod file;
pub mod memory;
pub mod swapfile;
pub mod uring;

pub use backend::{Backend, BackendKind, RawCompletion, RawOp};
pub use buffer::{align_up, human_bytes, AlignedBuf, BufferPool, ALIGN_BYTES};
pub use compress::Compression;
pub use config::{check_writable_dir, EngineChoice, IoConfig, QUEUE_DEPTH_MAX};
pub use engine::{Engine, IoCompletion, IoRequest};
pub use error::{IoError, Op, Result};
pub use memory::{FaultConfig, MemoryBackend};
pub use swapfile::{SwapCompletion, SwapFile};
