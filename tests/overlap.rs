//! Overlap of the exchange with backward: the same weights as without it, for every strategy
//! that overlaps, and a step completes when some parameters get no gradient; `--overlap auto`
//! on CPU ranks measures both modes over the first steps and keeps the faster, with the same
//! weights whichever it keeps.

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

/// `--overlap auto` on CPU ranks, its trial made to choose each way (the test hook adds time to
/// one mode's steps), plain and under ZeRO 2 (whose shard plan must survive the switches): the
/// weights of `--overlap off`, the record says what was chosen and the figures behind it, and a
/// run too short for the trial is off and says why.
#[test]
fn auto_keeps_the_mode_its_trial_measured_faster() {
    if covered_by_the_first_mpi("the trial's switching between modes") {
        return;
    }
    let dir = scratch("overlap-auto");
    let data = synth(&dir, "auto", 96, 0, "1x12x12", 5);
    let many_buckets = ["--model", "tiny", "--strategy", "ring", "--bucket-mb", "0.001"];
    let train_env = |name: &str, steps: &str, extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["--data", data.to_str().unwrap(), "--scaling", "strong", "--global-batch", "12", "--steps", steps, "--no-eval", "--threads", "1"];
        args.extend(many_buckets);
        args.extend(extra);
        train_saving_weights_env(&dir, name, 2, &args, env).0
    };
    let off = train_env("off", "15", &["--overlap", "off"], &[]);
    let penalty = "HPC_TRAIN_TEST_OVERLAP_PENALTY";
    for (name, extra, slower, kept) in [
        ("auto-on", &[][..], "without:10000", true),
        ("auto-off", &[][..], "with:10000", false),
        ("auto-zero2-off", &["--zero", "2"][..], "with:10000", false),
        ("auto-zero2-on", &["--zero", "2"][..], "without:10000", true),
    ] {
        let weights = train_env(name, "15", extra, &[(penalty, slower)]);
        let diff = max_relative_difference(&off, &weights);
        assert!(diff < 1e-5, "{name}: {diff:e} from --overlap off");
        let runs = read_runs(&dir);
        let record = runs.last().unwrap();
        assert_eq!(record["extra"]["overlap"], kept, "{name}: {}", record["extra"]);
        let reason = record["extra"]["overlap_reason"].as_str().unwrap();
        assert!(reason.contains("a CPU rank: measured over steps 1..12") && reason.contains("ms a step with overlap"), "{name}: {reason}");
        let (with, without) = (record["extra"]["overlap_trial_with_ms"].as_f64().unwrap(), record["extra"]["overlap_trial_without_ms"].as_f64().unwrap());
        assert_eq!(with < without, kept, "{name}: {with} against {without}");
    }
    let short = train_env("auto-short", "13", &[], &[]);
    assert!(short.exists());
    let runs = read_runs(&dir);
    let record = runs.last().unwrap();
    assert_eq!(record["extra"]["overlap"], false);
    assert!(record["extra"]["overlap_reason"].as_str().unwrap().contains("too few steps"), "{}", record["extra"]);
}
