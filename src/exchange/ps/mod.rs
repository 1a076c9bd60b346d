//! `ps`: parameter servers on MPI point-to-point calls.
//!
//! Server ranks hold the authoritative weights and optimizer state of their share of the
//! parameter tensors (balanced in bytes); workers push gradients to every server and pull fresh
//! weights back. Layouts:
//! - dedicated servers (`--servers K`): the last K ranks serve and compute nothing, the other
//!   ranks are workers and share the data;
//! - colocated (`--ps-colocate`): every rank is a worker and the server of its share.
//!
//! Modes:
//! - `sync`: every step, a server averages the gradients of all workers (in worker order, so
//!   that runs repeat exactly) and steps the optimizer once: the computation of an all-reduce.
//! - `async`: a server applies each gradient as it arrives and answers with the weights it then
//!   holds. `--max-staleness S` bounds the lag: a worker's weights for its round c include every
//!   update of rounds before c - S, and the server holds its answer back until they do. The
//!   optimizer is split so that a round's momentum and weight-decay term is applied once, when
//!   the round's first gradient arrives, and each gradient adds its share; with S = 0 this is
//!   exactly the synchronous update.
//!
//! This file is the strategy a rank runs, [`ParameterServer`]: the worker side (push gradients,
//! pull weights), the colocated synchronous round served inline, and the `Exchange` calls that
//! start the server side. The server side is server.rs, who serves what is roles.rs (pure,
//! tested without MPI), the messages and their communicators link.rs.

mod link;
mod roles;
mod server;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use mpi::collective::SystemOperation;
use mpi::topology::{Rank, SimpleCommunicator};
use mpi::traits::*;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::exchange::buckets::{pack, unpack};
use crate::exchange::comm_thread::CommThread;
use crate::exchange::config::{ExchangeConfig, PsConfig, PsMode};
use crate::exchange::staging::wait_for_stream;
use crate::exchange::strategy::{allreduce_bus_factor, common_dtype, Checkpointed, DataPath, Described, ExchangeReport, Reduce, ReduceOp, Role, Training, WholeState};
use crate::optim::Optimizer;
use crate::plan::buckets::Bucket;
use crate::raw::{self, PointToPoint};
use crate::topology::World;

use link::{Link, DONE, FINAL, PULL, PUSH, STATE};
use roles::{partition, server_buckets, Roles};
use server::{serve_async, serve_sync, serve_sync_round, ServerState, Staleness};

/// The layout of the exchange, made once the tensors are known.
struct Layout {
    buckets: Vec<Bucket>,
    sizes: Vec<usize>,
}

pub struct ParameterServer {
    up: Link,
    down: Link,
    /// For the few collectives (statistics at the end), never used by the server thread.
    control: SimpleCommunicator,
    rank: Rank,
    size: usize,
    roles: Roles,
    config: PsConfig,
    path: DataPath,
    device: Device,
    layout: Option<Layout>,
    /// Worker side: one flat buffer per server for gradients out and weights in, where MPI
    /// reads them (pinned host memory on the staged path).
    send_bufs: Vec<Tensor>,
    recv_bufs: Vec<Tensor>,
    /// Staged path: the same buffers on the device, where the gradients are packed and the
    /// weights unpacked, so that each crosses in one non-blocking copy per server.
    device_send_bufs: Vec<Tensor>,
    device_recv_bufs: Vec<Tensor>,
    /// Colocated sync: this rank's share (weights, optimizer) and the pushes it receives.
    own: Option<ServerState>,
    push_bufs: Vec<Tensor>,
    /// Dedicated server in the benchmark: its share's state, kept between rounds.
    bench_state: Option<ServerState>,
    /// Colocated async: the server thread, and the flag that stops it on an error path.
    thread: Option<CommThread<Staleness>>,
    stop_thread: Arc<AtomicBool>,
    staleness: Staleness,
    /// Whether training pushed through the servers (then finish() tells them it is over).
    trained: bool,
    /// Momentum buffers from a checkpoint, until the servers take their shares.
    restored: Option<(WholeState, u64)>,
    /// Rank 0: the servers' momentum, sent with the final weights.
    final_state: Option<WholeState>,
}

