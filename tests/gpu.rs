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
