//! AVX-512 compact kernels, 16 lanes, in the two builds of [`super::super::avx512`]
//! (bf16 rounding with integer ops, or with `vcvtneps2bf16` + subnormal fix-up).
//!
//! The update is [`super::super::scalar::adam`]'s operation sequence in vector form; an
//! int8 block is dequantized with register permutes over the 256-entry map (no gathers:
//! they are slow under the Gather Data Sampling mitigation), its absmax is an
//! integer `vpmaxud` over the magnitude bits, and the quantizer's binary search looks
//! each level's midpoints up with register permutes (`vpermps` for levels of at most 16,
//! `vpermt2ps` for 32 and more, blended on the index bits) instead of gathers. Where the
//! CPU has AVX512_VBMI (checked at each call, [`vbmi_supported`]), the int8 step reads
//! and writes 64 codes at a time with byte permutes and quantizes by one bucket lookup
//! and one compare ([`vbmi`]). Measured on the 2-core Zen 5 VM (`adamw-bench --path
//! m-int8`, 20M params, 1 thread, medians of 3 alternated rounds under load 4): 0.48 ->
//! 1.06 G params/s; in cache (200K params) 0.61-0.76 -> 1.20-1.24. With the quantizer's
//! compare against `midpoints[code]` (see [`vbmi`]): 32K params (in L2), medians of 31,
//! 1.30-1.32 -> 1.56-1.76 G params/s; 100M params, 1 thread, 97-104 -> 81-85 ms per step
//! (load 2-3). The kernel is bound by its own work, not by memory: even in L2 it reaches
//! about half of the parameter rate the memory probe allows out of cache, and about half
//! of its time in cache is requantization (measured by leaving it out). Scalar tails from
//! [`super::scalar`]; results bit-identical to it.

use std::arch::x86_64::*;

use super::super::avx512::{load16, out_streamable, store16_out};
use super::super::raw::{G_BF16, G_F32, O_BF16};
use super::super::x86::prefetch;
use super::avx2::{flip16, prefetch_probe};
use super::scalar::{self as cs, Q8Block};
use super::CompactPtrs;
use crate::params::Consts;
use crate::quant::{DynamicMap, Maps, Q8_BLOCK};

mod vbmi;

/// The broadcast constants of the update.
struct Vc {
    gs: __m512,
    b1: __m512,
    omb1: __m512,
    b2: __m512,
    omb2: __m512,
    wd: __m512,
    neg_lr_wd: __m512,
    neg_step: __m512,
    isb2: __m512,
    eps: __m512,
}

impl Vc {
    /// # Safety
    /// AVX-512F is enabled in the caller.
    #[inline(always)]
    unsafe fn new(c: &Consts) -> Vc {
        // SAFETY: register-only intrinsics under the caller's AVX-512F.
        unsafe {
            Vc {
                gs: _mm512_set1_ps(c.grad_scale),
                b1: _mm512_set1_ps(c.beta1),
                omb1: _mm512_set1_ps(c.one_minus_beta1),
                b2: _mm512_set1_ps(c.beta2),
                omb2: _mm512_set1_ps(c.one_minus_beta2),
                wd: _mm512_set1_ps(c.wd_l2),
                neg_lr_wd: _mm512_set1_ps(c.neg_lr_wd),
                neg_step: _mm512_set1_ps(c.neg_step),
                isb2: _mm512_set1_ps(c.inv_sqrt_bc2),
                eps: _mm512_set1_ps(c.eps),
            }
        }
    }
}

/// The update of 16 lanes, `scalar::adam`'s sequence; `g` is the raw gradient.
///
/// # Safety
/// AVX-512F and FMA are enabled in the caller.
#[inline(always)]
unsafe fn adam16<const L2: bool>(
    k: &Vc,
    p: __m512,
    m: __m512,
    v: __m512,
    g: __m512,
) -> (__m512, __m512, __m512) {
    // SAFETY: register-only intrinsics under the caller's features.
    unsafe {
        let g = _mm512_mul_ps(g, k.gs);
        let g = if L2 { _mm512_fmadd_ps(k.wd, p, g) } else { g };
        let m = _mm512_fmadd_ps(k.b1, m, _mm512_mul_ps(k.omb1, g));
        let gg = _mm512_mul_ps(_mm512_mul_ps(k.omb2, g), g);
        let v = _mm512_fmadd_ps(k.b2, v, gg);
        let d = _mm512_fmadd_ps(_mm512_sqrt_ps(v), k.isb2, k.eps);
        let p = if L2 {
            p
        } else {
            _mm512_fmadd_ps(k.neg_lr_wd, p, p)
        };
        let p = _mm512_fmadd_ps(k.neg_step, _mm512_div_ps(m, d), p);
        (p, m, v)
    }
}

