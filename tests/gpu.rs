//! The GPU path: runs where CUDA is present and says it skipped otherwise.

mod common;

use std::path::Path;

use common::*;

fn gpu_present() -> bool {
    Path::new("/dev/nvidia0").exists() || Path::new("/dev/nvidiactl").exists()
}

/// One test's runs on the GPU: a scratch folder, a small synthetic dataset, and every run's
/// stderr (checked for per-step warnings when the test ends). The tests below are independent, so
/// that the harness runs them side by side (ranks of several tests share the GPU, which is what
/// `--allow-gpu-sharing` allows).
struct GpuRuns {
    dir: std::path::PathBuf,
    data: std::path::PathBuf,
    logs: std::cell::RefCell<String>,
}

impl GpuRuns {
    fn new(name: &str) -> GpuRuns {
        let dir = scratch(name);
        let data = synth(&dir, name, 96, 24, "3x32x32", 5);
        GpuRuns { dir, data, logs: Default::default() }
    }

    /// Trains `model` on `ranks` ranks for 6 steps of a global batch of 12 and returns the path of
    /// its final weights.
    fn run_model(&self, name: &str, ranks: usize, model: &str, extra: &[&str]) -> std::path::PathBuf {
        self.run_model_logged(name, ranks, model, extra).0
    }

    /// As `run_model`, with the run's stderr.
    fn run_model_logged(&self, name: &str, ranks: usize, model: &str, extra: &[&str]) -> (std::path::PathBuf, String) {
        let out = self.dir.join(format!("{name}.safetensors"));
        let (d, r) = (self.data.to_str().unwrap(), self.dir.to_str().unwrap());
        let mut args = vec!["--model", model, "--data", d, "--scaling", "strong", "--global-batch", "12", "--steps", "6", "--results", r, "--save-weights", out.to_str().unwrap(), "--allow-gpu-sharing"];
        args.extend(extra);
        let done = mpirun(ranks, &args).expect_ok();
        self.logs.borrow_mut().push_str(&done.stderr);
        (out, done.stderr)
    }

    fn run(&self, name: &str, ranks: usize, extra: &[&str]) -> std::path::PathBuf {
        self.run_model(name, ranks, "tiny", extra)
    }

    /// Two ranks' data-parallel run on the CPU with MPI_Allreduce: the weights GPU runs match.
    fn cpu_reference(&self) -> std::path::PathBuf {
        self.run("cpu", 2, &["--device", "cpu", "--strategy", "allreduce"])
    }

    fn assert_matches(&self, reference: &Path, name: &str, got: &Path) {
        let diff = max_relative_difference(reference, got);
        assert!(diff < 1e-4, "{name} on the GPU differs from the CPU by {diff:e}");
    }
}

impl Drop for GpuRuns {
    /// No warning per step: deprecated autocast or pin_memory calls warn on every call.
    fn drop(&mut self) {
        let logs = self.logs.borrow();
        if !std::thread::panicking() {
            assert!(!logs.contains("deprecated"), "deprecation warnings in the runs' logs:\n{logs}");
        }
    }
}

macro_rules! needs_gpu {
    ($what:expr) => {
        if !gpu_present() {
            eprintln!("skipped: no GPU on this machine ({} on CUDA needs one)", $what);
            return;
        }
    };
}

#[test]
fn every_strategy_on_the_gpu_matches_the_cpu() {
    needs_gpu!("every strategy's device code");
    let gpu = GpuRuns::new("gpu-strategies");
    let cpu = gpu.cpu_reference();
    // Every strategy's device code (rhd and auto included), staged and, where MPI is
    // CUDA-aware, direct; the weights start from the CPU's (initialised there, then moved).
    for strategy in ["allreduce", "ring", "rhd", "auto", "horovod", "ps"] {
        for aware in ["no", "auto"] {
            let name = format!("gpu-{strategy}-{aware}");
            let got = gpu.run(&name, 2, &["--device", "cuda", "--precision", "fp32", "--strategy", strategy, "--cuda-aware", aware]);
            gpu.assert_matches(&cpu, &name, &got);
        }
    }
}

