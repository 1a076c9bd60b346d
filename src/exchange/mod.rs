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
//!   ring, rhd or auto (wraps them).
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
pub mod horovod;
pub mod options;
pub mod ps;
pub mod rhd;
pub mod ring;
pub mod shared_ring;
pub mod staging;
pub mod strategy;
pub mod zero;

pub use config::{worker_count, ExchangeConfig, PsMode, StrategyKind};
pub use strategy::{Exchange, ReduceOp, Role};

use crate::error::{Error, Result};
use crate::topology::World;

/// Makes the chosen strategy on `world`. Collective over the world's communicator.
pub fn build(kind: StrategyKind, world: &World, config: &ExchangeConfig) -> Result<Box<dyn Exchange>> {
    check_zero(kind, config.zero, world.size as usize)?;
    if config.zero > 0 {
        let sharded: Box<dyn zero::ShardedCollectives> = match kind {
            StrategyKind::Rhd => Box::new(rhd::RhdAllreduce::new(world, config)?),
            StrategyKind::Auto => Box::new(auto::Auto::new(world, config)?),
            _ => Box::new(ring::RingAllreduce::new(world, config)?),
        };
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

/// `--zero` is for the from-scratch all-reduces, whose reduce-scatter leaves every rank a shard
/// balanced to within one element: the ring always, recursive halving among a power of two of
/// ranks (`auto` then keeps to the ring).
pub fn check_zero(kind: StrategyKind, stage: u8, ranks: usize) -> Result<()> {
    match (stage, kind) {
        (0, _) | (1 | 2, StrategyKind::Ring | StrategyKind::Auto) => Ok(()),
        (1 | 2, StrategyKind::Rhd) if crate::plan::rhd::zero_shards_balance(ranks) => Ok(()),
        (1 | 2, StrategyKind::Rhd) => Err(Error::usage(format!(
            "--zero {stage} with --strategy rhd on {ranks} ranks: recursive halving leaves the ranks outside its power-of-two group without a shard; launch a power of two of ranks, or use --strategy ring or auto"
        ))),
        (1 | 2, _) => Err(Error::usage(format!(
            "--zero {stage} with --strategy {kind}: ZeRO shards the optimizer along a reduce-scatter and an all-gather, which only the from-scratch all-reduces (ring, rhd, auto) run apart"
        ))),
        (other, _) => Err(Error::usage(format!("--zero {other}: expected 0, 1 or 2"))),
    }
}
