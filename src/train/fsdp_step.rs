//! `--zero 3`'s part of the one step (step.rs) on the [`Run`]: forward and backward unit by
//! unit, and the evaluation unit by unit. The compute thread and
//! the units are fsdp.rs; the shards and their collectives exchange/fsdp.rs.
//!
//! One step, for units 0..L (every rank makes the same collectives in the same order):
//! - forward: gather unit 0; for each unit but the last, compute it (no graph, its input kept)
//!   while the next unit gathers, then let it go;
//! - the last unit computes forward, loss and backward in one job while unit L-2 gathers again;
//! - backward, for u from L-2 down to 0: recompute and backward unit u while the gradients of
//!   unit u+1 are reduce-scattered and unit u-1 gathers; then pack u's gradients, let it go;
//! - the last reduce-scatter; the step then decides and steps the optimizer on every shard.
//!
//! Without prefetch (`--overlap off`) each unit is let go, and its gradients reduced, before
//! the next gather, so that one buffer serves the whole step. Every rank decides prefetch alike
//! (setup agrees on it): the two orders make their collectives in different orders.

use std::time::Duration;

use tch::{Kind, Reduction, Tensor};

use crate::data::reader::SplitReader;
use crate::data::Split;
use crate::data::loader::Batch;
use crate::error::Result;
use crate::exchange::staging::{synchronize_device, wait_for_stream};
use crate::exchange::strategy::{UnitShards, UnitTimes};
use crate::plan::fsdp::{exposure, WindowSpans};
use crate::optim::FiniteCheck;
use crate::plan::shard::ShardInfo;

use super::collective::sum_pair;
use super::fsdp::{Done, Job, UnitWorker};
use super::net::Normalizer;
use super::run::Run;
use super::step::{inject_inf, Backward, Gradients, LoopState, PassLoss};
use super::stamp_clock::{Stamp, StampClock, Stamped};
use super::step_faults::StepFaults;


/// The collectives beside one unit's compute: the reduce-scatter of a unit's packed gradients,
/// then the gather of another unit (reduced first, so that its buffer serves the gather).
struct Window {
    reduce: Option<usize>,
    gather: Option<usize>,
}

impl Window {
    /// Runs the window's collectives: gives the gathered unit's buffer, and when each half ran.
    fn run(self, shards: &mut dyn UnitShards, clock: &StampClock) -> Result<(Option<Tensor>, Option<Stamped>, Option<Stamped>)> {
        let reduced = self.reduce.map(|u| clock.time(|| shards.reduce(u))).transpose()?.map(|((), stamped)| stamped);
        let (gathered, gather) = match self.gather.map(|u| clock.time(|| shards.gather(u))).transpose()? {
            Some((buffer, stamped)) => (Some(buffer), Some(stamped)),
            None => (None, None),
        };
        Ok((gathered, reduced, gather))
    }
}

/// A window's stamps: its compute (none where this rank computed nothing) and collectives.
struct StampedWindow {
    compute: Option<Stamped>,
    reduce: Option<Stamped>,
    gather: Option<Stamped>,
}

enum Collective {
    ReduceScatter,
    Gather,
}

/// The stamps of a step's windows, taken on the MPI thread's stream and the compute thread's,
/// read at the step's end against the anchor taken at its start (stamp_clock.rs).
struct WindowLog {
    clock: StampClock,
    anchor: Stamp,
    windows: Vec<StampedWindow>,
}

impl WindowLog {
    fn start(clock: &StampClock) -> Result<WindowLog> {
        Ok(WindowLog { clock: clock.clone(), anchor: clock.now()?, windows: Vec::new() })
    }

    /// A collective that no compute ran beside (the first gather, the last reduce-scatter).
    fn alone<T>(&mut self, kind: Collective, collective: impl FnOnce() -> Result<T>) -> Result<T> {
        let (result, stamped) = self.clock.time(collective)?;
        let stamped = Some(stamped);
        let (reduce, gather) = match kind {
            Collective::ReduceScatter => (stamped, None),
            Collective::Gather => (None, stamped),
        };
        self.windows.push(StampedWindow { compute: None, reduce, gather });
        Ok(result)
    }

    /// The step's gathers and reduce-scatters in all and the part compute did not hide (on a
    /// GPU, as the device ran them: read once the step has waited for it).
    fn finish(self) -> Result<UnitTimes> {
        let WindowLog { clock, anchor, windows } = self;
        let mut spans = Vec::with_capacity(windows.len());
        for w in windows {
            let span = |s: Option<Stamped>| s.map(|s| clock.span(&anchor, s)).transpose();
            spans.push(WindowSpans { compute: span(w.compute)?, reduce: span(w.reduce)?, gather: span(w.gather)? });
        }
        clock.give_back(anchor);
        let e = exposure(&spans);
        let ms = |v: f64| Duration::from_secs_f64(v.max(0.0) / 1e3);
        Ok(UnitTimes { gather: ms(e.gather_ms), exposed_gather: ms(e.exposed_gather_ms), reduce: ms(e.reduce_ms), exposed_reduce: ms(e.exposed_reduce_ms) })
    }

