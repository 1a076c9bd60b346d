//! Sharded checkpoints through the real binary (issue 49): the checkpoint that training wrote
//! (2 data-parallel ranks, each writing its share), resharded by `mpirun -n 3 hpc-train
//! checkpoint reshard --layout rows` (tensor-parallel style cuts, small tensors whole on one
//! rank each), resharded again by 2 ranks into flat shards (ZeRO style: each rank reads only the
//! slices it writes, across the first layout's cuts), then `hpc-train checkpoint consolidate`d:
//! the weights and the optimizer state come back equal to the training run's checkpoint
//! consolidated, and the weights load into torchvision's resnet18 with strict=True. A write
//! that cannot complete leaves no partial folder; a damaged part file is refused by name.
//!
//! Then training's own sharded checkpoints at every layout: a run checkpoints at one layout
//! and resumes at another (rank count, D, P, T, ZeRO stage), ending with the uninterrupted
//! run's weights; its last checkpoint consolidated is its `--save-weights` file.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

fn newest(root: &Path) -> std::path::PathBuf {
    let step = *checkpoint_steps(root).last().unwrap_or_else(|| panic!("no checkpoint in {}", root.display()));
    root.join(format!("ckpt-{step:012}"))
}

fn files_of(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn a_resharded_checkpoint_consolidates_into_weights_torchvision_loads_strictly() {
    let dir = scratch("checkpoint-sharded");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    // 64x64 images: the ImageNet stem (7x7), as torchvision's resnet18 has it.
    let data = synth(&dir, "images", 8, 0, "3x64x64", 10);
    let whole = dir.join("whole");
    mpirun(2, &[
        "--model", "resnet18", "--data", &s(&data), "--batch-size", "2", "--steps", "1", "--threads", "1", "--no-eval",
        "--results", &s(&dir), "--checkpoint-dir", &s(&whole), "--checkpoint-every", "1",
    ])
    .expect_ok();
    let trained = newest(&whole);

    let rows = dir.join("rows");
    let run = mpirun(3, &["checkpoint", "reshard", &s(&whole), &s(&rows), "--layout", "rows"]).expect_ok();
    assert!(run.stdout.contains("3 part files"), "{}", run.all_output());
    let flat = dir.join("flat");
    mpirun(2, &["checkpoint", "reshard", &s(&newest(&rows)), &s(&flat), "--layout", "flat"]).expect_ok();
    let sharded = newest(&flat);
    assert_eq!(files_of(&sharded), vec!["index.json", "meta.crc32", "meta.json", "part-00000.safetensors", "part-00001.safetensors"]);

    // A write that cannot complete (a file where its folder must go): every rank fails, no
    // partial folder is left, and what was there stays.
    let blocked = dir.join("blocked");
    std::fs::create_dir_all(&blocked).unwrap();
    let in_the_way = blocked.join(sharded.file_name().unwrap());
    std::fs::write(&in_the_way, b"in the way").unwrap();
    let run = mpirun(2, &["checkpoint", "reshard", &s(&sharded), &s(&blocked)]);
    assert!(!run.ok() && run.stderr.contains(&format!("error: {}", in_the_way.display())), "{}", run.all_output());
    assert_eq!(files_of(&blocked), vec![".lock".to_string(), sharded.file_name().unwrap().to_string_lossy().into_owned()]);

    let (out, optimizer) = (dir.join("consolidated.safetensors"), dir.join("consolidated-optimizer.safetensors"));
    let run = hpc_train(&["checkpoint", "consolidate", &s(&sharded), &s(&out), "--optimizer", &s(&optimizer)]).expect_ok();
    assert!(run.stdout.contains("sharded"), "{}", run.all_output());
    // Training writes sharded checkpoints now: what it wrote, consolidated, is the reference.
    let (trained_weights, trained_optimizer) = (dir.join("trained.safetensors"), dir.join("trained-optimizer.safetensors"));
    hpc_train(&["checkpoint", "consolidate", &s(&trained), &s(&trained_weights), "--optimizer", &s(&trained_optimizer)]).expect_ok();
    let weights = read_weights(&out);
    assert!(weights.len() > 100, "resnet18's variables: {}", weights.len());
    assert_eq!(weights, read_weights(&trained_weights), "the weights training wrote, tensor by tensor");
    assert_eq!(read_weights(&optimizer), read_weights(&trained_optimizer), "the momentum training wrote");

    // A flipped byte in one part file: refused, naming it.
    let part = newest(&rows).join("part-00001.safetensors");
    let mut bytes = std::fs::read(&part).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&part, &bytes).unwrap();
    let run = hpc_train(&["checkpoint", "consolidate", &s(&newest(&rows)), &s(&dir.join("damaged.safetensors"))]);
    assert!(!run.ok() && run.stderr.contains("part-00001.safetensors fails its CRC-32 check (damaged)"), "{}", run.all_output());
    assert!(!dir.join("damaged.safetensors").exists());

    // PyTorch: the consolidated weights into torchvision.models.resnet18(num_classes=10),
    // load_state_dict(strict=True), and a forward pass (scripts/optim_reference.py strict-load).
    let venv = std::env::var_os("PYTORCH_VENV").map(std::path::PathBuf::from).unwrap_or_else(|| root().join(".venv-pytorch"));
    let python = venv.join("bin/python");
    if !python.exists() {
        eprintln!("skipped the PyTorch load: no {} (PYTORCH_VENV, or scripts/compare-pytorch.sh makes .venv-pytorch)", python.display());
        return;
    }
    let mut load = Command::new(&python);
    load.arg(root().join("scripts/optim_reference.py")).args(["strict-load", "--torchvision", "resnet18", "--classes", "10", "--weights"]).arg(&out);
    let loaded = run_with_limit(load, Duration::from_secs(300));
    assert!(loaded.ok() && loaded.stdout.contains("with strict=True"), "{}", loaded.all_output());
}

