//! How a chunk store is opened, and the capacity check made before anything is
//! allocated.
//!
//! [`StoreConfig`] names every knob: the device budget for chunks (the most chunks may
//! take outside the optimizer step), the pinned host pool, where the NVMe swap file is
//! (a directory and a size, or an [`NvmeTier`] the caller opened), the eviction policy,
//! prefetch look-ahead, the tidal margin and window, and how many chunks one moment may
//! hold in use at once.
//!
//! [`plan_capacity`] refuses, with the bytes needed and available, budgets that cannot
//! hold one moment's working set and models that do not fit in host + NVMe. It runs in
//! [`crate::ChunkStore::open`] before the host pool or the swap file is made, so an
//! impossible configuration fails before the first iteration. The rules:
//! - the device budget holds the `working_set_chunks` largest chunks (each counted
//!   rounded up to 4096 bytes, as the device budget counts them);
//! - the host pool holds `working_set_chunks + 1` buffers: the chunks a moment may use
//!   on the host, plus one to stage a chunk between the device and NVMe;
//! - every chunk takes one whole host buffer or NVMe slot (both the size of the largest
//!   chunk), and host + NVMe hold every chunk plus one staging slot, so a chunk can
//!   always be read from NVMe even when both are full.

use std::path::PathBuf;

use tidestore_io::{align_up, IoConfig};
use tidestore_tiers::{NvmeTier, TierKind};

use crate::error::ChunkError;
use crate::layout::Layout;
use crate::policy::PolicyKind;
use crate::Result;

/// Where the NVMe tier comes from.
#[derive(Debug)]
pub enum NvmeSource {
    /// A swap file `tidestore-chunks.swap` in `dir`, of `bytes` (whole slots of the
    /// largest chunk). Made if absent; an existing one is emptied (remade if its shape
    /// differs), or adopted with [`StoreConfig::adopt`].
    Dir {
        /// The directory.
        dir: PathBuf,
        /// Bytes of the file's slots.
        bytes: u64,
        /// Block I/O settings.
        io: IoConfig,
    },
    /// A tier opened by the caller (over any engine); the store owns its swap file from
    /// then on. Chunks it already stores are dropped, unless [`StoreConfig::adopt`]
    /// takes them as the store's contents. Boxed: a tier is large and this is moved
    /// once.
    Tier(Box<NvmeTier>),
}

/// Device accesses the device prefetcher looks ahead by default (the benchmarked value).
pub const DEFAULT_PREFETCH_LOOKAHEAD: u32 = 8;
/// Moments the host-tier prefetcher looks ahead by default (the benchmarked value).
pub const DEFAULT_HOST_PREFETCH_LOOKAHEAD: u32 = 512;

/// Everything [`crate::ChunkStore::open`] needs besides the layout and the device.
#[derive(Debug)]
pub struct StoreConfig {
    /// Most device bytes chunks may use during forward/backward; the tidal budget is
    /// never above it.
    pub device_budget_bytes: u64,
    /// Most device bytes chunks may use between `begin_optimizer_step` and
    /// `end_optimizer_step`; `None`: the whole device less the margin and the
    /// non-model memory.
    pub step_device_budget_bytes: Option<u64>,
    /// Bytes of the pinned host pool (whole buffers of the largest chunk).
    pub host_budget_bytes: u64,
    /// The NVMe tier.
    pub nvme: NvmeSource,
    /// The eviction policy of the device and host tiers.
    pub policy: PolicyKind,
    /// Device accesses the device prefetcher looks ahead (0: no prefetch): the next
    /// this many moments at which the device's schedule uses a chunk (the host's
    /// accesses between them do not count).
    pub prefetch_lookahead: u32,
    /// Most bytes of chunks the prefetch window may cover (`u64::MAX`: no bound).
    pub prefetch_lookahead_bytes_max: u64,
    /// Moments the host-tier prefetcher looks ahead on the traced schedule
    /// (NVMe -> host reads started ahead of need, for accesses on either tier, within
    /// the host pool; 0: off).
    pub host_prefetch_lookahead: u32,
    /// Host -> NVMe write-backs forced by eviction run without waiting: the buffer
    /// stays with the I/O until it completes, and the chunk is not used until then.
    pub async_write_back: bool,
    /// Bytes of the device kept free of chunks above the non-model peak.
    pub tidal_margin_bytes: u64,
    /// Moments ahead whose non-model peak the tidal budget leaves room for.
    pub tidal_window: u32,
    /// Non-model bytes above the traced value a later iteration may use before it
    /// counts as a divergence (and a re-trace).
    pub non_model_slack_bytes: u64,
    /// The most chunks one moment holds in use at once (tensors accessed and not yet
    /// released, on either tier); sizes the budget check at open.
    pub working_set_chunks: u32,
    /// What happens to chunks an existing swap file already stores. `false` (the
    /// default): they are dropped, and every chunk reads as zeros until written — a
    /// store never takes bytes it did not write as state unless told to. `true`: they
    /// are taken as the chunks' contents, and the store refuses to open
    /// ([`crate::ChunkError::AdoptRefused`]) unless the file records this layout's
    /// fingerprint ([`Layout::fingerprint`]) and was closed by
    /// [`crate::ChunkStore::close`] after its last change. Opening for adoption clears
    /// the file's clean marker on disk before anything else changes.
    pub adopt: bool,
    /// Whether the host pool is pinned: locked in RAM, registered with the device and
    /// offered to the swap file's engine as fixed buffers (`true`, the default: chunks
    /// move to and from a GPU and NVMe from pinned memory). `false` for a store whose
    /// chunks never leave the pool (it holds every chunk, and nothing computes on a
    /// GPU): a buffer's pages are then made when it is first used, so the lists a run
    /// never touches cost no memory.
    pub pin_host: bool,
}

