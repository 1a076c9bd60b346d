//! Moving GPU buckets through host memory when the MPI library cannot read device memory.
//!
//! Two host buffers (pinned, for a GPU) alternate: while bucket b is exchanged from one, bucket
//! b+1 is already being copied device-to-host into the other, and bucket b's result is copied
//! back host-to-device behind it. All copies are queued on the current stream, so the stream
//! orders them after the kernels that wrote the buckets and before the ones that read the
//! results; the host waits only for the copy it is about to read, through an event recorded
//! right after that copy. Host buckets and device buckets on the direct (CUDA-aware) path are
//! handed over where they are.
//!
//! The same code runs on CPU tensors (the copies are then plain, the events absent), which is
//! how the CPU tests exercise it: see [`DataPath::choose`].

use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::exchange::strategy::{DataPath, ExchangeReport};
use crate::raw::{self, CudaEvent};

/// Receive space an algorithm reuses from call to call: host memory (kept as u32 words, which
/// every element kind can be cast from) and one device tensor, each grown when a call needs more
/// (or another kind or device) and never shrunk.
#[derive(Default)]
pub struct Scratch {
    host: Vec<u32>,
    device: Option<Tensor>,
}

impl Scratch {
    /// `len` elements of E in host memory (contents left from earlier calls).
    pub fn host<E: crate::element::Element>(&mut self, len: usize) -> &mut [E] {
        let words = (len * std::mem::size_of::<E>()).div_ceil(4);
        if self.host.len() < words {
            self.host.resize(words, 0);
        }
        &mut bytemuck::cast_slice_mut(&mut self.host[..words])[..len]
    }

    /// A tensor of `len` elements (at least one) of `like`'s kind on its device.
    pub fn device_like(&mut self, like: &Tensor, len: usize) -> Result<Tensor> {
        let len = len.max(1);
        if self.device.as_ref().is_none_or(|t| t.numel() < len || t.kind() != like.kind() || t.device() != like.device()) {
            self.device = Some(Tensor::f_empty([len as i64], (like.kind(), like.device()))?);
        }
        Ok(self.device.as_ref().expect("made above").narrow(0, 0, len as i64))
    }
}

#[derive(Default)]
pub struct Staging {
    /// Two host buffers of `capacity` elements, pinned for a GPU.
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

    /// Host buffers for buckets of up to `len` elements of `kind` living on `device`; made once
    /// and grown only when a larger bucket comes.
    fn ensure(&mut self, len: usize, kind: Kind, device: Device) -> Result<()> {
        if self.layout == Some((kind, device)) && self.capacity >= len {
            return Ok(());
        }
        self.buffers = (0..2)
            .map(|_| -> Result<Tensor> {
                let host = Tensor::f_zeros([len as i64], (kind, Device::Cpu))?;
                // Pinned memory is what lets a device-to-host copy run without blocking.
                if device.is_cuda() { raw::pin_memory(&host) } else { Ok(host) }
            })
            .collect::<Result<_>>()?;
        self.capacity = len;
        self.layout = Some((kind, device));
        Ok(())
    }

    /// What every all-reduce strategy reports about its data path: the path, and on the staged
    /// path the time spent waiting for copies; `extra` adds the strategy's own figures.
    pub fn report(&self, path: DataPath, mut extra: serde_json::Map<String, serde_json::Value>) -> ExchangeReport {
        if path == DataPath::Staged {
            extra.insert("staging_copy_ms".into(), (self.copy_time.as_secs_f64() * 1e3).into());
        }
        ExchangeReport { data_path: Some(path), extra }
    }

