//! `hpc-train data bench`: how fast each rank reads its shard of a dataset file, in exactly the
//! order training reads it (the shuffled, sharded [`Schedule`], through the prefetching
//! [`Loader`] training uses), with nothing else to do. What training gets at best from its data.
//!
//! Every rank reads its own batches without waiting for the others (training synchronises at the
//! gradient exchange, which is not measured here); the total rate divides all images read by the
//! slowest rank's time. Every run checks that the ranks together read exactly the samples the
//! schedule assigns.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use mpi::traits::*;
use serde::Serialize;

use crate::data::loader::{Loader, Schedule};
use crate::error::{Error, Result};
use crate::raw;
use crate::results;
use crate::topology::World;

/// Options of `hpc-train data bench`.
#[derive(Args, Debug)]
pub struct DataBenchArgs {
    /// Dataset file in the project's HDF5 layout.
    pub file: PathBuf,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: u64,
    /// Steps to read (default: one epoch).
    #[arg(long, conflicts_with = "epochs", value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: Option<u64>,
    /// Epochs to read.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub epochs: Option<u64>,
    /// Seed of the shuffled order (training's --seed gives training's order).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Steps read before timing starts (at most all but one).
    #[arg(long, default_value_t = 2)]
    pub warmup_steps: u64,
    /// Batches the loader thread reads ahead (training's default).
    #[arg(long, default_value_t = 4)]
    pub prefetch: usize,
    /// Folder for data_bench.jsonl.
    #[arg(long, default_value = "results")]
    pub results: PathBuf,
}

pub const DATA_BENCH_FILE: &str = "data_bench.jsonl";

#[derive(Serialize, Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Spread {
        if values.is_empty() {
            return Spread { mean: 0.0, min: 0.0, max: 0.0 };
        }
        Spread {
            mean: values.iter().sum::<f64>() / values.len() as f64,
            min: values.iter().copied().fold(f64::INFINITY, f64::min),
            max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }
}

#[derive(Serialize)]
struct DataBenchRecord {
    file: String,
    dataset: String,
    image_shape: [usize; 3],
    compression: String,
    chunk_rows: Option<usize>,
    ranks: usize,
    nodes: usize,
    batch: usize,
    steps: u64,
    warmup_steps: u64,
    /// Images read in the timed steps, all ranks together.
    images: u64,
    seconds: f64,
    images_per_sec_per_rank: Spread,
    images_per_sec_total: f64,
    mb_per_sec_total: f64,
    prefetch: usize,
    host: String,
    date: String,
    git_commit: String,
}

/// Steps to run: `--steps`, or `--epochs` (one by default) of the schedule.
pub fn total_steps(steps: Option<u64>, epochs: Option<u64>, schedule: &Schedule) -> u64 {
    steps.unwrap_or_else(|| epochs.unwrap_or(1) * schedule.steps_per_epoch())
}

/// Samples all workers read in steps `from..to` (global step numbers across epochs).
pub fn expected_samples(schedule: &Schedule, from: u64, to: u64) -> u64 {
    let spe = schedule.steps_per_epoch();
    (from..to).map(|g| schedule.global_samples(g % spe) as u64).sum()
}

