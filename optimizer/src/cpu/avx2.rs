//! AVX2 + FMA + F16C kernels, 8 lanes.
//!
//! Each public kernel is a `#[target_feature]` wrapper around `#[inline(always)]`
//! bodies, so the intrinsics inline into code compiled with the features. The bodies
//! evaluate exactly the operation sequence of [`super::scalar::adam`] (fused where it
//! fuses), and finish the last `len % 8` elements with the scalar element functions, so
//! results are bit-identical to the scalar level. The 8-lane load and the prefetch are
//! shared with the AVX-512 kernels through [`super::x86`].

use std::arch::x86_64::*;

use super::raw::{StepPtrs, G_F16, G_F32, O_F16, O_NONE};
use super::scalar;
use super::x86::{load8, prefetch, prefetch_step, RNE};
use crate::params::Consts;

/// Rounds 8 f32 to bf16 bits exactly as `half::bf16::from_f32`: NaN keeps its top
/// mantissa bits and gets the quiet bit; otherwise round to nearest, ties to even, by
/// adding `0x7FFF + lsb` (subnormals and overflow to infinity included). Result in the
/// low 16 bits of each 32-bit lane.
///
/// # Safety
/// AVX2 is enabled in the caller.
#[inline(always)]
pub(crate) unsafe fn bf16_bits8(p: __m256) -> __m256i {
    // SAFETY: register-only intrinsics; the caller guarantees AVX2.
    unsafe {
        let x = _mm256_castps_si256(p);
        // One unordered compare (the integer form, `|x| > 0x7F80_0000`, compiles to three
        // instructions on AVX2, which has no unsigned compare).
        let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(p, p));
        let hi = _mm256_srli_epi32::<16>(x);
        let lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
        let biased = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb);
        let rounded = _mm256_srli_epi32::<16>(biased);
        let nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
        _mm256_blendv_epi8(rounded, nan, is_nan)
    }
}

/// Stores `p` as 8 16-bit values of the `OK` dtype at `out + i`.
///
/// # Safety
/// AVX2 and F16C are enabled in the caller; `out + i .. out + i + 8` is writable.
#[inline(always)]
pub(crate) unsafe fn store8_out<const OK: u8>(out: *mut u16, i: usize, p: __m256) {
    if OK == O_NONE {
        return;
    }
    // SAFETY: features and bounds from the caller; unaligned 16-byte store.
    unsafe {
        let h = if OK == O_F16 {
            _mm256_cvtps_ph::<RNE>(p)
        } else {
            // packus keeps 0..=0xFFFF unchanged; it packs within 128-bit lanes, so the
            // permute gathers qwords 0 and 2 (elements 0..4 and 4..8) into the low half.
            let b = bf16_bits8(p);
            let packed = _mm256_packus_epi32(b, b);
            _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b00_00_10_00>(packed))
        };
        _mm_storeu_si128(out.add(i).cast(), h);
    }
}

/// 16 elements in the *split order* that 16-bit data takes without crossing 128-bit
/// lanes: the first vector holds elements 0-3 and 8-11, the second 4-7 and 12-15.
/// `vpunpck{l,h}wd` with zero widens 16 bf16 values into that order, and `vpackusdw` of
/// the two vectors' 16-bit results stores them back in element order, so a loop over
/// 16 elements converts its bf16 streams without `vpmovzxwd`/`vextracti128` (lane
/// crossings: on the Zen 3 development VM one 8-lane bf16 path's step took about 3.7
/// cycles per parameter in cache against 1.7 for fp32).
///
/// # Safety
/// AVX2 and F16C are enabled in the caller; 16 elements of the `GK` dtype at element
/// `i` of `g` are readable.
#[inline(always)]
pub(crate) unsafe fn load16_split<const GK: u8>(g: *const u8, i: usize) -> (__m256, __m256) {
    // SAFETY: the caller's bounds; unaligned loads.
    unsafe {
        match GK {
            G_F32 => load16_f32_split(g.cast::<f32>().add(i)),
            G_F16 => {
                let h = g.cast::<u16>().add(i);
                let a =
                    _mm_unpacklo_epi64(_mm_loadl_epi64(h.cast()), _mm_loadl_epi64(h.add(8).cast()));
                let b = _mm_unpacklo_epi64(
                    _mm_loadl_epi64(h.add(4).cast()),
                    _mm_loadl_epi64(h.add(12).cast()),
                );
                (_mm256_cvtph_ps(a), _mm256_cvtph_ps(b))
            }
            _ => {
                let x = _mm256_loadu_si256(g.cast::<u16>().add(i).cast());
                let z = _mm256_setzero_si256();
                (
                    _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x)),
                    _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x)),
                )
            }
        }
    }
}

