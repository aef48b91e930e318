//! The one vocabulary of element types in tidestore, shared by every crate (a leaf: it
//! depends on nothing of the workspace).
//!
//! - [`DType`]: the element type of a tensor or a chunk list — `f32` (master parameters,
//!   Adam state), the 16-bit `f16` / `bf16` (compute parameters, gradients), and
//!   [`DType::Q8`], the block-wise 8-bit form of an Adam moment. It knows its byte sizes
//!   and its names; conversions between formats belong to the optimizer.
//! - [`MomentForm`]: how Adam's M and V are stored (`optimizer.states`): fp32, bf16 or
//!   int8, and which [`DType`] a tensor's moment then has.
//! - The int8 block layout: [`Q8_BLOCK`] elements share one fp32 absmax, tensors under
//!   [`Q8_MIN_ELEMENTS`] keep fp32 moments, places start at [`Q8_PLACE_ALIGN_BYTES`].
//!
//! Invariant: [`DType::size_bytes`] is 1, 2 or 4, and [`DType::place_bytes`] is the exact
//! byte count of a tensor's elements (with [`DType::Q8`]'s absmax): `n` codes, zero
//! padding to a multiple of 4, then `ceil(n / Q8_BLOCK)` little-endian fp32 absmax.

use std::fmt;
use std::str::FromStr;

/// Elements per int8 quantization block (one fp32 absmax each).
pub const Q8_BLOCK: usize = 256;

/// Tensors with fewer elements keep fp32 moments under [`MomentForm::Int8`] (their absmax
/// overhead and error are not worth it; bitsandbytes uses the same cut-off).
pub const Q8_MIN_ELEMENTS: usize = 4096;

/// Alignment of every place in an int8 moment list, in bytes (f32 alignment for the
/// absmax and the fp32 fallbacks, whole cache lines for SIMD).
pub const Q8_PLACE_ALIGN_BYTES: u64 = 64;

/// Number of absmax values of an `n`-element int8 array.
pub const fn absmax_len(n: usize) -> usize {
    n.div_ceil(Q8_BLOCK)
}

/// The element type of a tensor or of a chunk list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (8 exponent bits, 7 mantissa bits).
    BF16,
    /// A block-wise 8-bit quantized Adam moment (only in the M and V lists, see
    /// [`MomentForm::Int8`]): one code byte per element, padding to 4 bytes, then one
    /// fp32 absmax per [`Q8_BLOCK`] elements. Its bytes are only read through the
    /// optimizer's quantizer; the chunk store's typed views decode them to NaN, never to
    /// plausible numbers.
    Q8,
}

impl DType {
    /// The element types of tensors (not [`DType::Q8`], which only moments use).
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element.
    pub const fn size_bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8 => 1,
        }
    }

    /// Bytes of `elements` elements stored in this type (for [`DType::Q8`]: the codes,
    /// padding to 4 bytes and the fp32 absmax of every 256 elements).
    pub const fn place_bytes(self, elements: u64) -> u64 {
        match self {
            DType::Q8 => elements.next_multiple_of(4) + 4 * elements.div_ceil(Q8_BLOCK as u64),
            d => elements * d.size_bytes(),
        }
    }

    /// Whether this is one of the 16-bit formats.
    pub const fn is_16bit(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }

    /// The canonical lower-case name (`f32`, `f16`, `bf16`), as [`fmt::Display`] writes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q8 => "q8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A dtype name that is not one of [`DType`]'s (or their aliases); becomes
/// an error of the crate that parsed it (e.g. `tidestore_chunk::ChunkError::UnknownDType`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype `{name}` (expected f32, f16 or bf16)")]
pub struct UnknownDType {
    /// The name as given.
    pub name: String,
}

impl FromStr for DType {
    type Err = UnknownDType;

    /// Parses the names used by PyTorch, safetensors and configuration files,
    /// case-insensitively: `f32 fp32 float32 float`, `f16 fp16 float16 half`,
    /// `bf16 bfloat16`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        let lower = lower.strip_prefix("torch.").unwrap_or(&lower);
        match lower {
            "f32" | "fp32" | "float32" | "float" => Ok(DType::F32),
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "q8" => Ok(DType::Q8),
            _ => Err(UnknownDType {
                name: s.to_string(),
            }),
        }
    }
}

