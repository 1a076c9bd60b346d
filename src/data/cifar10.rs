//! CIFAR-10 binary batches: `data_batch_1.bin` .. `data_batch_5.bin` and `test_batch.bin`, each
//! a sequence of 3073-byte records (one label byte, then 32x32 red, green and blue planes), and
//! `batches.meta.txt` with the class names.

use std::path::{Path, PathBuf};

use crate::data::layout::{Meta, Split};
use crate::data::writer::{Compression, DatasetWriter};
use crate::error::{Error, Result, WithPath};

pub const SIDE: usize = 32;
pub const IMAGE_BYTES: usize = 3 * SIDE * SIDE;
pub const RECORD_BYTES: usize = 1 + IMAGE_BYTES;
pub const CLASSES: usize = 10;
pub const TRAIN_FILES: [&str; 5] = ["data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin", "data_batch_4.bin", "data_batch_5.bin"];
pub const TEST_FILE: &str = "test_batch.bin";

/// Records in one batch file, checking its size.
fn record_count(path: &Path) -> Result<usize> {
    let len = std::fs::metadata(path).at(path)?.len() as usize;
    if len == 0 || !len.is_multiple_of(RECORD_BYTES) {
        return Err(Error::data(path, format!("{len} bytes is not a whole number of {RECORD_BYTES}-byte CIFAR-10 records")));
    }
    Ok(len / RECORD_BYTES)
}

/// Splits a batch file's bytes into images and labels, checking the labels.
pub fn parse_records(path: &Path, bytes: &[u8]) -> Result<(Vec<u8>, Vec<i64>)> {
    if bytes.is_empty() || !bytes.len().is_multiple_of(RECORD_BYTES) {
        return Err(Error::data(path, format!("{} bytes is not a whole number of {RECORD_BYTES}-byte CIFAR-10 records", bytes.len())));
    }
    let mut images = Vec::with_capacity(bytes.len() / RECORD_BYTES * IMAGE_BYTES);
    let mut labels = Vec::with_capacity(bytes.len() / RECORD_BYTES);
    for (i, record) in bytes.chunks_exact(RECORD_BYTES).enumerate() {
        if record[0] as usize >= CLASSES {
            return Err(Error::data(path, format!("record {i} has label {}, CIFAR-10 labels are 0..9", record[0])));
        }
        labels.push(record[0] as i64);
        images.extend_from_slice(&record[1..]);
    }
    Ok((images, labels))
}

pub fn import(dir: &Path, out: &Path, compression: Compression, force: bool) -> Result<(usize, usize)> {
    if !dir.is_dir() {
        return Err(Error::data(dir, "expected the folder of CIFAR-10 binary batches (cifar-10-batches-bin)"));
    }
    let train_files: Vec<PathBuf> = TRAIN_FILES.iter().map(|f| dir.join(f)).collect();
    let test_file = dir.join(TEST_FILE);
    let train_len = train_files.iter().map(|p| record_count(p)).sum::<Result<usize>>()?;
    let test_len = record_count(&test_file)?;

    let meta_path = dir.join("batches.meta.txt");
    let class_names: Vec<String> = match std::fs::read_to_string(&meta_path) {
        Ok(text) => text.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect(),
        Err(_) => Vec::new(),
    };
    if !class_names.is_empty() && class_names.len() != CLASSES {
        return Err(Error::data(&meta_path, format!("{} class names, CIFAR-10 has {CLASSES}", class_names.len())));
    }
    let meta = Meta { name: "cifar10".into(), classes: CLASSES, class_names, channels: 3, height: SIDE, width: SIDE };
    let mut writer = DatasetWriter::create(out, meta, train_len, test_len, compression, force)?;
    let mut offset = 0;
    for path in &train_files {
        let (images, labels) = parse_records(path, &std::fs::read(path).at(path)?)?;
        writer.write(Split::Train, offset, &images, &labels)?;
        offset += labels.len();
    }
    let (images, labels) = parse_records(&test_file, &std::fs::read(&test_file).at(&test_file)?)?;
    writer.write(Split::Test, 0, &images, &labels)?;
    writer.finish()?;
    Ok((train_len, test_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn damaged_batches_are_errors_not_panics() {
        let path = Path::new("data_batch_1.bin");
        let mut good = Vec::new();
        for label in [3u8, 9] {
            good.push(label);
            good.extend((0..IMAGE_BYTES).map(|i| (i % 251) as u8 ^ label));
        }
        let (images, labels) = parse_records(path, &good).unwrap();
        assert_eq!(labels, vec![3, 9]);
        assert_eq!(&images[IMAGE_BYTES..IMAGE_BYTES + 3], &[9, 1 ^ 9, 2 ^ 9]);
        // Every cut but the record boundaries is an error.
        for cut in 0..good.len() {
            let result = parse_records(path, &good[..cut]);
            assert_eq!(result.is_ok(), cut == RECORD_BYTES, "cut at {cut}");
        }
        // A label byte out of range names the record.
        for bad_label in [10u8, 0xff] {
            let mut bad = good.clone();
            bad[RECORD_BYTES] = bad_label;
            let err = parse_records(path, &bad).unwrap_err().to_string();
            assert!(err.contains(&format!("record 1 has label {bad_label}")) && err.contains("data_batch_1.bin"), "{err}");
        }
        // Flipping any pixel byte changes nothing but that pixel.
        let mut flipped = good.clone();
        flipped[100] ^= 0xff;
        assert_eq!(parse_records(path, &flipped).unwrap().0[99], images[99] ^ 0xff);
    }
}
