//! `tidestore finetune`: the `[train]` section's model fine-tuned on its text through the
//! store, a progress bar on stderr (loss, tokens/s), then a summary on stdout: the loss
//! from first to last step, tokens/s, where each step's time went (compute, waiting on
//! the store, optimizer), NVMe traffic, peak bytes per tier and the process's peak
//! resident memory; `--json` prints the report as JSON instead; `--plot FILE.svg` draws
//! the loss per step, with `--plot-with REPORT.json` the curves of earlier runs (their
//! `--json` reports, e.g. with other `optimizer.states`) on the same axes, and prints
//! each one's final loss against this run's.

use std::path::{Path, PathBuf};

use crate::finetune::{self, DataSummary, FinetuneProgress, FinetuneReport, StepRecord};
use crate::loss_plot::{draw_loss_curves, final_loss, LossCurve};
use crate::plan::human_bytes;
use indicatif::{ProgressBar, ProgressStyle};
use tidestore::Config;

use super::Error;

/// Options of `finetune`.
#[derive(Debug, clap::Args)]
pub struct FinetuneArgs {
    /// Continue from the newest checkpoint in train.checkpoint_dir.
    #[arg(long)]
    resume: bool,

    /// Steps to run in all [default: train.steps].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10000000))]
    steps: Option<u32>,

    /// Print the report as JSON on stdout.
    #[arg(long)]
    json: bool,

    /// Draw the loss per step into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,

    /// An earlier run's `--json` report whose loss curve is drawn with this run's (with
    /// --plot) and whose final loss is compared with this run's; repeatable.
    #[arg(long, value_name = "REPORT.json", requires = "plot")]
    plot_with: Vec<PathBuf>,
}

/// Steps the final loss is averaged over (single steps are one batch each: noisy).
const FINAL_STEPS: usize = 20;

/// A run's loss curve, from this run's report or an earlier run's `--json` file.
trait Curve: Sized {
    fn of(r: &FinetuneReport) -> Self;
    fn load(path: &Path) -> Result<Self, Error>;
}

impl Curve for LossCurve {
    fn of(r: &FinetuneReport) -> LossCurve {
        LossCurve {
            label: format!("this run ({})", r.states),
            points: r.steps.iter().map(|s| (s.step, s.loss)).collect(),
        }
    }

    /// A `--json` report of `tidestore finetune`, labelled by its `states` (or, in a
    /// report from before that field, its file name).
    fn load(path: &Path) -> Result<LossCurve, Error> {
        let bad = Error::output("cannot read the loss curve of", path);
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if v["schema"] != finetune::SCHEMA {
            return Err(bad(format!(
                "schema is {}, not {} (write it with `finetune --json`)",
                v["schema"],
                finetune::SCHEMA
            )));
        }
        let steps = v["steps"]
            .as_array()
            .ok_or_else(|| bad("no `steps` array".into()))?;
        let mut points = Vec::with_capacity(steps.len());
        for s in steps {
            match (s["step"].as_u64(), s["loss"].as_f64()) {
                (Some(step), Some(loss)) => points.push((step as u32, loss as f32)),
                _ => return Err(bad(format!("a step without `step` and `loss`: {s}"))),
            }
        }
        if points.is_empty() {
            return Err(bad("no step was run".into()));
        }
        let name = path
            .file_stem()
            .map_or(String::new(), |s| s.to_string_lossy().into_owned());
        let label = match v["states"].as_str() {
            Some(states) => format!("{states} ({name})"),
            None => name,
        };
        Ok(LossCurve { label, points })
    }
}

/// A progress bar over the steps, with the last loss and the token rate.
struct Bar(ProgressBar);

impl FinetuneProgress for Bar {
    fn begin(&mut self, first: u32, last: u32) {
        self.0.set_length(u64::from(last));
        self.0.set_position(u64::from(first.saturating_sub(1)));
        self.0.reset_eta();
    }

    fn step(&mut self, r: &StepRecord) {
        self.0.set_position(u64::from(r.step));
        self.0.set_message(format!(
            "loss {:.4}  {:.0} tok/s  lr {:.2e}",
            r.loss,
            r.tokens as f64 / r.seconds.max(1e-9),
            r.lr
        ));
    }

    fn end(&mut self) {
        self.0.finish_and_clear();
    }
}

