//! The large-batch recipe's options (`--optimizer`, `--lr-schedule`, `--scale-lr`, ...): what
//! they mean together, their checks, and the optimizer and schedule a run builds from them.
//! The rules themselves are crate::optim's.

use clap::Args;

use crate::error::{Error, Result};
use crate::exchange::options::Given;

use crate::optim::{DecayKind, LrSchedule, OptimizerConfig, OptimizerKind, ScaleLr};

/// How training optimizes: the optimizer, its rate per step, the loss's label smoothing, and
/// the accuracy whose time is measured.
#[derive(Args, Debug, Clone)]
pub struct RecipeArgs {
    /// The optimizer: sgd (torch.optim.SGD), lars (layer-wise adaptive rate scaling, for large
    /// batches), adamw (torch.optim.AdamW).
    #[arg(long, value_enum, default_value_t = OptimizerKind::Sgd)]
    pub optimizer: OptimizerKind,

    /// Learning rate (the peak, after warm-up); with --scale-lr, the rate for --base-batch.
    #[arg(long, default_value_t = 0.05)]
    pub lr: f64,

    /// Momentum (sgd, lars).
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,

    /// Weight decay [default: sgd 1e-4 (L2, as torch.optim.SGD), lars 5e-5 (MLPerf's
    /// ResNet-50), adamw 0.01 (decoupled, torch.optim.AdamW's)].
    #[arg(long)]
    pub weight_decay: Option<f64>,

    /// LARS trust coefficient eta.
    #[arg(long, default_value_t = 0.001)]
    pub lars_eta: f64,

    /// AdamW's beta1 (first moment's decay).
    #[arg(long, default_value_t = 0.9)]
    pub adam_beta1: f64,

    /// AdamW's beta2 (second moment's decay).
    #[arg(long, default_value_t = 0.999)]
    pub adam_beta2: f64,

    /// AdamW's epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub adam_eps: f64,

    /// How the rate decays after warm-up.
    #[arg(long, value_enum, default_value_t = DecayKind::Constant)]
    pub lr_schedule: DecayKind,

    /// Linear warm-up from 0 to the peak rate over this many epochs (per step; may be fractional).
    #[arg(long, default_value_t = 0.0)]
    pub warmup_epochs: f64,

    /// Step decay: the epochs at which the rate is multiplied by --lr-gamma (e.g. 30,60,80).
    #[arg(long, value_delimiter = ',')]
    pub lr_steps: Vec<f64>,

    /// Step decay's factor.
    #[arg(long, default_value_t = 0.1)]
    pub lr_gamma: f64,

    /// The rate cosine and poly decay end at.
    #[arg(long, default_value_t = 0.0)]
    pub end_lr: f64,

    /// Poly decay's power (MLPerf's LARS schedule: 2).
    #[arg(long, default_value_t = 2.0)]
    pub poly_power: f64,

    /// Scale --lr with the global batch: linear (Goyal et al.'s rule), sqrt, or none.
    #[arg(long, value_enum, default_value_t = ScaleLr::None)]
    pub scale_lr: ScaleLr,

    /// The global batch --lr is given for, with --scale-lr.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub base_batch: u64,

    /// Label smoothing of the cross-entropy loss, as torch.nn.CrossEntropyLoss(label_smoothing).
    #[arg(long, default_value_t = 0.0)]
    pub label_smoothing: f64,

    /// Record when test accuracy first reaches this fraction (0-1; evaluated every epoch).
    #[arg(long)]
    pub target_accuracy: Option<f64>,
}

/// Options that only some optimizers or schedules read: (clap id, flag, who reads it).
const OPTIMIZER_OPTIONS: &[(&str, &str, &[OptimizerKind])] = {
    use OptimizerKind::*;
    &[
        ("momentum", "--momentum", &[Sgd, Lars]),
        ("lars_eta", "--lars-eta", &[Lars]),
        ("adam_beta1", "--adam-beta1", &[Adamw]),
        ("adam_beta2", "--adam-beta2", &[Adamw]),
        ("adam_eps", "--adam-eps", &[Adamw]),
    ]
};
const SCHEDULE_OPTIONS: &[(&str, &str, &[DecayKind])] = {
    use DecayKind::*;
    &[("lr_steps", "--lr-steps", &[Step]), ("lr_gamma", "--lr-gamma", &[Step]), ("end_lr", "--end-lr", &[Cosine, Poly]), ("poly_power", "--poly-power", &[Poly])]
};

