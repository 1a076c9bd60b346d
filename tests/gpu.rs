//! The GPU path: runs where CUDA is present and says it skipped otherwise.

mod common;

use std::path::Path;

use common::*;

fn gpu_present() -> bool {
    Path::new("/dev/nvidia0").exists() || Path::new("/dev/nvidiactl").exists()
}

#[test]
fn gpu_training_matches_the_cpu_and_every_precision_runs() {
    if !gpu_present() {
        eprintln!("skipped: no GPU on this machine (device selection, staging, precision and channels-last on CUDA need one)");
        return;
    }
    let dir = scratch("gpu");
    let data = synth(&dir, "gpu", 96, 24, "3x32x32", 5);
    let d = data.to_str().unwrap();
    let r = dir.to_str().unwrap();
    let run = |name: &str, ranks: usize, extra: &[&str]| {
        let out = dir.join(format!("{name}.safetensors"));
        let mut args = vec!["--model", "tiny", "--data", d, "--scaling", "strong", "--global-batch", "12", "--steps", "6", "--results", r, "--save-weights", out.to_str().unwrap(), "--allow-gpu-sharing"];
        args.extend(extra);
        mpirun(ranks, &args).expect_ok();
        out
    };
    let cpu = run("cpu", 2, &["--device", "cpu", "--strategy", "allreduce"]);
    for strategy in ["allreduce", "ring", "horovod", "ps"] {
        for aware in ["no", "auto"] {
            let gpu = run(&format!("gpu-{strategy}-{aware}"), 2, &["--device", "cuda", "--precision", "fp32", "--strategy", strategy, "--cuda-aware", aware]);
            let diff = max_relative_difference(&cpu, &gpu);
            assert!(diff < 1e-4, "{strategy} (cuda-aware {aware}) on the GPU differs from the CPU by {diff:e}");
        }
    }
    // ZeRO on the GPU: the bucket buffer on the host with a device copy of the shard (staged),
    // or on the device (CUDA-aware); overlap on and off.
    for zero in ["1", "2"] {
        for (aware, overlap) in [("no", "on"), ("no", "off"), ("auto", "on")] {
            let name = format!("gpu-zero{zero}-{aware}-{overlap}");
            let gpu = run(&name, 2, &["--device", "cuda", "--precision", "fp32", "--strategy", "ring", "--zero", zero, "--cuda-aware", aware, "--overlap", overlap, "--bucket-mb", "0.01"]);
            let diff = max_relative_difference(&cpu, &gpu);
            assert!(diff < 1e-4, "{name} differs from the CPU by {diff:e}");
        }
    }
    for precision in ["tf32", "bf16", "fp16"] {
        run(&format!("p-{precision}"), 2, &["--device", "cuda", "--precision", precision, "--channels-last", "--strategy", "ring"]);
    }
    // Without --allow-gpu-sharing, more ranks than GPUs on a node is a clear error.
    let gpus = std::process::Command::new("nvidia-smi").args(["-L"]).output().map(|o| String::from_utf8_lossy(&o.stdout).lines().count()).unwrap_or(1);
    let ranks = gpus + 1;
    let refused = mpirun(ranks, &["--model", "tiny", "--data", d, "--steps", "1", "--batch-size", "2", "--device", "cuda", "--results", r]);
    assert!(!refused.ok());
    assert!(refused.all_output().contains("--allow-gpu-sharing"), "{}", refused.all_output());
}

/// The review's GPU defects (issue 13): the staged copies (1), the rank's GPU made current (2)
/// and 16-bit reductions, which MPI runs as host functions, on a CUDA-aware MPI (3).
#[test]
fn staged_copies_current_device_and_sixteen_bit_sums_on_the_gpu() {
    if !gpu_present() {
        eprintln!("skipped: no GPU on this machine (the staged copies, the current device and 16-bit sums of GPU buffers need one)");
        return;
    }
    let dir = scratch("gpu-review");
    let r = dir.to_str().unwrap();
    let bench = |extra: &[&str]| {
        let mut args = vec!["bench", "--device", "cuda", "--counts", "0,1,3,1001,262147", "--iters", "2", "--warmup", "1", "--verify", "allreduce", "--results", r];
        args.extend(extra);
        let run = mpirun_env(2, &args, &[("RUST_LOG", "debug")], std::time::Duration::from_secs(300));
        assert!(run.ok(), "{extra:?}:\n{}", run.all_output());
        for row in run.stdout.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
            assert_eq!(row.split_whitespace().last(), Some("0"), "{extra:?}: {row}");
        }
        run
    };
    for aware in ["no", "auto"] {
        // (1) and (3): every strategy and dtype, through the staged path and, where MPI is
        // CUDA-aware, the direct one (16-bit sums then still go through the host).
        for dtype in ["f32", "f16", "bf16"] {
            let strategies = if dtype == "f32" { "ring,allreduce,horovod,ps" } else { "ring,allreduce,horovod" };
            let run = bench(&["--strategies", strategies, "--dtype", dtype, "--cuda-aware", aware]);
            // (2) every rank's MPI thread has its GPU current.
            assert_eq!(run.stderr.matches("is the current device of the MPI thread").count(), 2, "{}", run.stderr);
        }
        for compression in ["fp16", "bf16"] {
            bench(&["--strategies", "horovod", "--compression", compression, "--layout", "resnet50", "--cuda-aware", aware, "--verify", "closed-form"]);
            bench(&["--strategies", "horovod", "--compression", compression, "--hierarchical", "--cuda-aware", aware, "--verify", "closed-form"]);
        }
    }
}

