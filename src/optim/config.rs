//! The optimizer's settings: which one (`--optimizer`) and its hyper-parameters.

use serde::{Deserialize, Serialize};

/// `--optimizer`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// torch.optim.SGD: momentum and L2 weight decay.
    #[default]
    Sgd,
    /// Layer-wise adaptive rate scaling (You et al. 2017) with momentum, batch-norm parameters
    /// and biases excluded from adaptation and weight decay, as MLPerf's ResNet-50 reference.
    Lars,
    /// torch.optim.AdamW: Adam with decoupled weight decay and bias correction.
    Adamw,
}

impl OptimizerKind {
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Lars => "lars",
            OptimizerKind::Adamw => "adamw",
        }
    }

    /// The names of the state buffers each parameter has, in checkpoint order.
    pub fn slots(self) -> &'static [&'static str] {
        match self {
            OptimizerKind::Sgd | OptimizerKind::Lars => &["momentum"],
            OptimizerKind::Adamw => &["exp_avg", "exp_avg_sq"],
        }
    }

    /// `--weight-decay`'s default: hpc-train's SGD default, MLPerf's LARS one (ResNet-50,
    /// 5e-5), torch.optim.AdamW's.
    pub fn default_weight_decay(self) -> f64 {
        match self {
            OptimizerKind::Sgd => 1e-4,
            OptimizerKind::Lars => 5e-5,
            OptimizerKind::Adamw => 1e-2,
        }
    }
}

fn default_eta() -> f64 {
    0.001
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_eps() -> f64 {
    1e-8
}

/// The optimizer's settings. `lr` is the base rate of the command line; the rate of a step
/// comes from the [`LrSchedule`]. Checkpoints of binaries before issue 35 hold `{lr, momentum,
/// weight_decay}` only, which read as SGD.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct OptimizerConfig {
    #[serde(default)]
    pub kind: OptimizerKind,
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    #[serde(default = "default_eta")]
    pub lars_eta: f64,
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    #[serde(default = "default_eps")]
    pub eps: f64,
}

impl OptimizerConfig {
    /// Plain SGD with these settings (tests, benchmarks).
    pub fn sgd(lr: f64, momentum: f64, weight_decay: f64) -> OptimizerConfig {
        OptimizerConfig { kind: OptimizerKind::Sgd, lr, momentum, weight_decay, lars_eta: default_eta(), beta1: default_beta1(), beta2: default_beta2(), eps: default_eps() }
    }

    /// In words, for logs.
    pub fn describe(&self) -> String {
        match self.kind {
            OptimizerKind::Sgd => format!("SGD (momentum {}, weight decay {})", self.momentum, self.weight_decay),
            OptimizerKind::Lars => format!("LARS (eta {}, momentum {}, weight decay {})", self.lars_eta, self.momentum, self.weight_decay),
            OptimizerKind::Adamw => format!("AdamW (betas {}, {}, eps {}, weight decay {})", self.beta1, self.beta2, self.eps, self.weight_decay),
        }
    }
}
