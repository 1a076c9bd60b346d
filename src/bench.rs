//! `hpc-train bench`: the gradient exchange alone, over a sweep of message sizes, in the manner
//! of nccl-tests: one row per size and strategy with time, algorithm bandwidth, bus bandwidth
//! and the number of wrong elements (every rank checks every run).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use mpi::collective::SystemOperation;
use mpi::traits::*;
use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::element::Dtype;
use crate::error::{Error, Result};
use crate::exchange::config::parse_strategies;
use crate::exchange::options::{check_strategy_options, ExchangeArgs, Given, HorovodArgs, PsArgs, WatchdogArgs};
use crate::exchange::{self, ExchangeConfig, Reduce, ReduceOp, StrategyKind};
use crate::raw;
use crate::results;
use crate::topology::World;
use crate::train::options::DeviceChoice;

/// `--device` of the bench: where the buffers live.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchDevice {
    Cpu,
    Cuda,
}

/// `--layout`: how the buffer is cut into tensors.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The buffer is one tensor.
    Single,
    /// The buffer is split into 161 tensors in the proportions of ResNet-50's parameters.
    Resnet50,
}

/// `--verify`: how every run's result is checked.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verify {
    /// Small-integer input whose sum is exact in any order: compared with the closed form.
    ClosedForm,
    /// Random input: compared with MPI_Allreduce's result, within summation-order rounding.
    Allreduce,
}

/// A count of at least 1.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("expected at least 1 (with none there is nothing to time)".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("expected a count: {e}")),
    }
}

/// Options of `hpc-train bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Strategies to measure, comma-separated.
    #[arg(long, default_value = "ring,allreduce", help_heading = "Sweep")]
    pub strategies: String,
    /// Smallest message (bytes; K, M, G suffixes).
    #[arg(long, default_value = "4K", help_heading = "Sweep")]
    pub min_bytes: String,
    /// Largest message.
    #[arg(long, default_value = "256M", help_heading = "Sweep")]
    pub max_bytes: String,
    /// Size multiplier between rows.
    #[arg(long, default_value_t = 2, help_heading = "Sweep")]
    pub factor: usize,
    /// Exact element counts instead of the sweep, comma-separated.
    #[arg(long, value_delimiter = ',', help_heading = "Sweep")]
    pub counts: Option<Vec<usize>>,
    /// Timed iterations per size (at least 1: a row of no iterations would record a time of 0).
    #[arg(long, default_value_t = 20, value_parser = at_least_one, help_heading = "Sweep")]
    pub iters: usize,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 5, help_heading = "Sweep")]
    pub warmup: usize,
    /// Sweeps over all strategies, each starting one strategy later than the one before; each
    /// row is the median of every round's timed iterations. On a shared or drifting machine,
    /// no strategy is then always the one measured first.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1000), help_heading = "Sweep")]
    pub rounds: u16,
    /// Where the buffers live.
    #[arg(long, value_enum, default_value_t = BenchDevice::Cpu, help_heading = "Sweep")]
    pub device: BenchDevice,
    /// Element type.
    #[arg(long, value_enum, default_value_t = Dtype::F32, help_heading = "Sweep")]
    pub dtype: Dtype,
    /// One tensor, or ResNet-50's 161 tensors.
    #[arg(long, value_enum, default_value_t = Layout::Single, help_heading = "Sweep")]
    pub layout: Layout,
    /// How results are checked.
    #[arg(long, value_enum, default_value_t = Verify::ClosedForm, help_heading = "Sweep")]
    pub verify: Verify,
    /// Seed of the random input (--verify allreduce).
    #[arg(long, default_value_t = 1, help_heading = "Sweep")]
    pub seed: u64,
    #[command(flatten, next_help_heading = "Exchange")]
    pub exchange: ExchangeArgs,
    #[command(flatten, next_help_heading = "Exchange")]
    pub watchdog: WatchdogArgs,
    /// Folder for bench.jsonl.
    #[arg(long, default_value = "results", help_heading = "Output")]
    pub results: PathBuf,
    /// Change one element of rank 0's result before the check (tests that the check works).
    #[arg(long, hide = true, help_heading = "Output")]
    pub corrupt_result: bool,
    /// Write rank 0's summed buffers, every strategy and size in turn (as f32, little-endian,
    /// after the last iteration), to this file: for comparing two runs bit for bit.
    #[arg(long, help_heading = "Output")]
    pub save_result: Option<PathBuf>,
    /// The rate of the links between nodes, in Mbit/s, recorded in bench.jsonl for
    /// `hpc-train model fit` (the bench cannot measure it apart from the exchange).
    #[arg(long, help_heading = "Exchange")]
    pub link_mbit: Option<f64>,

    #[command(flatten, next_help_heading = "Parameter server")]
    pub ps: PsArgs,

    #[command(flatten, next_help_heading = "Horovod")]
    pub horovod: HorovodArgs,

    /// The options given on the command line.
    #[arg(skip)]
    pub given: Given,
}