/// Issue 31, item 1: whether ranks share a GPU is decided by the GPUs' identities, not by
/// counting: under `srun --gpus-per-task=1` (or a per-rank CUDA_VISIBLE_DEVICES) each rank sees
/// one GPU, its own, and must start without --allow-gpu-sharing; ranks that would really share
/// one are refused once, by name. The GPUs are simulated (HPC_TRAIN_SIMULATE_GPUS: the node's
/// GPU identities, masked by each rank's CUDA_VISIBLE_DEVICES as CUDA does; training then runs
/// on the CPU), so this runs on every machine.
#[test]
fn gpu_sharing_is_decided_by_the_gpus_identities() {
    let dir = scratch("gpu-identity");
    let data = synth(&dir, "gpu-identity", 64, 0, "1x8x8", 2);
    let (d, r) = (data.to_str().unwrap(), dir.to_str().unwrap());
    let per_rank = dir.join("one-gpu-per-rank.sh");
    std::fs::write(&per_rank, "#!/bin/sh\n# As srun --gpus-per-task=1 leaves a rank: its own GPU, seen as index 0.\nexport CUDA_VISIBLE_DEVICES=\"$OMPI_COMM_WORLD_LOCAL_RANK\"\nexec \"$@\"\n").unwrap();
    std::fs::set_permissions(&per_rank, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let plain = dir.join("as-launched.sh");
    std::fs::write(&plain, "#!/bin/sh\nexec \"$@\"\n").unwrap();
    std::fs::set_permissions(&plain, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let four = "GPU-a,GPU-b,GPU-c,GPU-d";
    let train = |wrapper: &Path, ranks: usize, gpus: &str, extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["--model", "tiny", "--data", d, "--batch-size", "4", "--steps", "1", "--no-eval", "--results", r];
        args.extend(extra);
        let mut all_env = vec![("HPC_TRAIN_SIMULATE_GPUS", gpus)];
        all_env.extend(env);
        mpirun_wrapped(ranks, wrapper, &args, &all_env, std::time::Duration::from_secs(120))
    };
    let refusal = "would share GPU";
    // One GPU per rank through the mask: 4 ranks, 4 GPUs, each rank sees one.
    let run = train(&per_rank, 4, four, &[], &[]);
    assert!(run.ok(), "ranks bound to one GPU each were refused:\n{}", run.all_output());
    // Every rank sees every GPU: each takes its own.
    let run = train(&plain, 4, four, &[], &[]);
    assert!(run.ok(), "{}", run.all_output());
    // 4 ranks for 2 GPUs: refused once, naming the GPU and the flag; accepted with the flag.
    let run = train(&plain, 4, "GPU-a,GPU-b", &[], &[]);
    assert!(!run.ok() && !run.timed_out, "{}", run.all_output());
    assert_eq!(run.all_output().matches(refusal).count(), 1, "{}", run.all_output());
    assert!(run.all_output().contains("--allow-gpu-sharing"), "{}", run.all_output());
    let run = train(&plain, 4, "GPU-a,GPU-b", &["--allow-gpu-sharing"], &[]);
    assert!(run.ok(), "{}", run.all_output());
    // Every rank masked to the same GPU: they would share it.
    let run = train(&plain, 2, four, &[], &[("CUDA_VISIBLE_DEVICES", "2")]);
    assert!(!run.ok() && run.all_output().contains("would share GPU GPU-c"), "{}", run.all_output());
    // --device cpu asks nothing of the GPUs.
    let run = train(&plain, 4, "GPU-a", &["--device", "cpu"], &[]);
    assert!(run.ok(), "{}", run.all_output());
}
