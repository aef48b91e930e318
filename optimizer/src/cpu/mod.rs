//! The CPU AdamW: SIMD kernels chosen at run time, spread over a rayon pool.
//!
//! [`AdamW`] owns (or borrows through an `Arc`) the thread pool and the SIMD level; its
//! methods check lengths and hyper-parameters, then hand contiguous blocks of
//! `block_params` elements to the kernels of the chosen [`SimdLevel`]. Nothing here
//! allocates per call, and every level computes bit-identical fp32 results (the
//! operation order is fixed in [`crate::params`]; fused multiply-adds everywhere the
//! scalar code uses `mul_add`).
//!
//! Soundness: the only `unsafe` in this file builds raw views from slices whose lengths
//! were checked equal and calls kernels of a level that [`SimdLevel::is_supported`]
//! accepted when the optimizer was built.

pub(crate) mod level;
pub(crate) mod parallel;
#[macro_use]
pub(crate) mod raw;
// After `raw`: uses its dispatch macros.
pub(crate) mod compact;
pub(crate) mod scalar;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

use std::sync::Arc;

use rayon::prelude::*;
use rayon::ThreadPool;

pub use level::{SimdLevel, SimdReason, SIMD_ENV};
use parallel::{run_blocks, AccJob, CastJob, Split, StepJob};
use raw::{grad_raw, out_raw, StepPtrs};

use crate::error::{check_len, OptimError, Result};
use crate::params::{Consts, HyperParams, StepState};
use crate::slices::{Grads, ParamOut};

/// Default parallel block: 64 Ki parameters (256 KiB of each fp32 array).
pub const BLOCK_PARAMS_DEFAULT: usize = 64 * 1024;

/// How the CPU optimizer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuConfig {
    /// Worker threads; 0 means one per available core. With 1, kernels run on the
    /// calling thread and no pool is built.
    pub threads: usize,
    /// Parameters per parallel block (rounded up to a multiple of 16; > 0).
    pub block_params: usize,
    /// Force a SIMD level (must be supported); `None` picks the level
    /// [`SIMD_ENV`] names if set, else the best this CPU supports.
    pub simd: Option<SimdLevel>,
}

impl Default for CpuConfig {
    fn default() -> Self {
        CpuConfig {
            threads: 0,
            block_params: BLOCK_PARAMS_DEFAULT,
            simd: None,
        }
    }
}

/// The CPU AdamW kernel driver. Cheap to share (`&self` methods, `Sync`).
#[derive(Debug, Clone)]
pub struct AdamW {
    level: SimdLevel,
    reason: SimdReason,
    block_params: usize,
    pool: Option<Arc<ThreadPool>>,
}

fn check_block(block_params: usize) -> Result<usize> {
    if block_params == 0 {
        return Err(OptimError::InvalidParam {
            name: "block_params",
            value: 0.0,
            reason: "must be > 0",
        });
    }
    Ok(block_params.div_ceil(16) * 16)
}

impl SimdLevel {
    /// The level an optimizer runs and why: `requested` if given, else the level
    /// [`SIMD_ENV`] names if set, else the best this CPU supports. Errors on an unknown
    /// name in the environment and on a level this CPU lacks.
    pub fn choose(requested: Option<SimdLevel>) -> Result<(SimdLevel, SimdReason)> {
        let (level, reason) = match requested {
            Some(level) => (level, SimdReason::Requested),
            None => match SimdLevel::from_env() {
                Ok(Some(level)) => (level, SimdReason::Environment),
                Ok(None) => return Ok((SimdLevel::detect(), SimdReason::Detected)),
                Err(name) => {
                    return Err(OptimError::SimdUnknown {
                        var: SIMD_ENV,
                        name,
                    })
                }
            },
        };
        if !level.is_supported() {
            return Err(OptimError::SimdUnsupported { level });
        }
        tracing::debug!(?level, reason = %reason.describe(), "CPU AdamW SIMD level forced");
        Ok((level, reason))
    }
}

