//! `tidestore finetune`: the `[train]` section's model fine-tuned on its text through the
//! store, a progress bar on stderr (loss, tokens/s), then a summary on stdout: the loss
//! from first to last step, tokens/s, where each step's time went (compute, waiting on
//! the store, optimizer), NVMe traffic, peak bytes per tier and the process's peak
//! resident memory; `--json` prints the report as JSON instead; `--plot FILE.svg` draws
//! the loss per step.

use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;
use tidestore::finetune::{self, FinetuneProgress, FinetuneReport, StepRecord};
use tidestore::plan::human_bytes;
use tidestore::Config;

use super::CliError;

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

/// Makes glibc serve allocations of 1 MiB and more straight from `mmap`, returned to the
/// OS when freed. The streamed trainer allocates and frees a block's parameters and
/// graph over and over; with glibc's default (a threshold that rises to 32 MiB after the
/// first frees) those land in heap arenas that fragment, and the process's resident
/// memory grows with the model's depth instead of staying at one block's working set.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn cap_heap_growth() {
    // SAFETY: `mallopt` only sets one of glibc malloc's tunables (under its own lock); it
    // has no pointer arguments and is called before the run allocates its buffers.
    let set = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20) };
    if set != 1 {
        tracing::warn!("mallopt(M_MMAP_THRESHOLD) refused; resident memory may grow with depth");
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn cap_heap_growth() {}

/// Runs `finetune`.
pub fn run(config: &Path, args: &FinetuneArgs) -> Result<(), CliError> {
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
    let report = finetune::run(&cfg, args.resume, &mut Bar(bar))?;
    if let Some(path) = &args.plot {
        draw(&report, path).map_err(|reason| CliError::Output {
            what: "cannot draw the loss curve into",
            path: path.clone(),
            reason,
        })?;
    }
    if args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| CliError::Output {
            what: "cannot encode the report as JSON for",
            path: "stdout".into(),
            reason: e.to_string(),
        })?;
        out!("{text}");
    } else {
        print(&report);
    }
    Ok(())
}

fn print(r: &FinetuneReport) {
    out!("tidestore finetune: {}", r.model);
    out!(
        "{} params, {} trained; text of {} tokens{}",
        r.params,
        r.params_trainable,
        r.text_tokens,
        r.resumed_from
            .map_or(String::new(), |s| format!("; resumed from step {s}"))
    );
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
        "NVMe: read {}, written {}; peak per tier: device {}, host {}, nvme {}; peak RSS {}",
        human_bytes(r.nvme_bytes.0),
        human_bytes(r.nvme_bytes.1),
        human_bytes(dev),
        human_bytes(host),
        human_bytes(nvme),
        r.peak_rss_bytes.map_or("n/a".into(), human_bytes)
    );
    for c in &r.checkpoints {
        out!("checkpoint: {}", c.display());
    }
    if let Some(e) = &r.export {
        out!("exported: {}", e.display());
    }
}

/// The loss per step, one line named `loss`.
fn draw(r: &FinetuneReport, path: &Path) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let points: Vec<(u32, f32)> = r.steps.iter().map(|s| (s.step, s.loss)).collect();
    let (Some(first), Some(last)) = (points.first(), points.last()) else {
        return Err("no step was run".into());
    };
    let hi = points.iter().map(|p| p.1).fold(f32::MIN, f32::max);
    let lo = points.iter().map(|p| p.1).fold(f32::MAX, f32::min);
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let root = SVGBackend::new(path, (1000, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("loss: {}", r.model), ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(60)
        .build_cartesian_2d(first.0..last.0.max(first.0 + 1), (lo - pad)..(hi + pad))
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("cross-entropy")
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(points, &BLUE))
        .map_err(|e| err(&e))?
        .label("loss")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}
