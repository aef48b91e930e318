//! [`TideParams`]: a candle model's parameters, gradients, fp32 master weights, Adam M
//! and V kept in a tidestore [`ChunkStore`], and the step made by tidestore's AdamW.
//!
//! One training iteration, as the glue drives the store:
//! 1. **Forward.** [`ParamSource::param`] accesses the tensor (on the store's device
//!    tier: the GPU, or its host simulation), copies it into a fresh candle tensor and
//!    releases it `HOLD_AFTER_FWD`. Trainable tensors become [`Var`]s, so candle tracks
//!    their gradients; frozen ones (a LoRA base) are plain tensors with no gradient.
//! 2. **Backward.** [`TideParams::backward`] runs candle's backward, then, in reverse
//!    registration order, accesses each trainable tensor's gradient place on the host,
//!    copies the gradient there and releases it `HOLD_AFTER_BWD`. The candle graph and
//!    its copies of the parameters are dropped.
//! 3. **Step.** [`TideParams::step`] hands the step to tidestore's one step loop
//!    ([`tidestore_train::StepLoop`]): it decides the step (global norm, clipping) and,
//!    tensor by tensor, accesses gradient, master, M and V in the host pool — the store
//!    loads their chunks from NVMe where the budgets put them, and writes them back when
//!    the pool needs room — and runs the CPU AdamW kernel on them in place.
//!
//! Two precisions ([`Precision`]):
//! - `F32`: forward reads the fp32 master copy; gradients are fp32, kept in frozen fp32
//!   companion tensors `NAME#grad` registered after all parameters (the layout's own
//!   gradient place is 16-bit), so they fill chunks of their own. Numerically the same as training in
//!   candle's memory; the parity test runs this way. The 16-bit copy of the parameters
//!   the layout also allocates stays unused.
//! - `Bf16`: the layout's mixed precision: forward reads the bf16 copy (widened to f32
//!   for candle's compute), the bf16 gradient reuses that copy's space, and the step
//!   writes the new bf16 copy back there.
//!
//! Copies made per iteration (documented because they are the cost of the glue):
//! forward, per parameter: chunk bytes -> a `Vec<f32>` that candle takes over without
//! copying (plus candle's host -> GPU upload on a CUDA candle device); backward, per
//! trainable parameter: candle's gradient -> a `Vec<f32>` (a GPU -> host download on
//! CUDA) -> the chunk. The step works on the chunks in place (with a host pool of at
//! least five chunks; a smaller one steps through scratch copies, one chunk at a time).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{Device, Tensor, Var};
use tidestore_chunk::{
    search_chunk_size, typed, ChunkStore, DType, Layout, LayoutConfig, ListKind, MomentStates,
    MoveEvent, MoveKind, NvmeSource, Place, SearchConfig, StoreConfig, StoreStats, TensorId,
    TensorSpec, TensorState,
};
use tidestore_io::IoConfig;
use tidestore_optimizer::{
    AdamW, ControllerState, CpuConfig, Grads, HybridAdamW, HyperParams, OptimError, StepDecision,
};
use tidestore_tiers::{DeviceConfig, DeviceKind};
use tidestore_train::{GradPlace, Overlap, StepConfig, StepLoop, StepPlace, StepTensor};

use crate::error::{Error, Result};
use crate::source::{check_params, ParamSource, ParamSpec};

/// Which copy of the parameters forward reads, and the gradients' precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// fp32 compute from the master copy, fp32 gradients (see the module doc).
    #[default]
    F32,
    /// bf16 compute copy and bf16 gradients, fp32 master, M and V.
    Bf16,
}

