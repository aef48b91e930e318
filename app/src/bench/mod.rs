//! `tidestore bench` as a library: warm-up plus N iterations of a fine-tuning workload's
//! forward, backward and optimizer step through the real chunk store and the real step
//! loop ([`tidestore_train::StepLoop`]), measured per phase.
//!
//! What is real: every tensor is registered in a [`ChunkStore`] and moves between the
//! device tier, the pinned host pool and the NVMe swap file as its budgets and the
//! eviction/prefetch policy decide; every accessed tensor's bytes are read (a 64-bit
//! wrapping sum over them, reported as the checksum); every trainable tensor's gradient
//! is written into its 16-bit space in backward; the step loop runs the optimizer crate's
//! AdamW over every trainable parameter (fp32 master, M and V from the store, bf16
//! gradients in, bf16 parameters out), with global-norm clipping.
//!
//! What is emulated: the compute. No matmul runs; gradients are a fixed pseudo-random
//! pattern (`pattern.rs`); activations are not allocated but reported to the store as
//! non-model device memory ([`tidestore::workload::Workload::activation_bytes`]), which
//! drives the tidal device budget exactly as real activations would. With
//! `workload.tflops` set, forward and backward take the time their FLOPs take at that
//! rate (`compute.rs`), so that the store's transfers and, with `optimizer.overlap =
//! "backward"`, the optimizer's steps run while the device computes; the report then
//! sets the iteration against its bound ([`BoundReport`]).
//!
//! Where the bytes are touched: on the simulated device and in the host pool the bench
//! reads and writes them on the host; on a CUDA device (feature `cuda`) forward and
//! backward run the kernels of `crate::gpu` on the tensors where they lie (a checksum
//! accumulated on the device and read back once per phase, the gradient pattern written
//! there), each finished before its tensor is released. Both sides compute the same bits.
//!
//! Where the step runs is `optimizer.device` (`placement.rs`): `cpu`, the host pool;
//! `gpu`, the device (the GPU kernel on CUDA, the CPU kernel over the simulation's
//! memory); `auto`, `gpu` where a CUDA GPU's step budget holds all trainable state.
//!
//! [`ChunkStore`]: tidestore_chunk::ChunkStore

pub(crate) mod compute;
mod disk;
#[cfg(not(feature = "cuda"))]
mod no_cuda;
mod pattern;
mod placement;
mod report;

use std::time::Instant;

use half::bf16;
use tidestore_chunk::{
    ChunkStore, Guard, ListKind, Place, TensorId, TensorState, TensorView, TensorViewMut,
};
use tidestore_optimizer::placement::HybridAdamW;
use tidestore_optimizer::{OptimError, StepDecision};
use tidestore_tiers::{DeviceView, DeviceViewMut};
use tidestore_train::{ParamSpec, Precision, StepConfig, StepPlace, Trainer};

use crate::error::{Error, Result};
#[cfg(feature = "cuda")]
use crate::gpu::BenchKernels;
use compute::{ComputeModel, ComputeStream};
#[cfg(not(feature = "cuda"))]
use no_cuda::BenchKernels;
use pattern::{noise, pattern_offset, INIT_SEED, PATTERN_SLACK};
use placement::{choose_placement, step_needs, StepBudget, StepPlacement};
use report::Counters;
use tidestore::config::{Config, DeviceKindName, OptimizerDevice};
use tidestore::session::{self, Session};
use tidestore::workload::{ActivationModel, Block};

pub use disk::DiskRates;
pub use pattern::{checksum, grad_value, splitmix64, unit_f32, GRAD_SCALE, GRAD_SEED};
pub use placement::cpu_optimizer;
pub use report::{
    BenchReport, BoundReport, BudgetReport, ChunkReport, ListReport, NoProgress, OptimizerReport,
    PeakReport, PhaseName, PhaseReport, Progress, Sample, StoreReport, WorkloadReport, EMULATED,
    SCHEMA,
};

