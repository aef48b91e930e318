//! Opening a [`Trainer`]: the parameters laid out in chunk lists (with an fp32 gradient
//! list in [`Precision::F32`]), the chunk size searched, the budgets resolved to
//! bytes, the device tier, the store and the step loop — in that order, each step a
//! function, every refusal before anything is allocated where the layout alone can tell.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tidestore_chunk::{
    device_working_set_bytes, search_chunk_size, ChunkError, ChunkStore, DType, Layout,
    LayoutConfig, ListKind, MoveEvent, NvmeSource, Place, SearchConfig, StoreConfig, TensorId,
    TensorSpec,
};
use tidestore_optimizer::{AdamW, CpuConfig, HybridAdamW, OptimError};
use tidestore_tiers::{Device, DeviceConfig, DeviceKind};

use super::config::{Budget, DeviceChoice, ParamSpec, Precision, StepDevice, TrainerConfig};
use super::placement::{decide_step_place, DeviceShare, StepNeeds};
use super::{Entry, NvmeTraffic, Trainer};
use crate::error::{Result, TrainError};
use crate::step::{StepConfig, StepLoop, StepPlace, StepTensor};

/// Chunks the optimizer step holds at once: gradient, master, M and V.
const STEP_WORKING_SET_CHUNKS: u32 = 4;

impl Trainer {
    /// Registers `specs` (in forward order, values zero) in a new store laid out and
    /// budgeted as `cfg` says, and readies the step loop. Names used twice, invalid
    /// hyper-parameters or step settings, a budget the store cannot work in, a chunk size
    /// that cannot hold a tensor: refused here, with the bytes needed and available,
    /// before the host pool or swap file is made.
    pub fn open(specs: &[ParamSpec], cfg: &TrainerConfig) -> Result<Trainer> {
        check_specs(specs)?;
        let layout = layout(specs, cfg)?;
        let (mut store_cfg, slot_bytes) = store_config(&layout, cfg);
        let (mut device, ordinal) = open_device(cfg, store_cfg.device_budget_bytes)?;
        let (opt, on_device, split, step_reason) = optimizer(
            cfg,
            &layout,
            &device,
            ordinal,
            store_cfg.device_budget_bytes,
        )?;
        let place = if on_device {
            StepPlace::Device
        } else {
            StepPlace::Host
        };
        let left_over = matches!(cfg.device, DeviceChoice::Auto | DeviceChoice::Cpu);
        if left_over && device.kind() == DeviceKind::Sim && !on_device {
            // The simulation left where no GPU was found holds nothing while the step is
            // in the host pool (compute reads there too, `Trainer::compute_place_for`):
            // its budget is what the store's capacity check asks, not the one given.
            let needed = device_working_set_bytes(&layout, STEP_WORKING_SET_CHUNKS);
            if needed != store_cfg.device_budget_bytes {
                store_cfg.device_budget_bytes = needed;
                device = open_device(cfg, needed)?.0;
            }
        }
        tracing::info!(?place, reason = %step_reason, "trainer: optimizer step placement");
        let step = StepConfig {
            hp: cfg.hp,
            max_grad_norm: cfg.max_grad_norm,
            loss_scaler: None,
            place,
            overlap: cfg.overlap,
            check_finite: cfg.check_finite,
        };
        step.validate()?;
        // A pool that holds every chunk beside a simulated device: no chunk ever goes to
        // NVMe or a GPU, so nothing needs it pinned, and the lists this run never
        // touches then cost no memory.
        let stays = cfg.host_budget == Budget::AllChunks && device.kind() == DeviceKind::Sim;
        let store_cfg = store_cfg.with_pinned_host(!stays);
        tracing::info!(
            chunk_elements = layout.chunk_elements(),
            slot_bytes,
            device_budget_bytes = store_cfg.device_budget_bytes,
            host_budget_bytes = store_cfg.host_budget_bytes,
            waste = layout.waste_fraction(),
            "trainer: layout"
        );
        let mut store = ChunkStore::open(layout, store_cfg, device)?;
        let traffic = Arc::new(NvmeTraffic::default());
        let hook = traffic.clone();
        store.set_move_hook(Some(Box::new(move |e: &MoveEvent| hook.record(e))));
        let mut trainer = Trainer::with_store(store, specs, cfg.precision, step, opt)?;
        trainer.step.place_on_device(&trainer.store, &split)?;
        // A simulation asked for stands in for a GPU; one left where none was found is
        // host memory beside the host pool (see `Trainer::compute_place_for`).
        trainer.sim_stands_in = cfg.device == DeviceChoice::Sim;
        trainer.compute_place = trainer.compute_place_for(false);
        tracing::info!(
            device = %trainer.store.device().kind(),
            reads_device = trainer.compute_reads_device(),
            "trainer: where compute reads parameters"
        );
        trainer.traffic = Some(traffic);
        trainer.step_reason = step_reason;
        Ok(trainer)
    }