/// 16 f32 at `p` in the split order (see [`load16_split`]).
///
/// # Safety
/// AVX is enabled in the caller; `p .. p + 16` is readable.
#[inline(always)]
pub(crate) unsafe fn load16_f32_split(p: *const f32) -> (__m256, __m256) {
    // SAFETY: the caller's bounds; unaligned 16-byte loads.
    unsafe {
        (
            _mm256_loadu2_m128(p.add(8), p),
            _mm256_loadu2_m128(p.add(12), p.add(4)),
        )
    }
}

/// Stores 16 f32 given in the split order at `p` in element order.
///
/// # Safety
/// AVX is enabled in the caller; `p .. p + 16` is writable.
#[inline(always)]
pub(crate) unsafe fn store16_f32_split(p: *mut f32, (a, b): (__m256, __m256)) {
    // SAFETY: the caller's bounds; unaligned 16-byte stores.
    unsafe {
        _mm256_storeu2_m128(p.add(8), p, a);
        _mm256_storeu2_m128(p.add(12), p.add(4), b);
    }
}

/// Stores 16 values given in the split order at `out` as bf16 (round to nearest even,
/// NaN quieted), in element order: one pack, one 32-byte store.
///
/// # Safety
/// AVX2 is enabled in the caller; `out .. out + 16` is writable.
#[inline(always)]
pub(crate) unsafe fn store16_bf16_split(out: *mut u16, (a, b): (__m256, __m256)) {
    // SAFETY: the caller's bounds; packus keeps 0..=0xFFFF unchanged.
    unsafe {
        let packed = _mm256_packus_epi32(bf16_bits8(a), bf16_bits8(b));
        _mm256_storeu_si256(out.cast(), packed);
    }
}

/// Stores 16 values given in the split order at `out` as the `OK` dtype.
///
/// # Safety
/// AVX2 and F16C are enabled in the caller; `out .. out + 16` is writable (unless
/// `OK == O_NONE`).
#[inline(always)]
pub(crate) unsafe fn store16_out_split<const OK: u8>(out: *mut u16, ab: (__m256, __m256)) {
    // SAFETY: the caller's bounds.
    unsafe {
        match OK {
            O_NONE => {}
            O_F16 => {
                // a: elements 0-3 and 8-11, b: 4-7 and 12-15.
                let (a, b) = (_mm256_cvtps_ph::<RNE>(ab.0), _mm256_cvtps_ph::<RNE>(ab.1));
                _mm_storeu_si128(out.cast(), _mm_unpacklo_epi64(a, b));
                _mm_storeu_si128(out.add(8).cast(), _mm_unpackhi_epi64(a, b));
            }
            _ => store16_bf16_split(out, ab),
        }
    }
}

