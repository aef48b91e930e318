//! The device tier: one type, [`Device`], for a CUDA GPU or its host simulation.
//!
//! Everything above (the chunk store, the optimizer) uses [`Device`] and never asks which
//! backend it is: enum dispatch over [`SimDevice`] and [`CudaDevice`], as candle's
//! `Storage`. Each backend implements the crate's backend trait (`backend`, a leaf it
//! imports) over its own memory type, which [`DeviceMem`] wraps; no backend names this
//! module. Without the `cuda` feature `CudaDevice` is an uninhabited stand-in, so no
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

use tidestore_io::{align_up, AlignedBuf, BufferPool};

use crate::backend::{align_down_page, CopyOf, DeviceBackend, DeviceCore, RawDone};
use crate::budget::Budget;
use crate::error::{Result, TierError};
use crate::kind::TierKind;
use crate::slab::SlabStats;
use crate::stats::LinkStats;

pub use crate::backend::{
    DeviceConfig, DeviceKind, MemInfo, COPY_QUEUE_DEPTH_MAX, SIM_ALLOC_GRANULARITY_BYTES_DEFAULT,
};
pub use crate::copy::{CopyDir, CopyId};
pub use crate::cuda::{CudaDevice, CudaMem, CudaPinnedRegion};
pub use crate::sim::{SimDevice, SimMem};
pub use crate::span::{CudaSpan, CudaSpanMut};
pub use crate::view::{DeviceView, DeviceViewMut};

/// One asynchronous copy between a host buffer and device memory. Both move into the
/// copy and come back in its [`CopyCompletion`].
pub type CopyRequest = CopyOf<DeviceMem>;

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

