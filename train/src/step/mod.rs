//! The step loop: AdamW over tensors whose 16-bit parameters (and gradients), fp32
//! master copy, M and V live in a [`ChunkStore`], each tensor stepped where the store
//! puts it. It is the one loop of tidestore: the bench, the candle glue and library
//! users drive it the same way.
//!
//! # One iteration
//! 1. During backward, as each tensor's gradient is final in the store, the caller says
//!    so with [`StepLoop::grad_ready`], with the gradient's squared L2 norm (the caller
//!    has the values when it writes them).
//! 2. With [`Overlap::Backward`], tensors are grouped by the chunk that holds their
//!    gradients; a group whose every gradient is final is queued, and
//!    [`StepLoop::step_ready`] steps queued tensors while the caller's device computes
//!    the next block (up to a deadline, so the step never holds the device's next
//!    launch back for long). A chunk still in use by backward is never in a complete
//!    group, so the step never fights backward for a chunk. A front end that holds a
//!    whole, final gradient in its own memory hands it over instead
//!    ([`StepLoop::step_given_now`], through [`crate::Trainer::step_with_grad`]): the
//!    tensor is stepped at once, reading the gradient where it is, and its `Grads`
//!    place is never written — no copy, no pool room, no NVMe spill for it.
//! 3. [`StepLoop::finish`] decides the step (global norm, clipping, overflow) with the
//!    optimizer's [`StepController`], switches the store to its optimizer-step budget
//!    and steps every tensor not stepped yet — or, with [`Overlap::Forward`], leaves
//!    them due: each one is stepped in the next forward, right before its first use
//!    ([`StepLoop::step_deferred`]; [`crate::Trainer`] does it in every access of a
//!    parameter), so the step's chunk I/O runs under forward's compute.
//!
//! # Where a tensor is stepped
//! [`StepPlace::Host`]: its chunks are accessed in the pinned host pool and the CPU
//! kernel updates them in place, piece by piece, polling the store's NVMe transfers
//! between pieces so that the reads of the next tensors and the write-backs of the last
//! ones keep moving. When the pool cannot hold a tensor's chunks at once (plus one
//! buffer for loads), the tensor is stepped one chunk at a time through scratch copies.
//! [`StepPlace::Device`]: its chunks are accessed on the device and stepped there (the
//! GPU kernel on CUDA; the CPU kernel over the simulated device's memory). A loop
//! stepping in the host pool may be split ([`StepLoop::place_on_device`]): the tensors
//! whose state the device holds are stepped there, the others in the host pool.
//!
//! # Overlap, clipping and overflow
//! Stepping a tensor during backward uses the step's decision before the last gradient
//! exists. Global-norm clipping needs the norm of every gradient and a skipped step
//! (overflow) must leave every tensor alone, so [`Overlap::Backward`] is refused with a
//! clipping norm or a loss scaler: clipping with the norm known so far would be wrong,
//! and rolling stepped tensors back would need a second copy of their state. Without
//! them the decision is known up front (step `n + 1`, gradients as they are), and
//! overlapped steps are bit-identical to [`Overlap::Off`]. A non-finite gradient that
//! arrives after tensors were stepped cannot be skipped any more: [`StepLoop::finish`]
//! poisons the loop, naming it (bf16 training has no overflow to skip; such a gradient
//! means the run diverged). Likewise a step asked for before every gradient came
//! ([`StepLoop::abandon`]): with nothing stepped yet the iteration is dropped and the
//! next one starts anew; after overlapped steps the loop is poisoned.
//!
//! [`Overlap::Forward`] decides the step when every gradient is in, as [`Overlap::Off`]
//! does, so it clips and skips alike; only when each tensor's update is made moves.
//! Every tensor is stepped with the decision and hyper-parameters of its own step (a
//! learning rate set in between applies to the next one), from the gradient left in its
//! place: a due tensor's gradient must not be written again before it is stepped
//! ([`StepLoop::grad_ready`] refuses it), and whatever reads the optimizer state (a
//! checkpoint, an export, the master copy) first completes the step
//! ([`StepLoop::complete_deferred`]). The result is bit-identical to [`Overlap::Off`].
//!
//! Every access is released on every path, errors included (the store's scoped API);
//! the store is handed to an observer (progress bars, plots) after each tensor's step.
//! A tensor's step that fails (an I/O error, a corrupt chunk) leaves the optimizer step
//! half made: the loop is then *poisoned* and refuses every call with
//! [`TrainError::Poisoned`] until a checkpoint is loaded into the store and
//! [`StepLoop::restore`] is called.

