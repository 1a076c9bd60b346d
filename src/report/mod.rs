//! `hpc-train report`: scaling tables (Markdown and CSV) and plots from the records training
//! appends to `runs.jsonl`, and bus-bandwidth plots from the rows `hpc-train bench` appends to
//! `bench.jsonl`.
//!
//! [`tables`] decides which runs share a table and computes the figures, [`busbw`] groups the
//! benchmark rows, [`plots`] draws; this file reads the inputs, writes the files and says where.
//! Serial: rank 0 runs it.

pub mod busbw;
pub mod peaks;
pub mod plots;
pub mod points;
pub mod stats;
pub mod tables;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;

use crate::error::{Error, Result, WithPath};
use crate::results::{self, RunRecord};
use tables::Table;

/// Options of `hpc-train report`.
#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// Training records (JSON lines, as training appends them).
    #[arg(long, default_value = "results/runs.jsonl")]
    pub input: PathBuf,
    /// Report only the runs of this study id.
    #[arg(long)]
    pub study: Option<String>,
    /// Exchange benchmark rows for the bus-bandwidth plots [default: bench.jsonl beside --input,
    /// skipped when absent].
    #[arg(long)]
    pub bench: Option<PathBuf>,
    /// How each point of a sweep ended, as the job files in jobs/ record it: the failed ones get a
    /// section of their own [default: points.jsonl beside --input, skipped when absent].
    #[arg(long)]
    pub points: Option<PathBuf>,
    /// How the runs of a point (`study --repeats`) make its images/s: the median (with the
    /// range beside it), or MLPerf's mean without the fastest and slowest run (3 runs or more).
    #[arg(long, value_enum, default_value_t = stats::Statistic::Median)]
    pub statistic: stats::Statistic,
    /// Folder for report.md, the CSV files and the plots.
    #[arg(long, default_value = "results/report")]
    pub out: PathBuf,
}

const REPORT_FILE: &str = "report.md";
/// The benchmark file looked for beside the runs file when `--bench` is not given.
const BENCH_FILE: &str = crate::bench::BENCH_FILE;

