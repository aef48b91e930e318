//! The streaming step: AdamW over groups whose M and V (and, when configured, fp32
//! master parameters) live in a swap file on NVMe, through a bounded ring of aligned
//! buffers.
//!
//! Group `i` of the optimizer is chunk `i` of the chunk lists (`MasterF32`,
//! `MomentumF32`, `VarianceF32`): its arrays are swap-file chunks
//! [`chunk_id`]`(i, ARRAY_M | ARRAY_V | ARRAY_MASTER)`. A step walks the groups in a
//! declared [`Order`]; while group `i` is updated by the CPU kernel, the reads of the
//! next groups (as many as the ring holds, or `read_ahead_max`) and the writes of the
//! groups before are in flight in the io engine. Compute runs in slices of
//! `poll_params` parameters, and between two slices the engine is polled, so queued
//! pieces keep reaching the device and completed reads free the way for more.
//!
//! Invariants:
//! - host memory of the pipeline is one [`BufferPool`] sized from the host budget at
//!   construction: `ring_groups * arrays` buffers of one group each; nothing is allocated
//!   per step or per group (the slot table and the group→slot map are made once);
//! - at most one request per chunk is in flight (a group is read once per step, and its
//!   slot is reused only after its writes complete; [`StreamingStep::finish`] waits for
//!   every write);
//! - every byte read back is checked against the crc32c it was written with (the swap
//!   file does it); a read or write that fails *poisons* the optimizer: the step is
//!   abandoned (in-flight requests drained, buffers returned) and every later step or
//!   save returns [`OptimError::Poisoned`] until a checkpoint is loaded
//!   ([`StreamingOptimizer::load_checkpoint`]), because some groups already hold the new
//!   step and others the old one. A step dropped before [`StreamingStep::finish`] after
//!   it updated a group poisons it too.
//!
//! Step during backward: [`StreamingOptimizer::begin`] starts the reads at once;
//! [`StreamingStep::update_group`] updates a group as soon as its gradients are final
//! (in the step's order: backward produces the last groups first, so
//! [`Order::Descending`]); [`StreamingStep::progress`] keeps I/O moving between two
//! layers of backward. The caller supplies the step's [`StepState`]: when the update
//! starts before the last gradient exists, global-norm clipping cannot use this step's
//! norm and an fp16 overflow cannot be known in advance — use the full step
//! ([`StreamingOptimizer::step`]) for those. Placement of every group (here: `Cpu`) is
//! in [`crate::placement`].

use std::time::Instant;

use tidestore_io::{align_up, AlignedBuf, BufferPool, Op, SwapCompletion, SwapFile};

use crate::controller::{StepController, StepDecision};
use crate::cpu::AdamW;
use crate::error::{check_len, OptimError, Result};
use crate::params::{HyperParams, StepState};
use crate::slices::{Grads, ParamOut};

/// Array index of the first moments in [`chunk_id`].
pub const ARRAY_M: u64 = 0;
/// Array index of the second moments.
pub const ARRAY_V: u64 = 1;
/// Array index of the fp32 master parameters (on NVMe only with [`MasterPlace::Nvme`]).
pub const ARRAY_MASTER: u64 = 2;
const ARRAYS_MAX: usize = 3;
const NO_SLOT: u32 = u32::MAX;

/// Swap-file chunk id of `array` of `group`.
pub fn chunk_id(group: usize, array: u64) -> u64 {
    group as u64 * ARRAYS_MAX as u64 + array
}

fn array_name(op: Op, array: usize) -> &'static str {
    match (op, array as u64) {
        (Op::Read, ARRAY_M) => "read of M",
        (Op::Read, ARRAY_V) => "read of V",
        (Op::Read, _) => "read of master params",
        (Op::Write, ARRAY_M) => "write of M",
        (Op::Write, ARRAY_V) => "write of V",
        (Op::Write, _) => "write of master params",
    }
}

/// One optimizer group: its parameter count and hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupSpec {
    /// Parameters in the group (> 0).
    pub len: usize,
    /// Its hyper-parameters.
    pub hp: HyperParams,
}

