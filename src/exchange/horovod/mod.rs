//! `horovod`: the way Horovod 0.28 exchanges gradients with its MPI operations, rebuilt on MPI
//! collectives as the baseline of the scaling reports (Horovod itself is not a dependency).
//!
//! The training loop enqueues tensors and waits for them; a background thread owns all of this
//! strategy's MPI traffic and runs Horovod's `RunLoopOnce` (horovod/common/operations.cc): it
//! sleeps out the rest of the cycle of `--cycle-time-ms` (HOROVOD_CYCLE_TIME, 1 ms), takes the
//! tensors enqueued meanwhile, and
//! 1. coordination, with the response cache on (HOROVOD_CACHE_CAPACITY, 1024 entries; 0 turns
//!    it off): one bitwise AND over the ranks of which cached tensors each has ready, with
//!    status bits (a rank has uncached or invalid tensors, shuts down, has nothing queued).
//!    When every ready tensor is cached everywhere, that AND is all the cycle's coordination;
//! 2. negotiation otherwise (and every cycle without the cache): every rank sends its new
//!    requests to rank 0, which answers with the tensors now ready everywhere (the cycle's
//!    common cache hits first), in one order for all; every rank puts the answer in its cache
//!    (least recently used eviction, cache.rs), so the caches stay equal;
//! 3. execution: the responses fused in that order up to `--fusion-threshold-mb`
//!    (negotiation.rs); a group of several tensors goes through the fusion buffer, a lone one
//!    is reduced where it lies; one blocking `MPI_Allreduce` per group, or on several nodes
//!    with `--hierarchical` a reduce within the node, an all-reduce among one rank per node and
//!    a broadcast within the node.
//!
//! A tensor enqueued after a cycle began waits for the next one: as with Horovod, a lone
//! all-reduce issued right after the previous one takes about a cycle (issue 32 measured the
//! real Horovod's 1 MiB all-reduce at 1.51 ms with a 1 ms cycle, 20.45 ms with 20 ms).
//! `--timeline FILE` (HOROVOD_TIMELINE) streams rank 0's view in Horovod's format (timeline.rs).

mod cache;
mod negotiation;
mod timeline;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use mpi::collective::SystemOperation;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use serde::Serialize;
use tch::{Kind, Tensor};

use crate::element::Dtype;
use crate::error::{Error, Result};
use crate::exchange::allreduce::SumOps;
use crate::exchange::buckets::{pack, unpack};
use crate::exchange::comm_thread::CommThread;
use crate::exchange::config::{Compression, ExchangeConfig, HorovodConfig};
use crate::exchange::staging::{wait_for_stream, Staging};
use crate::exchange::strategy::{allreduce_bus_factor, common_dtype, DataPath, Exchange, ExchangeReport, ReduceOp, Role};
use crate::plan::buckets::{Bucket, BucketPlan, Slot};
use crate::raw::{self, CudaEvent, SendComm};
use crate::topology::World;

use cache::{CacheState, Response, ResponseCache};
use negotiation::{fuse, fusion_threshold, MessageTable};
use timeline::Timeline;

/// The HOROVOD_* variables hpc-train reads (docs/strategies.md, "Horovod's variables", says what each does
/// and where it differs from Horovod). Others in the environment get one warning.
pub const VARIABLES: [&str; 8] = [
    "HOROVOD_CYCLE_TIME",
    "HOROVOD_FUSION_THRESHOLD",
    "HOROVOD_CACHE_CAPACITY",
    "HOROVOD_HIERARCHICAL_ALLREDUCE",
    "HOROVOD_TIMELINE",
    "HOROVOD_TIMELINE_MARK_CYCLES",
    "HOROVOD_STALL_CHECK_TIME_SECONDS",
    "HOROVOD_STALL_CHECK_DISABLE",
];

/// The HOROVOD_* names among `names` that hpc-train does not read, sorted.
pub fn unsupported_variables(names: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out: Vec<String> = names.into_iter().filter(|n| n.starts_with("HOROVOD_") && !VARIABLES.contains(&n.as_str())).collect();
    out.sort();
    out.dedup();
    out
}

/// Warns once per process about HOROVOD_* variables of the environment that hpc-train ignores.
fn warn_about_unsupported_variables() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let ignored = unsupported_variables(std::env::vars_os().filter_map(|(k, _)| k.into_string().ok()));
        if !ignored.is_empty() {
            log::warn!(
                "horovod: {} set but not read by hpc-train's Horovod-style strategy, which reads only {} (docs/strategies.md, Horovod's variables)",
                ignored.join(", "),
                VARIABLES.join(", ")
            );
        }
    });
}

/// Messages from the training loop to the background thread.
enum ToBackground {
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
enum FromBackground {
    Done,
    Failed(Error),
}

/// Counters reported in runs.jsonl.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct Counters {
    cycles: u64,
    negotiations: u64,
    cache_hits: u64,
    cache_evictions: u64,
    fused_allreduces: u64,
    tensors: u64,
}