/// `x` with every NaN lane replaced by the canonical NaN (the crate's NaN policy).
///
/// # Safety
/// The CPU supports AVX.
#[inline(always)]
unsafe fn canon8(x: __m256) -> __m256 {
    // SAFETY: register-only AVX intrinsics; the caller's target features include AVX.
    unsafe {
        let nan = _mm256_castsi256_ps(_mm256_set1_epi32(crate::CANONICAL_NAN_BITS as i32));
        _mm256_blendv_ps(x, nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
    }
}

/// The update of 8 lanes, `scalar::adam`'s sequence (every AVX2 step's); `g` is the raw
/// gradient.
///
/// # Safety
/// AVX2 and FMA are enabled in the caller.
#[inline(always)]
pub(crate) unsafe fn adam8<const L2: bool>(
    c: &Consts,
    p: __m256,
    m: __m256,
    v: __m256,
    g: __m256,
) -> (__m256, __m256, __m256) {
    // SAFETY: register-only intrinsics under the caller's features.
    unsafe {
        let g = _mm256_mul_ps(g, _mm256_set1_ps(c.grad_scale));
        let g = if L2 {
            _mm256_fmadd_ps(_mm256_set1_ps(c.wd_l2), p, g)
        } else {
            g
        };
        let m = _mm256_fmadd_ps(
            _mm256_set1_ps(c.beta1),
            m,
            _mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta1), g),
        );
        let gg = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta2), g), g);
        let v = _mm256_fmadd_ps(_mm256_set1_ps(c.beta2), v, gg);
        let d = _mm256_fmadd_ps(
            _mm256_sqrt_ps(v),
            _mm256_set1_ps(c.inv_sqrt_bc2),
            _mm256_set1_ps(c.eps),
        );
        let p = if L2 {
            p
        } else {
            _mm256_fmadd_ps(_mm256_set1_ps(c.neg_lr_wd), p, p)
        };
        let p = _mm256_fmadd_ps(_mm256_set1_ps(c.neg_step), _mm256_div_ps(m, d), p);
        (p, m, v)
    }
}

/// [`canon8`] of each of the three: the fp32-moment step stores canonical NaNs
/// (`scalar::step_from`'s sequence is [`adam8`]'s, then this).
///
/// # Safety
/// AVX is enabled in the caller.
#[inline(always)]
unsafe fn canon3((p, m, v): (__m256, __m256, __m256)) -> (__m256, __m256, __m256) {
    // SAFETY: register-only intrinsics under the caller's features.
    unsafe { (canon8(p), canon8(m), canon8(v)) }
}

/// No software prefetch: on the Zen 4 class VM (forced AVX2, 20M parameters, medians of
/// 7, alternated) the step without it moved 0.89-1.06 of the probe's bytes on one core
/// against 0.85-0.93 with it, and more parameters per second in each pair; the hardware
/// prefetchers follow these unit-stride streams.
#[inline(always)]
unsafe fn step_body<const GK: u8, const OK: u8, const L2: bool>(c: &Consts, s: &StepPtrs) {
    // SAFETY: the wrapper enables AVX2/FMA/F16C; `i + 8 <= s.len` inside the loop and
    // StepPtrs covers `s.len` elements of each array; unaligned loads and stores.
    unsafe {
        let mut i = 0;
        if GK == G_F32 && OK == O_NONE {
            // Nothing 16-bit: 8 elements an iteration, in element order.
            let n8 = s.len - s.len % 8;
            while i < n8 {
                let (p, m, v) = canon3(adam8::<L2>(
                    c,
                    _mm256_loadu_ps(s.p.add(i)),
                    _mm256_loadu_ps(s.m.add(i)),
                    _mm256_loadu_ps(s.v.add(i)),
                    load8::<GK>(s.g, i),
                ));
                _mm256_storeu_ps(s.p.add(i), p);
                _mm256_storeu_ps(s.m.add(i), m);
                _mm256_storeu_ps(s.v.add(i), v);
                i += 8;
            }
        } else {
            // A 16-bit gradient or output: 16 elements an iteration in the split order
            // (see `load16_split`). On the Zen 3 VM (20M parameters, medians of 3 runs
            // alternated with the 8-lane loop) the bf16 path went from 0.81 to 0.90 G
            // parameters/s on one thread and from 1.34 to 1.45 on two.
            let n16 = s.len - s.len % 16;
            while i < n16 {
                let g = load16_split::<GK>(s.g, i);
                let p = load16_f32_split(s.p.add(i));
                let m = load16_f32_split(s.m.add(i));
                let v = load16_f32_split(s.v.add(i));
                let (p0, m0, v0) = canon3(adam8::<L2>(c, p.0, m.0, v.0, g.0));
                let (p1, m1, v1) = canon3(adam8::<L2>(c, p.1, m.1, v.1, g.1));
                store16_f32_split(s.p.add(i), (p0, p1));
                store16_f32_split(s.m.add(i), (m0, m1));
                store16_f32_split(s.v.add(i), (v0, v1));
                store16_out_split::<OK>(s.out.add(i), (p0, p1));
                i += 16;
            }
        }
        scalar::step_from::<GK, OK, L2>(c, s, i);
    }
}

