//! Stand-in for the GPU AdamW when the `cuda` feature is off: the same names, so code
//! above never needs a `cfg`. [`GpuAdamW`] is uninhabited and its constructor returns
//! [`OptimError::NotCompiledWithCuda`]; [`compile_ptx`] does too. Device views in CUDA
//! memory are therefore refused with that error by
//! [`crate::placement::HybridAdamW::step_device_slices`].

#![deny(unsafe_code)]

use crate::device_slices::{CudaPtrs, DeviceGroup};
use crate::error::{OptimError, Result};
use crate::params::{HyperParams, StepState};

pub use crate::cuda_source::ADAMW_CU;

/// Always false without the `cuda` feature.
pub fn nvrtc_available() -> bool {
    false
}

/// Always [`OptimError::NotCompiledWithCuda`].
pub fn compile_ptx(_arch: Option<&'static str>) -> Result<String> {
    Err(OptimError::NotCompiledWithCuda)
}

/// Always [`OptimError::NotCompiledWithCuda`].
pub fn compile_compact_ptx(_arch: Option<&'static str>) -> Result<String> {
    Err(OptimError::NotCompiledWithCuda)
}

/// Always [`OptimError::NotCompiledWithCuda`].
pub fn compile_cubin(_cc: (i32, i32)) -> Result<Vec<u8>> {
    Err(OptimError::NotCompiledWithCuda)
}

/// The NVRTC version, for reports: none without the `cuda` feature.
pub fn nvrtc_version_text() -> String {
    "none (built without the `cuda` feature)".into()
}

/// Always [`OptimError::NotCompiledWithCuda`].
pub fn compile_source(
    _source: &str,
    _file: &str,
    _arch: Option<&'static str>,
    _options: Vec<String>,
) -> Result<String> {
    Err(OptimError::NotCompiledWithCuda)
}

/// The GPU AdamW; cannot exist in a build without the `cuda` feature.
#[derive(Debug)]
pub enum GpuAdamW {}

impl GpuAdamW {
    /// Always [`OptimError::NotCompiledWithCuda`].
    pub fn new(_ordinal: usize) -> Result<Self> {
        Err(OptimError::NotCompiledWithCuda)
    }

    /// Never called: no value of this type exists.
    pub fn step(
        &self,
        _state: StepState,
        _hp: &HyperParams,
        _group: DeviceGroup<'_>,
    ) -> Result<()> {
        match *self {}
    }

    /// Never called: no value of this type exists.
    pub(crate) fn step_ptrs(
        &self,
        _state: StepState,
        _hp: &HyperParams,
        _ptrs: CudaPtrs<'_>,
    ) -> Result<()> {
        match *self {}
    }
}
