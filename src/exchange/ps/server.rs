//! The server side: a server's share of the weights and optimizer state ([`ServerState`]), and
//! its loops: synchronous rounds (a push from every worker, in worker order, then the result to
//! each), and asynchronous service with bounded staleness. A dedicated server rank runs them in
//! `Training::serve`; a colocated asynchronous server runs them on a thread of its own beside
//! its rank's worker; a colocated synchronous server runs one round inline per step
//! (`ParameterServer::inline_round`, which combines the pushes through [`ServerState`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use mpi::point_to_point::Status;
use mpi::topology::Rank;
use mpi::traits::*;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::exchange::buckets::pack;
use crate::exchange::config::PsConfig;
use crate::exchange::strategy::WholeState;
use crate::optim::{Optimizer, Pieces};
use crate::plan::buckets::Bucket;
use crate::raw::{self, PointToPoint};

use super::link::{DONE, FINAL, PULL, PUSH, STATE};

/// Staleness seen by one server (async).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Staleness {
    pub(super) sum: f64,
    pub(super) count: u64,
    pub(super) max: u64,
}

/// A server's share: weights and optimizer state, on the host.
pub(super) struct ServerState {
    pub(super) weights: Tensor,
    workers: usize,
    optimizer: Optimizer,
    /// The optimizer's state for the share, slot after slot, each laid out as the weights (what
    /// a STATE message carries); the optimizer steps views of it.
    state: Tensor,
    /// Per parameter tensor of the share: views of the weights and of `sum`, and the tensor's
    /// index (the optimizer steps whole tensors, LARS's layers).
    piece_weights: Vec<Tensor>,
    piece_sums: Vec<Tensor>,
    layers: Vec<usize>,
    /// Async: the momentum buffer, and the 0-dim factors of the split update.
    velocity: Tensor,
    scratch: Tensor,
    sum: Tensor,
    /// Sync: one receive buffer per worker (made at the first round).
    pushes: Vec<Vec<f32>>,
}

impl ServerState {
    /// The server of `bucket`'s tensors (packed into `weights`) for `workers` workers; `exempt`
    /// per parameter tensor of the model, as the workers' optimizer has it.
    pub(super) fn new(weights: Tensor, bucket: &Bucket, workers: usize, config: &PsConfig, exempt: Vec<bool>) -> Result<ServerState> {
        let len = weights.numel() as i64;
        let slots = config.optimizer.kind.slots().len() as i64;
        let sum = Tensor::f_zeros([len], (Kind::Float, Device::Cpu))?;
        let view = |t: &Tensor, at: usize, n: usize| t.f_narrow(0, at as i64, n as i64);
        let piece_weights = bucket.slots.iter().map(|s| view(&weights, s.offset, s.len)).collect::<std::result::Result<_, _>>()?;
        let piece_sums = bucket.slots.iter().map(|s| view(&sum, s.offset, s.len)).collect::<std::result::Result<_, _>>()?;
        let mut state = ServerState {
            velocity: Tensor::f_zeros([len], (Kind::Float, Device::Cpu))?,
            scratch: Tensor::f_zeros([len], (Kind::Float, Device::Cpu))?,
            state: Tensor::f_zeros([slots * len], (Kind::Float, Device::Cpu))?,
            sum,
            piece_weights,
            piece_sums,
            layers: bucket.slots.iter().map(|s| s.tensor).collect(),
            pushes: Vec::new(),
            weights,
            workers,
            optimizer: Optimizer::new(config.optimizer, config.schedule.clone(), exempt),
        };
        state.hand_state_to_optimizer(bucket, 0)?;
        Ok(state)
    }

    /// The optimizer's buffers become views of `state`, per slot and tensor.
    fn hand_state_to_optimizer(&mut self, bucket: &Bucket, steps: u64) -> Result<()> {
        let len = self.weights.numel();
        let slots = self.optimizer.kind().slots().len();
        let views = (0..slots)
            .map(|k| bucket.slots.iter().map(|s| Ok(Some(self.state.f_narrow(0, (k * len + s.offset) as i64, s.len as i64)?))).collect::<Result<Vec<_>>>())
            .collect::<Result<Vec<_>>>()?;
        self.optimizer.restore(views, steps);
        Ok(())
    }

    /// This server's optimizer state (zeros before the first step), slot after slot.
    pub(super) fn state_share(&self) -> Result<Tensor> {
        Ok(self.state.f_detach_copy()?)
    }

