//! Plots of a report, drawn with plotters as SVG and PNG: throughput and efficiency against
//! ranks, and bus bandwidth against message size.
//!
//! A plot is first described as data ([`LineChart`], built by pure functions), then drawn on
//! either backend by one function. PNG text needs a font file (plotters' bitmap backend
//! rasterises glyphs itself); SVG text does not (the viewer renders it), so the drawing avoids
//! every call that measures text — the caption and the legend are placed by hand — and SVG
//! plots come out even when no font can be found.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::busbw::{human_bytes, BenchGroup};
use super::tables::{Scaling, Table};
use crate::error::{Error, Result};

/// Font file used when `HPC_TRAIN_FONT` is not set (Debian package fonts-dejavu-core).
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
pub const FONT_ENV: &str = "HPC_TRAIN_FONT";

const SIZE: (u32, u32) = (900, 560);
const FONT: &str = "sans-serif";

/// Okabe-Ito colours: distinguishable with the common colour-vision deficiencies.
const COLOURS: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
];
const REFERENCE: RGBColor = RGBColor(128, 128, 128);

/// How x values are labelled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum XAxis {
    /// Counts on a linear axis: whole numbers only.
    Ranks,
    /// log2 of a rank count: labelled 1, 2, 4, 8 at whole powers of two.
    Log2Ranks,
    /// log2 of a byte count: labelled as sizes (4K, 1M) at whole powers of two.
    Log2Bytes,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum YAxis {
    Plain,
    Percent,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    /// None: the grey of reference lines.
    pub colour: Option<usize>,
    /// Dashed without markers (an ideal or a reference), else solid with a marker per point.
    pub reference: bool,
    /// Range bars (x, lowest, highest): the spread of a point's repeated runs.
    pub ranges: Vec<(f64, f64, f64)>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LineChart {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    pub x_axis: XAxis,
    pub y_axis: YAxis,
    pub series: Vec<Series>,
    /// The x values where a series may have a point (a table's rank counts). Two points of a
    /// series are joined only where no such x lies between them: a rank count a series lacks,
    /// or one whose median run did not reach the target, shows as a gap, not as a line across
    /// it. Empty: every point is joined to the next.
    pub x_grid: Vec<f64>,
}

fn scaling_title(table: &Table, what: &str) -> String {
    let mode = match table.key.scaling {
        Scaling::Weak => "weak scaling",
        Scaling::Strong => "strong scaling",
    };
    format!("{what}, {mode}: {} on {}, {}", table.key.model, table.key.dataset, table.key.device)
}

/// Images/s against ranks (log2 axis) per strategy, with a bar from the slowest to the fastest
/// run where a point ran more than once, and one ideal: linear scaling of the fastest 1-rank
/// run, drawn at every rank count of the table.
pub fn throughput_chart(table: &Table) -> LineChart {
    let mut series = Vec::new();
    for (i, s) in table.strategies.iter().enumerate() {
        let figures: Vec<_> = table.present().filter(|(name, _)| name == s).map(|(_, f)| f).collect();
        let points = figures.iter().map(|f| (log2(f.ranks), f.images_per_sec)).collect();
        let ranges = figures.iter().filter(|f| f.spread.runs > 1).map(|f| (log2(f.ranks), f.spread.min, f.spread.max)).collect();
        series.push(Series { label: s.clone(), points, colour: Some(i % COLOURS.len()), reference: false, ranges });
    }
    let best = table.strategies.iter().filter_map(|s| Some((s, table.one_rank(s)?))).max_by(|a, b| a.1.total_cmp(&b.1));
    if let Some((s, base)) = best {
        let points = table.ranks.iter().map(|&n| (log2(n), n as f64 * base)).collect();
        series.push(Series { label: format!("ideal (linear from {s} at 1 rank)"), points, colour: None, reference: true, ranges: Vec::new() });
    }
    LineChart {
        title: scaling_title(table, "Throughput"),
        x_desc: "ranks".into(),
        y_desc: "images/s".into(),
        x_axis: XAxis::Log2Ranks,
        y_axis: YAxis::Plain,
        series,
        x_grid: rank_grid(table),
    }
}

fn log2(ranks: usize) -> f64 {
    (ranks.max(1) as f64).log2()
}

/// The table's rank counts on the plots' log2 axis ([`LineChart::x_grid`]).
fn rank_grid(table: &Table) -> Vec<f64> {
    table.ranks.iter().map(|&n| log2(n)).collect()
}

/// `points` cut where an x of `grid` lies strictly between two of them: the runs of points a
/// line joins.
fn joined_runs(points: &[(f64, f64)], grid: &[f64]) -> Vec<Vec<(f64, f64)>> {
    let mut runs: Vec<Vec<(f64, f64)>> = Vec::new();
    for &p in points {
        match runs.last_mut() {
            Some(run) if !grid.iter().any(|&x| run.last().is_some_and(|last| last.0 < x && x < p.0)) => run.push(p),
            _ => runs.push(vec![p]),
        }
    }
    runs
}

/// Scaling efficiency (%) against ranks (log2 axis), for the strategies with a 1-rank run, and
/// the one ideal of 100%; None when no strategy has a 1-rank run.
pub fn efficiency_chart(table: &Table) -> Option<LineChart> {
    let mut series = Vec::new();
    for (i, s) in table.strategies.iter().enumerate() {
        let figures: Vec<_> = table.present().filter(|(name, f)| name == s && f.efficiency.is_some()).map(|(_, f)| f).collect();
        let points: Vec<(f64, f64)> = figures.iter().map(|f| (log2(f.ranks), f.efficiency.unwrap_or(f64::NAN) * 100.0)).collect();
        // The runs' spread on the same scale: each run's images/s over the median 1-rank base.
        let ranges = figures
            .iter()
            .filter(|f| f.spread.runs > 1)
            .filter_map(|f| {
                let per_image = f.efficiency? * 100.0 / f.images_per_sec;
                Some((log2(f.ranks), f.spread.min * per_image, f.spread.max * per_image))
            })
            .collect();
        if !points.is_empty() {
            series.push(Series { label: s.clone(), points, colour: Some(i % COLOURS.len()), reference: false, ranges });
        }
    }
    if series.is_empty() {
        return None;
    }
    let max_ranks = table.ranks.last().copied().unwrap_or(1);
    series.push(Series { label: "ideal (100%)".into(), points: vec![(0.0, 100.0), (log2(max_ranks), 100.0)], colour: None, reference: true, ranges: Vec::new() });
    Some(LineChart {
        title: scaling_title(table, "Efficiency"),
        x_desc: "ranks".into(),
        y_desc: "scaling efficiency".into(),
        x_axis: XAxis::Log2Ranks,
        y_axis: YAxis::Percent,
        series,
        x_grid: rank_grid(table),
    })
}

/// Test accuracy (%) after the last epoch against ranks, a series per column (strategy and
/// recipe): in a weak-scaling study the global batch grows with the ranks, and this shows what
/// the larger batch costs in accuracy. None when no run has a test accuracy.
pub fn accuracy_chart(table: &Table) -> Option<LineChart> {
    let mut series = Vec::new();
    for (i, s) in table.strategies.iter().enumerate() {
        let points: Vec<(f64, f64)> = table.present().filter(|(name, _)| name == s).filter_map(|(_, f)| Some((log2(f.ranks), f.test_accuracy? * 100.0))).collect();
        if !points.is_empty() {
            series.push(Series { label: s.clone(), points, colour: Some(i % COLOURS.len()), reference: false, ranges: Vec::new() });
        }
    }
    (!series.is_empty()).then(|| LineChart {
        title: scaling_title(table, "Test accuracy"),
        x_desc: "ranks".into(),
        y_desc: "test accuracy after the last epoch".into(),
        x_axis: XAxis::Log2Ranks,
        y_axis: YAxis::Percent,
        series,
        x_grid: rank_grid(table),
    })
}

/// Seconds of training to the target accuracy against ranks (log2 axis), a series per column,
/// at the points whose median run reached it, with the range of the runs that did. None when no
/// point reached its target.
pub fn time_to_accuracy_chart(table: &Table) -> Option<LineChart> {
    let mut series = Vec::new();
    let mut target = None;
    for (i, s) in table.strategies.iter().enumerate() {
        let reached: Vec<_> = table.present().filter(|(name, _)| name == s).filter_map(|(_, f)| Some((f.ranks, f.target?))).filter(|(_, t)| t.reached.is_some()).collect();
        let points = reached.iter().filter_map(|(n, t)| Some((log2(*n), t.reached?.0))).collect::<Vec<_>>();
        let ranges = reached.iter().filter(|(_, t)| t.runs > 1).filter_map(|(n, t)| Some((log2(*n), t.range?.0, t.range?.1))).collect();
        if let Some((_, t)) = reached.first() {
            target.get_or_insert(t.accuracy);
            series.push(Series { label: s.clone(), points, colour: Some(i % COLOURS.len()), reference: false, ranges });
        }
    }
    let target = target?;
    Some(LineChart {
        title: scaling_title(table, &format!("Time to {:.1}% accuracy", target * 100.0)),
        x_desc: "ranks".into(),
        y_desc: "seconds of training to the target".into(),
        x_axis: XAxis::Log2Ranks,
        y_axis: YAxis::Plain,
        series,
        x_grid: rank_grid(table),
    })
}

/// The pipelines' measured bubble (%, mean over the stages) against the micro-batches per step,
/// a series per stage count, schedule and rank count, with the balanced theory of each stage
/// count and interleaving dashed. None when no run of the table is pipelined.
pub fn bubble_chart(table: &Table) -> Option<LineChart> {
    use std::collections::BTreeMap;
    let mut measured: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut theory: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (name, f) in table.present() {
        let Some((bubble, ideal)) = f.bubble else { continue };
        let Some(p) = table.cell(name, f.ranks).and_then(|c| c.record.pipeline.as_ref()) else { continue };
        let v = if p.virtual_stages > 1 { format!(" V={}", p.virtual_stages) } else { String::new() };
        let recompute = if p.recompute { ", recompute" } else { "" };
        let m = p.micro_batches as f64;
        measured.entry(format!("P={} {}{v}{recompute}, {} ranks", p.pipeline_stages, p.schedule, f.ranks)).or_default().push((m, bubble * 100.0));
        theory.entry(format!("theory P={}{v}", p.pipeline_stages)).or_default().push((m, ideal * 100.0));
    }
    if measured.is_empty() {
        return None;
    }
    let tidy = |mut points: Vec<(f64, f64)>| {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        points.dedup_by(|a, b| a.0 == b.0);
        points
    };
    let mut series: Vec<Series> =
        measured.into_iter().enumerate().map(|(i, (label, points))| Series { label, points: tidy(points), colour: Some(i % COLOURS.len()), reference: false, ranges: Vec::new() }).collect();
    series.extend(theory.into_iter().map(|(label, points)| Series { label, points: tidy(points), colour: None, reference: true, ranges: Vec::new() }));
    Some(LineChart {
        title: scaling_title(table, "Pipeline bubble"),
        x_desc: "micro-batches per step".into(),
        y_desc: "idle share of the pipelined phase".into(),
        x_axis: XAxis::Ranks,
        y_axis: YAxis::Percent,
        series,
        x_grid: Vec::new(),
    })
}

/// Bus bandwidth against message size (log2 axis), a series per strategy.
pub fn busbw_chart(group: &BenchGroup) -> LineChart {
    let series = group
        .series
        .iter()
        .enumerate()
        .map(|(i, (strategy, points))| Series {
            label: strategy.clone(),
            points: points.iter().map(|&(bytes, busbw)| ((bytes.max(1) as f64).log2(), busbw)).collect(),
            colour: Some(i),
            reference: false,
            ranges: Vec::new(),
        })
        .collect();
    LineChart {
        title: group.key.title(),
        x_desc: "message size (bytes)".into(),
        y_desc: "bus bandwidth (GB/s)".into(),
        x_axis: XAxis::Log2Bytes,
        y_axis: YAxis::Plain,
        series,
        x_grid: Vec::new(),
    }
}

/// Registers the font for PNG text, once per process: the file named by `HPC_TRAIN_FONT`,
/// else [`DEFAULT_FONT`]. Ok(path) when PNG plots can be drawn; Err(why) names the file that
/// is missing or unusable.
pub fn load_font() -> std::result::Result<PathBuf, String> {
    static FONT_LOADED: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    FONT_LOADED
        .get_or_init(|| {
            let (path, origin) = match std::env::var_os(FONT_ENV) {
                Some(p) => (PathBuf::from(p), format!(" (from {FONT_ENV})")),
                None => (PathBuf::from(DEFAULT_FONT), format!(" (Debian package fonts-dejavu-core; or set {FONT_ENV} to a TTF file)")),
            };
            let bytes = std::fs::read(&path).map_err(|e| format!("font {}{origin}: {e}", path.display()))?;
            // plotters keeps a 'static reference to the font: the bytes live as long as the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font(FONT, FontStyle::Normal, bytes)
                .map_err(|_| format!("font {}{origin}: not a TrueType or OpenType font", path.display()))?;
            Ok(path)
        })
        .clone()
}

/// Writes `<stem>.svg`, and `<stem>.png` when `png` (a font is registered). Returns the files.
pub fn write(chart: &LineChart, stem: &Path, png: bool) -> Result<Vec<PathBuf>> {
    let failed = |path: &Path, e: &dyn std::fmt::Display| Error::Results(format!("{}: drawing the plot failed: {e}", path.display()));
    let svg = stem.with_extension("svg");
    {
        let root = SVGBackend::new(&svg, SIZE).into_drawing_area();
        draw(&root, chart).and_then(|()| root.present()).map_err(|e| failed(&svg, &e))?;
    }
    let mut written = vec![svg];
    if png {
        let png = stem.with_extension("png");
        {
            let root = BitMapBackend::new(&png, SIZE).into_drawing_area();
            draw(&root, chart).and_then(|()| root.present()).map_err(|e| failed(&png, &e))?;
        }
        written.push(png);
    }
    Ok(written)
}

type DrawResult<DB> = std::result::Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// The x and y ranges: from 0 (ranks, values) or half a step before the smallest size, to a
/// little beyond the largest value.
fn ranges(chart: &LineChart) -> (std::ops::Range<f64>, std::ops::Range<f64>) {
    let points = || chart.series.iter().flat_map(|s| s.points.iter());
    let x_max = points().map(|p| p.0).fold(1.0, f64::max);
    let bar_tops = chart.series.iter().flat_map(|s| s.ranges.iter().map(|r| r.2));
    let y_max = points().map(|p| p.1).chain(bar_tops).filter(|y| y.is_finite()).fold(0.0, f64::max);
    let x = match chart.x_axis {
        XAxis::Ranks => 0.0..x_max * 1.05 + 0.2,
        XAxis::Log2Bytes | XAxis::Log2Ranks => {
            let x_min = points().map(|p| p.0).fold(f64::INFINITY, f64::min);
            let x_min = if x_min.is_finite() { x_min } else { 0.0 };
            x_min.floor() - 0.5..x_max.ceil() + 0.5
        }
    };
    let y_top = match chart.y_axis {
        YAxis::Plain => y_max * 1.1,
        YAxis::Percent => (y_max * 1.1).max(110.0),
    };
    (x, 0.0..if y_top > 0.0 { y_top } else { 1.0 })
}

fn x_label(axis: XAxis, x: f64) -> String {
    // Key points between whole numbers (0.5 ranks, 2^12.5 bytes) are left blank.
    if (x - x.round()).abs() > 1e-9 {
        return String::new();
    }
    match axis {
        XAxis::Ranks => format!("{x:.0}"),
        XAxis::Log2Ranks => format!("{:.0}", x.round().exp2()),
        XAxis::Log2Bytes => human_bytes(x.round().exp2()),
    }
}

/// Short labels: 950, 1.2k, 12k, 3.4M, 0.25; percentages whole.
fn y_label(axis: YAxis, y: f64) -> String {
    if axis == YAxis::Percent {
        return format!("{y:.0}%");
    }
    let trim = |s: String| if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s };
    let a = y.abs();
    if a >= 1e6 {
        format!("{}M", trim(format!("{:.1}", y / 1e6)))
    } else if a >= 1e4 {
        format!("{:.0}k", y / 1e3)
    } else if a >= 1e3 {
        format!("{}k", trim(format!("{:.1}", y / 1e3)))
    } else if a >= 10.0 || y == 0.0 {
        format!("{y:.0}")
    } else {
        trim(format!("{y:.2}"))
    }
}

fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, chart: &LineChart) -> DrawResult<DB> {
    root.fill(&WHITE)?;
    // Caption and legend are drawn as plain text at fixed places: measuring text would need
    // the font, which the SVG plots must do without.
    let title_style = TextStyle::from((FONT, 22).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
    root.draw_text(&chart.title, &title_style, (SIZE.0 as i32 / 2, 12))?;
    let longest = chart.series.iter().map(|s| s.label.chars().count()).max().unwrap_or(0) as u32;
    let legend_width = (48 + 9 * longest).clamp(120, SIZE.0 / 3);
    let (plot, legend) = root.split_horizontally(SIZE.0 - legend_width);

    let (x_range, y_range) = ranges(chart);
    let mut cc = ChartBuilder::on(&plot.margin(50, 10, 10, 10))
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x_range, y_range)?;
    let (x_axis, y_axis) = (chart.x_axis, chart.y_axis);
    cc.configure_mesh()
        .x_desc(chart.x_desc.as_str())
        .y_desc(chart.y_desc.as_str())
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .x_label_formatter(&|x| x_label(x_axis, *x))
        .y_label_formatter(&|y| y_label(y_axis, *y))
        .draw()?;

    // Bars of different series at one x are set a little apart, so that they do not hide each
    // other: a twentieth of a doubling per series, centred on the point.
    let with_bars = chart.series.iter().filter(|s| !s.ranges.is_empty()).count();
    let mut bar_series = 0;
    for s in &chart.series {
        let colour = s.colour.map_or(REFERENCE, |i| COLOURS[i % COLOURS.len()]);
        if s.reference {
            cc.draw_series(DashedLineSeries::new(s.points.iter().copied(), 8, 6, colour.stroke_width(2)))?;
        } else {
            for run in joined_runs(&s.points, &chart.x_grid) {
                cc.draw_series(LineSeries::new(run, colour.stroke_width(2)))?;
            }
            cc.draw_series(s.points.iter().map(|&p| Circle::new(p, 4, colour.filled())))?;
            // A range bar: a vertical line from the slowest to the fastest run, capped.
            // Caps are a tenth of a doubling wide (the x axes with bars are log2 ranks).
            let dodge = (bar_series as f64 - (with_bars as f64 - 1.0) / 2.0) * 0.05;
            bar_series += usize::from(!s.ranges.is_empty());
            for &(x, lo, hi) in s.ranges.iter().filter(|r| r.2 > r.1) {
                let x = x + dodge;
                let style = colour.stroke_width(2);
                cc.draw_series([(x, lo, x, hi), (x - 0.05, lo, x + 0.05, lo), (x - 0.05, hi, x + 0.05, hi)].map(|(x0, y0, x1, y1)| PathElement::new(vec![(x0, y0), (x1, y1)], style)))?;
            }
        }
    }

    let label_style = TextStyle::from((FONT, 15).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    for (i, s) in chart.series.iter().enumerate() {
        let colour = s.colour.map_or(REFERENCE, |i| COLOURS[i % COLOURS.len()]);
        let y = 70 + 24 * i as i32;
        let line = [(4, y), (32, y)];
        if s.reference {
            legend.draw(&PathElement::new(vec![line[0], (14, y)], colour.stroke_width(2)))?;
            legend.draw(&PathElement::new(vec![(22, y), line[1]], colour.stroke_width(2)))?;
        } else {
            legend.draw(&PathElement::new(line.to_vec(), colour.stroke_width(2)))?;
            legend.draw(&Circle::new((18, y), 4, colour.filled()))?;
        }
        legend.draw_text(&s.label, &label_style, (40, y))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tables::{group, tests::record, tests::repeat};

    #[test]
    fn the_bubble_is_plotted_against_the_micro_batches_with_its_theory() {
        let with = |m: usize, bubble: f64| {
            let mut r = record("ring", 2, 100.0);
            r.pipeline = Some(crate::results::PipelineRecord { pipeline_stages: 2, micro_batches: m, schedule: "1f1b".into(), virtual_stages: 1, bubble: vec![bubble, bubble], theoretical_bubble: 1.0 / (m as f64 + 1.0), ..Default::default() });
            r
        };
        let runs = [record("ring", 1, 60.0), with(4, 0.25), with(8, 0.12)];
        let chart = bubble_chart(&group(&runs).unwrap()[0]).unwrap();
        let labels: Vec<&str> = chart.series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, vec!["P=2 1f1b, 2 ranks", "theory P=2"]);
        assert_eq!(chart.series[0].points, vec![(4.0, 25.0), (8.0, 12.0)]);
        assert!(chart.series[1].reference && (chart.series[1].points[1].1 - 100.0 / 9.0).abs() < 1e-9);
        assert!(bubble_chart(&group(&runs[..1]).unwrap()[0]).is_none());
    }

    #[test]
    fn accuracy_is_plotted_per_column_where_runs_have_it() {
        let with = |ranks: usize, accuracy: Option<f64>, optimizer: &str| {
            let mut r = record("ring", ranks, 100.0);
            r.test_accuracy = accuracy;
            r.optimizer = Some(optimizer.into());
            r
        };
        let runs = vec![with(1, Some(0.9), "sgd"), with(8, Some(0.8), "sgd"), with(8, Some(0.88), "lars"), with(2, None, "adamw")];
        let tables = group(&runs).unwrap();
        let chart = accuracy_chart(&tables[0]).unwrap();
        let labels: Vec<&str> = chart.series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, vec!["ring", "ring (lars, constant)"], "the AdamW column has no accuracy to plot");
        assert_eq!(chart.series[0].points, vec![(0.0, 90.0), (3.0, 80.0)]);
        assert!(accuracy_chart(&group(&runs[3..]).unwrap()[0]).is_none());
    }

    /// Points that ran more than once get a bar from the slowest to the fastest run, on the
    /// throughput and the efficiency plots alike; time to accuracy gets one from the runs that
    /// reached it. The bars are drawn (an SVG without a font).
    #[test]
    fn repeated_points_get_range_bars_and_time_to_accuracy_a_plot() {
        let mut runs = vec![repeat("ring", 1, 100.0, 0), repeat("ring", 1, 80.0, 1), repeat("ring", 1, 120.0, 2), repeat("ring", 2, 180.0, 0)];
        for (r, reached) in runs.iter_mut().zip([Some(30.0), Some(10.0), Some(20.0), None]) {
            r.target_accuracy = Some(0.8);
            r.time_to_target_s = reached;
            r.epoch_to_target = reached.map(|_| 2);
        }
        let tables = group(&runs).unwrap();
        let throughput = throughput_chart(&tables[0]);
        assert_eq!(throughput.series[0].ranges, vec![(0.0, 80.0, 120.0)], "one run at 2 ranks: no bar there");
        let efficiency = efficiency_chart(&tables[0]).unwrap();
        assert_eq!(efficiency.series[0].ranges, vec![(0.0, 80.0, 120.0)]);
        let tta = time_to_accuracy_chart(&tables[0]).unwrap();
        assert_eq!(tta.title, "Time to 80.0% accuracy, weak scaling: tiny on fashion-mnist, cpu");
        assert_eq!((tta.series[0].points.clone(), tta.series[0].ranges.clone()), (vec![(0.0, 20.0)], vec![(0.0, 10.0, 30.0)]));
        // The y axis reaches the top of the highest bar.
        assert!(ranges(&throughput).1.end >= 120.0 * 1.1 - 1e-9);
        let dir = std::env::temp_dir().join(format!("hpc-train-plots-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let written = write(&throughput, &dir.join("t"), false).unwrap();
        let svg = std::fs::read_to_string(&written[0]).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(svg.matches("<polyline").count() >= 3 + 3, "the bar and its two caps beside the lines:\n{svg}");
        // Without a target reached anywhere there is no plot.
        assert!(time_to_accuracy_chart(&group(&runs[3..]).unwrap()[0]).is_none());
    }

    #[test]
    fn throughput_has_an_ideal_only_where_a_1_rank_run_exists() {
        let runs = vec![record("ring", 1, 100.0), record("ring", 4, 360.0), record("allreduce", 2, 180.0)];
        let tables = group(&runs).unwrap();
        let chart = throughput_chart(&tables[0]);
        let labels: Vec<&str> = chart.series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, vec!["allreduce", "ring", "ideal (linear from ring at 1 rank)"]);
        // One ideal, at every rank count, x on a log2 axis.
        assert_eq!(chart.series[2].points, vec![(0.0, 100.0), (1.0, 200.0), (2.0, 400.0)]);
        assert_eq!(chart.series[1].points, vec![(0.0, 100.0), (2.0, 360.0)]);
        // ring has no 2-rank run: its line stops at 1 rank and starts again at 4.
        assert_eq!(joined_runs(&chart.series[1].points, &chart.x_grid), vec![vec![(0.0, 100.0)], vec![(2.0, 360.0)]]);
        let efficiency = efficiency_chart(&tables[0]).unwrap();
        assert_eq!(efficiency.series[0].points, vec![(0.0, 100.0), (2.0, 90.0)]);
        assert_eq!(efficiency.series.len(), 2, "ring and the 100% line; allreduce has no 1-rank run");
        let no_base = group(&runs[2..]).unwrap();
        assert!(efficiency_chart(&no_base[0]).is_none());
    }

    #[test]
    fn a_line_joins_neighbouring_rank_counts_only() {
        let grid = [0.0, 1.0, 2.0, 3.0];
        assert_eq!(joined_runs(&[(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)], &grid), vec![vec![(0.0, 1.0), (1.0, 2.0)], vec![(3.0, 4.0)]]);
        assert_eq!(joined_runs(&[(0.0, 1.0), (3.0, 4.0)], &[]), vec![vec![(0.0, 1.0), (3.0, 4.0)]], "no grid: all joined");
        assert!(joined_runs(&[], &grid).is_empty());
        // A point whose median run missed the target leaves a gap in time to accuracy.
        let mut runs = vec![record("ring", 1, 100.0), record("ring", 2, 180.0), record("ring", 4, 300.0)];
        for (r, reached) in runs.iter_mut().zip([Some(30.0), None, Some(12.0)]) {
            r.target_accuracy = Some(0.8);
            r.time_to_target_s = reached;
            r.epoch_to_target = reached.map(|_| 2);
        }
        let tta = time_to_accuracy_chart(&group(&runs).unwrap()[0]).unwrap();
        assert_eq!(joined_runs(&tta.series[0].points, &tta.x_grid), vec![vec![(0.0, 30.0)], vec![(2.0, 12.0)]]);
    }

    #[test]
    fn axis_labels_appear_at_whole_numbers_only() {
        assert_eq!(x_label(XAxis::Ranks, 4.0), "4");
        assert_eq!(x_label(XAxis::Ranks, 2.5), "");
        assert_eq!(x_label(XAxis::Log2Bytes, 20.0), "1M");
        assert_eq!(x_label(XAxis::Log2Bytes, 12.5), "");
        assert_eq!(y_label(YAxis::Percent, 90.0), "90%");
        assert_eq!(x_label(XAxis::Log2Ranks, 3.0), "8");
        assert_eq!(x_label(XAxis::Log2Ranks, 2.5), "");
        let labels: Vec<String> = [0.0, 0.25, 80.0, 950.0, 1200.0, 1000.0, 12_500.0, 3_400_000.0].iter().map(|&y| y_label(YAxis::Plain, y)).collect();
        assert_eq!(labels, ["0", "0.25", "80", "950", "1.2k", "1k", "12k", "3.4M"]);
    }
}
