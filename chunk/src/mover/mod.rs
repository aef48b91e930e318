//! The mover: where each chunk's bytes are, and every move between the three tiers.
//!
//! Each chunk has a [`Slot`]: its device memory, its host buffer, whether the NVMe swap
//! file holds a slot for it and whether that copy is current, and what is in flight.
//! The copies are kept coherent by three rules:
//! - a device copy or host buffer that is present is **current** (equal to the chunk's
//!   latest bytes); a copy that becomes stale is dropped at once (changing a chunk on
//!   the device drops its host buffer and marks its NVMe copy stale, and vice versa);
//! - a chunk that was ever materialised has at least one current copy, or its bytes are
//!   in a transfer whose completion puts them back into the slot: evicting a copy that is
//!   the only current one first writes it one tier down (device -> host -> NVMe), and a
//!   failed write leaves the copy where it was. A copy that is current elsewhere is
//!   dropped without a write (clean eviction);
//! - a chunk never written reads as zeros: its first load zero-fills a host buffer. A
//!   discarded chunk (its tensors all FREE: no payload needed) has no copy either, but
//!   its next host copy is not filled: its bytes are unspecified until written.
//!
//! Budgets hold by construction: device memory is allocated through the device's
//! budget (capacity = the store's tidal budget), the host pool is fixed, and the swap
//! file has a fixed number of slots; eviction makes room before each allocation. After
//! every move the mover reports a [`MoveEvent`] to the hook (and, in debug builds,
//! asserts that every tier is within its budget).
//!
//! Transfers: demand loads and write-backs are synchronous (submitted, then waited
//! for), unless write-backs are asynchronous (`async_writes`); prefetches run
//! asynchronously (a host->device copy, or an NVMe read followed by a copy) and are
//! collected by [`Mover::harvest`] or waited for when their chunk is accessed. A
//! prefetch that needs a host buffer held by an asynchronous write-back (often one the
//! prefetcher just started to make room) does not give up: its read waits in a queue
//! and starts the moment that write completes, so a whole row of write-backs and the
//! reads that replace it are in flight together, and the device always has work queued.
//! A demand load waiting for a buffer goes before the queue. Device completions come in
//! submission order; one routing function puts each completion's buffers back into its
//!
//! # Files, one concept each
//! - `seam`: what the store asks of the mover — the [`Cause`] of each move, pins,
//!   queries of where chunks are — and what each side promises the other;
//! - `load`: the demand load path (where is the chunk, make room, load, copy), read top
//!   to bottom: [`Mover::ensure_device`] and [`Mover::ensure_host`];
//! - `evict`: making room on each tier (victims, clean drops, write-backs one tier
//!   down, freeing NVMe slots) and the tide's shrinking;
//! - `prefetch`: starting loads ahead of need on the device and host tiers;
//! - `copies`: host<->device copies: starting them, routing their completions;
//! - `nvme`: NVMe completions, synchronous requests beside asynchronous ones, and the
//!   [`IoPump`] that keeps them moving while buffers are lent out;
//! - `queue`: the read queue of prefetch reads waiting for a write-back's buffer;
//! - `wait`: collecting and waiting for transfers in flight;
//! - `coherence`: dropping stale copies when a chunk changes, writing back, adoption;
//! - `policies`: a tier's eviction policy with its LRU fallback;
//! - `verify`: every invariant above, checked.

mod coherence;
mod copies;
mod evict;
mod load;
mod nvme;
mod policies;
mod prefetch;
mod queue;
mod seam;
mod verify;
mod wait;

use std::collections::{BTreeMap, VecDeque};

use tidestore_io::AlignedBuf;
use tidestore_tiers::nvme::NvmeCompletion;
use tidestore_tiers::{CopyId, Device, DeviceMem, HostTier, NvmeTier, TierError, TierUsage};

use crate::accounting::{MoveEvent, MoveHook, MoveKind, StoreStats, TierSnapshot};
use crate::error::ChunkError;
use crate::id::ChunkId;
use crate::Result;

pub(crate) use evict::Ahead;
pub use nvme::IoPump;
pub(crate) use policies::Policies;
pub(crate) use seam::Cause;
pub use seam::ChunkResidency;