pub fn run(args: &ReportArgs) -> Result<()> {
    let points_path = args.points.clone().unwrap_or_else(|| args.input.with_file_name(points::POINTS_FILE));
    let failed = if points_path.is_file() {
        points::failed(&points_path, args.study.as_deref())?
    } else if args.points.is_some() {
        return Err(Error::Results(format!("{}: no such file (--points)", points_path.display())));
    } else {
        Vec::new()
    };
    // A sweep whose every point failed has no runs, and its report lists the failures.
    let (records, read) = match read_runs(&args.input, args.study.as_deref()) {
        Err(e) if !failed.is_empty() => {
            log::warn!("{e}: the report lists the failed points only");
            (Vec::new(), 0)
        }
        other => other?,
    };
    let tables = tables::group_with(&records, args.statistic)?;
    let bench_path = args.bench.clone().unwrap_or_else(|| args.input.with_file_name(BENCH_FILE));
    let bench = if bench_path.is_file() {
        Some(results::read_json_lines::<busbw::BenchRecord>(&bench_path)?)
    } else if args.bench.is_some() {
        return Err(Error::Results(format!("{}: no such file (--bench)", bench_path.display())));
    } else {
        log::info!("no {} beside {}: no bus-bandwidth plots", BENCH_FILE, args.input.display());
        None
    };

    results::check_writable(&args.out)?;
    let png = match plots::load_font() {
        Ok(font) => {
            log::debug!("PNG plot text in {}", font.display());
            true
        }
        Err(why) => {
            log::warn!("{why}: writing SVG plots only, no PNG");
            false
        }
    };
    let mut written: Vec<PathBuf> = Vec::new();
    let mut sections = Vec::new();
    for table in &tables {
        let csv_path = args.out.join(format!("{}.csv", table.slug));
        write_csv(&csv_path, &table.csv_rows())?;
        written.push(csv_path);
        let mut links = vec![format!("[throughput]({}-throughput.svg)", table.slug)];
        written.extend(plots::write(&plots::throughput_chart(table), &args.out.join(format!("{}-throughput", table.slug)), png)?);
        if let Some(chart) = plots::efficiency_chart(table) {
            written.extend(plots::write(&chart, &args.out.join(format!("{}-efficiency", table.slug)), png)?);
            links.push(format!("[efficiency]({}-efficiency.svg)", table.slug));
        }
        if let Some(chart) = plots::bubble_chart(table) {
            written.extend(plots::write(&chart, &args.out.join(format!("{}-bubble", table.slug)), png)?);
            links.push(format!("[bubble]({}-bubble.svg)", table.slug));
        }
        if let Some(chart) = plots::accuracy_chart(table) {
            written.extend(plots::write(&chart, &args.out.join(format!("{}-accuracy", table.slug)), png)?);
            links.push(format!("[accuracy]({}-accuracy.svg)", table.slug));
        }
        if let Some(chart) = plots::time_to_accuracy_chart(table) {
            written.extend(plots::write(&chart, &args.out.join(format!("{}-time-to-accuracy", table.slug)), png)?);
            links.push(format!("[time to accuracy]({}-time-to-accuracy.svg)", table.slug));
        }
        sections.push(format!("{}\nData: [{slug}.csv]({slug}.csv). Plots: {}.\n", table.markdown(), links.join(", "), slug = table.slug));
    }
    if let Some(rows) = &bench {
        let (groups, wrong) = busbw::group(rows);
        if wrong > 0 {
            log::warn!("{}: left out {wrong} row(s) with wrong elements", bench_path.display());
        }
        let mut lines = Vec::new();
        for g in &groups {
            written.extend(plots::write(&plots::busbw_chart(g), &args.out.join(g.key.slug()), png)?);
            let strategies: Vec<&str> = g.series.keys().map(String::as_str).collect();
            lines.push(format!(
                "- {} ranks, {}, {}, {} layout ({}): [{slug}.svg]({slug}.svg)",
                g.key.ranks, g.key.device, g.key.dtype, g.key.layout, strategies.join(", "), slug = g.key.slug()
            ));
        }
        sections.push(bench_section(&bench_path, &lines, wrong));
    }
    if !failed.is_empty() {
        log::warn!("{} point(s) of the sweep failed: {}", failed.len(), failed.iter().map(|p| format!("{} (exit {})", p.point, p.exit_code)).collect::<Vec<_>>().join(", "));
        sections.push(points::section(&points_path, &failed));
    }

    let report = args.out.join(REPORT_FILE);
    let text = document(&args.input, args.study.as_deref(), records.len(), read, &tables, &sections);
    std::fs::write(&report, text).at(&report)?;
    let superseded: usize = tables.iter().map(Table::superseded).sum();
    println!(
        "wrote {}: {} table{} from {} run{} ({superseded} superseded){}",
        report.display(),
        tables.len(),
        plural(tables.len()),
        records.len(),
        plural(records.len()),
        if failed.is_empty() { String::new() } else { format!(", {} failed point{}", failed.len(), plural(failed.len())) }
    );
    for path in written {
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// The records of `input` (of one study when `study` is given), and how many the file held.
fn read_runs(input: &Path, study: Option<&str>) -> Result<(Vec<RunRecord>, usize)> {
    if !input.exists() {
        return Err(Error::Results(format!("{}: no such file (training appends its records there; see --input)", input.display())));
    }
    let all = results::read_json_lines::<RunRecord>(input)?;
    if all.is_empty() {
        return Err(Error::Results(format!("{}: no run records", input.display())));
    }
    let read = all.len();
    // A run that measured nothing (a resume with no step left, from before such runs stopped
    // being recorded) would replace the real one at its rank count: leave it out.
    let (all, unmeasured): (Vec<RunRecord>, Vec<RunRecord>) = all.into_iter().partition(has_measured_steps);
    if !unmeasured.is_empty() {
        log::warn!("{}: left out {} record(s) with no measured steps", input.display(), unmeasured.len());
    }
    if all.is_empty() {
        return Err(Error::Results(format!("{}: no run record with measured steps", input.display())));
    }
    let Some(study) = study else {
        return Ok((all, read));
    };
    let mut studies: Vec<&str> = all.iter().filter_map(|r| r.study.as_deref()).collect();
    studies.sort_unstable();
    studies.dedup();
    if !studies.contains(&study) {
        let found = if studies.is_empty() { "none of its records has a study id".to_string() } else { format!("studies found: {}", studies.join(", ")) };
        return Err(Error::Results(format!("{}: no runs of study {study:?}; {found}", input.display())));
    }
    let of_study = all.into_iter().filter(|r| r.study.as_deref() == Some(study)).collect();
    Ok((of_study, read))
}

/// Whether a record has steps and a throughput to show.
fn has_measured_steps(r: &RunRecord) -> bool {
    r.steps > 0 && r.images_per_sec.is_finite() && r.images_per_sec > 0.0
}

fn write_csv(path: &Path, rows: &[tables::CsvRow]) -> Result<()> {
    let failed = |e: csv::Error| Error::Results(format!("{}: {e}", path.display()));
    let mut writer = csv::Writer::from_path(path).map_err(failed)?;
    for row in rows {
        writer.serialize(row).map_err(failed)?;
    }
    writer.flush().at(path)
}

fn bench_section(path: &Path, lines: &[String], wrong: usize) -> String {
    let mut out = String::from("## Exchange benchmark: bus bandwidth\n\n");
    let _ = writeln!(
        out,
        "From `{}`: bus bandwidth (nccl-tests' definition) against message size, one plot per rank count, device, \
         element type and layout, the most recent row of each size and strategy.",
        path.display()
    );
    if wrong > 0 {
        let _ = writeln!(out, "{wrong} row{} with wrong elements left out.", plural(wrong));
    }
    out.push('\n');
    for line in lines {
        let _ = writeln!(out, "{line}");
    }
    out
}

/// The whole report: what it was made from, how to read it, then the sections. Nothing in it
/// depends on when or where it was made, so the same records always give the same text.
fn document(input: &Path, study: Option<&str>, used: usize, read: usize, tables: &[Table], sections: &[String]) -> String {
    let mut out = String::from("# Scaling report\n\n");
    let which = match study {
        Some(s) => format!("{used} of its {read} records, those of study `{s}`"),
        None => format!("{read} record{}", plural(read)),
    };
    let _ = writeln!(out, "From `{}`: {which}, in {} section{}.\n", input.display(), tables.len(), plural(tables.len()));
    if !tables.is_empty() {
        out.push_str("In one line each:\n");
        for t in tables {
            let _ = writeln!(out, "- {}", t.summary_line());
        }
        out.push('\n');
    }
    out.push_str(READING_GUIDE);
    for section in sections {
        out.push('\n');
        out.push_str(section);
    }
    out
}

const READING_GUIDE: &str = "\
How to read the tables:
- A section holds runs that differ only in strategy and rank count: same scaling mode, model, dataset, image shape, \
device and batch (per rank for weak scaling, global for strong scaling).
- A section opens with three narrow tables, images/s, scaling efficiency and speedup: a row per rank count (N), \
its global batch, then a column per strategy. A detail table per strategy follows, a row per rank count it ran at, \
with all its figures.
- A strategy's column names its variant where it has one: ps (sync), ps (async, colocated), horovod (fp16, hierarchical).
- Global batch: images per step over all ranks. Where strategies differ at a rank count, the row shows the most common \
(on a tie the largest) and marks with † the cells of a strategy that ran with another; a note under the tables \
gives it, and the strategy's detail table shows its own in every row.
- speedup(N) = images/s at N ranks / images/s at 1 rank, of the same strategy.
- efficiency, weak scaling = images/s(N) / (N x images/s(1)); strong scaling = speedup(N) / N, the same formula.
- images/s per rank = images/s / N.
- compute ms / exchange ms: mean time per step computing gradients / exchanging them (compute_ms / comm_ms).
- epoch s (strong scaling, in the detail tables) = steps per epoch x global batch / images/s, with steps per epoch = \
steps / epochs: the records do not hold the training-set size.
- N counts every rank, dedicated parameter servers included: efficiency is measured against the resources used.
- — : no run at that rank count (never interpolated); n/a: not computable (no 1-rank run of the strategy).
- Where a strategy ran more than once at a rank count, the most recent run is shown (by timestamp; on a tie, the later line), \
with the other repeats of its study (`study --repeats`, the job files' REPEATS): images/s is then their median \
(`report --statistic trimmed`: MLPerf's mean without the fastest and slowest run), the fastest and slowest in brackets, \
and speedup and efficiency are taken from it.
- Context: the nodes and ranks per node, device, MPI library and data path, precision, global batch and measured steps \
the figures rest on. ‡ marks points whose ranks outnumber the node's cores (ranks x threads) or GPUs.
- exchange share = exchange ms / step ms: the communication not hidden behind computing.
- TFLOP/s per rank = 3 x the model's forward FLOPs per image (counted from its layers) x images/s per rank; \
MFU = that over one rank's peak: the device's dense datasheet peak for the run's precision on GPUs, \
a matmul measured on the spot on CPUs (the context says which).
";

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}
