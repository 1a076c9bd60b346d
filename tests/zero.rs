//! ZeRO (`--zero 1|2`) on the ring: the weights of MPI_Allreduce, with overlap on and off, for
//! rank counts whose shards split tensors, are uneven or empty; across a resume with another
//! rank count and another stage; the memory figures in runs.jsonl; refusals.

mod common;

use std::path::{Path, PathBuf};

use common::*;

/// Tiny model on 3 classes: its tensors have 144, 16, 4608, 32, 96 and 3 elements.
fn dataset(dir: &Path) -> PathBuf {
    synth(dir, "zero", 300, 0, "1x12x12", 3)
}

fn args<'a>(data: &'a str, steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "--model", "tiny", "--data", data, "--scaling", "strong", "--global-batch", "60", "--steps", steps,
        "--no-eval", "--threads", "1", "--log-every", "1000", "--weight-decay", "0.01",
    ];
    a.extend(extra);
    a
}

/// Every stage, with overlap on and off, ends with the weights MPI_Allreduce gives, at 1, 2, 3
/// and 5 ranks. Buckets of about 512 elements put several tensors in a bucket and cut shards
/// through them; at 5 ranks, one tensor per bucket gives the 3-element bias a bucket with more
/// ranks than elements (two ranks own nothing of it). Recursive halving shards at 1, 2 and 4
/// ranks; auto at every count (the ring where halving cannot balance the shards).
#[test]
fn every_stage_trains_to_the_weights_of_allreduce() {
    let dir = scratch("zero-equal");
    let data = dataset(&dir);
    let d = data.to_str().unwrap();
    let (mut runs, mut compared) = (Runs::new(&dir), Vec::new());
    // MPICH's run at 2 and 3 ranks (a power of two for rhd, an uneven split, the record's
    // figures); Open MPI's at every count, per-tensor buckets at 5 (common::launcher::every_row).
    for ranks in launcher::rows_under_mpich(&[1, 2, 3, 4, 5], |r| r == 2 || r == 3) {
        let reference = runs.add(&format!("allreduce-{ranks}"), ranks, &args(d, "6", &["--strategy", "allreduce", "--overlap", "off"]));
        let mut cases: Vec<(String, Vec<&str>)> = Vec::new();
        for overlap in ["off", "on"] {
            for zero in ["0", "1", "2"] {
                if ranks != 4 {
                    cases.push((format!("ring-z{zero}-overlap-{overlap}-{ranks}"), vec!["--strategy", "ring", "--overlap", overlap, "--zero", zero, "--bucket-mb", "0.002"]));
                }
            }
        }
        if ranks == 5 {
            for zero in ["1", "2"] {
                cases.push((format!("ring-z{zero}-per-tensor-{ranks}"), vec!["--strategy", "ring", "--overlap", "on", "--zero", zero, "--bucket-mb", "0"]));
            }
        }
        if ranks.is_power_of_two() {
            cases.push((format!("rhd-z2-{ranks}"), vec!["--strategy", "rhd", "--overlap", "on", "--zero", "2", "--bucket-mb", "0.002"]));
        }
        cases.push((format!("auto-z1-{ranks}"), vec!["--strategy", "auto", "--overlap", "off", "--zero", "1", "--bucket-mb", "0.002"]));
        for (name, extra) in cases {
            let mut a = args(d, "6", &[]);
            a.extend(extra);
            compared.push((name.clone(), reference.clone(), runs.add(&name, ranks, &a)));
        }
    }
    // Every run in one launch (common::Runs), then the comparisons.
    runs.launch();
    for (name, reference, weights) in compared {
        let diff = max_relative_difference(&reference, &weights);
        assert!(diff < 1e-5, "{name} differs from MPI_Allreduce by {diff:e}");
    }
    // The record says which stage ran and what it held.
    let runs = read_runs(&dir);
    let ring3: Vec<&serde_json::Value> = runs.iter().filter(|r| r["strategy"] == "ring" && r["ranks"] == 3).collect();
    assert_eq!(ring3.len(), 6, "{ring3:#?}");
    for r in ring3 {
        let extra = &r["extra"];
        let (zero, params) = (extra["zero"].as_u64().unwrap(), extra["parameters"].as_u64().unwrap());
        let (state, grads) = (extra["optimizer_state_bytes"].as_u64().unwrap(), extra["gradient_bytes"].as_u64().unwrap());
        let full = 4 * params;
        // Within one element per bucket of a third (the shards' rounding; 10 buckets at most).
        let third = |bytes: u64| bytes.abs_diff(full / 3) <= 4 * 10;
        match zero {
            0 => assert_eq!((state, grads), (full, full), "{r}"),
            // Stage 1 keeps the parameters' gradients; stage 2 lets them go once reduced, and
            // the optimizer takes each shard straight from the bucket buffer.
            1 => assert!(third(state) && grads == full, "{r}"),
            2 => assert!(third(state) && grads == 0, "{r}"),
            other => panic!("zero {other}"),
        }
    }
}

