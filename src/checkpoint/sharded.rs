//! Writing a sharded checkpoint: every rank writes the pieces it holds into its own part file,
//! in parallel, and rank 0 writes index.json and meta.json beside them, then renames the folder
//! into place, as a whole checkpoint is (issue 49; the layout is torch.distributed.checkpoint's,
//! README says why).
//!
//! The steps, each agreed by every rank (an error on any rank is an error on all, and rank 0
//! removes the partial folder, so the previous checkpoint stays the newest):
//! 1. rank 0 makes `.ckpt-<step>.partial`;
//! 2. every rank writes `part-<rank>.safetensors` ([`write_part`]), one piece at a time, and
//!    syncs it;
//! 3. rank 0 gathers what each wrote and describes the folder ([`describe`]): the index (refused
//!    unless every tensor is covered exactly once), meta.json, meta.crc32;
//! 4. every rank reads a part file back against its CRC-32 ([`verify_written`]), so that a part
//!    changed on its way to the disk, or seen short from another node, fails the write;
//! 5. rank 0 renames the folder into place and prunes older checkpoints ([`place_and_prune`]).
//!
//! None of these steps makes an MPI call: [`save_sharded`] is them with the agreements and the
//! gather, and tests call them for several simulated ranks in one process.

use std::path::{Path, PathBuf};
use std::time::Instant;

use mpi::traits::*;
use tch::Tensor;

use crate::error::{Error, Result, WithPath};
use crate::topology::World;

use super::files::{folder_name, partial_dir, place, prune, write_meta, write_synced, Retention};
use super::index::{build_index, PartWritten, PieceWritten, Section, INDEX_FILE};
use super::meta::{CheckpointMeta, FileCheck, SHARDED_FORMAT};
use super::reader::verify_written;
use super::region::Region;
use super::stream::{dtype_name, Entry, StreamWriter};

/// A piece of a tensor that a rank writes: `data` holds the elements of `region` of the tensor
/// `name` of global shape `shape` (in the region's row-major order, any shape with that many
/// elements; on any device).
#[derive(Debug)]
pub struct Piece {
    pub section: Section,
    pub name: String,
    pub shape: Vec<i64>,
    pub region: Region,
    pub data: Tensor,
}

impl Piece {
    /// The whole tensor (a replicated one: let one replica write it).
    pub fn whole(section: Section, name: impl Into<String>, data: &Tensor) -> Piece {
        Piece { section, name: name.into(), shape: data.size(), region: Region::Whole, data: data.shallow_clone() }
    }

    /// Elements `at .. at + data.numel()` of the flattened tensor of `shape` (a ZeRO/FSDP shard).
    pub fn flat(section: Section, name: impl Into<String>, shape: &[i64], at: i64, data: &Tensor) -> Piece {
        Piece { section, name: name.into(), shape: shape.to_vec(), region: Region::Flat { at, len: data.numel() as i64 }, data: data.shallow_clone() }
    }

    /// The rectangle of the tensor of `shape` that starts at `offsets` and has `data`'s shape (a
    /// tensor-parallel cut).
    pub fn rect(section: Section, name: impl Into<String>, shape: &[i64], offsets: &[i64], data: &Tensor) -> Piece {
        let region = Region::Rect { offsets: offsets.to_vec(), lengths: data.size() };
        Piece { section, name: name.into(), shape: shape.to_vec(), region, data: data.shallow_clone() }
    }
}

/// The part file of `rank`.
pub fn part_file(rank: usize) -> String {
    format!("part-{rank:05}.safetensors")
}

/// What a checkpoint write cost, for runs.jsonl: the same on every rank.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Written {
    /// The complete checkpoint folder.
    pub dir: PathBuf,
    /// Part files written (one per rank).
    pub files: usize,
    /// Bytes of every rank's part file together (index and meta not counted).
    pub bytes: u64,
    /// Seconds from the start of the write to the complete folder, on the slowest rank.
    pub seconds: f64,
}

/// A fault a test injects into one rank's part of a sharded write (`HPC_TRAIN_FAULT`, faults.rs).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum WriteFault {
    #[default]
    None,
    /// `stall-write`: sleep this long after the first piece, the file half written.
    PauseMidway(std::time::Duration),
    /// `damage-write`: flip one byte of the part file once it is written and its size and
    /// CRC-32 are taken, as storage that changes data on its way to the disk would.
    DamageWritten,
}

