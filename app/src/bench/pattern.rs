//! The bench's data: initial parameters and gradients as counter-based pseudo-random
//! patterns (element `k` depends on `k` alone, so a GPU kernel computes the same bits in
//! parallel), and the checksum of every byte read.

use half::bf16;

/// Elements of the patterns beyond the largest tensor (each tensor starts at its own
/// offset, [`pattern_offset`]).
pub(super) const PATTERN_SLACK: usize = 4096;

/// Seed of the initial parameters' pattern.
pub(super) const INIT_SEED: u64 = 7;
/// Seed of the gradient pattern.
pub const GRAD_SEED: u64 = 11;
/// Gradients are the pattern in [-1, 1) times this.
pub const GRAD_SCALE: f32 = 1e-3;

/// Where tensor `tensor`'s slice of a pattern starts in `iteration`.
pub(super) fn pattern_offset(tensor: usize, iteration: u32) -> usize {
    (tensor * 131 + iteration as usize * 977) % PATTERN_SLACK
}

/// Output `index` (0-based) of the splitmix64 generator started at state `seed`: a
/// counter-based stream, so any element is computed on its own (by a GPU thread too).
pub const fn splitmix64(seed: u64, index: u64) -> u64 {
    let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The top 24 bits of `x` as an f32 in [-1, 1); every step is exact.
pub fn unit_f32(x: u64) -> f32 {
    ((x >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

/// Element `index` of the bench's bf16 gradient pattern of `seed`: exactly what the GPU
/// kernel `bench_grad_fill` writes (f32 product rounded to nearest, then bf16 rounded
/// to nearest even).
pub fn grad_value(seed: u64, index: u64, scale: f32) -> bf16 {
    bf16::from_f32(unit_f32(splitmix64(seed, index)) * scale)
}

/// A deterministic pseudo-random stream in [-1, 1): elements `0..n` of `seed`.
pub(super) fn noise(seed: u64, n: usize) -> impl Iterator<Item = f32> {
    (0..n as u64).map(move |k| unit_f32(splitmix64(seed, k)))
}

/// Wrapping sum of `bytes` as little-endian u64 words from its start (the tail
/// zero-padded), so the same bytes give the same sum wherever they lie. The GPU kernel
/// `bench_checksum` computes the same sum of a device range.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut words = bytes.chunks_exact(8);
    let mut sum = words.by_ref().fold(0u64, |a, c| {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        a.wrapping_add(u64::from_le_bytes(w))
    });
    let tail = words.remainder();
    if !tail.is_empty() {
        let mut w = [0u8; 8];
        w[..tail.len()].copy_from_slice(tail);
        sum = sum.wrapping_add(u64::from_le_bytes(w));
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_is_a_word_sum_with_a_padded_tail() {
        let words: Vec<u64> = vec![1, 2, 3];
        assert_eq!(checksum(bytemuck::cast_slice(&words)), 6);
        let bytes: Vec<u8> = (0..17u8).collect();
        assert_eq!(checksum(&bytes[16..]), 16);
        let mut shifted = vec![0u8; 1];
        shifted.extend_from_slice(&bytes);
        assert_eq!(checksum(&shifted[1..]), checksum(&bytes));
    }

    /// The CUDA source of the bench's kernels (also in builds without `cuda`).
    const BENCH_CU: &str = include_str!("../kernels/bench.cu");

    #[test]
    fn splitmix64_is_the_published_generator() {
        // Vigna's splitmix64.c: state 0, and the test vector of state 1234567.
        assert_eq!(splitmix64(0, 0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(0, 1), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(splitmix64(0, 2), 0x06C4_5D18_8009_454F);
        assert_eq!(splitmix64(1_234_567, 0), 6_457_827_717_110_365_317);
        assert_eq!(splitmix64(1_234_567, 1), 3_203_168_211_198_807_973);
    }

    /// The kernel's `f32_to_bf16_bits`, line for line.
    fn kernel_bf16_bits(f: f32) -> u16 {
        let x = f.to_bits();
        if (x & 0x7fff_ffff) > 0x7f80_0000 {
            return ((x >> 16) | 0x0040) as u16;
        }
        let round_bit = 0x0000_8000u32;
        if (x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0 {
            return ((x >> 16) + 1) as u16;
        }
        (x >> 16) as u16
    }

    /// The kernel's `unit_f32`, built from integers only: the top 24 bits `t` give
    /// `t / 2^23 - 1`, exactly representable, so the f32 is exact.
    fn kernel_unit_exact(x: u64) -> f32 {
        let t = (x >> 40) as i64; // 24 bits
        let v = (t - (1 << 23)) as f64 / (1u64 << 23) as f64;
        v as f32
    }

    #[test]
    fn the_host_generator_is_what_the_fill_kernel_computes() {
        // Every operation of `bench_grad_fill`, as the kernel writes it, against the
        // `half` crate path the host uses.
        for (first, n) in [(0u64, 1 << 16), (977, 1 << 16), (u64::MAX - 100, 100)] {
            for k in 0..n {
                let index = first.wrapping_add(k);
                let x = splitmix64(GRAD_SEED, index);
                let unit = unit_f32(x);
                assert_eq!(unit.to_bits(), kernel_unit_exact(x).to_bits(), "exact unit");
                assert!((-1.0..1.0).contains(&unit));
                let want = kernel_bf16_bits(unit * GRAD_SCALE);
                assert_eq!(grad_value(GRAD_SEED, index, GRAD_SCALE).to_bits(), want);
            }
        }
        // The bf16 rounding rule on its edge cases: ties to even, carries into the
        // exponent, overflow to infinity, subnormals, NaN kept quiet with its payload.
        for bits in [
            0x3f80_8000u32, // tie, even below: stays
            0x3f81_8000,    // tie, odd below: rounds up
            0x3f80_8001,    // above the tie
            0x3f80_7fff,    // below the tie
            0x3fff_ffff,    // carries into the exponent
            0x7f7f_ffff,    // largest finite: to infinity
            0x7f80_0000,    // infinity
            0xff80_0000,
            0x0000_8001, // subnormal
            0x8000_0000, // -0
            0x7fc0_0001, // quiet NaN with a payload
            0x7f80_0001, // signalling NaN: made quiet
            0xffff_ffff,
        ] {
            let f = f32::from_bits(bits);
            assert_eq!(
                bf16::from_f32(f).to_bits(),
                kernel_bf16_bits(f),
                "{bits:#010x}"
            );
        }
        // The kernel source uses these constants and steps (a change on one side only
        // fails here; tests/bench_gpu.rs compares the bits on a GPU).
        let src: String = BENCH_CU.split_whitespace().collect();
        for needle in [
            "u64z=seed+(index+1u)*0x9E3779B97F4A7C15ull;",
            "z=(z^(z>>30))*0xBF58476D1CE4E5B9ull;",
            "z=(z^(z>>27))*0x94D049BB133111EBull;",
            "returnz^(z>>31);",
            "__fsub_rn(__fdiv_rn(__ull2float_rn(x>>40),8388608.0f),1.0f)",
            "unit_f32(splitmix64(seed,first+k))",
            "f32_to_bf16_bits(__fmul_rn(x,scale))",
        ] {
            assert!(src.contains(needle), "bench.cu lacks `{needle}`");
        }
        assert_eq!(8_388_608.0f32, (1u64 << 23) as f32);
    }

    /// The checksum kernel's algorithm, thread by thread: the aligned words covering
    /// the range, bytes outside it masked (never read), each rotated right by 8 times
    /// the misalignment, summed in any order.
    fn kernel_checksum_model(memory: &[u8], start: usize, n: usize) -> u64 {
        let shift = start % 8;
        let base = start - shift;
        let (lo, hi) = (shift, shift + n);
        let words = hi.div_ceil(8);
        let rot = 8 * shift as u32;
        // Reverse order, to show the order does not matter.
        (0..words).rev().fold(0u64, |sum, k| {
            let w = if k * 8 >= lo && k * 8 + 8 <= hi {
                u64::from_le_bytes(memory[base + k * 8..base + k * 8 + 8].try_into().unwrap())
            } else {
                (0..8).fold(0u64, |w, b| {
                    let at = k * 8 + b;
                    if at >= lo && at < hi {
                        w | (u64::from(memory[base + at]) << (8 * b))
                    } else {
                        w
                    }
                })
            };
            sum.wrapping_add(w.rotate_right(rot))
        })
    }

    #[test]
    fn the_checksum_kernels_rotated_aligned_words_give_the_host_sum() {
        let memory: Vec<u8> = (0..4200u64)
            .map(|i| (splitmix64(5, i) >> 32) as u8)
            .collect();
        for start in 0..16 {
            for n in [0, 1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4096] {
                assert_eq!(
                    kernel_checksum_model(&memory, start, n),
                    checksum(&memory[start..start + n]),
                    "start {start}, {n} bytes"
                );
            }
        }
    }
}
