//! Bucket planning and the fusion buffers that buckets are packed into.
//!
//! Planning (which tensors share a bucket, at which offsets) is pure arithmetic and lives in
//! [`BucketPlan`]; [`Fusion`] owns the buffers, made once, and copies gradients in and out of
//! them around whatever reduction a strategy runs on each bucket.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::raw;

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

/// Fusion buffers for one bucket plan, made on first use and reused every step.
pub struct Fusion {
    bucket_bytes: usize,
    first_bucket_bytes: Option<usize>,
    plan: Option<BucketPlan>,
    /// One flat buffer per bucket of several tensors; `None` for a bucket of one tensor, which
    /// is reduced in place in the tensor itself.
    buffers: Vec<Option<Tensor>>,
    layout: Option<(Device, Kind)>,
}

impl Fusion {
    pub fn new(bucket_bytes: usize, first_bucket_bytes: Option<usize>) -> Fusion {
        Fusion { bucket_bytes, first_bucket_bytes, plan: None, buffers: Vec::new(), layout: None }
    }

    /// Makes the plan and buffers for `tensors` unless the current ones already fit them.
    pub fn prepare(&mut self, tensors: &[Tensor]) -> Result<&BucketPlan> {
        let sizes: Vec<usize> = tensors.iter().map(|t| t.numel()).collect();
        let layout = match tensors.first() {
            Some(t) => (t.device(), t.kind()),
            None => (Device::Cpu, Kind::Float),
        };
        if let Some(t) = tensors.iter().find(|t| (t.device(), t.kind()) != layout) {
            return Err(Error::exchange(
                "fusion",
                format!("all tensors of one exchange must share device and dtype: {:?} and {:?}", layout, (t.device(), t.kind())),
            ));
        }
        let fits = self.plan.as_ref().is_some_and(|p| p.sizes == sizes) && self.layout == Some(layout);
        if !fits {
            let elem_bytes = layout.1.elt_size_in_bytes();
            let plan = BucketPlan::new(&sizes, elem_bytes, self.bucket_bytes, self.first_bucket_bytes);
            self.buffers = plan
                .buckets
                .iter()
                .map(|b| (b.slots.len() > 1).then(|| Tensor::zeros([b.len as i64], (layout.1, layout.0))))
                .collect();
            self.plan = Some(plan);
            self.layout = Some(layout);
        }
        Ok(self.plan.as_ref().expect("just made"))
    }

    /// The flat tensors to reduce, one per bucket: a bucket of several tensors is packed into its
    /// fusion buffer; a bucket of one tensor is a flat view of the tensor itself (reduced in
    /// place, no copy). Hand the result of the reduction to [`Fusion::unpack`].
    pub fn pack(&mut self, tensors: &[Tensor]) -> Result<Vec<Tensor>> {
        self.prepare(tensors)?;
        let plan = self.plan.as_ref().expect("prepared");
        plan.buckets
            .iter()
            .zip(&mut self.buffers)
            .map(|(bucket, buffer)| match buffer {
                None => raw::flat_dense_view(&tensors[bucket.slots[0].tensor]),
                Some(buffer) => {
                    pack(bucket, tensors, buffer);
                    Ok(buffer.shallow_clone())
                }
            })
            .collect()
    }

    /// Copies reduced fusion buffers back into their tensors (views need nothing).
    pub fn unpack(&self, buckets: &[Tensor], tensors: &mut [Tensor]) {
        let plan = self.plan.as_ref().expect("unpack follows pack");
        for ((bucket, buffer), flat) in plan.buckets.iter().zip(&self.buffers).zip(buckets) {
            if buffer.is_some() {
                unpack(bucket, flat, tensors);
            }
        }
    }
}

/// Copies the bucket's tensors into its flat buffer.
pub fn pack(bucket: &Bucket, tensors: &[Tensor], buffer: &mut Tensor) {
    for slot in &bucket.slots {
        pack_slot(slot, &flat(&tensors[slot.tensor]), buffer);
    }
}

/// Copies one tensor's flat elements `src` to its slot in the bucket's buffer (a plain memory
/// copy for host tensors).
pub fn pack_slot(slot: &Slot, src: &Tensor, buffer: &mut Tensor) {
    if !raw::copy_host_elements(buffer, slot.offset, src, 0, slot.len) {
        let mut dst = buffer.narrow(0, slot.offset as i64, slot.len as i64);
        tch::no_grad(|| dst.copy_(src));
    }
}

/// A tensor's elements in storage order (see `raw::flat_dense_view`); a copy in logical order
/// for the rare tensor that is not dense (then only good for reading).
fn flat(t: &Tensor) -> Tensor {
    raw::flat_dense_view(t).unwrap_or_else(|_| t.reshape([-1]))
}

/// Copies the flat buffer back into the bucket's tensors.
pub fn unpack(bucket: &Bucket, buffer: &Tensor, tensors: &mut [Tensor]) {
    for slot in &bucket.slots {
        let mut dst = raw::flat_dense_view(&tensors[slot.tensor]).expect("parameters and gradients are dense");
        if !raw::copy_host_elements(&mut dst, 0, buffer, slot.offset, slot.len) {
            let src = buffer.narrow(0, slot.offset as i64, slot.len as i64);
            tch::no_grad(|| dst.copy_(&src));
        }
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

    #[test]
    fn fusion_round_trip_applies_the_reduction_to_every_element() {
        let mut tensors: Vec<Tensor> =
            [3i64, 1, 5].iter().map(|&n| Tensor::arange(n, (Kind::Float, Device::Cpu))).collect();
        let mut fusion = Fusion::new(16, None); // 4 floats per bucket
        let mut buckets = fusion.pack(&tensors).unwrap();
        let seen: Vec<(usize, usize)> = buckets.iter().enumerate().map(|(b, t)| (b, t.numel())).collect();
        for bucket in &mut buckets {
            let _ = bucket.f_mul_scalar_(2.0).unwrap();
        }
        fusion.unpack(&buckets, &mut tensors);
        // Tensor 2 alone (in place), then tensors 1 and 0 fused into one buffer of 4.
        assert_eq!(seen, vec![(0, 5), (1, 4)]);
        assert_eq!(Vec::<f32>::try_from(&tensors[0]).unwrap(), vec![0.0, 2.0, 4.0]);
        assert_eq!(Vec::<f32>::try_from(&tensors[1]).unwrap(), vec![0.0]);
        assert_eq!(Vec::<f32>::try_from(&tensors[2]).unwrap(), vec![0.0, 2.0, 4.0, 6.0, 8.0]);
    }
}
