//! Typed views of a tensor place's bytes for the kernels: f32, 16-bit and block-quantized
//! slices cast from the store's bytes (a misaligned one is an error naming the tensor),
//! gradients and 16-bit outputs in their dtype, and device views reborrowed from a
//! scope.

use half::{bf16, f16};
use tidestore_chunk::{DType, TensorViewMut};
use tidestore_optimizer::{Grads, MomentForm, Moments, ParamOut, Q8Mut};
use tidestore_tiers::{DeviceView, DeviceViewMut};

use crate::error::{Result, TrainError};

pub(super) fn cast_err(tensor: &str, what: &str) -> TrainError {
    TrainError::Tensor {
        tensor: tensor.into(),
        reason: format!("its {what} bytes are not aligned for their element type"),
    }
}

pub(super) fn f32s<'a>(bytes: &'a mut [u8], tensor: &str, what: &str) -> Result<&'a mut [f32]> {
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| cast_err(tensor, what))
}

pub(crate) fn grads_of<'a>(bytes: &'a [u8], dtype: DType, tensor: &str) -> Result<Grads<'a>> {
    let err = |_| cast_err(tensor, "gradient");
    Ok(match dtype {
        DType::F32 => Grads::F32(bytemuck::try_cast_slice(bytes).map_err(err)?),
        DType::F16 => Grads::F16(bytemuck::try_cast_slice::<u8, f16>(bytes).map_err(err)?),
        DType::BF16 => Grads::Bf16(bytemuck::try_cast_slice::<u8, bf16>(bytes).map_err(err)?),
        DType::Q8 => return Err(cast_err(tensor, "gradient (8-bit codes)")),
    })
}

pub(super) fn param_out<'a>(
    bytes: &'a mut [u8],
    dtype: DType,
    tensor: &str,
) -> Result<ParamOut<'a>> {
    let err = |_| cast_err(tensor, "16-bit parameter");
    Ok(match dtype {
        DType::F16 => ParamOut::F16(bytemuck::try_cast_slice_mut(bytes).map_err(err)?),
        DType::BF16 => ParamOut::Bf16(bytemuck::try_cast_slice_mut(bytes).map_err(err)?),
        DType::F32 | DType::Q8 => {
            return Err(TrainError::Tensor {
                tensor: tensor.into(),
                reason: format!("the 16-bit parameters are stored as {dtype}"),
            })
        }
    })
}

/// The stored form of a tensor's moments as the optimizer names it.
pub(super) fn state_type_of(d: DType, tensor: &str) -> Result<MomentForm> {
    match d {
        DType::F32 => Ok(MomentForm::F32),
        DType::BF16 => Ok(MomentForm::BF16),
        DType::Q8 => Ok(MomentForm::Int8),
        DType::F16 => Err(cast_err(tensor, "moment (f16 is no moment form)")),
    }
}

/// Elements `piece` of a tensor's M and V place bytes as the kernel's view: fp32 or
/// bf16 elements, or (Q8) the codes and absmax of the piece's blocks (a Q8 place is the
/// `len` codes, padding to 4 bytes, then the absmax; pieces start at whole blocks).
pub(super) fn moments_of<'a>(
    (m, v): (&'a mut [u8], &'a mut [u8]),
    (dtype, len): (DType, usize),
    name: &str,
    piece: std::ops::Range<usize>,
) -> Result<Moments<'a>> {
    Ok(match dtype {
        DType::F32 => Moments::F32 {
            m: &mut f32s(m, name, "m")?[piece.clone()],
            v: &mut f32s(v, name, "v")?[piece],
        },
        DType::BF16 => Moments::Bf16 {
            m: &mut bf16s(m, name, "m")?[piece.clone()],
            v: &mut bf16s(v, name, "v")?[piece],
        },
        DType::Q8 => Moments::Int8 {
            m: q8_of(m, len, piece.clone(), name, "m")?,
            v: q8_of(v, len, piece, name, "v")?,
        },
        DType::F16 => return Err(cast_err(name, "moment (f16 is no moment form)")),
    })
}

pub(super) fn bf16s<'a>(bytes: &'a mut [u8], tensor: &str, what: &str) -> Result<&'a mut [bf16]> {
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| cast_err(tensor, what))
}

pub(super) fn q8_of<'a>(
    bytes: &'a mut [u8],
    len: usize,
    piece: std::ops::Range<usize>,
    tensor: &str,
    what: &str,
) -> Result<Q8Mut<'a>> {
    use tidestore_optimizer::quant::{absmax_len, Q8_BLOCK};
    debug_assert!(piece.start.is_multiple_of(Q8_BLOCK));
    let (codes, rest) = bytes.split_at_mut(len.next_multiple_of(4));
    let absmax = f32s(&mut rest[..4 * absmax_len(len)], tensor, what)?;
    Ok(Q8Mut {
        absmax: &mut absmax[piece.start / Q8_BLOCK..piece.end.div_ceil(Q8_BLOCK)],
        codes: &mut codes[piece],
    })
}

/// The host bytes of views of host-pool accesses.
pub(super) fn host_slices<'a>(
    views: &'a mut [TensorViewMut<'_>],
    tensor: &str,
) -> Result<Vec<&'a mut [u8]>> {
    views
        .iter_mut()
        .map(|v| match v {
            TensorViewMut::Host(b) => Ok(&mut **b),
            TensorViewMut::Device(_) => Err(TrainError::Tensor {
                tensor: tensor.into(),
                reason: "a host access gave a device view".into(),
            }),
        })
        .collect()
}

/// A device view of a device access, reborrowed from the scope's views.
pub(super) fn device_view<'a>(
    v: &'a mut TensorViewMut<'_>,
    tensor: &str,
) -> Result<DeviceViewMut<'a>> {
    match v {
        TensorViewMut::Device(DeviceViewMut::Host(b)) => Ok(DeviceViewMut::Host(b)),
        TensorViewMut::Device(DeviceViewMut::Cuda(span)) => {
            Ok(DeviceViewMut::Cuda(span.reborrow()))
        }
        TensorViewMut::Host(_) => Err(TrainError::Tensor {
            tensor: tensor.into(),
            reason: "a device access gave a view of the host pool".into(),
        }),
    }
}

pub(super) fn read_only(v: DeviceViewMut<'_>) -> DeviceView<'_> {
    match v {
        DeviceViewMut::Host(b) => DeviceView::Host(b),
        DeviceViewMut::Cuda(s) => DeviceView::Cuda(s.into_span()),
    }
}
