//! [`Trainer`]: the one place where a training run meets the store. Every front end —
//! the candle glue, the Python package, a library user — opens its run here and goes
//! through it; none of them touches the chunk store, the tiers or the I/O engine.
//!
//! What it does, in the order of one iteration:
//! - **open** ([`Trainer::open`], `open.rs`): the parameters laid out in chunk lists
//!   (with an fp32 gradient list in [`Precision::F32`]), the chunk size searched,
//!   budgets resolved, the device tier and the store opened, the step loop readied;
//! - **values in and out** (`values.rs`): initial or imported weights written, a
//!   parameter handed out for compute ([`Trainer::fetch`]), its master copy, gradient
//!   and decoded moments read back;
//! - **gradients** (`grads.rs`): [`Trainer::put_grad`] writes a gradient (or one
//!   micro-batch's part of it), takes its norm and reports it to the step loop; a front
//!   end that wrote a gradient into the store itself reports it through
//!   [`Trainer::grad_written`]. That function is the only way a gradient enters the
//!   step loop;
//! - **step** ([`Trainer::step`]): the step loop decides and makes the optimizer step
//!   and the store's iteration ends; with `Overlap::Forward` the updates are made in the
//!   next forward, each chunk group's at the first access of one of its parameters
//!   ([`Trainer::step_deferred`]), and before anything reads the optimizer state
//!   ([`Trainer::complete_step`]);
//! - **state** (`state.rs`): checkpoints streamed out of the store and back.
//!
//! Invariant: between [`Trainer::put_grad`] of an iteration's first gradient and
//! [`Trainer::step`], checkpoints are refused (the gradients would be lost, and in bf16
//! they lie over the 16-bit copy).

mod config;
mod grads;
mod open;
mod placement;
mod state;
mod values;

pub use values::{decode_moment, Lease, Resident, Values};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tidestore_chunk::{ChunkStore, ListKind, MoveEvent, MoveKind, Place, StoreStats, TensorId};
use tidestore_optimizer::HyperParams;

pub use config::{Budget, DeviceChoice, ParamSpec, Precision, StepDevice, TrainerConfig};
pub use placement::{decide_step_place, DeviceShare, StepNeeds};

use crate::error::{Result, TrainError};
use crate::step::StepLoop;

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

/// One registered parameter.
#[derive(Debug)]
struct Entry {
    spec: ParamSpec,
    id: TensorId,
    /// Its gradient was reported final in this iteration.
    reported: bool,
}

/// A training run's parameters, gradients and optimizer state in a chunk store, and the
/// step loop over them; see the module doc.
pub struct Trainer {
    store: ChunkStore,
    step: StepLoop,
    entries: Vec<Entry>,
    by_name: HashMap<String, usize>,
    precision: Precision,
    /// Where compute reads parameters (see [`Trainer::set_compute_on_device`]).
    compute_place: Place,
    /// The simulated device stands in for a GPU: compute reads it as it would a GPU's
    /// memory (else, a simulation left where no GPU was found, compute reads where the
    /// step writes).
    sim_stands_in: bool,
    /// A master copy was handed out as resident ([`Trainer::resident_master`]).
    resident: bool,
    /// Bytes between host and NVMe per list, counted through the store's move hook (a
    /// trainer that opened its store; see [`Trainer::with_store`]).
    traffic: Option<Arc<NvmeTraffic>>,
    /// Why the step runs where it does (see [`Trainer::step_on_device`]).
    step_reason: String,
    /// The store's swap file.
    swap_path: std::path::PathBuf,
    /// Gradients reported since the last step (parts of an accumulation included once
    /// the last part is in).
    reported: usize,
    /// The iteration in progress began with steps due from the last one
    /// (`Overlap::Forward`; see [`Trainer::end_iteration`]).
    began_with_due: bool,
    /// The most compute's activations took ([`Trainer::hold_activations`]).
    activation_peak_bytes: u64,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("params", &self.entries.len())
            .field("precision", &self.precision)
            .field("step", &self.step.step_count())
            .field("store", &self.store)
            .finish()
    }
}

