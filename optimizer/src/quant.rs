//! Block-wise 8-bit dynamic quantization of Adam moments (Dettmers et al., "8-bit
//! Optimizers via Block-wise Quantization", as in bitsandbytes), and the state types.
//!
//! A moment array of `n` elements is stored as `n` one-byte codes and `ceil(n / 256)`
//! fp32 block maxima (`absmax`). Element `i` reads back as `map[code[i]] * absmax[i / 256]`.
//! M uses the **signed** dynamic map, V (never negative) the **unsigned** one; both are
//! bitsandbytes' `create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8)`:
//! for each decade `10^(i-6)`, `i = 0..7`, the midpoints of `linspace(0.1, 1, k + 1)`
//! with `k = 2^i` (signed, both signs) or `2^(i+1)` (unsigned), plus `0` and `1`, sorted.
//! The values are computed here in f64 and rounded once to f32 (bitsandbytes rounds
//! `linspace` in f32 first, so a value may differ from its table in the last bit).
//!
//! Quantization of a block, the definition every kernel (scalar, AVX2, AVX-512, CUDA)
//! implements bit for bit:
//! 1. `absmax` = the largest `|x|` of the block, raised to `f32::MIN_POSITIVE` (2^-126)
//!    when it is smaller but not zero (so its reciprocal is finite); if any element is
//!    inf or NaN, `absmax` is stored as NaN, so the whole block reads back NaN: a
//!    non-finite moment is never hidden (the step applies whatever it is given; the
//!    caller skips overflowed steps).
//! 2. `x * r` with `r = 1 / absmax` (one correctly rounded f32 division per block; `r = 0`
//!    for an all-zero block), an f32 multiplication per element — no per-element
//!    division, which would double the divider's load next to AdamW's own.
//! 3. The code is the number of the map's 255 midpoints (`(map[k] + map[k+1]) / 2`,
//!    rounded to f32) that are strictly below `x * r`: the nearest map value to `x *
//!    r`, ties to the lower one, NaN to code 0. The scalar kernel finds it by an 8-step
//!    branch-free binary search ([`DynamicMap::code`]); the AVX-512 VBMI kernel by one
//!    bucket lookup and one compare ([`DynamicMap::code_by_bucket`], see
//!    [`BucketTables`]); the AVX2 kernel by one gathered entry of a table indexed by
//!    the top 16 bits and one integer compare ([`DynamicMap::code_by_key`], see
//!    [`KeyTable`]) — the same code for every non-NaN input.
//!
//! The quantization error of a finite element is at most half the gap between the two
//! map values around `x / absmax`, times `absmax` (tests check this per block).

use std::sync::OnceLock;

pub use tidestore_dtype::{absmax_len, MomentForm, Q8_BLOCK, Q8_MIN_ELEMENTS};

/// One 8-bit dynamic map and the tables its quantizer searches.
#[derive(Debug)]
pub struct DynamicMap {
    /// The 256 code values, increasing.
    pub values: [f32; 256],
    /// `midpoints[k]` lies between `values[k]` and `values[k + 1]` (255 used, last NaN-free
    /// padding `+inf`).
    pub midpoints: [f32; 256],
    /// The binary search's tables by level: level `l` (`0..8`) starts at `2^l - 1` and
    /// holds `2^l` midpoints, `levels[2^l - 1 + j] = midpoints[(2j + 1) * s - 1]` with
    /// `s = 128 >> l`; the last entry is padding. A SIMD kernel looks up level `l` with
    /// index `lo >> (8 - l)` in a vector permute.
    pub levels: [f32; 256],
    /// The quantizer's bucket tables (one lookup, one compare).
    pub buckets: BucketTables,
    /// The quantizer's key table (one gathered entry, one integer compare).
    pub keys: KeyTable,
    /// `values` split into byte planes (`value_planes.0[b][k]` = byte `b` of `values[k]`,
    /// little-endian) for byte-permute lookups.
    pub value_planes: Planes<256>,
    /// `midpoints` in byte planes: the bucket quantizer's compare reads
    /// `midpoints[code[b]]`, which is `mid[b]` where bucket `b` holds a midpoint and
    /// otherwise a midpoint of a higher bucket (or the `+inf` padding), above every value
    /// of `b`, so the compare is false as with `mid[b] = +inf`.
    pub midpoint_planes: Planes<256>,
}

