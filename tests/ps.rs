//! The parameter server: synchronous equals all-reduce, asynchronous with staleness 0 equals
//! synchronous, asynchronous with staleness learns, bad layouts are refused.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

fn train(dir: &Path, data: &Path, name: &str, ranks: usize, extra: &[&str]) -> PathBuf {
    let mut args = vec![
        "--model", "tiny", "--data", data.to_str().unwrap(), "--scaling", "strong", "--global-batch", "12",
        "--steps", "10", "--no-eval", "--threads", "1", "--lr", "0.05", "--weight-decay", "0.001",
    ];
    args.extend(extra);
    train_saving_weights(dir, name, ranks, &args)
}

#[test]
fn synchronous_ps_equals_allreduce() {
    let dir = scratch("ps-sync");
    let data = synth(&dir, "ps", 100, 0, "1x12x12", 5);
    let reference = train(&dir, &data, "ref", 1, &["--strategy", "allreduce"]);
    let layouts: [(&str, usize, &[&str]); 6] = [
        ("s1n2", 2, &["--servers", "1"]),
        ("s1n3", 3, &["--servers", "1"]),
        ("s2n4", 4, &["--servers", "2"]),
        ("s2n5", 5, &["--servers", "2"]),
        ("co2", 2, &["--ps-colocate"]),
        ("co4", 4, &["--ps-colocate"]),
    ];
    for (name, ranks, opts) in layouts {
        let mut args = vec!["--strategy", "ps"];
        args.extend(opts);
        let w = train(&dir, &data, name, ranks, &args);
        let diff = max_relative_difference(&reference, &w);
        assert!(diff < 1e-5, "{name}: ps differs from allreduce by {diff:e}");
    }
}

#[test]
fn async_with_staleness_zero_equals_sync() {
    let dir = scratch("ps-async0");
    let data = synth(&dir, "ps0", 100, 0, "1x12x12", 5);
    for (name, ranks, opts) in [("dedicated", 3, &["--servers", "1"][..]), ("two", 4, &["--servers", "2"]), ("colocated", 3, &["--ps-colocate"])] {
        let mut sync_args = vec!["--strategy", "ps"];
        sync_args.extend(opts);
        let sync = train(&dir, &data, &format!("sync-{name}"), ranks, &sync_args);
        let mut async_args = sync_args.clone();
        async_args.extend(["--ps-mode", "async", "--max-staleness", "0"]);
        let asynchronous = train(&dir, &data, &format!("async-{name}"), ranks, &async_args);
        let diff = max_relative_difference(&sync, &asynchronous);
        assert!(diff < 1e-5, "{name}: async with staleness 0 differs from sync by {diff:e}");
    }
    // The record says what staleness was seen: none.
    let runs = read_runs(&dir);
    let last = runs.last().unwrap();
    assert_eq!(last["extra"]["staleness_max"], 0, "{last}");
}

#[test]
fn async_with_staleness_learns_like_sync() {
    // A learning curve, not an MPI behaviour: Open MPI's run only (common::launcher::every_row);
    // MPICH's run keeps the exact staleness-0 test.
    if !common::launcher::every_row() {
        return;
    }
    let dir = scratch("ps-learn");
    let data = fashion_mnist();
    let mut accuracy = Vec::new();
    for mode in [&["--ps-mode", "sync"][..], &["--ps-mode", "async", "--max-staleness", "4"]] {
        let mut args = vec![
            "--strategy", "ps", "--servers", "1", "--model", "tiny", "--data", data.to_str().unwrap(),
            "--batch-size", "32", "--epochs", "1", "--lr", "0.1", "--threads", "1", "--results", dir.to_str().unwrap(),
        ];
        args.extend(mode);
        mpirun(3, &args).expect_ok();
        let run = read_runs(&dir).pop().unwrap();
        accuracy.push(run["test_accuracy"].as_f64().unwrap());
        if mode[1] == "async" {
            let max = run["extra"]["staleness_max"].as_u64().unwrap();
            assert!(max <= 4, "staleness {max} beyond the bound");
            assert!(run["extra"]["staleness_mean"].as_f64().is_some());
        }
    }
    eprintln!("Fashion-MNIST, tiny CNN, 1 epoch, 2 workers + 1 server: sync {:.2}%, async (staleness <= 4) {:.2}%", accuracy[0] * 100.0, accuracy[1] * 100.0);
    assert!(accuracy[0] > 0.65, "sync accuracy {}", accuracy[0]);
    // Async's result depends on how the workers' pushes interleave: over five runs on the
    // 2-core VM (one during the full suite) it ranged 72.96-76.33% against sync's 75.52%, and
    // under MPICH during the full suite (2026-11-27, two tests at once) it fell to 68.49%
    // against 75.61% (72.54% and 76.36% when run again). Its exactness is
    // async_with_staleness_zero_equals_sync's; here a broken async (updates lost, applied
    // twice, or far too stale) ends far outside 9 points.
    assert!((accuracy[0] - accuracy[1]).abs() <= 0.09, "sync {} vs async {}", accuracy[0], accuracy[1]);
}

