//! AVX2 compact kernels, 8 lanes: the update of [`super::super::scalar::adam`] in vector
//! form, int8 blocks dequantized and binary-searched with gathers (AVX2 has no wide
//! permutes), bf16 moments rounded with integer ops. Scalar tails from
//! [`super::scalar`]; results bit-identical to it.

use std::arch::x86_64::*;

use super::super::avx2::{load8, store8_out};
use super::super::raw::{G_BF16, O_BF16};
use super::scalar::{self as cs, Q8Block};
use super::CompactPtrs;
use crate::params::Consts;
use crate::quant::{DynamicMap, Maps, Q8_BLOCK};

/// The update of 8 lanes, `scalar::adam`'s sequence; `g` is the raw gradient.
///
/// # Safety
/// AVX2 and FMA are enabled in the caller.
#[inline(always)]
unsafe fn adam8<const L2: bool>(
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

#[inline(always)]
unsafe fn b16_body<const GK: u8, const OK: u8, const L2: bool>(c: &Consts, s: &CompactPtrs) {
    // SAFETY: the wrapper enables the features; `i + 8 <= s.len` in the loop and the
    // CompactPtrs invariant covers `s.len` elements of every array.
    unsafe {
        let m16 = s.m.cast::<u16>();
        let v16 = s.v.cast::<u16>();
        let n8 = s.len - s.len % 8;
        let mut i = 0;
        while i < n8 {
            let g = load8::<GK>(s.g, i);
            let m = load8::<G_BF16>(m16.cast(), i);
            let v = load8::<G_BF16>(v16.cast(), i);
            let (p, m, v) = adam8::<L2>(c, _mm256_loadu_ps(s.p.add(i)), m, v, g);
            _mm256_storeu_ps(s.p.add(i), p);
            store8_out::<O_BF16>(m16, i, m);
            store8_out::<O_BF16>(v16, i, v);
            store8_out::<OK>(s.out, i, p);
            i += 8;
        }
        cs::b16_from::<GK, OK, L2>(c, s, n8);
    }
}

/// The codes of 8 values `x`: [`DynamicMap::code`]'s binary search, each level's
/// midpoint gathered at `lo + s - 1`.
///
/// # Safety
/// AVX2 is enabled in the caller.
#[inline(always)]
unsafe fn codes8(map: &DynamicMap, x: __m256) -> __m256i {
    // SAFETY: every gathered index is `lo + s - 1 <= 254`, inside `midpoints`.
    unsafe {
        let mid = map.midpoints.as_ptr();
        let mut lo = _mm256_setzero_si256();
        let mut s = 128;
        while s > 0 {
            let t = _mm256_i32gather_ps::<4>(mid, _mm256_add_epi32(lo, _mm256_set1_epi32(s - 1)));
            let gt = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(x, t));
            lo = _mm256_add_epi32(lo, _mm256_and_si256(gt, _mm256_set1_epi32(s)));
            s >>= 1;
        }
        lo
    }
}

/// Writes the codes of `x[j] * r`, `j < len`, at `codes`.
///
/// # Safety
/// AVX2 is enabled in the caller; `codes` covers `len <= Q8_BLOCK` writable bytes.
#[inline(always)]
unsafe fn quantize_block(
    map: &DynamicMap,
    x: &[f32; Q8_BLOCK],
    r: f32,
    codes: *mut u8,
    len: usize,
) {
    // SAFETY: `j + 8 <= len` for every vector access; the tail is scalar.
    unsafe {
        let rv = _mm256_set1_ps(r);
        // Byte 0 of each 32-bit lane into the low 4 bytes of each 128-bit half.
        let pick = _mm256_setr_epi8(
            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1,
            -1, -1, -1, -1, -1, -1, -1, -1, -1,
        );
        let n8 = len - len % 8;
        let mut j = 0;
        while j < n8 {
            let q = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(j)), rv);
            let b = _mm256_shuffle_epi8(codes8(map, q), pick);
            let lo = _mm_cvtsi128_si32(_mm256_castsi256_si128(b)) as u32;
            let hi = _mm_cvtsi128_si32(_mm256_extracti128_si256::<1>(b)) as u32;
            let w = u64::from(lo) | (u64::from(hi) << 32);
            codes.add(j).cast::<u64>().write_unaligned(w);
            j += 8;
        }
        cs::q8_codes_from(map, x, r, codes, n8, len);
    }
}

