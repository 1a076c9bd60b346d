//! The learning rate of every step: `--scale-lr` (the linear scaling rule of Goyal et al. 2017,
//! "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", or its square-root variant),
//! a linear warm-up, then constant, step, cosine or polynomial decay.
//!
//! A schedule is a pure function of the global step: a resumed run (same global batch, which
//! checkpoints insist on) takes the same rate at every step as the run it continues, whatever
//! its rank count, and nothing about it needs saving. The rules, with torch.optim.lr_scheduler's
//! equivalents (scripts/optim_reference.py runs them), for step s counted from 0, E steps per
//! epoch, T steps in all, W = round(warm-up epochs x E) warm-up steps:
//!
//! ```text
//! s <  W   peak (s + 1) / W                       LinearLR(1/W, 1.0, total_iters=W-1)
//! s >= W   t = s - W, D = max(T - W, 1)           then, after SequentialLR's milestone W:
//!   constant  peak
//!   step      peak gamma^k, k = milestones m (epochs) with m E <= s     MultiStepLR
//!   cosine    end + (peak - end) (1 + cos(pi t / D)) / 2               CosineAnnealingLR(D, end)
//!   poly      end + (peak - end) (1 - t / D)^power                     PolynomialLR (end 0)
//! ```
//!
//! The warm-up starts at peak / W rather than 0, so that no step is spent at rate 0.

use serde::{Deserialize, Serialize};

/// `--lr-schedule`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DecayKind {
    /// The peak rate after warm-up, unchanged to the end.
    #[default]
    Constant,
    /// Multiplied by --lr-gamma at each epoch of --lr-steps (ResNet's classic 30, 60, 80).
    Step,
    /// Half a cosine from the peak to --end-lr over the steps after warm-up.
    Cosine,
    /// (1 - progress)^--poly-power from the peak to --end-lr (MLPerf's LARS schedule).
    Poly,
}

impl DecayKind {
    pub fn name(self) -> &'static str {
        match self {
            DecayKind::Constant => "constant",
            DecayKind::Step => "step",
            DecayKind::Cosine => "cosine",
            DecayKind::Poly => "poly",
        }
    }
}

/// `--scale-lr`: how `--lr`, given for `--base-batch`, follows the global batch.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ScaleLr {
    /// --lr as given, whatever the batch.
    #[default]
    None,
    /// --lr x global batch / base batch (Goyal et al.).
    Linear,
    /// --lr x sqrt(global batch / base batch) (Krizhevsky 2014; common for Adam).
    Sqrt,
}

impl ScaleLr {
    /// The factor for `global_batch` against `base_batch`.
    pub fn factor(self, global_batch: usize, base_batch: usize) -> f64 {
        let ratio = global_batch as f64 / base_batch.max(1) as f64;
        match self {
            ScaleLr::None => 1.0,
            ScaleLr::Linear => ratio,
            ScaleLr::Sqrt => ratio.sqrt(),
        }
    }
}

/// A learning-rate schedule over a run's steps, resolved from the options and the run's size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// The rate after warm-up and before decay (--lr after --scale-lr).
    pub peak: f64,
    pub decay: DecayKind,
    pub warmup_steps: u64,
    /// The run's steps in all (the decay ends at the last one).
    pub total_steps: u64,
    /// Step decay: the steps at which the rate is multiplied by `gamma`.
    pub milestones: Vec<u64>,
    pub gamma: f64,
    pub end_lr: f64,
    pub power: f64,
}

impl LrSchedule {
    /// A constant rate (the parameter server's and the benchmarks' default).
    pub fn constant(lr: f64) -> LrSchedule {
        LrSchedule { peak: lr, decay: DecayKind::Constant, warmup_steps: 0, total_steps: 1, milestones: Vec::new(), gamma: 1.0, end_lr: 0.0, power: 1.0 }
    }

    /// The rate of step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        let w = self.warmup_steps;
        if step < w {
            return self.peak * (step + 1) as f64 / w as f64;
        }
        let t = (step - w) as f64;
        let d = self.total_steps.saturating_sub(w).max(1) as f64;
        let progress = (t / d).min(1.0);
        let (peak, end) = (self.peak, self.end_lr);
        match self.decay {
            DecayKind::Constant => peak,
            DecayKind::Step => peak * self.gamma.powi(self.milestones.iter().filter(|&&m| m <= step).count() as i32),
            DecayKind::Cosine => end + (peak - end) * (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0,
            DecayKind::Poly => end + (peak - end) * (1.0 - progress).powf(self.power),
        }
    }

