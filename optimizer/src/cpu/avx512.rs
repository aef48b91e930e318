//! AVX-512 kernels, 16 lanes, in two builds: AVX-512F only (bf16 output rounded with
//! integer ops) and AVX-512F + AVX512_BF16 (`vcvtneps2bf16`).
//!
//! Same structure and arithmetic as [`super::avx2`]: `#[target_feature]` wrappers around
//! `#[inline(always)]` bodies evaluating the operation sequence of
//! [`super::scalar::adam`], scalar tails, bit-identical results. `vcvtneps2bf16` rounds
//! to nearest even like `half` but flushes subnormal inputs to signed zero, so a vector
//! holding any subnormal lane takes the integer rounding instead (exact for all lanes).

use std::arch::x86_64::*;

use super::raw::{StepPtrs, G_F16, G_F32, O_F16, O_NONE};
use super::scalar;
use super::x86::{load8, prefetch, prefetch_step, RNE};
use crate::params::Consts;

/// Loads 16 gradient elements of the `GK` dtype at `g + i` as f32 (exact; bf16 by a
/// 16-bit left shift of the zero-extended bits).
///
/// # Safety
/// AVX-512F is enabled in the caller; elements `i..i + 16` are in bounds.
#[inline(always)]
pub(crate) unsafe fn load16<const GK: u8>(g: *const u8, i: usize) -> __m512 {
    // SAFETY: the caller guarantees AVX-512F and that 16 elements (32 or 64 bytes) from
    // element `i` are readable; all loads are unaligned ones.
    unsafe {
        match GK {
            G_F32 => _mm512_loadu_ps(g.cast::<f32>().add(i)),
            G_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(g.cast::<u16>().add(i).cast())),
            _ => {
                let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(g.cast::<u16>().add(i).cast()));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
            }
        }
    }
}

/// 16 f32 to bf16 bits with integer ops, bit-identical to `half::bf16::from_f32` (see
/// [`super::avx2::bf16_bits8`] for the method).
///
/// # Safety
/// AVX-512F is enabled in the caller.
#[inline(always)]
unsafe fn bf16_int16(p: __m512) -> __m256i {
    // SAFETY: register-only intrinsics; the caller guarantees AVX-512F.
    unsafe {
        let x = _mm512_castps_si512(p);
        let abs = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFF_FFFF));
        let is_nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
        let hi = _mm512_srli_epi32::<16>(x);
        let lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
        let biased = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), lsb);
        let rounded = _mm512_srli_epi32::<16>(biased);
        let nan = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan))
    }
}

/// 16 f32 to bf16 bits with `vcvtneps2bf16`, falling back to [`bf16_int16`] when a lane
/// is subnormal (the instruction would flush it to zero; `half` rounds it).
///
/// # Safety
/// AVX-512F and AVX512_BF16 are enabled in the caller.
#[inline(always)]
unsafe fn bf16_hw16(p: __m512) -> __m256i {
    // SAFETY: register-only intrinsics; the caller guarantees AVX-512F + AVX512_BF16.
    // `__m256bh` and `__m256i` are both 256-bit vectors, so the transmute reinterprets
    // the 16 bf16 results as 16 u16 lanes.
    unsafe {
        let x = _mm512_castps_si512(p);
        let exp_zero = _mm512_testn_epi32_mask(x, _mm512_set1_epi32(0x7F80_0000));
        let man_nonzero = _mm512_test_epi32_mask(x, _mm512_set1_epi32(0x007F_FFFF));
        if exp_zero & man_nonzero != 0 {
            bf16_int16(p)
        } else {
            std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(p))
        }
    }
}

/// Stores 16 16-bit values at `out + i`: non-temporal when `nt` (the output is never
/// read by the step, so streaming it skips the read-for-ownership of its lines).
///
/// # Safety
/// AVX-512F is enabled in the caller; `out + i .. + 16` is writable; when `nt`,
/// `out + i` is 32-byte aligned.
#[inline(always)]
unsafe fn store16_bits(out: *mut u16, i: usize, h: __m256i, nt: bool) {
    // SAFETY: bounds and alignment from the caller.
    unsafe {
        if nt {
            _mm256_stream_si256(out.add(i).cast(), h);
        } else {
            _mm256_storeu_si256(out.add(i).cast(), h);
        }
    }
}

