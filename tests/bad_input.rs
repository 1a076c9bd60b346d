//! Bad input: each case ends every rank non-zero within seconds, with one clear message.

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

#[test]
fn missing_and_unreadable_files() {
    let dir = scratch("bad-files");
    let results = dir.join("r");
    let r = results.to_str().unwrap();
    expect_failure(&base("/nonexistent/data.h5", r), "no such file");
    let not_h5 = dir.join("not.h5");
    std::fs::write(&not_h5, b"this is text").unwrap();
    expect_failure(&base(not_h5.to_str().unwrap(), r), "not an HDF5 file");
    expect_failure(&base(dir.to_str().unwrap(), r), "is a directory");
}

#[test]
fn malformed_datasets() {
    let dir = scratch("bad-layout");
    let results = dir.join("r");
    let r = results.to_str().unwrap();

    let no_test = dir.join("no_test.h5");
    write_h5(&no_test, |f| images(f, "train", 10));
    expect_failure(&base(no_test.to_str().unwrap(), r), "missing dataset `test/images`");

    let float_images = dir.join("float.h5");
    write_h5(&float_images, |f| {
        for split in ["train", "test"] {
            let g = f.create_group(split)?;
            g.new_dataset::<f32>().shape([10, 1, 8, 8]).create("images")?;
            g.new_dataset::<i64>().shape([10]).create("labels")?;
        }
        Ok(())
    });
    expect_failure(&base(float_images.to_str().unwrap(), r), "expected uint8");

    let rank3 = dir.join("rank3.h5");
    write_h5(&rank3, |f| {
        for split in ["train", "test"] {
            let g = f.create_group(split)?;
            g.new_dataset::<u8>().shape([10, 8, 8]).create("images")?;
            g.new_dataset::<i64>().shape([10]).create("labels")?;
        }
        Ok(())
    });
    expect_failure(&base(rank3.to_str().unwrap(), r), "expected 4 dimensions");

    let wrong_count = dir.join("count.h5");
    write_h5(&wrong_count, |f| {
        images(f, "test", 4)?;
        let g = f.create_group("train")?;
        g.new_dataset::<u8>().shape([10, 1, 8, 8]).create("images")?;
        g.new_dataset::<i64>().shape([9]).create("labels")?;
        Ok(())
    });
    expect_failure(&base(wrong_count.to_str().unwrap(), r), "one label per image");

    let out_of_range = dir.join("range.h5");
    write_h5(&out_of_range, |f| {
        images(f, "train", 10)?;
        images(f, "test", 4)?;
        f.new_attr::<i64>().create("num_classes")?.write_scalar(&2i64)?;
        Ok(())
    });
    expect_failure(&base(out_of_range.to_str().unwrap(), r), "outside 0..2");
}

#[test]
fn sizes_that_do_not_fit() {
    let dir = scratch("bad-sizes");
    let data = synth(&dir, "small", 6, 2, "1x8x8", 2);
    let d = data.to_str().unwrap();
    let results = dir.join("r");
    let r = results.to_str().unwrap();
    expect_failure(&with(d, r, &[("--batch-size", "4")]), "fewer than ranks x batch");
    expect_failure(&with(d, r, &[("--scaling", "strong"), ("--global-batch", "3")]), "not divisible by the 2 training ranks");
    expect_failure(&with(d, r, &[("--scaling", "strong")]), "needs --global-batch");
}

#[test]
fn bad_options() {
    let dir = scratch("bad-options");
    let data = synth(&dir, "opt", 20, 2, "1x8x8", 2);
    let d = data.to_str().unwrap();
    let r = dir.join("r");
    let r = r.to_str().unwrap();
    expect_failure(&with(d, r, &[("--batch-size", "0")]), "invalid value '0' for '--batch-size");
    expect_failure(&with(d, r, &[("--strategy", "butterfly")]), "invalid value 'butterfly' for '--strategy");
    expect_failure(&with(d, r, &[("--model", "vgg")]), "invalid value 'vgg' for '--model");
    if !Path::new("/dev/nvidia0").exists() {
        expect_failure(&with(d, r, &[("--device", "cuda")]), "CUDA is not available");
    }
    // A results folder that cannot be created (its parent is a file): refused before training.
    let blocker = dir.join("file");
    std::fs::write(&blocker, b"").unwrap();
    let results = blocker.join("results");
    expect_failure(&base(d, results.to_str().unwrap()), "cannot create it");
    // So is a profile folder that cannot be made, and --profile-steps 0.
    let profiles = blocker.join("profiles");
    expect_failure(&with(d, r, &[("--profile-dir", profiles.to_str().unwrap())]), &format!("--profile-dir {}: Not a directory", profiles.display()));
    expect_failure(&with(d, r, &[("--profile-steps", "0")]), "invalid value '0' for '--profile-steps");
}

/// `data info FILE` alone: its status and output.
fn data_info(file: &Path) -> Run {
    hpc_train(&["data", "info", file.to_str().unwrap()])
}

/// A small valid layout (1x8x8 images, 3 classes) with root attributes written by `attrs`.
fn with_attrs(path: &Path, attrs: impl FnOnce(&hdf5::File) -> hdf5::Result<()>) {
    write_h5(path, |f| {
        images(f, "train", 10)?;
        images(f, "test", 4)?;
        attrs(f)
    })
}

