//! Pipeline parallelism's executor: one stage runs its schedule (plan/pipeline/) action by
//! action, its activations and their gradients travelling as non-blocking MPI messages to the
//! neighbouring stages; then the D ranks that hold the stage average its gradients with the
//! run's exchange and step the optimizer, as a plain step does. Also the pipelined evaluation
//! (forwards only, in micro-batches of training's size).
//!
//! The loss of every micro-batch is its samples' summed loss times D / global samples, as in a
//! plain step, and a stage's gradients accumulate over its micro-batches in micro-batch order:
//! P and M change the order of float additions (D does too), nothing else.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::traits::*;
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Reduction, Tensor};

use crate::error::{Error, Result};
use crate::exchange::staging::{wait_for_stream, HostPool};
use crate::exchange::Training;
use crate::optim::{FiniteCheck, Optimizer};
use crate::overlap::{BucketWork, Overlap, OverlapTimes};
use crate::plan::pipeline::{self, Action, FinalBackward, Message, Shape};
use crate::plan::shard::ShardInfo;
use crate::progress::{Progress, StallProbe};
use crate::raw::TensorMessage;
use crate::topology::World;

use super::action_clock::{ActionClock, Phase, Started, Timed};
use super::collective::gather_strings;
use super::held::HeldBytes;
use super::net::BuffersAsFound;
use super::options::Precision;
use super::stages::{Cut, PipelinePlan};

/// How many steps the timeline keeps (from the first measured step): enough to see the
/// schedule, small enough to load in a browser.
const TIMELINE_STEPS: u64 = 10;

/// The largest message set-up's probe sends (src/progress.rs): an MPI library picks its protocol
/// by size well below this, and the probe need not hold a model's largest activation twice.
const MAX_PROBE_BYTES: usize = 16 << 20;

/// One rank's stage of a pipeline.
pub(super) struct Pipeline {
    pub(super) plan: PipelinePlan,
    pub(super) stage: usize,
    pub(super) replica: usize,
    pub(super) cut: Cut,
    /// This rank's pipeline: P ranks, ranked by stage.
    pub(super) comm: SimpleCommunicator,
    /// The MPI_COMM_WORLD rank of each stage of this pipeline, for the watchdog's messages.
    stage_world_ranks: Vec<i32>,
    /// The D ranks that hold this stage: the exchange's world.
    pub(super) stage_world: World,
    actions: Vec<Action>,
    pub(super) device: Device,
    /// Messages go from and to device memory (CUDA-aware MPI); otherwise through the host.
    cuda_aware: bool,
    recompute: bool,
    /// Each of this stage's chunks' batch-norm buffers (running statistics), by chunk: put back
    /// after a recomputed forward ([`Pipeline::hold_buffers`]).
    chunk_buffers: HashMap<usize, Vec<Tensor>>,
    /// Moves this stage's messages along while it computes (src/progress.rs); None where
    /// set-up's probe found that messages move without their sender, or where the MPI library
    /// gave less than MPI_THREAD_MULTIPLE.
    progress: Option<Arc<Progress>>,
    /// What set-up measured of messages waiting for their sender (src/progress.rs).
    stall: StallProbe,
    pub(super) figures: PipelineFigures,
    /// Times the stage's F, B and W (on a GPU from device events, read at the step's end).
    clock: ActionClock,
    /// Where messages are staged: host buffers, pinned and reused ([`Pipeline::staged`]).
    staging: HostPool,
    /// What this rank read of the dataset, for the record.
    pub(super) data_read: DataRead,
    timeline: Option<Timeline>,
    /// Each chunk's last backward, after which its gradients are final (none under the
    /// zero-bubble schedules): where an overlapped step exchanges the chunk's buckets.
    pub(super) final_backwards: Vec<FinalBackward>,
    /// `--overlap`: the stage's gradient exchange beside each chunk's last backward, its
    /// buckets planned per chunk (set-up builds it; `--overlap auto`'s trial may end it).
    pub(super) overlap: Option<Overlap>,
    /// `--zero 3`: between steps this rank holds its shard of the stage's parameters (the
    /// exchange's one unit), gathered whole before the schedule and each evaluation and let go
    /// after (pipeline_step.rs).
    pub(super) shards_parameters: bool,
}

/// An overlapped step's exchange beside the schedule ([`Overlap`]): the run's exchange and
/// optimizer, the stage's gradients, and where the optimizer steps bucket by bucket, the local
/// gradients' finiteness; the exchange's times add up in `times`.
pub(super) struct StageOverlap<'a> {
    pub(super) overlap: &'a mut Overlap,
    pub(super) grads: &'a mut [Tensor],
    pub(super) exchange: &'a mut dyn Training,
    pub(super) optimizer: &'a mut Optimizer,
    pub(super) finite: Option<&'a mut FiniteCheck>,
    pub(super) times: OverlapTimes,
}

impl StageOverlap<'_> {
    /// [`Overlap::backward_segment`], its times added to the step's.
    fn backward(&mut self, loss: Option<Tensor>, segment: Option<usize>, params: &mut [Tensor]) -> Result<()> {
        let StageOverlap { overlap, grads, exchange, optimizer, finite, times } = self;
        let mut work = BucketWork { params, grads, exchange: &mut **exchange, optimizer, finite: finite.as_deref_mut() };
        let t = overlap.backward_segment(loss, segment, &mut work)?;
        times.backward += t.backward;
        times.exchange += t.exchange;
        times.exposed += t.exposed;
        Ok(())
    }

    /// [`Overlap::finish_segment`]: the buckets left, exchanged now, in the step's sight (all
    /// of their time exposed); how long it took.
    fn finish(&mut self, params: &mut [Tensor]) -> Result<Duration> {
        let StageOverlap { overlap, grads, exchange, optimizer, finite, times } = self;
        let mut work = BucketWork { params, grads, exchange: &mut **exchange, optimizer, finite: finite.as_deref_mut() };
        let took = overlap.finish_segment(&mut work)?;
        times.exchange += took;
        times.exposed += took;
        Ok(took)
    }
}

/// What a rank of a pipeline read of the dataset: the first stage reads images, the last
/// labels, the stages between nothing (the record shows it per rank).
#[derive(Default, Clone, Copy, Debug)]
pub(super) struct DataRead {
    pub(super) train_image_bytes: u64,
    pub(super) train_labels: u64,
    pub(super) test_image_bytes: u64,
    pub(super) test_labels: u64,
}

