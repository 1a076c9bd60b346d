//! What the training loop's side and the background thread share, and the controller and the
//! operations on that thread: the messages between the two threads, the queue of tensors this
//! rank has ready, the timeline's names of tensor ids and the counters of runs.jsonl.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tch::Tensor;

use crate::error::Error;
use crate::raw::CudaEvent;

/// Messages from the training loop to the background thread.
pub(super) enum ToBackground {
    /// `prescale`: multiply the tensor by this before it is cast down for the wire (a mean
    /// under compression, so that the 16-bit sum over many ranks cannot overflow).
    ///
    /// `ready`: on a GPU, an event recorded on the enqueuing thread's stream after the tensor's
    /// last write (Horovod's ready event): the background thread's stream is another one, so
    /// waiting on its own stream would not cover that work.
    Enqueue { id: usize, tensor: Tensor, prescale: Option<f64>, ready: Option<CudaEvent> },
    /// The timeline's row names of tensor ids (rank 0, with a timeline only).
    Names(Vec<(usize, Arc<str>)>),
    Shutdown,
}

/// Messages back: one more tensor done, or the thread's failure.
pub(super) enum FromBackground {
    Done,
    Failed(Error),
}

/// Counters reported in runs.jsonl.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(super) struct Counters {
    pub(super) cycles: u64,
    pub(super) negotiations: u64,
    pub(super) cache_hits: u64,
    pub(super) cache_evictions: u64,
    pub(super) fused_allreduces: u64,
    pub(super) tensors: u64,
}

impl Counters {
    pub(super) fn to_array(self) -> [u64; 6] {
        [self.cycles, self.negotiations, self.cache_hits, self.cache_evictions, self.fused_allreduces, self.tensors]
    }

    pub(super) fn from_array(a: [u64; 6]) -> Counters {
        Counters { cycles: a[0], negotiations: a[1], cache_hits: a[2], cache_evictions: a[3], fused_allreduces: a[4], tensors: a[5] }
    }
}

/// A tensor this rank has ready, waiting to be reduced.
pub(super) struct Ready {
    pub(super) id: usize,
    pub(super) tensor: Tensor,
    pub(super) prescale: Option<f64>,
    /// The enqueuing thread's event after the tensor's last write (GPU only).
    pub(super) ready: Option<CudaEvent>,
    pub(super) since: Instant,
    /// Sent to rank 0 in a negotiation (each request goes once, as Horovod's queue pops it).
    pub(super) reported: bool,
}

/// The timeline's row name of tensor `id` (a stand-in for a tensor never named).
pub(super) fn name_of(names: &HashMap<usize, Arc<str>>, id: usize) -> Arc<str> {
    names.get(&id).cloned().unwrap_or_else(|| Arc::from(format!("allreduce.noname.{id}")))
}