/// Tolerance of a run resumed at another layout against the uninterrupted one: the float sums
/// of the exchange run in another order (tests/conformance.rs's F32_TOLERANCE).
const F32_TOLERANCE: f64 = 2e-5;

/// The index's tensors of one section (`weights` or `optimizer`): name -> the files of its pieces.
fn pieces_by_file(ckpt: &Path, section: &str) -> std::collections::BTreeMap<String, Vec<String>> {
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ckpt.join("index.json")).unwrap()).unwrap();
    index[section]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, entry)| (name.clone(), entry["pieces"].as_array().unwrap().iter().map(|p| p["file"].as_str().unwrap().to_string()).collect()))
        .collect()
}

/// A run at layout `a` (`a_ranks` ranks) that checkpoints after step `at` and ends after
/// `steps`, saving its weights; its last checkpoint consolidated must equal those weights. Then
/// the later checkpoints are removed and a run at layout `b` resumes from step `at` to the end:
/// its weights must equal the uninterrupted run's. Returns the first run's checkpoint at `at`
/// (for checks of its part files) and the record of the resumed run.
#[allow(clippy::too_many_arguments)]
fn checkpoint_then_resume(name: &str, common: &[&str], a_ranks: usize, a: &[&str], b_ranks: usize, b: &[&str], steps: u64, at: u64) -> (std::path::PathBuf, serde_json::Value) {
    let dir = scratch(&format!("ckpt-resume-{name}"));
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let ckpt = dir.join("ckpt");
    let (steps_s, every) = (steps.to_string(), at.to_string());
    let with = |layout: &[&str], extra: &[String]| -> Vec<String> {
        let mut args: Vec<String> = common.iter().map(|x| x.to_string()).collect();
        args.extend(["--steps".into(), steps_s.clone(), "--checkpoint-dir".into(), s(&ckpt), "--checkpoint-every".into(), every.clone(), "--keep-checkpoints".into(), "10".into()]);
        args.extend(layout.iter().map(|x| x.to_string()));
        args.extend(extra.iter().cloned());
        args
    };
    let started = std::time::Instant::now();
    let full_results = dir.join("full");
    let full = dir.join("full.safetensors");
    let args = with(a, &["--results".into(), s(&full_results), "--save-weights".into(), s(&full)]);
    mpirun(a_ranks, &args.iter().map(String::as_str).collect::<Vec<_>>()).expect_ok();
    let record = read_runs(&full_results).pop().expect("a record");
    assert!(record["extra"]["checkpoint_writes"].as_u64().unwrap_or(0) >= 2 && record["extra"]["checkpoint_write_bytes"].as_u64().unwrap_or(0) > 0, "{name}: {record}");

    // The last checkpoint, consolidated, is the --save-weights file of the same step.
    let last = ckpt.join(format!("ckpt-{steps:012}"));
    let consolidated = dir.join("consolidated.safetensors");
    hpc_train(&["checkpoint", "consolidate", &s(&last), &s(&consolidated)]).expect_ok();
    assert_eq!(read_weights(&consolidated), read_weights(&full), "{name}: the consolidated checkpoint against --save-weights");

    let first = ckpt.join(format!("ckpt-{at:012}"));
    assert!(first.join("index.json").exists(), "{name}: {} is a sharded checkpoint", first.display());
    let parts: Vec<String> = files_of(&first).into_iter().filter(|f| f.starts_with("part-")).collect();
    assert_eq!(parts.len(), a_ranks, "{name}: one part file per rank: {parts:?}");
    // Keep a copy of the checkpoint the resume starts from, and remove the later ones.
    for step in checkpoint_steps(&ckpt) {
        if step > at {
            std::fs::remove_dir_all(ckpt.join(format!("ckpt-{step:012}"))).unwrap();
        }
    }
    let kept = dir.join("kept");
    copy_dir(&first, &kept);

    let resumed_results = dir.join("resumed");
    let resumed = dir.join("resumed.safetensors");
    let args = with(b, &["--results".into(), s(&resumed_results), "--save-weights".into(), s(&resumed), "--resume".into()]);
    let run = mpirun(b_ranks, &args.iter().map(String::as_str).collect::<Vec<_>>()).expect_ok();
    assert!(run.stderr.contains(&format!("(step {at},")), "{name}: {}", run.all_output());
    let diff = max_relative_difference(&full, &resumed);
    assert!(diff < F32_TOLERANCE, "{name}: the run resumed at another layout differs from the uninterrupted one by {diff:e}");
    let record = read_runs(&resumed_results).pop().expect("a record");
    assert!(record["extra"]["resume_read_bytes"].as_u64().unwrap_or(0) > 0 && record["extra"]["resume_read_s"].as_f64().is_some(), "{name}: {record}");
    eprintln!("{name}: resumed within {diff:e} of the uninterrupted run, {:.1} s", started.elapsed().as_secs_f64());
    (kept, record)
}

