//! The checkpoint folders on disk: their names, the partial folder a write goes into and the
//! rename that completes it, syncing, pruning, which folders are checkpoints (never an output),
//! and the lock a run holds on the folder.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result, WithPath};

use super::index::INDEX_FILE;
use super::meta::{CheckpointMeta, FileCheck, LOCK_FILE, META_CHECK_FILE, META_FILE, WEIGHTS_FILE};

/// The folder name of the checkpoint after `step`.
pub fn folder_name(step: u64) -> String {
    format!("ckpt-{step:012}")
}

/// The hidden folder a checkpoint is written into before it is renamed into place.
pub fn partial_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!(".{}.partial", folder_name(step)))
}

pub fn sync_dir(dir: &Path) {
    // Makes the rename durable; not every file system supports syncing a folder.
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).at(path)?;
    f.write_all(bytes).and_then(|_| f.sync_all()).at(path)
}


/// Writes `meta` (its format set to `format`) as meta.json and its check as meta.crc32 into the
/// partial folder, each synced.
pub fn write_meta(partial: &Path, mut meta: CheckpointMeta, format: u32) -> Result<()> {
    meta.format = format;
    let meta_path = partial.join(META_FILE);
    let text = serde_json::to_string_pretty(&meta).map_err(|e| Error::Checkpoint { path: meta_path.clone(), reason: e.to_string() })?;
    write_synced(&meta_path, text.as_bytes())?;
    let check = FileCheck { bytes: text.len() as u64, crc32: crc32fast::hash(text.as_bytes()) };
    let check_path = partial.join(META_CHECK_FILE);
    let check_text = serde_json::to_string(&check).map_err(|e| Error::Checkpoint { path: check_path.clone(), reason: e.to_string() })?;
    write_synced(&check_path, check_text.as_bytes())
}

/// Moves the complete `partial` folder to `final_dir` (replacing the same step saved before,
/// now that the new one is complete) and makes the rename durable.
pub fn place(root: &Path, partial: &Path, final_dir: &Path) -> Result<()> {
    sync_dir(partial);
    if final_dir.exists() {
        // The same step saved again (a resumed run reaching it): replace it only now that the
        // new one is complete.
        std::fs::remove_dir_all(final_dir).at(final_dir)?;
    }
    std::fs::rename(partial, final_dir).at(final_dir)?;
    sync_dir(root);
    Ok(())
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

/// Which complete checkpoints a write leaves in its folder (see [`prune`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// Good checkpoints kept, the one just written counted (0 reads as 1: the one written).
    pub keep: usize,
    /// The checkpoint the run resumed from, kept for the whole run beside the newest `keep`: a
    /// resume may go on with changed settings (accepted with a warning), and the run can always
    /// be taken again from where it started.
    pub resumed_from: Option<u64>,
}

impl Retention {
    /// The newest `keep` good checkpoints, for a write that resumed from none.
    pub fn newest(keep: usize) -> Retention {
        Retention { keep, resumed_from: None }
    }
}

/// Called once the checkpoint of step `written` is complete in `root`: removes the good
/// checkpoints older than it beyond the newest `retention.keep` ([`steps_to_prune`]), good by
/// [`super::index::check_sizes`] (no data read). A damaged one is logged and left alone, and
/// so is a folder that cannot be removed.
pub fn prune(root: &Path, written: u64, retention: Retention) {
    let damage = |step: u64| super::index::check_sizes(&root.join(folder_name(step))).err();
    let mut found_damaged = Vec::new();
    let good = |step: u64| match damage(step) {
        None => true,
        Some(e) => {
            found_damaged.push(e);
            false
        }
    };
    let remove = steps_to_prune(&list_steps(root), written, retention, good);
    for e in found_damaged {
        log::warn!("left in place, neither counted among the {} kept nor removed: {e}", retention.keep.max(1));
    }
    for step in remove {
        let dir = root.join(folder_name(step));
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            log::warn!("could not remove old checkpoint {}: {e}", dir.display());
        }
    }
}

/// The steps [`prune`] removes from a folder holding the checkpoints `steps` once the one of
/// step `written` is complete, where `good(step)` says whether a checkpoint is whole. Only good
/// checkpoints older than `written` go: the newest `keep - 1` of them stay beside it, and so
/// does the one the run resumed from. A newer checkpoint is never removed (another run's, or a
/// damaged one this run replaces when it reaches that step), nor a damaged one, which counts
/// for none of those kept: removing by step number alone deleted the checkpoint just written
/// whenever the folder held a higher step, and left no good one beside a newer damaged one.
fn steps_to_prune(steps: &[u64], written: u64, retention: Retention, mut good: impl FnMut(u64) -> bool) -> Vec<u64> {
    let mut older: Vec<u64> = steps.iter().copied().filter(|&s| s < written).collect();
    older.sort_unstable_by(|a, b| b.cmp(a));
    older
        .into_iter()
        .filter(|&s| good(s))
        .skip(retention.keep.max(1) - 1)
        .filter(|&s| Some(s) != retention.resumed_from)
        .collect()
}

