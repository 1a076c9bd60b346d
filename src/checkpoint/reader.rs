//! Reading checkpoints of either format: finding the newest good one ([`find_latest`],
//! [`find_latest_together`]), checking one ([`verify`]), and reading any region of any tensor
//! from it ([`CheckpointReader`]), whatever layout wrote it and whatever layout reads it.
//!
//! A whole checkpoint (formats 1 to 3) reads as one whose two files hold one whole piece per
//! tensor; a sharded one (format 4) through its index. Part files are memory-mapped, so a read
//! touches only the pages of the elements it copies (and each file's header).
//!
//! **Verification.** A whole checkpoint is verified as before: every byte of both files against
//! its CRC-32. A sharded checkpoint is verified whole too, every byte of every part file against
//! the CRC-32 in index.json, and the part files' headers against the index, before any rank
//! reads from it: a damaged part found only when a rank reads its slice would come too late to
//! fall back on the previous checkpoint (the other ranks may have read theirs and gone on), and
//! a slice's bytes alone cannot be checked against a CRC-32 of the whole file. What keeps this
//! from costing every rank the whole checkpoint is [`find_latest_together`]: each rank checks
//! every size-th part file, so the checkpoint is read once in all, spread over the ranks, and a
//! damaged file anywhere makes every rank skip that checkpoint, as [`find_latest`] does on one
//! process.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use mpi::traits::*;
use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::topology::World;

use super::files::{folder_name, list_steps};
use super::index::{read_index, Section, ShardIndex, StoredPiece, TensorEntry};
use super::meta::{check_file, read_checked_meta, Checkpoint, CheckpointMeta, OPTIMIZER_FILE, WEIGHTS_FILE};
use super::region::{overlap, Region};
use super::stream::kind_of;
use super::whole;

/// Checks one checkpoint folder, either format: meta.json against meta.crc32, then every file
/// against the size and CRC-32 recorded for it (every byte read), and the files' headers.
pub fn verify(dir: &Path) -> Result<Checkpoint> {
    verify_share(dir, 0, 1)
}

/// [`verify`] of the part of the work that falls to `rank` of `ranks`: meta.json and index.json
/// on every rank, the part files `rank`, `rank + ranks`, ... (a whole checkpoint's files on rank
/// 0).
fn verify_share(dir: &Path, rank: usize, ranks: usize) -> Result<Checkpoint> {
    let meta = read_checked_meta(dir)?;
    if meta.is_sharded() {
        verify_parts(dir, &meta, |k| k % ranks == rank)?;
    } else if rank == 0 {
        whole::verify_files(dir, &meta)?;
    }
    Ok(Checkpoint { dir: dir.to_path_buf(), meta })
}

/// [`verify`] of a sharded checkpoint just written into `dir` (its partial folder, before the
/// rename), by every rank at once: rank r reads back the part file of rank r + 1 (the last rank
/// rank 0's), so that every file is read once in all, and by a rank other than its writer
/// wherever there are two (on a shared file system, what another client sees of it). Until
/// this passes on every rank the checkpoint is not complete, and nothing older is pruned.
pub fn verify_written(dir: &Path, rank: usize, ranks: usize) -> Result<()> {
    let meta = read_checked_meta(dir)?;
    verify_parts(dir, &meta, |k| (k + ranks - 1) % ranks == rank).map(|_| ())
}

/// Checks the part files `mine` picks (by their number in the index's order): size and CRC-32,
/// and every piece the index puts in them present with its dtype and shape.
fn verify_parts(dir: &Path, meta: &CheckpointMeta, mine: impl Fn(usize) -> bool) -> Result<ShardIndex> {
    let bad = |reason: String| Error::Checkpoint { path: dir.to_path_buf(), reason };
    let index = read_index(dir, meta)?;
    let mut pieces_of: HashMap<&str, Vec<(&TensorEntry, &StoredPiece)>> = HashMap::new();
    for section in [Section::Weights, Section::Optimizer] {
        for entry in index.section(section).values() {
            for piece in &entry.pieces {
                pieces_of.entry(piece.file.as_str()).or_default().push((entry, piece));
            }
        }
    }
    for (k, (file, check)) in index.files.iter().enumerate() {
        if !mine(k) {
            continue;
        }
        check_file(dir, file, check).map_err(bad)?;
        let mapped = MappedFile::open(dir, file).map_err(bad)?;
        for (entry, piece) in pieces_of.get(file.as_str()).into_iter().flatten() {
            mapped.stored(entry, piece).map_err(bad)?;
        }
    }
    if let Some(file) = pieces_of.keys().find(|f| !index.files.contains_key(**f)) {
        return Err(bad(format!("index.json puts pieces in {file}, which it does not list")));
    }
    Ok(index)
}