impl ParameterServer {
    pub fn new(world: &World, config: &ExchangeConfig) -> Result<ParameterServer> {
        let cfg = config.ps.clone();
        let roles = Roles::new(world.size as usize, &cfg)?;
        // Only the colocated asynchronous server runs in a thread of its own beside the worker;
        // every other layout makes all its MPI calls from the main thread.
        let threaded = cfg.mode == PsMode::Async && cfg.colocate;
        let threading = mpi::environment::threading_support();
        if threaded && threading < mpi::Threading::Multiple {
            return Err(Error::usage(format!(
                "--ps-mode async --ps-colocate runs a server thread beside each worker, which needs \
                 MPI_THREAD_MULTIPLE; this MPI library provides {threading:?}"
            )));
        }
        Ok(ParameterServer {
            up: Link::new(world.comm.duplicate(), threaded)?,
            down: Link::new(world.comm.duplicate(), threaded)?,
            control: world.comm.duplicate(),
            rank: world.rank,
            size: world.size as usize,
            roles,
            config: cfg,
            path: DataPath::choose(config.device, config.cuda_aware),
            device: config.device,
            layout: None,
            send_bufs: Vec::new(),
            recv_bufs: Vec::new(),
            device_send_bufs: Vec::new(),
            device_recv_bufs: Vec::new(),
            own: None,
            push_bufs: Vec::new(),
            thread: None,
            bench_state: None,
            stop_thread: Arc::new(AtomicBool::new(false)),
            staleness: Staleness::default(),
            trained: false,
            restored: None,
            final_state: None,
        })
    }

    fn is_worker(&self) -> bool {
        self.roles.workers.contains(&self.rank)
    }

    /// Index of this rank among the servers, if it is one.
    fn server_index(&self) -> Option<usize> {
        self.roles.servers.iter().position(|&r| r == self.rank)
    }

    /// Makes the layout for `tensors` (the same on every rank), checking it fits.
    fn ensure_layout(&mut self, tensors: &[Tensor]) -> Result<()> {
        let sizes: Vec<usize> = tensors.iter().map(|t| t.numel()).collect();
        if self.layout.as_ref().is_some_and(|l| l.sizes == sizes) {
            return Ok(());
        }
        common_dtype(tensors)?;
        let server_of = partition(&sizes, self.roles.servers.len())?;
        let buckets = server_buckets(&sizes, &server_of, self.roles.servers.len());
        // Worker buffers: on the device with a CUDA-aware MPI, else on the host (pinned for a GPU).
        let (kind, device) = tensors.first().map_or((Kind::Float, Device::Cpu), |t| (t.kind(), t.device()));
        let make = |len: usize| -> Result<Tensor> {
            let t = match self.path {
                DataPath::Direct => Tensor::f_zeros([len as i64], (kind, device))?,
                DataPath::Staged if device.is_cuda() => raw::pin_memory(&Tensor::f_zeros([len as i64], (kind, Device::Cpu))?)?,
                DataPath::Staged => Tensor::f_zeros([len as i64], (kind, Device::Cpu))?,
                DataPath::Host => Tensor::f_zeros([len as i64], (kind, Device::Cpu))?,
            };
            Ok(t)
        };
        self.send_bufs = buckets.iter().map(|b| make(b.len)).collect::<Result<_>>()?;
        self.recv_bufs = buckets.iter().map(|b| make(b.len)).collect::<Result<_>>()?;
        let on_device = |len: usize| Tensor::f_zeros([len as i64], (kind, device));
        let staged = self.path == DataPath::Staged;
        self.device_send_bufs = if staged { buckets.iter().map(|b| on_device(b.len)).collect::<std::result::Result<_, _>>()? } else { Vec::new() };
        self.device_recv_bufs = if staged { buckets.iter().map(|b| on_device(b.len)).collect::<std::result::Result<_, _>>()? } else { Vec::new() };
        self.layout = Some(Layout { buckets, sizes });
        self.bench_state = None;
        Ok(())
    }

    /// Packs `grads` into the send buffers and waits until MPI may read them (MPI reads outside
    /// stream order). On the staged path the packing runs on the device and each server's
    /// buffer crosses to the host in one non-blocking copy (not one blocking copy per tensor).
    /// The wait also covers every copy queued earlier from the receive buffers, which MPI may
    /// then write.
    fn pack_for_mpi(&mut self, grads: &[Tensor]) -> Result<()> {
        let layout = self.layout.as_ref().expect("layout made first");
        if self.device_send_bufs.is_empty() {
            for (bucket, buf) in layout.buckets.iter().zip(&mut self.send_bufs) {
                pack(bucket, grads, buf);
            }
        } else {
            for ((bucket, on_device), host) in layout.buckets.iter().zip(&mut self.device_send_bufs).zip(&mut self.send_bufs) {
                pack(bucket, grads, on_device);
                raw::copy_into(host, on_device, true)?;
            }
        }
        wait_for_stream(self.device)
    }

