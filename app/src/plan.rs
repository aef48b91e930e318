//! `tidestore plan` as a library: for a workload and a machine (GPU, RAM and NVMe sizes
//! and bandwidths), where every chunk list goes, whether it fits, what is short by how
//! much, and the projected iteration time.
//!
//! The placement follows the store's rules (see [`tidestore_chunk::config`]): every
//! chunk has a home slot in the host pool or the swap file (one slot = the largest chunk
//! as stored: chunks are allocated and moved as the prefix their tensors use),
//! plus one staging slot; the device holds copies of as many 16-bit chunks as its
//! forward/backward budget allows (the GPU less the activation peak and the margin).
//! Home slots go to the chunks whose NVMe traffic they save the most: 16-bit chunks not
//! kept on the device first (read in forward and backward), then master, M, V (read and
//! written once per step); chunks kept on the device are backed on NVMe.
//!
//! The projection, per iteration: forward + backward take the slowest of the GPU's
//! compute (the bench's compute model, `workload.tflops`: each matrix's FLOPs, attention,
//! backward with recompute; nothing when the rate is 0), the PCIe and the NVMe traffic
//! they cause; the step takes the slower of the CPU AdamW (at the measured or given
//! rate) and the NVMe traffic of the optimizer state, streamed. With the step
//! overlapping backward (`optimizer.overlap = "backward"`) the iteration is forward plus
//! the slower of backward and the step, forward taking its share of the compute's
//! FLOPs; with the step deferred into the next forward (`"forward"`) it is the slower of
//! forward and the step, plus backward; otherwise it is their sum.
//!
//! Data parallel over `ranks` GPUs (`--gpus`), each a machine as given: every chunk list
//! sharded, each rank's store holding `1/ranks` of every tensor and of its master, M and
//! V (the layout planned is one rank's: [`Workload::shard`]), each rank computing the
//! whole model on its own micro-batch. Per rank and iteration the 16-bit parameters are
//! all-gathered for forward and again for backward, and the trained gradients (bf16)
//! reduce-scattered: with ring collectives each rank sends and receives `(ranks - 1) /
//! ranks` of those bytes, over the link between GPUs (`--link`), a fourth resource of
//! forward and backward beside compute, PCIe and NVMe; the step updates a rank's shard.

use serde::Serialize;
use tidestore_chunk::{plan_capacity, ChunkError, Layout, ListKind};

use crate::bench::compute::ComputeModel;
use crate::error::Result;
pub use tidestore::config::human_bytes;
use tidestore::config::OverlapName;
use tidestore::session::WORKING_SET_CHUNKS;
use tidestore::workload::Workload;

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
    /// The GPU's compute rate in FLOP/s (0: compute not counted).
    pub compute_flops_per_s: f64,
    /// When the step runs (`optimizer.overlap`): after backward, during backward, or
    /// during the next forward.
    pub overlap: OverlapName,
    /// Data-parallel ranks (GPUs, one machine as above each); 1: no data parallelism.
    pub ranks: u32,
    /// Bandwidth of a rank's collectives (each way), between GPUs.
    pub link_bytes_per_s: f64,
}

/// Where one chunk list goes.
#[derive(Debug, Clone, Serialize)]
pub struct ListPlan {
    /// `param16`, `master`, `m`, `v`.
    pub list: String,
    /// Chunks of the list.
    pub chunks: u64,
    /// Bytes of the list as the store allocates and moves them (each chunk's used
    /// prefix, page-rounded).
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
    /// Bytes of a host buffer / NVMe slot (the largest chunk as stored).
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
    /// Bytes a rank sends (and receives) in collectives per iteration: the all-gathers
    /// of the 16-bit parameters (forward and backward) and the gradients'
    /// reduce-scatter; 0 on one rank.
    pub collective_bytes: u64,
    /// Projected seconds of those collectives over the link.
    pub collective_seconds: f64,
    /// Elements of zero padding in the ranks' shards, all ranks together: the shards of
    /// a tensor the rank count does not divide are padded to equal length (0 on one
    /// rank).
    pub shard_padding_elements: u64,
    /// Projected compute seconds of forward + backward (0 when not counted).
    pub compute_seconds: f64,
    /// Projected forward + backward seconds: the slowest of compute, PCIe and NVMe.
    pub forward_backward_seconds: f64,
    /// Projected optimizer step seconds.
    pub optimizer_seconds: f64,
    /// Projected iteration seconds.
    pub iteration_seconds: f64,
    /// What the projection leaves out.
    pub note: String,
}

