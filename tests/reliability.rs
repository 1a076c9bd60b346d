//! Reliability: checkpoints and resume, signals, failing ranks, bad configurations.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

fn base<'a>(data: &'a str, results: &'a str, strategy: &'a [&'a str]) -> Vec<&'a str> {
    let model = if strategy.contains(&"--model") { vec![] } else { vec!["--model", "tiny"] };
    let mut args = model;
    args.extend([
        "--data", data, "--scaling", "strong", "--global-batch", "12", "--no-eval",
        "--threads", "1", "--log-every", "1000", "--results", results,
    ]);
    args.extend(strategy);
    args
}

fn dataset(dir: &Path) -> PathBuf {
    synth(dir, "rel", 1200, 60, "1x16x16", 5)
}

/// The interrupted-and-resumed run ends with the uninterrupted run's weights.
fn sigterm_then_resume(strategy: &[&str], ranks: usize, name: &str) {
    let dir = scratch(&format!("sigterm-{name}"));
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let steps = "60";
    let full = dir.join("full.safetensors");
    let mut args = base(&d, &r, strategy);
    args.extend(["--steps", steps, "--save-weights", full.to_str().unwrap()]);
    mpirun(ranks, &args).expect_ok();

    let ckpt = dir.join("ckpt");
    let resumed = dir.join("resumed.safetensors");
    let mut args = base(&d, &r, strategy);
    args.extend(["--steps", steps, "--checkpoint-dir", ckpt.to_str().unwrap(), "--checkpoint-every", "10", "--save-weights", resumed.to_str().unwrap()]);
    let log = dir.join("interrupted.log");
    // Every rank slow from step 11 on (0.1 s a step, asleep): the signal below, sent once the
    // checkpoint of step 10 is there, finds the run still going without hundreds of steps.
    let pace: String = (0..ranks).map(|r| format!("pace@{r}:11:0.1")).collect::<Vec<_>>().join(",");
    let mut child = spawn_mpirun(ranks, &args, &[("HPC_TRAIN_FAULT", pace.as_str())], &log);
    wait_until(Duration::from_secs(120), "a first checkpoint", || !checkpoint_steps(&ckpt).is_empty());
    // What Slurm does before the time limit: SIGTERM to every task.
    for pid in rank_pids(child.id()) {
        signal(pid, "TERM");
    }
    let (code, _) = wait_limited(&mut child, Duration::from_secs(60)).expect("the interrupted run ended");
    let text = std::fs::read_to_string(&log).unwrap();
    // Stopped before its last step, its state in a checkpoint: 143, as a job a signal ended.
    assert_eq!(code, Some(143), "{text}");
    let stopped: u64 = text
        .split("stopped by a signal after step ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no stop message:\n{text}"));
    assert!(stopped < 60, "{text}");
    assert_eq!(*checkpoint_steps(&ckpt).last().unwrap(), stopped, "a checkpoint where it stopped");

    args.push("--resume");
    let run = mpirun(ranks, &args).expect_ok();
    assert!(run.stderr.contains(&format!("(step {stopped},")), "{}", run.stderr);
    let diff = max_relative_difference(&full, &resumed);
    assert!(diff < 1e-6, "{name}: resumed run differs from the uninterrupted one by {diff:e}");
}

// How a SIGTERM reaches the ranks and ends the job is the launcher's; what the checkpoint
// holds is each strategy's. MPICH's run stops and resumes the ring and the dedicated parameter
// server (the other two stop paths: a collective exchange, and a server that waits for
// workers); Open MPI's run every strategy (common::launcher::every_row).
#[test]
fn sigterm_and_resume_allreduce() {
    if !common::launcher::every_row() {
        return;
    }
    sigterm_then_resume(&["--strategy", "allreduce"], 3, "allreduce");
}

#[test]
fn sigterm_and_resume_ring() {
    sigterm_then_resume(&["--strategy", "ring"], 3, "ring");
}

#[test]
fn sigterm_and_resume_horovod() {
    if !common::launcher::every_row() {
        return;
    }
    sigterm_then_resume(&["--strategy", "horovod"], 2, "horovod");
}

#[test]
fn sigterm_and_resume_parameter_servers() {
    sigterm_then_resume(&["--strategy", "ps", "--servers", "1"], 3, "ps");
    if common::launcher::every_row() {
        sigterm_then_resume(&["--strategy", "ps", "--ps-colocate"], 3, "ps-colocated");
    }
}

#[test]
fn a_killed_rank_ends_the_job_and_resume_loses_at_most_one_interval() {
    let dir = scratch("kill");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let ckpt = dir.join("ckpt");
    let trace = dir.join("trace");
    let mut args = base(&d, &r, &["--strategy", "ring"]);
    args.extend(["--steps", "100000", "--checkpoint-dir", ckpt.to_str().unwrap(), "--checkpoint-every", "25", "--trace-samples", trace.to_str().unwrap()]);
    let log = dir.join("killed.log");
    let mut child = spawn_mpirun(3, &args, &[], &log);
    wait_until(Duration::from_secs(120), "two checkpoints", || checkpoint_steps(&ckpt).len() >= 2);
    let pids = rank_pids(child.id());
    assert_eq!(pids.len(), 3);
    signal(pids[1], "KILL");
    let (code, took) = wait_limited(&mut child, Duration::from_secs(30)).expect("the job ended within 30 s of the kill");
    assert_ne!(code, Some(0));
    eprintln!("job ended {took:?} after SIGKILL of one rank (exit {code:?})");
    // The last step any rank started, from the sample traces (epoch and step per line).
    let steps_per_epoch = 1200 / 12;
    let reached = (0..3)
        .filter_map(|rank| std::fs::read_to_string(trace.join(format!("rank{rank}.txt"))).ok())
        .filter_map(|t| t.lines().last().map(|l| l.split(' ').take(2).map(|v| v.parse::<u64>().unwrap()).collect::<Vec<_>>()))
        .map(|v| v[0] * steps_per_epoch + v[1] + 1)
        .max()
        .unwrap();
    let latest = *checkpoint_steps(&ckpt).last().unwrap();
    assert!(reached - latest <= 25 + 1, "reached step {reached}, newest checkpoint {latest}");

    let mut resume = base(&d, &r, &["--strategy", "ring"]);
    let total = (latest + 10).to_string();
    resume.extend(["--steps", &total, "--checkpoint-dir", ckpt.to_str().unwrap(), "--resume"]);
    let run = mpirun(3, &resume).expect_ok();
    assert!(run.stderr.contains(&format!("(step {latest},")), "{}", run.stderr);
}

