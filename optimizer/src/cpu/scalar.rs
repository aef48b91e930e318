//! The portable kernels, one element at a time, and the per-element functions the SIMD
//! kernels use for their tails.
//!
//! These functions define the arithmetic: every SIMD kernel evaluates the same f32
//! operations in the same order with the same fusions (`f32::mul_add` here, `vfmadd`
//! there; `sqrt` and `/` are correctly rounded in both), so every level gives
//! bit-identical fp32 results. 16-bit outputs use `half`'s conversions, which the SIMD
//! kernels reproduce bit for bit.

use half::{bf16, f16};

use super::raw::{StepPtrs, G_F16, G_F32, O_F16, O_NONE};
use crate::params::Consts;

/// Gradient element `i` widened to f32 (exact; bf16 by a 16-bit shift, like the SIMD
/// kernels, so a signalling NaN stays signalling until the first arithmetic).
///
/// # Safety
/// `g` points to at least `i + 1` elements of the dtype coded by `GK`.
#[inline(always)]
pub(crate) unsafe fn load_grad<const GK: u8>(g: *const u8, i: usize) -> f32 {
    // SAFETY: (all arms) the caller guarantees element `i` of the `GK` dtype is in bounds;
    // `read_unaligned` needs no alignment.
    unsafe {
        match GK {
            G_F32 => g.cast::<f32>().add(i).read_unaligned(),
            G_F16 => f16::from_bits(g.cast::<u16>().add(i).read_unaligned()).to_f32(),
            _ => f32::from_bits(u32::from(g.cast::<u16>().add(i).read_unaligned()) << 16),
        }
    }
}

/// `p` rounded to the 16-bit dtype coded by `OK` (nearest even, `half`'s rules).
#[inline(always)]
pub(crate) fn to_half_bits<const OK: u8>(p: f32) -> u16 {
    if OK == O_F16 {
        f16::from_f32(p).to_bits()
    } else {
        bf16::from_f32(p).to_bits()
    }
}

/// `x`, or the canonical NaN if `x` is any NaN (the crate's NaN policy).
#[inline(always)]
pub(crate) fn canon_nan(x: f32) -> f32 {
    if x.is_nan() {
        f32::from_bits(crate::CANONICAL_NAN_BITS)
    } else {
        x
    }
}

/// One AdamW / Adam-L2 update in f32; returns `(p, m, v)`, NaNs canonical.
#[inline(always)]
pub(crate) fn adam<const L2: bool>(c: &Consts, p: f32, m: f32, v: f32, g: f32) -> (f32, f32, f32) {
    let g = g * c.grad_scale;
    let g = if L2 { c.wd_l2.mul_add(p, g) } else { g };
    let m = c.beta1.mul_add(m, c.one_minus_beta1 * g);
    let v = c.beta2.mul_add(v, (c.one_minus_beta2 * g) * g);
    let d = v.sqrt().mul_add(c.inv_sqrt_bc2, c.eps);
    let p = if L2 { p } else { c.neg_lr_wd.mul_add(p, p) };
    let p = c.neg_step.mul_add(m / d, p);
    (canon_nan(p), canon_nan(m), canon_nan(v))
}

/// Updates element `i` of a span.
///
/// # Safety
/// `s` satisfies the [`StepPtrs`] invariant and `i < s.len`.
#[inline(always)]
pub(crate) unsafe fn step_elem<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    s: &StepPtrs,
    i: usize,
) {
    // SAFETY: `i < s.len` and every pointer covers `s.len` elements of its dtype, the
    // mutable ones exclusively (StepPtrs invariant).
    unsafe {
        let g = load_grad::<GK>(s.g, i);
        let (p, m, v) = adam::<L2>(c, *s.p.add(i), *s.m.add(i), *s.v.add(i), g);
        *s.p.add(i) = p;
        *s.m.add(i) = m;
        *s.v.add(i) = v;
        if OK != O_NONE {
            *s.out.add(i) = to_half_bits::<OK>(p);
        }
    }
}

/// Updates elements `from..s.len`.
///
/// # Safety
/// `s` satisfies the [`StepPtrs`] invariant.
#[inline(always)]
pub(crate) unsafe fn step_from<const GK: u8, const OK: u8, const L2: bool>(
    c: &Consts,
    s: &StepPtrs,
    from: usize,
) {
    for i in from..s.len {
        // SAFETY: `i < s.len`; the caller upholds the StepPtrs invariant.
        unsafe { step_elem::<GK, OK, L2>(c, s, i) }
    }
}

/// The portable step kernel.
///
/// # Safety
/// `s` satisfies the [`StepPtrs`] invariant.
pub(crate) unsafe fn step<const GK: u8, const OK: u8, const L2: bool>(c: &Consts, s: &StepPtrs) {
    // SAFETY: forwarded caller contract.
    unsafe { step_from::<GK, OK, L2>(c, s, 0) }
}

