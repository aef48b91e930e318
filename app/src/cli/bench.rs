//! `tidestore bench`: the configured workload through the real store and optimizer,
//! with a progress bar per phase on stderr, then a report on stdout: a table per phase
//! (time, stall, peaks) and per link (bytes and GB/s), the optimizer's rate, and what was
//! emulated; `--json` prints the report as JSON instead (schema in the README);
//! `--plot FILE.svg` draws the last iteration's tier occupancy and link traffic.

use std::collections::HashMap;
use std::path::PathBuf;

use crate::bench::{self, BenchReport, PhaseName, Progress};
use crate::plan::human_bytes;
use crate::scratch::{self, Scratch};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use tidestore::Config;

use super::{plot, Error};

/// Options of `bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Measured iterations after the warm-up [default: workload.iterations].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=100000))]
    iterations: Option<u32>,

    /// Print the report as JSON on stdout (the schema is in the README).
    #[arg(long)]
    json: bool,

    /// Draw each tier's occupancy and each link's traffic over the moments of the last
    /// iteration into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

/// Progress bars, one per phase, on stderr (hidden when stderr is not a terminal).
struct Bars {
    multi: MultiProgress,
    bars: HashMap<PhaseName, ProgressBar>,
    style: ProgressStyle,
    iterations: u32,
    current: Option<PhaseName>,
}

impl Progress for Bars {
    fn start(&mut self, phase: PhaseName, iteration: u32, steps: u64) {
        let style = self.style.clone();
        let multi = &self.multi;
        let bar = self.bars.entry(phase).or_insert_with(|| {
            let b = multi.add(ProgressBar::new(steps));
            b.set_style(style);
            b.set_prefix(format!("{:<9}", phase.as_str()));
            b
        });
        bar.set_length(steps);
        bar.set_position(0);
        self.current = Some(phase);
        bar.set_message(match (phase, iteration) {
            (PhaseName::Init, _) => "writing parameters".to_string(),
            (_, 0) => "warm-up (traced)".to_string(),
            (_, i) => format!("iteration {i}/{}", self.iterations),
        });
    }

    fn advance(&mut self, n: u64) {
        if let Some(b) = self.current.and_then(|p| self.bars.get(&p)) {
            b.inc(n);
        }
    }

    fn finish(&mut self, phase: PhaseName) {
        if let Some(b) = self.bars.get(&phase) {
            if let Some(len) = b.length() {
                b.set_position(len);
            }
        }
    }
}

impl Bars {
    fn done(&self) {
        for b in self.bars.values() {
            b.finish();
        }
    }
}

/// Runs the bench.
/// The prefix of a bench run's swap directory in `nvme.dir`: `bench.PID`.
const SWAP_DIR_PREFIX: &str = "bench.";

/// Points `nvme.dir` at this run's own folder in it (`bench.PID`, made now), so that no
/// other run (another bench, a finetune) shares the swap file; the folder is removed
/// when the guard drops (the run's end, an error) or on SIGINT/SIGTERM. What a killed
/// bench left (`bench.PID` of a dead process) is removed first.
fn own_swap_dir(cfg: &mut Config) -> Result<Scratch, Error> {
    let nvme = cfg.nvme_dir()?.to_path_buf();
    scratch::remove_dead(&nvme, SWAP_DIR_PREFIX);
    let dir = nvme.join(scratch::own_name(SWAP_DIR_PREFIX));
    let guard = Scratch::path(&dir);
    std::fs::create_dir(&dir)
        .map_err(|e| tidestore::Error::config("nvme.dir", format!("{}: {e}", dir.display())))?;
    cfg.nvme.dir = Some(dir);
    Ok(guard)
}

