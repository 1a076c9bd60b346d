//! Progress while training: running sums of the step timings ([`Timings`]), the loss over a
//! window of steps, rank 0's progress bar or log lines, and the per-rank trace of the samples
//! trained on.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tch::Tensor;

use crate::data::loader::Batch;
use crate::error::{Error, Result, WithPath};

/// Running sums of one rank's step timings.
#[derive(Default, Clone, Copy)]
pub(super) struct Timings {
    pub(super) steps: u64,
    pub(super) samples: u64,
    pub(super) data_wait: Duration,
    pub(super) compute: Duration,
    pub(super) comm: Duration,
    pub(super) optimizer: Duration,
    pub(super) step: Duration,
    /// With overlap: all exchange time, and the part of the step after backward ended.
    pub(super) exchange_total: Duration,
    pub(super) exchange_exposed: Duration,
}

impl Timings {
    pub(super) fn mean_ms(&self, d: Duration) -> f64 {
        if self.steps == 0 { 0.0 } else { d.as_secs_f64() * 1e3 / self.steps as f64 }
    }
}

impl Timings {
    pub(super) fn add(&mut self, t: &Timings) {
        self.steps += t.steps;
        self.samples += t.samples;
        self.data_wait += t.data_wait;
        self.compute += t.compute;
        self.comm += t.comm;
        self.optimizer += t.optimizer;
        self.step += t.step;
        self.exchange_total += t.exchange_total;
        self.exchange_exposed += t.exchange_exposed;
    }
}

/// A step's loss: read, or left on the device with its step's gradient flag (step.rs,
/// `DeferredChecks`).
pub(super) enum StepLoss {
    Read(f64),
    OnDevice(PendingLoss),
}

/// A loss and gradient flag not read yet, and the step they belong to.
pub(super) struct PendingLoss {
    /// The rank's summed loss (a 0-dim float tensor).
    pub(super) loss: Tensor,
    /// The gradients' flag as it stood after this step (1: not finite at this step or before).
    pub(super) not_finite: Tensor,
    /// Test hook (`nan` fault): the loss reads as NaN.
    pub(super) injected_nan: bool,
    pub(super) step: u64,
    pub(super) epoch: u64,
}

impl PendingLoss {
    /// Reads every pending step's loss and flag in one transfer and returns the losses, or the
    /// error of the first step whose loss or gradients were not finite.
    pub(super) fn read_all(pending: &[PendingLoss]) -> Result<Vec<f64>> {
        if pending.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<Tensor> = pending.iter().map(|p| Tensor::f_cat(&[p.loss.f_view([1])?, p.not_finite.shallow_clone()], 0)).collect::<std::result::Result<_, _>>()?;
        let values = Vec::<f32>::try_from(Tensor::f_stack(&rows, 0)?.f_to_device(tch::Device::Cpu)?.f_view([-1])?)?;
        let mut losses = Vec::with_capacity(pending.len());
        for (p, pair) in pending.iter().zip(values.chunks(2)) {
            let loss = finite_loss(f64::from(pair[0]), p.injected_nan, p.step, p.epoch)?;
            if pair[1] != 0.0 {
                return Err(Error::NonFinite { what: "gradient", step: p.step, epoch: p.epoch });
            }
            losses.push(loss);
        }
        Ok(losses)
    }
}

/// A step's summed loss as read, or its error when it is not finite (`injected_nan`: the `nan`
/// fault's test hook, under which it reads as NaN).
pub(super) fn finite_loss(value: f64, injected_nan: bool, step: u64, epoch: u64) -> Result<f64> {
    let value = if injected_nan { f64::NAN } else { value };
    if !value.is_finite() {
        return Err(Error::NonFinite { what: "loss", step, epoch });
    }
    Ok(value)
}

/// Mean training loss over a window of steps, and the last step's loss.
pub(super) struct LossWindow {
    pub(super) sum: f64,
    pub(super) samples: f64,
    /// The last step's summed loss and samples on this worker.
    pub(super) last: (f64, f64),
    /// Steps whose loss is still on the device, with their samples (step::DeferredChecks).
    pending: Vec<(PendingLoss, usize)>,
}

