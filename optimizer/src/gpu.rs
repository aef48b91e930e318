//! GPU AdamW (feature `cuda`): the kernel of `kernels/adamw.cu`, compiled at run time
//! with NVRTC through cudarc, launched on groups whose arrays are device memory.
//!
//! - `is_culib_present()` is asked before any CUDA or NVRTC call (cudarc panics when a
//!   library is missing); a missing libcuda, driver or GPU is [`OptimError::NoGpu`], and
//!   context creation runs under `catch_unwind` so an old driver lacking a symbol is that
//!   error too. Compile and driver failures are [`OptimError::Cuda`] with the message
//!   (the NVRTC log for a compile error); no cudarc type is public.
//! - The math is the CPU kernel's, operation for operation, with explicit roundings and
//!   `--fmad=false`: a group gives the same bits on either side.
//! - [`GpuAdamW::step`] (a whole-chunk [`DeviceGroup`]) and the tensor-slice path of
//!   [`crate::placement::HybridAdamW::step_device_slices`] both end in one pointer-based
//!   step over views checked by [`DeviceSlices`] (kind, length, alignment, overlap); it
//!   launches on the optimizer's own stream and synchronizes it before returning, so the
//!   device memory borrowed by the call is never used by the kernel after the borrow
//!   ends. In place, the gradient and output pointers are the same. The context is the device's primary context (cudarc's
//!   `CudaContext::new`), the one the device tier allocates in, so its pointers are valid.
//!
//! - Kernels are loaded as a cubin for the device's own architecture (`sm_XY`), which any
//!   driver loads; PTX, which a driver older than NVRTC refuses, only when NVRTC cannot
//!   write a cubin for the GPU ([`nvrtc`]). The NVRTC version is logged when the kernels
//!   are built.
//!
//! Every `unsafe` is an FFI call in a small function below with its `# Safety` contract.

#[path = "gpu_nvrtc.rs"]
pub mod nvrtc;
pub use nvrtc::{cubin_sm, nvrtc_available, nvrtc_version, nvrtc_version_text, KernelImage};

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, LaunchConfig,
    PushKernelArg,
};

use crate::cuda_source::{compact_kernel_names, map_table, ADAMW_COMPACT_CU};
use crate::device_slices::{CudaArgs, CudaPtrs, DeviceGroup, DeviceSlices};
use crate::error::{OptimError, Result};
use crate::params::{Consts, HyperParams, StepState};
use crate::quant::{absmax_len, MomentForm};
use crate::slices::DType;

pub use crate::cuda_source::ADAMW_CU;

/// Threads per block of the AdamW kernel.
const BLOCK_THREADS: u32 = 256;
/// Most blocks of one launch (grid-stride loop beyond).
const GRID_BLOCKS_MAX: u32 = 1 << 16;

/// The kernel's `AdamConsts`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AdamConstsRepr {
    grad_scale: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    wd_l2: f32,
    neg_lr_wd: f32,
    neg_step: f32,
    inv_sqrt_bc2: f32,
    eps: f32,
}

// SAFETY: `AdamConstsRepr` is `repr(C)` with ten f32 fields, exactly the layout of the
// kernel's `struct AdamConsts` (ten floats, no padding); it is passed by value.
unsafe impl DeviceRepr for AdamConstsRepr {}

impl From<&Consts> for AdamConstsRepr {
    fn from(c: &Consts) -> Self {
        AdamConstsRepr {
            grad_scale: c.grad_scale,
            beta1: c.beta1,
            one_minus_beta1: c.one_minus_beta1,
            beta2: c.beta2,
            one_minus_beta2: c.one_minus_beta2,
            wd_l2: c.wd_l2,
            neg_lr_wd: c.neg_lr_wd,
            neg_step: c.neg_step,
            inv_sqrt_bc2: c.inv_sqrt_bc2,
            eps: c.eps,
        }
    }
}

// ---------------------------------------------------------------------------------------
// FFI, one call per function.

