//! Where each group is updated: on the GPU when its arrays are device memory of a CUDA
//! device, on the CPU otherwise (host memory or the device simulation), and the report
//! that says which.
//!
//! [`HybridAdamW::step_resident`] takes groups as they are resident — host slices
//! ([`ResidentGroup::Host`]) or device memory ([`ResidentGroup::Device`]) — and updates
//! each where its data is. Bringing a group's data there (from NVMe included) is the
//! chunk store's work, driven by the step loop of `tidestore-train`; this module only
//! computes. [`HybridAdamW::step_device_slices`] does the same for one range of device
//! views ([`DeviceSlices`]: a tensor at an offset inside its chunks), with the 16-bit
//! gradient either in its own memory or in the very bytes the new 16-bit parameters are
//! written to ([`DeviceGrads::InPlace`]). A whole-chunk [`DeviceGroup`] is converted
//! into [`DeviceSlices`] and takes the same path.
//!
//! M and V are views in the tensor's stored form ([`DeviceSlices::moments`]: fp32,
//! bf16, or int8 codes + absmax as the layout places them, [`moment_view_bytes`]); the
//! GPU runs the matching kernel, the simulation [`AdamW::step_moments`].
//!
//! With the simulated device (no GPU, or no `cuda` feature) device memory is updated by
//! the CPU kernel over the simulation's host bytes and reported as `Gpu` with
//! `simulated: true`, so every path above runs everywhere. Memory on a CUDA device with
//! no usable GPU kernel is an error naming why ([`OptimError::NotCompiledWithCuda`],
//! [`OptimError::NoGpu`]), never a silent skip.
//!
//! Invariants of one call over device views, checked before anything is read or written:
//! every view is of one kind (all host bytes, or all CUDA pointers, as `master`); each
//! holds at least `len` elements of its dtype and is aligned to that element; the views
//! do not overlap, except the in-place gradient, which *is* the 16-bit output. A failed
//! check is a typed error naming the view ([`OptimError::LengthMismatch`] for a short
//! view, [`OptimError::DeviceView`] otherwise) and nothing is changed.

use std::cell::Cell;
use std::marker::PhantomData;

use half::slice::HalfBitsSliceExt;
use tidestore_tiers::{DeviceMem, DeviceView, DeviceViewMut};

use crate::cpu::AdamW;
use crate::error::{OptimError, Result};
use crate::gpu::GpuAdamW;
use crate::group::ParamGroup;
use crate::moments::{Moments, Q8Mut};
use crate::params::{HyperParams, StepState};
use crate::quant::{absmax_len, StateType, Q8_BLOCK};
use crate::slices::{Dtype, Grads, ParamOut};

/// Bytes of one moment view of `len` elements stored as `form`, and the alignment its
/// start needs: fp32 `4 * len` (4), bf16 `2 * len` (2), int8 the `len` codes, padding
/// to a multiple of 4 bytes, then `absmax_len(len)` f32 (4) — the chunk layout's Q8
/// place, whose absmax starts at byte `len.next_multiple_of(4)`.
pub fn moment_view_bytes(form: StateType, len: usize) -> (usize, usize) {
    match form {
        StateType::Fp32 => (4 * len, 4),
        StateType::Bf16 => (2 * len, 2),
        StateType::Int8 => (len.next_multiple_of(4) + 4 * absmax_len(len), 4),
    }
}

/// The processor that updated a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// The CPU kernel.
    Cpu,
    /// The GPU kernel (or, with `simulated`, the CPU kernel over simulated device memory).
    Gpu,
}

/// Where one group was updated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPlacement {
    /// The group's index (as the caller numbers them).
    pub group: usize,
    /// Where it was updated.
    pub placement: Placement,
    /// Its device memory is the host simulation.
    pub simulated: bool,
}

/// Group → placement for one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlacementReport {
    /// One entry per group, in the order updated.
    pub groups: Vec<GroupPlacement>,
}

