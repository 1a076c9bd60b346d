//! Points in time of a `--zero 3` step, taken on its two threads and read at the step's end:
//! how much of the gathers and reduce-scatters the units' compute hid (plan::fsdp::exposure).
//!
//! On CPU ranks a call is done when it returns, and a stamp is the host clock. On a GPU the
//! compute thread's calls return once their kernels are queued on its stream, and the MPI
//! thread's collectives run on a communication stream: there a stamp is a CUDA timing event
//! recorded on the calling thread's current stream, and its time is the device's, read once the
//! step has waited for the device. The events are reused from step to step (a pool shared by
//! both threads), as the gradient hooks' are.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tch::Device;

use crate::error::{Error, Result};
use crate::plan::fsdp::Span;
use crate::raw::CudaEvent;

/// A point in time on one thread: the host clock's, or a recorded event's.
pub(super) enum Stamp {
    Host(Instant),
    Device(CudaEvent),
}

/// A stretch between two stamps of one thread.
pub(super) struct Stamped {
    pub start: Stamp,
    pub end: Stamp,
}

/// Takes stamps on any thread (clones share the event pool) and reads them against an anchor.
#[derive(Clone)]
pub(super) struct StampClock {
    device: Device,
    /// Timing events recorded and read before, free for the next stamps.
    spare: Arc<Mutex<Vec<CudaEvent>>>,
}

impl StampClock {
    pub fn new(device: Device) -> StampClock {
        StampClock { device, spare: Arc::default() }
    }

    /// Now: on the host clock (CPU ranks), or an event recorded on the calling thread's current
    /// stream of the device, whose time is when the device gets there.
    pub fn now(&self) -> Result<Stamp> {
        if !self.device.is_cuda() {
            return Ok(Stamp::Host(Instant::now()));
        }
        let reused = self.spare.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let event = match reused {
            Some(event) => event,
            None => CudaEvent::reusable(self.device, true)?.ok_or_else(|| Error::exchange("zero 3", "a CUDA device without events"))?,
        };
        event.record_current(self.device)?;
        Ok(Stamp::Device(event))
    }

    /// Runs `work` between two stamps of the calling thread.
    pub fn time<T>(&self, work: impl FnOnce() -> Result<T>) -> Result<(T, Stamped)> {
        let start = self.now()?;
        let result = work()?;
        Ok((result, Stamped { start, end: self.now()? }))
    }

    /// Waits for the work queued on its stream before `stamp` (nothing on the host clock).
    pub fn wait(&self, stamp: &Stamp) -> Result<()> {
        match stamp {
            Stamp::Host(_) => Ok(()),
            Stamp::Device(event) => event.synchronize(),
        }
    }

    /// `stretch` on the anchor's clock, in milliseconds; its events go back to the pool. On a
    /// GPU, waits for the stretch's end (the step has waited for the device by then anyway).
    pub fn span(&self, anchor: &Stamp, stretch: Stamped) -> Result<Span> {
        let start_ms = self.since(anchor, stretch.start)?;
        let end_ms = self.since(anchor, stretch.end)?;
        Ok(Span { start_ms, end_ms })
    }

    fn since(&self, anchor: &Stamp, stamp: Stamp) -> Result<f64> {
        match (anchor, stamp) {
            (Stamp::Host(anchor), Stamp::Host(at)) => Ok(at.saturating_duration_since(*anchor).as_secs_f64() * 1e3),
            (Stamp::Device(anchor), Stamp::Device(at)) => {
                let ms = anchor.elapsed_ms(&at);
                self.give_back(Stamp::Device(at));
                ms
            }
            _ => Err(Error::exchange("zero 3", "a host time read against a device time")),
        }
    }

    /// A stamp no longer needed: its event back to the pool.
    pub fn give_back(&self, stamp: Stamp) {
        if let Stamp::Device(event) = stamp {
            self.spare.lock().unwrap_or_else(|e| e.into_inner()).push(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// On CPU ranks stamps are the host clock, read against the anchor from any thread.
    #[test]
    fn host_stamps_read_in_milliseconds_from_the_anchor() {
        let clock = StampClock::new(Device::Cpu);
        let anchor = clock.now().unwrap();
        std::thread::sleep(Duration::from_millis(2));
        let other = clock.clone();
        let stretch = std::thread::spawn(move || {
            let start = other.now().unwrap();
            std::thread::sleep(Duration::from_millis(3));
            Stamped { start, end: other.now().unwrap() }
        })
        .join()
        .unwrap();
        let span = clock.span(&anchor, stretch).unwrap();
        assert!(span.start_ms >= 2.0 && span.len_ms() >= 3.0 && span.end_ms < 2_000.0, "{span:?}");
    }
}