/// The newest complete checkpoint under `root`, skipping (and naming) damaged ones.
pub fn find_latest(root: &Path) -> Result<Option<Checkpoint>> {
    if !root.exists() {
        return Ok(None);
    }
    let mut steps = list_steps(root);
    steps.sort_unstable_by(|a, b| b.cmp(a));
    for step in steps {
        match verify(&root.join(folder_name(step))) {
            Ok(c) => return Ok(Some(c)),
            Err(e) => log::warn!("skipping a damaged checkpoint: {e}"),
        }
    }
    Ok(None)
}

/// [`verify`] by every rank together (collective): each checks its share of the part files;
/// a failure on any rank is an error on all ([`World::agree`]).
pub fn verify_together(world: &World, dir: &Path) -> Result<Checkpoint> {
    world.agree(verify_share(dir, world.rank as usize, world.size as usize))
}

/// [`find_latest`] by every rank together (collective): rank 0's listing of `root`, newest
/// first; each rank verifies its share of each checkpoint's part files, and a checkpoint that
/// fails on any rank is skipped by all. Every rank returns the same checkpoint.
pub fn find_latest_together(world: &World, root: &Path) -> Result<Option<Checkpoint>> {
    let mut steps = if world.is_root() && root.exists() { list_steps(root) } else { Vec::new() };
    steps.sort_unstable_by(|a, b| b.cmp(a));
    let mut count = steps.len() as u64;
    let from_root = world.comm.process_at_rank(0);
    from_root.broadcast_into(&mut count);
    steps.resize(count as usize, 0);
    if count > 0 {
        from_root.broadcast_into(&mut steps[..]);
    }
    for step in steps {
        let found = verify_share(&root.join(folder_name(step)), world.rank as usize, world.size as usize);
        let failed_somewhere = world.max_f64(if found.is_err() { 1.0 } else { 0.0 }) > 0.0;
        match found {
            Ok(c) if !failed_somewhere => return Ok(Some(c)),
            Ok(_) => {}
            Err(e) => log::warn!("skipping a damaged checkpoint: {e}"),
        }
    }
    Ok(None)
}

/// Every model variable and every optimizer state buffer of a checkpoint, whole, by name (a
/// sharded checkpoint's pieces assembled): the tests' reference reader.
#[cfg(test)]
pub fn load(ckpt: &Checkpoint) -> Result<(BTreeMap<String, Tensor>, BTreeMap<String, Tensor>)> {
    if !ckpt.meta.is_sharded() {
        let read = |file: &str| -> Result<BTreeMap<String, Tensor>> { Ok(Tensor::read_safetensors(ckpt.dir.join(file))?.into_iter().collect()) };
        return Ok((read(WEIGHTS_FILE)?, read(OPTIMIZER_FILE)?));
    }
    let reader = CheckpointReader::open(ckpt)?;
    let read = |section: Section| -> Result<BTreeMap<String, Tensor>> {
        reader.tensors(section).into_iter().map(|t| Ok((t.name.clone(), reader.read_whole(section, &t.name)?))).collect()
    };
    Ok((read(Section::Weights)?, read(Section::Optimizer)?))
}

/// A tensor of a checkpoint, whole.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub shape: Vec<i64>,
    pub kind: Kind,
}

/// What a reader has read so far: bytes of tensor data copied out of the files (headers and
/// index not counted) and seconds spent opening and reading.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct ReadStats {
    pub bytes: u64,
    pub seconds: f64,
}

/// One stored tensor's place in its mapped file.
struct Stored {
    dtype: String,
    shape: Vec<i64>,
    begin: usize,
    end: usize,
}

/// A safetensors file mapped into memory, its header parsed (only the header's pages read).
struct MappedFile {
    name: String,
    map: memmap2::Mmap,
    tensors: HashMap<String, Stored>,
}