impl RecipeArgs {
    /// The weight decay: given, or the optimizer's default.
    pub fn weight_decay(&self) -> f64 {
        self.weight_decay.unwrap_or(self.optimizer.default_weight_decay())
    }

    pub fn config(&self) -> OptimizerConfig {
        OptimizerConfig {
            kind: self.optimizer,
            lr: self.lr,
            momentum: if self.optimizer == OptimizerKind::Adamw { 0.0 } else { self.momentum },
            weight_decay: self.weight_decay(),
            lars_eta: self.lars_eta,
            beta1: self.adam_beta1,
            beta2: self.adam_beta2,
            eps: self.adam_eps,
        }
    }

    /// The schedule of a run of `total_steps` steps of `global_batch` samples, `steps_per_epoch`
    /// to an epoch.
    pub fn schedule(&self, global_batch: usize, steps_per_epoch: u64, total_steps: u64) -> LrSchedule {
        // The warm-up lasts the nearest whole number of steps; a milestone falls on the first
        // step at or after its epoch (the schedule's rule: k counts milestones m with m E <= s).
        let epochs_to_steps = |epochs: f64| (epochs * steps_per_epoch as f64).round() as u64;
        let first_step_from = |epochs: f64| (epochs * steps_per_epoch as f64).ceil() as u64;
        LrSchedule {
            peak: self.lr * self.scale_lr.factor(global_batch, self.base_batch as usize),
            decay: self.lr_schedule,
            warmup_steps: epochs_to_steps(self.warmup_epochs),
            total_steps,
            milestones: self.lr_steps.iter().map(|&e| first_step_from(e)).collect(),
            gamma: self.lr_gamma,
            end_lr: self.end_lr,
            power: self.poly_power,
        }
    }

    /// The values each option may take, and the combinations that mean nothing.
    pub fn check(&self, given: &Given) -> Result<()> {
        let positive = |flag: &str, v: f64| -> Result<()> {
            match v.is_finite() && v > 0.0 {
                true => Ok(()),
                false => Err(Error::usage(format!("{flag} {v}: expected a positive number"))),
            }
        };
        positive("--lr", self.lr)?;
        check_sgd_settings(self.momentum, self.weight_decay())?;
        positive("--lars-eta", self.lars_eta)?;
        positive("--adam-eps", self.adam_eps)?;
        positive("--poly-power", self.poly_power)?;
        positive("--lr-gamma", self.lr_gamma)?;
        self.check_f32_range()?;
        for (flag, beta) in [("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(Error::usage(format!("{flag} {beta}: expected 0 <= beta < 1 (as torch.optim.AdamW)")));
            }
        }
        if !(self.warmup_epochs.is_finite() && self.warmup_epochs >= 0.0) {
            return Err(Error::usage(format!("--warmup-epochs {}: expected 0 or more epochs", self.warmup_epochs)));
        }
        if !(self.end_lr.is_finite() && self.end_lr >= 0.0) {
            return Err(Error::usage(format!("--end-lr {}: expected a rate of 0 or more", self.end_lr)));
        }
        if self.lr_steps.iter().any(|e| !(e.is_finite() && *e > 0.0)) || self.lr_steps.windows(2).any(|w| w[1] <= w[0]) {
            let list: Vec<String> = self.lr_steps.iter().map(|e| e.to_string()).collect();
            return Err(Error::usage(format!("--lr-steps {}: expected increasing epochs above 0 (e.g. 30,60,80)", list.join(","))));
        }
        if self.lr_schedule == DecayKind::Step && self.lr_steps.is_empty() {
            return Err(Error::usage("--lr-schedule step needs --lr-steps (the epochs at which the rate drops, e.g. 30,60,80)"));
        }
        // torch.nn.CrossEntropyLoss takes 0 <= S <= 1: at 1 the targets are uniform.
        if !(0.0..=1.0).contains(&self.label_smoothing) {
            return Err(Error::usage(format!("--label-smoothing {}: expected 0 <= S <= 1 (as torch.nn.CrossEntropyLoss)", self.label_smoothing)));
        }
        if let Some(a) = self.target_accuracy {
            if !(a > 0.0 && a <= 1.0) {
                return Err(Error::usage(format!("--target-accuracy {a}: expected a fraction above 0 and at most 1 (0.9 for 90%)")));
            }
        }
        for &(id, flag, readers) in OPTIMIZER_OPTIONS {
            if given.has(id) && !readers.contains(&self.optimizer) {
                let names: Vec<&str> = readers.iter().map(|k| k.name()).collect();
                return Err(Error::usage(format!("{flag} is read by --optimizer {} only; this run uses {}", names.join(" or "), self.optimizer.name())));
            }
        }
        for &(id, flag, readers) in SCHEDULE_OPTIONS {
            if given.has(id) && !readers.contains(&self.lr_schedule) {
                let names: Vec<&str> = readers.iter().map(|k| k.name()).collect();
                return Err(Error::usage(format!("{flag} is read by --lr-schedule {} only; this run uses {}", names.join(" or "), self.lr_schedule.name())));
            }
        }
        if given.has("base_batch") && self.scale_lr == ScaleLr::None {
            return Err(Error::usage("--base-batch is read with --scale-lr linear or sqrt only (the batch --lr is given for)"));
        }
        Ok(())
    }

