//! What the strategies are configured with: the `--strategy` choice, the options every strategy
//! reads ([`ExchangeConfig`]) and each strategy's own ([`PsConfig`], [`HorovodConfig`], ...).
//! One small module that the strategies, `build()` and the training run all import, so that one
//! strategy's settings never make another strategy's file an import. The command-line flags
//! that fill them are in `exchange::options` (strategy groups) and `train::options`.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use tch::{Device, Kind};

use crate::cost::CostModel;
use crate::error::{Error, Result};
use crate::optim::{LrSchedule, OptimizerConfig};

/// The strategies a user can choose.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StrategyKind {
    /// From-scratch ring all-reduce over MPI point-to-point.
    Ring,
    /// From-scratch parameter server over MPI point-to-point.
    Ps,
    /// The MPI library's MPI_Allreduce (the baseline).
    Allreduce,
    /// From-scratch recursive halving-doubling all-reduce over MPI point-to-point.
    Rhd,
    /// Ring or rhd per bucket, whichever the cost model predicts faster.
    Auto,
    /// Horovod-style background cycle, negotiation and tensor fusion over MPI collectives.
    Horovod,
}

impl StrategyKind {
    pub fn name(self) -> &'static str {
        match self {
            StrategyKind::Ring => "ring",
            StrategyKind::Ps => "ps",
            StrategyKind::Allreduce => "allreduce",
            StrategyKind::Horovod => "horovod",
            StrategyKind::Rhd => "rhd",
            StrategyKind::Auto => "auto",
        }
    }
}

impl std::fmt::Display for StrategyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a comma-separated list of strategies (`--strategies ring,ps`).
pub fn parse_strategies(list: &str) -> Result<Vec<StrategyKind>> {
    use clap::ValueEnum;
    let out: Vec<StrategyKind> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| StrategyKind::from_str(s, true).map_err(|_| Error::usage(format!("--strategies: unknown strategy {s:?} (ring, rhd, auto, ps, allreduce, horovod)"))))
        .collect::<Result<_>>()?;
    if out.is_empty() {
        return Err(Error::usage("--strategies: name at least one strategy"));
    }
    Ok(out)
}

/// Options every strategy may read.
#[derive(Clone, Debug)]
pub struct ExchangeConfig {
    pub device: Device,
    pub cuda_aware: bool,
    /// Bucket (fusion) size in bytes; 0 = one exchange per tensor.
    pub bucket_bytes: usize,
    /// Ring segment size in bytes.
    pub segment_bytes: usize,
    /// How the ring's ranks reach each other.
    pub ring_transport: RingTransport,
    pub ps: PsConfig,
    pub horovod: HorovodConfig,
    /// What `auto` chooses with.
    pub cost_model: CostModel,
    /// `--zero`: 0 (every rank keeps the whole optimizer state), 1, 2 or 3.
    pub zero: u8,
    /// `--fsdp-hybrid` (stage 3): shard over each node's ranks, replicate across nodes.
    pub fsdp_hybrid: bool,
    /// `--mpi-allreduce`: the MPI call `allreduce` and `horovod` reduce host buffers with.
    pub mpi_allreduce: MpiAllreduceCall,
}

/// What decides the ranks' roles: how many are dedicated parameter servers.
#[derive(Clone, Debug, Default)]
pub struct RoleOptions {
    /// Parameter servers (for `ps`).
    pub servers: usize,
    /// Every rank is both a worker and a server (`ps --ps-colocate`).
    pub colocate: bool,
}

/// How many ranks compute gradients: all of them, except dedicated parameter servers.
pub fn worker_count(kind: StrategyKind, ranks: usize, roles: &RoleOptions) -> Result<usize> {
    if kind != StrategyKind::Ps || roles.colocate {
        return Ok(ranks);
    }
    if roles.servers == 0 {
        return Err(Error::usage("--servers 0: the parameter server needs at least one server rank"));
    }
    if roles.servers >= ranks {
        return Err(Error::usage(format!(
            "--servers {} with {ranks} rank(s) leaves no worker: launch more ranks, use fewer servers, or --ps-colocate",
            roles.servers
        )));
    }
    Ok(ranks - roles.servers)
}

/// How the ring (`ring`, and `auto` when it picks the ring) moves its chunks between ranks.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingTransport {
    /// Node-shared memory when every rank of the ring is on one node, MPI messages otherwise.
    Auto,
    /// Node-shared memory (an MPI-3 shared window); an error unless every rank is on one node.
    Shm,
    /// MPI point-to-point messages only, as between nodes.
    Mpi,
}

