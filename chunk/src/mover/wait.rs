//! Collecting transfers in flight: without waiting ([`Mover::harvest`]), one at a time,
//! until nothing is in flight for one chunk, or until nothing is in flight at all.
//!
//! Invariants: every completion is routed into its chunk's slot whoever waits for it;
//! the first error is returned after every other completion has been routed; a count of
//! transfers in flight with none outstanding is a broken invariant, not a hang.

use super::{Cause, Mover, Pending};
use crate::error::ChunkError;
use crate::id::ChunkId;
use crate::Result;

impl Mover {
    /// Collects finished transfers without waiting.
    pub(crate) fn harvest(&mut self, cause: Cause) -> Result<()> {
        let mut first_err = None;
        if self.pending_copies > 0 {
            while let Some(c) = self.device.poll_copy() {
                if let Err(e) = self.route_copy(c, cause) {
                    first_err.get_or_insert(e);
                }
            }
        }
        if self.pending_nvme > 0 {
            while let Some(c) = self.nvme_poll() {
                if let Err(e) = self.route_nvme(c, cause) {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.settle_queue();
        first_err.map_or(Ok(()), Err)
    }

    /// Waits for one transfer in flight; false when none is.
    pub(super) fn wait_any(&mut self, cause: Cause) -> Result<bool> {
        if self.pending_nvme > 0 {
            if let Some(c) = self.nvme_wait() {
                self.route_nvme(c, cause)?;
                return Ok(true);
            }
            return Err(none_outstanding(self.pending_nvme, "NVMe requests"));
        }
        if self.pending_copies > 0 {
            if let Some(c) = self.device.wait_copy() {
                self.route_copy(c, cause)?;
                return Ok(true);
            }
            return Err(none_outstanding(self.pending_copies, "device copies"));
        }
        Ok(false)
    }

    /// Waits until nothing is in flight for `c`.
    pub(super) fn wait_pending(&mut self, c: ChunkId, cause: Cause) -> Result<()> {
        loop {
            match self.slots[c.dense()].pending {
                Pending::None => return Ok(()),
                Pending::HostToDevice(id) | Pending::DeviceToHost(id) => {
                    let done = self.wait_copy_id(id, c, cause)?;
                    self.route_copy(done, cause)?;
                }
                Pending::NvmeRead | Pending::NvmeWrite => {
                    if !self.wait_any(cause)? {
                        return Err(ChunkError::Invariant {
                            chunk: Some(c),
                            what: "an NVMe transfer is pending but nothing is in flight".into(),
                        });
                    }
                }
                Pending::NvmeReadQueued => {
                    // Write-backs completing give buffers to the queue (in order); with
                    // nothing left in flight, the read is not coming: load on demand.
                    self.settle_queue();
                    if self.slots[c.dense()].pending == Pending::NvmeReadQueued
                        && !self.wait_any(cause)?
                    {
                        self.cancel_queued(c);
                    }
                }
            }
        }
    }

    /// Waits for every transfer in flight. Queued reads start as write-backs finish and
    /// are waited for too; any that still find no buffer at the end are dropped (loaded
    /// on demand later).
    pub(crate) fn wait_all(&mut self, cause: Cause) -> Result<()> {
        let mut first_err = None;
        loop {
            match self.wait_any(cause) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        while let Some(c) = self.read_queue.pop_front() {
            self.cancel_queued(c);
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// The broken invariant of `counted` transfers (`what`) in flight with none outstanding.
fn none_outstanding(counted: usize, what: &str) -> ChunkError {
    ChunkError::Invariant {
        chunk: None,
        what: format!("{counted} {what} counted in flight, none outstanding"),
    }
}