#[test]
fn a_damaged_checkpoint_is_skipped_for_the_previous_one() {
    if covered_by_the_first_mpi("which checkpoint a resume takes when one is damaged") {
        return;
    }
    let dir = scratch("damaged");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let ckpt = dir.join("ckpt");
    let mut args = base(&d, &r, &["--strategy", "allreduce"]);
    args.extend(["--steps", "30", "--checkpoint-dir", ckpt.to_str().unwrap(), "--checkpoint-every", "10"]);
    mpirun(2, &args).expect_ok();
    assert_eq!(checkpoint_steps(&ckpt), vec![10, 20, 30]);
    // Truncate one part file of the newest checkpoint, as a crash of the storage might.
    let weights = ckpt.join("ckpt-000000000030/part-00001.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&weights).unwrap().set_len(len / 2).unwrap();
    args.extend(["--resume"]);
    let idx = args.iter().position(|a| *a == "30").unwrap();
    args[idx] = "35";
    let run = mpirun(2, &args).expect_ok();
    assert!(run.stderr.contains("skipping a damaged checkpoint") && run.stderr.contains("truncated"), "{}", run.stderr);
    assert!(run.stderr.contains("(step 20,"), "{}", run.stderr);
}

#[test]
fn checkpoints_of_another_run_are_refused_or_accepted_with_reason() {
    if covered_by_the_first_mpi("the checks of a checkpoint's settings") {
        return;
    }
    let dir = scratch("compat");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let mut args = base(&d, &r, &["--strategy", "ring"]);
    args.extend(["--steps", "10", "--checkpoint-dir", c]);
    mpirun(2, &args).expect_ok();

    let refused = |extra: &[&str], data: &str, reason: &str| {
        let mut a = base(data, &r, extra);
        a.extend(["--steps", "20", "--checkpoint-dir", c, "--resume"]);
        let run = mpirun_env(2, &a, &[], Duration::from_secs(60));
        assert!(!run.ok(), "resumed despite {reason}");
        assert_eq!(run.all_output().matches(reason).count(), 1, "{}", run.all_output());
    };
    // One refusal launched; the other settings a checkpoint is compared on (dataset, batch,
    // optimizer, ...): src/checkpoint/meta.rs's unit tests of check_compatible.
    refused(&["--strategy", "ring", "--model", "resnet18"], &d, "refused: it was made with model tiny, this run uses resnet18");
    // Another synchronous strategy and rank count with the same global batch: accepted, logged.
    let mut a = base(&d, &r, &["--strategy", "allreduce"]);
    a.extend(["--steps", "20", "--checkpoint-dir", c, "--resume"]);
    let run = mpirun(3, &a).expect_ok();
    assert!(run.stderr.contains("strategy ring -> allreduce") && run.stderr.contains("ranks 2 -> 3"), "{}", run.stderr);
    // The longer run's schedule, said in words (it printed `Some(LrSchedule { .. })`, issue 48).
    assert!(run.stderr.contains("learning-rate schedule peak rate 0.05, constant, 10 steps -> peak rate 0.05, constant, 20 steps"), "{}", run.stderr);
    assert!(!run.stderr.contains("LrSchedule") && !run.stderr.contains("Some("), "{}", run.stderr);
}

#[test]
fn one_failing_rank_ends_the_job_with_its_rank_and_cause() {
    let dir = scratch("failing");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let mut args = base(&d, &r, &["--strategy", "ring"]);
    args.extend(["--steps", "100000"]);
    // A diverging loss on rank 1.
    let run = mpirun_env(3, &args, &[("HPC_TRAIN_FAULT", "nan@1:5")], Duration::from_secs(60));
    assert!(!run.timed_out && !run.ok());
    assert!(run.elapsed < Duration::from_secs(30), "{:?}", run.elapsed);
    assert!(run.stderr.contains("rank 1 of 3: non-finite loss at step 5"), "{}", run.stderr);
    // A crash without MPI_Finalize on rank 2.
    let run = mpirun_env(3, &args, &[("HPC_TRAIN_FAULT", "exit@2:5")], Duration::from_secs(60));
    assert!(!run.timed_out && !run.ok(), "{}", run.all_output());
    assert!(run.elapsed < Duration::from_secs(30), "{:?}", run.elapsed);
}

#[test]
fn an_io_error_on_one_rank_ends_the_job() {
    let dir = scratch("io");
    // The reader checks the file's length after each read (HDF5 itself would hand out zeros for
    // the lost half), so the size of the file does not matter.
    let data = synth(&dir, "big", 2000, 10, "3x32x32", 5);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    // Read from the file at every step: a split held in memory (--cache-data) was read whole,
    // and checked, before training started.
    let args = ["--model", "tiny", "--data", &d, "--batch-size", "4", "--steps", "100000", "--no-eval", "--threads", "1", "--results", &r, "--prefetch", "1", "--cache-data", "off"];
    let log = dir.join("io.log");
    let mut child = spawn_mpirun(2, &args, &[], &log);
    wait_until(Duration::from_secs(60), "training to start", || std::fs::read_to_string(&log).unwrap_or_default().contains("steps 0.."));
    std::thread::sleep(Duration::from_millis(500));
    // The storage loses the second half of the file.
    let len = std::fs::metadata(&data).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&data).unwrap().set_len(len / 2).unwrap();
    let (code, took) = wait_limited(&mut child, Duration::from_secs(60)).expect("the job ended");
    let text = std::fs::read_to_string(&log).unwrap();
    assert_ne!(code, Some(0), "{text}");
    assert!(took < Duration::from_secs(30));
    assert!(text.contains("error: rank ") && text.contains("big.h5") && text.contains("shrank from"), "{text}");
}

#[test]
fn ranks_started_with_different_options_are_refused() {
    let dir = scratch("mismatch");
    let data = dataset(&dir);
    let d = data.to_str().unwrap();
    let r = dir.to_str().unwrap();
    // MPMD launch: rank 0 and rank 1 get different learning rates.
    let common = ["--model", "tiny", "--data", d, "--results", r, "--steps", "2", "--batch-size", "2"];
    let mut args: Vec<&str> = common.to_vec();
    args.extend(["--lr", "0.1", ":", "-n", "1", bin()]);
    args.extend(common);
    args.extend(["--lr", "0.2"]);
    let run = mpirun_env(1, &args, &[], Duration::from_secs(60));
    assert!(!run.ok());
    assert_eq!(run.all_output().matches("lr is 0.1 on rank 0 but 0.2 on rank 1").count(), 1, "{}", run.all_output());
}

#[test]
fn a_silent_async_worker_is_reported_by_its_server() {
    let dir = scratch("ps-timeout");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let mut args = base(&d, &r, &["--strategy", "ps", "--ps-mode", "async", "--ps-timeout-s", "2"]);
    args.extend(["--steps", "100000"]);
    let run = mpirun_env(3, &args, &[("HPC_TRAIN_FAULT", "stall@1:5:60")], Duration::from_secs(90));
    assert!(!run.timed_out && !run.ok(), "{}", run.all_output());
    assert!(run.elapsed < Duration::from_secs(40), "{:?}", run.elapsed);
    assert!(run.stderr.contains("worker rank 1 has sent nothing for 2 s"), "{}", run.stderr);
}

#[test]
fn resume_without_a_checkpoint_starts_from_the_beginning() {
    if covered_by_the_first_mpi("a resume with no checkpoint") {
        return;
    }
    let dir = scratch("fresh");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let ckpt = dir.join("empty");
    let mut args = base(&d, &r, &["--strategy", "ring"]);
    args.extend(["--steps", "5", "--checkpoint-dir", ckpt.to_str().unwrap(), "--resume"]);
    let run = mpirun(2, &args).expect_ok();
    assert!(run.stderr.contains("no complete checkpoint"), "{}", run.stderr);
    assert_eq!(checkpoint_steps(&ckpt), vec![5]);
    let mut bad = base(&d, &r, &["--strategy", "ring"]);
    bad.extend(["--steps", "5", "--resume"]);
    let run = mpirun_env(2, &bad, &[], Duration::from_secs(60));
    assert_eq!(run.all_output().matches("--resume needs --checkpoint-dir").count(), 1, "{}", run.all_output());
}

