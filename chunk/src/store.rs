//! The chunk store: tensors whose bytes live on the device, in the pinned host pool or
//! on NVMe, and move just in time.
//!
//! [`ChunkStore::open`] takes a [`Layout`], a [`StoreConfig`] and a [`Device`]; it
//! checks the budgets against the layout (see [`crate::config`]) before it allocates the
//! host pool or the swap file. Then, per iteration:
//! - [`ChunkStore::access`] makes a tensor's chunk current where asked (the device for
//!   compute, the host for CPU work), loading it NVMe -> host -> device and evicting by
//!   the configured policy when a tier is full, and returns a [`Guard`];
//!   [`ChunkStore::view`] / [`ChunkStore::view_mut`] give its bytes (host slices, or a
//!   device view), `view_mut` marking the chunk changed there;
//!   [`ChunkStore::release`] ends the use (COMPUTE -> HOLD / HOLD_AFTER_FWD /
//!   HOLD_AFTER_BWD, by the [`StateTable`] rules). A chunk with a tensor in COMPUTE is
//!   never evicted, and a chunk is in use on one tier at a time;
//! - [`ChunkStore::end_iteration`] closes the iteration. The first one is traced: every
//!   access and release is a moment, with the non-model device memory at that moment
//!   (reported through [`ChunkStore::report_non_model_bytes`], or measured on a GPU).
//!   After it, the [`Schedule`] drives `lifetime` eviction, the prefetcher (loads for the
//!   next moments, never evicting a chunk needed sooner than the one it brings) and the
//!   tidal device budget (capacity minus the non-model peak over the next moments minus
//!   a margin). A later iteration that departs from the schedule is logged and the next
//!   one is traced again; until then eviction falls back to LRU and prefetch pauses.
//! - [`ChunkStore::begin_optimizer_step`] / [`ChunkStore::end_optimizer_step`] switch
//!   the device budget to nearly the whole device for the step, and back.
//!
//! [`ChunkStore::with_access`] and [`ChunkStore::with_host_views`] are the scoped form
//! of access/release: several tensors at once, views handed to a closure, every tensor
//! released on every path (return, error, panic). A [`Guard`] names one access; a stale
//! one is refused ([`ChunkError::StaleGuard`]) and changes nothing.
//!
//! [`ChunkStore::write`] and [`ChunkStore::read`] put bytes into a tensor and take them
//! out without being moments of the trace (initialisation, checkpoints). A chunk never
//! written reads as zeros — also on a swap file an earlier store left, whose chunks are
//! dropped unless [`StoreConfig::adopt`] asks for them (and then only from a file of the
//! same layout fingerprint, closed by [`ChunkStore::close`]).
//! [`ChunkStore::stats`] returns the accounting; [`ChunkStore::verify`] checks every
//! invariant and reports the first broken one rather than repairing it.
//!
//! Not thread-safe by itself (`&mut self` everywhere); it is `Send`, so it can live
//! behind a mutex or on a dedicated thread.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use tidestore_tiers::{
    CudaSpanMut, Device, DeviceKind, DeviceView, DeviceViewMut, HostTier, NvmeTier, TierKind,
};

use crate::accounting::{MoveHook, MoveReason, StoreStats, TierSnapshot};
use crate::adopt::{open_swap_dir, prepare_swap_file};
use crate::config::{plan_capacity, CapacityPlan, NvmeSource, StoreConfig};
use crate::dtype::DType;
use crate::error::ChunkError;
use crate::id::{ChunkId, ListKind, TensorId};
use crate::layout::{Layout, TensorLocation};
use crate::mover::{is_no_room, IoPump, Mover, Pending, Policies};
use crate::policy::{Lifetime, PolicyKind, PrefetchPlanner, PrefetchStep, Residency};
use crate::state::{StateTable, TensorState};
use crate::tracer::{Follow, Follower, Horizon, MomentKind, Schedule, Tracer};
use crate::Result;

/// The swap file's name inside [`NvmeSource::Dir`].
pub const SWAP_FILE_NAME: &str = "tidestore-chunks.swap";

/// Where an access wants the tensor's chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Place {
    /// The compute device (GPU, or its simulation).
    Device,
    /// The pinned host pool (CPU work, e.g. the CPU optimizer).
    Host,
}

impl Place {
    /// The tier this place is.
    pub fn tier(self) -> TierKind {
        match self {
            Place::Device => TierKind::Device,
            Place::Host => TierKind::Host,
        }
    }
}

/// One tensor in COMPUTE, handed out by [`ChunkStore::access`]; views come from
/// [`ChunkStore::view`] / [`ChunkStore::view_mut`], and [`ChunkStore::release`] ends
/// it. Dropping a guard without releasing leaves the tensor in COMPUTE (its chunk stays
/// pinned); [`ChunkStore::release_tensor`] releases by id. [`ChunkStore::with_access`]
/// and [`ChunkStore::with_host_views`] release on every path instead.
///
/// A guard names one access: its store and the access's generation. Once that access
/// ends (released by id, perhaps accessed again since), or given to another store, it is
/// stale, and every call taking it returns [`ChunkError::StaleGuard`] and changes
/// nothing.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a guard must be released, or its chunk stays pinned"]
pub struct Guard {
    /// The store that made it ([`ChunkStore`]'s `id`).
    store: u64,
    /// The access it names (the tensor's generation in its list then).
    generation: u64,
    tensor: TensorId,
    list: ListKind,
    chunk: ChunkId,
    place: Place,
    offset_bytes: usize,
    len_bytes: usize,
    dtype: DType,
}

impl Guard {
    /// The tensor.
    pub fn tensor(&self) -> TensorId {
        self.tensor
    }

    /// The list it was accessed in.
    pub fn list(&self) -> ListKind {
        self.list
    }

    /// Its chunk.
    pub fn chunk(&self) -> ChunkId {
        self.chunk
    }

    /// Where it is.
    pub fn place(&self) -> Place {
        self.place
    }

    /// Offset of the tensor in its chunk, in bytes.
    pub fn offset_bytes(&self) -> usize {
        self.offset_bytes
    }

    /// The tensor's bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The tensor's dtype in this list.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

/// A read-only view of an accessed tensor.
#[derive(Debug)]
pub enum TensorView<'a> {
    /// Its bytes in the host pool.
    Host(&'a [u8]),
    /// Its bytes on the device (host bytes in the simulation, a pointer on a GPU).
    Device(DeviceView<'a>),
}

/// A writable view of an accessed tensor.
#[derive(Debug)]
pub enum TensorViewMut<'a> {
    /// Its bytes in the host pool.
    Host(&'a mut [u8]),
    /// Its bytes on the device.
    Device(DeviceViewMut<'a>),
}

/// What is left of one chunk's bytes while views are cut from it.
enum Region<'a> {
    /// Host-addressable bytes (`true`: the simulated device).
    Host(&'a mut [u8], bool),
    /// GPU memory (`None` only while a view is being cut from it).
    Cuda(Option<CudaSpanMut<'a>>),
}

/// Where a chunk's current copies are (for tests and reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkResidency {
    /// Current on the device.
    pub device: bool,
    /// Current in the host pool.
    pub host: bool,
    /// Current on NVMe.
    pub nvme: bool,
    /// A transfer is in flight.
    pub in_flight: bool,
}

/// Which device budget applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Forward and backward: the tidal budget.
    ForwardBackward,
    /// The optimizer step: nearly the whole device.
    OptimizerStep,
}

struct ListStates {
    table: StateTable,
    /// Global tensor index -> index in `table` (`u32::MAX`: not in this list).
    local: Vec<u32>,
    /// Per local tensor: where it is in COMPUTE.
    place: Vec<Option<Place>>,
    /// Per local tensor: the generation of its latest access (0: never accessed).
    generation: Vec<u64>,
}

/// Store ids, so that a guard of one store is stale in every other.
static NEXT_STORE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

enum Mode {
    Tracing(Tracer),
    Following(Arc<Schedule>),
}

#[derive(Debug, Clone, Copy)]
struct Settings {
    device_budget_bytes: u64,
    step_device_budget_bytes: Option<u64>,
    policy: PolicyKind,
    lookahead: u32,
    host_lookahead: u32,
    margin_bytes: u64,
    window: u32,
    slack_bytes: u64,
}

/// Tensors in chunks on three tiers; see the module doc.
pub struct ChunkStore {
    /// This store's id, carried by its guards.
    id: u64,
    /// The generation the next access gets (across all tensors and lists).
    next_generation: u64,
    layout: Layout,
    mover: Mover,
    lists: Vec<Option<ListStates>>,
    settings: Settings,
    planner: PrefetchPlanner,
    /// The host tier's prefetch planner (the same rule, over host accesses).
    host_planner: PrefetchPlanner,
    /// Per dense id: the bytes a chunk takes in the host pool (one whole buffer).
    host_chunk_bytes: Vec<u64>,
    plan: CapacityPlan,
    mode: Mode,
    follower: Follower,
    diverged: bool,
    /// Moments observed in this iteration.
    position: u32,
    /// Iterations followed since the schedule was made.
    cycles: u64,
    phase: Phase,
    /// During tracing, per access: (moment, device bytes pinned, phase).
    warmup: Vec<(u32, u64, Phase)>,
    /// During tracing, per moment: the chunk accessed on the device, if any.
    device_moments: Vec<Option<ChunkId>>,
    /// During tracing, per moment: the chunk accessed on the host, if any.
    host_moments: Vec<Option<ChunkId>>,
    /// The schedule of host accesses (same moments): what the host prefetcher loads.
    host_schedule: Option<Arc<Schedule>>,
    /// The schedule of device accesses only (same moments as the followed one): what
    /// the device's `lifetime` policy and the prefetcher read.
    device_schedule: Option<Arc<Schedule>>,
    pinned_device_bytes: u64,
    non_model_reported_bytes: u64,
    device_total_bytes: u64,
}

impl std::fmt::Debug for ChunkStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkStore")
            .field("tensors", &self.layout.tensors().len())
            .field("plan", &self.plan)
            .field("policy", &self.settings.policy)
            .field("tracing", &self.is_tracing())
            .field("phase", &self.phase)
            .finish()
    }
}

