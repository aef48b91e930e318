//! Opening a store: the configuration checked against the layout (capacity plan)
//! before anything is allocated, then the swap file opened and its chunks adopted or
//! dropped, the host pool allocated, the mover built over the three tiers and every
//! list's tensor states made.
//!
//! Invariants: an impossible budget is an error before the host pool or the swap file
//! is allocated; a swap file's chunks are taken as state only when adoption is asked
//! for and the file's fingerprint matches and it was closed cleanly (see `adopt`).

use std::sync::Arc;

use tidestore_tiers::{Device, HostTier, NvmeTier};

use crate::adopt::{open_swap_dir, prepare_swap_file};
use crate::config::{plan_capacity, CapacityPlan, NvmeSource, StoreConfig};
use crate::error::{ChunkError, ALLOCATING_HOST_POOL};
use crate::layout::Layout;
use crate::mover::{Mover, Policies};
use crate::planner::PrefetchPlanner;
use crate::policy::PolicyKind;
use crate::tracer::{Follower, Horizon, Schedule, Tracer};
use crate::Result;

use super::{ChunkStore, Counts, DeviceBytes, ListStates, Mode, Phase, Settings, NEXT_STORE_ID};

impl ChunkStore {
    /// Opens a store for `layout` on `device` (see the module doc). Impossible budgets
    /// are refused here, before the host pool or the swap file is allocated, with the
    /// bytes needed and available.
    pub fn open(layout: Layout, config: StoreConfig, device: Device) -> Result<Self> {
        let device_bytes = DeviceBytes::of(&device)?;
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
            pin_host,
        } = config;
        let fingerprint = layout.fingerprint();
        let (nvme_slots, source) = SwapSource::from_config(nvme, max_chunk)?;
        let plan = plan_capacity(
            &layout,
            device_budget_bytes,
            host_budget_bytes,
            working_set_chunks,
            nvme_slots,
            device_bytes.slab,
        )?;
        check_window(prefetch_lookahead_bytes_max)?;
        // Everything fits: open the swap file and decide what its chunks are, then
        // allocate.
        let mut nvme = source.open(nvme_slots, slot_bytes, adopt.then_some(fingerprint))?;
        let adopted = prepare_swap_file(&mut nvme, &len_bytes, fingerprint, adopt)?;
        let host = HostTier::with_pinning(host_budget_bytes, slot_bytes, &device, pin_host)
            .map_err(|e| ChunkError::tier(ALLOCATING_HOST_POOL, None, e))?;

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
        let mut mover = build_mover(device, host, nvme, len_bytes, &settings, device_bytes)?;
        mover.set_async_writes(async_write_back);
        for c in &adopted {
            mover.adopt_nvme(*c);
        }
        tracing::debug!(?plan, device_budget_bytes, host_budget_bytes, %policy, "chunk store opened");
        Ok(ChunkStore::assemble(
            layout,
            plan,
            settings,
            mover,
            prefetch_lookahead_bytes_max,
            device_bytes,
        ))
    }

    /// The store over `mover`, every list's tensors FREE, tracing its first iteration.
    fn assemble(
        layout: Layout,
        plan: CapacityPlan,
        settings: Settings,
        mover: Mover,
        lookahead_bytes_max: u64,
        device_bytes: DeviceBytes,
    ) -> ChunkStore {
        let lists = ListStates::for_layout(&layout);
        ChunkStore {
            id: NEXT_STORE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            next_generation: 1,
            layout,
            mover,
            lists,
            settings,
            // The device's window counts device accesses: the host's between them
            // (gradients and optimizer state in the pool) do not bring a device
            // need closer, and counted, they hid the next block's first chunk until
            // its block began.
            planner: PrefetchPlanner::new(settings.lookahead, Horizon::Cyclic)
                .with_lookahead_bytes_max(lookahead_bytes_max)
                .counting_busy_moments(),
            host_planner: PrefetchPlanner::new(settings.host_lookahead, Horizon::Cyclic),
            plan,
            mode: Mode::Tracing(Tracer::new()),
            follower: Follower::new(settings.slack_bytes),
            diverged: false,
            position: 0,
            cycles: 0,
            phase: Phase::ForwardBackward,
            warmup: Vec::new(),
            device_moments: Vec::new(),
            host_moments: Vec::new(),
            counts: Counts::default(),
            moment: 0,
            non_model_reported_bytes: 0,
            device_bytes,
        }
    }
}

fn empty_schedule() -> Arc<Schedule> {
    Arc::new(Schedule::from_groups(&[], &[]))
}

