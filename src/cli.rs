//! Command-line interface. `hpc-train [OPTIONS]` trains; subcommands do the other jobs.
//!
//! Argument parsing only: each command's options are declared beside the code that reads them
//! (`train::options`, `study`, `bench`, `report`, `project`, `data::command`, `data::bench`,
//! `checkpoint::command`; the strategies' groups in `exchange::options`), and this file
//! composes them into the command line.

use clap::{Parser, Subcommand};

use crate::bench::BenchArgs;
use crate::checkpoint::command::CheckpointCommand;
use crate::data::command::DataCommand;
use crate::exchange::config::{parse_strategies, PsMode, StrategyKind};
use crate::exchange::options::{Given, PsArgs};
use crate::project::{FitArgs, ProjectArgs};
use crate::report::ReportArgs;
use crate::study::StudyArgs;
use crate::train::options::{DeviceChoice, TrainArgs, DEFAULT_EXCHANGE_TIMEOUT_S};

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
    /// Checkpoints: `checkpoint consolidate` writes one (sharded or whole) as a single weights
    /// file of whole tensors.
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
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
    /// What combines: every option that changes a step against every layout kind (strategies,
    /// ZeRO stages, pipeline schedules, tensor parallelism), supported or refused with the
    /// reason, as Markdown (README's compatibility table is this output).
    Compat(CompatArgs),
    /// Many short training runs in one launch (tests/conformance.rs's walk of the table).
    #[command(hide = true)]
    Conform(crate::conform::ConformArgs),
}

/// Options of `hpc-train compat`.
#[derive(clap::Args, Debug)]
pub struct CompatArgs {
    /// One pair per line, tab-separated, for scripts: row, its flag, column, its flag, yes / no
    /// / n/a, the reason.
    #[arg(long)]
    pub tsv: bool,
}

#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Fit latency and bandwidth within and between nodes (and the add rate) to bench rows.
    Fit(FitArgs),
}

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
    /// parameter servers) and for a pipeline's progress thread, else `MPI_THREAD_FUNNELED`
    /// (helper threads, such as the data loader's or backward's, make no MPI calls).
    pub fn mpi_threading(&self) -> mpi::Threading {
        let threaded = |strategy: StrategyKind, ps: &PsArgs| {
            strategy == StrategyKind::Horovod || (strategy == StrategyKind::Ps && ps.ps_colocate && ps.ps_mode == PsMode::Async)
        };
        // A list that does not parse is reported after MPI starts; ask for the most meanwhile.
        let any_threaded = |list: &str, ps: &PsArgs| parse_strategies(list).map_or(true, |all| all.into_iter().any(|s| threaded(s, ps)));
        // A GPU's backward runs the tensor-parallel all-reduce on libtorch's device thread; a
        // CPU's runs it on the run's own thread, and needs no more than FUNNELED.
        let tensor_parallel_thread = |train: &TrainArgs| train.tensor_parallel > 1 && may_train_on_a_gpu(train.device);
        // A pipeline's stages move their messages along from a thread of their own while they
        // compute (src/progress.rs).
        let pipeline_thread = |train: &TrainArgs| train.pipeline.pipeline_stages > 1;
        let needs_thread = match &self.command {
            None => threaded(self.train.strategy, &self.train.ps) || tensor_parallel_thread(&self.train) || pipeline_thread(&self.train),
            Some(Command::Study(a)) => {
                // A list that does not parse is reported after MPI starts, as above.
                let pipelined_points = crate::study::parse_stages(&a.stages).map_or(true, |counts| counts.iter().any(|&p| p > 1));
                any_threaded(&a.strategies, &a.train.ps) || tensor_parallel_thread(&a.train) || pipeline_thread(&a.train) || pipelined_points
            }
            Some(Command::Bench(a)) => any_threaded(&a.strategies, &a.ps),
            // Its cases may be of any strategy.
            Some(Command::Conform(_)) => true,
            Some(Command::Data(_) | Command::Checkpoint(_) | Command::Report(_) | Command::Model(_) | Command::Project(_) | Command::Compat(_)) => false,
        };
        if needs_thread { mpi::Threading::Multiple } else { mpi::Threading::Funneled }
    }

    /// How long MPI's start-up may wait for the other ranks (`watchdog::watch_start_up`): the
    /// command's `--exchange-timeout-s` where it has one, else that option's default; 0: not
    /// watched. A value the run's set-up will refuse (negative, not a number) counts as the
    /// default until then.
    pub fn start_up_timeout(&self) -> std::time::Duration {
        let seconds = match &self.command {
            None => self.train.exchange_timeout_s,
            Some(Command::Study(a)) => a.train.exchange_timeout_s,
            Some(Command::Bench(a)) => a.exchange_timeout_s,
            Some(_) => DEFAULT_EXCHANGE_TIMEOUT_S,
        };
        crate::train::watchdog_timeout(seconds).unwrap_or(std::time::Duration::from_secs_f64(DEFAULT_EXCHANGE_TIMEOUT_S))
    }
}

/// Whether `--device` may put the run on a GPU, asked before MPI starts: not with `cpu` or
/// simulated GPUs (which train on the CPU), else where libtorch sees CUDA. A GPU run that got
/// less than MULTIPLE all the same is refused by name when its backward calls the exchange
/// from the device thread (raw/regions.rs).
fn may_train_on_a_gpu(device: DeviceChoice) -> bool {
    if device == DeviceChoice::Cpu || std::env::var_os(crate::train::SIMULATED_GPUS_ENV).is_some() {
        return false;
    }
    let _ = crate::raw::load_torch_cuda();
    tch::Cuda::is_available()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CPU tensor-parallel run asked for MPI_THREAD_MULTIPLE, which only a GPU's backward
    /// needs (issue 48): every call then takes a lock in some libraries.
    #[test]
    fn only_a_gpu_tensor_parallel_run_asks_for_thread_multiple() {
        let level = |args: &[&str]| Cli::try_parse_from([&["hpc-train"], args].concat()).unwrap().mpi_threading();
        assert_eq!(level(&["--model", "vit-tiny", "--tensor-parallel", "2", "--device", "cpu"]), mpi::Threading::Funneled);
        assert_eq!(level(&["study", "--model", "vit-tiny", "--tensor-parallel", "2", "--device", "cpu", "--strategies", "ring"]), mpi::Threading::Funneled);
        assert_eq!(level(&["--model", "vit-tiny", "--tensor-parallel", "2", "--device", "cpu", "--strategy", "horovod"]), mpi::Threading::Multiple);
        let on_a_gpu = if tch::Cuda::is_available() { mpi::Threading::Multiple } else { mpi::Threading::Funneled };
        assert_eq!(level(&["--model", "vit-tiny", "--tensor-parallel", "2"]), on_a_gpu);
    }
}
