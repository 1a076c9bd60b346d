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
//! Messages: PUSH (worker to server, gradients), PULL (server to worker, weights), DONE (worker
//! to server, end of training), FINAL (server to worker, the final weights) and STATE (server
//! to rank 0, its momentum buffer, at checkpoints and at the end), each flat buffer holding the
//! server's tensors in tensor order. Workers send on `up`, servers answer on
//! `down`, so that a colocated server thread and its rank's worker never take each other's
//! messages.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::point_to_point::Status;
use mpi::topology::{Rank, SimpleCommunicator};
use mpi::traits::*;
use mpi::Tag;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::exchange::buckets::{pack, unpack};
use crate::exchange::comm_thread::CommThread;
use crate::exchange::config::{worker_count, ExchangeConfig, PsConfig, PsMode, RoleOptions, StrategyKind};
use crate::exchange::staging::wait_for_stream;
use crate::exchange::strategy::{allreduce_bus_factor, common_dtype, DataPath, Exchange, ExchangeReport, ReduceOp, Role};
use crate::optim::Sgd;
use crate::plan::buckets::{Bucket, Slot};
use crate::raw::{self, PeerComm, PointToPoint};
use crate::topology::World;

const PUSH: Tag = 1;
const PULL: Tag = 2;
const DONE: Tag = 3;
const FINAL: Tag = 4;
const STATE: Tag = 5;

/// Server of every tensor: largest tensors first, each to the server holding the fewest bytes
/// so far (ties to the lowest index), so that servers carry near-equal traffic.
pub fn partition(sizes: &[usize], servers: usize) -> Result<Vec<usize>> {
    if servers > sizes.len() {
        return Err(Error::usage(format!(
            "{servers} parameter servers but the model has {} parameter tensors: each server needs at least one",
            sizes.len()
        )));
    }
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; servers];
    let mut server_of = vec![0; sizes.len()];
    for t in order {
        let s = (0..servers).min_by_key(|&s| (load[s], s)).expect("at least one server");
        server_of[t] = s;
        load[s] += sizes[t];
    }
    Ok(server_of)
}

/// Each server's tensors as a bucket (slots in tensor order).
fn server_buckets(sizes: &[usize], server_of: &[usize], servers: usize) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = (0..servers).map(|_| Bucket { slots: Vec::new(), len: 0 }).collect();
    for (t, &s) in server_of.iter().enumerate() {
        let b = &mut buckets[s];
        b.slots.push(Slot { tensor: t, offset: b.len, len: sizes[t] });
        b.len += sizes[t];
    }
    buckets
}

/// Who serves and who works.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Roles {
    pub servers: Vec<Rank>,
    pub workers: Vec<Rank>,
}

impl Roles {
    pub fn new(ranks: usize, config: &PsConfig) -> Result<Roles> {
        let all: Vec<Rank> = (0..ranks as Rank).collect();
        if config.colocate {
            return Ok(Roles { servers: all.clone(), workers: all });
        }
        let workers = worker_count(StrategyKind::Ps, ranks, &RoleOptions { servers: config.servers, colocate: false })?;
        Ok(Roles { servers: all[workers..].to_vec(), workers: all[..workers].to_vec() })
    }
}

/// Staleness seen by one server (async).
#[derive(Clone, Copy, Debug, Default)]
struct Staleness {
    sum: f64,
    count: u64,
    max: u64,
}

/// The layout of the exchange, made once the tensors are known.
struct Layout {
    buckets: Vec<Bucket>,
    sizes: Vec<usize>,
}

/// One of the parameter server's two communicators: used by the main thread alone, or shared
/// with a colocated server thread (asynchronous colocated servers only, which is what needs
/// MPI_THREAD_MULTIPLE).
enum Link {
    Local(SimpleCommunicator),
    Shared(Arc<PeerComm>),
}

impl Link {
    fn new(comm: SimpleCommunicator, shared: bool) -> Result<Link> {
        Ok(if shared {
            Link::Shared(Arc::new(PeerComm::new(comm, mpi::environment::threading_support())?))
        } else {
            Link::Local(comm)
        })
    }

    fn shared(&self) -> Option<Arc<PeerComm>> {
        match self {
            Link::Shared(c) => Some(c.clone()),
            Link::Local(_) => None,
        }
    }
}