impl Counters {
    fn to_array(self) -> [u64; 6] {
        [self.cycles, self.negotiations, self.cache_hits, self.cache_evictions, self.fused_allreduces, self.tensors]
    }

    fn from_array(a: [u64; 6]) -> Counters {
        Counters { cycles: a[0], negotiations: a[1], cache_hits: a[2], cache_evictions: a[3], fused_allreduces: a[4], tensors: a[5] }
    }
}

/// Tensor ids of overlap's buckets: bucket `key`'s tensors, above every plain tensor index.
fn keyed_id(key: usize, index: usize) -> usize {
    ((key + 1) << 32) + index
}

pub struct Horovod {
    to_bg: Sender<ToBackground>,
    from_bg: Receiver<FromBackground>,
    thread: Option<CommThread<(Counters, Option<String>)>>,
    /// Main-thread communicator for the end-of-run counters.
    control: SimpleCommunicator,
    rank: usize,
    size: usize,
    /// What runs (hierarchical only on several nodes, the threshold Horovod rounds).
    config: HorovodConfig,
    path: DataPath,
    counters: Counters,
    /// Rank 0: why the timeline is incomplete, if it is (known once the thread has ended).
    timeline_failure: Option<String>,
    /// Rank 0 with a timeline: the background thread wants the tensors' names.
    names_wanted: bool,
    /// The parameters' names (Exchange::name_tensors), and overlap's buckets as last named.
    param_names: Vec<String>,
    named_buckets: Vec<Vec<usize>>,
}

impl Horovod {
    pub fn new(world: &World, config: &ExchangeConfig) -> Result<Horovod> {
        let threading = mpi::environment::threading_support();
        if threading < mpi::Threading::Multiple {
            return Err(Error::usage(format!(
                "--strategy horovod runs its communication in a background thread while training makes its own \
                 MPI calls, which needs MPI_THREAD_MULTIPLE; this MPI library provides {threading:?}"
            )));
        }
        let mut hv = config.horovod.clone();
        if world.is_root() {
            warn_about_unsupported_variables();
        }
        if hv.hierarchical && world.nodes() == 1 {
            // Horovod: "Set flag for hierarchical allreduce. Ignore if Horovod is running on a
            // single node" (operations.cc): the node's reduce and broadcast would be the whole
            // all-reduce done twice.
            if world.is_root() {
                log::info!("horovod: hierarchical all-reduce asked for, but every rank is on one node: ignored, as Horovod ignores HOROVOD_HIERARCHICAL_ALLREDUCE on a single node");
            }
            hv.hierarchical = false;
        }
        // Every rank must run the same cycle: a variable exported to some ranks only would
        // leave their caches, bit vectors and collectives apart (and the job hanging).
        let settings = format!(
            "{:?} {} {} {:?} {} {} {} {} {:?}",
            hv.cycle_time, hv.fusion_threshold, hv.cache_capacity, hv.compression, hv.hierarchical, hv.timeline.is_some(), hv.timeline_mark_cycles, hv.stall_check, hv.stall_warning
        );
        let mine = crc32fast::hash(settings.as_bytes());
        let mut all = vec![0u32; world.size as usize];
        world.comm.all_gather_into(&mine, &mut all[..]);
        if all.iter().any(|&h| h != all[0]) {
            return Err(Error::usage(
                "the Horovod-style settings differ between ranks (a HOROVOD_* variable set for some ranks only?): export it to every rank, e.g. mpirun -x NAME",
            ));
        }
        let per_node = (0..world.nodes()).map(|node| world.node_of.iter().filter(|&&n| n == node).count()).collect::<Vec<_>>();
        let homogeneous = per_node.iter().all(|&c| c == per_node[0]);
        hv.fusion_threshold = fusion_threshold(hv.fusion_threshold, world.local_size as usize, homogeneous);
        // Rank 0 writes the timeline, as Horovod's coordinator does; every rank learns whether
        // it could open the file before any thread starts.
        let timeline = world.agree(match (&hv.timeline, world.is_root()) {
            (Some(path), true) => Timeline::create(path).map(Some),
            _ => Ok(None),
        })?;
        let names_wanted = timeline.is_some();
        let path = DataPath::choose(config.device, config.cuda_aware);
        // The background thread's communicators, made here (collectively) and moved there.
        let coord = SendComm::new(world.comm.duplicate(), threading)?;
        let data = SendComm::new(world.comm.duplicate(), threading)?;
        let local = SendComm::new(world.local.duplicate(), threading)?;
        let is_leader = world.local_rank == 0;
        let cross = world
            .comm
            .split_by_color_with_key(if is_leader { Color::with_value(0) } else { Color::undefined() }, world.rank)
            .map(|c| SendComm::new(c, threading))
            .transpose()?;
        let (to_bg, bg_rx) = channel();
        let (bg_tx, from_bg) = channel();
        let (rank, size) = (world.rank as usize, world.size as usize);
        let bg_config = hv.clone();
        let call = config.mpi_allreduce;
        // Built on the thread: MPI's user operations (SumOps) stay on the thread that uses them.
        let thread = CommThread::spawn("horovod-background", config.device, move || {
            let mut bg = Background {
                coord,
                data,
                local,
                cross,
                rank,
                size,
                cache: ResponseCache::new(bg_config.cache_capacity),
                config: bg_config,
                path,
                inbox: bg_rx,
                outbox: bg_tx.clone(),
                queue: Vec::new(),
                table: MessageTable::new(size),
                names: HashMap::new(),
                timeline,
                fusion: None,
                staging: Staging::new(),
                sums: SumOps::new(call),
                counters: Counters::default(),
                last_stall_check: Instant::now(),
                shutting_down: false,
            };
            let result = bg.run();
            if let Err(e) = &result {
                let _ = bg_tx.send(FromBackground::Failed(Error::exchange("horovod", e.to_string())));
            }
            let timeline_failure = bg.timeline.take().and_then(Timeline::close);
            result.map(|()| (bg.counters, timeline_failure))
        })?;
        Ok(Horovod {
            to_bg,
            from_bg,
            thread: Some(thread),
            control: world.comm.duplicate(),
            rank,
            size,
            config: hv,
            path,
            counters: Counters::default(),
            timeline_failure: None,
            names_wanted,
            param_names: Vec::new(),
            named_buckets: Vec::new(),
        })
    }

