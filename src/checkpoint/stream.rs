//! Safetensors files written one tensor at a time: the header (every tensor's key, dtype, shape
//! and byte range) first, then each tensor's bytes as it comes, so that memory holds one tensor
//! at a time; the size and CRC-32 are computed on the way out. The files are plain safetensors
//! (little-endian, row-major, the header padded with spaces to 8 bytes as the safetensors crate
//! writes it): any safetensors reader loads them.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result, WithPath};

use super::meta::FileCheck;

/// The safetensors name of a tensor element type.
pub fn dtype_name(kind: Kind) -> Option<&'static str> {
    Some(match kind {
        Kind::Float => "F32",
        Kind::Double => "F64",
        Kind::Half => "F16",
        Kind::BFloat16 => "BF16",
        Kind::Int64 => "I64",
        Kind::Int => "I32",
        Kind::Int16 => "I16",
        Kind::Int8 => "I8",
        Kind::Uint8 => "U8",
        Kind::Bool => "BOOL",
        _ => return None,
    })
}

/// The element type of a safetensors dtype name ([`dtype_name`]'s inverse).
pub fn kind_of(dtype: &str) -> Option<Kind> {
    [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16, Kind::Int64, Kind::Int, Kind::Int16, Kind::Int8, Kind::Uint8, Kind::Bool]
        .into_iter()
        .find(|&k| dtype_name(k) == Some(dtype))
}

/// One tensor of a file's header.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub key: String,
    pub kind: Kind,
    pub shape: Vec<i64>,
}

impl Entry {
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<i64>() as u64 * self.kind.elt_size_in_bytes() as u64
    }
}

/// A safetensors file being written: [`StreamWriter::create`] writes the header,
/// [`StreamWriter::write_next`] each tensor in the header's order, [`StreamWriter::finish`]
/// syncs it.
pub struct StreamWriter {
    path: PathBuf,
    out: BufWriter<std::fs::File>,
    hasher: crc32fast::Hasher,
    bytes: u64,
    entries: Vec<Entry>,
    next: usize,
}

impl StreamWriter {
    /// Creates `path` and writes the header of `entries` (keys must be distinct).
    pub fn create(path: &Path, entries: Vec<Entry>) -> Result<StreamWriter> {
        let mut header = serde_json::Map::new();
        let mut offset = 0u64;
        for e in &entries {
            let dtype = dtype_name(e.kind).ok_or_else(|| Error::Checkpoint { path: path.to_path_buf(), reason: format!("tensor {}: elements of type {:?} have no safetensors name", e.key, e.kind) })?;
            let end = offset + e.bytes();
            let info = serde_json::json!({ "dtype": dtype, "shape": e.shape, "data_offsets": [offset, end] });
            if header.insert(e.key.clone(), info).is_some() {
                return Err(Error::Checkpoint { path: path.to_path_buf(), reason: format!("tensor {} listed twice", e.key) });
            }
            offset = end;
        }
        let mut text = serde_json::to_vec(&header).map_err(|e| Error::Checkpoint { path: path.to_path_buf(), reason: e.to_string() })?;
        // The data then starts at a multiple of 8 bytes, as the safetensors crate aligns it.
        text.resize(text.len().next_multiple_of(8), b' ');
        let file = std::fs::File::create(path).at(path)?;
        let mut writer = StreamWriter { path: path.to_path_buf(), out: BufWriter::with_capacity(1 << 20, file), hasher: crc32fast::Hasher::new(), bytes: 0, entries, next: 0 };
        writer.put(&(text.len() as u64).to_le_bytes())?;
        writer.put(&text)?;
        Ok(writer)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.out.write_all(bytes).at(&self.path)?;
        self.hasher.update(bytes);
        self.bytes += bytes.len() as u64;
        Ok(())
    }

    /// Writes the next tensor of the header: `data` (on any device, any strides) must have its
    /// element type and as many elements; it is copied to the host alone.
    pub fn write_next(&mut self, data: &Tensor) -> Result<()> {
        let bad = |reason: String| Error::Checkpoint { path: self.path.clone(), reason };
        let entry = self.entries.get(self.next).ok_or_else(|| bad("more tensors written than its header lists".into()))?.clone();
        let numel: i64 = entry.shape.iter().product();
        if data.kind() != entry.kind || data.numel() as i64 != numel {
            return Err(bad(format!("tensor {}: got {} elements of {:?}, its header says {numel} of {:?}", entry.key, data.numel(), data.kind(), entry.kind)));
        }
        let host = data.f_to_device(Device::Cpu)?.f_contiguous()?;
        let mut bytes = vec![0u8; entry.bytes() as usize];
        host.f_copy_data_u8(&mut bytes, numel as usize)?;
        self.put(&bytes)?;
        self.next += 1;
        Ok(())
    }

    /// Flushes and syncs the file once every tensor is written; its size and CRC-32.
    pub fn finish(mut self) -> Result<FileCheck> {
        if self.next != self.entries.len() {
            return Err(Error::Checkpoint { path: self.path.clone(), reason: format!("{} of its {} tensors written", self.next, self.entries.len()) });
        }
        self.out.flush().at(&self.path)?;
        self.out.get_ref().sync_all().at(&self.path)?;
        Ok(FileCheck { bytes: self.bytes, crc32: self.hasher.finalize() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streamed_file_is_plain_safetensors_with_its_check() {
        let dir = super::super::files::tests::scratch("stream");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).reshape([2, 3]);
        let b = Tensor::from_slice(&[7i64, 8]);
        let entries = vec![Entry { key: "a".into(), kind: Kind::Float, shape: vec![2, 3] }, Entry { key: "b".into(), kind: Kind::Int64, shape: vec![2] }];
        let mut w = StreamWriter::create(&path, entries).unwrap();
        // A transposed view is written in row-major order of the header's shape.
        w.write_next(&a.tr().contiguous().tr()).unwrap();
        w.write_next(&b).unwrap();
        let check = w.finish().unwrap();
        assert_eq!(check, super::super::meta::crc32_of(&path).unwrap());
        let read: std::collections::BTreeMap<String, Tensor> = Tensor::read_safetensors(&path).unwrap().into_iter().collect();
        assert!(read["a"].equal(&a) && read["b"].equal(&b));
        let mut short = StreamWriter::create(&path, vec![Entry { key: "a".into(), kind: Kind::Float, shape: vec![2, 3] }]).unwrap();
        let err = short.write_next(&b).unwrap_err().to_string();
        assert!(err.contains("tensor a: got 2 elements of Int64, its header says 6 of Float"), "{err}");
        assert!(short.finish().unwrap_err().to_string().contains("0 of its 1 tensors written"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
