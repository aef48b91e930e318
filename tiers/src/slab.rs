//! The device slab: all chunk memory of a device is one region allocated once, when the
//! device opens; chunks take blocks of it and give them back. Nothing on the move path
//! asks the driver (or the host allocator) for memory.
//!
//! Why: `cuMemAlloc` / `cuMemFree` per chunk move synchronize the device (an eviction
//! waits for every queued prefetch copy, an allocation serializes the copy stream against
//! compute), and the simulation's fresh zeroed buffer per move cost a page fault and a
//! zeroing per page. Both backends use this allocator, so the simulation tests the
//! allocator the GPU runs.
//!
//! Invariants ([`SlabAllocator::verify`] checks them):
//! - blocks are `block_align_bytes`-aligned (4096: the device budget's unit, so a block
//!   is exactly the bytes its budget lease holds) and lie inside the slab;
//! - blocks handed out and free runs never overlap, and together cover the slab; free
//!   runs are coalesced (no two adjacent);
//! - `used_bytes` is the sum of the blocks handed out, and never exceeds the slab;
//! - a [`SlabBlock`] gives its block back exactly once, when dropped.
//!
//! Placement is best fit (the smallest free run that holds the block, lowest offset on a
//! tie): chunk sizes come in a few classes (one per chunk list), so a freed chunk's hole
//! is mostly refilled by a chunk of its class. A chunk is contiguous and the slab cannot
//! be compacted (its blocks' addresses are out), so a request that the budget admits may
//! still find no free run that holds it when chunks of several sizes are pinned in the
//! way. Such a request is the one case served outside the slab: an *overflow*
//! allocation (the driver's, or the host's in the simulation), logged, counted
//! ([`SlabStats::overflow_allocs`]) and held to the same budget; its device footprint,
//! rounded to the allocation granularity, counts as chunk memory, not non-model memory.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tidestore_io::align_up;

/// Alignment and size unit of every block: the budget's unit.
pub const BLOCK_ALIGN_BYTES: u64 = 4096;

/// One block of a slab: `bytes` at `offset_bytes` from its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub offset_bytes: u64,
    pub bytes: u64,
}

/// Counts of one slab, for reports and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlabStats {
    /// Bytes of the slab.
    pub slab_bytes: u64,
    /// Bytes in blocks handed out now.
    pub used_bytes: u64,
    /// The most bytes in blocks at once.
    pub peak_used_bytes: u64,
    /// Blocks handed out now.
    pub blocks: u64,
    /// Blocks handed out in all.
    pub allocs: u64,
    /// Allocations that failed for want of a free run large enough.
    pub refused: u64,
    /// The largest free run.
    pub largest_free_bytes: u64,
    /// Allocations served outside the slab because it was fragmented, in all.
    pub overflow_allocs: u64,
    /// Bytes of overflow allocations alive now.
    pub overflow_live_bytes: u64,
    /// Device memory those take (each rounded up to the allocation granularity).
    pub overflow_footprint_bytes: u64,
}

/// Bookkeeping of one slab: offsets only, no memory.
#[derive(Debug)]
pub struct SlabAllocator {
    slab_bytes: u64,
    /// `slab_bytes` rounded down to whole blocks: what blocks can cover.
    usable_bytes: u64,
    /// Free runs, offset -> length; disjoint and coalesced.
    free: BTreeMap<u64, u64>,
    used_bytes: u64,
    peak_used_bytes: u64,
    blocks: u64,
    allocs: u64,
    refused: u64,
    granularity_bytes: u64,
    overflow_allocs: u64,
    overflow_live_bytes: u64,
    overflow_footprint_bytes: u64,
}