    /// Enqueues every tensor (tensor i as id `first_id + i`) and waits until the background
    /// thread has reduced them all.
    fn enqueue_and_wait(&mut self, first_id: usize, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        common_dtype(tensors)?;
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        if self.config.shuffle_enqueue {
            use rand::seq::SliceRandom;
            use rand::SeedableRng;
            order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(self.rank as u64 * 7919 + 1));
        }
        // Under compression a mean is taken before the cast down (see ToBackground::Enqueue).
        let prescale = (op == ReduceOp::Mean && self.size > 1 && self.config.compression != Compression::None).then(|| 1.0 / self.size as f64);
        for (k, &index) in order.iter().enumerate() {
            let id = first_id + index;
            if k + 1 == order.len() {
                if let Some((rank, delay)) = self.config.test_delay.take_if(|(r, _)| *r == self.rank) {
                    log::warn!("rank {rank}: holding tensor {id} back for {:.1} s (test hook)", delay.as_secs_f64());
                    std::thread::sleep(delay);
                }
            }
            self.to_bg
                .send(ToBackground::Enqueue { id, tensor: tensors[index].shallow_clone(), prescale, ready: CudaEvent::record(tensors[index].device())? })
                .map_err(|_| Error::exchange("horovod", "the background thread has stopped"))?;
            if self.config.shuffle_enqueue && k % 3 == 2 {
                std::thread::sleep(self.config.cycle_time / 2);
            }
        }
        let mut remaining = tensors.len();
        while remaining > 0 {
            match self.from_bg.recv() {
                Ok(FromBackground::Done) => {
                    remaining -= 1;
                    crate::watchdog::progress();
                }
                Ok(FromBackground::Failed(e)) => return Err(e),
                Err(_) => return Err(Error::exchange("horovod", "the background thread has stopped")),
            }
        }
        if op == ReduceOp::Mean && self.size > 1 && prescale.is_none() {
            for t in tensors.iter_mut() {
                let _ = t.f_div_scalar_(self.size as f64)?;
            }
        }
        Ok(())
    }

    /// Hands the background thread the timeline's names of tensor ids (rank 0, with a timeline).
    fn send_names(&self, names: Vec<(usize, Arc<str>)>) {
        if self.names_wanted && !names.is_empty() {
            let _ = self.to_bg.send(ToBackground::Names(names));
        }
    }

    /// Ends the background thread (all ranks together) and gathers the counters.
    fn shut_down(&mut self) -> Result<()> {
        let Some(thread) = self.thread.take() else { return Ok(()) };
        let _ = self.to_bg.send(ToBackground::Shutdown);
        let (counters, timeline_failure) = thread.join()?;
        let mine = counters.to_array();
        let mut totals = [0u64; 6];
        self.control.all_reduce_into(&mine[..], &mut totals[..], SystemOperation::max());
        self.counters = Counters::from_array(totals);
        self.timeline_failure = timeline_failure;
        Ok(())
    }
}

impl Drop for Horovod {
    fn drop(&mut self) {
        // On an error path the thread may still run: tell it to stop. It leaves its loop once
        // every rank's has been told (an error all ranks agreed on), or at once when other
        // ranks wait for tensors this one will never send (an error of this rank alone, which
        // is about to abort the job); dropping `thread` then joins it, so that MPI is never
        // finalized under it (see comm_thread).
        let _ = self.to_bg.send(ToBackground::Shutdown);
        self.thread.take();
    }
}