/// The checkpoint folder that `path` is or lies in, if any (see [`is_checkpoint_folder`]),
/// through links and `..`: where nothing may be written but the checkpoint itself. A checkpoint
/// folder is an input wherever it is: resume and `consolidate` read it, verification fails on
/// any changed byte, and pruning removes it whole with whatever was put in it.
pub fn checkpoint_folder_of(path: &Path) -> Option<PathBuf> {
    let absolute = std::path::absolute(path).ok()?;
    // What does not exist yet holds no checkpoint: from the nearest existing ancestor up.
    let existing = absolute.ancestors().find(|p| p.exists())?.canonicalize().ok()?;
    existing.ancestors().find(|dir| is_checkpoint_folder(dir)).map(Path::to_path_buf)
}

/// Refuses an output (`what`: the option or argument that names it) that is or lies in a
/// checkpoint folder ([`checkpoint_folder_of`]).
pub fn check_not_in_checkpoint(what: &str, path: &Path) -> Result<()> {
    let Some(folder) = checkpoint_folder_of(path) else { return Ok(()) };
    let place = match std::path::absolute(path).ok().and_then(|p| p.canonicalize().ok()) {
        Some(real) if real == folder => "is the checkpoint folder",
        _ => "lies in the checkpoint folder",
    };
    Err(Error::usage(format!(
        "{what} {}: it {place} {}, which is read and checked as a whole and removed whole when pruned (a file written there damages the checkpoint or goes with it); write it elsewhere",
        path.display(),
        folder.display()
    )))
}

/// Whether `dir` is a checkpoint folder: one being written (`.ckpt-<step>.partial`), or one
/// with meta.json beside the files it covers, under any name (`consolidate` reads a copy
/// anywhere), or a `ckpt-<step>` folder holding any of a checkpoint's own files (damaged).
fn is_checkpoint_folder(dir: &Path) -> bool {
    if !dir.is_dir() {
        return false;
    }
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let step_named = |prefix: &str, suffix: &str| name.strip_prefix(prefix).and_then(|n| n.strip_suffix(suffix)).is_some_and(|n| n.parse::<u64>().is_ok());
    let has = |file: &str| dir.join(file).is_file();
    step_named(".ckpt-", ".partial")
        || (has(META_FILE) && (has(META_CHECK_FILE) || has(INDEX_FILE) || has(WEIGHTS_FILE)))
        || (step_named("ckpt-", "") && (has(META_FILE) || has(META_CHECK_FILE) || has(INDEX_FILE)))
}

pub fn list_steps(root: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_prefix("ckpt-")).and_then(|s| s.parse().ok()))
        .collect()
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A fresh folder for one test (absent until written).
    pub(crate) fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hpc-train-ckpt-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// Every path in a checkpoint folder leads to it (through a link, `..`, or a file not yet
    /// there): a complete one, a copy under another name, one being written. The folder of
    /// checkpoints, and a folder of the user's with a meta.json of its own, are not one.
    #[test]
    fn a_checkpoint_folder_is_found_from_any_path_in_it() {
        let root = scratch("folders");
        let ckpt = root.join(folder_name(4));
        let copy = root.join("kept");
        let partial = partial_dir(&root, 6);
        let mine = root.join("mine");
        for dir in [&ckpt, &copy, &partial, &mine] {
            std::fs::create_dir_all(dir).unwrap();
        }
        for (dir, files) in [(&ckpt, &[META_FILE, META_CHECK_FILE, "part-00000.safetensors"][..]), (&copy, &[META_FILE, INDEX_FILE]), (&mine, &[META_FILE])] {
            for file in files {
                std::fs::write(dir.join(file), b"{}").unwrap();
            }
        }
        std::os::unix::fs::symlink(&ckpt, root.join("link")).unwrap();
        let real = |p: &Path| Some(p.canonicalize().unwrap());
        assert_eq!(checkpoint_folder_of(&ckpt.join("part-00000.safetensors")), real(&ckpt));
        assert_eq!(checkpoint_folder_of(&ckpt), real(&ckpt));
        assert_eq!(checkpoint_folder_of(&ckpt.join("new/w.safetensors")), real(&ckpt));
        assert_eq!(checkpoint_folder_of(&root.join("link/index.json")), real(&ckpt));
        assert_eq!(checkpoint_folder_of(&mine.join("../kept/out.safetensors")), real(&copy));
        assert_eq!(checkpoint_folder_of(&partial.join("part-00001.safetensors")), real(&partial));
        for outside in [root.clone(), root.join("w.safetensors"), mine.join("w.safetensors"), PathBuf::from("relative/w.safetensors")] {
            assert_eq!(checkpoint_folder_of(&outside), None, "{}", outside.display());
        }
        let part = ckpt.join("part-00000.safetensors");
        let err = check_not_in_checkpoint("OUT", &part).unwrap_err().to_string();
        assert!(err.starts_with(&format!("OUT {}: it lies in the checkpoint folder {}", part.display(), ckpt.canonicalize().unwrap().display())), "{err}");
        let err = check_not_in_checkpoint("TO", &ckpt).unwrap_err().to_string();
        assert!(err.contains(": it is the checkpoint folder "), "{err}");
        assert!(check_not_in_checkpoint("OUT", &root.join("w.safetensors")).is_ok());
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
