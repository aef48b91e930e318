//! tidestore-tiers: the three tiers a chunk can live on, and their byte budgets.
//!
//! - [`budget`]: a byte [`Budget`] per tier that is never exceeded, with peak tracking and
//!   a capacity that can move at run time (the device's tidal budget);
//! - [`device`]: GPU memory behind one type, [`Device`]: a CUDA backend (feature `cuda`)
//!   or a simulation in host memory with the same budgets and the same asynchronous
//!   copies, so every layer above runs the same code on every machine;
//! - [`slab`]: the device slab, all chunk memory of a device allocated once at start-up,
//!   and its block allocator (both backends);
//! - [`host`]: the pinned host pool, fixed at start-up;
//! - [`nvme`]: the NVMe tier over the io crate's swap file;
//! - [`stats`]: peaks per tier and bytes moved per link ([`TierStats`] gathers them).
//!
//! Imports point one way: leaves (`kind`, `copy`, `view`, `span`, `budget`, `error`,
//! `slab`, `stats`) below the backend seam (`backend`: the trait each backend
//! implements over its own memory type), the backends (`sim`, `cuda`) above it,
//! [`device`] above them, dispatching; `host`, `nvme` and the gathered stats on top.
//!
//! Nothing here prints; everything is logged with `tracing`. FFI lives only in the CUDA
//! backend; every other module denies `unsafe` (but for the two `unsafe fn` constructors
//! of GPU spans, which promise an address is device memory, and the simulation's slab
//! region in [`slab`], which hands out disjoint blocks of one host mapping).

mod backend;
pub mod budget;
mod copy;
pub mod device;
pub mod error;
pub mod host;
mod kind;
pub mod nvme;
mod sim;
pub mod slab;
mod span;
pub mod stats;
mod tier_stats;
mod view;

#[cfg(feature = "cuda")]
#[path = "cuda.rs"]
mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "dummy_cuda.rs"]
mod cuda;

pub use budget::{Budget, Lease, SharedBudget, TierKind};
pub use device::{
    CopyCompletion, CopyDir, CopyId, CopyRequest, CudaDevice, CudaMem, CudaSpan, CudaSpanMut,
    Device, DeviceConfig, DeviceKind, DeviceMem, DeviceView, DeviceViewMut, MemInfo, PinnedRegion,
    SimDevice, SimMem,
};
pub use error::{Result, TierError};
pub use host::HostTier;
pub use nvme::{NvmeActivity, NvmeTier, PUMP_INTERVAL};
pub use slab::{SlabAllocator, SlabStats};
pub use stats::{write_usage_lines, LinkStats, NvmeLinkStats, TierUsage};
pub use tier_stats::TierStats;

#[cfg(test)]
mod tests {
    /// The tiers move between threads (a store behind a mutex, a prefetch thread).
    #[test]
    fn tier_types_are_send() {
        fn send<T: Send>() {}
        send::<crate::Device>();
        send::<crate::DeviceMem>();
        send::<crate::CopyRequest>();
        send::<crate::CopyCompletion>();
        send::<crate::PinnedRegion>();
        send::<crate::HostTier>();
        send::<crate::NvmeTier>();
        send::<crate::TierError>();
    }
}
