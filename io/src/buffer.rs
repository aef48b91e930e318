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
//!   pins for CUDA and what io_uring registers as fixed buffers;
//! - a take of fewer bytes than a buffer may get a *part*: a buffer split into `per`
//!   equal, aligned parts (`per = buffer / request`, at most [`PARTS_MAX`]), each a buffer
//!   of its own; parts of one split serve requests of the same `per` only, and the buffer
//!   becomes whole again when its last part comes back. Small requests so share buffers
//!   without fragmenting the pool: at any time every buffer is whole-free, whole-taken or
//!   split for one size, so a whole buffer is free whenever no part of it is taken —
//!   never worse than one buffer per request. A part lies inside its buffer, so it keeps
//!   that buffer's fixed (registered) index.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use memmap2::{MmapMut, MmapOptions};

use crate::error::{IoError, Result};

/// Alignment of every buffer and of every O_DIRECT offset and length.
pub const ALIGN_BYTES: usize = 4096;

/// The most parts a buffer is split into.
pub const PARTS_MAX: usize = 64;

/// Round `bytes` up to a multiple of [`ALIGN_BYTES`].
pub const fn align_up(bytes: usize) -> usize {
    (bytes + ALIGN_BYTES - 1) & !(ALIGN_BYTES - 1)
}

static NEXT_POOL_ID: AtomicU32 = AtomicU32::new(1);

/// A buffer split into parts: which are free (bit `i` set: part `i` is free).
#[derive(Debug, Clone, Copy)]
struct Split {
    per: u32,
    free_mask: u64,
}

/// The pool's free buffers and parts, under one lock.
#[derive(Debug, Default)]
struct FreeState {
    /// Whole buffers free, taken from the front, returned to the back.
    whole: VecDeque<u32>,
    /// Buffers split into parts, by buffer index.
    splits: BTreeMap<u32, Split>,
    /// Split buffers with a free part, by `per`.
    partial: BTreeMap<u32, BTreeSet<u32>>,
    /// Bytes of free parts.
    free_part_bytes: usize,
    /// Bytes of the buffers and parts handed out.
    taken_bytes: usize,
}

struct PoolInner {
    id: u32,
    map: MmapMut,
    buf_bytes: usize,
    count: u32,
    free: Mutex<FreeState>,
    returned: Condvar,
}

impl PoolInner {
    fn lock(&self) -> MutexGuard<'_, FreeState> {
        // Every critical section leaves the state consistent before anything can panic.
        self.free.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes of each part of a buffer split `per` ways.
    fn part_bytes(&self, per: u32) -> usize {
        (self.buf_bytes / per as usize) & !(ALIGN_BYTES - 1)
    }

    /// `(per, part bytes)` for a request of `bytes`: `per == 1` is a whole buffer.
    fn class_of(&self, bytes: usize) -> Option<(u32, usize)> {
        let want = align_up(bytes.max(1));
        if want > self.buf_bytes {
            return None;
        }
        let per = (self.buf_bytes / want).min(PARTS_MAX) as u32;
        Some((
            per,
            if per == 1 {
                self.buf_bytes
            } else {
                self.part_bytes(per)
            },
        ))
    }

    /// Takes a part (or a whole buffer when `per == 1`): `(buffer index, part index)`.
    fn take_locked(&self, st: &mut FreeState, per: u32) -> Option<(u32, u32)> {
        if per == 1 {
            let index = st.whole.pop_front()?;
            st.taken_bytes += self.buf_bytes;
            return Some((index, 0));
        }
        let part_bytes = self.part_bytes(per);
        st.taken_bytes += part_bytes;
        if let Some(&index) = st.partial.get(&per).and_then(|set| set.first()) {
            let split = st
                .splits
                .get_mut(&index)
                .expect("partial buffers are split");
            let part = split.free_mask.trailing_zeros();
            split.free_mask &= !(1u64 << part);
            if split.free_mask == 0 {
                remove_partial(st, per, index);
            }
            st.free_part_bytes -= part_bytes;
            return Some((index, part));
        }
        let Some(index) = st.whole.pop_front() else {
            st.taken_bytes -= part_bytes;
            return None;
        };
        let free_mask = all_parts(per) & !1;
        st.splits.insert(index, Split { per, free_mask });
        if free_mask != 0 {
            st.partial.entry(per).or_default().insert(index);
        }
        st.free_part_bytes += (per as usize - 1) * part_bytes;
        Some((index, 0))
    }

