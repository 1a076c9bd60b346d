//! The checkpoint module's behaviour through its files: whole and sharded writes, damage and
//! interrupted writes, pruning, reading at another layout, consolidation. Several ranks' part
//! files are written in one process by calling each step of a sharded write for each rank.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use crate::error::Result;

use super::command::consolidate;
use super::files::tests::scratch;
use super::files::{folder_name, list_steps, partial_dir, Retention};
use super::index::Section;
use super::meta::tests::meta;
use super::meta::{META_CHECK_FILE, META_FILE, OPTIMIZER_FILE, WEIGHTS_FILE};
use super::reader::{find_latest, load, verify, verify_written, CheckpointReader};
use super::region::Region;
use super::sharded::{describe, part_file, place_and_prune, write_part, Piece, WriteFault};
use super::whole::save;

#[test]
fn newest_good_checkpoint_wins_and_damage_is_detected() {
    let root = scratch("find");
    let w = vec![("fc.weight".to_string(), Tensor::from_slice(&[1.0f32, 2.0, 3.0]))];
    let m = vec![("fc.weight".to_string(), Tensor::from_slice(&[0.1f32, 0.2, 0.3]))];
    for step in [10, 20, 30] {
        save(&root, meta(step), &w, &m, Retention::newest(5)).unwrap();
    }
    assert_eq!(find_latest(&root).unwrap().unwrap().meta.step, 30);
    // Truncate the newest one's weights: the previous one is used.
    let weights = root.join(folder_name(30)).join(WEIGHTS_FILE);
    let len = std::fs::metadata(&weights).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&weights).unwrap().set_len(len - 5).unwrap();
    assert!(verify(&root.join(folder_name(30))).unwrap_err().to_string().contains("truncated"));
    assert_eq!(find_latest(&root).unwrap().unwrap().meta.step, 20);
    // A flipped byte of the same length fails the CRC.
    let opt = root.join(folder_name(20)).join(OPTIMIZER_FILE);
    let mut bytes = std::fs::read(&opt).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&opt, bytes).unwrap();
    assert_eq!(find_latest(&root).unwrap().unwrap().meta.step, 10);
    // A partial folder from an interrupted write is never considered.
    std::fs::create_dir_all(root.join(".ckpt-000000000040.partial")).unwrap();
    assert_eq!(find_latest(&root).unwrap().unwrap().meta.step, 10);
    let (weights, momentum) = load(&find_latest(&root).unwrap().unwrap()).unwrap();
    assert_eq!(Vec::<f32>::try_from(&weights["fc.weight"]).unwrap(), vec![1.0, 2.0, 3.0]);
    assert_eq!(Vec::<f32>::try_from(&momentum["fc.weight"]).unwrap(), vec![0.1, 0.2, 0.3]);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn old_checkpoints_are_pruned() {
    let root = scratch("prune");
    let w = vec![("a".to_string(), Tensor::from_slice(&[1.0f32]))];
    for step in 1..=5 {
        save(&root, meta(step), &w, &w, Retention::newest(2)).unwrap();
    }
    let mut steps = list_steps(&root);
    steps.sort();
    assert_eq!(steps, vec![4, 5]);
    std::fs::remove_dir_all(&root).unwrap();
}

