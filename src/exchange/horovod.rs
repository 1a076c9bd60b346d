//! `horovod`: the way Horovod exchanges gradients, rebuilt on MPI collectives as the baseline of
//! the scaling reports (Horovod itself is not a dependency).
//!
//! The training loop enqueues tensors and waits for them; a background thread owns all of this
//! strategy's MPI traffic and runs a cycle every `--cycle-time-ms`:
//! 1. coordination: a bitwise AND over the ranks of which cached tensors each has ready (the
//!    response cache: the steady state of training costs one small all-reduce per cycle), and
//!    whether any rank has tensors the cache does not know;
//! 2. negotiation, for those: every rank sends its ready list to rank 0, which answers with
//!    the tensors ready everywhere, in one order for all (and logs tensors that some ranks
//!    have held back longer than `--stall-warning-s`); the answer enters every rank's cache at
//!    the same position;
//! 3. execution: ready tensors, in that common order, are packed into fusion buffers of up to
//!    `--fusion-threshold-mb` (optionally cast to fp16/bf16), one `MPI_Allreduce` per buffer
//!    (or node reduce, cross-node all-reduce of one rank per node, node broadcast with
//!    `--hierarchical`), then unpacked; a buffer's worth of one tensor, uncompressed, is reduced
//!    in place with no copy, as Horovod does.
//!
//! `--timeline FILE` writes every rank's events in the Chrome tracing format.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::topology::{Color, Rank, SimpleCommunicator};
use mpi::traits::*;
use serde::Serialize;
use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::exchange::allreduce::SumOps;
use crate::exchange::buckets::{pack, unpack, Bucket, Slot};
use crate::exchange::element::Dtype;
use crate::exchange::comm_thread::CommThread;
use crate::exchange::staging::{wait_for_stream, Staging};
use crate::exchange::{allreduce_bus_factor, common_dtype, DataPath, Exchange, ExchangeConfig, ExchangeReport, ReduceOp, Role};
use crate::raw::{self, SendComm};
use crate::topology::World;

/// `--compression`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    None,
    Fp16,
    Bf16,
}

impl Compression {
    fn kind(self) -> Option<Kind> {
        match self {
            Compression::None => None,
            Compression::Fp16 => Some(Kind::Half),
            Compression::Bf16 => Some(Kind::BFloat16),
        }
    }
}

#[derive(Clone, Debug)]
pub struct HorovodConfig {
    pub cycle_time: Duration,
    /// Fusion buffer size in bytes; 0: one all-reduce per tensor.
    pub fusion_threshold: usize,
    pub compression: Compression,
    pub hierarchical: bool,
    pub timeline: Option<PathBuf>,
    pub stall_warning: Duration,
    /// Test hook: enqueue tensors in a rank-dependent order, a little apart in time.
    pub shuffle_enqueue: bool,
    /// Test hook: this rank holds its last tensor back this long, once (a stall).
    pub test_delay: Option<(usize, Duration)>,
}

impl Default for HorovodConfig {
    fn default() -> Self {
        HorovodConfig {
            cycle_time: Duration::from_millis(1),
            fusion_threshold: 128 << 20,
            compression: Compression::None,
            hierarchical: false,
            timeline: None,
            stall_warning: Duration::from_secs(60),
            shuffle_enqueue: false,
            test_delay: None,
        }
    }
}

/// After a flush, for how many cycles' time the background thread negotiates back to back while
/// the flushed tensors wait for another rank (see `Background::run`).
const HURRY_CYCLES: u32 = 10;

/// Messages from the training loop to the background thread.
enum ToBackground {
    /// `prescale`: multiply the tensor by this before it is cast down for the wire (a mean
    /// under compression, so that the 16-bit sum over many ranks cannot overflow).
    Enqueue { id: usize, tensor: Tensor, prescale: Option<f64> },
    /// The training loop has enqueued all it will before waiting: negotiate now rather than at
    /// the end of the cycle. Horovod's cycle gathers tensors that a framework hands over one op
    /// at a time; here each call hands over all of its tensors at once and then waits, so the
    /// rest of the cycle would be idle time on every exchange.
    Flush,
    Shutdown,
}

/// Messages back: one more tensor done, or the thread's failure.
enum FromBackground {
    Done,
    Failed(Error),
}