/// How Adam's M and V are stored (the fp32 master copy is kept in every case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MomentForm {
    /// fp32 moments: 8 bytes per parameter.
    #[default]
    F32,
    /// bf16 moments rounded to nearest even: 4 bytes per parameter.
    BF16,
    /// Block-wise 8-bit dynamic quantization: 2 bytes per parameter plus 8 bytes per
    /// [`Q8_BLOCK`] (tensors under [`Q8_MIN_ELEMENTS`] stay fp32).
    Int8,
}

impl MomentForm {
    /// Every form.
    pub const ALL: [MomentForm; 3] = [MomentForm::F32, MomentForm::BF16, MomentForm::Int8];

    /// The configuration spelling: `"fp32"`, `"bf16"` or `"int8"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            MomentForm::F32 => "fp32",
            MomentForm::BF16 => "bf16",
            MomentForm::Int8 => "int8",
        }
    }

    /// Parses the configuration spelling (also `float32` and `bfloat16`, as PyTorch
    /// names the dtypes).
    pub fn parse(s: &str) -> Option<MomentForm> {
        match s {
            "float32" => Some(MomentForm::F32),
            "bfloat16" => Some(MomentForm::BF16),
            _ => MomentForm::ALL.into_iter().find(|t| t.as_str() == s),
        }
    }

    /// The form a tensor of `n` elements actually uses: int8 falls back to fp32 under
    /// [`Q8_MIN_ELEMENTS`].
    pub const fn for_len(self, n: usize) -> MomentForm {
        match self {
            MomentForm::Int8 if n < Q8_MIN_ELEMENTS => MomentForm::F32,
            t => t,
        }
    }

    /// How a moment of an `elements`-element tensor is stored.
    pub const fn dtype_for(self, elements: u64) -> DType {
        match self {
            MomentForm::F32 => DType::F32,
            MomentForm::BF16 => DType::BF16,
            MomentForm::Int8 if elements < Q8_MIN_ELEMENTS as u64 => DType::F32,
            MomentForm::Int8 => DType::Q8,
        }
    }

    /// Bytes per slot of the M and V chunk lists.
    pub const fn slot_bytes(self) -> u64 {
        match self {
            MomentForm::F32 => 4,
            MomentForm::BF16 => 2,
            MomentForm::Int8 => 1,
        }
    }

    /// Bytes the tensor's moment occupies in its chunk list (place padding included).
    pub const fn place_bytes(self, elements: u64) -> u64 {
        let data = self.dtype_for(elements).place_bytes(elements);
        match self {
            MomentForm::Int8 => data.next_multiple_of(Q8_PLACE_ALIGN_BYTES),
            _ => data,
        }
    }

    /// Slots the tensor's moment occupies (its `place_bytes` over the slot size, exact).
    pub const fn place_slots(self, elements: u64) -> u64 {
        self.place_bytes(elements) / self.slot_bytes()
    }
}

impl fmt::Display for MomentForm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(DType::F32.size_bytes(), 4);
        assert_eq!(DType::F16.size_bytes(), 2);
        assert_eq!(DType::BF16.size_bytes(), 2);
        assert!(DType::BF16.is_16bit() && !DType::F32.is_16bit());
    }

    #[test]
    fn q8_place_is_codes_padding_absmax() {
        assert_eq!(DType::Q8.place_bytes(4097), 4100 + 4 * 17);
        assert_eq!(
            MomentForm::Int8.place_bytes(4097),
            (4100 + 68_u64).next_multiple_of(64)
        );
        assert_eq!(MomentForm::Int8.dtype_for(4095), DType::F32);
        assert_eq!(MomentForm::Int8.for_len(4095), MomentForm::F32);
        assert_eq!(MomentForm::BF16.place_slots(10), 10);
        for f in MomentForm::ALL {
            assert_eq!(MomentForm::parse(f.as_str()), Some(f));
        }
    }

    #[test]
    fn parse_names() {
        for (s, d) in [
            ("f32", DType::F32),
            ("FP32", DType::F32),
            ("torch.float32", DType::F32),
            ("half", DType::F16),
            ("float16", DType::F16),
            ("BF16", DType::BF16),
            (" bfloat16 ", DType::BF16),
        ] {
            assert_eq!(s.parse::<DType>().unwrap(), d, "{s}");
        }
        for d in DType::ALL {
            assert_eq!(d.to_string().parse::<DType>().unwrap(), d);
        }
    }

    #[test]
    fn parse_unknown_names_it() {
        let err = "int8".parse::<DType>().unwrap_err();
        assert_eq!(err.name, "int8");
        assert!(err.to_string().contains("int8"));
    }
}
