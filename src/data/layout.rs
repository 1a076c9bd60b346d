//! The HDF5 layout of a dataset file, and its validation: what `open` checks and returns.
//!
//! Layout of a dataset file (the same for every source):
//!
//! | path            | type                    | shape         |
//! |-----------------|-------------------------|---------------|
//! | `train/images`  | uint8                   | N x C x H x W |
//! | `train/labels`  | any integer             | N             |
//! | `test/images`   | uint8                   | M x C x H x W |
//! | `test/labels`   | any integer             | M             |
//!
//! Root attributes: `name` (string), `num_classes` (integer), `class_names` (strings, optional),
//! `mean` and `std` (f32 per channel, of the training images scaled to [0, 1]; optional).

use std::path::{Path, PathBuf};

use hdf5::types::{TypeDescriptor, VarLenUnicode};

use crate::error::{Error, Result, WithPath};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    Test,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "test",
        }
    }
}

/// How one split is stored.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitInfo {
    pub len: usize,
    /// Rows per chunk of the image dataset (None: contiguous storage).
    pub chunk_rows: Option<usize>,
    /// Filters on the image dataset ("none", "deflate(4)", ...).
    pub compression: String,
}

/// What a dataset is: what the importers write and `open` reads back.
#[derive(Clone, Debug, PartialEq)]
pub struct Meta {
    pub name: String,
    pub classes: usize,
    pub class_names: Vec<String>,
    pub channels: usize,
    pub height: usize,
    pub width: usize,
}

impl Meta {
    pub fn sample_bytes(&self) -> usize {
        self.channels * self.height * self.width
    }
}

/// What a dataset file holds, after validation.
#[derive(Clone, Debug, PartialEq)]
pub struct DatasetInfo {
    pub path: PathBuf,
    pub meta: Meta,
    pub train: SplitInfo,
    pub test: SplitInfo,
    /// Per-channel mean and standard deviation of the training images in [0, 1].
    pub mean: Vec<f32>,
    pub std: Vec<f32>,
}

impl DatasetInfo {
    pub fn split(&self, split: Split) -> &SplitInfo {
        match split {
            Split::Train => &self.train,
            Split::Test => &self.test,
        }
    }

    pub fn sample_bytes(&self) -> usize {
        self.meta.sample_bytes()
    }
}

/// Opens an HDF5 file for reading, with a chunk cache large enough for random row reads.
pub fn open_file(path: &Path) -> Result<hdf5::File> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::data(path, "no such file (create one with `hpc-train data import` or `data synth`)"))
        }
        Err(e) => return Err(Error::io(path, e)),
        Ok(m) if m.is_dir() => return Err(Error::data(path, "is a directory, not an HDF5 file")),
        // Opening a FIFO for reading waits for a writer, and a device or socket is no dataset:
        // only a regular file (or a link to one) is opened at all.
        Ok(m) if !m.is_file() => return Err(Error::data(path, format!("is {}, not a regular file: a dataset is an HDF5 file", file_kind(&m)))),
        Ok(_) => {}
    }
    if !has_hdf5_signature(path)? {
        return Err(Error::data(path, "not an HDF5 file"));
    }
    hdf5::File::with_options()
        .with_fapl(|p| p.chunk_cache(12_421, 64 << 20, 1.0))
        .open(path)
        .at(path)
}

/// What a path that is neither a regular file nor a folder is, for the message.
fn file_kind(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "a special file"
    }
}

/// Whether the file starts with the HDF5 signature, at offset 0 or after a user block (512,
/// 1024, 2048, ... bytes). Checked before HDF5 opens it, for a clear message instead of
/// HDF5's error stack (and a clear "permission denied").
fn has_hdf5_signature(path: &Path) -> Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    const SIGNATURE: [u8; 8] = [0x89, b'H', b'D', b'F', b'\r', b'\n', 0x1a, b'\n'];
    let mut f = std::fs::File::open(path).at(path)?;
    let len = f.metadata().at(path)?.len();
    let mut offset = 0u64;
    while offset + 8 <= len {
        let mut head = [0u8; 8];
        f.seek(SeekFrom::Start(offset)).at(path)?;
        f.read_exact(&mut head).at(path)?;
        if head == SIGNATURE {
            return Ok(true);
        }
        offset = if offset == 0 { 512 } else { offset * 2 };
    }
    Ok(false)
}

