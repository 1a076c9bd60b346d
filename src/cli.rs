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
use crate::exchange::options::{Given, PsArgs, DEFAULT_EXCHANGE_TIMEOUT_S};
use crate::project::{FitArgs, ProjectArgs};
use crate::report::ReportArgs;
use crate::study::StudyArgs;
use crate::train::options::{DeviceChoice, TrainArgs};

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
    /// reason, as Markdown (docs/combinations.md's table is this output).
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
        // A GPU's backward runs the tensor-parallel all-reduce on libtorch's device thread, and
        // --zero 3's units compute on a thread of their own (while the run's thread gathers the
        // next unit over the replicas); a CPU's plain run has it on the run's own thread, and
        // needs no more than FUNNELED.
        let tensor_parallel_thread = |train: &TrainArgs| train.tensor_parallel > 1 && (may_train_on_a_gpu(train.device) || train.zero == 3);
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
            None => self.train.watchdog.exchange_timeout_s,
            Some(Command::Study(a)) => a.train.watchdog.exchange_timeout_s,
            Some(Command::Bench(a)) => a.watchdog.exchange_timeout_s,
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

    /// An option that `bench` and training both have is one option: the same help, default,
    /// aliases and values (both flatten crate::exchange::options' groups), apart from the few
    /// names that mean another thing in the bench. Only a heading may differ: the bench puts
    /// --exchange-timeout-s under "Exchange", training under "Checkpoints and faults".
    #[test]
    fn bench_and_training_declare_their_shared_options_once() {
        use clap::CommandFactory;
        // The bench's buffers' device, input seed and bench.jsonl folder.
        const OTHER_MEANING: &[&str] = &["device", "seed", "results", "help"];
        let command = Cli::command();
        let bench = command.find_subcommand("bench").unwrap();
        let describe = |a: &clap::Arg| {
            let help = |s: Option<&clap::builder::StyledStr>| s.map(|s| s.to_string());
            let values: Vec<String> = a.get_possible_values().iter().map(|v| v.get_name().to_string()).collect();
            let defaults: Vec<String> = a.get_default_values().iter().map(|d| d.to_string_lossy().into_owned()).collect();
            let aliases: Vec<String> = a.get_all_aliases().unwrap_or_default().iter().map(|s| s.to_string()).collect();
            format!("{:?} {:?} {:?} {defaults:?} {aliases:?} {values:?} {:?} {:?}", a.get_id(), help(a.get_help()), help(a.get_long_help()), a.get_value_names(), a.get_action())
        };
        let mut shared = 0;
        for b in bench.get_arguments().filter(|a| a.get_long().is_some_and(|l| !OTHER_MEANING.contains(&l))) {
            let Some(t) = command.get_arguments().find(|t| t.get_long() == b.get_long()) else { continue };
            assert_eq!(describe(b), describe(t), "--{}: bench and training differ", b.get_long().unwrap());
            let heading = if b.get_long() == Some("exchange-timeout-s") { "Checkpoints and faults" } else { b.get_help_heading().unwrap() };
            assert_eq!(t.get_help_heading(), Some(heading), "--{}: training's heading (its run-file section)", b.get_long().unwrap());
            shared += 1;
        }
        // bucket, segment, transport, MPI call, CUDA-awareness, cost model, timeout; the
        // parameter server's 5 and Horovod's 9.
        assert_eq!(shared, 7 + 5 + 9);
    }

    /// A CPU tensor-parallel run asked for MPI_THREAD_MULTIPLE, which only a GPU's backward
    /// and --zero 3's compute thread need (issue 48): every call then takes a lock in some
    /// libraries.
    #[test]
    fn only_a_gpu_tensor_parallel_run_asks_for_thread_multiple() {
        let level = |args: &[&str]| Cli::try_parse_from([&["hpc-train"], args].concat()).unwrap().mpi_threading();
        assert_eq!(level(&["--model", "vit-tiny", "--tensor-parallel", "2", "--device", "cpu"]), mpi::Threading::Funneled);
        assert_eq!(level(&["study", "--model", "vit-tiny", "--tensor-parallel", "2", "--device", "cpu", "--strategies", "ring"]), mpi::Threading::Funneled);
        assert_eq!(level(&["--model", "vit-tiny", "--tensor-parallel", "2", "--device", "cpu", "--strategy", "horovod"]), mpi::Threading::Multiple);
        // --zero 3's units compute on their own thread, which then calls the group's all-reduce.
        assert_eq!(level(&["--model", "vit-tiny", "--tensor-parallel", "2", "--device", "cpu", "--zero", "3"]), mpi::Threading::Multiple);
        assert_eq!(level(&["--model", "vit-tiny", "--device", "cpu", "--zero", "3"]), mpi::Threading::Funneled);
        let on_a_gpu = if tch::Cuda::is_available() { mpi::Threading::Multiple } else { mpi::Threading::Funneled };
        assert_eq!(level(&["--model", "vit-tiny", "--tensor-parallel", "2"]), on_a_gpu);
    }
}