#[test]
fn uneven_shards_and_free_running_workers_finish() {
    // 53 samples over 2 workers with batch 4: shards of 27 and 26, a last step of 5; async
    // without a bound lets one worker run ahead and finish first.
    let dir = scratch("ps-uneven");
    let data = synth(&dir, "uneven", 53, 10, "1x8x8", 3);
    for mode in [&["--ps-mode", "sync"][..], &["--ps-mode", "async"], &["--ps-mode", "async", "--ps-colocate"]] {
        let mut args = vec![
            "--strategy", "ps", "--model", "tiny", "--data", data.to_str().unwrap(), "--batch-size", "4",
            "--epochs", "3", "--threads", "1", "--results", dir.to_str().unwrap(),
        ];
        args.extend(mode);
        let run = mpirun_env(3, &args, &[], Duration::from_secs(120));
        assert!(!run.timed_out, "{mode:?} hung");
        assert!(run.ok(), "{mode:?}:\n{}", run.all_output());
    }
}

#[test]
fn layouts_that_cannot_work_are_refused() {
    let dir = scratch("ps-bad");
    let data = synth(&dir, "bad", 40, 4, "1x8x8", 3);
    let d = data.to_str().unwrap();
    let r = dir.to_str().unwrap();
    let base = ["--strategy", "ps", "--model", "tiny", "--data", d, "--results", r, "--steps", "2", "--batch-size", "2"];
    let run = mpirun_env(2, &[&base[..], &["--servers", "2"]].concat(), &[], Duration::from_secs(60));
    assert!(!run.ok());
    assert_eq!(run.all_output().matches("leaves no worker").count(), 1, "{}", run.all_output());
    // The tiny model has 6 parameter tensors: 7 colocated servers cannot each hold one.
    let run = mpirun_env(7, &[&base[..], &["--ps-colocate"]].concat(), &[], Duration::from_secs(60));
    assert!(!run.ok());
    assert_eq!(run.all_output().matches("7 parameter servers but the model has 6 parameter tensors").count(), 1, "{}", run.all_output());
}

#[test]
fn ps_in_the_bench() {
    let dir = scratch("ps-bench");
    for (ranks, opts) in [(3, &["--servers", "1"][..]), (4, &["--servers", "2", "--layout", "resnet50"]), (3, &["--ps-colocate", "--layout", "resnet50"])] {
        let mut args = vec!["bench", "--strategies", "ps,ring", "--counts", "1001,262147", "--iters", "2", "--warmup", "1", "--verify", "allreduce", "--results", dir.to_str().unwrap()];
        args.extend(opts);
        let run = mpirun_env(ranks, &args, &[], Duration::from_secs(120));
        assert!(run.ok(), "{opts:?}:\n{}", run.all_output());
        let rows: Vec<&str> = run.stdout.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(rows.len(), 4);
        assert!(rows.iter().all(|r| r.ends_with(" 0")), "{}", run.stdout);
    }
}
