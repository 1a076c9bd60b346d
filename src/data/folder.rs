//! Image folders in torchvision's ImageFolder layout: one sub-folder per class (class names are
//! the sorted folder names, labels their positions), images anywhere below it. JPEG and PNG
//! images are decoded in parallel, converted to RGB, resized so that the shorter side is `size`,
//! and centre-cropped to `size` x `size` (torchvision's `Resize(size)` then `CenterCrop(size)`).
//! A file that cannot be decoded is reported and skipped.
//!
//! Sizes: the writer declares each split's size before anything is written, but only decoding
//! tells which files are good images, and decoding is most of the work. Counting decodable
//! images in a first pass would decode everything twice (a header check is not enough: a file
//! damaged after its header passes it), so the splits are declared with the number of candidate
//! files as an upper bound and shrunk to what was written at the end
//! ([`DatasetWriter::create_at_most`]).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use image::imageops::FilterType;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::data::layout::{Meta, Split};
use crate::data::writer::{Compression, DatasetWriter};
use crate::error::{Error, Result, WithPath};

/// Output bytes decoded per block before they are written: bounds memory whatever the number of
/// images (each block is decoded in parallel, then written in order).
const BLOCK_BYTES: usize = 32 << 20;

/// Where the test split comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum TestSource {
    /// No test split (an empty one).
    None,
    /// A second folder with the same class sub-folders (a subset of them is fine).
    Folder(PathBuf),
    /// This fraction of each class's files, picked at random with the seed.
    Fraction(f64),
}

pub struct FolderSpec {
    pub input: PathBuf,
    pub test: TestSource,
    /// Side of the square images written.
    pub size: usize,
    pub seed: u64,
    pub name: String,
}

/// What an import did.
#[derive(Debug)]
pub struct Summary {
    pub train: usize,
    pub test: usize,
    pub classes: usize,
    /// Files that were not decodable JPEG or PNG images, with the reason.
    pub skipped: Vec<(PathBuf, String)>,
}

/// Class folders of `dir`, sorted by name. Hidden folders (`.ipynb_checkpoints`, `.git`) are
/// not classes.
pub fn class_folders(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    if !dir.is_dir() {
        return Err(Error::data(dir, "expected a folder with one sub-folder per class"));
    }
    let mut classes = Vec::new();
    for entry in std::fs::read_dir(dir).at(dir)? {
        let entry = entry.at(dir)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        // metadata() follows symbolic links: a linked class folder counts.
        if !name.starts_with('.') && std::fs::metadata(entry.path()).is_ok_and(|m| m.is_dir()) {
            classes.push((name, entry.path()));
        }
    }
    classes.sort();
    if classes.is_empty() {
        return Err(Error::data(dir, "holds no class folders (expected one sub-folder per class, as torchvision's ImageFolder)"));
    }
    Ok(classes)
}

