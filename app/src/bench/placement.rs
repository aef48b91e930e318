//! Where the optimizer step runs (`optimizer.device`), decided before the first
//! iteration: the step's device budget against the trainable tensors' chunks, and the
//! CPU kernel the host steps use.

use tidestore_chunk::{ChunkStore, Layout, ListKind, TensorId};
use tidestore_optimizer::{AdamW, CpuConfig, OptimError};

use crate::error::{Error, Result};
use tidestore::config::{Config, OptimizerDevice};
use tidestore::session;
use tidestore::workload::Workload;

/// Where the optimizer step runs (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StepPlacement {
    /// Whether the four chunks of a tensor are stepped on the device (else in the host
    /// pool).
    pub(super) on_device: bool,
    /// Why, in one phrase.
    pub(super) reason: String,
}

/// The lists a tensor's step touches.
const STEP_LISTS: [ListKind; 4] = [
    ListKind::Params,
    ListKind::Master,
    ListKind::Momentum,
    ListKind::Variance,
];

/// The device budget for chunks during the optimizer step, as the store sets it then:
/// the device's memory less what is not chunks (measured on a GPU; on the simulated
/// device the bench reports none during the step) less `device.tidal_margin`, and never
/// more than the chunk slab (on a GPU, `device.budget`; on the simulated device, its
/// whole memory).
#[derive(Debug, Clone, Copy)]
pub(super) struct StepBudget {
    bytes: u64,
    total_bytes: u64,
    non_model_bytes: u64,
    margin_bytes: u64,
    slab_bytes: u64,
}

impl StepBudget {
    fn new(cfg: &Config, total_bytes: u64, non_model_bytes: u64, slab_bytes: u64) -> Self {
        let margin_bytes = cfg.device.tidal_margin.bytes();
        StepBudget {
            bytes: total_bytes
                .saturating_sub(non_model_bytes)
                .saturating_sub(margin_bytes)
                .min(slab_bytes),
            total_bytes,
            non_model_bytes,
            margin_bytes,
            slab_bytes,
        }
    }

    /// The simulated device's, known before it is made (the memory `session::open`
    /// gives it, all of it the slab).
    pub(super) fn simulated(cfg: &Config, prepared: &session::Prepared) -> Self {
        let total = prepared.device_memory_bytes.max(cfg.device.budget.bytes());
        StepBudget::new(cfg, total, 0, total)
    }

    /// The opened device's (on a GPU, less the memory in use by others now).
    pub(super) fn of(cfg: &Config, store: &ChunkStore) -> Result<Self> {
        let device = store.device();
        let total = device.mem_info()?.total_bytes;
        let non_model = if session::is_gpu(store) {
            device.non_model_bytes()?
        } else {
            0
        };
        Ok(StepBudget::new(cfg, total, non_model, device.slab_bytes()))
    }

    /// How the budget is made, for messages.
    fn describe(&self) -> String {
        let free = format!(
            "{} of device memory less {} in use by others less {} tidal_margin",
            human(self.total_bytes),
            human(self.non_model_bytes),
            human(self.margin_bytes)
        );
        if self.slab_bytes < self.total_bytes {
            format!(
                "the chunk slab (device.budget, {}) within {free}",
                human(self.slab_bytes)
            )
        } else {
            free
        }
    }
}

/// Device bytes the step on the device needs: the four chunks of the trainable tensor
/// whose four chunks take most (what is in use at once), and every chunk holding
/// trainable state (what would let the step move nothing). Chunks count as the device
/// budget counts them (rounded up to 4096).
#[derive(Debug, Clone)]
pub(super) struct StepNeeds {
    largest_bytes: u64,
    largest_tensor: String,
    /// The largest tensor's chunks, per list of [`STEP_LISTS`].
    largest_chunks: [u64; 4],
    all_bytes: u64,
}

pub(super) fn step_needs(layout: &Layout, workload: &Workload) -> StepNeeds {
    let dense = layout.dense_chunk_bytes();
    let dev_bytes = |d: usize| tidestore_io::align_up(dense[d] as usize) as u64;
    let mut needs = StepNeeds {
        largest_bytes: 0,
        largest_tensor: String::new(),
        largest_chunks: [0; 4],
        all_bytes: 0,
    };
    let mut seen = vec![false; dense.len()];
    for (i, t) in workload.tensors.iter().enumerate() {
        if !t.trainable {
            continue;
        }
        let mut chunks = [0u64; 4];
        for (c, list) in chunks.iter_mut().zip(STEP_LISTS) {
            if let Some(loc) = layout.location(TensorId(i as u32), list) {
                let d = loc.chunk.dense();
                *c = dev_bytes(d);
                if !seen[d] {
                    seen[d] = true;
                    needs.all_bytes += *c;
                }
            }
        }
        let sum = chunks.iter().sum();
        if sum > needs.largest_bytes {
            needs.largest_bytes = sum;
            needs.largest_tensor = t.name.clone();
            needs.largest_chunks = chunks;
        }
    }
    needs
}

