//! Stand-in for `crate::gpu::BenchKernels` in a build without the `cuda` feature:
//! uninhabited, so the bench's calls compile without a `cfg` and can never run (a
//! CUDA device cannot be opened without the feature: `device.kind = "cuda"` fails
//! at session open).

use tidestore_tiers::{DeviceView, DeviceViewMut};

use crate::error::{Error, Result};

pub(crate) enum BenchKernels {}

impl BenchKernels {
    pub(crate) fn new(_ordinal: usize) -> Result<Self> {
        Err(Error::Bench(
            "GPU kernels: this build has no `cuda` feature".into(),
        ))
    }

    pub(crate) fn checksum(&mut self, _view: &DeviceView<'_>) -> Result<()> {
        match *self {}
    }

    pub(crate) fn checksum_and_fill(
        &mut self,
        _view: &mut DeviceViewMut<'_>,
        _seed: u64,
        _first: u64,
        _scale: f32,
    ) -> Result<()> {
        match *self {}
    }

    pub(crate) fn take_checksum(&mut self) -> Result<u64> {
        match *self {}
    }
}