    /// An evaluation's windows, not reported: their events back to the pool.
    fn discard(self) {
        for w in self.windows {
            for s in [w.compute, w.reduce, w.gather].into_iter().flatten() {
                self.clock.give_back(s.start);
                self.clock.give_back(s.end);
            }
        }
        self.clock.give_back(self.anchor);
    }
}

/// Sends `job` (when there is one: a rank without samples computes nothing) and runs `window`'s
/// collectives beside it (prefetch) or after it; then `after` (what follows the unit's compute:
/// letting it go). Without prefetch, `after` comes before the window, so that one unit is
/// gathered at a time. Either way every rank makes the same collectives in the same order.
/// Logs when the compute and the collectives ran, for the share of the collectives the compute
/// hid.
fn compute_beside<R>(
    worker: &UnitWorker,
    shards: &mut dyn UnitShards,
    job: Option<Job>,
    window: Window,
    prefetch: bool,
    log: &mut WindowLog,
    after: impl FnOnce(&mut dyn UnitShards) -> Result<R>,
) -> Result<(Option<Done>, Option<Tensor>, R)> {
    let has_job = job.is_some();
    if let Some(job) = job {
        worker.send(job)?;
    }
    let wait = |worker: &UnitWorker| if has_job { worker.wait().map(Some) } else { Ok(None) };
    let (mut done, (gathered, reduce, gather), after) = if prefetch {
        let collectives = window.run(shards, &log.clock)?;
        let done = wait(worker)?;
        (done, collectives, after(shards)?)
    } else {
        let done = wait(worker)?;
        let after = after(shards)?;
        (done, window.run(shards, &log.clock)?, after)
    };
    let compute = done.as_mut().and_then(|d| d.compute.take());
    log.windows.push(StampedWindow { compute, reduce, gather });
    Ok((done, gathered, after))
}

/// After a unit's backward: its gradients packed (for the reduce-scatter), the unit let go.
/// `overflow` (the `infgrad` test hook): one of them becomes +inf first, as an fp16 overflow.
fn pack_and_let_go<'a>(u: usize, params: &'a [Tensor], finite: &'a mut FiniteCheck, overflow: bool) -> impl FnOnce(&mut dyn UnitShards) -> Result<()> + 'a {
    move |s| {
        if overflow {
            // Only the unit just computed has gradients now.
            inject_inf(&params.iter().map(Tensor::grad).collect::<Vec<_>>())?;
        }
        s.pack_grads(u, params, finite)?;
        s.release(u, params)
    }
}

