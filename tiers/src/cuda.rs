//! The CUDA backend of the device tier (feature `cuda`), through cudarc's driver API.
//!
//! - Before any CUDA call, `is_culib_present()` decides whether libcuda can be loaded at
//!   all (cudarc panics on a missing library); a missing library, driver or GPU is
//!   [`TierError::NoGpu`], and context creation runs under `catch_unwind` so a driver too
//!   old for a symbol cudarc wants is that error too, not a panic.
//! - Chunk memory is a block of the device's slab ([`crate::slab`]): one `cuMemAlloc` when
//!   the device opens, one `cuMemFree` when the last block and the device are gone;
//!   nothing on the move path allocates or frees (either would synchronize the device).
//!   Only when the slab is too fragmented for a chunk the budget admits is that chunk
//!   allocated on its own (counted as an overflow, rounded to [`ALLOC_GRANULARITY_BYTES`]).
//! - Copies go on two non-blocking copy streams, one per direction, so an eviction's copy
//!   overlaps a prefetch's on GPUs with two copy engines; each is followed by an event
//!   (blocking-sync, timing disabled) from a small free list. Completions are taken in
//!   submission order from the front of one FIFO by querying (poll) or synchronizing
//!   (wait) its event.
//! - A copy owns its host buffer and device memory from submit to completion; neither is
//!   freed or handed back before its event has completed, and dropping the device waits
//!   for both streams first (or, if they cannot be waited for, leaks them).
//! - Host pools are page-locked with `cuMemHostRegister` for the lifetime of a
//!   [`CudaPinnedRegion`], which keeps the pool's mapping alive until it unregisters —
//!   for ever, if it cannot unregister (the mapping is leaked, never unmapped while
//!   registered).
//! - No drop path returns budget the GPU still holds: memory that cannot be freed (the
//!   context cannot be bound, the free fails) is leaked together with its budget lease.
//! - Every driver error is boxed into [`TierError::Cuda`]; no cudarc type is public.
//!
//! Every `unsafe` block is an FFI call wrapped in a small function below whose
//! `# Safety` section lists what the caller must guarantee.

use std::collections::VecDeque;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};
use tidestore_io::BufferPool;

use crate::backend::{
    CopyOf, DeviceBackend, DeviceConfig, DeviceCore, MemInfo, MemTag, RawDone, SlabPlace,
};
use crate::budget::Lease;
use crate::copy::{CopyDir, CopyId};
use crate::error::{Result, TierError};
use crate::slab::{OverflowLease, Placement, SlabBlock};
use crate::span::{CudaSpan, CudaSpanMut};
use crate::view::{DeviceView, DeviceViewMut};

/// The granularity `cuMemAlloc` rounds large allocations to on current GPUs (2 MiB): the
/// slab's footprint and an overflow allocation's are counted in it.
pub const ALLOC_GRANULARITY_BYTES: u64 = 2 << 20;

// ---------------------------------------------------------------------------------------
// FFI, one call per function.

/// Whether libcuda can be loaded.
#[cfg(not(feature = "cuda-linked"))]
fn culib_present() -> bool {
    // SAFETY: this only tries to `dlopen` the CUDA driver library under its known names;
    // loading it runs the library's initialisers, which is what every CUDA program does,
    // and it touches no memory of ours.
    unsafe { sys::is_culib_present() }
}

/// Whether libcuda is loaded: with `cuda-linked` cudarc links it, so a process that runs
/// has it (the dynamic loader would not have started the binary without libcuda.so.1).
#[cfg(feature = "cuda-linked")]
fn culib_present() -> bool {
    true
}

/// Allocate `bytes` of device memory in the current context.
///
/// # Safety
/// - a context must be current on this thread (`bind_to_thread`);
/// - the memory returned is uninitialised: it may only be used as raw bytes, and must be
///   freed exactly once with [`free_device`].
unsafe fn alloc_device(bytes: usize) -> std::result::Result<sys::CUdeviceptr, DriverError> {
    // SAFETY: forwarded from this function's contract.
    unsafe { result::malloc_sync(bytes) }
}

