//! `--overlap auto` on CPU ranks: which of the first steps run with the exchange overlapped and
//! which without, and the choice their times make (issue 51).
//!
//! Overlap pays where something is free to exchange while backward computes (a GPU); on CPU
//! ranks it may cost more than it hides (the exchange's thread takes cores, or memory
//! bandwidth, from backward), and whether it pays depends on the model, the cores and the
//! network. So auto measures it on the run itself: after the first step (with overlap, whose
//! buckets are then rebuilt from the order the gradients really arrived in), `rounds` rounds of
//! three steps without overlap then three with, so that a slow drift (caches warming, the data
//! reader's prefetch filling) weighs on both alike. The first step after each switch is not
//! timed: it pays for the switch (the gradients' storage changes hands between the bucket
//! views and backward's own tensors, whose fresh pages fault in), which a run that stays in one
//! mode never pays; on the 16-core GPU machine (2 ranks of 4 cores, ResNet-50) those first
//! steps without overlap were 5-20% slower than a run without overlap's steps. Each mode's
//! median timed step on each rank, the slowest rank's of those (every step ends in a
//! collective, so the slowest rank sets the pace), and overlap stays on only where it was
//! faster. Not the fastest step: steps with overlap vary more (two threads share the cores),
//! and there the fastest of a few was 10% under the mean of a run with overlap, so that a
//! trial comparing fastest steps chose overlap where it was 2-5% slower. Every step of the
//! trial trains as any other: the modes give the same gradients (within f32 summation order).

/// The steps of the trial, from the run's first step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverlapTrial {
    first: u64,
    rounds: u64,
}

/// Rounds of the trial: three steps without overlap, then three with; all but the first of
/// each three timed.
pub const TRIAL_ROUNDS: u64 = 2;

/// Steps of each mode in a round; the first is not timed.
const RUN: u64 = 3;

impl OverlapTrial {
    /// The trial of a run from `first` to `total` (exclusive), or None where the run is too
    /// short to have a step left after it: nothing it decided would be used.
    pub fn new(first: u64, total: u64, rounds: u64) -> Option<OverlapTrial> {
        let trial = OverlapTrial { first, rounds: rounds.max(1) };
        (trial.end() < total).then_some(trial)
    }

    /// The first step after the trial, the first that runs as it decided.
    pub fn end(&self) -> u64 {
        self.first + 1 + 2 * RUN * self.rounds
    }

    /// The steps the trial takes, the first included.
    pub fn steps(rounds: u64) -> u64 {
        1 + 2 * RUN * rounds.max(1)
    }

    /// Whether `step` runs with overlap during the trial; None after it.
    pub fn overlap_at(&self, step: u64) -> Option<bool> {
        if step >= self.end() {
            return None;
        }
        // The first step with overlap (not timed), then off, off, off, on, on, on, off, ...
        Some(step <= self.first || (step - self.first - 1) % (2 * RUN) >= RUN)
    }

    /// Whether `step`'s time counts for the mode with overlap (true) or without (false); None
    /// for a step whose time is not compared: the first, each first step after a switch, and
    /// those after the trial.
    pub fn timed(&self, step: u64) -> Option<bool> {
        (step > self.first && step < self.end() && !(step - self.first - 1).is_multiple_of(RUN)).then(|| (step - self.first - 1) % (2 * RUN) >= RUN)
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

/// The timed steps of each mode on one rank during the trial, in ms.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrialSteps {
    with_overlap: Vec<f64>,
    without: Vec<f64>,
}

impl TrialSteps {
    /// Adds a timed step of the mode `with_overlap`.
    pub fn add(&mut self, with_overlap: bool, ms: f64) {
        if with_overlap { &mut self.with_overlap } else { &mut self.without }.push(ms);
    }

    /// Each mode's median step (infinite for a mode without a timed step).
    pub fn medians(&self) -> TrialTimes {
        TrialTimes { with_overlap_ms: median(&self.with_overlap), without_ms: median(&self.without) }
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::INFINITY,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// A step time of each mode: one rank's median timed step, or the slowest rank's of those.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrialTimes {
    pub with_overlap_ms: f64,
    pub without_ms: f64,
}

impl TrialTimes {
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
    fn the_trial_times_all_but_the_first_step_of_each_mode_after_an_untimed_first_step() {
        let trial = OverlapTrial::new(10, 100, 2).unwrap();
        let modes: Vec<Option<bool>> = (10..25).map(|s| trial.overlap_at(s)).collect();
        let (on, off) = (Some(true), Some(false));
        assert_eq!(modes, vec![on, off, off, off, on, on, on, off, off, off, on, on, on, None, None]);
        let timed: Vec<Option<bool>> = (10..24).map(|s| trial.timed(s)).collect();
        assert_eq!(timed, vec![None, None, off, off, None, on, on, None, off, off, None, on, on, None]);
        assert_eq!((trial.end(), trial.last(), trial.first_timed(), OverlapTrial::steps(2)), (23, 22, 12, 13));
        for s in 10..23 {
            // Every timed step runs in the mode it counts for, after a step of that mode.
            if let Some(mode) = trial.timed(s) {
                assert_eq!(trial.overlap_at(s), Some(mode));
                assert_eq!(trial.overlap_at(s - 1), Some(mode), "step {s} follows a switch");
            }
        }
    }

    #[test]
    fn a_run_too_short_for_a_step_after_the_trial_has_none() {
        assert_eq!(OverlapTrial::new(0, 13, 2), None);
        assert!(OverlapTrial::new(0, 14, 2).is_some());
        assert_eq!(OverlapTrial::new(3, 16, 2), None);
    }

    #[test]
    fn overlap_stays_only_where_its_median_step_was_faster() {
        let mut t = TrialSteps::default();
        assert!(!t.medians().overlap_pays(), "unmeasured: off");
        // With overlap: one fast step among slower ones; its fastest would win, its median not.
        for ms in [80.0, 100.0, 104.0, 110.0] {
            t.add(true, ms);
        }
        for ms in [98.0, 99.0, 101.0, 120.0] {
            t.add(false, ms);
        }
        assert_eq!(t.medians(), TrialTimes { with_overlap_ms: 102.0, without_ms: 100.0 });
        assert!(!t.medians().overlap_pays());
        t.add(true, 70.0);
        assert_eq!(t.medians().with_overlap_ms, 100.0);
        assert!(!t.medians().overlap_pays(), "a tie goes to the mode without");
        t.add(true, 60.0);
        assert!(t.medians().overlap_pays());
    }
}
