//! The simulated device: device views that are host bytes are updated by the CPU
//! kernel ([`AdamW::step_moments`]), with the bits of a GPU step.

use std::cell::Cell;

use half::slice::HalfBitsSliceExt;
use tidestore_tiers::{DeviceView, DeviceViewMut};

use crate::cpu::AdamW;
use crate::device_slices::{
    in_place_f32, misaligned, mixed, out_f32, q8_view, short, DeviceGrads, DeviceSlices,
};
use crate::error::Result;
use crate::moments::{Moments, Q8Mut};
use crate::params::{HyperParams, StepState};
use crate::quant::{absmax_len, MomentForm, Q8_BLOCK};
use crate::slices::{DType, Grads, ParamOut};

/// Element types for which every bit pattern is a valid value and that have no padding,
/// so host bytes may be viewed as them and back.
trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for u16 {}
impl Plain for half::f16 {}
impl Plain for half::bf16 {}
impl Plain for u8 {}

fn host_mut<'a>(v: DeviceViewMut<'a>, name: &'static str) -> Result<&'a mut [u8]> {
    match v {
        DeviceViewMut::Host(b) => Ok(b),
        DeviceViewMut::Cuda(_) => Err(mixed(name, false)),
    }
}

/// Aligned for `T` and long enough for `n` of them, or the error naming the view.
fn fits<T: Plain>(addr: usize, len_bytes: usize, n: usize, name: &'static str) -> Result<()> {
    let size = std::mem::size_of::<T>();
    let off = addr % std::mem::align_of::<T>();
    if off != 0 {
        return Err(misaligned(name, off as u64));
    }
    if len_bytes / size < n {
        return Err(short(name, len_bytes / size, n));
    }
    Ok(())
}

/// The first `n` elements of `bytes` as `T`.
fn cast<'a, T: Plain>(bytes: &'a [u8], n: usize, name: &'static str) -> Result<&'a [T]> {
    fits::<T>(bytes.as_ptr().addr(), bytes.len(), n, name)?;
    // SAFETY: the pointer is aligned for `T` and `n * size_of::<T>()` bytes are in
    // bounds of `bytes` (`fits`), borrowed for 'a; `T: Plain`, so every bit pattern read
    // is a valid `T`.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), n) })
}

/// The first `n` elements of `bytes` as `T`, writable.
fn cast_mut<'a, T: Plain>(
    bytes: &'a mut [u8],
    n: usize,
    name: &'static str,
) -> Result<&'a mut [T]> {
    fits::<T>(bytes.as_ptr().addr(), bytes.len(), n, name)?;
    // SAFETY: as in `cast`, with `bytes` borrowed mutably (so exclusively) for 'a; a `T`
    // has no padding, so any `T` written leaves valid bytes.
    Ok(unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<T>(), n) })
}

fn f32_mut<'a>(v: DeviceViewMut<'a>, n: usize, name: &'static str) -> Result<&'a mut [f32]> {
    cast_mut(host_mut(v, name)?, n, name)
}

fn grads_of<'a>(bytes: &'a [u8], dtype: DType, n: usize) -> Result<Grads<'a>> {
    Ok(match dtype {
        DType::F32 => Grads::F32(cast(bytes, n, "grads")?),
        DType::F16 => Grads::F16(cast(bytes, n, "grads")?),
        DType::BF16 => Grads::Bf16(cast(bytes, n, "grads")?),
        DType::Q8 => return Err(q8_view("grads")),
    })
}

fn out_of(bits: &mut [u16], dtype: DType) -> Result<ParamOut<'_>> {
    match dtype {
        DType::F16 => Ok(ParamOut::F16(bits.reinterpret_cast_mut())),
        DType::BF16 => Ok(ParamOut::Bf16(bits.reinterpret_cast_mut())),
        DType::F32 => Err(out_f32()),
        DType::Q8 => Err(q8_view("out")),
    }
}

/// Host views: the CPU kernel where they are.
pub(crate) fn step_host(
    cpu: &AdamW,
    state: StepState,
    hp: &HyperParams,
    s: DeviceSlices<'_>,
) -> Result<()> {
    // All checks first (kinds, lengths, alignment), so an error changes nothing; the
    // conversions below cannot fail after them.
    s.check()?;
    let n = s.len;
    let p = f32_mut(s.master, n, "master")?;
    let (m, v) = (host_mut(s.m, "m")?, host_mut(s.v, "v")?);
    let mv = moments_host(s.moments, m, v, n)?;
    match s.grads {
        DeviceGrads::Separate { grads, dtype, out } => {
            let gb = match grads {
                DeviceView::Host(b) => b,
                DeviceView::Cuda(_) => return Err(mixed("grads", false)),
            };
            let grads = grads_of(gb, dtype, n)?;
            let out = match out {
                None => None,
                Some((o, d)) => Some(out_of(cast_mut(host_mut(o, "out")?, n, "out")?, d)?),
            };
            cpu.step_moments(state, hp, p, mv, grads, out)
        }
        DeviceGrads::InPlace { bytes, dtype } => {
            let bits = cast_mut::<u16>(host_mut(bytes, "bytes")?, n, "bytes")?;
            step_in_place(cpu, state, hp, (p, mv), bits, dtype)
        }
    }
}

