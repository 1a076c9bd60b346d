//! hpc-train: data-parallel training over MPI, and the scaling studies of its gradient-exchange
//! strategies. This file parses the command line, initialises MPI once, and dispatches.

#![deny(unsafe_op_in_unsafe_fn)]

use std::io::Write;

mod bench;
mod checkpoint;
mod cli;
mod config;
mod conform;
mod cost;
mod data;
mod element;
mod error;
mod exchange;
mod faults;
mod layouts;
mod model;
mod mpi_library;
mod optim;
mod overlap;
mod plan;
mod progress;
mod project;
mod raw;
mod report;
mod results;
mod study;
mod topology;
mod train;
mod watchdog;

use cli::{Cli, Command};
use data::command::DataCommand;
use error::Error;
use topology::World;

/// The longest that the ranks of an agreed error wait for each other before they exit (see
/// its use). Every rank normally arrives within milliseconds, so the limit costs nothing
/// then; it only bounds the wait for a rank that never comes. It is long because a rank that
/// gives up too soon ends the job (mpirun kills the others) before a printing rank that was
/// descheduled on a crowded node has written its line.
const REPORTED_ERROR_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// What a rank that does not print pauses before it exits, where it has no barrier to meet the
/// printing rank in (a launcher of another MPI makes each process a world of its own).
const REPORTED_ERROR_PAUSE: std::time::Duration = std::time::Duration::from_millis(500);