/// Pruning by step number alone removed the checkpoint just written whenever the folder held a
/// higher step (another run's), and kept a newer damaged checkpoint in place of every good one.
/// A write now removes only good checkpoints older than itself, never the one the run resumed
/// from; a damaged one is neither counted among those kept nor removed.
#[test]
fn a_write_prunes_only_good_checkpoints_older_than_itself() {
    let root = scratch("prune-older");
    let w = vec![("a".to_string(), Tensor::from_slice(&[1.0f32]))];
    let steps = || {
        let mut s = list_steps(&root);
        s.sort();
        s
    };
    save(&root, meta(10), &w, &w, Retention::newest(5)).unwrap();
    let written = save(&root, meta(2), &w, &w, Retention::newest(1)).unwrap();
    assert!(written.exists() && steps() == vec![2, 10], "{:?}", steps());
    // A run resumed from step 2 keeping 1: step 3 goes once 4 is written, 2 stays.
    let resumed = Retention { keep: 1, resumed_from: Some(2) };
    for step in [3, 4] {
        save(&root, meta(step), &w, &w, resumed).unwrap();
    }
    assert_eq!(steps(), vec![2, 4, 10]);
    // Keeping 2 past a damaged step 5: 4 is the good one kept beside 6, then goes for 6 beside 7;
    // 5 stays, counted for nothing.
    let keep_two = Retention { keep: 2, resumed_from: Some(2) };
    save(&root, meta(5), &w, &w, keep_two).unwrap();
    let weights = root.join(folder_name(5)).join(WEIGHTS_FILE);
    std::fs::write(&weights, b"short").unwrap();
    save(&root, meta(6), &w, &w, keep_two).unwrap();
    assert_eq!(steps(), vec![2, 4, 5, 6, 10]);
    save(&root, meta(7), &w, &w, keep_two).unwrap();
    assert_eq!(steps(), vec![2, 5, 6, 7, 10]);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn an_edited_meta_json_is_refused() {
    let root = scratch("edited");
    let w = vec![("a".to_string(), Tensor::from_slice(&[1.0f32]))];
    save(&root, meta(4), &w, &w, Retention::newest(5)).unwrap();
    save(&root, meta(8), &w, &w, Retention::newest(5)).unwrap();
    let meta_path = root.join(folder_name(8)).join(META_FILE);
    let text = std::fs::read_to_string(&meta_path).unwrap();
    std::fs::write(&meta_path, text.replace("\"step\": 8,", "\"step\": 9,")).unwrap();
    let err = verify(&root.join(folder_name(8))).unwrap_err().to_string();
    assert!(err.contains("meta.json fails its CRC-32 check (edited or damaged)"), "{err}");
    assert_eq!(find_latest(&root).unwrap().unwrap().meta.step, 4, "the edited one is skipped");
    // Without its check file, a format-2 meta.json is damaged too.
    std::fs::remove_file(root.join(folder_name(4)).join(META_CHECK_FILE)).unwrap();
    assert!(verify(&root.join(folder_name(4))).unwrap_err().to_string().contains("meta.crc32 is missing"));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_failed_write_leaves_no_partial_folder() {
    let root = scratch("failed");
    std::fs::create_dir_all(&root).unwrap();
    // A file where the checkpoint's folder must go: the final rename fails.
    std::fs::write(root.join(folder_name(3)), b"in the way").unwrap();
    let w = vec![("a".to_string(), Tensor::from_slice(&[1.0f32]))];
    assert!(save(&root, meta(3), &w, &w, Retention::newest(5)).is_err());
    let left: Vec<String> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left, vec![folder_name(3)], "only what was there before");
    std::fs::remove_dir_all(&root).unwrap();
}


/// What `mpirun -n <parts.len()>` of save_sharded does, in one process: every rank's part file,
/// rank 0's description, every rank's read-back of its share of the parts, rank 0's rename and
/// pruning to the newest `keep`; a failure removes the partial folder.
fn save_simulated(root: &Path, step: u64, parts: &[Vec<Piece>], keep: usize) -> Result<PathBuf> {
    save_simulated_with(root, step, parts, keep, |_| ())
}

/// [`save_simulated`] with `meanwhile` done to the partial folder once the parts are written.
fn save_simulated_with(root: &Path, step: u64, parts: &[Vec<Piece>], keep: usize, meanwhile: impl FnOnce(&Path)) -> Result<PathBuf> {
    let partial = partial_dir(root, step);
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).unwrap();
    let ranks = parts.len();
    let saved = parts
        .iter()
        .enumerate()
        .map(|(rank, pieces)| write_part(&partial, rank, pieces, WriteFault::None))
        .collect::<Result<Vec<_>>>()
        .and_then(|written| {
            meanwhile(&partial);
            describe(&partial, meta(step), &written)
        })
        .and_then(|()| (0..ranks).try_for_each(|rank| verify_written(&partial, rank, ranks)))
        .and_then(|()| place_and_prune(root, &partial, step, Retention::newest(keep)));
    if saved.is_err() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    saved
}

/// Tensors by name, as the writers take them.
type Named = Vec<(String, Tensor)>;

/// A small model's variables and one optimizer slot, by name.
fn model(seed: i64) -> (Named, Named) {
    tch::manual_seed(seed);
    let weights = vec![
        ("fc1.weight".to_string(), Tensor::randn([6, 4], (Kind::Float, tch::Device::Cpu))),
        ("fc1.bias".to_string(), Tensor::randn([6], (Kind::Float, tch::Device::Cpu))),
        ("conv.weight".to_string(), Tensor::randn([4, 3, 2, 2], (Kind::Float, tch::Device::Cpu))),
        ("bn.running_var".to_string(), Tensor::rand([3], (Kind::Double, tch::Device::Cpu))),
    ];
    let state = weights.iter().filter(|(n, _)| !n.starts_with("bn.")).map(|(n, t)| (format!("exp_avg/{n}"), t.f_mul_scalar(0.5).unwrap())).collect();
    (weights, state)
}

