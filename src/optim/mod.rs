//! The optimizer every strategy steps: SGD, LARS or AdamW (`--optimizer`), at the rate of the
//! learning-rate schedule ([`schedule`]).
//!
//! One [`Optimizer`] serves every strategy. The averaging strategies step it on whole parameter
//! tensors; ZeRO on its shards, a parameter server on its share; both as *pieces*, flat views of
//! parts of parameter tensors, each tagged with the tensor it belongs to. SGD and AdamW are
//! element-wise, so pieces change nothing. LARS scales each layer by a ratio of norms over the
//! whole layer: pieces add their squared norms per layer, and a sharded caller sums those over
//! the ranks (one small all-reduce per bucket) before any piece is updated, so that every shard
//! steps with the whole layer's ratio. The rules, in PyTorch's terms, are in the files of each:
//! sgd.rs, lars.rs, adamw.rs.
//!
//! State: one buffer per piece for each of the optimizer's slots (SGD and LARS: `momentum`;
//! AdamW: `exp_avg`, `exp_avg_sq`), made at the first step, or handed over whole from a
//! checkpoint by [`Optimizer::restore`], and the count of steps taken (AdamW's bias correction).

mod adamw;
mod config;
mod finite;
mod lars;
mod rule;
pub mod schedule;
mod sgd;

use std::time::{Duration, Instant};

use tch::Tensor;

use crate::error::Result;

pub use config::{OptimizerConfig, OptimizerKind};
pub use finite::{all_finite, define_grads, defined_grad, defined_grads, flag_not_finite, grads_finite, release_grads, zero_grads, FiniteCheck};
pub use rule::Pieces;
use rule::Step;
pub use schedule::{DecayKind, LrSchedule, ScaleLr};

pub struct Optimizer {
    pub config: OptimizerConfig,
    schedule: LrSchedule,
    /// The rate of the step under way ([`Optimizer::begin_step`]).
    lr: f64,
    /// Per parameter tensor: excluded from LARS's adaptation and weight decay.
    exempt: Vec<bool>,
    /// `state[slot][i]`: the buffer of slot `slot` of piece `i` (None until its first step).
    state: Vec<Vec<Option<Tensor>>>,
    steps: u64,
    /// Time spent in `step` since the last `take_busy`.
    busy: Duration,
    /// Tensor parallelism: which tensors are parts of layers cut over a group.
    layer_parts: Option<LayerParts>,
    /// A flag on the device under which updates change nothing ([`Optimizer::skip_if`]).
    skip_if: Option<Tensor>,
    /// What gradients are multiplied by before they update ([`Optimizer::unscale_by`]).
    unscale: Option<f64>,
}

/// Tensor parallelism's parameter tensors, for LARS: some are this rank's part of a layer whose
/// other parts the group's other ranks hold (its ratio of norms must be the whole layer's), the
/// others whole copies that every rank of the group holds alike (counted once).
pub struct LayerParts {
    /// Per parameter tensor: a part of a layer cut over the group.
    pub cut: Vec<bool>,
    /// This rank's copies of whole tensors count in the group's sums (its first rank); the
    /// other ranks add zeros for them, so that the sum is the copy's own figure, exactly.
    pub counts_whole: bool,
    /// Sums per-layer figures over the group, in place (collective over the group).
    pub sum_over_group: Box<dyn FnMut(&mut Tensor) -> Result<()> + Send>,
}

impl Optimizer {
    /// `exempt[t]`: parameter tensor t takes no LARS adaptation or decay (see [`exempt_from_lars`]).
    pub fn new(config: OptimizerConfig, schedule: LrSchedule, exempt: Vec<bool>) -> Optimizer {
        let lr = schedule.lr_at(0);
        let slots = config.kind.slots().len();
        Optimizer { config, schedule, lr, exempt, state: (0..slots).map(|_| Vec::new()).collect(), steps: 0, busy: Duration::ZERO, layer_parts: None, skip_if: None, unscale: None }
    }

    /// Makes LARS's norms those of whole layers where this rank holds parts of them (tensor
    /// parallelism; see [`LayerParts`]), whole tensors or ZeRO's pieces of them alike.
    pub fn set_layer_parts(&mut self, parts: LayerParts) {
        self.layer_parts = Some(parts);
    }

    pub fn kind(&self) -> OptimizerKind {
        self.config.kind
    }

    pub fn schedule(&self) -> &LrSchedule {
        &self.schedule
    }

    /// Makes the updates that follow change nothing where `flag` (a one-element float tensor on
    /// the parameters' device) holds a non-zero value, as GradScaler skips a step: the fused
    /// SGD and AdamW kernels read it on the device, so that a step's finiteness check needs no
    /// read by the host (the training step reads the flag later, with the loss). LARS, and the
    /// rare tensor that the fused kernels cannot take, read it on the host. None: always update.
    pub fn skip_if(&mut self, flag: Option<Tensor>) {
        self.skip_if = flag;
    }

