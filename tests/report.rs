//! `hpc-train report` on fixed records: the Markdown must match the expected file exactly, the
//! CSV files must hold the chosen records, the plots must exist, and bad input must end with
//! one clear error.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

const RUNS: &str = "tests/fixtures/runs.jsonl";
const EXPECTED: &str = "tests/fixtures/report.md";
const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// The tables the fixture makes, and the (strategy, ranks) cells each one has.
fn expected_tables() -> BTreeMap<&'static str, Vec<(&'static str, usize)>> {
    BTreeMap::from([
        ("weak-tiny-fashion-mnist-1x28x28-cpu-b64", vec![("allreduce", 1), ("allreduce", 4), ("ps (sync)", 4), ("ring", 1), ("ring", 2), ("ring", 4)]),
        ("weak-tiny-fashion-mnist-1x28x28-cpu-b32", vec![("allreduce", 1)]),
        ("weak-resnet18-fashion-mnist-1x28x28-cpu-b64", vec![("horovod", 1), ("horovod", 2)]),
        (
            "strong-tiny-fashion-mnist-1x28x28-cpu-gb256",
            vec![("ps (sync)", 2), ("ps (sync)", 3), ("ps (sync)", 5), ("ring", 1), ("ring", 2), ("ring", 4)],
        ),
    ])
}

const EXCHANGE_SHARE: &str = "**Exchange share of the step** (exchange ms / step ms: the communication not hidden behind computing; with overlap, the exposed part only)";

const BUSBW_PLOTS: [&str; 2] = ["busbw-2ranks-cpu-float-single", "busbw-4ranks-cpu-float-single"];

/// `hpc-train report <args>` without mpirun, with extra environment variables.
fn report(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(bin());
    cmd.arg("report").args(args).current_dir(root());
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_with_limit(cmd, Duration::from_secs(60))
}

/// The font the binary will use for PNG plots, if it is there.
fn font_present() -> bool {
    std::env::var_os("HPC_TRAIN_FONT").map(PathBuf::from).unwrap_or_else(|| DEFAULT_FONT.into()).is_file()
}