/// Presets through the whole command line.
#[cfg(test)]
mod preset_tests {
    use clap::ValueEnum;

    use crate::exchange::options::Given;
    use crate::model::ModelKind;
    use crate::train::options::*;

    /// Parses a training command line as `hpc-train` does: the options given noted, the run
    /// file and the preset applied.
    fn resolved(extra: &[&str]) -> std::result::Result<TrainArgs, String> {
        let cli = super::Cli::parse_from_noting_given([&["hpc-train"], extra].concat()).map_err(|e| e.to_string())?;
        assert!(cli.command.is_none());
        Ok(cli.train)
    }

    #[test]
    fn a_preset_sets_what_the_command_line_leaves_and_given_options_win() {
        let a = resolved(&["--preset", "resnet50-throughput"]).unwrap();
        assert_eq!((a.model, a.data.to_str().unwrap(), a.batch_size, a.warmup_steps, a.measured_steps, a.no_eval), (ModelKind::Resnet50, "synthetic:3x224x224:1000", 64, 10, Some(100), true));
        assert_eq!(a.total_steps(1), 110, "10 warm-up and 100 measured steps, whatever the epoch's length");
        let a = resolved(&["--preset", "resnet50-throughput", "--batch-size", "8", "--data", "x.h5", "--skip-steps", "3", "--model", "resnet18"]).unwrap();
        assert_eq!((a.model, a.data.to_str().unwrap(), a.batch_size, a.warmup_steps, a.measured_steps), (ModelKind::Resnet18, "x.h5", 8, 3, Some(100)));
        // A length given replaces the preset's, whichever it is.
        let a = resolved(&["--preset", "resnet50-throughput", "--steps", "7"]).unwrap();
        assert_eq!((a.measured_steps, a.total_steps(1000)), (None, 7));
        let a = resolved(&["--preset", "cpu-trial", "--epochs", "2"]).unwrap();
        assert_eq!((a.model, a.measured_steps, a.total_steps(30)), (ModelKind::Tiny, None, 60));
        let a = resolved(&["--preset", "cpu-trial", "--measured-steps", "3"]).unwrap();
        assert_eq!((a.warmup_steps, a.measured_steps, a.total_steps(30)), (5, Some(3), 8));
        // No preset: the program's own defaults, as before.
        let a = resolved(&[]).unwrap();
        assert_eq!((a.model, a.data.to_str().unwrap(), a.batch_size, a.epochs, a.measured_steps, a.no_eval), (ModelKind::Resnet50, "datasets/fashion-mnist.h5", 64, 5, None, false));
        assert_eq!(a.total_steps(938), 5 * 938);
    }

    #[test]
    fn measured_steps_with_another_length_is_refused_by_name() {
        for other in [["--steps", "5"], ["--epochs", "1"]] {
            let err = resolved(&["--measured-steps", "3", other[0], other[1]]).unwrap_err();
            assert!(err.contains("--measured-steps") && err.contains(other[0]) && err.contains("cannot be used with"), "{err}");
            // The same under a preset, whose own length is no conflict.
            let err = resolved(&["--preset", "cpu-trial", other[0], other[1], "--measured-steps", "3"]).unwrap_err();
            assert!(err.contains("--measured-steps") && err.contains(other[0]), "{err}");
        }
        assert!(resolved(&["--measured-steps", "0"]).unwrap_err().contains("--measured-steps"));
    }

