//! What the AVX2 and AVX-512 kernels share: the 8-lane gradient load, the software
//! prefetch of the streams and the rounding immediate of `vcvtps2ph`. A leaf: it names
//! no other kernel file, so neither kernel file depends on the other.

use std::arch::x86_64::*;

use super::raw::{StepPtrs, G_F16, G_F32};

/// Prefetch distance of the step and probe loops, in bytes ahead on each f32 stream.
/// Measured on the 2-core AVX-512 Xeon (20M params, medians of 9): 0 -> ~0.90 of the
/// probe's bytes/s, 1-8 KiB -> ~0.98-1.0; 4 KiB chosen. The probe prefetches alike, so
/// the roofline is not understated.
pub(crate) const PREFETCH_BYTES: usize = 4096;

/// Prefetches the line `PREFETCH_BYTES` ahead of element `i` of an f32 stream.
#[inline(always)]
pub(crate) fn prefetch(p: *const f32, i: usize) {
    // SAFETY: a prefetch is a hint that never faults, whatever the address (SSE is part
    // of x86_64); `wrapping_add` forms the address without claiming it is in bounds.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + PREFETCH_BYTES / 4).cast()) }
}

/// Prefetches every stream of a step with fp32 moments at element `i`: master, M, V,
/// and the gradient when it is f32.
#[inline(always)]
pub(crate) fn prefetch_step<const GK: u8>(s: &StepPtrs, i: usize) {
    prefetch(s.p, i);
    prefetch(s.m, i);
    prefetch(s.v, i);
    if GK == G_F32 {
        prefetch(s.g.cast(), i);
    }
}

/// `vcvtps2ph` immediate: round to nearest even (not MXCSR's mode).
pub(crate) const RNE: i32 = _MM_FROUND_TO_NEAREST_INT;

/// Loads 8 gradient elements of the `GK` dtype at `g + i` as f32 (exact).
///
/// # Safety
/// AVX2 and F16C are enabled in the caller; elements `i..i + 8` are in bounds.
#[inline(always)]
pub(crate) unsafe fn load8<const GK: u8>(g: *const u8, i: usize) -> __m256 {
    // SAFETY: the caller guarantees the features and that 8 elements (16 or 32 bytes)
    // starting at element `i` are readable; the loads are unaligned ones.
    unsafe {
        match GK {
            G_F32 => _mm256_loadu_ps(g.cast::<f32>().add(i)),
            G_F16 => _mm256_cvtph_ps(_mm_loadu_si128(g.cast::<u16>().add(i).cast())),
            _ => {
                let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(g.cast::<u16>().add(i).cast()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
            }
        }
    }
}
