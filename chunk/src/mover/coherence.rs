//! Keeping the copies coherent when a chunk changes: a change on one tier drops the
//! copies on the others; `write_back` makes a chunk's NVMe copy current without moving
//! it (closing), adoption takes a swap file's copy as the chunk's contents, and
//! `discard` forgets a chunk whose bytes are dead.
//!
//! Invariants: a present copy is current; a chunk ever materialised keeps at least one
//! current copy until it is discarded (then it is as if never written); pins are never
//! touched here.

use super::{remove_from, Cause, Mover};
use crate::accounting::MoveKind;
use crate::error::ChunkError;
use crate::id::ChunkId;
use crate::Result;

impl Mover {
    /// `c` is about to change on the device: its host and NVMe copies become stale.
    pub(super) fn dirty_on_device(&mut self, c: ChunkId, cause: Cause) {
        let d = c.dense();
        debug_assert_eq!(
            self.slots[d].host_pins, 0,
            "dropping {c}'s host copy, where it is pinned"
        );
        self.slots[d].nvme_valid = false;
        if let Some(buf) = self.slots[d].host.take() {
            drop(buf);
            self.slots[d].host_prefetched = false;
            remove_from(&mut self.host_list, c);
            self.host_policy.on_evict(c, cause.moment);
            self.emit(cause, MoveKind::Invalidate, c, 0);
        }
    }

    /// `c` is about to change in the host pool: its device and NVMe copies become stale.
    pub(super) fn dirty_on_host(&mut self, c: ChunkId, cause: Cause) {
        let d = c.dense();
        debug_assert_eq!(
            self.slots[d].dev_pins, 0,
            "dropping {c}'s device copy, where it is pinned"
        );
        self.slots[d].nvme_valid = false;
        if let Some(mem) = self.slots[d].dev.take() {
            drop(mem);
            remove_from(&mut self.dev_list, c);
            self.dev_mark[d] = false;
            self.slots[d].prefetched = false;
            self.dev_policy.on_evict(c, cause.moment);
            self.emit(cause, MoveKind::Invalidate, c, 0);
        }
    }

    /// Writes `c`'s current bytes to NVMe where its NVMe copy is not current, keeping
    /// its other copies (a device-only copy is copied to the host first): after it,
    /// a chunk ever materialised has a current NVMe copy. Synchronous. Pins are not
    /// touched: a chunk in use stays where it is.
    pub(crate) fn write_back(&mut self, c: ChunkId, cause: Cause) -> Result<()> {
        self.wait_pending(c, cause)?;
        let d = c.dense();
        let slot = &self.slots[d];
        if self.len_bytes[d] == 0 || slot.nvme_valid || (slot.host.is_none() && slot.dev.is_none())
        {
            return Ok(());
        }
        if slot.host.is_none() {
            // Both copies are current after it.
            self.ensure_host(c, cause)?;
        }
        self.ensure_nvme_slot(c, true, cause)?;
        let Some(buf) = self.slots[d].host.take() else {
            return Err(ChunkError::Invariant {
                chunk: Some(c),
                what: "no host copy to write back after loading one".into(),
            });
        };
        let len = self.len(c);
        self.note_nvme_in_flight(true);
        let (result, buf) = self.nvme.write_chunk(d as u64, buf, len);
        self.slots[d].host = Some(buf);
        if let Err(e) = result {
            // A failed write drops the chunk from the file (which refuses writes now).
            self.slots[d].nvme_stored = self.nvme.contains(d as u64);
            return Err(ChunkError::tier("writing back to NVMe", Some(c), e));
        }
        let slot = &mut self.slots[d];
        slot.nvme_stored = true;
        slot.nvme_valid = true;
        self.stats.host_to_nvme_bytes += len as u64;
        self.stats.nvme_writes += 1;
        self.emit(cause, MoveKind::HostToNvme, c, len as u64);
        Ok(())
    }

    /// Drops every copy of `c` — device memory, host buffer, NVMe slot — without writing
    /// any: its tensors are all FREE, so its bytes are dead. Its next host copy is taken
    /// from the pool unfilled (its bytes unspecified until written: a gradient chunk is
    /// overwritten by the next backward). Transfers of it in flight are waited for
    /// first. A chunk in use (pinned) is refused: FREE tensors are not in use.
    pub(crate) fn discard(&mut self, c: ChunkId, cause: Cause) -> Result<()> {
        self.wait_pending(c, cause)?;
        let d = c.dense();
        let slot = &mut self.slots[d];
        if slot.dev_pins > 0 || slot.host_pins > 0 {
            return Err(ChunkError::Invariant {
                chunk: Some(c),
                what: "discarding a chunk in use (its tensors are not all FREE)".into(),
            });
        }
        let dev = slot.dev.take();
        let host = slot.host.take();
        let stored = std::mem::take(&mut slot.nvme_stored);
        slot.nvme_valid = false;
        slot.prefetched = false;
        slot.host_prefetched = false;
        slot.read_started_at = None;
        slot.dead = true;
        if dev.is_some() {
            remove_from(&mut self.dev_list, c);
            self.dev_mark[d] = false;
            self.dev_policy.on_evict(c, cause.moment);
        }
        if host.is_some() {
            remove_from(&mut self.host_list, c);
            self.host_policy.on_evict(c, cause.moment);
        }
        drop((dev, host));
        if stored {
            self.nvme.remove(d as u64).map_err(|e| {
                ChunkError::tier("freeing a discarded chunk's NVMe slot", Some(c), e)
            })?;
        }
        self.stats.discarded_chunks += 1;
        self.emit(cause, MoveKind::Discard, c, 0);
        Ok(())
    }

    /// Adopts a chunk the swap file already stores as the chunk's contents.
    pub(crate) fn adopt_nvme(&mut self, c: ChunkId) {
        let s = &mut self.slots[c.dense()];
        s.nvme_stored = true;
        s.nvme_valid = true;
    }
}