    /// Every preset's table names flags of the command line with values that parse there (so
    /// that a preset could be written as a run file of the same keys), and sets each one.
    #[test]
    fn every_preset_names_options_of_the_command_line() {
        let command = crate::config::train_command();
        for preset in Preset::value_variants() {
            let mut argv = vec!["hpc-train".to_string()];
            for &(flag, value) in preset.options() {
                let arg = command.get_arguments().find(|a| a.get_long() == Some(flag)).unwrap_or_else(|| panic!("{} names --{flag}, no option", preset.name()));
                match arg.get_action().takes_values() {
                    true => argv.extend([format!("--{flag}"), value.to_string()]),
                    false => {
                        assert_eq!(value, "true", "a switch is set by naming it");
                        argv.push(format!("--{flag}"));
                    }
                }
            }
            let from_flags = resolved(&argv[1..].iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
            let from_preset = resolved(&["--preset", preset.name()]).unwrap();
            let plain = |a: TrainArgs| format!("{:?}", TrainArgs { given: Given::default(), preset: None, run_config: Default::default(), ..a });
            assert_eq!(plain(from_flags), plain(from_preset), "{}", preset.name());
        }
    }

    /// The step counts of the old defaults against the preset's at 1..64 ranks, as
    /// results/cluster-path/preset-steps.md tabulates them (printed with `--nocapture`).
    #[test]
    fn preset_step_table() {
        const FASHION_MNIST_TRAIN: usize = 60_000;
        let job_files = resolved(&["--batch-size", "256", "--epochs", "1"]).unwrap();
        let program = resolved(&[]).unwrap();
        let preset = resolved(&["--preset", "resnet50-throughput"]).unwrap();
        let synthetic = crate::data::source::IMAGENET_TRAIN_SAMPLES;
        println!("| ranks | job files' old default: steps / warm-up / measured | program's default (--epochs 5, batch 64) | --preset resnet50-throughput |");
        println!("|---:|---|---|---|");
        for ranks in [1usize, 2, 4, 8, 16, 32, 64] {
            let row = |c: StepCounts| format!("{} / {} / {}", c.total, c.warmup, c.measured);
            let (old, default, new) = (job_files.step_counts(FASHION_MNIST_TRAIN, ranks, 256), program.step_counts(FASHION_MNIST_TRAIN, ranks, 64), preset.step_counts(synthetic, ranks, 64));
            println!("| {ranks} | {} | {} | {} |", row(old), row(default), row(new));
            assert_eq!(new, StepCounts { total: 110, warmup: 10, measured: 100 }, "the preset measures the same at every rank count");
            if ranks == 16 {
                assert_eq!(old, StepCounts { total: 15, warmup: 5, measured: 10 });
            }
            if ranks == 64 {
                assert_eq!(old, StepCounts { total: 4, warmup: 3, measured: 1 }, "one measured step at 64 ranks");
            }
        }
    }
}

/// Run files through the whole command line (here, above crate::config, so that its tests
/// import no file above it).
#[cfg(test)]
mod run_file_tests {
    use std::ffi::OsString;
    use std::path::{Path, PathBuf};

    use super::Cli;
    use crate::config::*;
    use crate::train::options::TrainArgs;

    /// A file in a folder of this test process's own, removed with it.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("hpc-train-config-{}-{name}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn file(&self, name: &str, text: &str) -> String {
            let path = self.0.join(name);
            std::fs::write(&path, text).unwrap();
            path.to_str().unwrap().to_string()
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn parse(args: &[&str]) -> Result<TrainArgs, String> {
        let cli = Cli::parse_from_noting_given([&["hpc-train"], args].concat()).map_err(|e| e.to_string())?;
        Ok(cli.train)
    }

    /// The options themselves, without what notes where they came from.
    fn options(a: &TrainArgs) -> String {
        format!("{:?}", TrainArgs { given: Default::default(), run_config: Default::default(), config: None, print_config: false, ..a.clone() })
    }

    const FLAGS: &[&str] = &["--model", "tiny", "--data", "synthetic:3x16x16:10:256", "--batch-size", "4", "--steps", "3", "--no-eval", "--lr", "0.1", "--seed", "7", "--bucket-mb", "0.5", "--lr-steps", "1,2"];

    const FILE: &str = r#"
[data]
data = "synthetic:3x16x16:10:256"
batch_size = 4
steps = 3
no_eval = true

[model]
model = "tiny"
lr = 0.1
lr_steps = [1, 2]

[run]
seed = 7

[exchange]
bucket_mb = 0.5
"#;

    #[test]
    fn a_file_and_the_same_flags_give_the_same_options() {
        let dir = Scratch::new("same");
        let path = dir.file("run.toml", FILE);
        let from_flags = parse(FLAGS).unwrap();
        let from_file = parse(&["--config", &path]).unwrap();
        assert_eq!(options(&from_flags), options(&from_file));
        // The file's options count as given (the layout checks apply to them), as flags do.
        for id in ["model", "batch_size", "steps", "no_eval", "lr", "seed", "bucket_mb", "lr_steps"] {
            assert!(from_file.given.has(id), "{id}");
        }
        assert_eq!(from_flags.run_config.table, from_file.run_config.table);
    }