impl Exchange for Horovod {
    fn name(&self) -> &'static str {
        "horovod"
    }

    fn bus_factor(&self) -> f64 {
        allreduce_bus_factor(self.size)
    }

    fn role(&self) -> Role {
        Role::Worker { index: self.rank, count: self.size }
    }

    fn wire_dtype(&self) -> Option<Dtype> {
        self.config.compression.kind().and_then(Dtype::of_kind)
    }

    /// Enqueues every tensor (tensor i as id i) and waits until the background thread has
    /// reduced them all.
    fn all_reduce(&mut self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        self.enqueue_and_wait(0, tensors, op)
    }

    /// Overlap's buckets: bucket `key`'s tensors get ids of their own, the same every step, so
    /// that the response cache knows them after the first step.
    fn all_reduce_keyed(&mut self, key: usize, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        self.enqueue_and_wait(keyed_id(key, 0), tensors, op)
    }

    /// Timeline rows named as Horovod's PyTorch optimizer names its all-reduces.
    fn name_tensors(&mut self, names: &[String]) {
        self.param_names = names.to_vec();
        self.send_names(names.iter().enumerate().map(|(i, n)| (i, Arc::from(format!("allreduce.{n}")))).collect());
    }

    /// Overlap hands over each bucket as one flat tensor: its row is named after the bucket's
    /// parameters.
    fn describe_keys(&mut self, plan: &BucketPlan) {
        if !self.names_wanted {
            return;
        }
        let buckets: Vec<Vec<usize>> = plan.buckets.iter().map(|b| b.slots.iter().map(|s| s.tensor).collect()).collect();
        if buckets == self.named_buckets {
            return;
        }
        let name = |i: usize| self.param_names.get(i).cloned().unwrap_or_else(|| format!("tensor{i}"));
        let names = buckets
            .iter()
            .enumerate()
            .map(|(key, tensors)| {
                let label = match tensors.as_slice() {
                    [one] => format!("allreduce.{}", name(*one)),
                    [first, .., last] => format!("allreduce.bucket{key} ({} tensors: {} .. {})", tensors.len(), name(*first), name(*last)),
                    [] => format!("allreduce.bucket{key}"),
                };
                (keyed_id(key, 0), Arc::from(label))
            })
            .collect();
        self.send_names(names);
        self.named_buckets = buckets;
    }

    fn finish(&mut self, _params: &mut [Tensor]) -> Result<()> {
        self.shut_down()
    }

    fn output_failure(&self) -> Option<String> {
        self.timeline_failure.clone()
    }

    fn report(&self) -> ExchangeReport {
        let mut extra = serde_json::Map::new();
        let c = self.counters;
        extra.insert("horovod_cycles".into(), c.cycles.into());
        extra.insert("horovod_negotiations".into(), c.negotiations.into());
        extra.insert("horovod_cache_hits".into(), c.cache_hits.into());
        extra.insert("horovod_cache_evictions".into(), c.cache_evictions.into());
        extra.insert("horovod_cache_capacity".into(), self.config.cache_capacity.into());
        extra.insert("horovod_tensors".into(), c.tensors.into());
        // Tensors reduced straight from the response cache, without negotiation through rank 0.
        let share = if c.tensors > 0 { c.cache_hits as f64 / c.tensors as f64 } else { 0.0 };
        extra.insert("horovod_cache_hit_share".into(), share.into());
        extra.insert("horovod_fused_allreduces".into(), c.fused_allreduces.into());
        extra.insert("fusion_threshold_mb".into(), (self.config.fusion_threshold as f64 / (1 << 20) as f64).into());
        extra.insert("cycle_time_ms".into(), (self.config.cycle_time.as_secs_f64() * 1e3).into());
        extra.insert("compression".into(), serde_json::to_value(self.config.compression).unwrap());
        extra.insert("hierarchical".into(), self.config.hierarchical.into());
        ExchangeReport { data_path: Some(self.path), extra }
    }
}

/// A tensor this rank has ready, waiting to be reduced.
struct Ready {
    id: usize,
    tensor: Tensor,
    prescale: Option<f64>,
    /// The enqueuing thread's event after the tensor's last write (GPU only).
    ready: Option<CudaEvent>,
    since: Instant,
    /// Sent to rank 0 in a negotiation (each request goes once, as Horovod's queue pops it).
    reported: bool,
}

/// Status bits of a cycle, each set by a rank where it holds for that rank: the AND over the
/// ranks says whether it holds for all.
const SHUTTING_DOWN: u64 = 1;
const IDLE: u64 = 1 << 1;
const ALL_CACHED: u64 = 1 << 2;
const NONE_INVALID: u64 = 1 << 3;

/// The background thread's state.
struct Background {
    coord: SendComm,
    data: SendComm,
    local: SendComm,
    cross: Option<SendComm>,
    rank: usize,
    size: usize,
    config: HorovodConfig,
    path: DataPath,
    inbox: Receiver<ToBackground>,
    outbox: Sender<FromBackground>,
    queue: Vec<Ready>,
    /// The response cache, the same on every rank.
    cache: ResponseCache,
    /// Rank 0's table of tensors reported by some ranks and not yet all.
    table: MessageTable,
    /// Timeline rows of tensor ids (rank 0, with a timeline).
    names: HashMap<usize, Arc<str>>,
    timeline: Option<Timeline>,
    fusion: Option<Tensor>,
    staging: Staging,
    sums: SumOps,
    counters: Counters,
    last_stall_check: Instant,
    shutting_down: bool,
}

