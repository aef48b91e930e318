//! The bench's GPU kernels (feature `cuda`): `kernels/bench.cu` after the optimizer's
//! `half_bits.cuh`, compiled at run time with NVRTC through cudarc, run on tensors the
//! chunk store holds on a CUDA device.
//!
//! - [`BenchKernels::checksum`] adds the bench's checksum of a device range (any
//!   alignment) into a device-side u64 accumulator; [`BenchKernels::take_checksum`]
//!   reads it back (once per phase) and zeroes it. The sum is exactly the host's
//!   (`bench::checksum`): wrapping addition does not care about order.
//! - [`BenchKernels::checksum_and_fill`] does the same, then writes the bench's bf16
//!   gradient pattern over the range, element for element the bits the host generator
//!   gives (`bench::grad_value`).
//!
//! Invariants:
//! - `is_culib_present()` is asked before any CUDA or NVRTC call (cudarc panics when a
//!   library is missing), and context creation runs under `catch_unwind` (an old driver
//!   lacking a symbol). The context is the device's primary context
//!   (`CudaContext::new(ordinal)`), the one the device tier allocates chunks in, so the
//!   store's device pointers are valid here.
//! - Every method that takes a view of the store's memory synchronizes the bench's
//!   stream before it returns, so no kernel touches a tensor after the caller's borrow
//!   of the view ends — and so never after its guard is released and the store may
//!   evict or free the chunk. Those methods are `pub(crate)`: the views come from the
//!   store, under a guard, never from a caller's integer.
//! - Every `unsafe` is in a small function below with its `# Safety` contract.

#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    LaunchConfig, PushKernelArg,
};
use tidestore_optimizer::gpu::nvrtc as kernels_nvrtc;
use tidestore_tiers::{DeviceView, DeviceViewMut};

use crate::error::{Error, Result};

/// The CUDA C source of the bench's kernels; compiled as [`bench_source`].
pub const BENCH_CU: &str = include_str!("kernels/bench.cu");

/// What NVRTC compiles: the optimizer's 16-bit conversions (`HALF_BITS_CU`), which the
/// bench's gradient fill rounds with, then [`BENCH_CU`].
pub fn bench_source() -> String {
    format!(
        "{}\n{BENCH_CU}",
        tidestore_optimizer::cuda_source::HALF_BITS_CU
    )
}

/// The kernels [`BENCH_CU`] defines.
pub const KERNEL_NAMES: [&str; 2] = ["bench_checksum", "bench_grad_fill"];

/// Threads per block (a multiple of the warp size: the checksum reduces per warp).
const BLOCK_THREADS: u32 = 256;
/// Most blocks of one launch (grid-stride loops beyond).
const GRID_BLOCKS_MAX: u32 = 1 << 14;

fn cuda_err(op: &str, e: impl std::fmt::Display) -> Error {
    Error::Bench(format!("GPU kernels: {op}: {e}"))
}

// ---------------------------------------------------------------------------------------
// FFI, one call per function.

