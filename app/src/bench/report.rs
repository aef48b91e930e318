//! What `tidestore bench` reports: the phases of an iteration, progress hooks for the
//! binary's bars, and the report (`--json` writes it; its schema is in the README).

use serde::Serialize;
use tidestore_chunk::{ChunkStore, TierSnapshot};
use tidestore_tiers::NvmeActivity;

use super::disk::DiskRates;

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
    /// `param16`, `master`, `m`, `v`, `grads`.
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
    /// NVMe read rate while the phase ran (bytes read / phase time), bytes/s.
    pub nvme_read_bytes_per_s: f64,
    /// Requests (I/O pieces of `io.block_size`) in flight on average over the phase.
    pub nvme_requests_in_flight: f64,
    /// Fraction of the phase with at least one request in flight.
    pub nvme_busy_fraction: f64,
    /// Time the phase waited on NVMe requests (for reads to land, or synchronous ones).
    pub nvme_wait_seconds: f64,
    /// The phase's bound: max(the phase with no NVMe traffic — estimated as its time
    /// less `nvme_wait_seconds` —, its NVMe bytes at the engine's rates measured before
    /// the first iteration).
    pub bound_seconds: f64,
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
    /// Why that level: the best the CPU supports, or forced (`TIDESTORE_SIMD`).
    pub simd_reason: String,
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
    /// `optimizer.overlap`: `off`, `backward` or `forward`.
    pub overlap: String,
    /// Tensor steps made during backward, over the measured iterations.
    pub tensors_overlapped: u64,
    /// Tensor steps made in the next iteration's forward (`overlap = "forward"`), the
    /// last iteration's completed after it, over the measured iterations.
    pub tensors_deferred: u64,
}

impl OptimizerReport {
    /// The CPU kernel in words: its SIMD level, why that level, its threads.
    pub fn cpu_kernel(&self) -> String {
        let (simd, why, threads) = (&self.simd, &self.simd_reason, self.threads);
        format!("CPU kernel {simd} ({why}), {threads} threads")
    }
}

/// An iteration's time against what bounds it: the slowest of the device's compute,
/// the PCIe traffic, the NVMe traffic and the optimizer kernel, each alone.
#[derive(Debug, Clone, Serialize)]
pub struct BoundReport {
    /// `workload.tflops` (0: compute not modeled, so it bounds nothing).
    pub tflops: f64,
    /// Forward and backward (recompute included) of one iteration at that rate.
    pub compute_seconds: f64,
    /// One iteration's host <-> device bytes at `device.pcie_gbps`, the busier direction.
    pub pcie_seconds: f64,
    /// One iteration's NVMe bytes at the disk's rates measured in this run.
    pub nvme_seconds: f64,
    /// The optimizer kernel's time per iteration, as measured.
    pub optimizer_seconds: f64,
    /// The largest of the four.
    pub bound_seconds: f64,
    /// `bound_seconds` / measured seconds per iteration (1.0: everything overlapped).
    pub efficiency: f64,
    /// The disk's rates, measured before the first iteration.
    pub disk: DiskRates,
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
    /// Accesses whose chunk's NVMe read a prefetch had started at an earlier moment.
    pub nvme_reads_ahead: u64,
    /// NVMe reads made by the access that needed the chunk.
    pub nvme_reads_on_demand: u64,
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
    /// The most NVMe requests in flight at once (`io.queue_depth`).
    pub nvme_queue_depth: u64,
    /// Peaks per tier.
    pub peak: PeakReport,
    /// The optimizer.
    pub optimizer: OptimizerReport,
    /// Store counters.
    pub store: StoreReport,
    /// The iteration's bound and the overlap efficiency.
    pub bound: BoundReport,
    /// Wrapping 64-bit sum of every byte read in forward and backward, hex.
    pub checksum: String,
    /// The last measured iteration, moment by moment (not in the JSON).
    #[serde(skip)]
    pub samples: Vec<Sample>,
}

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Counters {
    pub(super) h2d: u64,
    pub(super) d2h: u64,
    pub(super) n2h: u64,
    pub(super) h2n: u64,
    pub(super) stall_ns: u64,
    pub(super) accesses: u64,
    pub(super) nvme: NvmeActivity,
}

impl Counters {
    pub(super) fn of(store: &ChunkStore) -> Self {
        let s = store.stats();
        Counters {
            nvme: store.nvme().activity(),
            h2d: s.host_to_device_bytes,
            d2h: s.device_to_host_bytes,
            n2h: s.nvme_to_host_bytes,
            h2n: s.host_to_nvme_bytes,
            stall_ns: s.stall_ns,
            accesses: s.accesses,
        }
    }

    pub(super) fn since(self, before: Counters) -> Counters {
        Counters {
            h2d: self.h2d - before.h2d,
            d2h: self.d2h - before.d2h,
            n2h: self.n2h - before.n2h,
            h2n: self.h2n - before.h2n,
            stall_ns: self.stall_ns - before.stall_ns,
            accesses: self.accesses - before.accesses,
            nvme: NvmeActivity {
                piece_ns: self.nvme.piece_ns - before.nvme.piece_ns,
                busy_ns: self.nvme.busy_ns - before.nvme.busy_ns,
                wait_ns: self.nvme.wait_ns - before.nvme.wait_ns,
                pieces_max: self.nvme.pieces_max,
            },
        }
    }
}