use std::collections::{HashMap, VecDeque};

use tidestore_chunk::{ChunkId, ChunkStore, ListKind, TensorId, TensorState};
use tidestore_optimizer::{
    ControllerState, Grads, HybridAdamW, HyperParams, LossScalerConfig, StepController,
    StepDecision, StepState,
};

use crate::error::{Result, TrainError};
use crate::peers::{NormPeers, Peers};

mod entry;
mod overlap;
mod place;
mod views;

use entry::{entry_of, Entry, STEP_PIECE};
pub use entry::{sharing_runs, tensor_chunks, GradPlace, StepPlace, StepTensor};

pub(crate) use views::grads_of;

use views::{f32s, param_out};

/// When tensors are stepped (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    /// After backward, in [`StepLoop::finish`].
    Off,
    /// During backward, as soon as a group's gradients are final.
    Backward,
    /// Decided after backward, each chunk group's tensors stepped in the next forward
    /// right before the first use of one of them.
    Forward,
}

/// How the loop steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepConfig {
    /// AdamW hyper-parameters.
    pub hp: HyperParams,
    /// Clip the global gradient norm to this, when given.
    pub max_grad_norm: Option<f32>,
    /// Dynamic loss scaling (fp16 gradients), when given.
    pub loss_scaler: Option<LossScalerConfig>,
    /// Where tensors are stepped.
    pub place: StepPlace,
    /// When tensors are stepped.
    pub overlap: Overlap,
    /// Whether a step whose gradients are not all finite is skipped (the default);
    /// `false`, allowed only without clipping and loss scaling, applies every step as
    /// `torch.optim.AdamW` does, and then no gradient's norm is needed: front ends that
    /// hand gradients over ([`crate::Trainer::step_given`]) take none, and
    /// [`StepStats::grad_norm`] is NaN.
    pub check_finite: bool,
}

impl StepConfig {
    /// Refuses what no store could make work: invalid hyper-parameters,
    /// [`Overlap::Backward`] with clipping or loss scaling (see the module doc), and
    /// [`StepConfig::check_finite`] off with either of them. Checked
    /// by [`StepLoop::new`], and by a [`crate::Trainer`] before it opens its store.
    pub fn validate(&self) -> Result<()> {
        self.hp.validate()?;
        if self.overlap == Overlap::Backward {
            let what = match (self.max_grad_norm, self.loss_scaler) {
                (Some(_), _) => Some("global-norm clipping (max_grad_norm)"),
                (None, Some(_)) => Some("dynamic loss scaling"),
                (None, None) => None,
            };
            if let Some(what) = what {
                return Err(TrainError::Config {
                    key: "optimizer.overlap",
                    reason: format!(
                        "\"backward\" steps tensors before the last gradient exists, and \
                         {what} needs every gradient first; turn it off, or set overlap = \
                         \"forward\" (decided after backward, stepped in the next forward) \
                         or \"off\""
                    ),
                });
            }
        }
        if !self.check_finite && (self.max_grad_norm.is_some() || self.loss_scaler.is_some()) {
            return Err(TrainError::Config {
                key: "optimizer.check_finite",
                reason: "off needs no clipping (max_grad_norm) and no loss scaling: both \
                         read the gradients' norm, and a non-finite norm must skip the step"
                    .into(),
            });
        }
        StepController::new(self.max_grad_norm, self.loss_scaler)?;
        Ok(())
    }
}

/// Counters of the loop since it was made (or [`StepLoop::reset_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Steps applied.
    pub steps_applied: u64,
    /// Steps skipped (overflow).
    pub steps_skipped: u64,
    /// Tensor steps made.
    pub tensors_stepped: u64,
    /// Of those, made during backward ([`Overlap::Backward`]).
    pub tensors_overlapped: u64,
    /// Of those, made in the next forward ([`Overlap::Forward`]).
    pub tensors_deferred: u64,
    /// Parameters stepped.
    pub params_stepped: u64,
    /// Time in the optimizer kernel (not waiting for chunks), in nanoseconds.
    pub kernel_ns: u64,
    /// Whether a device step ran over the simulated device's memory.
    pub simulated: bool,
    /// The global gradient norm of the last applied step (NaN where the loop takes no
    /// norms: [`StepConfig::check_finite`] off).
    pub grad_norm: f64,
}

