//! Where the optimizer step runs (`optimizer.device`), decided before the first
//! iteration: the step's device budget against the trainable tensors' chunks, and the
//! CPU kernel the host steps use.

use tidestore_chunk::{ChunkStore, Layout};
use tidestore_optimizer::{AdamW, CpuConfig, OptimError};
use tidestore_train::{decide_step_place, StepNeeds};

use crate::error::Result;
use tidestore::config::{human_bytes, Config};
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
            human_bytes(self.total_bytes),
            human_bytes(self.non_model_bytes),
            human_bytes(self.margin_bytes)
        );
        if self.slab_bytes < self.total_bytes {
            format!(
                "the chunk slab (device.budget, {}) within {free}",
                human_bytes(self.slab_bytes)
            )
        } else {
            free
        }
    }
}

/// Where the optimizer step runs, from `optimizer.device` (the trainer's rule,
/// [`decide_step_place`], with the bench's step budget), or a config error naming
/// `optimizer.device` when `gpu` cannot run.
pub(super) fn choose_placement(
    cfg: &Config,
    on_gpu: bool,
    budget: StepBudget,
    needs: &StepNeeds,
    gpu_kernel: std::result::Result<(), OptimError>,
) -> Result<StepPlacement> {
    let (on_device, reason) = decide_step_place(
        cfg.optimizer.device.step_device(),
        on_gpu,
        budget.bytes,
        &budget.describe(),
        needs,
        gpu_kernel,
    )?;
    Ok(StepPlacement { on_device, reason })
}

/// The trainable tensors' step needs in the bench's layout (tensor `i` is the
/// workload's `i`).
pub(super) fn step_needs(layout: &Layout, workload: &Workload) -> StepNeeds {
    StepNeeds::of(layout, |id| {
        workload
            .tensors
            .get(id.0 as usize)
            .is_some_and(|t| t.trainable)
    })
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
    use tidestore::config::OptimizerDevice;
    use tidestore_chunk::ListKind;

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
            largest_chunks: vec![
                (ListKind::Params, 32 << 20),
                (ListKind::Master, 48 << 20),
                (ListKind::Momentum, 48 << 20),
                (ListKind::Variance, 48 << 20),
            ],
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
