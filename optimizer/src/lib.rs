//! tidestore-optimizer: AdamW for training state that lives in chunks.
//!
//! This crate is tidestore's optimizer as pure compute: a SIMD AdamW kernel over fp32
//! master parameters and moments with fp32/fp16/bf16 gradients and an optional 16-bit
//! parameter copy written in the same pass, its GPU twin over device views
//! ([`HybridAdamW`] picks the processor where a group's memory is), and around them
//! global gradient-norm clipping, dynamic loss scaling and gradient accumulation. It does
//! no I/O: it works on slices and device views that are already resident. The step loop
//! that brings each tensor's chunks to where it is stepped (from NVMe included) and the
//! checkpoints live in `tidestore-train`, over the chunk store.
//!
//! # The kernel API
//! ```text
//! AdamW::new(cfg: CpuConfig) -> Result<AdamW>
//! AdamW::with_pool(pool: Arc<rayon::ThreadPool>, cfg: CpuConfig) -> Result<AdamW>
//! AdamW::step_slice(&self, state: StepState, hp: &HyperParams,
//!                   master: &mut [f32], m: &mut [f32], v: &mut [f32],
//!                   grads: Grads<'_>, out: Option<ParamOut<'_>>) -> Result<()>
//! AdamW::grad_sq_norm(&self, grads: Grads<'_>) -> f64        // f64 sum of squares
//! AdamW::grads_finite(&self, grads: Grads<'_>) -> bool        // no inf / NaN
//! AdamW::accumulate(&self, acc: &mut [f32], grads: Grads<'_>, scale: f32) -> Result<()>
//! AdamW::cast_params(&self, src: &[f32], out: ParamOut<'_>) -> Result<()>
//! AdamW::probe_slice(&self, master: &mut [f32], m: &mut [f32], v: &mut [f32],
//!                    grads: Grads<'_>, out: Option<ParamOut<'_>>) -> Result<()>  // roofline
//! AdamW::simd_level(&self) -> SimdLevel   // Scalar | Avx2 | Avx512 | Avx512Bf16
//! AdamW::threads(&self) -> usize
//! AdamW::step_groups(&self, ctrl: &mut StepController,
//!                    groups: &mut [ParamGroup<'_>]) -> Result<StepDecision>
//!
//! enum Grads<'a>    { F32(&'a [f32]), F16(&'a [half::f16]), Bf16(&'a [half::bf16]) }
//! enum ParamOut<'a> { F16(&'a mut [half::f16]), Bf16(&'a mut [half::bf16]) }
//! struct StepState  { step: u64 /* 1-based */, grad_scale: f32 /* g = grad * grad_scale */ }
//! struct HyperParams { lr, beta1, beta2, eps, weight_decay: f32, mode: Mode /* AdamW | AdamL2 */ }
//! struct CpuConfig  { threads: usize /* 0 = all cores, 1 = caller thread */,
//!                     block_params: usize /* 64 Ki */, simd: Option<SimdLevel> }
//!
//! StepController::new(max_grad_norm: Option<f32>, loss_scaler: Option<LossScalerConfig>)
//! StepController::decide(&mut self, raw_sq_norm: f64) -> StepDecision  // Apply{state,..} | Skip{..}
//! StepController::state(&self) -> ControllerState { step: u64, loss_scaler: Option<LossScalerState> }
//! clip_coefficient(grad_norm: f64, max_norm: f64) -> f64
//! bench::run(cfg: &BenchConfig) -> Result<Vec<BenchRow>>
//! ```
//!
//! # One step, as a caller drives it (`tidestore-train`'s step loop does this)
//! 1. For every gradient slice: `sq += opt.grad_sq_norm(grads)` (raw, loss-scaled).
//! 2. `match ctrl.decide(sq)`: `Skip { .. }` leaves everything alone (fp16 overflow; the
//!    loss scale was lowered); `Apply { state, .. }` carries the step number and
//!    `grad_scale = clip_coef / loss_scale`.
//! 3. For every chunk group, once the store has it resident:
//!    `opt.step_slice(state, &hp, master, m, v, grads, Some(ParamOut::Bf16(params)))`.
//!
//! # Numerics
//! All math in f32 with the operation order of [`cpu`] (fused multiply-adds, correctly
//! rounded `sqrt` and division), identical at every SIMD level, so the scalar, AVX2 and
//! AVX-512 kernels give bit-identical parameters and moments. 16-bit outputs round to
//! nearest even, bit-identical to `half::f16::from_f32` / `half::bf16::from_f32`,
//! including NaN (quiet bit set, payload kept), subnormals and overflow to infinity. Bias
//! correction uses `1 - beta^step` in f64. Subnormal moments are computed exactly (no
//! flush to zero), which is slow on x86 if they are common.
//!
//! # NaN policy
//! A step writes every NaN result — master parameter, M or V — as the one canonical NaN,
//! [`CANONICAL_NAN_BITS`] (`0x7FFF_FFFF`, the NaN NVIDIA GPUs produce), whatever NaN went
//! in (sign and payload are not propagated), and the 16-bit parameter copy is converted
//! from that value (`0x7FFF` in f16 and in bf16). x86 arithmetic would keep the payload of
//! an input NaN and a GPU would not; canonicalizing on both sides (the CPU kernels at
//! every SIMD level and the GPU kernel select it explicitly before storing) is what makes
//! "the same bits on either side" hold for NaNs too. Casts and gradient accumulation are
//! not steps: they keep `half`'s conversion rules (payload kept, quiet bit set).
//!
//! # Performance
//! One pass over memory: per parameter the fp32 path reads and writes master, M and V
//! and reads the gradient (28 bytes); the bf16 path reads a bf16 gradient and writes a
//! bf16 parameter instead (also 28 bytes). Blocks of `block_params` go to the pool's
//! threads by recursive halving (`rayon::join`), each thread walking long contiguous
//! spans; the AVX kernels prefetch 4 KiB ahead on each fp32 stream, and the AVX-512
//! kernels stream the 16-bit output with non-temporal stores when it is 32-byte aligned
//! (it is never read by the step, so this saves its read-for-ownership). Arrays
//! 64-byte aligned (chunk buffers are 4096-aligned) avoid split loads. Nothing is
//! allocated per call.
//!
//! Nothing in this crate prints; it logs through `tracing`.