    /// Makes the updates that follow first multiply their gradients by `inv_scale` (fp16's loss
    /// scaler, as GradScaler's unscale), wherever the gradients are by then: averaged whole, or in
    /// ZeRO's and stage 3's shards. The one place that unscales, so that every
    /// layout's update takes the same values. None: as they are.
    pub fn unscale_by(&mut self, inv_scale: Option<f64>) {
        self.unscale = inv_scale;
    }

    /// Sets the rate for global step `step` (0-based): the schedule follows the global step,
    /// also where a step is skipped (fp16 overflow) or the run resumed.
    pub fn begin_step(&mut self, step: u64) {
        self.lr = self.schedule.lr_at(step);
    }

    /// The rate of the step under way.
    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// Updates taken (restored from a checkpoint on resume).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Applies one update to `params` from `grads` (same shapes, same order), and counts it.
    /// `grads` may be used as scratch.
    pub fn step(&mut self, params: &mut [Tensor], grads: &mut [Tensor]) -> Result<()> {
        let all: Vec<usize> = (0..params.len()).collect();
        self.step_some(params, grads, &all)?;
        self.count_step();
        Ok(())
    }

    /// Counts a step made of several `step_some`/`step_pieces` calls (one per bucket).
    pub fn count_step(&mut self) {
        self.steps += 1;
    }

    /// Updates the whole parameter tensors at `which`; does not count a step. Their state is
    /// theirs alone, so a step made bucket by bucket equals one made at once.
    pub fn step_some(&mut self, params: &mut [Tensor], grads: &mut [Tensor], which: &[usize]) -> Result<()> {
        self.step_pieces(params, grads, which, Pieces::Whole)
    }

    /// Updates the pieces at `which` (see [`Pieces`]); does not count a step.
    pub fn step_pieces(&mut self, params: &mut [Tensor], grads: &mut [Tensor], which: &[usize], pieces: Pieces) -> Result<()> {
        let started = Instant::now();
        assert_eq!(params.len(), grads.len(), "one gradient per parameter");
        for slot in &mut self.state {
            if slot.len() != params.len() {
                slot.resize_with(params.len(), || None);
            }
        }
        let step = Step { lr: self.lr, count: self.steps + 1, config: &self.config, skip_if: self.skip_if.as_ref() };
        if self.config.kind == OptimizerKind::Lars && step.skipped()? {
            self.busy += started.elapsed();
            return Ok(());
        }
        if let Some(inv_scale) = self.unscale {
            tch::no_grad(|| which.iter().map(|&i| &grads[i]).filter(|g| g.defined()).try_for_each(|g| g.shallow_clone().f_mul_scalar_(inv_scale).map(drop)))?;
        }
        tch::no_grad(|| -> Result<()> {
            match self.config.kind {
                OptimizerKind::Sgd => sgd::update(&step, params, grads, &mut self.state[0], which),
                OptimizerKind::Adamw => {
                    let (first, second) = self.state.split_at_mut(1);
                    adamw::update(&step, params, grads, &mut first[0], &mut second[0], which)
                }
                OptimizerKind::Lars => match &mut self.layer_parts {
                    None => lars::update(&step, params, grads, &mut self.state[0], which, &self.exempt, pieces),
                    Some(parts) => {
                        // Tensor parallelism: each layer's squared norms from this rank's
                        // pieces (ZeRO's shards summed over the replicas first), then summed over
                        // the group; the rows of whole copies (lars.rs lists the adapted layers
                        // in order), which every rank of the group holds alike, zeroed first on
                        // all but one rank.
                        let whole_layers: Vec<usize>;
                        let (layer_of, layers, mut over_replicas) = match pieces {
                            Pieces::Whole => {
                                whole_layers = (0..params.len()).collect();
                                (&whole_layers[..], which, None)
                            }
                            Pieces::Parts { layer_of, layers, sum_over_ranks } => (layer_of, layers, Some(sum_over_ranks)),
                        };
                        let exempt = &self.exempt;
                        let adapted: Vec<usize> = layers.iter().copied().filter(|&l| !exempt.get(l).copied().unwrap_or(false)).collect();
                        let copies: Vec<i64> = adapted.iter().enumerate().filter(|&(_, &l)| !parts.cut[l]).map(|(row, _)| row as i64).collect();
                        let counts_whole = parts.counts_whole;
                        let sum_over_group = &mut parts.sum_over_group;
                        let mut sum_over_ranks = |sums: &mut Tensor| -> Result<()> {
                            if let Some(sum_over_replicas) = over_replicas.as_mut() {
                                sum_over_replicas(sums)?;
                            }
                            if !counts_whole && !copies.is_empty() {
                                let rows = Tensor::f_from_slice(&copies)?.f_to_device(sums.device())?;
                                let _ = sums.f_index_fill_(0, &rows, 0.0)?;
                            }
                            sum_over_group(sums)
                        };
                        let pieces = Pieces::Parts { layer_of, layers, sum_over_ranks: &mut sum_over_ranks };
                        lars::update(&step, params, grads, &mut self.state[0], which, exempt, pieces)
                    }
                },
            }
        })?;
        self.busy += started.elapsed();
        Ok(())
    }

    /// Time spent stepping since the last call.
    pub fn take_busy(&mut self) -> Duration {
        std::mem::take(&mut self.busy)
    }

