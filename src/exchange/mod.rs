//! Gradient exchange strategies, all behind [`Exchange`], so that the training loop never knows
//! which one runs.
//!
//! One file per strategy:
//! - [`allreduce`]: the MPI library's own `MPI_Allreduce`, the baseline;
//! - [`ring`]: a ring all-reduce (reduce-scatter then all-gather) on point-to-point calls;
//! - [`ps`]: parameter servers on point-to-point calls, synchronous or asynchronous;
//! - [`horovod`]: a Horovod-style background cycle with negotiation and tensor fusion;
//! - [`rhd`]: recursive halving-doubling (and recursive doubling for short buckets) on
//!   point-to-point calls; [`auto`]: ring, rhd or recursive doubling per bucket, from the cost
//!   model;
//! - [`zero`]: `--zero 1|2`, ZeRO's sharded optimizer on the reduce-scatter and all-gather of
//!   ring, rhd or auto (wraps them).
//!
//! Shared parts: [`buckets`] plans and packs buckets, [`staging`] moves GPU buckets through
//! pinned host memory when MPI cannot read device memory, [`element`] knows the dtypes.

pub mod allreduce;
pub mod auto;
pub mod buckets;
pub mod comm_thread;
pub mod element;
pub mod horovod;
pub mod ps;
pub mod rhd;
pub mod ring;
pub mod shared_ring;
pub mod staging;
pub mod zero;

use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::optim::Sgd;
use crate::topology::World;

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

/// What a reduction produces: the sum over ranks, or the mean.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Mean,
}

/// How bytes get from a tensor to MPI.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DataPath {
    /// Host tensors, handed to MPI in place.
    Host,
    /// GPU tensors copied through pinned host memory (MPI is not CUDA-aware).
    Staged,
    /// GPU pointers handed straight to a CUDA-aware MPI.
    Direct,
}

/// Test hook: `HPC_TRAIN_STAGE_HOST=1` sends host tensors through the staged path (copies into
/// the staging buffers and back), so that the code GPU runs take without a CUDA-aware MPI is
/// exercised on machines without a GPU.
pub const STAGE_HOST_ENV: &str = "HPC_TRAIN_STAGE_HOST";

impl DataPath {
    pub fn choose(device: Device, cuda_aware: bool) -> DataPath {
        match (device, cuda_aware) {
            (Device::Cpu, _) if std::env::var(STAGE_HOST_ENV).is_ok_and(|v| v == "1") => DataPath::Staged,
            (Device::Cpu, _) => DataPath::Host,
            (_, true) => DataPath::Direct,
            (_, false) => DataPath::Staged,
        }
    }

    /// The path for an `MPI_Allreduce`/`MPI_Reduce` of `dtype` values. MPI has no 16-bit float
    /// sum: those run as a user operation, a host function that cannot read device memory, so
    /// a CUDA-aware MPI still gets 16-bit buffers through the host.
    pub fn for_mpi_reduction(self, dtype: element::Dtype) -> DataPath {
        match (self, dtype) {
            (DataPath::Direct, element::Dtype::F16 | element::Dtype::Bf16) => DataPath::Staged,
            (path, _) => path,
        }
    }
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
    /// Resolves `auto` by asking the MPI library (`MPIX_Query_cuda_support`).
    pub fn resolve(self) -> bool {
        match self {
            CudaAware::Yes => true,
            CudaAware::No => false,
            CudaAware::Auto => crate::raw::mpi_cuda_support().unwrap_or(false),
        }
    }
}

/// The role of a rank in training: workers compute gradients on a shard of the data; a
/// dedicated parameter server only serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Worker `index` of `count` (the data is sharded over the workers).
    Worker { index: usize, count: usize },
    Server,
}

/// What a strategy reports about itself for the run log and `runs.jsonl`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ExchangeReport {
    pub data_path: Option<DataPath>,
    /// Strategy-specific figures (staleness for the parameter server, cache hits for Horovod...).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// A gradient-exchange strategy.
pub trait Exchange {
    fn name(&self) -> &'static str;

    /// Bytes on the busiest link per byte of buffer: 2(n-1)/n for an all-reduce (nccl-tests'
    /// convention), so that bus bandwidths of different strategies compare.
    fn bus_factor(&self) -> f64;

