//! Which elements of a tensor a stored piece holds, and which of them a reader wants: pure
//! arithmetic on the tensor's global shape (row-major), without tensors, files or MPI.
//!
//! A piece is one of
//! - [`Region::Whole`]: the tensor (today's whole checkpoints, and a replicated tensor written by
//!   one replica),
//! - [`Region::Rect`]: a hyper-rectangle, stored with the rectangle's lengths as its shape (the
//!   rows or columns of a weight cut by tensor parallelism; a rank that holds its rows of each of
//!   q, k and v of one in-projection stores three rectangles),
//! - [`Region::Flat`]: a contiguous range of the flattened tensor, stored 1-D (a ZeRO or FSDP
//!   shard of a flat buffer, cut wherever the shard boundary falls).
//!
//! [`overlap`] says how to copy what a stored piece has of a requested piece as runs of
//! contiguous elements, so that a reader touches only the bytes it needs: both regions are
//! listed as ascending runs of the flattened tensor, and the two lists are merged.

use serde::{Deserialize, Serialize};

/// Part of a tensor of a known global shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Region {
    Whole,
    /// Elements `offsets[d] .. offsets[d] + lengths[d]` along every dimension `d`.
    Rect { offsets: Vec<i64>, lengths: Vec<i64> },
    /// Elements `at .. at + len` of the row-major flattened tensor.
    Flat { at: i64, len: i64 },
}

/// Copy `len` elements from element `from` of the stored piece to element `to` of the
/// requested piece (both counted in the pieces' own row-major order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub from: i64,
    pub to: i64,
    pub len: i64,
}

/// A contiguous range of the flattened tensor and where it starts in its piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    global: i64,
    len: i64,
    in_piece: i64,
}

/// Elements of a tensor of `shape` (1 for a scalar).
pub fn numel(shape: &[i64]) -> i64 {
    shape.iter().product()
}

impl Region {
    /// The rows `start .. start + count` of a tensor of `shape` (the first dimension's cut).
    pub fn rows(shape: &[i64], start: i64, count: i64) -> Region {
        let mut offsets = vec![0; shape.len()];
        let mut lengths = shape.to_vec();
        if let (Some(o), Some(l)) = (offsets.first_mut(), lengths.first_mut()) {
            *o = start;
            *l = count;
        }
        Region::Rect { offsets, lengths }
    }

    /// Elements the region holds.
    pub fn elements(&self, shape: &[i64]) -> i64 {
        match self {
            Region::Whole => numel(shape),
            Region::Rect { lengths, .. } => numel(lengths),
            Region::Flat { len, .. } => *len,
        }
    }

    /// The shape a piece of this region is stored with: the tensor's, the rectangle's lengths,
    /// or one dimension for a flat range.
    pub fn piece_shape(&self, shape: &[i64]) -> Vec<i64> {
        match self {
            Region::Whole => shape.to_vec(),
            Region::Rect { lengths, .. } => lengths.clone(),
            Region::Flat { len, .. } => vec![*len],
        }
    }

    /// Checks that the region lies inside a tensor of `shape`; the error names the tensor.
    pub fn check(&self, name: &str, shape: &[i64]) -> Result<(), String> {
        if shape.iter().any(|&d| d < 0) {
            return Err(format!("tensor {name}: negative dimension in its shape {shape:?}"));
        }
        match self {
            Region::Whole => Ok(()),
            Region::Rect { offsets, lengths } => {
                if offsets.len() != shape.len() || lengths.len() != shape.len() {
                    return Err(format!(
                        "tensor {name}: a rectangle with {} offsets and {} lengths for a tensor of {} dimensions {shape:?}",
                        offsets.len(),
                        lengths.len(),
                        shape.len()
                    ));
                }
                for (d, ((&o, &l), &n)) in offsets.iter().zip(lengths).zip(shape).enumerate() {
                    if o < 0 || l < 0 || o + l > n {
                        return Err(format!("tensor {name}: the rectangle's dimension {d} runs from {o} for {l}, outside 0..{n} (shape {shape:?})"));
                    }
                }
                Ok(())
            }
            Region::Flat { at, len } => {
                let total = numel(shape);
                if *at < 0 || *len < 0 || at + len > total {
                    return Err(format!("tensor {name}: the flat range {at}..{} lies outside its {total} elements (shape {shape:?})", at + len));
                }
                Ok(())
            }
        }
    }

    /// The region as ascending ranges of the flattened tensor of `shape`, each with where it
    /// starts in the piece. A rectangle gives one range per row of its last non-full
    /// dimension: full trailing dimensions are contiguous.
    fn spans(&self, shape: &[i64]) -> Vec<Span> {
        match self {
            Region::Whole => vec![Span { global: 0, len: numel(shape), in_piece: 0 }],
            Region::Flat { at, len } => vec![Span { global: *at, len: *len, in_piece: 0 }],
            Region::Rect { offsets, lengths } => rect_spans(shape, offsets, lengths),
        }
    }
}