    /// Unpacks the receive buffers into `out`; on the staged path through the device buffers,
    /// each filled by one non-blocking copy that the stream orders before the unpacking.
    fn unpack_from_mpi(&mut self, out: &mut [Tensor]) -> Result<()> {
        let layout = self.layout.as_ref().expect("layout made first");
        if self.device_recv_bufs.is_empty() {
            tch::no_grad(|| {
                for (bucket, buf) in layout.buckets.iter().zip(&self.recv_bufs) {
                    unpack(bucket, buf, out);
                }
            });
            return Ok(());
        }
        for ((bucket, on_device), host) in layout.buckets.iter().zip(&mut self.device_recv_bufs).zip(&self.recv_bufs) {
            raw::copy_into(on_device, host, true)?;
            tch::no_grad(|| unpack(bucket, on_device, out));
        }
        Ok(())
    }

    /// Worker side of one exchange with every server: push `grads`, pull into `out`.
    fn push_pull(&mut self, grads: &[Tensor], out: &mut [Tensor]) -> Result<()> {
        self.pack_for_mpi(grads)?;
        let (up, down) = (&self.up, &self.down);
        let servers = &self.roles.servers;
        let mut sends: Vec<_> = mpi_buffers(&mut self.send_bufs)?;
        let mut recvs: Vec<_> = mpi_buffers(&mut self.recv_bufs)?;
        mpi::request::scope(|scope| {
            let pulls: Vec<_> = recvs
                .iter_mut()
                .zip(servers)
                .map(|(buf, &s)| down.immediate_receive_into(scope, s, buf, PULL))
                .collect();
            let pushes: Vec<_> = sends
                .iter_mut()
                .zip(servers)
                .map(|(buf, &s)| up.immediate_send(scope, s, &*buf, PUSH))
                .collect();
            pulls.into_iter().for_each(|r| r.wait_without_status());
            pushes.into_iter().for_each(|r| r.wait_without_status());
        });
        drop((sends, recvs));
        self.unpack_from_mpi(out)
    }

    /// Colocated sync: one round in which this rank serves its share inline while working.
    /// `optimize`: step the optimizer and return weights; otherwise return the plain sum.
    fn inline_round(&mut self, grads: &[Tensor], out: &mut [Tensor], optimize: bool) -> Result<()> {
        let me = self.server_index().expect("colocated ranks all serve");
        self.pack_for_mpi(grads)?;
        let layout = self.layout.as_ref().expect("layout made first");
        let share = layout.buckets[me].len;
        let workers = self.roles.workers.clone();
        let servers = self.roles.servers.clone();
        if self.push_bufs.len() != workers.len() || self.push_bufs.first().is_some_and(|b| b.numel() != share) {
            self.push_bufs = workers.iter().map(|_| Tensor::f_zeros([share as i64], (Kind::Float, Device::Cpu))).collect::<std::result::Result<_, _>>()?;
        }
        let (up, down) = (&self.up, &self.down);
        // Gradients for my share arrive from every other worker while mine leave.
        {
            let mut incoming: Vec<_> = mpi_buffers(&mut self.push_bufs)?;
            let mut outgoing: Vec<_> = mpi_buffers(&mut self.send_bufs)?;
            mpi::request::scope(|scope| {
                let recvs: Vec<_> = incoming
                    .iter_mut()
                    .zip(&workers)
                    .filter(|(_, &w)| w != self.rank)
                    .map(|(buf, &w)| up.immediate_receive_into(scope, w, buf, PUSH))
                    .collect();
                let sends: Vec<_> = outgoing
                    .iter_mut()
                    .zip(&servers)
                    .filter(|(_, &s)| s != self.rank)
                    .map(|(buf, &s)| up.immediate_send(scope, s, &*buf, PUSH))
                    .collect();
                recvs.into_iter().for_each(|r| r.wait_without_status());
                sends.into_iter().for_each(|r| r.wait_without_status());
            });
        }
        // My own push is a local copy; then sum in worker order, so that every run adds alike.
        let mine = self.send_bufs[me].f_to_device(Device::Cpu)?;
        let my_index = workers.iter().position(|&w| w == self.rank).expect("colocated ranks all work");
        self.push_bufs[my_index].f_copy_(&mine)?;
        let state = self.own.as_mut().expect("colocated state made in prepare");
        let result = state.combine(&self.push_bufs, optimize)?;
        // My share goes to every other worker; the other shares come from their servers.
        {
            let mut result_view = result.shallow_clone();
            // SAFETY: the server share's result tensor (its weights or sum), a host tensor of
            // the server state that nothing else touches until the sends below complete.
            let result_mpi = unsafe { raw::mpi_buffer_mut::<f32>(&mut result_view)? };
            let mut incoming: Vec<_> = mpi_buffers(&mut self.recv_bufs)?;
            mpi::request::scope(|scope| {
                let recvs: Vec<_> = incoming
                    .iter_mut()
                    .zip(&servers)
                    .filter(|(_, &s)| s != self.rank)
                    .map(|(buf, &s)| down.immediate_receive_into(scope, s, buf, PULL))
                    .collect();
                let sends: Vec<_> = workers
                    .iter()
                    .filter(|&&w| w != self.rank)
                    .map(|&w| down.immediate_send(scope, w, &result_mpi, PULL))
                    .collect();
                recvs.into_iter().for_each(|r| r.wait_without_status());
                sends.into_iter().for_each(|r| r.wait_without_status());
            });
        }
        self.recv_bufs[me].f_copy_(&result)?;
        self.unpack_from_mpi(out)
    }