/// A non-finite gradient found while an overlapped backward still runs ends the job with the
/// clear error, not with a crash: the step waits for backward before it returns, so no hook
/// fires into the freed channel. MALLOC_PERTURB_ makes glibc fill freed memory with garbage, so
/// that a hook calling into it (the defect of 851c172) crashes instead of passing by luck.
#[test]
fn a_non_finite_gradient_during_overlap_is_a_clean_error() {
    let dir = scratch("overlap-nan");
    // ResNet-18 on 3x32x32: backward takes long enough that the last layers' bucket is checked
    // while the earlier layers are still being differentiated.
    let data = synth(&dir, "nangrad", 64, 0, "3x32x32", 4);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    for strategy in ["allreduce", "ring"] {
        let args = [
            "--model", "resnet18", "--data", &d, "--batch-size", "8", "--steps", "4", "--no-eval", "--threads", "1",
            "--results", &r, "--strategy", strategy, "--overlap", "on", "--bucket-mb", "1",
        ];
        let run = mpirun_env(2, &args, &[("HPC_TRAIN_FAULT", "nangrad@1:2"), ("MALLOC_PERTURB_", "165")], Duration::from_secs(120));
        let out = run.all_output();
        assert!(!run.timed_out && !run.ok(), "{out}");
        assert!(out.contains("rank 1 of 2: non-finite gradient at step 2"), "{strategy}: {out}");
        for crash in ["Segmentation fault", "signal 11", "SIGSEGV", "signal 6", "panicked"] {
            assert!(!out.contains(crash), "{strategy}: {crash}:\n{out}");
        }
    }
}

/// A non-finite gradient on one rank ends a Horovod-style run as quickly as a ring run (it took
/// 11.6 s against 1.5 s, issue 31 item 23): the failing rank's background thread, told to stop
/// while the other ranks wait for its tensors, leaves at once instead of waiting out the
/// 10 s grace for a thread that cannot end, so the rank reports and aborts the job.
#[test]
fn a_non_finite_gradient_ends_a_horovod_run_as_quickly_as_a_ring_run() {
    let dir = scratch("horovod-nan");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let elapsed = |strategy: &str, overlap: &str, fault: &str| -> Duration {
        let options = ["--strategy", strategy, "--overlap", overlap];
        let mut args = base(&d, &r, &options);
        args.extend(["--steps", "100000"]);
        let run = mpirun_env(2, &args, &[("HPC_TRAIN_FAULT", fault)], Duration::from_secs(60));
        let out = run.all_output();
        assert!(!run.timed_out && !run.ok(), "{strategy}: {out}");
        assert!(out.contains("rank 1 of 2: non-finite"), "{strategy} {fault}: {out}");
        run.elapsed
    };
    for (overlap, fault) in [("off", "nangrad@1:5"), ("on", "nangrad@1:5"), ("off", "nan@1:5")] {
        let ring = elapsed("ring", overlap, fault);
        let horovod = elapsed("horovod", overlap, fault);
        eprintln!("{fault}, overlap {overlap}: ring ended in {ring:?}, horovod in {horovod:?}");
        assert!(horovod < ring + Duration::from_secs(5), "{fault}, overlap {overlap}: horovod took {horovod:?}, ring {ring:?}");
    }
}

/// An error every rank agrees on after the exchange is built (here an injected set-up failure)
/// ends a Horovod-style run cleanly: the background thread is joined before MPI_Finalize, which
/// at 851c172 ran while the thread was still inside MPI.
#[test]
fn an_agreed_error_joins_communication_threads_before_finalize() {
    let dir = scratch("finalize");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    // A long cycle: the background thread takes its shutdown message only at the end of a
    // cycle, so MPI_Finalize, if it did not wait for the thread, would run first.
    let horovod = ["--strategy", "horovod", "--cycle-time-ms", "100"];
    let hierarchical = ["--strategy", "horovod", "--cycle-time-ms", "100", "--hierarchical"];
    for strategy in [&horovod[..], &hierarchical, &["--strategy", "ps", "--ps-colocate", "--ps-mode", "async"]] {
        let mut args = base(&d, &r, strategy);
        args.extend(["--steps", "50"]);
        let run = mpirun_env(3, &args, &[("HPC_TRAIN_FAULT", "setup@1:0")], Duration::from_secs(60));
        let out = run.all_output();
        assert!(!run.timed_out && !run.ok(), "{strategy:?}: {out}");
        assert!(run.elapsed < Duration::from_secs(30), "{strategy:?}: {:?}", run.elapsed);
        assert_eq!(out.matches("rank 1: set-up failed (injected by HPC_TRAIN_FAULT)").count(), 1, "{strategy:?}: {out}");
        for wrong in ["after MPI_FINALIZE", "aborting instead of finalizing", "MPI_ABORT", "panicked"] {
            assert!(!out.contains(wrong), "{strategy:?}: {wrong}:\n{out}");
        }
    }
}

/// Resuming a run whose checkpoint already covers the steps asked for ends at once, says so,
/// and appends no record, for every strategy (at 851c172 the parameter server hung for
/// --ps-timeout-s and ring appended a record of 0 steps).
#[test]
fn resuming_a_finished_run_ends_at_once_without_a_record() {
    if covered_by_the_first_mpi("a resume of a finished run") {
        return;
    }
    let dir = scratch("resume-done");
    let data = dataset(&dir);
    let d = data.to_str().unwrap().to_string();
    for strategy in [&["--strategy", "ps", "--servers", "1"][..], &["--strategy", "ring"], &["--strategy", "horovod"], &["--strategy", "ps", "--ps-colocate"]] {
        let name = strategy.join("-").replace("--", "");
        let results = dir.join(&name);
        let r = results.to_str().unwrap().to_string();
        let ckpt = results.join("ckpt");
        let weights = results.join("again.safetensors");
        let mut args = base(&d, &r, strategy);
        args.extend(["--steps", "6", "--checkpoint-dir", ckpt.to_str().unwrap(), "--checkpoint-every", "3"]);
        mpirun(3, &args).expect_ok();
        assert_eq!(read_runs(&results).len(), 1);
        args.extend(["--resume", "--save-weights", weights.to_str().unwrap()]);
        let run = mpirun_env(3, &args, &[], Duration::from_secs(60));
        assert!(run.ok(), "{name}: {}", run.all_output());
        assert!(run.elapsed < Duration::from_secs(20), "{name}: {:?}", run.elapsed);
        assert_eq!(run.stdout.matches("already covers the 6 steps asked for").count(), 1, "{name}: {}", run.all_output());
        assert_eq!(read_runs(&results).len(), 1, "{name}: no record appended");
        assert!(weights.exists(), "{name}: --save-weights writes the checkpoint's weights");
    }
}

