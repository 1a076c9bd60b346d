//! Files mapped into memory, read-only: a checkpoint's part files, so that a reader that needs a
//! slice of a tensor reads only the pages it touches.
//!
//! The invariant the mapping relies on: nobody writes or truncates a mapped file while its map
//! lives. Checkpoint files are written once into a partial folder and never changed in place
//! after the rename that completes it; a file removed meanwhile (pruning by another run) keeps
//! its pages until the map is dropped. A file truncated by hand while mapped would end the
//! process with SIGBUS when a lost page is touched, which is what reading it would find anyway.

use std::path::Path;

/// Lets go of this process's pages of `map[offset .. offset + len]` (whole pages around it):
/// they stay in the page cache, and a later read faults them back in. A reader that copies a
/// piece out of a mapped checkpoint file calls it after the copy, so that the file's pages do
/// not pile up in its resident memory: mapped and touched, a ViT-L/16 checkpoint's part files
/// counted 2.2 to 4.2 GB of resident memory per rank during a resume that needed 1.2 GB, in
/// cgroups of 2 GiB (clean pages the kernel can take back, but charged all the same).
pub fn release_pages(map: &memmap2::Mmap, offset: usize, len: usize) {
    if len == 0 {
        return;
    }
    // SAFETY: MADV_DONTNEED on a shared read-only mapping of a file drops only page-table
    // entries; the next access reads the same bytes again from the page cache or the file, so
    // a slice borrowed from the map still reads what it read (the module's invariant: nobody
    // changes a mapped checkpoint file). The range is inside the map (the caller's slice of
    // it); memmap2 aligns its start down to a page. A refusal only leaves the pages mapped.
    let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
}

/// Maps the whole of `path` read-only.
pub fn map_read_only(path: &Path) -> std::io::Result<memmap2::Mmap> {
    let file = std::fs::File::open(path)?;
    // SAFETY: the map is read-only and private to this process; the module's invariant (no
    // writer changes a checkpoint file after it is complete) keeps its contents stable.
    unsafe { memmap2::Mmap::map(&file) }
}
