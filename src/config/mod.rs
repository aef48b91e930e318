//! The `tidestore.toml` configuration: parsing, sizes, and validation that names keys.
//!
//! One TOML file, one section per concern: `[io]` (block I/O), `[chunk]` (chunk size),
//! `[device]`, `[host]`, `[nvme]` (the three tiers and their budgets), `[policy]`
//! (eviction and prefetch), `[optimizer]` (AdamW and where it runs) and `[workload]`
//! (the model `tidestore bench` and `tidestore plan` drive). Every struct rejects unknown
//! keys, every size is a [`Size`] ("24GiB", "512MiB", "4096" or a plain integer), and
//! every error is an [`Error::Config`] that names the key as written in TOML and the
//! reason, with the file, line and column where the parser points at it. Invariants kept:
//! - [`Config::from_toml_str`] never touches the filesystem; [`Config::load`] also
//!   resolves `nvme.dir` against the config file's folder and checks that it can be
//!   written (creating its last component if missing);
//! - a `Config` that passed [`Config::validate`] converts into an [`IoConfig`] the io
//!   crate accepts.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tidestore_io::{EngineChoice, IoConfig, ALIGN_BYTES};

use crate::error::{from_io_validation, Error, Result};
pub use crate::workload::WorkloadSection;

mod gpu;
mod parse;
mod size;
mod train;
mod trainer;

pub use gpu::GpuOrdinal;
use parse::parse;
#[cfg(test)]
use parse::{key_and_reason, locate};
pub use size::{human_bytes, AutoSize, Size};

/// A setting's value as a TOML file writes it (`"zstd"`, `"64MiB"`, `4`), for messages
/// that name what the user wrote.
pub fn as_toml<T: serde::Serialize + std::fmt::Debug>(value: &T) -> String {
    match toml::Value::try_from(value) {
        Ok(v) => v.to_string(),
        Err(_) => format!("{value:?}"),
    }
}
#[cfg(test)]
use size::{GIB, MIB, TIB};
pub use train::*;

/// `io.engine`: which engine moves the bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineName {
    /// io_uring where the kernel allows it, else the thread pool (logged).
    #[default]
    Auto,
    /// io_uring or an error.
    IoUring,
    /// `pread`/`pwrite` on a thread pool.
    Threads,
}

impl From<EngineName> for EngineChoice {
    fn from(e: EngineName) -> Self {
        match e {
            EngineName::Auto => EngineChoice::Auto,
            EngineName::IoUring => EngineChoice::IoUring,
            EngineName::Threads => EngineChoice::ThreadPool,
        }
    }
}

/// `[io]`: how block I/O is done.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct IoSection {
    pub engine: EngineName,
    /// Size of the requests a chunk is split into; a positive multiple of 4096.
    pub block_size: Size,
    /// Most requests in flight at once, 1..=4096.
    pub queue_depth: u32,
    /// Open files with O_DIRECT.
    pub direct: bool,
    /// Register the buffer pool with io_uring (READ_FIXED / WRITE_FIXED).
    pub fixed_buffers: bool,
    /// Workers of the thread-pool engine, 1..=256.
    pub threads: u32,
}

impl Default for IoSection {
    fn default() -> Self {
        let io = IoConfig::default();
        IoSection {
            engine: match io.engine {
                EngineChoice::IoUring => EngineName::IoUring,
                EngineChoice::ThreadPool => EngineName::Threads,
                _ => EngineName::Auto,
            },
            block_size: Size(io.block_bytes as u64),
            queue_depth: io.queue_depth,
            direct: io.direct,
            fixed_buffers: io.fixed_buffers,
            threads: u32::try_from(io.threads).unwrap_or(u32::MAX),
        }
    }
}

/// `[chunk]`: the unit every transfer moves.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct ChunkSection {
    /// Bytes of one fp32 chunk (master, M, V); 16-bit chunks are half as large. A chunk
    /// is stored as the part its tensors use; one host buffer and one slot of the swap
    /// file is the largest stored chunk. `"auto"`: the chunk crate's search picks the
    /// size that wastes least for the workload's tensors (`finetune` and the trainer:
    /// least waste plus the five chunks a step holds at once).
    /// A fixed size is a positive multiple of 4096.
    pub size: AutoSize,
}

impl Default for ChunkSection {
    fn default() -> Self {
        ChunkSection {
            size: AutoSize::Auto,
        }
    }
}

