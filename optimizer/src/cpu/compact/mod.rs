//! The fused AdamW over compact moments (bf16, or block-wise 8-bit): one pass per
//! element block that dequantizes M and V, applies the update of
//! [`super::scalar::adam`], requantizes them and writes the 16-bit parameter copy.
//!
//! Same ladder and guarantees as the fp32 kernels: every [`SimdLevel`] computes the same
//! f32 operations in the same order, and the quantizer is the exact definition of
//! [`crate::quant`] (integer absmax, correctly rounded division, branch-free binary
//! search over the same midpoints), so codes, absmax, bf16 moments and master values are
//! bit-identical at every level and thread count. Parallel blocks of an int8 step are
//! whole quantization blocks (the block size is rounded up to a multiple of 256), so an
//! absmax is only ever written by the thread that owns its block.
//!
//! Soundness: the `unsafe` here builds [`CompactPtrs`] from slices whose lengths were
//! checked (and kept by the split) and calls kernels of a supported level.

pub(crate) mod scalar;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;

use half::bf16;

use super::parallel::{check_grads_out, run_blocks, split_out, Split};
use super::raw::{grad_raw, out_raw};
use super::{AdamW, ProbeKey, SimdLevel};
use crate::error::{check_len, Result};
use crate::moments::{Moments, Q8Mut};
use crate::params::{Consts, HyperParams, StepState};
use crate::quant::{absmax_len, maps, Maps, Q8_BLOCK};
use crate::slices::{Grads, ParamOut};

/// Raw views of one span of a compact step. Invariant (kept by [`step_leaf`]): every
/// pointer comes from a live slice of `len` elements of its dtype (`m`/`v`: `u16` bf16
/// bits or `u8` codes; `ma`/`va`: `absmax_len(len)` f32, dangling for bf16), the
/// mutable ones exclusive for the call, and the span starts at a quantization block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CompactPtrs {
    pub p: *mut f32,
    pub m: *mut u8,
    pub v: *mut u8,
    pub ma: *mut f32,
    pub va: *mut f32,
    pub g: *const u8,
    pub out: *mut u16,
    pub len: usize,
}

/// The compact moments of a job.
enum Compact<'a> {
    Bf16(&'a mut [bf16], &'a mut [bf16]),
    Int8(Q8Mut<'a>, Q8Mut<'a>),
}

/// The arrays of one compact step.
struct CompactJob<'a> {
    p: &'a mut [f32],
    mv: Compact<'a>,
    g: Grads<'a>,
    out: Option<ParamOut<'a>>,
}

fn split_q8(q: Q8Mut<'_>, mid: usize) -> (Q8Mut<'_>, Q8Mut<'_>) {
    assert!(
        mid.is_multiple_of(Q8_BLOCK),
        "int8 spans split at whole blocks"
    );
    let (c0, c1) = q.codes.split_at_mut(mid);
    let (a0, a1) = q.absmax.split_at_mut(mid / Q8_BLOCK);
    (
        Q8Mut {
            codes: c0,
            absmax: a0,
        },
        Q8Mut {
            codes: c1,
            absmax: a1,
        },
    )
}

impl Split for CompactJob<'_> {
    fn len(&self) -> usize {
        self.p.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.p.split_at_mut(mid);
        let (g0, g1) = self.g.split_at(mid);
        let (o0, o1) = split_out(self.out, mid);
        let (mv0, mv1) = match self.mv {
            Compact::Bf16(m, v) => {
                let (m0, m1) = m.split_at_mut(mid);
                let (v0, v1) = v.split_at_mut(mid);
                (Compact::Bf16(m0, v0), Compact::Bf16(m1, v1))
            }
            Compact::Int8(m, v) => {
                let (m0, m1) = split_q8(m, mid);
                let (v0, v1) = split_q8(v, mid);
                (Compact::Int8(m0, v0), Compact::Int8(m1, v1))
            }
        };
        (
            CompactJob {
                p: p0,
                mv: mv0,
                g: g0,
                out: o0,
            },
            CompactJob {
                p: p1,
                mv: mv1,
                g: g1,
                out: o1,
            },
        )
    }
}

