//! The NVMe tier: chunks in the slots of the io crate's swap file.
//!
//! Invariants:
//! - the budget is the file's slots times the slot size, fixed when the file is made;
//!   every stored chunk (or chunk whose first write is in flight) holds one whole slot,
//!   so the bytes in use are counted from the file's own free-slot count and cannot
//!   drift; the peak is sampled at every write;
//! - a write that finds no free slot is [`TierError::OverBudget`] for the NVMe tier;
//! - every read is verified against the chunk's checksum by the swap file: a chunk comes
//!   back exactly as written or as an error, never changed;
//! - buffers pass into each request and come back in its [`NvmeCompletion`], as in the
//!   io engine; bytes moved are counted when a request succeeds;
//! - the host tier's pool may be registered with the swap file's engine
//!   ([`NvmeTier::register_pool`]): requests on its buffers then use io_uring fixed
//!   buffers, and requests on any other buffer work as before.

#![deny(unsafe_code)]

use std::path::Path;

use tidestore_io::compress::Compression;
use tidestore_io::swapfile::{SwapCompletion, SwapFile};
use tidestore_io::{AlignedBuf, BufferPool, IoConfig, IoError, Op};

use crate::budget::{Budget, TierKind};
use crate::error::{Result, TierError};
use crate::stats::NvmeLinkStats;

/// A finished NVMe request: the buffer back, and what happened.
#[derive(Debug)]
pub struct NvmeCompletion {
    pub chunk: u64,
    pub op: Op,
    /// `Ok` when the chunk was written, or read and verified.
    pub result: Result<()>,
    /// The buffer handed in; after a good read its first `len_bytes` are the chunk.
    pub buf: AlignedBuf,
    /// The chunk's length in bytes (0 for a read refused before its length was known).
    pub len_bytes: usize,
}

/// The NVMe tier over one swap file.
#[derive(Debug)]
pub struct NvmeTier {
    file: SwapFile,
    peak_bytes: u64,
    links: NvmeLinkStats,
}

impl NvmeTier {
    /// Open the swap file at `path` if it exists (it must have this shape), else create
    /// it with `slot_count` slots of `slot_bytes`, reserving all its space now.
    pub fn open_or_create(
        path: &Path,
        slot_bytes: usize,
        slot_count: u32,
        cfg: &IoConfig,
        compression: Compression,
    ) -> Result<Self> {
        let file = SwapFile::open_or_create(path, slot_bytes, slot_count, cfg, compression)
            .map_err(|e| TierError::io(TierKind::Nvme, None, e))?;
        Ok(NvmeTier::from_swap_file(file))
    }

    /// Use a swap file opened by the caller (for instance over the in-memory,
    /// fault-injecting engine).
    pub fn from_swap_file(file: SwapFile) -> Self {
        let mut tier = NvmeTier {
            file,
            peak_bytes: 0,
            links: NvmeLinkStats::default(),
        };
        tier.sample_peak();
        tracing::debug!(
            path = %tier.file.path().display(),
            slots = tier.file.slot_count(),
            slot_bytes = tier.file.slot_bytes(),
            "nvme tier opened"
        );
        tier
    }

    fn capacity_bytes(&self) -> u64 {
        self.file.slot_count() as u64 * self.file.slot_bytes() as u64
    }

    /// Bytes of slots held by chunks (stored, or first written now).
    pub fn used_bytes(&self) -> u64 {
        let free = self.file.free_slots() as u64;
        (self.file.slot_count() as u64).saturating_sub(free) * self.file.slot_bytes() as u64
    }

    fn sample_peak(&mut self) {
        self.peak_bytes = self.peak_bytes.max(self.used_bytes());
    }

    /// Capacity, used and peak bytes as a [`Budget`].
    pub fn budget(&self) -> Budget {
        Budget::from_parts(
            TierKind::Nvme,
            self.capacity_bytes(),
            self.used_bytes(),
            self.peak_bytes,
        )
    }

    /// Restart peak tracking from what is in use now.
    pub fn reset_peak(&mut self) {
        self.peak_bytes = self.used_bytes();
    }

    /// Bytes moved between host and NVMe.
    pub fn link_stats(&self) -> NvmeLinkStats {
        self.links
    }

    /// Size of every slot: the largest chunk the tier holds.
    pub fn slot_bytes(&self) -> usize {
        self.file.slot_bytes()
    }

    /// Number of slots.
    pub fn slot_count(&self) -> u32 {
        self.file.slot_count()
    }

    /// Whether `chunk` is stored.
    pub fn contains(&self, chunk: u64) -> bool {
        self.file.contains(chunk)
    }

    /// Length of stored `chunk`.
    pub fn len_of(&self, chunk: u64) -> Option<usize> {
        self.file.len_of(chunk)
    }

    /// Requests submitted and not yet handed back.
    pub fn outstanding(&self) -> usize {
        self.file.outstanding()
    }

    /// The swap file underneath.
    pub fn swap_file(&self) -> &SwapFile {
        &self.file
    }

    /// Register `pool` (the host tier's) with the swap file's engine as io_uring fixed
    /// buffers; returns whether it took (see `SwapFile::register_pool`). Requests on
    /// other buffers are unaffected.
    pub fn register_pool(&mut self, pool: &BufferPool) -> Result<bool> {
        self.file
            .register_pool(pool)
            .map_err(|e| TierError::io(TierKind::Nvme, None, e))
    }

