//! Reading rows of a split's images with hyperslab reads.

use std::path::{Path, PathBuf};

use ndarray::s;

use crate::data::layout::{open_file, Split};
use crate::data::source::SyntheticData;
use crate::data::synth::Generator;
use crate::error::{Error, Result, WithPath};

/// One split's image dataset, open for reading rows: from its HDF5 file, or generated
/// (`--data synthetic:...`, [`SyntheticData`]).
pub struct SplitReader {
    path: PathBuf,
    source: Source,
    len: usize,
    sample_bytes: usize,
    /// Sorted (index, position in the request) pairs, kept to avoid an allocation per read.
    order: Vec<(usize, usize)>,
}

enum Source {
    File {
        images: hdf5::Dataset,
        /// The file as opened, and its length then: see `check_not_shrunk`.
        file: std::fs::File,
        file_len: u64,
    },
    /// Each sample drawn when it is read: memory does not grow with the split's length.
    Generated(Generator, Split),
}

impl SplitReader {
    pub fn open(path: &Path, split: Split) -> Result<SplitReader> {
        if let Some(synthetic) = SyntheticData::from_path(path) {
            let synthetic = synthetic.map_err(Error::usage)?;
            let len = match split {
                Split::Train => synthetic.train,
                Split::Test => 0,
            };
            let g = synthetic.generator;
            return Ok(SplitReader { path: path.to_path_buf(), source: Source::Generated(g, split), len, sample_bytes: g.sample_bytes(), order: Vec::new() });
        }
        let file = open_file(path)?;
        let name = format!("{}/images", split.name());
        let images = file.dataset(&name).map_err(|_| Error::data(path, format!("missing dataset `{name}`")))?;
        let shape = images.shape();
        if shape.len() != 4 {
            return Err(Error::data(path, format!("`{name}` has shape {shape:?}, expected N x C x H x W")));
        }
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        Ok(SplitReader {
            path: path.to_path_buf(),
            source: Source::File { images, file, file_len },
            len: shape[0],
            sample_bytes: shape[1] * shape[2] * shape[3],
            order: Vec::new(),
        })
    }

    pub fn sample_bytes(&self) -> usize {
        self.sample_bytes
    }

    /// Reads the images at `indices` (any order, no repeats needed) into `out`, in the order
    /// given. Runs of consecutive indices are read with one hyperslab each.
    pub fn read(&mut self, indices: &[usize], out: &mut [u8]) -> Result<()> {
        let row = self.sample_bytes;
        assert_eq!(out.len(), indices.len() * row, "output sized for the request");
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.len) {
            return Err(Error::data(&self.path, format!("image {bad} requested, the split holds {}", self.len)));
        }
        let images = match &self.source {
            Source::Generated(g, split) => {
                for (&i, sample) in indices.iter().zip(out.chunks_exact_mut(row)) {
                    g.sample(*split, i, sample);
                }
                return Ok(());
            }
            Source::File { images, .. } => images,
        };
        self.order.clear();
        self.order.extend(indices.iter().enumerate().map(|(pos, &i)| (i, pos)));
        self.order.sort_unstable();
        let mut start = 0;
        while start < self.order.len() {
            let mut end = start + 1;
            while end < self.order.len() && self.order[end].0 == self.order[end - 1].0 + 1 {
                end += 1;
            }
            let (first, last) = (self.order[start].0, self.order[end - 1].0);
            let block = images.read_slice::<u8, _, ndarray::Ix4>(s![first..=last, .., .., ..]).at(&self.path)?;
            let bytes = block.as_slice().expect("a freshly read array is contiguous");
            for (k, &(_, pos)) in self.order[start..end].iter().enumerate() {
                out[pos * row..(pos + 1) * row].copy_from_slice(&bytes[k * row..(k + 1) * row]);
            }
            start = end;
        }
        self.check_not_shrunk()
    }

    /// Every image of the split, in one read (for [`SplitCache`]).
    pub fn read_all(&mut self) -> Result<Vec<u8>> {
        let Source::File { images, .. } = &self.source else {
            return Err(Error::usage(format!("--data {}: generated samples are made as they are read; there is no file to hold in memory (--cache-data off)", self.path.display())));
        };
        let all = images.read_raw::<u8>().at(&self.path)?;
        if all.len() != self.len * self.sample_bytes {
            return Err(Error::data(&self.path, format!("read {} bytes of images, expected {}", all.len(), self.len * self.sample_bytes)));
        }
        self.check_not_shrunk()?;
        Ok(all)
    }

    /// HDF5's POSIX driver answers a read past the end of the file with zeros, not an error,
    /// once the file is open: if the storage loses the tail of a file during training (a
    /// truncating copy, a full quota, a failing OST), training would go on with blank images.
    /// The length is checked after every read (one fstat) so that no batch read from a shrunk
    /// file is used. The handle is the file that was opened, so a file replaced under the same
    /// name (written elsewhere and renamed over it) is not mistaken for damage.
    fn check_not_shrunk(&self) -> Result<()> {
        let Source::File { file, file_len, .. } = &self.source else { return Ok(()) };
        let (file, file_len) = (file, *file_len);
        let len = file.metadata().map_err(|e| Error::io(&self.path, e))?.len();
        if len < file_len {
            return Err(Error::data(
                &self.path,
                format!("the file shrank from {} to {len} bytes while it was being read (truncated or lost on its storage)", file_len),
            ));
        }
        Ok(())
    }
}