/// `moments`, `grads` and `out` checked against `n` parameters: the compact views, or
/// the fp32 pair (`Err`) for the fp32 kernel, which checks them all itself.
#[allow(clippy::type_complexity)]
fn compact_of<'a>(
    n: usize,
    moments: Moments<'a>,
    grads: &Grads<'_>,
    out: &Option<ParamOut<'_>>,
) -> Result<std::result::Result<Compact<'a>, (&'a mut [f32], &'a mut [f32])>> {
    let mv = match moments {
        Moments::F32 { m, v } => return Ok(Err((m, v))),
        Moments::Bf16 { m, v } => {
            check_len("m", m.len(), "master", n)?;
            check_len("v", v.len(), "master", n)?;
            Compact::Bf16(m, v)
        }
        Moments::Int8 { m, v } => {
            check_q8("m", &m, n)?;
            check_q8("v", &v, n)?;
            Compact::Int8(m, v)
        }
    };
    check_grads_out(n, grads, out)?;
    Ok(Ok(mv))
}

fn check_q8(what: &'static str, q: &Q8Mut<'_>, n: usize) -> Result<()> {
    check_len(what, q.codes.len(), "master", n)?;
    check_len(what, q.absmax.len(), "absmax_len(master)", absmax_len(n))
}

impl AdamW {
    /// One AdamW / Adam-L2 step with moments in any stored form, in place, in one pass:
    /// as [`AdamW::step_slice`] (which the fp32 form calls), with bf16 moments rounded to
    /// nearest even and int8 moments dequantized, updated and requantized per block of
    /// 256 (see [`crate::quant`]). Bit-identical at every SIMD level and thread count.
    #[allow(clippy::too_many_arguments)]
    pub fn step_moments(
        &self,
        state: StepState,
        hp: &HyperParams,
        master: &mut [f32],
        moments: Moments<'_>,
        grads: Grads<'_>,
        out: Option<ParamOut<'_>>,
    ) -> Result<()> {
        let mv = match compact_of(master.len(), moments, &grads, &out)? {
            Err((m, v)) => return self.step_slice(state, hp, master, m, v, grads, out),
            Ok(mv) => mv,
        };
        let c = Consts::new(state, hp)?;
        let q = maps();
        self.run_compact(master, mv, grads, out, |level, j| {
            step_leaf(level, &c, q, j)
        });
        Ok(())
    }

    /// Runs `leaf` (given this optimizer's SIMD level) over the compact job's parallel
    /// blocks: whole quantization blocks each (also fine for bf16).
    fn run_compact(
        &self,
        p: &mut [f32],
        mv: Compact<'_>,
        g: Grads<'_>,
        out: Option<ParamOut<'_>>,
        leaf: impl Fn(SimdLevel, CompactJob<'_>) + Sync,
    ) {
        let level = self.level;
        let block = self.block_params.div_ceil(Q8_BLOCK) * Q8_BLOCK;
        run_blocks(
            self.pool(),
            block,
            CompactJob { p, mv, g, out },
            &|j: CompactJob<'_>| leaf(level, j),
            &|(), ()| (),
        );
    }
}

/// The kernels' pointers into `j`'s slices, with the gradient's and output's dtype
/// codes and whether the moments are int8 (else bf16; their absmax pointers dangle).
fn step_ptrs(j: CompactJob<'_>) -> (CompactPtrs, u8, u8, bool) {
    let (gk, g) = grad_raw(j.g);
    let (ok, out) = out_raw(j.out);
    let dangling = std::ptr::NonNull::<f32>::dangling().as_ptr();
    let (int8, m, v, ma, va) = match j.mv {
        Compact::Bf16(m, v) => (
            false,
            m.as_mut_ptr().cast::<u8>(),
            v.as_mut_ptr().cast::<u8>(),
            dangling,
            dangling,
        ),
        Compact::Int8(m, v) => (
            true,
            m.codes.as_mut_ptr(),
            v.codes.as_mut_ptr(),
            m.absmax.as_mut_ptr(),
            v.absmax.as_mut_ptr(),
        ),
    };
    let s = CompactPtrs {
        p: j.p.as_mut_ptr(),
        m,
        v,
        ma,
        va,
        g,
        out,
        len: j.p.len(),
    };
    (s, gk, ok, int8)
}

fn step_leaf(level: SimdLevel, c: &Consts, q: &Maps, j: CompactJob<'_>) {
    let (s, gk, ok, int8) = step_ptrs(j);
    #[cfg(target_arch = "x86_64")]
    let vbmi = int8 && level >= SimdLevel::Avx512 && avx512::vbmi_supported();
    // SAFETY: `s` was built from the job's slices, checked by `step_moments` to have the
    // lengths of the CompactPtrs invariant and kept so by the split (at whole blocks);
    // they are exclusive `&mut` borrows (shared for the gradients) alive for this call.
    // `level` passed `is_supported` when the optimizer was built, and the VBMI kernels
    // run only where `vbmi_supported` found their extra features.
    unsafe {
        if int8 {
            match level {
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx512Bf16 if vbmi => {
                    dispatch_step!(avx512::step_q8_vbmi_bf16, gk, ok, c.l2, (c, q, &s))
                }
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx512 if vbmi => {
                    dispatch_step!(avx512::step_q8_vbmi, gk, ok, c.l2, (c, q, &s))
                }
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx512Bf16 => {
                    dispatch_step!(avx512::step_q8_bf16, gk, ok, c.l2, (c, q, &s))
                }
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx512 => dispatch_step!(avx512::step_q8, gk, ok, c.l2, (c, q, &s)),
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx2 => dispatch_step!(avx2::step_q8, gk, ok, c.l2, (c, q, &s)),
                _ => dispatch_step!(scalar::step_q8, gk, ok, c.l2, (c, q, &s)),
            }
        } else {
            match level {
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx512Bf16 => {
                    dispatch_step!(avx512::step_b16_bf16, gk, ok, c.l2, (c, &s))
                }
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx512 => dispatch_step!(avx512::step_b16, gk, ok, c.l2, (c, &s)),
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx2 => dispatch_step!(avx2::step_b16, gk, ok, c.l2, (c, &s)),
                _ => dispatch_step!(scalar::step_b16, gk, ok, c.l2, (c, &s)),
            }
        }
    }
}

impl AdamW {
    /// The memory roofline probe of [`AdamW::step_moments`]: moves the bytes that step
    /// moves for the same arguments (master, the stored moments with their absmax, read
    /// and written back; gradients read; the 16-bit output written), with the same
    /// blocking and threads and almost no arithmetic. Values are left unchanged when the
    /// gradients are finite. The fp32 form is [`AdamW::probe_slice`].
    pub fn probe_moments(
        &self,
        master: &mut [f32],
        moments: Moments<'_>,
        grads: Grads<'_>,
        out: Option<ParamOut<'_>>,
    ) -> Result<()> {
        self.probe_moments_keyed(ProbeKey::identity(), master, moments, grads, out)
    }

