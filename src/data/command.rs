//! `hpc-train data import|info|synth`: the serial data commands and their options (rank 0
//! does the work, the others wait for its verdict). `data bench`, which every rank runs, is
//! `data::bench`.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand, ValueEnum};

use crate::data::bench::DataBenchArgs;
use crate::data::{cifar10, folder, idx, svhn, synth};
use crate::data::layout::{describe, open};
use crate::data::writer::{self, Compression};
use crate::error::{Error, Result};

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Convert a dataset into the project's HDF5 layout.
    Import(ImportArgs),
    /// Print what a dataset file holds, or why it cannot be used. Several files: each in
    /// turn (a blank line between); the exit status is 1 when any cannot be used.
    Info {
        /// Dataset file(s).
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Write a synthetic dataset (noise around class-dependent levels) of any image size.
    Synth(SynthArgs),
    /// Measure how fast every rank reads its shard in training's order (run under mpirun).
    Bench(DataBenchArgs),
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImportFormat {
    /// IDX files (MNIST, Fashion-MNIST), gzipped or not.
    Idx,
    /// CIFAR-10 binary batches (the cifar-10-batches-bin folder).
    Cifar10,
    /// SVHN cropped digits: train_32x32.mat and test_32x32.mat (MATLAB level 5).
    Svhn,
    /// A folder with one sub-folder of JPEG/PNG images per class (torchvision's ImageFolder).
    Folder,
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// Source format.
    #[arg(long, value_enum)]
    pub format: ImportFormat,
    /// Source folder (cifar10; folder: the training images).
    #[arg(long)]
    pub input: Option<PathBuf>,
    /// Training file (svhn: train_32x32.mat).
    #[arg(long)]
    pub train: Option<PathBuf>,
    /// Test file (svhn: test_32x32.mat).
    #[arg(long)]
    pub test: Option<PathBuf>,
    /// Folder of test images with the same class sub-folders (folder).
    #[arg(long, conflicts_with = "test_fraction")]
    pub test_input: Option<PathBuf>,
    /// Fraction of each class's images set aside as the test split (folder).
    #[arg(long)]
    pub test_fraction: Option<f64>,
    /// Side of the square images written: shorter side resized to it, then centre-cropped (folder).
    #[arg(long)]
    pub size: Option<usize>,
    /// Seed of the --test-fraction pick (folder).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Training images (idx).
    #[arg(long)]
    pub train_images: Option<PathBuf>,
    /// Training labels (idx).
    #[arg(long)]
    pub train_labels: Option<PathBuf>,
    /// Test images (idx).
    #[arg(long)]
    pub test_images: Option<PathBuf>,
    /// Test labels (idx).
    #[arg(long)]
    pub test_labels: Option<PathBuf>,
    /// Dataset name stored in the file.
    #[arg(long)]
    pub name: Option<String>,
    /// Class names, comma-separated, stored in the file.
    #[arg(long)]
    pub class_names: Option<String>,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// Where an import or a generator writes its dataset file.
#[derive(Args, Debug)]
pub struct OutputArgs {
    /// Filter for the image datasets.
    #[arg(long, value_enum, default_value_t = Compression::None)]
    pub compression: Compression,
    /// Output file.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace an existing output file.
    #[arg(long)]
    pub force: bool,
}

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Training samples.
    #[arg(long)]
    pub samples: usize,
    /// Test samples.
    #[arg(long, default_value_t = 0)]
    pub test_samples: usize,
    /// Image shape CxHxW.
    #[arg(long, default_value = "3x224x224")]
    pub shape: String,
    /// Number of classes.
    #[arg(long, default_value_t = 1000)]
    pub classes: usize,
    /// Seed of the generator.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub output: OutputArgs,
}


/// Runs a serial data command (rank 0 runs it; `data bench` runs on every rank, see
/// `data::bench`).
pub fn run(cmd: &DataCommand) -> Result<()> {
    match cmd {
        DataCommand::Info { files } => {
            if let [file] = files.as_slice() {
                let (info, labels) = open(file)?;
                print!("{}", describe(&info, &labels));
                return Ok(());
            }
            // Every file is checked, whatever the ones before it held: a user checking a
            // folder of files (and the damaged-file tests, in one process) wants each verdict.
            let mut unusable = 0;
            for (i, file) in files.iter().enumerate() {
                match open(file) {
                    Ok((info, labels)) => print!("{}{}", if i > 0 { "\n" } else { "" }, describe(&info, &labels)),
                    Err(e) => {
                        unusable += 1;
                        // One write per line (formatted first): output may interleave.
                        let line = format!("error: {e}\n");
                        eprint!("{line}");
                    }
                }
            }
            match unusable {
                0 => Ok(()),
                n => Err(Error::usage(format!("{n} of {} dataset files cannot be used (each named above)", files.len()))),
            }
        }
        DataCommand::Import(a) => {
            let class_names = a.class_names.as_deref().map(writer::parse_class_names).unwrap_or_default();
            let (train, test) = match a.format {
                ImportFormat::Idx => {
                    let need = |p: &Option<PathBuf>, flag: &str| {
                        p.clone().ok_or_else(|| Error::usage(format!("--format idx needs {flag}")))
                    };
                    let (ti, tl) = (need(&a.train_images, "--train-images")?, need(&a.train_labels, "--train-labels")?);
                    let (vi, vl) = (need(&a.test_images, "--test-images")?, need(&a.test_labels, "--test-labels")?);
                    let paths = idx::IdxPaths { train_images: &ti, train_labels: &tl, test_images: &vi, test_labels: &vl };
                    let name = a.name.clone().unwrap_or_else(|| default_name(&a.output.out));
                    idx::import(&paths, &a.output.out, &name, class_names, a.output.compression, a.output.force)?
                }
                ImportFormat::Cifar10 => {
                    let input = a.input.as_ref().ok_or_else(|| Error::usage("--format cifar10 needs --input DIR (cifar-10-batches-bin)"))?;
                    cifar10::import(input, &a.output.out, a.output.compression, a.output.force)?
                }
                ImportFormat::Svhn => {
                    let train = a.train.as_ref().ok_or_else(|| Error::usage("--format svhn needs --train train_32x32.mat"))?;
                    let test = a.test.as_ref().ok_or_else(|| Error::usage("--format svhn needs --test test_32x32.mat"))?;
                    svhn::import(train, test, &a.output.out, a.output.compression, a.output.force)?
                }
                ImportFormat::Folder => {
                    let input = a.input.clone().ok_or_else(|| Error::usage("--format folder needs --input DIR (one sub-folder per class)"))?;
                    let size = a.size.ok_or_else(|| Error::usage("--format folder needs --size S (side of the square images)"))?;
                    let test = match (&a.test_input, a.test_fraction) {
                        (Some(dir), _) => folder::TestSource::Folder(dir.clone()),
                        (None, Some(f)) => folder::TestSource::Fraction(f),
                        (None, None) => folder::TestSource::None,
                    };
                    let name = a.name.clone().unwrap_or_else(|| default_name(&a.output.out));
                    let spec = folder::FolderSpec { input, test, size, seed: a.seed, name };
                    let s = folder::import(&spec, &a.output.out, a.output.compression, a.output.force)?;
                    println!(
                        "wrote {} ({} training and {} test samples of 3x{size}x{size}, {} classes); skipped {} file(s) that are not readable JPEG or PNG images",
                        a.output.out.display(), s.train, s.test, s.classes, s.skipped.len()
                    );
                    return Ok(());
                }
            };
            println!("wrote {} ({train} training and {test} test samples)", a.output.out.display());
            Ok(())
        }
        DataCommand::Synth(a) => {
            let shape = synth::parse_shape(&a.shape).map_err(Error::usage)?;
            let spec = synth::SynthSpec { train: a.samples, test: a.test_samples, shape, classes: a.classes, seed: a.seed };
            synth::generate(&spec, &a.output.out, a.output.compression, a.output.force)?;
            println!("wrote {} ({} training and {} test samples of {})", a.output.out.display(), a.samples, a.test_samples, a.shape);
            Ok(())
        }
        DataCommand::Bench(_) => unreachable!("data bench runs on every rank, dispatched in main"),
    }
}

/// The dataset's name when none is given: the output file's stem.
fn default_name(out: &Path) -> String {
    out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "dataset".into())
}
