//! `tidestore bench` as a library: warm-up plus N iterations of a fine-tuning workload's
//! forward, backward and optimizer step through the real chunk store and the real CPU
//! AdamW kernel, measured per phase.
//!
//! What is real: every tensor is registered in a [`ChunkStore`] and moves between the
//! device tier, the pinned host pool and the NVMe swap file as its budgets and the
//! eviction/prefetch policy decide; every accessed tensor's bytes are read (a 64-bit
//! wrapping sum over them, reported as the checksum); every trainable tensor's gradient
//! is written into its 16-bit space in backward; the optimizer step runs the optimizer
//! crate's SIMD AdamW over every trainable parameter (fp32 master, M and V from the
//! store, bf16 gradients in, bf16 parameters out), with global-norm clipping.
//!
//! What is emulated: the compute. No matmul runs; gradients are a fixed pseudo-random
//! pattern; activations are not allocated but reported to the store as non-model device
//! memory ([`crate::workload::Workload::activation_bytes`]), which drives the tidal
//! device budget exactly as real activations would.
//!
//! Where the bytes are touched: on the simulated device and in the host pool the bench
//! reads and writes them on the host; on a CUDA device (feature `cuda`) forward and
//! backward run the kernels of `crate::gpu` on the tensors where they lie (a checksum
//! accumulated on the device and read back once per phase, the gradient pattern written
//! there), each finished before its tensor is released. Both sides compute the same bits:
//! the gradient pattern is counter-based ([`grad_value`]: element `k` of a tensor depends
//! on `k` alone), so a kernel fills a tensor in parallel with what the host precomputes
//! for the gradient norm.
//!
//! The optimizer step takes one tensor at a time, where `optimizer.device` puts it
//! (`choose_placement`):
//! - `cpu`: its 16-bit param/gradient, master, M and V are accessed in the host pool
//!   together (four accesses) and the CPU kernel updates them in place through the
//!   store's disjoint views ([`ChunkStore::views_mut_with_io`]), no copies out and back.
//!   The gradient and the new 16-bit parameters share the same bytes, so the kernel runs
//!   in pieces of [`STEP_PIECE`] parameters, each piece's gradient staged in a
//!   cache-sized buffer; between pieces the store's NVMe transfers (the host
//!   prefetcher's reads of the next chunks, write-backs) are polled so they run while the
//!   kernel computes. A host pool of fewer than five buffers copies through scratch.
//! - `gpu`: the same four are accessed on the device and stepped where they are
//!   ([`HybridAdamW::step_device_slices`]): the GPU kernel on a CUDA device, the CPU
//!   kernel over the simulation's memory on the simulated one (reported as simulated).
//!   The step-phase device budget must hold the four chunks of the largest trainable
//!   tensor, checked before the first iteration.
//! - `auto`: `gpu` where the device is a CUDA GPU, the GPU kernel is ready and the
//!   step-phase device budget holds all trainable state (so the step moves nothing);
//!   `cpu` otherwise, and always on the simulated device.
//!
//! [`ChunkStore::views_mut_with_io`]: tidestore_chunk::ChunkStore::views_mut_with_io

use std::time::Instant;

use half::bf16;
use serde::Serialize;
use tidestore_chunk::{
    Guard, Layout, ListKind, Place, StoreStats, TensorId, TensorState, TensorView, TensorViewMut,
    TierSnapshot,
};
use tidestore_optimizer::placement::{DeviceGrads, DeviceSlices, HybridAdamW, Placement};
use tidestore_optimizer::{
    AdamW, CpuConfig, Dtype, Grads, HyperParams, Mode, OptimError, ParamOut, StepController,
    StepDecision,
};
use tidestore_tiers::{DeviceView, DeviceViewMut};

use crate::config::{Config, DecayMode, DeviceKindName, OptimizerDevice};
use crate::error::{Error, Result};
#[cfg(feature = "cuda")]
use crate::gpu::BenchKernels;
use crate::session::{self, Session};
use crate::workload::Workload;
#[cfg(not(feature = "cuda"))]
use no_cuda::BenchKernels;

/// The JSON schema name and version of [`BenchReport`].
pub const SCHEMA: &str = "tidestore.bench.v1";

/// What the report says was emulated.
pub const EMULATED: &str = "compute is emulated: no matmul runs; activations are not \
allocated but reported to the store as non-model device memory (activation \
checkpointing sizes); gradients are a fixed pseudo-random bf16 pattern. Real: every \
chunk move between device, host and NVMe, a checksum over every byte accessed, every \
gradient written into its chunk, and the AdamW step on every trainable parameter.";

/// The phases of an iteration (and the initial load).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PhaseName {
    /// Writing the initial parameters into the store.
    Init,
    /// Forward over every block.
    Forward,
    /// Backward over every block in reverse, writing gradients.
    Backward,
    /// The AdamW step over every trainable tensor.
    Optimizer,
}

impl PhaseName {
    /// Lower-case name.
    pub const fn as_str(self) -> &'static str {
        match self {
            PhaseName::Init => "init",
            PhaseName::Forward => "forward",
            PhaseName::Backward => "backward",
            PhaseName::Optimizer => "optimizer",
        }
    }
}

/// Progress of a run, for progress bars. `iteration` 0 is the warm-up.
pub trait Progress {
    /// A phase starts with `steps` steps to go.
    fn start(&mut self, phase: PhaseName, iteration: u32, steps: u64);
    /// `n` more steps are done.
    fn advance(&mut self, n: u64);
    /// The phase ended.
    fn finish(&mut self, phase: PhaseName);
}

/// No progress reporting.
#[derive(Debug, Default)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&mut self, _: PhaseName, _: u32, _: u64) {}
    fn advance(&mut self, _: u64) {}
    fn finish(&mut self, _: PhaseName) {}
}

/// The workload, as run.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadReport {
    /// `workload.model`.
    pub model: String,
    /// `gpt2` or `llama`.
    pub arch: String,
    /// One line.
    pub description: String,
    /// `full` or `lora`.
    pub mode: String,
    /// LoRA rank, when LoRA.
    pub lora_rank: Option<u32>,
    /// Parameters of the base model.
    pub params_base: u64,
    /// Parameters the optimizer updates.
    pub params_trainable: u64,
    /// Tensors registered.
    pub tensors: usize,
    /// Transformer layers.
    pub layers: u32,
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Tokens per sequence.
    pub sequence: u64,
    /// Peak emulated activation bytes.
    pub activation_peak_bytes: u64,
}

/// Chunks and their layout.
#[derive(Debug, Clone, Serialize)]
pub struct ChunkReport {
    /// Element slots per chunk.
    pub chunk_elements: u64,
    /// Whether the size came from the search (`chunk.size = "auto"`).
    pub searched: bool,
    /// Bytes of a 16-bit chunk.
    pub param16_chunk_bytes: u64,
    /// Bytes of a host buffer and an NVMe slot: the largest chunk as stored (a chunk is
    /// stored as the part its tensors use; an fp32 chunk holds twice a 16-bit one).
    pub slot_bytes: u64,
    /// Chunks per list: `param16`, `master`, `m`, `v`.
    pub lists: Vec<ListReport>,
    /// Chunk capacity no tensor uses, over all lists (not stored: chunks are allocated
    /// and moved as their used prefix).
    pub waste_bytes: u64,
}