pub const BENCH_FILE: &str = "bench.jsonl";

/// Parameter tensor sizes of torchvision's ResNet-50 (161 tensors, 25,557,032 elements), in
/// creation order: the many-small-tensors case of a real gradient exchange.
pub fn resnet50_sizes() -> Vec<usize> {
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let spec = crate::model::InputSpec { channels: 3, height: 224, width: 224, classes: 1000 };
    let (_model, variables) = crate::model::declare(crate::model::ModelKind::Resnet50, &vs.root(), spec);
    variables.iter().filter(|v| v.trainable).map(crate::model::Variable::numel).collect()
}

/// Splits `count` elements into tensors in the proportions of `weights` (at least one element
/// each where the count allows, the remainder on the largest).
pub fn split_by_weights(count: usize, weights: &[usize]) -> Vec<usize> {
    if count == 0 || weights.is_empty() {
        return vec![count];
    }
    let total: usize = weights.iter().sum();
    let mut sizes: Vec<usize> = weights.iter().map(|&w| (count as u128 * w as u128 / total as u128) as usize).collect();
    let assigned: usize = sizes.iter().sum();
    let largest = (0..sizes.len()).max_by_key(|&i| weights[i]).unwrap();
    sizes[largest] += count - assigned;
    sizes.retain(|&s| s > 0);
    sizes
}

/// The sizes of the sweep, in elements.
pub fn sweep_counts(args: &BenchArgs, elem: usize) -> Result<Vec<usize>> {
    if let Some(list) = &args.counts {
        return Ok(list.clone());
    }
    if args.factor < 2 {
        return Err(Error::usage("--factor must be at least 2"));
    }
    let (min, max) = (parse_bytes(&args.min_bytes)?, parse_bytes(&args.max_bytes)?);
    if min > max {
        return Err(Error::usage(format!("--min-bytes {} is larger than --max-bytes {}", args.min_bytes, args.max_bytes)));
    }
    let mut out = Vec::new();
    let mut bytes = min.max(elem);
    while bytes <= max {
        out.push(bytes / elem);
        bytes *= args.factor;
    }
    Ok(out)
}

/// Parses sizes such as `4096`, `4K`, `256M`, `1G` (binary units).
pub fn parse_bytes(s: &str) -> Result<usize> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let mult = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'B' => 1,
                _ => return Err(Error::usage(format!("{s:?}: unknown unit (use K, M or G)"))),
            };
            (&t[..i], mult)
        }
        _ => (t, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|_| Error::usage(format!("{s:?}: expected a size in bytes such as 4096, 4K or 256M")))
}

/// Known input: small integers, so that every partial sum is exact in f32, f16 and bf16 and the
/// result has a closed form whatever the reduction order.
fn exact_value(rank: usize, i: usize) -> f32 {
    (1 + (i + rank) % 3) as f32
}

fn exact_sum(ranks: &[usize], i: usize) -> f32 {
    ranks.iter().map(|&r| exact_value(r, i)).sum()
}

