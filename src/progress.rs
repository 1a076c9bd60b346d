//! A thread that moves a rank's point-to-point messages along while the rank computes.
//!
//! An MPI library moves a large message only inside MPI calls: its rendezvous sends the first
//! fragment, and the rest goes when the sender calls MPI again (Open MPI's ob1 pipeline
//! protocol over shared memory without a single-copy mechanism, over TCP, and most networks
//! without hardware offload). A pipeline stage posts its sends and goes on with its next
//! forward or backward, which makes no MPI call for tens of milliseconds, so its neighbour,
//! already waiting, waits for that compute too. With Open MPI's single-copy path (CMA) the
//! receiver pulls the data itself and nothing stalls, but that path needs the kernel's
//! `process_vm_readv` between the ranks, which containers and hardened kernels often refuse:
//! on the 16-core GPU machine (2026-11-27) four stages of ResNet-18 idled 48-60% of each step
//! where the replay of their schedule, from their own measured compute, gave 11-34%; on the
//! development VM two stages with `btl_vader_single_copy_mechanism=none` idled 37% and 44%
//! against replays of 15% and 13% (results/pipeline/progress/).
//!
//! Whether a rank needs the thread is measured, not guessed ([`sender_stalls`]): at set-up each
//! stage sends its neighbour a message of the pipeline's largest size and then makes no MPI call
//! for [`HOLD`]; where the message arrives only once the sender calls MPI again, the pipeline
//! starts the thread. Where it arrives at once (CMA, eager sizes) the thread would only cost:
//! on the development VM's one-core ranks a thread that always ran took 2-8% of ResNet-18's
//! and vit-tiny's images/s with CMA, where without CMA it gives ResNet-18 1.3-1.5x.
//!
//! The thread calls `MPI_Iprobe` on a communicator of its own (nothing is ever sent on it)
//! while the pipeline runs a step ([`Progress::active`]), often just after each send is posted
//! and less often as it ages ([`FIRST_INTERVAL`], [`LONGEST_INTERVAL`]), and sleeps between
//! steps: every MPI library runs its progress engine in a probe that matches
//! nothing, which pushes the pending fragments of every communicator. This needs
//! `MPI_THREAD_MULTIPLE` (the command asks for it where a pipeline runs); where the library
//! gives less, [`Progress::start`] says so and the messages move only when the stage waits.
//! MPICH can run such a thread itself (`MPIR_CVAR_ASYNC_PROGRESS=1`), Open MPI 4.1 cannot.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use crate::raw::SendComm;

/// Between two probes: the first after a send is posted ([`Progress::sent`]), doubling to the
/// longest while no new send comes. Each probe costs a wake-up and a pass of the progress
/// engine, taken from the rank's compute where the rank has one core: on the development VM
/// (one core per rank, no CMA) probes every 100 us cost ResNet-18's two stages 15% of their
/// images/s and 50 us after each send then doubling 2-4%; probes every 1 ms cost nothing
/// measurable and brought ResNet-18 from 64 to 95 images/s, while vit-tiny, whose micro-batches
/// take 1-2 ms, then idled more than without the thread. A message waiting for its sender waits
/// up to the interval.
const FIRST_INTERVAL: Duration = Duration::from_micros(200);
const LONGEST_INTERVAL: Duration = Duration::from_millis(1);

/// How long the sender of [`sender_stalls`]'s message makes no MPI call.
pub const HOLD: Duration = Duration::from_millis(20);

/// The progress thread of one rank's pipeline.
pub struct Progress {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    /// How many [`Active`] guards are alive: the thread probes while this is above zero.
    active: Mutex<usize>,
    wake: Condvar,
    /// Sends posted so far ([`Progress::sent`]).
    kicks: AtomicU64,
    stop: AtomicBool,
}

/// While alive, the progress thread probes (see [`Progress::active`]).
pub struct Active<'a>(&'a Progress);

impl Progress {
    /// The progress thread over a duplicate of `comm`, or why there is none: the MPI library
    /// was started with less than `MPI_THREAD_MULTIPLE`. Collective over `comm` (the duplicate).
    pub fn start(comm: &SimpleCommunicator) -> std::result::Result<Progress, String> {
        let threading = mpi::environment::threading_support();
        let own = comm.duplicate();
        let own = SendComm::new(own, threading).map_err(|e| e.to_string())?;
        let shared = Arc::new(Shared::default());
        let theirs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("mpi-progress".into())
            .spawn(move || run(&own, &theirs))
            .map_err(|e| format!("could not start the MPI progress thread: {e}"))?;
        Ok(Progress { shared, thread: Some(thread) })
    }

