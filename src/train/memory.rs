//! Peak resident memory per phase of a run: set-up (from the process's start: MPI, libtorch, the
//! model in parts, a resume's reads), the training steps, evaluations, checkpoints, and the end
//! (the last checkpoint, --save-weights, the record). What a layout exists for is what one rank
//! holds (issue 49), and a whole run's peak does not say which phase reached it: each phase
//! restarts the kernel's high-water mark (raw::restart_peak_rss) and keeps the highest it
//! reached over all its occurrences.
//!
//! Memory is the process's, so the recorder is too: one per process, entered from wherever a
//! phase begins, with a guard that returns to the phase before.

use std::sync::Mutex;

use crate::raw;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    SetUp,
    Training,
    Evaluation,
    Checkpoint,
    End,
}

impl Phase {
    pub(super) const ALL: [Phase; 5] = [Phase::SetUp, Phase::Training, Phase::Evaluation, Phase::Checkpoint, Phase::End];

    /// The name the record gives it.
    pub(super) fn name(self) -> &'static str {
        match self {
            Phase::SetUp => "set-up",
            Phase::Training => "training",
            Phase::Evaluation => "evaluation",
            Phase::Checkpoint => "checkpoint",
            Phase::End => "end",
        }
    }

    fn index(self) -> usize {
        Phase::ALL.iter().position(|&p| p == self).expect("every phase is in ALL")
    }
}

struct Recorder {
    current: Phase,
    /// The highest mark each phase reached, in MiB; None for a phase not entered yet.
    peaks: [Option<f64>; Phase::ALL.len()],
    /// False where the kernel cannot restart the mark: then no phase is told apart.
    restartable: bool,
}

/// The process starts in set-up, whose mark runs from the process's start.
static RECORDER: Mutex<Recorder> = Mutex::new(Recorder { current: Phase::SetUp, peaks: [None; Phase::ALL.len()], restartable: true });

fn recorder() -> std::sync::MutexGuard<'static, Recorder> {
    RECORDER.lock().unwrap_or_else(|e| e.into_inner())
}

impl Recorder {
    /// Closes the current phase: its peak takes the mark, which then restarts.
    fn close(&mut self) {
        if !self.restartable {
            return;
        }
        let Some(mark) = raw::peak_rss_since_restart_mb() else {
            self.restartable = false;
            return;
        };
        let slot = &mut self.peaks[self.current.index()];
        *slot = Some(slot.map_or(mark, |p| p.max(mark)));
        self.restartable = raw::restart_peak_rss();
    }

    /// Closes the current phase and makes `phase` the current one (nothing when it already is).
    fn move_to(&mut self, phase: Phase) {
        if self.current != phase {
            self.close();
            self.current = phase;
        }
    }
}

/// Moves to `phase` for good (set-up to training, training to the end).
pub(super) fn switch(phase: Phase) {
    recorder().move_to(phase);
}

/// Enters `phase` until the guard is dropped, which returns to the phase before.
#[must_use = "the phase lasts as long as the guard"]
pub(super) fn enter(phase: Phase) -> PhaseGuard {
    let mut r = recorder();
    let before = r.current;
    r.move_to(phase);
    PhaseGuard { before }
}

pub(super) struct PhaseGuard {
    before: Phase,
}

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        recorder().move_to(self.before);
    }
}

/// Each phase entered so far with its peak in MiB, the current one's up to now; empty where the
/// kernel could not tell phases apart (then only the run's peak means anything).
pub(super) fn peaks() -> Vec<(Phase, f64)> {
    let mut r = recorder();
    r.close();
    if !r.restartable {
        return Vec::new();
    }
    Phase::ALL.iter().filter_map(|&p| r.peaks[p.index()].map(|mb| (p, mb))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each phase keeps the highest mark of its occurrences, and a phase after a large one does
    /// not inherit its peak. (Other unit tests share the process and may allocate meanwhile;
    /// the blocks here are far larger than what they hold at once.)
    #[test]
    fn each_phase_keeps_its_own_peak() {
        let _alone = raw::process::MEMORY_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let touch = |mib: usize| {
            let mut block = vec![0u8; mib << 20];
            block.iter_mut().step_by(4096).for_each(|b| *b = 1);
            drop(std::hint::black_box(block));
        };
        let training = enter(Phase::Training);
        {
            let _evaluation = enter(Phase::Evaluation);
            touch(512);
        }
        touch(8);
        drop(training);
        let peaks = peaks();
        let of = |phase: Phase| peaks.iter().find(|(p, _)| *p == phase).map(|(_, mb)| *mb).unwrap_or_else(|| panic!("{phase:?} in {peaks:?}"));
        assert!(of(Phase::Evaluation) > of(Phase::Training) + 256.0, "{peaks:?}");
        assert!(raw::peak_rss_mb() >= of(Phase::Evaluation) - 1.0, "{peaks:?}");
        assert_eq!(recorder().current, Phase::SetUp, "the guards return to the phase before");
    }
}