/// Four byte planes of a table of `N` f32 (plane `b` holds byte `b` of each value),
/// 64-byte aligned so a SIMD kernel loads each 64-byte row whole.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub struct Planes<const N: usize>(pub [[u8; N]; 4]);

impl<const N: usize> Planes<N> {
    fn of(values: &[f32; N]) -> Self {
        let mut p = [[0u8; N]; 4];
        for (k, v) in values.iter().enumerate() {
            for (b, plane) in p.iter_mut().enumerate() {
                plane[k] = v.to_bits().to_le_bytes()[b];
            }
        }
        Planes(p)
    }
}

/// The quantizer as one table entry per 16-bit key: for `x`'s sign and the top 16 bits
/// of `|x|` (clamped to `lo..=hi`), the entry holds the code `c` of the key's lowest
/// value (the midpoints strictly below it) and, when a midpoint `M` lies among the
/// key's values (at most one does: the bucket tables check that no two midpoints share
/// a key), the low 16 bits of `M` in an order that increases with the value (`t(M)`:
/// the bits for a positive `M`, their complement for a negative one), else `0xFFFF`.
/// The code of `x` is `c + (t(x) > t(M))`: within a key the top bits agree and the low
/// bits order the values. `lo` and `hi` are one key below and above every midpoint's
/// magnitude, so a clamped `|x|` lands in a key without a midpoint whose code is the
/// code of `x` (no midpoint lies between `x` and that key).
#[derive(Debug, Clone)]
pub struct KeyTable {
    /// The lowest magnitude key told apart.
    pub lo: u16,
    /// The highest magnitude key told apart.
    pub hi: u16,
    /// Entries per sign: `hi - lo + 1`.
    pub per_sign: usize,
    /// `c | t(M) << 8`; positive keys at `key - lo`, negative at `per_sign + key - lo`.
    pub entries: Vec<u32>,
}

impl KeyTable {
    /// Builds the table for the 255 increasing `midpoints`. Panics if two midpoints
    /// share a key, which the tests of both maps rule out.
    fn build(midpoints: &[f32]) -> KeyTable {
        let mag_key = |m: &f32| (m.abs().to_bits() >> 16) as u16;
        let kmin = midpoints.iter().map(mag_key).min().expect("midpoints");
        let kmax = midpoints.iter().map(mag_key).max().expect("midpoints");
        assert!(
            kmin > 0 && kmax < 0x7F7F,
            "midpoints are finite and not tiny"
        );
        let (lo, hi) = (kmin - 1, kmax + 1);
        let per_sign = usize::from(hi - lo) + 1;
        let mut entries = Vec::with_capacity(2 * per_sign);
        for neg in [false, true] {
            for key in lo..=hi {
                let top = u32::from(key) << 16 | if neg { 0x8000_0000 } else { 0 };
                let lowest = f32::from_bits(if neg { top | 0xFFFF } else { top });
                let c = midpoints.iter().filter(|&&m| m < lowest).count();
                let inside: Vec<u32> = midpoints
                    .iter()
                    .map(|m| m.to_bits())
                    .filter(|b| b >> 16 == top >> 16)
                    .collect();
                assert!(inside.len() <= 1, "two midpoints share the key {top:#x}");
                let t = inside.first().map_or(0xFFFF, |&b| {
                    assert_eq!(midpoints[c].to_bits(), b, "the key's midpoint is next");
                    if neg {
                        !b & 0xFFFF
                    } else {
                        b & 0xFFFF
                    }
                });
                entries.push(u32::try_from(c).expect("at most 255") | t << 8);
            }
        }
        KeyTable {
            lo,
            hi,
            per_sign,
            entries,
        }
    }

    /// The entry index of `x` (see the type's documentation).
    #[inline(always)]
    pub fn index(&self, x: f32) -> usize {
        let b = x.to_bits();
        let key = ((b >> 16) as u16 & 0x7FFF).clamp(self.lo, self.hi);
        usize::from(key - self.lo) + if b >> 31 == 1 { self.per_sign } else { 0 }
    }
}