pub fn run(world: &World, args: &DataBenchArgs) -> Result<()> {
    world.agree(if world.is_root() { results::check_writable(&args.results) } else { Ok(()) })?;
    let (info, labels) = world.agree(crate::data::layout::open(&args.file))?;
    let ranks = world.size as usize;
    let batch = args.batch_size as usize;
    if info.train.len < ranks * batch {
        world.agree::<()>(Err(Error::data(
            &args.file,
            format!("{} training samples, fewer than ranks x batch = {ranks} x {batch} = {}", info.train.len, ranks * batch),
        )))?;
    }
    let schedule = Schedule { samples: info.train.len, workers: ranks, worker: world.rank as usize, batch, seed: args.seed };
    let steps = total_steps(args.steps, args.epochs, &schedule);
    // Warm-up (opening the file, the first reads) is excluded; at least one step is timed.
    let warmup = args.warmup_steps.min(steps.saturating_sub(1));
    let sample_bytes = info.sample_bytes();
    let date = results::timestamp();

    // Start together, and only then read: batches read ahead while the others start up would
    // make the first timed steps look free.
    world.comm.barrier();
    let mut loader = Loader::spawn(args.file.clone(), Arc::new(labels.train), crate::data::loader::Parts::ALL, schedule, 0, steps, args.prefetch, false, tch::Device::Cpu); // the file's reads are what it measures
    let measured = (|| -> Result<(u64, f64)> {
        for _ in 0..warmup {
            loader.next()?;
        }
        let start = Instant::now();
        let mut images = 0u64;
        for _ in warmup..steps {
            let batch = loader.next()?;
            images += batch.samples() as u64;
        }
        Ok((images, start.elapsed().as_secs_f64()))
    })();
    drop(loader);
    // No collective runs inside the loop, so a rank that failed can be agreed on here.
    let (images, seconds) = world.agree(measured)?;

    let rate = if seconds > 0.0 { images as f64 / seconds } else { 0.0 };
    let mut rates = vec![0.0f64; ranks];
    world.comm.all_gather_into(&rate, &mut rates[..]);
    let all_images = world.sum_f64(images as f64) as u64;
    let slowest = world.max_f64(seconds);
    let expected = expected_samples(&schedule, warmup, steps);
    let per_rank = Spread::of(&rates);
    let total = if slowest > 0.0 { all_images as f64 / slowest } else { 0.0 };
    let mb_per_sec = total * sample_bytes as f64 / 1e6;

    if world.is_root() {
        let split = &info.train;
        let chunks = match split.chunk_rows {
            Some(rows) => format!("chunks of {rows} image(s)"),
            None => "contiguous".into(),
        };
        println!(
            "# hpc-train data bench: {} ({}, {}x{}x{} uint8, {sample_bytes} bytes per image, {chunks}, compression {}), {} training samples",
            args.file.display(), info.meta.name, info.meta.channels, info.meta.height, info.meta.width, split.compression, split.len
        );
        println!(
            "# {ranks} rank(s) on {} node(s), batch {batch} per rank, {} timed step(s) after {warmup} warm-up, loader prefetch {}, seed {}, {date}",
            world.nodes(), steps - warmup, args.prefetch, args.seed
        );
        println!("#");
        println!("# {:>6} {:>6} {:>7} {:>10} {:>10} {:>10} {:>10} {:>11} {:>9} {:>7}", "ranks", "batch", "steps", "images", "min", "mean", "max", "total", "total", "#wrong");
        println!("# {:>6} {:>6} {:>7} {:>10} {:>10} {:>10} {:>10} {:>11} {:>9} {:>7}", "", "", "", "", "(img/s)", "(img/s)", "(img/s)", "(img/s)", "(MB/s)", "");
        println!(
            "  {:>6} {:>6} {:>7} {:>10} {:>10.1} {:>10.1} {:>10.1} {:>11.1} {:>9.1} {:>7}",
            ranks, batch, steps - warmup, all_images, per_rank.min, per_rank.mean, per_rank.max, total, mb_per_sec,
            all_images.abs_diff(expected)
        );
        let record = DataBenchRecord {
            file: args.file.display().to_string(),
            dataset: info.meta.name.clone(),
            image_shape: [info.meta.channels, info.meta.height, info.meta.width],
            compression: split.compression.clone(),
            chunk_rows: split.chunk_rows,
            ranks,
            nodes: world.nodes() as usize,
            batch,
            steps: steps - warmup,
            warmup_steps: warmup,
            images: all_images,
            seconds: slowest,
            images_per_sec_per_rank: per_rank,
            images_per_sec_total: total,
            mb_per_sec_total: mb_per_sec,
            prefetch: args.prefetch,
            host: raw::hostname(),
            date,
            git_commit: results::GIT_COMMIT.into(),
        };
        let path = args.results.join(DATA_BENCH_FILE);
        world.agree(results::append_json_line(&path, &record))?;
        println!("# appended to {}", path.display());
    } else {
        world.agree(Ok(()))?;
    }
    world.agree(if all_images == expected {
        Ok(())
    } else {
        Err(Error::data(&args.file, format!("the ranks read {all_images} samples, the schedule assigns {expected}")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_of_rates() {
        assert_eq!(Spread::of(&[2.0, 4.0, 9.0]), Spread { mean: 5.0, min: 2.0, max: 9.0 });
        assert_eq!(Spread::of(&[]), Spread { mean: 0.0, min: 0.0, max: 0.0 });
    }

    #[test]
    fn expected_samples_cover_epochs_and_the_short_last_step() {
        // 10 samples, 3 workers x batch 2: steps of 6 and 4.
        let s = Schedule { samples: 10, workers: 3, worker: 0, batch: 2, seed: 1 };
        assert_eq!(total_steps(None, None, &s), 2);
        assert_eq!(total_steps(None, Some(3), &s), 6);
        assert_eq!(total_steps(Some(5), None, &s), 5);
        assert_eq!(expected_samples(&s, 0, 2), 10);
        assert_eq!(expected_samples(&s, 1, 5), 4 + 6 + 4 + 6);
    }
}