/// An infinite `std` trained on blank inputs and exited 0 at chance accuracy; a NaN `mean` ended
/// in an unnamed "non-finite loss". Both are refused when the file is opened, naming the
/// attribute, by training and by `data info`.
#[test]
fn normalisation_attributes_are_checked_when_the_file_is_opened() {
    let dir = scratch("bad-normalisation");
    let r = dir.join("r");
    let r = r.to_str().unwrap();
    // (name, mean, std, message, also through training: the probe's two cases; the check is
    // the same code for both commands).
    let cases: [(&str, [f32; 1], [f32; 1], &str, bool); 4] = [
        ("inf-std", [0.5], [f32::INFINITY], "attribute `std` [0] is inf, expected a finite value", true),
        ("nan-mean", [f32::NAN], [0.5], "attribute `mean` [0] is NaN, expected a finite value", true),
        ("zero-std", [0.5], [0.0], "attribute `std` [0] is 0, expected a standard deviation > 0", false),
        ("inf-mean", [f32::NEG_INFINITY], [0.5], "attribute `mean` [0] is -inf", false),
    ];
    for (name, mean, std, message, train) in cases {
        let file = dir.join(format!("{name}.h5"));
        with_attrs(&file, |f| {
            f.new_attr::<f32>().shape(1).create("mean")?.write(&mean)?;
            f.new_attr::<f32>().shape(1).create("std")?.write(&std)
        });
        if train {
            expect_failure(&base(file.to_str().unwrap(), r), message);
        }
        let info = data_info(&file);
        assert!(!info.ok() && info.all_output().contains(message), "data info {name}: {}", info.all_output());
    }
}

/// Out-of-range SGD settings exited 0 with test losses of 1e10; NaN ended in an unnamed
/// "non-finite loss". Refused before training, naming the flag.
#[test]
fn sgd_settings_out_of_range_are_refused() {
    let dir = scratch("bad-sgd");
    let data = synth(&dir, "sgd", 20, 2, "1x8x8", 2);
    let (d, r) = (data.to_str().unwrap(), dir.join("r"));
    let r = r.to_str().unwrap();
    expect_failure(&with(d, r, &[("--momentum", "1.5")]), "--momentum 1.5: expected 0 <= momentum < 1");
    expect_failure(&with(d, r, &[("--momentum", "NaN")]), "--momentum NaN: expected 0 <= momentum < 1");
    let negative_decay = [&base(d, r)[..], &["--weight-decay=-100"]].concat();
    expect_failure(&negative_decay, "--weight-decay -100: expected a finite weight decay of 0 or more");
    // Beyond f32 (the parameters' type): these ended in "non-finite loss" naming no flag (issue 48).
    expect_failure(&with(d, r, &[("--lr", "1e39")]), "--lr 1e39: beyond the largest f32");
    expect_failure(&with(d, r, &[("--weight-decay", "1e300")]), "--weight-decay 1e300: beyond the largest f32");
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
    expect_failure(&with(d, r, &[("--strategy", "ring"), ("--timeline", t)]), "--timeline is an option of --strategy horovod; --strategy ring writes nothing");
    assert!(!timeline.exists());
    expect_failure(&with(d, r, &[("--strategy", "ring"), ("--compression", "fp16")]), "--compression is an option of --strategy horovod; --strategy ring would ignore it");
    let sync_ps = [&with(d, r, &[("--strategy", "ps"), ("--max-staleness", "3")])[..], &["--ps-colocate"]].concat();
    expect_failure(&sync_ps, "--max-staleness bounds asynchronous parameter servers");
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
    // A stage count that divides no rank count ran nothing and exited 0 (issue 48).
    let args = ["study", "--ranks", "1,2", "--strategies", "ring", "--stages", "3", "--model", "tiny", "--data", d, "--results", r, "--steps", "1", "--no-eval"];
    let run = expect_failure(&args, "--stages 3: divides none of the rank counts of --ranks 1,2");
    assert!(!dir.join("r").join("runs.jsonl").exists(), "{}", run.all_output());
}

/// `--save-weights` pointing at the `--data` file overwrote the dataset.
#[test]
fn an_output_that_is_an_input_is_refused() {
    let dir = scratch("bad-output");
    let data = synth(&dir, "out", 20, 2, "1x8x8", 2);
    let before = std::fs::read(&data).unwrap();
    let (d, r) = (data.to_str().unwrap(), dir.join("r"));
    let r = r.to_str().unwrap();
    // The same file under another spelling.
    let same = dir.join(".").join(data.file_name().unwrap());
    expect_failure(&with(d, r, &[("--save-weights", same.to_str().unwrap())]), "it is the --data file");
    assert_eq!(std::fs::read(&data).unwrap(), before, "the dataset is untouched");
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
/// screens of backtrace; `data info` aborted; the tiny CNN on 1x1 images: a pool2d panic).
#[test]
fn sizes_the_model_cannot_take_are_refused_without_a_panic() {
    let dir = scratch("bad-model-sizes");
    let r = dir.join("r");
    let r = r.to_str().unwrap();
    let huge = dir.join("classes.h5");
    with_attrs(&huge, |f| f.new_attr::<i64>().create("num_classes")?.write_scalar(&1_000_000_000_000i64));
    expect_failure(&base(huge.to_str().unwrap(), r), "in the last layer, for 1000000000000 classes");
    let info = data_info(&huge).expect_ok();
    assert!(info.stdout.contains("classes:     1000000000000") && info.stdout.contains("3 of the 1000000000000 classes present"), "{}", info.stdout);

    let pixel = dir.join("pixel.h5");
    write_h5(&pixel, |f| {
        for (split, n) in [("train", 10), ("test", 4)] {
            let g = f.create_group(split)?;
            g.new_dataset::<u8>().shape([n, 1, 1, 1]).create("images")?;
            let labels: Vec<i64> = (0..n as i64).map(|i| i % 3).collect();
            g.new_dataset_builder().with_data(&labels).create("labels")?;
        }
        Ok(())
    });
    expect_failure(&base(pixel.to_str().unwrap(), r), "needs images of at least 2x2 pixels, not 1x1");
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