    /// Gives back part `part` of buffer `index` (or the whole buffer).
    fn give_back(&self, index: u32, part: Option<u32>) {
        let mut st = self.lock();
        match part {
            None => {
                st.taken_bytes -= self.buf_bytes;
                st.whole.push_back(index);
            }
            Some(part) => {
                let Some(split) = st.splits.get_mut(&index) else {
                    debug_assert!(false, "a part of buffer {index}, which is not split");
                    return;
                };
                let per = split.per;
                split.free_mask |= 1u64 << part;
                let whole_again = split.free_mask == all_parts(per);
                let part_bytes = self.part_bytes(per);
                st.taken_bytes -= part_bytes;
                if whole_again {
                    st.splits.remove(&index);
                    remove_partial(&mut st, per, index);
                    st.free_part_bytes -= (per as usize - 1) * part_bytes;
                    st.whole.push_back(index);
                } else {
                    st.partial.entry(per).or_default().insert(index);
                    st.free_part_bytes += part_bytes;
                }
            }
        }
        drop(st);
        self.returned.notify_all();
    }
}

/// The free mask of a buffer split `per` ways with every part free.
fn all_parts(per: u32) -> u64 {
    debug_assert!((2..=PARTS_MAX as u32).contains(&per));
    u64::MAX >> (64 - per)
}

fn remove_partial(st: &mut FreeState, per: u32, index: u32) {
    if let Some(set) = st.partial.get_mut(&per) {
        set.remove(&index);
        if set.is_empty() {
            st.partial.remove(&per);
        }
    }
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
            .field("free", &self.available())
            .finish()
    }
}

impl BufferPool {
    /// Allocate `count` buffers of `buf_bytes` each (rounded up to 4096) in one mapping,
    /// locked in RAM (`mlock`, which makes every page now).
    pub fn new(buf_bytes: usize, count: usize) -> Result<Self> {
        Self::with_lock(buf_bytes, count, true)
    }

