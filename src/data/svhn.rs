//! SVHN, the cropped-digits format (`train_32x32.mat`, `test_32x32.mat`, optionally
//! `extra_32x32.mat`): MAT-files of level 5 whose variable `X` is uint8 32 x 32 x 3 x N (height,
//! width, channel, image; column-major, so the row index varies fastest) and whose `y` holds N
//! labels 1..10, where 10 stands for the digit 0.

use std::path::Path;

use crate::data::layout::{Meta, Split};
use crate::data::mat;
use crate::data::writer::{Compression, DatasetWriter};
use crate::error::{Error, Result};

pub const CLASSES: usize = 10;

/// Images transposed and written per block (bounds the second copy of the images in memory).
const BLOCK_BYTES: usize = 16 << 20;

/// The shape of a file's `X` and `y`, checked before anything is read.
struct Shape {
    height: usize,
    width: usize,
    channels: usize,
    images: usize,
}

fn shape_of<R: std::io::Read + std::io::Seek>(path: &Path, file: &mat::MatReader<R>) -> Result<Shape> {
    let bad = |reason: String| Error::data(path, reason);
    let x = file.find("X").map_err(bad)?;
    if x.class != mat::Class::UInt8 {
        return Err(bad(format!("variable `X` is a {} array, SVHN images are uint8", x.class.name())));
    }
    // MATLAB drops trailing dimensions of 1: one image is 32 x 32 x 3.
    let (height, width, channels, images) = match x.dims[..] {
        [h, w, c, n] => (h, w, c, n),
        [h, w, c] => (h, w, c, 1),
        _ => return Err(bad(format!("variable `X` has dimensions {:?}, expected height x width x channels x images", x.dims))),
    };
    if height == 0 || width == 0 || channels == 0 {
        return Err(bad(format!("variable `X` has dimensions {:?}: an empty image dimension", x.dims)));
    }
    let y = file.find("y").map_err(bad)?;
    if !y.class.is_numeric() {
        return Err(bad(format!("variable `y` is a {} array, expected numeric labels", y.class.name())));
    }
    let labels = y.numel().unwrap_or(usize::MAX);
    if labels != images || y.dims.iter().filter(|&&d| d != 1).count() > 1 {
        return Err(bad(format!("variable `y` has dimensions {:?}, expected {images} x 1 (one label per image in `X`)", y.dims)));
    }
    Ok(Shape { height, width, channels, images })
}

/// SVHN's labels 1..10 as classes 0..9 (10 is the digit 0).
pub fn digit_labels(values: &[f64]) -> std::result::Result<Vec<i64>, String> {
    values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            if v.fract() == 0.0 && (1.0..=10.0).contains(&v) {
                Ok(v as i64 % 10)
            } else {
                Err(format!("`y` [{i}] is {v}; SVHN labels are 1..10 (10 stands for the digit 0)"))
            }
        })
        .collect()
}

/// One image from MATLAB's column-major height x width x channels order into channels x height x
/// width (row-major), appended to `out`.
pub fn image_to_chw(src: &[u8], height: usize, width: usize, channels: usize, out: &mut Vec<u8>) {
    debug_assert_eq!(src.len(), height * width * channels);
    for c in 0..channels {
        let plane = &src[c * height * width..(c + 1) * height * width];
        for row in 0..height {
            out.extend((0..width).map(|col| plane[col * height + row]));
        }
    }
}

pub fn import(train: &Path, test: &Path, out: &Path, compression: Compression, force: bool) -> Result<(usize, usize)> {
    let mut train_file = mat::open(train)?;
    let mut test_file = mat::open(test)?;
    let train_shape = shape_of(train, &train_file)?;
    let test_shape = shape_of(test, &test_file)?;
    let dims = |s: &Shape| [s.channels, s.height, s.width];
    if dims(&train_shape) != dims(&test_shape) {
        return Err(Error::data(
            test,
            format!("images are {:?} (C x H x W), the training images {:?}", dims(&test_shape), dims(&train_shape)),
        ));
    }
    let meta = Meta {
        name: "svhn".into(),
        classes: CLASSES,
        class_names: (0..CLASSES).map(|d| d.to_string()).collect(),
        channels: train_shape.channels,
        height: train_shape.height,
        width: train_shape.width,
    };
    let mut writer = DatasetWriter::create(out, meta, train_shape.images, test_shape.images, compression, force)?;
    for (split, path, file, shape) in [(Split::Train, train, &mut train_file, &train_shape), (Split::Test, test, &mut test_file, &test_shape)] {
        let bad = |reason: String| Error::data(path, reason);
        // Labels first: a bad label fails before the images are read.
        let labels = digit_labels(&file.read_numeric("y").map_err(bad)?.to_f64()).map_err(bad)?;
        let images = file.read_numeric("X").map_err(bad)?.into_u8().map_err(|e| bad(format!("variable `X`: {e}")))?;
        let sample = shape.channels * shape.height * shape.width;
        let per_block = (BLOCK_BYTES / sample).max(1);
        let mut block = Vec::with_capacity(per_block.min(shape.images) * sample);
        for first in (0..shape.images).step_by(per_block) {
            let n = per_block.min(shape.images - first);
            block.clear();
            for src in images[first * sample..(first + n) * sample].chunks_exact(sample) {
                image_to_chw(src, shape.height, shape.width, shape.channels, &mut block);
            }
            writer.write(split, first, &block, &labels[first..first + n])?;
        }
    }
    writer.finish()?;
    Ok((train_shape.images, test_shape.images))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_is_the_digit_zero() {
        assert_eq!(digit_labels(&[1.0, 9.0, 10.0]).unwrap(), vec![1, 9, 0]);
        assert!(digit_labels(&[0.0]).unwrap_err().contains("[0] is 0"));
        assert!(digit_labels(&[3.0, 11.0]).unwrap_err().contains("[1] is 11"));
        assert!(digit_labels(&[2.5]).is_err());
        assert!(digit_labels(&[f64::NAN]).is_err());
    }

    #[test]
    fn column_major_hwc_becomes_chw() {
        // 2 rows x 3 columns x 2 channels; value = 100 c + 10 row + col, laid out column-major.
        let (h, w, c) = (2, 3, 2);
        let mut src = vec![0u8; h * w * c];
        for ch in 0..c {
            for row in 0..h {
                for col in 0..w {
                    src[row + h * col + h * w * ch] = (100 * ch + 10 * row + col) as u8;
                }
            }
        }
        let mut out = Vec::new();
        image_to_chw(&src, h, w, c, &mut out);
        assert_eq!(out, vec![0, 1, 2, 10, 11, 12, 100, 101, 102, 110, 111, 112]);
    }
}