/// One chunk list.
#[derive(Debug, Clone, Serialize)]
pub struct ListReport {
    /// `param16`, `master`, `m`, `v`, `grad16`.
    pub list: String,
    /// Chunks.
    pub chunks: u64,
    /// Bytes as stored (each chunk's used prefix, page-rounded).
    pub bytes: u64,
}

/// Tier budgets as configured.
#[derive(Debug, Clone, Serialize)]
pub struct BudgetReport {
    /// `sim` or `cuda`.
    pub device_kind: String,
    /// Device memory (simulated size, or the GPU's).
    pub device_memory_bytes: u64,
    /// `device.budget`.
    pub device_bytes: u64,
    /// `device.tidal_margin`.
    pub tidal_margin_bytes: u64,
    /// `host.budget`.
    pub host_bytes: u64,
    /// `nvme.size`.
    pub nvme_bytes: u64,
}

/// One phase, summed over the measured iterations.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PhaseReport {
    /// `forward`, `backward`, `optimizer`.
    pub name: String,
    /// Wall time.
    pub seconds: f64,
    /// Bytes copied host -> device.
    pub host_to_device_bytes: u64,
    /// Bytes copied device -> host.
    pub device_to_host_bytes: u64,
    /// Bytes read from NVMe.
    pub nvme_to_host_bytes: u64,
    /// Bytes written to NVMe.
    pub host_to_nvme_bytes: u64,
    /// Time `access` waited for chunks.
    pub stall_seconds: f64,
    /// Accesses.
    pub accesses: u64,
    /// Most bytes in use on the device tier during the phase.
    pub peak_device_bytes: u64,
    /// Most bytes in use in the host pool during the phase.
    pub peak_host_bytes: u64,
    /// Most bytes in use in the swap file during the phase.
    pub peak_nvme_bytes: u64,
}

/// Peak bytes per tier over the measured iterations.
#[derive(Debug, Clone, Serialize)]
pub struct PeakReport {
    /// Device tier.
    pub device_bytes: u64,
    /// Host pool.
    pub host_bytes: u64,
    /// Swap file.
    pub nvme_bytes: u64,
}

/// The optimizer.
#[derive(Debug, Clone, Serialize)]
pub struct OptimizerReport {
    /// Where the step ran: `cpu` (the host pool, the CPU kernel) or `gpu` (the device).
    pub placement: String,
    /// With `gpu`: the device is the simulation, so the CPU kernel stepped the
    /// simulated device memory on the host.
    pub simulated: bool,
    /// Why there, in one phrase (`optimizer.device` and, for `auto`, what decided).
    pub placement_reason: String,
    /// SIMD level of the CPU kernel.
    pub simd: String,
    /// CPU threads of the CPU kernel.
    pub threads: usize,
    /// Parameters updated per step.
    pub params_per_step: u64,
    /// Steps applied (measured iterations).
    pub steps_applied: u64,
    /// Steps skipped (overflow).
    pub steps_skipped: u64,
    /// Parameters per second over the whole optimizer phase (with its I/O).
    pub params_per_s: f64,
    /// Parameters per second in the kernel alone.
    pub kernel_params_per_s: f64,
    /// Last global gradient norm.
    pub grad_norm: f64,
}

/// Store counters over the measured iterations.
#[derive(Debug, Clone, Serialize)]
pub struct StoreReport {
    /// Chunks that left the device.
    pub device_evictions: u64,
    /// Chunks that left the host pool.
    pub host_evictions: u64,
    /// Loads the computation waited for.
    pub demand_loads: u64,
    /// Loads started by the prefetcher.
    pub prefetch_loads: u64,
    /// Accesses served by a prefetch.
    pub prefetch_hits: u64,
    /// Times the access sequence left the schedule.
    pub divergences: u64,
}

/// One instant of the last measured iteration, for the plot.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Sample {
    /// Moment within the iteration (each access and each release is one).
    pub moment: u32,
    /// The phase.
    pub phase: PhaseName,
    /// Tier use and capacity now.
    #[serde(skip)]
    pub usage: TierSnapshot,
    /// Cumulative bytes host -> device since the iteration began.
    pub host_to_device_bytes: u64,
    /// ... device -> host.
    pub device_to_host_bytes: u64,
    /// ... NVMe -> host.
    pub nvme_to_host_bytes: u64,
    /// ... host -> NVMe.
    pub host_to_nvme_bytes: u64,
}

/// Everything `tidestore bench` reports (`--json` writes it; schema in the README).
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// [`SCHEMA`].
    pub schema: String,
    /// [`EMULATED`].
    pub emulated: String,
    /// The workload.
    pub workload: WorkloadReport,
    /// Budgets.
    pub budgets: BudgetReport,
    /// Chunks.
    pub chunks: ChunkReport,
    /// `policy.eviction`.
    pub policy: String,
    /// `policy.prefetch_lookahead`.
    pub prefetch_lookahead: u32,
    /// Measured iterations.
    pub iterations: u32,
    /// Seconds of the initial load.
    pub init_seconds: f64,
    /// Seconds of the warm-up (traced) iteration.
    pub warmup_seconds: f64,
    /// Mean seconds per measured iteration.
    pub seconds_per_iteration: f64,
    /// Per phase, summed over the measured iterations.
    pub phases: Vec<PhaseReport>,
    /// Peaks per tier.
    pub peak: PeakReport,
    /// The optimizer.
    pub optimizer: OptimizerReport,
    /// Store counters.
    pub store: StoreReport,
    /// Wrapping 64-bit sum of every byte read in forward and backward, hex.
    pub checksum: String,
    /// The last measured iteration, moment by moment (not in the JSON).
    #[serde(skip)]
    pub samples: Vec<Sample>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    h2d: u64,
    d2h: u64,
    n2h: u64,
    h2n: u64,
    stall_ns: u64,
    accesses: u64,
}

impl Counters {
    fn of(s: &StoreStats) -> Self {
        Counters {
            h2d: s.host_to_device_bytes,
            d2h: s.device_to_host_bytes,
            n2h: s.nvme_to_host_bytes,
            h2n: s.host_to_nvme_bytes,
            stall_ns: s.stall_ns,
            accesses: s.accesses,
        }
    }

    fn since(self, before: Counters) -> Counters {
        Counters {
            h2d: self.h2d - before.h2d,
            d2h: self.d2h - before.d2h,
            n2h: self.n2h - before.n2h,
            h2n: self.h2n - before.h2n,
            stall_ns: self.stall_ns - before.stall_ns,
            accesses: self.accesses - before.accesses,
        }
    }
}

/// Where the optimizer step runs (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
struct StepPlacement {
    /// Whether the four chunks of a tensor are stepped on the device (else in the host
    /// pool).
    on_device: bool,
    /// Why, in one phrase.
    reason: String,
}

