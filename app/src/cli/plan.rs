//! `tidestore plan`: where a model's chunk lists go on a machine given as GPU / RAM /
//! NVMe sizes and bandwidths, whether it fits, what is short, and the projected
//! iteration time. The workload and the sizes default to the config; the CPU AdamW
//! rate is measured here (a short run of the optimizer crate's kernel) unless given.

use crate::bench::cpu_optimizer;
use crate::plan::{self, human_bytes, Machine, PlanReport};
use clap::ValueEnum;
use tidestore::config::OverlapName;
use tidestore::session::{check_model_fits, layout_for};
use tidestore::workload::{human_count, ModelName, TrainMode};
use tidestore::{AutoSize, Config, Size};

use super::Error;

/// `--model` values.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModelArg {
    Gpt2,
    #[value(name = "gpt2-xl")]
    Gpt2Xl,
    #[value(name = "llama-7b")]
    Llama7b,
    #[value(name = "llama-13b")]
    Llama13b,
    #[value(name = "llama-70b")]
    Llama70b,
}

impl From<ModelArg> for ModelName {
    fn from(m: ModelArg) -> Self {
        match m {
            ModelArg::Gpt2 => ModelName::Gpt2,
            ModelArg::Gpt2Xl => ModelName::Gpt2Xl,
            ModelArg::Llama7b => ModelName::Llama7b,
            ModelArg::Llama13b => ModelName::Llama13b,
            ModelArg::Llama70b => ModelName::Llama70b,
        }
    }
}

/// Options of `plan`. Sizes take units (24GB, 64GiB, 2TB); bandwidths are GB/s.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Model [default: workload.model of the config].
    #[arg(long, value_enum)]
    model: Option<ModelArg>,

    /// LoRA of this rank (frozen base) instead of the config's mode.
    #[arg(long, value_name = "R", value_parser = clap::value_parser!(u32).range(1..=65536), conflicts_with = "full")]
    lora_rank: Option<u32>,

    /// Full fine-tuning instead of the config's mode.
    #[arg(long)]
    full: bool,

    /// GPU memory [default: the simulated device of the config].
    #[arg(long, value_name = "SIZE")]
    gpu: Option<Size>,

    /// Host RAM; the pinned pool gets it less --ram-reserve [default: host.budget].
    #[arg(long, value_name = "SIZE")]
    ram: Option<Size>,

    /// RAM left to the OS and the process when --ram is given.
    #[arg(long, value_name = "SIZE", default_value = "8GiB", requires = "ram")]
    ram_reserve: Size,

    /// NVMe space for the swap file [default: nvme.size].
    #[arg(long, value_name = "SIZE")]
    nvme: Option<Size>,

    /// Host <-> device bandwidth in GB/s, each way (PCIe 4.0 x16: about 25)
    /// [default: device.pcie_gbps].
    #[arg(long, value_name = "GB/s")]
    pcie: Option<f64>,

    /// The GPU's compute rate in TFLOP/s (0: compute not counted) [default:
    /// workload.tflops].
    #[arg(long, value_name = "TFLOP/s")]
    tflops: Option<f64>,

    /// NVMe read bandwidth in GB/s.
    #[arg(long, value_name = "GB/s", default_value_t = 7.0)]
    nvme_read: f64,

    /// NVMe write bandwidth in GB/s.
    #[arg(long, value_name = "GB/s", default_value_t = 5.0)]
    nvme_write: f64,

    /// Data-parallel ranks: GPUs, each with the GPU, RAM and NVMe above, every chunk
    /// list sharded across them (the plan is one rank's).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    gpus: u32,

    /// Bandwidth of a rank's collectives between GPUs in GB/s, each way (NCCL's bus
    /// bandwidth: about the PCIe rate without NVLink) [default: --pcie].
    #[arg(long, value_name = "GB/s", requires = "gpus")]
    link: Option<f64>,

    /// CPU AdamW rate in parameters per second [default: measured now].
    #[arg(long, value_name = "PARAMS/s")]
    optimizer_rate: Option<f64>,

    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
}

fn positive(flag: &'static str, v: f64) -> Result<f64, Error> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(Error::Usage {
            flag,
            reason: format!("{v} is not a positive number"),
        })
    }
}

/// The CPU AdamW rate: `given`, or measured now over the config's moments; whether
/// measured.
fn optimizer_rate(cfg: &Config, given: Option<f64>) -> Result<(f64, bool), Error> {
    Ok(match given {
        Some(r) => (positive("--optimizer-rate", r)?, false),
        None => {
            let opt = cpu_optimizer(cfg)?;
            let moments = cfg.optimizer.states.moments();
            (
                plan::measure_optimizer_rate(&opt, 8 << 20, 5, moments)?,
                true,
            )
        }
    })
}