    /// A trainer over a store its caller opened (the bench, whose capacity checks name
    /// its config's keys and whose step placement depends on the opened device): every
    /// spec must be a tensor of the store's layout, with an fp32 `Grads` place in `F32`
    /// precision. Steps with `opt` as `step` says. The store's move hook is the
    /// caller's: such a trainer counts no NVMe traffic of its own
    /// ([`Trainer::nvme_traffic`] is `None`).
    pub fn with_store(
        store: ChunkStore,
        specs: &[ParamSpec],
        precision: Precision,
        step: StepConfig,
        opt: HybridAdamW,
    ) -> Result<Trainer> {
        check_specs(specs)?;
        let entries = entries(specs, store.layout(), precision)?;
        let step = step_loop(&store, &entries, precision, step, opt)?;
        let swap_path = store.nvme().with_swap_file(|f| f.path().to_path_buf());
        let by_name = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.spec.name.clone(), i))
            .collect::<HashMap<_, _>>();
        let mut trainer = Trainer {
            store,
            step,
            entries,
            by_name,
            precision,
            compute_place: Place::Host,
            // A caller's simulated device stands in for a GPU, read as one.
            sim_stands_in: true,
            resident: false,
            traffic: None,
            step_reason: "chosen by the caller that opened the store".into(),
            swap_path,
            reported: 0,
            began_with_due: false,
            activation_peak_bytes: 0,
        };
        // Compute reads host-addressable memory until a front end computing on the GPU
        // says otherwise (`Trainer::set_compute_on_device`).
        trainer.compute_place = trainer.compute_place_for(false);
        Ok(trainer)
    }
}

fn check_specs(specs: &[ParamSpec]) -> Result<()> {
    let mut seen = HashSet::new();
    if let Some(p) = specs.iter().find(|p| !seen.insert(p.name.as_str())) {
        return Err(TrainError::Tensor {
            tensor: p.name.clone(),
            reason: "registered twice".into(),
        });
    }
    if let Some(p) = specs.iter().find(|p| p.elements() == 0) {
        return Err(TrainError::Tensor {
            tensor: p.name.clone(),
            reason: format!("shape {:?} has no elements", p.shape),
        });
    }
    if specs.iter().all(|p| !p.trainable) {
        return Err(TrainError::Config {
            key: "params",
            reason: "no trainable parameter: nothing to step".into(),
        });
    }
    Ok(())
}

