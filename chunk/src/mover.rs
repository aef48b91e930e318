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
//! - a chunk never written reads as zeros: its first load zero-fills a host buffer.
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
//! chunk's slot, whoever waits.

use std::collections::VecDeque;
use std::sync::Arc;

use tidestore_io::AlignedBuf;
use tidestore_io::Op;
use tidestore_tiers::nvme::NvmeCompletion;
use tidestore_tiers::{
    CopyCompletion, CopyDir, CopyId, Device, DeviceMem, HostTier, NvmeTier, TierError, TierKind,
    TierUsage,
};

use crate::accounting::{MoveEvent, MoveHook, MoveKind, MoveReason, StoreStats, TierSnapshot};
use crate::error::ChunkError;
use crate::id::ChunkId;
use crate::policy::{EvictionPolicy, Lru};
use crate::tracer::{Horizon, Schedule};
use crate::Result;

/// What is in flight for a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pending {
    None,
    /// A host->device copy: the host buffer and device memory are inside it.
    HostToDevice(CopyId),
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
    pub(crate) dev: Option<DeviceMem>,
    pub(crate) host: Option<AlignedBuf>,
    /// The swap file holds a slot for this chunk (current or stale).
    pub(crate) nvme_stored: bool,
    /// The swap file's copy is current.
    pub(crate) nvme_valid: bool,
    pub(crate) pending: Pending,
    /// Device memory held for a prefetch whose NVMe read is in flight.
    pub(crate) reserved_dev: Option<DeviceMem>,
    /// Loaded by the prefetcher and not accessed since.
    pub(crate) prefetched: bool,
    /// Read into the host pool by the host-tier prefetcher and not accessed since.
    pub(crate) host_prefetched: bool,
    /// Tensors of this chunk in COMPUTE on the device.
    pub(crate) dev_pins: u32,
    /// Tensors of this chunk in COMPUTE on the host.
    pub(crate) host_pins: u32,
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
            dev_pins: 0,
            host_pins: 0,
        }
    }
}

/// A tier's policy plus an LRU kept up to date beside it, used while the main policy
/// cannot be (`lifetime` without a valid schedule: warm-up, after a divergence).
pub(crate) struct Policies {
    main: Box<dyn EvictionPolicy + Send>,
    lru: Lru,
    pub(crate) use_main: bool,
}

impl Policies {
    pub(crate) fn new(main: Box<dyn EvictionPolicy + Send>, use_main: bool) -> Self {
        Policies {
            main,
            lru: Lru::new(),
            use_main,
        }
    }

    pub(crate) fn set_main(&mut self, main: Box<dyn EvictionPolicy + Send>) {
        self.main = main;
    }

    fn on_insert(&mut self, c: ChunkId, m: u64) {
        self.main.on_insert(c, m);
        self.lru.on_insert(c, m);
    }

    pub(crate) fn on_access(&mut self, c: ChunkId, m: u64) {
        self.main.on_access(c, m);
        self.lru.on_access(c, m);
    }

    fn on_evict(&mut self, c: ChunkId, m: u64) {
        self.main.on_evict(c, m);
        self.lru.on_evict(c, m);
    }

    fn choose(&mut self, candidates: &[ChunkId], m: u64) -> Option<ChunkId> {
        let v = if self.use_main {
            self.main.choose_victim(candidates, m)
        } else {
            self.lru.choose_victim(candidates, m)
        };
        v.filter(|v| candidates.contains(v))
    }
}

/// Where a host buffer may come from when none is free.
#[derive(Debug, Clone, Copy)]
struct HostRoom<'a> {
    /// Chunks whose host copies must stay.
    protect: &'a [ChunkId],
    /// Only evict host copies next used after this absolute moment, and never wait
    /// for transfers in flight (the prefetcher's rule); `None`: any victim, may wait.
    not_before: Option<u64>,
}

