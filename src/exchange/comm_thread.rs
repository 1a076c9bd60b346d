//! Communication threads (the Horovod-style background thread, a colocated parameter server):
//! started with the rank's GPU as their current device, counted while they run, and joined
//! before MPI is finalized.
//!
//! `MPI_Finalize` while another thread is inside MPI is erroneous (Open MPI aborts or hangs).
//! A strategy's thread is normally joined by the strategy's `finish`; on an error path the
//! strategy is dropped instead, and dropping a [`CommThread`] waits a bounded time for the
//! thread to end (the strategy has told it to stop before). `main` finalizes MPI only when
//! [`running`] says no such thread is left, and aborts the job otherwise.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tch::Device;

use crate::error::{Error, Result};

/// Communication threads started and not yet ended, in this process.
static RUNNING: AtomicUsize = AtomicUsize::new(0);

/// How long dropping a thread waits for it: it ends within a cycle once every rank has told its
/// own to stop; one that is still running then waits for ranks that are not stopping, and the
/// job is going to be aborted anyway.
const DROP_GRACE: Duration = Duration::from_secs(10);

/// Communication threads of this process still running.
pub fn running() -> usize {
    RUNNING.load(Ordering::SeqCst)
}

/// Decrements the count when the thread's body ends, however it ends (a panic included).
struct Counted;

impl Drop for Counted {
    fn drop(&mut self) {
        RUNNING.fetch_sub(1, Ordering::SeqCst);
    }
}

pub struct CommThread<T> {
    name: &'static str,
    handle: Option<JoinHandle<Result<T>>>,
}

impl<T: Send + 'static> CommThread<T> {
    /// Starts `body` on a thread named `name`, with `device` current on it (a no-op for the CPU).
    pub fn spawn(name: &'static str, device: Device, body: impl FnOnce() -> Result<T> + Send + 'static) -> Result<CommThread<T>> {
        RUNNING.fetch_add(1, Ordering::SeqCst);
        let spawned = std::thread::Builder::new().name(name.into()).spawn(move || {
            let _counted = Counted;
            crate::raw::set_cuda_device(device)?;
            body()
        });
        match spawned {
            Ok(handle) => Ok(CommThread { name, handle: Some(handle) }),
            Err(e) => {
                RUNNING.fetch_sub(1, Ordering::SeqCst);
                Err(Error::exchange(name, format!("cannot start the thread: {e}")))
            }
        }
    }

    /// Waits for the thread and returns what it returned (its panic as an error).
    pub fn join(mut self) -> Result<T> {
        let handle = self.handle.take().expect("joined once");
        handle.join().map_err(|_| Error::exchange(self.name, "the thread panicked"))?
    }
}

impl<T> Drop for CommThread<T> {
    fn drop(&mut self) {
        let Some(handle) = self.handle.take() else { return };
        let start = Instant::now();
        while !handle.is_finished() && start.elapsed() < DROP_GRACE {
            std::thread::sleep(Duration::from_millis(5));
        }
        if handle.is_finished() {
            if let Ok(Err(e)) = handle.join() {
                log::debug!("{} thread ended with: {e}", self.name);
            }
        } else {
            log::warn!("the {} thread is still inside MPI after {:.0} s; the job will be aborted rather than finalized", self.name, DROP_GRACE.as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_counted_until_they_end_and_drop_waits_for_them() {
        let before = running();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = CommThread::spawn("test", Device::Cpu, move || {
            let _ = rx.recv();
            std::thread::sleep(Duration::from_millis(50));
            Ok(7)
        })
        .unwrap();
        assert!(running() > before);
        drop(tx); // tell it to stop, as a strategy's Drop does
        drop(t); // waits for it
        assert_eq!(running(), before);
        let t = CommThread::spawn("test", Device::Cpu, || Ok(3)).unwrap();
        assert_eq!(t.join().unwrap(), 3);
    }
}