/// The tensors in layout order: frozen first, then the trainable ones (each in forward
/// order), so that a LoRA model's adapters share a few chunks instead of each leaving a
/// mostly empty master, M and V chunk beside its frozen base weight. In `F32`, fp32
/// gradients get a list of their own (`Grads`, 4-byte slots, mirroring master): in the
/// 16-bit `Params` list they would take two slots per element, so chunks would have to
/// be twice the largest tensor and every gradient chunk half empty in the host pool,
/// whose buffers are as large as the largest chunk.
///
/// The chunk size is searched for the least waste plus the working set it forces
/// ([`STEP_WORKING_SET_CHUNKS`] and a buffer to load into): waste alone takes larger
/// chunks, each a larger share of a small host pool.
fn layout(specs: &[ParamSpec], cfg: &TrainerConfig) -> Result<Layout> {
    let (frozen, trainable): (Vec<_>, Vec<_>) = specs.iter().partition(|p| !p.trainable);
    let tensors: Vec<TensorSpec> = frozen
        .iter()
        .chain(&trainable)
        .map(|p| TensorSpec::new(&p.name, &p.shape, DType::F32, p.trainable))
        .collect();
    let f32_grads = cfg.precision == Precision::F32;
    let base = LayoutConfig::new(1)
        .with_param16_dtype(DType::BF16)
        .with_grad_accumulation(f32_grads)
        .with_fp32_grads(f32_grads)
        .with_moments(cfg.moments);
    let chunk_elements = match cfg.chunk_elements {
        Some(c) => c,
        None => fitting_chunk_elements(&tensors, &base, cfg)?,
    };
    Layout::new(
        LayoutConfig {
            chunk_elements,
            ..base
        },
        tensors,
    )
    .map_err(|e| match e {
        e @ (ChunkError::TensorTooLarge { .. } | ChunkError::InvalidChunkSize { .. }) => {
            TrainError::Config {
                key: "chunk_elements",
                reason: e.to_string(),
            }
        }
        e => TrainError::Store(e),
    })
}

/// The searched chunk size, made smaller where a budget given in bytes could not hold
/// what one moment uses at it (the search weighs waste against a working set, not
/// against the budgets): searched again under a cap — the largest chunk the budgets
/// allow (7/8 of the last choice where that is no smaller) — until the host's working set
/// ([`STEP_WORKING_SET_CHUNKS`] slots and a staging buffer) and, on a device that holds
/// chunks, the device's fit, or no smaller size holds the largest tensor: then the
/// store's own check at open names the bytes short, as before.
fn fitting_chunk_elements(
    tensors: &[TensorSpec],
    base: &LayoutConfig,
    cfg: &TrainerConfig,
) -> Result<u64> {
    let mut search = SearchConfig::new(cfg.io.block_bytes as u64)
        .with_cap_factor(2)
        .with_resident_chunks(u64::from(STEP_WORKING_SET_CHUNKS) + 1);
    let mut chosen = search_chunk_size(tensors, base, &search)?
        .chosen
        .chunk_elements;
    for _ in 0..16 {
        let Some(cap) = budget_cap(tensors, base, chosen, cfg) else {
            break; // fits
        };
        // The budgets' own cap, unless rounding left it no smaller than the last try.
        let cap = if cap < chosen { cap } else { chosen / 8 * 7 };
        search = search.with_max_chunk_elements(cap);
        match search_chunk_size(tensors, base, &search) {
            Ok(report) => chosen = report.chosen.chunk_elements,
            Err(_) => break, // no smaller size holds the largest tensor
        }
        tracing::debug!(
            chunk_elements = chosen,
            "trainer: chunk size made to fit the budgets"
        );
    }
    Ok(chosen)
}

/// `None` when chunks of `chunk_elements` leave the working sets inside the budgets
/// given in bytes, else the largest chunk (in elements) the budgets allow at this
/// layout's bytes per element. The device's budget counts only on a device that holds
/// chunks — the simulation asked for, or a GPU a `cuda` build may open — not where the
/// stand-in left without a GPU is resized to what the layout needs (see
/// [`Trainer::open`]).
fn budget_cap(
    tensors: &[TensorSpec],
    base: &LayoutConfig,
    chunk_elements: u64,
    cfg: &TrainerConfig,
) -> Option<u64> {
    let config = LayoutConfig {
        chunk_elements,
        ..*base
    };
    // A layout refused here is refused at open, naming why.
    let layout = Layout::new(config, tensors.to_vec()).ok()?;
    let largest = layout.dense_chunk_bytes().into_iter().max().unwrap_or(0);
    let slot_bytes = tidestore_io::align_up(largest as usize) as u64;
    let n = u64::from(STEP_WORKING_SET_CHUNKS);
    let mut max_slot = u64::MAX;
    if let Budget::Bytes(b) = cfg.host_budget {
        if (n + 1) * slot_bytes > b {
            max_slot = b / (n + 1);
        }
    }
    let holds_chunks = match cfg.device {
        DeviceChoice::Sim => true,
        DeviceChoice::Auto => cfg!(feature = "cuda"),
        DeviceChoice::Cpu => false,
    };
    if let (true, Budget::Bytes(b)) = (holds_chunks, cfg.device_budget) {
        if device_working_set_bytes(&layout, STEP_WORKING_SET_CHUNKS) > b {
            max_slot = max_slot.min(b / n);
        }
    }
    (max_slot != u64::MAX).then(|| {
        let bytes_per_element = largest.div_ceil(chunk_elements.max(1)).max(1);
        max_slot / bytes_per_element
    })
}