/// A rank that stops answering mid-run (a hung node, a cut link) ends the job within
/// --exchange-timeout-s: every rank waiting in an exchange says what it waits for, and the job
/// is aborted instead of hanging until the batch system's time limit.
#[test]
fn the_exchange_watchdog_ends_a_hung_exchange() {
    let dir = scratch("watchdog");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    // MPICH's run: the ring (this rank's own waits) and MPI_Allreduce (a wait inside MPICH);
    // Horovod's background cycle too under Open MPI (common::launcher::every_row).
    for (strategy, overlap) in common::launcher::rows_under_mpich(&[("ring", "on"), ("allreduce", "off"), ("horovod", "on")], |(s, _)| s != "horovod") {
        let options = ["--strategy", strategy, "--overlap", overlap, "--exchange-timeout-s", "3"];
        let mut args = base(&d, &r, &options);
        args.extend(["--steps", "100000"]);
        let run = mpirun_env(3, &args, &[("HPC_TRAIN_FAULT", "stall@1:5:120")], Duration::from_secs(90));
        let out = run.all_output();
        assert!(!run.timed_out && !run.ok(), "{strategy}: {out}");
        assert!(run.elapsed < Duration::from_secs(30), "{strategy}: {:?}\n{out}", run.elapsed);
        assert!(out.contains(&format!("exchange watchdog: {strategy} at step 5")), "{strategy}: {out}");
        assert!(out.contains("has made no progress for 3 s") && out.contains("waiting for"), "{strategy}: {out}");
    }
    // A rank lost between two exchanges: the others, done with the exchange, wait for it in
    // the stop agreement that follows every step, which is watched as well.
    let mut args = base(&d, &r, &["--strategy", "ring", "--exchange-timeout-s", "3"]);
    args.extend(["--steps", "100000"]);
    let run = mpirun_env(3, &args, &[("HPC_TRAIN_FAULT", "stall-after@1:5:120")], Duration::from_secs(90));
    let out = run.all_output();
    assert!(!run.timed_out && !run.ok(), "{out}");
    assert!(run.elapsed < Duration::from_secs(30), "{:?}\n{out}", run.elapsed);
    assert!(out.contains("exchange watchdog: the stop agreement at step 5 has made no progress for 3 s"), "{out}");
    // A slow step that is not a hang: a stall shorter than the timeout goes unnoticed (the
    // watchdog's own clock, whatever the MPI: Open MPI's run).
    if !common::launcher::every_row() {
        return;
    }
    let mut args = base(&d, &r, &["--strategy", "ring", "--exchange-timeout-s", "5"]);
    args.extend(["--steps", "8"]);
    mpirun_env(3, &args, &[("HPC_TRAIN_FAULT", "stall@1:5:2")], Duration::from_secs(90)).expect_ok();
}

/// A signal that stops a run before its last step made it exit 0, as if it had finished (and,
/// without --checkpoint-dir, advised --resume though nothing was saved). Now: 143 once the
/// checkpoint of the step where it stopped is written, 1 when nothing was saved. A run holds
/// its checkpoint folder: a second job on the same folder (which would prune and replace the
/// first one's checkpoints) is refused at start, naming the holder.
#[test]
fn a_stopped_run_says_what_it_saved_in_its_exit_status_and_holds_its_folder() {
    let dir = scratch("stop-codes");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let ckpt = dir.join("ckpt");
    let started = |log: &Path| std::fs::read_to_string(log).unwrap_or_default().contains("steps 0..");

    let mut args = base(&d, &r, &["--strategy", "allreduce"]);
    args.extend(["--steps", "100000", "--checkpoint-dir", ckpt.to_str().unwrap(), "--checkpoint-every", "100000"]);
    let log = dir.join("first.log");
    let mut child = spawn_mpirun(2, &args, &[], &log);
    wait_until(Duration::from_secs(60), "training to start", || started(&log));
    let second = mpirun_env(2, &args, &[], Duration::from_secs(60));
    assert!(!second.ok() && second.elapsed < Duration::from_secs(20), "{}", second.all_output());
    let holder = format!("in use by another run (pid {} on ", rank_pids(child.id())[0]);
    assert_eq!(second.all_output().matches(&holder).count(), 1, "{}", second.all_output());
    for pid in rank_pids(child.id()) {
        signal(pid, "TERM");
    }
    let (code, _) = wait_limited(&mut child, Duration::from_secs(60)).expect("the stopped run ended");
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(code, Some(143), "{text}");
    let saved = checkpoint_steps(&ckpt);
    assert_eq!(saved.len(), 1, "{text}");
    assert!(text.contains(&format!("stopped by a signal after step {} of 100000; checkpoint at step {} in ", saved[0], saved[0])) && text.contains("continue with --resume"), "{text}");

    // Without a checkpoint folder nothing is kept: said so, no advice to resume, exit 1.
    let mut args = base(&d, &r, &["--strategy", "allreduce"]);
    args.extend(["--steps", "100000"]);
    let log = dir.join("unsaved.log");
    let mut child = spawn_mpirun(2, &args, &[], &log);
    wait_until(Duration::from_secs(60), "training to start", || started(&log));
    for pid in rank_pids(child.id()) {
        signal(pid, "USR1");
    }
    let (code, _) = wait_limited(&mut child, Duration::from_secs(60)).expect("the stopped run ended");
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("; nothing was saved (no --checkpoint-dir) and no record written"), "{text}");
    assert!(!text.contains("--resume"), "{text}");
}

/// Checkpoints that could not be written (a full disk) were logged as "the previous one is
/// intact" when there was none, the run exited 0, and `.partial` folders were left. Without an
/// earlier checkpoint the run now stops with the reason; with one, each failure is logged, the
/// record is written and the run exits non-zero naming the newest good checkpoint. No partial
/// folder is left either way.
#[test]
fn checkpoints_that_cannot_be_written_end_the_run_non_zero() {
    let dir = scratch("full-checkpoints");
    let data = dataset(&dir);
    let d = data.to_str().unwrap().to_string();
    let disk = dir.join("disk");
    let run_on = |size: &str, results: &Path| {
        let r = results.to_str().unwrap().to_string();
        let ckpt = disk.join("ckpt");
        let mut args = base(&d, &r, &["--strategy", "allreduce"]);
        args.extend(["--steps", "20", "--checkpoint-dir", ckpt.to_str().unwrap(), "--checkpoint-every", "5"]);
        mpirun_with_tmpfs_listing(2, &args, &disk, size, Duration::from_secs(60))
    };
    // 16 KiB: not even the first checkpoint fits.
    let results = dir.join("none");
    let (run, left) = run_on("16k", &results);
    let out = run.all_output();
    assert!(!run.ok() && !run.timed_out, "{out}");
    assert_eq!(out.matches("the checkpoint at step 5 could not be written").count(), 1, "{out}");
    assert!(out.contains("and this run has no earlier one to continue from: stopping"), "{out}");
    assert!(!out.contains("intact"), "{out}");
    assert_eq!(left, vec!["ckpt", "ckpt/.lock"], "{out}");
    assert!(!results.join("runs.jsonl").exists());
    // 64 KiB: the checkpoint at step 5 fits, the next ones do not (the old one stays until a
    // newer one is complete).
    let results = dir.join("one");
    let (run, left) = run_on("64k", &results);
    let out = run.all_output();
    assert!(!run.ok() && !run.timed_out, "{out}");
    for step in [10, 15, 20] {
        assert_eq!(out.matches(&format!("checkpoint at step {step} failed")).count(), 1, "{out}");
    }
    assert_eq!(out.matches("3 checkpoint(s) could not be written (after step(s) 10, 15, 20); --resume continues from the newest good one, at step 5").count(), 1, "{out}");
    let good = "ckpt/ckpt-000000000005";
    let expected: Vec<String> = ["ckpt", "ckpt/.lock", good].into_iter().map(String::from)
        .chain(["index.json", "meta.crc32", "meta.json", "part-00000.safetensors", "part-00001.safetensors"].map(|f| format!("{good}/{f}")))
        .collect();
    assert_eq!(left, expected, "{out}");
    assert_eq!(read_runs(&results).len(), 1, "training finished: its record stands");
}

