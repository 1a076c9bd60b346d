//! Files mapped into memory, read-only: a checkpoint's part files, so that a reader that needs a
//! slice of a tensor reads only the pages it touches.
//!
//! The invariant the mapping relies on: nobody writes or truncates a mapped file while its map
//! lives. Checkpoint files are written once into a partial folder and never changed in place
//! after the rename that completes it; a file removed meanwhile (pruning by another run) keeps
//! its pages until the map is dropped. A file truncated by hand while mapped would end the
//! process with SIGBUS when a lost page is touched, which is what reading it would find anyway.

use std::path::Path;

/// Maps the whole of `path` read-only.
pub fn map_read_only(path: &Path) -> std::io::Result<memmap2::Mmap> {
    let file = std::fs::File::open(path)?;
    // SAFETY: the map is read-only and private to this process; the module's invariant (no
    // writer changes a checkpoint file after it is complete) keeps its contents stable.
    unsafe { memmap2::Mmap::map(&file) }
}
