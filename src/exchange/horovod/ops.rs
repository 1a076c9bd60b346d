//! The operations, as Horovod keeps them apart from its controller (horovod/common/ops/): the
//! code that moves the gradients' bytes once the controller has agreed on them. Tensors are
//! fused in the agreed order up to the threshold, a group of several through the fusion buffer
//! and a lone one where it lies, and each group is reduced by one MPI_Allreduce, or on several
//! nodes with `--hierarchical` by a reduce within the node, an all-reduce among one rank per
//! node and a broadcast within the node.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::Sender;
use std::sync::Arc;

use mpi::traits::*;
use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::exchange::allreduce::SumOps;
use crate::exchange::buckets::{pack, unpack};
use crate::exchange::config::{Compression, HorovodConfig, MpiAllreduceCall};
use crate::exchange::horovod::cache::Response;
use crate::exchange::horovod::negotiation::fuse;
use crate::exchange::horovod::queue::{name_of, Counters, FromBackground, Ready};
use crate::exchange::horovod::timeline::Timeline;
use crate::exchange::staging::{wait_for_stream, Staging};
use crate::exchange::strategy::{common_dtype, DataPath};
use crate::plan::buckets::{Bucket, Slot};
use crate::raw::{self, SendComm};

/// The operations' state, on the background thread.
pub(super) struct Ops {
    data: SendComm,
    local: SendComm,
    cross: Option<SendComm>,
    rank: usize,
    path: DataPath,
    compression: Compression,
    fusion_threshold: usize,
    hierarchical: bool,
    fusion: Option<Tensor>,
    staging: Staging,
    sums: SumOps,
}

impl Ops {
    /// Made on the background thread: MPI's user operations (SumOps) stay on the thread that
    /// uses them.
    pub(super) fn new(data: SendComm, local: SendComm, cross: Option<SendComm>, rank: usize, path: DataPath, config: &HorovodConfig, call: MpiAllreduceCall) -> Ops {
        Ops {
            data,
            local,
            cross,
            rank,
            path,
            compression: config.compression,
            fusion_threshold: config.fusion_threshold,
            hierarchical: config.hierarchical,
            fusion: None,
            staging: Staging::new(),
            sums: SumOps::new(call),
        }
    }

    /// Reduces the tensors of `responses`, fused in that order, then tells the training loop.
    pub(super) fn execute(&mut self, queue: &mut Vec<Ready>, responses: &[Response], timeline: &mut Option<Timeline>, row_names: &HashMap<usize, Arc<str>>, counters: &mut Counters, outbox: &Sender<FromBackground>) -> Result<()> {
        // This rank's tensors, in the agreed order.
        let mut items: Vec<Ready> = Vec::with_capacity(responses.len());
        for response in responses {
            let at = queue.iter().position(|r| r.id == response.id).ok_or_else(|| {
                Error::exchange("horovod", format!("tensor {} was agreed but is not queued on rank {}", response.id, self.rank))
            })?;
            items.push(queue.swap_remove(at));
        }
        // Fuse consecutive tensors up to the threshold (dtype is one per exchange).
        let kind = items[0].tensor.kind();
        let wire_kind = self.compression.kind().unwrap_or(kind);
        let elem = wire_kind.elt_size_in_bytes();
        let bytes: Vec<usize> = items.iter().map(|r| r.tensor.numel() * elem).collect();
        let mut items: VecDeque<Ready> = items.into();
        for group in fuse(&bytes, self.fusion_threshold) {
            let group: Vec<Ready> = items.drain(..group.len()).collect();
            self.execute_group(group, wire_kind, timeline, row_names, counters, outbox)?;
        }
        Ok(())
    }

