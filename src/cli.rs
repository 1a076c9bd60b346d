//! Command-line interface. `hpc-train [OPTIONS]` trains; subcommands do the other jobs.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::data::writer::Compression;
use crate::exchange::{CudaAware, RingTransport};
use crate::exchange::StrategyKind;
use crate::model::ModelKind;

#[derive(Parser, Debug)]
#[command(
    name = "hpc-train",
    version,
    about = "Data-parallel training over MPI with from-scratch gradient-exchange strategies",
    long_about = "Trains a network data-parallel over MPI ranks (launch with mpirun or srun; one rank per GPU, \
                  or CPU ranks) and measures how each gradient-exchange strategy scales.\n\n\
                  Without a subcommand it trains: mpirun -n 16 hpc-train --strategy ring",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub train: TrainArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Import, inspect, generate or benchmark datasets.
    #[command(subcommand)]
    Data(DataCommand),
    /// Measure the gradient exchange alone over a sweep of sizes (nccl-tests style).
    Bench(BenchArgs),
    /// Write scaling tables (Markdown, CSV) and plots (SVG, PNG) from runs.jsonl and bench.jsonl.
    Report(ReportArgs),
    /// Run a whole scaling sweep (rank counts x strategies) inside this one launch.
    Study(StudyArgs),
    /// The exchange cost model: `model fit` fits it to bench.jsonl rows.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Scaling tables projected for a cluster profile (up to thousands of ranks) from the cost
    /// model, checked against the measurements given.
    Project(ProjectArgs),
}

#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Fit latency and bandwidth within and between nodes (and the add rate) to bench rows.
    Fit(FitArgs),
}

/// Options of `hpc-train model fit`.
#[derive(Args, Debug, Clone)]
pub struct FitArgs {
    /// Bench rows (host f32, one tensor): ring, rhd and ps within a node and, for the network
    /// link and the fabric, across nodes; MPI_Allreduce's rows become its measured curve; every
    /// row is predicted and shown beside its measurement (MPI_Allreduce's from the others).
    #[arg(long, default_value = "results/bench.jsonl")]
    pub bench: PathBuf,
    /// Only the rows across nodes recorded with this --link-mbit (rows within one node all count).
    #[arg(long)]
    pub link_mbit: Option<f64>,
    /// The model file to write (JSON).
    #[arg(long, default_value = "results/cost-model.json")]
    pub out: PathBuf,
    /// Parameter servers in the ps rows (as bench --servers).
    #[arg(long, default_value_t = 1)]
    pub servers: usize,
    /// Network links per node in the rows across nodes: the node's ranks that cross the network
    /// in the same step share them (rhd's steps between nodes; the node-aware ring crosses with
    /// one flow each way). Written into the model. [default: a link per rank]
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub nics_per_node: Option<u16>,
    /// Horovod cycle time of the horovod rows (as bench --cycle-time-ms).
    #[arg(long, default_value_t = 1.0)]
    pub cycle_time_ms: f64,
}

/// Options of `hpc-train project`.
#[derive(Args, Debug, Clone)]
pub struct ProjectArgs {
    /// Cluster profile (TOML; see jobs/clusters/).
    #[arg(long)]
    pub profile: PathBuf,
    /// Model whose gradients are exchanged.
    #[arg(long, value_enum, default_value_t = ModelKind::Resnet50)]
    pub model: ModelKind,
    /// One rank's forward, backward and optimizer per step, in ms.
    #[arg(long)]
    pub compute_ms: Option<f64>,
    /// Take the compute time from the 1-rank run of the model at --batch in this runs.jsonl.
    #[arg(long)]
    pub from_runs: Option<PathBuf>,
    /// Samples per rank per step (weak scaling).
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// Rank counts.
    #[arg(long, default_value = "1,2,4,8,16,32,64,128,256,512,1024")]
    pub ranks: String,
    /// Ranks per node [default: the profile's].
    #[arg(long)]
    pub ranks_per_node: Option<usize>,
    /// Gradient buckets in MiB.
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mb: f64,
    /// Share of compute that backward takes (what overlap can hide the exchange behind).
    #[arg(long, default_value_t = 0.67)]
    pub backward_share: f64,
    /// Parameter servers of the measured ps rows (validation).
    #[arg(long, default_value_t = 1)]
    pub servers: usize,
    /// Folder for the tables, the projected records and their report, and validation.csv.
    #[arg(long, default_value = "results/projection")]
    pub out: PathBuf,
    /// Measured bench rows to compare the model with (validation.csv).
    #[arg(long)]
    pub validate_bench: Option<PathBuf>,
    /// Measured training runs to compare the model with (validation.csv).
    #[arg(long)]
    pub validate_runs: Option<PathBuf>,
}

