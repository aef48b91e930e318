//! The device tier: one type, [`Device`], for a CUDA GPU or its host simulation.
//!
//! Everything above (the chunk store, the optimizer) uses [`Device`] and never asks which
//! backend it is: enum dispatch over [`SimDevice`] and [`CudaDevice`], as candle's
//! `Storage`. Without the `cuda` feature `CudaDevice` is an uninhabited stand-in, so no
//! code above needs a `cfg`.
//!
//! Invariants:
//! - chunk memory is a block of the device's slab ([`crate::slab`]), one region allocated
//!   when the device opens and never again: [`Device::alloc`] takes a
//!   [`Lease`](crate::budget::Lease) of the chunk's bytes (rounded up to 4096, exactly the
//!   block's size) and then a block; the memory gives both back when dropped, wherever
//!   that is. The budget's capacity never exceeds the slab;
//! - non-model memory is the same quantity on both backends: what the caller reported
//!   ([`Device::report_non_model_bytes`], e.g. activations the bench models) plus what is
//!   measured beyond the slab, `(total - free) - slab footprint` from the driver (the
//!   simulation's driver sees the slab only, so it measures zero). Chunks are counted at
//!   their real footprint: the whole slab, rounded to the allocation granularity;
//! - a copy owns both ends: the host buffer and the device memory move into
//!   [`Device::submit_copy`] and come back, exactly once, inside its [`CopyCompletion`],
//!   whether it succeeded or not; nobody can touch either while the copy runs;
//! - each direction has its own copy stream (GPU) or copy worker (simulation), so an
//!   eviction's copy overlaps a prefetch's on GPUs with two copy engines; completions are
//!   handed back in submission order all the same (the oldest copy is waited for first);
//!   at most `copy_queue_depth` are in flight, a submit beyond that first waits for the
//!   oldest;
//! - a malformed request (memory of another device, a length larger than either end or
//!   zero) never starts: it completes at once with the error and its buffers.

#![deny(unsafe_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};

use tidestore_io::{align_up, AlignedBuf, BufferPool};

use crate::budget::{Budget, SharedBudget, TierKind};
use crate::error::{Result, TierError};
use crate::slab::{SharedSlab, SlabStats};
use crate::stats::LinkStats;

pub use crate::cuda::{CudaDevice, CudaMem, CudaPinnedRegion};
pub use crate::sim::{SimDevice, SimMem};
pub use crate::span::{CudaSpan, CudaSpanMut};

/// Id of a copy, unique per device, handed out by [`Device::submit_copy`] and carried by
/// its completion.
pub type CopyId = u64;

/// The simulated driver's allocation granularity unless configured (CUDA's usual one).
pub const SIM_ALLOC_GRANULARITY_BYTES_DEFAULT: u64 = 2 << 20;

/// Most copies one device keeps in flight.
pub const COPY_QUEUE_DEPTH_MAX: usize = 1024;

static NEXT_DEVICE_ID: AtomicU32 = AtomicU32::new(1);

pub(crate) fn next_device_id() -> u32 {
    NEXT_DEVICE_ID.fetch_add(1, Ordering::Relaxed)
}

/// Which backend a [`Device`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// Device memory simulated in host memory.
    Sim,
    /// A CUDA GPU.
    Cuda,
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Sim => "sim",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// How to open the device tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Bytes of device memory chunks may use at first (changed later with
    /// [`Device::set_budget_capacity`]).
    pub budget_bytes: u64,
    /// CUDA device ordinal.
    pub ordinal: usize,
    /// Most copies in flight at once; 1 ..= [`COPY_QUEUE_DEPTH_MAX`].
    pub copy_queue_depth: usize,
    /// Total memory of the simulated device; `None`: the budget.
    pub sim_total_bytes: Option<u64>,
    /// Bandwidth of the simulated host↔device link (each direction); `None`: as fast as
    /// `memcpy`.
    pub sim_link_bytes_per_s: Option<u64>,
    /// Bytes of the chunk slab allocated when the device opens; the budget can never be
    /// set above it. `None`: the simulated device's whole memory, or on a GPU the initial
    /// budget (`budget_bytes`).
    pub slab_bytes: Option<u64>,
    /// Allocation granularity of the simulated driver (a power of two, at least 4096):
    /// the slab occupies its size rounded up to it, as on a GPU (2 MiB by default).
    pub sim_alloc_granularity_bytes: u64,
}