/// Sets glibc malloc so that the streamed trainer reuses its heap instead of asking the
/// OS for fresh pages on every op, while resident memory stays at one block's working set.
///
/// The trainer allocates and frees the same sizes block after block (a block's
/// parameters, activations, gradients; the logits). Served from `mmap` (the earlier
/// 1 MiB threshold), each of those is zero-filled page by page when first touched and
/// unmapped when freed: on the 2-layer 0.23B model at sequence 512 that was 8.0 million
/// page faults and more system time than user time. Here nothing below 512 MiB is
/// mapped on its own, freed memory is kept for the next block (the heap's top is given
/// back only past 1 GiB free), and at most two arenas exist, so the rayon workers do not
/// each grow (and fragment) an arena of their own, which
/// could make resident memory grow with depth.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn cap_heap_growth() {
    let tunables = [
        ("M_MMAP_THRESHOLD", libc::M_MMAP_THRESHOLD, 512 << 20),
        ("M_TRIM_THRESHOLD", libc::M_TRIM_THRESHOLD, 1 << 30),
        ("M_ARENA_MAX", libc::M_ARENA_MAX, 2),
    ];
    for (name, param, value) in tunables {
        // SAFETY: `mallopt` only sets one of glibc malloc's tunables (under its own lock);
        // it has no pointer arguments and is called before the run allocates its buffers.
        if unsafe { libc::mallopt(param, value) } != 1 {
            tracing::warn!("mallopt({name}) refused; the heap may grow or fault more");
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn cap_heap_growth() {}

/// Runs `finetune`.
pub fn run(config: &Path, args: &FinetuneArgs) -> Result<(), Error> {
    cap_heap_growth();
    let mut cfg = Config::load(config)?;
    if let Some(n) = args.steps {
        cfg.train.steps = n;
    }
    let style = ProgressStyle::with_template(
        "finetune [{bar:32}] {pos}/{len} steps  {msg}  {elapsed_precise} eta {eta}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    let bar = ProgressBar::new(0).with_style(style);
    // Read the earlier reports first: a bad path fails before the run, not after it.
    let others = args
        .plot_with
        .iter()
        .map(|p| LossCurve::load(p))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(plot) = &args.plot {
        super::check_output_writable("--plot", plot)?;
    }
    // Launched as one of several ranks (`mpirun -np N`): rank 0 reports for the run.
    let ranks = crate::ranks::from_env()?;
    if ranks.is_some() {
        // Each rank on a machine its own GPU, unless the config names one.
        let gpu = cfg.device.ordinal.resolve(crate::ranks::local_rank()?);
        cfg.device.ordinal = tidestore::config::GpuOrdinal::Index(gpu);
    }
    let report = match &ranks {
        Some(r) => {
            let mut quiet = finetune::NoProgress;
            let progress: &mut dyn finetune::FinetuneProgress = if r.rank() == 0 {
                &mut Bar(bar)
            } else {
                &mut quiet
            };
            match finetune::run_with_ranks(&cfg, args.resume, progress, ranks.clone()) {
                Ok(_) if r.rank() != 0 => return Ok(()),
                Ok(report) => report,
                Err(e) => crate::ranks::fail(r, &e),
            }
        }
        None => finetune::run(&cfg, args.resume, &mut Bar(bar))?,
    };
    let mut curves = vec![LossCurve::of(&report)];
    curves.extend(others);
    if let Some(path) = &args.plot {
        draw_loss_curves(&report.model, &curves, path)
            .map_err(Error::output("cannot draw the loss curve into", path))?;
    }
    if args.json {
        super::print_json(&report, "cannot encode the report as JSON for")?;
    } else {
        print(&report);
        compare(&curves);
    }
    Ok(())
}

/// A data-parallel run: each rank's optimizer state, NVMe traffic and collectives.
fn print_ranks(r: &FinetuneReport) {
    let Some(dp) = &r.data_parallel else {
        return;
    };
    out!(
        "data parallel: {} ranks over {} (the figures above are rank 0's)",
        dp.ranks,
        dp.engine
    );
    for f in &dp.per_rank {
        let state: u64 = f.state_bytes.values().sum();
        let (read, written) = f
            .nvme_bytes_by_list
            .values()
            .fold((0, 0), |(a, b), (r, w)| (a + r, b + w));
        out!(
            "  rank {}: master, M and V {}; NVMe read {}, written {}; sent {} into \
             all-gathers, {} into reduce-scatters; waited {:.2} s for collectives",
            f.rank,
            human_bytes(state),
            human_bytes(read),
            human_bytes(written),
            human_bytes(f.sent.all_gather),
            human_bytes(f.sent.reduce_scatter),
            f.collective_wait_s
        );
    }
    let o = &dp.overlapped;
    out!(
        "  rank 0's fetches: {} gathered ahead, {} at the call ({} gathers ahead dropped); \
         {} gradients reduce-scattered behind",
        o.gathers_ahead,
        o.gathers_at_call,
        o.gathers_discarded,
        o.scatters_behind
    );
}

/// Each earlier run's final loss against this run's.
fn compare(curves: &[LossCurve]) {
    let [this, others @ ..] = curves else {
        return;
    };
    if others.is_empty() || this.points.is_empty() {
        return;
    }
    let mine = final_loss(&this.points, FINAL_STEPS);
    out!(
        "final loss (mean of the last {FINAL_STEPS} steps): {} {mine:.4}",
        this.label
    );
    for c in others {
        let theirs = final_loss(&c.points, FINAL_STEPS);
        out!(
            "  {} {theirs:.4}: this run is {:+.2} % against it",
            c.label,
            (mine / theirs - 1.0) * 100.0
        );
    }
}

/// What the data file gave, for a JSONL file (a text file says nothing more).
fn print_data(d: &DataSummary) {
    if d.format != "text" {
        out!(
            "data ({}): {} records, {} samples trained on ({} truncated); left out: {} longer \
             than train.sequence + 1, {} with no token that carries loss; {} tokens carry \
             loss, {} padding",
            d.format,
            d.records,
            d.samples,
            d.truncated,
            d.dropped_too_long,
            d.dropped_no_loss,
            d.loss_tokens,
            d.padding_tokens
        );
    }
}

fn print(r: &FinetuneReport) {
    out!("tidestore finetune: {}", r.model);
    let resumed = r
        .resumed_from
        .map_or(String::new(), |s| format!("; resumed from step {s}"));
    out!(
        "{} params, {} trained; text of {} tokens; blocks compute on {} (matrix products: \
         {}), reading the parameters {}; the optimizer steps on the {} ({}){resumed}",
        r.params,
        r.params_trainable,
        r.text_tokens,
        r.compute,
        r.matmul,
        if r.compute_reads == "host" {
            "in the host pool"
        } else {
            "on the device tier"
        },
        r.optimizer,
        r.optimizer_reason,
    );
    print_data(&r.data);
    let (Some(first), Some(last)) = (r.steps.first(), r.steps.last()) else {
        out!("no step run (train.steps already reached)");
        return;
    };
    let n = r.steps.len() as f64;
    let sum = |f: fn(&StepRecord) -> f64| r.steps.iter().map(f).sum::<f64>();
    let secs = sum(|s| s.seconds);
    let tokens = sum(|s| s.tokens as f64);
    out!(
        "steps {}..={}: loss {:.4} -> {:.4}; {:.0} tokens/s; {:.3} s per step = compute {:.3} s + \
         store {:.3} s + optimizer {:.3} s",
        first.step,
        last.step,
        first.loss,
        last.loss,
        tokens / secs.max(1e-9),
        secs / n,
        sum(|s| s.compute_seconds) / n,
        sum(|s| s.store_seconds) / n,
        sum(|s| s.optimizer_seconds) / n
    );
    let (dev, host, nvme) = r.peak_tier_bytes;
    out!(
        "NVMe: read {}, written {}; peak per tier: device {}, host {}, nvme {}; peak \
         activations {}; peak RSS {}",
        human_bytes(r.nvme_bytes.0),
        human_bytes(r.nvme_bytes.1),
        human_bytes(dev),
        human_bytes(host),
        human_bytes(nvme),
        human_bytes(r.activation_peak_bytes),
        r.peak_rss_bytes.map_or("n/a".into(), human_bytes)
    );
    print_ranks(r);
    for c in &r.checkpoints {
        out!("checkpoint (kept): {}", c.display());
    }
    if let Some(e) = &r.export {
        out!("exported: {}", e.display());
    }
    if let Some(e) = &r.export_merged {
        out!("exported merged: {}", e.display());
    }
    out!("swap directory (removed): {}", r.swap_dir.display());
}
