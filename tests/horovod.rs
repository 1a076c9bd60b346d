//! The Horovod-style strategy: sums equal MPI_Allreduce's, fusion and hierarchy do not change
//! results, compression stays within its format's rounding, order of enqueueing does not
//! matter, the timeline is valid, stalls are reported.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

fn bench(ranks: usize, extra: &[&str], env: &[(&str, &str)], dir: &Path) -> Run {
    let mut args = vec!["bench", "--strategies", "horovod", "--iters", "2", "--warmup", "1", "--results", dir.to_str().unwrap()];
    args.extend(extra);
    mpirun_env(ranks, &args, env, Duration::from_secs(180))
}

fn rows_all_right(run: &Run, rows: usize) {
    assert!(run.ok(), "{}", run.all_output());
    let lines: Vec<&str> = run.stdout.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(lines.len(), rows, "{}", run.stdout);
    assert!(lines.iter().all(|l| l.ends_with(" 0")), "{}", run.stdout);
}

fn train(dir: &Path, data: &Path, name: &str, ranks: usize, extra: &[&str], env: &[(&str, &str)]) -> PathBuf {
    let out = dir.join(format!("{name}.safetensors"));
    let mut args = vec![
        "--model", "tiny", "--data", data.to_str().unwrap(), "--scaling", "strong", "--global-batch", "12",
        "--steps", "6", "--no-eval", "--threads", "1", "--results", dir.to_str().unwrap(), "--save-weights", out.to_str().unwrap(),
    ];
    args.extend(extra);
    mpirun_env(ranks, &args, env, Duration::from_secs(180)).expect_ok();
    out
}

#[test]
fn sums_equal_mpi_allreduce_per_tensor() {
    let dir = scratch("hvd-sum");
    for ranks in [1, 2, 3] {
        rows_all_right(&bench(ranks, &["--counts", "0,1,3,1001,262147", "--verify", "allreduce"], &[], &dir), 5);
        rows_all_right(&bench(ranks, &["--counts", "1001,300000", "--layout", "resnet50", "--verify", "allreduce"], &[], &dir), 2);
        rows_all_right(&bench(ranks, &["--counts", "1001,300000", "--layout", "resnet50", "--fusion-threshold-mb", "0"], &[], &dir), 2);
    }
}

#[test]
fn compression_stays_within_the_format() {
    let dir = scratch("hvd-compress");
    for c in ["fp16", "bf16"] {
        // Random data: within the 16-bit format's rounding of MPI_Allreduce's f32 sum.
        rows_all_right(&bench(3, &["--counts", "1001,262147", "--compression", c, "--verify", "allreduce"], &[], &dir), 2);
        // Small integers are exact in 16 bits: the closed form holds exactly.
        rows_all_right(&bench(3, &["--counts", "1001,262147", "--layout", "resnet50", "--compression", c], &[], &dir), 2);
    }
}

#[test]
fn enqueue_order_does_not_matter() {
    let dir = scratch("hvd-order");
    rows_all_right(&bench(3, &["--counts", "300000", "--layout", "resnet50", "--horovod-shuffle-enqueue", "--verify", "allreduce"], &[], &dir), 1);
    let data = synth(&dir, "order", 60, 0, "1x12x12", 5);
    let reference = train(&dir, &data, "allreduce", 3, &["--strategy", "allreduce"], &[]);
    let shuffled = train(&dir, &data, "shuffled", 3, &["--strategy", "horovod", "--horovod-shuffle-enqueue"], &[]);
    let diff = max_relative_difference(&reference, &shuffled);
    assert!(diff < 1e-5, "shuffled enqueue differs from allreduce by {diff:e}");
}

#[test]
fn fusion_and_hierarchy_do_not_change_the_weights() {
    let dir = scratch("hvd-fusion");
    let data = synth(&dir, "fusion", 60, 0, "1x12x12", 5);
    let fused = train(&dir, &data, "fused", 4, &["--strategy", "horovod"], &[]);
    let unfused = train(&dir, &data, "unfused", 4, &["--strategy", "horovod", "--fusion-threshold-mb", "0"], &[]);
    let fake_nodes = [("HPC_TRAIN_RANKS_PER_NODE", "2")];
    let flat = train(&dir, &data, "flat", 4, &["--strategy", "horovod"], &fake_nodes);
    let hierarchical = train(&dir, &data, "hier", 4, &["--strategy", "horovod", "--hierarchical"], &fake_nodes);
    assert!(max_relative_difference(&fused, &unfused) < 1e-5);
    assert!(max_relative_difference(&flat, &hierarchical) < 1e-5);
    let reference = train(&dir, &data, "allreduce", 4, &["--strategy", "allreduce"], &[]);
    assert!(max_relative_difference(&reference, &fused) < 1e-5);
    // Hierarchical sums equal MPI_Allreduce's on 3 fake nodes of 2, 2 and 1 ranks.
    rows_all_right(&bench(5, &["--counts", "1,1001,262147", "--hierarchical", "--verify", "allreduce"], &fake_nodes, &dir), 3);
    rows_all_right(&bench(5, &["--counts", "1001", "--hierarchical", "--compression", "bf16"], &fake_nodes, &dir), 1);
}

