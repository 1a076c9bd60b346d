//! Training under mpirun: data-parallel SGD equals one process on the global batch, sharding
//! covers every sample once, a real run learns, memory stays flat.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;

/// Trains `tiny` with `strategy` on `ranks` ranks for `steps` steps of `global` samples and
/// returns the saved weights' path.
fn train_weights(dir: &Path, data: &Path, strategy: &str, ranks: usize, global: usize, steps: u32, extra: &[&str]) -> std::path::PathBuf {
    let name = format!("{strategy}-{ranks}-{}", extra.join("_").replace(['-', '/'], ""));
    let (global, steps) = (global.to_string(), steps.to_string());
    let mut args = vec![
        "--strategy", strategy, "--model", "tiny", "--scaling", "strong",
        "--data", data.to_str().unwrap(), "--threads", "1", "--no-eval", "--warmup-steps", "0",
        "--lr", "0.05", "--momentum", "0.9", "--weight-decay", "0.001",
        "--global-batch", &global, "--steps", &steps,
    ];
    args.extend(extra);
    train_saving_weights(dir, &name, ranks, &args)
}

#[test]
fn data_parallel_sgd_equals_one_process_on_the_global_batch() {
    let dir = scratch("equivalence");
    // 100 samples, global batch 12: the 9th step of the epoch holds the 4 left over, split
    // unevenly over the ranks, so uneven shards are part of the check.
    let data = synth(&dir, "eq", 100, 0, "1x12x12", 5);
    let reference = train_weights(&dir, &data, "allreduce", 1, 12, 10, &[]);
    for ranks in [2, 3, 4] {
        let w = train_weights(&dir, &data, "allreduce", ranks, 12, 10, &[]);
        let diff = max_relative_difference(&reference, &w);
        assert!(diff < 1e-5, "{ranks} ranks: relative difference {diff:e}");
    }
}

#[test]
fn bucket_size_does_not_change_the_result() {
    let dir = scratch("buckets");
    let data = synth(&dir, "b", 60, 0, "1x12x12", 5);
    let fused = train_weights(&dir, &data, "allreduce", 2, 8, 4, &["--bucket-mb", "25"]);
    let per_tensor = train_weights(&dir, &data, "allreduce", 2, 8, 4, &["--bucket-mb", "0"]);
    let tiny_buckets = train_weights(&dir, &data, "allreduce", 2, 8, 4, &["--bucket-mb", "0.001"]);
    assert!(max_relative_difference(&fused, &per_tensor) < 1e-6);
    assert!(max_relative_difference(&fused, &tiny_buckets) < 1e-6);
}

#[test]
fn every_training_sample_is_seen_once_per_epoch() {
    let dir = scratch("sharding");
    // 53 samples over 3 ranks with batch 4: 5 steps, the last one holding 5 samples.
    let data = synth(&dir, "s", 53, 0, "1x8x8", 3);
    let trace = dir.join("trace");
    mpirun(3, &[
        "--strategy", "allreduce", "--model", "tiny", "--data", data.to_str().unwrap(),
        "--batch-size", "4", "--epochs", "2", "--no-eval", "--threads", "1",
        "--results", dir.join("results").to_str().unwrap(), "--trace-samples", trace.to_str().unwrap(),
    ])
    .expect_ok();
    let mut seen: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for rank in 0..3 {
        let text = std::fs::read_to_string(trace.join(format!("rank{rank}.txt"))).unwrap();
        for line in text.lines() {
            let mut parts = line.split(' ');
            let epoch: u64 = parts.next().unwrap().parse().unwrap();
            let _step = parts.next().unwrap();
            let list = parts.next().unwrap_or("");
            seen.entry(epoch).or_default().extend(list.split(',').filter(|s| !s.is_empty()).map(|s| s.parse::<usize>().unwrap()));
        }
    }
    assert_eq!(seen.len(), 2, "two epochs");
    for (epoch, mut ids) in seen {
        ids.sort();
        assert_eq!(ids, (0..53).collect::<Vec<_>>(), "epoch {epoch}");
    }
}