/// One timeline event (Chrome tracing "complete" event).
#[derive(Serialize, Clone)]
struct Event {
    name: &'static str,
    cat: &'static str,
    ph: &'static str,
    ts: f64,
    dur: f64,
    pid: i32,
    tid: u32,
    args: serde_json::Value,
}

/// Counters reported in runs.jsonl.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct Counters {
    cycles: u64,
    negotiations: u64,
    cache_hits: u64,
    fused_allreduces: u64,
    tensors: u64,
}

/// What the background thread hands back when it ends.
struct Finished {
    counters: Counters,
    events: Vec<Event>,
}

pub struct Horovod {
    to_bg: Sender<ToBackground>,
    from_bg: Receiver<FromBackground>,
    thread: Option<CommThread<Finished>>,
    /// Main-thread communicator for the end-of-run gathers (timeline, counters).
    control: SimpleCommunicator,
    rank: usize,
    size: usize,
    config: HorovodConfig,
    path: DataPath,
    counters: Counters,
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
        let hv = config.horovod.clone();
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
        let (rank, size) = (world.rank, world.size as usize);
        let bg_config = hv.clone();
        let start = Instant::now();
        let call = config.mpi_allreduce;
        let thread = CommThread::spawn("horovod-background", config.device, move || {
                let mut bg = Background {
                    coord,
                    data,
                    local,
                    cross,
                    rank,
                    size,
                    config: bg_config,
                    path,
                    inbox: bg_rx,
                    outbox: bg_tx.clone(),
                    pending: Vec::new(),
                    cache: Vec::new(),
                    cache_index: HashMap::new(),
                    table: HashMap::new(),
                    fusion: None,
                    staging: Staging::new(),
                    sums: SumOps::new(call),
                    counters: Counters::default(),
                    events: Vec::new(),
                    start,
                    last_stall_report: Instant::now(),
                };
                let result = bg.run();
                if let Err(e) = &result {
                    let _ = bg_tx.send(FromBackground::Failed(Error::exchange("horovod", e.to_string())));
                }
                result.map(|()| Finished { counters: bg.counters, events: std::mem::take(&mut bg.events) })
            })?;
        Ok(Horovod {
            to_bg,
            from_bg,
            thread: Some(thread),
            control: world.comm.duplicate(),
            rank: rank as usize,
            size,
            config: hv,
            path,
            counters: Counters::default(),
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
                .send(ToBackground::Enqueue { id, tensor: tensors[index].shallow_clone(), prescale })
                .map_err(|_| Error::exchange("horovod", "the background thread has stopped"))?;
            if self.config.shuffle_enqueue && k % 3 == 2 {
                std::thread::sleep(self.config.cycle_time / 2);
            }
        }
        let _ = self.to_bg.send(ToBackground::Flush);
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

    /// Ends the background thread (all ranks together) and gathers the timeline and counters.
    fn shut_down(&mut self) -> Result<()> {
        let Some(thread) = self.thread.take() else { return Ok(()) };
        let _ = self.to_bg.send(ToBackground::Shutdown);
        let finished = thread.join()?;
        let mut totals = [0u64; 5];
        let c = finished.counters;
        let mine = [c.cycles, c.negotiations, c.cache_hits, c.fused_allreduces, c.tensors];
        self.control.all_reduce_into(&mine[..], &mut totals[..], SystemOperation::max());
        self.counters = Counters { cycles: totals[0], negotiations: totals[1], cache_hits: totals[2], fused_allreduces: totals[3], tensors: totals[4] };
        if let Some(path) = &self.config.timeline {
            write_timeline(&self.control, path, &finished.events)?;
        }
        Ok(())
    }
}

impl Drop for Horovod {
    fn drop(&mut self) {
        // On an error path the thread may still run: tell it to stop. It leaves its loop once
        // every rank's has been told (an error all ranks agreed on), and dropping `thread` then
        // joins it, so that MPI is never finalized under it (see comm_thread).
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
        self.enqueue_and_wait((key + 1) << 32, tensors, op)
    }

    fn finish(&mut self, _params: &mut [Tensor]) -> Result<()> {
        self.shut_down()
    }

