//! AVX2 compact kernels, 8 lanes: the update of [`super::super::scalar::adam`] in vector
//! form, bf16 moments rounded with integer ops, int8 blocks dequantized with scalar
//! loads of the map values and quantized with one gather per 8 values
//! ([`crate::quant::KeyTable`]: the entry of each value's top 16 bits and one integer
//! compare; AVX2 has no wide permutes). Table lookups bound the int8 kernel: on the Zen
//! 4 class development VM one 8-lane `vpgatherdd` takes about 3.5 ns, eight scalar loads
//! from code bytes 1.6-3.0 ns, and the kernel about 2 ns per parameter in L2 (four
//! lookups per 8 values of each moment pair). Scalar tails from [`super::scalar`];
//! results bit-identical to it.

use std::arch::x86_64::*;

use super::super::avx2::{
    adam8, load16_f32_split, load16_split, store16_bf16_split, store16_f32_split,
    store16_out_split, store8_out,
};
use super::super::raw::{G_BF16, G_F32, O_NONE};
use super::super::x86::{load8, prefetch};
use super::scalar::{self as cs, Q8Block};
use super::CompactPtrs;
use crate::params::Consts;
use crate::quant::{DynamicMap, KeyTable, Maps, Q8_BLOCK};

#[inline(always)]
unsafe fn b16_body<const GK: u8, const OK: u8, const L2: bool>(c: &Consts, s: &CompactPtrs) {
    // SAFETY: the wrapper enables the features; `i + 16 <= s.len` in the loop and the
    // CompactPtrs invariant covers `s.len` elements of every array.
    unsafe {
        let m16 = s.m.cast::<u16>();
        let v16 = s.v.cast::<u16>();
        let n16 = s.len - s.len % 16;
        let mut i = 0;
        // 16 elements an iteration in the split order (see `load16_split`). On the
        // Zen 3 VM (20M parameters, medians of 3 runs alternated with the 8-lane loop)
        // 0.87 -> 0.96 G parameters/s on one thread, 1.57 -> 1.73 on two.
        while i < n16 {
            let g = load16_split::<GK>(s.g, i);
            let m = load16_split::<G_BF16>(m16.cast(), i);
            let v = load16_split::<G_BF16>(v16.cast(), i);
            let p = load16_f32_split(s.p.add(i));
            let (p0, m0, v0) = adam8::<L2>(c, p.0, m.0, v.0, g.0);
            let (p1, m1, v1) = adam8::<L2>(c, p.1, m.1, v.1, g.1);
            store16_f32_split(s.p.add(i), (p0, p1));
            store16_bf16_split(m16.add(i), (m0, m1));
            store16_bf16_split(v16.add(i), (v0, v1));
            store16_out_split::<OK>(s.out.add(i), (p0, p1));
            i += 16;
        }
        cs::b16_from::<GK, OK, L2>(c, s, n16);
    }
}

/// The broadcast constants of one map's [`KeyTable`] lookups.
struct KeyConsts {
    entries: *const i32,
    lo: __m256i,
    hi: __m256i,
    per_sign: __m256i,
}

impl KeyConsts {
    /// # Safety
    /// AVX2 is enabled in the caller.
    #[inline(always)]
    unsafe fn new(t: &KeyTable) -> KeyConsts {
        // SAFETY: register-only intrinsics; the table's bounds are i32-sized (asserted).
        unsafe {
            let per_sign = i32::try_from(t.per_sign).expect("a small table");
            KeyConsts {
                entries: t.entries.as_ptr().cast(),
                lo: _mm256_set1_epi32(i32::from(t.lo)),
                hi: _mm256_set1_epi32(i32::from(t.hi)),
                per_sign: _mm256_set1_epi32(per_sign),
            }
        }
    }
}

