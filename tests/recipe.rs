//! The large-batch recipe (issue 35) across strategies: LARS and AdamW with a warm-up and a
//! decay end with the weights MPI_Allreduce gives, whatever the strategy, ZeRO stage or
//! parameter server; a checkpoint carries the optimizer's state and the schedule across a crash
//! and a resume with another rank count; runs.jsonl says what ran and when the target accuracy
//! was reached.

mod common;

use std::path::{Path, PathBuf};

use common::*;

/// Tiny model on 3 classes: its tensors have 144, 16, 4608, 32, 96 and 3 elements; the
/// biases (16, 32, 3) are LARS's exempt tensors.
fn dataset(dir: &Path) -> PathBuf {
    synth(dir, "recipe", 300, 60, "1x12x12", 3)
}

/// 12 steps of 60 (strong scaling), a 3-step warm-up then a cosine decay, label smoothing;
/// buckets of about 512 elements (several tensors to a bucket, shards cut through them) unless
/// `extra` sets --bucket-mb.
fn args<'a>(data: &'a str, optimizer: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "--model", "tiny", "--data", data, "--scaling", "strong", "--global-batch", "60", "--steps", "12", "--no-eval", "--threads", "1",
        "--log-every", "1000", "--optimizer", optimizer, "--lr-schedule", "cosine", "--end-lr", "0.001", "--warmup-epochs", "0.6",
        "--label-smoothing", "0.1",
    ];
    match optimizer {
        // A trust coefficient and rate large enough that the adapted layers really move.
        "lars" => a.extend(["--lars-eta", "0.02", "--lr", "2"]),
        _ => a.extend(["--lr", "0.05"]),
    }
    if !extra.contains(&"--bucket-mb") {
        a.extend(["--bucket-mb", "0.002"]);
    }
    a.extend(extra);
    a
}

/// Every strategy, ZeRO stage and parameter-server layout, with AdamW and with LARS, ends
/// with the weights of MPI_Allreduce, at 2 and 3 ranks (3 ranks: shards cut through tensors
/// and LARS's layers, whose norms are then summed over the ranks).
#[test]
fn every_strategy_trains_to_the_weights_of_allreduce_with_adamw_and_lars() {
    let dir = scratch("recipe-equal");
    let data = dataset(&dir);
    let d = data.to_str().unwrap();
    let (mut runs, mut compared): (Runs, Vec<(String, PathBuf, PathBuf)>) = (Runs::new(&dir), Vec::new());
    for optimizer in ["adamw", "lars"] {
        // MPICH's run trains at 2 workers; Open MPI's at 3 as well (common::launcher::every_row).
        for workers in common::launcher::rows_under_mpich(&[2usize, 3], |w| w == 2) {
            let reference = runs.add(&format!("{optimizer}-allreduce-{workers}"), workers, &args(d, optimizer, &["--strategy", "allreduce", "--overlap", "off"]));
            let mut cases: Vec<(String, usize, Vec<&str>)> = vec![
                ("ring".into(), workers, vec!["--strategy", "ring", "--overlap", "off"]),
                ("ring-overlap".into(), workers, vec!["--strategy", "ring", "--overlap", "on"]),
                ("auto".into(), workers, vec!["--strategy", "auto"]),
                ("horovod".into(), workers, vec!["--strategy", "horovod"]),
                ("ring-z1".into(), workers, vec!["--strategy", "ring", "--zero", "1", "--overlap", "off"]),
                ("ring-z2-overlap".into(), workers, vec!["--strategy", "ring", "--zero", "2", "--overlap", "on"]),
                ("ps-dedicated".into(), workers + 1, vec!["--strategy", "ps", "--servers", "1"]),
                ("ps-colocated".into(), workers, vec!["--strategy", "ps", "--ps-colocate"]),
            ];
            if workers == 2 {
                cases.push(("rhd-z2".into(), workers, vec!["--strategy", "rhd", "--zero", "2", "--overlap", "on"]));
            } else {
                cases.push(("auto-z1-per-tensor".into(), workers, vec!["--strategy", "auto", "--zero", "1", "--bucket-mb", "0"]));
            }
            for (name, ranks, extra) in cases {
                let name = format!("{optimizer}-{name}-{workers}");
                compared.push((name.clone(), reference.clone(), runs.add(&name, ranks, &args(d, optimizer, &extra))));
            }
        }
    }
    // Every run in one launch (common::Runs), then the comparisons.
    runs.launch();
    for (name, reference, weights) in compared {
        let diff = max_relative_difference(&reference, &weights);
        assert!(diff < 1e-5, "{name} differs from MPI_Allreduce by {diff:e}");
    }
    // The optimizers did move the weights apart: AdamW and LARS end in different places.
    let diff = max_relative_difference(&dir.join("adamw-allreduce-2.safetensors"), &dir.join("lars-allreduce-2.safetensors"));
    assert!(diff > 1e-3, "AdamW and LARS gave the same weights ({diff:e})");
}