/// An iteration of forward + backward taking `fb` (of which forward `forward`) and a
/// step taking `optimizer`: the step after backward, beside backward's share, or beside
/// the next forward's.
fn iteration(overlap: OverlapName, forward: f64, fb: f64, optimizer: f64) -> f64 {
    match overlap {
        OverlapName::Off => fb + optimizer,
        OverlapName::Backward => forward + (fb - forward).max(optimizer),
        OverlapName::Forward => forward.max(optimizer) + fb - forward,
    }
}

/// Plans `workload` laid out as `layout` on `machine` (see the module doc); with
/// `machine.ranks` > 1, `layout` is one rank's, of `workload.shard(machine.ranks)`.
pub fn plan(workload: &Workload, layout: &Layout, machine: &Machine) -> Result<PlanReport> {
    let act = workload.activation_bytes().peak();
    let device_budget = machine
        .gpu_bytes
        .saturating_sub(act)
        .saturating_sub(machine.tidal_margin_bytes);
    let dense = layout.dense_chunk_bytes();
    let slot_bytes =
        tidestore_io::align_up(dense.iter().copied().max().unwrap_or(0) as usize) as u64;
    let p16_chunk = layout.chunk_bytes(ListKind::Params).max(1);
    let mut shortfalls = Vec::new();

    // Device: as many 16-bit chunks as fit.
    let n16 = layout.list_chunk_count(ListKind::Params);
    let dev16 = (device_budget / p16_chunk).min(n16);
    // 16-bit chunks off the device are read in forward and backward; trained ones are
    // also written (gradients) and read and written again by the step. Master, M and V
    // are read and written once per step. LoRA adapters are a small part of the 16-bit
    // list; their traffic is counted with the optimizer state.
    let frozen_only = workload.params_trainable() == 0 || workload.lora.is_some();
    let (p16_reads, p16_writes): (u32, u32) = if frozen_only { (2, 0) } else { (3, 2) };
    let stored_per_chunk = |list: ListKind| {
        layout.list_stored_bytes(list) as f64 / layout.list_chunk_count(list).max(1) as f64
    };
    let per_s = |rate: f64| {
        if rate > 0.0 {
            1.0 / rate
        } else {
            f64::INFINITY
        }
    };
    let (r, w) = (
        per_s(machine.nvme_read_bytes_per_s),
        per_s(machine.nvme_write_bytes_per_s),
    );
    // Home slots: one staging slot; the host pool to the chunks whose NVMe traffic it
    // saves the most seconds of per slot; the rest, and the device-resident chunks, on
    // NVMe.
    let mut wanted = vec![(
        ListKind::Params,
        n16 - dev16,
        stored_per_chunk(ListKind::Params) * (f64::from(p16_reads) * r + f64::from(p16_writes) * w),
    )];
    for l in [ListKind::Master, ListKind::Momentum, ListKind::Variance] {
        let n = layout.list_chunk_count(l);
        if n > 0 {
            wanted.push((l, n, stored_per_chunk(l) * (r + w)));
        }
    }
    let mut order: Vec<usize> = (0..wanted.len()).collect();
    order.sort_by(|&a, &b| wanted[b].2.total_cmp(&wanted[a].2));
    let mut left = (machine.host_budget_bytes / slot_bytes.max(1)).saturating_sub(1);
    let mut homed = vec![0u64; wanted.len()];
    for i in order {
        homed[i] = wanted[i].1.min(left);
        left -= homed[i];
    }
    let lists: Vec<ListPlan> = wanted
        .iter()
        .zip(&homed)
        .map(|(&(l, _, _), &h)| {
            let n = layout.list_chunk_count(l);
            let device = if l == ListKind::Params { dev16 } else { 0 };
            ListPlan {
                list: l.as_str().into(),
                chunks: n,
                bytes: layout.list_stored_bytes(l),
                payload_bytes: layout.list_payload_bytes(l),
                device_chunks: device,
                host_chunks: h,
                nvme_chunks: n - h,
            }
        })
        .collect();

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
    let bytes_of = |n: u64, list: ListKind| -> u64 {
        let c = layout.list_chunk_count(list).max(1);
        layout.list_stored_bytes(list) * n / c
    };
    let p16 = &lists[0];
    let off_device16 = bytes_of(p16.chunks - p16.device_chunks, ListKind::Params);
    let nvme16_off_device = bytes_of(
        (p16.chunks - p16.device_chunks).saturating_sub(p16.host_chunks),
        ListKind::Params,
    );
    let (pcie, mut nvme_r, mut nvme_w) = if frozen_only {
        (2 * off_device16, 2 * nvme16_off_device, 0)
    } else {
        let on_device = bytes_of(p16.device_chunks, ListKind::Params);
        (
            3 * off_device16 + 2 * on_device,
            u64::from(p16_reads) * nvme16_off_device,
            u64::from(p16_writes) * nvme16_off_device,
        )
    };
    let fb_nvme_r = nvme_r;
    let fb_nvme_w = nvme_w;
    let mut opt_r = 0;
    let mut opt_w = 0;
    for l in &lists[1..] {
        let kind = match l.list.as_str() {
            "master" => ListKind::Master,
            "m" => ListKind::Momentum,
            _ => ListKind::Variance,
        };
        let b = bytes_of(l.nvme_chunks, kind);
        opt_r += b;
        opt_w += b;
    }
    nvme_r += opt_r;
    nvme_w += opt_w;
    let compute = ComputeModel::new(workload, machine.compute_flops_per_s / 1e12);
    let compute_seconds = compute.iteration_seconds();
    let ranks = u64::from(machine.ranks.max(1));
    let (collective_bytes, collective_seconds) = collectives(workload, machine);
    let fb = compute_seconds
        .max(collective_seconds)
        .max(secs(pcie, machine.pcie_bytes_per_s))
        .max(
            secs(fb_nvme_r, machine.nvme_read_bytes_per_s)
                + secs(fb_nvme_w, machine.nvme_write_bytes_per_s),
        );
    let stepped = workload.params_trainable().div_ceil(ranks);
    let optimizer_seconds = secs(stepped, machine.optimizer_params_per_s).max(
        secs(opt_r, machine.nvme_read_bytes_per_s) + secs(opt_w, machine.nvme_write_bytes_per_s),
    );
    let forward = fb * compute.forward_fraction();
    let iteration_seconds = iteration(machine.overlap, forward, fb, optimizer_seconds);
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
        collective_bytes,
        collective_seconds,
        shard_padding_elements: workload.shard_padding(machine.ranks),
        compute_seconds,
        forward_backward_seconds: fb,
        optimizer_seconds,
        iteration_seconds,
        note: note(compute_seconds > 0.0, ranks > 1),
    })
}