/// Stores `p` as 16 16-bit values of the `OK` dtype at `out + i` (see [`store16_bits`]).
///
/// # Safety
/// AVX-512F (and AVX512_BF16 when `HW`) are enabled in the caller; `out + i .. + 16` is
/// writable; when `nt`, `out + i` is 32-byte aligned.
#[inline(always)]
pub(crate) unsafe fn store16_out<const OK: u8, const HW: bool>(
    out: *mut u16,
    i: usize,
    p: __m512,
    nt: bool,
) {
    if OK == O_NONE {
        return;
    }
    // SAFETY: features, bounds and alignment from the caller.
    unsafe {
        let h = if OK == O_F16 {
            _mm512_cvtps_ph::<RNE>(p)
        } else if HW {
            bf16_hw16(p)
        } else {
            bf16_int16(p)
        };
        store16_bits(out, i, h, nt);
    }
}

/// Whether a 16-bit output at `out` can be streamed (32-byte aligned, so every
/// 16-element store from it is too).
#[inline(always)]
pub(crate) fn out_streamable<const OK: u8>(out: *mut u16) -> bool {
    OK != O_NONE && out.addr().is_multiple_of(32)
}

/// `x` with every NaN lane replaced by the canonical NaN (the crate's NaN policy).
///
/// # Safety
/// The CPU supports AVX-512F.
#[inline(always)]
unsafe fn canon16(x: __m512) -> __m512 {
    // SAFETY: register-only AVX-512F intrinsics; the caller's target features include it.
    unsafe {
        let nan = _mm512_castsi512_ps(_mm512_set1_epi32(crate::CANONICAL_NAN_BITS as i32));
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x), x, nan)
    }
}

#[inline(always)]
unsafe fn step_body<const GK: u8, const OK: u8, const L2: bool, const HW: bool>(
    c: &Consts,
    s: &StepPtrs,
) {
    // SAFETY: the wrapper enables the features; `i + 16 <= s.len` inside the loop and
    // StepPtrs covers `s.len` elements of each array; unaligned loads and stores.
    unsafe {
        let gs = _mm512_set1_ps(c.grad_scale);
        let b1 = _mm512_set1_ps(c.beta1);
        let omb1 = _mm512_set1_ps(c.one_minus_beta1);
        let b2 = _mm512_set1_ps(c.beta2);
        let omb2 = _mm512_set1_ps(c.one_minus_beta2);
        let wd = _mm512_set1_ps(c.wd_l2);
        let neg_lr_wd = _mm512_set1_ps(c.neg_lr_wd);
        let neg_step = _mm512_set1_ps(c.neg_step);
        let isb2 = _mm512_set1_ps(c.inv_sqrt_bc2);
        let eps = _mm512_set1_ps(c.eps);
        let n16 = s.len - s.len % 16;
        let nt = out_streamable::<OK>(s.out);
        let mut i = 0;
        while i < n16 {
            prefetch_step::<GK>(s, i);
            let g = _mm512_mul_ps(load16::<GK>(s.g, i), gs);
            let p = _mm512_loadu_ps(s.p.add(i));
            let g = if L2 { _mm512_fmadd_ps(wd, p, g) } else { g };
            let m = _mm512_fmadd_ps(b1, _mm512_loadu_ps(s.m.add(i)), _mm512_mul_ps(omb1, g));
            let gg = _mm512_mul_ps(_mm512_mul_ps(omb2, g), g);
            let v = _mm512_fmadd_ps(b2, _mm512_loadu_ps(s.v.add(i)), gg);
            let d = _mm512_fmadd_ps(_mm512_sqrt_ps(v), isb2, eps);
            let p = if L2 {
                p
            } else {
                _mm512_fmadd_ps(neg_lr_wd, p, p)
            };
            let p = _mm512_fmadd_ps(neg_step, _mm512_div_ps(m, d), p);
            let (p, m, v) = (canon16(p), canon16(m), canon16(v));
            _mm512_storeu_ps(s.p.add(i), p);
            _mm512_storeu_ps(s.m.add(i), m);
            _mm512_storeu_ps(s.v.add(i), v);
            store16_out::<OK, HW>(s.out, i, p, nt);
            i += 16;
        }
        if nt {
            // Order the streamed stores before anything this thread does next (the join
            // that hands the block back is then enough for other threads).
            _mm_sfence();
        }
        scalar::step_from::<GK, OK, L2>(c, s, n16);
    }
}