impl PointToPoint for Link {
    fn send<B: mpi::datatype::Buffer + ?Sized>(&self, to: Rank, buf: &B, tag: Tag) {
        match self {
            Link::Local(c) => c.send(to, buf, tag),
            Link::Shared(c) => c.send(to, buf, tag),
        }
    }
    fn receive_into<B: mpi::datatype::BufferMut + ?Sized>(&self, from: Rank, buf: &mut B, tag: Tag) {
        match self {
            Link::Local(c) => c.receive_into(from, buf, tag),
            Link::Shared(c) => c.receive_into(from, buf, tag),
        }
    }
    fn immediate_send<'a, Sc: mpi::request::Scope<'a>, B: 'a + mpi::datatype::Buffer + ?Sized>(&self, scope: Sc, to: Rank, buf: &'a B, tag: Tag) -> mpi::request::Request<'a, B, Sc> {
        match self {
            Link::Local(c) => c.immediate_send(scope, to, buf, tag),
            Link::Shared(c) => c.immediate_send(scope, to, buf, tag),
        }
    }
    fn immediate_receive_into<'a, Sc: mpi::request::Scope<'a>, B: 'a + mpi::datatype::BufferMut + ?Sized>(&self, scope: Sc, from: Rank, buf: &'a mut B, tag: Tag) -> mpi::request::Request<'a, B, Sc> {
        match self {
            Link::Local(c) => c.immediate_receive_into(scope, from, buf, tag),
            Link::Shared(c) => c.immediate_receive_into(scope, from, buf, tag),
        }
    }
    fn probe(&self, from: Option<Rank>) -> Option<(mpi::point_to_point::Message, Status)> {
        match self {
            Link::Local(c) => c.probe(from),
            Link::Shared(c) => c.probe(from),
        }
    }
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
    restored: Option<(Vec<Tensor>, u64)>,
    /// Rank 0: the servers' momentum, sent with the final weights.
    final_momentum: Option<Vec<Tensor>>,
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
            final_momentum: None,
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
        let mut state = ServerState::new(weights, self.roles.workers.len(), &self.config)?;
        if let Some((momentum, steps)) = &self.restored {
            state.restore_momentum(&bucket, momentum, *steps)?;
        }
        Ok(state)
    }

    /// Rank 0: every server's momentum share, as one buffer per parameter (`own`: this rank's
    /// share when it is a server itself).
    fn collect_momentum(&self, params: &[Tensor], own: Option<Tensor>) -> Result<Vec<Tensor>> {
        let layout = self.layout.as_ref().expect("layout made first");
        let mut out: Vec<Tensor> = params.iter().map(|p| Tensor::f_zeros(p.size().as_slice(), (Kind::Float, Device::Cpu))).collect::<std::result::Result<_, _>>()?;
        for (&server, bucket) in self.roles.servers.iter().zip(&layout.buckets) {
            let mut share = Tensor::f_zeros([bucket.len as i64], (Kind::Float, Device::Cpu))?;
            match (&own, server == self.rank) {
                (Some(mine), true) => share.f_copy_(mine)?,
                _ => {
                    // SAFETY: `share` was just made here and has no other handle.
                    self.down.receive_into(server, unsafe { raw::host_slice_mut::<f32>(&mut share)? }, STATE);
                }
            }
            unpack(bucket, &share, &mut out);
        }
        Ok(out)
    }
}