/// How [`TideParams::open`] lays out and budgets the store.
#[derive(Debug, Clone)]
pub struct TideConfig {
    /// Forward/gradient precision.
    pub precision: Precision,
    /// AdamW hyper-parameters (one group).
    pub hp: HyperParams,
    /// Clip the global gradient norm to this, when given.
    pub max_grad_norm: Option<f32>,
    /// Chunk size in element slots; `None`: the chunk-size search (capped at twice the
    /// largest tensor, so a small model still has several chunks per list).
    pub chunk_elements: Option<u64>,
    /// Device budget for chunks, in chunks of the largest size (at least 4: the store
    /// sizes every tier for the step's four chunks in use at once).
    pub device_chunks: u32,
    /// Pinned host pool, in chunks of the largest size (at least 5: four in use by the
    /// step plus one staging buffer). Fewer than the model's chunks put the rest —
    /// M and V among them — on NVMe.
    pub host_chunks: u32,
    /// Directory of the swap file (its own, or a temporary one). Every open starts
    /// fresh: chunks an earlier run left there are dropped (resume from checkpoints).
    pub swap_dir: PathBuf,
    /// Block I/O settings of the swap file.
    pub io: IoConfig,
    /// Threads of the CPU AdamW (0: one per core).
    pub optimizer_threads: usize,
    /// Device and host budgets in bytes, when given instead of the chunk counts above
    /// (rounded down to whole chunks by the store).
    pub budget_bytes: Option<(u64, u64)>,
    /// How M and V are stored (`optimizer.states`): fp32, bf16 or block-wise int8.
    pub moments: MomentStates,
}

impl TideConfig {
    /// fp32, the given hyper-parameters, a searched chunk size, 4 device chunks and the
    /// smallest host pool (5 chunks), swap file in `swap_dir`.
    pub fn new(hp: HyperParams, swap_dir: impl Into<PathBuf>) -> Self {
        TideConfig {
            precision: Precision::F32,
            hp,
            max_grad_norm: None,
            chunk_elements: None,
            device_chunks: 4,
            host_chunks: 5,
            swap_dir: swap_dir.into(),
            io: IoConfig {
                block_bytes: 64 * 1024,
                queue_depth: 16,
                ..IoConfig::default()
            },
            optimizer_threads: 0,
            budget_bytes: None,
            moments: MomentStates::F32,
        }
    }
}

/// Bytes moved between host and NVMe, per chunk list (indexed by `ListKind as usize`).
#[derive(Debug, Default)]
pub struct NvmeTraffic {
    read_bytes: [AtomicU64; 5],
    written_bytes: [AtomicU64; 5],
}

impl NvmeTraffic {
    /// Bytes read from NVMe into the host pool for `list`.
    pub fn read_bytes(&self, list: ListKind) -> u64 {
        self.read_bytes[list as usize].load(Ordering::Relaxed)
    }

    /// Bytes written from the host pool to NVMe for `list`.
    pub fn written_bytes(&self, list: ListKind) -> u64 {
        self.written_bytes[list as usize].load(Ordering::Relaxed)
    }

    fn record(&self, e: &MoveEvent) {
        let list = e.chunk.list() as usize;
        match e.kind {
            MoveKind::NvmeToHost => self.read_bytes[list].fetch_add(e.bytes, Ordering::Relaxed),
            MoveKind::HostToNvme => self.written_bytes[list].fetch_add(e.bytes, Ordering::Relaxed),
            _ => 0,
        };
    }
}

#[derive(Debug)]
struct Entry {
    spec: ParamSpec,
    id: TensorId,
    /// F32 mode: the fp32 gradient companion (in the Param16 list).
    grad_id: Option<TensorId>,
    /// The tensor handed out in this forward pass.
    live: Option<Tensor>,
}

/// A model's parameters and optimizer state in a tidestore chunk store; see the module
/// doc.
pub struct TideParams {
    store: ChunkStore,
    device: Device,
    entries: Vec<Entry>,
    by_name: std::collections::HashMap<String, usize>,
    precision: Precision,
    forward_place: Place,
    step: StepLoop,
    grads_ready: bool,
    traffic: Arc<NvmeTraffic>,
}

impl std::fmt::Debug for TideParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TideParams")
            .field("params", &self.entries.len())
            .field("precision", &self.precision)
            .field("step", &self.step.step_count())
            .field("store", &self.store)
            .finish()
    }
}