/// A whole split's images held in memory, read from the file once: serving a batch is then a
/// copy per sample instead of an HDF5 read per sample (each a hyperslab selection, a chunk
/// lookup and perhaps a decompression), which on a rank whose cores all run backward takes
/// time from it.
pub struct SplitCache {
    images: Vec<u8>,
    sample_bytes: usize,
    /// The file the split came from, for error messages.
    path: PathBuf,
}

impl SplitCache {
    pub fn load(reader: &mut SplitReader) -> Result<SplitCache> {
        Ok(SplitCache { images: reader.read_all()?, sample_bytes: reader.sample_bytes(), path: reader.path.clone() })
    }

    /// As [`SplitReader::read`].
    pub fn read(&self, indices: &[usize], out: &mut [u8]) -> Result<()> {
        let row = self.sample_bytes;
        assert_eq!(out.len(), indices.len() * row, "output sized for the request");
        for (pos, &i) in indices.iter().enumerate() {
            let sample = self.images.get(i * row..(i + 1) * row).ok_or_else(|| Error::data(&self.path, format!("image {i} requested, the split (held in memory) holds {}", self.images.len() / row.max(1))))?;
            out[pos * row..(pos + 1) * row].copy_from_slice(sample);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::synth::{generate, SynthSpec};
    use crate::data::writer::Compression;

    /// A synthetic uncompressed file `name` in a scratch folder of its own: (folder, file).
    fn synthetic_file(folder: &str, name: &str, spec: SynthSpec) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("hpc-train-{folder}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        generate(&spec, &path, Compression::None, true).unwrap();
        (dir, path)
    }

    #[test]
    fn a_file_that_shrinks_while_open_is_an_error_not_blank_images() {
        let (dir, path) = synthetic_file("reader", "shrinks.h5", SynthSpec { train: 64, test: 4, shape: [1, 32, 32], classes: 3, seed: 1 });

        let mut reader = SplitReader::open(&path, Split::Train).unwrap();
        let mut out = vec![0u8; 2 * reader.sample_bytes()];
        reader.read(&[0, 63], &mut out).unwrap();
        assert!(out.iter().any(|&b| b != 0), "synthetic images are not blank");

        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
        let err = reader.read(&[62, 63], &mut out).unwrap_err().to_string();
        assert!(err.contains("shrinks.h5") && err.contains(&format!("shrank from {len} to {} bytes", len / 2)), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_cache_serves_the_bytes_the_file_holds() {
        let (dir, path) = synthetic_file("cache", "cached.h5", SynthSpec { train: 50, test: 4, shape: [3, 5, 7], classes: 3, seed: 2 });
        let mut reader = SplitReader::open(&path, Split::Train).unwrap();
        let cache = SplitCache::load(&mut reader).unwrap();
        let indices = [49, 0, 17, 18, 19, 3, 48];
        let (mut from_file, mut from_cache) = (vec![0u8; indices.len() * 105], vec![1u8; indices.len() * 105]);
        reader.read(&indices, &mut from_file).unwrap();
        cache.read(&indices, &mut from_cache).unwrap();
        assert_eq!(from_file, from_cache);
        let err = cache.read(&[50], &mut from_cache[..105]).unwrap_err().to_string();
        assert!(err.contains("cached.h5") && err.contains("image 50 requested"), "past the end, naming the file: {err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `--data synthetic:...` serves what `data synth --seed 0` writes, through the same reader
    /// and `open`, without a file: one generator.
    #[test]
    fn generated_data_equals_the_file_data_synth_writes() {
        use crate::data::source::open;
        let dir = std::env::temp_dir().join(format!("hpc-train-synthetic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("synth.h5");
        generate(&SynthSpec { train: 40, test: 0, shape: [3, 6, 5], classes: 4, seed: 0 }, &file, Compression::None, true).unwrap();
        let named = Path::new("synthetic:3x6x5:4:40");
        let ((file_info, file_labels), (info, labels)) = (open(&file).unwrap(), open(named).unwrap());
        assert_eq!((info.meta, info.train.len, info.test.len), (file_info.meta, 40, 0));
        assert_eq!(labels.train, file_labels.train);
        let (mut from_file, mut generated) = (SplitReader::open(&file, Split::Train).unwrap(), SplitReader::open(named, Split::Train).unwrap());
        let indices = [39, 0, 7, 8, 21];
        let (mut a, mut b) = (vec![0u8; 5 * 90], vec![1u8; 5 * 90]);
        from_file.read(&indices, &mut a).unwrap();
        generated.read(&indices, &mut b).unwrap();
        assert_eq!(a, b);
        for (x, y) in info.mean.iter().zip(&file_info.mean).chain(info.std.iter().zip(&file_info.std)) {
            assert!((x - y).abs() < 1e-4, "normalisation {x} against the file's {y}");
        }
        let err = generated.read(&[40], &mut b[..90]).unwrap_err().to_string();
        assert!(err.contains("image 40 requested, the split holds 40"), "{err}");
        assert!(generated.read_all().unwrap_err().to_string().contains("no file to hold in memory"));
        assert!(open(Path::new("synthetic:3x6")).unwrap_err().to_string().contains("expected synthetic:CxHxW"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
