//! The read queue: prefetch reads ([`Pending::NvmeReadQueued`]) waiting for the host
//! buffer an asynchronous write-back in flight gives back, so that a row of write-backs
//! and the reads that replace them are in flight together.
//!
//! Invariants: once settled, no more reads are queued than write-backs in flight
//! (`pending_writes`), each owed one of their buffers; queued reads start in order as
//! buffers come back; a demand load waiting for a buffer goes first (`hold_queue`), and
//! a queued read that will not happen gives back the device memory reserved for it.

use super::{Mover, Pending};
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
    /// (not while a demand load waits for one, see `hold_queue`).
    fn start_queued_reads(&mut self) {
        while !self.hold_queue {
            let Some(&c) = self.read_queue.front() else {
                return;
            };
            let d = c.dense();
            let Ok(buf) = self.host.try_take(d as u64) else {
                return;
            };
            self.read_queue.pop_front();
            self.nvme.submit_read(d as u64, buf);
            self.slots[d].pending = Pending::NvmeRead;
            self.pending_nvme += 1;
            self.note_nvme_in_flight(false);
        }
    }

    /// Drops queued reads from the back until no more are queued than buffers the
    /// write-backs in flight will give back.
    fn trim_read_queue(&mut self) {
        while self.read_queue.len() > self.pending_writes {
            if let Some(c) = self.read_queue.pop_back() {
                self.cancel_queued(c);
            }
        }
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
    pub(super) fn wait_for_demand(&mut self) -> Result<bool> {
        self.hold_queue = true;
        let waited = self.wait_any();
        self.hold_queue = false;
        self.trim_read_queue();
        waited
    }
}
