//! Checkpoints: weights and optimizer state, written so that a crash never damages the last
//! good one, found again on `--resume`.
//!
//! A checkpoint is a folder `ckpt-<step>` under `--checkpoint-dir`, in one of two formats. A
//! whole checkpoint ([`save`], formats 1 to 3) holds
//! - `weights.safetensors`: every model variable by its torchvision name (loadable with
//!   `safetensors.torch.load_file` and `model.load_state_dict`),
//! - `optimizer.safetensors`: the optimizer's state buffers of every parameter, by parameter
//!   name for the momentum (SGD, LARS), `exp_avg/<name>` and `exp_avg_sq/<name>` for AdamW,
//! - `meta.json`: the step, what the run was (model, dataset and its content fingerprint,
//!   strategy, ranks, batch, seed, optimizer settings and learning-rate schedule, binary) and
//!   the size and CRC-32 of each file,
//! - `meta.crc32`: the size and CRC-32 of `meta.json` itself, so that an edited step or
//!   setting is found like a damaged weight file.
//!
//! A sharded checkpoint ([`save_sharded`], format 4, issue 49) holds one `part-<rank>.safetensors`
//! per rank with the pieces that rank held (rectangles or flat ranges of tensors, see
//! [`Region`]), `index.json` (every tensor's global shape, dtype and pieces, and every part
//! file's size and CRC-32), and meta.json and meta.crc32 as above, meta.json's checks covering
//! index.json. [`CheckpointReader`] reads any region of any tensor from either format, so that a
//! run resumes at any layout; `hpc-train checkpoint consolidate` ([`command`]) turns either
//! into one weights file.
//!
//! Rank 0 writes a whole checkpoint into a hidden `.ckpt-<step>.partial` folder, syncs every
//! file, and renames the folder into place: an interrupted write leaves at most a partial folder
//! that `--resume` never looks at (a write that fails, on a full disk, removes it). A sharded
//! one goes into the same partial folder, every rank writing its part file, and is renamed once
//! every part is synced and read back against its CRC-32. A damaged complete checkpoint (a file
//! truncated or changed afterwards) fails its checks and the previous one is used. The data
//! order needs no state of its own: it is a function of the seed, the epoch and the step.
//!
//! A run holds a lock (flock) on `.lock` in the folder while it runs, naming its process and
//! host there: two runs sharing a folder would prune and replace each other's checkpoints. A
//! write prunes only good checkpoints older than itself, never the one the run resumed from
//! ([`files::prune`]), and no command writes anything into a checkpoint folder
//! ([`files::check_not_in_checkpoint`]).
//!
//! The files: [`meta`] (meta.json, compatibility), [`files`] (folders, syncing, pruning, the
//! lock), [`whole`] and [`sharded`] (the two writers), [`region`] (which elements a piece
//! holds), [`index`] (index.json and the coverage check), [`stream`] (safetensors written a
//! tensor at a time), [`reader`] (verification and reading, both formats), [`command`] (the
//! `checkpoint` commands: consolidate, reshard).

pub mod command;
pub mod files;
pub mod index;
pub mod meta;
pub mod reader;
pub mod region;
pub mod sharded;
pub mod stream;
pub mod whole;

// What the rest of the crate names as `checkpoint::X`; the sharded format's API is named by
// its file (`checkpoint::sharded::save_sharded`, `checkpoint::reader::CheckpointReader`,
// `checkpoint::region::Region`, `checkpoint::index::Section`).
pub use files::{check_not_in_checkpoint, check_writable, FolderLock, Retention};
pub use meta::{check_compatible, state_name, Checkpoint, CheckpointMeta};
pub use whole::save;

#[cfg(test)]
mod tests;