/// Whether libcuda can be loaded.
#[cfg(not(feature = "cuda-linked"))]
fn culib_present() -> bool {
    // SAFETY: only tries to `dlopen` the driver library under its known names; its
    // initialisers run as in any CUDA program; no memory of ours is touched.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether libcuda is loaded: with `cuda-linked` cudarc links it, so a process that runs
/// has it (the dynamic loader would not have started the binary without libcuda.so.1).
#[cfg(feature = "cuda-linked")]
fn culib_present() -> bool {
    true
}

/// Queue one launch of `func` over `n` elements on `stream`.
///
/// # Safety
/// - `func` is one of the `adamw_*` kernels of [`ADAMW_CU`], loaded in the context of
///   `stream`, whose gradient/output dtypes match the memory behind `g` and `out`;
/// - `p`, `m`, `v` are live device memory of that context of at least `4 * n` bytes
///   each, `g` of at least `n` elements of the kernel's gradient dtype, `out` of at least
///   `n` 16-bit elements (or anything, null included, for an `_none_` kernel), each
///   aligned to its element;
/// - `p`, `m`, `v` overlap nothing else; `g` and `out` either do not overlap or are the
///   same pointer with the kernel's gradient dtype equal to its output dtype (in place:
///   each thread reads its element's gradient before writing its output there);
/// - none of them is freed, read or written by anyone else until `stream` has been
///   synchronized after this launch.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_adamw(
    stream: &CudaStream,
    func: &CudaFunction,
    p: u64,
    m: u64,
    v: u64,
    g: u64,
    out: u64,
    n: u64,
    c: AdamConstsRepr,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    let blocks = n
        .div_ceil(u64::from(BLOCK_THREADS))
        .clamp(1, u64::from(GRID_BLOCKS_MAX)) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(func);
    b.arg(&p).arg(&m).arg(&v).arg(&g).arg(&out).arg(&n).arg(&c);
    // SAFETY: forwarded from this function's contract; the argument list matches the
    // kernel's signature (five device pointers as u64, u64 n, AdamConsts by value).
    unsafe { b.launch(cfg) }.map(|_| ())
}