/// Device memory holding one chunk: simulated (host memory) or on a GPU. No `Clone`
/// (a copy may not fit in the budget). Dropping it frees it and releases its budget.
#[derive(Debug)]
pub enum DeviceMem {
    Sim(SimMem),
    Cuda(CudaMem),
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
        mem_dispatch!(self, m => m.tag().bytes)
    }

    /// The chunk this memory was allocated for.
    pub fn chunk(&self) -> u64 {
        mem_dispatch!(self, m => m.tag().chunk)
    }

    /// The device this memory belongs to.
    pub fn device_id(&self) -> u32 {
        mem_dispatch!(self, m => m.tag().device_id)
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

macro_rules! dispatch {
    ($backend:expr, $d:ident => $e:expr) => {
        match $backend {
            Backend::Sim($d) => $e,
            Backend::Cuda($d) => $e,
        }
    };
}

/// The device tier: a CUDA GPU or its simulation in host memory, behind one type, with
/// the queue of finished copies (accounted, in submission order) both share.
#[derive(Debug)]
pub struct Device {
    backend: Backend,
    next_copy_id: CopyId,
    ready: VecDeque<CopyCompletion>,
    links: LinkStats,
}

/// The backends [`Device`] dispatches over; each has its own memory type, which
/// [`DeviceMem`] wraps.
#[derive(Debug)]
enum Backend {
    Sim(SimDevice),
    Cuda(CudaDevice),
}

impl Device {
    fn over(backend: Backend) -> Self {
        let queue_depth = dispatch!(&backend, d => d.core().queue_depth);
        Device {
            backend,
            next_copy_id: 1,
            ready: VecDeque::with_capacity(queue_depth * 2),
            links: LinkStats::default(),
        }
    }

    /// The host simulation.
    pub fn sim(cfg: &DeviceConfig) -> Result<Self> {
        Ok(Device::over(Backend::Sim(SimDevice::new(cfg)?)))
    }

    /// A CUDA GPU, or [`TierError::NoGpu`] / [`TierError::NotCompiledWithCuda`].
    pub fn cuda(cfg: &DeviceConfig) -> Result<Self> {
        Ok(Device::over(Backend::Cuda(CudaDevice::new(cfg)?)))
    }

    /// A CUDA GPU where there is one, otherwise the simulation (logged). Errors other
    /// than a missing GPU or missing CUDA support (a bad config, a budget larger than
    /// the GPU) are returned, not papered over.
    pub fn auto(cfg: &DeviceConfig) -> Result<Self> {
        match CudaDevice::new(cfg) {
            Ok(d) => Ok(Device::over(Backend::Cuda(d))),
            Err(e @ (TierError::NoGpu { .. } | TierError::NotCompiledWithCuda)) => {
                tracing::info!(reason = %e, "device tier: no CUDA GPU; simulating the device in host memory");
                Device::sim(cfg)
            }
            Err(e) => Err(e),
        }
    }

    /// Which backend this is.
    pub fn kind(&self) -> DeviceKind {
        match self.backend {
            Backend::Sim(_) => DeviceKind::Sim,
            Backend::Cuda(_) => DeviceKind::Cuda,
        }
    }

    /// A process-unique id; memory remembers the device it came from by it.
    pub fn id(&self) -> u32 {
        dispatch!(&self.backend, d => d.core().device_id)
    }

    fn core(&self) -> &DeviceCore {
        dispatch!(&self.backend, d => d.core())
    }

    fn core_mut(&mut self) -> &mut DeviceCore {
        dispatch!(&mut self.backend, d => d.core_mut())
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
    /// budgets by the slab and the tide by the whole device (see `ChunkStore::open`).
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
        match &self.backend {
            Backend::Sim(d) => d.alloc(chunk, bytes, lease).map(DeviceMem::Sim),
            Backend::Cuda(d) => d.alloc(chunk, bytes, lease).map(DeviceMem::Cuda),
        }
    }

    /// Start a copy. Never blocks unless `copy_queue_depth` copies are in flight (then it
    /// first waits for the oldest). The result, with both buffers, comes back through
    /// [`Device::poll_copy`], [`Device::wait_copy`] or [`Device::wait_copy_id`].
    pub fn submit_copy(&mut self, req: CopyRequest) -> CopyId {
        let id = self.next_copy_id;
        self.next_copy_id += 1;
        if let Err(e) = self.check(id, &req) {
            self.ready.push_back(CopyCompletion::new(id, req, Err(e)));
            return id;
        }
        while self.in_flight() >= self.core().queue_depth {
            if !self.reap(true) {
                break;
            }
        }
        if let Some((e, req)) = self.start_copy(id, req) {
            self.ready.push_back(CopyCompletion::new(id, req, Err(e)));
        }
        id
    }

    /// Hands a checked copy to the backend, over its own memory; `Some` when it was
    /// refused, with the request back. (Without the `cuda` feature `CudaMem` is
    /// uninhabited: the CUDA arm is provably dead.)
    #[cfg_attr(not(feature = "cuda"), allow(unreachable_code))]
    fn start_copy(&mut self, id: CopyId, req: CopyRequest) -> Option<(TierError, CopyRequest)> {
        let (mem, req) = req.take_mem();
        match (&mut self.backend, mem) {
            (Backend::Sim(d), DeviceMem::Sim(mem)) => d
                .start_copy(id, req.with_mem(mem))
                .map(|(e, r)| (e, r.map_mem(DeviceMem::Sim))),
            (Backend::Cuda(d), DeviceMem::Cuda(mem)) => d
                .start_copy(id, req.with_mem(mem))
                .map(|(e, r)| (e, r.map_mem(DeviceMem::Cuda))),
            // `check` refuses memory of another backend first.
            (_, mem) => {
                let reason = "memory of another backend".into();
                let chunk = req.chunk;
                Some((TierError::BadCopy { id, chunk, reason }, req.with_mem(mem)))
            }
        }
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
        for (tier, limit_bytes) in [
            (TierKind::Host, req.host.capacity()),
            (TierKind::Device, req.mem.bytes()),
        ] {
            if req.len_bytes > limit_bytes {
                return Err(TierError::TooLarge {
                    tier,
                    chunk: req.chunk,
                    len_bytes: req.len_bytes as u64,
                    limit_bytes: limit_bytes as u64,
                });
            }
        }
        Ok(())
    }

    /// Copies submitted and not yet handed back (in flight or finished and queued).
    pub fn copies_outstanding(&self) -> usize {
        self.in_flight() + self.ready.len()
    }

    fn in_flight(&self) -> usize {
        dispatch!(&self.backend, d => d.in_flight())
    }

    /// Move one finished copy from the backend to the ready queue; false when none could
    /// be had (none in flight, or, with `block` false, none finished yet).
    fn reap(&mut self, block: bool) -> bool {
        let done = match &mut self.backend {
            Backend::Sim(d) => d.next_done(block).map(|raw| wrap(raw, DeviceMem::Sim)),
            Backend::Cuda(d) => d.next_done(block).map(|raw| wrap(raw, DeviceMem::Cuda)),
        };
        match done {
            Some(raw) => {
                self.finish(raw);
                true
            }
            None => false,
        }
    }

    /// Account for a finished copy and queue it for the caller.
    fn finish(&mut self, (id, req, result): RawDone<DeviceMem>) {
        if result.is_ok() {
            self.links.record(req.dir, req.len_bytes as u64);
        } else {
            self.links.failed_copies += 1;
        }
        self.ready.push_back(CopyCompletion::new(id, req, result));
    }

    /// A finished copy if there is one, without waiting.
    pub fn poll_copy(&mut self) -> Option<CopyCompletion> {
        if self.ready.is_empty() {
            while self.reap(false) {}
        }
        self.ready.pop_front()
    }

    /// The next finished copy (in submission order), waiting for it; `None` when nothing
    /// is outstanding.
    pub fn wait_copy(&mut self) -> Option<CopyCompletion> {
        if self.ready.is_empty() {
            self.reap(true);
        }
        self.ready.pop_front()
    }

    /// Wait for copy `id`; other copies that finish meanwhile stay queued. `None` when
    /// `id` is not outstanding (already handed back, never submitted, or lost with a
    /// stopped copy engine).
    pub fn wait_copy_id(&mut self, id: CopyId) -> Option<CopyCompletion> {
        loop {
            let ready = &mut self.ready;
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
        dispatch!(&mut self.backend, d => d.synchronize())
    }

    /// Total device memory, and what neither chunks nor non-model memory use: the
    /// driver's free memory (`cuMemGetInfo`, or the simulated driver's) plus the slab's
    /// free blocks, less the reported non-model bytes.
    pub fn mem_info(&self) -> Result<MemInfo> {
        let driver = dispatch!(&self.backend, d => d.driver_mem_info())?;
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
        let driver = dispatch!(&self.backend, d => d.driver_mem_info())?;
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
        Ok(match &self.backend {
            Backend::Sim(d) => d
                .pin_pool(pool)?
                .map_or_else(PinnedRegion::unpinned, |p| match p {}),
            Backend::Cuda(d) => d
                .pin_pool(pool)?
                .map_or_else(PinnedRegion::unpinned, PinnedRegion::from),
        })
    }

    /// Bytes and copies moved per direction of the host↔device link.
    pub fn link_stats(&self) -> LinkStats {
        self.links
    }
}

/// A backend's finished copy over device memory `M`, its memory wrapped.
fn wrap<M>((id, req, result): RawDone<M>, f: impl FnOnce(M) -> DeviceMem) -> RawDone<DeviceMem> {
    (id, req.map_mem(f), result)
}