#[test]
fn a_real_run_learns_fashion_mnist() {
    let dir = scratch("learns");
    let data = fashion_mnist();
    mpirun(2, &[
        "--strategy", "allreduce", "--model", "tiny", "--data", data.to_str().unwrap(),
        "--batch-size", "32", "--epochs", "1", "--lr", "0.1", "--threads", "1",
        "--results", dir.to_str().unwrap(),
    ])
    .expect_ok();
    let runs = read_runs(&dir);
    let run = &runs[0];
    let accuracy = run["test_accuracy"].as_f64().unwrap();
    // Chance is 10%; one epoch of the tiny CNN reaches about 75%.
    assert!(accuracy > 0.65, "test accuracy {accuracy}");
    for field in [
        "strategy", "ranks", "model", "dataset", "batch_per_rank", "global_batch", "scaling", "steps", "epochs",
        "images_per_sec", "step_ms", "compute_ms", "comm_ms", "final_loss", "test_accuracy", "device",
        "mpi_library", "cuda_aware", "host", "git_commit", "timestamp", "peak_rss_mb",
    ] {
        assert!(!run[field].is_null(), "runs.jsonl lacks {field}: {run}");
    }
    assert_eq!(run["ranks"], 2);
    assert_eq!(run["global_batch"], 64);
    assert_eq!(run["dataset"], "fashion-mnist");
    assert!(run["images_per_sec"].as_f64().unwrap() > 0.0);
}

#[test]
fn memory_stays_flat_over_a_long_run() {
    let dir = scratch("memory");
    let data = synth(&dir, "m", 4000, 0, "1x16x16", 4);
    mpirun(2, &[
        "--strategy", "allreduce", "--model", "tiny", "--data", data.to_str().unwrap(),
        "--batch-size", "8", "--steps", "1500", "--warmup-steps", "100", "--no-eval", "--threads", "1",
        "--bucket-mb", "0.001", "--results", dir.to_str().unwrap(),
    ])
    .expect_ok();
    let run = &read_runs(&dir)[0];
    let (warm, end) = (run["rss_warmup_mb"].as_f64().unwrap(), run["rss_end_mb"].as_f64().unwrap());
    assert!(warm > 0.0);
    // 1400 steps after warm-up: any per-step leak of even a few KiB would show.
    assert!(end - warm < 8.0, "resident memory grew from {warm:.1} MiB to {end:.1} MiB");
    // The peak is a peak: never below a resident figure of the same run (issue 31, item 9).
    let peak = run["peak_rss_mb"].as_f64().unwrap();
    assert!(peak >= warm && peak >= end, "peak_rss_mb {peak:.1} below warm-up {warm:.1} or end {end:.1}");
}

/// Issue 31, item 23: final_loss is the last step's loss over every worker, whatever
/// --log-every is (it was the mean since the last progress line).
#[test]
fn the_final_loss_does_not_depend_on_the_log_interval() {
    let dir = scratch("final-loss");
    let data = synth(&dir, "fl", 120, 0, "1x8x8", 3);
    let final_loss = |log_every: &str| {
        let results = dir.join(format!("log-{log_every}"));
        mpirun(2, &[
            "--strategy", "ring", "--model", "tiny", "--data", data.to_str().unwrap(), "--batch-size", "6",
            "--steps", "7", "--no-eval", "--threads", "1", "--log-every", log_every, "--results", results.to_str().unwrap(),
        ])
        .expect_ok();
        read_runs(&results)[0]["final_loss"].as_f64().unwrap()
    };
    let (every_step, rarely) = (final_loss("1"), final_loss("5"));
    assert!(every_step.is_finite() && every_step > 0.0, "{every_step}");
    assert_eq!(every_step, rarely, "final_loss with --log-every 1 and 5");
}

