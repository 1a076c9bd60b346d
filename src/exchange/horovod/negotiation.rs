//! Rank 0's side of negotiation and the fusion of responses, apart from the MPI code: Horovod's
//! `Controller::IncrementTensorCount`, its stall inspector's table, and `FuseResponses`
//! (horovod/common/controller.cc, stall_inspector.cc).

use std::collections::HashMap;
use std::ops::Range;
use std::time::{Duration, Instant};

/// What rank 0 knows about tensors that some ranks have reported ready and others not yet.
#[derive(Debug)]
pub struct MessageTable {
    ranks: usize,
    /// Tensor id -> element count, which ranks reported it, when the first did.
    pending: HashMap<usize, (usize, Vec<bool>, Instant)>,
}

/// What a report changed, for the timeline (Horovod's NegotiateStart, RankReady, End).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reported {
    /// The first rank to report this tensor.
    pub first: bool,
    /// Every rank has now reported it: the tensor is ready to reduce, and left the table.
    pub complete: bool,
}

impl MessageTable {
    pub fn new(ranks: usize) -> MessageTable {
        MessageTable { ranks, pending: HashMap::new() }
    }

    /// `rank` reports tensor `id` of `len` elements ready at `now`. An error when another rank
    /// reported it with another element count (the ranks disagree on the model).
    pub fn report(&mut self, rank: usize, id: usize, len: usize, now: Instant) -> Result<Reported, String> {
        let ranks = self.ranks;
        let first = !self.pending.contains_key(&id);
        let entry = self.pending.entry(id).or_insert_with(|| (len, vec![false; ranks], now));
        if entry.0 != len {
            let earlier: Vec<usize> = (0..ranks).filter(|&r| entry.1[r]).collect();
            return Err(format!("tensor {id} has {} elements on rank(s) {earlier:?} and {len} on rank {rank}", entry.0));
        }
        entry.1[rank] = true;
        let complete = entry.1.iter().all(|&seen| seen);
        if complete {
            self.pending.remove(&id);
        }
        Ok(Reported { first, complete })
    }

    /// Tensors reported by some ranks but not all for at least `warning`, oldest first, with
    /// the ranks that have not reported them and how long the first report has waited.
    pub fn stalled(&self, now: Instant, warning: Duration) -> Vec<(usize, Vec<usize>, Duration)> {
        let mut out: Vec<(usize, Vec<usize>, Duration)> = self
            .pending
            .iter()
            .map(|(&id, (_, seen, since))| (id, (0..seen.len()).filter(|&r| !seen[r]).collect(), now.saturating_duration_since(*since)))
            .filter(|(_, _, waited)| *waited >= warning)
            .collect();
        out.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
        out
    }
}

/// Horovod's `TensorFusionThresholdBytes`: on a homogeneous job (the same number of ranks on
/// every node) the threshold is rounded up to a multiple of `local_size` x 8 bytes x 64, so
/// that a full buffer splits evenly over a node's ranks.
pub fn fusion_threshold(requested: usize, local_size: usize, homogeneous: bool) -> usize {
    if !homogeneous {
        return requested;
    }
    let unit = local_size.max(1) * 8 * 64;
    requested.div_ceil(unit) * unit
}

/// Horovod's `FuseResponses` for responses of one element type, in the agreed order: each group
/// takes the next response and then the following ones while the group's bytes stay within
/// `threshold` (0: every response alone). Horovod looks past a response that does not fit only
/// to skip responses of another type or device, which one exchange here never mixes.
pub fn fuse(bytes: &[usize], threshold: usize) -> Vec<Range<usize>> {
    let mut groups = Vec::new();
    let mut start = 0;
    while start < bytes.len() {
        let mut end = start + 1;
        let mut size = bytes[start];
        while end < bytes.len() && size + bytes[end] <= threshold {
            size += bytes[end];
            end += 1;
        }
        groups.push(start..end);
        start = end;
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tensor_is_ready_once_every_rank_reported_it() {
        let mut table = MessageTable::new(3);
        let t0 = Instant::now();
        assert_eq!(table.report(1, 5, 10, t0), Ok(Reported { first: true, complete: false }));
        assert_eq!(table.report(0, 5, 10, t0), Ok(Reported { first: false, complete: false }));
        assert_eq!(table.report(0, 5, 10, t0), Ok(Reported { first: false, complete: false }), "a repeated report changes nothing");
        assert_eq!(table.report(2, 5, 10, t0), Ok(Reported { first: false, complete: true }));
        // Gone from the table: the next step's report of the same tensor starts anew.
        assert_eq!(table.report(2, 5, 10, t0), Ok(Reported { first: true, complete: false }));
        let err = table.report(0, 5, 11, t0).unwrap_err();
        assert!(err.contains("10 elements on rank(s) [2] and 11 on rank 0"), "{err}");
    }

    #[test]
    fn stalls_name_the_missing_ranks_oldest_first() {
        let mut table = MessageTable::new(4);
        let t0 = Instant::now();
        table.report(0, 1, 1, t0).unwrap();
        table.report(2, 1, 1, t0).unwrap();
        table.report(3, 2, 1, t0 + Duration::from_secs(5)).unwrap();
        let now = t0 + Duration::from_secs(8);
        assert_eq!(table.stalled(now, Duration::from_secs(10)), vec![]);
        assert_eq!(
            table.stalled(now, Duration::from_secs(2)),
            vec![(1, vec![1, 3], Duration::from_secs(8)), (2, vec![0, 1, 2], Duration::from_secs(3))]
        );
    }

    #[test]
    fn the_threshold_rounds_up_on_homogeneous_jobs_only() {
        assert_eq!(fusion_threshold(128 << 20, 4, true), 128 << 20);
        assert_eq!(fusion_threshold(1000, 2, true), 1024);
        assert_eq!(fusion_threshold(1025, 2, true), 2048);
        assert_eq!(fusion_threshold(1000, 2, false), 1000);
        assert_eq!(fusion_threshold(0, 8, true), 0);
    }

    #[test]
    fn responses_fuse_in_order_up_to_the_threshold() {
        assert_eq!(fuse(&[], 100), Vec::<Range<usize>>::new());
        assert_eq!(fuse(&[40, 40, 40, 10, 200, 5], 100), vec![0..2, 2..4, 4..5, 5..6]);
        // A response larger than the threshold goes alone.
        assert_eq!(fuse(&[300, 1, 1], 100), vec![0..1, 1..3]);
        // Threshold 0: no fusion, even of empty tensors.
        assert_eq!(fuse(&[4, 0, 4], 0), vec![0..1, 1..2, 2..3]);
        assert_eq!(fuse(&[50, 50], 100), vec![0..2], "exactly full fits");
    }
}
