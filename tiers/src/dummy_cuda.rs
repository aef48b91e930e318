//! Stand-in for the CUDA backend when the `cuda` feature is off.
//!
//! It keeps the type names of `cuda.rs` (`CudaDevice`, `CudaMem`, `CudaPinnedRegion`) so
//! nothing above needs a `cfg`: the constructor returns [`TierError::NotCompiledWithCuda`]
//! and every type is uninhabited, so the `Cuda` arms of the dispatch are provably dead.

#![deny(unsafe_code)]

use tidestore_io::BufferPool;

use crate::backend::{CopyOf, DeviceBackend, DeviceConfig, DeviceCore, MemInfo, MemTag, RawDone};
use crate::budget::Lease;
use crate::copy::CopyId;
use crate::error::{Result, TierError};
use crate::view::{DeviceView, DeviceViewMut};

/// A CUDA GPU; cannot exist in a build without the `cuda` feature.
#[derive(Debug)]
pub enum CudaDevice {}

/// Memory on a CUDA GPU; cannot exist in a build without the `cuda` feature.
#[derive(Debug)]
pub enum CudaMem {}

/// A host region pinned for a CUDA GPU; cannot exist without the `cuda` feature.
#[derive(Debug)]
pub enum CudaPinnedRegion {}

impl CudaDevice {
    /// Always [`TierError::NotCompiledWithCuda`].
    pub fn new(_cfg: &DeviceConfig) -> Result<Self> {
        Err(TierError::NotCompiledWithCuda)
    }
}

impl CudaMem {
    pub(crate) fn tag(&self) -> MemTag {
        match *self {}
    }

    pub(crate) fn view(&self) -> DeviceView<'_> {
        match *self {}
    }

    pub(crate) fn view_mut(&mut self) -> DeviceViewMut<'_> {
        match *self {}
    }
}

impl CudaPinnedRegion {
    pub(crate) fn bytes(&self) -> usize {
        match *self {}
    }
}

impl DeviceBackend for CudaDevice {
    type Mem = CudaMem;
    type Pinned = CudaPinnedRegion;

    fn core(&self) -> &DeviceCore {
        match *self {}
    }

    fn core_mut(&mut self) -> &mut DeviceCore {
        match *self {}
    }

    fn alloc(&self, _chunk: u64, _bytes: usize, _lease: Lease) -> Result<CudaMem> {
        match *self {}
    }

    fn start_copy(
        &mut self,
        _id: CopyId,
        _req: CopyOf<CudaMem>,
    ) -> Option<(TierError, CopyOf<CudaMem>)> {
        match *self {}
    }

    fn in_flight(&self) -> usize {
        match *self {}
    }

    fn next_done(&mut self, _block: bool) -> Option<RawDone<CudaMem>> {
        match *self {}
    }

    fn synchronize(&mut self) -> Result<()> {
        match *self {}
    }

    fn driver_mem_info(&self) -> Result<MemInfo> {
        match *self {}
    }

    fn pin_pool(&self, _pool: &BufferPool) -> Result<Option<CudaPinnedRegion>> {
        match *self {}
    }
}