fn empty_schedule() -> Arc<Schedule> {
    Arc::new(Schedule::from_groups(&[], &[]))
}

impl ChunkStore {
    /// Opens a store for `layout` on `device` (see the module doc). Impossible budgets
    /// are refused here, before the host pool or the swap file is allocated, with the
    /// bytes needed and available.
    pub fn open(layout: Layout, config: StoreConfig, device: Device) -> Result<Self> {
        // Chunks live in the device's slab: it bounds every device budget.
        let device_total_bytes = device
            .mem_info()
            .map_err(|e| ChunkError::tier("reading the device's memory", None, e))?
            .total_bytes
            .min(device.slab_bytes());
        let len_bytes = layout.dense_chunk_bytes();
        let max_chunk = len_bytes.iter().copied().max().unwrap_or(0);
        if max_chunk == 0 {
            return Err(ChunkError::NoTensors);
        }
        let slot_bytes = tidestore_io::align_up(max_chunk as usize);
        let StoreConfig {
            device_budget_bytes,
            step_device_budget_bytes,
            host_budget_bytes,
            nvme,
            policy,
            prefetch_lookahead,
            prefetch_lookahead_bytes_max,
            host_prefetch_lookahead,
            async_write_back,
            tidal_margin_bytes,
            tidal_window,
            non_model_slack_bytes,
            working_set_chunks,
            adopt,
        } = config;
        enum Source {
            Dir(std::path::PathBuf, tidestore_io::IoConfig),
            Tier(Box<NvmeTier>),
        }
        let fingerprint = layout.fingerprint();
        // Usable NVMe slots, and the tier if the caller made it: every slot, since the
        // chunks a file already holds are either dropped or the layout's own.
        let (nvme_slots, source) = match nvme {
            NvmeSource::Dir { dir, bytes, io } => (bytes / slot_bytes as u64, Source::Dir(dir, io)),
            NvmeSource::Tier(tier) => {
                if tier.slot_bytes() < max_chunk as usize {
                    return Err(ChunkError::Config {
                        key: "nvme.slot_bytes",
                        reason: format!(
                            "the NVMe tier's slots of {} bytes are smaller than the largest \
                             chunk ({max_chunk} bytes)",
                            tier.slot_bytes()
                        ),
                    });
                }
                (u64::from(tier.slot_count()), Source::Tier(tier))
            }
        };
        let plan = plan_capacity(
            &layout,
            device_budget_bytes,
            host_budget_bytes,
            working_set_chunks,
            nvme_slots,
            device_total_bytes,
        )?;
        if prefetch_lookahead_bytes_max == 0 {
            return Err(ChunkError::Config {
                key: "store.prefetch_lookahead_bytes",
                reason: "a window of zero bytes prefetches nothing; set the look-ahead to 0 \
                         instead"
                    .into(),
            });
        }
        // Everything fits: open the swap file and decide what its chunks are, then
        // allocate.
        let mut nvme = match source {
            Source::Tier(tier) => *tier,
            Source::Dir(dir, io) => {
                let slots = u32::try_from(nvme_slots.max(1)).map_err(|_| ChunkError::Config {
                    key: "nvme.bytes",
                    reason: format!("{nvme_slots} slots are more than a swap file holds"),
                })?;
                open_swap_dir(&dir, slot_bytes, slots, &io, adopt.then_some(fingerprint))?
            }
        };
        let adopted = prepare_swap_file(&mut nvme, &len_bytes, fingerprint, adopt)?;
        let host = HostTier::new(host_budget_bytes, slot_bytes, &device)
            .map_err(|e| ChunkError::tier("allocating the host pool", None, e))?;

        let settings = Settings {
            device_budget_bytes,
            step_device_budget_bytes,
            policy,
            lookahead: prefetch_lookahead,
            host_lookahead: host_prefetch_lookahead,
            margin_bytes: tidal_margin_bytes,
            window: tidal_window,
            slack_bytes: non_model_slack_bytes,
        };
        let use_main = policy != PolicyKind::Lifetime;
        let dev_policy = Policies::new(policy.build(empty_schedule(), Horizon::Cyclic), use_main);
        let host_policy = Policies::new(policy.build(empty_schedule(), Horizon::Cyclic), use_main);
        let non_model = device.non_model_bytes().unwrap_or(0);
        let cap = device_budget_bytes.min(
            device_total_bytes
                .saturating_sub(non_model)
                .saturating_sub(tidal_margin_bytes),
        );
        device
            .set_budget_capacity(cap)
            .map_err(|e| ChunkError::tier("setting the device budget", None, e))?;
        // Chunks move between the host pool and NVMe only: with the pool registered as
        // fixed buffers, no request pins pages.
        match nvme.register_pool(host.pool()) {
            Ok(fixed) => {
                tracing::debug!(
                    fixed,
                    "chunk store: host pool offered to the swap file's engine"
                )
            }
            Err(e) => {
                tracing::warn!(error = %e, "chunk store: host pool not registered with the io engine; plain requests")
            }
        }
        let mut mover = Mover::new(device, host, nvme, len_bytes, cap, dev_policy, host_policy);
        mover.async_writes = async_write_back;
        for c in &adopted {
            mover.adopt_nvme(*c);
        }
        let host_buf_bytes = mover.host.buf_bytes() as u64;
        let host_chunk_bytes: Vec<u64> = mover
            .len_bytes
            .iter()
            .map(|&b| if b > 0 { host_buf_bytes } else { 0 })
            .collect();

        let mut lists: Vec<Option<ListStates>> = (0..ListKind::COUNT).map(|_| None).collect();
        let n = layout.tensors().len();
        for list in ListKind::ALL {
            if layout.list_chunk_count(list) == 0 {
                continue;
            }
            let mut local = vec![u32::MAX; n];
            let mut names = Vec::new();
            let mut chunks = Vec::new();
            for (i, spec) in layout.tensors().iter().enumerate() {
                if let Some(loc) = layout.location(TensorId(i as u32), list) {
                    local[i] = names.len() as u32;
                    names.push(spec.name.clone());
                    chunks.push(loc.chunk);
                }
            }
            let count = names.len();
            lists[list as usize] = Some(ListStates {
                table: StateTable::new(names, chunks),
                local,
                place: vec![None; count],
                generation: vec![0; count],
            });
        }
        tracing::debug!(?plan, device_budget_bytes, host_budget_bytes, %policy, "chunk store opened");
        Ok(ChunkStore {
            id: NEXT_STORE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            next_generation: 1,
            layout,
            mover,
            lists,
            settings,
            planner: PrefetchPlanner::new(prefetch_lookahead, Horizon::Cyclic)
                .with_lookahead_bytes_max(prefetch_lookahead_bytes_max),
            host_planner: PrefetchPlanner::new(host_prefetch_lookahead, Horizon::Cyclic),
            host_chunk_bytes,
            plan,
            mode: Mode::Tracing(Tracer::new()),
            follower: Follower::new(non_model_slack_bytes),
            diverged: false,
            position: 0,
            cycles: 0,
            phase: Phase::ForwardBackward,
            warmup: Vec::new(),
            device_moments: Vec::new(),
            host_moments: Vec::new(),
            host_schedule: None,
            device_schedule: None,
            pinned_device_bytes: 0,
            non_model_reported_bytes: 0,
            device_total_bytes,
        })
    }

    // ------------------------------------------------------------- lookups

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The capacity plan made at open.
    pub fn capacity_plan(&self) -> &CapacityPlan {
        &self.plan
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.mover.device
    }

    /// The NVMe tier (its swap file and io engine), for reports and tests.
    pub fn nvme(&self) -> &NvmeTier {
        &self.mover.nvme
    }

    /// Whether the current iteration is being traced.
    pub fn is_tracing(&self) -> bool {
        matches!(self.mode, Mode::Tracing(_))
    }

