//! Checkpoints: weights and optimizer state, written so that a crash never damages the last
//! good one, found again on `--resume`.
//!
//! A checkpoint is a folder `ckpt-<step>` under `--checkpoint-dir` holding
//! - `weights.safetensors`: every model variable by its torchvision name (loadable with
//!   `safetensors.torch.load_file` and `model.load_state_dict`),
//! - `optimizer.safetensors`: the optimizer's state buffers of every parameter, by parameter
//!   name for the momentum (SGD, LARS), `exp_avg/<name>` and `exp_avg_sq/<name>` for AdamW,
//! - `meta.json`: the step, what the run was (model, dataset and its content fingerprint,
//!   strategy, ranks, batch, seed, optimizer settings and learning-rate schedule, binary) and
//!   the size and CRC-32 of each file,
//! - `meta.crc32`: the size and CRC-32 of `meta.json` itself, so that an edited step or
//!   setting is found like a damaged weight file.
//!
//! Rank 0 writes it into a hidden `.ckpt-<step>.partial` folder, syncs every file, and renames
//! the folder into place: an interrupted write leaves at most a partial folder that `--resume`
//! never looks at (a write that fails, on a full disk, removes it). A damaged complete
//! checkpoint (a file truncated or changed afterwards) fails its checks and the previous one is
//! used. The data order needs no state of its own: it is a function of the seed, the epoch and
//! the step.
//!
//! A run holds a lock (flock) on `.lock` in the folder while it runs, naming its process and
//! host there: two runs sharing a folder would prune and replace each other's checkpoints.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::error::{Error, Result, WithPath};
use crate::optim::{LrSchedule, OptimizerConfig};

pub const META_FILE: &str = "meta.json";
pub const WEIGHTS_FILE: &str = "weights.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The size and CRC-32 of meta.json (format 2 on).
pub const META_CHECK_FILE: &str = "meta.crc32";
pub const LOCK_FILE: &str = ".lock";
/// 2: meta.json covered by meta.crc32, the dataset's fingerprint recorded. 3: the optimizer's
/// kind and schedule recorded (issue 35). Formats 1 and 2 (SGD) are still read.
const FORMAT: u32 = 3;
const OLDEST_FORMAT: u32 = 1;

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
    /// [`crate::data::fingerprint`] of the dataset (empty in format 1).
    #[serde(default)]
    pub dataset_fingerprint: String,
    pub train_samples: usize,
    pub image_shape: Vec<usize>,
    pub classes: usize,
    pub strategy: String,
    pub ranks: usize,
    pub workers: usize,
    pub batch_per_rank: usize,
    pub global_batch: usize,
    pub seed: u64,
    /// The optimizer (`sgd` in formats 1 and 2, which read as SGD).
    #[serde(alias = "sgd")]
    pub optimizer: OptimizerConfig,
    /// The learning rate per step (absent before format 3: a constant rate).
    #[serde(default)]
    pub schedule: Option<LrSchedule>,
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

