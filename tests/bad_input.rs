//! Bad input, launched as a user launches it: each case ends every rank non-zero within
//! seconds, with one clear message. One launch per kind of error (a command line that does not
//! parse, a data file that cannot be read, sizes that do not fit, an option the strategy does
//! not read, an output folder that cannot be made, a study's, a model's, and the inputs that
//! could hang a rank): which values each check refuses, and with what words, is tested without
//! a launch next to the check (src/cli.rs's refusal_tests, src/data/layout.rs,
//! src/train/plan.rs, src/train/recipe.rs, src/model/mod.rs, src/study.rs, src/results.rs).

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const RANKS: usize = 2;

/// Runs training with `args` on RANKS ranks and checks the failure: non-zero, quick, and the
/// expected message printed exactly once, and no panic.
fn expect_failure(args: &[&str], message: &str) -> Run {
    let run = mpirun_env(RANKS, args, &[], Duration::from_secs(60));
    assert!(!run.timed_out, "hung: {args:?}\n{}", run.all_output());
    assert!(!run.ok(), "succeeded: {args:?}");
    let out = run.all_output();
    assert_eq!(out.matches(message).count(), 1, "expected {message:?} once in:\n{out}");
    assert!(!out.contains("panicked"), "{out}");
    assert!(run.elapsed < Duration::from_secs(30), "took {:?}", run.elapsed);
    run
}

/// Training options: small defaults, each replaceable through `over` (flag, value).
fn base<'a>(data: &'a str, results: &'a str) -> Vec<&'a str> {
    with(data, results, &[])
}

fn with<'a>(data: &'a str, results: &'a str, over: &[(&'a str, &'a str)]) -> Vec<&'a str> {
    let mut opts = vec![
        ("--model", "tiny"), ("--strategy", "allreduce"), ("--data", data), ("--results", results),
        ("--steps", "2"), ("--batch-size", "2"),
    ];
    for &(flag, value) in over {
        match opts.iter_mut().find(|(f, _)| *f == flag) {
            Some(slot) => slot.1 = value,
            None => opts.push((flag, value)),
        }
    }
    opts.into_iter().flat_map(|(f, v)| [f, v]).collect()
}

fn write_h5(path: &Path, build: impl FnOnce(&hdf5::File) -> hdf5::Result<()>) {
    with_hdf5_open(|| {
        let f = hdf5::File::create(path).unwrap();
        build(&f).unwrap();
    })
}

fn images(f: &hdf5::Group, split: &str, n: usize) -> hdf5::Result<()> {
    let g = f.create_group(split)?;
    g.new_dataset::<u8>().shape([n, 1, 8, 8]).create("images")?;
    let labels: Vec<i64> = (0..n as i64).map(|i| i % 3).collect();
    g.new_dataset_builder().with_data(&labels).create("labels")?;
    Ok(())
}

/// A data file that cannot be read: refused on every rank as it is opened (which files are
/// refused, and with what words: src/data/layout.rs's unit tests).
#[test]
fn missing_and_unreadable_files() {
    let dir = scratch("bad-files");
    let results = dir.join("r");
    expect_failure(&base("/nonexistent/data.h5", results.to_str().unwrap()), "no such file");
}

/// A batch larger than the training split, found once the file is read (strong scaling's
/// batch that does not split over the ranks: src/train/plan.rs's unit tests).
#[test]
fn sizes_that_do_not_fit() {
    let dir = scratch("bad-sizes");
    let data = synth(&dir, "small", 6, 2, "1x8x8", 2);
    let results = dir.join("r");
    expect_failure(&with(data.to_str().unwrap(), results.to_str().unwrap(), &[("--batch-size", "4")]), "fewer than ranks x batch");
}

/// A command line that does not parse, refused before MPI starts, and a profile folder that
/// cannot be made, agreed after it (the other values refused: src/cli.rs's refusal_tests,
/// src/train/plan.rs's and src/results.rs's unit tests).
#[test]
fn bad_options() {
    let dir = scratch("bad-options");
    let data = synth(&dir, "opt", 20, 2, "1x8x8", 2);
    let d = data.to_str().unwrap();
    let r = dir.join("r");
    let r = r.to_str().unwrap();
    expect_failure(&with(d, r, &[("--strategy", "butterfly")]), "invalid value 'butterfly' for '--strategy");
    let blocker = dir.join("file");
    std::fs::write(&blocker, b"").unwrap();
    let profiles = blocker.join("profiles");
    expect_failure(&with(d, r, &[("--profile-dir", profiles.to_str().unwrap())]), &format!("--profile-dir {}: Not a directory", profiles.display()));
}