impl MappedFile {
    fn open(dir: &Path, file: &str) -> std::result::Result<MappedFile, String> {
        let map = crate::raw::map_read_only(&dir.join(file)).map_err(|e| format!("{file}: {e}"))?;
        let (header, metadata) = safetensors::SafeTensors::read_metadata(&map).map_err(|e| format!("{file}: not a complete safetensors file ({e:?})"))?;
        let data = 8 + header;
        let tensors = metadata
            .tensors()
            .into_iter()
            .map(|(key, info)| {
                let stored = Stored { dtype: format!("{:?}", info.dtype), shape: info.shape.iter().map(|&d| d as i64).collect(), begin: data + info.data_offsets.0, end: data + info.data_offsets.1 };
                (key, stored)
            })
            .collect();
        Ok(MappedFile { name: file.to_string(), map, tensors })
    }

    /// The stored bytes of `piece` of the tensor `entry`, checked against what the index says.
    fn stored(&self, entry: &TensorEntry, piece: &StoredPiece) -> std::result::Result<&[u8], String> {
        let stored = self.tensors.get(&piece.key).ok_or_else(|| format!("{} has no tensor {}", self.name, piece.key))?;
        let shape = piece.region.piece_shape(&entry.shape);
        if stored.dtype != entry.dtype || stored.shape != shape {
            return Err(format!("{} {}: {} of shape {:?} stored, the index says {} of shape {shape:?}", self.name, piece.key, stored.dtype, stored.shape, entry.dtype));
        }
        Ok(&self.map[stored.begin..stored.end])
    }

    /// Lets go of the pages of a piece read from this file (raw::release_pages).
    fn release(&self, piece: &StoredPiece) {
        if let Some(stored) = self.tensors.get(&piece.key) {
            crate::raw::release_pages(&self.map, stored.begin, stored.end - stored.begin);
        }
    }
}

/// Any region of any tensor of one checkpoint, either format (see the module's notes).
pub struct CheckpointReader {
    checkpoint: Checkpoint,
    weights: BTreeMap<String, TensorEntry>,
    optimizer: BTreeMap<String, TensorEntry>,
    /// Part files mapped so far, opened when first read from.
    files: RefCell<HashMap<String, Rc<MappedFile>>>,
    /// Shared with [`CheckpointReader::shared_stats`]: a run keeps counting what was read after
    /// the reader is gone (ZeRO reads its state at the first step, then drops the reader).
    stats: Rc<Cell<ReadStats>>,
}

impl CheckpointReader {
    /// Opens a checkpoint that [`verify`] (or [`find_latest`], [`find_latest_together`]) found
    /// good. A whole checkpoint's two files are mapped and their headers read; a sharded one's
    /// index is read, and its part files are mapped as reads reach them.
    pub fn open(checkpoint: &Checkpoint) -> Result<CheckpointReader> {
        let start = Instant::now();
        let dir = &checkpoint.dir;
        let bad = |reason: String| Error::Checkpoint { path: dir.to_path_buf(), reason };
        let mut files = HashMap::new();
        let (weights, optimizer) = if checkpoint.meta.is_sharded() {
            let index = read_index(dir, &checkpoint.meta)?;
            (index.weights, index.optimizer)
        } else {
            let mut sections = [BTreeMap::new(), BTreeMap::new()];
            for (file, tensors) in [WEIGHTS_FILE, OPTIMIZER_FILE].into_iter().zip(&mut sections) {
                let mapped = MappedFile::open(dir, file).map_err(bad)?;
                for (key, stored) in &mapped.tensors {
                    let piece = StoredPiece { file: file.to_string(), key: key.clone(), region: Region::Whole };
                    tensors.insert(key.clone(), TensorEntry { shape: stored.shape.clone(), dtype: stored.dtype.clone(), pieces: vec![piece] });
                }
                files.insert(file.to_string(), Rc::new(mapped));
            }
            let [weights, optimizer] = sections;
            (weights, optimizer)
        };
        for section in [&weights, &optimizer] {
            if let Some((name, entry)) = section.iter().find(|(_, e)| kind_of(&e.dtype).is_none()) {
                return Err(bad(format!("tensor {name}: dtype {} is not one this binary reads", entry.dtype)));
            }
        }
        let stats = Rc::new(Cell::new(ReadStats { bytes: 0, seconds: start.elapsed().as_secs_f64() }));
        Ok(CheckpointReader { checkpoint: checkpoint.clone(), weights, optimizer, files: RefCell::new(files), stats })
    }

    fn section(&self, section: Section) -> &BTreeMap<String, TensorEntry> {
        match section {
            Section::Weights => &self.weights,
            Section::Optimizer => &self.optimizer,
        }
    }