/// What is in flight for a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pending {
    None,
    /// A host->device copy: the host buffer and device memory are inside it.
    HostToDevice(CopyId),
    /// The host prefetcher's device->host copy: the device memory (current) and the
    /// host buffer are inside it; both copies are current when it lands.
    DeviceToHost(CopyId),
    /// An NVMe read into a host buffer; then a copy to the reserved device memory.
    NvmeRead,
    /// A prefetch's NVMe read (into the host pool, or to stage a device prefetch whose
    /// device memory is reserved) that waits in [`Mover`]'s read queue for the buffer a
    /// write-back in flight gives back; the chunk's only current copy is on NVMe.
    NvmeReadQueued,
    /// An NVMe write-back of the chunk's only current copy: the host buffer is inside
    /// it, and the chunk is not used until it completes.
    NvmeWrite,
}

/// Where one chunk's bytes are.
#[derive(Debug)]
pub(crate) struct Slot {
    dev: Option<DeviceMem>,
    host: Option<AlignedBuf>,
    /// The swap file holds a slot for this chunk (current or stale).
    nvme_stored: bool,
    /// The swap file's copy is current.
    nvme_valid: bool,
    pending: Pending,
    /// Device memory held for a prefetch whose NVMe read is in flight.
    reserved_dev: Option<DeviceMem>,
    /// Loaded by the prefetcher and not accessed since.
    prefetched: bool,
    /// Read into the host pool by the host-tier prefetcher and not accessed since.
    host_prefetched: bool,
    /// Discarded (its tensors all FREE) and not materialised since: its next host copy
    /// needs no zero-fill, its bytes being unspecified until written.
    dead: bool,
    /// Tensors of this chunk in COMPUTE on the device.
    dev_pins: u32,
    /// Tensors of this chunk in COMPUTE on the host.
    host_pins: u32,
    /// The moment a prefetch started (or queued) the NVMe read of the host copy now
    /// on its way or landed, until an access uses it (for the read-ahead counters).
    read_started_at: Option<u64>,
    /// The moment a prefetch read is needed at: its order among the NVMe requests
    /// waiting to start (`NvmeTier::submit_read_ordered`).
    read_needed_at: u64,
}

impl Slot {
    fn new() -> Self {
        Slot {
            dev: None,
            host: None,
            nvme_stored: false,
            nvme_valid: false,
            pending: Pending::None,
            reserved_dev: None,
            prefetched: false,
            host_prefetched: false,
            dead: false,
            dev_pins: 0,
            host_pins: 0,
            read_started_at: None,
            read_needed_at: 0,
        }
    }
}

/// The tiers and every chunk's slot; see the module doc.
pub(crate) struct Mover {
    device: Device,
    host: HostTier,
    nvme: NvmeTier,
    slots: Vec<Slot>,
    /// Chunk length in bytes per dense id (0: no such chunk).
    len_bytes: Vec<u64>,
    /// Device bytes per dense id (length rounded up to 4096, as the budget counts).
    dev_bytes: Vec<u64>,
    /// Host pool bytes per dense id: the buffer, or the part of one, its host copy
    /// holds (see [`HostTier::take_class`]).
    host_bytes: Vec<u64>,
    /// The pool's part sizes the chunks use: held bytes -> parts per buffer.
    host_part_sizes: BTreeMap<u64, u64>,
    /// Chunks present on the device (not in flight).
    dev_list: Vec<ChunkId>,
    /// Chunks present in the host pool (not in flight).
    host_list: Vec<ChunkId>,
    /// Per dense id: present on the device or on its way there (the planner's view).
    dev_mark: Vec<bool>,
    /// The device budget's capacity now (the tidal budget).
    dev_cap: u64,
    /// Device copies in flight (host->device, and the host prefetcher's
    /// device->host).
    pending_copies: usize,
    /// NVMe requests in flight (reads and writes).
    pending_nvme: usize,
    /// NVMe writes in flight by the host bytes their buffers hold (`host_bytes`).
    writing_held: BTreeMap<u64, usize>,
    /// Prefetch reads waiting for a buffer ([`Pending::NvmeReadQueued`]), in order of
    /// need; each is owed one of the buffers of its size that the write-backs in flight
    /// give back, so there are never more of them of one size than write-backs of that
    /// size once settled (see `settle_queue`). They start as those writes complete, so
    /// write-backs and the reads that follow them are in flight together.
    read_queue: VecDeque<ChunkId>,
    /// While set, queued reads do not start: a demand load is waiting for a buffer and
    /// goes first (its chunk is needed now, theirs later).
    hold_queue: bool,
    /// NVMe completions taken by an [`IoPump`] and not routed yet.
    nvme_stash: VecDeque<NvmeCompletion>,
    /// Write-backs forced by eviction do not wait (see [`Pending::NvmeWrite`]).
    async_writes: bool,
    stats: StoreStats,
    hook: Option<MoveHook>,
    /// The device bytes of the chunks pinned on the device (`dev_pins > 0`).
    pinned_device_bytes: u64,
    dev_policy: Policies,
    host_policy: Policies,
}

