//! Run files end to end (issue 66): a run from a `--config` file, and one from the `config` a
//! runs.jsonl record holds, end with the same weights as the run of the same flags. Parsing,
//! refusals and `--print-config` are unit tests (src/config.rs); this is the one check that
//! needs runs.

mod common;

use common::*;

#[test]
fn a_run_file_and_a_records_config_train_to_the_same_weights_as_the_flags() {
    let dir = scratch("run-file");
    for sub in ["flags", "file", "rerun"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    let flags = ["--model", "tiny", "--data", "synthetic:3x16x16:10:128", "--batch-size", "4", "--steps", "3", "--no-eval", "--lr", "0.1", "--seed", "11", "--momentum", "0.5"];
    let by_flags = train_saving_weights(&dir.join("flags"), "w", 2, &flags);

    let file = dir.join("run.toml");
    std::fs::write(&file, "[data]\ndata = \"synthetic:3x16x16:10:128\"\nbatch_size = 4\nsteps = 3\nno_eval = true\n\n[model]\nmodel = \"tiny\"\nlr = 0.1\nmomentum = 0.5\n\n[run]\nseed = 11\n").unwrap();
    let by_file = train_saving_weights(&dir.join("file"), "w", 2, &["--config", file.to_str().unwrap()]);
    assert_eq!(read_weights(&by_flags), read_weights(&by_file), "a run file and the same flags");

    // The record holds the resolved options and the command line; its `config` re-runs it (the
    // output paths given on the command line win over the record's).
    let records = read_runs(&dir.join("flags"));
    let record = records.last().unwrap();
    let argv: Vec<&str> = record["argv"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert!(argv.windows(2).any(|w| w == ["--momentum", "0.5"]), "{argv:?}");
    let config = toml::to_string(&record["config"]).unwrap();
    assert!(config.contains("[model]") && config.contains("momentum = 0.5"), "{config}");
    let from_record = dir.join("record.toml");
    std::fs::write(&from_record, &config).unwrap();
    let rerun = train_saving_weights(&dir.join("rerun"), "w", 2, &["--config", from_record.to_str().unwrap()]);
    assert_eq!(read_weights(&by_flags), read_weights(&rerun), "a record's config");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `hpc-train` alone prints how to train and trains nothing (it started a five-epoch ResNet-50
/// run); `train` is the same as no subcommand.
#[test]
fn no_arguments_print_the_usage_and_train_nothing() {
    let run = hpc_train(&[]);
    assert_eq!(run.status, Some(2), "{}", run.all_output());
    assert!(run.stderr.starts_with("Usage: hpc-train [train] [OPTIONS]") && run.stderr.contains("study"), "{}", run.stderr);
    assert!(run.elapsed < std::time::Duration::from_secs(10) && run.stdout.is_empty() && !run.stderr.contains("images/s"), "{}", run.all_output());
    let run = hpc_train(&["train", "--steps", "2", "--print-config"]).expect_ok();
    assert!(run.stdout.contains("steps = 2"), "{}", run.stdout);
    // A combination a run would refuse is refused by --print-config too, naming the file's key.
    let dir = scratch("run-file-refused");
    let file = dir.join("ps-zero3.toml");
    std::fs::write(&file, "[exchange]\nstrategy = \"ps\"\n\n[sharding]\nzero = 3\n").unwrap();
    let run = hpc_train(&["--config", file.to_str().unwrap(), "--model", "tiny", "--print-config"]);
    let errors: Vec<&str> = run.stderr.lines().filter(|l| l.starts_with("error: ")).collect();
    assert!(run.status == Some(2) && run.stdout.is_empty() && errors.len() == 1, "{}", run.all_output());
    assert!(errors[0].contains("--strategy ps with --zero 3") && errors[0].contains(&format!("(key `strategy` of {})", file.display())), "{}", errors[0]);
}