/// README said that any synchronous strategy may continue another's checkpoint, but rhd and
/// auto were refused. Both continue a ring checkpoint to the uninterrupted run's weights.
#[test]
fn rhd_and_auto_continue_a_ring_checkpoint() {
    if covered_by_the_first_mpi("a checkpoint's content across strategies") {
        return;
    }
    let dir = scratch("resume-rhd-auto");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let full = dir.join("full.safetensors");
    let mut args = base(&d, &r, &["--strategy", "ring"]);
    args.extend(["--steps", "20", "--save-weights", full.to_str().unwrap()]);
    mpirun(2, &args).expect_ok();
    let ring_ckpt = dir.join("ring");
    let mut args = base(&d, &r, &["--strategy", "ring"]);
    args.extend(["--steps", "10", "--checkpoint-dir", ring_ckpt.to_str().unwrap()]);
    mpirun(2, &args).expect_ok();
    for strategy in ["rhd", "auto"] {
        // Each from its own copy of the ring's checkpoint at step 10.
        let ckpt = dir.join(strategy);
        let from = ring_ckpt.join("ckpt-000000000010");
        std::fs::create_dir_all(ckpt.join("ckpt-000000000010")).unwrap();
        for file in std::fs::read_dir(&from).unwrap() {
            let file = file.unwrap();
            std::fs::copy(file.path(), ckpt.join("ckpt-000000000010").join(file.file_name())).unwrap();
        }
        let resumed = dir.join(format!("{strategy}.safetensors"));
        let chosen = ["--strategy", strategy];
        let mut args = base(&d, &r, &chosen);
        args.extend(["--steps", "20", "--checkpoint-dir", ckpt.to_str().unwrap(), "--resume", "--save-weights", resumed.to_str().unwrap()]);
        let run = mpirun(2, &args).expect_ok();
        assert!(run.stderr.contains(&format!("strategy ring -> {strategy}")) && run.stderr.contains("(step 10,"), "{}", run.stderr);
        let diff = max_relative_difference(&full, &resumed);
        assert!(diff < 1e-5, "{strategy}: resumed from ring's checkpoint, differs from the uninterrupted run by {diff:e}");
    }
}

/// Resume accepted another file of the same name and size (every `data synth` file of one shape
/// has the same name), and an edited step in meta.json. The checkpoint records the dataset's
/// content fingerprint, and meta.json has a CRC-32 of its own.
#[test]
fn resume_refuses_another_dataset_of_the_same_size_and_an_edited_meta_json() {
    if covered_by_the_first_mpi("the dataset fingerprint and meta.json's checksum") {
        return;
    }
    let dir = scratch("resume-content");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let twin = dir.join("twin.h5");
    hpc_train(&["data", "synth", "--samples", "1200", "--test-samples", "60", "--shape", "1x16x16", "--classes", "5", "--seed", "9", "--out", twin.to_str().unwrap()]).expect_ok();
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let mut args = base(&d, &r, &["--strategy", "allreduce"]);
    args.extend(["--steps", "10", "--checkpoint-dir", c]);
    mpirun(2, &args).expect_ok();

    let mut other = base(twin.to_str().unwrap(), &r, &["--strategy", "allreduce"]);
    other.extend(["--steps", "20", "--checkpoint-dir", c, "--resume"]);
    let run = mpirun_env(2, &other, &[], Duration::from_secs(60));
    assert!(!run.ok(), "{}", run.all_output());
    assert_eq!(run.all_output().matches("refused: it was made with another dataset of the same name and size (content fingerprint").count(), 1, "{}", run.all_output());

    let meta = ckpt.join("ckpt-000000000010/meta.json");
    let text = std::fs::read_to_string(&meta).unwrap();
    std::fs::write(&meta, text.replace("\"step\": 10,", "\"step\": 15,")).unwrap();
    let mut again = base(&d, &r, &["--strategy", "allreduce"]);
    again.extend(["--steps", "12", "--checkpoint-dir", c, "--resume"]);
    let run = mpirun_env(2, &again, &[], Duration::from_secs(60));
    assert!(!run.ok() && run.stderr.contains("meta.json fails its CRC-32 check (edited or damaged)"), "{}", run.all_output());
    // Its only checkpoint damaged, the run refuses to start over it (tests/checkpoint.rs).
    assert_eq!(run.all_output().matches("every checkpoint here is damaged").count(), 1, "{}", run.all_output());
    assert!(!run.stderr.contains("resuming from") && checkpoint_steps(&ckpt) == vec![10], "{}", run.all_output());
}

/// `--save-weights` and `--timeline` on a full disk left their `.tmp` files behind. Both runs now
/// end non-zero naming the full disk; the weights leave nothing, and the timeline (streamed as
/// the run goes, as Horovod's) stays a valid JSON array of the events written before the disk
/// filled up.
#[test]
fn outputs_on_a_full_disk_leave_no_temporary_file() {
    // Writing through a temporary file is the program's file logic, the same under any MPI:
    // Open MPI's run checks it (common::launcher::every_row).
    if !common::launcher::every_row() {
        return;
    }
    let dir = scratch("full-outputs");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let disk = dir.join("disk");
    let weights = disk.join("w.safetensors");
    let timeline = disk.join("timeline.json");
    for (strategy, output) in [("allreduce", ["--save-weights", weights.to_str().unwrap()]), ("horovod", ["--timeline", timeline.to_str().unwrap()])] {
        let chosen = ["--strategy", strategy];
        let mut args = base(&d, &r, &chosen);
        args.extend(["--steps", "20"]);
        args.extend(output);
        let (run, left) = mpirun_with_tmpfs_listing(2, &args, &disk, "8k", Duration::from_secs(60));
        let out = run.all_output();
        assert!(!run.ok() && !run.timed_out, "{strategy}: {out}");
        assert!(out.contains("No space left on device") || out.contains("StorageFull"), "{strategy}: {out}");
        match strategy {
            "horovod" => {
                assert_eq!(left, vec!["timeline.json".to_string()], "{out}");
                assert!(out.contains("the timeline") && out.contains("is incomplete"), "{out}");
            }
            _ => assert!(left.is_empty(), "{strategy} left {left:?}:\n{out}"),
        }
    }
}

