//! The `hpc-train checkpoint` commands.
//!
//! - `consolidate DIR OUT.safetensors`: a checkpoint's model variables, sharded or whole, as one
//!   safetensors file in the whole format's layout (torchvision names, whole tensors: what
//!   `--save-weights` writes and `load_state_dict(strict=True)` takes). The header goes first,
//!   then each tensor assembled from its pieces one at a time, so that memory holds one tensor
//!   (twice: assembled, then its bytes on their way out), never the model. Serial (rank 0).
//! - `reshard FROM TO --layout rows|flat`: the same checkpoint written sharded by the ranks of
//!   this launch, each reading only the slices it writes: a checkpoint made for another rank
//!   count or layout, or a whole one made sharded. Collective.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand, ValueEnum};

use crate::error::{Error, Result};
use crate::plan::shard::ShardInfo;
use crate::topology::World;

use super::files::{check_not_in_checkpoint, folder_name, sync_dir, FolderLock, Retention};
use super::index::Section;
use super::meta::{Checkpoint, FileCheck, META_FILE};
use super::reader::{checkpoint_at, find_latest_together, verify_together, CheckpointReader, ReadStats};
use super::region::Region;
use super::sharded::{save_sharded, Piece, WriteFault};
use super::stream::{Entry, StreamWriter};

#[derive(Subcommand, Debug)]
pub enum CheckpointCommand {
    /// Write a checkpoint (sharded or whole) as one weights file of whole tensors by torchvision
    /// name, one tensor at a time; the optimizer's state too with --optimizer.
    Consolidate(ConsolidateArgs),
    /// Write a checkpoint (sharded or whole) as a sharded one cut for the ranks of this launch
    /// (mpirun -n N), each rank reading only the slices it writes.
    Reshard(ReshardArgs),
}

/// Options of `hpc-train checkpoint consolidate`.
#[derive(Args, Debug)]
pub struct ConsolidateArgs {
    /// A checkpoint folder (ckpt-<step>), or a --checkpoint-dir (its newest good checkpoint).
    pub dir: PathBuf,
    /// The weights file to write (replaced only once complete; not in a checkpoint folder).
    pub out: PathBuf,
    /// Also write the optimizer's state (optimizer.safetensors's names) to this file.
    #[arg(long, value_name = "FILE")]
    pub optimizer: Option<PathBuf>,
}

/// How `reshard` cuts each tensor among the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReshardLayout {
    /// Contiguous ranges of the flattened tensor, balanced to one element (ZeRO's shards).
    Flat,
    /// Ranges of the first dimension (a tensor-parallel cut); a tensor with fewer rows than
    /// ranks, or none, is written whole by one rank (the tensors' turns go round the ranks).
    Rows,
}

/// Options of `hpc-train checkpoint reshard`.
#[derive(Args, Debug)]
pub struct ReshardArgs {
    /// The checkpoint to read: a checkpoint folder (ckpt-<step>), or a --checkpoint-dir (its
    /// newest good checkpoint).
    pub from: PathBuf,
    /// The --checkpoint-dir to write into (the same step and meta.json; a checkpoint of that step
    /// there is replaced once the new one is complete).
    pub to: PathBuf,
    #[arg(long, value_enum, default_value = "flat")]
    pub layout: ReshardLayout,
    /// Good checkpoints kept in TO, the one written counted (older ones beyond it are removed;
    /// newer ones are left alone).
    #[arg(long, default_value_t = 3)]
    pub keep: usize,
}

/// What a consolidation wrote and read.
#[derive(Debug)]
pub struct Consolidated {
    pub checkpoint: Checkpoint,
    pub tensors: usize,
    pub bytes: u64,
    pub read: ReadStats,
}

/// Runs a `checkpoint` command: `consolidate` on rank 0 alone (the others wait for its
/// verdict), `reshard` on every rank.
pub fn run(world: &World, command: &CheckpointCommand) -> Result<()> {
    match command {
        CheckpointCommand::Reshard(args) => reshard(world, args),
        CheckpointCommand::Consolidate(args) => {
            let local = if world.is_root() { consolidate_and_say(args) } else { Ok(()) };
            world.agree(local)
        }
    }
}

fn consolidate_and_say(args: &ConsolidateArgs) -> Result<()> {
    let done = consolidate(&args.dir, &args.out, args.optimizer.as_deref())?;
    let format = if done.checkpoint.meta.is_sharded() { "sharded" } else { "whole" };
    println!(
        "{} (step {}, {format}) -> {}{}: {} tensors, {} bytes written; {} bytes read in {:.3} s",
        done.checkpoint.dir.display(),
        done.checkpoint.meta.step,
        args.out.display(),
        args.optimizer.as_ref().map_or(String::new(), |p| format!(" and {}", p.display())),
        done.tensors,
        done.bytes,
        done.read.bytes,
        done.read.seconds
    );
    Ok(())
}