#[test]
fn overlap_on_the_gpu_matches_the_cpu() {
    needs_gpu!("overlap with backward");
    let gpu = GpuRuns::new("gpu-overlap");
    let cpu = gpu.cpu_reference();
    // Plain overlap with several buckets: the communication stream waits on each bucket's
    // hook event, the finiteness check is read once per step.
    for strategy in ["allreduce", "ring", "rhd", "auto", "horovod"] {
        for aware in ["no", "auto"] {
            let name = format!("gpu-overlap-{strategy}-{aware}");
            let got = gpu.run(&name, 2, &["--device", "cuda", "--precision", "fp32", "--strategy", strategy, "--cuda-aware", aware, "--overlap", "on", "--bucket-mb", "0.01"]);
            gpu.assert_matches(&cpu, &name, &got);
        }
    }
}

#[test]
fn zero_on_the_gpu_matches_the_cpu() {
    needs_gpu!("ZeRO's device buffers");
    let gpu = GpuRuns::new("gpu-zero");
    let cpu = gpu.cpu_reference();
    // ZeRO on the GPU: the bucket buffer on the device with a pinned host mirror (staged), or
    // on the device alone (CUDA-aware); overlap on and off.
    for zero in ["1", "2"] {
        for (aware, overlap) in [("no", "on"), ("no", "off"), ("auto", "on")] {
            let name = format!("gpu-zero{zero}-{aware}-{overlap}");
            let got = gpu.run(&name, 2, &["--device", "cuda", "--precision", "fp32", "--strategy", "ring", "--zero", zero, "--cuda-aware", aware, "--overlap", overlap, "--bucket-mb", "0.01"]);
            gpu.assert_matches(&cpu, &name, &got);
        }
    }
    // Fully sharded (issue 37): units gathered into device buffers (staged through the host,
    // or CUDA-aware), the compute thread on the rank's GPU, prefetch on and off; bf16 autocast
    // on the compute thread.
    for (aware, overlap) in [("no", "on"), ("no", "off"), ("auto", "on")] {
        let name = format!("gpu-zero3-{aware}-{overlap}");
        let got = gpu.run(&name, 2, &["--device", "cuda", "--precision", "fp32", "--strategy", "ring", "--zero", "3", "--cuda-aware", aware, "--overlap", overlap]);
        gpu.assert_matches(&cpu, &name, &got);
    }
    gpu.run("gpu-zero3-bf16", 2, &["--device", "cuda", "--precision", "bf16", "--strategy", "ring", "--zero", "3"]);
}

#[test]
fn pipelines_on_the_gpu_match_the_cpu() {
    needs_gpu!("pipeline stages' activations");
    let gpu = GpuRuns::new("gpu-pipeline");
    // Pipelines on the GPU (issue 36): activations staged through the host or sent from
    // device memory (CUDA-aware), 2 stages alone and 2 x 2 with the ring, and 2 x 2 at
    // --zero 3 (each stage gathered on the device once per step: issue 68); against the CPU
    // accumulating the same micro-batches.
    let cpu_micro = gpu.run("cpu-micro", 1, &["--device", "cpu", "--micro-batches", "3"]);
    let d2p2 = ["--pipeline-stages", "2", "--micro-batches", "3", "--schedule", "gpipe", "--strategy", "ring"];
    let layouts: [(&str, usize, Vec<&str>); 3] = [
        ("2", 2, vec!["--pipeline-stages", "2", "--micro-batches", "3", "--schedule", "1f1b"]),
        ("4", 4, d2p2.to_vec()),
        ("4-zero3", 4, [&d2p2[..], &["--zero", "3"]].concat()),
    ];
    for aware in ["no", "auto"] {
        for (what, ranks, layout) in &layouts {
            let mut extra = vec!["--device", "cuda", "--precision", "fp32", "--cuda-aware", aware, "--partition", "params"];
            extra.extend(layout);
            let name = format!("gpu-pipeline-{what}-{aware}");
            let got = gpu.run(&name, *ranks, &extra);
            gpu.assert_matches(&cpu_micro, &name, &got);
        }
    }
}