/// A 64-byte aligned byte table.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub struct Bytes<const N: usize>(pub [u8; N]);

/// Number of buckets a map's quantizer may use (indices fit in 9 bits).
pub const BUCKETS_MAX: usize = 512;

/// The key of the smallest magnitude the buckets tell apart: the top 16 bits of 2^-26
/// (every smaller magnitude shares its bucket; no midpoint of either map is that small).
pub const BUCKET_KEY_MIN: u16 = (101 << 7) as u16;

/// The key of the largest magnitude the buckets tell apart: the top 16 bits of the
/// largest float below 2 (every larger magnitude, inf included, shares its bucket).
pub const BUCKET_KEY_MAX: u16 = 0x3FFF;

/// The quantizer as a lookup: `x`'s top 16 bits (sign, exponent, 7 mantissa bits) give a
/// bucket `b = f(x)` — a function non-decreasing in `x` that puts at most one midpoint in
/// any bucket — and the code is `code[b] + (x > mid[b])`, where `code[b]` counts the
/// midpoints of the buckets below `b` and `mid[b]` is the midpoint in `b` (`+inf` if
/// none). As `f` is non-decreasing, a midpoint in a lower bucket is below `x` and one in
/// a higher bucket above it, so this counts exactly the midpoints strictly below `x`:
/// the same code as the binary search for every non-NaN `x` (tests check every key's
/// bounds and every midpoint's neighbours).
///
/// `f`: the magnitude's key `k = top16(|x|)` clamped to `BUCKET_KEY_MIN..=BUCKET_KEY_MAX`
/// (one-sided maps: `x`'s own top 16 bits as `i16`, so negatives take the minimum) has exponent `e = k >> 7` and
/// falls in bucket `g = off[e & 31] + (k >> shift[e & 31])` (wrapping u16; each binade
/// is cut into `128 >> shift` buckets, as few as keep its midpoints apart); a two-sided
/// map mirrors negative `x` to `mirror - g` below the positive buckets.
#[derive(Debug, Clone)]
pub struct BucketTables {
    /// Bucket offset per exponent (`e & 31`), the exponent's own key bits subtracted.
    pub off: [u16; 32],
    /// Mantissa bits dropped per exponent (`0..=7`).
    pub shift: [u16; 32],
    /// For a two-sided (signed) map: `2 * positive buckets - 1`.
    pub mirror: Option<u16>,
    /// Buckets in use (`<= BUCKETS_MAX`).
    pub len: usize,
    /// Midpoints below each bucket (the code of its lowest values).
    pub code: Bytes<BUCKETS_MAX>,
    /// The midpoint inside each bucket, `+inf` where none.
    pub mid: [f32; BUCKETS_MAX],
}

impl BucketTables {
    /// The bucket of `x` (see the type's documentation).
    #[inline(always)]
    pub fn bucket(&self, x: f32) -> usize {
        let top = (x.to_bits() >> 16) as u16;
        let neg = top & 0x8000 != 0;
        let key = match self.mirror {
            Some(_) => (top & 0x7FFF).clamp(BUCKET_KEY_MIN, BUCKET_KEY_MAX),
            None if neg => BUCKET_KEY_MIN,
            None => top.clamp(BUCKET_KEY_MIN, BUCKET_KEY_MAX),
        };
        let e = usize::from(key >> 7) & 31;
        let g = self.off[e].wrapping_add(key >> self.shift[e]);
        usize::from(match self.mirror {
            Some(mirror) if neg => mirror.wrapping_sub(g),
            _ => g,
        })
    }

