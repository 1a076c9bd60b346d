//! Which samples each worker reads at each step, and a prefetch thread that reads them ahead.
//!
//! Every epoch has one shuffled order of the training set, the same on every rank (seeded by
//! the run's seed and the epoch). Worker `w` of `W` owns the positions `w, w + W, w + 2W, ...` of
//! that order, and at step `k` reads its positions `k*b .. (k+1)*b`. The union over the workers
//! at step `k` is then exactly the positions `k*G .. (k+1)*G` (G = W*b), the batch one process
//! with batch G would read, so data-parallel training computes the same thing. The last step of
//! an epoch takes what is left, so every sample is seen exactly once per epoch; a worker may get
//! fewer samples than the others, or none, at that step.
//!
//! A rank reads only the [`Parts`] of its samples it uses: a pipeline's first stage the images,
//! its last stage the labels, the stages between neither (they still learn which samples the
//! step takes, to size their micro-batches).

use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use tch::{Device, Tensor};

use crate::data::layout::Split;
use crate::data::reader::{SplitCache, SplitReader};
use crate::error::{Error, Result};
use crate::raw;

/// `--cache-data`: whether the training split is held in memory, read once ([`cache_decision`]).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheData {
    /// Cached when every rank of the node together needs at most a quarter of the memory
    /// available: reading a batch's samples one by one from HDF5 costs a thread that competes
    /// with backward for the cores (measured on the tiny CNN: results/pytorch_comparison.md).
    Auto,
    /// Cached; an error where the node's ranks together would need more than the memory
    /// available.
    On,
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Samples in the training set.
    pub samples: usize,
    pub workers: usize,
    pub worker: usize,
    /// Samples per worker per step.
    pub batch: usize,
    pub seed: u64,
}

impl Schedule {
    pub fn global_batch(&self) -> usize {
        self.batch * self.workers
    }

    pub fn steps_per_epoch(&self) -> u64 {
        self.samples.div_ceil(self.global_batch()) as u64
    }

    /// The shuffled order of the training set in `epoch`, the same on every rank.
    pub fn epoch_order(&self, epoch: u64) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.samples as u32).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(epoch);
        order.shuffle(&mut rng);
        order
    }

    /// The samples this worker reads at `step` of an epoch with `order`.
    pub fn local_indices(&self, order: &[u32], step: u64) -> Vec<usize> {
        let first = step as usize * self.batch;
        (first..first + self.batch)
            .map(|j| self.worker + j * self.workers)
            .take_while(|&pos| pos < order.len())
            .map(|pos| order[pos] as usize)
            .collect()
    }

    /// Samples read by all workers together at `step` of an epoch.
    pub fn global_samples(&self, step: u64) -> usize {
        let start = step as usize * self.global_batch();
        self.global_batch().min(self.samples.saturating_sub(start))
    }
}

/// Whether to hold the training split in memory (`--cache-data`): `split_bytes` per rank,
/// `ranks_on_node` copies on this node, `available` the node's available memory in bytes
/// (None where unknown: `auto` then reads from the file).
pub fn cache_decision(mode: CacheData, split_bytes: usize, ranks_on_node: usize, available: Option<u64>) -> Result<bool> {
    let needed = split_bytes as u64 * ranks_on_node as u64;
    match (mode, available) {
        (CacheData::Off, _) => Ok(false),
        (CacheData::Auto, None) => Ok(false),
        (CacheData::Auto, Some(free)) => Ok(needed <= free / 4),
        (CacheData::On, Some(free)) if needed > free => Err(Error::usage(format!(
            "--cache-data on: the training split ({:.1} MB) held by each of the {ranks_on_node} rank(s) on this node needs {:.1} MB, more than the {:.1} MB of memory available; use --cache-data off",
            split_bytes as f64 / 1e6,
            needed as f64 / 1e6,
            free as f64 / 1e6
        ))),
        (CacheData::On, _) => Ok(true),
    }
}

/// MemAvailable of /proc/meminfo, in bytes.
pub fn memory_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Which parts of its samples a rank reads. DeepSpeed builds its data iterator on a pipeline's
/// first and last stages only; here the first stage reads the images (and, holding the split
/// in memory, holds the images alone), the last the labels, and the stages between nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parts {
    pub images: bool,
    pub labels: bool,
}