    /// The schedule being followed, if any.
    pub fn schedule(&self) -> Option<&Arc<Schedule>> {
        match &self.mode {
            Mode::Following(s) => Some(s),
            Mode::Tracing(_) => None,
        }
    }

    /// The schedule of device accesses (what `lifetime` and the prefetcher read on the
    /// device tier), if one is followed.
    pub fn device_schedule(&self) -> Option<&Arc<Schedule>> {
        self.device_schedule.as_ref()
    }

    /// The phase (which device budget applies).
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The device budget for chunks now (the tide).
    pub fn device_budget_bytes(&self) -> u64 {
        self.mover.dev_cap
    }

    /// Every tier's use now.
    pub fn usage(&self) -> TierSnapshot {
        self.mover.snapshot()
    }

    /// A tensor's state in `list`.
    pub fn state(&self, tensor: TensorId, list: ListKind) -> Option<TensorState> {
        let ls = self.lists.get(list as usize)?.as_ref()?;
        let local = *ls.local.get(tensor.index())?;
        ls.table.state(TensorId(local))
    }

    /// Where `chunk`'s current copies are.
    pub fn residency(&self, chunk: ChunkId) -> Option<ChunkResidency> {
        let s = self.mover.slots.get(chunk.dense())?;
        if self.mover.len_bytes[chunk.dense()] == 0 {
            return None;
        }
        Some(ChunkResidency {
            device: s.dev.is_some(),
            host: s.host.is_some(),
            nvme: s.nvme_valid,
            in_flight: s.pending != Pending::None,
        })
    }

    /// The accounting, with every tier's capacity, use and peak now.
    pub fn stats(&self) -> StoreStats {
        let mut s = self.mover.stats;
        let u = self.mover.snapshot();
        s.device = u.device;
        s.host = u.host;
        s.nvme = u.nvme;
        s
    }

    /// Zeroes the counters and restarts peak tracking from what is in use now.
    pub fn reset_stats(&mut self) {
        self.mover.stats = StoreStats::default();
        self.mover.device.reset_peak();
        self.mover.host.reset_peak();
        self.mover.nvme.reset_peak();
    }

    /// Calls `hook` after every move and eviction (`None` removes it); see
    /// [`crate::accounting`].
    pub fn set_move_hook(&mut self, hook: Option<MoveHook>) {
        self.mover.hook = hook;
    }

    fn location(&self, tensor: TensorId, list: ListKind) -> Result<TensorLocation> {
        let count = self.layout.tensors().len() as u32;
        let spec = self
            .layout
            .tensor(tensor)
            .ok_or(ChunkError::UnknownTensor {
                id: tensor.0,
                count,
            })?;
        self.layout
            .location(tensor, list)
            .ok_or_else(|| ChunkError::NoPlace {
                tensor: spec.name.clone(),
                list,
            })
    }

    fn name(&self, tensor: TensorId) -> String {
        self.layout
            .tensor(tensor)
            .map_or_else(|| tensor.to_string(), |s| s.name.clone())
    }

    /// (list index, local id) of a tensor placed in `list`.
    fn local(&self, tensor: TensorId, list: ListKind) -> Result<u32> {
        self.lists[list as usize]
            .as_ref()
            .and_then(|ls| ls.local.get(tensor.index()).copied())
            .filter(|&l| l != u32::MAX)
            .ok_or_else(|| ChunkError::NoPlace {
                tensor: self.name(tensor),
                list,
            })
    }

    fn list_states(&mut self, list: ListKind) -> &mut ListStates {
        // `local` succeeded for this list, so its states exist.
        self.lists[list as usize]
            .as_mut()
            .expect("list states exist for a list with a placed tensor")
    }

    fn non_model_now(&self) -> u64 {
        match self.mover.device.kind() {
            DeviceKind::Sim => self.non_model_reported_bytes,
            DeviceKind::Cuda => self
                .mover
                .device
                .non_model_bytes()
                .unwrap_or(self.non_model_reported_bytes),
        }
    }

    // ------------------------------------------------------------- moments

    /// Records or follows one moment and returns its absolute moment.
    fn observe(&mut self, tensor: TensorId, chunk: ChunkId, kind: MomentKind) -> u64 {
        let non_model = self.non_model_now();
        let diverged_now = match &mut self.mode {
            Mode::Tracing(t) => {
                let i = t.record(tensor, chunk, kind, non_model);
                self.position = i.saturating_add(1);
                return u64::from(i);
            }
            Mode::Following(s) => {
                let moment = self.cycles * u64::from(s.len()) + u64::from(self.position);
                self.position = self.position.saturating_add(1);
                if self.diverged {
                    return moment;
                }
                let why = match self.follower.observe(s, tensor, kind, non_model) {
                    Follow::OnSchedule { moment: m } => {
                        (s.events()[m as usize].chunk != chunk).then_some("another list")
                    }
                    Follow::Diverged(_) => Some("another access sequence"),
                    Follow::Untraced => None,
                };
                match why {
                    None => return moment,
                    Some(why) => (moment, why),
                }
            }
        };
        self.diverge(diverged_now.1);
        diverged_now.0
    }

    fn diverge(&mut self, why: &'static str) {
        self.diverged = true;
        self.mover.stats.divergences += 1;
        self.sync_policies();
        tracing::info!(
            moment = self.position.saturating_sub(1),
            why,
            "chunk store: iteration left the traced schedule; LRU until the next iteration, \
             which is re-traced"
        );
    }

    fn sync_policies(&mut self) {
        let following = matches!(self.mode, Mode::Following(_)) && !self.diverged;
        let use_main = self.settings.policy != PolicyKind::Lifetime || following;
        self.mover.dev_policy.use_main = use_main;
        self.mover.host_policy.use_main = use_main;
    }

    /// The absolute moment the next observation will get.
    fn current_moment(&self) -> u64 {
        match &self.mode {
            Mode::Tracing(t) => t.moments().len() as u64,
            Mode::Following(s) => self.cycles * u64::from(s.len()) + u64::from(self.position),
        }
    }

    /// The device budget for chunks at `moment`.
    fn cap_for(&self, s: Option<&Schedule>, moment: u64, phase: Phase, non_model: u64) -> u64 {
        let st = &self.settings;
        let total = self.device_total_bytes;
        let now = total
            .saturating_sub(non_model)
            .saturating_sub(st.margin_bytes);
        match phase {
            Phase::ForwardBackward => st.device_budget_bytes.min(match s {
                Some(s) => s.tidal_budget_bytes(total, moment, st.window, st.margin_bytes),
                None => now,
            }),
            Phase::OptimizerStep => st.step_device_budget_bytes.unwrap_or(total).min(now),
        }
    }

    fn update_tide(&mut self, moment: u64) -> Result<()> {
        let s = match &self.mode {
            Mode::Following(s) if !self.diverged => Some(&**s),
            _ => None,
        };
        let cap = self.cap_for(s, moment, self.phase, self.non_model_now());
        if cap != self.mover.dev_cap {
            self.set_device_cap(cap)?;
        }
        Ok(())
    }

    fn set_device_cap(&mut self, cap: u64) -> Result<()> {
        let cap = if cap < self.mover.dev_cap {
            self.mover.reason = MoveReason::Tide;
            let held = self.mover.shrink_device(cap);
            self.mover.reason = MoveReason::Demand;
            let held = held?;
            if held > cap {
                tracing::debug!(
                    cap,
                    held,
                    "tidal budget held above target by chunks in use or in flight"
                );
            }
            cap.max(held)
        } else {
            cap
        };
        self.mover
            .device
            .set_budget_capacity(cap)
            .map_err(|e| ChunkError::tier("setting the tidal device budget", None, e))?;
        self.mover.dev_cap = cap;
        Ok(())
    }

    // ------------------------------------------------------------- access

