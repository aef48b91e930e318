//! Raw views handed from the safe drivers to the kernels, and the dtype codes the
//! kernels are monomorphised on.
//!
//! Invariant kept by every constructor in [`crate::cpu`]: each pointer comes from a
//! live slice of exactly `len` elements (the `u8`/`u16` pointers are reinterpreted per
//! the dtype code), the mutable ones are exclusive for the kernel call, and no two
//! mutable views overlap (they come from distinct `&mut` slices).

use crate::slices::{Grads, ParamOut};

/// Gradient dtype codes (const generic `GK`).
pub(crate) const G_F32: u8 = 0;
pub(crate) const G_F16: u8 = 1;
pub(crate) const G_BF16: u8 = 2;

/// 16-bit output codes (const generic `OK`).
pub(crate) const O_NONE: u8 = 0;
pub(crate) const O_F16: u8 = 1;
pub(crate) const O_BF16: u8 = 2;

/// One contiguous span of a step: `len` elements of each array.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepPtrs {
    pub p: *mut f32,
    pub m: *mut f32,
    pub v: *mut f32,
    /// `f32`, `f16` or `bf16` elements per the `GK` code.
    pub g: *const u8,
    /// `f16` or `bf16` bits per the `OK` code; dangling and unused for `O_NONE`.
    pub out: *mut u16,
    pub len: usize,
}

/// Dtype code and base pointer of a gradient slice.
pub(crate) fn grad_raw(g: Grads<'_>) -> (u8, *const u8) {
    match g {
        Grads::F32(s) => (G_F32, s.as_ptr().cast()),
        Grads::F16(s) => (G_F16, s.as_ptr().cast()),
        Grads::Bf16(s) => (G_BF16, s.as_ptr().cast()),
    }
}

/// Dtype code and base pointer of an optional 16-bit output slice.
pub(crate) fn out_raw(o: Option<ParamOut<'_>>) -> (u8, *mut u16) {
    match o {
        None => (O_NONE, std::ptr::NonNull::<u16>::dangling().as_ptr()),
        Some(ParamOut::F16(s)) => (O_F16, s.as_mut_ptr().cast()),
        Some(ParamOut::Bf16(s)) => (O_BF16, s.as_mut_ptr().cast()),
    }
}

/// Calls `path::<GK, OK, L2>(args)` for the runtime codes `(gk, ok, l2)`.
macro_rules! dispatch_step {
    ($($f:ident)::+, $gk:expr, $ok:expr, $l2:expr, ($($arg:expr),*)) => {{
        use $crate::cpu::raw::{G_BF16, G_F16, G_F32, O_BF16, O_F16, O_NONE};
        match ($gk, $ok, $l2) {
            (G_F32, O_NONE, false) => $($f)::+::<G_F32, O_NONE, false>($($arg),*),
            (G_F32, O_F16, false) => $($f)::+::<G_F32, O_F16, false>($($arg),*),
            (G_F32, O_BF16, false) => $($f)::+::<G_F32, O_BF16, false>($($arg),*),
            (G_F16, O_NONE, false) => $($f)::+::<G_F16, O_NONE, false>($($arg),*),
            (G_F16, O_F16, false) => $($f)::+::<G_F16, O_F16, false>($($arg),*),
            (G_F16, O_BF16, false) => $($f)::+::<G_F16, O_BF16, false>($($arg),*),
            (G_BF16, O_NONE, false) => $($f)::+::<G_BF16, O_NONE, false>($($arg),*),
            (G_BF16, O_F16, false) => $($f)::+::<G_BF16, O_F16, false>($($arg),*),
            (G_BF16, O_BF16, false) => $($f)::+::<G_BF16, O_BF16, false>($($arg),*),
            (G_F32, O_NONE, true) => $($f)::+::<G_F32, O_NONE, true>($($arg),*),
            (G_F32, O_F16, true) => $($f)::+::<G_F32, O_F16, true>($($arg),*),
            (G_F32, O_BF16, true) => $($f)::+::<G_F32, O_BF16, true>($($arg),*),
            (G_F16, O_NONE, true) => $($f)::+::<G_F16, O_NONE, true>($($arg),*),
            (G_F16, O_F16, true) => $($f)::+::<G_F16, O_F16, true>($($arg),*),
            (G_F16, O_BF16, true) => $($f)::+::<G_F16, O_BF16, true>($($arg),*),
            (G_BF16, O_NONE, true) => $($f)::+::<G_BF16, O_NONE, true>($($arg),*),
            (G_BF16, O_F16, true) => $($f)::+::<G_BF16, O_F16, true>($($arg),*),
            (G_BF16, O_BF16, true) => $($f)::+::<G_BF16, O_BF16, true>($($arg),*),
            _ => unreachable!("dtype codes come from grad_raw/out_raw"),
        }
    }};
}

