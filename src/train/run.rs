//! What a run holds once it is set up ([`Run`]: built by setup.rs, stepped by step.rs, recorded
//! by record.rs, its loop in mod.rs), what training leaves for the record ([`Outcome`]), and the
//! stop signal the workers agree on.

use std::sync::Arc;

use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use crate::checkpoint::FolderLock;
use crate::data::{DatasetInfo, Labels};
use crate::error::{Error, Result};
use crate::exchange::Exchange;
use crate::faults::Faults;
use crate::model::InputSpec;
use crate::optim::Optimizer;
use crate::topology::World;

use super::checkpoints::CheckpointLog;
use super::net::Net;
use super::options::TrainArgs;
use super::overlap_choice::OverlapChoice;
use super::layout::RunLayout;
use super::plan::Plan;
use super::progress::Timings;

/// What a caller outside the command line adds to a run (a study tags its runs).
#[derive(Clone, Debug, Default)]
pub struct RunContext {
    pub study: Option<String>,
    /// One CPU core's measured f32 matmul GFLOP/s (model/flops.rs), for the record: measured
    /// once per launch of a study or a study's point, not per run.
    pub core_gflops: Option<f64>,
    /// Which run of its point this is (`study --repeats`, `--repeat-index`).
    pub repeat: Option<u32>,
}

/// Everything a run needs once it is set up.
pub(super) struct Run<'a> {
    pub(super) world: &'a World,
    pub(super) args: &'a TrainArgs,
    pub(super) plan: Plan,
    pub(super) info: DatasetInfo,
    pub(super) labels: Labels,
    /// This rank holds the training split's images in memory (`--cache-data`; in a pipeline
    /// only the first stages read images, so only they may).
    pub(super) cache_data: bool,
    pub(super) spec: InputSpec,
    pub(super) net: Net,
    /// How the model is cut and held here, and so what a step computes (layout.rs).
    pub(super) layout: RunLayout,
    /// How gradients are averaged: the strategy, ZeRO 1/2's sharded update, stage 3's shards.
    pub(super) exchange: Box<dyn Exchange>,
    pub(super) optimizer: Optimizer,
    /// What `--overlap` came to and why, with auto's trial of the first steps on CPU ranks.
    pub(super) overlap_choice: OverlapChoice,
    pub(super) faults: Faults,
    pub(super) stop: StopSignal,
    /// Workers only: dedicated parameter servers take no part in evaluation or the loss.
    pub(super) workers_comm: SimpleCommunicator,
    pub(super) worker: usize,
    pub(super) workers: usize,
    pub(super) global_batch: usize,
    pub(super) steps_per_epoch: u64,
    pub(super) first_step: u64,
    pub(super) total_steps: u64,
    /// The step of the checkpoint the run resumed from.
    pub(super) resumed_at: Option<u64>,
    /// The dataset's content fingerprint (rank 0, with --checkpoint-dir), recorded in checkpoints.
    pub(super) dataset_fingerprint: String,
    /// Rank 0: which checkpoints were written and which failed.
    pub(super) checkpoints: CheckpointLog,
    /// Rank 0: the checkpoint folder's lock, held until the run ends.
    pub(super) _checkpoint_lock: Option<FolderLock>,
}

/// What training leaves for the record.
pub(super) struct Outcome {
    pub(super) totals: Timings,
    /// The steps after warm-up, which throughput is computed from.
    pub(super) measured: Timings,
    pub(super) last_eval: Option<(f64, f64)>,
    /// The time the test-set evaluations took, all of them.
    pub(super) evaluation: std::time::Duration,
    /// Test accuracy at each epoch's end, and when it first reached --target-accuracy: the
    /// training time until then (evaluations excluded) and the epoch (1-based).
    pub(super) accuracy_by_epoch: Vec<f64>,
    pub(super) reached_target: Option<(f64, u64)>,
    pub(super) final_loss: f64,
    pub(super) rss_warmup: f64,
    pub(super) last_step: u64,
    pub(super) saved_at: Option<u64>,
    /// A signal ended training before its last step.
    pub(super) stopped: bool,
    /// This rank's --profile-dir trace: where it went, or why it could not be written (None:
    /// no trace, as on a parameter server).
    pub(super) profile: Option<std::result::Result<String, String>>,
    /// fp16's loss scaler at the end: the steps it skipped on an overflow (every rank skips
    /// alike) and its last scale; None at other precisions.
    pub(super) loss_scaler: Option<(u64, f64)>,
}

/// SIGTERM (what Slurm sends before the time limit) and SIGUSR1 (what `--signal` jobs often
/// ask for) set a flag; the workers agree on it after every step, so that all stop together.
pub(super) struct StopSignal(Arc<std::sync::atomic::AtomicBool>);

/// The process's one stop flag and its handlers, registered once: as the training commands
/// start (main.rs, before MPI's start-up and the run's set-up), so that a signal during
/// start-up is a stop request too. Before, it killed the rank by the signal's default action,
/// which the job saw as 143, the status that says a checkpoint holds the step (issue 48). A
/// signal from before main, which `raw::process` held, counts too.
static STOP_FLAG: std::sync::OnceLock<std::result::Result<Arc<std::sync::atomic::AtomicBool>, String>> = std::sync::OnceLock::new();

impl StopSignal {
    pub(super) fn install() -> Result<StopSignal> {
        let installed = STOP_FLAG.get_or_init(|| {
            let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
            for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGUSR1] {
                signal_hook::flag::register(signal, flag.clone()).map_err(|e| format!("cannot install the handler of signal {signal}: {e}"))?;
            }
            // Asked after registering: a signal is then seen by one handler or the other.
            if crate::raw::stop_signal_held() {
                flag.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(flag)
        });
        installed.clone().map(StopSignal).map_err(Error::usage)
    }

    /// Whether any rank of `comm` has been asked to stop (collective over `comm`).
    pub(super) fn agreed(&self, comm: &SimpleCommunicator) -> bool {
        let mine = i32::from(self.0.load(std::sync::atomic::Ordering::Relaxed));
        let mut any = 0;
        // After a checkpoint step the other ranks wait here for rank 0's write.
        crate::watchdog::collective("the stop agreement", comm, || comm.all_reduce_into(&mine, &mut any, mpi::collective::SystemOperation::max()));
        any != 0
    }
}