/// Queue one launch of a compact kernel of [`ADAMW_COMPACT_CU`] over `a.n` elements.
///
/// # Safety
/// As [`launch_adamw`], with `func` the `adamw_m16_*` (bf16 moments: `a.m`, `a.v` of
/// `2 * n` bytes) or `adamw_q8_*` (int8: `a.m`, `a.v` of `n` codes, `a.ma`, `a.va` of
/// `absmax_len(n)` f32, none overlapping) kernel matching `a.moments`, the gradient and
/// output dtypes; `maps` is the 1024-float [`map_table`] on this context.
unsafe fn launch_compact(
    stream: &CudaStream,
    func: &CudaFunction,
    a: &CudaArgs,
    out: u64,
    maps: &CudaSlice<f32>,
    c: AdamConstsRepr,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    let n = a.n as u64;
    let int8 = a.moments == MomentForm::Int8;
    // int8: one thread block of exactly 256 threads per quantization block.
    let work = if int8 {
        absmax_len(a.n) as u64
    } else {
        n.div_ceil(u64::from(BLOCK_THREADS))
    };
    let cfg = LaunchConfig {
        grid_dim: (work.clamp(1, u64::from(GRID_BLOCKS_MAX)) as u32, 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(func);
    if int8 {
        b.arg(&a.p).arg(&a.m).arg(&a.ma).arg(&a.v).arg(&a.va);
        b.arg(&a.g).arg(&out).arg(&n).arg(maps).arg(&c);
    } else {
        b.arg(&a.p)
            .arg(&a.m)
            .arg(&a.v)
            .arg(&a.g)
            .arg(&out)
            .arg(&n)
            .arg(&c);
    }
    // SAFETY: forwarded from this function's contract; the argument lists match the
    // kernels' signatures (`adamw_q8_*`: p, mc, ma, vc, va, g, out as pointers, u64 n,
    // the map table, AdamConsts; `adamw_m16_*`: p, m, v, g, out, n, AdamConsts), and the
    // q8 kernel is launched with the 256 threads it requires.
    unsafe { b.launch(cfg) }.map(|_| ())
}

// ---------------------------------------------------------------------------------------

fn cuda_err(op: &'static str, e: impl std::fmt::Display) -> OptimError {
    OptimError::Cuda {
        op,
        reason: e.to_string(),
    }
}

/// The architecture NVRTC is asked for when none is given.
const DEFAULT_ARCH: &str = "compute_86";

/// Compiles [`ADAMW_CU`] to PTX with NVRTC (`arch`: e.g. `compute_86`; `None`:
/// `compute_86`). Needs libnvrtc only, no GPU.
pub fn compile_ptx(arch: Option<&'static str>) -> Result<String> {
    compile_source(ADAMW_CU, "tidestore_adamw.cu", arch, Vec::new())
}

/// Compiles [`ADAMW_CU`] followed by [`ADAMW_COMPACT_CU`] to PTX (`arch`: e.g.
/// `compute_86`). Needs libnvrtc only, no GPU.
pub fn compile_compact_ptx(arch: Option<&'static str>) -> Result<String> {
    let source = format!("{ADAMW_CU}\n{ADAMW_COMPACT_CU}");
    compile_source(&source, "adamw_compact.cu", arch, Vec::new())
}

/// Compiles [`ADAMW_CU`] to a cubin for `sm_{major}{minor}`. Needs libnvrtc only.
pub fn compile_cubin(cc: (i32, i32)) -> Result<Vec<u8>> {
    nvrtc::compile_cubin(ADAMW_CU, "tidestore_adamw.cu", cc, &[])
}

/// Compiles the CUDA C `source` (called `file` in NVRTC's messages) to PTX text with the
/// options every tidestore kernel is built with ([`nvrtc::BASE_OPTIONS`]: no FMA
/// contraction, no flush to zero, IEEE division and square root — the roundings that make
/// a kernel give the CPU's bits) plus `options` (`arch`: e.g. `compute_86`; `None`:
/// `compute_86`). Needs libnvrtc only, no GPU.
pub fn compile_source(
    source: &str,
    file: &str,
    arch: Option<&'static str>,
    options: Vec<String>,
) -> Result<String> {
    nvrtc::compile_ptx(source, file, arch.unwrap_or(DEFAULT_ARCH), &options)
}

/// The entry point for these dtypes (`g` and `out` are f32 / f16 / bf16: the views'
/// checks refused q8 before any launch).
fn kernel_name(moments: MomentForm, g: DType, out: Option<DType>, l2: bool) -> String {
    let d = |d: DType| d.as_str();
    let kind = match moments {
        MomentForm::F32 => "",
        MomentForm::BF16 => "m16_",
        MomentForm::Int8 => "q8_",
    };
    format!(
        "adamw_{kind}{}_{}_{}",
        d(g),
        out.map_or("none", d),
        if l2 { "l2" } else { "adamw" }
    )
}

/// The GPU AdamW of one device.
pub struct GpuAdamW {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: Vec<(String, CudaFunction)>,
    /// The int8 kernels' map table ([`map_table`]) in device memory.
    maps: CudaSlice<f32>,
}

impl std::fmt::Debug for GpuAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuAdamW")
            .field("ordinal", &self.ordinal)
            .field("kernels", &self.funcs.len())
            .finish()
    }
}