#[derive(Serialize)]
struct BenchRow {
    size: usize,
    count: usize,
    #[serde(rename = "type")]
    dtype: &'static str,
    strategy: String,
    tensors: usize,
    layout: String,
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: u64,
    ranks: usize,
    nodes: usize,
    device: String,
    iters: usize,
    /// Sweeps over every strategy whose iterations the row's median pools (--rounds).
    rounds: usize,
    host: String,
    mpi_library: String,
    git_commit: String,
    date: String,
    /// The ring's bus bandwidth bound from this machine's memory bandwidth (see MemoryBound),
    /// measured in the same run: host f32 runs only.
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_bound_busbw: Option<f64>,
    /// The copy and add rates behind that bound, each core's with every rank at work (the cost
    /// model's gamma comes from the add rate). Rows written before 2026-11-24 hold rank 0's
    /// rates measured alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_copy_gbs: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_add_gbs: Option<f64>,
    /// The same bound with MPI's measured point-to-point rate in place of the copy rate, and
    /// that rate (see MemoryBound::transport_gbs).
    #[serde(skip_serializing_if = "Option::is_none")]
    transport_bound_busbw: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    transport_gbs: Option<f64>,
    /// The network links' rate when the run says it (--link-mbit), for fitting the cost model
    /// per link.
    #[serde(skip_serializing_if = "Option::is_none")]
    link_mbit: Option<f64>,
    /// How the ring moved its chunks (ring and auto rows): "shared-memory" or "mpi".
    #[serde(skip_serializing_if = "Option::is_none")]
    ring_transport: Option<String>,
    /// Where the strategy's bytes went between the device and MPI: "host" (a CPU rank),
    /// "staged" (GPU buffers through pinned host copies) or "direct" (GPU buffers handed to a
    /// CUDA-aware MPI), as runs.jsonl says it; absent where the strategy does not say.
    #[serde(skip_serializing_if = "Option::is_none")]
    data_path: Option<String>,
    /// Horovod-style rows: whether the all-reduce was hierarchical (node, nodes, node).
    #[serde(skip_serializing_if = "Option::is_none")]
    hierarchical: Option<bool>,
}

/// What one core's memory bandwidth allows an all-reduce on host memory: every rank receives
/// (copies) 2(n-1)/n of the buffer and adds (n-1)/n of it into its own, so a ring can take no
/// less than 2(n-1)/n S / copy + (n-1)/n S / add, i.e. a bus bandwidth of at most
/// 2 / (2 / copy + 1 / add). Measured on every rank at once over buffers of the bench's largest
/// size (256 MiB at most), the slowest rank's rates, since the ranks of an all-reduce copy and
/// add at the same time and share the node's memory system (a core measured alone while the
/// others wait copies faster than any of them can during the all-reduce); the same bound with
/// MPI's measured transfer rate as the copy is the transport bound.
#[derive(Clone, Copy, Debug)]
struct MemoryBound {
    copy_gbs: f64,
    add_gbs: f64,
    /// What one rank receives per second by MPI point-to-point while every rank sends to its
    /// right and receives from its left at once (a ring hop): the copy rate MPI's transport
    /// really reaches (Open MPI's CMA copies in the kernel, below a user-space memcpy).
    transport_gbs: f64,
}

/// How long the transport rate's repetitions may take before the measurement keeps what it has
/// (one at the least). A hop takes milliseconds where each rank has a core; on ranks that
/// share cores MPICH polls without yielding, and 5 ranks on 2 cores took 0.7 s a hop, 4.4 s
/// of a 6.8 s bench whose rows took a fraction of a second.
const TRANSPORT_BUDGET: Duration = Duration::from_millis(250);

impl MemoryBound {
    /// This rank's copy and add rates over `bytes`, every rank of `world` copying (then adding)
    /// at the same time.
    fn measure_memory(world: &World, bytes: usize) -> (f64, f64) {
        let len = (bytes / 4).max(1024);
        let src: Vec<f32> = (0..len).map(|i| (i % 1000) as f32).collect();
        let mut dst = vec![1.0f32; len];
        let mut copies = Vec::new();
        let mut adds = Vec::new();
        let together = || crate::watchdog::collective("measuring the memory bound", &world.comm, || world.comm.barrier());
        for _ in 0..5 {
            together();
            let t = Instant::now();
            dst.copy_from_slice(&src);
            copies.push(t.elapsed().as_secs_f64());
            together();
            let t = Instant::now();
            crate::element::accumulate(&mut dst, &src);
            adds.push(t.elapsed().as_secs_f64());
        }
        std::hint::black_box(&dst);
        let gbs = |t: f64| (len * 4) as f64 / t / 1e9;
        (gbs(median(&mut copies)), gbs(median(&mut adds)))
    }