/// Bytes per pass of the disk probe made before the first iteration.
const DISK_PROBE_BYTES: u64 = 256 << 20;
/// Bytes of the swap file's chunks read before the first iteration (see `disk`).
const SWAP_PROBE_BYTES: u64 = 512 << 20;

/// Usage samples for the plot, and the peaks of the current phase.
#[derive(Debug, Default)]
struct Sampler {
    /// Whether to keep samples (the last measured iteration).
    sampling: bool,
    moment: u32,
    phase: Option<PhaseName>,
    samples: Vec<Sample>,
    iter_base: Counters,
    /// Peaks of the current phase: device, host, NVMe.
    peaks: [u64; 3],
}

impl Sampler {
    /// One moment: the store after an access or a release.
    fn observe(&mut self, store: &ChunkStore) {
        let u = store.usage();
        for (p, t) in self.peaks.iter_mut().zip([u.device, u.host, u.nvme]) {
            *p = (*p).max(t.used_bytes);
        }
        if self.sampling {
            let c = Counters::of(store).since(self.iter_base);
            self.samples.push(Sample {
                moment: self.moment,
                phase: self.phase.unwrap_or(PhaseName::Init),
                usage: u,
                host_to_device_bytes: c.h2d,
                device_to_host_bytes: c.d2h,
                nvme_to_host_bytes: c.n2h,
                host_to_nvme_bytes: c.h2n,
            });
        }
        self.moment += 1;
    }
}

/// The running state of one bench: the workload, and the trainer over its store (the
/// step loop; the only way its gradients reach it).
struct Runner<'p> {
    s: Session,
    trainer: Trainer,
    progress: &'p mut dyn Progress,
    sampler: Sampler,
    checksum: u64,
    /// The GPU kernels, on a CUDA device only.
    kernels: Option<BenchKernels>,
    /// bf16 gradient pattern, longer than the largest trainable tensor by `PATTERN_SLACK`.
    grad_pattern: Vec<bf16>,
    compute: ComputeModel,
    stream: ComputeStream,
    /// Per tensor: its gradient's squared norm, once written in this backward.
    grad_sq: Vec<Option<f64>>,
    /// Per tensor: the (block, position) of its last use in backward, where its gradient
    /// is final (a tied embedding is used by the head and the embedding block).
    grad_final_at: Vec<Option<(usize, usize)>>,
    placement: StepPlacement,
}

fn no_kernels() -> Error {
    Error::Bench("a tensor is in GPU memory but the bench's GPU kernels are not loaded".into())
}

