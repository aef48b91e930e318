//! The swap file: one preallocated file of fixed-size chunk slots, with a stable
//! chunk→slot map, a crc32c per chunk and optional compression.
//!
//! # Layout (all offsets 4096-aligned, so the file can be used with O_DIRECT)
//! ```text
//! [0, 4096)            header copy 0   magic, version, generation, shape, map crc,
//!                                      owner's layout fingerprint, clean flag, crc
//! [4096, 8192)         header copy 1
//! [8192, +map)         map copy 0      one 32-byte entry per slot
//! [.., +map)           map copy 1
//! [data, +slots)       slot i at data_offset + i * slot_bytes (data_offset 1 MiB aligned)
//! ```
//! A map entry is `chunk u64, len_bytes u64, stored_bytes u64, crc32c u32, flags u32`
//! (little endian). `crc32c` covers the `stored_bytes` actually kept in the slot: the
//! chunk itself, or its compressed image when compression shrank it (flag bit 1).
//!
//! # What is persisted when, and what survives a crash
//! The map lives in memory and is written by [`SwapFile::flush`] (and on drop): flush
//! waits for every request in flight, `fdatasync`s the data, writes the map and header
//! into the copy *not* holding the newest generation, and syncs again. Opening picks the
//! valid copy (magic, version, header and map checksums) with the highest generation, so
//! a crash during a flush falls back to the previous flush.
//!
//! After a crash the file holds the chunks as of the last completed flush. A chunk
//! overwritten in place after that flush (the optimizer rewrites M and V every step) may
//! hold a mix of old and new bytes: its checksum no longer matches and reading it gives
//! [`IoError::Corrupt`](crate::error::IoError::Corrupt) — never wrong bytes. Chunks written for the first time after the
//! last flush are simply absent. Slots freed by [`SwapFile::remove`] are not reused until
//! the next flush (while others are free), so a crash cannot make a removed chunk's old
//! entry point at another chunk's bytes.
//!
//! # Owner's fingerprint and the clean-close marker
//! The header also keeps an opaque 64-bit *layout fingerprint* set by the file's owner
//! ([`SwapFile::set_layout_fingerprint`]; the chunk store stores its layout's) and a
//! *clean* flag. [`SwapFile::mark_clean`] flushes and persists the flag set: it says the
//! chunks on disk are exactly what the owner last wrote. The flag is cleared on disk
//! (header written and synced) before the first change after it — a write, a removal, a
//! new fingerprint, or [`SwapFile::clear_clean`] — so a crash after that change is never
//! read back as a clean close.
//!
//! # Invariants
//! - the file never grows after creation: every slot is reserved (fallocate) up front;
//! - a chunk keeps its slot for as long as it is stored, across flushes and reopenings;
//! - every read is checked against the checksum taken when the chunk was written;
//! - a caller's buffer is never changed by a write (compression works in scratch buffers
//!   made at open);
//! - at most one request per chunk is in flight; a second one completes at once with an
//!   error;
//! - a file-backed swap file is locked (`flock`, exclusive) while it is open, so a
//!   second owner (another process sharing `nvme.dir`) gets a setup error instead of
//!   overwriting chunks under the first;
//! - checksums are taken by the engine as each request's pieces complete (see
//!   [`Engine::submit_checksummed`]), so neither a write nor the verification of a read
//!   waits for a whole-chunk checksum pass;
//! - after any failed write or sync the file is *poisoned*: every later write and flush
//!   fails with [`IoError::Poisoned`](crate::error::IoError::Poisoned) (no retry: the kernel may have dropped the dirty
//!   pages), while chunks written before stay readable. The chunk whose write failed is
//!   dropped from the map (reading it gives [`IoError::UnknownChunk`](crate::error::IoError::UnknownChunk)).
//!
//! # Files, one concept each
//! - `format`: the on-disk layout, header and map entries (encode, decode, check);
//! - `open`: creating, formatting and opening a file (picking the newest valid copy);
//! - `slots`: the chunk→slot table (claims, removals, the quarantine of freed slots);
//! - `submit`: requests going in (checks, compression, tokens) and waiting for them;
//! - `complete`: engine completions coming back (map updates, checksums, decompression);
//! - `durability`: flush, the owner's fingerprint and clean flag, poisoning.

mod complete;
mod durability;
mod format;
mod open;
mod slots;
mod submit;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};

use crate::buffer::{AlignedBuf, BufferPool};
use crate::compress::{Codec, Compression};
use crate::engine::Engine;
use crate::error::{Op, Result};

use format::{Layout, SlotEntry};
pub use format::{MAGIC, VERSION};

/// Compressed images that may be in flight at once (each a buffer of the zstd bound of a
/// slot, made at open). A compressed write waits for one to come back when all are out.
pub const COMPRESS_WRITE_BUFFERS: usize = 2;

/// A finished swap-file request: the caller's buffer back, and what happened.
#[derive(Debug)]
pub struct SwapCompletion {
    pub chunk: u64,
    pub op: Op,
    /// `Ok` when the chunk was written (durable at the next flush), or read and verified.
    pub result: Result<()>,
    /// The buffer handed in; after a good read its first `len_bytes` are the chunk.
    pub buf: AlignedBuf,
    /// The chunk's length in bytes (0 for a read refused before its length was known).
    pub len_bytes: usize,
    token: u64,
}