impl Background {
    fn run(&mut self) -> Result<()> {
        let mut cycle_start = Instant::now();
        loop {
            // Horovod's RunLoopOnce: sleep out the rest of the cycle, then one cycle. What the
            // training loop enqueues meanwhile waits for it.
            let wake = cycle_start + self.config.cycle_time;
            let now = Instant::now();
            if wake > now {
                std::thread::sleep(wake - now);
            }
            cycle_start = Instant::now();
            if self.config.timeline_mark_cycles {
                if let Some(timeline) = &mut self.timeline {
                    timeline.mark_cycle_start();
                }
            }
            self.take_enqueued();
            self.counters.cycles += 1;
            let (responses, agreed) = self.compute_responses()?;
            if agreed & (SHUTTING_DOWN | IDLE) == SHUTTING_DOWN | IDLE {
                // Every rank is shutting down with nothing queued: all leave together.
                return Ok(());
            }
            if self.shutting_down && self.queue.is_empty() && agreed & IDLE == 0 {
                // Another rank waits for tensors this one will never enqueue: this rank stopped
                // on an error of its own and is about to abort the job.
                return Err(Error::exchange("horovod", "this rank stopped while other ranks wait for its tensors"));
            }
            if !responses.is_empty() {
                self.execute(&responses)?;
            }
        }
    }

    /// Takes what the training loop enqueued since the last cycle (Horovod's tensor queue).
    fn take_enqueued(&mut self) {
        loop {
            match self.inbox.try_recv() {
                Ok(ToBackground::Enqueue { id, tensor, prescale, ready }) => {
                    self.queue.push(Ready { id, tensor, prescale, ready, since: Instant::now(), reported: false })
                }
                Ok(ToBackground::Names(names)) => {
                    for (id, name) in names {
                        // A row under way under the old name (or the stand-in for none) goes on
                        // under the new one.
                        let old = self.name_of(id);
                        self.names.insert(id, name.clone());
                        if let Some(timeline) = self.timeline.as_mut() {
                            timeline.rename(&old, &name);
                        }
                    }
                }
                Ok(ToBackground::Shutdown) => self.shutting_down = true,
                Err(TryRecvError::Disconnected) => {
                    self.shutting_down = true;
                    break;
                }
                Err(TryRecvError::Empty) => break,
            }
        }
    }

    fn name_of(&self, id: usize) -> Arc<str> {
        self.names.get(&id).cloned().unwrap_or_else(|| Arc::from(format!("allreduce.noname.{id}")))
    }

    /// Horovod's `Controller::ComputeResponseList`: which tensors to reduce this cycle, in one
    /// order on every rank, and the status bits agreed over the ranks.
    fn compute_responses(&mut self) -> Result<(Vec<Response>, u64)> {
        let caching = self.cache.capacity() > 0;
        // A cached tensor held back past the stall warning is renegotiated (Horovod's
        // InvalidateStalledCachedTensors), so that rank 0 can say which ranks hold it back.
        let stall_check = self.config.stall_check && self.last_stall_check.elapsed() >= self.config.stall_warning;
        let mut hits = BTreeSet::new();
        let mut invalid = BTreeSet::new();
        let mut uncached = false;
        if caching {
            for r in &self.queue {
                match self.cache.cached(r.id, r.tensor.numel()) {
                    CacheState::Hit(bit) if stall_check && r.since.elapsed() >= self.config.stall_warning => {
                        invalid.insert(bit);
                        uncached = true;
                    }
                    CacheState::Hit(bit) => {
                        hits.insert(bit);
                    }
                    CacheState::Invalid(bit) => {
                        invalid.insert(bit);
                        uncached = true;
                    }
                    CacheState::Miss => uncached = true,
                }
            }
        }
        let mut status = 0;
        if self.shutting_down {
            status |= SHUTTING_DOWN;
        }
        if self.queue.is_empty() {
            status |= IDLE;
        }
        if !uncached {
            status |= ALL_CACHED;
        }
        if invalid.is_empty() {
            status |= NONE_INVALID;
        }

        // 1. Coordination through the cache: one AND of status and hit bits.
        let mut agreed = status;
        let mut common: Vec<usize> = Vec::new();
        if caching {
            let (flags, found) = self.coordinate_cache(status, &hits, &invalid)?;
            agreed = flags;
            common = found;
        }

        // 2. Negotiation through rank 0, unless every ready tensor is cached everywhere.
        let responses: Vec<Response>;
        if caching && agreed & ALL_CACHED != 0 {
            // Every rank takes the hits in bit order, each becoming the most recently used.
            responses = common.iter().map(|&bit| self.cache.get(bit)).collect();
        } else {
            self.counters.negotiations += 1;
            let hit_responses: Vec<Response> = common.iter().map(|&bit| self.cache.peek(bit)).collect();
            let mut requests: Vec<u64> = Vec::new();
            for r in self.queue.iter_mut().filter(|r| !r.reported) {
                if !matches!(self.cache.cached(r.id, r.tensor.numel()), CacheState::Hit(_)) {
                    r.reported = true;
                    requests.extend([r.id as u64, r.tensor.numel() as u64]);
                }
            }
            let (flags, list) = self.negotiate(status, &requests, &hit_responses)?;
            if !caching {
                agreed = flags;
            }
            responses = list;
            // Every rank caches the same responses in the same order: the caches stay equal.
            for &response in &responses {
                if self.cache.put(response).is_some() && self.cache.evictions() == 1 && self.rank == 0 {
                    // Horovod's warning, once.
                    log::warn!(
                        "horovod: a response was evicted from the cache of {} entries, which may reduce performance: raise HOROVOD_CACHE_CAPACITY (or --cache-capacity), or set it to 0",
                        self.cache.capacity()
                    );
                }
            }
            self.counters.cache_evictions = self.cache.evictions();
        }
        self.cache.compact();
        if stall_check {
            self.last_stall_check = Instant::now();
        }
        self.counters.cache_hits += common.len() as u64;
        Ok((responses, agreed))
    }