/// Where the fp32 master parameters of streamed groups live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MasterPlace {
    /// In host memory owned by the optimizer (4 bytes per parameter, outside the ring
    /// budget); only M and V stream (16 bytes of I/O per parameter and step).
    Host,
    /// In the swap file with M and V (24 bytes of I/O per parameter and step; host
    /// memory is the ring alone).
    Nvme,
}

/// How the streaming step runs.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamConfig {
    /// Bytes of host memory the ring may use; it holds `ring_groups` groups of 2 (M, V)
    /// or 3 (and master) buffers of the largest group, at least 2 groups.
    pub host_budget_bytes: u64,
    /// Where master parameters live.
    pub master: MasterPlace,
    /// Most groups read ahead of the one being updated (0: as many as the ring holds).
    pub read_ahead_max: usize,
    /// Parameters updated between two polls of the io engine (> 0).
    pub poll_params: usize,
}

impl Default for StreamConfig {
    /// 1 GiB ring, master on NVMe, read-ahead bounded by the ring, poll every 1 Mi params.
    fn default() -> Self {
        StreamConfig {
            host_budget_bytes: 1 << 30,
            master: MasterPlace::Nvme,
            read_ahead_max: 0,
            poll_params: 1 << 20,
        }
    }
}

/// The order in which a step updates groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Group 0 first (a full step after backward).
    Ascending,
    /// The last group first (during backward, which finishes the last layers first).
    Descending,
}

/// Counters of the streaming step (since construction or [`StreamingOptimizer::reset_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Bytes read from the swap file by steps.
    pub bytes_read: u64,
    /// Bytes written to the swap file by steps.
    pub bytes_written: u64,
    /// Most ring buffers taken at once.
    pub buffers_in_use_peak: usize,
    /// Time the calling thread waited for reads of the group to update.
    pub read_wait_ns: u64,
    /// Time spent in the kernel.
    pub compute_ns: u64,
    /// Time [`StreamingStep::finish`] waited for the last writes.
    pub drain_ns: u64,
    /// Steps completed.
    pub steps: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Free,
    /// Reads submitted (`reads_left` still out), or all in and waiting for the update.
    Reading,
    /// Buffers taken out for the kernel.
    Computing,
    /// Writes submitted (`writes_left` still out).
    Writing,
}

#[derive(Debug)]
struct Slot {
    group: usize,
    bufs: [Option<AlignedBuf>; ARRAYS_MAX],
    reads_left: u8,
    writes_left: u8,
    phase: Phase,
}

impl Slot {
    fn free() -> Self {
        Slot {
            group: 0,
            bufs: [None, None, None],
            reads_left: 0,
            writes_left: 0,
            phase: Phase::Free,
        }
    }
}

/// An AdamW whose group states live in a swap file, stepped through a bounded ring.
/// See the module documentation.
#[derive(Debug)]
pub struct StreamingOptimizer {
    pub(crate) cpu: AdamW,
    pub(crate) groups: Vec<GroupSpec>,
    pub(crate) cfg: StreamConfig,
    pub(crate) swap: SwapFile,
    pub(crate) pool: BufferPool,
    /// Arrays per group in the swap file (2 or 3).
    pub(crate) arrays: usize,
    slots: Vec<Slot>,
    group_slot: Vec<u32>,
    /// Master parameters per group with [`MasterPlace::Host`]; empty otherwise.
    pub(crate) host_master: Vec<Vec<f32>>,
    pub(crate) step: u64,
    pub(crate) poisoned: Option<String>,
    pub(crate) initialized: bool,
    stats: StreamStats,
}

impl StreamingOptimizer {
    /// Swap-file shape for `groups`: `(slot_bytes, slot_count)` to create it with.
    pub fn swap_shape(groups: &[GroupSpec], master: MasterPlace) -> (usize, u32) {
        let max_len = groups.iter().map(|g| g.len).max().unwrap_or(1);
        let arrays = match master {
            MasterPlace::Host => 2,
            MasterPlace::Nvme => 3,
        };
        let slots = (groups.len() * arrays).min(u32::MAX as usize) as u32;
        (align_up(max_len * 4), slots)
    }