/// The running state of one bench.
struct Runner<'p> {
    s: Session,
    opt: HybridAdamW,
    hp: HyperParams,
    ctrl: StepController,
    progress: &'p mut dyn Progress,
    checksum: u64,
    /// The GPU kernels, on a CUDA device only.
    kernels: Option<BenchKernels>,
    /// bf16 gradient pattern, longer than the largest trainable tensor by `PATTERN_SLACK`.
    grad_pattern: Vec<bf16>,
    /// One piece's gradient (see [`STEP_PIECE`]); the whole tensor's when copying.
    scratch_g: Vec<bf16>,
    /// Whether the host pool holds a tensor's four chunks at once (else the step copies
    /// through the scratch buffers below, one chunk in use at a time).
    in_place: bool,
    scratch_m: Vec<f32>,
    scratch_v: Vec<f32>,
    scratch_p: Vec<bf16>,
    /// Where the step runs.
    placement: StepPlacement,
    /// Whether a device step ran over simulated memory.
    simulated: bool,
    grad_sq: f64,
    grad_done: Vec<bool>,
    trainable: Vec<usize>,
    /// Sampling for the plot (only while `sampling`).
    sampling: bool,
    moment: u32,
    phase: PhaseName,
    samples: Vec<Sample>,
    iter_base: Counters,
    /// Peaks of the current phase.
    peaks: [u64; 3],
    steps_applied: u64,
    steps_skipped: u64,
    kernel_ns: u64,
    grad_norm: f64,
}

const PATTERN_SLACK: usize = 4096;

/// Parameters per kernel call in the optimizer step: the piece's bf16 gradient (256 KiB)
/// is staged in a buffer that stays in cache, and the store's NVMe transfers are polled
/// between pieces.
const STEP_PIECE: usize = 128 * 1024;

/// Seed of the initial parameters' pattern.
const INIT_SEED: u64 = 7;
/// Seed of the gradient pattern.
pub const GRAD_SEED: u64 = 11;
/// Gradients are the pattern in [-1, 1) times this.
pub const GRAD_SCALE: f32 = 1e-3;

fn pattern_offset(tensor: usize, iteration: u32) -> usize {
    (tensor * 131 + iteration as usize * 977) % PATTERN_SLACK
}