    /// The transport rate: every rank sends `bytes` to its right and receives as many from its
    /// left, in messages of `message` bytes (the ring's segments) one after another, six times
    /// (fewer past [`TRANSPORT_BUDGET`]); the median of the slowest rank's times, the first left
    /// out (it maps the pages) unless it is the only one.
    fn measure_transport(world: &World, bytes: usize, message: usize) -> f64 {
        let (n, rank) = (world.size, world.rank);
        let len = (bytes / 4).max(1024);
        let piece = (message / 4).clamp(1, len);
        let out = vec![1.0f32; len];
        let mut into = vec![0.0f32; len];
        let (right, left) = (world.comm.process_at_rank((rank + 1) % n), world.comm.process_at_rank((rank + n - 1) % n));
        let mut times = Vec::new();
        for _ in 0..6 {
            crate::watchdog::collective("measuring MPI's transport", &world.comm, || {
                world.comm.barrier();
                let t = Instant::now();
                for (send, receive) in out.chunks(piece).zip(into.chunks_mut(piece)) {
                    mpi::point_to_point::send_receive_into(send, &right, receive, &left);
                }
                let mine = t.elapsed().as_secs_f64();
                let mut slowest = 0.0f64;
                world.comm.all_reduce_into(&mine, &mut slowest, mpi::collective::SystemOperation::max());
                times.push(slowest);
            });
            // Every rank holds the same slowest times, so every rank stops at the same turn.
            if times.iter().sum::<f64>() > TRANSPORT_BUDGET.as_secs_f64() {
                break;
            }
        }
        if times.len() > 1 {
            times.remove(0);
        }
        (len * 4) as f64 / median(&mut times) / 1e9
    }

    /// Both rates, memory then transport, on every rank at once over the bench's largest buffer
    /// (`max_bytes`), the transport in `segment` messages.
    fn measure(world: &World, max_bytes: usize, segment: usize) -> MemoryBound {
        let n = world.size as usize;
        // Every rank holds two such buffers beside the bench's own: at most 256 MiB each, far
        // beyond any cache, so the rates are memory's whatever the largest size.
        let (copy, add) = MemoryBound::measure_memory(world, max_bytes.clamp(1 << 20, 256 << 20));
        let mut rates = [0.0f64; 2];
        crate::watchdog::collective("taking the slowest rank's memory rates", &world.comm, || {
            world.comm.all_reduce_into(&[copy, add][..], &mut rates[..], mpi::collective::SystemOperation::min())
        });
        // A ring hop at the largest size, in the ring's segments.
        let transport_gbs = MemoryBound::measure_transport(world, (max_bytes / n).max(1 << 20), segment);
        MemoryBound { copy_gbs: rates[0], add_gbs: rates[1], transport_gbs }
    }

    /// Each rate's median over the rounds (None without any).
    fn median(rounds: &[MemoryBound]) -> Option<MemoryBound> {
        if rounds.is_empty() {
            return None;
        }
        let of = |f: fn(&MemoryBound) -> f64| median(&mut rounds.iter().map(f).collect::<Vec<_>>());
        Some(MemoryBound { copy_gbs: of(|b| b.copy_gbs), add_gbs: of(|b| b.add_gbs), transport_gbs: of(|b| b.transport_gbs) })
    }

    /// The bound on busbw (see above).
    fn ring_busbw(&self) -> f64 {
        2.0 / (2.0 / self.copy_gbs + 1.0 / self.add_gbs)
    }

    /// The same with the copies at the transport's rate.
    fn transport_busbw(&self) -> f64 {
        2.0 / (2.0 / self.transport_gbs + 1.0 / self.add_gbs)
    }
}

