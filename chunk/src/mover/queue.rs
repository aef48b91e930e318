//! The read queue: prefetch reads ([`Pending::NvmeReadQueued`]) waiting for the host
//! buffer an asynchronous write-back in flight gives back, so that a row of write-backs
//! and the reads that replace them are in flight together.
//!
//! Invariants: once settled, no more reads of one size (the host bytes their chunks
//! hold, `host_bytes`) are queued than write-backs of that size in flight
//! (`writing_held`), each owed one of their buffers — a write-back of a part of a buffer
//! gives back a part of that size, which serves a read of that size; queued reads of
//! one size start in order as buffers come back; a demand load waiting for a buffer
//! goes first (`hold_queue`), and a queued read that will not happen gives back the
//! device memory reserved for it.

use std::collections::BTreeMap;

use super::{count_down, Cause, Mover, Pending};
use crate::id::ChunkId;
use crate::Result;

impl Mover {
    /// Starts the queued reads that find a free buffer, then drops (from the back, the
    /// latest needed) those no write-back in flight will bring a buffer to: a queued
    /// read never waits for a buffer that is not coming, nor holds device memory for
    /// one. Nothing happens while a demand load waits for a buffer (`hold_queue`); it
    /// settles the queue itself once it has one.
    pub(super) fn settle_queue(&mut self) {
        if self.hold_queue {
            return;
        }
        self.start_queued_reads();
        self.trim_read_queue();
    }

    /// Starts the queued host prefetch reads that find a free buffer, in queue order
    /// within each size (not while a demand load waits for one, see `hold_queue`).
    fn start_queued_reads(&mut self) {
        let mut blocked: Vec<u64> = Vec::new();
        let mut i = 0;
        while !self.hold_queue && i < self.read_queue.len() {
            let c = self.read_queue[i];
            let d = c.dense();
            let held = self.host_bytes[d];
            if blocked.contains(&held) {
                i += 1;
                continue;
            }
            let Ok(buf) = self.host.try_take(d as u64, self.len_bytes[d]) else {
                blocked.push(held);
                i += 1;
                continue;
            };
            self.read_queue.remove(i);
            let needed_at = self.slots[d].read_needed_at;
            self.nvme.submit_read_ordered(d as u64, buf, needed_at);
            self.slots[d].pending = Pending::NvmeRead;
            self.pending_nvme += 1;
            self.note_nvme_in_flight(false);
        }
    }

    /// Drops queued reads from the back until no more of one size are queued than
    /// buffers of that size the write-backs in flight will give back.
    fn trim_read_queue(&mut self) {
        let mut queued = self.queued_held();
        let mut cancel = Vec::new();
        for &c in self.read_queue.iter().rev() {
            let held = self.host_bytes[c.dense()];
            let n = queued.entry(held).or_default();
            if *n > self.writing_held.get(&held).copied().unwrap_or(0) {
                *n -= 1;
                cancel.push(c);
            }
        }
        for c in cancel {
            self.cancel_queued(c);
        }
    }

    /// Queued reads by the host bytes their chunks hold.
    pub(super) fn queued_held(&self) -> BTreeMap<u64, usize> {
        let mut queued = BTreeMap::new();
        for c in &self.read_queue {
            *queued.entry(self.host_bytes[c.dense()]).or_default() += 1;
        }
        queued
    }

    /// Write-backs in flight whose buffers are the size `c`'s host copy holds and are
    /// not yet owed to a queued read: a read of `c` may wait in the queue for one.
    pub(super) fn writes_owing(&self, c: ChunkId) -> usize {
        let held = self.host_bytes[c.dense()];
        let writing = self.writing_held.get(&held).copied().unwrap_or(0);
        let queued = self
            .read_queue
            .iter()
            .filter(|q| self.host_bytes[q.dense()] == held)
            .count();
        writing.saturating_sub(queued)
    }

    /// Whether a read of `c` queued now would wait behind an earlier queued read of
    /// its size (it must not take a buffer first).
    pub(super) fn queued_same_size(&self, c: ChunkId) -> bool {
        let held = self.host_bytes[c.dense()];
        self.read_queue
            .iter()
            .any(|q| self.host_bytes[q.dense()] == held)
    }

    /// NVMe write-backs in flight.
    pub(super) fn pending_writes(&self) -> usize {
        self.writing_held.values().sum()
    }

    /// A write-back of chunk `d` started: its buffer comes back when it completes.
    pub(super) fn writing_back(&mut self, d: usize) {
        *self.writing_held.entry(self.host_bytes[d]).or_default() += 1;
    }

    /// A write-back of chunk `d` finished (well or not): its buffer's size is owed no
    /// more. A write nobody counted is a broken invariant.
    pub(super) fn wrote_back(&mut self, d: usize) -> Result<()> {
        let held = self.host_bytes[d];
        let mut n = self.writing_held.get(&held).copied().unwrap_or(0);
        count_down(&mut n, "NVMe write", ChunkId::from_dense(d))?;
        if n == 0 {
            self.writing_held.remove(&held);
        } else {
            self.writing_held.insert(held, n);
        }
        Ok(())
    }

    /// `c`'s queued read will not happen: nothing is pending for it any more (device
    /// memory reserved for a device prefetch is given back); it loads on demand.
    pub(super) fn cancel_queued(&mut self, c: ChunkId) {
        let d = c.dense();
        let slot = &mut self.slots[d];
        if slot.pending == Pending::NvmeReadQueued {
            slot.pending = Pending::None;
            slot.host_prefetched = false;
            slot.read_started_at = None;
            if let Some(mem) = slot.reserved_dev.take() {
                drop(mem);
                slot.prefetched = false;
                self.dev_mark[d] = false;
            }
            self.stats.prefetch_wasted += 1;
        }
        if let Some(i) = self.read_queue.iter().position(|&q| q == c) {
            self.read_queue.remove(i);
        }
    }

    /// Waits for one transfer in flight on behalf of a demand load (false when none is):
    /// a buffer it brings back goes to the load, not to the queued prefetch reads, which
    /// are then owed one fewer.
    pub(super) fn wait_for_demand(&mut self, cause: Cause) -> Result<bool> {
        self.hold_queue = true;
        let waited = self.wait_any(cause);
        self.hold_queue = false;
        self.trim_read_queue();
        waited
    }
}
