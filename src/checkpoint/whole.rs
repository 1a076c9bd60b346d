//! Today's whole checkpoints (formats 1 to 3): rank 0 writes every model variable into
//! weights.safetensors and the optimizer's state into optimizer.safetensors.

use std::path::{Path, PathBuf};

use tch::Tensor;

use crate::error::{Error, Result, WithPath};

use super::files::{folder_name, partial_dir, place, prune, write_meta, Retention};
use super::meta::{check_file, crc32_of, CheckpointMeta, META_FILE, OPTIMIZER_FILE, WEIGHTS_FILE, WHOLE_FORMAT};

/// The files of a whole checkpoint.
pub const WHOLE_FILES: [&str; 2] = [WEIGHTS_FILE, OPTIMIZER_FILE];

/// Writes a checkpoint (rank 0), then prunes older ones by `retention` ([`prune`]). A write
/// that fails leaves no partial folder behind.
pub fn save(root: &Path, meta: CheckpointMeta, weights: &[(String, Tensor)], momentum: &[(String, Tensor)], retention: Retention) -> Result<PathBuf> {
    let step = meta.step;
    let partial = partial_dir(root, step);
    let _ = std::fs::remove_dir_all(&partial);
    let saved = write_complete(root, &partial, meta, weights, momentum);
    if saved.is_err() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    let final_dir = saved?;
    prune(root, step, retention);
    Ok(final_dir)
}

/// Writes the checkpoint into `partial`, then moves it into place.
fn write_complete(root: &Path, partial: &Path, mut meta: CheckpointMeta, weights: &[(String, Tensor)], momentum: &[(String, Tensor)]) -> Result<PathBuf> {
    let final_dir = root.join(folder_name(meta.step));
    std::fs::create_dir_all(partial).at(partial)?;
    let host = |list: &[(String, Tensor)]| -> Result<Vec<(String, Tensor)>> {
        list.iter().map(|(n, t)| Ok((n.clone(), t.f_to_device(tch::Device::Cpu)?.f_contiguous()?))).collect()
    };
    for (file, list) in [(WEIGHTS_FILE, host(weights)?), (OPTIMIZER_FILE, host(momentum)?)] {
        let path = partial.join(file);
        Tensor::write_safetensors(&list, &path)?;
        std::fs::File::open(&path).and_then(|f| f.sync_all()).at(&path)?;
        meta.files.insert(file.to_string(), crc32_of(&path)?);
    }
    write_meta(partial, meta, WHOLE_FORMAT)?;
    place(root, partial, &final_dir)?;
    Ok(final_dir)
}

/// Checks a whole checkpoint's two files: present with their recorded sizes and CRC-32s (every
/// byte read), and both parse as safetensors.
pub fn verify_files(dir: &Path, meta: &CheckpointMeta) -> Result<()> {
    let bad = |reason: String| Error::Checkpoint { path: dir.to_path_buf(), reason };
    for file in WHOLE_FILES {
        let expected = meta.files.get(file).ok_or_else(|| bad(format!("{META_FILE} lists no {file}")))?;
        check_file(dir, file, expected).map_err(bad)?;
        Tensor::read_safetensors(dir.join(file)).map_err(|e| bad(format!("{file}: {e}")))?;
    }
    Ok(())
}