/// What the projection leaves out, and what it assumes.
fn note(compute: bool, ranks: bool) -> String {
    let mut n = String::from(if compute {
        "compute at the given rate (matrices, attention, backward with recompute); compute, "
    } else {
        "data movement and the CPU optimizer only: the GPU's compute is not included (give \
         --tflops); "
    });
    n += if ranks {
        "collectives, PCIe and NVMe are assumed to overlap within a phase; the gathered \
         16-bit parameters of the block being computed take device memory beside the \
         activations, not counted here"
    } else {
        "PCIe and NVMe are assumed to overlap within a phase"
    };
    n
}

/// Bytes one of `machine.ranks` ranks sends (and receives) per iteration in ring
/// collectives — two all-gathers of every 16-bit parameter (bf16), one reduce-scatter
/// of the trained gradients (bf16), each `(ranks - 1) / ranks` of its bytes — and their
/// seconds over the link; nothing for one rank.
fn collectives(workload: &Workload, machine: &Machine) -> (u64, f64) {
    let ranks = u64::from(machine.ranks.max(1));
    if ranks == 1 {
        return (0, 0.0);
    }
    let gathered = 2 * 2 * workload.params_total();
    let reduced = 2 * workload.params_trainable();
    let bytes = (gathered + reduced) * (ranks - 1) / ranks;
    (bytes, secs(bytes, machine.link_bytes_per_s))
}