/// Each spec's entry; in `F32`, every trainable tensor must have an fp32 `Grads` place.
fn entries(specs: &[ParamSpec], layout: &Layout, precision: Precision) -> Result<Vec<Entry>> {
    specs
        .iter()
        .map(|spec| {
            let missing = |what: &str| TrainError::Tensor {
                tensor: spec.name.clone(),
                reason: format!("{what} is not in the store's layout"),
            };
            let id = layout
                .tensor_id(&spec.name)
                .ok_or_else(|| missing("the tensor"))?;
            let f32_grad = layout
                .location(id, ListKind::Grads)
                .is_some_and(|l| l.dtype == DType::F32);
            if precision == Precision::F32 && spec.trainable && !f32_grad {
                return Err(missing("its fp32 gradient place (the Grads list)"));
            }
            Ok(Entry {
                spec: spec.clone(),
                id,
                reported: false,
            })
        })
        .collect()
}

/// The store's settings: budgets in bytes, and a swap file with a slot for every chunk
/// the host pool does not hold, plus two to spare. Returns them with the slot size.
fn store_config(layout: &Layout, cfg: &TrainerConfig) -> (StoreConfig, u64) {
    let chunk_max_bytes = layout.dense_chunk_bytes().into_iter().max().unwrap_or(0);
    let slot_bytes = tidestore_io::align_up(chunk_max_bytes as usize) as u64;
    let chunks: u64 = layout
        .lists()
        .iter()
        .map(|&l| layout.list_chunk_count(l))
        .sum();
    let bytes = |b: Budget| match b {
        Budget::Chunks(n) => u64::from(n) * slot_bytes,
        Budget::Bytes(n) => n,
        Budget::AllChunks => (chunks + 1) * slot_bytes,
    };
    let device_budget_bytes = bytes(cfg.device_budget);
    let host_budget_bytes = bytes(cfg.host_budget);
    let host_slots = host_budget_bytes / slot_bytes.max(1);
    let nvme_slots = (chunks + 2).saturating_sub(host_slots).max(2);
    let nvme = NvmeSource::Dir {
        dir: cfg.swap_dir.clone(),
        bytes: nvme_slots * slot_bytes,
        io: cfg.io.clone(),
    };
    let store_cfg = StoreConfig::new(device_budget_bytes, host_budget_bytes, nvme)
        .with_working_set_chunks(STEP_WORKING_SET_CHUNKS);
    (store_cfg, slot_bytes)
}