/// Where the swap file comes from: a directory to open it in, or a tier the caller made.
enum SwapSource {
    Dir(std::path::PathBuf, tidestore_io::IoConfig),
    Tier(Box<NvmeTier>),
}

impl SwapSource {
    /// The usable NVMe slots and where they come from. A tier the caller made counts
    /// every slot, since the chunks a file already holds are either dropped or the
    /// layout's own; its slots must hold the largest chunk.
    fn from_config(nvme: NvmeSource, max_chunk: u64) -> Result<(u64, SwapSource)> {
        let slot_bytes = tidestore_io::align_up(max_chunk as usize);
        Ok(match nvme {
            NvmeSource::Dir { dir, bytes, io } => {
                (bytes / slot_bytes as u64, SwapSource::Dir(dir, io))
            }
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
                (u64::from(tier.slot_count()), SwapSource::Tier(tier))
            }
        })
    }

    /// The NVMe tier: the caller's, or the swap file opened (or created) in the
    /// directory with `nvme_slots` slots (`adopt`: the fingerprint a file's chunks are
    /// adopted under).
    fn open(self, nvme_slots: u64, slot_bytes: usize, adopt: Option<u64>) -> Result<NvmeTier> {
        Ok(match self {
            SwapSource::Tier(tier) => *tier,
            SwapSource::Dir(dir, io) => {
                let slots = u32::try_from(nvme_slots.max(1)).map_err(|_| ChunkError::Config {
                    key: "nvme.bytes",
                    reason: format!("{nvme_slots} slots are more than a swap file holds"),
                })?;
                open_swap_dir(&dir, slot_bytes, slots, &io, adopt)?
            }
        })
    }
}

/// Refuses a prefetch window of zero bytes (`store.prefetch_lookahead_bytes`).
fn check_window(bytes_max: u64) -> Result<()> {
    if bytes_max == 0 {
        return Err(ChunkError::Config {
            key: "store.prefetch_lookahead_bytes",
            reason: "a window of zero bytes prefetches nothing; set the look-ahead to 0 \
                     instead"
                .into(),
        });
    }
    Ok(())
}

/// The mover over the three tiers: the policies both tiers evict by (`lifetime` waits
/// for a schedule, LRU until then), the device budget set to the configured one within
/// what the device has free now, and the host pool offered to the swap file's engine.
fn build_mover(
    device: Device,
    host: HostTier,
    mut nvme: NvmeTier,
    len_bytes: Vec<u64>,
    settings: &Settings,
    device_bytes: DeviceBytes,
) -> Result<Mover> {
    let policy = settings.policy;
    let use_main = policy != PolicyKind::Lifetime;
    let dev_policy = Policies::new(policy.build(empty_schedule(), Horizon::Cyclic), use_main);
    let host_policy = Policies::new(policy.build(empty_schedule(), Horizon::Cyclic), use_main);
    let non_model = device.non_model_bytes().unwrap_or(0);
    let cap = settings
        .device_budget_bytes
        .min(device_bytes.slab)
        .min(device_bytes.beside(non_model, settings.margin_bytes));
    device
        .set_budget_capacity(cap)
        .map_err(|e| ChunkError::tier("setting the device budget", None, e))?;
    // Chunks move between the host pool and NVMe only: with the pool registered as
    // fixed buffers, no request pins pages. An unpinned pool stays out (registration
    // would lock it).
    let registered = if host.is_locked() {
        nvme.register_pool(host.pool())
    } else {
        Ok(false)
    };
    match registered {
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
    Ok(Mover::new(
        device,
        host,
        nvme,
        len_bytes,
        cap,
        dev_policy,
        host_policy,
    ))
}

impl DeviceBytes {
    /// Chunks live in the device's slab: it bounds every device budget. Non-model
    /// memory (the context, activations, other processes) is measured over the whole
    /// device, beside the slab, so the tide subtracts it from the device's total.
    fn of(device: &Device) -> Result<DeviceBytes> {
        let total = device
            .mem_info()
            .map_err(|e| ChunkError::tier("reading the device's memory", None, e))?
            .total_bytes;
        Ok(DeviceBytes {
            total,
            slab: device.slab_bytes().min(total),
        })
    }

    /// What the device leaves chunks beside `non_model` bytes and a margin.
    pub(super) fn beside(&self, non_model: u64, margin: u64) -> u64 {
        self.total.saturating_sub(non_model).saturating_sub(margin)
    }
}