fn rect_spans(shape: &[i64], offsets: &[i64], lengths: &[i64]) -> Vec<Span> {
    if numel(lengths) == 0 {
        return Vec::new();
    }
    let rank = shape.len();
    if rank == 0 {
        return vec![Span { global: 0, len: 1, in_piece: 0 }];
    }
    // Dimensions after `inner` (the last one the rectangle cuts) are whole, so one run covers
    // `lengths[inner]` times their product, contiguous in both the tensor and the piece.
    let inner = (0..rank).rev().find(|&d| lengths[d] != shape[d]).unwrap_or(0);
    let strides: Vec<i64> = (0..rank).map(|d| numel(&shape[d + 1..])).collect();
    let run = lengths[inner] * strides[inner];
    let outer = &lengths[..inner];
    let count = numel(outer);
    let mut spans = Vec::with_capacity(count as usize);
    let mut index = vec![0i64; inner];
    for k in 0..count {
        let global = (0..inner).map(|d| (offsets[d] + index[d]) * strides[d]).sum::<i64>() + offsets[inner] * strides[inner];
        spans.push(Span { global, len: run, in_piece: k * run });
        // The next row of the outer dimensions, in row-major order.
        for d in (0..inner).rev() {
            index[d] += 1;
            if index[d] < outer[d] {
                break;
            }
            index[d] = 0;
        }
    }
    spans
}

/// What `stored` (a piece of a tensor of `shape`) holds of `wanted`, as runs of contiguous
/// elements in both pieces, ascending in the tensor; runs contiguous in both pieces are merged.
/// Both regions must have passed [`Region::check`] for `shape`.
pub fn overlap(shape: &[i64], stored: &Region, wanted: &Region) -> Vec<Run> {
    let (a, b) = (stored.spans(shape), wanted.spans(shape));
    let (mut i, mut j) = (0, 0);
    let mut runs: Vec<Run> = Vec::new();
    while i < a.len() && j < b.len() {
        let (s, w) = (a[i], b[j]);
        let start = s.global.max(w.global);
        let end = (s.global + s.len).min(w.global + w.len);
        if start < end {
            let run = Run { from: s.in_piece + start - s.global, to: w.in_piece + start - w.global, len: end - start };
            match runs.last_mut() {
                Some(last) if last.from + last.len == run.from && last.to + last.len == run.to => last.len += run.len,
                _ => runs.push(run),
            }
        }
        if s.global + s.len <= w.global + w.len {
            i += 1;
        } else {
            j += 1;
        }
    }
    runs
}

/// Elements `start .. end` of the flattened tensor.
pub type FlatRange = (i64, i64);
/// Elements `start .. end` held by both the regions numbered `first` and `second`.
pub type DoubledRange = (i64, i64, usize, usize);