pub fn run(world: &World, args: &BenchArgs) -> Result<()> {
    let strategies = world.agree(parse_strategies(&args.strategies))?;
    world.log_warnings(&world.agree(check_strategy_options(&args.given, &strategies, &args.ps))?);
    world.agree(args.exchange.check())?;
    let elem = args.dtype.size();
    let counts = world.agree(sweep_counts(args, elem))?;
    // The node's ranks may share a GPU here (the bench measures the exchange, and tests run
    // several ranks on one GPU); each takes the GPU that training would give it.
    let choice = match args.device {
        BenchDevice::Cpu => DeviceChoice::Cpu,
        BenchDevice::Cuda => DeviceChoice::Cuda,
    };
    let device = world.agree(crate::train::choose_device(choice, true, world))?;
    world.agree(crate::train::make_current(device))?;
    crate::watchdog::start(world.rank, world.agree(crate::train::watchdog_timeout(args.watchdog.exchange_timeout_s))?);
    world.agree(if world.is_root() { results::check_writable(&args.results) } else { Ok(()) })?;
    world.agree(match (&args.save_result, world.is_root()) {
        (Some(path), true) => std::fs::File::create(path).map(drop).map_err(|e| Error::io(path, e)),
        _ => Ok(()),
    })?;
    let weights = match args.layout {
        Layout::Single => Vec::new(),
        Layout::Resnet50 => resnet50_sizes(),
    };
    let n = world.size as usize;
    let mpi_library = crate::train::mpi_library();
    let date = results::timestamp();
    let config = ExchangeConfig {
        device,
        cuda_aware: args.exchange.cuda_aware.resolve(),
        bucket_bytes: args.exchange.bucket_bytes(),
        segment_bytes: args.exchange.segment_bytes(),
        ring_transport: args.exchange.ring_transport,
        // The parameter server's benchmark round sums; its optimizer is not used.
        ps: args.ps.config(crate::optim::OptimizerConfig::sgd(0.0, 0.0, 0.0), crate::optim::LrSchedule::constant(0.0)),
        horovod: world.agree(args.horovod.config())?,
        mpi_allreduce: args.exchange.mpi_allreduce,
        cost_model: world.agree(crate::cost::CostModel::from_option(args.exchange.cost_model.as_deref()))?,
        zero: 0,
        fsdp_hybrid: false,
    };

    let is_host_f32 = device == Device::Cpu && args.dtype == Dtype::F32 && n > 1;
    let max_bytes = counts.iter().max().copied().unwrap_or(0) * elem;
    if world.is_root() {
        let rounds = if args.rounds > 1 { format!(", {} rounds in rotated order", args.rounds) } else { String::new() };
        println!(
            "# hpc-train bench: {n} rank(s) on {} node(s), {mpi_library}, device {}, {} {}, layout {}, median of {} iterations after {} warm-up{rounds}, {date}",
            world.nodes(), device_label(device), args.dtype.name(), if config.cuda_aware { "(CUDA-aware MPI)" } else { "" },
            layout_name(args.layout), args.iters, args.warmup
        );
    }
    // Every round measures the bounds and then every strategy, starting one strategy later than
    // the round before: on a machine whose speed drifts (a shared VM), no strategy always runs
    // first or last, and each row is the median over all rounds' timed iterations.
    let k = strategies.len();
    let mut samples: Vec<Vec<SizeSample>> = vec![vec![SizeSample::default(); counts.len()]; k];
    let mut bounds: Vec<MemoryBound> = Vec::new();
    for round in 0..usize::from(args.rounds) {
        if is_host_f32 {
            bounds.push(MemoryBound::measure(world, max_bytes, args.exchange.segment_bytes()));
        }
        for index in (0..k).map(|i| (i + round) % k) {
            let measured = measure_strategy(world, strategies[index], &config, &counts, &weights, args, device)?;
            for (sample, new) in samples[index].iter_mut().zip(measured) {
                sample.add_round(new);
            }
            // The table comes once every round is in: say how far the sweep has got meanwhile.
            if world.is_root() {
                log::info!("round {} of {}: {} measured", round + 1, args.rounds, strategies[index].name());
            }
        }
    }
    let bound = MemoryBound::median(&bounds);

    if world.is_root() {
        println!("#");
        println!("# {:>12} {:>12} {:>8} {:>10} {:>7} {:>11} {:>9} {:>9} {:>7}", "size", "count", "type", "strategy", "tensors", "time", "algbw", "busbw", "#wrong");
        println!("# {:>12} {:>12} {:>8} {:>10} {:>7} {:>11} {:>9} {:>9} {:>7}", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "");
    }
    let mut busbw_sums = vec![(0.0f64, 0usize); k];
    let mut total_wrong = 0u64;
    for (index, &strategy) in strategies.iter().enumerate() {
        for (&count, sample) in counts.iter().zip(&mut samples[index]) {
            total_wrong += sample.wrong;
            let time = median(&mut sample.times);
            let bytes = count * elem;
            let algbw = if time > 0.0 { bytes as f64 / time / 1e9 } else { 0.0 };
            let busbw = algbw * sample.bus_factor;
            if bytes > 0 {
                busbw_sums[index].0 += busbw;
                busbw_sums[index].1 += 1;
            }
            if !world.is_root() {
                continue;
            }
            println!(
                "  {:>12} {:>12} {:>8} {:>10} {:>7} {:>11.2} {:>9.3} {:>9.3} {:>7}",
                bytes, count, args.dtype.name(), strategy.name(), sample.tensors, time * 1e6, algbw, busbw, sample.wrong
            );
            let row = BenchRow {
                size: bytes,
                count,
                dtype: args.dtype.name(),
                strategy: strategy.name().into(),
                tensors: sample.tensors,
                layout: layout_name(args.layout).into(),
                time_us: time * 1e6,
                algbw,
                busbw,
                wrong: sample.wrong,
                ranks: n,
                nodes: world.nodes() as usize,
                device: device_label(device),
                iters: args.iters,
                rounds: usize::from(args.rounds),
                host: raw::hostname(),
                mpi_library: mpi_library.clone(),
                git_commit: results::GIT_COMMIT.into(),
                date: date.clone(),
                memory_bound_busbw: bound.map(|b| b.ring_busbw()),
                memory_copy_gbs: bound.map(|b| b.copy_gbs),
                memory_add_gbs: bound.map(|b| b.add_gbs),
                transport_bound_busbw: bound.map(|b| b.transport_busbw()),
                transport_gbs: bound.map(|b| b.transport_gbs),
                link_mbit: args.link_mbit,
                ring_transport: sample.ring_transport.clone(),
                data_path: sample.data_path.clone(),
                hierarchical: sample.hierarchical,
            };
            results::append_json_line(&args.results.join(BENCH_FILE), &row)?;
            if sample.wrong > 0 {
                log::error!("{}: {} wrong element(s) at {count} elements", strategy.name(), sample.wrong);
            }
        }
    }
    if world.is_root() {
        println!("# Out of bounds values : see #wrong (every rank checks every element)");
        for (strategy, (sum, rows)) in strategies.iter().zip(&busbw_sums) {
            println!("# Avg bus bandwidth    : {:>10} {:.3} GB/s", strategy.name(), if *rows > 0 { sum / *rows as f64 } else { 0.0 });
        }
        if let Some(b) = bound {
            let of_rounds = if bounds.len() > 1 { format!(" (medians of {} rounds)", bounds.len()) } else { String::new() };
            println!(
                "# Memory bound         : each core copies {:.2} GB/s and adds {:.2} GB/s, every rank at once{of_rounds}: a host all-reduce's busbw is at most {:.3} GB/s",
                b.copy_gbs, b.add_gbs, b.ring_busbw()
            );
            println!(
                "# Transport bound      : MPI point-to-point moves {:.2} GB/s per rank ({} KiB messages, every rank sending to its right at once): with the add, busbw is at most {:.3} GB/s",
                b.transport_gbs,
                args.exchange.segment_kb,
                b.transport_busbw()
            );
        }
        println!("# appended to {}", args.results.join(BENCH_FILE).display());
    }
    // Any wrong element fails the run (after the table, so the figures are still seen).
    world.agree(if total_wrong > 0 {
        Err(Error::exchange("bench", format!("{total_wrong} wrong element(s) in all: a strategy computed a wrong sum")))
    } else {
        Ok(())
    })
}

