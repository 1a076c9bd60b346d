//! IDX files (MNIST, Fashion-MNIST), gzipped or not.
//!
//! Format: two zero bytes, a type byte (0x08 = unsigned byte, the only type image sets use), a
//! dimension count, the dimensions as big-endian u32, then the data in row-major order.

use std::io::Read;
use std::path::Path;

use crate::data::layout::{Meta, Split};
use crate::data::writer::{Compression, DatasetWriter};
use crate::error::{Error, Result, WithPath};

/// An IDX array of unsigned bytes.
#[derive(Debug, PartialEq, Eq)]
pub struct Idx {
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

/// Refuse headers that promise more than this (a corrupt header must not trigger a huge
/// allocation).
const MAX_IDX_BYTES: usize = 64 << 30;

pub fn read(path: &Path) -> Result<Idx> {
    let raw = std::fs::read(path).at(path)?;
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| Error::data(path, format!("gzip stream is damaged: {e}")))?;
        out
    } else {
        raw
    };
    parse(&bytes).map_err(|reason| Error::data(path, reason))
}

pub fn parse(bytes: &[u8]) -> std::result::Result<Idx, String> {
    if bytes.len() < 4 {
        return Err(format!("{} bytes: too short for an IDX header", bytes.len()));
    }
    if bytes[0] != 0 || bytes[1] != 0 {
        return Err("not an IDX file (the first two bytes must be zero)".into());
    }
    if bytes[2] != 0x08 {
        return Err(format!("IDX element type 0x{:02x}; only unsigned bytes (0x08) are supported", bytes[2]));
    }
    let ndims = bytes[3] as usize;
    if ndims == 0 {
        return Err("IDX header declares no dimensions".into());
    }
    let header = 4 + 4 * ndims;
    if bytes.len() < header {
        return Err(format!("truncated IDX header: {ndims} dimensions need {header} bytes, the file has {}", bytes.len()));
    }
    let dims: Vec<usize> = (0..ndims)
        .map(|i| u32::from_be_bytes(bytes[4 + 4 * i..8 + 4 * i].try_into().unwrap()) as usize)
        .collect();
    let expected = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).filter(|&n| n <= MAX_IDX_BYTES);
    let Some(expected) = expected else {
        return Err(format!("IDX dimensions {dims:?} are implausibly large"));
    };
    let data = &bytes[header..];
    if data.len() != expected {
        return Err(format!(
            "IDX dimensions {dims:?} need {expected} bytes of data, the file holds {} ({})",
            data.len(),
            if data.len() < expected { "truncated" } else { "trailing bytes" }
        ));
    }
    Ok(Idx { dims, data: data.to_vec() })
}

/// Paths of an IDX import: images and labels for each split.
pub struct IdxPaths<'a> {
    pub train_images: &'a Path,
    pub train_labels: &'a Path,
    pub test_images: &'a Path,
    pub test_labels: &'a Path,
}

/// Converts IDX image and label files into the project's layout (one grey channel).
pub fn import(paths: &IdxPaths, out: &Path, name: &str, class_names: Vec<String>, compression: Compression, force: bool) -> Result<(usize, usize)> {
    let load = |images: &Path, labels: &Path| -> Result<(Idx, Vec<i64>)> {
        let im = read(images)?;
        if im.dims.len() != 3 {
            return Err(Error::data(images, format!("image IDX has dimensions {:?}, expected N x H x W", im.dims)));
        }
        let lb = read(labels)?;
        if lb.dims.len() != 1 {
            return Err(Error::data(labels, format!("label IDX has dimensions {:?}, expected N", lb.dims)));
        }
        if lb.dims[0] != im.dims[0] {
            return Err(Error::data(labels, format!("{} labels for {} images in {}", lb.dims[0], im.dims[0], images.display())));
        }
        Ok((im, lb.data.iter().map(|&l| l as i64).collect()))
    };
    let (train, train_labels) = load(paths.train_images, paths.train_labels)?;
    let (test, test_labels) = load(paths.test_images, paths.test_labels)?;
    if train.dims[1..] != test.dims[1..] {
        return Err(Error::data(paths.test_images, format!("test images are {:?}, training images {:?}", &test.dims[1..], &train.dims[1..])));
    }
    let max_label = train_labels.iter().chain(&test_labels).copied().max().unwrap_or(0) as usize;
    let classes = class_names.len().max(max_label + 1);
    let meta = Meta { name: name.to_string(), classes, class_names, channels: 1, height: train.dims[1], width: train.dims[2] };
    let mut writer = DatasetWriter::create(out, meta, train.dims[0], test.dims[0], compression, force)?;
    writer.write(Split::Train, 0, &train.data, &train_labels)?;
    writer.write(Split::Test, 0, &test.data, &test_labels)?;
    writer.finish()?;
    Ok((train.dims[0], test.dims[0]))
}

/// Writes an IDX file of unsigned bytes (for tests and small fixtures).
#[cfg(test)]
pub fn encode(dims: &[usize], data: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, 0x08, dims.len() as u8];
    for &d in dims {
        out.extend_from_slice(&(d as u32).to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let data: Vec<u8> = (0..24).collect();
        let idx = parse(&encode(&[2, 3, 4], &data)).unwrap();
        assert_eq!(idx, Idx { dims: vec![2, 3, 4], data });
    }

    #[test]
    fn damaged_files_are_errors_not_panics() {
        let good = encode(&[2, 3, 4], &[7; 24]);
        for cut in 0..good.len() {
            assert!(parse(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(parse(&long).unwrap_err().contains("trailing"));
        let mut wrong_type = good.clone();
        wrong_type[2] = 0x0d;
        assert!(parse(&wrong_type).unwrap_err().contains("0x0d"));
        assert!(parse(&encode(&[u32::MAX as usize, u32::MAX as usize, 16], &[])).unwrap_err().contains("implausibly"));
        // Pseudo-random garbage never panics.
        let mut x = 12345u32;
        for len in 0..300 {
            let bytes: Vec<u8> = (0..len).map(|_| { x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345); (x >> 16) as u8 }).collect();
            let _ = parse(&bytes);
        }
    }
}