    /// Builds the tables for the 255 increasing `midpoints` (`two_sided`: the map has
    /// negative values). Panics if the map does not fit, which the tests of both maps
    /// rule out.
    fn build(midpoints: &[f32], two_sided: bool) -> BucketTables {
        // The distinct magnitudes (a two-sided map's mirrored midpoints share one).
        let mut mags: Vec<u32> = midpoints.iter().map(|m| m.abs().to_bits()).collect();
        mags.sort_unstable();
        mags.dedup();
        let keys: Vec<u16> = mags.iter().map(|&b| (b >> 16) as u16).collect();
        let mut off = [0u16; 32];
        let mut shift = [7u16; 32];
        let mut next = 0u16;
        for e in 101u16..=127 {
            // Mantissa bits (of 7) of this binade's midpoints' keys.
            let m7: Vec<u16> = keys
                .iter()
                .filter(|&&k| k >> 7 == e)
                .map(|&k| k & 127)
                .collect();
            let sh = (0..=7u16)
                .rev()
                .find(|&sh| {
                    let mut b: Vec<u16> = m7.iter().map(|&m| m >> sh).collect();
                    b.sort_unstable();
                    b.windows(2).all(|w| w[0] != w[1])
                })
                .expect("two midpoints share a 16-bit key");
            let i = usize::from(e & 31);
            shift[i] = sh;
            off[i] = next.wrapping_sub((e << 7) >> sh);
            next += 128 >> sh;
        }
        let positive = next;
        let mirror = two_sided.then(|| 2 * positive - 1);
        if two_sided {
            for o in &mut off {
                *o = o.wrapping_add(positive);
            }
        }
        let len = usize::from(if two_sided { 2 * positive } else { positive });
        assert!(len <= BUCKETS_MAX, "{len} buckets");
        let mut t = BucketTables {
            off,
            shift,
            mirror,
            len,
            code: Bytes([u8::MAX; BUCKETS_MAX]),
            mid: [f32::INFINITY; BUCKETS_MAX],
        };
        let mut below = 0usize;
        let mut m = midpoints.iter().peekable();
        for b in 0..len {
            t.code.0[b] = u8::try_from(below).expect("at most 255 midpoints");
            if let Some(&&x) = m.peek() {
                if t.bucket(x) == b {
                    t.mid[b] = x;
                    below += 1;
                    m.next();
                }
            }
            assert!(
                m.peek().is_none_or(|&&x| t.bucket(x) > b),
                "bucket {b} holds two midpoints or is out of order"
            );
        }
        assert!(m.peek().is_none(), "a midpoint beyond the last bucket");
        t
    }
}

impl DynamicMap {
    fn build(signed: bool) -> DynamicMap {
        let mut data: Vec<f64> = Vec::with_capacity(256);
        for i in 0..7i32 {
            let k = if signed {
                1usize << i
            } else {
                1usize << (i + 1)
            };
            let scale = 10f64.powi(i - 6);
            for j in 0..k {
                // Midpoint of linspace(0.1, 1, k + 1)[j..=j + 1].
                let a = 0.1 + 0.9 * j as f64 / k as f64;
                let b = 0.1 + 0.9 * (j + 1) as f64 / k as f64;
                let mean = (a + b) / 2.0 * scale;
                data.push(mean);
                if signed {
                    data.push(-mean);
                }
            }
        }
        data.push(0.0);
        data.push(1.0);
        assert_eq!(data.len(), 256, "dynamic map size");
        data.sort_by(f64::total_cmp);
        let mut values = [0f32; 256];
        for (v, d) in values.iter_mut().zip(&data) {
            *v = *d as f32;
        }
        let mut midpoints = [f32::INFINITY; 256];
        for k in 0..255 {
            midpoints[k] = ((f64::from(values[k]) + f64::from(values[k + 1])) / 2.0) as f32;
        }
        let mut levels = [f32::INFINITY; 256];
        for l in 0..8 {
            let s = 128usize >> l;
            for j in 0..(1usize << l) {
                levels[(1 << l) - 1 + j] = midpoints[(2 * j + 1) * s - 1];
            }
        }
        DynamicMap {
            values,
            midpoints,
            levels,
            buckets: BucketTables::build(&midpoints[..255], signed),
            keys: KeyTable::build(&midpoints[..255]),
            value_planes: Planes::of(&values),
            midpoint_planes: Planes::of(&midpoints),
        }
    }

    /// The code of `x` (already divided by the block's absmax): the number of midpoints
    /// strictly below `x`, by the same 8-step binary search the SIMD kernels run.
    #[inline(always)]
    pub fn code(&self, x: f32) -> u8 {
        let mut lo = 0usize;
        let mut s = 128usize;
        while s > 0 {
            if x > self.midpoints[lo + s - 1] {
                lo += s;
            }
            s >>= 1;
        }
        lo as u8
    }