/// The folder of the checkpoint at `step` under `root`.
pub fn folder(root: &Path, step: u64) -> PathBuf {
    root.join(folder_name(step))
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

/// Writes a checkpoint (rank 0), then removes all but the newest `keep` complete ones. A write
/// that fails leaves no partial folder behind.
pub fn save(root: &Path, meta: CheckpointMeta, weights: &[(String, Tensor)], momentum: &[(String, Tensor)], keep: usize) -> Result<PathBuf> {
    let partial = root.join(format!(".{}.partial", folder_name(meta.step)));
    let _ = std::fs::remove_dir_all(&partial);
    let saved = write_complete(root, &partial, meta, weights, momentum);
    if saved.is_err() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    let final_dir = saved?;
    prune(root, keep);
    Ok(final_dir)
}

/// Writes the checkpoint into `partial`, then moves it into place.
fn write_complete(root: &Path, partial: &Path, mut meta: CheckpointMeta, weights: &[(String, Tensor)], momentum: &[(String, Tensor)]) -> Result<PathBuf> {
    let final_dir = root.join(folder_name(meta.step));
    std::fs::create_dir_all(partial).at(partial)?;
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
    write_synced(&meta_path, text.as_bytes())?;
    let check = FileCheck { bytes: text.len() as u64, crc32: crc32fast::hash(text.as_bytes()) };
    let check_path = partial.join(META_CHECK_FILE);
    let check_text = serde_json::to_string(&check).map_err(|e| Error::Checkpoint { path: check_path.clone(), reason: e.to_string() })?;
    write_synced(&check_path, check_text.as_bytes())?;
    sync_dir(partial);
    if final_dir.exists() {
        // The same step saved again (a resumed run reaching it): replace it only now that the
        // new one is complete.
        std::fs::remove_dir_all(&final_dir).at(&final_dir)?;
    }
    std::fs::rename(partial, &final_dir).at(&final_dir)?;
    sync_dir(root);
    Ok(final_dir)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).at(path)?;
    f.write_all(bytes).and_then(|_| f.sync_all()).at(path)
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
    let check_path = dir.join(META_CHECK_FILE);
    let covered = match std::fs::read_to_string(&check_path) {
        Ok(check) => {
            let expected: FileCheck = serde_json::from_str(&check).map_err(|e| bad(format!("{META_CHECK_FILE}: {e}")))?;
            if expected.bytes != text.len() as u64 || expected.crc32 != crc32fast::hash(text.as_bytes()) {
                return Err(bad(format!("{META_FILE} fails its CRC-32 check (edited or damaged)")));
            }
            true
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(bad(format!("{META_CHECK_FILE}: {e}"))),
    };
    let meta: CheckpointMeta = serde_json::from_str(&text).map_err(|e| bad(format!("{META_FILE}: {e}")))?;
    if !(OLDEST_FORMAT..=FORMAT).contains(&meta.format) {
        return Err(bad(format!("format {} (this binary reads formats {OLDEST_FORMAT} to {FORMAT})", meta.format)));
    }
    // From format 2 on, meta.json has its own check: one without it lost it.
    if meta.format >= 2 && !covered {
        return Err(bad(format!("{META_CHECK_FILE} is missing (damaged)")));
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

/// The lock a run holds on its checkpoint folder for as long as it runs (released when dropped,
/// or by the kernel when the process ends, however it ends). Where the file system refuses
/// flock, the run goes on without it, with a warning.
#[derive(Debug)]
pub struct FolderLock {
    _file: std::fs::File,
}

impl FolderLock {
    /// Takes the lock on `root` (created if needed), or says which run holds it.
    pub fn take(root: &Path) -> Result<FolderLock> {
        use std::io::Read;
        let refuse = |reason: String| Error::Checkpoint { path: root.to_path_buf(), reason };
        std::fs::create_dir_all(root).map_err(|e| refuse(format!("cannot create the folder: {e}")))?;
        let path = root.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| refuse(format!("cannot open {LOCK_FILE}: {e}")))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = if holder.trim().is_empty() { "which did not say who it is".to_string() } else { holder.trim().to_string() };
                return Err(refuse(format!(
                    "in use by another run ({holder}): two runs writing one folder remove and replace each other's checkpoints; give each run its own --checkpoint-dir"
                )));
            }
            // Some parallel file systems refuse flock (Lustre mounted without `flock`: ENOSYS).
            // The lock guards against a mistake; without it the run goes on, unguarded, and says so.
            Err(std::fs::TryLockError::Error(e)) => {
                log::warn!("{}: cannot lock {LOCK_FILE} ({e}); a second run sharing this folder would not be detected", root.display());
                return Ok(FolderLock { _file: file });
            }
        }
        // Who holds it, for the message the next run gets; the lock, not this text, decides.
        let me = format!("pid {} on {}, since {}\n", std::process::id(), crate::raw::hostname(), crate::results::timestamp());
        file.set_len(0).and_then(|()| file.write_all(me.as_bytes())).map_err(|e| refuse(format!("cannot write {LOCK_FILE}: {e}")))?;
        Ok(FolderLock { _file: file })
    }
}