impl Trainer {
    /// The index of parameter `name` (its place in the specs it was opened with).
    pub fn index(&self, name: &str) -> Result<usize> {
        self.by_name
            .get(name)
            .copied()
            .ok_or_else(|| TrainError::Tensor {
                tensor: name.to_string(),
                reason: "not a registered parameter".into(),
            })
    }

    fn entry(&self, i: usize) -> Result<&Entry> {
        self.entries.get(i).ok_or_else(|| TrainError::Argument {
            tensor: format!("#{i}"),
            reason: format!("index out of range ({} parameters)", self.entries.len()),
        })
    }

    /// Parameter `i`'s spec.
    pub fn spec(&self, i: usize) -> Result<&ParamSpec> {
        Ok(&self.entry(i)?.spec)
    }

    /// The registered parameters, in forward order.
    pub fn specs(&self) -> impl Iterator<Item = &ParamSpec> {
        self.entries.iter().map(|e| &e.spec)
    }

    /// Number of registered parameters.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no parameter is registered (never, for an opened trainer).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Compute and gradient precision.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Sets the learning rate of the steps to come (a schedule's).
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        self.step.set_lr(lr)
    }

    /// Sets every hyper-parameter of the steps to come: see [`StepLoop::set_hyper_params`].
    pub fn set_hyper_params(&mut self, hp: HyperParams) -> Result<()> {
        self.step.set_hyper_params(hp)
    }

    /// Steps applied so far.
    pub fn step_count(&self) -> u64 {
        self.step.step_count()
    }

    /// The optimizer's hyper-parameters.
    pub fn hyper_params(&self) -> &HyperParams {
        self.step.hyper_params()
    }

    /// Makes this trainer one rank of a data-parallel run that steps its shards of the
    /// tensors: see [`StepLoop::set_peers`].
    pub fn set_norm_peers(&mut self, peers: Box<dyn crate::NormPeers>) {
        self.step.set_peers(peers);
    }

    /// Whether the optimizer step runs on the device tier, for every tensor or some of
    /// them (`TrainerConfig::step_device` as decided at open, or [`Trainer::split_step`]:
    /// the GPU kernel on a GPU, the CPU kernel over the simulated device's memory), and
    /// why, in one phrase. Gradients are then written where the step reads them, on the
    /// device ([`Trainer::grad_view`]).
    pub fn step_placement(&self) -> (bool, &str) {
        (
            self.step.place() == crate::step::StepPlace::Device,
            &self.step_reason,
        )
    }

    /// Splits a step that runs in the host pool: trainable parameters `params` are
    /// stepped on the device tier from now on (the GPU kernel; the CPU kernel over the
    /// simulated device), the others in the host pool, and each one's gradient is
    /// written where its step reads it. `auto` makes this split at open on a GPU whose
    /// budget holds every 16-bit parameter chunk and part of the state
    /// ([`crate::DeviceShare`]). Refused between a gradient and its step, for a step on
    /// the device already, for a frozen parameter, and once a master copy was handed out
    /// as resident in the host pool ([`Trainer::resident_master`]); nothing changes then.
    pub fn split_step(&mut self, params: &[usize]) -> Result<()> {
        self.between_steps("splitting the step")?;
        if self.resident {
            return Err(TrainError::Protocol(
                "a master copy was handed out as resident in the host pool: its step stays \
                 there"
                    .into(),
            ));
        }
        let ids = params
            .iter()
            .map(|&i| self.trainable_id(i))
            .collect::<Result<Vec<_>>>()?;
        self.step.place_on_device(&self.store, &ids)?;
        self.step_reason = format!(
            "split: {} of {} trainable tensors stepped on the device, the others in the host \
             pool",
            self.step.on_device_count(),
            self.step.tensor_count()
        );
        Ok(())
    }

    /// The step loop (its counters, optimizer and settings).
    pub fn step_loop(&self) -> &StepLoop {
        &self.step
    }

    /// The chunk store (layout, residency, budgets, counters).
    pub fn store(&self) -> &ChunkStore {
        &self.store
    }

    /// The chunk store, for a front end that accesses tensors itself (the bench: its
    /// emulated compute reads and writes tensors where they lie, and reports their
    /// gradients with [`Trainer::grad_written`]).
    pub fn store_mut(&mut self) -> &mut ChunkStore {
        &mut self.store
    }

    /// The store's counters.
    pub fn stats(&self) -> StoreStats {
        self.store.stats()
    }

    /// Counters of the store and the step loop, by name: NVMe bytes read and written,
    /// bytes copied between the host pool and the device tier, the host budget (bytes,
    /// buffers), the chunk size, whether the step runs in place, steps applied, tensors
    /// stepped during backward and in the next forward, host evictions, the most compute's
    /// activations took ([`Trainer::hold_activations`]); per list of the
    /// optimizer state (master, M, V), the bytes the store keeps of it (used prefixes of
    /// its chunks, page-rounded) and (where counted) its NVMe traffic.
    pub fn counters(&self) -> std::collections::BTreeMap<&'static str, u64> {
        let s = self.store.stats();
        let plan = self.store.capacity_plan();
        let mut counters = std::collections::BTreeMap::from([
            ("nvme_read_bytes", s.nvme_to_host_bytes),
            ("nvme_written_bytes", s.host_to_nvme_bytes),
            ("host_to_device_bytes", s.host_to_device_bytes),
            ("device_to_host_bytes", s.device_to_host_bytes),
            ("host_budget_bytes", plan.host_buffers * plan.slot_bytes),
            ("host_buffers", plan.host_buffers),
            ("chunk_elements", self.store.layout().chunk_elements()),
            ("step_in_place", u64::from(self.step.in_place())),
            ("steps", self.step.step_count()),
            ("tensors_overlapped", self.step.stats().tensors_overlapped),
            ("tensors_deferred", self.step.stats().tensors_deferred),
            ("host_evictions", s.host_evictions),
            ("activation_peak_bytes", self.activation_peak_bytes),
        ]);
        // What each rank of a data-parallel run holds and moves of its shards.
        let layout = self.store.layout();
        let lists = [
            (
                ListKind::Master,
                [
                    "master_bytes",
                    "master_nvme_read_bytes",
                    "master_nvme_written_bytes",
                ],
            ),
            (
                ListKind::Momentum,
                ["m_bytes", "m_nvme_read_bytes", "m_nvme_written_bytes"],
            ),
            (
                ListKind::Variance,
                ["v_bytes", "v_nvme_read_bytes", "v_nvme_written_bytes"],
            ),
        ];
        for (list, [held, read, written]) in lists {
            counters.insert(held, layout.list_stored_bytes(list));
            if let Some(t) = self.nvme_traffic() {
                counters.insert(read, t.read_bytes(list));
                counters.insert(written, t.written_bytes(list));
            }
        }
        counters
    }

    /// Bytes moved between host and NVMe per list since open (`None` for a trainer over
    /// a store its caller opened, [`Trainer::with_store`]: counting takes the store's
    /// move hook, which costs a usage snapshot per move).
    pub fn nvme_traffic(&self) -> Option<&NvmeTraffic> {
        self.traffic.as_deref()
    }

    /// The store's swap file (in the configured `swap_dir`).
    pub fn swap_path(&self) -> &std::path::Path {
        &self.swap_path
    }

    /// Gradients reported final since the last step.
    pub fn reported(&self) -> usize {
        self.reported
    }

    /// Refuses `what` while gradients of an unfinished iteration are in the store.
    fn between_steps(&self, what: &str) -> Result<()> {
        if self.reported > 0 {
            return Err(TrainError::Protocol(format!(
                "{what} after {} gradients were reported and before step(); step first",
                self.reported
            )));
        }
        Ok(())
    }
}
