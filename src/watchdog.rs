//! The exchange watchdog (`--exchange-timeout-s`): a cut link or a dead peer must end the job,
//! not hang it until the batch system's time limit.
//!
//! Every exchange a worker makes tells the watchdog what it is (strategy, step, bucket, the
//! peers it waits for) while it runs, and reports progress as requests complete. A thread
//! checks once a second: an exchange that has made no progress for the timeout is logged with
//! what it waits for, and the job is aborted (`MPI_Abort`, the one MPI call made off the main
//! thread, as the panic hook does). Every rank watches its own exchanges, so every rank that can
//! still speak says what it was waiting for.
//!
//! The small collectives between exchanges (the loss report, the stop agreement each step,
//! evaluation's sums, the bench's barriers) are watched too, through [`collective`]: a rank that
//! has received all it needs from an exchange goes on to them while a peer behind a cut link
//! is still stuck in the exchange, and would otherwise wait there unwatched for ever. Compute
//! (forward, backward, evaluation's forward passes, rank 0 writing a checkpoint) is not
//! watched, but a rank waiting for a peer's compute is: the other ranks wait for rank 0's
//! checkpoint write in the stop agreement, so `--exchange-timeout-s` must exceed the longest
//! write. Dedicated parameter servers, which wait for workers by design, have their own
//! `--ps-timeout-s`.
//!
//! Waits that are not an exchange strategy's are watched the same way through [`waiting`]: a
//! pipeline stage's messages to and from its neighbours (each named by stage, micro-batch and
//! world rank), the pipelined evaluation, the gathers of a pipelined checkpoint. Peers are
//! named by their rank in MPI_COMM_WORLD ([`crate::topology::world_ranks_of`]): a rank in a
//! stage's or a tensor-parallel group's communicator says nothing about which process hangs.
//!
//! Each rank also keeps its last few communication events (what began or ended, with whom, at
//! which step, how long ago), as PyTorch's NCCL flight recorder does, and prints them when its
//! watchdog fires: one log then shows which rank stopped at which step.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// What the running exchange is.
#[derive(Clone, Debug)]
struct Activity {
    /// The exchange strategy, the collective, or who waits ("pipeline stage 1").
    strategy: String,
    bucket: Option<usize>,
    /// Who this rank waits for, in words ("rank 3 (left)", "all 8 ranks").
    peers: String,
    entered: Instant,
}

struct State {
    timeout: Duration,
    rank: i32,
    step: AtomicU64,
    /// Bumped on every completed request or message the exchanges report; the checking thread
    /// reads it together with the raw layer's count of the requests its segments complete
    /// (`raw::completed_requests`), which counts without knowing of the watchdog.
    progress: AtomicU64,
    current: Mutex<Option<Activity>>,
    /// The last [`RECENT_EVENTS`] communication events, oldest first.
    recent: Mutex<VecDeque<Event>>,
}

/// A communication that began or ended, for the flight recorder.
struct Event {
    at: Instant,
    step: u64,
    began: bool,
    what: String,
    peers: String,
}

/// How many events the flight recorder keeps: enough to see the last step's pattern.
const RECENT_EVENTS: usize = 8;

impl State {
    fn record(&self, began: bool, activity: &Activity) {
        let event = Event { at: Instant::now(), step: self.step.load(Ordering::Relaxed), began, what: activity.strategy.clone(), peers: activity.peers.clone() };
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if recent.len() == RECENT_EVENTS {
            recent.pop_front();
        }
        recent.push_back(event);
    }

    /// The recorded events, oldest first, as one line.
    fn recent_events(&self) -> String {
        let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        let events: Vec<String> = recent
            .iter()
            .map(|e| format!("[step {}, {:.1} s ago: {} {} with {}]", e.step, e.at.elapsed().as_secs_f64(), if e.began { "began" } else { "ended" }, e.what, e.peers))
            .collect();
        if events.is_empty() { "none".into() } else { events.join(" ") }
    }
}

static STATE: OnceLock<State> = OnceLock::new();

/// How long the watchdog lets MPI_Abort try before this rank exits by itself.
const ABORT_GRACE: Duration = Duration::from_secs(5);

