//! Planning apart from moving bytes: what a collective does, computed without MPI, below both
//! the cost model that prices it and the strategies that execute it.
//!
//! - [`shard`]: which part of a count each of n parts owns (`ShardInfo`);
//! - [`ring`]: the ring all-reduce's schedule of chunks;
//! - [`rhd`]: recursive halving and doubling's partners and ranges;
//! - [`buckets`]: which tensors share a bucket, at which offsets;
//! - [`pipeline`]: pipeline parallelism's rank grid, model cuts and per-stage schedules;
//! - [`overlap`]: `--overlap auto`'s trial of the first steps on CPU ranks and its choice;
//! - [`fsdp`]: fully sharded data parallelism's units and their flat layouts;
//! - [`tensor`]: tensor parallelism's rank layout and the cut of each transformer parameter.
//! - [`compat`]: what combines: every option against every layout kind, supported or refused.
//!
//! Each file is pure arithmetic with its unit tests, which run the schedules on in-memory
//! buffers. A new collective's schedule (a pipeline's table of micro-batches per stage, a tree)
//! goes here, beside these, before the strategy that sends its messages.

pub mod buckets;
pub mod compat;
pub mod fsdp;
pub mod overlap;
pub mod pipeline;
pub mod rhd;
pub mod ring;
pub mod shard;
pub mod tensor;