impl DeviceConfig {
    /// Defaults around a budget: device 0, 16 copies in flight, a simulated device as
    /// large as the budget, copies as fast as `memcpy`.
    pub fn new(budget_bytes: u64) -> Self {
        DeviceConfig {
            budget_bytes,
            ordinal: 0,
            copy_queue_depth: 16,
            sim_total_bytes: None,
            sim_link_bytes_per_s: None,
            slab_bytes: None,
            sim_alloc_granularity_bytes: SIM_ALLOC_GRANULARITY_BYTES_DEFAULT,
        }
    }

    /// Check every value; the error names the first bad key.
    pub fn validate(&self) -> Result<()> {
        if self.copy_queue_depth == 0 || self.copy_queue_depth > COPY_QUEUE_DEPTH_MAX {
            return Err(TierError::Config {
                key: "device.copy_queue_depth",
                reason: format!(
                    "{} is outside 1..={COPY_QUEUE_DEPTH_MAX}",
                    self.copy_queue_depth
                ),
            });
        }
        let g = self.sim_alloc_granularity_bytes;
        if !g.is_power_of_two() || g < 4096 {
            return Err(TierError::Config {
                key: "device.sim_alloc_granularity",
                reason: format!("{g} is not a power of two of at least 4096"),
            });
        }
        if let Some(slab) = self.slab_bytes {
            if slab < self.budget_bytes {
                return Err(TierError::Config {
                    key: "device.slab_bytes",
                    reason: format!(
                        "a slab of {slab} bytes cannot hold the budget of {} bytes",
                        self.budget_bytes
                    ),
                });
            }
        }
        if self.sim_link_bytes_per_s == Some(0) {
            return Err(TierError::Config {
                key: "device.sim_link_bandwidth",
                reason: "a link of zero bytes per second moves nothing".into(),
            });
        }
        Ok(())
    }
}

/// Memory of the device as its driver (or the simulation) sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    pub total_bytes: u64,
    pub free_bytes: u64,
}

/// Direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyDir {
    HostToDevice,
    DeviceToHost,
}

impl std::fmt::Display for CopyDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CopyDir::HostToDevice => "host->device",
            CopyDir::DeviceToHost => "device->host",
        })
    }
}

/// One asynchronous copy between a host buffer and device memory. Both move into the
/// copy and come back in its [`CopyCompletion`].
#[derive(Debug)]
pub struct CopyRequest {
    pub dir: CopyDir,
    /// The chunk being moved; for error context and echoed in the completion.
    pub chunk: u64,
    pub host: AlignedBuf,
    pub mem: DeviceMem,
    /// Bytes to move from the start of each end; `1 ..= min(host capacity, mem bytes)`.
    pub len_bytes: usize,
}

/// A finished copy: both ends back, and whether every byte moved.
#[derive(Debug)]
pub struct CopyCompletion {
    pub id: CopyId,
    pub dir: CopyDir,
    pub chunk: u64,
    pub host: AlignedBuf,
    pub mem: DeviceMem,
    pub len_bytes: usize,
    pub result: Result<()>,
}

impl CopyCompletion {
    pub(crate) fn new(id: CopyId, req: CopyRequest, result: Result<()>) -> Self {
        CopyCompletion {
            id,
            dir: req.dir,
            chunk: req.chunk,
            host: req.host,
            mem: req.mem,
            len_bytes: req.len_bytes,
            result,
        }
    }
}

/// A copy the backend has finished, before the device has accounted for it.
pub(crate) type RawDone = (CopyId, CopyRequest, Result<()>);

/// Device memory holding one chunk: simulated (host memory) or on a GPU. No `Clone`
/// (a copy may not fit in the budget). Dropping it frees it and releases its budget.
#[derive(Debug)]
pub enum DeviceMem {
    Sim(SimMem),
    Cuda(CudaMem),
}

