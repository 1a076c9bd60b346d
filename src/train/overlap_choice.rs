//! What `--overlap` comes to on a run, and why: `on` and `off` as asked (where they can apply),
//! `auto` (the default) on where it pays. A GPU rank overlaps (the device computes backward
//! while the host exchanges: 1.2-1.3x on the H200, results/device/); a CPU rank measures both
//! modes over the first steps and keeps the faster ([`OverlapTrial`]), every rank alike, since
//! on CPU ranks overlap has measured anywhere from 10% slower to a little faster (issue 51).
//! The log's line and the record's `overlap_reason` say which and why. A pipeline stage's
//! overlap is chosen the same way, alike on every stage.

use std::time::Duration;

use mpi::traits::*;

use crate::error::Result;
use crate::exchange::{self, Training};
use crate::model::InputSpec;
use crate::overlap::{one_bucket, Overlap};
use crate::plan::overlap::{OverlapTrial, TrialSteps, TrialTimes, TRIAL_ROUNDS};
use crate::topology::World;

use super::net::{variable_blocks, Net};
use super::options::{OnOff, TrainArgs};
use super::pipeline::Pipeline;
use super::plan::Plan;

/// `--overlap auto` during its trial, and why overlap runs or not.
pub(super) struct OverlapChoice {
    /// During the trial on CPU ranks: its steps and this rank's timed steps of each mode.
    pub(super) trial: Option<(OverlapTrial, TrialSteps)>,
    /// Why overlap runs or not (the log's line, the record's `overlap_reason`).
    pub(super) reason: String,
    /// The trial's figures once it decided: the slowest rank's median timed step of each mode.
    pub(super) measured: Option<TrialTimes>,
    /// Test hook ([`TRIAL_PENALTY_ENV`]): milliseconds added to each timed step of one mode
    /// (true: with overlap), so that a test can make either choice happen.
    penalty: Option<(bool, f64)>,
}

/// Test hook: `with:MS` or `without:MS` adds MS to every timed step of that mode in the trial.
pub const TRIAL_PENALTY_ENV: &str = "HPC_TRAIN_TEST_OVERLAP_PENALTY";

impl OverlapChoice {
    pub(super) fn fixed(reason: impl Into<String>) -> OverlapChoice {
        OverlapChoice { trial: None, reason: reason.into(), measured: None, penalty: None }
    }
}

/// The test hook's setting, if any (a malformed one is ignored: it is no user's option).
fn trial_penalty() -> Option<(bool, f64)> {
    let value = std::env::var(TRIAL_PENALTY_ENV).ok()?;
    let (mode, ms) = value.split_once(':')?;
    Some((mode == "with", ms.parse().ok()?))
}

