//! What a [`crate::Trainer`] is opened with: the parameters a model declares
//! ([`ParamSpec`]), the precision its compute runs in ([`Precision`]), and the store,
//! optimizer and step settings of the run ([`TrainerConfig`]).
//!
//! Every front end (the candle glue, the Python package, a library user) fills one
//! [`TrainerConfig`]; nothing else decides how a training run's store is laid out.

use std::path::PathBuf;

use tidestore_chunk::MomentForm;
use tidestore_io::IoConfig;
use tidestore_optimizer::HyperParams;

use crate::step::{GradPlace, Overlap};

/// A model parameter as the model declares it, in forward order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// A unique name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Whether the optimizer updates it (a LoRA base weight is frozen).
    pub trainable: bool,
}

impl ParamSpec {
    /// A parameter spec.
    pub fn new(name: impl Into<String>, shape: &[usize], trainable: bool) -> Self {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            trainable,
        }
    }

    /// Its element count.
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Which copy of the parameters compute reads, and the gradients' precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// fp32 compute from the master copy; fp32 gradients in the layout's `Grads` list
    /// (4-byte slots, its chunks mirroring master's). Numerically the same as training
    /// in memory. The layout's 16-bit copy of a trainable parameter stays unused.
    #[default]
    F32,
    /// The layout's mixed precision: compute reads the bf16 copy, the bf16 gradient
    /// reuses that copy's space, and the step writes the new bf16 copy back there; fp32
    /// master, M and V.
    Bf16,
}

impl Precision {
    /// Where its gradients are (see the variants).
    pub(crate) fn grad_place(self) -> GradPlace {
        match self {
            Precision::F32 => GradPlace::InGrads {
                write_param16: false,
            },
            Precision::Bf16 => GradPlace::InParam16,
        }
    }

    /// Its name in configs and checkpoint metadata.
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }
}

/// A tier's budget for chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// This many chunks of the largest size.
    Chunks(u32),
    /// This many bytes (rounded down to whole chunks by the store).
    Bytes(u64),
    /// Every chunk of the layout plus one staging buffer: nothing spills further down
    /// (the host pool of an optimizer whose state should stay in RAM).
    AllChunks,
}

/// Which device tier the store opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// Host memory standing in for the GPU, with the same budgets.
    Sim,
    /// The CUDA GPU where one is present (a build with the `cuda` feature), else the
    /// simulation, logged.
    Auto,
    /// No GPU, even in a `cuda` build on a machine with one: compute and the step are
    /// the CPU's, and the device tier is what [`DeviceChoice::Auto`] leaves where no GPU
    /// is found (a simulation holding only the step's working set, which compute does
    /// not read). For a front end that computes on the CPU by choice.
    Cpu,
}

/// Where the optimizer step runs ([`TrainerConfig::step_device`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepDevice {
    /// The CPU kernel in the host pool: each gradient goes to host memory, each
    /// tensor's master, M and V chunks come to it.
    Cpu,
    /// Each tensor's gradient, master, M and V chunks on the device tier, stepped there:
    /// the GPU kernel on a CUDA GPU, the CPU kernel over the simulated device's memory.
    /// Gradients are written where the step reads them (on the device). Refused at
    /// open when the device budget cannot hold the largest tensor's step chunks, or on
    /// a GPU whose AdamW kernel cannot be made.
    Gpu,
    /// `Gpu` on a CUDA GPU whose AdamW kernel is ready and whose device budget holds
    /// every chunk of trainable state (so no step moves one), else `Cpu`; always `Cpu`
    /// on the simulated device ([`crate::decide_step_place`]). Why is logged and kept
    /// ([`crate::Trainer::step_placement`]).
    Auto,
}

/// How a [`crate::Trainer`] lays out, budgets and steps its store.
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    /// Compute and gradient precision.
    pub precision: Precision,
    /// AdamW hyper-parameters (one group).
    pub hp: HyperParams,
    /// Clip the global gradient norm to this, when given.
    pub max_grad_norm: Option<f32>,
    /// When groups are stepped: after backward, or during it as their gradients
    /// become final.
    pub overlap: Overlap,
    /// Whether a step with a non-finite gradient is skipped (see
    /// [`StepConfig::check_finite`](crate::StepConfig::check_finite)).
    pub check_finite: bool,
    /// Chunk size in element slots; `None`: the chunk-size search (capped at twice the
    /// largest tensor, so that a small model still has several chunks per list).
    pub chunk_elements: Option<u64>,
    /// Device budget for chunks (at least the step's four chunks).
    pub device_budget: Budget,
    /// Pinned host pool (at least four chunks in use by the step plus one staging
    /// buffer). Less than the model's chunks puts the rest — M and V among them — on
    /// NVMe.
    pub host_budget: Budget,
    /// Which device tier.
    pub device: DeviceChoice,
    /// The simulated device's memory beside the device budget: what compute's
    /// activations may take there ([`crate::Trainer::hold_activations`]) while chunks
    /// fill the budget, as a GPU has memory beyond the budget given to chunks. 0 (the
    /// default): the simulated device is the budget, and activations take from it.
    pub sim_activation_bytes: u64,
    /// The CUDA GPU the device tier (and a GPU step) opens, when it is a GPU.
    pub gpu_ordinal: usize,
    /// Directory of the swap file. Every open starts fresh: chunks an earlier run left
    /// there are dropped (resume from checkpoints).
    pub swap_dir: PathBuf,
    /// Block I/O settings of the swap file (its block size also sizes the searched
    /// chunks: they are whole multiples of it).
    pub io: IoConfig,
    /// Threads of the CPU AdamW (0: one per core).
    pub optimizer_threads: usize,
    /// How M and V are stored: fp32, bf16 or block-wise int8.
    pub moments: MomentForm,
    /// Where the optimizer step runs.
    pub step_device: StepDevice,
}

impl TrainerConfig {
    /// fp32, the given hyper-parameters, no clipping, non-finite steps skipped, overlap
    /// off, a searched chunk size, 4 device chunks and the smallest host pool (5
    /// chunks), the device the build has, swap file in `swap_dir` written in 64 KiB
    /// blocks, the step on the CPU.
    pub fn new(hp: HyperParams, swap_dir: impl Into<PathBuf>) -> Self {
        TrainerConfig {
            precision: Precision::F32,
            hp,
            max_grad_norm: None,
            overlap: Overlap::Off,
            check_finite: true,
            chunk_elements: None,
            device_budget: Budget::Chunks(4),
            host_budget: Budget::Chunks(5),
            device: DeviceChoice::Auto,
            sim_activation_bytes: 0,
            gpu_ordinal: 0,
            swap_dir: swap_dir.into(),
            io: IoConfig {
                block_bytes: 64 * 1024,
                queue_depth: 16,
                ..IoConfig::default()
            },
            optimizer_threads: 0,
            moments: MomentForm::F32,
            step_device: StepDevice::Cpu,
        }
    }
}