/// A read-only view of device memory for compute: host bytes in the simulation, a span
/// of GPU memory (see [`CudaSpan`]) on a GPU.
#[derive(Debug)]
pub enum DeviceView<'a> {
    Host(&'a [u8]),
    Cuda(CudaSpan<'a>),
}

/// A writable view of device memory for compute.
#[derive(Debug)]
pub enum DeviceViewMut<'a> {
    Host(&'a mut [u8]),
    Cuda(CudaSpanMut<'a>),
}

macro_rules! mem_dispatch {
    ($self:expr, $m:ident => $e:expr) => {
        match $self {
            DeviceMem::Sim($m) => $e,
            DeviceMem::Cuda($m) => $e,
        }
    };
}

impl DeviceMem {
    /// Bytes asked for at allocation (the budget holds them rounded up to 4096).
    pub fn bytes(&self) -> usize {
        mem_dispatch!(self, m => m.bytes())
    }

    /// The chunk this memory was allocated for.
    pub fn chunk(&self) -> u64 {
        mem_dispatch!(self, m => m.chunk())
    }

    /// The device this memory belongs to.
    pub fn device_id(&self) -> u32 {
        mem_dispatch!(self, m => m.device_id())
    }

    /// Which backend this memory lives on.
    pub fn kind(&self) -> DeviceKind {
        match self {
            DeviceMem::Sim(_) => DeviceKind::Sim,
            DeviceMem::Cuda(_) => DeviceKind::Cuda,
        }
    }

    /// A view for compute. On a GPU, kernels reading through the pointer must finish
    /// before the memory is dropped or handed to a copy.
    pub fn view(&self) -> DeviceView<'_> {
        mem_dispatch!(self, m => m.view())
    }

    /// A writable view for compute (same rule as [`DeviceMem::view`]).
    pub fn view_mut(&mut self) -> DeviceViewMut<'_> {
        mem_dispatch!(self, m => m.view_mut())
    }
}

/// A host region registered (pinned) with the device for fast asynchronous copies, or the
/// token that says nothing needed pinning. Unregisters when dropped; it keeps the pool's
/// mapping alive until then.
#[derive(Debug)]
pub struct PinnedRegion(PinnedInner);

#[derive(Debug)]
enum PinnedInner {
    Unpinned,
    Cuda(CudaPinnedRegion),
}

impl PinnedRegion {
    /// Nothing pinned (the simulation, or pinning refused and logged).
    pub fn unpinned() -> Self {
        PinnedRegion(PinnedInner::Unpinned)
    }

    /// Whether the region is page-locked and registered with a GPU.
    pub fn is_pinned(&self) -> bool {
        matches!(self.0, PinnedInner::Cuda(_))
    }

    /// Bytes page-locked (zero when nothing is).
    pub fn pinned_bytes(&self) -> usize {
        match &self.0 {
            PinnedInner::Unpinned => 0,
            PinnedInner::Cuda(r) => r.bytes(),
        }
    }
}

impl From<CudaPinnedRegion> for PinnedRegion {
    fn from(region: CudaPinnedRegion) -> Self {
        PinnedRegion(PinnedInner::Cuda(region))
    }
}

/// `bytes` rounded down to the budget's unit (a page, 4096).
fn align_down_page(bytes: u64) -> u64 {
    bytes - bytes % crate::slab::BLOCK_ALIGN_BYTES
}

/// Where a backend put its slab: its size, the device memory it occupies (rounded up to
/// the allocation granularity) and its first byte's address.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlabPlace {
    pub(crate) bytes: u64,
    pub(crate) footprint_bytes: u64,
    pub(crate) base_addr: u64,
    /// The driver's allocation granularity (overflow allocations are rounded to it).
    pub(crate) granularity_bytes: u64,
}

