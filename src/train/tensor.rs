//! Tensor parallelism (`--tensor-parallel T`) in a run: the rank's groups (its tensor-parallel
//! group of T consecutive ranks, and the data-parallel ranks that hold the same part of the
//! model), the group's all-reduce (hpc-train's own ring, rhd or auto, on the group's
//! communicator) behind the model's conjugate operators, and the cutting of the whole model
//! into this rank's part and its gluing back for `--save-weights`.
//!
//! Every rank draws each variable whole from its name (so T = 1 and T = 4 start from the same
//! weights), keeps its part (plan/tensor.rs says which, [`cut_tensor`] cuts it; train/net.rs)
//! and lets the whole go before it draws the next. Layer norms,
//! the embedding and the head stay whole on every rank of a group, and their gradients equal
//! without any exchange in the group: the group's ranks compute them from the same input (the
//! all-reduce after each row-parallel layer gives every rank the same sum, bit for bit) and the
//! same incoming gradient (summed likewise by the copy operator's backward). The data-parallel
//! exchange (`--strategy`) then averages every parameter over the D ranks that hold the same
//! part; under `--zero 1|2|3` it shards each part over them (checkpoints.rs writes a shard of a
//! part as the regions of the whole tensor it is).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::topology::{Color, Communicator};
use tch::Tensor;

use crate::error::{Error, Result};
use crate::exchange::{self, ExchangeConfig, Reduce, ReduceOp};
use crate::model::vit::TensorSplit;
use crate::optim::LayerParts;
use crate::plan::tensor::{vit_split, Layout, Split};
use crate::raw::{self, RegionAllReduce, RegisteredGroup};
use crate::topology::World;

use super::options::TrainArgs;

/// What the group's all-reduces have cost so far (forward and backward, training and
/// evaluation alike; a step reads the difference).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct RegionCounts {
    pub(super) calls: u64,
    pub(super) elements: u64,
    /// The bytes of the tensors reduced, each at its own element size: under bf16 autocast the
    /// activations' all-reduces move 2 bytes an element, not the 4 that were counted (issue 48).
    pub(super) bytes: u64,
    pub(super) time: Duration,
}

impl RegionCounts {
    pub(super) fn since(&self, before: &RegionCounts) -> RegionCounts {
        RegionCounts {
            calls: self.calls - before.calls,
            elements: self.elements - before.elements,
            bytes: self.bytes - before.bytes,
            time: self.time.saturating_sub(before.time),
        }
    }

    /// One all-reduce of `tensor` that took `time`.
    fn add(&mut self, tensor: &Tensor, time: Duration) {
        let elements = tensor.numel() as u64;
        self.calls += 1;
        self.elements += elements;
        self.bytes += elements * tensor.kind().elt_size_in_bytes() as u64;
        self.time += time;
    }

    fn add_counts(&mut self, other: &RegionCounts) {
        self.calls += other.calls;
        self.elements += other.elements;
        self.bytes += other.bytes;
        self.time += other.time;
    }
}

/// The group's all-reduce: a strategy instance on the group's communicator, watched by the
/// watchdog, counted.
struct GroupAllReduce {
    exchange: Box<dyn Reduce>,
    size: i32,
    counts: Arc<Mutex<RegionCounts>>,
}

impl RegionAllReduce for GroupAllReduce {
    fn all_reduce(&mut self, tensor: &mut Tensor) -> Result<()> {
        let started = Instant::now();
        let size = self.size;
        let _watched = crate::watchdog::exchange("the tensor-parallel all-reduce", || format!("the {size} ranks of its tensor-parallel group"));
        self.exchange.all_reduce(std::slice::from_mut(tensor), ReduceOp::Sum)?;
        self.counts.lock().unwrap_or_else(|e| e.into_inner()).add(tensor, started.elapsed());
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.exchange.finish(&mut [])
    }
}

/// This rank's place in the N = D x T layout, its two communicators' worlds, and its group's
/// all-reduce, registered for the model's layers.
pub(super) struct TensorParallel {
    pub(super) layout: Layout,
    pub(super) rank: usize,
    /// The T ranks that compute one replica's layers together: held for the run, as the
    /// group's all-reduce was built on its communicator.
    _group: World,
    /// The D ranks that hold this rank's part: the data-parallel exchange runs on them (with a
    /// pipeline, the stage's replicas among `plane` do).
    pub(super) replicas: World,
    /// The N / T ranks with this rank's place in their groups: with a pipeline, its stages
    /// and replicas (a stage's activations go to the same place in the next stage's group).
    pub(super) plane: World,
    /// The group's all-reduce as `--tp-allreduce` names it, and its bus factor (bytes each rank
    /// sends per byte reduced).
    pub(super) strategy: &'static str,
    pub(super) bus_factor: f64,
    counts: Arc<Mutex<RegionCounts>>,
    /// The training steps' share of the counts: the measured steps' (after warm-up) and the
    /// last step's.
    pub(super) measured: RegionCounts,
    pub(super) measured_steps: u64,
    pub(super) last_step: RegionCounts,
    registered: RegisteredGroup,
}