/// The maximum of the 8 unsigned lanes.
///
/// # Safety
/// AVX2 is enabled in the caller.
#[inline(always)]
unsafe fn hmax(x: __m256i) -> u32 {
    // SAFETY: register-only intrinsics; the transmute reinterprets 256 bits as 8 u32.
    unsafe {
        let a: [u32; 8] = std::mem::transmute(x);
        a.into_iter().max().unwrap_or(0)
    }
}

#[inline(always)]
unsafe fn q8_body<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    q: &Maps,
    s: &CompactPtrs,
) {
    // SAFETY: the wrapper enables the features; every block lies in the span and
    // `b0 + j + 8 <= b0 + len <= s.len` for every vector access (CompactPtrs invariant).
    unsafe {
        let mag = _mm256_set1_epi32(0x7FFF_FFFF);
        let mut b = Q8Block::new();
        let mut b0 = 0;
        while b0 < s.len {
            let blk = b0 / Q8_BLOCK;
            let len = (s.len - b0).min(Q8_BLOCK);
            let n8 = len - len % 8;
            let (am, av) = (*s.ma.add(blk), *s.va.add(blk));
            let (amv, avv) = (_mm256_set1_ps(am), _mm256_set1_ps(av));
            let mut mb = _mm256_setzero_si256();
            let mut vb = _mm256_setzero_si256();
            let mut j = 0;
            while j < n8 {
                let i = b0 + j;
                let mc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(s.m.add(i).cast()));
                let vc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(s.v.add(i).cast()));
                let m = _mm256_i32gather_ps::<4>(q.signed.values.as_ptr(), mc);
                let v = _mm256_i32gather_ps::<4>(q.unsigned.values.as_ptr(), vc);
                let m = _mm256_mul_ps(m, amv);
                let v = _mm256_mul_ps(v, avv);
                let g = load8::<GK>(s.g, i);
                let (p, m, v) = adam8::<L2>(c, _mm256_loadu_ps(s.p.add(i)), m, v, g);
                _mm256_storeu_ps(s.p.add(i), p);
                store8_out::<OK>(s.out, i, p);
                _mm256_storeu_ps(b.m.as_mut_ptr().add(j), m);
                _mm256_storeu_ps(b.v.as_mut_ptr().add(j), v);
                mb = _mm256_max_epu32(mb, _mm256_and_si256(_mm256_castps_si256(m), mag));
                vb = _mm256_max_epu32(vb, _mm256_and_si256(_mm256_castps_si256(v), mag));
                j += 8;
            }
            b.m_bits = hmax(mb);
            b.v_bits = hmax(vb);
            cs::q8_update_from::<GK, OK, L2>(c, q, s, b0, (am, av), n8, len, &mut b);
            let (dm, dv) = cs::q8_store_absmax(s, blk, &b);
            quantize_block(&q.signed, &b.m, dm, s.m.add(b0), len);
            quantize_block(&q.unsigned, &b.v, dv, s.v.add(b0), len);
            b0 += len;
        }
    }
}

/// AVX2 step over bf16 moments.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `s` satisfies the [`CompactPtrs`] invariant for
/// bf16 moments.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn step_b16<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    s: &CompactPtrs,
) {
    // SAFETY: features enabled here; caller's invariant.
    unsafe { b16_body::<GK, OK, L2>(c, s) }
}

/// AVX2 step over int8 moments.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `s` satisfies the [`CompactPtrs`] invariant for
/// int8 moments.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn step_q8<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    q: &Maps,
    s: &CompactPtrs,
) {
    // SAFETY: features enabled here; caller's invariant.
    unsafe { q8_body::<GK, OK, L2>(c, q, s) }
}