    /// [`AdamW::probe_moments`] folding `key` into every value it moves (see
    /// [`ProbeKey`]).
    pub(crate) fn probe_moments_keyed(
        &self,
        key: ProbeKey,
        master: &mut [f32],
        moments: Moments<'_>,
        grads: Grads<'_>,
        out: Option<ParamOut<'_>>,
    ) -> Result<()> {
        let mv = match compact_of(master.len(), moments, &grads, &out)? {
            Err((m, v)) => return self.probe_slice_keyed(key, master, m, v, grads, out),
            Ok(mv) => mv,
        };
        self.run_compact(master, mv, grads, out, |level, j| probe_leaf(level, j, key));
        Ok(())
    }
}

fn probe_leaf(level: SimdLevel, j: CompactJob<'_>, key: ProbeKey) {
    let (gk, g) = grad_raw(j.g);
    let (ok, out) = out_raw(j.out);
    let n = j.p.len();
    let (w, m, v, absmax) = match j.mv {
        Compact::Bf16(m, v) => (
            2,
            m.as_mut_ptr().cast::<u8>(),
            v.as_mut_ptr().cast::<u8>(),
            None,
        ),
        Compact::Int8(m, v) => (
            1,
            m.codes.as_mut_ptr(),
            v.codes.as_mut_ptr(),
            Some((m.absmax, v.absmax)),
        ),
    };
    if let Some((ma, va)) = absmax {
        for a in ma.iter_mut().chain(va.iter_mut()) {
            // A multiplication: `mul_add` here, outside any target feature, would be a
            // call to the software fma.
            *a *= key.one;
        }
    }
    let s = CompactPtrs {
        p: j.p.as_mut_ptr(),
        m,
        v,
        ma: std::ptr::NonNull::<f32>::dangling().as_ptr(),
        va: std::ptr::NonNull::<f32>::dangling().as_ptr(),
        g,
        out,
        len: n,
    };
    let (zero, flip, pf) = (key.zero, key.flip, key.prefetch);
    // SAFETY: `s` covers the job's slices (`w` bytes per moment element, checked lengths
    // kept by the split), exclusive for the call; `level` is supported by this CPU.
    unsafe {
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Bf16 | SimdLevel::Avx512 => {
                dispatch_grad_out!(avx512::probe, gk, ok, (&s, w, zero, flip, pf))
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => dispatch_grad_out!(avx2::probe, gk, ok, (&s, w, zero, flip, pf)),
            _ => dispatch_grad_out!(scalar::probe, gk, ok, (&s, w, zero, flip)),
        }
    }
}