    /// Turn an io error into the tier's error: a full file is the NVMe budget exceeded.
    fn error(&self, chunk: u64, e: IoError) -> TierError {
        match e {
            IoError::SwapFull { .. } => TierError::OverBudget {
                tier: TierKind::Nvme,
                needed_bytes: self.file.slot_bytes() as u64,
                free_bytes: self.capacity_bytes() - self.used_bytes(),
                capacity_bytes: self.capacity_bytes(),
            },
            IoError::UnknownChunk { chunk } => TierError::UnknownChunk {
                tier: TierKind::Nvme,
                chunk,
            },
            other => TierError::io(TierKind::Nvme, Some(chunk), other),
        }
    }

    fn account(&mut self, op: Op, ok: bool, len_bytes: usize) {
        if !ok {
            self.links.failed += 1;
            return;
        }
        match op {
            Op::Write => {
                self.links.host_to_nvme_bytes += len_bytes as u64;
                self.links.writes += 1;
            }
            Op::Read => {
                self.links.nvme_to_host_bytes += len_bytes as u64;
                self.links.reads += 1;
            }
        }
    }

    fn complete(&mut self, c: SwapCompletion) -> NvmeCompletion {
        self.account(c.op, c.result.is_ok(), c.len_bytes);
        let result = c.result.map_err(|e| self.error(c.chunk, e));
        NvmeCompletion {
            chunk: c.chunk,
            op: c.op,
            result,
            buf: c.buf,
            len_bytes: c.len_bytes,
        }
    }

    /// Write the first `len_bytes` of `buf` as `chunk` and wait for it.
    pub fn write_chunk(
        &mut self,
        chunk: u64,
        buf: AlignedBuf,
        len_bytes: usize,
    ) -> (Result<()>, AlignedBuf) {
        let (result, buf) = self.file.write_chunk(chunk, buf, len_bytes);
        self.sample_peak();
        self.account(Op::Write, result.is_ok(), len_bytes);
        (result.map_err(|e| self.error(chunk, e)), buf)
    }

    /// Read `chunk` into `buf`, verify it, and return its length.
    pub fn read_chunk(&mut self, chunk: u64, buf: AlignedBuf) -> (Result<usize>, AlignedBuf) {
        let (result, buf) = self.file.read_chunk(chunk, buf);
        match result {
            Ok(len) => {
                self.account(Op::Read, true, len);
                (Ok(len), buf)
            }
            Err(e) => {
                self.account(Op::Read, false, 0);
                (Err(self.error(chunk, e)), buf)
            }
        }
    }

    /// Start writing `chunk`; the completion comes from [`NvmeTier::poll`] or
    /// [`NvmeTier::wait`].
    pub fn submit_write(&mut self, chunk: u64, buf: AlignedBuf, len_bytes: usize) {
        self.file.submit_write(chunk, buf, len_bytes);
        self.sample_peak();
    }

    /// Start reading `chunk` into `buf`.
    pub fn submit_read(&mut self, chunk: u64, buf: AlignedBuf) {
        self.file.submit_read(chunk, buf);
    }

    /// A finished request if there is one, without waiting.
    pub fn poll(&mut self) -> Option<NvmeCompletion> {
        let c = self.file.poll()?;
        Some(self.complete(c))
    }

    /// The next finished request, waiting for it; `None` when nothing is outstanding.
    pub fn wait(&mut self) -> Option<NvmeCompletion> {
        let c = self.file.wait()?;
        Some(self.complete(c))
    }

    /// Forget `chunk` and free its slot.
    pub fn remove(&mut self, chunk: u64) -> Result<()> {
        self.file.remove(chunk).map_err(|e| self.error(chunk, e))
    }

    /// Make everything written so far durable (see `SwapFile::flush`).
    pub fn flush(&mut self) -> Result<()> {
        self.file
            .flush()
            .map_err(|e| TierError::io(TierKind::Nvme, None, e))
    }

    /// The owner's layout fingerprint recorded in the swap file, if any.
    pub fn layout_fingerprint(&self) -> Option<u64> {
        self.file.layout_fingerprint()
    }

    /// Whether the swap file was closed cleanly and nothing changed since (see
    /// `SwapFile::mark_clean`).
    pub fn is_clean(&self) -> bool {
        self.file.is_clean()
    }

    /// Records the owner's layout fingerprint (see `SwapFile::set_layout_fingerprint`).
    pub fn set_layout_fingerprint(&mut self, fingerprint: Option<u64>) -> Result<()> {
        self.file
            .set_layout_fingerprint(fingerprint)
            .map_err(|e| TierError::io(TierKind::Nvme, None, e))
    }

    /// Flushes and persists the clean-close marker (see `SwapFile::mark_clean`).
    pub fn mark_clean(&mut self) -> Result<()> {
        self.file
            .mark_clean()
            .map_err(|e| TierError::io(TierKind::Nvme, None, e))
    }

    /// Clears the clean-close marker on disk if it is set (see `SwapFile::clear_clean`).
    pub fn clear_clean(&mut self) -> Result<()> {
        self.file
            .clear_clean()
            .map_err(|e| TierError::io(TierKind::Nvme, None, e))
    }
}