/// One strategy's timings and checks at one size, in one round.
#[derive(Clone, Debug, Default)]
struct SizeSample {
    /// The slowest rank's time of each timed iteration, in seconds.
    times: Vec<f64>,
    /// Elements wrong on any rank, summed over the ranks.
    wrong: u64,
    tensors: usize,
    bus_factor: f64,
    ring_transport: Option<String>,
    data_path: Option<String>,
    hierarchical: Option<bool>,
}

impl SizeSample {
    /// Pools another round's iterations and wrong elements into this one.
    fn add_round(&mut self, round: SizeSample) {
        self.times.extend(round.times);
        self.wrong += round.wrong;
        self.tensors = round.tensors;
        self.bus_factor = round.bus_factor;
        self.ring_transport = round.ring_transport;
        self.data_path = round.data_path;
        self.hierarchical = round.hierarchical;
    }
}

/// One strategy over every size: made just before and finished just after, so that a
/// strategy's background thread (Horovod's cycle) never takes the cores while another is
/// measured.
fn measure_strategy(
    world: &World,
    strategy: StrategyKind,
    config: &ExchangeConfig,
    counts: &[usize],
    weights: &[usize],
    args: &BenchArgs,
    device: Device,
) -> Result<Vec<SizeSample>> {
    let (n, rank) = (world.size as usize, world.rank as usize);
    let kind = args.dtype.kind();
    // The bench measures the collective alone.
    let mut exchange: Box<dyn Reduce> = world.agree(exchange::build(strategy, world, config))?;
    // The ranks whose buffers count in the sum (not dedicated servers').
    let mine = u8::from(exchange.contributes());
    let mut flags = vec![0u8; n];
    world.comm.all_gather_into(&mine, &mut flags[..]);
    let contributors: Vec<usize> = (0..n).filter(|&r| flags[r] == 1).collect();
    let mut samples = Vec::with_capacity(counts.len());
    for &count in counts {
        let sizes = if weights.is_empty() { vec![count] } else { split_by_weights(count, weights) };
        // The input each run starts from, and the expected result.
        let pristine: Vec<Tensor> = input_tensors(&sizes, rank, args.verify, args.seed, kind, device)?;
        world.agree(exchange.prepare(&pristine))?;
        let reference = mpi_reference(world, &pristine, &contributors, args.verify)?;
        let mut tensors: Vec<Tensor> = pristine.iter().map(|t| t.copy()).collect();
        let mut times: Vec<f64> = Vec::with_capacity(args.iters);
        for iter in 0..args.warmup + args.iters {
            for (t, p) in tensors.iter_mut().zip(&pristine) {
                t.f_copy_(p)?;
            }
            exchange::staging::synchronize_device(device);
            crate::watchdog::collective("the barrier before a timed exchange", &world.comm, || world.comm.barrier());
            let start = Instant::now();
            {
                let _watched = crate::watchdog::exchange(exchange.name(), || exchange.waits_for());
                exchange.all_reduce(&mut tensors, ReduceOp::Sum)?;
            }
            exchange::staging::synchronize_device(device);
            let local = start.elapsed().as_secs_f64();
            let mut slowest = 0.0;
            crate::watchdog::collective("taking the slowest rank's time", &world.comm, || world.comm.all_reduce_into(&local, &mut slowest, SystemOperation::max()));
            if iter >= args.warmup {
                times.push(slowest);
            }
        }
        if let (Some(path), true) = (&args.save_result, world.is_root()) {
            append_values(path, &tensors)?;
        }
        if args.corrupt_result && rank == 0 {
            if let Some(t) = tensors.iter_mut().find(|t| t.numel() > 0) {
                let mut first = t.f_view([-1])?.f_narrow(0, 0, 1)?;
                let _ = first.f_add_scalar_(1.0)?;
            }
        }
        // Ranks whose buffers do not count (dedicated servers) have nothing to check; a
        // strategy that compresses is held to its wire format's rounding.
        let wrong_local = if contributors.contains(&rank) {
            let precision = exchange.wire_dtype().unwrap_or(args.dtype);
            count_wrong(&tensors, &sizes, &contributors, reference.as_deref(), precision)?
        } else {
            0
        };
        let mut wrong = 0u64;
        crate::watchdog::collective("counting wrong elements", &world.comm, || world.comm.all_reduce_into(&wrong_local, &mut wrong, SystemOperation::sum()));
        let report = exchange.report();
        let ring_transport = report.extra.get("ring_transport").and_then(|v| v.as_str()).map(String::from);
        let hierarchical = report.extra.get("hierarchical").and_then(|v| v.as_bool());
        let data_path = report.data_path.map(|p| format!("{p:?}").to_lowercase());
        samples.push(SizeSample { times, wrong, tensors: sizes.len(), bus_factor: exchange.bus_factor(), ring_transport, data_path, hierarchical });
    }
    exchange.finish(&mut [])?;
    Ok(samples)
}