/// The elements of `shape` that no region of `regions` holds and those that two hold, as
/// ranges of the flattened tensor (for coverage errors that say which elements).
pub fn coverage_gaps(shape: &[i64], regions: &[&Region]) -> (Vec<FlatRange>, Vec<DoubledRange>) {
    let mut spans: Vec<(Span, usize)> = regions.iter().enumerate().flat_map(|(k, r)| r.spans(shape).into_iter().map(move |s| (s, k))).filter(|(s, _)| s.len > 0).collect();
    spans.sort_by_key(|(s, _)| s.global);
    let (mut missing, mut doubled) = (Vec::new(), Vec::new());
    let mut reached = 0i64;
    let mut reached_by = usize::MAX;
    for (s, k) in spans {
        if s.global > reached {
            missing.push((reached, s.global));
        } else if s.global < reached {
            doubled.push((s.global, reached.min(s.global + s.len), reached_by, k));
        }
        if s.global + s.len > reached {
            reached = s.global + s.len;
            reached_by = k;
        }
    }
    if reached < numel(shape) {
        missing.push((reached, numel(shape)));
    }
    (missing, doubled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Where each element of the tensor sits in a piece of `region` (None where it is not held),
    /// one element at a time from the definition.
    fn positions(shape: &[i64], region: &Region) -> Vec<Option<i64>> {
        let total = numel(shape);
        (0..total)
            .map(|flat| match region {
                Region::Whole => Some(flat),
                Region::Flat { at, len } => (flat >= *at && flat < at + len).then(|| flat - at),
                Region::Rect { offsets, lengths } => {
                    let mut rest = flat;
                    let mut index = vec![0; shape.len()];
                    for d in (0..shape.len()).rev() {
                        index[d] = rest % shape[d];
                        rest /= shape[d];
                    }
                    let inside = (0..shape.len()).all(|d| index[d] >= offsets[d] && index[d] < offsets[d] + lengths[d]);
                    inside.then(|| (0..shape.len()).fold(0, |acc, d| acc * lengths[d] + index[d] - offsets[d]))
                }
            })
            .collect()
    }

    fn random_region(rng: &mut impl Rng, shape: &[i64]) -> Region {
        match rng.gen_range(0..4) {
            0 => Region::Whole,
            1 => {
                let total = numel(shape);
                let at = rng.gen_range(0..=total);
                Region::Flat { at, len: rng.gen_range(0..=total - at) }
            }
            _ => {
                // Mostly cuts along one dimension (what tensor parallelism makes), sometimes any box.
                let cut_one = rng.gen_bool(0.5);
                let d_cut = rng.gen_range(0..shape.len().max(1));
                let (mut offsets, mut lengths) = (Vec::new(), Vec::new());
                for (d, &n) in shape.iter().enumerate() {
                    if cut_one && d != d_cut {
                        offsets.push(0);
                        lengths.push(n);
                    } else {
                        let o = rng.gen_range(0..n);
                        offsets.push(o);
                        lengths.push(rng.gen_range(1..=n - o));
                    }
                }
                Region::Rect { offsets, lengths }
            }
        }
    }

    /// Every combination of kinds on random small shapes (scalars to 4-D) against the
    /// element-by-element reference: each run's elements are exactly the common ones.
    #[test]
    fn overlap_matches_the_element_by_element_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut kinds_seen = std::collections::BTreeSet::new();
        for _ in 0..3000 {
            let rank = rng.gen_range(0..=4);
            let shape: Vec<i64> = (0..rank).map(|_| rng.gen_range(1..=5)).collect();
            let (stored, wanted) = (random_region(&mut rng, &shape), random_region(&mut rng, &shape));
            stored.check("t", &shape).unwrap();
            wanted.check("t", &shape).unwrap();
            let kind = |r: &Region| match r { Region::Whole => 0, Region::Rect { .. } => 1, Region::Flat { .. } => 2 };
            kinds_seen.insert((kind(&stored), kind(&wanted)));
            let (ps, pw) = (positions(&shape, &stored), positions(&shape, &wanted));
            let mut expected: Vec<(i64, i64)> = ps.iter().zip(&pw).filter_map(|(s, w)| Some(((*s)?, (*w)?))).collect();
            let runs = overlap(&shape, &stored, &wanted);
            let mut got: Vec<(i64, i64)> = runs.iter().flat_map(|r| (0..r.len).map(move |k| (r.from + k, r.to + k))).collect();
            expected.sort_unstable();
            got.sort_unstable();
            assert_eq!(got, expected, "shape {shape:?}, stored {stored:?}, wanted {wanted:?}: runs {runs:?}");
            assert!(runs.iter().all(|r| r.len > 0), "{runs:?}");
            assert_eq!(stored.elements(&shape), ps.iter().flatten().count() as i64, "{shape:?} {stored:?}");
        }
        assert_eq!(kinds_seen.len(), 9, "every pair of kinds was drawn: {kinds_seen:?}");
    }

    #[test]
    fn a_rows_cut_read_by_a_columns_cut_copies_one_run_per_row() {
        let shape = [4, 6];
        let rows = Region::rows(&shape, 2, 2);
        let cols = Region::Rect { offsets: vec![0, 3], lengths: vec![4, 3] };
        assert_eq!(overlap(&shape, &rows, &cols), vec![Run { from: 3, to: 6, len: 3 }, Run { from: 9, to: 9, len: 3 }]);
        // Whole rows are contiguous: a flat shard over them is one run.
        assert_eq!(overlap(&shape, &Region::Flat { at: 10, len: 14 }, &rows), vec![Run { from: 2, to: 0, len: 12 }]);
        assert_eq!(overlap(&shape, &Region::Whole, &Region::Whole), vec![Run { from: 0, to: 0, len: 24 }]);
    }

    #[test]
    fn bad_regions_are_refused_naming_the_tensor() {
        let shape = [4, 6];
        let err = Region::Rect { offsets: vec![0, 4], lengths: vec![4, 3] }.check("fc.weight", &shape).unwrap_err();
        assert_eq!(err, "tensor fc.weight: the rectangle's dimension 1 runs from 4 for 3, outside 0..6 (shape [4, 6])");
        let err = Region::Rect { offsets: vec![0], lengths: vec![4] }.check("fc.weight", &shape).unwrap_err();
        assert!(err.starts_with("tensor fc.weight: a rectangle with 1 offsets and 1 lengths for a tensor of 2 dimensions"), "{err}");
        let err = Region::Flat { at: 20, len: 5 }.check("fc.bias", &shape).unwrap_err();
        assert_eq!(err, "tensor fc.bias: the flat range 20..25 lies outside its 24 elements (shape [4, 6])");
        assert!(Region::Flat { at: 20, len: 4 }.check("fc.bias", &shape).is_ok());
    }

    #[test]
    fn gaps_and_doubles_are_found() {
        let shape = [4, 6];
        let (a, b) = (Region::rows(&shape, 0, 2), Region::Flat { at: 10, len: 10 });
        let (missing, doubled) = coverage_gaps(&shape, &[&a, &b]);
        assert_eq!(missing, vec![(20, 24)]);
        assert_eq!(doubled, vec![(10, 12, 0, 1)]);
        let c = Region::Flat { at: 12, len: 12 };
        assert_eq!(coverage_gaps(&shape, &[&a, &c]), (vec![], vec![]));
    }
}
