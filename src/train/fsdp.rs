//! `--zero 3`'s compute side: the units' modules on a thread of their own, which runs one
//! unit's forward or backward at a time while the MPI thread (the run's) gathers the next
//! unit's parameters and reduces the last one's gradients, as PyTorch FSDP's prefetch does
//! with CUDA streams. The schedule of gathers and reductions is fsdp_step.rs; the shards are
//! exchange/fsdp.rs.
//!
//! Freed parameters and autograd: a unit's forward in the step runs without a graph, keeping
//! only the unit's input; its backward runs the forward again from that input, with the
//! parameters gathered again, and backward through it at once (FSDP with activation
//! checkpointing per unit). No tensor autograd saved can then point at a parameter whose
//! memory was let go in between. The last unit is not let go after its forward: its forward,
//! the loss and its backward run as one job. The recomputed forward must not count in batch
//! norm's running statistics twice: the unit's buffers are put back as they were after it.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Reduction, Tensor};

use crate::error::{Error, Result};
use crate::raw::{CudaStream, CurrentStream};
use crate::plan::fsdp::{self, Unit, UnitSize};
use crate::plan::shard::ShardInfo;

use super::net::BuffersAsFound;
use super::options::Precision;
use super::stamp_clock::{StampClock, Stamped};

/// One unit's work.
pub(super) enum Job {
    /// The unit's forward without a graph (`train`: batch statistics, running statistics
    /// updated).
    Forward { unit: usize, input: Tensor, train: bool },
    /// The last unit: forward with its graph, the summed loss scaled by `factor`, backward.
    /// Gives the summed loss and the gradient of the input.
    Last { unit: usize, input: Tensor, labels: Tensor, factor: f64, label_smoothing: f64 },
    /// The unit's forward again from its input, with its graph, then backward from `grad`.
    /// Gives the gradient of the input (None for the first unit, whose input is the images).
    Backward { unit: usize, input: Tensor, grad: Tensor },
}

/// What a job gives back, and when it computed.
pub(super) struct Done {
    pub(super) output: Option<Tensor>,
    /// `Last`: the summed (unscaled) loss, detached.
    pub(super) loss: Option<Tensor>,
    /// From the job's start to the end of its work, on this thread's stream on a GPU (taken by
    /// the step's window log).
    pub(super) compute: Option<Stamped>,
}

/// The thread that computes the units.
pub(super) struct UnitWorker {
    jobs: Option<Sender<Job>>,
    done: Receiver<Result<Done>>,
    thread: Option<JoinHandle<()>>,
}