/// The overlap of a data-parallel run (not the parameter server's, whose servers take whole
/// shares after backward) and what decided it; `steps`: the run's first and end steps. In a
/// pipeline (`stage`: this rank's, and the model's input, which names the blocks that hold its
/// parameters), among the stage's replicas, chunk by chunk; decided alike on every rank of
/// `world` (the trial's verdict is agreed over it).
#[allow(clippy::too_many_arguments)]
pub(super) fn make_overlap(
    world: &World,
    args: &TrainArgs,
    plan: &Plan,
    net: &Net,
    exchange: &mut dyn Training,
    bucket_bytes: usize,
    steps: (u64, u64),
    stage: Option<(&Pipeline, InputSpec)>,
) -> Result<(Option<Overlap>, OverlapChoice)> {
    let off = |reason: &str| Ok((None, OverlapChoice::fixed(reason)));
    if args.overlap == OnOff::Off {
        return off("--overlap off");
    }
    // Refused when asked for (plan/compat.rs): the servers take whole shares after backward.
    if args.strategy == exchange::StrategyKind::Ps {
        return off("the parameter server takes whole shares after backward");
    }
    // ZeRO's overlap steps each shard during backward, before fp16's loss scaler has seen
    // every gradient (an explicit --overlap on is refused: train/plan.rs).
    if args.precision == super::options::Precision::Fp16 && exchange.zero().is_some() {
        return off("fp16's loss scaler decides before any shard steps, which ZeRO's overlap would step during backward");
    }
    // One rank exchanges nothing: backward on a thread of its own would only cost a hand-over.
    let replicas = stage.as_ref().map_or(world, |(p, _)| &p.stage_world);
    if replicas.size == 1 {
        return off(if stage.is_some() { "one pipeline: a stage has no replica to exchange with; backward runs on the MPI thread" } else { "one rank has nothing to exchange; backward runs on the MPI thread" });
    }
    // Each parameter's chunk's place among the chunks' last backwards; none under the split
    // schedules, whose W's are not overlapped (refused when asked for: plan/compat.rs).
    let segments = match &stage {
        Some((p, spec)) => match p.param_segments(&net.param_names, &variable_blocks(args.model, *spec).1) {
            Some(segments) => Some(segments),
            None => return off("the zero-bubble schedules' weight gradients (their W's) are not exchanged beside backward"),
        },
        None => None,
    };
    // One bucket is exchanged after the last gradient however backward runs; on a thread of
    // its own, backward would only add hand-overs (measured on the tiny CNN, results/). In a
    // pipeline, where the stages' parameters differ, only where every stage's fit one.
    let fits = one_bucket(&net.params, bucket_bytes);
    let fits = if stage.is_some() { world.sum_f64(f64::from(u8::from(!fits))) == 0.0 } else { fits };
    if fits {
        return off("every gradient fits one bucket (--bucket-mib), which is exchanged after backward; backward runs on the MPI thread");
    }
    let choice = match (args.overlap, plan.device.is_cuda(), OverlapTrial::new(steps.0, steps.1, TRIAL_ROUNDS)) {
        (OnOff::On, ..) => OverlapChoice::fixed("--overlap on"),
        (_, true, _) => OverlapChoice::fixed("a GPU rank: the device computes backward while the host exchanges"),
        (_, false, Some(trial)) => OverlapChoice {
            trial: Some((trial, TrialSteps::default())),
            reason: format!("a CPU rank: measured over steps {}..{}, three without and three with overlap by turns, all but the first of each three timed", trial.first_timed() - 1, trial.last()),
            measured: None,
            penalty: trial_penalty(),
        },
        (_, false, None) => {
            return off(&format!("a CPU rank, and too few steps to measure whether overlap pays (the trial takes {} and one after)", OverlapTrial::steps(TRIAL_ROUNDS)));
        }
    };
    // Gradients as views into the buckets' buffers, but under ZeRO, whose own buffer holds the
    // packed buckets (and stage 2 lets go of the gradients).
    let views = exchange.zero().is_none();
    let overlap = match segments {
        Some((segment_of, segments)) => Overlap::with_segments(&net.params, &segment_of, segments, bucket_bytes, replicas.comm.duplicate(), views),
        None => Overlap::new(&net.params, bucket_bytes, world.comm.duplicate(), views),
    };
    let overlap = world.agree(overlap)?;
    Ok((Some(overlap), choice))
}

impl OverlapChoice {
    /// Whether `step` runs with overlap, where there is one: during the trial, as it says.
    pub(super) fn overlaps_at(&self, step: u64) -> bool {
        self.trial.as_ref().and_then(|(trial, _)| trial.overlap_at(step)).unwrap_or(true)
    }

    /// During `--overlap auto`'s trial, counts the step's time; after its last step, every rank
    /// agrees on the choice (the slowest rank's median timed step of each mode, collective over
    /// `world`) and it returns whether overlap stays. None on every other step.
    pub(super) fn note_step(&mut self, step: u64, took: Duration, world: &World) -> Option<bool> {
        let (trial, times) = self.trial.as_mut()?;
        if let Some(with_overlap) = trial.timed(step) {
            let penalty = self.penalty.filter(|&(mode, _)| mode == with_overlap).map_or(0.0, |(_, ms)| ms);
            times.add(with_overlap, took.as_secs_f64() * 1e3 + penalty);
        }
        if step != trial.last() {
            return None;
        }
        let mine = times.medians();
        let agreed = TrialTimes { with_overlap_ms: world.max_f64(mine.with_overlap_ms), without_ms: world.max_f64(mine.without_ms) };
        let pays = agreed.overlap_pays();
        let reason = format!(
            "{}: {:.1} ms a step with overlap, {:.1} without (each mode's median timed step, the slowest rank's)",
            self.reason, agreed.with_overlap_ms, agreed.without_ms
        );
        if world.is_root() {
            log::info!("--overlap auto: {} ({reason})", if pays { "on" } else { "off" });
        }
        *self = OverlapChoice { trial: None, reason, measured: Some(agreed), penalty: None };
        Some(pays)
    }

    /// The first step after the trial, or None without one.
    pub(super) fn trial_end(&self) -> Option<u64> {
        self.trial.as_ref().map(|(trial, _)| trial.end())
    }
}
