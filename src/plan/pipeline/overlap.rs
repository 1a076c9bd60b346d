//! The overlap of a stage's gradient exchange with its backwards (`--overlap` with the unsplit
//! schedules, as Megatron-LM's `overlap_grad_reduce`): a chunk's gradients are final after its
//! last micro-batch's backward, so that backward is the one the exchange of the chunk's buckets
//! runs beside. Which actions those are ([`final_backwards`]) and the buckets, planned chunk by
//! chunk in the order those backwards come ([`segmented_plan`]), so that no bucket waits for a
//! chunk whose backward comes later. Pure arithmetic, tested without MPI.

use std::ops::Range;

use crate::plan::buckets::BucketPlan;

use crate::plan::pipeline::shape::Action;

/// A chunk's last backward in a stage's action list: at `action`, chunk `chunk`'s gradients
/// become final; `segment` is its place among the stage's final backwards (the order in which
/// the chunks' buckets are exchanged).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FinalBackward {
    pub action: usize,
    pub chunk: usize,
    pub segment: usize,
}

/// Each chunk's last unsplit backward in `actions` (one stage's step), in action order. Empty
/// where the backward is split (the zero-bubble schedules' B and W), which this overlap does not
/// run beside the exchange.
pub fn final_backwards(actions: &[Action]) -> Vec<FinalBackward> {
    if actions.iter().any(|a| matches!(a, Action::BackwardInput { .. } | Action::BackwardWeight { .. })) {
        return Vec::new();
    }
    let mut last: Vec<(usize, usize)> = Vec::new();
    for (i, a) in actions.iter().enumerate() {
        if let Action::Backward { chunk, .. } = *a {
            match last.iter_mut().find(|(_, c)| *c == chunk) {
                Some(entry) => entry.0 = i,
                None => last.push((i, chunk)),
            }
        }
    }
    last.sort_unstable();
    last.into_iter().enumerate().map(|(segment, (action, chunk))| FinalBackward { action, chunk, segment }).collect()
}

/// Buckets over tensors of `sizes` elements that never mix two segments (`segment_of`: each
/// tensor's, below `segments`): each segment's tensors in the order `order` gives them (a
/// permutation of every tensor), bucketed as [`BucketPlan::in_order`] does (each segment's
/// first bucket capped at `first_bucket_bytes`: its exchange starts early in its backward), the
/// segments' buckets one after another. Returns the plan and each segment's range of buckets.
pub fn segmented_plan(
    sizes: &[usize],
    segment_of: &[usize],
    segments: usize,
    order: &[usize],
    elem_bytes: usize,
    bucket_bytes: usize,
    first_bucket_bytes: Option<usize>,
) -> (BucketPlan, Vec<Range<usize>>) {
    debug_assert_eq!(order.len(), sizes.len());
    let mut buckets = Vec::new();
    let mut ranges = Vec::with_capacity(segments);
    for s in 0..segments {
        let tensors: Vec<usize> = order.iter().copied().filter(|&t| segment_of[t] == s).collect();
        let local_sizes: Vec<usize> = tensors.iter().map(|&t| sizes[t]).collect();
        let local_order: Vec<usize> = (0..tensors.len()).collect();
        let local = BucketPlan::in_order(&local_sizes, &local_order, elem_bytes, bucket_bytes, first_bucket_bytes);
        let start = buckets.len();
        for mut bucket in local.buckets {
            bucket.slots.iter_mut().for_each(|slot| slot.tensor = tensors[slot.tensor]);
            buckets.push(bucket);
        }
        ranges.push(start..buckets.len());
    }
    (BucketPlan { buckets, sizes: sizes.to_vec() }, ranges)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::pipeline::schedule::schedule;
    use crate::plan::pipeline::shape::{ScheduleKind, Shape};

    fn finals(kind: ScheduleKind, stages: usize, micro: usize, virtual_stages: usize, stage: usize) -> Vec<(usize, usize)> {
        let shape = Shape::new(kind, stages, micro, virtual_stages).unwrap();
        let actions = schedule(&shape, stage);
        let finals = final_backwards(&actions);
        for f in &finals {
            // Nothing of the chunk computes after its final backward: its gradients are final.
            assert!(actions[f.action + 1..].iter().all(|a| !matches!(*a, Action::Forward { chunk, .. } | Action::Backward { chunk, .. } if chunk == f.chunk)), "{kind:?} stage {stage}: {f:?}");
            assert_eq!(actions[f.action], Action::Backward { micro: micro - 1, chunk: f.chunk });
        }
        finals.iter().map(|f| (f.chunk, f.segment)).collect()
    }

    #[test]
    fn each_chunks_last_backward_is_its_last_micro_batchs_in_the_order_the_chunks_finish() {
        for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
            for stage in 0..3 {
                assert_eq!(finals(kind, 3, 4, 1, stage), vec![(stage, 0)]);
            }
        }
        // Interleaved, 2 stages x 2 chunks: stage 0 holds chunks 0 and 2, and chunk 2's
        // backwards end first (its exchange hides behind chunk 0's remaining backwards).
        assert_eq!(finals(ScheduleKind::Interleaved, 2, 4, 2, 0), vec![(2, 0), (0, 1)]);
        assert_eq!(finals(ScheduleKind::Interleaved, 2, 4, 2, 1), vec![(3, 0), (1, 1)]);
        assert_eq!(finals(ScheduleKind::Interleaved, 2, 8, 3, 1), vec![(5, 0), (3, 1), (1, 2)]);
    }

    #[test]
    fn split_backwards_have_no_final_backward_here() {
        for (kind, v) in [(ScheduleKind::ZbH1, 1), (ScheduleKind::ZbV, 2)] {
            let shape = Shape::new(kind, 2, 4, v).unwrap();
            assert!(final_backwards(&schedule(&shape, 0)).is_empty(), "{kind:?}");
        }
    }

    #[test]
    fn buckets_never_mix_segments_and_follow_the_order_within_each() {
        // Tensors 0..6 of 10 elements (4 bytes each); 0, 1, 2 in segment 1, 3, 4, 5 in segment 0.
        let sizes = [10; 6];
        let segment_of = [1, 1, 1, 0, 0, 0];
        let order: Vec<usize> = (0..6).rev().collect();
        let (plan, ranges) = segmented_plan(&sizes, &segment_of, 2, &order, 4, 80, Some(40));
        let tensors = |b: usize| plan.buckets[b].slots.iter().map(|s| s.tensor).collect::<Vec<_>>();
        // Each segment starts with a small bucket (40 bytes: one tensor), then up to 80 bytes.
        assert_eq!(ranges, vec![0..2, 2..4]);
        assert_eq!((tensors(0), tensors(1), tensors(2), tensors(3)), (vec![5], vec![4, 3], vec![2], vec![1, 0]));
        assert_eq!(plan.buckets[1].slots[1].offset, 10);
        assert_eq!(plan.sizes, sizes.to_vec());
        // One segment: exactly the plan of the whole order.
        let (one, ranges) = segmented_plan(&sizes, &[0; 6], 1, &order, 4, 80, Some(40));
        assert_eq!(one, BucketPlan::in_order(&sizes, &order, 4, 80, Some(40)));
        assert_eq!(ranges, vec![0..one.buckets.len()]);
    }
}
