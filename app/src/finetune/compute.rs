//! Where the blocks compute: candle's CUDA device on the GPU the store's device tier is
//! on (a `gpu` build, `device.kind` `cuda` or `auto`, a GPU found), else the CPU.
//!
//! On the GPU, parameters go from their device chunks into candle's memory device to
//! device (`TideParams::set_compute_device`), and gradients, cast on the GPU, into their
//! places where the step reads them (`TideParams::put_grad_tensor`).

use candle_core::Device;
use tidestore_tiers::DeviceKind;

use crate::error::Result;

/// The compute device for a store whose device tier is `store_device`, on GPU
/// `ordinal` (the tier's).
pub(super) fn compute_device(store_device: DeviceKind, ordinal: usize) -> Result<Device> {
    match store_device {
        DeviceKind::Sim => Ok(Device::Cpu),
        DeviceKind::Cuda => cuda(ordinal),
    }
}

#[cfg(feature = "gpu")]
fn cuda(ordinal: usize) -> Result<Device> {
    // The store's device tier opened the GPU, so libcuda is there (cudarc panics
    // without it; the tier checked `is_culib_present` first).
    match Device::new_cuda(ordinal) {
        Ok(d) => {
            tracing::info!(
                ordinal,
                "finetune: blocks compute on the GPU (candle's CUDA backend)"
            );
            Ok(d)
        }
        Err(e) => Err(crate::error::Error::config(
            "device.kind",
            format!(
                "the store's device tier is on GPU {}, but candle's CUDA backend cannot \
                 open it: {e}",
                ordinal
            ),
        )),
    }
}

#[cfg(not(feature = "gpu"))]
fn cuda(_ordinal: usize) -> Result<Device> {
    tracing::warn!(
        "finetune: the store's device tier is a GPU, but this build has no candle CUDA \
         backend (build with --features gpu): blocks compute on the CPU"
    );
    Ok(Device::Cpu)
}

/// What computes the blocks' matrix products on `device`, for the report: on the CPU
/// OpenBLAS where it is installed, else candle's gemm (an error when `TIDESTORE_BLAS`
/// names a library that cannot be used).
pub(super) fn matmul(device: &Device) -> Result<String> {
    match device {
        Device::Cpu => Ok(tidestore_candle::blas::backend()?),
        _ => Ok("cuBLAS (candle's CUDA backend)".into()),
    }
}

/// The device in a word, for the report.
pub(super) fn name(device: &Device) -> &'static str {
    match device {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
        Device::Metal(_) => "metal",
    }
}
