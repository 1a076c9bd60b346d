//! Scaling tables from training records: which runs share a table, which record fills each
//! cell, the speedup and efficiency arithmetic, and the Markdown and CSV forms of a table.
//! Pure: the caller reads and writes the files.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use super::peaks;
use super::stats::{self, Statistic, Summary};
use crate::error::{Error, Result};
use crate::results::RunRecord;

/// Shown in a cell without a run: a missing rank count is never interpolated.
pub const NO_RUN: &str = "—";
/// Shown where a figure cannot be computed (no 1-rank run to compare with).
pub const NOT_COMPUTED: &str = "n/a";
/// Marks a strategy's cell in a row whose global batch is not its own.
pub const OTHER_BATCH: &str = "†";
/// Marks a cell whose ranks outnumber the node's cores (or GPUs).
pub const OVERSUBSCRIBED: &str = "‡";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scaling {
    Weak,
    Strong,
}

impl Scaling {
    pub fn name(self) -> &'static str {
        match self {
            Scaling::Weak => "weak",
            Scaling::Strong => "strong",
        }
    }
}

/// What runs must share to be compared in one table: everything but the rank count and the
/// strategy. The batch is the one the scaling mode holds fixed: per rank for weak scaling,
/// global for strong scaling. Field order is the order of the tables in the report.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct TableKey {
    pub scaling: Scaling,
    pub model: String,
    pub dataset: String,
    pub image_shape: Vec<usize>,
    pub device: String,
    pub fixed_batch: usize,
}

impl TableKey {
    pub fn of(record: &RunRecord) -> Result<TableKey> {
        let scaling = match record.scaling.as_str() {
            "weak" => Scaling::Weak,
            "strong" => Scaling::Strong,
            other => {
                return Err(Error::Results(format!(
                    "the record of {} at {} ranks from {}: unknown scaling {other:?} (expected weak or strong)",
                    record.strategy, record.ranks, record.timestamp
                )))
            }
        };
        Ok(TableKey {
            scaling,
            model: record.model.clone(),
            dataset: record.dataset.clone(),
            image_shape: record.image_shape.clone(),
            device: record.device.clone(),
            fixed_batch: match scaling {
                Scaling::Weak => record.batch_per_rank,
                Scaling::Strong => record.global_batch,
            },
        })
    }

    fn shape(&self) -> String {
        self.image_shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")
    }

    fn batch(&self) -> String {
        match self.scaling {
            Scaling::Weak => format!("batch {} per rank", self.fixed_batch),
            Scaling::Strong => format!("global batch {}", self.fixed_batch),
        }
    }

    /// The table's heading.
    pub fn title(&self) -> String {
        let mode = match self.scaling {
            Scaling::Weak => "Weak scaling",
            Scaling::Strong => "Strong scaling",
        };
        format!("{mode}: {} on {} ({}), {}, {}", self.model, self.dataset, self.shape(), self.device, self.batch())
    }

    /// The table's name in file names: lower case letters, digits and dashes.
    pub fn slug(&self) -> String {
        let batch = match self.scaling {
            Scaling::Weak => format!("b{}", self.fixed_batch),
            Scaling::Strong => format!("gb{}", self.fixed_batch),
        };
        slug(&[self.scaling.name(), &self.model, &self.dataset, &self.shape(), &self.device, &batch])
    }
}

/// Joins `parts` with dashes, keeping ASCII letters and digits (lower-cased) and turning every
/// other run of characters into one dash.
pub fn slug(parts: &[&str]) -> String {
    let mut out = String::new();
    for c in parts.join("-").chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.is_empty() && !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_end_matches('-').to_string()
}

/// The strategy as a table column: its name, plus the options that make it a different
/// algorithm (a synchronous and an asynchronous parameter server must not share a column, or
/// one would supersede the other).
pub fn strategy_label(record: &RunRecord) -> String {
    let text = |key: &str| record.extra.get(key).and_then(|v| v.as_str()).map(str::to_string);
    let flag = |key: &str| record.extra.get(key).and_then(|v| v.as_bool()).unwrap_or(false);
    let mut variant = Vec::new();
    match record.strategy.as_str() {
        "ps" => {
            variant.extend(text("ps_mode"));
            if flag("ps_colocate") {
                variant.push("colocated".to_string());
            }
        }
        "horovod" => {
            variant.extend(text("compression").filter(|c| c != "none"));
            if flag("hierarchical") {
                variant.push("hierarchical".to_string());
            }
        }
        _ => {}
    }
    variant.extend(recipe_label(record));
    variant.extend(pipeline_label(record));
    variant.extend(zero_label(record));
    variant.extend(record.extra.get("tensor_parallel").and_then(|v| v.as_u64()).filter(|&t| t > 1).map(|t| format!("T={t}")));
    if variant.is_empty() {
        record.strategy.clone()
    } else {
        format!("{} ({})", record.strategy, variant.join(", "))
    }
}

/// The training recipe as part of a column's name, where it is not plain SGD at a constant,
/// unscaled rate (issue 35: a weak-scaling study compares recipes side by side).
fn recipe_label(record: &RunRecord) -> Option<String> {
    let optimizer = record.optimizer.as_deref().unwrap_or("sgd");
    let schedule = record.lr_schedule.as_deref().unwrap_or("constant");
    let scale = record.extra.get("scale_lr").and_then(|v| v.as_str()).filter(|s| *s != "none");
    if optimizer == "sgd" && schedule == "constant" && scale.is_none() {
        return None;
    }
    let mut parts = vec![optimizer.to_string()];
    parts.extend(scale.map(|s| format!("lr scaled {s}")));
    parts.push(warmup_in_epochs(schedule, record));
    Some(parts.join(", "))
}

/// A pipelined run's layout as part of its column's name so that a pipeline never
/// takes the cell of the plain run with the same strategy and ranks: `P=2, M=8 1f1b`.
fn pipeline_label(record: &RunRecord) -> Option<String> {
    let p = record.pipeline.as_ref()?;
    let virtual_stages = if p.virtual_stages > 1 { format!(" V={}", p.virtual_stages) } else { String::new() };
    let recompute = if p.recompute { ", recompute" } else { "" };
    Some(format!("P={}, M={} {}{virtual_stages}{recompute}", p.pipeline_stages, p.micro_batches, p.schedule))
}

/// A ZeRO stage as part of a column's name (issue 37), so that a sharded run never takes the
/// cell of the plain run: `zero 2`, `zero 3 block`, `zero 3 stage hybrid`.
fn zero_label(record: &RunRecord) -> Option<String> {
    let stage = record.extra.get("zero").and_then(|v| v.as_u64()).filter(|&z| z > 0)?;
    let mut label = format!("zero {stage}");
    if let Some(unit) = record.extra.get("fsdp_unit").and_then(|v| v.as_str()) {
        label.push_str(&format!(" {unit}"));
    }
    if record.extra.get("fsdp_hybrid").and_then(|v| v.as_bool()).unwrap_or(false) {
        label.push_str(" hybrid");
    }
    Some(label)
}

/// Records of the first issue-35 binaries gave the warm-up in steps ("after a 40-step
/// warm-up"), which differ with the ranks in a weak-scaling study: read in epochs, as later
/// records give it, so that one recipe keeps one column.
fn warmup_in_epochs(schedule: &str, record: &RunRecord) -> String {
    let Some((before, rest)) = schedule.split_once(" after a ") else { return schedule.to_string() };
    let Some(steps) = rest.strip_suffix("-step warm-up").and_then(|n| n.parse::<f64>().ok()) else { return schedule.to_string() };
    let steps_per_epoch = record.steps as f64 / record.epochs;
    match steps_per_epoch.is_finite() && steps_per_epoch > 0.0 && record.extra.get("resumed_from_step").is_none() {
        true => format!("{before} after a {}-epoch warm-up", steps / steps_per_epoch),
        false => schedule.to_string(),
    }
}

/// The runs of a cell: the most recent of its strategy and rank count, and with it the other
/// repeats of its study (distinct repeat indices, `study --repeats`).
#[derive(Clone, Debug)]
pub struct Cell<'a> {
    /// The most recent run: the one whose context (batch, device, steps) the row shows.
    pub record: &'a RunRecord,
    /// Every run the cell's figures rest on, `record` among them, oldest first.
    pub runs: Vec<&'a RunRecord>,
    /// Older records of the same cell that these replace (another study, or the same repeat
    /// run again).
    pub superseded: usize,
}

/// Runs of one configuration: a row per rank count, strategies side by side.
#[derive(Debug)]
pub struct Table<'a> {
    pub key: TableKey,
    /// Unique among the tables of one report.
    pub slug: String,
    /// Sorted.
    pub strategies: Vec<String>,
    /// Every rank count any strategy ran at, ascending.
    pub ranks: Vec<usize>,
    cells: BTreeMap<(String, usize), Cell<'a>>,
    /// How a cell's runs make its images/s.
    pub statistic: Statistic,
}

/// Sorts records into tables with [`Statistic::Median`]; see [`group_with`].
#[cfg(test)]
pub fn group(records: &[RunRecord]) -> Result<Vec<Table<'_>>> {
    group_with(records, Statistic::Median)
}

