//! The SIMD dispatch ladder: which instruction set the kernels use on this CPU.
//!
//! Detection runs once per optimizer (`SimdLevel::choose`, in [`crate::cpu`]); a level can also be forced,
//! by the caller ([`crate::CpuConfig::simd`]; tests compare every level the CPU supports
//! against the scalar one) or for the whole process by the environment variable
//! [`SIMD_ENV`] (`TIDESTORE_SIMD=avx2`, e.g. to measure the AVX2 kernels on an AVX-512
//! machine). Forcing a level the CPU lacks, or an unknown name, is an error, never
//! undefined behaviour: every `unsafe` call into a `#[target_feature]` kernel is guarded
//! by a [`SimdLevel`] that was checked with [`SimdLevel::is_supported`].

/// The environment variable that forces the SIMD level of every optimizer built without
/// an explicit level: `scalar`, `avx2`, `avx512` or `avx512bf16` (case-insensitive).
pub const SIMD_ENV: &str = "TIDESTORE_SIMD";

/// Why an optimizer runs the level it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SimdReason {
    /// The best level this CPU supports.
    Detected,
    /// The caller asked for it ([`crate::CpuConfig::simd`]).
    Requested,
    /// [`SIMD_ENV`] named it.
    Environment,
}

impl SimdReason {
    /// A short explanation for logs and tables.
    pub fn describe(self) -> String {
        match self {
            SimdReason::Detected => "the best level this CPU supports".into(),
            SimdReason::Requested => "forced by the caller".into(),
            SimdReason::Environment => format!("forced by {SIMD_ENV}"),
        }
    }
}

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

    /// The lowercase name [`SimdLevel::parse`] reads: `scalar`, `avx2`, `avx512`,
    /// `avx512bf16`.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Avx512Bf16 => "avx512bf16",
        }
    }

    /// The level named `s` (case-insensitive), if any.
    pub fn parse(s: &str) -> Option<SimdLevel> {
        SimdLevel::ALL
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(s.trim()))
    }

    /// The level [`SIMD_ENV`] names: `Ok(None)` when it is unset or empty, `Err` with
    /// the value when it names no level.
    pub fn from_env() -> Result<Option<SimdLevel>, String> {
        match std::env::var(SIMD_ENV) {
            Ok(name) if !name.trim().is_empty() => SimdLevel::parse(&name).map(Some).ok_or(name),
            _ => Ok(None),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_level_parses_from_its_name() {
        for l in SimdLevel::ALL {
            assert_eq!(SimdLevel::parse(l.name()), Some(l));
            assert_eq!(SimdLevel::parse(&l.name().to_uppercase()), Some(l));
        }
        assert_eq!(SimdLevel::parse("avx3"), None);
    }

    #[test]
    fn a_requested_level_wins_and_an_unsupported_one_is_refused() {
        assert_eq!(
            SimdLevel::choose(Some(SimdLevel::Scalar)).unwrap(),
            (SimdLevel::Scalar, SimdReason::Requested)
        );
        for l in SimdLevel::ALL {
            assert_eq!(
                SimdLevel::choose(Some(l)).is_ok(),
                l.is_supported(),
                "{l:?}"
            );
        }
    }
}
