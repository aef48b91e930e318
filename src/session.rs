//! A chunk store opened for a workload from the configuration, with every up-front
//! check mapped to the key a user would change.
//!
//! [`prepare`] does everything that needs no memory or file: it builds the workload's
//! tensors, picks the chunk size (`chunk.size = "auto"`: the chunk crate's search), lays
//! the tensors out, and checks the budgets with the chunk crate's
//! [`tidestore_chunk::plan_capacity`] (the same check [`ChunkStore::open`] makes). A
//! device budget smaller than one chunk, a host pool that cannot stage a chunk and a
//! model larger than host + NVMe are all [`Error::Config`] naming `device.budget`,
//! `host.budget` or `nvme.size`, before anything is allocated. [`open`] then makes the
//! device, the host pool and the swap file.
//!
//! One chunk is in use at a time on the device (`working_set_chunks = 1`): forward and
//! backward use one tensor at a time. The optimizer step holds a tensor's 16-bit
//! param/gradient, master, M and V chunks at once, in the host pool (`optimizer.device`
//! cpu: in place through the store's `views_mut` when the pool holds those four buffers
//! plus one for loads, else copied through scratch one chunk at a time) or on the
//! device (gpu: the bench checks, before it starts, that the step's device budget holds
//! them).

use tidestore_chunk::{
    plan_capacity, search_chunk_size, CapacityPlan, ChunkError, ChunkStore, Layout, LayoutConfig,
    ListKind, NvmeSource, SearchConfig, StoreConfig, TensorId, ALLOCATING_HOST_POOL,
    SWAP_FILE_NAME,
};
use tidestore_io::compress::Compression;
use tidestore_tiers::{Device, DeviceConfig, DeviceKind, NvmeTier, TierError, TierKind};

use crate::config::{AutoSize, CompressionName, Config, DeviceKindName, Size};
use crate::error::{Error, Result};
use crate::workload::{ModelShape, Workload, WorkloadSection};

/// Chunks in use at once (see the module doc).
pub const WORKING_SET_CHUNKS: u32 = 1;

/// The CUDA device the device tier opens (`device.ordinal`; `"auto"`: 0, as a
/// data-parallel front end resolves the key to the rank's local rank first); GPU
/// kernels that work on its chunks, and candle's compute, open the same device's
/// primary context.
pub fn device_ordinal(cfg: &Config) -> usize {
    cfg.device.ordinal.resolve(None)
}

/// The workload laid out in chunks and checked against the budgets; nothing allocated.
#[derive(Debug)]
pub struct Prepared {
    /// The workload.
    pub workload: Workload,
    /// Its layout.
    pub layout: Layout,
    /// Element slots per chunk.
    pub chunk_elements: u64,
    /// Whether the chunk size came from the search.
    pub chunk_searched: bool,
    /// Wasted bytes of the layout (allocated minus payload, all lists).
    pub waste_bytes: u64,
    /// The capacity check's result.
    pub capacity: CapacityPlan,
    /// Total memory of the device (the simulated one, or the GPU's when known).
    pub device_memory_bytes: u64,
    /// Bytes of the largest 16-bit chunk (what the device holds).
    pub param16_chunk_bytes: u64,
}

/// What the bench knows of the workload it opened a store for (the store itself goes
/// to the bench's [`tidestore_train::Trainer`]).
pub struct Session {
    /// The workload.
    pub workload: Workload,
    /// Tensor ids in the order of `workload.tensors`.
    pub ids: Vec<TensorId>,
    /// The preparation's facts (layout moved into the store).
    pub chunk_elements: u64,
    /// Whether the chunk size was searched.
    pub chunk_searched: bool,
    /// Wasted bytes of the layout.
    pub waste_bytes: u64,
    /// Capacity plan.
    pub capacity: CapacityPlan,
    /// Device memory.
    pub device_memory_bytes: u64,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("workload", &self.workload.describe())
            .finish()
    }
}

