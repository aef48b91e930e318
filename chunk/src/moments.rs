//! How the Adam moment lists (M, V) store a tensor: `optimizer.states`, one
//! [`MomentForm`] for the layout and the optimizer alike (from `tidestore-dtype`).
//!
//! - [`MomentForm::F32`]: each moment is the tensor's elements in fp32, 4-byte slots
//!   (the layout of every earlier version, fingerprints included).
//! - [`MomentForm::BF16`]: bf16 elements in 2-byte slots.
//! - [`MomentForm::Int8`]: 1-byte slots. A tensor of at least [`Q8_MIN_ELEMENTS`]
//!   elements has a [`crate::DType::Q8`] place: its `n` one-byte codes, zero padding to a
//!   multiple of 4, then `ceil(n / 256)` fp32 absmax values (little-endian) — the codes
//!   and the absmax of one tensor stay in one place, so one access brings both. A smaller
//!   tensor keeps an fp32 place. Every place of an int8 list starts at a multiple of 64
//!   bytes (f32 alignment for the absmax and the fallbacks, whole cache lines for SIMD).
//!
//! Invariant: [`MomentForm::place_bytes`] is what a tensor occupies in the list
//! (padding included) and [`MomentForm::dtype_for`] how its bytes are read.

pub use crate::dtype::{MomentForm, Q8_BLOCK, Q8_MIN_ELEMENTS, Q8_PLACE_ALIGN_BYTES};