/// A SIGTERM while the job starts (before the run's set-up had installed its handler) killed
/// the rank, and the job exited 143, the status that says a checkpoint holds the step, with
/// nothing saved (issue 48). Now it is a stop request: without --checkpoint-dir the run exits
/// 1 saying nothing was saved; with one, it writes a checkpoint where it stopped and exits 143.
#[test]
fn a_sigterm_during_start_up_is_a_stop_that_says_what_was_saved() {
    let dir = scratch("sigterm-start-up");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.join("r").to_str().unwrap().to_string());
    let mut args = base(&d, &r, &["--strategy", "ring"]);
    args.extend(["--steps", "20"]);
    let fault = [("HPC_TRAIN_FAULT", "term@1:0")];
    let run = mpirun_env(2, &args, &fault, Duration::from_secs(60));
    let out = run.all_output();
    assert_eq!(run.status, Some(1), "{out}");
    assert_eq!(out.matches("hpc-train: stopped by a signal after step 1 of 20; nothing was saved (no --checkpoint-dir)").count(), 1, "{out}");
    let ckpt = dir.join("ckpt");
    args.extend(["--checkpoint-dir", ckpt.to_str().unwrap()]);
    let run = mpirun_env(2, &args, &fault, Duration::from_secs(60));
    let out = run.all_output();
    assert_eq!(run.status, Some(143), "{out}");
    assert!(out.contains("checkpoint at step 1 in"), "{out}");
    assert_eq!(checkpoint_steps(&ckpt), vec![1], "{out}");
}

/// A SIGTERM in the first 0.4-1 s of a rank, while libtorch's static initialisers run before
/// main, killed it by the signal's default action: exit 143, the status that says a checkpoint
/// holds the step, with nothing saved. The stop handler is now in place before any library's
/// initialiser: the signal sent as soon as the process catches it, which the kernel shows
/// (SigCgt) while Rust's runtime has not yet set SIGPIPE aside (SigIgn), that is before main,
/// is a stop request: a checkpoint at step 1 and 143. One process, no launcher: what is tested
/// is the process's own start, which no launcher changes.
#[test]
fn a_sigterm_before_main_is_a_stop_that_checkpoints() {
    let dir = scratch("sigterm-before-main");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.join("r").to_str().unwrap().to_string());
    let ckpt = dir.join("ckpt");
    let mut args = base(&d, &r, &["--strategy", "allreduce"]);
    args.extend(["--steps", "20", "--checkpoint-dir", ckpt.to_str().unwrap()]);
    let log = dir.join("run.log");
    let mut child = spawn_hpc_train(&args, &log);
    // Bit n-1 of a /proc/PID/status mask is signal n.
    let mask = |status: &str, field: &str| status.lines().find_map(|l| l.strip_prefix(field)).and_then(|v| u64::from_str_radix(v.trim(), 16).ok()).unwrap_or(0);
    let (term, pipe) = (1u64 << 14, 1u64 << 12);
    let status_path = format!("/proc/{}/status", child.id());
    let started = std::time::Instant::now();
    let ignored_at_catch = loop {
        let status = std::fs::read_to_string(&status_path).unwrap_or_default();
        if mask(&status, "SigCgt:") & term != 0 {
            break mask(&status, "SigIgn:");
        }
        assert!(started.elapsed() < Duration::from_secs(60) && child.try_wait().unwrap().is_none(), "SIGTERM never caught:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
        std::thread::sleep(Duration::from_micros(500));
    };
    signal(child.id(), "TERM");
    let (code, _) = wait_limited(&mut child, Duration::from_secs(120)).expect("the stopped run ended");
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(ignored_at_catch & pipe, 0, "SIGTERM was first caught after Rust's runtime had started (it ignores SIGPIPE before main):\n{text}");
    assert_eq!(code, Some(143), "{text}");
    assert!(text.contains("stopped by a signal after step 1 of 20; checkpoint at step 1 in"), "{text}");
    assert_eq!(checkpoint_steps(&ckpt), vec![1], "{text}");
}

/// A rank stopped while the job starts (a node that hangs, a process stopped) left the others
/// inside `MPI_Init_thread` for ever: the exchange watchdog does not exist yet. A guard armed
/// before MPI's start-up ends the job after --exchange-timeout-s, here raised to its start-up
/// floor of 10 s. The stalled rank pauses before its guard is armed, as a stopped rank's guard
/// could not run either: the others' guards end the job.
#[test]
fn a_rank_stopped_during_mpi_start_up_ends_the_job() {
    let dir = scratch("stall-start");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let mut args = base(&d, &r, &["--strategy", "ring", "--exchange-timeout-s", "3"]);
    args.extend(["--steps", "5"]);
    let run = mpirun_env(2, &args, &[("HPC_TRAIN_FAULT", "stall-start@1:0:120")], Duration::from_secs(90));
    let out = run.all_output();
    assert!(!run.timed_out && !run.ok(), "{out}");
    assert!(run.elapsed < Duration::from_secs(40), "{:?}\n{out}", run.elapsed);
    assert!(out.contains("rank 1: pausing 120 s before MPI's start-up (injected fault)"), "{out}");
    assert!(out.contains("error: rank 0 of the 2 the launcher started: MPI's start-up (MPI_Init_thread) has not completed after 10 s: a rank has not joined the job"), "{out}");
}

/// During a stalled write of a sharded checkpoint the watchdog's line named the step the loop
/// had last begun (3) for the folder of step 4, and no line named the rank stuck in its write.
/// Now the stuck rank says it is the one the others wait for, naming its part file, and any
/// waiting rank names the checkpoint's folder and step.
#[test]
fn a_stalled_checkpoint_write_names_its_step_and_the_stuck_rank() {
    let dir = scratch("stall-write-watchdog");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let ckpt = dir.join("ckpt");
    let mut args = base(&d, &r, &["--strategy", "ring", "--exchange-timeout-s", "3"]);
    args.extend(["--steps", "20", "--checkpoint-dir", ckpt.to_str().unwrap(), "--checkpoint-every", "4"]);
    let run = mpirun_env(2, &args, &[("HPC_TRAIN_FAULT", "stall-write@1:4:120")], Duration::from_secs(90));
    let out = run.all_output();
    assert!(!run.timed_out && !run.ok(), "{out}");
    assert!(run.elapsed < Duration::from_secs(40), "{:?}\n{out}", run.elapsed);
    assert!(
        out.contains("error: rank 1: exchange watchdog: writing its part ")
            && out.contains(".ckpt-000000000004.partial/part-00001.safetensors at step 4 has made no progress for 3 s")
            && out.contains("and the other ranks wait for this one, inside writing the sharded checkpoint ckpt-000000000004;"),
        "{out}"
    );
    for line in out.lines().filter(|l| l.contains("exchange watchdog: writing")) {
        assert!(line.contains(" at step 4 "), "a checkpoint's wait named by another step: {line}\n{out}");
    }
    assert_eq!(checkpoint_steps(&ckpt), Vec::<u64>::new(), "{out}");
}

