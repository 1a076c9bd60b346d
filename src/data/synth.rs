//! Synthetic datasets in the project's layout, for throughput studies at any image size without
//! the data, and for tests.
//!
//! Images are noise around a class-dependent level per channel, so that a model can learn them
//! (a test of learning can use them); the content does not matter for throughput.

use std::path::Path;

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::data::layout::{Meta, Split};
use crate::data::writer::{Compression, DatasetWriter};
use crate::error::{Error, Result};

/// Samples generated and written per block: bounds memory for any image size.
const BLOCK_BYTES: usize = 64 << 20;

/// Parses `CxHxW`, as in `3x224x224`.
pub fn parse_shape(s: &str) -> std::result::Result<[usize; 3], String> {
    let parts: Vec<&str> = s.split(['x', 'X']).collect();
    let dims: Vec<usize> = parts.iter().filter_map(|p| p.trim().parse().ok()).collect();
    match dims[..] {
        [c, h, w] if parts.len() == 3 && c > 0 && h > 0 && w > 0 => Ok([c, h, w]),
        _ => Err(format!("{s:?}: expected CxHxW with positive sizes, as in 3x224x224")),
    }
}

pub struct SynthSpec {
    pub train: usize,
    pub test: usize,
    pub shape: [usize; 3],
    pub classes: usize,
    pub seed: u64,
}

pub fn generate(spec: &SynthSpec, out: &Path, compression: Compression, force: bool) -> Result<()> {
    check_classes(spec.classes)?;
    let [channels, height, width] = spec.shape;
    let meta = Meta { name: format!("synthetic-{channels}x{height}x{width}"), classes: spec.classes, class_names: Vec::new(), channels, height, width };
    let sample = meta.sample_bytes();
    let mut writer = DatasetWriter::create(out, meta, spec.train, spec.test, compression, force)?;
    let block = (BLOCK_BYTES / sample).max(1);
    let generator = Generator { shape: spec.shape, classes: spec.classes, seed: spec.seed };
    for (split, len) in [(Split::Train, spec.train), (Split::Test, spec.test)] {
        let mut offset = 0;
        while offset < len {
            let n = block.min(len - offset);
            let mut images = vec![0u8; n * sample];
            let labels: Vec<i64> =
                images.chunks_exact_mut(sample).enumerate().map(|(k, img)| generator.sample(split, offset + k, img)).collect();
            writer.write(split, offset, &images, &labels)?;
            offset += n;
        }
    }
    writer.finish()?;
    Ok(())
}

fn check_classes(classes: usize) -> Result<()> {
    if classes == 0 || classes > 65_536 {
        return Err(Error::usage(format!("--classes {classes}: expected 1 to 65536")));
    }
    Ok(())
}

/// The synthetic images and labels, each sample drawn from (seed, split, index) alone: any rank
/// can produce any sample, in any order, holding nothing but the one it writes. `data synth`
/// writes these samples into a file; `--data synthetic:...` serves them without one
/// (`data::source`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Generator {
    pub shape: [usize; 3],
    pub classes: usize,
    pub seed: u64,
}

impl Generator {
    pub fn sample_bytes(&self) -> usize {
        self.shape.iter().product()
    }

    /// The label of sample `index` of `split`.
    pub fn label(&self, split: Split, index: usize) -> i64 {
        (mix(self.key(split, index)) % self.classes as u64) as i64
    }

    /// Writes sample `index` of `split` into `out` (`sample_bytes()` long); returns its label.
    pub fn sample(&self, split: Split, index: usize, out: &mut [u8]) -> i64 {
        assert_eq!(out.len(), self.sample_bytes(), "one sample's bytes");
        let label = self.label(split, index);
        let mut rng = ChaCha8Rng::seed_from_u64(mix(self.key(split, index) ^ 0x5EED));
        // The noise first, as raw bytes (the generator's fastest path: a 3x224x224 image is
        // 150 KB, and the loader makes a batch of them every step), then mapped onto the levels.
        rng.fill_bytes(out);
        let plane = self.shape[1] * self.shape[2];
        let spread = self.classes.max(2);
        for (c, pixels) in out.chunks_exact_mut(plane).enumerate() {
            // A level per (class, channel) spread over 32..224, plus noise of -31..=31.
            let level = 32 + ((label as usize * 7 + c * 3) % spread) * 192 / spread;
            for p in pixels {
                *p = (level as i32 + (*p % 63) as i32 - 31).clamp(0, 255) as u8;
            }
        }
        label
    }

    fn key(&self, split: Split, index: usize) -> u64 {
        let stream = match split {
            Split::Train => 0u64,
            Split::Test => 1,
        };
        mix(self.seed ^ mix(stream.wrapping_add(0x9E37_79B9_7F4A_7C15))) ^ (index as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)
    }
}

/// SplitMix64's finaliser: a well-spread 64-bit value from any input.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse() {
        assert_eq!(parse_shape("3x224x224"), Ok([3, 224, 224]));
        assert_eq!(parse_shape("1X28x28"), Ok([1, 28, 28]));
        assert!(parse_shape("3x224").is_err());
        assert!(parse_shape("0x2x2").is_err());
        assert!(parse_shape("axbxc").is_err());
    }

    /// A sample depends on its index alone: the same bytes whichever rank draws it and in
    /// whatever order, others for another index, with its label's level per channel.
    #[test]
    fn generated_samples_depend_on_their_index_alone() {
        let g = Generator { shape: [3, 4, 5], classes: 7, seed: 0 };
        let draw = |i: usize| {
            let mut img = vec![0u8; g.sample_bytes()];
            let label = g.sample(Split::Train, i, &mut img);
            (label, img)
        };
        let forward: Vec<_> = (0..50).map(draw).collect();
        let backward: Vec<_> = (0..50).rev().map(draw).collect();
        assert!(forward.iter().eq(backward.iter().rev()), "the same sample in any order");
        assert_eq!(forward.iter().map(|(_, img)| img).collect::<std::collections::HashSet<_>>().len(), 50, "every index its own image");
        let labels: std::collections::HashSet<i64> = forward.iter().map(|&(l, _)| l).collect();
        assert!(labels.iter().all(|l| (0..7).contains(l)) && labels.len() == 7, "{labels:?}");
        for (i, (label, img)) in forward.iter().enumerate() {
            assert_eq!(*label, g.label(Split::Train, i));
            // Each channel's mean is near its (class, channel) level: a model can learn them.
            for (c, plane) in img.chunks_exact(20).enumerate() {
                let level = 32 + ((*label as usize * 7 + c * 3) % 7) * 192 / 7;
                let mean = plane.iter().map(|&p| p as f64).sum::<f64>() / 20.0;
                assert!((mean - level as f64).abs() < 20.0, "sample {i} channel {c}: mean {mean}, level {level}");
            }
        }
        let mut test = vec![0u8; g.sample_bytes()];
        g.sample(Split::Test, 0, &mut test);
        assert_ne!(test, forward[0].1, "the test split is drawn apart");
        let other_seed = Generator { seed: 1, ..g };
        let mut img = vec![0u8; g.sample_bytes()];
        other_seed.sample(Split::Train, 0, &mut img);
        assert_ne!(img, forward[0].1);
    }

}