fn main() {
    raw::keep_freed_memory();
    // No arguments: what to type, not a five-epoch ResNet-50 run.
    if std::env::args_os().len() == 1 {
        if mpi_library::launcher_rank() == 0 {
            eprint!("{}", cli::short_usage());
        }
        raw::exit_process(2);
    }
    let parsed = Cli::parse_noting_given();
    // SIGTERM and SIGUSR1 have been held since before main (raw::process says why). Training and
    // studies turn them into a stop request, from MPI's start-up on, since one during start-up
    // is a stop request like one during training, not the death of the rank; every other
    // command gets their default action back, and one that came meanwhile ends it now.
    match &parsed {
        Ok(cli) if matches!(cli.command, None | Some(Command::Study(_))) => train::catch_stop_signals(),
        _ => raw::release_stop_signals(),
    }
    let cli = match parsed {
        Ok(cli) => cli,
        // The MPI libraries hpc-train was built against and runs with; no launcher needed.
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayVersion => {
            print!("{}", mpi_library::version_text());
            raw::exit_process(0);
        }
        Err(e) => exit_after_parse_error(e),
    };
    // Renamed options: the old name works, and says what replaced it, once.
    if mpi_library::launcher_rank() == 0 {
        let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
        let from_file = cli.train_args().map(|t| t.run_config.warnings.clone()).unwrap_or_default();
        for warning in config::deprecated_names(&argv).into_iter().chain(from_file) {
            let _ = std::io::stderr().write_all(format!("warning: {warning}\n").as_bytes());
        }
    }
    // --print-config: the resolved options (command line, run file, preset), before anything
    // starts; printed once under a launcher of several processes.
    if let Some(train) = cli.train_args().filter(|t| t.print_config) {
        // A run file that a run would refuse is refused here, as the run would, naming the key.
        if let Err(e) = train::check_combination(train) {
            if mpi_library::launcher_rank() == 0 {
                print_error(format_args!("{}", attribute(&cli, e.to_string())));
            }
            raw::exit_process(2);
        }
        if mpi_library::launcher_rank() == 0 {
            print!("{}", train.run_config.to_toml());
        }
        raw::exit_process(0);
    }
    // A command that rank 0 carries out alone needs no MPI where nothing launched other
    // processes: Open MPI's start-up of a lone process (a singleton, which forks its own daemon)
    // took 0.7 s of `hpc-train compat`'s 1.6 s, and tests and scripts call these commands often.
    // Where a launcher started several, MPI starts so that only rank 0 works (below): each of
    // `srun -n 8`'s tasks wrote the same report when only Open MPI's and PMI's variables counted.
    if mpi_library::launched_processes() == 1 {
        if let Some(work) = serial_work(&cli.command) {
            init_logging(0);
            install_panic_hook(0, 1);
            let code = match work() {
                Ok(()) => 0,
                Err(e) => {
                    print_error(format_args!("{e}"));
                    1
                }
            };
            raw::exit_process(code);
        }
    }
    faults::stall_before_start_up();
    // Each command asks for the thread level it needs: MPI_THREAD_MULTIPLE makes every call take
    // a lock in some libraries (MPICH's global lock, UCX's multi-thread mode), so only the
    // commands that run a communication thread ask for it (and check what they got).
    let start_up = watchdog::watch_start_up(cli.start_up_timeout());
    let Some((universe, _threading)) = mpi::initialize_with_threading(cli.mpi_threading()) else {
        print_error(format_args!("MPI was already initialised"));
        raw::exit_process(1);
    };
    drop(start_up);
    let world = match mpi_library::check_launch(&universe.world()).and_then(|()| World::new(universe.world())) {
        Ok(w) => w,
        Err(e) => exit_once_reported(Some(universe), || print_error(format_args!("{e}")), 1),
    };
    let rank = world.rank;
    init_logging(world.rank);
    install_panic_hook(world.rank, world.size);

    let result = match &cli.command {
        None => {
            // A study's point (the job files tag them) measures the CPU's matmul peak for its
            // record's MFU; an untagged run does not spend the 0.2 s.
            let core_gflops = cli.train.study_tag.as_ref().and_then(|_| study::measure_core_gflops(&world));
            let context = train::RunContext { study: cli.train.study_tag.clone(), core_gflops, repeat: cli.train.repeat_index };
            world
                .agree(cli.train.check_unused_options(&[cli.train.strategy]))
                .map(|warnings| world.log_warnings(&warnings))
                .and_then(|()| train::run(&world, &cli.train, &context).map(|_| ()))
        }
        Some(Command::Study(args)) => study::run(&world, args),
        Some(Command::Bench(args)) => bench::run(&world, args),
        // Every rank reads its shard.
        Some(Command::Data(DataCommand::Bench(args))) => data::bench::run(&world, args),
        Some(Command::Checkpoint(cmd)) => checkpoint::command::run(&world, cmd),
        Some(Command::Conform(args)) => conform::run(&world, args),
        // Serial: rank 0 does the work, the others wait for its verdict.
        Some(_) => {
            let work = serial_work(&cli.command).expect("every collective command has its arm above");
            let local = if world.is_root() { work() } else { Ok(()) };
            world.agree(local)
        }
    };

    let code = match result {
        Ok(()) => 0,
        // A run stopped by a signal: rank 0 said where and what was saved.
        Err(Error::Stopped { checkpointed }) => stopped_code(checkpointed),
        Err(Error::Agreed(e)) if matches!(*e, Error::Stopped { .. }) => match *e {
            Error::Stopped { checkpointed } => stopped_code(checkpointed),
            _ => unreachable!("matched above"),
        },
        // Another rank prints the error these ranks agreed on. Exiting at once, a rank that
        // does not print ended the job under Open MPI (mpirun kills the others when one exits
        // non-zero) before the one that does had written its line: a fault of --zero 3 ended
        // with no message in 1 of about 20 runs. So every rank of an agreed error meets in a
        // barrier, the printing one once its line is out, and exits after it. The barrier gives
        // up after REPORTED_ERROR_GRACE (a fixed pause of 0.5 s before): a rank that
        // never comes has ended the job another way.
        Err(Error::Reported(rank)) => {
            log::debug!("exiting after the error reported by rank {rank}");
            world.sleeping_barrier_within(Some(REPORTED_ERROR_GRACE));
            1
        }
        Err(Error::Agreed(e)) if matches!(*e, Error::Reported(_)) => {
            world.sleeping_barrier_within(Some(REPORTED_ERROR_GRACE));
            1
        }
        Err(Error::Agreed(e)) => {
            print_error(format_args!("{}", attribute(&cli, e.to_string())));
            let _ = std::io::stderr().flush();
            world.sleeping_barrier_within(Some(REPORTED_ERROR_GRACE));
            1
        }
        Err(e) => {
            // Only this rank knows: the others may be blocked in communication with it.
            print_error(format_args!("rank {} of {}: {}", world.rank, world.size, attribute(&cli, e.to_string())));
            let _ = std::io::stderr().flush();
            if world.size > 1 {
                raw::abort_world(1);
            }
            1
        }
    };
    drop(world);
    // MPI_Finalize under a thread still inside MPI is erroneous: the strategies join their
    // threads when dropped, and one that could not be joined ends the job instead.
    let running = exchange::comm_thread::running();
    if running > 0 {
        print_error(format_args!("rank {rank}: {running} communication thread(s) still inside MPI; aborting instead of finalizing"));
        raw::abort_world(code.max(1));
    }
    drop(universe); // MPI_Finalize
    raw::exit_process(code);
}

