//! The run's checkpoints: where it resumes from ([`find_resume_point`], [`restore`]), what it
//! writes ([`save_checkpoint`], [`checkpoint_meta`], the weights) and rank 0's account of the
//! writes ([`CheckpointLog`]). The file format is crate::checkpoint's.

use std::path::Path;

use mpi::traits::*;
use tch::{Device, Tensor};

use crate::checkpoint::{self, Checkpoint, CheckpointMeta};
use crate::data::DatasetInfo;
use crate::error::{Error, Result};
use crate::exchange::{Exchange, WholeState};
use crate::optim::{self, Optimizer};
use crate::results;
use crate::topology::World;

use super::collective::broadcast_from_root;
use super::net::Net;
use super::options::TrainArgs;
use super::plan::Plan;
use super::tensor::TensorParallel;

/// Rank 0's account of the run's checkpoints.
#[derive(Debug, Default)]
pub(super) struct CheckpointLog {
    /// The newest checkpoint this run can continue from: written by it, or resumed from.
    pub(super) newest_good: Option<u64>,
    /// Steps whose checkpoint could not be written.
    pub(super) failed: Vec<u64>,
}

impl CheckpointLog {
    /// Takes note of rank 0's write of the checkpoint after `step`.
    pub(super) fn note(&mut self, dir: &Path, step: u64, written: Result<std::path::PathBuf>) -> Result<()> {
        match (written, self.newest_good) {
            (Ok(path), _) => {
                log::info!("checkpoint at step {step}: {}", path.display());
                self.newest_good = Some(step);
                Ok(())
            }
            // Training on would only spend the allocation on steps that nothing keeps.
            (Err(e), None) => Err(Error::Checkpoint {
                path: dir.to_path_buf(),
                reason: format!("the checkpoint at step {step} could not be written ({e}), and this run has no earlier one to continue from: stopping"),
            }),
            (Err(e), Some(good)) => {
                log::error!("checkpoint at step {step} failed ({e}); the newest good one is at step {good}; training goes on, and the run will end non-zero");
                self.failed.push(step);
                Ok(())
            }
        }
    }

    /// The error a run with failed checkpoints ends with (rank 0), once its record is written.
    pub(super) fn verdict(&self, dir: &Path) -> Result<()> {
        match (self.failed.as_slice(), self.newest_good) {
            ([], _) => Ok(()),
            (failed, good) => Err(Error::Checkpoint {
                path: dir.to_path_buf(),
                reason: format!(
                    "{} checkpoint(s) could not be written (after step(s) {}); --resume continues from the newest good one, at step {}",
                    failed.len(),
                    failed.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", "),
                    good.map_or("?".into(), |g| g.to_string())
                ),
            }),
        }
    }
}

/// Rank 0 takes the checkpoint folder's lock for the run (None without --checkpoint-dir and on
/// the other ranks), after checking that it can write there.
pub(super) fn lock_checkpoint_dir(world: &World, args: &TrainArgs) -> Result<Option<checkpoint::FolderLock>> {
    match (&args.checkpoint_dir, world.is_root()) {
        (Some(dir), true) => {
            checkpoint::check_writable(dir)?;
            checkpoint::FolderLock::take(dir).map(Some)
        }
        _ => Ok(None),
    }
}

/// What a checkpoint says about the run it belongs to.
#[allow(clippy::too_many_arguments)]
pub(super) fn checkpoint_meta(args: &TrainArgs, world: &World, plan: &Plan, info: &DatasetInfo, fingerprint: &str, steps_per_epoch: u64, total_steps: u64, step: u64, optimizer_steps: u64) -> CheckpointMeta {
    CheckpointMeta {
        format: 0,
        step,
        steps_per_epoch,
        model: args.model.name().into(),
        dataset: info.meta.name.clone(),
        dataset_fingerprint: fingerprint.into(),
        train_samples: info.train.len,
        image_shape: vec![info.meta.channels, info.meta.height, info.meta.width],
        classes: info.meta.classes,
        strategy: args.strategy.name().into(),
        ranks: world.size as usize,
        workers: plan.workers,
        batch_per_rank: plan.batch,
        global_batch: plan.batch * plan.workers,
        seed: args.seed,
        optimizer: args.recipe.config(),
        schedule: Some(args.recipe.schedule(plan.batch * plan.workers, steps_per_epoch, total_steps)),
        optimizer_steps,
        git_commit: results::GIT_COMMIT.into(),
        timestamp: results::timestamp(),
        files: Default::default(),
    }
}