/// A request handed to the engine.
#[derive(Debug)]
struct InFlight {
    /// The request's token: slab index in the low 32 bits, a sequence number above, so
    /// a token is never reused while an older completion with it may still be queued.
    token: u64,
    chunk: u64,
    slot: u32,
    op: Op,
    len_bytes: usize,
    stored_bytes: usize,
    crc: u32,
    compressed: bool,
    /// The caller's buffer while its compressed image (from `write_bufs`) is written.
    held: Option<AlignedBuf>,
}

/// A preallocated file of fixed-size chunk slots. See the module documentation.
pub struct SwapFile {
    engine: Engine,
    path: PathBuf,
    layout: Layout,
    compression: Compression,
    codec: Option<Codec>,
    /// Shuffle output before compressing, zstd output before unshuffling (slot_bytes).
    scratch: Option<AlignedBuf>,
    /// Destinations of compressed images, each of the zstd bound of a slot.
    write_bufs: Vec<AlignedBuf>,
    slots: Vec<SlotEntry>,
    /// Chunk → slot, for stored chunks and chunks whose first write is in flight.
    map: HashMap<u64, u32>,
    /// Free slots, lowest last (popped first).
    free: Vec<u32>,
    /// Slots freed since the last flush: the persisted map may still name them.
    quarantine: Vec<u32>,
    in_flight: Vec<Option<InFlight>>,
    free_tokens: Vec<u32>,
    ready: VecDeque<SwapCompletion>,
    next_refused: u64,
    /// Sequence number of the last tracked request (see `InFlight::token`).
    next_seq: u64,
    generation: u64,
    dirty: bool,
    /// The owner's layout fingerprint (persisted in the header).
    fingerprint: Option<u64>,
    /// The header on disk says clean (see the module doc): nothing changed since.
    clean: bool,
    poisoned: Option<String>,
    header_buf: Option<AlignedBuf>,
    map_buf: Option<AlignedBuf>,
    /// Whether [`SwapFile::register_pool`] may register buffers (`io.fixed_buffers`).
    fixed_buffers: bool,
    /// The exclusive lock on a file-backed swap file, held while it is open.
    _lock: Option<std::fs::File>,
}

impl std::fmt::Debug for SwapFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapFile")
            .field("path", &self.path)
            .field("slot_bytes", &self.layout.slot_bytes)
            .field("slot_count", &self.layout.slot_count)
            .field("chunks", &self.len())
            .field("compression", &self.compression)
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

impl SwapFile {
    // ---------------------------------------------------------------- accessors

    /// The file's path (or `<memory>` for an engine-backed one).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size of every slot.
    pub fn slot_bytes(&self) -> usize {
        self.layout.slot_bytes as usize
    }

    /// Number of slots.
    pub fn slot_count(&self) -> u32 {
        self.layout.slot_count
    }

    /// Total size of the file (fixed at creation).
    pub fn file_bytes(&self) -> u64 {
        self.layout.file_bytes()
    }

    /// File offset of `slot`'s first byte.
    pub fn slot_offset_bytes(&self, slot: u32) -> u64 {
        self.layout.slot_offset(slot)
    }

    /// The compression setting (restored from the header on open).
    pub fn compression(&self) -> Compression {
        self.compression
    }

    /// Whether an earlier write or sync failed (writes are refused).
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.is_some()
    }

    /// Requests finished whose completion [`SwapFile::poll`] / [`SwapFile::wait`] has
    /// not returned yet.
    pub fn finished(&self) -> usize {
        self.ready.len()
    }

    /// Requests submitted whose completion [`SwapFile::wait`] has not returned yet.
    pub fn outstanding(&self) -> usize {
        self.in_flight.len() - self.free_tokens.len() + self.ready.len()
    }

    /// The engine underneath (backend kind, block size).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Register `pool` (the buffers chunks are read into and written from) with the
    /// engine, so requests on its buffers become io_uring `READ_FIXED` / `WRITE_FIXED`
    /// (no page pinning per request). Returns whether it took: `false` when
    /// `io.fixed_buffers` is off, on backends without fixed buffers, or when the kernel
    /// refuses (RLIMIT_MEMLOCK; logged). Buffers of other pools keep working as plain
    /// requests. Waits for every request in flight first (registration needs an idle
    /// ring); their completions stay for [`SwapFile::wait`].
    pub fn register_pool(&mut self, pool: &BufferPool) -> Result<bool> {
        if !self.fixed_buffers {
            return Ok(false);
        }
        while let Some(c) = self.engine.wait() {
            self.on_completion(c);
        }
        self.engine.register_pool(pool)
    }
}

impl Drop for SwapFile {
    /// Flush the map unless the file is poisoned; errors are logged (drop cannot return
    /// them: call [`SwapFile::flush`] to see them).
    fn drop(&mut self) {
        if self.poisoned.is_some() || !self.dirty {
            return;
        }
        if let Err(e) = self.flush() {
            tracing::error!(path = %self.path.display(), error = %e, "swap file flush on drop failed");
        }
    }
}
