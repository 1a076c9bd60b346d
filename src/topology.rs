//! Ranks and nodes: who is where (the shard arithmetic of a count is `plan::shard`).
//!
//! [`World`] wraps the communicator a job runs on (MPI_COMM_WORLD, or a sub-communicator when a
//! study runs several rank counts in one allocation) with what every part of the program asks
//! of it: rank, size, the node-local rank that picks the GPU, and which node every rank is on.

use std::time::Duration;

use mpi::collective::SystemOperation;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::traits::*;

use crate::error::{Error, Result};

/// Environment variable that splits the ranks of one machine into fake nodes of this many ranks,
/// so that node-aware code (ring order, hierarchical allreduce) can be tested on one machine.
pub const FAKE_RANKS_PER_NODE_ENV: &str = "HPC_TRAIN_RANKS_PER_NODE";

pub struct World {
    pub comm: SimpleCommunicator,
    pub rank: i32,
    pub size: i32,
    /// The ranks on this rank's node (a shared-memory split, or a fake node).
    pub local: SimpleCommunicator,
    pub local_rank: i32,
    pub local_size: i32,
    /// Node index of every rank, numbered from 0 in order of each node's lowest rank.
    pub node_of: Vec<i32>,
}

impl World {
    /// Builds the view of `comm`. Collective over `comm`.
    pub fn new(comm: SimpleCommunicator) -> Result<World> {
        let rank = comm.rank();
        let size = comm.size();
        let local = match fake_ranks_per_node()? {
            Some(per_node) => comm
                .split_by_color_with_key(Color::with_value(rank / per_node), rank)
                .expect("a colour was given, so every rank gets a communicator"),
            None => comm.split_shared(rank),
        };
        let local_rank = local.rank();
        let local_size = local.size();

        // The node's lowest world rank names the node; every rank learns every rank's node.
        let mut leader = 0i32;
        local.all_reduce_into(&rank, &mut leader, SystemOperation::min());
        let mut leader_of = vec![0i32; size as usize];
        comm.all_gather_into(&leader, &mut leader_of[..]);
        let node_of = number_nodes(&leader_of);

        Ok(World { comm, rank, size, local, local_rank, local_size, node_of })
    }

    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    pub fn nodes(&self) -> i32 {
        self.node_of.iter().copied().max().map_or(1, |n| n + 1)
    }

    /// Agrees across the ranks on whether a step that every rank performed failed.
    ///
    /// Every rank calls this at the same point. If no rank failed, each gets its own `Ok` back.
    /// If some did, the lowest failing rank gets its error back as [`Error::Agreed`] (and is the
    /// one that prints it) while every other rank gets [`Error::Reported`], so the message
    /// appears once and every rank can exit non-zero without anyone blocking in a collective
    /// that others skipped.
    pub fn agree<T>(&self, local: Result<T>) -> Result<T> {
        let candidate = if local.is_err() { self.rank } else { self.size };
        let mut first_failed = self.size;
        self.comm.all_reduce_into(&candidate, &mut first_failed, SystemOperation::min());
        if first_failed == self.size {
            return local;
        }
        match local {
            Err(e) if self.rank == first_failed => Err(Error::Agreed(Box::new(e))),
            Err(e) => {
                log::debug!("rank {}: {e} (reported by rank {first_failed})", self.rank);
                Err(Error::Reported(first_failed))
            }
            Ok(_) => Err(Error::Reported(first_failed)),
        }
    }

    /// Ranks in ring order: node by node, so that only two ring links per node cross the network.
    pub fn ring_order(&self) -> Vec<i32> {
        ring_order(&self.node_of)
    }

    /// Maximum of `value` over the ranks.
    pub fn max_f64(&self, value: f64) -> f64 {
        let mut out = 0.0;
        self.comm.all_reduce_into(&value, &mut out, SystemOperation::max());
        out
    }

    /// Sum of `value` over the ranks.
    pub fn sum_f64(&self, value: f64) -> f64 {
        let mut out = 0.0;
        self.comm.all_reduce_into(&value, &mut out, SystemOperation::sum());
        out
    }

    /// A barrier whose waiting ranks sleep between tests of it (50 us apart, doubling to 2 ms)
    /// instead of polling in MPI. For the ranks that sit out a study point or a conformance
    /// case: Open MPI and MPICH both poll while a blocking collective waits, and on a launch
    /// with more ranks than cores the idle ranks' polling took the cores of the ranks at work.
    /// Collective over the world.
    pub fn sleeping_barrier(&self) {
        self.sleeping_barrier_within(None);
    }