/// Free device memory.
///
/// # Safety
/// - `ptr` was returned by [`alloc_device`] in the context current on this thread and has
///   not been freed;
/// - no copy or kernel that uses it is still running.
unsafe fn free_device(ptr: sys::CUdeviceptr) -> std::result::Result<(), DriverError> {
    // SAFETY: forwarded from this function's contract.
    unsafe { result::memory_free(ptr) }
}

/// Queue a copy of `src` into device memory at `dst` on `stream`; returns at once.
///
/// # Safety
/// - `dst` is a live device allocation of at least `src.len()` bytes;
/// - the memory behind `src` stays allocated and unwritten until the copy has finished on
///   `stream` (an event recorded after it has completed, or the stream synchronized);
/// - `stream` is a live stream of the context current on this thread.
unsafe fn enqueue_htod(
    dst: sys::CUdeviceptr,
    src: &[u8],
    stream: sys::CUstream,
) -> std::result::Result<(), DriverError> {
    // SAFETY: forwarded from this function's contract.
    unsafe { result::memcpy_htod_async(dst, src, stream) }
}

/// Queue a copy of device memory at `src` into `dst` on `stream`; returns at once.
///
/// # Safety
/// - `src` is a live device allocation of at least `dst.len()` bytes;
/// - the memory behind `dst` stays allocated, and nothing else reads or writes it, until
///   the copy has finished on `stream`;
/// - `stream` is a live stream of the context current on this thread.
unsafe fn enqueue_dtoh(
    dst: &mut [u8],
    src: sys::CUdeviceptr,
    stream: sys::CUstream,
) -> std::result::Result<(), DriverError> {
    // SAFETY: forwarded from this function's contract.
    unsafe { result::memcpy_dtoh_async(dst, src, stream) }
}

/// Page-lock `len` bytes at `ptr` and map them for every context (portable).
///
/// # Safety
/// - `ptr .. ptr + len` is one live mapping that stays mapped until [`unregister_host`]
///   is called on `ptr`;
/// - a context is current on this thread.
unsafe fn register_host(ptr: *mut u8, len: usize) -> std::result::Result<(), DriverError> {
    // SAFETY: forwarded from this function's contract; the driver only pins and maps the
    // pages, it does not read or write them.
    unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE).result() }
}

/// Undo [`register_host`].
///
/// # Safety
/// - `ptr` was registered with [`register_host`] and not unregistered since;
/// - no copy from or to the region is still running.
unsafe fn unregister_host(ptr: *mut u8) -> std::result::Result<(), DriverError> {
    // SAFETY: forwarded from this function's contract.
    unsafe { sys::cuMemHostUnregister(ptr.cast()).result() }
}

/// Create an event that blocks the waiting thread (no spinning) and records no timing.
///
/// # Safety
/// A context is current on this thread; the event must be destroyed exactly once with
/// [`destroy_event`], in that context.
unsafe fn create_event() -> std::result::Result<sys::CUevent, DriverError> {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
        | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: `ev` is a live out-pointer; the flags are valid `CUevent_flags` bits.
    unsafe { sys::cuEventCreate(&mut ev, flags) }.result()?;
    Ok(ev)
}

/// Record `ev` on `stream`: it completes once everything queued before it has.
///
/// # Safety
/// `ev` and `stream` are live and of the context current on this thread.
unsafe fn record_event(
    ev: sys::CUevent,
    stream: sys::CUstream,
) -> std::result::Result<(), DriverError> {
    // SAFETY: forwarded from this function's contract.
    unsafe { sys::cuEventRecord(ev, stream) }.result()
}

/// Whether `ev` has completed (`CUDA_ERROR_NOT_READY`: not yet).
///
/// # Safety
/// `ev` is a live event.
unsafe fn query_event(ev: sys::CUevent) -> std::result::Result<bool, DriverError> {
    // SAFETY: forwarded from this function's contract.
    match unsafe { sys::cuEventQuery(ev) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(DriverError(e)),
    }
}

/// Block until `ev` has completed.
///
/// # Safety
/// `ev` is a live event.
unsafe fn sync_event(ev: sys::CUevent) -> std::result::Result<(), DriverError> {
    // SAFETY: forwarded from this function's contract.
    unsafe { sys::cuEventSynchronize(ev) }.result()
}