/// The codes of 8 values `x` (none NaN) in the 32-bit lanes: [`DynamicMap::code_by_key`]
/// with one gather of the key table's entries and one integer compare.
///
/// # Safety
/// AVX2 is enabled in the caller; `k` was built from a live [`KeyTable`].
#[inline(always)]
unsafe fn codes8(k: &KeyConsts, x: __m256) -> __m256i {
    // SAFETY: the clamped key minus `lo` is below `per_sign`, plus `per_sign` for a
    // negative lane: every gathered index is inside the `2 * per_sign` entries.
    unsafe {
        let b = _mm256_castps_si256(x);
        let neg = _mm256_srai_epi32::<31>(b);
        let mag = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x7FFF));
        let key = _mm256_min_epi32(_mm256_max_epi32(mag, k.lo), k.hi);
        let idx = _mm256_add_epi32(
            _mm256_sub_epi32(key, k.lo),
            _mm256_and_si256(neg, k.per_sign),
        );
        let e = _mm256_i32gather_epi32::<4>(k.entries, idx);
        let low = _mm256_set1_epi32(0xFFFF);
        let t = _mm256_and_si256(_mm256_xor_si256(b, neg), low);
        let above = _mm256_cmpgt_epi32(t, _mm256_srli_epi32::<8>(e));
        _mm256_sub_epi32(_mm256_and_si256(e, _mm256_set1_epi32(0xFF)), above)
    }
}

/// Stores the 32 codes `c` (in the 32-bit lanes of four vectors, in element order) as 32
/// bytes at `out`.
///
/// # Safety
/// AVX2 is enabled in the caller; `out` covers 32 writable bytes; every lane is 0..=255.
#[inline(always)]
unsafe fn store_codes32(c: [__m256i; 4], out: *mut u8) {
    // SAFETY: the caller's bounds; the packs saturate nothing as the lanes fit a byte.
    unsafe {
        // Per 128-bit half: words of c0, c1 (then c2, c3), bytes of c0, c1, c2, c3.
        let w01 = _mm256_packus_epi32(c[0], c[1]);
        let w23 = _mm256_packus_epi32(c[2], c[3]);
        let b = _mm256_packus_epi16(w01, w23);
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        _mm256_storeu_si256(out.cast(), _mm256_permutevar8x32_epi32(b, order));
    }
}

/// Writes the codes of the block's new moments, `b.m[j] * rm` at `mc + j` and
/// `b.v[j] * rv` at `vc + j` for `j < len`, 32 of each per iteration (M and V
/// interleaved, so the two maps' gathers overlap), the rest through the scalar
/// quantizer. A NaN inverse (a block holding inf or NaN) gives code 0 throughout, as the
/// binary search does for NaN.
///
/// # Safety
/// AVX2 is enabled in the caller; `mc` and `vc` cover `len <= Q8_BLOCK` writable bytes.
#[inline(always)]
unsafe fn quantize_pair(
    q: &Maps,
    b: &Q8Block,
    (rm, rv): (f32, f32),
    (mc, vc): (*mut u8, *mut u8),
    len: usize,
) {
    // SAFETY: `j + 32 <= n32 <= len` for every vector access.
    unsafe {
        let (km, kv) = (
            KeyConsts::new(&q.signed.keys),
            KeyConsts::new(&q.unsigned.keys),
        );
        let (rmv, rvv) = (_mm256_set1_ps(rm), _mm256_set1_ps(rv));
        let n32 = len - len % 32;
        let mut j = 0;
        while j < n32 {
            let (pm, pv) = (b.m.as_ptr().add(j), b.v.as_ptr().add(j));
            let mut cm = [_mm256_setzero_si256(); 4];
            let mut cv = [_mm256_setzero_si256(); 4];
            for t in 0..4 {
                cm[t] = codes8(&km, _mm256_mul_ps(_mm256_loadu_ps(pm.add(8 * t)), rmv));
                cv[t] = codes8(&kv, _mm256_mul_ps(_mm256_loadu_ps(pv.add(8 * t)), rvv));
            }
            store_codes32(cm, mc.add(j));
            store_codes32(cv, vc.add(j));
            j += 32;
        }
        if rm.is_nan() {
            std::ptr::write_bytes(mc, 0, n32);
        }
        if rv.is_nan() {
            std::ptr::write_bytes(vc, 0, n32);
        }
        cs::q8_codes_from(&q.signed, &b.m, rm, mc, n32, len);
        cs::q8_codes_from(&q.unsigned, &b.v, rv, vc, n32, len);
    }
}