/// Files below `dir`, sorted, hidden ones left out. Sub-folders are followed, but not through
/// symbolic links, which could form a loop.
pub fn files_below(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).at(&d)? {
            let entry = entry.at(&d)?;
            if entry.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let kind = entry.file_type().at(entry.path())?;
            if kind.is_dir() {
                pending.push(entry.path());
            } else if kind.is_file() || (kind.is_symlink() && entry.path().is_file()) {
                files.push(entry.path());
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Picks `fraction` of each class's samples for the test split, the same way for the same seed
/// and file list. Returns (train, test), each in the order of the input.
pub fn split_by_fraction(samples: Vec<(PathBuf, i64)>, classes: usize, fraction: f64, seed: u64) -> (Vec<(PathBuf, i64)>, Vec<(PathBuf, i64)>) {
    let mut is_test = vec![false; samples.len()];
    for class in 0..classes {
        let mut members: Vec<usize> = (0..samples.len()).filter(|&i| samples[i].1 == class as i64).collect();
        // A stream per class, so that adding files to one class does not change the others.
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(class as u64);
        members.shuffle(&mut rng);
        let take = (members.len() as f64 * fraction).round() as usize;
        for &i in &members[..take] {
            is_test[i] = true;
        }
    }
    let (test, train): (Vec<_>, Vec<_>) = samples.into_iter().zip(is_test).partition(|(_, t)| *t);
    (train.into_iter().map(|(s, _)| s).collect(), test.into_iter().map(|(s, _)| s).collect())
}

/// Decodes one image and returns it as RGB, `size` x `size`, channels first.
pub fn load_image(path: &Path, size: usize) -> std::result::Result<Vec<u8>, String> {
    let reader = image::ImageReader::open(path).map_err(|e| e.to_string())?.with_guessed_format().map_err(|e| e.to_string())?;
    match reader.format() {
        Some(image::ImageFormat::Jpeg | image::ImageFormat::Png) => {}
        Some(other) => return Err(format!("a {other:?} image; only JPEG and PNG are read")),
        None => return Err("not a JPEG or PNG image".into()),
    }
    // The decoder's default limits (512 MiB per image) turn a decompression bomb into an error.
    let decoded = reader.decode().map_err(|e| e.to_string())?;
    // Grey images gain three equal channels; an alpha channel is dropped.
    let rgb = decoded.to_rgb8();
    let (w, h) = (rgb.width() as usize, rgb.height() as usize);
    if w == 0 || h == 0 {
        return Err("an empty image".into());
    }
    // Shorter side to `size`, the other in proportion (rounded, at least `size`).
    let (nw, nh) = if w <= h {
        (size, ((h * size) as f64 / w as f64).round().max(size as f64) as usize)
    } else {
        (((w * size) as f64 / h as f64).round().max(size as f64) as usize, size)
    };
    // Triangle is bilinear with its support widened by the scale when shrinking, so it averages
    // every source pixel (as torchvision's antialiased bilinear resize does).
    let resized = if (nw, nh) == (w, h) { rgb } else { image::imageops::resize(&rgb, nw as u32, nh as u32, FilterType::Triangle) };
    let (x0, y0) = ((nw - size) / 2, (nh - size) / 2);
    let plane = size * size;
    let mut out = vec![0u8; 3 * plane];
    for y in 0..size {
        for x in 0..size {
            let p = resized.get_pixel((x0 + x) as u32, (y0 + y) as u32).0;
            for c in 0..3 {
                out[c * plane + y * size + x] = p[c];
            }
        }
    }
    Ok(out)
}

fn labelled_files(classes: &[(String, PathBuf)], index_of: impl Fn(&str) -> Result<i64>) -> Result<Vec<(PathBuf, i64)>> {
    let mut samples = Vec::new();
    for (name, dir) in classes {
        let label = index_of(name)?;
        samples.extend(files_below(dir)?.into_iter().map(|f| (f, label)));
    }
    Ok(samples)
}

pub fn import(spec: &FolderSpec, out: &Path, compression: Compression, force: bool) -> Result<Summary> {
    if spec.size == 0 {
        return Err(Error::usage("--size must be at least 1"));
    }
    let classes = class_folders(&spec.input)?;
    let class_names: Vec<String> = classes.iter().map(|(n, _)| n.clone()).collect();
    let all = labelled_files(&classes, |name| Ok(class_names.iter().position(|n| n == name).expect("listed above") as i64))?;
    let (train, test) = match &spec.test {
        TestSource::None => (all, Vec::new()),
        TestSource::Fraction(f) => {
            if !(*f > 0.0 && *f < 1.0) {
                return Err(Error::usage(format!("--test-fraction {f}: expected a number between 0 and 1")));
            }
            split_by_fraction(all, classes.len(), *f, spec.seed)
        }
        TestSource::Folder(dir) => {
            let test_classes = class_folders(dir)?;
            let test = labelled_files(&test_classes, |name| {
                class_names.iter().position(|n| n == name).map(|i| i as i64).ok_or_else(|| {
                    Error::data(dir.join(name), format!("a test class that {} does not have", spec.input.display()))
                })
            })?;
            (all, test)
        }
    };
    if train.is_empty() {
        return Err(Error::data(&spec.input, "no files in the class folders"));
    }

    let meta = Meta { name: spec.name.clone(), classes: classes.len(), class_names, channels: 3, height: spec.size, width: spec.size };
    let sample = meta.sample_bytes();
    let mut writer = DatasetWriter::create_at_most(out, meta, train.len(), test.len(), compression, force)?;
    let bar = progress_bar((train.len() + test.len()) as u64);
    let per_block = (BLOCK_BYTES / sample).max(1);
    let mut skipped = Vec::new();
    let mut written = [0usize; 2];
    for (split, samples) in [(Split::Train, &train), (Split::Test, &test)] {
        let mut images = Vec::with_capacity(per_block.min(samples.len()) * sample);
        let mut labels = Vec::with_capacity(per_block.min(samples.len()));
        for block in samples.chunks(per_block) {
            let decoded: Vec<std::result::Result<Vec<u8>, String>> = block
                .par_iter()
                .map(|(path, _)| {
                    let image = load_image(path, spec.size);
                    bar.inc(1);
                    image
                })
                .collect();
            images.clear();
            labels.clear();
            for ((path, label), result) in block.iter().zip(decoded) {
                match result {
                    Ok(pixels) => {
                        images.extend_from_slice(&pixels);
                        labels.push(*label);
                    }
                    Err(reason) => {
                        bar.suspend(|| log::warn!("skipping {}: {reason}", path.display()));
                        skipped.push((path.clone(), reason));
                    }
                }
            }
            writer.write(split, written[split as usize], &images, &labels)?;
            written[split as usize] += labels.len();
        }
    }
    bar.finish_and_clear();
    if written[0] == 0 {
        return Err(Error::data(&spec.input, format!("none of the {} training files is a readable JPEG or PNG image", train.len())));
    }
    writer.finish()?;
    Ok(Summary { train: written[0], test: written[1], classes: classes.len(), skipped })
}

/// A progress bar on a terminal; hidden otherwise (logs and pipes get the summary only).
fn progress_bar(total: u64) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} images ({per_sec}, {eta} left)")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fraction_split_is_stratified_and_repeatable() {
        let samples: Vec<(PathBuf, i64)> = (0..100).map(|i| (PathBuf::from(format!("f{i:03}")), (i % 4) as i64)).collect();
        let (train, test) = split_by_fraction(samples.clone(), 4, 0.2, 9);
        assert_eq!(test.len(), 20);
        assert_eq!(train.len(), 80);
        for class in 0..4 {
            assert_eq!(test.iter().filter(|s| s.1 == class).count(), 5);
        }
        let (train2, test2) = split_by_fraction(samples.clone(), 4, 0.2, 9);
        assert_eq!((train, test.clone()), (train2, test2));
        let (_, other) = split_by_fraction(samples, 4, 0.2, 10);
        assert_ne!(test, other);
    }
}
