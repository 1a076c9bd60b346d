//! What a checkpoint says about itself: meta.json (the step, the run it belongs to, the checks
//! of its files) and meta.crc32, and whether a run may continue from it.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result, WithPath};
use crate::optim::{LrSchedule, OptimizerConfig};

pub const META_FILE: &str = "meta.json";
pub const WEIGHTS_FILE: &str = "weights.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The size and CRC-32 of meta.json (format 2 on).
pub const META_CHECK_FILE: &str = "meta.crc32";
pub const LOCK_FILE: &str = ".lock";
/// The whole format's number. 2: meta.json covered by meta.crc32, the dataset's fingerprint
/// recorded. 3: the optimizer's kind and schedule recorded (issue 35). Formats 1 and 2 (SGD)
/// are still read.
pub const WHOLE_FORMAT: u32 = 3;
/// The sharded format (issue 49): one file of pieces per rank and index.json; meta.json as in
/// format 3, its `files` covering index.json, which covers the part files.
pub const SHARDED_FORMAT: u32 = 4;
pub const OLDEST_FORMAT: u32 = 1;


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

    /// Whether the checkpoint is sharded (index.json and part files) rather than whole.
    pub fn is_sharded(&self) -> bool {
        self.format >= SHARDED_FORMAT
    }
}

/// A complete, checked checkpoint.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub meta: CheckpointMeta,
}

/// Reads a checkpoint folder's meta.json, checked against meta.crc32 (formats 2 on) and for a
/// format this binary reads; the files it lists are checked by the format's own reader.
pub fn read_checked_meta(dir: &Path) -> Result<CheckpointMeta> {
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
    if !(OLDEST_FORMAT..=SHARDED_FORMAT).contains(&meta.format) {
        return Err(bad(format!("format {} (this binary reads formats {OLDEST_FORMAT} to {SHARDED_FORMAT})", meta.format)));
    }
    // From format 2 on, meta.json has its own check: one without it lost it.
    if meta.format >= 2 && !covered {
        return Err(bad(format!("{META_CHECK_FILE} is missing (damaged)")));
    }
    Ok(meta)
}

/// The name of parameter `param`'s buffer of state slot `slot` in optimizer.safetensors: the
/// parameter's own name for the momentum (as formats 1 and 2 wrote it), `<slot>/<name>` else.
pub fn state_name(slot: &str, param: &str) -> String {
    match slot {
        "momentum" => param.to_string(),
        other => format!("{other}/{param}"),
    }
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

/// The size and CRC-32 of a file, read in blocks (a part file may be larger than memory).
pub fn crc32_of(path: &Path) -> Result<FileCheck> {
    let mut file = std::fs::File::open(path).at(path)?;
    let mut hasher = crc32fast::Hasher::new();
    let mut block = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut block).at(path)?;
        if n == 0 {
            break;
        }
        hasher.update(&block[..n]);
        bytes += n as u64;
    }
    Ok(FileCheck { bytes, crc32: hasher.finalize() })
}

/// Checks that `dir/file` has the size and CRC-32 it was written with; the reason names the file.
pub fn check_file(dir: &Path, file: &str, expected: &FileCheck) -> std::result::Result<(), String> {
    let found = crc32_of(&dir.join(file)).map_err(|e| format!("{file}: {e}"))?;
    if found.bytes != expected.bytes {
        return Err(format!("{file} holds {} bytes, {} were written (truncated or replaced)", found.bytes, expected.bytes));
    }
    if found.crc32 != expected.crc32 {
        return Err(format!("{file} fails its CRC-32 check (damaged)"));
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A checkpoint's description for tests.
    pub(crate) fn meta(step: u64) -> CheckpointMeta {
        CheckpointMeta {
            format: WHOLE_FORMAT,
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
}