    /// As [`BufferPool::new`], locked only when `lock`: unlocked, a page is made when a
    /// buffer first touches it, so buffers never used cost no memory.
    pub fn with_lock(buf_bytes: usize, count: usize, lock: bool) -> Result<Self> {
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
        if let Err(e) = lock.then(|| map.lock()).transpose() {
            tracing::debug!(error = %e, total_bytes, "pool: mlock refused; buffers stay pageable");
        }
        let free = FreeState {
            whole: (0..count32).collect(),
            ..FreeState::default()
        };
        let id = NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(id, buf_bytes, count, "buffer pool allocated");
        Ok(BufferPool {
            inner: Arc::new(PoolInner {
                id,
                map,
                buf_bytes,
                count: count32,
                free: Mutex::new(free),
                returned: Condvar::new(),
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

    /// Whole buffers not taken (nor split) right now.
    pub fn available(&self) -> usize {
        self.inner.lock().whole.len()
    }

    /// Bytes free right now: whole buffers and free parts of split ones.
    pub fn free_bytes(&self) -> usize {
        let st = self.inner.lock();
        st.whole.len() * self.inner.buf_bytes + st.free_part_bytes
    }

    /// Bytes of the buffers and parts handed out now (their capacities).
    pub fn taken_bytes(&self) -> usize {
        self.inner.lock().taken_bytes
    }

    /// The capacity of the buffer a take of `bytes` gets (a whole buffer, or a part of
    /// one), or `None` when `bytes` is more than a buffer holds.
    pub fn take_bytes_for(&self, bytes: usize) -> Option<usize> {
        self.inner.class_of(bytes).map(|(_, cap)| cap)
    }

    /// How a take of `bytes` is served: `(per, capacity)`, `per == 1` a whole buffer,
    /// else a part of a buffer split `per` ways; `None` when `bytes` is more than a
    /// buffer holds.
    pub fn take_class_for(&self, bytes: usize) -> Option<(u32, usize)> {
        self.inner.class_of(bytes)
    }

    /// The buffers split into parts now: `(buffer index, per, part bytes, parts
    /// free)`, by index. A free part serves only takes of its own `per` (see the module
    /// doc), so its bytes are free for those sizes only.
    pub fn splits(&self) -> Vec<(u32, u32, usize, usize)> {
        let st = self.inner.lock();
        st.splits
            .iter()
            .map(|(&index, split)| {
                (
                    index,
                    split.per,
                    self.inner.part_bytes(split.per),
                    split.free_mask.count_ones() as usize,
                )
            })
            .collect()
    }

    /// A process-unique id; buffers remember the pool they came from by it.
    pub fn id(&self) -> u32 {
        self.inner.id
    }

    /// Take a whole buffer if one is free.
    pub fn try_take(&self) -> Option<AlignedBuf> {
        self.try_take_bytes(self.inner.buf_bytes)
    }

    /// Take a whole buffer, waiting up to `timeout` for one to be returned.
    pub fn take_timeout(&self, timeout: Duration) -> Option<AlignedBuf> {
        self.take_bytes_timeout(self.inner.buf_bytes, timeout)
    }

    /// Take a buffer of at least `bytes` if one is free: a part of a buffer split for
    /// requests of this size when `bytes` is at most half a buffer (see the module doc),
    /// a whole buffer otherwise. `None` when none is free or `bytes` is more than a
    /// buffer holds.
    pub fn try_take_bytes(&self, bytes: usize) -> Option<AlignedBuf> {
        let (per, cap) = self.inner.class_of(bytes)?;
        let taken = self.inner.take_locked(&mut self.inner.lock(), per)?;
        Some(self.buf_at(taken, per, cap))
    }

    /// As [`BufferPool::try_take_bytes`], waiting up to `timeout` for a buffer to come
    /// back.
    pub fn take_bytes_timeout(&self, bytes: usize, timeout: Duration) -> Option<AlignedBuf> {
        let (per, cap) = self.inner.class_of(bytes)?;
        let deadline = Instant::now() + timeout;
        let mut st = self.inner.lock();
        loop {
            if let Some(taken) = self.inner.take_locked(&mut st, per) {
                drop(st);
                return Some(self.buf_at(taken, per, cap));
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            st = self
                .inner
                .returned
                .wait_timeout(st, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn buf_at(&self, (index, part): (u32, u32), per: u32, cap: usize) -> AlignedBuf {
        let offset = index as usize * self.inner.buf_bytes + part as usize * cap;
        debug_assert!(part < per && (part as usize + 1) * cap <= self.inner.buf_bytes);
        // SAFETY: `offset + cap <= map.len()`: `index < count`, the map is
        // `count * buf_bytes` long and part `part` of `per` ends inside buffer `index`
        // (`(part + 1) * cap <= per * cap <= buf_bytes`); the mapping pointer is non-null
        // and lives as long as the `Arc` the buffer holds.
        let ptr = unsafe { NonNull::new_unchecked(self.inner.map.as_ptr().add(offset) as *mut u8) };
        AlignedBuf {
            ptr,
            cap,
            origin: Origin::Pool {
                pool: Arc::clone(&self.inner),
                index,
                part: (per > 1).then_some(part),
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
    /// Buffer `index` of a pool, or part `part` of it.
    Pool {
        pool: Arc<PoolInner>,
        index: u32,
        part: Option<u32>,
    },
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

    /// `(pool id, buffer index)` when this buffer comes from a pool (for a part, the
    /// index of the buffer it lies in).
    pub fn fixed_index(&self) -> Option<(u32, u32)> {
        match &self.origin {
            Origin::Pool { pool, index, .. } => Some((pool.id, *index)),
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
            Origin::Pool { pool, index, part } => pool.give_back(*index, *part),
            Origin::Heap => {
                let layout = std::alloc::Layout::from_size_align(self.cap, ALIGN_BYTES)
                    .expect("layout was valid at allocation");
                // SAFETY: allocated in `new_zeroed` with this very layout, freed once.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
            }
        }
    }
}

/// Bytes for people: `1.50 GiB`, `512.00 MiB`, `4.00 KiB`, `12 B` (powers of 1024), as
/// every crate's messages write sizes.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [(&str, f64); 4] = [
        ("TiB", (1u64 << 40) as f64),
        ("GiB", (1u64 << 30) as f64),
        ("MiB", (1u64 << 20) as f64),
        ("KiB", 1024.0),
    ];
    for (name, size) in UNITS {
        if b as f64 >= size {
            return format!("{:.2} {name}", b as f64 / size);
        }
    }
    format!("{b} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many of the pool's pages are resident now.
    #[cfg(target_os = "linux")]
    fn resident_pages(pool: &BufferPool) -> usize {
        let (addr, len) = pool.region();
        let page = 4096;
        let mut vec = vec![0u8; len.div_ceil(page)];
        // SAFETY: `addr..addr + len` is the pool's whole mapping, page-aligned and alive
        // for this call; `vec` has one byte per page of it.
        let rc = unsafe { libc::mincore(addr.cast(), len, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn an_unlocked_pool_makes_only_the_pages_its_buffers_touch() {
        let pool = BufferPool::with_lock(1 << 20, 8, false).unwrap();
        assert_eq!(
            resident_pages(&pool),
            0,
            "an unlocked pool made pages up front"
        );
        let mut a = pool.try_take().unwrap();
        // SAFETY: `a` is an exclusive buffer of `capacity()` bytes.
        unsafe { std::ptr::write_bytes(a.as_mut_ptr(), 1, a.capacity()) };
        let touched = resident_pages(&pool);
        assert!(
            (256..=2 * 256 + 512).contains(&touched),
            "one 1 MiB buffer written, {touched} pages resident"
        );
        let locked = BufferPool::new(1 << 20, 8).unwrap();
        let made = resident_pages(&locked);
        // mlock makes every page; where RLIMIT_MEMLOCK refuses it, nothing is made.
        assert!(made == 8 * 256 || made == 0, "{made} pages");
    }

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
    fn small_takes_share_a_buffer_split_for_their_size() {
        let pool = BufferPool::new(4 * 16384, 2).unwrap();
        assert_eq!(pool.take_bytes_for(16384), Some(16384));
        assert_eq!(pool.take_bytes_for(20000), Some(20480)); // three parts of 20 KiB
        assert_eq!(pool.take_bytes_for(30000), Some(32768));
        assert_eq!(pool.take_bytes_for(40000), Some(65536));
        assert_eq!(pool.take_bytes_for(65537), None);
        // Four parts of a quarter: one buffer.
        let quarters: Vec<AlignedBuf> = (0..4)
            .map(|_| pool.try_take_bytes(16000).unwrap())
            .collect();
        assert_eq!(pool.available(), 1);
        let base = quarters[0].as_ptr() as usize;
        for (i, q) in quarters.iter().enumerate() {
            assert_eq!(q.capacity(), 16384);
            assert_eq!(q.as_ptr() as usize, base + i * 16384);
            assert_eq!(q.fixed_index(), quarters[0].fixed_index());
        }
        // A half takes the other buffer (parts of a quarter split do not serve it).
        let half = pool.try_take_bytes(30000).unwrap();
        assert_eq!(pool.available(), 0);
        assert!(pool.try_take().is_none());
        assert_eq!(pool.free_bytes(), 32768);
        let other_half = pool.try_take_bytes(32768).unwrap();
        assert!(pool.try_take_bytes(100).is_none());
        assert_eq!(pool.free_bytes(), 0);
        drop((half, other_half));
        assert_eq!(pool.available(), 1);
        // The quarter split is whole again only when its last part comes back.
        let mut quarters = quarters;
        quarters.truncate(1);
        assert_eq!(pool.available(), 1);
        assert_eq!(pool.free_bytes(), 65536 + 3 * 16384);
        drop(quarters);
        assert_eq!(pool.available(), 2);
        assert_eq!(pool.free_bytes(), 2 * 65536);
    }

    #[test]
    fn a_wait_for_a_part_wakes_when_one_comes_back() {
        let pool = BufferPool::new(8192, 1).unwrap();
        let a = pool.try_take_bytes(4096).unwrap();
        let b = pool.try_take_bytes(4096).unwrap();
        assert!(pool
            .take_bytes_timeout(4096, Duration::from_millis(5))
            .is_none());
        let giver = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(b);
        });
        let c = pool
            .take_bytes_timeout(4096, Duration::from_secs(10))
            .unwrap();
        giver.join().unwrap();
        assert_ne!(a.as_ptr(), c.as_ptr());
    }

    proptest::proptest! {
        /// Any sequence of takes of any size and returns: live buffers never overlap and
        /// lie inside the pool, free bytes plus held bytes stay within the pool, and once
        /// everything is back every buffer is whole again.
        #[test]
        fn takes_and_returns_keep_the_pool_consistent(
            ops in proptest::collection::vec((0usize..=65536, proptest::bool::ANY), 1..200)
        ) {
            let pool = BufferPool::new(65536, 3).unwrap();
            let (base, len) = pool.region();
            let base = base as usize;
            let mut live: Vec<AlignedBuf> = Vec::new();
            for (bytes, give) in ops {
                if give && !live.is_empty() {
                    live.swap_remove(bytes % live.len());
                } else if let Some(b) = pool.try_take_bytes(bytes) {
                    proptest::prop_assert!(b.capacity() >= align_up(bytes.max(1)));
                    live.push(b);
                }
                let mut spans: Vec<(usize, usize)> = live
                    .iter()
                    .map(|b| (b.as_ptr() as usize, b.as_ptr() as usize + b.capacity()))
                    .collect();
                spans.sort_unstable();
                for w in spans.windows(2) {
                    proptest::prop_assert!(w[0].1 <= w[1].0, "overlap {:?}", w);
                }
                for &(s, e) in &spans {
                    proptest::prop_assert!(s >= base && e <= base + len && s % ALIGN_BYTES == 0);
                }
                let held: usize = live.iter().map(|b| b.capacity()).sum();
                proptest::prop_assert_eq!(pool.taken_bytes(), held);
                proptest::prop_assert!(pool.free_bytes() + held <= len);
            }
            live.clear();
            proptest::prop_assert_eq!(pool.available(), 3);
            proptest::prop_assert_eq!(pool.free_bytes(), len);
        }
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
