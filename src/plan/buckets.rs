//! Bucket plans: which tensors share a bucket, and at which offsets. Pure arithmetic, used by
//! the strategies' fusion (`exchange::buckets`), overlap's buckets, ZeRO's shards and
//! Horovod's fusion alike.

/// Where one tensor sits in its bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    pub tensor: usize,
    pub offset: usize,
    pub len: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub slots: Vec<Slot>,
    /// Elements in the bucket.
    pub len: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    pub buckets: Vec<Bucket>,
    /// Element count of every tensor the plan was made for, in tensor order.
    pub sizes: Vec<usize>,
}

impl BucketPlan {
    /// Groups tensors of `sizes` elements (of `elem_bytes` each) into buckets of at most
    /// `bucket_bytes`, walking them in reverse order: the order in which backward produces
    /// gradients, so that the first bucket is complete first. A tensor larger than the limit gets
    /// a bucket of its own. `bucket_bytes == 0` gives one bucket per tensor (no fusion).
    /// `first_bucket_bytes`, when given, caps the first bucket separately (DDP keeps it small so
    /// that communication starts early in the backward pass).
    pub fn new(sizes: &[usize], elem_bytes: usize, bucket_bytes: usize, first_bucket_bytes: Option<usize>) -> Self {
        let reverse: Vec<usize> = (0..sizes.len()).rev().collect();
        Self::in_order(sizes, &reverse, elem_bytes, bucket_bytes, first_bucket_bytes)
    }

    /// As [`BucketPlan::new`], walking the tensors in `order` (every index once): the order in
    /// which a backward pass really produced their gradients (DDP rebuilds its buckets so after
    /// the first step).
    pub fn in_order(sizes: &[usize], order: &[usize], elem_bytes: usize, bucket_bytes: usize, first_bucket_bytes: Option<usize>) -> Self {
        debug_assert_eq!(order.len(), sizes.len());
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut current = Bucket { slots: Vec::new(), len: 0 };
        for &tensor in order {
            let len = sizes[tensor];
            let limit = match (buckets.is_empty(), first_bucket_bytes) {
                (true, Some(first)) => first,
                _ => bucket_bytes,
            };
            let fits = (current.len + len) * elem_bytes <= limit;
            if !current.slots.is_empty() && !fits {
                buckets.push(std::mem::replace(&mut current, Bucket { slots: Vec::new(), len: 0 }));
            }
            current.slots.push(Slot { tensor, offset: current.len, len });
            current.len += len;
        }
        if !current.slots.is_empty() {
            buckets.push(current);
        }
        BucketPlan { buckets, sizes: sizes.to_vec() }
    }

    #[cfg(test)]
    pub fn total_len(&self) -> usize {
        self.sizes.iter().sum()
    }

    /// The bucket each tensor lands in.
    pub fn bucket_of(&self) -> Vec<usize> {
        let mut of = vec![0; self.sizes.len()];
        for (b, bucket) in self.buckets.iter().enumerate() {
            for slot in &bucket.slots {
                of[slot.tensor] = b;
            }
        }
        of
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_reverse_order_and_respect_the_limit() {
        // Four tensors of 4-byte elements, limit 40 bytes = 10 elements.
        let plan = BucketPlan::new(&[3, 8, 2, 5], 4, 40, None);
        let as_lists: Vec<Vec<usize>> =
            plan.buckets.iter().map(|b| b.slots.iter().map(|s| s.tensor).collect()).collect();
        assert_eq!(as_lists, vec![vec![3, 2], vec![1], vec![0]]);
        assert_eq!(plan.buckets[0].len, 7);
        assert_eq!(plan.buckets[0].slots[1], Slot { tensor: 2, offset: 5, len: 2 });
        assert_eq!(plan.total_len(), 18);
        assert_eq!(plan.bucket_of(), vec![2, 1, 0, 0]);
    }

    #[test]
    fn buckets_can_follow_the_order_gradients_arrived_in() {
        let plan = BucketPlan::in_order(&[3, 8, 2, 5], &[1, 3, 0, 2], 4, 40, None);
        let as_lists: Vec<Vec<usize>> = plan.buckets.iter().map(|b| b.slots.iter().map(|s| s.tensor).collect()).collect();
        assert_eq!(as_lists, vec![vec![1], vec![3, 0, 2]]);
        assert_eq!(plan.bucket_of(), vec![1, 0, 1, 1]);
        assert_eq!(BucketPlan::in_order(&[3, 8, 2, 5], &[3, 2, 1, 0], 4, 40, None), BucketPlan::new(&[3, 8, 2, 5], 4, 40, None));
    }

    #[test]
    fn zero_bucket_size_means_one_tensor_per_bucket() {
        let plan = BucketPlan::new(&[3, 8, 2], 4, 0, None);
        assert_eq!(plan.buckets.len(), 3);
        assert!(plan.buckets.iter().all(|b| b.slots.len() == 1));
    }

    #[test]
    fn an_oversized_tensor_gets_its_own_bucket() {
        let plan = BucketPlan::new(&[1, 100, 1], 4, 16, None);
        let lens: Vec<usize> = plan.buckets.iter().map(|b| b.len).collect();
        assert_eq!(lens, vec![1, 100, 1]);
    }

    #[test]
    fn first_bucket_has_its_own_cap() {
        let plan = BucketPlan::new(&[4, 4, 4, 4, 4], 1, 12, Some(4));
        let lens: Vec<usize> = plan.buckets.iter().map(|b| b.len).collect();
        assert_eq!(lens, vec![4, 12, 4]);
    }
}
