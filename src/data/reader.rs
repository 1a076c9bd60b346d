//! Reading rows of a split's images with hyperslab reads.

use std::path::{Path, PathBuf};

use ndarray::s;

use crate::data::{open_file, Split};
use crate::error::{Error, Result, WithPath};

/// One split's image dataset, open for reading rows.
pub struct SplitReader {
    path: PathBuf,
    images: hdf5::Dataset,
    len: usize,
    sample_bytes: usize,
    /// Sorted (index, position in the request) pairs, kept to avoid an allocation per read.
    order: Vec<(usize, usize)>,
}

impl SplitReader {
    pub fn open(path: &Path, split: Split) -> Result<SplitReader> {
        let file = open_file(path)?;
        let name = format!("{}/images", split.name());
        let images = file.dataset(&name).map_err(|_| Error::data(path, format!("missing dataset `{name}`")))?;
        let shape = images.shape();
        if shape.len() != 4 {
            return Err(Error::data(path, format!("`{name}` has shape {shape:?}, expected N x C x H x W")));
        }
        Ok(SplitReader {
            path: path.to_path_buf(),
            len: shape[0],
            sample_bytes: shape[1] * shape[2] * shape[3],
            images,
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
            let block = self
                .images
                .read_slice::<u8, _, ndarray::Ix4>(s![first..=last, .., .., ..])
                .at(&self.path)?;
            let bytes = block.as_slice().expect("a freshly read array is contiguous");
            for (k, &(_, pos)) in self.order[start..end].iter().enumerate() {
                out[pos * row..(pos + 1) * row].copy_from_slice(&bytes[k * row..(k + 1) * row]);
            }
            start = end;
        }
        Ok(())
    }
}