    /// Host bytes the ring takes for `groups` with `cfg` (what the budget must cover).
    pub fn ring_bytes_for(groups: &[GroupSpec], cfg: &StreamConfig) -> (usize, usize) {
        let (buf_bytes, _) = Self::swap_shape(groups, cfg.master);
        let arrays = match cfg.master {
            MasterPlace::Host => 2,
            MasterPlace::Nvme => 3,
        };
        let per_group = buf_bytes * arrays;
        let ring_groups = (cfg.host_budget_bytes / per_group as u64) as usize;
        let ring_groups = if cfg.read_ahead_max > 0 {
            ring_groups.min(cfg.read_ahead_max + 2)
        } else {
            ring_groups
        };
        (ring_groups, per_group)
    }

    /// Builds the optimizer over `swap` (made with [`StreamingOptimizer::swap_shape`] or
    /// larger) and allocates the ring. Call [`StreamingOptimizer::initialize`] or
    /// [`StreamingOptimizer::load_checkpoint`] before the first step.
    pub fn new(
        cpu: AdamW,
        groups: Vec<GroupSpec>,
        swap: SwapFile,
        cfg: StreamConfig,
    ) -> Result<Self> {
        let stream_err = |reason: String| OptimError::Stream { reason };
        if groups.is_empty() {
            return Err(stream_err("no groups".into()));
        }
        if cfg.poll_params == 0 {
            return Err(OptimError::InvalidParam {
                name: "poll_params",
                value: 0.0,
                reason: "must be > 0",
            });
        }
        for (i, g) in groups.iter().enumerate() {
            if g.len == 0 {
                return Err(stream_err(format!("group {i} has no parameters")));
            }
            g.hp.validate()?;
        }
        let arrays = match cfg.master {
            MasterPlace::Host => 2,
            MasterPlace::Nvme => 3,
        };
        let (buf_bytes, slots_needed) = Self::swap_shape(&groups, cfg.master);
        if swap.slot_bytes() < buf_bytes || swap.slot_count() < slots_needed {
            return Err(stream_err(format!(
                "swap file has {} slots of {} bytes; {} groups need {slots_needed} slots of {buf_bytes} bytes",
                swap.slot_count(),
                swap.slot_bytes(),
                groups.len()
            )));
        }
        let (ring_groups, per_group) = Self::ring_bytes_for(&groups, &cfg);
        if ring_groups < 2 {
            return Err(stream_err(format!(
                "host budget of {} bytes is too small: the ring needs at least 2 groups of {per_group} bytes ({} bytes)",
                cfg.host_budget_bytes,
                2 * per_group
            )));
        }
        let pool = BufferPool::new(buf_bytes, ring_groups * arrays).map_err(|e| {
            stream_err(format!(
                "allocating a ring of {ring_groups} groups of {per_group} bytes: {e}"
            ))
        })?;
        let host_master = match cfg.master {
            MasterPlace::Host => groups.iter().map(|g| vec![0.0f32; g.len]).collect(),
            MasterPlace::Nvme => Vec::new(),
        };
        tracing::info!(
            groups = groups.len(),
            ring_groups,
            buf_bytes,
            arrays,
            "streaming optimizer ready"
        );
        Ok(StreamingOptimizer {
            cpu,
            group_slot: vec![NO_SLOT; groups.len()],
            groups,
            cfg,
            swap,
            pool,
            arrays,
            slots: (0..ring_groups).map(|_| Slot::free()).collect(),
            host_master,
            step: 0,
            poisoned: None,
            initialized: false,
            stats: StreamStats::default(),
        })
    }