/// The layout of `workload` with chunk size `chunk` (auto: searched for `block_bytes`).
pub fn layout_for(
    workload: &Workload,
    chunk: AutoSize,
    block_bytes: u64,
    moments: tidestore_chunk::MomentForm,
) -> Result<(Layout, u64, bool)> {
    let base = LayoutConfig::new(1).with_moments(moments);
    let (elements, searched) = match chunk {
        AutoSize::Auto => {
            let report =
                search_chunk_size(&workload.tensors, &base, &SearchConfig::new(block_bytes))
                    .map_err(|e| {
                        Error::config("chunk.size", format!("the chunk-size search failed: {e}"))
                    })?;
            (report.chosen.chunk_elements, true)
        }
        AutoSize::Fixed(size) => {
            let bytes = size.bytes();
            if !bytes.is_multiple_of(8192) {
                return Err(Error::config(
                    "chunk.size",
                    format!(
                        "{size} is the size of an fp32 chunk; it must be a multiple of 8192 so \
                         that the 16-bit chunks (half as large) stay 4096-aligned"
                    ),
                ));
            }
            (bytes / 4, false)
        }
    };
    let layout = Layout::new(
        LayoutConfig::new(elements).with_moments(moments),
        workload.tensors.iter().cloned(),
    )
    .map_err(|e| match e {
        ChunkError::TensorTooLarge {
            tensor,
            needed_elements,
            ..
        } => Error::config(
            "chunk.size",
            format!(
                "{} cannot hold tensor `{tensor}` ({needed_elements} elements need {} as fp32); \
                 tensors are never split: use \"auto\" or at least that size",
                Size::from_bytes(elements * 4),
                Size::from_bytes(needed_elements * 4),
            ),
        ),
        other => Error::Store(other),
    })?;
    Ok((layout, elements, searched))
}

fn human(b: u64) -> String {
    crate::config::human_bytes(b)
}

/// Builds the workload and its layout and checks every budget (see the module doc).
pub fn prepare(cfg: &Config) -> Result<Prepared> {
    let room = [cfg.device.budget, cfg.host.budget, cfg.nvme.size]
        .iter()
        .map(|s| u128::from(s.bytes()))
        .sum::<u128>();
    check_model_fits(
        &cfg.workload,
        room,
        "device.budget + host.budget + nvme.size",
    )?;
    let workload = cfg.workload.build()?;
    let (layout, chunk_elements, chunk_searched) = layout_for(
        &workload,
        cfg.chunk.size,
        cfg.io.block_size.bytes(),
        cfg.optimizer.states.moments(),
    )?;
    let param16_chunk_bytes = layout.chunk_bytes(ListKind::Params);
    let device_budget = cfg.device.budget.bytes();
    if device_budget < param16_chunk_bytes {
        return Err(Error::config(
            "device.budget",
            format!(
                "{} is smaller than one chunk: a 16-bit chunk of {} takes {} (chunk.size = {})",
                human(device_budget),
                workload.model,
                human(param16_chunk_bytes),
                cfg.chunk.size
            ),
        ));
    }
    let activations = workload.activation_bytes();
    let device_memory_bytes = match cfg.device.sim_memory {
        AutoSize::Fixed(m) => m.bytes(),
        AutoSize::Auto => device_budget + activations.peak() + cfg.device.tidal_margin.bytes(),
    };
    let slot_bytes =
        tidestore_io::align_up(layout.dense_chunk_bytes().into_iter().max().unwrap_or(0) as usize)
            as u64;
    let nvme_slots = cfg.nvme.size.bytes() / slot_bytes.max(1);
    let capacity = plan_capacity(
        &layout,
        device_budget,
        cfg.host.budget.bytes(),
        WORKING_SET_CHUNKS,
        nvme_slots,
        device_memory_bytes.max(device_budget),
    )
    .map_err(|e| capacity_error(e, &workload, cfg))?;
    Ok(Prepared {
        waste_bytes: layout.waste_bytes(),
        workload,
        layout,
        chunk_elements,
        chunk_searched,
        capacity,
        device_memory_bytes,
        param16_chunk_bytes,
    })
}