impl AdamW {
    /// Builds the optimizer and, for more than one thread, its own rayon pool.
    pub fn new(cfg: CpuConfig) -> Result<Self> {
        let (level, reason) = SimdLevel::choose(cfg.simd)?;
        let block_params = check_block(cfg.block_params)?;
        let threads = if cfg.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            cfg.threads
        };
        let pool = if threads > 1 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("tidestore-adamw-{i}"))
                .build()
                .map_err(|e| OptimError::ThreadPool {
                    threads,
                    reason: e.to_string(),
                })?;
            Some(Arc::new(pool))
        } else {
            None
        };
        tracing::debug!(?level, threads, block_params, "CPU AdamW ready");
        Ok(AdamW {
            level,
            reason,
            block_params,
            pool,
        })
    }

    /// Uses a pool the caller owns (shared with other work); `cfg.threads` is ignored.
    pub fn with_pool(pool: Arc<ThreadPool>, cfg: CpuConfig) -> Result<Self> {
        let (level, reason) = SimdLevel::choose(cfg.simd)?;
        Ok(AdamW {
            level,
            reason,
            block_params: check_block(cfg.block_params)?,
            pool: Some(pool),
        })
    }

    /// The SIMD level in use.
    pub fn simd_level(&self) -> SimdLevel {
        self.level
    }

    /// Why this optimizer runs [`AdamW::simd_level`].
    pub fn simd_reason(&self) -> SimdReason {
        self.reason
    }

    /// Threads a call uses (1 when it runs on the calling thread).
    pub fn threads(&self) -> usize {
        self.pool.as_ref().map_or(1, |p| p.current_num_threads())
    }

    /// Parameters per parallel block.
    pub fn block_params(&self) -> usize {
        self.block_params
    }

    fn pool(&self) -> Option<&ThreadPool> {
        self.pool.as_deref()
    }

    /// Runs `leaf` (given this optimizer's SIMD level) over `job`'s parallel blocks of
    /// `block_params` on its pool, folding the blocks' results with `combine`: how every
    /// slice operation below spreads over the threads.
    fn run<J, R>(
        &self,
        job: J,
        leaf: impl Fn(SimdLevel, J) -> R + Sync,
        combine: impl Fn(R, R) -> R + Sync,
    ) -> R
    where
        J: Split,
        R: Send,
    {
        let level = self.level;
        run_blocks(
            self.pool(),
            self.block_params,
            job,
            &|j: J| leaf(level, j),
            &combine,
        )
    }

    /// One AdamW / Adam-L2 step over one span of parameters, in place: reads `grads`
    /// (multiplied by `state.grad_scale`), updates `master`, `m` and `v`, and writes the
    /// new parameters rounded to 16 bits into `out` when given — one pass over memory.
    ///
    /// All slices must have `master.len()` elements. The caller decides whether to step
    /// at all (overflow, see [`crate::StepController`]); this function applies whatever
    /// it is given, NaN included.
    #[allow(clippy::too_many_arguments)]
    pub fn step_slice(
        &self,
        state: StepState,
        hp: &HyperParams,
        master: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        grads: Grads<'_>,
        out: Option<ParamOut<'_>>,
    ) -> Result<()> {
        let job = StepJob::checked(master, m, v, grads, out)?;
        let c = Consts::new(state, hp)?;
        self.run(
            job,
            |level, j: StepJob<'_>| step_leaf(level, &c, j),
            |(), ()| (),
        );
        Ok(())
    }

    /// Sum of squares of the gradients, accumulated in f64 (each square is exact), for
    /// global norm clipping: add the results of every slice of every group, then
    /// [`crate::clip_coefficient`]. Non-finite exactly when some gradient is inf or NaN.
    /// The result does not depend on the thread count.
    ///
    /// The blocks and the order their sums are added in are [`AdamW::widen_grads`]'
    /// (bit for bit); [`NORM_STREAMS`] blocks are read at once, one stream each.
    pub fn grad_sq_norm(&self, grads: Grads<'_>) -> f64 {
        let block = self.block_params;
        let mut sums = vec![0.0; grads.len().div_ceil(block).max(1)];
        let level = self.level;
        let fill = |(k, out): (usize, &mut [f64])| {
            sq_norm_blocks(level, grads, block, k * NORM_STREAMS, out);
        };
        match self.pool() {
            Some(pool) if pool.current_num_threads() > 1 => {
                pool.install(|| sums.par_chunks_mut(NORM_STREAMS).enumerate().for_each(fill))
            }
            _ => sums.chunks_mut(NORM_STREAMS).enumerate().for_each(fill),
        }
        tree_sum(&sums)
    }

    /// Widens `grads` into `dst` and returns what [`AdamW::grad_sq_norm`] returns for
    /// `dst`, bit for bit (the same blocks, each summed while it is still in cache): how
    /// a gradient enters an fp32 place in one pass over memory, spread over the threads.
    /// An f32 gradient is copied with streaming stores (`dst` is not read into the cache
    /// first: a gradient place is next read at the step) and summed from its source, the
    /// same values.
    pub fn widen_grads(&self, grads: Grads<'_>, dst: &mut [f32]) -> Result<f64> {
        check_len("dst", dst.len(), "grads", grads.len())?;
        Ok(self.run(
            AccJob { acc: dst, g: grads },
            |level, j: AccJob<'_>| match j.g {
                Grads::F32(g) => {
                    copy_streaming(level, g, j.acc);
                    sq_norm_leaf(level, Grads::F32(g))
                }
                g => {
                    widen_leaf(g, j.acc);
                    sq_norm_leaf(level, Grads::F32(j.acc))
                }
            },
            |a: f64, b: f64| a + b,
        ))
    }

    /// Copies `src` into `dst`, spread over the threads (a master copy handed out).
    pub fn copy(&self, src: &[f32], dst: &mut [f32]) -> Result<()> {
        check_len("dst", dst.len(), "src", src.len())?;
        self.run(
            AccJob {
                acc: dst,
                g: Grads::F32(src),
            },
            |_, j: AccJob<'_>| widen_leaf(j.g, j.acc),
            |(), ()| (),
        );
        Ok(())
    }

    /// True when no gradient is inf or NaN (the loss-scaling overflow check).
    pub fn grads_finite(&self, grads: Grads<'_>) -> bool {
        self.run(
            grads,
            |level, g: Grads<'_>| finite_leaf(level, g),
            |a: bool, b: bool| a && b,
        )
    }

    /// Gradient accumulation over micro-batches: `acc[i] = fma(grads[i], scale, acc[i])`
    /// (use `scale = 1 / micro_batches` to average, or a loss-unscale factor).
    pub fn accumulate(&self, acc: &mut [f32], grads: Grads<'_>, scale: f32) -> Result<()> {
        check_len("grads", grads.len(), "acc", acc.len())?;
        self.run(
            AccJob { acc, g: grads },
            |level, j: AccJob<'_>| accumulate_leaf(level, j, scale),
            |(), ()| (),
        );
        Ok(())
    }

    /// Writes `src` rounded to 16 bits (bit-identical to `half`'s `from_f32`), e.g. to
    /// make the first 16-bit copy of freshly loaded master parameters.
    pub fn cast_params(&self, src: &[f32], out: ParamOut<'_>) -> Result<()> {
        check_len("out", out.len(), "src", src.len())?;
        self.run(
            CastJob { src, out },
            |level, j: CastJob<'_>| cast_leaf(level, j),
            |(), ()| (),
        );
        Ok(())
    }

    /// The memory roofline probe: moves exactly the bytes [`AdamW::step_slice`] moves for
    /// the same arguments (read and write back `master`, `m`, `v`; read `grads`; write
    /// `out`) with the same blocking and threads and almost no arithmetic. Values are left
    /// unchanged when the gradients are finite.
    pub fn probe_slice(
        &self,
        master: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        grads: Grads<'_>,
        out: Option<ParamOut<'_>>,
    ) -> Result<()> {
        self.probe_slice_keyed(ProbeKey::identity(), master, m, v, grads, out)
    }

    /// [`AdamW::probe_slice`] folding `key` into the values it moves (tests pass a key
    /// that changes every value, to see each counted byte read and written back).
    pub(crate) fn probe_slice_keyed(
        &self,
        key: ProbeKey,
        master: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        grads: Grads<'_>,
        out: Option<ParamOut<'_>>,
    ) -> Result<()> {
        let job = StepJob::checked(master, m, v, grads, out)?;
        self.run(
            job,
            |level, j: StepJob<'_>| probe_leaf(level, j, key),
            |(), ()| (),
        );
        Ok(())
    }
}