impl Parts {
    /// Images and labels: a rank that runs the whole model (or a pipeline of one stage).
    pub const ALL: Parts = Parts { images: true, labels: true };

    /// The parts that stage `stage` uses: the first stage holds chunk 0, which takes the
    /// images; `loss_stage` holds the last chunk, which scores against the labels (the last
    /// stage; the first under ZB-V, whose chunks come back up).
    pub fn of_stage(stage: usize, loss_stage: usize) -> Parts {
        Parts { images: stage == 0, labels: stage == loss_stage }
    }
}

/// One worker's batch: which samples it takes, and the [`Parts`] of them the rank reads.
pub struct Batch {
    pub epoch: u64,
    /// Step within the epoch.
    pub step: u64,
    pub indices: Vec<usize>,
    /// The samples' bytes one after another, a flat uint8 host tensor: in pinned memory when
    /// training runs on a GPU, so that the copy there neither blocks nor needs a copy first.
    /// None where the rank does not read images.
    pub images: Option<Tensor>,
    /// None where the rank does not read labels.
    pub labels: Option<Vec<i64>>,
    /// Samples in the global batch this step (for scaling the loss).
    pub global_samples: usize,
}

impl Batch {
    /// The samples this worker takes at this step (whichever parts of them it reads).
    pub fn samples(&self) -> usize {
        self.indices.len()
    }

    /// The images of a rank that reads them (every rank outside a pipeline).
    pub fn images(&self) -> &Tensor {
        self.images.as_ref().expect("a rank that uses images reads them")
    }

    /// The labels of a rank that reads them (every rank outside a pipeline).
    pub fn labels(&self) -> &[i64] {
        self.labels.as_deref().expect("a rank that uses labels reads them")
    }

    /// Bytes of images and number of labels this batch read.
    pub fn read(&self) -> (usize, usize) {
        (self.images.as_ref().map_or(0, |t| t.numel()), self.labels.as_ref().map_or(0, Vec::len))
    }
}

/// Reads batches ahead of training in a thread of its own, so that reading overlaps compute.
pub struct Loader {
    rx: Receiver<Result<Batch>>,
    handle: Option<JoinHandle<()>>,
}

