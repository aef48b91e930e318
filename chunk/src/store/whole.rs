//! Whole-store operations: moving the I/O on, waiting for it, evicting the device,
//! and closing cleanly (every chunk written back, the swap file marked clean) or not
//! (dropped: transfers waited for, the file left not clean).
//!
//! Invariant: a swap file is marked clean only after every chunk ever written has a
//! current NVMe copy.

use tidestore_tiers::TierKind;

use crate::accounting::MoveReason;
use crate::error::ChunkError;
use crate::Result;

use super::ChunkStore;

impl ChunkStore {
    /// Moves the store's transfers on without waiting: finished NVMe reads and writes
    /// and device copies are taken in, and queued requests started. The store's I/O
    /// advances only inside its calls, so a caller whose own work runs for a while (a
    /// device computing) calls this now and then to keep the disk busy.
    pub fn poll_io(&mut self) -> Result<()> {
        self.mover.harvest(self.demand())
    }

    /// Waits for every transfer in flight.
    pub fn sync(&mut self) -> Result<()> {
        self.mover.wait_all(self.demand())
    }

    /// Moves every chunk not in use off the device (written back where the device copy
    /// is the only current one).
    pub fn evict_device_all(&mut self) -> Result<()> {
        self.mover.wait_all(self.demand())?;
        self.mover
            .evict_device_unpinned(self.cause(MoveReason::Explicit))
    }

    /// Closes the store cleanly: waits for every transfer, writes every chunk whose NVMe
    /// copy is not current (from its device or host copy) to NVMe, syncs, and marks the
    /// swap file clean, so that a store opened later on it with [`StoreConfig::adopt`](crate::config::StoreConfig::adopt)
    /// gets these bytes back. Tensors still in COMPUTE do not stop it (their bytes are
    /// written as they are). It needs an NVMe slot for every chunk ever written
    /// ([`ChunkError::TierFull`] for the NVMe tier otherwise). On any error the file
    /// stays not clean; so does a store dropped without `close`.
    pub fn close(mut self) -> Result<()> {
        self.mover.wait_all(self.demand())?;
        self.verify()?;
        let kept = self.mover.materialised();
        let slot_count = self.mover.nvme().slot_count() as usize;
        if kept.len() > slot_count {
            let slot_bytes = self.mover.nvme().slot_bytes() as u64;
            return Err(ChunkError::TierFull {
                tier: TierKind::Nvme,
                chunk: kept[slot_count],
                needed_bytes: kept.len() as u64 * slot_bytes,
                capacity_bytes: slot_count as u64 * slot_bytes,
            });
        }
        let cause = self.cause(MoveReason::Explicit);
        for &c in &kept {
            self.mover.write_back(c, cause)?;
        }
        self.mover.wait_all(cause)?;
        for &c in &kept {
            if !self.mover.nvme_current(c) {
                return Err(ChunkError::Invariant {
                    chunk: Some(c),
                    what: "NVMe copy not current after writing every chunk back".into(),
                });
            }
        }
        self.mover.mark_swap_clean()?;
        tracing::info!(chunks = kept.len(), "chunk store closed cleanly");
        Ok(())
    }
}

impl Drop for ChunkStore {
    fn drop(&mut self) {
        if let Err(e) = self.mover.wait_all(self.demand()) {
            tracing::warn!(error = %e, "chunk store: a transfer failed while closing");
        }
    }
}