/// Weights and momentum buffers of a checkpoint, by name.
/// The name of parameter `param`'s buffer of state slot `slot` in optimizer.safetensors: the
/// parameter's own name for the momentum (as formats 1 and 2 wrote it), `<slot>/<name>` else.
pub fn state_name(slot: &str, param: &str) -> String {
    match slot {
        "momentum" => param.to_string(),
        other => format!("{other}/{param}"),
    }
}

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
    // In words and flags, as the user gave them: not Rust's Debug (quoted strings, structs).
    let refuse = |what: &str, a: &dyn std::fmt::Display, b: &dyn std::fmt::Display| Err(format!("it was made with {what} {a}, this run uses {b}"));
    let dataset = |m: &CheckpointMeta| {
        let shape: Vec<String> = m.image_shape.iter().map(|d| d.to_string()).collect();
        format!("{} ({} training samples of {})", m.dataset, m.train_samples, shape.join("x"))
    };
    if saved.model != now.model {
        return refuse("model", &saved.model, &now.model);
    }
    if saved.dataset != now.dataset || saved.train_samples != now.train_samples || saved.image_shape != now.image_shape || saved.classes != now.classes {
        return refuse("dataset", &dataset(saved), &dataset(now));
    }
    let mut accepted = Vec::new();
    match (saved.dataset_fingerprint.as_str(), now.dataset_fingerprint.as_str()) {
        ("", _) => accepted.push("the checkpoint records no dataset fingerprint (format 1, an older binary): the dataset's content is not checked".to_string()),
        (a, b) if a != b => {
            return Err(format!(
                "it was made with another dataset of the same name and size (content fingerprint {a}; {b} for this run's file)"
            ))
        }
        _ => {}
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
    // Every synchronous strategy computes the same update from the same weights and momentum,
    // and none holds state of its own between steps (ZeRO's shards and the servers' momentum
    // are gathered into the checkpoint): any may continue another's checkpoint.
    let synchronous = |s: &str| matches!(s, "ring" | "rhd" | "auto" | "allreduce" | "horovod" | "ps");
    if saved.strategy != now.strategy && !(synchronous(&saved.strategy) && synchronous(&now.strategy)) {
        return refuse("strategy", &saved.strategy, &now.strategy);
    }
    if saved.strategy != now.strategy {
        accepted.push(format!("strategy {} -> {} (synchronous strategies compute the same update)", saved.strategy, now.strategy));
    }
    if saved.ranks != now.ranks || saved.workers != now.workers {
        accepted.push(format!("ranks {} -> {} with the same global batch of {}", saved.ranks, now.ranks, now.global_batch));
    }
    if saved.optimizer.kind != now.optimizer.kind {
        return Err(format!(
            "it was made with --optimizer {}, this run uses {} (their states differ: {} against {})",
            saved.optimizer.kind.name(),
            now.optimizer.kind.name(),
            saved.optimizer.kind.slots().join(", "),
            now.optimizer.kind.slots().join(", ")
        ));
    }
    if saved.optimizer != now.optimizer {
        let words = |c: &OptimizerConfig| format!("--lr {} {}", c.lr, c.describe());
        accepted.push(format!("optimizer settings {} -> {}", words(&saved.optimizer), words(&now.optimizer)));
    }
    if saved.schedule.is_some() && saved.schedule != now.schedule {
        let words = |m: &CheckpointMeta| match &m.schedule {
            Some(s) => format!("peak rate {}, {}, {} steps", s.peak, s.describe(m.steps_per_epoch), s.total_steps),
            None => "none recorded".to_string(),
        };
        accepted.push(format!("learning-rate schedule {} -> {} (the rate of each step follows this run's)", words(saved), words(now)));
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
            dataset_fingerprint: "fnv1a64:0000000000000001".into(),
            train_samples: 100,
            image_shape: vec![1, 8, 8],
            classes: 3,
            strategy: "ring".into(),
            ranks: 2,
            workers: 2,
            batch_per_rank: 4,
            global_batch: 8,
            seed: 1,
            optimizer: OptimizerConfig::sgd(0.1, 0.9, 0.0),
            schedule: None,
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
        // rhd and auto hold no state of their own: resumable like the others, both ways.
        for strategy in ["rhd", "auto"] {
            let other = CheckpointMeta { strategy: strategy.into(), ..meta(0) };
            assert!(check_compatible(&saved, &other).unwrap()[0].contains(&format!("strategy ring -> {strategy}")));
            assert!(check_compatible(&CheckpointMeta { step: 10, ..other.clone() }, &meta(0)).is_ok());
        }
        // Another file of the same name and size: its content fingerprint differs.
        let other_content = CheckpointMeta { dataset_fingerprint: "fnv1a64:0000000000000002".into(), ..meta(0) };
        assert!(check_compatible(&saved, &other_content).unwrap_err().contains("another dataset of the same name and size"));
        // A format-1 checkpoint has no fingerprint: accepted, and said.
        let old = CheckpointMeta { dataset_fingerprint: String::new(), ..meta(10) };
        assert!(check_compatible(&old, &meta(0)).unwrap()[0].contains("no dataset fingerprint"));
    }

    /// Issue 35: the optimizer's kind must match (its state would not fit), its settings and
    /// the schedule may change (said); format 2's `sgd` settings read as SGD.
    #[test]
    fn the_optimizer_kind_must_match_and_old_settings_read_as_sgd() {
        use crate::optim::{LrSchedule, OptimizerKind};
        let adamw = CheckpointMeta { optimizer: OptimizerConfig { kind: OptimizerKind::Adamw, ..meta(0).optimizer }, ..meta(10) };
        let err = check_compatible(&adamw, &meta(0)).unwrap_err();
        assert!(err.contains("--optimizer adamw, this run uses sgd") && err.contains("exp_avg, exp_avg_sq against momentum"), "{err}");
        let scheduled = CheckpointMeta { schedule: Some(LrSchedule::constant(0.1)), ..meta(10) };
        let longer = CheckpointMeta { schedule: Some(LrSchedule { total_steps: 20, ..LrSchedule::constant(0.1) }), ..meta(0) };
        // Said in words and flags, not as Rust's Debug structs (issue 48).
        let said = check_compatible(&scheduled, &longer).unwrap();
        assert_eq!(said[0], "learning-rate schedule peak rate 0.1, constant, 1 steps -> peak rate 0.1, constant, 20 steps (the rate of each step follows this run's)");
        let faster = CheckpointMeta { optimizer: OptimizerConfig { lr: 0.2, ..meta(0).optimizer }, ..meta(0) };
        let said = check_compatible(&meta(10), &faster).unwrap();
        assert!(said.iter().any(|s| s.starts_with("optimizer settings --lr 0.1 SGD (momentum") && s.contains("-> --lr 0.2 SGD (momentum")), "{said:?}");
        assert!(said.iter().all(|s| !s.contains('{') && !s.contains("Some(")), "{said:?}");
        let other_model = CheckpointMeta { model: "resnet18".into(), ..meta(0) };
        assert_eq!(check_compatible(&meta(10), &other_model).unwrap_err(), "it was made with model tiny, this run uses resnet18");
        let other_data = CheckpointMeta { train_samples: 50, ..meta(0) };
        assert_eq!(check_compatible(&meta(10), &other_data).unwrap_err(), "it was made with dataset d (100 training samples of 1x8x8), this run uses d (50 training samples of 1x8x8)");
        let mut json = serde_json::to_value(meta(10)).unwrap();
        let settings = json.as_object_mut().unwrap().remove("optimizer").unwrap();
        json["sgd"] = serde_json::json!({"lr": settings["lr"], "momentum": settings["momentum"], "weight_decay": settings["weight_decay"]});
        json.as_object_mut().unwrap().remove("schedule");
        let old: CheckpointMeta = serde_json::from_value(json).unwrap();
        assert_eq!((old.optimizer, old.schedule), (meta(10).optimizer, None));
        assert_eq!((state_name("momentum", "fc.weight"), state_name("exp_avg", "fc.weight")), ("fc.weight".to_string(), "exp_avg/fc.weight".to_string()));
    }

    #[test]
    fn an_edited_meta_json_is_refused() {
        let root = scratch("edited");
        let w = vec![("a".to_string(), Tensor::from_slice(&[1.0f32]))];
        save(&root, meta(4), &w, &w, 5).unwrap();
        save(&root, meta(8), &w, &w, 5).unwrap();
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
        assert!(save(&root, meta(3), &w, &w, 5).is_err());
        let left: Vec<String> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(left, vec![folder_name(3)], "only what was there before");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn one_run_at_a_time_holds_a_folder() {
        let root = scratch("lock");
        let held = FolderLock::take(&root).unwrap();
        // flock locks belong to the open file: a second open conflicts, in this process too.
        let err = FolderLock::take(&root).unwrap_err().to_string();
        assert!(err.contains(&format!("in use by another run (pid {} on ", std::process::id())), "{err}");
        drop(held);
        let _again = FolderLock::take(&root).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
    }
}