/// Destroy `ev`.
///
/// # Safety
/// `ev` came from [`create_event`] and is destroyed only here, once.
unsafe fn destroy_event(ev: sys::CUevent) -> std::result::Result<(), DriverError> {
    // SAFETY: forwarded from this function's contract.
    unsafe { sys::cuEventDestroy_v2(ev) }.result()
}

// ---------------------------------------------------------------------------------------

/// A copy's completion event (blocking sync, no timing), destroyed when dropped.
struct CopyEvent {
    ev: sys::CUevent,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUDA event handle may be used from any thread once its context is bound
// there, which every use below does; the handle is owned by this value alone.
unsafe impl Send for CopyEvent {}

impl CopyEvent {
    fn new(ctx: &Arc<CudaContext>) -> std::result::Result<Self, DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: the context was bound just above; the event is destroyed once, in
        // `drop`, after binding the same context.
        let ev = unsafe { create_event() }?;
        Ok(CopyEvent {
            ev,
            ctx: Arc::clone(ctx),
        })
    }

    fn record(&self, stream: &CudaStream) -> std::result::Result<(), DriverError> {
        // SAFETY: `ev` is live and of `ctx`, which the caller bound; `stream` belongs to
        // the same context (the device's).
        unsafe { record_event(self.ev, stream.cu_stream()) }
    }

    fn is_complete(&self) -> std::result::Result<bool, DriverError> {
        // SAFETY: `ev` is live until `self` drops.
        unsafe { query_event(self.ev) }
    }

    fn synchronize(&self) -> std::result::Result<(), DriverError> {
        // SAFETY: `ev` is live until `self` drops.
        unsafe { sync_event(self.ev) }
    }
}

impl Drop for CopyEvent {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::error!(error = %e, "CUDA: cannot bind the context to destroy an event; leaked");
            return;
        }
        // SAFETY: `ev` came from `create_event` in this context and is destroyed only here.
        if let Err(e) = unsafe { destroy_event(self.ev) } {
            tracing::error!(error = %e, "CUDA: destroying an event failed");
        }
    }
}

/// The device memory of a slab: one allocation, freed when the device and every block of
/// it are gone (each holds this in an `Arc`).
#[derive(Debug)]
struct CudaSlabMemory {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl CudaSlabMemory {
    /// `bytes` of device memory (none for zero bytes: `cuMemAlloc(0)` is an error).
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        if bytes == 0 {
            return Ok(CudaSlabMemory {
                ptr: 0,
                bytes,
                ctx: Arc::clone(ctx),
            });
        }
        ctx.bind_to_thread()
            .map_err(|e| TierError::cuda("binding the context", None, bytes as u64, e))?;
        // SAFETY: the context was bound just above; the memory is used only as raw bytes
        // (blocks of it handed to copies and compute views) and freed once, in `drop`.
        let ptr = unsafe { alloc_device(bytes) }.map_err(|e| {
            if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                TierError::DeviceOutOfMemory {
                    chunk: u64::MAX,
                    needed_bytes: bytes as u64,
                    free_bytes: ctx.mem_get_info().map_or(0, |(free, _)| free as u64),
                }
            } else {
                TierError::cuda("cuMemAlloc (the chunk slab)", None, bytes as u64, e)
            }
        })?;
        Ok(CudaSlabMemory {
            ptr,
            bytes,
            ctx: Arc::clone(ctx),
        })
    }
}

