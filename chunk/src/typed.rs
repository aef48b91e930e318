//! Typed copies of tensor bytes: little-endian `f32`, `f16` and `bf16` to and from
//! `f32`, through the `half` crate.
//!
//! The chunk crate has no `unsafe`, so it does not reinterpret byte slices in place;
//! these copy, element by element. Invariant: `bytes.len() == values.len() * size`;
//! extra elements on either side are ignored.
//!
//! A copy of a tensor past [`PARALLEL_MIN`] elements runs on rayon's pool in pieces:
//! one core copies a parameter into a framework tensor at a fraction of the memory's
//! rate, and while a trainer's step loop copies, the cores that compute are idle.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::dtype::DType;

/// Elements from which a copy is split across rayon's threads (16 MiB of f32).
pub const PARALLEL_MIN: usize = 1 << 22;

/// Elements of one piece of a parallel copy (1 MiB of f32).
const PIECE: usize = 1 << 18;

/// Decodes `bytes` (elements of `dtype`) into `out`.
pub fn decode_f32(bytes: &[u8], dtype: DType, out: &mut [f32]) {
    let size = dtype.size_bytes() as usize;
    piecewise(out.len(), (out, 1), (bytes, size), |o, b| {
        decode_piece(b, dtype, o)
    });
}

/// `bytes` (elements of `dtype`) decoded into a new vector.
pub fn decode_f32_vec(bytes: &[u8], dtype: DType) -> Vec<f32> {
    let n = bytes.len() / dtype.size_bytes() as usize;
    if n < PARALLEL_MIN {
        let mut out = vec![0.0; n];
        decode_piece(bytes, dtype, &mut out);
        return out;
    }
    // Written once, in place, by the pool: no zero fill first.
    let mut out = Vec::with_capacity(n);
    let size = dtype.size_bytes() as usize;
    let each = bytes.par_chunks_exact(size);
    match dtype {
        DType::F32 => each.map(f32_le).collect_into_vec(&mut out),
        DType::F16 => each.map(f16_le).collect_into_vec(&mut out),
        DType::BF16 => each.map(bf16_le).collect_into_vec(&mut out),
        DType::Q8 => out.resize(n, f32::NAN),
    }
    out
}

/// `src` copied into `dst` (as long as the shorter), split as [`decode_f32`].
pub fn copy_f32(src: &[f32], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    piecewise(n, (&mut dst[..n], 1), (&src[..n], 1), |d, s| {
        d.copy_from_slice(s)
    });
}

/// `f` over `n` tensor elements held in `dst` and `src` (`(slice, units per element)`):
/// once over both whole, or past [`PARALLEL_MIN`] over matching pieces of [`PIECE`]
/// elements on rayon's pool.
fn piecewise<D: Send, S: Sync>(
    n: usize,
    (dst, dst_unit): (&mut [D], usize),
    (src, src_unit): (&[S], usize),
    f: impl Fn(&mut [D], &[S]) + Sync,
) {
    if n >= PARALLEL_MIN {
        dst.par_chunks_mut(PIECE * dst_unit)
            .zip(src.par_chunks(PIECE * src_unit))
            .for_each(|(d, s)| f(d, s));
    } else {
        f(dst, src);
    }
}

fn f32_le(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn f16_le(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

fn bf16_le(b: &[u8]) -> f32 {
    bf16::from_le_bytes([b[0], b[1]]).to_f32()
}

fn decode_piece(bytes: &[u8], dtype: DType, out: &mut [f32]) {
    let size = dtype.size_bytes() as usize;
    let each = out.iter_mut().zip(bytes.chunks_exact(size));
    match dtype {
        DType::F32 => each.for_each(|(o, b)| *o = f32_le(b)),
        DType::F16 => each.for_each(|(o, b)| *o = f16_le(b)),
        DType::BF16 => each.for_each(|(o, b)| *o = bf16_le(b)),
        // Codes need the optimizer's map: never pass them off as numbers.
        DType::Q8 => out.fill(f32::NAN),
    }
}

/// Encodes `values` as elements of `dtype` into `out` (rounding to nearest even).
pub fn encode_f32(values: &[f32], dtype: DType, out: &mut [u8]) {
    let size = dtype.size_bytes() as usize;
    piecewise(values.len(), (out, size), (values, 1), |o, v| {
        encode_piece(v, dtype, o)
    });
}

fn encode_piece(values: &[f32], dtype: DType, out: &mut [u8]) {
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

    /// Past PARALLEL_MIN the copies run in pieces on rayon's pool: the same elements,
    /// in the same places, as one serial pass (a piece boundary that is not a multiple
    /// of the element size, or a tail left out, would differ).
    #[test]
    fn parallel_copies_equal_the_serial_pass() {
        let n = PARALLEL_MIN + PIECE / 2 + 3;
        let values: Vec<f32> = (0..n).map(|i| (i as f32).sin() * 1e3).collect();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let size = dtype.size_bytes() as usize;
            let (mut par, mut serial) = (vec![0u8; n * size], vec![0u8; n * size]);
            encode_f32(&values, dtype, &mut par);
            encode_piece(&values, dtype, &mut serial);
            assert!(par == serial, "{dtype}: encode");
            let mut want = vec![0f32; n];
            decode_piece(&serial, dtype, &mut want);
            let mut into = vec![0f32; n];
            decode_f32(&serial, dtype, &mut into);
            assert!(into == want, "{dtype}: decode");
            assert!(
                decode_f32_vec(&serial, dtype) == want,
                "{dtype}: decode into a vector"
            );
        }
        let mut copied = vec![0f32; n];
        copy_f32(&values, &mut copied);
        assert!(copied == values);
    }
}