    /// Probes run until the guard is dropped (guards nest: the thread rests once all are gone).
    pub fn active(&self) -> Active<'_> {
        let mut n = self.shared.active.lock().unwrap_or_else(|p| p.into_inner());
        *n += 1;
        if *n == 1 {
            self.shared.wake.notify_one();
        }
        Active(self)
    }

    /// A send was posted: probe soon, its rendezvous is likely waiting.
    pub fn sent(&self) {
        self.shared.kicks.fetch_add(1, Ordering::Release);
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        let mut n = self.0.shared.active.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(comm: &SendComm, shared: &Shared) {
    let (mut seen, mut interval) = (0u64, FIRST_INTERVAL);
    loop {
        {
            let mut n = shared.active.lock().unwrap_or_else(|p| p.into_inner());
            while *n == 0 && !shared.stop.load(Ordering::Acquire) {
                n = shared.wake.wait(n).unwrap_or_else(|p| p.into_inner());
            }
        }
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        // Matches nothing (nothing is sent on this communicator); runs the progress engine.
        let _ = comm.comm().any_process().immediate_probe();
        // Probes come fast after a send is posted (its rendezvous waits for the receiver's
        // answer, then for the sender to push the data), and slower as it ages.
        let kicks = shared.kicks.load(Ordering::Acquire);
        if kicks != seen {
            (seen, interval) = (kicks, FIRST_INTERVAL);
        } else {
            interval = (interval * 2).min(LONGEST_INTERVAL);
        }
        std::thread::sleep(interval);
    }
}

/// What [`sender_stalls`] measured: the slowest arrival of a message of `bytes` between two
/// neighbouring stages while its sender made no MPI call for [`HOLD`].
#[derive(Clone, Copy, Debug)]
pub struct StallProbe {
    pub bytes: usize,
    pub arrival_ms: f64,
}

impl StallProbe {
    /// Whether messages wait for their sender's MPI calls: the slowest arrived only after most
    /// of the hold (a transfer that moves alone takes well under a millisecond per MiB).
    pub fn stalls(&self) -> bool {
        self.arrival_ms > HOLD.as_secs_f64() * 1e3 / 2.0
    }
}

/// Measures whether a message of `bytes` from stage to stage moves while its sender computes:
/// in two rounds (even stages send, odd ones receive; then the other way), each sender posts
/// the message to its next stage and sleeps for [`HOLD`] before waiting for it, while each
/// receiver tests for it and times its arrival. Collective over `comm`, the pipeline's ranks
/// ranked by stage; every rank gets the slowest arrival.
pub fn sender_stalls(comm: &SimpleCommunicator, bytes: usize) -> StallProbe {
    let (stage, stages) = (comm.rank(), comm.size());
    let count = bytes.div_ceil(4).max(1);
    let mut slowest = 0.0f64;
    for round in 0..2 {
        let sends = stage % 2 == round && stage + 1 < stages;
        let receives = stage % 2 != round && stage > 0;
        if sends {
            let message = vec![0f32; count];
            mpi::request::scope(|scope| {
                let request = comm.process_at_rank(stage + 1).immediate_send_with_tag(scope, &message[..], PROBE_TAG);
                std::thread::sleep(HOLD);
                request.wait();
            });
        } else if receives {
            let mut message = vec![0f32; count];
            let started = std::time::Instant::now();
            mpi::request::scope(|scope| {
                let mut request = comm.process_at_rank(stage - 1).immediate_receive_into_with_tag(scope, &mut message[..], PROBE_TAG);
                // Tests (which drive this side's progress) until it is here.
                loop {
                    match request.test() {
                        Ok(_) => break,
                        Err(pending) => request = pending,
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
            });
            slowest = slowest.max(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    let mut arrival_ms = 0.0f64;
    comm.all_reduce_into(&slowest, &mut arrival_ms, mpi::collective::SystemOperation::max());
    StallProbe { bytes: count * 4, arrival_ms }
}

/// The probe's tag: the pipeline's own tags start at 0 and its schedule's receives are posted
/// only after set-up, so any tag would do; one far from theirs reads better in a trace.
const PROBE_TAG: i32 = 32_000;