/// A small valid layout (1x8x8 images, 3 classes) with root attributes written by `attrs`.
fn with_attrs(path: &Path, attrs: impl FnOnce(&hdf5::File) -> hdf5::Result<()>) {
    write_h5(path, |f| {
        images(f, "train", 10)?;
        images(f, "test", 4)?;
        attrs(f)
    })
}

/// Options that the chosen strategy never reads were silently ignored (`--timeline` with ring
/// wrote nothing). Refused, naming the option and the strategy; in a study an option read by
/// one of its strategies is fine.
#[test]
fn options_the_strategy_does_not_read_are_refused() {
    let dir = scratch("bad-unused");
    let data = synth(&dir, "unused", 20, 2, "1x8x8", 2);
    let (d, r) = (data.to_str().unwrap(), dir.join("r"));
    let r = r.to_str().unwrap();
    let timeline = dir.join("timeline.json");
    let t = timeline.to_str().unwrap();
    // The other options refused so: src/cli.rs's refusal_tests and src/exchange/options.rs's.
    expect_failure(&with(d, r, &[("--strategy", "ring"), ("--timeline", t)]), "--timeline is an option of --strategy horovod; --strategy ring writes nothing");
    assert!(!timeline.exists());
    // A study of ring and allreduce: nothing writes the timeline.
    let study = |strategies: &str| {
        let args = [
            "study", "--ranks", "2", "--strategies", strategies, "--timeline", t,
            "--model", "tiny", "--data", d, "--results", r, "--steps", "2", "--batch-size", "2",
        ];
        mpirun_env(RANKS, &args, &[], Duration::from_secs(120))
    };
    let run = study("ring,allreduce");
    assert!(!run.ok() && !run.timed_out, "{}", run.all_output());
    assert_eq!(run.all_output().matches("--timeline is an option of --strategy horovod; the strategies ring,allreduce writes nothing").count(), 1, "{}", run.all_output());
    // With horovod in the study, the option is read: accepted, and the timeline written.
    study("ring,horovod").expect_ok();
    assert!(timeline.exists());
}

/// A strong study of ring and ps at 1, 2 and 4 ranks with a global batch of 8 ran its four
/// first points and stopped at ps on 4 ranks (3 workers): seen on the GPU machine's 16 cores,
/// where the sweep had run a minute before it failed. Now it stops before its first point,
/// naming every point the batch does not split over, and appends nothing.
#[test]
fn a_strong_study_whose_batch_does_not_split_at_a_point_stops_before_it_starts() {
    let dir = scratch("bad-study-batch");
    let data = synth(&dir, "study", 20, 2, "1x8x8", 2);
    let (d, r) = (data.to_str().unwrap(), dir.join("r"));
    let r = r.to_str().unwrap();
    let args = [
        "study", "--ranks", "1,2,4", "--strategies", "ring,ps", "--scaling", "strong", "--global-batch", "8",
        "--model", "tiny", "--data", d, "--results", r, "--steps", "1", "--no-eval",
    ];
    let run = mpirun_env(4, &args, &[], Duration::from_secs(120));
    assert!(!run.ok() && !run.timed_out, "{}", run.all_output());
    let message = "--global-batch 8 does not divide evenly among the training ranks of every point of the study (strong scaling splits it evenly): ps at 4 rank(s) has 3;";
    assert_eq!(run.all_output().matches(message).count(), 1, "{}", run.all_output());
    assert!(!dir.join("r").join("runs.jsonl").exists(), "a point ran before the study stopped:\n{}", run.all_output());
    // A stage count that divides no rank count, refused by the study's checks before its
    // first point too: src/study.rs's unit tests.
}

/// `--threads 100000` hung without a word; `--threads 1000` took 28 s for 2 steps.
#[test]
fn threads_far_beyond_the_cores_are_refused() {
    let dir = scratch("bad-threads");
    let data = synth(&dir, "threads", 20, 2, "1x8x8", 2);
    let (d, r) = (data.to_str().unwrap(), dir.join("r"));
    expect_failure(&with(d, r.to_str().unwrap(), &[("--threads", "100000")]), "intra-op threads per core only wait for each other");
}