/// What both backends share: the budget, the slab, the copy ids, the queue of finished
/// copies, the reported non-model memory and the link counters.
#[derive(Debug)]
pub(crate) struct DeviceCore {
    pub(crate) device_id: u32,
    pub(crate) budget: SharedBudget,
    pub(crate) total_bytes: u64,
    pub(crate) queue_depth: usize,
    pub(crate) slab: SharedSlab,
    /// Device memory the slab occupies (its size rounded up to the allocation granularity).
    pub(crate) slab_footprint_bytes: u64,
    slab_base_addr: u64,
    non_model_reported_bytes: u64,
    next_copy_id: CopyId,
    ready: VecDeque<CopyCompletion>,
    links: LinkStats,
}

impl DeviceCore {
    /// Checks the budget against the device and the slab the backend allocated.
    pub(crate) fn new(cfg: &DeviceConfig, total_bytes: u64, slab: SlabPlace) -> Result<Self> {
        let SlabPlace {
            bytes: slab_bytes,
            footprint_bytes: slab_footprint_bytes,
            base_addr: slab_base_addr,
            granularity_bytes: slab_granularity_bytes,
        } = slab;
        cfg.validate()?;
        if cfg.budget_bytes > total_bytes {
            return Err(TierError::BudgetExceedsDevice {
                budget_bytes: cfg.budget_bytes,
                total_bytes,
            });
        }
        let slab = SharedSlab::new(slab_bytes, slab_granularity_bytes);
        // Leases are whole pages: a budget's last partial page can never be used.
        if align_down_page(cfg.budget_bytes) > align_down_page(slab_bytes) {
            return Err(TierError::BudgetExceedsSlab {
                budget_bytes: cfg.budget_bytes,
                slab_bytes,
            });
        }
        Ok(DeviceCore {
            device_id: next_device_id(),
            budget: SharedBudget::new(TierKind::Device, cfg.budget_bytes),
            total_bytes,
            queue_depth: cfg.copy_queue_depth,
            slab,
            slab_footprint_bytes,
            slab_base_addr,
            non_model_reported_bytes: 0,
            next_copy_id: 1,
            ready: VecDeque::with_capacity(cfg.copy_queue_depth * 2),
            links: LinkStats::default(),
        })
    }

    /// The non-model bytes reported last.
    pub(crate) fn non_model_reported_bytes(&self) -> u64 {
        self.non_model_reported_bytes
    }

    /// Account for a finished copy and queue it for the caller.
    fn finish(&mut self, (id, req, result): RawDone) {
        if result.is_ok() {
            self.links.record(req.dir, req.len_bytes as u64);
        } else {
            self.links.failed_copies += 1;
        }
        self.ready.push_back(CopyCompletion::new(id, req, result));
    }
}

macro_rules! dispatch {
    ($self:expr, $d:ident => $e:expr) => {
        match $self {
            Device::Sim($d) => $e,
            Device::Cuda($d) => $e,
        }
    };
}

/// The device tier: a CUDA GPU or its simulation in host memory, behind one type.
#[derive(Debug)]
pub enum Device {
    Sim(SimDevice),
    Cuda(CudaDevice),
}

impl Device {
    /// The host simulation.
    pub fn sim(cfg: &DeviceConfig) -> Result<Self> {
        Ok(Device::Sim(SimDevice::new(cfg)?))
    }

    /// A CUDA GPU, or [`TierError::NoGpu`] / [`TierError::NotCompiledWithCuda`].
    pub fn cuda(cfg: &DeviceConfig) -> Result<Self> {
        Ok(Device::Cuda(CudaDevice::new(cfg)?))
    }

    /// A CUDA GPU where there is one, otherwise the simulation (logged). Errors other
    /// than a missing GPU or missing CUDA support (a bad config, a budget larger than
    /// the GPU) are returned, not papered over.
    pub fn auto(cfg: &DeviceConfig) -> Result<Self> {
        match CudaDevice::new(cfg) {
            Ok(d) => Ok(Device::Cuda(d)),
            Err(e @ (TierError::NoGpu { .. } | TierError::NotCompiledWithCuda)) => {
                tracing::info!(reason = %e, "device tier: no CUDA GPU; simulating the device in host memory");
                Device::sim(cfg)
            }
            Err(e) => Err(e),
        }
    }

