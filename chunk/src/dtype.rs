//! Element types of the tensors a store holds.
//!
//! Three types exist: `f32` (master parameters and Adam state), and the two 16-bit
//! formats `f16` and `bf16` (compute parameters and gradients). A [`DType`] only knows
//! its byte size and its names; conversions between formats belong to the optimizer.
//! Invariant: [`DType::size_bytes`] is 1, 2 or 4, and [`DType::place_bytes`] is the exact
//! byte count of a tensor's elements (with [`DType::Q8`]'s absmax).

use std::fmt;
use std::str::FromStr;

/// Elements per int8 quantization block (one fp32 absmax each).
pub const Q8_BLOCK: u64 = 256;

/// Tensors with fewer elements keep fp32 moments under [`MomentStates::Int8`].
pub const Q8_MIN_ELEMENTS: u64 = 4096;

/// Alignment of every place in an int8 moment list, in bytes.
pub const Q8_PLACE_ALIGN_BYTES: u64 = 64;

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
    /// [`crate::moments`]): one code byte per element, padding to 4 bytes, then one
    /// fp32 absmax per 256 elements. Its bytes are only read through the optimizer's
    /// quantizer; [`crate::typed`] decodes them to NaN, never to plausible numbers.
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
            DType::Q8 => elements.next_multiple_of(4) + 4 * elements.div_ceil(Q8_BLOCK),
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
/// [`crate::ChunkError::UnknownDType`].
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
        assert!(matches!(
            crate::ChunkError::from(err),
            crate::ChunkError::UnknownDType { name } if name == "int8"
        ));
    }
}