#[inline(always)]
unsafe fn b16_body<const GK: u8, const OK: u8, const L2: bool, const HW: bool>(
    c: &Consts,
    s: &CompactPtrs,
) {
    // SAFETY: the wrapper enables the features; `i + 16 <= s.len` in the loop and the
    // CompactPtrs invariant covers `s.len` elements of every array.
    unsafe {
        let k = Vc::new(c);
        let m16 = s.m.cast::<u16>();
        let v16 = s.v.cast::<u16>();
        let n16 = s.len - s.len % 16;
        let nt = out_streamable::<OK>(s.out);
        let mut i = 0;
        while i < n16 {
            prefetch(s.p, i);
            prefetch(m16.cast(), i / 2);
            prefetch(v16.cast(), i / 2);
            if GK == G_F32 {
                prefetch(s.g.cast(), i);
            }
            let g = load16::<GK>(s.g, i);
            let m = load16::<G_BF16>(m16.cast(), i);
            let v = load16::<G_BF16>(v16.cast(), i);
            let (p, m, v) = adam16::<L2>(&k, _mm512_loadu_ps(s.p.add(i)), m, v, g);
            _mm512_storeu_ps(s.p.add(i), p);
            store16_out::<O_BF16, HW>(m16, i, m, false);
            store16_out::<O_BF16, HW>(v16, i, v, false);
            store16_out::<OK, HW>(s.out, i, p, nt);
            i += 16;
        }
        if nt {
            _mm_sfence();
        }
        cs::b16_from::<GK, OK, L2>(c, s, n16);
    }
}

/// Loads 16 floats of a level table at offset `o`.
///
/// # Safety
/// AVX-512F is enabled in the caller; `o + 16 <= 256`.
#[inline(always)]
unsafe fn ld(lv: *const f32, o: usize) -> __m512 {
    // SAFETY: in bounds of the 256-entry `levels` table by the caller's contract.
    unsafe { _mm512_loadu_ps(lv.add(o)) }
}

/// The 32-entry table at offset `o`, looked up by the low 5 bits of `j`.
///
/// # Safety
/// AVX-512F is enabled in the caller; `o + 32 <= 256`.
#[inline(always)]
unsafe fn t32(lv: *const f32, o: usize, j: __m512i) -> __m512 {
    // SAFETY: as `ld`, twice.
    unsafe { _mm512_permutex2var_ps(ld(lv, o), j, ld(lv, o + 16)) }
}

/// One binary-search step: `lo += s` where `x > t`.
///
/// # Safety
/// AVX-512F is enabled in the caller.
#[inline(always)]
unsafe fn bstep(lo: __m512i, x: __m512, t: __m512, s: i32) -> __m512i {
    // SAFETY: register-only intrinsics.
    unsafe {
        let gt = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, t);
        _mm512_mask_add_epi32(lo, gt, lo, _mm512_set1_epi32(s))
    }
}

/// The 256-entry table at `t` looked up at the 16 indices `idx` (`0..256`) with register
/// permutes: eight 32-entry `vpermt2ps` lookups blended on index bits 5, 6 and 7. A
/// gather does this in one instruction but is several times slower on CPUs with the
/// Gather Data Sampling mitigation.
///
/// # Safety
/// AVX-512F is enabled in the caller; `t` points to 256 readable floats.
#[inline(always)]
unsafe fn lookup256(t: *const f32, idx: __m512i) -> __m512 {
    // SAFETY: every table load reads 16 floats inside the 256.
    unsafe {
        let b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
        let b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
        let b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
        let q0 = _mm512_mask_blend_ps(b5, t32(t, 0, idx), t32(t, 32, idx));
        let q1 = _mm512_mask_blend_ps(b5, t32(t, 64, idx), t32(t, 96, idx));
        let q2 = _mm512_mask_blend_ps(b5, t32(t, 128, idx), t32(t, 160, idx));
        let q3 = _mm512_mask_blend_ps(b5, t32(t, 192, idx), t32(t, 224, idx));
        let h0 = _mm512_mask_blend_ps(b6, q0, q1);
        let h1 = _mm512_mask_blend_ps(b6, q2, q3);
        _mm512_mask_blend_ps(b7, h0, h1)
    }
}

