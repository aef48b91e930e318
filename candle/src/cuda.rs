//! A parameter's bytes on the store's GPU into a candle CUDA tensor, device to device
//! (the `gpu` feature: candle's CUDA backend over the cudarc the store uses, both in
//! the device's primary context).

use candle_core::cuda_backend::cudarc::driver::{result, DevicePtr, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Storage, Tensor};
use tidestore_train::{CudaSpan, DType};

use crate::error::{Error, Result};

/// The `dtype` elements `span` holds as a tensor of `shape` on `device`, copied on the
/// GPU and waited for: the span may be evicted once this returns.
pub(crate) fn tensor_from_span(
    span: &CudaSpan<'_>,
    dtype: DType,
    shape: &[usize],
    device: &Device,
) -> Result<Tensor> {
    let Device::Cuda(cuda) = device else {
        return Err(Error::BadParam {
            name: String::new(),
            reason: "a parameter on the GPU handed to a candle device that is not CUDA".into(),
        });
    };
    let storage = match dtype {
        DType::F32 => copy::<f32>(span, cuda)?,
        DType::BF16 => copy::<half::bf16>(span, cuda)?,
        DType::F16 => copy::<half::f16>(span, cuda)?,
        other => {
            return Err(Error::BadParam {
                name: String::new(),
                reason: format!("a parameter stored as {other:?} cannot be computed with"),
            })
        }
    };
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        shape,
        BackpropOp::none(),
        false,
    ))
}

/// `span`'s bytes in fresh candle memory on `cuda`'s stream, the copy finished.
fn copy<T: CudaDType + DeviceRepr>(span: &CudaSpan<'_>, cuda: &CudaDevice) -> Result<CudaStorage> {
    let n = span.len_bytes() / std::mem::size_of::<T>();
    let stream = cuda.cuda_stream();
    // SAFETY: all of `dst` is written by the copy below, which is waited for before
    // the slice is wrapped and read.
    let dst = unsafe { cuda.alloc::<T>(n) }?;
    {
        let (dst_ptr, _record) = dst.device_ptr(&stream);
        // SAFETY: `span` is `len_bytes` of live memory of an accessed chunk on this GPU
        // (the store keeps it resident while the caller's view lives, and the caller
        // holds the view until this returns); `dst_ptr` is `n * size_of::<T>()` =
        // `len_bytes` fresh bytes in the same (primary) context. The stream is
        // synchronized below, before the view can be released.
        unsafe {
            result::memcpy_dtod_async(dst_ptr, span.ptr(), span.len_bytes(), stream.cu_stream())
        }
        .w()?;
    }
    stream.synchronize().w()?;
    Ok(CudaStorage::wrap_cuda_slice(dst, cuda.clone()))
}