    /// Horovod's `PerformOperation` and `MPIAllreduce::Execute` for one fused group.
    fn execute_group(&mut self, group: Vec<Ready>, wire_kind: Kind, timeline: &mut Option<Timeline>, row_names: &HashMap<usize, Arc<str>>, counters: &mut Counters, outbox: &Sender<FromBackground>) -> Result<()> {
        let elem = wire_kind.elt_size_in_bytes();
        let names: Vec<Arc<str>> = match timeline {
            Some(_) => group.iter().map(|r| name_of(row_names, r.id)).collect(),
            None => Vec::new(),
        };
        let len: usize = group.iter().map(|r| r.tensor.numel()).sum();
        let device = group[0].tensor.device();
        each(timeline, &names, |t, n| t.start(n, "ALLREDUCE"));
        if device.is_cuda() {
            // The kernels that wrote the gradients, on the enqueuing thread's stream, must be
            // done before MPI or a copy reads them.
            each(timeline, &names, |t, n| t.activity_start(n, "WAIT_FOR_DATA"));
            for r in &group {
                if let Some(event) = &r.ready {
                    event.synchronize()?;
                }
            }
            each(timeline, &names, |t, n| t.activity_end(n));
        }
        let tensors: Vec<Tensor> = group.iter().map(|r| r.tensor.shallow_clone()).collect();
        for (r, t) in group.iter().zip(&tensors) {
            if let Some(factor) = r.prescale {
                let _ = t.shallow_clone().f_mul_scalar_(factor)?;
            }
        }
        // One tensor is reduced where it lies, as Horovod's MPIAllreduce::Execute does for a
        // single entry; several go through the fusion buffer.
        let alone = in_place(&group, wire_kind);
        let fused = alone.is_none();
        let bucket = Bucket {
            slots: group
                .iter()
                .scan(0, |at, r| {
                    let slot = Slot { tensor: 0, offset: *at, len: r.tensor.numel() };
                    *at += slot.len;
                    Some(slot)
                })
                .enumerate()
                .map(|(i, s)| Slot { tensor: i, ..s })
                .collect(),
            len,
        };
        let mut buffer = match alone {
            Some(view) => view,
            None => {
                let fusion_fits = self.fusion.as_ref().is_some_and(|f| f.numel() >= len && f.kind() == wire_kind && f.device() == device);
                if !fusion_fits {
                    let capacity = len.max(self.fusion_threshold / elem).max(1);
                    self.fusion = Some(Tensor::f_zeros([capacity as i64], (wire_kind, device))?);
                }
                let mut buffer = self.fusion.as_ref().expect("made above").f_narrow(0, 0, len as i64)?;
                // Tensors in and out of the fusion buffer: a memory copy for host tensors,
                // libtorch's copy (which also casts, when compressing) otherwise.
                each(timeline, &names, |t, n| t.activity_start(n, "MEMCPY_IN_FUSION_BUFFER"));
                pack(&bucket, &tensors, &mut buffer);
                each(timeline, &names, |t, n| t.activity_end(n));
                buffer
            }
        };

        self.all_reduce_buffer(&mut buffer, &names, timeline)?;
        counters.fused_allreduces += 1;

        if fused {
            each(timeline, &names, |t, n| t.activity_start(n, "MEMCPY_OUT_FUSION_BUFFER"));
            let mut tensors = tensors;
            unpack(&bucket, &buffer, &mut tensors);
        }
        // The training loop may read the tensors once told they are done.
        wait_for_stream(device)?;
        let dtype = horovod_dtype_name(group[0].tensor.kind());
        for (r, name) in group.iter().zip(names.iter().map(Some).chain(std::iter::repeat(None))) {
            if let (Some(timeline), Some(name)) = (timeline.as_mut(), name) {
                timeline.end(name, dtype, &r.tensor.size());
            }
            counters.tensors += 1;
            let _ = outbox.send(FromBackground::Done);
        }
        Ok(())
    }

    /// Sums one fusion buffer over all ranks: flat, or node-reduce + cross all-reduce + node
    /// broadcast.
    fn all_reduce_buffer(&mut self, buffer: &mut Tensor, names: &[Arc<str>], timeline: &mut Option<Timeline>) -> Result<()> {
        let mut one = [buffer.shallow_clone()];
        let (data, local, cross, sums, hierarchical) = (&self.data, &self.local, &self.cross, &self.sums, self.hierarchical);
                let mut activity = |name: Option<&str>| {
            if let Some(t) = timeline.as_mut() {
                for n in names {
                    match name {
                        Some(a) => t.activity_start(n, a),
                        None => t.activity_end(n),
                    }
                }
            }
        };
        let path = self.path.for_mpi_reduction(common_dtype(&one)?);
        self.staging.run(path, &mut one, |_, b| {
            if !hierarchical {
                activity(Some("MPI_ALLREDUCE"));
                let result = sums.all_reduce_sum(data.comm(), b);
                activity(None);
                return result;
            }
            // Reduce within the node to its first rank, all-reduce among the nodes' first
            // ranks, broadcast within the node.
            let local = local.comm();
            activity(Some("MPI_REDUCE"));
            sums.reduce_sum_to_root(local, b, 0)?;
            if let Some(cross) = cross {
                activity(Some("MPI_ALLREDUCE"));
                sums.all_reduce_sum(cross.comm(), b)?;
            }
            activity(Some("MPI_BCAST"));
            let dtype = common_dtype(std::slice::from_ref(b))?;
            crate::with_element!(dtype, E => {
                // SAFETY: `b` is this thread's fusion buffer (or its staging copy), which nothing
                // else touches; on the device the path is direct only with a CUDA-aware MPI, and
                // the staging run waited for the stream.
                let mut view = unsafe { raw::mpi_buffer_mut::<E>(b)? };
                local.process_at_rank(0).broadcast_into(&mut view);
            });
            activity(None);
            Ok(())
        })
    }
}

/// Runs `f` on the timeline for every tensor named (rank 0 with a timeline; else nothing).
fn each(timeline: &mut Option<Timeline>, names: &[Arc<str>], f: impl Fn(&mut Timeline, &Arc<str>)) {
    if let Some(timeline) = timeline.as_mut() {
        names.iter().for_each(|n| f(timeline, n));
    }
}

/// Horovod's names of the element types, for the timeline's end events.
fn horovod_dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "HOROVOD_FLOAT32",
        Kind::Half => "HOROVOD_FLOAT16",
        Kind::BFloat16 => "HOROVOD_BFLOAT16",
        Kind::Double => "HOROVOD_FLOAT64",
        _ => "HOROVOD_OTHER",
    }
}

/// A flat view of a group's one tensor when it can be reduced where it lies: alone, already of
/// the wire's kind (no compression cast), dense in memory. None: it goes through the fusion buffer.
fn in_place(group: &[Ready], wire_kind: Kind) -> Option<Tensor> {
    match group {
        [r] if r.tensor.kind() == wire_kind => raw::flat_dense_view(&r.tensor).ok(),
        _ => None,
    }
}
