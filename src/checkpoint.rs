//! Checkpoints: weights and optimizer state, written so that a crash never damages the last
//! good one, found again on `--resume`.
//!
//! A checkpoint is a folder `ckpt-<step>` under `--checkpoint-dir` holding
//! - `weights.safetensors`: every model variable by its torchvision name (loadable with
//!   `safetensors.torch.load_file` and `model.load_state_dict`),
//! - `optimizer.safetensors`: the SGD momentum buffer of every parameter, by parameter name,
//! - `meta.json`: the step, what the run was (model, dataset, strategy, ranks, batch, seed,
//!   optimizer settings, binary) and the size and CRC-32 of each file.
//!
//! Rank 0 writes it into a hidden `.ckpt-<step>.partial` folder, syncs every file, and renames
//! the folder into place: an interrupted write leaves at most a partial folder that `--resume`
//! never looks at. A damaged complete checkpoint (a file truncated or changed afterwards) fails
//! its checks and the previous one is used. The data order needs no state of its own: it is a
//! function of the seed, the epoch and the step.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::error::{Error, Result, WithPath};
use crate::optim::SgdConfig;

pub const META_FILE: &str = "meta.json";
pub const WEIGHTS_FILE: &str = "weights.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const FORMAT: u32 = 1;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FileCheck {
    pub bytes: u64,
    pub crc32: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CheckpointMeta {
    pub format: u32,
    /// Training steps completed (the global step to continue from).
    pub step: u64,
    pub steps_per_epoch: u64,
    pub model: String,
    pub dataset: String,
    pub train_samples: usize,
    pub image_shape: Vec<usize>,
    pub classes: usize,
    pub strategy: String,
    pub ranks: usize,
    pub workers: usize,
    pub batch_per_rank: usize,
    pub global_batch: usize,
    pub seed: u64,
    pub sgd: SgdConfig,
    pub optimizer_steps: u64,
    pub git_commit: String,
    pub timestamp: String,
    #[serde(default)]
    pub files: BTreeMap<String, FileCheck>,
}

impl CheckpointMeta {
    pub fn epoch(&self) -> u64 {
        self.step / self.steps_per_epoch.max(1)
    }
}

/// A complete, checked checkpoint.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub meta: CheckpointMeta,
}

fn folder_name(step: u64) -> String {
    format!("ckpt-{step:012}")
}

fn crc32_of(path: &Path) -> Result<FileCheck> {
    let bytes = std::fs::read(path).at(path)?;
    Ok(FileCheck { bytes: bytes.len() as u64, crc32: crc32fast::hash(&bytes) })
}

fn sync_dir(dir: &Path) {
    // Makes the rename durable; not every file system supports syncing a folder.
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

/// Creates `root` if needed and checks that a checkpoint can be written there.
pub fn check_writable(root: &Path) -> Result<()> {
    std::fs::create_dir_all(root)
        .map_err(|e| Error::Checkpoint { path: root.to_path_buf(), reason: format!("cannot create the folder: {e}") })?;
    let probe = root.join(format!(".write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| Error::Checkpoint { path: root.to_path_buf(), reason: format!("not writable: {e}") })?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Writes a checkpoint (rank 0), then removes all but the newest `keep` complete ones.
pub fn save(root: &Path, mut meta: CheckpointMeta, weights: &[(String, Tensor)], momentum: &[(String, Tensor)], keep: usize) -> Result<PathBuf> {
    let final_dir = root.join(folder_name(meta.step));
    let partial = root.join(format!(".{}.partial", folder_name(meta.step)));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).at(&partial)?;
    let host = |list: &[(String, Tensor)]| -> Result<Vec<(String, Tensor)>> {
        list.iter().map(|(n, t)| Ok((n.clone(), t.f_to_device(tch::Device::Cpu)?.f_contiguous()?))).collect()
    };
    for (file, list) in [(WEIGHTS_FILE, host(weights)?), (OPTIMIZER_FILE, host(momentum)?)] {
        let path = partial.join(file);
        Tensor::write_safetensors(&list, &path)?;
        std::fs::File::open(&path).and_then(|f| f.sync_all()).at(&path)?;
        meta.files.insert(file.to_string(), crc32_of(&path)?);
    }
    meta.format = FORMAT;
    let meta_path = partial.join(META_FILE);
    let text = serde_json::to_string_pretty(&meta).map_err(|e| Error::Checkpoint { path: meta_path.clone(), reason: e.to_string() })?;
    let mut f = std::fs::File::create(&meta_path).at(&meta_path)?;
    f.write_all(text.as_bytes()).and_then(|_| f.sync_all()).at(&meta_path)?;
    sync_dir(&partial);
    if final_dir.exists() {
        // The same step saved again (a resumed run reaching it): replace it only now that the
        // new one is complete.
        std::fs::remove_dir_all(&final_dir).at(&final_dir)?;
    }
    std::fs::rename(&partial, &final_dir).at(&final_dir)?;
    sync_dir(root);
    prune(root, keep);
    Ok(final_dir)
}

/// Removes complete checkpoints beyond the newest `keep` (never the only good one).
fn prune(root: &Path, keep: usize) {
    let mut steps = list_steps(root);
    steps.sort_unstable_by(|a, b| b.cmp(a));
    for step in steps.into_iter().skip(keep.max(1)) {
        let dir = root.join(folder_name(step));
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            log::warn!("could not remove old checkpoint {}: {e}", dir.display());
        }
    }
}

fn list_steps(root: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_prefix("ckpt-")).and_then(|s| s.parse().ok()))
        .collect()
}

