//! Writing a dataset file in the project's layout, block by block, so that memory stays bounded
//! whatever the dataset size. The file is written under a temporary name and renamed at the
//! end: a failed import never leaves a half-written file where a good one was expected.

use std::path::{Path, PathBuf};

use std::str::FromStr;

use hdf5::types::VarLenUnicode;
use hdf5::{Extent, SimpleExtents};
use ndarray::{s, ArrayView1, ArrayView4};

use crate::data::layout::{Meta, Split};
use crate::error::{Error, Result, WithPath};

/// Target bytes per chunk of the image datasets. Training reads random rows, so chunks stay
/// small: a random read pulls in one chunk, and 64 KiB keeps that cheap while still giving
/// compression something to work with. Large images get one image per chunk.
pub const CHUNK_TARGET_BYTES: usize = 64 << 10;

/// Rows per chunk of a resizable label dataset (16 KiB of i32).
const LABEL_CHUNK_ROWS: usize = 4096;

/// Filters for the image datasets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Compression {
    None,
    /// Deflate (zlib) level 4: built into every HDF5.
    Gzip,
    /// LZF (h5py's filter): faster than gzip, compresses less. Readers need the filter: h5py
    /// and this program have it, a plain HDF5 installation does not.
    Lzf,
}


/// Rows per chunk for images of `sample_bytes`, in a split of `len` rows.
pub fn chunk_rows(sample_bytes: usize, len: usize) -> usize {
    (CHUNK_TARGET_BYTES / sample_bytes.max(1)).clamp(1, len.max(1))
}

pub struct DatasetWriter {
    final_path: PathBuf,
    tmp_path: PathBuf,
    file: Option<hdf5::File>,
    meta: Meta,
    images: [hdf5::Dataset; 2],
    labels: [hdf5::Dataset; 2],
    lens: [usize; 2],
    written: [usize; 2],
    /// End of the highest rows written, per split.
    end: [usize; 2],
    /// The splits were declared with an upper bound and shrink to what was written at the end.
    shrink_at_finish: bool,
    /// Per channel: sum and sum of squares of the training pixels in [0, 1].
    sums: Vec<(f64, f64)>,
}

impl DatasetWriter {
    /// Creates `<out>` (under a temporary name until [`DatasetWriter::finish`]) for `train` and
    /// `test` samples. An existing `out` is only replaced with `force`.
    pub fn create(out: &Path, meta: Meta, train: usize, test: usize, compression: Compression, force: bool) -> Result<Self> {
        Self::create_with(out, meta, [train, test], compression, force, false)
    }

    /// Like [`DatasetWriter::create`] for at most `train` and `test` samples: each split holds
    /// rows 0.. as written, and [`DatasetWriter::finish`] shrinks it to them. For sources where
    /// only the decoding tells which samples are good (image folders), so that nothing has to be
    /// decoded twice. The datasets are chunked (the labels too) with an unlimited first
    /// dimension, which HDF5 requires to change their extent.
    pub fn create_at_most(out: &Path, meta: Meta, train: usize, test: usize, compression: Compression, force: bool) -> Result<Self> {
        Self::create_with(out, meta, [train, test], compression, force, true)
    }

