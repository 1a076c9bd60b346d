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
//!
//! Waits nest (the agreements inside a checkpoint's write, inside the write's own watch): the
//! watched waits form a stack, the innermost is the one a message names, and the end of an inner
//! one leaves the outer ones watched. A rank's own work that its peers wait for (its part of a
//! sharded checkpoint) is watched through [`own_work`], so that the rank stuck in it says so:
//! a rank that waits for peers, when it fires, gives such a rank time to print its line before
//! it aborts the job.
//!
//! Before all of this, [`watch_start_up`] guards MPI's start-up, where no communicator exists
//! yet: a rank that never joins (stopped, or lost with its node) would leave the others inside
//! `MPI_Init_thread` for ever.

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
    /// The step it belongs to where that is not the training step under way: a checkpoint's,
    /// written after that step's count (`ckpt-4` after the step the loop numbers 3).
    step: Option<u64>,
    /// This rank's own work, which its peers may wait for, rather than a wait for peers.
    own_work: bool,
    entered: Instant,
}

/// A watched wait, with the number its guard removes it by.
struct Watched {
    id: u64,
    activity: Activity,
}

struct State {
    timeout: Duration,
    rank: i32,
    step: AtomicU64,
    /// Bumped on every completed request or message the exchanges report; the checking thread
    /// reads it together with the raw layer's count of the requests its segments complete
    /// (`raw::completed_requests`), which counts without knowing of the watchdog.
    progress: AtomicU64,
    /// The watched waits under way, outermost first.
    watched: Mutex<Vec<Watched>>,
    next_id: AtomicU64,
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
    fn new(rank: i32, timeout: Duration) -> State {
        State {
            timeout,
            rank,
            step: AtomicU64::new(0),
            progress: AtomicU64::new(0),
            watched: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
            recent: Mutex::new(VecDeque::with_capacity(RECENT_EVENTS)),
        }
    }