/// AVX-512F step kernel.
///
/// # Safety
/// The CPU supports AVX-512F, AVX2, FMA and F16C; `s` satisfies the [`StepPtrs`]
/// invariant.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn step<const GK: u8, const OK: u8, const L2: bool>(c: &Consts, s: &StepPtrs) {
    // SAFETY: features enabled by this function; caller's StepPtrs contract.
    unsafe { step_body::<GK, OK, L2, false>(c, s) }
}

/// AVX-512F + AVX512_BF16 step kernel.
///
/// # Safety
/// The CPU supports AVX-512F, AVX512_BF16, AVX2, FMA and F16C; `s` satisfies the
/// [`StepPtrs`] invariant.
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
pub(crate) unsafe fn step_bf16<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    s: &StepPtrs,
) {
    // SAFETY: features enabled by this function; caller's StepPtrs contract.
    unsafe { step_body::<GK, OK, L2, true>(c, s) }
}

/// AVX-512 sum of squares in f64 (two 8-lane f64 accumulators): [`sq_norms`] of one
/// stream.
///
/// # Safety
/// The CPU supports AVX-512F, AVX2, FMA and F16C; `g` covers `len` elements of the `GK`
/// dtype.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn sq_norm<const GK: u8>(g: *const u8, len: usize) -> f64 {
    // SAFETY: forwarded caller contract.
    unsafe { sq_norms::<GK, 1>([g], len)[0] }
}

/// AVX-512 sums of squares in f64 of `K` streams of `len` elements at once, each with
/// two 8-lane f64 accumulators of its own: per stream the same additions in the same
/// order as [`sq_norm`] of it alone (the same bits), the `K` streams' memory fetched
/// together (one stream a thread reads DRAM at about two thirds of what several do).
///
/// # Safety
/// The CPU supports AVX-512F, AVX2, FMA and F16C; each of `g` covers `len` elements of
/// the `GK` dtype.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn sq_norms<const GK: u8, const K: usize>(
    g: [*const u8; K],
    len: usize,
) -> [f64; K] {
    // SAFETY: features enabled here; `i + 16 <= len` for both 8-element loads of every
    // stream.
    unsafe {
        let mut a0 = [_mm512_setzero_pd(); K];
        let mut a1 = [_mm512_setzero_pd(); K];
        let n16 = len - len % 16;
        let mut i = 0;
        while i < n16 {
            for s in 0..K {
                // Fetched ahead, as the step's streams are (without it one stream read
                // 20 GB/s from DRAM where the step moves 52).
                if GK == G_F32 {
                    prefetch(g[s].cast(), i);
                }
                let lo = _mm512_cvtps_pd(load8::<GK>(g[s], i));
                let hi = _mm512_cvtps_pd(load8::<GK>(g[s], i + 8));
                a0[s] = _mm512_fmadd_pd(lo, lo, a0[s]);
                a1[s] = _mm512_fmadd_pd(hi, hi, a1[s]);
            }
            i += 16;
        }
        let mut out = [0.0; K];
        for s in 0..K {
            out[s] = _mm512_reduce_add_pd(_mm512_add_pd(a0[s], a1[s]))
                + scalar::sq_norm_from::<GK>(g[s], n16, len);
        }
        out
    }
}

/// AVX-512 finiteness check.
///
/// # Safety
/// The CPU supports AVX-512F, AVX2, FMA and F16C; `g` covers `len` elements of the `GK`
/// dtype.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn all_finite<const GK: u8>(g: *const u8, len: usize) -> bool {
    // SAFETY: features enabled here; `i + 16 <= len` for every vector load.
    unsafe {
        let exp = _mm512_set1_epi32(0x7F80_0000);
        let mut bad: __mmask16 = 0;
        let n16 = len - len % 16;
        let mut i = 0;
        while i < n16 {
            let x = _mm512_and_si512(_mm512_castps_si512(load16::<GK>(g, i)), exp);
            bad |= _mm512_cmpeq_epi32_mask(x, exp);
            i += 16;
        }
        bad == 0 && scalar::finite_from::<GK>(g, n16, len)
    }
}

/// AVX-512 `acc = fma(g, scale, acc)`.
///
/// # Safety
/// The CPU supports AVX-512F, AVX2, FMA and F16C; `acc` (exclusive) and `g` cover `len`
/// elements.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn accumulate<const GK: u8>(acc: *mut f32, g: *const u8, scale: f32, len: usize) {
    // SAFETY: features enabled here; `i + 16 <= len` for every vector access.
    unsafe {
        let s = _mm512_set1_ps(scale);
        let n16 = len - len % 16;
        let mut i = 0;
        while i < n16 {
            let a = _mm512_fmadd_ps(load16::<GK>(g, i), s, _mm512_loadu_ps(acc.add(i)));
            _mm512_storeu_ps(acc.add(i), a);
            i += 16;
        }
        scalar::accumulate_from::<GK>(acc, g, scale, n16, len);
    }
}

