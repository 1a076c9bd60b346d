//! The training run, one stage per file, each a reader can find by name:
//! - [`options`]: the run's command-line options and settings types;
//! - plan.rs: the options resolved against the world, the checks before anything starts, the
//!   device; setup.rs: set-up checked on every rank, which builds the [`Run`] (run.rs) from the
//!   plan, the network (net.rs), the exchange, overlap and the resume point (checkpoints.rs);
//!   overlap_choice.rs: what `--overlap` comes to, with auto's trial of the first steps;
//! - layout.rs: the run's layout as one value (the tensor-parallel cut; whole layers, a
//!   pipeline stage or `--zero 3`'s units); step.rs: the one step of every layout and what
//!   follows a step at some steps; whole_step.rs, pipeline_step.rs, fsdp_step.rs: each layout's
//!   forward and backward; step_faults.rs: the injected faults, at the same points in every
//!   layout; progress.rs: timings, progress lines, the sample trace;
//!   collective.rs: the collectives besides the exchange; tensor.rs: tensor parallelism's
//!   groups, their all-reduce, and the model cut into a rank's part;
//! - record.rs: the end of the run and its record.
//!
//! [`run`] reads top to bottom: set up, then serve (a dedicated parameter server) or train, then
//! finish the exchange and record. The loop below is one screen: a step, then what follows it
//! at some steps (a progress line, an evaluation, a checkpoint, a stop request).

mod action_clock;
mod checkpoints;
mod collective;
mod fsdp;
mod fsdp_step;
mod held;
mod layout;
mod memory;
mod net;
pub mod options;
mod overlap_choice;
mod pipeline;
mod pipeline_step;
mod plan;
mod profile;
mod progress;
pub mod recipe;
mod record;
mod run;
mod setup;
pub mod stages;
mod stamp_clock;
mod step;
mod step_faults;
mod tensor;
mod weights_file;
mod whole_step;

use std::time::Instant;

use crate::error::{Error, Result};
use crate::exchange::Role;
use crate::raw;
use crate::results::RunRecord;
use crate::topology::World;

use collective::sum_pair;
use options::TrainArgs;
use progress::{LossWindow, Timings};
use run::{Outcome, Run};

pub use plan::{check_combination, choose_device, features_and_kinds, make_current, training_ranks, watchdog_timeout, SIMULATED_GPUS_ENV};
pub use record::mpi_library;
pub use run::RunContext;

/// The exit status of a run that a signal (SIGTERM, SIGUSR1) stopped before its last step after
/// writing a checkpoint at the step where it stopped: 128 + SIGTERM, what the job of a process
/// killed by SIGTERM reports (Horovod's does), so that a job script can tell "stopped, continue
/// with --resume" from success (0) and from failure (1, also for a stop with nothing saved).
pub const EXIT_STOPPED: i32 = 143;

/// Makes SIGTERM and SIGUSR1 requests to stop from now on, for the commands that train (main
/// calls it first thing): a failure to install the handlers is reported by the run's set-up.
pub fn catch_stop_signals() {
    let _ = run::StopSignal::install();
}

/// Trains as `args` says on the ranks of `world`; rank 0 returns the run's record (None on the
/// other ranks, and when nothing was left to train). A run stopped by a signal before its last
/// step ends in [`Error::Stopped`](crate::error::Error::Stopped) on every rank.
pub fn run(world: &World, args: &TrainArgs, context: &RunContext) -> Result<Option<RunRecord>> {
    let Some(mut run) = Run::set_up(world, args)? else { return Ok(None) };
    memory::switch(memory::Phase::Training);
    let outcome = match run.exchange.role() {
        Role::Server => run.serve()?,
        Role::Worker { .. } => run.train()?,
    };
    memory::switch(memory::Phase::End);
    run.exchange.finish(&mut run.net.params)?;
    if let Some(tensor_parallel) = &run.layout.tensor {
        tensor_parallel.finish()?;
    }
    run.agree_on_profile(&outcome)?;
    run.record(outcome, context)
}