/// The codes of 16 values `x` (already divided by the absmax): the branch-free binary
/// search of [`DynamicMap::code`], level `l` looked up at `lo >> (8 - l)` in
/// `map.levels[2^l - 1..]`.
///
/// # Safety
/// AVX-512F is enabled in the caller.
#[inline(always)]
unsafe fn codes16(map: &DynamicMap, x: __m512) -> __m512i {
    let lv = map.levels.as_ptr();
    // SAFETY: every table load reads 16 floats inside `levels` (the last at 239..255).
    unsafe {
        let mut lo = _mm512_setzero_si512();
        lo = bstep(lo, x, _mm512_set1_ps(*lv), 128);
        let t = _mm512_permutexvar_ps(_mm512_srli_epi32::<7>(lo), ld(lv, 1));
        lo = bstep(lo, x, t, 64);
        let t = _mm512_permutexvar_ps(_mm512_srli_epi32::<6>(lo), ld(lv, 3));
        lo = bstep(lo, x, t, 32);
        let t = _mm512_permutexvar_ps(_mm512_srli_epi32::<5>(lo), ld(lv, 7));
        lo = bstep(lo, x, t, 16);
        let t = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(lo), ld(lv, 15));
        lo = bstep(lo, x, t, 8);
        lo = bstep(lo, x, t32(lv, 31, _mm512_srli_epi32::<3>(lo)), 4);
        let j = _mm512_srli_epi32::<2>(lo);
        let b5 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(32));
        let t = _mm512_mask_blend_ps(b5, t32(lv, 63, j), t32(lv, 95, j));
        lo = bstep(lo, x, t, 2);
        let j = _mm512_srli_epi32::<1>(lo);
        let b5 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(32));
        let b6 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(64));
        let low = _mm512_mask_blend_ps(b5, t32(lv, 127, j), t32(lv, 159, j));
        let high = _mm512_mask_blend_ps(b5, t32(lv, 191, j), t32(lv, 223, j));
        bstep(lo, x, _mm512_mask_blend_ps(b6, low, high), 1)
    }
}

/// [`codes16`] for four vectors at once, level by level, so that the four searches'
/// dependency chains (a permute, a compare and a masked add per level) overlap instead
/// of each waiting on its own latency; `lv[k]` is the level table for `x[k]`.
///
/// # Safety
/// AVX-512F is enabled in the caller; every `lv[k]` points to a 256-entry level table.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn codes16x4(lv: [*const f32; 4], x: [__m512; 4]) -> [__m512i; 4] {
    // SAFETY: every table load reads 16 floats inside `levels` (the last at 239..255).
    unsafe {
        let mut lo = [_mm512_setzero_si512(); 4];
        for k in 0..4 {
            lo[k] = bstep(lo[k], x[k], _mm512_set1_ps(*lv[k]), 128);
        }
        for k in 0..4 {
            let t = _mm512_permutexvar_ps(_mm512_srli_epi32::<7>(lo[k]), ld(lv[k], 1));
            lo[k] = bstep(lo[k], x[k], t, 64);
        }
        for k in 0..4 {
            let t = _mm512_permutexvar_ps(_mm512_srli_epi32::<6>(lo[k]), ld(lv[k], 3));
            lo[k] = bstep(lo[k], x[k], t, 32);
        }
        for k in 0..4 {
            let t = _mm512_permutexvar_ps(_mm512_srli_epi32::<5>(lo[k]), ld(lv[k], 7));
            lo[k] = bstep(lo[k], x[k], t, 16);
        }
        for k in 0..4 {
            let t = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(lo[k]), ld(lv[k], 15));
            lo[k] = bstep(lo[k], x[k], t, 8);
        }
        for k in 0..4 {
            lo[k] = bstep(
                lo[k],
                x[k],
                t32(lv[k], 31, _mm512_srli_epi32::<3>(lo[k])),
                4,
            );
        }
        for k in 0..4 {
            let j = _mm512_srli_epi32::<2>(lo[k]);
            let b5 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(32));
            let t = _mm512_mask_blend_ps(b5, t32(lv[k], 63, j), t32(lv[k], 95, j));
            lo[k] = bstep(lo[k], x[k], t, 2);
        }
        for k in 0..4 {
            let j = _mm512_srli_epi32::<1>(lo[k]);
            let b5 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(32));
            let b6 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(64));
            let low = _mm512_mask_blend_ps(b5, t32(lv[k], 127, j), t32(lv[k], 159, j));
            let high = _mm512_mask_blend_ps(b5, t32(lv[k], 191, j), t32(lv[k], 223, j));
            lo[k] = bstep(lo[k], x[k], _mm512_mask_blend_ps(b6, low, high), 1);
        }
        lo
    }
}

