//! `auto`: each bucket goes to the ring, to recursive halving-doubling or (short buckets) to
//! recursive doubling, whichever the cost model predicts fastest for its size on this layout
//! (as NCCL's tuner picks between ring and tree, and MPICH between its short- and
//! long-message algorithms). Neither algorithm knows this file exists: it packs the buckets, stages them like the
//! others, and hands each one to the chosen algorithm's flat reduction.

use std::ops::Range;

use tch::Tensor;

use crate::cost::{Algorithm, CostModel, Layout};
use crate::element::Dtype;
use crate::error::Result;
use crate::exchange::buckets::Fusion;
use crate::exchange::config::ExchangeConfig;
use crate::exchange::rhd::RhdAllreduce;
use crate::exchange::ring::RingAllreduce;
use crate::exchange::staging::Staging;
use crate::exchange::strategy::{all_reduce_is_identity, allreduce_bus_factor, common_dtype, Checkpointed, DataPath, Described, ExchangeReport, Reduce, ReduceOp, Role, Training};
use crate::exchange::zero::{ShardAlgorithm, ShardedCollectives};
use crate::topology::World;

pub struct Auto {
    ring: RingAllreduce,
    rhd: RhdAllreduce,
    model: CostModel,
    layout: Layout,
    rank: usize,
    path: DataPath,
    fusion: Fusion,
    staging: Staging,
    /// Buckets sent to each algorithm so far (ring, rhd, recursive doubling).
    chosen: [u64; 3],
}

impl Auto {
    pub fn new(world: &World, config: &ExchangeConfig) -> Result<Auto> {
        let ring = RingAllreduce::new(world, config)?;
        Ok(Auto {
            ring,
            rhd: RhdAllreduce::new(world, config)?,
            model: config.cost_model,
            layout: Layout { ranks: world.size as usize, per_node: world.local_size.max(1) as usize },
            rank: world.rank as usize,
            path: DataPath::choose(config.device, config.cuda_aware),
            fusion: Fusion::new(config.bucket_bytes, None),
            staging: Staging::new(),
            chosen: [0; 3],
        })
    }
}

impl ShardedCollectives for Auto {
    /// The model's choice for ZeRO's halves of a bucket of `len` elements, but the ring where
    /// recursive halving would leave ranks without a shard (rank counts that are not powers of
    /// two). Every rank computes the same from the same size and layout; ZeRO keeps the answer
    /// for the bucket (the model's answer changes when the ring leaves shared memory).
    fn choose(&self, len: usize, dtype: Dtype) -> ShardAlgorithm {
        if !crate::plan::rhd::zero_shards_balance(self.layout.ranks) {
            return ShardAlgorithm::Ring;
        }
        // Recursive doubling leaves every rank the whole sum, not a shard: not a candidate.
        match self.model.fastest(&[ring_algorithm(&self.ring), Algorithm::Rhd], self.layout, (len * dtype.size()) as f64) {
            Algorithm::Rhd => ShardAlgorithm::Rhd,
            _ => ShardAlgorithm::Ring,
        }
    }

    fn shard(&self, len: usize, algorithm: ShardAlgorithm) -> Range<usize> {
        match algorithm {
            ShardAlgorithm::Rhd => self.rhd.shard(len, algorithm),
            ShardAlgorithm::Ring => self.ring.shard(len, algorithm),
        }
    }

    fn reduce_scatter(&mut self, buffer: &mut Tensor, dtype: Dtype, op: ReduceOp, algorithm: ShardAlgorithm) -> Result<()> {
        match algorithm {
            ShardAlgorithm::Rhd => {
                self.chosen[1] += 1;
                self.rhd.reduce_scatter(buffer, dtype, op, algorithm)
            }
            ShardAlgorithm::Ring => {
                self.chosen[0] += 1;
                self.ring.reduce_scatter(buffer, dtype, op, algorithm)
            }
        }
    }

    fn all_gather(&mut self, buffer: &mut Tensor, dtype: Dtype, algorithm: ShardAlgorithm) -> Result<()> {
        match algorithm {
            ShardAlgorithm::Rhd => self.rhd.all_gather(buffer, dtype, algorithm),
            ShardAlgorithm::Ring => self.ring.all_gather(buffer, dtype, algorithm),
        }
    }
}

impl Described for Auto {
    fn name(&self) -> &'static str {
        "auto"
    }

    fn bus_factor(&self) -> f64 {
        allreduce_bus_factor(self.layout.ranks)
    }

    fn waits_for(&self) -> String {
        format!("{} or {}", self.ring.waits_for(), self.rhd.waits_for())
    }

    fn report(&self) -> ExchangeReport {
        let mut extra = serde_json::Map::new();
        extra.insert("auto_ring_buckets".into(), self.chosen[0].into());
        extra.insert("auto_rhd_buckets".into(), self.chosen[1].into());
        extra.insert("auto_doubling_buckets".into(), self.chosen[2].into());
        extra.insert("ring_transport".into(), self.ring.transport().into());
        self.staging.report(self.path, extra)
    }
}

impl Reduce for Auto {
    fn all_reduce(&mut self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        if all_reduce_is_identity(self.layout.ranks) {
            return Ok(());
        }
        let dtype = common_dtype(tensors)?;
        let (ring, rhd, model, layout, chosen) = (&mut self.ring, &mut self.rhd, &self.model, self.layout, &mut self.chosen);
        self.staging.reduce_fused(&mut self.fusion, self.path, tensors, |_, bucket| {
            // Every rank computes the same choice from the same size and layout.
            let bytes = (bucket.numel() * dtype.size()) as f64;
            match model.choose(ring_algorithm(ring), layout, bytes) {
                Algorithm::Rhd => {
                    chosen[1] += 1;
                    rhd.reduce_flat(bucket, dtype, op)
                }
                Algorithm::RecursiveDoubling => {
                    chosen[2] += 1;
                    rhd.reduce_flat_doubling(bucket, dtype, op)
                }
                _ => {
                    chosen[0] += 1;
                    ring.reduce_flat(bucket, dtype, op)
                }
            }
        })
    }

    fn finish(&mut self, params: &mut [Tensor]) -> Result<()> {
        self.ring.finish(params)?;
        self.rhd.finish(params)
    }
}

impl Training for Auto {
    fn role(&self) -> Role {
        Role::Worker { index: self.rank, count: self.layout.ranks }
    }
}

impl Checkpointed for Auto {}

/// The ring as it runs now, for the model: through node-shared memory (one node) or over MPI
/// (across nodes, or since its window found no room).
fn ring_algorithm(ring: &RingAllreduce) -> Algorithm {
    if ring.in_shared_memory() { Algorithm::SharedRing } else { Algorithm::Ring }
}
