//! Datasets: the HDF5 layout ([`layout`], and [`fingerprint`] for checkpoints), where a run's
//! data comes from, a file or generated ([`source`]), the sharded reader ([`reader`]) and the
//! loader that reads ahead in training's order ([`loader`]); the writer and the importers
//! ([`writer`], [`idx`], [`cifar10`], [`svhn`] with [`mat`], [`folder`], [`synth`]); the `data`
//! commands ([`command`], [`bench`]).
//!
//! The files below import each other directly; the layers above take the layout's types
//! through the re-exports here.

pub mod bench;
pub mod cifar10;
pub mod command;
pub mod fingerprint;
pub mod folder;
pub mod idx;
pub mod layout;
pub mod loader;
pub mod mat;
pub mod reader;
pub mod source;
pub mod svhn;
pub mod synth;
pub mod writer;

pub use fingerprint::fingerprint;
pub use layout::{DatasetInfo, Labels, Split};
pub use source::open;