    /// One AND over the ranks of the status word and the cache's hit bits (with a timeline, a
    /// second section tells rank 0 which tensors any rank has ready, for NEGOTIATE_ALLREDUCE);
    /// then, if any rank has invalid entries, one OR of them, and every rank erases them.
    /// Returns the agreed status and the bits every rank has ready.
    fn coordinate_cache(&mut self, status: u64, hits: &BTreeSet<usize>, invalid: &BTreeSet<usize>) -> Result<(u64, Vec<usize>)> {
        let words = self.cache.bits().div_ceil(64);
        let with_timeline = self.config.timeline.is_some();
        let mut vector = vec![0u64; 1 + words * if with_timeline { 2 } else { 1 }];
        vector[0] = status;
        if with_timeline {
            vector[1 + words..].fill(!0);
        }
        for &bit in hits {
            vector[1 + bit / 64] |= 1 << (bit % 64);
            if with_timeline {
                vector[1 + words + bit / 64] ^= 1 << (bit % 64);
            }
        }
        let mut and = vec![0u64; vector.len()];
        self.coord.comm().all_reduce_into(&vector[..], &mut and[..], SystemOperation::bitwise_and());
        let agreed = and[0];
        let bits_of = |section: &[u64], set: bool| -> Vec<usize> {
            (0..words * 64).filter(|&b| (section[b / 64] >> (b % 64) & 1 == 1) == set).collect()
        };
        let mut erased = BTreeSet::new();
        if agreed & NONE_INVALID == 0 {
            let mut mine = vec![0u64; words];
            for &bit in invalid {
                mine[bit / 64] |= 1 << (bit % 64);
            }
            let mut any = vec![0u64; words];
            self.coord.comm().all_reduce_into(&mine[..], &mut any[..], SystemOperation::bitwise_or());
            erased = bits_of(&any, true).into_iter().filter(|&b| b < self.cache.bits()).collect();
        }
        let common: Vec<usize> = bits_of(&and[1..1 + words], true).into_iter().filter(|b| *b < self.cache.bits() && !erased.contains(b)).collect();
        if with_timeline && self.timeline.is_some() {
            // Some rank has it ready: negotiation has begun; every rank has: it has ended.
            let started: Vec<Arc<str>> = bits_of(&and[1 + words..], false)
                .into_iter()
                .filter(|b| *b < self.cache.bits() && !erased.contains(b))
                .map(|b| self.name_of(self.cache.peek(b).id))
                .collect();
            let ended: Vec<Arc<str>> = common.iter().map(|&b| self.name_of(self.cache.peek(b).id)).collect();
            if let Some(timeline) = self.timeline.as_mut() {
                started.iter().for_each(|n| timeline.negotiate_start(n));
                ended.iter().for_each(|n| timeline.negotiate_end(n));
            }
        }
        for &bit in &erased {
            self.cache.erase(bit);
        }
        Ok((agreed, common))
    }