impl Loader {
    /// Starts reading at global step `first_step` (epoch * steps_per_epoch + step) and stops
    /// after `end_step`, keeping up to `depth` batches ready; only `parts` of the samples are
    /// read (`labels` are the split's, in memory, and may be left empty without `parts.labels`). `cache`: read the whole split's images into
    /// memory first and serve the batches from there (a rank that reads no images opens no
    /// file and holds nothing). For a GPU `device` the batches are read into pinned memory, as
    /// PyTorch's DataLoader(pin_memory=True) makes them, in this thread: pinning and copying a
    /// batch on the training thread left the GPU idle meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub fn spawn(
        path: PathBuf,
        labels: Arc<Vec<i64>>,
        parts: Parts,
        schedule: Schedule,
        first_step: u64,
        end_step: u64,
        depth: usize,
        cache: bool,
        device: Device,
    ) -> Loader {
        let (tx, rx) = sync_channel(depth.max(1));
        let handle = std::thread::Builder::new()
            .name("loader".into())
            .spawn(move || {
                // Pinned memory belongs to the context of the thread's current device: this
                // rank's GPU, not GPU 0.
                if let Err(e) = raw::set_cuda_device(device) {
                    let _ = tx.send(Err(e));
                    return;
                }
                let mut reader = match parts.images.then(|| SplitReader::open(&path, Split::Train)).transpose() {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let cached = match (&mut reader, cache) {
                    (Some(reader), true) => match SplitCache::load(reader) {
                        Ok(c) => Some(c),
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return;
                        }
                    },
                    _ => None,
                };
                let spe = schedule.steps_per_epoch();
                let mut order: Option<(u64, Vec<u32>)> = None;
                for global in first_step..end_step {
                    let (epoch, step) = (global / spe, global % spe);
                    if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                        order = Some((epoch, schedule.epoch_order(epoch)));
                    }
                    let indices = schedule.local_indices(&order.as_ref().unwrap().1, step);
                    let images = reader
                        .as_mut()
                        .map(|reader| {
                            raw::host_bytes(indices.len() * reader.sample_bytes(), device.is_cuda(), |bytes| match &cached {
                                Some(c) => c.read(&indices, bytes),
                                None => reader.read(&indices, bytes),
                            })
                        })
                        .transpose();
                    let batch = images.map(|images| Batch {
                        epoch,
                        step,
                        labels: parts.labels.then(|| indices.iter().map(|&i| labels[i]).collect()),
                        indices,
                        images,
                        global_samples: schedule.global_samples(step),
                    });
                    let failed = batch.is_err();
                    if tx.send(batch).is_err() || failed {
                        return; // training stopped, or reading failed and said so
                    }
                }
            })
            .expect("spawning the loader thread");
        Loader { rx, handle: Some(handle) }
    }

    /// The next batch, waiting for the reader if it is behind.
    pub fn next(&mut self) -> Result<Batch> {
        match self.rx.recv() {
            Ok(batch) => batch,
            Err(_) => Err(Error::Results("the data loader stopped before the end of training".into())),
        }
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // Unblock the thread (its next send fails once the receiver is gone), then join it.
        let (_, dead) = sync_channel(1);
        drop(std::mem::replace(&mut self.rx, dead));
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_is_cached_where_the_node_has_memory_for_it() {
        let gb = 1u64 << 30;
        assert!(cache_decision(CacheData::Auto, 1 << 20, 4, Some(gb)).unwrap());
        assert!(!cache_decision(CacheData::Auto, (gb / 8) as usize, 4, Some(gb)).unwrap(), "4 x 1/8 > 1/4 of the memory");
        assert!(!cache_decision(CacheData::Auto, 1, 1, None).unwrap(), "unknown memory: read from the file");
        assert!(!cache_decision(CacheData::Off, 1, 1, Some(gb)).unwrap());
        assert!(cache_decision(CacheData::On, (gb / 8) as usize, 4, Some(gb)).unwrap());
        assert!(cache_decision(CacheData::On, 1, 1, None).unwrap());
        let err = cache_decision(CacheData::On, (gb / 2) as usize, 4, Some(gb)).unwrap_err().to_string();
        assert!(err.contains("--cache-data on") && err.contains("4 rank(s)"), "{err}");
        assert!(memory_available().is_some_and(|b| b > 0));
    }

    /// Every batch, from the file or from the cache, holds the bytes the reader gives for its
    /// samples, in their order, as a flat uint8 host tensor; a worker's empty last batch too.
    #[test]
    fn batches_hold_the_bytes_of_their_samples() {
        use crate::data::synth::{generate, SynthSpec};
        let dir = std::env::temp_dir().join(format!("hpc-train-loader-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("loader.h5");
        generate(&SynthSpec { train: 8, test: 2, shape: [2, 3, 4], classes: 3, seed: 5 }, &path, crate::data::writer::Compression::None, true).unwrap();
        let mut reader = SplitReader::open(&path, Split::Train).unwrap();
        let row = reader.sample_bytes();
        let labels: Arc<Vec<i64>> = Arc::new((0..8).map(|i| i * 10).collect());
        // Worker 2 of 3 with 2 per step: 8 samples make 2 steps, the second one empty for it.
        let schedule = schedule(8, 3, 2, 2);
        for cache in [false, true] {
            let mut loader = Loader::spawn(path.clone(), labels.clone(), Parts::ALL, schedule, 0, 4, 2, cache, Device::Cpu);
            for global in 0..4u64 {
                let batch = loader.next().unwrap();
                assert_eq!((batch.epoch, batch.step), (global / 2, global % 2));
                let expected_indices = schedule.local_indices(&schedule.epoch_order(batch.epoch), batch.step);
                assert_eq!(batch.indices, expected_indices);
                assert_eq!(batch.labels(), expected_indices.iter().map(|&i| i as i64 * 10).collect::<Vec<_>>());
                let mut expected = vec![0u8; expected_indices.len() * row];
                reader.read(&expected_indices, &mut expected).unwrap();
                let images = batch.images();
                assert_eq!((images.kind(), images.device(), images.size()), (tch::Kind::Uint8, Device::Cpu, vec![expected.len() as i64]));
                assert_eq!(Vec::<u8>::try_from(images).unwrap(), expected, "cache {cache}, step {global}");
                assert_eq!(batch.read(), (expected.len(), expected_indices.len()));
                assert_eq!(batch.indices.is_empty(), global % 2 == 1, "the second step of an epoch leaves worker 2 nothing");
            }
            assert!(loader.next().is_err(), "nothing after the last step");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A rank that reads no images opens no file (a path that does not exist serves it), with
    /// the cache asked for or not; each part comes alone, for the same samples in the same order.
    #[test]
    fn a_rank_reads_only_its_parts() {
        let labels: Arc<Vec<i64>> = Arc::new((0..8).map(|i| i * 10).collect());
        let schedule = schedule(8, 2, 1, 3);
        let nowhere = std::env::temp_dir().join(format!("hpc-train-loader-nowhere-{}.h5", std::process::id()));
        for (parts, cache) in [(Parts::of_stage(1, 1), true), (Parts::of_stage(1, 2), true), (Parts::of_stage(2, 2), false)] {
            let mut loader = Loader::spawn(nowhere.clone(), labels.clone(), parts, schedule, 0, 3, 2, cache, Device::Cpu);
            for global in 0..3u64 {
                let batch = loader.next().unwrap_or_else(|e| panic!("{parts:?}: {e}"));
                let spe = schedule.steps_per_epoch();
                let expected = schedule.local_indices(&schedule.epoch_order(global / spe), global % spe);
                assert_eq!(batch.indices, expected, "{parts:?}");
                assert!(batch.images.is_none(), "{parts:?}");
                assert_eq!(batch.labels, parts.labels.then(|| expected.iter().map(|&i| i as i64 * 10).collect::<Vec<_>>()), "{parts:?}");
                assert_eq!(batch.read(), (0, if parts.labels { expected.len() } else { 0 }));
            }
        }
        assert_eq!(Parts::of_stage(0, 0), Parts::ALL);
        assert_eq!(Parts::of_stage(0, 2), Parts { images: true, labels: false });
        assert_eq!((Parts::of_stage(1, 2), Parts::of_stage(2, 2)), (Parts { images: false, labels: false }, Parts { images: false, labels: true }));
    }

    fn schedule(samples: usize, workers: usize, worker: usize, batch: usize) -> Schedule {
        Schedule { samples, workers, worker, batch, seed: 7 }
    }

    #[test]
    fn every_sample_once_per_epoch_for_uneven_counts() {
        for (samples, workers, batch) in [(10, 3, 2), (17, 4, 3), (5, 5, 1), (7, 2, 10), (1, 3, 1)] {
            let order = schedule(samples, workers, 0, batch).epoch_order(3);
            let mut seen = vec![0; samples];
            let steps = schedule(samples, workers, 0, batch).steps_per_epoch();
            for w in 0..workers {
                let s = schedule(samples, workers, w, batch);
                for step in 0..steps {
                    for i in s.local_indices(&order, step) {
                        seen[i] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "samples {samples} workers {workers} batch {batch}: {seen:?}");
        }
    }

    #[test]
    fn workers_together_read_what_one_process_with_the_global_batch_reads() {
        let (samples, workers, batch) = (23, 3, 2);
        let single = schedule(samples, 1, 0, workers * batch);
        let order = single.epoch_order(0);
        for step in 0..single.steps_per_epoch() {
            let mut one: Vec<usize> = single.local_indices(&order, step);
            let mut many: Vec<usize> = (0..workers)
                .flat_map(|w| schedule(samples, workers, w, batch).local_indices(&order, step))
                .collect();
            assert_eq!(many.len(), single.global_samples(step));
            one.sort();
            many.sort();
            assert_eq!(one, many);
        }
    }

    #[test]
    fn orders_depend_on_seed_and_epoch_only() {
        let a = schedule(100, 4, 0, 2);
        let b = schedule(100, 4, 3, 8);
        assert_eq!(a.epoch_order(1), b.epoch_order(1));
        assert_ne!(a.epoch_order(1), a.epoch_order(2));
        let mut sorted = a.epoch_order(5);
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<u32>>());
    }
}