impl Run<'_> {
    /// Every rank's trace written, or the run fails (one line, from the lowest rank whose write
    /// failed) before its record: a profile asked for and lost is not a success. Collective, on
    /// every rank of the run (servers have no trace).
    fn agree_on_profile(&self, outcome: &Outcome) -> Result<()> {
        let local = match &outcome.profile {
            Some(Err(reason)) => Err(Error::Results(reason.clone())),
            _ => Ok(()),
        };
        self.world.agree(local)?;
        if let (true, Some(Ok(line))) = (self.world.is_root(), &outcome.profile) {
            log::info!("{line}");
        }
        Ok(())
    }

    fn outcome(&self) -> Outcome {
        Outcome {
            totals: Timings::default(),
            measured: Timings::default(),
            last_eval: None,
            evaluation: std::time::Duration::ZERO,
            accuracy_by_epoch: Vec::new(),
            reached_target: None,
            final_loss: f64::NAN,
            rss_warmup: raw::current_rss_mb(),
            last_step: self.first_step,
            saved_at: self.resumed_at,
            stopped: false,
            profile: None,
            loss_scaler: None,
        }
    }

    /// A dedicated parameter server: serve the workers until they are done.
    fn serve(&mut self) -> Result<Outcome> {
        self.exchange.serve(&mut self.net.params, &mut self.optimizer)?;
        Ok(self.outcome())
    }

    /// The step loop of a worker.
    fn train(&mut self) -> Result<Outcome> {
        let mut out = self.outcome();
        let mut state = step::LoopState::new(self)?;
        if let Some(pipeline) = self.layout.pipeline_mut() {
            pipeline.start_timeline(state.warmup);
        }
        // The losses since the last progress line, and the last step's (the record's final
        // loss); on one GPU rank read only where the loop needs them (step::DeferredChecks).
        let mut window = LossWindow::default();
        for step in self.first_step..self.total_steps {
            if step == state.warmup {
                out.rss_warmup = raw::current_rss_mb();
            }
            let epoch_end = (step + 1) % self.steps_per_epoch == 0 || step + 1 == self.total_steps;
            let report_due = state.progress.due(step) || epoch_end;
            let mark = state.profile.before_step(step)?;
            let started = Instant::now();
            let done = self.step(step, &mut state)?;
            window.add(done.loss, done.samples);
            // Deferred checks are read where the loop reports, evaluates or checkpoints, and at
            // the end of the warm-up, inside the step's time: the measured steps then begin and
            // end with the device idle, and their time is the device's.
            if state.defers_checks() && (report_due || step + 1 == state.warmup || self.checkpoint_due(step + 1)) {
                window.settle()?;
            }
            let t = Timings { step: started.elapsed(), ..done.timings };
            // `--overlap auto`'s trial on CPU ranks: at its end, overlap stays only where it paid.
            if self.overlap_choice.note_step(step, t.step, self.world) == Some(false) {
                self.layout.stop_overlapping();
            }
            drop(mark);
            state.profile.after_step(step)?;
            out.totals.add(&t);
            if step >= state.warmup {
                out.measured.add(&t);
            }
            out.last_step = step + 1;

            if report_due {
                self.report_progress(step, done.epoch, &mut window, &out.totals, &state.progress);
            }
            if epoch_end && !self.args.no_eval && self.info.test.len > 0 {
                let started = Instant::now();
                let (test_loss, accuracy) = self.evaluate_epoch(step, done.epoch, &state)?;
                out.evaluation += started.elapsed();
                out.accuracy_by_epoch.push(accuracy);
                match self.args.recipe.target_accuracy {
                    Some(target) if accuracy >= target && out.reached_target.is_none() => {
                        out.reached_target = Some((out.totals.step.as_secs_f64(), done.epoch + 1));
                        if self.world.is_root() {
                            state.progress.suspend(|| log::info!("target accuracy {:.2}% reached in epoch {} after {:.1} s of training", target * 100.0, done.epoch + 1, out.totals.step.as_secs_f64()));
                        }
                    }
                    _ => {}
                }
                out.last_eval = Some((test_loss, accuracy));
            }
            if self.checkpoint_due(out.last_step) {
                self.save_checkpoint(out.last_step)?;
                out.saved_at = Some(out.last_step);
            }
            // Asynchronous workers agree only at logging steps, to stay untied.
            let agree_now = self.exchange.lockstep() || state.progress.due(step) || epoch_end;
            if agree_now && self.stop.agreed(&self.workers_comm) {
                out.stopped = self.stop_requested(out.last_step, &state.progress);
                break;
            }
        }
        // A stop request may end the loop between reads.
        window.settle()?;
        state.progress.finish();
        state.profile.finish()?;
        out.profile = state.profile.written();
        out.loss_scaler = state.scaler.as_ref().map(|s| (s.skipped, s.scale));
        // The last step's mean loss over every worker's samples: the same figure whatever
        // --log-every is (the progress lines' means run over the steps since the last line).
        let (sum, samples) = sum_pair(&self.workers_comm, window.last.0, window.last.1);
        out.final_loss = sum / samples.max(1.0);
        Ok(out)
    }
}