/// Writes this rank's part file into the partial folder `partial`: `pieces` in order, each
/// copied to the host alone, keyed `<section>/<name>#<k>` (the k-th piece of that tensor in this
/// file); the file is synced. Checks each piece against its tensor (region inside the shape,
/// as many elements as the region) before writing anything. `fault`: a test's, see [`WriteFault`].
pub fn write_part(partial: &Path, rank: usize, pieces: &[Piece], fault: WriteFault) -> Result<PartWritten> {
    let start = Instant::now();
    let file = part_file(rank);
    let path = partial.join(&file);
    let bad = |reason: String| Error::Checkpoint { path: path.clone(), reason };
    let mut written = Vec::with_capacity(pieces.len());
    let mut entries = Vec::with_capacity(pieces.len());
    let mut seen: std::collections::HashMap<(Section, &str), usize> = std::collections::HashMap::new();
    for p in pieces {
        p.region.check(&p.name, &p.shape).map_err(bad)?;
        let elements = p.region.elements(&p.shape);
        if p.data.numel() as i64 != elements {
            return Err(bad(format!("tensor {}: a piece of {} elements for a region of {elements} ({:?})", p.name, p.data.numel(), p.region)));
        }
        let dtype = dtype_name(p.data.kind()).ok_or_else(|| bad(format!("tensor {}: elements of type {:?} have no safetensors name", p.name, p.data.kind())))?;
        let k = seen.entry((p.section, p.name.as_str())).or_insert(0);
        let key = format!("{}/{}#{k}", p.section.name(), p.name);
        *k += 1;
        entries.push(Entry { key: key.clone(), kind: p.data.kind(), shape: p.region.piece_shape(&p.shape) });
        written.push(PieceWritten { section: p.section, name: p.name.clone(), shape: p.shape.clone(), dtype: dtype.into(), key, region: p.region.clone() });
    }
    let mut out = StreamWriter::create(&path, entries)?;
    for (i, p) in pieces.iter().enumerate() {
        out.write_next(&p.data)?;
        if let (0, WriteFault::PauseMidway(pause)) = (i, fault) {
            eprintln!("rank {rank}: pausing {:.0} s in the middle of {} (injected fault)", pause.as_secs_f64(), path.display());
            std::thread::sleep(pause);
        }
    }
    let check = out.finish()?;
    if fault == WriteFault::DamageWritten {
        eprintln!("rank {rank}: flipping a byte of {} after writing it (injected fault)", path.display());
        flip_middle_byte(&path)?;
    }
    Ok(PartWritten { rank, file, check, pieces: written, seconds: start.elapsed().as_secs_f64() })
}

/// Flips the bits of the byte in the middle of `path`, keeping its size (`damage-write`).
fn flip_middle_byte(path: &Path) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).at(path)?;
    let middle = file.metadata().at(path)?.len() / 2;
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, middle).at(path)?;
    file.write_all_at(&[!byte[0]], middle).and_then(|()| file.sync_all()).at(path)
}

/// Describes a sharded checkpoint (rank 0) from what every rank wrote into `partial`:
/// index.json (refused when the pieces do not cover every tensor exactly once), then meta.json
/// and meta.crc32 in [`SHARDED_FORMAT`]. On an error the partial folder is left for the caller
/// to remove.
pub fn describe(partial: &Path, mut meta: CheckpointMeta, parts: &[PartWritten]) -> Result<()> {
    let bad = |reason: String| Error::Checkpoint { path: partial.to_path_buf(), reason };
    let index = build_index(parts).map_err(bad)?;
    let text = serde_json::to_vec_pretty(&index).map_err(|e| bad(format!("{INDEX_FILE}: {e}")))?;
    write_synced(&partial.join(INDEX_FILE), &text)?;
    meta.files = [(INDEX_FILE.to_string(), FileCheck { bytes: text.len() as u64, crc32: crc32fast::hash(&text) })].into();
    write_meta(partial, meta, SHARDED_FORMAT)
}