    /// [`World::sleeping_barrier`] that gives up after `limit`: whether every rank arrived in
    /// time. A barrier given up on stays posted, unfinished, as the process exits: for the
    /// exit paths only, where a rank that never arrives has ended the job another way.
    pub fn sleeping_barrier_within(&self, limit: Option<Duration>) -> bool {
        sleeping_barrier_within(&self.comm, limit)
    }

    /// Warnings every rank computed alike, logged once (by rank 0).
    pub fn log_warnings(&self, warnings: &[String]) {
        if self.is_root() {
            for w in warnings {
                log::warn!("{w}");
            }
        }
    }

}

/// [`World::sleeping_barrier_within`] over any communicator, for an exit path that has no
/// [`World`] (a command line that did not parse).
pub fn sleeping_barrier_within(comm: &impl Communicator, limit: Option<Duration>) -> bool {
    let started = std::time::Instant::now();
    let mut request = comm.immediate_barrier();
    let mut pause = Duration::from_micros(50);
    loop {
        match request.test() {
            Ok(_) => return true,
            Err(pending) => request = pending,
        }
        if limit.is_some_and(|limit| started.elapsed() >= limit) {
            // rsmpi panics when an unfinished request is dropped; MPI frees it at exit.
            std::mem::forget(request);
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(2));
    }
}

/// The MPI_COMM_WORLD rank of each rank of `comm` (a local group translation, no
/// communication): how logs name a peer, since a rank in a stage's or a tensor-parallel group's
/// communicator says nothing about which process it is. -1 for a rank outside the world (a
/// spawned process; hpc-train spawns none).
pub fn world_ranks_of(comm: &impl Communicator) -> Vec<i32> {
    let ranks: Vec<i32> = (0..comm.size()).collect();
    comm.group().translate_ranks(&ranks, &SimpleCommunicator::world().group()).into_iter().map(|r| r.unwrap_or(-1)).collect()
}

fn fake_ranks_per_node() -> Result<Option<i32>> {
    match std::env::var(FAKE_RANKS_PER_NODE_ENV) {
        Err(_) => Ok(None),
        Ok(v) if v.is_empty() => Ok(None),
        Ok(v) => match v.parse::<i32>() {
            Ok(n) if n >= 1 => Ok(Some(n)),
            _ => Err(Error::usage(format!(
                "{FAKE_RANKS_PER_NODE_ENV}={v:?}: expected a whole number of ranks per node, at least 1"
            ))),
        },
    }
}

/// Numbers nodes 0.. in the order of their leaders (lowest ranks).
fn number_nodes(leader_of: &[i32]) -> Vec<i32> {
    let mut leaders: Vec<i32> = leader_of.to_vec();
    leaders.sort_unstable();
    leaders.dedup();
    leader_of
        .iter()
        .map(|l| leaders.binary_search(l).expect("every leader is in the list") as i32)
        .collect()
}

/// Ranks sorted by node, then by rank within the node.
pub fn ring_order(node_of: &[i32]) -> Vec<i32> {
    let mut order: Vec<i32> = (0..node_of.len() as i32).collect();
    order.sort_by_key(|&r| (node_of[r as usize], r));
    order
}

/// The GPU a rank of a node takes: an index into the GPUs that rank sees (what it passes to
/// CUDA), and the node's other ranks that took the same physical GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuChoice {
    pub index: usize,
    /// The GPU's identity (UUID), as the rank sees it.
    pub id: String,
    /// Node-local ranks that took the same GPU, this one excluded.
    pub shared_with: Vec<usize>,
}