/// Appends `tensors`' values, as f32 (exact for every element type), to `path`.
fn append_values(path: &std::path::Path, tensors: &[Tensor]) -> Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new().append(true).open(path).map_err(|e| Error::io(path, e))?;
    for t in tensors {
        let values = Vec::<f32>::try_from(&t.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?).map_err(Error::from)?;
        file.write_all(bytemuck::cast_slice(&values)).map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

fn input_tensors(sizes: &[usize], rank: usize, verify: Verify, seed: u64, kind: Kind, device: Device) -> Result<Vec<Tensor>> {
    let mut offset = 0;
    sizes
        .iter()
        .map(|&len| {
            let values: Vec<f32> = match verify {
                Verify::ClosedForm => (offset..offset + len).map(|i| exact_value(rank, i)).collect(),
                Verify::Allreduce => {
                    use rand::{Rng, SeedableRng};
                    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ (rank as u64) << 32 ^ offset as u64);
                    (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
                }
            };
            offset += len;
            Ok(Tensor::f_from_slice(&values)?.f_to_kind(kind)?.f_to_device(device)?)
        })
        .collect()
}

/// Elements of `tensors` that differ from the expected sum: the closed form, or MPI_Allreduce's
/// result within the tolerance of a different summation order.
fn count_wrong(tensors: &[Tensor], sizes: &[usize], contributing: &[usize], reference: Option<&[Tensor]>, dtype: Dtype) -> Result<u64> {
    let ranks = contributing.len();
    let mut wrong = 0u64;
    let mut offset = 0;
    for (i, t) in tensors.iter().enumerate() {
        let got: Vec<f32> = Vec::<f32>::try_from(&t.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?)
            .map_err(Error::from)?;
        match reference {
            None => {
                for (k, v) in got.iter().enumerate() {
                    if *v != exact_sum(contributing, offset + k) {
                        wrong += 1;
                    }
                }
            }
            Some(refs) => {
                let expected: Vec<f32> = Vec::<f32>::try_from(&refs[i].f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?)
                    .map_err(Error::from)?;
                // Each partial sum may round once more or less than in MPI's order.
                let eps = match dtype {
                    Dtype::F32 => f32::EPSILON,
                    Dtype::F16 => 9.8e-4,
                    Dtype::Bf16 => 7.9e-3,
                };
                let tol = 2.0 * ranks as f32 * eps;
                for (v, e) in got.iter().zip(&expected) {
                    // Written as "not close" rather than "far": a NaN is neither, and is wrong.
                    let close = (v - e).abs() <= tol * (ranks as f32).max(e.abs());
                    if !close {
                        wrong += 1;
                    }
                }
            }
        }
        offset += sizes[i];
    }
    Ok(wrong)
}

/// MPI_Allreduce's own answer on the same input (the contributing ranks' buffers), when the
/// check compares with it.
fn mpi_reference(world: &World, pristine: &[Tensor], contributing: &[usize], verify: Verify) -> Result<Option<Vec<Tensor>>> {
    if verify == Verify::ClosedForm {
        return Ok(None);
    }
    // The call users make, whatever --mpi-allreduce says about the strategies.
    let sums = exchange::allreduce::SumOps::new(exchange::config::MpiAllreduceCall::Blocking);
    let comm = world.comm.duplicate();
    let mut expected = Vec::with_capacity(pristine.len());
    for t in pristine {
        // A copy: on the CPU, to_device returns the same tensor, and pristine must stay.
        let mut host = t.f_to_device(Device::Cpu)?.f_detach_copy()?;
        if !contributing.contains(&(world.rank as usize)) {
            let _ = host.f_zero_()?;
        }
        sums.all_reduce_sum(&comm, &mut host)?;
        expected.push(host);
    }
    Ok(Some(expected))
}

/// Median of the samples (the time of a typical iteration; robust to a stray slow one).
fn median(samples: &mut [f64]) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    let m = samples.len() / 2;
    if samples.len() % 2 == 1 { samples[m] } else { (samples[m - 1] + samples[m]) / 2.0 }
}