fn tiny_args(data: &str) -> Vec<&str> {
    vec!["--model", "tiny", "--data", data, "--scaling", "strong", "--global-batch", "12", "--threads", "1", "--no-eval", "--log-every", "1000", "--lr", "0.1"]
}

fn tiny_data(name: &str) -> String {
    synth(&scratch(&format!("ckpt-data-{name}")), "tiny", 96, 0, "1x16x16", 4).to_str().unwrap().to_string()
}

/// Two data-parallel ranks write one part file each, splitting the replicated variables (and
/// their momentum) between them: each tensor once, in one of the two files, and both files
/// hold some. One rank resumes from it.
#[test]
fn data_parallel_replicas_split_the_write_and_one_rank_resumes() {
    let data = tiny_data("dp");
    let (ckpt, _) = checkpoint_then_resume("dp2-to-1", &tiny_args(&data), 2, &[], 1, &[], 6, 3);
    for section in ["weights", "optimizer"] {
        let pieces = pieces_by_file(&ckpt, section);
        assert!(pieces.values().all(|files| files.len() == 1), "{section}: every replicated tensor written once, whole: {pieces:?}");
        let files: std::collections::BTreeSet<&String> = pieces.values().flatten().collect();
        assert_eq!(files.len(), 2, "{section}: both replicas write a share: {pieces:?}");
    }
}

/// `--zero 2` on 2 ranks writes each rank's flat shard of the momentum; plain data
/// parallelism on 2 ranks resumes from it.
#[test]
fn zero2_shards_resume_as_plain_data_parallelism() {
    let data = tiny_data("zero2");
    let (ckpt, _) = checkpoint_then_resume("zero2-to-plain", &tiny_args(&data), 2, &["--zero", "2", "--overlap", "off"], 2, &[], 6, 3);
    let state = pieces_by_file(&ckpt, "optimizer");
    assert!(state.values().any(|files| files.len() == 2), "a tensor cut between the two ranks' shards: {state:?}");
}

/// `--zero 3` on 2 ranks: parameters and state as flat shards, nothing gathered; 3 ranks of
/// `--zero 3` resume from it.
#[test]
fn zero3_shards_resume_on_three_ranks() {
    let data = tiny_data("zero3");
    let (ckpt, _) = checkpoint_then_resume("zero3-2-to-3", &tiny_args(&data), 2, &["--zero", "3"], 3, &["--zero", "3"], 6, 3);
    let weights = pieces_by_file(&ckpt, "weights");
    assert!(weights.values().any(|files| files.len() == 2), "parameters written as both ranks' shards: {weights:?}");
}

/// A 2-stage pipeline writes each stage's variables from its own rank; `--zero 1` on 2 ranks
/// resumes from it.
#[test]
fn a_pipeline_checkpoint_resumes_under_zero1() {
    let data = tiny_data("pipeline");
    let (ckpt, _) = checkpoint_then_resume("pipeline-to-zero1", &tiny_args(&data), 2, &["--pipeline-stages", "2", "--micro-batches", "2"], 2, &["--zero", "1", "--overlap", "off"], 6, 3);
    let weights = pieces_by_file(&ckpt, "weights");
    let files: std::collections::BTreeSet<&String> = weights.values().flatten().collect();
    assert_eq!(files.len(), 2, "each stage writes its own variables: {weights:?}");
}

