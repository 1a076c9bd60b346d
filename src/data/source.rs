//! Where a run's data comes from: a file in the project's HDF5 layout, or samples generated
//! as they are read (`--data synthetic:CxHxW[:CLASSES[:SAMPLES]]`, [`SyntheticData`]).

use std::path::Path;

use crate::data::layout::{self, DatasetInfo, Labels, Meta, Split, SplitInfo};
use crate::data::synth::{parse_shape, Generator};
use crate::error::{Error, Result};

/// The dataset `--data` names, and its labels: generated, or read from its file
/// ([`layout::open`]).
pub fn open(path: &Path) -> Result<(DatasetInfo, Labels)> {
    match SyntheticData::from_path(path) {
        Some(synthetic) => synthetic.map(|s| s.info(path)).map_err(Error::usage),
        None => layout::open(path),
    }
}

/// The prefix of a `--data` value naming generated data instead of a file.
pub const SYNTHETIC_PREFIX: &str = "synthetic:";

/// ImageNet-1k's training split: the nominal length of generated data when none is given, so
/// that an epoch of `synthetic:3x224x224` is as long as one of ImageNet.
pub const IMAGENET_TRAIN_SAMPLES: usize = 1_281_167;

/// `--data synthetic:CxHxW[:CLASSES[:SAMPLES]]`: training data generated per sample, with no
/// file ([`Generator`], seed 0, the same samples as `data synth --seed 0` writes) and no test
/// split (it would measure nothing: the runs that use it measure throughput).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyntheticData {
    pub generator: Generator,
    pub train: usize,
}

impl SyntheticData {
    /// `Some` for a `--data` value that names generated data (a parse error then says what is
    /// wrong with it), `None` for a file.
    pub fn from_path(path: &Path) -> Option<std::result::Result<SyntheticData, String>> {
        let text = path.to_str()?;
        let spec = text.strip_prefix(SYNTHETIC_PREFIX)?;
        Some(SyntheticData::parse(spec).map_err(|why| format!("--data {text}: {why}; expected synthetic:CxHxW[:CLASSES[:SAMPLES]], as in synthetic:3x224x224:1000")))
    }

    fn parse(spec: &str) -> std::result::Result<SyntheticData, String> {
        let mut parts = spec.split(':');
        let shape = parse_shape(parts.next().unwrap_or(""))?;
        let mut count = |what: &str, default: usize, max: usize| -> std::result::Result<usize, String> {
            match parts.next() {
                None => Ok(default),
                Some(s) => s.parse::<usize>().ok().filter(|&n| (1..=max).contains(&n)).ok_or_else(|| format!("{what} {s:?} is not a number from 1 to {max}")),
            }
        };
        let classes = count("CLASSES", 1000, 65_536)?;
        let train = count("SAMPLES", IMAGENET_TRAIN_SAMPLES, u32::MAX as usize)?;
        if let Some(extra) = parts.next() {
            return Err(format!("{extra:?} after SAMPLES"));
        }
        Ok(SyntheticData { generator: Generator { shape, classes, seed: 0 }, train })
    }

    /// What `layout::open` reads from a file: the shape, no test split, the normalisation of a
    /// few generated samples, and every training label.
    pub fn info(&self, path: &Path) -> (DatasetInfo, Labels) {
        let g = &self.generator;
        let [channels, height, width] = g.shape;
        let meta = Meta { name: format!("synthetic-{channels}x{height}x{width}"), classes: g.classes, class_names: Vec::new(), channels, height, width };
        let split = |len| SplitInfo { len, chunk_rows: None, compression: "generated".into() };
        let (mean, std) = self.normalisation();
        let labels = Labels { train: (0..self.train).map(|i| g.label(Split::Train, i)).collect(), test: Vec::new() };
        (DatasetInfo { path: path.to_path_buf(), meta, train: split(self.train), test: split(0), mean, std }, labels)
    }

    /// Per-channel mean and standard deviation in [0, 1] over the first samples.
    fn normalisation(&self) -> (Vec<f32>, Vec<f32>) {
        let g = &self.generator;
        let channels = g.shape[0];
        let plane = g.shape[1] * g.shape[2];
        let (mut sum, mut squares) = (vec![0f64; channels], vec![0f64; channels]);
        let mut image = vec![0u8; g.sample_bytes()];
        let samples = self.train.min(NORMALISATION_SAMPLES);
        for i in 0..samples {
            g.sample(Split::Train, i, &mut image);
            for (c, pixels) in image.chunks_exact(plane).enumerate() {
                for &p in pixels {
                    let v = p as f64 / 255.0;
                    sum[c] += v;
                    squares[c] += v * v;
                }
            }
        }
        let n = (samples * plane) as f64;
        let mean: Vec<f32> = sum.iter().map(|s| (s / n) as f32).collect();
        let std = squares.iter().zip(&sum).map(|(q, s)| ((q / n - (s / n).powi(2)).max(0.0).sqrt().max(1e-6)) as f32).collect();
        (mean, std)
    }
}

/// Samples the normalisation of generated data is measured on.
const NORMALISATION_SAMPLES: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_data_names_parse_or_say_what_is_wrong() {
        let parsed = |s: &str| SyntheticData::from_path(Path::new(s));
        assert_eq!(parsed("datasets/fashion-mnist.h5"), None, "a file");
        let d = parsed("synthetic:3x224x224").unwrap().unwrap();
        assert_eq!((d.generator.shape, d.generator.classes, d.train), ([3, 224, 224], 1000, IMAGENET_TRAIN_SAMPLES));
        let d = parsed("synthetic:1x8x9:10:77").unwrap().unwrap();
        assert_eq!((d.generator.shape, d.generator.classes, d.train), ([1, 8, 9], 10, 77));
        for (bad, why) in [("synthetic:3x224", "CxHxW"), ("synthetic:3x8x8:0", "CLASSES \"0\""), ("synthetic:3x8x8:10:x", "SAMPLES \"x\""), ("synthetic:3x8x8:10:5:1", "after SAMPLES")] {
            let err = parsed(bad).unwrap().unwrap_err();
            assert!(err.starts_with(&format!("--data {bad}: ")) && err.contains(why) && err.contains("synthetic:3x224x224:1000"), "{err}");
        }
    }
}