/// Whether libcuda can be loaded.
#[cfg(not(feature = "gpu"))]
pub fn cuda_available() -> bool {
    // SAFETY: only tries to `dlopen` the driver library under its known names; its
    // initialisers run as in any CUDA program; no memory of ours is touched.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether libcuda is loaded: with `gpu` cudarc links it, so a process that runs has it
/// (the dynamic loader would not have started the binary without libcuda.so.1).
#[cfg(feature = "gpu")]
pub fn cuda_available() -> bool {
    true
}

/// Whether libnvrtc can be loaded (the kernels can be compiled, GPU or not).
pub fn nvrtc_available() -> bool {
    kernels_nvrtc::nvrtc_available()
}

/// The loaded NVRTC's version (`12.4`), or why it is unknown; for logs and reports.
pub fn nvrtc_version_text() -> String {
    kernels_nvrtc::nvrtc_version_text()
}

fn launch_config(units: u64) -> LaunchConfig {
    let blocks = units
        .div_ceil(u64::from(BLOCK_THREADS))
        .clamp(1, u64::from(GRID_BLOCKS_MAX)) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Queue `bench_checksum` over `n` bytes at `ptr`, adding into `acc`.
///
/// # Safety
/// - `func` is `bench_checksum` of [`BENCH_CU`], loaded in the context of `stream`, and
///   `acc` was allocated on `stream`;
/// - `ptr .. ptr + n` is live device memory of that context (any alignment);
/// - it is not freed or written by anyone else until `stream` has been synchronized
///   after this launch.
unsafe fn launch_checksum(
    stream: &CudaStream,
    func: &CudaFunction,
    ptr: u64,
    n: u64,
    acc: &mut CudaSlice<u64>,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    let mut b = stream.launch_builder(func);
    b.arg(&ptr).arg(&n).arg(acc);
    // SAFETY: forwarded from this function's contract; the arguments match the kernel's
    // signature (const u8*, u64, u64*), and the kernel reads only inside the range.
    unsafe { b.launch(launch_config(n.div_ceil(8))) }.map(|_| ())
}

/// Queue `bench_grad_fill` of `n` bf16 elements at `ptr`.
///
/// # Safety
/// - `func` is `bench_grad_fill` of [`BENCH_CU`], loaded in the context of `stream`;
/// - `ptr` is 2-aligned and `ptr .. ptr + 2 n` is live device memory of that context;
/// - it is not freed, read or written by anyone else until `stream` has been
///   synchronized after this launch.
unsafe fn launch_grad_fill(
    stream: &CudaStream,
    func: &CudaFunction,
    ptr: u64,
    n: u64,
    seed: u64,
    first: u64,
    scale: f32,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    let mut b = stream.launch_builder(func);
    b.arg(&ptr).arg(&n).arg(&seed).arg(&first).arg(&scale);
    // SAFETY: forwarded from this function's contract; the arguments match the kernel's
    // signature (u16*, u64, u64, u64, float), and it writes only `n` elements at `ptr`.
    unsafe { b.launch(launch_config(n)) }.map(|_| ())
}

// ---------------------------------------------------------------------------------------

/// Compiles [`BENCH_CU`] to PTX with NVRTC (`arch`: e.g. `compute_86`; `None`:
/// `compute_86`). Needs libnvrtc only, no GPU.
pub fn compile_ptx(arch: Option<&'static str>) -> Result<String> {
    tidestore_optimizer::gpu::compile_source(
        &bench_source(),
        "tidestore_bench.cu",
        arch,
        Vec::new(),
    )
    .map_err(|e| Error::KernelBuild {
        nvrtc: nvrtc_version_text(),
        reason: e.to_string(),
    })
}

/// Compiles [`BENCH_CU`] to a cubin for `sm_{major}{minor}`. Needs libnvrtc only.
pub fn compile_cubin(cc: (i32, i32)) -> Result<Vec<u8>> {
    kernels_nvrtc::compile_cubin(&bench_source(), "tidestore_bench.cu", cc, &[]).map_err(|e| {
        Error::KernelBuild {
            nvrtc: nvrtc_version_text(),
            reason: e.to_string(),
        }
    })
}

/// The bench's kernels on one GPU, with their stream and checksum accumulator.
pub struct BenchKernels {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    checksum_fn: CudaFunction,
    fill_fn: CudaFunction,
    acc: CudaSlice<u64>,
}

impl std::fmt::Debug for BenchKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BenchKernels")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl BenchKernels {
    /// Opens GPU `ordinal` (its primary context), compiles the kernels for its compute
    /// capability, loads them and allocates the accumulator. No libcuda or no GPU is an
    /// error saying so.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !cuda_available() {
            return Err(cuda_err("opening the GPU", "libcuda not found"));
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| {
                cuda_err(
                    "opening the GPU",
                    "the CUDA driver lacks a symbol cudarc needs (driver too old)",
                )
            })?
            .map_err(|e| cuda_err(&format!("opening GPU {ordinal}"), e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda_err("cuDeviceGetAttribute", e))?;
        let kernel_build = |reason: String| Error::KernelBuild {
            nvrtc: nvrtc_version_text(),
            reason,
        };
        let image =
            kernels_nvrtc::build_for_device(&bench_source(), "tidestore_bench.cu", (major, minor))
                .map_err(|e| kernel_build(e.to_string()))?;
        let built = image.describe((major, minor));
        let module = ctx
            .load_module(image.into_module_image())
            .map_err(|e| kernel_build(format!("loading the {built}: {e}")))?;
        let load = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| cuda_err("cuModuleGetFunction", e))
        };
        let checksum_fn = load(KERNEL_NAMES[0])?;
        let fill_fn = load(KERNEL_NAMES[1])?;
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("creating a stream", e))?;
        let acc = stream
            .alloc_zeros::<u64>(1)
            .map_err(|e| cuda_err("allocating the accumulator", e))?;
        stream
            .synchronize()
            .map_err(|e| cuda_err("stream synchronize", e))?;
        tracing::info!(ordinal, major, minor, image = %built, nvrtc = %nvrtc_version_text(),
            "bench GPU kernels ready");
        Ok(BenchKernels {
            ordinal,
            ctx,
            stream,
            _module: module,
            checksum_fn,
            fill_fn,
            acc,
        })
    }

    /// Makes this context the calling thread's.
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))
    }

    fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("stream synchronize", e))
    }

    /// Queues the checksum of `len_bytes` at `ptr` into the accumulator.
    ///
    /// # Safety
    /// `ptr .. ptr + len_bytes` is live device memory of this context that nobody frees
    /// or writes until `self.stream` has been synchronized after this call.
    unsafe fn queue_checksum(&mut self, ptr: u64, len_bytes: usize) -> Result<()> {
        if len_bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the kernel and the accumulator are this stream's; the range is as this
        // function's contract says.
        unsafe {
            launch_checksum(
                &self.stream,
                &self.checksum_fn,
                ptr,
                len_bytes as u64,
                &mut self.acc,
            )
        }
        .map_err(|e| cuda_err("checksum launch", e))
    }

    /// Queues the gradient fill of the bf16 range `len_bytes` at `ptr`.
    ///
    /// # Safety
    /// `ptr .. ptr + len_bytes` is live device memory of this context that nobody else
    /// frees, reads or writes until `self.stream` has been synchronized after this call.
    unsafe fn queue_fill(
        &self,
        ptr: u64,
        len_bytes: usize,
        seed: u64,
        first: u64,
        scale: f32,
    ) -> Result<()> {
        if !ptr.is_multiple_of(2) || !len_bytes.is_multiple_of(2) {
            return Err(cuda_err(
                "gradient fill",
                format!("a bf16 range at {ptr:#x} of {len_bytes} bytes is not 2-aligned"),
            ));
        }
        if len_bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the kernel is this stream's; the range was checked 2-aligned above and
        // is otherwise as this function's contract says.
        unsafe {
            launch_grad_fill(
                &self.stream,
                &self.fill_fn,
                ptr,
                (len_bytes / 2) as u64,
                seed,
                first,
                scale,
            )
        }
        .map_err(|e| cuda_err("gradient fill launch", e))
    }

    /// Adds the checksum of the tensor `view` shows into the accumulator; the kernel has
    /// finished when this returns. Host bytes (the simulation) are an error: the caller
    /// sums those itself.
    pub(crate) fn checksum(&mut self, view: &DeviceView<'_>) -> Result<()> {
        let DeviceView::Cuda(span) = view else {
            return Err(cuda_err("checksum", "host bytes given to a GPU kernel"));
        };
        let (ptr, len_bytes) = (span.ptr(), span.len_bytes());
        // SAFETY: a `CudaSpan` is device-tier memory (only the tier, or an `unsafe`
        // promise, makes one), here the chunk store's view of a guarded tensor on the
        // device of this ordinal (so this primary context): live and unwritten while
        // `view` is borrowed, and the stream is synchronized below, before this returns.
        let queued = unsafe { self.queue_checksum(ptr, len_bytes) };
        // Synchronized even after an error, so nothing queued outlives the borrow.
        let synced = self.sync();
        queued.and(synced)
    }

    /// Adds the checksum of the tensor `view` shows into the accumulator, then writes
    /// the gradient pattern over it: bf16 element `k` is `bench::grad_value(seed, first
    /// + k, scale)`. Both kernels have finished when this returns.
    pub(crate) fn checksum_and_fill(
        &mut self,
        view: &mut DeviceViewMut<'_>,
        seed: u64,
        first: u64,
        scale: f32,
    ) -> Result<()> {
        let DeviceViewMut::Cuda(span) = view else {
            return Err(cuda_err(
                "gradient fill",
                "host bytes given to a GPU kernel",
            ));
        };
        let (ptr, len_bytes) = (span.ptr(), span.len_bytes());
        // SAFETY: as in `checksum`, from a mutable store view (nobody else touches the
        // range while it is borrowed); the checksum reads before the fill writes, in
        // stream order; the stream is synchronized below, before this returns.
        let queued = unsafe { self.queue_checksum(ptr, len_bytes) }
            .and_then(|()| unsafe { self.queue_fill(ptr, len_bytes, seed, first, scale) });
        let synced = self.sync();
        queued.and(synced)
    }

    /// The accumulated checksum since the last call (one device-to-host copy), and the
    /// accumulator zeroed.
    pub fn take_checksum(&mut self) -> Result<u64> {
        self.bind()?;
        let v = self
            .stream
            .clone_dtoh(&self.acc)
            .map_err(|e| cuda_err("reading the checksum", e))?;
        self.stream
            .memset_zeros(&mut self.acc)
            .map_err(|e| cuda_err("zeroing the checksum", e))?;
        self.sync()?;
        v.first()
            .copied()
            .ok_or_else(|| cuda_err("reading the checksum", "no value came back"))
    }

    /// Self-test entry (for tests on a GPU): copies `bytes` to the device at offset
    /// `lead` (0..8) of a fresh allocation, so that the range starts misaligned by
    /// `lead`, and returns the kernel's checksum of it.
    pub fn checksum_of_host_bytes(&mut self, bytes: &[u8], lead: usize) -> Result<u64> {
        let lead = lead % 8;
        if bytes.is_empty() {
            // Nothing to sum, and no allocation: `cuMemAlloc(0)` is an error.
            self.take_checksum()?;
            return Ok(0);
        }
        let mut staged = vec![0u8; lead + bytes.len()];
        staged[lead..].copy_from_slice(bytes);
        self.bind()?;
        let dev = self
            .stream
            .clone_htod(&staged)
            .map_err(|e| cuda_err("copying to the device", e))?;
        self.take_checksum()?;
        let base = {
            let (ptr, _record) = DevicePtr::device_ptr(&dev, &self.stream);
            ptr
        };
        // SAFETY: `dev` is our allocation of `lead + bytes.len()` bytes on this stream,
        // alive until the end of this function, after the stream is synchronized.
        let queued = unsafe { self.queue_checksum(base + lead as u64, bytes.len()) };
        let synced = self.sync();
        queued.and(synced)?;
        self.take_checksum()
    }

    /// Self-test entry (for tests on a GPU): the kernel's `n` gradient elements from
    /// index `first`, as bf16 bits, written into a fresh allocation.
    pub fn grad_bits(&self, seed: u64, first: u64, n: usize, scale: f32) -> Result<Vec<u16>> {
        self.bind()?;
        if n == 0 {
            // No allocation: `cuMemAlloc(0)` is an error.
            return Ok(Vec::new());
        }
        let mut dev = self
            .stream
            .alloc_zeros::<u16>(n)
            .map_err(|e| cuda_err("allocating", e))?;
        let ptr = {
            let (ptr, _record) = DevicePtrMut::device_ptr_mut(&mut dev, &self.stream);
            ptr
        };
        // SAFETY: `dev` is our allocation of `n` u16 on this stream, alive until
        // the end of this function, after the stream is synchronized.
        let queued = unsafe { self.queue_fill(ptr, n * 2, seed, first, scale) };
        let synced = self.sync();
        queued.and(synced)?;
        let mut out = self
            .stream
            .clone_dtoh(&dev)
            .map_err(|e| cuda_err("copying to the host", e))?;
        self.sync()?;
        out.truncate(n);
        Ok(out)
    }
}