/// What the measured steps showed on this stage.
#[derive(Default, Clone, Debug)]
pub(super) struct PipelineFigures {
    pub(super) steps: u64,
    /// Forwards and backwards (recomputation included).
    pub(super) compute: Duration,
    /// From the first action to the last send's completion: compute plus waiting.
    pub(super) phase: Duration,
    /// The part of `phase` blocked in MPI for a message to arrive or the sends to complete.
    /// The rest outside `compute` is the messages' host work (buffers, posting, testing).
    pub(super) blocked: Duration,
    /// The most micro-batches (per chunk) whose activations were held at once.
    pub(super) peak_alive: usize,
    /// The most bytes of boundary activations (inputs kept for backward, outputs, and what a
    /// split backward's B keeps for its W) held at once (held.rs says what counts).
    pub(super) peak_boundary_bytes: usize,
    /// The parts of `compute` per chunk of the model (this stage's only; the others stay
    /// zero), indexed by [`FORWARD`], [`BACKWARD`] and [`WEIGHT_GRAD`]: its forwards, its B's
    /// (the inputs' gradients) or unsplit backwards (recomputation included), and its W's (the
    /// weights' gradients, zero-bubble schedules). Under ZB-V a stage's two chunks differ: the
    /// first chunk's B computes nothing and its W is the whole backward.
    pub(super) per_chunk: Vec<[Duration; 3]>,
}

/// The places of [`PipelineFigures::per_chunk`]; an unsplit backward is priced as a B with a W
/// of nothing.
const FORWARD: usize = 0;
const BACKWARD: usize = 1;
const WEIGHT_GRAD: usize = 2;

impl PipelineFigures {
    /// One part of `per_chunk` over all the stage's chunks.
    pub(super) fn stage_total(&self, part: usize) -> Duration {
        self.per_chunk.iter().map(|parts| parts[part]).sum()
    }

    /// The measured idle share of the stage's pipelined phase.
    pub(super) fn bubble(&self) -> f64 {
        if self.phase.is_zero() { 0.0 } else { 1.0 - self.compute.as_secs_f64() / self.phase.as_secs_f64() }
    }
}

/// Chrome-tracing events of this rank.
struct Timeline {
    /// Microseconds since the Unix epoch of rank 0's start, which every rank measures from.
    origin_us: f64,
    events: Vec<String>,
    until_step: u64,
}

impl Timeline {
    fn now_us(&self) -> f64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e6) - self.origin_us
    }
}

