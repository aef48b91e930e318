//! The seam between the store and the mover: what the store asks of the mover, as
//! calls. The store decides what is needed where and when (its moments, its plans, its
//! tensors' states); the mover owns where each chunk is — its copies, the transfers in
//! flight, the pins — and makes every move, dated and explained by the [`Cause`] each
//! call that may move a chunk takes. The store reads no field of the mover.
//!
//! What each side promises the other (asserted in debug builds, and checked by
//! [`Mover::verify`]):
//! - the store pins a chunk only where [`Mover::make_current`] has just made it current,
//!   and on one tier at a time; it unpins only what it pinned (pins never underflow:
//!   [`Mover::unpin`] refuses);
//! - the mover never evicts or drops a pinned copy, and a chunk it reports current at a
//!   place has its copy there with nothing in flight;
//! - the device bytes pinned are those of the chunks pinned on the device, counted once
//!   per chunk.

use tidestore_tiers::{Device, DeviceMem, HostTier, NvmeTier};

use super::{Mover, Pending, Slot};
use crate::accounting::{MoveHook, MoveReason, StoreStats};
use crate::error::ChunkError;
use crate::id::ChunkId;
use crate::place::Place;
use crate::policy::EvictionPolicy;
use crate::Result;

/// Why a move happens and when: every call that may move a chunk takes one, and every
/// [`MoveEvent`](crate::accounting::MoveEvent) it reports carries it. The moment dates
/// the policies' inserts, accesses and evictions; it is the store's (the latest access
/// or release, or the next moment for untraced I/O).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cause {
    pub(crate) moment: u64,
    pub(crate) reason: MoveReason,
}

/// Where a chunk's current copies are (for tests and reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkResidency {
    /// Current on the device.
    pub device: bool,
    /// Current in the host pool.
    pub host: bool,
    /// Current on NVMe.
    pub nvme: bool,
    /// A transfer is in flight.
    pub in_flight: bool,
}

impl Slot {
    /// The host copy's bytes, where there is one (the views cut from it).
    pub(crate) fn host_mut(&mut self) -> Option<&mut [u8]> {
        self.host.as_deref_mut()
    }

    /// The device copy, where there is one (the views cut from it).
    pub(crate) fn dev_mut(&mut self) -> Option<&mut DeviceMem> {
        self.dev.as_mut()
    }
}

/// The tiers, the accounting and the settings.
impl Mover {
    /// The device tier.
    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    /// The NVMe tier (its swap file and io engine).
    pub(crate) fn nvme(&self) -> &NvmeTier {
        &self.nvme
    }

    /// The host tier.
    pub(crate) fn host(&self) -> &HostTier {
        &self.host
    }

    /// Reports the device memory used by everything but chunks now.
    pub(crate) fn report_non_model_bytes(&mut self, bytes: u64) {
        self.device.report_non_model_bytes(bytes);
    }

    /// Marks the swap file clean (every chunk written back: see `ChunkStore::close`).
    pub(crate) fn mark_swap_clean(&mut self) -> Result<()> {
        self.nvme
            .mark_clean()
            .map_err(|e| ChunkError::tier("marking the swap file clean", None, e))
    }

    /// The counters of the moves (the tiers' use is the caller's to add: see
    /// [`Mover::snapshot`]; the store adds its own).
    pub(crate) fn stats(&self) -> StoreStats {
        self.stats
    }

    /// Zeroes the counters and restarts every tier's peak from its use now.
    pub(crate) fn reset_stats(&mut self) {
        self.stats = StoreStats::default();
        self.device.reset_peak();
        self.host.reset_peak();
        self.nvme.reset_peak();
    }

    /// Calls `hook` after every move (`None` removes it).
    pub(crate) fn set_hook(&mut self, hook: Option<MoveHook>) {
        self.hook = hook;
    }

    /// Whether write-backs forced by eviction run asynchronously.
    pub(crate) fn set_async_writes(&mut self, on: bool) {
        self.async_writes = on;
    }

    /// Both tiers' main policies (after a traced iteration: `lifetime` over its
    /// schedules).
    pub(crate) fn set_main_policies(
        &mut self,
        device: Box<dyn EvictionPolicy + Send>,
        host: Box<dyn EvictionPolicy + Send>,
    ) {
        self.dev_policy.set_main(device);
        self.host_policy.set_main(host);
    }

    /// Whether both tiers evict by their main policy (else by their LRU).
    pub(crate) fn use_main_policies(&mut self, on: bool) {
        self.dev_policy.use_main = on;
        self.host_policy.use_main = on;
    }
}

