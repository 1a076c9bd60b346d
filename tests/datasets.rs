//! Dataset importers and I/O tools through the real binary: SVHN MAT-files, image folders,
//! compression, `data bench` under mpirun, and damaged inputs.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;

// ---------------------------------------------------------------------------------------------
// Open MPI keeps a session folder per host under /tmp, which a singleton starting while another
// ends can race on ("A call to mkdir was unable to create the desired directory ... File
// exists"); these tests start many short processes side by side, so each run gets its own.

fn session_dir() -> PathBuf {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!("hpc-train-ompi-{}-{}", std::process::id(), RUNS.fetch_add(1, Ordering::Relaxed)));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `hpc-train <args>` alone (a singleton MPI process).
fn hpc(args: &[&str]) -> Run {
    let session = session_dir();
    let mut cmd = Command::new(bin());
    cmd.args(args).current_dir(root()).env("OMPI_MCA_orte_tmpdir_base", &session);
    let run = run_with_limit(cmd, Duration::from_secs(120));
    let _ = std::fs::remove_dir_all(&session);
    run
}

/// `mpirun -n <ranks> hpc-train <args>`.
fn mpi(ranks: usize, args: &[&str]) -> Run {
    let session = session_dir();
    let run = mpirun_env(ranks, args, &[("OMPI_MCA_orte_tmpdir_base", session.to_str().unwrap())], Duration::from_secs(300));
    let _ = std::fs::remove_dir_all(&session);
    run
}

fn synthetic(dir: &Path, name: &str, samples: usize, test: usize, shape: &str, classes: usize) -> PathBuf {
    let out = dir.join(format!("{name}.h5"));
    hpc(&[
        "data", "synth", "--samples", &samples.to_string(), "--test-samples", &test.to_string(), "--shape", shape,
        "--classes", &classes.to_string(), "--out", out.to_str().unwrap(),
    ])
    .expect_ok();
    out
}

// ---------------------------------------------------------------------------------------------
// A small MAT-file (level 5) writer, independent of the one in the crate: little-endian, one
// miMATRIX per variable, optionally wrapped in miCOMPRESSED as MATLAB's `save -v7` does.

const MI_INT8: u32 = 1;
const MI_UINT8: u32 = 2;
const MI_INT32: u32 = 5;
const MI_UINT32: u32 = 6;
const MI_DOUBLE: u32 = 9;
const MI_MATRIX: u32 = 14;
const MI_COMPRESSED: u32 = 15;
const MX_DOUBLE: u32 = 6;
const MX_UINT8: u32 = 9;

fn mat_element(out: &mut Vec<u8>, data_type: u32, data: &[u8]) {
    if data.len() <= 4 && data_type != MI_MATRIX {
        out.extend_from_slice(&(((data.len() as u32) << 16) | data_type).to_le_bytes());
        let mut word = [0u8; 4];
        word[..data.len()].copy_from_slice(data);
        out.extend_from_slice(&word);
    } else {
        out.extend_from_slice(&data_type.to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(data);
        while !out.len().is_multiple_of(8) {
            out.push(0);
        }
    }
}

struct MatVar<'a> {
    name: &'a str,
    class: u32,
    dims: Vec<usize>,
    data_type: u32,
    data: Vec<u8>,
}

fn mat_file(vars: &[MatVar], compressed: bool) -> Vec<u8> {
    let mut out = b"MATLAB 5.0 MAT-file, Platform: GLNXA64, Created on: Sun Nov 22 12:00:00 2026".to_vec();
    out.resize(116, b' ');
    out.extend_from_slice(&[0u8; 8]);
    out.extend_from_slice(&0x0100u16.to_le_bytes());
    out.extend_from_slice(b"IM");
    for v in vars {
        let mut body = Vec::new();
        mat_element(&mut body, MI_UINT32, &[v.class.to_le_bytes(), 0u32.to_le_bytes()].concat());
        let dims: Vec<u8> = v.dims.iter().flat_map(|&d| (d as i32).to_le_bytes()).collect();
        mat_element(&mut body, MI_INT32, &dims);
        mat_element(&mut body, MI_INT8, v.name.as_bytes());
        mat_element(&mut body, v.data_type, &v.data);
        let mut matrix = Vec::new();
        mat_element(&mut matrix, MI_MATRIX, &body);
        if compressed {
            let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
            z.write_all(&matrix).unwrap();
            let z = z.finish().unwrap();
            out.extend_from_slice(&MI_COMPRESSED.to_le_bytes());
            out.extend_from_slice(&(z.len() as u32).to_le_bytes());
            out.extend_from_slice(&z);
        } else {
            out.extend_from_slice(&matrix);
        }
    }
    out
}

