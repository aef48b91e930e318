//! The narrow seam between the chunk I/O engine and the three ways of moving bytes.
//!
//! A backend only knows *raw operations*: one contiguous read or write of at most a block
//! at a file offset, identified by an id, answered by a completion carrying the kernel's
//! convention (`>= 0` bytes moved, `< 0` a negated errno). Splitting chunks into blocks,
//! retrying short transfers, typing errors and handing buffers back all live above, in
//! [`crate::Engine`], so every backend gets them for free and the same way.
//!
//! Implementations: [`crate::uring::UringBackend`] (io_uring),
//! [`crate::fallback::ThreadPoolBackend`] (`pread`/`pwrite` on threads) and
//! [`crate::memory::MemoryBackend`] (in memory, with a seeded fault injector).

use crate::buffer::BufferPool;
use crate::error::{Op, Result};

/// Which backend an engine runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    IoUring,
    ThreadPool,
    Memory,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::IoUring => "io_uring",
            BackendKind::ThreadPool => "threads",
            BackendKind::Memory => "memory",
        })
    }
}

/// One contiguous transfer handed to a backend.
#[derive(Debug, Clone, Copy)]
pub struct RawOp {
    /// Echoed back in the completion.
    pub id: u64,
    pub op: Op,
    pub offset_bytes: u64,
    /// First byte of the memory to read into or write from.
    pub ptr: *mut u8,
    pub len_bytes: u32,
    /// `(pool id, buffer index)` of the buffer `ptr` lies in, when it comes from a pool;
    /// `ptr` may point past the buffer's start (a block inside a chunk).
    pub fixed: Option<(u32, u32)>,
}

/// The answer to one [`RawOp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawCompletion {
    pub id: u64,
    /// Bytes moved (`>= 0`) or a negated errno.
    pub result: i32,
}

/// A way of moving bytes between memory and one file (or its in-memory stand-in).
pub trait Backend: Send {
    fn kind(&self) -> BackendKind;

    /// Most operations this backend holds at once (pushed but not yet reaped).
    fn queue_depth(&self) -> usize;

    /// Queue one operation. It need not start before [`Backend::submit_and_reap`].
    /// Callers never push more than [`Backend::queue_depth`] unreaped operations.
    ///
    /// # Safety
    /// `op.ptr .. op.ptr + op.len_bytes` must stay valid, and must not be read or written
    /// by anyone else, until the completion with `op.id` has been returned by
    /// `submit_and_reap` (or the backend has been dropped, which waits for it).
    unsafe fn push(&mut self, op: RawOp) -> Result<()>;

    /// Start everything pushed, then wait until at least `min_complete` completions are
    /// ready (0: do not wait) and append all ready completions to `out`.
    fn submit_and_reap(&mut self, min_complete: usize, out: &mut Vec<RawCompletion>) -> Result<()>;

    /// Offer a buffer pool for registration (io_uring fixed buffers). Returns whether it
    /// was registered; backends without the notion return `Ok(false)`.
    fn register_pool(&mut self, _pool: &BufferPool) -> Result<bool> {
        Ok(false)
    }

    /// Operations issued on registered (fixed) buffers so far; 0 for backends without
    /// them.
    fn ops_fixed(&self) -> u64 {
        0
    }

    /// Make written data durable.
    fn sync_data(&mut self) -> Result<()>;

    /// Current length of the file.
    fn len_bytes(&self) -> Result<u64>;

    /// Reserve `len_bytes` of real space (fallocate), so a later write cannot hit ENOSPC.
    fn allocate(&mut self, len_bytes: u64) -> Result<()>;
}
