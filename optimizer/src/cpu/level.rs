//! The SIMD dispatch ladder: which instruction set the kernels use on this CPU.
//!
//! Detection runs once per optimizer ([`SimdLevel::detect`]); a level can also be forced
//! (tests compare every level the CPU supports against the scalar one), and forcing a
//! level the CPU lacks is an error, never undefined behaviour: every `unsafe` call into a
//! `#[target_feature]` kernel is guarded by a [`SimdLevel`] that was checked with
//! [`SimdLevel::is_supported`].

/// Instruction set used by the CPU kernels, from most to least capable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SimdLevel {
    /// Portable Rust, one element at a time (`f32::mul_add` for every fused step).
    Scalar,
    /// AVX2 + FMA + F16C, 8 lanes; bf16 output rounded with integer ops.
    Avx2,
    /// AVX-512F (+ AVX2/FMA/F16C), 16 lanes; bf16 output rounded with integer ops.
    Avx512,
    /// As [`SimdLevel::Avx512`], with `vcvtneps2bf16` (AVX512_BF16) for bf16 output and an
    /// integer fix-up for subnormal inputs, which that instruction flushes to zero.
    Avx512Bf16,
}

impl SimdLevel {
    /// Every level, lowest first.
    pub const ALL: [SimdLevel; 4] = [
        SimdLevel::Scalar,
        SimdLevel::Avx2,
        SimdLevel::Avx512,
        SimdLevel::Avx512Bf16,
    ];

    /// The best level this CPU runs.
    pub fn detect() -> SimdLevel {
        let best = SimdLevel::ALL
            .into_iter()
            .rev()
            .find(|l| l.is_supported())
            .unwrap_or(SimdLevel::Scalar);
        tracing::debug!(level = ?best, "CPU AdamW SIMD level");
        best
    }

    /// True when this CPU has every feature the level's kernels are compiled with.
    pub fn is_supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            match self {
                SimdLevel::Scalar => true,
                SimdLevel::Avx2 => avx2,
                SimdLevel::Avx512 => avx2 && is_x86_feature_detected!("avx512f"),
                SimdLevel::Avx512Bf16 => {
                    avx2 && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bf16")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == SimdLevel::Scalar
        }
    }

    /// Every level this CPU supports, lowest first.
    pub fn supported() -> Vec<SimdLevel> {
        SimdLevel::ALL
            .into_iter()
            .filter(|l| l.is_supported())
            .collect()
    }
}