    /// Sets every group's master parameters with `init(group, master)` and its moments to
    /// zero, writes them to the swap file, flushes it, and sets the step count to 0.
    /// Clears a poisoned state (this is a fresh start).
    pub fn initialize(&mut self, mut init: impl FnMut(usize, &mut [f32])) -> Result<()> {
        self.drain_quiet();
        for i in 0..self.groups.len() {
            let len = self.groups[i].len;
            for array in [ARRAY_M, ARRAY_V, ARRAY_MASTER] {
                let mut buf = self.take_buf("initialize")?;
                let view = f32s_mut(&mut buf, len);
                if array == ARRAY_MASTER {
                    init(i, view);
                    if self.cfg.master == MasterPlace::Host {
                        self.host_master[i].copy_from_slice(view);
                        continue;
                    }
                } else {
                    view.fill(0.0);
                }
                self.write_sync(i, array, buf, "initialize")?;
            }
        }
        self.flush_swap(0)?;
        self.step = 0;
        self.poisoned = None;
        self.initialized = true;
        Ok(())
    }

    /// Groups of the optimizer.
    pub fn groups(&self) -> &[GroupSpec] {
        &self.groups
    }

    /// The CPU kernel driver.
    pub fn cpu(&self) -> &AdamW {
        &self.cpu
    }