/// `[nvme]`: the NVMe tier.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct NvmeSection {
    /// Folder of the swap file (and of `io-bench`'s file). Required. Relative paths are
    /// relative to the configuration file's folder.
    pub dir: Option<PathBuf>,
    /// Size of the swap file; holds at least one chunk.
    pub size: Size,
    /// Compression of the chunks written to the swap file.
    pub compression: CompressionName,
}

impl Default for NvmeSection {
    fn default() -> Self {
        NvmeSection {
            dir: None,
            size: Size::from_gib(16),
            compression: CompressionName::Off,
        }
    }
}

/// `nvme.compression`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CompressionName {
    /// Chunks are stored as they are (the fastest on a fast drive).
    #[default]
    Off,
    /// Byte-shuffled zstd level 1 (smaller files, more CPU).
    Zstd,
}

/// `device.kind`: which backend the device tier is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKindName {
    /// A CUDA GPU when built with `cuda` and one is present, else the simulation.
    #[default]
    Auto,
    /// A CUDA GPU or an error.
    Cuda,
    /// The device simulated in host memory.
    Sim,
}

/// `[device]`: the GPU tier (or its simulation in host memory).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct DeviceSection {
    /// Which backend.
    pub kind: DeviceKindName,
    /// Most device bytes chunks may use during forward/backward (the tide never rises
    /// above it).
    pub budget: Size,
    /// Device bytes kept free of chunks above the activations' peak.
    pub tidal_margin: Size,
    /// Memory of the simulated device; `"auto"`: the budget plus the workload's
    /// activation peak plus the margin. Ignored on a GPU (its real memory is used).
    pub sim_memory: AutoSize,
    /// Host <-> device link rate in GB/s (10^9 bytes/s) each way: the simulated device's
    /// copies take at least this long, and the bench's bound and `plan` count PCIe time
    /// at this rate.
    pub pcie_gbps: f64,
    /// Which CUDA GPU: a number, or `"auto"` (GPU 0, or under data parallel the rank's
    /// local rank).
    pub ordinal: GpuOrdinal,
}

impl Default for DeviceSection {
    fn default() -> Self {
        DeviceSection {
            kind: DeviceKindName::Auto,
            budget: Size::from_gib(4),
            tidal_margin: Size::from_mib(0),
            sim_memory: AutoSize::Auto,
            pcie_gbps: 25.0,
            ordinal: GpuOrdinal::Auto,
        }
    }
}

/// `[host]`: the pinned host pool.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct HostSection {
    /// Bytes of the pinned host pool (whole buffers of the largest stored chunk each).
    pub budget: Size,
}

impl Default for HostSection {
    fn default() -> Self {
        HostSection {
            budget: Size::from_gib(8),
        }
    }
}

/// `policy.eviction`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionName {
    /// Evict the chunk whose next use on the traced schedule is farthest (Belady).
    #[default]
    Lifetime,
    /// Least recently used.
    Lru,
    /// First in, first out.
    Fifo,
}

impl From<EvictionName> for tidestore_chunk::PolicyKind {
    fn from(e: EvictionName) -> Self {
        match e {
            EvictionName::Lifetime => tidestore_chunk::PolicyKind::Lifetime,
            EvictionName::Lru => tidestore_chunk::PolicyKind::Lru,
            EvictionName::Fifo => tidestore_chunk::PolicyKind::Fifo,
        }
    }
}

/// `[policy]`: eviction and prefetch.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct PolicySection {
    /// Which chunk leaves a full tier.
    pub eviction: EvictionName,
    /// Device accesses the device prefetcher looks ahead (0: no prefetch), at most
    /// 4096: the next this many moments at which the device uses a chunk.
    pub prefetch_lookahead: u32,
    /// Moments the host-tier prefetcher (NVMe -> host reads for host accesses, e.g.
    /// the CPU optimizer's) looks ahead (0: off), at most 4096.
    pub host_prefetch_lookahead: u32,
}

impl Default for PolicySection {
    fn default() -> Self {
        PolicySection {
            eviction: EvictionName::Lifetime,
            prefetch_lookahead: 8,
            host_prefetch_lookahead: tidestore_chunk::config::DEFAULT_HOST_PREFETCH_LOOKAHEAD,
        }
    }
}