impl TensorParallel {
    /// Collective over `world`: splits it into groups and replicas, and builds the group's
    /// all-reduce.
    pub(super) fn new(world: &World, args: &TrainArgs, config: &ExchangeConfig) -> Result<TensorParallel> {
        let layout = Layout::new(world.size as usize, args.pipeline.pipeline_stages as usize, args.tensor_parallel as usize).map_err(Error::usage)?;
        let rank = world.rank as usize;
        let split = |color: usize| world.comm.split_by_color_with_key(Color::with_value(color as i32), world.rank).expect("every rank has a colour");
        let group = World::new(split(layout.tensor_group(rank)))?;
        let replicas = World::new(split(layout.data_group(rank)))?;
        let plane = World::new(split(layout.tensor_rank(rank)))?;
        if group.nodes() > 1 && world.is_root() {
            log::warn!(
                "--tensor-parallel {}: a tensor-parallel group spans {} nodes; its all-reduces (4 per encoder layer and step, of batch x tokens x width each) cross the network, where they are slowest. Put whole groups on a node (T at most the ranks per node, and a multiple of nodes' ranks)",
                layout.tensor,
                group.nodes()
            );
        }
        let exchange = exchange::build(args.tp_allreduce.strategy(), &group, config)?;
        let (strategy, bus_factor) = (exchange.name(), exchange.bus_factor());
        let counts = Arc::new(Mutex::new(RegionCounts::default()));
        let reducer = GroupAllReduce { exchange, size: group.size, counts: counts.clone() };
        let registered = raw::register_group(Box::new(reducer), mpi::environment::threading_support());
        Ok(TensorParallel {
            layout,
            rank: layout.tensor_rank(rank),
            _group: group,
            replicas,
            plane,
            strategy,
            bus_factor,
            counts,
            measured: RegionCounts::default(),
            measured_steps: 0,
            last_step: RegionCounts::default(),
            registered,
        })
    }

    /// LARS's view of this rank's parameters (named `names`, in the optimizer's order): which
    /// are its parts of layers cut over the group, and the group's sum of per-layer figures:
    /// the group's own all-reduce (under the watchdog, and counted with the layers' ones),
    /// which gives every rank the same sums, so that the group's whole copies step alike.
    pub(super) fn layer_parts(&self, names: &[String]) -> LayerParts {
        let group = self.registered.group();
        LayerParts {
            cut: names.iter().map(|n| vit_split(n) != Split::Whole).collect(),
            counts_whole: self.rank == 0,
            sum_over_group: Box::new(move |sums: &mut Tensor| group.all_reduce(sums)),
        }
    }

    /// At the run's end, on every rank together: the group's exchange frees its shared
    /// window, which nothing freed before (issue 48).
    pub(super) fn finish(&self) -> Result<()> {
        self.registered.finish()
    }

    pub(super) fn split(&self) -> TensorSplit {
        TensorSplit { size: self.layout.tensor as i64, group: self.registered.group() }
    }

    pub(super) fn counts(&self) -> RegionCounts {
        *self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A training step has ended that began when the counts were `before`.
    pub(super) fn note_step(&mut self, before: &RegionCounts, measured: bool) {
        self.last_step = self.counts().since(before);
        if measured {
            self.measured.add_counts(&self.last_step);
            self.measured_steps += 1;
        }
    }
}

/// The whole tensor from every rank's part, in rank order (the inverse of [`cut_tensor`]):
/// the test of the cut.
#[cfg(test)]
fn glue(parts: &[Tensor], split: Split) -> Result<Tensor> {
    Ok(match split {
        Split::Whole => parts[0].shallow_clone(),
        Split::Columns => Tensor::f_cat(parts, 1)?,
        Split::Rows { parts: blocks } => {
            // Each part is `blocks` blocks (q, k, v) of its rows; the whole is block by block,
            // each block's rows in rank order.
            let rows = parts[0].size()[0] / blocks as i64;
            let mut pieces = Vec::with_capacity(blocks * parts.len());
            for b in 0..blocks as i64 {
                for p in parts {
                    pieces.push(p.f_narrow(0, b * rows, rows)?);
                }
            }
            Tensor::f_cat(&pieces, 0)?
        }
    })
}

#[cfg(test)]
mod tests {
    use super::super::net::cut_tensor;
    use super::*;
    use tch::{Device, Kind};

    /// tp_bytes_sent counted 4 bytes an element whatever was sent: bf16 activations are 2.
    #[test]
    fn the_counts_take_each_tensors_element_size() {
        let mut counts = RegionCounts::default();
        counts.add(&Tensor::zeros([10], (Kind::BFloat16, Device::Cpu)), Duration::from_millis(1));
        counts.add(&Tensor::zeros([5], (Kind::Float, Device::Cpu)), Duration::from_millis(2));
        assert_eq!((counts.calls, counts.elements, counts.bytes), (2, 15, 10 * 2 + 5 * 4));
        let before = counts;
        counts.add(&Tensor::zeros([3], (Kind::Half, Device::Cpu)), Duration::from_millis(1));
        let step = counts.since(&before);
        assert_eq!((step.calls, step.elements, step.bytes, step.time), (1, 3, 6, Duration::from_millis(1)));
        let mut measured = RegionCounts::default();
        measured.add_counts(&step);
        measured.add_counts(&step);
        assert_eq!((measured.calls, measured.bytes), (2, 12));
    }

    #[test]
    fn cutting_then_gluing_gives_the_whole_back() {
        let w = Tensor::arange(12 * 4, (Kind::Float, Device::Cpu)).view([12, 4]);
        for split in [Split::Rows { parts: 3 }, Split::Rows { parts: 1 }, Split::Columns, Split::Whole] {
            for size in [1, 2, 4] {
                let parts: Vec<Tensor> = (0..size).map(|r| cut_tensor(&w, split, r, size).unwrap()).collect();
                assert!(glue(&parts, split).unwrap().equal(&w), "{split:?} {size}");
            }
        }
        // q, k, v rows of rank 1 of 2: rows 2-3, 6-7, 10-11.
        let part = cut_tensor(&w, Split::Rows { parts: 3 }, 1, 2).unwrap();
        let first_column: Vec<f32> = Vec::try_from(&part.select(1, 0)).unwrap();
        assert_eq!(first_column, vec![8.0, 12.0, 24.0, 28.0, 40.0, 44.0]);
    }
}
