//! The run's checkpoints: where it resumes from ([`find_resume_point`], [`restore_state`]), what
//! it writes ([`save_sharded_checkpoint`], [`save_checkpoint`] for the parameter server,
//! [`checkpoint_meta`], the weights) and the account of the writes ([`CheckpointLog`]). The
//! file format is crate::checkpoint's.
//!
//! **What each layout writes** (format 4, one part file per rank, issue 49): every rank writes
//! what it holds, and a tensor that several ranks hold alike is written by one of them, chosen
//! by [`assign_writers`], so that the ranks that share the copies share the writing:
//! - the variables (batch-norm statistics included) by the ranks that hold them alike: all
//!   ranks of a data-parallel run, a stage's replicas in a pipeline; with tensor parallelism a
//!   cut variable as the rectangles of the whole tensor this rank holds, by the ranks that hold
//!   the same part, and a variable the group holds whole by one rank of the group's replicas;
//! - the optimizer state with its parameter, except where the exchange shards it: ZeRO 1/2's
//!   flat shards as each rank holds them, and under `--zero 3` the parameters' flat shards too
//!   (nothing is gathered);
//! - the parameter server keeps today's whole checkpoint: its state lives on the servers,
//!   which rank 0 collects (README says so).
//!
//! On resume the weights come through `InitialValues` (net.rs); the optimizer state through a
//! [`CheckpointState`] that every rank reads by region, as its exchange holds the state.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use tch::{Device, Tensor};

use crate::checkpoint::index::Section;
use crate::checkpoint::reader::{CheckpointReader, ReadStats};
use crate::checkpoint::region::Region;
use crate::checkpoint::sharded::{save_sharded, Piece, WriteFault, Written};
use crate::checkpoint::{self, Checkpoint, CheckpointMeta, Retention};
use crate::data::DatasetInfo;
use crate::error::{Error, Result};
use crate::exchange::{Checkpointed, StateSource};
use crate::optim::{self, Optimizer};
use crate::plan::tensor::{vit_split, Split};
use crate::results;
use crate::topology::World;

use super::net::{cut_regions, part_range_regions, Net};
use super::options::TrainArgs;
use super::plan::Plan;
use super::tensor::TensorParallel;

/// The account of the run's checkpoints: rank 0's of which were written, every rank's of what
/// writing and resuming cost.
#[derive(Debug, Default)]
pub(super) struct CheckpointLog {
    /// The newest checkpoint this run can continue from: written by it, or resumed from.
    pub(super) newest_good: Option<u64>,
    /// Steps whose checkpoint could not be written.
    pub(super) failed: Vec<u64>,
    /// Sharded checkpoints written: how many, their part files' bytes, and the seconds from the
    /// start of each write to its complete folder (the slowest rank's), summed.
    pub(super) written: u64,
    pub(super) written_bytes: u64,
    pub(super) written_seconds: f64,
    /// What this rank read of the checkpoint it resumed from (weights and optimizer state),
    /// counted for as long as the run reads it.
    pub(super) resume_read: Option<Rc<Cell<ReadStats>>>,
}