fn by_name(list: &[(String, Tensor)], name: &str) -> Tensor {
    list.iter().find(|(n, _)| n == name).unwrap().1.shallow_clone()
}

/// Three ranks of a mixed layout: fc1.weight cut by rows between ranks 0 and 1 (rank 1 holding
/// two rectangles, as a tensor-parallel rank holds q, k and v), fc1.bias and the optimizer
/// state as flat shards of uneven sizes (ZeRO), conv.weight and the batch-norm statistics
/// replicated and written by rank 2 alone.
fn three_ranks(weights: &[(String, Tensor)], state: &[(String, Tensor)]) -> Vec<Vec<Piece>> {
    let w = by_name(weights, "fc1.weight");
    let b = by_name(weights, "fc1.bias");
    let rows = |start: i64, count: i64| Piece::rect(Section::Weights, "fc1.weight", &[6, 4], &[start, 0], &w.narrow(0, start, count));
    let bias = |at: i64, len: i64| Piece::flat(Section::Weights, "fc1.bias", &[6], at, &b.narrow(0, at, len));
    let mut parts = vec![vec![rows(0, 2), bias(0, 1)], vec![rows(2, 1), rows(3, 3), bias(1, 5)], vec![
        Piece::whole(Section::Weights, "conv.weight", &by_name(weights, "conv.weight")),
        Piece::whole(Section::Weights, "bn.running_var", &by_name(weights, "bn.running_var")),
    ]];
    for (name, t) in state {
        let (flat, n) = (t.flatten(0, -1), t.numel() as i64);
        let cuts = [0, n / 3, n / 3 + 1, n];
        for (rank, part) in parts.iter_mut().enumerate() {
            let (at, len) = (cuts[rank], cuts[rank + 1] - cuts[rank]);
            part.push(Piece::flat(Section::Optimizer, name.clone(), &t.size(), at, &flat.narrow(0, at, len)));
        }
    }
    parts
}