impl Drop for CudaSlabMemory {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::error!(error = %e, bytes = self.bytes,
                "CUDA: cannot bind the context to free the chunk slab; leaked");
            return;
        }
        // SAFETY: `ptr` came from `alloc_device` in this context (bound just above) and
        // is freed only here, once: every block of the slab holds this in an `Arc`, so
        // none is alive, and no copy or kernel uses a block that is not alive.
        if let Err(e) = unsafe { free_device(self.ptr) } {
            tracing::error!(error = %e, bytes = self.bytes, "CUDA: freeing the chunk slab failed");
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

fn no_gpu(what: &str, e: DriverError) -> TierError {
    TierError::NoGpu {
        reason: format!("{what}: {e}"),
    }
}

/// Open device `ordinal`: its context, a copy stream per direction, and its total memory.
type Opened = (Arc<CudaContext>, [Arc<CudaStream>; 2], u64);

fn open_context(ordinal: usize) -> Result<Opened> {
    let count = CudaContext::device_count().map_err(|e| no_gpu("CUDA driver", e))?;
    if count <= 0 {
        return Err(TierError::NoGpu {
            reason: "the CUDA driver sees no GPU".into(),
        });
    }
    if ordinal >= count as usize {
        return Err(TierError::NoGpu {
            reason: format!("GPU {ordinal} asked for, the driver sees {count}"),
        });
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| no_gpu("creating the context", e))?;
    let stream = || {
        ctx.new_stream()
            .map_err(|e| TierError::cuda("creating a copy stream", None, 0, e))
    };
    let streams = [stream()?, stream()?];
    let (_free, total) = ctx
        .mem_get_info()
        .map_err(|e| TierError::cuda("cuMemGetInfo", None, 0, e))?;
    Ok((ctx, streams, total as u64))
}

/// Memory on a CUDA GPU holding one chunk: a block of the device's slab (or, when the
/// slab was too fragmented, an allocation of its own).
#[derive(Debug)]
pub struct CudaMem {
    ptr: sys::CUdeviceptr,
    tag: MemTag,
    /// `None` only while dropping.
    store: Option<CudaStore>,
    /// `None` only while dropping.
    lease: Option<Lease>,
}

#[derive(Debug)]
enum CudaStore {
    Slab {
        _slab: Arc<CudaSlabMemory>,
        _block: SlabBlock,
    },
    Overflow {
        ctx: Arc<CudaContext>,
        accounting: OverflowLease,
    },
}

impl CudaMem {
    pub(crate) fn tag(&self) -> MemTag {
        self.tag
    }

    pub(crate) fn view(&self) -> DeviceView<'_> {
        // SAFETY: `ptr..ptr + bytes` is this allocation, live until `self` drops, which the
        // span's borrow of `self` outlasts; writes need `&mut self` (`view_mut`).
        DeviceView::Cuda(unsafe { CudaSpan::from_raw(self.ptr, self.tag.bytes) })
    }

    pub(crate) fn view_mut(&mut self) -> DeviceViewMut<'_> {
        // SAFETY: as `view`, borrowed exclusively: nobody else reaches this allocation
        // through the tier while the span lives.
        DeviceViewMut::Cuda(unsafe { CudaSpanMut::from_raw(self.ptr, self.tag.bytes) })
    }
}

impl Drop for CudaMem {
    fn drop(&mut self) {
        // A slab block goes back to the slab (no CUDA call) with its lease.
        let Some(CudaStore::Overflow { ctx, accounting }) = self.store.take() else {
            return;
        };
        let freed = ctx.bind_to_thread().and_then(|()| {
            // SAFETY: `ptr` came from `alloc_device` in this context (bound just before)
            // and is freed only here, once. No copy uses it: a copy owns this `CudaMem`
            // until its event has completed. Kernels reading it through a view must have
            // finished, as `DeviceMem::view` requires.
            unsafe { free_device(self.ptr) }
        });
        if let Err(e) = freed {
            // The GPU still holds the memory: so does the budget, and the footprint.
            tracing::error!(error = %e, chunk = self.tag.chunk, bytes = self.tag.bytes,
                "CUDA: device memory cannot be freed; leaked with its budget");
            std::mem::forget(accounting);
            std::mem::forget(self.lease.take());
        }
    }
}

/// A host region page-locked for a CUDA GPU; unregistered when dropped.
#[derive(Debug)]
pub struct CudaPinnedRegion {
    /// Address of the region (kept as an integer so the type stays `Send`).
    addr: usize,
    bytes: usize,
    ctx: Arc<CudaContext>,
    /// Keeps the mapping alive until it is unregistered; `None` only while dropping.
    pool: Option<BufferPool>,
}