    /// Which backend this is.
    pub fn kind(&self) -> DeviceKind {
        match self {
            Device::Sim(_) => DeviceKind::Sim,
            Device::Cuda(_) => DeviceKind::Cuda,
        }
    }

    /// A process-unique id; memory remembers the device it came from by it.
    pub fn id(&self) -> u32 {
        dispatch!(self, d => d.core().device_id)
    }

    fn core(&self) -> &DeviceCore {
        dispatch!(self, d => d.core())
    }

    fn core_mut(&mut self) -> &mut DeviceCore {
        dispatch!(self, d => d.core_mut())
    }

    /// The chunk budget as it is now (capacity, used, peak).
    pub fn budget(&self) -> Budget {
        self.core().budget.snapshot()
    }

    /// Move the chunk budget (tidal: small during forward/backward, nearly all of the
    /// slab during the optimizer step). Refused below what is in use
    /// ([`TierError::ShrinkBelowUsed`] says how much to evict), above the device's total
    /// memory and above the slab ([`Device::slab_bytes`]).
    pub fn set_budget_capacity(&self, capacity_bytes: u64) -> Result<()> {
        let core = self.core();
        if capacity_bytes > core.total_bytes {
            return Err(TierError::BudgetExceedsDevice {
                budget_bytes: capacity_bytes,
                total_bytes: core.total_bytes,
            });
        }
        let slab_bytes = self.slab_bytes();
        if align_down_page(capacity_bytes) > align_down_page(slab_bytes) {
            return Err(TierError::BudgetExceedsSlab {
                budget_bytes: capacity_bytes,
                slab_bytes,
            });
        }
        core.budget.set_capacity(capacity_bytes)
    }

    /// Bytes of the chunk slab: the most the chunk budget can ever be. A store sizes its
    /// budgets by `min(total memory, slab)`.
    pub fn slab_bytes(&self) -> u64 {
        self.core().slab.stats().slab_bytes
    }

    /// The slab's counts: bytes in blocks now and at peak, blocks, refusals.
    pub fn slab_stats(&self) -> SlabStats {
        self.core().slab.stats()
    }

    /// Address of the slab's first byte (host memory in the simulation, a device pointer
    /// on a GPU): every chunk's memory lies in `base .. base + slab_bytes`.
    pub fn slab_base_addr(&self) -> u64 {
        self.core().slab_base_addr
    }

    /// Check the slab's invariants (for tests; cheap for a few hundred chunks).
    pub fn verify_slab(&self) -> std::result::Result<(), String> {
        self.core().slab.verify()
    }

    /// Bytes to evict before the budget could be `capacity_bytes`.
    pub fn excess_bytes_at(&self, capacity_bytes: u64) -> u64 {
        self.core().budget.excess_bytes_at(capacity_bytes)
    }

    /// Restart peak tracking of the budget.
    pub fn reset_peak(&self) {
        self.core().budget.reset_peak();
    }

    /// Device memory for `chunk` (`bytes`, counted rounded up to 4096): a block of the
    /// slab, within the budget. [`TierError::OverBudget`] when the budget has no room,
    /// [`TierError::DeviceOutOfMemory`] when the device (or, fragmented, the slab) has
    /// none. Never asks the driver for memory.
    pub fn alloc(&self, chunk: u64, bytes: usize) -> Result<DeviceMem> {
        if bytes == 0 {
            return Err(TierError::ZeroBytes {
                tier: TierKind::Device,
                chunk,
            });
        }
        let lease = self.core().budget.try_lease(align_up(bytes) as u64)?;
        dispatch!(self, d => d.alloc(chunk, bytes, lease))
    }