impl Runner<'_> {
    fn id(&self, i: usize) -> TensorId {
        self.s.ids[i]
    }

    fn elements(&self, i: usize) -> usize {
        self.s.workload.tensors[i].shape.iter().product()
    }

    fn access(&mut self, i: usize, list: ListKind, place: Place) -> Result<Guard> {
        if list == ListKind::Params {
            // Its step due from the last iteration first (`optimizer.overlap = "forward"`).
            self.trainer.step_deferred(i)?;
        }
        let store = self.trainer.store_mut();
        let g = store.access(self.s.ids[i], list, place)?;
        self.sampler.observe(store);
        Ok(g)
    }

    fn release(&mut self, g: Guard, to: TensorState) -> Result<()> {
        let store = self.trainer.store_mut();
        store.release(g, to)?;
        self.sampler.observe(store);
        self.progress.advance(1);
        Ok(())
    }

    /// Queues `seconds` of modeled compute on the device stream; when it will be done
    /// (`None` when compute is not modeled).
    fn launch(&mut self, seconds: f64) -> Option<Instant> {
        self.compute.is_on().then(|| self.stream.launch(seconds))
    }

    /// Waits for modeled compute launched with [`Runner::launch`].
    fn wait(&mut self, deadline: Option<Instant>) -> Result<()> {
        match deadline {
            Some(end) => self.stream.wait(end, self.trainer.store_mut()),
            None => Ok(()),
        }
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
            self.trainer.store_mut().write(
                id,
                ListKind::Params,
                bytemuck::cast_slice(&values16[o..o + len]),
            )?;
            if self.s.workload.tensors[i].trainable {
                self.trainer.store_mut().write(
                    id,
                    ListKind::Master,
                    bytemuck::cast_slice(&values[o..o + len]),
                )?;
            }
            self.progress.advance(1);
        }
        self.progress.finish(PhaseName::Init);
        Ok(())
    }

    /// Starts `phase` of `iteration`, one progress step a tensor: the workload's
    /// activation sizes and its blocks, for the pass to walk.
    fn start_pass(&mut self, phase: PhaseName, iteration: u32) -> (ActivationModel, Vec<Block>) {
        let act = self.s.workload.activation_bytes();
        let blocks = self.s.workload.blocks.clone();
        let steps: usize = blocks.iter().map(|b| b.tensors.len()).sum();
        self.progress.start(phase, iteration, steps as u64);
        (act, blocks)
    }

    fn forward(&mut self, iteration: u32) -> Result<()> {
        let (act, blocks) = self.start_pass(PhaseName::Forward, iteration);
        let mut layer = 0u64;
        for (bi, b) in blocks.iter().enumerate() {
            let non_model = act.at(layer, b.name == "head");
            self.trainer.store_mut().report_non_model_bytes(non_model);
            for (k, &i) in b.tensors.iter().enumerate() {
                let g = self.access(i, ListKind::Params, Place::Device)?;
                // The checksum stands in for the device reading the tensor: part of the
                // modeled compute, not added to it.
                let deadline = self.launch(self.compute.forward_seconds(bi, k));
                self.add_checksum(&g)?;
                self.wait(deadline)?;
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
        match self.trainer.store().view(g)? {
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
        match self.trainer.store_mut().view_mut(g)? {
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
        let cpu = self.trainer.step_loop().optimizer().cpu();
        Ok(cpu.grad_sq_norm(tidestore_optimizer::Grads::Bf16(grads)))
    }

    /// Adds what the GPU kernels accumulated in this phase (one read-back).
    fn collect_device_checksum(&mut self) -> Result<()> {
        if let Some(k) = self.kernels.as_mut() {
            self.checksum = self.checksum.wrapping_add(k.take_checksum()?);
        }
        Ok(())
    }

    /// Backward, blocks in reverse: each tensor accessed on the device, its gradient
    /// written at its first use, its compute launched; while the device computes, the
    /// step loop steps the tensors whose gradients are final (`optimizer.overlap =
    /// "backward"`); a gradient is reported final at the tensor's last use.
    fn backward(&mut self, iteration: u32) -> Result<()> {
        let (act, blocks) = self.start_pass(PhaseName::Backward, iteration);
        self.grad_sq.iter_mut().for_each(|d| *d = None);
        let mut layer = act.layers;
        for (bi, b) in blocks.iter().enumerate().rev() {
            if b.is_layer {
                layer -= 1;
            }
            self.trainer
                .store_mut()
                .report_non_model_bytes(act.at(layer, b.name == "head"));
            for (k, &i) in b.tensors.iter().enumerate().rev() {
                self.backward_one(bi, k, i, iteration)?;
            }
        }
        self.trainer.store_mut().report_non_model_bytes(0);
        self.collect_device_checksum()?;
        self.progress.finish(PhaseName::Backward);
        Ok(())
    }

    fn backward_one(&mut self, bi: usize, k: usize, i: usize, iteration: u32) -> Result<()> {
        let g = self.access(i, ListKind::Params, Place::Device)?;
        // Reading the tensor and writing its gradient stand in for the device's work.
        let deadline = self.launch(self.compute.backward_seconds(bi, k));
        let trainable = self.s.workload.tensors[i].trainable;
        if trainable && self.grad_sq[i].is_none() {
            self.grad_sq[i] = Some(self.checksum_and_write_grads(&g, i, iteration)?);
        } else {
            self.add_checksum(&g)?;
        }
        let Runner {
            trainer, sampler, ..
        } = self;
        trainer.step_ready(deadline, &mut |st| sampler.observe(st))?;
        self.wait(deadline)?;
        let to = if trainable {
            TensorState::HoldAfterBwd
        } else {
            TensorState::Hold
        };
        self.release(g, to)?;
        if self.grad_final_at[i] == Some((bi, k)) {
            let sq = self.grad_sq[i].ok_or_else(|| {
                Error::Bench("a gradient reported final before it was written".into())
            })?;
            self.trainer.grad_written(i, sq)?;
        }
        Ok(())
    }

    /// The step of every tensor not stepped during backward (all of them with
    /// `optimizer.overlap = "off"`).
    fn optimizer(&mut self, iteration: u32) -> Result<StepDecision> {
        let left = self.step_tensor_count();
        self.progress
            .start(PhaseName::Optimizer, iteration, 8 * left as u64);
        let Runner {
            trainer,
            sampler,
            progress,
            ..
        } = self;
        let outcome = trainer.finish_step(&mut |st| {
            sampler.observe(st);
            progress.advance(1);
        })?;
        self.progress.finish(PhaseName::Optimizer);
        Ok(outcome.decision)
    }

    fn step_tensor_count(&self) -> usize {
        self.s
            .workload
            .tensors
            .iter()
            .filter(|t| t.trainable)
            .count()
    }
}

/// The trainer over the session's store: every tensor of the workload (tensor `i` is
/// parameter `i`), gradients over the 16-bit copies, stepped where `placement` says
/// with the config's overlap.
fn trainer(
    cfg: &Config,
    s: &Session,
    store: ChunkStore,
    opt: HybridAdamW,
    placement: &StepPlacement,
) -> Result<Trainer> {
    let max_norm =
        (cfg.optimizer.max_grad_norm > 0.0).then_some(cfg.optimizer.max_grad_norm as f32);
    let specs: Vec<ParamSpec> = s
        .workload
        .tensors
        .iter()
        .map(|t| ParamSpec::new(&t.name, &t.shape, t.trainable))
        .collect();
    let step_cfg = StepConfig {
        hp: cfg.hyper_params(),
        max_grad_norm: max_norm,
        loss_scaler: None,
        place: if placement.on_device {
            StepPlace::Device
        } else {
            StepPlace::Host
        },
        overlap: cfg.optimizer.overlap.into(),
        check_finite: true,
    };
    Ok(Trainer::with_store(
        store,
        &specs,
        Precision::Bf16,
        step_cfg,
        opt,
    )?)
}

/// Per trainable tensor, the (block, position) of its last use in backward (blocks in
/// reverse, positions in reverse): the first use in forward order. Frozen tensors (the
/// base weights of a LoRA run) have no gradient, so none.
fn grad_final_at(s: &Session) -> Vec<Option<(usize, usize)>> {
    let mut at = vec![None; s.workload.tensors.len()];
    for (bi, b) in s.workload.blocks.iter().enumerate().rev() {
        for (k, &i) in b.tensors.iter().enumerate().rev() {
            if s.workload.tensors[i].trainable {
                at[i] = Some((bi, k));
            }
        }
    }
    at
}

/// Opens the session and everything the runner needs, with every up-front check.
fn open<'p>(cfg: &Config, progress: &'p mut dyn Progress) -> Result<Runner<'p>> {
    let cpu = cpu_optimizer(cfg)?;
    cfg.hyper_params()
        .validate()
        .map_err(|e| Error::config("optimizer", e.to_string()))?;
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
    let (store, s) = session::open(cfg, prepared)?;
    let on_gpu = session::is_gpu(&store);
    // On a GPU, forward and backward run the bench's kernels; the GPU AdamW is made only
    // where the step may run on it.
    let kernels = if on_gpu {
        Some(BenchKernels::new(session::device_ordinal(cfg))?)
    } else {
        None
    };
    let opt = if on_gpu && cfg.optimizer.device != OptimizerDevice::Cpu {
        HybridAdamW::new(cpu, session::device_ordinal(cfg))
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
            StepBudget::of(cfg, &store)?,
            &needs,
            opt.gpu_status(),
        )?,
    };
    tracing::info!(on_device = placement.on_device, reason = %placement.reason, "bench: optimizer step placement");
    let trainer = trainer(cfg, &s, store, opt, &placement)?;
    let w = &s.workload;
    let longest_trainable = w
        .tensors
        .iter()
        .filter(|t| t.trainable)
        .map(|t| t.shape.iter().product::<usize>())
        .max()
        .unwrap_or(0);
    let grad_pattern: Vec<bf16> = (0..(longest_trainable + PATTERN_SLACK) as u64)
        .map(|k| grad_value(GRAD_SEED, k, GRAD_SCALE))
        .collect();
    Ok(Runner {
        trainer,
        progress,
        sampler: Sampler::default(),
        checksum: 0,
        kernels,
        grad_pattern,
        compute: ComputeModel::new(w, cfg.workload.tflops),
        stream: ComputeStream::default(),
        grad_sq: vec![None; w.tensors.len()],
        grad_final_at: grad_final_at(&s),
        placement,
        s,
    })
}