    /// The code of `x` by the bucket lookup of [`BucketTables`]: equal to
    /// [`DynamicMap::code`] for every `x` (NaN gives 0).
    #[inline(always)]
    pub fn code_by_bucket(&self, x: f32) -> u8 {
        if x.is_nan() {
            return 0;
        }
        let b = self.buckets.bucket(x);
        self.buckets.code.0[b] + u8::from(x > self.buckets.mid[b])
    }

    /// The code of `x` by the key table of [`KeyTable`]: equal to [`DynamicMap::code`]
    /// for every `x` (NaN gives 0; the AVX2 kernel writes a block's codes as 0 when its
    /// inverse absmax is NaN, the only way a NaN reaches the quantizer).
    #[inline(always)]
    pub fn code_by_key(&self, x: f32) -> u8 {
        if x.is_nan() {
            return 0;
        }
        let e = self.keys.entries[self.keys.index(x)];
        let b = x.to_bits();
        let t = if b >> 31 == 1 {
            !b & 0xFFFF
        } else {
            b & 0xFFFF
        };
        (e & 0xFF) as u8 + u8::from(t > e >> 8)
    }

    /// The value of `code`.
    #[inline(always)]
    pub fn value(&self, code: u8) -> f32 {
        self.values[usize::from(code)]
    }
}

/// The signed map (M) and the unsigned map (V).
#[derive(Debug)]
pub struct Maps {
    /// For M.
    pub signed: DynamicMap,
    /// For V.
    pub unsigned: DynamicMap,
}

/// The two maps, built once.
pub fn maps() -> &'static Maps {
    static MAPS: OnceLock<Maps> = OnceLock::new();
    MAPS.get_or_init(|| Maps {
        signed: DynamicMap::build(true),
        unsigned: DynamicMap::build(false),
    })
}

/// The stored absmax of a block whose largest `|x|` has the bits `max_abs_bits` (the
/// maximum of `x.to_bits() & 0x7FFF_FFFF` over the block, an integer maximum every
/// kernel computes the same way): NaN when some element was inf or NaN, at least
/// `f32::MIN_POSITIVE` unless zero.
#[inline(always)]
pub fn absmax_of_bits(max_abs_bits: u32) -> f32 {
    if max_abs_bits >= 0x7F80_0000 {
        f32::NAN
    } else if max_abs_bits == 0 {
        0.0
    } else {
        f32::from_bits(max_abs_bits.max(f32::MIN_POSITIVE.to_bits()))
    }
}

/// The factor a block's elements are multiplied by before the code search: `1 / absmax`
/// (finite, as the absmax is NaN, 0 or at least 2^-126), 0 for an all-zero block.
#[inline(always)]
pub fn inverse_of(absmax: f32) -> f32 {
    if absmax == 0.0 {
        0.0
    } else {
        1.0 / absmax
    }
}

/// Quantizes one block (at most [`Q8_BLOCK`] elements) with `map`; returns its absmax.
/// The reference the kernels are tested against.
pub fn quantize_block(map: &DynamicMap, x: &[f32], codes: &mut [u8]) -> f32 {
    assert!(x.len() <= Q8_BLOCK && codes.len() == x.len(), "one block");
    let max_bits = x
        .iter()
        .map(|v| v.to_bits() & 0x7FFF_FFFF)
        .max()
        .unwrap_or(0);
    let absmax = absmax_of_bits(max_bits);
    let r = inverse_of(absmax);
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = map.code(v * r);
    }
    absmax
}

/// Reads one block back: `out[i] = map[codes[i]] * absmax`.
pub fn dequantize_block(map: &DynamicMap, codes: &[u8], absmax: f32, out: &mut [f32]) {
    assert_eq!(codes.len(), out.len(), "one block");
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = map.value(c) * absmax;
    }
}

