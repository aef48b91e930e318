//! What the chunk store counts, as plain data the binary prints, and the per-move
//! events a test (or a tracer) can watch.
//!
//! [`StoreStats`] counts bytes moved per link and direction (device↔host,
//! host↔NVMe), evictions per tier (and how many of them needed no write because the
//! chunk was still valid below), prefetches and prefetch hits, time stalled waiting for
//! a chunk, and, when taken with [`crate::ChunkStore::stats`], each tier's capacity, use
//! and peak. Bytes are counted when a move has finished successfully.
//!
//! A [`MoveHook`] is called after every move and every eviction with a [`MoveEvent`]:
//! the move, its reason, and every tier's use at that instant. This is how the property
//! tests check that no tier is ever over its budget *at every move*, and that a
//! prefetch never evicts a chunk needed sooner than the one it brings.

use std::fmt;

use tidestore_tiers::TierUsage;

use crate::id::ChunkId;

/// Counters of a chunk store since it opened (or since [`crate::ChunkStore::reset_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Bytes copied host -> device.
    pub host_to_device_bytes: u64,
    /// Bytes copied device -> host (write-backs of chunks changed on the device).
    pub device_to_host_bytes: u64,
    /// Bytes read from NVMe into host buffers.
    pub nvme_to_host_bytes: u64,
    /// Bytes written from host buffers to NVMe.
    pub host_to_nvme_bytes: u64,
    /// Copies host -> device.
    pub host_to_device_copies: u64,
    /// Copies device -> host.
    pub device_to_host_copies: u64,
    /// Chunk reads from NVMe.
    pub nvme_reads: u64,
    /// Chunk writes to NVMe.
    pub nvme_writes: u64,
    /// Chunks that left the device (tier over budget, tide going out, explicit).
    pub device_evictions: u64,
    /// Of those, chunks dropped without a copy: still valid on host or NVMe.
    pub device_clean_evictions: u64,
    /// Chunks that left the host pool.
    pub host_evictions: u64,
    /// Of those, chunks dropped without a write: still valid on the device or NVMe.
    pub host_clean_evictions: u64,
    /// Chunks first touched and initialised to zeros (after a discard: given a buffer
    /// unfilled).
    pub materialized_chunks: u64,
    /// Chunks discarded: their tensors all FREE, every copy dropped unwritten.
    pub discarded_chunks: u64,
    /// Calls to `access`.
    pub accesses: u64,
    /// Accesses whose chunk was already where asked, with nothing in flight.
    pub hits: u64,
    /// Loads the computation waited for (chunk not there, not prefetched).
    pub demand_loads: u64,
    /// Loads started ahead of need by the prefetcher (including NVMe reads queued for
    /// the buffer of a write-back in flight).
    pub prefetch_loads: u64,
    /// Accesses that found their chunk loaded (or loading) by the prefetcher.
    pub prefetch_hits: u64,
    /// Prefetched chunks evicted before any access used them (or whose queued read was
    /// dropped before it started).
    pub prefetch_wasted: u64,
    /// Of `prefetch_loads`: NVMe -> host loads started by the host-tier prefetcher.
    pub host_prefetch_loads: u64,
    /// Of `prefetch_hits`: host accesses that found their chunk read (or being read)
    /// from NVMe by the host-tier prefetcher.
    pub host_prefetch_hits: u64,
    /// Host -> NVMe write-backs started without waiting (their buffer returns to the
    /// pool when they complete).
    pub async_writes: u64,
    /// Of `prefetch_loads`: NVMe reads queued for the buffer of a write-back in flight
    /// (they start as it completes, so the write and the read overlap at the device).
    pub queued_reads: u64,
    /// Most NVMe requests (chunk reads and writes) in flight at once.
    pub nvme_in_flight_max: u64,
    /// NVMe reads made by the access that needed the chunk (synchronous: nothing read
    /// it ahead).
    pub nvme_reads_on_demand: u64,
    /// Accesses whose chunk's NVMe read a prefetch had started at an earlier moment.
    pub nvme_reads_ahead: u64,
    /// Of `nvme_reads_ahead`: the fewest moments between a read's start and the access
    /// that needed it (0: none was read ahead).
    pub nvme_read_lead_min: u64,
    /// Nanoseconds `access` spent waiting for chunks (loads, evictions, copies).
    pub stall_ns: u64,
    /// Iterations ended.
    pub iterations: u64,
    /// Iterations traced (the warm-up and every re-trace).
    pub traced_iterations: u64,
    /// Times the access sequence diverged from the schedule (each causes a re-trace).
    pub divergences: u64,
    /// Device tier: capacity (the tidal budget now), bytes in use, peak.
    pub device: TierUsage,
    /// Host tier: capacity, bytes of buffers taken, peak.
    pub host: TierUsage,
    /// NVMe tier: capacity, bytes of slots held, peak.
    pub nvme: TierUsage,
}

impl StoreStats {
    /// Bytes over the device link, both directions.
    pub fn device_link_bytes(&self) -> u64 {
        self.host_to_device_bytes + self.device_to_host_bytes
    }

