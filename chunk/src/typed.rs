//! Typed copies of tensor bytes: little-endian `f32`, `f16` and `bf16` to and from
//! `f32`, through the `half` crate.
//!
//! The chunk crate has no `unsafe`, so it does not reinterpret byte slices in place;
//! these copy, element by element. Invariant: `bytes.len() == values.len() * size`;
//! extra elements on either side are ignored.

use half::{bf16, f16};

use crate::dtype::DType;

/// Decodes `bytes` (elements of `dtype`) into `out`.
pub fn decode_f32(bytes: &[u8], dtype: DType, out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        // Codes need the optimizer's map: never pass them off as numbers.
        DType::Q8 => out.fill(f32::NAN),
    }
}

/// Encodes `values` as elements of `dtype` into `out` (rounding to nearest even).
pub fn encode_f32(values: &[f32], dtype: DType, out: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (v, b) in values.iter().zip(out.chunks_exact_mut(4)) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F16 => {
            for (v, b) in values.iter().zip(out.chunks_exact_mut(2)) {
                b.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (v, b) in values.iter().zip(out.chunks_exact_mut(2)) {
                b.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        // Quantizing needs the optimizer's map; callers write Q8 places as raw bytes.
        DType::Q8 => panic!("encode_f32 into a Q8 place: write its bytes through the optimizer"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_exact_values() {
        let values = [0.0f32, 1.0, -2.5, 0.15625, 1024.0];
        for dtype in DType::ALL {
            let mut bytes = vec![0u8; values.len() * dtype.size_bytes() as usize];
            encode_f32(&values, dtype, &mut bytes);
            let mut back = [0f32; 5];
            decode_f32(&bytes, dtype, &mut back);
            assert_eq!(back, values, "{dtype}");
        }
    }
}