/// `optimizer.device`: where AdamW runs. `tidestore bench` steps one trainable tensor at a
/// time, its 16-bit param/gradient, fp32 master, M and V together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerDevice {
    /// `gpu` where the device is a CUDA GPU, the GPU AdamW kernel is ready and the
    /// device budget during the step holds all trainable state (so the step moves no
    /// chunk); `cpu` otherwise, and always on the simulated device.
    #[default]
    Auto,
    /// The CPU kernel over the tensors' chunks in the pinned host pool.
    Cpu,
    /// The tensors' chunks on the device, stepped there: the GPU kernel on a CUDA GPU,
    /// the CPU kernel over the simulated device's memory on the simulated one. The
    /// device budget during the step (the device's memory less what is not chunks less
    /// `device.tidal_margin`) must hold the four chunks of the largest trainable tensor,
    /// and on a GPU the GPU kernel must be ready; otherwise the run refuses to start,
    /// naming this key.
    Gpu,
}

impl OptimizerDevice {
    /// The trainer's setting of the same name.
    pub fn step_device(self) -> tidestore_train::StepDevice {
        match self {
            OptimizerDevice::Auto => tidestore_train::StepDevice::Auto,
            OptimizerDevice::Cpu => tidestore_train::StepDevice::Cpu,
            OptimizerDevice::Gpu => tidestore_train::StepDevice::Gpu,
        }
    }
}

/// `optimizer.overlap`: when tensors are stepped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OverlapName {
    /// After backward.
    #[default]
    Off,
    /// During backward, each chunk of gradients as soon as it is final (needs
    /// `max_grad_norm = 0`: clipping needs every gradient before the first step).
    Backward,
    /// Decided after backward (clipping and skips as with `off`), each chunk group's
    /// tensors stepped in the next forward right before compute reads the first of
    /// them, their chunk I/O under forward's compute; bit-identical to `off`.
    Forward,
}

impl OverlapName {
    /// The name as the config spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            OverlapName::Off => "off",
            OverlapName::Backward => "backward",
            OverlapName::Forward => "forward",
        }
    }
}

/// `optimizer.mode`: how weight decay enters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecayMode {
    /// Decoupled weight decay (PyTorch `AdamW`).
    #[default]
    Adamw,
    /// L2 regularisation added to the gradient (PyTorch `Adam` with `weight_decay`).
    AdamL2,
}

/// `optimizer.states`: how Adam's M and V are stored (chunks, disk, PCIe, checkpoints).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StatesName {
    /// fp32 moments (8 bytes per trained parameter).
    #[default]
    Fp32,
    /// bf16 moments, rounded to nearest even (4 bytes).
    Bf16,
    /// Block-wise 8-bit dynamic quantization, one fp32 absmax per 256 (2 bytes + 1/32);
    /// tensors under 4096 elements keep fp32 moments.
    Int8,
}

impl StatesName {
    /// The layout's form of the moment lists.
    pub fn moments(self) -> tidestore_chunk::MomentForm {
        match self {
            StatesName::Fp32 => tidestore_chunk::MomentForm::F32,
            StatesName::Bf16 => tidestore_chunk::MomentForm::BF16,
            StatesName::Int8 => tidestore_chunk::MomentForm::Int8,
        }
    }
}

/// `[optimizer]`: AdamW hyper-parameters and where the step runs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct OptimizerSection {
    /// Where the step runs.
    pub device: OptimizerDevice,
    /// CPU worker threads; 0: one per core.
    pub threads: u32,
    /// Learning rate (finite, >= 0).
    pub lr: f64,
    /// Decay of the first moment, in [0, 1).
    pub beta1: f64,
    /// Decay of the second moment, in [0, 1).
    pub beta2: f64,
    /// Added to the bias-corrected sqrt(v) (finite, > 0).
    pub eps: f64,
    /// Weight decay (finite, >= 0).
    pub weight_decay: f64,
    /// Decoupled (AdamW) or L2 weight decay.
    pub mode: DecayMode,
    /// Clip the global gradient norm to this; 0 turns clipping off.
    pub max_grad_norm: f64,
    /// When tensors are stepped: after backward, or during it.
    pub overlap: OverlapName,
    /// How M and V are stored: fp32, bf16 or int8.
    pub states: StatesName,
}

impl Default for OptimizerSection {
    fn default() -> Self {
        OptimizerSection {
            device: OptimizerDevice::Auto,
            threads: 0,
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            mode: DecayMode::Adamw,
            max_grad_norm: 1.0,
            overlap: OverlapName::Off,
            states: StatesName::Fp32,
        }
    }
}