    /// Bytes over the NVMe link, both directions.
    pub fn nvme_link_bytes(&self) -> u64 {
        self.nvme_to_host_bytes + self.host_to_nvme_bytes
    }
}

impl fmt::Display for StoreStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MIB: f64 = (1u64 << 20) as f64;
        let mib = |b: u64| b as f64 / MIB;
        writeln!(
            f,
            "host->device {:.1} MiB ({} copies), device->host {:.1} MiB ({} copies)",
            mib(self.host_to_device_bytes),
            self.host_to_device_copies,
            mib(self.device_to_host_bytes),
            self.device_to_host_copies
        )?;
        writeln!(
            f,
            "nvme->host {:.1} MiB ({} reads), host->nvme {:.1} MiB ({} writes)",
            mib(self.nvme_to_host_bytes),
            self.nvme_reads,
            mib(self.host_to_nvme_bytes),
            self.nvme_writes
        )?;
        writeln!(
            f,
            "evictions: device {} ({} clean), host {} ({} clean); {} chunks zero-initialised, \
             {} discarded",
            self.device_evictions,
            self.device_clean_evictions,
            self.host_evictions,
            self.host_clean_evictions,
            self.materialized_chunks,
            self.discarded_chunks
        )?;
        writeln!(
            f,
            "accesses {} ({} hits, {} demand loads); prefetch {} loads, {} hits, {} wasted \
             (host tier: {} loads, {} hits); {} asynchronous write-backs; stalled {:.3} ms",
            self.accesses,
            self.hits,
            self.demand_loads,
            self.prefetch_loads,
            self.prefetch_hits,
            self.prefetch_wasted,
            self.host_prefetch_loads,
            self.host_prefetch_hits,
            self.async_writes,
            self.stall_ns as f64 / 1e6
        )?;
        writeln!(
            f,
            "nvme: at most {} requests in flight; {} reads queued behind write-backs; \
             {} reads started ahead and used (lead at least {} moments), {} on demand",
            self.nvme_in_flight_max,
            self.queued_reads,
            self.nvme_reads_ahead,
            self.nvme_read_lead_min,
            self.nvme_reads_on_demand
        )?;
        writeln!(
            f,
            "iterations {} ({} traced, {} divergences)",
            self.iterations, self.traced_iterations, self.divergences
        )?;
        tidestore_tiers::write_usage_lines(f, self.device, self.host, self.nvme)
    }
}

/// One move (or drop) of a chunk between tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveKind {
    /// Copied host -> device.
    HostToDevice,
    /// Copied device -> host (a write-back).
    DeviceToHost,
    /// Read from NVMe into a host buffer.
    NvmeToHost,
    /// Written from a host buffer to NVMe.
    HostToNvme,
    /// Evicted from the device without a copy (still valid below).
    DropDevice,
    /// Evicted from the host without a write (still valid on the device or NVMe).
    DropHost,
    /// A stale copy dropped because the chunk was changed on another tier.
    Invalidate,
    /// A chunk first touched, initialised to zeros in a host buffer.
    Materialize,
    /// An NVMe slot freed to make room (its chunk is valid elsewhere, or stale).
    ReclaimNvme,
    /// Every copy dropped, NVMe slot included, without a write: the chunk's tensors are
    /// all FREE, so its bytes are dead (unspecified until written).
    Discard,
}

/// Why a move happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveReason {
    /// An access (or `read`/`write`) needed the chunk, or room for it.
    Demand,
    /// The prefetcher brings `for_chunk`, needed at absolute moment `needed_at`; for an
    /// eviction, `victim_next_use` is the evicted chunk's next use on the schedule
    /// (`u64::MAX`: never).
    Prefetch {
        /// The chunk being prefetched.
        for_chunk: ChunkId,
        /// When it is needed.
        needed_at: u64,
        /// The evicted chunk's next use (for evictions; `u64::MAX` otherwise).
        victim_next_use: u64,
    },
    /// The tidal device budget shrank.
    Tide,
    /// An explicit call (`evict_device_all`).
    Explicit,
}

/// Every tier's use at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierSnapshot {
    /// The device tier (capacity = the tidal chunk budget now).
    pub device: TierUsage,
    /// The pinned host pool.
    pub host: TierUsage,
    /// The NVMe swap file.
    pub nvme: TierUsage,
}

impl TierSnapshot {
    /// Whether every tier's use is within its capacity.
    pub fn within_budgets(&self) -> bool {
        [self.device, self.host, self.nvme]
            .iter()
            .all(|u| u.used_bytes <= u.capacity_bytes)
    }
}

/// One event for a [`MoveHook`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoveEvent {
    /// What moved.
    pub kind: MoveKind,
    /// The chunk.
    pub chunk: ChunkId,
    /// Bytes moved (0 for drops).
    pub bytes: u64,
    /// Why.
    pub reason: MoveReason,
    /// The store's absolute moment.
    pub moment: u64,
    /// Every tier's use right after the move.
    pub usage: TierSnapshot,
}

/// Called after every move; see the module doc.
pub type MoveHook = Box<dyn FnMut(&MoveEvent) + Send>;