/// Writes the codes of the block's new moments, `b.m[j] * rm` at `mc + j` and
/// `b.v[j] * rv` at `vc + j` for `from <= j < len`: with `VB`, 64 elements of each per
/// iteration through [`vbmi::codes64`]; then 32 through [`codes16x4`], 16 at a time, and
/// the scalar tail.
///
/// # Safety
/// AVX-512F (and with `VB`, AVX512BW and AVX512_VBMI) is enabled in the caller; `mc`
/// and `vc` cover `len <= Q8_BLOCK` writable bytes; `from` is a multiple of 64 (of 16
/// without `VB`) and at most `len`.
#[inline(always)]
unsafe fn quantize_pair<const VB: bool>(
    q: &Maps,
    b: &Q8Block,
    (rm, rv): (f32, f32),
    (mc, vc): (*mut u8, *mut u8),
    len: usize,
) {
    // SAFETY: `j + 64 <= n64`, `j + 32 <= n32` and `j + 16 <= n16 <= len` for the vector
    // accesses; the VBMI helpers' features are the caller's.
    unsafe {
        let (rmv, rvv) = (_mm512_set1_ps(rm), _mm512_set1_ps(rv));
        let (sl, ul) = (q.signed.levels.as_ptr(), q.unsigned.levels.as_ptr());
        let ldm = |j: usize| _mm512_mul_ps(_mm512_loadu_ps(b.m.as_ptr().add(j)), rmv);
        let ldv = |j: usize| _mm512_mul_ps(_mm512_loadu_ps(b.v.as_ptr().add(j)), rvv);
        let n16 = len - len % 16;
        let n32 = len - len % 32;
        let mut j = 0;
        if VB {
            let n64 = len - len % 64;
            while j < n64 {
                let x4 = |ld: &dyn Fn(usize) -> __m512| [ld(j), ld(j + 16), ld(j + 32), ld(j + 48)];
                vbmi::store_codes64(&q.signed, x4(&ldm), rm, mc.add(j));
                vbmi::store_codes64(&q.unsigned, x4(&ldv), rv, vc.add(j));
                j += 64;
            }
        }
        while j < n32 {
            let c = codes16x4([sl, sl, ul, ul], [ldm(j), ldm(j + 16), ldv(j), ldv(j + 16)]);
            _mm_storeu_si128(mc.add(j).cast(), _mm512_cvtepi32_epi8(c[0]));
            _mm_storeu_si128(mc.add(j + 16).cast(), _mm512_cvtepi32_epi8(c[1]));
            _mm_storeu_si128(vc.add(j).cast(), _mm512_cvtepi32_epi8(c[2]));
            _mm_storeu_si128(vc.add(j + 16).cast(), _mm512_cvtepi32_epi8(c[3]));
            j += 32;
        }
        if j < n16 {
            _mm_storeu_si128(
                mc.add(j).cast(),
                _mm512_cvtepi32_epi8(codes16(&q.signed, ldm(j))),
            );
            _mm_storeu_si128(
                vc.add(j).cast(),
                _mm512_cvtepi32_epi8(codes16(&q.unsigned, ldv(j))),
            );
        }
        cs::q8_codes_from(&q.signed, &b.m, rm, mc, n16, len);
        cs::q8_codes_from(&q.unsigned, &b.v, rv, vc, n16, len);
    }
}

/// The block's broadcast state in phase 1: the update's constants, the old absmax
/// values, and the running integer maxima of the new moments' magnitudes.
struct Phase1 {
    k: Vc,
    amv: __m512,
    avv: __m512,
    mb: __m512i,
    vb: __m512i,
}