/// The exchange watchdog's default: far beyond any one exchange on a working cluster (a 100 MB
/// bucket over a 1 Gbit/s link takes about a second; the first exchange may also set up
/// connections), and far below a batch job's time limit.
pub const DEFAULT_EXCHANGE_TIMEOUT_S: f64 = 300.0;

impl Cli {
    /// Parses the command line, noting which options it gave (see [`Given`]).
    pub fn parse_noting_given() -> Result<Cli, clap::Error> {
        use clap::{CommandFactory, FromArgMatches};
        let matches = Cli::command().try_get_matches()?;
        let mut cli = Cli::from_arg_matches(&matches)?;
        match (&mut cli.command, matches.subcommand()) {
            (None, _) => cli.train.given = Given::from_matches(&matches),
            (Some(Command::Study(a)), Some((_, m))) => a.train.given = Given::from_matches(m),
            (Some(Command::Bench(a)), Some((_, m))) => a.given = Given::from_matches(m),
            _ => {}
        }
        Ok(cli)
    }

    /// The MPI thread level this command needs: `MPI_THREAD_MULTIPLE` where a strategy runs a
    /// communication thread beside the main one (Horovod-style, colocated asynchronous
    /// parameter servers), else `MPI_THREAD_FUNNELED` (helper threads, such as the data
    /// loader's or backward's, make no MPI calls).
    pub fn mpi_threading(&self) -> mpi::Threading {
        let threaded = |strategy: StrategyKind, ps: &PsArgs| {
            strategy == StrategyKind::Horovod || (strategy == StrategyKind::Ps && ps.ps_colocate && ps.ps_mode == crate::exchange::PsMode::Async)
        };
        // A list that does not parse is reported after MPI starts; ask for the most meanwhile.
        let any_threaded = |list: &str, ps: &PsArgs| crate::study::parse_strategies(list).map_or(true, |all| all.into_iter().any(|s| threaded(s, ps)));
        let needs_thread = match &self.command {
            None => threaded(self.train.strategy, &self.train.ps),
            Some(Command::Study(a)) => any_threaded(&a.strategies, &a.train.ps),
            Some(Command::Bench(a)) => any_threaded(&a.strategies, &a.ps),
            Some(Command::Data(_) | Command::Report(_) | Command::Model(_) | Command::Project(_)) => false,
        };
        if needs_thread { mpi::Threading::Multiple } else { mpi::Threading::Funneled }
    }
}

/// The options given on the command line (by clap id), apart from those left at their
/// defaults: an option that the chosen strategy never reads is refused, not silently ignored.
#[derive(Clone, Debug, Default)]
pub struct Given(std::collections::BTreeSet<String>);

impl Given {
    pub fn from_matches(matches: &clap::ArgMatches) -> Given {
        let given = |id: &&clap::Id| matches.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine);
        Given(matches.ids().filter(given).map(|id| id.as_str().to_string()).collect())
    }

    /// For tests: the given options by id.
    #[cfg(test)]
    pub fn of(ids: &[&str]) -> Given {
        Given(ids.iter().map(|s| s.to_string()).collect())
    }

    pub fn has(&self, id: &str) -> bool {
        self.0.contains(id)
    }
}

/// Options that only some strategies read: (clap id, flag, the strategies that read it).
const STRATEGY_OPTIONS: &[(&str, &str, &[StrategyKind])] = {
    use StrategyKind::*;
    &[
        ("cycle_time_ms", "--cycle-time-ms", &[Horovod]),
        ("fusion_threshold_mb", "--fusion-threshold-mb", &[Horovod]),
        ("compression", "--compression", &[Horovod]),
        ("hierarchical", "--hierarchical", &[Horovod]),
        ("timeline", "--timeline", &[Horovod]),
        ("stall_warning_s", "--stall-warning-s", &[Horovod]),
        ("cache_capacity", "--cache-capacity", &[Horovod]),
        ("mpi_allreduce", "--mpi-allreduce", &[Allreduce, Horovod]),
        ("servers", "--servers", &[Ps]),
        ("ps_colocate", "--ps-colocate", &[Ps]),
        ("ps_mode", "--ps-mode", &[Ps]),
        ("max_staleness", "--max-staleness", &[Ps]),
        ("ps_timeout_s", "--ps-timeout-s", &[Ps]),
        ("cost_model", "--cost-model", &[Auto]),
    ]
};