/// The pixel at (image n, channel c, row, col) of the SVHN fixtures.
fn svhn_pixel(n: usize, c: usize, row: usize, col: usize) -> u8 {
    ((n * 7 + c * 61 + row * 3 + col * 5) % 256) as u8
}

/// `X` as MATLAB stores it: 32 x 32 x 3 x N, column-major (row fastest, then column, channel,
/// image).
fn svhn_x(images: usize) -> Vec<u8> {
    let mut x = vec![0u8; 32 * 32 * 3 * images];
    for n in 0..images {
        for c in 0..3 {
            for col in 0..32 {
                for row in 0..32 {
                    x[row + 32 * col + 1024 * c + 3072 * n] = svhn_pixel(n, c, row, col);
                }
            }
        }
    }
    x
}

/// An SVHN-style file with `labels` (1..10); labels as doubles, or as uint8.
fn svhn_file(path: &Path, labels: &[u8], double_labels: bool, compressed: bool) {
    let n = labels.len();
    let y = if double_labels {
        MatVar { name: "y", class: MX_DOUBLE, dims: vec![n, 1], data_type: MI_DOUBLE, data: labels.iter().flat_map(|&l| (l as f64).to_le_bytes()).collect() }
    } else {
        MatVar { name: "y", class: MX_UINT8, dims: vec![n, 1], data_type: MI_UINT8, data: labels.to_vec() }
    };
    let x = MatVar { name: "X", class: MX_UINT8, dims: vec![32, 32, 3, n], data_type: MI_UINT8, data: svhn_x(n) };
    std::fs::write(path, mat_file(&[x, y], compressed)).unwrap();
}

fn read_split(path: &Path, split: &str) -> (Vec<usize>, Vec<u8>, Vec<i64>) {
    with_hdf5_open(|| {
        let f = hdf5::File::open(path).unwrap();
        let images = f.dataset(&format!("{split}/images")).unwrap();
        let shape = images.shape();
        let pixels = images.read_raw::<u8>().unwrap();
        let labels = f.dataset(&format!("{split}/labels")).unwrap().read_raw::<i64>().unwrap();
        (shape, pixels, labels)
    })
}

fn string_attr(path: &Path, name: &str) -> String {
    with_hdf5_open(|| {
        let f = hdf5::File::open(path).unwrap();
        f.attr(name).unwrap().read_scalar::<hdf5::types::VarLenUnicode>().unwrap().as_str().to_string()
    })
}

fn strings_attr(path: &Path, name: &str) -> Vec<String> {
    with_hdf5_open(|| {
        let f = hdf5::File::open(path).unwrap();
        f.attr(name).unwrap().read_raw::<hdf5::types::VarLenUnicode>().unwrap().iter().map(|s| s.as_str().to_string()).collect()
    })
}

/// Expects a failure that names `file` and says `reason`, printed once, exit code 1.
fn expect_error(run: &Run, file: &str, reason: &str) {
    assert!(!run.timed_out, "hung:\n{}", run.all_output());
    assert_eq!(run.status, Some(1), "expected exit code 1:\n{}", run.all_output());
    let out = run.all_output();
    let line = out.lines().find(|l| l.contains("error")).unwrap_or_else(|| panic!("no error line in:\n{out}"));
    assert!(line.contains(file) && line.contains(reason), "expected {file:?} and {reason:?} in the error line {line:?}");
}