impl Default for LossWindow {
    fn default() -> Self {
        LossWindow { sum: 0.0, samples: 0.0, last: (f64::NAN, 0.0), pending: Vec::new() }
    }
}

impl LossWindow {
    pub(super) fn add(&mut self, loss: StepLoss, samples: usize) {
        match loss {
            StepLoss::Read(value) => self.count(value, samples),
            StepLoss::OnDevice(pending) => self.pending.push((pending, samples)),
        }
    }

    /// A step's loss, read, into the window and as the last step's.
    fn count(&mut self, value: f64, samples: usize) {
        self.sum += value;
        self.samples += samples as f64;
        self.last = (value, samples as f64);
    }

    /// Reads the pending steps' losses (one wait for the device), or fails on the first step
    /// whose loss or gradients were not finite.
    pub(super) fn settle(&mut self) -> Result<()> {
        let pending = std::mem::take(&mut self.pending);
        let (steps, samples): (Vec<PendingLoss>, Vec<usize>) = pending.into_iter().unzip();
        for (value, n) in PendingLoss::read_all(&steps)?.into_iter().zip(samples) {
            self.count(value, n);
        }
        Ok(())
    }

    /// Starts the next progress line's window (the pending steps stay: read before a line).
    pub(super) fn restart(&mut self) {
        self.sum = 0.0;
        self.samples = 0.0;
    }
}

/// One file per rank listing the samples it trained on: `epoch step index,index,...`.
pub(super) struct SampleTrace(Option<std::io::BufWriter<std::fs::File>>, PathBuf);

impl SampleTrace {
    pub(super) fn open(dir: Option<&Path>, rank: i32) -> Result<SampleTrace> {
        let Some(dir) = dir else { return Ok(SampleTrace(None, PathBuf::new())) };
        std::fs::create_dir_all(dir).at(dir)?;
        let path = dir.join(format!("rank{rank}.txt"));
        Ok(SampleTrace(Some(std::io::BufWriter::new(std::fs::File::create(&path).at(&path)?)), path))
    }

    pub(super) fn record(&mut self, batch: &Batch) -> Result<()> {
        use std::io::Write;
        if let Some(w) = &mut self.0 {
            let list: Vec<String> = batch.indices.iter().map(|i| i.to_string()).collect();
            writeln!(w, "{} {} {}", batch.epoch, batch.step, list.join(",")).at(&self.1)?;
            w.flush().at(&self.1)?;
        }
        Ok(())
    }
}

/// Progress on rank 0: a bar on a terminal, a log line every `every` steps otherwise.
pub(super) struct Progress {
    pub(super) bar: Option<indicatif::ProgressBar>,
    pub(super) active: bool,
    pub(super) every: u64,
}

impl Progress {
    pub(super) fn new(root: bool, total: u64, every: u64) -> Progress {
        let bar = (root && std::io::stderr().is_terminal()).then(|| {
            let bar = indicatif::ProgressBar::new(total);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps {msg}")
                    .expect("a valid template")
                    .progress_chars("=> "),
            );
            bar
        });
        Progress { bar, active: root, every: every.max(1) }
    }

    pub(super) fn due(&self, step: u64) -> bool {
        (step + 1).is_multiple_of(self.every)
    }

    pub(super) fn report(&self, step: u64, epoch: u64, loss: f64, t: &Timings) {
        if !self.active {
            return;
        }
        let rate = t.samples as f64 / t.step.as_secs_f64().max(1e-9);
        let msg = format!(
            "loss {loss:.4} | {rate:.1} img/s | step {:.1} ms (compute {:.1}, comm {:.1}, data {:.1})",
            t.mean_ms(t.step), t.mean_ms(t.compute), t.mean_ms(t.comm), t.mean_ms(t.data_wait)
        );
        match &self.bar {
            Some(bar) => {
                bar.set_position(step + 1);
                bar.set_message(msg);
            }
            None => log::info!("epoch {} step {}: {msg}", epoch + 1, step + 1),
        }
    }

    pub(super) fn suspend(&self, f: impl FnOnce()) {
        match &self.bar {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }

    pub(super) fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