/// The whole configuration file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct Config {
    pub io: IoSection,
    pub chunk: ChunkSection,
    pub device: DeviceSection,
    pub host: HostSection,
    pub nvme: NvmeSection,
    pub policy: PolicySection,
    pub optimizer: OptimizerSection,
    pub workload: WorkloadSection,
    pub train: TrainSection,
}

impl Config {
    /// Parse and validate a configuration from TOML text. Does not touch the filesystem:
    /// `nvme.dir` is checked for presence only (see [`Config::check_dirs`]).
    pub fn from_toml_str(src: &str) -> Result<Config> {
        let cfg: Config = parse(src)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Read, parse and validate the file at `path`; resolve a relative `nvme.dir` against
    /// the file's folder, and check that it is a writable folder (creating its last
    /// component if it is missing). Errors carry the file name.
    pub fn load(path: &Path) -> Result<Config> {
        let src = std::fs::read_to_string(path).map_err(|source| Error::ConfigRead {
            path: path.to_path_buf(),
            source,
        })?;
        let mut cfg = Config::from_toml_str(&src).map_err(|e| e.in_file(path))?;
        let base = path.parent().unwrap_or(Path::new(""));
        let t = &mut cfg.train;
        for dir in [
            &mut cfg.nvme.dir,
            &mut t.model_dir,
            &mut t.text,
            &mut t.data,
            &mut t.chat_template,
            &mut t.checkpoint_dir,
            &mut t.export_dir,
            &mut t.export_merged,
        ] {
            if let Some(d) = dir.as_mut().filter(|d| d.is_relative()) {
                *d = base.join(&*d);
            }
        }
        cfg.check_dirs().map_err(|e| e.in_file(path))?;
        Ok(cfg)
    }

    /// Check every value, without touching the filesystem; the error names the first bad
    /// key.
    pub fn validate(&self) -> Result<()> {
        self.io_config()?.validate().map_err(from_io_validation)?;
        let chunk_bytes = self.chunk.size.fixed().map_or(0, Size::bytes);
        if self.chunk.size != AutoSize::Auto
            && (chunk_bytes == 0 || !chunk_bytes.is_multiple_of(ALIGN_BYTES as u64))
        {
            return Err(Error::config(
                "chunk.size",
                format!(
                    "{chunk_bytes} bytes is not a positive multiple of {ALIGN_BYTES} \
                     (chunks are moved with O_DIRECT)"
                ),
            ));
        }
        match &self.nvme.dir {
            None => {
                return Err(Error::config(
                    "nvme.dir",
                    "missing: set the folder that holds the swap file, e.g. dir = \"/mnt/nvme/tidestore\"",
                ))
            }
            Some(dir) if dir.as_os_str().is_empty() => {
                return Err(Error::config("nvme.dir", "is empty: set the folder that holds the swap file"))
            }
            Some(_) => {}
        }
        if self.nvme.size.bytes() == 0 {
            return Err(Error::config(
                "nvme.size",
                "a swap file of 0 bytes holds no chunk",
            ));
        }
        if self.nvme.size.bytes() < chunk_bytes {
            return Err(Error::config(
                "nvme.size",
                format!(
                    "a swap file of {} is too small for one chunk of {} (chunk.size)",
                    self.nvme.size, self.chunk.size
                ),
            ));
        }
        self.validate_tiers()?;
        self.validate_optimizer()?;
        self.workload.validate()?;
        self.train.validate()?;
        Ok(())
    }

    fn validate_tiers(&self) -> Result<()> {
        let pcie = self.device.pcie_gbps;
        if !(pcie.is_finite() && pcie > 0.0 && pcie <= 10_000.0) {
            return Err(Error::config(
                "device.pcie_gbps",
                format!("{pcie} is outside (0, 10000] GB/s"),
            ));
        }
        if self.device.budget.bytes() == 0 {
            return Err(Error::config(
                "device.budget",
                "0 bytes: chunks need room on the device",
            ));
        }
        if let AutoSize::Fixed(m) = self.device.sim_memory {
            let need = self.device.budget.bytes() + self.device.tidal_margin.bytes();
            if m.bytes() < need {
                return Err(Error::config(
                    "device.sim_memory",
                    format!(
                        "{m} is less than device.budget + device.tidal_margin ({})",
                        Size(need)
                    ),
                ));
            }
        }
        if self.host.budget.bytes() == 0 {
            return Err(Error::config(
                "host.budget",
                "0 bytes: chunks pass through the host pool on their way to and from NVMe",
            ));
        }
        if self.policy.prefetch_lookahead > 4096 {
            return Err(Error::config(
                "policy.prefetch_lookahead",
                format!("{} is outside 0..=4096", self.policy.prefetch_lookahead),
            ));
        }
        if self.policy.host_prefetch_lookahead > 4096 {
            return Err(Error::config(
                "policy.host_prefetch_lookahead",
                format!(
                    "{} is outside 0..=4096",
                    self.policy.host_prefetch_lookahead
                ),
            ));
        }
        Ok(())
    }

    fn validate_optimizer(&self) -> Result<()> {
        let o = &self.optimizer;
        let finite = |key: &str, v: f64| -> Result<()> {
            if v.is_finite() && v <= f64::from(f32::MAX) {
                Ok(())
            } else {
                Err(Error::config(key, format!("{v} is not a finite number")))
            }
        };
        finite("optimizer.lr", o.lr)?;
        if o.lr < 0.0 {
            return Err(Error::config(
                "optimizer.lr",
                format!("{} is negative", o.lr),
            ));
        }
        for (key, v) in [("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)] {
            finite(key, v)?;
            if !(0.0..1.0).contains(&v) {
                return Err(Error::config(key, format!("{v} is outside [0, 1)")));
            }
        }
        finite("optimizer.eps", o.eps)?;
        if o.eps <= 0.0 {
            return Err(Error::config(
                "optimizer.eps",
                format!("{} is not > 0", o.eps),
            ));
        }
        finite("optimizer.weight_decay", o.weight_decay)?;
        if o.weight_decay < 0.0 {
            return Err(Error::config(
                "optimizer.weight_decay",
                format!("{} is negative", o.weight_decay),
            ));
        }
        finite("optimizer.max_grad_norm", o.max_grad_norm)?;
        if o.max_grad_norm < 0.0 {
            return Err(Error::config(
                "optimizer.max_grad_norm",
                format!("{} is negative (0 turns clipping off)", o.max_grad_norm),
            ));
        }
        if o.threads > 1024 {
            return Err(Error::config(
                "optimizer.threads",
                format!("{} is outside 0..=1024", o.threads),
            ));
        }
        if o.overlap == OverlapName::Backward && o.max_grad_norm > 0.0 {
            return Err(Error::config(
                "optimizer.overlap",
                format!(
                    "\"backward\" steps tensors before the last gradient exists, but \
                     global-norm clipping (optimizer.max_grad_norm = {}) needs every \
                     gradient first; set max_grad_norm = 0, or overlap = \"forward\" (decided \
                     after backward, stepped in the next forward) or \"off\"",
                    o.max_grad_norm
                ),
            ));
        }
        Ok(())
    }

    /// Check that `nvme.dir` is a folder we can write to, creating it first if only its
    /// last component is missing (a missing parent is an error, not a tree to build).
    pub fn check_dirs(&self) -> Result<()> {
        let dir = self.nvme_dir()?;
        if !dir.exists() {
            match std::fs::create_dir(dir) {
                Ok(()) => tracing::info!(dir = %dir.display(), "created nvme.dir"),
                // Another process or thread made it between the check and here: fine, the
                // writability check below still looks at what is there.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(Error::config(
                        "nvme.dir",
                        format!(
                            "{} does not exist and cannot be created: {e}",
                            dir.display()
                        ),
                    ))
                }
            }
        }
        tidestore_io::check_writable_dir("nvme.dir", dir).map_err(from_io_validation)
    }

    /// The folder of the NVMe tier (an error naming `nvme.dir` when it is not set).
    pub fn nvme_dir(&self) -> Result<&Path> {
        self.nvme.dir.as_deref().ok_or_else(|| {
            Error::config(
                "nvme.dir",
                "missing: set the folder that holds the swap file",
            )
        })
    }

    /// The `[io]` section as the io crate's configuration (not yet validated).
    pub fn io_config(&self) -> Result<IoConfig> {
        let io = &self.io;
        let block_bytes = usize::try_from(io.block_size.bytes()).map_err(|_| {
            Error::config(
                "io.block_size",
                format!("{} does not fit in memory", io.block_size),
            )
        })?;
        Ok(IoConfig {
            engine: io.engine.into(),
            block_bytes,
            queue_depth: io.queue_depth,
            direct: io.direct,
            fixed_buffers: io.fixed_buffers,
            threads: io.threads as usize,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        let cases = [
            ("4096", 4096),
            ("0", 0),
            ("64MiB", 64 * MIB),
            ("64 MiB", 64 * MIB),
            ("64m", 64 * MIB),
            ("24GiB", 24 * GIB),
            ("1.5GiB", 3 * GIB / 2),
            ("2TB", 2_000_000_000_000),
            ("4kB", 4000),
            ("1_048_576", MIB),
            ("512B", 512),
        ];
        for (text, bytes) in cases {
            assert_eq!(text.parse::<Size>(), Ok(Size(bytes)), "{text}");
        }
    }

    #[test]
    fn bad_sizes_say_why() {
        for (text, why) in [
            ("-4096", "negative"),
            ("-1GiB", "negative"),
            ("12 parsecs", "not a size"),
            ("", "empty"),
            ("GiB", "not a size"),
            ("1.2.3MiB", "not a size"),
            ("0.1KiB", "whole number"),
            ("99999999999TiB", "too large"),
        ] {
            let err = text.parse::<Size>().unwrap_err();
            assert!(err.contains(why), "{text}: {err}");
        }
    }

    #[test]
    fn size_display_round_trips() {
        for bytes in [0, 1, 4096, 6144, MIB, 3 * GIB / 2, 5 * TIB] {
            let s = Size(bytes);
            assert_eq!(s.to_string().parse::<Size>(), Ok(s));
        }
        assert_eq!(Size::from_mib(64).to_string(), "64MiB");
    }

    #[test]
    fn key_of_unknown_and_missing_fields_includes_the_field() {
        let (k, r) = key_and_reason("io", "unknown field `blok_size`, expected one of `engine`");
        assert_eq!(k, "io.blok_size");
        assert!(r.starts_with("unknown key"), "{r}");
        let (k, _) = key_and_reason(".", "unknown field `cuda`, expected one of `io`");
        assert_eq!(k, "cuda");
        let (k, _) = key_and_reason("cuda", "unknown field `cuda`, expected one of `io`");
        assert_eq!(k, "cuda");
        let (k, _) = key_and_reason("io.blok", "unknown field `blok`, expected one of `a`");
        assert_eq!(k, "io.blok");
        let (k, _) = key_and_reason("io.queue_depth", "invalid type: string \"x\", expected u32");
        assert_eq!(k, "io.queue_depth");
    }

    #[test]
    fn locations_are_one_based() {
        let src = "a = 1\nbé = 2\n";
        assert_eq!(locate(src, Some(0..1)).line_column, Some((1, 1)));
        assert_eq!(locate(src, Some(10..11)).line_column, Some((2, 4)));
        assert_eq!(locate(src, None).line_column, None);
    }

    #[test]
    fn defaults_need_only_a_dir() {
        let cfg = Config::from_toml_str("[nvme]\ndir = \"/tmp\"\n").unwrap();
        assert_eq!(cfg.io, IoSection::default());
        assert_eq!(cfg.io_config().unwrap(), IoConfig::default());
    }

    #[test]
    fn the_gpu_is_a_number_or_auto_and_auto_follows_the_local_rank() {
        let read = |v: &str| {
            Config::from_toml_str(&format!(
                "[nvme]\ndir = \"/tmp\"\n[device]\nordinal = {v}\n"
            ))
        };
        let one = read("1").unwrap().device.ordinal;
        assert_eq!(one, GpuOrdinal::Index(1));
        assert_eq!(
            one.resolve(Some(3)),
            1,
            "a named GPU wins over the local rank"
        );
        let auto = read("\"auto\"").unwrap().device.ordinal;
        assert_eq!(auto, GpuOrdinal::Auto);
        assert_eq!(Config::default().device.ordinal, GpuOrdinal::Auto);
        assert_eq!(auto.resolve(None), 0);
        assert_eq!(auto.resolve(Some(3)), 3);
        for bad in ["-1", "\"first\"", "1.5"] {
            let e = read(bad).expect_err(bad).to_string();
            assert!(e.contains("device.ordinal"), "{bad}: {e}");
        }
        let e = read("-1").unwrap_err().to_string();
        assert!(e.contains("-1 is not a GPU number"), "{e}");
    }

    proptest::proptest! {
        #[test]
        fn any_size_round_trips_through_its_text(bytes in 0u64..u64::MAX / 2) {
            let s = Size(bytes);
            proptest::prop_assert_eq!(s.to_string().parse::<Size>(), Ok(s));
        }
    }
}
