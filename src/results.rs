//! Results: the record of a run, appended to `runs.jsonl`, and the checks that the results
//! folder can take it.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result, WithPath};

pub const RUNS_FILE: &str = "runs.jsonl";

/// The commit the binary was built from.
pub const GIT_COMMIT: &str = env!("HPC_TRAIN_GIT_COMMIT");

/// One training run, as appended to `runs.jsonl`. Figures are means per step over the steps
/// after warm-up; times in milliseconds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RunRecord {
    pub strategy: String,
    pub ranks: usize,
    /// Ranks that computed gradients (all but dedicated parameter servers).
    #[serde(default)]
    pub workers: usize,
    #[serde(default)]
    pub nodes: usize,
    pub model: String,
    pub dataset: String,
    #[serde(default)]
    pub image_shape: Vec<usize>,
    pub batch_per_rank: usize,
    pub global_batch: usize,
    pub scaling: String,
    pub steps: u64,
    pub epochs: f64,
    pub images_per_sec: f64,
    pub step_ms: f64,
    pub compute_ms: f64,
    pub comm_ms: f64,
    #[serde(default)]
    pub data_wait_ms: f64,
    #[serde(default)]
    pub optimizer_ms: f64,
    pub final_loss: f64,
    pub test_accuracy: Option<f64>,
    #[serde(default)]
    pub test_loss: Option<f64>,
    pub device: String,
    pub mpi_library: String,
    pub cuda_aware: bool,
    #[serde(default)]
    pub data_path: Option<String>,
    #[serde(default)]
    pub threads: usize,
    #[serde(default)]
    pub bucket_mb: f64,
    #[serde(default)]
    pub peak_rss_mb: f64,
    /// Resident memory after warm-up and at the end (max over ranks): a flat run keeps them close.
    #[serde(default)]
    pub rss_warmup_mb: f64,
    #[serde(default)]
    pub rss_end_mb: f64,
    pub host: String,
    pub git_commit: String,
    pub timestamp: String,
    #[serde(default)]
    pub study: Option<String>,
    /// `--optimizer` (sgd, lars, adamw); absent in records of older binaries, which ran SGD.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<String>,
    /// `--lr-schedule` with its warm-up, e.g. `cosine, warm-up 2 epochs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_schedule: Option<String>,
    /// The learning rate of the last step (after `--scale-lr` and the schedule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_lr: Option<f64>,
    /// Test accuracy after each epoch (evaluated at every epoch's end), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accuracy_by_epoch: Vec<f64>,
    /// `--target-accuracy`: the accuracy asked for, and when test accuracy first reached it:
    /// the seconds of training until then (evaluation excluded) and the epoch (1-based).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_accuracy: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_to_target_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch_to_target: Option<u64>,
    /// A pipelined run's layout and figures (--pipeline-stages, --micro-batches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineRecord>,
    /// Strategy-specific figures (staleness, cache hits, ...).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
    /// What re-runs it: `config` and `argv` (absent from older records).
    #[serde(flatten)]
    pub rerun: Rerun,
    /// What the report's context block, FLOP/s and MFU need (flat in the JSON line).
    #[serde(flatten)]
    pub hardware: HardwareRecord,
}

/// A record's options: `config`, the resolved options as the table that `--config` reads
/// (write it to a .toml file and run with `--config FILE` for the same run), and `argv`, the
/// command line that made it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Rerun {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub argv: Vec<String>,
}

/// The machine and the model's arithmetic, as a report needs them to put a run in context.
/// Absent in records of older binaries: every field defaults, and the report says n/a.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HardwareRecord {
    /// Logical cores of rank 0's node, and the GPUs it sees: a point with more ranks per node
    /// than these is oversubscribed.
    #[serde(default)]
    pub cores_per_node: usize,
    #[serde(default)]
    pub gpus_per_node: usize,
    /// The device's model as its driver names it ("NVIDIA H100 80GB HBM3", a CPU's model name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_model: Option<String>,
    /// Forward FLOPs of one image, counted from the model for the run's input (model/flops.rs).
    #[serde(default)]
    pub forward_flops_per_image: f64,
    /// One CPU core's f32 matmul GFLOP/s, measured at the start of a study or a tagged point on
    /// CPUs: the peak of MFU where no datasheet applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub core_gflops: Option<f64>,
    /// Which run of its point in its study this is (`study --repeats`, the jobs' REPEATS):
    /// records of one point and study with distinct indices are repeats, not replacements.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat: Option<u32>,
}