/// The work of a command that rank 0 carries out alone, the other ranks waiting for its
/// verdict (the data commands but `data bench`, the model fit, projections, reports and the
/// compatibility table); None for a collective command.
fn serial_work(command: &Option<Command>) -> Option<Box<dyn FnOnce() -> error::Result<()> + '_>> {
    match command.as_ref()? {
        Command::Data(DataCommand::Bench(_)) => None,
        Command::Data(cmd) => Some(Box::new(move || data::command::run(cmd))),
        Command::Model(cli::ModelCommand::Fit(args)) => Some(Box::new(move || project::fit(args))),
        Command::Project(args) => Some(Box::new(move || project::project(args))),
        Command::Report(args) => Some(Box::new(move || report::run(args))),
        Command::Compat(args) => Some(Box::new(move || {
            print!("{}", if args.tsv { plan::compat::tsv() } else { plan::compat::markdown() });
            Ok(())
        })),
        Command::Study(_) | Command::Bench(_) | Command::Checkpoint(_) | Command::Conform(_) => None,
    }
}

/// Reports a command line that does not parse from one rank, and exits with clap's status on
/// every rank. Help (on stdout, status 0) prints on every rank, as it did. An error starts MPI
/// under a launcher of several processes, only for [`exit_once_reported`]'s barrier: CI lost
/// `bench --rounds 0`'s message when the rank that does not print exited at once.
fn exit_after_parse_error(e: clap::Error) -> ! {
    if !e.use_stderr() {
        let _ = e.print();
        raw::exit_process(e.exit_code());
    }
    let universe = if mpi_library::launched_processes() > 1 {
        let _start_up = watchdog::watch_start_up(std::time::Duration::from_secs_f64(exchange::options::DEFAULT_EXCHANGE_TIMEOUT_S));
        mpi::initialize()
    } else {
        None
    };
    exit_once_reported(universe, || drop(e.print()), e.exit_code())
}

/// Exits every rank with `code` after an error found before the run's [`World`] exists, which
/// launcher rank 0 alone prints (`print`). A rank that exited at once ended the job under Open
/// MPI (mpirun kills the others when one exits non-zero) before rank 0 had written its line.
/// So the ranks meet in the agreed error's barrier, rank 0 once its line is out; where a
/// launcher of another MPI made each process a world of its own, the ranks that do not print
/// pause instead, having no one to meet.
fn exit_once_reported(universe: Option<mpi::environment::Universe>, print: impl FnOnce(), code: i32) -> ! {
    if mpi_library::launcher_rank() == 0 {
        print();
        let _ = std::io::stderr().flush();
    }
    if let Some(universe) = universe {
        let world = universe.world();
        if mpi::traits::Communicator::size(&world) > 1 {
            topology::sleeping_barrier_within(&world, Some(REPORTED_ERROR_GRACE));
        } else if mpi_library::launcher_rank() != 0 {
            std::thread::sleep(REPORTED_ERROR_PAUSE);
        }
        drop(universe); // MPI_Finalize
    }
    raw::exit_process(code);
}

/// An error's message with the run file named where it is about an option the file set.
fn attribute(cli: &Cli, message: String) -> String {
    cli.train_args().map_or(message.clone(), |train| train.run_config.attribute(&message))
}

/// The exit status of a run stopped by a signal before its last step: `EXIT_STOPPED` when a
/// checkpoint holds the step where it stopped (a job script may requeue it with --resume), 1
/// when nothing was saved.
fn stopped_code(checkpointed: bool) -> i32 {
    if checkpointed { train::EXIT_STOPPED } else { 1 }
}

/// Rank 0 logs at info level, the others warnings and errors only; RUST_LOG overrides both.
fn init_logging(rank: i32) {
    let default = if rank == 0 { "info" } else { "warn" };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(default))
        .format(move |buf, record| {
            writeln!(buf, "[{} rank {rank} {}] {}", chrono::Utc::now().format("%H:%M:%S"), record.level(), record.args())
        })
        .init();
}

/// Prints `error: <message>` to stderr with one write. Rust's stderr is unbuffered, so
/// `eprintln!` writes each piece of its format separately, and mpirun, forwarding several ranks'
/// stderr at once, would interleave two ranks' messages mid-line.
fn print_error(message: std::fmt::Arguments) {
    let line = format!("error: {message}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// A panic on one rank would leave the others blocked in communication: log it with the rank
/// and end the whole job.
fn install_panic_hook(rank: i32, size: i32) {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        print_error(format_args!("rank {rank} of {size} panicked"));
        default(info);
        if size > 1 {
            raw::abort_world(101);
        }
    }));
}