/// `--cuda-aware yes|no|auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CudaAware {
    Yes,
    No,
    Auto,
}

impl CudaAware {
    /// Resolves `auto` by asking the MPI library (see [`crate::mpi_library::cuda_aware`]).
    pub fn resolve(self) -> bool {
        match self {
            CudaAware::Yes => true,
            CudaAware::No => false,
            CudaAware::Auto => crate::mpi_library::cuda_aware(),
        }
    }
}

/// `--mpi-allreduce`: which MPI call reduces host buffers (device buffers always go to the
/// blocking one, see [`crate::raw::all_reduce_in_place_device`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MpiAllreduceCall {
    /// `MPI_Allreduce`, as users of MPI (and Horovod) call it.
    #[default]
    Blocking,
    /// `MPI_Iallreduce` and a wait that yields the core between tests (the call hpc-train's
    /// earlier versions made).
    Nonblocking,
}

impl MpiAllreduceCall {
    pub fn name(self) -> &'static str {
        match self {
            MpiAllreduceCall::Blocking => "blocking",
            MpiAllreduceCall::Nonblocking => "nonblocking",
        }
    }
}

/// `--ps-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PsMode {
    /// Servers average all workers' gradients each step, then update once.
    Sync,
    /// Servers apply each worker's gradient as it arrives.
    Async,
}

#[derive(Clone, Debug)]
pub struct PsConfig {
    pub servers: usize,
    pub colocate: bool,
    pub mode: PsMode,
    /// Rounds a worker's weights may lag behind (async); None: no bound.
    pub max_staleness: Option<u64>,
    /// A server reports a worker that has sent nothing for this long.
    pub timeout: Duration,
    /// The servers' optimizer and its rate per step (the workers' own, see train/setup.rs).
    pub optimizer: OptimizerConfig,
    pub schedule: LrSchedule,
    /// Synchronous servers send their optimizer state to rank 0 after every this many steps.
    pub checkpoint_every: Option<u64>,
    /// The global step training starts from (a resumed run).
    pub first_step: u64,
}

impl Default for PsConfig {
    fn default() -> Self {
        PsConfig {
            servers: 1,
            colocate: false,
            mode: PsMode::Sync,
            max_staleness: None,
            timeout: Duration::from_secs(600),
            optimizer: OptimizerConfig::sgd(0.1, 0.0, 0.0),
            schedule: LrSchedule::constant(0.1),
            checkpoint_every: None,
            first_step: 0,
        }
    }
}

/// `--compression`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    None,
    Fp16,
    Bf16,
}

impl Compression {
    /// The element kind values travel in, when compressed.
    pub fn kind(self) -> Option<Kind> {
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
    /// Response cache entries; 0: no cache (every cycle negotiates through rank 0).
    pub cache_capacity: usize,
    pub compression: Compression,
    /// Asked for (flag or variable); applied only on several nodes, as Horovod does.
    pub hierarchical: bool,
    pub timeline: Option<PathBuf>,
    /// HOROVOD_TIMELINE_MARK_CYCLES: a mark in the timeline at every cycle's start.
    pub timeline_mark_cycles: bool,
    /// HOROVOD_STALL_CHECK_DISABLE turns the stall check off.
    pub stall_check: bool,
    pub stall_warning: Duration,
    /// Test hook: enqueue tensors in a rank-dependent order, a little apart in time.
    pub shuffle_enqueue: bool,
    /// Test hook: this rank holds its last tensor back this long, once (a stall).
    pub test_delay: Option<(usize, Duration)>,
}

/// Horovod's response cache capacity (`HorovodGlobalState::cache_capacity`).
pub const DEFAULT_CACHE_CAPACITY: usize = 1024;

impl Default for HorovodConfig {
    fn default() -> Self {
        HorovodConfig {
            cycle_time: Duration::from_millis(1),
            fusion_threshold: 128 << 20,
            cache_capacity: DEFAULT_CACHE_CAPACITY,
            compression: Compression::None,
            hierarchical: false,
            timeline: None,
            timeline_mark_cycles: false,
            stall_check: true,
            stall_warning: Duration::from_secs(60),
            shuffle_enqueue: false,
            test_delay: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategy_lists_parse() {
        assert_eq!(parse_strategies("ring, ps").unwrap(), vec![StrategyKind::Ring, StrategyKind::Ps]);
        assert!(parse_strategies("ring,magic").is_err());
    }
}