/// Completes a described and verified checkpoint of `step` (rank 0): the rename of `partial`
/// into `root/ckpt-<step>`, then pruning by `retention`.
pub fn place_and_prune(root: &Path, partial: &Path, step: u64, retention: Retention) -> Result<PathBuf> {
    let final_dir = root.join(folder_name(step));
    place(root, partial, &final_dir)?;
    prune(root, step, retention);
    Ok(final_dir)
}

/// Writes a sharded checkpoint of the step `meta.step` under `root`: collective, every rank
/// passes the pieces it writes (possibly none). Which rank writes a replicated tensor is the
/// caller's choice; every tensor must be covered exactly once across the ranks. Returns the same
/// [`Written`] on every rank, or an error on every rank (the folder is then not written, and
/// the previous checkpoints are untouched). `meta.files` and `meta.format` are set here; older
/// checkpoints are pruned by `retention` once the new one is verified and in place. `fault`: a
/// test's, see [`WriteFault`].
pub fn save_sharded(world: &World, root: &Path, meta: CheckpointMeta, pieces: &[Piece], retention: Retention, fault: WriteFault) -> Result<Written> {
    let start = Instant::now();
    let step = meta.step;
    let partial = partial_dir(root, step);
    let (rank, ranks) = (world.rank as usize, world.size as usize);
    let attempt = (|| -> Result<PartWritten> {
        world.agree(match world.is_root() {
            true => {
                let _ = std::fs::remove_dir_all(&partial);
                std::fs::create_dir_all(&partial).at(&partial)
            }
            false => Ok(()),
        })?;
        // Every rank waits for the slowest writer in the agreement; watched as this rank's own
        // work meanwhile, so that a rank stuck in its write names itself (crate::watchdog).
        let written = {
            let _own = crate::watchdog::own_work(|| format!("writing its part {}", partial.join(part_file(rank)).display()), Some(step));
            write_part(&partial, rank, pieces, fault)
        };
        let part = world.agree(written)?;
        // Every rank takes part in the agreement, also when rank 0 could not read a description.
        world.agree(gather_parts(world, &part).and_then(|parts| match parts {
            Some(parts) => describe(&partial, meta, &parts),
            None => Ok(()),
        }))?;
        world.agree(verify_written(&partial, rank, ranks))?;
        world.agree(match world.is_root() {
            true => place_and_prune(root, &partial, step, retention).map(|_| ()),
            false => Ok(()),
        })?;
        Ok(part)
    })();
    if attempt.is_err() && world.is_root() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    let part = attempt?;
    // f64 holds byte counts exactly up to 2^53 (8 PiB).
    let bytes = world.sum_f64(part.check.bytes as f64) as u64;
    let seconds = world.max_f64(start.elapsed().as_secs_f64());
    Ok(Written { dir: root.join(folder_name(step)), files: world.size as usize, bytes, seconds })
}

/// Rank 0 receives every rank's [`PartWritten`] (as JSON), in rank order; the others get None.
fn gather_parts(world: &World, part: &PartWritten) -> Result<Option<Vec<PartWritten>>> {
    let text = serde_json::to_vec(part).map_err(|e| Error::exchange("checkpoint", format!("describing the part file: {e}")))?;
    let count = text.len() as i32;
    let root = world.comm.process_at_rank(0);
    if !world.is_root() {
        root.gather_into(&count);
        root.gather_varcount_into(&text[..]);
        return Ok(None);
    }
    let mut counts = vec![0i32; world.size as usize];
    root.gather_into_root(&count, &mut counts[..]);
    let displs: Vec<i32> = counts.iter().scan(0, |acc, &c| { let d = *acc; *acc += c; Some(d) }).collect();
    let mut all = vec![0u8; counts.iter().map(|&c| c as usize).sum()];
    {
        let mut partition = mpi::datatype::PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
        root.gather_varcount_into_root(&text[..], &mut partition);
    }
    let parts = counts
        .iter()
        .zip(&displs)
        .map(|(&c, &d)| serde_json::from_slice(&all[d as usize..(d + c) as usize]).map_err(|e| Error::exchange("checkpoint", format!("a rank's part description: {e}"))))
        .collect::<Result<Vec<PartWritten>>>()?;
    Ok(Some(parts))
}