#[inline(always)]
unsafe fn cast_body<const OK: u8, const HW: bool>(src: *const f32, out: *mut u16, len: usize) {
    // SAFETY: the wrapper enables the features; `i + 16 <= len` for every vector access.
    unsafe {
        let n16 = len - len % 16;
        let mut i = 0;
        while i < n16 {
            store16_out::<OK, HW>(out, i, _mm512_loadu_ps(src.add(i)), false);
            i += 16;
        }
        scalar::cast_from::<OK>(src, out, n16, len);
    }
}

/// AVX-512F f32 -> 16-bit cast.
///
/// # Safety
/// The CPU supports AVX-512F, AVX2, FMA and F16C; `src` covers `len` f32, `out`
/// (exclusive) `len` 16-bit elements.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn cast<const OK: u8>(src: *const f32, out: *mut u16, len: usize) {
    // SAFETY: features enabled here; forwarded bounds contract.
    unsafe { cast_body::<OK, false>(src, out, len) }
}

/// AVX-512F + AVX512_BF16 f32 -> 16-bit cast.
///
/// # Safety
/// As [`cast`], and the CPU supports AVX512_BF16.
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
pub(crate) unsafe fn cast_bf16<const OK: u8>(src: *const f32, out: *mut u16, len: usize) {
    // SAFETY: features enabled here; forwarded bounds contract.
    unsafe { cast_body::<OK, true>(src, out, len) }
}

/// AVX-512 memory probe (see [`scalar::probe_from`]).
///
/// # Safety
/// The CPU supports AVX-512F, AVX2, FMA and F16C; `s` satisfies the [`StepPtrs`]
/// invariant.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn probe<const GK: u8, const OK: u8>(
    s: &StepPtrs,
    one: f32,
    zero: f32,
    pf: bool,
) {
    // SAFETY: features enabled here; `i + 16 <= s.len` for every vector access.
    unsafe {
        let k = _mm512_set1_ps(one);
        let z = _mm512_set1_ps(zero);
        let n16 = s.len - s.len % 16;
        let nt = out_streamable::<OK>(s.out);
        let mut i = 0;
        while i < n16 {
            if pf {
                prefetch_step::<GK>(s, i);
            }
            let p = _mm512_fmadd_ps(load16::<GK>(s.g, i), z, _mm512_loadu_ps(s.p.add(i)));
            _mm512_storeu_ps(s.p.add(i), p);
            _mm512_storeu_ps(s.m.add(i), _mm512_mul_ps(_mm512_loadu_ps(s.m.add(i)), k));
            _mm512_storeu_ps(s.v.add(i), _mm512_mul_ps(_mm512_loadu_ps(s.v.add(i)), k));
            if OK != O_NONE {
                let h = _mm512_srli_epi32::<16>(_mm512_castps_si512(p));
                store16_bits(s.out, i, _mm512_cvtepi32_epi16(h), nt);
            }
            i += 16;
        }
        if nt {
            _mm_sfence();
        }
        scalar::probe_from::<GK, OK>(s, one, zero, n16);
    }
}

/// Copies `len` f32 from `src` to `dst` with non-temporal stores where `dst` is
/// 64-byte aligned (scalar head and tail): a copy into memory that is not read again
/// soon skips reading its destination into the cache first (a third less memory
/// traffic). Ends with `sfence`, so the stores are ordered before whatever follows.
///
/// # Safety
/// The CPU supports AVX-512F; `src` covers `len` f32, `dst` (exclusive, not
/// overlapping `src`) `len` f32.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn copy_stream(src: *const f32, dst: *mut f32, len: usize) {
    // SAFETY: AVX-512F enabled here; every access is below `len`; the streamed stores
    // are at `dst + i` with `i` past the head, which makes `dst + i` 64-byte aligned.
    unsafe {
        let head = dst.align_offset(64).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 16 <= len {
            _mm512_stream_ps(dst.add(i), _mm512_loadu_ps(src.add(i)));
            i += 16;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
        _mm_sfence();
    }
}
