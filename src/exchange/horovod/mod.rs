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
//!
//! As Horovod keeps its controller (controller.cc) apart from its operations (ops/), the
//! cycle's decision, steps 1 and 2, is controller.rs's, and the bytes of step 3 move in ops.rs;
//! this file is the training loop's side and the background thread's loop (operations.cc's
//! RunLoopOnce), queue.rs what they all share.

mod cache;
mod controller;
mod negotiation;
mod ops;
mod queue;
mod timeline;

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use mpi::collective::SystemOperation;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use tch::Tensor;

use crate::element::Dtype;
use crate::error::{Error, Result};
use crate::exchange::comm_thread::CommThread;
use crate::exchange::config::{Compression, ExchangeConfig, HorovodConfig};
use crate::exchange::strategy::{allreduce_bus_factor, common_dtype, Checkpointed, DataPath, Described, ExchangeReport, Reduce, ReduceOp, Role, Training};
use crate::plan::buckets::BucketPlan;
use crate::raw::{CudaEvent, SendComm};
use crate::topology::World;

use controller::{Controller, IDLE, SHUTTING_DOWN};
use negotiation::fusion_threshold;
use ops::Ops;
use queue::{name_of, Counters, FromBackground, Ready, ToBackground};
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
    /// The parameters' names (Training::name_tensors), and overlap's buckets as last named.
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
                controller: Controller::new(coord, rank, size, &bg_config),
                ops: Ops::new(data, local, cross, rank, path, &bg_config, call),
                config: bg_config,
                inbox: bg_rx,
                outbox: bg_tx.clone(),
                queue: Vec::new(),
                names: HashMap::new(),
                timeline,
                counters: Counters::default(),
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

impl Described for Horovod {
    fn name(&self) -> &'static str {
        "horovod"
    }

    fn bus_factor(&self) -> f64 {
        allreduce_bus_factor(self.size)
    }

    fn wire_dtype(&self) -> Option<Dtype> {
        self.config.compression.kind().and_then(Dtype::of_kind)
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

impl Reduce for Horovod {
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

    fn finish(&mut self, _params: &mut [Tensor]) -> Result<()> {
        self.shut_down()
    }
}

impl Training for Horovod {
    fn role(&self) -> Role {
        Role::Worker { index: self.rank, count: self.size }
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
}

impl Checkpointed for Horovod {}

/// The background thread's state: the controller, the operations, and what both work on.
struct Background {
    controller: Controller,
    ops: Ops,
    /// The cycle's time and whether the timeline marks each cycle.
    config: HorovodConfig,
    inbox: Receiver<ToBackground>,
    outbox: Sender<FromBackground>,
    queue: Vec<Ready>,
    /// Timeline rows of tensor ids (rank 0, with a timeline).
    names: HashMap<usize, Arc<str>>,
    timeline: Option<Timeline>,
    counters: Counters,
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
            let (responses, agreed) = self.controller.compute_responses(&mut self.queue, self.shutting_down, &mut self.timeline, &self.names, &mut self.counters)?;
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
                self.ops.execute(&mut self.queue, &responses, &mut self.timeline, &self.names, &mut self.counters, &self.outbox)?;
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
                        let old = name_of(&self.names, id);
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
