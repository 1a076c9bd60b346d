//! The controller, as Horovod keeps it apart from its operations (horovod/common/controller.cc
//! beside ops/): each cycle it decides which tensors every rank reduces and in which order, by
//! coordination through the response cache (one bitwise AND over the ranks) or negotiation
//! through rank 0, and warns of stalls. It moves no gradient bytes: ops.rs does.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::traits::*;

use crate::error::{Error, Result};
use crate::exchange::config::HorovodConfig;
use crate::exchange::horovod::cache::{CacheState, Response, ResponseCache};
use crate::exchange::horovod::negotiation::MessageTable;
use crate::exchange::horovod::queue::{name_of, Counters, Ready};
use crate::exchange::horovod::timeline::Timeline;
use crate::raw::SendComm;

/// Status bits of a cycle, each set by a rank where it holds for that rank: the AND over the
/// ranks says whether it holds for all.
pub(super) const SHUTTING_DOWN: u64 = 1;
pub(super) const IDLE: u64 = 1 << 1;
const ALL_CACHED: u64 = 1 << 2;
const NONE_INVALID: u64 = 1 << 3;

/// The controller's state, on the background thread.
pub(super) struct Controller {
    /// The communicator of coordination and negotiation (apart from the data's).
    coord: SendComm,
    rank: usize,
    size: usize,
    /// The response cache, the same on every rank.
    cache: ResponseCache,
    /// Rank 0's table of tensors reported by some ranks and not yet all.
    table: MessageTable,
    stall_check: bool,
    stall_warning: Duration,
    /// Whether a timeline is written (on rank 0; every rank then sends the bits it needs).
    with_timeline: bool,
    last_stall_check: Instant,
}

impl Controller {
    pub(super) fn new(coord: SendComm, rank: usize, size: usize, config: &HorovodConfig) -> Controller {
        Controller {
            coord,
            rank,
            size,
            cache: ResponseCache::new(config.cache_capacity),
            table: MessageTable::new(size),
            stall_check: config.stall_check,
            stall_warning: config.stall_warning,
            with_timeline: config.timeline.is_some(),
            last_stall_check: Instant::now(),
        }
    }

    /// Horovod's `Controller::ComputeResponseList`: which tensors to reduce this cycle, in one
    /// order on every rank, and the status bits agreed over the ranks.
    pub(super) fn compute_responses(&mut self, queue: &mut [Ready], shutting_down: bool, timeline: &mut Option<Timeline>, names: &HashMap<usize, Arc<str>>, counters: &mut Counters) -> Result<(Vec<Response>, u64)> {
        let caching = self.cache.capacity() > 0;
        // A cached tensor held back past the stall warning is renegotiated (Horovod's
        // InvalidateStalledCachedTensors), so that rank 0 can say which ranks hold it back.
        let stall_check = self.stall_check && self.last_stall_check.elapsed() >= self.stall_warning;
        let mut hits = BTreeSet::new();
        let mut invalid = BTreeSet::new();
        let mut uncached = false;
        if caching {
            for r in queue.iter() {
                match self.cache.cached(r.id, r.tensor.numel()) {
                    CacheState::Hit(bit) if stall_check && r.since.elapsed() >= self.stall_warning => {
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
        if shutting_down {
            status |= SHUTTING_DOWN;
        }
        if queue.is_empty() {
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
            let (flags, found) = self.coordinate_cache(status, &hits, &invalid, timeline, names)?;
            agreed = flags;
            common = found;
        }

        // 2. Negotiation through rank 0, unless every ready tensor is cached everywhere.
        let responses: Vec<Response>;
        if caching && agreed & ALL_CACHED != 0 {
            // Every rank takes the hits in bit order, each becoming the most recently used.
            responses = common.iter().map(|&bit| self.cache.get(bit)).collect();
        } else {
            counters.negotiations += 1;
            let hit_responses: Vec<Response> = common.iter().map(|&bit| self.cache.peek(bit)).collect();
            let mut requests: Vec<u64> = Vec::new();
            for r in queue.iter_mut().filter(|r| !r.reported) {
                if !matches!(self.cache.cached(r.id, r.tensor.numel()), CacheState::Hit(_)) {
                    r.reported = true;
                    requests.extend([r.id as u64, r.tensor.numel() as u64]);
                }
            }
            let (flags, list) = self.negotiate(status, &requests, &hit_responses, timeline, names)?;
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
            counters.cache_evictions = self.cache.evictions();
        }
        self.cache.compact();
        if stall_check {
            self.last_stall_check = Instant::now();
        }
        counters.cache_hits += common.len() as u64;
        Ok((responses, agreed))
    }

    /// One AND over the ranks of the status word and the cache's hit bits (with a timeline, a
    /// second section tells rank 0 which tensors any rank has ready, for NEGOTIATE_ALLREDUCE);
    /// then, if any rank has invalid entries, one OR of them, and every rank erases them.
    /// Returns the agreed status and the bits every rank has ready.
    fn coordinate_cache(&mut self, status: u64, hits: &BTreeSet<usize>, invalid: &BTreeSet<usize>, timeline: &mut Option<Timeline>, names: &HashMap<usize, Arc<str>>) -> Result<(u64, Vec<usize>)> {
        let words = self.cache.bits().div_ceil(64);
        let with_timeline = self.with_timeline;
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
        if with_timeline && timeline.is_some() {
            // Some rank has it ready: negotiation has begun; every rank has: it has ended.
            let started: Vec<Arc<str>> = bits_of(&and[1 + words..], false)
                .into_iter()
                .filter(|b| *b < self.cache.bits() && !erased.contains(b))
                .map(|b| name_of(names, self.cache.peek(b).id))
                .collect();
            let ended: Vec<Arc<str>> = common.iter().map(|&b| name_of(names, self.cache.peek(b).id)).collect();
            if let Some(timeline) = timeline.as_mut() {
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
    fn negotiate(&mut self, status: u64, requests: &[u64], hits: &[Response], timeline: &mut Option<Timeline>, names: &HashMap<usize, Arc<str>>) -> Result<(u64, Vec<Response>)> {
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
                    let name = timeline.as_ref().map(|_| name_of(names, id));
                    if let (Some(timeline), Some(name)) = (timeline.as_mut(), name) {
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
            self.report_stalls(names);
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
    fn report_stalls(&mut self, names: &HashMap<usize, Arc<str>>) {
        if !self.stall_check {
            return;
        }
        let stalled = self.table.stalled(Instant::now(), self.stall_warning);
        if stalled.is_empty() || self.last_stall_check.elapsed() < self.stall_warning {
            return;
        }
        let listed: Vec<String> = stalled
            .iter()
            .map(|(id, missing, waited)| format!("{} (waiting {:.0} s) missing on ranks {missing:?}", name_of(names, *id), waited.as_secs_f64()))
            .collect();
        log::warn!(
            "horovod: stall: {} tensor(s) enqueued on some ranks but not all for over {:.0} s: {}",
            listed.len(),
            self.stall_warning.as_secs_f64(),
            listed.join("; ")
        );
        self.last_stall_check = Instant::now();
    }
}