/// The map values of the 8 codes at `codes`: eight scalar loads, which on the Zen 4
/// class development VM took 1.6-3.0 ns per 8 against 3.3-3.9 for one `vpgatherdd`
/// (a micro-benchmark, under load).
///
/// # Safety
/// AVX is enabled in the caller; `codes` points to 8 readable bytes.
#[inline(always)]
unsafe fn values8(map: &DynamicMap, codes: *const u8) -> __m256 {
    // SAFETY: 8 code bytes by the caller; every code indexes the 256 values.
    unsafe {
        let v = |k: usize| map.values[usize::from(*codes.add(k))];
        _mm256_setr_ps(v(0), v(1), v(2), v(3), v(4), v(5), v(6), v(7))
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
                let m = values8(&q.signed, s.m.add(i));
                let v = values8(&q.unsigned, s.v.add(i));
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
            let r = cs::q8_store_absmax(s, blk, &b);
            quantize_pair(q, &b, r, (s.m.add(b0), s.v.add(b0)), len);
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

/// Stores the top 16 bits of the 8 f32 `p` at `out + i` (the probe's output: its bytes,
/// not a rounding).
///
/// # Safety
/// AVX2 is enabled in the caller; `out + i .. out + i + 8` is writable.
#[inline(always)]
unsafe fn store8_top16(out: *mut u16, i: usize, p: __m256) {
    // SAFETY: features and bounds from the caller; unaligned 16-byte store.
    unsafe {
        let h = _mm256_srli_epi32::<16>(_mm256_castps_si256(p));
        let packed = _mm256_packus_epi32(h, h);
        let lo = _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b00_00_10_00>(packed));
        _mm_storeu_si128(out.add(i).cast(), lo);
    }
}

/// Loads the `16 * w` moment bytes at `p`, xors them with `f` and stores them back: one
/// 32-byte vector for bf16 (`w == 2`), one 16-byte vector for int8 codes.
///
/// # Safety
/// AVX2 is enabled in the caller; `p` covers `16 * w` writable bytes, `w` is 1 or 2.
#[inline(always)]
pub(super) unsafe fn flip16(p: *mut u8, w: usize, f: __m256i) {
    // SAFETY: the caller's bounds; unaligned loads and stores.
    unsafe {
        if w == 2 {
            _mm256_storeu_si256(p.cast(), _mm256_xor_si256(_mm256_loadu_si256(p.cast()), f));
        } else {
            let f = _mm256_castsi256_si128(f);
            _mm_storeu_si128(p.cast(), _mm_xor_si128(_mm_loadu_si128(p.cast()), f));
        }
    }
}

/// Prefetches what a compact probe moves at element `i` (moments of `w` bytes an
/// element): every stream the steps prefetch, and the gradient's too.
#[inline(always)]
pub(super) fn prefetch_probe<const GK: u8>(s: &CompactPtrs, w: usize, i: usize) {
    prefetch(s.p, i);
    prefetch(s.m.cast(), w * i / 4);
    prefetch(s.v.cast(), w * i / 4);
    prefetch(s.g.cast(), if GK == G_F32 { i } else { i / 2 });
}

/// AVX2 compact memory probe (see [`cs::probe_from`]): 16 elements per iteration, master
/// and output as two 8-lane vectors, the `16 * w` bytes of each moment with one vector,
/// as the AVX-512 probe moves them; prefetching the streams as the steps do when `pf`.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; the bounds of [`cs::probe_from`].
#[target_feature(enable = "avx2,fma,f16c")]
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
        let z = _mm256_set1_ps(zero);
        let f = _mm256_set1_epi8(flip as i8);
        let n16 = s.len - s.len % 16;
        let mut i = 0;
        while i < n16 {
            if pf {
                prefetch_probe::<GK>(s, w, i);
            }
            for k in [i, i + 8] {
                let p = _mm256_fmadd_ps(load8::<GK>(s.g, k), z, _mm256_loadu_ps(s.p.add(k)));
                _mm256_storeu_ps(s.p.add(k), p);
                if OK != O_NONE {
                    store8_top16(s.out, k, p);
                }
            }
            flip16(s.m.add(w * i), w, f);
            flip16(s.v.add(w * i), w, f);
            i += 16;
        }
        cs::probe_from::<GK, OK>(s, w, (zero, flip), n16);
    }
}