    /// What every all-reduce strategy does around its algorithm: pack `tensors` into fused
    /// buckets, run `reduce` on each where MPI can read it (staged or not), unpack the results.
    pub fn reduce_fused(
        &mut self,
        fusion: &mut crate::exchange::buckets::Fusion,
        path: DataPath,
        tensors: &mut [Tensor],
        reduce: impl FnMut(usize, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        let mut buckets = fusion.pack(tensors)?;
        self.run(path, &mut buckets, reduce)?;
        fusion.unpack(&buckets, tensors);
        Ok(())
    }

    /// Runs `reduce(b, bucket)` on every bucket in order, on `path`. On the staged path `reduce`
    /// receives a host tensor holding the bucket, and the result is copied back.
    pub fn run(
        &mut self,
        path: DataPath,
        buckets: &mut [Tensor],
        mut reduce: impl FnMut(usize, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        if path != DataPath::Staged {
            for (b, bucket) in buckets.iter_mut().enumerate() {
                crate::watchdog::set_bucket(b);
                if path == DataPath::Direct {
                    // MPI reads device memory outside stream order: the kernels that wrote the
                    // bucket must be done first.
                    wait_for_stream(bucket.device())?;
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
        // exchanging the current one. Buffer b % 2 is rewritten by the copy of bucket b + 2 only
        // after the copy back of bucket b, which the stream runs first.
        let mut arrived = copy_and_record(&mut host_view(&self.buffers, 0, first.numel()), first)?;
        for b in 0..buckets.len() {
            crate::watchdog::set_bucket(b);
            let wait = Instant::now();
            if let Some(event) = arrived.take() {
                event.synchronize()?;
            }
            self.copy_time += wait.elapsed();
            let next_arrived = match buckets.get(b + 1) {
                Some(next) => copy_and_record(&mut host_view(&self.buffers, b + 1, next.numel()), next)?,
                None => None,
            };
            let mut host = host_view(&self.buffers, b, buckets[b].numel());
            reduce(b, &mut host)?;
            raw::copy_into(&mut buckets[b], &host, true)?;
            arrived = next_arrived;
        }
        Ok(())
    }
}

/// A flat buffer on the device and its host mirror (pinned for a GPU), for exchanges that keep
/// one bucket-sized buffer and hand MPI host memory only (ZeRO's bucket, the parameter server's
/// push and pull buffers on the staged path): packing and unpacking run on the device, queued on
/// the stream like any kernel, and the bytes cross in one non-blocking copy each way instead of
/// one blocking copy per tensor. On the CPU (the test hook of [`DataPath::choose`]) both halves
/// are host tensors and the copies plain.
///
/// Every host read or write by MPI follows a wait on a copy to the host queued after every
/// earlier copy from it ([`Mirror::to_host`]), so a copy to the device still queued from the
/// host buffer cannot race with MPI writing it.
pub struct Mirror {
    device: Tensor,
    host: Tensor,
    /// Time spent waiting for copies to the host, in all.
    copy_time: Duration,
}

impl Mirror {
    /// A mirror of `len` elements of `kind`, with its device half on `device`.
    pub fn new(len: usize, kind: Kind, device: Device) -> Result<Mirror> {
        let host = Tensor::f_zeros([len as i64], (kind, Device::Cpu))?;
        Ok(Mirror {
            device: Tensor::f_zeros([len as i64], (kind, device))?,
            host: if device.is_cuda() { raw::pin_memory(&host)? } else { host },
            copy_time: Duration::ZERO,
        })
    }

    /// Elements the mirror holds.
    pub fn len(&self) -> usize {
        self.device.numel()
    }

    pub fn device_kind(&self) -> (Kind, Device) {
        (self.device.kind(), self.device.device())
    }

    /// The first `len` elements of the device half (a view).
    pub fn on_device(&self, len: usize) -> Tensor {
        self.device.narrow(0, 0, len as i64)
    }

    /// The first `len` elements of the host half (a view), for MPI.
    pub fn on_host(&self, len: usize) -> Tensor {
        self.host.narrow(0, 0, len as i64)
    }

    /// Copies elements `range` from the device to the host and waits for that copy (and so for
    /// the kernels queued before it that wrote them).
    pub fn to_host(&mut self, range: std::ops::Range<usize>) -> Result<()> {
        let (at, len) = (range.start as i64, range.len() as i64);
        let wait = Instant::now();
        if let Some(event) = copy_and_record(&mut self.host.narrow(0, at, len), &self.device.narrow(0, at, len))? {
            event.synchronize()?;
        }
        self.copy_time += wait.elapsed();
        Ok(())
    }

    /// Queues the copy of elements `range` from the host to the device, without waiting: the
    /// stream runs it before any kernel queued after it reads the device half.
    pub fn to_device(&mut self, range: std::ops::Range<usize>) -> Result<()> {
        let (at, len) = (range.start as i64, range.len() as i64);
        raw::copy_into(&mut self.device.narrow(0, at, len), &self.host.narrow(0, at, len), true)
    }

    /// Time spent waiting for copies to the host.
    pub fn copy_time(&self) -> Duration {
        self.copy_time
    }
}

/// Host buffers that staged messages pass through, pinned for a GPU (whose copies to and from
/// pinned memory are DMA transfers, where pageable memory goes through a bounce buffer) and
/// reused: a message takes one ([`HostPool::stage`], [`HostPool::take`]) and gives it back once
/// MPI and the copies are done with it ([`HostPool::give`]). Kept by size, as the same few
/// shapes come back at every step (a pipeline's boundary messages, ZeRO 3's unit buffers).
#[derive(Default)]
pub struct HostPool {
    free: Vec<Tensor>,
    /// Buffers made, in all (reuse means it stops growing).
    made: usize,
}

impl HostPool {
    /// A host buffer of `shape` and `kind` (contents left from earlier use), pinned when `for_device`
    /// is a GPU.
    pub fn take(&mut self, shape: &[i64], kind: Kind, for_device: Device) -> Result<Tensor> {
        let numel: i64 = shape.iter().product();
        if let Some(i) = self.free.iter().position(|t| t.numel() as i64 == numel && t.kind() == kind) {
            return Ok(self.free.swap_remove(i).f_view(shape)?);
        }
        self.made += 1;
        let host = Tensor::f_empty(shape, (kind, Device::Cpu))?;
        if for_device.is_cuda() { raw::pin_memory(&host) } else { Ok(host) }
    }

    /// `src` (a device tensor) copied into a host buffer of the pool, waited for: MPI may read it.
    pub fn stage(&mut self, src: &Tensor) -> Result<Tensor> {
        let mut host = self.take(&src.size(), src.kind(), src.device())?;
        // A blocking copy: it returns once the stream's kernels that write `src` and the copy
        // itself are done.
        tch::no_grad(|| host.f_copy_(src))?;
        Ok(host)
    }

    /// Gives a buffer back for the next message (MPI and every copy are done with it).
    pub fn give(&mut self, buffer: Tensor) {
        self.free.push(buffer);
    }

    /// Buffers made so far.
    pub fn made(&self) -> usize {
        self.made
    }
}

/// Queues `dst.copy_(src)` without blocking and returns an event that marks its end (None when
/// the copy is already done, between host tensors).
fn copy_and_record(dst: &mut Tensor, src: &Tensor) -> Result<Option<CudaEvent>> {
    raw::copy_into(dst, src, true)?;
    CudaEvent::record(src.device())
}

/// Waits for the work queued so far on `device`'s current stream (this stream only, unlike a
/// device-wide synchronize, so other streams' kernels go on). Nothing to wait for on the CPU.
pub fn wait_for_stream(device: Device) -> Result<()> {
    match CudaEvent::record(device)? {
        Some(event) => event.synchronize(),
        None => Ok(()),
    }
}

/// Waits for all queued work on `device` (a no-op on the CPU): for step timings, once a step.
pub fn synchronize_device(device: Device) {
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The staged path on CPU tensors: every bucket goes through the alternating host buffers
    /// and comes back with the reduction applied, whatever the bucket sizes.
    #[test]
    fn host_pool_reuses_a_buffer_given_back_for_the_same_size() {
        let mut pool = HostPool::default();
        let src = Tensor::arange(12, (Kind::Float, Device::Cpu)).view([3, 4]);
        let staged = pool.stage(&src).unwrap();
        assert_eq!(staged.size(), vec![3, 4]);
        assert!(staged.equal(&src));
        let other = pool.take(&[12], Kind::Float, Device::Cpu).unwrap();
        assert_eq!(pool.made(), 2, "the first is still in use");
        pool.give(staged);
        pool.give(other);
        let again = pool.take(&[2, 6], Kind::Float, Device::Cpu).unwrap();
        assert_eq!((again.size(), pool.made()), (vec![2, 6], 2), "a given-back buffer of the size, viewed in the shape");
        let bigger = pool.take(&[13], Kind::Float, Device::Cpu).unwrap();
        let half = pool.take(&[12], Kind::Half, Device::Cpu).unwrap();
        assert_eq!((bigger.numel(), half.kind(), pool.made()), (13, Kind::Half, 4), "another size or kind is made");
    }

    #[test]
    fn staged_buckets_come_back_reduced() {
        for kind in [Kind::Float, Kind::Half, Kind::BFloat16] {
            let mut buckets: Vec<Tensor> = [5i64, 1, 9, 3, 9].iter().map(|&n| Tensor::arange(n, (kind, Device::Cpu))).collect();
            let expected: Vec<Tensor> = buckets.iter().map(|t| t * 3.0 + 1.0).collect();
            let mut staging = Staging::new();
            let mut seen = Vec::new();
            staging
                .run(DataPath::Staged, &mut buckets, |b, host| {
                    seen.push((b, host.numel()));
                    // The reduction sees a copy, not the bucket itself.
                    let _ = host.f_mul_scalar_(3.0)?.f_add_scalar_(1.0)?;
                    Ok(())
                })
                .unwrap();
            assert_eq!(seen, vec![(0, 5), (1, 1), (2, 9), (3, 3), (4, 9)]);
            for (got, want) in buckets.iter().zip(&expected) {
                assert!(got.equal(want), "{kind:?}: {got:?} vs {want:?}");
            }
        }
    }

    #[test]
    fn host_and_direct_paths_reduce_in_place() {
        let mut buckets = vec![Tensor::from_slice(&[1.0f32, 2.0])];
        let address = raw::data_address(&buckets[0]);
        Staging::new()
            .run(DataPath::Host, &mut buckets, |_, t| {
                assert_eq!(raw::data_address(t), address);
                let _ = t.f_neg_()?;
                Ok(())
            })
            .unwrap();
        assert_eq!(Vec::<f32>::try_from(&buckets[0]).unwrap(), vec![-1.0, -2.0]);
    }
}