pub fn run(config: &std::path::Path, args: &BenchArgs) -> Result<(), Error> {
    let mut cfg = Config::load(config)?;
    if let Some(n) = args.iterations {
        cfg.workload.iterations = n;
    }
    if let Some(plot) = &args.plot {
        super::check_output_writable("--plot", plot)?;
    }
    let swap = own_swap_dir(&mut cfg)?;
    let style =
        ProgressStyle::with_template("{prefix} [{bar:40}] {pos:>6}/{len:6} {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
    let mut bars = Bars {
        multi: MultiProgress::new(),
        bars: HashMap::new(),
        style,
        iterations: cfg.workload.iterations,
        current: None,
    };
    let report = bench::run(&cfg, &mut bars)?;
    bars.done();
    let swap_dir = swap.target().to_path_buf();
    drop(swap);
    if let Some(path) = &args.plot {
        plot::draw(&report, path).map_err(Error::output("cannot write the plot", path))?;
    }
    if args.json {
        super::print_json(&report, "cannot encode the report as JSON for")?;
    } else {
        print_table(&report);
        explain_bound(&report);
        if let Some(path) = &args.plot {
            out!("plot: {}", path.display());
        }
        out!("swap directory (removed): {}", swap_dir.display());
    }
    Ok(())
}

/// What a time/bound below 1 and an efficiency above 1 mean: the bound is an estimate
/// from disk rates measured once, not a floor.
fn explain_bound(r: &BenchReport) {
    let b = &r.bound;
    if r.phases
        .iter()
        .any(|p| p.bound_seconds > 0.0 && p.seconds < p.bound_seconds)
    {
        out!(
            "time/bound below 1: that phase ran faster than its bound estimates: its NVMe \
             bytes were served faster than the disk rates measured before the first \
             iteration (the page cache, the drive's own cache)"
        );
    }
    if b.efficiency > 1.0 {
        out!(
            "efficiency above 1: the iteration ran faster than its bound, which is an \
             estimate, not a floor: its disk rates were measured once before the first \
             iteration, and reads the page cache or the drive's cache serve beat them"
        );
    }
}

fn gbps(bytes: u64, secs: f64) -> String {
    if secs > 0.0 {
        format!("{:.2} GB/s", bytes as f64 / secs / 1e9)
    } else {
        "-".into()
    }
}

fn print_table(r: &BenchReport) {
    let n = f64::from(r.iterations.max(1));
    let per = |b: u64| (b as f64 / n) as u64;
    out!("tidestore bench: {}", r.workload.description);
    out!(
        "device: {} ({} memory); budgets: device {} (tidal margin {}), host {}, nvme {}",
        r.budgets.device_kind,
        human_bytes(r.budgets.device_memory_bytes),
        human_bytes(r.budgets.device_bytes),
        human_bytes(r.budgets.tidal_margin_bytes),
        human_bytes(r.budgets.host_bytes),
        human_bytes(r.budgets.nvme_bytes)
    );
    let lists: Vec<String> = r
        .chunks
        .lists
        .iter()
        .map(|l| format!("{} {} x{}", l.list, human_bytes(l.bytes), l.chunks))
        .collect();
    out!(
        "chunks: {} elements ({}; 16-bit {}, fp32 {}; host buffer / swap slot {}), stored \
         {}; capacity no tensor uses {} (not stored)",
        r.chunks.chunk_elements,
        if r.chunks.searched {
            "searched"
        } else {
            "chunk.size"
        },
        human_bytes(r.chunks.param16_chunk_bytes),
        human_bytes(2 * r.chunks.param16_chunk_bytes),
        human_bytes(r.chunks.slot_bytes),
        lists.join(", "),
        human_bytes(r.chunks.waste_bytes)
    );
    out!(
        "policy {}, prefetch {} device accesses; init {:.2} s, warm-up {:.2} s, then {} iterations \
         of {:.2} s",
        r.policy,
        r.prefetch_lookahead,
        r.init_seconds,
        r.warmup_seconds,
        r.iterations,
        r.seconds_per_iteration
    );
    out!();
    out!("per iteration (mean of {}):", r.iterations);
    out!(
        "{:<10} {:>9} {:>10} {:>9} {:>12} {:>12} {:>12}",
        "phase",
        "time",
        "stalled",
        "accesses",
        "peak device",
        "peak host",
        "peak nvme"
    );
    for p in &r.phases {
        out!(
            "{:<10} {:>7.3} s {:>8.3} s {:>9} {:>12} {:>12} {:>12}",
            p.name,
            p.seconds / n,
            p.stall_seconds / n,
            p.accesses / u64::from(r.iterations.max(1)),
            human_bytes(p.peak_device_bytes),
            human_bytes(p.peak_host_bytes),
            human_bytes(p.peak_nvme_bytes)
        );
    }
    out!();
    out!(
        "{:<10} {:>24} {:>24} {:>24} {:>24}",
        "link",
        "host->device",
        "device->host",
        "nvme->host",
        "host->nvme"
    );
    let mut total = [0u64; 4];
    let mut total_secs = 0.0;
    for p in &r.phases {
        let b = [
            p.host_to_device_bytes,
            p.device_to_host_bytes,
            p.nvme_to_host_bytes,
            p.host_to_nvme_bytes,
        ];
        let cells: Vec<String> = b
            .iter()
            .map(|&x| format!("{} {}", human_bytes(per(x)), gbps(x, p.seconds)))
            .collect();
        out!(
            "{:<10} {:>24} {:>24} {:>24} {:>24}",
            p.name,
            cells[0],
            cells[1],
            cells[2],
            cells[3]
        );
        for (t, x) in total.iter_mut().zip(b) {
            *t += x;
        }
        total_secs += p.seconds;
    }
    let cells: Vec<String> = total
        .iter()
        .map(|&x| format!("{} {}", human_bytes(per(x)), gbps(x, total_secs)))
        .collect();
    out!(
        "{:<10} {:>24} {:>24} {:>24} {:>24}",
        "iteration",
        cells[0],
        cells[1],
        cells[2],
        cells[3]
    );
    out!();
    out!(
        "{:<10} {:>10} {:>10} {:>6} {:>10} {:>10} {:>11}",
        "nvme",
        "read",
        "in flight",
        "busy",
        "waited",
        "bound",
        "time/bound"
    );
    for p in &r.phases {
        out!(
            "{:<10} {:>10} {:>10.1} {:>5.0}% {:>8.3} s {:>8.3} s {:>11.2}",
            p.name,
            gbps(p.nvme_to_host_bytes, p.seconds),
            p.nvme_requests_in_flight,
            100.0 * p.nvme_busy_fraction,
            p.nvme_wait_seconds / n,
            p.bound_seconds / n,
            if p.bound_seconds > 0.0 {
                p.seconds / p.bound_seconds
            } else {
                0.0
            }
        );
    }
    out!(
        "(read: NVMe bytes read / phase time; in flight: requests of io.block_size on \
         average, at most {}; bound: max(the phase less its NVMe waits, its NVMe bytes at \
         the disk's rates below))",
        r.nvme_queue_depth
    );
    out!();
    out!(
        "peak per tier: device {}, host {}, nvme {}",
        human_bytes(r.peak.device_bytes),
        human_bytes(r.peak.host_bytes),
        human_bytes(r.peak.nvme_bytes)
    );
    let o = &r.optimizer;
    let kernel = o.cpu_kernel();
    let place = match (o.placement.as_str(), o.simulated) {
        ("gpu", false) => "gpu".to_string(),
        ("gpu", true) => format!("gpu simulated on the host ({kernel})"),
        (p, _) => format!("{p} ({kernel})"),
    };
    out!(
        "optimizer: step on {place} [{}], {} params per step, {} steps applied, {} skipped; \
         {:.3} G params/s with its I/O, {:.3} G params/s in the kernel; grad norm {:.4}",
        o.placement_reason,
        o.params_per_step,
        o.steps_applied,
        o.steps_skipped,
        o.params_per_s / 1e9,
        o.kernel_params_per_s / 1e9,
        o.grad_norm
    );
    let s = &r.store;
    out!(
        "store: {} device evictions, {} host evictions, {} demand loads, {} prefetch loads \
         ({} hits), {} divergences; NVMe reads: {} started ahead of their access, {} on demand",
        s.device_evictions,
        s.host_evictions,
        s.demand_loads,
        s.prefetch_loads,
        s.prefetch_hits,
        s.divergences,
        s.nvme_reads_ahead,
        s.nvme_reads_on_demand
    );
    print_overlap_and_bound(r);
    out!("checksum of every byte read: {}", r.checksum);
    out!("emulated: {}", r.emulated);
}

/// The overlap's counts, the iteration's bound and the disk's measured rates.
fn print_overlap_and_bound(r: &BenchReport) {
    let o = &r.optimizer;
    let b = &r.bound;
    let compute = if b.tflops > 0.0 {
        format!("compute {:.3} s at {} TFLOP/s", b.compute_seconds, b.tflops)
    } else {
        "compute not modeled (workload.tflops = 0)".to_string()
    };
    out!(
        "overlap {}: {} tensor steps during backward, {} in the next forward; bound per \
         iteration {:.3} s = max({compute}, PCIe {:.3} s, NVMe {:.3} s, optimizer kernel {:.3} \
         s); efficiency {:.2} (bound / measured)",
        o.overlap,
        o.tensors_overlapped,
        o.tensors_deferred,
        b.bound_seconds,
        b.pcie_seconds,
        b.nvme_seconds,
        b.optimizer_seconds,
        b.efficiency
    );
    out!(
        "disk (measured before the first iteration): read {:.2} GB/s (fresh file {:.2}, \
         swap file's chunks {:.2}), write {:.2} GB/s, mixed {:.2} GB/s",
        b.disk.read_bytes_per_s / 1e9,
        b.disk.fresh_read_bytes_per_s / 1e9,
        b.disk.swap_read_bytes_per_s / 1e9,
        b.disk.write_bytes_per_s / 1e9,
        b.disk.mixed_bytes_per_s / 1e9
    );
}