impl SlabAllocator {
    /// A slab of `slab_bytes`, all free (its last partial block never used); overflow
    /// allocations take `granularity_bytes` units of device memory.
    pub fn new(slab_bytes: u64, granularity_bytes: u64) -> Self {
        let usable_bytes = slab_bytes - slab_bytes % BLOCK_ALIGN_BYTES;
        let mut free = BTreeMap::new();
        if usable_bytes > 0 {
            free.insert(0, usable_bytes);
        }
        SlabAllocator {
            slab_bytes,
            usable_bytes,
            free,
            used_bytes: 0,
            peak_used_bytes: 0,
            blocks: 0,
            allocs: 0,
            refused: 0,
            granularity_bytes: granularity_bytes.max(1),
            overflow_allocs: 0,
            overflow_live_bytes: 0,
            overflow_footprint_bytes: 0,
        }
    }

    fn overflow_footprint(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.granularity_bytes) * self.granularity_bytes
    }

    /// The bytes a block for `len_bytes` takes.
    pub fn block_bytes(len_bytes: u64) -> u64 {
        align_up(len_bytes.max(1) as usize) as u64
    }

    /// A block for `len_bytes`, or `None` when no free run holds it.
    pub fn alloc(&mut self, len_bytes: u64) -> Option<Block> {
        let bytes = Self::block_bytes(len_bytes);
        let best = self
            .free
            .iter()
            .filter(|(_, &run)| run >= bytes)
            .min_by_key(|(&off, &run)| (run, off))
            .map(|(&off, &run)| (off, run));
        let Some((offset_bytes, run)) = best else {
            self.refused += 1;
            return None;
        };
        self.free.remove(&offset_bytes);
        if run > bytes {
            self.free.insert(offset_bytes + bytes, run - bytes);
        }
        self.used_bytes += bytes;
        self.peak_used_bytes = self.peak_used_bytes.max(self.used_bytes);
        self.blocks += 1;
        self.allocs += 1;
        assert!(self.used_bytes <= self.usable_bytes, "slab overcommitted");
        Some(Block {
            offset_bytes,
            bytes,
        })
    }

    /// Give `block` back. Panics if it is not a block handed out now (a double free or a
    /// foreign block would corrupt every later allocation).
    pub fn free(&mut self, block: Block) {
        let Block {
            mut offset_bytes,
            mut bytes,
        } = block;
        assert!(
            offset_bytes + bytes <= self.usable_bytes && bytes <= self.used_bytes,
            "slab: freeing {block:?}, not a live block"
        );
        if let Some((&prev_off, &prev_len)) = self.free.range(..=offset_bytes).next_back() {
            assert!(
                prev_off + prev_len <= offset_bytes,
                "slab: freeing {block:?}, which overlaps a free run"
            );
            if prev_off + prev_len == offset_bytes {
                self.free.remove(&prev_off);
                offset_bytes = prev_off;
                bytes += prev_len;
            }
        }
        let end = block.offset_bytes + block.bytes;
        if let Some((&next_off, &next_len)) = self.free.range(block.offset_bytes..).next() {
            assert!(
                next_off >= end,
                "slab: freeing {block:?}, which overlaps a free run"
            );
            if next_off == end {
                self.free.remove(&next_off);
                bytes += next_len;
            }
        }
        self.free.insert(offset_bytes, bytes);
        self.used_bytes -= block.bytes;
        self.blocks -= 1;
    }

    /// Counts.
    pub fn stats(&self) -> SlabStats {
        SlabStats {
            slab_bytes: self.slab_bytes,
            used_bytes: self.used_bytes,
            peak_used_bytes: self.peak_used_bytes,
            blocks: self.blocks,
            allocs: self.allocs,
            refused: self.refused,
            largest_free_bytes: self.free.values().copied().max().unwrap_or(0),
            overflow_allocs: self.overflow_allocs,
            overflow_live_bytes: self.overflow_live_bytes,
            overflow_footprint_bytes: self.overflow_footprint_bytes,
        }
    }

    /// Check every invariant of the module doc; the first broken one, named.
    pub fn verify(&self) -> std::result::Result<(), String> {
        let mut end = 0u64;
        let mut prev_end: Option<u64> = None;
        let mut free_bytes = 0u64;
        for (&off, &len) in &self.free {
            if len == 0 || off % BLOCK_ALIGN_BYTES != 0 || len % BLOCK_ALIGN_BYTES != 0 {
                return Err(format!("free run {off}+{len} empty or unaligned"));
            }
            if prev_end.is_some_and(|pe| off <= pe) {
                return Err(format!(
                    "free run at {off} overlaps or touches the previous"
                ));
            }
            end = off + len;
            prev_end = Some(end);
            free_bytes += len;
        }
        if end > self.usable_bytes {
            return Err(format!("free run ends at {end}, past the slab"));
        }
        if free_bytes + self.used_bytes != self.usable_bytes {
            return Err(format!(
                "free {free_bytes} + used {} != usable slab {}",
                self.used_bytes, self.usable_bytes
            ));
        }
        Ok(())
    }
}