/// The report's description of the workload, chunks and budgets.
fn describe(
    cfg: &Config,
    s: &Session,
    store: &ChunkStore,
) -> (WorkloadReport, ChunkReport, BudgetReport) {
    let w = &s.workload;
    let workload = WorkloadReport {
        model: w.model.to_string(),
        arch: w.shape.arch.as_str().into(),
        description: w.describe(),
        mode: if w.lora.is_some() { "lora" } else { "full" }.into(),
        lora_rank: w.lora.map(|(r, _)| r),
        params_base: w.params_base(),
        params_trainable: w.params_trainable(),
        tensors: w.tensors.len(),
        layers: w.shape.layers,
        micro_batch: w.micro_batch,
        sequence: w.sequence,
        activation_peak_bytes: w.activation_bytes().peak(),
    };
    let layout = store.layout();
    let chunks = ChunkReport {
        chunk_elements: s.chunk_elements,
        searched: s.chunk_searched,
        param16_chunk_bytes: layout.chunk_bytes(ListKind::Params),
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
        device_kind: store.device().kind().to_string(),
        device_memory_bytes: s.device_memory_bytes,
        device_bytes: cfg.device.budget.bytes(),
        tidal_margin_bytes: cfg.device.tidal_margin.bytes(),
        host_bytes: cfg.host.budget.bytes(),
        nvme_bytes: cfg.nvme.size.bytes(),
    };
    (workload, chunks, budgets)
}