/// Sorts records into tables. A cell (strategy, ranks) shows its most recent record ("most
/// recent" compares timestamps; on a tie the later line of runs.jsonl wins) and the repeats of
/// it: the records of the same study with other repeat indices (the most recent of each
/// index). Every other record of the cell is superseded.
pub fn group_with(records: &[RunRecord], statistic: Statistic) -> Result<Vec<Table<'_>>> {
    type Recency = (chrono::DateTime<chrono::FixedOffset>, usize);
    let mut by_key: BTreeMap<TableKey, BTreeMap<(String, usize), Vec<(&RunRecord, Recency)>>> = BTreeMap::new();
    for (index, record) in records.iter().enumerate() {
        let time = chrono::DateTime::parse_from_rfc3339(&record.timestamp).map_err(|e| {
            Error::Results(format!(
                "the record of {} at {} ranks: timestamp {:?} is not an RFC 3339 time: {e}",
                record.strategy, record.ranks, record.timestamp
            ))
        })?;
        by_key.entry(TableKey::of(record)?).or_default().entry((strategy_label(record), record.ranks)).or_default().push((record, (time, index)));
    }
    let mut tables = Vec::new();
    let mut slugs_taken: BTreeMap<String, usize> = BTreeMap::new();
    for (key, cells) in by_key {
        let cells: BTreeMap<_, _> = cells.into_iter().map(|(k, all)| (k, cell_of(all))).collect();
        let mut strategies: Vec<String> = cells.keys().map(|(s, _)| s.clone()).collect();
        strategies.dedup();
        let mut ranks: Vec<usize> = cells.keys().map(|&(_, n)| n).collect();
        ranks.sort_unstable();
        ranks.dedup();
        // Different keys can clean up to the same slug ("a b" and "a-b"): number the later ones.
        let base = key.slug();
        let seen = slugs_taken.entry(base.clone()).or_insert(0);
        *seen += 1;
        let slug = if *seen == 1 { base } else { format!("{base}-{seen}") };
        tables.push(Table { key, slug, strategies, ranks, cells, statistic });
    }
    Ok(tables)
}

/// The cell of one (strategy, ranks): the most recent record, its study's other repeats (the
/// most recent of each repeat index), the rest superseded.
fn cell_of<R: Ord + Copy>(mut all: Vec<(&RunRecord, R)>) -> Cell<'_> {
    all.sort_by_key(|&(_, recency)| recency);
    let latest = all.last().expect("a cell has a record").0;
    let mut runs: Vec<&RunRecord> = Vec::new();
    if let (Some(study), Some(_)) = (&latest.study, latest.hardware.repeat) {
        // Newest first, so that the first of each index is the one kept.
        for &(r, _) in all.iter().rev() {
            if r.study.as_ref() == Some(study) && r.hardware.repeat.is_some() && !runs.iter().any(|k| k.hardware.repeat == r.hardware.repeat) {
                runs.push(r);
            }
        }
        runs.reverse();
    } else {
        runs.push(latest);
    }
    Cell { record: latest, superseded: all.len() - runs.len(), runs }
}

/// speedup(N) = images/s at N ranks / images/s at 1 rank. None without a usable 1-rank figure.
pub fn speedup(images_per_sec: f64, one_rank: f64) -> Option<f64> {
    (one_rank.is_finite() && one_rank > 0.0 && images_per_sec.is_finite()).then(|| images_per_sec / one_rank)
}

/// Scaling efficiency at `ranks`: images/s(N) / (N x images/s(1)) for weak scaling, which is
/// speedup(N) / N, the strong-scaling definition: one formula serves both.
pub fn efficiency(images_per_sec: f64, ranks: usize, one_rank: f64) -> Option<f64> {
    speedup(images_per_sec, one_rank).filter(|_| ranks > 0).map(|s| s / ranks as f64)
}

/// Seconds per epoch: an epoch's samples over the throughput. The training-set size is not in
/// the record, so an epoch's samples are steps per epoch (steps / epochs) x the global batch.
pub fn epoch_seconds(steps: u64, epochs: f64, global_batch: usize, images_per_sec: f64) -> Option<f64> {
    let samples = steps as f64 / epochs * global_batch as f64;
    let seconds = samples / images_per_sec;
    (epochs > 0.0 && images_per_sec > 0.0 && seconds.is_finite()).then_some(seconds)
}

/// The figures of one cell.
#[derive(Clone, Debug, PartialEq)]
pub struct Figures {
    pub ranks: usize,
    pub workers: usize,
    pub global_batch: usize,
    pub images_per_sec: f64,
    /// Over all ranks, parameter servers included.
    pub images_per_sec_per_rank: f64,
    pub speedup: Option<f64>,
    pub efficiency: Option<f64>,
    pub compute_ms: f64,
    pub comm_ms: f64,
    /// Strong scaling only.
    pub epoch_s: Option<f64>,
    /// Test accuracy after the last epoch, and when --target-accuracy was first reached
    /// (seconds of training, epoch), with the target.
    pub test_accuracy: Option<f64>,
    pub target: Option<TargetReached>,
    /// A pipelined run's measured bubble (mean over its stages) and the balanced theory's.
    pub bubble: Option<(f64, f64)>,
    /// The cell's runs and their images/s: count, median, range (images_per_sec is `value`).
    pub spread: Summary,
    /// Exchange time over step time (medians over the runs): the share of the step spent
    /// communicating and not hidden behind computing.
    pub exchange_share: Option<f64>,
    /// Achieved training FLOP/s per rank (3 x the model's forward FLOPs per image x images/s
    /// per rank), and that over the peak of one rank (MFU).
    pub flops_per_rank: Option<f64>,
    pub mfu: Option<f64>,
    /// Why the point's ranks share cores or GPUs ("4 ranks x 1 thread on 2 cores"), if they do.
    pub oversubscribed: Option<String>,
}

/// The ranks on the busiest node (ranks spread evenly over the nodes, rounded up).
pub fn ranks_per_node(r: &RunRecord) -> usize {
    r.ranks.div_ceil(r.nodes.max(1))
}

/// Whether the ranks of a node outnumber its cores (CPU runs: ranks x threads) or its GPUs,
/// said in words; None when they fit or the record does not know the node (older binaries).
pub fn oversubscription(r: &RunRecord) -> Option<String> {
    let per_node = ranks_per_node(r);
    let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    if r.device.starts_with("cuda") {
        let gpus = r.hardware.gpus_per_node;
        return (gpus > 0 && per_node > gpus).then(|| format!("{} on {}", plural(per_node, "rank"), plural(gpus, "GPU")));
    }
    let cores = r.hardware.cores_per_node;
    let threads = r.threads.max(1);
    (cores > 0 && per_node * threads > cores).then(|| format!("{} x {} on {}", plural(per_node, "rank"), plural(threads, "thread"), plural(cores, "core")))
}

/// The run's `--precision` (records before it was recorded ran fp32).
pub fn precision(r: &RunRecord) -> String {
    r.extra.get("precision").and_then(|v| v.as_str()).unwrap_or("fp32").to_string()
}

/// One rank's peak FLOP/s and where it comes from: a GPU's dense datasheet peak for the run's
/// precision (peaks.rs), or on CPUs the measured core rate times the cores a rank has (its
/// threads, or its share of the node's cores where ranks x threads exceed them). None where
/// neither is known.
pub fn peak_per_rank(r: &RunRecord) -> Option<(f64, String)> {
    if r.device.starts_with("cuda") {
        let model = r.hardware.device_model.as_deref()?;
        let (tflops, what) = peaks::for_precision(&peaks::lookup(model)?, &precision(r))?;
        return Some((tflops * 1e12, what));
    }
    let core = r.hardware.core_gflops.filter(|g| *g > 0.0)?;
    let cores = r.hardware.cores_per_node;
    let threads = r.threads.max(1) as f64;
    let share = if cores > 0 { threads.min(cores as f64 / ranks_per_node(r) as f64) } else { threads };
    Some((core * 1e9 * share, format!("measured on the spot: one core's f32 matmul, {core:.1} GFLOP/s, x the cores a rank has (its threads, at most the node's cores / its ranks)")))
}

/// A point's --target-accuracy and when its runs reached it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TargetReached {
    pub accuracy: f64,
    /// The median time to the target (seconds of training) and the epoch of the run at that
    /// median; None when the median run did not reach it. A run that never reached the target
    /// counts as slower than every run that did, so the median is the time by which half the
    /// runs had reached it.
    pub reached: Option<(f64, u64)>,
    /// How many of the point's runs had the target, and how many reached it.
    pub runs: usize,
    pub runs_reached: usize,
    /// The fastest and slowest time of the runs that reached it.
    pub range: Option<(f64, f64)>,
    /// The smallest and largest epoch the runs reached it at.
    pub epochs: Option<(u64, u64)>,
}

impl TargetReached {
    /// The target of `runs` (the latest run's, which the others share as repeats of one study)
    /// summarised; None when the latest run had no target.
    pub fn of(latest: &RunRecord, runs: &[&RunRecord]) -> Option<TargetReached> {
        let accuracy = latest.target_accuracy?;
        let with_target: Vec<&RunRecord> = runs.iter().copied().filter(|r| r.target_accuracy == Some(accuracy)).collect();
        let mut reached: Vec<(f64, u64)> = with_target.iter().filter_map(|r| r.time_to_target_s.zip(r.epoch_to_target)).collect();
        reached.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (n, k) = (with_target.len(), reached.len());
        // Sorted times with the runs that did not reach it last (as infinitely slow): the
        // median is defined while the middle run (or both middle runs) reached the target.
        let at = |i: usize| reached.get(i).copied();
        let median = if n % 2 == 1 {
            at(n / 2)
        } else {
            at(n / 2 - 1).zip(at(n / 2)).map(|(a, b)| ((a.0 + b.0) / 2.0, b.1))
        };
        Some(TargetReached {
            accuracy,
            reached: median,
            runs: n,
            runs_reached: k,
            range: (k > 0).then(|| (reached[0].0, reached[k - 1].0)),
            epochs: reached.iter().map(|r| r.1).min().zip(reached.iter().map(|r| r.1).max()),
        })
    }
}