    /// Reduces `tensors` element-wise over the ranks, in place (sum or mean).
    fn all_reduce(&mut self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()>;

    /// As [`Exchange::all_reduce`], for a set of tensors that `key` names alike on every rank
    /// and at every step (overlap's bucket index), for strategies that remember tensors between
    /// calls (Horovod's response cache).
    fn all_reduce_keyed(&mut self, _key: usize, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        self.all_reduce(tensors, op)
    }

    /// This rank's role in training.
    fn role(&self) -> Role;

    /// The names of the parameters whose gradients `all_reduce` and `update` are handed, in
    /// that order (`names[i]` names tensor i), for strategies that show them (Horovod's
    /// timeline rows). Called once, after `prepare`.
    fn name_tensors(&mut self, _names: &[String]) {}

    /// Overlap's buckets before each step: `all_reduce_keyed(k, ..)` reduces the gradients of
    /// `plan.buckets[k]`'s parameters (indices into the names of [`Exchange::name_tensors`]).
    fn describe_keys(&mut self, _plan: &crate::plan::buckets::BucketPlan) {}

    /// Whom an exchange on this rank waits for, in words, for the watchdog's message.
    fn waits_for(&self) -> String {
        "every rank".into()
    }

    /// Called once with the parameters before training, on every rank at the same point (a
    /// strategy that plans around the tensors checks here that they fit).
    fn prepare(&mut self, _params: &[Tensor]) -> Result<()> {
        Ok(())
    }

    /// Whether this rank's buffers count in `all_reduce`'s result (dedicated parameter servers'
    /// do not).
    fn contributes(&self) -> bool {
        true
    }

    /// Whether the workers move in lockstep (every update waits for all of them), so that a
    /// per-step agreement between them costs nothing extra. Asynchronous workers must not be
    /// tied together every step.
    fn lockstep(&self) -> bool {
        true
    }

    /// The precision values travel in when it is lower than the buffers' (compression), which
    /// sets how closely results can match.
    fn wire_dtype(&self) -> Option<element::Dtype> {
        None
    }

    /// One training step's update of `params` from the local gradients `grads`: average the
    /// gradients over the workers, then step the optimizer. A parameter server overrides this
    /// (its servers step the optimizer and send weights back).
    fn update(&mut self, params: &mut [Tensor], grads: &mut [Tensor], sgd: &mut Sgd) -> Result<()> {
        self.all_reduce(grads, ReduceOp::Mean)?;
        sgd.step(params, grads)
    }

    /// On a dedicated server rank: serve the workers until they are all done.
    fn serve(&mut self, _params: &mut [Tensor], _sgd: &mut Sgd) -> Result<()> {
        Ok(())
    }

    /// Called by every rank once training ends (workers done, servers released).
    fn finish(&mut self, _params: &mut [Tensor]) -> Result<()> {
        Ok(())
    }

    /// For a checkpoint, called by every worker at the same step (and after `finish` for the
    /// last one): the momentum buffer of every parameter, wherever the optimizer state lives.
    /// The value matters on rank 0, which writes the checkpoint. By default the local
    /// optimizer's, which is the same on every rank for the averaging strategies.
    fn optimizer_state(&mut self, params: &[Tensor], sgd: &Sgd) -> Result<Option<Vec<Tensor>>> {
        Ok(Some(momentum_or_zeros(params, sgd)?))
    }

    /// On resume, on every rank: the momentum buffers of every parameter, from the checkpoint
    /// (the parameters already hold the checkpoint's weights).
    fn restore_optimizer(&mut self, _params: &[Tensor], momentum: Vec<Tensor>, steps: u64, sgd: &mut Sgd) -> Result<()> {
        sgd.restore(momentum.into_iter().map(Some).collect(), steps);
        Ok(())
    }

    /// ZeRO's per-bucket update, when this strategy shards the optimizer (`--zero 1|2`):
    /// overlap hands it each bucket instead of all-reducing it.
    fn zero(&mut self) -> Option<&mut zero::ZeroExchange> {
        None
    }

    /// Optimizer state and gradient bytes this rank holds between steps.
    fn held_bytes(&self, params: &[Tensor], sgd: &Sgd) -> zero::HeldBytes {
        zero::HeldBytes::of(params, sgd)
    }

    fn report(&self) -> ExchangeReport;
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

/// How a rank waits for a peer without holding its core (MPI_Wait would spin, and with overlap
/// that core is the one backward runs on): a few hundred spins, then yielding the core, then
/// sleeps of 20 us between looks.
#[derive(Default)]
pub struct Backoff {
    idle: u32,
}

impl Backoff {
    /// One pause between two looks. Returns false while still spinning (the peer is probably
    /// about to arrive), true after, when a look may be worth more work.
    pub fn pause(&mut self) -> bool {
        self.idle = self.idle.saturating_add(1);
        if self.idle < 256 {
            std::hint::spin_loop();
            return false;
        }
        if self.idle < 1024 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        true
    }
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
    pub ps: ps::PsConfig,
    pub horovod: horovod::HorovodConfig,
    /// What `auto` chooses with.
    pub cost_model: crate::cost::CostModel,
    /// `--zero`: 0 (every rank keeps the whole optimizer state), 1 or 2.
    pub zero: u8,
    /// `--mpi-allreduce`: the MPI call `allreduce` and `horovod` reduce host buffers with.
    pub mpi_allreduce: allreduce::MpiAllreduceCall,
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

/// Makes the chosen strategy on `world`. Collective over the world's communicator.
pub fn build(kind: StrategyKind, world: &World, config: &ExchangeConfig) -> Result<Box<dyn Exchange>> {
    check_zero(kind, config.zero, world.size as usize)?;
    if config.zero > 0 {
        let sharded: Box<dyn zero::ShardedCollectives> = match kind {
            StrategyKind::Rhd => Box::new(rhd::RhdAllreduce::new(world, config)?),
            StrategyKind::Auto => Box::new(auto::Auto::new(world, config)?),
            _ => Box::new(ring::RingAllreduce::new(world, config)?),
        };
        let path = DataPath::choose(config.device, config.cuda_aware);
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

/// The momentum buffers of `sgd` for `params`, zeros before its first step.
pub fn momentum_or_zeros(params: &[Tensor], sgd: &Sgd) -> Result<Vec<Tensor>> {
    let buffers = sgd.momentum_buffers();
    params
        .iter()
        .enumerate()
        .map(|(i, p)| match buffers.get(i) {
            Some(Some(m)) => Ok(m.shallow_clone()),
            _ => Ok(p.f_zeros_like()?),
        })
        .collect()
}

/// All-reduce bus factor for `n` ranks: 2(n-1)/n.
pub fn allreduce_bus_factor(n: usize) -> f64 {
    if n <= 1 {
        0.0
    } else {
        2.0 * (n as f64 - 1.0) / n as f64
    }
}

/// The element type of a set of tensors, which must all share it.
pub fn common_dtype(tensors: &[Tensor]) -> Result<element::Dtype> {
    let kind = tensors.first().map_or(Kind::Float, |t| t.kind());
    if tensors.iter().any(|t| t.kind() != kind) {
        return Err(Error::exchange("exchange", "tensors of one exchange must share a dtype"));
    }
    element::Dtype::of_kind(kind)
        .ok_or_else(|| Error::exchange("exchange", format!("unsupported dtype {kind:?} (f32, f16 or bf16)")))
}

/// Calls `$body` with `$E` bound to the element type of `$dtype`.
#[macro_export]
macro_rules! with_element {
    ($dtype:expr, $E:ident => $body:expr) => {
        match $dtype {
            $crate::exchange::element::Dtype::F32 => {
                type $E = f32;
                $body
            }
            $crate::exchange::element::Dtype::F16 => {
                type $E = half::f16;
                $body
            }
            $crate::exchange::element::Dtype::Bf16 => {
                type $E = half::bf16;
                $body
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(allreduce_bus_factor(1), 0.0);
        assert_eq!(allreduce_bus_factor(2), 1.0);
        assert_eq!(allreduce_bus_factor(4), 1.5);
    }

    #[test]
    fn data_path_follows_device_and_mpi() {
        assert_eq!(DataPath::choose(Device::Cpu, true), DataPath::Host);
        assert_eq!(DataPath::choose(Device::Cuda(0), false), DataPath::Staged);
        assert_eq!(DataPath::choose(Device::Cuda(0), true), DataPath::Direct);
    }

    #[test]
    fn sixteen_bit_mpi_reductions_go_through_the_host() {
        use element::Dtype;
        assert_eq!(DataPath::Direct.for_mpi_reduction(Dtype::F32), DataPath::Direct);
        assert_eq!(DataPath::Direct.for_mpi_reduction(Dtype::F16), DataPath::Staged);
        assert_eq!(DataPath::Direct.for_mpi_reduction(Dtype::Bf16), DataPath::Staged);
        assert_eq!(DataPath::Staged.for_mpi_reduction(Dtype::F16), DataPath::Staged);
        assert_eq!(DataPath::Host.for_mpi_reduction(Dtype::Bf16), DataPath::Host);
    }
}