/// Checks one checkpoint folder: meta.json readable, every file present with its recorded size
/// and CRC-32, and both safetensors files parse.
pub fn verify(dir: &Path) -> Result<Checkpoint> {
    let bad = |reason: String| Error::Checkpoint { path: dir.to_path_buf(), reason };
    let meta_path = dir.join(META_FILE);
    let text = std::fs::read_to_string(&meta_path).map_err(|e| bad(format!("{META_FILE}: {e}")))?;
    let meta: CheckpointMeta = serde_json::from_str(&text).map_err(|e| bad(format!("{META_FILE}: {e}")))?;
    if meta.format != FORMAT {
        return Err(bad(format!("format {} (this binary reads format {FORMAT})", meta.format)));
    }
    for file in [WEIGHTS_FILE, OPTIMIZER_FILE] {
        let expected = meta.files.get(file).ok_or_else(|| bad(format!("{META_FILE} lists no {file}")))?;
        let path = dir.join(file);
        let found = crc32_of(&path).map_err(|e| bad(format!("{file}: {e}")))?;
        if found.bytes != expected.bytes {
            return Err(bad(format!("{file} holds {} bytes, {} were written (truncated or replaced)", found.bytes, expected.bytes)));
        }
        if found.crc32 != expected.crc32 {
            return Err(bad(format!("{file} fails its CRC-32 check (damaged)")));
        }
        Tensor::read_safetensors(&path).map_err(|e| bad(format!("{file}: {e}")))?;
    }
    Ok(Checkpoint { dir: dir.to_path_buf(), meta })
}

/// The newest complete checkpoint under `root`, skipping (and naming) damaged ones.
pub fn find_latest(root: &Path) -> Result<Option<Checkpoint>> {
    if !root.exists() {
        return Ok(None);
    }
    let mut steps = list_steps(root);
    steps.sort_unstable_by(|a, b| b.cmp(a));
    for step in steps {
        match verify(&root.join(folder_name(step))) {
            Ok(c) => return Ok(Some(c)),
            Err(e) => log::warn!("skipping a damaged checkpoint: {e}"),
        }
    }
    Ok(None)
}

/// Weights and momentum buffers of a checkpoint, by name.
pub fn load(ckpt: &Checkpoint) -> Result<(BTreeMap<String, Tensor>, BTreeMap<String, Tensor>)> {
    let read = |file: &str| -> Result<BTreeMap<String, Tensor>> {
        Ok(Tensor::read_safetensors(ckpt.dir.join(file))?.into_iter().collect())
    };
    Ok((read(WEIGHTS_FILE)?, read(OPTIMIZER_FILE)?))
}