/// Tuning options that most strategies read: one given for a run none of whose strategies reads
/// it is warned about (once, on rank 0), not refused, since scripts pass them to every run.
const TUNING_OPTIONS: &[(&str, &str, &[StrategyKind])] = {
    use StrategyKind::*;
    &[
        ("segment_kb", "--segment-kb", &[Ring, Rhd, Auto]),
        ("ring_transport", "--ring-transport", &[Ring, Auto]),
        ("bucket_mb", "--bucket-mb", &[Ring, Rhd, Auto, Allreduce, Horovod]),
    ]
};

/// Horovod's environment variables: read by Horovod-style runs only, and never a reason to
/// refuse another run (a site may export them for every job).
const HOROVOD_VARIABLES: &[&str] =
    &["HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_TIMELINE", "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_CACHE_CAPACITY"];

/// Checks the options given against the strategies of the run (a study or a bench: all of its
/// strategies; an option read by one of them is fine). Returns the warnings to log once;
/// refuses an option that no strategy of the run reads, naming it and the strategies.
pub fn check_strategy_options(given: &Given, strategies: &[StrategyKind], ps: &PsArgs) -> crate::error::Result<Vec<String>> {
    let names = strategies.iter().map(|s| s.name()).collect::<Vec<_>>().join(",");
    let run = if strategies.len() == 1 { format!("--strategy {names}") } else { format!("the strategies {names}") };
    let readers = |of: &[StrategyKind]| of.iter().map(|s| s.name()).collect::<Vec<_>>().join(" or ");
    for &(id, flag, of) in STRATEGY_OPTIONS {
        if given.has(id) && !strategies.iter().any(|s| of.contains(s)) {
            let what = if id == "timeline" { "writes nothing" } else { "would ignore it" };
            return Err(crate::error::Error::usage(format!(
                "{flag} is an option of --strategy {}; {run} {what}: drop it, or choose that strategy",
                readers(of)
            )));
        }
    }
    if strategies.contains(&StrategyKind::Ps) {
        if given.has("max_staleness") && ps.ps_mode != crate::exchange::PsMode::Async {
            return Err(crate::error::Error::usage(
                "--max-staleness bounds asynchronous parameter servers; --ps-mode sync keeps every worker in step: drop it, or add --ps-mode async",
            ));
        }
        if given.has("servers") && ps.ps_colocate {
            return Err(crate::error::Error::usage(format!(
                "--servers {} with --ps-colocate: colocated, every rank is a server; drop one of the two",
                ps.servers
            )));
        }
    }
    for var in HOROVOD_VARIABLES {
        if !strategies.contains(&StrategyKind::Horovod) && std::env::var_os(var).is_some() {
            log::debug!("{var} is set; {run} does not read it (Horovod-style runs do)");
        }
    }
    Ok(TUNING_OPTIONS
        .iter()
        .filter(|(id, _, of)| given.has(id) && !strategies.iter().any(|s| of.contains(s)))
        .map(|(_, flag, of)| format!("{flag} is read by --strategy {}; {run} ignores it", readers(of)))
        .collect())
}

/// Options of `hpc-train study`.
#[derive(Args, Debug, Clone)]
pub struct StudyArgs {
    /// Rank counts of the sweep, comma-separated (each at most the launched ranks).
    #[arg(long, default_value = "1,2,4")]
    pub ranks: String,
    /// Strategies, comma-separated.
    #[arg(long, default_value = "ring,ps,allreduce,horovod")]
    pub strategies: String,
    /// Id tagging the study's runs in runs.jsonl [default: scaling mode and UTC time].
    #[arg(long)]
    pub study_id: Option<String>,
    /// Training options for every run (--strategy is set by the sweep).
    #[command(flatten)]
    pub train: TrainArgs,
}

