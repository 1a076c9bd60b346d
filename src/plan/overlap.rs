//! `--overlap auto` on CPU ranks: which of the first steps run with the exchange overlapped and
//! which without, and the choice their times make (issue 51).
//!
//! Overlap pays where something is free to exchange while backward computes (a GPU); on CPU
//! ranks it may cost more than it hides (the exchange's thread takes cores, or memory
//! bandwidth, from backward), and whether it pays depends on the model, the cores and the
//! network. So auto measures it on the run itself: after the first step (with overlap, whose
//! buckets are then rebuilt from the order the gradients really arrived in), `pairs` rounds of
//! two steps without overlap then two with, so that a slow drift (caches warming, the data
//! reader's prefetch filling) weighs on both alike. Only the second step of each two is timed:
//! the first after a switch pays for the switch (the gradients' storage changes hands between
//! the bucket views and backward's own tensors, whose fresh pages fault in), which a run that
//! stays in one mode never pays; on the 16-core GPU machine (2 ranks of 4 cores, ResNet-50)
//! those first steps without overlap were 5-20% slower than a run without overlap, and a trial
//! that timed them chose overlap where it was slower. Each mode's fastest timed step on each
//! rank, the slowest rank's of those (every step ends in a collective, so the slowest rank sets
//! the pace), and overlap stays on only where it was faster. Every step of the trial trains as
//! any other: the modes give the same gradients (within f32 summation order).

/// The steps of the trial, from the run's first step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverlapTrial {
    first: u64,
    pairs: u64,
}

/// Rounds of the trial: two steps without overlap, then two with; the second of each timed.
pub const TRIAL_PAIRS: u64 = 2;

impl OverlapTrial {
    /// The trial of a run from `first` to `total` (exclusive), or None where the run is too
    /// short to have a step left after it: nothing it decided would be used.
    pub fn new(first: u64, total: u64, pairs: u64) -> Option<OverlapTrial> {
        let trial = OverlapTrial { first, pairs: pairs.max(1) };
        (trial.end() < total).then_some(trial)
    }

    /// The first step after the trial, the first that runs as it decided.
    pub fn end(&self) -> u64 {
        self.first + 1 + 4 * self.pairs
    }

    /// Whether `step` runs with overlap during the trial; None after it.
    pub fn overlap_at(&self, step: u64) -> Option<bool> {
        if step >= self.end() {
            return None;
        }
        // The first step with overlap (not timed), then off, off, on, on, off, off, ...
        Some(step <= self.first || (step - self.first - 1) % 4 >= 2)
    }

    /// Whether `step`'s time counts for the mode with overlap (true) or without (false); None
    /// for a step whose time is not compared: the first, each first step after a switch, and
    /// those after the trial.
    pub fn timed(&self, step: u64) -> Option<bool> {
        (step > self.first && step < self.end() && (step - self.first - 1) % 2 == 1).then(|| (step - self.first - 1) % 4 == 3)
    }

    /// The first step the trial times.
    pub fn first_timed(&self) -> u64 {
        self.first + 2
    }

    /// The last step of the trial, after which the choice is made.
    pub fn last(&self) -> u64 {
        self.end() - 1
    }
}

/// The fastest step time of each mode on one rank during the trial.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrialTimes {
    pub with_overlap_ms: f64,
    pub without_ms: f64,
}

impl Default for TrialTimes {
    fn default() -> TrialTimes {
        TrialTimes { with_overlap_ms: f64::INFINITY, without_ms: f64::INFINITY }
    }
}

impl TrialTimes {
    /// Adds a timed step of the mode `with_overlap`.
    pub fn add(&mut self, with_overlap: bool, ms: f64) {
        let slot = if with_overlap { &mut self.with_overlap_ms } else { &mut self.without_ms };
        *slot = slot.min(ms);
    }

    /// Overlap stays on only where it was faster (ties and unmeasured go to the mode without,
    /// which takes no thread from backward).
    pub fn overlap_pays(&self) -> bool {
        self.with_overlap_ms < self.without_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trial_times_the_second_step_of_each_mode_after_an_untimed_first_step() {
        let trial = OverlapTrial::new(10, 100, 2).unwrap();
        let modes: Vec<Option<bool>> = (10..20).map(|s| trial.overlap_at(s)).collect();
        let (on, off) = (Some(true), Some(false));
        assert_eq!(modes, vec![on, off, off, on, on, off, off, on, on, None]);
        let timed: Vec<Option<bool>> = (10..20).map(|s| trial.timed(s)).collect();
        assert_eq!(timed, vec![None, None, off, None, on, None, off, None, on, None]);
        assert_eq!((trial.end(), trial.last(), trial.first_timed()), (19, 18, 12));
        for s in 10..19 {
            // Every timed step runs in the mode it counts for, after a step of that mode.
            if let Some(mode) = trial.timed(s) {
                assert_eq!(trial.overlap_at(s), Some(mode));
                assert_eq!(trial.overlap_at(s - 1), Some(mode), "step {s} follows a switch");
            }
        }
    }

    #[test]
    fn a_run_too_short_for_a_step_after_the_trial_has_none() {
        assert_eq!(OverlapTrial::new(0, 9, 2), None);
        assert!(OverlapTrial::new(0, 10, 2).is_some());
        assert_eq!(OverlapTrial::new(3, 12, 2), None);
    }

    #[test]
    fn overlap_stays_only_where_its_fastest_step_was_faster() {
        let mut t = TrialTimes::default();
        assert!(!t.overlap_pays(), "unmeasured: off");
        t.add(true, 100.0);
        t.add(true, 90.0);
        t.add(false, 95.0);
        t.add(false, 120.0);
        assert_eq!(t, TrialTimes { with_overlap_ms: 90.0, without_ms: 95.0 });
        assert!(t.overlap_pays());
        t.add(false, 90.0);
        assert!(!t.overlap_pays(), "a tie goes to the mode without");
    }
}
