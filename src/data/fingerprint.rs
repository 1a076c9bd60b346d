//! A dataset's fingerprint: its shape, attributes, labels and a few images of each split,
//! hashed, so that a checkpoint knows the file it was trained on.

use crate::data::layout::{DatasetInfo, Labels, Split};
use crate::data::reader::SplitReader;
use crate::error::Result;

/// Rows of each split's images that enter the dataset's fingerprint.
const FINGERPRINT_ROWS: usize = 16;

/// A fingerprint of what a dataset holds: its shape, class count, attributes, every label, and
/// `FINGERPRINT_ROWS` images of each split (the first, the last and evenly spaced ones between).
/// Checkpoints record it, so that a resume on another file of the same name and size (every
/// `data synth` file of one shape has the same name) is refused. It costs a few row reads at
/// any size; it hashes the images, not the stored bytes, so a recompressed copy keeps it.
pub fn fingerprint(info: &DatasetInfo, labels: &Labels) -> Result<String> {
    let mut hash = Fnv1a64::default();
    let m = &info.meta;
    hash.write(m.name.as_bytes());
    for n in [m.classes, m.channels, m.height, m.width, info.train.len, info.test.len] {
        hash.write(&(n as u64).to_le_bytes());
    }
    for name in &m.class_names {
        hash.write(name.as_bytes());
    }
    for v in info.mean.iter().chain(&info.std) {
        hash.write(&v.to_le_bytes());
    }
    for split in [Split::Train, Split::Test] {
        for l in labels.split(split) {
            hash.write(&l.to_le_bytes());
        }
        let len = info.split(split).len;
        if len == 0 {
            continue;
        }
        let mut rows: Vec<usize> = (0..FINGERPRINT_ROWS).map(|i| i * (len - 1) / (FINGERPRINT_ROWS - 1)).collect();
        rows.dedup();
        let mut reader = SplitReader::open(&info.path, split)?;
        let mut images = vec![0u8; rows.len() * reader.sample_bytes()];
        reader.read(&rows, &mut images)?;
        hash.write(&images);
    }
    Ok(format!("fnv1a64:{:016x}", hash.0))
}

/// FNV-1a, 64 bits: a hash that stays the same across Rust versions and platforms (what is
/// written into checkpoints must), for telling files apart, not against an adversary.
struct Fnv1a64(u64);

impl Default for Fnv1a64 {
    fn default() -> Self {
        Fnv1a64(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a64 {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::layout::open;
    use crate::data::synth::{generate, SynthSpec};
    use crate::data::writer::Compression;

    #[test]
    fn fnv1a64_matches_its_reference_values() {
        let hash = |bytes: &[u8]| {
            let mut h = Fnv1a64::default();
            h.write(bytes);
            h.0
        };
        assert_eq!(hash(b""), 0xcbf29ce484222325);
        assert_eq!(hash(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(hash(b"foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn the_fingerprint_follows_the_content_not_the_storage() {
        let dir = std::env::temp_dir().join(format!("hpc-train-fingerprint-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let make = |name: &str, seed: u64, compression: Compression| {
            let path = dir.join(name);
            generate(&SynthSpec { train: 50, test: 7, shape: [1, 6, 6], classes: 3, seed }, &path, compression, true).unwrap();
            let (info, labels) = open(&path).unwrap();
            fingerprint(&info, &labels).unwrap()
        };
        let a = make("a.h5", 1, Compression::None);
        assert_eq!(a, make("a-gzip.h5", 1, Compression::Gzip), "the same images recompressed");
        assert_ne!(a, make("b.h5", 2, Compression::None), "same name, shape and size, other images");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