    /// The parameters are f32, and the optimizers take their settings as f32: a value beyond
    /// f32's range becomes infinite there, and so does an update whose factors multiply beyond
    /// it (the rate times the decay, or LARS's coefficient, of a weight of 1). Such runs ended
    /// in "non-finite loss" at the first step without naming the flag (issue 48).
    fn check_f32_range(&self) -> Result<()> {
        const MOST: f64 = f32::MAX as f64;
        for (flag, v) in [("--lr", self.lr), ("--weight-decay", self.weight_decay()), ("--lars-eta", self.lars_eta), ("--adam-eps", self.adam_eps), ("--end-lr", self.end_lr)] {
            if v.abs() > MOST {
                return Err(Error::usage(format!("{flag} {v:e}: beyond the largest f32 ({MOST:e}); the parameters are f32, and the first update would be infinite")));
            }
        }
        let mut products = vec![("--weight-decay", self.weight_decay())];
        if self.optimizer == OptimizerKind::Lars {
            products.push(("--lars-eta", self.lars_eta));
        }
        for (flag, v) in products {
            if self.lr * v > MOST {
                return Err(Error::usage(format!(
                    "--lr {:e} with {flag} {v:e}: their product ({:e}, a weight of 1's share of one update) is beyond the largest f32 ({MOST:e}); the parameters are f32, and the first update would be infinite",
                    self.lr,
                    self.lr * v
                )));
            }
        }
        Ok(())
    }

