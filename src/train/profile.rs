//! `--profile-dir`: libtorch's profiler over a few measured steps, one Chrome trace per rank.
//!
//! The window starts at the first measured step (after `--warmup-steps`: cuDNN's autotuner and
//! the allocator's first requests are behind it) and spans `--profile-steps` steps, each marked
//! "ProfilerStep#N" as torch.profiler marks its steps, so that hpc-train's traces and PyTorch's
//! read alike (scripts/trace_summary.py). The profiler starts one step before the window, as
//! torch.profiler's schedule warms up one step (scripts/gpu_reference.py): the first marked
//! step then pays no start-up of the profiler itself (CUPTI's first buffers), on either side. A
//! run that ends inside the window writes what it collected.
//!
//! Kineto writes the trace to `rank-R.json.tmp` and renames it, but a write that fails (a full
//! disk, a folder that cannot be written) only logs "Failed to write to log file!" and leaves
//! the truncated temporary: each trace is checked after it is written, and a failed one is
//! removed and ends the run non-zero once every rank's trace is in (issue 48).

use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::raw::{self, StepMark};

pub(super) struct StepProfile {
    /// The trace to write, None without --profile-dir.
    path: Option<PathBuf>,
    first: u64,
    end: u64,
    cuda: bool,
    active: bool,
    /// Where the trace went, or why it could not be written; None before it is written.
    written: Option<std::result::Result<String, String>>,
}

impl StepProfile {
    /// Steps `first..first + steps` (those before `total`) of the rank `rank`, written into `dir`.
    pub(super) fn new(dir: Option<&std::path::Path>, rank: i32, first: u64, steps: u64, total: u64, cuda: bool) -> StepProfile {
        let path = dir.map(|d| d.join(format!("rank-{rank}.json")));
        StepProfile { path, first, end: (first + steps).min(total), cuda, active: false, written: None }
    }

    /// Before `step`: collecting starts at the window's first step, and a step in the window is
    /// marked until the returned mark is dropped.
    pub(super) fn before_step(&mut self, step: u64) -> Result<Option<StepMark>> {
        if self.path.is_none() || step + 1 < self.first || step >= self.end {
            return Ok(None);
        }
        if !self.active {
            raw::profiler_start(self.cuda)?;
            self.active = true;
        }
        if step < self.first {
            // The profiler's warm-up step: collected, not marked, so not summarised.
            return Ok(None);
        }
        Ok(Some(StepMark::open(&format!("ProfilerStep#{step}"))?))
    }

    /// After `step`: the trace is written after the window's last step.
    pub(super) fn after_step(&mut self, step: u64) -> Result<()> {
        if step + 1 >= self.end { self.finish() } else { Ok(()) }
    }

    /// Writes the trace if collecting is still on (a run stopped inside the window).
    pub(super) fn finish(&mut self) -> Result<()> {
        match &self.path {
            Some(path) if self.active => {
                self.active = false;
                // A trace left by an earlier run must not pass for this one's.
                let _ = std::fs::remove_file(path);
                raw::profiler_stop(path)?;
                let dir = path.parent().unwrap_or(path);
                self.written = Some(match check_written(path) {
                    Ok(()) => Ok(format!("profile of steps {}..{} written to {} (rank-R.json for each rank R)", self.first, self.end, dir.display())),
                    Err(reason) => Err(format!("--profile-dir {}: {reason}", dir.display())),
                });
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// After [`Self::finish`]: None when no trace was written (no --profile-dir, or a run that
    /// ended before the window), else the line rank 0 prints once every rank's trace is in (the
    /// run agrees on them: `Run::agree_on_profile`), or why this rank's could not be written.
    pub(super) fn written(&mut self) -> Option<std::result::Result<String, String>> {
        self.written.take()
    }
}

/// Whether Kineto's write of `path` went through: renamed from its temporary and complete (a
/// Chrome trace ends with the closing brace of its object). A failed write's leftovers are
/// removed, so that nothing truncated stays behind to be read as a trace.
fn check_written(path: &Path) -> std::result::Result<(), String> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = PathBuf::from(temporary);
    let complete = match std::fs::read(path) {
        Ok(bytes) => bytes.trim_ascii_end().ends_with(b"}"),
        Err(_) => false,
    };
    if complete && !temporary.exists() {
        return Ok(());
    }
    let left = if temporary.exists() { format!("{name}.tmp") } else { name.clone() };
    let _ = std::fs::remove_file(&temporary);
    let _ = std::fs::remove_file(path);
    Err(format!(
        "the profiler could not write {name} (it left {left} unfinished: a full disk, or a folder that cannot be written?); the partial trace was removed"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_left_unfinished_is_removed_and_named() {
        let dir = std::env::temp_dir().join(format!("hpc-train-profile-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rank-1.json");
        let temporary = dir.join("rank-1.json.tmp");
        // Kineto's failed write: the truncated temporary alone.
        std::fs::write(&temporary, b"{\n  \"schemaVersion\": 1,\n  \"traceEvents\": [").unwrap();
        let reason = check_written(&path).unwrap_err();
        assert!(reason.contains("could not write rank-1.json (it left rank-1.json.tmp unfinished"), "{reason}");
        assert!(!temporary.exists() && !path.exists());
        // A renamed but truncated trace.
        std::fs::write(&path, b"{\"traceEvents\": [{\"ph\": \"X\"").unwrap();
        assert!(check_written(&path).unwrap_err().contains("it left rank-1.json unfinished"));
        assert!(!path.exists());
        // Nothing at all.
        assert!(check_written(&path).is_err());
        // A whole trace stays.
        std::fs::write(&path, b"{\"traceEvents\": []\n}\n").unwrap();
        assert_eq!(check_written(&path), Ok(()));
        assert!(path.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
