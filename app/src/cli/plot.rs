//! `bench --plot FILE.svg`: the last measured iteration, moment by moment, drawn with
//! plotters' SVG backend. Top panel: bytes in use on each tier (`device`, `host`,
//! `nvme`) and the device budget for chunks (`device budget (tide)`). Bottom panel: the
//! traffic of each link (`host->device`, `device->host`, `nvme->host`, `host->nvme`) per
//! bucket of moments. Phase boundaries are named in the x-axis description.

use std::path::Path;

use crate::bench::{BenchReport, PhaseName, Sample};
use crate::loss_plot::draw_legend;
use plotters::prelude::*;

const MIB: f64 = (1u64 << 20) as f64;

/// A named line: its name, its points (moment, MiB) and its colour.
type Series = (&'static str, Vec<(u32, f64)>, RGBColor);

/// The series names, as they appear in the SVG (tests look for them).
pub const OCCUPANCY_SERIES: [&str; 4] = ["device", "host", "nvme", "device budget (tide)"];
/// The link series names.
pub const LINK_SERIES: [&str; 4] = ["host->device", "device->host", "nvme->host", "host->nvme"];

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Draws `report`'s samples into `path`.
pub fn draw(report: &BenchReport, path: &Path) -> Result<(), String> {
    let samples = &report.samples;
    if samples.is_empty() {
        return Err("no samples: the run had no measured iteration".into());
    }
    let moments = samples.last().map_or(1, |s| s.moment + 1);
    let root = SVGBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (top, bottom) = root.split_vertically(400);

    let occ = |f: &dyn Fn(&Sample) -> u64| -> Vec<(u32, f64)> {
        samples
            .iter()
            .map(|s| (s.moment, f(s) as f64 / MIB))
            .collect()
    };
    let series: Vec<Series> = vec![
        (
            OCCUPANCY_SERIES[0],
            occ(&|s| s.usage.device.used_bytes),
            RED,
        ),
        (OCCUPANCY_SERIES[1], occ(&|s| s.usage.host.used_bytes), BLUE),
        (
            OCCUPANCY_SERIES[2],
            occ(&|s| s.usage.nvme.used_bytes),
            GREEN,
        ),
        (
            OCCUPANCY_SERIES[3],
            occ(&|s| s.usage.device.capacity_bytes),
            MAGENTA,
        ),
    ];
    let caption = format!(
        "tier occupancy over one iteration: {}",
        report.workload.model
    );
    let x_desc = format!("moment ({})", phase_starts(samples));
    draw_panel(&top, caption, moments, x_desc, "MiB in use", series)?;

    // Link traffic per bucket of moments.
    let buckets = 200u32.min(moments).max(1);
    let width = moments.div_ceil(buckets).max(1);
    let cumulative: [fn(&Sample) -> u64; 4] = [
        |s| s.host_to_device_bytes,
        |s| s.device_to_host_bytes,
        |s| s.nvme_to_host_bytes,
        |s| s.host_to_nvme_bytes,
    ];
    let colors = [RED, BLUE, GREEN, BLACK];
    let mut links: Vec<Vec<(u32, f64)>> = Vec::new();
    for f in cumulative {
        let mut out = Vec::new();
        let mut prev = 0u64;
        let mut bucket_end = width;
        let mut last = 0u64;
        for s in samples {
            if s.moment >= bucket_end {
                out.push((bucket_end - width, (last - prev) as f64 / MIB));
                prev = last;
                bucket_end += width;
            }
            last = f(s);
        }
        out.push((bucket_end - width, (last - prev) as f64 / MIB));
        links.push(out);
    }
    let series: Vec<Series> = LINK_SERIES
        .iter()
        .zip(links)
        .zip(colors)
        .map(|((name, points), color)| (*name, points, color))
        .collect();
    let caption = format!("link traffic per {width} moments");
    draw_panel(
        &bottom,
        caption,
        moments,
        "moment".into(),
        "MiB moved",
        series,
    )?;
    root.present().map_err(err)?;
    Ok(())
}

/// Draws `series` as lines with a legend into `area` under `caption`: x the moments
/// from 0 to `moments`, y (MiB) from 0 to a tenth above the highest point (at least 1.1).
fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    caption: String,
    moments: u32,
    x_desc: String,
    y_desc: &str,
    series: Vec<Series>,
) -> Result<(), String> {
    let ymax = series
        .iter()
        .flat_map(|(_, v, _)| v.iter().map(|p| p.1))
        .fold(1.0f64, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(70)
        .build_cartesian_2d(0u32..moments, 0f64..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(err)?;
    for (name, points, color) in series {
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    draw_legend(&mut chart)
}

/// `forward from 0, backward from 310, optimizer from 620`.
fn phase_starts(samples: &[Sample]) -> String {
    let mut out = Vec::new();
    let mut last: Option<PhaseName> = None;
    for s in samples {
        if last != Some(s.phase) {
            out.push(format!("{} from {}", s.phase.as_str(), s.moment));
            last = Some(s.phase);
        }
    }
    out.join(", ")
}