    /// Takes this server's share of the whole per-parameter `state` (`[slot][parameter]`, from
    /// a checkpoint).
    pub(super) fn restore_state(&mut self, bucket: &Bucket, state: &WholeState, steps: u64) -> Result<()> {
        let len = self.weights.numel();
        for (k, slot) in state.iter().enumerate() {
            let host: Vec<Tensor> = slot.iter().map(|m| m.f_to_device(Device::Cpu)?.f_to_kind(Kind::Float)).collect::<std::result::Result<_, _>>()?;
            let mut share = self.state.f_narrow(0, (k * len) as i64, len as i64)?;
            pack(bucket, &host, &mut share);
        }
        self.hand_state_to_optimizer(bucket, steps)?;
        self.velocity.f_copy_(&self.state.f_narrow(0, 0, len as i64)?)?;
        Ok(())
    }

    /// Sum of the pushes (in worker order); with `optimize`, their mean steps the optimizer and
    /// the new weights are returned, else the sum is.
    pub(super) fn combine(&mut self, pushes: &[Tensor], optimize: bool) -> Result<Tensor> {
        self.sum.f_copy_(&pushes[0])?;
        for p in &pushes[1..] {
            let _ = self.sum.f_add_(p)?;
        }
        if !optimize {
            return Ok(self.sum.shallow_clone());
        }
        self.step_on_mean()?;
        Ok(self.weights.shallow_clone())
    }

    /// Divides `sum` by the workers and steps the optimizer on the share, tensor by tensor.
    /// Synchronous servers take every step, so their count of steps is the global step.
    fn step_on_mean(&mut self) -> Result<()> {
        let _ = self.sum.f_mul_scalar_(1.0 / self.workers as f64)?;
        self.optimizer.begin_step(self.optimizer.steps());
        let which: Vec<usize> = (0..self.layers.len()).collect();
        // A server holds whole tensors: LARS's norms need no other server's figures.
        let mut whole_here = |_: &mut Tensor| Ok(());
        let pieces = Pieces::Parts { layer_of: &self.layers, layers: &self.layers, sum_over_ranks: &mut whole_here };
        self.optimizer.step_pieces(&mut self.piece_weights, &mut self.piece_sums, &which, pieces)?;
        self.optimizer.count_step();
        Ok(())
    }

    /// Async: the part of round `round`'s update that does not depend on its gradients:
    /// v = momentum * v + weight_decay * w, then w -= lr * v, at the round's rate (SGD only:
    /// `--ps-mode async` refuses other optimizers).
    fn start_round(&mut self, round: u64) -> Result<()> {
        self.optimizer.begin_step(round);
        let (c, lr) = (self.optimizer.config, self.optimizer.lr());
        tch::no_grad(|| -> Result<()> {
            let _ = self.velocity.f_mul_scalar_(c.momentum)?;
            if c.weight_decay != 0.0 {
                self.scratch.f_copy_(&self.weights)?;
                let _ = self.scratch.f_mul_scalar_(c.weight_decay)?;
                let _ = self.velocity.f_add_(&self.scratch)?;
            }
            self.scratch.f_copy_(&self.velocity)?;
            let _ = self.scratch.f_mul_scalar_(lr)?;
            let _ = self.weights.f_sub_(&self.scratch)?;
            Ok(())
        })
    }

    /// Async: one worker's share of the round: v += g / W, w -= lr * g / W.
    fn apply_gradient(&mut self, grad: &Tensor) -> Result<()> {
        let (c, lr) = (self.optimizer.config, self.optimizer.lr());
        tch::no_grad(|| -> Result<()> {
            self.scratch.f_copy_(grad)?;
            let _ = self.scratch.f_mul_scalar_(1.0 / self.workers as f64)?;
            if c.momentum != 0.0 {
                let _ = self.velocity.f_add_(&self.scratch)?;
            }
            let _ = self.scratch.f_mul_scalar_(lr)?;
            let _ = self.weights.f_sub_(&self.scratch)?;
            Ok(())
        })
    }
}