/// What the measured iterations add up to.
#[derive(Debug, Default)]
struct Measured {
    phases: Vec<PhaseReport>,
    warmup_seconds: f64,
    seconds: f64,
    steps_applied: u64,
    steps_skipped: u64,
    grad_norm: f64,
}

const PHASES: [PhaseName; 3] = [
    PhaseName::Forward,
    PhaseName::Backward,
    PhaseName::Optimizer,
];

/// The traced warm-up and `iterations` measured iterations.
fn iterate(r: &mut Runner<'_>, iterations: u32) -> Result<Measured> {
    let mut m = Measured {
        phases: PHASES
            .iter()
            .map(|p| PhaseReport {
                name: p.as_str().into(),
                ..PhaseReport::default()
            })
            .collect(),
        ..Measured::default()
    };
    for it in 0..=iterations {
        let iter_started = Instant::now();
        if it == 1 {
            r.trainer.reset_stats();
        }
        r.sampler.sampling = it == iterations && it > 0;
        r.sampler.moment = 0;
        r.sampler.iter_base = Counters::of(r.trainer.store());
        for (k, phase) in PHASES.into_iter().enumerate() {
            r.sampler.phase = Some(phase);
            r.sampler.peaks = [0; 3];
            let before = Counters::of(r.trainer.store());
            let t = Instant::now();
            match phase {
                PhaseName::Forward => r.forward(it)?,
                PhaseName::Backward => r.backward(it)?,
                _ => match r.optimizer(it)? {
                    StepDecision::Apply { grad_norm, .. } => m.grad_norm = grad_norm,
                    StepDecision::Skip { .. } => {}
                },
            }
            let secs = t.elapsed().as_secs_f64();
            if it > 0 {
                let c = Counters::of(r.trainer.store()).since(before);
                let p = &mut m.phases[k];
                p.seconds += secs;
                p.host_to_device_bytes += c.h2d;
                p.device_to_host_bytes += c.d2h;
                p.nvme_to_host_bytes += c.n2h;
                p.host_to_nvme_bytes += c.h2n;
                p.stall_seconds += c.stall_ns as f64 / 1e9;
                p.accesses += c.accesses;
                p.nvme_wait_seconds += c.nvme.wait_ns as f64 / 1e9;
                // Averages over the phases summed so far (time-weighted).
                p.nvme_requests_in_flight += c.nvme.piece_ns as f64 / 1e9;
                p.nvme_busy_fraction += c.nvme.busy_ns as f64 / 1e9;
                p.peak_device_bytes = p.peak_device_bytes.max(r.sampler.peaks[0]);
                p.peak_host_bytes = p.peak_host_bytes.max(r.sampler.peaks[1]);
                p.peak_nvme_bytes = p.peak_nvme_bytes.max(r.sampler.peaks[2]);
            }
        }
        r.trainer.end_iteration()?;
        let secs = iter_started.elapsed().as_secs_f64();
        if it == 0 {
            m.warmup_seconds = secs;
        } else {
            m.seconds += secs;
        }
    }
    for p in &mut m.phases {
        // Summed piece-seconds and busy seconds become averages over the phase's time.
        if p.seconds > 0.0 {
            p.nvme_requests_in_flight /= p.seconds;
            p.nvme_busy_fraction /= p.seconds;
            p.nvme_read_bytes_per_s = p.nvme_to_host_bytes as f64 / p.seconds;
        } else {
            p.nvme_requests_in_flight = 0.0;
            p.nvme_busy_fraction = 0.0;
        }
    }
    let st = r.trainer.step_loop().stats();
    m.steps_applied = st.steps_applied;
    m.steps_skipped = st.steps_skipped;
    Ok(m)
}