/// `--profile-dir`: each rank writes a Chrome trace of the profiled steps only, marked as
/// torch.profiler marks its steps, with the host ops of forward and backward in them (the
/// autograd engine's too), which scripts/trace_summary.py reads and sums per step.
#[test]
fn profile_dir_traces_the_profiled_steps_of_every_rank() {
    let dir = scratch("profile");
    let data = synth(&dir, "p", 64, 0, "1x12x12", 5);
    let profiles = dir.join("profiles");
    mpirun(2, &[
        "--model", "tiny", "--data", data.to_str().unwrap(), "--batch-size", "4", "--steps", "7", "--warmup-steps", "2",
        "--profile-dir", profiles.to_str().unwrap(), "--profile-steps", "3", "--no-eval", "--threads", "1",
        "--results", dir.join("results").to_str().unwrap(),
    ])
    .expect_ok();
    for rank in 0..2 {
        let path = profiles.join(format!("rank-{rank}.json"));
        let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        let mut steps: Vec<&str> = events.iter().filter(|e| e["cat"] == "user_annotation").filter_map(|e| e["name"].as_str()).filter(|n| n.starts_with("ProfilerStep#")).collect();
        steps.sort();
        assert_eq!(steps, ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"], "rank {rank}: the measured steps 2-4 only");
        for op in ["aten::conv2d", "autograd::engine::evaluate_function: ConvolutionBackward0"] {
            assert!(events.iter().any(|e| e["name"] == op), "rank {rank}: {op} in the trace");
        }
        let summary = std::process::Command::new("python3").arg(root().join("scripts/trace_summary.py")).arg(format!("hpc={}", path.display())).output().unwrap();
        let text = String::from_utf8_lossy(&summary.stdout);
        assert!(summary.status.success(), "{}", String::from_utf8_lossy(&summary.stderr));
        assert!(text.contains("| hpc | 2, 3, 4 |") && text.contains("ConvolutionBackward0"), "{text}");
    }
}

/// A study profiles each of its points into a folder of its own (strategy and ranks).
#[test]
fn a_study_profiles_each_point_apart() {
    let dir = scratch("profile-study");
    let data = synth(&dir, "ps", 64, 0, "1x12x12", 5);
    let profiles = dir.join("profiles");
    mpirun(2, &[
        "study", "--ranks", "1,2", "--strategies", "ring,allreduce", "--model", "tiny", "--data", data.to_str().unwrap(),
        "--batch-size", "4", "--steps", "4", "--warmup-steps", "1", "--profile-dir", profiles.to_str().unwrap(), "--profile-steps", "2",
        "--no-eval", "--threads", "1", "--results", dir.join("results").to_str().unwrap(),
    ])
    .expect_ok();
    for point in ["ring-1ranks", "ring-2ranks", "allreduce-1ranks", "allreduce-2ranks"] {
        let ranks: usize = point.split('-').nth(1).unwrap().trim_end_matches("ranks").parse().unwrap();
        for rank in 0..ranks {
            let path = profiles.join(point).join(format!("rank-{rank}.json"));
            assert!(path.is_file(), "{} missing", path.display());
        }
        assert!(!profiles.join(point).join(format!("rank-{ranks}.json")).exists());
    }
}

/// scripts/trace_summary.py on a GPU trace (made up here: CI has no GPU): per step, the union of
/// kernels and copies in the step's window (from its start to the next step's) is the GPU's
/// busy time, the rest of the window its idle time.
#[test]
fn trace_summary_splits_gpu_time_into_busy_and_idle_per_step() {
    let dir = scratch("trace-summary");
    let x = |cat: &str, name: &str, ts: f64, dur: f64| serde_json::json!({ "ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1 });
    let trace = serde_json::json!({ "traceEvents": [
        x("user_annotation", "ProfilerStep#5", 0.0, 10_000.0),
        x("kernel", "k1", 1_000.0, 2_000.0),
        x("kernel", "k2", 2_000.0, 3_000.0),
        x("gpu_memcpy", "Memcpy HtoD", 6_000.0, 1_000.0),
        x("user_annotation", "ProfilerStep#6", 10_000.0, 10_000.0),
        x("kernel", "k1", 11_000.0, 8_000.0),
    ]});
    let path = dir.join("gpu.json");
    std::fs::write(&path, trace.to_string()).unwrap();
    let out = std::process::Command::new("python3").arg(root().join("scripts/trace_summary.py")).arg(format!("gpu={}", path.display())).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Step 5: busy 1-5 ms and 6-7 ms (5 ms), idle 5; step 6: busy 8, idle 2.
    assert!(text.contains("| gpu | 5, 6 | 10.00 | 6.50 | 3.50 | 1.50 | 6.50 | 0.50 |"), "{text}");
    assert!(text.contains("| `k1` | 5.000 |") && text.contains("| `k2` | 1.500 |"), "{text}");
}