impl Exchange for ParameterServer {
    fn name(&self) -> &'static str {
        "ps"
    }

    fn bus_factor(&self) -> f64 {
        allreduce_bus_factor(self.size)
    }

    fn role(&self) -> Role {
        match self.roles.workers.iter().position(|&w| w == self.rank) {
            Some(index) => Role::Worker { index, count: self.roles.workers.len() },
            None => Role::Server,
        }
    }

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

    fn waits_for(&self) -> String {
        format!("the server rank(s) {:?}", self.roles.servers)
    }

    fn lockstep(&self) -> bool {
        self.config.mode == PsMode::Sync
    }

    /// Worker: push gradients, pull the weights the servers computed (the local optimizer is
    /// not used: servers own the optimizer state).
    fn update(&mut self, params: &mut [Tensor], grads: &mut [Tensor], _sgd: &mut Sgd) -> Result<()> {
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

    fn serve(&mut self, params: &mut [Tensor], _sgd: &mut Sgd) -> Result<()> {
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
                self.final_momentum = Some(self.collect_momentum(params, None)?);
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

    fn optimizer_state(&mut self, params: &[Tensor], _sgd: &Sgd) -> Result<Option<Vec<Tensor>>> {
        if self.config.mode == PsMode::Async {
            return Err(Error::exchange("ps", "asynchronous servers have no consistent optimizer state to checkpoint"));
        }
        let root = self.roles.workers[0];
        if let Some(m) = self.final_momentum.take() {
            return Ok(Some(m));
        }
        if self.config.colocate {
            let share = self.own.as_ref().expect("colocated state").momentum_share()?;
            if self.rank == root {
                return Ok(Some(self.collect_momentum(params, Some(share))?));
            }
            // SAFETY: `share` is a fresh copy (momentum_share) with no other handle.
            self.down.send(root, unsafe { raw::host_slice::<f32>(&share)? }, STATE);
            return Ok(None);
        }
        if self.rank == root {
            return Ok(Some(self.collect_momentum(params, None)?));
        }
        Ok(None)
    }

    fn restore_optimizer(&mut self, params: &[Tensor], momentum: Vec<Tensor>, steps: u64, _sgd: &mut Sgd) -> Result<()> {
        self.restored = Some((momentum, steps));
        if self.own.is_some() {
            // A colocated share made before the checkpoint was loaded: remake it from the
            // restored weights and momentum. Dedicated servers make theirs when they start.
            let me = self.server_index().expect("colocated ranks all serve");
            self.own = Some(self.server_state(me, params)?);
        }
        Ok(())
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

/// A server's share: weights and optimizer state, on the host.
struct ServerState {
    weights: Tensor,
    workers: usize,
    sgd: Sgd,
    /// Async: the momentum buffer, and the 0-dim factors of the split update.
    velocity: Tensor,
    scratch: Tensor,
    sum: Tensor,
    /// Sync: one receive buffer per worker (made at the first round).
    pushes: Vec<Vec<f32>>,
}

impl ServerState {
    fn new(weights: Tensor, workers: usize, config: &PsConfig) -> Result<ServerState> {
        let len = weights.numel() as i64;
        Ok(ServerState {
            velocity: Tensor::f_zeros([len], (Kind::Float, Device::Cpu))?,
            scratch: Tensor::f_zeros([len], (Kind::Float, Device::Cpu))?,
            sum: Tensor::f_zeros([len], (Kind::Float, Device::Cpu))?,
            pushes: Vec::new(),
            weights,
            workers,
            sgd: Sgd::new(config.sgd),
        })
    }

    /// This server's momentum buffer (zeros before the first step).
    fn momentum_share(&self) -> Result<Tensor> {
        match self.sgd.momentum_buffers().first() {
            Some(Some(m)) => Ok(m.f_detach_copy()?),
            _ => Ok(self.weights.f_zeros_like()?),
        }
    }

    /// Takes this server's share of the per-parameter `momentum` (from a checkpoint).
    fn restore_momentum(&mut self, bucket: &Bucket, momentum: &[Tensor], steps: u64) -> Result<()> {
        let mut share = self.weights.f_zeros_like()?;
        let host: Vec<Tensor> = momentum.iter().map(|m| m.f_to_device(Device::Cpu)?.f_to_kind(Kind::Float)).collect::<std::result::Result<_, _>>()?;
        pack(bucket, &host, &mut share);
        self.sgd.restore(vec![Some(share.f_detach_copy()?)], steps);
        self.velocity.f_copy_(&share)?;
        Ok(())
    }

    /// Sum of the pushes (in worker order); with `optimize`, their mean steps the optimizer and
    /// the new weights are returned, else the sum is.
    fn combine(&mut self, pushes: &[Tensor], optimize: bool) -> Result<Tensor> {
        self.sum.f_copy_(&pushes[0])?;
        for p in &pushes[1..] {
            let _ = self.sum.f_add_(p)?;
        }
        if !optimize {
            return Ok(self.sum.shallow_clone());
        }
        let _ = self.sum.f_mul_scalar_(1.0 / self.workers as f64)?;
        let mut w = [self.weights.shallow_clone()];
        let mut g = [self.sum.shallow_clone()];
        self.sgd.step(&mut w, &mut g)?;
        Ok(self.weights.shallow_clone())
    }

    /// Async: the part of round `round`'s update that does not depend on its gradients:
    /// v = momentum * v + weight_decay * w, then w -= lr * v.
    fn start_round(&mut self) -> Result<()> {
        let c = self.sgd.config;
        tch::no_grad(|| -> Result<()> {
            let _ = self.velocity.f_mul_scalar_(c.momentum)?;
            if c.weight_decay != 0.0 {
                self.scratch.f_copy_(&self.weights)?;
                let _ = self.scratch.f_mul_scalar_(c.weight_decay)?;
                let _ = self.velocity.f_add_(&self.scratch)?;
            }
            self.scratch.f_copy_(&self.velocity)?;
            let _ = self.scratch.f_mul_scalar_(c.lr)?;
            let _ = self.weights.f_sub_(&self.scratch)?;
            Ok(())
        })
    }

    /// Async: one worker's share of the round: v += g / W, w -= lr * g / W.
    fn apply_gradient(&mut self, grad: &Tensor) -> Result<()> {
        let c = self.sgd.config;
        tch::no_grad(|| -> Result<()> {
            self.scratch.f_copy_(grad)?;
            let _ = self.scratch.f_mul_scalar_(1.0 / self.workers as f64)?;
            if c.momentum != 0.0 {
                let _ = self.velocity.f_add_(&self.scratch)?;
            }
            let _ = self.scratch.f_mul_scalar_(c.lr)?;
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
fn serve_sync_round(state: &mut ServerState, up: &impl PointToPoint, down: &impl PointToPoint, workers: &[Rank], config: &PsConfig, optimize: bool) -> Result<bool> {
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
                            crate::exchange::element::accumulate(sum, pushed);
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
        let _ = state.sum.f_mul_scalar_(1.0 / state.workers as f64)?;
        let mut w = [state.weights.shallow_clone()];
        let mut g = [state.sum.shallow_clone()];
        state.sgd.step(&mut w, &mut g)?;
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
fn serve_sync(mut state: ServerState, up: &impl PointToPoint, down: &impl PointToPoint, workers: &[Rank], config: &PsConfig) -> Result<(ServerState, Staleness)> {
    let mut step = config.first_step;
    while serve_sync_round(&mut state, up, down, workers, config, true)? {
        step += 1;
        if config.checkpoint_every.is_some_and(|every| step % every == 0) {
            send_state(&state, down, workers[0])?;
        }
    }
    send_final(&state, down, workers)?;
    send_state(&state, down, workers[0])?;
    Ok((state, Staleness::default()))
}

fn send_state(state: &ServerState, down: &impl PointToPoint, root: Rank) -> Result<()> {
    let share = state.momentum_share()?;
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
fn serve_async(
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
                            state.start_round()?;
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
    use crate::optim::SgdConfig;

    #[test]
    fn partition_balances_bytes() {
        let sizes = [100, 10, 60, 50, 5, 5];
        let server_of = partition(&sizes, 2).unwrap();
        let mut load = [0usize; 2];
        for (t, &s) in server_of.iter().enumerate() {
            load[s] += sizes[t];
        }
        assert_eq!(load, [115, 115]);
        assert!(partition(&sizes, 7).unwrap_err().to_string().contains("6 parameter tensors"));
    }

    #[test]
    fn roles_leave_workers_or_fail() {
        let cfg = PsConfig { servers: 2, ..PsConfig::default() };
        let roles = Roles::new(5, &cfg).unwrap();
        assert_eq!(roles.workers, vec![0, 1, 2]);
        assert_eq!(roles.servers, vec![3, 4]);
        assert!(Roles::new(2, &cfg).is_err());
        let colocated = Roles::new(3, &PsConfig { colocate: true, ..cfg }).unwrap();
        assert_eq!(colocated.servers, vec![0, 1, 2]);
        assert_eq!(colocated.workers, vec![0, 1, 2]);
    }

    #[test]
    fn the_split_async_update_is_the_synchronous_update() {
        let sgd = SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01 };
        let cfg = PsConfig { sgd, ..PsConfig::default() };
        let w0 = Tensor::from_slice(&[1.0f32, -2.0, 0.5]);
        let grads = [Tensor::from_slice(&[0.3f32, 0.1, -0.2]), Tensor::from_slice(&[-0.1f32, 0.4, 0.2])];
        let mut sync = ServerState::new(w0.copy(), 2, &cfg).unwrap();
        let mut split = ServerState::new(w0.copy(), 2, &cfg).unwrap();
        for round in 0..3 {
            let scaled: Vec<Tensor> = grads.iter().map(|g| g * (round as f64 + 1.0)).collect();
            let _new_weights = sync.combine(&scaled, true).unwrap();
            split.start_round().unwrap();
            for g in &scaled {
                split.apply_gradient(g).unwrap();
            }
        }
        let diff = (&sync.weights - &split.weights).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{diff}");
    }
}
