//! Sharded checkpoints through the real binary (issue 49): a whole checkpoint that training
//! wrote, resharded by `mpirun -n 3 hpc-train checkpoint reshard --layout rows` (tensor-parallel
//! style cuts, small tensors whole on one rank each), resharded again by 2 ranks into flat
//! shards (ZeRO style: each rank reads only the slices it writes, across the first layout's
//! cuts), then `hpc-train checkpoint consolidate`d: the weights and the optimizer state come back
//! equal to the training run's whole files, and the weights load into torchvision's resnet18
//! with strict=True. A write that cannot complete leaves no partial folder; a damaged part file
//! is refused by name.

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
    let weights = read_weights(&out);
    assert!(weights.len() > 100, "resnet18's variables: {}", weights.len());
    assert_eq!(weights, read_weights(&trained.join("weights.safetensors")), "the weights training wrote, tensor by tensor");
    assert_eq!(read_weights(&optimizer), read_weights(&trained.join("optimizer.safetensors")), "the momentum training wrote");

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