/// The tiers and every chunk's slot; see the module doc.
pub(crate) struct Mover {
    pub(crate) device: Device,
    pub(crate) host: HostTier,
    pub(crate) nvme: NvmeTier,
    pub(crate) slots: Vec<Slot>,
    /// Chunk length in bytes per dense id (0: no such chunk).
    pub(crate) len_bytes: Vec<u64>,
    /// Device bytes per dense id (length rounded up to 4096, as the budget counts).
    pub(crate) dev_bytes: Vec<u64>,
    /// Chunks present on the device (not in flight).
    pub(crate) dev_list: Vec<ChunkId>,
    /// Chunks present in the host pool (not in flight).
    pub(crate) host_list: Vec<ChunkId>,
    /// Per dense id: present on the device or on its way there (the planner's view).
    pub(crate) dev_mark: Vec<bool>,
    /// The device budget's capacity now (the tidal budget).
    pub(crate) dev_cap: u64,
    pending_h2d: usize,
    /// NVMe requests in flight (reads and writes).
    pending_nvme: usize,
    /// NVMe writes in flight.
    pending_writes: usize,
    /// Prefetch reads waiting for a buffer ([`Pending::NvmeReadQueued`]), in order of
    /// need; each is owed one of the buffers the write-backs in flight give back, so
    /// there are never more of them than `pending_writes` once settled (see
    /// `settle_queue`). They start as those writes complete, so write-backs and the
    /// reads that follow them are in flight together.
    read_queue: VecDeque<ChunkId>,
    /// While set, queued reads do not start: a demand load is waiting for a buffer and
    /// goes first (its chunk is needed now, theirs later).
    hold_queue: bool,
    /// NVMe completions taken by an [`IoPump`] and not routed yet.
    nvme_stash: VecDeque<NvmeCompletion>,
    /// Write-backs forced by eviction do not wait (see [`Pending::NvmeWrite`]).
    pub(crate) async_writes: bool,
    pub(crate) stats: StoreStats,
    pub(crate) hook: Option<MoveHook>,
    pub(crate) reason: MoveReason,
    pub(crate) moment: u64,
    pub(crate) dev_policy: Policies,
    pub(crate) host_policy: Policies,
    /// The schedule, for the prefetcher's host-victim rule.
    pub(crate) schedule: Option<Arc<Schedule>>,
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
        Mover {
            device,
            host,
            nvme,
            slots: (0..n).map(|_| Slot::new()).collect(),
            len_bytes,
            dev_bytes,
            dev_list: Vec::new(),
            host_list: Vec::new(),
            dev_mark: vec![false; n],
            dev_cap,
            pending_h2d: 0,
            pending_nvme: 0,
            pending_writes: 0,
            read_queue: VecDeque::new(),
            hold_queue: false,
            nvme_stash: VecDeque::new(),
            async_writes: false,
            stats: StoreStats::default(),
            hook: None,
            reason: MoveReason::Demand,
            moment: 0,
            dev_policy,
            host_policy,
            schedule: None,
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

    fn emit(&mut self, kind: MoveKind, chunk: ChunkId, bytes: u64) {
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
            reason: self.reason,
            moment: self.moment,
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

    // ------------------------------------------------------------- completions

    /// Puts a finished host->device copy's buffers back into its chunk's slot.
    fn route_copy(&mut self, c: CopyCompletion) -> Result<()> {
        let chunk = ChunkId::from_dense(c.chunk as usize);
        let d = chunk.dense();
        match c.dir {
            CopyDir::HostToDevice => {
                let counted = count_down(&mut self.pending_h2d, "host->device copy", chunk);
                let slot = &mut self.slots[d];
                slot.pending = Pending::None;
                // The host buffer still holds the chunk's current bytes, copy or not.
                slot.host = Some(c.host);
                self.host_list.push(chunk);
                match c.result {
                    Ok(()) => {
                        slot.dev = Some(c.mem);
                        self.dev_list.push(chunk);
                        self.stats.host_to_device_bytes += c.len_bytes as u64;
                        self.stats.host_to_device_copies += 1;
                        self.emit(MoveKind::HostToDevice, chunk, c.len_bytes as u64);
                        counted
                    }
                    Err(e) => {
                        self.dev_mark[d] = false;
                        slot.prefetched = false;
                        drop(c.mem);
                        counted?;
                        Err(ChunkError::tier("copy host->device", Some(chunk), e))
                    }
                }
            }
            CopyDir::DeviceToHost => {
                // Write-backs are waited for by their issuer; one arriving here was
                // orphaned by an earlier error. The device memory is still current.
                let slot = &mut self.slots[d];
                if slot.dev.is_none() {
                    slot.dev = Some(c.mem);
                    self.dev_list.push(chunk);
                    self.dev_mark[d] = true;
                }
                Ok(())
            }
        }
    }

    /// Waits for copy `id`, routing every other completion that comes first.
    fn wait_copy_id(&mut self, id: CopyId, chunk: ChunkId) -> Result<CopyCompletion> {
        let mut first_err = None;
        loop {
            let Some(c) = self.device.wait_copy() else {
                return Err(ChunkError::tier(
                    "waiting for a device copy",
                    Some(chunk),
                    TierError::CopyEngineStopped {
                        reason: format!("copy {id} never completed"),
                    },
                ));
            };
            if c.id == id {
                return match first_err {
                    Some(e) => {
                        // Our own completion still goes back where it belongs.
                        self.route_copy(c)?;
                        Err(e)
                    }
                    None => Ok(c),
                };
            }
            if let Err(e) = self.route_copy(c) {
                first_err.get_or_insert(e);
            }
        }
    }

    fn route_nvme(&mut self, c: NvmeCompletion) -> Result<()> {
        if c.op == Op::Write {
            return self.route_nvme_write(c);
        }
        let chunk = ChunkId::from_dense(c.chunk as usize);
        let d = chunk.dense();
        let counted = count_down(&mut self.pending_nvme, "NVMe request", chunk);
        let slot = &mut self.slots[d];
        slot.pending = Pending::None;
        let reserved = slot.reserved_dev.take();
        match c.result {
            Ok(()) => {
                slot.host = Some(c.buf);
                self.host_list.push(chunk);
                self.host_policy.on_insert(chunk, self.moment);
                self.stats.nvme_to_host_bytes += c.len_bytes as u64;
                self.stats.nvme_reads += 1;
                self.emit(MoveKind::NvmeToHost, chunk, c.len_bytes as u64);
                if let Some(mem) = reserved {
                    self.start_h2d(chunk, mem)?;
                }
                counted
            }
            Err(e) => {
                self.dev_mark[d] = false;
                slot.prefetched = false;
                slot.host_prefetched = false;
                drop(reserved);
                drop(c.buf);
                counted?;
                Err(ChunkError::tier("reading from NVMe", Some(chunk), e))
            }
        }
    }

    /// An asynchronous write-back finished: the NVMe copy is current and the buffer
    /// goes back to the pool; on failure the buffer goes back into the slot (still the
    /// chunk's only current copy).
    fn route_nvme_write(&mut self, c: NvmeCompletion) -> Result<()> {
        let chunk = ChunkId::from_dense(c.chunk as usize);
        let d = chunk.dense();
        let counted = count_down(&mut self.pending_nvme, "NVMe request", chunk).and(count_down(
            &mut self.pending_writes,
            "NVMe write",
            chunk,
        ));
        // After a failed write the file no longer stores the chunk.
        let still_stored = self.nvme.contains(c.chunk);
        let slot = &mut self.slots[d];
        slot.pending = Pending::None;
        match c.result {
            Ok(()) => {
                drop(c.buf);
                slot.nvme_stored = true;
                slot.nvme_valid = true;
                self.stats.host_to_nvme_bytes += c.len_bytes as u64;
                self.stats.nvme_writes += 1;
                self.emit(MoveKind::HostToNvme, chunk, c.len_bytes as u64);
                // Its buffer is back: the read owed it starts now.
                self.settle_queue();
                counted
            }
            Err(e) => {
                slot.nvme_stored = still_stored;
                slot.host = Some(c.buf);
                self.host_list.push(chunk);
                self.host_policy.on_insert(chunk, self.moment);
                // One buffer fewer comes back than the queue was promised.
                self.settle_queue();
                counted?;
                Err(ChunkError::tier("writing to NVMe", Some(chunk), e))
            }
        }
    }

    /// The next NVMe completion: one an [`IoPump`] took first, else a finished one.
    fn nvme_poll(&mut self) -> Option<NvmeCompletion> {
        self.nvme_stash.pop_front().or_else(|| self.nvme.poll())
    }

    /// The next NVMe completion, waiting for one; `None` when nothing is in flight.
    fn nvme_wait(&mut self) -> Option<NvmeCompletion> {
        self.nvme_stash.pop_front().or_else(|| self.nvme.wait())
    }

    /// Keeps NVMe transfers moving while the chunks' buffers are lent out (see
    /// [`IoPump`]).
    pub(crate) fn pump_parts(&mut self) -> (&mut Vec<Slot>, IoPump<'_>) {
        (
            &mut self.slots,
            IoPump {
                nvme: &mut self.nvme,
                stash: &mut self.nvme_stash,
                active: self.pending_nvme > 0,
            },
        )
    }

    /// Routes every finished NVMe read before a synchronous NVMe request.
    ///
    /// Workaround: `SwapFile` reuses a request token as soon as its completion is
    /// queued, and its synchronous `read_chunk`/`write_chunk` wait for the first queued
    /// completion carrying their token, so a finished asynchronous read still queued
    /// could be taken for the new request. With the queue empty when a synchronous
    /// request starts, every completion queued while it waits carries another token.
    fn drain_nvme(&mut self) {
        while self.pending_nvme > 0 {
            let Some(c) = self.nvme_poll() else {
                return;
            };
            if let Err(e) = self.route_nvme(c) {
                tracing::warn!(error = %e, "chunk store: an asynchronous NVMe transfer failed");
            }
        }
    }

    /// Collects finished transfers without waiting.
    pub(crate) fn harvest(&mut self) -> Result<()> {
        let mut first_err = None;
        if self.pending_h2d > 0 {
            while let Some(c) = self.device.poll_copy() {
                if let Err(e) = self.route_copy(c) {
                    first_err.get_or_insert(e);
                }
            }
        }
        if self.pending_nvme > 0 {
            while let Some(c) = self.nvme_poll() {
                if let Err(e) = self.route_nvme(c) {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.settle_queue();
        first_err.map_or(Ok(()), Err)
    }

    /// Starts the queued reads that find a free buffer, then drops (from the back, the
    /// latest needed) those no write-back in flight will bring a buffer to: a queued
    /// read never waits for a buffer that is not coming, nor holds device memory for
    /// one. Nothing happens while a demand load waits for a buffer (`hold_queue`); it
    /// settles the queue itself once it has one.
    fn settle_queue(&mut self) {
        if self.hold_queue {
            return;
        }
        self.start_queued_reads();
        self.trim_read_queue();
    }

    /// One more NVMe request is in flight (`pending_nvme` already counts it, or `sync`:
    /// a synchronous one beside those).
    fn note_nvme_in_flight(&mut self, sync: bool) {
        let n = self.pending_nvme as u64 + u64::from(sync);
        self.stats.nvme_in_flight_max = self.stats.nvme_in_flight_max.max(n);
    }

    /// Starts the queued host prefetch reads that find a free buffer, in queue order
    /// (not while a demand load waits for one, see `hold_queue`).
    fn start_queued_reads(&mut self) {
        while !self.hold_queue {
            let Some(&c) = self.read_queue.front() else {
                return;
            };
            let d = c.dense();
            let Ok(buf) = self.host.try_take(d as u64) else {
                return;
            };
            self.read_queue.pop_front();
            self.nvme.submit_read(d as u64, buf);
            self.slots[d].pending = Pending::NvmeRead;
            self.pending_nvme += 1;
            self.note_nvme_in_flight(false);
        }
    }

    /// Drops queued reads from the back until no more are queued than buffers the
    /// write-backs in flight will give back.
    fn trim_read_queue(&mut self) {
        while self.read_queue.len() > self.pending_writes {
            if let Some(c) = self.read_queue.pop_back() {
                self.cancel_queued(c);
            }
        }
    }

    /// `c`'s queued read will not happen: nothing is pending for it any more (device
    /// memory reserved for a device prefetch is given back); it loads on demand.
    fn cancel_queued(&mut self, c: ChunkId) {
        let d = c.dense();
        let slot = &mut self.slots[d];
        if slot.pending == Pending::NvmeReadQueued {
            slot.pending = Pending::None;
            slot.host_prefetched = false;
            if let Some(mem) = slot.reserved_dev.take() {
                drop(mem);
                slot.prefetched = false;
                self.dev_mark[d] = false;
            }
            self.stats.prefetch_wasted += 1;
        }
        if let Some(i) = self.read_queue.iter().position(|&q| q == c) {
            self.read_queue.remove(i);
        }
    }

    /// Waits for one transfer in flight; false when none is.
    fn wait_any(&mut self) -> Result<bool> {
        if self.pending_nvme > 0 {
            if let Some(c) = self.nvme_wait() {
                self.route_nvme(c)?;
                return Ok(true);
            }
            return Err(ChunkError::Invariant {
                chunk: None,
                what: format!(
                    "{} NVMe requests counted in flight, none outstanding",
                    self.pending_nvme
                ),
            });
        }
        if self.pending_h2d > 0 {
            if let Some(c) = self.device.wait_copy() {
                self.route_copy(c)?;
                return Ok(true);
            }
            return Err(ChunkError::Invariant {
                chunk: None,
                what: format!(
                    "{} host->device copies counted in flight, none outstanding",
                    self.pending_h2d
                ),
            });
        }
        Ok(false)
    }

    /// Waits until nothing is in flight for `c`.
    pub(crate) fn wait_pending(&mut self, c: ChunkId) -> Result<()> {
        loop {
            match self.slots[c.dense()].pending {
                Pending::None => return Ok(()),
                Pending::HostToDevice(id) => {
                    let done = self.wait_copy_id(id, c)?;
                    self.route_copy(done)?;
                }
                Pending::NvmeRead | Pending::NvmeWrite => {
                    if !self.wait_any()? {
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
                        && !self.wait_any()?
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
    pub(crate) fn wait_all(&mut self) -> Result<()> {
        let mut first_err = None;
        loop {
            match self.wait_any() {
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

    // ------------------------------------------------------------- host tier

    /// A free host buffer for `chunk`, evicting host copies (to NVMe where they are the
    /// only current copy) as needed.
    fn take_host_buffer(&mut self, chunk: ChunkId, room: HostRoom<'_>) -> Result<AlignedBuf> {
        loop {
            if let Ok(buf) = self.host.try_take(chunk.dense() as u64) {
                return Ok(buf);
            }
            if self.pending_writes > 0 {
                // A write-back in flight gives a buffer back: wait for it rather than
                // evicting more (the prefetcher never waits). Queued prefetch reads do
                // not take it first: this chunk is needed sooner.
                if room.not_before.is_none() && self.wait_for_demand()? {
                    continue;
                }
                return Err(ChunkError::TierFull {
                    tier: TierKind::Host,
                    chunk,
                    needed_bytes: self.host.buf_bytes() as u64,
                    capacity_bytes: self.host.budget().capacity_bytes(),
                });
            }
            let schedule = self.schedule.clone();
            let candidates: Vec<ChunkId> = self
                .host_list
                .iter()
                .copied()
                .filter(|w| {
                    self.slots[w.dense()].host_pins == 0
                        && !room.protect.contains(w)
                        && match (room.not_before, &schedule) {
                            (None, _) => true,
                            (Some(n), Some(s)) => s
                                .next_use_from(*w, self.moment + 1, Horizon::Cyclic)
                                .is_none_or(|u| u > n),
                            (Some(_), None) => false,
                        }
                })
                .collect();
            if candidates.is_empty() {
                if room.not_before.is_none() && self.wait_any()? {
                    continue;
                }
                return Err(ChunkError::TierFull {
                    tier: TierKind::Host,
                    chunk,
                    needed_bytes: self.host.buf_bytes() as u64,
                    capacity_bytes: self.host.budget().capacity_bytes(),
                });
            }
            let Some(victim) = self.host_policy.choose(&candidates, self.moment) else {
                return Err(ChunkError::NoVictim {
                    moment: self.moment,
                    chunk,
                    policy: "host",
                });
            };
            self.evict_host(victim, room.not_before.is_none())?;
        }
    }

    /// Waits for one transfer in flight on behalf of a demand load (false when none is):
    /// a buffer it brings back goes to the load, not to the queued prefetch reads, which
    /// are then owed one fewer.
    fn wait_for_demand(&mut self) -> Result<bool> {
        self.hold_queue = true;
        let waited = self.wait_any();
        self.hold_queue = false;
        self.trim_read_queue();
        waited
    }

    /// Takes `w`'s host copy out of the pool, writing it to NVMe first when it is the
    /// chunk's only current copy. On a failed write the copy stays where it was. With
    /// `may_wait` (a demand load makes room), a swap file whose slots are all held by
    /// transfers in flight is waited on rather than reported full.
    pub(crate) fn evict_host(&mut self, w: ChunkId, may_wait: bool) -> Result<()> {
        let d = w.dense();
        let slot = &self.slots[d];
        if slot.host.is_none() {
            return Ok(());
        }
        if slot.dev.is_none() && !slot.nvme_valid {
            // Found before the copy leaves its slot: waiting routes other transfers.
            self.ensure_nvme_slot(w, may_wait)?;
        }
        let Some(buf) = self.slots[d].host.take() else {
            return Ok(());
        };
        remove_from(&mut self.host_list, w);
        if std::mem::take(&mut self.slots[d].host_prefetched) {
            self.stats.prefetch_wasted += 1;
        }
        let slot = &self.slots[d];
        if slot.dev.is_some() || slot.nvme_valid {
            drop(buf);
            self.stats.host_evictions += 1;
            self.stats.host_clean_evictions += 1;
            self.host_policy.on_evict(w, self.moment);
            self.emit(MoveKind::DropHost, w, 0);
            return Ok(());
        }
        let len = self.len(w);
        if self.async_writes {
            // The buffer stays with the write until it completes (route_nvme_write);
            // the chunk waits for it before any other use.
            self.nvme.submit_write(d as u64, buf, len);
            self.slots[d].pending = Pending::NvmeWrite;
            self.pending_nvme += 1;
            self.pending_writes += 1;
            self.note_nvme_in_flight(false);
            self.stats.async_writes += 1;
            self.stats.host_evictions += 1;
            self.host_policy.on_evict(w, self.moment);
            // Start it now (submitted requests start at the next poll).
            let first = self.nvme.poll();
            if let Some(c) = first {
                self.nvme_stash.push_back(c);
            }
            return Ok(());
        }
        self.drain_nvme();
        self.note_nvme_in_flight(true);
        let (result, buf) = self.nvme.write_chunk(d as u64, buf, len);
        if let Err(e) = result {
            // A failed write drops the chunk from the file (which refuses writes now).
            self.slots[d].nvme_stored = self.nvme.contains(d as u64);
            self.slots[d].host = Some(buf);
            self.host_list.push(w);
            return Err(ChunkError::tier("writing to NVMe", Some(w), e));
        }
        drop(buf);
        let slot = &mut self.slots[d];
        slot.nvme_stored = true;
        slot.nvme_valid = true;
        self.stats.host_to_nvme_bytes += len as u64;
        self.stats.nvme_writes += 1;
        self.stats.host_evictions += 1;
        self.host_policy.on_evict(w, self.moment);
        self.emit(MoveKind::HostToNvme, w, len as u64);
        Ok(())
    }

    /// Makes sure writing `w` to NVMe finds a slot: its own, a free one, or one freed
    /// from a chunk whose NVMe copy is stale or also current elsewhere. A chunk being
    /// read holds its slot until the read lands (then its copy is current elsewhere
    /// too): with `may_wait`, transfers in flight are waited for rather than the file
    /// reported full.
    fn ensure_nvme_slot(&mut self, w: ChunkId, may_wait: bool) -> Result<()> {
        let d = w.dense();
        if self.slots[d].nvme_stored {
            return Ok(());
        }
        let reclaim = |s: &Slot| {
            s.nvme_stored
                && !matches!(
                    s.pending,
                    Pending::NvmeRead | Pending::NvmeReadQueued | Pending::NvmeWrite
                )
                && (!s.nvme_valid || s.host.is_some() || s.dev.is_some())
        };
        let r = loop {
            let budget = self.nvme.budget();
            if budget.free_bytes() >= self.nvme.slot_bytes() as u64 {
                return Ok(());
            }
            // Stale copies first, then copies current elsewhere.
            let pick = (0..self.slots.len())
                .filter(|&i| i != d && reclaim(&self.slots[i]))
                .min_by_key(|&i| self.slots[i].nvme_valid);
            match pick {
                Some(r) => break r,
                None if may_wait && self.wait_for_demand()? => {}
                None => {
                    return Err(ChunkError::TierFull {
                        tier: TierKind::Nvme,
                        chunk: w,
                        needed_bytes: self.nvme.slot_bytes() as u64,
                        capacity_bytes: budget.capacity_bytes(),
                    })
                }
            }
        };
        let rc = ChunkId::from_dense(r);
        self.nvme
            .remove(r as u64)
            .map_err(tier_err("freeing an NVMe slot", rc))?;
        let s = &mut self.slots[r];
        s.nvme_stored = false;
        s.nvme_valid = false;
        self.emit(MoveKind::ReclaimNvme, rc, 0);
        Ok(())
    }

    /// A host buffer holding `c`'s current bytes, taken out of its slot (it goes back
    /// with the copy that uses it): its host copy, a read from NVMe, or zeros.
    fn host_copy_for_load(&mut self, c: ChunkId, room: HostRoom<'_>) -> Result<AlignedBuf> {
        let d = c.dense();
        if let Some(buf) = self.slots[d].host.take() {
            remove_from(&mut self.host_list, c);
            self.slots[d].host_prefetched = false;
            return Ok(buf);
        }
        self.fill_host(c, room)?;
        remove_from(&mut self.host_list, c);
        self.slots[d]
            .host
            .take()
            .ok_or_else(|| ChunkError::tier("loading", Some(c), stopped("host copy vanished")))
    }

    /// Gives `c` a current host copy (from NVMe, or zeros), not from the device.
    fn fill_host(&mut self, c: ChunkId, room: HostRoom<'_>) -> Result<()> {
        let d = c.dense();
        let buf = self.take_host_buffer(c, room)?;
        let len = self.len(c);
        if self.slots[d].nvme_valid {
            self.drain_nvme();
            self.note_nvme_in_flight(true);
            let (result, buf) = self.nvme.read_chunk(d as u64, buf);
            match result {
                Ok(n) if n == len => {}
                Ok(n) => {
                    return Err(ChunkError::tier(
                        "reading from NVMe",
                        Some(c),
                        TierError::TooLarge {
                            tier: TierKind::Nvme,
                            chunk: d as u64,
                            len_bytes: n as u64,
                            limit_bytes: len as u64,
                        },
                    ))
                }
                Err(e) => return Err(ChunkError::tier("reading from NVMe", Some(c), e)),
            }
            self.slots[d].host = Some(buf);
            self.host_list.push(c);
            self.host_policy.on_insert(c, self.moment);
            self.stats.nvme_to_host_bytes += len as u64;
            self.stats.nvme_reads += 1;
            self.emit(MoveKind::NvmeToHost, c, len as u64);
        } else {
            let mut buf = buf;
            buf[..len].fill(0);
            self.slots[d].host = Some(buf);
            self.host_list.push(c);
            self.host_policy.on_insert(c, self.moment);
            self.stats.materialized_chunks += 1;
            self.emit(MoveKind::Materialize, c, 0);
        }
        Ok(())
    }

    /// Makes `c` current in the host pool (from the device, NVMe or zeros). Returns
    /// whether it already was.
    pub(crate) fn ensure_host(&mut self, c: ChunkId) -> Result<bool> {
        self.wait_pending(c)?;
        let d = c.dense();
        if self.slots[d].host.is_some() {
            self.host_policy.on_access(c, self.moment);
            return Ok(true);
        }
        let room = HostRoom {
            protect: &[c],
            not_before: None,
        };
        if self.slots[d].dev.is_some() {
            let buf = self.take_host_buffer(c, room)?;
            let Some(mem) = self.slots[d].dev.take() else {
                return Err(ChunkError::tier(
                    "loading",
                    Some(c),
                    stopped("device copy vanished"),
                ));
            };
            let len = self.len(c);
            let id = self.device.copy_to_host(d as u64, mem, buf, len);
            let done = self.wait_copy_id(id, c)?;
            // The device copy stays: both are current now.
            self.slots[d].dev = Some(done.mem);
            if let Err(e) = done.result {
                drop(done.host);
                return Err(ChunkError::tier("copy device->host", Some(c), e));
            }
            self.slots[d].host = Some(done.host);
            self.host_list.push(c);
            self.host_policy.on_insert(c, self.moment);
            self.stats.device_to_host_bytes += len as u64;
            self.stats.device_to_host_copies += 1;
            self.emit(MoveKind::DeviceToHost, c, len as u64);
        } else {
            self.fill_host(c, room)?;
        }
        Ok(false)
    }

    // ------------------------------------------------------------- device tier

    /// Evicts device chunks until `need` more bytes fit under the tidal budget.
    fn make_room_device(
        &mut self,
        need: u64,
        protect: ChunkId,
        not_before: Option<u64>,
    ) -> Result<()> {
        loop {
            let used = self.device_used();
            if used + need <= self.dev_cap {
                return Ok(());
            }
            let candidates: Vec<ChunkId> = self
                .dev_list
                .iter()
                .copied()
                .filter(|&v| v != protect && self.slots[v.dense()].dev_pins == 0)
                .collect();
            if candidates.is_empty() {
                if not_before.is_none() && self.wait_any()? {
                    continue;
                }
                return Err(ChunkError::WorkingSetTooLarge {
                    moment: self.moment,
                    needed_bytes: used + need,
                    capacity_bytes: self.dev_cap,
                    short_bytes: used + need - self.dev_cap,
                });
            }
            let Some(victim) = self.dev_policy.choose(&candidates, self.moment) else {
                return Err(ChunkError::NoVictim {
                    moment: self.moment,
                    chunk: protect,
                    policy: "device",
                });
            };
            self.evict_device(victim, not_before, protect)?;
        }
    }

    /// Takes `v` off the device, copying it to the host first when the device copy is
    /// its only current one. On failure the device copy stays.
    /// `keep`'s host copy is not evicted to make room for the write-back.
    pub(crate) fn evict_device(
        &mut self,
        v: ChunkId,
        not_before: Option<u64>,
        keep: ChunkId,
    ) -> Result<()> {
        let d = v.dense();
        if self.slots[d].dev.is_none() {
            return Ok(());
        }
        let clean = self.slots[d].host.is_some() || self.slots[d].nvme_valid;
        if !clean {
            let buf = self.take_host_buffer(
                v,
                HostRoom {
                    protect: &[v, keep],
                    not_before,
                },
            )?;
            let Some(mem) = self.slots[d].dev.take() else {
                return Err(ChunkError::tier(
                    "evicting",
                    Some(v),
                    stopped("device copy vanished"),
                ));
            };
            let len = self.len(v);
            let id = self.device.copy_to_host(d as u64, mem, buf, len);
            let done = self.wait_copy_id(id, v)?;
            if let Err(e) = done.result {
                self.slots[d].dev = Some(done.mem);
                return Err(ChunkError::tier("copy device->host", Some(v), e));
            }
            drop(done.mem);
            self.slots[d].host = Some(done.host);
            self.host_list.push(v);
            self.host_policy.on_insert(v, self.moment);
            self.stats.device_to_host_bytes += len as u64;
            self.stats.device_to_host_copies += 1;
        } else {
            drop(self.slots[d].dev.take());
        }
        remove_from(&mut self.dev_list, v);
        self.dev_mark[d] = false;
        let slot = &mut self.slots[d];
        if slot.prefetched {
            slot.prefetched = false;
            self.stats.prefetch_wasted += 1;
        }
        self.stats.device_evictions += 1;
        self.dev_policy.on_evict(v, self.moment);
        if clean {
            self.stats.device_clean_evictions += 1;
            self.emit(MoveKind::DropDevice, v, 0);
        } else {
            let len = self.len_bytes[d];
            self.emit(MoveKind::DeviceToHost, v, len);
        }
        Ok(())
    }

    /// Evicts device chunks not in use until the device holds at most `cap` bytes;
    /// returns the bytes it still holds.
    pub(crate) fn shrink_device(&mut self, cap: u64) -> Result<u64> {
        loop {
            let used = self.device_used();
            if used <= cap {
                return Ok(used);
            }
            let candidates: Vec<ChunkId> = self
                .dev_list
                .iter()
                .copied()
                .filter(|&v| self.slots[v.dense()].dev_pins == 0)
                .collect();
            let Some(victim) = self.dev_policy.choose(&candidates, self.moment) else {
                if self.wait_any()? {
                    continue;
                }
                return Ok(used);
            };
            self.evict_device(victim, None, victim)?;
        }
    }

    /// Starts copying `c`'s host copy (its callers put one in the slot) into `mem`.
    fn start_h2d(&mut self, c: ChunkId, mem: DeviceMem) -> Result<()> {
        let d = c.dense();
        let Some(buf) = self.slots[d].host.take() else {
            drop(mem);
            return Err(ChunkError::Invariant {
                chunk: Some(c),
                what: "a host->device copy started without a host copy".into(),
            });
        };
        remove_from(&mut self.host_list, c);
        self.slots[d].host_prefetched = false;
        let len = self.len(c);
        let id = self.device.copy_to_device(d as u64, buf, mem, len);
        self.slots[d].pending = Pending::HostToDevice(id);
        self.dev_mark[d] = true;
        self.pending_h2d += 1;
        Ok(())
    }

    /// Makes `c` current on the device (demand). Returns whether it already was.
    pub(crate) fn ensure_device(&mut self, c: ChunkId) -> Result<bool> {
        let d = c.dense();
        if self.slots[d].pending != Pending::None {
            self.wait_pending(c)?;
        }
        if self.slots[d].dev.is_some() {
            self.dev_policy.on_access(c, self.moment);
            return Ok(true);
        }
        self.make_room_device(self.dev_bytes[d], c, None)?;
        let mem = self
            .device
            .alloc(d as u64, self.len(c))
            .map_err(tier_err("allocating device memory", c))?;
        let room = HostRoom {
            protect: &[c],
            not_before: None,
        };
        let buf = match self.host_copy_for_load(c, room) {
            Ok(b) => b,
            Err(e) => {
                drop(mem);
                return Err(e);
            }
        };
        self.slots[d].host = Some(buf);
        self.host_list.push(c);
        self.start_h2d(c, mem)?;
        self.stats.demand_loads += 1;
        self.wait_pending(c)?;
        self.dev_policy.on_insert(c, self.moment);
        Ok(false)
    }

    /// Starts loading `c` to the device ahead of need (at `needed_at`). Returns false
    /// when there is no room for it now without breaking the prefetch rule.
    pub(crate) fn prefetch_device(&mut self, c: ChunkId, needed_at: u64) -> Result<bool> {
        let d = c.dense();
        if self.dev_mark[d] || self.slots[d].pending != Pending::None {
            return Ok(true);
        }
        if self.device_free() < self.dev_bytes[d] || self.slots[d].host_pins > 0 {
            return Ok(false);
        }
        let mem = match self.device.alloc(d as u64, self.len(c)) {
            Ok(m) => m,
            Err(_) => return Ok(false),
        };
        let room = HostRoom {
            protect: &[c],
            not_before: Some(needed_at),
        };
        if self.slots[d].host.is_none() {
            if self.slots[d].nvme_valid {
                // A staging buffer now, or one a write-back in flight (perhaps the one
                // just started to make room) gives back: the read then waits in the
                // queue, and the copy to the reserved memory follows it.
                let buf = match self.take_host_buffer(c, room) {
                    Ok(b) => Some(b),
                    Err(e) if is_no_room(&e) && self.read_queue.len() < self.pending_writes => None,
                    Err(e) if is_no_room(&e) => return Ok(false),
                    Err(e) => return Err(e),
                };
                let slot = &mut self.slots[d];
                slot.reserved_dev = Some(mem);
                slot.prefetched = true;
                self.dev_mark[d] = true;
                self.stats.prefetch_loads += 1;
                self.dev_policy.on_insert(c, self.moment);
                match buf {
                    Some(buf) => {
                        self.nvme.submit_read(d as u64, buf);
                        self.slots[d].pending = Pending::NvmeRead;
                        self.pending_nvme += 1;
                        self.note_nvme_in_flight(false);
                    }
                    None => {
                        self.slots[d].pending = Pending::NvmeReadQueued;
                        self.read_queue.push_back(c);
                        self.stats.queued_reads += 1;
                        self.settle_queue();
                    }
                }
                return Ok(true);
            }
            match self.fill_host(c, room) {
                Ok(()) => {}
                Err(e) if is_no_room(&e) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        self.start_h2d(c, mem)?;
        self.slots[d].prefetched = true;
        self.stats.prefetch_loads += 1;
        self.dev_policy.on_insert(c, self.moment);
        Ok(true)
    }

    /// Starts reading `c` from NVMe into the host pool ahead of need, into a buffer
    /// that is free now, or queues the read for a buffer that a write-back in flight
    /// gives back (the host prefetcher makes room by its plan first, evicting with
    /// asynchronous write-backs; it never evicts here). Returns false when no buffer is
    /// free or owed. Chunks with nothing to read (a host or device copy, a transfer in
    /// flight or queued, never written) are done.
    pub(crate) fn prefetch_host(&mut self, c: ChunkId) -> Result<bool> {
        let d = c.dense();
        let s = &self.slots[d];
        if s.host.is_some() || s.dev.is_some() || s.pending != Pending::None || !s.nvme_valid {
            return Ok(true);
        }
        if self.read_queue.is_empty() {
            if let Ok(buf) = self.host.try_take(d as u64) {
                self.nvme.submit_read(d as u64, buf);
                let slot = &mut self.slots[d];
                slot.pending = Pending::NvmeRead;
                slot.host_prefetched = true;
                self.pending_nvme += 1;
                self.note_nvme_in_flight(false);
                self.stats.prefetch_loads += 1;
                self.stats.host_prefetch_loads += 1;
                return Ok(true);
            }
        }
        if self.read_queue.len() >= self.pending_writes {
            return Ok(false);
        }
        self.read_queue.push_back(c);
        let slot = &mut self.slots[d];
        slot.pending = Pending::NvmeReadQueued;
        slot.host_prefetched = true;
        self.stats.prefetch_loads += 1;
        self.stats.host_prefetch_loads += 1;
        self.stats.queued_reads += 1;
        // A buffer may be free already (a write-back that finished since).
        self.settle_queue();
        Ok(true)
    }

    /// Host-pool bytes held by write-backs in flight and not yet owed to a queued read:
    /// they come back to the pool when the writes complete.
    pub(crate) fn host_bytes_writing(&self) -> u64 {
        debug_assert!(
            self.read_queue.len() <= self.pending_writes,
            "more queued reads than write-backs to give them buffers"
        );
        self.pending_writes.saturating_sub(self.read_queue.len()) as u64
            * self.host.buf_bytes() as u64
    }

    /// Whether the host-tier prefetcher has nothing to load for `c`.
    pub(crate) fn host_ready(&self, c: ChunkId) -> bool {
        let s = &self.slots[c.dense()];
        s.host.is_some() || s.dev.is_some() || s.pending != Pending::None || !s.nvme_valid
    }

    // ------------------------------------------------------------- coherence

    /// `c` is about to change on the device: its host and NVMe copies become stale.
    pub(crate) fn dirty_on_device(&mut self, c: ChunkId) {
        let d = c.dense();
        self.slots[d].nvme_valid = false;
        if let Some(buf) = self.slots[d].host.take() {
            drop(buf);
            self.slots[d].host_prefetched = false;
            remove_from(&mut self.host_list, c);
            self.host_policy.on_evict(c, self.moment);
            self.emit(MoveKind::Invalidate, c, 0);
        }
    }

    /// `c` is about to change in the host pool: its device and NVMe copies become stale.
    pub(crate) fn dirty_on_host(&mut self, c: ChunkId) {
        let d = c.dense();
        self.slots[d].nvme_valid = false;
        if let Some(mem) = self.slots[d].dev.take() {
            drop(mem);
            remove_from(&mut self.dev_list, c);
            self.dev_mark[d] = false;
            self.slots[d].prefetched = false;
            self.dev_policy.on_evict(c, self.moment);
            self.emit(MoveKind::Invalidate, c, 0);
        }
    }

    /// Writes `c`'s current bytes to NVMe where its NVMe copy is not current, keeping
    /// its other copies (a device-only copy is copied to the host first): after it,
    /// a chunk ever materialised has a current NVMe copy. Synchronous. Pins are not
    /// touched: a chunk in use stays where it is.
    pub(crate) fn write_back(&mut self, c: ChunkId) -> Result<()> {
        self.wait_pending(c)?;
        let d = c.dense();
        let slot = &self.slots[d];
        if self.len_bytes[d] == 0 || slot.nvme_valid || (slot.host.is_none() && slot.dev.is_none())
        {
            return Ok(());
        }
        if slot.host.is_none() {
            // Both copies are current after it.
            self.ensure_host(c)?;
        }
        self.ensure_nvme_slot(c, true)?;
        let Some(buf) = self.slots[d].host.take() else {
            return Err(ChunkError::Invariant {
                chunk: Some(c),
                what: "no host copy to write back after loading one".into(),
            });
        };
        let len = self.len(c);
        self.drain_nvme();
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
        self.emit(MoveKind::HostToNvme, c, len as u64);
        Ok(())
    }

    /// Adopts a chunk the swap file already stores as the chunk's contents.
    pub(crate) fn adopt_nvme(&mut self, c: ChunkId) {
        let s = &mut self.slots[c.dense()];
        s.nvme_stored = true;
        s.nvme_valid = true;
    }
}

/// What [`Mover::verify`] counts over the slots.
#[derive(Debug, Default)]
struct Tally {
    dev_bytes: u64,
    host_buffers: u64,
    h2d: usize,
    nvme: usize,
    writes: usize,
    queued: usize,
}

impl Mover {
    /// Checks every invariant of the slots, the lists, the counters and the tiers that
    /// the moves rely on (see the module doc); the first broken one is
    /// [`ChunkError::Invariant`] naming the chunk and what disagrees.
    pub(crate) fn verify(&self) -> Result<()> {
        let mut t = Tally::default();
        for d in 0..self.slots.len() {
            self.verify_slot(d, &mut t)?;
        }
        let bad = |what: String| Err(ChunkError::Invariant { chunk: None, what });
        if self.hold_queue {
            return bad("the read queue is held outside a demand load".into());
        }
        if (self.pending_h2d, self.pending_nvme, self.pending_writes) != (t.h2d, t.nvme, t.writes) {
            return bad(format!(
                "in flight counted (h2d {}, nvme {}, writes {}) but slots say (h2d {}, nvme \
                 {}, writes {})",
                self.pending_h2d, self.pending_nvme, self.pending_writes, t.h2d, t.nvme, t.writes
            ));
        }
        if self.read_queue.len() != t.queued || self.read_queue.len() > self.pending_writes {
            return bad(format!(
                "{} reads queued, {} slots queued, {} write-backs to give them buffers",
                self.read_queue.len(),
                t.queued,
                self.pending_writes
            ));
        }
        let dev = self.device.budget();
        if dev.used_bytes() != t.dev_bytes
            || dev.capacity_bytes() != self.dev_cap
            || dev.used_bytes() > dev.capacity_bytes()
        {
            return bad(format!(
                "device budget uses {} of {} bytes (tide {}), the chunks' device copies take {}",
                dev.used_bytes(),
                dev.capacity_bytes(),
                self.dev_cap,
                t.dev_bytes
            ));
        }
        let host = self.host.budget();
        let host_bytes = t.host_buffers * self.host.buf_bytes() as u64;
        if host.used_bytes() != host_bytes || host.used_bytes() > host.capacity_bytes() {
            return bad(format!(
                "host pool uses {} of {} bytes, the chunks hold {} buffers ({host_bytes} bytes)",
                host.used_bytes(),
                host.capacity_bytes(),
                t.host_buffers
            ));
        }
        let nvme = self.nvme.budget();
        if nvme.used_bytes() > nvme.capacity_bytes() {
            return bad(format!(
                "swap file uses {} of {} bytes",
                nvme.used_bytes(),
                nvme.capacity_bytes()
            ));
        }
        for (id, _) in self.nvme.swap_file().chunks() {
            let ours = usize::try_from(id)
                .ok()
                .and_then(|d| self.slots.get(d))
                .is_some_and(|s| s.nvme_stored || s.pending == Pending::NvmeWrite);
            if !ours {
                return bad(format!(
                    "the swap file stores chunk {id}, which no slot claims"
                ));
            }
        }
        Ok(())
    }

    fn verify_slot(&self, d: usize, t: &mut Tally) -> Result<()> {
        let c = ChunkId::from_dense(d);
        let s = &self.slots[d];
        let bad = |what: String| {
            Err(ChunkError::Invariant {
                chunk: Some(c),
                what,
            })
        };
        let in_list = |list: &[ChunkId]| list.iter().filter(|&&x| x == c).count();
        if self.len_bytes[d] == 0 {
            let empty = s.dev.is_none()
                && s.host.is_none()
                && !s.nvme_stored
                && s.pending == Pending::None
                && s.reserved_dev.is_none()
                && s.dev_pins == 0
                && s.host_pins == 0;
            return if empty {
                Ok(())
            } else {
                bad("a chunk the layout does not have holds state".into())
            };
        }
        if s.dev_pins > 0 && s.host_pins > 0 {
            return bad(format!(
                "pinned on both tiers ({} device, {} host pins)",
                s.dev_pins, s.host_pins
            ));
        }
        if s.dev_pins > 0 && (s.dev.is_none() || s.pending != Pending::None) {
            return bad(format!(
                "{} device pins without a device copy ready",
                s.dev_pins
            ));
        }
        if s.host_pins > 0 && (s.host.is_none() || s.pending != Pending::None) {
            return bad(format!(
                "{} host pins without a host copy ready",
                s.host_pins
            ));
        }
        if s.nvme_valid && !s.nvme_stored {
            return bad("NVMe copy current but no slot stored".into());
        }
        // A write-back in flight may have completed in the swap file (stored there, or
        // dropped after a failure) before its completion is routed here.
        let writing = s.pending == Pending::NvmeWrite;
        if !writing && s.nvme_stored != self.nvme.contains(d as u64) {
            return bad(format!(
                "slot says stored on NVMe {}, the swap file {}",
                s.nvme_stored,
                self.nvme.contains(d as u64)
            ));
        }
        if !writing && s.nvme_stored && self.nvme.len_of(d as u64) != Some(self.len(c)) {
            return bad(format!(
                "stored on NVMe as {:?} bytes, the chunk is {}",
                self.nvme.len_of(d as u64),
                self.len(c)
            ));
        }
        let copies = s.host.is_some() || s.dev.is_some();
        let moving = match s.pending {
            Pending::None => false,
            Pending::HostToDevice(_) => {
                t.h2d += 1;
                t.host_buffers += 1;
                t.dev_bytes += self.dev_bytes[d];
                true
            }
            Pending::NvmeRead => {
                t.nvme += 1;
                t.host_buffers += 1;
                true
            }
            Pending::NvmeReadQueued => {
                t.queued += 1;
                if self.read_queue.iter().filter(|&&x| x == c).count() != 1 {
                    return bad("queued for a read but not once in the read queue".into());
                }
                true
            }
            Pending::NvmeWrite => {
                t.nvme += 1;
                t.writes += 1;
                t.host_buffers += 1;
                if s.nvme_valid {
                    return bad("a write-back in flight over a current NVMe copy".into());
                }
                true
            }
        };
        if moving && copies {
            return bad(format!(
                "{:?} in flight beside a copy in the slot",
                s.pending
            ));
        }
        let reading = matches!(s.pending, Pending::NvmeRead | Pending::NvmeReadQueued);
        if reading && !s.nvme_valid {
            return bad("an NVMe read of a copy that is not current".into());
        }
        if s.reserved_dev.is_some() {
            if !reading {
                return bad("device memory reserved without a read for it".into());
            }
            t.dev_bytes += self.dev_bytes[d];
        }
        if s.nvme_stored
            && !s.nvme_valid
            && !copies
            && !matches!(s.pending, Pending::HostToDevice(_) | Pending::NvmeWrite)
        {
            return bad("its only copy is a stale NVMe copy".into());
        }
        if s.dev.is_some() {
            t.dev_bytes += self.dev_bytes[d];
        }
        if s.host.is_some() {
            t.host_buffers += 1;
        }
        if in_list(&self.dev_list) != usize::from(s.dev.is_some()) {
            return bad(format!(
                "device copy {}, {} times in the device list",
                s.dev.is_some(),
                in_list(&self.dev_list)
            ));
        }
        if in_list(&self.host_list) != usize::from(s.host.is_some()) {
            return bad(format!(
                "host copy {}, {} times in the host list",
                s.host.is_some(),
                in_list(&self.host_list)
            ));
        }
        let marked = s.dev.is_some()
            || s.reserved_dev.is_some()
            || matches!(s.pending, Pending::HostToDevice(_));
        if self.dev_mark[d] != marked {
            return bad(format!(
                "device mark {} but on or bound for the device {marked}",
                self.dev_mark[d]
            ));
        }
        if s.prefetched && !marked {
            return bad("prefetched to the device but not there".into());
        }
        Ok(())
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

/// Keeps NVMe transfers moving while the store's chunk buffers are lent out as views
/// ([`crate::ChunkStore::views_mut_with_io`]): a request starts in pieces of the I/O
/// block size, at most the queue depth at once, and the next pieces start only when the
/// engine is polled. [`IoPump::poll`] polls it; completions are kept and routed into
/// their chunks at the store's next call.
pub struct IoPump<'a> {
    nvme: &'a mut NvmeTier,
    stash: &'a mut VecDeque<NvmeCompletion>,
    active: bool,
}

impl std::fmt::Debug for IoPump<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoPump")
            .field("active", &self.active)
            .field("stashed", &self.stash.len())
            .finish()
    }
}

impl IoPump<'_> {
    /// Starts queued NVMe pieces and takes finished requests, without waiting. Cheap
    /// when nothing is in flight.
    pub fn poll(&mut self) {
        if !self.active {
            return;
        }
        while let Some(c) = self.nvme.poll() {
            self.stash.push_back(c);
        }
    }
}
