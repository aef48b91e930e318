//! The int8 map lookups of the AVX-512 kernel with byte permutes (AVX512_VBMI), 64
//! elements at a time.
//!
//! A 256- or 512-entry f32 table is kept as four byte planes ([`crate::quant::Planes`]);
//! `vpermi2b` looks a plane up for 64 byte indices at once (128 entries per instruction,
//! blended on index bits 7 and 8), and byte unpacks put the four planes back together
//! as four vectors of 16 f32. The unpacks work inside 128-bit lanes, so the indices are
//! first arranged in [`P_ORDER`], which makes the four results come out as elements
//! 0..16, 16..32, 32..48, 48..64. The quantizer is [`crate::quant::BucketTables`]'s
//! lookup: the bucket of each value from its top 16 bits (16-bit lanes), then the
//! bucket's code `c` and the midpoint `midpoints[c]` (a 256-entry table, not one per
//! bucket), one compare, one masked add. Results are bit-identical
//! to the binary search (tests below, and the kernels' proptests at every level).

use std::arch::x86_64::*;

use crate::quant::{DynamicMap, Planes, BUCKET_KEY_MAX, BUCKET_KEY_MIN};

/// The byte index of element `n = 16t + 4l + u` (vector `t`, 128-bit lane `l`, dword
/// `u`) among the 16-bit lanes of two packed vectors `(w01, w23)` (`w01` holds vectors 0
/// and 1 after `vpackssdw`: per 128-bit lane, 4 words of vector 0 then 4 of vector 1),
/// as a `vpermt2b` index; `+ 1` picks the word's high byte.
const fn packed_byte(n: usize) -> u8 {
    let (t, l, u) = (n / 16, (n / 4) % 4, n % 4);
    ((t >> 1) * 64 + 16 * l + (t & 1) * 8 + 2 * u) as u8
}

/// The element whose byte sits at position `q = 16l + 4t + u` in the order the unpack
/// reassembly reads: `16t + 4l + u`.
const fn p_element(q: usize) -> usize {
    let (l, t, u) = (q / 16, (q / 4) % 4, q % 4);
    16 * t + 4 * l + u
}

/// Which index vector [`table`] builds.
#[derive(Clone, Copy)]
enum Kind {
    POrder,
    LoElem,
    HiElem,
}

const fn table(kind: Kind) -> Idx {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = match kind {
            Kind::POrder => p_element(i) as u8,
            Kind::LoElem => packed_byte(i),
            Kind::HiElem => packed_byte(i) + 1,
        };
        i += 1;
    }
    Idx(t)
}

/// 64-byte aligned index vector.
#[repr(C, align(64))]
struct Idx([u8; 64]);

/// `vpermb` index putting 64 bytes in element order into the reassembly order.
static P_ORDER: Idx = table(Kind::POrder);
/// Low / high bytes of the packed bucket words, in element order.
static LO_ELEM: Idx = table(Kind::LoElem);
static HI_ELEM: Idx = table(Kind::HiElem);

/// # Safety
/// AVX-512F; `p` points to 64 readable bytes.
#[inline(always)]
unsafe fn ld(p: *const u8) -> __m512i {
    // SAFETY: the caller's bounds.
    unsafe { _mm512_loadu_si512(p.cast()) }
}

/// A 256-entry byte plane at `t` looked up at the 64 indices `c` (bit 7 given as `b7`).
///
/// # Safety
/// AVX-512F, AVX512BW, AVX512_VBMI; `t` points to 256 readable bytes.
#[inline(always)]
unsafe fn plane256(t: *const u8, c: __m512i, b7: __mmask64) -> __m512i {
    // SAFETY: four 64-byte loads inside the plane; register-only permutes.
    unsafe {
        let lo = _mm512_permutex2var_epi8(ld(t), c, ld(t.add(64)));
        let hi = _mm512_permutex2var_epi8(ld(t.add(128)), c, ld(t.add(192)));
        _mm512_mask_blend_epi8(b7, lo, hi)
    }
}

/// A 512-entry byte plane at `t` looked up at the 64 indices whose low bytes are `c`
/// and whose bits 7 and 8 are `b7`, `b8`.
///
/// # Safety
/// AVX-512F, AVX512BW, AVX512_VBMI; `t` points to 512 readable bytes.
#[inline(always)]
unsafe fn plane512(t: *const u8, c: __m512i, b7: __mmask64, b8: __mmask64) -> __m512i {
    // SAFETY: as `plane256`, twice.
    unsafe {
        let lo = plane256(t, c, b7);
        let hi = plane256(t.add(256), c, b7);
        _mm512_mask_blend_epi8(b8, lo, hi)
    }
}