impl UnitWorker {
    /// Takes the units' modules (in unit order) and their batch-norm buffers. The training jobs
    /// run under the precision's autocast, which is a per-thread setting: set here, on the
    /// thread that computes them; evaluation's forwards run in fp32, as every layout's do.
    pub(super) fn spawn(modules: Vec<nn::FuncT<'static>>, buffers: Vec<Vec<Tensor>>, device: Device, precision: Precision, clock: StampClock) -> Result<UnitWorker> {
        let (jobs, inbox) = channel::<Job>();
        let (outbox, done) = channel();
        let threads = tch::get_num_threads();
        let thread = std::thread::Builder::new()
            .name("fsdp-compute".into())
            .spawn(move || {
                // at::set_num_threads also sets this thread's OpenMP team size, which is per
                // thread: without it the units would compute with every core (as overlap.rs).
                tch::set_num_threads(threads);
                if let Err(e) = crate::raw::set_cuda_device(device) {
                    let _ = outbox.send(Err(e));
                    return;
                }
                for job in inbox {
                    let result = clock.now().and_then(|start| {
                        let (output, loss) = match job {
                            Job::Forward { train: false, .. } => run(&modules, &buffers, job),
                            _ => precision.training_forward(device, || run(&modules, &buffers, job)),
                        }?;
                        // On a GPU: when this stream has run the job's kernels, which the
                        // hidden share of the collectives is measured against.
                        let end = clock.now()?;
                        // The job is done when its kernels are: waiting here for this thread's
                        // stream only (the MPI thread's collectives run on a stream of their
                        // own), on the end stamp's event, lets the MPI thread pack the
                        // gradients and reuse the unit's buffer without racing it.
                        clock.wait(&end)?;
                        Ok(Done { output, loss, compute: Some(Stamped { start, end }) })
                    });
                    if outbox.send(result).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| Error::exchange("zero 3", format!("cannot start the compute thread: {e}")))?;
        Ok(UnitWorker { jobs: Some(jobs), done, thread: Some(thread) })
    }

    pub(super) fn send(&self, job: Job) -> Result<()> {
        self.jobs.as_ref().expect("open until dropped").send(job).map_err(|_| self.ended())
    }

    /// The result of the job sent last.
    pub(super) fn wait(&self) -> Result<Done> {
        self.done.recv().map_err(|_| self.ended())?
    }

    /// Why the thread has ended: the error it left behind (a device it could not make current
    /// at its start), which a closed channel alone lost (issue 48).
    fn ended(&self) -> Error {
        match self.done.try_recv() {
            Ok(Err(cause)) => Error::exchange("zero 3", format!("the compute thread has ended: {cause}")),
            _ => Error::exchange("zero 3", "the compute thread has ended"),
        }
    }
}

impl Drop for UnitWorker {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(modules: &[nn::FuncT<'static>], buffers: &[Vec<Tensor>], job: Job) -> Result<(Option<Tensor>, Option<Tensor>)> {
    match job {
        Job::Forward { unit, input, train } => Ok((Some(tch::no_grad(|| modules[unit].forward_t(&input, train))), None)),
        Job::Last { unit, input, labels, factor, label_smoothing } => {
            let input = with_grad(&input, unit)?;
            let logits = modules[unit].forward_t(&input, true);
            let loss = logits.f_cross_entropy_loss::<Tensor>(&labels, None, Reduction::Sum, -100, label_smoothing)?.f_to_kind(Kind::Float)?;
            loss.f_mul_scalar(factor)?.f_backward()?;
            Ok((input_grad(&input, unit), Some(loss.f_detach()?)))
        }
        Job::Backward { unit, input, grad } => {
            let found = BuffersAsFound::take(&buffers[unit])?;
            let input = with_grad(&input, unit)?;
            let output = modules[unit].forward_t(&input, true);
            if output.requires_grad() {
                // The gradients of sum(output * grad) are those of backward from `output` with
                // gradient `grad` (as the pipeline's stages do it).
                output.f_mul(&grad)?.f_sum(Kind::Float)?.f_backward()?;
            }
            // After backward, which reads the running statistics batch norm saved.
            found.put_back()?;
            Ok((input_grad(&input, unit), None))
        }
    }
}

/// The unit's input as a leaf that collects its gradient (not the first unit's: the images).
fn with_grad(input: &Tensor, unit: usize) -> Result<Tensor> {
    Ok(if unit == 0 { input.shallow_clone() } else { input.f_detach()?.f_set_requires_grad(true)? })
}

fn input_grad(input: &Tensor, unit: usize) -> Option<Tensor> {
    (unit > 0).then(|| input.grad())
}

/// What a `--zero 3` run holds beside the exchange: the units and the thread that computes them.
pub(super) struct FullySharded {
    pub(super) units: Vec<Unit>,
    pub(super) size: UnitSize,
    /// Gather the next unit while this one computes, reduce the last one's gradients while the
    /// next backward runs (`--overlap`).
    pub(super) prefetch: bool,
    pub(super) worker: UnitWorker,
    /// On a GPU: the stream the MPI thread's gathers, reduce-scatters and optimizer run on
    /// during a step or an evaluation ([`FullySharded::collectives_stream`]), so that they do
    /// not queue behind the compute thread's kernels on the default stream, as FSDP's
    /// all-gather and reduce-scatter streams.
    pub(super) comm_stream: Option<CudaStream>,
    /// The stamps of the step's collectives and compute (shared with the compute thread).
    pub(super) clock: StampClock,
}

impl FullySharded {
    /// Makes the communication stream the calling (MPI) thread's current one until the guard is
    /// restored: the default stream then waits, on the device, for what was queued on it. None
    /// on the CPU.
    pub(super) fn collectives_stream(&self) -> Result<Option<CurrentStream>> {
        self.comm_stream.as_ref().map(CudaStream::make_current).transpose()
    }

    /// What the start of the log says about the units, with `sharing` ranks sharing shards.
    pub(super) fn describe(&self, sharing: usize) -> String {
        let lens: Vec<usize> = self.units.iter().map(|u| u.layout.len).collect();
        let largest = self.units.iter().max_by_key(|u| u.layout.len).map_or("-", |u| u.name.as_str());
        let held = fsdp::held_elements(&self.units, |len| ShardInfo::split(len, sharing, 0).len);
        format!(
            "zero 3: {} unit(s) of --fsdp-unit {} ({} to {} parameters, the largest {largest}); at most {held} of {} parameters held per rank between steps, at most {} gathered at once; prefetch {}",
            self.units.len(),
            self.size.name(),
            lens.iter().min().unwrap_or(&0),
            lens.iter().max().unwrap_or(&0),
            lens.iter().sum::<usize>(),
            fsdp::peak_gathered_elements(&self.units, self.prefetch),
            if self.prefetch { "on (the next unit gathers while one computes)" } else { "off" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A compute thread that cannot start (no such GPU) says why, on the first job sent or
    /// waited for, whichever meets its end first.
    #[test]
    fn a_compute_thread_that_cannot_start_says_why() {
        let worker = UnitWorker::spawn(Vec::new(), Vec::new(), Device::Cuda(99), Precision::Fp32, StampClock::new(Device::Cuda(99))).unwrap();
        // Its end first, so that the send meets the closed channel (where the cause was lost).
        let started = Instant::now();
        while !worker.thread.as_ref().unwrap().is_finished() {
            assert!(started.elapsed() < Duration::from_secs(30), "the thread started on cuda:99");
            std::thread::sleep(Duration::from_millis(5));
        }
        let job = Job::Forward { unit: 0, input: Tensor::zeros([1], (Kind::Float, Device::Cpu)), train: false };
        let err = worker.send(job).unwrap_err().to_string();
        assert!(err.starts_with("zero 3: the compute thread has ended: making cuda:99 the current device"), "{err}");
    }
}