    /// The settings every rank must share, for the start-up comparison, by flag.
    pub fn fingerprint(&self) -> Vec<(String, String)> {
        let c = self.config();
        let list = |v: &[f64]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",");
        [
            ("optimizer", c.kind.name().to_string()),
            ("lr", c.lr.to_string()),
            ("momentum", c.momentum.to_string()),
            ("weight-decay", c.weight_decay.to_string()),
            ("lars-eta", c.lars_eta.to_string()),
            ("adam-betas", format!("{},{}", c.beta1, c.beta2)),
            ("adam-eps", c.eps.to_string()),
            ("lr-schedule", self.lr_schedule.name().to_string()),
            ("warmup-epochs", self.warmup_epochs.to_string()),
            ("lr-steps", list(&self.lr_steps)),
            ("lr-gamma", self.lr_gamma.to_string()),
            ("end-lr", self.end_lr.to_string()),
            ("poly-power", self.poly_power.to_string()),
            ("scale-lr", format!("{:?} {}", self.scale_lr, self.base_batch).to_lowercase()),
            ("label-smoothing", self.label_smoothing.to_string()),
            ("target-accuracy", format!("{:?}", self.target_accuracy)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

/// `--momentum` and `--weight-decay` as torch.optim.SGD takes them: it refuses a negative
/// momentum or weight decay. A momentum of 1 or more is refused as well: the momentum buffer
/// then never forgets a gradient, and grows without bound (1.5 ended at a loss of 1e10).
pub(super) fn check_sgd_settings(momentum: f64, weight_decay: f64) -> Result<()> {
    if !(0.0..1.0).contains(&momentum) {
        return Err(Error::usage(format!(
            "--momentum {momentum}: expected 0 <= momentum < 1 (torch.optim.SGD refuses a negative one; at 1 or more the momentum buffer never decays and training diverges)"
        )));
    }
    if !weight_decay.is_finite() || weight_decay < 0.0 {
        return Err(Error::usage(format!(
            "--weight-decay {weight_decay}: expected a finite weight decay of 0 or more (torch.optim.SGD refuses a negative one)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(extra: &[&str]) -> (RecipeArgs, Given) {
        #[derive(Parser)]
        struct Command {
            #[command(flatten)]
            recipe: RecipeArgs,
        }
        let mut argv = vec!["hpc-train"];
        argv.extend(extra);
        let matches = <Command as clap::CommandFactory>::command().try_get_matches_from(&argv).unwrap();
        let given = Given::from_matches(&matches);
        (<Command as clap::FromArgMatches>::from_arg_matches(&matches).unwrap().recipe, given)
    }

    fn check(extra: &[&str]) -> Result<()> {
        let (recipe, given) = parse(extra);
        recipe.check(&given)
    }

    #[test]
    fn sgd_settings_torch_refuses_are_refused() {
        assert!(check_sgd_settings(0.9, 1e-4).is_ok());
        assert!(check_sgd_settings(0.0, 0.0).is_ok());
        for (momentum, flag) in [(-5.0, "--momentum -5"), (1.0, "--momentum 1"), (1.5, "--momentum 1.5"), (f64::NAN, "--momentum NaN")] {
            let err = check_sgd_settings(momentum, 0.0).unwrap_err().to_string();
            assert!(err.starts_with(&format!("{flag}: expected 0 <= momentum < 1")), "{err}");
        }
        for (decay, flag) in [(-100.0, "--weight-decay -100"), (f64::NAN, "--weight-decay NaN"), (f64::INFINITY, "--weight-decay inf")] {
            assert!(check_sgd_settings(0.9, decay).unwrap_err().to_string().starts_with(flag));
        }
    }

    #[test]
    fn the_linear_rule_with_warm_up_resolves_to_steps() {
        let (recipe, _) = parse(&["--lr", "0.1", "--scale-lr", "linear", "--warmup-epochs", "2.5", "--lr-schedule", "step", "--lr-steps", "30,60"]);
        let s = recipe.schedule(2048, 10, 900);
        assert_eq!((s.peak, s.warmup_steps, s.milestones.clone(), s.total_steps), (0.8, 25, vec![300, 600], 900));
        // A milestone between steps takes effect at the next one (2.25 epochs of 1 step: step 3).
        let (fractional, _) = parse(&["--lr-schedule", "step", "--lr-steps", "2.25,4.5", "--warmup-epochs", "1.4"]);
        let s = fractional.schedule(64, 1, 10);
        assert_eq!((s.milestones.clone(), s.warmup_steps), (vec![3, 5], 1));
        let (sqrt, _) = parse(&["--lr", "0.1", "--scale-lr", "sqrt", "--base-batch", "512"]);
        assert!((sqrt.schedule(2048, 10, 900).peak - 0.2).abs() < 1e-15);
    }

    /// libtorch's cross-entropy takes a smoothing of 1 (uniform targets), as torch.nn's does:
    /// a finite loss, log(classes) above the mean log-probability, and a finite gradient.
    #[test]
    fn libtorch_takes_a_label_smoothing_of_one() {
        use tch::{Kind, Reduction, Tensor};
        let logits = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 0.5, -1.0, 0.0]).view([2, 3]).set_requires_grad(true);
        let labels = Tensor::from_slice(&[2i64, 0]);
        let loss = logits.f_cross_entropy_loss::<Tensor>(&labels, None, Reduction::Mean, -100, 1.0).unwrap();
        let uniform = -logits.log_softmax(-1, Kind::Float).mean_dim(-1, false, Kind::Float).mean(Kind::Float);
        assert!((loss.double_value(&[]) - uniform.double_value(&[])).abs() < 1e-6, "{loss} {uniform}");
        loss.backward();
        assert!(logits.grad().isfinite().all().int64_value(&[]) == 1);
    }

    #[test]
    fn weight_decay_defaults_follow_the_optimizer() {
        assert_eq!(parse(&[]).0.config().weight_decay, 1e-4);
        assert_eq!(parse(&["--optimizer", "lars"]).0.config().weight_decay, 5e-5);
        assert_eq!(parse(&["--optimizer", "adamw"]).0.config().weight_decay, 0.01);
        assert_eq!(parse(&["--optimizer", "adamw", "--weight-decay", "0"]).0.config().weight_decay, 0.0);
    }

    #[test]
    fn options_another_optimizer_or_schedule_reads_are_refused() {
        assert!(check(&["--optimizer", "lars", "--lars-eta", "0.002", "--lr-schedule", "poly", "--poly-power", "2", "--warmup-epochs", "5"]).is_ok());
        assert!(check(&["--optimizer", "adamw", "--adam-beta2", "0.98", "--lr-schedule", "cosine", "--end-lr", "0.001"]).is_ok());
        for (args, wanted) in [
            (&["--lars-eta", "0.01"][..], "--lars-eta is read by --optimizer lars only; this run uses sgd"),
            (&["--optimizer", "adamw", "--momentum", "0.8"][..], "--momentum is read by --optimizer sgd or lars only"),
            (&["--lr-steps", "10"][..], "--lr-steps is read by --lr-schedule step only; this run uses constant"),
            (&["--lr-schedule", "cosine", "--poly-power", "1"][..], "--poly-power is read by --lr-schedule poly only"),
            (&["--lr-schedule", "step"][..], "--lr-schedule step needs --lr-steps"),
            (&["--base-batch", "512"][..], "--base-batch is read with --scale-lr linear or sqrt only"),
            (&["--lr-schedule", "step", "--lr-steps", "20,10"][..], "--lr-steps 20,10: expected increasing epochs"),
            (&["--warmup-epochs=-1"][..], "--warmup-epochs -1: expected 0 or more"),
            (&["--label-smoothing", "1.01"][..], "--label-smoothing 1.01: expected 0 <= S <= 1 (as torch.nn.CrossEntropyLoss)"),
            (&["--label-smoothing=-0.1"][..], "--label-smoothing -0.1: expected 0 <= S <= 1"),
            (&["--label-smoothing", "NaN"][..], "--label-smoothing NaN: expected 0 <= S <= 1"),
            (&["--target-accuracy", "90"][..], "--target-accuracy 90: expected a fraction"),
            (&["--optimizer", "adamw", "--adam-beta1", "1"][..], "--adam-beta1 1: expected 0 <= beta < 1"),
            (&["--lr", "0"][..], "--lr 0: expected a positive number"),
            (&["--lr", "1e39"][..], "--lr 1e39: beyond the largest f32 (3.4028234663852886e38)"),
            (&["--weight-decay", "1e300"][..], "--weight-decay 1e300: beyond the largest f32"),
            (&["--optimizer", "lars", "--lars-eta", "1e300"][..], "--lars-eta 1e300: beyond the largest f32"),
            (&["--lr", "1e20", "--weight-decay", "1e20"][..], "--lr 1e20 with --weight-decay 1e20: their product (1e40, a weight of 1's share of one update) is beyond the largest f32"),
            (&["--optimizer", "lars", "--lr", "1e30", "--lars-eta", "1e10"][..], "--lr 1e30 with --lars-eta 1e10: their product (1e40,"),
        ] {
            let err = check(args).unwrap_err().to_string();
            assert!(err.contains(wanted), "{args:?}: {err}");
        }
        assert!(check(&["--label-smoothing", "1"]).is_ok());
    }
}