/// A slab's allocator shared by the device and every block it handed out.
#[derive(Debug, Clone)]
pub(crate) struct SharedSlab(Arc<Mutex<SlabAllocator>>);

impl SharedSlab {
    pub(crate) fn new(slab_bytes: u64, granularity_bytes: u64) -> Self {
        SharedSlab(Arc::new(Mutex::new(SlabAllocator::new(
            slab_bytes,
            granularity_bytes,
        ))))
    }

    /// The allocator; a panic while it was held cannot have broken it (every method
    /// asserts before it changes anything), so a poisoned lock is taken over.
    fn lock(&self) -> MutexGuard<'_, SlabAllocator> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A block for `len_bytes` of `chunk`, or, when no free run holds it (fragmentation),
    /// the accounting of an overflow allocation the caller then makes outside the slab.
    pub(crate) fn take(&self, chunk: u64, len_bytes: u64) -> Placement {
        let mut slab = self.lock();
        if let Some(block) = slab.alloc(len_bytes) {
            return Placement::Slab(SlabBlock {
                slab: self.clone(),
                block,
            });
        }
        let bytes = SlabAllocator::block_bytes(len_bytes);
        let stats = slab.stats();
        tracing::debug!(
            chunk,
            bytes,
            largest_free_bytes = stats.largest_free_bytes,
            free_bytes = stats.slab_bytes - stats.used_bytes,
            "device slab fragmented: chunk allocated outside it"
        );
        slab.overflow_allocs += 1;
        slab.overflow_live_bytes += bytes;
        let footprint_bytes = slab.overflow_footprint(bytes);
        slab.overflow_footprint_bytes += footprint_bytes;
        Placement::Overflow(OverflowLease {
            slab: self.clone(),
            bytes,
            footprint_bytes,
        })
    }

    pub(crate) fn stats(&self) -> SlabStats {
        self.lock().stats()
    }

    pub(crate) fn verify(&self) -> std::result::Result<(), String> {
        self.lock().verify()
    }
}

/// Where a chunk's memory comes from.
#[derive(Debug)]
pub(crate) enum Placement {
    /// A block of the slab (the normal case).
    Slab(SlabBlock),
    /// Outside the slab, which was too fragmented (the caller allocates the memory).
    Overflow(OverflowLease),
}

/// The accounting of one overflow allocation; ends when dropped (after the memory is
/// freed, or leaked with it where it cannot be).
#[derive(Debug)]
pub(crate) struct OverflowLease {
    slab: SharedSlab,
    bytes: u64,
    footprint_bytes: u64,
}

impl Drop for OverflowLease {
    fn drop(&mut self) {
        let mut slab = self.slab.lock();
        slab.overflow_live_bytes -= self.bytes;
        slab.overflow_footprint_bytes -= self.footprint_bytes;
    }
}

/// A block of a slab, given back when dropped.
#[derive(Debug)]
pub(crate) struct SlabBlock {
    slab: SharedSlab,
    block: Block,
}