/// Whether a run described by `now` may continue from `saved`. Differences that change the
/// computation are refused with the reason; a different rank count or averaging strategy with
/// the same global batch is the same computation, accepted and returned for the log.
pub fn check_compatible(saved: &CheckpointMeta, now: &CheckpointMeta) -> std::result::Result<Vec<String>, String> {
    let refuse = |what: &str, a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| Err(format!("it was made with {what} {a:?}, this run uses {b:?}"));
    if saved.model != now.model {
        return refuse("model", &saved.model, &now.model);
    }
    if saved.dataset != now.dataset || saved.train_samples != now.train_samples || saved.image_shape != now.image_shape || saved.classes != now.classes {
        return refuse(
            "dataset",
            &(&saved.dataset, saved.train_samples, &saved.image_shape),
            &(&now.dataset, now.train_samples, &now.image_shape),
        );
    }
    if saved.global_batch != now.global_batch {
        return Err(format!(
            "it was made with a global batch of {}, this run uses {} (the data order and the optimizer's trajectory depend on it; keep the global batch, e.g. with --scaling strong --global-batch {})",
            saved.global_batch, now.global_batch, saved.global_batch
        ));
    }
    if saved.seed != now.seed {
        return refuse("seed", &saved.seed, &now.seed);
    }
    let averaging = |s: &str| matches!(s, "ring" | "allreduce" | "horovod" | "ps");
    if saved.strategy != now.strategy && !(averaging(&saved.strategy) && averaging(&now.strategy)) {
        return refuse("strategy", &saved.strategy, &now.strategy);
    }
    let mut accepted = Vec::new();
    if saved.strategy != now.strategy {
        accepted.push(format!("strategy {} -> {} (synchronous strategies compute the same update)", saved.strategy, now.strategy));
    }
    if saved.ranks != now.ranks || saved.workers != now.workers {
        accepted.push(format!("ranks {} -> {} with the same global batch of {}", saved.ranks, now.ranks, now.global_batch));
    }
    if saved.sgd != now.sgd {
        accepted.push(format!("optimizer settings {:?} -> {:?}", saved.sgd, now.sgd));
    }
    if saved.git_commit != now.git_commit {
        accepted.push(format!("binary {} -> {}", saved.git_commit, now.git_commit));
    }
    Ok(accepted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(step: u64) -> CheckpointMeta {
        CheckpointMeta {
            format: FORMAT,
            step,
            steps_per_epoch: 10,
            model: "tiny".into(),
            dataset: "d".into(),
            train_samples: 100,
            image_shape: vec![1, 8, 8],
            classes: 3,
            strategy: "ring".into(),
            ranks: 2,
            workers: 2,
            batch_per_rank: 4,
            global_batch: 8,
            seed: 1,
            sgd: SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.0 },
            optimizer_steps: step,
            git_commit: "abc".into(),
            timestamp: "t".into(),
            files: BTreeMap::new(),
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hpc-train-ckpt-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn newest_good_checkpoint_wins_and_damage_is_detected() {
        let root = scratch("find");
        let w = vec![("fc.weight".to_string(), Tensor::from_slice(&[1.0f32, 2.0, 3.0]))];
        let m = vec![("fc.weight".to_string(), Tensor::from_slice(&[0.1f32, 0.2, 0.3]))];
        for step in [10, 20, 30] {
            save(&root, meta(step), &w, &m, 5).unwrap();
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
            save(&root, meta(step), &w, &w, 2).unwrap();
        }
        let mut steps = list_steps(&root);
        steps.sort();
        assert_eq!(steps, vec![4, 5]);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn compatibility_rules() {
        let saved = meta(10);
        assert!(check_compatible(&saved, &meta(0)).unwrap().is_empty());
        let other_model = CheckpointMeta { model: "resnet18".into(), ..meta(0) };
        assert!(check_compatible(&saved, &other_model).unwrap_err().contains("model"));
        let more_ranks = CheckpointMeta { ranks: 4, workers: 4, batch_per_rank: 2, ..meta(0) };
        assert_eq!(check_compatible(&saved, &more_ranks).unwrap().len(), 1);
        let bigger_batch = CheckpointMeta { global_batch: 16, ..meta(0) };
        assert!(check_compatible(&saved, &bigger_batch).unwrap_err().contains("global batch"));
        let ps = CheckpointMeta { strategy: "horovod".into(), ..meta(0) };
        assert!(check_compatible(&saved, &ps).unwrap()[0].contains("strategy"));
    }
}