/// The iteration's bound (see [`BoundReport`]).
fn bound(
    cfg: &Config,
    r: &Runner<'_>,
    m: &Measured,
    disk: DiskRates,
    iterations: u32,
) -> BoundReport {
    let per_it = |x: u64| x / u64::from(iterations);
    let sum = |f: fn(&PhaseReport) -> u64| per_it(m.phases.iter().map(f).sum());
    let h2d = sum(|p| p.host_to_device_bytes);
    let d2h = sum(|p| p.device_to_host_bytes);
    let n2h = sum(|p| p.nvme_to_host_bytes);
    let h2n = sum(|p| p.host_to_nvme_bytes);
    let compute_seconds = r.compute.iteration_seconds();
    let pcie_seconds = h2d.max(d2h) as f64 / (cfg.device.pcie_gbps * 1e9);
    let nvme_seconds = disk.seconds(n2h, h2n);
    let optimizer_seconds =
        r.trainer.step_loop().stats().kernel_ns as f64 / 1e9 / f64::from(iterations);
    let bound_seconds = compute_seconds
        .max(pcie_seconds)
        .max(nvme_seconds)
        .max(optimizer_seconds);
    let measured = m.seconds / f64::from(iterations);
    BoundReport {
        tflops: cfg.workload.tflops,
        compute_seconds,
        pcie_seconds,
        nvme_seconds,
        optimizer_seconds,
        bound_seconds,
        efficiency: if measured > 0.0 {
            bound_seconds / measured
        } else {
            0.0
        },
        disk,
    }
}