    fn report(&self) -> ExchangeReport {
        let mut extra = serde_json::Map::new();
        let c = self.counters;
        extra.insert("horovod_cycles".into(), c.cycles.into());
        extra.insert("horovod_negotiations".into(), c.negotiations.into());
        extra.insert("horovod_cache_hits".into(), c.cache_hits.into());
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
    since: Instant,
}

/// The background thread's state.
struct Background {
    coord: SendComm,
    data: SendComm,
    local: SendComm,
    cross: Option<SendComm>,
    rank: Rank,
    size: usize,
    config: HorovodConfig,
    path: DataPath,
    inbox: Receiver<ToBackground>,
    outbox: Sender<FromBackground>,
    pending: Vec<Ready>,
    /// Response cache: bit position -> (tensor id, element count), the same on every rank.
    cache: Vec<(usize, usize)>,
    cache_index: HashMap<usize, usize>,
    /// Rank 0's negotiation table: tensor id -> (element count, ranks that reported it, first report).
    table: HashMap<usize, (usize, Vec<bool>, Instant)>,
    fusion: Option<Tensor>,
    staging: Staging,
    sums: SumOps,
    counters: Counters,
    events: Vec<Event>,
    start: Instant,
    last_stall_report: Instant,
}

impl Background {
    fn now_us(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1e6
    }

    fn event(&mut self, name: &'static str, started_us: f64, args: serde_json::Value) {
        if self.config.timeline.is_some() {
            let end = self.now_us();
            self.events.push(Event { name, cat: "horovod", ph: "X", ts: started_us, dur: end - started_us, pid: self.rank, tid: 0, args });
        }
    }

    fn run(&mut self) -> Result<()> {
        let mut shutting_down = false;
        // When the training loop last flushed: it waits for what it enqueued, and nothing more
        // comes until that is done. The tensors can outlive the cycle that took the flush, when
        // another rank had not enqueued them yet (the cycle agreed on nothing, or on part of
        // them); the next cycles then negotiate at once, each waiting in the collective for the
        // slower rank, instead of idling to the end of a cycle first (up to a whole cycle per
        // exchange: tensors waited 0.95 ms in the queue, median, at 16 MiB on 2 ranks). For a
        // few cycles only: ranks that enqueued different tensors (a stall) go back to the
        // cycle's pace.
        let mut flushed_at: Option<Instant> = None;
        loop {
            let cycle_start = Instant::now();
            // Take what the training loop enqueued (waiting at most one cycle for something).
            let deadline = cycle_start + self.config.cycle_time;
            if self.pending.is_empty() {
                flushed_at = None;
            }
            let hurry = flushed_at.is_some_and(|t| t.elapsed() < HURRY_CYCLES * self.config.cycle_time);
            while !hurry {
                let wait = deadline.saturating_duration_since(Instant::now());
                match self.inbox.recv_timeout(wait) {
                    Ok(ToBackground::Enqueue { id, tensor, prescale }) => self.pending.push(Ready { id, tensor, prescale, since: Instant::now() }),
                    Ok(ToBackground::Flush) => {
                        flushed_at = Some(Instant::now());
                        break;
                    }
                    Ok(ToBackground::Shutdown) | Err(RecvTimeoutError::Disconnected) => shutting_down = true,
                    Err(RecvTimeoutError::Timeout) => break,
                }
                if Instant::now() >= deadline {
                    break;
                }
            }
            self.counters.cycles += 1;
            let negotiate_start = self.now_us();
            let (order, all_done) = self.coordinate(shutting_down)?;
            self.event("NEGOTIATE", negotiate_start, serde_json::json!({ "tensors": order.len() }));
            if all_done {
                // Every rank is shutting down with nothing pending: all leave the loop together.
                return Ok(());
            }
            if !order.is_empty() {
                self.execute(&order)?;
            }
        }
    }