/// The optimizer for the opened `device` (GPU `ordinal`), whether its step runs on the
/// device tier (`device_budget_bytes` there), the tensors stepped there by a split step
/// otherwise ([`DeviceShare`]; `auto` on a GPU), and why.
fn optimizer(
    cfg: &TrainerConfig,
    layout: &Layout,
    device: &Device,
    ordinal: usize,
    device_budget_bytes: u64,
) -> Result<(HybridAdamW, bool, Vec<TensorId>, String)> {
    let cpu = AdamW::new(CpuConfig {
        threads: cfg.optimizer_threads,
        ..CpuConfig::default()
    })?;
    let on_gpu = device.kind() == DeviceKind::Cuda;
    let opt = if on_gpu && cfg.step_device != StepDevice::Cpu {
        HybridAdamW::new(cpu, ordinal)
    } else {
        let why = if on_gpu {
            "optimizer.device = \"cpu\""
        } else {
            "the device is simulated"
        };
        HybridAdamW::cpu_only(cpu, OptimError::NoGpu { reason: why.into() })
    };
    let needs = StepNeeds::of(layout, |id| layout.tensor(id).is_some_and(|t| t.trainable));
    let (on_device, reason) = decide_step_place(
        cfg.step_device,
        on_gpu,
        device_budget_bytes,
        "device.budget",
        &needs,
        opt.gpu_status(),
    )?;
    let splits = !on_device && on_gpu && cfg.step_device == StepDevice::Auto;
    if !splits || opt.gpu_status().is_err() {
        return Ok((opt, on_device, Vec::new(), reason));
    }
    let trainable = |id| layout.tensor(id).is_some_and(|t| t.trainable);
    let share = DeviceShare::of(layout, trainable, device_budget_bytes);
    if share.tensors.is_empty() {
        return Ok((opt, false, Vec::new(), reason));
    }
    let reason = format!(
        "auto: split: the state of {} of {} trainable tensors ({}) fits the device budget \
         ({}) beside every 16-bit parameter chunk ({}); they are stepped on the GPU, the \
         others in the host pool",
        share.tensors.len(),
        share.trainable,
        tidestore_io::human_bytes(share.state_bytes),
        tidestore_io::human_bytes(device_budget_bytes),
        tidestore_io::human_bytes(share.params_bytes)
    );
    Ok((opt, false, share.tensors, reason))
}

/// The device tier `cfg` asks for, on GPU `cfg.gpu_ordinal`, with that ordinal (for
/// the GPU AdamW on the same GPU). `Auto` opens the GPU only in a build with the `cuda` feature,
/// where `tiers` checks for the driver before any CUDA call.
fn open_device(cfg: &TrainerConfig, budget_bytes: u64) -> Result<(Device, usize)> {
    let mut dcfg = DeviceConfig::new(budget_bytes);
    dcfg.ordinal = cfg.gpu_ordinal;
    // The chunks' slab is the budget, as on a GPU; the activations' room is beside it.
    dcfg.sim_total_bytes = Some(budget_bytes.saturating_add(cfg.sim_activation_bytes));
    dcfg.slab_bytes = Some(budget_bytes);
    let device = match cfg.device {
        DeviceChoice::Auto if cfg!(feature = "cuda") => Device::auto(&dcfg),
        _ => Device::sim(&dcfg),
    };
    device
        .map(|d| (d, dcfg.ordinal))
        .map_err(|e| TrainError::Store(ChunkError::tier("opening the device tier", None, e)))
}