    #[test]
    fn the_command_line_wins_over_the_file_and_the_file_over_the_preset() {
        let dir = Scratch::new("precedence");
        let path = dir.file("run.toml", "preset = \"cpu-trial\"\n[data]\nbatch_size = 8\nno_eval = false\n");
        let a = parse(&["--config", &path]).unwrap();
        // The file's batch and evaluation, the preset's model and length.
        assert_eq!((a.batch_size, a.no_eval, a.model, a.measured_steps), (8, false, crate::model::ModelKind::Tiny, Some(20)));
        assert!(!a.given.has("model"), "a preset's option is a default, not given");
        let a = parse(&["--config", &path, "--batch-size", "2", "--steps", "3"]).unwrap();
        // A length on the command line replaces the preset's --measured-steps.
        assert_eq!((a.batch_size, a.steps, a.measured_steps), (2, Some(3), None));
        // A file's length gives way to the command line's where the two cannot go together.
        let path = dir.file("length.toml", "measured_steps = 4\n");
        let a = parse(&["--config", &path, "--steps", "3"]).unwrap();
        assert_eq!((a.steps, a.measured_steps), (Some(3), None));
    }

    #[test]
    fn print_config_reads_back_as_the_same_run() {
        let dir = Scratch::new("print");
        for args in [FLAGS, &["--preset", "cpu-trial", "--strategy", "horovod", "--timeline", "t.json", "--lr-schedule", "cosine"][..], &["--zero", "3", "--fsdp-unit", "stage", "--pipeline-stages", "1"][..]] {
            let first = parse(args).unwrap();
            let text = first.run_config.to_toml();
            let path = dir.file("printed.toml", &text);
            let again = parse(&["--config", &path]).unwrap();
            assert_eq!(options(&first), options(&again), "{args:?}");
            assert_eq!(again.run_config.to_toml(), text, "{args:?}: printed again, the same file");
            // Defaults in the file are not "given" (no check refuses them); the rest is.
            assert!(!again.given.has("checkpoint_every") && !again.given.has("epochs"), "{args:?}");
        }
        // Sections named after the help headings.
        let text = parse(FLAGS).unwrap().run_config.to_toml();
        for section in ["[data]", "[model]", "[exchange]", "[run]", "[checkpoint]", "[output]", "[pipeline]", "[ps]", "[sharding]"] {
            assert!(text.contains(section), "{section} in\n{text}");
        }
    }