/// AVX2 step kernel.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `s` satisfies the [`StepPtrs`] invariant.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn step<const GK: u8, const OK: u8, const L2: bool>(c: &Consts, s: &StepPtrs) {
    // SAFETY: features enabled by this function; caller's StepPtrs contract.
    unsafe { step_body::<GK, OK, L2>(c, s) }
}

/// AVX2 sum of squares in f64: [`sq_norms`] of one stream.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `g` covers `len` elements of the `GK` dtype.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sq_norm<const GK: u8>(g: *const u8, len: usize) -> f64 {
    // SAFETY: forwarded caller contract.
    unsafe { sq_norms::<GK, 1>([g], len)[0] }
}

/// AVX2 sums of squares in f64 of `K` streams of `len` elements at once, each with two
/// 4-lane accumulators of its own: per stream the bits of [`sq_norm`] of it alone (see
/// [`super::avx512::sq_norms`]).
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; each of `g` covers `len` elements of the `GK`
/// dtype.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sq_norms<const GK: u8, const K: usize>(
    g: [*const u8; K],
    len: usize,
) -> [f64; K] {
    // SAFETY: features enabled here; `i + 8 <= len` for every vector load.
    unsafe {
        let mut a0 = [_mm256_setzero_pd(); K];
        let mut a1 = [_mm256_setzero_pd(); K];
        let n8 = len - len % 8;
        let mut i = 0;
        while i < n8 {
            for s in 0..K {
                // Fetched ahead, as the step's streams are.
                if GK == G_F32 {
                    prefetch(g[s].cast(), i);
                }
                let x = load8::<GK>(g[s], i);
                let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
                let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x));
                a0[s] = _mm256_fmadd_pd(lo, lo, a0[s]);
                a1[s] = _mm256_fmadd_pd(hi, hi, a1[s]);
            }
            i += 8;
        }
        let mut out = [0.0; K];
        for s in 0..K {
            let mut lanes = [0.0f64; 4];
            _mm256_storeu_pd(lanes.as_mut_ptr(), _mm256_add_pd(a0[s], a1[s]));
            out[s] = (lanes[0] + lanes[1])
                + (lanes[2] + lanes[3])
                + scalar::sq_norm_from::<GK>(g[s], n8, len);
        }
        out
    }
}

/// AVX2 finiteness check.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `g` covers `len` elements of the `GK` dtype.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn all_finite<const GK: u8>(g: *const u8, len: usize) -> bool {
    // SAFETY: features enabled here; `i + 8 <= len` for every vector load.
    unsafe {
        let exp = _mm256_set1_epi32(0x7F80_0000);
        let mut bad = _mm256_setzero_si256();
        let n8 = len - len % 8;
        let mut i = 0;
        while i < n8 {
            let x = _mm256_and_si256(_mm256_castps_si256(load8::<GK>(g, i)), exp);
            bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(x, exp));
            i += 8;
        }
        _mm256_testz_si256(bad, bad) == 1 && scalar::finite_from::<GK>(g, n8, len)
    }
}