impl CudaPinnedRegion {
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for CudaPinnedRegion {
    fn drop(&mut self) {
        let unpinned = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: `addr` was registered by `pin_pool` and is unregistered only here.
            // The mapping is still alive (`pool` is released after this). Copies from or
            // to it are finished: each owns a buffer of the pool, and buffers come back
            // only after their copy's event; the device drains its streams when dropped.
            unsafe { unregister_host(self.addr as *mut u8) }
        });
        if let Err(e) = unpinned {
            // Still registered: the mapping must never be unmapped (the driver would
            // keep pinned pages of a range the process may reuse). Leak it.
            tracing::error!(error = %e, bytes = self.bytes,
                "CUDA: cannot unpin host memory; the pool's mapping is leaked");
            std::mem::forget(self.pool.take());
        }
    }
}

struct InFlight {
    id: CopyId,
    req: CopyOf<CudaMem>,
    /// Recorded after the copy; `None` when recording failed, then the copy's stream is
    /// synchronized instead.
    event: Option<CopyEvent>,
    /// An error to report with the copy once its buffers are idle.
    error: Option<TierError>,
}

/// A CUDA GPU.
pub struct CudaDevice {
    core: DeviceCore,
    ctx: Arc<CudaContext>,
    /// Host-to-device copies.
    h2d: Arc<CudaStream>,
    /// Device-to-host copies.
    d2h: Arc<CudaStream>,
    slab: Arc<CudaSlabMemory>,
    in_flight: VecDeque<InFlight>,
    spare_events: Vec<CopyEvent>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .field("device_id", &self.core.device_id)
            .field("total_bytes", &self.core.total_bytes)
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}

impl CudaDevice {
    /// Open GPU `cfg.ordinal`, or [`TierError::NoGpu`] when there is no driver or GPU.
    pub fn new(cfg: &DeviceConfig) -> Result<Self> {
        cfg.validate()?;
        if !culib_present() {
            return Err(TierError::NoGpu {
                reason: "the CUDA driver library (libcuda) cannot be loaded".into(),
            });
        }
        let ordinal = cfg.ordinal;
        let (ctx, [h2d, d2h], total_bytes) = std::panic::catch_unwind(|| open_context(ordinal))
            .map_err(|p| TierError::NoGpu {
            reason: format!("the CUDA driver failed: {}", panic_message(p.as_ref())),
        })??;
        let slab_bytes = cfg.slab_bytes.unwrap_or(cfg.budget_bytes);
        if slab_bytes > total_bytes {
            return Err(TierError::BudgetExceedsDevice {
                budget_bytes: slab_bytes,
                total_bytes,
            });
        }
        let slab = Arc::new(CudaSlabMemory::new(&ctx, slab_bytes as usize)?);
        let place = SlabPlace {
            bytes: slab_bytes,
            footprint_bytes: slab_bytes.div_ceil(ALLOC_GRANULARITY_BYTES) * ALLOC_GRANULARITY_BYTES,
            base_addr: slab.ptr,
            granularity_bytes: ALLOC_GRANULARITY_BYTES,
        };
        let core = DeviceCore::new(cfg, total_bytes, place)?;
        tracing::info!(
            ordinal,
            name = %ctx.name().unwrap_or_else(|e| format!("(name unknown: {e})")),
            total_bytes,
            slab_bytes,
            budget_bytes = cfg.budget_bytes,
            "CUDA device opened"
        );
        Ok(CudaDevice {
            core,
            ctx,
            h2d,
            d2h,
            slab,
            in_flight: VecDeque::with_capacity(cfg.copy_queue_depth),
            spare_events: Vec::with_capacity(cfg.copy_queue_depth),
        })
    }

    fn stream(&self, dir: CopyDir) -> &Arc<CudaStream> {
        match dir {
            CopyDir::HostToDevice => &self.h2d,
            CopyDir::DeviceToHost => &self.d2h,
        }
    }

    fn take_event(&mut self) -> std::result::Result<CopyEvent, DriverError> {
        match self.spare_events.pop() {
            Some(e) => Ok(e),
            None => CopyEvent::new(&self.ctx),
        }
    }