/// Refuses a custom model whose 16-bit parameters alone exceed `room` bytes (the three
/// tiers' budgets together, named by `room_what`), before its tensors are listed one by
/// one: `workload.layers = 1000000000` would otherwise be allocated for, layer by
/// layer, and abort the process. The count comes from the one- and two-layer workloads
/// (what each layer adds), so it is the workload's own; a model this check passes (and
/// every named one) is checked exactly by the capacity plan.
pub fn check_model_fits(w: &WorkloadSection, room: u128, room_what: &str) -> Result<()> {
    w.validate()?;
    if w.model != crate::workload::ModelName::Custom {
        return Ok(());
    }
    let shape = w.shape()?;
    let params = |layers: u32| {
        let s = ModelShape { layers, ..shape };
        u128::from(Workload::new(w.model, s, None, 1, 1).params_base())
    };
    let (one, two) = (params(1), params(2));
    let total = one + (two - one) * u128::from(shape.layers.max(1) - 1);
    let needed = total * 2;
    if needed <= room {
        return Ok(());
    }
    Err(Error::config(
        "workload.layers",
        format!(
            "the model does not fit: {} layers of {} parameters in all need {} for their \
             16-bit copy alone, more than {room_what} ({}) hold",
            shape.layers,
            total,
            human(u64::try_from(needed).unwrap_or(u64::MAX)),
            human(u64::try_from(room).unwrap_or(u64::MAX)),
        ),
    ))
}

/// The chunk crate's capacity errors as config errors naming the key to change.
fn capacity_error(e: ChunkError, workload: &Workload, cfg: &Config) -> Error {
    match e {
        e @ ChunkError::BudgetTooSmall { .. } => budget_error(e, cfg),
        ChunkError::ModelTooLarge {
            chunks,
            slot_bytes,
            needed_bytes,
            host_bytes,
            nvme_bytes,
            short_bytes,
            ..
        } => Error::config(
            "nvme.size",
            format!(
                "the model does not fit: {} needs {chunks} chunks + 1 staging slot of {} = {} \
                 of host + NVMe, but host.budget ({}) holds {} and nvme.size ({}) holds {} \
                 ({} short)",
                workload.describe(),
                human(slot_bytes),
                human(needed_bytes),
                cfg.host.budget,
                human(host_bytes),
                cfg.nvme.size,
                human(nvme_bytes),
                human(short_bytes)
            ),
        ),
        other => budget_error(other, cfg),
    }
}

/// A [`ChunkError::BudgetTooSmall`] as a config error naming the budget's key; when the
/// chunk size was chosen by the search, it says that chunks are whole multiples of
/// `io.block_size`, the usual reason a small budget cannot hold a small model's chunks.
/// A host pool the machine cannot allocate names `host.budget`. Any other error is
/// returned as the store's.
pub fn budget_error(e: ChunkError, cfg: &Config) -> Error {
    if let ChunkError::Tier {
        op: ALLOCATING_HOST_POOL,
        source,
        ..
    } = &e
    {
        return Error::config(
            "host.budget",
            format!(
                "{}: the host pool cannot be allocated ({}); give a budget this machine's \
                 memory holds",
                cfg.host.budget, source.0
            ),
        );
    }
    let ChunkError::BudgetTooSmall {
        tier,
        what,
        needed_bytes,
        available_bytes,
        short_bytes,
    } = e
    else {
        return Error::Store(e);
    };
    let key = match tier {
        TierKind::Device => "device.budget",
        TierKind::Host => "host.budget",
        _ => "nvme.size",
    };
    let hint = match cfg.chunk.size {
        AutoSize::Auto => format!(
            "; chunk sizes are whole multiples of io.block_size ({}), so a smaller \
             io.block_size (or a fixed chunk.size) gives smaller chunks",
            human(cfg.io.block_size.bytes())
        ),
        AutoSize::Fixed(_) => String::new(),
    };
    Error::config(
        key,
        format!(
            "too small: {what} needs {}, the budget gives {} ({} short){hint}",
            human(needed_bytes),
            human(available_bytes),
            human(short_bytes)
        ),
    )
}