/// Four byte planes (in reassembly order) put back together: the f32 of elements
/// `16t..16t + 16` in vector `t`.
///
/// # Safety
/// AVX-512F, AVX512BW.
#[inline(always)]
unsafe fn assemble(b: [__m512i; 4]) -> [__m512; 4] {
    // SAFETY: register-only unpacks.
    unsafe {
        let l01 = _mm512_unpacklo_epi8(b[0], b[1]);
        let h01 = _mm512_unpackhi_epi8(b[0], b[1]);
        let l23 = _mm512_unpacklo_epi8(b[2], b[3]);
        let h23 = _mm512_unpackhi_epi8(b[2], b[3]);
        [
            _mm512_castsi512_ps(_mm512_unpacklo_epi16(l01, l23)),
            _mm512_castsi512_ps(_mm512_unpackhi_epi16(l01, l23)),
            _mm512_castsi512_ps(_mm512_unpacklo_epi16(h01, h23)),
            _mm512_castsi512_ps(_mm512_unpackhi_epi16(h01, h23)),
        ]
    }
}

/// The entries of the 256-entry f32 table `planes` at the 64 byte indices `c` (element
/// order), as four vectors in element order.
///
/// # Safety
/// AVX-512F, AVX512BW, AVX512_VBMI.
#[inline(always)]
unsafe fn lookup64(planes: &Planes<256>, c: __m512i) -> [__m512; 4] {
    // SAFETY: each plane has 256 bytes; the index vector 64.
    unsafe {
        let c = _mm512_permutexvar_epi8(ld(P_ORDER.0.as_ptr()), c);
        let b7 = _mm512_movepi8_mask(c);
        let p = &planes.0;
        assemble([
            plane256(p[0].as_ptr(), c, b7),
            plane256(p[1].as_ptr(), c, b7),
            plane256(p[2].as_ptr(), c, b7),
            plane256(p[3].as_ptr(), c, b7),
        ])
    }
}

/// The map values of the 64 codes at `codes` (not scaled by the absmax), as four
/// vectors in element order.
///
/// # Safety
/// AVX-512F, AVX512BW, AVX512_VBMI; `codes` points to 64 readable bytes.
#[inline(always)]
pub(super) unsafe fn values64(map: &DynamicMap, codes: *const u8) -> [__m512; 4] {
    // SAFETY: 64 code bytes by the caller.
    unsafe { lookup64(&map.value_planes, ld(codes)) }
}

/// The buckets of 32 values given as their top 16 bits `w` (16-bit lanes), as
/// [`crate::quant::BucketTables::bucket`] computes them.
///
/// # Safety
/// AVX-512F, AVX512BW.
#[inline(always)]
unsafe fn buckets32(map: &DynamicMap, w: __m512i) -> __m512i {
    let t = &map.buckets;
    // SAFETY: the 32-entry u16 tables are 64 bytes each; register-only otherwise.
    unsafe {
        let (kmin, kmax) = (
            _mm512_set1_epi16(BUCKET_KEY_MIN as i16),
            _mm512_set1_epi16(BUCKET_KEY_MAX as i16),
        );
        let key = match t.mirror {
            Some(_) => {
                let mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7FFF));
                _mm512_min_epu16(_mm512_max_epu16(mag, kmin), kmax)
            }
            // Signed compare: a negative value's key (sign bit set) takes the minimum.
            None => _mm512_min_epi16(_mm512_max_epi16(w, kmin), kmax),
        };
        let e = _mm512_srli_epi16::<7>(key);
        let off = _mm512_permutexvar_epi16(e, ld(t.off.as_ptr().cast()));
        let sh = _mm512_permutexvar_epi16(e, ld(t.shift.as_ptr().cast()));
        let g = _mm512_add_epi16(off, _mm512_srlv_epi16(key, sh));
        match t.mirror {
            Some(mirror) => {
                let neg = _mm512_movepi16_mask(w);
                _mm512_mask_sub_epi16(g, neg, _mm512_set1_epi16(mirror as i16), g)
            }
            None => g,
        }
    }
}

/// The codes of 64 values `x` (already divided by the absmax, none NaN), in element
/// order: `c + (x > midpoints[c])` with `c = code[b]` for each value's bucket `b` (see
/// [`DynamicMap::midpoint_planes`] for why `midpoints[c]` decides as `mid[b]` does).
///
/// # Safety
/// AVX-512F, AVX512BW, AVX512_VBMI.
#[inline(always)]
unsafe fn codes64(map: &DynamicMap, x: [__m512; 4]) -> __m512i {
    let t = &map.buckets;
    // SAFETY: table loads inside the 512-entry code plane, the 256-entry midpoint planes
    // and the 64-byte index vectors.
    unsafe {
        let top = |v: __m512| _mm512_srai_epi32::<16>(_mm512_castps_si512(v));
        // Exact: every dword is in i16 range after the arithmetic shift.
        let w01 = buckets32(map, _mm512_packs_epi32(top(x[0]), top(x[1])));
        let w23 = buckets32(map, _mm512_packs_epi32(top(x[2]), top(x[3])));
        let pick = |i: &Idx| _mm512_permutex2var_epi8(w01, ld(i.0.as_ptr()), w23);
        let (lo, hi) = (pick(&LO_ELEM), pick(&HI_ELEM));
        let (b7, b8) = (
            _mm512_movepi8_mask(lo),
            _mm512_test_epi8_mask(hi, _mm512_set1_epi8(1)),
        );
        let base = plane512(t.code.0.as_ptr(), lo, b7, b8);
        let mid = lookup64(&map.midpoint_planes, base);
        let gt = |k: usize| u64::from(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(x[k], mid[k]));
        let above = gt(0) | gt(1) << 16 | gt(2) << 32 | gt(3) << 48;
        _mm512_mask_sub_epi8(base, above, base, _mm512_set1_epi8(-1))
    }
}