/// A run that crashes after its checkpoint at step 6 resumes on another rank count (and
/// strategy, and ZeRO stage) and ends with the weights of an uninterrupted run: the checkpoint
/// holds Adam's moments or LARS's momentum and the step count (AdamW's bias correction), and
/// the schedule follows the global step.
#[test]
fn a_crash_resumes_the_optimizer_and_schedule_on_another_rank_count() {
    let dir = scratch("recipe-resume");
    let data = dataset(&dir);
    let d = data.to_str().unwrap();
    for optimizer in ["adamw", "lars"] {
        let reference = train_saving_weights(&dir, &format!("{optimizer}-uninterrupted"), 3, &args(d, optimizer, &["--strategy", "allreduce"]));
        let ckpt = dir.join(format!("{optimizer}-ckpt"));
        let c = ckpt.to_str().unwrap();
        let mut first = args(d, optimizer, &["--strategy", "ring", "--zero", "2", "--overlap", "on", "--checkpoint-dir", c, "--checkpoint-every", "6"]);
        first.extend(["--results", dir.to_str().unwrap()]);
        let crashed = mpirun_env(3, &first, &[("HPC_TRAIN_FAULT", "exit@1:8")], std::time::Duration::from_secs(300));
        assert!(!crashed.ok(), "the injected crash ended the run with exit 0:\n{}", crashed.all_output());
        assert_eq!(checkpoint_steps(&ckpt), vec![6]);
        let copy = dir.join(format!("{optimizer}-ckpt-copy"));
        copy_dir(&ckpt, &copy);
        let cases = [(2, vec!["--strategy", "ring", "--zero", "1", "--checkpoint-dir", c, "--resume"]), (4, vec!["--strategy", "ps", "--servers", "1", "--checkpoint-dir", copy.to_str().unwrap(), "--resume"])];
        for (ranks, extra) in cases {
            let name = format!("{optimizer}-resumed-{ranks}");
            let weights = train_saving_weights(&dir, &name, ranks, &args(d, optimizer, &extra));
            let diff = max_relative_difference(&reference, &weights);
            assert!(diff < 1e-5, "{name} differs from the uninterrupted run by {diff:e}");
        }
    }
    // Another optimizer cannot continue a checkpoint's state: refused once, nothing lost.
    let ckpt = dir.join("adamw-ckpt");
    let before = checkpoint_steps(&ckpt);
    let mut a = args(d, "lars", &["--strategy", "ring", "--checkpoint-dir", ckpt.to_str().unwrap(), "--resume"]);
    a.extend(["--results", dir.to_str().unwrap()]);
    let refused = mpirun(2, &a);
    assert!(!refused.ok(), "a LARS run continued an AdamW checkpoint");
    let out = refused.all_output();
    assert_eq!(out.matches("it was made with --optimizer adamw, this run uses lars").count(), 1, "{out}");
    assert_eq!(checkpoint_steps(&ckpt), before);
}

/// runs.jsonl says which optimizer and schedule ran, the last step's rate, the accuracy after
/// each epoch, and the epoch and time at which the target accuracy was first reached.
#[test]
fn the_record_says_what_ran_and_when_the_target_was_reached() {
    if covered_by_the_first_mpi("the record of a run") {
        return;
    }
    let dir = scratch("recipe-record");
    let data = dataset(&dir);
    let d = data.to_str().unwrap();
    let base = [
        "--model", "tiny", "--data", d, "--batch-size", "20", "--epochs", "3", "--threads", "1", "--strategy", "ring", "--optimizer", "sgd",
        "--scale-lr", "linear", "--base-batch", "20", "--lr-schedule", "poly", "--poly-power", "1",
        "--warmup-epochs", "1", "--results", dir.to_str().unwrap(),
    ];
    // A target reached at the first evaluation; one a rate of 1e-9 never reaches.
    for (target, lr, end_lr) in [("0.0001", "0.05", "0.01"), ("0.99", "1e-9", "0")] {
        let mut a = base.to_vec();
        a.extend(["--target-accuracy", target, "--lr", lr, "--end-lr", end_lr]);
        mpirun(2, &a).expect_ok();
    }
    let runs = read_runs(&dir);
    assert_eq!(runs.len(), 2);
    for r in &runs {
        assert_eq!(r["optimizer"], "sgd", "{r}");
        let schedule = r["lr_schedule"].as_str().unwrap();
        assert!(schedule.starts_with("poly^1 to 0") && schedule.contains("1-epoch warm-up"), "{schedule}");
        assert_eq!(r["accuracy_by_epoch"].as_array().unwrap().len(), 3, "{r}");
    }
    // 300 samples, 40 per step: 8 steps an epoch, 24 in all, 8 of warm-up to a peak of
    // 0.05 x 40 / 20; the last step (t = 15 of 16 decay steps) at 0.01 + 0.09 / 16.
    let final_lr = runs[0]["final_lr"].as_f64().unwrap();
    assert!((final_lr - (0.01 + 0.09 / 16.0)).abs() < 1e-12, "{final_lr}");
    assert_eq!(runs[0]["target_accuracy"], 0.0001);
    assert_eq!(runs[0]["epoch_to_target"], 1);
    assert!(runs[0]["time_to_target_s"].as_f64().unwrap() > 0.0);
    let never = &runs[1];
    assert!(never["accuracy_by_epoch"].as_array().unwrap().iter().all(|a| a.as_f64().unwrap() < 0.99), "{never}");
    assert!(never.get("epoch_to_target").is_none() && never.get("time_to_target_s").is_none(), "{never}");
}