#[test]
fn a_sharded_checkpoint_reads_back_at_another_layout() {
    let root = scratch("sharded");
    let (weights, state) = model(1);
    let dir = save_simulated(&root, 7, &three_ranks(&weights, &state), 3).unwrap();
    let found = find_latest(&root).unwrap().unwrap();
    assert_eq!((found.dir.clone(), found.meta.step, found.meta.format), (dir.clone(), 7, super::meta::SHARDED_FORMAT));
    let mut files: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    assert_eq!(files, vec!["index.json", "meta.crc32", "meta.json", "part-00000.safetensors", "part-00001.safetensors", "part-00002.safetensors"]);
    // Each part file is plain safetensors: rank 1's second rectangle of fc1.weight.
    let part1: BTreeMap<String, Tensor> = Tensor::read_safetensors(dir.join(part_file(1))).unwrap().into_iter().collect();
    assert!(part1["weights/fc1.weight#1"].equal(&by_name(&weights, "fc1.weight").narrow(0, 3, 3)));

    let reader = CheckpointReader::open(&found).unwrap();
    let names: Vec<String> = reader.tensors(Section::Weights).into_iter().map(|t| t.name).collect();
    assert_eq!(names, vec!["bn.running_var", "conv.weight", "fc1.bias", "fc1.weight"]);
    let var = reader.tensors(Section::Weights).into_iter().find(|t| t.name == "bn.running_var").unwrap();
    assert_eq!((var.shape, var.kind), (vec![3], Kind::Double));
    for (section, list) in [(Section::Weights, &weights), (Section::Optimizer, &state)] {
        for (name, t) in list.iter() {
            assert!(reader.read_whole(section, name).unwrap().equal(t), "{name}");
        }
    }
    // Another layout: columns 1..3 of fc1.weight (a column cut, across ranks 0 and 1's rows),
    // a flat range of conv.weight, and a rectangle of the optimizer's flat shards.
    let before = reader.stats().bytes;
    let cols = reader.read(Section::Weights, "fc1.weight", &Region::Rect { offsets: vec![0, 1], lengths: vec![6, 2] }).unwrap();
    assert!(cols.equal(&by_name(&weights, "fc1.weight").narrow(1, 1, 2)));
    assert_eq!(reader.stats().bytes - before, 12 * 4, "only the elements asked for are copied");
    let conv = by_name(&weights, "conv.weight");
    let flat = reader.read(Section::Weights, "conv.weight", &Region::Flat { at: 5, len: 20 }).unwrap();
    assert!(flat.equal(&conv.flatten(0, -1).narrow(0, 5, 20)));
    let state_rows = reader.read(Section::Optimizer, "exp_avg/conv.weight", &Region::rows(&[4, 3, 2, 2], 1, 2)).unwrap();
    assert!(state_rows.equal(&by_name(&state, "exp_avg/conv.weight").narrow(0, 1, 2)));
    let err = reader.read(Section::Weights, "fc2.weight", &Region::Whole).unwrap_err().to_string();
    assert!(err.contains("no tensor fc2.weight among its weights"), "{err}");
    // load() assembles whole tensors as from a whole checkpoint.
    let (w, s) = load(&found).unwrap();
    assert_eq!((w.len(), s.len()), (4, 3));
    assert!(w["fc1.bias"].equal(&by_name(&weights, "fc1.bias")) && s["exp_avg/fc1.bias"].equal(&by_name(&state, "exp_avg/fc1.bias")));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_tensor_not_covered_exactly_once_fails_the_write_and_keeps_the_previous_checkpoint() {
    let root = scratch("coverage");
    let (weights, state) = model(2);
    save_simulated(&root, 5, &three_ranks(&weights, &state), 3).unwrap();
    let mut parts = three_ranks(&weights, &state);
    parts[1].remove(1); // rank 1's rows 3..6 of fc1.weight
    let err = save_simulated(&root, 10, &parts, 3).unwrap_err().to_string();
    assert!(err.contains("tensor fc1.weight (weights) of shape [6, 4]: elements 12..24 are in no piece"), "{err}");
    // The replicated conv.weight written by two replicas.
    let mut parts = three_ranks(&weights, &state);
    parts[0].push(Piece::whole(Section::Weights, "conv.weight", &by_name(&weights, "conv.weight")));
    let err = save_simulated(&root, 10, &parts, 3).unwrap_err().to_string();
    assert!(err.contains("tensor conv.weight (weights) of shape [4, 3, 2, 2]: elements 0..48 are in two pieces"), "{err}");
    // A piece whose data does not match its region is refused before anything is written.
    let mut parts = three_ranks(&weights, &state);
    parts[2].push(Piece { section: Section::Weights, name: "fc2.weight".into(), shape: vec![2, 2], region: Region::Flat { at: 0, len: 4 }, data: Tensor::zeros([3], (Kind::Float, tch::Device::Cpu)) });
    let err = save_simulated(&root, 10, &parts, 3).unwrap_err().to_string();
    assert!(err.contains("tensor fc2.weight: a piece of 3 elements for a region of 4"), "{err}");
    let left: Vec<String> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left, vec![folder_name(5)], "no partial folder left, the previous checkpoint in place");
    assert_eq!(find_latest(&root).unwrap().unwrap().meta.step, 5);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_killed_or_damaged_sharded_write_falls_back_to_the_previous_checkpoint() {
    let root = scratch("killed");
    let (weights, state) = model(3);
    save_simulated(&root, 10, &three_ranks(&weights, &state), 5).unwrap();
    // Killed after two ranks wrote their parts, before rank 0's index and rename.
    let partial = partial_dir(&root, 20);
    std::fs::create_dir_all(&partial).unwrap();
    let (newer, _) = model(4);
    for (rank, pieces) in three_ranks(&newer, &state).iter().enumerate().take(2) {
        write_part(&partial, rank, pieces, WriteFault::None).unwrap();
    }
    let found = find_latest(&root).unwrap().unwrap();
    assert_eq!(found.meta.step, 10, "the partial folder is never considered");
    assert!(CheckpointReader::open(&found).unwrap().read_whole(Section::Weights, "fc1.weight").unwrap().equal(&by_name(&weights, "fc1.weight")));

    // A complete newer one with a flipped byte in one part file: verify names it, the older one is used.
    std::fs::remove_dir_all(&partial).unwrap();
    let dir = save_simulated(&root, 20, &three_ranks(&newer, &state), 5).unwrap();
    assert_eq!(find_latest(&root).unwrap().unwrap().meta.step, 20);
    let part = dir.join(part_file(1));
    let mut bytes = std::fs::read(&part).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&part, &bytes).unwrap();
    let err = verify(&dir).unwrap_err().to_string();
    assert!(err.contains("part-00001.safetensors fails its CRC-32 check (damaged)"), "{err}");
    assert_eq!(find_latest(&root).unwrap().unwrap().meta.step, 10);
    // Truncated, and index.json edited: both found.
    std::fs::write(&part, &bytes[..last]).unwrap();
    assert!(verify(&dir).unwrap_err().to_string().contains("truncated"));
    let index = dir.join(super::index::INDEX_FILE);
    let text = std::fs::read_to_string(&index).unwrap();
    std::fs::write(&index, text.replacen("\"at\": 1", "\"at\": 2", 1)).unwrap();
    assert!(verify(&dir).unwrap_err().to_string().contains("index.json fails its CRC-32 check"));
    std::fs::remove_dir_all(&root).unwrap();
}