/// The host pool of the plan: `--ram` less `--ram-reserve`, else `host.budget`.
fn plan_host(cfg: &Config, args: &PlanArgs) -> Result<u64, Error> {
    let Some(ram) = args.ram else {
        return Ok(cfg.host.budget.bytes());
    };
    let pool = ram.bytes().saturating_sub(args.ram_reserve.bytes());
    if pool == 0 {
        return Err(Error::Usage {
            flag: "--ram",
            reason: format!(
                "{ram} leaves nothing for the host pool after --ram-reserve {}",
                args.ram_reserve
            ),
        });
    }
    Ok(pool)
}

/// Refuses a custom model whose 16-bit parameters alone exceed what the plan's machine
/// holds (the GPU's room for chunks, its activations aside, the host pool and NVMe, per
/// rank), before a tensor is listed.
fn check_plan_room(cfg: &Config, args: &PlanArgs, host: u64, nvme: u64) -> Result<(), Error> {
    let gpu_room = match (args.gpu, cfg.device.sim_memory) {
        (Some(g), _) => g.bytes(),
        (None, AutoSize::Fixed(m)) => m.bytes(),
        (None, AutoSize::Auto) => cfg.device.budget.bytes(),
    };
    let room =
        [gpu_room, host, nvme].map(u128::from).iter().sum::<u128>() * u128::from(args.gpus.max(1));
    check_model_fits(
        &cfg.workload,
        room,
        "the plan's GPU + host pool + NVMe, times --gpus",
    )?;
    Ok(())
}

/// Runs the planner.
pub fn run(config: &std::path::Path, args: &PlanArgs) -> Result<(), Error> {
    let mut cfg = Config::load(config)?;
    if let Some(m) = args.model {
        let w = &mut cfg.workload;
        w.model = m.into();
        w.arch = None;
        w.layers = None;
        w.hidden = None;
        w.heads = None;
        w.kv_heads = None;
        w.intermediate = None;
        w.vocab = None;
    }
    if let Some(r) = args.lora_rank {
        cfg.workload.mode = TrainMode::Lora;
        cfg.workload.lora_rank = r;
    }
    if args.full {
        cfg.workload.mode = TrainMode::Full;
    }
    let host = plan_host(&cfg, args)?;
    let nvme = args.nvme.unwrap_or(cfg.nvme.size).bytes();
    check_plan_room(&cfg, args, host, nvme)?;
    let workload = cfg.workload.build()?;
    let pcie = positive("--pcie", args.pcie.unwrap_or(cfg.device.pcie_gbps))? * 1e9;
    let tflops = args.tflops.unwrap_or(cfg.workload.tflops);
    if !(tflops.is_finite() && tflops >= 0.0) {
        return Err(Error::Usage {
            flag: "--tflops",
            reason: format!("{tflops} is not a number >= 0"),
        });
    }
    let link = match args.link {
        Some(l) => positive("--link", l)? * 1e9,
        None => pcie,
    };
    let nvme_read = positive("--nvme-read", args.nvme_read)? * 1e9;
    let nvme_write = positive("--nvme-write", args.nvme_write)? * 1e9;
    let (rate, measured) = optimizer_rate(&cfg, args.optimizer_rate)?;
    let act = workload.activation_bytes().peak();
    let margin = cfg.device.tidal_margin.bytes();
    let gpu = match (args.gpu, cfg.device.sim_memory) {
        (Some(g), _) => g.bytes(),
        (None, AutoSize::Fixed(m)) => m.bytes(),
        (None, AutoSize::Auto) => cfg.device.budget.bytes() + act + margin,
    };
    let machine = Machine {
        gpu_bytes: gpu,
        tidal_margin_bytes: margin,
        host_budget_bytes: host,
        nvme_bytes: nvme,
        pcie_bytes_per_s: pcie,
        nvme_read_bytes_per_s: nvme_read,
        nvme_write_bytes_per_s: nvme_write,
        optimizer_params_per_s: rate,
        compute_flops_per_s: tflops * 1e12,
        overlap: cfg.optimizer.overlap,
        ranks: args.gpus,
        link_bytes_per_s: link,
    };
    let (layout, _, _) = layout_for(
        &workload.shard(args.gpus),
        cfg.chunk.size,
        cfg.io.block_size.bytes(),
        cfg.optimizer.states.moments(),
    )?;
    let report = plan::plan(&workload, &layout, &machine)?;
    if args.json {
        super::print_json(&report, "cannot encode the plan as JSON for")?;
    } else {
        print(&report, measured, args);
    }
    Ok(())
}