    /// The server of share `index` with weights taken from `params`.
    fn server_state(&self, index: usize, params: &[Tensor]) -> Result<ServerState> {
        let layout = self.layout.as_ref().expect("layout made first");
        let bucket = layout.buckets[index].clone();
        let mut weights = Tensor::f_zeros([bucket.len as i64], (Kind::Float, Device::Cpu))?;
        let host: Vec<Tensor> = params.iter().map(|p| p.f_to_device(Device::Cpu)).collect::<std::result::Result<_, _>>()?;
        pack(&bucket, &host, &mut weights);
        let mut state = ServerState::new(weights, &bucket, self.roles.workers.len(), &self.config, crate::optim::exempt_from_lars(params))?;
        if let Some((whole, steps)) = &self.restored {
            state.restore_state(&bucket, whole, *steps)?;
        }
        Ok(state)
    }

    /// Rank 0: every server's optimizer state share, as whole buffers per slot and parameter
    /// (`own`: this rank's share when it is a server itself).
    fn collect_state(&self, params: &[Tensor], own: Option<Tensor>) -> Result<WholeState> {
        let layout = self.layout.as_ref().expect("layout made first");
        let slots = self.config.optimizer.kind.slots().len();
        let zeros = || params.iter().map(|p| Tensor::f_zeros(p.size().as_slice(), (Kind::Float, Device::Cpu))).collect::<std::result::Result<Vec<_>, _>>();
        let mut out: WholeState = (0..slots).map(|_| zeros()).collect::<std::result::Result<_, _>>()?;
        for (&server, bucket) in self.roles.servers.iter().zip(&layout.buckets) {
            let mut share = Tensor::f_zeros([(slots * bucket.len) as i64], (Kind::Float, Device::Cpu))?;
            match (&own, server == self.rank) {
                (Some(mine), true) => share.f_copy_(mine)?,
                _ => {
                    // SAFETY: `share` was just made here and has no other handle.
                    self.down.receive_into(server, unsafe { raw::host_slice_mut::<f32>(&mut share)? }, STATE);
                }
            }
            for (k, slot) in out.iter_mut().enumerate() {
                unpack(bucket, &share.f_narrow(0, (k * bucket.len) as i64, bucket.len as i64)?, slot);
            }
        }
        Ok(out)
    }
}

impl Described for ParameterServer {
    fn name(&self) -> &'static str {
        "ps"
    }

    fn bus_factor(&self) -> f64 {
        allreduce_bus_factor(self.size)
    }

    fn waits_for(&self) -> String {
        format!("the server rank(s) {:?}", self.roles.servers)
    }

    fn report(&self) -> ExchangeReport {
        let mut extra = serde_json::Map::new();
        extra.insert("ps_mode".into(), serde_json::to_value(self.config.mode).unwrap());
        extra.insert("ps_servers".into(), self.roles.servers.len().into());
        extra.insert("ps_colocate".into(), self.config.colocate.into());
        if self.config.mode == PsMode::Async {
            let mean = if self.staleness.count > 0 { self.staleness.sum / self.staleness.count as f64 } else { 0.0 };
            extra.insert("staleness_mean".into(), mean.into());
            extra.insert("staleness_max".into(), self.staleness.max.into());
            extra.insert("max_staleness".into(), self.config.max_staleness.map_or(serde_json::Value::Null, |s| s.into()));
        }
        ExchangeReport { data_path: Some(self.path), extra }
    }
}

