//! Aligned, owned I/O buffers and the fixed pool they come from.
//!
//! Invariants:
//! - every buffer starts on a 4096-byte boundary and its capacity is a multiple of 4096,
//!   so it can be handed to O_DIRECT reads and writes as it is;
//! - a buffer has exactly one owner; there is no `Clone` (a copy may fail to allocate:
//!   use [`AlignedBuf::try_clone_from_pool`]). Ownership passes into an I/O call and comes
//!   back with its completion, so the kernel never writes into memory someone else holds;
//! - a pool is one contiguous anonymous mapping made once at start-up (transparent huge
//!   pages asked for, locked in memory where allowed), cut into equal buffers. Taking and
//!   returning a buffer allocates nothing. One contiguous, huge-page backed region lets
//!   the block layer build large requests from few segments, and it is what the host tier
//!   pins for CUDA and what io_uring registers as fixed buffers.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use memmap2::{MmapMut, MmapOptions};

use crate::error::{IoError, Result};

/// Alignment of every buffer and of every O_DIRECT offset and length.
pub const ALIGN_BYTES: usize = 4096;

/// Round `bytes` up to a multiple of [`ALIGN_BYTES`].
pub const fn align_up(bytes: usize) -> usize {
    (bytes + ALIGN_BYTES - 1) & !(ALIGN_BYTES - 1)
}

static NEXT_POOL_ID: AtomicU32 = AtomicU32::new(1);

struct PoolInner {
    id: u32,
    map: MmapMut,
    buf_bytes: usize,
    count: u32,
    free_tx: Sender<u32>,
    free_rx: Receiver<u32>,
}

/// A fixed set of equal, aligned buffers carved from one contiguous mapping.
#[derive(Clone)]
pub struct BufferPool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("id", &self.inner.id)
            .field("buf_bytes", &self.inner.buf_bytes)
            .field("count", &self.inner.count)
            .field("free", &self.inner.free_rx.len())
            .finish()
    }
}

impl BufferPool {
    /// Allocate `count` buffers of `buf_bytes` each (rounded up to 4096) in one mapping.
    pub fn new(buf_bytes: usize, count: usize) -> Result<Self> {
        if buf_bytes == 0 || count == 0 {
            return Err(IoError::Pool {
                reason: format!("needs at least one buffer of at least one byte (asked {count} x {buf_bytes} bytes)"),
            });
        }
        let count32 = u32::try_from(count).map_err(|_| IoError::Pool {
            reason: format!("{count} buffers is more than a pool holds"),
        })?;
        let buf_bytes = align_up(buf_bytes);
        let total_bytes = buf_bytes.checked_mul(count).ok_or_else(|| IoError::Pool {
            reason: format!("{count} x {buf_bytes} bytes overflows"),
        })?;
        let map = MmapOptions::new()
            .len(total_bytes)
            .map_anon()
            .map_err(|e| IoError::Pool {
                reason: format!("mapping {total_bytes} bytes failed: {e}"),
            })?;
        #[cfg(target_os = "linux")]
        if let Err(e) = map.advise(memmap2::Advice::HugePage) {
            tracing::debug!(error = %e, "pool: transparent huge pages not available");
        }
        if let Err(e) = map.lock() {
            tracing::debug!(error = %e, total_bytes, "pool: mlock refused; buffers stay pageable");
        }
        let (free_tx, free_rx) = crossbeam_channel::bounded(count);
        for i in 0..count32 {
            free_tx.send(i).expect("channel sized for every index");
        }
        let id = NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(id, buf_bytes, count, "buffer pool allocated");
        Ok(BufferPool {
            inner: Arc::new(PoolInner {
                id,
                map,
                buf_bytes,
                count: count32,
                free_tx,
                free_rx,
            }),
        })
    }

    /// Size of every buffer of this pool.
    pub fn buf_bytes(&self) -> usize {
        self.inner.buf_bytes
    }

    /// Number of buffers in the pool.
    pub fn count(&self) -> usize {
        self.inner.count as usize
    }

    /// Buffers not taken right now.
    pub fn available(&self) -> usize {
        self.inner.free_rx.len()
    }

    /// A process-unique id; buffers remember the pool they came from by it.
    pub fn id(&self) -> u32 {
        self.inner.id
    }

    /// Take a buffer if one is free.
    pub fn try_take(&self) -> Option<AlignedBuf> {
        self.inner.free_rx.try_recv().ok().map(|i| self.buf_at(i))
    }

    /// Take a buffer, waiting up to `timeout` for one to be returned.
    pub fn take_timeout(&self, timeout: Duration) -> Option<AlignedBuf> {
        self.inner
            .free_rx
            .recv_timeout(timeout)
            .ok()
            .map(|i| self.buf_at(i))
    }

    fn buf_at(&self, index: u32) -> AlignedBuf {
        let offset = index as usize * self.inner.buf_bytes;
        // SAFETY: `offset + buf_bytes <= map.len()` because `index < count` and the map is
        // `count * buf_bytes` long; the mapping pointer is non-null and lives as long as
        // the `Arc` the buffer holds.
        let ptr = unsafe { NonNull::new_unchecked(self.inner.map.as_ptr().add(offset) as *mut u8) };
        AlignedBuf {
            ptr,
            cap: self.inner.buf_bytes,
            origin: Origin::Pool {
                pool: Arc::clone(&self.inner),
                index,
            },
        }
    }