fn files_with_extension(dir: &Path, ext: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn expect_error(run: &Run, message: &str) {
    assert!(!run.timed_out, "hung:\n{}", run.all_output());
    assert!(!run.ok(), "succeeded:\n{}", run.all_output());
    assert_eq!(run.stderr.matches(message).count(), 1, "expected {message:?} once in:\n{}", run.all_output());
    assert_eq!(run.stderr.lines().filter(|l| l.starts_with("error:")).count(), 1, "one error line:\n{}", run.stderr);
}

#[test]
fn the_report_matches_the_expected_markdown() {
    let out = scratch("report-md");
    let run = report(&["--input", RUNS, "--out", out.to_str().unwrap()], &[]).expect_ok();
    let written = std::fs::read_to_string(out.join("report.md")).unwrap();
    let expected = std::fs::read_to_string(root().join(EXPECTED)).unwrap();
    assert!(written == expected, "report.md differs from {EXPECTED}:\n--- written\n{written}\n--- expected\n{expected}");
    assert!(run.stdout.contains(&format!("wrote {}: 4 tables from 16 runs (1 superseded)", out.join("report.md").display())), "{}", run.stdout);
    // The truncated last line of the fixture is skipped with a warning naming it.
    assert!(run.stderr.contains("runs.jsonl:17: skipping a truncated line"), "{}", run.stderr);
    std::fs::remove_dir_all(&out).unwrap();
}

/// A table of report.md: the caption line above it, its header and its rows, cells trimmed.
struct MdTable {
    caption: String,
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

/// A `## ` section of report.md: its text, the slug its data link names, and its tables.
struct Section {
    text: String,
    slug: String,
    tables: Vec<MdTable>,
}

fn cells(line: &str) -> Vec<String> {
    line.trim().trim_matches('|').split('|').map(|c| c.trim().to_string()).collect()
}

/// The scaling sections of a report (those with a data link), in order.
fn scaling_sections(md: &str) -> Vec<Section> {
    let mut sections = Vec::new();
    for text in md.split("\n## ").skip(1) {
        let Some(link) = text.lines().find_map(|l| l.strip_prefix("Data: [")) else { continue };
        let slug = link.split(".csv]").next().unwrap().to_string();
        let mut tables: Vec<MdTable> = Vec::new();
        let mut caption = String::new();
        let mut lines = text.lines().peekable();
        while let Some(line) = lines.next() {
            if !line.starts_with('|') {
                if !line.is_empty() {
                    caption = line.to_string();
                }
                continue;
            }
            let header = cells(line);
            lines.next(); // the alignment line
            let mut rows = Vec::new();
            while let Some(row) = lines.next_if(|l| l.starts_with('|')) {
                rows.push(cells(row));
            }
            tables.push(MdTable { caption: caption.clone(), header, rows });
        }
        sections.push(Section { text: text.to_string(), slug, tables });
    }
    sections
}

/// Whether a summary cell is one figure: a number or a percentage, "—" or "n/a", perhaps
/// marked as run with another global batch. Never a list.
fn is_one_figure(cell: &str) -> bool {
    let figure = cell.trim_end_matches('†').trim_end_matches('%');
    figure == "—" || figure == "n/a" || figure.parse::<f64>().is_ok()
}

/// The layout of the issue: per section, images/s, efficiency and speedup, each with the
/// columns Ranks, Global batch and one per strategy, a number as global batch, then a detail
/// table per strategy with a row per rank count it ran at.
#[test]
fn each_section_has_a_narrow_table_per_figure_and_a_detail_table_per_strategy() {
    let out = scratch("report-layout");
    report(&["--input", RUNS, "--out", out.to_str().unwrap()], &[]).expect_ok();
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    let sections = scaling_sections(&md);
    let expected = expected_tables();
    assert_eq!(sections.len(), expected.len(), "{md}");
    for section in &sections {
        let cells_run = &expected[section.slug.as_str()];
        let mut strategies: Vec<&str> = cells_run.iter().map(|&(s, _)| s).collect();
        strategies.dedup();
        let detail_columns = ["Ranks", "Global batch", "images/s", "images/s per rank", "speedup", "efficiency", "compute ms", "exchange ms"];
        let detail_columns = if section.slug.starts_with("strong") { [&detail_columns[..], &["epoch s"]].concat() } else { detail_columns.to_vec() };
        let detail_columns = [&detail_columns[..], &["runs", "images/s min–max", "exchange share", "TFLOP/s per rank", "MFU"]].concat();
        // Every fixture record has a test accuracy, so every section has the accuracy table;
        // no fixture record counts its model's FLOPs (older binaries), so none has the FLOP/s table.
        let mut want: Vec<(String, Vec<&str>)> = ["**Images/s**", "**Scaling efficiency**", "**Speedup**", "**Test accuracy after the last epoch**", EXCHANGE_SHARE]
            .iter()
            .map(|c| (c.to_string(), [&["Ranks", "Global batch"][..], &strategies].concat()))
            .collect();
        want.extend(strategies.iter().map(|s| (format!("**Detail: {s}**"), detail_columns.clone())));
        let got: Vec<(String, Vec<&str>)> = section.tables.iter().map(|t| (t.caption.clone(), t.header.iter().map(String::as_str).collect())).collect();
        assert_eq!(got, want, "{}", section.slug);
        for t in &section.tables {
            for row in &t.rows {
                assert!(row[1].parse::<usize>().is_ok(), "{}, {}: global batch {:?}", section.slug, t.caption, row[1]);
            }
        }
        for t in &section.tables[..5] {
            assert!(t.rows.iter().flat_map(|r| &r[2..]).all(|c| is_one_figure(c)), "{}, {}: {:?}", section.slug, t.caption, t.rows);
        }
        for (s, t) in strategies.iter().zip(&section.tables[5..]) {
            let ranks: Vec<usize> = t.rows.iter().map(|r| r[0].parse().unwrap()).collect();
            let ran: Vec<usize> = cells_run.iter().filter(|&&(c, _)| c == *s).map(|&(_, n)| n).collect();
            assert_eq!(ranks, ran, "{}, {s}", section.slug);
        }
    }
    // At 4 ranks, ps with a dedicated server has 3 workers taking a batch of 64: the row shows
    // the others' 256, marks ps's cells and names its own under the tables and in its detail.
    let tiny = sections.iter().find(|s| s.slug == "weak-tiny-fashion-mnist-1x28x28-cpu-b64").unwrap();
    assert_eq!(tiny.tables[0].rows[2], ["4", "256", "3500.0", "2400.0†", "3600.0"]);
    assert_eq!(tiny.tables[1].rows[2], ["4", "256", "86.6%", "n/a†", "90.0%"]);
    assert!(tiny.text.contains("\n- † ps (sync) ran with global batch 192 at 4 ranks\n"), "{}", tiny.text);
    assert_eq!(tiny.tables[3].rows[2], ["4", "256", "78.0%", "78.0%†", "78.0%"]);
    assert_eq!(tiny.tables[6].rows, [["4", "192", "2400.0", "600.0", "n/a", "n/a", "61.0", "30.0", "1", "2400.0–2400.0", "33.0%", "n/a", "n/a"]]);
    // Strong scaling holds the global batch: nothing differs, nothing is marked.
    assert!(!sections.iter().find(|s| s.slug.starts_with("strong")).unwrap().text.contains('†'));
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn each_table_has_a_csv_file_with_a_row_per_strategy_and_rank_count() {
    let out = scratch("report-csv");
    let run = report(&["--input", RUNS, "--out", out.to_str().unwrap()], &[]).expect_ok();
    let expected = expected_tables();
    assert_eq!(files_with_extension(&out, "csv"), expected.keys().map(|s| s.to_string()).collect::<Vec<_>>());
    for (slug, cells) in &expected {
        let path = out.join(format!("{slug}.csv"));
        assert!(run.stdout.contains(&format!("wrote {}", path.display())), "{}", run.stdout);
        let mut reader = csv::Reader::from_path(&path).unwrap();
        let headers = reader.headers().unwrap().clone();
        let col = |name: &str| headers.iter().position(|h| h == name).unwrap_or_else(|| panic!("{slug}: no column {name}"));
        let rows: Vec<csv::StringRecord> = reader.records().map(|r| r.unwrap()).collect();
        let got: Vec<(String, usize)> = rows.iter().map(|r| (r[col("strategy")].to_string(), r[col("ranks")].parse().unwrap())).collect();
        let want: Vec<(String, usize)> = cells.iter().map(|&(s, n)| (s.to_string(), n)).collect();
        assert_eq!(got, want, "{slug}");
        for r in &rows {
            assert_eq!(&r[col("table")], *slug, "{r:?}");
        }
    }
    // The superseded 2-rank ring run (1700 images/s, older though later in the file) is not the one kept.
    let mut reader = csv::Reader::from_path(out.join("weak-tiny-fashion-mnist-1x28x28-cpu-b64.csv")).unwrap();
    let ring2 = reader.deserialize::<BTreeMap<String, String>>().map(|r| r.unwrap()).find(|r| r["strategy"] == "ring" && r["ranks"] == "2").unwrap();
    assert_eq!((ring2["images_per_sec"].as_str(), ring2["superseded"].as_str(), ring2["speedup"].as_str()), ("1900.0", "1", "1.9"));
    // Without a 1-rank run, speedup and efficiency are empty, not guessed.
    let mut reader = csv::Reader::from_path(out.join("strong-tiny-fashion-mnist-1x28x28-cpu-gb256.csv")).unwrap();
    for r in reader.deserialize::<BTreeMap<String, String>>().map(|r| r.unwrap()).filter(|r| r["strategy"] == "ps (sync)") {
        assert_eq!((r["speedup"].as_str(), r["efficiency"].as_str()), ("", ""), "{r:?}");
        assert!(!r["epoch_s"].is_empty(), "{r:?}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn plots_are_written_for_every_table_and_benchmark_group() {
    let out = scratch("report-plots");
    report(&["--input", RUNS, "--out", out.to_str().unwrap()], &[]).expect_ok();
    let mut stems: Vec<String> =
        expected_tables().keys().flat_map(|slug| ["throughput", "efficiency", "accuracy"].map(|plot| format!("{slug}-{plot}"))).collect();
    stems.extend(BUSBW_PLOTS.iter().map(|s| s.to_string()));
    stems.sort();
    assert_eq!(files_with_extension(&out, "svg"), stems);
    for stem in &stems {
        let svg = std::fs::read_to_string(out.join(format!("{stem}.svg"))).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{stem}.svg");
    }
    // The bus-bandwidth plot labels sizes on its log-2 axis and has a series per strategy.
    let busbw = std::fs::read_to_string(out.join("busbw-4ranks-cpu-float-single.svg")).unwrap();
    for label in ["4K", "64K", "1M", "allreduce", "ring", "bus bandwidth (GB/s)"] {
        assert!(busbw.contains(&format!("\n{label}\n")), "no {label:?} in the bus-bandwidth plot");
    }
    if font_present() {
        assert_eq!(files_with_extension(&out, "png"), stems);
        for stem in &stems {
            let png = std::fs::read(out.join(format!("{stem}.png"))).unwrap();
            assert!(png.len() > 1000 && png.starts_with(b"\x89PNG"), "{stem}.png");
        }
    } else {
        assert!(files_with_extension(&out, "png").is_empty());
    }
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn without_a_font_svg_plots_are_still_written() {
    let out = scratch("report-nofont");
    let missing = out.join("no-such-font.ttf");
    let run = report(&["--input", RUNS, "--out", out.to_str().unwrap()], &[("HPC_TRAIN_FONT", missing.to_str().unwrap())]).expect_ok();
    assert!(run.stderr.contains(&format!("font {}", missing.display())) && run.stderr.contains("SVG plots only"), "{}", run.stderr);
    assert!(files_with_extension(&out, "png").is_empty());
    assert_eq!(files_with_extension(&out, "svg").len(), 3 * expected_tables().len() + BUSBW_PLOTS.len());
    let expected = std::fs::read_to_string(root().join(EXPECTED)).unwrap();
    assert_eq!(std::fs::read_to_string(out.join("report.md")).unwrap(), expected);
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn without_a_bench_file_there_are_no_bus_bandwidth_plots() {
    let dir = scratch("report-nobench");
    let input = dir.join("runs.jsonl");
    std::fs::copy(root().join(RUNS), &input).unwrap();
    let out = dir.join("report");
    report(&["--input", input.to_str().unwrap(), "--out", out.to_str().unwrap()], &[]).expect_ok();
    assert!(!files_with_extension(&out, "svg").iter().any(|s| s.starts_with("busbw")));
    assert!(!std::fs::read_to_string(out.join("report.md")).unwrap().contains("## Exchange benchmark"));
    // Named explicitly, a missing bench file is an error.
    let missing = dir.join("bench.jsonl");
    let run = report(&["--input", input.to_str().unwrap(), "--bench", missing.to_str().unwrap(), "--out", out.to_str().unwrap()], &[]);
    expect_error(&run, &format!("{}: no such file (--bench)", missing.display()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_study_selects_its_runs() {
    let out = scratch("report-study");
    report(&["--input", RUNS, "--study", "models", "--out", out.to_str().unwrap()], &[]).expect_ok();
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("From `tests/fixtures/runs.jsonl`: 3 of its 16 records, those of study `models`, in 2 sections."), "{md}");
    let headings: Vec<&str> = md.lines().filter(|l| l.starts_with("## ") && !l.contains("benchmark")).collect();
    assert_eq!(
        headings,
        vec![
            "## Weak scaling: resnet18 on fashion-mnist (1x28x28), cpu, batch 64 per rank",
            "## Weak scaling: tiny on fashion-mnist (1x28x28), cpu, batch 32 per rank",
        ]
    );
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn an_unknown_study_is_an_error_listing_the_studies_found() {
    let out = scratch("report-nostudy");
    let run = report(&["--input", RUNS, "--study", "nope", "--out", out.to_str().unwrap()], &[]);
    expect_error(&run, "tests/fixtures/runs.jsonl: no runs of study \"nope\"; studies found: models, scaling-1");
    assert!(!out.join("report.md").exists());
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn a_malformed_line_is_an_error_naming_it() {
    let dir = scratch("report-malformed");
    let text = std::fs::read_to_string(root().join(RUNS)).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    // Complete JSON of the wrong shape in the middle of the file: not a crash's cut line.
    lines.insert(2, r#"{"strategy": "ring", "ranks": "two"}"#);
    let input = dir.join("runs.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = dir.join("report");
    let run = report(&["--input", input.to_str().unwrap(), "--out", out.to_str().unwrap()], &[]);
    expect_error(&run, &format!("{}:3: not a valid record", input.display()));
    assert!(!out.join("report.md").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A record without measured steps (a resume with nothing left, as written before such runs
/// stopped being recorded) never replaces the real run at its rank count.
#[test]
fn records_without_measured_steps_are_left_out() {
    let dir = scratch("report-unmeasured");
    let mut text = std::fs::read_to_string(root().join(RUNS)).unwrap();
    let mut empty: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    empty["steps"] = 0.into();
    empty["epochs"] = 0.0.into();
    empty["images_per_sec"] = 0.0.into();
    empty["timestamp"] = "2099-01-01T00:00:00Z".into();
    if !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&format!("{empty}\n"));
    let input = dir.join("runs.jsonl");
    std::fs::write(&input, text).unwrap();
    let out = dir.join("report");
    let run = report(&["--input", input.to_str().unwrap(), "--out", out.to_str().unwrap()], &[]).expect_ok();
    assert!(run.stderr.contains("left out 1 record(s) with no measured steps"), "{}", run.stderr);
    let expected = std::fs::read_to_string(root().join(EXPECTED)).unwrap();
    let got = std::fs::read_to_string(out.join("report.md")).unwrap();
    // The same tables as without the empty record (only the header's count of records read differs).
    let tables = |md: &str| md.lines().filter(|l| l.starts_with('|')).map(String::from).collect::<Vec<_>>();
    assert_eq!(tables(&got), tables(&expected));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_missing_or_empty_input_is_an_error() {
    let dir = scratch("report-noinput");
    let input = dir.join("runs.jsonl");
    let out = dir.join("report");
    let run = report(&["--input", input.to_str().unwrap(), "--out", out.to_str().unwrap()], &[]);
    expect_error(&run, &format!("{}: no such file", input.display()));
    std::fs::write(&input, "\n").unwrap();
    let run = report(&["--input", input.to_str().unwrap(), "--out", out.to_str().unwrap()], &[]);
    expect_error(&run, &format!("{}: no run records", input.display()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn under_mpirun_rank_0_reports_once() {
    let out = scratch("report-mpirun");
    let run = mpirun_env(2, &["report", "--input", RUNS, "--out", out.to_str().unwrap()], &[], Duration::from_secs(120)).expect_ok();
    assert_eq!(run.stdout.matches("report.md: 4 tables").count(), 1, "{}", run.stdout);
    assert_eq!(std::fs::read_to_string(out.join("report.md")).unwrap(), std::fs::read_to_string(root().join(EXPECTED)).unwrap());
    // An error is printed once, and every rank exits non-zero.
    let run = mpirun_env(2, &["report", "--input", RUNS, "--study", "nope", "--out", out.to_str().unwrap()], &[], Duration::from_secs(120));
    expect_error(&run, "no runs of study \"nope\"");
    std::fs::remove_dir_all(&out).unwrap();
}

/// `study --repeats`: each point runs that many times, the strategies of a rank count rotated
/// from one repeat to the next, every record with its repeat index, the node's cores, the
/// model's FLOPs and the measured core rate; the report counts the runs per point. One launch
/// of one rank, the tiny model, one measured step per run.
#[test]
fn a_study_with_repeats_records_each_run_and_the_report_counts_them() {
    let dir = scratch("report-repeats");
    let results = dir.join("results");
    let args = [
        "study", "--ranks", "1", "--strategies", "ring,allreduce", "--repeats", "2", "--study-id", "rep", "--model", "tiny",
        "--data", "synthetic:1x8x8:4:64", "--batch-size", "4", "--warmup-steps", "0", "--measured-steps", "1", "--no-eval",
        "--results", results.to_str().unwrap(),
    ];
    mpirun_env(1, &args, &[], Duration::from_secs(120)).expect_ok();
    let records: Vec<serde_json::Value> =
        std::fs::read_to_string(results.join("runs.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let order: Vec<(&str, u64)> = records.iter().map(|r| (r["strategy"].as_str().unwrap(), r["repeat"].as_u64().unwrap())).collect();
    assert_eq!(order, [("ring", 0), ("allreduce", 0), ("allreduce", 1), ("ring", 1)]);
    for r in &records {
        assert!(r["cores_per_node"].as_u64().unwrap() >= 1, "{r}");
        // The tiny CNN on 1x8x8: conv1 2x1x16x9x64, conv2 (4x4) 2x16x32x9x16, fc 2x32x4.
        assert_eq!(r["forward_flops_per_image"].as_f64(), Some((2 * 16 * 9 * 64 + 2 * 16 * 32 * 9 * 16 + 2 * 32 * 4) as f64), "{r}");
        assert!(r["core_gflops"].as_f64().unwrap() > 0.0, "{r}");
    }
    let out = dir.join("report");
    report(&["--input", results.join("runs.jsonl").to_str().unwrap(), "--out", out.to_str().unwrap()], &[]).expect_ok();
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("- Runs per point: 2; shown: the median run's images/s"), "{md}");
    std::fs::remove_dir_all(&dir).unwrap();
}
