//! `tidestore plan` as a library: for a workload and a machine (GPU, RAM and NVMe sizes
//! and bandwidths), where every chunk list goes, whether it fits, what is short by how
//! much, and the projected iteration time.
//!
//! The placement follows the store's rules (see [`tidestore_chunk::config`]): every
//! chunk has a home slot in the host pool or the swap file (one slot = one fp32 chunk),
//! plus one staging slot; the device holds copies of as many 16-bit chunks as its
//! forward/backward budget allows (the GPU less the activation peak and the margin).
//! Home slots go to the chunks whose NVMe traffic they save the most: 16-bit chunks not
//! kept on the device first (read in forward and backward), then master, M, V (read and
//! written once per step); chunks kept on the device are backed on NVMe.
//!
//! The projection, per iteration, excludes the GPU's matmul time (tidestore moves
//! bytes; it does not know the model's FLOPs): forward + backward take the slower of the
//! PCIe and NVMe traffic they cause, the step takes the slower of the CPU AdamW (at the
//! measured or given rate) and the NVMe traffic of the optimizer state, streamed.

use serde::Serialize;
use tidestore_chunk::{plan_capacity, ChunkError, Layout, ListKind};

use crate::error::Result;
use crate::session::WORKING_SET_CHUNKS;
use crate::workload::Workload;

/// `1.50 GiB`, `512.0 MiB`, `4.0 KiB`, `12 B`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [(&str, f64); 4] = [
        ("TiB", (1u64 << 40) as f64),
        ("GiB", (1u64 << 30) as f64),
        ("MiB", (1u64 << 20) as f64),
        ("KiB", 1024.0),
    ];
    for (name, size) in UNITS {
        if b as f64 >= size {
            return format!("{:.2} {name}", b as f64 / size);
        }
    }
    format!("{b} B")
}

/// The machine a plan is for. Budgets are for chunks.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Machine {
    /// GPU memory.
    pub gpu_bytes: u64,
    /// Device bytes kept free above the activations.
    pub tidal_margin_bytes: u64,
    /// Pinned host pool for chunks.
    pub host_budget_bytes: u64,
    /// Swap file on NVMe.
    pub nvme_bytes: u64,
    /// Host <-> device bandwidth, each way.
    pub pcie_bytes_per_s: f64,
    /// NVMe read bandwidth.
    pub nvme_read_bytes_per_s: f64,
    /// NVMe write bandwidth.
    pub nvme_write_bytes_per_s: f64,
    /// CPU AdamW parameters per second.
    pub optimizer_params_per_s: f64,
}

/// Where one chunk list goes.
#[derive(Debug, Clone, Serialize)]
pub struct ListPlan {
    /// `param16`, `master`, `m`, `v`.
    pub list: String,
    /// Chunks of the list.
    pub chunks: u64,
    /// Bytes of the list (whole chunks, as the store allocates them).
    pub bytes: u64,
    /// Bytes of the list that tensors occupy.
    pub payload_bytes: u64,
    /// Chunks kept on the device during forward/backward.
    pub device_chunks: u64,
    /// Chunks whose home is the host pool.
    pub host_chunks: u64,
    /// Chunks whose home is the swap file.
    pub nvme_chunks: u64,
}

/// A shortfall: which budget, what it needs, what it has.
#[derive(Debug, Clone, Serialize)]
pub struct Shortfall {
    /// `gpu`, `ram`, `nvme`.
    pub resource: String,
    /// What needs it.
    pub what: String,
    /// Bytes needed.
    pub needed_bytes: u64,
    /// Bytes available.
    pub available_bytes: u64,
    /// `needed - available`.
    pub short_bytes: u64,
}

/// The plan.
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    /// The JSON schema name.
    pub schema: String,
    /// The workload in one line.
    pub workload: String,
    /// Parameters of the base model.
    pub params_base: u64,
    /// Trainable parameters.
    pub params_trainable: u64,
    /// The machine.
    pub machine: Machine,
    /// Peak emulated activation bytes.
    pub activation_peak_bytes: u64,
    /// Device bytes left for chunks during forward/backward.
    pub device_chunk_budget_bytes: u64,
    /// Bytes of a 16-bit chunk.
    pub param16_chunk_bytes: u64,
    /// Bytes of a host buffer / NVMe slot.
    pub slot_bytes: u64,
    /// Per list.
    pub lists: Vec<ListPlan>,
    /// Whether everything fits.
    pub fits: bool,
    /// What is short, when it does not fit.
    pub shortfalls: Vec<Shortfall>,
    /// Bytes over PCIe per iteration (both ways).
    pub pcie_bytes: u64,
    /// Bytes read from NVMe per iteration.
    pub nvme_read_bytes: u64,
    /// Bytes written to NVMe per iteration.
    pub nvme_write_bytes: u64,
    /// Projected forward + backward seconds (data movement only).
    pub forward_backward_seconds: f64,
    /// Projected optimizer step seconds.
    pub optimizer_seconds: f64,
    /// Projected iteration seconds (without the GPU's matmuls).
    pub iteration_seconds: f64,
    /// What the projection leaves out.
    pub note: String,
}