/// The bits of the one NaN a step writes (see the crate doc's NaN policy).
pub const CANONICAL_NAN_BITS: u32 = 0x7FFF_FFFF;

/// The `half` crate whose `f16` / `bf16` types the API uses, re-exported so callers need
/// no version match of their own.
pub use half;

pub mod bench;
pub mod controller;
pub mod cpu;
pub mod cuda_source;
pub mod device_slices;
pub mod error;
pub mod group;
pub mod loss_scale;
pub mod moments;
pub mod params;
pub mod placement;
pub mod quant;
pub mod simulated;
pub mod slices;

#[cfg(feature = "cuda")]
#[path = "gpu.rs"]
pub mod gpu;
#[cfg(not(feature = "cuda"))]
#[path = "gpu_dummy.rs"]
pub mod gpu;

pub use controller::{clip_coefficient, ControllerState, StepController, StepDecision};
pub use cpu::{
    AdamW, CpuConfig, SimdLevel, SimdReason, BLOCK_PARAMS_DEFAULT, NORM_STREAMS, SIMD_ENV,
};
pub use device_slices::{moment_view_bytes, DeviceGrads, DeviceGroup, DeviceSlices};
pub use error::{OptimError, Result};
pub use group::ParamGroup;
pub use loss_scale::{DynamicLossScaler, LossScalerConfig, LossScalerState};
pub use moments::{Moments, Q8Mut};
pub use params::{HyperParams, Mode, StepState};
pub use placement::{GroupPlacement, HybridAdamW, Placement, PlacementReport, ResidentGroup};
pub use quant::{MomentForm, Q8_BLOCK, Q8_MIN_ELEMENTS};
pub use slices::{DType, Grads, ParamOut};