    fn record(&self, began: bool, activity: &Activity) {
        let step = activity.step.unwrap_or_else(|| self.step.load(Ordering::Relaxed));
        let event = Event { at: Instant::now(), step, began, what: activity.strategy.clone(), peers: activity.peers.clone() };
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

    /// Starts watching `activity`; the returned number ends it ([`State::leave`]).
    fn enter(&self, activity: Activity) -> u64 {
        self.record(true, &activity);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.watched.lock().unwrap_or_else(|e| e.into_inner()).push(Watched { id, activity });
        self.progress.fetch_add(1, Ordering::Relaxed);
        id
    }

    /// Ends the watch `id` and it alone: guards normally end innermost first, but one taken on
    /// another thread (a GPU's backward calling the tensor-parallel all-reduce) may end out of
    /// order, and must not end another's.
    fn leave(&self, id: u64) {
        let ended = {
            let mut watched = self.watched.lock().unwrap_or_else(|e| e.into_inner());
            watched.iter().rposition(|w| w.id == id).map(|at| watched.remove(at).activity)
        };
        if let Some(activity) = ended {
            self.record(false, &activity);
        }
        self.progress.fetch_add(1, Ordering::Relaxed);
    }

    /// The innermost watched wait, and what the outer ones are (innermost first), if any.
    fn innermost(&self) -> Option<(Activity, Vec<String>)> {
        let watched = self.watched.lock().unwrap_or_else(|e| e.into_inner());
        let (inner, outer) = watched.split_last()?;
        Some((inner.activity.clone(), outer.iter().rev().map(|w| w.activity.strategy.clone()).collect()))
    }

    /// The line this rank prints when `activity` (inside `outer`) has made no progress for
    /// `quiet`.
    fn stalled_line(&self, activity: &Activity, outer: &[String], quiet: Duration) -> String {
        let step = activity.step.unwrap_or_else(|| self.step.load(Ordering::Relaxed));
        let bucket = activity.bucket.map_or(String::new(), |b| format!(" (bucket {b})"));
        let what = match activity.own_work {
            true => "and the other ranks wait for this one".to_string(),
            false => format!("waiting for {}", activity.peers),
        };
        let inside: String = outer.iter().map(|o| format!(", inside {o}")).collect();
        format!(
            "error: rank {}: exchange watchdog: {} at step {step}{bucket} has made no progress for {:.0} s (in it for {:.0} s), {what}{inside}; aborting the job (--exchange-timeout-s)\nrank {}: its last communication events, oldest first: {}\n",
            self.rank,
            activity.strategy,
            quiet.as_secs_f64(),
            activity.entered.elapsed().as_secs_f64(),
            self.rank,
            self.recent_events()
        )
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
    if STATE.set(State::new(rank, timeout)).is_err() {
        return;
    }
    let spawned = std::thread::Builder::new().name("exchange-watchdog".into()).spawn(watch_thread);
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
    watch(|| Activity { strategy: who(), bucket: None, peers: peers(), step: None, own_work: false, entered: Instant::now() })
}

/// Marks this rank's own work that its peers wait for (its part of a sharded checkpoint,
/// `what`), of step `step` where that is not the step under way, as running until the guard is
/// dropped. When it makes no progress for the timeout, this rank's line names it, and so names
/// the rank the others are stuck behind.
pub fn own_work(what: impl FnOnce() -> String, step: Option<u64>) -> ExchangeGuard {
    watch(|| Activity { strategy: what(), bucket: None, peers: "no peer".into(), step, own_work: true, entered: Instant::now() })
}

fn watch(activity: impl FnOnce() -> Activity) -> ExchangeGuard {
    ExchangeGuard(STATE.get().map(|s| s.enter(activity())))
}

/// The bucket the running exchange (the innermost wait) works on (for the message).
pub fn set_bucket(bucket: usize) {
    if let Some(s) = STATE.get() {
        if let Some(w) = s.watched.lock().unwrap_or_else(|e| e.into_inner()).last_mut() {
            w.activity.bucket = Some(bucket);
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

/// As [`collective`], for one that belongs to step `step` rather than to the step under way
/// (a checkpoint written after `step` steps, in the folder `ckpt-<step>`), named by `what`.
pub fn collective_of_step<T>(what: impl FnOnce() -> String, step: u64, comm: &impl mpi::topology::Communicator, f: impl FnOnce() -> T) -> T {
    let _watched = watch(|| Activity { strategy: what(), bucket: None, peers: format!("all {} ranks of its communicator", comm.size()), step: Some(step), own_work: false, entered: Instant::now() });
    f()
}

/// A watched wait, ended when dropped (the number of its entry; None without a watchdog).
pub struct ExchangeGuard(Option<u64>);

impl Drop for ExchangeGuard {
    fn drop(&mut self) {
        if let (Some(s), Some(id)) = (STATE.get(), self.0) {
            s.leave(id);
        }
    }
}

fn watch_thread() {
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
        let Some((activity, outer)) = s.innermost() else {
            quiet_since = Instant::now();
            continue;
        };
        if quiet_since.elapsed() < s.timeout {
            continue;
        }
        let line = s.stalled_line(&activity, &outer, quiet_since.elapsed());
        // A rank that waits for peers gives one stuck in its own work time to print the line
        // that names it, since the abort below ends every rank at once. That rank's quiet time
        // began about when this one's did (they left the same agreement), and each notices
        // within two ticks (the tick that sees the last progress, the one that sees the
        // timeout): two ticks, and a second for the ranks' skew and a crowded node.
        let peer_report_grace = if activity.own_work { Duration::ZERO } else { 2 * tick + Duration::from_secs(1) };
        // MPI_Abort asks the launcher to end every rank; across a cut link it may wait for a
        // daemon it cannot reach. This rank ends either way: the timer starts first, because
        // even the message below can block when the launcher stops reading this rank's stderr.
        std::thread::spawn(move || {
            std::thread::sleep(peer_report_grace + ABORT_GRACE);
            crate::raw::exit_now(1);
        });
        use std::io::Write;
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
        std::thread::sleep(peer_report_grace);
        crate::raw::abort_world(1);
    }
}

/// The least time MPI's start-up gets before [`watch_start_up`] gives up, whatever
/// `--exchange-timeout-s` says: its clock starts when this rank reaches `MPI_Init_thread`,
/// which then waits for the slowest rank to load (libtorch takes 0.4-1 s on an idle machine,
/// several times that on a crowded node or a shared file system), while a timeout of a few
/// seconds is meant for exchanges, whose peers are already running.
pub const START_UP_FLOOR: Duration = Duration::from_secs(10);

/// Watches MPI's start-up until dropped. Where a launcher that starts its ranks at once says
/// that it started several (mpirun, srun, Hydra, mpirun_rsh: `mpi_library::launched_processes`),
/// a rank whose `MPI_Init_thread` has not returned within `timeout` (`--exchange-timeout-s`,
/// at least [`START_UP_FLOOR`]) waits for a rank that will not come: it says so and exits
/// non-zero, and its launcher then ends the job, the stopped rank too. No MPI call can be made
/// (MPI_Abort needs MPI started). Without such a launcher, or with `timeout` zero, nothing is
/// watched: a launcher that starts ranks one after another may take longer by design.
pub fn watch_start_up(timeout: Duration) -> StartUpWatch {
    let launched = crate::mpi_library::launched_processes();
    if timeout.is_zero() || launched < 2 {
        return StartUpWatch { _started: None };
    }
    let budget = timeout.max(START_UP_FLOOR);
    let rank = crate::mpi_library::launcher_rank();
    let (started, watched) = std::sync::mpsc::channel::<()>();
    let spawned = std::thread::Builder::new().name("start-up-watchdog".into()).spawn(move || {
        // The sender is dropped when MPI's start-up returns: nothing is ever sent.
        if watched.recv_timeout(budget) != Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
            return;
        }
        let line = format!(
            "error: rank {rank} of the {launched} the launcher started: MPI's start-up (MPI_Init_thread) has not completed after {:.0} s: \
             a rank has not joined the job (stopped, or lost with its node); ending this rank so that the launcher ends the job \
             (--exchange-timeout-s, at least {:.0} s at start-up; 0: off)\n",
            budget.as_secs_f64(),
            START_UP_FLOOR.as_secs_f64()
        );
        // As the exchange watchdog: the exit does not wait for a launcher that stopped reading.
        std::thread::spawn(|| {
            std::thread::sleep(ABORT_GRACE);
            crate::raw::exit_now(1);
        });
        use std::io::Write;
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
        crate::raw::exit_now(1);
    });
    match spawned {
        Ok(_) => StartUpWatch { _started: Some(started) },
        Err(e) => {
            eprintln!("warning: MPI's start-up is not watched (no thread: {e})");
            StartUpWatch { _started: None }
        }
    }
}

/// MPI's start-up under watch ([`watch_start_up`]), until dropped: dropping the sender tells
/// the watching thread that the start-up returned.
pub struct StartUpWatch {
    _started: Option<std::sync::mpsc::Sender<()>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn activity(what: &str) -> Activity {
        Activity { strategy: what.into(), bucket: None, peers: "all 2 ranks of its communicator".into(), step: None, own_work: false, entered: Instant::now() }
    }

    /// An inner wait's end used to clear the one slot the watchdog had, and the outer wait
    /// (the checkpoint write around its agreements) went unwatched for the rest of it.
    #[test]
    fn the_end_of_an_inner_wait_leaves_the_outer_one_watched() {
        let state = State::new(1, Duration::from_secs(3));
        let outer = state.enter(activity("writing the sharded checkpoint ckpt-4"));
        let inner = state.enter(activity("the stop agreement"));
        let (now, around) = state.innermost().expect("watched");
        assert_eq!((now.strategy.as_str(), around), ("the stop agreement", vec!["writing the sharded checkpoint ckpt-4".to_string()]));
        state.leave(inner);
        assert_eq!(state.innermost().map(|(a, around)| (a.strategy, around.len())), Some(("writing the sharded checkpoint ckpt-4".into(), 0)));
        // Guards on two threads may end out of order; each ends its own wait only.
        let late = state.enter(activity("the tensor-parallel all-reduce"));
        state.leave(outer);
        assert_eq!(state.innermost().map(|(a, _)| a.strategy), Some("the tensor-parallel all-reduce".into()));
        state.leave(late);
        assert!(state.innermost().is_none());
        state.leave(late);
        assert!(state.innermost().is_none(), "a second end of the same wait changes nothing");
    }

    /// A checkpoint's wait names the checkpoint's step, not the loop's (the folder ckpt-4 was
    /// named "at step 3"), and a rank stuck in its own part says that the others wait for it.
    #[test]
    fn the_line_names_the_step_of_the_checkpoint_and_whose_work_is_stuck() {
        let state = State::new(1, Duration::from_secs(3));
        state.step.store(3, Ordering::Relaxed);
        let mut writing = activity("writing the sharded checkpoint ckpt-4");
        writing.step = Some(4);
        state.enter(writing);
        let part = Activity { strategy: "writing its part of the checkpoint ckpt-4".into(), peers: "no peer".into(), step: Some(4), own_work: true, ..activity("") };
        state.enter(part);
        let (now, around) = state.innermost().unwrap();
        let line = state.stalled_line(&now, &around, Duration::from_secs(3));
        assert!(
            line.starts_with("error: rank 1: exchange watchdog: writing its part of the checkpoint ckpt-4 at step 4 has made no progress for 3 s (in it for 0 s), and the other ranks wait for this one, inside writing the sharded checkpoint ckpt-4; aborting the job"),
            "{line}"
        );
        assert!(line.contains("[step 4, 0.0 s ago: began writing the sharded checkpoint ckpt-4 with all 2 ranks of its communicator]"), "{line}");
        // The exchanges of the loop keep its step.
        let ring = state.enter(activity("ring"));
        let (now, around) = state.innermost().unwrap();
        assert!(state.stalled_line(&now, &around, Duration::from_secs(3)).contains("exchange watchdog: ring at step 3 has made"));
        state.leave(ring);
    }
}