/// Phase 1 of 16 elements (block offset `j`, span offset `i`) whose old moments were
/// dequantized to map values `(mq, vq)` (not yet scaled by the absmax).
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C are enabled in the caller; `i + 16 <= s.len`, `j + 16 <=
/// Q8_BLOCK` (CompactPtrs invariant).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn update16<const GK: u8, const OK: u8, const L2: bool, const HW: bool>(
    st: &mut Phase1,
    s: &CompactPtrs,
    (i, j): (usize, usize),
    (mq, vq): (__m512, __m512),
    nt: bool,
    b: &mut Q8Block,
) {
    // SAFETY: bounds and features from the caller.
    unsafe {
        let mag = _mm512_set1_epi32(0x7FFF_FFFF);
        prefetch(s.p, i);
        if GK == G_F32 {
            prefetch(s.g.cast(), i);
        }
        let m = _mm512_mul_ps(mq, st.amv);
        let v = _mm512_mul_ps(vq, st.avv);
        let g = load16::<GK>(s.g, i);
        let (p, m, v) = adam16::<L2>(&st.k, _mm512_loadu_ps(s.p.add(i)), m, v, g);
        _mm512_storeu_ps(s.p.add(i), p);
        store16_out::<OK, HW>(s.out, i, p, nt);
        _mm512_storeu_ps(b.m.as_mut_ptr().add(j), m);
        _mm512_storeu_ps(b.v.as_mut_ptr().add(j), v);
        st.mb = _mm512_max_epu32(st.mb, _mm512_and_si512(_mm512_castps_si512(m), mag));
        st.vb = _mm512_max_epu32(st.vb, _mm512_and_si512(_mm512_castps_si512(v), mag));
    }
}

/// The int8 step. `VB`: the AVX512_VBMI form (byte-permute dequantization of 64 codes
/// at a time and the bucket quantizer), else register permutes over f32 tables and the
/// binary search; both give the same bits.
#[inline(always)]
unsafe fn q8_body<const GK: u8, const OK: u8, const L2: bool, const HW: bool, const VB: bool>(
    c: &Consts,
    q: &Maps,
    s: &CompactPtrs,
) {
    // SAFETY: the wrapper enables the features; every block lies in the span and
    // `b0 + j + 64 <= b0 + len <= s.len` (resp. 16) for every vector access
    // (CompactPtrs invariant).
    unsafe {
        let nt = out_streamable::<OK>(s.out);
        let mut st = Phase1 {
            k: Vc::new(c),
            amv: _mm512_setzero_ps(),
            avv: _mm512_setzero_ps(),
            mb: _mm512_setzero_si512(),
            vb: _mm512_setzero_si512(),
        };
        let mut b = Q8Block::new();
        let mut b0 = 0;
        while b0 < s.len {
            let blk = b0 / Q8_BLOCK;
            let len = (s.len - b0).min(Q8_BLOCK);
            let n16 = len - len % 16;
            let n64 = if VB { len - len % 64 } else { 0 };
            let (am, av) = (*s.ma.add(blk), *s.va.add(blk));
            (st.amv, st.avv) = (_mm512_set1_ps(am), _mm512_set1_ps(av));
            st.mb = _mm512_setzero_si512();
            st.vb = _mm512_setzero_si512();
            let mut j = 0;
            while j < n64 {
                let i = b0 + j;
                let mq = vbmi::values64(&q.signed, s.m.add(i));
                let vq = vbmi::values64(&q.unsigned, s.v.add(i));
                for t in 0..4 {
                    let ij = (i + 16 * t, j + 16 * t);
                    update16::<GK, OK, L2, HW>(&mut st, s, ij, (mq[t], vq[t]), nt, &mut b);
                }
                j += 64;
            }
            while j < n16 {
                let i = b0 + j;
                let mc = _mm512_cvtepu8_epi32(_mm_loadu_si128(s.m.add(i).cast()));
                let vc = _mm512_cvtepu8_epi32(_mm_loadu_si128(s.v.add(i).cast()));
                let mq = lookup256(q.signed.values.as_ptr(), mc);
                let vq = lookup256(q.unsigned.values.as_ptr(), vc);
                update16::<GK, OK, L2, HW>(&mut st, s, (i, j), (mq, vq), nt, &mut b);
                j += 16;
            }
            b.m_bits = _mm512_reduce_max_epu32(st.mb);
            b.v_bits = _mm512_reduce_max_epu32(st.vb);
            cs::q8_update_from::<GK, OK, L2>(c, q, s, b0, (am, av), n16, len, &mut b);
            let r = cs::q8_store_absmax(s, blk, &b);
            quantize_pair::<VB>(q, &b, r, (s.m.add(b0), s.v.add(b0)), len);
            b0 += len;
        }
        if nt {
            _mm_sfence();
        }
    }
}