    /// The record's `config` (JSON in runs.jsonl) is what --config reads; older records
    /// without `config` and `argv` still load.
    #[test]
    fn a_record_holds_a_run_file_and_old_records_load() {
        let dir = Scratch::new("record");
        let first = parse(FLAGS).unwrap();
        let rerun = crate::results::Rerun { config: Some(first.run_config.to_json()), argv: vec!["hpc-train".into(), "--steps".into(), "3".into()] };
        let line = serde_json::to_string(&rerun).unwrap();
        let back: crate::results::Rerun = serde_json::from_str(&line).unwrap();
        let text = toml::to_string(&back.config.unwrap()).unwrap();
        let path = dir.file("record.toml", &text);
        assert_eq!(options(&parse(&["--config", &path]).unwrap()), options(&first));
        assert_eq!(back.argv, rerun.argv);
        let old: crate::results::Rerun = serde_json::from_str(r#"{"strategy": "ring"}"#).unwrap();
        assert_eq!(old, crate::results::Rerun::default());
    }

    #[test]
    fn a_bad_file_is_refused_in_one_line_naming_the_key_and_the_file() {
        let dir = Scratch::new("bad");
        let cases: &[(&str, &str)] = &[
            ("[data]\nbatch_sise = 4\n", "unknown key `batch_sise` in [data]"),
            ("[data]\nbatch_size = \"four\"\n", "key `batch_size` = \"four\": invalid value 'four' for '--batch-size"),
            ("[data]\nbatch_size = 0\n", "key `batch_size` = 0"),
            ("no_eval = 1\n", "key `no_eval` = 1: expected true or false"),
            ("model = \"resnet-49\"\n", "key `model` = \"resnet-49\": invalid value"),
            ("seed = [1, 2]\n", "key `seed` = [1, 2]: expected one value, not a list"),
            ("steps = 3\nmeasured_steps = 4\n", "keys `measured_steps` and `steps` cannot be used together"),
            ("config = \"other.toml\"\n", "key `config`: a run file cannot name another run file"),
            ("[data.more]\nsteps = 3\n", "[data.more]: sections are one level deep"),
            ("steps = 3\n[data]\nsteps = 4\n", "key `steps` sets --steps a second time"),
            ("steps = \n", "not TOML"),
        ];
        for (text, expected) in cases {
            let path = dir.file("bad.toml", text);
            let err = parse(&["--config", &path]).unwrap_err();
            assert!(err.contains(&format!("--config {path}: ")) && err.contains(expected), "{text:?}: {err}");
            assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        }
        assert!(parse(&["--config", "/nonexistent/run.toml"]).unwrap_err().contains("--config /nonexistent/run.toml: "));
    }

    /// A layout's refusal of an option (the checks run after parsing, from plan/compat.rs and
    /// the strategies' tables) names the key and the file when the file set it.
    #[test]
    fn a_refusal_of_a_files_option_names_the_key_and_the_file() {
        let dir = Scratch::new("refusal");
        let path = dir.file("run.toml", "[horovod]\ntimeline = \"t.json\"\n");
        let a = parse(&["--config", &path]).unwrap();
        let err = a.check_unused_options(&[a.strategy]).unwrap_err().to_string();
        let said = a.run_config.attribute(&err);
        assert!(said.starts_with("--timeline is an option of --strategy horovod") && said.ends_with(&format!("(key `timeline` of {path})")), "{said}");
        // Given on the command line, the message is the flag's, as before.
        let a = parse(&["--config", &path, "--timeline", "u.json"]).unwrap();
        let err = a.check_unused_options(&[a.strategy]).unwrap_err().to_string();
        assert_eq!(a.run_config.attribute(&err), err);
    }

    /// jobs/configs/ holds the presets as run files (and ViT-B/16 with tensor parallelism): each
    /// reads, passes the option checks, and is the run its flags make.
    #[test]
    fn the_golden_run_files_are_the_runs_they_name() {
        let golden: &[(&str, &[&str])] = &[
            ("resnet50-throughput", &["--preset", "resnet50-throughput"]),
            ("cpu-study", &["--preset", "cpu-trial", "--device", "cpu"]),
            ("vit-b16-tp", &["--model", "vit-b16", "--data", "synthetic:3x224x224:1000", "--tensor-parallel", "4", "--batch-size", "32", "--skip-steps", "10", "--measured-steps", "50", "--no-eval", "--precision", "bf16"]),
        ];
        for (name, flags) in golden {
            let path = format!("{}/jobs/configs/{name}.toml", env!("CARGO_MANIFEST_DIR"));
            let from_file = parse(&["--config", &path]).unwrap_or_else(|e| panic!("{name}: {e}"));
            from_file.check_unused_options(&[from_file.strategy]).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(options(&from_file), options(&parse(flags).unwrap()), "{name}");
        }
    }

    /// `study --config` gives the file's options to every point, the study's command line winning.
    #[test]
    fn study_takes_the_run_file() {
        let dir = Scratch::new("study");
        let path = dir.file("run.toml", FILE);
        let cli = Cli::parse_from_noting_given(["hpc-train", "study", "--config", &path, "--ranks", "1,2", "--batch-size", "2", "--study", "s1"]).unwrap();
        let Some(crate::cli::Command::Study(study)) = cli.command else { panic!("a study") };
        let a = study.train;
        assert_eq!((study.ranks.as_str(), a.study_tag.as_deref(), a.batch_size), ("1,2", Some("s1"), 2));
        assert_eq!(options(&TrainArgs { batch_size: 4, study_tag: None, ..a }), options(&parse(FLAGS).unwrap()));
        // A study's own option is not a run file's.
        let path = dir.file("study.toml", "ranks = \"1,2\"\n");
        let err = Cli::parse_from_noting_given(["hpc-train", "study", "--config", &path]).unwrap_err().to_string();
        assert!(err.contains("unknown key `ranks`"), "{err}");
    }

    #[test]
    fn old_names_work_and_the_deprecated_one_warns() {
        let a = parse(&["--warmup-steps", "3", "--study-tag", "t", "--bucket-mb", "2", "--segment-kb", "8", "--strategy", "horovod", "--fusion-threshold-mb", "4", "--timeline-filename", "t.json", "--hierarchical-allreduce"]).unwrap();
        assert_eq!((a.warmup_steps, a.study_tag.as_deref(), a.exchange.bucket_mb, a.exchange.segment_kb), (3, Some("t"), 2.0, 8));
        assert_eq!((a.horovod.fusion_threshold_mb, a.horovod.timeline.as_deref(), a.horovod.hierarchical), (Some(4.0), Some(Path::new("t.json")), Some(true)));
        let argv: Vec<OsString> = ["hpc-train", "--warmup-steps=3", "--skip-steps", "2", "--bucket-mb", "1"].iter().map(OsString::from).collect();
        let warnings = deprecated_names(&argv);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("--warmup-steps is deprecated: use --skip-steps"), "{warnings:?}");
        let dir = Scratch::new("deprecated");
        let path = dir.file("old.toml", "warmup_steps = 3\n");
        let a = parse(&["--config", &path]).unwrap();
        assert_eq!(a.warmup_steps, 3);
        assert!(a.run_config.warnings[0].contains("key `warmup_steps` is deprecated: use `skip_steps`"), "{:?}", a.run_config.warnings);
    }
}

/// Training command lines that are refused before any step, as `hpc-train` parses and checks
/// them (`Cli::parse_from_noting_given`, then the options no part of the run reads, which main
/// checks before the run starts): each refusal's own message, one per check. tests/bad_input.rs
/// launches one of each kind to show how the refused job ends on every rank.
#[cfg(test)]
mod refusal_tests {
    use super::Cli;