/// A pipelined run: its layout, the cut, and per stage (index = stage) the measured figures.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PipelineRecord {
    pub pipeline_stages: usize,
    pub micro_batches: usize,
    pub schedule: String,
    pub virtual_stages: usize,
    /// `--partition`: time, params or the cut list given.
    pub partition: String,
    pub recompute: bool,
    /// Per chunk: its blocks, "0..3 (stem..layer1.2)".
    pub chunk_blocks: Vec<String>,
    /// Per chunk: parameters, and the profiled forward+backward ms per micro-batch (--partition time).
    pub chunk_params: Vec<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_profiled_ms: Option<Vec<f64>>,
    /// Per stage: forwards and backwards per measured step (ms, mean over the replicas).
    pub stage_compute_ms: Vec<f64>,
    /// Per stage, zero-bubble schedules only: the split backward's B (the inputs' gradients)
    /// and W (the weights') per measured step (ms, mean over the replicas), part of
    /// stage_compute_ms: what decides whether a split schedule pays on this model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stage_input_grad_ms: Vec<f64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stage_weight_grad_ms: Vec<f64>,
    /// Per stage: the measured idle share of the pipelined phase (mean over the replicas).
    pub bubble: Vec<f64>,
    /// Per stage: the bubble the schedule's replay gives with this run's measured forward,
    /// backward (B and W) times, messages free. Absent in records of older binaries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replay_bubble: Vec<f64>,
    /// Per stage: the host time per measured step spent on messages outside computing and
    /// outside waiting for them (making buffers, posting, testing; ms, mean over the
    /// replicas), and the replay's bubble with each message costing its stage its share of it.
    /// Absent in records of older binaries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stage_message_ms: Vec<f64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replay_bubble_with_messages: Vec<f64>,
    /// The balanced schedule's bubble (plan/pipeline/schedule.rs's theoretical_bubble): (P-1)/(M+P-1),
    /// P-1 divided by V when interleaved, (P-1)/(3M+P-1) for ZB-H1 (F = B = W).
    pub theoretical_bubble: f64,
    /// Per stage: the most micro-batches (per chunk) held between forward and backward, and
    /// the most bytes of boundary activations (inputs and outputs of chunks, and what a split
    /// backward's B keeps for its W) held at once. Records before 2026-11-29 left out what B
    /// keeps.
    pub peak_alive_micro_batches: Vec<usize>,
    pub peak_boundary_activation_bytes: Vec<usize>,
    /// Set-up's probe (src/progress.rs), slowest over the pipelines: how long a message of
    /// `stall_probe_bytes` took to reach the next stage while its sender made no MPI call for
    /// 20 ms, and whether the stages therefore ran a progress thread. Absent in records of
    /// older binaries.
    #[serde(default)]
    pub stall_probe_bytes: usize,
    #[serde(default)]
    pub stall_probe_ms: f64,
    #[serde(default)]
    pub progress_thread: bool,
    /// Per rank (index = world rank): its stage, what it read of the dataset and held, its
    /// peak memory. Absent in records of older binaries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<PipelineRank>,
}

/// One rank of a pipelined run: its place, what it read of the dataset (a pipeline's first
/// stage reads the images, its last the labels, the stages between nothing) and what it held.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PipelineRank {
    pub rank: usize,
    pub stage: usize,
    pub replica: usize,
    /// Bytes of training images read over the run's steps (from the file or the cache).
    pub train_image_bytes: u64,
    /// Training labels read over the run's steps.
    pub train_labels: u64,
    /// Bytes of test images read by the evaluations.
    pub test_image_bytes: u64,
    /// Test labels scored by the evaluations.
    pub test_labels: u64,
    /// Bytes of training images held in memory (`--cache-data`): the split, or nothing.
    pub cached_image_bytes: u64,
    /// Peak resident memory of the rank, MiB (its high-water mark at the end of the run).
    pub peak_rss_mb: f64,
}

/// Creates `dir` if needed and checks that a file can be written in it.
pub fn check_writable(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::Results(format!("results folder {}: cannot create it: {e}", dir.display())))?;
    let probe = dir.join(format!(".write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| Error::Results(format!("results folder {}: not writable: {e}", dir.display())))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Writes `path` by way of `tmp`: `write` fills `tmp`, which is then renamed over `path`, so that
/// an interrupted write never leaves a damaged `path`. On any failure (a full disk) `tmp` is
/// removed, so that nothing half-written is left behind either.
pub fn replace_via_temp(path: &Path, tmp: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).at(dir)?;
    }
    let result = write(tmp).and_then(|()| std::fs::rename(tmp, path).at(path));
    if result.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    result
}