/// What the memory probes fold into every value they move, so that no load and store
/// back of a value can be dropped by the compiler as a no-op (a store of the value just
/// loaded from the same address is one, and LLVM removes it): master `p` becomes
/// `fma(g, zero, p)`, an fp32 moment `x * one`, an int8 absmax `a * one`, and
/// every byte of a compact moment `b ^ flip`. The benchmark's key ([`ProbeKey::identity`])
/// is `1, 0, 0` hidden from the optimizer, which leaves every value as it was.
///
/// `prefetch`: whether the SIMD probes prefetch their streams as the steps do
/// (`PREFETCH_BYTES` ahead). Which form is faster depends on the CPU (the step's
/// software prefetch was chosen on an Intel Xeon; on the AMD EPYC development VM the
/// plain form is faster), so the benchmark times both and takes the faster as the
/// roofline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProbeKey {
    pub one: f32,
    pub zero: f32,
    pub flip: u8,
    pub prefetch: bool,
}

impl ProbeKey {
    /// The key that changes nothing, opaque to the compiler.
    pub(crate) fn identity() -> ProbeKey {
        ProbeKey {
            one: std::hint::black_box(1.0),
            zero: std::hint::black_box(0.0),
            flip: std::hint::black_box(0),
            prefetch: true,
        }
    }