impl Pipeline {
    /// Sets up this rank's stage (collective over `world`).
    pub(super) fn new(world: &World, plan: PipelinePlan, cut: Cut, micro_batch: usize, device: Device, cuda_aware: bool, recompute: bool, timeline: bool) -> Result<Pipeline> {
        let rank = world.rank as usize;
        let (stage, replica) = (plan.grid.stage_of(rank), plan.grid.replica_of(rank));
        let comm = world.comm.split_by_color_with_key(Color::with_value(replica as i32), stage as i32).expect("every rank has a colour");
        let stage_comm = world.comm.split_by_color_with_key(Color::with_value(stage as i32), replica as i32).expect("every rank has a colour");
        let stage_world = World::new(stage_comm)?;
        let tag_limit = crate::raw::tag_upper_bound();
        if plan.shape.max_tag() > tag_limit {
            return Err(Error::usage(format!(
                "--micro-batches {} over {} chunks needs message tags up to {}, beyond this MPI's MPI_TAG_UB of {tag_limit}: use fewer micro-batches",
                plan.shape.micro_batches,
                plan.shape.chunks(),
                plan.shape.max_tag()
            )));
        }
        let actions = pipeline::schedule(&plan.shape, stage);
        let final_backwards = pipeline::final_backwards(&actions);
        let stage_world_ranks = crate::topology::world_ranks_of(&comm);
        let mut origin_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e6);
        world.comm.process_at_rank(0).broadcast_into(&mut origin_us);
        let timeline = timeline.then(|| Timeline { origin_us, events: Vec::new(), until_step: 0 });
        // Whether a message moves while its sender computes, measured with the largest one.
        let largest = (1..plan.shape.chunks()).map(|c| cut.input_shape(c).iter().product::<i64>() as usize).max().unwrap_or(0) * micro_batch * 4;
        let stall = crate::progress::sender_stalls(&comm, largest.min(MAX_PROBE_BYTES));
        let progress = if !stall.stalls() {
            None
        } else {
            match Progress::start(&comm) {
                Ok(progress) => Some(Arc::new(progress)),
                Err(why) => {
                    if world.is_root() {
                        log::warn!("pipeline: messages wait for their sender's MPI calls here, and no progress thread can move them ({why}): expect stages to idle behind their neighbours' compute");
                    }
                    None
                }
            }
        };
        if world.is_root() {
            let (mib, ms, hold) = (stall.bytes as f64 / (1 << 20) as f64, stall.arrival_ms, crate::progress::HOLD.as_millis());
            match &progress {
                Some(_) => log::info!("pipeline: a {mib:.2} MiB message reached the next stage {ms:.1} ms into its sender's {hold} ms without MPI calls: a progress thread moves messages along"),
                None if !stall.stalls() => log::info!("pipeline: a {mib:.2} MiB message reached the next stage {ms:.1} ms into its sender's {hold} ms without MPI calls: no progress thread needed"),
                None => {}
            }
        }
        Ok(Pipeline {
            plan,
            stage,
            replica,
            cut,
            comm,
            stage_world_ranks,
            stage_world,
            actions,
            device,
            cuda_aware,
            recompute,
            chunk_buffers: HashMap::new(),
            progress,
            stall,
            figures: PipelineFigures { per_chunk: vec![[Duration::ZERO; 3]; plan.shape.chunks()], ..PipelineFigures::default() },
            clock: ActionClock::new(device),
            staging: HostPool::default(),
            data_read: DataRead::default(),
            timeline,
            final_backwards,
            overlap: None,
            shards_parameters: false,
        })
    }

    /// Each of the stage's parameters' segment for [`Overlap::with_segments`] (its chunk's
    /// place among the chunks' last backwards), from its name (`block_of`: the block that
    /// declares each variable); and the number of segments. None under the split schedules,
    /// whose chunks have no last unsplit backward.
    pub(super) fn param_segments(&self, param_names: &[String], block_of: &HashMap<String, usize>) -> Option<(Vec<usize>, usize)> {
        let segment_of = param_names
            .iter()
            .map(|name| {
                let block = block_of.get(name).copied();
                let chunk = self.cut.chunks.iter().position(|blocks| block.is_some_and(|b| blocks.contains(&b)));
                let chunk = chunk.unwrap_or_else(|| panic!("parameter {name} of this stage is in no chunk of the cut"));
                self.final_backwards.iter().find(|f| f.chunk == chunk).map(|f| f.segment)
            })
            .collect::<Option<Vec<usize>>>()?;
        Some((segment_of, self.final_backwards.len()))
    }

    pub(super) fn shape(&self) -> &Shape {
        &self.plan.shape
    }

    /// Takes the stage's buffers (`buffers`, by name) into the chunks that hold them
    /// (`block_of`: the block that declares each variable), for --recompute: a recomputed
    /// forward must not count in batch norm's running statistics a second time.
    pub(super) fn hold_buffers(&mut self, buffers: &[(String, Tensor)], block_of: &HashMap<String, usize>) {
        for (name, buffer) in buffers {
            let block = block_of.get(name).copied();
            let chunk = self.cut.chunks.iter().position(|blocks| block.is_some_and(|b| blocks.contains(&b)));
            let chunk = chunk.unwrap_or_else(|| panic!("buffer {name} of this stage is in no chunk of the cut"));
            self.chunk_buffers.entry(chunk).or_default().push(buffer.shallow_clone());
        }
    }

    /// Whether this stage holds the first chunk, which takes the images.
    pub(super) fn first_stage(&self) -> bool {
        self.shape().stage_of(0) == self.stage
    }

    /// What this stage reads of its samples: images on the first, labels on the last.
    pub(super) fn data_parts(&self) -> crate::data::loader::Parts {
        crate::data::loader::Parts::of_stage(self.stage, self.shape().loss_stage())
    }

    /// Whether this stage holds the last chunk, which computes the loss (the last stage; the
    /// first under ZB-V, whose chunks come back up).
    pub(super) fn last_stage(&self) -> bool {
        self.shape().loss_stage() == self.stage
    }

    /// Whether messages go through host memory from a GPU: then in pinned, reused buffers of
    /// `staging`.
    fn staged(&self) -> bool {
        self.device.is_cuda() && self.message_device() == Device::Cpu
    }

    /// A received message on the stage's device; a staging buffer goes back to the pool (the
    /// blocking copy out of it is done).
    fn arrived(&mut self, message: Tensor) -> Result<Tensor> {
        let on_device = message.f_to_device(self.device)?;
        if self.staged() {
            self.staging.give(message);
        }
        Ok(on_device)
    }

    /// `t`'s elements for a message on `on`: a staging buffer of the pool where messages are
    /// staged, else `t` itself where it is contiguous on `on`, else a copy.
    fn for_message(&mut self, t: &Tensor, on: Device) -> Result<Tensor> {
        if self.staged() {
            return self.staging.stage(t);
        }
        Ok(t.f_to_device(on)?.f_contiguous()?)
    }

    /// Where messages live: the device with CUDA-aware MPI, else the host.
    pub(super) fn message_device(&self) -> Device {
        if self.device.is_cuda() && self.cuda_aware { self.device } else { Device::Cpu }
    }

    pub(super) fn peer(&self, chunk: usize) -> i32 {
        self.shape().stage_of(chunk) as i32
    }

    /// Whether `stage` of the pipeline is this rank's own: ZB-V's two chunks at the turn of
    /// the V, whose boundary needs no message.
    fn is_this_stage(&self, stage: i32) -> bool {
        stage as usize == self.stage
    }

    /// `stage` of this pipeline as the watchdog names it: "stage 0 (world rank 4)".
    pub(super) fn stage_name(&self, stage: i32) -> String {
        format!("stage {stage} (world rank {})", self.stage_world_ranks.get(stage as usize).copied().unwrap_or(-1))
    }

    /// Watches a wait of this stage for `what` (a message, naming its peer with
    /// [`Pipeline::stage_name`]) until the guard is dropped: a stalled neighbour or a cut link
    /// then ends the job within --exchange-timeout-s, saying which stage waited for what.
    pub(super) fn waiting(&self, what: impl FnOnce() -> String) -> crate::watchdog::ExchangeGuard {
        crate::watchdog::waiting(|| format!("pipeline stage {}", self.stage), what)
    }

    /// Puts what ran from `start_us` until now on the timeline.
    fn event(&mut self, step: u64, name: String, category: &str, start_us: f64) {
        let end = self.now_us();
        self.span(step, name, category, start_us, end - start_us);
    }

    fn span(&mut self, step: u64, name: String, category: &str, start_us: f64, duration_us: f64) {
        if let Some(t) = &mut self.timeline {
            if step < t.until_step {
                t.events.push(format!(
                    r#"{{"name":"{name}","cat":"{category}","ph":"X","ts":{start_us:.1},"dur":{duration_us:.1},"pid":{},"tid":{}}}"#,
                    self.replica,
                    self.stage
                ));
            }
        }
    }

    /// Ends a compute action begun with `self.clock.start`: counted at once on CPU ranks, at the
    /// step's end on a GPU ([`ActionClock`]).
    #[allow(clippy::too_many_arguments)]
    fn stop_action(&mut self, began: Started, phase: Phase, chunk: usize, label: impl FnOnce() -> String, step: u64, measured: bool, compute: &mut Duration) -> Result<()> {
        if let Some(timed) = self.clock.stop(began, phase, chunk, label)? {
            self.count_action(timed, step, measured, compute);
        }
        Ok(())
    }

    /// A timed action into the step's compute, the figures (of a measured step) and the
    /// timeline.
    fn count_action(&mut self, timed: Timed, step: u64, measured: bool, compute: &mut Duration) {
        *compute += timed.took;
        if measured {
            let part = match timed.phase {
                Phase::Forward => FORWARD,
                Phase::Backward | Phase::InputGrad => BACKWARD,
                Phase::WeightGrad => WEIGHT_GRAD,
            };
            self.figures.per_chunk[timed.chunk][part] += timed.took;
        }
        let category = if timed.phase == Phase::Forward { "forward" } else { "backward" };
        self.span(step, timed.label, category, timed.start_us, timed.took.as_secs_f64() * 1e6);
    }

    /// The buckets overlap's last backward left, exchanged now (on the timeline); how long it
    /// took.
    fn exchange_left(&mut self, overlap: &mut StageOverlap, params: &mut [Tensor], step: u64) -> Result<Duration> {
        if !overlap.overlap.has_pending() {
            return Ok(Duration::ZERO);
        }
        let start = self.now_us();
        let took = overlap.finish(params)?;
        self.event(step, "exchange".into(), "exchange", start);
        Ok(took)
    }

    /// A send was posted: the progress thread, where there is one, probes soon.
    fn note_sent(&self) {
        if let Some(progress) = &self.progress {
            progress.sent();
        }
    }

    fn now_us(&self) -> f64 {
        self.timeline.as_ref().map_or(0.0, Timeline::now_us)
    }

    /// Starts the timeline's window at the first measured step.
    pub(super) fn start_timeline(&mut self, first_measured: u64) {
        if let Some(t) = &mut self.timeline {
            t.until_step = first_measured + TIMELINE_STEPS;
        }
    }

    /// Runs one step's schedule over `n` samples (split into the micro-batches); returns the
    /// summed loss of the samples (on the last stage; 0 elsewhere). An injected forward
    /// failure (`faults`) fails the stage's last forward, with messages in flight.
    ///
    /// With `overlap`, the stage's gradients are averaged over its replicas (and with the
    /// optimizer stepped bucket by bucket, applied) beside the schedule: each chunk's buckets
    /// beside its last backward ([`FinalBackward`]), what is left after it (its input gradient
    /// sent upstream first) beside the next backward, or before the next forward or the end.
    ///
    /// On an error the messages still in flight are abandoned, not waited for (see
    /// `TensorMessage`'s drop): the error reaches the job's abort at once.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_schedule(
        &mut self,
        chunks: &[(usize, nn::FuncT<'static>)],
        params: &mut [Tensor],
        n: usize,
        images: Option<&Tensor>,
        labels: Option<&Tensor>,
        factor: f64,
        smoothing: f64,
        precision: Precision,
        step: u64,
        measured: bool,
        faults: &super::step_faults::StepFaults,
        mut overlap: Option<&mut StageOverlap<'_>>,
    ) -> Result<f64> {
        let shape = *self.shape();
        let micro = ShardInfo::all(n, shape.micro_batches);
        let last = shape.chunks() - 1;
        let module = |c: usize| &chunks.iter().find(|(i, _)| *i == c).expect("the schedule only names this stage's chunks").1;
        let on = self.message_device();
        let mut inputs: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut outputs: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut receives: HashMap<(Message, usize, usize), Inbound> = HashMap::new();
        // Each send with the stage it goes to (for the watchdog's message).
        let mut sends: Vec<(TensorMessage, i32)> = Vec::new();
        let last_forward = self.actions.iter().rposition(|a| matches!(a, Action::Forward { .. }));
        // A split backward's B leaves, per (micro-batch, chunk), the input's gradient to send
        // and what its W needs.
        let mut input_grads: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut deferred: HashMap<(usize, usize), DeferredWeights> = HashMap::new();
        let mut losses: Vec<Tensor> = Vec::new();
        let (mut compute, mut alive, mut held) = (Duration::ZERO, 0usize, HeldBytes::default());
        // Time blocked in MPI waiting for a message to arrive or the step's sends to complete.
        let mut blocked = Duration::ZERO;
        // Overlap's buckets exchanged between actions (not beside a backward): outside the
        // schedule's phase, as the exchange after the schedule is without overlap.
        let mut exchanged = Duration::ZERO;
        // Sends in flight move on while this stage computes; the thread rests between steps.
        let progress = self.progress.clone();
        let _progress = progress.as_deref().map(Progress::active);
        let started = Instant::now();
        self.clock.begin_step(self.now_us())?;
        let loss_of = |logits: &Tensor, m: usize| -> Result<Tensor> {
            let y = labels.expect("the last stage has the labels").f_narrow(0, micro[m].offset as i64, micro[m].len as i64)?;
            Ok(logits.f_cross_entropy_loss::<Tensor>(&y, None, Reduction::Sum, -100, smoothing)?.f_to_kind(Kind::Float)?)
        };
        for index in 0..self.actions.len() {
            let action = self.actions[index];
            if let (Some(ov), Action::Forward { .. }) = (overlap.as_deref_mut(), action) {
                // Buckets a backward left, before a forward (nothing runs beside it here).
                exchanged += self.exchange_left(ov, params, step)?;
            }
            match action {
                Action::ReceiveActivation { micro: m, chunk: c } | Action::ReceiveGradient { micro: m, chunk: c } => {
                    if micro[m].len == 0 {
                        continue;
                    }
                    let (kind, sample_shape, from, boundary) = match action {
                        Action::ReceiveActivation { .. } => (Message::Activation, self.cut.input_shape(c).to_vec(), self.peer(c - 1), c),
                        _ => (Message::Gradient, self.cut.output_shape(c).to_vec(), self.peer(c + 1), c + 1),
                    };
                    if self.is_this_stage(from) {
                        continue; // handed over by this stage's send (Inbound::Local)
                    }
                    let size: Vec<i64> = std::iter::once(micro[m].len as i64).chain(sample_shape).collect();
                    let buffer = if self.staged() { self.staging.take(&size, Kind::Float, self.device)? } else { Tensor::f_empty(size.as_slice(), (Kind::Float, on))? };
                    // SAFETY: a new tensor (or a pool's host buffer given back after its copy to
                    // the device) with no other handle, made on this thread's current stream,
                    // whose queued kernels `receive` waits for on a device; the message owns it
                    // until waited for.
                    let message = unsafe { TensorMessage::receive(buffer, &self.comm, from, shape.tag(kind, m, boundary))? };
                    receives.insert((kind, m, c), Inbound::Message(message));
                }
                Action::Forward { micro: m, chunk: c } => {
                    if faults.forward_fails() && Some(index) == last_forward {
                        return Err(faults.forward_error());
                    }
                    if micro[m].len == 0 {
                        continue;
                    }
                    let x = if c == 0 {
                        images.expect("the first stage has the images").f_narrow(0, micro[m].offset as i64, micro[m].len as i64)?
                    } else {
                        match receives.remove(&(Message::Activation, m, c)).expect("the schedule posts every receive before its use") {
                            Inbound::Local(mut x) => x.f_requires_grad_(true)?,
                            Inbound::Message(message) => {
                                let waited = self.now_us();
                                let from = self.peer(c - 1);
                                let watched = self.waiting(|| format!("the activation of micro-batch {m} from {}", self.stage_name(from)));
                                let since = Instant::now();
                                let arrived = message.wait()?;
                                blocked += since.elapsed();
                                let x = self.arrived(arrived)?.f_requires_grad_(true)?;
                                drop(watched);
                                self.event(step, format!("wait activation {m}"), "wait", waited);
                                x
                            }
                        }
                    };
                    let began = self.clock.start(self.now_us())?;
                    // The chunk's forward and (on the last) the loss under the precision's
                    // autocast, as a plain step computes them.
                    let out = precision.training_forward(self.device, || {
                        let out = if self.recompute { tch::no_grad(|| module(c).forward_t(&x, true)) } else { module(c).forward_t(&x, true) };
                        if c != last {
                            return Ok(out);
                        }
                        let loss = loss_of(&out, m)?;
                        losses.push(loss.f_detach()?);
                        Ok(loss.f_mul_scalar(factor)?)
                    })?;
                    self.stop_action(began, Phase::Forward, c, || format!("forward {m} (chunk {c})"), step, measured, &mut compute)?;
                    held.forward(m, c, tensor_bytes(&x), tensor_bytes(&out));
                    outputs.insert((m, c), out);
                    inputs.insert((m, c), x);
                    alive += 1;
                    if measured {
                        self.figures.peak_alive = self.figures.peak_alive.max(alive);
                    }
                }
                Action::SendActivation { micro: m, chunk: c } => {
                    if micro[m].len == 0 {
                        continue;
                    }
                    let out = if self.recompute { outputs.remove(&(m, c)).expect("sent after its forward") } else { outputs[&(m, c)].shallow_clone() };
                    if self.recompute {
                        held.output_sent(m, c);
                    }
                    // In f32 whatever autocast made the output (the receiver's buffer is f32):
                    // a 16-bit output goes over and back exactly, and the next chunk's first
                    // autocast op casts it down again as one process would not need to.
                    let to = self.peer(c + 1);
                    if self.is_this_stage(to) {
                        // The turn of ZB-V's V: the next chunk is this stage's. It takes a copy,
                        // as a message would give it, in the device's memory.
                        let x = out.f_detach()?.f_to_kind(Kind::Float)?;
                        let x = if raw_shares_storage(&x, &out) { x.copy() } else { x };
                        receives.insert((Message::Activation, m, c + 1), Inbound::Local(x));
                        continue;
                    }
                    let payload = self.for_message(&out.f_detach()?.f_to_kind(Kind::Float)?, on)?;
                    let payload = if raw_shares_storage(&payload, &out) { payload.copy() } else { payload };
                    // A device buffer reaches MPI once the kernels that write it are done (the
                    // stream's, not the whole device's); a host copy is done when made.
                    wait_for_stream(payload.device())?;
                    // SAFETY: `payload` is a fresh copy (cloned when detach and contiguous kept
                    // the output's storage, which autograd may hold), written by nothing else.
                    sends.push((unsafe { TensorMessage::send(payload, &self.comm, to, shape.tag(Message::Activation, m, c + 1))? }, to));
                    self.note_sent();
                }
                Action::Backward { micro: m, chunk: c } => {
                    // Where this is the chunk's last backward, the segment whose buckets it completes.
                    let segment = self.final_backwards.iter().find(|f| f.action == index).map(|f| f.segment).filter(|_| overlap.is_some());
                    if micro[m].len == 0 {
                        if let (Some(ov), Some(_)) = (overlap.as_deref_mut(), segment) {
                            // An empty last micro-batch: the chunk's gradients are final already.
                            ov.backward(None, segment, params)?;
                        }
                        continue;
                    }
                    let gradient = self.wait_gradient(&mut receives, m, c, step, &mut blocked)?;
                    let began = self.clock.start(self.now_us())?;
                    let x = inputs.get(&(m, c)).expect("backward after forward");
                    let (out, found) = if self.recompute {
                        // The recomputed forward updates batch norm's running statistics as the
                        // first one did: the chunk's buffers are put back as it found them after
                        // backward (which may read what batch norm saved of them), as --zero 3's
                        // units do (fsdp.rs), so that they count each micro-batch once.
                        let found = BuffersAsFound::take(self.chunk_buffers.get(&c).map_or(&[][..], Vec::as_slice))?;
                        let out = precision.training_forward(self.device, || {
                            let out = module(c).forward_t(x, true);
                            Ok(if c == last { loss_of(&out, m)?.f_mul_scalar(factor)? } else { out })
                        })?;
                        (out, Some(found))
                    } else {
                        (outputs.remove(&(m, c)).expect("backward after forward"), None)
                    };
                    // On overlap's thread where it completes a segment or buckets are left to
                    // exchange beside it; else here.
                    match overlap.as_deref_mut().filter(|ov| segment.is_some() || ov.overlap.has_pending()) {
                        Some(ov) => ov.backward(Some(backward_loss(&out, gradient.as_ref())?), segment, params)?,
                        None => backward_from(&out, gradient.as_ref())?,
                    }
                    if let Some(found) = found {
                        found.put_back()?;
                    }
                    self.stop_action(began, Phase::Backward, c, || format!("backward {m} (chunk {c})"), step, measured, &mut compute)?;
                    held.backward(m, c);
                    alive -= 1;
                    if c == 0 {
                        drop(inputs.remove(&(m, c)).expect("held"));
                    }
                }
                Action::BackwardInput { micro: m, chunk: c } => {
                    if micro[m].len == 0 {
                        continue;
                    }
                    let gradient = self.wait_gradient(&mut receives, m, c, step, &mut blocked)?;
                    let began = self.clock.start(self.now_us())?;
                    let out = outputs.remove(&(m, c)).expect("backward after forward");
                    let for_weights = if c == 0 {
                        // The first chunk's input is the images: there is no input gradient
                        // to compute, and its whole backward is the W, from the output and its
                        // gradient, both kept until then.
                        drop(inputs.remove(&(m, c)).expect("held"));
                        let kept = DeferredWeights::Whole { out, gradient };
                        let bytes = kept.bytes();
                        deferred.insert((m, c), kept);
                        bytes
                    } else {
                        let x = &inputs[&(m, c)];
                        let (dx, kept) = crate::raw::backward_input(&out, gradient.as_ref(), x, params)?;
                        input_grads.insert((m, c), dx);
                        let kept = DeferredWeights::Graph(kept);
                        let bytes = kept.bytes();
                        deferred.insert((m, c), kept);
                        bytes
                    };
                    held.input_grad(m, c, for_weights);
                    self.stop_action(began, Phase::InputGrad, c, || format!("B {m} (chunk {c})"), step, measured, &mut compute)?;
                }
                Action::BackwardWeight { micro: m, chunk: c } => {
                    if micro[m].len == 0 {
                        continue;
                    }
                    let began = self.clock.start(self.now_us())?;
                    match deferred.remove(&(m, c)).expect("W after its B") {
                        DeferredWeights::Graph(kept) => crate::raw::backward_weight(kept)?,
                        DeferredWeights::Whole { out, gradient } => backward_from(&out, gradient.as_ref())?,
                    }
                    self.stop_action(began, Phase::WeightGrad, c, || format!("W {m} (chunk {c})"), step, measured, &mut compute)?;
                    held.weight_grad(m, c);
                    alive -= 1;
                }
                Action::SendGradient { micro: m, chunk: c } => {
                    if micro[m].len == 0 {
                        continue;
                    }
                    let x = inputs.remove(&(m, c)).expect("sent after its backward");
                    held.gradient_sent(m, c);
                    // A split backward's B made the gradient apart; an unsplit one left it in x.
                    let grad = match input_grads.remove(&(m, c)) {
                        Some(dx) => dx,
                        None => x.grad(),
                    };
                    let to = self.peer(c - 1);
                    if self.is_this_stage(to) {
                        // The turn of the V: the gradient stays here, where nothing else holds it.
                        receives.insert((Message::Gradient, m, c - 1), Inbound::Local(grad));
                        continue;
                    }
                    let payload = self.for_message(&grad, on)?;
                    let payload = if raw_shares_storage(&payload, &grad) { payload.copy() } else { payload };
                    wait_for_stream(payload.device())?;
                    // SAFETY: a fresh copy of the input's gradient, which nothing else writes.
                    sends.push((unsafe { TensorMessage::send(payload, &self.comm, to, shape.tag(Message::Gradient, m, c))? }, to));
                    self.note_sent();
                }
            }
            // Completed sends let go of their buffers; testing also drives MPI's progress.
            let mut still = Vec::with_capacity(sends.len());
            for (mut s, to) in sends.drain(..) {
                if !s.test()? {
                    still.push((s, to));
                } else if self.staged() {
                    self.staging.give(s.wait()?);
                }
            }
            sends = still;
        }
        if let Some(ov) = overlap {
            exchanged += self.exchange_left(ov, params, step)?;
        }
        let waited = self.now_us();
        let since = Instant::now();
        if !sends.is_empty() {
            let mut peers: Vec<i32> = sends.iter().map(|(_, to)| *to).collect();
            peers.dedup();
            let _watched = self.waiting(|| format!("its sends of step {step} to {} to complete", peers.iter().map(|&p| self.stage_name(p)).collect::<Vec<_>>().join(" and ")));
            for (s, _) in sends {
                let sent = s.wait()?;
                if self.staged() {
                    self.staging.give(sent);
                }
            }
        }
        blocked += since.elapsed();
        self.event(step, "wait sends".into(), "wait", waited);
        // On a GPU the actions' device times, now that their kernels are done.
        for timed in self.clock.finish()? {
            self.count_action(timed, step, measured, &mut compute);
        }
        if measured {
            self.figures.peak_boundary_bytes = self.figures.peak_boundary_bytes.max(held.peak());
            self.figures.steps += 1;
            self.figures.compute += compute;
            self.figures.phase += started.elapsed().saturating_sub(exchanged);
            self.figures.blocked += blocked;
        }
        let mut loss_sum = 0.0;
        for l in &losses {
            loss_sum += l.f_double_value(&[])?;
        }
        Ok(loss_sum)
    }

    /// Evaluation's forward-only schedule (plan/pipeline/'s `forward_schedule`) over the
    /// micro-batches `micro` (the same sample ranges on every stage of the pipeline): chunk 0
    /// takes `input(m)` (the first stage reads the images), the last chunk's logits go to
    /// `score(m, logits)` (the last stage holds the labels). Forwards run with `train` false
    /// (batch norm's running statistics: micro-batching changes no value) and build no graph
    /// (the caller runs this under no_grad). Before a forward whose output it sends, the stage
    /// waits for its oldest send while as many are in flight as training's schedule holds
    /// micro-batches here ([`pipeline::peak_held`]), so evaluation holds no more than training.
    ///
    /// The test set takes more micro-batches than a step: their tags repeat every M
    /// micro-batches. MPI's non-overtaking order pairs them right: the sender sends a
    /// boundary's messages in micro-batch order and the receiver posts its receives in that
    /// order.
    pub(super) fn run_forwards(
        &self,
        chunks: &[(usize, nn::FuncT<'static>)],
        micro: &[ShardInfo],
        mut input: impl FnMut(usize) -> Result<Tensor>,
        mut score: impl FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<()> {
        let shape = *self.shape();
        let last = shape.chunks() - 1;
        let module = |c: usize| &chunks.iter().find(|(i, _)| *i == c).expect("the schedule only names this stage's chunks").1;
        let tag = |m: usize, boundary: usize| shape.tag(Message::Activation, m % shape.micro_batches, boundary);
        let window = pipeline::peak_held(&shape, self.stage);
        let on = self.message_device();
        let mut receives: HashMap<(usize, usize), Inbound> = HashMap::new();
        let mut outputs: HashMap<(usize, usize), Tensor> = HashMap::new();
        // Sends in flight, oldest first, with the micro-batch and stage they go to.
        let mut sends: std::collections::VecDeque<(TensorMessage, usize, i32)> = std::collections::VecDeque::new();
        let _progress = self.progress.as_deref().map(Progress::active);
        for action in pipeline::forward_schedule(&shape, self.stage, micro.len()) {
            match action {
                Action::ReceiveActivation { micro: m, chunk: c } => {
                    if self.is_this_stage(self.peer(c - 1)) {
                        continue; // handed over by this stage's send (Inbound::Local)
                    }
                    let size: Vec<i64> = std::iter::once(micro[m].len as i64).chain(self.cut.input_shape(c).iter().copied()).collect();
                    let buffer = Tensor::f_empty(size.as_slice(), (Kind::Float, on))?;
                    // SAFETY: a new tensor with no other handle, made on this thread's current
                    // stream, whose queued kernels `receive` waits for on a device; the message
                    // owns it until waited for.
                    let message = unsafe { TensorMessage::receive(buffer, &self.comm, self.peer(c - 1), tag(m, c))? };
                    receives.insert((m, c), Inbound::Message(message));
                }
                Action::Forward { micro: m, chunk: c } => {
                    if c < last {
                        while sends.len() >= window {
                            let (send, sent, to) = sends.pop_front().expect("the window is at least 1");
                            let _watched = self.waiting(|| format!("its evaluation's activations of micro-batch {sent} to reach {}", self.stage_name(to)));
                            let _sent = send.wait()?;
                        }
                    }
                    let x = if c == 0 {
                        input(m)?
                    } else {
                        match receives.remove(&(m, c)).expect("the schedule posts every receive before its use") {
                            Inbound::Local(x) => x,
                            Inbound::Message(message) => {
                                let from = self.peer(c - 1);
                                let _watched = self.waiting(|| format!("the evaluation's activations of micro-batch {m} (test samples {}..{}) from {}", micro[m].offset, micro[m].end(), self.stage_name(from)));
                                message.wait()?.f_to_device(self.device)?
                            }
                        }
                    };
                    let y = module(c).forward_t(&x, false);
                    if c == last {
                        score(m, &y)?;
                    } else {
                        outputs.insert((m, c), y);
                    }
                }
                Action::SendActivation { micro: m, chunk: c } => {
                    let y = outputs.remove(&(m, c)).expect("sent after its forward");
                    let to = self.peer(c + 1);
                    if self.is_this_stage(to) {
                        // In f32, as the receive buffer of a message would hold it.
                        receives.insert((m, c + 1), Inbound::Local(y.f_to_kind(Kind::Float)?));
                        continue;
                    }
                    let payload = y.f_to_device(on)?.f_contiguous()?;
                    wait_for_stream(payload.device())?;
                    // SAFETY: the forward's output (no graph under no_grad) or its copy, which
                    // nothing else holds or writes: `y` is dropped here.
                    sends.push_back((unsafe { TensorMessage::send(payload, &self.comm, to, tag(m, c + 1))? }, m, to));
                    self.note_sent();
                }
                other => unreachable!("evaluation's schedule holds no {other:?}"),
            }
            // Completed sends let go of their buffers; testing also drives MPI's progress.
            let mut still = std::collections::VecDeque::with_capacity(sends.len());
            for (mut send, m, to) in sends.drain(..) {
                if !send.test()? {
                    still.push_back((send, m, to));
                }
            }
            sends = still;
        }
        for (send, m, to) in sends {
            let _watched = self.waiting(|| format!("its evaluation's activations of micro-batch {m} to reach {}", self.stage_name(to)));
            let _sent = send.wait()?;
        }
        Ok(())
    }

    /// The Chrome trace of every rank, written by rank 0 (collective over `world`).
    pub(super) fn write_timeline(&self, world: &World, path: &std::path::Path) -> Result<()> {
        let mine = self.timeline.as_ref().map(|t| t.events.join(",\n")).unwrap_or_default();
        let all = gather_strings(&world.comm, &mine);
        if world.is_root() {
            let mut names = Vec::new();
            for rank in 0..world.size as usize {
                let (d, p) = (self.plan.grid.replica_of(rank), self.plan.grid.stage_of(rank));
                names.push(format!(r#"{{"name":"thread_name","ph":"M","pid":{d},"tid":{p},"args":{{"name":"stage {p} (rank {rank})"}}}}"#));
                if p == 0 {
                    names.push(format!(r#"{{"name":"process_name","ph":"M","pid":{d},"args":{{"name":"pipeline {d}"}}}}"#));
                }
            }
            let body: Vec<&str> = names.iter().map(String::as_str).chain(all.iter().map(String::as_str).filter(|s| !s.is_empty())).collect();
            let text = format!("{{\"traceEvents\":[\n{}\n]}}\n", body.join(",\n"));
            let tmp = path.with_extension("json.tmp");
            crate::results::replace_via_temp(path, &tmp, |tmp| std::fs::write(tmp, &text).map_err(|e| Error::io(tmp, e)))?;
        }
        Ok(())
    }
}

impl Pipeline {
    /// Per stage, the bubble the schedule's replay (plan/pipeline/) gives with this run's
    /// measured times: each chunk's own forward, backward (or B) and W per micro-batch (a
    /// stage's chunks differ: under ZB-V the first chunk's B is empty, while the last chunk's
    /// B is on the step's critical path); first with messages free, then with each message costing its
    /// stage an equal share of `message_ms` (the stage's host time per step on messages outside
    /// computing and waiting). Set beside the measured bubble, they say how much of the idle
    /// time the schedule explains, and how much the messages' own work (collective over
    /// `world`).
    fn replay_bubble(&self, world: &World, message_ms: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let f = &self.figures;
        let shape = self.shape();
        let chunks = shape.chunks();
        // Per chunk, per micro-batch: [F, B, W] of each chunk side by side (each rank holds its
        // own chunks' times, zero elsewhere), the mean over the replicas.
        let mut mine = vec![0.0; 3 * chunks];
        for (c, parts) in f.per_chunk.iter().enumerate() {
            for (k, d) in parts.iter().enumerate() {
                mine[3 * c + k] = if f.steps == 0 { 0.0 } else { d.as_secs_f64() * 1e3 / (f.steps as usize * shape.micro_batches) as f64 };
            }
        }
        let means = self.mean_over_replicas(world, &mine);
        let part = |k: usize| (0..chunks).map(|c| means[3 * c + k]).collect::<Vec<f64>>();
        let costs = pipeline::Costs { forward: part(FORWARD), input_grad: part(BACKWARD), weight_grad: part(WEIGHT_GRAD) };
        // Each message a stage posts in a step costs it its share of the stage's message time.
        let per_message: Vec<f64> = (0..shape.stages).map(|s| message_ms[s] / pipeline::messages_per_step(shape, s).max(1) as f64).collect();
        let bubbles = |r: std::result::Result<pipeline::Replay, String>| r.map(|r| (0..shape.stages).map(|s| r.bubble(s)).collect()).unwrap_or_default();
        (bubbles(pipeline::replay(shape, &costs)), bubbles(pipeline::replay_with_messages(shape, &costs, &per_message)))
    }

    /// Per stage, the mean over the replicas of `value` (collective over `world`).
    fn per_stage(&self, world: &World, value: f64) -> Vec<f64> {
        let mut mine = vec![0.0; self.plan.grid.stages];
        mine[self.stage] = value;
        self.mean_over_replicas(world, &mine)
    }

    /// `mine` (each rank's figures in its own places, zero elsewhere) summed over `world` and
    /// divided by the number of replicas (collective over `world`).
    fn mean_over_replicas(&self, world: &World, mine: &[f64]) -> Vec<f64> {
        let mut sums = vec![0.0; mine.len()];
        crate::watchdog::collective("the pipeline figures' sum", &world.comm, || world.comm.all_reduce_into(mine, &mut sums[..], mpi::collective::SystemOperation::sum()));
        sums.iter().map(|s| s / self.plan.grid.replicas as f64).collect()
    }

    /// The record's pipeline figures (collective over `world`; meaningful on rank 0).
    pub(super) fn record(&self, world: &World, args: &super::options::TrainArgs) -> crate::results::PipelineRecord {
        let f = &self.figures;
        let per_step_ms = |d: Duration| if f.steps == 0 { 0.0 } else { d.as_secs_f64() * 1e3 / f.steps as f64 };
        let compute_ms = per_step_ms(f.compute);
        let shape = self.shape();
        // Every replica of a stage holds the same shapes: the mean over them is each one's peak.
        let peak_per_stage = |v: usize| self.per_stage(world, v as f64).iter().map(|m| m.round() as usize).collect::<Vec<_>>();
        // On a GPU `compute` is device time, which may overlap the host's: no less than nothing.
        let message_ms = per_step_ms(f.phase.saturating_sub(f.compute).saturating_sub(f.blocked));
        let stage_message_ms = self.per_stage(world, message_ms);
        let (replay_bubble, replay_bubble_with_messages) = self.replay_bubble(world, &stage_message_ms);
        crate::results::PipelineRecord {
            pipeline_stages: shape.stages,
            micro_batches: shape.micro_batches,
            schedule: shape.kind.name().into(),
            virtual_stages: shape.virtual_stages,
            partition: args.pipeline.partition.name(),
            recompute: self.recompute,
            chunk_blocks: self.cut.chunks.iter().map(|r| format!("{}..{} ({}..{})", r.start, r.end - 1, self.cut.survey.names[r.start], self.cut.survey.names[r.end - 1])).collect(),
            chunk_params: self.cut.chunk_params(),
            chunk_profiled_ms: self.cut.chunk_ms(),
            stage_compute_ms: self.per_stage(world, compute_ms),
            // Under a split schedule every backward is a B.
            stage_input_grad_ms: if shape.kind.splits_backward() { self.per_stage(world, per_step_ms(f.stage_total(BACKWARD))) } else { Vec::new() },
            stage_weight_grad_ms: if shape.kind.splits_backward() { self.per_stage(world, per_step_ms(f.stage_total(WEIGHT_GRAD))) } else { Vec::new() },
            bubble: self.per_stage(world, f.bubble()),
            replay_bubble,
            stage_message_ms,
            replay_bubble_with_messages,
            theoretical_bubble: shape.theoretical_bubble(),
            peak_alive_micro_batches: peak_per_stage(f.peak_alive),
            peak_boundary_activation_bytes: peak_per_stage(f.peak_boundary_bytes),
            stall_probe_bytes: self.stall.bytes,
            stall_probe_ms: world.max_f64(self.stall.arrival_ms),
            progress_thread: world.max_f64(f64::from(u8::from(self.progress.is_some()))) > 0.0,
            ranks: Vec::new(),
        }
    }
}

impl Pipeline {
    /// Per rank of `world` (every rank, with tensor parallelism too): its place, what it read
    /// of the dataset, the bytes of images it held in memory (`cached_image_bytes`, this
    /// rank's), and its peak resident memory. Collective over `world`.
    pub(super) fn ranks_record(&self, world: &World, cached_image_bytes: u64) -> Vec<crate::results::PipelineRank> {
        const FIELDS: usize = 8;
        let d = &self.data_read;
        let mine: [f64; FIELDS] = [
            self.stage as f64,
            self.replica as f64,
            d.train_image_bytes as f64,
            d.train_labels as f64,
            d.test_image_bytes as f64,
            d.test_labels as f64,
            cached_image_bytes as f64,
            crate::raw::peak_rss_mb(),
        ];
        let mut all = vec![0.0f64; FIELDS * world.size as usize];
        crate::watchdog::collective("the pipeline ranks' figures", &world.comm, || world.comm.all_gather_into(&mine[..], &mut all[..]));
        all.chunks_exact(FIELDS)
            .enumerate()
            .map(|(rank, f)| crate::results::PipelineRank {
                rank,
                stage: f[0] as usize,
                replica: f[1] as usize,
                train_image_bytes: f[2] as u64,
                train_labels: f[3] as u64,
                test_image_bytes: f[4] as u64,
                test_labels: f[5] as u64,
                cached_image_bytes: f[6] as u64,
                peak_rss_mb: f[7],
            })
            .collect()
    }
}

/// What a split backward's W needs of its micro-batch: the graph its B kept, or for the first
/// chunk (no input gradient: B has nothing to do) the output and its gradient, for one whole
/// backward.
enum DeferredWeights {
    Graph(crate::raw::KeptGraph),
    Whole { out: Tensor, gradient: Option<Tensor> },
}

impl DeferredWeights {
    /// The bytes it holds until W: the gradients B captured (the graph's saved activations,
    /// held from the forward in every schedule, are not boundary bytes), or the first chunk's
    /// output and its gradient.
    fn bytes(&self) -> usize {
        match self {
            DeferredWeights::Graph(kept) => kept.captured_bytes(),
            DeferredWeights::Whole { out, gradient } => tensor_bytes(out) + gradient.as_ref().map_or(0, tensor_bytes),
        }
    }
}

impl Pipeline {
    /// Waits for the gradient of chunk `c`'s output for micro-batch `m` (its receive posted by
    /// the schedule), under the watchdog, naming the stage it comes from; None for the last
    /// chunk, whose output is the loss.
    /// The time blocked in MPI for it is added to `blocked`.
    fn wait_gradient(&mut self, receives: &mut HashMap<(Message, usize, usize), Inbound>, m: usize, c: usize, step: u64, blocked: &mut Duration) -> Result<Option<Tensor>> {
        if c + 1 == self.shape().chunks() {
            return Ok(None);
        }
        let waited = self.now_us();
        let message = match receives.remove(&(Message::Gradient, m, c)).expect("the schedule posts every receive before its use") {
            Inbound::Local(g) => return Ok(Some(g)),
            Inbound::Message(message) => message,
        };
        let from = self.peer(c + 1);
        let watched = self.waiting(|| format!("the gradient of micro-batch {m} from {}", self.stage_name(from)));
        let since = Instant::now();
        let arrived = message.wait()?;
        *blocked += since.elapsed();
        let g = self.arrived(arrived)?;
        drop(watched);
        self.event(step, format!("wait gradient {m}"), "wait", waited);
        Ok(Some(g))
    }
}

/// A chunk's input or its output's gradient as it reaches the stage: a message from another
/// stage, or the tensor itself where the neighbouring chunk is this stage's too (the turn of
/// ZB-V's V), which needs neither a receive buffer nor the MPI library's matching and copy.
enum Inbound {
    Message(TensorMessage),
    Local(Tensor),
}

/// An unsplit backward of one chunk: from `out` with its gradient `g` (None: `out` is the
/// scalar loss). d(sum(out * g))/d(out) is g exactly, so the parameters' gradients are those of
/// backward from `out` with gradient g; one place for the unsplit step and the first chunk's W.
fn backward_from(out: &Tensor, gradient: Option<&Tensor>) -> Result<()> {
    Ok(backward_loss(out, gradient)?.f_backward()?)
}

/// The scalar whose backward is [`backward_from`]'s (overlap runs it on its own thread).
fn backward_loss(out: &Tensor, gradient: Option<&Tensor>) -> Result<Tensor> {
    Ok(match gradient {
        Some(g) => out.f_mul(g)?.f_sum(Kind::Float)?,
        None => out.shallow_clone(),
    })
}

/// The bytes of a tensor's elements.
fn tensor_bytes(t: &Tensor) -> usize {
    t.numel() * t.kind().elt_size_in_bytes()
}

/// Whether two tensors share their first element's memory (a no-op copy).
fn raw_shares_storage(a: &Tensor, b: &Tensor) -> bool {
    a.device() == b.device() && crate::raw::data_address(a) == crate::raw::data_address(b)
}
