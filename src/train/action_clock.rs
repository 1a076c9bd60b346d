//! How long a pipeline stage's compute actions (F, B, W) take, without stopping the device.
//!
//! On CPU ranks an action's calls return when its work is done, and the host clock times it. On
//! a GPU they return once its kernels are queued: timing them on the host needed a device-wide
//! synchronisation after every action, which kept the host from queueing the next action while
//! the device ran this one. There each action is bracketed by a pair of reused CUDA timing
//! events instead, read once at the step's end ([`ActionClock::finish`]), where the step waits
//! for its last kernels anyway. The timeline places an action at its device start, measured from
//! an anchor event recorded when the step begins (the device is idle then: the step before ended
//! by waiting for it).

use std::time::{Duration, Instant};

use tch::Device;

use crate::error::Result;
use crate::raw::CudaEvent;

/// The compute actions a stage times, as the figures and the timeline sort them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    Forward,
    /// An unsplit backward (B and W together).
    Backward,
    InputGrad,
    WeightGrad,
}

/// An action that has started: its host start, and on a GPU the index of its event pair.
pub(super) struct Started {
    host: Instant,
    host_us: f64,
    pair: Option<usize>,
}

/// An action's duration, once known: at once on the host, at the step's end on a GPU.
pub(super) struct Timed {
    pub phase: Phase,
    /// The chunk (of the model's 0..V*P) it computed.
    pub chunk: usize,
    pub label: String,
    /// Where the action starts on the timeline (its clock: microseconds since rank 0's start).
    pub start_us: f64,
    pub took: Duration,
}

/// A GPU step's actions waiting for their times.
struct Pending {
    phase: Phase,
    chunk: usize,
    label: String,
    pair: usize,
}

pub(super) struct ActionClock {
    device: Device,
    /// On a GPU: the step's anchor event and the host time it was recorded at.
    anchor: Option<(CudaEvent, f64)>,
    /// On a GPU: begin and end events, reused from step to step (one pair per action of a step).
    pairs: Vec<(CudaEvent, CudaEvent)>,
    used: usize,
    pending: Vec<Pending>,
}

impl ActionClock {
    pub fn new(device: Device) -> ActionClock {
        ActionClock { device, anchor: None, pairs: Vec::new(), used: 0, pending: Vec::new() }
    }

    /// Whether times come at the step's end ([`ActionClock::finish`]) rather than at each
    /// [`ActionClock::stop`].
    pub fn deferred(&self) -> bool {
        self.device.is_cuda()
    }

    /// Starts a step: on a GPU, records the anchor the step's actions are placed from.
    pub fn begin_step(&mut self, host_us: f64) -> Result<()> {
        self.used = 0;
        self.pending.clear();
        if !self.deferred() {
            return Ok(());
        }
        if self.anchor.is_none() {
            self.anchor = CudaEvent::reusable(self.device, true)?.map(|e| (e, host_us));
        }
        if let Some((event, at)) = &mut self.anchor {
            event.record_current(self.device)?;
            *at = host_us;
        }
        Ok(())
    }

    /// Starts an action now (`host_us` on the timeline's clock).
    pub fn start(&mut self, host_us: f64) -> Result<Started> {
        let pair = if self.deferred() {
            if self.used == self.pairs.len() {
                let (begin, end) = (CudaEvent::reusable(self.device, true)?, CudaEvent::reusable(self.device, true)?);
                self.pairs.push((begin.expect("a CUDA device has events"), end.expect("a CUDA device has events")));
            }
            self.pairs[self.used].0.record_current(self.device)?;
            self.used += 1;
            Some(self.used - 1)
        } else {
            None
        };
        Ok(Started { host: Instant::now(), host_us, pair })
    }

    /// Ends an action: its time on the host (CPU ranks), or None on a GPU, where it comes with
    /// the step's others from [`ActionClock::finish`].
    pub fn stop(&mut self, started: Started, phase: Phase, chunk: usize, label: impl FnOnce() -> String) -> Result<Option<Timed>> {
        match started.pair {
            None => Ok(Some(Timed { phase, chunk, label: label(), start_us: started.host_us, took: started.host.elapsed() })),
            Some(pair) => {
                self.pairs[pair].1.record_current(self.device)?;
                self.pending.push(Pending { phase, chunk, label: label(), pair });
                Ok(None)
            }
        }
    }

    /// The step's GPU actions with their device times, waiting for the last of them; nothing
    /// on CPU ranks.
    pub fn finish(&mut self) -> Result<Vec<Timed>> {
        let Some((anchor, anchor_us)) = &self.anchor else { return Ok(Vec::new()) };
        let mut timed = Vec::with_capacity(self.pending.len());
        for p in self.pending.drain(..) {
            let (begin, end) = &self.pairs[p.pair];
            let took_ms = begin.elapsed_ms(end)?;
            let offset_ms = anchor.elapsed_ms(begin)?;
            timed.push(Timed {
                phase: p.phase,
                chunk: p.chunk,
                label: p.label,
                start_us: anchor_us + offset_ms * 1e3,
                took: Duration::from_secs_f64(took_ms.max(0.0) / 1e3),
            });
        }
        Ok(timed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_actions_are_timed_on_the_host_at_once() {
        let mut clock = ActionClock::new(Device::Cpu);
        clock.begin_step(100.0).unwrap();
        assert!(!clock.deferred());
        let started = clock.start(150.0).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        let timed = clock.stop(started, Phase::InputGrad, 1, || "B 3 (chunk 1)".into()).unwrap().expect("timed at once");
        assert_eq!((timed.phase, timed.chunk, timed.label.as_str(), timed.start_us), (Phase::InputGrad, 1, "B 3 (chunk 1)", 150.0));
        assert!(timed.took >= Duration::from_millis(2), "{:?}", timed.took);
        assert!(clock.finish().unwrap().is_empty(), "nothing is deferred on the host");
    }
}