impl PlacementReport {
    /// Groups updated on `p`.
    pub fn count(&self, p: Placement) -> usize {
        self.groups.iter().filter(|g| g.placement == p).count()
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
    pub grad_dtype: Dtype,
    /// 16-bit parameters to refresh, and their dtype (F16 or Bf16).
    pub out: Option<(&'a mut DeviceMem, Dtype)>,
}

/// 16-bit (or f32) gradients on the device, and where the new 16-bit parameters go.
#[derive(Debug)]
pub enum DeviceGrads<'a> {
    /// Gradients in their own memory, `dtype`; new 16-bit params to `out` if given.
    Separate {
        /// `len` gradients of `dtype`.
        grads: DeviceView<'a>,
        /// Their dtype.
        dtype: Dtype,
        /// 16-bit parameters to refresh, and their dtype (F16 or Bf16).
        out: Option<(DeviceViewMut<'a>, Dtype)>,
    },
    /// 16-bit gradients (`dtype`, F16 or Bf16) read from these bytes, then the new
    /// parameters written over them, same dtype.
    InPlace {
        /// `len` elements of `dtype`: the gradient before the call, the new parameters
        /// after it.
        bytes: DeviceViewMut<'a>,
        /// F16 or Bf16.
        dtype: Dtype,
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
    /// [`StateType::for_len`]); see [`moment_view_bytes`] for each form's bytes.
    pub moments: StateType,
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
            moments: StateType::Fp32,
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

/// A group as it is resident for this step.
#[derive(Debug)]
pub enum ResidentGroup<'a> {
    /// Arrays in host memory.
    Host {
        /// The caller's group index (for the report).
        index: usize,
        /// The arrays and hyper-parameters.
        group: ParamGroup<'a>,
    },
    /// Arrays in device memory.
    Device {
        /// The caller's group index (for the report).
        index: usize,
        /// Hyper-parameters.
        hp: HyperParams,
        /// The arrays.
        group: DeviceGroup<'a>,
    },
}

/// The CPU kernel, and the GPU kernel where one could be made.
#[derive(Debug)]
pub struct HybridAdamW {
    cpu: AdamW,
    gpu: std::result::Result<GpuAdamW, OptimError>,
}

impl HybridAdamW {
    /// The CPU kernel, with the GPU kernel of CUDA device `ordinal` when the build has
    /// CUDA and the machine a GPU (why not is kept, see [`HybridAdamW::gpu_status`]).
    pub fn new(cpu: AdamW, ordinal: usize) -> Self {
        let gpu = GpuAdamW::new(ordinal);
        if let Err(e) = &gpu {
            tracing::info!(error = %e, "GPU AdamW unavailable; device groups need the simulated device");
        }
        HybridAdamW { cpu, gpu }
    }

    /// The CPU kernel only (the GPU kernel reported as not compiled / no GPU).
    pub fn cpu_only(cpu: AdamW, why: OptimError) -> Self {
        HybridAdamW { cpu, gpu: Err(why) }
    }

    /// Ok when the GPU kernel is ready, else why not.
    pub fn gpu_status(&self) -> Result<()> {
        self.gpu.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    /// The CPU kernel.
    pub fn cpu(&self) -> &AdamW {
        &self.cpu
    }

    /// Updates every group where its data is, with one `state` for all (from
    /// [`crate::StepController::decide`]), and reports where.
    pub fn step_resident(
        &self,
        state: StepState,
        groups: &mut [ResidentGroup<'_>],
    ) -> Result<PlacementReport> {
        let mut report = PlacementReport {
            groups: Vec::with_capacity(groups.len()),
        };
        for rg in groups.iter_mut() {
            match rg {
                ResidentGroup::Host { index, group } => {
                    self.cpu.step_slice(
                        state,
                        &group.hp,
                        group.master,
                        group.m,
                        group.v,
                        group.grads,
                        group.out.as_mut().map(ParamOut::reborrow),
                    )?;
                    report.groups.push(GroupPlacement {
                        group: *index,
                        placement: Placement::Cpu,
                        simulated: false,
                    });
                }
                ResidentGroup::Device { index, hp, group } => {
                    let done =
                        self.step_device_slices(state, hp, DeviceSlices::from(reborrow(group)))?;
                    report.groups.push(GroupPlacement {
                        group: *index,
                        ..done
                    });
                }
            }
        }
        Ok(report)
    }

    /// Steps the slices where they are: the GPU kernel when they are CUDA memory, the CPU
    /// kernel over the simulation's host bytes otherwise; returns where
    /// ([`Placement::Gpu`], `simulated` true or false; `group` 0, for the caller to
    /// renumber). Finished when this returns (the GPU stream is synchronized).
    ///
    /// Every view is checked before anything is read or written: mixed host/CUDA views,
    /// a view shorter than `len` elements of its dtype, a view not aligned to its
    /// element, overlapping CUDA views, F32 in-place gradients or an F32 output are typed
    /// errors naming the view; CUDA views without a GPU kernel are the reason there is
    /// none ([`HybridAdamW::gpu_status`]). With [`DeviceGrads::InPlace`] the bits are
    /// those of [`AdamW::step_slice`] given a separate copy of the gradient.
    ///
    /// CUDA views are spans of the device tier's allocations
    /// ([`tidestore_tiers::CudaSpanMut`]): borrowed, so alive and untouched by anyone
    /// else during the call; they must be on the GPU kernel's device (the same ordinal).
    pub fn step_device_slices(
        &self,
        state: StepState,
        hp: &HyperParams,
        s: DeviceSlices<'_>,
    ) -> Result<GroupPlacement> {
        let simulated = matches!(s.master, DeviceViewMut::Host(_));
        if simulated {
            step_host(&self.cpu, state, hp, s)?;
        } else {
            let ptrs = s.into_cuda()?;
            let gpu = self.gpu.as_ref().map_err(Clone::clone)?;
            gpu.step_ptrs(state, hp, ptrs)?;
        }
        Ok(GroupPlacement {
            group: 0,
            placement: Placement::Gpu,
            simulated,
        })
    }
}

fn reborrow<'b>(g: &'b mut DeviceGroup<'_>) -> DeviceGroup<'b> {
    DeviceGroup {
        len: g.len,
        master: g.master,
        m: g.m,
        v: g.v,
        grads: g.grads,
        grad_dtype: g.grad_dtype,
        out: g.out.as_mut().map(|(o, d)| (&mut **o, *d)),
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
    form: Option<StateType>,
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
    fn moment(name: &'static str, view: (bool, u64, usize), form: StateType) -> Self {
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
        if let Some(form @ StateType::Int8) = self.form {
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
        if self.form != Some(StateType::Int8) && have < n {
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
fn mixed(view: &'static str, cuda: bool) -> OptimError {
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

fn short(name: &'static str, have: usize, n: usize) -> OptimError {
    OptimError::LengthMismatch {
        slice: name,
        len: have,
        reference: "len",
        expected: n,
    }
}

fn misaligned(view: &'static str, off: u64) -> OptimError {
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

fn out_f32() -> OptimError {
    OptimError::DeviceView {
        view: "out",
        reason: "is F32: the output is 16-bit only (F16 or Bf16)".into(),
    }
}

fn in_place_f32() -> OptimError {
    OptimError::DeviceView {
        view: "bytes",
        reason: "is F32 in place: in-place gradients are 16-bit (F16 or Bf16), the new parameters are written over them in the same dtype".into(),
    }
}

/// The checked spans of one call: master, m, v, the gradient, and the 16-bit output when
/// it has its own memory (`None` in place or without output).
#[derive(Debug)]
struct Spans {
    cuda: bool,
    all: [Option<Span>; 5],
}

impl DeviceSlices<'_> {
    /// Every check of the module's invariants, before anything is touched.
    fn check(&self) -> Result<Spans> {
        let n = self.len;
        let master = Span::new("master", parts_mut(&self.master), 4);
        let cuda = master.cuda;
        let m = Span::moment("m", parts_mut(&self.m), self.moments);
        let v = Span::moment("v", parts_mut(&self.v), self.moments);
        let (g, out) = match &self.grads {
            DeviceGrads::Separate { grads, dtype, out } => {
                let out = match out {
                    None => None,
                    Some((_, Dtype::F32)) => return Err(out_f32()),
                    Some((o, _)) => Some(Span::new("out", parts_mut(o), 2)),
                };
                (Span::new("grads", parts(grads), dtype.size_bytes()), out)
            }
            DeviceGrads::InPlace {
                dtype: Dtype::F32, ..
            } => return Err(in_place_f32()),
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
            StateType::Int8 => addr(i) + self.len.next_multiple_of(4) as u64,
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
    pub(crate) moments: StateType,
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
    pub(crate) g_dtype: Dtype,
    /// At least `n` 16-bit elements of this dtype, 2-aligned, disjoint from `p`, `m`,
    /// `v`; either disjoint from `g` or equal to it (in place, `g_dtype` the same dtype).
    pub(crate) out: Option<(u64, Dtype)>,
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

// ---------------------------------------------------------------------------------------
// The simulated device: the CPU kernel over host bytes.

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

fn grads_of<'a>(bytes: &'a [u8], dtype: Dtype, n: usize) -> Result<Grads<'a>> {
    Ok(match dtype {
        Dtype::F32 => Grads::F32(cast(bytes, n, "grads")?),
        Dtype::F16 => Grads::F16(cast(bytes, n, "grads")?),
        Dtype::Bf16 => Grads::Bf16(cast(bytes, n, "grads")?),
    })
}

fn out_of(bits: &mut [u16], dtype: Dtype) -> Result<ParamOut<'_>> {
    match dtype {
        Dtype::F16 => Ok(ParamOut::F16(bits.reinterpret_cast_mut())),
        Dtype::Bf16 => Ok(ParamOut::Bf16(bits.reinterpret_cast_mut())),
        Dtype::F32 => Err(out_f32()),
    }
}

/// Host views: the CPU kernel where they are.
fn step_host(cpu: &AdamW, state: StepState, hp: &HyperParams, s: DeviceSlices<'_>) -> Result<()> {
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
    form: StateType,
    bytes: &'a mut [u8],
    n: usize,
    name: &'static str,
) -> Result<MomentHost<'a>> {
    Ok(match form {
        StateType::Fp32 => MomentHost::F32(cast_mut(bytes, n, name)?),
        StateType::Bf16 => MomentHost::Bf16(cast_mut(bytes, n, name)?),
        StateType::Int8 => {
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
    form: StateType,
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
    dtype: Dtype,
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
                Dtype::F16 => Grads::F16(g.reinterpret_cast()),
                Dtype::Bf16 => Grads::Bf16(g.reinterpret_cast()),
                Dtype::F32 => return Err(in_place_f32()),
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