    /// This key with the probes' prefetch on or off.
    pub(crate) fn with_prefetch(self, prefetch: bool) -> ProbeKey {
        ProbeKey { prefetch, ..self }
    }
}

fn step_ptrs(j: StepJob<'_>) -> (u8, u8, StepPtrs) {
    let (gk, g) = grad_raw(j.g);
    let (ok, out) = out_raw(j.out);
    let s = StepPtrs {
        len: j.p.len(),
        p: j.p.as_mut_ptr(),
        m: j.m.as_mut_ptr(),
        v: j.v.as_mut_ptr(),
        g,
        out,
    };
    (gk, ok, s)
}

fn step_leaf(level: SimdLevel, c: &Consts, j: StepJob<'_>) {
    let (gk, ok, s) = step_ptrs(j);
    // SAFETY: `s` was built from the job's slices, which the public entry point checked to
    // have equal lengths and which the split kept equal; they are exclusive `&mut`
    // borrows (or shared `&` for the gradients) alive for this call, so `s` satisfies the
    // StepPtrs invariant. `level` passed `is_supported` when the optimizer was built, so
    // the CPU has the features of the kernel called.
    unsafe {
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Bf16 => dispatch_step!(avx512::step_bf16, gk, ok, c.l2, (c, &s)),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => dispatch_step!(avx512::step, gk, ok, c.l2, (c, &s)),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => dispatch_step!(avx2::step, gk, ok, c.l2, (c, &s)),
            _ => dispatch_step!(scalar::step, gk, ok, c.l2, (c, &s)),
        }
    }
}

fn probe_leaf(level: SimdLevel, j: StepJob<'_>, key: ProbeKey) {
    let (gk, ok, s) = step_ptrs(j);
    let (one, zero, pf) = (key.one, key.zero, key.prefetch);
    // SAFETY: as in `step_leaf`: equal-length exclusive slices, supported level.
    unsafe {
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Bf16 | SimdLevel::Avx512 => {
                dispatch_grad_out!(avx512::probe, gk, ok, (&s, one, zero, pf))
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => dispatch_grad_out!(avx2::probe, gk, ok, (&s, one, zero, pf)),
            _ => dispatch_grad_out!(scalar::probe, gk, ok, (&s, one, zero)),
        }
    }
}

/// `fn $name(level, g) -> $ret`: the gradient-only kernel `$kernel` (`sq_norm`,
/// `all_finite`) of SIMD level `level` over `g`.
macro_rules! grad_leaf {
    ($name:ident, $kernel:ident, $ret:ty) => {
        fn $name(level: SimdLevel, g: Grads<'_>) -> $ret {
            let len = g.len();
            let (gk, p) = grad_raw(g);
            // SAFETY: `p` points to the `len` elements of the gradient slice, alive for
            // the call; `level` is supported by this CPU.
            unsafe {
                match level {
                    #[cfg(target_arch = "x86_64")]
                    SimdLevel::Avx512Bf16 | SimdLevel::Avx512 => {
                        dispatch_grad!(avx512::$kernel, gk, (p, len))
                    }
                    #[cfg(target_arch = "x86_64")]
                    SimdLevel::Avx2 => dispatch_grad!(avx2::$kernel, gk, (p, len)),
                    _ => dispatch_grad!(scalar::$kernel, gk, (p, len)),
                }
            }
        }
    };
}

grad_leaf!(sq_norm_leaf, sq_norm, f64);

/// Blocks whose gradient norms [`AdamW::grad_sq_norm`] reads at once.
pub const NORM_STREAMS: usize = 4;

