//! How the Adam moment lists (M, V) store a tensor: the layout's side of
//! `optimizer.states` (the optimizer's `StateType`; this crate does not depend on it, so
//! the two block constants are repeated here and a `tidestore-train` test checks they
//! agree).
//!
//! - [`MomentStates::F32`]: each moment is the tensor's elements in fp32, 4-byte slots
//!   (the layout of every earlier version, fingerprints included).
//! - [`MomentStates::Bf16`]: bf16 elements in 2-byte slots.
//! - [`MomentStates::Int8`]: 1-byte slots. A tensor of at least [`Q8_MIN_ELEMENTS`]
//!   elements has a [`DType::Q8`] place: its `n` one-byte codes, zero padding to a
//!   multiple of 4, then `ceil(n / 256)` fp32 absmax values (little-endian) — the codes
//!   and the absmax of one tensor stay in one place, so one access brings both. A smaller
//!   tensor keeps an fp32 place. Every place of an int8 list starts at a multiple of 64
//!   bytes (f32 alignment for the absmax and the fallbacks, whole cache lines for SIMD).
//!
//! Invariant: [`MomentStates::place_bytes`] is what a tensor occupies in the list
//! (padding included) and [`MomentStates::dtype_for`] how its bytes are read.

use crate::dtype::DType;

pub use crate::dtype::{Q8_BLOCK, Q8_MIN_ELEMENTS, Q8_PLACE_ALIGN_BYTES};

/// The stored form of the M and V lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MomentStates {
    /// fp32 (the default).
    #[default]
    F32,
    /// bf16, rounded to nearest even.
    Bf16,
    /// Block-wise 8-bit codes plus an fp32 absmax per 256 elements.
    Int8,
}

impl MomentStates {
    /// Bytes per slot of the M and V lists.
    pub const fn slot_bytes(self) -> u64 {
        match self {
            MomentStates::F32 => 4,
            MomentStates::Bf16 => 2,
            MomentStates::Int8 => 1,
        }
    }

    /// The configuration spelling (`fp32`, `bf16`, `int8`).
    pub const fn as_str(self) -> &'static str {
        match self {
            MomentStates::F32 => "fp32",
            MomentStates::Bf16 => "bf16",
            MomentStates::Int8 => "int8",
        }
    }

    /// How a moment of an `elements`-element tensor is stored.
    pub const fn dtype_for(self, elements: u64) -> DType {
        match self {
            MomentStates::F32 => DType::F32,
            MomentStates::Bf16 => DType::BF16,
            MomentStates::Int8 if elements < Q8_MIN_ELEMENTS => DType::F32,
            MomentStates::Int8 => DType::Q8,
        }
    }

    /// Bytes the tensor's moment occupies in the list (place padding included).
    pub const fn place_bytes(self, elements: u64) -> u64 {
        let data = self.dtype_for(elements).place_bytes(elements);
        match self {
            MomentStates::Int8 => data.next_multiple_of(Q8_PLACE_ALIGN_BYTES),
            _ => data,
        }
    }

    /// Slots the tensor's moment occupies (its `place_bytes` over the slot size, exact).
    pub const fn place_slots(self, elements: u64) -> u64 {
        self.place_bytes(elements) / self.slot_bytes()
    }
}

impl std::fmt::Display for MomentStates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