    /// Queue the copy of `req` on the copy stream.
    fn enqueue(&self, id: CopyId, req: &mut CopyOf<CudaMem>) -> std::result::Result<(), TierError> {
        let len = req.len_bytes;
        let (chunk, bytes) = (req.chunk, len as u64);
        let mem = &req.mem;
        if len > mem.tag.bytes {
            return Err(TierError::BadCopy {
                id,
                chunk,
                reason: format!("{len} bytes into {} bytes of device memory", mem.tag.bytes),
            });
        }
        let dptr = mem.ptr;
        let stream = self.stream(req.dir).cu_stream();
        let Some(host) = req.host.get_mut(..len) else {
            return Err(TierError::BadCopy {
                id,
                chunk,
                reason: format!("{len} bytes do not fit the host buffer"),
            });
        };
        let queued = match req.dir {
            // SAFETY: `dptr` is live device memory of at least `len` bytes (checked
            // above), owned by `req`; `host` is `len` bytes of the request's buffer. The
            // request moves into `in_flight` and is handed back only after the event
            // recorded behind this copy has completed (or the stream was synchronized),
            // so neither end is freed, moved from its allocation or touched meanwhile.
            // The context was bound by the caller and `stream` belongs to it.
            CopyDir::HostToDevice => unsafe { enqueue_htod(dptr, host, stream) },
            // SAFETY: as above, with the host buffer the destination.
            CopyDir::DeviceToHost => unsafe { enqueue_dtoh(host, dptr, stream) },
        };
        queued.map_err(|e| TierError::cuda("queueing a copy", Some(chunk), bytes, e))
    }

    /// Wait for everything on both copy streams; on failure the copies in flight cannot
    /// be known idle, so their buffers are leaked rather than handed back.
    fn drain_or_leak(&mut self) -> Result<()> {
        let waited = self
            .ctx
            .bind_to_thread()
            .and_then(|()| self.h2d.synchronize())
            .and_then(|()| self.d2h.synchronize());
        if let Err(e) = waited {
            tracing::error!(error = %e, lost = self.in_flight.len(),
                "CUDA copy stream failed; the buffers of its copies are leaked");
            for f in self.in_flight.drain(..) {
                std::mem::forget(f.req);
            }
            return Err(TierError::CopyEngineStopped {
                reason: format!("CUDA copy stream: {e}"),
            });
        }
        Ok(())
    }
}

impl DeviceBackend for CudaDevice {
    type Mem = CudaMem;
    type Pinned = CudaPinnedRegion;

    fn core(&self) -> &DeviceCore {
        &self.core
    }

    fn core_mut(&mut self) -> &mut DeviceCore {
        &mut self.core
    }