#[test]
fn svhn_import_transposes_images_and_maps_ten_to_zero() {
    let dir = scratch("svhn");
    let train_labels: Vec<u8> = vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 3];
    let test_labels: Vec<u8> = vec![10, 4, 7];
    for compressed in [false, true] {
        let train = dir.join(format!("train-{compressed}.mat"));
        let test = dir.join(format!("test-{compressed}.mat"));
        svhn_file(&train, &train_labels, true, compressed);
        svhn_file(&test, &test_labels, false, compressed);
        let out = dir.join(format!("svhn-{compressed}.h5"));
        let run = hpc(&[
            "data", "import", "--format", "svhn", "--train", train.to_str().unwrap(), "--test", test.to_str().unwrap(),
            "--out", out.to_str().unwrap(),
        ])
        .expect_ok();
        assert!(run.stdout.contains("12 training and 3 test samples"), "{}", run.stdout);

        for (split, labels) in [("train", &train_labels), ("test", &test_labels)] {
            let (shape, pixels, got_labels) = read_split(&out, split);
            assert_eq!(shape, vec![labels.len(), 3, 32, 32], "{split}");
            let expected: Vec<i64> = labels.iter().map(|&l| (l % 10) as i64).collect();
            assert_eq!(got_labels, expected, "{split} labels, compressed {compressed}");
            for n in 0..labels.len() {
                for c in 0..3 {
                    for row in 0..32 {
                        for col in 0..32 {
                            let got = pixels[((n * 3 + c) * 32 + row) * 32 + col];
                            assert_eq!(got, svhn_pixel(n, c, row, col), "{split} image {n} channel {c} ({row}, {col})");
                        }
                    }
                }
            }
        }
        assert_eq!(string_attr(&out, "name"), "svhn");
        assert_eq!(strings_attr(&out, "class_names"), (0..10).map(|d| d.to_string()).collect::<Vec<_>>());
        let info = hpc(&["data", "info", out.to_str().unwrap()]).expect_ok();
        assert!(info.stdout.contains("per class: [2, 1, 1, 2, 1, 1, 1, 1, 1, 1]"), "{}", info.stdout);
    }
}

