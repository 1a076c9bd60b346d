//! The crate's one error type.
//!
//! Two kinds of failure need different endings in an MPI job:
//! - an error every rank learns about at the same point (bad options, a missing file, a bad
//!   dataset): the ranks agree on it with [`crate::topology::World::agree`], the lowest failing
//!   rank prints it once, and every rank exits non-zero after finalising MPI;
//! - an error only one rank sees in the middle of a collective phase (an I/O error mid-epoch, a
//!   NaN loss): the others are blocked in MPI calls and would wait forever, so the failing rank
//!   logs its rank and the cause and calls `MPI_Abort`.
//!
//! [`Error::Reported`] marks the first kind on the ranks that did not print it.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A bad option or combination of options.
    #[error("{0}")]
    Usage(String),

    /// A data file that cannot be used, with the reason.
    #[error("{path}: {reason}")]
    Data { path: PathBuf, reason: String },

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("HDF5 error in {path}: {source}")]
    Hdf5 {
        path: PathBuf,
        #[source]
        source: hdf5::Error,
    },

    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),

    /// A failure in a communication strategy (a broken invariant, a peer that sent the wrong size).
    #[error("{strategy}: {reason}")]
    Exchange { strategy: &'static str, reason: String },

    /// Training produced a non-finite value.
    #[error("non-finite {what} at step {step} (epoch {epoch})")]
    NonFinite { what: &'static str, step: u64, epoch: u64 },

    /// A checkpoint that cannot be used, with the reason.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },

    /// Results (runs.jsonl, reports) that cannot be read or written.
    #[error("{0}")]
    Results(String),

    /// A signal stopped training before its last step (rank 0 said so and where); every rank
    /// returns it. `checkpointed`: a checkpoint holds the step where it stopped (the run exits
    /// with [`crate::train::EXIT_STOPPED`], else with 1).
    #[error("stopped by a signal before the last step")]
    Stopped { checkpointed: bool },

    /// An error the ranks agreed on, on the rank that prints it: every rank is exiting.
    #[error("{0}")]
    Agreed(Box<Error>),

    /// An error that the ranks agreed on and that another rank (the lowest failing one) printed.
    #[error("rank {0} reported the error")]
    Reported(i32),
}

impl Error {
    pub fn usage(msg: impl Into<String>) -> Self {
        Error::Usage(msg.into())
    }

    pub fn data(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::Data { path: path.into(), reason: reason.into() }
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    pub fn hdf5(path: impl Into<PathBuf>, source: hdf5::Error) -> Self {
        Error::Hdf5 { path: path.into(), source }
    }

    pub fn exchange(strategy: &'static str, reason: impl Into<String>) -> Self {
        Error::Exchange { strategy, reason: reason.into() }
    }

}

/// Adds a path to I/O and HDF5 errors, so that every message names the file.
pub trait WithPath<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> WithPath<T> for std::result::Result<T, std::io::Error> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|e| Error::io(path, e))
    }
}

impl<T> WithPath<T> for std::result::Result<T, hdf5::Error> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|e| Error::hdf5(path, e))
    }
}
