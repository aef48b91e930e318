//! Views of Adam's moments in the three stored forms ([`crate::MomentForm`]).
//!
//! [`Moments`] is what [`crate::AdamW::step_moments`] updates in place: fp32 arrays, bf16
//! arrays, or 8-bit codes with their per-block absmax ([`Q8Mut`], see [`crate::quant`]).
//! Invariant checked by the step: every array has the master's element count, and an
//! int8 moment has `absmax_len(n)` absmax values.

use half::bf16;

use crate::quant::MomentForm;

/// One block-wise quantized moment array: `codes[i]` with `absmax[i / 256]`.
#[derive(Debug)]
pub struct Q8Mut<'a> {
    /// One code per element.
    pub codes: &'a mut [u8],
    /// One fp32 maximum per block of [`crate::quant::Q8_BLOCK`] elements.
    pub absmax: &'a mut [f32],
}

/// M and V of one span of parameters, in one of the stored forms.
#[derive(Debug)]
pub enum Moments<'a> {
    /// fp32 moments.
    F32 {
        /// First moment.
        m: &'a mut [f32],
        /// Second moment.
        v: &'a mut [f32],
    },
    /// bf16 moments (round to nearest even after each update).
    Bf16 {
        /// First moment.
        m: &'a mut [bf16],
        /// Second moment.
        v: &'a mut [bf16],
    },
    /// Block-wise 8-bit moments: M on the signed map, V on the unsigned one.
    Int8 {
        /// First moment.
        m: Q8Mut<'a>,
        /// Second moment.
        v: Q8Mut<'a>,
    },
}

impl Moments<'_> {
    /// The stored form.
    pub fn state_type(&self) -> MomentForm {
        match self {
            Moments::F32 { .. } => MomentForm::F32,
            Moments::Bf16 { .. } => MomentForm::BF16,
            Moments::Int8 { .. } => MomentForm::Int8,
        }
    }
}

impl<'a> Moments<'a> {
    /// Elements `r` of these moments (an int8 range starts at a whole block, and ends at
    /// one or at the end): the codes of `r` and the absmax of the blocks they fall in.
    pub fn range(&mut self, r: std::ops::Range<usize>) -> Moments<'_> {
        match self {
            Moments::F32 { m, v } => Moments::F32 {
                m: &mut m[r.clone()],
                v: &mut v[r],
            },
            Moments::Bf16 { m, v } => Moments::Bf16 {
                m: &mut m[r.clone()],
                v: &mut v[r],
            },
            Moments::Int8 { m, v } => {
                assert!(
                    r.start.is_multiple_of(crate::quant::Q8_BLOCK),
                    "int8 ranges start at whole blocks"
                );
                Moments::Int8 {
                    m: m.range(r.clone()),
                    v: v.range(r),
                }
            }
        }
    }
}

impl Q8Mut<'_> {
    /// Elements `r` (starting at a whole block) with their blocks' absmax.
    pub fn range(&mut self, r: std::ops::Range<usize>) -> Q8Mut<'_> {
        let b = crate::quant::Q8_BLOCK;
        Q8Mut {
            absmax: &mut self.absmax[r.start / b..r.end.div_ceil(b)],
            codes: &mut self.codes[r],
        }
    }
}