    /// Rank 0 gathers every rank's status and new requests, and answers every rank with the
    /// agreed status and the responses: `hits` (the cycle's common cache hits) first, then the
    /// tensors every rank has now reported, in the order they became ready.
    fn negotiate(&mut self, status: u64, requests: &[u64], hits: &[Response]) -> Result<(u64, Vec<Response>)> {
        let comm = self.coord.comm();
        let root = comm.process_at_rank(0);
        let mut message = Vec::with_capacity(requests.len() + 1);
        message.push(status);
        message.extend_from_slice(requests);
        let count = message.len() as i32;
        let mut answer: Vec<u64>;
        if self.rank == 0 {
            let mut counts = vec![0i32; self.size];
            root.gather_into_root(&count, &mut counts[..]);
            let displs: Vec<i32> = counts.iter().scan(0, |acc, &c| { let d = *acc; *acc += c; Some(d) }).collect();
            let mut all = vec![0u64; counts.iter().sum::<i32>() as usize];
            {
                let mut partition = mpi::datatype::PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
                root.gather_varcount_into_root(&message[..], &mut partition);
            }
            let mut agreed = !0u64;
            let mut ready: Vec<Response> = Vec::new();
            let now = Instant::now();
            for (r, (&c, &d)) in counts.iter().zip(&displs).enumerate() {
                let part = &all[d as usize..(d + c) as usize];
                agreed &= part[0];
                for pair in part[1..].chunks_exact(2) {
                    let (id, len) = (pair[0] as usize, pair[1] as usize);
                    let reported = self.table.report(r, id, len, now).map_err(|e| Error::exchange("horovod", e))?;
                    let name = self.timeline.as_ref().map(|_| self.name_of(id));
                    if let (Some(timeline), Some(name)) = (self.timeline.as_mut(), name) {
                        if reported.first {
                            timeline.negotiate_start(&name);
                        }
                        timeline.negotiate_rank_ready(&name, r);
                        if reported.complete {
                            timeline.negotiate_end(&name);
                        }
                    }
                    if reported.complete {
                        ready.push(Response { id, len });
                    }
                }
            }
            answer = vec![agreed];
            answer.extend(hits.iter().chain(&ready).flat_map(|r| [r.id as u64, r.len as u64]));
            let mut n = answer.len() as u64;
            root.broadcast_into(&mut n);
            root.broadcast_into(&mut answer[..]);
            self.report_stalls();
        } else {
            root.gather_into(&count);
            root.gather_varcount_into(&message[..]);
            let mut n = 0u64;
            root.broadcast_into(&mut n);
            answer = vec![0u64; n as usize];
            root.broadcast_into(&mut answer[..]);
        }
        let responses = answer[1..].chunks_exact(2).map(|p| Response { id: p[0] as usize, len: p[1] as usize }).collect();
        Ok((answer[0], responses))
    }

    /// Rank 0: tensors some ranks have reported and others not, for longer than the warning
    /// (Horovod's stall inspector), at most once per warning period.
    fn report_stalls(&mut self) {
        if !self.config.stall_check {
            return;
        }
        let stalled = self.table.stalled(Instant::now(), self.config.stall_warning);
        if stalled.is_empty() || self.last_stall_check.elapsed() < self.config.stall_warning {
            return;
        }
        let listed: Vec<String> = stalled
            .iter()
            .map(|(id, missing, waited)| format!("{} (waiting {:.0} s) missing on ranks {missing:?}", self.name_of(*id), waited.as_secs_f64()))
            .collect();
        log::warn!(
            "horovod: stall: {} tensor(s) enqueued on some ranks but not all for over {:.0} s: {}",
            listed.len(),
            self.config.stall_warning.as_secs_f64(),
            listed.join("; ")
        );
        self.last_stall_check = Instant::now();
    }

    /// Reduces the tensors of `responses`, fused in that order, then tells the training loop.
    fn execute(&mut self, responses: &[Response]) -> Result<()> {
        // This rank's tensors, in the agreed order.
        let mut items: Vec<Ready> = Vec::with_capacity(responses.len());
        for response in responses {
            let at = self.queue.iter().position(|r| r.id == response.id).ok_or_else(|| {
                Error::exchange("horovod", format!("tensor {} was agreed but is not queued on rank {}", response.id, self.rank))
            })?;
            items.push(self.queue.swap_remove(at));
        }
        // Fuse consecutive tensors up to the threshold (dtype is one per exchange).
        let kind = items[0].tensor.kind();
        let wire_kind = self.config.compression.kind().unwrap_or(kind);
        let elem = wire_kind.elt_size_in_bytes();
        let bytes: Vec<usize> = items.iter().map(|r| r.tensor.numel() * elem).collect();
        let mut items: VecDeque<Ready> = items.into();
        for group in fuse(&bytes, self.config.fusion_threshold) {
            let group: Vec<Ready> = items.drain(..group.len()).collect();
            self.execute_group(group, wire_kind)?;
        }
        Ok(())
    }