/// Calls `path::<GK>(args)` (or `path::<GK, N>(args)`, given `<N>`) for the runtime
/// gradient code `gk`.
macro_rules! dispatch_grad {
    ($($f:ident)::+, $gk:expr, ($($arg:expr),*)) => {{
        use $crate::cpu::raw::{G_BF16, G_F16, G_F32};
        match $gk {
            G_F32 => $($f)::+::<G_F32>($($arg),*),
            G_F16 => $($f)::+::<G_F16>($($arg),*),
            G_BF16 => $($f)::+::<G_BF16>($($arg),*),
            _ => unreachable!("dtype codes come from grad_raw"),
        }
    }};
    ($($f:ident)::+, $gk:expr, <$n:ident>, ($($arg:expr),*)) => {{
        use $crate::cpu::raw::{G_BF16, G_F16, G_F32};
        match $gk {
            G_F32 => $($f)::+::<G_F32, $n>($($arg),*),
            G_F16 => $($f)::+::<G_F16, $n>($($arg),*),
            G_BF16 => $($f)::+::<G_BF16, $n>($($arg),*),
            _ => unreachable!("dtype codes come from grad_raw"),
        }
    }};
}

/// Calls `path::<OK>(args)` for the runtime output code `ok` (never `O_NONE`).
macro_rules! dispatch_out {
    ($($f:ident)::+, $ok:expr, ($($arg:expr),*)) => {{
        use $crate::cpu::raw::{O_BF16, O_F16};
        match $ok {
            O_F16 => $($f)::+::<O_F16>($($arg),*),
            O_BF16 => $($f)::+::<O_BF16>($($arg),*),
            _ => unreachable!("output codes come from out_raw with Some"),
        }
    }};
}

/// Calls `path::<GK, OK>(args)` for the runtime codes (probe kernels).
macro_rules! dispatch_grad_out {
    ($($f:ident)::+, $gk:expr, $ok:expr, ($($arg:expr),*)) => {{
        use $crate::cpu::raw::{G_BF16, G_F16, G_F32, O_BF16, O_F16, O_NONE};
        match ($gk, $ok) {
            (G_F32, O_NONE) => $($f)::+::<G_F32, O_NONE>($($arg),*),
            (G_F32, O_F16) => $($f)::+::<G_F32, O_F16>($($arg),*),
            (G_F32, O_BF16) => $($f)::+::<G_F32, O_BF16>($($arg),*),
            (G_F16, O_NONE) => $($f)::+::<G_F16, O_NONE>($($arg),*),
            (G_F16, O_F16) => $($f)::+::<G_F16, O_F16>($($arg),*),
            (G_F16, O_BF16) => $($f)::+::<G_F16, O_BF16>($($arg),*),
            (G_BF16, O_NONE) => $($f)::+::<G_BF16, O_NONE>($($arg),*),
            (G_BF16, O_F16) => $($f)::+::<G_BF16, O_F16>($($arg),*),
            (G_BF16, O_BF16) => $($f)::+::<G_BF16, O_BF16>($($arg),*),
            _ => unreachable!("dtype codes come from grad_raw/out_raw"),
        }
    }};
}