/// Opens and validates a dataset file: every dataset present with the right dtype and rank,
/// matching sizes, labels within the class count. Reads the labels (small) to check them.
pub fn open(path: &Path) -> Result<(DatasetInfo, Labels)> {
    let file = open_file(path)?;
    let bad = |reason: String| Error::data(path, reason);

    let mut image_shape: Option<[usize; 3]> = None;
    let mut splits = Vec::new();
    let mut labels = Vec::new();
    for split in [Split::Train, Split::Test] {
        let images_name = format!("{}/images", split.name());
        let labels_name = format!("{}/labels", split.name());
        let images = file.dataset(&images_name).map_err(|_| bad(format!("missing dataset `{images_name}`")))?;
        let label_ds = file.dataset(&labels_name).map_err(|_| bad(format!("missing dataset `{labels_name}`")))?;

        let dtype = images.dtype().and_then(|d| d.to_descriptor()).at(path)?;
        if dtype != TypeDescriptor::Unsigned(hdf5::types::IntSize::U1) {
            return Err(bad(format!("`{images_name}` has type {dtype}, expected uint8")));
        }
        let shape = images.shape();
        if shape.len() != 4 {
            return Err(bad(format!("`{images_name}` has shape {shape:?}, expected 4 dimensions N x C x H x W")));
        }
        let chw = [shape[1], shape[2], shape[3]];
        if chw.contains(&0) {
            return Err(bad(format!("`{images_name}` has shape {shape:?}: an empty image dimension")));
        }
        match image_shape {
            None => image_shape = Some(chw),
            Some(s) if s != chw => {
                return Err(bad(format!("`{images_name}` holds {chw:?} images but train holds {s:?}")))
            }
            Some(_) => {}
        }

        let ldtype = label_ds.dtype().and_then(|d| d.to_descriptor()).at(path)?;
        if !matches!(ldtype, TypeDescriptor::Integer(_) | TypeDescriptor::Unsigned(_)) {
            return Err(bad(format!("`{labels_name}` has type {ldtype}, expected integers")));
        }
        let lshape = label_ds.shape();
        if lshape.len() != 1 || lshape[0] != shape[0] {
            return Err(bad(format!(
                "`{labels_name}` has shape {lshape:?}, expected [{}] (one label per image)",
                shape[0]
            )));
        }
        let values: Vec<i64> = label_ds.read_raw::<i64>().at(path)?;
        let chunk_rows = images.chunk().map(|c| c[0]);
        let compression = describe_filters(&images.filters());
        splits.push(SplitInfo { len: shape[0], chunk_rows, compression });
        labels.push(values);
    }
    let [channels, height, width] = image_shape.expect("two splits were read");
    let test_labels = labels.pop().expect("test");
    let train_labels = labels.pop().expect("train");
    let test = splits.pop().expect("test");
    let train = splits.pop().expect("train");
    if train.len == 0 {
        return Err(bad("`train/images` holds no images".into()));
    }

    let max_label = train_labels.iter().chain(&test_labels).copied().max().unwrap_or(0);
    let classes = match read_int_attr(&file, "num_classes") {
        Some(n) if n >= 1 => n as usize,
        Some(n) => return Err(bad(format!("attribute `num_classes` is {n}, expected at least 1"))),
        None => {
            log::warn!("{}: no `num_classes` attribute; using the largest label + 1 = {}", path.display(), max_label + 1);
            (max_label + 1) as usize
        }
    };
    for (split, values) in [(Split::Train, &train_labels), (Split::Test, &test_labels)] {
        if let Some((i, &l)) = values.iter().enumerate().find(|(_, &l)| l < 0 || l as usize >= classes) {
            return Err(bad(format!(
                "`{}/labels` [{i}] is {l}, outside 0..{classes} (num_classes = {classes})",
                split.name()
            )));
        }
    }

    let name = read_string_attr(&file, "name").unwrap_or_else(|| {
        path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
    });
    let class_names = read_strings_attr(&file, "class_names").unwrap_or_default();
    let (mean, std) = normalisation(&file, channels).map_err(bad)?;

    let meta = Meta { name, classes, class_names, channels, height, width };
    let info = DatasetInfo { path: path.to_path_buf(), meta, train, test, mean, std };
    Ok((info, Labels { train: train_labels, test: test_labels }))
}

