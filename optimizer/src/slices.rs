//! Typed views of the per-parameter arrays a step reads and writes.
//!
//! [`Grads`] is a gradient slice in one of three dtypes; [`ParamOut`] is the optional
//! 16-bit copy of the parameters the step writes in the same pass. Both split at an
//! element index, which is how the parallel driver hands disjoint contiguous spans to
//! threads. Raw `&[u16]` chunk memory converts to these with
//! `half::slice::HalfBitsSliceExt::reinterpret_cast` (no copy).

use half::{bf16, f16};

pub use tidestore_dtype::DType;

/// Gradients of one span of parameters, in the dtype they were produced in.
#[derive(Debug, Clone, Copy)]
pub enum Grads<'a> {
    /// fp32 gradients (or an fp32 accumulation buffer).
    F32(&'a [f32]),
    /// fp16 gradients, usually multiplied by a loss scale.
    F16(&'a [f16]),
    /// bf16 gradients.
    Bf16(&'a [bf16]),
}

impl<'a> Grads<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Grads::F32(g) => g.len(),
            Grads::F16(g) => g.len(),
            Grads::Bf16(g) => g.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element dtype.
    pub fn dtype(&self) -> DType {
        match self {
            Grads::F32(_) => DType::F32,
            Grads::F16(_) => DType::F16,
            Grads::Bf16(_) => DType::BF16,
        }
    }

    /// Splits into `[..mid]` and `[mid..]`; panics if `mid > len` like `slice::split_at`.
    pub fn split_at(self, mid: usize) -> (Grads<'a>, Grads<'a>) {
        match self {
            Grads::F32(g) => {
                let (a, b) = g.split_at(mid);
                (Grads::F32(a), Grads::F32(b))
            }
            Grads::F16(g) => {
                let (a, b) = g.split_at(mid);
                (Grads::F16(a), Grads::F16(b))
            }
            Grads::Bf16(g) => {
                let (a, b) = g.split_at(mid);
                (Grads::Bf16(a), Grads::Bf16(b))
            }
        }
    }

    /// Element `i` widened to f32 (exact), for tests and scalar reference code.
    pub fn get_f32(&self, i: usize) -> Option<f32> {
        match self {
            Grads::F32(g) => g.get(i).copied(),
            Grads::F16(g) => g.get(i).map(|x| x.to_f32()),
            Grads::Bf16(g) => g.get(i).map(|x| x.to_f32()),
        }
    }
}

/// Destination of the updated parameters cast to 16 bits (round to nearest even,
/// bit-identical to `half::f16::from_f32` / `half::bf16::from_f32`).
#[derive(Debug)]
pub enum ParamOut<'a> {
    /// Write fp16 parameters.
    F16(&'a mut [f16]),
    /// Write bf16 parameters.
    Bf16(&'a mut [bf16]),
}

impl<'a> ParamOut<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            ParamOut::F16(o) => o.len(),
            ParamOut::Bf16(o) => o.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element dtype.
    pub fn dtype(&self) -> DType {
        match self {
            ParamOut::F16(_) => DType::F16,
            ParamOut::Bf16(_) => DType::BF16,
        }
    }

    /// Reborrows for a shorter lifetime (so one `ParamOut` can serve several calls).
    pub fn reborrow(&mut self) -> ParamOut<'_> {
        match self {
            ParamOut::F16(o) => ParamOut::F16(o),
            ParamOut::Bf16(o) => ParamOut::Bf16(o),
        }
    }

    /// Splits into `[..mid]` and `[mid..]`; panics if `mid > len` like `split_at_mut`.
    pub fn split_at(self, mid: usize) -> (ParamOut<'a>, ParamOut<'a>) {
        match self {
            ParamOut::F16(o) => {
                let (a, b) = o.split_at_mut(mid);
                (ParamOut::F16(a), ParamOut::F16(b))
            }
            ParamOut::Bf16(o) => {
                let (a, b) = o.split_at_mut(mid);
                (ParamOut::Bf16(a), ParamOut::Bf16(b))
            }
        }
    }
}
