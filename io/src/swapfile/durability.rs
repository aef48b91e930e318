//! What is persisted when: [`SwapFile::flush`] makes data and map durable (sync, map
//! and header into the older copy, sync), the owner's layout fingerprint, the
//! clean-close flag, and poisoning after a failed write or sync.
//!
//! Invariants: the clean flag is cleared on disk before the first change after it; a
//! generation is written only into the copy not holding the newest one, map before
//! header; after any failed write or sync every later write and flush is refused
//! ([`IoError::Poisoned`]), never retried.

use super::format::{Header, Layout, ENTRY_BYTES, HEADER_COPIES, HEADER_PAGE_BYTES};
use super::SwapFile;
use crate::error::{IoError, Result};

impl SwapFile {
    /// Wait for every request in flight (their completions stay for
    /// [`SwapFile::wait`]), then make the data and the map durable: sync, write the map
    /// and header into the older copy, sync. A failure poisons the file.
    pub fn flush(&mut self) -> Result<()> {
        while let Some(c) = self.engine.wait() {
            self.on_completion(c);
        }
        self.check_not_poisoned()?;
        if !self.dirty {
            return Ok(());
        }
        self.persist_meta()
    }

    /// The owner's layout fingerprint recorded in the header, if any (see the module
    /// doc).
    pub fn layout_fingerprint(&self) -> Option<u64> {
        self.fingerprint
    }

    /// Whether the header says the file was closed cleanly and nothing changed since
    /// (see [`SwapFile::mark_clean`]).
    pub fn is_clean(&self) -> bool {
        self.clean
    }

    /// Records the owner's layout fingerprint (`None`: none). A file marked clean is
    /// first marked not clean on disk; the fingerprint itself is persisted at the next
    /// flush.
    pub fn set_layout_fingerprint(&mut self, fingerprint: Option<u64>) -> Result<()> {
        if self.fingerprint == fingerprint {
            return Ok(());
        }
        self.clear_clean()?;
        self.fingerprint = fingerprint;
        self.dirty = true;
        Ok(())
    }

    /// Flushes (see [`SwapFile::flush`]) and then persists the clean-close marker: the
    /// chunks on disk are exactly the ones written. The marker is cleared on disk before
    /// the next change. A failure poisons the file (and leaves it not clean).
    pub fn mark_clean(&mut self) -> Result<()> {
        self.flush()?;
        if self.clean {
            return Ok(());
        }
        self.clean = true;
        let result = self.persist_meta();
        if result.is_err() {
            self.clean = false;
        }
        result
    }

    /// Clears the clean-close marker on disk (header written and synced) if it is set;
    /// every change to a clean file does this first. Waits for the requests in flight
    /// (their completions stay for [`SwapFile::wait`]). A failure poisons the file.
    pub fn clear_clean(&mut self) -> Result<()> {
        if !self.clean {
            return Ok(());
        }
        self.check_not_poisoned()?;
        while let Some(c) = self.engine.wait() {
            self.on_completion(c);
        }
        self.clean = false;
        self.persist_meta()
    }

    /// Syncs the data, writes the map and header of the next generation into the older
    /// copy, and syncs again; then the quarantined slots are free. A failure poisons the
    /// file. Nothing may be in flight.
    fn persist_meta(&mut self) -> Result<()> {
        let generation = self.generation + 1;
        let result = self
            .engine
            .sync_data()
            .and_then(|()| self.write_meta(generation))
            .and_then(|()| self.engine.sync_data());
        if let Err(e) = result {
            self.poison(&e);
            return Err(e);
        }
        self.generation = generation;
        self.dirty = false;
        self.release_quarantine();
        Ok(())
    }

    pub(super) fn check_not_poisoned(&self) -> Result<()> {
        match &self.poisoned {
            Some(first_error) => Err(IoError::Poisoned {
                path: self.path.clone(),
                first_error: first_error.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(super) fn poison(&mut self, e: &IoError) {
        if self.poisoned.is_none() {
            tracing::error!(path = %self.path.display(), error = %e, "swap file poisoned: refusing further writes");
            self.poisoned = Some(e.to_string());
        }
    }

    /// Encode the map and header for `generation` and write them into copy
    /// `generation % 2` (map first: the header's checksum of the map covers a torn map).
    pub(super) fn write_meta(&mut self, generation: u64) -> Result<()> {
        let copy = generation % HEADER_COPIES;
        let map_bytes = self.layout.map_bytes as usize;
        let (Some(mut map_buf), Some(mut header_buf)) =
            (self.map_buf.take(), self.header_buf.take())
        else {
            return Err(IoError::InvalidRequest {
                reason: "swap file metadata buffers are in use".into(),
            });
        };
        map_buf[..map_bytes].fill(0);
        for (slot, e) in self.slots.iter().enumerate() {
            let at = slot * ENTRY_BYTES;
            e.encode(&mut map_buf[at..at + ENTRY_BYTES]);
        }
        let header = Header {
            generation,
            layout: self.layout,
            compression: self.compression,
            map_crc: crc32c::crc32c(&map_buf[..map_bytes]),
            fingerprint: self.fingerprint,
            clean: self.clean,
        };
        header.encode(&mut header_buf);
        let (res, map_buf) = self
            .engine
            .write_at(self.layout.map_offset(copy), map_buf, map_bytes);
        self.map_buf = Some(map_buf);
        if let Err(e) = res {
            self.header_buf = Some(header_buf);
            return Err(e);
        }
        let (res, header_buf) =
            self.engine
                .write_at(Layout::header_offset(copy), header_buf, HEADER_PAGE_BYTES);
        self.header_buf = Some(header_buf);
        res
    }
}