fn print(r: &PlanReport, measured: bool, args: &PlanArgs) {
    let m = &r.machine;
    out!("tidestore plan: {}", r.workload);
    out!(
        "machine: GPU {}, host pool {}{}, NVMe {}",
        human_bytes(m.gpu_bytes),
        human_bytes(m.host_budget_bytes),
        args.ram
            .map(|ram| format!(
                " (RAM {} less {} reserve)",
                human_bytes(ram.bytes()),
                human_bytes(args.ram_reserve.bytes())
            ))
            .unwrap_or_default(),
        human_bytes(m.nvme_bytes)
    );
    out!(
        "links: PCIe {:.1} GB/s each way, NVMe {:.1} GB/s read / {:.1} GB/s write; GPU {}; \
         CPU AdamW {:.3} G params/s ({})",
        m.pcie_bytes_per_s / 1e9,
        m.nvme_read_bytes_per_s / 1e9,
        m.nvme_write_bytes_per_s / 1e9,
        if m.compute_flops_per_s > 0.0 {
            format!("{} TFLOP/s", m.compute_flops_per_s / 1e12)
        } else {
            "compute not counted (--tflops)".to_string()
        },
        m.optimizer_params_per_s / 1e9,
        if measured {
            "measured now on this machine, bf16 grads, optimizer.states moments, 8M params"
        } else {
            "--optimizer-rate"
        }
    );
    print_ranks(r);
    out!(
        "device for chunks: {} = GPU less {} of activations (checkpointed, micro-batch and \
         sequence of the config) less {} margin",
        human_bytes(r.device_chunk_budget_bytes),
        human_bytes(r.activation_peak_bytes),
        human_bytes(m.tidal_margin_bytes)
    );
    out!(
        "chunks: 16-bit {}, fp32 {}, stored as the part their tensors use; host buffer / \
         NVMe slot {} (the largest stored chunk; one per chunk)",
        human_bytes(r.param16_chunk_bytes),
        human_bytes(2 * r.param16_chunk_bytes),
        human_bytes(r.slot_bytes)
    );
    out!();
    out!(
        "{:<8} {:>7} {:>12} {:>12} {:>16} {:>12} {:>12}",
        "list",
        "chunks",
        "stored",
        "payload",
        "device (fwd/bwd)",
        "host (home)",
        "nvme (home)"
    );
    let mut sparse = false;
    for l in &r.lists {
        sparse |= l.chunks * r.slot_bytes > 4 * l.bytes.max(1) && l.host_chunks > 0;
        out!(
            "{:<8} {:>7} {:>12} {:>12} {:>16} {:>12} {:>12}",
            l.list,
            l.chunks,
            human_bytes(l.bytes),
            human_bytes(l.payload_bytes),
            l.device_chunks,
            l.host_chunks,
            l.nvme_chunks
        );
    }
    if sparse {
        warn_sparse();
    }
    out!();
    if r.fits {
        out!("fits: yes");
    } else {
        out!("fits: NO");
        for s in &r.shortfalls {
            out!(
                "  {} short by {}: {} needs {}, has {}",
                s.resource,
                human_bytes(s.short_bytes),
                s.what,
                human_bytes(s.needed_bytes),
                human_bytes(s.available_bytes)
            );
        }
    }
    out!(
        "per iteration: PCIe {}, NVMe read {}, NVMe write {}; {} params trained",
        human_bytes(r.pcie_bytes),
        human_bytes(r.nvme_read_bytes),
        human_bytes(r.nvme_write_bytes),
        human_count(r.params_trainable)
    );
    out!(
        "projected: compute {:.2} s, forward+backward {:.2} s, optimizer step {:.2} s{}, \
         iteration {:.2} s",
        r.compute_seconds,
        r.forward_backward_seconds,
        r.optimizer_seconds,
        match r.machine.overlap {
            OverlapName::Off => "",
            OverlapName::Backward => " (overlapping backward)",
            OverlapName::Forward => " (overlapping the next forward)",
        },
        r.iteration_seconds
    );
    out!("note: {}", r.note);
}

/// The data-parallel line, with more than one rank.
fn print_ranks(r: &PlanReport) {
    let m = &r.machine;
    if m.ranks > 1 {
        out!(
            "data parallel: {} ranks, each the machine above, every chunk list sharded (the \
             lists below are one rank's 1/{} of each tensor); per rank and iteration {} in \
             ring collectives (16-bit parameters all-gathered for forward and backward, \
             gradients reduce-scattered) over a {:.1} GB/s link: {:.2} s",
            m.ranks,
            m.ranks,
            human_bytes(r.collective_bytes),
            m.link_bytes_per_s / 1e9,
            r.collective_seconds
        );
        if r.shard_padding_elements > 0 {
            out!(
                "  tensors {} ranks do not divide are cut into equal shards, the last \
                 zero-padded: {} elements of padding over all ranks",
                m.ranks,
                r.shard_padding_elements
            );
        }
    }
}

/// Chunks homed in host buffers far larger than they are.
fn warn_sparse() {
    out!(
        "warning: some chunks homed in the host pool are far smaller than its buffers: every \
         chunk's home is one whole host buffer or NVMe slot, sized for the largest chunk, so \
         small chunks (a few LoRA adapters' master, M and V) waste most of theirs; the plan \
         counts what the store would use"
    );
}