    /// Start a copy. Never blocks unless `copy_queue_depth` copies are in flight (then it
    /// first waits for the oldest). The result, with both buffers, comes back through
    /// [`Device::poll_copy`], [`Device::wait_copy`] or [`Device::wait_copy_id`].
    pub fn submit_copy(&mut self, req: CopyRequest) -> CopyId {
        let id = {
            let core = self.core_mut();
            let id = core.next_copy_id;
            core.next_copy_id += 1;
            id
        };
        if let Err(e) = self.check(id, &req) {
            self.core_mut()
                .ready
                .push_back(CopyCompletion::new(id, req, Err(e)));
            return id;
        }
        while self.in_flight() >= self.core().queue_depth {
            if !self.reap(true) {
                break;
            }
        }
        let refused = dispatch!(self, d => d.start_copy(id, req));
        if let Some((e, req)) = refused {
            self.core_mut()
                .ready
                .push_back(CopyCompletion::new(id, req, Err(e)));
        }
        id
    }

    /// Copy the first `len_bytes` of `host` into `mem`.
    pub fn copy_to_device(
        &mut self,
        chunk: u64,
        host: AlignedBuf,
        mem: DeviceMem,
        len_bytes: usize,
    ) -> CopyId {
        self.submit_copy(CopyRequest {
            dir: CopyDir::HostToDevice,
            chunk,
            host,
            mem,
            len_bytes,
        })
    }

    /// Copy the first `len_bytes` of `mem` into `host`.
    pub fn copy_to_host(
        &mut self,
        chunk: u64,
        mem: DeviceMem,
        host: AlignedBuf,
        len_bytes: usize,
    ) -> CopyId {
        self.submit_copy(CopyRequest {
            dir: CopyDir::DeviceToHost,
            chunk,
            host,
            mem,
            len_bytes,
        })
    }

    fn check(&self, id: CopyId, req: &CopyRequest) -> Result<()> {
        let bad = |reason: String| {
            Err(TierError::BadCopy {
                id,
                chunk: req.chunk,
                reason,
            })
        };
        if req.mem.kind() != self.kind() || req.mem.device_id() != self.id() {
            return bad(format!(
                "memory of {} device {} handed to {} device {}",
                req.mem.kind(),
                req.mem.device_id(),
                self.kind(),
                self.id()
            ));
        }
        if req.len_bytes == 0 {
            return bad("a copy of zero bytes".into());
        }
        if req.len_bytes > req.host.capacity() {
            return Err(TierError::TooLarge {
                tier: TierKind::Host,
                chunk: req.chunk,
                len_bytes: req.len_bytes as u64,
                limit_bytes: req.host.capacity() as u64,
            });
        }
        if req.len_bytes > req.mem.bytes() {
            return Err(TierError::TooLarge {
                tier: TierKind::Device,
                chunk: req.chunk,
                len_bytes: req.len_bytes as u64,
                limit_bytes: req.mem.bytes() as u64,
            });
        }
        Ok(())
    }

    /// Copies submitted and not yet handed back (in flight or finished and queued).
    pub fn copies_outstanding(&self) -> usize {
        self.in_flight() + self.core().ready.len()
    }

    fn in_flight(&self) -> usize {
        dispatch!(self, d => d.in_flight())
    }

    /// Move one finished copy from the backend to the ready queue; false when none could
    /// be had (none in flight, or, with `block` false, none finished yet).
    fn reap(&mut self, block: bool) -> bool {
        let done = dispatch!(self, d => d.next_done(block));
        match done {
            Some(raw) => {
                self.core_mut().finish(raw);
                true
            }
            None => false,
        }
    }

    /// A finished copy if there is one, without waiting.
    pub fn poll_copy(&mut self) -> Option<CopyCompletion> {
        if self.core().ready.is_empty() {
            while self.reap(false) {}
        }
        self.core_mut().ready.pop_front()
    }

    /// The next finished copy (in submission order), waiting for it; `None` when nothing
    /// is outstanding.
    pub fn wait_copy(&mut self) -> Option<CopyCompletion> {
        if self.core().ready.is_empty() {
            self.reap(true);
        }
        self.core_mut().ready.pop_front()
    }

    /// Wait for copy `id`; other copies that finish meanwhile stay queued. `None` when
    /// `id` is not outstanding (already handed back, never submitted, or lost with a
    /// stopped copy engine).
    pub fn wait_copy_id(&mut self, id: CopyId) -> Option<CopyCompletion> {
        loop {
            let ready = &mut self.core_mut().ready;
            if let Some(pos) = ready.iter().position(|c| c.id == id) {
                return ready.remove(pos);
            }
            if !self.reap(true) {
                return None;
            }
        }
    }