/// The device `device.kind` names (a simulated one of `sim_memory_bytes`), and its
/// memory: on a GPU the card's.
fn open_device(cfg: &Config, sim_memory_bytes: u64) -> Result<(Device, u64)> {
    let mut dcfg = DeviceConfig::new(cfg.device.budget.bytes());
    dcfg.ordinal = device_ordinal(cfg);
    dcfg.sim_total_bytes = Some(sim_memory_bytes.max(cfg.device.budget.bytes()));
    dcfg.sim_link_bytes_per_s = Some((cfg.device.pcie_gbps * 1e9) as u64);
    let device = match cfg.device.kind {
        DeviceKindName::Sim => Device::sim(&dcfg),
        DeviceKindName::Cuda => Device::cuda(&dcfg),
        DeviceKindName::Auto => Device::auto(&dcfg),
    }
    .map_err(|e| match cfg.device.kind {
        DeviceKindName::Cuda => Error::config("device.kind", format!("no CUDA device: {e}")),
        _ => Error::Tier(e),
    })?;
    let memory_bytes = match device.kind() {
        tidestore_tiers::DeviceKind::Cuda => device.mem_info()?.total_bytes,
        tidestore_tiers::DeviceKind::Sim => sim_memory_bytes,
    };
    Ok((device, memory_bytes))
}

/// The bench's swap file in `nvme.dir`, shaped for `capacity`. It is scratch: one of
/// another shape (an earlier run, another chunk size) is replaced, one of this shape is
/// emptied by the store. Any other failure (another process holding the file's lock, a
/// full disk) is an error, and the file is left alone.
fn open_swap_file(cfg: &Config, capacity: &CapacityPlan) -> Result<NvmeTier> {
    let dir = cfg.nvme_dir()?.to_path_buf();
    let io = cfg.io_config()?;
    let compression = match cfg.nvme.compression {
        CompressionName::Off => Compression::Off,
        CompressionName::Zstd => Compression::FP32,
    };
    let slots = u32::try_from(capacity.nvme_slots.max(1))
        .map_err(|_| Error::config("nvme.size", "more slots than a swap file holds"))?;
    let path = dir.join(SWAP_FILE_NAME);
    let open =
        || NvmeTier::open_or_create(&path, capacity.slot_bytes as usize, slots, &io, compression);
    Ok(match open() {
        Err(TierError::Io {
            source: source @ tidestore_io::IoError::BadHeader { .. },
            ..
        }) => {
            tracing::info!(error = %source, "swap file of another shape; recreating it");
            std::fs::remove_file(&path).map_err(|e| {
                Error::config(
                    "nvme.dir",
                    format!("removing {} to recreate it: {e}", path.display()),
                )
            })?;
            open()?
        }
        other => other?,
    })
}

/// Opens the device, the host pool and the swap file for a prepared workload: the store,
/// and what the bench keeps of the preparation.
pub fn open(cfg: &Config, prepared: Prepared) -> Result<(ChunkStore, Session)> {
    let Prepared {
        workload,
        layout,
        chunk_elements,
        chunk_searched,
        waste_bytes,
        capacity,
        device_memory_bytes,
        ..
    } = prepared;
    let (device, device_memory_bytes) = open_device(cfg, device_memory_bytes)?;
    let tier = open_swap_file(cfg, &capacity)?;
    // Every run starts from nothing: the store drops the chunks an earlier run left
    // (it adopts none unless asked to).
    let nvme = NvmeSource::Tier(Box::new(tier));
    let store_cfg = StoreConfig::new(cfg.device.budget.bytes(), cfg.host.budget.bytes(), nvme)
        .with_policy(cfg.policy.eviction.into())
        .with_prefetch(cfg.policy.prefetch_lookahead)
        .with_host_prefetch(cfg.policy.host_prefetch_lookahead)
        .with_async_write_back(true)
        .with_working_set_chunks(WORKING_SET_CHUNKS);
    let store_cfg = StoreConfig {
        tidal_margin_bytes: cfg.device.tidal_margin.bytes(),
        ..store_cfg
    };
    let store = match ChunkStore::open(layout, store_cfg, device) {
        Ok(s) => s,
        Err(e) => return Err(capacity_error(e, &workload, cfg)),
    };
    let ids = (0..workload.tensors.len() as u32).map(TensorId).collect();
    tracing::info!(
        workload = %workload.describe(),
        device = %store.device().kind(),
        chunk_elements,
        "chunk store opened"
    );
    Ok((
        store,
        Session {
            workload,
            ids,
            chunk_elements,
            chunk_searched,
            waste_bytes,
            capacity,
            device_memory_bytes,
        },
    ))
}

/// Whether the store's device is a real GPU.
pub fn is_gpu(store: &ChunkStore) -> bool {
    store.device().kind() == DeviceKind::Cuda
}
