//! Guards against 16-bit parameter copies that differ from `half`'s conversions: a
//! rounding that is not nearest-even, a NaN that loses its payload or quiet bit, a
//! subnormal flushed to zero (which `vcvtneps2bf16` alone would do), an overflow that
//! does not give infinity.
//!
//! Every level's `cast_params` (the same store code the step uses) over: every bf16 bit
//! pattern followed by the low halves that decide rounding (0, 1, 0x7FFF, 0x8000, 0x8001,
//! 0xFFFF, and the fp16 tie patterns 0x0FFF, 0x1000, 0x1001, 0x3000), in order and
//! shuffled (so vectors mix subnormal and normal lanes), and 1M random bit patterns.

mod common;

use common::Rng;
use half::{bf16, f16};
use tidestore_optimizer::ParamOut;

fn inputs() -> Vec<f32> {
    let mut v = Vec::new();
    for hi in 0u32..=0xFFFF {
        for lo in [
            0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x0FFF, 0x1000, 0x1001, 0x3000,
        ] {
            v.push(f32::from_bits(hi << 16 | lo));
        }
    }
    let mut rng = Rng::new(11);
    let mut shuffled = v.clone();
    for i in (1..shuffled.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        shuffled.swap(i, j);
    }
    v.extend(shuffled);
    v.extend((0..1_000_000).map(|_| f32::from_bits(rng.next_u64() as u32)));
    v
}

#[test]
fn casts_match_half_bit_for_bit() {
    let src = inputs();
    let want_h: Vec<u16> = src.iter().map(|&x| f16::from_f32(x).to_bits()).collect();
    let want_b: Vec<u16> = src.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
    for (level, threads, opt) in common::optimizers(4096) {
        let mut h = vec![f16::ZERO; src.len()];
        let mut b = vec![bf16::ZERO; src.len()];
        opt.cast_params(&src, ParamOut::F16(&mut h)).unwrap();
        opt.cast_params(&src, ParamOut::Bf16(&mut b)).unwrap();
        for i in 0..src.len() {
            assert_eq!(
                h[i].to_bits(),
                want_h[i],
                "{level:?} x{threads}: f16 of {:#010x}",
                src[i].to_bits()
            );
            assert_eq!(
                b[i].to_bits(),
                want_b[i],
                "{level:?} x{threads}: bf16 of {:#010x}",
                src[i].to_bits()
            );
        }
    }
}

/// The cases the hardware instruction alone gets wrong, spelled out.
#[test]
fn bf16_subnormals_nan_and_ties() {
    let cases: [(u32, u16); 8] = [
        (0x0000_8001, 0x0001), // subnormal rounds up, not flushed
        (0x0040_0000, 0x0040), // subnormal kept
        (0x8040_0000, 0x8040), // negative subnormal kept
        (0x7F80_0001, 0x7FC0), // signalling NaN quieted, top payload kept (none)
        (0xFFA0_0000, 0xFFE0), // negative NaN with payload, quiet bit set
        (0x3F80_8000, 0x3F80), // tie to even (down)
        (0x3F81_8000, 0x3F82), // tie to even (up)
        (0x7F7F_FFFF, 0x7F80), // max finite rounds to infinity
    ];
    let src: Vec<f32> = cases.iter().map(|&(b, _)| f32::from_bits(b)).collect();
    // Pad to a full vector with one normal value, so the SIMD path (not the tail) runs.
    let mut padded = src.clone();
    padded.resize(32, 1.0);
    for (level, threads, opt) in common::optimizers(4096) {
        let mut out = vec![bf16::ZERO; padded.len()];
        opt.cast_params(&padded, ParamOut::Bf16(&mut out)).unwrap();
        for (i, &(bits, want)) in cases.iter().enumerate() {
            assert_eq!(out[i].to_bits(), want, "{level:?} x{threads}: {bits:#010x}");
            assert_eq!(
                bf16::from_f32(f32::from_bits(bits)).to_bits(),
                want,
                "half itself"
            );
        }
    }
}