    /// Decides, with the other ranks, which tensors to reduce this cycle, in one order for all.
    fn coordinate(&mut self, shutting_down: bool) -> Result<(Vec<(usize, usize)>, bool)> {
        let comm = self.coord.comm();
        // 1. Cached tensors ready everywhere: one AND of bit vectors. A cached tensor that has
        //    waited past the stall warning is sent through negotiation instead, so that rank 0
        //    can say which ranks hold it back.
        let words = self.cache.len().div_ceil(64).max(1);
        let mut bits = vec![0u64; words + 1];
        let mut uncached = 0u64;
        for r in &self.pending {
            match self.cache_index.get(&r.id) {
                Some(&bit) if self.cache[bit].1 == r.tensor.numel() && r.since.elapsed() < self.config.stall_warning => {
                    bits[bit / 64] |= 1 << (bit % 64)
                }
                _ => uncached = 1,
            }
        }
        // The last word carries the flags, ANDed like the rest: "no rank has uncached tensors",
        // "every rank is shutting down" and "no rank has anything pending".
        bits[words] = u64::from(uncached == 0) | (u64::from(shutting_down) << 1) | (u64::from(self.pending.is_empty()) << 2);
        let mut agreed = vec![0u64; words + 1];
        comm.all_reduce_into(&bits[..], &mut agreed[..], SystemOperation::bitwise_and());
        let someone_uncached = agreed[words] & 1 == 0;
        let all_done = agreed[words] & 6 == 6;

        let mut order: Vec<(usize, usize)> = Vec::new();
        for (bit, &(id, len)) in self.cache.iter().enumerate() {
            if agreed[bit / 64] >> (bit % 64) & 1 == 1 {
                order.push((id, len));
            }
        }
        self.counters.cache_hits += order.len() as u64;
        if self.rank == 0 {
            // Reduced from the cache: forget any earlier report of them in the table.
            for (id, _) in &order {
                self.table.remove(id);
            }
        }

        // 2. Negotiation with rank 0 for the rest.
        if someone_uncached {
            self.counters.negotiations += 1;
            let cached_now: Vec<usize> = order.iter().map(|&(id, _)| id).collect();
            let mine: Vec<u64> = self
                .pending
                .iter()
                .filter(|r| !cached_now.contains(&r.id))
                .flat_map(|r| [r.id as u64, r.tensor.numel() as u64])
                .collect();
            let responses = self.negotiate(&mine)?;
            for &(id, len) in &responses {
                // Every rank sees the same responses in the same order, so the caches stay equal;
                // an entry whose tensor changed size is replaced in place, or the tensor would be
                // negotiated again at every step.
                match self.cache_index.get(&id) {
                    Some(&bit) => self.cache[bit].1 = len,
                    None => {
                        self.cache_index.insert(id, self.cache.len());
                        self.cache.push((id, len));
                    }
                }
                order.push((id, len));
            }
        }
        Ok((order, all_done))
    }

    /// Rank 0 gathers every rank's ready list and answers with the tensors ready everywhere.
    fn negotiate(&mut self, mine: &[u64]) -> Result<Vec<(usize, usize)>> {
        let comm = self.coord.comm();
        let root = comm.process_at_rank(0);
        let count = mine.len() as i32;
        let mut answer: Vec<u64>;
        if self.rank == 0 {
            let mut counts = vec![0i32; self.size];
            root.gather_into_root(&count, &mut counts[..]);
            let displs: Vec<i32> = counts.iter().scan(0, |acc, &c| { let d = *acc; *acc += c; Some(d) }).collect();
            let mut all = vec![0u64; counts.iter().sum::<i32>() as usize];
            {
                let mut partition = mpi::datatype::PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
                root.gather_varcount_into_root(mine, &mut partition);
            }
            // Update the table: who has reported what.
            for (r, (&c, &d)) in counts.iter().zip(&displs).enumerate() {
                for pair in all[d as usize..(d + c) as usize].chunks_exact(2) {
                    let (id, len) = (pair[0] as usize, pair[1] as usize);
                    let entry = self.table.entry(id).or_insert_with(|| (len, vec![false; self.size], Instant::now()));
                    if entry.0 != len {
                        return Err(Error::exchange("horovod", format!("tensor {id} has {} elements on one rank and {len} on rank {r}", entry.0)));
                    }
                    entry.1[r] = true;
                }
            }
            // Ready everywhere, oldest first (ties by id): the order every rank will use.
            let mut ready: Vec<(Instant, usize, usize)> =
                self.table.iter().filter(|(_, (_, seen, _))| seen.iter().all(|&s| s)).map(|(&id, &(len, _, t))| (t, id, len)).collect();
            ready.sort();
            for (_, id, _) in &ready {
                self.table.remove(id);
            }
            answer = ready.iter().flat_map(|&(_, id, len)| [id as u64, len as u64]).collect();
            let mut n = answer.len() as u64;
            root.broadcast_into(&mut n);
            root.broadcast_into(&mut answer[..]);
        } else {
            root.gather_into(&count);
            root.gather_varcount_into(mine);
            let mut n = 0u64;
            root.broadcast_into(&mut n);
            answer = vec![0u64; n as usize];
            root.broadcast_into(&mut answer[..]);
        }
        if self.rank == 0 {
            self.report_stalls();
        }
        Ok(answer.chunks_exact(2).map(|p| (p[0] as usize, p[1] as usize)).collect())
    }

