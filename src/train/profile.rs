//! `--profile-dir`: libtorch's profiler over a few measured steps, one Chrome trace per rank.
//!
//! The window starts at the first measured step (after `--warmup-steps`: cuDNN's autotuner and
//! the allocator's first requests are behind it) and spans `--profile-steps` steps, each marked
//! "ProfilerStep#N" as torch.profiler marks its steps, so that hpc-train's traces and PyTorch's
//! read alike (scripts/trace_summary.py). A run that ends inside the window writes what it
//! collected.

use std::path::PathBuf;

use crate::error::Result;
use crate::raw::{self, StepMark};

pub(super) struct StepProfile {
    /// The trace to write, None without --profile-dir.
    path: Option<PathBuf>,
    first: u64,
    end: u64,
    cuda: bool,
    active: bool,
    /// Rank 0 says where the traces went.
    announce: bool,
}

impl StepProfile {
    /// Steps `first..first + steps` (those before `total`) of the rank `rank`, written into `dir`.
    pub(super) fn new(dir: Option<&std::path::Path>, rank: i32, first: u64, steps: u64, total: u64, cuda: bool) -> StepProfile {
        let path = dir.map(|d| d.join(format!("rank-{rank}.json")));
        StepProfile { path, first, end: (first + steps).min(total), cuda, active: false, announce: rank == 0 }
    }

    /// Before `step`: collecting starts at the window's first step, and a step in the window is
    /// marked until the returned mark is dropped.
    pub(super) fn before_step(&mut self, step: u64) -> Result<Option<StepMark>> {
        if self.path.is_none() || step < self.first || step >= self.end {
            return Ok(None);
        }
        if !self.active {
            raw::profiler_start(self.cuda)?;
            self.active = true;
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
                raw::profiler_stop(path)?;
                if self.announce {
                    let dir = path.parent().unwrap_or(path);
                    log::info!("profile of steps {}..{} written to {} (rank-R.json for each rank R)", self.first, self.end, dir.display());
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
}
