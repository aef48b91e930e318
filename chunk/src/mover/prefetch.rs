//! Loads ahead of need: the device prefetch (a host->device copy, or an NVMe read whose
//! copy to reserved device memory follows it) and the host prefetch (NVMe reads into
//! the host pool), with what the store's planners ask of the mover.
//!
//! Invariants: a prefetch never waits; it starts only with room that is free now (the
//! planners evict by their rule first) or with a buffer a write-back in flight owes the
//! read queue; a prefetch that finds no room reports `false` and changes nothing.

use tidestore_tiers::DeviceMem;

use super::evict::{Ahead, HostRoom};
use super::{is_no_room, Cause, Mover, Pending};
use crate::accounting::MoveKind;
use crate::id::ChunkId;
use crate::planner::PoolRoom;
use crate::Result;

impl Mover {
    /// Starts loading `c` to the device ahead of need (at `ahead.needed_at`; host copies
    /// that make room for its staging buffer follow `ahead`'s rule). Returns false when
    /// there is no room for it now without breaking the prefetch rule.
    pub(crate) fn prefetch_device(
        &mut self,
        c: ChunkId,
        ahead: Ahead<'_>,
        cause: Cause,
    ) -> Result<bool> {
        let needed_at = ahead.needed_at;
        let d = c.dense();
        if self.dev_mark[d] || self.slots[d].pending != Pending::None {
            return Ok(true);
        }
        if self.device_free() < self.dev_bytes[d] || self.slots[d].host_pins > 0 {
            return Ok(false);
        }
        let mem = match self.device.alloc(d as u64, self.len(c)) {
            Ok(m) => m,
            Err(_) => return Ok(false),
        };
        if self.dead_everywhere(c) {
            self.materialize_on_device(c, mem, cause);
            self.slots[d].prefetched = true;
            self.stats.prefetch_loads += 1;
            return Ok(true);
        }
        let room = HostRoom {
            protect: &[c],
            ahead: Some(ahead),
        };
        if self.slots[d].host.is_none() {
            if self.slots[d].nvme_valid {
                return self.prefetch_from_nvme(c, mem, room, needed_at, cause);
            }
            match self.fill_host(c, room, cause) {
                Ok(()) => {}
                Err(e) if is_no_room(&e) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        self.start_h2d(c, mem)?;
        self.slots[d].prefetched = true;
        self.stats.prefetch_loads += 1;
        self.dev_policy.on_insert(c, cause.moment);
        Ok(true)
    }

    /// The NVMe part of [`Mover::prefetch_device`]: `c`'s read into a staging buffer
    /// (now, or queued for one a write-back in flight gives back), needed at
    /// `needed_at`, then its copy to the reserved device memory `mem`. Returns false
    /// when there is no buffer for it.
    fn prefetch_from_nvme(
        &mut self,
        c: ChunkId,
        mem: DeviceMem,
        room: HostRoom<'_>,
        needed_at: u64,
        cause: Cause,
    ) -> Result<bool> {
        let d = c.dense();
        // A staging buffer now, or one a write-back in flight (perhaps the one
        // just started to make room) gives back: the read then waits in the
        // queue, and the copy to the reserved memory follows it.
        let buf = match self.take_host_buffer(c, room, cause) {
            Ok(b) => Some(b),
            Err(e) if is_no_room(&e) && self.writes_owing(c) > 0 => None,
            Err(e) if is_no_room(&e) => return Ok(false),
            Err(e) => return Err(e),
        };
        let slot = &mut self.slots[d];
        slot.reserved_dev = Some(mem);
        slot.prefetched = true;
        slot.read_started_at = Some(cause.moment);
        slot.read_needed_at = needed_at;
        self.dev_mark[d] = true;
        self.stats.prefetch_loads += 1;
        self.dev_policy.on_insert(c, cause.moment);
        match buf {
            Some(buf) => {
                self.nvme.submit_read_ordered(d as u64, buf, needed_at);
                self.slots[d].pending = Pending::NvmeRead;
                self.pending_nvme += 1;
                self.note_nvme_in_flight(false);
            }
            None => {
                self.slots[d].pending = Pending::NvmeReadQueued;
                self.read_queue.push_back(c);
                self.stats.queued_reads += 1;
                self.settle_queue();
            }
        }
        Ok(true)
    }

    /// Starts loading `c` into the host pool ahead of need: reading it from NVMe into a
    /// buffer that is free now, or queueing the read for a buffer that a write-back in
    /// flight gives back (the host prefetcher makes room by its plan first, evicting
    /// with asynchronous write-backs; it never evicts here). With `materialize` (the
    /// host accesses' pass), a chunk only the device holds is copied from there into a
    /// free buffer. Returns false when no buffer is free or owed. Chunks with nothing
    /// to load (a host copy, a device copy outside that pass or in use there, a
    /// transfer in flight or queued, never written) are done.
    pub(crate) fn prefetch_host(
        &mut self,
        c: ChunkId,
        needed_at: u64,
        cause: Cause,
        materialize: bool,
    ) -> Result<bool> {
        if materialize && self.dead_everywhere(c) {
            return Ok(self.materialize_on_host(c, cause));
        }
        let d = c.dense();
        if materialize && self.device_only(c) {
            // Only into a buffer free now, not one queued reads are owed: the copy
            // cannot wait in the read queue, and the reads after it in the plan go on
            // (a later plan, or the access, copies it).
            if self.queued_same_size(c) {
                return Ok(true);
            }
            let Ok(buf) = self.host.try_take(d as u64, self.len_bytes[d]) else {
                return Ok(true);
            };
            self.start_d2h(c, buf)?;
            self.stats.prefetch_loads += 1;
            self.stats.host_prefetch_loads += 1;
            return Ok(true);
        }
        let s = &self.slots[d];
        if s.host.is_some() || s.dev.is_some() || s.pending != Pending::None || !s.nvme_valid {
            return Ok(true);
        }
        if !self.queued_same_size(c) {
            if let Ok(buf) = self.host.try_take(d as u64, self.len_bytes[d]) {
                self.nvme.submit_read_ordered(d as u64, buf, needed_at);
                let slot = &mut self.slots[d];
                slot.pending = Pending::NvmeRead;
                slot.host_prefetched = true;
                slot.read_started_at = Some(cause.moment);
                self.pending_nvme += 1;
                self.note_nvme_in_flight(false);
                self.stats.prefetch_loads += 1;
                self.stats.host_prefetch_loads += 1;
                return Ok(true);
            }
        }
        if self.writes_owing(c) == 0 {
            return Ok(false);
        }
        self.read_queue.push_back(c);
        let slot = &mut self.slots[d];
        slot.pending = Pending::NvmeReadQueued;
        slot.host_prefetched = true;
        slot.read_started_at = Some(cause.moment);
        slot.read_needed_at = needed_at;
        self.stats.prefetch_loads += 1;
        self.stats.host_prefetch_loads += 1;
        self.stats.queued_reads += 1;
        // A buffer may be free already (a write-back that finished since).
        self.settle_queue();
        Ok(true)
    }

    /// The host pool's room by size for the planner: whole buffers and parts free now,
    /// and those the write-backs in flight give back that no queued read is owed.
    pub(crate) fn host_room(&self) -> PoolRoom {
        let buf_bytes = self.host.buf_bytes() as u64;
        let mut room = PoolRoom {
            buf_bytes,
            whole: self.host.available() as u64,
            parts: self
                .host_part_sizes
                .iter()
                .map(|(&held, &per)| (held, (per, 0)))
                .collect(),
            ..PoolRoom::default()
        };
        for (index, per, held, free) in self.host.splits() {
            let per = u64::from(per);
            room.parts.entry(held).or_insert((per, 0));
            room.splits.insert(index, (held, per, per - free));
        }
        for &c in &self.host_list {
            let d = c.dense();
            if self.host_bytes[d] < buf_bytes {
                let index = self.slots[d].host.as_ref().and_then(|b| b.fixed_index());
                if let Some((_, index)) = index {
                    room.buffer_of.insert(c, index);
                }
            }
        }
        let queued = self.queued_held();
        for (&held, &writing) in &self.writing_held {
            let owed = queued.get(&held).copied().unwrap_or(0);
            debug_assert!(
                owed <= writing,
                "more queued reads than write-backs to serve them"
            );
            let returning = writing.saturating_sub(owed) as u64;
            if held >= buf_bytes {
                room.whole += returning;
            } else if let Some((_, free)) = room.parts.get_mut(&held) {
                *free += returning;
            }
        }
        room
    }

    /// Whether the host-tier prefetcher has nothing to load for `c`. With `materialize`
    /// (the pass over the host's own accesses), a dead chunk with no copy anywhere is not
    /// ready: the access that writes it needs a buffer, which the prefetch takes ahead
    /// ([`Mover::prefetch_host`]) instead of that access evicting for it; nor is a chunk
    /// only the device holds (and does not use now), which the prefetch copies from
    /// there instead of that access waiting for the copy.
    pub(crate) fn host_ready(&self, c: ChunkId, materialize: bool) -> bool {
        if materialize && (self.dead_everywhere(c) || self.device_only(c)) {
            return false;
        }
        let s = &self.slots[c.dense()];
        s.host.is_some() || s.dev.is_some() || s.pending != Pending::None || !s.nvme_valid
    }

    /// Whether `c`'s only copy is on the device, not in use there and with nothing in
    /// flight: the host prefetcher may copy it into the pool.
    fn device_only(&self, c: ChunkId) -> bool {
        let s = &self.slots[c.dense()];
        s.dev.is_some() && s.host.is_none() && s.dev_pins == 0 && s.pending == Pending::None
    }

    /// Gives the dead chunk `c` a host buffer ahead of the access that writes it (its
    /// bytes unspecified, as `fill_host` leaves a dead chunk's); false when no buffer
    /// is free now (or reads queued for one come first): the next plan retries.
    fn materialize_on_host(&mut self, c: ChunkId, cause: Cause) -> bool {
        let d = c.dense();
        if self.queued_same_size(c) {
            return false;
        }
        let Ok(buf) = self.host.try_take(d as u64, self.len_bytes[d]) else {
            return false;
        };
        let slot = &mut self.slots[d];
        slot.dead = false;
        slot.host = Some(buf);
        self.host_list.push(c);
        self.host_policy.on_insert(c, cause.moment);
        self.stats.materialized_chunks += 1;
        self.stats.host_prefetch_loads += 1;
        self.emit(cause, MoveKind::Materialize, c, 0);
        true
    }
}