#[test]
fn horovod_variables_are_aliases_and_flags_win() {
    let dir = scratch("hvd-env");
    let data = synth(&dir, "env", 40, 0, "1x8x8", 3);
    let env = [("HOROVOD_FUSION_THRESHOLD", "0"), ("HOROVOD_CYCLE_TIME", "2.5")];
    train(&dir, &data, "env", 2, &["--strategy", "horovod"], &env);
    train(&dir, &data, "flag", 2, &["--strategy", "horovod", "--fusion-threshold-mb", "64"], &env);
    let runs = read_runs(&dir);
    assert_eq!(runs[0]["extra"]["fusion_threshold_mb"], 0.0);
    assert_eq!(runs[0]["extra"]["cycle_time_ms"], 2.5);
    assert_eq!(runs[1]["extra"]["fusion_threshold_mb"], 64.0);
    // Steady state: after the first step, tensors come from the response cache.
    assert!(runs[0]["extra"]["horovod_cache_hits"].as_u64().unwrap() > 0);
    let bad = mpirun_env(2, &["--strategy", "horovod", "--model", "tiny", "--data", data.to_str().unwrap(), "--steps", "1", "--batch-size", "2", "--results", dir.to_str().unwrap()],
        &[("HOROVOD_CYCLE_TIME", "soon")], Duration::from_secs(60));
    assert!(!bad.ok());
    assert_eq!(bad.all_output().matches("HOROVOD_CYCLE_TIME=\"soon\" is not a valid value").count(), 1, "{}", bad.all_output());
}

#[test]
fn the_timeline_holds_every_ranks_events() {
    let dir = scratch("hvd-timeline");
    let data = synth(&dir, "tl", 40, 0, "1x8x8", 3);
    let timeline = dir.join("timeline.json");
    train(&dir, &data, "tl", 3, &["--strategy", "horovod", "--timeline", timeline.to_str().unwrap()], &[]);
    let value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&timeline).unwrap()).expect("valid JSON");
    let events = value["traceEvents"].as_array().unwrap();
    for rank in 0..3 {
        for name in ["NEGOTIATE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"] {
            assert!(events.iter().any(|e| e["pid"] == rank && e["name"] == name), "no {name} event from rank {rank}");
        }
    }
    assert!(events.iter().filter(|e| e["ph"] == "X").all(|e| e["dur"].as_f64().unwrap() >= 0.0 && e["ts"].as_f64().is_some()));
}

#[test]
fn one_tensor_is_reduced_in_place_and_many_through_the_fusion_buffer() {
    // Horovod's MPIAllreduce::Execute copies into the fusion buffer only when a response holds
    // more than one tensor; with compression the cast needs the buffer even for one.
    let dir = scratch("hvd-in-place");
    let names = |extra: &[&str]| -> Vec<String> {
        let timeline = dir.join("timeline.json");
        let mut args = vec!["--counts", "262147", "--verify", "allreduce", "--timeline", timeline.to_str().unwrap()];
        args.extend(extra);
        rows_all_right(&bench(2, &args, &[], &dir), 1);
        let value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&timeline).unwrap()).expect("valid JSON");
        value["traceEvents"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str().map(String::from)).collect()
    };
    let alone = names(&[]);
    assert!(alone.iter().any(|n| n == "ALLREDUCE"), "{alone:?}");
    assert!(!alone.iter().any(|n| n.starts_with("MEMCPY")), "one tensor was copied: {alone:?}");
    let fused = names(&["--layout", "resnet50"]);
    assert!(fused.iter().any(|n| n == "MEMCPY_IN_FUSION_BUFFER") && fused.iter().any(|n| n == "MEMCPY_OUT_FUSION_BUFFER"), "{fused:?}");
    let cast = names(&["--compression", "fp16"]);
    assert!(cast.iter().any(|n| n == "MEMCPY_IN_FUSION_BUFFER"), "{cast:?}");
}

#[test]
fn a_stall_is_reported_with_the_missing_rank() {
    let dir = scratch("hvd-stall");
    let args = [
        "bench", "--strategies", "horovod", "--counts", "1000", "--layout", "resnet50", "--warmup", "0", "--iters", "1",
        "--stall-warning-s", "1", "--horovod-test-delay", "2:3.5", "--results", dir.to_str().unwrap(),
    ];
    let run = mpirun_env(3, &args, &[], Duration::from_secs(60));
    assert!(run.ok(), "{}", run.all_output());
    assert!(run.stderr.contains("horovod: stall:") && run.stderr.contains("missing on ranks [2]"), "{}", run.stderr);
}

/// With overlap (the default) every bucket keeps its id from step to step, so after the first
/// steps every tensor is reduced straight from the response cache, without negotiation.
#[test]
fn overlapped_buckets_hit_the_response_cache() {
    let dir = scratch("hvd-cache");
    let data = synth(&dir, "cache", 240, 0, "1x12x12", 5);
    let out = dir.join("cache.safetensors");
    let args = [
        "--model", "tiny", "--data", data.to_str().unwrap(), "--scaling", "strong", "--global-batch", "12",
        "--steps", "20", "--no-eval", "--threads", "1", "--results", dir.to_str().unwrap(), "--save-weights", out.to_str().unwrap(),
        "--strategy", "horovod", "--overlap", "on", "--bucket-mb", "0.001",
    ];
    mpirun_env(2, &args, &[], Duration::from_secs(180)).expect_ok();
    let run = read_runs(&dir).pop().unwrap();
    let extra = &run["extra"];
    assert!(extra["overlap_buckets"].as_u64().unwrap() > 1, "{extra}");
    let share = extra["horovod_cache_hit_share"].as_f64().unwrap();
    assert!(share >= 0.9, "cache hits {share} of tensors: {extra}");
    assert_eq!(extra["horovod_tensors"].as_u64().unwrap(), 20 * extra["overlap_buckets"].as_u64().unwrap(), "{extra}");
}