impl Reduce for ParameterServer {
    fn prepare(&mut self, params: &[Tensor]) -> Result<()> {
        self.ensure_layout(params)?;
        if self.config.colocate {
            let me = self.server_index().expect("colocated ranks all serve");
            self.own = Some(self.server_state(me, params)?);
        }
        Ok(())
    }

    /// Benchmark round: the sum over the workers, pushed to the servers and pulled back.
    fn all_reduce(&mut self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        if self.layout.as_ref().is_none_or(|l| l.sizes.iter().ne(tensors.iter().map(|t| t.numel()).collect::<Vec<_>>().iter())) {
            self.prepare(tensors)?;
        }
        if self.config.colocate {
            let grads: Vec<Tensor> = tensors.iter().map(|t| t.shallow_clone()).collect();
            self.inline_round(&grads, tensors, false)?;
        } else if let Some(index) = self.server_index() {
            // The benchmark's rounds only sum: one state, made once per layout, serves them all.
            let mut state = match self.bench_state.take() {
                Some(state) => state,
                None => self.server_state(index, tensors)?,
            };
            serve_sync_round(&mut state, &self.up, &self.down, &self.roles.workers, &self.config, false)?;
            self.bench_state = Some(state);
        } else {
            let grads: Vec<Tensor> = tensors.iter().map(|t| t.shallow_clone()).collect();
            self.push_pull(&grads, tensors)?;
        }
        if op == ReduceOp::Mean {
            for t in tensors.iter_mut() {
                let _ = t.f_div_scalar_(self.roles.workers.len() as f64)?;
            }
        }
        Ok(())
    }

    fn contributes(&self) -> bool {
        self.is_worker()
    }

    /// Workers tell every server they are done and take the final weights; a colocated server
    /// thread is joined; then the staleness figures are gathered.
    fn finish(&mut self, params: &mut [Tensor]) -> Result<()> {
        let server_loops = !(self.config.colocate && self.config.mode == PsMode::Sync);
        if self.is_worker() && self.trained && server_loops {
            let (up, down) = (&self.up, &self.down);
            for &s in &self.roles.servers {
                up.send(s, &[0u8; 0][..], DONE);
            }
            // Copies to the device queued from the receive buffers by the last step must be
            // done before MPI writes them again.
            wait_for_stream(self.device)?;
            let mut recvs: Vec<_> = mpi_buffers(&mut self.recv_bufs)?;
            for (buf, &s) in recvs.iter_mut().zip(&self.roles.servers) {
                down.receive_into(s, buf, FINAL);
            }
            drop(recvs);
            self.unpack_from_mpi(params)?;
            // Synchronous servers follow their final weights with their momentum, for the
            // checkpoint rank 0 may write at the end.
            if self.config.mode == PsMode::Sync && self.rank == self.roles.workers[0] {
                self.final_state = Some(self.collect_state(params, None)?);
            }
        }
        if let Some(thread) = self.thread.take() {
            self.staleness = thread.join()?;
        }
        // Staleness over all servers (every rank calls finish at the same point).
        let local = [self.staleness.sum, self.staleness.count as f64];
        let mut total = [0.0f64; 2];
        self.control.all_reduce_into(&local[..], &mut total[..], SystemOperation::sum());
        let mut max = 0u64;
        self.control.all_reduce_into(&self.staleness.max, &mut max, SystemOperation::max());
        self.staleness = Staleness { sum: total[0], count: total[1] as u64, max };
        Ok(())
    }
}

impl Training for ParameterServer {
    fn role(&self) -> Role {
        match self.roles.workers.iter().position(|&w| w == self.rank) {
            Some(index) => Role::Worker { index, count: self.roles.workers.len() },
            None => Role::Server,
        }
    }

    fn lockstep(&self) -> bool {
        self.config.mode == PsMode::Sync
    }