    /// Wait until every copy in flight has finished (their completions stay queued for
    /// [`Device::poll_copy`]); on a GPU, also wait for all work on the device.
    pub fn synchronize(&mut self) -> Result<()> {
        while self.in_flight() > 0 {
            if !self.reap(true) {
                return Err(TierError::CopyEngineStopped {
                    reason: format!("{} copies in flight never finished", self.in_flight()),
                });
            }
        }
        dispatch!(self, d => d.synchronize())
    }

    /// Total device memory, and what neither chunks nor non-model memory use: the
    /// driver's free memory (`cuMemGetInfo`, or the simulated driver's) plus the slab's
    /// free blocks, less the reported non-model bytes.
    pub fn mem_info(&self) -> Result<MemInfo> {
        let driver = dispatch!(self, d => d.driver_mem_info())?;
        let core = self.core();
        let slab = core.slab.stats();
        Ok(MemInfo {
            total_bytes: driver.total_bytes,
            free_bytes: (driver.free_bytes + (slab.slab_bytes - slab.used_bytes))
                .saturating_sub(core.non_model_reported_bytes()),
        })
    }

    /// Report device memory used by everything but chunks that the device cannot see
    /// (activations a modeled compute would hold); it adds to what is measured.
    pub fn report_non_model_bytes(&mut self, bytes: u64) {
        self.core_mut().non_model_reported_bytes = bytes;
    }

    /// Device memory in use by everything but chunks, the same on both backends: the
    /// reported bytes plus the measured `(total - free) - chunk footprint`, the chunk
    /// footprint being the slab's plus that of any overflow allocation (zero in the
    /// simulation, whose driver holds only those).
    pub fn non_model_bytes(&self) -> Result<u64> {
        let driver = dispatch!(self, d => d.driver_mem_info())?;
        let core = self.core();
        let chunk_footprint_bytes =
            core.slab_footprint_bytes + core.slab.stats().overflow_footprint_bytes;
        let measured = (driver.total_bytes - driver.free_bytes.min(driver.total_bytes))
            .saturating_sub(chunk_footprint_bytes);
        Ok(core.non_model_reported_bytes() + measured)
    }

    /// The non-model bytes reported last (see [`Device::report_non_model_bytes`]).
    pub fn non_model_reported_bytes(&self) -> u64 {
        self.core().non_model_reported_bytes()
    }

    /// Page-lock `pool`'s region for fast asynchronous copies (a GPU), or do nothing
    /// (the simulation). Keep the returned region as long as the pool is used for copies.
    pub fn pin_pool(&self, pool: &BufferPool) -> Result<PinnedRegion> {
        dispatch!(self, d => d.pin_pool(pool))
    }

    /// Bytes and copies moved per direction of the host↔device link.
    pub fn link_stats(&self) -> LinkStats {
        self.core().links
    }
}

/// What each backend provides to [`Device`] (the uninhabited CUDA stand-in too), so the
/// dispatch above compiles against either. Crate-private: the public seam is [`Device`].
pub(crate) trait DeviceBackend {
    fn core(&self) -> &DeviceCore;
    fn core_mut(&mut self) -> &mut DeviceCore;
    fn alloc(&self, chunk: u64, bytes: usize, lease: crate::budget::Lease) -> Result<DeviceMem>;
    /// Start a copy; `Some` when it was refused, with the request back.
    fn start_copy(&mut self, id: CopyId, req: CopyRequest) -> Option<(TierError, CopyRequest)>;
    fn in_flight(&self) -> usize;
    fn next_done(&mut self, block: bool) -> Option<RawDone>;
    fn synchronize(&mut self) -> Result<()>;
    /// Total and free memory as the driver (or the simulated driver) sees it: the slab
    /// counts as used whole.
    fn driver_mem_info(&self) -> Result<MemInfo>;
    fn pin_pool(&self, pool: &BufferPool) -> Result<PinnedRegion>;
}
