//! The NVMe side of the moves: routing read and write completions into their chunks'
//! slots, the stash of completions an [`IoPump`] took while views were lent out, and
//! synchronous requests made beside asynchronous ones.
//!
//! Invariants: a finished read puts the chunk's host copy back (and starts the copy to
//! device memory reserved for it); a finished write-back makes the NVMe copy current and
//! gives its buffer to the read queue, a failed one puts the buffer back as the chunk's
//! only current copy. A synchronous request may start while asynchronous completions are
//! queued: the swap file's tokens carry a sequence number, so the request waits for its
//! own completion, never a finished earlier one's.

use std::collections::VecDeque;

use tidestore_io::Op;
use tidestore_tiers::nvme::NvmeCompletion;
use tidestore_tiers::NvmeTier;

use super::{count_down, Cause, Mover, Pending, Slot};
use crate::accounting::MoveKind;
use crate::error::ChunkError;
use crate::id::ChunkId;
use crate::Result;

impl Mover {
    pub(super) fn route_nvme(&mut self, c: NvmeCompletion, cause: Cause) -> Result<()> {
        if c.op == Op::Write {
            return self.route_nvme_write(c, cause);
        }
        let chunk = ChunkId::from_dense(c.chunk as usize);
        let d = chunk.dense();
        let counted = count_down(&mut self.pending_nvme, "NVMe request", chunk);
        let slot = &mut self.slots[d];
        slot.pending = Pending::None;
        let reserved = slot.reserved_dev.take();
        match c.result {
            Ok(()) => {
                slot.host = Some(c.buf);
                self.host_list.push(chunk);
                self.host_policy.on_insert(chunk, cause.moment);
                self.stats.nvme_to_host_bytes += c.len_bytes as u64;
                self.stats.nvme_reads += 1;
                self.emit(cause, MoveKind::NvmeToHost, chunk, c.len_bytes as u64);
                if let Some(mem) = reserved {
                    self.start_h2d(chunk, mem)?;
                }
                counted
            }
            Err(e) => {
                self.dev_mark[d] = false;
                slot.prefetched = false;
                slot.host_prefetched = false;
                slot.read_started_at = None;
                drop(reserved);
                drop(c.buf);
                counted?;
                Err(ChunkError::tier("reading from NVMe", Some(chunk), e))
            }
        }
    }

    /// An asynchronous write-back finished: the NVMe copy is current and the buffer
    /// goes back to the pool; on failure the buffer goes back into the slot (still the
    /// chunk's only current copy).
    fn route_nvme_write(&mut self, c: NvmeCompletion, cause: Cause) -> Result<()> {
        let chunk = ChunkId::from_dense(c.chunk as usize);
        let d = chunk.dense();
        let counted =
            count_down(&mut self.pending_nvme, "NVMe request", chunk).and(self.wrote_back(d));
        // After a failed write the file no longer stores the chunk.
        let still_stored = self.nvme.contains(c.chunk);
        let slot = &mut self.slots[d];
        slot.pending = Pending::None;
        match c.result {
            Ok(()) => {
                drop(c.buf);
                slot.nvme_stored = true;
                slot.nvme_valid = true;
                self.stats.host_to_nvme_bytes += c.len_bytes as u64;
                self.stats.nvme_writes += 1;
                self.emit(cause, MoveKind::HostToNvme, chunk, c.len_bytes as u64);
                // Its buffer is back: the read owed it starts now.
                self.settle_queue();
                counted
            }
            Err(e) => {
                slot.nvme_stored = still_stored;
                slot.host = Some(c.buf);
                self.host_list.push(chunk);
                self.host_policy.on_insert(chunk, cause.moment);
                // One buffer fewer comes back than the queue was promised.
                self.settle_queue();
                counted?;
                Err(ChunkError::tier("writing to NVMe", Some(chunk), e))
            }
        }
    }

    /// The next NVMe completion: one an [`IoPump`] took first, else a finished one.
    pub(super) fn nvme_poll(&mut self) -> Option<NvmeCompletion> {
        self.nvme_stash.pop_front().or_else(|| self.nvme.poll())
    }

    /// The next NVMe completion, waiting for one; `None` when nothing is in flight.
    pub(super) fn nvme_wait(&mut self) -> Option<NvmeCompletion> {
        self.nvme_stash.pop_front().or_else(|| self.nvme.wait())
    }

    /// Keeps NVMe transfers moving while the chunks' buffers are lent out (see
    /// [`IoPump`]).
    pub(crate) fn pump_parts(&mut self) -> (&mut Vec<Slot>, IoPump<'_>) {
        (
            &mut self.slots,
            IoPump {
                nvme: &mut self.nvme,
                stash: &mut self.nvme_stash,
                active: self.pending_nvme > 0,
            },
        )
    }

    /// One more NVMe request is in flight (`pending_nvme` already counts it, or `sync`:
    /// a synchronous one beside those).
    pub(super) fn note_nvme_in_flight(&mut self, sync: bool) {
        let n = self.pending_nvme as u64 + u64::from(sync);
        self.stats.nvme_in_flight_max = self.stats.nvme_in_flight_max.max(n);
    }
}

/// Keeps NVMe transfers moving while the store's chunk buffers are lent out as views
/// ([`crate::ChunkStore::views_mut_with_io`]): a request starts in pieces of the I/O
/// block size, at most the queue depth at once, and the next pieces start only when the
/// engine is polled. [`IoPump::poll`] polls it; completions are kept and routed into
/// their chunks at the store's next call.
pub struct IoPump<'a> {
    nvme: &'a mut NvmeTier,
    stash: &'a mut VecDeque<NvmeCompletion>,
    active: bool,
}

impl std::fmt::Debug for IoPump<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoPump")
            .field("active", &self.active)
            .field("stashed", &self.stash.len())
            .finish()
    }
}

impl IoPump<'_> {
    /// Starts queued NVMe pieces and takes finished requests, without waiting. Cheap
    /// when nothing is in flight.
    pub fn poll(&mut self) {
        if !self.active {
            return;
        }
        while let Some(c) = self.nvme.poll() {
            self.stash.push_back(c);
        }
    }
}
