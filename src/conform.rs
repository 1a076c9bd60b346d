//! `hpc-train conform` (hidden, for tests/conformance.rs): many short training runs inside one
//! launch, each on the first ranks of the world as a study's points are, so that the walk of
//! the compatibility table (plan/compat.rs: every supported pair must train to the plain run's
//! weights, every refused pair must be refused naming both options) costs one MPI start-up
//! instead of hundreds.
//!
//! Each line of `--cases` is a rank count and the options of one run (whitespace-separated, no
//! quoting: the test writes paths without spaces). Rank 0 writes one line per case to
//! `--report`: the case's index, then `ok`, or `refused` and the message the run printed, or
//! `failed on rank R` where an error was not agreed by every rank. An error that only one rank
//! meets ends the launch as it ends a run.

use std::path::PathBuf;

use clap::{Args, FromArgMatches, Parser};
use mpi::topology::Color;
use mpi::traits::*;

use crate::error::{Error, Result};
use crate::exchange::options::Given;
use crate::topology::World;
use crate::train::options::TrainArgs;
use crate::train::{self, RunContext};

/// Options of `hpc-train conform`.
#[derive(Args, Debug, Clone)]
pub struct ConformArgs {
    /// One run per line: the rank count, then the run's training options.
    #[arg(long)]
    pub cases: PathBuf,
    /// Where rank 0 writes each case's outcome (index, ok / refused MESSAGE / failed on rank R).
    #[arg(long)]
    pub report: PathBuf,
}

/// A case's options, parsed as `hpc-train [OPTIONS]` parses a training run's.
#[derive(Parser)]
struct CaseLine {
    #[command(flatten)]
    train: TrainArgs,
}

/// The cases of `text`: (ranks, options). Refuses a line that does not parse, naming it.
fn parse_cases(text: &str, world_size: usize) -> Result<Vec<(usize, TrainArgs)>> {
    let mut cases = Vec::new();
    for (number, line) in text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let ranks: usize = words
            .next()
            .and_then(|r| r.parse().ok())
            .filter(|&r| r >= 1 && r <= world_size)
            .ok_or_else(|| Error::usage(format!("--cases line {number}: expected a rank count from 1 to {world_size} first")))?;
        let argv = std::iter::once("hpc-train").chain(words);
        let matches = <CaseLine as clap::CommandFactory>::command()
            .try_get_matches_from(argv)
            .map_err(|e| Error::usage(format!("--cases line {number}: {}", e.to_string().lines().next().unwrap_or(""))))?;
        let mut case = CaseLine::from_arg_matches(&matches).map_err(|e| Error::usage(format!("--cases line {number}: {e}")))?;
        case.train.given = Given::from_matches(&matches);
        cases.push((ranks, case.train));
    }
    Ok(cases)
}

/// Runs every case in turn (collective over `world`).
pub fn run(world: &World, args: &ConformArgs) -> Result<()> {
    let text = world.agree(std::fs::read_to_string(&args.cases).map_err(|e| Error::io(&args.cases, e)))?;
    let cases = world.agree(parse_cases(&text, world.size as usize))?;
    let context = RunContext { study: Some("conform".into()), ..Default::default() };
    let mut report = String::new();
    for (index, (ranks, train)) in cases.iter().enumerate() {
        let inside = (world.rank as usize) < *ranks;
        // Collective over the world: every rank comes from the sleeping barrier below.
        let sub = world.comm.split_by_color(if inside { Color::with_value(0) } else { Color::undefined() });
        let line = match sub {
            Some(comm) => {
                let case_world = World::new(comm)?;
                let outcome = case_world
                    .agree(train.check_unused_options(&[train.strategy]))
                    .and_then(|_warnings| train::run(&case_world, train, &context).map(|_| ()));
                match outcome {
                    Ok(()) => "ok".to_string(),
                    Err(Error::Agreed(e)) => format!("refused\t{e}"),
                    Err(Error::Reported(rank)) => format!("failed on rank {rank}"),
                    Err(e) => return Err(e),
                }
            }
            None => String::new(),
        };
        // The ranks outside the case wait for the next one asleep: most cases take 2 of the
        // launch's 8 ranks, and spinning the others took those 2 ranks' cores.
        world.sleeping_barrier();
        // Rank 0 is in every case: it holds the message of any error its case agreed on first.
        if world.is_root() {
            report.push_str(&format!("{index}\t{line}\n"));
        }
    }
    if world.is_root() {
        std::fs::write(&args.report, report).map_err(|e| Error::io(&args.report, e))?;
    }
    Ok(())
}
