//! Moving GPU buckets through pinned host memory when the MPI library cannot read device memory.
//!
//! Two pinned buffers alternate: while bucket b is exchanged from one, bucket b+1 is already
//! being copied device-to-host into the other, and bucket b's result is copied back
//! host-to-device behind it on the same stream. Host buckets and device buckets on the direct
//! (CUDA-aware) path are handed over where they are.

use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::exchange::DataPath;

#[derive(Default)]
pub struct Staging {
    /// Two pinned host buffers of `capacity` elements.
    buffers: Vec<Tensor>,
    capacity: usize,
    layout: Option<(Kind, Device)>,
    /// Time spent waiting for copies between device and host, in all.
    copy_time: Duration,
}

impl Staging {
    pub fn new() -> Staging {
        Staging::default()
    }

    /// Pinned buffers for buckets of up to `len` elements of `kind`, for `device`; made once and
    /// grown only when a larger bucket comes.
    fn ensure(&mut self, len: usize, kind: Kind, device: Device) -> Result<()> {
        if self.layout == Some((kind, device)) && self.capacity >= len {
            return Ok(());
        }
        self.buffers = (0..2)
            .map(|_| Tensor::f_zeros([len as i64], (kind, Device::Cpu))?.f_pin_memory(device))
            .collect::<std::result::Result<_, _>>()?;
        self.capacity = len;
        self.layout = Some((kind, device));
        Ok(())
    }

    /// Time spent waiting for copies between device and host so far (the staged path's cost).
    pub fn copy_time(&self) -> Duration {
        self.copy_time
    }

    /// Runs `reduce(b, bucket)` on every bucket in order, on `path`. On the staged path `reduce`
    /// receives a pinned host tensor holding the bucket, and the result is copied back.
    pub fn run(
        &mut self,
        path: DataPath,
        buckets: &mut [Tensor],
        mut reduce: impl FnMut(usize, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        if path != DataPath::Staged {
            for (b, bucket) in buckets.iter_mut().enumerate() {
                if path == DataPath::Direct {
                    synchronize(bucket.device()); // the kernels that wrote the bucket are done
                }
                reduce(b, bucket)?;
            }
            return Ok(());
        }
        let Some(first) = buckets.first() else { return Ok(()) };
        let (kind, device) = (first.kind(), first.device());
        let longest = buckets.iter().map(|b| b.numel()).max().unwrap_or(0);
        self.ensure(longest, kind, device)?;

        let host_view = |buffers: &[Tensor], b: usize, len: usize| buffers[b % 2].narrow(0, 0, len as i64);
        // Device-to-host of bucket 0; each iteration starts the copy of the next bucket before
        // exchanging the current one.
        let _ = first.f_internal_copy_from(&host_view(&self.buffers, 0, first.numel()), true)?;
        for b in 0..buckets.len() {
            let wait = Instant::now();
            synchronize(device); // D2H of bucket b (and H2D of b-1, which used the other buffer) done
            self.copy_time += wait.elapsed();
            if let Some(next) = buckets.get(b + 1) {
                let _ = next.f_internal_copy_from(&host_view(&self.buffers, b + 1, next.numel()), true)?;
            }
            let mut host = host_view(&self.buffers, b, buckets[b].numel());
            reduce(b, &mut host)?;
            let _ = host.f_internal_copy_from(&buckets[b], true)?;
        }
        let wait = Instant::now();
        synchronize(device);
        self.copy_time += wait.elapsed();
        Ok(())
    }
}

/// Waits for all queued work on `device` (a no-op on the CPU).
pub fn synchronize(device: Device) {
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}