    /// Rank 0: tensors some ranks have reported and others not, for longer than the warning.
    fn report_stalls(&mut self) {
        if self.last_stall_report.elapsed() < self.config.stall_warning {
            return;
        }
        let mut stalled: Vec<String> = self
            .table
            .iter()
            .filter(|(_, (_, _, since))| since.elapsed() >= self.config.stall_warning)
            .map(|(id, (_, seen, since))| {
                let missing: Vec<usize> = (0..seen.len()).filter(|&r| !seen[r]).collect();
                format!("tensor {id} (waiting {:.0} s) missing on ranks {missing:?}", since.elapsed().as_secs_f64())
            })
            .collect();
        if !stalled.is_empty() {
            stalled.sort();
            log::warn!(
                "horovod: stall: {} tensor(s) enqueued on some ranks but not all for over {:.0} s: {}",
                stalled.len(),
                self.config.stall_warning.as_secs_f64(),
                stalled.join("; ")
            );
            self.last_stall_report = Instant::now();
        }
    }

    /// Reduces the tensors of `order` in fusion buffers, then tells the training loop.
    fn execute(&mut self, order: &[(usize, usize)]) -> Result<()> {
        // This rank's tensors, in the agreed order.
        let mut items: Vec<Ready> = Vec::with_capacity(order.len());
        for &(id, _) in order {
            let at = self.pending.iter().position(|r| r.id == id).ok_or_else(|| {
                Error::exchange("horovod", format!("tensor {id} was agreed but is not pending on rank {}", self.rank))
            })?;
            items.push(self.pending.swap_remove(at));
        }
        let now = self.now_us();
        for r in &items {
            let queued = r.since.elapsed().as_secs_f64() * 1e6;
            self.event("QUEUE", now - queued, serde_json::json!({ "tensor": r.id }));
        }
        // Fuse consecutive tensors up to the threshold (dtype is one per exchange).
        let kind = items[0].tensor.kind();
        let wire_kind = self.config.compression.kind().unwrap_or(kind);
        let elem = wire_kind.elt_size_in_bytes();
        let mut groups: Vec<VecDeque<Ready>> = Vec::new();
        let mut current: VecDeque<Ready> = VecDeque::new();
        let mut current_bytes = 0;
        for r in items {
            let bytes = r.tensor.numel() * elem;
            if !current.is_empty() && (self.config.fusion_threshold == 0 || current_bytes + bytes > self.config.fusion_threshold) {
                groups.push(std::mem::take(&mut current));
                current_bytes = 0;
            }
            current_bytes += bytes;
            current.push_back(r);
        }
        groups.push(current);

        for group in groups {
            let len: usize = group.iter().map(|r| r.tensor.numel()).sum();
            let device = group[0].tensor.device();
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
                slots: group.iter().scan(0, |at, r| { let slot = Slot { tensor: 0, offset: *at, len: r.tensor.numel() }; *at += slot.len; Some(slot) })
                    .enumerate().map(|(i, s)| Slot { tensor: i, ..s }).collect(),
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
                    let t0 = self.now_us();
                    pack(&bucket, &tensors, &mut buffer);
                    self.event("MEMCPY_IN_FUSION_BUFFER", t0, serde_json::json!({ "tensors": group.len(), "bytes": len * elem }));
                    buffer
                }
            };

            let t1 = self.now_us();
            self.all_reduce_buffer(&mut buffer)?;
            self.counters.fused_allreduces += 1;
            self.event("ALLREDUCE", t1, serde_json::json!({ "bytes": len * elem, "hierarchical": self.config.hierarchical }));

