//! `--preset cpu-trial` trains on generated data with no file, and its record names the preset
//! and the measured steps the preset's length asks for (here shortened by the command line).

mod common;

use common::*;

#[test]
fn a_preset_run_measures_the_steps_it_asks_for() {
    let dir = scratch("preset");
    let run = mpirun(2, &[
        "--preset", "cpu-trial", "--strategy", "allreduce", "--batch-size", "4", "--warmup-steps", "2", "--measured-steps", "3",
        "--threads", "1", "--overlap", "off", "--results", dir.to_str().unwrap(),
    ])
    .expect_ok();
    let runs = read_runs(&dir);
    assert_eq!(runs.len(), 1, "{}", run.all_output());
    let r = &runs[0];
    assert_eq!((r["model"].as_str(), r["dataset"].as_str(), r["image_shape"].clone()), (Some("tiny"), Some("synthetic-3x32x32"), serde_json::json!([3, 32, 32])), "{r}");
    assert_eq!((r["steps"].as_u64(), r["extra"]["warmup_steps"].as_u64(), r["extra"]["measured_steps"].as_u64()), (Some(5), Some(2), Some(3)), "{r}");
    assert_eq!(r["extra"]["preset"], "cpu-trial");
    assert!(r["test_accuracy"].is_null(), "generated data has no test split: nothing evaluated");
    assert!(r["images_per_sec"].as_f64().unwrap() > 0.0);
    std::fs::remove_dir_all(&dir).unwrap();
}
