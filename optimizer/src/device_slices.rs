//! Device views of one step's arrays and the checks they pass before anything is read
//! or written: [`DeviceGroup`] (whole allocations), [`DeviceSlices`] (a range of device
//! views, M and V in their stored form, see [`moment_view_bytes`]), and the proof
//! (`CudaPtrs`) that CUDA views passed every check, which the GPU kernel takes.
//!
//! Invariants of one call over device views, checked before anything is read or written:
//! every view is of one kind (all host bytes, or all CUDA pointers, as `master`); each
//! holds at least `len` elements of its dtype and is aligned to that element; the views
//! do not overlap, except the in-place gradient, which *is* the 16-bit output. A failed
//! check is a typed error naming the view ([`OptimError::LengthMismatch`] for a short
//! view, [`OptimError::DeviceView`] otherwise) and nothing is changed.

use std::marker::PhantomData;

use tidestore_tiers::{DeviceMem, DeviceView, DeviceViewMut};

use crate::error::{OptimError, Result};
use crate::quant::{absmax_len, MomentForm};
use crate::slices::DType;

/// Bytes of one moment view of `len` elements stored as `form`, and the alignment its
/// start needs: fp32 `4 * len` (4), bf16 `2 * len` (2), int8 the `len` codes, padding
/// to a multiple of 4 bytes, then `absmax_len(len)` f32 (4) — the chunk layout's Q8
/// place, whose absmax starts at byte `len.next_multiple_of(4)`.
pub fn moment_view_bytes(form: MomentForm, len: usize) -> (usize, usize) {
    match form {
        MomentForm::F32 => (4 * len, 4),
        MomentForm::BF16 => (2 * len, 2),
        MomentForm::Int8 => (len.next_multiple_of(4) + 4 * absmax_len(len), 4),
    }
}

/// A group whose arrays are device memory.
#[derive(Debug)]
pub struct DeviceGroup<'a> {
    /// Parameters in the group.
    pub len: usize,
    /// fp32 master parameters (at least `4 * len` bytes).
    pub master: &'a mut DeviceMem,
    /// First moments.
    pub m: &'a mut DeviceMem,
    /// Second moments.
    pub v: &'a mut DeviceMem,
    /// Gradients, `len` elements of `grad_dtype`.
    pub grads: &'a DeviceMem,
    /// Their dtype.
    pub grad_dtype: DType,
    /// 16-bit parameters to refresh, and their dtype (F16 or Bf16).
    pub out: Option<(&'a mut DeviceMem, DType)>,
}

/// 16-bit (or f32) gradients on the device, and where the new 16-bit parameters go.
#[derive(Debug)]
pub enum DeviceGrads<'a> {
    /// Gradients in their own memory, `dtype`; new 16-bit params to `out` if given.
    Separate {
        /// `len` gradients of `dtype`.
        grads: DeviceView<'a>,
        /// Their dtype.
        dtype: DType,
        /// 16-bit parameters to refresh, and their dtype (F16 or Bf16).
        out: Option<(DeviceViewMut<'a>, DType)>,
    },
    /// 16-bit gradients (`dtype`, F16 or Bf16) read from these bytes, then the new
    /// parameters written over them, same dtype.
    InPlace {
        /// `len` elements of `dtype`: the gradient before the call, the new parameters
        /// after it.
        bytes: DeviceViewMut<'a>,
        /// F16 or Bf16.
        dtype: DType,
    },
}

/// One tensor's (or any range's) arrays as device views: all host bytes of the
/// simulated device, or all CUDA memory of the GPU kernel's device. Views may be longer
/// than needed; the first `len` elements of each are used.
#[derive(Debug)]
pub struct DeviceSlices<'a> {
    /// Parameters in the range.
    pub len: usize,
    /// fp32 master parameters (at least `4 * len` bytes, 4-aligned).
    pub master: DeviceViewMut<'a>,
    /// How `m` and `v` are stored (the form this tensor actually uses, see
    /// [`MomentForm::for_len`]); see [`moment_view_bytes`] for each form's bytes.
    pub moments: MomentForm,
    /// First moments, in the form `moments`.
    pub m: DeviceViewMut<'a>,
    /// Second moments (as `m`).
    pub v: DeviceViewMut<'a>,
    /// The gradients, and where the new 16-bit parameters go.
    pub grads: DeviceGrads<'a>,
}

impl<'a> From<DeviceGroup<'a>> for DeviceSlices<'a> {
    /// The whole allocations, from offset 0.
    fn from(g: DeviceGroup<'a>) -> Self {
        DeviceSlices {
            len: g.len,
            master: g.master.view_mut(),
            moments: MomentForm::F32,
            m: g.m.view_mut(),
            v: g.v.view_mut(),
            grads: DeviceGrads::Separate {
                grads: g.grads.view(),
                dtype: g.grad_dtype,
                out: g.out.map(|(o, d)| (o.view_mut(), d)),
            },
        }
    }
}

// ---------------------------------------------------------------------------------------
// Checks shared by both paths.