fn tier_err(op: &'static str, chunk: ChunkId) -> impl FnOnce(TierError) -> ChunkError {
    move |e| ChunkError::tier(op, Some(chunk), e)
}

fn remove_from(list: &mut Vec<ChunkId>, c: ChunkId) {
    if let Some(i) = list.iter().position(|&x| x == c) {
        list.swap_remove(i);
    }
}

/// Errors after which a prefetch simply stops (no room now), rather than failing.
pub(crate) fn is_no_room(e: &ChunkError) -> bool {
    match e {
        ChunkError::TierFull { .. } | ChunkError::WorkingSetTooLarge { .. } => true,
        ChunkError::Tier { source, .. } => matches!(
            source.inner(),
            TierError::OverBudget { .. }
                | TierError::DeviceOutOfMemory { .. }
                | TierError::HostPoolExhausted { .. }
        ),
        _ => false,
    }
}

/// Counts one transfer of `what` out of `n` as it completes; a completion nobody counted
/// is a broken invariant (reported after the completion is routed).
fn count_down(n: &mut usize, what: &str, chunk: ChunkId) -> Result<()> {
    match n.checked_sub(1) {
        Some(left) => {
            *n = left;
            Ok(())
        }
        None => Err(ChunkError::Invariant {
            chunk: Some(chunk),
            what: format!("a {what} completed that was not counted in flight"),
        }),
    }
}

fn stopped(reason: &str) -> TierError {
    TierError::CopyEngineStopped {
        reason: reason.into(),
    }
}

impl Mover {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        device: Device,
        host: HostTier,
        nvme: NvmeTier,
        len_bytes: Vec<u64>,
        dev_cap: u64,
        dev_policy: Policies,
        host_policy: Policies,
    ) -> Self {
        let n = len_bytes.len();
        let dev_bytes = len_bytes
            .iter()
            .map(|&b| tidestore_io::align_up(b as usize) as u64)
            .collect();
        // Every chunk fits a buffer: the pool's buffers are the largest chunk's size.
        let whole = (1, host.buf_bytes() as u64);
        let classes: Vec<(u32, u64)> = len_bytes
            .iter()
            .map(|&b| match b {
                0 => (1, 0),
                b => host.take_class(b).unwrap_or(whole),
            })
            .collect();
        let host_bytes = classes.iter().map(|&(_, held)| held).collect();
        let host_part_sizes = classes
            .iter()
            .filter(|&&(per, _)| per > 1)
            .map(|&(per, held)| (held, u64::from(per)))
            .collect();
        Mover {
            device,
            host,
            nvme,
            slots: (0..n).map(|_| Slot::new()).collect(),
            len_bytes,
            dev_bytes,
            host_bytes,
            host_part_sizes,
            dev_list: Vec::new(),
            host_list: Vec::new(),
            dev_mark: vec![false; n],
            dev_cap,
            pending_copies: 0,
            pending_nvme: 0,
            writing_held: BTreeMap::new(),
            read_queue: VecDeque::new(),
            hold_queue: false,
            nvme_stash: VecDeque::new(),
            async_writes: false,
            stats: StoreStats::default(),
            hook: None,
            pinned_device_bytes: 0,
            dev_policy,
            host_policy,
        }
    }

    fn len(&self, c: ChunkId) -> usize {
        self.len_bytes[c.dense()] as usize
    }

    /// Every tier's use now.
    pub(crate) fn snapshot(&self) -> TierSnapshot {
        let device: TierUsage = self.device.budget().into();
        TierSnapshot {
            device,
            host: self.host.budget().into(),
            nvme: self.nvme.budget().into(),
        }
    }

    fn emit(&mut self, cause: Cause, kind: MoveKind, chunk: ChunkId, bytes: u64) {
        if self.hook.is_none() && !cfg!(debug_assertions) {
            return;
        }
        let usage = self.snapshot();
        debug_assert!(
            usage.within_budgets(),
            "a tier is over budget after {kind:?} of {chunk}: {usage:?}"
        );
        let event = MoveEvent {
            kind,
            chunk,
            bytes,
            reason: cause.reason,
            moment: cause.moment,
            usage,
        };
        if let Some(hook) = &mut self.hook {
            hook(&event);
        }
    }

    fn device_used(&self) -> u64 {
        self.device.budget().used_bytes()
    }

    pub(crate) fn device_free(&self) -> u64 {
        self.dev_cap.saturating_sub(self.device_used())
    }
}