fn human(b: u64) -> String {
    crate::plan::human_bytes(b)
}

/// Where the optimizer step runs, from `optimizer.device` (see the module doc), or a
/// config error naming `optimizer.device` when `gpu` cannot run.
pub(super) fn choose_placement(
    cfg: &Config,
    on_gpu: bool,
    budget: StepBudget,
    needs: &StepNeeds,
    gpu_kernel: std::result::Result<(), OptimError>,
) -> Result<StepPlacement> {
    let place = |on_device: bool, reason: String| Ok(StepPlacement { on_device, reason });
    match cfg.optimizer.device {
        OptimizerDevice::Cpu => place(false, "optimizer.device = \"cpu\"".into()),
        OptimizerDevice::Gpu => {
            if on_gpu {
                if let Err(e) = gpu_kernel {
                    return Err(Error::config(
                        "optimizer.device",
                        format!("\"gpu\": the GPU AdamW kernel is not ready: {e}"),
                    ));
                }
            }
            if needs.largest_bytes > budget.bytes {
                let [p16, master, m, v] = needs.largest_chunks;
                return Err(Error::config(
                    "optimizer.device",
                    format!(
                        "\"gpu\" steps each trainable tensor with its four chunks on the \
                         device at once: tensor `{}` needs {} (param16 {}, master {}, m {}, \
                         v {}), but the device budget during the step is {} ({}), {} \
                         short; use \"cpu\" or \"auto\", or more device memory{}",
                        needs.largest_tensor,
                        human(needs.largest_bytes),
                        human(p16),
                        human(master),
                        human(m),
                        human(v),
                        human(budget.bytes),
                        budget.describe(),
                        human(needs.largest_bytes - budget.bytes),
                        if on_gpu { "" } else { " (device.sim_memory)" }
                    ),
                ));
            }
            place(
                true,
                if on_gpu {
                    "optimizer.device = \"gpu\"".into()
                } else {
                    "optimizer.device = \"gpu\" on the simulated device".into()
                },
            )
        }
        OptimizerDevice::Auto => {
            if !on_gpu {
                return place(false, "auto: the device is simulated".into());
            }
            if let Err(e) = gpu_kernel {
                return place(false, format!("auto: no GPU AdamW kernel ({e})"));
            }
            if needs.all_bytes > budget.bytes {
                return place(
                    false,
                    format!(
                        "auto: the trainable state ({}) does not fit the step's device \
                         budget ({})",
                        human(needs.all_bytes),
                        human(budget.bytes)
                    ),
                );
            }
            place(
                true,
                format!(
                    "auto: a CUDA GPU whose step budget ({}) holds all trainable state ({})",
                    human(budget.bytes),
                    human(needs.all_bytes)
                ),
            )
        }
    }
}

/// The CPU AdamW the config asks for (`optimizer.threads`). It steps the host pool, and
/// with `optimizer.device` on the device of a simulated device, the simulated memory.
pub fn cpu_optimizer(cfg: &Config) -> Result<AdamW> {
    Ok(AdamW::new(CpuConfig {
        threads: cfg.optimizer.threads as usize,
        ..CpuConfig::default()
    })?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a GPU the slab is `device.budget`: the step's budget is bounded by it, not by
    /// the card's free memory (an 80 GB card with a 128 MiB slab placed a 176 MB step on
    /// the device, which then failed mid-step).
    #[test]
    fn the_step_budget_never_exceeds_the_slab() {
        let cfg = Config::from_toml_str("[device]\nbudget = \"128MiB\"\n[nvme]\ndir = \"swap\"\n")
            .unwrap();
        let gib = 1u64 << 30;
        let slab = 128 << 20;
        let b = StepBudget::new(&cfg, 80 * gib, gib / 2, slab);
        assert_eq!(b.bytes, slab);
        assert!(b
            .describe()
            .contains("chunk slab (device.budget, 128.00 MiB)"));
        let needs = StepNeeds {
            largest_bytes: 176 << 20,
            largest_tensor: "embed_tokens".into(),
            largest_chunks: [32 << 20, 48 << 20, 48 << 20, 48 << 20],
            all_bytes: 2 * gib,
        };
        let auto = choose_placement(&cfg, true, b, &needs, Ok(())).unwrap();
        assert!(!auto.on_device, "{}", auto.reason);
        let mut gpu = cfg.clone();
        gpu.optimizer.device = OptimizerDevice::Gpu;
        let e = choose_placement(&gpu, true, b, &needs, Ok(())).unwrap_err();
        assert!(e.to_string().contains("embed_tokens"), "{e}");
        // Where the slab is the whole device (the simulation), free memory bounds it.
        let b = StepBudget::new(&cfg, 8 << 20, 1 << 20, 8 << 20);
        assert_eq!(b.bytes, 7 << 20);
    }
}