/// Options of `hpc-train report`.
#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// Training records (JSON lines, as training appends them).
    #[arg(long, default_value = "results/runs.jsonl")]
    pub input: PathBuf,
    /// Report only the runs of this study id.
    #[arg(long)]
    pub study: Option<String>,
    /// Exchange benchmark rows for the bus-bandwidth plots [default: bench.jsonl beside --input,
    /// skipped when absent].
    #[arg(long)]
    pub bench: Option<PathBuf>,
    /// Folder for report.md, the CSV files and the plots.
    #[arg(long, default_value = "results/report")]
    pub out: PathBuf,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchDevice {
    Cpu,
    Cuda,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The buffer is one tensor.
    Single,
    /// The buffer is split into 161 tensors in the proportions of ResNet-50's parameters.
    Resnet50,
}

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
    #[arg(long, default_value = "ring,allreduce")]
    pub strategies: String,
    /// Smallest message (bytes; K, M, G suffixes).
    #[arg(long, default_value = "4K")]
    pub min_bytes: String,
    /// Largest message.
    #[arg(long, default_value = "256M")]
    pub max_bytes: String,
    /// Size multiplier between rows.
    #[arg(long, default_value_t = 2)]
    pub factor: usize,
    /// Exact element counts instead of the sweep, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub counts: Option<Vec<usize>>,
    /// Timed iterations per size (at least 1: a row of no iterations would record a time of 0).
    #[arg(long, default_value_t = 20, value_parser = at_least_one)]
    pub iters: usize,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Sweeps over all strategies, each starting one strategy later than the one before; each
    /// row is the median of every round's timed iterations. On a shared or drifting machine,
    /// no strategy is then always the one measured first.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub rounds: u16,
    /// Where the buffers live.
    #[arg(long, value_enum, default_value_t = BenchDevice::Cpu)]
    pub device: BenchDevice,
    /// Element type.
    #[arg(long, value_enum, default_value_t = crate::exchange::element::Dtype::F32)]
    pub dtype: crate::exchange::element::Dtype,
    /// One tensor, or ResNet-50's 161 tensors.
    #[arg(long, value_enum, default_value_t = Layout::Single)]
    pub layout: Layout,
    /// How results are checked.
    #[arg(long, value_enum, default_value_t = Verify::ClosedForm)]
    pub verify: Verify,
    /// Seed of the random input (--verify allreduce).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Fusion bucket size in MiB for multi-tensor layouts.
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mb: f64,
    /// Ring segment size in KiB.
    #[arg(long, default_value_t = 4096)]
    pub segment_kb: u64,
    /// How the ring's ranks reach each other: node-shared memory when all are on one node (auto).
    #[arg(long, value_enum, default_value_t = RingTransport::Auto)]
    pub ring_transport: RingTransport,

    /// The MPI call of `allreduce` and `horovod` on host buffers: `blocking` (MPI_Allreduce, as
    /// users and Horovod call it) or `nonblocking` (MPI_Iallreduce and a polling wait, this
    /// program's path before issue 32, for comparison). Device buffers always take the blocking
    /// call.
    #[arg(long, value_enum, default_value_t = crate::exchange::config::MpiAllreduceCall::Blocking)]
    pub mpi_allreduce: crate::exchange::config::MpiAllreduceCall,
    /// Whether MPI can read GPU memory.
    #[arg(long, value_enum, default_value_t = CudaAware::Auto)]
    pub cuda_aware: CudaAware,
    /// Folder for bench.jsonl.
    #[arg(long, default_value = "results")]
    pub results: PathBuf,
    /// Change one element of rank 0's result before the check (tests that the check works).
    #[arg(long, hide = true)]
    pub corrupt_result: bool,
    /// Write rank 0's summed buffers, every strategy and size in turn (as f32, little-endian,
    /// after the last iteration), to this file: for comparing two runs bit for bit.
    #[arg(long)]
    pub save_result: Option<PathBuf>,
    /// Abort when an exchange makes no progress for this many seconds; 0: never.
    #[arg(long, default_value_t = DEFAULT_EXCHANGE_TIMEOUT_S)]
    pub exchange_timeout_s: f64,
    /// Cost model for `auto` (see the training option).
    #[arg(long)]
    pub cost_model: Option<PathBuf>,
    /// The rate of the links between nodes, in Mbit/s, recorded in bench.jsonl for
    /// `hpc-train model fit` (the bench cannot measure it apart from the exchange).
    #[arg(long)]
    pub link_mbit: Option<f64>,

    #[command(flatten)]
    pub ps: PsArgs,

    #[command(flatten)]
    pub horovod: HorovodArgs,

    /// The options given on the command line.
    #[arg(skip)]
    pub given: Given,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scaling {
    /// Every rank keeps --batch-size: the global batch grows with the ranks.
    Weak,
    /// --global-batch is split over the ranks.
    Strong,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    Tf32,
    Bf16,
    Fp16,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnOff {
    /// On where something is free to run the exchange while backward computes: a GPU rank (the
    /// GPU computes, the CPU exchanges) or a CPU rank with cores beyond its intra-op threads;
    /// off where backward already uses every core the rank has (the exchange's copies and
    /// additions would take them from backward: measured slower on such CPU runs, results/).
    Auto,
    On,
    Off,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
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

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The rank's GPU when CUDA is available, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// Parameter-server options (training and bench).
#[derive(Args, Debug, Clone)]
pub struct PsArgs {
    /// Parameter-server ranks (the last ones), for --strategy ps.
    #[arg(long, default_value_t = 1)]
    pub servers: usize,
    /// Every rank is both a worker and the server of its share of the parameters.
    #[arg(long)]
    pub ps_colocate: bool,
    /// Synchronous (average every step) or asynchronous (apply gradients as they arrive).
    #[arg(long, value_enum, default_value_t = crate::exchange::PsMode::Sync)]
    pub ps_mode: crate::exchange::PsMode,
    /// Asynchronous mode: rounds a worker's weights may lag behind (unbounded when not given).
    #[arg(long)]
    pub max_staleness: Option<u64>,
    /// A server reports a worker that has sent nothing for this many seconds.
    #[arg(long, default_value_t = 600.0)]
    pub ps_timeout_s: f64,
}

impl PsArgs {
    pub fn config(&self, sgd: crate::optim::SgdConfig) -> crate::exchange::config::PsConfig {
        crate::exchange::config::PsConfig {
            servers: self.servers,
            colocate: self.ps_colocate,
            mode: self.ps_mode,
            max_staleness: self.max_staleness,
            timeout: std::time::Duration::from_secs_f64(self.ps_timeout_s.max(0.001)),
            sgd,
            checkpoint_every: None,
            first_step: 0,
        }
    }

    pub fn roles(&self) -> crate::exchange::RoleOptions {
        crate::exchange::RoleOptions { servers: self.servers, colocate: self.ps_colocate }
    }
}

/// Horovod-style options (training and bench). Unset flags fall back to Horovod's
/// environment variables, then to Horovod's defaults (README, Horovod's variables).
#[derive(Args, Debug, Clone)]
pub struct HorovodArgs {
    /// Background cycle in milliseconds: tensors enqueued during a cycle are negotiated and
    /// fused at the next [env HOROVOD_CYCLE_TIME; default 1].
    #[arg(long)]
    pub cycle_time_ms: Option<f64>,
    /// Fusion buffer in MiB, 0 = no fusion [env HOROVOD_FUSION_THRESHOLD in bytes; default 128].
    #[arg(long)]
    pub fusion_threshold_mb: Option<f64>,
    /// Response cache entries, least recently used evicted; 0 = no cache (every cycle
    /// negotiates through rank 0) [env HOROVOD_CACHE_CAPACITY; default 1024].
    #[arg(long)]
    pub cache_capacity: Option<usize>,
    /// Cast gradients to 16 bits for the exchange.
    #[arg(long, value_enum, default_value_t = crate::exchange::config::Compression::None)]
    pub compression: crate::exchange::config::Compression,
    /// Reduce within nodes, all-reduce across nodes, broadcast within nodes; ignored when every
    /// rank is on one node, as Horovod does [env HOROVOD_HIERARCHICAL_ALLREDUCE=1].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub hierarchical: Option<bool>,
    /// Stream rank 0's Horovod timeline (Chrome tracing JSON) to this file [env HOROVOD_TIMELINE].
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// Warn about tensors that some ranks enqueued and others not, after this many seconds
    /// [env HOROVOD_STALL_CHECK_TIME_SECONDS; default 60; HOROVOD_STALL_CHECK_DISABLE=1: never].
    #[arg(long)]
    pub stall_warning_s: Option<f64>,
    /// Test hook: enqueue in a rank-dependent order, spread over cycles.
    #[arg(long, hide = true)]
    pub horovod_shuffle_enqueue: bool,
    /// Test hook RANK:SECONDS: that rank holds its last tensor back this long once.
    #[arg(long, hide = true)]
    pub horovod_test_delay: Option<String>,
}

impl HorovodArgs {
    pub fn config(&self) -> crate::error::Result<crate::exchange::config::HorovodConfig> {
        use crate::exchange::config::{HorovodConfig, DEFAULT_CACHE_CAPACITY};
        use crate::exchange::horovod::env_or;
        use std::time::Duration;
        let positive = |s: &str| s.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0);
        // Horovod reads its switches as integers, any value above 0 meaning on.
        let switch = |s: &str| match s {
            "true" | "True" | "TRUE" => Some(true),
            "false" | "False" | "FALSE" => Some(false),
            _ => s.parse::<i64>().ok().map(|v| v > 0),
        };
        let cycle_ms = env_or(self.cycle_time_ms, "HOROVOD_CYCLE_TIME", positive, 1.0)?;
        let fusion_mb = env_or(self.fusion_threshold_mb, "HOROVOD_FUSION_THRESHOLD", |s| positive(s).map(|b| b / (1 << 20) as f64), 128.0)?;
        let cache_capacity = env_or(self.cache_capacity, "HOROVOD_CACHE_CAPACITY", |s| s.parse::<usize>().ok(), DEFAULT_CACHE_CAPACITY)?;
        let hierarchical = env_or(self.hierarchical, "HOROVOD_HIERARCHICAL_ALLREDUCE", switch, false)?;
        let timeline = env_or(self.timeline.clone().map(Some), "HOROVOD_TIMELINE", |s| Some(Some(PathBuf::from(s))), None)?;
        if timeline.as_deref() == Some(std::path::Path::new("DYNAMIC")) {
            return Err(crate::error::Error::usage(
                "HOROVOD_TIMELINE=DYNAMIC (a timeline started later from Python) is not supported: give the timeline's file name",
            ));
        }
        let timeline_mark_cycles = env_or(None, "HOROVOD_TIMELINE_MARK_CYCLES", switch, false)?;
        let stall = env_or(self.stall_warning_s, "HOROVOD_STALL_CHECK_TIME_SECONDS", positive, 60.0)?;
        let stall_check = !env_or(None, "HOROVOD_STALL_CHECK_DISABLE", switch, false)?;
        for (flag, v) in [("--cycle-time-ms", cycle_ms), ("--fusion-threshold-mb", fusion_mb), ("--stall-warning-s", stall)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(crate::error::Error::usage(format!("{flag} {v}: expected a number of 0 or more")));
            }
        }
        Ok(HorovodConfig {
            cycle_time: Duration::from_secs_f64(cycle_ms / 1e3),
            fusion_threshold: (fusion_mb * (1 << 20) as f64) as usize,
            cache_capacity,
            compression: self.compression,
            hierarchical,
            timeline,
            timeline_mark_cycles,
            stall_check,
            stall_warning: Duration::from_secs_f64(stall),
            shuffle_enqueue: self.horovod_shuffle_enqueue,
            test_delay: match &self.horovod_test_delay {
                None => None,
                Some(spec) => {
                    let parsed = spec.split_once(':').and_then(|(r, s)| Some((r.parse::<usize>().ok()?, s.parse::<f64>().ok()?)));
                    let (rank, secs) = parsed.ok_or_else(|| crate::error::Error::usage(format!("--horovod-test-delay {spec:?}: expected RANK:SECONDS")))?;
                    Some((rank, Duration::from_secs_f64(secs)))
                }
            },
        })
    }
}