/// AVX-512F step over bf16 moments.
///
/// # Safety
/// The CPU supports AVX-512F, AVX2, FMA and F16C; `s` satisfies the [`CompactPtrs`]
/// invariant for bf16 moments.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn step_b16<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    s: &CompactPtrs,
) {
    // SAFETY: features enabled here; caller's invariant.
    unsafe { b16_body::<GK, OK, L2, false>(c, s) }
}

/// AVX-512F + AVX512_BF16 step over bf16 moments.
///
/// # Safety
/// As [`step_b16`], and the CPU supports AVX512_BF16.
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
pub(crate) unsafe fn step_b16_bf16<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    s: &CompactPtrs,
) {
    // SAFETY: features enabled here; caller's invariant.
    unsafe { b16_body::<GK, OK, L2, true>(c, s) }
}

/// AVX-512F step over int8 moments.
///
/// # Safety
/// The CPU supports AVX-512F, AVX2, FMA and F16C; `s` satisfies the [`CompactPtrs`]
/// invariant for int8 moments.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn step_q8<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    q: &Maps,
    s: &CompactPtrs,
) {
    // SAFETY: features enabled here; caller's invariant.
    unsafe { q8_body::<GK, OK, L2, false, false>(c, q, s) }
}

/// AVX-512F + AVX512_BF16 step over int8 moments.
///
/// # Safety
/// As [`step_q8`], and the CPU supports AVX512_BF16.
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
pub(crate) unsafe fn step_q8_bf16<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    q: &Maps,
    s: &CompactPtrs,
) {
    // SAFETY: features enabled here; caller's invariant.
    unsafe { q8_body::<GK, OK, L2, true, false>(c, q, s) }
}

/// AVX-512F + AVX512_VBMI step over int8 moments.
///
/// # Safety
/// As [`step_q8`], and the CPU supports AVX512BW and AVX512_VBMI.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,fma,f16c")]
pub(crate) unsafe fn step_q8_vbmi<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    q: &Maps,
    s: &CompactPtrs,
) {
    // SAFETY: features enabled here; caller's invariant.
    unsafe { q8_body::<GK, OK, L2, false, true>(c, q, s) }
}

/// AVX-512F + AVX512_BF16 + AVX512_VBMI step over int8 moments.
///
/// # Safety
/// As [`step_q8_bf16`], and the CPU supports AVX512BW and AVX512_VBMI.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bf16,avx2,fma,f16c")]
pub(crate) unsafe fn step_q8_vbmi_bf16<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    q: &Maps,
    s: &CompactPtrs,
) {
    // SAFETY: features enabled here; caller's invariant.
    unsafe { q8_body::<GK, OK, L2, true, true>(c, q, s) }
}

/// True when this CPU runs the VBMI int8 kernels (AVX512BW and AVX512_VBMI, on top of
/// an AVX-512 level); they give the same bits as the others, only faster.
pub(crate) fn vbmi_supported() -> bool {
    is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vbmi")
}

/// AVX-512 compact memory probe (see [`cs::probe_from`]): 16 elements per iteration,
/// their `16 * w` moment bytes loaded, xored with `flip` and stored back with one vector
/// each.
///
/// # Safety
/// The CPU supports AVX-512F, AVX2, FMA and F16C; the bounds of [`cs::probe_from`].
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn probe<const GK: u8, const OK: u8>(
    s: &CompactPtrs,
    w: usize,
    zero: f32,
    flip: u8,
    pf: bool,
) {
    // SAFETY: features enabled here; `i + 16 <= s.len` for every vector access, and the
    // moments' `16 * w` bytes from byte `w * i` are in bounds.
    unsafe {
        let z = _mm512_set1_ps(zero);
        let f = _mm256_set1_epi8(flip as i8);
        let n16 = s.len - s.len % 16;
        let nt = out_streamable::<OK>(s.out);
        let mut i = 0;
        while i < n16 {
            if pf {
                prefetch_probe::<GK>(s, w, i);
            }
            let p = _mm512_fmadd_ps(load16::<GK>(s.g, i), z, _mm512_loadu_ps(s.p.add(i)));
            _mm512_storeu_ps(s.p.add(i), p);
            flip16(s.m.add(w * i), w, f);
            flip16(s.v.add(w * i), w, f);
            store16_out::<OK, false>(s.out, i, p, nt);
            i += 16;
        }
        if nt {
            _mm_sfence();
        }
        cs::probe_from::<GK, OK>(s, w, (zero, flip), n16);
    }
}