#[test]
fn svhn_bad_files_name_the_file_and_the_problem() {
    let dir = scratch("svhn-bad");
    let good = dir.join("good.mat");
    svhn_file(&good, &[1, 2, 3], true, true);
    let out = dir.join("out.h5");
    let import = |train: &Path| {
        hpc(&[
            "data", "import", "--format", "svhn", "--train", train.to_str().unwrap(), "--test", good.to_str().unwrap(),
            "--out", out.to_str().unwrap(), "--force",
        ])
    };

    let bad_label = dir.join("label11.mat");
    svhn_file(&bad_label, &[1, 11, 3], true, false);
    expect_error(&import(&bad_label), "label11.mat", "`y` [1] is 11");

    let no_x = dir.join("no_x.mat");
    std::fs::write(&no_x, mat_file(&[MatVar { name: "y", class: MX_DOUBLE, dims: vec![1, 1], data_type: MI_DOUBLE, data: 1f64.to_le_bytes().to_vec() }], true)).unwrap();
    expect_error(&import(&no_x), "no_x.mat", "no variable `X` (the file holds `y`)");

    let bytes = std::fs::read(&good).unwrap();
    let truncated = dir.join("truncated.mat");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    expect_error(&import(&truncated), "truncated.mat", "truncated");

    let text = dir.join("text.mat");
    std::fs::write(&text, "x,y\n1,2\n".repeat(40)).unwrap();
    expect_error(&import(&text), "text.mat", "not a MAT-file");

    let wrong_count = dir.join("count.mat");
    let x = MatVar { name: "X", class: MX_UINT8, dims: vec![32, 32, 3, 2], data_type: MI_UINT8, data: svhn_x(2) };
    let y = MatVar { name: "y", class: MX_DOUBLE, dims: vec![3, 1], data_type: MI_DOUBLE, data: [1f64, 2.0, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect() };
    std::fs::write(&wrong_count, mat_file(&[x, y], false)).unwrap();
    expect_error(&import(&wrong_count), "count.mat", "expected 2 x 1");
    assert!(!out.exists(), "a failed import left {}", out.display());
}

// ---------------------------------------------------------------------------------------------
// Image folders.

fn solid_png(path: &Path, w: u32, h: u32, rgb: [u8; 3]) {
    image::RgbImage::from_pixel(w, h, image::Rgb(rgb)).save(path).unwrap();
}

#[test]
fn folder_import_decodes_resizes_and_skips_bad_files() {
    let dir = scratch("folder");
    let input = dir.join("images");
    let cats = input.join("cats");
    let dogs = input.join("dogs");
    std::fs::create_dir_all(cats.join("more")).unwrap();
    std::fs::create_dir_all(&dogs).unwrap();
    std::fs::create_dir_all(input.join(".ipynb_checkpoints")).unwrap();
    // cats: a red PNG wider than tall, a grey PNG, a JPEG in a sub-folder.
    solid_png(&cats.join("a_red.png"), 40, 30, [255, 0, 0]);
    image::GrayImage::from_pixel(20, 50, image::Luma([77])).save(cats.join("b_grey.png")).unwrap();
    image::RgbImage::from_fn(64, 48, |x, y| image::Rgb([(x * 4) as u8, (y * 5) as u8, 128])).save(cats.join("more/c_photo.jpg")).unwrap();
    // dogs: a blue PNG taller than wide, a corrupt PNG, a text file, a hidden file.
    solid_png(&dogs.join("a_blue.png"), 30, 50, [0, 0, 255]);
    let mut png = Vec::new();
    image::RgbImage::from_pixel(16, 16, image::Rgb([1, 2, 3])).write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png).unwrap();
    std::fs::write(dogs.join("b_broken.png"), &png[..png.len() / 2]).unwrap();
    std::fs::write(dogs.join("c_notes.txt"), "not an image\n").unwrap();
    std::fs::write(dogs.join(".DS_Store"), [0u8; 64]).unwrap();
    solid_png(&dogs.join("d_green.png"), 16, 16, [0, 200, 0]);

    let out = dir.join("folder.h5");
    let run = hpc(&["data", "import", "--format", "folder", "--input", input.to_str().unwrap(), "--size", "16", "--out", out.to_str().unwrap()]).expect_ok();
    assert!(run.stdout.contains("5 training and 0 test samples of 3x16x16, 2 classes"), "{}", run.stdout);
    assert!(run.stdout.contains("skipped 2 file(s)"), "{}", run.stdout);
    for skipped in ["b_broken.png", "c_notes.txt"] {
        let warning = run.stderr.lines().find(|l| l.contains(skipped)).unwrap_or_else(|| panic!("no warning for {skipped}:\n{}", run.stderr));
        assert!(warning.contains("WARN") && warning.contains("skipping"), "{warning}");
    }
    assert!(run.stderr.contains("not a JPEG or PNG image"), "{}", run.stderr);
    assert!(!run.all_output().contains(".DS_Store"), "hidden files are not candidates");

    let (shape, pixels, labels) = read_split(&out, "train");
    // Sorted by class, then path, less the skipped files: cats/a_red, cats/b_grey,
    // cats/more/c_photo, dogs/a_blue, dogs/d_green.
    assert_eq!(shape, vec![5, 3, 16, 16]);
    assert_eq!(labels, vec![0, 0, 0, 1, 1]);
    let image = |n: usize| &pixels[n * 768..(n + 1) * 768];
    let solid = |n: usize, rgb: [u8; 3]| {
        for c in 0..3 {
            assert!(image(n)[c * 256..(c + 1) * 256].iter().all(|&p| p == rgb[c]), "image {n} channel {c}: {:?}", &image(n)[c * 256..c * 256 + 16]);
        }
    };
    solid(0, [255, 0, 0]);
    solid(1, [77, 77, 77]);
    solid(3, [0, 0, 255]);
    solid(4, [0, 200, 0]);
    // The JPEG is a gradient: red grows left to right, green top to bottom, blue stays 128
    // (within JPEG's loss).
    let photo = image(2);
    assert!(photo[..256].chunks(16).all(|row| row[15] as i32 - row[0] as i32 > 150), "red grows along rows");
    assert!(photo[256 + 15 * 16] as i32 - photo[256] as i32 > 150, "green grows down the columns");
    assert!(photo[512..].iter().all(|&b| (b as i32 - 128).abs() <= 12), "blue stays near 128");
    assert_eq!(strings_attr(&out, "class_names"), vec!["cats", "dogs"]);
    assert_eq!(string_attr(&out, "name"), "folder");
    hpc(&["data", "info", out.to_str().unwrap()]).expect_ok();
}