/// Where chunks are.
impl Mover {
    /// Chunk slots (dense ids), the layout's and the gaps between lists.
    pub(crate) fn chunk_count(&self) -> usize {
        self.slots.len()
    }

    /// Where `c`'s current copies are; `None` for a chunk the layout does not have.
    pub(crate) fn residency(&self, c: ChunkId) -> Option<ChunkResidency> {
        let s = self.slots.get(c.dense())?;
        if self.len_bytes[c.dense()] == 0 {
            return None;
        }
        Some(ChunkResidency {
            device: s.dev.is_some(),
            host: s.host.is_some(),
            nvme: s.nvme_valid,
            in_flight: s.pending != Pending::None,
        })
    }

    /// Whether `c` is current at `place` with nothing in flight for it: an access there
    /// is a hit, and its copy may be pinned and viewed.
    pub(crate) fn is_current(&self, c: ChunkId, place: Place) -> bool {
        let s = &self.slots[c.dense()];
        s.pending == Pending::None
            && match place {
                Place::Device => s.dev.is_some(),
                Place::Host => s.host.is_some(),
            }
    }

    /// Whether `c`'s NVMe copy is current.
    pub(crate) fn nvme_current(&self, c: ChunkId) -> bool {
        self.slots[c.dense()].nvme_valid
    }

    /// The chunks ever materialised: a copy on some tier (a stale NVMe one included).
    pub(crate) fn materialised(&self) -> Vec<ChunkId> {
        (0..self.slots.len())
            .filter(|&d| {
                let s = &self.slots[d];
                self.len_bytes[d] > 0 && (s.nvme_stored || s.host.is_some() || s.dev.is_some())
            })
            .map(ChunkId::from_dense)
            .collect()
    }

    /// `c`'s host copy (see [`Mover::is_current`]).
    pub(crate) fn host_copy(&self, c: ChunkId) -> Option<&[u8]> {
        self.slots[c.dense()].host.as_deref()
    }

    /// `c`'s host copy, writable (the caller has marked it changed there).
    pub(crate) fn host_copy_mut(&mut self, c: ChunkId) -> Option<&mut [u8]> {
        self.slots[c.dense()].host_mut()
    }

    /// `c`'s device copy.
    pub(crate) fn device_copy(&self, c: ChunkId) -> Option<&DeviceMem> {
        self.slots[c.dense()].dev.as_ref()
    }

    /// `c`'s device copy, writable (the caller has marked it changed there).
    pub(crate) fn device_copy_mut(&mut self, c: ChunkId) -> Option<&mut DeviceMem> {
        self.slots[c.dense()].dev_mut()
    }

    /// Per dense id: on the device or on its way there (the device planner's view).
    pub(crate) fn device_marks(&self) -> &[bool] {
        &self.dev_mark
    }

    /// Per dense id: the device bytes a chunk takes.
    pub(crate) fn device_chunk_bytes(&self) -> &[u64] {
        &self.dev_bytes
    }

    /// Per dense id: the host pool bytes a chunk's host copy holds.
    pub(crate) fn host_chunk_bytes(&self) -> &[u64] {
        &self.host_bytes
    }

    /// Per dense id: a device copy is present (a host copy beside it is a shadow).
    pub(crate) fn device_copies(&self) -> Vec<bool> {
        self.slots.iter().map(|s| s.dev.is_some()).collect()
    }

    /// The chunks present on the device and not pinned there, in the device list's order.
    pub(crate) fn device_evictable(&self) -> Vec<ChunkId> {
        self.dev_list
            .iter()
            .copied()
            .filter(|c| self.slots[c.dense()].dev_pins == 0)
            .collect()
    }

    /// The chunks present in the host pool: (pinned there, not pinned).
    pub(crate) fn host_copies_by_pin(&self) -> (Vec<ChunkId>, Vec<ChunkId>) {
        self.host_list
            .iter()
            .partition(|c| self.slots[c.dense()].host_pins > 0)
    }

    /// The device budget's capacity now (the tide).
    pub(crate) fn device_cap(&self) -> u64 {
        self.dev_cap
    }
}

/// Pins: a chunk with a tensor in COMPUTE on a tier is pinned there, never evicted.
impl Mover {
    /// The tier `c` is pinned on, if any (one at most).
    pub(crate) fn pinned_on(&self, c: ChunkId) -> Option<Place> {
        let s = &self.slots[c.dense()];
        debug_assert!(
            s.dev_pins == 0 || s.host_pins == 0,
            "{c} pinned on both tiers"
        );
        if s.dev_pins > 0 {
            Some(Place::Device)
        } else if s.host_pins > 0 {
            Some(Place::Host)
        } else {
            None
        }
    }

