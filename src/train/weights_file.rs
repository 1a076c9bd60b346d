//! `--init-weights`: a safetensors file of the model's variables by name (what `--save-weights`
//! and checkpoints write, or a torchvision state_dict saved with safetensors), read one
//! variable at a time: every rank reads the variables it holds and nothing else, so no rank
//! holds the file whole (a ViT-L/16's is 1.2 GB).
//!
//! The format: 8 bytes of header length (little-endian), a JSON header mapping each name to
//! its dtype, shape and byte range in the data that follows. Only the header is parsed
//! whole; a variable's bytes are read at their offset.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata};
use tch::{Kind, Tensor};

use crate::error::{Error, Result};

/// The largest header read: safetensors' own limit (100 MB).
const MAX_HEADER: u64 = 100_000_000;

pub(super) struct WeightsFile {
    /// What the file is, for messages: "--init-weights" or "the checkpoint's weights".
    what: &'static str,
    path: PathBuf,
    file: File,
    /// Where the data starts: after the length and the header.
    data_at: u64,
    tensors: HashMap<String, (Dtype, Vec<usize>, (usize, usize))>,
}

impl WeightsFile {
    pub(super) fn open(what: &'static str, path: &Path) -> Result<WeightsFile> {
        let refuse = |reason: String| Error::usage(format!("{what} {}: {reason}", path.display()));
        let file = File::open(path).map_err(|e| refuse(format!("cannot open it ({e})")))?;
        let mut length = [0u8; 8];
        file.read_exact_at(&mut length, 0).map_err(|e| refuse(format!("not a safetensors file: no header ({e})")))?;
        let length = u64::from_le_bytes(length);
        if length > MAX_HEADER {
            return Err(refuse(format!("not a safetensors file: a header of {length} bytes")));
        }
        let mut header = vec![0u8; length as usize];
        file.read_exact_at(&mut header, 8).map_err(|e| refuse(format!("not a safetensors file: its header is cut short ({e})")))?;
        let metadata: Metadata = serde_json::from_slice(&header).map_err(|e| refuse(format!("not a safetensors file: its header does not parse ({e})")))?;
        let tensors = metadata.tensors().into_iter().map(|(name, info)| (name, (info.dtype, info.shape.clone(), info.data_offsets))).collect();
        Ok(WeightsFile { what, path: path.to_path_buf(), file, data_at: 8 + length, tensors })
    }

    /// The variable `name`, which must have `shape`, as f32 on the CPU.
    pub(super) fn read(&self, name: &str, shape: &[i64]) -> Result<Tensor> {
        let refuse = |reason: String| Error::usage(format!("{} {}: {reason}", self.what, self.path.display()));
        let (dtype, saved_shape, (start, end)) =
            self.tensors.get(name).ok_or_else(|| refuse(format!("no tensor {name} among its {} (weights of another model?)", self.tensors.len())))?;
        let saved: Vec<i64> = saved_shape.iter().map(|&d| d as i64).collect();
        if saved != shape {
            return Err(refuse(format!("{name} has shape {saved:?}, the model's is {shape:?}")));
        }
        let kind = match dtype {
            Dtype::F32 => Kind::Float,
            Dtype::F16 => Kind::Half,
            Dtype::BF16 => Kind::BFloat16,
            Dtype::F64 => Kind::Double,
            other => return Err(refuse(format!("{name} is {other:?}, not a floating-point tensor"))),
        };
        let mut bytes = vec![0u8; end - start];
        self.file.read_exact_at(&mut bytes, self.data_at + *start as u64).map_err(|e| refuse(format!("cannot read {name} ({e})")))?;
        Ok(Tensor::f_from_data_size(&bytes, shape, kind)?.f_to_kind(Kind::Float)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_one_variable_at_a_time_and_names_what_does_not_fit() {
        let dir = std::env::temp_dir().join(format!("hpc-train-weights-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.safetensors");
        let a = Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).view([2, 3]);
        let b = Tensor::from_slice(&[1.5f32, -2.0]).to_kind(Kind::BFloat16);
        Tensor::write_safetensors(&[("a.weight", &a), ("b.bias", &b)], &path).unwrap();
        let file = WeightsFile::open("--init-weights", &path).unwrap();
        assert!(file.read("a.weight", &[2, 3]).unwrap().equal(&a));
        assert!(file.read("b.bias", &[2]).unwrap().equal(&Tensor::from_slice(&[1.5f32, -2.0])));
        let err = file.read("a.weight", &[3, 2]).unwrap_err().to_string();
        assert!(err.contains("a.weight has shape [2, 3], the model's is [3, 2]"), "{err}");
        assert!(file.read("c", &[1]).unwrap_err().to_string().contains("no tensor c among its 2"));
        std::fs::write(&path, b"not safetensors at all").unwrap();
        assert!(WeightsFile::open("--init-weights", &path).err().unwrap().to_string().contains("not a safetensors file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