/// A part file changed after its rank wrote it (one byte flipped, its size the same, as storage
/// that changes data on its way would) passed the check of sizes, became the newest checkpoint
/// and had the older one pruned. Read back against its CRC-32 before the rename, it fails the
/// write by name; the partial folder goes and the older checkpoint stays.
#[test]
fn a_part_changed_after_its_write_fails_the_checkpoint_and_nothing_is_pruned() {
    let root = scratch("changed-part");
    let (weights, state) = model(7);
    save_simulated(&root, 10, &three_ranks(&weights, &state), 1).unwrap();
    let flip = |partial: &Path| {
        let part = partial.join(part_file(1));
        let mut bytes = std::fs::read(&part).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xff;
        std::fs::write(&part, &bytes).unwrap();
    };
    let err = save_simulated_with(&root, 20, &three_ranks(&weights, &state), 1, flip).unwrap_err().to_string();
    assert!(err.contains("part-00001.safetensors fails its CRC-32 check (damaged)"), "{err}");
    assert_eq!(list_steps(&root), vec![10]);
    assert!(!partial_dir(&root, 20).exists());
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_whole_checkpoint_reads_through_the_same_reader() {
    let root = scratch("whole-reader");
    let (weights, state) = model(5);
    save(&root, meta(3), &weights, &state, Retention::newest(3)).unwrap();
    let found = find_latest(&root).unwrap().unwrap();
    assert!(!found.meta.is_sharded());
    let reader = CheckpointReader::open(&found).unwrap();
    assert_eq!(reader.tensors(Section::Optimizer).len(), 3);
    let w = by_name(&weights, "fc1.weight");
    assert!(reader.read_whole(Section::Weights, "fc1.weight").unwrap().equal(&w));
    let rows = reader.read(Section::Weights, "fc1.weight", &Region::rows(&[6, 4], 4, 2)).unwrap();
    assert!(rows.equal(&w.narrow(0, 4, 2)));
    let shard = reader.read(Section::Optimizer, "exp_avg/fc1.weight", &Region::Flat { at: 3, len: 10 }).unwrap();
    assert!(shard.equal(&by_name(&state, "exp_avg/fc1.weight").flatten(0, -1).narrow(0, 3, 10)));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn consolidation_writes_whole_files_from_either_format() {
    let root = scratch("consolidate");
    let (weights, state) = model(6);
    let sharded = save_simulated(&root, 4, &three_ranks(&weights, &state), 5).unwrap();
    let whole = save(&root, meta(8), &weights, &state, Retention::newest(5)).unwrap();
    for (from, tag) in [(&sharded, "sharded"), (&whole, "whole")] {
        let (out, opt) = (root.join(format!("{tag}.safetensors")), root.join(format!("{tag}-optimizer.safetensors")));
        let done = consolidate(from, &out, Some(&opt)).unwrap();
        assert_eq!(done.tensors, 7);
        for (path, list) in [(&out, &weights), (&opt, &state)] {
            let read: BTreeMap<String, Tensor> = Tensor::read_safetensors(path).unwrap().into_iter().collect();
            assert_eq!(read.len(), list.len(), "{tag}");
            for (name, t) in list.iter() {
                assert!(read[name].equal(t), "{tag} {name}");
            }
        }
        assert!(!root.join(format!("{tag}.safetensors.tmp")).exists());
    }
    // A --checkpoint-dir stands for its newest good checkpoint (the whole one, step 8).
    let done = consolidate(&root, &root.join("newest.safetensors"), None).unwrap();
    assert_eq!((done.checkpoint.meta.step, done.tensors), (8, 4));
    std::fs::remove_dir_all(&root).unwrap();
}