    fn alloc(&self, chunk: u64, bytes: usize, lease: Lease) -> Result<CudaMem> {
        let accounting = match self.core.slab.take(chunk, bytes as u64) {
            Placement::Slab(block) => {
                assert_eq!(block.bytes(), lease.bytes(), "a block is its lease's bytes");
                return Ok(CudaMem {
                    ptr: self.slab.ptr + block.offset_bytes(),
                    tag: self.core.tag(chunk, bytes),
                    store: Some(CudaStore::Slab {
                        _slab: Arc::clone(&self.slab),
                        _block: block,
                    }),
                    lease: Some(lease),
                });
            }
            Placement::Overflow(accounting) => accounting,
        };
        // The slab is too fragmented for this chunk: an allocation of its own.
        self.ctx
            .bind_to_thread()
            .map_err(|e| TierError::cuda("binding the context", Some(chunk), bytes as u64, e))?;
        // SAFETY: the context was bound just above; the memory is only ever used as raw
        // bytes (copies and compute views) and is freed once, by `CudaMem::drop`.
        let ptr = unsafe { alloc_device(bytes) }.map_err(|e| {
            if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                TierError::DeviceOutOfMemory {
                    chunk,
                    needed_bytes: bytes as u64,
                    free_bytes: self.ctx.mem_get_info().map_or(0, |(free, _)| free as u64),
                }
            } else {
                TierError::cuda("cuMemAlloc", Some(chunk), bytes as u64, e)
            }
        })?;
        Ok(CudaMem {
            ptr,
            tag: self.core.tag(chunk, bytes),
            store: Some(CudaStore::Overflow {
                ctx: Arc::clone(&self.ctx),
                accounting,
            }),
            lease: Some(lease),
        })
    }

    fn start_copy(
        &mut self,
        id: CopyId,
        mut req: CopyOf<CudaMem>,
    ) -> Option<(TierError, CopyOf<CudaMem>)> {
        let (chunk, bytes) = (req.chunk, req.len_bytes as u64);
        if let Err(e) = self.ctx.bind_to_thread() {
            return Some((
                TierError::cuda("binding the context", Some(chunk), bytes, e),
                req,
            ));
        }
        let event = match self.take_event() {
            Ok(e) => e,
            Err(e) => {
                return Some((
                    TierError::cuda("creating an event", Some(chunk), bytes, e),
                    req,
                ))
            }
        };
        if let Err(e) = self.enqueue(id, &mut req) {
            self.spare_events.push(event);
            return Some((e, req));
        }
        // From here the copy is queued: the request goes into `in_flight` whatever
        // happens, and comes back only once the stream is known past it.
        let (event, error) = match event.record(self.stream(req.dir)) {
            Ok(()) => (Some(event), None),
            Err(e) => (
                None,
                Some(TierError::cuda("recording an event", Some(chunk), bytes, e)),
            ),
        };
        self.in_flight.push_back(InFlight {
            id,
            req,
            event,
            error,
        });
        None
    }

    fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    fn next_done(&mut self, block: bool) -> Option<RawDone<CudaMem>> {
        let front = self.in_flight.front()?;
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::error!(error = %e, "CUDA: cannot bind the context to wait for a copy");
            return None;
        }
        let finished = match &front.event {
            Some(ev) if block => ev.synchronize().map(|()| true),
            Some(ev) => ev.is_complete(),
            // No event to ask: wait for the copy's stream (a rare error path).
            None => self.stream(front.req.dir).synchronize().map(|()| true),
        };
        match finished {
            Ok(false) => None,
            Ok(true) => {
                let f = self.in_flight.pop_front()?;
                if let Some(ev) = f.event {
                    self.spare_events.push(ev);
                }
                let result = match f.error {
                    Some(e) => Err(e),
                    None => Ok(()),
                };
                Some((f.id, f.req, result))
            }
            Err(e) => {
                // The copy (or earlier work) failed. Its buffers may be handed back only
                // once the stream is idle.
                let (chunk, bytes) = (front.req.chunk, front.req.len_bytes as u64);
                let err = TierError::cuda("copy", Some(chunk), bytes, e);
                if self.drain_or_leak().is_err() {
                    return None;
                }
                let f = self.in_flight.pop_front()?;
                Some((f.id, f.req, Err(err)))
            }
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .and_then(|()| self.ctx.synchronize())
            .map_err(|e| TierError::cuda("synchronizing the device", None, 0, e))
    }

    fn driver_mem_info(&self) -> Result<MemInfo> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|e| TierError::cuda("cuMemGetInfo", None, 0, e))?;
        Ok(MemInfo {
            total_bytes: total as u64,
            free_bytes: free as u64,
        })
    }

    fn pin_pool(&self, pool: &BufferPool) -> Result<Option<CudaPinnedRegion>> {
        let (ptr, bytes) = pool.region();
        self.ctx
            .bind_to_thread()
            .map_err(|e| TierError::cuda("binding the context", None, bytes as u64, e))?;
        // SAFETY: `ptr .. ptr + bytes` is the pool's one anonymous mapping, alive while any
        // handle to the pool is; the region returned holds such a handle and unregisters
        // before releasing it. The context was bound just above.
        unsafe { register_host(ptr, bytes) }
            .map_err(|e| TierError::cuda("cuMemHostRegister", None, bytes as u64, e))?;
        Ok(Some(CudaPinnedRegion {
            addr: ptr as usize,
            bytes,
            ctx: Arc::clone(&self.ctx),
            pool: Some(pool.clone()),
        }))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if !self.in_flight.is_empty() && self.drain_or_leak().is_ok() {
            self.in_flight.clear();
        }
    }
}