    /// Steps completed.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Whether an earlier step failed midway (steps refused until a checkpoint is loaded).
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.is_some()
    }

    /// The ring's buffer pool (its `count() * buf_bytes()` is the host memory bound).
    pub fn ring(&self) -> &BufferPool {
        &self.pool
    }

    /// Groups the ring holds at once.
    pub fn ring_groups(&self) -> usize {
        self.slots.len()
    }

    /// Counters since construction or the last reset.
    pub fn stats(&self) -> StreamStats {
        self.stats
    }

    /// Zero the counters.
    pub fn reset_stats(&mut self) {
        self.stats = StreamStats::default();
    }

    /// The swap file underneath.
    pub fn swap(&self) -> &SwapFile {
        &self.swap
    }

    /// Copies group `group`'s master parameters and moments out (synchronous reads; for
    /// tests and export). Any slice may be empty to skip it.
    pub fn read_group(
        &mut self,
        group: usize,
        master: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
    ) -> Result<()> {
        self.check_usable()?;
        let len = self.group_len(group)?;
        for (array, dst) in [(ARRAY_MASTER, master), (ARRAY_M, m), (ARRAY_V, v)] {
            if dst.is_empty() {
                continue;
            }
            check_len("dst", dst.len(), "group", len)?;
            if array == ARRAY_MASTER && self.cfg.master == MasterPlace::Host {
                dst.copy_from_slice(&self.host_master[group]);
                continue;
            }
            let buf = self.read_sync(group, array, "read_group")?;
            dst.copy_from_slice(f32s(&buf, len));
        }
        Ok(())
    }

    /// One whole step: the global gradient norm over `grads` (one slice per group), the
    /// controller's decision (skip on overflow, clip, unscale), then every group streamed
    /// in ascending order, writing the 16-bit parameters into `outs` (one per group, or
    /// empty for none). If the step fails midway the controller has already counted it:
    /// reload both from a checkpoint.
    pub fn step(
        &mut self,
        ctrl: &mut StepController,
        grads: &[Grads<'_>],
        outs: &mut [ParamOut<'_>],
    ) -> Result<StepDecision> {
        self.check_usable()?;
        let n = self.groups.len();
        check_len("grads", grads.len(), "groups", n)?;
        if !outs.is_empty() {
            check_len("outs", outs.len(), "groups", n)?;
        }
        for (i, g) in grads.iter().enumerate() {
            check_len("grads", g.len(), "group", self.groups[i].len)?;
            if let Some(o) = outs.get(i) {
                check_len("out", o.len(), "group", self.groups[i].len)?;
            }
        }
        let sq: f64 = grads.iter().map(|g| self.cpu.grad_sq_norm(*g)).sum();
        let decision = ctrl.decide(sq);
        if let StepDecision::Apply { state, .. } = decision {
            let mut step = self.begin(state, Order::Ascending)?;
            for (i, g) in grads.iter().enumerate() {
                step.update_group(i, *g, outs.get_mut(i).map(ParamOut::reborrow))?;
            }
            step.finish()?;
        }
        Ok(decision)
    }

    /// Starts a step (reads of the first groups go out at once). `state.step` must be the
    /// step after [`StreamingOptimizer::step_count`].
    pub fn begin(&mut self, state: StepState, order: Order) -> Result<StreamingStep<'_>> {
        self.check_usable()?;
        if state.step != self.step + 1 {
            return Err(OptimError::InvalidParam {
                name: "step",
                value: state.step as f64,
                reason: "must be one more than the steps completed (reload the controller with the checkpoint)",
            });
        }
        let mut s = StreamingStep {
            opt: self,
            state,
            order,
            next_update: 0,
            next_read: 0,
            finished: false,
        };
        s.issue_reads()?;
        Ok(s)
    }

    // ------------------------------------------------------------------ internals

    pub(crate) fn check_usable(&self) -> Result<()> {
        if let Some(first_error) = &self.poisoned {
            return Err(OptimError::Poisoned {
                first_error: first_error.clone(),
            });
        }
        if !self.initialized {
            return Err(OptimError::Stream {
                reason: "not initialized: call initialize or load_checkpoint first".into(),
            });
        }
        Ok(())
    }

    pub(crate) fn group_len(&self, group: usize) -> Result<usize> {
        self.groups
            .get(group)
            .map(|g| g.len)
            .ok_or_else(|| OptimError::Stream {
                reason: format!("group {group} out of {}", self.groups.len()),
            })
    }

    pub(crate) fn poison(&mut self, e: &OptimError) {
        if self.poisoned.is_none() {
            tracing::error!(error = %e, "streaming optimizer poisoned: steps refused until a checkpoint is loaded");
            self.poisoned = Some(e.to_string());
        }
    }

    pub(crate) fn take_buf(&self, during: &str) -> Result<AlignedBuf> {
        self.pool.try_take().ok_or_else(|| OptimError::Stream {
            reason: format!("{during}: no free ring buffer (a step is still holding them)"),
        })
    }

    pub(crate) fn read_sync(
        &mut self,
        group: usize,
        array: u64,
        during: &'static str,
    ) -> Result<AlignedBuf> {
        let buf = self.take_buf(during)?;
        let (res, buf) = self.swap.read_chunk(chunk_id(group, array), buf);
        res.map_err(|e| OptimError::Io {
            during: array_name(Op::Read, array as usize),
            group,
            source: e.into(),
        })?;
        Ok(buf)
    }

    pub(crate) fn write_sync(
        &mut self,
        group: usize,
        array: u64,
        buf: AlignedBuf,
        _during: &'static str,
    ) -> Result<()> {
        let len_bytes = self.groups[group].len * 4;
        let (res, _buf) = self
            .swap
            .write_chunk(chunk_id(group, array), buf, len_bytes);
        res.map_err(|e| OptimError::Io {
            during: array_name(Op::Write, array as usize),
            group,
            source: e.into(),
        })
    }

    pub(crate) fn flush_swap(&mut self, group: usize) -> Result<()> {
        self.swap.flush().map_err(|e| OptimError::Io {
            during: "swap file flush",
            group,
            source: e.into(),
        })
    }

    /// Wait for every request in flight and free every slot (errors only logged).
    pub(crate) fn drain_quiet(&mut self) {
        while let Some(c) = self.swap.wait() {
            if let Err(e) = c.result {
                tracing::warn!(chunk = c.chunk, error = %e, "request failed while draining");
            }
        }
        for s in &mut self.slots {
            *s = Slot::free();
        }
        self.group_slot.fill(NO_SLOT);
    }

    fn note_buffers(&mut self) {
        let used = self.pool.count() - self.pool.available();
        self.stats.buffers_in_use_peak = self.stats.buffers_in_use_peak.max(used);
    }

    /// Book a completion; an error poisons the optimizer and is returned.
    fn on_completion(&mut self, c: SwapCompletion) -> Result<()> {
        let group = (c.chunk / ARRAYS_MAX as u64) as usize;
        let array = (c.chunk % ARRAYS_MAX as u64) as usize;
        let slot_ix = self.group_slot.get(group).copied().unwrap_or(NO_SLOT);
        let err = c.result.err().map(|e| OptimError::Io {
            during: array_name(c.op, array),
            group,
            source: e.into(),
        });
        if slot_ix == NO_SLOT {
            // Not ours (cannot happen: every request of a step is booked in a slot).
            tracing::error!(
                chunk = c.chunk,
                "completion for a group without a ring slot"
            );
            return match err {
                Some(e) => Err(e),
                None => Ok(()),
            };
        }
        let ok = err.is_none();
        let slot = &mut self.slots[slot_ix as usize];
        match c.op {
            Op::Read => {
                slot.reads_left = slot.reads_left.saturating_sub(1);
                if ok {
                    slot.bufs[array] = Some(c.buf);
                    self.stats.bytes_read += c.len_bytes as u64;
                }
            }
            Op::Write => {
                drop(c.buf);
                slot.writes_left = slot.writes_left.saturating_sub(1);
                if slot.writes_left == 0 {
                    *slot = Slot::free();
                    self.group_slot[group] = NO_SLOT;
                }
                if ok {
                    self.stats.bytes_written += c.len_bytes as u64;
                }
            }
        }
        match err {
            Some(e) => {
                self.poison(&e);
                Err(e)
            }
            None => Ok(()),
        }
    }
}

