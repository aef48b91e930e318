//! The chunk store: tensors whose bytes live on the device, in the pinned host pool or
//! on NVMe, and move just in time.
//!
//! [`ChunkStore::open`] takes a [`Layout`], a [`StoreConfig`](crate::config::StoreConfig) and a [`Device`]; it
//! checks the budgets against the layout (see [`crate::config`]) before it allocates the
//! host pool or the swap file. Then, per iteration:
//! - [`ChunkStore::access`] makes a tensor's chunk current where asked (the device for
//!   compute, the host for CPU work), loading it NVMe -> host -> device and evicting by
//!   the configured policy when a tier is full, and returns a [`Guard`];
//!   [`ChunkStore::view`] / [`ChunkStore::view_mut`] give its bytes (host slices, or a
//!   device view), `view_mut` marking the chunk changed there;
//!   [`ChunkStore::release`] ends the use (COMPUTE -> HOLD / HOLD_AFTER_FWD /
//!   HOLD_AFTER_BWD, by the [`StateTable`](crate::state::StateTable) rules). A chunk with a tensor in COMPUTE is
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
//! one is refused ([`ChunkError::StaleGuard`](crate::error::ChunkError::StaleGuard)) and changes nothing.
//!
//! [`ChunkStore::write`] and [`ChunkStore::read`] put bytes into a tensor and take them
//! out without being moments of the trace (initialisation, checkpoints). A chunk never
//! written reads as zeros — also on a swap file an earlier store left, whose chunks are
//! dropped unless [`StoreConfig::adopt`](crate::config::StoreConfig::adopt) asks for them (and then only from a file of the
//! same layout fingerprint, closed by [`ChunkStore::close`]).
//! [`ChunkStore::stats`] returns the accounting; [`ChunkStore::verify`] checks every
//! invariant and reports the first broken one rather than repairing it.
//!
//! Not thread-safe by itself (`&mut self` everywhere); it is `Send`, so it can live
//! behind a mutex or on a dedicated thread.
//!
//! # Files, one concept each
//! - `access`: the access path, top to bottom (may it be used there, the moment, the
//!   tide, where the chunk is — made current by the mover's load path —, pin, state,
//!   warm-up record, prefetch), and release;
//! - `guard`: [`Guard`] and the stale-guard check; `scope`: scoped access;
//! - `views`: views of accessed tensors, one or several at once;
//! - `lists`: per list, the tensors' states, places and access generations;
//! - `trace`: tracing the first iteration, following its schedule, divergence;
//! - `tide`: the device budget at each moment and phase;
//! - `prefetch`: prefetch planning on the device and host tiers;
//! - `io`: untraced reads and writes; `open`: opening a store; `whole`: poll, sync,
//!   evict all, close; `verify`: the store's invariants.

mod access;
mod guard;
mod io;
mod list_states;
mod lists;
mod mode;
mod open;
mod prefetch;
mod scope;
mod tide;
mod trace;
mod verify;
mod views;
mod whole;

use tidestore_tiers::{Device, NvmeTier};

use crate::accounting::MoveReason;
use crate::accounting::{MoveHook, StoreStats, TierSnapshot};
use crate::config::CapacityPlan;
use crate::id::ChunkId;
use crate::layout::Layout;
pub use crate::mover::ChunkResidency;
use crate::mover::{Cause, Mover};
use crate::planner::PrefetchPlanner;
use crate::policy::PolicyKind;
use crate::tracer::Follower;

pub use crate::place::Place;
pub use guard::Guard;
use list_states::ListStates;
use mode::Mode;
pub use tide::Phase;
pub use views::{TensorView, TensorViewMut};

/// The swap file's name inside [`NvmeSource::Dir`](crate::config::NvmeSource::Dir).
pub const SWAP_FILE_NAME: &str = "tidestore-chunks.swap";

/// Store ids, so that a guard of one store is stale in every other.
static NEXT_STORE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

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

/// The counters the store keeps itself; the mover keeps those of the moves, and
/// [`ChunkStore::stats`] reports both.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    accesses: u64,
    iterations: u64,
    traced_iterations: u64,
    divergences: u64,
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
    counts: Counts,
    /// The moment the mover's moves are dated at (see [`Cause`]): the latest access or
    /// release, or the next moment for untraced reads and writes.
    moment: u64,
    non_model_reported_bytes: u64,
    device_bytes: DeviceBytes,
}

/// The device's memory as the tide sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct DeviceBytes {
    /// The whole device (the driver's total), which non-model memory shares with chunks.
    pub(super) total: u64,
    /// The slab chunks live in (at most `total`): no budget for chunks exceeds it.
    pub(super) slab: u64,
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

impl ChunkStore {
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
        self.mover.device()
    }

    /// Whether the host pool is pinned (see [`crate::StoreConfig::pin_host`]).
    pub fn host_pinned(&self) -> bool {
        self.mover.host().is_locked()
    }

    /// The NVMe tier (its swap file and io engine), for reports and tests.
    pub fn nvme(&self) -> &NvmeTier {
        self.mover.nvme()
    }

    /// Every tier's use now.
    pub fn usage(&self) -> TierSnapshot {
        self.mover.snapshot()
    }

    /// Where `chunk`'s current copies are.
    pub fn residency(&self, chunk: ChunkId) -> Option<ChunkResidency> {
        self.mover.residency(chunk)
    }

    /// The accounting, with every tier's capacity, use and peak now.
    pub fn stats(&self) -> StoreStats {
        let mut s = self.mover.stats();
        s.accesses = self.counts.accesses;
        s.iterations = self.counts.iterations;
        s.traced_iterations = self.counts.traced_iterations;
        s.divergences = self.counts.divergences;
        let u = self.mover.snapshot();
        s.device = u.device;
        s.host = u.host;
        s.nvme = u.nvme;
        s
    }

    /// Zeroes the counters and restarts peak tracking from what is in use now.
    pub fn reset_stats(&mut self) {
        self.counts = Counts::default();
        self.mover.reset_stats();
    }

    /// The cause of the moves the store asks of the mover now, for `reason`.
    fn cause(&self, reason: MoveReason) -> Cause {
        Cause {
            moment: self.moment,
            reason,
        }
    }

    /// A demand move now (an access, a read or write, waiting for transfers).
    fn demand(&self) -> Cause {
        self.cause(MoveReason::Demand)
    }

    /// Calls `hook` after every move and eviction (`None` removes it); see
    /// [`crate::accounting`].
    pub fn set_move_hook(&mut self, hook: Option<MoveHook>) {
        self.mover.set_hook(hook);
    }
}