/// Runs the bench the configuration describes (see the module doc). Every up-front
/// check happens before the first iteration.
pub fn run(cfg: &Config, progress: &mut dyn Progress) -> Result<BenchReport> {
    let mut r = open(cfg, progress)?;
    let disk = disk::probe(cfg.nvme_dir()?, &cfg.io_config()?, DISK_PROBE_BYTES)?;
    let (workload, chunks, budgets) = describe(cfg, &r.s, r.trainer.store());
    let started = Instant::now();
    r.init()?;
    r.trainer.store_mut().sync()?;
    let init_seconds = started.elapsed().as_secs_f64();
    let (swap_path, regions) = r.trainer.store().nvme().with_swap_file(|f| {
        let regions: Vec<(u64, u64)> = f
            .chunks()
            .filter_map(|(id, slot)| {
                // Whole pages: the slot holds the chunk's last page whole.
                let len = tidestore_io::align_up(f.stored_bytes_of(id)?).min(f.slot_bytes());
                Some((f.slot_offset_bytes(slot), len as u64))
            })
            .collect();
        (f.path().to_path_buf(), regions)
    });
    let disk = disk.with_swap_reads(&swap_path, &cfg.io_config()?, &regions, SWAP_PROBE_BYTES)?;
    let iterations = cfg.workload.iterations;
    let mut m = iterate(&mut r, iterations)?;
    r.trainer.complete_step()?;
    r.trainer.store_mut().sync()?;
    let st = r.trainer.store().stats();
    let opt_seconds = m.phases[2].seconds;
    let trainable_params = r.s.workload.params_trainable();
    let (step_stats, steps) = (r.trainer.step_loop().stats(), m.steps_applied);
    let cpu = r.trainer.step_loop().optimizer().cpu();
    let optimizer = OptimizerReport {
        placement: if r.placement.on_device { "gpu" } else { "cpu" }.into(),
        simulated: step_stats.simulated,
        placement_reason: r.placement.reason.clone(),
        simd: format!("{:?}", cpu.simd_level()).to_lowercase(),
        simd_reason: cpu.simd_reason().describe(),
        threads: cpu.threads(),
        params_per_step: trainable_params,
        steps_applied: steps,
        steps_skipped: m.steps_skipped,
        params_per_s: if opt_seconds > 0.0 {
            (trainable_params * steps) as f64 / opt_seconds
        } else {
            0.0
        },
        kernel_params_per_s: if step_stats.kernel_ns > 0 {
            (trainable_params * steps) as f64 / (step_stats.kernel_ns as f64 / 1e9)
        } else {
            0.0
        },
        grad_norm: m.grad_norm,
        overlap: cfg.optimizer.overlap.as_str().into(),
        tensors_overlapped: step_stats.tensors_overlapped,
        tensors_deferred: step_stats.tensors_deferred,
    };
    let bound = bound(cfg, &r, &m, disk, iterations);
    for p in &mut m.phases {
        let no_nvme = (p.seconds - p.nvme_wait_seconds).max(0.0);
        p.bound_seconds = no_nvme.max(disk.seconds(p.nvme_to_host_bytes, p.host_to_nvme_bytes));
    }
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
        warmup_seconds: m.warmup_seconds,
        seconds_per_iteration: m.seconds / f64::from(iterations),
        phases: std::mem::take(&mut m.phases),
        nvme_queue_depth: r.trainer.store().nvme().queue_depth() as u64,
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
            nvme_reads_ahead: st.nvme_reads_ahead,
            nvme_reads_on_demand: st.nvme_reads_on_demand,
        },
        bound,
        checksum: format!("{:016x}", r.checksum),
        samples: std::mem::take(&mut r.sampler.samples),
    })
}