/// The step a tensor gets: the decision (step number, gradient scale) and the
/// hyper-parameters of that step.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Applied {
    state: StepState,
    hp: HyperParams,
}

/// What [`StepLoop::finish`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// The controller's decision.
    pub decision: StepDecision,
    /// Tensors stepped during backward.
    pub overlapped: usize,
}

/// Reused buffers of the host steps (sized once, at construction).
#[derive(Debug, Default)]
struct Scratch {
    /// A piece's 16-bit gradient (in place) or a whole tensor's gradient bytes (copying).
    grad: Vec<u32>,
    m: Vec<f32>,
    v: Vec<f32>,
    out16: Vec<u16>,
}

impl Scratch {
    /// What a loop stepping at `place` needs, for tensors of at most `longest` elements:
    /// nothing on the device; a piece's widened gradient in place in the host pool;
    /// whole tensors' copies when it steps through scratch.
    fn for_step(place: StepPlace, in_place: bool, longest: usize) -> Scratch {
        match (place, in_place) {
            (StepPlace::Device, _) => Scratch::default(),
            (StepPlace::Host, true) => Scratch {
                grad: vec![0; STEP_PIECE.min(longest).div_ceil(2)],
                ..Scratch::default()
            },
            (StepPlace::Host, false) => Scratch {
                grad: vec![0; longest],
                m: vec![0.0; longest],
                v: vec![0.0; longest],
                out16: vec![0; longest],
            },
        }
    }
}

/// Called after every access and release the loop makes, with the store as it is then.
pub type Observer<'a> = &'a mut dyn FnMut(&ChunkStore);

/// The step loop over a store (see the module doc).
#[derive(Debug)]
pub struct StepLoop {
    opt: HybridAdamW,
    hp: HyperParams,
    ctrl: StepController,
    place: StepPlace,
    overlap: Overlap,
    check_finite: bool,
    entries: Vec<Entry>,
    by_tensor: HashMap<TensorId, usize>,
    /// Per group (gradient chunk): members, and how many gradients are not final.
    groups: HashMap<ChunkId, (Vec<usize>, usize)>,
    ready: VecDeque<usize>,
    /// The decision overlapped steps use (made at the first of them).
    early: Option<StepState>,
    /// The step due tensors get ([`Overlap::Forward`]), and how many are due.
    deferred: Option<(Applied, usize)>,
    grad_sq: f64,
    finals: usize,
    /// Whether the host pool holds a tensor's chunks at once.
    in_place: bool,
    scratch: Scratch,
    stats: StepStats,
    /// Why the loop refuses to go on (see the module doc).
    poisoned: Option<String>,
    /// The first tensor of this iteration whose gradient norm was not finite.
    non_finite: Option<String>,
    /// The same, of the last step that was skipped.
    last_skip_tensor: Option<String>,
    /// The other data-parallel ranks, whose norms join this rank's before the decision.
    peers: Option<Peers>,
}

impl StepLoop {
    /// A loop stepping `tensors` of `store` with `opt`. Refused here, before anything is
    /// touched: a tensor without master, M or V places, a gradient of an unsupported
    /// dtype, a tensor listed twice, invalid hyper-parameters, and [`Overlap::Backward`]
    /// with clipping or loss scaling (see the module doc).
    pub fn new(
        store: &ChunkStore,
        opt: HybridAdamW,
        tensors: Vec<StepTensor>,
        cfg: StepConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        let ctrl = StepController::new(cfg.max_grad_norm, cfg.loss_scaler)?;
        let layout = store.layout();
        let mut entries = Vec::with_capacity(tensors.len());
        let mut by_tensor = HashMap::with_capacity(tensors.len());
        let mut groups: HashMap<ChunkId, (Vec<usize>, usize)> = HashMap::new();
        for spec in tensors {
            let mut entry = entry_of(layout, spec)?;
            entry.place = cfg.place;
            if by_tensor.insert(spec.tensor, entries.len()).is_some() {
                return Err(TrainError::Tensor {
                    tensor: entry.name,
                    reason: "listed twice in the step loop".into(),
                });
            }
            let g = groups.entry(entry.group).or_default();
            g.0.push(entries.len());
            g.1 += 1;
            entries.push(entry);
        }
        let places_max = entries.iter().map(|e| e.places().len()).max().unwrap_or(0);
        let in_place = store.capacity_plan().host_buffers > places_max as u64;
        let longest = entries.iter().map(|e| e.len).max().unwrap_or(0);
        let scratch = Scratch::for_step(cfg.place, in_place, longest);
        if !in_place && cfg.place == StepPlace::Host {
            tracing::info!(
                host_buffers = store.capacity_plan().host_buffers,
                chunks_per_tensor = places_max,
                "step loop: the host pool cannot hold a tensor's chunks at once; stepping \
                 one chunk at a time through scratch copies"
            );
        }
        Ok(StepLoop {
            opt,
            hp: cfg.hp,
            ctrl,
            place: cfg.place,
            overlap: cfg.overlap,
            check_finite: cfg.check_finite,
            entries,
            by_tensor,
            groups,
            ready: VecDeque::new(),
            early: None,
            deferred: None,
            non_finite: None,
            last_skip_tensor: None,
            peers: None,
            grad_sq: 0.0,
            finals: 0,
            in_place,
            scratch,
            stats: StepStats::default(),
            poisoned: None,
        })
    }

