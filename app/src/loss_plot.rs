//! Loss curves of several runs in one SVG (feature `cli`, which brings plotters): the
//! curves on one pair of axes, and below them each curve's distance to the first one
//! (both averaged over a window of steps, as single steps are one batch each), which is
//! where runs that differ by a fraction of a percent — moment forms, say — can be told
//! apart. Used by `tidestore finetune --plot` and `examples/finetune.rs --plot`.

use std::ops::Range;
use std::path::Path;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::types::RangedCoordu32;
use plotters::coord::Shift;
use plotters::prelude::*;

/// One run: its label and `(step, loss)` points in step order.
#[derive(Debug, Clone)]
pub struct LossCurve {
    /// The legend entry.
    pub label: String,
    /// `(step, loss)`, steps increasing.
    pub points: Vec<(u32, f32)>,
}

/// Steps of the moving average in the lower panel.
pub const SMOOTH_STEPS: usize = 20;

/// The mean loss of the last `n` points (all if fewer).
pub fn final_loss(points: &[(u32, f32)], n: usize) -> f64 {
    let tail = &points[points.len().saturating_sub(n)..];
    tail.iter().map(|p| f64::from(p.1)).sum::<f64>() / tail.len().max(1) as f64
}

/// Trailing moving average over [`SMOOTH_STEPS`] points.
fn smooth(points: &[(u32, f32)]) -> Vec<(u32, f64)> {
    let mut out = Vec::with_capacity(points.len());
    let mut sum = 0.0;
    for (i, &(step, loss)) in points.iter().enumerate() {
        sum += f64::from(loss);
        if i >= SMOOTH_STEPS {
            sum -= f64::from(points[i - SMOOTH_STEPS].1);
        }
        out.push((step, sum / (i + 1).min(SMOOTH_STEPS) as f64));
    }
    out
}

/// The legend of a chart's labelled series, as every tidestore chart draws it: a
/// translucent white box with a black border.
pub(crate) fn draw_legend<'a, DB, CT>(chart: &mut ChartContext<'a, DB, CT>) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
{
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())
}

/// A panel of the plot on `area`, in the frame both panels share: `caption` in a
/// sans-serif of `caption_px` above, steps `steps` across, `y` up labelled
/// `y_desc`, the mesh drawn.
fn panel<'a, 'b, Y>(
    area: &'a DrawingArea<SVGBackend<'b>, Shift>,
    caption: String,
    caption_px: i32,
    steps: Range<u32>,
    y: Y,
    y_desc: &str,
) -> Result<ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordu32, Y::CoordDescType>>, String>
where
    Y: AsRangedCoord,
    Y::CoordDescType: ValueFormatter<Y::Value>,
{
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", caption_px))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(steps, y)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_desc)
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(chart)
}

/// Draws `curves` into the SVG at `path` (1000 x 700): the losses, and each curve's
/// smoothed loss minus the first curve's at the same steps, in percent of the latter.
pub fn draw_loss_curves(title: &str, curves: &[LossCurve], path: &Path) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let all = || curves.iter().flat_map(|c| c.points.iter());
    let first = all().map(|p| p.0).min().ok_or("no step was run")?;
    let last = all().map(|p| p.0).max().unwrap_or(first).max(first + 1);
    let hi = all().map(|p| p.1).fold(f32::MIN, f32::max);
    let lo = all().map(|p| p.1).fold(f32::MAX, f32::min);
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let root = SVGBackend::new(path, (1000, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (top, bottom) = root.split_vertically(430);
    let color = |k: usize| Palette99::pick(k).to_rgba();

    let mut chart = panel(
        &top,
        format!("loss: {title}"),
        18,
        first..last,
        (lo - pad)..(hi + pad),
        "cross-entropy",
    )?;
    for (k, c) in curves.iter().enumerate() {
        let col = color(k);
        chart
            .draw_series(LineSeries::new(c.points.iter().copied(), col))
            .map_err(|e| err(&e))?
            .label(c.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col));
    }
    draw_legend(&mut chart)?;

    // Lower panel: smoothed distance to the first curve, in percent.
    let Some(reference) = curves.first() else {
        return root.present().map_err(|e| err(&e));
    };
    let base: std::collections::HashMap<u32, f64> = smooth(&reference.points).into_iter().collect();
    let gaps: Vec<Vec<(u32, f64)>> = curves
        .iter()
        .map(|c| {
            smooth(&c.points)
                .into_iter()
                .filter_map(|(s, l)| base.get(&s).map(|b| (s, (l / b - 1.0) * 100.0)))
                .collect()
        })
        .collect();
    // Past the first window, where the averages have settled.
    let settled = |g: &&(u32, f64)| g.0 >= first + SMOOTH_STEPS as u32;
    let settled_gaps = || gaps.iter().flatten().filter(settled).map(|g| g.1);
    let ghi = settled_gaps().fold(0.0, f64::max);
    let glo = settled_gaps().fold(0.0, f64::min);
    let gpad = ((ghi - glo) * 0.1).max(0.1);
    let caption = format!(
        "loss against {} (moving average of {SMOOTH_STEPS} steps), %",
        reference.label
    );
    let mut gap_chart = panel(
        &bottom,
        caption,
        14,
        first..last,
        (glo - gpad)..(ghi + gpad),
        "difference, %",
    )?;
    for (k, g) in gaps.iter().enumerate() {
        let pts = g.iter().filter(settled).copied();
        gap_chart
            .draw_series(LineSeries::new(pts, color(k)))
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}