/// The step loop over the trainable entries: gradients in the fp32 `Grads` list
/// (`F32`) or over the bf16 copy (`Bf16`).
fn step_loop(
    store: &ChunkStore,
    entries: &[Entry],
    precision: Precision,
    cfg: StepConfig,
    opt: HybridAdamW,
) -> Result<StepLoop> {
    let grad = precision.grad_place();
    let tensors = entries
        .iter()
        .filter(|e| e.spec.trainable)
        .map(|e| StepTensor { tensor: e.id, grad })
        .collect();
    StepLoop::new(store, opt, tensors, cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidestore_optimizer::HyperParams;

    /// The 0.5B LLaMA of the CPU comparison (hidden 2048, 8 layers, GQA 16/8 heads,
    /// intermediate 5632, vocab 32000), in the order the trainer registers it.
    fn llama_05b() -> Vec<ParamSpec> {
        let cfg = crate::hf::LlamaConfig::from_shape(crate::hf::config::LlamaShape {
            hidden_size: 2048,
            intermediate_size: 5632,
            num_hidden_layers: 8,
            num_attention_heads: 16,
            num_key_value_heads: 8,
            vocab_size: 32000,
            tie_word_embeddings: false,
            max_position_embeddings: 2048,
        })
        .unwrap();
        crate::hf::base_tensors(&cfg)
            .into_iter()
            .map(|(name, shape)| ParamSpec::new(name, &shape, true))
            .collect()
    }

    #[test]
    fn the_chunk_size_weighs_the_working_set_against_waste() {
        let mut cfg = TrainerConfig::new(HyperParams::adamw(1e-5, (0.9, 0.999), 1e-8, 0.0), "/");
        cfg.io.block_bytes = 16 << 20; // finetune's default io.block_size
        let chosen = layout(&llama_05b(), &cfg).unwrap();
        let grads = chosen
            .location(tidestore_chunk::TensorId(0), ListKind::Grads)
            .unwrap();
        assert_eq!((grads.dtype, grads.slot_bytes), (DType::F32, 4));
        let waste_only = SearchConfig::new(cfg.io.block_bytes as u64).with_cap_factor(2);
        let tensors: Vec<_> = llama_05b()
            .iter()
            .map(|p| TensorSpec::new(&p.name, &p.shape, DType::F32, true))
            .collect();
        let base = LayoutConfig::new(1)
            .with_grad_accumulation(true)
            .with_fp32_grads(true);
        let by_waste = search_chunk_size(&tensors, &base, &waste_only).unwrap();
        // Waste alone picks 109M-element chunks (6.7 % waste); 92M elements waste 8.1 %
        // and floor the host at five 369 MB buffers. (With the f32 gradients over two
        // 16-bit slots each, chunks had to hold twice the 65.5M-element embedding: the
        // search chose 134M.)
        assert_eq!(chosen.config().chunk_elements, 92_274_688);
        assert_eq!(by_waste.chosen.chunk_elements, 109_051_904);
        assert!(by_waste.chosen.waste_bytes < chosen.waste_bytes());
    }

    /// The 5 x 369 MB host floor of the search's choice above, and its 4-chunk device
    /// working set, against budgets given in bytes: the chunk is made smaller until both
    /// fit (still holding the 65.5M-element embedding), and a budget no chunk size can
    /// meet leaves the search's choice for the store to refuse by name.
    #[test]
    fn budgets_in_bytes_bound_the_searched_chunk_size() {
        let mut cfg = TrainerConfig::new(HyperParams::adamw(1e-5, (0.9, 0.999), 1e-8, 0.0), "/");
        cfg.io.block_bytes = 16 << 20;
        cfg.device = DeviceChoice::Sim;
        let specs = llama_05b();
        let gib = 1u64 << 30;
        for (host, device) in [(gib + gib / 2, 4 * gib), (8 * gib, gib + gib / 8)] {
            cfg.host_budget = Budget::Bytes(host);
            cfg.device_budget = Budget::Bytes(device);
            let chosen = layout(&specs, &cfg).unwrap();
            let elements = chosen.config().chunk_elements;
            assert!((65_536_000..92_274_688).contains(&elements), "{elements}");
            let slot = chosen.dense_chunk_bytes().into_iter().max().unwrap();
            assert!(5 * slot <= host, "host: 5 x {slot} > {host}");
            let working = device_working_set_bytes(&chosen, STEP_WORKING_SET_CHUNKS);
            assert!(working <= device, "device: {working} > {device}");
        }
        // No GPU asked for: the stand-in is resized to the layout at open, its budget
        // does not count (nor Auto's, where no build can open a GPU).
        cfg.host_budget = Budget::Bytes(8 * gib);
        for choice in [DeviceChoice::Cpu, DeviceChoice::Auto] {
            cfg.device = choice;
            let elements = layout(&specs, &cfg).unwrap().config().chunk_elements;
            let bounded = choice == DeviceChoice::Auto && cfg!(feature = "cuda");
            assert_eq!(elements == 92_274_688, !bounded, "{choice:?}: {elements}");
        }
        cfg.device = DeviceChoice::Auto;
        // Below what the embedding alone forces: the search's choice, refused at open.
        cfg.host_budget = Budget::Bytes(gib);
        assert_eq!(
            layout(&specs, &cfg).unwrap().config().chunk_elements,
            92_274_688
        );
    }
}