/// Options of a training run.
#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// Gradient-exchange strategy.
    #[arg(long, value_enum, default_value_t = StrategyKind::Ring)]
    pub strategy: StrategyKind,

    /// Model to train.
    #[arg(long, value_enum, default_value_t = ModelKind::Resnet50)]
    pub model: ModelKind,

    /// Dataset file in the project's HDF5 layout (see `hpc-train data`).
    #[arg(long, default_value = "datasets/fashion-mnist.h5")]
    pub data: PathBuf,

    /// Samples per rank per step (weak scaling).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: u64,

    /// Weak scaling keeps --batch-size per rank; strong scaling splits --global-batch over the ranks.
    #[arg(long, value_enum, default_value_t = Scaling::Weak)]
    pub scaling: Scaling,

    /// Samples per step over all ranks (strong scaling).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub global_batch: Option<u64>,

    /// Epochs to train.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub epochs: u64,

    /// Stop after this many steps in all (overrides --epochs).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: Option<u64>,

    /// Learning rate.
    #[arg(long, default_value_t = 0.05)]
    pub lr: f64,

    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,

    /// Weight decay (L2), applied to every parameter as torch.optim.SGD does.
    #[arg(long, default_value_t = 1e-4)]
    pub weight_decay: f64,

    /// Seed for weights and data order (the same on every rank).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,

    /// Gradient bucket size in MiB; 0 = one exchange per parameter tensor (the naive variant).
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mb: f64,

    /// Exchange gradient buckets while backward is still running (gradient-ready hooks).
    #[arg(long, value_enum, default_value_t = OnOff::Auto)]
    pub overlap: OnOff,

    /// Ring all-reduce segment size in KiB (the pipelining grain of the ring; the default is the
    /// best measured in results/README.md).
    #[arg(long, default_value_t = 4096)]
    pub segment_kb: u64,

    /// How the ring's ranks reach each other: `auto` reads and adds a neighbour's chunk straight
    /// from node-shared memory when every rank is on one node, and sends MPI messages otherwise.
    #[arg(long, value_enum, default_value_t = RingTransport::Auto)]
    pub ring_transport: RingTransport,

    /// The MPI call of `allreduce` and `horovod` on host buffers: `blocking` (MPI_Allreduce, as
    /// users and Horovod call it) or `nonblocking` (MPI_Iallreduce and a polling wait, this
    /// program's path before issue 32, for comparison). Device buffers always take the blocking
    /// call.
    #[arg(long, value_enum, default_value_t = crate::exchange::config::MpiAllreduceCall::Blocking)]
    pub mpi_allreduce: crate::exchange::config::MpiAllreduceCall,

    /// Folder for runs.jsonl and other results.
    #[arg(long, default_value = "results")]
    pub results: PathBuf,

    /// Intra-op threads per rank; 0 = the cores this rank may use divided by the ranks on its node.
    #[arg(long, default_value_t = 0)]
    pub threads: usize,

    /// Where to train.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,

    /// Whether the MPI library can read GPU memory; auto asks it (MPIX_Query_cuda_support).
    #[arg(long, value_enum, default_value_t = CudaAware::Auto)]
    pub cuda_aware: CudaAware,

    /// Arithmetic: fp32, tf32 (TF32 matrix units), bf16 or fp16 (autocast; fp16 with a dynamic
    /// loss scaler). Other than fp32 needs CUDA.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,

    /// Keep activations and convolution weights in channels-last (NHWC) memory order.
    #[arg(long)]
    pub channels_last: bool,

    /// ZeRO stage (ring, rhd on a power of two of ranks, auto): 1 shards the optimizer state
    /// (momentum) over the ranks, 2 also the gradients held between steps; 0 keeps everything
    /// on every rank.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub zero: u8,

    /// Let several ranks of a node share one GPU (for testing on a machine with fewer GPUs).
    #[arg(long)]
    pub allow_gpu_sharing: bool,

    /// Steps at the start excluded from throughput figures.
    #[arg(long, default_value_t = 5)]
    pub warmup_steps: u64,

    /// Abort the job when an exchange, or a collective between exchanges, makes no progress for
    /// this many seconds (a cut link or a dead node), after every rank logs what it waits for;
    /// keep it above rank 0's longest checkpoint write, which the others wait for; 0: off.
    #[arg(long, default_value_t = DEFAULT_EXCHANGE_TIMEOUT_S)]
    pub exchange_timeout_s: f64,

    /// Cost model (JSON, from `hpc-train model fit`) with which `--strategy auto` picks ring,
    /// rhd or recursive doubling per bucket [default: built-in link costs].
    #[arg(long)]
    pub cost_model: Option<PathBuf>,

    /// Log a progress line every this many steps (when no progress bar is shown).
    #[arg(long, default_value_t = 50)]
    pub log_every: u64,

    /// Batches the loader thread reads ahead.
    #[arg(long, default_value_t = 4)]
    pub prefetch: usize,

    /// Hold the training split in memory, read once, instead of reading each batch's samples
    /// from the file.
    #[arg(long, value_enum, default_value_t = CacheData::Auto)]
    pub cache_data: CacheData,

    /// Skip the test-set evaluation at the end of each epoch.
    #[arg(long)]
    pub no_eval: bool,

    /// Write the final weights (safetensors, loadable from PyTorch) to this file.
    #[arg(long)]
    pub save_weights: Option<PathBuf>,

    /// Folder for checkpoints (weights and optimizer state; rank 0 writes them).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,

    /// Steps between checkpoints (a checkpoint is also written at the end, or when a signal stops training).
    #[arg(long, default_value_t = 500)]
    pub checkpoint_every: u64,

    /// Complete checkpoints kept (older ones are removed once a newer one is complete).
    #[arg(long, default_value_t = 3)]
    pub keep_checkpoints: usize,

    /// Continue from the newest complete checkpoint in --checkpoint-dir (from the start when there is none).
    #[arg(long)]
    pub resume: bool,

    /// Tag this run's record in runs.jsonl with a study id (job scripts group their runs so).
    #[arg(long)]
    pub study_tag: Option<String>,

    /// Record the sample indices each rank trains on, one file per rank in this folder (checks).
    #[arg(long, hide = true)]
    pub trace_samples: Option<PathBuf>,

    #[command(flatten)]
    pub ps: PsArgs,

    #[command(flatten)]
    pub horovod: HorovodArgs,

    /// The options given on the command line.
    #[arg(skip)]
    pub given: Given,
}

