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
//! The optimizer step takes one tensor at a time: its 16-bit param/gradient, master, M
//! and V are accessed in the host pool together (four accesses) and the kernel updates
//! them in place through the store's disjoint views ([`ChunkStore::views_mut_with_io`]),
//! no copies out and back. The gradient and the new 16-bit parameters share the same
//! bytes, so the kernel runs in pieces of [`STEP_PIECE`] parameters, each piece's
//! gradient staged in a cache-sized buffer; between pieces the store's NVMe transfers
//! (the host prefetcher's reads of the next chunks, write-backs) are polled so they run
//! while the kernel computes.
//!
//! [`ChunkStore::views_mut_with_io`]: tidestore_chunk::ChunkStore::views_mut_with_io

use std::time::Instant;

use half::bf16;
use serde::Serialize;
use tidestore_chunk::{Guard, ListKind, Place, StoreStats, TensorId, TensorState, TierSnapshot};
use tidestore_optimizer::{
    AdamW, CpuConfig, Grads, HyperParams, Mode, ParamOut, StepController, StepDecision,
};

use crate::config::{Config, DecayMode, OptimizerDevice};
use crate::error::{Error, Result};
use crate::session::{self, Session};

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
    /// Bytes of an fp32 chunk (= a host buffer and an NVMe slot).
    pub slot_bytes: u64,
    /// Chunks per list: `param16`, `master`, `m`, `v`.
    pub lists: Vec<ListReport>,
    /// Allocated minus payload bytes over all lists.
    pub waste_bytes: u64,
}

/// One chunk list.
#[derive(Debug, Clone, Serialize)]
pub struct ListReport {
    /// `param16`, `master`, `m`, `v`, `grad16`.
    pub list: String,
    /// Chunks.
    pub chunks: u64,
    /// Bytes.
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
    /// Where it ran: `cpu`.
    pub placement: String,
    /// SIMD level of the CPU kernel.
    pub simd: String,
    /// CPU threads.
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

/// The running state of one bench.
struct Runner<'p> {
    s: Session,
    opt: AdamW,
    hp: HyperParams,
    ctrl: StepController,
    progress: &'p mut dyn Progress,
    checksum: u64,
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

fn pattern_offset(tensor: usize, iteration: u32) -> usize {
    (tensor * 131 + iteration as usize * 977) % PATTERN_SLACK
}

/// A deterministic pseudo-random stream in [-1, 1).
fn noise(seed: u64, n: usize) -> impl Iterator<Item = f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n).map(move |_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    })
}

/// Wrapping sum of `bytes` as little-endian u64 words from its start (the tail
/// zero-padded), so the same bytes give the same sum wherever they lie.
fn checksum(bytes: &[u8]) -> u64 {
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
        let values: Vec<f32> = noise(7, longest + PATTERN_SLACK)
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
                self.checksum = self
                    .checksum
                    .wrapping_add(checksum(self.s.store.bytes(&g)?));
                self.release(g, TensorState::HoldAfterFwd)?;
            }
            if b.is_layer {
                layer += 1;
            }
        }
        self.progress.finish(PhaseName::Forward);
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
                self.checksum = self
                    .checksum
                    .wrapping_add(checksum(self.s.store.bytes(&g)?));
                let trainable = self.s.workload.tensors[i].trainable;
                if trainable && !self.grad_done[i] {
                    let len = self.elements(i);
                    let o = pattern_offset(i, iteration);
                    let grads = &self.grad_pattern[o..o + len];
                    self.s
                        .store
                        .bytes_mut(&g)?
                        .copy_from_slice(bytemuck::cast_slice(grads));
                    self.grad_sq += self.opt.grad_sq_norm(Grads::Bf16(grads));
                    self.grad_done[i] = true;
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
        for &i in &trainable {
            let len = self.elements(i);
            let Some(state) = state else {
                // Skipped: the gradients are consumed all the same.
                let g = self.access(i, ListKind::Param16, Place::Host)?;
                self.release(g, TensorState::Hold)?;
                self.progress.advance(6);
                continue;
            };
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
                    self.opt.step_slice(
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
        self.opt.step_slice(
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

/// The CPU AdamW the config asks for (the GPU kernel is not in this build: asking for it
/// is an error naming `optimizer.device`).
pub fn cpu_optimizer(cfg: &Config) -> Result<AdamW> {
    if cfg.optimizer.device == OptimizerDevice::Gpu {
        return Err(Error::config(
            "optimizer.device",
            "\"gpu\": the optimizer crate has no GPU AdamW kernel in this build yet; use \
             \"auto\" or \"cpu\"",
        ));
    }
    Ok(AdamW::new(CpuConfig {
        threads: cfg.optimizer.threads as usize,
        ..CpuConfig::default()
    })?)
}

/// Runs the bench the configuration describes (see the module doc). Every up-front
/// check happens before the first iteration.
pub fn run(cfg: &Config, progress: &mut dyn Progress) -> Result<BenchReport> {
    let opt = cpu_optimizer(cfg)?;
    let hp = hyper_params(cfg);
    hp.validate()
        .map_err(|e| Error::config("optimizer", e.to_string()))?;
    let max_norm =
        (cfg.optimizer.max_grad_norm > 0.0).then_some(cfg.optimizer.max_grad_norm as f32);
    let ctrl = StepController::new(max_norm, None)?;
    let prepared = session::prepare(cfg)?;
    let s = session::open(cfg, prepared)?;
    if session::is_gpu(&s) {
        return Err(Error::config(
            "device.kind",
            "the bench reads and writes tensor bytes from the host; on a CUDA device that \
             needs device kernels this build does not have yet: use kind = \"sim\"",
        ));
    }
    let w = &s.workload;
    let n = w.tensors.len();
    let trainable: Vec<usize> = (0..n).filter(|&i| w.tensors[i].trainable).collect();
    let elems = |i: usize| -> usize { w.tensors[i].shape.iter().product() };
    let longest_trainable = trainable.iter().map(|&i| elems(i)).max().unwrap_or(0);
    let grad_pattern: Vec<bf16> = noise(11, longest_trainable + PATTERN_SLACK)
        .map(|x| bf16::from_f32(x * 1e-3))
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
                bytes: layout.list_bytes(l),
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
    if !in_place {
        tracing::info!(
            host_buffers = s.capacity.host_buffers,
            "bench: the host pool holds fewer than 5 chunks; the optimizer step copies \
             through scratch buffers instead of working in place"
        );
    }
    let mut r = Runner {
        opt,
        hp,
        ctrl,
        progress,
        checksum: 0,
        grad_pattern,
        scratch_g: vec![
            bf16::ZERO;
            if in_place {
                STEP_PIECE.min(longest_trainable)
            } else {
                longest_trainable
            }
        ],
        in_place,
        scratch_m: vec![0.0; if in_place { 0 } else { longest_trainable }],
        scratch_v: vec![0.0; if in_place { 0 } else { longest_trainable }],
        scratch_p: vec![bf16::ZERO; if in_place { 0 } else { longest_trainable }],
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
        placement: "cpu".into(),
        simd: format!("{:?}", r.opt.simd_level()).to_lowercase(),
        threads: r.opt.threads(),
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
}