#[test]
fn folder_test_splits_from_a_fraction_or_a_second_folder() {
    let dir = scratch("folder-split");
    let input = dir.join("train");
    for (class, rgb) in [("a", [250u8, 10, 10]), ("b", [10, 250, 10])] {
        std::fs::create_dir_all(input.join(class)).unwrap();
        for i in 0..10u8 {
            solid_png(&input.join(class).join(format!("{i:02}.png")), 8 + i as u32, 8, [rgb[0], rgb[1], i]);
        }
    }
    let import = |out: &Path, extra: &[&str]| {
        let mut args = vec!["data", "import", "--format", "folder", "--input", input.to_str().unwrap(), "--size", "8", "--out", out.to_str().unwrap()];
        args.extend(extra);
        hpc(&args).expect_ok()
    };
    let one = dir.join("one.h5");
    let two = dir.join("two.h5");
    let other_seed = dir.join("three.h5");
    import(&one, &["--test-fraction", "0.3", "--seed", "5"]);
    import(&two, &["--test-fraction", "0.3", "--seed", "5"]);
    import(&other_seed, &["--test-fraction", "0.3", "--seed", "6"]);
    let (shape, test_pixels, test_labels) = read_split(&one, "test");
    assert_eq!(shape, vec![6, 3, 8, 8]);
    assert_eq!(test_labels, vec![0, 0, 0, 1, 1, 1], "three per class, in class order");
    assert_eq!(read_split(&one, "train").0, vec![14, 3, 8, 8]);
    assert_eq!(read_split(&two, "test").1, test_pixels, "the same seed picks the same images");
    assert_ne!(read_split(&other_seed, "test").1, test_pixels, "another seed picks others");

    // A second folder; a class the training folder lacks is an error naming it.
    let test_dir = dir.join("test");
    std::fs::create_dir_all(test_dir.join("b")).unwrap();
    solid_png(&test_dir.join("b/x.png"), 9, 9, [1, 2, 3]);
    let with_folder = dir.join("four.h5");
    import(&with_folder, &["--test-input", test_dir.to_str().unwrap()]);
    let (shape, pixels, labels) = read_split(&with_folder, "test");
    assert_eq!((shape, labels), (vec![1, 3, 8, 8], vec![1]));
    assert!(pixels[..64].iter().all(|&p| p == 1) && pixels[128..].iter().all(|&p| p == 3));
    std::fs::create_dir_all(test_dir.join("zebra")).unwrap();
    let run = hpc(&["data", "import", "--format", "folder", "--input", input.to_str().unwrap(), "--size", "8", "--test-input", test_dir.to_str().unwrap(), "--out", dir.join("five.h5").to_str().unwrap()]);
    expect_error(&run, "zebra", "a test class that");

    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let run = hpc(&["data", "import", "--format", "folder", "--input", empty.to_str().unwrap(), "--size", "8", "--out", dir.join("six.h5").to_str().unwrap()]);
    expect_error(&run, "empty", "holds no class folders");
}

// ---------------------------------------------------------------------------------------------
// Compression.

#[test]
fn compressed_files_read_back_the_same() {
    let dir = scratch("compression");
    let mut pixels = Vec::new();
    for compression in ["none", "gzip", "lzf"] {
        let out = dir.join(format!("{compression}.h5"));
        hpc(&[
            "data", "synth", "--samples", "40", "--test-samples", "4", "--shape", "3x20x20", "--classes", "3",
            "--compression", compression, "--out", out.to_str().unwrap(),
        ])
        .expect_ok();
        let info = hpc(&["data", "info", out.to_str().unwrap()]).expect_ok();
        let line = info.stdout.lines().find(|l| l.starts_with("train:")).unwrap().to_string();
        let expected = match compression {
            "none" => "compression none",
            "gzip" => "compression deflate(4)",
            _ => "compression lzf",
        };
        assert!(line.contains(expected) && line.contains("chunks of 40 images"), "{line}");
        pixels.push(read_split(&out, "train").1);
    }
    assert_eq!(pixels[0], pixels[1]);
    assert_eq!(pixels[0], pixels[2]);
}

