//! The portable compact kernels, one element at a time, and the per-element and
//! per-block pieces the SIMD kernels use for their tails. They define the arithmetic:
//! [`super::super::scalar::adam`] on the dequantized moments, then
//! [`crate::quant`]'s quantizer (or `half`'s bf16 rounding).

use half::bf16;

use super::super::raw::O_NONE;
use super::super::scalar::{adam, load_grad, to_half_bits};
use super::CompactPtrs;
use crate::params::Consts;
use crate::quant::{absmax_of_bits, inverse_of, DynamicMap, Maps, Q8_BLOCK};

/// bf16 bits widened to f32 (exact).
#[inline(always)]
pub(crate) fn widen(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Updates element `i` of a bf16-moment span.
///
/// # Safety
/// `s` satisfies the [`CompactPtrs`] invariant for bf16 moments and `i < s.len`.
#[inline(always)]
pub(crate) unsafe fn b16_elem<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    s: &CompactPtrs,
    i: usize,
) {
    // SAFETY: `i < s.len`; every pointer covers `s.len` elements of its dtype, the
    // mutable ones exclusively (CompactPtrs invariant).
    unsafe {
        let m16 = s.m.cast::<u16>().add(i);
        let v16 = s.v.cast::<u16>().add(i);
        let g = load_grad::<GK>(s.g, i);
        let (p, m, v) = adam::<L2>(c, *s.p.add(i), widen(*m16), widen(*v16), g);
        *s.p.add(i) = p;
        *m16 = bf16::from_f32(m).to_bits();
        *v16 = bf16::from_f32(v).to_bits();
        if OK != O_NONE {
            *s.out.add(i) = to_half_bits::<OK>(p);
        }
    }
}

/// Updates elements `from..s.len` of a bf16-moment span.
///
/// # Safety
/// As [`b16_elem`] for every element.
#[inline(always)]
pub(crate) unsafe fn b16_from<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    s: &CompactPtrs,
    from: usize,
) {
    for i in from..s.len {
        // SAFETY: `i < s.len`; forwarded invariant.
        unsafe { b16_elem::<GK, OK, L2>(c, s, i) }
    }
}

/// Portable step over bf16 moments.
///
/// # Safety
/// `s` satisfies the [`CompactPtrs`] invariant for bf16 moments.
pub(crate) unsafe fn step_b16<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    s: &CompactPtrs,
) {
    // SAFETY: forwarded caller contract.
    unsafe { b16_from::<GK, OK, L2>(c, s, 0) }
}

/// The new moments of one int8 block before requantization, and their integer absmax.
pub(crate) struct Q8Block {
    pub m: [f32; Q8_BLOCK],
    pub v: [f32; Q8_BLOCK],
    /// Maximum of `m.to_bits() & 0x7FFF_FFFF` over the block (see `absmax_of_bits`).
    pub m_bits: u32,
    pub v_bits: u32,
}

impl Q8Block {
    pub(crate) fn new() -> Self {
        Q8Block {
            m: [0.0; Q8_BLOCK],
            v: [0.0; Q8_BLOCK],
            m_bits: 0,
            v_bits: 0,
        }
    }
}

/// Phase 1 of an int8 block for its elements `from..len`: dequantize (with the block's
/// old absmax `am`, `av`), update, store master and output, keep the new moments in `b`.
///
/// # Safety
/// `s` satisfies the [`CompactPtrs`] invariant for int8 moments; the block starts at
/// element `b0` and `b0 + len <= s.len`, `len <= Q8_BLOCK`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn q8_update_from<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    q: &Maps,
    s: &CompactPtrs,
    b0: usize,
    (am, av): (f32, f32),
    from: usize,
    len: usize,
    b: &mut Q8Block,
) {
    for j in from..len {
        let i = b0 + j;
        // SAFETY: `i < s.len`; CompactPtrs invariant.
        unsafe {
            let m = q.signed.value(*s.m.add(i)) * am;
            let v = q.unsigned.value(*s.v.add(i)) * av;
            let g = load_grad::<GK>(s.g, i);
            let (p, m, v) = adam::<L2>(c, *s.p.add(i), m, v, g);
            *s.p.add(i) = p;
            if OK != O_NONE {
                *s.out.add(i) = to_half_bits::<OK>(p);
            }
            b.m[j] = m;
            b.v[j] = v;
            b.m_bits = b.m_bits.max(m.to_bits() & 0x7FFF_FFFF);
            b.v_bits = b.v_bits.max(v.to_bits() & 0x7FFF_FFFF);
        }
    }
}