impl StoreConfig {
    /// Defaults around three budgets, the ones the benchmark (`tidestore bench`) runs
    /// with: `lifetime` policy, 8 moments of device prefetch, 64 moments of host-tier
    /// prefetch, asynchronous write-backs, no margin, a tidal window of 8 moments,
    /// 1 MiB of non-model slack, one chunk in use at a time, no adoption of an existing
    /// swap file's chunks.
    pub fn new(device_budget_bytes: u64, host_budget_bytes: u64, nvme: NvmeSource) -> Self {
        StoreConfig {
            device_budget_bytes,
            step_device_budget_bytes: None,
            host_budget_bytes,
            nvme,
            policy: PolicyKind::Lifetime,
            prefetch_lookahead: DEFAULT_PREFETCH_LOOKAHEAD,
            prefetch_lookahead_bytes_max: u64::MAX,
            host_prefetch_lookahead: DEFAULT_HOST_PREFETCH_LOOKAHEAD,
            async_write_back: true,
            tidal_margin_bytes: 0,
            tidal_window: 8,
            non_model_slack_bytes: 1 << 20,
            working_set_chunks: 1,
            adopt: false,
            pin_host: true,
        }
    }

    /// With the host pool pinned or not (see [`StoreConfig::pin_host`]).
    pub fn with_pinned_host(mut self, pin: bool) -> Self {
        self.pin_host = pin;
        self
    }

    /// Taking the chunks an existing swap file stores as the contents (see
    /// [`StoreConfig::adopt`]), or not.
    pub fn with_adopt(mut self, adopt: bool) -> Self {
        self.adopt = adopt;
        self
    }

    /// With another policy.
    pub fn with_policy(mut self, policy: PolicyKind) -> Self {
        self.policy = policy;
        self
    }

    /// With another prefetch look-ahead (0 turns prefetch off).
    pub fn with_prefetch(mut self, lookahead: u32) -> Self {
        self.prefetch_lookahead = lookahead;
        self
    }

    /// With a host-tier prefetch look-ahead (0 turns it off).
    pub fn with_host_prefetch(mut self, lookahead: u32) -> Self {
        self.host_prefetch_lookahead = lookahead;
        self
    }

    /// With host -> NVMe write-backs forced by eviction made asynchronous (or not).
    pub fn with_async_write_back(mut self, on: bool) -> Self {
        self.async_write_back = on;
        self
    }

    /// With room for `chunks` chunks in use at once.
    pub fn with_working_set_chunks(mut self, chunks: u32) -> Self {
        self.working_set_chunks = chunks;
        self
    }
}