/// Which GPU each rank of one node takes, from every node-local rank's list of the GPUs it sees
/// (their identities in CUDA's index order; empty for a rank that trains on the CPU).
///
/// Sharing is decided by identity, not by counting: under `srun --gpus-per-task=1` (Slurm's
/// per-task binding) or a per-rank `CUDA_VISIBLE_DEVICES`, every rank sees one GPU, its own, as
/// index 0, so four ranks see one GPU each and share nothing. Ranks take GPUs in local-rank
/// order; each starts looking at its local rank modulo its GPUs (with every rank seeing every
/// GPU, rank r takes GPU r as before) and takes the first that no lower rank has. A rank that
/// finds every one of its GPUs taken shares the one it started at.
pub fn assign_gpus(visible: &[Vec<String>]) -> Vec<Option<GpuChoice>> {
    let mut holders: std::collections::HashMap<&str, Vec<usize>> = std::collections::HashMap::new();
    let mut picks: Vec<Option<(usize, &str)>> = Vec::with_capacity(visible.len());
    for (rank, gpus) in visible.iter().enumerate() {
        if gpus.is_empty() {
            picks.push(None);
            continue;
        }
        let start = rank % gpus.len();
        let free = (0..gpus.len()).map(|k| (start + k) % gpus.len()).find(|&i| !holders.contains_key(gpus[i].as_str()));
        let index = free.unwrap_or(start);
        holders.entry(gpus[index].as_str()).or_default().push(rank);
        picks.push(Some((index, gpus[index].as_str())));
    }
    picks
        .iter()
        .enumerate()
        .map(|(rank, pick)| {
            pick.map(|(index, id)| GpuChoice {
                index,
                id: id.to_string(),
                shared_with: holders[id].iter().copied().filter(|&r| r != rank).collect(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_order_keeps_nodes_together() {
        // Ranks placed round-robin over two nodes.
        let node_of = [0, 1, 0, 1, 0, 1];
        assert_eq!(ring_order(&node_of), vec![0, 2, 4, 1, 3, 5]);
        // Crossings between nodes: exactly one per node boundary, plus the wrap-around.
        let order = ring_order(&node_of);
        let crossings = (0..order.len())
            .filter(|&i| node_of[order[i] as usize] != node_of[order[(i + 1) % order.len()] as usize])
            .count();
        assert_eq!(crossings, 2);
    }

    fn gpus(lists: &[&[&str]]) -> Vec<Vec<String>> {
        lists.iter().map(|l| l.iter().map(|s| s.to_string()).collect()).collect()
    }

    fn indices_and_sharing(choices: &[Option<GpuChoice>]) -> Vec<Option<(usize, bool)>> {
        choices.iter().map(|c| c.as_ref().map(|c| (c.index, !c.shared_with.is_empty()))).collect()
    }

    #[test]
    fn every_rank_seeing_every_gpu_takes_its_local_rank() {
        let all = ["A", "B", "C", "D"];
        let choices = assign_gpus(&gpus(&[&all, &all, &all, &all]));
        assert_eq!(indices_and_sharing(&choices), vec![Some((0, false)), Some((1, false)), Some((2, false)), Some((3, false))]);
    }

    #[test]
    fn ranks_bound_to_one_gpu_each_share_nothing() {
        // srun --gpus-per-task=1: each rank sees its own GPU as index 0 (issue 31, item 1).
        let choices = assign_gpus(&gpus(&[&["A"], &["B"], &["C"], &["D"]]));
        assert_eq!(indices_and_sharing(&choices), vec![Some((0, false)); 4]);
        // Two GPUs per task: ranks 0 and 1 see A and B, ranks 2 and 3 see C and D.
        let choices = assign_gpus(&gpus(&[&["A", "B"], &["A", "B"], &["C", "D"], &["C", "D"]]));
        let ids: Vec<&str> = choices.iter().map(|c| c.as_ref().unwrap().id.as_str()).collect();
        assert_eq!(ids, vec!["A", "B", "C", "D"]);
        assert!(choices.iter().all(|c| c.as_ref().unwrap().shared_with.is_empty()));
    }

    #[test]
    fn more_ranks_than_gpus_share_and_say_with_whom() {
        let all = ["A", "B"];
        let choices = assign_gpus(&gpus(&[&all, &all, &all]));
        assert_eq!(indices_and_sharing(&choices), vec![Some((0, true)), Some((1, false)), Some((0, true))]);
        assert_eq!(choices[0].as_ref().unwrap().shared_with, vec![2]);
        assert_eq!(choices[2].as_ref().unwrap().shared_with, vec![0]);
        // Every rank masked to the same GPU (CUDA_VISIBLE_DEVICES=0 for all): all share it.
        let choices = assign_gpus(&gpus(&[&["A"], &["A"]]));
        assert_eq!(indices_and_sharing(&choices), vec![Some((0, true)), Some((0, true))]);
    }

    #[test]
    fn cpu_ranks_take_no_gpu() {
        let choices = assign_gpus(&gpus(&[&[], &["A"], &[]]));
        assert_eq!(indices_and_sharing(&choices), vec![None, Some((0, false)), None]);
    }

    #[test]
    fn nodes_are_numbered_by_lowest_rank() {
        assert_eq!(number_nodes(&[0, 0, 2, 2, 0]), vec![0, 0, 1, 1, 0]);
        assert_eq!(number_nodes(&[3, 0, 0, 3]), vec![1, 0, 0, 1]);
    }
}