    /// Worker: push gradients, pull the weights the servers computed (the local optimizer is
    /// not used: servers own the optimizer state).
    fn update(&mut self, params: &mut [Tensor], grads: &mut [Tensor], _sgd: &mut Optimizer) -> Result<()> {
        self.trained = true;
        if self.config.colocate && self.config.mode == PsMode::Async && self.thread.is_none() {
            // This rank's server starts with the first step; pushes that reach it earlier wait
            // in MPI until it does.
            let state = self.own.take().expect("colocated state made in prepare");
            let (up, down) = self.up.shared().zip(self.down.shared()).expect("colocated async links are shared");
            let (workers, config, stop) = (self.roles.workers.clone(), self.config.clone(), self.stop_thread.clone());
            self.thread = Some(CommThread::spawn("ps-server", self.device, move || {
                serve_async(state, &*up, &*down, &workers, &config, true, &stop).map(|(_, s)| s)
            })?);
        }
        if self.config.colocate && self.config.mode == PsMode::Sync {
            let g: Vec<Tensor> = grads.iter().map(|t| t.shallow_clone()).collect();
            self.inline_round(&g, params, true)
        } else {
            let g: Vec<Tensor> = grads.iter().map(|t| t.shallow_clone()).collect();
            self.push_pull(&g, params)
        }
    }

    fn serve(&mut self, params: &mut [Tensor], _sgd: &mut Optimizer) -> Result<()> {
        let index = self.server_index().expect("serve runs on server ranks");
        let state = self.server_state(index, params)?;
        let (state, staleness) = match self.config.mode {
            PsMode::Sync => serve_sync(state, &self.up, &self.down, &self.roles.workers, &self.config)?,
            PsMode::Async => serve_async(state, &self.up, &self.down, &self.roles.workers, &self.config, false, &AtomicBool::new(false))?,
        };
        self.staleness = staleness;
        // Keep the final weights of this share in the server's copy of the model.
        let layout = self.layout.as_ref().expect("layout made first");
        tch::no_grad(|| unpack(&layout.buckets[index], &state.weights, params));
        Ok(())
    }
}

impl Checkpointed for ParameterServer {
    fn optimizer_state(&mut self, params: &[Tensor], _optimizer: &Optimizer) -> Result<Option<WholeState>> {
        if self.config.mode == PsMode::Async {
            return Err(Error::exchange("ps", "asynchronous servers have no consistent optimizer state to checkpoint"));
        }
        let root = self.roles.workers[0];
        if let Some(m) = self.final_state.take() {
            return Ok(Some(m));
        }
        if self.config.colocate {
            let share = self.own.as_ref().expect("colocated state").state_share()?;
            if self.rank == root {
                return Ok(Some(self.collect_state(params, Some(share))?));
            }
            // SAFETY: `share` is a fresh copy (state_share) with no other handle.
            self.down.send(root, unsafe { raw::host_slice::<f32>(&share)? }, STATE);
            return Ok(None);
        }
        if self.rank == root {
            return Ok(Some(self.collect_state(params, None)?));
        }
        Ok(None)
    }

    fn restore_optimizer(&mut self, params: &[Tensor], state: WholeState, steps: u64, _optimizer: &mut Optimizer) -> Result<()> {
        self.restored = Some((state, steps));
        if self.own.is_some() {
            // A colocated share made before the checkpoint was loaded: remake it from the
            // restored weights and momentum. Dedicated servers make theirs when they start.
            let me = self.server_index().expect("colocated ranks all serve");
            self.own = Some(self.server_state(me, params)?);
        }
        Ok(())
    }
}

impl Drop for ParameterServer {
    fn drop(&mut self) {
        // On an error path a colocated server thread may still wait for pushes: stop it, and
        // dropping the thread joins it before MPI can be finalized (see comm_thread).
        self.stop_thread.store(true, Ordering::Relaxed);
        self.thread.take();
    }
}

/// The parameter server's own send, receive and push buffers as MPI buffers.
fn mpi_buffers(buffers: &mut [Tensor]) -> Result<Vec<mpi::datatype::DynBufferMut<'_>>> {
    buffers
        .iter_mut()
        // SAFETY: these tensors are made by the parameter server (ensure_layout, inline_round)
        // and never handed out, so no other handle touches them; device buffers exist only on
        // the direct path (a CUDA-aware MPI), filled by copies waited for before the exchange.
        .map(|b| unsafe { raw::mpi_buffer_mut::<f32>(b) })
        .collect()
}