/// Phase 2 for elements `from..len`: codes of `x[j] * r` written at `codes + j`.
///
/// # Safety
/// `codes` covers `len` writable bytes; `len <= Q8_BLOCK`.
#[inline(always)]
pub(crate) unsafe fn q8_codes_from(
    map: &DynamicMap,
    x: &[f32; Q8_BLOCK],
    r: f32,
    codes: *mut u8,
    from: usize,
    len: usize,
) {
    for (j, &xj) in x.iter().enumerate().take(len).skip(from) {
        // SAFETY: `j < len`, within the caller's bytes.
        unsafe { *codes.add(j) = map.code(xj * r) }
    }
}

/// Stores the block's new absmax values and returns their inverses `(rm, rv)`.
///
/// # Safety
/// `s` satisfies the [`CompactPtrs`] invariant for int8 moments and `blk` is a block
/// index of the span.
#[inline(always)]
pub(crate) unsafe fn q8_store_absmax(s: &CompactPtrs, blk: usize, b: &Q8Block) -> (f32, f32) {
    let am = absmax_of_bits(b.m_bits);
    let av = absmax_of_bits(b.v_bits);
    // SAFETY: `blk < absmax_len(s.len)`; CompactPtrs invariant.
    unsafe {
        *s.ma.add(blk) = am;
        *s.va.add(blk) = av;
    }
    (inverse_of(am), inverse_of(av))
}

/// Portable step over int8 moments.
///
/// # Safety
/// `s` satisfies the [`CompactPtrs`] invariant for int8 moments.
pub(crate) unsafe fn step_q8<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    q: &Maps,
    s: &CompactPtrs,
) {
    let mut b = Q8Block::new();
    let mut b0 = 0;
    while b0 < s.len {
        let blk = b0 / Q8_BLOCK;
        let len = (s.len - b0).min(Q8_BLOCK);
        b.m_bits = 0;
        b.v_bits = 0;
        // SAFETY: block `blk` spans `b0..b0 + len` within the span; invariant forwarded.
        unsafe {
            let old = (*s.ma.add(blk), *s.va.add(blk));
            q8_update_from::<GK, OK, L2>(c, q, s, b0, old, 0, len, &mut b);
            let (dm, dv) = q8_store_absmax(s, blk, &b);
            q8_codes_from(&q.signed, &b.m, dm, s.m.add(b0), 0, len);
            q8_codes_from(&q.unsigned, &b.v, dv, s.v.add(b0), 0, len);
        }
        b0 += len;
    }
}

/// The compact memory probe for elements `from..s.len`: master and `w` bytes of each
/// moment per element read and written back, the gradient read, the output written
/// (the bf16 truncation of the master value), no arithmetic beyond `fma(g, zero, p)` and
/// `b ^ flip` per moment byte (see [`super::super::ProbeKey`]: with a key the compiler
/// cannot see, no load and store back can be dropped).
///
/// # Safety
/// `s` covers `s.len` elements of master, gradient and output and `w * s.len` bytes of
/// each moment, all exclusive but the gradient.
#[inline(always)]
pub(crate) unsafe fn probe_from<const GK: u8, const OK: u8>(
    s: &CompactPtrs,
    w: usize,
    (zero, flip): (f32, u8),
    from: usize,
) {
    for i in from..s.len {
        // SAFETY: `i < s.len`; the caller's bounds.
        unsafe {
            let p = load_grad::<GK>(s.g, i).mul_add(zero, *s.p.add(i));
            *s.p.add(i) = p;
            for k in w * i..w * (i + 1) {
                *s.m.add(k) ^= flip;
                *s.v.add(k) ^= flip;
            }
            if OK != O_NONE {
                *s.out.add(i) = (p.to_bits() >> 16) as u16;
            }
        }
    }
}

/// Portable compact probe.
///
/// # Safety
/// As [`probe_from`].
pub(crate) unsafe fn probe<const GK: u8, const OK: u8>(
    s: &CompactPtrs,
    w: usize,
    zero: f32,
    flip: u8,
) {
    // SAFETY: forwarded caller contract.
    unsafe { probe_from::<GK, OK>(s, w, (zero, flip), 0) }
}