/// Sum of squares of elements `from..len`, in f64 (each square of an f32 is exact in
/// f64).
///
/// # Safety
/// `g` points to `len` elements of the `GK` dtype.
#[inline(always)]
pub(crate) unsafe fn sq_norm_from<const GK: u8>(g: *const u8, from: usize, len: usize) -> f64 {
    let mut acc = 0.0f64;
    for i in from..len {
        // SAFETY: `i < len`, within the caller's slice.
        let x = f64::from(unsafe { load_grad::<GK>(g, i) });
        // The square of an f32 is exact in f64, so this equals a fused multiply-add.
        acc += x * x;
    }
    acc
}

/// Portable sum of squares.
///
/// # Safety
/// `g` points to `len` elements of the `GK` dtype.
pub(crate) unsafe fn sq_norm<const GK: u8>(g: *const u8, len: usize) -> f64 {
    // SAFETY: forwarded caller contract.
    unsafe { sq_norm_from::<GK>(g, 0, len) }
}

/// True when elements `from..len` are all finite.
///
/// # Safety
/// `g` points to `len` elements of the `GK` dtype.
#[inline(always)]
pub(crate) unsafe fn finite_from<const GK: u8>(g: *const u8, from: usize, len: usize) -> bool {
    let mut bad = false;
    for i in from..len {
        // SAFETY: `i < len`, within the caller's slice.
        bad |= !unsafe { load_grad::<GK>(g, i) }.is_finite();
    }
    !bad
}

/// Portable finiteness check.
///
/// # Safety
/// `g` points to `len` elements of the `GK` dtype.
pub(crate) unsafe fn all_finite<const GK: u8>(g: *const u8, len: usize) -> bool {
    // SAFETY: forwarded caller contract.
    unsafe { finite_from::<GK>(g, 0, len) }
}

/// `acc[i] = fma(g[i], scale, acc[i])` for `i` in `from..len`.
///
/// # Safety
/// `acc` (exclusive) and `g` (of the `GK` dtype) each cover `len` elements.
#[inline(always)]
pub(crate) unsafe fn accumulate_from<const GK: u8>(
    acc: *mut f32,
    g: *const u8,
    scale: f32,
    from: usize,
    len: usize,
) {
    for i in from..len {
        // SAFETY: `i < len`; `acc` is exclusive to this call.
        unsafe {
            let a = acc.add(i);
            *a = load_grad::<GK>(g, i).mul_add(scale, *a);
        }
    }
}

/// Portable accumulation.
///
/// # Safety
/// As [`accumulate_from`].
pub(crate) unsafe fn accumulate<const GK: u8>(acc: *mut f32, g: *const u8, scale: f32, len: usize) {
    // SAFETY: forwarded caller contract.
    unsafe { accumulate_from::<GK>(acc, g, scale, 0, len) }
}

/// `out[i] = half(src[i])` for `i` in `from..len`.
///
/// # Safety
/// `src` covers `len` f32, `out` (exclusive) `len` 16-bit elements.
#[inline(always)]
pub(crate) unsafe fn cast_from<const OK: u8>(
    src: *const f32,
    out: *mut u16,
    from: usize,
    len: usize,
) {
    for i in from..len {
        // SAFETY: `i < len`; `out` is exclusive to this call.
        unsafe { *out.add(i) = to_half_bits::<OK>(*src.add(i)) }
    }
}

/// Portable cast.
///
/// # Safety
/// As [`cast_from`].
pub(crate) unsafe fn cast<const OK: u8>(src: *const f32, out: *mut u16, len: usize) {
    // SAFETY: forwarded caller contract.
    unsafe { cast_from::<OK>(src, out, 0, len) }
}

/// The memory probe's per-element work for elements `from..len`: read and write back
/// `p`, `m`, `v`, read `g`, write `out` (the bf16 truncation of `p`) — the same bytes a
/// step moves, with almost no arithmetic. With `one == 1.0` and `zero == 0.0` (passed at
/// run time so nothing folds away) the values do not change.
///
/// # Safety
/// `s` satisfies the [`StepPtrs`] invariant.
#[inline(always)]
pub(crate) unsafe fn probe_from<const GK: u8, const OK: u8>(
    s: &StepPtrs,
    one: f32,
    zero: f32,
    from: usize,
) {
    for i in from..s.len {
        // SAFETY: `i < s.len`; StepPtrs invariant.
        unsafe {
            let g = load_grad::<GK>(s.g, i);
            let p = g.mul_add(zero, *s.p.add(i));
            *s.p.add(i) = p;
            *s.m.add(i) *= one;
            *s.v.add(i) *= one;
            if OK != O_NONE {
                *s.out.add(i) = (p.to_bits() >> 16) as u16;
            }
        }
    }
}

/// Portable probe.
///
/// # Safety
/// `s` satisfies the [`StepPtrs`] invariant.
pub(crate) unsafe fn probe<const GK: u8, const OK: u8>(s: &StepPtrs, one: f32, zero: f32) {
    // SAFETY: forwarded caller contract.
    unsafe { probe_from::<GK, OK>(s, one, zero, 0) }
}