/// What the checks need to know of one view: its name in [`DeviceSlices`], its kind, its
/// first address and length, and the size of its elements.
#[derive(Debug, Clone, Copy)]
struct Span {
    name: &'static str,
    cuda: bool,
    addr: u64,
    len_bytes: usize,
    elem_bytes: usize,
    /// For a moment view in a compact form: the bytes `len` elements take (then
    /// `elem_bytes` is the alignment).
    form: Option<MomentForm>,
}

impl Span {
    /// `view`: (is CUDA, first address, bytes), from [`parts`] or [`parts_mut`].
    fn new(name: &'static str, view: (bool, u64, usize), elem_bytes: usize) -> Self {
        let (cuda, addr, len_bytes) = view;
        Span {
            name,
            cuda,
            addr,
            len_bytes,
            elem_bytes,
            form: None,
        }
    }

    /// A moment view stored as `form`.
    fn moment(name: &'static str, view: (bool, u64, usize), form: MomentForm) -> Self {
        let (_, align) = moment_view_bytes(form, 0);
        Span {
            form: Some(form),
            ..Span::new(name, view, align)
        }
    }

    /// Bytes `n` elements take.
    fn need_bytes(&self, n: usize) -> usize {
        match self.form {
            Some(f) => moment_view_bytes(f, n).0,
            None => n * self.elem_bytes,
        }
    }

    /// Of `cuda`'s kind, at least `n` elements, aligned to one element.
    fn check(&self, cuda: bool, n: usize) -> Result<()> {
        if self.cuda != cuda {
            return Err(mixed(self.name, cuda));
        }
        if let Some(form @ MomentForm::Int8) = self.form {
            let need = self.need_bytes(n);
            if self.len_bytes < need {
                return Err(OptimError::DeviceView {
                    view: self.name,
                    reason: format!(
                        "holds {} bytes; {form} moments of {n} elements take {need}",
                        self.len_bytes
                    ),
                });
            }
        }
        let have = self.len_bytes / self.elem_bytes;
        if self.form != Some(MomentForm::Int8) && have < n {
            return Err(short(self.name, have, n));
        }
        let off = self.addr % self.elem_bytes as u64;
        if off != 0 {
            return Err(misaligned(self.name, off));
        }
        Ok(())
    }

    /// The bytes the step touches (after [`Span::check`], so no overflow).
    fn used(&self, n: usize) -> std::ops::Range<u64> {
        self.addr..self.addr.saturating_add(self.need_bytes(n) as u64)
    }
}

fn parts(v: &DeviceView<'_>) -> (bool, u64, usize) {
    match v {
        DeviceView::Host(b) => (false, b.as_ptr().addr() as u64, b.len()),
        DeviceView::Cuda(span) => (true, span.ptr(), span.len_bytes()),
    }
}

fn parts_mut(v: &DeviceViewMut<'_>) -> (bool, u64, usize) {
    match v {
        DeviceViewMut::Host(b) => (false, b.as_ptr().addr() as u64, b.len()),
        DeviceViewMut::Cuda(span) => (true, span.ptr(), span.len_bytes()),
    }
}

/// A view of the other kind than `master` (`cuda`: the kind of `master`).
pub(crate) fn mixed(view: &'static str, cuda: bool) -> OptimError {
    let (this, master) = if cuda {
        ("host (simulated)", "CUDA")
    } else {
        ("CUDA", "host (simulated)")
    };
    OptimError::DeviceView {
        view,
        reason: format!(
            "is {this} memory but `master` is {master} memory: one call's views must all be on one device"
        ),
    }
}

pub(crate) fn short(name: &'static str, have: usize, n: usize) -> OptimError {
    OptimError::LengthMismatch {
        slice: name,
        len: have,
        reference: "len",
        expected: n,
    }
}

pub(crate) fn misaligned(view: &'static str, off: u64) -> OptimError {
    OptimError::DeviceView {
        view,
        reason: format!(
            "starts {off} bytes past a multiple of its element size (f32: 4, f16/bf16: 2)"
        ),
    }
}

fn overlap(view: &'static str, bytes: u64) -> OptimError {
    OptimError::DeviceView {
        view,
        reason: format!(
            "overlaps another view of the call by {bytes} bytes (only in-place gradients may share the output's bytes)"
        ),
    }
}

/// [`DType::Q8`] named as a gradient or parameter dtype: it is the form of a moment.
pub(crate) fn q8_view(view: &'static str) -> OptimError {
    OptimError::DeviceView {
        view,
        reason: "is q8, a moment form: gradients and parameters are f32, f16 or bf16".into(),
    }
}

pub(crate) fn out_f32() -> OptimError {
    OptimError::DeviceView {
        view: "out",
        reason: "is F32: the output is 16-bit only (F16 or Bf16)".into(),
    }
}

pub(crate) fn in_place_f32() -> OptimError {
    OptimError::DeviceView {
        view: "bytes",
        reason: "is F32 in place: in-place gradients are 16-bit (F16 or Bf16), the new parameters are written over them in the same dtype".into(),
    }
}