impl GpuAdamW {
    /// Opens GPU `ordinal` (its primary context), compiles the kernels for its compute
    /// capability and loads them.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !culib_present() {
            return Err(OptimError::NoGpu {
                reason: "libcuda not found".into(),
            });
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| OptimError::NoGpu {
                reason: "the CUDA driver lacks a symbol cudarc needs (driver too old)".into(),
            })?
            .map_err(|e| OptimError::NoGpu {
                reason: format!("opening GPU {ordinal}: {e}"),
            })?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda_err("cuDeviceGetAttribute", e))?;
        // One module: the fp32 kernels and the compact ones (which use its helpers).
        let source = format!("{ADAMW_CU}\n{ADAMW_COMPACT_CU}");
        let image = nvrtc::build_for_device(&source, "tidestore_adamw.cu", (major, minor))?;
        let built = image.describe((major, minor));
        let module = ctx.load_module(image.into_module_image()).map_err(|e| {
            cuda_err(
                "loading the kernels",
                format!("{built} from NVRTC {}: {e}", nvrtc_version_text()),
            )
        })?;
        let mut names = Vec::with_capacity(18 + 36);
        for l2 in [false, true] {
            for g in [DType::F32, DType::F16, DType::BF16] {
                for out in [None, Some(DType::F16), Some(DType::BF16)] {
                    names.push(kernel_name(MomentForm::F32, g, out, l2));
                }
            }
        }
        names.extend(compact_kernel_names());
        let mut funcs = Vec::with_capacity(names.len());
        for name in names {
            let f = module
                .load_function(&name)
                .map_err(|e| cuda_err("cuModuleGetFunction", format!("{name}: {e}")))?;
            funcs.push((name, f));
        }
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("creating a stream", e))?;
        let maps = stream
            .clone_htod(&map_table())
            .map_err(|e| cuda_err("uploading the int8 map table", e))?;
        stream
            .synchronize()
            .map_err(|e| cuda_err("stream synchronize", e))?;
        tracing::info!(ordinal, major, minor, image = %built, nvrtc = %nvrtc_version_text(),
            "GPU AdamW ready");
        Ok(GpuAdamW {
            ordinal,
            ctx,
            stream,
            _module: module,
            funcs,
            maps,
        })
    }

    /// One AdamW / Adam-L2 step over a group in device memory, finished when this
    /// returns.
    pub fn step(&self, state: StepState, hp: &HyperParams, group: DeviceGroup<'_>) -> Result<()> {
        self.step_ptrs(state, hp, DeviceSlices::from(group).into_cuda()?)
    }

    /// One step over checked CUDA views (whole groups and tensor slices alike), finished
    /// when this returns.
    pub(crate) fn step_ptrs(
        &self,
        state: StepState,
        hp: &HyperParams,
        ptrs: CudaPtrs<'_>,
    ) -> Result<()> {
        let c = Consts::new(state, hp)?;
        let a = *ptrs.args();
        let (out, out_dtype) = match a.out {
            Some((o, d)) => (o, Some(d)),
            None => (0, None),
        };
        let name = kernel_name(a.moments, a.g_dtype, out_dtype, c.l2);
        let func = self
            .funcs
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, f)| f)
            .ok_or_else(|| cuda_err("kernel lookup", format!("{name} not loaded")))?;
        if a.n == 0 {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let consts = AdamConstsRepr::from(&c);
        let launched = match a.moments {
            // SAFETY: `func` is the kernel for `a.g_dtype` and `out_dtype`. `ptrs` comes
            // only from `DeviceSlices::into_cuda`, which checked that every view is CUDA
            // memory of at least `n` elements of its dtype, aligned to its element, with
            // `p`, `m`, `v` overlapping nothing and `out` either disjoint from `g` or
            // equal to it with the same 16-bit dtype (in place) — the launch contract.
            // The views are the device tier's memory of this ordinal's primary context,
            // the context `func` is loaded in (the contract of
            // `HybridAdamW::step_device_slices`). `ptrs` holds their borrows for the whole
            // of this call (it is an argument), which returns only after the stream is
            // synchronized below.
            MomentForm::F32 => unsafe {
                launch_adamw(
                    &self.stream,
                    func,
                    a.p,
                    a.m,
                    a.v,
                    a.g,
                    out,
                    a.n as u64,
                    consts,
                )
            },
            // SAFETY: as above, and: `func` is the kernel of `a.moments` (its name says
            // so); `into_cuda` checked the moment views' bytes in that form (for int8 the
            // codes and the absmax inside each view, `ma`/`va` pointing at the absmax);
            // `self.maps` is the map table uploaded on this context — `launch_compact`'s
            // contract.
            MomentForm::BF16 | MomentForm::Int8 => unsafe {
                launch_compact(&self.stream, func, &a, out, &self.maps, consts)
            },
        };
        launched.map_err(|e| cuda_err("kernel launch", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("stream synchronize", e))
    }
}