impl CheckpointLog {
    /// Counts a sharded checkpoint written (every rank, the same figures).
    pub(super) fn count(&mut self, written: &Written) {
        self.written += 1;
        self.written_bytes += written.bytes;
        self.written_seconds += written.seconds;
    }

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

/// Every rank finds the newest complete checkpoint when `--resume` is given (verified by the
/// ranks together, each reading its share of the part files), and rank 0 checks that this run
/// may continue from it. Collective; every rank returns the same checkpoint. Refused (rank 0):
/// a run without `--resume` into a folder that holds checkpoints, and a `--resume` where every
/// checkpoint is damaged, since either would start from step 0 over checkpoints it then
/// replaces and prunes.
pub(super) fn find_resume_point(world: &World, args: &TrainArgs, now: &CheckpointMeta) -> Result<Option<Checkpoint>> {
    if args.checkpoint_dir.is_some() && args.checkpoint_every == 0 {
        return Err(Error::usage("--checkpoint-every 0: expected a number of steps, at least 1"));
    }
    if !args.resume {
        return match (&args.checkpoint_dir, world.is_root()) {
            (Some(dir), true) => refuse_earlier_checkpoints(dir).map(|()| None),
            _ => Ok(None),
        };
    }
    let Some(dir) = &args.checkpoint_dir else {
        return Err(Error::usage("--resume needs --checkpoint-dir (where the checkpoints are)"));
    };
    let found = checkpoint::reader::find_latest_together(world, dir)?;
    if !world.is_root() {
        return Ok(found);
    }
    match found {
        None => match checkpoint::files::list_steps(dir).len() {
            0 => {
                log::warn!("--resume: no complete checkpoint in {}; starting from the beginning", dir.display());
                Ok(None)
            }
            // The warnings above name each one and what is wrong with it.
            damaged => Err(Error::Checkpoint {
                path: dir.clone(),
                reason: format!(
                    "--resume: every checkpoint here is damaged ({damaged}, each named above with what is wrong with it); this run would start from step 0 and replace them as it reaches their steps: move them out of this folder (or repair them) and run again"
                ),
            }),
        },
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

/// Refuses a run from step 0 (no `--resume`) into a `--checkpoint-dir` that holds checkpoints,
/// an earlier run's: this run would replace the one of each step it reaches and prune the older
/// ones, and a later `--resume` would take the newest whoever wrote it.
fn refuse_earlier_checkpoints(dir: &Path) -> Result<()> {
    let mut steps = checkpoint::files::list_steps(dir);
    steps.sort_unstable();
    let held = match steps.as_slice() {
        [] => return Ok(()),
        [one] => format!("a checkpoint (step {one})"),
        [first, .., last] => format!("{} checkpoints (steps {first} to {last})", steps.len()),
    };
    Err(Error::Checkpoint {
        path: dir.to_path_buf(),
        reason: format!(
            "holds {held} of an earlier run, and this run starts from step 0 (no --resume): it would replace the one of each step it reaches and prune the older ones; continue that run with --resume, or give this run a --checkpoint-dir of its own"
        ),
    })
}

/// The optimizer's state of a resumed run, read from its checkpoint (either format) by every
/// rank as its exchange holds it: a replicated state whole per parameter, one at a time; a
/// ZeRO or FSDP shard as flat ranges; a tensor-parallel rank its cut; a stage its own
/// parameters. Nothing is read by one rank for another, and nothing is sent.
pub(super) struct CheckpointState {
    reader: Rc<CheckpointReader>,
    /// This rank's parameters: names, whole shapes.
    names: Vec<String>,
    shapes: Vec<Vec<i64>>,
    slots: Vec<&'static str>,
    /// A tensor-parallel rank's place in its group and the group's size: cut parameters' state
    /// is read as this rank's rectangles of it.
    part: Option<(usize, usize)>,
}

impl CheckpointState {
    pub(super) fn new(reader: Rc<CheckpointReader>, net: &Net, slots: &[&'static str], tp: Option<&TensorParallel>) -> CheckpointState {
        CheckpointState {
            reader,
            names: net.param_names.clone(),
            shapes: net.declared.iter().map(|v| v.shape.clone()).collect(),
            slots: slots.to_vec(),
            part: tp.map(|tp| (tp.rank, tp.layout.tensor)),
        }
    }
}

impl StateSource for CheckpointState {
    fn read(&self, slot: usize, param: usize, range: Option<std::ops::Range<usize>>) -> Result<Option<Tensor>> {
        let (param_name, shape) = (&self.names[param], &self.shapes[param]);
        let name = checkpoint::state_name(self.slots[slot], param_name);
        let Some(stored) = self.reader.shape(Section::Optimizer, &name) else { return Ok(None) };
        if stored != shape.as_slice() {
            return Err(Error::usage(format!("the checkpoint's optimizer state {name} has shape {stored:?}, the model's parameter {shape:?}")));
        }
        let split = self.part.map_or(Split::Whole, |_| vit_split(param_name));
        let (rank, size) = self.part.unwrap_or((0, 1));
        Ok(Some(match (split, range) {
            (Split::Whole, None) => self.reader.read_whole(Section::Optimizer, &name)?,
            (split, Some(r)) => {
                // A flat range of this rank's part (a ZeRO or FSDP shard; of the whole tensor
                // where it is not cut): only the regions of the whole tensor that it is.
                let mut pieces = part_range_regions(shape, split, rank, size, r.start as i64, r.len() as i64)
                    .into_iter()
                    .map(|(region, _)| Ok(self.reader.read(Section::Optimizer, &name, &region)?.f_reshape([-1])?))
                    .collect::<Result<Vec<Tensor>>>()?;
                match pieces.len() {
                    1 => pieces.pop().expect("one"),
                    _ => Tensor::f_cat(&pieces, 0)?,
                }
            }
            (split, None) => {
                // This rank's rectangles, glued as the cut holds them (net.rs's cut_tensor).
                let dim = if matches!(split, Split::Columns) { 1 } else { 0 };
                let rects = cut_regions(shape, split, rank, size)
                    .into_iter()
                    .map(|region| self.reader.read(Section::Optimizer, &name, &region))
                    .collect::<Result<Vec<Tensor>>>()?;
                Tensor::f_cat(&rects, dim)?
            }
        }))
    }
}

/// The pieces to write of a flat range of a parameter (or its state) that this rank holds
/// (`data`, elements `at ..` of its part): with tensor parallelism, the regions of the whole
/// tensor that a cut part's range is ([`part_range_regions`], net.rs), and a whole copy's range only on
/// the group's first rank (its other ranks hold the same range alike, from the same reductions).
fn flat_pieces_of(section: Section, name: String, param: &str, shape: &[i64], at: usize, data: &Tensor, tp: Option<&TensorParallel>) -> Result<Vec<Piece>> {
    let Some(tp) = tp else {
        return Ok(vec![Piece::flat(section, name, shape, at as i64, data)]);
    };
    let split = vit_split(param);
    if split == Split::Whole {
        return Ok(if tp.rank == 0 { vec![Piece::flat(section, name, shape, at as i64, data)] } else { Vec::new() });
    }
    let flat = data.f_reshape([-1])?;
    part_range_regions(shape, split, tp.rank, tp.layout.tensor, at as i64, flat.numel() as i64)
        .into_iter()
        .map(|(region, from)| {
            let piece = flat.f_narrow(0, from, region.elements(shape))?;
            Ok(match region {
                Region::Flat { at, .. } => Piece::flat(section, name.clone(), shape, at, &piece),
                Region::Rect { offsets, lengths } => Piece::rect(section, name.clone(), shape, &offsets, &piece.f_reshape(lengths.as_slice())?),
                Region::Whole => unreachable!("a range of a part is flat ranges and rectangles"),
            })
        })
        .collect()
}

/// The reader of the checkpoint a run resumes from, for its optimizer state: the one the
/// weights are read through (a sharded checkpoint), or one opened on a whole checkpoint.
pub(super) fn state_reader(values: &super::net::InitialValues, folder: &Path) -> Result<Rc<CheckpointReader>> {
    match values {
        super::net::InitialValues::Sharded(reader) => Ok(reader.clone()),
        _ => {
            // A whole checkpoint, verified by rank 0 (find_resume_point): its meta.json checked
            // again here, its two files mapped.
            let meta = checkpoint::meta::read_checked_meta(folder)?;
            Ok(Rc::new(CheckpointReader::open(&Checkpoint { dir: folder.to_path_buf(), meta })?))
        }
    }
}

/// Restores the optimizer's state and step count from `reader` (every rank): the exchange
/// reads what it will hold.
pub(super) fn restore_state(reader: Rc<CheckpointReader>, net: &Net, tp: Option<&TensorParallel>, exchange: &mut dyn Checkpointed, optimizer: &mut Optimizer) -> Result<()> {
    let steps = reader.checkpoint().meta.optimizer_steps;
    let source = CheckpointState::new(reader, net, optimizer.kind().slots(), tp);
    exchange.restore_state(&net.params, Box::new(source), steps, optimizer)
}

/// Which of `sharers` ranks holding the same tensors (of `sizes` elements, in an order every
/// sharer agrees on) writes each: the largest first, each to the sharer with the fewest
/// elements so far (ties to the lowest), so that the ranks write about as much each and at
/// once. The same on every sharer.
pub(super) fn assign_writers(sizes: &[usize], sharers: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; sharers.max(1)];
    let mut writer = vec![0; sizes.len()];
    for i in order {
        let least = (0..load.len()).min_by_key(|&r| (load[r], r)).expect("one sharer at least");
        writer[i] = least;
        load[least] += sizes[i];
    }
    writer
}

/// The pieces of a tensor of whole shape `shape` that this rank holds as `local`: its
/// rectangles of a tensor-parallel cut, or the whole tensor.
fn held_pieces(section: Section, name: &str, param: &str, shape: &[i64], local: &Tensor, tp: Option<&TensorParallel>) -> Result<Vec<Piece>> {
    // The cut is the parameter's: a state's own name (AdamW's `exp_avg/<param>`) is no
    // parameter name, and read as whole it had every rank of a group write its part as the
    // whole tensor (found by scripts/measure-beyond-one-rank.sh: --tensor-parallel with AdamW
    // could not checkpoint).
    let split = tp.map_or(Split::Whole, |_| vit_split(param));
    let Some(tp) = tp.filter(|_| split != Split::Whole) else {
        return Ok(vec![Piece::whole(section, name, local)]);
    };
    let dim = if matches!(split, Split::Columns) { 1 } else { 0 };
    let mut at = 0;
    cut_regions(shape, split, tp.rank, tp.layout.tensor)
        .into_iter()
        .map(|region| {
            let Region::Rect { offsets, lengths } = region else { unreachable!("a cut is rectangles") };
            let data = local.f_narrow(dim as i64, at, lengths[dim])?.f_contiguous()?;
            at += lengths[dim];
            Ok(Piece::rect(section, name, shape, &offsets, &data))
        })
        .collect()
}

/// A sharded checkpoint after `meta.step` (collective over `world`): every rank writes the
/// pieces it holds (see the module's notes) into its own part file, at once; nothing is
/// gathered. `replicas`: the ranks that hold this rank's part alike (the exchange's ranks).
/// An outer error (a non-finite weight or state buffer anywhere: no checkpoint written) ends
/// the run on every rank; the inner result, the same on every rank, says whether the write
/// succeeded. `fault`: a test's, in this rank's part (`stall-write`, `damage-write`).
#[allow(clippy::too_many_arguments)]
pub(super) fn save_sharded_checkpoint(
    world: &World,
    dir: &Path,
    retention: Retention,
    net: &Net,
    exchange: &mut dyn Checkpointed,
    optimizer: &Optimizer,
    meta: CheckpointMeta,
    replicas: &World,
    tp: Option<&TensorParallel>,
    fault: WriteFault,
) -> Result<Result<Written>> {
    let pieces = pieces_held(world, net, exchange, optimizer, replicas, tp, true)?;
    // Never replace good checkpoints with a diverged state: with overlap a non-finite gradient
    // is found at the end of the step on the rank that made it, after the exchange has spread
    // it to every rank, which may reach this checkpoint before that rank ends the job. Each
    // rank checks what it writes; the replicas hold the same.
    let data: Vec<Tensor> = pieces.iter().map(|p| p.data.shallow_clone()).collect();
    let finite = optim::all_finite(&data)?;
    world.agree(if finite { Ok(()) } else { Err(Error::NonFinite { what: "weights or optimizer state (no checkpoint written)", step: meta.step, epoch: meta.epoch() }) })?;
    // Every rank writes at once; the agreements inside wait for the slowest writer. Watched as
    // the checkpoint's step and folder, not the step the loop last began (one less).
    let (step, folder) = (meta.step, checkpoint::files::folder_name(meta.step));
    Ok(crate::watchdog::collective_of_step(|| format!("writing the sharded checkpoint {folder}"), step, &world.comm, || save_sharded(world, dir, meta, &pieces, retention, fault)))
}

/// The folder `--save-weights OUT` writes its parts into where the model is cut: `OUT.parts`.
pub(super) fn parts_folder(out: &Path) -> PathBuf {
    let mut folder = out.as_os_str().to_owned();
    folder.push(".parts");
    PathBuf::from(folder)
}

/// Refuses `--save-weights OUT` in parts where `OUT.parts` is there and not an empty folder:
/// this run writes into it and removes what it wrote, and never writes over what it did not
/// make (a folder of the user's, or the parts an earlier run kept when their join failed).
/// Checked before the first step, and again by [`save_weights_in_parts`].
pub(super) fn check_parts_folder(out: &Path) -> Result<()> {
    let folder = parts_folder(out);
    let in_use = match std::fs::read_dir(&folder).map(|mut entries| entries.next().is_some()) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Ok(false) => return Ok(()),
        Ok(true) => "holds files this run did not write".to_string(),
        Err(e) => format!("is in the way ({e})"),
    };
    Err(Error::usage(format!(
        "--save-weights {}: its parts go into {}, which {in_use} (the parts of an earlier run whose join failed, which `hpc-train checkpoint consolidate {} {}` joins, or a folder of yours); move or remove it first",
        out.display(),
        folder.display(),
        folder.display(),
        out.display()
    )))
}

/// Rank 0 makes `folder` for the parts (true), or takes it empty as it is (false: not to be
/// removed); anything else is refused by [`check_parts_folder`]'s rule.
fn claim_parts_folder(out: &Path, folder: &Path) -> Result<bool> {
    if let Some(parent) = folder.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    match std::fs::create_dir(folder) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => check_parts_folder(out).map(|()| false),
        Err(e) => Err(Error::io(folder, e)),
    }
}

/// Whether `e` (or the error it carries) is a full disk or a spent quota.
fn is_full_disk(e: &Error) -> bool {
    match e {
        Error::Io { source, .. } => matches!(source.kind(), std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded),
        Error::Agreed(inner) => is_full_disk(inner),
        _ => false,
    }
}

/// `--save-weights` where the model is cut (pipelines, `--zero 3`, tensor parallelism), with no
/// rank holding it whole (collective over `world`): every rank writes the variables it holds,
/// as a checkpoint's weights, into [`parts_folder`] beside `out`, then rank 0 streams them into
/// `out` one tensor at a time (`checkpoint consolidate`'s writer) and removes what it wrote.
/// So, as `--checkpoint-dir`, `out`'s folder must be one that every rank sees. A join that fails
/// (a full disk) keeps the parts, a complete checkpoint, and the error says how to join them.
#[allow(clippy::too_many_arguments)]
pub(super) fn save_weights_in_parts(
    world: &World,
    out: &Path,
    net: &Net,
    exchange: &mut dyn Checkpointed,
    optimizer: &Optimizer,
    meta: CheckpointMeta,
    replicas: &World,
    tp: Option<&TensorParallel>,
) -> Result<()> {
    let pieces = pieces_held(world, net, exchange, optimizer, replicas, tp, false)?;
    let folder = parts_folder(out);
    let made_here = world.agree(if world.is_root() { claim_parts_folder(out, &folder) } else { Ok(false) })?;
    let written = crate::watchdog::collective("writing --save-weights' parts", &world.comm, || save_sharded(world, &folder, meta, &pieces, Retention::newest(1), WriteFault::None));
    let joined = match (&written, world.is_root()) {
        (Ok(w), true) => checkpoint::command::consolidate(&w.dir, out, None).map(|_| ()).map_err(|e| {
            let join = format!("`hpc-train checkpoint consolidate {} {}`", folder.display(), out.display());
            let what_then = match is_full_disk(&e) {
                true => format!("the disk is full; make room, then join them with {join}"),
                false => format!("join them with {join} once the cause is put right"),
            };
            Error::Checkpoint {
                path: out.to_path_buf(),
                reason: format!("--save-weights: its parts could not be joined ({e}); they are kept in {}, a complete checkpoint: {what_then}", w.dir.display()),
            }
        }),
        _ => Ok(()),
    };
    if world.is_root() && joined.is_ok() {
        // What this run wrote, and the folder if it made it (a failed write removed its own
        // partial folder).
        if let Ok(w) = &written {
            let _ = std::fs::remove_dir_all(&w.dir);
        }
        if made_here {
            let _ = std::fs::remove_dir(&folder);
        }
    }
    written?;
    world.agree(joined)
}

/// The pieces this rank writes of what the run holds (see the module's notes): the variables,
/// and with `with_state` the optimizer's state. `replicas`: the ranks that hold this rank's
/// part alike. Collective over `replicas` (ZeRO with channels-last parameters, zero.rs says why).
fn pieces_held(world: &World, net: &Net, exchange: &mut dyn Checkpointed, optimizer: &Optimizer, replicas: &World, tp: Option<&TensorParallel>, with_state: bool) -> Result<Vec<Piece>> {
    let shards = world.agree(crate::watchdog::collective("collecting the optimizer state's shards", &replicas.comm, || exchange.held_shards(&net.params, optimizer)))?;
    let shape_of: HashMap<&str, &[i64]> = net.declared.iter().map(|v| (v.name.as_str(), v.shape.as_slice())).collect();
    let param_sharded = shards.as_ref().is_some_and(|s| !s.params.is_empty());
    let params: HashSet<&str> = net.param_names.iter().map(String::as_str).collect();
    // The variables held alike by `replicas` (cut ones) or by the group's ranks and their
    // replicas (whole ones); under --zero 3 the parameters come from the exchange's shards.
    let variables: Vec<(String, Tensor)> = net.named_variables().into_iter().filter(|(n, _)| !(param_sharded && params.contains(n.as_str()))).collect();
    let is_cut = |name: &str| tp.is_some() && vit_split(name) != Split::Whole;
    let (d, dr) = (replicas.size as usize, replicas.rank as usize);
    let (whole_sharers, whole_me) = match tp {
        Some(tp) => (tp.layout.tensor * d, tp.rank + tp.layout.tensor * dr),
        None => (d, dr),
    };
    let mut writes: HashSet<&str> = HashSet::new();
    for (cut, sharers, me) in [(false, whole_sharers, whole_me), (true, d, dr)] {
        // The parameters are the same on every sharer, so the sharers share their writing. The
        // buffers (batch norm's running statistics) are not: each replica updates them from its
        // own samples, and evaluation averages them only for itself. The first sharer's are
        // written, as PyTorch's rank 0 saves its state_dict (and DDP broadcasts rank 0's
        // buffers): a mix of the replicas' statistics would be nobody's.
        let mine: Vec<&(String, Tensor)> = variables.iter().filter(|(n, _)| is_cut(n) == cut && params.contains(n.as_str())).collect();
        let sizes: Vec<usize> = mine.iter().map(|(_, t)| t.numel()).collect();
        for ((name, _), writer) in mine.iter().zip(assign_writers(&sizes, sharers)) {
            if writer == me {
                writes.insert(name.as_str());
            }
        }
        if me == 0 {
            writes.extend(variables.iter().filter(|(n, _)| is_cut(n) == cut && !params.contains(n.as_str())).map(|(n, _)| n.as_str()));
        }
    }
    let shape = |name: &str, t: &Tensor| shape_of.get(name).map_or_else(|| t.size(), |s| s.to_vec());
    let mut pieces = Vec::new();
    for (name, t) in variables.iter().filter(|(n, _)| writes.contains(n.as_str())) {
        pieces.extend(held_pieces(Section::Weights, name, name, &shape(name, t), t, tp)?);
    }
    let slots = optimizer.kind().slots();
    match shards {
        Some(held) if held.writes => {
            let flat = |section: Section, name: String, p: &crate::exchange::FlatPiece| flat_pieces_of(section, name, &net.param_names[p.param], &net.declared[p.param].shape, p.at, &p.data, tp);
            for p in &held.params {
                pieces.extend(flat(Section::Weights, net.param_names[p.param].clone(), p)?);
            }
            for (slot, state) in slots.iter().zip(&held.state).filter(|_| with_state) {
                for p in state {
                    pieces.extend(flat(Section::Optimizer, checkpoint::state_name(slot, &net.param_names[p.param]), p)?);
                }
            }
        }
        Some(_) => {}
        None if !with_state => {}
        None => {
            // A replicated state: written with its parameter, by the same rank.
            let state = crate::exchange::strategy::state_or_zeros(&net.params, optimizer)?;
            for (slot, buffers) in slots.iter().zip(&state) {
                for (name, b) in net.param_names.iter().zip(buffers).filter(|(n, _)| writes.contains(n.as_str())) {
                    pieces.extend(held_pieces(Section::Optimizer, &checkpoint::state_name(slot, name), name, &shape(name, b), b, tp)?);
                }
            }
        }
    }
    Ok(pieces)
}

/// The parameter server's checkpoint, whole (formats 1 to 3): its servers hold the optimizer
/// state, which rank 0 collects from them (every worker takes part) and writes with the
/// weights. Rank 0 returns how its write went (the folder written, or why not), the others
/// None. (Parameter servers are refused with pipelines and tensor parallelism.)
pub(super) fn save_checkpoint(world: &World, dir: &Path, retention: Retention, net: &Net, exchange: &mut dyn Checkpointed, optimizer: &Optimizer, meta: CheckpointMeta) -> Result<Option<Result<std::path::PathBuf>>> {
    // Collective: the state is held by the servers.
    let state = crate::watchdog::collective("gathering the optimizer state", &world.comm, || exchange.optimizer_state(&net.params, optimizer))?;
    let weights = net.named_variables();
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
    Ok(Some(checkpoint::save(dir, meta, &weights, &named_state(net, optimizer, state), retention)))
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

/// `--save-weights` for a run that had nothing left to train: the checkpoint's weights, streamed
/// one tensor at a time (`checkpoint consolidate`), never the model whole.
pub(super) fn save_checkpoint_weights(found: Option<&Checkpoint>, path: &Path) -> Result<()> {
    let found = found.ok_or_else(|| Error::exchange("checkpoint", "rank 0 has no checkpoint to take the weights from"))?;
    checkpoint::command::consolidate(&found.dir, path, None).map(|_| ())
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
    fn replicas_share_the_writing_by_size_and_agree_on_it() {
        // Largest first, each to the least-loaded sharer: 10 -> 0, 6 -> 1, 5 -> 1 (6 < 10),
        // 3 -> 0 (10 < 11), 1 -> 1 (11 < 13).
        assert_eq!(assign_writers(&[3, 10, 5, 6, 1], 2), vec![0, 0, 1, 1, 1]);
        assert_eq!(assign_writers(&[4, 4, 4], 1), vec![0, 0, 0]);
        // More sharers than tensors: each tensor on its own rank, the rest write none.
        assert_eq!(assign_writers(&[2, 9], 4), vec![1, 0]);
    }

    /// A run without --resume refuses a folder of checkpoints (an earlier run's).
    #[test]
    fn a_run_from_step_0_refuses_a_folder_of_checkpoints() {
        let dir = std::env::temp_dir().join(format!("hpc-train-earlier-run-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ckpt = dir.join("ckpt");
        std::fs::create_dir_all(ckpt.join(".ckpt-000000000001.partial")).unwrap();
        assert!(refuse_earlier_checkpoints(&ckpt).is_ok(), "a partial folder is no checkpoint");
        std::fs::create_dir_all(ckpt.join("ckpt-000000000004")).unwrap();
        assert!(refuse_earlier_checkpoints(&ckpt).unwrap_err().to_string().contains("holds a checkpoint (step 4) of an earlier run"));
        std::fs::create_dir_all(ckpt.join("ckpt-000000000002")).unwrap();
        assert!(refuse_earlier_checkpoints(&ckpt).unwrap_err().to_string().contains("holds 2 checkpoints (steps 2 to 4) of an earlier run, and this run starts from step 0 (no --resume)"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `--save-weights` in parts writes into `OUT.parts` only where it is absent or an empty
    /// folder.
    #[test]
    fn a_parts_folder_holding_anything_is_refused() {
        let dir = std::env::temp_dir().join(format!("hpc-train-parts-folder-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = dir.join("w.safetensors");
        assert!(check_parts_folder(&out).is_ok(), "absent");
        std::fs::create_dir_all(parts_folder(&out)).unwrap();
        assert!(check_parts_folder(&out).is_ok(), "empty");
        std::fs::write(parts_folder(&out).join("notes.txt"), b"mine").unwrap();
        let err = check_parts_folder(&out).unwrap_err().to_string();
        assert!(err.contains(&format!("its parts go into {}.parts, which holds files this run did not write", out.display())), "{err}");
        let file = dir.join("f.safetensors");
        std::fs::write(parts_folder(&file), b"a file").unwrap();
        assert!(check_parts_folder(&file).unwrap_err().to_string().contains(".parts, which is in the way ("));
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
        assert!(CheckpointLog { newest_good: Some(3), ..CheckpointLog::default() }.verdict(dir).is_ok());
    }
}
