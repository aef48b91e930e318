//! What the device backends share and implement, as a leaf they import: the
//! [`DeviceBackend`] trait each backend implements over its own memory type, the
//! configuration, the copy a backend runs ([`CopyOf`]), and the accounting core (budget,
//! slab, non-model memory). [`Device`](crate::Device) dispatches over the backends and
//! wraps their memory; nothing here names a backend.

#![deny(unsafe_code)]

use std::sync::atomic::{AtomicU32, Ordering};

use tidestore_io::{AlignedBuf, BufferPool};

use crate::budget::{Lease, SharedBudget};
use crate::copy::{CopyDir, CopyId};
use crate::error::{Result, TierError};
use crate::kind::TierKind;
use crate::slab::SharedSlab;

/// The simulated driver's allocation granularity unless configured (CUDA's usual one).
pub const SIM_ALLOC_GRANULARITY_BYTES_DEFAULT: u64 = 2 << 20;

/// Most copies one device keeps in flight.
pub const COPY_QUEUE_DEPTH_MAX: usize = 1024;

static NEXT_DEVICE_ID: AtomicU32 = AtomicU32::new(1);

pub(crate) fn next_device_id() -> u32 {
    NEXT_DEVICE_ID.fetch_add(1, Ordering::Relaxed)
}

/// Which backend a [`Device`](crate::Device) is.
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
    /// [`Device::set_budget_capacity`](crate::Device::set_budget_capacity)).
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

/// One asynchronous copy between a host buffer and device memory `M` (a backend's own,
/// or [`DeviceMem`](crate::DeviceMem) as [`CopyRequest`](crate::CopyRequest)). Both
/// move into the copy and come back in its completion.
#[derive(Debug)]
pub struct CopyOf<M> {
    pub dir: CopyDir,
    /// The chunk being moved; for error context and echoed in the completion.
    pub chunk: u64,
    pub host: AlignedBuf,
    pub mem: M,
    /// Bytes to move from the start of each end; `1 ..= min(host capacity, mem bytes)`.
    pub len_bytes: usize,
}

impl<M> CopyOf<M> {
    /// The device memory, and the rest of the copy to put memory of another type in.
    pub(crate) fn take_mem(self) -> (M, CopyOf<()>) {
        let CopyOf {
            dir,
            chunk,
            host,
            mem,
            len_bytes,
        } = self;
        let rest = CopyOf {
            dir,
            chunk,
            host,
            mem: (),
            len_bytes,
        };
        (mem, rest)
    }

    /// The same copy over memory `N` (a backend's memory wrapped, or unwrapped).
    pub(crate) fn map_mem<N>(self, f: impl FnOnce(M) -> N) -> CopyOf<N> {
        let (mem, rest) = self.take_mem();
        rest.with_mem(f(mem))
    }
}

impl CopyOf<()> {
    /// The copy over `mem`.
    pub(crate) fn with_mem<N>(self, mem: N) -> CopyOf<N> {
        CopyOf {
            dir: self.dir,
            chunk: self.chunk,
            host: self.host,
            mem,
            len_bytes: self.len_bytes,
        }
    }
}

/// A copy the backend has finished, before the device has accounted for it.
pub(crate) type RawDone<M> = (CopyId, CopyOf<M>, Result<()>);

/// `bytes` rounded down to the budget's unit (a page, 4096).
pub(crate) fn align_down_page(bytes: u64) -> u64 {
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

/// What every backend's chunk memory records of itself: the bytes asked for, the chunk
/// it was allocated for and its device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemTag {
    pub(crate) bytes: usize,
    pub(crate) chunk: u64,
    pub(crate) device_id: u32,
}

/// What both backends share: the budget, the slab and the reported non-model memory.
#[derive(Debug)]
pub(crate) struct DeviceCore {
    pub(crate) device_id: u32,
    pub(crate) budget: SharedBudget,
    pub(crate) total_bytes: u64,
    pub(crate) queue_depth: usize,
    pub(crate) slab: SharedSlab,
    /// Device memory the slab occupies (its size rounded up to the allocation granularity).
    pub(crate) slab_footprint_bytes: u64,
    pub(crate) slab_base_addr: u64,
    pub(crate) non_model_reported_bytes: u64,
}

impl DeviceCore {
    /// The tag of `bytes` of this device's memory allocated for `chunk`.
    pub(crate) fn tag(&self, chunk: u64, bytes: usize) -> MemTag {
        MemTag {
            bytes,
            chunk,
            device_id: self.device_id,
        }
    }

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
        })
    }

    /// The non-model bytes reported last.
    pub(crate) fn non_model_reported_bytes(&self) -> u64 {
        self.non_model_reported_bytes
    }
}

/// What each backend provides to [`Device`](crate::Device) (the uninhabited CUDA
/// stand-in too), over its own memory and pinned-region types, so the dispatch there
/// compiles against either. Crate-private: the public seam is `Device`.
pub(crate) trait DeviceBackend {
    /// The backend's device memory for one chunk.
    type Mem;
    /// The backend's page-locked host region.
    type Pinned;
    fn core(&self) -> &DeviceCore;
    fn core_mut(&mut self) -> &mut DeviceCore;
    fn alloc(&self, chunk: u64, bytes: usize, lease: Lease) -> Result<Self::Mem>;
    /// Start a copy; `Some` when it was refused, with the request back.
    fn start_copy(
        &mut self,
        id: CopyId,
        req: CopyOf<Self::Mem>,
    ) -> Option<(TierError, CopyOf<Self::Mem>)>;
    fn in_flight(&self) -> usize;
    fn next_done(&mut self, block: bool) -> Option<RawDone<Self::Mem>>;
    fn synchronize(&mut self) -> Result<()>;
    /// Total and free memory as the driver (or the simulated driver) sees it: the slab
    /// counts as used whole.
    fn driver_mem_info(&self) -> Result<MemInfo>;
    /// Page-lock `pool`'s region; `None`: nothing needs pinning.
    fn pin_pool(&self, pool: &BufferPool) -> Result<Option<Self::Pinned>>;
}