/// The checked spans of one call: master, m, v, the gradient, and the 16-bit output when
/// it has its own memory (`None` in place or without output).
#[derive(Debug)]
pub(crate) struct Spans {
    cuda: bool,
    all: [Option<Span>; 5],
}

impl DeviceSlices<'_> {
    /// Every check of the module's invariants, before anything is touched.
    pub(crate) fn check(&self) -> Result<Spans> {
        let n = self.len;
        let master = Span::new("master", parts_mut(&self.master), 4);
        let cuda = master.cuda;
        let m = Span::moment("m", parts_mut(&self.m), self.moments);
        let v = Span::moment("v", parts_mut(&self.v), self.moments);
        let (g, out) = match &self.grads {
            DeviceGrads::Separate { grads, dtype, out } => {
                let out = match out {
                    None => None,
                    Some((_, DType::F32)) => return Err(out_f32()),
                    Some((_, DType::Q8)) => return Err(q8_view("out")),
                    Some((o, _)) => Some(Span::new("out", parts_mut(o), 2)),
                };
                if *dtype == DType::Q8 {
                    return Err(q8_view("grads"));
                }
                let elem = dtype.size_bytes() as usize;
                (Span::new("grads", parts(grads), elem), out)
            }
            DeviceGrads::InPlace {
                dtype: DType::F32, ..
            } => return Err(in_place_f32()),
            DeviceGrads::InPlace {
                dtype: DType::Q8, ..
            } => return Err(q8_view("bytes")),
            DeviceGrads::InPlace { bytes, .. } => (Span::new("bytes", parts_mut(bytes), 2), None),
        };
        let all = [Some(master), Some(m), Some(v), Some(g), out];
        for s in all.iter().flatten() {
            s.check(cuda, n)?;
        }
        for (i, a) in all.iter().enumerate() {
            for b in all[..i].iter().flatten() {
                if let Some(a) = a {
                    let (ra, rb) = (a.used(n), b.used(n));
                    let common = ra.end.min(rb.end).saturating_sub(ra.start.max(rb.start));
                    if common > 0 {
                        return Err(overlap(a.name, common));
                    }
                }
            }
        }
        Ok(Spans { cuda, all })
    }
}

impl<'a> DeviceSlices<'a> {
    /// The device pointers of CUDA views, checked; they stay borrowed as long as the
    /// result lives.
    pub(crate) fn into_cuda(self) -> Result<CudaPtrs<'a>> {
        let spans = self.check()?;
        if !spans.cuda {
            return Err(OptimError::DeviceView {
                view: "master",
                reason: "is host (simulated) memory, handed to the GPU kernel".into(),
            });
        }
        let addr = |i: usize| spans.all[i].map_or(0, |s| s.addr);
        let (g_dtype, out) = match &self.grads {
            DeviceGrads::Separate { dtype, out, .. } => {
                (*dtype, out.as_ref().map(|(_, d)| (addr(4), *d)))
            }
            DeviceGrads::InPlace { dtype, .. } => (*dtype, Some((addr(3), *dtype))),
        };
        let absmax = |i: usize| match self.moments {
            MomentForm::Int8 => addr(i) + self.len.next_multiple_of(4) as u64,
            _ => 0,
        };
        Ok(CudaPtrs {
            args: CudaArgs {
                n: self.len,
                moments: self.moments,
                p: addr(0),
                m: addr(1),
                v: addr(2),
                ma: absmax(1),
                va: absmax(2),
                g: addr(3),
                g_dtype,
                out,
            },
            _views: PhantomData,
        })
    }
}

/// The kernel arguments of one GPU step.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct CudaArgs {
    /// Elements.
    pub(crate) n: usize,
    /// The form of M and V.
    pub(crate) moments: MomentForm,
    /// fp32 master (`4 * n` bytes), M and V (`moment_view_bytes(moments, n)` bytes each),
    /// aligned, pairwise disjoint.
    pub(crate) p: u64,
    pub(crate) m: u64,
    pub(crate) v: u64,
    /// Int8: the absmax arrays inside the M and V views (0 otherwise).
    pub(crate) ma: u64,
    pub(crate) va: u64,
    /// At least `n` gradients of `g_dtype`, aligned, disjoint from `p`, `m`, `v`.
    pub(crate) g: u64,
    pub(crate) g_dtype: DType,
    /// At least `n` 16-bit elements of this dtype, 2-aligned, disjoint from `p`, `m`,
    /// `v`; either disjoint from `g` or equal to it (in place, `g_dtype` the same dtype).
    pub(crate) out: Option<(u64, DType)>,
}

/// Device pointers of CUDA views that passed every check of [`DeviceSlices`], holding
/// the views' borrows for `'a`. Only [`DeviceSlices::into_cuda`] makes one (the private
/// field), so holding one is the proof that [`CudaArgs`]' documented contract holds and
/// that the memory stays borrowed while it lives.
#[derive(Debug)]
pub(crate) struct CudaPtrs<'a> {
    args: CudaArgs,
    _views: PhantomData<&'a mut [u8]>,
}

impl CudaPtrs<'_> {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn args(&self) -> &CudaArgs {
        &self.args
    }
}