    /// The buffers of state slot `slot` (see [`OptimizerKind::slots`]), per piece; None before
    /// a piece's first step.
    pub fn state(&self, slot: usize) -> &[Option<Tensor>] {
        &self.state[slot]
    }

    /// Bytes of optimizer state held.
    pub fn state_bytes(&self) -> usize {
        self.state.iter().flatten().flatten().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum()
    }

    /// Takes over `state[slot][piece]` (from a checkpoint, or re-cut along new shards) and the
    /// count of steps taken. An empty `state` starts every buffer afresh.
    pub fn restore(&mut self, state: Vec<Vec<Option<Tensor>>>, steps: u64) {
        let slots = self.config.kind.slots().len();
        self.state = if state.is_empty() { (0..slots).map(|_| Vec::new()).collect() } else { state };
        assert_eq!(self.state.len(), slots, "one list per state slot");
        self.steps = steps;
    }
}

/// The tensors LARS leaves unadapted and undecayed: those of at most one dimension, which in
/// ResNet and the tiny CNN are exactly the batch-norm weights and biases and every bias (MLPerf's
/// reference and NVIDIA's DeepLearningExamples skip the same ones, by name).
pub fn exempt_from_lars(params: &[Tensor]) -> Vec<bool> {
    exempt_by_dims(params.iter().map(Tensor::dim))
}

/// [`exempt_from_lars`] from the parameters' numbers of dimensions (`--zero 3` knows its
/// parameters by their declared shapes: they hold no memory between its steps).
pub fn exempt_by_dims(dims: impl IntoIterator<Item = usize>) -> Vec<bool> {
    dims.into_iter().map(|d| d <= 1).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The optimizer steps at the schedule's rate for the global step it is told, counts its
    /// updates, and takes its state and count back from a checkpoint.
    #[test]
    fn steps_at_the_scheduled_rate_and_restores_its_state() {
        let schedule = LrSchedule { warmup_steps: 4, total_steps: 8, ..LrSchedule::constant(0.4) };
        let mut optimizer = Optimizer::new(OptimizerConfig::sgd(0.4, 0.0, 0.0), schedule, Vec::new());
        let mut w = vec![Tensor::from_slice(&[1.0f32])];
        for step in [0, 2] {
            optimizer.begin_step(step);
            optimizer.step(&mut w, &mut [Tensor::from_slice(&[1.0f32])]).unwrap();
        }
        // Rates 0.1 (step 0 of a 4-step warm-up) and 0.3 (step 2).
        assert!((w[0].double_value(&[0]) - 0.6).abs() < 1e-6, "{w:?}");
        assert_eq!((optimizer.steps(), optimizer.lr()), (2, 0.30000000000000004));
        let mut adamw = Optimizer::new(OptimizerConfig { kind: OptimizerKind::Adamw, ..OptimizerConfig::sgd(0.1, 0.0, 0.0) }, LrSchedule::constant(0.1), Vec::new());
        adamw.restore(vec![vec![Some(Tensor::from_slice(&[0.5f32]))], vec![Some(Tensor::from_slice(&[0.25f32]))]], 7);
        assert_eq!((adamw.steps(), adamw.state_bytes()), (7, 8));
        adamw.restore(Vec::new(), 0);
        assert_eq!(adamw.state_bytes(), 0);
    }

    /// Under a set skip flag no rule changes a weight, on the fused path (a dense gradient) or
    /// the separate one (a transposed gradient, which the fused kernels cannot take); under a
    /// clear flag each updates as without one.
    #[test]
    fn a_set_skip_flag_leaves_the_weights_unchanged() {
        let kinds = [OptimizerKind::Sgd, OptimizerKind::Adamw, OptimizerKind::Lars];
        for kind in kinds {
            for transposed in [false, true] {
                let w0 = Tensor::from_slice(&(0..12).map(|i| (i as f32 * 0.3).cos()).collect::<Vec<_>>()).view([3, 4]);
                let g = Tensor::from_slice(&(0..12).map(|i| (i as f32 * 0.7).sin()).collect::<Vec<_>>()).view([3, 4]);
                let g = if transposed { g.tr().contiguous().tr() } else { g };
                let moved = |flag: Option<f32>| {
                    let config = OptimizerConfig { kind, ..OptimizerConfig::sgd(0.1, 0.9, 1e-2) };
                    let mut optimizer = Optimizer::new(config, LrSchedule::constant(0.1), vec![false]);
                    optimizer.skip_if(flag.map(|f| Tensor::from_slice(&[f])));
                    let mut w = vec![w0.copy()];
                    optimizer.begin_step(0);
                    optimizer.step(&mut w, &mut [g.copy()]).unwrap();
                    (&w[0] - &w0).abs().max().double_value(&[])
                };
                assert_eq!(moved(Some(1.0)), 0.0, "{kind:?}, transposed {transposed}: moved under a set flag");
                let (clear, none) = (moved(Some(0.0)), moved(None));
                assert!(clear > 1e-4 && clear == none, "{kind:?}, transposed {transposed}: {clear} under a clear flag, {none} without one");
            }
        }
    }
}