fn vit_args(data: &str) -> Vec<&str> {
    vec!["--model", "vit-tiny", "--data", data, "--scaling", "strong", "--global-batch", "8", "--threads", "1", "--no-eval", "--log-every", "1000", "--warmup-steps", "1"]
}

fn vit_data(name: &str) -> String {
    synth(&scratch(&format!("ckpt-data-{name}")), "vit", 48, 0, "1x16x16", 4).to_str().unwrap().to_string()
}

/// `--tensor-parallel 2` writes the cut weights and their momentum as each rank's rectangles
/// of the whole tensors, the group's whole copies once; one rank resumes from it.
#[test]
fn tensor_parallel_rectangles_resume_on_one_rank() {
    let data = vit_data("tp");
    let (ckpt, _) = checkpoint_then_resume("tp2-to-1", &vit_args(&data), 2, &["--tensor-parallel", "2"], 1, &[], 4, 2);
    let weights = pieces_by_file(&ckpt, "weights");
    let in_proj = &weights["encoder.layers.encoder_layer_0.self_attention.in_proj_weight"];
    assert_eq!(in_proj.len(), 6, "q, k and v rows of each of 2 ranks: {in_proj:?}");
    assert!(weights.iter().filter(|(n, _)| n.contains("ln")).all(|(_, f)| f.len() == 1), "the group's whole copies once: {weights:?}");
}

/// AdamW's moments of a cut parameter are cut as the parameter is: `--tensor-parallel 2` with
/// AdamW checkpoints each rank's rectangles of `exp_avg` and `exp_avg_sq`, and the resume ends
/// bit for bit where the uninterrupted run does. (The moments' names, `exp_avg/<param>`, were
/// taken for whole tensors: every rank of the group wrote its part as the whole, and the write
/// was refused; scripts/measure-beyond-one-rank.sh found it.) The resume is at the same layout:
/// AdamW divides each gradient by its own running size, so an element whose gradient is f32
/// rounding (a ViT's key biases, whose true gradient is zero) moves by about the learning rate
/// with a sign set by the order of the sums, and two layouts that sum in different orders part
/// by 1e-4 to 0.3 (vit-tiny, 4 steps) where SGD agrees within 2e-5; the moments' reading at
/// other layouts goes through the same slices as SGD's momentum, which the tests above resume
/// at other layouts.
#[test]
fn tensor_parallel_adamw_moments_are_cut_like_their_parameters_and_resume_exactly() {
    let data = vit_data("tp-adamw");
    let mut common = vit_args(&data);
    common.extend(["--optimizer", "adamw"]);
    let (ckpt, _) = checkpoint_then_resume("tp2-adamw", &common, 2, &["--tensor-parallel", "2"], 2, &["--tensor-parallel", "2"], 4, 2);
    let state = pieces_by_file(&ckpt, "optimizer");
    for slot in ["exp_avg", "exp_avg_sq"] {
        let mlp = &state[&format!("{slot}/encoder.layers.encoder_layer_0.mlp.0.bias")];
        assert_eq!(mlp.len(), 2, "{slot}: one rectangle from each rank: {mlp:?}");
    }
}

/// A pipeline of tensor-parallel groups (2 stages x T = 2 on 4 ranks), refused before sharded
/// checkpoints, checkpoints; 2 ranks of plain data parallelism resume from it.
#[test]
fn a_pipeline_of_tensor_parallel_groups_resumes_as_plain_data_parallelism() {
    let data = vit_data("pptp");
    checkpoint_then_resume("pp2tp2-to-dp2", &vit_args(&data), 4, &["--pipeline-stages", "2", "--tensor-parallel", "2", "--micro-batches", "2"], 2, &[], 4, 2);
}