/// Plans `workload` laid out as `layout` on `machine` (see the module doc).
pub fn plan(workload: &Workload, layout: &Layout, machine: &Machine) -> Result<PlanReport> {
    let act = workload.activation_bytes().peak();
    let device_budget = machine
        .gpu_bytes
        .saturating_sub(act)
        .saturating_sub(machine.tidal_margin_bytes);
    let dense = layout.dense_chunk_bytes();
    let slot_bytes =
        tidestore_io::align_up(dense.iter().copied().max().unwrap_or(0) as usize) as u64;
    let p16_chunk = layout.chunk_bytes(ListKind::Param16).max(1);
    let mut shortfalls = Vec::new();

    // Device: as many 16-bit chunks as fit.
    let n16 = layout.list_chunk_count(ListKind::Param16);
    let dev16 = (device_budget / p16_chunk).min(n16);
    // Home slots: one staging slot; the host pool first to non-resident 16-bit chunks,
    // then master, M, V; the rest and the device-resident chunks on NVMe.
    let host_slots = (machine.host_budget_bytes / slot_bytes.max(1)).saturating_sub(1);
    let mut left = host_slots;
    let mut take = |n: u64| {
        let t = n.min(left);
        left -= t;
        t
    };
    let host16 = take(n16 - dev16);
    let mut lists = vec![ListPlan {
        list: ListKind::Param16.as_str().into(),
        chunks: n16,
        bytes: layout.list_bytes(ListKind::Param16),
        payload_bytes: layout.list_payload_bytes(ListKind::Param16),
        device_chunks: dev16,
        host_chunks: host16,
        nvme_chunks: n16 - host16,
    }];
    for l in [
        ListKind::MasterF32,
        ListKind::MomentumF32,
        ListKind::VarianceF32,
    ] {
        let n = layout.list_chunk_count(l);
        if n == 0 {
            continue;
        }
        let h = take(n);
        lists.push(ListPlan {
            list: l.as_str().into(),
            chunks: n,
            bytes: layout.list_bytes(l),
            payload_bytes: layout.list_payload_bytes(l),
            device_chunks: 0,
            host_chunks: h,
            nvme_chunks: n - h,
        });
    }

    let nvme_slots = machine.nvme_bytes / slot_bytes.max(1);
    match plan_capacity(
        layout,
        device_budget,
        machine.host_budget_bytes,
        WORKING_SET_CHUNKS,
        nvme_slots,
        device_budget,
    ) {
        Ok(_) => {}
        Err(ChunkError::BudgetTooSmall {
            tier,
            what,
            needed_bytes,
            available_bytes,
            short_bytes,
        }) => shortfalls.push(Shortfall {
            resource: match tier {
                tidestore_tiers::TierKind::Device => "gpu",
                tidestore_tiers::TierKind::Host => "ram",
                _ => "nvme",
            }
            .into(),
            what: format!("{what} (after {} of activations)", human_bytes(act)),
            needed_bytes,
            available_bytes,
            short_bytes,
        }),
        Err(ChunkError::ModelTooLarge {
            chunks,
            needed_bytes,
            available_bytes,
            short_bytes,
            ..
        }) => shortfalls.push(Shortfall {
            resource: "nvme".into(),
            what: format!("{chunks} chunks + 1 staging slot in host + NVMe"),
            needed_bytes,
            available_bytes,
            short_bytes,
        }),
        Err(e) => return Err(e.into()),
    }

    // Traffic per iteration.
    let frozen_only = workload.params_trainable() == 0 || workload.lora.is_some();
    let trainable16 = if frozen_only {
        0
    } else {
        layout.list_bytes(ListKind::Param16)
    };
    let bytes_of = |n: u64, list: ListKind| -> u64 {
        let c = layout.list_chunk_count(list).max(1);
        layout.list_bytes(list) * n / c
    };
    let p16 = &lists[0];
    let off_device16 = bytes_of(p16.chunks - p16.device_chunks, ListKind::Param16);
    let nvme16_off_device = bytes_of(
        (p16.chunks - p16.device_chunks).saturating_sub(p16.host_chunks),
        ListKind::Param16,
    );
    // LoRA adapters are a small part of the 16-bit list; their traffic is counted with
    // the optimizer state below.
    let (pcie, mut nvme_r, mut nvme_w) = if trainable16 == 0 {
        (2 * off_device16, 2 * nvme16_off_device, 0)
    } else {
        let on_device = bytes_of(p16.device_chunks, ListKind::Param16);
        (
            3 * off_device16 + 2 * on_device,
            3 * nvme16_off_device,
            2 * nvme16_off_device,
        )
    };
    let fb_nvme_r = nvme_r;
    let fb_nvme_w = nvme_w;
    let mut opt_r = 0;
    let mut opt_w = 0;
    for l in &lists[1..] {
        let kind = match l.list.as_str() {
            "master" => ListKind::MasterF32,
            "m" => ListKind::MomentumF32,
            _ => ListKind::VarianceF32,
        };
        let b = bytes_of(l.nvme_chunks, kind);
        opt_r += b;
        opt_w += b;
    }
    nvme_r += opt_r;
    nvme_w += opt_w;
    let secs = |bytes: u64, rate: f64| {
        if rate > 0.0 {
            bytes as f64 / rate
        } else {
            f64::INFINITY
        }
    };
    let forward_backward_seconds = secs(pcie, machine.pcie_bytes_per_s).max(
        secs(fb_nvme_r, machine.nvme_read_bytes_per_s)
            + secs(fb_nvme_w, machine.nvme_write_bytes_per_s),
    );
    let optimizer_seconds = secs(workload.params_trainable(), machine.optimizer_params_per_s).max(
        secs(opt_r, machine.nvme_read_bytes_per_s) + secs(opt_w, machine.nvme_write_bytes_per_s),
    );
    Ok(PlanReport {
        schema: "tidestore.plan.v1".into(),
        workload: workload.describe(),
        params_base: workload.params_base(),
        params_trainable: workload.params_trainable(),
        machine: *machine,
        activation_peak_bytes: act,
        device_chunk_budget_bytes: device_budget,
        param16_chunk_bytes: p16_chunk,
        slot_bytes,
        lists,
        fits: shortfalls.is_empty(),
        shortfalls,
        pcie_bytes: pcie,
        nvme_read_bytes: nvme_r,
        nvme_write_bytes: nvme_w,
        forward_backward_seconds,
        optimizer_seconds,
        iteration_seconds: forward_backward_seconds + optimizer_seconds,
        note: "data movement and the CPU optimizer only: the GPU's matmul time is not \
               included; PCIe and NVMe are assumed to overlap within a phase"
            .into(),
    })
}

