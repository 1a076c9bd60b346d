//! Gradient exchange strategies, all behind [`Exchange`], so that the training loop never knows
//! which one runs.
//!
//! One file per strategy:
//! - [`allreduce`]: the MPI library's own `MPI_Allreduce`, the baseline;
//! - [`ring`]: a ring all-reduce (reduce-scatter then all-gather) on point-to-point calls;
//!   [`shared_ring`] runs its schedule through node-shared memory;
//! - [`ps`]: parameter servers on point-to-point calls, synchronous or asynchronous;
//! - [`horovod`]: a Horovod-style background cycle with negotiation and tensor fusion;
//! - [`rhd`]: recursive halving-doubling (and recursive doubling for short buckets) on
//!   point-to-point calls; [`auto`]: ring, rhd or recursive doubling per bucket, from the cost
//!   model;
//! - [`zero`]: `--zero 1|2`, ZeRO's sharded optimizer on the reduce-scatter and all-gather of
//!   ring, rhd or auto (wraps them); [`fsdp`]: `--zero 3`, the parameters sharded too, unit by
//!   unit, on the same halves.
//!
//! What they share, each strategy imports directly (never through this file, which imports
//! them all): [`strategy`] the trait and the types it speaks in, [`config`] what the strategies
//! are configured with; [`buckets`] packs buckets into fusion buffers (the plans are
//! `plan::buckets`), [`staging`] moves GPU buckets through pinned host memory when MPI cannot
//! read device memory, [`comm_thread`] runs a strategy's own MPI thread; the element types
//! they reduce are `crate::element`, below the exchange beside the raw layer that moves them.
//! [`options`] holds the strategies' command-line groups, for the commands. This file makes the
//! chosen strategy ([`build`]) and re-exports what the layers above use.

pub mod allreduce;
pub mod auto;
pub mod buckets;
pub mod comm_thread;
pub mod config;
pub mod fsdp;
pub mod horovod;
pub mod options;
pub mod ps;
pub mod rhd;
pub mod ring;
pub mod shared_ring;
pub mod staging;
pub mod strategy;
pub mod zero;

pub use config::{worker_count, ExchangeConfig, StrategyKind};
pub use strategy::{Checkpointed, Exchange, FlatPiece, Reduce, ReduceOp, Role, StateSource, Training};

use crate::error::{Error, Result};
use mpi::topology::{Color, Communicator};

use crate::topology::World;

/// Makes the chosen strategy on `world`. Collective over the world's communicator.
pub fn build(kind: StrategyKind, world: &World, config: &ExchangeConfig) -> Result<Box<dyn Exchange>> {
    check_zero(kind, config.zero, world.size as usize)?;
    if config.zero == 3 {
        return build_fully_sharded(kind, world, config);
    }
    if config.zero > 0 {
        let sharded = build_sharded(kind, world, config)?;
        let path = strategy::DataPath::choose(config.device, config.cuda_aware);
        return Ok(Box::new(zero::ZeroExchange::new(sharded, config.zero, config.bucket_bytes, path)));
    }
    Ok(match kind {
        StrategyKind::Allreduce => Box::new(allreduce::MpiAllreduce::new(world, config)?),
        StrategyKind::Ring => Box::new(ring::RingAllreduce::new(world, config)?),
        StrategyKind::Ps => Box::new(ps::ParameterServer::new(world, config)?),
        StrategyKind::Horovod => Box::new(horovod::Horovod::new(world, config)?),
        StrategyKind::Rhd => Box::new(rhd::RhdAllreduce::new(world, config)?),
        StrategyKind::Auto => Box::new(auto::Auto::new(world, config)?),
    })
}

/// The strategy's reduce-scatter and all-gather, run apart (ZeRO's stages).
fn build_sharded(kind: StrategyKind, world: &World, config: &ExchangeConfig) -> Result<Box<dyn zero::ShardedCollectives>> {
    Ok(match kind {
        StrategyKind::Rhd => Box::new(rhd::RhdAllreduce::new(world, config)?),
        StrategyKind::Auto => Box::new(auto::Auto::new(world, config)?),
        _ => Box::new(ring::RingAllreduce::new(world, config)?),
    })
}

/// `--zero 3`: shards over every rank, or with `--fsdp-hybrid` over each node's ranks with the
/// same shards on every node (an all-reduce among them joins the nodes). Collective.
fn build_fully_sharded(kind: StrategyKind, world: &World, config: &ExchangeConfig) -> Result<Box<dyn Exchange>> {
    let path = strategy::DataPath::choose(config.device, config.cuda_aware);
    let role = Role::Worker { index: world.rank as usize, count: world.size as usize };
    if !config.fsdp_hybrid || world.nodes() == 1 {
        if config.fsdp_hybrid && world.is_root() {
            log::info!("--fsdp-hybrid: every rank is on one node, so sharding over the node is sharding over all of them");
        }
        return Ok(Box::new(fsdp::FullyShardedExchange::new(build_sharded(kind, world, config)?, None, role, path, true)));
    }
    let per_node = world.local_size;
    if world.node_of.iter().any(|&n| world.node_of.iter().filter(|&&m| m == n).count() != per_node as usize) {
        return Err(Error::usage(format!(
            "--fsdp-hybrid: the {} nodes run different numbers of ranks; hybrid sharding needs the same number on each (each node holds one copy of the shards)",
            world.nodes()
        )));
    }
    check_zero(kind, 3, per_node as usize)?;
    let node = World::new(world.local.duplicate())?;
    let across = World::new(world.comm.split_by_color_with_key(Color::with_value(world.local_rank), world.rank).expect("every rank has a colour"))?;
    let replicas = build(kind, &across, &ExchangeConfig { zero: 0, fsdp_hybrid: false, ..config.clone() })?;
    if world.is_root() {
        log::info!("--fsdp-hybrid: shards over the {per_node} ranks of each node, replicated on {} nodes", world.nodes());
    }
    // The first node's ranks write the shards into checkpoints; the others hold the same ones.
    let writes_shards = across.rank == 0;
    Ok(Box::new(fsdp::FullyShardedExchange::new(build_sharded(kind, &node, config)?, Some(replicas), role, path, writes_shards)))
}

/// `--zero` is for the from-scratch all-reduces, whose reduce-scatter leaves every rank a shard
/// balanced to within one element: the ring always, recursive halving among a power of two of
/// ranks (`auto` then keeps to the ring).
pub fn check_zero(kind: StrategyKind, stage: u8, ranks: usize) -> Result<()> {
    match (stage, kind) {
        (0, _) | (1..=3, StrategyKind::Ring | StrategyKind::Auto) => Ok(()),
        (1..=3, StrategyKind::Rhd) if crate::plan::rhd::zero_shards_balance(ranks) => Ok(()),
        (1..=3, StrategyKind::Rhd) => Err(Error::usage(format!(
            "--zero {stage} with --strategy rhd on {ranks} ranks: recursive halving leaves the ranks outside its power-of-two group without a shard; launch a power of two of ranks, or use --strategy ring or auto"
        ))),
        (1..=3, _) => Err(Error::usage(format!(
            "--zero {stage} with --strategy {kind}: ZeRO shards the optimizer (and at stage 3 the parameters) along a reduce-scatter and an all-gather, which only the from-scratch all-reduces (ring, rhd, auto) run apart"
        ))),
        (other, _) => Err(Error::usage(format!("--zero {other}: expected 0, 1, 2 or 3"))),
    }
}