impl TrainArgs {
    /// [`check_strategy_options`] for a run of `strategies` (one, or a study's), and the
    /// checkpoint options that mean nothing without --checkpoint-dir.
    pub fn check_unused_options(&self, strategies: &[StrategyKind]) -> crate::error::Result<Vec<String>> {
        if self.checkpoint_dir.is_none() {
            for (id, flag) in [("checkpoint_every", "--checkpoint-every"), ("keep_checkpoints", "--keep-checkpoints")] {
                if self.given.has(id) {
                    return Err(crate::error::Error::usage(format!("{flag} without --checkpoint-dir: no checkpoint is written; add --checkpoint-dir DIR")));
                }
            }
        }
        check_strategy_options(&self.given, strategies, &self.ps)
    }
}

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Convert a dataset into the project's HDF5 layout.
    Import(ImportArgs),
    /// Print what a dataset file holds, or why it cannot be used.
    Info {
        /// Dataset file.
        file: PathBuf,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ps(mode: crate::exchange::PsMode, colocate: bool) -> PsArgs {
        PsArgs { servers: 1, ps_colocate: colocate, ps_mode: mode, max_staleness: None, ps_timeout_s: 600.0 }
    }

    #[test]
    fn options_no_strategy_of_the_run_reads_are_refused() {
        use crate::exchange::PsMode::{Async, Sync};
        use StrategyKind::*;
        let check = |ids: &[&str], strategies: &[StrategyKind], ps: PsArgs| check_strategy_options(&Given::of(ids), strategies, &ps);
        let refused = |ids: &[&str], strategies: &[StrategyKind], ps: PsArgs| check(ids, strategies, ps).unwrap_err().to_string();
        assert!(refused(&["timeline"], &[Ring], ps(Sync, false)).contains("--timeline is an option of --strategy horovod; --strategy ring writes nothing"));
        for (id, flag) in [("compression", "--compression"), ("hierarchical", "--hierarchical"), ("cycle_time_ms", "--cycle-time-ms"), ("fusion_threshold_mb", "--fusion-threshold-mb")] {
            assert!(refused(&[id], &[Allreduce], ps(Sync, false)).starts_with(&format!("{flag} is an option of --strategy horovod")));
        }
        for id in ["servers", "ps_mode", "ps_colocate", "max_staleness", "ps_timeout_s"] {
            assert!(refused(&[id], &[Ring], ps(Sync, false)).contains("--strategy ring would ignore it"), "{id}");
        }
        assert!(refused(&["cost_model"], &[Ring, Rhd], ps(Sync, false)).contains("the strategies ring,rhd would ignore it"));
        assert!(refused(&["max_staleness"], &[Ps], ps(Sync, false)).contains("--ps-mode sync"));
        assert!(refused(&["servers"], &[Ps], ps(Sync, true)).contains("with --ps-colocate"));
        // Used by one strategy of a study: fine.
        assert!(check(&["timeline", "servers"], &[Ring, Horovod, Ps], ps(Sync, false)).unwrap().is_empty());
        assert!(check(&["max_staleness", "ps_mode"], &[Ps], ps(Async, false)).unwrap().is_empty());
        // Tuning options: a warning.
        let warnings = check(&["segment_kb", "bucket_mb"], &[Ps], ps(Sync, false)).unwrap();
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(check(&["segment_kb", "ring_transport"], &[Auto], ps(Sync, false)).unwrap().is_empty());
    }
}