    /// clap's refusal of `extra`, or the first of the run's own checks; None: accepted.
    fn refusal(extra: &[&str]) -> Option<String> {
        let argv = [&["hpc-train", "--data", "d.h5"][..], extra].concat();
        match Cli::parse_from_noting_given(argv) {
            Err(e) => Some(e.to_string()),
            Ok(cli) => cli.train.check_unused_options(&[cli.train.strategy]).err().map(|e| e.to_string()),
        }
    }

    fn refused(extra: &[&str], message: &str) {
        let said = refusal(extra).unwrap_or_else(|| panic!("{extra:?} was accepted"));
        assert!(said.contains(message), "{extra:?}: expected {message:?} in {said:?}");
    }

    #[test]
    fn values_the_parser_does_not_take_are_usage_errors() {
        assert_eq!(refusal(&["--batch-size", "1", "--strategy", "allreduce", "--profile-steps", "1"]), None);
        refused(&["--batch-size", "0"], "invalid value '0' for '--batch-size");
        refused(&["--strategy", "butterfly"], "invalid value 'butterfly' for '--strategy");
        refused(&["--model", "vgg"], "invalid value 'vgg' for '--model");
        refused(&["--profile-steps", "0"], "invalid value '0' for '--profile-steps");
        refused(&["--zero", "4"], "invalid value '4' for '--zero");
    }

    /// Out-of-range SGD settings exited 0 with test losses of 1e10; NaN ended in an unnamed
    /// "non-finite loss"; values beyond f32 too, naming no flag (issue 48).
    #[test]
    fn sgd_settings_out_of_range_are_refused_naming_the_flag() {
        assert_eq!(refusal(&["--momentum", "0.9", "--weight-decay", "0.001", "--lr", "0.1"]), None);
        refused(&["--momentum", "1.5"], "--momentum 1.5: expected 0 <= momentum < 1");
        refused(&["--momentum", "NaN"], "--momentum NaN: expected 0 <= momentum < 1");
        refused(&["--weight-decay=-100"], "--weight-decay -100: expected a finite weight decay of 0 or more");
        refused(&["--lr", "1e39"], "--lr 1e39: beyond the largest f32");
        refused(&["--weight-decay", "1e300"], "--weight-decay 1e300: beyond the largest f32");
    }

    /// Options that the chosen strategy never reads were silently ignored (`--timeline` with
    /// ring wrote nothing).
    #[test]
    fn options_the_strategy_does_not_read_are_refused() {
        assert_eq!(refusal(&["--strategy", "horovod", "--timeline", "t.json", "--compression", "fp16"]), None);
        refused(&["--strategy", "ring", "--timeline", "t.json"], "--timeline is an option of --strategy horovod; --strategy ring writes nothing");
        refused(&["--strategy", "ring", "--compression", "fp16"], "--compression is an option of --strategy horovod; --strategy ring would ignore it");
        refused(&["--strategy", "ps", "--max-staleness", "3", "--ps-colocate"], "--max-staleness bounds asynchronous parameter servers");
    }
}
