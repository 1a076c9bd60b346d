//! The test hooks of `HPC_TRAIN_FAULT` for one training step, apart from the step that calls
//! them (step.rs) and the layouts' passes that act on some (whole_step.rs, pipeline_step.rs
//! with pipeline.rs, fsdp_step.rs), so that each imports them without importing another.

use crate::error::{Error, Result};
use crate::faults::{Fault, Faults, FAULT_ENV};

/// The test hooks of `HPC_TRAIN_FAULT` (faults.rs) for one step, called at the same points of
/// the one step whatever the layout, so that a fault cannot reach one layout and silently miss
/// another: `exit` at the step's start, `stall` and `pace` before its first communication,
/// `error` at the forward, `nangrad` on the gradients backward makes, `nan` on the loss as the
/// step reads it, `infgrad` on the averaged gradients before the loss scaler's decision, and
/// `stall-after` once the gradients are averaged, before the optimizer.
pub(super) struct StepFaults {
    fault: Option<Fault>,
    rank: i32,
    step: u64,
}

impl StepFaults {
    /// This rank's fault at `step`; `exit` ends the process here, without MPI_Finalize.
    pub(super) fn begin(faults: &Faults, rank: i32, step: u64) -> StepFaults {
        let fault = faults.at(rank, step).cloned();
        if fault == Some(Fault::Exit) {
            eprintln!("rank {rank}: exiting at step {step} (injected fault)");
            std::process::exit(3);
        }
        StepFaults { fault, rank, step }
    }

    /// Whether the forward is to fail (`error`).
    pub(super) fn forward_fails(&self) -> bool {
        self.fault == Some(Fault::Error)
    }

    /// `error`: the forward fails, as an out-of-memory in libtorch would.
    pub(super) fn forward(&self) -> Result<()> {
        if self.forward_fails() {
            return Err(self.forward_error());
        }
        Ok(())
    }

    /// The error an injected forward failure raises.
    pub(super) fn forward_error(&self) -> Error {
        Error::Torch(tch::TchError::Torch(format!("the forward failed at step {} (injected by {FAULT_ENV})", self.step)))
    }

    /// `nan`: the loss reads as NaN.
    pub(super) fn nan_loss(&self) -> bool {
        self.fault == Some(Fault::Nan)
    }

    /// `infgrad`: one element of the exchanged gradients becomes +inf (an fp16 overflow of
    /// this rank's own slice).
    pub(super) fn inf_gradient(&self) -> bool {
        self.fault == Some(Fault::InfGrad)
    }

    /// `nangrad`: the gradients become NaN while the loss stays finite.
    pub(super) fn nan_gradients(&self) -> bool {
        self.fault == Some(Fault::NanGrad)
    }

    /// The factor backward starts from: `factor`, or NaN under `nangrad`, so that every gradient
    /// backward makes is NaN (a pipeline stage spoils its own instead: the factor reaches only
    /// the last stage).
    pub(super) fn loss_factor(&self, factor: f64) -> f64 {
        if self.nan_gradients() { f64::NAN } else { factor }
    }

    /// `stall`: a hung node, before the step's communication; `pace`: a slow one, at every step
    /// from its own on.
    pub(super) fn before_exchange(&self) {
        if let Some(Fault::Stall(pause)) = self.fault {
            eprintln!("rank {}: stalling {:.1} s at step {} (injected fault)", self.rank, pause.as_secs_f64(), self.step);
            std::thread::sleep(pause);
        }
        if let Some(Fault::Pace(pause)) = self.fault {
            std::thread::sleep(pause);
        }
    }

    /// `stall-after`: a node lost after the step's exchange, before the collectives that follow.
    pub(super) fn after_exchange(&self) {
        if let Some(Fault::StallAfter(pause)) = self.fault {
            eprintln!("rank {}: stalling {:.1} s after the exchange of step {} (injected fault)", self.rank, pause.as_secs_f64(), self.step);
            std::thread::sleep(pause);
        }
    }
}