/// Stores the codes of the 64 values `x * r`, given as `x * r` already (`r` the block's
/// inverse absmax, NaN for a block holding inf or NaN, whose codes are all 0).
///
/// # Safety
/// AVX-512F, AVX512BW, AVX512_VBMI; `out` points to 64 writable bytes.
#[inline(always)]
pub(super) unsafe fn store_codes64(map: &DynamicMap, x: [__m512; 4], r: f32, out: *mut u8) {
    // SAFETY: 64 bytes at `out` by the caller; features forwarded.
    unsafe {
        let c = if r.is_nan() {
            _mm512_setzero_si512()
        } else {
            codes64(map, x)
        };
        _mm512_storeu_si512(out.cast(), c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::maps;

    fn vbmi() -> bool {
        let ok = super::super::vbmi_supported() && is_x86_feature_detected!("avx512f");
        if !ok {
            eprintln!("skipped: this CPU lacks AVX512BW / AVX512_VBMI");
        }
        ok
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn codes_of(map: &DynamicMap, x: &[f32; 64]) -> [u8; 64] {
        let mut out = [0u8; 64];
        // SAFETY: features enabled; 64 floats read, 64 bytes written.
        unsafe {
            let v = |k: usize| _mm512_loadu_ps(x.as_ptr().add(16 * k));
            codes64_store(map, [v(0), v(1), v(2), v(3)], out.as_mut_ptr());
        }
        out
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn codes64_store(map: &DynamicMap, x: [__m512; 4], out: *mut u8) {
        // SAFETY: forwarded.
        unsafe { _mm512_storeu_si512(out.cast(), codes64(map, x)) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn values_of(map: &DynamicMap, c: &[u8; 64]) -> [f32; 64] {
        let mut out = [0f32; 64];
        // SAFETY: features enabled; 64 bytes read, 64 floats written.
        unsafe {
            let v = values64(map, c.as_ptr());
            for (k, x) in v.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(16 * k), *x);
            }
        }
        out
    }

    /// splitmix64, enough for test inputs.
    fn next(s: &mut u64) -> u64 {
        *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[test]
    fn values64_reads_every_code_in_place() {
        if !vbmi() {
            return;
        }
        let q = maps();
        let mut s = 7u64;
        for map in [&q.signed, &q.unsigned] {
            for round in 0..64 {
                let mut c = [0u8; 64];
                for (i, b) in c.iter_mut().enumerate() {
                    *b = if round == 0 {
                        (4 * i) as u8
                    } else {
                        next(&mut s) as u8
                    };
                }
                // SAFETY: vbmi() checked the features.
                let v = unsafe { values_of(map, &c) };
                for i in 0..64 {
                    assert_eq!(v[i].to_bits(), map.value(c[i]).to_bits(), "element {i}");
                }
            }
        }
    }

    #[test]
    fn codes64_equals_the_binary_search() {
        if !vbmi() {
            return;
        }
        let q = maps();
        let mut s = 11u64;
        for map in [&q.signed, &q.unsigned] {
            let mut cases: Vec<f32> = Vec::new();
            for &m in &map.midpoints[..255] {
                for d in 0..3 {
                    cases.push(f32::from_bits(m.to_bits() + d));
                    cases.push(f32::from_bits(m.to_bits() - d));
                }
            }
            cases.extend(map.values);
            for _ in 0..20_000 {
                let r = next(&mut s);
                // Magnitudes 2^-40 .. 2, either sign, and the raw bit patterns near 1.
                let e = (r % 41) as i32 - 40;
                let m = 1.0 + (r >> 20) as f32 / (1u64 << 44) as f32;
                let sign = if r & 1 == 1 { -1.0 } else { 1.0 };
                cases.push(sign * m * 2f32.powi(e));
            }
            cases.extend([0.0, -0.0, 1.0, -1.0, 1.0000001, -1.0000001, 1.5, -1.99]);
            while !cases.len().is_multiple_of(64) {
                cases.push(0.5);
            }
            for chunk in cases.chunks(64) {
                let x: &[f32; 64] = chunk.try_into().unwrap();
                // SAFETY: vbmi() checked the features.
                let c = unsafe { codes_of(map, x) };
                for i in 0..64 {
                    assert_eq!(c[i], map.code(x[i]), "x = {:e}", x[i]);
                }
            }
        }
    }
}