/// Measures this machine's CPU AdamW rate (bf16 gradients, fp32 state, bf16 params out)
/// over `params` parameters, the best of `repeats` steps.
pub fn measure_optimizer_rate(
    opt: &tidestore_optimizer::AdamW,
    params: usize,
    repeats: u32,
) -> Result<f64> {
    use half::bf16;
    use tidestore_optimizer::{Grads, HyperParams, ParamOut, StepState};
    let mut master = vec![0.01f32; params];
    let mut m = vec![0.0f32; params];
    let mut v = vec![0.0f32; params];
    let g = vec![bf16::from_f32(1e-3); params];
    let mut out = vec![bf16::ZERO; params];
    let hp = HyperParams::default();
    let mut best = f64::INFINITY;
    for step in 1..=u64::from(repeats.max(1)) {
        let t = std::time::Instant::now();
        opt.step_slice(
            StepState::new(step),
            &hp,
            &mut master,
            &mut m,
            &mut v,
            Grads::Bf16(&g),
            Some(ParamOut::Bf16(&mut out)),
        )?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(params as f64 / best.max(1e-9))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{models, LoraTargets, ModelName};

    #[test]
    fn llama_70b_lora_on_a_24gb_gpu_uses_all_three_tiers() {
        let w = Workload::new(
            ModelName::Llama70b,
            models::LLAMA_70B,
            Some((16, LoraTargets::Qv)),
            1,
            1024,
        );
        let (layout, _, _) =
            crate::session::layout_for(&w, crate::config::AutoSize::Auto, 1 << 20).unwrap();
        let m = Machine {
            gpu_bytes: 24_000_000_000,
            tidal_margin_bytes: 0,
            host_budget_bytes: 56_000_000_000,
            nvme_bytes: 2_000_000_000_000,
            pcie_bytes_per_s: 25e9,
            nvme_read_bytes_per_s: 7e9,
            nvme_write_bytes_per_s: 5e9,
            optimizer_params_per_s: 1e9,
        };
        let p = plan(&w, &layout, &m).unwrap();
        assert!(p.fits, "{:?}", p.shortfalls);
        let p16 = &p.lists[0];
        assert!(
            p16.device_chunks > 0 && p16.host_chunks > 0 && p16.nvme_chunks > 0,
            "{p16:?}"
        );
        assert!(p.iteration_seconds.is_finite() && p.iteration_seconds > 0.0);
        // The same on a 200 GB drive does not fit, and says by how much.
        let small = Machine {
            nvme_bytes: 20_000_000_000,
            ..m
        };
        let p = plan(&w, &layout, &small).unwrap();
        assert!(!p.fits);
        assert!(p.shortfalls[0].short_bytes > 0);
    }
}