    /// `c`'s pins at `place` (its tensors in COMPUTE there).
    pub(crate) fn pins(&self, c: ChunkId, place: Place) -> u32 {
        let s = &self.slots[c.dense()];
        match place {
            Place::Device => s.dev_pins,
            Place::Host => s.host_pins,
        }
    }

    /// The device bytes of the chunks pinned on the device.
    pub(crate) fn pinned_device_bytes(&self) -> u64 {
        self.pinned_device_bytes
    }

    /// One more tensor of `c` in COMPUTE at `place`, where [`Mover::make_current`] has
    /// just made it current (a prefetch that brought it there counts as a hit).
    pub(crate) fn pin(&mut self, c: ChunkId, place: Place) {
        debug_assert!(
            self.is_current(c, place),
            "pinning {c} on the {place:?} tier, where it is not current"
        );
        debug_assert!(
            self.pinned_on(c).is_none_or(|p| p == place),
            "pinning {c} on the {place:?} tier while it is pinned on the other"
        );
        let d = c.dense();
        let slot = &mut self.slots[d];
        match place {
            Place::Device => {
                if slot.prefetched {
                    slot.prefetched = false;
                    self.stats.prefetch_hits += 1;
                }
                slot.dev_pins += 1;
                if slot.dev_pins == 1 {
                    self.pinned_device_bytes += self.dev_bytes[d];
                }
            }
            Place::Host => {
                if slot.host_prefetched {
                    slot.host_prefetched = false;
                    self.stats.prefetch_hits += 1;
                    self.stats.host_prefetch_hits += 1;
                }
                slot.host_pins += 1;
            }
        }
    }

    /// Counts the NVMe read a prefetch started for `c` before `moment`, now used by an
    /// access.
    pub(crate) fn count_read_ahead(&mut self, c: ChunkId, moment: u64) {
        let Some(at) = self.slots[c.dense()].read_started_at.take() else {
            return;
        };
        let lead = moment.saturating_sub(at);
        let s = &mut self.stats;
        s.nvme_reads_ahead += 1;
        s.nvme_read_lead_min = match s.nvme_read_lead_min {
            0 => lead,
            m => m.min(lead),
        };
    }

    /// Whether `c` has a pin at `place` to give back (and, on the device, its bytes are
    /// counted pinned).
    pub(crate) fn can_unpin(&self, c: ChunkId, place: Place) -> bool {
        self.pins(c, place) > 0
            && (place == Place::Host || self.pinned_device_bytes >= self.dev_bytes[c.dense()])
    }

    /// One tensor of `c` fewer in COMPUTE at `place`. A pin that is not there is a
    /// broken invariant, refused: a pin count never underflows.
    pub(crate) fn unpin(&mut self, c: ChunkId, place: Place) -> Result<()> {
        if !self.can_unpin(c, place) {
            debug_assert!(
                false,
                "unpinning {c} on the {place:?} tier, not pinned there"
            );
            return Err(ChunkError::Invariant {
                chunk: Some(c),
                what: format!("unpinning at {place:?} a chunk with no pin there"),
            });
        }
        let d = c.dense();
        let slot = &mut self.slots[d];
        match place {
            Place::Device => {
                slot.dev_pins -= 1;
                if slot.dev_pins == 0 {
                    self.pinned_device_bytes -= self.dev_bytes[d];
                }
            }
            Place::Host => slot.host_pins -= 1,
        }
        Ok(())
    }

    /// `c` is about to change at `place`: its copies elsewhere become stale and are
    /// dropped.
    pub(crate) fn mark_changed(&mut self, c: ChunkId, place: Place, cause: Cause) {
        match place {
            Place::Host => self.dirty_on_host(c, cause),
            Place::Device => self.dirty_on_device(c, cause),
        }
    }
}

/// Test-only ways to break the invariants [`Mover::verify`] and the store check.
#[cfg(test)]
impl Mover {
    pub(crate) fn test_set_pins(&mut self, c: ChunkId, place: Place, pins: u32) {
        let s = &mut self.slots[c.dense()];
        match place {
            Place::Device => s.dev_pins = pins,
            Place::Host => s.host_pins = pins,
        }
    }

    pub(crate) fn test_host_list(&mut self) -> &mut Vec<ChunkId> {
        &mut self.host_list
    }
}
