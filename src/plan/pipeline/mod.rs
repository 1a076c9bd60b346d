//! Pipeline parallelism as data: which rank holds which stage ([`Grid`]), where the model is cut
//! ([`balance`], [`cut_by_replay`], [`cuts_from_list`]), and what each stage does in one training step
//! ([`schedule`]): an ordered list of [`Action`]s that the stage's engine (src/train/pipeline.rs)
//! executes one by one, computed and unit-tested here without MPI.
//!
//! Vocabulary. The model's blocks are cut into `chunks` consecutive pieces; chunk `c` lives on
//! stage `c % P` (Megatron-LM's interleaving: with V virtual stages a stage holds chunks
//! p, p + P, ..., p + (V-1)P; with V = 1 chunk c is stage c). Boundary `b` (1..chunks) lies
//! between chunk b-1 and chunk b: activations cross it forwards, their gradients backwards.
//!
//! The schedules (P stages, M micro-batches):
//! - GPipe (Huang et al. 2019): every forward, then every backward; M micro-batches alive.
//! - 1F1B (PipeDream-Flush, Narayanan et al. 2021): P-1-p warm-up forwards on stage p, then
//!   one forward and one backward in turn, then the remaining backwards; at most P-p alive.
//! - Interleaved 1F1B (Megatron-LM): the same with V chunks per stage, taken P micro-batches
//!   at a time, which divides the bubble by V at the price of V times the messages.
//! - Zero bubble (Qi et al., ICLR 2024) splits each backward in two: B, the gradient of the
//!   chunk's input, which the previous chunk waits for, and W, the weights' gradients, which
//!   nobody waits for and which fill the bubble. ZB-H1 is 1F1B with stage p's W's trailing its
//!   B's by p (the last W's fill the cool-down), at 1F1B's memory: the bubble drops from
//!   (P-1)(F+B+W) to (P-1)(F+B-W) per step. ZB-V holds two chunks per stage in a V (chunk p
//!   down the stages, chunk 2P-1-p back up: stage 0 holds the first and the last), ordered by
//!   [`zb_v_orders`] at 1F1B's memory; its bubble is near zero when F = B = W.
//!
//! Backwards (and W's) run in micro-batch order on every chunk under every schedule, so the
//! gradients accumulate in the same order as one process that sums the micro-batches in turn:
//! the schedule changes when work happens, never the arithmetic.
//!
//! Evaluation runs forwards only ([`forward_schedule`]), over as many micro-batches as the test
//! set makes, holding no more of them per stage than training does ([`peak_held`]); its replay
//! ([`replay_forwards`]) checks that it cannot deadlock.
//!
//! The files, each importing only those listed before it: `shape.rs` the vocabulary (the
//! schedule's kind and shape, the actions, the rank grid); `replay.rs` the replay's engine,
//! which runs given per-stage action lists under a cost model; `schedule.rs` the schedules
//! (ZB-V's chosen by replaying candidates) and their replays; `cuts.rs` where the model is cut;
//! `overlap.rs` which backward makes each chunk's gradients final, and buckets chunk by chunk.

mod cuts;
mod overlap;
mod replay;
mod schedule;
mod shape;

pub use cuts::{balance, chunk_costs, cut_by_replay, cuts_from_list, ranges, BlockCost, REPLAYED_CUTS};
pub use overlap::{final_backwards, segmented_plan, FinalBackward};
pub use replay::{Costs, Replay};
pub use schedule::{forward_schedule, idle_per_busy, messages_per_step, peak_held, replay, replay_with_messages, schedule};
pub use shape::{Action, Grid, Message, ScheduleKind, Shape};