#[cfg(test)]
mod tests {
    //! Where the CPU has AVX512_VBMI, the step always takes the VBMI kernels, so the
    //! kernels' proptests never run the plain AVX-512 int8 kernel (which CPUs without
    //! VBMI run); this runs it against the scalar kernel directly.

    use super::*;
    use crate::params::{HyperParams, StepState};
    use crate::quant::{absmax_len, maps};

    /// splitmix64.
    fn next(s: &mut u64) -> u64 {
        *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    struct Span {
        p: Vec<f32>,
        m: Vec<u8>,
        v: Vec<u8>,
        ma: Vec<f32>,
        va: Vec<f32>,
        g: Vec<u16>,
        out: Vec<u16>,
    }

    impl Span {
        fn new(n: usize, seed: u64) -> Span {
            let mut s = seed;
            let mut unit = || (next(&mut s) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            let nb = absmax_len(n);
            Span {
                p: (0..n).map(|_| unit()).collect(),
                m: (0..n).map(|i| (i * 37 % 256) as u8).collect(),
                v: (0..n).map(|i| (i * 91 % 256) as u8).collect(),
                ma: (0..nb).map(|k| 1e-3 * (1.0 + k as f32)).collect(),
                va: (0..nb).map(|k| 1e-6 * (1.0 + k as f32)).collect(),
                g: (0..n)
                    .map(|_| half::bf16::from_f32(1e-2 * unit()).to_bits())
                    .collect(),
                out: vec![0; n],
            }
        }

        fn ptrs(&mut self) -> CompactPtrs {
            CompactPtrs {
                p: self.p.as_mut_ptr(),
                m: self.m.as_mut_ptr(),
                v: self.v.as_mut_ptr(),
                ma: self.ma.as_mut_ptr(),
                va: self.va.as_mut_ptr(),
                g: self.g.as_ptr().cast(),
                out: self.out.as_mut_ptr(),
                len: self.p.len(),
            }
        }
    }

    #[test]
    fn the_plain_avx512_int8_kernels_equal_the_scalar_one() {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            eprintln!("skipped: this CPU lacks AVX-512F");
            return;
        }
        let bf16_hw = is_x86_feature_detected!("avx512bf16");
        let c = Consts::new(StepState::new(7), &HyperParams::default()).unwrap();
        let q = maps();
        // Whole blocks, a block with a 64-, 16- and scalar tail, one short block.
        for (n, seed) in [(1024, 1), (3 * 256 + 64 + 16 + 7, 2), (41, 3)] {
            let mut want = Span::new(n, seed);
            // SAFETY: every pointer covers `n` elements (absmax_len(n) for the absmax),
            // exclusively; the features were checked above.
            unsafe { cs::step_q8::<G_BF16, O_BF16, false>(&c, q, &want.ptrs()) };
            for hw in [false, true] {
                if hw && !bf16_hw {
                    continue;
                }
                let mut got = Span::new(n, seed);
                // SAFETY: as above; AVX512_BF16 checked for the `hw` kernel.
                unsafe {
                    if hw {
                        step_q8_bf16::<G_BF16, O_BF16, false>(&c, q, &got.ptrs());
                    } else {
                        step_q8::<G_BF16, O_BF16, false>(&c, q, &got.ptrs());
                    }
                }
                let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                let label = format!("n = {n}, hw = {hw}");
                assert_eq!(bits(&got.p), bits(&want.p), "master, {label}");
                assert_eq!(got.m, want.m, "m codes, {label}");
                assert_eq!(got.v, want.v, "v codes, {label}");
                assert_eq!(bits(&got.ma), bits(&want.ma), "m absmax, {label}");
                assert_eq!(bits(&got.va), bits(&want.va), "v absmax, {label}");
                assert_eq!(got.out, want.out, "output, {label}");
            }
        }
    }
}
