//! How a run's model is cut and held, as one value ([`RunLayout`]) that set-up builds from the
//! plan and the one training step (step.rs) hands its work to: the layout kinds are pieces
//! behind the step, not step bodies of their own (as torchtitan applies tensor, data and
//! pipeline parallelism to the model before its one `train_step`).
//!
//! - the cut across ranks of a layer: `--tensor-parallel`'s groups, or none;
//! - what this rank computes a step over ([`Part`]): whole layers (a replica, or a tensor part
//!   of one), with the exchange after backward or overlapped with it; a pipeline stage and its
//!   schedule over micro-batches; or `--zero 3`'s units, gathered one after another;
//! - how gradients are averaged: the run's `Exchange` (the strategy, ZeRO 1/2's sharded update,
//!   or stage 3's shards), which the [`Run`](super::run::Run) holds beside the layout.

use crate::overlap::Overlap;
use crate::topology::World;

use super::fsdp::FullySharded;
use super::pipeline::Pipeline;
use super::tensor::TensorParallel;

/// The run's layout: the tensor-parallel cut, and the part of the model a step computes here.
pub(super) struct RunLayout {
    /// `--tensor-parallel`: the groups, their all-reduce behind the model's layers and its
    /// counts; None where each rank computes whole layers.
    pub(super) tensor: Option<TensorParallel>,
    pub(super) part: Part,
}

/// What this rank computes a step over, and so how its forward and backward run.
pub(super) enum Part {
    /// Whole layers: forward and backward, the exchange after backward, or bucket by bucket
    /// beside it (`overlap`, which `--overlap auto`'s trial may end).
    Whole { overlap: Option<Overlap> },
    /// A pipeline stage (`--pipeline-stages`): its schedule over the micro-batches, then the
    /// exchange among the stage's replicas, or chunk by chunk beside each chunk's last
    /// backward (the stage's overlap, which `--overlap auto`'s trial may end).
    Stage(Pipeline),
    /// `--zero 3`: unit by unit, each gathered before it computes, its gradients
    /// reduce-scattered after its backward.
    Units(FullySharded),
}

impl RunLayout {
    pub(super) fn pipeline(&self) -> Option<&Pipeline> {
        match &self.part {
            Part::Stage(p) => Some(p),
            _ => None,
        }
    }

    pub(super) fn pipeline_mut(&mut self) -> Option<&mut Pipeline> {
        match &mut self.part {
            Part::Stage(p) => Some(p),
            _ => None,
        }
    }

    pub(super) fn fsdp(&self) -> Option<&FullySharded> {
        match &self.part {
            Part::Units(f) => Some(f),
            _ => None,
        }
    }

    /// The overlap of backward with the exchange, while the run has one.
    pub(super) fn overlap(&self) -> Option<&Overlap> {
        match &self.part {
            Part::Whole { overlap } => overlap.as_ref(),
            Part::Stage(p) => p.overlap.as_ref(),
            Part::Units(_) => None,
        }
    }

    /// Ends the overlap (`--overlap auto`'s trial found that it did not pay).
    pub(super) fn stop_overlapping(&mut self) {
        match &mut self.part {
            Part::Whole { overlap } => *overlap = None,
            Part::Stage(p) => p.overlap = None,
            Part::Units(_) => {}
        }
    }

    /// Whether each rank computes the whole model alone, with nothing beside backward: the
    /// layout whose step one GPU rank may leave unread on the device (step::DeferredChecks).
    pub(super) fn is_plain(&self) -> bool {
        matches!(self.part, Part::Whole { overlap: None }) && self.tensor.is_none()
    }

    /// The ranks that hold this rank's part of the model alike, where the model is cut.
    pub(super) fn part_replicas(&self) -> Option<&World> {
        part_replicas(self.pipeline(), self.tensor.as_ref())
    }
}

/// The ranks that hold this rank's part of the model alike, where the model is cut: a stage's
/// replicas in a pipeline (with tensor parallelism, those of the same part), the replicas of
/// this rank's part under tensor parallelism alone; None where every worker holds the whole
/// model. One rule for set-up's exchange, the checkpoints' writers and evaluation's averages.
pub(super) fn part_replicas<'a>(pipeline: Option<&'a Pipeline>, tensor_parallel: Option<&'a TensorParallel>) -> Option<&'a World> {
    match (pipeline, tensor_parallel) {
        (Some(p), _) => Some(&p.stage_world),
        (None, Some(tp)) => Some(&tp.replicas),
        (None, None) => None,
    }
}
