//! Untraced I/O: bytes put into a tensor and taken out through the host pool without
//! being moments of the trace (initialisation, checkpoints).
//!
//! Invariants: a tensor in COMPUTE is written only through its guard; a chunk never
//! written reads as zeros; a write marks the chunk changed in the host pool.

use tidestore_tiers::TierKind;

use crate::error::ChunkError;
use crate::id::{ListKind, TensorId};
use crate::state::TensorState;
use crate::Result;

use super::{ChunkStore, Place};

impl ChunkStore {
    /// Puts `data` (the tensor's bytes in `list`) into a tensor not in COMPUTE, through
    /// the host pool; not a moment of the trace. A FREE tensor becomes HOLD.
    pub fn write(&mut self, tensor: TensorId, list: ListKind, data: &[u8]) -> Result<()> {
        let loc = self.location(tensor, list)?;
        let local = self.local(tensor, list)?;
        if data.len() as u64 != loc.bytes() {
            return Err(ChunkError::LengthMismatch {
                tensor: self.name(tensor),
                expected_bytes: loc.bytes(),
                got_bytes: data.len() as u64,
            });
        }
        let chunk = loc.chunk;
        let from = self.list_states(list).table.state(TensorId(local));
        if from == Some(TensorState::Compute) {
            return Err(ChunkError::BadView {
                tensor: self.name(tensor),
                reason: "the tensor is in COMPUTE: write through its guard",
            });
        }
        if self.mover.pinned_on(chunk) == Some(Place::Device) {
            return Err(ChunkError::PinnedElsewhere {
                tensor: self.name(tensor),
                chunk,
                pinned_on: TierKind::Device,
            });
        }
        self.moment = self.current_moment();
        self.mover.ensure_host(chunk, self.demand())?;
        self.mover.mark_changed(chunk, Place::Host, self.demand());
        let off = loc.offset_bytes() as usize;
        let buf = self
            .mover
            .host_copy_mut(chunk)
            .ok_or_else(host_copy_missing)?;
        buf[off..off + data.len()].copy_from_slice(data);
        if from == Some(TensorState::Free) {
            self.list_states(list)
                .table
                .transition(TensorId(local), TensorState::Hold)?;
        }
        Ok(())
    }

    /// The tensor's bytes in `list` (zeros if never written; unspecified once its chunk
    /// was discarded, until written), read through the host pool; not a moment of the
    /// trace.
    pub fn read(&mut self, tensor: TensorId, list: ListKind) -> Result<Vec<u8>> {
        let loc = self.location(tensor, list)?;
        let chunk = loc.chunk;
        self.moment = self.current_moment();
        self.mover.ensure_host(chunk, self.demand())?;
        let off = loc.offset_bytes() as usize;
        let len = loc.bytes() as usize;
        let buf = self.mover.host_copy(chunk).ok_or_else(host_copy_missing)?;
        Ok(buf[off..off + len].to_vec())
    }
}

/// A chunk [`Mover::ensure_host`] just loaded has no host copy: a store bug, as an error.
fn host_copy_missing() -> ChunkError {
    ChunkError::BadView {
        tensor: String::new(),
        reason: "host copy missing after load (store bug)",
    }
}
