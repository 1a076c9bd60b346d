//! The fusion buffers that buckets are packed into.
//!
//! Planning (which tensors share a bucket, at which offsets) is pure arithmetic and lives in
//! `plan::buckets` ([`BucketPlan`]); [`Fusion`] owns the buffers, made once, and copies
//! gradients in and out of them around whatever reduction a strategy runs on each bucket.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::plan::buckets::{Bucket, BucketPlan, Slot};
use crate::raw;

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
