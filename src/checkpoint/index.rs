//! index.json of a sharded checkpoint: every tensor's global shape, dtype and pieces (the part
//! file, the key in it, the region of the tensor it holds), and the size and CRC-32 of every
//! part file. Built by rank 0 from what each rank wrote, after checking that the pieces of each
//! tensor cover it exactly once.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

use super::meta::{check_file, read_checked_meta, CheckpointMeta, FileCheck, META_FILE};
use super::region::{coverage_gaps, Region};

pub const INDEX_FILE: &str = "index.json";

/// Which of a checkpoint's two sets a tensor belongs to: the model's variables (by torchvision
/// name; weights.safetensors of the whole format) or the optimizer's state (by
/// [`super::meta::state_name`]; optimizer.safetensors).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Section {
    Weights,
    Optimizer,
}

impl Section {
    pub fn name(self) -> &'static str {
        match self {
            Section::Weights => "weights",
            Section::Optimizer => "optimizer",
        }
    }
}

/// One stored piece of a tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredPiece {
    pub file: String,
    pub key: String,
    pub region: Region,
}

/// A tensor of the checkpoint, whole, and where its pieces are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub shape: Vec<i64>,
    /// The safetensors dtype name (`F32`, `BF16`, ...).
    pub dtype: String,
    pub pieces: Vec<StoredPiece>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ShardIndex {
    pub weights: BTreeMap<String, TensorEntry>,
    pub optimizer: BTreeMap<String, TensorEntry>,
    /// Every part file's size and CRC-32.
    pub files: BTreeMap<String, FileCheck>,
}

impl ShardIndex {
    pub fn section(&self, section: Section) -> &BTreeMap<String, TensorEntry> {
        match section {
            Section::Weights => &self.weights,
            Section::Optimizer => &self.optimizer,
        }
    }

    fn section_mut(&mut self, section: Section) -> &mut BTreeMap<String, TensorEntry> {
        match section {
            Section::Weights => &mut self.weights,
            Section::Optimizer => &mut self.optimizer,
        }
    }
}

/// One piece as its rank wrote it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PieceWritten {
    pub section: Section,
    pub name: String,
    /// The tensor's global shape.
    pub shape: Vec<i64>,
    pub dtype: String,
    pub key: String,
    pub region: Region,
}

/// What one rank wrote: its part file (name, size, CRC-32), the pieces in it, and how long the
/// write took. Rank 0 gathers these to build the index.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PartWritten {
    pub rank: usize,
    pub file: String,
    pub check: FileCheck,
    pub pieces: Vec<PieceWritten>,
    pub seconds: f64,
}

/// The index of the parts that the ranks wrote. Refused, naming the tensor: pieces of one
/// tensor that disagree on its shape or dtype, a region outside the tensor, and elements held by
/// no piece or by two (a replicated tensor must be written by one replica only).
pub fn build_index(parts: &[PartWritten]) -> std::result::Result<ShardIndex, String> {
    let mut index = ShardIndex::default();
    let mut first_seen: BTreeMap<(Section, &str), &str> = BTreeMap::new();
    for part in parts {
        if index.files.insert(part.file.clone(), part.check.clone()).is_some() {
            return Err(format!("two ranks wrote {}", part.file));
        }
        for p in &part.pieces {
            p.region.check(&p.name, &p.shape)?;
            let stored = StoredPiece { file: part.file.clone(), key: p.key.clone(), region: p.region.clone() };
            let entry = index.section_mut(p.section).entry(p.name.clone()).or_insert_with(|| TensorEntry { shape: p.shape.clone(), dtype: p.dtype.clone(), pieces: Vec::new() });
            let first = *first_seen.entry((p.section, p.name.as_str())).or_insert(part.file.as_str());
            if entry.shape != p.shape || entry.dtype != p.dtype {
                return Err(format!(
                    "tensor {} ({}): {} holds a piece of a {} tensor of shape {:?}, {first} one of a {} tensor of shape {:?}",
                    p.name,
                    p.section.name(),
                    part.file,
                    p.dtype,
                    p.shape,
                    entry.dtype,
                    entry.shape
                ));
            }
            entry.pieces.push(stored);
        }
    }
    for section in [Section::Weights, Section::Optimizer] {
        for (name, entry) in index.section(section) {
            check_coverage(section, name, entry)?;
        }
    }
    Ok(index)
}