/// The shape of the tiers a layout needs, as [`plan_capacity`] found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapacityPlan {
    /// Bytes of every host buffer and NVMe slot (the largest chunk, rounded to 4096).
    pub slot_bytes: u64,
    /// Chunks of the layout.
    pub chunks: u64,
    /// Host buffers the pool will hold.
    pub host_buffers: u64,
    /// NVMe slots usable for chunks.
    pub nvme_slots: u64,
    /// Device bytes one moment's working set needs.
    pub device_working_set_bytes: u64,
}

/// Device bytes one moment's working set needs in `layout`: its `working_set_chunks`
/// largest chunks, each as stored (rounded up to the I/O alignment). What
/// [`plan_capacity`] asks of the device budget.
pub fn device_working_set_bytes(layout: &Layout, working_set_chunks: u32) -> u64 {
    let mut sizes = layout.dense_chunk_bytes();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    working_set_bytes(&sizes, working_set_chunks as usize)
}

/// The first `n` of `sizes` (largest first), each rounded up to the I/O alignment.
fn working_set_bytes(sizes: &[u64], n: usize) -> u64 {
    sizes
        .iter()
        .take(n)
        .map(|&b| align_up(b as usize) as u64)
        .sum()
}

/// Refuses a device budget above the device's memory or below the working set of the
/// `n` largest chunks.
fn check_device_budget(
    budget_bytes: u64,
    total_bytes: u64,
    working_set: u64,
    n: usize,
) -> Result<()> {
    if budget_bytes > total_bytes {
        return Err(ChunkError::Config {
            key: "store.device_budget",
            reason: format!("{budget_bytes} bytes is more than the device's {total_bytes} bytes"),
        });
    }
    if budget_bytes < working_set {
        return Err(ChunkError::BudgetTooSmall {
            tier: TierKind::Device,
            what: if n == 1 {
                "the largest chunk (one access)"
            } else {
                "the working set (the largest chunks one moment may use)"
            },
            needed_bytes: working_set,
            available_bytes: budget_bytes,
            short_bytes: working_set - budget_bytes,
        });
    }
    Ok(())
}

/// Checks the budgets against `layout` (see the module doc). `nvme_slots` is the number
/// of NVMe slots usable for chunks (for [`NvmeSource::Dir`], `bytes / slot_bytes`);
/// `device_total_bytes` is the device's memory.
pub fn plan_capacity(
    layout: &Layout,
    device_budget_bytes: u64,
    host_budget_bytes: u64,
    working_set_chunks: u32,
    nvme_slots: u64,
    device_total_bytes: u64,
) -> Result<CapacityPlan> {
    if working_set_chunks == 0 {
        return Err(ChunkError::Config {
            key: "store.working_set_chunks",
            reason: "at least one chunk must be usable at a time".into(),
        });
    }
    let mut sizes: Vec<u64> = layout
        .dense_chunk_bytes()
        .into_iter()
        .filter(|&b| b > 0)
        .collect();
    if sizes.is_empty() {
        return Err(ChunkError::NoTensors);
    }
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let slot_bytes = align_up(sizes[0] as usize) as u64;
    let chunks = sizes.len() as u64;
    let n = working_set_chunks as usize;
    let device_working_set_bytes = working_set_bytes(&sizes, n);
    check_device_budget(
        device_budget_bytes,
        device_total_bytes,
        device_working_set_bytes,
        n,
    )?;
    let host_buffers = host_budget_bytes / slot_bytes;
    let host_needed = (n as u64 + 1) * slot_bytes;
    if host_budget_bytes < host_needed {
        return Err(ChunkError::BudgetTooSmall {
            tier: TierKind::Host,
            what: "the chunks one moment may use on the host plus one staging buffer",
            needed_bytes: host_needed,
            available_bytes: host_budget_bytes,
            short_bytes: host_needed - host_budget_bytes,
        });
    }
    let needed_bytes = (chunks + 1) * slot_bytes;
    let host_bytes = host_buffers * slot_bytes;
    let nvme_bytes = nvme_slots * slot_bytes;
    let available_bytes = host_bytes + nvme_bytes;
    if needed_bytes > available_bytes {
        return Err(ChunkError::ModelTooLarge {
            chunks,
            slot_bytes,
            needed_bytes,
            host_bytes,
            nvme_bytes,
            available_bytes,
            short_bytes: needed_bytes - available_bytes,
        });
    }
    Ok(CapacityPlan {
        slot_bytes,
        chunks,
        host_buffers,
        nvme_slots,
        device_working_set_bytes,
    })
}