    /// Horovod's `PerformOperation` and `MPIAllreduce::Execute` for one fused group.
    fn execute_group(&mut self, group: Vec<Ready>, wire_kind: Kind) -> Result<()> {
        let elem = wire_kind.elt_size_in_bytes();
        let names: Vec<Arc<str>> = match self.timeline {
            Some(_) => group.iter().map(|r| self.name_of(r.id)).collect(),
            None => Vec::new(),
        };
        let len: usize = group.iter().map(|r| r.tensor.numel()).sum();
        let device = group[0].tensor.device();
        self.each(&names, |t, n| t.start(n, "ALLREDUCE"));
        if device.is_cuda() {
            // The kernels that wrote the gradients, on the enqueuing thread's stream, must be
            // done before MPI or a copy reads them.
            self.each(&names, |t, n| t.activity_start(n, "WAIT_FOR_DATA"));
            for r in &group {
                if let Some(event) = &r.ready {
                    event.synchronize()?;
                }
            }
            self.each(&names, |t, n| t.activity_end(n));
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
                    let capacity = len.max(self.config.fusion_threshold / elem).max(1);
                    self.fusion = Some(Tensor::f_zeros([capacity as i64], (wire_kind, device))?);
                }
                let mut buffer = self.fusion.as_ref().expect("made above").f_narrow(0, 0, len as i64)?;
                // Tensors in and out of the fusion buffer: a memory copy for host tensors,
                // libtorch's copy (which also casts, when compressing) otherwise.
                self.each(&names, |t, n| t.activity_start(n, "MEMCPY_IN_FUSION_BUFFER"));
                pack(&bucket, &tensors, &mut buffer);
                self.each(&names, |t, n| t.activity_end(n));
                buffer
            }
        };

        self.all_reduce_buffer(&mut buffer, &names)?;
        self.counters.fused_allreduces += 1;

        if fused {
            self.each(&names, |t, n| t.activity_start(n, "MEMCPY_OUT_FUSION_BUFFER"));
            let mut tensors = tensors;
            unpack(&bucket, &buffer, &mut tensors);
        }
        // The training loop may read the tensors once told they are done.
        wait_for_stream(device)?;
        let dtype = horovod_dtype_name(group[0].tensor.kind());
        for (r, name) in group.iter().zip(names.iter().map(Some).chain(std::iter::repeat(None))) {
            if let (Some(timeline), Some(name)) = (self.timeline.as_mut(), name) {
                timeline.end(name, dtype, &r.tensor.size());
            }
            self.counters.tensors += 1;
            let _ = self.outbox.send(FromBackground::Done);
        }
        Ok(())
    }

    /// Runs `f` on the timeline for every tensor named (rank 0 with a timeline; else nothing).
    fn each(&mut self, names: &[Arc<str>], f: impl Fn(&mut Timeline, &Arc<str>)) {
        if let Some(timeline) = self.timeline.as_mut() {
            names.iter().for_each(|n| f(timeline, n));
        }
    }

    /// Sums one fusion buffer over all ranks: flat, or node-reduce + cross all-reduce + node
    /// broadcast.
    fn all_reduce_buffer(&mut self, buffer: &mut Tensor, names: &[Arc<str>]) -> Result<()> {
        let mut one = [buffer.shallow_clone()];
        let (data, local, cross, sums, hierarchical) = (&self.data, &self.local, &self.cross, &self.sums, self.config.hierarchical);
        let timeline = &mut self.timeline;
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

/// Resolves a flag against Horovod's environment variable, the flag winning.
pub fn env_or<T>(flag: Option<T>, var: &str, parse: impl Fn(&str) -> Option<T>, default: T) -> Result<T> {
    if let Some(v) = flag {
        return Ok(v);
    }
    match std::env::var(var) {
        Ok(s) if !s.trim().is_empty() => parse(s.trim()).ok_or_else(|| Error::usage(format!("{var}={s:?} is not a valid value"))),
        _ => Ok(default),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_horovod_variables() {
        std::env::set_var("HPC_TRAIN_TEST_HOROVOD_X", "64");
        let parse = |s: &str| s.parse::<u64>().ok();
        assert_eq!(env_or(Some(5), "HPC_TRAIN_TEST_HOROVOD_X", parse, 1).unwrap(), 5);
        assert_eq!(env_or(None, "HPC_TRAIN_TEST_HOROVOD_X", parse, 1).unwrap(), 64);
        assert_eq!(env_or(None, "HPC_TRAIN_TEST_HOROVOD_UNSET", parse, 1).unwrap(), 1);
        std::env::set_var("HPC_TRAIN_TEST_HOROVOD_Y", "lots");
        assert!(env_or(None, "HPC_TRAIN_TEST_HOROVOD_Y", parse, 1).is_err());
    }

    #[test]
    fn only_unread_horovod_variables_are_named() {
        let env = ["PATH", "HOROVOD_CYCLE_TIME", "HOROVOD_AUTOTUNE", "HOROVOD_CACHE_CAPACITY", "HOROVOD_GLOO_IFACE", "HOROVOD_AUTOTUNE", "HOROVOD"];
        assert_eq!(unsupported_variables(env.iter().map(|s| s.to_string())), vec!["HOROVOD_AUTOTUNE", "HOROVOD_GLOO_IFACE"]);
        assert!(unsupported_variables(VARIABLES.iter().map(|s| s.to_string())).is_empty());
    }

    #[test]
    fn keyed_ids_sit_above_every_tensor_index() {
        assert_eq!(keyed_id(0, 0), 1 << 32);
        assert!(keyed_id(3, 0) > keyed_id(2, u32::MAX as usize));
    }
}