/// One host moment view of `n` elements in `form`.
fn moment_host<'a>(
    form: MomentForm,
    bytes: &'a mut [u8],
    n: usize,
    name: &'static str,
) -> Result<MomentHost<'a>> {
    Ok(match form {
        MomentForm::F32 => MomentHost::F32(cast_mut(bytes, n, name)?),
        MomentForm::BF16 => MomentHost::Bf16(cast_mut(bytes, n, name)?),
        MomentForm::Int8 => {
            let (codes, rest) = bytes.split_at_mut(n.next_multiple_of(4).min(bytes.len()));
            let absmax = cast_mut(rest, absmax_len(n), name)?;
            if codes.len() < n {
                return Err(short(name, codes.len(), n));
            }
            MomentHost::Int8(Q8Mut {
                codes: &mut codes[..n],
                absmax,
            })
        }
    })
}

enum MomentHost<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [half::bf16]),
    Int8(Q8Mut<'a>),
}

/// M and V host views as the CPU kernel's [`Moments`].
fn moments_host<'a>(
    form: MomentForm,
    m: &'a mut [u8],
    v: &'a mut [u8],
    n: usize,
) -> Result<Moments<'a>> {
    Ok(
        match (moment_host(form, m, n, "m")?, moment_host(form, v, n, "v")?) {
            (MomentHost::F32(m), MomentHost::F32(v)) => Moments::F32 { m, v },
            (MomentHost::Bf16(m), MomentHost::Bf16(v)) => Moments::Bf16 { m, v },
            (MomentHost::Int8(m), MomentHost::Int8(v)) => Moments::Int8 { m, v },
            _ => unreachable!("both views were read in one form"),
        },
    )
}

/// Smallest piece of an in-place step (elements): the gradient of one piece is staged
/// in a per-thread buffer, then the piece is stepped with its output over the gradient.
/// A piece is `threads * block_params` of the CPU kernel when that is larger (every
/// thread gets a block), at most [`IN_PLACE_PIECE_MAX`].
pub const IN_PLACE_PIECE_MIN: usize = 128 * 1024;

/// Largest piece of an in-place step (elements): the staging buffer, kept per calling
/// thread, never exceeds 8 MiB.
pub const IN_PLACE_PIECE_MAX: usize = 4 * 1024 * 1024;

thread_local! {
    /// The staging buffer of in-place steps on this thread: grown once to the piece
    /// size (at most [`IN_PLACE_PIECE_MAX`] elements), then reused for the thread's life. Taken out while in use, so a nested call (a rayon worker that
    /// steals another step while waiting) gets its own instead of a panic.
    static STAGING: Cell<Vec<u16>> = const { Cell::new(Vec::new()) };
}

/// 16-bit gradients read from `bits`, then the new parameters written over them: piece
/// by piece, each piece's gradient first copied aside, so the results are those of
/// [`AdamW::step_slice`] with a separate copy (the step is element-wise).
fn step_in_place(
    cpu: &AdamW,
    state: StepState,
    hp: &HyperParams,
    (p, mut mv): (&mut [f32], Moments<'_>),
    bits: &mut [u16],
    dtype: DType,
) -> Result<()> {
    let n = p.len();
    if n == 0 {
        // Nothing to stage; the kernel still checks `hp`.
        return cpu.step_moments(state, hp, p, mv, Grads::F32(&[]), None);
    }
    // Enough for every thread of the pool to get whole blocks.
    let piece = cpu
        .threads()
        .saturating_mul(cpu.block_params())
        .clamp(IN_PLACE_PIECE_MIN, IN_PLACE_PIECE_MAX)
        // Whole quantization blocks (both bounds are multiples of 256).
        .next_multiple_of(Q8_BLOCK)
        .min(IN_PLACE_PIECE_MAX)
        .min(n);
    let mut stage = STAGING.take();
    if stage.len() < piece {
        stage.resize(piece, 0);
    }
    let mut run = || -> Result<()> {
        for lo in (0..n).step_by(piece) {
            let hi = n.min(lo + piece);
            stage[..hi - lo].copy_from_slice(&bits[lo..hi]);
            let g = &stage[..hi - lo];
            let grads = match dtype {
                DType::F16 => Grads::F16(g.reinterpret_cast()),
                DType::BF16 => Grads::Bf16(g.reinterpret_cast()),
                DType::F32 => return Err(in_place_f32()),
                DType::Q8 => return Err(q8_view("bytes")),
            };
            let out = out_of(&mut bits[lo..hi], dtype)?;
            cpu.step_moments(
                state,
                hp,
                &mut p[lo..hi],
                mv.range(lo..hi),
                grads,
                Some(out),
            )?;
        }
        Ok(())
    };
    let r = run();
    STAGING.set(stage);
    r
}