/// Writes the model variables of the checkpoint at `dir` (see [`checkpoint_at`]) to `out`, and
/// its optimizer state to `optimizer` if given, each in the whole format's layout. An output
/// in a checkpoint folder (the one read, a part file of it, any other) is refused first.
pub fn consolidate(dir: &Path, out: &Path, optimizer: Option<&Path>) -> Result<Consolidated> {
    check_not_in_checkpoint("OUT", out)?;
    if let Some(path) = optimizer {
        check_not_in_checkpoint("--optimizer", path)?;
    }
    let checkpoint = checkpoint_at(dir)?;
    let reader = CheckpointReader::open(&checkpoint)?;
    let (mut tensors, mut bytes) = (0, 0);
    for (section, path) in [(Section::Weights, Some(out)), (Section::Optimizer, optimizer)] {
        if let Some(path) = path {
            tensors += reader.tensors(section).len();
            bytes += write_section(&reader, section, path)?.bytes;
        }
    }
    Ok(Consolidated { read: reader.stats(), checkpoint, tensors, bytes })
}

/// Writes every tensor of `section`, whole and by name, into the safetensors file `path`
/// through a temporary file renamed into place once complete and synced.
pub fn write_section(reader: &CheckpointReader, section: Section, path: &Path) -> Result<FileCheck> {
    let tensors = reader.tensors(section);
    let entries = tensors.iter().map(|t| Entry { key: t.name.clone(), kind: t.kind, shape: t.shape.clone() }).collect();
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let mut check = None;
    crate::results::replace_via_temp(path, Path::new(&tmp), |tmp| {
        let mut out = StreamWriter::create(tmp, entries)?;
        for t in &tensors {
            out.write_next(&reader.read_whole(section, &t.name)?)?;
        }
        check = Some(out.finish()?);
        Ok(())
    })?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        sync_dir(dir);
    }
    check.ok_or_else(|| Error::Checkpoint { path: path.to_path_buf(), reason: "written without its check".into() })
}

/// `checkpoint reshard`: every rank finds the checkpoint (verifying its share of the part
/// files), reads its slice of every tensor and writes it with [`save_sharded`].
pub fn reshard(world: &World, args: &ReshardArgs) -> Result<()> {
    // TO a checkpoint folder, or in one: the lock and the new checkpoint would go inside it.
    world.agree(if world.is_root() { check_not_in_checkpoint("TO", &args.to) } else { Ok(()) })?;
    // Rank 0 holds the lock on the folder it writes, as a training run does.
    let _lock = world.agree(if world.is_root() { FolderLock::take(&args.to).map(Some) } else { Ok(None) })?;
    let found = if args.from.join(META_FILE).exists() {
        verify_together(world, &args.from)?
    } else {
        let found = find_latest_together(world, &args.from)?;
        world.agree(found.ok_or_else(|| Error::Checkpoint { path: args.from.clone(), reason: "no complete checkpoint here".into() }))?
    };
    let target = args.to.join(folder_name(found.meta.step));
    if same_folder(&target, &found.dir) {
        return world.agree(Err(Error::usage(format!("{}: resharding a checkpoint into its own folder would replace what it reads; give another TO", found.dir.display()))));
    }
    let reader = world.agree(CheckpointReader::open(&found))?;
    let pieces = world.agree(my_pieces(&reader, args.layout, world.rank as usize, world.size as usize))?;
    let read = reader.stats();
    let written = save_sharded(world, &args.to, found.meta.clone(), &pieces, Retention::newest(args.keep), WriteFault::None)?;
    let (read_bytes, read_seconds) = (world.sum_f64(read.bytes as f64) as u64, world.max_f64(read.seconds));
    if world.is_root() {
        println!(
            "{} (step {}) -> {}: {} part files, {} bytes written in {:.3} s; {read_bytes} bytes read in {read_seconds:.3} s (slowest rank)",
            found.dir.display(),
            found.meta.step,
            written.dir.display(),
            written.files,
            written.bytes,
            written.seconds
        );
    }
    Ok(())
}

fn same_folder(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// The pieces rank `rank` of `ranks` writes in `layout`, read from the checkpoint.
fn my_pieces(reader: &CheckpointReader, layout: ReshardLayout, rank: usize, ranks: usize) -> Result<Vec<Piece>> {
    let mut pieces = Vec::new();
    let mut turn = 0;
    for section in [Section::Weights, Section::Optimizer] {
        for tensor in reader.tensors(section) {
            let (name, shape) = (tensor.name.as_str(), tensor.shape.as_slice());
            let piece = match layout {
                ReshardLayout::Flat => {
                    let share = ShardInfo::split(shape.iter().product::<i64>() as usize, ranks, rank);
                    let data = reader.read(section, name, &Region::Flat { at: share.offset as i64, len: share.len as i64 })?;
                    Piece::flat(section, name, shape, share.offset as i64, &data)
                }
                ReshardLayout::Rows if shape.first().is_some_and(|&rows| rows as usize >= ranks) => {
                    let share = ShardInfo::split(shape[0] as usize, ranks, rank);
                    let data = reader.read(section, name, &Region::rows(shape, share.offset as i64, share.len as i64))?;
                    let mut offsets = vec![0; shape.len()];
                    offsets[0] = share.offset as i64;
                    Piece::rect(section, name, shape, &offsets, &data)
                }
                ReshardLayout::Rows => {
                    turn += 1;
                    if (turn - 1) % ranks != rank {
                        continue;
                    }
                    Piece::whole(section, name, &reader.read_whole(section, name)?)
                }
            };
            pieces.push(piece);
        }
    }
    Ok(pieces)
}