    /// The optimizer (its CPU kernel's SIMD level and threads, its GPU status).
    pub fn optimizer(&self) -> &HybridAdamW {
        &self.opt
    }

    /// The hyper-parameters.
    pub fn hyper_params(&self) -> &HyperParams {
        &self.hp
    }

    /// Sets the learning rate of the steps to come (a schedule's); an invalid one is
    /// refused and nothing changes.
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        self.set_hyper_params(HyperParams { lr, ..self.hp })
    }

    /// Sets every hyper-parameter of the steps to come (a front end whose user changed
    /// betas, eps or weight decay between steps, as torch's schedulers may); an invalid
    /// set is refused and nothing changes. The bias corrections of later steps use the
    /// new betas with the step count so far, as torch's AdamW does.
    pub fn set_hyper_params(&mut self, hp: HyperParams) -> Result<()> {
        hp.validate()?;
        self.hp = hp;
        Ok(())
    }

    /// Where tensors are stepped: `Device` when any one is (every one, or some of them
    /// in a split, [`StepLoop::place_on_device`]).
    pub fn place(&self) -> StepPlace {
        if self.entries.iter().any(|e| e.place == StepPlace::Device) {
            StepPlace::Device
        } else {
            self.place
        }
    }

    /// Where `tensor` is stepped (the loop's place for a tensor it does not step).
    pub fn place_of(&self, tensor: TensorId) -> StepPlace {
        self.by_tensor
            .get(&tensor)
            .map_or(self.place, |&i| self.entries[i].place)
    }

    /// How many tensors the loop steps.
    pub fn tensor_count(&self) -> usize {
        self.entries.len()
    }

    /// How many tensors are stepped on the device.
    pub fn on_device_count(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| e.place == StepPlace::Device)
            .count()
    }

    /// Splits a loop stepping in the host pool: `tensors` are stepped on the device from
    /// now on (the GPU kernel; the CPU kernel over the simulated device), the others
    /// where they were. Where each tensor's gradient is read follows
    /// ([`StepLoop::place_of`]). None moves nothing. Refused once an iteration has begun
    /// (a gradient reported, or steps due), for a loop stepping on the device already,
    /// for a tensor the loop does not step, and where a chunk would hold tensors stepped
    /// in both places (it would cross between them within every step): naming both;
    /// nothing changes then.
    pub fn place_on_device(&mut self, store: &ChunkStore, tensors: &[TensorId]) -> Result<()> {
        if tensors.is_empty() {
            return Ok(());
        }
        if self.place != StepPlace::Host {
            return Err(TrainError::Protocol(
                "the loop steps every tensor on the device already".into(),
            ));
        }
        if self.finals > 0 || self.deferred.is_some() || self.early.is_some() {
            return Err(TrainError::Protocol(
                "tensors moved to the device in the middle of an iteration".into(),
            ));
        }
        let found: Vec<usize> = tensors
            .iter()
            .map(|t| {
                self.by_tensor
                    .get(t)
                    .copied()
                    .ok_or_else(|| TrainError::Tensor {
                        tensor: t.to_string(),
                        reason: "not stepped by this loop".into(),
                    })
            })
            .collect::<Result<_>>()?;
        let mut on_device: Vec<bool> = self
            .entries
            .iter()
            .map(|e| e.place == StepPlace::Device)
            .collect();
        found.iter().for_each(|&i| on_device[i] = true);
        let mut stepped: Vec<TensorId> = self.entries.iter().map(|e| e.spec.tensor).collect();
        stepped.sort_unstable();
        for run in sharing_runs(store.layout(), &stepped) {
            let at = |t: &TensorId| on_device[self.by_tensor[t]];
            if let (Some(d), Some(h)) = (run.iter().find(|t| at(t)), run.iter().find(|t| !at(t))) {
                let name = |t: &TensorId| self.entries[self.by_tensor[t]].name.clone();
                return Err(TrainError::Tensor {
                    tensor: name(d),
                    reason: format!(
                        "shares a chunk with `{}`, which would be stepped in the host pool: \
                         a chunk is stepped in one place, so its tensors go together",
                        name(h)
                    ),
                });
            }
        }
        for i in found {
            self.entries[i].place = StepPlace::Device;
        }
        Ok(())
    }

    /// When tensors are stepped.
    pub fn overlap(&self) -> Overlap {
        self.overlap
    }

    /// Whether the step needs the gradients' norms (see [`StepConfig::check_finite`]);
    /// where it does not, a front end may report each gradient with a norm of 0.
    pub fn needs_norms(&self) -> bool {
        self.check_finite
    }

    /// Whether host steps work in place (else through scratch copies).
    pub fn in_place(&self) -> bool {
        self.in_place
    }

    /// Steps applied so far (the controller's count).
    pub fn step_count(&self) -> u64 {
        self.ctrl.step()
    }

    /// The loss scale to multiply the loss by (1.0 without a scaler).
    pub fn loss_scale(&self) -> f32 {
        self.ctrl.loss_scale()
    }

    /// The controller's state, for checkpoints.
    pub fn controller_state(&self) -> ControllerState {
        self.ctrl.state()
    }

    /// Restores a checkpointed controller state, after the checkpoint's tensors were
    /// loaded into the store: between iterations, or to lift a poisoned loop (the
    /// iteration in progress is abandoned). Steps still due ([`Overlap::Forward`]) are
    /// dropped: the checkpoint replaced the state they would have updated.
    pub fn restore(&mut self, state: ControllerState) -> Result<()> {
        if self.finals != 0 && self.poisoned.is_none() {
            return Err(TrainError::Protocol(
                "restore() during an iteration (gradients already reported)".into(),
            ));
        }
        self.ctrl.restore(state)?;
        self.poisoned = None;
        if let Some((_, due)) = self.deferred.take() {
            tracing::debug!(due, "step loop: restored; the due tensor steps are dropped");
            self.entries.iter_mut().for_each(|e| e.due = false);
        }
        self.new_iteration();
        Ok(())
    }

    /// Makes this loop one rank of a data-parallel run that steps shards: from the next
    /// decision on, its squared gradient norm is summed with the other ranks' by
    /// `peers` before the step is decided (clipped, skipped), so every rank decides
    /// alike (see [`crate::peers`]). A failed all-reduce poisons the loop: the ranks
    /// may no longer agree on what was stepped.
    pub fn set_peers(&mut self, peers: Box<dyn NormPeers>) {
        self.peers = Some(Peers(peers));
    }

    /// Whether a failed step stopped the loop (see the module doc).
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.is_some()
    }

    /// Ends an iteration that cannot be finished (`what`: a gradient that never came, a
    /// backward that raised). With nothing stepped yet its gradients and reports are
    /// dropped as a skipped step's are (a 16-bit copy a gradient was written over cast
    /// anew from the master) and the next iteration starts anew
    /// ([`TrainError::Protocol`]); after tensors were stepped during backward the step
    /// is half made and the loop is poisoned ([`TrainError::Poisoned`]).
    pub fn abandon(
        &mut self,
        store: &mut ChunkStore,
        observe: Observer<'_>,
        what: &str,
    ) -> TrainError {
        let overlapped = self.entries.iter().filter(|e| e.stepped).count();
        if overlapped > 0 {
            return self.half_made(format!(
                "{what} after {overlapped} tensors were stepped during backward"
            ));
        }
        // As a skipped step: the gradients written so far are dropped, and a 16-bit copy
        // a gradient was written over is cast anew from the unchanged master.
        if let Err(e) = self.consume_grads(store, observe, &[]) {
            return self.half_made(format!("{what}; dropping its gradients failed: {e}"));
        }
        self.new_iteration();
        tracing::warn!(
            what,
            "step loop: iteration abandoned, its gradients dropped"
        );
        TrainError::Protocol(format!(
            "{what}: the iteration is abandoned (its gradients dropped, nothing stepped); \
             the next backward starts a new one"
        ))
    }

    /// Poisons the loop after a step that some tensors took and others did not.
    fn half_made(&mut self, reason: String) -> TrainError {
        tracing::error!(%reason, "step loop: a step half made; poisoned until restore()");
        self.poisoned = Some(reason.clone());
        TrainError::Poisoned { reason }
    }

    fn check_poisoned(&self) -> Result<()> {
        match &self.poisoned {
            Some(reason) => Err(TrainError::Poisoned {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// The counters.
    pub fn stats(&self) -> StepStats {
        self.stats
    }

    /// Zeroes the counters.
    pub fn reset_stats(&mut self) {
        self.stats = StepStats::default();
    }

    /// `tensor`'s gradient is final in the store, with squared L2 norm `sq_norm` (of
    /// the raw, loss-scaled values). With [`Overlap::Backward`], its group is queued
    /// when this was its last gradient.
    pub fn grad_ready(&mut self, tensor: TensorId, sq_norm: f64) -> Result<()> {
        self.check_poisoned()?;
        let &i = self.by_tensor.get(&tensor).ok_or_else(|| {
            TrainError::Protocol(format!("grad_ready for {tensor}, which is not stepped"))
        })?;
        let e = &mut self.entries[i];
        if e.grad_final {
            return Err(TrainError::Protocol(format!(
                "the gradient of `{}` reported final twice in one iteration",
                e.name
            )));
        }
        if e.due {
            return Err(TrainError::Protocol(format!(
                "a new gradient of `{}` before its last step was made (overlap = \"forward\" \
                 steps it before its next use: step_deferred first)",
                e.name
            )));
        }
        e.grad_final = true;
        if !sq_norm.is_finite() && self.non_finite.is_none() {
            self.non_finite = Some(e.name.clone());
        }
        self.finals += 1;
        self.grad_sq += sq_norm;
        let group = self
            .groups
            .get_mut(&e.group)
            .expect("every entry's group was registered with it");
        group.1 -= 1;
        if group.1 == 0 && self.overlap == Overlap::Backward {
            self.ready.extend(group.0.iter().copied());
        }
        Ok(())
    }

    /// Ends the iteration's step: decides it from every gradient's norm, and steps every
    /// tensor not stepped yet between the store's
    /// [`ChunkStore::begin_optimizer_step`] and [`ChunkStore::end_optimizer_step`]. A
    /// skipped step consumes the gradients (each gradient place accessed and released)
    /// and changes nothing else. Every tensor's gradient must have been reported.
    pub fn finish(&mut self, store: &mut ChunkStore, observe: Observer<'_>) -> Result<StepOutcome> {
        self.finish_given(store, observe, &[])
    }

    /// Whether [`StepLoop::finish_given`] reads given gradients where they are: the
    /// step runs in place in the host pool, and no tensor has a 16-bit copy to write.
    pub fn reads_given(&self) -> bool {
        self.place() == StepPlace::Host
            && self.in_place
            && self.entries.iter().all(|e| e.out_dtype.is_none())
    }

    /// As [`StepLoop::finish`], with the gradients of `given`'s tensors read from the
    /// caller's memory instead of their `Grads` places (which stay untouched): a front
    /// end whose framework holds the gradients hands them over without a copy (it
    /// reports each one's norm first, [`StepLoop::grad_ready`]). Refused before the
    /// decision unless [`StepLoop::reads_given`], and for a tensor that is not stepped,
    /// already stepped, given twice or of another length.
    pub fn finish_given(
        &mut self,
        store: &mut ChunkStore,
        observe: Observer<'_>,
        given: &[(TensorId, Grads<'_>)],
    ) -> Result<StepOutcome> {
        self.check_poisoned()?;
        let given = self.given_by_entry(given)?;
        if let Some(e) = self.entries.iter().find(|e| !e.grad_final) {
            let what = format!("finish() before the gradient of `{}` was reported", e.name);
            return Err(self.abandon(store, observe, &what));
        }
        let overlapped = self.entries.iter().filter(|e| e.stepped).count();
        // Without the finiteness check no norm counts: the step is applied as it is.
        let grad_sq = if self.check_finite {
            self.sum_with_peers()?
        } else {
            0.0
        };
        let mut decision = self.ctrl.decide(grad_sq);
        if let (false, StepDecision::Apply { grad_norm, .. }) = (self.check_finite, &mut decision) {
            *grad_norm = f64::NAN; // not taken
        }
        let result = match decision {
            StepDecision::Apply {
                state, grad_norm, ..
            } => {
                if let Some(early) = self.early.filter(|&early| early != state) {
                    return Err(TrainError::Protocol(format!(
                        "overlapped steps used {early:?} but the step is {state:?}"
                    )));
                }
                self.stats.steps_applied += 1;
                self.stats.grad_norm = grad_norm;
                let at = Applied { state, hp: self.hp };
                let defer = self.overlap == Overlap::Forward;
                let r = self.step_rest(store, at, observe, &given, defer);
                if let (Err(e), None) = (&r, &self.poisoned) {
                    // The controller counted the step: whatever failed, it is half made.
                    self.poisoned = Some(format!("step {}: {e}", state.step));
                }
                r
            }
            StepDecision::Skip { .. } if overlapped > 0 => Err(self.half_made(format!(
                "a non-finite gradient arrived after {overlapped} tensors were stepped \
                 during backward; optimizer.overlap = \"backward\" cannot skip a step"
            ))),
            StepDecision::Skip { .. } => {
                self.stats.steps_skipped += 1;
                self.last_skip_tensor = self.non_finite.clone();
                self.consume_grads(store, observe, &given)
            }
        };
        self.new_iteration();
        result.map(|()| StepOutcome {
            decision,
            overlapped,
        })
    }

    /// This iteration's squared gradient norm, summed with the other ranks' when the
    /// loop has peers; a failed all-reduce poisons the loop.
    fn sum_with_peers(&mut self) -> Result<f64> {
        let Some(peers) = &mut self.peers else {
            return Ok(self.grad_sq);
        };
        match peers.0.sum_sq_norm(self.grad_sq) {
            Ok(sum) => Ok(sum),
            Err(e) => {
                self.poisoned = Some(format!("the ranks' gradient norms: {e}"));
                Err(e)
            }
        }
    }

    fn new_iteration(&mut self) {
        for e in &mut self.entries {
            e.grad_final = false;
            e.stepped = false;
        }
        for g in self.groups.values_mut() {
            g.1 = g.0.len();
        }
        self.ready.clear();
        self.early = None;
        self.grad_sq = 0.0;
        self.finals = 0;
        self.non_finite = None;
    }

    /// The first tensor (in the order gradients became final) whose gradient was not
    /// finite in the last skipped step; `None` before any skip, or when every norm was
    /// finite and only their sum overflowed.
    pub fn last_skip_tensor(&self) -> Option<&str> {
        self.last_skip_tensor.as_deref()
    }

    /// `given` (tensor, gradient) pairs as a gradient per entry, checked (see
    /// [`StepLoop::finish_given`]).
    fn given_by_entry<'g>(
        &self,
        given: &[(TensorId, Grads<'g>)],
    ) -> Result<Vec<Option<Grads<'g>>>> {
        let mut by_entry = vec![
            None;
            if given.is_empty() {
                0
            } else {
                self.entries.len()
            }
        ];
        if !given.is_empty() && !self.reads_given() {
            return Err(TrainError::Protocol(
                "gradients given to the step need the step in place in the host pool, with \
                 no 16-bit copy to write"
                    .into(),
            ));
        }
        for &(t, g) in given {
            let i = *self.by_tensor.get(&t).ok_or_else(|| {
                TrainError::Protocol(format!("a gradient given for {t}, which is not stepped"))
            })?;
            let e = &self.entries[i];
            let why = if e.stepped {
                Some("it was stepped during backward".to_string())
            } else if by_entry[i].is_some() {
                Some("it was given twice".to_string())
            } else if g.len() != e.len {
                Some(format!("{} elements for a tensor of {}", g.len(), e.len))
            } else {
                None
            };
            if let Some(why) = why {
                return Err(TrainError::Argument {
                    tensor: e.name.clone(),
                    reason: format!("the gradient given to the step: {why}"),
                });
            }
            by_entry[i] = Some(g);
        }
        Ok(by_entry)
    }

    /// Steps every tensor not stepped yet, between the store's optimizer-step calls;
    /// deferring ([`Overlap::Forward`]), only those whose gradients were given (the
    /// caller's memory is not kept), the others left due.
    fn step_rest(
        &mut self,
        store: &mut ChunkStore,
        at: Applied,
        observe: Observer<'_>,
        given: &[Option<Grads<'_>>],
        defer: bool,
    ) -> Result<()> {
        let now: Vec<usize> = (0..self.entries.len())
            .filter(|&i| !self.entries[i].stepped)
            .filter(|&i| !defer || given.get(i).is_some_and(Option::is_some))
            .collect();
        if !defer || !now.is_empty() {
            store.begin_optimizer_step()?;
            for i in now {
                let g = given.get(i).copied().flatten();
                self.step_entry(store, i, at, observe, g)?;
            }
            store.end_optimizer_step()?;
        }
        if defer {
            let mut due = 0;
            for e in self.entries.iter_mut().filter(|e| !e.stepped) {
                e.due = true;
                due += 1;
            }
            self.deferred = (due > 0).then_some((at, due));
        }
        Ok(())
    }

    /// A skipped step: every gradient is consumed, and where the gradient lies
    /// over the 16-bit copy (or the step would refresh that copy), the copy is cast anew
    /// from the unchanged master, so that the next forward reads parameters, not
    /// gradients. Done in the host pool.
    fn consume_grads(
        &mut self,
        store: &mut ChunkStore,
        observe: Observer<'_>,
        given: &[Option<Grads<'_>>],
    ) -> Result<()> {
        for (i, e) in self.entries.iter().enumerate() {
            if given.get(i).is_some_and(Option::is_some) {
                // Given to the step (no 16-bit copy, see `reads_given`): its place
                // was never written.
                continue;
            }
            let Some(dtype) = e.out_dtype else {
                // A gradient of its own, no 16-bit copy to refresh: dropped unread.
                e.grad_consumed(store)?;
                observe(store);
                continue;
            };
            // A gradient of its own is dropped unread; one over the 16-bit copy is
            // overwritten here.
            let places = [
                (e.spec.tensor, ListKind::Master),
                (e.spec.tensor, ListKind::Params),
            ];
            let cpu = self.opt.cpu();
            store.with_host_views(&places, TensorState::Hold, |views| -> Result<()> {
                let [master, p16] = views else {
                    unreachable!("two places were asked for")
                };
                let master = f32s(master, &e.name, "master")?;
                cpu.cast_params(master, param_out(p16, dtype, &e.name)?)?;
                Ok(())
            })??;
            e.grad_consumed(store)?;
            observe(store);
        }
        Ok(())
    }

    /// Steps entry `i` in this iteration's step (see [`StepLoop::step_tensor`]).
    fn step_entry(
        &mut self,
        store: &mut ChunkStore,
        i: usize,
        at: Applied,
        observe: Observer<'_>,
        given: Option<Grads<'_>>,
    ) -> Result<()> {
        if self.entries[i].stepped {
            return Err(TrainError::Protocol(format!(
                "`{}` stepped twice in one step",
                self.entries[i].name
            )));
        }
        self.step_tensor(store, i, at, observe, given)?;
        self.entries[i].stepped = true;
        Ok(())
    }

    /// Steps entry `i` with `at`: its places accessed, stepped, released on every path;
    /// its gradient read from `given` where given (its `Grads` place then left alone).
    /// A failure poisons the loop.
    fn step_tensor(
        &mut self,
        store: &mut ChunkStore,
        i: usize,
        at: Applied,
        observe: Observer<'_>,
        given: Option<Grads<'_>>,
    ) -> Result<()> {
        let stepped = match (self.entries[i].place, self.in_place) {
            (StepPlace::Host, true) => self.step_host_in_place(store, i, at, observe, given),
            (StepPlace::Host, false) => self.step_host_copying(store, i, at, observe),
            (StepPlace::Device, _) => self.step_device(store, i, at, observe),
        }
        .and_then(|()| match given {
            Some(_) => Ok(()),
            None => self.entries[i].grad_consumed(store),
        });
        if let Err(e) = stepped {
            self.half_made(format!("stepping `{}`: {e}", self.entries[i].name));
            return Err(e);
        }
        self.stats.tensors_stepped += 1;
        self.stats.params_stepped += self.entries[i].len as u64;
        Ok(())
    }
}