/// Sums of squares of `out.len()` consecutive blocks of `block` elements of `g` from
/// block `first`, each the bits [`sq_norm_leaf`] gives it. [`NORM_STREAMS`] whole blocks
/// are read together where the SIMD level has a kernel for it.
fn sq_norm_blocks(level: SimdLevel, g: Grads<'_>, block: usize, first: usize, out: &mut [f64]) {
    let at = |k: usize| {
        let lo = ((first + k) * block).min(g.len());
        let hi = (lo + block).min(g.len());
        g.split_at(hi).0.split_at(lo).1
    };
    let mut streams: Option<[f64; NORM_STREAMS]> = None;
    if out.len() == NORM_STREAMS && first + NORM_STREAMS <= g.len() / block {
        let (gk, _) = grad_raw(g);
        let ptrs: [*const u8; NORM_STREAMS] = std::array::from_fn(|k| grad_raw(at(k)).1);
        // SAFETY: each pointer is to `block` elements of `g` (whole blocks), alive for the
        // call; `level` is supported by this CPU.
        streams = unsafe {
            match level {
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx512Bf16 | SimdLevel::Avx512 => Some(dispatch_grad!(
                    avx512::sq_norms,
                    gk,
                    <NORM_STREAMS>,
                    (ptrs, block)
                )),
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx2 => Some(dispatch_grad!(
                    avx2::sq_norms,
                    gk,
                    <NORM_STREAMS>,
                    (ptrs, block)
                )),
                _ => None,
            }
        };
    }
    match streams {
        Some(sums) => out.copy_from_slice(&sums),
        None => {
            for (k, o) in out.iter_mut().enumerate() {
                *o = sq_norm_leaf(level, at(k));
            }
        }
    }
}

/// `sums` added as [`run_blocks`] adds its blocks' results: the first half's sum plus
/// the second's, recursively (the left half has `len / 2` blocks).
fn tree_sum(sums: &[f64]) -> f64 {
    match sums {
        [] => 0.0,
        [one] => *one,
        _ => {
            let (a, b) = sums.split_at(sums.len() / 2);
            tree_sum(a) + tree_sum(b)
        }
    }
}

/// `g` widened to f32 into `dst` (as long as `g`): exact for every dtype.
fn widen_leaf(g: Grads<'_>, dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    match g {
        Grads::F32(g) => dst.copy_from_slice(g),
        Grads::F16(g) => g.convert_to_f32_slice(dst),
        Grads::Bf16(g) => g.convert_to_f32_slice(dst),
    }
}
grad_leaf!(finite_leaf, all_finite, bool);

/// `src` copied into `dst` (as long), with non-temporal stores where the CPU has them
/// (see [`avx512::copy_stream`]): for a destination not read again soon.
fn copy_streaming(level: SimdLevel, src: &[f32], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len(), "a copy between slices of one length");
    let len = src.len().min(dst.len());
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `src` and the exclusive `dst` both cover `len` elements and cannot
        // overlap (one is borrowed shared, the other exclusive); `level` is supported.
        SimdLevel::Avx512Bf16 | SimdLevel::Avx512 => unsafe { avx512::copy_stream(s, d, len) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 => unsafe { avx2::copy_stream(s, d, len) },
        _ => dst[..len].copy_from_slice(&src[..len]),
    }
}

fn accumulate_leaf(level: SimdLevel, j: AccJob<'_>, scale: f32) {
    let len = j.acc.len();
    let acc = j.acc.as_mut_ptr();
    let (gk, g) = grad_raw(j.g);
    // SAFETY: `acc` is the exclusive accumulator slice and `g` the gradient slice, both of
    // `len` elements (checked by `accumulate`, kept by the split); `level` is supported.
    unsafe {
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Bf16 | SimdLevel::Avx512 => {
                dispatch_grad!(avx512::accumulate, gk, (acc, g, scale, len))
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => dispatch_grad!(avx2::accumulate, gk, (acc, g, scale, len)),
            _ => dispatch_grad!(scalar::accumulate, gk, (acc, g, scale, len)),
        }
    }
}

fn cast_leaf(level: SimdLevel, j: CastJob<'_>) {
    let len = j.src.len();
    let src = j.src.as_ptr();
    let (ok, out) = out_raw(Some(j.out));
    // SAFETY: `src` and the exclusive `out` both cover `len` elements (checked by
    // `cast_params`, kept by the split); `level` is supported by this CPU.
    unsafe {
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Bf16 => dispatch_out!(avx512::cast_bf16, ok, (src, out, len)),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => dispatch_out!(avx512::cast, ok, (src, out, len)),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => dispatch_out!(avx2::cast, ok, (src, out, len)),
            _ => dispatch_out!(scalar::cast, ok, (src, out, len)),
        }
    }
}