/// Seconds to move `bytes` at `rate` bytes/s (never, at a rate of 0).
fn secs(bytes: u64, rate: f64) -> f64 {
    if rate > 0.0 {
        bytes as f64 / rate
    } else {
        f64::INFINITY
    }
}

/// Measures this machine's CPU AdamW rate (bf16 gradients, moments stored as `moments`,
/// bf16 params out) over `params` parameters, the best of `repeats` steps.
pub fn measure_optimizer_rate(
    opt: &tidestore_optimizer::AdamW,
    params: usize,
    repeats: u32,
    moments: tidestore_chunk::MomentForm,
) -> Result<f64> {
    use half::bf16;
    use tidestore_chunk::MomentForm;
    use tidestore_optimizer::quant::absmax_len;
    use tidestore_optimizer::{Grads, HyperParams, Moments, ParamOut, Q8Mut, StepState};
    let mut master = vec![0.01f32; params];
    // The moments in the form the run stores them (the kernels differ in speed).
    let mut m = vec![0.0f32; params];
    let mut v = vec![0.0f32; params];
    let mut mb = vec![bf16::ZERO; params];
    let mut vb = vec![bf16::ZERO; params];
    let mut mc = vec![0u8; params];
    let mut vc = vec![0u8; params];
    let mut ma = vec![0.0f32; absmax_len(params)];
    let mut va = vec![0.0f32; absmax_len(params)];
    let g = vec![bf16::from_f32(1e-3); params];
    let mut out = vec![bf16::ZERO; params];
    let hp = HyperParams::default();
    let mut best = f64::INFINITY;
    for step in 1..=u64::from(repeats.max(1)) {
        let t = std::time::Instant::now();
        let mv = match moments {
            MomentForm::F32 => Moments::F32 {
                m: &mut m,
                v: &mut v,
            },
            MomentForm::BF16 => Moments::Bf16 {
                m: &mut mb,
                v: &mut vb,
            },
            MomentForm::Int8 => Moments::Int8 {
                m: Q8Mut {
                    codes: &mut mc,
                    absmax: &mut ma,
                },
                v: Q8Mut {
                    codes: &mut vc,
                    absmax: &mut va,
                },
            },
        };
        opt.step_moments(
            StepState::new(step),
            &hp,
            &mut master,
            mv,
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
    use tidestore::workload::{models, LoraTargets, ModelName};

    #[test]
    fn llama_70b_lora_on_a_24gb_gpu_uses_all_three_tiers() {
        let (w, layout) = llama_70b_lora();
        let m = gpu24_ram64_nvme2t();
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

    /// A 24 GB GPU, 56 GB of pinned host pool, a 2 TB NVMe; PCIe 25, NVMe 7 / 5 GB/s.
    fn gpu24_ram64_nvme2t() -> Machine {
        Machine {
            gpu_bytes: 24_000_000_000,
            tidal_margin_bytes: 0,
            host_budget_bytes: 56_000_000_000,
            nvme_bytes: 2_000_000_000_000,
            pcie_bytes_per_s: 25e9,
            compute_flops_per_s: 0.0,
            overlap: OverlapName::Off,
            ranks: 1,
            link_bytes_per_s: 25e9,
            nvme_read_bytes_per_s: 7e9,
            nvme_write_bytes_per_s: 5e9,
            optimizer_params_per_s: 1e9,
        }
    }

    /// `w`'s layout in auto-sized chunks, 1 MiB blocks and fp32 moments.
    fn auto_layout(w: &Workload) -> Layout {
        let (layout, _, _) = tidestore::session::layout_for(
            w,
            tidestore::config::AutoSize::Auto,
            1 << 20,
            tidestore_chunk::MomentForm::F32,
        )
        .unwrap();
        layout
    }

    fn llama_70b_lora() -> (Workload, Layout) {
        let w = Workload::new(
            ModelName::Llama70b,
            models::LLAMA_70B,
            Some((16, LoraTargets::Qv)),
            1,
            1024,
        );
        let layout = auto_layout(&w);
        (w, layout)
    }

    #[test]
    fn data_parallel_ranks_each_store_a_shard_and_pay_the_collectives() {
        let w = Workload::new(ModelName::Llama7b, models::LLAMA_7B, None, 1, 1024);
        let m = gpu24_ram64_nvme2t();
        let one = plan(&w, &auto_layout(&w), &m).unwrap();
        let m4 = Machine {
            ranks: 4,
            link_bytes_per_s: 10e9,
            ..m
        };
        let four = plan(&w, &auto_layout(&w.shard(4)), &m4).unwrap();
        // Each rank stores a quarter of every list (shards padded to whole elements).
        for (a, b) in one.lists.iter().zip(&four.lists) {
            let quarter = a.payload_bytes as f64 / 4.0;
            assert!(
                (b.payload_bytes as f64 - quarter).abs() / quarter < 1e-3,
                "{a:?} {b:?}"
            );
        }
        // Two all-gathers of the bf16 parameters and a reduce-scatter of the bf16
        // gradients, three quarters of each through every rank.
        let (p, t) = (w.params_total(), w.params_trainable());
        assert_eq!(one.collective_bytes, 0);
        assert_eq!(four.collective_bytes, (4 * p + 2 * t) * 3 / 4);
        let link = four.collective_bytes as f64 / 10e9;
        assert!((four.collective_seconds - link).abs() < 1e-9);
        assert!(four.forward_backward_seconds >= link);
        // A rank steps a quarter of the parameters.
        assert!(
            four.optimizer_seconds <= one.optimizer_seconds / 4.0 * 1.01,
            "{} vs {}",
            four.optimizer_seconds,
            one.optimizer_seconds
        );
        assert!(four.note.contains("collectives"), "{}", four.note);
        // Tensors 4 does not divide (none in LLaMA-7B) pad their shards; 3 ranks pad
        // every tensor of 4096 elements (a norm) by 2.
        assert_eq!(four.shard_padding_elements, 0);
        let m3 = Machine { ranks: 3, ..m4 };
        let three = plan(&w, &auto_layout(&w.shard(3)), &m3).unwrap();
        let pads: u64 = w
            .tensors
            .iter()
            .map(|t| {
                let n: u64 = t.shape.iter().map(|&d| d as u64).product();
                n.div_ceil(3) * 3 - n
            })
            .sum();
        assert!(pads > 0);
        assert_eq!(three.shard_padding_elements, pads);
    }

    /// The step after backward adds to the iteration; overlapping backward it runs
    /// beside backward's share of the compute, overlapping the next forward beside
    /// forward's: with compute modeled, each overlap is the slower of the two parts.
    #[test]
    fn each_overlap_hides_the_step_under_its_own_pass() {
        let w = Workload::new(ModelName::Llama7b, models::LLAMA_7B, None, 1, 1024);
        let m = Machine {
            compute_flops_per_s: 100e12,
            ..gpu24_ram64_nvme2t()
        };
        let at = |overlap| plan(&w, &auto_layout(&w), &Machine { overlap, ..m }).unwrap();
        let (off, bwd, fwd) = (
            at(OverlapName::Off),
            at(OverlapName::Backward),
            at(OverlapName::Forward),
        );
        let (fb, opt) = (off.forward_backward_seconds, off.optimizer_seconds);
        assert!(fb > 0.0 && opt > 0.0, "{fb} {opt}");
        assert!((off.iteration_seconds - (fb + opt)).abs() < 1e-9);
        let forward = fb * ComputeModel::new(&w, 100.0).forward_fraction();
        let want_bwd = forward + (fb - forward).max(opt);
        let want_fwd = forward.max(opt) + (fb - forward);
        assert!((bwd.iteration_seconds - want_bwd).abs() < 1e-9, "{bwd:?}");
        assert!((fwd.iteration_seconds - want_fwd).abs() < 1e-9, "{fwd:?}");
        assert!(fwd.iteration_seconds < off.iteration_seconds);
    }

    #[test]
    fn adapters_state_is_stored_as_the_bytes_it_uses() {
        let (w, layout) = llama_70b_lora();
        let m = gpu24_ram64_nvme2t();
        let p = plan(&w, &layout, &m).unwrap();
        // A host buffer / NVMe slot is the largest stored chunk: a 16-bit one, not an
        // fp32 chunk (twice the size) of which the adapters use a few percent.
        assert!(p.slot_bytes <= p.param16_chunk_bytes, "{p:?}");
        assert_eq!(
            p.slot_bytes,
            *layout.dense_chunk_bytes().iter().max().unwrap()
        );
        let adapters_fp32 = 4 * w.params_trainable();
        for l in &p.lists[1..] {
            assert!(l.bytes >= l.payload_bytes, "{l:?}");
            assert!(l.bytes - l.payload_bytes < 4096 * l.chunks, "{l:?}");
        }
        // Master, M and V on NVMe: read and written once, each the adapters' bytes
        // (page-rounded).
        assert!(p.nvme_write_bytes >= 3 * adapters_fp32);
        assert!(p.nvme_write_bytes < 3 * adapters_fp32 + 3 * 4096 * 4);
    }

    #[test]
    fn host_homes_go_where_they_save_the_most_nvme_seconds() {
        let w = Workload::new(ModelName::Gpt2, models::GPT2, None, 1, 1024);
        let layout = auto_layout(&w);
        let slot = *layout.dense_chunk_bytes().iter().max().unwrap();
        let m = Machine {
            gpu_bytes: 1 << 30,
            host_budget_bytes: 4 * slot,
            nvme_bytes: 1 << 40,
            ..gpu24_ram64_nvme2t()
        };
        let device_all = plan(&w, &layout, &m).unwrap();
        assert_eq!(
            device_all.lists[0].device_chunks,
            device_all.lists[0].chunks
        );
        // Every 16-bit chunk on the device: the three host homes go to optimizer state.
        let homed: u64 = device_all.lists[1..].iter().map(|l| l.host_chunks).sum();
        assert_eq!(homed, 3);
        // With 16-bit chunks off the device, their forward/backward/step traffic per
        // chunk (three reads and two writes) outweighs one step's read and write of an
        // fp32 chunk of twice the bytes: they are homed first, the rest after.
        let tight = Machine { gpu_bytes: 0, ..m };
        let p = plan(&w, &layout, &tight).unwrap();
        let n16 = p.lists[0].chunks;
        assert_eq!(p.lists[0].host_chunks, 3.min(n16), "{:?}", p.lists);
        let fp32_homed: u64 = p.lists[1..].iter().map(|l| l.host_chunks).sum();
        assert_eq!(fp32_homed, 3 - 3.min(n16), "{:?}", p.lists);
    }
}
