//! The chunk→slot table: which slot holds which chunk, which slots are free, and the
//! quarantine of slots freed since the last flush.
//!
//! Invariants: a chunk keeps its slot for as long as it is stored; `map` names every
//! stored chunk and every chunk whose first write is in flight; a removed slot waits in
//! the quarantine until the next flush (the persisted map may still name it) unless no
//! other slot is free; free slots are handed out lowest first.

use super::{SlotEntry, SwapFile};
use crate::error::{IoError, Result};

impl SwapFile {
    /// Whether `chunk` is stored (its write completed and it was not removed).
    pub fn contains(&self, chunk: u64) -> bool {
        self.entry(chunk).is_some()
    }

    /// Length in bytes of stored `chunk`.
    pub fn len_of(&self, chunk: u64) -> Option<usize> {
        self.entry(chunk).map(|(_, e)| e.len_bytes as usize)
    }

    /// Slot holding stored `chunk`.
    pub fn slot_of(&self, chunk: u64) -> Option<u32> {
        self.entry(chunk).map(|(s, _)| s)
    }

    /// Bytes `chunk` takes in its slot (less than its length when compressed).
    pub fn stored_bytes_of(&self, chunk: u64) -> Option<usize> {
        self.entry(chunk).map(|(_, e)| e.stored_bytes as usize)
    }

    /// Number of chunks stored.
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|e| e.used).count()
    }

    /// Whether no chunk is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stored chunks and their slots, in slot order.
    pub fn chunks(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, e)| e.used)
            .map(|(s, e)| (e.chunk, s as u32))
    }

    /// Slots free for new chunks (including ones freed since the last flush).
    pub fn free_slots(&self) -> usize {
        self.free.len() + self.quarantine.len()
    }
    pub(super) fn entry(&self, chunk: u64) -> Option<(u32, &SlotEntry)> {
        let &slot = self.map.get(&chunk)?;
        let e = &self.slots[slot as usize];
        e.used.then_some((slot, e))
    }

    /// A slot for writing `chunk`: its own (`false`), else a free one, a quarantined one
    /// when none is free (`true`: newly claimed, not yet in the map); `None` when the
    /// file is full.
    pub(super) fn claim_slot(&mut self, chunk: u64) -> Option<(u32, bool)> {
        match self.map.get(&chunk) {
            Some(&slot) => Some((slot, false)),
            None => self
                .free
                .pop()
                .or_else(|| self.quarantine.pop())
                .map(|slot| (slot, true)),
        }
    }

    /// Forget `chunk` and free its slot (reused after the next flush, or sooner when no
    /// other slot is free). Persisted at the next flush.
    pub fn remove(&mut self, chunk: u64) -> Result<()> {
        let Some(&slot) = self.map.get(&chunk) else {
            return Err(IoError::UnknownChunk { chunk });
        };
        if self.slots[slot as usize].busy {
            return Err(IoError::InvalidRequest {
                reason: format!(
                    "chunk {chunk} cannot be removed while a request on it is in flight"
                ),
            });
        }
        self.clear_clean()?;
        self.slots[slot as usize] = SlotEntry::default();
        self.map.remove(&chunk);
        self.quarantine.push(slot);
        self.dirty = true;
        Ok(())
    }

    /// The persisted map no longer names the quarantined slots: they are free.
    pub(super) fn release_quarantine(&mut self) {
        while let Some(slot) = self.quarantine.pop() {
            self.free.push(slot);
        }
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }
}