/// A model that cannot be built for the file's sizes panicked on every rank (10^12 classes:
/// screens of backtrace; `data info` aborted). The tiny CNN on 1x1 images (a pool2d panic) is
/// refused by the same check of the model against the file: src/model/mod.rs's unit tests.
#[test]
fn sizes_the_model_cannot_take_are_refused_without_a_panic() {
    let dir = scratch("bad-model-sizes");
    let r = dir.join("r");
    let r = r.to_str().unwrap();
    let huge = dir.join("classes.h5");
    with_attrs(&huge, |f| f.new_attr::<i64>().create("num_classes")?.write_scalar(&1_000_000_000_000i64));
    expect_failure(&base(huge.to_str().unwrap(), r), "in the last layer, for 1000000000000 classes");
    let info = hpc_train(&["data", "info", huge.to_str().unwrap()]).expect_ok();
    assert!(info.stdout.contains("classes:     1000000000000") && info.stdout.contains("3 of the 1000000000000 classes present"), "{}", info.stdout);
}

/// A FIFO as `--data` hung (opening it waits for a writer), and SIGTERM did not end it.
#[test]
fn a_fifo_as_data_is_refused_at_once() {
    let dir = scratch("bad-fifo");
    let fifo = dir.join("data.h5");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(status.success());
    let r = dir.join("r");
    expect_failure(&base(fifo.to_str().unwrap(), r.to_str().unwrap()), "is a FIFO (named pipe), not a regular file");
}

/// `bench --iters 0` appended rows of time 0, and `model fit` made a model of them in which
/// every link cost nothing.
#[test]
fn a_bench_of_no_iterations_and_rows_of_no_time_are_refused() {
    let dir = scratch("bad-bench");
    let results = dir.join("r");
    let run = hpc_train(&["bench", "--strategies", "ring", "--counts", "1000", "--iters", "0", "--results", results.to_str().unwrap()]);
    assert!(!run.ok() && run.all_output().contains("invalid value '0' for '--iters <ITERS>': expected at least 1"), "{}", run.all_output());
    assert!(!results.join("bench.jsonl").exists());
    let bench = dir.join("bench.jsonl");
    let row = |size: usize, time: f64| {
        format!(
            r#"{{"size":{size},"strategy":"ring","ranks":2,"nodes":1,"time_us":{time},"wrong":0,"type":"float","layout":"single","device":"cpu","memory_add_gbs":10.0}}"#
        )
    };
    std::fs::write(&bench, [row(4096, 12.0), row(8192, 0.0), row(16384, 30.0)].join("\n")).unwrap();
    let out = dir.join("model.json");
    let run = hpc_train(&["model", "fit", "--bench", bench.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(!run.ok(), "{}", run.all_output());
    let message = format!("{}:2: the ring row of 8192 bytes on 2 rank(s) has time_us 0, not a positive measurement", bench.display());
    assert_eq!(run.all_output().matches(&message).count(), 1, "{}", run.all_output());
    assert!(!out.exists());
}

/// Issue 48's probes of `project`: a global batch near 2^64 plans (its micro-batch doubled and
/// wrapped to 0, a remainder by zero), 2^64 - 1 GPUs is refused at once (its divisors took for
/// ever), and project's flags are refused under their own names, exit 1.
#[test]
fn project_probes_end_in_a_plan_or_one_line_naming_the_flag() {
    let out = scratch("project-probes");
    let profile = root().join("jobs/clusters/dgx-a100-hdr.toml");
    let project = |extra: &[&str]| {
        let mut args = vec!["project", "--profile", profile.to_str().unwrap(), "--out", out.to_str().unwrap()];
        args.extend(extra);
        hpc_train(&args)
    };
    let run = project(&["--plan", "--global-batch", "18446744073709551615"]);
    assert!(run.ok() && run.stdout.contains("(fastest)") && !run.all_output().contains("panicked"), "{}", run.all_output());
    for (extra, message) in [
        (&["--plan", "--gpus", "18446744073709551615"][..], "--gpus 18446744073709551615: at most 16777216 (2^24) GPUs"),
        (&["--plan", "--vocab", "0"], "--vocab 0: expected at least 1"),
        (&["--compute-ms", "NaN"], "--compute-ms NaN: expected a positive number of milliseconds"),
        (&["--compute-ms", "1", "--ranks", "1,2,4", "--pipeline-stages", "3"], "--pipeline-stages 3: divides none of the rank counts of --ranks 1,2,4"),
    ] {
        let run = project(extra);
        let all = run.all_output();
        assert!(!run.ok() && run.elapsed < Duration::from_secs(20), "{extra:?}: {all}");
        assert_eq!(all.matches(message).count(), 1, "{extra:?}: {all}");
        assert_eq!(all.lines().count(), 1, "{extra:?}: {all}");
    }
}