/// The labels of both splits, read once at open.
#[derive(Clone, Debug, Default)]
pub struct Labels {
    pub train: Vec<i64>,
    pub test: Vec<i64>,
}

impl Labels {
    pub fn split(&self, split: Split) -> &[i64] {
        match split {
            Split::Train => &self.train,
            Split::Test => &self.test,
        }
    }
}

fn describe_filters(filters: &[hdf5::filters::Filter]) -> String {
    if filters.is_empty() {
        return "none".into();
    }
    filters.iter().map(|f| format!("{f:?}").to_lowercase()).collect::<Vec<_>>().join("+")
}

fn read_int_attr(file: &hdf5::File, name: &str) -> Option<i64> {
    file.attr(name).ok()?.read_scalar::<i64>().ok()
}

fn read_string_attr(file: &hdf5::File, name: &str) -> Option<String> {
    file.attr(name).ok()?.read_scalar::<VarLenUnicode>().ok().map(|s| s.as_str().to_string())
}

fn read_strings_attr(file: &hdf5::File, name: &str) -> Option<Vec<String>> {
    let values = file.attr(name).ok()?.read_raw::<VarLenUnicode>().ok()?;
    Some(values.iter().map(|s| s.as_str().to_string()).collect())
}

/// The `mean` and `std` attributes, checked: training computes (pixel - mean) / std, so a
/// non-finite mean, or a std that is not finite and positive, would turn every input into NaN,
/// infinity or zero (an infinite std trains on blank images, at chance accuracy). Both absent:
/// 0.5 and 0.5 (inputs in [-1, 1]).
fn normalisation(file: &hdf5::File, channels: usize) -> std::result::Result<(Vec<f32>, Vec<f32>), String> {
    let (mean, std) = match (read_f32s_attr(file, "mean")?, read_f32s_attr(file, "std")?) {
        (None, None) => return Ok((vec![0.5; channels], vec![0.5; channels])),
        (Some(m), Some(s)) => (m, s),
        (Some(_), None) => return Err("attribute `mean` without `std`: give both or neither".into()),
        (None, Some(_)) => return Err("attribute `std` without `mean`: give both or neither".into()),
    };
    for (name, values) in [("mean", &mean), ("std", &std)] {
        if values.len() != channels {
            return Err(format!("attribute `{name}` holds {} value(s), expected {channels} (one per channel)", values.len()));
        }
        if let Some((c, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(format!("attribute `{name}` [{c}] is {v}, expected a finite value (the inputs are normalised with it)"));
        }
    }
    // The inputs are multiplied by 1 / (255 std): it must be finite too (a subnormal std is not).
    if let Some((c, v)) = std.iter().enumerate().find(|(_, &v)| v <= 0.0 || !(1.0 / (v * 255.0)).is_finite()) {
        return Err(format!("attribute `std` [{c}] is {v}, expected a standard deviation > 0 (the inputs are divided by it)"));
    }
    Ok((mean, std))
}

/// An f32 attribute (HDF5 converts other number types), None when absent, an error when it
/// exists but holds no numbers.
fn read_f32s_attr(file: &hdf5::File, name: &str) -> std::result::Result<Option<Vec<f32>>, String> {
    if !file.attr_names().map_err(|e| format!("attributes: {e}"))?.iter().any(|n| n == name) {
        return Ok(None);
    }
    let attr = file.attr(name).map_err(|e| format!("attribute `{name}`: {e}"))?;
    attr.read_raw::<f32>().map(Some).map_err(|_| format!("attribute `{name}` cannot be read as numbers"))
}

/// Samples per class: every class's count up to `LISTED_CLASSES` classes, a summary beyond
/// (counted over the labels present, so that a huge `num_classes` costs nothing).
fn class_counts(labels: &[i64], classes: usize) -> String {
    const LISTED_CLASSES: usize = 1000;
    let mut present = std::collections::BTreeMap::<i64, usize>::new();
    for &l in labels {
        *present.entry(l).or_default() += 1;
    }
    if classes <= LISTED_CLASSES {
        let counts: Vec<usize> = (0..classes as i64).map(|c| present.get(&c).copied().unwrap_or(0)).collect();
        return format!("{counts:?}");
    }
    let (fewest, most) = (present.values().min().copied().unwrap_or(0), present.values().max().copied().unwrap_or(0));
    format!("{} of the {classes} classes present, {fewest} to {most} samples each", present.len())
}

/// `hpc-train data info`: what a file holds, or why it cannot be used.
pub fn describe(info: &DatasetInfo, labels: &Labels) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "file:        {}", info.path.display());
    let _ = writeln!(out, "name:        {}", info.meta.name);
    let _ = writeln!(out, "images:      {} x {} x {} (C x H x W), uint8", info.meta.channels, info.meta.height, info.meta.width);
    let _ = write!(out, "classes:     {}", info.meta.classes);
    if !info.meta.class_names.is_empty() {
        let _ = write!(out, " ({})", info.meta.class_names.join(", "));
    }
    let _ = writeln!(out);
    for split in [Split::Train, Split::Test] {
        let s = info.split(split);
        if s.len == 0 {
            let _ = writeln!(out, "{:<12} 0 samples", format!("{}:", split.name()));
            continue;
        }
        let chunk = match s.chunk_rows {
            Some(rows) => format!("chunks of {rows} images ({} KiB)", rows * info.sample_bytes() / 1024),
            None => "contiguous".to_string(),
        };
        let _ = writeln!(out, "{:<12} {} samples, {chunk}, compression {}", format!("{}:", split.name()), s.len, s.compression);
        let _ = writeln!(out, "             per class: {}", class_counts(labels.split(split), info.meta.classes));
    }
    let fmt = |v: &[f32]| v.iter().map(|x| format!("{x:.4}")).collect::<Vec<_>>().join(", ");
    let _ = writeln!(out, "mean:        [{}]", fmt(&info.mean));
    let _ = writeln!(out, "std:         [{}]", fmt(&info.std));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder of its own under the system's temporary folder, removed when dropped (also when
    /// a test fails).
    struct Scratch(std::path::PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("hpc-train-layout-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// `name` in `dir`, written by `build`.
    fn h5(dir: &Scratch, name: &str, build: impl FnOnce(&hdf5::File) -> hdf5::Result<()>) -> std::path::PathBuf {
        let path = dir.0.join(name);
        let f = hdf5::File::create(&path).unwrap();
        build(&f).unwrap();
        path
    }

    /// A split of `n` blank 1x8x8 images labelled 0, 1, 2, 0, ...
    fn images(f: &hdf5::Group, split: &str, n: usize) -> hdf5::Result<()> {
        let g = f.create_group(split)?;
        g.new_dataset::<u8>().shape([n, 1, 8, 8]).create("images")?;
        let labels: Vec<i64> = (0..n as i64).map(|i| i % 3).collect();
        g.new_dataset_builder().with_data(&labels).create("labels")?;
        Ok(())
    }

    /// The message `open` refuses `path` with.
    fn refusal(path: &Path) -> String {
        open(path).map(|_| ()).unwrap_err().to_string()
    }

    #[test]
    fn paths_that_are_no_hdf5_file_are_refused_before_hdf5_opens_them() {
        let dir = Scratch::new("paths");
        assert!(refusal(&dir.0.join("absent.h5")).contains("no such file"));
        let text = dir.0.join("not.h5");
        std::fs::write(&text, b"this is text").unwrap();
        assert!(refusal(&text).ends_with("not an HDF5 file"), "{}", refusal(&text));
        assert!(refusal(&dir.0).contains("is a directory, not an HDF5 file"));
        // Neither a regular file nor a folder (a FIFO, launched in tests/bad_input.rs, would need
        // a child process here, which would inherit the lock of an HDF5 file another test holds).
        let socket = dir.0.join("socket.h5");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        assert!(refusal(&socket).contains("is a socket, not a regular file"), "{}", refusal(&socket));
        let good = h5(&dir, "good.h5", |f| images(f, "train", 10).and_then(|_| images(f, "test", 4)));
        let (info, labels) = open(&good).unwrap();
        assert_eq!((info.train.len, info.test.len, info.meta.classes, labels.test.len()), (10, 4, 3, 4));
    }

    #[test]
    fn malformed_datasets_are_refused_naming_the_dataset() {
        let dir = Scratch::new("malformed");
        let no_test = h5(&dir, "no_test.h5", |f| images(f, "train", 10));
        assert!(refusal(&no_test).contains("missing dataset `test/images`"), "{}", refusal(&no_test));
        let float_images = h5(&dir, "float.h5", |f| {
            for split in ["train", "test"] {
                let g = f.create_group(split)?;
                g.new_dataset::<f32>().shape([10, 1, 8, 8]).create("images")?;
                g.new_dataset::<i64>().shape([10]).create("labels")?;
            }
            Ok(())
        });
        let said = refusal(&float_images);
        assert!(said.contains("`train/images` has type") && said.ends_with("expected uint8"), "{said}");
        let rank3 = h5(&dir, "rank3.h5", |f| {
            for split in ["train", "test"] {
                let g = f.create_group(split)?;
                g.new_dataset::<u8>().shape([10, 8, 8]).create("images")?;
                g.new_dataset::<i64>().shape([10]).create("labels")?;
            }
            Ok(())
        });
        assert!(refusal(&rank3).contains("expected 4 dimensions N x C x H x W"), "{}", refusal(&rank3));
        let wrong_count = h5(&dir, "count.h5", |f| {
            images(f, "test", 4)?;
            let g = f.create_group("train")?;
            g.new_dataset::<u8>().shape([10, 1, 8, 8]).create("images")?;
            g.new_dataset::<i64>().shape([9]).create("labels")?;
            Ok(())
        });
        assert!(refusal(&wrong_count).contains("`train/labels` has shape [9], expected [10] (one label per image)"), "{}", refusal(&wrong_count));
        let out_of_range = h5(&dir, "range.h5", |f| {
            images(f, "train", 10)?;
            images(f, "test", 4)?;
            f.new_attr::<i64>().create("num_classes")?.write_scalar(&2i64)
        });
        assert!(refusal(&out_of_range).contains("`train/labels` [2] is 2, outside 0..2"), "{}", refusal(&out_of_range));
    }

    /// An infinite `std` trained on blank inputs and exited 0 at chance accuracy; a NaN `mean`
    /// ended in an unnamed "non-finite loss". Refused when the file is opened (by training and
    /// by `data info` alike), naming the attribute.
    #[test]
    fn normalisation_attributes_are_checked_when_the_file_is_opened() {
        let dir = Scratch::new("normalisation");
        let cases: [(&str, f32, f32, &str); 4] = [
            ("inf-std", 0.5, f32::INFINITY, "attribute `std` [0] is inf, expected a finite value"),
            ("nan-mean", f32::NAN, 0.5, "attribute `mean` [0] is NaN, expected a finite value"),
            ("zero-std", 0.5, 0.0, "attribute `std` [0] is 0, expected a standard deviation > 0"),
            ("inf-mean", f32::NEG_INFINITY, 0.5, "attribute `mean` [0] is -inf"),
        ];
        for (name, mean, std, message) in cases {
            let file = h5(&dir, &format!("{name}.h5"), |f| {
                images(f, "train", 10)?;
                images(f, "test", 4)?;
                f.new_attr::<f32>().shape(1).create("mean")?.write(&[mean])?;
                f.new_attr::<f32>().shape(1).create("std")?.write(&[std])
            });
            assert!(refusal(&file).contains(message), "{name}: {}", refusal(&file));
        }
    }
}