impl Run<'_> {
    /// `--zero 3`'s forward and backward, unit by unit (see the file's comment): the gradients
    /// end reduce-scattered into this rank's shards, for the step's optimizer.
    pub(super) fn units_pass(&mut self, batch: &Batch, factor: f64, faults: &StepFaults, state: &LoopState) -> Result<Backward> {
        // `error`: every unit's gathers are the step's communication, so a forward failure comes
        // before the first, on every rank that has it whether or not it has samples.
        faults.forward()?;
        let n = batch.samples();
        let images = if n > 0 { Some(state.norm.images(batch.images(), n)?) } else { None };
        let labels = if n > 0 { Some(state.norm.labels(batch.labels())?) } else { None };
        let factor = faults.loss_factor(factor);
        let overflow = faults.inf_gradient() && state.scaler.is_some();
        let label_smoothing = self.args.recipe.label_smoothing;
        let fsdp = self.layout.fsdp().expect("a --zero 3 run");
        let (worker, prefetch, last) = (&fsdp.worker, fsdp.prefetch, fsdp.units.len() - 1);
        let on_comm_stream = fsdp.collectives_stream()?;
        let params = &self.net.params;
        let shards = self.exchange.fully_sharded().expect("--zero 3 builds a fully sharded exchange");
        let mut log = WindowLog::start(&fsdp.clock)?;
        let mut finite = FiniteCheck::default();

        // Forward: each unit's input kept for its backward.
        let mut gathered = log.alone(Collective::Gather, || shards.gather(0))?;
        let mut inputs: Vec<Option<Tensor>> = vec![images];
        for u in 0..last {
            shards.install(u, &gathered, params)?;
            let job = inputs[u].as_ref().map(|x| Job::Forward { unit: u, input: x.shallow_clone(), train: true });
            let window = Window { reduce: None, gather: Some(u + 1) };
            let (done, next, ()) = compute_beside(worker, shards, job, window, prefetch, &mut log, |s| s.release(u, params))?;
            gathered = next.expect("gathered");
            inputs.push(done.and_then(|d| d.output));
        }

        // The last unit: forward, loss and backward; the unit before it gathers again.
        shards.install(last, &gathered, params)?;
        let job = match (&inputs[last], &labels) {
            (Some(x), Some(y)) => Some(Job::Last { unit: last, input: x.shallow_clone(), labels: y.shallow_clone(), factor, label_smoothing }),
            _ => None,
        };
        // With prefetch a unit's gradients are reduced beside the next backward; without, at
        // once (one buffer serves its gather, its gradients, and the next gather).
        let reduce_now = |u: usize| (!prefetch).then_some(u);
        let window = Window { reduce: reduce_now(last), gather: last.checked_sub(1) };
        let (done, mut next, ()) = compute_beside(worker, shards, job, window, prefetch, &mut log, pack_and_let_go(last, params, &mut finite, overflow))?;
        let (loss, mut grad) = match done {
            Some(d) => (d.loss, d.output),
            None => (None, None),
        };
        let mut pending = prefetch.then_some(last);

        // Backward, unit by unit from the end.
        for u in (0..last).rev() {
            shards.install(u, &next.take().expect("gathered"), params)?;
            let job = match (inputs[u].take(), grad.take()) {
                (Some(x), Some(g)) => Some(Job::Backward { unit: u, input: x, grad: g }),
                _ => None,
            };
            let window = Window { reduce: pending.take().or(reduce_now(u)), gather: u.checked_sub(1) };
            let (done, gathered, ()) = compute_beside(worker, shards, job, window, prefetch, &mut log, pack_and_let_go(u, params, &mut finite, false))?;
            next = gathered;
            grad = done.and_then(|d| d.output);
            pending = prefetch.then_some(u);
        }
        if let Some(u) = pending {
            log.alone(Collective::ReduceScatter, || shards.reduce(u))?;
        }
        if let Some(stream) = on_comm_stream {
            stream.restore()?;
        }
        synchronize_device(self.plan.device);
        let times = log.finish()?;
        shards.note_step(times);
        let loss = loss.map_or(PassLoss::Read(0.0), PassLoss::Tensor);
        let (exchange_total, exchange_exposed) = (times.gather + times.reduce, times.exposed_gather + times.exposed_reduce);
        Ok(Backward { loss, samples: n, gradients: Gradients::Shards(finite), exchange_total, exchange_exposed })
    }

    /// Test loss and accuracy, unit by unit per batch of the test set (every rank gathers every
    /// unit for as many batches as the largest share has, computing only its own).
    pub(super) fn fsdp_evaluate(&mut self, norm: &Normalizer) -> Result<(f64, f64)> {
        let (info, labels) = (&self.info, &self.labels);
        let shard = ShardInfo::split(info.test.len, self.workers, self.worker);
        let eval_batch = self.plan.batch.max(1) * 2;
        let batches = ShardInfo::split(info.test.len, self.workers, 0).len.div_ceil(eval_batch);
        let mut reader = SplitReader::open(&self.args.data, Split::Test)?;
        let (mut loss_sum, mut correct) = (0.0, 0.0);
        let mut images = Vec::new();
        let fsdp = self.layout.fsdp().expect("a --zero 3 run");
        let (worker, prefetch, units) = (&fsdp.worker, fsdp.prefetch, fsdp.units.len());
        let on_comm_stream = fsdp.collectives_stream()?;
        let params = &self.net.params;
        let shards = self.exchange.fully_sharded().expect("--zero 3 builds a fully sharded exchange");
        for b in 0..batches {
            let start = shard.offset + b * eval_batch;
            let end = (start + eval_batch).min(shard.end());
            let mut x = if start < end {
                let indices: Vec<usize> = (start..end).collect();
                images.resize(indices.len() * info.sample_bytes(), 0);
                reader.read(&indices, &mut images)?;
                let x = norm.images_from_bytes(&images, indices.len())?;
                // Copied to a GPU on the communication stream (current here), read by the
                // compute thread's: done first.
                wait_for_stream(self.plan.device)?;
                Some(x)
            } else {
                None
            };
            // Not reported: the log only keeps the windows' stamps until the batch ends.
            let mut log = WindowLog::start(&fsdp.clock)?;
            let mut gathered = shards.gather(0)?;
            for u in 0..units {
                shards.install(u, &gathered, params)?;
                let job = x.take().map(|input| Job::Forward { unit: u, input, train: false });
                let window = Window { reduce: None, gather: (u + 1 < units).then_some(u + 1) };
                let (done, next, ()) = compute_beside(worker, shards, job, window, prefetch, &mut log, |s| s.release(u, params))?;
                x = done.and_then(|d| d.output);
                if let Some(next) = next {
                    gathered = next;
                }
            }
            log.discard();
            if let Some(logits) = x {
                let y = norm.labels(&labels.test[start..end])?;
                loss_sum += logits.f_cross_entropy_loss::<Tensor>(&y, None, Reduction::Sum, -100, 0.0)?.f_double_value(&[])?;
                correct += logits.f_argmax(-1, false)?.f_eq_tensor(&y)?.f_sum(Kind::Float)?.f_double_value(&[])?;
            }
        }
        if let Some(stream) = on_comm_stream {
            stream.restore()?;
        }
        // A tensor-parallel group's ranks computed the same logits from the same samples: one
        // of them counts them.
        let counted = self.layout.tensor.as_ref().is_none_or(|tp| tp.rank == 0);
        let (loss_sum, correct) = if counted { (loss_sum, correct) } else { (0.0, 0.0) };
        let (loss_sum, correct) = sum_pair(&self.workers_comm, loss_sum, correct);
        let n = info.test.len as f64;
        Ok((loss_sum / n, correct / n))
    }
}