/// Quantizes a whole array (blocks of [`Q8_BLOCK`]); `absmax.len() == absmax_len(x.len())`.
pub fn quantize(map: &DynamicMap, x: &[f32], codes: &mut [u8], absmax: &mut [f32]) {
    assert_eq!(codes.len(), x.len());
    assert_eq!(absmax.len(), absmax_len(x.len()));
    for ((xb, cb), a) in x
        .chunks(Q8_BLOCK)
        .zip(codes.chunks_mut(Q8_BLOCK))
        .zip(absmax.iter_mut())
    {
        *a = quantize_block(map, xb, cb);
    }
}

/// Reads a whole quantized array back.
pub fn dequantize(map: &DynamicMap, codes: &[u8], absmax: &[f32], out: &mut [f32]) {
    assert_eq!(codes.len(), out.len());
    assert_eq!(absmax.len(), absmax_len(codes.len()));
    for ((cb, ob), &a) in codes
        .chunks(Q8_BLOCK)
        .zip(out.chunks_mut(Q8_BLOCK))
        .zip(absmax)
    {
        dequantize_block(map, cb, a, ob);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agree(map: &DynamicMap, x: f32) {
        assert_eq!(
            map.code_by_bucket(x),
            map.code(x),
            "x = {x:e} ({:#010x})",
            x.to_bits()
        );
        assert_eq!(
            map.code_by_key(x),
            map.code(x),
            "key table, x = {x:e} ({:#010x})",
            x.to_bits()
        );
    }

    /// The bucket and key quantizers are functions of the top 16 bits plus one compare,
    /// so the first and last float of every 16-bit key, and every midpoint with its
    /// nearest neighbours, cover every way they could differ from the binary search.
    #[test]
    fn bucket_code_equals_binary_search_at_every_key_and_midpoint() {
        for map in [&maps().signed, &maps().unsigned] {
            for top in 0..=u16::MAX {
                let lo = u32::from(top) << 16;
                for bits in [lo, lo + 1, lo | 0x7FFF, lo | 0xFFFE, lo | 0xFFFF] {
                    agree(map, f32::from_bits(bits));
                }
            }
            for &m in &map.midpoints[..255] {
                for d in 0..4u32 {
                    agree(map, f32::from_bits(m.to_bits() + d));
                    agree(map, f32::from_bits(m.to_bits() - d));
                }
            }
            for &v in &map.values {
                agree(map, v);
            }
        }
    }

    /// The VBMI quantizer compares with `midpoints[code[b]]` instead of `mid[b]`: equal
    /// where `b` holds a midpoint, else above every value of `b`.
    #[test]
    fn the_midpoint_after_a_bucket_code_decides_like_its_own() {
        for map in [&maps().signed, &maps().unsigned] {
            let t = &map.buckets;
            for b in 0..t.len {
                let next = map.midpoints[usize::from(t.code.0[b])];
                if t.mid[b].is_finite() {
                    assert_eq!(next.to_bits(), t.mid[b].to_bits(), "bucket {b}");
                } else {
                    assert!(next.is_infinite() || t.bucket(next) > b, "bucket {b}");
                }
            }
        }
    }

    #[test]
    fn bucket_tables_fit() {
        let q = maps();
        assert_eq!(
            q.signed.buckets.mirror.map(|m| usize::from(m) + 1),
            Some(q.signed.buckets.len)
        );
        assert!(q.unsigned.buckets.mirror.is_none());
        for map in [&q.signed, &q.unsigned] {
            assert!(map.buckets.len <= BUCKETS_MAX);
            let n = map.buckets.mid.iter().filter(|m| m.is_finite()).count();
            assert_eq!(n, 255, "every midpoint in its own bucket");
        }
    }

    /// Every f32 bit pattern (about a minute in release on 2 cores): run with
    /// `cargo test --release -p tidestore-optimizer -- --ignored every_float`.
    #[test]
    #[ignore = "4 billion inputs; the key-bound test covers the same cases"]
    fn bucket_code_equals_binary_search_for_every_float() {
        for map in [&maps().signed, &maps().unsigned] {
            for bits in 0..=u32::MAX {
                let x = f32::from_bits(bits);
                if map.code_by_bucket(x) != map.code(x) || map.code_by_key(x) != map.code(x) {
                    agree(map, x);
                }
            }
        }
    }
}
