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
                  Without a subcommand (or with `train`) it trains: mpirun -n 16 hpc-train --strategy ring; \
                  --config FILE.toml reads the options from a run file (--print-config writes one).",
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
    /// Parses the command line, noting which options it gave (see [`Given`]), with the run
    /// file of `--config` and the `--preset` applied where it gave none (crate::config).
    pub fn parse_noting_given() -> Result<Cli, clap::Error> {
        Cli::parse_from_noting_given(std::env::args_os())
    }

    /// [`Cli::parse_noting_given`] of `argv` (its first item the program's name).
    pub fn parse_from_noting_given<T: Into<std::ffi::OsString>>(argv: impl IntoIterator<Item = T>) -> Result<Cli, clap::Error> {
        use clap::{CommandFactory, FromArgMatches};
        let mut argv: Vec<std::ffi::OsString> = argv.into_iter().map(Into::into).collect();
        // `hpc-train train [OPTIONS]` is `hpc-train [OPTIONS]`.
        if argv.get(1).is_some_and(|a| a == "train") {
            argv.remove(1);
        }
        let mut matches = Cli::command().try_get_matches_from(&argv)?;
        let train_matches = match matches.subcommand() {
            None => Some(&matches),
            Some(("study", m)) => Some(m),
            _ => None,
        };
        let mut preset_ids = Vec::new();
        let mut file = None;
        let mut warnings = Vec::new();
        if let Some(m) = train_matches {
            // One line that names the file and the key (clap's usage text would bury it).
            let additions = crate::config::additions(m).map_err(|e| clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{e}\n")))?;
            if !additions.args.is_empty() {
                // The command line gives none of these, so where they go does not matter: at
                // the end, they are the training command's (or study's) own.
                argv.extend(additions.args);
                matches = Cli::command().try_get_matches_from(&argv)?;
            }
            preset_ids = additions.preset_ids;
            file = additions.file;
            warnings = additions.warnings;
        }
        let mut cli = Cli::from_arg_matches(&matches)?;
        let preset_ids: Vec<&str> = preset_ids.iter().map(String::as_str).collect();
        let note = |train: &mut TrainArgs, m: &clap::ArgMatches| {
            train.given = Given::from_matches(m).without(&preset_ids);
            train.run_config = crate::config::resolved(m);
            train.run_config.file = file.clone();
            train.run_config.warnings = warnings.clone();
        };
        match (&mut cli.command, matches.subcommand()) {
            (None, _) => note(&mut cli.train, &matches),
            (Some(Command::Study(a)), Some((_, m))) => note(&mut a.train, m),
            (Some(Command::Bench(a)), Some((_, m))) => a.given = Given::from_matches(m),
            _ => {}
        }
        Ok(cli)
    }

    /// The training options of a command that trains (`hpc-train [OPTIONS]`, `study`).
    pub fn train_args(&self) -> Option<&TrainArgs> {
        match &self.command {
            None => Some(&self.train),
            Some(Command::Study(a)) => Some(&a.train),
            _ => None,
        }
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

/// What `hpc-train` with no arguments prints: how to train and the commands, not a run.
pub fn short_usage() -> String {
    use clap::CommandFactory;
    let command = Cli::command();
    let mut text = String::from(
        "Usage: hpc-train [train] [OPTIONS]   train, e.g. mpirun -n 4 hpc-train --preset cpu-trial\n       \
         hpc-train [train] --config FILE.toml [OPTIONS]   train from a run file (jobs/configs/)\n       \
         hpc-train <COMMAND> [OPTIONS]\n\nCommands:\n",
    );
    for sub in command.get_subcommands().filter(|c| !c.is_hide_set()) {
        let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
        text.push_str(&format!("  {:<11}{}\n", sub.get_name(), about.split(". ").next().unwrap_or_default().trim_end_matches('.')));
    }
    text.push_str("\nhpc-train --help: every training option, by group; hpc-train <COMMAND> --help: the command's.\n");
    text
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

    /// `--help` of training and of `study` groups the options under the headings of issue 66,
    /// and every visible training option has one (and so a section in run files).
    #[test]
    fn help_groups_the_options_under_headings() {
        use clap::CommandFactory;
        let headings = ["Run", "Data", "Model and optimizer", "Exchange", "Horovod", "Parameter server", "Pipeline", "Sharding and tensor parallelism", "Checkpoints and faults", "Output"];
        let mut command = Cli::command();
        let top = command.render_long_help().to_string();
        let study = command.find_subcommand_mut("study").unwrap().render_long_help().to_string();
        for help in [&top, &study] {
            let mut at = 0;
            for heading in headings {
                let found = help[at..].find(&format!("\n{heading}:\n")).unwrap_or_else(|| panic!("{heading}: missing or out of order in\n{help}"));
                at += found + 1;
            }
        }
        for (sub, headings) in [("bench", &["Sweep", "Exchange", "Output", "Parameter server", "Horovod"][..]), ("project", &["Cluster and model", "Sweep", "Plan (--plan)", "Output"][..])] {
            let help = command.find_subcommand_mut(sub).unwrap().render_long_help().to_string();
            for heading in headings {
                assert!(help.contains(&format!("\n{heading}:\n")), "{sub}: {heading} missing in\n{help}");
            }
        }
        for arg in crate::config::train_command().get_arguments().filter(|a| !a.is_hide_set()) {
            assert!(arg.get_help_heading().is_some(), "--{} has no heading", arg.get_long().unwrap_or_default());
        }
    }

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
