//! Synthetic datasets in the project's layout, for throughput studies at any image size without
//! the data, and for tests.
//!
//! Images are noise around a class-dependent level per channel, so that a model can learn them
//! (a test of learning can use them); the content does not matter for throughput.

use std::path::Path;

use rand::{Rng, SeedableRng};
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
    if spec.classes == 0 || spec.classes > 65_536 {
        return Err(Error::usage(format!("--classes {}: expected 1 to 65536", spec.classes)));
    }
    let [channels, height, width] = spec.shape;
    let meta = Meta { name: format!("synthetic-{channels}x{height}x{width}"), classes: spec.classes, class_names: Vec::new(), channels, height, width };
    let sample = meta.sample_bytes();
    let mut writer = DatasetWriter::create(out, meta, spec.train, spec.test, compression, force)?;
    let block = (BLOCK_BYTES / sample).max(1);
    for (split, len, stream) in [(Split::Train, spec.train, 0u64), (Split::Test, spec.test, 1)] {
        let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
        rng.set_stream(stream);
        let mut offset = 0;
        while offset < len {
            let n = block.min(len - offset);
            let labels: Vec<i64> = (0..n).map(|_| rng.gen_range(0..spec.classes) as i64).collect();
            let mut images = vec![0u8; n * sample];
            for (img, &label) in images.chunks_exact_mut(sample).zip(&labels) {
                let plane = height * width;
                for (c, pixels) in img.chunks_exact_mut(plane).enumerate() {
                    // A level per (class, channel) spread over 32..224, plus noise of +-31.
                    let level = 32 + ((label as usize * 7 + c * 3) % spec.classes.max(2)) * 192 / spec.classes.max(2);
                    for p in pixels {
                        *p = (level as i32 + rng.gen_range(-31..=31)).clamp(0, 255) as u8;
                    }
                }
            }
            writer.write(split, offset, &images, &labels)?;
            offset += n;
        }
    }
    writer.finish()?;
    Ok(())
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
}