// ---------------------------------------------------------------------------------------------
// data bench.

#[test]
fn data_bench_runs_on_any_rank_count() {
    let dir = scratch("data-bench");
    let data = synthetic(&dir, "bench", 150, 10, "3x16x16", 4);
    let results = dir.join("results");
    for ranks in [1, 2, 3] {
        let run = mpi(ranks, &["data", "bench", data.to_str().unwrap(), "--batch-size", "8", "--epochs", "2", "--results", results.to_str().unwrap()]).expect_ok();
        let rows: Vec<&str> = run.stdout.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).collect();
        assert_eq!(rows.len(), 1, "one row:\n{}", run.stdout);
        let fields: Vec<&str> = rows[0].split_whitespace().collect();
        assert_eq!(fields[0], ranks.to_string(), "{}", rows[0]);
        assert_eq!(fields[1], "8");
        assert_eq!(fields[9], "0", "#wrong: {}", rows[0]);
    }
    let text = std::fs::read_to_string(results.join("data_bench.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(records.len(), 3);
    for (r, ranks) in records.iter().zip([1u64, 2, 3]) {
        assert_eq!(r["ranks"], ranks);
        assert_eq!(r["batch"], 8);
        assert_eq!(r["image_shape"], serde_json::json!([3, 16, 16]));
        for key in ["mean", "min", "max"] {
            assert!(r["images_per_sec_per_rank"][key].as_f64().unwrap() > 0.0, "{r}");
        }
        assert!(r["images_per_sec_total"].as_f64().unwrap() > 0.0);
        for key in ["file", "host", "date", "git_commit", "mb_per_sec_total", "images"] {
            assert!(!r[key].is_null(), "{key} missing in {r}");
        }
    }
}

#[test]
fn data_bench_fails_cleanly() {
    let dir = scratch("data-bench-bad");
    let run = mpi(2, &["data", "bench", "/nonexistent/x.h5", "--results", dir.join("r").to_str().unwrap()]);
    assert!(!run.ok());
    assert_eq!(run.all_output().matches("no such file").count(), 1, "{}", run.all_output());
    let data = synthetic(&dir, "tiny", 10, 2, "1x4x4", 2);
    let run = mpi(3, &["data", "bench", data.to_str().unwrap(), "--batch-size", "4", "--results", dir.join("r").to_str().unwrap()]);
    assert!(!run.ok());
    assert_eq!(run.all_output().matches("fewer than ranks x batch").count(), 1, "{}", run.all_output());
}

// ---------------------------------------------------------------------------------------------
// Damaged files through the binary: errors, never crashes.

/// Runs `hpc-train <command> FILE <extra>` on each file; every run must end with 0 (damage that
/// goes unnoticed, as in pixel data) or the program's own error exit 1 naming the file, never a
/// signal or a panic (101). Returns the files that gave an error.
/// `data info` over every file in one process (one libtorch load instead of one per file): the
/// files it found unusable, each named in an error line of its own, the exit status 1 exactly
/// when there are some. A crash or a hang gives no verdicts: then each file alone
/// ([`check_no_crash`]), which names the file that crashes.
fn unusable_files(files: &[PathBuf]) -> Vec<PathBuf> {
    let mut args = vec!["data", "info"];
    args.extend(files.iter().map(|f| f.to_str().unwrap()));
    let run = hpc(&args);
    if run.timed_out || !matches!(run.status, Some(0) | Some(1)) {
        eprintln!("data info over {} files ended with {:?} (timed out: {}): each file alone", files.len(), run.status, run.timed_out);
        return check_no_crash(files, &["data", "info"], &[]);
    }
    let error_lines: Vec<&str> = run.stderr.lines().filter(|l| l.starts_with("error: ")).collect();
    let named = |f: &PathBuf, line: &str| line.contains(&format!("/{}", f.file_name().unwrap().to_str().unwrap()));
    let errors: Vec<PathBuf> = files.iter().filter(|f| error_lines.iter().any(|l| named(f, l))).cloned().collect();
    assert_eq!(run.status == Some(1), !errors.is_empty(), "exit status {:?} with {} unusable files:\n{}", run.status, errors.len(), run.stderr);
    // One line per unusable file, each naming one file, and the count at the end.
    if !errors.is_empty() {
        let per_file = &error_lines[..error_lines.len() - 1];
        assert_eq!(per_file.len(), errors.len(), "{}", run.stderr);
        for line in per_file {
            assert_eq!(files.iter().filter(|f| named(f, line)).count(), 1, "{line}");
        }
        assert!(error_lines.last().unwrap().contains(&format!("{} of {} dataset files cannot be used", errors.len(), files.len())), "{}", run.stderr);
    }
    errors
}

fn check_no_crash(files: &[PathBuf], command: &[&str], extra: &[&str]) -> Vec<PathBuf> {
    let mut errors = Vec::new();
    // Two at a time: the machine has two cores.
    for pair in files.chunks(2) {
        let runs: Vec<(PathBuf, Run)> = std::thread::scope(|s| {
            let handles: Vec<_> = pair
                .iter()
                .map(|f| {
                    s.spawn(move || {
                        let args: Vec<&str> = command.iter().copied().chain([f.to_str().unwrap()]).chain(extra.iter().copied()).collect();
                        (f.clone(), hpc(&args))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (file, run) in runs {
            assert!(!run.timed_out, "{} hung", file.display());
            match run.status {
                Some(0) => {}
                Some(1) => {
                    let name = file.file_name().unwrap().to_str().unwrap();
                    assert!(run.stderr.contains(name), "{}: the error does not name the file:\n{}", file.display(), run.stderr);
                    errors.push(file);
                }
                other => panic!("{}: exit {other:?}\n{}", file.display(), run.all_output()),
            }
        }
    }
    errors
}

#[test]
fn damaged_hdf5_files_are_errors_not_crashes() {
    let dir = scratch("fuzz-h5");
    let good = synthetic(&dir, "good", 30, 6, "1x6x6", 3);
    let bytes = std::fs::read(&good).unwrap();
    let mut files = Vec::new();
    // Cuts: a spread of lengths through the file, and a few at its edges.
    let step = (bytes.len() / 40).max(1);
    for cut in (0..bytes.len()).step_by(step).chain([8, 512, 2047, bytes.len() - 1]) {
        let f = dir.join(format!("cut{cut}.h5"));
        std::fs::write(&f, &bytes[..cut]).unwrap();
        files.push(f);
    }
    let cuts = files.clone();
    // Flipped bytes over the whole file (superblock, object headers, B-trees, heaps, data).
    let mut x = 2_463_534_242u32;
    for k in 0..40 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let at = if k < 15 { k * 7 } else { x as usize % bytes.len() };
        let mut bad = bytes.clone();
        bad[at] ^= 0xff;
        let f = dir.join(format!("flip{at}.h5"));
        std::fs::write(&f, &bad).unwrap();
        files.push(f);
    }
    // Garbage after a valid signature.
    let mut garbage = bytes[..8].to_vec();
    garbage.extend((0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
    let f = dir.join("garbage.h5");
    std::fs::write(&f, &garbage).unwrap();
    files.push(f);
    let errors = unusable_files(&files);
    for cut in &cuts {
        assert!(errors.contains(cut), "{}: a cut file was accepted", cut.display());
    }
    assert!(errors.contains(&dir.join("garbage.h5")));
    // The files that passed validation are read in full, in training's order, by the reader.
    let accepted: Vec<PathBuf> = files.iter().filter(|f| !errors.contains(f)).cloned().collect();
    let results = dir.join("results");
    check_no_crash(&accepted, &["data", "bench"], &["--batch-size", "4", "--results", results.to_str().unwrap()]);
}

#[test]
fn damaged_idx_and_cifar_files_are_clear_errors() {
    let dir = scratch("fuzz-importers");
    let out = dir.join("out.h5");
    // IDX: gzipped images cut short, labels with a wrong count.
    let images: Vec<u8> = [vec![0, 0, 8, 3], 4u32.to_be_bytes().to_vec(), 5u32.to_be_bytes().to_vec(), 5u32.to_be_bytes().to_vec(), vec![9u8; 100]].concat();
    let labels: Vec<u8> = [vec![0, 0, 8, 1], 4u32.to_be_bytes().to_vec(), vec![0, 1, 2, 1]].concat();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&images).unwrap();
    let gz = gz.finish().unwrap();
    let write = |name: &str, b: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let good_images = write("images.idx", &images);
    let good_labels = write("labels.idx", &labels);
    let idx = |images: &Path, labels: &Path| {
        hpc(&[
            "data", "import", "--format", "idx", "--force", "--out", out.to_str().unwrap(),
            "--train-images", images.to_str().unwrap(), "--train-labels", labels.to_str().unwrap(),
            "--test-images", good_images.to_str().unwrap(), "--test-labels", good_labels.to_str().unwrap(),
        ])
    };
    idx(&good_images, &good_labels).expect_ok();
    for cut in [3, 10, gz.len() / 2, gz.len() - 3] {
        let p = write(&format!("cut{cut}.idx.gz"), &gz[..cut]);
        let run = idx(&p, &good_labels);
        assert_eq!(run.status, Some(1), "{}", run.all_output());
        assert!(run.stderr.contains(&format!("cut{cut}.idx.gz")), "{}", run.stderr);
    }
    let short_labels = write("short.idx", &labels[..labels.len() - 1]);
    expect_error(&idx(&good_images, &short_labels), "short.idx", "truncated");

    // CIFAR-10: a batch cut short, a label out of range.
    let cifar = dir.join("cifar");
    std::fs::create_dir_all(&cifar).unwrap();
    let record = |label: u8| [vec![label], vec![label * 20; 3072]].concat();
    for name in ["data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin", "data_batch_4.bin", "data_batch_5.bin", "test_batch.bin"] {
        std::fs::write(cifar.join(name), [record(1), record(2)].concat()).unwrap();
    }
    let import = || hpc(&["data", "import", "--format", "cifar10", "--input", cifar.to_str().unwrap(), "--out", out.to_str().unwrap(), "--force"]);
    import().expect_ok();
    std::fs::write(cifar.join("data_batch_3.bin"), &[record(1), record(2)].concat()[..5000]).unwrap();
    expect_error(&import(), "data_batch_3.bin", "not a whole number of 3073-byte CIFAR-10 records");
    std::fs::write(cifar.join("data_batch_3.bin"), [record(1), record(12)].concat()).unwrap();
    expect_error(&import(), "data_batch_3.bin", "record 1 has label 12");
}

/// A dataset written to a full disk: H5Fclose reported no error while the datasets were open,
/// so a file whose data never reached the disk was renamed into place with "wrote ..." and
/// exit 0; a write that failed earlier left its `.tmp` file. Now the write fails with the
/// reason and leaves nothing behind (the importers share the writer).
#[test]
fn a_dataset_written_to_a_full_disk_fails_and_leaves_nothing() {
    let dir = scratch("full-disk-dataset");
    let disk = dir.join("disk");
    let out = disk.join("s.h5");
    // 64 KiB: the chunks fit in HDF5's cache and fail when flushed; 256 KiB: a write fails.
    for (samples, size) in [("400", "64k"), ("2000", "256k")] {
        let (run, left) = hpc_train_with_tmpfs_listing(
            &["data", "synth", "--samples", samples, "--shape", "1x28x28", "--classes", "3", "--out", out.to_str().unwrap()],
            &disk,
            size,
        );
        let text = run.all_output();
        assert!(!run.ok(), "{samples} samples on {size}: {text}");
        assert!(text.contains("No space left on device") && !text.contains("wrote "), "{text}");
        assert!(left.is_empty(), "{samples} samples on {size} left {left:?}:\n{text}");
    }
}