/// Every element of the tensor in exactly one piece; the error says which elements are not.
fn check_coverage(section: Section, name: &str, entry: &TensorEntry) -> std::result::Result<(), String> {
    let regions: Vec<&Region> = entry.pieces.iter().map(|p| &p.region).collect();
    let (missing, doubled) = coverage_gaps(&entry.shape, &regions);
    let mut problems: Vec<String> = missing.iter().take(3).map(|(a, b)| format!("elements {a}..{b} are in no piece")).collect();
    problems.extend(doubled.iter().take(3).map(|(a, b, p, q)| {
        let (p, q) = (&entry.pieces[*p], &entry.pieces[*q]);
        format!("elements {a}..{b} are in two pieces ({} {} and {} {})", p.file, p.key, q.file, q.key)
    }));
    if problems.is_empty() {
        return Ok(());
    }
    let more = missing.len().saturating_sub(3) + doubled.len().saturating_sub(3);
    let more = if more > 0 { format!(", and {more} more such ranges") } else { String::new() };
    Err(format!(
        "tensor {name} ({}) of shape {:?}: {}{more} (flat row-major element numbers; every element must be written by exactly one rank)",
        section.name(),
        entry.shape,
        problems.join(", ")
    ))
}

/// Reads a sharded checkpoint's index.json, checked against the size and CRC-32 that meta.json
/// records for it.
pub fn read_index(dir: &Path, meta: &CheckpointMeta) -> Result<ShardIndex> {
    let bad = |reason: String| Error::Checkpoint { path: dir.to_path_buf(), reason };
    let expected = meta.files.get(INDEX_FILE).ok_or_else(|| bad(format!("{META_FILE} lists no {INDEX_FILE}")))?;
    check_file(dir, INDEX_FILE, expected).map_err(bad)?;
    let text = std::fs::read_to_string(dir.join(INDEX_FILE)).map_err(|e| bad(format!("{INDEX_FILE}: {e}")))?;
    serde_json::from_str(&text).map_err(|e| bad(format!("{INDEX_FILE}: {e}")))
}

/// What pruning trusts a checkpoint folder by without reading its data: meta.json passes its
/// own check, and every file it covers (through index.json for a sharded one) is there at its
/// recorded size. A checkpoint that fails this is damaged; one that passes may still fail
/// reader.rs's `verify`, which reads every byte.
pub fn check_sizes(dir: &Path) -> Result<()> {
    let bad = |reason: String| Error::Checkpoint { path: dir.to_path_buf(), reason };
    let meta = read_checked_meta(dir)?;
    let files = match meta.is_sharded() {
        true => read_index(dir, &meta)?.files,
        false => meta.files.clone(),
    };
    for (file, check) in &files {
        let len = std::fs::metadata(dir.join(file)).map_err(|e| bad(format!("{file}: {e}")))?.len();
        if len != check.bytes {
            return Err(bad(format!("{file} holds {len} bytes, {} were written (truncated or replaced)", check.bytes)));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(name: &str, region: Region) -> PieceWritten {
        PieceWritten { section: Section::Weights, name: name.into(), shape: vec![4, 6], dtype: "F32".into(), key: format!("weights/{name}#0"), region }
    }

    fn part(rank: usize, pieces: Vec<PieceWritten>) -> PartWritten {
        PartWritten { rank, file: format!("part-{rank}.safetensors"), check: FileCheck { bytes: 1, crc32: 2 }, pieces, seconds: 0.0 }
    }

    #[test]
    fn pieces_must_cover_each_tensor_once() {
        let shape = [4, 6];
        let rows = |start, count| piece("w", Region::rows(&shape, start, count));
        let index = build_index(&[part(0, vec![rows(0, 2)]), part(1, vec![rows(2, 2)])]).unwrap();
        assert_eq!(index.weights["w"].pieces.len(), 2);
        assert_eq!(index.files.len(), 2);

        let err = build_index(&[part(0, vec![rows(0, 2)]), part(1, vec![rows(3, 1)])]).unwrap_err();
        assert_eq!(err, "tensor w (weights) of shape [4, 6]: elements 12..18 are in no piece (flat row-major element numbers; every element must be written by exactly one rank)");
        // A replicated tensor written by two replicas.
        let err = build_index(&[part(0, vec![piece("w", Region::Whole)]), part(1, vec![piece("w", Region::Whole)])]).unwrap_err();
        assert!(err.contains("elements 0..24 are in two pieces (part-0.safetensors weights/w#0 and part-1.safetensors weights/w#0)"), "{err}");
        let err = build_index(&[part(0, vec![piece("w", Region::Flat { at: 0, len: 30 })])]).unwrap_err();
        assert!(err.starts_with("tensor w: the flat range 0..30 lies outside its 24 elements"), "{err}");
        let mut other = piece("w", Region::rows(&[4, 5], 2, 2));
        other.shape = vec![4, 5];
        let err = build_index(&[part(0, vec![rows(0, 2)]), part(1, vec![other])]).unwrap_err();
        assert!(err.contains("part-1.safetensors holds a piece of a F32 tensor of shape [4, 5], part-0.safetensors one of a F32 tensor of shape [4, 6]"), "{err}");
    }
}