impl<'a> Table<'a> {
    pub fn cell(&self, strategy: &str, ranks: usize) -> Option<&Cell<'a>> {
        self.cells.get(&(strategy.to_string(), ranks))
    }

    /// The 1-rank throughput of `strategy`, the base of its speedup and efficiency.
    pub fn one_rank(&self, strategy: &str) -> Option<f64> {
        self.cell(strategy, 1).and_then(|c| self.spread(c)).map(|s| s.value)
    }

    /// The images/s of a cell's runs, reduced by the table's statistic.
    fn spread(&self, cell: &Cell) -> Option<Summary> {
        stats::summarise(&cell.runs.iter().map(|r| r.images_per_sec).collect::<Vec<_>>(), self.statistic)
    }

    pub fn figures(&self, strategy: &str, ranks: usize) -> Option<Figures> {
        let cell = self.cell(strategy, ranks)?;
        let r = cell.record;
        let spread = self.spread(cell)?;
        let images_per_sec = spread.value;
        let median_of = |f: fn(&RunRecord) -> f64| stats::median(&cell.runs.iter().map(|r| f(r)).collect::<Vec<_>>()).unwrap_or(f64::NAN);
        let (compute_ms, comm_ms, step_ms) = (median_of(|r| r.compute_ms), median_of(|r| r.comm_ms), median_of(|r| r.step_ms));
        let base = self.one_rank(strategy);
        let flops_per_rank = (r.hardware.forward_flops_per_image > 0.0).then(|| crate::model::flops::TRAINING_FACTOR * r.hardware.forward_flops_per_image * images_per_sec / ranks.max(1) as f64);
        Some(Figures {
            ranks,
            workers: r.workers,
            global_batch: r.global_batch,
            images_per_sec,
            images_per_sec_per_rank: images_per_sec / ranks.max(1) as f64,
            speedup: base.and_then(|b| speedup(images_per_sec, b)),
            efficiency: base.and_then(|b| efficiency(images_per_sec, ranks, b)),
            compute_ms,
            comm_ms,
            epoch_s: match self.key.scaling {
                Scaling::Strong => epoch_seconds(r.steps, r.epochs, r.global_batch, images_per_sec),
                Scaling::Weak => None,
            },
            spread,
            exchange_share: (step_ms > 0.0 && comm_ms.is_finite()).then(|| comm_ms / step_ms),
            flops_per_rank,
            mfu: flops_per_rank.zip(peak_per_rank(r)).map(|(f, (peak, _))| f / peak),
            oversubscribed: oversubscription(r),
            test_accuracy: stats::median(&cell.runs.iter().filter_map(|r| r.test_accuracy).collect::<Vec<_>>()),
            bubble: r.pipeline.as_ref().filter(|p| !p.bubble.is_empty()).map(|p| (p.bubble.iter().sum::<f64>() / p.bubble.len() as f64, p.theoretical_bubble)),
            target: TargetReached::of(r, &cell.runs),
        })
    }

    /// Every cell with a run, strategy by strategy, ranks ascending.
    pub fn present(&self) -> impl Iterator<Item = (&str, Figures)> + '_ {
        self.strategies
            .iter()
            .flat_map(move |s| self.ranks.iter().filter_map(move |&n| Some((s.as_str(), self.figures(s, n)?))))
    }

    pub fn superseded(&self) -> usize {
        self.cells.values().map(|c| c.superseded).sum()
    }

    /// For each strategy marked in the summary tables, its own global batch where it differs.
    fn batch_notes(&self) -> Vec<String> {
        let note = |s: &String| {
            let differing: Vec<String> = self
                .ranks
                .iter()
                .filter(|&&n| self.batch_differs(s, n))
                .filter_map(|&n| Some(format!("{} at {n} ranks", self.cell(s, n)?.record.global_batch)))
                .collect();
            (!differing.is_empty()).then(|| format!("{OTHER_BATCH} {s} ran with global batch {}", differing.join(", ")))
        };
        self.strategies.iter().filter_map(note).collect()
    }

    /// What a reader must know to read the table right, one line each.
    pub fn notes(&self) -> Vec<String> {
        let mut notes = self.batch_notes();
        for s in &self.strategies {
            if self.one_rank(s).is_none() {
                notes.push(format!("no 1-rank run of {s}: speedup and efficiency not computed"));
            }
        }
        for s in &self.strategies {
            let with_servers: Vec<String> = self
                .ranks
                .iter()
                .filter_map(|&n| self.cell(s, n))
                .map(|c| c.record)
                .filter(|r| r.workers > 0 && r.workers < r.ranks)
                .map(|r| format!("{} ranks, {} computing", r.ranks, r.workers))
                .collect();
            if !with_servers.is_empty() {
                notes.push(format!(
                    "{s} has dedicated parameter servers ({}): ranks, images/s per rank and efficiency count every rank, \
                     servers included (the resources used)",
                    with_servers.join("; ")
                ));
            }
        }
        let shared: Vec<String> = self
            .present()
            .filter_map(|(s, f)| Some(format!("{s} at {} ranks: {}", f.ranks, f.oversubscribed?)))
            .collect();
        if !shared.is_empty() {
            notes.push(format!("{OVERSUBSCRIBED} oversubscribed, the ranks share cores or GPUs, which the throughput reflects ({})", shared.join("; ")));
        }
        let total = self.superseded();
        if total > 0 {
            let which: Vec<String> = self
                .cells
                .iter()
                .filter(|(_, c)| c.superseded > 0)
                .map(|((s, n), c)| format!("{s} at {n} ranks: {}", c.superseded))
                .collect();
            notes.push(format!(
                "{total} older record{} superseded by the most recent run of the same strategy and rank count ({})",
                if total == 1 { "" } else { "s" },
                which.join("; ")
            ));
        }
        notes
    }

    /// The global batch a row shows: the one most strategies used at `ranks`, on a tie the
    /// largest (in weak scaling a strategy with dedicated servers has fewer ranks computing, so
    /// a smaller global batch: the largest is the one of every rank computing). None where no
    /// strategy ran at `ranks`.
    pub fn common_global_batch(&self, ranks: usize) -> Option<usize> {
        let mut counts: BTreeMap<usize, usize> = BTreeMap::new();
        for s in &self.strategies {
            if let Some(c) = self.cell(s, ranks) {
                *counts.entry(c.record.global_batch).or_default() += 1;
            }
        }
        // Batches ascend and max_by_key keeps the last maximum: a tie goes to the largest.
        counts.into_iter().max_by_key(|&(_, count)| count).map(|(batch, _)| batch)
    }

    /// Whether `strategy` ran at `ranks` with another global batch than the row shows.
    pub fn batch_differs(&self, strategy: &str, ranks: usize) -> bool {
        let own = self.cell(strategy, ranks).map(|c| c.record.global_batch);
        own.is_some() && own != self.common_global_batch(ranks)
    }

    /// One figure of every strategy: a row per rank count, a column per strategy.
    fn summary_table(&self, caption: &str, figure: impl Fn(&Figures) -> String) -> String {
        let mut header = vec!["Ranks".to_string(), "Global batch".to_string()];
        header.extend(self.strategies.iter().cloned());
        let rows = self.ranks.iter().map(|&n| {
            let batch = self.common_global_batch(n).map_or(NO_RUN.to_string(), |b| b.to_string());
            let mut row = vec![n.to_string(), batch];
            row.extend(self.strategies.iter().map(|s| self.summary_cell(s, n, &figure)));
            row
        });
        markdown_table(caption, &header, rows)
    }

    /// A strategy's figure at `ranks`, marked where its global batch is not the row's.
    fn summary_cell(&self, strategy: &str, ranks: usize, figure: &impl Fn(&Figures) -> String) -> String {
        let Some(f) = self.figures(strategy, ranks) else { return NO_RUN.to_string() };
        let batch = if self.batch_differs(strategy, ranks) { OTHER_BATCH } else { "" };
        let shared = if f.oversubscribed.is_some() { OVERSUBSCRIBED } else { "" };
        format!("{}{batch}{shared}", figure(&f))
    }

    /// The table's context, one line each: what a reader needs to judge its figures, from the
    /// records (n/a where the records of older binaries do not say).
    pub fn context(&self) -> Vec<String> {
        let records: Vec<&RunRecord> = self.cells.values().flat_map(|c| c.runs.iter().copied()).collect();
        let distinct = |f: &dyn Fn(&RunRecord) -> String| {
            let mut v: Vec<String> = records.iter().map(|r| f(r)).collect();
            v.sort();
            v.dedup();
            v.join("; ")
        };
        let by_ranks = |f: &dyn Fn(&RunRecord) -> String| {
            self.ranks
                .iter()
                .map(|&n| {
                    let mut v: Vec<String> = records.iter().filter(|r| r.ranks == n).map(|r| f(r)).collect();
                    v.sort();
                    v.dedup();
                    v.join(" or ")
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let known = |n: usize| if n > 0 { n.to_string() } else { NOT_COMPUTED.to_string() };
        let at = format!("at {} rank{}", self.ranks.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(", "), if self.ranks == [1] { "" } else { "s" });
        let extra_u64 = |r: &RunRecord, key: &str| r.extra.get(key).and_then(|v| v.as_u64());
        let mut lines = vec![
            format!("Nodes x ranks per node: {}", by_ranks(&|r| format!("{}x{}", r.nodes.max(1), ranks_per_node(r)))),
            format!(
                "Device: {}",
                distinct(&|r| {
                    let model = r.hardware.device_model.as_deref().map_or(String::new(), |m| format!(" ({m})"));
                    if r.device.starts_with("cuda") {
                        format!("{}{model}, {} GPUs per node", r.device, known(r.hardware.gpus_per_node))
                    } else {
                        format!("{}{model}, {} cores per node", r.device, known(r.hardware.cores_per_node))
                    }
                })
            ),
            format!("Threads per rank: {}", by_ranks(&|r| known(r.threads))),
            format!(
                "MPI library and data path: {}",
                distinct(&|r| format!("{}, {}{}", r.mpi_library, r.data_path.as_deref().unwrap_or(NOT_COMPUTED), if r.cuda_aware { ", CUDA-aware" } else { "" }))
            ),
            format!("Precision: {}", distinct(&|r| precision(r))),
            format!("Global batch: {} ({at})", by_ranks(&|r| r.global_batch.to_string())),
            format!(
                "Measured steps per run: {}",
                distinct(&|r| match (extra_u64(r, "measured_steps"), extra_u64(r, "warmup_steps")) {
                    (Some(m), Some(w)) => format!("{m} after {w} warm-up"),
                    (Some(m), None) => m.to_string(),
                    _ => format!("{NOT_COMPUTED} ({} steps in all)", r.steps),
                })
            ),
        ];
        let runs: Vec<usize> = self.cells.values().map(|c| c.runs.len()).collect();
        let (fewest, most) = (runs.iter().min().copied().unwrap_or(0), runs.iter().max().copied().unwrap_or(0));
        let statistic = match self.statistic {
            Statistic::Median => "the median run's images/s, with the fastest and slowest run's".to_string(),
            Statistic::Trimmed if fewest >= 3 => format!("images/s: the {}", self.statistic.name()),
            Statistic::Trimmed => format!("images/s: the {} where a point has 3 runs or more, else the median (marked)", self.statistic.name()),
        };
        let count = if fewest == most { fewest.to_string() } else { format!("{fewest} to {most}") };
        lines.push(format!("Runs per point: {count}; shown: {statistic}"));
        lines.push(format!(
            "Model FLOPs: {} forward per image, counted from the model's layers for this input; training taken as 3x forward",
            distinct(&|r| if r.hardware.forward_flops_per_image > 0.0 { format!("{}FLOP", si(r.hardware.forward_flops_per_image)) } else { NOT_COMPUTED.to_string() })
        ));
        lines.push(match records.iter().any(|r| peak_per_rank(r).is_some()) {
            true => format!(
                "Peak for MFU: {} FLOP/s per rank ({at}); {}",
                by_ranks(&|r| peak_per_rank(r).map_or(NOT_COMPUTED.to_string(), |(peak, _)| si(peak).trim_end().to_string())),
                distinct(&|r| peak_per_rank(r).map_or(format!("{NOT_COMPUTED}: no datasheet peak for this device and no measured one"), |(_, what)| what))
            ),
            false => format!("Peak for MFU: {NOT_COMPUTED} (no datasheet peak for this device and no measured one)"),
        });
        lines
    }

    /// The table in one line: the strategy with the best efficiency at the largest rank count
    /// that has one, with the runs it rests on and whether the ranks shared cores.
    pub fn summary_line(&self) -> String {
        let title = self.key.title();
        let best = self.ranks.iter().rev().find_map(|&n| {
            self.strategies.iter().filter_map(|s| Some((s, self.figures(s, n)?))).filter(|(_, f)| f.efficiency.is_some() && n > 1).max_by(|a, b| a.1.efficiency.unwrap().total_cmp(&b.1.efficiency.unwrap()))
        });
        let Some((s, f)) = best else { return format!("{title}: no scaling efficiency (no 1-rank run, or 1 rank only)") };
        let runs = if f.spread.runs == 1 { "1 run".to_string() } else { format!("{} of {} runs", if f.spread.trimmed { "trimmed mean" } else { "median" }, f.spread.runs) };
        let shared = f.oversubscribed.as_ref().map_or(String::new(), |o| format!("; oversubscribed: {o}"));
        let exchange = f.exchange_share.map_or(String::new(), |e| format!(", {} of the step exchanging", percent(e)));
        format!("{title}: {s} keeps {} scaling efficiency at {} ranks ({runs}{exchange}{shared})", percent(f.efficiency.unwrap()), f.ranks)
    }

    /// Every figure of one strategy, a row per rank count it ran at.
    fn detail_table(&self, strategy: &str) -> String {
        let mut header: Vec<String> =
            ["Ranks", "Global batch", "images/s", "images/s per rank", "speedup", "efficiency", "compute ms", "exchange ms"]
                .map(String::from)
                .into();
        if self.key.scaling == Scaling::Strong {
            header.push("epoch s".to_string());
        }
        header.extend(["runs", "images/s min–max", "exchange share", "TFLOP/s per rank", "MFU"].map(String::from));
        let rows = self.ranks.iter().filter_map(|&n| self.figures(strategy, n)).map(|f| self.detail_row(&f));
        markdown_table(&format!("**Detail: {strategy}**"), &header, rows)
    }

    fn detail_row(&self, f: &Figures) -> Vec<String> {
        let mut row = vec![
            f.ranks.to_string(),
            f.global_batch.to_string(),
            fixed(f.images_per_sec, 1),
            fixed(f.images_per_sec_per_rank, 1),
            speedup_cell(f.speedup),
            efficiency_cell(f.efficiency),
            fixed(f.compute_ms, 1),
            fixed(f.comm_ms, 1),
        ];
        if self.key.scaling == Scaling::Strong {
            row.push(f.epoch_s.map_or(NOT_COMPUTED.to_string(), |v| fixed(v, 1)));
        }
        row.push(format!("{}{}", f.spread.runs, if self.statistic == Statistic::Trimmed && !f.spread.trimmed { " (median)" } else { "" }));
        row.push(format!("{}–{}", fixed(f.spread.min, 1), fixed(f.spread.max, 1)));
        row.push(f.exchange_share.map_or(NOT_COMPUTED.to_string(), percent));
        row.push(f.flops_per_rank.map_or(NOT_COMPUTED.to_string(), |v| significant(v / 1e12)));
        row.push(f.mfu.map_or(NOT_COMPUTED.to_string(), percent));
        row
    }

    /// The section of this table in Markdown: heading; images/s, efficiency and speedup, each
    /// a narrow table with a column per strategy; notes; then every figure of each strategy.
    /// Numbers have fixed decimals so that the same records always give the same text.
    pub fn markdown(&self) -> String {
        let context: String = self.context().iter().map(|l| format!("- {l}\n")).collect();
        let images_caption = match self.statistic {
            Statistic::Median => "**Images/s**",
            Statistic::Trimmed => "**Images/s** (MLPerf: mean without the fastest and slowest run; range in brackets)",
        };
        let mut blocks = vec![
            format!("## {}\n", self.key.title()),
            format!("**Context**\n\n{context}"),
            self.summary_table(images_caption, images_cell),
            self.summary_table("**Scaling efficiency**", |f| efficiency_cell(f.efficiency)),
            self.summary_table("**Speedup**", |f| speedup_cell(f.speedup)),
        ];
        if self.present().any(|(_, f)| f.bubble.is_some()) {
            let cell = |f: &Figures| f.bubble.map_or(NOT_COMPUTED.to_string(), |(measured, theory)| format!("{} ({})", percent(measured), percent(theory)));
            blocks.push(self.summary_table("**Pipeline bubble** (measured idle share of the stages' pipelined phase, mean over the stages; balanced theory in brackets)", cell));
        }
        if self.present().any(|(_, f)| f.test_accuracy.is_some()) {
            let caption = if self.present().any(|(_, f)| f.spread.runs > 1) { "**Test accuracy after the last epoch** (median over the runs)" } else { "**Test accuracy after the last epoch**" };
            blocks.push(self.summary_table(caption, |f| f.test_accuracy.map_or(NOT_COMPUTED.to_string(), percent)));
        }
        if let Some(target) = self.present().find_map(|(_, f)| f.target) {
            let repeated = self.present().any(|(_, f)| f.target.is_some_and(|t| t.runs > 1));
            let how = if repeated { "median over the runs, a run that never reached it counting as the slowest; range of those that did" } else { "epoch" };
            let caption = format!("**Time to {} test accuracy** (seconds of training, evaluations excluded; {how})", percent(target.accuracy));
            blocks.push(self.summary_table(&caption, |f| target_cell(f, target.accuracy)));
        }
        blocks.push(self.summary_table(
            "**Exchange share of the step** (exchange ms / step ms: the communication not hidden behind computing; with overlap, the exposed part only)",
            |f| f.exchange_share.map_or(NOT_COMPUTED.to_string(), percent),
        ));
        if self.present().any(|(_, f)| f.flops_per_rank.is_some()) {
            blocks.push(self.summary_table("**Achieved TFLOP/s per rank (MFU)** (3 x forward FLOPs per image x images/s per rank; MFU against the peak in the context)", |f| {
                match (f.flops_per_rank, f.mfu) {
                    (Some(v), Some(m)) => format!("{} ({})", significant(v / 1e12), percent(m)),
                    (Some(v), None) => format!("{} (MFU n/a)", significant(v / 1e12)),
                    _ => NOT_COMPUTED.to_string(),
                }
            }));
        }
        let notes = self.notes();
        if !notes.is_empty() {
            blocks.push(notes.iter().map(|n| format!("- {n}\n")).collect());
        }
        blocks.extend(self.strategies.iter().map(|s| self.detail_table(s)));
        blocks.join("\n")
    }

    /// One CSV row per (strategy, ranks) with a run.
    pub fn csv_rows(&self) -> Vec<CsvRow> {
        self.present()
            .map(|(s, f)| {
                let cell = self.cell(s, f.ranks).expect("present() yields cells with a run");
                CsvRow {
                    table: self.slug.clone(),
                    scaling: self.key.scaling.name(),
                    model: self.key.model.clone(),
                    dataset: self.key.dataset.clone(),
                    image_shape: self.key.shape(),
                    device: self.key.device.clone(),
                    strategy: s.to_string(),
                    ranks: f.ranks,
                    workers: f.workers,
                    batch_per_rank: cell.record.batch_per_rank,
                    global_batch: f.global_batch,
                    images_per_sec: f.images_per_sec,
                    images_per_sec_per_rank: f.images_per_sec_per_rank,
                    speedup: f.speedup,
                    efficiency: f.efficiency,
                    compute_ms: f.compute_ms,
                    comm_ms: f.comm_ms,
                    epoch_s: f.epoch_s,
                    test_accuracy: f.test_accuracy,
                    target_accuracy: f.target.map(|t| t.accuracy),
                    time_to_target_s: f.target.and_then(|t| t.reached).map(|r| r.0),
                    epoch_to_target: f.target.and_then(|t| t.reached).map(|r| r.1),
                    time_to_target_min_s: f.target.and_then(|t| t.range).map(|r| r.0),
                    time_to_target_max_s: f.target.and_then(|t| t.range).map(|r| r.1),
                    runs_reaching_target: f.target.map(|t| t.runs_reached),
                    runs: f.spread.runs,
                    images_per_sec_median: f.spread.median,
                    images_per_sec_min: f.spread.min,
                    images_per_sec_max: f.spread.max,
                    statistic: if f.spread.trimmed { "trimmed" } else { "median" },
                    exchange_share: f.exchange_share,
                    tflops_per_rank: f.flops_per_rank.map(|v| v / 1e12),
                    mfu: f.mfu,
                    oversubscribed: f.oversubscribed.clone().unwrap_or_default(),
                    superseded: cell.superseded,
                    timestamp: cell.record.timestamp.clone(),
                    git_commit: cell.record.git_commit.clone(),
                }
            })
            .collect()
    }
}

/// A row of a table's CSV file. Efficiency is a fraction (0.95), not a percentage; a figure
/// that cannot be computed is an empty field. It repeats the fields of `Figures` rather than
/// holding one: the csv crate cannot write a `#[serde(flatten)]` field (it serialises as a map).
#[derive(Debug, Serialize)]
pub struct CsvRow {
    pub table: String,
    pub scaling: &'static str,
    pub model: String,
    pub dataset: String,
    pub image_shape: String,
    pub device: String,
    pub strategy: String,
    pub ranks: usize,
    pub workers: usize,
    pub batch_per_rank: usize,
    pub global_batch: usize,
    pub images_per_sec: f64,
    pub images_per_sec_per_rank: f64,
    pub speedup: Option<f64>,
    pub efficiency: Option<f64>,
    pub compute_ms: f64,
    pub comm_ms: f64,
    pub epoch_s: Option<f64>,
    pub test_accuracy: Option<f64>,
    pub target_accuracy: Option<f64>,
    /// The median over the point's runs (see [`TargetReached`]), the epoch of the median run,
    /// the fastest and slowest run that reached the target, and how many did.
    pub time_to_target_s: Option<f64>,
    pub epoch_to_target: Option<u64>,
    pub time_to_target_min_s: Option<f64>,
    pub time_to_target_max_s: Option<f64>,
    pub runs_reaching_target: Option<usize>,
    /// The point's runs, and their images/s: images_per_sec is the median, or the trimmed mean
    /// where `statistic` says so.
    pub runs: usize,
    pub images_per_sec_median: f64,
    pub images_per_sec_min: f64,
    pub images_per_sec_max: f64,
    pub statistic: &'static str,
    pub exchange_share: Option<f64>,
    pub tflops_per_rank: Option<f64>,
    pub mfu: Option<f64>,
    /// Empty, or why the ranks shared cores or GPUs.
    pub oversubscribed: String,
    pub superseded: usize,
    pub timestamp: String,
    pub git_commit: String,
}

fn fixed(value: f64, decimals: usize) -> String {
    if value.is_finite() {
        format!("{value:.decimals$}")
    } else {
        NOT_COMPUTED.to_string()
    }
}

/// A Markdown table under its caption, numbers right-aligned.
fn markdown_table(caption: &str, header: &[String], rows: impl Iterator<Item = Vec<String>>) -> String {
    let mut out = format!("{caption}\n\n| {} |\n|{}\n", header.join(" | "), "---:|".repeat(header.len()));
    for row in rows {
        let _ = writeln!(out, "| {} |", row.join(" | "));
    }
    out
}

/// When a point reached its target accuracy: `412.0 s (epoch 3)` for one run; with repeats the
/// median, the range and epochs of the runs that reached it and how many did:
/// `412.0 s (398.1–430.2; epochs 3–4; 3 of 3 runs)`. The target is named where it is not the
/// caption's; `not reached`, or `n/a` for a run without a target.
fn target_cell(f: &Figures, caption_target: f64) -> String {
    let Some(target) = f.target else { return NOT_COMPUTED.to_string() };
    let other = if target.accuracy != caption_target { format!(", target {}", percent(target.accuracy)) } else { Default::default() };
    if target.runs <= 1 {
        return match target.reached {
            None => format!("not reached{other}"),
            Some((seconds, epoch)) => format!("{} s (epoch {epoch}{other})", fixed(seconds, 1)),
        };
    }
    let of = format!("{} of {} runs", target.runs_reached, target.runs);
    let epochs = match target.epochs {
        Some((lo, hi)) if lo == hi => format!("epoch {lo}"),
        Some((lo, hi)) => format!("epochs {lo}–{hi}"),
        None => String::new(),
    };
    match (target.reached, target.range) {
        (Some((seconds, _)), Some((lo, hi))) => format!("{} s ({}–{}; {epochs}; {of} reached it{other})", fixed(seconds, 1), fixed(lo, 1), fixed(hi, 1)),
        _ => format!("not reached ({of} reached it{other})"),
    }
}

/// images/s of a cell: the statistic, with the range where the point ran more than once.
fn images_cell(f: &Figures) -> String {
    let value = fixed(f.images_per_sec, 1);
    if f.spread.runs > 1 {
        format!("{value} ({}–{})", fixed(f.spread.min, 1), fixed(f.spread.max, 1))
    } else {
        value
    }
}

/// Three significant digits, plain notation: 0.0123, 1.23, 123.
fn significant(value: f64) -> String {
    if !value.is_finite() {
        return NOT_COMPUTED.to_string();
    }
    if value == 0.0 {
        return "0".to_string();
    }
    let decimals = (2 - value.abs().log10().floor() as i32).max(0) as usize;
    format!("{value:.decimals$}")
}

/// A count with an SI prefix and three significant digits: 1.23 G, 456 k.
pub fn si(value: f64) -> String {
    let (scaled, prefix) = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]
        .iter()
        .find(|(f, _)| value.abs() >= *f)
        .map_or((value, ""), |&(f, p)| (value / f, p));
    format!("{} {prefix}", significant(scaled))
}

fn speedup_cell(speedup: Option<f64>) -> String {
    speedup.map_or(NOT_COMPUTED.to_string(), |v| fixed(v, 2))
}

fn efficiency_cell(efficiency: Option<f64>) -> String {
    efficiency.map_or(NOT_COMPUTED.to_string(), percent)
}

fn percent(fraction: f64) -> String {
    if fraction.is_finite() {
        format!("{:.1}%", fraction * 100.0)
    } else {
        NOT_COMPUTED.to_string()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A weak-scaling ring run of the tiny model on 1x28x28 images: 64 per rank, 10 steps.
    pub(crate) fn record(strategy: &str, ranks: usize, images_per_sec: f64) -> RunRecord {
        RunRecord {
            strategy: strategy.into(),
            ranks,
            workers: ranks,
            nodes: 1,
            model: "tiny".into(),
            dataset: "fashion-mnist".into(),
            image_shape: vec![1, 28, 28],
            batch_per_rank: 64,
            global_batch: 64 * ranks,
            scaling: "weak".into(),
            steps: 10,
            epochs: 0.5,
            images_per_sec,
            step_ms: 12.0,
            compute_ms: 10.0,
            comm_ms: 2.0,
            data_wait_ms: 0.0,
            optimizer_ms: 0.0,
            final_loss: 1.0,
            test_accuracy: None,
            test_loss: None,
            device: "cpu".into(),
            mpi_library: "Open MPI".into(),
            cuda_aware: false,
            data_path: None,
            threads: 1,
            bucket_mb: 25.0,
            peak_rss_mb: 0.0,
            rss_warmup_mb: 0.0,
            rss_end_mb: 0.0,
            host: "h".into(),
            git_commit: "abc".into(),
            timestamp: "2025-01-01T00:00:00Z".into(),
            study: None,
            optimizer: None,
            lr_schedule: None,
            final_lr: None,
            accuracy_by_epoch: Vec::new(),
            target_accuracy: None,
            time_to_target_s: None,
            epoch_to_target: None,
            pipeline: None,
            extra: Default::default(),
            rerun: Default::default(),
            hardware: Default::default(),
        }
    }

    /// The rows of the table under `caption` in `md`, header and alignment line included.
    pub(crate) fn table_under<'m>(md: &'m str, caption: &str) -> Vec<&'m str> {
        let mut lines = md.lines().skip_while(|l| *l != caption).skip(1).skip_while(|l| l.is_empty());
        lines.by_ref().take_while(|l| l.starts_with('|')).collect()
    }

    /// A weak-scaling sync parameter server run with one dedicated server: one rank fewer takes a batch.
    fn ps_with_a_server(ranks: usize, images_per_sec: f64) -> RunRecord {
        let mut ps = record("ps", ranks, images_per_sec);
        ps.workers = ranks - 1;
        ps.global_batch = ps.workers * ps.batch_per_rank;
        ps.extra.insert("ps_mode".into(), "sync".into());
        ps
    }

    fn strong(strategy: &str, ranks: usize, global_batch: usize, images_per_sec: f64) -> RunRecord {
        RunRecord {
            scaling: "strong".into(),
            global_batch,
            batch_per_rank: global_batch / ranks,
            ..record(strategy, ranks, images_per_sec)
        }
    }

    /// A pipelined run has a column of its own beside the plain run of its strategy and ranks.
    #[test]
    fn pipelined_runs_get_columns_of_their_own() {
        let plain = record("ring", 2, 1900.0);
        let mut piped = record("ring", 2, 1500.0);
        piped.pipeline = Some(crate::results::PipelineRecord { pipeline_stages: 2, micro_batches: 8, schedule: "1f1b".into(), virtual_stages: 1, ..Default::default() });
        assert_eq!(strategy_label(&piped), "ring (P=2, M=8 1f1b)");
        assert_eq!(strategy_label(&plain), "ring");
        // ZeRO stages likewise (issue 37).
        let mut sharded = record("ring", 2, 1200.0);
        sharded.extra.insert("zero".into(), 3.into());
        sharded.extra.insert("fsdp_unit".into(), "block".into());
        sharded.extra.insert("fsdp_hybrid".into(), true.into());
        assert_eq!(strategy_label(&sharded), "ring (zero 3 block hybrid)");
        sharded.extra.clear();
        sharded.extra.insert("zero".into(), 0.into());
        assert_eq!(strategy_label(&sharded), "ring");
        // Tensor parallelism likewise (issue 38), beside a pipeline.
        let mut tensor = piped.clone();
        tensor.extra.insert("tensor_parallel".into(), 4.into());
        assert_eq!(strategy_label(&tensor), "ring (P=2, M=8 1f1b, T=4)");
        tensor.extra.insert("tensor_parallel".into(), 1.into());
        assert_eq!(strategy_label(&tensor), "ring (P=2, M=8 1f1b)");
        // The bubble table, for the pipelined column only.
        piped.pipeline.as_mut().unwrap().bubble = vec![0.10, 0.14];
        piped.pipeline.as_mut().unwrap().theoretical_bubble = 1.0 / 9.0;
        let runs = [record("ring", 1, 1000.0), plain, piped];
        let md = group(&runs).unwrap()[0].markdown();
        let rows = table_under(&md, "**Pipeline bubble** (measured idle share of the stages' pipelined phase, mean over the stages; balanced theory in brackets)");
        assert!(rows.iter().any(|r| r.starts_with("| 2 | 128 | n/a | 12.0% (11.1%) |")), "{md}");
    }

    /// A weak-scaling accuracy study (issue 35): each recipe is a column of its own, with the
    /// final test accuracy and the time to the target accuracy beside the throughput.
    #[test]
    fn recipes_get_columns_of_their_own_with_accuracy_and_time_to_target() {
        let with = |ranks: usize, optimizer: &str, schedule: &str, scaled: bool, accuracy: f64, reached: Option<(f64, u64)>| {
            let mut r = record("ring", ranks, 100.0 * ranks as f64);
            r.optimizer = Some(optimizer.into());
            r.lr_schedule = Some(schedule.into());
            if scaled {
                r.extra.insert("scale_lr".into(), "linear".into());
            }
            r.test_accuracy = Some(accuracy);
            r.target_accuracy = Some(0.85);
            r.time_to_target_s = reached.map(|x| x.0);
            r.epoch_to_target = reached.map(|x| x.1);
            r
        };
        let records = vec![
            with(1, "sgd", "constant", false, 0.90, Some((30.0, 2))),
            with(8, "sgd", "constant", false, 0.80, None),
            with(8, "sgd", "constant after a 1-epoch warm-up", true, 0.891, Some((12.5, 3))),
            // An older record's warm-up in steps: 10 steps of an epoch of 20 (steps 10, epochs 0.5).
            with(8, "lars", "constant after a 10-step warm-up", false, 0.88, Some((14.0, 3))),
        ];
        let tables = group(&records).unwrap();
        assert_eq!(tables.len(), 1);
        let t = &tables[0];
        assert_eq!(
            t.strategies,
            vec!["ring", "ring (lars, constant after a 0.5-epoch warm-up)", "ring (sgd, lr scaled linear, constant after a 1-epoch warm-up)"]
        );
        let md = t.markdown();
        assert!(md.contains("**Test accuracy after the last epoch**"), "{md}");
        assert!(md.contains("| 8 | 512 | 80.0% | 88.0% | 89.1% |"), "{md}");
        assert!(md.contains("**Time to 85.0% test accuracy**"), "{md}");
        assert!(md.contains("| 1 | 64 | 30.0 s (epoch 2) | — | — |"), "{md}");
        assert!(md.contains("| 8 | 512 | not reached | 14.0 s (epoch 3) | 12.5 s (epoch 3) |"), "{md}");
        let csv = t.csv_rows();
        assert_eq!(csv.iter().filter(|r| r.epoch_to_target == Some(3)).count(), 2);
        // Records without a recipe (older binaries) keep their plain column.
        assert_eq!(strategy_label(&record("ring", 2, 1.0)), "ring");
    }

    #[test]
    fn runs_that_differ_in_configuration_never_share_a_table() {
        let base = record("ring", 1, 100.0);
        let variants = vec![
            base.clone(),
            RunRecord { model: "resnet18".into(), ..base.clone() },
            RunRecord { dataset: "cifar10".into(), ..base.clone() },
            RunRecord { image_shape: vec![3, 28, 28], ..base.clone() },
            RunRecord { device: "cuda:0".into(), ..base.clone() },
            RunRecord { batch_per_rank: 32, global_batch: 32, ..base.clone() },
            RunRecord { scaling: "strong".into(), ..base.clone() },
            RunRecord { scaling: "strong".into(), global_batch: 128, batch_per_rank: 128, ..base.clone() },
        ];
        let tables = group(&variants).unwrap();
        assert_eq!(tables.len(), variants.len());
        assert!(tables.iter().all(|t| t.present().count() == 1 && t.superseded() == 0));
        let slugs: std::collections::BTreeSet<_> = tables.iter().map(|t| t.slug.clone()).collect();
        assert_eq!(slugs.len(), tables.len(), "slugs are unique: {slugs:?}");
    }

    #[test]
    fn rank_counts_and_strategies_share_a_table() {
        // Weak scaling holds the batch per rank: the global batch grows with the ranks. Strong
        // scaling holds the global batch: the batch per rank shrinks.
        let runs = vec![
            record("ring", 1, 100.0),
            record("ring", 4, 380.0),
            record("allreduce", 2, 190.0),
            strong("ring", 1, 256, 100.0),
            strong("ring", 4, 256, 300.0),
            strong("allreduce", 2, 256, 180.0),
        ];
        let tables = group(&runs).unwrap();
        assert_eq!(tables.len(), 2);
        assert_eq!(tables[0].key.scaling, Scaling::Weak, "weak tables come first");
        for t in &tables {
            assert_eq!(t.strategies, vec!["allreduce", "ring"]);
            assert_eq!(t.ranks, vec![1, 2, 4]);
            assert_eq!(t.present().count(), 3);
        }
    }

    #[test]
    fn the_most_recent_record_of_a_cell_wins() {
        let at = |ips: f64, timestamp: &str| RunRecord { timestamp: timestamp.into(), ..record("ring", 2, ips) };
        // Out of file order: the latest timestamp wins wherever it is in the file.
        let runs = vec![at(1.0, "2025-01-02T00:00:00Z"), at(2.0, "2025-01-03T00:00:00Z"), at(3.0, "2025-01-01T00:00:00Z")];
        let tables = group(&runs).unwrap();
        let cell = tables[0].cell("ring", 2).unwrap();
        assert_eq!((cell.record.images_per_sec, cell.superseded), (2.0, 2));
        assert!(tables[0].notes().iter().any(|n| n.starts_with("2 older records superseded") && n.contains("ring at 2 ranks: 2")));
        // Time zones are compared as times, not as text.
        let runs = vec![at(1.0, "2025-01-01T10:00:00+02:00"), at(2.0, "2025-01-01T09:00:00Z")];
        assert_eq!(group(&runs).unwrap()[0].cell("ring", 2).unwrap().record.images_per_sec, 2.0);
        // A tie goes to the later line.
        let runs = vec![at(1.0, "2025-01-01T00:00:00Z"), at(2.0, "2025-01-01T00:00:00Z")];
        assert_eq!(group(&runs).unwrap()[0].cell("ring", 2).unwrap().record.images_per_sec, 2.0);
    }

    #[test]
    fn speedup_and_efficiency_follow_their_definitions() {
        assert_eq!(speedup(300.0, 100.0), Some(3.0));
        // Weak: images/s(N) / (N x images/s(1)); strong: speedup(N) / N. The same number.
        assert_eq!(efficiency(300.0, 4, 100.0), Some(300.0 / (4.0 * 100.0)));
        assert_eq!(efficiency(300.0, 4, 100.0), speedup(300.0, 100.0).map(|s| s / 4.0));
        assert_eq!(speedup(300.0, 0.0), None);
        assert_eq!(efficiency(300.0, 4, f64::NAN), None);
        // 100 steps over 2 epochs of a global batch of 256 at 1280 images/s: 50 x 256 / 1280 s.
        assert_eq!(epoch_seconds(100, 2.0, 256, 1280.0), Some(10.0));
        assert_eq!(epoch_seconds(100, 0.0, 256, 1280.0), None);
        assert_eq!(epoch_seconds(100, 2.0, 256, 0.0), None);

        let runs = vec![strong("ring", 1, 256, 100.0), strong("ring", 4, 256, 300.0)];
        let tables = group(&runs).unwrap();
        let f = tables[0].figures("ring", 4).unwrap();
        assert_eq!((f.speedup, f.efficiency, f.images_per_sec_per_rank), (Some(3.0), Some(0.75), 75.0));
        // 10 steps over 0.5 epochs: 20 steps of 256 images per epoch, at 300 images/s.
        assert_eq!(f.epoch_s, Some(20.0 * 256.0 / 300.0));
        let md = tables[0].markdown();
        let detail = table_under(&md, "**Detail: ring**");
        assert_eq!(detail[0], "| Ranks | Global batch | images/s | images/s per rank | speedup | efficiency | compute ms | exchange ms | epoch s | runs | images/s min–max | exchange share | TFLOP/s per rank | MFU |");
        assert_eq!(detail[3], "| 4 | 256 | 300.0 | 75.0 | 3.00 | 75.0% | 10.0 | 2.0 | 17.1 | 1 | 300.0–300.0 | 16.7% | n/a | n/a |", "{md}");
    }

    #[test]
    fn a_strategy_without_a_1_rank_run_gets_no_speedup() {
        let runs = vec![record("ring", 1, 100.0), record("ring", 2, 190.0), record("ring", 4, 360.0), record("allreduce", 2, 180.0), record("allreduce", 4, 350.0)];
        let tables = group(&runs).unwrap();
        let t = &tables[0];
        let f = t.figures("allreduce", 4).unwrap();
        assert_eq!((f.speedup, f.efficiency), (None, None));
        assert_eq!(t.notes(), vec!["no 1-rank run of allreduce: speedup and efficiency not computed".to_string()]);
        let md = t.markdown();
        // The missing 1-rank cell is a dash, never made up; the figures that need it are n/a.
        assert_eq!(table_under(&md, "**Images/s**")[2..], ["| 1 | 64 | — | 100.0 |", "| 2 | 128 | 180.0 | 190.0 |", "| 4 | 256 | 350.0 | 360.0 |"], "{md}");
        assert_eq!(table_under(&md, "**Scaling efficiency**")[2..], ["| 1 | 64 | — | 100.0% |", "| 2 | 128 | n/a | 95.0% |", "| 4 | 256 | n/a | 90.0% |"], "{md}");
        assert_eq!(table_under(&md, "**Speedup**")[2..], ["| 1 | 64 | — | 1.00 |", "| 2 | 128 | n/a | 1.90 |", "| 4 | 256 | n/a | 3.60 |"], "{md}");
        assert_eq!(table_under(&md, "**Detail: allreduce**")[2..], ["| 2 | 128 | 180.0 | 90.0 | n/a | n/a | 10.0 | 2.0 | 1 | 180.0–180.0 | 16.7% | n/a | n/a |", "| 4 | 256 | 350.0 | 87.5 | n/a | n/a | 10.0 | 2.0 | 1 | 350.0–350.0 | 16.7% | n/a | n/a |"], "{md}");
    }

    #[test]
    fn a_missing_rank_count_is_a_dash() {
        let runs = vec![record("ring", 1, 100.0), record("ring", 2, 190.0), record("ring", 4, 360.0), record("allreduce", 1, 100.0), record("allreduce", 4, 350.0)];
        let t = &group(&runs).unwrap()[0];
        assert!(t.figures("allreduce", 2).is_none());
        let md = t.markdown();
        assert_eq!(table_under(&md, "**Images/s**")[3], "| 2 | 128 | — | 190.0 |", "{md}");
        // The detail table lists the rank counts the strategy ran at: no row of dashes.
        let ranks = |table: Vec<&str>| table[2..].iter().map(|row| row.split(" | ").next().unwrap().to_string()).collect::<Vec<_>>();
        assert_eq!(ranks(table_under(&md, "**Detail: allreduce**")), ["| 1", "| 4"], "{md}");
        assert_eq!(ranks(table_under(&md, "**Detail: ring**")), ["| 1", "| 2", "| 4"], "{md}");
        assert_eq!(t.csv_rows().len(), 5);
    }

    #[test]
    fn dedicated_servers_are_counted_as_ranks() {
        let runs = vec![record("ring", 4, 380.0), ps_with_a_server(4, 300.0)];
        let t = &group(&runs).unwrap()[0];
        assert_eq!(t.strategies, vec!["ps (sync)", "ring"]);
        assert_eq!(t.figures("ps (sync)", 4).unwrap().images_per_sec_per_rank, 75.0);
        assert!(t.notes().iter().any(|n| n.starts_with("ps (sync) has dedicated parameter servers (4 ranks, 3 computing)")));
        // Only the workers take a batch: the row shows one number, the other strategy's cell is
        // marked and a note and its detail table give its own.
        let md = t.markdown();
        assert_eq!(table_under(&md, "**Images/s**")[2], "| 4 | 256 | 300.0† | 380.0 |", "{md}");
        assert_eq!(table_under(&md, "**Scaling efficiency**")[2], "| 4 | 256 | n/a† | n/a |", "{md}");
        assert!(md.contains("\n- † ps (sync) ran with global batch 192 at 4 ranks\n"), "{md}");
        assert!(table_under(&md, "**Detail: ps (sync)**")[2].starts_with("| 4 | 192 | 300.0 | 75.0 |"), "{md}");
    }

    #[test]
    fn a_row_shows_the_most_common_global_batch() {
        // Two strategies against one: the two win, whichever is larger.
        let runs = vec![record("ring", 4, 380.0), ps_with_a_server(4, 300.0), RunRecord { workers: 3, global_batch: 192, ..record("allreduce", 4, 290.0) }];
        let t = &group(&runs).unwrap()[0];
        assert_eq!(t.common_global_batch(4), Some(192));
        assert_eq!((t.batch_differs("ring", 4), t.batch_differs("ps (sync)", 4)), (true, false));
        assert_eq!(table_under(&t.markdown(), "**Images/s**")[2], "| 4 | 192 | 290.0 | 300.0 | 380.0† |");
        // On a tie the largest: every rank computing.
        let runs = vec![record("ring", 2, 190.0), ps_with_a_server(2, 90.0), record("ring", 4, 380.0), ps_with_a_server(4, 300.0)];
        let t = &group(&runs).unwrap()[0];
        assert_eq!((t.common_global_batch(2), t.common_global_batch(4), t.common_global_batch(8)), (Some(128), Some(256), None));
        assert!(t.notes().contains(&"† ps (sync) ran with global batch 64 at 2 ranks, 192 at 4 ranks".to_string()), "{:?}", t.notes());
        // The same batch everywhere: nothing marked, no note.
        let runs = vec![record("ring", 1, 100.0), record("ring", 2, 190.0), record("allreduce", 1, 100.0), record("allreduce", 2, 180.0)];
        let t = &group(&runs).unwrap()[0];
        assert!(!t.markdown().contains('†') && t.notes().is_empty(), "{}", t.markdown());
    }

    #[test]
    fn summary_tables_have_a_column_per_strategy() {
        let runs = vec![record("ring", 1, 100.0), record("allreduce", 1, 100.0), ps_with_a_server(2, 90.0)];
        let md = group(&runs).unwrap()[0].markdown();
        for caption in ["**Images/s**", "**Scaling efficiency**", "**Speedup**"] {
            let table = table_under(&md, caption);
            assert_eq!(table[..2], ["| Ranks | Global batch | allreduce | ps (sync) | ring |", "|---:|---:|---:|---:|---:|"], "{md}");
        }
        for s in ["allreduce", "ps (sync)", "ring"] {
            assert_eq!(table_under(&md, &format!("**Detail: {s}**"))[0], "| Ranks | Global batch | images/s | images/s per rank | speedup | efficiency | compute ms | exchange ms | runs | images/s min–max | exchange share | TFLOP/s per rank | MFU |", "{md}");
        }
    }

    #[test]
    fn strategy_variants_get_their_own_column() {
        let ps = |mode: &str, colocate: bool| {
            let mut r = record("ps", 2, 100.0);
            r.extra.insert("ps_mode".into(), mode.into());
            r.extra.insert("ps_colocate".into(), colocate.into());
            r
        };
        let mut horovod = record("horovod", 2, 100.0);
        horovod.extra.insert("compression".into(), "fp16".into());
        horovod.extra.insert("hierarchical".into(), true.into());
        let mut plain_horovod = record("horovod", 2, 100.0);
        plain_horovod.extra.insert("compression".into(), "none".into());
        let labels: Vec<String> = [ps("sync", false), ps("async", true), horovod, plain_horovod, record("ring", 2, 1.0)].iter().map(strategy_label).collect();
        assert_eq!(labels, vec!["ps (sync)", "ps (async, colocated)", "horovod (fp16, hierarchical)", "horovod", "ring"]);
    }

    #[test]
    fn slugs_are_file_name_safe() {
        assert_eq!(slug(&["weak", "ResNet 50", "my/data", "1x28x28", "cuda:0", "b64"]), "weak-resnet-50-my-data-1x28x28-cuda-0-b64");
        let runs = [record("ring", 1, 1.0)];
        let t = &group(&runs).unwrap()[0];
        assert_eq!(t.slug, "weak-tiny-fashion-mnist-1x28x28-cpu-b64");
    }

    #[test]
    fn unknown_scaling_and_bad_timestamps_are_errors() {
        let err = group(&[RunRecord { scaling: "sideways".into(), ..record("ring", 1, 1.0) }]).unwrap_err().to_string();
        assert!(err.contains("unknown scaling \"sideways\""), "{err}");
        let err = group(&[RunRecord { timestamp: "yesterday".into(), ..record("ring", 1, 1.0) }]).unwrap_err().to_string();
        assert!(err.contains("timestamp \"yesterday\""), "{err}");
    }
    /// A study run with --repeats: the records of one study with distinct repeat indices.
    pub(crate) fn repeat(strategy: &str, ranks: usize, images_per_sec: f64, index: u32) -> RunRecord {
        let mut r = record(strategy, ranks, images_per_sec);
        r.study = Some("s".into());
        r.hardware.repeat = Some(index);
        r.timestamp = format!("2025-01-01T00:00:0{index}Z");
        r
    }

    #[test]
    fn repeats_show_their_median_with_the_range_and_rerun_repeats_supersede() {
        let mut runs = vec![
            repeat("ring", 1, 100.0, 0),
            repeat("ring", 1, 90.0, 1),
            repeat("ring", 1, 120.0, 2),
            repeat("ring", 2, 150.0, 0),
            repeat("ring", 2, 190.0, 1),
            repeat("ring", 2, 170.0, 2),
        ];
        // Repeat 1 at 2 ranks run again later (a requeued job): the later run replaces it.
        let mut again = repeat("ring", 2, 180.0, 1);
        again.timestamp = "2025-01-02T00:00:00Z".into();
        runs.push(again);
        // Another study's run of the cell is older: superseded, not a repeat.
        runs.push(RunRecord { study: Some("old".into()), timestamp: "2024-01-01T00:00:00Z".into(), ..record("ring", 2, 10.0) });
        let tables = group(&runs).unwrap();
        let t = &tables[0];
        let cell = t.cell("ring", 2).unwrap();
        assert_eq!((cell.runs.len(), cell.superseded), (3, 2));
        let f = t.figures("ring", 2).unwrap();
        assert_eq!((f.images_per_sec, f.spread.min, f.spread.max, f.spread.runs), (170.0, 150.0, 180.0, 3));
        // Efficiency from the medians: 170 / (2 x 100).
        assert_eq!(f.efficiency, Some(0.85));
        let md = t.markdown();
        assert_eq!(table_under(&md, "**Images/s**")[2..], ["| 1 | 64 | 100.0 (90.0–120.0) |", "| 2 | 128 | 170.0 (150.0–180.0) |"], "{md}");
        assert!(md.contains("- Runs per point: 3; shown: the median run's images/s"), "{md}");
        let csv = t.csv_rows();
        assert_eq!((csv[1].runs, csv[1].images_per_sec_median, csv[1].images_per_sec_min, csv[1].images_per_sec_max), (3, 170.0, 150.0, 180.0));
        // MLPerf's rule: the mean without the fastest and slowest, 3 runs here: the middle one.
        let trimmed = group_with(&runs, Statistic::Trimmed).unwrap();
        assert_eq!(trimmed[0].figures("ring", 2).unwrap().images_per_sec, 170.0);
        assert_eq!(trimmed[0].csv_rows()[1].statistic, "trimmed");
        // Records without repeat indices keep the most recent run only, as before.
        let plain = vec![record("ring", 2, 1.0), RunRecord { timestamp: "2025-02-01T00:00:00Z".into(), ..record("ring", 2, 2.0) }];
        let t = &group(&plain).unwrap()[0];
        assert_eq!((t.cell("ring", 2).unwrap().runs.len(), t.figures("ring", 2).unwrap().images_per_sec), (1, 2.0));
    }

    /// Time to accuracy over repeats: the median with a run that never reached the target as
    /// the slowest, the range and epochs of those that did, and the test accuracy's median.
    #[test]
    fn time_to_accuracy_over_repeats_is_the_median_with_unreached_runs_slowest() {
        let with = |ranks: usize, index: u32, accuracy: f64, reached: Option<(f64, u64)>| {
            let mut r = repeat("ring", ranks, 100.0, index);
            r.test_accuracy = Some(accuracy);
            r.target_accuracy = Some(0.8);
            r.time_to_target_s = reached.map(|x| x.0);
            r.epoch_to_target = reached.map(|x| x.1);
            r
        };
        let runs = vec![
            // 1 rank: all three reached it; the median is the middle time, its run's epoch.
            with(1, 0, 0.84, Some((30.0, 3))),
            with(1, 1, 0.82, Some((10.0, 1))),
            with(1, 2, 0.83, Some((20.0, 2))),
            // 2 ranks: two of three reached it; the median is the slower of the two.
            with(2, 0, 0.81, Some((12.0, 2))),
            with(2, 1, 0.70, None),
            with(2, 2, 0.85, Some((8.0, 2))),
            // 4 ranks: one of three; the median run never reached it.
            with(4, 0, 0.79, None),
            with(4, 1, 0.81, Some((5.0, 1))),
            with(4, 2, 0.78, None),
        ];
        let t = &group(&runs).unwrap()[0];
        let target = |n| t.figures("ring", n).unwrap().target.unwrap();
        assert_eq!((target(1).reached, target(1).range, target(1).epochs), (Some((20.0, 2)), Some((10.0, 30.0)), Some((1, 3))));
        assert_eq!((target(2).reached, target(2).runs_reached, target(2).runs), (Some((12.0, 2)), 2, 3));
        assert_eq!((target(4).reached, target(4).runs_reached, target(4).range), (None, 1, Some((5.0, 5.0))));
        assert_eq!(t.figures("ring", 2).unwrap().test_accuracy, Some(0.81));
        let md = t.markdown();
        let rows = table_under(&md, "**Time to 80.0% test accuracy** (seconds of training, evaluations excluded; median over the runs, a run that never reached it counting as the slowest; range of those that did)");
        assert_eq!(
            rows[2..],
            [
                "| 1 | 64 | 20.0 s (10.0–30.0; epochs 1–3; 3 of 3 runs reached it) |",
                "| 2 | 128 | 12.0 s (8.0–12.0; epoch 2; 2 of 3 runs reached it) |",
                "| 4 | 256 | not reached (1 of 3 runs reached it) |",
            ],
            "{md}"
        );
        assert!(table_under(&md, "**Test accuracy after the last epoch** (median over the runs)")[3].contains("81.0%"), "{md}");
        let csv = t.csv_rows();
        assert_eq!((csv[0].time_to_target_s, csv[0].time_to_target_min_s, csv[0].time_to_target_max_s, csv[0].runs_reaching_target), (Some(20.0), Some(10.0), Some(30.0), Some(3)));
        assert_eq!((csv[2].time_to_target_s, csv[2].runs_reaching_target), (None, Some(1)));
    }

    #[test]
    fn the_trimmed_mean_falls_back_to_the_median_below_three_runs() {
        let runs = vec![repeat("ring", 1, 100.0, 0), repeat("ring", 1, 200.0, 1)];
        let t = &group_with(&runs, Statistic::Trimmed).unwrap()[0];
        let f = t.figures("ring", 1).unwrap();
        assert_eq!((f.images_per_sec, f.spread.trimmed), (150.0, false));
        let md = t.markdown();
        assert!(md.contains("else the median (marked)"), "{md}");
        assert!(table_under(&md, "**Detail: ring**")[2].contains("| 2 (median) |"), "{md}");
    }

    #[test]
    fn ranks_beyond_the_cores_or_gpus_are_flagged() {
        let mut r = record("ring", 4, 100.0);
        r.hardware.cores_per_node = 2;
        assert_eq!(oversubscription(&r).as_deref(), Some("4 ranks x 1 thread on 2 cores"));
        r.ranks = 2;
        assert_eq!(oversubscription(&r), None);
        r.threads = 2;
        assert_eq!(oversubscription(&r).as_deref(), Some("2 ranks x 2 threads on 2 cores"));
        // Two nodes: two ranks on each.
        r.threads = 1;
        r.ranks = 4;
        r.nodes = 2;
        assert_eq!(oversubscription(&r), None);
        let mut gpu = record("ring", 8, 100.0);
        gpu.device = "cuda:0".into();
        gpu.hardware.gpus_per_node = 4;
        assert_eq!(oversubscription(&gpu).as_deref(), Some("8 ranks on 4 GPUs"));
        // An older record does not know the node: nothing claimed.
        assert_eq!(oversubscription(&record("ring", 64, 1.0)), None);
        // In the tables: the cells are marked and a note says why.
        let mut shared = record("ring", 4, 300.0);
        shared.hardware.cores_per_node = 2;
        let runs = [record("ring", 1, 100.0), shared];
        let md = group(&runs).unwrap()[0].markdown();
        assert_eq!(table_under(&md, "**Images/s**")[3], "| 4 | 256 | 300.0‡ |", "{md}");
        assert!(md.contains("‡ oversubscribed") && md.contains("ring at 4 ranks: 4 ranks x 1 thread on 2 cores"), "{md}");
    }

    #[test]
    fn flops_and_mfu_use_the_datasheet_on_gpus_and_the_measured_core_on_cpus() {
        // 1 GFLOP forward per image, 1000 images/s on 2 ranks: 3 x 1e9 x 500 = 1.5 TFLOP/s per rank.
        let mut gpu = record("ring", 2, 1000.0);
        gpu.device = "cuda:0".into();
        gpu.hardware.forward_flops_per_image = 1e9;
        gpu.hardware.device_model = Some("NVIDIA A100-SXM4-80GB".into());
        gpu.extra.insert("precision".into(), "bf16".into());
        let runs = [gpu.clone()];
        let f = group(&runs).unwrap()[0].figures("ring", 2).unwrap();
        assert_eq!(f.flops_per_rank, Some(1.5e12));
        assert!((f.mfu.unwrap() - 1.5 / 312.0).abs() < 1e-12);
        // A model the table lacks: the FLOP/s stand, MFU is n/a.
        gpu.hardware.device_model = Some("Some GPU".into());
        assert!(peak_per_rank(&gpu).is_none());
        // A CPU: 50 GFLOP/s per core; 4 ranks on 2 cores have half a core each.
        let mut cpu = record("ring", 4, 100.0);
        cpu.hardware.core_gflops = Some(50.0);
        cpu.hardware.cores_per_node = 2;
        let (peak, what) = peak_per_rank(&cpu).unwrap();
        assert_eq!(peak, 25e9);
        assert!(what.starts_with("measured"), "{what}");
        // An older record: neither FLOPs nor a peak, and the report says n/a.
        let old = [record("ring", 1, 100.0)];
        let t = &group(&old).unwrap()[0];
        assert_eq!((t.figures("ring", 1).unwrap().flops_per_rank, peak_per_rank(&old[0])), (None, None));
        let md = t.markdown();
        assert!(md.contains("- Model FLOPs: n/a forward per image") && md.contains("- Peak for MFU: n/a"), "{md}");
        assert!(!md.contains("**Achieved TFLOP/s per rank"), "{md}");
    }

    #[test]
    fn a_table_has_its_context_and_a_one_line_summary() {
        let mut runs = vec![record("ring", 1, 100.0), record("ring", 2, 180.0), record("allreduce", 1, 100.0), record("allreduce", 2, 160.0)];
        for r in &mut runs {
            r.extra.insert("measured_steps".into(), 6.into());
            r.extra.insert("warmup_steps".into(), 5.into());
            r.hardware.cores_per_node = 2;
        }
        let t = &group(&runs).unwrap()[0];
        let context = t.context();
        assert_eq!(context[0], "Nodes x ranks per node: 1x1, 1x2");
        assert_eq!(context[1], "Device: cpu, 2 cores per node");
        assert_eq!(context[2], "Threads per rank: 1, 1");
        assert_eq!(context[3], "MPI library and data path: Open MPI, n/a");
        assert_eq!(context[4], "Precision: fp32");
        assert_eq!(context[5], "Global batch: 64, 128 (at 1, 2 ranks)");
        assert_eq!(context[6], "Measured steps per run: 6 after 5 warm-up");
        assert_eq!(t.summary_line(), "Weak scaling: tiny on fashion-mnist (1x28x28), cpu, batch 64 per rank: ring keeps 90.0% scaling efficiency at 2 ranks (1 run, 16.7% of the step exchanging)");
        let only_one = [record("ring", 1, 100.0)];
        assert!(group(&only_one).unwrap()[0].summary_line().ends_with("no scaling efficiency (no 1-rank run, or 1 rank only)"));
    }

    #[test]
    fn old_records_without_the_new_fields_load() {
        // A line of a binary from before the hardware fields and repeats.
        let line = r#"{"strategy":"ring","ranks":2,"model":"tiny","dataset":"d","batch_per_rank":64,"global_batch":128,"scaling":"weak","steps":10,"epochs":0.5,"images_per_sec":100.0,"step_ms":12.0,"compute_ms":10.0,"comm_ms":2.0,"final_loss":1.0,"test_accuracy":null,"device":"cpu","mpi_library":"Open MPI","cuda_aware":false,"host":"h","git_commit":"abc","timestamp":"2025-01-01T00:00:00Z"}"#;
        let r: RunRecord = serde_json::from_str(line).unwrap();
        assert_eq!(r.hardware, crate::results::HardwareRecord::default());
        // And a new record goes out flat and comes back the same.
        let mut new = record("ring", 2, 1.0);
        new.hardware.cores_per_node = 2;
        new.hardware.core_gflops = Some(40.0);
        new.hardware.repeat = Some(1);
        let json = serde_json::to_string(&new).unwrap();
        assert!(json.contains(r#""cores_per_node":2"#) && json.contains(r#""repeat":1"#), "{json}");
        assert_eq!(serde_json::from_str::<RunRecord>(&json).unwrap(), new);
    }
}