    /// The whole mapping as `(address, length)`, for registering it (io_uring fixed
    /// buffers, CUDA host registration). Buffer `i` starts at `address + i * buf_bytes`.
    pub fn region(&self) -> (*mut u8, usize) {
        (self.inner.map.as_ptr() as *mut u8, self.inner.map.len())
    }
}

enum Origin {
    Pool { pool: Arc<PoolInner>, index: u32 },
    Heap,
}

/// An owned, 4096-aligned buffer. Its whole capacity is addressable; its contents are
/// whatever was last written (a fresh buffer from the pool is not zeroed).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    origin: Origin,
}

// SAFETY: an `AlignedBuf` is the unique owner of its bytes (no `Clone`, pool indices are
// handed out once); moving it to another thread moves that ownership.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give `&[u8]` access.
unsafe impl Sync for AlignedBuf {}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("cap", &self.cap)
            .field("fixed", &self.fixed_index())
            .finish()
    }
}

impl AlignedBuf {
    /// Allocate a zeroed buffer outside any pool (for tests and cold paths; the hot path
    /// takes from a [`BufferPool`]).
    pub fn new_zeroed(bytes: usize) -> Result<Self> {
        let cap = align_up(bytes.max(1));
        let layout =
            std::alloc::Layout::from_size_align(cap, ALIGN_BYTES).map_err(|e| IoError::Pool {
                reason: format!("layout of {cap} bytes: {e}"),
            })?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| IoError::Pool {
            reason: format!("allocating {cap} bytes failed"),
        })?;
        Ok(AlignedBuf {
            ptr,
            cap,
            origin: Origin::Heap,
        })
    }

    /// Take a buffer from `pool` and copy this one's bytes into it (no `Clone`: the copy
    /// can fail for lack of a buffer).
    pub fn try_clone_from_pool(&self, pool: &BufferPool) -> Result<Self> {
        let mut out = pool.try_take().ok_or_else(|| IoError::Pool {
            reason: "no free buffer to clone into".into(),
        })?;
        if out.cap < self.cap {
            return Err(IoError::Pool {
                reason: format!(
                    "pool buffers hold {} bytes, clone needs {}",
                    out.cap, self.cap
                ),
            });
        }
        out[..self.cap].copy_from_slice(self);
        Ok(out)
    }

    /// Capacity in bytes, a multiple of 4096.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// `(pool id, buffer index)` when this buffer comes from a pool.
    pub fn fixed_index(&self) -> Option<(u32, u32)> {
        match &self.origin {
            Origin::Pool { pool, index } => Some((pool.id, *index)),
            Origin::Heap => None,
        }
    }

    /// Raw pointer to the first byte, for handing to the kernel or a device copy.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Raw pointer to the first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `cap` bytes owned by this buffer (pool slot or heap
        // allocation) that stay valid until it is dropped; `&self` forbids mutation.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.cap) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match &self.origin {
            Origin::Pool { pool, index } => {
                // The channel holds `count` entries and each index is out at most once,
                // so this never blocks and never fails while the pool lives.
                let _ = pool.free_tx.try_send(*index);
            }
            Origin::Heap => {
                let layout = std::alloc::Layout::from_size_align(self.cap, ALIGN_BYTES)
                    .expect("layout was valid at allocation");
                // SAFETY: allocated in `new_zeroed` with this very layout, freed once.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_buffers_are_aligned_distinct_and_returned() {
        let pool = BufferPool::new(10_000, 3).unwrap();
        assert_eq!(pool.buf_bytes(), 12_288);
        let a = pool.try_take().unwrap();
        let b = pool.try_take().unwrap();
        let c = pool.try_take().unwrap();
        assert!(pool.try_take().is_none());
        for buf in [&a, &b, &c] {
            assert_eq!(buf.as_ptr() as usize % ALIGN_BYTES, 0);
            assert_eq!(buf.capacity(), 12_288);
        }
        assert_ne!(a.as_ptr(), b.as_ptr());
        drop(b);
        assert_eq!(pool.available(), 1);
        let b2 = pool.try_take().unwrap();
        assert_eq!(b2.fixed_index().unwrap().0, pool.id());
    }

    #[test]
    fn heap_buffer_is_zeroed_and_aligned() {
        let buf = AlignedBuf::new_zeroed(5000).unwrap();
        assert_eq!(buf.capacity(), 8192);
        assert_eq!(buf.as_ptr() as usize % ALIGN_BYTES, 0);
        assert!(buf.iter().all(|&b| b == 0));
    }

    #[test]
    fn empty_pool_is_an_error() {
        assert!(matches!(BufferPool::new(0, 4), Err(IoError::Pool { .. })));
        assert!(matches!(
            BufferPool::new(4096, 0),
            Err(IoError::Pool { .. })
        ));
    }
}