/// Starts the watchdog for this rank (once; later calls change nothing). `timeout` zero turns
/// it off.
pub fn start(rank: i32, timeout: Duration) {
    if timeout.is_zero() || STATE.get().is_some() {
        return;
    }
    let state = State {
        timeout,
        rank,
        step: AtomicU64::new(0),
        progress: AtomicU64::new(0),
        current: Mutex::new(None),
        recent: Mutex::new(VecDeque::with_capacity(RECENT_EVENTS)),
    };
    if STATE.set(state).is_err() {
        return;
    }
    let spawned = std::thread::Builder::new().name("exchange-watchdog".into()).spawn(watch);
    if let Err(e) = spawned {
        log::warn!("the exchange watchdog could not start ({e}); a hung exchange will not be detected");
    }
}

/// The training step exchanges now belong to (for the message).
pub fn set_step(step: u64) {
    if let Some(s) = STATE.get() {
        s.step.store(step, Ordering::Relaxed);
    }
}

/// Progress: a request completed, a message arrived.
pub fn progress() {
    if let Some(s) = STATE.get() {
        s.progress.fetch_add(1, Ordering::Relaxed);
    }
}

/// Marks an exchange as running until the guard is dropped.
pub fn exchange(strategy: &'static str, peers: impl FnOnce() -> String) -> ExchangeGuard {
    waiting(|| strategy.to_string(), peers)
}

/// Marks a wait for peers that is not an exchange (a pipeline stage's message, a checkpoint's
/// gather) as running until the guard is dropped: `who` says who waits ("pipeline stage 1"),
/// `peers` what for, naming peers by world rank. Neither is computed without a watchdog.
pub fn waiting(who: impl FnOnce() -> String, peers: impl FnOnce() -> String) -> ExchangeGuard {
    if let Some(s) = STATE.get() {
        let activity = Activity { strategy: who(), bucket: None, peers: peers(), entered: Instant::now() };
        s.record(true, &activity);
        *s.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(activity);
        s.progress.fetch_add(1, Ordering::Relaxed);
    }
    ExchangeGuard(())
}

/// The bucket the running exchange works on (for the message).
pub fn set_bucket(bucket: usize) {
    if let Some(s) = STATE.get() {
        if let Some(a) = s.current.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            a.bucket = Some(bucket);
        }
        s.progress.fetch_add(1, Ordering::Relaxed);
    }
}

/// Runs `f`, a blocking collective over the ranks of `comm` outside any exchange, watched as
/// `what` (see the module comment).
pub fn collective<T>(what: &'static str, comm: &impl mpi::topology::Communicator, f: impl FnOnce() -> T) -> T {
    let _watched = exchange(what, || format!("all {} ranks of its communicator", comm.size()));
    f()
}

pub struct ExchangeGuard(());

impl Drop for ExchangeGuard {
    fn drop(&mut self) {
        if let Some(s) = STATE.get() {
            let ended = s.current.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(activity) = ended {
                s.record(false, &activity);
            }
            s.progress.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn watch() {
    let s = STATE.get().expect("started after the state is set");
    let tick = (s.timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    // Both counts only grow, so their sum changes whenever either does.
    let total_progress = || s.progress.load(Ordering::Relaxed).wrapping_add(crate::raw::completed_requests());
    let mut seen = total_progress();
    let mut quiet_since = Instant::now();
    loop {
        std::thread::sleep(tick);
        let now = total_progress();
        if now != seen {
            seen = now;
            quiet_since = Instant::now();
            continue;
        }
        let current = s.current.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(activity) = current else {
            quiet_since = Instant::now();
            continue;
        };
        if quiet_since.elapsed() < s.timeout {
            continue;
        }
        let bucket = activity.bucket.map_or(String::new(), |b| format!(" (bucket {b})"));
        let line = format!(
            "error: rank {}: exchange watchdog: {} at step {}{bucket} has made no progress for {:.0} s (in it for {:.0} s), waiting for {}; aborting the job (--exchange-timeout-s)\nrank {}: its last communication events, oldest first: {}\n",
            s.rank,
            activity.strategy,
            s.step.load(Ordering::Relaxed),
            quiet_since.elapsed().as_secs_f64(),
            activity.entered.elapsed().as_secs_f64(),
            activity.peers,
            s.rank,
            s.recent_events()
        );
        // MPI_Abort asks the launcher to end every rank; across a cut link it may wait for a
        // daemon it cannot reach. This rank ends either way: the timer starts first, because
        // even the message below can block when the launcher stops reading this rank's stderr.
        std::thread::spawn(|| {
            std::thread::sleep(ABORT_GRACE);
            crate::raw::exit_now(1);
        });
        use std::io::Write;
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
        crate::raw::abort_world(1);
    }
}