/// The bundle's CUDA-aware Open MPI (scripts/pack.sh writes env-cuda.sh beside the bundle where
/// scripts/build-cuda-mpi.sh built one): `HPC_TRAIN_CUDA_MPI_ENV` (scripts/device-check.sh sets
/// it), else the default bundle's; None where there is none.
fn cuda_aware_mpi_env() -> Option<std::path::PathBuf> {
    std::env::var_os("HPC_TRAIN_CUDA_MPI_ENV")
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| Some(root().join("dist/hpc-train/env-cuda.sh")))
        .filter(|p| p.is_file())
}

/// `ranks` ranks of hpc-train with `args` under the CUDA-aware Open MPI that `env_file` selects,
/// over CUDA IPC between the ranks (as scripts/device-check.sh runs it).
fn mpirun_cuda_aware(env_file: &Path, ranks: usize, args: &[&str]) -> Run {
    let plain = launcher::command(ranks);
    let mut cmd = std::process::Command::new("bash");
    cmd.args(["-c", r#"source "$0" && exec "$@""#]).arg(env_file).arg(plain.get_program()).args(plain.get_args());
    cmd.args(["--mca", "pml", "ob1", "--mca", "btl", "smcuda,vader,self"]).arg(bin()).args(args).current_dir(root());
    for (k, v) in plain.get_envs() {
        if let Some(v) = v {
            cmd.env(k, v);
        }
    }
    run_with_limit(cmd, std::time::Duration::from_secs(300))
}

/// A pipeline's device receives (CUDA-aware MPI) against the same pipeline staged through the
/// host: the same weights. A receive buffer fresh from libtorch's caching allocator may be
/// memory that kernels queued on the stream still read or write, and MPI writes it outside
/// every stream, so a receive is posted only once the stream has caught up
/// (src/raw/messages.rs). The races it prevents come where a receive follows a compute action
/// without a send (whose own wait for the stream hid them): 1F1B's first stage after a
/// backward, the last stage after the loss's forward, every W of ZB-H1. ResNet-18 in fp32 on
/// 224x224 images keeps each kernel on the GPU longer than the host takes to launch it, so
/// that the host runs ahead of the stream, with M = 4 micro-batches of 8. Both runs compute
/// the same kernels on the same GPU from the same bytes: only a kernel's own summation order
/// (cuDNN's atomics) may differ, far below the tolerance, while a receive racing a kernel puts
/// another tensor's values into a gradient.
#[test]
fn cuda_aware_pipeline_receives_match_staged_ones() {
    needs_gpu!("a pipeline's device receives");
    let Some(env_file) = cuda_aware_mpi_env() else {
        eprintln!("skipped: no CUDA-aware MPI in the bundle (scripts/build-cuda-mpi.sh, then scripts/pack.sh) for a pipeline's device receives");
        return;
    };
    let gpu = GpuRuns::new("gpu-pipeline-receives");
    let data = synth(&gpu.dir, "resnet-224", 64, 0, "3x224x224", 10);
    let (d, r) = (data.to_str().unwrap(), gpu.dir.to_str().unwrap());
    for schedule in ["1f1b", "zb-h1"] {
        let weights = |path: &str| gpu.dir.join(format!("{schedule}-{path}.safetensors"));
        let (staged, direct) = (weights("staged"), weights("cuda-aware"));
        let args = |aware: &str, out: &Path| -> Vec<String> {
            [
                "--model", "resnet18", "--data", d, "--scaling", "strong", "--global-batch", "32", "--steps", "4", "--lr", "0.05", "--no-eval",
                "--device", "cuda", "--precision", "fp32", "--pipeline-stages", "2", "--micro-batches", "4", "--schedule", schedule,
                "--partition", "params", "--allow-gpu-sharing", "--results", r, "--cuda-aware", aware, "--save-weights", out.to_str().unwrap(),
            ]
            .map(String::from)
            .to_vec()
        };
        let staged_args = args("no", &staged);
        let run = mpirun(2, &staged_args.iter().map(String::as_str).collect::<Vec<_>>()).expect_ok();
        gpu.logs.borrow_mut().push_str(&run.stderr);
        let direct_args = args("yes", &direct);
        let run = mpirun_cuda_aware(&env_file, 2, &direct_args.iter().map(String::as_str).collect::<Vec<_>>()).expect_ok();
        gpu.logs.borrow_mut().push_str(&run.stderr);
        let records = read_runs(&gpu.dir);
        let aware: Vec<bool> = records.iter().rev().take(2).map(|record| record["cuda_aware"].as_bool().unwrap()).collect();
        assert_eq!(aware, vec![true, false], "{schedule}: the second run sent from device memory, the first through the host");
        let diff = max_relative_difference(&staged, &direct);
        assert!(diff < 1e-4, "{schedule}: CUDA-aware receives gave weights {diff:e} from the staged run's");
    }
}

#[test]
fn tensor_parallelism_on_the_gpu_matches_the_cpu() {
    needs_gpu!("tensor parallelism's operators");
    let gpu = GpuRuns::new("gpu-tensor");
    // Tensor parallelism (issue 38): vit-tiny's encoder layers over 2 ranks sharing the GPU,
    // the groups' all-reduce staged or CUDA-aware and called from libtorch's device thread in
    // backward (MPI_THREAD_MULTIPLE); alone, beside data parallelism and in 2 pipeline stages,
    // against one CPU rank; bf16 autocast through the operators.
    let cpu_vit = gpu.run_model("cpu-vit", 1, "vit-tiny", &["--device", "cpu"]);
    for aware in ["no", "auto"] {
        for (ranks, layout) in [
            (2, &["--tensor-parallel", "2"][..]),
            (4, &["--tensor-parallel", "2", "--strategy", "ring"][..]),
            (4, &["--tensor-parallel", "2", "--pipeline-stages", "2", "--micro-batches", "3", "--partition", "params"][..]),
        ] {
            let mut extra = vec!["--device", "cuda", "--precision", "fp32", "--cuda-aware", aware];
            extra.extend(layout);
            let name = format!("gpu-tensor-{ranks}-{}-{aware}", layout.len());
            let got = gpu.run_model(&name, ranks, "vit-tiny", &extra);
            gpu.assert_matches(&cpu_vit, &name, &got);
        }
    }
    gpu.run_model("gpu-tensor-bf16", 2, "vit-tiny", &["--device", "cuda", "--precision", "bf16", "--tensor-parallel", "2"]);
}

#[test]
fn every_precision_runs_and_ranks_share_a_gpu_only_when_allowed() {
    needs_gpu!("device selection, precision and channels-last");
    let gpu = GpuRuns::new("gpu-precision");
    // Each precision trains to weights near fp32's; bf16 and fp16 really ran in 16 bits (their
    // weights are not fp32's).
    let fp32 = gpu.run("p-fp32", 2, &["--device", "cuda", "--precision", "fp32", "--channels-last", "--strategy", "ring"]);
    for (precision, tolerance) in [("tf32", 1e-2), ("bf16", 5e-2), ("fp16", 5e-2)] {
        let (got, log) = gpu.run_model_logged(&format!("p-{precision}"), 2, "tiny", &["--device", "cuda", "--precision", precision, "--channels-last", "--strategy", "ring"]);
        let diff = max_relative_difference(&fp32, &got);
        if precision != "tf32" {
            assert!(diff > 0.0, "{precision} gave fp32's weights bit for bit: autocast did not run");
        }
        // fp16's loss scaler starts at 2^16, as torch.amp.GradScaler does: where the scaled
        // gradients overflow, the step is skipped and the scale halves (on the H200, 2026-11-26,
        // the tiny CNN's first steps overflowed and the weights ended 0.15 from fp32's). Skipped
        // steps are steps fp32 took, so the weights are compared only when none was skipped.
        let skipped = log.matches("gradients overflowed").count();
        if precision == "fp16" && skipped > 0 {
            assert!(skipped <= 4, "fp16 skipped {skipped} of 6 steps:\n{log}");
            let scale = 65536.0 / 2f64.powi(skipped as i32);
            assert!(log.contains(&format!("loss scale now {scale}")), "fp16 skipped {skipped} steps, but the scale did not halve as often:\n{log}");
            eprintln!("fp16: {skipped} step(s) skipped on overflow (scale now {scale}); weights {diff:e} from fp32's, not compared");
            continue;
        }
        assert!(diff < tolerance, "{precision} differs from fp32 by {diff:e} ({skipped} steps skipped on overflow)");
    }
    // Without --allow-gpu-sharing, more ranks than GPUs on a node is a clear error.
    let gpus = std::process::Command::new("nvidia-smi").args(["-L"]).output().map(|o| String::from_utf8_lossy(&o.stdout).lines().count()).unwrap_or(1);
    let ranks = gpus + 1;
    let (d, r) = (gpu.data.to_str().unwrap(), gpu.dir.to_str().unwrap());
    let refused = mpirun(ranks, &["--model", "tiny", "--data", d, "--steps", "1", "--batch-size", "2", "--device", "cuda", "--results", r]);
    assert!(!refused.ok());
    assert!(refused.all_output().contains("--allow-gpu-sharing"), "{}", refused.all_output());
}

/// What a GPU step does apart from the exchange, each against the same run on the CPU: one
/// rank alone (its exchange returns at once), AdamW (libtorch's fused kernel on CUDA, as SGD's),
/// and a run stopped at a checkpoint and resumed (the weights' finite check before the write
/// reads parameters that autograd tracks; the loader's pinned batches resume at the step after).
#[test]
fn one_rank_adamw_and_a_resumed_run_on_the_gpu_match_the_cpu() {
    needs_gpu!("one rank, AdamW and checkpoints");
    let gpu = GpuRuns::new("gpu-step");
    for ranks in [1, 2] {
        let cpu = gpu.run(&format!("one-cpu-{ranks}"), ranks, &["--device", "cpu", "--strategy", "ring"]);
        let cuda = gpu.run(&format!("one-gpu-{ranks}"), ranks, &["--device", "cuda", "--strategy", "ring"]);
        gpu.assert_matches(&cpu, &format!("ring on {ranks} rank(s)"), &cuda);
    }
    let adamw = ["--optimizer", "adamw", "--lr", "0.001", "--strategy", "ring"];
    let cpu = gpu.run("adamw-cpu", 2, &[&adamw[..], &["--device", "cpu"]].concat());
    let cuda = gpu.run("adamw-gpu", 2, &[&adamw[..], &["--device", "cuda"]].concat());
    gpu.assert_matches(&cpu, "AdamW", &cuda);
    // 6 steps with checkpoints at 3 and 6; without the one at 6 the resumed run takes steps 4-6
    // again, from the checkpoint at 3, and ends with the whole run's weights.
    let checkpoints = gpu.dir.join("checkpoints");
    let every = ["--device", "cuda", "--strategy", "ring", "--checkpoint-dir", checkpoints.to_str().unwrap(), "--checkpoint-every", "3"];
    let whole = gpu.run("resume-whole", 2, &every);
    assert_eq!(checkpoint_steps(&checkpoints), vec![3, 6]);
    std::fs::remove_dir_all(checkpoints.join("ckpt-000000000006")).unwrap();
    let resumed = gpu.run("resume-rest", 2, &[&every[..], &["--resume"]].concat());
    gpu.assert_matches(&whole, "a run resumed from its step-3 checkpoint", &resumed);
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
        let mut args = vec!["bench", "--device", "cuda", "--counts", "0,1,3,1001,262147", "--iters", "2", "--warmup", "1", "--results", r];
        if !extra.contains(&"--verify") {
            args.extend(["--verify", "allreduce"]);
        }
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
    let local_rank = launcher::local_rank_variable();
    std::fs::write(&per_rank, format!("#!/bin/sh\n# As srun --gpus-per-task=1 leaves a rank: its own GPU, seen as index 0.\nexport CUDA_VISIBLE_DEVICES=\"${local_rank}\"\nexec \"$@\"\n")).unwrap();
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
