//! A parameter's bytes on the store's GPU into a candle CUDA tensor, and a gradient from
//! one into its place on the store's GPU, device to device (the `gpu` feature: candle's
//! CUDA backend over the cudarc the store uses, both in the device's primary context).

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    result, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Storage, Tensor};
use tidestore_train::{CudaSpan, CudaSpanMut, DType};

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

/// Where a gradient from the GPU goes: its place on the store's GPU (device to device),
/// or host bytes (its place in the host pool, for a step there).
pub(crate) enum GradDst<'a> {
    Device(CudaSpanMut<'a>),
    Host(&'a mut [u8]),
}

impl GradDst<'_> {
    fn len_bytes(&self) -> usize {
        match self {
            GradDst::Device(span) => span.len_bytes(),
            GradDst::Host(bytes) => bytes.len(),
        }
    }
}

/// Writes the f32 gradient `grad` (`n` elements, any shape) into `dst` as `dtype` —
/// replacing what is there (`first`) or adding to it — cast on the GPU and copied from
/// it, waited for: the place may be released once this returns. Returns the squared L2
/// norm of what the place then holds, summed on the GPU from the f32 values before they
/// are rounded to `dtype`.
pub(crate) fn write_grad(
    mut dst: GradDst<'_>,
    dtype: DType,
    grad: &Tensor,
    first: bool,
) -> Result<f64> {
    let n = grad.elem_count();
    if dst.len_bytes() as u64 != n as u64 * dtype.size_bytes() {
        return Err(Error::BadParam {
            name: String::new(),
            reason: format!(
                "a gradient of {n} elements for a place of {} bytes of {dtype:?}",
                dst.len_bytes()
            ),
        });
    }
    let g = grad.to_dtype(candle_core::DType::F32)?.flatten_all()?;
    let sum = if first {
        g
    } else {
        let earlier = match &dst {
            GradDst::Device(span) => tensor_from_span(&span.as_span(), dtype, &[n], grad.device())?,
            GradDst::Host(bytes) => Tensor::from_vec(
                tidestore_train::typed::decode_f32_vec(bytes, dtype),
                n,
                grad.device(),
            )?,
        };
        (earlier.to_dtype(candle_core::DType::F32)? + g)?
    };
    let sq = sum.sqr()?.sum_all()?.to_scalar::<f32>()?;
    let stored = sum.to_dtype(candle_dtype(dtype)?)?.contiguous()?;
    copy_into(&stored, &mut dst)?;
    Ok(f64::from(sq))
}

/// candle's dtype for elements stored as `dtype` (the float types compute reads).
fn candle_dtype(dtype: DType) -> Result<candle_core::DType> {
    match dtype {
        DType::F32 => Ok(candle_core::DType::F32),
        DType::BF16 => Ok(candle_core::DType::BF16),
        DType::F16 => Ok(candle_core::DType::F16),
        other => Err(Error::BadParam {
            name: String::new(),
            reason: format!("a gradient cannot be stored as {other:?}"),
        }),
    }
}

/// The contiguous CUDA tensor `t`'s bytes into `dst` (as long as each other), on the
/// tensor's stream, waited for.
fn copy_into(t: &Tensor, dst: &mut GradDst<'_>) -> Result<()> {
    let Device::Cuda(cuda) = t.device() else {
        return Err(Error::BadParam {
            name: String::new(),
            reason: "a gradient for the GPU's device tier computed off the GPU".into(),
        });
    };
    let stream = cuda.cuda_stream();
    {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            return Err(Error::BadParam {
                name: String::new(),
                reason: "a CUDA tensor without CUDA storage".into(),
            });
        };
        let at = layout.start_offset();
        match t.dtype() {
            candle_core::DType::F32 => copy_slice(cs.as_cuda_slice::<f32>()?, at, dst, &stream)?,
            candle_core::DType::BF16 => {
                copy_slice(cs.as_cuda_slice::<half::bf16>()?, at, dst, &stream)?
            }
            candle_core::DType::F16 => {
                copy_slice(cs.as_cuda_slice::<half::f16>()?, at, dst, &stream)?
            }
            other => {
                return Err(Error::BadParam {
                    name: String::new(),
                    reason: format!("a gradient of dtype {other:?}"),
                })
            }
        }
    }
    stream.synchronize().w()?;
    Ok(())
}

/// `dst`'s length of `src`'s bytes from element `at` into `dst`, queued on `stream`.
fn copy_slice<T: DeviceRepr>(
    src: &CudaSlice<T>,
    at: usize,
    dst: &mut GradDst<'_>,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let width = std::mem::size_of::<T>();
    let bytes = dst.len_bytes();
    let have = src.len().saturating_sub(at) * width;
    if have < bytes {
        return Err(Error::BadParam {
            name: String::new(),
            reason: format!("a gradient of {have} bytes for a place of {bytes}"),
        });
    }
    let (src_ptr, _record) = src.device_ptr(stream);
    let from = src_ptr + (at * width) as u64;
    match dst {
        // SAFETY: `span` is `bytes` of writable memory of an accessed chunk on this GPU
        // (the store keeps it resident while the caller's view lives, and the caller
        // synchronizes the stream before the view can be released); the source is
        // `bytes` of `src` from element `at` (checked above), in the same (primary)
        // context, kept alive by the borrow of `src` until the stream is synchronized.
        GradDst::Device(span) => unsafe {
            result::memcpy_dtod_async(span.ptr(), from, bytes, stream.cu_stream())
        },
        // SAFETY: `host` is `bytes` of writable host memory borrowed until the stream is
        // synchronized (by the caller, before the borrow ends); the source as above.
        GradDst::Host(host) => unsafe {
            result::memcpy_dtoh_async(&mut host[..], from, stream.cu_stream())
        },
    }
    .w()?;
    Ok(())
}