/// `--profile-dir` on a full disk printed "profile written" and exited 0 with a truncated
/// rank-R.json.tmp left (issue 48): the run fails with one line naming --profile-dir, every rank
/// non-zero, nothing left behind and no run recorded.
#[test]
fn a_profile_on_a_full_disk_fails_the_run_and_leaves_nothing() {
    let dir = scratch("full-profile");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.join("r").to_str().unwrap().to_string());
    let disk = dir.join("disk");
    let profiles = disk.join("p");
    let mut args = base(&d, &r, &["--strategy", "ring"]);
    args.extend(["--steps", "4", "--profile-dir", profiles.to_str().unwrap()]);
    let (run, left) = mpirun_with_tmpfs_listing(2, &args, &disk, "8k", Duration::from_secs(60));
    let out = run.all_output();
    assert!(!run.ok() && !run.timed_out, "{out}");
    let message = format!("--profile-dir {}: the profiler could not write rank-", profiles.display());
    assert_eq!(out.matches(&message).count(), 1, "{out}");
    assert!(!out.contains("written to") && !out.contains("panicked"), "{out}");
    assert_eq!(left, vec!["p".to_string()], "{out}");
    assert!(!dir.join("r").join("runs.jsonl").exists(), "{out}");
}

/// With overlap, a non-finite gradient is found at the end of the step, after the exchange has
/// spread it to every rank: rank 0 must not write those weights over the good checkpoints
/// (issue 31, item 7's deferred check). The checkpoint before the fault stays the newest.
#[test]
fn a_diverged_step_writes_no_checkpoint() {
    let dir = scratch("nan-checkpoint");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let ckpt = dir.join("ckpt");
    let mut args = base(&d, &r, &["--strategy", "ring", "--overlap", "on", "--bucket-mb", "0.001"]);
    args.extend(["--steps", "10", "--checkpoint-dir", ckpt.to_str().unwrap(), "--checkpoint-every", "2"]);
    // The fault at step index 3: the step that ends at the checkpoint after step 4.
    let run = mpirun_env(2, &args, &[("HPC_TRAIN_FAULT", "nangrad@1:3")], Duration::from_secs(120));
    assert!(!run.timed_out && !run.ok(), "{}", run.all_output());
    assert!(run.all_output().contains("non-finite gradient at step 3"), "{}", run.all_output());
    assert_eq!(checkpoint_steps(&ckpt), vec![2], "{}", run.all_output());
}

/// A pipelined run under `HPC_TRAIN_FAULT`: the options of a cheap two-stage pipeline
/// (P = 2, `ranks` / 2 replicas) with a short watchdog, over `steps` steps.
fn pipelined<'a>(d: &'a str, r: &'a str, steps: &'a str, extra: &'a [&'a str]) -> Vec<&'a str> {
    let mut args = base(d, r, &["--pipeline-stages", "2", "--micro-batches", "2", "--strategy", "ring", "--exchange-timeout-s", "5"]);
    args.extend(["--steps", steps]);
    args.extend(extra);
    args
}

/// A stalled pipeline stage hung the job for ever with one pipeline (its waits were outside
/// the watchdog) and was blamed on the wrong rank with two. Now the stage waiting for it ends
/// the job within the timeout, naming itself, the message, and its peer by world rank.
#[test]
fn a_stalled_pipeline_stage_ends_the_job_naming_stage_and_world_rank() {
    let dir = scratch("pipeline-stall");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    // Rank 1 holds stage 1 of the first pipeline with D = 1 and with D = 2 alike.
    for ranks in [2, 4] {
        let args = pipelined(&d, &r, "100000", &[]);
        let run = mpirun_env(ranks, &args, &[("HPC_TRAIN_FAULT", "stall@1:2:120")], Duration::from_secs(90));
        let out = run.all_output();
        assert!(!run.timed_out && !run.ok(), "{ranks} ranks: {out}");
        // Timeout (5 s) + 5 s, after a start-up of a few seconds.
        assert!(run.elapsed < Duration::from_secs(25), "{ranks} ranks: {:?}\n{out}", run.elapsed);
        assert!(out.contains("error: rank 0: exchange watchdog: pipeline stage 0 at step 2 has made no progress for 5 s"), "{ranks} ranks: {out}");
        assert!(out.contains("waiting for the gradient of micro-batch 0 from stage 1 (world rank 1)"), "{ranks} ranks: {out}");
        // The flight recorder: what rank 0 did last, so that one log shows where it stopped.
        assert!(out.contains("rank 0: its last communication events, oldest first: [step"), "{ranks} ranks: {out}");
    }
    // The stage itself stopped (SIGSTOP), as a hung node: its neighbour's watchdog ends the job.
    let args = pipelined(&d, &r, "100000", &[]);
    let log = dir.join("stopped.log");
    let mut child = spawn_mpirun(2, &args, &[], &log);
    let rank0 = pid_of_rank(&mut child, 2, 0);
    // Well into training: its first line is written (start-up took from one to over four
    // seconds, by the machine's load), and a second later its steps, of milliseconds, run.
    wait_until(Duration::from_secs(60), "training to start", || std::fs::read_to_string(&log).unwrap_or_default().contains("steps 0.."));
    std::thread::sleep(Duration::from_secs(1));
    signal(rank0, "STOP");
    let ended = wait_limited(&mut child, Duration::from_secs(30));
    signal(rank0, "CONT");
    let (code, took) = ended.expect("the job ended within 30 s of the stop");
    let text = std::fs::read_to_string(&log).unwrap();
    assert_ne!(code, Some(0), "{text}");
    assert!(took < Duration::from_secs(15), "{took:?}: {text}");
    // Stage 1 waits for stage 0 in the schedule or in the stop agreement after a step; either
    // way its flight recorder names what it last waited for from stage 0 by world rank.
    assert!(text.contains("error: rank 1: exchange watchdog:"), "{text}");
    assert!(text.contains("from stage 0 (world rank 0)"), "{text}");
}

/// The process id of `rank` of a job of `ranks` ranks, once they all run (start-up takes a
/// moment), from the rank its launcher gave it.
fn pid_of_rank(child: &mut std::process::Child, ranks: usize, rank: usize) -> u32 {
    let mut pids = Vec::new();
    wait_until(Duration::from_secs(60), "the ranks to start", || {
        pids = rank_pids(child.id());
        pids.len() == ranks
    });
    let rank_of = |pid: u32| -> Option<usize> {
        let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        env.split(|b| *b == 0).filter_map(|v| std::str::from_utf8(v).ok()).find_map(|v| {
            v.strip_prefix("OMPI_COMM_WORLD_RANK=").or_else(|| v.strip_prefix("PMI_RANK=")).and_then(|r| r.parse().ok())
        })
    };
    *pids.iter().find(|&&p| rank_of(p) == Some(rank)).unwrap_or_else(|| panic!("no process of rank {rank} among {pids:?}"))
}