const GRAD_SUFFIX: &str = "#grad";

impl TideParams {
    /// Registers `params` (spec and initial values, in forward order) in a new chunk
    /// store, writes their values, and readies the optimizer. Candle tensors are made on
    /// `device`. Budgets the store cannot work in are refused here, with the bytes
    /// needed and available.
    pub fn open(
        params: &[(ParamSpec, Vec<f32>)],
        config: &TideConfig,
        device: &Device,
    ) -> Result<Self> {
        check_params(params)?;
        let specs: Vec<ParamSpec> = params.iter().map(|(p, _)| p.clone()).collect();
        let mut this = Self::open_specs(&specs, config, device)?;
        for (i, (_, values)) in params.iter().enumerate() {
            this.set_values(i, values)?;
        }
        Ok(this)
    }

    /// As [`TideParams::open`], with every parameter zero: the values are then written
    /// one parameter at a time ([`TideParams::set_param`]), so a model larger than memory
    /// is never whole in RAM.
    pub fn open_specs(specs: &[ParamSpec], config: &TideConfig, device: &Device) -> Result<Self> {
        let mut seen = std::collections::HashSet::new();
        if let Some(p) = specs.iter().find(|p| !seen.insert(p.name.as_str())) {
            return Err(Error::BadParam {
                name: p.name.clone(),
                reason: "registered twice".into(),
            });
        }
        // Frozen tensors first, then the trainable ones (each in forward order): a LoRA
        // model's adapters then share a few chunks, instead of each leaving a mostly
        // empty master, M and V chunk beside its frozen base weight.
        let (frozen, trainable): (Vec<_>, Vec<_>) = specs.iter().partition(|p| !p.trainable);
        let mut tensors: Vec<TensorSpec> = frozen
            .iter()
            .chain(&trainable)
            .map(|p| TensorSpec::new(&p.name, &p.shape, DType::F32, p.trainable))
            .collect();
        if config.precision == Precision::F32 {
            // After every parameter, not next to each: mixed into the parameters' chunks
            // the companions (2 slots per element) would leave the master, M and V chunks
            // two-thirds empty, and every NVMe transfer three times too long.
            tensors.extend(specs.iter().filter(|p| p.trainable).map(|p| {
                let name = format!("{}{GRAD_SUFFIX}", p.name);
                TensorSpec::new(name, &p.shape, DType::F32, false)
            }));
        }
        let layout_cfg = LayoutConfig::new(1)
            .with_param16_dtype(DType::BF16)
            .with_moments(config.moments);
        let chunk_elements = match config.chunk_elements {
            Some(c) => c,
            None => {
                let mut search = SearchConfig::new(config.io.block_bytes as u64);
                search.cap_factor = 2;
                let report = search_chunk_size(&tensors, &layout_cfg, &search)?;
                report.chosen.chunk_elements
            }
        };
        let layout = Layout::new(
            LayoutConfig {
                chunk_elements,
                ..layout_cfg
            },
            tensors,
        )?;
        let ids = specs
            .iter()
            .map(|p| {
                let id = layout
                    .tensor_id(&p.name)
                    .ok_or_else(|| Error::UnknownParam {
                        name: p.name.clone(),
                    })?;
                let grad_id = layout.tensor_id(&format!("{}{GRAD_SUFFIX}", p.name));
                Ok((id, grad_id))
            })
            .collect::<Result<Vec<_>>>()?;

        let chunk_max_bytes = layout.dense_chunk_bytes().into_iter().max().unwrap_or(0);
        let slot_bytes = tidestore_io::align_up(chunk_max_bytes as usize) as u64;
        let chunks = layout
            .lists()
            .iter()
            .map(|&l| layout.list_chunk_count(l))
            .sum::<u64>();
        let (device_budget_bytes, host_budget_bytes) = config.budget_bytes.unwrap_or((
            u64::from(config.device_chunks) * slot_bytes,
            u64::from(config.host_chunks) * slot_bytes,
        ));
        let nvme_bytes = (chunks + 2) * slot_bytes;
        tracing::info!(
            chunk_elements,
            chunks,
            slot_bytes,
            device_budget_bytes,
            host_budget_bytes,
            nvme_bytes,
            waste = layout.waste_fraction(),
            "tidestore-candle: layout"
        );
        let store_device = if cfg!(feature = "cuda") {
            tidestore_tiers::Device::auto(&DeviceConfig::new(device_budget_bytes))
        } else {
            tidestore_tiers::Device::sim(&DeviceConfig::new(device_budget_bytes))
        }
        .map_err(|e| tidestore_chunk::ChunkError::tier("opening the device tier", None, e))?;
        // Candle builds its tensors from host memory; a simulated device is host memory,
        // a CUDA one is not (see the crate doc's weaknesses).
        let forward_place = match store_device.kind() {
            DeviceKind::Sim => Place::Device,
            _ => Place::Host,
        };
        let store_cfg = StoreConfig::new(
            device_budget_bytes,
            host_budget_bytes,
            NvmeSource::Dir {
                dir: config.swap_dir.clone(),
                bytes: nvme_bytes,
                io: config.io.clone(),
            },
        )
        // The step holds gradient, master, M and V at once.
        .with_working_set_chunks(4);
        let mut store = ChunkStore::open(layout, store_cfg, store_device)?;
        let traffic = Arc::new(NvmeTraffic::default());
        let t = traffic.clone();
        store.set_move_hook(Some(Box::new(move |e: &MoveEvent| t.record(e))));

        let entries: Vec<Entry> = specs
            .iter()
            .zip(ids)
            .map(|(spec, (id, grad_id))| Entry {
                spec: spec.clone(),
                id,
                grad_id,
                live: None,
            })
            .collect();
        let by_name = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.spec.name.clone(), i))
            .collect();
        let step = step_loop(&store, &entries, config)?;
        Ok(TideParams {
            store,
            device: device.clone(),
            entries,
            by_name,
            precision: config.precision,
            forward_place,
            step,
            grads_ready: false,
            traffic,
        })
    }

    /// Writes parameter `name`'s values (untraced; see [`TideParams::open_specs`]).
    pub fn set_param(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let i = self.index(name)?;
        if values.len() != self.entries[i].spec.elements() {
            return Err(Error::BadParam {
                name: name.into(),
                reason: format!(
                    "{} values for {} elements",
                    values.len(),
                    self.entries[i].spec.elements()
                ),
            });
        }
        self.set_values(i, values)
    }

    /// Writes a parameter's values (untraced): the master copy (and the bf16 copy in
    /// `Bf16` mode) of a trainable tensor, the fp32 tensor itself of a frozen one.
    fn set_values(&mut self, i: usize, values: &[f32]) -> Result<()> {
        let e = &self.entries[i];
        let id = e.id;
        if e.spec.trainable {
            self.store
                .write(id, ListKind::MasterF32, &f32_bytes(values))?;
            if self.precision == Precision::Bf16 {
                let mut b = vec![0u8; values.len() * 2];
                typed::encode_f32(values, DType::BF16, &mut b);
                self.store.write(id, ListKind::Param16, &b)?;
            }
        } else {
            self.store
                .write(id, ListKind::Param16, &f32_bytes(values))?;
        }
        Ok(())
    }

    fn index(&self, name: &str) -> Result<usize> {
        self.by_name
            .get(name)
            .copied()
            .ok_or_else(|| Error::UnknownParam {
                name: name.to_string(),
            })
    }

    /// The list forward reads a parameter from.
    fn forward_list(&self, trainable: bool) -> ListKind {
        match (trainable, self.precision) {
            (true, Precision::F32) => ListKind::MasterF32,
            _ => ListKind::Param16,
        }
    }

    /// Where a trainable tensor's gradient lives: (tensor, list).
    fn grad_place(&self, e: &Entry) -> (TensorId, ListKind) {
        match e.grad_id {
            Some(g) => (g, ListKind::Param16),
            None => (e.id, ListKind::Param16),
        }
    }

    /// Runs candle's backward from `loss` and puts every trainable parameter's gradient
    /// into the store (a parameter the forward did not use gets a zero gradient).
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        let grads = loss.backward()?;
        for i in (0..self.entries.len()).rev() {
            let live = self.entries[i].live.take();
            if !self.entries[i].spec.trainable {
                continue;
            }
            let n = self.entries[i].spec.elements();
            let values = match live.as_ref().and_then(|t| grads.get(t)) {
                Some(g) => g.flatten_all()?.to_vec1::<f32>()?,
                None => vec![0.0; n],
            };
            self.put_grad_at(i, &values, true, true)?;
        }
        Ok(())
    }

    /// Writes `values` as the final gradient of trainable parameter `name` and tells the
    /// step loop (the layer-streamed driver calls this as each block's backward ends).
    pub fn put_grad(&mut self, name: &str, values: &[f32]) -> Result<()> {
        self.put_grad_part(name, values, true, true)
    }

    /// Writes one micro-batch's part of `name`'s gradient: the first part replaces what
    /// is there, later ones are added to it (`Precision::F32` only: in bf16 the gradient
    /// lies over the 16-bit parameters the next micro-batch reads); after the `last`
    /// part the step loop is told the gradient is final.
    pub fn put_grad_part(
        &mut self,
        name: &str,
        values: &[f32],
        first: bool,
        last: bool,
    ) -> Result<()> {
        let i = self.index(name)?;
        let e = &self.entries[i];
        if !e.spec.trainable || values.len() != e.spec.elements() {
            return Err(Error::BadParam {
                name: name.into(),
                reason: format!(
                    "a gradient of {} values for a {} parameter of {} elements",
                    values.len(),
                    if e.spec.trainable {
                        "trainable"
                    } else {
                        "frozen"
                    },
                    e.spec.elements()
                ),
            });
        }
        if !first && e.grad_id.is_none() {
            return Err(Error::BadParam {
                name: name.into(),
                reason: "gradients are accumulated only with Precision::F32".into(),
            });
        }
        self.put_grad_at(i, values, first, last)
    }

    fn put_grad_at(&mut self, i: usize, values: &[f32], first: bool, last: bool) -> Result<()> {
        let (tensor, list) = self.grad_place(&self.entries[i]);
        let g = self.store.access(tensor, list, Place::Host)?;
        let written = if first {
            self.store.write_f32(&g, values).map(|()| values.to_vec())
        } else {
            self.store.read_f32(&g).and_then(|mut sum| {
                sum.iter_mut().zip(values).for_each(|(s, v)| *s += v);
                self.store.write_f32(&g, &sum).map(|()| sum)
            })
        };
        self.store.release(g, TensorState::HoldAfterBwd)?;
        let total = written?;
        if last {
            let sq = self.step.optimizer().cpu().grad_sq_norm(Grads::F32(&total));
            self.step.grad_ready(self.entries[i].id, sq)?;
            self.grads_ready = true;
        }
        Ok(())
    }

    /// Parameter `name` as a fresh candle tensor (a variable when `as_var` and the
    /// parameter is trainable), read from the store where forward reads it and released
    /// to `to` at once; nothing is kept (the layer-streamed driver's source).
    pub fn fetch(&mut self, name: &str, as_var: bool, to: TensorState) -> Result<(Tensor, bool)> {
        let i = self.index(name)?;
        let (id, trainable) = (self.entries[i].id, self.entries[i].spec.trainable);
        let list = self.forward_list(trainable);
        let g = self.store.access(id, list, self.forward_place)?;
        let values = self.store.read_f32(&g);
        self.store.release(g, to)?;
        let values = values?;
        let shape = self.entries[i].spec.shape.as_slice();
        let var = as_var && trainable;
        let t = if var {
            Var::from_vec(values, shape, &self.device)?.into_inner()
        } else {
            Tensor::from_vec(values, shape, &self.device)?
        };
        Ok((t, var))
    }

    /// One AdamW step over every trainable parameter, with the gradients of the last
    /// [`TideParams::backward`], by tidestore's step loop; ends the store's iteration.
    /// Returns the optimizer's decision (clipping coefficient, gradient norm).
    pub fn step(&mut self) -> Result<StepDecision> {
        if !self.grads_ready {
            return Err(Error::BadParam {
                name: String::new(),
                reason: "step() without backward() since the last step".into(),
            });
        }
        self.grads_ready = false;
        let outcome = self.step.finish(&mut self.store, &mut |_| {})?;
        self.store.end_iteration()?;
        Ok(outcome.decision)
    }

    /// Sets the learning rate of the steps to come (a schedule's).
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        Ok(self.step.set_lr(lr)?)
    }

    /// Steps applied so far.
    pub fn step_count(&self) -> u64 {
        self.step.step_count()
    }

    /// The optimizer's hyper-parameters.
    pub fn hyper_params(&self) -> &HyperParams {
        self.step.hyper_params()
    }

    /// The registered parameters, in forward order.
    pub fn specs(&self) -> impl Iterator<Item = &ParamSpec> {
        self.entries.iter().map(|e| &e.spec)
    }

    /// The chunk store (layout, residency, budgets).
    pub fn store(&self) -> &ChunkStore {
        &self.store
    }

    /// The store's counters.
    pub fn stats(&self) -> StoreStats {
        self.store.stats()
    }

    /// Bytes moved between host and NVMe per list since open.
    pub fn nvme_traffic(&self) -> &NvmeTraffic {
        &self.traffic
    }

    /// A parameter's current fp32 values (the master copy of a trainable one); untraced.
    pub fn values(&mut self, name: &str) -> Result<Vec<f32>> {
        let e = &self.entries[self.index(name)?];
        let (id, list) = if e.spec.trainable {
            (e.id, ListKind::MasterF32)
        } else {
            (e.id, ListKind::Param16)
        };
        Ok(bytes_f32(&self.store.read(id, list)?))
    }

    /// The last gradient of trainable parameter `name` (`Precision::F32` only: there the
    /// gradient has its own fp32 tensor, which the step reads and leaves; in `Bf16` the
    /// step writes the new parameters over it); untraced.
    pub fn grad_values(&mut self, name: &str) -> Result<Vec<f32>> {
        let e = &self.entries[self.index(name)?];
        let grad = e.grad_id.ok_or_else(|| Error::BadParam {
            name: name.into(),
            reason: "no gradient of its own (frozen, or Precision::Bf16)".into(),
        })?;
        Ok(bytes_f32(&self.store.read(grad, ListKind::Param16)?))
    }

    /// A trainable parameter's Adam moments (M, V) as f32, decoded from their stored
    /// form (bf16 widened, int8 dequantized); untraced.
    pub fn moments(&mut self, name: &str) -> Result<(Vec<f32>, Vec<f32>)> {
        let id = self.entries[self.index(name)?].id;
        let loc = self.store.layout().location(id, ListKind::MomentumF32);
        let (dtype, n) = loc.map_or((DType::F32, 0), |l| (l.dtype, l.elements as usize));
        let m = decode_moment(&self.store.read(id, ListKind::MomentumF32)?, dtype, n, true);
        let v = decode_moment(
            &self.store.read(id, ListKind::VarianceF32)?,
            dtype,
            n,
            false,
        );
        Ok((m, v))
    }

    /// Forward/gradient precision.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The tensors a checkpoint holds: every registered parameter, in forward order
    /// (not the `F32` gradient companions, which are not state between steps).
    pub(crate) fn checkpoint_ids(&self) -> Vec<TensorId> {
        self.entries.iter().map(|e| e.id).collect()
    }

    /// The chunk store, for what streams tensors in or out of it (checkpoints, exports):
    /// between steps, with no forward pass in progress.
    pub fn store_mut(&mut self) -> &mut ChunkStore {
        &mut self.store
    }

    /// Gradients of a [`TideParams::backward`] wait for [`TideParams::step`].
    pub(crate) fn grads_pending(&self) -> bool {
        self.grads_ready
    }

    /// A forward pass handed out tensors that its backward has not consumed yet.
    pub(crate) fn forward_in_progress(&self) -> bool {
        self.entries.iter().any(|e| e.live.is_some())
    }

    /// The optimizer's step count and loss-scaler state, for [`crate::checkpoint`].
    pub(crate) fn controller_state(&self) -> ControllerState {
        self.step.controller_state()
    }

    pub(crate) fn restore_controller(&mut self, state: ControllerState) -> Result<()> {
        Ok(self.step.restore(state)?)
    }
}