/// How a waiting server passes time: spin briefly, then yield the core (a rank sharing a core
/// with others must not starve them); a colocated server thread, which shares its core with
/// its own rank's worker, sleeps once it has been idle for a while.
fn backoff(idle: &mut u32, colocated: bool) {
    *idle = idle.saturating_add(1);
    if *idle < 64 {
        std::hint::spin_loop();
    } else if !colocated || *idle < 256 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// One synchronous round on a dedicated server: a push from every worker (in worker order),
/// then the result to every worker. Returns false when the workers said DONE instead.
pub(super) fn serve_sync_round(state: &mut ServerState, up: &impl PointToPoint, down: &impl PointToPoint, workers: &[Rank], config: &PsConfig, optimize: bool) -> Result<bool> {
    let share = state.weights.numel();
    if state.pushes.len() != workers.len() || state.pushes.first().is_some_and(|p| p.len() != share) {
        state.pushes = workers.iter().map(|_| vec![0.0f32; share]).collect();
    }
    let (mut done, mut received) = (0, 0);
    {
        // SAFETY: the server state's own sum tensor, which nothing else holds during the round.
        let sum = unsafe { raw::host_slice_mut::<f32>(&mut state.sum)? };
        // One receive per worker, all posted before any arrives, so that every worker's push
        // travels at once; the sum still goes in worker order, so that runs repeat exactly. A
        // receive takes any tag: a worker's one message of the round is a PUSH, or DONE.
        mpi::request::scope(|scope| -> Result<()> {
            let mut requests: Vec<_> = state.pushes.iter_mut().zip(workers).map(|(buf, &w)| up.immediate_receive_into(scope, w, &mut buf[..], raw::any_tag())).collect::<Vec<_>>().into_iter().map(Some).collect();
            for k in 0..requests.len() {
                let request = requests[k].take().expect("each request is waited once");
                let (status, pushed) = match wait_within(request, config.timeout) {
                    Ok(arrived) => arrived,
                    Err(request) => {
                        // Cancel what is still posted, so that the scope can end, then report.
                        for r in std::iter::once(request).chain(requests.iter_mut().filter_map(Option::take)) {
                            r.cancel();
                            r.wait_without_status();
                        }
                        return Err(Error::exchange("ps", format!("worker rank {} has sent nothing for {:.0} s (--ps-timeout-s)", workers[k], config.timeout.as_secs_f64())));
                    }
                };
                match status.tag() {
                    DONE => done += 1,
                    PUSH if status.count(f32::equivalent_datatype()) as usize == share => {
                        if received == 0 {
                            sum.copy_from_slice(pushed);
                        } else {
                            crate::element::accumulate(sum, pushed);
                        }
                        received += 1;
                    }
                    tag => {
                        let rest: Vec<_> = requests.iter_mut().filter_map(Option::take).collect();
                        for r in rest {
                            r.cancel();
                            r.wait_without_status();
                        }
                        return Err(Error::exchange("ps", format!("unexpected message (tag {tag}, {} elements) from rank {}", status.count(f32::equivalent_datatype()), workers[k])));
                    }
                }
            }
            Ok(())
        })?;
    }
    if done == workers.len() {
        return Ok(false);
    }
    if done > 0 {
        return Err(Error::exchange("ps", format!("{done} worker(s) finished while {received} still pushed: the workers ran different step counts")));
    }
    let result = if optimize {
        state.step_on_mean()?;
        state.weights.shallow_clone()
    } else {
        state.sum.shallow_clone()
    };
    // SAFETY: the server state's weights or sum, unchanged until the sends below complete.
    let out = unsafe { raw::host_slice::<f32>(&result)? };
    mpi::request::scope(|scope| {
        let sends: Vec<_> = workers.iter().map(|&w| down.immediate_send(scope, w, out, PULL)).collect();
        sends.into_iter().for_each(|r| r.wait_without_status());
    });
    Ok(true)
}

/// Waits for a receive with the parameter server's timeout: its status and data, or the request
/// back when nothing came in time (a worker that hung or died without MPI noticing).
fn wait_within<'a, S: mpi::request::Scope<'a>>(
    mut request: mpi::request::Request<'a, [f32], S>,
    timeout: Duration,
) -> std::result::Result<(Status, &'a [f32]), mpi::request::Request<'a, [f32], S>> {
    let start = Instant::now();
    let mut idle = 0u32;
    loop {
        match request.test_with_data() {
            Ok(arrived) => return Ok(arrived),
            Err(pending) if start.elapsed() > timeout => return Err(pending),
            Err(pending) => request = pending,
        }
        backoff(&mut idle, false);
    }
}

/// Synchronous server loop: rounds until every worker is done, then the final weights. After
/// every `checkpoint_every` steps, and at the end, the momentum goes to rank 0 for checkpoints.
pub(super) fn serve_sync(mut state: ServerState, up: &impl PointToPoint, down: &impl PointToPoint, workers: &[Rank], config: &PsConfig) -> Result<(ServerState, Staleness)> {
    let mut step = config.first_step;
    while serve_sync_round(&mut state, up, down, workers, config, true)? {
        step += 1;
        if config.checkpoint_every.is_some_and(|every| step.is_multiple_of(every)) {
            send_state(&state, down, workers[0])?;
        }
    }
    send_final(&state, down, workers)?;
    send_state(&state, down, workers[0])?;
    Ok((state, Staleness::default()))
}

fn send_state(state: &ServerState, down: &impl PointToPoint, root: Rank) -> Result<()> {
    let share = state.state_share()?;
    // SAFETY: `share` is a fresh copy with no other handle.
    down.send(root, unsafe { raw::host_slice::<f32>(&share)? }, STATE);
    Ok(())
}

fn send_final(state: &ServerState, down: &impl PointToPoint, workers: &[Rank]) -> Result<()> {
    // SAFETY: the server state's weights, which only this (server) thread writes.
    let out = unsafe { raw::host_slice::<f32>(&state.weights)? };
    for &w in workers {
        down.send(w, out, FINAL);
    }
    Ok(())
}

/// Asynchronous server loop (on a dedicated rank, or in a colocated rank's server thread).
/// `stop`: set on an error path (a colocated server thread must end before MPI is finalized).
pub(super) fn serve_async(
    mut state: ServerState,
    up: &impl PointToPoint,
    down: &impl PointToPoint,
    workers: &[Rank],
    config: &PsConfig,
    colocated: bool,
    stop: &AtomicBool,
) -> Result<(ServerState, Staleness)> {
    let (up_c, down_c) = (up, down);
    let n = workers.len();
    let share = state.weights.numel() as i64;
    let index_of = |rank: Rank| workers.iter().position(|&w| w == rank);
    // Per worker: gradients received (its clock), whether it is done, the complete rounds its
    // current weights include, and a held-back answer (the round it waits on).
    let mut clock = vec![0u64; n];
    let mut done = vec![false; n];
    let mut sent_complete = vec![0u64; n];
    let mut waiting: Vec<Option<u64>> = vec![None; n];
    let mut last_heard = vec![Instant::now(); n];
    let mut rounds_started = 0u64;
    let mut staleness = Staleness::default();
    let mut incoming = Tensor::f_zeros([share], (Kind::Float, Device::Cpu))?;
    let mut idle = 0u32;
    let mut last_timeout_check = Instant::now();
    let bound = config.max_staleness;

    loop {
        if stop.load(Ordering::Relaxed) {
            return Err(Error::exchange("ps", "the server was stopped before its workers were done"));
        }
        match up_c.probe(None) {
            Some((message, status)) => {
                idle = 0;
                let source = status.source_rank();
                let w = index_of(source).ok_or_else(|| Error::exchange("ps", format!("a message from rank {source}, which is not a worker")))?;
                last_heard[w] = Instant::now();
                match status.tag() {
                    PUSH => {
                        // SAFETY: `incoming` is this loop's own receive buffer, no other handle.
                        message.matched_receive_into(unsafe { raw::host_slice_mut::<f32>(&mut incoming)? });
                        let round = clock[w];
                        let s = round.saturating_sub(sent_complete[w]);
                        staleness.sum += s as f64;
                        staleness.count += 1;
                        staleness.max = staleness.max.max(s);
                        if round == rounds_started {
                            state.start_round(config.first_step + rounds_started)?;
                            rounds_started += 1;
                        }
                        state.apply_gradient(&incoming)?;
                        clock[w] += 1;
                        waiting[w] = Some(round);
                    }
                    DONE => {
                        message.matched_receive_into(&mut [0u8; 0][..]);
                        done[w] = true;
                    }
                    tag => return Err(Error::exchange("ps", format!("unexpected message tag {tag} from rank {source}"))),
                }
                // Rounds every active worker has pushed; a finished worker holds no one back.
                let complete = (0..n).filter(|&v| !done[v]).map(|v| clock[v]).min().unwrap_or(u64::MAX);
                for v in 0..n {
                    let Some(round) = waiting[v] else { continue };
                    // The worker's next round is round + 1; its weights must include every
                    // round before round + 1 - S.
                    let needed = match bound {
                        Some(s) => (round + 1).saturating_sub(s),
                        None => 0,
                    };
                    if complete >= needed {
                        // SAFETY: the server state's weights, which only this thread writes.
                        down_c.send(workers[v], unsafe { raw::host_slice::<f32>(&state.weights)? }, PULL);
                        sent_complete[v] = complete.min(round + 1);
                        waiting[v] = None;
                    }
                }
                if done.iter().all(|&d| d) {
                    break;
                }
            }
            None => backoff(&mut idle, colocated),
        }
        // A worker that is neither done nor waiting for an answer should be pushing; one that
        // has been silent past the timeout has hung or died without MPI noticing.
        if last_timeout_check.elapsed() > Duration::from_millis(100) {
            last_timeout_check = Instant::now();
            let silent: Vec<String> = (0..n)
                .filter(|&v| !done[v] && waiting[v].is_none() && last_heard[v].elapsed() > config.timeout)
                .map(|v| workers[v].to_string())
                .collect();
            if !silent.is_empty() {
                return Err(Error::exchange("ps", format!(
                    "worker rank {} has sent nothing for {:.0} s (--ps-timeout-s)",
                    silent.join(", worker rank "),
                    config.timeout.as_secs_f64()
                )));
            }
        }
    }
    send_final(&state, down, workers)?;
    Ok((state, staleness))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{LrSchedule, OptimizerConfig, OptimizerKind};
    use crate::plan::buckets::BucketPlan;

    fn share_of(sizes: &[usize]) -> Bucket {
        let order: Vec<usize> = (0..sizes.len()).collect();
        BucketPlan::in_order(sizes, &order, 4, 1 << 20, None).buckets[0].clone()
    }

    #[test]
    fn the_split_async_update_is_the_synchronous_update() {
        let cfg = PsConfig { optimizer: OptimizerConfig::sgd(0.1, 0.9, 0.01), schedule: LrSchedule::constant(0.1), ..PsConfig::default() };
        let w0 = Tensor::from_slice(&[1.0f32, -2.0, 0.5]);
        let bucket = share_of(&[2, 1]);
        let grads = [Tensor::from_slice(&[0.3f32, 0.1, -0.2]), Tensor::from_slice(&[-0.1f32, 0.4, 0.2])];
        let mut sync = ServerState::new(w0.copy(), &bucket, 2, &cfg, vec![false, true]).unwrap();
        let mut split = ServerState::new(w0.copy(), &bucket, 2, &cfg, vec![false, true]).unwrap();
        for round in 0..3 {
            let scaled: Vec<Tensor> = grads.iter().map(|g| g * (round as f64 + 1.0)).collect();
            let _new_weights = sync.combine(&scaled, true).unwrap();
            split.start_round(round).unwrap();
            for g in &scaled {
                split.apply_gradient(g).unwrap();
            }
        }
        let diff = (&sync.weights - &split.weights).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{diff}");
    }

    /// A server steps its flat share tensor by tensor, as the workers' optimizer steps the
    /// whole tensors (LARS's norms per tensor, AdamW's moments), and its state share holds the
    /// slots one after the other.
    #[test]
    fn a_share_steps_as_the_whole_tensors_would() {
        for kind in [OptimizerKind::Sgd, OptimizerKind::Lars, OptimizerKind::Adamw] {
            let config = OptimizerConfig { kind, ..OptimizerConfig::sgd(0.1, 0.9, 0.01) };
            let schedule = LrSchedule { warmup_steps: 2, total_steps: 4, ..LrSchedule::constant(0.1) };
            let cfg = PsConfig { optimizer: config, schedule: schedule.clone(), ..PsConfig::default() };
            let exempt = vec![false, true];
            let w0 = [Tensor::from_slice(&[1.0f32, -2.0, 0.5, 0.25]).view([2, 2]), Tensor::from_slice(&[0.5f32, -0.5])];
            let bucket = share_of(&[4, 2]);
            let mut flat = Tensor::zeros([6], (Kind::Float, Device::Cpu));
            pack(&bucket, &w0, &mut flat);
            let mut server = ServerState::new(flat, &bucket, 1, &cfg, exempt.clone()).unwrap();
            let mut whole: Vec<Tensor> = w0.iter().map(|t| t.copy()).collect();
            let mut optimizer = Optimizer::new(config, schedule, exempt);
            for step in 0..4 {
                let g: Vec<Tensor> = whole.iter().map(|w| (w * 0.3 + (step as f64 + 1.0) * 0.1).sin()).collect();
                let mut push = Tensor::zeros([6], (Kind::Float, Device::Cpu));
                pack(&bucket, &g, &mut push);
                let _new_weights = server.combine(&[push], true).unwrap();
                optimizer.begin_step(step);
                optimizer.step(&mut whole, &mut g.iter().map(|t| t.copy()).collect::<Vec<_>>()).unwrap();
            }
            let mut expected = Tensor::zeros([6], (Kind::Float, Device::Cpu));
            pack(&bucket, &whole, &mut expected);
            let diff = (&server.weights - &expected).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "{kind:?}: {diff}");
            assert_eq!(server.state_share().unwrap().numel(), 6 * kind.slots().len());
        }
    }
}