/// `exit`, `nan` and `nangrad` were ignored by pipelined runs (they ended 0), and `stall-after`
/// by `--zero 3` runs: every step kind now honours every fault at the same points.
#[test]
fn every_step_kind_honours_the_injected_faults() {
    let dir = scratch("pipeline-faults");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let args = pipelined(&d, &r, "4", &[]);
    // Where each step kind calls the hooks is hpc-train's; how the job then ends is the
    // launcher's, which the stalls below (and one_failing_rank_ends_the_job_with_its_rank_and_cause)
    // show under MPICH too. MPICH's run leaves these rows to Open MPI's (common::launcher::every_row).
    let pipelined_faults: &[(&str, &str)] = if common::launcher::every_row() {
        &[
            ("nan@0:2", "rank 0 of 2: non-finite loss at step 2"),
            ("nan@1:2", "rank 1 of 2: non-finite loss at step 2"),
            ("nangrad@0:1", "rank 0 of 2: non-finite gradient at step 1"),
            ("exit@1:2", "rank 1: exiting at step 2 (injected fault)"),
        ]
    } else {
        &[("exit@1:2", "rank 1: exiting at step 2 (injected fault)")]
    };
    for &(fault, says) in pipelined_faults {
        let run = mpirun_env(2, &args, &[("HPC_TRAIN_FAULT", fault)], Duration::from_secs(60));
        let out = run.all_output();
        assert!(!run.timed_out && !run.ok(), "{fault}: {out}");
        assert!(out.contains(says), "{fault}: {out}");
    }
    let mut args = base(&d, &r, &["--strategy", "ring", "--zero", "3", "--exchange-timeout-s", "5"]);
    args.extend(["--steps", "4"]);
    let run = mpirun_env(2, &args, &[("HPC_TRAIN_FAULT", "stall-after@1:2:120")], Duration::from_secs(60));
    let out = run.all_output();
    assert!(!run.timed_out && !run.ok(), "{out}");
    assert!(out.contains("rank 1: stalling 120.0 s after the exchange of step 2"), "{out}");
    assert!(out.contains("exchange watchdog: the stop agreement at step 2 has made no progress for 5 s"), "{out}");
    // With LARS the peers' next wait is the optimizer's per-unit norm all-reduce, which ran
    // unwatched (issue 48, item 7): a stall there hung the job.
    let mut lars = args.clone();
    lars.extend(["--optimizer", "lars"]);
    let run = mpirun_env(2, &lars, &[("HPC_TRAIN_FAULT", "stall-after@1:2:120")], Duration::from_secs(60));
    let out = run.all_output();
    assert!(!run.timed_out && !run.ok(), "{out}");
    assert!(out.contains("exchange watchdog: the zero 3 optimizer's norm all-reduce at step 2") && out.contains("waiting for world rank 1"), "{out}");
    if !common::launcher::every_row() {
        return;
    }
    // A fault on a rank the job lacks would never happen: refused at set-up, once.
    let run = mpirun_env(2, &args, &[("HPC_TRAIN_FAULT", "nan@7:1")], Duration::from_secs(60));
    assert!(!run.ok() && !run.timed_out);
    assert_eq!(run.stderr.matches("HPC_TRAIN_FAULT: \"nan@7:1\" names rank 7, but the job has ranks 0 to 1").count(), 1, "{}", run.stderr);
    // The variable's other refusals (seconds out of range, unknown kinds): src/faults.rs's
    // unit tests, through the same parse.
}

/// An error inside a stage's schedule (an out-of-memory at the last forward, injected by
/// `error`) dropped messages in flight whose drop waited for ever for neighbours that wait for
/// this stage: no error line, no abort. Now the messages are abandoned and the error ends the
/// job at once, on every rank.
#[test]
fn an_error_inside_a_pipeline_schedule_ends_the_job() {
    let dir = scratch("pipeline-error");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    for (stages, fault, rank) in [("2", "error@0:1", 0), ("3", "error@1:1", 1)] {
        // GPipe: the first backward's gradient is awaited (its receive posted) during the last forward.
        let options = ["--pipeline-stages", stages, "--micro-batches", "4", "--schedule", "gpipe", "--exchange-timeout-s", "60"];
        let mut args = base(&d, &r, &options);
        args.extend(["--steps", "4"]);
        let ranks: usize = stages.parse().unwrap();
        let run = mpirun_env(ranks, &args, &[("HPC_TRAIN_FAULT", fault)], Duration::from_secs(60));
        let out = run.all_output();
        assert!(!run.timed_out && !run.ok(), "{fault}: {out}");
        // Well before the watchdog's 60 s: the error itself ends the job.
        assert!(run.elapsed < Duration::from_secs(30), "{fault}: {:?}\n{out}", run.elapsed);
        assert!(out.contains(&format!("rank {rank} of {ranks}: libtorch: Internal torch error: the forward failed at step 1 (injected by HPC_TRAIN_FAULT)")), "{fault}: {out}");
    }
}

/// One GPU rank leaves its loss and its gradients' finiteness on the device until the loop
/// reads them (train/step.rs, DeferredChecks); the test hook takes the same path on a CPU rank.
/// Read late, the checks give the weights, final loss and errors of reading every step: a
/// non-finite loss or gradient ends the run naming its step, and no checkpoint is written after
/// it (the read comes before each checkpoint).
#[test]
fn checks_read_late_give_the_same_weights_and_errors_as_every_step() {
    if covered_by_the_first_mpi("the deferred checks of one rank") {
        return;
    }
    let dir = scratch("deferred-checks");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap().to_string(), dir.to_str().unwrap().to_string());
    let defer = [("HPC_TRAIN_TEST_DEFER_CHECKS", "1")];
    let weights = |name: &str, env: &[(&str, &str)]| {
        let path = dir.join(format!("{name}.safetensors"));
        let mut args = base(&d, &r, &["--optimizer", "adamw", "--lr", "0.01"]);
        args.extend(["--steps", "10", "--save-weights", path.to_str().unwrap(), "--study-tag", name]);
        mpirun_env(1, &args, env, Duration::from_secs(120)).expect_ok();
        path
    };
    let (every, late) = (weights("every-step", &[]), weights("late", &defer));
    assert_eq!(max_relative_difference(&every, &late), 0.0, "the same kernels in the same order");
    let losses: Vec<f64> = read_runs(&dir).iter().map(|row| row["final_loss"].as_f64().unwrap()).collect();
    assert!(losses.len() == 2 && losses[0] == losses[1] && losses[0].is_finite(), "final losses {losses:?}");

    for (fault, what) in [("nan@0:5", "non-finite loss at step 5"), ("nangrad@0:5", "non-finite gradient at step 5")] {
        let mut outcomes = Vec::new();
        for (name, env) in [("every", vec![("HPC_TRAIN_FAULT", fault)]), ("late", vec![("HPC_TRAIN_FAULT", fault), defer[0]])] {
            // A folder per fault kind (nan, nangrad): a run from step 0 refuses one that holds
            // an earlier run's checkpoints.
            let kind = fault.split('@').next().unwrap();
            let checkpoints = dir.join(format!("ckpt-{name}-{kind}"));
            let mut args = base(&d, &r, &[]);
            args.extend(["--steps", "12", "--checkpoint-dir", checkpoints.to_str().unwrap(), "--checkpoint-every", "3"]);
            let run = mpirun_env(1, &args, &env, Duration::from_secs(120));
            let out = run.all_output();
            assert!(!run.timed_out && !run.ok(), "{fault} {name}: {out}");
            assert_eq!(out.matches(what).count(), 1, "{fault} {name}: {out}");
            outcomes.push(checkpoint_steps(&checkpoints));
        }
        assert_eq!(outcomes[0], vec![3], "{fault}: checkpoints before the fault only");
        assert_eq!(outcomes[0], outcomes[1], "{fault}: the same checkpoints");
    }
}