    fn create_with(out: &Path, meta: Meta, [train, test]: [usize; 2], compression: Compression, force: bool, shrink_at_finish: bool) -> Result<Self> {
        if out.exists() && !force {
            return Err(Error::data(out, "already exists; pass --force to replace it"));
        }
        if meta.classes == 0 || meta.sample_bytes() == 0 {
            return Err(Error::data(out, format!("nothing to write: {} classes, images {}x{}x{}", meta.classes, meta.channels, meta.height, meta.width)));
        }
        if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).at(dir)?;
        }
        let file_name = out.file_name().ok_or_else(|| Error::data(out, "not a file name"))?;
        let tmp_path = out.with_file_name(format!(".{}.tmp{}", file_name.to_string_lossy(), std::process::id()));
        let file = hdf5::File::create(&tmp_path).at(&tmp_path)?;

        let make = |split: Split, len: usize| -> Result<(hdf5::Dataset, hdf5::Dataset)> {
            let group = file.create_group(split.name()).at(&tmp_path)?;
            let rows = chunk_rows(meta.sample_bytes(), len);
            let first = if shrink_at_finish { Extent::resizable(len) } else { Extent::fixed(len) };
            let shape = SimpleExtents::from_vec(vec![first, Extent::fixed(meta.channels), Extent::fixed(meta.height), Extent::fixed(meta.width)]);
            let mut builder = group.new_dataset::<u8>();
            if len > 0 {
                builder = builder.chunk([rows, meta.channels, meta.height, meta.width]);
                builder = match compression {
                    Compression::None => builder,
                    Compression::Gzip => builder.deflate(4),
                    Compression::Lzf => builder.lzf(),
                };
            }
            let images = builder.shape(shape).create("images").at(&tmp_path)?;
            let mut labels = group.new_dataset::<i32>();
            if shrink_at_finish && len > 0 {
                labels = labels.chunk([len.min(LABEL_CHUNK_ROWS)]);
            }
            let labels = labels.shape(SimpleExtents::from_vec(vec![first])).create("labels").at(&tmp_path)?;
            Ok((images, labels))
        };
        let (train_images, train_labels) = make(Split::Train, train)?;
        let (test_images, test_labels) = make(Split::Test, test)?;
        let channels = meta.channels;
        Ok(DatasetWriter {
            final_path: out.to_path_buf(),
            tmp_path,
            file: Some(file),
            meta,
            images: [train_images, test_images],
            labels: [train_labels, test_labels],
            lens: [train, test],
            written: [0, 0],
            end: [0, 0],
            shrink_at_finish,
            sums: vec![(0.0, 0.0); channels],
        })
    }

    /// Writes `labels.len()` samples of `split` starting at row `offset`.
    pub fn write(&mut self, split: Split, offset: usize, images: &[u8], labels: &[i64]) -> Result<()> {
        let i = split as usize;
        let n = labels.len();
        let m = &self.meta;
        if images.len() != n * m.sample_bytes() {
            return Err(Error::data(&self.final_path, format!("{} image bytes for {n} labels", images.len())));
        }
        if offset + n > self.lens[i] {
            return Err(Error::data(&self.final_path, format!("rows {offset}..{} past the {} declared", offset + n, self.lens[i])));
        }
        if let Some(&bad) = labels.iter().find(|&&l| l < 0 || l as usize >= m.classes) {
            return Err(Error::data(&self.final_path, format!("label {bad} outside 0..{}", m.classes)));
        }
        if n == 0 {
            return Ok(());
        }
        let view = ArrayView4::from_shape((n, m.channels, m.height, m.width), images).expect("sizes checked above");
        self.images[i].write_slice(view, s![offset..offset + n, .., .., ..]).at(&self.tmp_path)?;
        let labels32: Vec<i32> = labels.iter().map(|&l| l as i32).collect();
        self.labels[i].write_slice(ArrayView1::from(&labels32), s![offset..offset + n]).at(&self.tmp_path)?;
        self.written[i] += n;
        self.end[i] = self.end[i].max(offset + n);
        if split == Split::Train {
            let plane = m.height * m.width;
            for sample in images.chunks_exact(m.sample_bytes()) {
                for (c, pixels) in sample.chunks_exact(plane).enumerate() {
                    let (sum, sq) = pixels.iter().fold((0u64, 0u64), |(s, q), &p| (s + p as u64, q + (p as u64) * (p as u64)));
                    self.sums[c].0 += sum as f64 / 255.0;
                    self.sums[c].1 += sq as f64 / (255.0 * 255.0);
                }
            }
        }
        Ok(())
    }

    /// Writes the attributes, closes the file and moves it into place.
    pub fn finish(mut self) -> Result<PathBuf> {
        for (i, split) in [Split::Train, Split::Test].iter().enumerate() {
            if self.shrink_at_finish {
                // Rows 0..end, each written once.
                if self.written[i] != self.end[i] {
                    return Err(Error::data(
                        &self.final_path,
                        format!("{} {} samples written, not rows 0..{} without gaps", self.written[i], split.name(), self.end[i]),
                    ));
                }
                if self.written[i] < self.lens[i] {
                    let m = &self.meta;
                    self.images[i].resize([self.written[i], m.channels, m.height, m.width]).at(&self.tmp_path)?;
                    self.labels[i].resize([self.written[i]]).at(&self.tmp_path)?;
                    self.lens[i] = self.written[i];
                }
            } else if self.written[i] != self.lens[i] {
                return Err(Error::data(
                    &self.final_path,
                    format!("{} of {} {} samples written", self.written[i], self.lens[i], split.name()),
                ));
            }
        }
        if self.lens[0] == 0 {
            return Err(Error::data(&self.final_path, "no training samples to write"));
        }
        let m = &self.meta;
        let values = (m.height * m.width * self.lens[0]) as f64;
        let mean: Vec<f32> = self.sums.iter().map(|(s, _)| (s / values) as f32).collect();
        let std: Vec<f32> = self
            .sums
            .iter()
            .zip(&mean)
            .map(|((_, q), &mu)| ((q / values - (mu as f64).powi(2)).max(0.0).sqrt() as f32).max(1e-3))
            .collect();
        let text = |s: &str| VarLenUnicode::from_str(s).map_err(|e| Error::data(&self.final_path, format!("{s:?}: {e}")));
        let name = text(&m.name)?;
        let class_names: Vec<VarLenUnicode> = m.class_names.iter().map(|n| text(n)).collect::<Result<_>>()?;
        let file = self.file.take().expect("finish runs once");
        let write_attrs = |file: &hdf5::File| -> hdf5::Result<()> {
            file.new_attr::<VarLenUnicode>().create("name")?.write_scalar(&name)?;
            file.new_attr::<i64>().create("num_classes")?.write_scalar(&(m.classes as i64))?;
            if !class_names.is_empty() {
                file.new_attr::<VarLenUnicode>().shape(class_names.len()).create("class_names")?.write(&class_names)?;
            }
            file.new_attr::<f32>().shape(mean.len()).create("mean")?.write(&mean)?;
            file.new_attr::<f32>().shape(std.len()).create("std")?.write(&std)?;
            Ok(())
        };
        let tmp_path = self.tmp_path.clone();
        let finished = (|| -> Result<()> {
            write_attrs(&file).at(&tmp_path)?;
            // H5Fclose reports no write error while the datasets are still open (it only marks
            // the file for closing; the data cached in memory is written when the last handle
            // goes, and a failure there is lost): flush first, which reports it. Without this a
            // full disk gave a damaged file and "wrote ..." with exit status 0.
            file.flush().at(&tmp_path)?;
            file.close().at(&tmp_path)?;
            std::fs::File::open(&tmp_path).and_then(|f| f.sync_all()).at(&tmp_path)?;
            std::fs::rename(&tmp_path, &self.final_path).at(&self.final_path)
        })();
        if finished.is_err() {
            // The file handle is gone from `self`, so Drop would not remove it.
            let _ = std::fs::remove_file(&tmp_path);
        }
        finished.map(|()| self.final_path.clone())
    }
}

impl Drop for DatasetWriter {
    fn drop(&mut self) {
        if let Some(file) = self.file.take() {
            // Not finished: an error happened. Leave nothing half-written behind.
            drop(file);
            let _ = std::fs::remove_file(&self.tmp_path);
        }
    }
}

/// Parses `--class-names a,b,c`.
pub fn parse_class_names(s: &str) -> Vec<String> {
    s.split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect()
}