impl SlabBlock {
    pub(crate) fn offset_bytes(&self) -> u64 {
        self.block.offset_bytes
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.block.bytes
    }
}

impl Drop for SlabBlock {
    fn drop(&mut self) {
        self.slab.lock().free(self.block);
    }
}

/// Host memory standing in for a slab of device memory (the simulation): one anonymous
/// mapping made at start-up, its pages faulted in on first use and reused after.
pub(crate) struct HostRegion {
    map: NonNull<u8>,
    bytes: usize,
    _mmap: memmap2::MmapMut,
}

// SAFETY: the region is plain memory; every access goes through a `SlabBlock` of it,
// which one owner holds (see `bytes` / `bytes_mut`), so sharing the region between threads
// shares no byte.
unsafe impl Send for HostRegion {}
// SAFETY: as above.
unsafe impl Sync for HostRegion {}

impl std::fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegion")
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl HostRegion {
    /// A region of `bytes` (at least one page), not yet touched (no swap reserved: pages
    /// exist once written, like a device's).
    pub(crate) fn new(bytes: u64) -> std::io::Result<Self> {
        let bytes = (bytes as usize).max(BLOCK_ALIGN_BYTES as usize);
        let mut mmap = memmap2::MmapOptions::new()
            .len(bytes)
            .no_reserve_swap()
            .map_anon()?;
        let map =
            NonNull::new(mmap.as_mut_ptr()).ok_or_else(|| std::io::Error::other("null map"))?;
        Ok(HostRegion {
            map,
            bytes,
            _mmap: mmap,
        })
    }

    fn check(&self, block: &SlabBlock, len: usize) -> usize {
        let off = block.offset_bytes() as usize;
        assert!(
            len as u64 <= block.bytes() && off + block.bytes() as usize <= self.bytes,
            "a block of another slab, or a view past its block"
        );
        off
    }

    /// The first `len` bytes of `block`.
    pub(crate) fn bytes<'a>(&'a self, block: &'a SlabBlock, len: usize) -> &'a [u8] {
        let off = self.check(block, len);
        // SAFETY: `off .. off + len` lies inside the mapping (checked) and inside
        // `block`, which no other live `SlabBlock` overlaps (the allocator's invariant);
        // writes need `&mut` of that block, which this shared borrow excludes.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(off), len) }
    }

    /// The first `len` bytes of `block`, writable.
    pub(crate) fn bytes_mut<'a>(&'a self, block: &'a mut SlabBlock, len: usize) -> &'a mut [u8] {
        let off = self.check(block, len);
        // SAFETY: as in `bytes`; the exclusive borrow of the block's one owner makes this
        // the only reference to these bytes while it lives.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr().add(off), len) }
    }

    /// The address of the first byte (for tests that check views lie inside the slab).
    pub(crate) fn base_addr(&self) -> usize {
        self.map.as_ptr() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_coalesces_and_refuses_fragmented_requests() {
        let page = BLOCK_ALIGN_BYTES;
        let mut s = SlabAllocator::new(10 * page, 2 << 20);
        let a = s.alloc(3 * page).unwrap();
        let b = s.alloc(2 * page - 1).unwrap();
        let c = s.alloc(3 * page).unwrap();
        assert_eq!(b.bytes, 2 * page);
        s.verify().unwrap();
        s.free(b);
        // The 2-page hole is the best fit for a 1-page block.
        let d = s.alloc(page).unwrap();
        assert_eq!(d.offset_bytes, 3 * page);
        s.free(a);
        s.free(c);
        s.verify().unwrap();
        // Free: 0..3, 4..10 pages: 6 fit, 7 do not although 9 pages are free.
        assert!(s.alloc(7 * page).is_none());
        assert_eq!(s.stats().largest_free_bytes, 6 * page);
        s.free(d);
        s.verify().unwrap();
        assert_eq!(s.stats().largest_free_bytes, 10 * page);
        assert_eq!(s.alloc(10 * page).unwrap().offset_bytes, 0);
    }
}