    /// In words, for logs and runs.jsonl, in epochs so that runs of a weak-scaling study (whose
    /// steps per epoch differ with the ranks) read alike: `cosine to 0 after a 2-epoch warm-up`.
    pub fn describe(&self, steps_per_epoch: u64) -> String {
        let mut text = match self.decay {
            DecayKind::Constant => "constant".to_string(),
            DecayKind::Step => {
                let epochs: Vec<String> = self.milestones.iter().map(|m| format!("{}", *m as f64 / steps_per_epoch.max(1) as f64)).collect();
                format!("step x{} at epochs {}", self.gamma, epochs.join(","))
            }
            DecayKind::Cosine => format!("cosine to {}", self.end_lr),
            DecayKind::Poly => format!("poly^{} to {}", self.power, self.end_lr),
        };
        if self.warmup_steps > 0 {
            text += &format!(" after a {}-epoch warm-up", self.warmup_steps as f64 / steps_per_epoch.max(1) as f64);
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(decay: DecayKind, warmup_steps: u64, total_steps: u64) -> LrSchedule {
        LrSchedule { peak: 0.8, decay, warmup_steps, total_steps, milestones: vec![6, 8], gamma: 0.1, end_lr: 0.0, power: 2.0 }
    }

    #[test]
    fn warm_up_climbs_linearly_to_the_peak_without_a_zero_step() {
        let s = schedule(DecayKind::Constant, 4, 10);
        let rates: Vec<f64> = (0..6).map(|k| s.lr_at(k)).collect();
        for (got, want) in rates.iter().zip([0.2, 0.4, 0.6, 0.8, 0.8, 0.8]) {
            assert!((got - want).abs() < 1e-15, "{rates:?}");
        }
    }

    #[test]
    fn step_decay_multiplies_at_each_milestone() {
        let s = schedule(DecayKind::Step, 0, 10);
        let rates: Vec<f64> = (0..10).map(|k| s.lr_at(k)).collect();
        assert!(rates[..6].iter().all(|&r| r == 0.8));
        assert!((rates[6] - 0.08).abs() < 1e-15 && (rates[7] - 0.08).abs() < 1e-15);
        assert!((rates[8] - 0.008).abs() < 1e-15 && (rates[9] - 0.008).abs() < 1e-15);
    }

    #[test]
    fn cosine_and_poly_run_from_the_peak_after_warm_up_to_the_end_rate() {
        for decay in [DecayKind::Cosine, DecayKind::Poly] {
            let mut s = schedule(decay, 2, 12);
            s.end_lr = 0.1;
            assert_eq!(s.lr_at(2), 0.8, "{decay:?}: the peak right after warm-up");
            let rates: Vec<f64> = (2..12).map(|k| s.lr_at(k)).collect();
            assert!(rates.windows(2).all(|w| w[1] < w[0]), "{decay:?}: falls every step: {rates:?}");
            assert!(rates.iter().all(|&r| r > 0.1), "{decay:?}: above the end rate until the end");
            assert!((s.lr_at(12) - 0.1).abs() < 1e-15, "{decay:?}: the end rate one step past the last");
        }
        // Halfway through the decay: the cosine's midpoint, and the poly's (1/2)^2.
        let (cos, poly) = (schedule(DecayKind::Cosine, 0, 10), schedule(DecayKind::Poly, 0, 10));
        assert!((cos.lr_at(5) - 0.4).abs() < 1e-15);
        assert!((poly.lr_at(5) - 0.2).abs() < 1e-15);
    }

    #[test]
    fn the_rate_is_a_function_of_the_step_alone() {
        // What a resumed run relies on: no state, the same rate at the same step.
        let s = schedule(DecayKind::Cosine, 3, 20);
        let first: Vec<f64> = (0..20).map(|k| s.lr_at(k)).collect();
        let again: Vec<f64> = (0..20).rev().map(|k| s.lr_at(k)).rev().collect();
        assert_eq!(first, again);
    }

    #[test]
    fn scaling_follows_the_global_batch() {
        assert_eq!(ScaleLr::None.factor(2048, 256), 1.0);
        assert_eq!(ScaleLr::Linear.factor(2048, 256), 8.0);
        assert!((ScaleLr::Sqrt.factor(1024, 256) - 2.0).abs() < 1e-15);
        assert_eq!(ScaleLr::Linear.factor(128, 256), 0.5);
    }
}
