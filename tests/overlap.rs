//! Overlap of the exchange with backward: the same weights as without it, for every strategy
//! that overlaps, and a step completes when some parameters get no gradient.

mod common;

use std::path::{Path, PathBuf};

use common::*;

fn train(dir: &Path, data: &Path, name: &str, ranks: usize, extra: &[&str]) -> PathBuf {
    let mut args = vec![
        "--data", data.to_str().unwrap(), "--scaling", "strong", "--global-batch", "12", "--steps", "8",
        "--no-eval", "--threads", "1",
    ];
    args.extend(extra);
    train_saving_weights(dir, name, ranks, &args)
}

#[test]
fn overlap_gives_the_weights_of_no_overlap_for_every_strategy() {
    let dir = scratch("overlap");
    let data = synth(&dir, "ov", 96, 0, "1x12x12", 5);
    let reference = train(&dir, &data, "allreduce-off", 3, &["--model", "tiny", "--strategy", "allreduce", "--overlap", "off"]);
    for strategy in ["allreduce", "ring", "horovod"] {
        // Tiny buckets: several per step, exchanged while backward runs.
        for bucket in ["0.001", "25"] {
            let on = train(&dir, &data, &format!("{strategy}-on-{bucket}"), 3, &["--model", "tiny", "--strategy", strategy, "--overlap", "on", "--bucket-mb", bucket]);
            let diff = max_relative_difference(&reference, &on);
            assert!(diff < 1e-5, "{strategy} with overlap (buckets {bucket} MiB) differs by {diff:e}");
        }
    }
    let runs = read_runs(&dir);
    let overlapped: Vec<_> = runs.iter().filter(|r| r["extra"]["overlap"] == true).collect();
    // The tiny CNN's gradients fit one 25 MiB bucket: nothing to overlap, backward runs on
    // the MPI thread (same weights, checked above).
    assert_eq!(overlapped.len(), 3, "only the runs with several buckets overlap");
    assert!(overlapped.iter().all(|r| r["extra"]["exchange_hidden_share"].as_f64().is_some()));
    assert!(overlapped.iter().any(|r| r["extra"]["overlap_buckets"].as_u64().unwrap() > 1));
}

#[test]
fn parameters_without_gradients_count_as_ready() {
    let dir = scratch("overlap-unused");
    let data = synth(&dir, "unused", 96, 0, "1x12x12", 5);
    let off = train(&dir, &data, "off", 2, &["--model", "tiny-unused", "--strategy", "ring", "--overlap", "off", "--bucket-mb", "0.001"]);
    let on = train(&dir, &data, "on", 2, &["--model", "tiny-unused", "--strategy", "ring", "--overlap", "on", "--bucket-mb", "0.001"]);
    assert!(max_relative_difference(&off, &on) < 1e-5);
    // Both runs finished (no wait for gradients that never come) and wrote their records.
    assert_eq!(read_runs(&dir).len(), 2);
}