/// A job killed while it writes a checkpoint (every rank SIGKILLed, as a node failure or a batch
/// system's kill after its grace period would) leaves the previous checkpoint the newest good
/// one: the half-written one is never taken for a checkpoint, and a resume from the previous
/// one ends with the weights of the run that was not killed. `stall-write` holds rank 1 in the
/// middle of its part file of step 6, its first piece written, until the kill.
#[test]
fn a_write_killed_midway_leaves_the_previous_checkpoint_and_the_resume_equals_the_run_not_killed() {
    let dir = scratch("ckpt-killed-write");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let data = tiny_data("killed-write");
    let ckpt = dir.join("ckpt");
    let with = |extra: &[&str]| -> Vec<String> {
        let mut args: Vec<String> = tiny_args(&data).iter().map(|x| x.to_string()).collect();
        args.extend(["--steps", "9", "--checkpoint-every", "3", "--keep-checkpoints", "10", "--zero", "1", "--strategy", "ring"].map(String::from));
        args.extend(extra.iter().map(|x| x.to_string()));
        args
    };
    let full = dir.join("full.safetensors");
    let args = with(&["--results", &s(&dir.join("full")), "--checkpoint-dir", &s(&dir.join("full-ckpt")), "--save-weights", &s(&full)]);
    mpirun(3, &args.iter().map(String::as_str).collect::<Vec<_>>()).expect_ok();

    let args = with(&["--results", &s(&dir.join("killed")), "--checkpoint-dir", &s(&ckpt)]);
    let log = dir.join("killed.log");
    let mut child = spawn_mpirun(3, &args.iter().map(String::as_str).collect::<Vec<_>>(), &[("HPC_TRAIN_FAULT", "stall-write@1:6:120")], &log);
    let half_written = ckpt.join(".ckpt-000000000006.partial").join("part-00001.safetensors");
    wait_until(Duration::from_secs(60), "rank 1 in the middle of its part of step 6", || {
        std::fs::read_to_string(&log).unwrap_or_default().contains("pausing 120 s in the middle of")
    });
    assert!(half_written.exists(), "{}", std::fs::read_to_string(&log).unwrap_or_default());
    for pid in rank_pids(child.id()) {
        signal(pid, "KILL");
    }
    let (code, _) = wait_limited(&mut child, Duration::from_secs(30)).expect("the job ended after the kill");
    assert_ne!(code, Some(0));
    assert_eq!(checkpoint_steps(&ckpt), vec![3], "only the checkpoint before the killed write is a checkpoint");

    let resumed = dir.join("resumed.safetensors");
    let args = with(&["--results", &s(&dir.join("resumed")), "--checkpoint-dir", &s(&ckpt), "--save-weights", &s(&resumed), "--resume"]);
    let run = mpirun(3, &args.iter().map(String::as_str).collect::<Vec<_>>()).expect_ok();
    assert!(run.stderr.contains("(step 3,"), "{}", run.all_output());
    assert_eq!(checkpoint_steps(&ckpt), vec![3, 6, 9], "the resumed run writes step 6 again, then 9");
    assert!(!ckpt.join(".ckpt-000000000006.partial").exists(), "the half-written folder is replaced");
    let diff = max_relative_difference(&full, &resumed);
    assert!(diff < F32_TOLERANCE, "the resume after a killed write differs from the run not killed by {diff:e}");

    // The parameter server writes whole checkpoints, which the fault cannot reach: refused by
    // name before anything starts, not ignored.
    let mut ps: Vec<String> = tiny_args(&data).iter().map(|x| x.to_string()).collect();
    ps.extend(["--steps", "9", "--strategy", "ps", "--servers", "1", "--checkpoint-dir", &s(&dir.join("ps-ckpt"))].map(String::from));
    let run = mpirun_env(3, &ps.iter().map(String::as_str).collect::<Vec<_>>(), &[("HPC_TRAIN_FAULT", "stall-write@1:6:120")], Duration::from_secs(60));
    assert!(!run.ok() && !run.timed_out, "{}", run.all_output());
    assert_eq!(run.all_output().matches("stall-write acts in a rank's part of a sharded checkpoint").count(), 1, "{}", run.all_output());
}

/// Batch norm's running statistics are each replica's own (no exchange averages them): a
/// checkpoint holds the first replica's, as `--save-weights` and PyTorch's rank-0 save do,
/// never a mix of replicas' statistics (the writers shared the buffers among the replicas by
/// size, so the consolidated checkpoint was no rank's). The same under `--zero 3`, whose
/// `--save-weights` is written in parts.
#[test]
fn batch_norm_statistics_are_the_first_replicas() {
    // Which rank writes which buffer is the writers' plan, the same under any MPI: Open MPI's
    // run checks it (common::launcher::every_row).
    if !common::launcher::every_row() {
        return;
    }
    let dir = scratch("ckpt-bn");
    let data = synth(&dir, "bn", 32, 0, "1x12x12", 4);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    for (name, layout) in [("plain", &[][..]), ("zero3", &["--zero", "3"][..])] {
        let ckpt = dir.join(format!("ckpt-{name}"));
        let saved = dir.join(format!("{name}.safetensors"));
        let mut args = vec!["--model", "resnet18", "--data", data.to_str().unwrap(), "--scaling", "strong", "--global-batch", "8", "--steps", "2", "--no-eval", "--threads", "1", "--strategy", "ring"];
        let (c, w, r) = (s(&ckpt), s(&saved), s(&dir.join(format!("runs-{name}"))));
        args.extend(["--checkpoint-dir", &c, "--save-weights", &w, "--results", &r]);
        args.extend(layout);
        mpirun(2, &args).expect_ok();
        let consolidated = dir.join(format!("{name}-consolidated.safetensors"));
        hpc_train(&["checkpoint", "consolidate", &c, &s(&consolidated)]).expect_ok();
        let (from_checkpoint, from_save) = (read_weights(&consolidated), read_weights(&saved));
        assert!(from_save.iter().any(|(k, _)| k.ends_with("running_mean")), "{name}: the model has batch norm");
        assert_eq!(from_checkpoint, from_save, "{name}: the consolidated checkpoint against --save-weights");
    }
}