    /// Makes `tensor` (its place in `list`) current at `place` and puts it in COMPUTE.
    ///
    /// Errors (the tensor's state is then unchanged): a tensor without a place in
    /// `list`, an illegal transition (already in COMPUTE), its chunk in use on the
    /// other tier, a working set that does not fit the tier, tier and I/O errors.
    pub fn access(&mut self, tensor: TensorId, list: ListKind, place: Place) -> Result<Guard> {
        let loc = self.location(tensor, list)?;
        let local = self.local(tensor, list)?;
        let chunk = loc.chunk;
        let d = chunk.dense();
        {
            let ls = self.list_states(list);
            let from = ls.table.state(TensorId(local)).unwrap_or(TensorState::Free);
            if !from.can_become(TensorState::Compute) {
                return Err(ChunkError::IllegalTransition {
                    tensor: self.name(tensor),
                    chunk,
                    from,
                    to: TensorState::Compute,
                });
            }
        }
        let slot = &self.mover.slots[d];
        let elsewhere = match place {
            Place::Device if slot.host_pins > 0 => Some(TierKind::Host),
            Place::Host if slot.dev_pins > 0 => Some(TierKind::Device),
            _ => None,
        };
        if let Some(pinned_on) = elsewhere {
            return Err(ChunkError::PinnedElsewhere {
                tensor: self.name(tensor),
                chunk,
                pinned_on,
            });
        }
        let moment = self.observe(tensor, chunk, MomentKind::Access);
        self.mover.moment = moment;
        self.mover.stats.accesses += 1;
        self.update_tide(moment)?;
        let slot = &self.mover.slots[d];
        let ready = slot.pending == Pending::None
            && match place {
                Place::Device => slot.dev.is_some(),
                Place::Host => slot.host.is_some(),
            };
        if ready {
            self.mover.stats.hits += 1;
            match place {
                Place::Device => self.mover.dev_policy.on_access(chunk, moment),
                Place::Host => self.mover.ensure_host(chunk).map(|_| ())?,
            }
        } else {
            let started = Instant::now();
            let r = match place {
                Place::Device => self.mover.ensure_device(chunk),
                Place::Host => self.mover.ensure_host(chunk),
            };
            self.mover.stats.stall_ns += started.elapsed().as_nanos() as u64;
            if r? {
                self.mover.stats.hits += 1;
            }
        }
        let dev_bytes = self.mover.dev_bytes[d];
        let slot = &mut self.mover.slots[d];
        match place {
            Place::Device => {
                if slot.prefetched {
                    slot.prefetched = false;
                    self.mover.stats.prefetch_hits += 1;
                }
                slot.dev_pins += 1;
                if slot.dev_pins == 1 {
                    self.pinned_device_bytes += dev_bytes;
                }
            }
            Place::Host => {
                if slot.host_prefetched {
                    slot.host_prefetched = false;
                    self.mover.stats.prefetch_hits += 1;
                    self.mover.stats.host_prefetch_hits += 1;
                }
                slot.host_pins += 1;
            }
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        let ls = self.list_states(list);
        ls.table.transition(TensorId(local), TensorState::Compute)?;
        ls.place[local as usize] = Some(place);
        ls.generation[local as usize] = generation;
        if let Mode::Tracing(_) = self.mode {
            if let Ok(m) = u32::try_from(moment) {
                self.warmup.push((m, self.pinned_device_bytes, self.phase));
                self.device_moments.resize(m as usize, None);
                self.device_moments
                    .push((place == Place::Device).then_some(chunk));
                self.host_moments.resize(m as usize, None);
                self.host_moments
                    .push((place == Place::Host).then_some(chunk));
            }
        }
        match place {
            Place::Device => self.prefetch(moment),
            Place::Host => self.prefetch_host(moment),
        }
        Ok(Guard {
            store: self.id,
            generation,
            tensor,
            list,
            chunk,
            place,
            offset_bytes: loc.offset_bytes() as usize,
            len_bytes: loc.bytes() as usize,
            dtype: loc.dtype,
        })
    }

    /// Ends `guard`'s use: its tensor goes from COMPUTE to `to` (`Hold`,
    /// `HoldAfterFwd` or `HoldAfterBwd`; COMPUTE -> FREE is illegal, see
    /// [`crate::state`]). On an error the tensor stays in COMPUTE;
    /// [`ChunkStore::release_tensor`] can release it then. A stale guard (see
    /// [`Guard`]) is [`ChunkError::StaleGuard`], and nothing changes.
    pub fn release(&mut self, guard: Guard, to: TensorState) -> Result<()> {
        self.check_guard(&guard)?;
        self.release_tensor(guard.tensor, guard.list, to)
    }

    /// Releases `tensor` in `list` by id (see [`ChunkStore::release`]).
    pub fn release_tensor(
        &mut self,
        tensor: TensorId,
        list: ListKind,
        to: TensorState,
    ) -> Result<()> {
        let local = self.local(tensor, list)?;
        let chunk = self.location(tensor, list)?.chunk;
        let ls = self.list_states(list);
        let from = ls.table.state(TensorId(local)).unwrap_or(TensorState::Free);
        if from != TensorState::Compute || !from.can_become(to) {
            return Err(ChunkError::IllegalTransition {
                tensor: self.name(tensor),
                chunk,
                from,
                to,
            });
        }
        // A tensor in COMPUTE has a place, and its chunk a pin there: checked before
        // anything changes.
        let place = ls.place[local as usize];
        let d = chunk.dense();
        let slot = &self.mover.slots[d];
        let pins = match place {
            Some(Place::Device) => slot.dev_pins,
            Some(Place::Host) => slot.host_pins,
            None => 0,
        };
        let dev_bytes = self.mover.dev_bytes[d];
        if pins == 0 || (place == Some(Place::Device) && self.pinned_device_bytes < dev_bytes) {
            return Err(ChunkError::Invariant {
                chunk: Some(chunk),
                what: format!(
                    "releasing `{}` in COMPUTE at {place:?}, but its chunk has no pin there",
                    self.name(tensor)
                ),
            });
        }
        let ls = self.list_states(list);
        ls.table.transition(TensorId(local), to)?;
        ls.place[local as usize] = None;
        let moment = self.observe(tensor, chunk, MomentKind::Release(to));
        self.mover.moment = moment;
        let slot = &mut self.mover.slots[d];
        match place {
            Some(Place::Device) => {
                slot.dev_pins -= 1;
                if slot.dev_pins == 0 {
                    self.pinned_device_bytes -= dev_bytes;
                }
            }
            Some(Place::Host) => slot.host_pins -= 1,
            None => unreachable!("checked above: a tensor released has a place"),
        }
        Ok(())
    }

    /// Moves a tensor that is not in COMPUTE to another state that is not COMPUTE
    /// (e.g. HOLD_AFTER_BWD -> FREE once its gradient is consumed). Not a moment. Bytes
    /// are kept whatever the state.
    pub fn set_state(&mut self, tensor: TensorId, list: ListKind, to: TensorState) -> Result<()> {
        let local = self.local(tensor, list)?;
        let chunk = self.location(tensor, list)?.chunk;
        let ls = self.list_states(list);
        let from = ls.table.state(TensorId(local)).unwrap_or(TensorState::Free);
        if from == TensorState::Compute || to == TensorState::Compute {
            return Err(ChunkError::IllegalTransition {
                tensor: self.name(tensor),
                chunk,
                from,
                to,
            });
        }
        ls.table.transition(TensorId(local), to).map(|_| ())
    }

    /// Whether `g` names the current access of its tensor in this store.
    fn check_guard(&self, g: &Guard) -> Result<()> {
        let current = g.store == self.id
            && self.lists[g.list as usize].as_ref().is_some_and(|ls| {
                let local = ls.local.get(g.tensor.index()).copied().unwrap_or(u32::MAX) as usize;
                ls.table.state(TensorId(local as u32)) == Some(TensorState::Compute)
                    && ls.place.get(local).copied().flatten() == Some(g.place)
                    && ls.generation.get(local) == Some(&g.generation)
            });
        if current {
            Ok(())
        } else {
            Err(ChunkError::StaleGuard {
                tensor: self.name(g.tensor),
                list: g.list,
                chunk: g.chunk,
            })
        }
    }

    fn lost(&self, g: &Guard) -> ChunkError {
        ChunkError::BadView {
            tensor: self.name(g.tensor),
            reason: "its chunk is not resident (store bug)",
        }
    }

    /// A read-only view of an accessed tensor.
    pub fn view(&self, g: &Guard) -> Result<TensorView<'_>> {
        self.check_guard(g)?;
        let slot = &self.mover.slots[g.chunk.dense()];
        let range = g.offset_bytes..g.offset_bytes + g.len_bytes;
        match g.place {
            Place::Host => {
                let buf = slot.host.as_ref().ok_or_else(|| self.lost(g))?;
                Ok(TensorView::Host(&buf[range]))
            }
            Place::Device => {
                let mem = slot.dev.as_ref().ok_or_else(|| self.lost(g))?;
                Ok(TensorView::Device(match mem.view() {
                    DeviceView::Host(bytes) => DeviceView::Host(&bytes[range]),
                    DeviceView::Cuda(span) => {
                        DeviceView::Cuda(span.get(range).ok_or_else(|| self.lost(g))?)
                    }
                }))
            }
        }
    }