            let t2 = self.now_us();
            if fused {
                let mut tensors = tensors;
                unpack(&bucket, &buffer, &mut tensors);
            }
            // The training loop may read the tensors once told they are done.
            wait_for_stream(device)?;
            if fused {
                self.event("MEMCPY_OUT_FUSION_BUFFER", t2, serde_json::json!({ "tensors": group.len() }));
            }
            for _ in &group {
                self.counters.tensors += 1;
                let _ = self.outbox.send(FromBackground::Done);
            }
        }
        Ok(())
    }

    /// Sums one fusion buffer over all ranks: flat, or node-reduce + cross all-reduce + node broadcast.
    fn all_reduce_buffer(&mut self, buffer: &mut Tensor) -> Result<()> {
        let mut one = [buffer.shallow_clone()];
        let (data, local, cross, sums, hierarchical) = (&self.data, &self.local, &self.cross, &self.sums, self.config.hierarchical);
        let path = self.path.for_mpi_reduction(common_dtype(&one)?);
        self.staging.run(path, &mut one, |_, b| {
            if !hierarchical {
                return sums.all_reduce_sum(data.comm(), b);
            }
            // Reduce within the node to its first rank, all-reduce among the nodes' first
            // ranks, broadcast within the node.
            let local = local.comm();
            sums.reduce_sum_to_root(local, b, 0)?;
            if let Some(cross) = cross {
                sums.all_reduce_sum(cross.comm(), b)?;
            }
            let dtype = common_dtype(std::slice::from_ref(b))?;
            crate::with_element!(dtype, E => {
                // SAFETY: `b` is this thread's fusion buffer (or its staging copy), which nothing
                // else touches; on the device the path is direct only with a CUDA-aware MPI, and
                // the staging run waited for the stream.
                let mut view = unsafe { raw::mpi_buffer_mut::<E>(b)? };
                local.process_at_rank(0).broadcast_into(&mut view);
            });
            Ok(())
        })
    }
}

/// A flat view of a group's one tensor when it can be reduced where it lies: alone, already of
/// the wire's kind (no compression cast), dense in memory. None: it goes through the fusion buffer.
fn in_place(group: &VecDeque<Ready>, wire_kind: Kind) -> Option<Tensor> {
    match group.front() {
        Some(r) if group.len() == 1 && r.tensor.kind() == wire_kind => raw::flat_dense_view(&r.tensor).ok(),
        _ => None,
    }
}

/// Gathers every rank's events to rank 0, which writes one Chrome tracing file.
fn write_timeline(comm: &SimpleCommunicator, path: &std::path::Path, events: &[Event]) -> Result<()> {
    let rank = comm.rank();
    let mut all: Vec<serde_json::Value> = Vec::new();
    if rank == 0 {
        all.extend(events.iter().map(|e| serde_json::to_value(e).unwrap()));
    }
    let mine = serde_json::to_vec(events).map_err(|e| Error::Results(e.to_string()))?;
    let root = comm.process_at_rank(0);
    let count = mine.len() as i32;
    if rank == 0 {
        let mut counts = vec![0i32; comm.size() as usize];
        root.gather_into_root(&count, &mut counts[..]);
        let displs: Vec<i32> = counts.iter().scan(0, |acc, &c| { let d = *acc; *acc += c; Some(d) }).collect();
        let mut bytes = vec![0u8; counts.iter().sum::<i32>() as usize];
        {
            let mut partition = mpi::datatype::PartitionMut::new(&mut bytes[..], &counts[..], &displs[..]);
            root.gather_varcount_into_root(&mine[..], &mut partition);
        }
        for (r, (&c, &d)) in counts.iter().zip(&displs).enumerate().skip(1) {
            let list: Vec<serde_json::Value> = serde_json::from_slice(&bytes[d as usize..(d + c) as usize])
                .map_err(|e| Error::Results(format!("timeline of rank {r}: {e}")))?;
            all.extend(list);
        }
        for r in 0..comm.size() {
            all.push(serde_json::json!({ "name": "process_name", "ph": "M", "pid": r, "args": { "name": format!("rank {r}") } }));
        }
        let text = serde_json::to_string(&serde_json::json!({ "traceEvents": all, "displayTimeUnit": "ms" }))
            .map_err(|e| Error::Results(e.to_string()))?;
        let tmp = path.with_extension("json.tmp");
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        std::fs::write(&tmp, text).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
    } else {
        root.gather_into(&count);
        root.gather_varcount_into(&mine[..]);
    }
    Ok(())
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
}