/// Every file under `dir` (recursively, by path relative to it) and its bytes, the lock file
/// left out (each run names itself there): what a refused command must leave as it was.
fn snapshot(dir: &Path) -> std::collections::BTreeMap<std::path::PathBuf, Vec<u8>> {
    let mut files = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else if path.file_name().is_some_and(|n| n != ".lock") {
                files.insert(path.strip_prefix(dir).unwrap().to_path_buf(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

fn ckpt_folder(step: u64) -> String {
    format!("ckpt-{step:012}")
}

/// Cuts a file to half its length, as a crash of the storage might.
fn truncate_half(path: &Path) {
    let len = std::fs::metadata(path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(len / 2).unwrap();
}

/// A tiny model trained 4 steps by one process, checkpointing every 2: `<dir>/ckpt` holds the
/// checkpoints of steps 2 and 4. Returns the test's folder, the dataset and the checkpoints.
fn two_checkpoints(name: &str) -> (std::path::PathBuf, String, std::path::PathBuf) {
    let dir = scratch(name);
    let data = tiny_data(name);
    let ckpt = dir.join("ckpt");
    let (c, r) = (ckpt.to_str().unwrap(), dir.to_str().unwrap());
    let mut args = tiny_args(&data);
    args.extend(["--steps", "4", "--checkpoint-dir", c, "--checkpoint-every", "2", "--keep-checkpoints", "10", "--results", r]);
    hpc_train(&args).expect_ok();
    assert_eq!(checkpoint_steps(&ckpt), vec![2, 4]);
    (dir, data, ckpt)
}

/// Pruning kept the highest step numbers, whoever wrote them: a run without --resume into a
/// folder holding an earlier run's higher step removed each checkpoint it wrote right after
/// writing it; `checkpoint reshard --keep 1` into such a folder reported success and removed
/// what it wrote; a resume past a newer damaged checkpoint with --keep-checkpoints 1 left no
/// good one. Now a write removes only good checkpoints older than itself, never the one the run
/// resumed from, and a run without --resume refuses a folder that holds checkpoints.
#[test]
fn a_write_prunes_only_older_good_checkpoints_and_a_new_run_refuses_a_used_folder() {
    if covered_by_the_first_mpi("which checkpoints a write removes") {
        return;
    }
    let (dir, data, ckpt) = two_checkpoints("ckpt-prune");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (c, r) = (s(&ckpt), s(&dir));
    let before = snapshot(&ckpt);
    let mut fresh = tiny_args(&data);
    fresh.extend(["--steps", "2", "--checkpoint-dir", &c, "--keep-checkpoints", "1", "--results", &r]);
    let run = hpc_train(&fresh);
    let out = run.all_output();
    assert!(!run.ok() && out.matches("holds 2 checkpoints (steps 2 to 4) of an earlier run, and this run starts from step 0 (no --resume)").count() == 1, "{out}");
    assert!(snapshot(&ckpt) == before, "the earlier run's checkpoints as they were:\n{out}");

    // Resharding the step-2 checkpoint into a folder that holds a copy of step 4, keeping 1.
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    copy_dir(&ckpt.join(ckpt_folder(4)), &other.join(ckpt_folder(4)));
    hpc_train(&["checkpoint", "reshard", &s(&ckpt.join(ckpt_folder(2))), &s(&other), "--keep", "1"]).expect_ok();
    assert_eq!(checkpoint_steps(&other), vec![2, 4], "what it wrote, and the newer one it found");
    hpc_train(&["checkpoint", "consolidate", &s(&other.join(ckpt_folder(2))), &s(&dir.join("resharded.safetensors"))]).expect_ok();

    // The newest checkpoint damaged: a resume from step 2 to 3 keeping 1 writes step 3 and
    // keeps it, keeps the one it resumed from, and leaves the damaged one.
    truncate_half(&ckpt.join(ckpt_folder(4)).join("part-00000.safetensors"));
    let mut resume = tiny_args(&data);
    resume.extend(["--steps", "3", "--checkpoint-dir", &c, "--checkpoint-every", "1", "--keep-checkpoints", "1", "--resume", "--results", &r]);
    let run = hpc_train(&resume).expect_ok();
    assert!(run.stderr.contains("(step 2,"), "{}", run.all_output());
    assert_eq!(checkpoint_steps(&ckpt), vec![2, 3, 4], "{}", run.all_output());
    hpc_train(&["checkpoint", "consolidate", &s(&ckpt.join(ckpt_folder(3))), &s(&dir.join("step3.safetensors"))]).expect_ok();
}

/// A checkpoint folder is an input everywhere: `checkpoint consolidate` wrote its OUT, or its
/// --optimizer file, over a file of the very checkpoint it read (a part file, index.json) and
/// said it succeeded, and the next --resume skipped that checkpoint as damaged; training's
/// --save-weights did the same to a part of a kept checkpoint. --checkpoint-dir naming a
/// `ckpt-<step>` folder with --resume warned that there was no checkpoint, trained from step 0
/// and wrote a checkpoint inside it; and a --resume whose checkpoints were all damaged only
/// warned before starting over them. Each is now refused, naming the folder, and nothing in the
/// checkpoints changes.
#[test]
fn outputs_in_checkpoint_folders_and_a_checkpoint_as_checkpoint_dir_are_refused() {
    if covered_by_the_first_mpi("which paths lie in a checkpoint") {
        return;
    }
    let (dir, data, ckpt) = two_checkpoints("ckpt-inputs");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let newest = ckpt.join(ckpt_folder(4));
    let (c, r, part, index) = (s(&ckpt), s(&dir), s(&newest.join("part-00000.safetensors")), s(&newest.join("index.json")));
    let elsewhere = s(&dir.join("w.safetensors"));
    let in_older = s(&ckpt.join(ckpt_folder(2)).join("w.safetensors"));
    let before = snapshot(&ckpt);
    let refused = |args: &[&str], what: &str| {
        let run = hpc_train(args);
        let out = run.all_output();
        assert!(!run.ok() && out.matches(what).count() == 1, "{args:?}:\n{out}");
        assert!(snapshot(&ckpt) == before, "{args:?} changed the checkpoints:\n{out}");
    };
    let inside = format!("lies in the checkpoint folder {}", newest.display());
    refused(&["checkpoint", "consolidate", &c, &part], &format!("OUT {part}: it {inside}"));
    refused(&["checkpoint", "consolidate", &c, &elsewhere, "--optimizer", &index], &format!("--optimizer {index}: it {inside}"));
    refused(&["checkpoint", "consolidate", &c, &in_older], "lies in the checkpoint folder");
    assert!(!dir.join("w.safetensors").exists());
    let mut save_into_part = tiny_args(&data);
    save_into_part.extend(["--steps", "6", "--checkpoint-dir", &c, "--resume", "--results", &r, "--save-weights", &part]);
    refused(&save_into_part, &format!("--save-weights {part}: it {inside}"));
    let mut checkpoint_as_dir = tiny_args(&data);
    let newest_s = s(&newest);
    checkpoint_as_dir.extend(["--steps", "6", "--checkpoint-dir", &newest_s, "--resume", "--results", &r]);
    refused(&checkpoint_as_dir, &format!("it is a checkpoint, not a folder of checkpoints (a run would write its own inside it); to continue from it, give the folder it is in: --checkpoint-dir {} --resume", ckpt.display()));
    assert!(!newest.join(".lock").exists(), "nothing written into the checkpoint");

    // Every checkpoint damaged: an error, and nothing replaced.
    for step in [2, 4] {
        truncate_half(&ckpt.join(ckpt_folder(step)).join("part-00000.safetensors"));
    }
    let damaged = snapshot(&ckpt);
    let mut resume = tiny_args(&data);
    resume.extend(["--steps", "6", "--checkpoint-dir", &c, "--resume", "--results", &r]);
    let run = hpc_train(&resume);
    let out = run.all_output();
    assert!(!run.ok() && out.matches("error: checkpoint").count() == 1 && out.contains("every checkpoint here is damaged (2, each named above"), "{out}");
    assert!(snapshot(&ckpt) == damaged, "{out}");
}

/// `--save-weights` in parts (`--zero 3`, one rank) removed `OUT.parts` before writing, a
/// folder of the user's of that name too, and removed the parts after a join that failed while
/// its error pointed at them, with a hint (every rank must see the folder) that did not fit a
/// full disk. Now a non-empty `OUT.parts` is refused before training, and a join that fails
/// (here a full disk: the parts fit, the joined file does not) keeps the parts, a complete
/// checkpoint, and says how to join them.
#[test]
fn save_weights_in_parts_keeps_the_parts_when_the_join_fails_and_refuses_a_folder_it_did_not_make() {
    if covered_by_the_first_mpi("what --save-weights in parts keeps") {
        return;
    }
    let dir = scratch("ckpt-parts");
    let data = tiny_data("parts");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let r = s(&dir);
    let disk = dir.join("disk");
    let out = disk.join("w.safetensors");
    let mut args = tiny_args(&data);
    let out_s = s(&out);
    args.extend(["--steps", "1", "--zero", "3", "--results", &r, "--save-weights", &out_s]);
    // The tiny model's weights are 20 KiB: its parts (part file, index.json, meta.json and
    // meta.crc32, each rounded up to 4 KiB pages) take 32 KiB, the joined file 20 KiB more.
    let (run, left) = hpc_train_with_tmpfs_listing(&args, &disk, "44k");
    let text = run.all_output();
    assert!(!run.ok() && !run.timed_out && text.matches("its parts could not be joined").count() == 1, "{text}");
    let parts = disk.join("w.safetensors.parts");
    assert!(text.contains(&format!("the disk is full; make room, then join them with `hpc-train checkpoint consolidate {} {}`", parts.display(), out.display())), "{text}");
    assert!(!text.contains("every rank must see"), "{text}");
    for file in ["index.json", "meta.json", "meta.crc32", "part-00000.safetensors"] {
        assert!(left.contains(&format!("w.safetensors.parts/ckpt-000000000001/{file}")), "{file} kept: {left:?}\n{text}");
    }
    assert!(!left.iter().any(|f| f == "w.safetensors" || f.ends_with(".tmp") || f.contains(".partial")), "{left:?}");

    // A folder of that name with a file of the user's: refused before training, left as it was.
    let mine = dir.join("mine.safetensors");
    let folder = dir.join("mine.safetensors.parts");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(folder.join("notes.txt"), b"mine").unwrap();
    let mut args = tiny_args(&data);
    let mine_s = s(&mine);
    args.extend(["--steps", "1", "--zero", "3", "--results", &r, "--save-weights", &mine_s]);
    let run = hpc_train(&args);
    let text = run.all_output();
    assert!(!run.ok() && text.matches(&format!("its parts go into {}, which holds files this run did not write", folder.display())).count() == 1, "{text}");
    assert!(!text.contains("2 steps") && !mine.exists(), "refused before training:\n{text}");
    assert_eq!(std::fs::read(folder.join("notes.txt")).unwrap(), b"mine");
}

/// A sharded checkpoint counted as good once its part files had their sizes: a part changed
/// on its way to the disk (`damage-write` flips a byte of rank 1's part of step 4 once its rank
/// took its CRC-32) became the newest good checkpoint, and the older one was pruned. Now the
/// ranks read the parts back against their CRC-32s before the folder is renamed into place:
/// the write fails naming the part, and the previous checkpoint stays.
#[test]
fn a_part_changed_on_its_way_to_the_disk_fails_the_write_and_the_previous_checkpoint_stays() {
    if covered_by_the_first_mpi("the check of a written checkpoint's parts") {
        return;
    }
    let dir = scratch("ckpt-damaged-write");
    let data = tiny_data("damaged-write");
    let ckpt = dir.join("ckpt");
    let (c, r) = (ckpt.to_str().unwrap(), dir.to_str().unwrap());
    let mut args = tiny_args(&data);
    args.extend(["--steps", "4", "--checkpoint-dir", c, "--checkpoint-every", "2", "--keep-checkpoints", "1", "--results", r]);
    let run = mpirun_env(2, &args, &[("HPC_TRAIN_FAULT", "damage-write@1:4")], Duration::from_secs(120));
    let out = run.all_output();
    assert!(!run.ok() && !run.timed_out, "{out}");
    assert!(out.contains("part-00001.safetensors fails its CRC-32 check (damaged)"), "{out}");
    assert_eq!(out.matches("1 checkpoint(s) could not be written (after step(s) 4); --resume continues from the newest good one, at step 2").count(), 1, "{out}");
    assert_eq!(checkpoint_steps(&ckpt), vec![2], "{out}");
    assert!(!ckpt.join(".ckpt-000000000004.partial").exists());
}