fn device_label(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(i) => format!("cuda:{i}"),
        d => format!("{d:?}"),
    }
}

fn layout_name(layout: Layout) -> &'static str {
    match layout {
        Layout::Single => "single",
        Layout::Resnet50 => "resnet50",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("4K").unwrap(), 4096);
        assert_eq!(parse_bytes("256M").unwrap(), 256 << 20);
        assert_eq!(parse_bytes("1g").unwrap(), 1 << 30);
        assert!(parse_bytes("12X").is_err());
        assert!(parse_bytes("lots").is_err());
    }

    #[test]
    fn weights_split_keeps_the_count() {
        let w = [10, 1, 1, 100];
        for count in [0, 1, 5, 112, 1000, 12345] {
            let s = split_by_weights(count, &w);
            assert_eq!(s.iter().sum::<usize>(), count);
        }
        assert_eq!(split_by_weights(112, &w), vec![10, 1, 1, 100]);
    }

    #[test]
    fn closed_form_sums_are_exact_in_half_precision() {
        for ranks in 1..=64 {
            let all: Vec<usize> = (0..ranks).collect();
            for i in 0..6 {
                let s = exact_sum(&all, i);
                assert!(s <= 256.0 && s.fract() == 0.0);
            }
        }
    }

    #[test]
    fn resnet50_has_161_tensors() {
        let sizes = resnet50_sizes();
        assert_eq!(sizes.len(), 161);
        assert_eq!(sizes.iter().sum::<usize>(), 25_557_032);
    }
}