    /// The tensors of `section`, by name (every dtype was checked at open).
    pub fn tensors(&self, section: Section) -> Vec<TensorInfo> {
        self.section(section).iter().filter_map(|(name, entry)| Some(TensorInfo { name: name.clone(), shape: entry.shape.clone(), kind: kind_of(&entry.dtype)? })).collect()
    }

    /// What has been read so far.
    pub fn stats(&self) -> ReadStats {
        self.stats.get()
    }

    /// The counts of [`CheckpointReader::stats`], kept up to date as long as any reader of them
    /// lives and readable after.
    pub fn shared_stats(&self) -> Rc<Cell<ReadStats>> {
        self.stats.clone()
    }

    /// The checkpoint read.
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// The global shape of tensor `name` of `section`, if the checkpoint has it.
    pub fn shape(&self, section: Section, name: &str) -> Option<&[i64]> {
        self.section(section).get(name).map(|e| e.shape.as_slice())
    }

    fn mapped(&self, file: &str) -> std::result::Result<Rc<MappedFile>, String> {
        if let Some(found) = self.files.borrow().get(file) {
            return Ok(found.clone());
        }
        let opened = Rc::new(MappedFile::open(&self.checkpoint.dir, file)?);
        self.files.borrow_mut().insert(file.to_string(), opened.clone());
        Ok(opened)
    }

    /// The whole tensor `name` of `section`, on the host.
    pub fn read_whole(&self, section: Section, name: &str) -> Result<Tensor> {
        self.read(section, name, &Region::Whole)
    }

    /// The elements `region` of the tensor `name` of `section`, on the host, shaped as the
    /// region's pieces are ([`Region::piece_shape`]: the tensor's shape, the rectangle's
    /// lengths, or 1-D for a flat range), copied from the stored pieces that hold them and only
    /// those.
    pub fn read(&self, section: Section, name: &str, region: &Region) -> Result<Tensor> {
        let start = Instant::now();
        let dir = &self.checkpoint.dir;
        let bad = |reason: String| Error::Checkpoint { path: dir.clone(), reason };
        let entry = self.section(section).get(name).ok_or_else(|| bad(format!("no tensor {name} among its {}", section.name())))?;
        region.check(name, &entry.shape).map_err(bad)?;
        let kind = kind_of(&entry.dtype).ok_or_else(|| bad(format!("tensor {name}: dtype {} is not one this binary reads", entry.dtype)))?;
        let size = kind.elt_size_in_bytes();
        let wanted = region.elements(&entry.shape);
        let mut copied = 0i64;
        let bytes = crate::raw::host_bytes(wanted as usize * size, false, |out| {
            for piece in &entry.pieces {
                let runs = overlap(&entry.shape, &piece.region, region);
                if runs.is_empty() {
                    continue;
                }
                let file = self.mapped(&piece.file).map_err(bad)?;
                let data = file.stored(entry, piece).map_err(bad)?;
                for run in runs {
                    let (from, to, len) = (run.from as usize * size, run.to as usize * size, run.len as usize * size);
                    out[to..to + len].copy_from_slice(&data[from..from + len]);
                    copied += run.len;
                }
                // Copied: the piece's pages leave this process (the page cache keeps them).
                file.release(piece);
            }
            Ok(())
        })?;
        if copied != wanted {
            return Err(bad(format!("tensor {name}: its pieces hold {copied} of the {wanted} elements asked for")));
        }
        let tensor = bytes.f_view_dtype(kind)?.f_reshape(region.piece_shape(&entry.shape))?;
        let mut stats = self.stats.get();
        stats.bytes += (wanted as usize * size) as u64;
        stats.seconds += start.elapsed().as_secs_f64();
        self.stats.set(stats);
        Ok(tensor)
    }
}

/// The folder a command names: a checkpoint folder (with meta.json), verified, or a
/// `--checkpoint-dir`, whose newest good checkpoint is taken.
pub fn checkpoint_at(path: &Path) -> Result<Checkpoint> {
    if path.join(super::meta::META_FILE).exists() {
        return verify(path);
    }
    find_latest(path)?.ok_or_else(|| Error::Checkpoint { path: PathBuf::from(path), reason: "no complete checkpoint here (neither a checkpoint folder with meta.json nor a folder of ckpt-<step> folders)".into() })
}