impl ParamSource for TideParams {
    fn param(&mut self, name: &str) -> Result<Tensor> {
        let i = self.index(name)?;
        if let Some(t) = &self.entries[i].live {
            return Ok(t.clone());
        }
        let (id, trainable) = (self.entries[i].id, self.entries[i].spec.trainable);
        let list = self.forward_list(trainable);
        let g = self.store.access(id, list, self.forward_place)?;
        let values = self.store.read_f32(&g);
        self.store.release(g, TensorState::HoldAfterFwd)?;
        let values = values?;
        let shape = self.entries[i].spec.shape.as_slice();
        // `from_vec` takes the vector over: no copy on the CPU, one upload on a GPU.
        let t = if trainable {
            Var::from_vec(values, shape, &self.device)?.into_inner()
        } else {
            Tensor::from_vec(values, shape, &self.device)?
        };
        self.entries[i].live = Some(t.clone());
        Ok(t)
    }
}

/// The step loop over `entries`' trainable tensors: on the host, gradients in their fp32
/// companions (`F32`) or over the bf16 copy (`Bf16`), stepped after backward.
fn step_loop(store: &ChunkStore, entries: &[Entry], config: &TideConfig) -> Result<StepLoop> {
    let cpu = AdamW::new(CpuConfig {
        threads: config.optimizer_threads,
        ..CpuConfig::default()
    })?;
    let opt = HybridAdamW::cpu_only(
        cpu,
        OptimError::NoGpu {
            reason: "the candle glue steps in the host pool".into(),
        },
    );
    let tensors = entries
        .iter()
        .filter(|e| e.spec.trainable)
        .map(|e| StepTensor {
            tensor: e.id,
            grad: match e.grad_id {
                Some(grad) => GradPlace::Separate {
                    grad,
                    write_param16: false,
                },
                None => GradPlace::InParam16,
            },
        })
        .collect();
    let cfg = StepConfig {
        hp: config.hp,
        max_grad_norm: config.max_grad_norm,
        loss_scaler: None,
        place: StepPlace::Host,
        overlap: Overlap::Off,
    };
    Ok(StepLoop::new(store, opt, tensors, cfg)?)
}

pub(crate) fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A moment's stored bytes as f32: fp32 as is, bf16 widened, a Q8 place (codes, padding,
/// absmax) dequantized with the signed (M) or unsigned (V) map.
fn decode_moment(bytes: &[u8], dtype: DType, n: usize, signed: bool) -> Vec<f32> {
    match dtype {
        DType::Q8 => {
            let q = tidestore_optimizer::quant::maps();
            let map = if signed { &q.signed } else { &q.unsigned };
            let absmax = bytes_f32(&bytes[n.next_multiple_of(4)..]);
            let blocks = tidestore_optimizer::quant::absmax_len(n);
            let mut out = vec![0.0; n];
            tidestore_optimizer::quant::dequantize(map, &bytes[..n], &absmax[..blocks], &mut out);
            out
        }
        d => {
            let mut out = vec![0.0; bytes.len() / d.size_bytes() as usize];
            typed::decode_f32(bytes, d, &mut out);
            out
        }
    }
}

pub(crate) fn bytes_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