/// Output `index` (0-based) of the splitmix64 generator started at state `seed`: a
/// counter-based stream, so any element is computed on its own (by a GPU thread too).
pub const fn splitmix64(seed: u64, index: u64) -> u64 {
    let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The top 24 bits of `x` as an f32 in [-1, 1); every step is exact.
pub fn unit_f32(x: u64) -> f32 {
    ((x >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

/// Element `index` of the bench's bf16 gradient pattern of `seed`: exactly what the GPU
/// kernel `bench_grad_fill` writes (f32 product rounded to nearest, then bf16 rounded
/// to nearest even).
pub fn grad_value(seed: u64, index: u64, scale: f32) -> bf16 {
    bf16::from_f32(unit_f32(splitmix64(seed, index)) * scale)
}

/// A deterministic pseudo-random stream in [-1, 1): elements `0..n` of `seed`.
fn noise(seed: u64, n: usize) -> impl Iterator<Item = f32> {
    (0..n as u64).map(move |k| unit_f32(splitmix64(seed, k)))
}

/// Wrapping sum of `bytes` as little-endian u64 words from its start (the tail
/// zero-padded), so the same bytes give the same sum wherever they lie. The GPU kernel
/// `bench_checksum` computes the same sum of a device range.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut words = bytes.chunks_exact(8);
    let mut sum = words.by_ref().fold(0u64, |a, c| {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        a.wrapping_add(u64::from_le_bytes(w))
    });
    let tail = words.remainder();
    if !tail.is_empty() {
        let mut w = [0u8; 8];
        w[..tail.len()].copy_from_slice(tail);
        sum = sum.wrapping_add(u64::from_le_bytes(w));
    }
    sum
}

#[cfg(not(feature = "cuda"))]
mod no_cuda {
    //! Stand-in for `crate::gpu::BenchKernels` in a build without the `cuda` feature:
    //! uninhabited, so the bench's calls compile without a `cfg` and can never run (a
    //! CUDA device cannot be opened without the feature: `device.kind = "cuda"` fails
    //! at session open).

    use tidestore_tiers::{DeviceView, DeviceViewMut};

    use crate::error::{Error, Result};

    pub(crate) enum BenchKernels {}

    impl BenchKernels {
        pub(crate) fn new(_ordinal: usize) -> Result<Self> {
            Err(Error::Bench(
                "GPU kernels: this build has no `cuda` feature".into(),
            ))
        }

        pub(crate) fn checksum(&mut self, _view: &DeviceView<'_>) -> Result<()> {
            match *self {}
        }

        pub(crate) fn checksum_and_fill(
            &mut self,
            _view: &mut DeviceViewMut<'_>,
            _seed: u64,
            _first: u64,
            _scale: f32,
        ) -> Result<()> {
            match *self {}
        }

        pub(crate) fn take_checksum(&mut self) -> Result<u64> {
            match *self {}
        }
    }
}

fn no_kernels() -> Error {
    Error::Bench("a tensor is in GPU memory but the bench's GPU kernels are not loaded".into())
}

fn cast_err(what: &str) -> Error {
    Error::Bench(format!(
        "{what}: the store's bytes are not aligned for their element type"
    ))
}

impl Runner<'_> {
    fn id(&self, i: usize) -> TensorId {
        self.s.ids[i]
    }

    fn elements(&self, i: usize) -> usize {
        self.s.workload.tensors[i].shape.iter().product()
    }

    fn sample(&mut self) {
        let u = self.s.store.usage();
        for (p, t) in self.peaks.iter_mut().zip([u.device, u.host, u.nvme]) {
            *p = (*p).max(t.used_bytes);
        }
        if self.sampling {
            let c = Counters::of(&self.s.store.stats()).since(self.iter_base);
            self.samples.push(Sample {
                moment: self.moment,
                phase: self.phase,
                usage: u,
                host_to_device_bytes: c.h2d,
                device_to_host_bytes: c.d2h,
                nvme_to_host_bytes: c.n2h,
                host_to_nvme_bytes: c.h2n,
            });
        }
        self.moment += 1;
    }

    fn access(&mut self, i: usize, list: ListKind, place: Place) -> Result<Guard> {
        let g = self.s.store.access(self.id(i), list, place)?;
        self.sample();
        Ok(g)
    }

    fn release(&mut self, g: Guard, to: TensorState) -> Result<()> {
        self.s.store.release(g, to)?;
        self.sample();
        self.progress.advance(1);
        Ok(())
    }

    /// Writes initial parameters: 16-bit copies, and fp32 masters of trainable tensors.
    fn init(&mut self) -> Result<()> {
        let n = self.s.workload.tensors.len();
        let longest = (0..n).map(|i| self.elements(i)).max().unwrap_or(0);
        let values: Vec<f32> = noise(INIT_SEED, longest + PATTERN_SLACK)
            .map(|x| x * 0.02)
            .collect();
        let values16: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        self.progress.start(PhaseName::Init, 0, n as u64);
        for i in 0..n {
            let len = self.elements(i);
            let o = pattern_offset(i, 0);
            let id = self.id(i);
            self.s.store.write(
                id,
                ListKind::Param16,
                bytemuck::cast_slice(&values16[o..o + len]),
            )?;
            if self.s.workload.tensors[i].trainable {
                self.s.store.write(
                    id,
                    ListKind::MasterF32,
                    bytemuck::cast_slice(&values[o..o + len]),
                )?;
            }
            self.progress.advance(1);
        }
        self.progress.finish(PhaseName::Init);
        Ok(())
    }

    fn forward(&mut self, iteration: u32) -> Result<()> {
        let act = self.s.workload.activation_bytes();
        let blocks = self.s.workload.blocks.clone();
        let steps: usize = blocks.iter().map(|b| b.tensors.len()).sum();
        self.progress
            .start(PhaseName::Forward, iteration, steps as u64);
        let mut layer = 0u64;
        for b in &blocks {
            let non_model = act.at(layer, b.name == "head");
            self.s.store.report_non_model_bytes(non_model);
            for &i in &b.tensors {
                let g = self.access(i, ListKind::Param16, Place::Device)?;
                self.add_checksum(&g)?;
                self.release(g, TensorState::HoldAfterFwd)?;
            }
            if b.is_layer {
                layer += 1;
            }
        }
        self.collect_device_checksum()?;
        self.progress.finish(PhaseName::Forward);
        Ok(())
    }

    /// Adds the checksum of the accessed tensor: on the host where its bytes are
    /// host-addressable, else by the GPU kernel (finished when this returns).
    fn add_checksum(&mut self, g: &Guard) -> Result<()> {
        match self.s.store.view(g)? {
            TensorView::Host(b) | TensorView::Device(DeviceView::Host(b)) => {
                self.checksum = self.checksum.wrapping_add(checksum(b));
                Ok(())
            }
            TensorView::Device(v) => self.kernels.as_mut().ok_or_else(no_kernels)?.checksum(&v),
        }
    }

    /// Adds the checksum of the accessed tensor `i` (see [`Runner::add_checksum`]), then
    /// writes its gradient of `iteration` over it (the GPU kernel computes the same
    /// elements as `grad_pattern`), and returns the gradient's squared norm.
    fn checksum_and_write_grads(&mut self, g: &Guard, i: usize, iteration: u32) -> Result<f64> {
        let len = self.elements(i);
        let o = pattern_offset(i, iteration);
        let grads = &self.grad_pattern[o..o + len];
        match self.s.store.view_mut(g)? {
            TensorViewMut::Host(b) | TensorViewMut::Device(DeviceViewMut::Host(b)) => {
                self.checksum = self.checksum.wrapping_add(checksum(b));
                b.copy_from_slice(bytemuck::cast_slice(grads));
            }
            TensorViewMut::Device(mut v) => self
                .kernels
                .as_mut()
                .ok_or_else(no_kernels)?
                .checksum_and_fill(&mut v, GRAD_SEED, o as u64, GRAD_SCALE)?,
        }
        Ok(self.opt.cpu().grad_sq_norm(Grads::Bf16(grads)))
    }

    /// Adds what the GPU kernels accumulated in this phase (one read-back).
    fn collect_device_checksum(&mut self) -> Result<()> {
        if let Some(k) = self.kernels.as_mut() {
            self.checksum = self.checksum.wrapping_add(k.take_checksum()?);
        }
        Ok(())
    }

    fn backward(&mut self, iteration: u32) -> Result<()> {
        let act = self.s.workload.activation_bytes();
        let blocks = self.s.workload.blocks.clone();
        let steps: usize = blocks.iter().map(|b| b.tensors.len()).sum();
        self.progress
            .start(PhaseName::Backward, iteration, steps as u64);
        self.grad_sq = 0.0;
        self.grad_done.iter_mut().for_each(|d| *d = false);
        let mut layer = act.layers;
        for b in blocks.iter().rev() {
            if b.is_layer {
                layer -= 1;
            }
            self.s
                .store
                .report_non_model_bytes(act.at(layer, b.name == "head"));
            for &i in b.tensors.iter().rev() {
                let g = self.access(i, ListKind::Param16, Place::Device)?;
                let trainable = self.s.workload.tensors[i].trainable;
                if trainable && !self.grad_done[i] {
                    self.grad_sq += self.checksum_and_write_grads(&g, i, iteration)?;
                    self.grad_done[i] = true;
                } else {
                    self.add_checksum(&g)?;
                }
                let to = if trainable {
                    TensorState::HoldAfterBwd
                } else {
                    TensorState::Hold
                };
                self.release(g, to)?;
            }
        }
        self.s.store.report_non_model_bytes(0);
        self.collect_device_checksum()?;
        self.progress.finish(PhaseName::Backward);
        Ok(())
    }

    fn optimizer(&mut self, iteration: u32) -> Result<()> {
        let trainable = self.trainable.clone();
        self.progress
            .start(PhaseName::Optimizer, iteration, 7 * trainable.len() as u64);
        self.s.store.begin_optimizer_step()?;
        let decision = self.ctrl.decide(self.grad_sq);
        let state = match decision {
            StepDecision::Apply {
                state, grad_norm, ..
            } => {
                self.steps_applied += 1;
                self.grad_norm = grad_norm;
                Some(state)
            }
            StepDecision::Skip { .. } => {
                self.steps_skipped += 1;
                None
            }
        };
        let place = if self.placement.on_device {
            Place::Device
        } else {
            Place::Host
        };
        for &i in &trainable {
            let len = self.elements(i);
            let Some(state) = state else {
                // Skipped: the gradients are consumed all the same.
                let g = self.access(i, ListKind::Param16, place)?;
                self.release(g, TensorState::Hold)?;
                self.progress.advance(6);
                continue;
            };
            if self.placement.on_device {
                self.step_on_device(i, len, state)?;
                continue;
            }
            if !self.in_place {
                self.step_copying(i, len, state)?;
                continue;
            }
            // The tensor's four places in the host pool at once, stepped in place.
            let gp = self.access(i, ListKind::Param16, Place::Host)?;
            let gm = self.access(i, ListKind::MasterF32, Place::Host)?;
            let g1 = self.access(i, ListKind::MomentumF32, Place::Host)?;
            let g2 = self.access(i, ListKind::VarianceF32, Place::Host)?;
            {
                let (views, mut pump) = self.s.store.views_mut_with_io(&[&gp, &gm, &g1, &g2])?;
                let [p16, master, m, v]: [&mut [u8]; 4] = views
                    .try_into()
                    .map_err(|_| Error::Bench("views_mut returned another count".into()))?;
                let p16: &mut [bf16] =
                    bytemuck::try_cast_slice_mut(p16).map_err(|_| cast_err("param16"))?;
                let master: &mut [f32] =
                    bytemuck::try_cast_slice_mut(master).map_err(|_| cast_err("master"))?;
                let m: &mut [f32] = bytemuck::try_cast_slice_mut(m).map_err(|_| cast_err("m"))?;
                let v: &mut [f32] = bytemuck::try_cast_slice_mut(v).map_err(|_| cast_err("v"))?;
                let started = Instant::now();
                let mut at = 0;
                while at < len {
                    let end = (at + STEP_PIECE).min(len);
                    let n = end - at;
                    // The gradient and the new parameters share these bytes: stage the
                    // piece's gradient in a cache-sized buffer.
                    self.scratch_g[..n].copy_from_slice(&p16[at..end]);
                    self.opt.cpu().step_slice(
                        state,
                        &self.hp,
                        &mut master[at..end],
                        &mut m[at..end],
                        &mut v[at..end],
                        Grads::Bf16(&self.scratch_g[..n]),
                        Some(ParamOut::Bf16(&mut p16[at..end])),
                    )?;
                    // Keep the NVMe reads of the next chunks (and write-backs) moving.
                    pump.poll();
                    at = end;
                }
                self.kernel_ns += started.elapsed().as_nanos() as u64;
            }
            for g in [gp, gm, g1, g2] {
                self.release(g, TensorState::Hold)?;
            }
            self.progress.advance(3);
        }
        self.s.store.end_optimizer_step()?;
        self.progress.finish(PhaseName::Optimizer);
        Ok(())
    }
}

impl Runner<'_> {
    /// The step of tensor `i` on the device: its 16-bit param/gradient, master, M and V
    /// accessed there at once and stepped where they are (the GPU kernel, or the CPU
    /// kernel over the simulated device's memory), the new 16-bit parameters written
    /// over the gradient. The kernel has finished when the optimizer returns, before the
    /// guards are released.
    fn step_on_device(
        &mut self,
        i: usize,
        len: usize,
        state: tidestore_optimizer::StepState,
    ) -> Result<()> {
        let gp = self.access(i, ListKind::Param16, Place::Device)?;
        let gm = self.access(i, ListKind::MasterF32, Place::Device)?;
        let g1 = self.access(i, ListKind::MomentumF32, Place::Device)?;
        let g2 = self.access(i, ListKind::VarianceF32, Place::Device)?;
        let placed = {
            let (views, mut pump) = self
                .s
                .store
                .tensor_views_mut_with_io(&[&gp, &gm, &g1, &g2])?;
            let [p16, master, m, v]: [DeviceViewMut<'_>; 4] = views
                .into_iter()
                .map(|v| match v {
                    TensorViewMut::Device(d) => Ok(d),
                    TensorViewMut::Host(_) => Err(Error::Bench(
                        "a device access gave a view of the host pool".into(),
                    )),
                })
                .collect::<Result<Vec<_>>>()?
                .try_into()
                .map_err(|_| Error::Bench("tensor_views_mut returned another count".into()))?;
            let started = Instant::now();
            let placed = self.opt.step_device_slices(
                state,
                &self.hp,
                DeviceSlices {
                    len,
                    master,
                    m,
                    v,
                    grads: DeviceGrads::InPlace {
                        bytes: p16,
                        dtype: Dtype::Bf16,
                    },
                },
            )?;
            self.kernel_ns += started.elapsed().as_nanos() as u64;
            pump.poll();
            placed
        };
        if placed.placement != Placement::Gpu {
            return Err(Error::Bench(format!(
                "the optimizer stepped device memory on {:?}",
                placed.placement
            )));
        }
        self.simulated |= placed.simulated;
        for g in [gp, gm, g1, g2] {
            self.release(g, TensorState::Hold)?;
        }
        self.progress.advance(3);
        Ok(())
    }

    /// The step of tensor `i` one chunk at a time (a host pool too small to hold its
    /// four chunks at once): gradient, M and V copied out to scratch, master updated in
    /// place, M, V and the new 16-bit parameters copied back.
    fn step_copying(
        &mut self,
        i: usize,
        len: usize,
        state: tidestore_optimizer::StepState,
    ) -> Result<()> {
        let g = self.access(i, ListKind::Param16, Place::Host)?;
        bytemuck::cast_slice_mut::<bf16, u8>(&mut self.scratch_g[..len])
            .copy_from_slice(self.s.store.bytes(&g)?);
        self.release(g, TensorState::Hold)?;
        for list in [ListKind::MomentumF32, ListKind::VarianceF32] {
            let g = self.access(i, list, Place::Host)?;
            let dst = if list == ListKind::MomentumF32 {
                &mut self.scratch_m[..len]
            } else {
                &mut self.scratch_v[..len]
            };
            bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(self.s.store.bytes(&g)?);
            self.release(g, TensorState::Hold)?;
        }
        let g = self.access(i, ListKind::MasterF32, Place::Host)?;
        let master: &mut [f32] = bytemuck::try_cast_slice_mut(self.s.store.bytes_mut(&g)?)
            .map_err(|_| cast_err("master"))?;
        let started = Instant::now();
        self.opt.cpu().step_slice(
            state,
            &self.hp,
            master,
            &mut self.scratch_m[..len],
            &mut self.scratch_v[..len],
            Grads::Bf16(&self.scratch_g[..len]),
            Some(ParamOut::Bf16(&mut self.scratch_p[..len])),
        )?;
        self.kernel_ns += started.elapsed().as_nanos() as u64;
        self.release(g, TensorState::Hold)?;
        for list in [ListKind::MomentumF32, ListKind::VarianceF32] {
            let g = self.access(i, list, Place::Host)?;
            let src = if list == ListKind::MomentumF32 {
                &self.scratch_m[..len]
            } else {
                &self.scratch_v[..len]
            };
            self.s
                .store
                .bytes_mut(&g)?
                .copy_from_slice(bytemuck::cast_slice(src));
            self.release(g, TensorState::Hold)?;
        }
        let g = self.access(i, ListKind::Param16, Place::Host)?;
        self.s
            .store
            .bytes_mut(&g)?
            .copy_from_slice(bytemuck::cast_slice(&self.scratch_p[..len]));
        self.release(g, TensorState::Hold)?;
        Ok(())
    }
}

fn hyper_params(cfg: &Config) -> HyperParams {
    let o = &cfg.optimizer;
    HyperParams {
        lr: o.lr as f32,
        beta1: o.beta1 as f32,
        beta2: o.beta2 as f32,
        eps: o.eps as f32,
        weight_decay: o.weight_decay as f32,
        mode: match o.mode {
            DecayMode::Adamw => Mode::AdamW,
            DecayMode::AdamL2 => Mode::AdamL2,
        },
    }
}

/// The CPU AdamW the config asks for (`optimizer.threads`). It steps the host pool, and
/// with `optimizer.device` on the device of a simulated device, the simulated memory.
pub fn cpu_optimizer(cfg: &Config) -> Result<AdamW> {
    Ok(AdamW::new(CpuConfig {
        threads: cfg.optimizer.threads as usize,
        ..CpuConfig::default()
    })?)
}

/// The lists a tensor's step touches.
const STEP_LISTS: [ListKind; 4] = [
    ListKind::Param16,
    ListKind::MasterF32,
    ListKind::MomentumF32,
    ListKind::VarianceF32,
];

/// The device budget for chunks during the optimizer step, as the store sets it then:
/// the device's memory less what is not chunks (measured on a GPU; on the simulated
/// device the bench reports none during the step) less `device.tidal_margin`.
#[derive(Debug, Clone, Copy)]
struct StepBudget {
    bytes: u64,
    total_bytes: u64,
    non_model_bytes: u64,
    margin_bytes: u64,
}

impl StepBudget {
    fn new(cfg: &Config, total_bytes: u64, non_model_bytes: u64) -> Self {
        let margin_bytes = cfg.device.tidal_margin.bytes();
        StepBudget {
            bytes: total_bytes
                .saturating_sub(non_model_bytes)
                .saturating_sub(margin_bytes),
            total_bytes,
            non_model_bytes,
            margin_bytes,
        }
    }

    /// The simulated device's, known before it is made (the memory `session::open`
    /// gives it).
    fn simulated(cfg: &Config, prepared: &session::Prepared) -> Self {
        let total = prepared.device_memory_bytes.max(cfg.device.budget.bytes());
        StepBudget::new(cfg, total, 0)
    }

    /// The opened device's (on a GPU, less the memory in use by others now).
    fn of(cfg: &Config, s: &Session) -> Result<Self> {
        let device = s.store.device();
        let total = device.mem_info()?.total_bytes;
        let non_model = if session::is_gpu(s) {
            device.non_model_bytes()?
        } else {
            0
        };
        Ok(StepBudget::new(cfg, total, non_model))
    }
}

/// Device bytes the step on the device needs: the four chunks of the trainable tensor
/// whose four chunks take most (what is in use at once), and every chunk holding
/// trainable state (what would let the step move nothing). Chunks count as the device
/// budget counts them (rounded up to 4096).
#[derive(Debug, Clone)]
struct StepNeeds {
    largest_bytes: u64,
    largest_tensor: String,
    /// The largest tensor's chunks, per list of [`STEP_LISTS`].
    largest_chunks: [u64; 4],
    all_bytes: u64,
}

fn step_needs(layout: &Layout, workload: &Workload) -> StepNeeds {
    let dense = layout.dense_chunk_bytes();
    let dev_bytes = |d: usize| tidestore_io::align_up(dense[d] as usize) as u64;
    let mut needs = StepNeeds {
        largest_bytes: 0,
        largest_tensor: String::new(),
        largest_chunks: [0; 4],
        all_bytes: 0,
    };
    let mut seen = vec![false; dense.len()];
    for (i, t) in workload.tensors.iter().enumerate() {
        if !t.trainable {
            continue;
        }
        let mut chunks = [0u64; 4];
        for (c, list) in chunks.iter_mut().zip(STEP_LISTS) {
            if let Some(loc) = layout.location(TensorId(i as u32), list) {
                let d = loc.chunk.dense();
                *c = dev_bytes(d);
                if !seen[d] {
                    seen[d] = true;
                    needs.all_bytes += *c;
                }
            }
        }
        let sum = chunks.iter().sum();
        if sum > needs.largest_bytes {
            needs.largest_bytes = sum;
            needs.largest_tensor = t.name.clone();
            needs.largest_chunks = chunks;
        }
    }
    needs
}

fn human(b: u64) -> String {
    crate::plan::human_bytes(b)
}

/// Where the optimizer step runs, from `optimizer.device` (see the module doc), or a
/// config error naming `optimizer.device` when `gpu` cannot run.
fn choose_placement(
    cfg: &Config,
    on_gpu: bool,
    budget: StepBudget,
    needs: &StepNeeds,
    gpu_kernel: std::result::Result<(), OptimError>,
) -> Result<StepPlacement> {
    let place = |on_device: bool, reason: String| Ok(StepPlacement { on_device, reason });
    match cfg.optimizer.device {
        OptimizerDevice::Cpu => place(false, "optimizer.device = \"cpu\"".into()),
        OptimizerDevice::Gpu => {
            if on_gpu {
                if let Err(e) = gpu_kernel {
                    return Err(Error::config(
                        "optimizer.device",
                        format!("\"gpu\": the GPU AdamW kernel is not ready: {e}"),
                    ));
                }
            }
            if needs.largest_bytes > budget.bytes {
                let [p16, master, m, v] = needs.largest_chunks;
                return Err(Error::config(
                    "optimizer.device",
                    format!(
                        "\"gpu\" steps each trainable tensor with its four chunks on the \
                         device at once: tensor `{}` needs {} (param16 {}, master {}, m {}, \
                         v {}), but the device budget during the step is {} ({} of device \
                         memory less {} in use by others less {} tidal_margin), {} short; \
                         use \"cpu\" or \"auto\", or more device memory{}",
                        needs.largest_tensor,
                        human(needs.largest_bytes),
                        human(p16),
                        human(master),
                        human(m),
                        human(v),
                        human(budget.bytes),
                        human(budget.total_bytes),
                        human(budget.non_model_bytes),
                        human(budget.margin_bytes),
                        human(needs.largest_bytes - budget.bytes),
                        if on_gpu { "" } else { " (device.sim_memory)" }
                    ),
                ));
            }
            place(
                true,
                if on_gpu {
                    "optimizer.device = \"gpu\"".into()
                } else {
                    "optimizer.device = \"gpu\" on the simulated device".into()
                },
            )
        }
        OptimizerDevice::Auto => {
            if !on_gpu {
                return place(false, "auto: the device is simulated".into());
            }
            if let Err(e) = gpu_kernel {
                return place(false, format!("auto: no GPU AdamW kernel ({e})"));
            }
            if needs.all_bytes > budget.bytes {
                return place(
                    false,
                    format!(
                        "auto: the trainable state ({}) does not fit the step's device \
                         budget ({})",
                        human(needs.all_bytes),
                        human(budget.bytes)
                    ),
                );
            }
            place(
                true,
                format!(
                    "auto: a CUDA GPU whose step budget ({}) holds all trainable state ({})",
                    human(budget.bytes),
                    human(needs.all_bytes)
                ),
            )
        }
    }
}

/// Runs the bench the configuration describes (see the module doc). Every up-front
/// check happens before the first iteration.
pub fn run(cfg: &Config, progress: &mut dyn Progress) -> Result<BenchReport> {
    let cpu = cpu_optimizer(cfg)?;
    let hp = hyper_params(cfg);
    hp.validate()
        .map_err(|e| Error::config("optimizer", e.to_string()))?;
    let max_norm =
        (cfg.optimizer.max_grad_norm > 0.0).then_some(cfg.optimizer.max_grad_norm as f32);
    let ctrl = StepController::new(max_norm, None)?;
    let prepared = session::prepare(cfg)?;
    // Tensors are registered in workload order: tensor i is `TensorId(i)`.
    let needs = step_needs(&prepared.layout, &prepared.workload);
    let no_gpu = |reason: &str| OptimError::NoGpu {
        reason: reason.into(),
    };
    // A simulated device is known before anything is allocated: its placement too.
    let early = if cfg.device.kind == DeviceKindName::Sim {
        Some(choose_placement(
            cfg,
            false,
            StepBudget::simulated(cfg, &prepared),
            &needs,
            Err(no_gpu("the device is simulated")),
        )?)
    } else {
        None
    };
    let s = session::open(cfg, prepared)?;
    let on_gpu = session::is_gpu(&s);
    // On a GPU, forward and backward run the bench's kernels; the GPU AdamW is made only
    // where the step may run on it.
    let kernels = if on_gpu {
        Some(BenchKernels::new(session::DEVICE_ORDINAL)?)
    } else {
        None
    };
    let opt = if on_gpu && cfg.optimizer.device != OptimizerDevice::Cpu {
        HybridAdamW::new(cpu, session::DEVICE_ORDINAL)
    } else {
        let reason = if on_gpu {
            "optimizer.device = \"cpu\""
        } else {
            "the device is simulated"
        };
        HybridAdamW::cpu_only(cpu, no_gpu(reason))
    };
    let placement = match early {
        Some(p) => p,
        None => choose_placement(
            cfg,
            on_gpu,
            StepBudget::of(cfg, &s)?,
            &needs,
            opt.gpu_status(),
        )?,
    };
    tracing::info!(on_device = placement.on_device, reason = %placement.reason, "bench: optimizer step placement");
    let w = &s.workload;
    let n = w.tensors.len();
    let trainable: Vec<usize> = (0..n).filter(|&i| w.tensors[i].trainable).collect();
    let elems = |i: usize| -> usize { w.tensors[i].shape.iter().product() };
    let longest_trainable = trainable.iter().map(|&i| elems(i)).max().unwrap_or(0);
    let grad_pattern: Vec<bf16> = (0..(longest_trainable + PATTERN_SLACK) as u64)
        .map(|k| grad_value(GRAD_SEED, k, GRAD_SCALE))
        .collect();
    let workload = WorkloadReport {
        model: w.model.to_string(),
        arch: w.shape.arch.as_str().into(),
        description: w.describe(),
        mode: if w.lora.is_some() { "lora" } else { "full" }.into(),
        lora_rank: w.lora.map(|(r, _)| r),
        params_base: w.params_base(),
        params_trainable: w.params_trainable(),
        tensors: n,
        layers: w.shape.layers,
        micro_batch: w.micro_batch,
        sequence: w.sequence,
        activation_peak_bytes: w.activation_bytes().peak(),
    };
    let layout = s.store.layout();
    let chunks = ChunkReport {
        chunk_elements: s.chunk_elements,
        searched: s.chunk_searched,
        param16_chunk_bytes: layout.chunk_bytes(ListKind::Param16),
        slot_bytes: s.capacity.slot_bytes,
        lists: layout
            .lists()
            .into_iter()
            .map(|l| ListReport {
                list: l.as_str().into(),
                chunks: layout.list_chunk_count(l),
                bytes: layout.list_stored_bytes(l),
            })
            .collect(),
        waste_bytes: s.waste_bytes,
    };
    let budgets = BudgetReport {
        device_kind: s.store.device().kind().to_string(),
        device_memory_bytes: s.device_memory_bytes,
        device_bytes: cfg.device.budget.bytes(),
        tidal_margin_bytes: cfg.device.tidal_margin.bytes(),
        host_bytes: cfg.host.budget.bytes(),
        nvme_bytes: cfg.nvme.size.bytes(),
    };
    // Four chunks in use on the host at once, plus one buffer for loads.
    let in_place = s.capacity.host_buffers >= 5;
    if !in_place && !placement.on_device {
        tracing::info!(
            host_buffers = s.capacity.host_buffers,
            "bench: the host pool holds fewer than 5 chunks; the optimizer step copies \
             through scratch buffers instead of working in place"
        );
    }
    // Scratch of the host step: one piece's gradient in place, whole tensors copying.
    let (piece, whole) = match (placement.on_device, in_place) {
        (true, _) => (0, 0),
        (false, true) => (STEP_PIECE.min(longest_trainable), 0),
        (false, false) => (longest_trainable, longest_trainable),
    };
    let mut r = Runner {
        opt,
        hp,
        ctrl,
        progress,
        checksum: 0,
        kernels,
        grad_pattern,
        scratch_g: vec![bf16::ZERO; piece],
        in_place,
        scratch_m: vec![0.0; whole],
        scratch_v: vec![0.0; whole],
        scratch_p: vec![bf16::ZERO; whole],
        placement,
        simulated: false,
        grad_sq: 0.0,
        grad_done: vec![false; n],
        trainable,
        sampling: false,
        moment: 0,
        phase: PhaseName::Init,
        samples: Vec::new(),
        iter_base: Counters::default(),
        peaks: [0; 3],
        steps_applied: 0,
        steps_skipped: 0,
        kernel_ns: 0,
        grad_norm: 0.0,
        s,
    };

    let started = Instant::now();
    r.init()?;
    r.s.store.sync()?;
    let init_seconds = started.elapsed().as_secs_f64();

    let iterations = cfg.workload.iterations;
    let mut phases: Vec<PhaseReport> = [
        PhaseName::Forward,
        PhaseName::Backward,
        PhaseName::Optimizer,
    ]
    .iter()
    .map(|p| PhaseReport {
        name: p.as_str().into(),
        ..PhaseReport::default()
    })
    .collect();
    let mut warmup_seconds = 0.0;
    let mut measured_seconds = 0.0;
    for it in 0..=iterations {
        let iter_started = Instant::now();
        if it == 1 {
            r.s.store.reset_stats();
            r.steps_applied = 0;
            r.steps_skipped = 0;
            r.kernel_ns = 0;
        }
        r.sampling = it == iterations && it > 0;
        r.moment = 0;
        r.iter_base = Counters::of(&r.s.store.stats());
        for (k, phase) in [
            PhaseName::Forward,
            PhaseName::Backward,
            PhaseName::Optimizer,
        ]
        .into_iter()
        .enumerate()
        {
            r.phase = phase;
            r.peaks = [0; 3];
            let before = Counters::of(&r.s.store.stats());
            let t = Instant::now();
            match phase {
                PhaseName::Forward => r.forward(it)?,
                PhaseName::Backward => r.backward(it)?,
                _ => r.optimizer(it)?,
            }
            let secs = t.elapsed().as_secs_f64();
            if it > 0 {
                let c = Counters::of(&r.s.store.stats()).since(before);
                let p = &mut phases[k];
                p.seconds += secs;
                p.host_to_device_bytes += c.h2d;
                p.device_to_host_bytes += c.d2h;
                p.nvme_to_host_bytes += c.n2h;
                p.host_to_nvme_bytes += c.h2n;
                p.stall_seconds += c.stall_ns as f64 / 1e9;
                p.accesses += c.accesses;
                p.peak_device_bytes = p.peak_device_bytes.max(r.peaks[0]);
                p.peak_host_bytes = p.peak_host_bytes.max(r.peaks[1]);
                p.peak_nvme_bytes = p.peak_nvme_bytes.max(r.peaks[2]);
            }
        }
        r.s.store.end_iteration()?;
        let secs = iter_started.elapsed().as_secs_f64();
        if it == 0 {
            warmup_seconds = secs;
        } else {
            measured_seconds += secs;
        }
    }
    r.s.store.sync()?;
    let st = r.s.store.stats();
    let opt_seconds = phases[2].seconds;
    let trainable_params = r.s.workload.params_trainable();
    let steps = r.steps_applied;
    let optimizer = OptimizerReport {
        placement: if r.placement.on_device { "gpu" } else { "cpu" }.into(),
        simulated: r.simulated,
        placement_reason: r.placement.reason.clone(),
        simd: format!("{:?}", r.opt.cpu().simd_level()).to_lowercase(),
        threads: r.opt.cpu().threads(),
        params_per_step: trainable_params,
        steps_applied: steps,
        steps_skipped: r.steps_skipped,
        params_per_s: if opt_seconds > 0.0 {
            (trainable_params * steps) as f64 / opt_seconds
        } else {
            0.0
        },
        kernel_params_per_s: if r.kernel_ns > 0 {
            (trainable_params * steps) as f64 / (r.kernel_ns as f64 / 1e9)
        } else {
            0.0
        },
        grad_norm: r.grad_norm,
    };
    Ok(BenchReport {
        schema: SCHEMA.into(),
        emulated: EMULATED.into(),
        workload,
        budgets,
        chunks,
        policy: format!("{}", tidestore_chunk::PolicyKind::from(cfg.policy.eviction)),
        prefetch_lookahead: cfg.policy.prefetch_lookahead,
        iterations,
        init_seconds,
        warmup_seconds,
        seconds_per_iteration: measured_seconds / f64::from(iterations),
        phases,
        peak: PeakReport {
            device_bytes: st.device.peak_bytes,
            host_bytes: st.host.peak_bytes,
            nvme_bytes: st.nvme.peak_bytes,
        },
        optimizer,
        store: StoreReport {
            device_evictions: st.device_evictions,
            host_evictions: st.host_evictions,
            demand_loads: st.demand_loads,
            prefetch_loads: st.prefetch_loads,
            prefetch_hits: st.prefetch_hits,
            divergences: st.divergences,
        },
        checksum: format!("{:016x}", r.checksum),
        samples: std::mem::take(&mut r.samples),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_is_a_word_sum_with_a_padded_tail() {
        let words: Vec<u64> = vec![1, 2, 3];
        assert_eq!(checksum(bytemuck::cast_slice(&words)), 6);
        let bytes: Vec<u8> = (0..17u8).collect();
        assert_eq!(checksum(&bytes[16..]), 16);
        let mut shifted = vec![0u8; 1];
        shifted.extend_from_slice(&bytes);
        assert_eq!(checksum(&shifted[1..]), checksum(&bytes));
    }

    /// The CUDA source of the bench's kernels (also in builds without `cuda`).
    const BENCH_CU: &str = include_str!("kernels/bench.cu");

    #[test]
    fn splitmix64_is_the_published_generator() {
        // Vigna's splitmix64.c: state 0, and the test vector of state 1234567.
        assert_eq!(splitmix64(0, 0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(0, 1), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(splitmix64(0, 2), 0x06C4_5D18_8009_454F);
        assert_eq!(splitmix64(1_234_567, 0), 6_457_827_717_110_365_317);
        assert_eq!(splitmix64(1_234_567, 1), 3_203_168_211_198_807_973);
    }

    /// The kernel's `f32_to_bf16_bits`, line for line.
    fn kernel_bf16_bits(f: f32) -> u16 {
        let x = f.to_bits();
        if (x & 0x7fff_ffff) > 0x7f80_0000 {
            return ((x >> 16) | 0x0040) as u16;
        }
        let round_bit = 0x0000_8000u32;
        if (x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0 {
            return ((x >> 16) + 1) as u16;
        }
        (x >> 16) as u16
    }

    /// The kernel's `unit_f32`, built from integers only: the top 24 bits `t` give
    /// `t / 2^23 - 1`, exactly representable, so the f32 is exact.
    fn kernel_unit_exact(x: u64) -> f32 {
        let t = (x >> 40) as i64; // 24 bits
        let v = (t - (1 << 23)) as f64 / (1u64 << 23) as f64;
        v as f32
    }

    #[test]
    fn the_host_generator_is_what_the_fill_kernel_computes() {
        // Every operation of `bench_grad_fill`, as the kernel writes it, against the
        // `half` crate path the host uses.
        for (first, n) in [(0u64, 1 << 16), (977, 1 << 16), (u64::MAX - 100, 100)] {
            for k in 0..n {
                let index = first.wrapping_add(k);
                let x = splitmix64(GRAD_SEED, index);
                let unit = unit_f32(x);
                assert_eq!(unit.to_bits(), kernel_unit_exact(x).to_bits(), "exact unit");
                assert!((-1.0..1.0).contains(&unit));
                let want = kernel_bf16_bits(unit * GRAD_SCALE);
                assert_eq!(grad_value(GRAD_SEED, index, GRAD_SCALE).to_bits(), want);
            }
        }
        // The bf16 rounding rule on its edge cases: ties to even, carries into the
        // exponent, overflow to infinity, subnormals, NaN kept quiet with its payload.
        for bits in [
            0x3f80_8000u32, // tie, even below: stays
            0x3f81_8000,    // tie, odd below: rounds up
            0x3f80_8001,    // above the tie
            0x3f80_7fff,    // below the tie
            0x3fff_ffff,    // carries into the exponent
            0x7f7f_ffff,    // largest finite: to infinity
            0x7f80_0000,    // infinity
            0xff80_0000,
            0x0000_8001, // subnormal
            0x8000_0000, // -0
            0x7fc0_0001, // quiet NaN with a payload
            0x7f80_0001, // signalling NaN: made quiet
            0xffff_ffff,
        ] {
            let f = f32::from_bits(bits);
            assert_eq!(
                bf16::from_f32(f).to_bits(),
                kernel_bf16_bits(f),
                "{bits:#010x}"
            );
        }
        // The kernel source uses these constants and steps (a change on one side only
        // fails here; tests/bench_gpu.rs compares the bits on a GPU).
        let src: String = BENCH_CU.split_whitespace().collect();
        for needle in [
            "u64z=seed+(index+1u)*0x9E3779B97F4A7C15ull;",
            "z=(z^(z>>30))*0xBF58476D1CE4E5B9ull;",
            "z=(z^(z>>27))*0x94D049BB133111EBull;",
            "returnz^(z>>31);",
            "__fsub_rn(__fdiv_rn(__ull2float_rn(x>>40),8388608.0f),1.0f)",
            "unit_f32(splitmix64(seed,first+k))",
            "f32_to_bf16_bits(__fmul_rn(x,scale))",
        ] {
            assert!(src.contains(needle), "bench.cu lacks `{needle}`");
        }
        assert_eq!(8_388_608.0f32, (1u64 << 23) as f32);
    }

    /// The checksum kernel's algorithm, thread by thread: the aligned words covering
    /// the range, bytes outside it masked (never read), each rotated right by 8 times
    /// the misalignment, summed in any order.
    fn kernel_checksum_model(memory: &[u8], start: usize, n: usize) -> u64 {
        let shift = start % 8;
        let base = start - shift;
        let (lo, hi) = (shift, shift + n);
        let words = hi.div_ceil(8);
        let rot = 8 * shift as u32;
        // Reverse order, to show the order does not matter.
        (0..words).rev().fold(0u64, |sum, k| {
            let w = if k * 8 >= lo && k * 8 + 8 <= hi {
                u64::from_le_bytes(memory[base + k * 8..base + k * 8 + 8].try_into().unwrap())
            } else {
                (0..8).fold(0u64, |w, b| {
                    let at = k * 8 + b;
                    if at >= lo && at < hi {
                        w | (u64::from(memory[base + at]) << (8 * b))
                    } else {
                        w
                    }
                })
            };
            sum.wrapping_add(w.rotate_right(rot))
        })
    }

    #[test]
    fn the_checksum_kernels_rotated_aligned_words_give_the_host_sum() {
        let memory: Vec<u8> = (0..4200u64)
            .map(|i| (splitmix64(5, i) >> 32) as u8)
            .collect();
        for start in 0..16 {
            for n in [0, 1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4096] {
                assert_eq!(
                    kernel_checksum_model(&memory, start, n),
                    checksum(&memory[start..start + n]),
                    "start {start}, {n} bytes"
                );
            }
        }
    }
}