/// One step in progress. Update every group once, in the step's order, then
/// [`StreamingStep::finish`]. Dropping it unfinished drains its I/O and, if any group was
/// updated, poisons the optimizer.
#[derive(Debug)]
pub struct StreamingStep<'a> {
    opt: &'a mut StreamingOptimizer,
    state: StepState,
    order: Order,
    next_update: usize,
    next_read: usize,
    finished: bool,
}

impl StreamingStep<'_> {
    /// The state this step applies.
    pub fn state(&self) -> StepState {
        self.state
    }

    /// The group [`StreamingStep::update_group`] expects next, `None` when all are done.
    pub fn next_group(&self) -> Option<usize> {
        (self.next_update < self.opt.groups.len()).then(|| self.group_at(self.next_update))
    }

    fn group_at(&self, k: usize) -> usize {
        match self.order {
            Order::Ascending => k,
            Order::Descending => self.opt.groups.len() - 1 - k,
        }
    }

    fn read_ahead_limit(&self) -> usize {
        let ring = self.opt.slots.len();
        let k = if self.opt.cfg.read_ahead_max == 0 {
            ring
        } else {
            self.opt.cfg.read_ahead_max
        };
        1 + k
    }

    /// Submit reads for the next groups while a ring slot is free.
    fn issue_reads(&mut self) -> Result<()> {
        let n = self.opt.groups.len();
        let limit = self.read_ahead_limit();
        while self.opt.poisoned.is_none()
            && self.next_read < n
            && self.next_read - self.next_update < limit
        {
            let Some(slot_ix) = self.opt.slots.iter().position(|s| s.phase == Phase::Free) else {
                break;
            };
            let group = self.group_at(self.next_read);
            let arrays = self.opt.arrays;
            if self.opt.pool.available() < arrays {
                break;
            }
            for array in 0..arrays {
                let buf = self.opt.take_buf("read-ahead")?;
                self.opt
                    .swap
                    .submit_read(chunk_id(group, array as u64), buf);
            }
            let slot = &mut self.opt.slots[slot_ix];
            slot.group = group;
            slot.reads_left = arrays as u8;
            slot.writes_left = 0;
            slot.phase = Phase::Reading;
            self.opt.group_slot[group] = slot_ix as u32;
            self.next_read += 1;
            self.opt.note_buffers();
        }
        Ok(())
    }

    /// Process finished I/O without waiting and start more reads: call it between layers
    /// of backward to keep the drive busy.
    pub fn progress(&mut self) -> Result<()> {
        self.opt.check_usable()?;
        while let Some(c) = self.opt.swap.poll() {
            self.opt.on_completion(c)?;
        }
        self.issue_reads()
    }

    /// Updates group `group` (which must be [`StreamingStep::next_group`]) with its final
    /// gradients, writing its 16-bit parameters into `out` when given; its writes go out
    /// behind it.
    pub fn update_group(
        &mut self,
        group: usize,
        grads: Grads<'_>,
        out: Option<ParamOut<'_>>,
    ) -> Result<()> {
        self.opt.check_usable()?;
        let expected = self.next_group();
        if expected != Some(group) {
            return Err(OptimError::Stream {
                reason: format!(
                    "group {group} updated out of order: the step expects {expected:?} next ({:?} order)",
                    self.order
                ),
            });
        }
        let len = self.opt.groups[group].len;
        check_len("grads", grads.len(), "group", len)?;
        if let Some(o) = &out {
            check_len("out", o.len(), "group", len)?;
        }
        let hp = self.opt.groups[group].hp;
        hp.validate()?;

        // 1. Wait for this group's reads (starting more as writes free slots).
        let t = Instant::now();
        let slot_ix = loop {
            self.issue_reads()?;
            let s = self.opt.group_slot[group];
            if s != NO_SLOT {
                let slot = &self.opt.slots[s as usize];
                if slot.phase == Phase::Reading && slot.reads_left == 0 {
                    break s as usize;
                }
            }
            match self.opt.swap.wait() {
                Some(c) => self.opt.on_completion(c)?,
                None => {
                    return Err(OptimError::Stream {
                        reason: format!("group {group} cannot be read: no ring slot frees up"),
                    })
                }
            }
        };
        self.opt.stats.read_wait_ns += t.elapsed().as_nanos() as u64;

        // 2. Update it in slices, polling the engine in between.
        let slot = &mut self.opt.slots[slot_ix];
        slot.phase = Phase::Computing;
        let mut m_buf = slot.bufs[ARRAY_M as usize].take();
        let mut v_buf = slot.bufs[ARRAY_V as usize].take();
        let mut p_buf = slot.bufs[ARRAY_MASTER as usize].take();
        let computed = self.compute(
            group, len, &hp, &mut m_buf, &mut v_buf, &mut p_buf, grads, out,
        );
        let slot = &mut self.opt.slots[slot_ix];
        slot.bufs[ARRAY_M as usize] = m_buf;
        slot.bufs[ARRAY_V as usize] = v_buf;
        slot.bufs[ARRAY_MASTER as usize] = p_buf;
        if let Err(e) = computed {
            // Partly updated buffers were never written: the group is at the old step,
            // but earlier groups are not, so the optimizer is inconsistent.
            self.opt.poison(&e);
            return Err(e);
        }

        // 3. Write it behind.
        let slot = &mut self.opt.slots[slot_ix];
        slot.phase = Phase::Writing;
        slot.writes_left = self.opt.arrays as u8;
        let len_bytes = len * 4;
        for array in 0..self.opt.arrays {
            let Some(buf) = self.opt.slots[slot_ix].bufs[array].take() else {
                let e = OptimError::Stream {
                    reason: format!("group {group}: buffer {array} missing after compute"),
                };
                self.opt.poison(&e);
                return Err(e);
            };
            self.opt
                .swap
                .submit_write(chunk_id(group, array as u64), buf, len_bytes);
        }
        self.next_update += 1;
        self.issue_reads()
    }

    #[allow(clippy::too_many_arguments)]
    fn compute(
        &mut self,
        group: usize,
        len: usize,
        hp: &HyperParams,
        m_buf: &mut Option<AlignedBuf>,
        v_buf: &mut Option<AlignedBuf>,
        p_buf: &mut Option<AlignedBuf>,
        grads: Grads<'_>,
        mut out: Option<ParamOut<'_>>,
    ) -> Result<()> {
        let missing = || OptimError::Stream {
            reason: format!("group {group}: a read buffer is missing"),
        };
        let m = f32s_mut(m_buf.as_mut().ok_or_else(missing)?, len);
        let v = f32s_mut(v_buf.as_mut().ok_or_else(missing)?, len);
        // Master on NVMe: from the ring; on the host: the optimizer's own array, moved out
        // for the compute so the engine can be polled through `self` meanwhile.
        let mut host_master = match self.opt.cfg.master {
            MasterPlace::Host => std::mem::take(&mut self.opt.host_master[group]),
            MasterPlace::Nvme => Vec::new(),
        };
        let result = (|| {
            let p: &mut [f32] = match self.opt.cfg.master {
                MasterPlace::Host => &mut host_master,
                MasterPlace::Nvme => f32s_mut(p_buf.as_mut().ok_or_else(missing)?, len),
            };
            let step = self.opt.cfg.poll_params;
            let mut at = 0;
            while at < len {
                let end = (at + step).min(len);
                let t = Instant::now();
                let g = grads.split_at(end).0.split_at(at).1;
                let o = out
                    .as_mut()
                    .map(|o| o.reborrow().split_at(end).0.split_at(at).1);
                self.opt.cpu.step_slice(
                    self.state,
                    hp,
                    &mut p[at..end],
                    &mut m[at..end],
                    &mut v[at..end],
                    g,
                    o,
                )?;
                self.opt.stats.compute_ns += t.elapsed().as_nanos() as u64;
                while let Some(c) = self.opt.swap.poll() {
                    self.opt.on_completion(c)?;
                }
                self.issue_reads()?;
                at = end;
            }
            Ok(())
        })();
        if self.opt.cfg.master == MasterPlace::Host {
            self.opt.host_master[group] = host_master;
        }
        result
    }

    /// Waits for the last writes and completes the step. Every group must have been
    /// updated; otherwise the optimizer is poisoned (its groups are at two steps).
    pub fn finish(mut self) -> Result<()> {
        self.finished = true;
        let n = self.opt.groups.len();
        let t = Instant::now();
        let mut first: Option<OptimError> = None;
        while let Some(c) = self.opt.swap.wait() {
            if let Err(e) = self.opt.on_completion(c) {
                first.get_or_insert(e);
            }
        }
        self.opt.stats.drain_ns += t.elapsed().as_nanos() as u64;
        if let Some(e) = first {
            self.opt.drain_quiet();
            return Err(e);
        }
        self.opt.check_usable()?;
        if self.next_update != n {
            let e = OptimError::Stream {
                reason: format!(
                    "step {} finished with {} of {n} groups updated",
                    self.state.step, self.next_update
                ),
            };
            self.opt.drain_quiet();
            if self.next_update > 0 {
                self.opt.poison(&e);
            }
            return Err(e);
        }
        self.opt.step = self.state.step;
        self.opt.stats.steps += 1;
        Ok(())
    }
}

impl Drop for StreamingStep<'_> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        self.opt.drain_quiet();
        if self.next_update > 0 {
            let e = OptimError::Stream {
                reason: format!(
                    "step {} abandoned after {} of {} groups",
                    self.state.step,
                    self.next_update,
                    self.opt.groups.len()
                ),
            };
            self.opt.poison(&e);
        }
    }
}

/// The first `len` f32 of a ring buffer.
pub(crate) fn f32s(buf: &AlignedBuf, len: usize) -> &[f32] {
    let bytes = &buf[..len * 4];
    // SAFETY: `bytes` is a live, initialised byte range of `len * 4` bytes (bounds checked
    // by the slice above) starting at the buffer's base, which is 4096-aligned, so it is
    // aligned for f32; every bit pattern is a valid f32; the shared borrow of `buf` keeps
    // it alive and unmodified for the returned lifetime.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), len) }
}

/// The first `len` f32 of a ring buffer, writable.
pub(crate) fn f32s_mut(buf: &mut AlignedBuf, len: usize) -> &mut [f32] {
    let bytes = &mut buf[..len * 4];
    // SAFETY: as in `f32s`; the exclusive borrow of `buf` makes this the only access.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<f32>(), len) }
}