/// Appends one JSON line to `path` so that concurrent writers never interleave or truncate each
/// other's lines: the file is locked, and the whole line goes out in one write.
pub fn append_json_line(path: &Path, value: &impl Serialize) -> Result<()> {
    let mut line = serde_json::to_string(value).map_err(|e| Error::Results(format!("serialising a result: {e}")))?;
    line.push('\n');
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path).at(path)?;
    file.lock().at(path)?;
    // A crash of an earlier writer can leave a last line without its newline; start on a fresh
    // line so that the new record stays readable.
    let len = file.metadata().at(path)?.len();
    if len > 0 && !ends_with_newline(path, len)? {
        line.insert(0, '\n');
    }
    file.write_all(line.as_bytes()).at(path)?;
    file.sync_data().at(path)?;
    file.unlock().at(path)?;
    Ok(())
}

fn ends_with_newline(path: &Path, len: u64) -> Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).at(path)?;
    f.seek(SeekFrom::Start(len - 1)).at(path)?;
    let mut last = [0u8; 1];
    f.read_exact(&mut last).at(path)?;
    Ok(last[0] == b'\n')
}

/// Reads the records of a JSON-lines file. A line cut short (a write interrupted by a crash:
/// the JSON ends early) is skipped with a warning; any other bad line is an error.
pub fn read_json_lines<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Vec<T>> {
    Ok(read_numbered_json_lines(path)?.into_iter().map(|(_, v)| v).collect())
}

/// As [`read_json_lines`], each record with its line number (from 1), for messages.
pub fn read_numbered_json_lines<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Vec<(usize, T)>> {
    let text = std::fs::read_to_string(path).at(path)?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        match serde_json::from_str(line) {
            Ok(v) => out.push((n + 1, v)),
            Err(e) if e.is_eof() => {
                log::warn!("{}:{}: skipping a truncated line (a write cut short by a crash)", path.display(), n + 1);
            }
            Err(e) => return Err(Error::Results(format!("{}:{}: not a valid record: {e}", path.display(), n + 1))),
        }
    }
    Ok(out)
}

pub fn runs_path(results: &Path) -> PathBuf {
    results.join(RUNS_FILE)
}

pub fn timestamp() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Row {
        a: u32,
    }

    #[test]
    fn appends_lines_and_skips_a_truncated_tail() {
        let dir = std::env::temp_dir().join(format!("hpc-train-results-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.jsonl");
        let _ = std::fs::remove_file(&path);
        append_json_line(&path, &Row { a: 1 }).unwrap();
        // A crash mid-write leaves a partial line without its newline.
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"{\"a\":").unwrap();
        assert_eq!(read_json_lines::<Row>(&path).unwrap(), vec![Row { a: 1 }]);
        // The next append starts a fresh line, and the cut line is still skipped.
        append_json_line(&path, &Row { a: 2 }).unwrap();
        assert_eq!(read_json_lines::<Row>(&path).unwrap(), vec![Row { a: 1 }, Row { a: 2 }]);
        // A line that is not cut short but wrong is an error naming the line.
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"{\"a\": \"x\"}\n").unwrap();
        let err = read_json_lines::<Row>(&path).unwrap_err().to_string();
        assert!(err.contains(":4:"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn concurrent_appends_never_interleave() {
        let dir = std::env::temp_dir().join(format!("hpc-train-results-c-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.jsonl");
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let path = path.clone();
                std::thread::spawn(move || {
                    for i in 0..50 {
                        append_json_line(&path, &Row { a: t * 1000 + i }).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(read_json_lines::<Row>(&path).unwrap().len(), 200);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[cfg(test)]
mod writable_tests {
    use super::check_writable;

    /// A results folder that cannot be made (its parent is a file) is refused before training,
    /// naming it.
    #[test]
    fn a_results_folder_that_cannot_be_created_is_refused() {
        let dir = std::env::temp_dir().join(format!("hpc-train-results-writable-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let blocker = dir.join("file");
        std::fs::write(&blocker, b"").unwrap();
        let err = check_writable(&blocker.join("results")).unwrap_err().to_string();
        let fine = check_writable(&dir.join("results"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(err.contains(&format!("results folder {}: cannot create it", blocker.join("results").display())), "{err}");
        assert!(fine.is_ok(), "{fine:?}");
    }
}