/// Rank 0 finds the newest complete checkpoint when `--resume` is given and checks that this
/// run may continue from it.
pub(super) fn find_resume_point(world: &World, args: &TrainArgs, now: &CheckpointMeta) -> Result<Option<Checkpoint>> {
    if args.checkpoint_dir.is_some() {
        if args.checkpoint_every == 0 {
            return Err(Error::usage("--checkpoint-every 0: expected a number of steps, at least 1"));
        }
    }
    if !args.resume {
        return Ok(None);
    }
    let Some(dir) = &args.checkpoint_dir else {
        return Err(Error::usage("--resume needs --checkpoint-dir (where the checkpoints are)"));
    };
    if !world.is_root() {
        return Ok(None);
    }
    match checkpoint::find_latest(dir)? {
        None => {
            log::warn!("--resume: no complete checkpoint in {}; starting from the beginning", dir.display());
            Ok(None)
        }
        Some(found) => {
            let accepted = checkpoint::check_compatible(&found.meta, now)
                .map_err(|reason| Error::Checkpoint { path: found.dir.clone(), reason: format!("refused: {reason}") })?;
            for change in accepted {
                log::warn!("resuming from {} with a change: {change}", found.dir.display());
            }
            log::info!("resuming from {} (step {}, epoch {})", found.dir.display(), found.meta.step, found.meta.epoch() + 1);
            Ok(Some(found))
        }
    }
}

/// Loads the optimizer's state from the checkpoint on rank 0 and sends it to every rank (the
/// weights were read when the model was built).
pub(super) fn restore(world: &World, found: Option<&Checkpoint>, net: &mut Net, exchange: &mut dyn Exchange, optimizer: &mut Optimizer) -> Result<()> {
    let (state, steps) = load_checkpoint(world, found, net, optimizer.kind().slots())?;
    exchange.restore_optimizer(&net.params, state, steps, optimizer)
}

/// The optimizer's state buffers of `net`'s parameters (`[slot][parameter]`, each of the
/// parameter's whole shape) from the checkpoint rank 0 found, on every rank, and its step
/// count. The weights are not here: every rank reads its own from the checkpoint's weights
/// file when it builds its part of the model (net.rs, `InitialValues`).
pub(super) fn load_checkpoint(world: &World, found: Option<&Checkpoint>, net: &Net, slots: &[&str]) -> Result<(WholeState, u64)> {
    let loaded = world.agree(match found {
        Some(c) if world.is_root() => checkpoint::load(c).map(Some),
        _ => Ok(None),
    })?;
    let zeros = |v: &crate::model::Variable| Tensor::f_zeros(v.shape.as_slice(), (tch::Kind::Float, net.vs.device()));
    let state: Vec<Vec<Tensor>> = slots.iter().map(|_| net.declared.iter().map(zeros).collect::<std::result::Result<_, _>>()).collect::<std::result::Result<_, _>>()?;
    let mut optimizer_steps = 0.0;
    world.agree((|| -> Result<()> {
        if let Some((_, saved_state)) = &loaded {
            tch::no_grad(|| -> Result<()> {
                // A buffer the checkpoint lacks stays zero: a parameter never stepped.
                for (slot, buffers) in slots.iter().zip(&state) {
                    for (name, b) in net.param_names.iter().zip(buffers) {
                        if let Some(saved) = saved_state.get(&checkpoint::state_name(slot, name)) {
                            b.shallow_clone().f_copy_(saved)?;
                        }
                    }
                }
                Ok(())
            })?;
            optimizer_steps = found.unwrap().meta.optimizer_steps as f64;
        }
        Ok(())
    })())?;
    for buffers in &state {
        broadcast_from_root(&world.comm, buffers)?;
    }
    let mut steps = optimizer_steps;
    world.comm.process_at_rank(0).broadcast_into(&mut steps);
    Ok((state, steps as u64))
}