/// AVX2 `acc = fma(g, scale, acc)`.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `acc` (exclusive) and `g` cover `len` elements.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn accumulate<const GK: u8>(acc: *mut f32, g: *const u8, scale: f32, len: usize) {
    // SAFETY: features enabled here; `i + 8 <= len` for every vector access.
    unsafe {
        let s = _mm256_set1_ps(scale);
        let n8 = len - len % 8;
        let mut i = 0;
        while i < n8 {
            let a = _mm256_fmadd_ps(load8::<GK>(g, i), s, _mm256_loadu_ps(acc.add(i)));
            _mm256_storeu_ps(acc.add(i), a);
            i += 8;
        }
        scalar::accumulate_from::<GK>(acc, g, scale, n8, len);
    }
}

/// AVX2 f32 -> 16-bit cast.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `src` covers `len` f32, `out` (exclusive) `len`
/// 16-bit elements.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn cast<const OK: u8>(src: *const f32, out: *mut u16, len: usize) {
    // SAFETY: features enabled here; `i + 8 <= len` for every vector access.
    unsafe {
        let n8 = len - len % 8;
        let mut i = 0;
        while i < n8 {
            store8_out::<OK>(out, i, _mm256_loadu_ps(src.add(i)));
            i += 8;
        }
        scalar::cast_from::<OK>(src, out, n8, len);
    }
}

/// AVX2 memory probe (see [`scalar::probe_from`]).
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `s` satisfies the [`StepPtrs`] invariant.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn probe<const GK: u8, const OK: u8>(
    s: &StepPtrs,
    one: f32,
    zero: f32,
    pf: bool,
) {
    // SAFETY: features enabled here; `i + 8 <= s.len` for every vector access.
    unsafe {
        let k = _mm256_set1_ps(one);
        let z = _mm256_set1_ps(zero);
        let n8 = s.len - s.len % 8;
        let mut i = 0;
        while i < n8 {
            if pf && i % 16 == 0 {
                prefetch_step::<GK>(s, i);
            }
            let p = _mm256_fmadd_ps(load8::<GK>(s.g, i), z, _mm256_loadu_ps(s.p.add(i)));
            _mm256_storeu_ps(s.p.add(i), p);
            _mm256_storeu_ps(s.m.add(i), _mm256_mul_ps(_mm256_loadu_ps(s.m.add(i)), k));
            _mm256_storeu_ps(s.v.add(i), _mm256_mul_ps(_mm256_loadu_ps(s.v.add(i)), k));
            if OK != O_NONE {
                let h = _mm256_srli_epi32::<16>(_mm256_castps_si256(p));
                let packed = _mm256_packus_epi32(h, h);
                let lo = _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b00_00_10_00>(packed));
                _mm_storeu_si128(s.out.add(i).cast(), lo);
            }
            i += 8;
        }
        scalar::probe_from::<GK, OK>(s, one, zero, n8);
    }
}

/// Copies `len` f32 from `src` to `dst` with non-temporal stores where `dst` is
/// 32-byte aligned (see [`super::avx512::copy_stream`]).
///
/// # Safety
/// The CPU supports AVX; `src` covers `len` f32, `dst` (exclusive, not overlapping
/// `src`) `len` f32.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn copy_stream(src: *const f32, dst: *mut f32, len: usize) {
    // SAFETY: AVX2 enabled here; every access is below `len`; the streamed stores are
    // at `dst + i` with `i` past the head, which makes `dst + i` 32-byte aligned.
    unsafe {
        let head = dst.align_offset(32).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 8 <= len {
            _mm256_stream_ps(dst.add(i), _mm256_loadu_ps(src.add(i)));
            i += 8;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
        _mm_sfence();
    }
}