    /// A writable view of an accessed tensor. The chunk counts as changed where the
    /// guard is: its copies on the other tiers are dropped (and written back from here
    /// when it is evicted).
    pub fn view_mut(&mut self, g: &Guard) -> Result<TensorViewMut<'_>> {
        self.check_guard(g)?;
        let c = g.chunk;
        match g.place {
            Place::Host => self.mover.dirty_on_host(c),
            Place::Device => self.mover.dirty_on_device(c),
        }
        let lost = self.lost(g);
        let slot = &mut self.mover.slots[c.dense()];
        let range = g.offset_bytes..g.offset_bytes + g.len_bytes;
        match g.place {
            Place::Host => {
                let buf = slot.host.as_mut().ok_or(lost)?;
                Ok(TensorViewMut::Host(&mut buf[range]))
            }
            Place::Device => {
                let mem = slot.dev.as_mut().ok_or(lost.clone())?;
                Ok(TensorViewMut::Device(match mem.view_mut() {
                    DeviceViewMut::Host(bytes) => DeviceViewMut::Host(&mut bytes[range]),
                    DeviceViewMut::Cuda(span) => DeviceViewMut::Cuda(span.get(range).ok_or(lost)?),
                }))
            }
        }
    }

    /// Writable views of several accessed tensors at once, in the order of `guards`
    /// (in different chunks or in one, on either tier where host-addressable). Every
    /// chunk counts as changed where its guard is (see [`ChunkStore::view_mut`]).
    /// Errors: [`ChunkError::OverlappingViews`] when two guards' bytes overlap (the
    /// same tensor twice included), [`ChunkError::StaleGuard`] for a guard no longer in
    /// use, [`ChunkError::BadView`] for GPU memory.
    pub fn views_mut(&mut self, guards: &[&Guard]) -> Result<Vec<&mut [u8]>> {
        self.views_mut_with_io(guards).map(|(views, _)| views)
    }

    /// As [`ChunkStore::views_mut`], with an [`IoPump`] to keep the store's NVMe
    /// transfers (prefetches, write-backs) moving while the views are in use: poll it
    /// between pieces of work.
    pub fn views_mut_with_io(&mut self, guards: &[&Guard]) -> Result<(Vec<&mut [u8]>, IoPump<'_>)> {
        for g in guards {
            self.check_guard(g)?;
            if g.place == Place::Device && self.mover.device.kind() == DeviceKind::Cuda {
                return Err(self.not_addressable(g));
            }
        }
        let lost = self.lost_any(guards);
        let (views, pump) = self.tensor_views_mut_with_io(guards)?;
        let bytes = views
            .into_iter()
            .map(|v| match v {
                TensorViewMut::Host(b) | TensorViewMut::Device(DeviceViewMut::Host(b)) => Ok(b),
                TensorViewMut::Device(DeviceViewMut::Cuda(_)) => Err(lost.clone()),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((bytes, pump))
    }

    /// Writable views of several accessed tensors at once, wherever they are: host
    /// bytes for the host pool and the simulated device, device pointers on a GPU (for
    /// kernels), in the order of `guards`, with an [`IoPump`] as in
    /// [`ChunkStore::views_mut_with_io`]. Every chunk counts as changed where its guard
    /// is. Errors: [`ChunkError::OverlappingViews`] when two guards' bytes overlap,
    /// [`ChunkError::StaleGuard`] for a guard no longer in use.
    pub fn tensor_views_mut_with_io(
        &mut self,
        guards: &[&Guard],
    ) -> Result<(Vec<TensorViewMut<'_>>, IoPump<'_>)> {
        for g in guards {
            self.check_guard(g)?;
        }
        // Sorted by (chunk, offset): overlaps are between neighbours.
        let mut order: Vec<usize> = (0..guards.len()).collect();
        order.sort_by_key(|&i| (guards[i].chunk.dense(), guards[i].offset_bytes));
        for w in order.windows(2) {
            let (a, b) = (guards[w[0]], guards[w[1]]);
            if a.chunk == b.chunk && a.offset_bytes + a.len_bytes > b.offset_bytes {
                return Err(ChunkError::OverlappingViews {
                    first: self.name(a.tensor),
                    second: self.name(b.tensor),
                    chunk: a.chunk,
                });
            }
        }
        let lost = self.lost_any(guards);
        for g in guards {
            match g.place {
                Place::Host => self.mover.dirty_on_host(g.chunk),
                Place::Device => self.mover.dirty_on_device(g.chunk),
            }
        }
        let (slots, pump) = self.mover.pump_parts();
        let mut out: Vec<Option<TensorViewMut<'_>>> = (0..guards.len()).map(|_| None).collect();
        let mut k = 0;
        for (d, slot) in slots.iter_mut().enumerate() {
            if k == order.len() {
                break;
            }
            let first = guards[order[k]];
            if first.chunk.dense() != d {
                continue;
            }
            // A chunk's guards all name one place (a chunk is accessed where it is).
            let mut rest: Region<'_> = match first.place {
                Place::Host => match slot.host.as_mut() {
                    Some(buf) => Region::Host(&mut buf[..], false),
                    None => return Err(lost),
                },
                Place::Device => match slot.dev.as_mut().map(|m| m.view_mut()) {
                    Some(DeviceViewMut::Host(bytes)) => Region::Host(bytes, true),
                    Some(DeviceViewMut::Cuda(span)) => Region::Cuda(Some(span)),
                    None => return Err(lost),
                },
            };
            let mut consumed = 0;
            while k < order.len() && guards[order[k]].chunk.dense() == d {
                let i = order[k];
                let g = guards[i];
                if g.place != first.place {
                    return Err(lost);
                }
                let skip = g.offset_bytes - consumed;
                match &mut rest {
                    Region::Host(bytes, on_device) => {
                        if skip + g.len_bytes > bytes.len() {
                            return Err(lost);
                        }
                        let (_, tail) = std::mem::take(bytes).split_at_mut(skip);
                        let (view, tail) = tail.split_at_mut(g.len_bytes);
                        out[i] = Some(if *on_device {
                            TensorViewMut::Device(DeviceViewMut::Host(view))
                        } else {
                            TensorViewMut::Host(view)
                        });
                        *bytes = tail;
                    }
                    Region::Cuda(span) => {
                        let (view, tail) = span
                            .take()
                            .and_then(|s| s.split_at(skip))
                            .and_then(|(_, tail)| tail.split_at(g.len_bytes))
                            .ok_or(lost.clone())?;
                        out[i] = Some(TensorViewMut::Device(DeviceViewMut::Cuda(view)));
                        *span = Some(tail);
                    }
                }
                consumed = g.offset_bytes + g.len_bytes;
                k += 1;
            }
        }
        let views = out.into_iter().collect::<Option<Vec<_>>>().ok_or(lost)?;
        Ok((views, pump))
    }

    fn lost_any(&self, guards: &[&Guard]) -> ChunkError {
        ChunkError::BadView {
            tensor: guards
                .first()
                .map_or_else(String::new, |g| self.name(g.tensor)),
            reason: "its chunk is not resident (store bug)",
        }
    }

    /// The accessed tensor's bytes where they are host-addressable (the host pool, or
    /// the simulated device); [`ChunkError::BadView`] for GPU memory.
    pub fn bytes(&self, g: &Guard) -> Result<&[u8]> {
        match self.view(g)? {
            TensorView::Host(b) | TensorView::Device(DeviceView::Host(b)) => Ok(b),
            TensorView::Device(DeviceView::Cuda(_)) => Err(self.not_addressable(g)),
        }
    }

    /// Writable host-addressable bytes (see [`ChunkStore::bytes`] and
    /// [`ChunkStore::view_mut`]).
    pub fn bytes_mut(&mut self, g: &Guard) -> Result<&mut [u8]> {
        let err = self.not_addressable(g);
        match self.view_mut(g)? {
            TensorViewMut::Host(b) | TensorViewMut::Device(DeviceViewMut::Host(b)) => Ok(b),
            TensorViewMut::Device(DeviceViewMut::Cuda(_)) => Err(err),
        }
    }

    fn not_addressable(&self, g: &Guard) -> ChunkError {
        ChunkError::BadView {
            tensor: self.name(g.tensor),
            reason: "GPU memory is not host-addressable; use the device view",
        }
    }

    /// The accessed tensor's elements as `f32` (converted from f16/bf16).
    pub fn read_f32(&self, g: &Guard) -> Result<Vec<f32>> {
        let bytes = self.bytes(g)?;
        let mut out = vec![0.0; bytes.len() / g.dtype.size_bytes() as usize];
        crate::typed::decode_f32(bytes, g.dtype, &mut out);
        Ok(out)
    }

    /// Writes `values` into the accessed tensor (converted to its dtype).
    pub fn write_f32(&mut self, g: &Guard, values: &[f32]) -> Result<()> {
        self.check_guard(g)?;
        let expected = g.len_bytes as u64;
        let got = values.len() as u64 * g.dtype.size_bytes();
        if expected != got {
            return Err(ChunkError::LengthMismatch {
                tensor: self.name(g.tensor),
                expected_bytes: expected,
                got_bytes: got,
            });
        }
        let dtype = g.dtype;
        let bytes = self.bytes_mut(g)?;
        crate::typed::encode_f32(values, dtype, bytes);
        Ok(())
    }

    // ------------------------------------------------------------- scoped access

    /// Accesses every `(tensor, list, place)` of `tensors` in order, runs `f` on
    /// writable views of them all (in that order, wherever they are, as
    /// [`ChunkStore::tensor_views_mut_with_io`] gives them) with an [`IoPump`], and
    /// releases every one to `to` on every path: when `f` returns (whatever it returns,
    /// an `Err` of its own included), when an access or the views fail part way (the
    /// tensors accessed so far are released), and when `f` panics (every tensor is
    /// released, then the panic goes on). Every chunk counts as changed where it is
    /// accessed. Accesses and releases are moments of the trace, as with
    /// [`ChunkStore::access`] / [`ChunkStore::release`].
    ///
    /// Errors: `to` not a state COMPUTE may go to (nothing is accessed); the first
    /// access or view error; a release error (a broken invariant; `f`'s result is then
    /// dropped).
    pub fn with_access<R>(
        &mut self,
        tensors: &[(TensorId, ListKind, Place)],
        to: TensorState,
        f: impl FnOnce(&mut [TensorViewMut<'_>], &mut IoPump<'_>) -> R,
    ) -> Result<R> {
        let guards = self.access_all(tensors, to)?;
        let outcome = {
            let refs: Vec<&Guard> = guards.iter().collect();
            self.tensor_views_mut_with_io(&refs)
                .map(|(mut views, mut pump)| {
                    catch_unwind(AssertUnwindSafe(|| f(&mut views, &mut pump)))
                })
        };
        self.end_scope(guards, to, outcome)
    }

    /// As [`ChunkStore::with_access`], for tensors accessed in the host pool, with their
    /// bytes as plain slices (in the order of `tensors`).
    pub fn with_host_views<R>(
        &mut self,
        tensors: &[(TensorId, ListKind)],
        to: TensorState,
        f: impl FnOnce(&mut [&mut [u8]]) -> R,
    ) -> Result<R> {
        let at_host: Vec<(TensorId, ListKind, Place)> =
            tensors.iter().map(|&(t, l)| (t, l, Place::Host)).collect();
        let guards = self.access_all(&at_host, to)?;
        let outcome = {
            let refs: Vec<&Guard> = guards.iter().collect();
            self.views_mut(&refs)
                .map(|mut views| catch_unwind(AssertUnwindSafe(|| f(&mut views))))
        };
        self.end_scope(guards, to, outcome)
    }

    /// Accesses every tensor of a scope, releasing (to `to`) the ones accessed before an
    /// access that fails. `to` is checked first.
    fn access_all(
        &mut self,
        tensors: &[(TensorId, ListKind, Place)],
        to: TensorState,
    ) -> Result<Vec<Guard>> {
        if let Some(&(tensor, list, _)) = tensors.first() {
            if to == TensorState::Compute || !TensorState::Compute.can_become(to) {
                return Err(ChunkError::IllegalTransition {
                    tensor: self.name(tensor),
                    chunk: self.location(tensor, list)?.chunk,
                    from: TensorState::Compute,
                    to,
                });
            }
        }
        let mut guards = Vec::with_capacity(tensors.len());
        for &(tensor, list, place) in tensors {
            match self.access(tensor, list, place) {
                Ok(g) => guards.push(g),
                Err(e) => {
                    if let Err(r) = self.release_all(guards, to) {
                        tracing::error!(error = %r, "chunk store: releasing a scope after a failed access");
                    }
                    return Err(e);
                }
            }
        }
        Ok(guards)
    }

    /// Releases every guard of a scope (all of them, whatever fails), returning the
    /// first error.
    fn release_all(&mut self, guards: Vec<Guard>, to: TensorState) -> Result<()> {
        let mut first = Ok(());
        for g in guards {
            if let Err(e) = self.release(g, to) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// Ends a scope: releases its guards, then returns `f`'s result, the views' error,
    /// or resumes `f`'s panic.
    fn end_scope<R>(
        &mut self,
        guards: Vec<Guard>,
        to: TensorState,
        outcome: Result<std::thread::Result<R>>,
    ) -> Result<R> {
        let released = self.release_all(guards, to);
        match outcome {
            Ok(Ok(r)) => released.map(|()| r),
            Ok(Err(panic)) => {
                if let Err(e) = released {
                    tracing::error!(error = %e, "chunk store: releasing a scope after a panic");
                }
                resume_unwind(panic)
            }
            Err(e) => {
                if let Err(r) = released {
                    tracing::error!(error = %r, "chunk store: releasing a scope after a view error");
                }
                Err(e)
            }
        }
    }

    // ------------------------------------------------------------- untraced I/O

    /// Puts `data` (the tensor's bytes in `list`) into a tensor not in COMPUTE, through
    /// the host pool; not a moment of the trace. A FREE tensor becomes HOLD.
    pub fn write(&mut self, tensor: TensorId, list: ListKind, data: &[u8]) -> Result<()> {
        let loc = self.location(tensor, list)?;
        let local = self.local(tensor, list)?;
        if data.len() as u64 != loc.bytes() {
            return Err(ChunkError::LengthMismatch {
                tensor: self.name(tensor),
                expected_bytes: loc.bytes(),
                got_bytes: data.len() as u64,
            });
        }
        let chunk = loc.chunk;
        let from = self.list_states(list).table.state(TensorId(local));
        if from == Some(TensorState::Compute) {
            return Err(ChunkError::BadView {
                tensor: self.name(tensor),
                reason: "the tensor is in COMPUTE: write through its guard",
            });
        }
        if self.mover.slots[chunk.dense()].dev_pins > 0 {
            return Err(ChunkError::PinnedElsewhere {
                tensor: self.name(tensor),
                chunk,
                pinned_on: TierKind::Device,
            });
        }
        self.mover.moment = self.current_moment();
        self.mover.ensure_host(chunk)?;
        self.mover.dirty_on_host(chunk);
        let off = loc.offset_bytes() as usize;
        let buf = self.mover.slots[chunk.dense()]
            .host
            .as_mut()
            .ok_or_else(host_copy_missing)?;
        buf[off..off + data.len()].copy_from_slice(data);
        if from == Some(TensorState::Free) {
            self.list_states(list)
                .table
                .transition(TensorId(local), TensorState::Hold)?;
        }
        Ok(())
    }

    /// The tensor's bytes in `list` (zeros if never written), read through the host
    /// pool; not a moment of the trace.
    pub fn read(&mut self, tensor: TensorId, list: ListKind) -> Result<Vec<u8>> {
        let loc = self.location(tensor, list)?;
        let chunk = loc.chunk;
        self.mover.moment = self.current_moment();
        self.mover.ensure_host(chunk)?;
        let off = loc.offset_bytes() as usize;
        let len = loc.bytes() as usize;
        let buf = self.mover.slots[chunk.dense()]
            .host
            .as_ref()
            .ok_or_else(host_copy_missing)?;
        Ok(buf[off..off + len].to_vec())
    }

    // ------------------------------------------------------------- iterations

    /// Reports the device memory used by everything but chunks now (activations,
    /// workspace). On a GPU it is measured instead; this value is the fallback.
    pub fn report_non_model_bytes(&mut self, bytes: u64) {
        self.non_model_reported_bytes = bytes;
        self.mover.device.report_non_model_bytes(bytes);
    }

    /// Ends an iteration. After a traced one, the schedule takes over (and its moments
    /// are checked: a moment whose chunks in use exceed its tidal budget is
    /// [`ChunkError::WorkingSetTooLarge`], returned after the schedule is installed).
    /// After a followed one that diverged (or ended early), the next one is traced.
    pub fn end_iteration(&mut self) -> Result<()> {
        self.mover.stats.iterations += 1;
        self.position = 0;
        let mode = std::mem::replace(&mut self.mode, Mode::Tracing(Tracer::new()));
        let mut result = Ok(());
        match mode {
            Mode::Tracing(t) => {
                self.mover.stats.traced_iterations += 1;
                if t.moments().is_empty() {
                    self.warmup.clear();
                    self.device_moments.clear();
                    self.host_moments.clear();
                    return Ok(());
                }
                let moments = t.moments().len();
                let s = Arc::new(t.finish());
                tracing::info!(
                    moments,
                    "chunk store: iteration traced; following its schedule"
                );
                result = self.check_traced(&s);
                self.warmup.clear();
                let mut groups: Vec<Vec<ChunkId>> = std::mem::take(&mut self.device_moments)
                    .into_iter()
                    .map(|c| c.into_iter().collect())
                    .collect();
                groups.resize(moments, Vec::new());
                let non_model: Vec<u64> =
                    (0..moments as u32).map(|m| s.non_model_bytes(m)).collect();
                let ds = Arc::new(Schedule::from_groups(&groups, &non_model));
                self.device_schedule = Some(ds.clone());
                let mut host_groups: Vec<Vec<ChunkId>> = std::mem::take(&mut self.host_moments)
                    .into_iter()
                    .map(|c| c.into_iter().collect())
                    .collect();
                host_groups.resize(moments, Vec::new());
                self.host_schedule =
                    Some(Arc::new(Schedule::from_groups(&host_groups, &non_model)));
                if self.settings.policy == PolicyKind::Lifetime {
                    self.mover
                        .dev_policy
                        .set_main(Box::new(Lifetime::new(ds, Horizon::Cyclic)));
                    self.mover
                        .host_policy
                        .set_main(Box::new(Lifetime::new(s.clone(), Horizon::Cyclic)));
                }
                self.mover.schedule = Some(s.clone());
                self.follower = Follower::new(self.settings.slack_bytes);
                self.cycles = 0;
                self.mode = Mode::Following(s);
            }
            Mode::Following(s) => {
                let early = self.follower.end_iteration(&s);
                if early.is_some() {
                    self.mover.stats.divergences += 1;
                }
                if self.diverged || early.is_some() {
                    tracing::info!(
                        "chunk store: access sequence changed; re-tracing this iteration"
                    );
                    self.mover.schedule = None;
                    self.device_schedule = None;
                    self.host_schedule = None;
                    self.warmup.clear();
                    self.device_moments.clear();
                    self.host_moments.clear();
                } else {
                    self.cycles += 1;
                    self.mode = Mode::Following(s);
                }
            }
        }
        self.diverged = false;
        self.sync_policies();
        result
    }

    fn check_traced(&self, s: &Schedule) -> Result<()> {
        for &(m, pinned, phase) in &self.warmup {
            let cap = self.cap_for(Some(s), u64::from(m), phase, s.non_model_bytes(m));
            if pinned > cap {
                return Err(ChunkError::WorkingSetTooLarge {
                    moment: u64::from(m),
                    needed_bytes: pinned,
                    capacity_bytes: cap,
                    short_bytes: pinned - cap,
                });
            }
        }
        Ok(())
    }

    /// Lets chunks use nearly the whole device (less the margin and the non-model
    /// memory now) until [`ChunkStore::end_optimizer_step`].
    pub fn begin_optimizer_step(&mut self) -> Result<()> {
        self.phase = Phase::OptimizerStep;
        self.update_tide(self.current_moment())
    }

    /// Back to the tidal forward/backward budget (evicting what no longer fits), and
    /// the device prefetcher starts on the moments that follow.
    pub fn end_optimizer_step(&mut self) -> Result<()> {
        self.phase = Phase::ForwardBackward;
        let next = self.current_moment();
        self.update_tide(next)?;
        // The step's last moments were host accesses, which do not run the device
        // prefetcher: start the loads the next device moments need now, so their NVMe
        // reads (and the write-backs that make room for them) overlap what the caller
        // does before its next access.
        self.prefetch(next.saturating_sub(1));
        Ok(())
    }

    // ------------------------------------------------------------- prefetch

    fn prefetch(&mut self, now: u64) {
        if self.settings.lookahead == 0 || self.diverged || self.is_tracing() {
            return;
        }
        let Some(s) = &self.device_schedule else {
            return;
        };
        let dev_mark = &self.mover.dev_mark;
        if !needs_any(s, now, self.settings.lookahead, |c| !dev_mark[c.dense()]) {
            return;
        }
        let s = s.clone();
        if let Err(e) = self.prefetch_planned(&s, now) {
            tracing::warn!(error = %e, "chunk store: prefetch stopped; demand loads will retry");
        }
        self.mover.reason = MoveReason::Demand;
    }

    fn prefetch_planned(&mut self, s: &Schedule, now: u64) -> Result<()> {
        self.mover.harvest()?;
        let evictable: Vec<ChunkId> = self
            .mover
            .dev_list
            .iter()
            .copied()
            .filter(|c| self.mover.slots[c.dense()].dev_pins == 0)
            .collect();
        let plan = self.planner.plan(
            s,
            now,
            Residency {
                resident: &self.mover.dev_mark,
                evictable: &evictable,
                chunk_bytes: &self.mover.dev_bytes,
                free_bytes: self.mover.device_free(),
            },
        )?;
        for step in plan {
            for &v in &step.evict {
                self.mover.reason = prefetch_reason(&step, Some((s, v, now)));
                match self.mover.evict_device(v, Some(step.needed_at), step.chunk) {
                    Ok(()) => {}
                    Err(e) if is_no_room(&e) => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
            self.mover.reason = prefetch_reason(&step, None);
            if !self.mover.prefetch_device(step.chunk, step.needed_at)? {
                break;
            }
        }
        Ok(())
    }

    /// The host tier's prefetch: NVMe -> host reads of the chunks the host accesses of
    /// the next moments need, planned by the same [`PrefetchPlanner`] rule as the
    /// device's (a victim is never needed, by any access, before the chunk it makes
    /// room for), within the host pool. Reads run while the caller computes.
    fn prefetch_host(&mut self, now: u64) {
        if self.settings.host_lookahead == 0 || self.diverged || self.is_tracing() {
            return;
        }
        let (Some(hs), Some(s)) = (&self.host_schedule, &self.mover.schedule) else {
            return;
        };
        let mover = &self.mover;
        if !needs_any(hs, now, self.settings.host_lookahead, |c| {
            !mover.host_ready(c)
        }) {
            return;
        }
        let (hs, s) = (hs.clone(), s.clone());
        if let Err(e) = self.prefetch_host_planned(&hs, &s, now) {
            tracing::warn!(error = %e, "chunk store: host prefetch stopped; demand loads will retry");
        }
        self.mover.reason = MoveReason::Demand;
    }

    fn prefetch_host_planned(&mut self, hs: &Schedule, s: &Schedule, now: u64) -> Result<()> {
        self.mover.harvest()?;
        let resident: Vec<bool> = (0..self.mover.slots.len())
            .map(|d| self.mover.host_ready(ChunkId::from_dense(d)))
            .collect();
        // Chunks in use cannot go now, but may be what Belady's rule would evict when a
        // load is needed (see `plan_split`).
        let (held, evictable): (Vec<ChunkId>, Vec<ChunkId>) = self
            .mover
            .host_list
            .iter()
            .partition(|c| self.mover.slots[c.dense()].host_pins > 0);
        let budget = self.mover.host.budget();
        let plan = self.host_planner.plan_split(
            hs,
            s,
            now,
            Residency {
                resident: &resident,
                evictable: &evictable,
                chunk_bytes: &self.host_chunk_bytes,
                // Buffers of write-backs in flight count as free: they return soon, and
                // evicting more instead would write (and later read) chunks for nothing.
                free_bytes: budget
                    .capacity_bytes()
                    .saturating_sub(budget.used_bytes())
                    .saturating_add(self.mover.host_bytes_writing()),
            },
            &held,
        )?;
        let mut started = false;
        for step in plan {
            for &v in &step.evict {
                self.mover.reason = prefetch_reason(&step, Some((s, v, now)));
                match self.mover.evict_host(v, false) {
                    Ok(()) => {}
                    Err(e) if is_no_room(&e) => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
            self.mover.reason = prefetch_reason(&step, None);
            if !self.mover.prefetch_host(step.chunk)? {
                break;
            }
            started = true;
        }
        if started {
            // Submitted requests start at the engine's next poll.
            self.mover.harvest()?;
        }
        Ok(())
    }

    // ------------------------------------------------------------- whole-store

    /// Moves the store's transfers on without waiting: finished NVMe reads and writes
    /// and device copies are taken in, and queued requests started. The store's I/O
    /// advances only inside its calls, so a caller whose own work runs for a while (a
    /// device computing) calls this now and then to keep the disk busy.
    pub fn poll_io(&mut self) -> Result<()> {
        self.mover.harvest()
    }

    /// Checks the store's invariants: per chunk, its device and host pins equal its
    /// tensors in COMPUTE there, and it is pinned on one tier at most, where its copy is
    /// ready; every tensor in COMPUTE has a place and no other does; the device bytes
    /// pinned; and the mover's own (copies vs transfers in flight, the lists the
    /// policies see, each tier's bytes in use equal to the copies it holds and within
    /// its budget, the swap file's chunks vs the slots that claim them). The first
    /// broken one is [`ChunkError::Invariant`] naming the chunk and what disagrees.
    /// Cheap enough for tests to call after every operation; changes nothing.
    pub fn verify(&self) -> Result<()> {
        self.mover.verify()?;
        let n = self.mover.slots.len();
        let mut dev_pins = vec![0u32; n];
        let mut host_pins = vec![0u32; n];
        for list in ListKind::ALL {
            let Some(ls) = self.lists[list as usize].as_ref() else {
                continue;
            };
            for (local, place) in ls.place.iter().enumerate() {
                let id = TensorId(local as u32);
                let (Some(state), Some(chunk)) = (ls.table.state(id), ls.table.chunk_of(id)) else {
                    return Err(ChunkError::Invariant {
                        chunk: None,
                        what: format!("list {list}: tensor {local} has no state or chunk"),
                    });
                };
                let pins = match place {
                    Some(Place::Device) => &mut dev_pins,
                    Some(Place::Host) => &mut host_pins,
                    None if state != TensorState::Compute => continue,
                    None => {
                        return Err(ChunkError::Invariant {
                            chunk: Some(chunk),
                            what: format!("list {list}: tensor {local} in COMPUTE without a place"),
                        })
                    }
                };
                if state != TensorState::Compute {
                    return Err(ChunkError::Invariant {
                        chunk: Some(chunk),
                        what: format!("list {list}: tensor {local} has a place but is {state}"),
                    });
                }
                pins[chunk.dense()] += 1;
            }
            for chunk in self.layout.chunks(list) {
                let d = chunk.dense();
                let computing = ls.table.count(chunk, TensorState::Compute);
                if computing != dev_pins[d] + host_pins[d] {
                    return Err(ChunkError::Invariant {
                        chunk: Some(chunk),
                        what: format!(
                            "state table counts {computing} tensors in COMPUTE, their places {}",
                            dev_pins[d] + host_pins[d]
                        ),
                    });
                }
            }
        }
        let mut pinned_device_bytes = 0;
        for (d, slot) in self.mover.slots.iter().enumerate() {
            if (slot.dev_pins, slot.host_pins) != (dev_pins[d], host_pins[d]) {
                return Err(ChunkError::Invariant {
                    chunk: Some(ChunkId::from_dense(d)),
                    what: format!(
                        "pins (device {}, host {}) but tensors in COMPUTE (device {}, host {})",
                        slot.dev_pins, slot.host_pins, dev_pins[d], host_pins[d]
                    ),
                });
            }
            if slot.dev_pins > 0 {
                pinned_device_bytes += self.mover.dev_bytes[d];
            }
        }
        if pinned_device_bytes != self.pinned_device_bytes {
            return Err(ChunkError::Invariant {
                chunk: None,
                what: format!(
                    "{} device bytes counted pinned, the pinned chunks take {pinned_device_bytes}",
                    self.pinned_device_bytes
                ),
            });
        }
        Ok(())
    }

    /// Waits for every transfer in flight.
    pub fn sync(&mut self) -> Result<()> {
        self.mover.wait_all()
    }

    /// Moves every chunk not in use off the device (written back where the device copy
    /// is the only current one).
    pub fn evict_device_all(&mut self) -> Result<()> {
        self.mover.wait_all()?;
        self.mover.reason = MoveReason::Explicit;
        let victims: Vec<ChunkId> = self
            .mover
            .dev_list
            .iter()
            .copied()
            .filter(|c| self.mover.slots[c.dense()].dev_pins == 0)
            .collect();
        let mut result = Ok(());
        for v in victims {
            if let Err(e) = self.mover.evict_device(v, None, v) {
                result = Err(e);
                break;
            }
        }
        self.mover.reason = MoveReason::Demand;
        result
    }
}

impl ChunkStore {
    /// Closes the store cleanly: waits for every transfer, writes every chunk whose NVMe
    /// copy is not current (from its device or host copy) to NVMe, syncs, and marks the
    /// swap file clean, so that a store opened later on it with [`StoreConfig::adopt`]
    /// gets these bytes back. Tensors still in COMPUTE do not stop it (their bytes are
    /// written as they are). It needs an NVMe slot for every chunk ever written
    /// ([`ChunkError::TierFull`] for the NVMe tier otherwise). On any error the file
    /// stays not clean; so does a store dropped without `close`.
    pub fn close(mut self) -> Result<()> {
        self.mover.wait_all()?;
        self.verify()?;
        let n = self.mover.slots.len();
        let kept: Vec<ChunkId> = (0..n)
            .filter(|&d| {
                let s = &self.mover.slots[d];
                self.mover.len_bytes[d] > 0
                    && (s.nvme_stored || s.host.is_some() || s.dev.is_some())
            })
            .map(ChunkId::from_dense)
            .collect();
        let slot_count = self.mover.nvme.slot_count() as usize;
        if kept.len() > slot_count {
            let slot_bytes = self.mover.nvme.slot_bytes() as u64;
            return Err(ChunkError::TierFull {
                tier: TierKind::Nvme,
                chunk: kept[slot_count],
                needed_bytes: kept.len() as u64 * slot_bytes,
                capacity_bytes: slot_count as u64 * slot_bytes,
            });
        }
        self.mover.reason = MoveReason::Explicit;
        for &c in &kept {
            self.mover.write_back(c)?;
        }
        self.mover.wait_all()?;
        for &c in &kept {
            if !self.mover.slots[c.dense()].nvme_valid {
                return Err(ChunkError::Invariant {
                    chunk: Some(c),
                    what: "NVMe copy not current after writing every chunk back".into(),
                });
            }
        }
        self.mover
            .nvme
            .mark_clean()
            .map_err(|e| ChunkError::tier("marking the swap file clean", None, e))?;
        tracing::info!(chunks = kept.len(), "chunk store closed cleanly");
        Ok(())
    }
}

impl Drop for ChunkStore {
    fn drop(&mut self) {
        if let Err(e) = self.mover.wait_all() {
            tracing::warn!(error = %e, "chunk store: a transfer failed while closing");
        }
    }
}

/// A chunk [`Mover::ensure_host`] just loaded has no host copy: a store bug, as an error.
fn host_copy_missing() -> ChunkError {
    ChunkError::BadView {
        tensor: String::new(),
        reason: "host copy missing after load (store bug)",
    }
}

/// Whether any chunk used in the `lookahead` moments after `now` (wrapping around the
/// traced iteration) satisfies `missing`: the cheap test that decides whether a prefetch
/// planner needs to run at all.
fn needs_any(
    schedule: &Schedule,
    now: u64,
    lookahead: u32,
    mut missing: impl FnMut(ChunkId) -> bool,
) -> bool {
    let len = u64::from(schedule.len());
    len != 0
        && (1..=u64::from(lookahead)).any(|k| {
            schedule
                .chunks_at(((now + k) % len) as u32)
                .iter()
                .any(|&c| missing(c))
        })
}

/// The reason recorded for a prefetch's moves: the load of `step.chunk` itself (`victim`
/// `None`), or the eviction of a victim, with the victim's next use on `schedule` after
/// `now` (`u64::MAX` when it is not used again).
fn prefetch_reason(step: &PrefetchStep, victim: Option<(&Schedule, ChunkId, u64)>) -> MoveReason {
    let victim_next_use = victim
        .and_then(|(schedule, v, now)| schedule.next_use_from(v, now + 1, Horizon::Cyclic))
        .unwrap_or(u64::MAX);
    MoveReason::Prefetch {
        for_chunk: step.chunk,
        needed_at: step.needed_at,
        victim_next_use,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{LayoutConfig, TensorSpec};
    use tidestore_tiers::DeviceConfig;

    fn store(dir: &tempfile::TempDir) -> ChunkStore {
        let layout = Layout::new(
            LayoutConfig::new(2048),
            (0..4).map(|i| TensorSpec::new(format!("t{i}"), &[2048], DType::F16, true)),
        )
        .unwrap();
        let slot = 8192;
        let cfg = StoreConfig::new(
            2 * slot,
            3 * slot,
            NvmeSource::Dir {
                dir: dir.path().to_path_buf(),
                bytes: 32 * slot,
                io: tidestore_io::IoConfig::default(),
            },
        );
        let device = Device::sim(&DeviceConfig::new(4 * slot)).unwrap();
        ChunkStore::open(layout, cfg, device).unwrap()
    }

    fn broken(store: &ChunkStore, chunk: ChunkId, what: &str) {
        match store.verify() {
            Err(ChunkError::Invariant { chunk: c, what: w }) => {
                assert_eq!(c, Some(chunk), "{w}");
                assert!(w.contains(what), "{w}");
            }
            other => panic!("expected a broken invariant ({what}), got {other:?}"),
        }
    }

    /// The failure: `verify` passing over the bugs it exists to find (a pin count that
    /// drifted from the tensors in COMPUTE, a copy the policies cannot see).
    #[test]
    fn verify_names_the_chunk_and_what_disagrees() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(&dir);
        let g = s
            .access(TensorId(1), ListKind::Param16, Place::Device)
            .unwrap();
        s.verify().unwrap();
        let c = g.chunk();
        s.mover.slots[c.dense()].dev_pins += 1;
        broken(&s, c, "pins (device 2, host 0)");
        s.mover.slots[c.dense()].dev_pins -= 1;
        s.verify().unwrap();
        s.release(g, TensorState::Hold).unwrap();

        let g = s
            .access(TensorId(2), ListKind::MasterF32, Place::Host)
            .unwrap();
        let c = g.chunk();
        s.mover.host_list.retain(|&x| x != c);
        broken(&s, c, "host list");
        s.mover.host_list.push(c);
        // A release whose chunk lost its pin is refused and changes nothing.
        s.mover.slots[c.dense()].host_pins = 0;
        let err = s.release_tensor(TensorId(2), ListKind::MasterF32, TensorState::Hold);
        assert!(matches!(err, Err(ChunkError::Invariant { .. })), "{err:?}");
        assert_eq!(
            s.state(TensorId(2), ListKind::MasterF32),
            Some(TensorState::Compute)
        );
        s.mover.slots[c.dense()].host_pins = 1;
        s.release(g, TensorState::Hold).unwrap();
        s.verify().unwrap();
    }
}