/// Collects the optimizer state (every worker takes part) and has rank 0 write the checkpoint:
/// rank 0 returns how its write went (the folder written, or why not), the others None. With
/// tensor parallelism the weights and the state are glued whole first (each group gathers its
/// parts), so that the checkpoint is the usual one.
#[allow(clippy::too_many_arguments)]
pub(super) fn save_checkpoint(
    world: &World,
    dir: &Path,
    keep: usize,
    net: &Net,
    exchange: &mut dyn Exchange,
    optimizer: &Optimizer,
    meta: CheckpointMeta,
    tensor_parallel: Option<&TensorParallel>,
) -> Result<Option<Result<std::path::PathBuf>>> {
    // Collective where the state is sharded (ZeRO) or held by servers.
    let state = crate::watchdog::collective("gathering the optimizer state", &world.comm, || exchange.optimizer_state(&net.params, optimizer))?;
    let (weights, state) = match tensor_parallel {
        Some(tp) => {
            let state = state.ok_or_else(|| Error::exchange("checkpoint", "no optimizer state to glue"))?;
            (world.agree(tp.whole_variables(net))?, Some(world.agree(tp.whole_state(&net.param_names, state))?))
        }
        None => (net.named_variables(), state),
    };
    if !world.is_root() {
        return Ok(None);
    }
    let state = state.ok_or_else(|| Error::exchange("checkpoint", "rank 0 received no optimizer state"))?;
    // Never replace good checkpoints with a diverged state: with overlap a non-finite gradient
    // is found at the end of the step on the rank that made it, after the exchange has spread
    // it to every rank, which may reach this checkpoint before that rank ends the job.
    if !optim::all_finite(&net.params)? || !state.iter().try_fold(true, |ok, slot| Ok::<bool, Error>(ok && optim::all_finite(slot)?))? {
        return Err(Error::NonFinite { what: "weights (no checkpoint written)", step: meta.step, epoch: meta.epoch() });
    }
    Ok(Some(checkpoint::save(dir, meta, &weights, &named_state(net, optimizer, state), keep)))
}

/// The optimizer's state buffers (`[slot][parameter]`) by their checkpoint names.
pub(super) fn named_state(net: &Net, optimizer: &Optimizer, state: Vec<Vec<Tensor>>) -> Vec<(String, Tensor)> {
    optimizer
        .kind()
        .slots()
        .iter()
        .zip(state)
        .flat_map(|(slot, buffers)| net.param_names.iter().map(|name| checkpoint::state_name(slot, name)).zip(buffers).collect::<Vec<_>>())
        .collect()
}

/// `--save-weights` for a run that had nothing left to train: the checkpoint's weights.
pub(super) fn save_checkpoint_weights(found: Option<&Checkpoint>, path: &Path) -> Result<()> {
    let found = found.ok_or_else(|| Error::exchange("checkpoint", "rank 0 has no checkpoint to take the weights from"))?;
    let (weights, _) = checkpoint::load(found)?;
    save_named(weights.into_iter().collect(), path)
}

/// Writes the weights (parameters and batch-norm statistics) as safetensors, under a temporary
/// name first so that an interrupted write leaves no damaged file.
pub(super) fn save_weights(net: &Net, path: &Path) -> Result<()> {
    save_named(net.named_variables(), path)
}

/// Writes named tensors as safetensors, as [`save_weights`] does.
pub(super) fn save_named(vars: Vec<(String, Tensor)>, path: &Path) -> Result<()> {
    let vars: Vec<(String, Tensor)> = vars.into_iter().map(|(n, t)| Ok((n, t.f_to_device(Device::Cpu)?.f_contiguous()?))).collect::<Result<_>>()?;
    let tmp = path.with_extension("safetensors.tmp");
    results::replace_via_temp(path, &tmp, |tmp| Ok(Tensor::write_safetensors(&vars, tmp)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_checkpoints_end_the_run_without_an_earlier_one_and_are_counted_with_one() {
        let dir = Path::new("/ckpt");
        let full = || Err(Error::io("/ckpt/x", std::io::Error::from(std::io::ErrorKind::StorageFull)));
        let mut fresh = CheckpointLog::default();
        let err = fresh.note(dir, 5, full()).unwrap_err().to_string();
        assert!(err.contains("could not be written") && err.contains("no earlier one to continue from"), "{err}");

        let mut log = CheckpointLog::default();
        log.note(dir, 5, Ok("/ckpt/ckpt-5".into())).unwrap();
        log.note(dir, 10, full()).unwrap();
        log.note(dir, 15, full()).unwrap();
        assert_eq!((log.newest_good, log.failed.clone()), (Some(5), vec![10, 15]));
        let err = log.verdict(dir).unwrap_err().to_string();
        assert!(err.contains("2 checkpoint(s) could not be written (after step(s) 10, 15)") && err.contains("at step 5"), "{err}");
        assert!(CheckpointLog { newest_good: Some(3), failed: vec![] }.verdict(dir).is_ok());
    }
}