/// Issue 31, item 3: `auto` chooses each bucket's algorithm (the ring or recursive halving,
/// whose shards differ) when ZeRO plans the shards, and keeps it. Here the cost model makes the
/// node-shared ring the cheapest and recursive halving cheaper than the ring over MPI; the
/// window's file system (a tmpfs of 8 KiB) has no room, so the ring falls back to MPI at its
/// first bucket, after the plan was made. Choosing again per call sent that bucket to recursive
/// halving along the ring's shards: weights 1e6 away, exit 0.
#[test]
fn auto_keeps_each_buckets_algorithm_when_the_ring_leaves_shared_memory() {
    if launcher::mpi() == launcher::Mpi::Mpich {
        // MPICH maps its own start-up segments from /dev/shm too, so it cannot start 4 ranks in
        // the 8 KiB that make this test's windows not fit (docs/mpi.md).
        eprintln!("skipped under MPICH: it needs more room in /dev/shm to start than this test leaves");
        return;
    }
    let dir = scratch("zero-auto-fallback");
    let data = dataset(&dir);
    let d = data.to_str().unwrap();
    let reference = train_saving_weights(&dir, "allreduce-4", 4, &args(d, "6", &["--strategy", "allreduce", "--overlap", "off"]));
    let model = dir.join("shared-ring-wins.json");
    let dear = serde_json::json!({ "alpha_s": 1e-3, "beta_s_per_byte": 1e-9 });
    let free = serde_json::json!({ "alpha_s": 0.0, "beta_s_per_byte": 0.0 });
    std::fs::write(&model, serde_json::json!({ "intra": dear, "inter": dear, "shared": free, "gamma_s_per_byte": 1e-10 }).to_string()).unwrap();
    let shm = dir.join("shm");
    let shm_env = [("OMPI_MCA_osc_sm_backing_directory", shm.to_str().unwrap())];
    let results = dir.join("results");
    for zero in ["1", "2"] {
        let out = dir.join(format!("auto-z{zero}.safetensors"));
        let extra = [
            "--strategy", "auto", "--zero", zero, "--overlap", "off", "--bucket-mb", "0.002", "--cost-model", model.to_str().unwrap(),
            "--results", results.to_str().unwrap(), "--save-weights", out.to_str().unwrap(),
        ];
        let run = mpirun_with_tmpfs(4, &args(d, "6", &extra), &shm_env, &shm, "8k", std::time::Duration::from_secs(180));
        assert!(run.ok(), "{}", run.all_output());
        assert!(run.all_output().contains("the ring goes over MPI point-to-point instead"), "the fallback did not happen: {}", run.all_output());
        let diff = max_relative_difference(&reference, &out);
        assert!(diff < 1e-5, "auto with --zero {zero} after the ring's fallback differs from MPI_Allreduce by {diff:e}");
    }
}

/// A checkpoint made with --zero 2 on 3 ranks resumes on 2 ranks with --zero 1, and on 5 ranks
/// with --zero 0, and both end with the weights of an uninterrupted run.
#[test]
fn a_zero_checkpoint_resumes_with_another_rank_count_and_stage() {
    let dir = scratch("zero-resume");
    let data = dataset(&dir);
    let d = data.to_str().unwrap();
    let reference = train_saving_weights(&dir, "uninterrupted", 3, &args(d, "12", &["--strategy", "allreduce"]));
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    train_saving_weights(&dir, "first-half", 3, &args(d, "6", &["--strategy", "ring", "--zero", "2", "--overlap", "on", "--bucket-mb", "0.002", "--checkpoint-dir", c, "--checkpoint-every", "6"]));
    assert_eq!(checkpoint_steps(&ckpt), vec![6]);
    let copy = dir.join("ckpt-copy");
    copy_dir(&ckpt, &copy);
    let cases = [(2, "1", c.to_string()), (5, "0", copy.to_str().unwrap().to_string())];
    for (ranks, zero, from) in &cases {
        let name = format!("resumed-{ranks}-z{zero}");
        let a = args(d, "12", &["--strategy", "ring", "--zero", zero, "--overlap", "off", "--bucket-mb", "0.001", "--checkpoint-dir", from, "--resume"]);
        let weights = train_saving_weights(&dir, &name, *ranks, &a);
        let diff = max_relative_difference(&reference, &weights);
        assert!(diff < 1e-5, "{name} differs from the uninterrupted run by {diff:e}");
    }
    // The resumed zero-1 run wrote its own checkpoint at the end; it resumes again with zero 2.
    let a = args(d, "14", &["--strategy", "ring", "--zero", "2", "--checkpoint-dir", c, "--resume"]);
    train_saving_weights(&dir, "again", 3, &a);
    assert_eq!(checkpoint_steps(&ckpt).last(), Some(&14));
}

/// `--zero` with rhd and pipelines was checked against the world, not the D replicas the
/// exchange runs on (issue 48): 6 ranks in 3 stages are D = 2, a power of two, and train; in 2
/// stages they are D = 3, refused naming the 3 ranks, once, on every rank. (The strategies
/// ZeRO cannot shard with are the compatibility table's, refused in tests/conformance.rs's
/// matrix; rhd's rank counts and `--zero 4` are unit tests in src/train/plan.rs and src/cli.rs.)
#[test]
fn zero_with_rhd_is_checked_against_the_stages_replicas() {
    let dir = scratch("zero-rhd-stages");
    let data = dataset(&dir);
    let (d, r) = (data.to_str().unwrap(), dir.join("r"));
    let r = r.to_str().unwrap();
    let run = |stages: &str| {
        let a = args(d, "2", &["--results", r, "--pipeline-stages", stages, "--micro-batches", "2", "--strategy", "rhd", "--zero", "1"]);
        mpirun_env(6, &a, &[], std::time::Duration::from_secs(120))
    };
    run("3").expect_ok();
    let refused = run("2");
    let out = refused.all_output();
    assert!(!refused.ok(), "{out}");
    assert_eq!(out.matches("--zero 1 with --strategy rhd on 3 ranks").count(), 1, "{out}");
}
